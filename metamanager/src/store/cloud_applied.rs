//! The cloud change last applied to each object (docs/protocol.md §6.4): the node recognises a
//! change the cloud broker delivers again, or an older version arriving after a newer one, by
//! what is kept, written in the same savepoint as the change itself. An object the cloud stored
//! keeps it on its own `meta` row (`applied_rv`, `applied_msg_id`), written by the same upsert;
//! `cloud_applied` keeps deletes (for an hour), lists, and what was applied before schema 9.

use libsql::{params, Row, Value};

use super::versions::{versioned, Event};
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
    /// [`Db::claim_cloud_change`] decides the same in its statement.
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

/// The change columns `rv, msg_id, deleted` from `at` on; None when no message id is kept.
fn applied_at(row: &Row, at: i32) -> Result<Option<Applied>, libsql::Error> {
    let Some(msg_id) = text(row, at + 1)? else {
        return Ok(None);
    };
    Ok(Some(Applied {
        rv: match row.get_value(at)? {
            Value::Integer(rv) => u64::try_from(rv).ok(),
            _ => None,
        },
        msg_id,
        deleted: matches!(row.get_value(at + 2)?, Value::Integer(d) if d != 0),
    }))
}

/// The cloud change a `meta` row keeps ([`Db::claim_cloud_change`] looks there first).
pub(super) const APPLIED_ON_ROW: &str =
    "SELECT applied_rv, applied_msg_id, 0 FROM meta WHERE type = ?2 AND key = ?1";

/// A cloud change's one read ([`Db::upsert_cloud_change`]): the stored value and what was
/// applied, on the row or in `cloud_applied`.
pub(super) const READ: &str = "SELECT 1, value, applied_rv, applied_msg_id, 0, rv FROM meta
         WHERE type = ?2 AND key = ?1
     UNION ALL SELECT 2, NULL, rv, msg_id, deleted, NULL FROM cloud_applied WHERE key = ?1";

impl Db {
    /// The cloud change last applied to `key` as `cloud_applied` keeps it, if it does.
    #[cfg(test)]
    pub async fn cloud_applied(&self, key: &str) -> Result<Option<Applied>, libsql::Error> {
        self.applied_by(
            "SELECT rv, msg_id, deleted FROM cloud_applied WHERE key = ?1",
            vec![key],
        )
        .await
    }

    /// The cloud change last applied to `key` as its `meta` row keeps it, if it does.
    pub(super) async fn applied_on_row(&self, key: &str) -> Result<Option<Applied>, libsql::Error> {
        self.applied_by(APPLIED_ON_ROW, vec![key, super::type_of(key)])
            .await
    }

    /// The change `sql` reads with `params` (columns `rv, msg_id, deleted`), if any.
    async fn applied_by(
        &self,
        sql: &'static str,
        params: Vec<&str>,
    ) -> Result<Option<Applied>, libsql::Error> {
        let statement = self.statement(sql).await?;
        let mut rows = statement.query(params).await?;
        let applied = match rows.next().await? {
            Some(row) => applied_at(&row, 0)?,
            None => None,
        };
        drop(rows);
        self.keep(sql, statement);
        Ok(applied)
    }

