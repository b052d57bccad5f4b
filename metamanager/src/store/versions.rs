//! The MetaServer's version space (docs/protocol.md §9), kept by the write path.
//!
//! Every change of a served type ([`VERSIONED`]) takes the next value of one node-local
//! sequence, in the same transaction as the change: the object's `meta.rv` and one
//! `meta_history` row (the event and the object as it is after it, or was before a delete).
//! History is pruned to `history` rows in the same statement sequence. The changes of the open
//! transaction wait in [`Db`]'s pending list until the worker has committed them, then go to
//! the live watchers.

use std::sync::Arc;

use libsql::params;

use super::Db;

/// The `meta.type`s whose changes are versioned: what the MetaServer serves.
pub const VERSIONED: &[&str] = &["pod", "configmap", "secret", "service", "endpoints", "node"];

/// Whether changes of `res_type` take versions.
pub fn versioned(res_type: &str) -> bool {
    VERSIONED.contains(&res_type)
}

/// What a change did to its object, as a watch event names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Added,
    Modified,
    Deleted,
}

impl Event {
    /// `ADDED`, `MODIFIED`, `DELETED`: the watch event type, also the `meta_history.event` text.
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Added => "ADDED",
            Event::Modified => "MODIFIED",
            Event::Deleted => "DELETED",
        }
    }

    pub fn parse(text: &str) -> Option<Event> {
        match text {
            "ADDED" => Some(Event::Added),
            "MODIFIED" => Some(Event::Modified),
            "DELETED" => Some(Event::Deleted),
            _ => None,
        }
    }
}

/// One committed change of a served object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Its version: the node-local sequence.
    pub rv: u64,
    /// `meta.type` (`pod`).
    pub res_type: String,
    /// `<namespace>/<type>/<name>`.
    pub key: String,
    pub event: Event,
    /// The object as stored (the JSON the cloud sent); for a delete, as it was last.
    pub value: Arc<str>,
}

/// The committed changes of one batch, oldest first, as the live watchers get them.
pub type Changes = Arc<Vec<Change>>;

impl Db {
    /// Inserts or replaces a served object, versioning the change; an identical value is no
    /// change (no version, no event: the cloud resends what the node already has).
    pub(super) async fn upsert_versioned(
        &self,
        key: &str,
        res_type: &str,
        value: &str,
    ) -> Result<(), libsql::Error> {
        let event = match self.get(key).await? {
            None => Event::Added,
            Some(old) if old == value => return Ok(()),
            Some(_) => Event::Modified,
        };
        let rv = self.record(res_type, key, event, value).await?;
        self.exec(
            "INSERT INTO meta (key, type, value, rv) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(key) DO UPDATE SET type = excluded.type, value = excluded.value,
             rv = excluded.rv",
            params![key, res_type, value, rv as i64],
        )
        .await
        .map(drop)
    }

    /// Deletes a served object, versioning the change; the number of rows removed.
    pub(super) async fn delete_versioned(
        &self,
        key: &str,
        res_type: &str,
    ) -> Result<u64, libsql::Error> {
        let Some(old) = self.get(key).await? else {
            return Ok(0);
        };
        self.record(res_type, key, Event::Deleted, &old).await?;
        self.exec("DELETE FROM meta WHERE key = ?1", [key]).await
    }

    /// Takes the next version for a change: its history row, the prune, the pending change.
    async fn record(
        &self,
        res_type: &str,
        key: &str,
        event: Event,
        value: &str,
    ) -> Result<u64, libsql::Error> {
        self.exec(
            "INSERT INTO meta_history (type, key, event, value) VALUES (?1, ?2, ?3, ?4)",
            params![res_type, key, event.as_str(), value],
        )
        .await?;
        let rv = self.conn.last_insert_rowid();
        let keep = i64::try_from(self.history).unwrap_or(i64::MAX);
        self.exec(
            "DELETE FROM meta_history WHERE rv <= ?1",
            [rv.saturating_sub(keep)],
        )
        .await?;
        let rv = u64::try_from(rv).unwrap_or_default();
        self.pending().push(Change {
            rv,
            res_type: res_type.to_owned(),
            key: key.to_owned(),
            event,
            value: value.into(),
        });
        Ok(rv)
    }

    /// The versioned changes committed by the last transaction (taken once, after `COMMIT`).
    pub fn take_changes(&self) -> Vec<Change> {
        std::mem::take(&mut *self.pending())
    }

    /// Changes not yet committed, for a savepoint to cut back to.
    pub(super) fn pending_len(&self) -> usize {
        self.pending().len()
    }

    /// Forgets the changes after the first `len`: their savepoint or transaction was undone.
    pub(super) fn forget_changes(&self, len: usize) {
        self.pending().truncate(len);
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Vec<Change>> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
