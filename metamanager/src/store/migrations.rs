//! Versioned schema, applied in order; `PRAGMA user_version` records the last one applied.

/// `(version, SQL)`. Append only: a released migration never changes.
pub const MIGRATIONS: &[(i64, &str)] = &[
    (
        1,
        // `meta` is KubeEdge's table, so an existing edgecore.db opens as is (IF NOT EXISTS).
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, type TEXT NOT NULL, value TEXT);
     CREATE INDEX IF NOT EXISTS meta_type ON meta(type);
     CREATE TABLE IF NOT EXISTS outbox (
         seq INTEGER PRIMARY KEY AUTOINCREMENT,
         topic TEXT NOT NULL,
         payload BLOB NOT NULL,
         created_ms INTEGER NOT NULL
     );",
    ),
    (
        2,
        // KubeEdge's DeviceTwin tables, with its columns (edge/pkg/metamanager/dao/models/
        // device.go), so an edgecore.db's devices open as they are. The indexes are ours and
        // not unique: an existing file may hold duplicates KubeEdge never prevented.
        "CREATE TABLE IF NOT EXISTS device (id TEXT PRIMARY KEY, name TEXT, description TEXT,
             state TEXT, last_online TEXT);
         CREATE TABLE IF NOT EXISTS device_attr (id INTEGER PRIMARY KEY AUTOINCREMENT,
             deviceid TEXT, name TEXT, description TEXT, value TEXT, optional NUMERIC,
             attr_type TEXT, metadata TEXT);
         CREATE TABLE IF NOT EXISTS device_twin (id INTEGER PRIMARY KEY AUTOINCREMENT,
             deviceid TEXT, name TEXT, description TEXT, expected TEXT, actual TEXT,
             expected_meta TEXT, actual_meta TEXT, expected_version TEXT, actual_version TEXT,
             optional NUMERIC, attr_type TEXT, metadata TEXT);
         CREATE INDEX IF NOT EXISTS device_attr_device ON device_attr(deviceid, name);
         CREATE INDEX IF NOT EXISTS device_twin_device ON device_twin(deviceid, name);",
    ),
    (
        3,
        // Hand-ons waiting for their subscribers: every local message the MetaManager publishes
        // after a commit, written in that commit, deleted once handed to the broker (flow
        // control, protocol §6). AUTOINCREMENT: a seq is never reused, so the pump's cursor holds.
        "CREATE TABLE IF NOT EXISTS handon (
             seq INTEGER PRIMARY KEY AUTOINCREMENT,
             topic TEXT NOT NULL,
             payload BLOB NOT NULL,
             correlation BLOB
         );",
    ),
    (
        4,
        // The MetaServer's version space (docs/protocol.md §9): one node-local sequence for every
        // change of a served type, `meta.rv` the version of each object, `meta_history` the last
        // changes (bounded by `metaserver.history`, pruned as it is written). AUTOINCREMENT keeps
        // the sequence in sqlite_sequence, so a pruned or rolled-back version is never reused.
        // Objects stored before get version 1 (the sequence starts there when there are any).
        "ALTER TABLE meta ADD COLUMN rv INTEGER NOT NULL DEFAULT 0;
         CREATE TABLE IF NOT EXISTS meta_history (
             rv INTEGER PRIMARY KEY AUTOINCREMENT,
             type TEXT NOT NULL,
             key TEXT NOT NULL,
             event TEXT NOT NULL,
             value TEXT NOT NULL
         );
         UPDATE meta SET rv = 1
             WHERE type IN ('pod', 'configmap', 'secret', 'service', 'endpoints', 'node');
         INSERT INTO sqlite_sequence (name, seq)
             SELECT 'meta_history', 1 WHERE EXISTS (SELECT 1 FROM meta WHERE rv = 1);",
    ),
    (
        5,
        // Lists by type (and namespace, a key range) come out of this index in key order: with
        // `meta_type` alone SQLite sorted every list in a temporary B-tree (10,000 pods: about
        // half of a MetaServer list's time).
        "CREATE INDEX IF NOT EXISTS meta_type_key ON meta(type, key);
         DROP INDEX IF EXISTS meta_type;",
    ),
    (
        6,
        // The cloud change last applied per object (protocol §6.4): a redelivered or older one
        // is recognised and acknowledged without being applied again. Deletes stay an hour as
        // tombstones, found for pruning through the partial index.
        "CREATE TABLE IF NOT EXISTS cloud_applied (
             key TEXT PRIMARY KEY,
             rv INTEGER,
             msg_id TEXT NOT NULL,
             deleted INTEGER NOT NULL,
             at_ms INTEGER NOT NULL
         );
         CREATE INDEX IF NOT EXISTS cloud_applied_tombstones ON cloud_applied(at_ms)
             WHERE deleted = 1;",
    ),
    (
        7,
        // `$hw/...` and `$ke/...` hand-ons are stored under the name clients use; rows an
        // earlier build stored as `edgemeta$hw/...` are renamed (8 = len("edgemeta")).
        "UPDATE handon SET topic = substr(topic, 9)
             WHERE topic LIKE 'edgemeta$hw/%' OR topic LIKE 'edgemeta$ke/%';",
    ),
    (
        8,
        // `cloud_applied` keyed by `key` alone (WITHOUT ROWID): each cloud change writes one
        // b-tree for it instead of two (the table and its key's index).
        "CREATE TABLE cloud_applied_by_key (
             key TEXT PRIMARY KEY,
             rv INTEGER,
             msg_id TEXT NOT NULL,
             deleted INTEGER NOT NULL,
             at_ms INTEGER NOT NULL
         ) WITHOUT ROWID;
         INSERT INTO cloud_applied_by_key SELECT key, rv, msg_id, deleted, at_ms FROM cloud_applied;
         DROP TABLE cloud_applied;
         ALTER TABLE cloud_applied_by_key RENAME TO cloud_applied;
         CREATE INDEX IF NOT EXISTS cloud_applied_tombstones ON cloud_applied(at_ms)
             WHERE deleted = 1;",
    ),
    (
        9,
        // A cloud insert or update remembers what it applied on the object's own row, written
        // by the upsert that stores it: no `cloud_applied` row of its own (cloud_applied.rs).
        "ALTER TABLE meta ADD COLUMN applied_rv INTEGER;
         ALTER TABLE meta ADD COLUMN applied_msg_id TEXT;",
    ),
    (
        10,
        // `meta_history.value` may be NULL: the object was added and is still what its `meta`
        // row holds (versions.rs), so an object added and never changed is written once. And
        // no AUTOINCREMENT: its sequence row cost every change a read and a write of
        // sqlite_sequence. A version is now the table's largest `rv` plus one, and the newest
        // row is never pruned; where the old sequence ran past every row (a store whose
        // versions schema 4 set, no change since), a row of no type carries it.
        "CREATE TABLE meta_history_next (
             rv INTEGER PRIMARY KEY,
             type TEXT NOT NULL,
             key TEXT NOT NULL,
             event TEXT NOT NULL,
             value TEXT
         );
         INSERT INTO meta_history_next (rv, type, key, event, value)
             SELECT rv, type, key, event, value FROM meta_history;
         INSERT INTO meta_history_next (rv, type, key, event, value)
             SELECT seq, '', '', '', NULL FROM sqlite_sequence
             WHERE name = 'meta_history'
               AND seq > coalesce((SELECT max(rv) FROM meta_history), 0);
         DROP TABLE meta_history;
         ALTER TABLE meta_history_next RENAME TO meta_history;",
    ),
    (
        11,
        // `type` is the key's second level, so `(type, key)` is as unique as `key`: one index
        // instead of the key's own and `meta_type_key`. Four publishers' new keys rewrote the
        // leaves of both in every commit (a third of a P1 insert's WAL bytes).
        "CREATE TABLE meta_next (
             key TEXT NOT NULL,
             type TEXT NOT NULL,
             value TEXT,
             rv INTEGER NOT NULL DEFAULT 0,
             applied_rv INTEGER,
             applied_msg_id TEXT
         );
         INSERT INTO meta_next (key, type, value, rv, applied_rv, applied_msg_id)
             SELECT key, type, value, rv, applied_rv, applied_msg_id FROM meta ORDER BY rowid;
         DROP TABLE meta;
         ALTER TABLE meta_next RENAME TO meta;
         CREATE UNIQUE INDEX meta_type_key ON meta(type, key);",
    ),
];

/// The schema version this build writes.
/// The table a migration rebuilds (creates anew and drops the old), whose triggers the
/// migration must make again.
pub fn rebuilds(version: i64) -> Option<&'static str> {
    match version {
        10 => Some("meta_history"),
        11 => Some("meta"),
        _ => None,
    }
}

pub fn latest() -> i64 {
    MIGRATIONS.last().map_or(0, |(v, _)| *v)
}