    /// Stores `value` under `key` as the cloud change `change` unless the change remembered
    /// covers it ([`Applied::covers`]): whether it was new and stored. The change is kept on the
    /// row by the upsert that writes it; one read finds the stored value and what was applied,
    /// on the row or, for an object without one there, in `cloud_applied`. An `insert` is first
    /// tried as an object the node has not got ([`Db::add_new`]), which needs no read.
    pub async fn upsert_cloud_change(
        &self,
        key: &str,
        res_type: &str,
        value: &str,
        change: &Applied,
        insert: bool,
    ) -> Result<bool, libsql::Error> {
        let rv = change.rv.and_then(|rv| i64::try_from(rv).ok());
        let msg_id = change.msg_id.as_str();
        // Most inserts the cloud sends are of objects the node has not got: no read first.
        if insert && self.add_new(key, res_type, value, rv, msg_id).await? {
            return Ok(true);
        }
        let statement = self.statement(READ).await?;
        let mut rows = statement.query([key, super::type_of(key)]).await?;
        let (mut stored, mut on_row, mut kept, mut version) = (None, None, None, 0);
        while let Some(row) = rows.next().await? {
            if matches!(row.get_value(0)?, Value::Integer(1)) {
                stored = Some(text(&row, 1)?);
                on_row = applied_at(&row, 2)?;
                version = row.get::<Option<i64>>(5)?.unwrap_or_default();
            } else {
                kept = applied_at(&row, 2)?;
            }
        }
        drop(rows);
        self.keep(READ, statement);
        if on_row
            .or(kept)
            .is_some_and(|done| done.covers(&change.msg_id, change.rv, false))
        {
            return Ok(false);
        }
        if !versioned(res_type) {
            self.exec(
                "INSERT INTO meta (key, type, value, applied_rv, applied_msg_id)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT(type, key) DO UPDATE SET value = excluded.value,
                     applied_rv = excluded.applied_rv, applied_msg_id = excluded.applied_msg_id",
                params![key, res_type, value, rv, msg_id],
            )
            .await?;
            return Ok(true);
        }
        let event = match stored.flatten() {
            None => Event::Added,
            Some(old) if old == value => {
                // Nothing changed for a watcher: no version, only the change remembered.
                self.exec(
                    "UPDATE meta SET applied_rv = ?2, applied_msg_id = ?3
                     WHERE type = ?4 AND key = ?1",
                    params![key, rv, msg_id, super::type_of(key)],
                )
                .await?;
                return Ok(true);
            }
            Some(old) => {
                self.settle(version, &old).await?;
                Event::Modified
            }
        };
        let version = self.record(res_type, key, event, value).await?;
        self.exec(
            "INSERT INTO meta (key, type, value, rv, applied_rv, applied_msg_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT(type, key) DO UPDATE SET value = excluded.value, rv = excluded.rv,
                 applied_rv = excluded.applied_rv, applied_msg_id = excluded.applied_msg_id",
            params![key, res_type, value, version as i64, rv, msg_id],
        )
        .await?;
        Ok(true)
    }

    /// Adds `value` under `key` as a cloud change (`applied_rv`, `applied_msg_id`) if the node
    /// has neither the object nor a change remembered for it (a delete's): whether it was
    /// added. When not, nothing was written, and [`Db::upsert_cloud_change`] reads and decides.
    async fn add_new(
        &self,
        key: &str,
        res_type: &str,
        value: &str,
        rv: Option<i64>,
        msg_id: &str,
    ) -> Result<bool, libsql::Error> {
        // `OR IGNORE` rather than `ON CONFLICT DO NOTHING`: `(type, key)` is meta's one unique
        // index, so both skip the same rows, but an `INSERT … SELECT` that may abort opens a
        // statement journal, a copy of every page it touches (SQLite's insert.c,
        // `sqlite3BeginWriteOperation(pParse, pSelect || pTrigger, iDb)`, and vdbeaux.c,
        // `usesStmtJournal = isMultiWrite && mayAbort`); one that ignores cannot abort.
        if !versioned(res_type) {
            let added = self
                .exec(
                    "INSERT OR IGNORE INTO meta (key, type, value, applied_rv, applied_msg_id)
                     SELECT ?1, ?2, ?3, ?4, ?5
                     WHERE NOT EXISTS (SELECT 1 FROM cloud_applied WHERE key = ?1)",
                    params![key, res_type, value, rv, msg_id],
                )
                .await?;
            return Ok(added == 1);
        }
        // The object's version is the history's next; `record` takes that same one just below,
        // as nothing else writes the history in between on this connection. After the first
        // change of a transaction it is known here, which spares a batch's other adds the
        // read of the history's last row.
        let next = self.next_version();
        let added = match next {
            Some(next) => {
                self.exec(
                    "INSERT OR IGNORE INTO meta (key, type, value, rv, applied_rv, applied_msg_id)
                     SELECT ?1, ?2, ?3, ?6, ?4, ?5
                     WHERE NOT EXISTS (SELECT 1 FROM cloud_applied WHERE key = ?1)",
                    params![key, res_type, value, rv, msg_id, next],
                )
                .await?
            }
            None => {
                self.exec(
                    "INSERT OR IGNORE INTO meta (key, type, value, rv, applied_rv, applied_msg_id)
                     SELECT ?1, ?2, ?3, coalesce((SELECT max(rv) FROM meta_history), 0) + 1, ?4, ?5
                     WHERE NOT EXISTS (SELECT 1 FROM cloud_applied WHERE key = ?1)",
                    params![key, res_type, value, rv, msg_id],
                )
                .await?
            }
        };
        if added == 0 {
            return Ok(false);
        }
        let recorded = self.record(res_type, key, Event::Added, value).await?;
        if next.is_some_and(|next| u64::try_from(next) != Ok(recorded)) {
            // Never expected; the message fails and its savepoint undoes both rows.
            return Err(libsql::Error::Misuse(format!(
                "{key} took version {recorded}, its row says {next:?}"
            )));
        }
        Ok(true)
    }

