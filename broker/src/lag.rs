//! What the broker owes each subscriber, so that the node hands on only as fast as subscribers
//! read (`reserve`), a subscriber that stops reading is cut off (`sweep`), and one that falls
//! behind a client's burst is cut off instead of losing messages without a word.
//!
//! rumqttd 0.20 keeps the recent messages of each subscribed filter in a log of
//! `segment_count` segments; a reader whose segment is dropped is moved forward silently
//! (`router/routing.rs:1510-1524` only logs), QoS 1 included. A segment can only be dropped
//! under a reader that is owed more than `(segment_count - 1) × segment_bytes` beyond the message
//! it is reading, so a subscriber owed that much is disconnected first: it reconnects and
//! resyncs, and never sees a gap. The message being read does not count, so one answer larger
//! than the log (a long pod list) does not cut off a reader that is keeping up.
//!
//! Counting errs on the side of owing more: a publish is counted when a guard (or our link)
//! hands it to the router, and paid off when rumqttd writes it to the subscriber, after the
//! router has moved its cursor.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::warn;

use crate::dollar::INTERNAL_PREFIX;
use crate::session::{Session, Written};

/// What rumqttd counts against a filter's log for one publish (`PublishData::size`).
pub fn log_size(topic: usize, payload: usize) -> usize {
    4 + topic + payload
}

/// Every subscription of a remote client, by filter.
#[derive(Debug)]
pub struct Lag {
    limit: u64,
    /// A subscriber owed something that has taken nothing for this long is cut off.
    stall: Duration,
    /// How many wait in [`Lag::room`]: deliveries wake them, and only then.
    waiting: AtomicUsize,
    room_made: Notify,
    /// Filters below these patterns have smaller logs (`broker.device_segment_bytes`), so their
    /// subscribers may be owed less: (pattern, limit).
    smaller: Vec<(String, u64)>,
    watched: RwLock<Watched>,
    cut: AtomicU64,
    /// Clients cut off whose next CONNECT must start a clean session: rumqttd would resume a
    /// persistent one at a cursor that is gone, skipping silently.
    to_clean: Mutex<HashSet<String>>,
    /// Filters a persistent session ever subscribed to: rumqttd keeps them (and queues for
    /// them) while the client is away, so they count as reaching their topics for good.
    kept: Mutex<HashSet<String>>,
    /// Shared subscriptions (`$share/<group>/<filter>`) by the filter they share, with how many
    /// hold each: not counted for lag (each member gets only some messages), but they are
    /// subscribers [`Lag::reaches`].
    shared: Mutex<HashMap<String, usize>>,
    /// Whether hand-ons that only clean-session subscriptions take are written by the front
    /// instead of going through rumqttd's logs ([`Route::Front`]).
    front: bool,
    /// Publishes the front has been given to write past rumqttd, one per subscriber.
    front_delivered: AtomicU64,
}

/// How a subscription's messages may reach its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Only through rumqttd (a persistent session, QoS 2, or no front).
    Router,
    /// Also written by the front, in MQTT 5 framing when `v5`.
    Front { v5: bool },
}

/// Where a paced hand-on goes, once counted against its subscribers' room.
#[derive(Debug)]
pub enum Route {
    /// Into rumqttd, which appends it to every matching filter's log.
    Router,
    /// Straight to these subscriptions' clients, by the front: every subscription the topic
    /// reaches is one whose client the front can write to (clean session, QoS 0 or 1).
    Front(Vec<Arc<Owed>>),
}

/// Pays a front-delivered message off once the front has written it.
#[derive(Debug)]
struct Paid {
    lag: std::sync::Weak<Lag>,
    owed: std::sync::Weak<Owed>,
}

impl Written for Paid {
    fn written(&self) {
        if let (Some(lag), Some(owed)) = (self.lag.upgrade(), self.owed.upgrade()) {
            lag.delivered(&owed);
        }
    }
}

/// Subscriptions by filter: filters without wildcards (one per device, typically) are found by
/// the topic itself, so a publish costs a lookup plus a scan of the wildcard filters only.
#[derive(Debug, Default)]
struct Watched {
    exact: HashMap<String, Filter>,
    wild: Vec<Filter>,
}

