//! Reads for the MetaServer: one thread with its own read-only connection (WAL readers never
//! wait for the writer), fed by a bounded channel, so neither tokio workers nor the store
//! worker run these SQLite calls. Each read is one read transaction: a list and the version it
//! reports, or a history replay and the version it reaches, are one snapshot.

use libsql::Connection;
use std::path::Path;
use tokio::sync::{mpsc, oneshot};

use super::versions::{Change, Event};
use super::{text, StoreError};

/// Reads waiting for the reader thread before callers wait.
const QUEUE: usize = 256;

/// One stored object of a served type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    /// `<namespace>/<type>/<name>`.
    pub key: String,
    pub value: String,
    /// Its version (`meta.rv`).
    pub rv: u64,
}

/// What to list: objects of `res_type`, in key order.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub res_type: String,
    /// Only this namespace (the first key level).
    pub namespace: Option<String>,
    /// Only keys after this one (a `continue`).
    pub after: Option<String>,
    /// At most this many (one more is read to tell whether more follow).
    pub limit: Option<usize>,
    /// The version of the list's first page, for a `continue`: the page is served only if no
    /// object after `after` changed since (else `None`: too old, HTTP 410).
    pub at: Option<u64>,
}

/// A page of a list.
#[derive(Debug, Clone, Default)]
pub struct ListPage {
    /// The version the page is exact at.
    pub rev: u64,
    pub objects: Vec<StoredObject>,
    /// More objects follow (past `limit`).
    pub more: bool,
}

/// The changes of one type after a version.
#[derive(Debug, Clone)]
pub enum Since {
    /// Every change of the type after the version asked for, oldest first, and the version
    /// the store was at: every change up to `rev` is in `changes` or of another type.
    Changes { changes: Vec<Change>, rev: u64 },
    /// The version is older than the history (`floor`), or newer than the store (`rev`).
    Expired { floor: u64, rev: u64 },
}

enum Job {
    List(
        ListQuery,
        oneshot::Sender<Result<Option<ListPage>, StoreError>>,
    ),
    Get(
        String,
        oneshot::Sender<Result<Option<StoredObject>, StoreError>>,
    ),
    Since(String, u64, oneshot::Sender<Result<Since, StoreError>>),
}

/// The handle to the reader thread; the thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct Reader {
    jobs: mpsc::Sender<Job>,
}

impl Reader {
    /// Opens the store at `path` (already created and migrated by the node) read-only on a new
    /// thread, `edgemeta-store-reader`.
    pub async fn open(path: &Path) -> Result<Reader, StoreError> {
        let (jobs, mut rx) = mpsc::channel(QUEUE);
        let (opened_tx, opened_rx) = oneshot::channel();
        let path = path.to_owned();
        std::thread::Builder::new()
            .name("edgemeta-store-reader".into())
            .spawn(move || {
                let runtime = match super::thread_runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let (_db, conn) = match super::read_only::open(&path).await {
                        Ok(opened) => opened,
                        Err(e) => {
                            let _ = opened_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = opened_tx.send(Ok(()));
                    while let Some(job) = rx.recv().await {
                        match job {
                            Job::List(query, reply) => {
                                let _ = reply.send(read(&conn, list(&conn, &query)).await);
                            }
                            Job::Get(key, reply) => {
                                let _ = reply.send(get(&conn, &key).await.map_err(Into::into));
                            }
                            Job::Since(res_type, rv, reply) => {
                                let _ = reply.send(read(&conn, since(&conn, &res_type, rv)).await);
                            }
                        }
                    }
                });
            })
            .map_err(StoreError::Thread)?;
        opened_rx.await.map_err(|_| StoreError::ReaderClosed)??;
        Ok(Reader { jobs })
    }

    async fn ask<T>(
        &self,
        job: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Job,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.jobs
            .send(job(tx))
            .await
            .map_err(|_| StoreError::ReaderClosed)?;
        rx.await.map_err(|_| StoreError::ReaderClosed)?
    }

    /// A page of objects; `None` when `query.at` is too old for an exact page.
    pub async fn list(&self, query: ListQuery) -> Result<Option<ListPage>, StoreError> {
        self.ask(|tx| Job::List(query, tx)).await
    }

    /// The object at `key`.
    pub async fn get(&self, key: &str) -> Result<Option<StoredObject>, StoreError> {
        self.ask(|tx| Job::Get(key.to_owned(), tx)).await
    }

    /// The changes of `res_type` after version `rv`, from the history.
    pub async fn since(&self, res_type: &str, rv: u64) -> Result<Since, StoreError> {
        self.ask(|tx| Job::Since(res_type.to_owned(), rv, tx)).await
    }
}

/// Runs `body` in one read transaction (one snapshot).
async fn read<T>(
    conn: &Connection,
    body: impl std::future::Future<Output = Result<T, libsql::Error>>,
) -> Result<T, StoreError> {
    conn.execute("BEGIN", ()).await?;
    let result = body.await;
    // A read transaction has nothing to keep: end it either way.
    let ended = conn.execute("COMMIT", ()).await;
    let value = result?;
    ended?;
    Ok(value)
}

