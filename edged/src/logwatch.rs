//! Wake-on-change for followed logs: one inotify instance for the process, one watch per
//! directory a follower looks at (a pod's `logs/`, its pid files' directory), shared by every
//! follower of a file in it, so N followers of one container cost one watch and one wake.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt as _;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// Requests the owner may hold; a follower waits for room when starting.
const COMMANDS: usize = 64;
/// How often the owner drops the watches of followers whose hint of leaving was not queued.
const SWEEP: Duration = Duration::from_secs(1);
/// What a file's change is: written, closed by its writer, created, moved or removed.
const MASK: WatchMask = WatchMask::MODIFY
    .union(WatchMask::CLOSE_WRITE)
    .union(WatchMask::CREATE)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::DELETE)
    .union(WatchMask::DELETE_SELF)
    .union(WatchMask::MOVE_SELF);

/// What the owner holds, for tests and the docs' memory figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// inotify watches held (directories).
    pub watches: usize,
    /// Subscriptions to a file's changes still held by a follower.
    pub subscriptions: usize,
}

enum Command {
    Subscribe {
        file: PathBuf,
        reply: oneshot::Sender<Option<watch::Receiver<()>>>,
    },
    /// A follower went: its subscriptions may be the last of a watch.
    Left,
}

/// The handle followers share; the watches belong to one task ([`LogWatcher::start`]).
#[derive(Clone)]
pub struct LogWatcher {
    tx: mpsc::Sender<Command>,
    stats: watch::Receiver<Stats>,
}

impl LogWatcher {
    /// Starts the owner of the watches; it ends with `cancel` (followers then re-check on a
    /// timer until they end).
    pub fn start(cancel: CancellationToken) -> LogWatcher {
        let (tx, rx) = mpsc::channel(COMMANDS);
        let (stats_tx, stats) = watch::channel(Stats::default());
        tokio::spawn(run(rx, stats_tx, cancel));
        LogWatcher { tx, stats }
    }

    /// Wakes for changes to each of `files` (a missing file is fine: its directory is watched).
    pub async fn subscribe(&self, files: &[&Path]) -> Wake {
        let mut changes = Vec::with_capacity(files.len());
        let mut watched = true;
        for file in files {
            let (reply, answer) = oneshot::channel();
            let sent = self
                .tx
                .send(Command::Subscribe {
                    file: file.to_path_buf(),
                    reply,
                })
                .await;
            match (sent, answer.await) {
                (Ok(()), Ok(Some(rx))) => changes.push(rx),
                _ => watched = false,
            }
        }
        Wake {
            changes,
            watched,
            left: self.tx.clone(),
        }
    }

    pub fn stats(&self) -> Stats {
        *self.stats.borrow()
    }
}

/// A follower's wake-ups; dropping it releases its subscriptions.
pub struct Wake {
    changes: Vec<watch::Receiver<()>>,
    /// Every file asked for is watched (else the caller re-checks more often).
    watched: bool,
    left: mpsc::Sender<Command>,
}

impl Wake {
    pub fn watched(&self) -> bool {
        self.watched
    }

    /// Returns when a subscribed file changed since the last return, or after `at_most`.
    pub async fn changed(&mut self, at_most: Duration) {
        if self.changes.is_empty() {
            tokio::time::sleep(at_most).await;
            return;
        }
        let any = futures_util::future::select_all(
            self.changes.iter_mut().map(|rx| Box::pin(rx.changed())),
        );
        let owner_gone = matches!(tokio::time::timeout(at_most, any).await, Ok((Err(_), ..)));
        if owner_gone {
            // The owner stopped: from now on only the timer wakes this follower.
            self.changes.clear();
            self.watched = false;
        }
    }
}

impl Drop for Wake {
    fn drop(&mut self) {
        self.changes.clear();
        // A hint only: when the queue is full, the owner's sweep finds the subscription gone.
        let _ = self.left.try_send(Command::Left);
    }
}

/// A watched directory: the files in it someone follows.
struct Dir {
    paths: Vec<PathBuf>,
    files: HashMap<OsString, watch::Sender<()>>,
}

