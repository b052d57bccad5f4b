//! The durability watermark (protocol §6.1). With `store.early_handon`, commits run at SQLite's
//! `synchronous=NORMAL` (no fsync), so a batch's local hand-ons leave at COMMIT; then the store
//! thread syncs the WAL once and only then releases what the node acknowledges outward
//! (PUBACKs, cloud acknowledgements, outbox write replies). The sync stays on the store thread:
//! on a second thread it ran beside the next commit's WAL writes, which then waited for the
//! pages under writeback, and every batch paid two more thread wake-ups (docs/benchmarks.md).
//! `store.sync_delay_ms` lets the commits of that long share one sync: at a steady trickle
//! (1,000 devices reporting once a second) one fsync per commit was a fifth of the node's CPU.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::error;

/// What to do once a commit is durable; `false`: its sync failed, so it may not be (the
/// caller refuses what it would have acknowledged, and the sender tries again).
pub(crate) type Release = Box<dyn FnOnce(bool) + Send>;

/// Syncs the WAL after commits whose acknowledgements wait for it, and releases them in commit
/// order.
pub(crate) struct Syncer {
    wal: Wal,
    /// `false` (`store.synchronous: normal`): nothing is synced.
    sync: bool,
    /// How long a commit's acknowledgements may wait for later commits to share its sync.
    delay: Duration,
    /// Releases of commits not synced yet, oldest first.
    pending: Vec<Release>,
    /// When the oldest pending commit that wrote something committed; `None`: nothing to sync.
    since: Option<Instant>,
    /// The last two distinct senders whose messages committed, and when. A sync waits only
    /// while more than one sender commits: a lone sender's next message may be waiting for
    /// this very acknowledgement (one message in flight), and nobody else would share it;
    /// unless its later messages are queued already: then they share it (a burst from one
    /// client hands on without waiting for an fsync between its batches).
    recent: [Option<(usize, Instant)>; 2],
}

impl Syncer {
    /// Syncs `db`'s WAL (`<db>-wal`); with `sync` false it only releases. A commit waits at
    /// most `delay` for others to share its sync.
    pub(crate) fn new(db: &std::path::Path, sync: bool, delay: Duration) -> Syncer {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        Syncer {
            wal: Wal {
                path: PathBuf::from(wal),
                db: db.to_owned(),
                open: None,
            },
            sync,
            delay: if sync { delay } else { Duration::ZERO },
            pending: Vec::new(),
            since: None,
            recent: [None; 2],
        }
    }

    /// Queues `release` behind the commits not synced yet; `needs_sync`: the commit wrote
    /// something; `senders`: whose messages it committed ([`crate::unit::Done::sender`]);
    /// `queued`: more jobs wait for the store thread. Syncs and releases at once unless other
    /// senders' commits, or the queued jobs, may share the sync.
    pub(crate) fn after(
        &mut self,
        needs_sync: bool,
        senders: &[usize],
        release: Release,
        queued: bool,
    ) {
        let now = Instant::now();
        for &sender in senders {
            self.heard(sender, now);
        }
        self.pending.push(release);
        if needs_sync && self.since.is_none() {
            self.since = Some(now);
        }
        if self.since.is_none() || self.delay.is_zero() || !(queued || self.shared(now)) {
            self.flush();
        }
    }

    /// The store thread found nothing queued: a lone sender's commits are synced now, since
    /// nobody else would share the sync (see [`Syncer::after`]).
    pub(crate) fn idle(&mut self) {
        if self.since.is_some() && !self.shared(Instant::now()) {
            self.flush();
        }
    }

    fn heard(&mut self, sender: usize, now: Instant) {
        match self.recent[0] {
            Some((last, _)) if last == sender => self.recent[0] = Some((sender, now)),
            _ => self.recent = [Some((sender, now)), self.recent[0]],
        }
    }

    /// Whether a second sender committed within the delay.
    fn shared(&self, now: Instant) -> bool {
        self.recent[1].is_some_and(|(_, at)| now.duration_since(at) <= self.delay)
    }

    /// When the oldest commit waiting for a sync has waited `delay`.
    pub(crate) fn due(&self) -> Option<Instant> {
        self.since.map(|since| since + self.delay)
    }

    /// Whether a commit waits for a sync.
    pub(crate) fn waiting(&self) -> bool {
        self.since.is_some()
    }

    /// Makes every pending commit durable (one sync, if one wrote something), then releases
    /// them in order.
    pub(crate) fn flush(&mut self) {
        let durable = if self.sync && self.since.is_some() {
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
        self.since = None;
        // One write per client for all the PUBACKs this sync releases.
        let _cork = edgemeta_broker::Cork::new();
        for release in self.pending.drain(..) {
            release(durable);
        }
    }
}

impl Drop for Syncer {
    /// Nothing committed is left unacknowledged when the store thread ends, even by a panic:
    /// it is synced first.
    fn drop(&mut self) {
        self.flush();
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
        let mut syncer = Syncer::new(&db, true, Duration::ZERO);
        // No WAL (everything checkpointed): the database file is synced instead.
        syncer.after(true, &[], recording(&seen), false);
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        syncer.after(true, &[], recording(&seen), false);
        syncer.after(false, &[], recording(&seen), false);
        assert_eq!(*seen.lock().expect("lock"), vec![true, true, true]);
    }

