//! Test harness: starts the real `edgemeta` binary on free ports with a temporary store, and
//! talks to it over real MQTT (rumqttc) or the real mosquitto command-line clients.
#![allow(dead_code)] // each test file uses a different part of the harness

pub mod cloud;
pub mod edged;
pub mod pki;
pub mod raw;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// How long any single network wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// What `edgemeta run` logs once its listeners are open.
const SERVING: &str = "edgemeta serving";
/// How long to watch for a message that must not arrive.
pub const QUIET: Duration = Duration::from_millis(400);
/// How often [`wait_until`], [`assert_quiet_for`] and [`exit_within`] look again.
const POLL: Duration = Duration::from_millis(20);

/// What a [`wait_until`] check returns: `true`, `Some(value)` or `Ok(value)` once what is
/// awaited holds; `false`, `None` or `Err(what is there instead)` while it does not.
pub trait Check {
    type Value;
    /// `Ok(value)` when done; `Err(last state)` (maybe empty) otherwise.
    fn outcome(self) -> Result<Self::Value, String>;
}

impl Check for bool {
    type Value = ();
    fn outcome(self) -> Result<(), String> {
        if self {
            Ok(())
        } else {
            Err(String::new())
        }
    }
}

impl<T> Check for Option<T> {
    type Value = T;
    fn outcome(self) -> Result<T, String> {
        self.ok_or_else(String::new)
    }
}

impl<T, E: std::fmt::Display> Check for Result<T, E> {
    type Value = T;
    fn outcome(self) -> Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// Polls `check` until it holds and returns what it found; panics naming `what` (and the last
/// state `check` reported) once `limit` has passed. The tests' one polling wait: a test waits
/// for something it can observe (a row, a log line, a metric, a file, a port), never a fixed time.
pub async fn wait_until<C: Check>(
    what: impl std::fmt::Display,
    limit: Duration,
    mut check: impl AsyncFnMut() -> C,
) -> C::Value {
    let started = Instant::now();
    loop {
        let last = match check().await.outcome() {
            Ok(value) => return value,
            Err(last) => last,
        };
        if started.elapsed() >= limit {
            if last.is_empty() {
                panic!("waited {limit:?} for {what}");
            }
            panic!("waited {limit:?} for {what}; last:\n{last}");
        }
        tokio::time::sleep(POLL).await; // the poll interval
    }
}

/// Asserts that nothing happens for `window`: `happened` is polled throughout and must keep
/// returning `None`; `Some(description)` fails the test with `what`. A fixed wait on purpose:
/// "nothing arrives" can only be observed for a bounded time.
pub async fn assert_quiet_for(
    what: impl std::fmt::Display,
    window: Duration,
    mut happened: impl AsyncFnMut() -> Option<String>,
) {
    let started = Instant::now();
    loop {
        if let Some(seen) = happened().await {
            panic!("{what} within {window:?}: {seen}");
        }
        if started.elapsed() >= window {
            return;
        }
        tokio::time::sleep(POLL).await; // the poll interval
    }
}

/// The exit status of `child` once it has exited, `None` if it still runs after `limit` (the
/// caller decides: kill it, or fail). Synchronous, for `Drop` and other sync code: std has no
/// wait with a timeout.
pub fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if started.elapsed() >= limit {
            return None;
        }
        std::thread::sleep(POLL); // the poll interval
    }
}

/// Sends a request (`sent`: rumqttc queues it) and waits, at most [`WAIT`], for what the client's
/// event loop forwards on `acks` when it is acknowledged.
pub async fn acknowledged<E: std::fmt::Debug, A>(
    sent: impl std::future::Future<Output = Result<(), E>>,
    acks: &mut mpsc::UnboundedReceiver<A>,
    what: &str,
) -> A {
    sent.await.unwrap_or_else(|e| panic!("{what}: {e:?}"));
    tokio::time::timeout(WAIT, acks.recv())
        .await
        .unwrap_or_else(|_| panic!("{what} not acknowledged within {WAIT:?}"))
        .expect("event loop alive")
}

/// Settings a test may change; everything else is the node's default.
#[derive(Debug, Clone)]
pub struct Options {
    pub remote_query_timeout_ms: u64,
    pub volume_timeout_ms: u64,
    pub podstatus_sync_interval_s: u64,
    pub max_payload_bytes: usize,
    pub max_packet_bytes: usize,
    pub max_pages: u64,
    /// How long the node's store waits on a lock held by someone else.
    pub busy_timeout_ms: u64,
    /// Also open an MQTT v5 listener.
    pub v5: bool,
    /// SQL run on the store file before the node first opens it (e.g. failure triggers).
    pub store_setup: Option<String>,
    /// Bridge to this cloud broker (`cloud.enabled: true`), with this node id.
    pub cloud: Option<CloudOptions>,
    /// Extra listeners, as YAML lines indented under `broker.listeners` (4 spaces).
    pub extra_listeners: String,
    /// Extra `broker:` settings (auth, acl, limits), as YAML lines indented 2 spaces.
    pub broker_yaml: String,
    /// YAML lines inserted in the `store:` section (2-space indent).
    pub store_yaml: String,
    /// `cloud.url` instead of `mqtt://127.0.0.1:<cloud port>` (e.g. `mqtts://localhost:<port>`).
    pub cloud_url: Option<String>,
    /// Extra `cloud:` settings (e.g. `tls:`), as YAML lines indented 2 spaces.
    pub cloud_yaml: String,
    /// `observe.max_outbox_age_s`: how old the outbox may get before `/readyz` fails.
    pub max_outbox_age_s: u64,
    /// Extra `metaserver:` settings (history, token_file, ...), as YAML lines indented 2 spaces.
    pub metaserver_yaml: String,
    /// Extra `log:` settings (e.g. `format: json`), as YAML lines indented 2 spaces.
    pub log_yaml: String,
    /// Extra environment (`EDGEMETA_*` overrides, as an operator would set them).
    pub env: Vec<(String, String)>,
    /// Files copied into the node's directory (its working directory) before it starts:
    /// `(from, file name)`.
    pub files: Vec<(PathBuf, String)>,
    /// Run as the README does: no `--config`, the embedded default configuration, the store
    /// `edgemeta.db` in the node's directory, and only the ports moved, through the environment
    /// ([`Node::env`]). The settings above other than `env` and `files` are not used.
    pub embedded_config: bool,
    /// `(soft, hard)` open-files limits the node starts with (through `prlimit`).
    pub nofile: Option<(u64, u64)>,
}

