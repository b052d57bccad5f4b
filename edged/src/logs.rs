//! kubelet's `containerLogs`: a container's CRI-format log files (`runtime.rs` writes them)
//! read back with `follow`, `tailLines`, `sinceSeconds`/`sinceTime`, `timestamps`, `previous`
//! and `limitBytes`, as kubelet's `ReadLogs` does.

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::io::{AsyncBufReadExt as _, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::logwatch::{LogWatcher, Wake};

/// A followed log wakes on change (`logwatch.rs`); it is also looked at this often, for what
/// inotify does not report (a network filesystem, a file replaced behind its directory's back).
const RECHECK: Duration = Duration::from_secs(1);
/// How often a followed log is looked at when its directory cannot be watched.
const UNWATCHED_POLL: Duration = Duration::from_millis(100);
/// How long after the container exited its last lines may still arrive (`runtime::LOG_DRAIN`).
const EXIT_DRAIN: Duration = Duration::from_millis(300);
/// Output is handed to the response in chunks of about this size.
const CHUNK: usize = 32 * 1024;
/// A line read back longer than this is cut (records written here are at most 16 KiB).
const MAX_LINE: usize = 64 * 1024;

/// A log query's options (kubelet's `PodLogOptions`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogOptions {
    pub follow: bool,
    pub tail: Option<usize>,
    /// Records older than this (a [`timestamp`]) are skipped.
    pub since: Option<String>,
    pub timestamps: bool,
    pub previous: bool,
    pub limit_bytes: Option<u64>,
}

impl LogOptions {
    /// Parses the query string's parameters; `Err` is the 400 message.
    pub fn parse(query: &HashMap<String, String>, now: SystemTime) -> Result<LogOptions, String> {
        let flag = |name: &str| -> Result<bool, String> {
            match query.get(name).map(String::as_str) {
                None | Some("" | "false" | "0") => Ok(false),
                Some("true" | "1") => Ok(true),
                Some(other) => Err(format!("{name}: {other:?} is not a boolean")),
            }
        };
        let number = |name: &str| -> Result<Option<i64>, String> {
            query
                .get(name)
                .map(|v| {
                    v.parse::<i64>()
                        .map_err(|_| format!("{name}: {v:?} is not an integer"))
                })
                .transpose()
        };
        let tail = match number("tailLines")? {
            Some(n) if n < 0 => None,
            Some(n) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            None => None,
        };
        let limit_bytes = match number("limitBytes")? {
            Some(n) if n <= 0 => return Err("limitBytes: must be greater than 0".to_owned()),
            Some(n) => Some(n.unsigned_abs()),
            None => None,
        };
        let since = match (number("sinceSeconds")?, query.get("sinceTime")) {
            (Some(_), Some(_)) => {
                return Err("at most one of sinceSeconds or sinceTime may be specified".to_owned())
            }
            (Some(s), None) if s <= 0 => {
                return Err("sinceSeconds: must be greater than 0".to_owned())
            }
            (Some(s), None) => Some(timestamp(
                now.checked_sub(Duration::from_secs(s.unsigned_abs()))
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            )),
            (None, Some(t)) => {
                let at = OffsetDateTime::parse(t, &Rfc3339)
                    .map_err(|e| format!("sinceTime: {t:?}: {e}"))?;
                Some(timestamp(at.into()))
            }
            (None, None) => None,
        };
        Ok(LogOptions {
            follow: flag("follow")?,
            tail,
            since,
            timestamps: flag("timestamps")?,
            previous: flag("previous")?,
            limit_bytes,
        })
    }
}

/// `t` in UTC with nine fraction digits (Go's `RFC3339NanoFixed`, kubelet's log timestamps):
/// fixed width, so timestamps compare as strings.
pub fn timestamp(t: SystemTime) -> String {
    let t = OffsetDateTime::from(t);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:09}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond()
    )
}

/// A log file's records: `<time> <stream> <F|P> <text>`.
struct Record<'a> {
    time: &'a [u8],
    full: bool,
    text: &'a [u8],
}

fn parse(line: &[u8]) -> Option<Record<'_>> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let mut parts = line.splitn(4, |b| *b == b' ');
    let time = parts.next()?;
    let _stream = parts.next()?;
    let tag = parts.next()?;
    let text = parts.next().unwrap_or_default();
    Some(Record {
        time,
        full: tag != b"P",
        text,
    })
}

