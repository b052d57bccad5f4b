//! Folds the WAL back into the database file on a thread of its own (`edgemeta-store-checkpoint`),
//! so the store thread's commits no longer stop for SQLite's automatic checkpoint: it wrote
//! and fsynced the database file inside every 1,000th page's commit, several ms that every
//! report arriving meanwhile waited out (docs/benchmarks.md, "Checkpoints off the store thread, on demand").

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tracing::warn;

use super::StoreError;

/// How often the checkpointer looks at the WAL. Short, because what it has not folded in when
/// the WAL reaches [`BACKSTOP_PAGES`] the store thread copies and fsyncs inline: at 500 ms that
/// was up to 2,000 pages and 3-5 ms every 0.3 s at 10k msg/s, the whole of P2's p99
/// (docs/benchmarks.md, "Checkpoints off the store thread, on demand").
const PERIOD: Duration = Duration::from_millis(20);

/// Unfolded WAL pages worth a pass at once. A pass fsyncs the WAL whatever it copies, so a
/// trickle of commits (a device report a millisecond: one page each) waits for this many, or
/// for [`MAX_WAIT`]; 256 is what [`PERIOD`] gathers at 10k msg/s.
const FOLD_PAGES: u32 = 256;

/// Passes run back to back after one that a commit overtook, while at most [`FOLD_PAGES`] are
/// left: each copies only what landed during the last, so it soon finishes before the next
/// commit (a commit a millisecond at 10k msg/s).
const CATCH_UP_TRIES: u32 = 4;

/// The longest a commit waits to be folded in.
const MAX_WAIT: Duration = Duration::from_millis(500);

/// WAL pages past which the store thread still checkpoints inline (SQLite's
/// `wal_autocheckpoint`): a backstop for when commits never pause long enough for a passive
/// checkpoint to catch up, so the WAL can restart from its beginning. Folded in up to the last
/// [`PERIOD`] by then, that checkpoint has little left to copy. 4 KiB pages: a WAL of at most
/// ~16 MiB.
pub(super) const BACKSTOP_PAGES: u32 = 4_000;

