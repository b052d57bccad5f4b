//! The cloud behind a node, as the end-to-end tests and `scripts/demo-devices` run it: the fake
//! API server and `edgemeta-edgecontroller` as processes of their own (found beside
//! `--edgemeta` unless named), a mosquitto as the cloud broker between the controller and the
//! node, and `kubectl` for manifests as users apply them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::Value;

use super::http::request;
use super::{cpu_of, free_port, Args, Process, Server};

/// The fake API server, the cloud broker and the controller; all stopped when dropped.
pub struct Cloud {
    // Dropped in this order: the controller first, so it does not log the others going away.
    controller: Process,
    broker: Server,
    api: Process,
    /// The fake API server's port (plain HTTP).
    pub api_port: u16,
    kubeconfig: PathBuf,
    dir: PathBuf,
}

/// CPU time (user + system) of the cloud's processes.
pub struct CloudCpu {
    pub controller: Duration,
    pub api: Duration,
    pub broker: Duration,
}

/// `flag` if given, else the binary named `name` beside `--edgemeta` (a build's `target/<profile>`).
fn beside(args: &Args, flag: &Option<PathBuf>, name: &str) -> PathBuf {
    flag.clone()
        .unwrap_or_else(|| args.edgemeta.with_file_name(name))
}

impl Cloud {
    /// Starts the three in `dir` and waits until each serves.
    pub async fn start(args: &Args, dir: &Path) -> anyhow::Result<Cloud> {
        let fakeapi = beside(args, &args.fakeapi, "edgemeta-fakeapi");
        let controller = beside(args, &args.controller, "edgemeta-edgecontroller");
        let kubeconfig = dir.join("kubeconfig");
        let url_file = dir.join("fakeapi.url");
        let api = Process(
            Command::new(&fakeapi)
                .args(["--port", "0", "--kubeconfig"])
                .arg(&kubeconfig)
                .env("RUST_LOG", "warn")
                .stdout(std::fs::File::create(&url_file)?)
                .stderr(std::fs::File::create(dir.join("fakeapi.log"))?)
                .spawn()
                .with_context(|| format!("start {}", fakeapi.display()))?,
        );
        // It prints its URL once it listens, after writing the kubeconfig.
        let started = Instant::now();
        let api_port = loop {
            let text = std::fs::read_to_string(&url_file).unwrap_or_default();
            if let Some(port) = text
                .lines()
                .next()
                .and_then(|url| url.rsplit(':').next())
                .and_then(|port| port.trim().parse().ok())
            {
                break port;
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!("{} printed no URL within 10 s", fakeapi.display());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let broker =
            Server::mosquitto_with(&args.mosquitto, dir, "cloud-broker", free_port()?, "").await?;
        let controller = Process(
            Command::new(&controller)
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .arg("--broker")
                .arg(format!("mqtt://127.0.0.1:{}", broker.port))
                .args(["--client-id", "bench-controller", "--resend-ms", "1000"])
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join("controller.log"))?)
                .spawn()
                .with_context(|| format!("start {}", controller.display()))?,
        );
        Ok(Cloud {
            controller,
            broker,
            api,
            api_port,
            kubeconfig,
            dir: dir.to_owned(),
        })
    }

    /// The node's `cloud:` section: bridged to this cloud's broker as `node_id`.
    pub fn node_config(&self, node_id: &str) -> String {
        format!(
            "cloud:\n  enabled: true\n  url: mqtt://127.0.0.1:{}\n  node_id: {node_id}\n  backoff_min_ms: 100\n  backoff_max_ms: 2000\n",
            self.broker.port
        )
    }

    /// CPU time each process has used so far.
    pub fn cpu(&self) -> anyhow::Result<CloudCpu> {
        Ok(CloudCpu {
            controller: cpu_of(self.controller.0.id())?,
            api: cpu_of(self.api.0.id())?,
            broker: self.broker.cpu()?,
        })
    }

    /// `kubectl apply --validate=false -f path`.
    pub fn kubectl_apply(&self, path: &Path) -> anyhow::Result<()> {
        let out = Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["apply", "--validate=false", "-f"])
            .arg(path)
            .output()
            .context("run kubectl (package kubernetes-client)")?;
        if !out.status.success() {
            bail!(
                "kubectl apply -f {}: {}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// POSTs `object` to the collection at `path` (`/apis/<group>/<version>/namespaces/...`).
    pub async fn create(&self, path: &str, object: &Value) -> anyhow::Result<()> {
        let (status, body) =
            request(self.api_port, "POST", path, Some(&object.to_string())).await?;
        if status != 201 {
            bail!("POST {path}: {status} {}", String::from_utf8_lossy(&body));
        }
        Ok(())
    }

    /// The items of the list at `path`.
    pub async fn list(&self, path: &str) -> anyhow::Result<Vec<Value>> {
        let body = super::http::get(self.api_port, path).await?;
        let mut list: Value = serde_json::from_slice(&body).context("a list")?;
        match list["items"].take() {
            Value::Array(items) => Ok(items),
            _ => bail!("GET {path}: no items"),
        }
    }

    /// The controller's log, for an error.
    pub fn controller_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("controller.log")).unwrap_or_default()
    }
}
