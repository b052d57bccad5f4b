//! One client connection as both the front (which owns its socket) and the guard (which sees its
//! packets) know it. The front registers it under a number that travels to the guard in the
//! preamble, so a decision the guard takes (cut this client off) reaches the socket.

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicI64, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Which acknowledgement the front owes a client for a publish the node consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckKind {
    /// QoS 1: PUBACK.
    PubAck,
    /// QoS 2: PUBCOMP (rumqttd appends a QoS 2 publish only on PUBREL, after its PUBREC).
    PubComp,
}

impl AckKind {
    /// The packet's fixed header byte; both packets are `type, 2, pkid` in 3.1.1 and 5.
    fn header(self) -> u8 {
        match self {
            AckKind::PubAck => 0x40,
            AckKind::PubComp => 0x70,
        }
    }
}

/// Packet ids of the publishes the front writes itself ([`Session::deliver`]): rumqttd numbers
/// its own from 1 up to its inflight limit (100), so the upper half never meets them.
pub const FRONT_PKIDS: u16 = 0x8000;

/// Whether a client's PUBACK answers a publish the front wrote (it never reaches rumqttd).
pub fn is_front_pkid(pkid: u16) -> bool {
    pkid >= FRONT_PKIDS
}

/// Told once the front has written a publish it delivered to the client.
pub trait Written: Send + Sync + std::fmt::Debug {
    fn written(&self);
}

/// What the node has the front write to a client between rumqttd's packets: acknowledgements of
/// committed publishes and publishes delivered past rumqttd, encoded, in order.
#[derive(Debug, Default)]
pub struct Out {
    pub bytes: Vec<u8>,
    written: Vec<Arc<dyn Written>>,
    reliable: i64,
}

impl Out {
    /// The front wrote [`Out::bytes`] to the client.
    pub fn done(self, session: &Session) {
        session.unacked.fetch_add(self.reliable, Ordering::Relaxed);
        for written in self.written {
            written.written();
        }
    }
}

/// What waits to be written to the client besides rumqttd's packets, and whether the node may
/// write it to the socket itself: that spares waking the front for each acknowledgement and
/// delivery (a thread hand-off, the largest share of a hand-on's latency on a busy node).
#[derive(Debug, Default)]
struct Outgoing {
    out: Out,
    /// A second handle on the client's socket (plain TCP only; a TLS stream has one writer).
    direct: Option<TcpStream>,
    /// The front waits between two of rumqttd's packets with nothing of its own to write, so
    /// bytes written now cannot land inside one of them.
    idle: bool,
}

impl Outgoing {
    /// Writes what is queued without waiting: all of it (returned, for [`Out::done`]), or, when
    /// the socket is full or failed, what it took, leaving the rest to the front.
    fn write_direct(&mut self) -> Option<Out> {
        let socket = self.direct.as_ref()?;
        let mut at = 0;
        while at < self.out.bytes.len() {
            match (&*socket).write(&self.out.bytes[at..]) {
                Ok(0) => break,
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // Full (the socket is non-blocking) or broken: the front finds out which.
                Err(_) => break,
            }
        }
        self.out.bytes.drain(..at);
        self.out
            .bytes
            .is_empty()
            .then(|| std::mem::take(&mut self.out))
    }
}

/// A connection the node may cut off, and what the front is to write to it besides rumqttd's.
#[derive(Debug, Default)]
pub struct Session {
    id: u64,
    /// This session, for a [`Cork`] to flush it later.
    me: Weak<Session>,
    cut: CancellationToken,
    /// Released acknowledgements (committed) and delivered publishes, not yet written.
    out: Mutex<Outgoing>,
    out_ready: Notify,
    /// Numbers the front's QoS 1 publishes, from [`FRONT_PKIDS`] up, wrapping within the half.
    next_pkid: AtomicU16,
    /// Since when the front has been waiting to write to the client (ns after [`epoch`]); 0:
    /// not waiting. A client that stopped reading keeps this set.
    writing_since: AtomicU64,
    /// When the client last sent anything (ns after [`epoch`]).
    heard: AtomicU64,
    /// QoS 1/2 publishes written to the client and not yet acknowledged by it (rumqttd stops
    /// sending at 100: a client that stopped reading then looks idle from the socket).
    unacked: AtomicI64,
    /// Bytes of publishes to our links the front passed to rumqttd and rumqttd has not read.
    carried: AtomicI64,
    /// Publishes to our links passed to rumqttd that no link has received yet: while there are
    /// any, the front hands none to a link itself, which would overtake them.
    routed: AtomicI64,
    /// What the client may publish, once rumqttd has accepted its CONNECT.
    rights: OnceLock<Rights>,
    /// Acknowledgements the node promised for the client's publishes and has not released.
    promised: AtomicI64,
    /// When the node last released one (ns after [`epoch`]; 0: never).
    acked_at: AtomicU64,
}