/// The handle to the checkpoint thread; dropping it stops the thread and waits for it, so a
/// final checkpoint after it does not race a passive one.
pub struct Checkpointer {
    /// Set by every commit; the thread checkpoints only when it finds it set.
    dirty: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Checkpointer {
    /// Opens a second connection to the store at `path` (created and migrated already) on a new
    /// thread, which runs a passive checkpoint every [`PERIOD`] after a commit.
    pub fn start(path: &Path) -> Result<Checkpointer, StoreError> {
        let dirty = Arc::new(AtomicBool::new(false));
        let (stop, mut stopped) = oneshot::channel::<()>();
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let path = path.to_owned();
        let seen = dirty.clone();
        let thread = std::thread::Builder::new()
            .name("edgemeta-store-checkpoint".into())
            .spawn(move || {
                let runtime = match super::thread_runtime() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = opened_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let opened = async {
                        let db = libsql::Builder::new_local(&path).build().await?;
                        let conn = db.connect()?;
                        Ok::<_, libsql::Error>((db, conn))
                    };
                    let (_db, conn) = match opened.await {
                        Ok(opened) => opened,
                        Err(e) => {
                            let _ = opened_tx.send(Err(StoreError::Sql(e)));
                            return;
                        }
                    };
                    let _ = opened_tx.send(Ok(()));
                    let mut index = WalIndex::new(&path);
                    let mut last_pass = Instant::now();
                    loop {
                        tokio::select! {
                            _ = &mut stopped => break,
                            _ = tokio::time::sleep(PERIOD) => {}
                        }
                        if !seen.load(Ordering::Relaxed) || !index.worth_a_pass(last_pass.elapsed())
                        {
                            continue;
                        }
                        seen.store(false, Ordering::Relaxed);
                        last_pass = Instant::now();
                        // PASSIVE never waits for the writer: it copies what is committed, and
                        // the writer goes on appending meanwhile.
                        if !fold(&conn).await {
                            continue;
                        }
                        // Only a pass that no commit overtook completes: it syncs the database
                        // file and lets the next commit restart the WAL from its beginning. A
                        // long pass never does under steady commits, and then the store thread
                        // completes one itself at the backstop, its fsyncs inline (P2's slowest
                        // 1 %). So while a short tail is left, pass again at once.
                        for _ in 0..CATCH_UP_TRIES {
                            if !index.tail_left() || !fold(&conn).await {
                                break;
                            }
                        }
                    }
                });
            })
            .map_err(StoreError::Thread)?;
        match opened_rx.recv() {
            Ok(Ok(())) => Ok(Checkpointer {
                dirty,
                stop: Some(stop),
                thread: Some(thread),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(StoreError::CheckpointerClosed),
        }
    }

    /// Notes a commit: the next pass has something to fold in.
    pub fn committed(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What the checkpointer reads of SQLite's WAL index (`<db>-shm`, laid out in SQLite's
/// "WAL-index format" document): how far the WAL goes and how much of it is folded in. Read
/// without SQLite's locks, so a torn read is possible: it only moves one pass earlier or later.
struct WalIndex {
    path: std::path::PathBuf,
    file: Option<std::fs::File>,
}

impl WalIndex {
    fn new(db: &Path) -> WalIndex {
        let mut path = db.as_os_str().to_owned();
        path.push("-shm");
        WalIndex {
            path: path.into(),
            file: None,
        }
    }

    /// `(mxFrame, nBackfill)`: the WAL's last committed frame and the frames folded in. `None`
    /// when there is no index to read (SQLite keeps it in memory, or it is not there yet) or
    /// the read caught SQLite writing it.
    fn frames(&mut self) -> Option<(u32, u32)> {
        use std::os::unix::fs::FileExt as _;
        if self.file.is_none() {
            self.file = std::fs::File::open(&self.path).ok();
        }
        let mut header = [0_u8; 100];
        if self.file.as_ref()?.read_exact_at(&mut header, 0).is_err() {
            self.file = None;
            return None;
        }
        let word = |at: usize| {
            u32::from_ne_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
        };
        // SQLite writes the header twice (bytes 0-47, 48-95) and trusts it when both agree;
        // then isInit (byte 12), mxFrame at 16; nBackfill at 96.
        (header[12] == 1 && header[..48] == header[48..96]).then(|| (word(16), word(96)))
    }

    /// Whether a pass left a tail (a commit overtook it) short enough to fold in at once.
    fn tail_left(&mut self) -> bool {
        self.frames()
            .is_some_and(|(last, folded)| folded < last && last - folded <= FOLD_PAGES)
    }

    /// Whether a pass pays now: enough to fold in, the WAL near the backstop (keep what the
    /// store thread would copy inline small), or the oldest commit waited long enough.
    fn worth_a_pass(&mut self, since_last: Duration) -> bool {
        match self.frames() {
            Some((last, folded)) => {
                last.saturating_sub(folded) >= FOLD_PAGES
                    || last.saturating_add(FOLD_PAGES) >= BACKSTOP_PAGES
                    || since_last >= MAX_WAIT
            }
            None => true,
        }
    }
}

/// One passive checkpoint, its failure logged; `false`: it failed.
async fn fold(conn: &libsql::Connection) -> bool {
    match passive(conn).await {
        Ok(()) => true,
        Err(e) => {
            warn!(error_code = "EM-STORE-CHECKPOINT", error = %e, "background WAL checkpoint failed; the store thread's backstop checkpoint still runs");
            false
        }
    }
}

/// One passive checkpoint; SQLite answers `busy` (not an error) when another is running.
async fn passive(conn: &libsql::Connection) -> Result<(), libsql::Error> {
    let mut rows = conn.query("PRAGMA wal_checkpoint(PASSIVE)", ()).await?;
    while rows.next().await?.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{fresh_store, Db};

    /// Frames in the WAL and frames already copied back, from a passive checkpoint's answer.
    async fn wal_frames(db: &Db) -> (i64, i64) {
        let mut rows = db
            .conn
            .query("PRAGMA wal_checkpoint(PASSIVE)", ())
            .await
            .expect("pragma");
        let row = rows.next().await.expect("row").expect("one row");
        (row.get(1).expect("log"), row.get(2).expect("done"))
    }

    /// Commits pods `ids` of 2,000 bytes each, one per transaction.
    async fn insert_pods(db: &Db, ids: std::ops::Range<usize>) {
        for i in ids {
            db.conn
                .execute(
                    "INSERT INTO meta (key, type, value) VALUES (?1, 'pod', ?2)",
                    libsql::params![format!("default/pod/p{i}"), "x".repeat(2_000)],
                )
                .await
                .expect("insert");
        }
    }

    #[tokio::test]
    async fn the_wal_index_tells_how_much_is_left_to_fold_in() {
        let (_dir, config, db) = fresh_store().await;
        let _ = wal_frames(&db).await;
        let mut index = WalIndex::new(&config.path);
        let (before, folded) = index.frames().expect("an index");
        assert_eq!(before, folded, "nothing left after a checkpoint");
        insert_pods(&db, 0..20).await;
        // The first write after a complete checkpoint restarts the WAL from its beginning.
        let (last, folded) = index.frames().expect("an index");
        assert!(
            last >= folded + 20,
            "20 commits are left to fold in: {folded} of {last} frames folded"
        );
        assert!(!index.worth_a_pass(Duration::ZERO), "20 pages wait");
        assert!(index.worth_a_pass(MAX_WAIT), "but not for ever");
        let (log, done) = wal_frames(&db).await;
        assert_eq!(u32::try_from(log).expect("frames"), last);
        assert_eq!(
            index.frames(),
            Some((last, u32::try_from(done).expect("frames")))
        );
    }

    #[tokio::test]
    async fn commits_are_folded_back_into_the_database_file_off_the_writer() {
        let (_dir, config, db) = fresh_store().await;
        let checkpointer = Checkpointer::start(&config.path).expect("start");
        let before = std::fs::metadata(&config.path).expect("db").len();
        insert_pods(&db, 0..200).await;
        checkpointer.committed();
        // The writer never checkpoints below the backstop: the rows reach the database file
        // only through the checkpoint thread.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while std::fs::metadata(&config.path).expect("db").len() <= before + 200 * 2_000 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the checkpoint thread never folded the WAL in"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        drop(checkpointer);
        let (log, done) = wal_frames(&db).await;
        assert_eq!(log, done, "every WAL frame is in the database file");
    }

    /// A commit a millisecond overtakes nearly every pass; the passes that follow at once still
    /// complete one now and then, so the WAL restarts from its beginning long before the
    /// backstop, where the store thread would complete one itself, with its fsyncs inline.
    /// Only restarts from below half the backstop count, so a starved checkpoint thread makes
    /// the test longer (up to its deadline), not wrong.
    #[tokio::test]
    async fn steady_commits_still_let_the_wal_restart() {
        let (_dir, config, db) = fresh_store().await;
        let checkpointer = Checkpointer::start(&config.path).expect("start");
        let mut index = WalIndex::new(&config.path);
        let (mut early_restarts, mut commits, mut previous) = (0, 0, 0);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while early_restarts < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the WAL restarted below half the backstop {early_restarts} times in {commits} commits"
            );
            insert_pods(&db, commits..commits + 1).await;
            commits += 1;
            checkpointer.committed();
            if let Some((frames, _)) = index.frames() {
                early_restarts += usize::from(frames < previous && previous < BACKSTOP_PAGES / 2);
                previous = frames;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}
