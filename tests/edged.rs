//! edged end to end: the real `edgemeta run` node, the real `edgemeta edged` agent running real
//! processes (`sh` scripts the tests write), real MQTT, and a real mosquitto as the cloud.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cloud::{bridged, cloud_client, cloud_insert};
use common::edged::Edged;
use common::{
    envelope, send, shell_words, topic, unique_id, wait_until, Client, CloudBroker, Node, WAIT,
};
use serde_json::{json, Value};

/// Pod statuses may take a few restarts and the rate limit to arrive.
const STATUS_WAIT: Duration = Duration::from_secs(20);

/// A pod running `script` under `sh -c`, with `spec` merged into its spec.
fn pod(name: &str, script: &str, spec: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script]}]},
    });
    if let (Some(base), Value::Object(extra)) = (pod["spec"].as_object_mut(), spec) {
        for (k, v) in extra {
            base.insert(k, v);
        }
    }
    pod
}

/// The next `podstatus` of pod `name` (on the topic under `prefix`) whose `Status` satisfies
/// `ok`; fails with the last one seen.
async fn await_status(
    client: &mut Client,
    prefix: &str,
    name: &str,
    ok: impl Fn(&Value) -> bool,
) -> Value {
    let resource = format!("default/podstatus/{name}");
    let topic = topic(prefix, &resource);
    let deadline = Instant::now() + STATUS_WAIT;
    let mut last = Value::Null;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        // `next` itself fails after the harness's wait without any message at all.
        let Ok(m) = tokio::time::timeout(left, client.next()).await else {
            panic!("no matching status of {name} on {topic} within {STATUS_WAIT:?}; last: {last}");
        };
        if m.topic == topic && m.resource() == resource {
            let status = m.content()["Status"].clone();
            if ok(&status) {
                return status;
            }
            last = status;
        }
    }
}

/// Waits until every pod of `names` has reported Running on the topic under `prefix`.
async fn await_all_running(client: &mut Client, prefix: &str, names: &[&str]) {
    let mut waiting: std::collections::BTreeSet<String> = names
        .iter()
        .map(|n| format!("default/podstatus/{n}"))
        .collect();
    let topic = format!("{prefix}/default/podstatus");
    let deadline = Instant::now() + STATUS_WAIT;
    while !waiting.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(m) = tokio::time::timeout(left, client.next()).await else {
            panic!("not Running within {STATUS_WAIT:?}: {waiting:?}");
        };
        if m.topic == topic && phase(&m.content()["Status"]) == "Running" {
            waiting.remove(&m.resource());
        }
    }
}

fn phase(status: &Value) -> &str {
    status["phase"].as_str().unwrap_or_default()
}

fn container(status: &Value) -> &Value {
    &status["containerStatuses"][0]
}

/// Waits until `path` exists and holds text; returns it.
async fn await_file(path: &Path) -> String {
    wait_until(
        format_args!("{} written", path.display()),
        STATUS_WAIT,
        || {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            std::future::ready((!text.trim().is_empty()).then_some(text))
        },
    )
    .await
}

/// Waits (at most `limit`) until `path` holds `wanted` (`count` times at least).
async fn await_text(path: &Path, wanted: &str, count: usize, limit: Duration) {
    wait_until(
        format_args!("{wanted:?} ×{count} in {}", path.display()),
        limit,
        || {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            std::future::ready(if text.matches(wanted).count() >= count {
                Ok(())
            } else {
                Err(text)
            })
        },
    )
    .await;
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
}

async fn await_dead(pid: u32, limit: Duration) -> Duration {
    let started = Instant::now();
    wait_until(format_args!("process {pid} gone"), limit, || {
        std::future::ready(!alive(pid))
    })
    .await;
    started.elapsed()
}

/// Where a pod script records its pid: in `dir`, one file per start. (`$$$$`: Kubernetes'
/// `$(VAR)` expansion of commands reduces `$$` to `$`.)
fn pid_script(dir: &Path, name: &str, then: &str) -> String {
    format!("echo $$$$ > {}/{name}.pid; {then}", dir.display())
}

fn read_pid(text: &str) -> u32 {
    text.trim().parse().expect("a pid")
}

