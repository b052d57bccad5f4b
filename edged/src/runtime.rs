//! The container runtime behind a small trait, and its one implementation here: each container
//! is a local process in its own process group, its stdout and stderr in a size-rotated log.
//! A CRI runtime would implement [`Runtime`] and [`Container`] the same way.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};
use tracing::warn;

use crate::plan::ContainerPlan;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How long `wait` lets the log writer drain the pipes after the process exited (a grandchild
/// may hold them open).
const LOG_DRAIN: Duration = Duration::from_millis(200);

/// Starts containers.
pub trait Runtime: Send + Sync + 'static {
    /// Starts `plan`'s process; `Err` is why it cannot run (kubelet's `ContainerCannotRun`).
    fn start(&self, plan: &ContainerPlan) -> Result<Box<dyn Container>, CannotRun>;
}

/// A started container.
pub trait Container: Send {
    /// `process://<pid>`.
    fn id(&self) -> String;
    /// Resolves when the container has exited.
    fn wait(&mut self) -> BoxFuture<'_, Exit>;
    /// Asks it to stop (SIGTERM to the whole process group).
    fn terminate(&mut self) -> BoxFuture<'_, ()>;
    /// Stops it now (SIGKILL to the whole process group).
    fn kill(&mut self) -> BoxFuture<'_, ()>;
}

/// How a container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// The exit code, or 128 + the signal number (as container runtimes report it).
    pub code: i32,
    pub signal: Option<i32>,
}

/// Why a container could not be started, with the exit code Docker reports for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CannotRun {
    pub code: i32,
    pub message: String,
}

/// Containers as local processes.
#[derive(Debug, Clone)]
pub struct ProcessRuntime {
    log_max_bytes: u64,
    log_max_files: u32,
}

impl ProcessRuntime {
    /// Each container's log is rotated at `log_max_bytes`, keeping `log_max_files` rotated files.
    pub fn new(log_max_bytes: u64, log_max_files: u32) -> ProcessRuntime {
        ProcessRuntime {
            log_max_bytes: log_max_bytes.max(1024),
            log_max_files,
        }
    }

    /// Kills process groups a previous run of the agent left behind (`kill -9` of the agent
    /// leaves its containers running): every `*.pid` file under `pods_dir` whose process still
    /// has the recorded start time. Blocking; call it from `spawn_blocking`.
    pub fn kill_leftovers(pods_dir: &Path) -> usize {
        let Ok(pods) = std::fs::read_dir(pods_dir) else {
            return 0;
        };
        let mut killed = 0;
        for pod in pods.flatten() {
            let Ok(files) = std::fs::read_dir(pod.path()) else {
                continue;
            };
            for file in files.flatten() {
                let path = file.path();
                if path.extension().and_then(|e| e.to_str()) != Some("pid") {
                    continue;
                }
                let recorded = std::fs::read_to_string(&path).unwrap_or_default();
                let mut parts = recorded.split_whitespace();
                let (Some(Ok(pid)), Some(started)) =
                    (parts.next().map(str::parse::<u32>), parts.next())
                else {
                    let _ = std::fs::remove_file(&path);
                    continue;
                };
                if start_time(pid).as_deref() == Some(started) {
                    signal_group(pid, "KILL");
                    killed += 1;
                }
                let _ = std::fs::remove_file(&path);
            }
        }
        killed
    }
}

impl Runtime for ProcessRuntime {
    fn start(&self, plan: &ContainerPlan) -> Result<Box<dyn Container>, CannotRun> {
        let Some((program, args)) = plan.argv.split_first() else {
            return Err(CannotRun {
                code: 128,
                message: "no command: this runtime runs processes, not images".to_owned(),
            });
        };
        if let Err(e) = std::fs::create_dir_all(&plan.working_dir) {
            return Err(CannotRun {
                code: 128,
                message: format!("working directory {}: {e}", plan.working_dir.display()),
            });
        }
        keep_previous_run(&plan.log_path, self.log_max_files);
        let mut command = Command::new(program);
        command
            .args(args)
            .env_clear()
            .envs(plan.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&plan.working_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(false);
        let mut child = command.spawn().map_err(|e| CannotRun {
            code: match e.kind() {
                std::io::ErrorKind::NotFound => 127,
                std::io::ErrorKind::PermissionDenied => 126,
                _ => 128,
            },
            message: format!("starting {program:?}: {e}"),
        })?;
        let pid = child.id().unwrap_or_default();
        if let Some(started) = start_time(pid) {
            if let Err(e) = std::fs::write(&plan.pid_path, format!("{pid} {started}\n")) {
                warn!(error_code = "EM-EDGED-IO", path = %plan.pid_path.display(), error = %e, "cannot record the pid");
            }
        }
        let log = LogFile {
            path: plan.log_path.clone(),
            max_bytes: self.log_max_bytes,
            max_files: self.log_max_files,
        };
        let logger = tokio::spawn(log.copy(child.stdout.take(), child.stderr.take()));
        Ok(Box::new(Process {
            child,
            pid,
            pid_path: plan.pid_path.clone(),
            logger: Some(logger),
        }))
    }
}

struct Process {
    child: Child,
    pid: u32,
    pid_path: PathBuf,
    logger: Option<tokio::task::JoinHandle<()>>,
}

impl Container for Process {
    fn id(&self) -> String {
        format!("process://{}", self.pid)
    }

