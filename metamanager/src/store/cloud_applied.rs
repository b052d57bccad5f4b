//! The cloud change last applied to each object (docs/protocol.md §6.4): the node recognises a
//! change the cloud broker delivers again, or an older version arriving after a newer one, by
//! what is kept here, written in the same savepoint as the change itself.

use libsql::{params, Value};

use super::{text, Db};

/// How long a delete is remembered after it was applied: redeliveries come within one outage
/// and its reconnect, and the tombstones of a busy cluster must not pile up for ever.
const TOMBSTONE_TTL_MS: i64 = 60 * 60 * 1000;

/// The last cloud change applied to one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Its `header.resourceversion`, when it had a numeric one.
    pub rv: Option<u64>,
    pub msg_id: String,
    pub deleted: bool,
}

impl Applied {
    /// Whether a cloud change (`msg_id`, `rv`, a delete or not) is one already applied or older
    /// than it: the same message again, or a version not newer than this one. A delete of the
    /// version applied last is new (the controller's delete carries the last version it knew).
    pub fn covers(&self, msg_id: &str, rv: Option<u64>, delete: bool) -> bool {
        if self.msg_id == msg_id {
            return true;
        }
        match (self.rv, rv) {
            (Some(done), Some(new)) if delete => new < done || (new == done && self.deleted),
            (Some(done), Some(new)) => new <= done,
            _ => false,
        }
    }
}

impl Db {
    /// The cloud change last applied to `key`, if one is remembered.
    pub async fn cloud_applied(&self, key: &str) -> Result<Option<Applied>, libsql::Error> {
        const SQL: &str = "SELECT rv, msg_id, deleted FROM cloud_applied WHERE key = ?1";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([key]).await?;
        let applied = match rows.next().await? {
            Some(row) => Some(Applied {
                rv: match row.get_value(0)? {
                    Value::Integer(rv) => u64::try_from(rv).ok(),
                    _ => None,
                },
                msg_id: text(&row, 1)?.unwrap_or_default(),
                deleted: matches!(row.get_value(2)?, Value::Integer(d) if d != 0),
            }),
            None => None,
        };
        drop(rows);
        self.keep(SQL, statement);
        Ok(applied)
    }

    /// Remembers `applied` as the last cloud change of `key`; writing a delete also forgets
    /// deletes older than [`TOMBSTONE_TTL_MS`].
    pub async fn set_cloud_applied(
        &self,
        key: &str,
        applied: &Applied,
    ) -> Result<(), libsql::Error> {
        let now = edgemeta_protocol::now_ms();
        let rv = applied.rv.and_then(|rv| i64::try_from(rv).ok());
        self.exec(
            "INSERT INTO cloud_applied (key, rv, msg_id, deleted, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(key) DO UPDATE SET rv = excluded.rv, msg_id = excluded.msg_id,
                 deleted = excluded.deleted, at_ms = excluded.at_ms",
            params![key, rv, applied.msg_id.as_str(), i64::from(applied.deleted), now],
        )
        .await?;
        if applied.deleted {
            self.exec(
                "DELETE FROM cloud_applied WHERE deleted = 1 AND at_ms < ?1",
                [now - TOMBSTONE_TTL_MS],
            )
            .await?;
        }
        Ok(())
    }

    /// Forgets what the cloud applied to `key`: the node changed it on its own (edged deleted a
    /// pod), so the cloud's next copy of the same version is news again.
    pub async fn forget_cloud_applied(&self, key: &str) -> Result<(), libsql::Error> {
        self.exec("DELETE FROM cloud_applied WHERE key = ?1", [key])
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn applied(rv: Option<u64>, deleted: bool) -> Applied {
        Applied {
            rv,
            msg_id: "m1".to_owned(),
            deleted,
        }
    }

    #[test]
    fn the_same_message_or_an_older_version_is_covered() {
        let update = applied(Some(7), false);
        assert!(update.covers("m1", Some(9), false), "same message id");
        assert!(update.covers("m2", Some(7), false), "same version");
        assert!(update.covers("m2", Some(6), false), "older version");
        assert!(!update.covers("m2", Some(8), false), "newer version");
        assert!(!update.covers("m2", None, false), "unversioned: only by id");
    }

    #[test]
    fn a_delete_of_the_version_applied_is_new_once() {
        assert!(!applied(Some(7), false).covers("m2", Some(7), true));
        assert!(applied(Some(7), false).covers("m2", Some(6), true));
        let tombstone = applied(Some(7), true);
        assert!(tombstone.covers("m3", Some(7), true));
        assert!(
            tombstone.covers("m3", Some(7), false),
            "an insert older than the delete"
        );
        assert!(!tombstone.covers("m3", Some(8), false), "a new incarnation");
    }

    #[test]
    fn nothing_versioned_remembered_covers_only_the_same_message() {
        let unversioned = applied(None, false);
        assert!(unversioned.covers("m1", Some(1), false));
        assert!(!unversioned.covers("m2", Some(1), false));
    }
}
