//! Versioned schema, applied in order; `PRAGMA user_version` records the last one applied.

/// `(version, SQL)`. Append only: a released migration never changes.
pub const MIGRATIONS: &[(i64, &str)] = &[(
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
)];

/// The schema version this build writes.
pub fn latest() -> i64 {
    MIGRATIONS.last().map_or(0, |(v, _)| *v)
}
