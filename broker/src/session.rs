//! One client connection as both the front (which owns its socket) and the guard (which sees its
//! packets) know it. The front registers it under a number that travels to the guard in the
//! preamble, so a decision the guard takes (cut this client off) reaches the socket.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
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

/// A connection the node may cut off, and the acknowledgements the front is to write to it.
#[derive(Debug, Default)]
pub struct Session {
    id: u64,
    cut: CancellationToken,
    /// Acknowledgements released by the node (committed), not yet written to the client.
    acks: Mutex<Vec<u8>>,
    acked: Notify,
    /// Since when the front has been waiting to write to the client (ns after [`epoch`]); 0:
    /// not waiting. A client that stopped reading keeps this set.
    writing_since: AtomicU64,
    /// When the client last sent anything (ns after [`epoch`]).
    heard: AtomicU64,
    /// QoS 1/2 publishes written to the client and not yet acknowledged by it (rumqttd stops
    /// sending at 100: a client that stopped reading then looks idle from the socket).
    unacked: AtomicI64,
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

    /// Queues the acknowledgement of `pkid` for the front to write.
    pub fn release(&self, kind: AckKind, pkid: u16) {
        let [hi, lo] = pkid.to_be_bytes();
        self.lock_acks()
            .extend_from_slice(&[kind.header(), 2, hi, lo]);
        self.acked.notify_one();
    }

    /// Resolves once acknowledgements are queued (at once if some already are).
    pub async fn acks_ready(&self) {
        loop {
            let notified = self.acked.notified();
            if !self.lock_acks().is_empty() {
                return;
            }
            notified.await;
        }
    }

    /// The queued acknowledgements, encoded, in release order.
    pub fn take_acks(&self) -> Vec<u8> {
        std::mem::take(&mut *self.lock_acks())
    }

    fn lock_acks(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.acks.lock().unwrap_or_else(|p| p.into_inner())
    }
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
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(session) = self.session.upgrade() {
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
        let session = Arc::new(Session {
            id,
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

    /// A promise to acknowledge `pkid` on connection `id`, if it is still open.
    pub fn ack(&self, id: u64, kind: AckKind, pkid: u16) -> Option<Ack> {
        let session = self.lock_live().get(&id)?.clone();
        session.upgrade()?;
        Some(Ack {
            _pending: Arc::new(Pending {
                session,
                kind,
                pkid,
            }),
        })
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

/// `<session>:<kind>:<pkid>` (see [`ACK_PROPERTY`]).
pub(crate) fn ack_tag(session: u64, kind: AckKind, pkid: u16) -> String {
    let kind = match kind {
        AckKind::PubAck => 1,
        AckKind::PubComp => 2,
    };
    format!("{session}:{kind}:{pkid}")
}

/// Reads an [`ACK_PROPERTY`] value back: the session, what to send and the packet id.
pub fn parse_ack_tag(tag: &str) -> Option<(u64, AckKind, u16)> {
    let mut parts = tag.splitn(3, ':');
    let session = parts.next()?.parse().ok()?;
    let kind = match parts.next()? {
        "1" => AckKind::PubAck,
        "2" => AckKind::PubComp,
        _ => return None,
    };
    Some((session, kind, parts.next()?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_tag_round_trips() {
        let tag = ack_tag(42, AckKind::PubComp, 65535);
        assert_eq!(parse_ack_tag(&tag), Some((42, AckKind::PubComp, 65535)));
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
            .ack(session.id(), AckKind::PubAck, 0x0102)
            .expect("open");
        let copy = ack.clone();
        drop(ack);
        assert!(session.take_acks().is_empty(), "a copy still holds it");
        drop(copy);
        assert_eq!(session.take_acks(), vec![0x40, 2, 1, 2]);
        sessions
            .ack(session.id(), AckKind::PubComp, 7)
            .expect("open");
        assert_eq!(session.take_acks(), vec![0x70, 2, 0, 7]);
        sessions.close(session.id());
        assert!(sessions.ack(session.id(), AckKind::PubAck, 1).is_none());
    }
}
