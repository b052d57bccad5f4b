//! The SQLite store: KubeEdge's `meta` table plus the cloud `outbox`, through libsql.
//!
//! [`Db`] is used only by the worker thread that owns it (see `worker.rs`): libsql runs SQLite
//! synchronously inside its async calls, so it must never run on a tokio worker serving MQTT.

mod checkpoint;
mod cloud_applied;
mod devices;
mod migrations;
mod read_only;
mod reader;
mod versions;

pub use checkpoint::Checkpointer;
pub use cloud_applied::Applied;
pub use devices::DeviceRow;
pub use read_only::{read_meta, MetaRow};
pub use reader::{ListPage, ListQuery, Reader, Since, StoredObject};
pub use versions::{versioned, Change, Changes, Committed, Event, VERSIONED};

use std::path::Path;
use std::time::Duration;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use edgemeta_broker::Message;
use libsql::params::IntoParams;
use libsql::{params, Connection, Statement, Value};
use serde::Deserialize;

/// Store settings (`store:` in the YAML config).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// SQLite file; created with its parent directories when missing.
    #[serde(default = "default_path")]
    pub path: std::path::PathBuf,
    /// How long a statement waits for a lock held by another connection, in milliseconds.
    #[serde(default = "default_busy_timeout_ms")]
    pub busy_timeout_ms: u64,
    /// `full` survives power loss; `normal` only process crashes (SQLite `synchronous`).
    #[serde(default)]
    pub synchronous: Synchronous,
    /// Commit without fsync and hand local messages on at once; PUBACKs, cloud acknowledgements
    /// and outbox rows for the cloud wait for one fsync of the WAL that covers their commit
    /// (protocol §6.3). `false`: every commit fsyncs before anything is handed on.
    #[serde(default = "default_true")]
    pub early_handon: bool,
    /// With `early_handon`, while several senders commit, how long a commit's acknowledgements
    /// may wait for later commits to share its fsync, in ms (0: every commit syncs at once;
    /// a lone sender is never delayed, nor a stop-and-wait one, nor 8 messages; protocol §6.1).
    #[serde(default = "default_sync_delay_ms")]
    pub sync_delay_ms: u64,
    /// Most messages committed in one transaction (group commit).
    #[serde(default = "default_batch_max")]
    pub batch_max: usize,
    /// SQLite `max_page_count` (4 KiB pages); 0 = unlimited. A full store answers `error`.
    #[serde(default)]
    pub max_pages: u64,
    /// Most messages waiting for the cloud; past it, cloud-bound changes get an `error` reply.
    #[serde(default = "default_outbox_max_entries")]
    pub outbox_max_entries: u64,
    /// Most payload bytes waiting for the cloud.
    #[serde(default = "default_outbox_max_bytes")]
    pub outbox_max_bytes: u64,
    /// Devices whose twins the store thread keeps in memory, so a twin report reads no rows
    /// (0: none). Past it, each device read drops another's; about 0.4 KiB a twin.
    #[serde(default = "default_twin_cache")]
    pub twin_cache: usize,
    /// Changes of served objects kept for watches to resume from (`metaserver.history`, set by
    /// the binary; not a `store:` key).
    #[serde(skip, default = "default_history")]
    pub history: u64,
}

/// SQLite `synchronous` levels offered.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    #[default]
    Full,
    Normal,
}

const fn default_true() -> bool {
    true
}
fn default_path() -> std::path::PathBuf {
    "edgemeta.db".into()
}
const fn default_busy_timeout_ms() -> u64 {
    5_000
}
const fn default_sync_delay_ms() -> u64 {
    4
}
const fn default_batch_max() -> usize {
    256
}
const fn default_twin_cache() -> usize {
    16_384
}
const fn default_outbox_max_entries() -> u64 {
    1_000_000
}
const fn default_outbox_max_bytes() -> u64 {
    512 * 1024 * 1024
}
/// `metaserver.history`'s default.
pub const fn default_history() -> u64 {
    10_000
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            path: default_path(),
            busy_timeout_ms: default_busy_timeout_ms(),
            synchronous: Synchronous::default(),
            early_handon: true,
            sync_delay_ms: default_sync_delay_ms(),
            batch_max: default_batch_max(),
            max_pages: 0,
            outbox_max_entries: default_outbox_max_entries(),
            outbox_max_bytes: default_outbox_max_bytes(),
            twin_cache: default_twin_cache(),
            history: default_history(),
        }
    }
}

/// What waits in the outbox.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxStats {
    pub entries: u64,
    pub bytes: u64,
    /// Creation time (ms since the epoch) of the oldest entry.
    pub oldest_ms: Option<i64>,
}

