//! The cloud change last applied to each object (docs/protocol.md §6.4): the node recognises a
//! change the cloud broker delivers again, or an older version arriving after a newer one, by
//! what is kept here, written in the same savepoint as the change itself.

use libsql::params;

use super::Db;

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
    /// [`Db::claim_cloud_change`] decides the same in its statement; this is its reference.
    #[cfg(test)]
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
    #[cfg(test)]
    pub async fn cloud_applied(&self, key: &str) -> Result<Option<Applied>, libsql::Error> {
        use super::text;
        use libsql::Value;
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

    /// Records `change` as the last cloud change of `key` unless the one remembered covers it
    /// (the same message, or a version not older; [`Applied::covers`]): whether it is new and
    /// must be applied. One statement for the test and the write, in the change's savepoint;
    /// a new delete also forgets deletes older than [`TOMBSTONE_TTL_MS`].
    pub async fn claim_cloud_change(
        &self,
        key: &str,
        change: &Applied,
    ) -> Result<bool, libsql::Error> {
        const SQL: &str = "INSERT INTO cloud_applied (key, rv, msg_id, deleted, at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(key) DO UPDATE SET rv = excluded.rv, msg_id = excluded.msg_id,
                 deleted = excluded.deleted, at_ms = excluded.at_ms
             WHERE cloud_applied.msg_id <> excluded.msg_id
               AND (cloud_applied.rv IS NULL OR excluded.rv IS NULL
                    OR excluded.rv > cloud_applied.rv
                    OR (excluded.deleted AND excluded.rv = cloud_applied.rv
                        AND NOT cloud_applied.deleted))";
        let now = edgemeta_protocol::now_ms();
        let rv = change.rv.and_then(|rv| i64::try_from(rv).ok());
        let claimed = self
            .exec(
                SQL,
                params![
                    key,
                    rv,
                    change.msg_id.as_str(),
                    i64::from(change.deleted),
                    now
                ],
            )
            .await?
            > 0;
        if claimed && change.deleted {
            self.exec(
                "DELETE FROM cloud_applied WHERE deleted = 1 AND at_ms < ?1",
                [now - TOMBSTONE_TTL_MS],
            )
            .await?;
        }
        Ok(claimed)
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

    /// The statement decides as [`Applied::covers`] for every combination of what is remembered
    /// and what arrives, and records only what it takes as new.
    #[tokio::test]
    async fn the_claim_decides_as_covers_does() {
        let dir = tempfile::tempdir().expect("dir");
        let config = crate::store::StoreConfig {
            path: dir.path().join("claim.db"),
            ..crate::store::StoreConfig::default()
        };
        let db = Db::open(&config).await.expect("open");
        let rvs = [None, Some(6), Some(7), Some(8)];
        let mut case = 0;
        for remembered_rv in rvs {
            for remembered_delete in [false, true] {
                for msg_id in ["m1", "m2"] {
                    for rv in rvs {
                        for delete in [false, true] {
                            case += 1;
                            let key = format!("default/pod/p{case}");
                            let remembered = Applied {
                                rv: remembered_rv,
                                msg_id: "m1".into(),
                                deleted: remembered_delete,
                            };
                            assert!(db
                                .claim_cloud_change(&key, &remembered)
                                .await
                                .expect("first"));
                            let change = Applied {
                                rv,
                                msg_id: msg_id.into(),
                                deleted: delete,
                            };
                            let new = !remembered.covers(msg_id, rv, delete);
                            let claimed =
                                db.claim_cloud_change(&key, &change).await.expect("claim");
                            assert_eq!(claimed, new, "{remembered:?} then {change:?}");
                            let kept = db.cloud_applied(&key).await.expect("read");
                            let expected = if new { change } else { remembered };
                            assert_eq!(kept, Some(expected));
                        }
                    }
                }
            }
        }
    }

    /// Schema 8 rebuilds the table keyed by `key` alone; what it remembered stays.
    #[tokio::test]
    async fn what_was_applied_survives_the_rebuild() {
        let dir = tempfile::tempdir().expect("dir");
        let config = crate::store::StoreConfig {
            path: dir.path().join("rebuild.db"),
            ..crate::store::StoreConfig::default()
        };
        let db = Db::open(&config).await.expect("open");
        let change = applied(Some(7), true);
        assert!(db
            .claim_cloud_change("default/pod/a", &change)
            .await
            .expect("claim"));
        db.control("PRAGMA user_version=7")
            .await
            .expect("version 7");
        drop(db);
        let db = Db::open(&config).await.expect("reopen");
        assert_eq!(
            db.cloud_applied("default/pod/a").await.expect("read"),
            Some(change.clone())
        );
        assert!(!db
            .claim_cloud_change("default/pod/a", &change)
            .await
            .expect("claim again"));
    }
}
