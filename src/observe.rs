//! The node seen from outside: `/metrics` (Prometheus text), `/healthz` and `/readyz` over HTTP
//! on `observe.address`. Metrics live in a local recorder (no global one, so a dependency's
//! cannot collide with ours); the message path only adds to handles registered here once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use edgemeta_bridges::CloudStatus;
use edgemeta_broker::stages::Stage;
use edgemeta_broker::BrokerStats;
use edgemeta_metamanager::{Meters, OutboxHandle, OutboxStats};
use metrics::{counter, gauge, Counter, Gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::field::{Field, Visit};
use tracing::{error, Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::Layer;

use crate::config::ObserveConfig;

/// Every stable `error_code` (ARCHITECTURE.md), each with its counter from the start so a rate
/// of zero is visible; anything else counts as `other`.
pub const ERROR_CODES: &[&str] = &[
    "EM-AUTH-REFUSED",
    "EM-AUTH-BUSY",
    "EM-AUTH-POOL",
    "EM-BROKER-CLIENT-ID",
    "EM-BROKER-TOPIC-BOUND",
    "EM-BROKER-CONNECTION-LIMIT",
    "EM-BROKER-FD-LIMIT",
    "EM-BROKER-READ-BUFFERS",
    "EM-BROKER-SLOW-PACKET",
    "EM-ACL-PUBLISH-DENIED",
    "EM-ACL-SUBSCRIBE-DENIED",
    "EM-ACL-WILL-DENIED",
    "EM-TLS-CLIENT-CERT",
    "EM-FRONT-ACCEPT",
    "EM-BROKER-SUBSCRIBER-LAG",
    "EM-BROKER-QUEUE-FULL",
    "EM-BROKER-RETAINED-FULL",
    "EM-BROKER-SESSIONS-FULL",
    "EM-BROKER-CLIENT-EVENT",
    "EM-BROKER-LISTENER",
    "EM-SHUTDOWN-GRACE",
    "EM-META-TOPIC",
    "EM-META-OPERATION",
    "EM-META-RESOURCE",
    "EM-META-NAMESPACE",
    "EM-META-NO-NAME",
    "EM-META-PAYLOAD-SIZE",
    "EM-META-PAYLOAD-BINARY",
    "EM-META-JSON",
    "EM-META-ENVELOPE",
    "EM-META-CONTENT",
    "EM-META-REMOTE-TIMEOUT",
    "EM-META-VOLUME-TIMEOUT",
    "EM-META-CLOSED",
    "EM-META-PUBLISH",
    "EM-META-PANIC",
    "EM-META-ENDED",
    "EM-DEVICE-REFUSED",
    "EM-DEVICE-JSON",
    "EM-DEVICE-CLOUD-JSON",
    "EM-DEVICE-UNKNOWN",
    "EM-DEVICE-ID",
    "EM-DEVICE-TWIN",
    "EM-STORE-WRITE",
    "EM-STORE-OUTBOX-FULL",
    "EM-STORE-COMMIT",
    "EM-STORE-OPEN",
    "EM-STORE-CACHE",
    "EM-STORE-CHECKPOINT",
    "EM-STORE-SYNC",
    "EM-STORE-PANIC",
    "EM-STORE-TRANSACTION",
    "EM-BRIDGE-CONNECT",
    "EM-BRIDGE-DISCONNECTED",
    "EM-BRIDGE-SIGNAL",
    "EM-BRIDGE-REDELIVER",
    "EM-BRIDGE-TOPIC",
    "EM-BRIDGE-PANIC",
    "EM-BRIDGE-TLS",
    "EM-BRIDGE-TLS-INSECURE",
    "EM-OBSERVE-SERVE",
    "EM-METASERVER-SERVE",
    "EM-METASERVER-READ",
];

/// Commit latency buckets, in seconds: from a relaxed batch (tens of µs) to a stalled disk.
const COMMIT_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// How often recorded histogram samples are folded into their buckets when nobody scrapes
/// (exporter 0.13 keeps samples until a render).
const DRAIN_EVERY: Duration = Duration::from_secs(30);

/// How long a health check waits for the store worker's answer.
const STORE_ANSWER: Duration = Duration::from_secs(2);

/// How long the HTTP server may take to stop once cancelled, before it is aborted.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// The node's metrics: the recorder's handle and what is registered with it.
pub struct Registry {
    handle: PrometheusHandle,
    /// Handed to the MetaManager.
    pub meters: Arc<Meters>,
    /// Fed by the tracing layer from [`Registry::error_layer`].
    errors: Arc<ErrorCounts>,
    scraped: Scraped,
}

impl Registry {
    /// Builds the recorder and registers every series once.
    pub fn new() -> anyhow::Result<Registry> {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("edgemeta_store_commit_seconds".into()),
                COMMIT_BUCKETS,
            )?
            .set_buckets_for_metric(
                Matcher::Full("edgemeta_metaserver_event_delay_seconds".into()),
                COMMIT_BUCKETS,
            )?
            .build_recorder();
        let handle = recorder.handle();
        // Handles keep their atomics alive; the recorder itself is not needed after this.
        let (meters, errors, scraped) = metrics::with_local_recorder(&recorder, || {
            (
                Arc::new(Meters::register()),
                Arc::new(ErrorCounts::register()),
                Scraped::register(),
            )
        });
        Ok(Registry {
            handle,
            meters,
            errors,
            scraped,
        })
    }

    /// A tracing layer counting every event that carries an `error_code`.
    pub fn error_layer(&self) -> ErrorLayer {
        ErrorLayer(self.errors.clone())
    }
}

/// `edgemeta_errors_total{error_code}`, one pre-registered counter per code.
struct ErrorCounts {
    codes: Vec<(&'static str, Counter)>,
    other: Counter,
}

impl ErrorCounts {
    fn register() -> ErrorCounts {
        ErrorCounts {
            codes: ERROR_CODES
                .iter()
                .map(|&code| {
                    (
                        code,
                        counter!("edgemeta_errors_total", "error_code" => code),
                    )
                })
                .collect(),
            other: counter!("edgemeta_errors_total", "error_code" => "other"),
        }
    }

    fn count(&self, code: &str) {
        match self.codes.iter().find(|(known, _)| *known == code) {
            Some((_, counter)) => counter.increment(1),
            None => self.other.increment(1),
        }
    }
}

/// Counts log events by their `error_code` field: every code is logged where it happens, so
/// the metric and the log agree without a counter beside each log line.
pub struct ErrorLayer(Arc<ErrorCounts>);

impl<S: Subscriber> Layer<S> for ErrorLayer {
    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        if event.metadata().fields().field("error_code").is_some() {
            event.record(&mut CodeVisitor(&self.0));
        }
    }
}

struct CodeVisitor<'a>(&'a ErrorCounts);

