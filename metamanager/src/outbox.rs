//! The cloud outbox, every rule of it: what may be appended (limits), how whoever delivers it
//! (the local relay or the cloud bridge) reads and acknowledges it (through `outbox_handle.rs`),
//! which batches need an fsync, and the running counters. The SQL itself is in [`crate::store`];
//! the worker runs these calls.

use edgemeta_broker::Message;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::store::Db;

pub use crate::store::{OutboxEntry, OutboxStats};

/// Where the store worker sends a call's result.
pub type Reply<T> = oneshot::Sender<Result<T, Error>>;

/// The most the outbox may hold before cloud-bound changes are refused.
#[derive(Debug, Clone, Copy)]
pub struct OutboxLimit {
    pub entries: u64,
    pub bytes: u64,
}

/// An outbox change: applied inside the batch's transaction, answered after its commit.
pub enum Write {
    /// Queue a message another module published on `<root>/cloud/...`.
    Append {
        topic: String,
        payload: Vec<u8>,
        reply: Reply<()>,
    },
    /// Delete every entry up to `seq`, once delivered.
    Ack { seq: i64, reply: Reply<()> },
    /// Delete every hand-on up to `seq`, once handed to the broker (`handon.rs`).
    HandonAck { seq: i64, reply: Reply<()> },
}

/// An outbox read: answered from committed (for a peek: synced) state, after the batch it
/// arrived with.
pub enum Read {
    /// The oldest `limit` entries with `seq > after`.
    Peek {
        after: i64,
        limit: usize,
        reply: Reply<Vec<OutboxEntry>>,
    },
    /// The oldest `limit` hand-ons with `seq > after`.
    HandonPeek {
        after: i64,
        limit: usize,
        reply: Reply<Vec<(i64, Message)>>,
    },
    /// Depth, size and the creation time of the oldest entry.
    Stats { reply: Reply<OutboxStats> },
    /// The same from the running counters and one indexed lookup: no scan, for health checks.
    Summary { reply: Reply<OutboxStats> },
}

/// Whether a batch's commit must reach the disk. One that only deletes delivered entries need
/// not: a power cut that undid it sends those entries again, which at-least-once allows. In
/// standalone mode every batch of requests is followed by such a batch, so this saves many fsyncs.
pub fn needs_fsync(requests: usize, writes: &[Write]) -> bool {
    requests > 0 || writes.iter().any(|w| matches!(w, Write::Append { .. }))
}

/// Appends unless that would pass `limit`: a full outbox refuses the change (the requester gets
/// an `error`) rather than dropping anything already queued. `counters` follow the append.
pub async fn append(
    db: &Db,
    counters: &mut OutboxStats,
    limit: OutboxLimit,
    topic: &str,
    payload: &[u8],
) -> Result<(), Error> {
    let size = payload.len() as u64;
    if counters.entries >= limit.entries || counters.bytes + size > limit.bytes {
        return Err(Error::OutboxFull {
            entries: counters.entries,
            bytes: counters.bytes,
        });
    }
    db.outbox_push(topic, payload)
        .await
        .map_err(Error::store("queue message for the cloud"))?;
    counters.entries += 1;
    counters.bytes += size;
    Ok(())
}

/// Applies `write` inside the open transaction; returns where its result goes, the result, and
/// whether the outbox gained an entry.
pub async fn apply(
    write: Write,
    db: &Db,
    counters: &mut OutboxStats,
    limit: OutboxLimit,
) -> (Reply<()>, Result<(), Error>, bool) {
    match write {
        Write::Ack { seq, reply } => {
            let result = db.outbox_ack(seq).await;
            if let Ok((entries, bytes)) = result {
                counters.entries = counters.entries.saturating_sub(entries);
                counters.bytes = counters.bytes.saturating_sub(bytes);
            }
            let result = result.map(drop).map_err(Error::store("acknowledge outbox"));
            (reply, result, false)
        }
        Write::HandonAck { seq, reply } => {
            let result = db.handon_ack(seq).await;
            (
                reply,
                result.map_err(Error::store("delete hand-ons")),
                false,
            )
        }
        Write::Append {
            topic,
            payload,
            reply,
        } => {
            let result = append(db, counters, limit, &topic, &payload).await;
            let appended = result.is_ok();
            (reply, result, appended)
        }
    }
}

/// Answers `read` from committed state; a peek sees the entries up to `synced` only (protocol
/// §6.1: what leaves for the cloud is durable). A stats read also re-anchors the running
/// counters.
pub async fn answer(read: Read, db: &Db, counters: &mut OutboxStats, synced: i64) {
    match read {
        Read::Peek {
            after,
            limit,
            reply,
        } => {
            let result = db.outbox_peek(after, synced, limit).await;
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
        Read::HandonPeek {
            after,
            limit,
            reply,
        } => {
            let result = db.handon_peek(after, limit).await;
            let _ = reply.send(result.map_err(Error::store("read hand-ons")));
        }
        Read::Stats { reply } => {
            let result = db.outbox_stats().await;
            if let Ok(stats) = result {
                *counters = stats;
            }
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
        Read::Summary { reply } => {
            let result = db.outbox_oldest_ms().await.map(|oldest_ms| OutboxStats {
                oldest_ms,
                ..*counters
            });
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
    }
}

impl Write {
    /// Tells the caller the batch was not committed.
    pub fn fail(self, error: &Error) {
        let (Write::Append { reply, .. }
        | Write::Ack { reply, .. }
        | Write::HandonAck { reply, .. }) = self;
        let _ = reply.send(Err(Error::Commit(error.to_string())));
    }
}