#[derive(Debug)]
struct Filter {
    filter: String,
    limit: u64,
    subscriptions: Vec<Arc<Owed>>,
}

impl Watched {
    fn is_wild(filter: &str) -> bool {
        filter.contains(['+', '#'])
    }

    fn get_mut(&mut self, filter: &str) -> Option<&mut Filter> {
        if Self::is_wild(filter) {
            self.wild.iter_mut().find(|w| w.filter == filter)
        } else {
            self.exact.get_mut(filter)
        }
    }

    fn insert(&mut self, entry: Filter) {
        if Self::is_wild(&entry.filter) {
            self.wild.push(entry);
        } else {
            self.exact.insert(entry.filter.clone(), entry);
        }
    }

    fn remove(&mut self, filter: &str) {
        if Self::is_wild(filter) {
            self.wild.retain(|w| w.filter != filter);
        } else {
            self.exact.remove(filter);
        }
    }

    /// The filters a publish to `topic` reaches.
    fn matching<'a>(&'a self, topic: &'a str) -> impl Iterator<Item = &'a Filter> {
        self.exact.get(topic).into_iter().chain(
            self.wild
                .iter()
                .filter(move |w| rumqttd::protocol::matches(topic, &w.filter)),
        )
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.exact
            .values()
            .chain(&self.wild)
            .map(|w| w.subscriptions.len())
            .sum()
    }
}

/// One subscription and what it is owed, in rumqttd's log bytes.
#[derive(Debug)]
pub struct Owed {
    filter: String,
    client_id: String,
    /// QoS 1/2: a burst from a client that would overrun the log cuts it off (QoS 0 may skip).
    reliable: bool,
    via: Via,
    unpaid: Mutex<Unpaid>,
    session: Arc<Session>,
}

/// The sizes of the messages not yet written to the subscriber, oldest first, their sum, and
/// when the subscriber last made progress (took a message, or started being owed).
#[derive(Debug, Default)]
struct Unpaid {
    bytes: u64,
    sizes: VecDeque<u32>,
    progress: Option<Instant>,
}

impl Owed {
    pub fn filter(&self) -> &str {
        &self.filter
    }

    /// Whether this is a QoS 1/2 subscription (rumqttd waits for its acknowledgements).
    pub fn is_reliable(&self) -> bool {
        self.reliable
    }

    /// Has the front write `topic` (clients' form) and `payload` to this subscriber; `lag` pays
    /// it off once written.
    pub fn deliver(self: &Arc<Self>, lag: &Arc<Lag>, topic: &str, payload: &[u8]) {
        let Via::Front { v5 } = self.via else { return };
        let paid = Arc::new(Paid {
            lag: Arc::downgrade(lag),
            owed: Arc::downgrade(self),
        });
        self.session
            .deliver(topic.as_bytes(), payload, self.reliable, v5, paid);
        lag.front_delivered.fetch_add(1, Ordering::Relaxed);
    }

    /// Everything owed, in log bytes.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// rumqttd wrote the oldest message owed to the subscriber.
    fn delivered(&self) {
        let mut unpaid = self.lock();
        if let Some(size) = unpaid.sizes.pop_front() {
            unpaid.bytes -= u64::from(size);
        }
        unpaid.progress = Some(Instant::now());
    }

    /// Counts a message of `size`; returns what is owed beyond the oldest unpaid message.
    fn owe(&self, size: usize) -> u64 {
        let mut unpaid = self.lock();
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        if unpaid.sizes.is_empty() {
            // The stall clock runs only while something is owed.
            unpaid.progress = Some(Instant::now());
        }
        unpaid.sizes.push_back(size);
        unpaid.bytes += u64::from(size);
        unpaid.bytes - unpaid.sizes.front().map_or(0, |s| u64::from(*s))
    }

    /// What would be owed beyond the oldest unpaid message with one more of `size`.
    fn owed_with(&self, size: usize) -> u64 {
        let unpaid = self.lock();
        let size = size as u64;
        unpaid.bytes + size - unpaid.sizes.front().map_or(size, |s| u64::from(*s))
    }

    /// Drops a count that rumqttd will never pay off.
    fn forgive(&self) {
        let mut unpaid = self.lock();
        unpaid.sizes.clear();
        unpaid.bytes = 0;
    }