/// The owner of the inotify instance and of every watch.
struct Owner {
    watches: Option<Watches>,
    dirs: HashMap<WatchDescriptor, Dir>,
    by_path: HashMap<PathBuf, WatchDescriptor>,
    stats: watch::Sender<Stats>,
    warned: bool,
}

async fn run(
    mut commands: mpsc::Receiver<Command>,
    stats: watch::Sender<Stats>,
    cancel: CancellationToken,
) {
    let mut events = match Inotify::init().and_then(|i| i.into_event_stream(vec![0u8; 4096])) {
        Ok(events) => Some(events),
        Err(e) => {
            warn!(error_code = "EM-EDGED-LOGWATCH", error = %e, "no inotify: followed logs are re-checked on a timer");
            None
        }
    };
    let mut owner = Owner {
        watches: events.as_ref().map(|e| e.watches()),
        dirs: HashMap::new(),
        by_path: HashMap::new(),
        stats,
        warned: false,
    };
    let mut sweep = tokio::time::interval(SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            command = commands.recv() => match command {
                None => break,
                Some(Command::Subscribe { file, reply }) => {
                    let _ = reply.send(owner.subscribe(&file));
                    owner.sweep();
                }
                Some(Command::Left) => owner.sweep(),
            },
            event = async { events.as_mut()?.next().await }, if events.is_some() => match event {
                Some(Ok(event)) => owner.event(&event.wd, event.mask, event.name.as_deref()),
                Some(Err(e)) => {
                    warn!(error_code = "EM-EDGED-LOGWATCH", error = %e, "inotify failed: followed logs are re-checked on a timer");
                    owner.stop();
                    events = None;
                }
                None => {
                    owner.stop();
                    events = None;
                }
            },
            _ = sweep.tick() => owner.sweep(),
        }
    }
    owner.stop();
}

impl Owner {
    /// The file's change notifications, or `None` when its directory cannot be watched.
    fn subscribe(&mut self, file: &Path) -> Option<watch::Receiver<()>> {
        let (dir, name) = (file.parent()?, file.file_name()?);
        let wd = match self.by_path.get(dir) {
            Some(wd) => wd.clone(),
            None => {
                let added = self.watches.as_mut()?.add(dir, MASK);
                let wd = match added {
                    Ok(wd) => wd,
                    Err(e) => {
                        // Out of watches (`fs.inotify.max_user_watches`) or no such directory.
                        if !self.warned {
                            warn!(error_code = "EM-EDGED-LOGWATCH", path = %dir.display(), error = %e, "cannot watch a log directory: its followers re-check on a timer");
                            self.warned = true;
                        }
                        return None;
                    }
                };
                // The same directory by another path gets the same descriptor.
                self.dirs
                    .entry(wd.clone())
                    .or_insert_with(|| Dir {
                        paths: Vec::new(),
                        files: HashMap::new(),
                    })
                    .paths
                    .push(dir.to_path_buf());
                self.by_path.insert(dir.to_path_buf(), wd.clone());
                wd
            }
        };
        let entry = self.dirs.get_mut(&wd)?;
        let sender = entry
            .files
            .entry(name.to_os_string())
            .or_insert_with(|| watch::Sender::new(()));
        Some(sender.subscribe())
    }

    fn event(&mut self, wd: &WatchDescriptor, mask: EventMask, name: Option<&std::ffi::OsStr>) {
        if mask.contains(EventMask::Q_OVERFLOW) {
            // Events were lost: every follower looks.
            for dir in self.dirs.values() {
                wake_all(dir);
            }
            return;
        }
        if mask.contains(EventMask::IGNORED) {
            // The directory went (or was unwatched): its followers look, then re-check on a timer.
            if let Some(dir) = self.dirs.remove(wd) {
                wake_all(&dir);
                for path in &dir.paths {
                    self.by_path.remove(path);
                }
            }
            self.publish();
            return;
        }
        let Some(dir) = self.dirs.get(wd) else {
            return;
        };
        match name {
            Some(name) => {
                if let Some(file) = dir.files.get(name) {
                    file.send_modify(|_| ());
                }
            }
            None => wake_all(dir),
        }
    }