/// The `cloud:` section for a node under test.
#[derive(Debug, Clone)]
pub struct CloudOptions {
    pub port: u16,
    pub node_id: String,
    pub backoff_min_ms: u64,
    pub backoff_max_ms: u64,
}

impl CloudOptions {
    /// A bridge to `cloud` with a unique node id and quick reconnects.
    pub fn to(cloud: &CloudBroker) -> CloudOptions {
        CloudOptions {
            port: cloud.port,
            node_id: unique_id("node"),
            backoff_min_ms: 50,
            backoff_max_ms: 500,
        }
    }

    /// `<cloud_root>/<node_id>/up/#`: what the node sends.
    pub fn up_filter(&self) -> String {
        format!("kubeedge/{}/up/#", self.node_id)
    }

    /// `<cloud_root>/<node_id>/down/<rest>`: where the cloud sends to this node.
    pub fn down(&self, rest: &str) -> String {
        format!("kubeedge/{}/down/{rest}", self.node_id)
    }

    /// `<cloud_root>/<node_id>/up/<rest>`.
    pub fn up(&self, rest: &str) -> String {
        format!("kubeedge/{}/up/{rest}", self.node_id)
    }
}

impl Options {
    /// Options for a node whose store already holds `sql` (run after the tables are created).
    pub fn seeded(sql: &str) -> Options {
        Options {
            store_setup: Some(sql.to_owned()),
            ..Options::default()
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            remote_query_timeout_ms: 2_000,
            volume_timeout_ms: 2_000,
            podstatus_sync_interval_s: 3_600,
            max_payload_bytes: 64 * 1024,
            max_packet_bytes: 256 * 1024,
            max_pages: 0,
            busy_timeout_ms: 5_000,
            v5: false,
            store_setup: None,
            cloud: None,
            extra_listeners: String::new(),
            broker_yaml: String::new(),
            store_yaml: String::new(),
            cloud_url: None,
            cloud_yaml: String::new(),
            max_outbox_age_s: 300,
            metaserver_yaml: String::new(),
            log_yaml: String::new(),
            env: Vec::new(),
            files: Vec::new(),
            embedded_config: false,
            nofile: None,
        }
    }
}

/// A running `edgemeta run` process with its own directory, store and ports.
pub struct Node {
    child: Option<Child>,
    pub port: u16,
    pub v5_port: Option<u16>,
    /// The observe endpoints' port (`/metrics`, `/healthz`, `/readyz`).
    pub observe_port: u16,
    /// The MetaServer's port (the Kubernetes API; 10550 by default, never in tests).
    pub metaserver_port: u16,
    dir: tempfile::TempDir,
    pub options: Options,
}

/// A port nobody listens on right now, below Linux's ephemeral range (32768 and up): a node
/// that restarts must get its port back, and no client's outgoing socket can take it meanwhile.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Test binaries run one after another; start each at its own offset anyway.
    let _ = NEXT.compare_exchange(
        0,
        std::process::id() % SPAN + 1,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port between {FIRST} and {}", FIRST + SPAN);
}

impl Node {
    pub async fn start() -> Node {
        Node::start_with(Options::default()).await
    }

    /// A node that also has an MQTT v5 listener (`v5_port`).
    pub async fn start_v5() -> Node {
        Node::start_with(Options {
            v5: true,
            ..Options::default()
        })
        .await
    }

    pub async fn start_with(options: Options) -> Node {
        let dir = tempfile::tempdir().expect("temp dir");
        let v5_port = options.v5.then(free_port);
        let mut node = Node {
            child: None,
            port: free_port(),
            v5_port,
            observe_port: free_port(),
            metaserver_port: free_port(),
            dir,
            options,
        };
        if let Some(sql) = node.options.store_setup.clone() {
            prepare_store(&node.db_path(), &sql).await;
        }
        for (from, name) in &node.options.files {
            std::fs::copy(from, node.dir().join(name)).unwrap_or_else(|e| {
                panic!("copy {} into the node's directory: {e}", from.display())
            });
        }
        // Another process may take a port between our probe and the node's bind: then try
        // fresh ports (the node names the address in its refusal).
        for _ in 0..3 {
            node.write_config();
            match node.spawn().await {
                Ok(()) => return node,
                Err(log) if log.contains("Address already in use") => {
                    node.port = free_port();
                    node.v5_port = node.options.v5.then(free_port);
                    node.observe_port = free_port();
                    node.metaserver_port = free_port();
                }
                Err(log) => panic!("edgemeta did not start:\n{log}"),
            }
        }
        panic!(
            "edgemeta found no free port in three tries:\n{}",
            node.log()
        );
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn db_path(&self) -> PathBuf {
        if self.options.embedded_config {
            self.dir.path().join("edgemeta.db")
        } else {
            self.dir.path().join("store").join("edgemeta.db")
        }
    }

    /// The environment the node runs with: [`Options::env`], and with
    /// [`Options::embedded_config`] the listeners' addresses. Other commands run "against the
    /// node" as the README does (in [`Node::dir`], without `--config`) need the same.
    pub fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if self.options.embedded_config {
            for (key, port) in [
                ("EDGEMETA_BROKER__LISTENERS__MQTT__ADDRESS", self.port),
                ("EDGEMETA_OBSERVE__ADDRESS", self.observe_port),
                ("EDGEMETA_METASERVER__ADDRESS", self.metaserver_port),
            ] {
                env.push((key.to_owned(), format!("127.0.0.1:{port}")));
            }
        }
        env.extend(self.options.env.iter().cloned());
        env
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("edge.yaml")
    }