    fn wait(&mut self) -> BoxFuture<'_, Exit> {
        Box::pin(async move {
            let exit = match self.child.wait().await {
                Ok(status) => {
                    use std::os::unix::process::ExitStatusExt as _;
                    match (status.code(), status.signal()) {
                        (Some(code), _) => Exit { code, signal: None },
                        (None, Some(sig)) => Exit {
                            code: 128 + sig,
                            signal: Some(sig),
                        },
                        (None, None) => Exit {
                            code: 255,
                            signal: None,
                        },
                    }
                }
                Err(_) => Exit {
                    code: 255,
                    signal: None,
                },
            };
            // The rest of the group (a shell's children) goes with it, as in a container.
            let pid = self.pid;
            let _ = tokio::task::spawn_blocking(move || signal_group(pid, "KILL")).await;
            let _ = std::fs::remove_file(&self.pid_path);
            if let Some(logger) = self.logger.take() {
                let _ = tokio::time::timeout(LOG_DRAIN, logger).await;
            }
            exit
        })
    }

    fn terminate(&mut self) -> BoxFuture<'_, ()> {
        let pid = self.pid;
        Box::pin(async move {
            let _ = tokio::task::spawn_blocking(move || signal_group(pid, "TERM")).await;
        })
    }

    fn kill(&mut self) -> BoxFuture<'_, ()> {
        let pid = self.pid;
        Box::pin(async move {
            let _ = tokio::task::spawn_blocking(move || signal_group(pid, "KILL")).await;
        })
    }
}

