//! The durability watermark (protocol §6.1). With `store.early_handon`, commits run at SQLite's
//! `synchronous=NORMAL` (no fsync), so a batch's local hand-ons leave at COMMIT; then the WAL is
//! synced once and only then is what the node acknowledges outward released (PUBACKs, cloud
//! acknowledgements, outbox write replies), in commit order. The sync runs on a thread of its
//! own (`edgemeta-store-sync`), so the store thread goes on committing while the disk works: a
//! report arriving during a slow fsync no longer waits it out (docs/benchmarks.md).
//! `store.sync_delay_ms` lets the commits of that long share one sync: at a steady trickle
//! (1,000 devices reporting once a second) one fsync per commit was a fifth of the node's CPU.
//! Nobody waits for others who cannot come: see [`Syncer::committed`].

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tracing::error;

/// What to do once a commit is durable; `false`: its sync failed, so it may not be (the
/// caller refuses what it would have acknowledged, and the sender tries again).
pub(crate) type Release = Box<dyn FnOnce(bool) + Send>;

/// Flushes the sync thread may hold before the store thread waits for it: the disk sets the
/// pace then, as it would with the sync inline.
const QUEUED_FLUSHES: usize = 64;

/// A sender heard within this many sync delays may still share a sync: a commit waits for
/// others only while some sender heard that recently has nothing waiting for the sync.
const RECENT_DELAYS: u32 = 10;

/// A sync this many messages wait for starts without waiting for more: they share its cost
/// well enough, and a pipelining sender may have filled its window by then (`mosquitto_pub`
/// keeps 20 in flight, Paho Java 10), so waiting longer would only stall it.
const SHARED_ENOUGH: usize = 8;

/// Decides when the commits that wait for a sync are synced, and hands them to the sync
/// thread, which syncs the WAL and releases them in commit order.
pub(crate) struct Syncer {
    /// How long a commit's acknowledgements may wait for later commits to share its sync.
    delay: Duration,
    /// Releases of commits not handed to the sync thread yet, oldest first.
    pending: Vec<Release>,
    /// When the oldest pending commit that wrote something committed; `None`: nothing to sync.
    since: Option<Instant>,
    /// Every sender heard within [`RECENT_DELAYS`] delays, and whether a commit of its waits
    /// here for a sync. When all of them wait, nobody is left to share the sync (several
    /// clients that each wait for their PUBACK before the next publish): it starts at once.
    senders: Senders,
    /// How many messages the pending commits hold ([`SHARED_ENOUGH`]).
    pending_messages: usize,
    /// A pending commit holds a message its client sent within a delay of its previous
    /// PUBACK, with nothing else in flight: it waits for this sync to publish again.
    awaited: bool,
    /// The newest outbox row of the pending commits, if they wrote any.
    pending_outbox: Option<i64>,
    /// The newest outbox row the sync thread has synced.
    outbox_synced: Arc<AtomicI64>,
    thread: Option<(mpsc::SyncSender<Flush>, std::thread::JoinHandle<()>)>,
}

/// The senders heard lately, each step O(1) amortised: with 10,000 devices each on its own
/// connection, scanning them all at every commit took 3–4 % of the node's CPU samples.
#[derive(Default)]
struct Senders {
    /// Each sender remembered: when it was last heard, and `flushes` then (it has a commit
    /// waiting while that is still the count).
    heard: HashMap<usize, (Instant, u64)>,
    /// Every hearing in time order, to forget the quiet senders (a hearing that is not its
    /// sender's last is passed over).
    order: VecDeque<(Instant, usize)>,
    /// Hand-overs to the sync thread so far.
    flushes: u64,
    /// How many remembered senders have a commit waiting.
    waiting: usize,
    /// The last two distinct senders heard and when, the latest first.
    last: [Option<(usize, Instant)>; 2],
}

impl Senders {
    /// `sender` committed at `now` (never earlier than a hearing before it).
    fn heard(&mut self, sender: usize, now: Instant) {
        // Another of its messages in the same commit: heard already.
        if self.last[0] == Some((sender, now))
            && self
                .heard
                .get(&sender)
                .is_some_and(|&(_, flushes)| flushes == self.flushes)
        {
            return;
        }
        match self.heard.insert(sender, (now, self.flushes)) {
            Some((_, flushes)) if flushes == self.flushes => {}
            _ => self.waiting += 1,
        }
        self.order.push_back((now, sender));
        match self.last[0] {
            Some((latest, _)) if latest == sender => self.last[0] = Some((sender, now)),
            _ => self.last = [Some((sender, now)), self.last[0]],
        }
    }