    /// The node's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the node runs").id()
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("edgemeta.log")
    }

    /// Everything the node logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn write_config(&self) {
        let o = &self.options;
        if o.embedded_config {
            return;
        }
        let v5 = match self.v5_port {
            Some(port) => {
                format!("    mqtt5:\n      address: 127.0.0.1:{port}\n")
            }
            None => String::new(),
        };
        let Options {
            log_yaml,
            broker_yaml,
            extra_listeners,
            max_packet_bytes,
            store_yaml,
            max_pages,
            busy_timeout_ms,
            max_payload_bytes,
            remote_query_timeout_ms,
            volume_timeout_ms,
            podstatus_sync_interval_s,
            max_outbox_age_s,
            metaserver_yaml,
            ..
        } = o;
        let (port, observe, metaserver) = (self.port, self.observe_port, self.metaserver_port);
        let db = self.db_path();
        let db = db.display();
        let cloud = match &o.cloud {
            Some(c) => format!(
                "cloud:\n  enabled: true\n  url: {}\n  node_id: {}\n  backoff_min_ms: {}\n  backoff_max_ms: {}\n  keep_alive_s: 5\n{}",
                o.cloud_url
                    .clone()
                    .unwrap_or_else(|| format!("mqtt://127.0.0.1:{}", c.port)),
                c.node_id,
                c.backoff_min_ms,
                c.backoff_max_ms,
                o.cloud_yaml
            ),
            None => String::new(),
        };
        // Tests run without fsync unless one asks for it (a disk's fsync is not what they test).
        let synchronous = if store_yaml.contains("synchronous:") {
            ""
        } else {
            "  synchronous: normal\n"
        };
        let yaml = format!(
            "log:\n  level: info\n{log_yaml}\
             broker:\n  listeners:\n    mqtt:\n      address: 127.0.0.1:{port}\n{v5}{extra_listeners}  max_packet_bytes: {max_packet_bytes}\n{broker_yaml}\
             store:\n  path: {db}\n{synchronous}  max_pages: {max_pages}\n  busy_timeout_ms: {busy_timeout_ms}\n{store_yaml}\
             metamanager:\n  max_payload_bytes: {max_payload_bytes}\n  remote_query_timeout_ms: {remote_query_timeout_ms}\n  volume_timeout_ms: {volume_timeout_ms}\n  podstatus_sync_interval_s: {podstatus_sync_interval_s}\n\
             observe:\n  address: 127.0.0.1:{observe}\n  max_outbox_age_s: {max_outbox_age_s}\n\
             metaserver:\n  address: 127.0.0.1:{metaserver}\n{metaserver_yaml}\
             shutdown_grace_ms: 5000\n{cloud}"
        );
        std::fs::write(self.config_path(), yaml).expect("write config");
    }

    async fn spawn(&mut self) -> Result<(), String> {
        // The log is appended to across restarts: wait for this run's own line.
        let served_before = self.log().matches(SERVING).count();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("log file");
        let config = self.config_path();
        let child = run_command(
            self.dir(),
            (!self.options.embedded_config).then_some(config.as_path()),
            self.options.nofile,
        )
        .envs(self.env())
        .stdout(log.try_clone().expect("log file"))
        .stderr(log)
        .spawn()
        .expect("start edgemeta");
        self.child = Some(child);
        self.wait_until_serving(served_before).await
    }

    /// `Err(log)` if the node exited during start-up.
    async fn wait_until_serving(&mut self, served_before: usize) -> Result<(), String> {
        let log_path = self.log_path();
        let child = self.child.as_mut().expect("just spawned");
        // The node says it serves once its listeners are bound (a port another process holds
        // stops it instead). No probe connection: it would hold one of `max_connections`'
        // places until the node saw it close.
        let outcome = wait_until("edgemeta serving", WAIT, || {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            std::future::ready(if let Ok(Some(status)) = child.try_wait() {
                Ok(Err(format!("exited with {status}:\n{log}")))
            } else if log.matches(SERVING).count() > served_before {
                Ok(Ok(()))
            } else {
                Err(log)
            })
        })
        .await;
        if outcome.is_err() {
            self.child = None;
        }
        outcome
    }

    /// `kill -9`: nothing gets a chance to flush.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("kill -9");
            child.wait().expect("reap");
        }
    }

    /// SIGTERM, then waits for the exit; returns the status and how long it took.
    pub fn terminate(&mut self) -> (ExitStatus, Duration) {
        let mut child = self.child.take().expect("node is running");
        let started = Instant::now();
        Command::new("kill")
            .arg("-TERM")
            .arg(child.id().to_string())
            .status()
            .expect("send SIGTERM");
        match exit_within(&mut child, WAIT) {
            Some(status) => (status, started.elapsed()),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("edgemeta ignored SIGTERM for {WAIT:?}:\n{}", self.log());
            }
        }
    }

    /// Rewrites the configuration from `options` (takes effect at the next restart).
    pub fn reconfigure(&mut self) {
        self.write_config();
    }

    /// Starts the node again on the same ports and store.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the node before restarting it");
        if let Err(log) = self.spawn().await {
            panic!("edgemeta did not restart: {log}");
        }
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Waits (at most [`WAIT`]) until the node's log contains `needle`, e.g. an event code;
    /// returns the first line that has it.
    pub async fn await_log(&self, needle: &str) -> String {
        wait_until(format_args!("{needle:?} in the node's log"), WAIT, || {
            let log = self.log();
            std::future::ready(match log.lines().find(|l| l.contains(needle)) {
                Some(line) => Ok(line.to_owned()),
                None => Err(log),
            })
        })
        .await
    }

    /// A connected rumqttc client with a unique id.
    pub async fn client(&self) -> Client {
        Client::connect(self.port, &unique_id("t")).await
    }

    /// The stored value of `key`, read from the SQLite file (a second connection, as an
    /// operator's `sqlite3` would).
    pub async fn stored(&self, key: &str) -> Option<String> {
        let conn = open(&self.db_path()).await;
        let mut rows = conn
            .query("SELECT value FROM meta WHERE key = ?1", [key])
            .await
            .expect("query meta");
        let row = rows.next().await.expect("read row")?;
        row.get::<Option<String>>(0).expect("value column")
    }

    /// How many messages wait in the outbox for the cloud.
    pub async fn outbox_len(&self) -> i64 {
        let conn = open(&self.db_path()).await;
        let mut rows = conn
            .query("SELECT count(*) FROM outbox", ())
            .await
            .expect("query outbox");
        let row = rows.next().await.expect("read row").expect("one row");
        row.get(0).expect("count")
    }

    /// The rows `sql` returns, read from the SQLite file as an operator's `sqlite3` would: each
    /// row a JSON object by column name (TEXT as a string, INTEGER and REAL as a number, NULL as
    /// null, a BLOB as its bytes read as UTF-8).
    pub async fn rows(&self, sql: &str) -> Vec<Value> {
        let conn = open(&self.db_path()).await;
        let mut rows = conn
            .query(sql, ())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let mut out = Vec::new();
        while let Some(row) = rows.next().await.expect("read row") {
            let mut object = serde_json::Map::new();
            for i in 0..row.column_count() {
                let name = row.column_name(i).unwrap_or_default().to_owned();
                let value = match row.get_value(i).expect("column value") {
                    libsql::Value::Null => Value::Null,
                    libsql::Value::Integer(n) => json!(n),
                    libsql::Value::Real(x) => json!(x),
                    libsql::Value::Text(t) => json!(t),
                    libsql::Value::Blob(b) => json!(String::from_utf8_lossy(&b)),
                };
                object.insert(name, value);
            }
            out.push(Value::Object(object));
        }
        out
    }

    /// Every `(key, type, value)` in `meta`, in key order.
    pub async fn meta_rows(&self) -> Vec<(String, String, String)> {
        let conn = open(&self.db_path()).await;
        let mut rows = conn
            .query(
                "SELECT key, type, coalesce(value, '') FROM meta ORDER BY key",
                (),
            )
            .await
            .expect("query meta");
        let mut out = Vec::new();
        while let Some(row) = rows.next().await.expect("read row") {
            out.push((
                row.get(0).unwrap(),
                row.get(1).unwrap(),
                row.get(2).unwrap(),
            ));
        }
        out
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn open(path: &Path) -> libsql::Connection {
    let db = libsql::Builder::new_local(path)
        .build()
        .await
        .expect("open store");
    let conn = db.connect().expect("connect store");
    conn.busy_timeout(Duration::from_secs(5))
        .expect("busy timeout");
    conn
}

/// Creates the store file with KubeEdge's table and runs `sql` on it (the node migrates the rest).
async fn prepare_store(path: &Path, sql: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let conn = open(path).await;
    conn.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, type TEXT NOT NULL, value TEXT);\n{sql}"
    ))
    .await
    .expect("prepare store");
}