impl Visit for CodeVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "error_code" {
            self.0.count(value);
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

/// Series set from the parts' own counters when `/metrics` is read, so the message path pays
/// nothing for them.
struct Scraped {
    outbox_entries: Gauge,
    outbox_bytes: Gauge,
    outbox_oldest_age: Gauge,
    store_bytes: Gauge,
    cloud_connected: Gauge,
    cloud_reconnects: Counter,
    cloud_down: Counter,
    connections: Gauge,
    denied_publishes: Counter,
    denied_subscribes: Counter,
    lagging_cut: Counter,
    away_dropped: Counter,
    read_buffers_refused: Counter,
    slow_packets: Counter,
    sessions: Gauge,
    paused_publishers: Gauge,
    publisher_pauses: Counter,
    handon_waiting: Gauge,
    listeners_up: Gauge,
    /// Time spent per stage of the message path (`edgemeta_broker::stages`), one per stage.
    stages: Vec<(Stage, Counter)>,
}

impl Scraped {
    fn register() -> Scraped {
        Scraped {
            outbox_entries: gauge!("edgemeta_outbox_entries"),
            outbox_bytes: gauge!("edgemeta_outbox_bytes"),
            outbox_oldest_age: gauge!("edgemeta_outbox_oldest_age_seconds"),
            store_bytes: gauge!("edgemeta_store_bytes"),
            cloud_connected: gauge!("edgemeta_cloud_connected"),
            cloud_reconnects: counter!("edgemeta_cloud_reconnects_total"),
            cloud_down: counter!("edgemeta_cloud_down_messages_total"),
            connections: gauge!("edgemeta_broker_connections"),
            denied_publishes: counter!("edgemeta_acl_denials_total", "kind" => "publish"),
            denied_subscribes: counter!("edgemeta_acl_denials_total", "kind" => "subscribe"),
            lagging_cut: counter!("edgemeta_broker_lagging_subscribers_disconnected_total"),
            away_dropped: counter!("edgemeta_broker_away_dropped_total"),
            read_buffers_refused: counter!("edgemeta_broker_read_buffers_refused_total"),
            slow_packets: counter!("edgemeta_broker_slow_packets_total"),
            sessions: gauge!("edgemeta_broker_sessions"),
            paused_publishers: gauge!("edgemeta_broker_paused_publishers"),
            publisher_pauses: counter!("edgemeta_broker_publisher_pauses_total"),
            handon_waiting: gauge!("edgemeta_handon_waiting"),
            listeners_up: gauge!("edgemeta_listeners_up"),
            stages: Stage::ALL
                .iter()
                .map(|&stage| {
                    let counter =
                        counter!("edgemeta_stage_nanoseconds_total", "stage" => stage.name());
                    (stage, counter)
                })
                .collect(),
        }
    }
}

/// Where the endpoints read the node's state.
pub struct Sources {
    pub outbox: OutboxHandle,
    pub broker: BrokerStats,
    /// Hand-ons committed and not yet handed to the broker.
    pub handons: Arc<edgemeta_metamanager::HandonGauge>,
    /// `None` when the cloud bridge is off.
    pub cloud: Option<Arc<CloudStatus>>,
    /// Set once every MQTT listener accepts, cleared when the node starts to stop.
    pub listeners_up: Arc<AtomicBool>,
    pub store_path: PathBuf,
    pub max_outbox_age: Duration,
}

struct Node {
    registry: Registry,
    sources: Sources,
}

/// Binds `observe.address`; a failure stops start-up, naming the address.
pub async fn bind(config: &ObserveConfig) -> anyhow::Result<TcpListener> {
    use anyhow::Context as _;
    TcpListener::bind(config.address)
        .await
        .with_context(|| format!("binding the observe listener {}", config.address))
}

/// Serves the endpoints until `cancel`; returns once the server has stopped (within
/// [`STOP_GRACE`], so an open scrape cannot hold shutdown up).
pub async fn serve(
    listener: TcpListener,
    registry: Registry,
    sources: Sources,
    cancel: CancellationToken,
) {
    let node = Arc::new(Node { registry, sources });
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(node.clone());
    let tick = move || drop(node.registry.handle.render());
    serve_app(
        listener,
        app,
        cancel,
        "EM-OBSERVE-SERVE",
        Some((DRAIN_EVERY, tick)),
    )
    .await;
}

/// Serves `app` on `listener` until `cancel`, running `tick` every period meanwhile; then open
/// requests get [`STOP_GRACE`] before the server is aborted, so none can hold shutdown up. A
/// server that fails is logged with `error_code`.
pub async fn serve_app(
    listener: TcpListener,
    app: Router,
    cancel: CancellationToken,
    error_code: &'static str,
    tick: Option<(Duration, impl FnMut())>,
) {
    let stop = cancel.clone();
    let mut server = tokio::spawn(async move {
        // Nagle off: a watch event or an answer leaves at once, not after the peer's delayed ACK.
        axum::serve(listener, app)
            .tcp_nodelay(true)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    });
    let (period, mut tick) = match tick {
        Some((period, tick)) => (Some(period), Some(tick)),
        None => (None, None),
    };
    let mut ticks = tokio::time::interval(period.unwrap_or(Duration::from_secs(3600)));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = ticks.tick() => if let Some(tick) = tick.as_mut() { tick() },
            served = &mut server => {
                report(served, error_code);
                return;
            }
        }
    }
    match tokio::time::timeout(STOP_GRACE, &mut server).await {
        Ok(served) => report(served, error_code),
        Err(_) => server.abort(),
    }
}