    /// Forgets the senders not heard within `recent` of `now`.
    fn forget_quiet(&mut self, now: Instant, recent: Duration) {
        while let Some(&(at, sender)) = self.order.front() {
            if now.duration_since(at) <= recent {
                break;
            }
            self.order.pop_front();
            if let Entry::Occupied(entry) = self.heard.entry(sender) {
                if entry.get().0 == at {
                    let (_, flushes) = entry.remove();
                    if flushes == self.flushes {
                        self.waiting -= 1;
                    }
                }
            }
        }
    }

    /// Everything pending was handed to the sync thread: nobody has a commit waiting.
    fn flushed(&mut self) {
        self.flushes += 1;
        self.waiting = 0;
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.heard.len()
    }
}

/// One hand-over to the sync thread.
struct Flush {
    /// The newest outbox row of its commits, if they wrote any.
    outbox: Option<i64>,
    needs_sync: bool,
    releases: Vec<Release>,
    /// Told once this flush and those before it are released ([`Syncer::settle`]).
    settled: Option<mpsc::SyncSender<()>>,
}

impl Syncer {
    /// Starts the sync thread for `db`'s WAL (`<db>-wal`); with `sync` false it only
    /// releases. A commit waits at most `delay` for others to share its sync. `outbox`: the
    /// newest outbox row when the store opened (durable by then).
    pub(crate) fn start(
        db: &std::path::Path,
        sync: bool,
        delay: Duration,
        outbox: i64,
    ) -> std::io::Result<Syncer> {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        let mut wal = Wal {
            path: PathBuf::from(wal),
            db: db.to_owned(),
            file: None,
        };
        let outbox_synced = Arc::new(AtomicI64::new(outbox));
        let (tx, rx) = mpsc::sync_channel::<Flush>(QUEUED_FLUSHES);
        let shared = outbox_synced.clone();
        let thread = std::thread::Builder::new()
            .name("edgemeta-store-sync".into())
            .spawn(move || serve(&rx, &mut wal, sync, &shared))?;
        Ok(Syncer {
            delay: if sync { delay } else { Duration::ZERO },
            pending: Vec::new(),
            since: None,
            senders: Senders::default(),
            pending_messages: 0,
            awaited: false,
            pending_outbox: None,
            outbox_synced,
            thread: Some((tx, thread)),
        })
    }

    /// Records a commit, and says whether its sync is to start at once: `needs_sync`: it wrote
    /// something; `senders`: whose messages it committed ([`crate::unit::Done::sender`]);
    /// `after_ack`: the soonest any was sent after its client's previous PUBACK
    /// ([`crate::unit::Done::after_ack`]); `queued`: more jobs wait for the store thread;
    /// `outbox`: its newest outbox row, if it wrote any. At once unless other senders'
    /// commits, or the queued jobs, may share the sync ([`Syncer::nothing_to_wait_for`]).
    /// Its release follows with [`Syncer::hand`].
    pub(crate) fn committed(
        &mut self,
        needs_sync: bool,
        senders: &[usize],
        after_ack: Option<Duration>,
        queued: bool,
        outbox: Option<i64>,
    ) -> bool {
        let now = Instant::now();
        for &sender in senders {
            self.heard(sender, now);
        }
        self.pending_messages += senders.len();
        self.awaited |= after_ack.is_some_and(|after| after <= self.delay);
        self.pending_outbox = outbox.or(self.pending_outbox);
        if needs_sync && self.since.is_none() {
            self.since = Some(now);
        }
        self.since.is_none() || self.delay.is_zero() || (!queued && self.nothing_to_wait_for(now))
    }

    /// Queues the last commit's `release` behind the commits not synced yet, and hands them
    /// all to the sync thread if its sync is to start `now` ([`Syncer::committed`]).
    pub(crate) fn hand(&mut self, release: Release, now: bool) {
        self.pending.push(release);
        if now {
            self.flush();
        }
    }