/// What an accepted client may publish, and how it speaks: what the front needs to hand its
/// publishes to the node's links itself.
#[derive(Debug)]
pub struct Rights {
    pub grants: crate::security::Grants,
    pub v5: bool,
}

/// Now, in ns after [`epoch`] (never 0).
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos().max(1) as u64
}

/// The instant session times count from.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Session {
    /// The number the preamble carries.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Ends the connection: the front drops both sockets, the guard writes nothing more.
    pub fn cut(&self) {
        self.cut.cancel();
    }

    pub fn is_cut(&self) -> bool {
        self.cut.is_cancelled()
    }

    /// Resolves once the connection has been cut.
    pub async fn cut_off(&self) {
        self.cut.cancelled().await;
    }

    /// The front starts writing to the client.
    pub fn writing(&self) {
        self.writing_since.store(now_ns(), Ordering::Relaxed);
    }

    /// The front's write to the client completed.
    pub fn written(&self) {
        self.writing_since.store(0, Ordering::Relaxed);
    }

    /// The client sent a packet; `ack`: an acknowledgement of a publish written to it.
    pub fn heard(&self, ack: bool) {
        self.heard.store(now_ns(), Ordering::Relaxed);
        if ack {
            self.unacked.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The front passed rumqttd a publish to our links of `len` bytes.
    pub fn carry(&self, len: usize) {
        self.carried.fetch_add(len as i64, Ordering::Relaxed);
    }

    /// rumqttd read a carried publish of `len` bytes: how many of them were still counted
    /// (none once [`Session::drop_carried`] gave them all up).
    pub fn landed(&self, len: usize) -> i64 {
        let len = len as i64;
        let before = self
            .carried
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some((c - len).max(0))
            })
            .unwrap_or_default();
        before.min(len)
    }

    /// The connection ended: whatever rumqttd did not read is no longer on its way.
    pub fn drop_carried(&self) -> i64 {
        self.carried.swap(0, Ordering::Relaxed)
    }

    /// rumqttd accepted the client's CONNECT with these rights.
    pub fn grant(&self, rights: Rights) {
        let _ = self.rights.set(rights);
    }

    /// The client's rights, once rumqttd has accepted it.
    pub fn rights(&self) -> Option<&Rights> {
        self.rights.get()
    }

    /// The front passed rumqttd a publish to our links.
    pub fn routed(&self) {
        self.routed.fetch_add(1, Ordering::Relaxed);
    }

    /// A routed publish reached a link, or turned out not to go to one.
    pub fn arrived(&self) {
        let _ = self
            .routed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some((n - 1).max(0))
            });
    }

    /// Whether a routed publish is still on its way to a link.
    pub fn routing(&self) -> bool {
        self.routed.load(Ordering::Relaxed) > 0
    }

    /// A QoS 1/2 publish was written to the client.
    pub fn sent_reliable(&self) {
        self.unacked.fetch_add(1, Ordering::Relaxed);
    }

    /// How long the client has shown it stopped reading: the front waiting to write to it, or,
    /// with acknowledgements outstanding, the client silent.
    pub fn stopped_for(&self) -> Duration {
        let silent = if self.unacked.load(Ordering::Relaxed) > 0 {
            let heard = self.heard.load(Ordering::Relaxed);
            epoch()
                .elapsed()
                .saturating_sub(Duration::from_nanos(heard))
        } else {
            Duration::ZERO
        };
        silent.max(self.blocked_for())
    }

    /// How long the front has been waiting for the client to take what it writes.
    pub fn blocked_for(&self) -> Duration {
        match self.writing_since.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            since => epoch()
                .elapsed()
                .saturating_sub(Duration::from_nanos(since)),
        }
    }

    /// Writes the acknowledgement of `pkid` to the client, or queues it for the front.
    pub fn release(&self, kind: AckKind, pkid: u16) {
        let [hi, lo] = pkid.to_be_bytes();
        let mut outgoing = self.lock_out();
        outgoing
            .out
            .bytes
            .extend_from_slice(&[kind.header(), 2, hi, lo]);
        self.queued(outgoing);
    }

    /// Writes a PUBLISH of `payload` on `topic` (clients' form) to the client, or queues it for
    /// the front, at QoS 1 with one of the front's packet ids when `reliable`; `written` is told
    /// once it is written.
    pub fn deliver(
        &self,
        topic: &[u8],
        payload: &[u8],
        reliable: bool,
        v5: bool,
        written: Arc<dyn Written>,
    ) {
        let pkid = reliable
            .then(|| FRONT_PKIDS | (self.next_pkid.fetch_add(1, Ordering::Relaxed) & !FRONT_PKIDS));
        let mut outgoing = self.lock_out();
        let out = &mut outgoing.out;
        encode_publish(&mut out.bytes, topic, payload, pkid, v5);
        out.written.push(written);
        out.reliable += i64::from(reliable);
        self.queued(outgoing);
    }

    /// Something was queued: written at once while the front is idle, else the front is woken;
    /// under a [`Cork`] only once the cork is pulled.
    fn queued(&self, outgoing: std::sync::MutexGuard<'_, Outgoing>) {
        if Cork::holds(self) {
            return;
        }
        self.flush_out(outgoing);
    }

    /// Writes what is queued to the socket while the front idles, else wakes the front.
    fn flush_out(&self, mut outgoing: std::sync::MutexGuard<'_, Outgoing>) {
        if outgoing.out.bytes.is_empty() {
            // The front took it meanwhile.
            return;
        }
        if outgoing.idle {
            if let Some(out) = outgoing.write_direct() {
                drop(outgoing);
                out.done(self);
                return;
            }
            outgoing.idle = false;
        }
        drop(outgoing);
        self.out_ready.notify_one();
    }

    /// The node may write to the client through `socket` (the client's, non-blocking) while
    /// the front is idle ([`Session::front_idle`]).
    pub fn attach(&self, socket: TcpStream) {
        self.lock_out().direct = socket.set_nonblocking(true).is_ok().then_some(socket);
    }

    /// The front let go of the client's socket: so does the node, or the client would not see
    /// the connection close.
    pub fn detach(&self) {
        let mut outgoing = self.lock_out();
        outgoing.direct = None;
        outgoing.idle = false;
    }

    /// The front waits between rumqttd's packets: the node may write directly, once nothing is
    /// queued (else [`Session::out_ready`] is already due).
    pub fn front_idle(&self) {
        let mut outgoing = self.lock_out();
        outgoing.idle = outgoing.direct.is_some() && outgoing.out.bytes.is_empty();
    }

    /// The front is about to write rumqttd's bytes: from now on the node queues.
    pub fn front_busy(&self) {
        self.lock_out().idle = false;
    }

    /// Resolves once something is queued for the front to write (at once if it already is).
    pub async fn out_ready(&self) {
        loop {
            let notified = self.out_ready.notified();
            if !self.lock_out().out.bytes.is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// What is queued, in the order it was queued; the front calls [`Out::done`] once written.
    /// The front is busy until it says it is idle again.
    pub fn take_out(&self) -> Out {
        let mut outgoing = self.lock_out();
        outgoing.idle = false;
        std::mem::take(&mut outgoing.out)
    }

    fn lock_out(&self) -> std::sync::MutexGuard<'_, Outgoing> {
        self.out.lock().unwrap_or_else(|p| p.into_inner())
    }
}

