//! The MetaServer's version space (docs/protocol.md §9), kept by the write path.
//!
//! Every change of a served type ([`VERSIONED`]) takes the next value of one node-local
//! sequence, in the same transaction as the change: the object's `meta.rv` and one
//! `meta_history` row (the event and the object as it is after it, or was before a delete; an
//! add leaves it to `meta` until the object changes). The sequence is the history's largest
//! version plus one. History is pruned to `history` rows, never the newest, in the same
//! statement sequence. The changes of the open
//! transaction wait in [`Db`]'s pending list until the worker has committed them, then go to
//! the live watchers.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use libsql::params;

use super::Db;

/// The `meta.type`s whose changes are versioned: what the MetaServer serves.
pub const VERSIONED: &[&str] = &["pod", "configmap", "secret", "service", "endpoints", "node"];

/// A served object's stored value and version by key ([`Db::current`]).
pub(super) const CURRENT: &str = "SELECT value, rv FROM meta WHERE type = ?2 AND key = ?1";

/// Rows past `keep` the history may hold before a prune: pruning every batch rewrote the
/// history's oldest leaf and its parents in every commit; waiting frees whole leaves at once.
fn prune_slack(keep: u64) -> u64 {
    (keep / 16).min(128)
}

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
pub type Changes = Arc<Committed>;

/// The changes of one committed batch, and when its `COMMIT` returned (for the MetaServer's
/// commit → watch event delay).
#[derive(Debug)]
pub struct Committed {
    pub at: std::time::Instant,
    pub changes: Vec<Change>,
}

impl std::ops::Deref for Committed {
    type Target = [Change];
    fn deref(&self) -> &[Change] {
        &self.changes
    }
}

