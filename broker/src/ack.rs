//! The node's promise to acknowledge a client's publish once a module is done with it: PUBACK
//! after the commit (protocol §6.5). Each connection that publishes something a module consumes
//! gets a queue its task reads the released acknowledgements from.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

/// Which acknowledgement waits for the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckKind {
    /// QoS 1: PUBACK.
    PubAck,
    /// QoS 2: PUBREC, and so the PUBCOMP that follows it.
    PubRec,
}

/// Where a connection's task reads the acknowledgements released to it.
pub(crate) type Released = mpsc::UnboundedReceiver<(AckKind, u16)>;

/// One connection's released acknowledgements, and when it was last acknowledged.
#[derive(Debug)]
pub(crate) struct Acks {
    released: mpsc::UnboundedSender<(AckKind, u16)>,
    /// Promises not yet released.
    promised: AtomicUsize,
    /// When the last one was released (ns since [`epoch`]), 0 before the first.
    acked_at: AtomicU64,
}

impl Acks {
    /// A connection's queue; its task reads the receiver.
    pub(crate) fn new() -> (Arc<Acks>, Released) {
        let (released, rx) = mpsc::unbounded_channel();
        let acks = Acks {
            released,
            promised: AtomicUsize::new(0),
            acked_at: AtomicU64::new(0),
        };
        (Arc::new(acks), rx)
    }

    /// Promises to acknowledge `pkid` once every copy of the returned [`Ack`] is dropped.
    pub(crate) fn promise(self: &Arc<Self>, kind: AckKind, pkid: u16) -> Ack {
        let owed = self.promised.fetch_add(1, Ordering::Relaxed);
        let acked = self.acked_at.load(Ordering::Relaxed);
        Ack {
            pending: Arc::new(Pending {
                acks: self.clone(),
                kind,
                pkid,
                after_ack: (owed == 0 && acked != 0)
                    .then(|| Duration::from_nanos(now_ns().saturating_sub(acked))),
                abandoned: AtomicBool::new(false),
            }),
        }
    }
}

/// The promise itself: dropped (after its commit, or once it was answered with an error) it
/// releases the acknowledgement to the client's connection.
#[derive(Debug, Clone)]
pub struct Ack {
    pending: Arc<Pending>,
}

#[derive(Debug)]
struct Pending {
    acks: Arc<Acks>,
    kind: AckKind,
    pkid: u16,
    after_ack: Option<Duration>,
    abandoned: AtomicBool,
}

impl Ack {
    /// How long after the client's last acknowledgement it sent this publish, if it waited
    /// for none other meanwhile: a client that waits for each PUBACK before it publishes
    /// again ("stop and wait") sends its next right after it (protocol §6.1).
    pub fn after_ack(&self) -> Option<Duration> {
        self.pending.after_ack
    }

    /// Which connection waits for this acknowledgement (equal for the same connection while
    /// it lives).
    pub fn sender(&self) -> usize {
        Arc::as_ptr(&self.pending.acks) as usize
    }

    /// Whether nobody else holds a copy: no module took the message.
    pub(crate) fn sole(&self) -> bool {
        Arc::strong_count(&self.pending) == 1
    }

    /// The message will not be committed (the node is stopping): no acknowledgement is sent,
    /// so the client publishes it again.
    pub fn abandon(&self) {
        self.pending.abandoned.store(true, Ordering::Relaxed);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.acks.promised.fetch_sub(1, Ordering::Relaxed);
        if !self.abandoned.load(Ordering::Relaxed) {
            self.acks.acked_at.store(now_ns(), Ordering::Relaxed);
            // The connection may have gone; then nobody waits for it.
            let _ = self.acks.released.send((self.kind, self.pkid));
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

/// Nanoseconds on a monotonic clock, never 0.
fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64 + 1
}

fn epoch() -> std::time::Instant {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(std::time::Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_is_released_once_every_copy_is_dropped_and_never_when_abandoned() {
        let (acks, mut rx) = Acks::new();
        let ack = acks.promise(AckKind::PubAck, 7);
        let copy = ack.clone();
        drop(ack);
        assert!(rx.try_recv().is_err(), "a copy still holds it");
        drop(copy);
        assert_eq!(rx.try_recv().ok(), Some((AckKind::PubAck, 7)));
        let abandoned = acks.promise(AckKind::PubRec, 8);
        abandoned.abandon();
        drop(abandoned);
        assert!(rx.try_recv().is_err());
        let next = acks.promise(AckKind::PubAck, 9);
        assert!(
            next.after_ack().is_some(),
            "sent after an acknowledgement, none in flight"
        );
    }
}
