//! Reading the store from another process (`edgemeta get`) while the node runs: a read-only
//! connection sees the last commit through the WAL and never writes, locks or migrates.

use std::path::Path;
use std::time::Duration;

use libsql::OpenFlags;

use super::StoreError;

/// One object of the `meta` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRow {
    /// `<namespace>/<type>/<name>`.
    pub key: String,
    pub res_type: String,
    /// The stored document (JSON text, as KubeEdge stores it).
    pub value: String,
}

/// A read-only connection to the store at `path` (the database must outlive it).
pub(super) async fn open(
    path: &Path,
) -> Result<(libsql::Database, libsql::Connection), StoreError> {
    let db = libsql::Builder::new_local(path)
        .flags(OpenFlags::SQLITE_OPEN_READ_ONLY)
        .build()
        .await?;
    let conn = db.connect()?;
    // A checkpoint by the node holds the lock briefly.
    conn.busy_timeout(Duration::from_secs(5))?;
    Ok((db, conn))
}

/// Objects of the store at `path`: the one at `key`, or with `list` every key under `key/`,
/// sorted by key. A missing file is an error, not an empty store.
pub async fn read_meta(path: &Path, key: &str, list: bool) -> Result<Vec<MetaRow>, StoreError> {
    if !path.exists() {
        return Err(StoreError::Missing(path.display().to_string()));
    }
    let (_db, conn) = open(path).await?;
    let res_type = super::type_of(key);
    let mut rows = if list {
        // A range, not LIKE: `_` and `%` are ordinary characters in names.
        let prefix = format!("{key}/");
        let end = format!("{key}0");
        if res_type.is_empty() {
            // A whole namespace: every type's objects, so no index narrows it.
            conn.query(
                "SELECT key, type, coalesce(value, '') FROM meta WHERE key >= ?1 AND key < ?2 ORDER BY key",
                [prefix, end],
            )
            .await?
        } else {
            conn.query(
                "SELECT key, type, coalesce(value, '') FROM meta
                 WHERE type = ?3 AND key >= ?1 AND key < ?2 ORDER BY key",
                [prefix.as_str(), end.as_str(), res_type],
            )
            .await?
        }
    } else {
        conn.query(
            "SELECT key, type, coalesce(value, '') FROM meta WHERE type = ?2 AND key = ?1",
            [key, res_type],
        )
        .await?
    };
    let mut found = Vec::new();
    while let Some(row) = rows.next().await? {
        found.push(MetaRow {
            key: row.get(0)?,
            res_type: row.get(1)?,
            value: row.get(2)?,
        });
    }
    Ok(found)
}