/// A client id no other test uses.
pub fn unique_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid_like())
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// One received publication.
#[derive(Debug, Clone)]
pub struct Msg {
    pub topic: String,
    pub payload: Bytes,
}

impl Msg {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.payload).unwrap_or_else(|e| {
            panic!(
                "payload on {} is not JSON ({e}): {:?}",
                self.topic, self.payload
            )
        })
    }
    pub fn content(&self) -> Value {
        self.json()["content"].clone()
    }
    pub fn parent_id(&self) -> Option<String> {
        self.json()["header"]["parent_msg_id"]
            .as_str()
            .map(str::to_owned)
    }
    pub fn msg_id(&self) -> String {
        self.json()["header"]["msg_id"]
            .as_str()
            .expect("msg_id")
            .to_owned()
    }
    pub fn operation(&self) -> String {
        self.json()["route"]["operation"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
    pub fn source(&self) -> String {
        self.json()["route"]["source"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
    /// `route.resource`: the object a message is about (v2 topics name only its type).
    pub fn resource(&self) -> String {
        self.json()["route"]["resource"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
    /// Whether this is a message on `topic` about `resource`; a payload that is not JSON is
    /// about nothing.
    fn is_about(&self, topic: &str, resource: &str) -> bool {
        self.topic == topic
            && serde_json::from_slice::<Value>(&self.payload)
                .is_ok_and(|json| json["route"]["resource"] == resource)
    }
}

/// `<namespace>/<type>` of a resource, at most its first two levels: all of it that a v2 topic
/// carries. The name travels in the envelope's `route.resource`.
pub fn type_level(resource: &str) -> String {
    resource.split('/').take(2).collect::<Vec<_>>().join("/")
}

/// The v2 topic under `prefix` (e.g. `ke/edged/meta/response`) for a message about `resource`:
/// `<prefix>/<namespace>/<type>`.
pub fn topic(prefix: &str, resource: &str) -> String {
    format!("{prefix}/{}", type_level(resource))
}

/// A rumqttc (MQTT 3.1.1) client whose event loop runs in its own task.
pub struct Client {
    pub client: AsyncClient,
    rx: mpsc::UnboundedReceiver<Msg>,
    acks: mpsc::UnboundedReceiver<u16>,
    task: tokio::task::JoinHandle<()>,
}

impl Client {
    pub async fn connect(port: u16, id: &str) -> Client {
        Client::connect_with(port, id, true).await
    }

    /// Connects with a username and password.
    pub async fn connect_as(port: u16, id: &str, user: &str, password: &str) -> Client {
        Client::open(port, id, true, Some((user, password))).await
    }

    /// Connects with a clean or a persistent session.
    pub async fn connect_with(port: u16, id: &str, clean_session: bool) -> Client {
        Client::open(port, id, clean_session, None).await
    }

    async fn open(port: u16, id: &str, clean_session: bool, login: Option<(&str, &str)>) -> Client {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options.set_clean_session(clean_session);
        if let Some((user, password)) = login {
            options.set_credentials(user, password);
        }
        options.set_max_packet_size(4 * 1024 * 1024, 4 * 1024 * 1024);
        options.set_keep_alive(Duration::from_secs(30));
        let (client, eventloop) = AsyncClient::new(options, 1000);
        let (tx, rx) = mpsc::unbounded_channel();
        let (ack_tx, acks) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(drive(eventloop, tx, ack_tx, ready_tx));
        tokio::time::timeout(WAIT, ready_rx)
            .await
            .expect("CONNACK within the wait")
            .expect("event loop alive");
        Client {
            client,
            rx,
            acks,
            task,
        }
    }

    /// Subscribes at QoS 1 and waits for the SUBACK.
    pub async fn subscribe(&mut self, filter: &str) {
        let sent = self.client.subscribe(filter, QoS::AtLeastOnce);
        acknowledged(sent, &mut self.acks, "SUBSCRIBE").await;
    }

    /// Publishes at QoS 1 (the broker's PUBACK is not awaited).
    pub async fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload.into())
            .await
            .expect("publish");
    }

    /// The next message, whatever its topic.
    pub async fn next(&mut self) -> Msg {
        tokio::time::timeout(WAIT, self.rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no message within {WAIT:?}"))
            .expect("event loop alive")
    }

    /// The next message, whatever its topic, or `None` if none comes within `limit`.
    pub async fn next_within(&mut self, limit: Duration) -> Option<Msg> {
        tokio::time::timeout(limit, self.rx.recv())
            .await
            .ok()
            .map(|m| m.expect("event loop alive"))
    }

    /// The next message on exactly `topic`, skipping others.
    pub async fn expect(&mut self, topic: &str) -> Msg {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.topic == topic => return m,
                Ok(Some(m)) => seen.push(m.topic),
                _ => panic!("nothing on {topic} within {WAIT:?}; saw {seen:?}"),
            }
        }
    }

    /// The next message about `resource` (its `route.resource`) on the v2 topic under `prefix`,
    /// skipping others: what `expect` on the topic with the name level used to be.
    pub async fn expect_about(&mut self, prefix: &str, resource: &str) -> Msg {
        let topic = topic(prefix, resource);
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.is_about(&topic, resource) => return m,
                Ok(Some(m)) => seen.push(m.topic),
                _ => panic!("nothing about {resource} on {topic} within {WAIT:?}; saw {seen:?}"),
            }
        }
    }

    /// The next reply to `parent` on the v2 topic under `prefix` for `resource`; the reply must
    /// name `resource` in `route.resource`.
    pub async fn expect_reply_about(&mut self, prefix: &str, resource: &str, parent: &str) -> Msg {
        let reply = self.expect_reply(&topic(prefix, resource), parent).await;
        assert_eq!(
            reply.resource(),
            resource,
            "route.resource of the reply on {}",
            reply.topic
        );
        reply
    }

    /// The next message on `topic` whose `parent_msg_id` is `parent`.
    pub async fn expect_reply(&mut self, topic: &str, parent: &str) -> Msg {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.topic == topic && m.parent_id().as_deref() == Some(parent) => {
                    return m
                }
                Ok(Some(m)) => seen.push(m.topic),
                _ => panic!("no reply to {parent} on {topic} within {WAIT:?}; saw {seen:?}"),
            }
        }
    }

    /// The next message on `topic` that `matches`, discarding the others (also on `topic`);
    /// `what` names it in the failure message, with the payloads seen on `topic` meanwhile.
    pub async fn expect_matching(
        &mut self,
        topic: &str,
        what: &str,
        matches: impl Fn(&Msg) -> bool,
    ) -> Msg {
        let deadline = Instant::now() + WAIT;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.topic == topic && matches(&m) => return m,
                Ok(Some(m)) if m.topic == topic => {
                    seen.push(String::from_utf8_lossy(&m.payload).into_owned())
                }
                Ok(Some(_)) => {}
                _ => panic!("no {what} on {topic} within {WAIT:?}; saw there {seen:#?}"),
            }
        }
    }

    /// One message on each of `topics`, in whatever order they arrive.
    pub async fn expect_each<const N: usize>(&mut self, topics: [&str; N]) -> [Msg; N] {
        let what = topics.map(|t| t.to_owned());
        self.expect_each_matching(&what, |i, m| m.topic == topics[i])
            .await
    }

    /// One message about each `(prefix, resource)` on its v2 topic, in whatever order they
    /// arrive.
    pub async fn expect_each_about<const N: usize>(
        &mut self,
        wanted: [(&str, &str); N],
    ) -> [Msg; N] {
        let topics = wanted.map(|(prefix, resource)| (topic(prefix, resource), resource));
        let what = topics.clone().map(|(t, r)| format!("{r} on {t}"));
        self.expect_each_matching(&what, |i, m| m.is_about(&topics[i].0, topics[i].1))
            .await
    }

    /// One message for each of `N` wants (`matches(i, msg)`), in whatever order they arrive.
    async fn expect_each_matching<const N: usize>(
        &mut self,
        what: &[String; N],
        matches: impl Fn(usize, &Msg) -> bool,
    ) -> [Msg; N] {
        let deadline = Instant::now() + WAIT;
        let mut found: [Option<Msg>; N] = std::array::from_fn(|_| None);
        let mut seen = Vec::new();
        while found.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) => match (0..N).find(|&i| found[i].is_none() && matches(i, &m)) {
                    Some(i) => found[i] = Some(m),
                    None => seen.push(m.topic),
                },
                _ => panic!("not all of {what:?} within {WAIT:?}; saw {seen:?}"),
            }
        }
        found.map(|m| m.expect("found"))
    }

    /// Asserts that nothing about `resource` arrives on its v2 topic under `prefix` for
    /// [`QUIET`]; other messages are discarded.
    pub async fn expect_silence_about(&mut self, prefix: &str, resource: &str) {
        let topic = topic(prefix, resource);
        let deadline = Instant::now() + QUIET;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.is_about(&topic, resource) => {
                    panic!(
                        "unexpected message about {resource} on {topic}: {:?}",
                        m.payload
                    )
                }
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    }

    /// Asserts that nothing arrives on `topic` for [`QUIET`]; other messages are discarded.
    pub async fn expect_silence(&mut self, topic: &str) {
        let deadline = Instant::now() + QUIET;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.rx.recv()).await {
                Ok(Some(m)) if m.topic == topic => {
                    panic!("unexpected message on {topic}: {:?}", m.payload)
                }
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    }

    /// Every message received during `window`.
    pub async fn drain(&mut self, window: Duration) -> Vec<Msg> {
        let deadline = Instant::now() + window;
        let mut out = Vec::new();
        while let Ok(Some(m)) = tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            self.rx.recv(),
        )
        .await
        {
            out.push(m);
        }
        out
    }

    /// The topics of every message received during `window`.
    pub async fn drain_topics(&mut self, window: Duration) -> Vec<String> {
        self.drain(window)
            .await
            .into_iter()
            .map(|m| m.topic)
            .collect()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn drive(
    mut eventloop: EventLoop,
    tx: mpsc::UnboundedSender<Msg>,
    acks: mpsc::UnboundedSender<u16>,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                if let Some(ready) = ready.take() {
                    let _ = ready.send(());
                }
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let topic = p.topic.clone();
                let _ = tx.send(Msg {
                    topic,
                    payload: p.payload,
                });
            }
            Ok(Event::Incoming(Packet::SubAck(s))) => {
                let _ = acks.send(s.pkid);
            }
            Ok(_) => {}
            // The node may be restarting; rumqttc reconnects on the next poll.
            // pacing: no tight reconnect loop while the node is down.
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A full KubeEdge envelope with a fresh id; returns `(msg_id, payload)`.
pub fn envelope(source: &str, operation: &str, resource: &str, content: Value) -> (String, String) {
    let id = unique_id("msg");
    let payload = json!({
        "header": {"msg_id": id, "timestamp": 1_732_262_400_000_i64},
        "route": {"source": source, "group": "resource", "operation": operation, "resource": resource},
        "content": content,
    });
    (id, payload.to_string())
}

/// Publishes a full envelope about `resource` as a v2 sender does: on the type-level topic
/// `<root>/meta/<from>/<op>/<namespace>/<type>`, the name in `route.resource`; returns its id.
pub async fn send(
    client: &Client,
    from: &str,
    operation: &str,
    resource: &str,
    content: Value,
) -> String {
    let (id, payload) = envelope(from, operation, resource, content);
    client
        .publish(
            &topic(&format!("ke/meta/{from}/{operation}"), resource),
            payload,
        )
        .await;
    id
}

/// Runs `tests/py/<script>` (paho-mqtt for Python, a client we did not write) with `args`, for
/// at most two [`WAIT`]s; what it printed, and what it printed on stderr.
pub async fn paho_script(script: &str, args: &[&str]) -> (String, String) {
    let path = format!("{}/tests/py/{script}", env!("CARGO_MANIFEST_DIR"));
    let run = tokio::process::Command::new("python3")
        .arg(path)
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(WAIT * 2, run)
        .await
        .expect("the paho-mqtt script finishes")
        .expect("python3 runs (scripts/test installs paho-mqtt)");
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `mosquitto_pub` with `args` against the node; returns its exit status and stderr.
pub fn mosquitto_pub(port: u16, args: &[&str]) -> (bool, String) {
    let out = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .output()
        .expect("mosquitto_pub is installed (scripts/test installs it)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Starts `mosquitto_sub -v` on `filter`, waiting for `count` messages (at most [`WAIT`]);
/// returns once it is subscribed.
pub async fn mosquitto_sub(port: u16, filter: &str, count: usize) -> MosquittoSub {
    let port = port.to_string();
    let count = count.to_string();
    let wait = WAIT.as_secs().to_string();
    MosquittoSub::start(&[
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-v",
        "-q",
        "1",
        "-t",
        filter,
        "-C",
        &count,
        "-W",
        &wait,
    ])
    .await
}

/// Lines `mosquitto_sub -v` printed (`<topic> <payload>`), after it exited.
pub async fn sub_output(sub: MosquittoSub) -> Vec<String> {
    sub.output().await.1
}

/// A running `mosquitto_sub` whose subscription is in place: it runs with `-d`, whose
/// `Subscribed (mid: …)` line follows the SUBACK, and line-buffered; the debug lines are left
/// out of its output.
pub struct MosquittoSub {
    child: Option<Child>,
    lines: mpsc::UnboundedReceiver<String>,
}

impl MosquittoSub {
    /// Starts `mosquitto_sub -d <args>` and waits (at most [`WAIT`]) for its SUBACK.
    pub async fn start(args: &[&str]) -> MosquittoSub {
        // `stdbuf -oL`: line-buffered, so `-d`'s lines arrive as printed (stdbuf execs
        // mosquitto_sub: the pid is its own).
        let mut child = Command::new("stdbuf")
            .args(["-oL", "mosquitto_sub", "-d"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto_sub is installed (scripts/test installs it)");
        let (tx, mut lines) = mpsc::unbounded_channel();
        forward_lines(&mut child, tx);
        let mut seen = Vec::new();
        let subscribed = tokio::time::timeout(WAIT, async {
            while let Some(line) = lines.recv().await {
                if line.starts_with("Subscribed (mid:") {
                    return true;
                }
                seen.push(line);
            }
            false
        })
        .await;
        assert!(
            subscribed == Ok(true),
            "`mosquitto_sub {}` not subscribed within {WAIT:?}; it printed {seen:#?}",
            args.join(" ")
        );
        MosquittoSub {
            child: Some(child),
            lines,
        }
    }

    /// The process (for the caller to stop) and what it prints from here on, `-d`'s lines
    /// included.
    pub fn split(mut self) -> (Child, mpsc::UnboundedReceiver<String>) {
        let child = self.child.take().expect("running");
        let (_, closed) = mpsc::unbounded_channel();
        (child, std::mem::replace(&mut self.lines, closed))
    }

    /// Waits for it to exit (it must, within twice [`WAIT`]: give it `-C` or `-W`); returns its
    /// exit status and the lines it printed, without `-d`'s.
    pub async fn output(mut self) -> (ExitStatus, Vec<String>) {
        let mut out = Vec::new();
        tokio::time::timeout(2 * WAIT, async {
            while let Some(line) = self.lines.recv().await {
                if !line.starts_with("Client ") && !line.starts_with("Subscribed (mid:") {
                    out.push(line);
                }
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "mosquitto_sub still printing after {:?}: {out:#?}",
                2 * WAIT
            )
        });
        let child = self.child.as_mut().expect("running");
        let status = exit_within(child, WAIT).expect("mosquitto_sub exits");
        (status, out)
    }
}

/// A child process killed (and reaped) when dropped, also when a test panics: a
/// `std::process::Child` is not, and a left-over `mosquitto_sub` reconnects forever.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SIGKILL also ends a process stopped with SIGSTOP.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for MosquittoSub {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Writes what a TLS listener needs into the broker's directory; returns its settings.
type ListenerSetup<'a> = Box<dyn FnOnce(&Path) -> String + 'a>;

/// A real mosquitto broker standing in for the cloud, on a free port, with persistence in its
/// own directory so sessions and queued messages survive a graceful restart.
pub struct CloudBroker {
    child: Option<Child>,
    pub port: u16,
    /// A second, TLS listener (see [`CloudBroker::start_tls`]).
    pub tls_port: Option<u16>,
    dir: tempfile::TempDir,
}

impl CloudBroker {
    pub async fn start() -> CloudBroker {
        CloudBroker::start_with(None, "").await
    }

    /// A cloud broker that also keeps QoS 0 messages for a persistent session whose client is
    /// away: an observer still reconnecting after a restart then gets the node's heartbeat (QoS 0)
    /// when the node was back first, instead of losing it to that race.
    pub async fn start_keeping_qos0() -> CloudBroker {
        CloudBroker::start_with(None, "queue_qos0_messages true\n").await
    }

    /// A cloud broker that also listens with TLS on [`CloudBroker::tls_port`]; `tls` writes the
    /// files it needs into the broker's directory (which mosquitto can read) and returns that
    /// listener's settings.
    pub async fn start_tls(tls: impl FnOnce(&Path) -> String) -> CloudBroker {
        CloudBroker::start_with(Some(Box::new(tls)), "").await
    }

    async fn start_with(tls: Option<ListenerSetup<'_>>, extra: &str) -> CloudBroker {
        let dir = tempfile::tempdir().expect("temp dir");
        // Started as root, mosquitto drops to its own user and must still write its persistence.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))
            .expect("chmod the cloud broker's directory");
        let tls_listener = match tls {
            Some(settings) => {
                let port = free_port();
                Some((
                    port,
                    format!("listener {port} 127.0.0.1\n{}", settings(dir.path())),
                ))
            }
            None => None,
        };
        let mut cloud = CloudBroker {
            child: None,
            port: free_port(),
            tls_port: tls_listener.as_ref().map(|(port, _)| *port),
            dir,
        };
        let config = format!(
            "listener {} 127.0.0.1\n{}allow_anonymous true\npersistence true\npersistence_location {}/\nautosave_interval 1\nmax_queued_messages 0\nmax_inflight_messages 100\n{extra}",
            cloud.port,
            tls_listener.map(|(_, l)| l).unwrap_or_default(),
            cloud.dir.path().display()
        );
        std::fs::write(cloud.dir.path().join("mosquitto.conf"), config).expect("mosquitto.conf");
        cloud.spawn().await;
        cloud
    }

    async fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("mosquitto.log"))
            .expect("log file");
        let child = Command::new(mosquitto_binary())
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("mosquitto is installed (scripts/test installs it)");
        self.child = Some(child);
        for port in std::iter::once(self.port).chain(self.tls_port) {
            let address = SocketAddr::from(([127, 0, 0, 1], port));
            wait_until(format_args!("mosquitto listening on {port}"), WAIT, || {
                let up = TcpStream::connect_timeout(&address, Duration::from_millis(100)).is_ok();
                std::future::ready(if up { Ok(()) } else { Err(self.log()) })
            })
            .await;
        }
    }

    /// SIGTERM: mosquitto saves its persistence file and exits.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let _ = child.wait();
        }
    }

    /// `kill -9`: whatever mosquitto had not saved is gone.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "stop the cloud broker first");
        self.spawn().await;
    }

    /// Whether the broker process is up (not stopped or killed by the test).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The broker's own directory (its config, persistence and log, files for TLS).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What mosquitto logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("mosquitto.log")).unwrap_or_default()
    }

    /// A client of the cloud broker with a persistent session under `id`.
    pub async fn client(&self, id: &str) -> Client {
        Client::connect_with(self.port, id, false).await
    }
}

