//! The one path's shared state: sessions, subscriptions and retained messages, and the one
//! `publish` every client and in-process module calls. A publish routes through the index and
//! is pushed into each matching session's mailbox; a connected reader whose queue it filled is
//! returned, and the publisher waits for it ([`Hub::wait_for`]) until it has room or is cut off
//! for not taking what it holds (docs/protocol.md §6.10).
//!
//! # Lock order
//! No lock is held across an await. Where two are held at once they are taken in this order,
//! and never the other way: `registry` → `rooms` → one mailroom's `holder` or one `mailbox`;
//! a socket's [`Direct`] state → that session's `mailbox` or its released acknowledgements.
//! The index is taken alone; the links (read) only → a module's [`Take`], which takes only its
//! own lock and neither blocks nor publishes. No code holds two mailboxes at once.

// Session ids are looked up on every publish: foldhash, not SipHash.
use foldhash::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::ack::Ack;
use bytes::BytesMut;

use crate::direct::{Direct, Waiting};
use crate::index::{Delivery, Index, SessionId};
use crate::log_every::LogEvery;
use crate::mailbox::{Budget, Limits, Mailbox, Owed, Progress, Published};
use crate::message::Reserved;
use crate::registry::{Connected, Fired, Registry, Will};
use crate::retained::Retained;
use crate::wire::Wire;
use crate::Message;

/// Link session ids start here, above any the registry hands out.
const FIRST_LINK: SessionId = 1 << 62;

/// How long a paced publisher waits before it looks again, in case a wake-up was missed and
/// so a reader that stopped is judged soon after its window ends.
const RECHECK: Duration = Duration::from_millis(50);

/// Drops for sessions away are logged at most this often, each line with the count so far: a
/// publisher feeding an away session must not write a log line per message.
const AWAY_LOG_EVERY: Duration = Duration::from_secs(10);

/// A connected reader a publish filled: its room, the message's weight and QoS there.
pub type Behind = Vec<(Arc<Mailroom>, usize, u8)>;

/// Where a publish went, and what its publisher waits for.
#[derive(Debug)]
pub struct Routed {
    /// Messages for the node's modules that did not fit their inboxes ([`hand_to_links`]).
    pub links: ForLinks,
    /// Whether any session or module was reached.
    pub heard: bool,
    /// Connected readers whose queue it filled ([`Hub::wait_for`]).
    pub behind: Behind,
}

/// What a publish left for the node's own modules: the caller awaits it ([`hand_to_links`])
/// before it goes on, which is how a publisher waits for the MetaManager.
pub type ForLinks = Vec<Handing>;

/// What a [`Take`] left for the publisher's task to await before it goes on.
pub type Later = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A module that takes what reaches it on the publisher's own task, which spares a hand-off
/// to a task of its own. It must not block, nor publish (the hub's links are locked).
pub trait Take: Send + Sync {
    fn take(&self, message: Message) -> Taken;
}

/// What a [`Take`] did with a message.
pub enum Taken {
    /// Took it; nothing is left to do.
    Done,
    /// Took it; the publisher awaits this before it goes on.
    Later(Later),
    /// Gave it back, for the module's inbox.
    Back(Message),
}

/// One module's part of a publish that could not be done at once.
pub enum Handing {
    /// A message its inbox had no room for.
    Inbox(mpsc::Sender<Message>, Message),
    /// What its [`Take`] left to do (wait for room in its own queue, answer a refusal).
    Later(Later),
}

impl std::fmt::Debug for Handing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Handing::Inbox(_, message) => f.debug_tuple("Inbox").field(&message.topic).finish(),
            Handing::Later(_) => f.write_str("Later"),
        }
    }
}

/// A node module's way in: its inbox, and the [`Take`] that may take a message at once.
struct LinkEnd {
    inbox: mpsc::Sender<Message>,
    taker: Option<Arc<dyn Take>>,
}

impl std::fmt::Debug for LinkEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkEnd")
            .field("taker", &self.taker.is_some())
            .finish_non_exhaustive()
    }
}

/// A session's mailbox and the bell its connection task waits on.
#[derive(Debug)]
pub struct Mailroom {
    pub mailbox: Arc<Mutex<Mailbox>>,
    /// Its client's id, for the logs.
    client_id: Arc<str>,
    pub ready: Notify,
    /// The connection reading it now, cut off when it stops taking what it holds.
    holder: Mutex<Option<(u64, CancellationToken)>>,
    /// Set when it was cut off for lagging, so the connection says why.
    pub lagged: std::sync::atomic::AtomicBool,
    /// Its plain-TCP connection's socket, which a publisher writes to while the task idles.
    direct: Mutex<Option<Arc<Direct>>>,
    /// The hub's bell for paced publishers, for a write from outside the hub.
    room_made: Arc<Notify>,
}