    #[test]
    fn a_failed_sync_refuses_what_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        // Neither the WAL nor the database exists: the sync fails.
        let mut syncer = Syncer::new(&dir.path().join("gone.db"), true, Duration::ZERO);
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, &[], recording(&seen), false);
        // Nothing to make durable: released as it is.
        syncer.after(false, &[], recording(&seen), false);
        assert_eq!(*seen.lock().expect("lock"), vec![false, true]);
    }

    fn numbered(seen: &Arc<Mutex<Vec<(u32, bool)>>>, n: u32) -> Release {
        let seen = seen.clone();
        Box::new(move |durable| seen.lock().expect("lock").push((n, durable)))
    }

    /// A syncer with `delay` over a store whose WAL exists (in the returned directory).
    fn over_a_wal(delay: Duration) -> (tempfile::TempDir, Syncer) {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        let syncer = Syncer::new(&dir.path().join("edgemeta.db"), true, delay);
        (dir, syncer)
    }

    #[test]
    fn commits_of_several_senders_within_the_delay_share_one_sync_in_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let delay = Duration::from_secs(60);
        let (_dir, mut syncer) = over_a_wal(delay);
        // A lone sender is synced at once: its next message may wait for this PUBACK.
        syncer.after(true, &[7], numbered(&seen, 1), false);
        syncer.after(true, &[7], numbered(&seen, 2), false);
        assert_eq!(*seen.lock().expect("lock"), vec![(1, true), (2, true)]);
        assert!(syncer.due().is_none());
        // A second sender within the delay: commits wait for others to share their sync.
        let before = Instant::now();
        syncer.after(true, &[8], numbered(&seen, 3), false);
        let due = syncer.due().expect("a commit waits");
        assert!(due >= before + delay && due <= Instant::now() + delay);
        // Behind a commit that waits, one with nothing to sync waits too: order is kept.
        syncer.after(false, &[], numbered(&seen, 4), false);
        syncer.after(true, &[7], numbered(&seen, 5), false);
        assert_eq!(
            syncer.due(),
            Some(due),
            "the oldest commit sets the deadline"
        );
        assert_eq!(seen.lock().expect("lock").len(), 2);
        syncer.flush();
        assert_eq!(
            seen.lock().expect("lock")[2..],
            [(3, true), (4, true), (5, true)]
        );
        assert!(!syncer.waiting() && syncer.due().is_none());
        // Nothing waits: a commit that wrote nothing is released at once.
        syncer.after(false, &[8], numbered(&seen, 6), false);
        assert_eq!(seen.lock().expect("lock").len(), 6);
        // What is still waiting when the store thread ends is synced and released.
        syncer.after(true, &[7], numbered(&seen, 7), false);
        assert_eq!(seen.lock().expect("lock").len(), 6);
        drop(syncer);
        assert_eq!(seen.lock().expect("lock").last(), Some(&(7, true)));
    }

    #[test]
    fn a_lone_senders_burst_shares_one_sync_once_nothing_is_queued() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (_dir, mut syncer) = over_a_wal(Duration::from_secs(60));
        // More of its messages are queued: they commit before the sync, not after it.
        syncer.after(true, &[7], numbered(&seen, 1), true);
        syncer.after(true, &[7], numbered(&seen, 2), true);
        assert!(seen.lock().expect("lock").is_empty());
        assert!(syncer.waiting());
        // The last batch of the burst, with nothing queued behind it: synced at once.
        syncer.after(true, &[7], numbered(&seen, 3), false);
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, true), (2, true), (3, true)]
        );
        // Queued work that commits nothing (a read): the idle store thread syncs.
        syncer.after(true, &[7], numbered(&seen, 4), true);
        syncer.idle();
        assert_eq!(seen.lock().expect("lock").len(), 4);
        // Two senders: idle leaves the sync to the delay, for others to share.
        syncer.after(true, &[8], numbered(&seen, 5), false);
        syncer.idle();
        assert_eq!(seen.lock().expect("lock").len(), 4);
        assert!(syncer.due().is_some());
    }

    #[test]
    fn a_failed_shared_sync_refuses_every_commit_that_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        let mut syncer = Syncer::new(&dir.path().join("gone.db"), true, Duration::from_secs(60));
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, &[1, 2], numbered(&seen, 1), false);
        syncer.after(true, &[2], numbered(&seen, 2), false);
        assert!(seen.lock().expect("lock").is_empty());
        syncer.flush();
        assert_eq!(*seen.lock().expect("lock"), vec![(1, false), (2, false)]);
    }

    #[test]
    fn without_fsync_nothing_waits() {
        let dir = tempfile::tempdir().expect("dir");
        // `synchronous: normal`: the delay does not apply, since there is no sync to share.
        let mut syncer = Syncer::new(&dir.path().join("gone.db"), false, Duration::from_secs(60));
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, &[1, 2], numbered(&seen, 1), false);
        assert_eq!(*seen.lock().expect("lock"), vec![(1, true)]);
    }
}