impl Drop for CloudBroker {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn mosquitto_binary() -> &'static str {
    if Path::new("/usr/sbin/mosquitto").exists() {
        "/usr/sbin/mosquitto"
    } else {
        "mosquitto"
    }
}

/// An argon2 hash of `password` made by `edgemeta passwd`, as an operator would. Made once per
/// password and test binary: a debug build takes a while over each.
pub fn hash(password: &str) -> String {
    use std::collections::HashMap;
    use std::io::Write;
    use std::sync::{Mutex, OnceLock};
    static MADE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let made = MADE.get_or_init(Mutex::default);
    if let Some(hash) = made.lock().expect("hashes").get(password) {
        return hash.clone();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgemeta"))
        .arg("passwd")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("edgemeta passwd");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("write password");
    let out = child.wait_with_output().expect("passwd output");
    assert!(
        out.status.success(),
        "edgemeta passwd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let hash = String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned();
    assert!(hash.starts_with("$argon2id$"), "{hash}");
    made.lock()
        .expect("hashes")
        .insert(password.to_owned(), hash.clone());
    hash
}

/// `broker.auth` YAML (for [`Options::broker_yaml`]) with `users`, each with the password
/// `<user>-pw`.
pub fn auth_yaml(allow_anonymous: bool, users: &[&str]) -> String {
    let users: String = users
        .iter()
        .map(|u| {
            format!(
                "      {u}: {{ password_hash: \"{}\" }}\n",
                hash(&format!("{u}-pw"))
            )
        })
        .collect();
    format!("  auth:\n    allow_anonymous: {allow_anonymous}\n    users:\n{users}")
}

impl Node {
    /// A node with these extra `broker:` settings ([`Options::broker_yaml`]) and defaults otherwise.
    pub async fn start_with_broker(broker_yaml: impl Into<String>) -> Node {
        Node::start_with(Options {
            broker_yaml: broker_yaml.into(),
            ..Options::default()
        })
        .await
    }
}

/// `edgemeta run` working in `dir`, with `config` (or the embedded default configuration) and
/// `nofile`'s open-files limits (soft, hard) if given: the one way the tests start a node
/// ([`Node`], [`run_expecting_exit`]).
fn run_command(dir: &Path, config: Option<&Path>, nofile: Option<(u64, u64)>) -> Command {
    let binary = env!("CARGO_BIN_EXE_edgemeta");
    let mut command = match nofile {
        // prlimit (util-linux) sets its own limits and execs the node: the pid stays the node's.
        Some((soft, hard)) => {
            let mut command = Command::new("prlimit");
            command.arg(format!("--nofile={soft}:{hard}")).arg(binary);
            command
        }
        None => Command::new(binary),
    };
    command.arg("run");
    if let Some(config) = config {
        command.arg("--config").arg(config);
    }
    command
        .current_dir(dir)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    command
}

/// Runs `edgemeta run` with `yaml` as its configuration file and `env`; it must exit on its
/// own within the wait. Returns its exit status and what it printed (stdout, then stderr).
pub fn run_expecting_exit(yaml: &str, env: &[(&str, &str)]) -> (ExitStatus, String) {
    run_limited_expecting_exit(yaml, env, None)
}

/// [`run_expecting_exit`] with the open-files limits `nofile` (soft, hard).
pub fn run_limited_expecting_exit(
    yaml: &str,
    env: &[(&str, &str)],
    nofile: Option<(u64, u64)>,
) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("edge.yaml");
    std::fs::write(&config, yaml).expect("config");
    let mut child = run_command(dir.path(), Some(&config), nofile)
        // The default 10550 is not the test's to take: any free port.
        .env("EDGEMETA_METASERVER__ADDRESS", "127.0.0.1:0")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start edgemeta");
    if exit_within(&mut child, WAIT).is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("edgemeta kept running with a bad configuration:\n{yaml}");
    }
    let out = child.wait_with_output().expect("output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

/// Splits a README command line on spaces, honouring single quotes.
pub fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let (mut quoted, mut started) = (false, false);
    for c in line.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                started = true;
            }
            ' ' if !quoted => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(word);
    }
    words
}