    /// Drops the subscriptions no follower holds, and the watches left with none.
    fn sweep(&mut self) {
        let mut emptied = Vec::new();
        for (wd, dir) in &mut self.dirs {
            dir.files.retain(|_, file| file.receiver_count() > 0);
            if dir.files.is_empty() {
                emptied.push(wd.clone());
            }
        }
        for wd in emptied {
            if let Some(dir) = self.dirs.remove(&wd) {
                for path in &dir.paths {
                    self.by_path.remove(path);
                }
            }
            if let Some(watches) = self.watches.as_mut() {
                // Fails only when the kernel already dropped it (the directory went).
                let _ = watches.remove(wd);
            }
        }
        self.publish();
    }

    /// No more events: every follower is woken and falls back to its timer.
    fn stop(&mut self) {
        for dir in self.dirs.values() {
            wake_all(dir);
        }
        self.dirs.clear();
        self.by_path.clear();
        self.watches = None;
        self.publish();
    }

    fn publish(&self) {
        let now = Stats {
            watches: self.dirs.len(),
            subscriptions: self
                .dirs
                .values()
                .flat_map(|d| d.files.values())
                .map(watch::Sender::receiver_count)
                .sum(),
        };
        self.stats.send_if_modified(|s| {
            let changed = *s != now;
            *s = now;
            changed
        });
    }
}

fn wake_all(dir: &Dir) {
    for file in dir.files.values() {
        file.send_modify(|_| ());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    async fn until(watcher: &LogWatcher, want: Stats) {
        let mut stats = watcher.stats.clone();
        tokio::time::timeout(Duration::from_secs(5), stats.wait_for(|s| *s == want))
            .await
            .unwrap_or_else(|_| panic!("stats never {want:?}: {:?}", watcher.stats()))
            .expect("owner running");
    }

    #[tokio::test]
    async fn followers_of_one_file_share_one_watch_released_by_the_last() {
        let dir = tempfile::tempdir().expect("dir");
        let log = dir.path().join("c.log");
        let other = dir.path().join("d.log");
        std::fs::write(&log, "").expect("log");
        let cancel = CancellationToken::new();
        let watcher = LogWatcher::start(cancel.clone());
        let mut followers = Vec::new();
        for _ in 0..5 {
            followers.push(watcher.subscribe(&[&log]).await);
        }
        let mut bystander = watcher.subscribe(&[&other]).await;
        assert!(followers.iter().all(Wake::watched));
        until(
            &watcher,
            Stats {
                watches: 1,
                subscriptions: 6,
            },
        )
        .await;

        // A write wakes every follower of the file, and not the follower of another file.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&log)
            .and_then(|mut f| f.write_all(b"x\n"))
            .expect("write");
        let forever = Duration::from_secs(3600);
        for follower in &mut followers {
            tokio::time::timeout(Duration::from_secs(5), follower.changed(forever))
                .await
                .expect("woken by the write");
        }
        assert!(
            tokio::time::timeout(Duration::from_millis(200), bystander.changed(forever))
                .await
                .is_err(),
            "a follower of another file was woken"
        );

        followers.truncate(1);
        until(
            &watcher,
            Stats {
                watches: 1,
                subscriptions: 2,
            },
        )
        .await;
        drop(followers);
        drop(bystander);
        until(&watcher, Stats::default()).await;
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_directory_that_cannot_be_watched_leaves_its_follower_on_the_timer() {
        let cancel = CancellationToken::new();
        let watcher = LogWatcher::start(cancel.clone());
        let mut wake = watcher
            .subscribe(&[Path::new("/no/such/directory/c.log")])
            .await;
        assert!(!wake.watched());
        tokio::time::timeout(
            Duration::from_secs(5),
            wake.changed(Duration::from_millis(10)),
        )
        .await
        .expect("the timer wakes it");
        cancel.cancel();
    }
}