impl Mailroom {
    /// Its reader took something from the queue now: publishers paced by it look again.
    pub fn taken(&self) {
        self.room_made.notify_waiters();
    }
}

impl Mailroom {
    /// A connection's socket publishers may write this mailbox into.
    pub fn plug(&self, direct: Arc<Direct>) {
        *lock(&self.direct) = Some(direct);
    }

    /// That socket is closing; a newer connection's stays.
    pub fn unplug(&self, direct: &Arc<Direct>) {
        let mut plugged = lock(&self.direct);
        if plugged.as_ref().is_some_and(|d| Arc::ptr_eq(d, direct)) {
            *plugged = None;
        }
    }

    /// Writes what its reader may take now from the publishing thread if the socket is free;
    /// else rings the connection's task. Inside [`Together`](crate::Together), once at its end.
    pub(crate) fn deliver(self: &Arc<Self>) {
        if crate::direct::later(self.clone()) {
            return;
        }
        crate::direct::send_one(&**self);
    }

    /// Connection `connection` stopped reading this mailbox (a newer one may hold it now).
    pub fn release(&self, connection: u64) {
        let mut holder = lock(&self.holder);
        if holder.as_ref().is_some_and(|(c, _)| *c == connection) {
            *holder = None;
        }
    }
}

impl Waiting for Mailroom {
    fn socket(&self) -> Option<Arc<Direct>> {
        lock(&self.direct).clone()
    }

    fn encode(&self, wire: Wire, max_out: Option<u32>, out: &mut BytesMut) -> Option<bool> {
        let mut mailbox = self.mailbox.lock().unwrap_or_else(PoisonError::into_inner);
        Some(crate::direct::drain(&mut mailbox, wire, max_out, out))
    }

    fn ring(&self) {
        self.ready.notify_one();
    }

    fn took(&self) {
        self.taken();
    }
}

/// The node-wide bounds of the one path.
#[derive(Clone, Copy, Debug)]
pub struct HubLimits {
    /// Bytes a session's queue holds (connected or not): its share of `queues_bytes`.
    pub queue_bytes: usize,
    /// Bytes all sessions' queues hold together; sessions that are away fill half at most.
    pub queues_bytes: usize,
    /// Bytes of retained messages kept in all.
    pub retained_bytes: usize,
    /// Sessions kept while their clients are away.
    pub max_away_sessions: usize,
    /// The window a reader that writers wait for has to take what it held when they began
    /// to wait; one that does not is cut off ([`Mailbox::progress`]).
    pub reader_stall: Duration,
}

/// Whether clients subscribe to the topics a caller asked about, valid for one generation of
/// the index: the store thread asks for every reply and device document it might build, and
/// matching the topic each time was 2 % of its instructions per stored message.
#[derive(Debug, Default)]
pub struct Heard {
    generation: u64,
    topics: HashMap<Box<str>, bool>,
    /// Bytes of the topics remembered.
    bytes: usize,
}

impl Heard {
    /// Topics remembered at most; past it the memory starts over (device topics name devices).
    const MAX_TOPICS: usize = 16_384;
    /// Topic bytes remembered at most: a reply's topic carries levels its sender chose, up to
    /// `max_topic_bytes` each (10,000 device topics take about 0.6 MiB).
    const MAX_BYTES: usize = 1 << 20;

    fn forget(&mut self) {
        self.topics.clear();
        self.bytes = 0;
    }

    /// Keeps `topic`'s answer, first forgetting the rest if it would not fit.
    fn keep(&mut self, topic: &str, reaches: bool) {
        if self.topics.len() >= Heard::MAX_TOPICS || self.bytes + topic.len() > Heard::MAX_BYTES {
            self.forget();
        }
        if topic.len() <= Heard::MAX_BYTES {
            self.bytes += topic.len();
            self.topics.insert(topic.into(), reaches);
        }
    }
}