/// The commands of the `sh` blocks of the README section titled `title`: tests run them verbatim.
pub fn readme_section_commands(title: &str) -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with(title))
        .unwrap_or_else(|| panic!("a {title:?} section in README.md"));
    let mut commands = Vec::new();
    let mut in_block = false;
    for line in section.lines() {
        match line.trim_end() {
            "```sh" => in_block = true,
            "```" => in_block = false,
            command if in_block && !command.is_empty() => commands.push(command.to_owned()),
            _ => {}
        }
    }
    commands
}

/// Sends each line `child` prints to `tx`, from a thread, until its stdout closes.
pub fn forward_lines(
    child: &mut std::process::Child,
    tx: tokio::sync::mpsc::UnboundedSender<String>,
) {
    let stdout = child.stdout.take().expect("stdout piped");
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
}

/// Stops a child process the way an operator would: SIGTERM (edged then stops its pods'
/// process groups), SIGKILL if it has not exited within [`WAIT`].
pub fn terminate_child(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = exit_within(child, WAIT);
    let _ = child.kill();
    let _ = child.wait();
}

/// `GET http://127.0.0.1:<port><path>`: status and body.
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    let url = format!("http://127.0.0.1:{port}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(5)))
            .build()
            .into();
        let mut response = agent.get(&url).call().expect("an HTTP answer");
        let body = response.body_mut().read_to_string().expect("a body");
        (response.status().as_u16(), body)
    })
    .await
    .expect("GET")
}
