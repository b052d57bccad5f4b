//! The one path's shared state: sessions, subscriptions and retained messages, and the one
//! `publish` every client and in-process module calls. A publish routes through the index and
//! is pushed into each matching session's mailbox; nothing waits for a reader.

// Session ids are looked up on every publish: foldhash, not SipHash.
use foldhash::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::ack::Ack;
use crate::direct::{Direct, Flushed, Waiting};
use crate::dollar::to_broker;
use crate::index::{Index, SessionId};
use crate::mailbox::{Limits, Mailbox, Owed, Published};
use crate::registry::{Connected, Fired, Registry, Will};
use crate::retained::Retained;
use crate::Message;

/// Link session ids start here, above any the registry hands out.
const FIRST_LINK: SessionId = 1 << 62;

/// Messages for the node's own modules that did not fit their inboxes at once: the caller
/// waits for room ([`hand_to_links`]), which is how a publisher waits for the MetaManager.
pub type ForLinks = Vec<(mpsc::Sender<Message>, Message)>;

/// A session's mailbox and the bell its connection task waits on.
#[derive(Debug)]
pub struct Mailroom {
    pub mailbox: Arc<Mutex<Mailbox>>,
    /// Its client's id, for the logs.
    client_id: Arc<str>,
    pub ready: Notify,
    /// The connection reading it now, cut off when it falls a whole queue behind.
    holder: Mutex<Option<(u64, CancellationToken)>>,
    /// Set when it was cut off for lagging, so the connection says why.
    pub lagged: std::sync::atomic::AtomicBool,
    /// When its reader last took something (ms on the hub's clock).
    taken_at: AtomicU64,
    /// Its plain-TCP connection's socket, which a publisher writes to while the task idles.
    direct: Mutex<Option<Arc<Direct>>>,
    /// The hub's clock and its bell for paced publishers, for a write from outside the hub.
    clock: Instant,
    room_made: Arc<Notify>,
}

impl Mailroom {
    /// Its reader took something from the queue now.
    pub fn taken(&self, hub: &Hub) {
        self.taken_at.store(hub.now_ms(), Ordering::Relaxed);
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
        self.write_or_ring();
    }

    fn write_or_ring(&self) {
        let direct = lock(&self.direct).clone();
        let flushed = direct.map(|d| d.flush(&self.mailbox));
        if let Some(Flushed { took: true, .. }) = flushed {
            self.taken_at
                .store(self.clock.elapsed().as_millis() as u64, Ordering::Relaxed);
            self.room_made.notify_waiters();
        }
        if flushed.is_none_or(|f| f.ring) {
            self.ready.notify_one();
        }
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
    fn send(&self) {
        self.write_or_ring();
    }
}

/// The node-wide bounds of the one path.
#[derive(Clone, Copy, Debug)]
pub struct HubLimits {
    /// Bytes a session's queue holds (connected or not).
    pub queue_bytes: usize,
    /// Bytes of retained messages kept in all.
    pub retained_bytes: usize,
    /// Sessions kept while their clients are away.
    pub max_away_sessions: usize,
    /// Hand-ons the node keeps in its store for connected readers that have no room, before
    /// it cuts those readers off.
    pub reader_store_backlog: usize,
    /// A reader with no room that took nothing this long is cut off even when fewer wait.
    pub reader_stall: Duration,
}

/// Sessions, subscriptions and retained messages, each behind its own short lock; no lock is
/// held across an await, and none is taken while another is held except index → mailrooms.
#[derive(Debug)]
pub struct Hub {
    pub limits: HubLimits,
    registry: Mutex<Registry>,
    index: RwLock<Index>,
    retained: Mutex<Retained>,
    rooms: Mutex<HashMap<SessionId, Arc<Mailroom>>>,
    /// Each live connection's token, so a take-over closes the connection it replaces.
    connections: Mutex<HashMap<u64, CancellationToken>>,
    /// Rung when an expiry or a delayed will may have come nearer.
    pub timers: Notify,
    /// The node's own modules: their session ids and inboxes.
    links: RwLock<HashMap<SessionId, mpsc::Sender<Message>>>,
    next_link: AtomicU64,
    /// Connected readers cut off so far for falling a whole queue behind.
    pub lag_cuts: AtomicU64,
    /// Rung when a connected reader took something from its queue, for paced publishers.
    pub room: Arc<Notify>,
    started: Instant,
}

/// Poisoning only follows a panic elsewhere; the state itself stays consistent per call.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Hub {
    pub fn new(limits: HubLimits) -> Hub {
        Hub {
            limits,
            registry: Mutex::new(Registry::new(limits.max_away_sessions)),
            index: RwLock::new(Index::default()),
            retained: Mutex::new(Retained::new(limits.retained_bytes)),
            rooms: Mutex::new(HashMap::default()),
            connections: Mutex::new(HashMap::default()),
            timers: Notify::new(),
            links: RwLock::new(HashMap::default()),
            next_link: AtomicU64::new(FIRST_LINK),
            lag_cuts: AtomicU64::new(0),
            room: Arc::new(Notify::new()),
            started: Instant::now(),
        }
    }