/// Sessions, subscriptions and retained messages, each behind its own short lock, taken in
/// the order the module's documentation gives.
#[derive(Debug)]
pub struct Hub {
    pub limits: HubLimits,
    /// What every session's queue counts against.
    pub budget: Arc<Budget>,
    registry: Mutex<Registry>,
    index: RwLock<Index>,
    retained: Mutex<Retained>,
    rooms: Mutex<HashMap<SessionId, Arc<Mailroom>>>,
    /// Each live connection's token, so a take-over closes the connection it replaces.
    connections: Mutex<HashMap<u64, CancellationToken>>,
    /// Rung when an expiry or a delayed will may have come nearer.
    pub timers: Notify,
    /// The node's own modules: their session ids and ways in.
    links: RwLock<HashMap<SessionId, LinkEnd>>,
    next_link: AtomicU64,
    /// Connected readers cut off so far for not taking what they held.
    pub lag_cuts: AtomicU64,
    /// Messages dropped for sessions that are away, their queue or the budget full.
    pub away_drops: AtomicU64,
    /// Drops for sessions away are logged at most every [`AWAY_LOG_EVERY`].
    away_log: LogEvery,
    /// Rung when a connected reader took something from its queue, for paced publishers.
    pub room: Arc<Notify>,
}

/// Poisoning only follows a panic elsewhere; the state itself stays consistent per call.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Hub {
    pub fn new(limits: HubLimits) -> Hub {
        Hub {
            limits,
            budget: Budget::new(limits.queues_bytes),
            registry: Mutex::new(Registry::new(limits.max_away_sessions)),
            index: RwLock::new(Index::default()),
            retained: Mutex::new(Retained::new(limits.retained_bytes)),
            rooms: Mutex::new(HashMap::default()),
            connections: Mutex::new(HashMap::default()),
            timers: Notify::new(),
            links: RwLock::new(HashMap::default()),
            next_link: AtomicU64::new(FIRST_LINK),
            lag_cuts: AtomicU64::new(0),
            away_drops: AtomicU64::new(0),
            away_log: LogEvery::new(AWAY_LOG_EVERY),
            room: Arc::new(Notify::new()),
        }
    }

    /// The connected readers `topic` reaches, with the QoS each gets (the node's modules,
    /// sessions away and readers already cut off are not among them).
    fn readers(&self, topic: &str) -> Vec<(Arc<Mailroom>, u8)> {
        let deliveries = self
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .route(topic, None, 2, false);
        self.readers_of(&deliveries)
    }

    /// The connected readers among `deliveries`, as [`Hub::readers`].
    fn readers_of(&self, deliveries: &[Delivery]) -> Vec<(Arc<Mailroom>, u8)> {
        let rooms = lock(&self.rooms);
        deliveries
            .iter()
            .filter_map(|d| rooms.get(&d.session).map(|room| (room.clone(), d.qos)))
            .filter(|(room, _)| {
                !room.lagged.load(Ordering::Relaxed) && lock(&room.holder).is_some()
            })
            .collect()
    }

    /// The connected readers that have no room now for a message of `weight` bytes on
    /// `topic`: those a paced publisher waits for.
    pub fn blocking(&self, topic: &str, weight: usize) -> Behind {
        self.readers(topic)
            .into_iter()
            .filter(|(room, qos)| !lock(&room.mailbox).has_room(weight, *qos, false))
            .map(|(room, qos)| (room, weight, qos))
            .collect()
    }

    /// Promises room for a message of `weight` bytes that `from` publishes on `topic` at
    /// `qos` in every connected reader's queue if each has it now; None promises nothing.
    /// The route it found is the one [`Hub::publish_reserved`] takes, so a message is routed
    /// once and a shared group's turn taken once. One mailbox is locked at a time: a reader
    /// without room takes back the promises made before it.
    pub fn reserve(
        &self,
        from: Option<SessionId>,
        topic: &str,
        qos: u8,
        weight: usize,
    ) -> Option<Reserved> {
        let deliveries = self
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .route(topic, from, qos, false);
        let readers = self.readers_of(&deliveries);
        for (at, (room, qos)) in readers.iter().enumerate() {
            let mut mailbox = lock(&room.mailbox);
            if !mailbox.has_room(weight, *qos, false) {
                drop(mailbox);
                for (promised, _) in &readers[..at] {
                    lock(&promised.mailbox).unreserve(weight);
                }
                return None;
            }
            mailbox.reserve(weight);
        }
        Some(Reserved(deliveries))
    }

    /// Keeps in `behind` the readers a publisher still waits for: those with room now, cut
    /// off, or gone are let go; one that did not take what it held within
    /// [`HubLimits::reader_stall`] is cut off first ([`Mailbox::progress`]).
    pub fn judge(&self, behind: &mut Behind) {
        let now = Instant::now();
        behind.retain(|(room, weight, qos)| {
            if room.lagged.load(Ordering::Relaxed) || lock(&room.holder).is_none() {
                return false;
            }
            let progress =
                lock(&room.mailbox).progress(*weight, *qos, now, self.limits.reader_stall);
            match progress {
                Progress::Room => false,
                Progress::Behind => true,
                Progress::Stopped => {
                    self.cut_off(
                        room,
                        "stopped reading: took less than it held within the window",
                    );
                    false
                }
            }
        });
    }

    /// Waits until every reader in `behind` has room for what was published to it, or was
    /// cut off for not taking what it held (a publisher is paced by its readers, never the
    /// other way round); false when `cancel` fired first.
    pub async fn wait_for(&self, mut behind: Behind, cancel: &CancellationToken) -> bool {
        loop {
            // Registered before the look, so room made in between is not missed.
            let room = self.room.notified();
            self.judge(&mut behind);
            if behind.is_empty() {
                return true;
            }
            tokio::select! {
                () = cancel.cancelled() => return false,
                _ = tokio::time::timeout(RECHECK, room) => {}
            }
        }
    }

    /// Cuts off the reader of `room` (it resyncs when it comes back); nobody else waits for it.
    pub fn cut_off(&self, room: &Mailroom, reason: &'static str) {
        let Some((_, holder)) = lock(&room.holder).take() else {
            return;
        };
        room.lagged.store(true, Ordering::Relaxed);
        holder.cancel();
        let cut = self.lag_cuts.fetch_add(1, Ordering::Relaxed) + 1;
        warn!(
            error_code = "EM-BROKER-SUBSCRIBER-LAG",
            client_id = %room.client_id,
            reason,
            queue_bytes = self.limits.queue_bytes,
            window_ms = self.limits.reader_stall.as_millis() as u64,
            cut,
            "subscriber disconnected; it resyncs when it reconnects"
        );
    }

    /// Attaches a node module: what `filters` (client form) match goes to `inbox`.
    pub fn attach_link(
        &self,
        filters: &[String],
        inbox: mpsc::Sender<Message>,
    ) -> Result<SessionId, crate::index::FilterError> {
        let id = self.next_link.fetch_add(1, Ordering::Relaxed);
        let mut index = self.index.write().unwrap_or_else(PoisonError::into_inner);
        // No Local: a module never gets back what it published itself (the MetaManager's
        // broad `$hw/events/#` would otherwise take every result it hands on).
        let options = crate::index::Options {
            no_local: true,
            ..crate::index::Options::v4(2)
        };
        for filter in filters {
            index.subscribe(id, filter, options.clone())?;
        }
        drop(index);
        self.links
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, LinkEnd { inbox, taker: None });
        Ok(id)
    }

    /// Lets `taker` take what reaches the module `session` on the publisher's own task; its
    /// inbox gets only what the taker gives back.
    pub fn set_taker(&self, session: SessionId, taker: Arc<dyn Take>) {
        let mut links = self.links.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(end) = links.get_mut(&session) {
            end.taker = Some(taker);
        }
    }

    /// Whether a client (not one of the node's modules) subscribes to `topic` now.
    pub fn reaches_clients(&self, topic: &str) -> bool {
        self.index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .reaches(topic, |session| session < FIRST_LINK)
    }

    /// [`Hub::reaches_clients`], answered from `heard` while no subscription changed since.
    pub fn reaches_clients_heard(&self, topic: &str, heard: &mut Heard) -> bool {
        let index = self.index.read().unwrap_or_else(PoisonError::into_inner);
        if heard.generation != index.generation() {
            heard.forget();
            heard.generation = index.generation();
        }
        if let Some(&reaches) = heard.topics.get(topic) {
            return reaches;
        }
        let reaches = index.reaches(topic, |session| session < FIRST_LINK);
        heard.keep(topic, reaches);
        reaches
    }

    /// A CONNECT: the session it starts or resumes, with its mailroom; a connection it takes
    /// over is told to close.
    pub fn connect(
        &self,
        client_id: &str,
        clean_start: bool,
        expiry: Duration,
        limits: Limits,
        token: CancellationToken,
    ) -> (Connected, Arc<Mailroom>) {
        let mut registry = lock(&self.registry);
        // A session whose reader was cut off ends with the cut, even if the client is back
        // before its old connection finished closing: it must resync, never resume past a gap.
        let cut = registry.session_of(client_id).is_some_and(|id| {
            lock(&self.rooms)
                .get(&id)
                .is_some_and(|room| room.lagged.load(Ordering::Relaxed))
        });
        let connected = registry.connect(client_id, clean_start || cut, expiry, limits);
        drop(registry);
        connected
            .mailbox
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .join(&self.budget);
        if let Some(old) = connected.discarded.as_ref() {
            self.forget(old.id, &old.filters);
        }
        let mut connections = lock(&self.connections);
        if let Some(old) = connected.took_over.and_then(|c| connections.remove(&c)) {
            old.cancel();
        }
        connections.insert(connected.connection, token.clone());
        drop(connections);
        let room = lock(&self.rooms)
            .entry(connected.session)
            .or_insert_with(|| {
                Arc::new(Mailroom {
                    mailbox: connected.mailbox.clone(),
                    client_id: Arc::from(client_id),
                    ready: Notify::new(),
                    holder: Mutex::new(None),
                    lagged: std::sync::atomic::AtomicBool::new(false),
                    direct: Mutex::new(None),
                    room_made: self.room.clone(),
                })
            })
            .clone();
        room.lagged
            .store(false, std::sync::atomic::Ordering::Relaxed);
        *lock(&room.holder) = Some((connected.connection, token.clone()));
        (connected, room)
    }

    /// A connection ended; its will goes out now or after its delay, and a session with no
    /// expiry left is freed.
    pub fn disconnect(
        &self,
        client_id: &str,
        connection: u64,
        will: Option<Will>,
        expiry: Duration,
    ) {
        lock(&self.connections).remove(&connection);
        let fired =
            lock(&self.registry).disconnect(client_id, connection, will, expiry, Instant::now());
        self.settle(fired);
        self.timers.notify_one();
    }

    /// Runs what came due by now; returns when the next thing is due.
    pub fn fire(&self) -> Option<Instant> {
        let mut registry = lock(&self.registry);
        let fired = registry.fire(Instant::now());
        let next = registry.next_due();
        drop(registry);
        self.settle(fired);
        next
    }

    pub fn subscribe(
        &self,
        client_id: &str,
        session: SessionId,
        filter: &str,
        options: crate::index::Options,
    ) -> Result<bool, crate::index::FilterError> {
        let new = self
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .subscribe(session, filter, options)?;
        lock(&self.registry).subscribed(client_id, filter);
        Ok(new)
    }

    pub fn unsubscribe(&self, client_id: &str, session: SessionId, filter: &str) -> bool {
        lock(&self.registry).unsubscribed(client_id, filter);
        self.index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .unsubscribe(session, filter)
    }

    /// The retained messages a new subscription to `filter` gets, with their QoS.
    pub fn retained_for(&self, filter: &str) -> Vec<(Arc<Published>, u8)> {
        let (_, filter) = crate::index::split_shared(filter);
        lock(&self.retained).matching(filter).cloned().collect()
    }

    /// Routes a message to every matching session; `from` is the publishing session (for No
    /// Local), None for the node itself. A message a module consumes carries `ack`, dropped
    /// once the module is done with it; what a module's inbox has no room for, and the
    /// connected readers whose queue it filled, are returned for the publisher to wait for.
    #[must_use = "messages for the node's modules must be handed on, filled readers waited for"]
    pub fn publish(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        retain: bool,
        ack: Option<&Ack>,
    ) -> Routed {
        self.route(from, message, qos, Pacing::Asked { retain, ack })
    }

    /// [`Hub::publish`] of a message [`Hub::reserve`] promised room to.
    #[must_use = "messages for the node's modules must be handed on"]
    pub fn publish_reserved(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        reserved: Reserved,
    ) -> Routed {
        self.route(from, message, qos, Pacing::Promised(reserved.0))
    }

    fn route(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        pacing: Pacing<'_>,
    ) -> Routed {
        let _route = crate::stages::enter(crate::stages::Stage::Route);
        let (retain, ack, promised) = match pacing {
            Pacing::Asked { retain, ack } => (retain, ack, None),
            Pacing::Promised(deliveries) => (false, None, Some(deliveries)),
        };
        if retain && lock(&self.retained).set(message.clone(), qos).is_err() {
            warn!(error_code = "EM-BROKER-RETAINED-FULL", topic = %message.topic,
                "retained message not kept: the retained store is full");
        }
        let reserved = promised.is_some();
        let deliveries = match promised {
            Some(deliveries) => deliveries,
            None => self
                .index
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .route(&message.topic, from, qos, retain),
        };
        let mut routed = Routed {
            links: self.to_links(&deliveries, &message, ack),
            heard: !deliveries.is_empty(),
            behind: Behind::new(),
        };
        let rooms = lock(&self.rooms);
        // Written or rung once the rooms' lock is given back: a direct write is a syscall.
        let mut queued: Vec<Arc<Mailroom>> = Vec::new();
        for delivery in deliveries {
            let Some(room) = rooms.get(&delivery.session) else {
                continue;
            };
            if room.lagged.load(Ordering::Relaxed) {
                // Cut off, its session ends with the connection: nothing more is kept for it.
                continue;
            }
            let owed = Owed {
                message: message.clone(),
                qos: delivery.qos,
                retain: delivery.retain,
                subscription_ids: delivery.subscription_ids,
            };
            let weight = owed.weight();
            if reserved {
                lock(&room.mailbox).push_reserved(owed);
                queued.push(room.clone());
                continue;
            }
            let connected = lock(&room.holder).is_some();
            if connected {
                // A connected reader gets it whatever its room; the publisher waits for it.
                if !lock(&room.mailbox).push_over(owed) {
                    routed.behind.push((room.clone(), weight, delivery.qos));
                }
                queued.push(room.clone());
                continue;
            }
            match lock(&room.mailbox).push_away(owed) {
                Ok(()) => queued.push(room.clone()),
                Err(why) => {
                    let dropped = self.away_drops.fetch_add(1, Ordering::Relaxed) + 1;
                    if self.away_log.due() {
                        warn!(error_code = "EM-BROKER-QUEUE-FULL", client_id = %room.client_id,
                            topic = %message.topic, ?why, dropped,
                            "messages dropped for sessions that are away (logged at most every 10 s; `dropped` counts all since start)");
                    }
                }
            }
        }
        drop(rooms);
        for room in queued {
            room.deliver();
        }
        routed
    }

    /// Gives the message to each module it reaches, through its taker or into its inbox; what
    /// is left to do is returned.
    fn to_links(
        &self,
        deliveries: &[Delivery],
        message: &Published,
        ack: Option<&Ack>,
    ) -> ForLinks {
        let mut waiting = ForLinks::new();
        if !deliveries.iter().any(|d| d.session >= FIRST_LINK) {
            return waiting;
        }
        let links = self.links.read().unwrap_or_else(PoisonError::into_inner);
        for delivery in deliveries.iter().filter(|d| d.session >= FIRST_LINK) {
            let Some(end) = links.get(&delivery.session) else {
                continue;
            };
            let mut message = for_link(message, ack);
            if let Some(taker) = &end.taker {
                match taker.take(message) {
                    Taken::Done => continue,
                    Taken::Later(later) => {
                        waiting.push(Handing::Later(later));
                        continue;
                    }
                    Taken::Back(back) => message = back,
                }
            }
            match end.inbox.try_send(message) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(m)) => {
                    waiting.push(Handing::Inbox(end.inbox.clone(), m));
                }
                Err(mpsc::error::TrySendError::Closed(m)) => {
                    if let Some(ack) = &m.ack {
                        ack.abandon();
                    }
                }
            }
        }
        waiting
    }

    /// Publishes delayed wills and frees expired sessions as they come due, until `cancel`.
    pub async fn run_timers(self: Arc<Self>, cancel: CancellationToken) {
        loop {
            let wait = self.fire().map_or(Duration::from_secs(3600), |at| {
                at.saturating_duration_since(Instant::now())
            });
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
                () = self.timers.notified() => {}
            }
        }
    }

    /// Sessions held, connected or not.
    pub fn sessions(&self) -> usize {
        lock(&self.registry).len()
    }

    fn settle(&self, fired: Fired) {
        for session in &fired.ended {
            self.forget(session.id, &session.filters);
        }
        for will in fired.wills {
            // A will is one message per connection that ended: it does not wait for readers.
            let waiting = self
                .publish(None, will.message, will.qos, will.retain, None)
                .links;
            if !waiting.is_empty() {
                // A will for a module whose inbox is full waits off the caller's thread.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(hand_to_links(waiting));
                }
            }
        }
    }

    /// Frees what an ended session held in the index and its mailroom.
    fn forget(&self, session: SessionId, filters: &[String]) {
        let mut index = self.index.write().unwrap_or_else(PoisonError::into_inner);
        for filter in filters {
            index.unsubscribe(session, filter);
        }
        drop(index);
        lock(&self.rooms).remove(&session);
    }
}