#[tokio::test]
async fn a_pod_from_the_cloud_runs_with_its_config_and_reports_running_to_the_cloud() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up_filter()).await;
    let marks = tempfile::tempdir().expect("dir");
    let edged = Edged::start(&node, &[]);
    // Configuration first, as the cloud's edgecontroller sends it.
    cloud_insert(
        &controller,
        &bridge,
        "default/configmap/app",
        json!({"metadata": {"name": "app"}, "data": {"mode": "eco", "level": "3"}}),
    )
    .await;
    cloud_insert(
        &controller,
        &bridge,
        "default/secret/creds",
        json!({"metadata": {"name": "creds"}, "data": {"password": "aHVudGVyMg=="}}),
    )
    .await;
    let script = pid_script(
        marks.path(),
        "web",
        "echo MODE=$MODE LEVEL=$APP_level PW=$PW; cat $EDGED_VOLUME_CONF/mode; echo; cat $EDGED_VOLUME_CREDS/password; echo; pwd; trap '' TERM; while true; do sleep 0.1; done",
    );
    let web = pod(
        "web",
        &script,
        json!({
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "busybox", "command": ["sh", "-c", script],
                "workingDir": "work",
                "env": [{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "app", "key": "mode"}}},
                        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}}],
                "envFrom": [{"configMapRef": {"name": "app"}, "prefix": "APP_"}],
                "volumeMounts": [{"name": "conf", "mountPath": "/etc/app"}, {"name": "creds", "mountPath": "/etc/creds"}]}],
            "volumes": [{"name": "conf", "configMap": {"name": "app"}}, {"name": "creds", "secret": {"secretName": "creds"}}],
        }),
    );
    cloud_insert(&controller, &bridge, "default/pod/web", web).await;

    let up = bridge.up("edged/update");
    let running = await_status(&mut controller, &up, "web", |s| phase(s) == "Running").await;
    assert_eq!(container(&running)["ready"], true, "{running}");
    assert!(
        container(&running)["state"]["running"]["startedAt"].is_string(),
        "{running}"
    );
    assert_eq!(
        running["conditions"][3],
        json!({"type": "Ready", "status": "True"})
    );
    let pid = read_pid(&await_file(&marks.path().join("web.pid")).await);
    let log_path = edged.pod_dir("web").join("logs/main.log");
    await_file(&log_path).await;
    await_text(&log_path, "/work", 1, WAIT).await;
    let log = std::fs::read_to_string(&log_path).expect("log");
    assert!(log.contains("MODE=eco LEVEL=3 PW=hunter2"), "{log}");
    // The CRI log format kubelet reads: `<time> <stream> <F|P> <line>`.
    assert!(
        log.contains(" stdout F eco\n") && log.contains(" stdout F hunter2\n"),
        "{log}"
    );
    assert!(
        log.contains(&format!("{}/work", edged.pod_dir("web").display())),
        "{log}"
    );

    // Delete: SIGTERM is ignored by the script, so SIGKILL after the 1 s grace period.
    let (_, payload) = envelope("edgecontroller", "delete", "default/pod/web", Value::Null);
    controller
        .publish(&bridge.down("edgecontroller/delete/default/pod"), payload)
        .await;
    let took = await_dead(pid, Duration::from_secs(5)).await;
    assert!(
        took >= Duration::from_millis(700),
        "killed before its grace period: {took:?}"
    );
    // edged reports the removal up, as KubeEdge's edged does.
    let removed = controller
        .expect_about(&bridge.up("edged/delete"), "default/pod/web")
        .await;
    assert_eq!(removed.source(), "edged");
}

