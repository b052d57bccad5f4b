//! Sessions by client id, for the one path: a CONNECT starts a session or takes one over (MQTT
//! 5.0 §3.1.2.4 Clean Start), a disconnect keeps it for its Session Expiry Interval
//! (§3.1.2.11.2), wills wait out their Will Delay (§3.1.3.2.2), and an ended session is handed
//! back whole so the caller frees its subscriptions. No I/O and no clock of its own: the
//! sessions task passes `now` and asks what is due.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::index::SessionId;
use crate::mailbox::{Limits, Mailbox, Published};

/// A Will Message and its delay, held while its connection lives.
#[derive(Debug, Clone)]
pub struct Will {
    pub message: Arc<Published>,
    pub qos: u8,
    pub retain: bool,
    pub delay: Duration,
}

/// One session: what outlives a connection.
#[derive(Debug)]
pub struct Session {
    pub id: SessionId,
    /// The filters it subscribed to, to free them from the index when it ends.
    pub filters: Vec<String>,
    pub mailbox: Arc<Mutex<Mailbox>>,
    /// QoS 2 packet ids received from its client and not yet released by a PUBREL: state of
    /// the session, not the connection, so a resend with DUP after a reconnect is not
    /// delivered twice (§4.3.3, [MQTT-4.3.3-10]). Only the connection holding the session
    /// uses it.
    pub awaiting_release: Arc<Mutex<HashSet<u16>>>,
    /// How long it is kept after its connection ends; `Duration::MAX` for "never expires".
    pub expiry: Duration,
    /// The connection that holds it, numbered so a late disconnect of a replaced one is ignored.
    connection: Option<u64>,
    /// When it ends if nobody takes it over; an earlier entry in the timer is then stale.
    expires_at: Option<Instant>,
}

/// What a CONNECT gets.
#[derive(Debug)]
pub struct Connected {
    pub session: SessionId,
    pub connection: u64,
    /// CONNACK's Session Present (§3.2.2.1.1).
    pub session_present: bool,
    pub mailbox: Arc<Mutex<Mailbox>>,
    /// The session's QoS 2 packet ids awaiting PUBREL.
    pub awaiting_release: Arc<Mutex<HashSet<u16>>>,
    /// The connection this one replaced, to be closed (§3.1.4-3, Session Takeover), whether
    /// it resumed the session or Clean Start discarded it.
    pub took_over: Option<u64>,
    /// A session Clean Start discarded, for the caller to free.
    pub discarded: Option<Session>,
}

/// Everything that ends or fires at some time, so one timer serves them all.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Due {
    Expiry(Arc<str>),
    Will(Arc<str>, u64),
}

/// Sessions by client id, with the expiries and delayed wills that wait on a clock.
#[derive(Debug)]
pub struct Registry {
    sessions: HashMap<Arc<str>, Session>,
    wills: HashMap<(Arc<str>, u64), Will>,
    due: BTreeMap<(Instant, u64), Due>,
    last_id: u64,
    /// Sessions kept with no connection, and how many may be: past the bound the one that would
    /// expire first ends early, so clients that come and go cannot grow the node without limit.
    away: usize,
    max_away: usize,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry::new(usize::MAX)
    }
}

/// What came due: wills to publish and sessions to free.
#[derive(Debug, Default)]
pub struct Fired {
    pub wills: Vec<Will>,
    pub ended: Vec<Session>,
}

impl Registry {
    /// A registry that keeps at most `max_away` sessions whose client is away.
    pub fn new(max_away: usize) -> Registry {
        Registry {
            sessions: HashMap::new(),
            wills: HashMap::new(),
            due: BTreeMap::new(),
            last_id: 0,
            away: 0,
            max_away,
        }
    }