/// The module's copy of a message: its topic as published, v5 request properties kept.
fn for_link(message: &Published, ack: Option<&Ack>) -> Message {
    let (response_topic, correlation) = message.properties.as_ref().map_or((None, None), |p| {
        (p.response_topic.clone(), p.correlation_data.clone())
    });
    Message {
        // Not `to_string()`: that goes through the formatting machinery on every hand-on.
        topic: String::from(&*message.topic),
        payload: message.payload.clone(),
        response_topic,
        correlation,
        ack: ack.cloned(),
        reserved: None,
    }
}

/// How [`Hub::route`] finds room for a message: asked of each reader as it routes (a client's
/// or module's publish, maybe retained, maybe acknowledged after the modules), or promised
/// beforehand by [`Hub::reserve`].
enum Pacing<'a> {
    Asked {
        retain: bool,
        ack: Option<&'a Ack>,
    },
    /// Routed by [`Hub::reserve`] already, to these.
    Promised(Vec<Delivery>),
}

/// Waits until each module has room for its message, or has done what its taker left (a
/// module that has gone gets nothing and its acknowledgement is abandoned, so the client
/// publishes again).
pub async fn hand_to_links(waiting: ForLinks) {
    for handing in waiting {
        match handing {
            Handing::Inbox(inbox, message) => {
                if let Err(refused) = inbox.send(message).await {
                    if let Some(ack) = &refused.0.ack {
                        ack.abandon();
                    }
                }
            }
            Handing::Later(later) => later.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hub() -> Arc<Hub> {
        Arc::new(Hub::new(HubLimits {
            queue_bytes: 1 << 20,
            queues_bytes: 64 << 20,
            retained_bytes: 1 << 20,
            max_away_sessions: 100,
            reader_stall: Duration::from_secs(2),
        }))
    }

    fn limits(hub: &Hub) -> Limits {
        Limits {
            receive_maximum: 100,
            maximum_packet_size: None,
            topic_alias_maximum: 0,
            queue_bytes: hub.limits.queue_bytes,
        }
    }

    /// A connected reader of `filters`.
    fn reader(hub: &Hub, id: &str, filters: &[&str]) -> Arc<Mailroom> {
        let token = CancellationToken::new();
        let (connected, room) = hub.connect(id, true, Duration::ZERO, limits(hub), token);
        for filter in filters {
            let options = crate::index::Options::v4(1);
            hub.subscribe(id, connected.session, filter, options)
                .expect("a valid filter");
        }
        room
    }

    /// A remembered answer holds only while the subscriptions do: a subscribe, an unsubscribe
    /// and a session's end each change what the next question hears.
    #[test]
    fn heard_answers_follow_every_subscription_change() {
        let hub = hub();
        let mut heard = Heard::default();
        assert!(!hub.reaches_clients_heard("ke/cloud/meta/insert/default/pod", &mut heard));
        let token = CancellationToken::new();
        let (connected, _room) = hub.connect("c", true, Duration::ZERO, limits(&hub), token);
        let options = crate::index::Options::v4(1);
        hub.subscribe("c", connected.session, "ke/cloud/#", options)
            .expect("a valid filter");
        assert!(hub.reaches_clients_heard("ke/cloud/meta/insert/default/pod", &mut heard));
        assert!(!hub.reaches_clients_heard("ke/edged/meta/insert/default/pod", &mut heard));
        assert!(hub.unsubscribe("c", connected.session, "ke/cloud/#"));
        assert!(!hub.reaches_clients_heard("ke/cloud/meta/insert/default/pod", &mut heard));
        hub.subscribe(
            "c",
            connected.session,
            "ke/+/meta/#",
            crate::index::Options::v4(1),
        )
        .expect("a valid filter");
        assert!(hub.reaches_clients_heard("ke/edged/meta/insert/default/pod", &mut heard));
        hub.disconnect("c", connected.connection, None, Duration::ZERO);
        assert!(!hub.reaches_clients_heard("ke/edged/meta/insert/default/pod", &mut heard));
    }

    /// Ten times the bytes and ten times the topics it may remember, each asked twice: what
    /// it keeps stays within both bounds, and every answer stays right.
    #[test]
    fn heard_stays_bounded_by_topics_and_bytes() {
        let hub = hub();
        let token = CancellationToken::new();
        let (connected, _room) = hub.connect("c", true, Duration::ZERO, limits(&hub), token);
        hub.subscribe(
            "c",
            connected.session,
            "ke/+/odd/#",
            crate::index::Options::v4(1),
        )
        .expect("a valid filter");
        let mut heard = Heard::default();
        let long = "x".repeat(8 * 1024);
        let by_bytes = 10 * Heard::MAX_BYTES / long.len();
        for i in 0..by_bytes {
            let kind = if i % 2 == 1 { "odd" } else { "even" };
            let topic = format!("ke/{i}/{kind}/{long}");
            for _ in 0..2 {
                assert_eq!(hub.reaches_clients_heard(&topic, &mut heard), i % 2 == 1);
                assert!(heard.bytes <= Heard::MAX_BYTES);
            }
        }
        for i in 0..10 * Heard::MAX_TOPICS {
            let kind = if i % 2 == 1 { "odd" } else { "even" };
            let topic = format!("ke/{i}/{kind}");
            assert_eq!(hub.reaches_clients_heard(&topic, &mut heard), i % 2 == 1);
            assert!(heard.topics.len() <= Heard::MAX_TOPICS);
        }
        let huge = format!("ke/1/odd/{}", "y".repeat(Heard::MAX_BYTES + 1));
        assert!(hub.reaches_clients_heard(&huge, &mut heard));
        assert!(heard.bytes <= Heard::MAX_BYTES);
    }

    /// A hand-on promised room is routed once, by its promise: a shared group's members take
    /// turns message by message (routing it again at publish took a second turn, and every
    /// message went to the same member), and a plain reader gets every message.
    #[test]
    fn a_reserved_message_goes_where_its_promise_routed_it() {
        let hub = hub();
        let a = reader(&hub, "a", &["$share/g/t"]);
        let b = reader(&hub, "b", &["$share/g/t"]);
        let all = reader(&hub, "all", &["t"]);
        for n in 0..6_u8 {
            let reserved = hub.reserve(None, "t", 2, 100).expect("room for it");
            let published = Arc::new(Published {
                topic: Arc::from("t"),
                payload: bytes::Bytes::from(vec![n; 99]),
                received: Instant::now(),
                expiry: None,
                properties: None,
            });
            let routed = hub.publish_reserved(None, published, 2, reserved);
            assert!(routed.links.is_empty() && routed.behind.is_empty());
        }
        let queued = |room: &Mailroom| lock(&room.mailbox).len();
        assert_eq!((queued(&a), queued(&b), queued(&all)), (3, 3, 6));
        assert_eq!(
            hub.budget.used(),
            6 * 2 * 100,
            "each promise became what it promised"
        );
    }

    /// Two publishers reserve room at once for topics that reach the same two readers in
    /// opposite orders (a shared group's member is routed before plain subscribers). Holding
    /// one reader's
    /// mailbox while taking the next, as a reservation once did, deadlocks here within a few
    /// thousand rounds; taking one at a time cannot.
    #[test]
    fn reservations_for_topics_that_reach_readers_in_opposite_orders_never_deadlock() {
        let hub = hub();
        let a = reader(&hub, "a", &["$share/g/t/1", "t/2"]);
        let b = reader(&hub, "b", &["t/1", "$share/g/t/2"]);
        let (done, finished) = std::sync::mpsc::channel();
        for topic in ["t/1", "t/2"] {
            let (hub, a, b, done) = (hub.clone(), a.clone(), b.clone(), done.clone());
            std::thread::spawn(move || {
                for _ in 0..200_000 {
                    assert!(
                        hub.reserve(None, topic, 2, 1).is_some(),
                        "both readers have room"
                    );
                    lock(&a.mailbox).unreserve(1);
                    lock(&b.mailbox).unreserve(1);
                }
                let _ = done.send(());
            });
        }
        for _ in 0..2 {
            finished
                .recv_timeout(Duration::from_secs(60))
                .expect("both publishers finish: no two mailboxes are locked at once");
        }
        assert_eq!(hub.budget.used(), 0, "every promise was taken back");
    }

    /// A connected reader a publish fills is returned for its publisher to wait for, and the
    /// message is queued for it all the same; a session away only drops, counted.
    #[test]
    fn a_full_connected_reader_paces_its_publisher_and_a_session_away_drops() {
        let hub = Arc::new(Hub::new(HubLimits {
            queue_bytes: 1000,
            ..hub().limits
        }));
        let room = reader(&hub, "r", &["t"]);
        let message = |n: u8| {
            Arc::new(Published {
                topic: Arc::from("t"),
                payload: bytes::Bytes::from(vec![n; 99]),
                received: Instant::now(),
                expiry: None,
                properties: None,
            })
        };
        let mut behind = 0;
        for n in 0..20 {
            behind += hub.publish(None, message(n), 1, false, None).behind.len();
        }
        assert_eq!(
            behind, 10,
            "from the eleventh on, each waits for the reader"
        );
        assert_eq!(lock(&room.mailbox).len(), 20, "nothing was dropped for it");
        assert_eq!(
            hub.lag_cuts.load(Ordering::Relaxed),
            0,
            "nor was it cut off"
        );
        let connection = lock(&room.holder).as_ref().map_or(0, |(c, _)| *c);
        room.release(connection);
        let routed = hub.publish(None, message(20), 1, false, None);
        assert!(routed.behind.is_empty(), "nobody waits for a session away");
        assert_eq!(hub.away_drops.load(Ordering::Relaxed), 1);
    }
}
