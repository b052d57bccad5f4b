//! The durability watermark (protocol §6.3). With `store.early_handon`, commits run at SQLite's
//! `synchronous=NORMAL` (no fsync), so a batch's local hand-ons leave at COMMIT; what the node
//! acknowledges outward (PUBACKs, cloud acknowledgements, outbox rows read for the cloud) waits
//! here, in commit order, until one `fdatasync` of the WAL on this thread covers its commit. The
//! store thread goes on with the next batch meanwhile, so under load one sync covers several.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tracing::error;

/// What to do once a commit is durable; `false`: its sync failed, so it may not be (the
/// caller refuses what it would have acknowledged, and the sender tries again).
pub(crate) type Release = Box<dyn FnOnce(bool) + Send>;

/// The thread that syncs the WAL and releases, in order, what waited for it.
pub(crate) struct Syncer {
    tx: Option<mpsc::Sender<(bool, Release)>>,
    thread: Option<JoinHandle<()>>,
}

impl Syncer {
    /// Syncs `db`'s WAL (`<db>-wal`); with `sync` false (`store.synchronous: normal`) it only
    /// keeps the order.
    pub(crate) fn start(db: &std::path::Path, sync: bool) -> std::io::Result<Syncer> {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let mut file = Wal {
            path: PathBuf::from(wal),
            db: db.to_owned(),
            open: None,
        };
        let (tx, rx) = mpsc::channel::<(bool, Release)>();
        let thread = std::thread::Builder::new()
            .name("edgemeta-sync".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let mut group = vec![first];
                    group.extend(rx.try_iter());
                    let durable = if sync && group.iter().any(|(needs, _)| *needs) {
                        match file.sync() {
                            Ok(()) => true,
                            Err(e) => {
                                error!(error_code = "EM-STORE-SYNC", error = %e, "syncing the store's WAL failed; its last commits are refused");
                                false
                            }
                        }
                    } else {
                        true
                    };
                    for (_, release) in group {
                        release(durable);
                    }
                }
            })?;
        Ok(Syncer {
            tx: Some(tx),
            thread: Some(thread),
        })
    }

    /// Runs `release` once everything committed so far is durable (`needs_sync`: this commit
    /// added something to make durable; otherwise it only waits its turn).
    pub(crate) fn after(&self, needs_sync: bool, release: Release) {
        match &self.tx {
            Some(tx) => {
                if let Err(mpsc::SendError((_, release))) = tx.send((needs_sync, release)) {
                    release(false);
                }
            }
            None => release(false),
        }
    }

    /// Releases what is still waiting (after a last sync) and ends the thread.
    pub(crate) fn finish(&mut self) {
        self.tx.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.finish();
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

    #[test]
    fn releases_come_in_commit_order_after_the_sync() {
        let dir = tempfile::tempdir().expect("dir");
        let db = dir.path().join("edgemeta.db");
        std::fs::write(&db, b"db").expect("db");
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        let mut syncer = Syncer::start(&db, true).expect("start");
        let seen = Arc::new(Mutex::new(Vec::new()));
        for n in 0..100 {
            let seen = seen.clone();
            syncer.after(
                n % 3 == 0,
                Box::new(move |durable| seen.lock().expect("lock").push((n, durable))),
            );
        }
        syncer.finish();
        let seen = seen.lock().expect("lock").clone();
        assert_eq!(seen, (0..100).map(|n| (n, true)).collect::<Vec<_>>());
    }

    #[test]
    fn a_failed_sync_refuses_what_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        // Neither the WAL nor the database exists: the sync fails.
        let mut syncer = Syncer::start(&dir.path().join("gone.db"), true).expect("start");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        syncer.after(
            true,
            Box::new(move |durable| kept.lock().expect("lock").push(durable)),
        );
        syncer.finish();
        assert_eq!(*seen.lock().expect("lock"), vec![false]);
    }
}