/// A store failure, with the SQLite text.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create directory {path}: {source}")]
    CreateDir {
        path: String,
        source: std::io::Error,
    },
    #[error("store {path} has schema version {found}, newer than this build's {latest}")]
    TooNew {
        path: String,
        found: i64,
        latest: i64,
    },
    #[error("no store at {0}")]
    Missing(String),
    #[error("{0}")]
    Sql(#[from] libsql::Error),
    #[error("cannot start the store thread: {0}")]
    Thread(std::io::Error),
    #[error("the store reader has stopped")]
    ReaderClosed,
    #[error("the store's checkpoint thread stopped while opening")]
    CheckpointerClosed,
}

/// One row of the cloud outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEntry {
    pub seq: i64,
    pub topic: String,
    pub payload: Vec<u8>,
}

/// The current-thread runtime each store thread (writer, checkpoint, reader) runs libsql's
/// async calls and its timers on.
pub(crate) fn thread_runtime() -> Result<tokio::runtime::Runtime, StoreError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(StoreError::Thread)
}

/// A statement's SQL as the cache keys it: by where its text lives, not by the text. Every SQL
/// here is a `&'static str` constant, and hashing hundreds of bytes twice a statement was the
/// store thread's largest single cost after SQLite (docs/benchmarks.md).
#[derive(Clone, Copy, Debug)]
struct Sql(&'static str);

impl PartialEq for Sql {
    fn eq(&self, other: &Sql) -> bool {
        // Address and length: the same constant. Two constants with the same text are two
        // entries, which costs one more prepared statement, never a wrong one.
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Sql {}

impl std::hash::Hash for Sql {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_usize(self.0.as_ptr() as usize);
    }
}

/// A typed view of one SQLite connection.
pub struct Db {
    conn: Connection,
    /// Prepared statements by their SQL: preparing costs more than running the small statements
    /// of the write path. A statement is taken out while in use (no lock across an await) and
    /// reset before it goes back: libsql silently reuses old values otherwise.
    statements: Mutex<foldhash::HashMap<Sql, Statement>>,
    /// The configured `synchronous` level, and whether the connection runs below it right now.
    synchronous: Synchronous,
    relaxed: AtomicBool,
    /// History rows kept (`versions.rs`).
    history: u64,
    /// The version at and below which the last prune removed the history (`versions.rs`).
    history_pruned: AtomicU64,
    /// Versioned changes of the open transaction, in order (`versions.rs`).
    pending: Mutex<Vec<Change>>,
    /// Devices' twins as their rows hold them, committed or not (`devices.rs`).
    twins: Mutex<devices::TwinCache>,
    // Keeps the database alive as long as the connection.
    _db: libsql::Database,
}

impl Db {
    /// Opens (creating if needed) the store and brings its schema up to date.
    pub async fn open(config: &StoreConfig) -> Result<Db, StoreError> {
        if let Some(dir) = config.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::CreateDir {
                path: dir.display().to_string(),
                source,
            })?;
        }
        // SQLITE_OPEN_NOMUTEX: the connection lives on one thread (the store thread, or a test's),
        // so SQLite's per-call connection mutex only cost a lock and an unlock on every bind, step
        // and reset (docs/benchmarks.md). libsql's flags name only the open modes; the bit is
        // SQLite's own (sqlite3.h).
        let flags = libsql::OpenFlags::default()
            | libsql::OpenFlags::from_bits_retain(libsql::ffi::SQLITE_OPEN_NOMUTEX);
        let db = libsql::Builder::new_local(&config.path)
            .flags(flags)
            .build()
            .await?;
        let conn = db.connect()?;
        conn.busy_timeout(Duration::from_millis(config.busy_timeout_ms))?;
        // journal_mode returns a row, so it must go through query(), not execute().
        conn.query("PRAGMA journal_mode=WAL", ()).await?;
        // Early hand-on: commits never fsync; the worker's syncer makes them durable.
        let level = if config.early_handon {
            Synchronous::Normal
        } else {
            config.synchronous
        };
        let sync = match level {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        };
        conn.execute(&format!("PRAGMA synchronous={sync}"), ())
            .await?;
        // The checkpoint thread folds the WAL in; the writer checkpoints only past the backstop.
        conn.query(
            &format!("PRAGMA wal_autocheckpoint={}", checkpoint::BACKSTOP_PAGES),
            (),
        )
        .await?;
        if config.max_pages > 0 {
            conn.query(&format!("PRAGMA max_page_count={}", config.max_pages), ())
                .await?;
        }
        let this = Db {
            conn,
            statements: Mutex::new(foldhash::HashMap::default()),
            synchronous: level,
            relaxed: AtomicBool::new(false),
            history: config.history,
            history_pruned: AtomicU64::new(0),
            pending: Mutex::new(Vec::new()),
            twins: Mutex::new(devices::TwinCache::new(config.twin_cache)),
            _db: db,
        };
        this.migrate(&config.path).await?;
        Ok(this)
    }

    async fn migrate(&self, path: &Path) -> Result<(), StoreError> {
        let current = self.scalar_i64("PRAGMA user_version").await?;
        let latest = migrations::latest();
        if current > latest {
            return Err(StoreError::TooNew {
                path: path.display().to_string(),
                found: current,
                latest,
            });
        }
        for (version, sql) in migrations::MIGRATIONS.iter().filter(|(v, _)| *v > current) {
            self.conn.execute("BEGIN IMMEDIATE", ()).await?;
            let applied = async {
                // A table the migration rebuilds loses its triggers with the old table: they
                // are made again on the new one (SQLite's "generalized ALTER TABLE procedure").
                let triggers = match migrations::rebuilds(*version) {
                    Some(table) => self.triggers_on(table).await?,
                    None => Vec::new(),
                };
                self.conn.execute_batch(sql).await?;
                for trigger in &triggers {
                    self.conn.execute_batch(trigger).await?;
                }
                self.conn
                    .execute(&format!("PRAGMA user_version={version}"), ())
                    .await?;
                self.conn.execute("COMMIT", ()).await
            }
            .await;
            if let Err(e) = applied {
                let _ = self.conn.execute("ROLLBACK", ()).await;
                return Err(e.into());
            }
            tracing::info!(version, "store schema migrated");
        }
        Ok(())
    }

    /// The `CREATE TRIGGER` statements of `table`'s triggers.
    async fn triggers_on(&self, table: &str) -> Result<Vec<String>, libsql::Error> {
        let mut rows = self
            .conn
            .query(
                "SELECT sql FROM sqlite_master
                 WHERE type = 'trigger' AND tbl_name = ?1 AND sql IS NOT NULL",
                [table],
            )
            .await?;
        let mut found = Vec::new();
        while let Some(row) = rows.next().await? {
            found.push(row.get::<String>(0)?);
        }
        Ok(found)
    }

    async fn scalar_i64(&self, sql: &str) -> Result<i64, libsql::Error> {
        let mut rows = self.conn.query(sql, ()).await?;
        match rows.next().await? {
            Some(row) => row.get::<i64>(0),
            None => Ok(0),
        }
    }

    /// The prepared statement for `sql`, from the cache or freshly prepared.
    async fn statement(&self, sql: &'static str) -> Result<Statement, libsql::Error> {
        let cached = self
            .statements
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&Sql(sql));
        match cached {
            Some(statement) => Ok(statement),
            None => self.conn.prepare(sql).await,
        }
    }

    /// Returns a statement to the cache once its rows are dropped. One that failed is not
    /// returned: it is finalized and prepared afresh next time.
    fn keep(&self, sql: &'static str, statement: Statement) {
        statement.reset();
        self.statements
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(Sql(sql), statement);
    }

    /// Executes `sql` through the cache; the number of rows changed.
    async fn exec(&self, sql: &'static str, params: impl IntoParams) -> Result<u64, libsql::Error> {
        let statement = self.statement(sql).await?;
        let changed = statement.execute(params).await?;
        self.keep(sql, statement);
        Ok(changed as u64)
    }

    /// Opens the write transaction of a batch. With `durable` false its `COMMIT` skips the fsync
    /// (SQLite `synchronous=NORMAL`; the WAL stays consistent, a power cut may undo it): only for
    /// writes whose loss repeats work instead of losing it, such as deleting delivered outbox rows.
    pub async fn begin(&self, durable: bool) -> Result<Transaction<'_>, libsql::Error> {
        if self.in_transaction() {
            // Only a transaction dropped without commit or rollback leaves one open.
            tracing::warn!(
                error_code = "EM-STORE-TRANSACTION",
                "rolling back a transaction left open"
            );
            self.undone(0);
            self.control("ROLLBACK").await?;
        }
        // `synchronous` cannot change inside a transaction, so it is set here, and only on change.
        if self.synchronous == Synchronous::Full && self.relaxed.load(Ordering::Relaxed) == durable
        {
            self.control(if durable {
                "PRAGMA synchronous=FULL"
            } else {
                "PRAGMA synchronous=NORMAL"
            })
            .await?;
            self.relaxed.store(!durable, Ordering::Relaxed);
        }
        self.control("BEGIN IMMEDIATE").await?;
        self.forget_changes(0);
        Ok(Transaction {
            db: self,
            fresh: std::cell::Cell::new(true),
        })
    }

    /// Forgets what is kept in memory of writes a rollback undid: the versioned changes past
    /// the first `changes`, and every cached twin.
    fn undone(&self, changes: usize) {
        self.forget_changes(changes);
        self.forget_twins();
    }

    /// Runs a transaction-control statement (`BEGIN`, `SAVEPOINT x`, `COMMIT`, ...).
    async fn control(&self, sql: &'static str) -> Result<(), libsql::Error> {
        self.exec(sql, ()).await.map(drop)
    }

    /// Whether a transaction is open.
    fn in_transaction(&self) -> bool {
        !self.conn.is_autocommit()
    }

    /// `value` of `key`, if stored.
    pub async fn get(&self, key: &str) -> Result<Option<String>, libsql::Error> {
        let statement = self.statement(GET).await?;
        let mut rows = statement.query([key, type_of(key)]).await?;
        let value = match rows.next().await? {
            Some(row) => text(&row, 0)?,
            None => None,
        };
        drop(rows);
        self.keep(GET, statement);
        Ok(value)
    }

    /// Insert or replace one record (KubeEdge `InsertOrUpdate`); a served object's change takes
    /// the next version (`versions.rs`).
    pub async fn upsert(
        &self,
        key: &str,
        res_type: &str,
        value: &str,
    ) -> Result<(), libsql::Error> {
        if versioned(res_type) {
            return self.upsert_versioned(key, res_type, value).await;
        }
        // The type is the key's second level, so an existing row keeps it: left out of the
        // SET, SQLite leaves the row's `meta_type_key` entry alone (one WAL page less).
        self.exec(
            "INSERT INTO meta (key, type, value) VALUES (?1, ?2, ?3)
             ON CONFLICT(type, key) DO UPDATE SET value = excluded.value",
            params![key, res_type, value],
        )
        .await
        .map(drop)
    }

    /// Deletes `key`; the number of rows removed. A served object's delete takes a version.
    pub async fn delete(&self, key: &str) -> Result<u64, libsql::Error> {
        let res_type = type_of(key);
        if versioned(res_type) {
            return self.delete_versioned(key, res_type).await;
        }
        self.exec(
            "DELETE FROM meta WHERE type = ?2 AND key = ?1",
            [key, res_type],
        )
        .await
    }

    /// Every `value` of `res_type`, in every namespace, in key order.
    pub async fn list_by_type(&self, res_type: &str) -> Result<Vec<String>, libsql::Error> {
        Ok(self
            .rows_by_type(res_type)
            .await?
            .into_iter()
            .map(|(_, v)| v)
            .collect())
    }

    /// Every `(key, value)` of `res_type`, in key order.
    pub async fn rows_by_type(
        &self,
        res_type: &str,
    ) -> Result<Vec<(String, String)>, libsql::Error> {
        let mut rows = self
            .conn
            .query(
                "SELECT key, value FROM meta WHERE type = ?1 ORDER BY key",
                [res_type],
            )
            .await?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().await? {
            let key = text(&row, 0)?.unwrap_or_default();
            out.push((key, text(&row, 1)?.unwrap_or_default()));
        }
        Ok(out)
    }

    /// Appends one cloud-bound message to the outbox.
    pub async fn outbox_push(&self, topic: &str, payload: &[u8]) -> Result<(), libsql::Error> {
        self.exec(
            "INSERT INTO outbox (topic, payload, created_ms) VALUES (?1, ?2, ?3)",
            params![topic, payload.to_vec(), edgemeta_protocol::now_ms()],
        )
        .await
        .map(drop)
    }

    /// The oldest `limit` outbox entries after `after` and up to `upto`, oldest first.
    pub async fn outbox_peek(
        &self,
        after: i64,
        upto: i64,
        limit: usize,
    ) -> Result<Vec<OutboxEntry>, libsql::Error> {
        const SQL: &str = "SELECT seq, topic, payload FROM outbox WHERE seq > ?1 AND seq <= ?2 \
             ORDER BY seq LIMIT ?3";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([after, upto, limit as i64]).await?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().await? {
            out.push(OutboxEntry {
                seq: row.get(0)?,
                topic: row.get(1)?,
                payload: row.get(2)?,
            });
        }
        drop(rows);
        self.keep(SQL, statement);
        Ok(out)
    }

    /// The newest outbox entry's seq (0: none): the rowid b-tree's last entry, no scan.
    pub async fn outbox_last(&self) -> Result<i64, libsql::Error> {
        const SQL: &str = "SELECT coalesce(max(seq), 0) FROM outbox";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query(()).await?;
        let last = match rows.next().await? {
            Some(row) => row.get::<i64>(0)?,
            None => 0,
        };
        drop(rows);
        self.keep(SQL, statement);
        Ok(last)
    }

    /// Removes every outbox entry up to and including `seq`; the entries and bytes removed.
    pub async fn outbox_ack(&self, seq: i64) -> Result<(u64, u64), libsql::Error> {
        const SQL: &str =
            "SELECT count(*), coalesce(sum(length(payload)), 0) FROM outbox WHERE seq <= ?1";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([seq]).await?;
        let (entries, bytes) = match rows.next().await? {
            Some(row) => (row.get::<i64>(0)? as u64, row.get::<i64>(1)? as u64),
            None => (0, 0),
        };
        drop(rows);
        self.keep(SQL, statement);
        self.exec("DELETE FROM outbox WHERE seq <= ?1", [seq])
            .await?;
        Ok((entries, bytes))
    }

    /// Writes one hand-on; its sequence number.
    pub async fn handon_push(&self, message: &Message) -> Result<i64, libsql::Error> {
        self.exec(
            "INSERT INTO handon (topic, payload, correlation) VALUES (?1, ?2, ?3)",
            params![
                message.topic.as_str(),
                message.payload.to_vec(),
                message.correlation.as_ref().map(|c| c.to_vec())
            ],
        )
        .await?;
        Ok(self.conn.last_insert_rowid())
    }

    /// The oldest `limit` hand-ons after `after`, oldest first.
    pub async fn handon_peek(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<(i64, Message)>, libsql::Error> {
        const SQL: &str =
            "SELECT seq, topic, payload, correlation FROM handon WHERE seq > ?1 ORDER BY seq LIMIT ?2";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([after, limit as i64]).await?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().await? {
            let payload: Vec<u8> = row.get(2)?;
            let correlation: Option<Vec<u8>> = row.get(3)?;
            let message = Message {
                topic: row.get(1)?,
                payload: payload.into(),
                correlation: correlation.map(Into::into),
                ..Message::default()
            };
            out.push((row.get(0)?, message));
        }
        drop(rows);
        self.keep(SQL, statement);
        Ok(out)
    }

    /// The highest hand-on seq waiting (0 when none).
    pub async fn handon_last(&self) -> Result<i64, libsql::Error> {
        self.scalar_i64("SELECT coalesce(max(seq), 0) FROM handon")
            .await
    }

    /// Removes every hand-on up to and including `seq`, once handed to the broker.
    pub async fn handon_ack(&self, seq: i64) -> Result<(), libsql::Error> {
        self.exec("DELETE FROM handon WHERE seq <= ?1", [seq])
            .await
            .map(drop)
    }

    /// Counts what waits in the outbox.
    pub async fn outbox_stats(&self) -> Result<OutboxStats, libsql::Error> {
        let mut rows = self
            .conn
            .query(
                "SELECT count(*), coalesce(sum(length(payload)), 0), min(created_ms) FROM outbox",
                (),
            )
            .await?;
        Ok(match rows.next().await? {
            Some(row) => OutboxStats {
                entries: row.get::<i64>(0)? as u64,
                bytes: row.get::<i64>(1)? as u64,
                oldest_ms: row.get::<Option<i64>>(2)?,
            },
            None => OutboxStats::default(),
        })
    }

    /// Creation time of the oldest outbox entry: the first by `seq`, found through the primary
    /// key without a scan, so health checks stay cheap however deep the outbox is.
    pub async fn outbox_oldest_ms(&self) -> Result<Option<i64>, libsql::Error> {
        let mut rows = self
            .conn
            .query("SELECT created_ms FROM outbox ORDER BY seq LIMIT 1", ())
            .await?;
        match rows.next().await? {
            Some(row) => row.get::<i64>(0).map(Some),
            None => Ok(None),
        }
    }

    /// Folds the WAL back into the database file; called at shutdown.
    pub async fn checkpoint(&self) -> Result<(), libsql::Error> {
        self.conn
            .query("PRAGMA wal_checkpoint(TRUNCATE)", ())
            .await
            .map(drop)
    }
}