    /// Milliseconds since the hub started.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Whether `room`'s reader has taken nothing for [`HubLimits::reader_stall`].
    pub fn stalled(&self, room: &Mailroom) -> bool {
        let taken = room.taken_at.load(Ordering::Relaxed);
        self.now_ms().saturating_sub(taken) >= self.limits.reader_stall.as_millis() as u64
    }

    /// The connected readers `topic` reaches, with the QoS each gets (the node's modules,
    /// sessions away and readers already cut off are not among them).
    fn readers(&self, topic: &str) -> Vec<(Arc<Mailroom>, u8)> {
        let deliveries = self
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .route(topic, None, 2, false);
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
    pub fn blocking(&self, topic: &str, weight: usize) -> Vec<Arc<Mailroom>> {
        self.readers(topic)
            .into_iter()
            .filter(|(room, qos)| !lock(&room.mailbox).has_room(weight, *qos))
            .map(|(room, _)| room)
            .collect()
    }

    /// Promises room for a message of `weight` bytes on `topic` in every connected reader's
    /// queue if each has it now; false promises nothing.
    pub fn reserve(&self, topic: &str, weight: usize) -> bool {
        let readers = self.readers(topic);
        let mut boxes: Vec<_> = readers
            .iter()
            .map(|(room, qos)| (lock(&room.mailbox), *qos))
            .collect();
        if !boxes
            .iter()
            .all(|(mailbox, qos)| mailbox.has_room(weight, *qos))
        {
            return false;
        }
        for (mailbox, _) in &mut boxes {
            mailbox.reserve(weight);
        }
        true
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
            .insert(id, inbox);
        Ok(id)
    }

    /// Whether a client (not one of the node's modules) subscribes to `topic` now.
    pub fn reaches_clients(&self, topic: &str) -> bool {
        self.index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .route(topic, None, 0, false)
            .iter()
            .any(|d| d.session < FIRST_LINK)
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
                    taken_at: AtomicU64::new(self.now_ms()),
                    direct: Mutex::new(None),
                    clock: self.started,
                    room_made: self.room.clone(),
                })
            })
            .clone();
        room.lagged
            .store(false, std::sync::atomic::Ordering::Relaxed);
        room.taken(self);
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
        let filter = filter
            .strip_prefix("$share/")
            .and_then(|rest| rest.split_once('/').map(|(_, f)| f))
            .unwrap_or(filter);
        lock(&self.retained).matching(filter).cloned().collect()
    }

    /// Routes a message to every matching session; `from` is the publishing session (for No
    /// Local), None for the node itself. A message a module consumes carries `ack`, dropped
    /// once the module is done with it; what a module's inbox has no room for is returned.
    #[must_use = "messages for the node's modules must be handed on"]
    pub fn publish(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        retain: bool,
        ack: Option<&Ack>,
    ) -> ForLinks {
        self.route(from, message, qos, retain, ack, false).0
    }

    /// [`Hub::publish`], also saying whether the message reached any session or module.
    #[must_use = "messages for the node's modules must be handed on"]
    pub fn publish_heard(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        retain: bool,
        ack: Option<&Ack>,
    ) -> (ForLinks, bool) {
        self.route(from, message, qos, retain, ack, false)
    }

    /// [`Hub::publish`] of a message [`Hub::reserve`] promised room to.
    #[must_use = "messages for the node's modules must be handed on"]
    pub fn publish_reserved(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
    ) -> ForLinks {
        self.route(from, message, qos, false, None, true).0
    }

    fn route(
        &self,
        from: Option<SessionId>,
        message: Arc<Published>,
        qos: u8,
        retain: bool,
        ack: Option<&Ack>,
        reserved: bool,
    ) -> (ForLinks, bool) {
        if retain && lock(&self.retained).set(message.clone(), qos).is_err() {
            warn!(error_code = "EM-BROKER-RETAINED-FULL", topic = %message.topic,
                "retained message not kept: the retained store is full");
        }
        let deliveries = self
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .route(&message.topic, from, qos, retain);
        let heard = !deliveries.is_empty();
        let mut waiting = ForLinks::new();
        if deliveries.iter().any(|d| d.session >= FIRST_LINK) {
            let links = self.links.read().unwrap_or_else(PoisonError::into_inner);
            for delivery in deliveries.iter().filter(|d| d.session >= FIRST_LINK) {
                let Some(inbox) = links.get(&delivery.session) else {
                    continue;
                };
                let for_link = for_link(&message, ack);
                match inbox.try_send(for_link) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(m)) => waiting.push((inbox.clone(), m)),
                    Err(mpsc::error::TrySendError::Closed(m)) => {
                        if let Some(ack) = &m.ack {
                            ack.abandon();
                        }
                    }
                }
            }
        }
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
            if reserved {
                lock(&room.mailbox).push_reserved(owed);
                queued.push(room.clone());
                continue;
            }
            let pushed = lock(&room.mailbox).push(owed);
            match pushed {
                Ok(()) => queued.push(room.clone()),
                Err(why) => {
                    // A connected reader a whole queue behind is cut off (it resyncs when it
                    // comes back); nobody else waits for it. A session away only drops.
                    if lock(&room.holder).is_some() {
                        self.cut_off(room, "fell a whole queue behind");
                        continue;
                    }
                    warn!(error_code = "EM-BROKER-QUEUE-FULL", client_id = %room.client_id,
                        topic = %message.topic, ?why, "message dropped for a session");
                }
            }
        }
        drop(rooms);
        for room in queued {
            room.deliver();
        }
        (waiting, heard)
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
            let waiting = self.publish(None, will.message, will.qos, will.retain, None);
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

/// The module's copy of a message: its topic in the broker form, v5 request properties kept.
fn for_link(message: &Published, ack: Option<&Ack>) -> Message {
    let (response_topic, correlation) = message.properties.as_ref().map_or((None, None), |p| {
        (p.response_topic.clone(), p.correlation_data.clone())
    });
    Message {
        topic: to_broker(&message.topic).into_owned(),
        payload: message.payload.clone(),
        response_topic,
        correlation,
        ack: ack.cloned(),
        reserved: false,
    }
}

/// Waits until each module has room for its message (a module that has gone gets nothing and
/// its acknowledgement is abandoned, so the client publishes again).
pub async fn hand_to_links(waiting: ForLinks) {
    for (inbox, message) in waiting {
        if let Err(refused) = inbox.send(message).await {
            if let Some(ack) = &refused.0.ack {
                ack.abandon();
            }
        }
    }
}