    /// How long it has been owed something without taking anything.
    fn stalled_for(&self, now: Instant) -> Option<Duration> {
        let unpaid = self.lock();
        if unpaid.sizes.is_empty() {
            return None;
        }
        unpaid.progress.map(|p| now.saturating_duration_since(p))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Unpaid> {
        self.unpaid.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Lag {
    /// `limit`: the most a subscriber may be owed beyond the message it is reading,
    /// `(segment_count - 1) × segment_bytes`.
    pub fn new(limit: u64) -> Lag {
        Lag {
            limit,
            stall: Duration::from_secs(30),
            waiting: AtomicUsize::new(0),
            room_made: Notify::new(),
            smaller: Vec::new(),
            watched: RwLock::new(Watched::default()),
            cut: AtomicU64::new(0),
            to_clean: Mutex::new(HashSet::new()),
            kept: Mutex::new(HashSet::new()),
            shared: Mutex::new(HashMap::new()),
            front: false,
            front_delivered: AtomicU64::new(0),
        }
    }

    /// Hand-ons that only clean-session subscriptions take are written by the front.
    pub fn with_front_delivery(mut self, front: bool) -> Lag {
        self.front = front;
        self
    }

    /// A subscriber owed something that takes nothing for `stall` is cut off ([`Lag::sweep`]).
    pub fn with_stall(mut self, stall: Duration) -> Lag {
        self.stall = stall;
        self
    }

    /// Filters below `patterns` have logs that hold only `limit` beyond the message read.
    pub fn with_smaller_logs(mut self, patterns: &[&str], limit: u64) -> Lag {
        self.smaller
            .extend(patterns.iter().map(|p| ((*p).to_owned(), limit)));
        self
    }

    /// What a subscriber of `filter` may be owed: rumqttd sizes the filter's log the same way
    /// (`custom_segment`, matched as it matches them).
    fn limit_for(&self, filter: &str) -> u64 {
        self.smaller
            .iter()
            .find(|(pattern, _)| rumqttd::protocol::matches(filter, pattern))
            .map_or(self.limit, |(_, limit)| *limit)
    }

    /// Starts counting for a new subscription of `session` to `filter` (`reliable`: QoS 1/2).
    pub fn subscribe(
        &self,
        filter: &str,
        client_id: &str,
        session: &Arc<Session>,
        reliable: bool,
        via: Via,
    ) -> Arc<Owed> {
        let owed = Arc::new(Owed {
            filter: filter.to_owned(),
            client_id: client_id.to_owned(),
            reliable,
            via,
            unpaid: Mutex::new(Unpaid::default()),
            session: session.clone(),
        });
        let limit = self.limit_for(filter);
        let mut watched = self.watched.write().unwrap_or_else(|p| p.into_inner());
        match watched.get_mut(filter) {
            Some(w) => w.subscriptions.push(owed.clone()),
            None => watched.insert(Filter {
                filter: filter.to_owned(),
                limit,
                subscriptions: vec![owed.clone()],
            }),
        }
        owed
    }

    /// Stops counting for a subscription (unsubscribed, or its connection ended).
    pub fn unsubscribe(&self, owed: &Arc<Owed>) {
        let mut watched = self.watched.write().unwrap_or_else(|p| p.into_inner());
        let emptied = watched.get_mut(&owed.filter).is_some_and(|w| {
            w.subscriptions.retain(|s| !Arc::ptr_eq(s, owed));
            w.subscriptions.is_empty()
        });
        if emptied {
            watched.remove(&owed.filter);
        }
        drop(watched);
        self.made_room();
    }

    /// rumqttd wrote the oldest message `owed` to its subscriber.
    pub fn delivered(&self, owed: &Owed) {
        owed.delivered();
        self.made_room();
    }

    fn made_room(&self) {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.room_made.notify_waiters();
        }
    }

    /// Counts a publish to `topic` of `size` log bytes that the node hands on, if every
    /// subscriber it reaches has room for it in its filter's log, and says where it goes
    /// (`front`: it may skip rumqttd); `None` counts nothing. A message larger than the room
    /// goes once nothing else is owed.
    pub fn reserve(&self, topic: &str, size: usize, front: bool) -> Option<Route> {
        let watched = self.watched.read().unwrap_or_else(|p| p.into_inner());
        let room = watched.matching(topic).all(|w| {
            w.subscriptions
                .iter()
                .all(|owed| owed.session.is_cut() || owed.owed_with(size) <= w.limit)
        });
        if !room {
            return None;
        }
        let internal = topic.starts_with(INTERNAL_PREFIX);
        // Counted and sorted in one pass: `live` holds the subscriptions the front writes to,
        // until one turns out to need rumqttd.
        let mut router = !(front && self.front);
        let mut live: Vec<Arc<Owed>> = Vec::new();
        for w in watched.matching(topic) {
            // rumqttd hands `$hw`/`$ke` topics to filters that start with a wildcard and the
            // guard withholds them (withhold.rs): such a subscriber never gets the message.
            router |= internal && w.filter.starts_with(['+', '#']);
            for owed in w.subscriptions.iter().filter(|o| !o.session.is_cut()) {
                owed.owe(size);
                router |= owed.via == Via::Router;
                if !router {
                    live.push(owed.clone());
                }
            }
        }
        drop(watched);
        if router || live.is_empty() || self.shared_reaches(topic) || self.kept_reaches(topic) {
            return Some(Route::Router);
        }
        Some(Route::Front(live))
    }

    /// Waits until a subscriber took something, was cut off or left, or `at_most` passed.
    pub async fn room(&self, at_most: Duration) {
        let made = self.room_made.notified();
        tokio::pin!(made);
        made.as_mut().enable();
        // Counted down however the wait ends, a cancelled one included.
        struct Waiting<'a>(&'a AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.waiting);
        let _ = tokio::time::timeout(at_most, made).await;
    }

    /// Cuts off every subscriber owed something that took nothing for the stall time while the
    /// front waited to write to it (a stopped reader); a count nothing was waiting on is
    /// dropped instead. Returns how many changed. Run about every second.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let watched = self.watched.read().unwrap_or_else(|p| p.into_inner());
        let mut cut = 0;
        for w in watched.exact.values().chain(&watched.wild) {
            for owed in &w.subscriptions {
                if owed.session.is_cut() {
                    continue;
                }
                let Some(stalled) = owed.stalled_for(now) else {
                    continue;
                };
                if stalled < self.stall {
                    continue;
                }
                if owed.session.stopped_for() >= self.stall / 2 {
                    self.cut_off(owed, owed.bytes(), w.limit, "stopped reading");
                    cut += 1;
                } else {
                    // The client takes all it is sent, and rumqttd sent nothing more for the
                    // stall time: what the count says is owed never reached this subscriber.
                    owed.forgive();
                    cut += 1;
                }
            }
        }
        drop(watched);
        if cut > 0 {
            self.made_room();
        }
        cut
    }

