//! The node seen by an operator: `/metrics` during a burst (parsed as Prometheus text), `/readyz`
//! going red when the cloud is away with messages queued and green once the outbox drains,
//! `edgemeta get` and `edgemeta status` against a running node, and the README's "Monitor the
//! node" commands run verbatim.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cloud::{bridged_with, queue_pod_statuses, CONNECTION};
use common::{
    assert_quiet_for, free_port, http_get, readme_section_commands, run_expecting_exit, send,
    wait_until, CloudBroker, CloudOptions, Node, Options, WAIT,
};
use serde_json::{json, Value};

/// A scrape of `/metrics`, parsed: every sample by name and sorted labels.
struct Scrape(HashMap<(String, Vec<(String, String)>), f64>);

impl Scrape {
    async fn of(node: &Node) -> Scrape {
        let (status, body) = http_get(node.observe_port, "/metrics").await;
        assert_eq!(status, 200, "{body}");
        let parsed = prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
            .expect("Prometheus text exposition");
        let mut samples = HashMap::new();
        for sample in parsed.samples {
            let value = match sample.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                prometheus_parse::Value::Histogram(buckets) => {
                    // The count is the +Inf bucket.
                    buckets.last().map_or(0.0, |b| b.count)
                }
                prometheus_parse::Value::Summary(_) => continue,
            };
            let mut labels: Vec<(String, String)> = sample
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            labels.sort();
            samples.insert((sample.metric, labels), value);
        }
        Scrape(samples)
    }

    /// The sample `name{labels}`; 0 when absent.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        self.0
            .get(&(name.to_owned(), labels))
            .copied()
            .unwrap_or(0.0)
    }

    fn has(&self, name: &str) -> bool {
        self.0.keys().any(|(n, _)| n == name)
    }

    fn messages(&self, operation: &str, result: &str) -> f64 {
        self.get(
            "edgemeta_messages_total",
            &[("operation", operation), ("result", result)],
        )
    }
}