/// An open write transaction; ends with [`Transaction::commit`] or [`Transaction::rollback`].
#[must_use = "a transaction must be committed or rolled back"]
pub struct Transaction<'a> {
    db: &'a Db,
    /// No savepoint was opened yet, so nothing was written.
    fresh: std::cell::Cell<bool>,
}

impl<'a> Transaction<'a> {
    /// Opens a savepoint: changes that can be undone without the rest of the transaction.
    pub async fn savepoint(&self) -> Result<Savepoint<'a>, libsql::Error> {
        self.fresh.set(false);
        self.db.control("SAVEPOINT step").await?;
        Ok(Savepoint {
            db: self.db,
            changes: self.db.pending_len(),
            whole: false,
        })
    }

    /// [`Transaction::savepoint`] for the batch's first message, when nothing was written
    /// since `begin`: it needs no `SAVEPOINT`, since undoing it undoes the transaction and
    /// opens it again. That spares two statements in each batch of one message (a device
    /// report's, mostly).
    pub async fn first_savepoint(&self) -> Result<Savepoint<'a>, libsql::Error> {
        if !self.fresh.replace(false) {
            return self.savepoint().await;
        }
        Ok(Savepoint {
            db: self.db,
            changes: self.db.pending_len(),
            whole: true,
        })
    }

    /// Whether the transaction is still open: SQLite rolls back the whole transaction by itself
    /// on some errors (a full disk, I/O errors), which a savepoint cannot undo.
    pub fn is_open(&self) -> bool {
        self.db.in_transaction()
    }

    /// Commits; when that fails, rolls back, so the connection is ready for the next batch.
    pub async fn commit(self) -> Result<(), libsql::Error> {
        let committed = match self.db.prune_history().await {
            Ok(()) => self.db.control("COMMIT").await,
            Err(e) => Err(e),
        };
        if committed.is_err() {
            self.db.undone(0);
            // The prune may be undone with the rest: the next commit prunes again.
            self.db.history_pruned.store(0, Ordering::Relaxed);
        }
        if committed.is_err() && self.db.in_transaction() {
            if let Err(e) = self.db.control("ROLLBACK").await {
                tracing::warn!(error_code = "EM-STORE-TRANSACTION", error = %e, "rollback after a failed commit failed");
            }
        }
        committed
    }

    /// Undoes the whole transaction (a no-op when SQLite already did).
    pub async fn rollback(self) -> Result<(), libsql::Error> {
        self.db.undone(0);
        if self.db.in_transaction() {
            self.db.control("ROLLBACK").await?;
        }
        Ok(())
    }
}