    fn cut_off(&self, owed: &Owed, owed_bytes: u64, limit: u64, reason: &'static str) {
        owed.session.cut();
        self.clean_set().insert(owed.client_id.clone());
        let cut = self.cut.fetch_add(1, Ordering::Relaxed) + 1;
        warn!(
            error_code = "EM-BROKER-SUBSCRIBER-LAG",
            client_id = %owed.client_id,
            filter = %owed.filter,
            owed_bytes,
            limit_bytes = limit,
            stall_s = self.stall.as_secs(),
            reason,
            cut,
            "subscriber disconnected: it must resubscribe and resync"
        );
    }

    /// A publish to `topic` of `size` log bytes that nobody paced (a client's) is on its way
    /// into the router. A QoS 1/2 subscriber it puts beyond its filter's log is cut off: rumqttd
    /// would skip messages under it.
    pub fn published(&self, topic: &str, size: usize) {
        let watched = self.watched.read().unwrap_or_else(|p| p.into_inner());
        for w in watched.matching(topic) {
            for owed in &w.subscriptions {
                if owed.session.is_cut() {
                    continue;
                }
                let beyond = owed.owe(size);
                if beyond > w.limit && owed.reliable {
                    self.cut_off(owed, beyond, w.limit, "fell behind a burst beyond its log");
                }
            }
        }
    }