#[tokio::test]
async fn a_crashing_container_restarts_with_back_off_and_its_restart_count_reaches_the_cloud() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up_filter()).await;
    let marks = tempfile::tempdir().expect("dir");
    let _edged = Edged::start(&node, &[]);
    let script = format!("date +%s%N >> {}/starts; exit 3", marks.path().display());
    cloud_insert(
        &controller,
        &bridge,
        "default/pod/crash",
        pod("crash", &script, json!({})),
    )
    .await;
    let status = await_status(&mut controller, &bridge.up("edged/update"), "crash", |s| {
        container(s)["restartCount"].as_u64() >= Some(3)
    })
    .await;
    let c = container(&status);
    assert_eq!(c["lastState"]["terminated"]["exitCode"], 3, "{status}");
    assert_eq!(phase(&status), "Running", "restartPolicy Always: {status}");
    // Starts at t0, +300 ms, +600 ms, +1200 ms: each gap at least the back-off. The fourth
    // start is counted once its process is spawned, which can be before its script has run.
    let read_starts = || -> Vec<u128> {
        std::fs::read_to_string(marks.path().join("starts"))
            .expect("starts")
            .lines()
            .map(|l| l.trim().parse().expect("nanoseconds"))
            .collect()
    };
    let starts = wait_until("four starts recorded", WAIT, || {
        let starts = read_starts();
        std::future::ready(if starts.len() >= 4 {
            Ok(starts)
        } else {
            Err(format!("{starts:?}"))
        })
    })
    .await;
    let gaps: Vec<u128> = starts
        .windows(2)
        .map(|w| (w[1] - w[0]) / 1_000_000)
        .collect();
    for (i, want) in [300u128, 600, 1200].iter().enumerate() {
        assert!(
            gaps[i] >= want - 50,
            "gap {i} is {} ms, want ≥ {want}: {gaps:?}",
            gaps[i]
        );
    }
}