    /// Records `change` (a delete, or a list's) as the last cloud change of `key` unless the one
    /// remembered covers it (the same message, or a version not older; [`Applied::covers`]):
    /// whether it is new and must be applied. What the object's row keeps is looked at first;
    /// then one statement tests and writes `cloud_applied`, in the change's savepoint. A new
    /// delete also forgets deletes older than [`TOMBSTONE_TTL_MS`].
    pub async fn claim_cloud_change(
        &self,
        key: &str,
        change: &Applied,
    ) -> Result<bool, libsql::Error> {
        if let Some(done) = self.applied_on_row(key).await? {
            if done.covers(&change.msg_id, change.rv, change.deleted) {
                return Ok(false);
            }
        }
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
        let (_dir, _, db) = crate::store::fresh_store().await;
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

    /// A change of message `msg_id` and version `rv`, a delete or not.
    fn change(msg_id: &str, rv: u64, deleted: bool) -> Applied {
        Applied {
            rv: Some(rv),
            msg_id: msg_id.into(),
            deleted,
        }
    }

    /// A stored object's change is remembered on its own row, served type or not: the same
    /// message or an older version again is neither stored nor recorded, a delete older than
    /// what was stored is refused, and after a delete only a newer version comes back.
    #[tokio::test]
    async fn a_stored_objects_change_is_remembered_on_its_row() {
        let (_dir, _, db) = crate::store::fresh_store().await;
        for res_type in ["pod", "configmap", "device"] {
            let key = format!("default/{res_type}/a");
            let store = |value: &'static str, applied: Applied| {
                let (db, key) = (&db, key.clone());
                async move {
                    db.upsert_cloud_change(&key, res_type, value, &applied, true)
                        .await
                        .expect("upsert")
                }
            };
            assert!(store("v5", change("m5", 5, false)).await, "{res_type}: new");
            assert!(
                !store("v5b", change("m5", 5, false)).await,
                "the same message"
            );
            assert!(
                !store("v4", change("m4", 4, false)).await,
                "an older version"
            );
            assert!(store("v5", change("m6", 6, false)).await, "unchanged value");
            assert!(
                !store("v5", change("m6", 6, false)).await,
                "recorded all the same"
            );
            assert_eq!(db.get(&key).await.expect("get").as_deref(), Some("v5"));
            assert_eq!(db.cloud_applied(&key).await.expect("read"), None);
            let claim = |applied: Applied| {
                let (db, key) = (&db, key.clone());
                async move { db.claim_cloud_change(&key, &applied).await.expect("claim") }
            };
            assert!(
                !claim(change("d5", 5, true)).await,
                "a delete older than v6"
            );
            assert!(claim(change("d6", 6, true)).await, "the delete of v6");
            db.delete(&key).await.expect("delete");
            assert!(
                !store("v6", change("m6b", 6, false)).await,
                "not newer than the delete"
            );
            assert!(
                store("v7", change("m7", 7, false)).await,
                "a new incarnation"
            );
            assert_eq!(db.get(&key).await.expect("get").as_deref(), Some("v7"));
        }
        // What an earlier schema kept in `cloud_applied` for a stored object still counts.
        assert!(db
            .claim_cloud_change("default/pod/old", &change("m7", 7, false))
            .await
            .expect("claim"));
        db.upsert("default/pod/old", "pod", "v7")
            .await
            .expect("upsert");
        for (applied, new) in [
            (change("m6", 6, false), false),
            (change("m8", 8, false), true),
        ] {
            let stored = db
                .upsert_cloud_change("default/pod/old", "pod", "v", &applied, false)
                .await
                .expect("upsert");
            assert_eq!(stored, new, "{applied:?}");
        }
    }

