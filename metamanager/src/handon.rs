//! Hand-ons: every local message the MetaManager publishes after a commit (to edged, edgemesh,
//! requesters, devices) is written to the store's `handon` table in that commit, and handed to
//! the broker only as fast as its subscribers read (`Publisher::publish_paced`). What waits for
//! a slow subscriber waits on disk, not in memory, and the worker never waits for subscribers.
//!
//! The worker also passes each commit's hand-ons to the pump over a bounded channel, so the pump
//! reads the store only when it fell behind (the channel was full) or after a restart. And when
//! nothing waits and every subscriber has room, the worker skips the table altogether: it counts
//! the messages against their subscribers' room before the commit and publishes them after it.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::{is_carried, Message, Publisher};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::outbox_handle::{OutboxHandle, PendingAck};

/// Hand-ons read from the store per round, and handed over between two deletions.
const BATCH: usize = 256;
/// Commits whose hand-ons may wait in memory for the pump; past that they wait in the store.
const FEED_CAPACITY: usize = 64;
/// How soon hand-ons already handed over are deleted once the pump is idle.
const ACK_IDLE: Duration = Duration::from_millis(20);

/// Hand-ons committed and not yet handed to the broker, for the node's metrics.
#[derive(Debug, Default)]
pub struct HandonGauge {
    committed: AtomicI64,
    handed: AtomicI64,
}

impl HandonGauge {
    /// Whether the pump has handed on everything stored: a message may then go straight out
    /// without overtaking one that waits.
    pub fn caught_up(&self) -> bool {
        self.handed.load(Ordering::Relaxed) >= self.committed.load(Ordering::Relaxed)
    }

    /// Hand-ons left in the store by an earlier run, up to `seq`, come first.
    pub fn left_from_before(&self, seq: i64) {
        self.committed.fetch_max(seq, Ordering::Relaxed);
    }

    /// Hand-ons waiting for their subscribers (an estimate across restarts: seqs only grow).
    pub fn waiting(&self) -> u64 {
        let committed = self.committed.load(Ordering::Relaxed);
        let handed = self.handed.load(Ordering::Relaxed);
        u64::try_from(committed - handed).unwrap_or(0)
    }
}

/// The worker's side: hands each commit's hand-ons to the pump.
pub struct Feed {
    tx: mpsc::Sender<Vec<(i64, Message)>>,
    spilled: Arc<AtomicBool>,
    wake: Arc<Notify>,
    gauge: Arc<HandonGauge>,
}

impl Feed {
    /// The gauge the pump keeps up to date.
    pub fn gauge(&self) -> &HandonGauge {
        &self.gauge
    }

    /// One commit's hand-ons, in seq order. When the pump is behind they are left in the
    /// store, where it finds them.
    pub fn committed(&self, handons: Vec<(i64, Message)>) {
        let Some(&(last, _)) = handons.last() else {
            return;
        };
        self.gauge.committed.fetch_max(last, Ordering::Relaxed);
        if self.tx.try_send(handons).is_err() {
            self.spilled.store(true, Ordering::Relaxed);
            self.wake.notify_one();
        }
    }
}

/// The pump's side of a [`Feed`].
pub struct Pump {
    rx: mpsc::Receiver<Vec<(i64, Message)>>,
    spilled: Arc<AtomicBool>,
    wake: Arc<Notify>,
    gauge: Arc<HandonGauge>,
}

/// A connected feed and pump, with the gauge both update.
pub fn channel() -> (Feed, Pump, Arc<HandonGauge>) {
    let (tx, rx) = mpsc::channel(FEED_CAPACITY);
    let spilled = Arc::new(AtomicBool::new(false));
    let wake = Arc::new(Notify::new());
    let gauge = Arc::new(HandonGauge::default());
    let feed = Feed {
        tx,
        spilled: spilled.clone(),
        wake: wake.clone(),
        gauge: gauge.clone(),
    };
    let pump = Pump {
        rx,
        spilled,
        wake,
        gauge: gauge.clone(),
    };
    (feed, pump, gauge)
}

/// Hands on committed messages in seq order, paced by their subscribers, and deletes them once
/// handed to the broker. Ends when cancelled: what is left goes out at the next start.
pub async fn run(
    mut pump: Pump,
    store: OutboxHandle,
    publisher: Publisher,
    cancel: CancellationToken,
) {
    let mut cursor = 0_i64;
    // Rows left by an earlier run come first.
    let mut behind = true;
    let mut acked = 0_i64;
    let mut acking: Option<PendingAck> = None;
    loop {
        if behind || pump.spilled.swap(false, Ordering::Relaxed) {
            let rows = match store.handon_peek(cursor, BATCH).await {
                Ok(rows) => rows,
                Err(e) => {
                    error!(error_code = e.code(), error = %e, "reading hand-ons failed");
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    }
                }
            };
            behind = rows.len() == BATCH;
            for (seq, message) in rows {
                if !hand_on(&publisher, message, &cancel).await {
                    return;
                }
                cursor = seq;
                pump.gauge.handed.store(cursor, Ordering::Relaxed);
            }
        } else {
            let idle = acked < cursor;
            tokio::select! {
                _ = cancel.cancelled() => return,
                batch = pump.rx.recv() => {
                    let Some(batch) = batch else { return };
                    for (seq, message) in batch {
                        if seq <= cursor {
                            continue;
                        }
                        if seq != cursor + 1 && cursor != 0 {
                            // One went by the store only: take the rest from there, in order.
                            behind = true;
                            break;
                        }
                        if !hand_on(&publisher, message, &cancel).await {
                            return;
                        }
                        cursor = seq;
                        pump.gauge.handed.store(cursor, Ordering::Relaxed);
                    }
                }
                () = pump.wake.notified() => {}
                () = tokio::time::sleep(ACK_IDLE), if idle => {
                    acked = forget(&store, cursor, &mut acking).await;
                    continue;
                }
            }
        }
        if cursor - acked >= BATCH as i64 {
            acked = forget(&store, cursor, &mut acking).await;
        }
    }
}

/// A device message (`$hw`/`$ke`) no client subscribes to: it is
/// dropped instead of published. Only the MetaManager's own link would get it, and it drops
/// its own results unread; on the way the router would append it to that link's log and wake
/// it (a `…/document` per twin report, which mappers seldom subscribe to).
pub(crate) fn unheard(publisher: &Publisher, message: &Message) -> bool {
    is_carried(message.topic.as_bytes()) && !publisher.reaches_anyone(&message.topic)
}

/// Publishes one hand-on once its subscribers have room; `false` when the node is stopping.
async fn hand_on(publisher: &Publisher, message: Message, cancel: &CancellationToken) -> bool {
    if unheard(publisher, &message) {
        return true;
    }
    tokio::select! {
        _ = cancel.cancelled() => false,
        published = publisher.publish_paced(message) => published.is_ok(),
    }
}

/// Deletes the hand-ons up to `cursor` (handed over); the previous deletion's outcome is read
/// first, so at most one is pending. A failed deletion sends those rows again after a restart.
async fn forget(store: &OutboxHandle, cursor: i64, acking: &mut Option<PendingAck>) -> i64 {
    if let Some(pending) = acking.take() {
        if let Err(e) = pending.finish().await {
            error!(error_code = e.code(), error = %e, "deleting hand-ons failed");
        }
    }
    match store.handon_start_ack(cursor).await {
        Ok(pending) => *acking = Some(pending),
        Err(e) => error!(error_code = e.code(), error = %e, "deleting hand-ons failed"),
    }
    cursor
}