/// The files of a container's run, oldest first: `<log>.N` … `<log>.1`, `<log>`; the
/// previous run's are under `previous/`.
pub fn run_files(log: &Path, previous: bool) -> Vec<PathBuf> {
    let (Some(dir), Some(name)) = (log.parent(), log.file_name().and_then(|n| n.to_str())) else {
        return Vec::new();
    };
    let dir = if previous {
        dir.join("previous")
    } else {
        dir.to_path_buf()
    };
    let mut rotated: Vec<(u32, PathBuf)> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let file = e.file_name();
            let n = file.to_str()?.strip_prefix(name)?.strip_prefix('.')?;
            Some((n.parse().ok()?, e.path()))
        })
        .collect();
    rotated.sort_by_key(|r| std::cmp::Reverse(r.0));
    let mut files: Vec<PathBuf> = rotated.into_iter().map(|(_, p)| p).collect();
    let current = dir.join(name);
    if current.exists() {
        files.push(current);
    }
    files
}

/// Formats records into the response, applying `since`, `timestamps` and `limitBytes`.
struct Emitter {
    options: LogOptions,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
    out: Vec<u8>,
    sent: u64,
    /// `limitBytes` reached or the reader went away.
    done: bool,
}

impl Emitter {
    fn push(&mut self, record: &Record<'_>) {
        if self.done {
            return;
        }
        if let Some(since) = &self.options.since {
            if record.time < since.as_bytes() {
                return;
            }
        }
        let start = self.out.len();
        if self.options.timestamps {
            self.out.extend_from_slice(record.time);
            self.out.push(b' ');
        }
        self.out.extend_from_slice(record.text);
        if record.full {
            self.out.push(b'\n');
        }
        if let Some(limit) = self.options.limit_bytes {
            let room = limit.saturating_sub(self.sent + start as u64);
            let added = (self.out.len() - start) as u64;
            if added >= room {
                self.out
                    .truncate(start + usize::try_from(room).unwrap_or(usize::MAX));
                self.done = true;
            }
        }
    }

    async fn flush(&mut self) {
        if self.out.is_empty() {
            return;
        }
        let chunk = Bytes::from(std::mem::take(&mut self.out));
        self.sent += chunk.len() as u64;
        if self.tx.send(Ok(chunk)).await.is_err() {
            self.done = true;
        }
    }

    async fn flush_if_full(&mut self) {
        if self.out.len() >= CHUNK {
            self.flush().await;
        }
    }
}

/// Reads lines of at most [`MAX_LINE`] bytes; `Ok(false)` at the end (a last line without
/// `\n` stays in `line`: it may still be being written).
async fn next_line(
    reader: &mut BufReader<impl AsyncRead + Unpin>,
    line: &mut Vec<u8>,
) -> std::io::Result<bool> {
    let before = line.len();
    let n = reader.read_until(b'\n', line).await?;
    if line.len() > MAX_LINE {
        line.truncate(MAX_LINE);
        line.push(b'\n');
    }
    Ok(n > 0 && line.len() > before && line.ends_with(b"\n"))
}

/// What a follower watches to know when the container's run ended.
pub struct RunWatch {
    /// Present while the container's process runs.
    pub pid_file: PathBuf,
    /// Whether the pod is still on the node.
    pub pod_alive: Box<dyn Fn() -> bool + Send>,
    /// Wakes the follower when the log or the pid file changes.
    pub watcher: LogWatcher,
    /// Ends the follow when edged stops.
    pub cancel: CancellationToken,
}