thread_local! {
    /// Sessions written to while this thread holds a [`Cork`], and how many corks it holds.
    static CORKED: std::cell::RefCell<(usize, Vec<Arc<Session>>)> =
        const { std::cell::RefCell::new((0, Vec::new())) };
}

/// While held, acknowledgements and deliveries this thread releases to a client are only
/// queued; dropping the (outermost) cork writes each client's in one go: a commit's hand-ons or
/// a sync's PUBACKs then cost one socket write per client instead of one each (a loopback send
/// is most of a hand-on's CPU on the store thread).
pub struct Cork {
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl Cork {
    pub fn new() -> Cork {
        CORKED.with(|corked| corked.borrow_mut().0 += 1);
        Cork {
            _thread_bound: std::marker::PhantomData,
        }
    }

    /// Whether this thread holds a cork; if so, `session` is flushed when it is pulled.
    fn holds(session: &Session) -> bool {
        CORKED.with(|corked| {
            let mut corked = corked.borrow_mut();
            let (depth, sessions) = &mut *corked;
            if *depth == 0 {
                return false;
            }
            if !sessions.iter().any(|held| held.id == session.id) {
                match session.me.upgrade() {
                    Some(me) => sessions.push(me),
                    // Not one the front opened (a test's): nothing would flush it.
                    None => return false,
                }
            }
            true
        })
    }
}

impl Default for Cork {
    fn default() -> Cork {
        Cork::new()
    }
}

impl Drop for Cork {
    fn drop(&mut self) {
        let sessions = CORKED.with(|corked| {
            let mut corked = corked.borrow_mut();
            corked.0 -= 1;
            if corked.0 == 0 {
                std::mem::take(&mut corked.1)
            } else {
                Vec::new()
            }
        });
        for session in sessions {
            session.flush_out(session.lock_out());
        }
    }
}

/// Whether a publish of this topic and payload fits one MQTT packet the front can write.
pub fn deliverable(topic: &[u8], payload: &[u8]) -> bool {
    topic.len() <= usize::from(u16::MAX) && topic.len() + payload.len() < (1 << 28) - 8
}

/// A PUBLISH packet (MQTT 3.1.1, or 5 with no properties), QoS 1 with `pkid`, else QoS 0.
fn encode_publish(into: &mut Vec<u8>, topic: &[u8], payload: &[u8], pkid: Option<u16>, v5: bool) {
    let remaining = 2 + topic.len() + pkid.map_or(0, |_| 2) + usize::from(v5) + payload.len();
    into.reserve(5 + remaining);
    into.push(if pkid.is_some() { 0x32 } else { 0x30 });
    let mut left = remaining;
    loop {
        let digit = (left % 128) as u8;
        left /= 128;
        into.push(if left > 0 { digit | 0x80 } else { digit });
        if left == 0 {
            break;
        }
    }
    into.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    into.extend_from_slice(topic);
    if let Some(pkid) = pkid {
        into.extend_from_slice(&pkid.to_be_bytes());
    }
    if v5 {
        into.push(0);
    }
    into.extend_from_slice(payload);
}

/// The node's promise to acknowledge one client publish: dropped (after its commit, or once
/// it was answered with an error), it releases the PUBACK / PUBCOMP to the front.
#[derive(Debug, Clone)]
pub struct Ack {
    _pending: Arc<Pending>,
}

#[derive(Debug)]
struct Pending {
    session: Weak<Session>,
    kind: AckKind,
    pkid: u16,
    after_ack: Option<Duration>,
    abandoned: std::sync::atomic::AtomicBool,
}

impl Ack {
    fn new(session: &Arc<Session>, kind: AckKind, pkid: u16) -> Ack {
        let owed = session.promised.fetch_add(1, Ordering::Relaxed);
        let acked = session.acked_at.load(Ordering::Relaxed);
        Ack {
            _pending: Arc::new(Pending {
                session: Arc::downgrade(session),
                kind,
                pkid,
                after_ack: (owed == 0 && acked != 0)
                    .then(|| Duration::from_nanos(now_ns().saturating_sub(acked))),
                abandoned: Default::default(),
            }),
        }
    }