#[tokio::test]
async fn metrics_count_a_burst_by_operation_result_and_error_code() {
    const INSERTS: usize = 300;
    const MALFORMED: usize = 7;
    let node = Node::start().await;
    let (status, body) = http_get(node.observe_port, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    let before = Scrape::of(&node).await;
    for name in [
        "edgemeta_messages_total",
        "edgemeta_errors_total",
        "edgemeta_outbox_entries",
        "edgemeta_outbox_bytes",
        "edgemeta_outbox_oldest_age_seconds",
        "edgemeta_store_bytes",
        "edgemeta_broker_connections",
        "edgemeta_acl_denials_total",
        "edgemeta_broker_lagging_subscribers_disconnected_total",
        "edgemeta_broker_away_dropped_total",
        "edgemeta_broker_sessions",
        "edgemeta_broker_paused_publishers",
        "edgemeta_broker_publisher_pauses_total",
        "edgemeta_handon_waiting",
        "edgemeta_cloud_connected",
        "edgemeta_cloud_reconnects_total",
        "edgemeta_cloud_down_messages_total",
    ] {
        assert!(before.has(name), "{name} is exposed from the start");
    }
    // Pre-registered: a code that never happened reads 0, not absent.
    assert!(before.0.contains_key(&(
        "edgemeta_errors_total".to_owned(),
        vec![("error_code".to_owned(), "EM-STORE-COMMIT".to_owned())]
    )));

    let client = node.client().await;
    // Scrapes during the burst: each parses, and the count never goes down.
    let scraper = {
        let port = node.observe_port;
        tokio::spawn(async move {
            let mut last = 0.0;
            let mut scrapes = 0;
            let started = Instant::now();
            while started.elapsed() < Duration::from_millis(1500) {
                let (_, body) = http_get(port, "/metrics").await;
                let parsed =
                    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
                        .expect("parses during the burst");
                let ok = parsed
                    .samples
                    .iter()
                    .find(|s| {
                        s.metric == "edgemeta_messages_total"
                            && s.labels.get("operation") == Some("insert")
                            && s.labels.get("result") == Some("ok")
                    })
                    .map(|s| match s.value {
                        prometheus_parse::Value::Counter(v) => v,
                        _ => panic!("a counter"),
                    })
                    .expect("insert/ok series");
                assert!(ok >= last, "a counter went down: {last} → {ok}");
                last = ok;
                scrapes += 1;
                // pacing: scrapes spread over the burst.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            scrapes
        })
    };
    for i in 0..INSERTS {
        send(
            &client,
            "edgecontroller",
            "insert",
            &format!("default/pod/burst-{i}"),
            json!({"metadata": {"name": format!("burst-{i}")}}),
        )
        .await;
        if i % 50 == 0 {
            client
                .publish("ke/meta/edged/insert/default/pod", "{\"oops")
                .await;
        }
    }
    for _ in 0..MALFORMED - (INSERTS / 50) {
        client
            .publish("ke/meta/edged/insert/default/pod", "{\"oops")
            .await;
    }
    let counted = |after: &Scrape| {
        (
            after.messages("insert", "ok") - before.messages("insert", "ok"),
            after.messages("insert", "refused") - before.messages("insert", "refused"),
        )
    };
    wait_until("the burst all counted", WAIT, async || {
        let (ok, refused) = counted(&Scrape::of(&node).await);
        if ok >= INSERTS as f64 && refused >= MALFORMED as f64 {
            Ok(())
        } else {
            Err(format!("{ok} ok, {refused} refused"))
        }
    })
    .await;
    assert!(scraper.await.expect("scraper") > 3);
    // Nothing more than what was sent, once it has settled.
    assert_quiet_for(
        "more counted than was sent",
        Duration::from_millis(300),
        async || {
            let (ok, refused) = counted(&Scrape::of(&node).await);
            (ok != INSERTS as f64 || refused != MALFORMED as f64)
                .then(|| format!("{ok} ok, {refused} refused"))
        },
    )
    .await;
    let after = Scrape::of(&node).await;
    let delta =
        |name: &str, labels: &[(&str, &str)]| after.get(name, labels) - before.get(name, labels);
    assert_eq!(
        after.messages("insert", "ok") - before.messages("insert", "ok"),
        INSERTS as f64
    );
    assert_eq!(
        after.messages("insert", "refused") - before.messages("insert", "refused"),
        MALFORMED as f64
    );
    assert_eq!(after.messages("insert", "failed"), 0.0);
    assert_eq!(
        delta("edgemeta_errors_total", &[("error_code", "EM-META-JSON")]),
        MALFORMED as f64
    );
    assert_eq!(
        delta(
            "edgemeta_errors_total",
            &[("error_code", "EM-STORE-COMMIT")]
        ),
        0.0
    );
    // Group commit: at least one commit, at most one per message (plus the relay's).
    let commits = delta("edgemeta_store_commit_seconds", &[]);
    assert!(commits >= 1.0, "commits counted: {commits}");
    assert!(after.get("edgemeta_store_bytes", &[]) > 0.0);
    assert!(after.get("edgemeta_broker_connections", &[]) >= 1.0);
    assert_eq!(after.get("edgemeta_outbox_entries", &[]), 0.0);
    assert_eq!(after.get("edgemeta_listeners_up", &[]), 1.0);
}

/// `/readyz`: status and the JSON body.
async fn readyz(node: &Node) -> (u16, Value) {
    let (status, body) = http_get(node.observe_port, "/readyz").await;
    let json = serde_json::from_str(&body).unwrap_or_else(|_| panic!("JSON: {body}"));
    (status, json)
}

fn failed(body: &Value) -> Vec<String> {
    body["failed"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn readyz_goes_red_while_the_outbox_waits_too_long_and_green_once_it_drains() {
    let mut cloud = CloudBroker::start().await;
    let (node, _bridge) = bridged_with(
        &cloud,
        Options {
            max_outbox_age_s: 2,
            ..Options::default()
        },
    )
    .await;
    wait_until("ready with the cloud connected", WAIT, || async {
        readyz(&node).await.0 == 200
    })
    .await;
    let (_, body) = readyz(&node).await;
    assert_eq!(
        body["checks"]["cloud_connected"]["ok"],
        json!(true),
        "{body}"
    );
    assert_eq!(body["checks"]["outbox_age"]["ok"], json!(true), "{body}");

    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    cloud.stop();
    watcher.expect(CONNECTION).await;
    // edged's pod status updates go to the cloud: they queue in the outbox.
    queue_pod_statuses(&node, 5).await;
    let (status, body) = readyz(&node).await;
    assert_eq!(status, 503, "{body}");
    assert!(
        failed(&body).contains(&"cloud_connected".to_owned()),
        "{body}"
    );
    // Once the oldest entry is older than max_outbox_age_s, the outbox check fails too.
    wait_until("the outbox check to fail", WAIT, || async {
        let (status, body) = readyz(&node).await;
        status == 503 && failed(&body).contains(&"outbox_age".to_owned())
    })
    .await;
    let (_, body) = readyz(&node).await;
    assert_eq!(body["checks"]["outbox_age"]["ok"], json!(false), "{body}");
    assert!(
        body["checks"]["outbox_age"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("not syncing")),
        "{body}"
    );
    assert_eq!(body["outbox"]["entries"], json!(5), "{body}");
    let scrape = Scrape::of(&node).await;
    assert_eq!(scrape.get("edgemeta_cloud_connected", &[]), 0.0);
    assert_eq!(scrape.get("edgemeta_outbox_entries", &[]), 5.0);
    assert!(scrape.get("edgemeta_outbox_oldest_age_seconds", &[]) >= 2.0);

    cloud.restart().await;
    wait_until("ready again once the outbox drained", WAIT, || async {
        readyz(&node).await.0 == 200
    })
    .await;
    let (_, body) = readyz(&node).await;
    assert_eq!(body["outbox"]["entries"], json!(0), "{body}");
    assert_eq!(node.outbox_len().await, 0);
    let scrape = Scrape::of(&node).await;
    assert_eq!(scrape.get("edgemeta_cloud_connected", &[]), 1.0);
    assert!(scrape.get("edgemeta_cloud_reconnects_total", &[]) >= 1.0);
    assert!(
        scrape.get(
            "edgemeta_errors_total",
            &[("error_code", "EM-BRIDGE-DISCONNECTED")]
        ) >= 1.0
    );
}

/// Runs the node's binary with `args`.
fn edgemeta(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_edgemeta"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run edgemeta")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn edgemeta_get_reads_the_store_of_a_running_node() {
    let node = Node::start().await;
    let client = node.client().await;
    for name in ["web", "db_1"] {
        send(
            &client,
            "edgecontroller",
            "insert",
            &format!("default/pod/{name}"),
            json!({"metadata": {"name": name}, "spec": {"image": "nginx"}}),
        )
        .await;
    }
    // Another type and namespace, which a listing must leave out.
    send(
        &client,
        "edgecontroller",
        "insert",
        "other/pod/web",
        json!({"metadata": {"name": "web"}}),
    )
    .await;
    wait_until("stored", WAIT, || async {
        node.stored("default/pod/db_1").await.is_some()
            && node.stored("other/pod/web").await.is_some()
    })
    .await;
    let config = node.config_path();
    let config = config.to_str().expect("UTF-8 path");

    let out = edgemeta(&["get", "default/pod", "--config", config]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    let lines: Vec<Vec<&str>> = table
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines[0], ["NAMESPACE", "TYPE", "NAME", "SIZE"], "{table}");
    let web_size = node
        .stored("default/pod/web")
        .await
        .expect("web")
        .len()
        .to_string();
    assert_eq!(lines.len(), 3, "{table}");
    assert_eq!(lines[1], ["default", "pod", "db_1", lines[1][3]], "{table}");
    assert_eq!(
        lines[2],
        ["default", "pod", "web", web_size.as_str()],
        "{table}"
    );

    let out = edgemeta(&["get", "default/pod", "-o", "json", "--config", config]);
    assert!(out.status.success());
    let docs: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(docs.as_array().map(Vec::len), Some(2), "{docs}");
    assert_eq!(docs[1]["metadata"]["name"], json!("web"));

    let out = edgemeta(&["get", "default/pod/web", "-o", "json", "--config", config]);
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(doc["spec"]["image"], json!("nginx"), "{doc}");

    let out = edgemeta(&["get", "default/pod/web", "-o", "yaml", "--config", config]);
    assert!(out.status.success());
    let yaml = text(&out.stdout);
    assert!(
        yaml.contains("name: web") && yaml.contains("image: nginx"),
        "{yaml}"
    );

    let out = edgemeta(&["get", "default/pod/missing", "--config", config]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("not found"));
    let out = edgemeta(&["get", "default/service", "--config", config]);
    assert!(out.status.success(), "an empty list is not an error");
    let out = edgemeta(&["get", "nonsense", "--config", config]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("<namespace>/<type>"),
        "{}",
        text(&out.stderr)
    );

    // Read-only: the node's store is unchanged and the node keeps writing.
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/after",
        json!({"metadata": {"name": "after"}}),
    )
    .await;
    wait_until("written after the reads", WAIT, || async {
        node.stored("default/pod/after").await.is_some()
    })
    .await;
}

#[tokio::test]
async fn edgemeta_status_exits_0_when_ready_and_1_when_not_or_unreachable() {
    let mut node = Node::start().await;
    let config = node.config_path().to_str().expect("UTF-8").to_owned();
    let out = edgemeta(&["status", "--config", &config]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}{}", text(&out.stderr));
    assert!(stdout.contains("READY"), "{stdout}");
    assert!(
        stdout.contains(&format!("mqtt 127.0.0.1:{} (up)", node.port)),
        "{stdout}"
    );
    assert!(stdout.contains("cloud       disabled"), "{stdout}");
    assert!(stdout.contains("outbox      0 entries"), "{stdout}");
    assert!(stdout.contains("connections "), "{stdout}");

    // A cloud nobody answers: not ready, and the failing check is named.
    let cut_off = Node::start_with(Options {
        cloud: Some(CloudOptions {
            port: free_port(),
            node_id: common::unique_id("node"),
            backoff_min_ms: 50,
            backoff_max_ms: 200,
        }),
        ..Options::default()
    })
    .await;
    let cut_config = cut_off.config_path().to_str().expect("UTF-8").to_owned();
    let out = edgemeta(&["status", "--config", &cut_config]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("NOT READY"), "{stdout}");
    assert!(stdout.contains("cloud_connected: FAILED"), "{stdout}");

    // A node that is not running.
    let _ = node.terminate();
    let out = edgemeta(&["status", "--config", &config]);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("UNREACHABLE"), "{stdout}");
}

#[tokio::test]
async fn the_observe_listener_cannot_bind_and_start_up_stops_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    let (status, printed) = run_expecting_exit(
        &format!(
            "broker:\n  listeners:\n    mqtt:\n      address: 127.0.0.1:{}\nstore:\n  path: store.db\n",
            free_port()
        ),
        &[("EDGEMETA_OBSERVE__ADDRESS", address.as_str())],
    );
    assert_eq!(status.code(), Some(1), "{printed}");
    assert!(
        printed.contains(&format!("binding the observe listener {address}")),
        "{printed}"
    );
}

#[tokio::test]
async fn the_readme_monitoring_commands_work_verbatim() {
    // A node as the README runs it: the embedded default configuration in its own directory,
    // moved to free ports through the environment, as its Configuration section describes.
    let mut node = Node::start_with(Options {
        embedded_config: true,
        ..Options::default()
    })
    .await;
    let (dir, env, observe) = (node.dir().to_owned(), node.env(), node.observe_port);
    // The walkthrough's pod, which the section's `get` lines look at.
    let client = node.client().await;
    client
        .publish(
            "ke/meta/edgecontroller/insert/default/pod",
            r#"{"metadata":{"name":"nginx"}}"#,
        )
        .await;
    let db = node.db_path();
    wait_until("nginx stored", WAIT, || async {
        edgemeta_get_finds(&db, &dir, &env)
    })
    .await;

    let commands = readme_section_commands("Monitor the node");
    assert!(commands.len() >= 4, "{commands:?}");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_edgemeta"))
        .parent()
        .expect("binary directory");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut outputs = Vec::new();
    for command in &commands {
        let line = command.replace("9464", &observe.to_string());
        let out = Command::new("sh")
            .args(["-c", &line])
            .current_dir(&dir)
            .envs(env.clone())
            .env("PATH", &path)
            .stdin(Stdio::null())
            .output()
            .expect("sh");
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "`{command}` failed: {stdout}{}",
            text(&out.stderr)
        );
        outputs.push((command.clone(), stdout));
    }
    node.kill9();
    let all: String = outputs.iter().map(|(_, o)| o.as_str()).collect();
    assert!(all.contains(r#""ready":true"#), "{outputs:?}");
    assert!(all.contains("edgemeta_messages_total"), "{outputs:?}");
    assert!(all.contains("nginx"), "{outputs:?}");
    assert!(all.contains("READY"), "{outputs:?}");
}

/// Whether `edgemeta get default/pod/nginx` finds the pod in `db`'s directory.
fn edgemeta_get_finds(db: &Path, dir: &Path, env: &[(String, String)]) -> bool {
    db.exists()
        && Command::new(env!("CARGO_BIN_EXE_edgemeta"))
            .args(["get", "default/pod/nginx"])
            .current_dir(dir)
            .envs(env.iter().cloned())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

#[tokio::test]
async fn device_messages_are_counted_by_kind_and_result() {
    let node = Node::start().await;
    let client = node.client().await;
    // The devicecontroller adds a device (as the cloud would, here published locally).
    let membership = serde_json::json!({
        "header": {"msg_id": "m-1", "timestamp": 1},
        "route": {"source": "devicecontroller", "group": "twin", "operation": "update",
                  "resource": "node/membership"},
        "content": {"event_id": "e-1", "timestamp": 1,
                    "added_devices": [{"id": "meter-1", "name": "meter-1"}]}
    });
    client
        .publish(
            "ke/meta/devicecontroller/update/node/membership",
            membership.to_string(),
        )
        .await;
    let report =
        r#"{"event_id":"r-1","twin":{"power":{"actual":{"value":"5"},"metadata":{"type":"int"}}}}"#;
    client
        .publish("$hw/events/device/meter-1/twin/update", report)
        .await;
    client
        .publish("$hw/events/device/meter-1/twin/update", "{not json")
        .await;
    client
        .publish("$hw/events/device/nobody/twin/get", r#"{"event_id":"g"}"#)
        .await;
    let device = |scrape: &Scrape, kind: &str, result: &str| {
        scrape.get(
            "edgemeta_device_messages_total",
            &[("kind", kind), ("result", result)],
        )
    };
    wait_until("four device messages counted", WAIT, || async {
        let scrape = Scrape::of(&node).await;
        device(&scrape, "cloud_membership", "ok") == 1.0
            && device(&scrape, "twin_update", "ok") == 1.0
            && device(&scrape, "twin_update", "refused") == 1.0
            && device(&scrape, "twin_get", "refused") == 1.0
    })
    .await;
    let scrape = Scrape::of(&node).await;
    assert_eq!(
        scrape.get(
            "edgemeta_errors_total",
            &[("error_code", "EM-DEVICE-REFUSED")]
        ),
        2.0
    );
    assert_eq!(
        scrape.messages("update", "ok"),
        0.0,
        "not counted as MetaManager operations"
    );
}
