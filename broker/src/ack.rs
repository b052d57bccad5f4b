//! The node's promise to acknowledge a client's publish once a module is done with it: PUBACK
//! after the commit (protocol §6.5). Each connection that publishes something a module consumes
//! gets a queue of released acknowledgements; its task writes them, or, for a plain TCP client
//! whose task is not writing, the thread that released a commit's acknowledgements
//! ([`release_together`]) writes them itself, one write per connection and commit.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use rumqttc::v5::mqttbytes::v5::PubAck;

use bytes::BytesMut;

use crate::direct::{later, together, Direct, Kept, Waiting};
use crate::wire::{Packet, Wire};

/// Which acknowledgement waits for the module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckKind {
    /// QoS 1: PUBACK.
    PubAck,
    /// QoS 2: PUBREC, and so the PUBCOMP that follows it.
    PubRec,
}

/// One connection's released acknowledgements, and when it was last acknowledged.
#[derive(Debug)]
pub(crate) struct Acks {
    /// Released, not yet written, in the order they were released.
    pub(crate) released: Mutex<Vec<(AckKind, u16)>>,
    /// Rung when the connection's task has some to write.
    pub(crate) bell: Notify,
    /// Its socket, when released ones may be written from the releasing thread.
    direct: Option<Arc<Direct>>,
    /// Promises not yet released.
    promised: AtomicUsize,
    /// When the last one was released (ns since [`epoch`]), 0 before the first.
    acked_at: AtomicU64,
}

/// Runs `release`, which drops [`Ack`]s, and sends each connection the acknowledgements it
/// released at the end, together: one write per connection rather than one per publish.
pub fn release_together<R>(release: impl FnOnce() -> R) -> R {
    let _together = crate::direct::Together::begin();
    release()
}

impl Acks {
    /// A connection's queue; `direct` its socket when others may write to it.
    pub(crate) fn new(direct: Option<Arc<Direct>>) -> Arc<Acks> {
        Arc::new(Acks {
            released: Mutex::new(Vec::new()),
            bell: Notify::new(),
            direct,
            promised: AtomicUsize::new(0),
            acked_at: AtomicU64::new(0),
        })
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
                with: Mutex::new(None),
            }),
        }
    }

    /// Takes what was released, in order.
    pub(crate) fn take(&self) -> Vec<(AckKind, u16)> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(AckKind, u16)>> {
        self.released.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Released PUBACKs are written from the releasing thread if the socket is free; a PUBREC is
/// the task's to write (it changes the task's QoS 2 state).
impl Waiting for Acks {
    fn socket(&self) -> Option<Arc<Direct>> {
        self.direct.clone()
    }

    fn encode(&self, wire: Wire, max_out: Option<u32>, out: &mut BytesMut) -> Option<bool> {
        let mut released = self.lock();
        if released.iter().any(|(kind, _)| *kind != AckKind::PubAck) {
            return None;
        }
        let any = !released.is_empty();
        for (_, pkid) in released.drain(..) {
            let ack = Packet::PubAck(PubAck::new(pkid, None));
            if let Err(e) = wire.write(ack, out, max_out) {
                tracing::debug!(error = %e, "acknowledgement not written");
            }
        }
        Some(any)
    }

    fn ring(&self) {
        self.bell.notify_one();
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
    /// What goes out with it, in one write ([`Ack::send_with`]).
    with: Mutex<Option<Kept>>,
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

    /// The socket it may be written into from outside the connection's task, if any (equal
    /// for the same socket while it lives): for [`crate::Together::keep_for`].
    pub fn socket(&self) -> Option<usize> {
        self.pending
            .acks
            .direct
            .as_ref()
            .map(|d| Arc::as_ptr(d) as usize)
    }

    /// Whether nobody else holds a copy: no module took the message.
    pub(crate) fn sole(&self) -> bool {
        Arc::strong_count(&self.pending) == 1
    }

    /// What `kept` holds for this client goes out with this acknowledgement once it is
    /// released, in one write, by whichever thread releases it (or at once, if it never is).
    pub fn send_with(&self, kept: Kept) {
        let mut with = self
            .pending
            .with
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(earlier) = with.replace(kept) {
            drop(with);
            drop(earlier);
        }
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
        let with = self
            .with
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if self.abandoned.load(Ordering::Relaxed) {
            return;
        }
        self.acks.acked_at.store(now_ns(), Ordering::Relaxed);
        // The connection may have gone; then nobody reads it.
        self.acks.lock().push((self.kind, self.pkid));
        let Some(kept) = with else {
            if !later(self.acks.clone()) {
                self.acks.bell.notify_one();
            }
            return;
        };
        together(|| {
            drop(kept);
            later(self.acks.clone())
        });
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
    use std::future::Future;

    #[test]
    fn an_ack_is_released_once_every_copy_is_dropped_and_never_when_abandoned() {
        let acks = Acks::new(None);
        let ack = acks.promise(AckKind::PubAck, 7);
        let copy = ack.clone();
        drop(ack);
        assert!(acks.take().is_empty(), "a copy still holds it");
        drop(copy);
        assert_eq!(acks.take(), [(AckKind::PubAck, 7)]);
        let abandoned = acks.promise(AckKind::PubRec, 8);
        abandoned.abandon();
        drop(abandoned);
        assert!(acks.take().is_empty());
        let next = acks.promise(AckKind::PubAck, 9);
        assert!(
            next.after_ack().is_some(),
            "sent after an acknowledgement, none in flight"
        );
    }

    /// Whether the connection's task was rung (takes the ring).
    fn rung(acks: &Acks) -> bool {
        let notified = std::pin::pin!(acks.bell.notified());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        notified.poll(&mut cx).is_ready()
    }

    #[test]
    fn released_together_they_ring_once_at_the_end_in_order() {
        let acks = Acks::new(None);
        let promised: Vec<Ack> = (1..=3).map(|i| acks.promise(AckKind::PubAck, i)).collect();
        release_together(|| {
            drop(promised);
            assert!(!rung(&acks), "held back until the end");
        });
        assert!(rung(&acks));
        let pkids: Vec<u16> = acks.take().into_iter().map(|(_, p)| p).collect();
        assert_eq!(pkids, [1, 2, 3]);
        drop(acks.promise(AckKind::PubAck, 4));
        assert!(rung(&acks), "alone, at once");
    }
}