async fn scalar(conn: &Connection, sql: &str) -> Result<Option<i64>, libsql::Error> {
    let mut rows = conn.query(sql, ()).await?;
    match rows.next().await? {
        Some(row) => row.get::<Option<i64>>(0),
        None => Ok(None),
    }
}

fn version(value: i64) -> u64 {
    u64::try_from(value).unwrap_or_default()
}

/// The version the store is at, and the oldest a watch can start from: the newest history
/// row's, and the one before the oldest row's. A row of no type (schema 10) stands for a
/// version whose change is not known: a watch starts at it, not before.
async fn bounds(conn: &Connection) -> Result<(u64, u64), libsql::Error> {
    let rev = scalar(conn, "SELECT max(rv) FROM meta_history")
        .await?
        .map_or(0, version);
    let mut rows = conn
        .query(
            "SELECT rv, type = '' FROM meta_history ORDER BY rv LIMIT 1",
            (),
        )
        .await?;
    let floor = match rows.next().await? {
        Some(row) if row.get::<bool>(1)? => version(row.get::<i64>(0)?),
        Some(row) => version(row.get::<i64>(0)? - 1),
        None => rev,
    };
    Ok((rev, floor))
}

async fn list(conn: &Connection, query: &ListQuery) -> Result<Option<ListPage>, libsql::Error> {
    let (rev, floor) = bounds(conn).await?;
    let after = query.after.clone().unwrap_or_default();
    let rev = match query.at {
        None => rev,
        Some(at) if at < floor || at > rev => return Ok(None),
        Some(at) => {
            let mut rows = conn
                .query(
                    "SELECT count(*) FROM meta_history WHERE rv > ?1 AND type = ?2 AND key > ?3",
                    libsql::params![at as i64, query.res_type.as_str(), after.as_str()],
                )
                .await?;
            let changed = match rows.next().await? {
                Some(row) => row.get::<i64>(0)?,
                None => 0,
            };
            if changed > 0 {
                return Ok(None);
            }
            at
        }
    };
    let limit = query
        .limit
        .map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX - 1) + 1);
    let mut rows = match &query.namespace {
        // A key range, not LIKE: `_` and `%` are ordinary characters in names.
        Some(ns) => {
            let low = format!("{ns}/{}/", query.res_type);
            let high = format!("{ns}/{}0", query.res_type);
            let from = if after > low { after } else { low };
            conn.query(
                "SELECT key, value, rv FROM meta WHERE key > ?1 AND key < ?2 AND type = ?3
                 ORDER BY key LIMIT ?4",
                libsql::params![from, high, query.res_type.as_str(), limit],
            )
            .await?
        }
        None => {
            conn.query(
                "SELECT key, value, rv FROM meta WHERE type = ?1 AND key > ?2 ORDER BY key LIMIT ?3",
                libsql::params![query.res_type.as_str(), after, limit],
            )
            .await?
        }
    };
    let mut objects = Vec::new();
    while let Some(row) = rows.next().await? {
        objects.push(StoredObject {
            key: text(&row, 0)?.unwrap_or_default(),
            value: text(&row, 1)?.unwrap_or_default(),
            rv: version(row.get::<i64>(2)?),
        });
    }
    let more = query.limit.is_some_and(|l| objects.len() > l);
    if let Some(l) = query.limit {
        objects.truncate(l);
    }
    Ok(Some(ListPage { rev, objects, more }))
}

async fn get(conn: &Connection, key: &str) -> Result<Option<StoredObject>, libsql::Error> {
    let mut rows = conn
        .query(
            "SELECT key, value, rv FROM meta WHERE type = ?2 AND key = ?1",
            [key, super::type_of(key)],
        )
        .await?;
    match rows.next().await? {
        Some(row) => Ok(Some(StoredObject {
            key: text(&row, 0)?.unwrap_or_default(),
            value: text(&row, 1)?.unwrap_or_default(),
            rv: version(row.get::<i64>(2)?),
        })),
        None => Ok(None),
    }
}

async fn since(conn: &Connection, res_type: &str, rv: u64) -> Result<Since, libsql::Error> {
    let (rev, floor) = bounds(conn).await?;
    if rv < floor || rv > rev {
        return Ok(Since::Expired { floor, rev });
    }
    let mut rows = conn
        .query(
            // A row without a value left it to the object's `meta` row (versions.rs).
            "SELECT h.rv, h.key, h.event, coalesce(h.value, m.value) FROM meta_history h
             LEFT JOIN meta m ON h.value IS NULL AND m.key = h.key
             WHERE h.rv > ?1 AND h.type = ?2 ORDER BY h.rv",
            libsql::params![rv as i64, res_type],
        )
        .await?;
    let mut changes = Vec::new();
    while let Some(row) = rows.next().await? {
        let event = text(&row, 2)?.as_deref().and_then(Event::parse);
        changes.push(Change {
            rv: version(row.get::<i64>(0)?),
            res_type: res_type.to_owned(),
            key: text(&row, 1)?.unwrap_or_default(),
            event: event.unwrap_or(Event::Modified),
            value: text(&row, 3)?.unwrap_or_default().into(),
        });
    }
    Ok(Since::Changes { changes, rev })
}