fn report(served: Result<std::io::Result<()>, tokio::task::JoinError>, error_code: &'static str) {
    match served {
        Ok(Ok(())) => {}
        Ok(Err(e)) => error!(error_code, error = %e, "HTTP listener failed"),
        Err(e) => error!(error_code, error = %e, "HTTP listener panicked"),
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn metrics(State(node): State<Arc<Node>>) -> Response {
    let s = &node.registry.scraped;
    let src = &node.sources;
    if let Some(stats) = outbox_stats(&src.outbox).await {
        s.outbox_entries.set(stats.entries as f64);
        s.outbox_bytes.set(stats.bytes as f64);
        s.outbox_oldest_age.set(oldest_age_s(&stats).unwrap_or(0.0));
    }
    s.store_bytes.set(store_bytes(&src.store_path) as f64);
    if let Some(cloud) = &src.cloud {
        s.cloud_connected
            .set(f64::from(u8::from(cloud.connected())));
        s.cloud_reconnects.absolute(cloud.reconnects());
        s.cloud_down.absolute(cloud.down_applied());
    }
    s.connections.set(src.broker.connections() as f64);
    let (publishes, subscribes) = src.broker.denials();
    s.denied_publishes.absolute(publishes);
    s.denied_subscribes.absolute(subscribes);
    s.lagging_cut.absolute(src.broker.lagging_subscribers_cut());
    s.away_dropped.absolute(src.broker.away_dropped());
    s.read_buffers_refused
        .absolute(src.broker.read_buffers_refused());
    s.slow_packets.absolute(src.broker.slow_packets());
    s.sessions.set(src.broker.sessions() as f64);
    let (paused, pauses) = src.broker.paused_publishers();
    s.paused_publishers.set(paused as f64);
    s.publisher_pauses.absolute(pauses);
    s.handon_waiting.set(src.handons.waiting() as f64);
    for (stage, counter) in &s.stages {
        counter.absolute(stage.nanos());
    }
    s.listeners_up.set(f64::from(u8::from(
        src.listeners_up.load(Ordering::Relaxed),
    )));
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        node.registry.handle.render(),
    )
        .into_response()
}

async fn readyz(State(node): State<Arc<Node>>) -> Response {
    let (ready, body) = readiness(&node).await;
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Every check with whether it passed and why; ready when all passed.
async fn readiness(node: &Node) -> (bool, Value) {
    let src = &node.sources;
    let mut checks = serde_json::Map::new();
    let mut check = |name: &str, ok: bool, detail: String| {
        checks.insert(name.to_owned(), json!({ "ok": ok, "detail": detail }));
    };
    let stats = outbox_stats(&src.outbox).await;
    let failing = node.registry.meters.store_failing();
    let (ok, detail) = match (&stats, failing) {
        (Some(_), false) => (true, "answering; last commit succeeded".to_owned()),
        (Some(_), true) => (false, "the last batch failed to commit".to_owned()),
        (None, _) => (false, format!("no answer within {STORE_ANSWER:?}")),
    };
    check("store", ok, detail);
    let up = src.listeners_up.load(Ordering::Relaxed);
    check(
        "listeners",
        up,
        if up { "accepting" } else { "not accepting" }.to_owned(),
    );
    let age = stats.as_ref().and_then(oldest_age_s);
    if let Some(cloud) = &src.cloud {
        let connected = cloud.connected();
        check(
            "cloud_connected",
            connected,
            if connected {
                "connected"
            } else {
                "not connected"
            }
            .to_owned(),
        );
        let limit = src.max_outbox_age.as_secs_f64();
        let (ok, detail) = match (&stats, age) {
            (None, _) => (false, "outbox unknown: the store did not answer".to_owned()),
            (Some(_), None) => (true, "outbox empty".to_owned()),
            (Some(_), Some(age)) if age <= limit => (
                true,
                format!("oldest entry {age:.1} s old (limit {limit} s)"),
            ),
            (Some(_), Some(age)) => (
                false,
                format!("oldest entry {age:.1} s old, over the limit of {limit} s: not syncing"),
            ),
        };
        check("outbox_age", ok, detail);
    }
    let failed: Vec<String> = checks
        .iter()
        .filter(|(_, c)| c["ok"] != Value::Bool(true))
        .map(|(name, _)| name.clone())
        .collect();
    let ready = failed.is_empty();
    let body = json!({
        "ready": ready,
        "failed": failed,
        "checks": checks,
        "cloud": src.cloud.as_ref().map(|c| json!({ "connected": c.connected() })),
        "outbox": stats.map(|s| json!({
            "entries": s.entries,
            "bytes": s.bytes,
            "oldest_age_s": age,
        })),
    });
    (ready, body)
}

async fn outbox_stats(outbox: &OutboxHandle) -> Option<OutboxStats> {
    tokio::time::timeout(STORE_ANSWER, outbox.summary())
        .await
        .ok()
        .and_then(Result::ok)
}

fn oldest_age_s(stats: &OutboxStats) -> Option<f64> {
    let now = edgemeta_protocol::now_ms();
    stats
        .oldest_ms
        .map(|t| now.saturating_sub(t).max(0) as f64 / 1000.0)
}

/// The store file and its WAL, in bytes.
fn store_bytes(path: &std::path::Path) -> u64 {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    [path.to_path_buf(), PathBuf::from(wal)]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `"EM-…"` literal in the workspace's sources, so a new code gets its counter.
    fn codes_in_sources() -> Vec<String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut dirs: Vec<PathBuf> = ["src", "broker/src", "metamanager/src", "bridges/src"]
            .iter()
            .map(|d| root.join(d))
            .collect();
        let mut codes = Vec::new();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("source dir").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).expect("source");
                    for piece in text.split("\"EM-").skip(1) {
                        let code = piece.split('"').next().unwrap_or_default();
                        if !code.is_empty()
                            && code
                                .chars()
                                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '-')
                        {
                            codes.push(format!("EM-{code}"));
                        }
                    }
                }
            }
        }
        codes
    }

    #[test]
    fn every_error_code_in_the_sources_has_its_own_counter() {
        for code in codes_in_sources() {
            assert!(
                ERROR_CODES.contains(&code.as_str()),
                "{code} is not in ERROR_CODES"
            );
        }
    }

    #[test]
    fn every_counted_code_is_documented_in_architecture() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ARCHITECTURE.md"))
            .expect("ARCHITECTURE.md");
        for code in ERROR_CODES {
            assert!(
                doc.contains(&format!("`{code}`")),
                "{code} missing in ARCHITECTURE.md"
            );
        }
    }
}