    /// A CONNECT for `client_id`. Clean Start discards any session it had; otherwise the session
    /// is resumed, and a connection holding it is taken over. Either way a will that was still
    /// waiting for its delay is cancelled (§3.1.3.2.2).
    pub fn connect(
        &mut self,
        client_id: &str,
        clean_start: bool,
        expiry: Duration,
        limits: Limits,
    ) -> Connected {
        self.wills.retain(|(client, _), _| &**client != client_id);
        let connection = self.next_number();
        let mut discarded = None;
        let mut replaced = None;
        if clean_start {
            discarded = self.sessions.remove(client_id);
            match discarded.as_ref().map(|s| s.connection) {
                Some(None) => self.away -= 1,
                Some(Some(held)) => replaced = Some(held),
                None => {}
            }
        }
        let (key, present) = match self.sessions.get_key_value(client_id) {
            Some((key, _)) => (key.clone(), true),
            None => (Arc::<str>::from(client_id), false),
        };
        if !present {
            let id = self.next_number();
            self.sessions.insert(
                key.clone(),
                Session {
                    id,
                    filters: Vec::new(),
                    mailbox: Arc::new(Mutex::new(Mailbox::new(limits))),
                    awaiting_release: Arc::default(),
                    expiry,
                    connection: None,
                    expires_at: None,
                },
            );
        }
        let session = self
            .sessions
            .get_mut(&key)
            .expect("the session was found or inserted above");
        session.expiry = expiry;
        session.expires_at = None;
        let took_over = session.connection.replace(connection);
        if present && took_over.is_none() {
            self.away -= 1;
        }
        Connected {
            session: session.id,
            connection,
            session_present: present,
            mailbox: session.mailbox.clone(),
            awaiting_release: session.awaiting_release.clone(),
            took_over: took_over.or(replaced),
            discarded,
        }
    }

    /// The connection `connection` of `client_id` ended. `will` is its Will unless it sent a
    /// normal DISCONNECT (§3.1.2.5); `expiry` is the interval then in force (a DISCONNECT may
    /// change it, §3.14.2.2.2). An expiry of zero ends the session now.
    pub fn disconnect(
        &mut self,
        client_id: &str,
        connection: u64,
        will: Option<Will>,
        expiry: Duration,
        now: Instant,
    ) -> Fired {
        let mut fired = Fired::default();
        let Some((key, session)) = self.sessions.get_key_value(client_id) else {
            return fired;
        };
        if session.connection != Some(connection) {
            // A replaced connection: its successor holds the session. Its will is published as
            // any will is (§3.1.4-3), which for a delayed one means never: the session already
            // has a new connection (§3.1.3.2.2).
            fired.wills.extend(will.filter(|w| w.delay.is_zero()));
            return fired;
        }
        let key = key.clone();
        if let Some(will) = will {
            if will.delay.is_zero() || expiry.is_zero() {
                fired.wills.push(will);
            } else {
                self.schedule(now + will.delay, Due::Will(key.clone(), connection));
                self.wills.insert((key.clone(), connection), will);
            }
        }
        if expiry.is_zero() {
            if let Some(session) = self.sessions.remove(&key) {
                fired.ended.push(session);
            }
            fired.wills.extend(self.take_wills(&key));
            return fired;
        }
        let expires_at = now.checked_add(expiry);
        if let Some(session) = self.sessions.get_mut(&key) {
            session.connection = None;
            session.expiry = expiry;
            session.expires_at = expires_at;
            self.away += 1;
        }
        if let Some(at) = expires_at {
            self.schedule(at, Due::Expiry(key));
        }
        if self.away > self.max_away {
            self.end_soonest(&mut fired);
        }
        fired
    }

    /// Records a subscription's filter with its session, to be freed with it.
    /// The session `client_id` holds, if any.
    pub fn session_of(&self, client_id: &str) -> Option<SessionId> {
        self.sessions.get(client_id).map(|s| s.id)
    }

    pub fn subscribed(&mut self, client_id: &str, filter: &str) {
        if let Some(session) = self.sessions.get_mut(client_id) {
            if !session.filters.iter().any(|f| f == filter) {
                session.filters.push(filter.to_owned());
            }
        }
    }

    pub fn unsubscribed(&mut self, client_id: &str, filter: &str) {
        if let Some(session) = self.sessions.get_mut(client_id) {
            session.filters.retain(|f| f != filter);
        }
    }

    /// Wills whose delay passed and sessions whose expiry passed by `now`; a session that ends
    /// takes its waiting will with it, published now (§3.1.3.2.2: whichever happens first).
    pub fn fire(&mut self, now: Instant) -> Fired {
        let mut fired = Fired::default();
        while let Some(entry) = self.due.first_entry() {
            if entry.key().0 > now {
                break;
            }
            match entry.remove() {
                Due::Will(client, connection) => {
                    fired.wills.extend(self.wills.remove(&(client, connection)));
                }
                Due::Expiry(client) => {
                    let still_away = self
                        .sessions
                        .get(&client)
                        .is_some_and(|s| s.expires_at.is_some_and(|at| at <= now));
                    if still_away {
                        self.end(&client, &mut fired);
                    }
                }
            }
        }
        fired
    }

