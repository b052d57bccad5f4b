//! The container runtime behind a small trait, and its one implementation here: each container
//! is a local process in its own process group, its stdout and stderr in a size-rotated log.
//! A CRI runtime would implement [`Runtime`] and [`Container`] the same way.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::Duration;

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

/// A container's log: both streams, rotated at `max_bytes` into `<log>.1` … `<log>.<max_files>`.
struct LogFile {
    path: PathBuf,
    max_bytes: u64,
    max_files: u32,
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
        let mut file = None;
        let mut written = tokio::fs::metadata(&self.path)
            .await
            .map(|m| m.len())
            .unwrap_or(0);
        let (mut out_buf, mut err_buf) = (vec![0u8; 8192], vec![0u8; 8192]);
        while out.is_some() || err.is_some() {
            let chunk = tokio::select! {
                n = read(&mut out, &mut out_buf), if out.is_some() => match n {
                    Some(n) => &out_buf[..n],
                    None => { out = None; continue; }
                },
                n = read(&mut err, &mut err_buf), if err.is_some() => match n {
                    Some(n) => &err_buf[..n],
                    None => { err = None; continue; }
                },
            };
            let mut rest = chunk;
            while !rest.is_empty() {
                if written >= self.max_bytes {
                    file = None;
                    self.rotate().await;
                    written = 0;
                }
                if file.is_none() {
                    file = tokio::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&self.path)
                        .await
                        .map_err(|e| {
                            warn!(error_code = "EM-EDGED-IO", path = %self.path.display(), error = %e, "cannot open the container log");
                        })
                        .ok();
                }
                let room = usize::try_from(self.max_bytes - written).unwrap_or(usize::MAX);
                let (now, later) = rest.split_at(rest.len().min(room));
                if let Some(f) = file.as_mut() {
                    if f.write_all(now).await.is_err() {
                        file = None;
                    }
                }
                written += now.len() as u64;
                rest = later;
            }
        }
        if let Some(mut f) = file {
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
