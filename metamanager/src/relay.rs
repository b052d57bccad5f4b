//! Standalone mode: with no cloud bridge, the outbox is delivered to the local broker on
//! `<root>/cloud/...`, where a cloud-side process (or an operator) can subscribe. Entries no
//! client subscribes to when they are relayed are deleted unpublished.

use std::sync::Arc;

use edgemeta_broker::{Message, Publisher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::outbox_handle::{OutboxHandle, PendingAck};

/// Entries read per round.
const BATCH: usize = 256;

/// Publishes outbox entries in order and deletes each batch once handed to the broker.
///
/// One store round trip per round: the deletion is queued without waiting for its commit, and
/// reads start after the last row handed over, so they never return it again. A row whose
/// deletion failed stays in the outbox and is sent again after a restart (at least once).
pub async fn run(
    outbox: OutboxHandle,
    publisher: Publisher,
    changed: Arc<Notify>,
    cancel: CancellationToken,
) {
    let mut delivered = 0;
    let mut acking: Option<PendingAck> = None;
    loop {
        let read = outbox.peek(delivered, BATCH).await;
        if let Some(ack) = acking.take() {
            if let Err(e) = ack.finish().await {
                error!(error_code = e.code(), error = %e, "outbox acknowledge failed");
            }
        }
        let entries = match read {
            Ok(entries) => entries,
            Err(e) => {
                error!(error_code = e.code(), error = %e, "outbox read failed");
                Vec::new()
            }
        };
        let full = entries.len() == BATCH;
        if let Some(last) = entries.last().map(|e| e.seq) {
            for entry in entries {
                // Published to nobody, it would cost a routing for nothing. A client
                // subscribing later gets the messages from then on, as with any QoS 0
                // publish.
                if !publisher.reaches_anyone(&entry.topic) {
                    continue;
                }
                if publisher
                    // The rows stay in the outbox until handed over: the relay waits for a
                    // reader without room as long as it takes what it holds.
                    .publish_paced(Message::new(entry.topic, entry.payload))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            delivered = last;
            match outbox.start_ack(last).await {
                Ok(ack) => acking = Some(ack),
                Err(_) => return,
            }
        }
        if full {
            if cancel.is_cancelled() {
                return;
            }
            continue;
        }
        // A short read took everything committed so far; every later commit that writes the
        // outbox notifies (a notification with nobody waiting is kept), so nothing is missed.
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = changed.notified() => {}
        }
    }
}