    /// When `fire` next has something to do.
    pub fn next_due(&self) -> Option<Instant> {
        self.due.keys().next().map(|(at, _)| *at)
    }

    /// Sessions held, connected or not: the `edgemeta_broker_sessions` metric.
    pub fn len(&self) -> usize {
        self.sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
    }

    /// Ends an away session now, with its waiting will.
    fn end(&mut self, client: &Arc<str>, fired: &mut Fired) {
        if let Some(session) = self.sessions.remove(client) {
            self.away -= 1;
            fired.ended.push(session);
        }
        fired.wills.extend(self.take_wills(client));
    }

    /// Past the bound: the away session that would expire first ends now, logged by the caller
    /// as any ended session is freed. Sessions that never expire go last, oldest first.
    fn end_soonest(&mut self, fired: &mut Fired) {
        let soonest = self
            .sessions
            .iter()
            .filter(|(_, s)| s.connection.is_none())
            .min_by_key(|(_, s)| (s.expires_at.is_none(), s.expires_at, s.id))
            .map(|(client, _)| client.clone());
        if let Some(client) = soonest {
            tracing::warn!(error_code = "EM-BROKER-SESSIONS-FULL", %client,
                max = self.max_away, "a kept session ended early: too many clients away");
            self.end(&client, fired);
        }
    }

    fn take_wills(&mut self, client: &Arc<str>) -> Vec<Will> {
        let keys: Vec<_> = self
            .wills
            .keys()
            .filter(|(c, _)| c == client)
            .cloned()
            .collect();
        keys.into_iter()
            .filter_map(|k| self.wills.remove(&k))
            .collect()
    }

    fn schedule(&mut self, at: Instant, due: Due) {
        let tie = self.next_number();
        self.due.insert((at, tie), due);
    }