    /// How long after the client's last acknowledgement it sent this publish, if it waited
    /// for none other meanwhile: a client that waits for each PUBACK before it publishes
    /// again ("stop and wait") sends its next right after it (protocol §6.1).
    pub fn after_ack(&self) -> Option<Duration> {
        self._pending.after_ack
    }

    /// Which connection waits for this acknowledgement (equal for the same connection while
    /// it lives).
    pub fn sender(&self) -> usize {
        self._pending.session.as_ptr() as usize
    }

    /// The message will not be committed (the node is stopping): no acknowledgement is sent,
    /// so the client publishes it again.
    pub fn abandon(&self) {
        self._pending.abandoned.store(true, Ordering::Relaxed);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(session) = self.session.upgrade() else {
            return;
        };
        session.promised.fetch_sub(1, Ordering::Relaxed);
        if !self.abandoned.load(Ordering::Relaxed) {
            session.acked_at.store(now_ns(), Ordering::Relaxed);
            session.release(self.kind, self.pkid);
        }
    }
}

impl PartialEq for Ack {
    fn eq(&self, _: &Ack) -> bool {
        // Messages compare by content; who waits for them does not change what they are.
        true
    }
}

impl Eq for Ack {}

/// Sessions the front has opened and the guard has not yet claimed.
#[derive(Debug, Default)]
pub struct Sessions {
    next: AtomicU64,
    /// Connections the front holds open right now (opened, not yet closed).
    open: AtomicU64,
    unclaimed: Mutex<HashMap<u64, Arc<Session>>>,
    /// Every open connection, so an acknowledgement can find its way back by number.
    live: Mutex<HashMap<u64, Weak<Session>>>,
    /// Clients whose CONNECT went on to rumqttd and is not yet dropped, and the most allowed
    /// (0: no limit).
    admitted: AtomicUsize,
    client_limit: AtomicUsize,
}

impl Sessions {
    /// Registers a new connection; the front holds the session until the connection ends.
    pub fn open(&self) -> Arc<Session> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.open.fetch_add(1, Ordering::Relaxed);
        let session = Arc::new_cyclic(|me| Session {
            id,
            me: me.clone(),
            ..Session::default()
        });
        self.lock().insert(id, session.clone());
        self.lock_live().insert(id, Arc::downgrade(&session));
        session
    }

