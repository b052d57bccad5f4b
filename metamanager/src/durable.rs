//! The durability watermark (protocol §6.1). With `store.early_handon`, commits run at SQLite's
//! `synchronous=NORMAL` (no fsync), so a batch's local hand-ons leave at COMMIT; then the store
//! thread syncs the WAL once and only then releases what the node acknowledges outward
//! (PUBACKs, cloud acknowledgements, outbox write replies). The sync stays on the store thread:
//! on a second thread it ran beside the next commit's WAL writes, which then waited for the
//! pages under writeback, and every batch paid two more thread wake-ups (docs/benchmarks.md).

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use tracing::error;

/// What to do once a commit is durable; `false`: its sync failed, so it may not be (the
/// caller refuses what it would have acknowledged, and the sender tries again).
pub(crate) type Release = Box<dyn FnOnce(bool) + Send>;

/// Syncs the WAL after a commit whose acknowledgements wait for it.
pub(crate) struct Syncer {
    wal: Wal,
    /// `false` (`store.synchronous: normal`): nothing is synced.
    sync: bool,
}

impl Syncer {
    /// Syncs `db`'s WAL (`<db>-wal`); with `sync` false it only releases.
    pub(crate) fn new(db: &std::path::Path, sync: bool) -> Syncer {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        Syncer {
            wal: Wal {
                path: PathBuf::from(wal),
                db: db.to_owned(),
                open: None,
            },
            sync,
        }
    }

    /// Makes what is committed durable if `needs_sync` (the commit wrote something), then runs
    /// `release`.
    pub(crate) fn after(&mut self, needs_sync: bool, release: Release) {
        let durable = if self.sync && needs_sync {
            match self.wal.sync() {
                Ok(()) => true,
                Err(e) => {
                    error!(error_code = "EM-STORE-SYNC", error = %e, "syncing the store's WAL failed; the batch's acknowledgements are refused");
                    false
                }
            }
        } else {
            true
        };
        release(durable);
    }
}

/// The WAL file, reopened if SQLite replaced it (a new inode).
struct Wal {
    path: PathBuf,
    /// The database file: synced instead when there is no WAL (everything checkpointed).
    db: PathBuf,
    open: Option<(std::fs::File, u64)>,
}

impl Wal {
    fn sync(&mut self) -> std::io::Result<()> {
        let meta = match std::fs::metadata(&self.path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.open = None;
                return std::fs::File::open(&self.db)?.sync_data();
            }
            Err(e) => return Err(e),
        };
        let reopen = self
            .open
            .as_ref()
            .is_none_or(|(_, inode)| *inode != meta.ino());
        if reopen {
            self.open = Some((std::fs::File::open(&self.path)?, meta.ino()));
        }
        match &self.open {
            Some((file, _)) => file.sync_data(),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn recording(seen: &Arc<Mutex<Vec<bool>>>) -> Release {
        let seen = seen.clone();
        Box::new(move |durable| seen.lock().expect("lock").push(durable))
    }

    #[test]
    fn a_commit_is_released_once_its_wal_is_synced() {
        let dir = tempfile::tempdir().expect("dir");
        let db = dir.path().join("edgemeta.db");
        std::fs::write(&db, b"db").expect("db");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut syncer = Syncer::new(&db, true);
        // No WAL (everything checkpointed): the database file is synced instead.
        syncer.after(true, recording(&seen));
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        syncer.after(true, recording(&seen));
        syncer.after(false, recording(&seen));
        assert_eq!(*seen.lock().expect("lock"), vec![true, true, true]);
    }

    #[test]
    fn a_failed_sync_refuses_what_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        // Neither the WAL nor the database exists: the sync fails.
        let mut syncer = Syncer::new(&dir.path().join("gone.db"), true);
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, recording(&seen));
        // Nothing to make durable: released as it is.
        syncer.after(false, recording(&seen));
        assert_eq!(*seen.lock().expect("lock"), vec![false, true]);
    }
}
