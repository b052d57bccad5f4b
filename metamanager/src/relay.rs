//! Standalone mode: with no cloud bridge, the outbox is delivered to the local broker on
//! `<root>/cloud/...`, where a cloud-side process (or an operator) can subscribe.

use std::sync::Arc;

use edgemeta_broker::{Message, Publisher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::OutboxHandle;

/// Entries read per round.
const BATCH: usize = 256;

/// Publishes outbox entries in order and deletes each batch once handed to the broker.
pub async fn run(
    outbox: OutboxHandle,
    publisher: Publisher,
    changed: Arc<Notify>,
    cancel: CancellationToken,
) {
    loop {
        let entries = match outbox.peek(0, BATCH).await {
            Ok(entries) => entries,
            Err(e) => {
                error!(error_code = e.code(), error = %e, "outbox read failed");
                Vec::new()
            }
        };
        let Some(last) = entries.last().map(|e| e.seq) else {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = changed.notified() => continue,
            }
        };
        for entry in entries {
            if publisher
                .publish(Message::new(entry.topic, entry.payload))
                .await
                .is_err()
            {
                return;
            }
        }
        if let Err(e) = outbox.ack(last).await {
            error!(error_code = e.code(), error = %e, "outbox acknowledge failed");
        }
        if cancel.is_cancelled() {
            return;
        }
    }
}