    /// At most `max` clients connected at once, across every listener.
    pub fn limit_clients(&self, max: usize) {
        self.client_limit.store(max, Ordering::Relaxed);
    }

    /// Counts a client in, unless that would pass the limit. A CONNECT refused here never
    /// reaches rumqttd, whose own refusal leaves state behind that makes the listener panic
    /// on the client's retry with the same id (rumqttd #1062).
    pub fn admit_client(&self) -> bool {
        let limit = self.client_limit.load(Ordering::Relaxed);
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (limit == 0 || n < limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// A client [`Sessions::admit_client`] counted in has gone.
    pub fn client_left(&self) {
        self.admitted.fetch_sub(1, Ordering::AcqRel);
    }

    /// Hands the session to the guard that read its number in the preamble (once).
    pub fn claim(&self, id: u64) -> Option<Arc<Session>> {
        self.lock().remove(&id)
    }

    /// The connection ended; forgets its session if it was never claimed (the client left
    /// before its first packet). Called once per [`Sessions::open`].
    pub fn close(&self, id: u64) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.lock().remove(&id);
        self.lock_live().remove(&id);
    }

    /// A routed publish of connection `id` reached a link ([`Session::arrived`]); the promise
    /// to acknowledge it, if it asks for one and the connection is still open.
    pub fn reached_link(&self, id: u64, ack: Option<(AckKind, u16)>) -> Option<Ack> {
        let session = self.lock_live().get(&id)?.upgrade()?;
        session.arrived();
        let (kind, pkid) = ack?;
        Some(Ack::new(&session, kind, pkid))
    }

    /// A promise to acknowledge `pkid` on connection `id`, if it is still open.
    pub fn promise(&self, id: u64, kind: AckKind, pkid: u16) -> Option<Ack> {
        let session = self.lock_live().get(&id)?.upgrade()?;
        Some(Ack::new(&session, kind, pkid))
    }

    fn lock_live(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Weak<Session>>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Client connections open right now.
    pub fn open_count(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.unclaimed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The user property that carries, from the guard to our links, which connection and packet id
/// a consumed publish is acknowledged to once it is committed: `<session>:<kind>:<pkid>`.
/// Clients' own properties of that name are removed, and subscribers never see it.
pub const ACK_PROPERTY: &str = "edgemeta-ack";

/// `<session>:<kind>:<pkid>` (see [`ACK_PROPERTY`]); kind 0 (QoS 0): nothing to acknowledge.
pub(crate) fn ack_tag(session: u64, ack: Option<(AckKind, u16)>) -> String {
    let (kind, pkid) = match ack {
        None => (0, 0),
        Some((AckKind::PubAck, pkid)) => (1, pkid),
        Some((AckKind::PubComp, pkid)) => (2, pkid),
    };
    format!("{session}:{kind}:{pkid}")
}

/// Reads an [`ACK_PROPERTY`] value back: the session, and what to send with its packet id.
pub fn parse_ack_tag(tag: &str) -> Option<(u64, Option<(AckKind, u16)>)> {
    let mut parts = tag.splitn(3, ':');
    let session = parts.next()?.parse().ok()?;
    let kind = match parts.next()? {
        "0" => return Some((session, None)),
        "1" => AckKind::PubAck,
        "2" => AckKind::PubComp,
        _ => return None,
    };
    Some((session, Some((kind, parts.next()?.parse().ok()?))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Default)]
    struct Count(std::sync::atomic::AtomicUsize);

    impl Written for Count {
        fn written(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn delivered_publishes_are_what_rumqttd_reads_in_both_versions() {
        use rumqttd::protocol::{v4::V4, v5::V5, Packet, Protocol};
        let session = Session::default();
        let count = Arc::new(Count::default());
        let payload = vec![b'x'; 300];
        session.deliver(b"$hw/a/result", &payload, true, false, count.clone());
        session.deliver(b"$hw/b", b"{}", false, false, count.clone());
        let out = session.take_out();
        // QoS 1 (0x32), remaining length 316 in two bytes, the topic, then the packet id.
        assert_eq!(out.bytes[..3], [0x32, 0xbc, 0x02]);
        assert!(is_front_pkid(u16::from_be_bytes([
            out.bytes[17],
            out.bytes[18]
        ])));
        assert_eq!(out.bytes[319], 0x30, "then a QoS 0 publish");
        let mut stream = bytes::BytesMut::from(&out.bytes[..]);
        let Packet::Publish(first, _) = V4.read_mut(&mut stream, 1 << 20).expect("v4") else {
            panic!("not a publish");
        };
        assert_eq!(
            (&first.topic[..], &first.payload[..]),
            (&b"$hw/a/result"[..], &payload[..])
        );
        let Packet::Publish(second, _) = V4.read_mut(&mut stream, 1 << 20).expect("v4") else {
            panic!("not a publish");
        };
        assert_eq!(&second.payload[..], b"{}");
        assert!(stream.is_empty());
        out.done(&session);
        assert_eq!(count.0.load(Ordering::Relaxed), 2);
        assert_eq!(
            session.unacked.load(Ordering::Relaxed),
            1,
            "one QoS 1 awaits its PUBACK"
        );

        session.deliver(b"t", b"p", true, true, count);
        let mut stream = bytes::BytesMut::from(&session.take_out().bytes[..]);
        let Packet::Publish(v5, properties) = V5.read_mut(&mut stream, 1 << 20).expect("v5") else {
            panic!("not a publish");
        };
        assert_eq!((&v5.topic[..], &v5.payload[..]), (&b"t"[..], &b"p"[..]));
        assert!(properties.is_none_or(|p| p.user_properties.is_empty()));
    }

    /// A connected pair of real sockets: the client's end and the node's.
    fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (node, _) = listener.accept().expect("accept");
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        (client, node)
    }

    #[test]
    fn an_idle_front_lets_the_node_write_to_the_socket_and_a_busy_one_gets_it_queued() {
        use std::io::Read;
        let (mut client, node) = socket_pair();
        let session = Session::default();
        session.attach(node);
        let count = Arc::new(Count::default());

        // Not idle yet (the front has not said so): queued.
        session.release(AckKind::PubAck, 7);
        assert_eq!(session.take_out().bytes, [0x40, 2, 0, 7]);

        session.front_idle();
        session.release(AckKind::PubAck, 8);
        session.deliver(b"t", b"p", false, false, count.clone());
        let mut read = [0_u8; 10];
        client.read_exact(&mut read).expect("written by the node");
        assert_eq!(read, [0x40, 2, 0, 8, 0x30, 4, 0, 1, b't', b'p']);
        assert_eq!(count.0.load(Ordering::Relaxed), 1, "told once written");
        assert!(
            session.take_out().bytes.is_empty(),
            "nothing left for the front"
        );

        // The front reads rumqttd's bytes: it writes them first, what comes meanwhile waits.
        session.front_idle();
        session.front_busy();
        session.release(AckKind::PubComp, 9);
        assert_eq!(session.take_out().bytes, [0x70, 2, 0, 9]);

        // Once the front lets go, the client sees the connection end.
        session.front_idle();
        session.detach();
        session.release(AckKind::PubAck, 10);
        assert_eq!(client.read(&mut read).expect("end of stream"), 0);
        assert_eq!(session.take_out().bytes, [0x40, 2, 0, 10]);
    }

    #[test]
    fn under_a_cork_a_client_gets_everything_in_one_write_when_it_is_pulled() {
        use std::io::Read;
        let (mut client, node) = socket_pair();
        let sessions = Sessions::default();
        let session = sessions.open();
        session.attach(node);
        session.front_idle();
        let count = Arc::new(Count::default());
        {
            let _outer = Cork::new();
            {
                let _inner = Cork::new();
                session.deliver(b"t", b"1", false, false, count.clone());
            }
            session.release(AckKind::PubAck, 5);
            session.deliver(b"t", b"2", false, false, count.clone());
            assert_eq!(count.0.load(Ordering::Relaxed), 0, "nothing written yet");
            client.set_nonblocking(true).expect("non-blocking");
            let mut none = [0_u8; 1];
            assert!(client.read(&mut none).is_err(), "nothing on the wire yet");
            client.set_nonblocking(false).expect("blocking");
        }
        let mut read = [0_u8; 16];
        client
            .read_exact(&mut read)
            .expect("written once the cork is pulled");
        assert_eq!(
            read,
            [0x30, 4, 0, 1, b't', b'1', 0x40, 2, 0, 5, 0x30, 4, 0, 1, b't', b'2'],
            "in the order released"
        );
        assert_eq!(count.0.load(Ordering::Relaxed), 2);
        assert!(session.take_out().bytes.is_empty());
    }

    #[test]
    fn what_a_full_socket_does_not_take_is_left_to_the_front_in_order() {
        use std::io::Read;
        let (mut client, node) = socket_pair();
        let session = Session::default();
        session.attach(node);
        let count = Arc::new(Count::default());
        session.front_idle();
        // More than the socket buffers hold while the client reads nothing.
        let payload = vec![b'x'; 1 << 16];
        let mut sent = 0;
        while session.lock_out().out.bytes.is_empty() {
            session.front_idle();
            session.deliver(b"t", &payload, true, false, count.clone());
            sent += 1;
            assert!(sent < 1_000, "the socket never filled");
        }
        // The publish that did not fit went partly to the socket, the rest was queued: reading
        // it all back gives whole packets, and the last one is told written only by the front.
        assert_eq!(count.0.load(Ordering::Relaxed), sent - 1);
        let mut whole = Vec::new();
        let rest = session.take_out();
        assert!(
            rest.bytes.len() <= payload.len() + 9,
            "only the last publish is left"
        );
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let packet = 4 + 2 + 1 + 2 + payload.len();
                whole.resize(packet * sent, 0);
                client.read_exact(&mut whole).expect("every packet");
            });
            let mut node = session.lock_out().direct.take().expect("attached");
            node.set_nonblocking(false).expect("blocking");
            node.write_all(&rest.bytes).expect("the rest");
        });
        let packet = 4 + 2 + 1 + 2 + payload.len();
        for (n, p) in whole.chunks(packet).enumerate() {
            assert_eq!(p[0], 0x32, "packet {n} starts where it should");
            assert!(p[9..].iter().all(|&b| b == b'x'), "packet {n} is whole");
        }
        rest.done(&session);
        assert_eq!(count.0.load(Ordering::Relaxed), sent);
    }

    #[test]
    fn front_packet_ids_stay_in_the_upper_half() {
        let session = Session::default();
        session.next_pkid.store(u16::MAX, Ordering::Relaxed);
        let count = Arc::new(Count::default());
        for _ in 0..3 {
            session.deliver(b"t", b"", true, false, count.clone());
        }
        let bytes = session.take_out().bytes;
        // Each packet: 0x32, 5, topic length (2), "t", pkid (2).
        let pkids: Vec<u16> = bytes
            .chunks(7)
            .map(|p| u16::from_be_bytes([p[5], p[6]]))
            .collect();
        assert_eq!(pkids, vec![0xffff, 0x8000, 0x8001]);
    }

    #[test]
    fn an_ack_tag_round_trips() {
        let tag = ack_tag(42, Some((AckKind::PubComp, 65535)));
        assert_eq!(
            parse_ack_tag(&tag),
            Some((42, Some((AckKind::PubComp, 65535))))
        );
        assert_eq!(parse_ack_tag(&ack_tag(7, None)), Some((7, None)));
        assert_eq!(parse_ack_tag("42:3:1"), None);
        assert_eq!(parse_ack_tag("x"), None);
    }

    #[test]
    fn a_session_is_claimed_once_and_a_cut_reaches_every_holder() {
        let sessions = Sessions::default();
        let front = sessions.open();
        let guard = sessions.claim(front.id()).expect("claimed");
        assert!(sessions.claim(front.id()).is_none(), "only once");
        guard.cut();
        assert!(front.is_cut());
        let other = sessions.open();
        assert_ne!(other.id(), front.id());
        sessions.close(other.id());
        assert!(sessions.claim(other.id()).is_none());
    }

    #[test]
    fn an_ack_is_released_when_its_last_holder_lets_go_and_only_while_the_connection_lives() {
        let sessions = Sessions::default();
        let session = sessions.open();
        let ack = sessions
            .promise(session.id(), AckKind::PubAck, 0x0102)
            .expect("open");
        let copy = ack.clone();
        drop(ack);
        assert!(session.take_out().bytes.is_empty(), "a copy still holds it");
        drop(copy);
        assert_eq!(session.take_out().bytes, vec![0x40, 2, 1, 2]);
        sessions
            .promise(session.id(), AckKind::PubComp, 7)
            .expect("open");
        assert_eq!(session.take_out().bytes, vec![0x70, 2, 0, 7]);
        sessions.close(session.id());
        assert!(sessions.promise(session.id(), AckKind::PubAck, 1).is_none());
    }

    #[test]
    fn a_publish_sent_right_after_its_ack_with_nothing_else_in_flight_is_told_apart() {
        let sessions = Sessions::default();
        let session = sessions.open();
        let promise = |pkid| {
            sessions
                .promise(session.id(), AckKind::PubAck, pkid)
                .expect("open")
        };
        let first = promise(1);
        assert_eq!(first.after_ack(), None, "no acknowledgement yet");
        drop(first);
        std::thread::sleep(Duration::from_millis(20));
        // Stop and wait: the next publish comes once the previous one is acknowledged.
        let next = promise(2);
        let after = next.after_ack().expect("nothing else in flight");
        assert!(after >= Duration::from_millis(20), "{after:?}");
        // Pipelining: a publish sent while another waits for its acknowledgement.
        let pipelined = promise(3);
        assert_eq!(pipelined.after_ack(), None);
        drop(next);
        // An abandoned promise no longer counts as in flight, nor as acknowledged.
        pipelined.abandon();
        drop(pipelined);
        std::thread::sleep(Duration::from_millis(20));
        let again = promise(4);
        assert!(again.after_ack().expect("nothing in flight") >= Duration::from_millis(20));
    }
}