    /// [`Syncer::committed`], then [`Syncer::hand`].
    #[cfg(test)]
    fn after(
        &mut self,
        needs_sync: bool,
        senders: &[usize],
        after_ack: Option<Duration>,
        release: Release,
        queued: bool,
        outbox: Option<i64>,
    ) {
        let now = self.committed(needs_sync, senders, after_ack, queued, outbox);
        self.hand(release, now);
    }

    /// The store thread found nothing queued: a lone sender's commits are synced now, since
    /// nobody else would share the sync (see [`Syncer::committed`]).
    pub(crate) fn idle(&mut self) {
        let now = Instant::now();
        if self.since.is_some() && self.nothing_to_wait_for(now) {
            self.flush();
        }
    }

    /// Whether the sync should not wait for more commits: one sender only; every sender heard
    /// lately waits for it; enough messages share it; or a client waits for it to go on.
    fn nothing_to_wait_for(&mut self, now: Instant) -> bool {
        !self.shared(now) || self.all_waiting(now) || self.enough() || self.awaited
    }

    fn heard(&mut self, sender: usize, now: Instant) {
        // Only senders heard lately are kept, however many connect over time.
        self.senders.forget_quiet(now, self.delay * RECENT_DELAYS);
        self.senders.heard(sender, now);
    }

    /// Whether every sender heard recently has a commit waiting here (forgetting the others).
    fn all_waiting(&mut self, now: Instant) -> bool {
        self.senders.forget_quiet(now, self.delay * RECENT_DELAYS);
        self.senders.waiting == self.senders.heard.len()
    }

    /// Whether enough messages wait for the sync to share it without waiting for more.
    fn enough(&self) -> bool {
        self.pending_messages >= SHARED_ENOUGH
    }

    /// Whether a second sender committed within the delay. A sync waits only while more than
    /// one sender commits: a lone sender's next message may be waiting for this very
    /// acknowledgement (one message in flight), and nobody else would share it; unless its
    /// later messages are queued already: then they share it (a burst from one client hands on
    /// without waiting for an fsync between its batches).
    fn shared(&self, now: Instant) -> bool {
        // The second-to-last sender heard is the latest of all but the last one.
        self.senders.last[1].is_some_and(|(_, at)| now.duration_since(at) <= self.delay)
    }

    /// When the oldest commit waiting for a sync has waited `delay`.
    pub(crate) fn due(&self) -> Option<Instant> {
        self.since.map(|since| since + self.delay)
    }

    /// Whether a commit waits for a sync not yet begun.
    pub(crate) fn waiting(&self) -> bool {
        self.since.is_some()
    }

    /// The newest outbox row that is synced: outbox rows are read for the cloud or the relay
    /// only up to it (protocol §6.1).
    pub(crate) fn outbox_synced(&self) -> i64 {
        self.outbox_synced.load(Ordering::Acquire)
    }

    /// Hands every pending commit to the sync thread: one sync (if one wrote something),
    /// then their releases in order.
    pub(crate) fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.senders.flushed();
        self.pending_messages = 0;
        self.awaited = false;
        let flush = Flush {
            outbox: self.pending_outbox.take(),
            needs_sync: self.since.take().is_some(),
            releases: std::mem::take(&mut self.pending),
            settled: None,
        };
        let refused = match &self.thread {
            Some((tx, _)) => match tx.send(flush) {
                Ok(()) => return,
                Err(mpsc::SendError(flush)) => flush,
            },
            None => flush,
        };
        // The sync thread is gone (it panicked): nothing of this flush may be acknowledged.
        for release in refused.releases {
            release(false);
        }
    }

    /// Flushes, and waits until everything handed over so far is released: what follows
    /// (a failed batch's refusals, the final checkpoint) comes after it.
    pub(crate) fn settle(&mut self) {
        self.flush();
        self.handed_over();
    }

    /// Waits until the sync thread has released everything handed to it so far, leaving what
    /// is pending here as it is.
    fn handed_over(&self) {
        let (tx, rx) = mpsc::sync_channel(1);
        let marker = Flush {
            outbox: None,
            needs_sync: false,
            releases: Vec::new(),
            settled: Some(tx),
        };
        if let Some((sender, _)) = &self.thread {
            if sender.send(marker).is_ok() {
                let _ = rx.recv();
            }
        }
    }
}