    /// An insert of an object the node has not got is added without a read, with the version
    /// its history row takes and the change remembered on its row; an object stored already,
    /// or one a remembered delete covers, is left untouched to the read that decides.
    #[tokio::test]
    async fn a_new_object_from_the_cloud_is_added_with_its_version_and_its_change() {
        let (_dir, _, db) = crate::store::fresh_store().await;
        let versions = |key: &'static str| {
            let db = &db;
            async move {
                let mut rows = db
                    .conn
                    .query(
                        "SELECT meta.rv, (SELECT max(rv) FROM meta_history WHERE key = ?1),
                                (SELECT event FROM meta_history WHERE key = ?1 ORDER BY rv DESC)
                         FROM meta WHERE key = ?1",
                        [key],
                    )
                    .await
                    .expect("versions");
                let row = rows.next().await.expect("row").expect("stored");
                (
                    row.get::<i64>(0).expect("rv"),
                    row.get::<i64>(1).expect("history rv"),
                    row.get::<String>(2).expect("event"),
                )
            }
        };
        db.upsert("default/pod/first", "pod", "{}")
            .await
            .expect("upsert");
        assert!(db
            .add_new("default/pod/a", "pod", "v1", Some(1), "m1")
            .await
            .expect("add"));
        assert_eq!(versions("default/pod/a").await, (2, 2, "ADDED".into()));
        assert_eq!(
            db.applied_on_row("default/pod/a").await.expect("applied"),
            Some(change("m1", 1, false))
        );
        let pending = db.take_changes();
        assert_eq!(
            pending.last().map(|c| (c.rv, c.event)),
            Some((2, Event::Added))
        );
        assert!(
            !db.add_new("default/pod/a", "pod", "v2", Some(2), "m2")
                .await
                .expect("add"),
            "stored already"
        );
        assert_eq!(
            db.get("default/pod/a").await.expect("get").as_deref(),
            Some("v1")
        );
        assert!(db
            .claim_cloud_change("default/pod/gone", &change("d3", 3, true))
            .await
            .expect("claim"));
        assert!(
            !db.add_new("default/pod/gone", "pod", "v2", Some(2), "m2")
                .await
                .expect("add"),
            "a delete is remembered"
        );
        assert_eq!(db.get("default/pod/gone").await.expect("get"), None);
        assert!(db
            .add_new("default/configmap/c", "configmap", "c1", Some(1), "c1")
            .await
            .expect("add"));
        assert_eq!(
            versions("default/configmap/c").await,
            (3, 3, "ADDED".into())
        );
        assert!(db
            .add_new("default/device/d", "device", "d1", Some(1), "d1")
            .await
            .expect("add an unversioned object"));
        assert_eq!(
            db.get("default/device/d").await.expect("get").as_deref(),
            Some("d1")
        );
        assert!(!db
            .add_new("default/device/d", "device", "d2", Some(2), "d2")
            .await
            .expect("add"));
        assert_eq!(
            db.get("default/device/d").await.expect("get").as_deref(),
            Some("d1")
        );
    }

    /// Schema 8 rebuilds the table keyed by `key` alone; what it remembered stays.
    #[tokio::test]
    async fn what_was_applied_survives_the_rebuild() {
        let (_dir, config, db) = crate::store::fresh_store().await;
        let change = applied(Some(7), true);
        assert!(db
            .claim_cloud_change("default/pod/a", &change)
            .await
            .expect("claim"));
        // As a store of schema 7 was: without what schema 9 adds to `meta`.
        for drop in [
            "ALTER TABLE meta DROP COLUMN applied_rv",
            "ALTER TABLE meta DROP COLUMN applied_msg_id",
        ] {
            db.control(drop).await.expect("drop a later column");
        }
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