/// Sends SIGTERM/SIGKILL to process group `pgid` with the system's `kill` (the workspace
/// forbids `unsafe`, which `libc::kill` needs). A group that is gone is not an error.
fn signal_group(pgid: u32, signal: &str) {
    if pgid == 0 {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Field 22 of `/proc/<pid>/stat` (start time in clock ticks): tells a pid from its reuse.
fn start_time(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19).map(str::to_owned)
}

/// A container's log in the CRI format kubelet reads (`<RFC3339 time> <stdout|stderr> <F|P>
/// <text>`, one record a line), rotated at `max_bytes` into `<log>.1` … `<log>.<max_files>`.
struct LogFile {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
}

/// A line longer than this is written as partial records (`P`), as container runtimes do.
const MAX_RECORD_TEXT: usize = 16 * 1024;
/// An unfinished line is written as a partial record after the output paused this long.
const PARTIAL_AFTER: Duration = Duration::from_millis(100);

/// Which output a record came from.
#[derive(Clone, Copy)]
enum Output {
    Stdout,
    Stderr,
}

impl LogFile {
    async fn copy(
        self,
        stdout: Option<impl AsyncRead + Unpin>,
        stderr: Option<impl AsyncRead + Unpin>,
    ) {
        if let Some(dir) = self.path.parent() {
            let _ = tokio::fs::create_dir_all(dir).await;
        }
        let mut out = stdout;
        let mut err = stderr;
        let mut sink = LogSink {
            file: None,
            written: tokio::fs::metadata(&self.path)
                .await
                .map(|m| m.len())
                .unwrap_or(0),
            pending: Vec::new(),
            stamp: String::new(),
            log: &self,
        };
        let (mut out_buf, mut err_buf) = (vec![0u8; 8192], vec![0u8; 8192]);
        let (mut out_line, mut err_line) = (Vec::new(), Vec::new());
        while out.is_some() || err.is_some() {
            let pending = !out_line.is_empty() || !err_line.is_empty();
            let (output, chunk, line) = tokio::select! {
                // An unfinished line (a prompt, a file without its last newline) is written as
                // a partial record once the output paused, so readers see it now.
                () = tokio::time::sleep(PARTIAL_AFTER), if pending => {
                    sink.read_now();
                    sink.partial(Output::Stdout, &mut out_line).await;
                    sink.partial(Output::Stderr, &mut err_line).await;
                    sink.write().await;
                    continue;
                }
                n = read(&mut out, &mut out_buf), if out.is_some() => match n {
                    Some(n) => (Output::Stdout, &out_buf[..n], &mut out_line),
                    None => {
                        out = None;
                        sink.read_now();
                        sink.partial(Output::Stdout, &mut out_line).await;
                        sink.write().await;
                        continue;
                    }
                },
                n = read(&mut err, &mut err_buf), if err.is_some() => match n {
                    Some(n) => (Output::Stderr, &err_buf[..n], &mut err_line),
                    None => {
                        err = None;
                        sink.read_now();
                        sink.partial(Output::Stderr, &mut err_line).await;
                        sink.write().await;
                        continue;
                    }
                },
            };
            // The records of one read share its time and one write: a chatty container cost
            // a blocking-pool write per line.
            sink.read_now();
            let mut rest = chunk;
            while let Some(end) = rest.iter().position(|b| *b == b'\n') {
                line.extend_from_slice(&rest[..end]);
                sink.record(output, true, line).await;
                line.clear();
                rest = &rest[end + 1..];
            }
            line.extend_from_slice(rest);
            if line.len() >= MAX_RECORD_TEXT {
                sink.partial(output, line).await;
            }
            sink.write().await;
        }
        if let Some(mut f) = sink.file {
            let _ = f.flush().await;
        }
    }

    async fn rotate(&self) {
        if self.max_files == 0 {
            let _ = tokio::fs::remove_file(&self.path).await;
            return;
        }
        let numbered = |n: u32| PathBuf::from(format!("{}.{n}", self.path.display()));
        for n in (1..self.max_files).rev() {
            let _ = tokio::fs::rename(numbered(n), numbered(n + 1)).await;
        }
        let _ = tokio::fs::rename(&self.path, numbered(1)).await;
    }
}

/// Where records go: the open log file and its size.
struct LogSink<'a> {
    file: Option<tokio::fs::File>,
    /// The file's size once `pending` is written.
    written: u64,
    /// Records not written yet: those of one read, written together.
    pending: Vec<u8>,
    /// When the output being recorded was read, as records start with it.
    stamp: String,
    log: &'a LogFile,
}

impl LogSink<'_> {
    /// Writes what is left of an unfinished line as a partial record.
    async fn partial(&mut self, output: Output, line: &mut Vec<u8>) {
        if !line.is_empty() {
            self.record(output, false, line).await;
            line.clear();
        }
    }

    /// The records from here on carry this moment.
    fn read_now(&mut self) {
        self.stamp = crate::logs::timestamp(SystemTime::now());
    }

    /// Adds one record to those waiting for [`LogSink::write`]; a record is never split across
    /// files.
    async fn record(&mut self, output: Output, full: bool, text: &[u8]) {
        let stream = match output {
            Output::Stdout => "stdout",
            Output::Stderr => "stderr",
        };
        let tag = if full { "F" } else { "P" };
        let header = format!("{} {stream} {tag} ", self.stamp);
        let size = (header.len() + text.len() + 1) as u64;
        if self.written > 0 && self.written + size > self.log.max_bytes {
            self.write().await;
            self.file = None;
            self.log.rotate().await;
            self.written = 0;
        }
        self.pending.extend_from_slice(header.as_bytes());
        self.pending.extend_from_slice(text);
        self.pending.push(b'\n');
        self.written += size;
    }

    /// Writes the waiting records to the log file, opening it if needed.
    async fn write(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        if self.file.is_none() {
            self.file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log.path)
                .await
                .map_err(|e| {
                    warn!(error_code = "EM-EDGED-IO", path = %self.log.path.display(), error = %e, "cannot open the container log");
                })
                .ok();
        }
        if let Some(f) = self.file.as_mut() {
            if f.write_all(&self.pending).await.is_err() {
                self.file = None;
            }
        }
        self.pending.clear();
    }
}