/// A savepoint inside a [`Transaction`]: the changes of one message, or of a segment of a
/// batch's messages (the worker's `apply_steps`).
#[must_use = "a savepoint must be released or rolled back"]
pub struct Savepoint<'a> {
    db: &'a Db,
    /// Versioned changes pending when it opened.
    changes: usize,
    /// It stands for the whole transaction, opened with nothing written before it.
    whole: bool,
}

impl Savepoint<'_> {
    /// Keeps the changes made since the savepoint.
    pub async fn release(self) -> Result<(), libsql::Error> {
        if self.whole {
            return Ok(());
        }
        self.db.control("RELEASE step").await
    }

    /// Undoes the changes made since the savepoint and closes it; the transaction stays open.
    pub async fn rollback(self) -> Result<(), libsql::Error> {
        self.db.undone(self.changes);
        if self.whole {
            if self.db.in_transaction() {
                self.db.control("ROLLBACK").await?;
            }
            return self.db.control("BEGIN IMMEDIATE").await;
        }
        self.db.control("ROLLBACK TO step").await?;
        self.db.control("RELEASE step").await
    }
}

/// A text column read without trusting its storage class: libsql panics when a `String` meets a
/// non-text value, and a KubeEdge `edgecore.db` edited by hand may hold anything.
/// An object's value by key ([`Db::get`]).
const GET: &str = "SELECT value FROM meta WHERE type = ?2 AND key = ?1";