impl Db {
    /// Inserts or replaces a served object, versioning the change; an identical value is no
    /// change (no version, no event: the cloud resends what the node already has).
    pub(super) async fn upsert_versioned(
        &self,
        key: &str,
        res_type: &str,
        value: &str,
    ) -> Result<(), libsql::Error> {
        let event = match self.current(key).await? {
            None => Event::Added,
            Some((old, _)) if old == value => return Ok(()),
            Some((old, old_rv)) => {
                self.settle(old_rv, &old).await?;
                Event::Modified
            }
        };
        let rv = self.record(res_type, key, event, value).await?;
        self.exec(
            "INSERT INTO meta (key, type, value, rv) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(type, key) DO UPDATE SET value = excluded.value, rv = excluded.rv",
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
        let Some((old, old_rv)) = self.current(key).await? else {
            return Ok(0);
        };
        self.settle(old_rv, &old).await?;
        self.record(res_type, key, Event::Deleted, &old).await?;
        self.exec(
            "DELETE FROM meta WHERE type = ?2 AND key = ?1",
            [key, super::type_of(key)],
        )
        .await
    }

    /// A served object's stored value and version.
    pub(super) async fn current(&self, key: &str) -> Result<Option<(String, i64)>, libsql::Error> {
        let statement = self.statement(CURRENT).await?;
        let mut rows = statement.query([key, super::type_of(key)]).await?;
        let found = match rows.next().await? {
            Some(row) => Some((
                super::text(&row, 0)?.unwrap_or_default(),
                row.get::<i64>(1)?,
            )),
            None => None,
        };
        drop(rows);
        self.keep(CURRENT, statement);
        Ok(found)
    }

    /// Writes `value` into the history row of version `rv` if that row leaves its value to
    /// `meta` (an add's, [`Db::record`]): the object is about to change, and that row must
    /// keep what it was. Nothing when the row is pruned or holds its value already.
    pub(super) async fn settle(&self, rv: i64, value: &str) -> Result<(), libsql::Error> {
        self.exec(
            "UPDATE meta_history SET value = ?2 WHERE rv = ?1 AND value IS NULL",
            params![rv, value],
        )
        .await
        .map(drop)
    }

    /// Takes the next version for a change: its history row and the pending change (the
    /// prune waits for the commit, [`Db::prune_history`]). An added object's row leaves its
    /// value to `meta`, which holds it until the object changes ([`Db::settle`]): an object
    /// added and never changed, most of a node's, is written once, not twice. A change's row
    /// holds its value: settling it on the next change would grow an old row of the history
    /// for every update of an object that changes often.
    pub(super) async fn record(
        &self,
        res_type: &str,
        key: &str,
        event: Event,
        value: &str,
    ) -> Result<u64, libsql::Error> {
        let kept = (event != Event::Added).then_some(value);
        self.exec(
            "INSERT INTO meta_history (type, key, event, value) VALUES (?1, ?2, ?3, ?4)",
            params![res_type, key, event.as_str(), kept],
        )
        .await?;
        let rv = u64::try_from(self.conn.last_insert_rowid()).unwrap_or_default();
        self.pending().push(Change {
            rv,
            res_type: res_type.to_owned(),
            key: key.to_owned(),
            event,
            value: value.into(),
        });
        Ok(rv)
    }

    /// Keeps the last `history` rows, once per transaction, just before its `COMMIT`: one
    /// `DELETE` per batch instead of one per change, and no reader sees the difference. The
    /// newest row stays whatever `history` says: the next version follows it.
    pub(super) async fn prune_history(&self) -> Result<(), libsql::Error> {
        let Some(last) = self.pending().last().map(|change| change.rv) else {
            return Ok(());
        };
        let keep = self.history.max(1);
        let floor = last.saturating_sub(keep);
        let pruned = self.history_pruned.load(Ordering::Relaxed);
        if floor < pruned.saturating_add(prune_slack(keep)) {
            return Ok(());
        }
        self.exec(
            "DELETE FROM meta_history WHERE rv <= ?1",
            [i64::try_from(floor).unwrap_or(i64::MAX)],
        )
        .await?;
        self.history_pruned.store(floor, Ordering::Relaxed);
        Ok(())
    }

    /// The versioned changes committed by the last transaction (taken once, after `COMMIT`).
    pub fn take_changes(&self) -> Vec<Change> {
        std::mem::take(&mut *self.pending())
    }

    /// The version the next change takes, when this transaction has recorded one already:
    /// the history's largest `rv` is then that change's (a savepoint undone forgets its
    /// changes with their rows, and the prune never removes the newest row).
    pub(super) fn next_version(&self) -> Option<i64> {
        let last = self.pending().last()?.rv;
        i64::try_from(last).ok()?.checked_add(1)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ListQuery, Reader, Since, StoreConfig};

    fn events(changes: &[Change]) -> Vec<(u64, Event, &str)> {
        changes
            .iter()
            .map(|c| (c.rv, c.event, c.key.as_str()))
            .collect()
    }

    /// Versions commit with their change, a rolled-back savepoint gives its version back, an
    /// unchanged value takes none, and the history keeps only the last `history` changes.
    #[tokio::test]
    async fn versions_follow_the_transaction_and_the_history_is_bounded() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = StoreConfig {
            path: dir.path().join("meta.db"),
            history: 3,
            ..StoreConfig::default()
        };
        let db = Db::open(&config).await.expect("open");
        let tx = db.begin(true).await.expect("begin");
        db.upsert("default/pod/a", "pod", "{\"v\":1}")
            .await
            .expect("upsert");
        db.upsert("default/podstatus/a", "podstatus", "{}")
            .await
            .expect("unversioned");
        let step = tx.savepoint().await.expect("savepoint");
        db.upsert("default/pod/b", "pod", "{}")
            .await
            .expect("upsert");
        step.rollback().await.expect("rollback to");
        db.upsert("default/pod/a", "pod", "{\"v\":1}")
            .await
            .expect("same value");
        db.upsert("default/pod/a", "pod", "{\"v\":2}")
            .await
            .expect("update");
        tx.commit().await.expect("commit");
        let committed = db.take_changes();
        assert_eq!(
            events(&committed),
            [
                (1, Event::Added, "default/pod/a"),
                (2, Event::Modified, "default/pod/a")
            ]
        );
        let tx = db.begin(true).await.expect("begin");
        for name in ["c", "d"] {
            db.upsert(&format!("default/pod/{name}"), "pod", "{}")
                .await
                .expect("upsert");
        }
        assert_eq!(db.delete("default/pod/a").await.expect("delete"), 1);
        assert_eq!(db.delete("default/pod/zz").await.expect("delete"), 0);
        tx.commit().await.expect("commit");
        assert_eq!(
            events(&db.take_changes()),
            [
                (3, Event::Added, "default/pod/c"),
                (4, Event::Added, "default/pod/d"),
                (5, Event::Deleted, "default/pod/a")
            ]
        );

        let reader = Reader::open(&config.path).await.expect("reader");
        match reader.since("pod", 1).await.expect("since") {
            Since::Expired { floor, rev } => assert_eq!((floor, rev), (2, 5)),
            other => panic!("{other:?}"),
        }
        let Since::Changes { changes, rev } = reader.since("pod", 2).await.expect("since") else {
            panic!("version 2 is in the history");
        };
        assert_eq!(rev, 5);
        assert_eq!(changes.len(), 3);
        assert_eq!(
            &*changes[2].value, "{\"v\":2}",
            "a delete carries the last value"
        );
        assert!(matches!(
            reader.since("pod", 6).await,
            Ok(Since::Expired { .. })
        ));
        let page = reader
            .list(ListQuery {
                res_type: "pod".into(),
                limit: Some(1),
                ..ListQuery::default()
            })
            .await
            .expect("list")
            .expect("a page");
        assert_eq!((page.rev, page.objects.len(), page.more), (5, 1, true));
        assert_eq!(
            (page.objects[0].key.as_str(), page.objects[0].rv),
            ("default/pod/c", 3)
        );
        // The next page at version 5 holds while nothing after "c" changes.
        let next = ListQuery {
            res_type: "pod".into(),
            after: Some("default/pod/c".into()),
            at: Some(5),
            ..ListQuery::default()
        };
        let page = reader
            .list(next.clone())
            .await
            .expect("list")
            .expect("a page");
        assert_eq!(page.objects.len(), 1);
        let tx = db.begin(true).await.expect("begin");
        db.upsert("default/pod/e", "pod", "{}")
            .await
            .expect("upsert");
        tx.commit().await.expect("commit");
        assert!(reader.list(next).await.expect("list").is_none(), "too old");
    }