#[tokio::test]
async fn bad_pods_get_a_reason_and_edged_keeps_running() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/meta/edged/update/+/podstatus").await;
    let mut edged = Edged::start(&node, &[]);
    let client = node.client().await;
    let prefix = "ke/meta/edged/update";
    let insert = |name: &str, pod: Value| {
        let resource = format!("default/pod/{name}");
        let client = &client;
        async move { send(client, "edgecontroller", "insert", &resource, pod).await }
    };

    insert(
        "empty",
        json!({"metadata": {"name": "empty"}, "spec": {"containers": []}}),
    )
    .await;
    let s = await_status(&mut watcher, prefix, "empty", |s| phase(s) == "Failed").await;
    assert_eq!(s["reason"], "InvalidPodSpec");
    assert!(
        s["message"]
            .as_str()
            .unwrap_or_default()
            .contains("no containers"),
        "{s}"
    );

    let needs = json!({"containers": [{"name": "main", "command": ["sh", "-c", "echo $X; sleep 60"],
        "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "later", "key": "x"}}}]}]});
    insert("needs", pod("needs", "", needs)).await;
    let s = await_status(&mut watcher, prefix, "needs", |s| {
        container(s)["state"]["waiting"]["reason"] == "CreateContainerConfigError"
    })
    .await;
    assert_eq!(phase(&s), "Pending");
    assert!(
        container(&s)["state"]["waiting"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("configmap \"later\" not found"),
        "{s}"
    );

    insert(
        "nocmd",
        json!({"metadata": {"name": "nocmd"}, "spec": {"restartPolicy": "Never",
        "containers": [{"name": "main", "command": ["/nonexistent/program"]}]}}),
    )
    .await;
    let s = await_status(&mut watcher, prefix, "nocmd", |s| phase(s) == "Failed").await;
    let terminated = &container(&s)["state"]["terminated"];
    assert_eq!(terminated["reason"], "ContainerCannotRun", "{s}");
    assert_eq!(terminated["exitCode"], 127, "{s}");

    // Not JSON of a pod at all, and a name that is not a path component.
    client
        .publish(
            "ke/meta/edgecontroller/insert/default/pod/junk",
            r#"{"spec":{"containers":"x"}}"#,
        )
        .await;
    let s = await_status(&mut watcher, prefix, "junk", |s| phase(s) == "Failed").await;
    assert_eq!(s["reason"], "InvalidPodSpec");

    // The configmap arrives: the waiting pod starts.
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/configmap/later",
        json!({"metadata": {"name": "later"}, "data": {"x": "1"}}),
    )
    .await;
    await_status(&mut watcher, prefix, "needs", |s| phase(s) == "Running").await;
    assert!(edged.is_running(), "edged crashed:\n{}", edged.log());
}

#[tokio::test]
async fn csi_volume_calls_are_refused_at_once() {
    let node = Node::start().await;
    let edged = Edged::start(&node, &[]);
    let mut cloud_side = node.client().await;
    cloud_side.subscribe("ke/cloud/#").await;
    // edged is subscribed once it has listed its pods.
    edged.await_log("pod list synced").await;
    for operation in [
        "createvolume",
        "deletevolume",
        "controllerpublishvolume",
        "controllerunpublishvolume",
    ] {
        let started = Instant::now();
        let id = send(
            &cloud_side,
            "edgecontroller",
            operation,
            "default/volume/vol-1",
            json!({"name": "vol-1"}),
        )
        .await;
        let reply = cloud_side
            .expect_reply("ke/cloud/meta/error/default/volume", &id)
            .await;
        let text = reply.content();
        assert!(
            text.as_str()
                .unwrap_or_default()
                .contains("not supported by this runtime"),
            "{text}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{operation} took {:?}",
            started.elapsed()
        );
    }
}

#[tokio::test]
async fn after_a_node_restart_edged_converges_without_restarting_unchanged_pods() {
    let mut node = Node::start().await;
    let marks = tempfile::tempdir().expect("dir");
    let edged = Edged::start(&node, &[]);
    let client = node.client().await;
    for name in ["keep", "drop"] {
        let script = pid_script(marks.path(), name, "exec sleep 600");
        send(
            &client,
            "edgecontroller",
            "insert",
            &format!("default/pod/{name}"),
            pod(name, &script, json!({})),
        )
        .await;
    }
    let keep = read_pid(&await_file(&marks.path().join("keep.pid")).await);
    let drop_pid = read_pid(&await_file(&marks.path().join("drop.pid")).await);
    drop(client);

    // While the node is down, its store changes: `drop` is deleted, `add` is stored.
    node.kill9();
    let add_script = pid_script(marks.path(), "add", "exec sleep 600");
    let add = pod("add", &add_script, json!({}))
        .to_string()
        .replace('\'', "''");
    let db = libsql::Builder::new_local(node.db_path())
        .build()
        .await
        .expect("open store");
    let conn = db.connect().expect("connect");
    conn.execute_batch(&format!(
        "DELETE FROM meta WHERE key = 'default/pod/drop';\
         INSERT INTO meta (key, type, value) VALUES ('default/pod/add', 'pod', '{add}');"
    ))
    .await
    .expect("change the store");
    drop(conn);
    drop(db);
    node.restart().await;

    let added = read_pid(&await_file(&marks.path().join("add.pid")).await);
    await_dead(drop_pid, STATUS_WAIT).await;
    assert!(alive(added));
    assert!(alive(keep), "an unchanged pod was restarted");
    assert_eq!(
        read_pid(&std::fs::read_to_string(marks.path().join("keep.pid")).expect("pid")),
        keep
    );
    assert!(edged.log().contains("pod list synced"), "{}", edged.log());
}

#[tokio::test]
async fn offline_reboot_brings_every_stored_pod_back() {
    let mut cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up_filter()).await;
    let marks = tempfile::tempdir().expect("dir");
    let mut edged = Edged::start(&node, &[]);
    let names = ["a", "b", "c"];
    for name in names {
        let script = pid_script(marks.path(), name, "exec sleep 600");
        cloud_insert(
            &controller,
            &bridge,
            &format!("default/pod/{name}"),
            pod(name, &script, json!({})),
        )
        .await;
    }
    await_all_running(&mut controller, &bridge.up("edged/update"), &names).await;
    let before: Vec<u32> = {
        let mut pids = Vec::new();
        for name in names {
            pids.push(read_pid(
                &await_file(&marks.path().join(format!("{name}.pid"))).await,
            ));
        }
        pids
    };
    for name in names {
        std::fs::remove_file(marks.path().join(format!("{name}.pid"))).expect("rm");
    }

    // The cloud goes away, then the node and edged die without a word.
    cloud.stop();
    edged.kill9();
    node.kill9();
    node.restart().await;
    let restarted = Instant::now();
    edged.spawn();
    for (name, old) in names.iter().zip(&before) {
        let pid = read_pid(&await_file(&marks.path().join(format!("{name}.pid"))).await);
        assert_ne!(pid, *old);
        assert!(alive(pid), "{name} is not running");
        // What the killed edged left behind was stopped, not run twice.
        await_dead(*old, WAIT).await;
    }
    let took = restarted.elapsed();
    assert!(took < WAIT, "pods back after {took:?}");
    assert!(edged.is_running());
    assert!(node.is_running());
}

#[tokio::test]
async fn a_liveness_probe_failure_restarts_the_container_and_readiness_gates_ready() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/meta/edged/update/+/podstatus").await;
    let _edged = Edged::start(&node, &[]);
    let client = node.client().await;
    // Ready once `ready` exists (after ~1 s); alive while `healthy` exists (removed after ~2 s).
    let spec = json!({"containers": [{"name": "main", "command": ["sh", "-c",
            "rm -f ready; touch healthy; sleep 1; touch ready; sleep 1; rm healthy; sleep 600"],
        "readinessProbe": {"exec": {"command": ["test", "-f", "ready"]}, "periodSeconds": 1},
        "livenessProbe": {"exec": {"command": ["test", "-f", "healthy"]}, "periodSeconds": 1, "failureThreshold": 1},
    }], "terminationGracePeriodSeconds": 1});
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/probed",
        pod("probed", "", spec),
    )
    .await;
    let prefix = "ke/meta/edged/update";
    let s = await_status(&mut watcher, prefix, "probed", |s| phase(s) == "Running").await;
    assert_eq!(
        container(&s)["ready"],
        false,
        "not ready before its readiness probe passed: {s}"
    );
    await_status(&mut watcher, prefix, "probed", |s| {
        container(s)["ready"] == true
    })
    .await;
    // At least once: statuses published while the restarted container is probed again may
    // already count a second restart (its first probe runs at its start).
    let s = await_status(&mut watcher, prefix, "probed", |s| {
        container(s)["restartCount"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(
        container(&s)["lastState"]["terminated"]["message"],
        "liveness probe failed",
        "{s}"
    );
}

#[tokio::test]
async fn edged_stops_its_pods_on_sigterm() {
    let node = Node::start().await;
    let marks = tempfile::tempdir().expect("dir");
    let mut edged = Edged::start(&node, &[]);
    let client = node.client().await;
    let script = pid_script(marks.path(), "t", "exec sleep 600");
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/t",
        pod("t", &script, json!({})),
    )
    .await;
    let pid = read_pid(&await_file(&marks.path().join("t.pid")).await);
    let took = edged.terminate();
    assert!(took < Duration::from_secs(5), "edged took {took:?} to stop");
    assert!(!alive(pid), "the pod outlived edged");
}

/// Kills a README process at the end of the test, edged with SIGTERM so it stops its pods.
struct Spawned(Vec<Child>);

impl Drop for Spawned {
    fn drop(&mut self) {
        for child in self.0.iter_mut().rev() {
            common::terminate_child(child);
        }
    }
}

#[tokio::test]
async fn the_readme_edged_walkthrough_works_verbatim() {
    // The README's section, run in a fresh directory, with a free port for the default 1883:
    // the node and edged through the environment, the mosquitto clients through `-p`.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("Run pods at the edge"))
        .expect("README section \"Run pods at the edge\"");
    let commands: Vec<&str> = section
        .lines()
        .filter(|l| {
            ["cargo run ", "mosquitto_sub ", "mosquitto_pub ", "cat "]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .collect();
    assert!(commands.len() >= 7, "{commands:?}");
    // The node as the README runs it: the embedded default configuration in its own directory,
    // its ports (free ones, so tests can run in parallel) moved through the environment.
    let mut node: Option<Node> = None;
    let mut spawned = Spawned(Vec::new());
    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut pod_log = None;
    for command in &commands {
        let words = shell_words(command);
        let cargo_run = command.strip_prefix("cargo run --release -- ");
        if cargo_run == Some("run") {
            let started = Node::start_with(common::Options {
                embedded_config: true,
                ..common::Options::default()
            })
            .await;
            node = Some(started);
        } else if let Some(args) = cargo_run {
            // edged, with the node's environment in the node's directory.
            let node = node.as_ref().expect("the node runs first");
            let log = std::fs::File::create(node.dir().join(format!("{args}.log"))).expect("log");
            let child = Command::new(env!("CARGO_BIN_EXE_edgemeta"))
                .args(args.split(' '))
                .envs(node.env())
                .env_remove("RUST_LOG")
                .current_dir(node.dir())
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log)
                .spawn()
                .expect("start edgemeta");
            spawned.0.push(child);
        } else if words[0] == "mosquitto_sub" {
            let port = node.as_ref().expect("the node runs first").port.to_string();
            let mut args = vec!["-p", port.as_str()];
            args.extend(words[1..].iter().map(String::as_str));
            let (child, mut printed) = common::MosquittoSub::start(&args).await.split();
            let forward = lines_tx.clone();
            tokio::spawn(async move {
                while let Some(line) = printed.recv().await {
                    let _ = forward.send(line);
                }
            });
            spawned.0.insert(0, child);
        } else if words[0] == "mosquitto_pub" {
            if command.contains("/delete/") {
                // The pod must be running before it is deleted.
                let started = Instant::now();
                loop {
                    let left = STATUS_WAIT.saturating_sub(started.elapsed());
                    let line = tokio::time::timeout(left, lines.recv())
                        .await
                        .expect("a Running status on the watcher")
                        .expect("watcher alive");
                    if line.starts_with("ke/meta/edged/update/default/podstatus ")
                        && line.contains(r#""resource":"default/podstatus/hello""#)
                        && line.contains(r#""phase":"Running""#)
                    {
                        break;
                    }
                }
            }
            let port = node.as_ref().expect("the node runs first").port;
            let ok = Command::new("mosquitto_pub")
                .args(["-p", &port.to_string()])
                .args(&words[1..])
                .status()
                .expect("mosquitto_pub")
                .success();
            assert!(ok, "{command}");
        } else if words[0] == "cat" {
            let path = node
                .as_ref()
                .expect("the node runs first")
                .dir()
                .join(&words[1]);
            await_text(&path, "hello from the edge", 2, STATUS_WAIT).await;
            pod_log = Some(path);
        }
    }
    // After the delete the process is gone: its pid file goes with it.
    let pod_dir = pod_log
        .expect("the cat line")
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("pod dir");
    wait_until("the pod's pid file gone after its delete", WAIT, || {
        std::future::ready(!pod_dir.join("main.pid").exists())
    })
    .await;
}

#[tokio::test]
async fn with_the_acl_on_edged_works_as_the_module_edged_and_a_wrong_password_only_retries() {
    let node = Node::start_with(common::Options {
        broker_yaml: format!(
            "{}  acl:\n    enabled: true\n    rules:\n      - identity: operator\n        publish: ['ke/meta/edgecontroller/#']\n        subscribe: ['ke/#']\n",
            common::auth_yaml(false, &["edged", "operator"])
        ),
        ..common::Options::default()
    })
    .await;
    let mut operator =
        Client::connect_as(node.port, &unique_id("op"), "operator", "operator-pw").await;
    operator.subscribe("ke/meta/edged/update/+/podstatus").await;
    let mut intruder = Edged::start(&node, &[("username", "edged"), ("password", "wrong")]);
    let _edged = Edged::start(&node, &[("username", "edged"), ("password", "edged-pw")]);
    send(
        &operator,
        "edgecontroller",
        "insert",
        "default/pod/guarded",
        pod("guarded", "exec sleep 600", json!({})),
    )
    .await;
    await_status(&mut operator, "ke/meta/edged/update", "guarded", |s| {
        phase(s) == "Running"
    })
    .await;
    intruder.await_log("EM-EDGED-CONNECT").await;
    assert!(intruder.is_running(), "a refused login stopped edged");
}

#[tokio::test]
async fn statuses_are_coalesced_to_the_configured_rate_per_pod() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/meta/edged/update/+/podstatus").await;
    let _edged = Edged::start(
        &node,
        &[
            ("status_interval_ms", "500"),
            ("restart_backoff_base_ms", "10"),
            ("restart_backoff_max_ms", "10"),
        ],
    );
    let client = node.client().await;
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/flappy",
        pod("flappy", "exit 1", json!({})),
    )
    .await;
    // Dozens of restarts, three state changes each, in 3 s: at most one status per 500 ms.
    let window = Duration::from_secs(3);
    let messages = watcher.drain(window).await;
    let statuses: Vec<Value> = messages
        .iter()
        .filter(|m| m.resource() == "default/podstatus/flappy")
        .map(|m| m.content()["Status"].clone())
        .collect();
    assert!(!statuses.is_empty());
    assert!(
        statuses.len() <= 7,
        "{} statuses in {window:?}",
        statuses.len()
    );
    let last = statuses.last().expect("a status");
    let restarts = container(last)["restartCount"].as_u64().unwrap_or_default();
    assert!(restarts >= 10, "only {restarts} restarts: {last}");
}

#[tokio::test]
async fn a_configmap_update_rewrites_the_volume_files_of_a_running_pod() {
    let node = Node::start().await;
    let edged = Edged::start(&node, &[]);
    let client = node.client().await;
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/configmap/tune",
        json!({"metadata": {"name": "tune"}, "data": {"mode": "eco"}}),
    )
    .await;
    let spec = json!({"containers": [{"name": "main", "command": ["sh", "-c", "exec sleep 600"],
            "volumeMounts": [{"name": "tune", "mountPath": "/etc/tune"}]}],
        "volumes": [{"name": "tune", "configMap": {"name": "tune"}}]});
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/tuned",
        pod("tuned", "", spec),
    )
    .await;
    let file = edged.pod_dir("tuned").join("volumes/tune/mode");
    assert_eq!(await_file(&file).await, "eco");
    // edged's pid file: `<pid> <start time>`.
    let recorded = await_file(&edged.pod_dir("tuned").join("main.pid")).await;
    let pid = read_pid(recorded.split_whitespace().next().unwrap_or_default());
    send(
        &client,
        "edgecontroller",
        "update",
        "default/configmap/tune",
        json!({"metadata": {"name": "tune"}, "data": {"mode": "turbo"}}),
    )
    .await;
    wait_until("the volume file rewritten", WAIT, || {
        let now = std::fs::read_to_string(&file).unwrap_or_default();
        std::future::ready(if now == "turbo" { Ok(()) } else { Err(now) })
    })
    .await;
    assert!(alive(pid), "the pod was restarted for a configmap change");
}

#[tokio::test]
async fn run_to_completion_pods_end_succeeded_or_failed() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/meta/edged/update/+/podstatus").await;
    let _edged = Edged::start(&node, &[]);
    let client = node.client().await;
    let prefix = "ke/meta/edged/update";
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/job",
        pod("job", "exit 0", json!({"restartPolicy": "OnFailure"})),
    )
    .await;
    let s = await_status(&mut watcher, prefix, "job", |s| phase(s) == "Succeeded").await;
    assert_eq!(
        container(&s)["state"]["terminated"]["reason"],
        "Completed",
        "{s}"
    );
    assert_eq!(container(&s)["restartCount"], 0, "{s}");
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/once",
        pod("once", "exit 4", json!({"restartPolicy": "Never"})),
    )
    .await;
    let s = await_status(&mut watcher, prefix, "once", |s| phase(s) == "Failed").await;
    assert_eq!(container(&s)["state"]["terminated"]["exitCode"], 4, "{s}");
}