    /// Whether a publish to `topic` reaches any client's subscription, shared ones included.
    pub fn reaches(&self, topic: &str) -> bool {
        let watched = self.watched.read().unwrap_or_else(|p| p.into_inner());
        if watched.matching(topic).any(|w| !w.subscriptions.is_empty()) {
            return true;
        }
        drop(watched);
        self.shared_reaches(topic)
    }

    /// A persistent session subscribed to `filter`.
    pub fn keep(&self, filter: &str) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if !kept.contains(filter) {
            kept.insert(filter.to_owned());
        }
    }

    /// [`Lag::reaches`], or a persistent session, connected or not, subscribed to `topic`:
    /// whether a client's publish there must go through rumqttd.
    pub fn reaches_any_session(&self, topic: &str) -> bool {
        self.reaches(topic) || self.kept_reaches(topic)
    }

    /// Whether a persistent session, connected or not, ever subscribed to a filter of `topic`:
    /// rumqttd queues for it while it is away, so only rumqttd may carry the message.
    fn kept_reaches(&self, topic: &str) -> bool {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let reached = kept
            .iter()
            .any(|filter| rumqttd::protocol::matches(topic, filter));
        reached
    }

    fn shared_reaches(&self, topic: &str) -> bool {
        let shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        let reached = shared
            .keys()
            .any(|filter| rumqttd::protocol::matches(topic, filter));
        reached
    }

    /// A client holds a shared subscription to `filter` (the part after `$share/<group>/`).
    pub fn share(&self, filter: &str) {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        *shared.entry(filter.to_owned()).or_default() += 1;
    }

    /// A shared subscription to `filter` ended (unsubscribed, or its connection ended).
    pub fn unshare(&self, filter: &str) {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = shared.get_mut(filter) {
            *count -= 1;
            if *count == 0 {
                shared.remove(filter);
            }
        }
    }

    /// Whether `client_id` was cut off since it last connected (then it must start clean, and its
    /// CONNACK says no session is present, so it resubscribes and resyncs).
    pub fn take_cut_client(&self, client_id: &str) -> bool {
        self.clean_set().remove(client_id)
    }

    fn clean_set(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.to_clean.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Subscribers cut off so far for falling behind.
    pub fn cut_count(&self) -> u64 {
        self.cut.load(Ordering::Relaxed)
    }

    /// Publishes handed to the front to write past rumqttd so far, one per subscriber.
    pub fn front_delivered(&self) -> u64 {
        self.front_delivered.load(Ordering::Relaxed)
    }

    /// Subscriptions being counted.
    #[cfg(test)]
    pub fn watched(&self) -> usize {
        let watched = self.watched.read().unwrap_or_else(|p| p.into_inner());
        watched.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Sessions;
    use std::time::Duration;

    #[test]
    fn a_subscriber_owed_more_than_the_limit_is_cut_once() {
        let lag = Lag::new(1_000);
        let sessions = Sessions::default();
        let slow = sessions.open();
        let fast = sessions.open();
        let slow_sub = lag.subscribe("ke/edged/#", "edged", &slow, true, Via::Router);
        let fast_sub = lag.subscribe("ke/edged/#", "mirror", &fast, true, Via::Router);
        for _ in 0..10 {
            lag.published("ke/edged/edgecontroller/insert/default/pod", 96);
            lag.delivered(&fast_sub);
        }
        assert_eq!((slow_sub.bytes(), fast_sub.bytes()), (960, 0));
        assert!(!slow.is_cut());
        lag.published("ke/meta/edged/insert/default/pod", 500); // another filter
        lag.published("ke/edged/edgecontroller/insert/default/pod", 96);
        assert!(!slow.is_cut(), "owed 960 beyond the message being read");
        lag.published("ke/edged/edgecontroller/insert/default/pod", 96);
        assert!(slow.is_cut(), "owed 1056 beyond the message being read");
        assert!(!fast.is_cut());
        lag.published("ke/edged/edgecontroller/insert/default/pod", 96);
        assert_eq!(lag.cut_count(), 1, "counted once");
        assert!(
            lag.take_cut_client("edged"),
            "its next session starts clean"
        );
        assert!(!lag.take_cut_client("edged"), "only the next one");
        assert!(!lag.take_cut_client("mirror"));
    }

    #[test]
    fn one_message_larger_than_the_log_does_not_cut_a_reader_that_keeps_up() {
        let lag = Lag::new(1_000);
        let sessions = Sessions::default();
        let session = sessions.open();
        let owed = lag.subscribe("ke/edged/#", "edged", &session, true, Via::Router);
        lag.published("ke/edged/meta/response/default/pod", 50_000);
        assert!(!session.is_cut());
        lag.delivered(&owed);
        lag.published("ke/edged/meta/response/default/pod", 50_000);
        lag.published("ke/edged/edgecontroller/insert/default/pod", 96);
        assert!(!session.is_cut(), "96 bytes beyond the list being read");
        lag.published("ke/edged/meta/response/default/pod", 50_000);
        assert!(session.is_cut(), "a second list behind the first");
    }

    #[test]
    fn filters_with_smaller_logs_cut_sooner_and_exact_filters_are_found_by_topic() {
        let lag = Lag::new(1_000).with_smaller_logs(&["dev/#"], 100);
        let sessions = Sessions::default();
        let (device, module) = (sessions.open(), sessions.open());
        let _d = lag.subscribe("dev/d1/result", "mapper", &device, true, Via::Router);
        let _m = lag.subscribe("ke/edged/#", "edged", &module, true, Via::Router);
        for _ in 0..3 {
            lag.published("dev/d1/result", 60);
            lag.published("ke/edged/x", 60);
        }
        assert!(device.is_cut(), "owed 120 beyond the first, limit 100");
        assert!(!module.is_cut(), "owed 120 beyond the first, limit 1000");
        lag.published("dev/d2/result", 60);
        assert_eq!(lag.watched(), 2);
    }

    #[test]
    fn reserve_counts_only_when_every_subscriber_has_room() {
        let lag = Lag::new(1_000);
        let sessions = Sessions::default();
        let (quick, reliable) = (sessions.open(), sessions.open());
        let q = lag.subscribe("ke/edged/#", "q0", &quick, false, Via::Router);
        let _r = lag.subscribe("ke/edged/#", "q1", &reliable, true, Via::Router);
        assert!(lag.reserve("ke/edged/x", 600, false).is_some());
        assert!(
            lag.reserve("ke/edged/x", 600, false).is_some(),
            "600 beyond the one being read"
        );
        assert!(
            lag.reserve("ke/edged/x", 600, false).is_none(),
            "1,200 beyond it"
        );
        assert_eq!(q.bytes(), 1_200, "a refused reservation counts nothing");
        lag.delivered(&q);
        assert!(
            lag.reserve("ke/edged/x", 600, false).is_none(),
            "the QoS 1 reader took nothing yet"
        );
        assert!(
            lag.reserve("elsewhere/x", 100_000, false).is_some(),
            "nobody reads it"
        );
    }

    #[test]
    fn hand_ons_only_clean_subscriptions_take_are_written_by_the_front() {
        let lag = Arc::new(Lag::new(1_000).with_front_delivery(true));
        let sessions = Sessions::default();
        let (mapper, other, persistent) = (sessions.open(), sessions.open(), sessions.open());
        let front = Via::Front { v5: false };
        let route = |topic: &str, may: bool| match lag.reserve(topic, 10, may) {
            Some(Route::Front(subscriptions)) => Some(subscriptions.len()),
            Some(Route::Router) => None,
            None => panic!("room"),
        };
        let exact = lag.subscribe("dev/d1/result", "m1", &mapper, true, front);
        assert_eq!(route("dev/d1/result", true), Some(1));
        assert_eq!(
            route("dev/d1/result", false),
            None,
            "the publisher keeps it"
        );
        assert_eq!(route("dev/d2/result", true), None, "nobody subscribes");
        let wild = lag.subscribe("dev/+/result", "m2", &other, true, front);
        assert_eq!(
            route("dev/d1/result", true),
            Some(2),
            "a wildcard of a clean session also takes it"
        );
        assert_eq!(route("dev/d2/result", true), Some(1), "the wildcard only");
        lag.unsubscribe(&wild);
        let all = lag.subscribe("#", "monitor", &other, true, front);
        assert_eq!(
            route("edgemeta$hw/events/device/d1/twin/update/result", true),
            None,
            "rumqttd's to withhold from a filter starting with a wildcard"
        );
        assert_eq!(route("ke/edged/x", true), Some(1));
        lag.unsubscribe(&all);
        let kept = lag.subscribe("dev/d1/result", "m3", &persistent, true, Via::Router);
        assert_eq!(
            route("dev/d1/result", true),
            None,
            "a persistent session takes it"
        );
        lag.unsubscribe(&kept);
        lag.share("dev/d1/result");
        assert_eq!(
            route("dev/d1/result", true),
            None,
            "a shared subscription takes it"
        );
        lag.unshare("dev/d1/result");
        let off = Lag::new(1_000);
        let _s = off.subscribe("dev/d1/result", "m1", &mapper, true, front);
        assert!(matches!(
            off.reserve("dev/d1/result", 10, true),
            Some(Route::Router)
        ));

        let owed_before = exact.bytes();
        let Some(Route::Front(subscriptions)) = lag.reserve("dev/d1/result", 10, true) else {
            panic!("front");
        };
        assert_eq!(exact.bytes(), owed_before + 10);
        subscriptions[0].deliver(&lag, "dev/d1/result", b"{}");
        let out = mapper.take_out();
        assert_eq!(out.bytes[0], 0x32, "a QoS 1 PUBLISH");
        out.done(&mapper);
        assert_eq!(exact.bytes(), owed_before, "paid once written");

        // A persistent session that subscribed once, now away: rumqttd queues for it.
        lag.keep("dev/+/result");
        assert_eq!(
            route("dev/d1/result", true),
            None,
            "a persistent session's filter, connected or not"
        );
    }

    #[test]
    fn the_sweep_cuts_a_stopped_reader_and_drops_a_count_nobody_waits_on() {
        let lag = Lag::new(1_000).with_stall(Duration::from_millis(40));
        let sessions = Sessions::default();
        let (stopped, idle) = (sessions.open(), sessions.open());
        let _s = lag.subscribe("f/#", "stopped", &stopped, true, Via::Router);
        let i = lag.subscribe("f/#", "idle", &idle, true, Via::Router);
        assert!(lag.reserve("f/x", 100, false).is_some());
        // The front has been waiting to write to one of them; the other takes all it is sent.
        stopped.writing();
        std::thread::sleep(Duration::from_millis(60)); // let the stall time pass
        assert_eq!(lag.sweep(), 2);
        assert!(stopped.is_cut());
        assert!(!idle.is_cut());
        assert_eq!(i.bytes(), 0, "a count rumqttd never pays off is dropped");
        assert_eq!(lag.cut_count(), 1);
        assert!(lag.take_cut_client("stopped"));
    }

    #[test]
    fn unsubscribing_stops_the_count() {
        let lag = Lag::new(100);
        let sessions = Sessions::default();
        let session = sessions.open();
        let owed = lag.subscribe("a/+", "c", &session, true, Via::Router);
        assert_eq!(lag.watched(), 1);
        lag.unsubscribe(&owed);
        assert_eq!(lag.watched(), 0);
        lag.published("a/b", 1_000);
        assert!(!session.is_cut());
    }

    #[test]
    fn shared_subscriptions_reach_their_topics_until_the_last_one_ends() {
        let lag = Lag::new(100);
        assert!(!lag.reaches("ke/cloud/meta/response/ns/pod"));
        lag.share("ke/cloud/#");
        lag.share("ke/cloud/#");
        assert!(lag.reaches("ke/cloud/meta/response/ns/pod"));
        assert!(!lag.reaches("ke/edged/x"));
        lag.unshare("ke/cloud/#");
        assert!(
            lag.reaches("ke/cloud/meta/response/ns/pod"),
            "one member is left"
        );
        lag.unshare("ke/cloud/#");
        assert!(!lag.reaches("ke/cloud/meta/response/ns/pod"));
        lag.published("ke/cloud/a", 1_000);
        assert_eq!(
            lag.watched(),
            0,
            "shared subscriptions are not counted for lag"
        );
    }
}