/// Streams the log at `log` per `options` into `tx` until done, the reader goes, or (when
/// following) the container's run ends.
pub async fn stream(
    log: PathBuf,
    options: LogOptions,
    watch: RunWatch,
    tx: mpsc::Sender<Result<Bytes, std::io::Error>>,
) {
    let follow = options.follow && !options.previous;
    let tail = options.tail;
    let mut emit = Emitter {
        options,
        tx,
        out: Vec::new(),
        sent: 0,
        done: false,
    };
    let previous = emit.options.previous;
    // Subscribed before the first read, so a line written meanwhile wakes the follower.
    let wake = if follow {
        Some(watch.watcher.subscribe(&[&log, &watch.pid_file]).await)
    } else {
        None
    };
    // The live file is opened first, so a rotation while the older files are read does not
    // lose it.
    let current = if previous {
        None
    } else {
        tokio::fs::File::open(&log).await.ok()
    };
    let current_ino = match &current {
        Some(f) => f.metadata().await.map(|m| m.ino()).ok(),
        None => None,
    };
    let mut kept: VecDeque<Vec<u8>> = VecDeque::new();
    let mut line = Vec::new();
    let files = run_files(&log, previous);
    for path in &files {
        if emit.done {
            emit.flush().await;
            return;
        }
        let Ok(file) = tokio::fs::File::open(path).await else {
            continue;
        };
        if !previous && file.metadata().await.map(|m| m.ino()).ok() == current_ino {
            // The live file: read below, and then followed.
            continue;
        }
        let mut reader = BufReader::with_capacity(CHUNK, file);
        loop {
            line.clear();
            match next_line(&mut reader, &mut line).await {
                Ok(true) => {}
                _ => break,
            }
            take(&line, tail, &mut kept, &mut emit).await;
            if emit.done {
                break;
            }
        }
    }
    let Some(current) = current else {
        drain_kept(&mut kept, &mut emit).await;
        emit.flush().await;
        return;
    };
    let mut reader = BufReader::with_capacity(CHUNK, current);
    line.clear();
    // Up to the end of what is written now: subject to `tailLines`.
    while !emit.done {
        match next_line(&mut reader, &mut line).await {
            Ok(true) => {
                take(&line, tail, &mut kept, &mut emit).await;
                line.clear();
            }
            _ => break,
        }
    }
    drain_kept(&mut kept, &mut emit).await;
    emit.flush().await;
    let Some(wake) = wake else {
        return;
    };
    follow_file(log, reader, current_ino, emit, (watch, wake), line).await;
}

/// Follows the live file past its end until the run ends, moving to the new file on rotation
/// (a new run moves the file to `previous/`: the followed run has ended).
async fn follow_file(
    log: PathBuf,
    mut reader: BufReader<tokio::fs::File>,
    mut ino: Option<u64>,
    mut emit: Emitter,
    (watch, mut wake): (RunWatch, Wake),
    mut line: Vec<u8>,
) {
    let recheck = if wake.watched() {
        RECHECK
    } else {
        UNWATCHED_POLL
    };
    let mut exited_at: Option<tokio::time::Instant> = None;
    loop {
        if emit.done {
            return;
        }
        match next_line(&mut reader, &mut line).await {
            Ok(true) => {
                if let Some(record) = parse(&line) {
                    emit.push(&record);
                }
                line.clear();
                emit.flush_if_full().await;
                continue;
            }
            Ok(false) => {}
            Err(_) => return,
        }
        emit.flush().await;
        if emit.tx.is_closed() {
            return;
        }
        let now_ino = tokio::fs::metadata(&log).await.map(|m| m.ino()).ok();
        if now_ino.is_some() && now_ino != ino {
            let rotated = format!("{}.1", log.display());
            if tokio::fs::metadata(&rotated).await.map(|m| m.ino()).ok() == ino {
                let Ok(file) = tokio::fs::File::open(&log).await else {
                    return;
                };
                // Rotation: the rest of the old file was read; go on with the new one.
                ino = file.metadata().await.map(|m| m.ino()).ok();
                reader = BufReader::with_capacity(CHUNK, file);
                line.clear();
                continue;
            }
            return;
        }
        if !(watch.pod_alive)() {
            return;
        }
        let mut wait = recheck;
        if tokio::fs::metadata(&watch.pid_file).await.is_err() {
            let at = *exited_at.get_or_insert_with(tokio::time::Instant::now);
            if at.elapsed() >= EXIT_DRAIN {
                return;
            }
            wait = EXIT_DRAIN.saturating_sub(at.elapsed());
        }
        tokio::select! {
            _ = watch.cancel.cancelled() => return,
            _ = emit.tx.closed() => return,
            _ = wake.changed(wait) => {}
        }
    }
}

/// One record of the initial read: kept for `tailLines`, or emitted at once.
async fn take(line: &[u8], tail: Option<usize>, kept: &mut VecDeque<Vec<u8>>, emit: &mut Emitter) {
    match tail {
        Some(0) => {}
        Some(n) => {
            if kept.len() == n {
                kept.pop_front();
            }
            kept.push_back(line.to_vec());
        }
        None => {
            if let Some(record) = parse(line) {
                emit.push(&record);
            }
            emit.flush_if_full().await;
        }
    }
}