/// Moves the log of a container's last run (`<log>` and its rotated files) to
/// `<logs>/previous/`, replacing the run before it: kubelet's `previous` reads it.
fn keep_previous_run(log: &Path, max_files: u32) {
    let Some(dir) = log.parent() else { return };
    let Some(name) = log.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    if !log.exists() {
        return;
    }
    let previous = dir.join("previous");
    if let Err(e) = std::fs::create_dir_all(&previous) {
        warn!(error_code = "EM-EDGED-IO", path = %previous.display(), error = %e, "cannot keep the previous run's log");
        return;
    }
    let _ = std::fs::remove_file(previous.join(name));
    for n in 1..=max_files {
        let _ = std::fs::remove_file(previous.join(format!("{name}.{n}")));
    }
    let _ = std::fs::rename(log, previous.join(name));
    for n in 1..=max_files {
        let _ = std::fs::rename(
            dir.join(format!("{name}.{n}")),
            previous.join(format!("{name}.{n}")),
        );
    }
}

/// Reads some bytes; `None` at end of stream or on an error.
async fn read(stream: &mut Option<impl AsyncRead + Unpin>, buf: &mut [u8]) -> Option<usize> {
    match stream.as_mut()?.read(buf).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(dir: &Path, argv: &[&str]) -> ContainerPlan {
        ContainerPlan {
            name: "c".to_owned(),
            argv: argv.iter().map(|s| (*s).to_owned()).collect(),
            env: vec![("PATH".to_owned(), "/usr/bin:/bin".to_owned())],
            working_dir: dir.to_path_buf(),
            log_path: dir.join("logs").join("c.log"),
            pid_path: dir.join("c.pid"),
            liveness: None,
            readiness: None,
        }
    }

    #[tokio::test]
    async fn a_process_runs_logs_and_reports_its_exit_code() {
        let dir = tempfile::tempdir().expect("dir");
        let runtime = ProcessRuntime::new(1024 * 1024, 2);
        let mut c = runtime
            .start(&plan(
                dir.path(),
                &["sh", "-c", "echo out; echo err >&2; exit 3"],
            ))
            .expect("starts");
        assert_eq!(
            c.wait().await,
            Exit {
                code: 3,
                signal: None
            }
        );
        let log = std::fs::read_to_string(dir.path().join("logs/c.log")).expect("log");
        assert!(log.contains("out") && log.contains("err"), "{log}");
        assert!(!dir.path().join("c.pid").exists());
    }

    #[tokio::test]
    async fn a_missing_command_cannot_run_with_127() {
        let dir = tempfile::tempdir().expect("dir");
        let runtime = ProcessRuntime::new(1024, 1);
        let err = runtime
            .start(&plan(dir.path(), &["/nonexistent/program"]))
            .err()
            .expect("refused");
        assert_eq!(err.code, 127);
        assert!(runtime.start(&plan(dir.path(), &[])).is_err());
    }

    #[tokio::test]
    async fn terminate_reaches_the_whole_group() {
        let dir = tempfile::tempdir().expect("dir");
        let runtime = ProcessRuntime::new(1024, 1);
        let mut c = runtime
            .start(&plan(dir.path(), &["sh", "-c", "sleep 30 & wait"]))
            .expect("starts");
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.terminate().await;
        let exit = tokio::time::timeout(Duration::from_secs(5), c.wait())
            .await
            .expect("stops on SIGTERM");
        assert_eq!(exit.signal, Some(15));
    }

    #[tokio::test]
    async fn logs_rotate_at_the_size_limit() {
        let dir = tempfile::tempdir().expect("dir");
        let runtime = ProcessRuntime::new(1024, 2);
        let mut c = runtime
            .start(&plan(
                dir.path(),
                &["sh", "-c", "i=0; while [ $i -lt 200 ]; do echo line-$i-xxxxxxxxxxxxxxxxxxxx; i=$((i+1)); done"],
            ))
            .expect("starts");
        c.wait().await;
        let logs = dir.path().join("logs");
        assert!(logs.join("c.log.1").exists() && logs.join("c.log.2").exists());
        assert!(!logs.join("c.log.3").exists());
        for name in ["c.log", "c.log.1", "c.log.2"] {
            let len = std::fs::metadata(logs.join(name))
                .map(|m| m.len())
                .unwrap_or(0);
            assert!(len <= 1024, "{name} is {len} bytes");
        }
        let last = std::fs::read_to_string(logs.join("c.log")).expect("log");
        assert!(last.contains("line-199"), "{last}");
    }
}