/// The sync thread: syncs the WAL for each flush, and for the flushes that queued up
/// meanwhile (they share the sync), then releases them in order.
fn serve(rx: &mpsc::Receiver<Flush>, wal: &mut Wal, sync: bool, outbox_synced: &AtomicI64) {
    while let Ok(first) = rx.recv() {
        let mut flushes = vec![first];
        flushes.extend(rx.try_iter());
        let ok = !(sync && flushes.iter().any(|f| f.needs_sync))
            || {
                match wal.sync() {
                    Ok(()) => true,
                    Err(e) => {
                        error!(error_code = "EM-STORE-SYNC", error = %e, "syncing the store's WAL failed; the batch's acknowledgements are refused");
                        false
                    }
                }
            };
        // Before the releases: an outbox read that one of them prompts finds its rows. After a
        // failed sync they count as synced too (as when the sync was inline): they are
        // committed, and a later sync covers them.
        if let Some(last) = flushes.iter().filter_map(|f| f.outbox).max() {
            outbox_synced.fetch_max(last, Ordering::Release);
        }
        {
            for flush in &mut flushes {
                // A flush whose commits wrote nothing needs no sync to be durable.
                let durable = ok || !flush.needs_sync;
                for release in flush.releases.drain(..) {
                    release(durable);
                }
            }
        }
        for settled in flushes.into_iter().filter_map(|f| f.settled) {
            let _ = settled.send(());
        }
    }
}