async fn drain_kept(kept: &mut VecDeque<Vec<u8>>, emit: &mut Emitter) {
    while let Some(line) = kept.pop_front() {
        if let Some(record) = parse(&line) {
            emit.push(&record);
        }
        emit.flush_if_full().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn options_parse_as_kubelet_reads_them() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let o = LogOptions::parse(
            &query(&[
                ("follow", "true"),
                ("tailLines", "5"),
                ("sinceSeconds", "10"),
                ("timestamps", "true"),
                ("limitBytes", "100"),
            ]),
            now,
        )
        .expect("valid");
        assert!(o.follow && o.timestamps && !o.previous);
        assert_eq!(o.tail, Some(5));
        assert_eq!(o.limit_bytes, Some(100));
        assert_eq!(o.since.as_deref(), Some("1970-01-12T13:46:30.000000000Z"));
        let t = LogOptions::parse(&query(&[("sinceTime", "1970-01-12T13:46:30Z")]), now)
            .expect("valid");
        assert_eq!(t.since, o.since);
        assert!(LogOptions::parse(&query(&[("follow", "yes")]), now).is_err());
        assert!(LogOptions::parse(&query(&[("limitBytes", "0")]), now).is_err());
        assert!(LogOptions::parse(
            &query(&[("sinceSeconds", "1"), ("sinceTime", "1970-01-01T00:00:00Z")]),
            now
        )
        .is_err());
    }

    fn write_log(path: &Path, lines: &[(&str, &str)]) {
        let text: String = lines
            .iter()
            .map(|(t, l)| format!("{t} stdout F {l}\n"))
            .collect();
        std::fs::write(path, text).expect("log");
    }

    async fn read_all(log: &Path, options: LogOptions) -> String {
        let (tx, mut rx) = mpsc::channel(4);
        let watch = RunWatch {
            pid_file: log.with_extension("pid"),
            pod_alive: Box::new(|| true),
            watcher: LogWatcher::start(CancellationToken::new()),
            cancel: CancellationToken::new(),
        };
        tokio::spawn(stream(log.to_path_buf(), options, watch, tx));
        let mut out = Vec::new();
        while let Some(Ok(chunk)) = rx.recv().await {
            out.extend_from_slice(&chunk);
        }
        String::from_utf8(out).expect("utf-8")
    }

    #[tokio::test]
    async fn rotated_files_come_first_and_tail_since_timestamps_and_limit_apply() {
        let dir = tempfile::tempdir().expect("dir");
        let log = dir.path().join("c.log");
        write_log(
            &dir.path().join("c.log.1"),
            &[
                ("2026-01-01T00:00:01.000000000Z", "one"),
                ("2026-01-01T00:00:02.000000000Z", "two"),
            ],
        );
        write_log(
            &log,
            &[
                ("2026-01-01T00:00:03.000000000Z", "three"),
                ("2026-01-01T00:00:04.000000000Z", "four"),
            ],
        );
        let all = read_all(&log, LogOptions::default()).await;
        assert_eq!(all, "one\ntwo\nthree\nfour\n");
        let tail = LogOptions {
            tail: Some(3),
            ..LogOptions::default()
        };
        assert_eq!(read_all(&log, tail).await, "two\nthree\nfour\n");
        let since = LogOptions {
            since: Some("2026-01-01T00:00:03.000000000Z".to_owned()),
            timestamps: true,
            ..LogOptions::default()
        };
        assert_eq!(
            read_all(&log, since).await,
            "2026-01-01T00:00:03.000000000Z three\n2026-01-01T00:00:04.000000000Z four\n"
        );
        let limit = LogOptions {
            limit_bytes: Some(6),
            ..LogOptions::default()
        };
        assert_eq!(read_all(&log, limit).await, "one\ntw");
    }

    #[tokio::test]
    async fn previous_reads_the_last_run_only() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::create_dir(dir.path().join("previous")).expect("dir");
        let log = dir.path().join("c.log");
        write_log(&log, &[("2026-01-01T00:00:03.000000000Z", "now")]);
        write_log(
            &dir.path().join("previous/c.log"),
            &[("2026-01-01T00:00:01.000000000Z", "before")],
        );
        let previous = LogOptions {
            previous: true,
            ..LogOptions::default()
        };
        assert_eq!(read_all(&log, previous).await, "before\n");
    }

    fn append(path: &Path, text: &str) {
        use std::io::Write as _;
        std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .and_then(|mut f| {
                f.write_all(format!("2026-01-01T00:00:09.000000000Z stdout F {text}\n").as_bytes())
            })
            .expect("append");
    }

    /// A follow of `log` (pid file `<dir>/c.pid`) with its own watcher.
    fn follow(
        log: &Path,
    ) -> (
        LogWatcher,
        mpsc::Receiver<Result<Bytes, std::io::Error>>,
        tokio::task::JoinHandle<()>,
    ) {
        let watcher = LogWatcher::start(CancellationToken::new());
        let (tx, rx) = mpsc::channel(4);
        let watch = RunWatch {
            pid_file: log.parent().expect("dir").join("c.pid"),
            pod_alive: Box::new(|| true),
            watcher: watcher.clone(),
            cancel: CancellationToken::new(),
        };
        let options = LogOptions {
            follow: true,
            ..LogOptions::default()
        };
        let task = tokio::spawn(stream(log.to_path_buf(), options, watch, tx));
        (watcher, rx, task)
    }

    async fn next(rx: &mut mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Option<String> {
        let chunk = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the follower answers within 5 s")?;
        Some(String::from_utf8(chunk.expect("chunk").to_vec()).expect("utf-8"))
    }

    async fn ends(task: tokio::task::JoinHandle<()>, watcher: &LogWatcher) {
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .expect("the follower ends")
            .expect("no panic");
        let gone = async {
            while watcher.stats() != crate::logwatch::Stats::default() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .unwrap_or_else(|_| panic!("watches left behind: {:?}", watcher.stats()));
    }

    #[tokio::test]
    async fn a_follower_sees_new_lines_across_a_rotation_and_ends_when_the_run_moves_to_previous() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::create_dir(dir.path().join("logs")).expect("dir");
        std::fs::write(dir.path().join("c.pid"), "1 1\n").expect("pid");
        let log = dir.path().join("logs/c.log");
        append(&log, "one");
        let (watcher, mut rx, task) = follow(&log);
        assert_eq!(next(&mut rx).await.as_deref(), Some("one\n"));
        append(&log, "two");
        assert_eq!(next(&mut rx).await.as_deref(), Some("two\n"));
        // Rotation, as the runtime does it: the file becomes `.1`, a new one takes its name.
        std::fs::rename(&log, dir.path().join("logs/c.log.1")).expect("rotate");
        append(&log, "three");
        assert_eq!(next(&mut rx).await.as_deref(), Some("three\n"));
        // A new run: this run's file moves to `previous/`, and the follow ends.
        std::fs::create_dir(dir.path().join("logs/previous")).expect("dir");
        std::fs::rename(&log, dir.path().join("logs/previous/c.log")).expect("previous");
        append(&log, "next run");
        assert_eq!(next(&mut rx).await, None);
        ends(task, &watcher).await;
    }

    #[tokio::test]
    async fn a_follower_ends_with_the_process_and_when_its_client_goes() {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::create_dir(dir.path().join("logs")).expect("dir");
        let pid = dir.path().join("c.pid");
        std::fs::write(&pid, "1 1\n").expect("pid");
        let log = dir.path().join("logs/c.log");
        append(&log, "one");

        // The process exits: what it wrote last still comes, then the follow ends.
        let (watcher, mut rx, task) = follow(&log);
        assert_eq!(next(&mut rx).await.as_deref(), Some("one\n"));
        std::fs::remove_file(&pid).expect("exit");
        append(&log, "last words");
        assert_eq!(next(&mut rx).await.as_deref(), Some("last words\n"));
        assert_eq!(next(&mut rx).await, None);
        ends(task, &watcher).await;

        // A client that goes while nothing is written: its follower and watch go too.
        std::fs::write(&pid, "1 1\n").expect("pid");
        let (watcher, mut rx, task) = follow(&log);
        assert_eq!(next(&mut rx).await.as_deref(), Some("one\nlast words\n"));
        assert_ne!(watcher.stats(), crate::logwatch::Stats::default());
        drop(rx);
        ends(task, &watcher).await;
    }

    #[test]
    fn timestamps_have_nine_fraction_digits() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(86_400 + 5, 120);
        assert_eq!(timestamp(t), "1970-01-02T00:00:05.000000120Z");
    }
}
