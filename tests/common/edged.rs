//! The edge agent under test: `edgemeta edged` with its own directory and configuration,
//! aimed at a [`Node`]'s broker (`edged.rs`, `kube.rs`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{exit_within, terminate_child, unique_id, wait_until, Node, WAIT};

/// A running `edgemeta edged` with its own directory, aimed at `node`.
pub struct Edged {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Edged {
    /// Starts edged with quick timings, `overrides` replacing keys of the `edged:` section.
    pub fn start(node: &Node, overrides: &[(&str, &str)]) -> Edged {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("root").display().to_string();
        let client_id = unique_id("edged");
        let mut keys: Vec<(&str, &str)> = vec![
            ("client_id", &client_id),
            ("root_dir", &root),
            ("status_interval_ms", "100"),
            ("restart_backoff_base_ms", "300"),
            ("restart_backoff_max_ms", "2000"),
            ("reconnect_min_ms", "50"),
            ("reconnect_max_ms", "500"),
            ("query_timeout_ms", "5000"),
        ];
        for (key, value) in overrides {
            match keys.iter_mut().find(|(k, _)| k == key) {
                Some(slot) => slot.1 = value,
                None => keys.push((key, value)),
            }
        }
        let section: String = keys.iter().map(|(k, v)| format!("  {k}: {v}\n")).collect();
        let yaml = format!(
            "log:\n  level: info\n\
             broker:\n  listeners:\n    mqtt:\n      address: 127.0.0.1:{port}\n\
             edged:\n{section}",
            port = node.port,
        );
        std::fs::write(dir.path().join("edged.yaml"), yaml).expect("edged config");
        let mut edged = Edged { child: None, dir };
        edged.spawn();
        edged
    }

    /// Starts the process (again, after [`Edged::kill9`]), its output appended to its log.
    pub fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log");
        let child = Command::new(env!("CARGO_BIN_EXE_edgemeta"))
            .arg("edged")
            .arg("--config")
            .arg(self.dir.path().join("edged.yaml"))
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start edgemeta edged");
        self.child = Some(child);
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("edged.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Waits (at most [`WAIT`]) until edged's log contains `needle`.
    pub async fn await_log(&self, needle: &str) {
        wait_until(format_args!("{needle:?} in edged's log"), WAIT, || {
            let log = self.log();
            std::future::ready(if log.contains(needle) {
                Ok(())
            } else {
                Err(log)
            })
        })
        .await;
    }

    /// `<root_dir>/pods/<namespace>_<name>`.
    pub fn pod_dir(&self, name: &str) -> PathBuf {
        self.dir
            .path()
            .join("root/pods")
            .join(format!("default_{name}"))
    }

    /// The process id (0 when it is not running).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// SIGTERM; returns how long edged took to stop its pods and exit.
    pub fn terminate(&mut self) -> Duration {
        let mut child = self.child.take().expect("edged runs");
        let started = Instant::now();
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("kill");
        if exit_within(&mut child, WAIT).is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("edged ignored SIGTERM:\n{}", self.log());
        }
        started.elapsed()
    }
}

impl Drop for Edged {
    fn drop(&mut self) {
        // Its pods are process groups of their own: stop them the way edged does at shutdown.
        if let Some(mut child) = self.child.take() {
            terminate_child(&mut child);
        }
    }
}