    /// A long history is pruned in steps: it always holds the last `history` changes and at
    /// most `history / 16` more, so a commit only now and then rewrites its oldest pages.
    #[tokio::test]
    async fn a_long_history_is_pruned_in_steps_and_keeps_at_least_its_length() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = StoreConfig {
            path: dir.path().join("meta.db"),
            history: 320,
            ..StoreConfig::default()
        };
        let db = Db::open(&config).await.expect("open");
        let reader = Reader::open(&config.path).await.expect("reader");
        let mut floors = Vec::new();
        for rv in 1..=1000u64 {
            let tx = db.begin(true).await.expect("begin");
            db.upsert("default/pod/a", "pod", &format!("{{\"v\":{rv}}}"))
                .await
                .expect("upsert");
            tx.commit().await.expect("commit");
            db.take_changes();
            let rows = history_rows(&db).await;
            let kept = rows.len() as u64;
            assert!(
                kept >= rv.min(320) && kept <= 340,
                "{kept} rows after {rv} changes (history 320, step 20)"
            );
            // The oldest version a watch resumes from, as the MetaServer reads it.
            let floor = match reader.since("pod", 0).await.expect("since") {
                Since::Expired { floor, .. } => floor,
                Since::Changes { .. } => 0,
            };
            if floors.last() != Some(&floor) {
                floors.push(floor);
            }
        }
        let steps: std::collections::BTreeSet<u64> =
            floors.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(
            (steps.into_iter().collect::<Vec<_>>(), floors.last()),
            (vec![20], Some(&680)),
            "the oldest version moves 20 at a time"
        );
    }

    /// What each history row holds: `(rv, event, value)`, a NULL value as `None`.
    async fn history_rows(db: &Db) -> Vec<(i64, String, Option<String>)> {
        let mut rows = db
            .conn
            .query("SELECT rv, event, value FROM meta_history ORDER BY rv", ())
            .await
            .expect("history");
        let mut found = Vec::new();
        while let Some(row) = rows.next().await.expect("row") {
            found.push((
                row.get(0).expect("rv"),
                row.get(1).expect("event"),
                row.get(2).expect("value"),
            ));
        }
        found
    }

    /// A store as schema 9 left it (`meta_history` with `AUTOINCREMENT` and values required)
    /// after `sql`, opened again: schema 10 applied to it. The directory guard comes along.
    async fn from_schema_9(sql: &str) -> (tempfile::TempDir, StoreConfig, Db) {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = fresh_config(&dir);
        let db = Db::open(&config).await.expect("open");
        db.conn
            .execute_batch(&format!(
                "DROP TABLE meta_history;
                 CREATE TABLE meta_history (rv INTEGER PRIMARY KEY AUTOINCREMENT,
                     type TEXT NOT NULL, key TEXT NOT NULL, event TEXT NOT NULL,
                     value TEXT NOT NULL);
                 {sql}
                 PRAGMA user_version=9;"
            ))
            .await
            .expect("schema 9");
        drop(db);
        let db = Db::open(&config).await.expect("reopen");
        (dir, config, db)
    }

    /// Stores `value` under the pod `key` in a transaction of its own.
    async fn upsert_committed(db: &Db, key: &str, value: &str) {
        let tx = db.begin(true).await.expect("begin");
        db.upsert(key, "pod", value).await.expect("upsert");
        tx.commit().await.expect("commit");
    }

    fn fresh_config(dir: &tempfile::TempDir) -> StoreConfig {
        StoreConfig {
            path: dir.path().join("meta.db"),
            ..StoreConfig::default()
        }
    }

    /// An added object is written once, in `meta`; the history row that leaves its value to
    /// `meta` gets it when the object changes, so a watch resumed from any version sees each
    /// change as it was, whether it came from edged or from the cloud.
    #[tokio::test]
    async fn each_change_keeps_its_value_once_the_object_moves_on() {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = fresh_config(&dir);
        let db = Db::open(&config).await.expect("open");
        let tx = db.begin(true).await.expect("begin");
        for value in ["{\"v\":1}", "{\"v\":2}", "{\"v\":3}"] {
            db.upsert("default/pod/a", "pod", value)
                .await
                .expect("upsert");
        }
        assert_eq!(db.delete("default/pod/a").await.expect("delete"), 1);
        db.upsert("default/pod/b", "pod", "{\"b\":1}")
            .await
            .expect("upsert");
        for (n, value) in ["{\"c\":1}", "{\"c\":2}"].into_iter().enumerate() {
            let change = crate::store::cloud_applied::Applied {
                rv: Some(n as u64 + 1),
                msg_id: format!("m{n}"),
                deleted: false,
            };
            assert!(db
                .upsert_cloud_change("default/pod/c", "pod", value, &change, false)
                .await
                .expect("cloud change"));
        }
        tx.commit().await.expect("commit");
        let some = |v: &str| Some(v.to_owned());
        assert_eq!(
            history_rows(&db).await,
            [
                (1, "ADDED".into(), some("{\"v\":1}")),
                (2, "MODIFIED".into(), some("{\"v\":2}")),
                (3, "MODIFIED".into(), some("{\"v\":3}")),
                (4, "DELETED".into(), some("{\"v\":3}")),
                (5, "ADDED".into(), None),
                (6, "ADDED".into(), some("{\"c\":1}")),
                (7, "MODIFIED".into(), some("{\"c\":2}")),
            ],
            "only adds not followed by a change leave their value to meta"
        );
        let reader = Reader::open(&config.path).await.expect("reader");
        let Since::Changes { changes, rev } = reader.since("pod", 0).await.expect("since") else {
            panic!("the whole history is kept");
        };
        assert_eq!(rev, 7);
        let seen: Vec<(u64, Event, &str, &str)> = changes
            .iter()
            .map(|c| (c.rv, c.event, c.key.as_str(), &*c.value))
            .collect();
        assert_eq!(
            seen,
            [
                (1, Event::Added, "default/pod/a", "{\"v\":1}"),
                (2, Event::Modified, "default/pod/a", "{\"v\":2}"),
                (3, Event::Modified, "default/pod/a", "{\"v\":3}"),
                (4, Event::Deleted, "default/pod/a", "{\"v\":3}"),
                (5, Event::Added, "default/pod/b", "{\"b\":1}"),
                (6, Event::Added, "default/pod/c", "{\"c\":1}"),
                (7, Event::Modified, "default/pod/c", "{\"c\":2}"),
            ]
        );
    }

    /// Schema 10 lets a history row leave its value to `meta`; a store of schema 9 keeps its
    /// rows and its sequence, so no version is handed out twice.
    #[tokio::test]
    async fn the_history_and_its_sequence_survive_the_rebuild() {
        // Every row with its value, the sequence past the last row (a change rolled back or
        // pruned after it).
        let (_dir, config, db) = from_schema_9(
            "INSERT INTO meta_history VALUES (7, 'pod', 'default/pod/a', 'ADDED', '{}');
             UPDATE sqlite_sequence SET seq = 9 WHERE name = 'meta_history';
             INSERT INTO meta (key, type, value, rv) VALUES ('default/pod/a', 'pod', '{}', 7);",
        )
        .await;
        upsert_committed(&db, "default/pod/a", "{\"v\":2}").await;
        assert_eq!(
            history_rows(&db).await,
            [
                (7, "ADDED".into(), Some("{}".to_owned())),
                (9, String::new(), None),
                (10, "MODIFIED".into(), Some("{\"v\":2}".to_owned()))
            ],
            "the sequence goes on past the versions it gave out"
        );
        let reader = Reader::open(&config.path).await.expect("reader");
        let Since::Changes { changes, rev } = reader.since("pod", 6).await.expect("since") else {
            panic!("version 6 is in the history");
        };
        assert_eq!(
            (events(&changes), rev),
            (
                vec![
                    (7, Event::Added, "default/pod/a"),
                    (10, Event::Modified, "default/pod/a")
                ],
                10
            )
        );
    }

    /// A store whose versions schema 4 set (every object at 1, no change since) goes on from
    /// them: a watch starts at 1, not before, and the next change is 2.
    #[tokio::test]
    async fn versions_set_by_schema_4_are_not_given_out_again() {
        let (_dir, config, db) = from_schema_9(
            "INSERT INTO sqlite_sequence (name, seq) VALUES ('meta_history', 1);
             INSERT INTO meta (key, type, value, rv) VALUES ('default/pod/a', 'pod', '{}', 1);",
        )
        .await;
        let reader = Reader::open(&config.path).await.expect("reader");
        assert!(matches!(
            reader.since("pod", 0).await.expect("since"),
            Since::Expired { floor: 1, rev: 1 }
        ));
        assert!(matches!(
            reader.since("pod", 1).await.expect("since"),
            Since::Changes { ref changes, rev: 1 } if changes.is_empty()
        ));
        upsert_committed(&db, "default/pod/b", "{}").await;
        assert_eq!(
            events(&db.take_changes()),
            [(2, Event::Added, "default/pod/b")]
        );
    }
}