/// The `type` of the object at `key` (`<namespace>/<type>[/<name>]`): its second level, as
/// every writer stores it (docs/protocol.md §2). Lookups by key name it too, since `meta` is
/// unique on `(type, key)`: one index for both, not one each.
pub(crate) fn type_of(key: &str) -> &str {
    let rest = key.find('/').map_or("", |at| &key[at + 1..]);
    rest.find('/').map_or(rest, |at| &rest[..at])
}

fn text(row: &libsql::Row, index: i32) -> Result<Option<String>, libsql::Error> {
    match row.get_value(index)? {
        Value::Null => Ok(None),
        Value::Text(s) => Ok(Some(s)),
        Value::Integer(i) => Ok(Some(i.to_string())),
        Value::Real(r) => Ok(Some(r.to_string())),
        Value::Blob(bytes) => String::from_utf8(bytes)
            .map(Some)
            .map_err(|_| libsql::Error::InvalidColumnType),
    }
}

/// A fresh store in its own directory, for tests (the guard keeps the directory).
#[cfg(test)]
pub(crate) async fn fresh_store() -> (tempfile::TempDir, StoreConfig, Db) {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = StoreConfig {
        path: dir.path().join("edgemeta.db"),
        ..StoreConfig::default()
    };
    let db = Db::open(&config).await.expect("open");
    (dir, config, db)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each lookup of an object by key finds it through `meta_type_key`, never by reading the
    /// table: with the key's own index gone, a statement that left out the type would scan
    /// every object.
    #[tokio::test]
    async fn lookups_by_key_search_the_type_key_index() {
        let (_dir, _, db) = fresh_store().await;
        for sql in [
            GET,
            versions::CURRENT,
            cloud_applied::APPLIED_ON_ROW,
            cloud_applied::READ,
        ] {
            let mut rows = db
                .conn
                .query(&format!("EXPLAIN QUERY PLAN {sql}"), ["ns/pod/a", "pod"])
                .await
                .expect("plan");
            let mut plan = Vec::new();
            while let Some(row) = rows.next().await.expect("row") {
                plan.push(row.get::<String>(3).expect("detail"));
            }
            let on_meta: Vec<_> = plan
                .iter()
                .filter(|step| step.contains(" meta ") || step.ends_with(" meta"))
                .collect();
            assert!(!on_meta.is_empty(), "{sql}: {plan:?}");
            for step in on_meta {
                assert!(
                    step.starts_with("SEARCH meta USING") && step.contains("meta_type_key"),
                    "{sql}: {step}"
                );
            }
        }
    }

    /// A store of schema 10 (`meta` keyed by `key`, with `meta_type_key` beside it) keeps its
    /// objects, versions and applied changes; `(type, key)` is unique afterwards, so an upsert
    /// of a stored key updates its row.
    #[tokio::test]
    async fn schema_11_keeps_every_object_under_one_index() {
        let (_dir, config, db) = fresh_store().await;
        db.conn
            .execute_batch(
                "DROP TABLE meta;
                 CREATE TABLE meta (key TEXT PRIMARY KEY, type TEXT NOT NULL, value TEXT,
                     rv INTEGER NOT NULL DEFAULT 0, applied_rv INTEGER, applied_msg_id TEXT);
                 CREATE INDEX meta_type_key ON meta(type, key);
                 INSERT INTO meta VALUES ('ns/pod/a', 'pod', '{\"a\":1}', 3, 7, 'm7');
                 INSERT INTO meta VALUES ('ns/configmap/c', 'configmap', '{}', 4, NULL, NULL);
                 INSERT INTO meta VALUES ('ns/devicedata/d', 'devicedata', 'd', 0, NULL, NULL);
                 CREATE TRIGGER keep_x BEFORE INSERT ON meta WHEN NEW.key LIKE 'x/%'
                     BEGIN SELECT RAISE(ABORT, 'refused'); END;
                 PRAGMA user_version=10;",
            )
            .await
            .expect("schema 10");
        drop(db);
        let db = Db::open(&config).await.expect("reopen");
        assert_eq!(
            db.scalar_i64("PRAGMA user_version").await.expect("version"),
            11
        );
        let indexes = db
            .scalar_i64(
                "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND tbl_name = 'meta'",
            )
            .await
            .expect("indexes");
        assert_eq!(indexes, 1, "only meta_type_key");
        assert!(
            db.upsert("x/pod/refused", "pod", "{}").await.is_err(),
            "the table's trigger is made again on the new table"
        );
        assert_eq!(
            db.get("ns/pod/a").await.expect("get").as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(
            db.get("ns/devicedata/d").await.expect("get").as_deref(),
            Some("d")
        );
        assert_eq!(
            db.current("ns/configmap/c").await.expect("current"),
            Some(("{}".to_owned(), 4))
        );
        let applied = db
            .applied_on_row("ns/pod/a")
            .await
            .expect("applied")
            .expect("kept on the row");
        assert!(applied.covers("m7", Some(7), false));
        db.upsert("ns/devicedata/d", "devicedata", "e")
            .await
            .expect("upsert");
        db.upsert("ns/pod/a", "pod", "{\"a\":2}")
            .await
            .expect("upsert");
        assert_eq!(
            db.get("ns/devicedata/d").await.expect("get").as_deref(),
            Some("e")
        );
        assert_eq!(
            db.get("ns/pod/a").await.expect("get").as_deref(),
            Some("{\"a\":2}")
        );
        assert_eq!(
            db.scalar_i64("SELECT count(*) FROM meta")
                .await
                .expect("count"),
            3,
            "updated in place"
        );
        assert_eq!(db.delete("ns/configmap/c").await.expect("delete"), 1);
        assert_eq!(db.get("ns/configmap/c").await.expect("get"), None);
    }

    #[test]
    fn the_type_is_the_second_level_of_the_key() {
        assert_eq!(type_of("ns/pod/a"), "pod");
        assert_eq!(type_of("ns/pod"), "pod");
        assert_eq!(type_of("ns/devicedata/a/b"), "devicedata");
        assert_eq!(type_of("ns"), "");
        assert_eq!(type_of(""), "");
    }

    /// A batch's first message is undone with the transaction, which opens again for the
    /// rest of the batch; a later message still gets a savepoint of its own.
    #[tokio::test]
    async fn the_first_savepoint_undoes_only_its_message_and_the_batch_goes_on() {
        let (_dir, _, db) = fresh_store().await;
        db.upsert("ns/pod/kept", "pod", "v0").await.expect("upsert");
        let tx = db.begin(true).await.expect("begin");
        let first = tx.first_savepoint().await.expect("first");
        db.upsert("ns/pod/kept", "pod", "undone")
            .await
            .expect("upsert");
        db.upsert("ns/pod/a", "pod", "undone")
            .await
            .expect("upsert");
        first.rollback().await.expect("roll back the first");
        assert!(tx.is_open(), "the batch's transaction is open again");
        let second = tx.first_savepoint().await.expect("a real savepoint now");
        db.upsert("ns/pod/b", "pod", "v1").await.expect("upsert");
        second.release().await.expect("release");
        let third = tx.savepoint().await.expect("savepoint");
        db.upsert("ns/pod/c", "pod", "undone")
            .await
            .expect("upsert");
        third.rollback().await.expect("roll back the third");
        tx.commit().await.expect("commit");
        let value = |key: &'static str| {
            let db = &db;
            async move { db.get(key).await.expect("get") }
        };
        assert_eq!(value("ns/pod/kept").await.as_deref(), Some("v0"));
        assert_eq!(value("ns/pod/a").await, None);
        assert_eq!(value("ns/pod/b").await.as_deref(), Some("v1"));
        assert_eq!(value("ns/pod/c").await, None);
    }

    /// The statement cache must bind every call's own values, also after a statement failed.
    #[tokio::test]
    async fn reused_statements_see_each_calls_values() {
        let (_dir, _, db) = fresh_store().await;
        for i in 0..3 {
            db.upsert(&format!("ns/pod/p{i}"), "pod", &format!("v{i}"))
                .await
                .expect("upsert");
        }
        for i in 0..3 {
            let value = db.get(&format!("ns/pod/p{i}")).await.expect("get");
            assert_eq!(value.as_deref(), Some(format!("v{i}").as_str()));
        }
        assert!(db.control("RELEASE nothing").await.is_err());
        let tx = db.begin(true).await.expect("begin");
        let step = tx.savepoint().await.expect("savepoint");
        db.upsert("ns/pod/p0", "pod", "changed")
            .await
            .expect("upsert");
        step.rollback().await.expect("rollback to");
        let step = tx.savepoint().await.expect("savepoint");
        db.upsert("ns/pod/p3", "pod", "v3").await.expect("upsert");
        step.release().await.expect("release");
        tx.commit().await.expect("commit");
        assert_eq!(
            db.get("ns/pod/p3").await.expect("get").as_deref(),
            Some("v3")
        );
        assert_eq!(
            db.get("ns/pod/p0").await.expect("get").as_deref(),
            Some("v0")
        );
        assert_eq!(db.delete("ns/pod/p1").await.expect("delete"), 1);
        assert_eq!(db.delete("ns/pod/p1").await.expect("delete"), 0);
        assert_eq!(
            db.get("ns/pod/p2").await.expect("get").as_deref(),
            Some("v2")
        );
    }

    /// Hand-ons an earlier build stored under `edgemeta$hw/...` are published as `$hw/...`
    /// once the file is migrated; other topics keep their names.
    #[tokio::test]
    async fn stored_hand_ons_get_the_dollar_name_clients_use() {
        let (_dir, config, db) = fresh_store().await;
        for topic in [
            "edgemeta$hw/events/device/d1/twin/update/result",
            "edgemeta$ke/x",
            "a/b",
        ] {
            db.handon_push(&Message::new(topic.to_owned(), "x"))
                .await
                .expect("push");
        }
        // As a store of schema 6 was: without what schema 9 adds to `meta`.
        for drop in [
            "ALTER TABLE meta DROP COLUMN applied_rv",
            "ALTER TABLE meta DROP COLUMN applied_msg_id",
        ] {
            db.control(drop).await.expect("drop a later column");
        }
        db.control("PRAGMA user_version=6")
            .await
            .expect("version 6");
        drop(db);
        let db = Db::open(&config).await.expect("reopen");
        let topics: Vec<String> = db
            .handon_peek(0, 10)
            .await
            .expect("peek")
            .into_iter()
            .map(|(_, m)| m.topic)
            .collect();
        assert_eq!(
            topics,
            ["$hw/events/device/d1/twin/update/result", "$ke/x", "a/b"]
        );
    }

    /// Early hand-on: no commit fsyncs (the worker's syncer does, after it).
    #[tokio::test]
    async fn with_early_hand_on_no_commit_syncs() {
        let (_dir, config, db) = fresh_store().await;
        for durable in [true, false, true] {
            let tx = db.begin(durable).await.expect("begin");
            db.upsert("ns/pod/p", "pod", "v").await.expect("upsert");
            tx.commit().await.expect("commit");
            let found = db.scalar_i64("PRAGMA synchronous").await.expect("pragma");
            assert_eq!(found, 1, "NORMAL, durable {durable}");
        }
        assert!(
            config.path.with_extension("db-wal").exists(),
            "the WAL the syncer syncs"
        );
    }

    /// A batch that may skip its fsync must not leave the next, durable one without it.
    #[tokio::test]
    async fn a_relaxed_commit_does_not_outlive_its_batch() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("meta.db");
        for (configured, durable_level) in [(Synchronous::Full, 2), (Synchronous::Normal, 1)] {
            let config = StoreConfig {
                path: path.clone(),
                synchronous: configured,
                early_handon: false,
                ..StoreConfig::default()
            };
            let db = Db::open(&config).await.expect("open");
            for (durable, level) in [
                (true, durable_level),
                (false, 1),
                (false, 1),
                (true, durable_level),
            ] {
                let tx = db.begin(durable).await.expect("begin");
                db.upsert("ns/pod/p", "pod", "v").await.expect("upsert");
                tx.commit().await.expect("commit");
                let found = db.scalar_i64("PRAGMA synchronous").await.expect("pragma");
                assert_eq!(found, level, "{configured:?}, durable {durable}");
            }
        }
    }
}