#[tokio::test]
async fn an_http_readiness_probe_gates_ready_on_the_status_code() {
    // The endpoint the probe calls: 503 until `healthy` is set, then 200.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    let healthy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = healthy.clone();
    let refusals = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let refused = refusals.clone();
    let server = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let mut request = [0u8; 1024];
            let n = socket.read(&mut request).await.unwrap_or(0);
            let asked = String::from_utf8_lossy(&request[..n]).into_owned();
            let code = if !asked.starts_with("GET /healthz ") {
                404
            } else if flag.load(std::sync::atomic::Ordering::SeqCst) {
                200
            } else {
                refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                503
            };
            let _ = socket
                .write_all(format!("HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n").as_bytes())
                .await;
        }
    });
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/meta/edged/update/+/podstatus").await;
    let _edged = Edged::start(&node, &[]);
    let client = node.client().await;
    let spec = json!({"containers": [{"name": "main", "command": ["sleep", "600"],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 1}}]});
    send(
        &client,
        "edgecontroller",
        "insert",
        "default/pod/web",
        pod("web", "", spec),
    )
    .await;
    let prefix = "ke/meta/edged/update";
    let s = await_status(&mut watcher, prefix, "web", |s| phase(s) == "Running").await;
    assert_eq!(container(&s)["ready"], false, "{s}");
    // Not ready while the probe is refused, more than once.
    wait_until("two refused readiness probes", WAIT, || {
        std::future::ready(refusals.load(std::sync::atomic::Ordering::SeqCst) >= 2)
    })
    .await;
    healthy.store(true, std::sync::atomic::Ordering::SeqCst);
    let s = await_status(&mut watcher, prefix, "web", |s| {
        container(s)["ready"] == true
    })
    .await;
    assert_eq!(
        s["conditions"][3],
        json!({"type": "Ready", "status": "True"})
    );
    server.abort();
}