    fn next_number(&mut self) -> u64 {
        self.last_id += 1;
        self.last_id
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    const LIMITS: Limits = Limits {
        receive_maximum: 10,
        maximum_packet_size: None,
        topic_alias_maximum: 0,
        queue_bytes: 1 << 20,
    };

    fn will(delay: u64) -> Will {
        Will {
            message: Arc::new(Published {
                topic: "clients/gone".into(),
                payload: Bytes::from_static(b"bye"),
                received: Instant::now(),
                expiry: None,
                properties: None,
            }),
            qos: 1,
            retain: false,
            delay: Duration::from_secs(delay),
        }
    }

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn a_clean_start_takes_over_the_connection_of_the_session_it_discards() {
        let mut registry = Registry::default();
        let first = registry.connect("dev", false, MIN, LIMITS);
        let second = registry.connect("dev", true, MIN, LIMITS);
        assert_eq!(second.took_over, Some(first.connection));
        assert!(!second.session_present);
        assert_eq!(second.discarded.map(|s| s.id), Some(first.session));
    }

    #[test]
    fn qos_2_ids_awaiting_release_outlive_the_connection_with_the_session() {
        let mut registry = Registry::default();
        let first = registry.connect("dev", false, MIN, LIMITS);
        first.awaiting_release.lock().unwrap().insert(7);
        registry.disconnect("dev", first.connection, None, MIN, Instant::now());
        let again = registry.connect("dev", false, MIN, LIMITS);
        assert!(again.awaiting_release.lock().unwrap().contains(&7));
        let fresh = registry.connect("dev", true, MIN, LIMITS);
        assert!(fresh.awaiting_release.lock().unwrap().is_empty());
    }

    #[test]
    fn a_session_is_kept_until_its_expiry_then_ended_whole() {
        let mut registry = Registry::default();
        let now = Instant::now();
        let first = registry.connect("dev", false, MIN, LIMITS);
        registry.subscribed("dev", "cmd/dev");
        assert!(registry
            .disconnect("dev", first.connection, None, MIN, now)
            .ended
            .is_empty());
        assert!(registry
            .fire(now + Duration::from_secs(59))
            .ended
            .is_empty());
        let again = registry.connect("dev", false, MIN, LIMITS);
        assert!(again.session_present);
        assert_eq!(again.session, first.session);
        registry.disconnect(
            "dev",
            again.connection,
            None,
            MIN,
            now + Duration::from_secs(30),
        );
        assert!(
            registry
                .fire(now + Duration::from_secs(60))
                .ended
                .is_empty(),
            "the newer expiry holds"
        );
        let fired = registry.fire(now + Duration::from_secs(90));
        assert_eq!(fired.ended.len(), 1);
        assert_eq!(fired.ended[0].filters, ["cmd/dev"]);
        assert!(registry.is_empty());
        assert!(!registry.connect("dev", false, MIN, LIMITS).session_present);
    }

    #[test]
    fn clean_start_discards_the_old_session_but_a_new_expiry_still_keeps_the_new_one() {
        let mut registry = Registry::default();
        let now = Instant::now();
        let first = registry.connect("dev", true, MIN, LIMITS);
        registry.subscribed("dev", "cmd/dev");
        registry.disconnect("dev", first.connection, None, MIN, now);
        let second = registry.connect("dev", true, MIN, LIMITS);
        assert!(!second.session_present);
        assert_eq!(
            second.discarded.expect("the old session").filters,
            ["cmd/dev"]
        );
        registry.disconnect("dev", second.connection, None, MIN, now);
        assert!(
            registry.connect("dev", false, MIN, LIMITS).session_present,
            "kept while away"
        );
    }

    #[test]
    fn expiry_zero_ends_the_session_at_disconnect() {
        let mut registry = Registry::default();
        let c = registry.connect("dev", false, Duration::ZERO, LIMITS);
        let fired = registry.disconnect("dev", c.connection, None, Duration::ZERO, Instant::now());
        assert_eq!(fired.ended.len(), 1);
        assert!(registry.is_empty() && registry.next_due().is_none());
    }

    #[test]
    fn a_takeover_keeps_the_session_and_sends_only_an_undelayed_will_of_the_old_connection() {
        let mut registry = Registry::default();
        let now = Instant::now();
        let old = registry.connect("dev", false, MIN, LIMITS);
        let new = registry.connect("dev", false, MIN, LIMITS);
        assert_eq!(new.took_over, Some(old.connection));
        let fired = registry.disconnect("dev", old.connection, Some(will(5)), MIN, now);
        assert!(
            fired.wills.is_empty() && fired.ended.is_empty(),
            "a delayed will is not sent"
        );
        assert!(registry.next_due().is_none(), "the session is still held");
        let fired = registry.disconnect("dev", old.connection, Some(will(0)), MIN, now);
        assert_eq!(
            (fired.wills.len(), fired.ended.len()),
            (1, 0),
            "an undelayed one is"
        );
    }

    #[test]
    fn a_will_waits_its_delay_and_a_reconnect_cancels_it() {
        let mut registry = Registry::default();
        let now = Instant::now();
        let c = registry.connect("dev", false, MIN, LIMITS);
        registry.disconnect("dev", c.connection, Some(will(10)), MIN, now);
        assert!(registry.fire(now + Duration::from_secs(9)).wills.is_empty());
        assert_eq!(registry.fire(now + Duration::from_secs(10)).wills.len(), 1);

        let c = registry.connect("dev", false, MIN, LIMITS);
        registry.disconnect("dev", c.connection, Some(will(10)), MIN, now);
        registry.connect("dev", false, MIN, LIMITS);
        assert!(registry
            .fire(now + Duration::from_secs(20))
            .wills
            .is_empty());
    }

    #[test]
    fn past_the_bound_on_sessions_away_the_one_expiring_first_ends() {
        let mut registry = Registry::new(2);
        let now = Instant::now();
        for (client, secs) in [("a", 300), ("b", 30), ("c", 600)] {
            let c = registry.connect(client, false, Duration::from_secs(secs), LIMITS);
            let fired =
                registry.disconnect(client, c.connection, None, Duration::from_secs(secs), now);
            if client == "c" {
                assert_eq!(fired.ended.len(), 1, "the third one away ends one");
            }
        }
        assert_eq!(registry.len(), 2);
        assert!(
            !registry.connect("b", false, MIN, LIMITS).session_present,
            "b expired first"
        );
        assert!(registry.connect("a", false, MIN, LIMITS).session_present);
    }

    #[test]
    fn a_session_that_ends_before_the_will_delay_sends_the_will_then() {
        let mut registry = Registry::default();
        let now = Instant::now();
        let c = registry.connect("dev", false, Duration::from_secs(5), LIMITS);
        registry.disconnect(
            "dev",
            c.connection,
            Some(will(30)),
            Duration::from_secs(5),
            now,
        );
        let fired = registry.fire(now + Duration::from_secs(5));
        assert_eq!((fired.ended.len(), fired.wills.len()), (1, 1));
        assert!(registry
            .fire(now + Duration::from_secs(30))
            .wills
            .is_empty());
    }
}