impl Drop for Syncer {
    /// Nothing committed is left unacknowledged when the store thread ends, even by a panic:
    /// it is synced first, and the sync thread ends after releasing it.
    fn drop(&mut self) {
        self.flush();
        if let Some((tx, thread)) = self.thread.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

/// The WAL file, opened once and kept: SQLite never replaces it, and removes it only as the
/// database's last connection closes, after checkpointing all of it into the synced database
/// file. One descriptor is told of every writeback error since it opened, even one the
/// checkpoint's own fsync saw first; a file opened after that error would not be.
struct Wal {
    path: PathBuf,
    /// The database file: synced instead while there is no WAL (everything checkpointed).
    db: PathBuf,
    file: Option<std::fs::File>,
}

impl Wal {
    /// Never `stat`s the file: a stat marks the WAL's timestamps as seen, the kernel then stamps
    /// each write finely, and on ext4 without a journal every fdatasync also wrote the inode
    /// (block writes per synced message 3.0 → 2.3).
    fn sync(&mut self) -> std::io::Result<()> {
        let file = match &mut self.file {
            Some(file) => file,
            None => match std::fs::File::open(&self.path) {
                Ok(file) => self.file.insert(file),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return std::fs::File::open(&self.db)?.sync_data();
                }
                Err(e) => return Err(e),
            },
        };
        file.sync_data()
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
        let mut syncer = Syncer::start(&db, true, Duration::ZERO, 0).expect("start");
        // No WAL (everything checkpointed): the database file is synced instead.
        syncer.after(true, &[], None, recording(&seen), false, None);
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        syncer.after(true, &[], None, recording(&seen), false, None);
        syncer.after(false, &[], None, recording(&seen), false, None);
        syncer.handed_over();
        assert_eq!(*seen.lock().expect("lock"), vec![true, true, true]);
    }

    #[test]
    fn a_failed_sync_refuses_what_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        // Neither the WAL nor the database exists: the sync fails.
        let mut syncer =
            Syncer::start(&dir.path().join("gone.db"), true, Duration::ZERO, 0).expect("start");
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, &[], None, recording(&seen), false, None);
        // Nothing to make durable: released as it is.
        syncer.after(false, &[], None, recording(&seen), false, None);
        syncer.handed_over();
        assert_eq!(*seen.lock().expect("lock"), vec![false, true]);
    }

    /// A writeback error is reported to each descriptor open before it (Linux `lib/errseq.c`,
    /// `errseq_sample`): a WAL opened anew for each sync would miss one the checkpoint's own
    /// fsync of the WAL saw first, and acknowledge what was lost.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_wal_is_synced_through_one_descriptor_kept_from_the_first_sync() {
        let (dir, mut syncer) = over_a_wal(Duration::ZERO);
        let wal = std::fs::canonicalize(dir.path().join("edgemeta.db-wal")).expect("wal");
        let open = || {
            std::fs::read_dir("/proc/self/fd")
                .expect("fds")
                .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter(|target| *target == wal)
                .count()
        };
        assert_eq!(open(), 0, "opened before its first sync");
        let seen = Arc::new(Mutex::new(Vec::new()));
        for _ in 0..3 {
            syncer.after(true, &[], None, recording(&seen), false, None);
            syncer.handed_over();
            assert_eq!(open(), 1, "the WAL's descriptor after a sync");
        }
        assert_eq!(*seen.lock().expect("lock"), vec![true, true, true]);
        drop(syncer);
        assert_eq!(open(), 0, "closed with the sync thread");
    }

    fn numbered(seen: &Arc<Mutex<Vec<(u32, bool)>>>, n: u32) -> Release {
        let seen = seen.clone();
        Box::new(move |durable| seen.lock().expect("lock").push((n, durable)))
    }

    /// A syncer with `delay` over a store whose WAL exists (in the returned directory).
    fn over_a_wal(delay: Duration) -> (tempfile::TempDir, Syncer) {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::write(dir.path().join("edgemeta.db-wal"), b"wal").expect("wal");
        let syncer = Syncer::start(&dir.path().join("edgemeta.db"), true, delay, 0).expect("start");
        (dir, syncer)
    }

    #[test]
    fn commits_of_several_senders_within_the_delay_share_one_sync_in_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let delay = Duration::from_secs(60);
        let (_dir, mut syncer) = over_a_wal(delay);
        // A lone sender is synced at once: its next message may wait for this PUBACK.
        syncer.after(true, &[7], None, numbered(&seen, 1), false, None);
        syncer.after(true, &[7], None, numbered(&seen, 2), false, None);
        syncer.handed_over();
        assert_eq!(*seen.lock().expect("lock"), vec![(1, true), (2, true)]);
        assert!(syncer.due().is_none());
        // A second sender within the delay: commits wait for others to share their sync.
        let before = Instant::now();
        syncer.after(true, &[8], None, numbered(&seen, 3), false, None);
        let due = syncer.due().expect("a commit waits");
        assert!(due >= before + delay && due <= Instant::now() + delay);
        // Behind a commit that waits, one with nothing to sync waits too: order is kept.
        syncer.after(false, &[], None, numbered(&seen, 4), false, None);
        assert_eq!(
            syncer.due(),
            Some(due),
            "the oldest commit sets the deadline"
        );
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 2);
        // Now every sender heard lately has a commit waiting (each waits for its PUBACK before
        // it publishes again): nobody is left to share the sync, which starts at once.
        syncer.after(true, &[7], None, numbered(&seen, 5), false, None);
        syncer.handed_over();
        assert_eq!(
            seen.lock().expect("lock")[2..],
            [(3, true), (4, true), (5, true)]
        );
        assert!(!syncer.waiting() && syncer.due().is_none());
        // Nothing waits: a commit that wrote nothing is released at once.
        syncer.after(false, &[8], None, numbered(&seen, 6), false, None);
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 6);
        // What is still waiting when the store thread ends is synced and released.
        syncer.after(true, &[7], None, numbered(&seen, 7), false, None);
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 6);
        drop(syncer);
        assert_eq!(seen.lock().expect("lock").last(), Some(&(7, true)));
    }

    #[test]
    fn a_sync_enough_messages_wait_for_starts_without_waiting_for_more() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (_dir, mut syncer) = over_a_wal(Duration::from_secs(60));
        // Sender 7 trickles; sender 8 pipelines a window of messages, one commit each.
        syncer.after(true, &[7], None, numbered(&seen, 0), false, None);
        syncer.after(true, &[7], None, numbered(&seen, 1), false, None);
        syncer.handed_over();
        let start = seen.lock().expect("lock").len();
        for n in 1..u32::try_from(SHARED_ENOUGH).expect("fits") {
            syncer.after(true, &[8], None, numbered(&seen, 10 + n), false, None);
            syncer.idle();
        }
        syncer.handed_over();
        assert_eq!(
            seen.lock().expect("lock").len(),
            start,
            "they wait to share the sync"
        );
        // With the window's next message enough wait: the sync starts, the sender is unblocked.
        syncer.after(true, &[8], None, numbered(&seen, 99), false, None);
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").last(), Some(&(99, true)));
        assert!(!syncer.waiting());
        // The count starts again after each sync.
        syncer.after(true, &[8], None, numbered(&seen, 100), false, None);
        syncer.after(true, &[9], None, numbered(&seen, 101), false, None);
        syncer.handed_over();
        assert!(syncer.waiting(), "two messages are not enough");
    }

    #[test]
    fn a_commit_its_client_waits_for_is_synced_without_waiting_for_others() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        // Long enough that a loaded machine cannot let it pass between two steps below: no
        // step waits it out.
        let delay = Duration::from_secs(2);
        let (_dir, mut syncer) = over_a_wal(delay);
        syncer.after(true, &[7], None, numbered(&seen, 1), false, None);
        syncer.handed_over();
        // Sender 8 published well after its last PUBACK (a trickle): it waits to share.
        syncer.after(true, &[8], Some(delay * 3), numbered(&seen, 2), false, None);
        syncer.idle();
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 1);
        // Sender 9 published right after its PUBACK, nothing else in flight: it waits for
        // this sync before its next publish, so the sync starts now, for all three.
        syncer.after(
            true,
            &[9],
            Some(Duration::from_micros(80)),
            numbered(&seen, 3),
            true,
            None,
        );
        syncer.handed_over();
        assert_eq!(
            seen.lock().expect("lock").len(),
            1,
            "queued jobs share it first"
        );
        syncer.idle();
        syncer.handed_over();
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, true), (2, true), (3, true)]
        );
        // The next sync waits again, unless someone waits for it.
        syncer.after(true, &[8], None, numbered(&seen, 4), false, None);
        syncer.handed_over();
        assert!(syncer.waiting());
    }

    #[test]
    fn a_sender_not_heard_for_ten_delays_no_longer_holds_a_sync_back() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let delay = Duration::from_millis(50);
        let (_dir, mut syncer) = over_a_wal(delay);
        syncer.after(true, &[1], None, numbered(&seen, 1), false, None);
        syncer.flush();
        // Sender 1 goes quiet; 2 and 3 take turns, each waiting for its PUBACK.
        std::thread::sleep(delay * (RECENT_DELAYS + 2));
        syncer.after(true, &[3], None, numbered(&seen, 2), false, None);
        syncer.after(true, &[2], None, numbered(&seen, 3), false, None);
        syncer.idle();
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 2, "3 may publish again");
        syncer.after(true, &[3], None, numbered(&seen, 4), false, None);
        syncer.handed_over();
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, true), (2, true), (3, true), (4, true)],
            "2 and 3 both wait: the sync starts without waiting for the quiet sender 1"
        );
    }

    #[test]
    fn only_senders_heard_lately_are_remembered() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let delay = Duration::from_millis(1);
        let (_dir, mut syncer) = over_a_wal(delay);
        for n in 0..5_000_u32 {
            let sender = usize::try_from(n).expect("fits");
            syncer.after(true, &[sender], None, numbered(&seen, n), true, None);
            if n % 500 == 499 {
                std::thread::sleep(delay * (RECENT_DELAYS + 2));
            }
        }
        assert!(
            syncer.senders.len() <= 500 && syncer.senders.order.len() <= 500,
            "{} senders remembered, {} hearings",
            syncer.senders.len(),
            syncer.senders.order.len()
        );
        drop(syncer);
        assert_eq!(seen.lock().expect("lock").len(), 5_000);
    }

    #[test]
    fn a_sender_heard_again_is_remembered_from_its_last_hearing() {
        let recent = Duration::from_millis(40);
        let t0 = Instant::now();
        let mut senders = Senders::default();
        senders.heard(1, t0);
        senders.heard(2, t0 + Duration::from_millis(10));
        senders.heard(1, t0 + Duration::from_millis(30));
        assert_eq!((senders.len(), senders.waiting), (2, 2));
        assert_eq!(senders.last.map(|l| l.map(|(s, _)| s)), [Some(1), Some(2)]);
        senders.flushed();
        assert_eq!(senders.waiting, 0, "handed over: nobody waits");
        senders.heard(2, t0 + Duration::from_millis(35));
        assert_eq!(senders.waiting, 1);
        // 1's first hearing and 2's first are quiet by now; their later ones are not.
        senders.forget_quiet(t0 + Duration::from_millis(60), recent);
        assert_eq!((senders.len(), senders.waiting), (2, 1));
        // 1 was last heard at 30 ms and waits for nothing: it goes; 2 still waits.
        senders.forget_quiet(t0 + Duration::from_millis(71), recent);
        assert_eq!((senders.len(), senders.waiting), (1, 1));
        senders.forget_quiet(t0 + Duration::from_millis(76), recent);
        assert_eq!(
            (senders.len(), senders.waiting, senders.order.len()),
            (0, 0, 0)
        );
    }

    #[test]
    fn a_lone_senders_burst_shares_one_sync_once_nothing_is_queued() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (_dir, mut syncer) = over_a_wal(Duration::from_secs(60));
        // More of its messages are queued: they commit before the sync, not after it.
        syncer.after(true, &[7], None, numbered(&seen, 1), true, None);
        syncer.after(true, &[7], None, numbered(&seen, 2), true, None);
        syncer.handed_over();
        assert!(seen.lock().expect("lock").is_empty());
        assert!(syncer.waiting());
        // The last batch of the burst, with nothing queued behind it: synced at once.
        syncer.after(true, &[7], None, numbered(&seen, 3), false, None);
        syncer.handed_over();
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, true), (2, true), (3, true)]
        );
        // Queued work that commits nothing (a read): the idle store thread syncs.
        syncer.after(true, &[7], None, numbered(&seen, 4), true, None);
        syncer.idle();
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 4);
        // Two senders: idle leaves the sync to the delay, for others to share.
        syncer.after(true, &[8], None, numbered(&seen, 5), false, None);
        syncer.idle();
        syncer.handed_over();
        assert_eq!(seen.lock().expect("lock").len(), 4);
        assert!(syncer.due().is_some());
    }

    #[test]
    fn a_failed_shared_sync_refuses_every_commit_that_waited_for_it() {
        let dir = tempfile::tempdir().expect("dir");
        let mut syncer = Syncer::start(
            &dir.path().join("gone.db"),
            true,
            Duration::from_secs(60),
            0,
        )
        .expect("start");
        let seen = Arc::new(Mutex::new(Vec::new()));
        // More jobs queued: the two commits share the sync.
        syncer.after(true, &[1, 2], None, numbered(&seen, 1), true, None);
        syncer.after(true, &[2], None, numbered(&seen, 2), true, None);
        syncer.handed_over();
        assert!(seen.lock().expect("lock").is_empty());
        syncer.flush();
        syncer.handed_over();
        assert_eq!(*seen.lock().expect("lock"), vec![(1, false), (2, false)]);
    }

    #[test]
    fn without_fsync_nothing_waits() {
        let dir = tempfile::tempdir().expect("dir");
        // `synchronous: normal`: the delay does not apply, since there is no sync to share.
        let mut syncer = Syncer::start(
            &dir.path().join("gone.db"),
            false,
            Duration::from_secs(60),
            0,
        )
        .expect("start");
        let seen = Arc::new(Mutex::new(Vec::new()));
        syncer.after(true, &[1, 2], None, numbered(&seen, 1), false, None);
        syncer.handed_over();
        assert_eq!(*seen.lock().expect("lock"), vec![(1, true)]);
    }

    #[test]
    fn outbox_rows_count_as_synced_only_once_their_sync_is_over() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (_dir, mut syncer) = over_a_wal(Duration::from_secs(60));
        assert_eq!(syncer.outbox_synced(), 0);
        // Two senders: the commit with outbox rows up to 5 waits for the delay.
        syncer.after(true, &[7], None, numbered(&seen, 1), false, None);
        syncer.after(true, &[8], None, numbered(&seen, 2), false, Some(5));
        syncer.handed_over();
        assert_eq!(syncer.outbox_synced(), 0);
        // A later commit without outbox rows does not lower the watermark it waits for.
        syncer.after(true, &[7], None, numbered(&seen, 3), false, None);
        syncer.settle();
        assert_eq!(syncer.outbox_synced(), 5);
        syncer.after(true, &[8], None, numbered(&seen, 4), false, Some(9));
        syncer.handed_over();
        assert_eq!(syncer.outbox_synced(), 5, "row 9 waits for its sync");
        syncer.flush();
        syncer.handed_over();
        assert_eq!(syncer.outbox_synced(), 9);
        assert_eq!(
            *seen.lock().expect("lock"),
            vec![(1, true), (2, true), (3, true), (4, true)]
        );
    }
}
