//! The node's Kubernetes API (MetaServer) as its users see it: `kubectl` against pods inserted
//! over MQTT, and kube-rs watch streams resuming by resourceVersion across random changes, node
//! restarts and history overflow.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{send, wait_until, Client, Node, Options};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use proptest::prelude::*;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};

const WAIT: Duration = Duration::from_secs(20);

/// A pod as the cloud sends it; `generation` goes into a label so every update changes it.
fn pod(name: &str, generation: u32) -> Value {
    json!({"metadata": {"name": name, "namespace": "default", "resourceVersion": "424242",
                        "labels": {"gen": generation.to_string()},
                        "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"nodeName": "edge-1", "containers": [{"name": "c", "image": "busybox"}]},
           "status": {"phase": if generation.is_multiple_of(2) { "Pending" } else { "Running" }}})
}

async fn change(client: &Client, operation: &str, name: &str, generation: u32) {
    send(
        client,
        "edgecontroller",
        operation,
        &format!("default/pod/{name}"),
        pod(name, generation),
    )
    .await;
}

fn kube_client(node: &Node) -> kube::Client {
    let url = format!("http://127.0.0.1:{}", node.metaserver_port);
    let config = kube::Config::new(url.parse().expect("url"));
    kube::Client::try_from(config).expect("kube client")
}

fn kubectl(node: &Node) -> Command {
    let mut command = Command::new("kubectl");
    command
        .arg("--server")
        .arg(format!("http://127.0.0.1:{}", node.metaserver_port))
        .env("KUBECONFIG", "/dev/null");
    command
}

/// Runs `kubectl get pods -A` until its output has `rows` rows below the header.
async fn kubectl_get_pods(node: &Node, rows: usize) -> String {
    wait_until(
        format_args!("{rows} rows from kubectl get pods -A"),
        WAIT,
        || {
            let out = kubectl(node)
                .args(["get", "pods", "-A"])
                .output()
                .expect("kubectl is installed (scripts/test installs kubernetes-client)");
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            std::future::ready(
                if out.status.success() && text.lines().count() == rows + 1 {
                    Ok(text)
                } else {
                    Err(format!("{text}\n{}", String::from_utf8_lossy(&out.stderr)))
                },
            )
        },
    )
    .await
}

#[tokio::test]
async fn kubectl_lists_pods_inserted_over_mqtt_and_watches_each_change_once() {
    let node = Node::start().await;
    let client = node.client().await;
    change(&client, "insert", "web-1", 1).await;
    change(&client, "insert", "web-2", 1).await;
    let listed = kubectl_get_pods(&node, 2).await;
    let lines: Vec<&str> = listed.lines().collect();
    assert!(lines[0].starts_with("NAMESPACE"), "{listed}");
    assert!(
        lines[1].starts_with("default") && lines[1].contains("web-1"),
        "{listed}"
    );
    assert!(
        lines[2].contains("web-2") && lines[2].contains("Running"),
        "{listed}"
    );

    let mut watch = tokio::process::Command::new("kubectl")
        .arg("--server")
        .arg(format!("http://127.0.0.1:{}", node.metaserver_port))
        .args(["get", "pods", "-A", "-w"])
        .env("KUBECONFIG", "/dev/null")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl get pods -A -w");
    let mut out = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let mut next_line = async || {
        tokio::time::timeout(WAIT, out.next_line())
            .await
            .expect("kubectl printed a line in time")
            .expect("read")
            .expect("kubectl is still watching")
    };
    // The header and the two pods first.
    for _ in 0..3 {
        next_line().await;
    }
    change(&client, "insert", "web-3", 2).await;
    change(&client, "update", "web-3", 3).await;
    change(&client, "delete", "web-1", 1).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(next_line().await);
    }
    assert!(
        seen[0].contains("web-3") && seen[0].contains("Pending"),
        "{seen:?}"
    );
    assert!(
        seen[1].contains("web-3") && seen[1].contains("Running"),
        "{seen:?}"
    );
    assert!(seen[2].contains("web-1"), "{seen:?}");
    // Each change once: nothing more follows.
    let more = tokio::time::timeout(Duration::from_millis(1500), out.next_line()).await;
    assert!(more.is_err(), "an extra line: {more:?}");
    let _ = watch.start_kill();
    let _ = watch.wait().await;
}

#[tokio::test]
async fn writes_are_refused_with_a_status_and_discovery_serves_the_stored_types() {
    let node = Node::start_with(Options {
        metaserver_yaml: "  secrets: false\n".into(),
        ..Options::default()
    })
    .await;
    let out = kubectl(&node)
        .args(["create", "configmap", "x", "--from-literal=a=b"])
        .output()
        .expect("kubectl");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("read-only")
            || stderr.contains("MethodNotAllowed")
            || stderr.contains("not allowed"),
        "{stderr}"
    );
    let out = kubectl(&node)
        .args(["api-resources", "--no-headers"])
        .output()
        .expect("kubectl");
    let text = String::from_utf8_lossy(&out.stdout);
    for plural in ["pods", "configmaps", "services", "endpoints", "nodes"] {
        assert!(text.contains(plural), "{plural}: {text}");
    }
    assert!(!text.contains("secrets"), "{text}");
}

/// One step of a random history.
#[derive(Debug, Clone)]
enum Step {
    Insert(u8),
    Update(u8),
    Delete(u8),
    /// Stop the node (SIGTERM) and start it again on the same store.
    Restart,
    /// The watcher reconnects from its version and reads until it is current.
    Resume,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u8..4).prop_map(Step::Insert),
        3 => (0u8..4).prop_map(Step::Update),
        2 => (0u8..4).prop_map(Step::Delete),
        1 => Just(Step::Restart),
        3 => Just(Step::Resume),
    ]
}

/// What a client knows: objects by name (their `gen` label) and the version it is at.
#[derive(Debug, Default, Clone, PartialEq)]
struct View {
    pods: BTreeMap<String, String>,
}

fn gen_of(pod: &Pod) -> String {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get("gen").cloned())
        .unwrap_or_default()
}

fn version_of(pod: &Pod) -> u64 {
    pod.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .expect("a numeric resourceVersion")
}

/// Lists until the store is at `rev` (the node has committed everything sent).
async fn list_at(api: &Api<Pod>, rev: u64) -> (View, u64) {
    wait_until(format_args!("the store at {rev}"), WAIT, async || {
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?;
        let at: u64 = list
            .metadata
            .resource_version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .expect("list version");
        assert!(at <= rev, "the store is at {at}, beyond {rev}");
        if at < rev {
            return Err(format!("at {at}"));
        }
        let pods = list
            .items
            .iter()
            .map(|p| (p.metadata.name.clone().unwrap_or_default(), gen_of(p)))
            .collect();
        Ok((View { pods }, at))
    })
    .await
}

/// Runs one random history against a fresh node keeping `history` changes; how many times the
/// watcher got 410 and relisted.
async fn run_history(steps: Vec<Step>, history: u64) -> usize {
    let mut node = Node::start_with(Options {
        metaserver_yaml: format!("  history: {history}\n  bookmark_interval_s: 1\n"),
        ..Options::default()
    })
    .await;
    let mut client = node.client().await;
    let mut api: Api<Pod> = Api::all(kube_client(&node));
    // The truth: the objects and, per version, the change it made.
    let mut model: BTreeMap<String, u32> = BTreeMap::new();
    let mut changes: Vec<(&'static str, String, u32)> = vec![("", String::new(), 0)];
    let mut generation = 0u32;
    // The watcher starts from a list. Not of the empty store: a watch from version "0" means
    // "from any version" to the API (the current objects as ADDED), not "after version 0".
    change(&client, "insert", "seed", generation).await;
    model.insert("seed".into(), generation);
    changes.push(("ADDED", "seed".into(), generation));
    let (mut view, mut at) = list_at(&api, 1).await;
    let mut relists = 0;
    for step in steps {
        let rev = changes.len() as u64 - 1;
        match step {
            Step::Insert(i) | Step::Update(i) => {
                let name = format!("pod-{i}");
                generation += 1;
                let op = if matches!(step, Step::Insert(_)) {
                    "insert"
                } else {
                    "update"
                };
                change(&client, op, &name, generation).await;
                let event = if model.contains_key(&name) {
                    "MODIFIED"
                } else {
                    "ADDED"
                };
                model.insert(name.clone(), generation);
                changes.push((event, name, generation));
            }
            Step::Delete(i) => {
                let name = format!("pod-{i}");
                change(&client, "delete", &name, 0).await;
                if let Some(last) = model.remove(&name) {
                    changes.push(("DELETED", name, last));
                }
            }
            Step::Restart => {
                list_at(&api, rev).await;
                node.terminate();
                node.restart().await;
                client = node.client().await;
                api = Api::all(kube_client(&node));
            }
            Step::Resume => {
                list_at(&api, rev).await;
                let expired = at < rev.saturating_sub(history);
                let params = WatchParams::default().timeout(10);
                let mut stream = api
                    .watch(&params, &at.to_string())
                    .await
                    .expect("watch")
                    .boxed();
                if expired {
                    let first = tokio::time::timeout(WAIT, stream.next())
                        .await
                        .expect("an event in time")
                        .expect("an event")
                        .expect("a readable event");
                    match first {
                        WatchEvent::Error(status) => assert_eq!(status.code, 410, "{status:?}"),
                        other => {
                            panic!("version {at} of {rev} (history {history}): {other:?}, not 410")
                        }
                    }
                    relists += 1;
                    (view, at) = list_at(&api, rev).await;
                } else {
                    // Exactly the changes after `at`, in order, each once.
                    let mut seen = Vec::new();
                    while at < rev {
                        let event = tokio::time::timeout(WAIT, stream.next())
                            .await
                            .expect("an event in time")
                            .expect("the watch stays open")
                            .expect("a readable event");
                        let (kind, pod) = match event {
                            WatchEvent::Added(p) => ("ADDED", p),
                            WatchEvent::Modified(p) => ("MODIFIED", p),
                            WatchEvent::Deleted(p) => ("DELETED", p),
                            WatchEvent::Bookmark(b) => {
                                let v: u64 = b.metadata.resource_version.parse().expect("rv");
                                assert!(v <= rev, "bookmark {v} beyond {rev}");
                                continue;
                            }
                            WatchEvent::Error(status) => {
                                panic!("version {at} of {rev} (history {history}): {status:?}")
                            }
                        };
                        let name = pod.metadata.name.clone().unwrap_or_default();
                        let v = version_of(&pod);
                        assert_eq!(
                            v,
                            at + 1,
                            "missed or repeated: {seen:?} then {kind} {name} at {v}"
                        );
                        let (want_kind, want_name, want_gen) = &changes[v as usize];
                        assert_eq!(
                            (kind, &name, gen_of(&pod)),
                            (*want_kind, want_name, want_gen.to_string())
                        );
                        seen.push((kind, name.clone(), v));
                        if kind == "DELETED" {
                            view.pods.remove(&name);
                        } else {
                            view.pods.insert(name, gen_of(&pod));
                        }
                        at = v;
                    }
                }
                let truth: BTreeMap<String, String> = model
                    .iter()
                    .map(|(k, v)| (k.clone(), v.to_string()))
                    .collect();
                assert_eq!(
                    view.pods, truth,
                    "the watcher at {at} differs from the store"
                );
            }
        }
    }
    let rev = changes.len() as u64 - 1;
    let (listed, _) = list_at(&api, rev).await;
    let truth: BTreeMap<String, String> = model
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    assert_eq!(listed.pods, truth, "the list differs from the model");
    relists
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, max_shrink_iters: 8, ..ProptestConfig::default() })]

    /// Random inserts, updates, deletes, restarts and resumes: a watcher resuming by version
    /// sees every change after it exactly once, in order, or a 410 exactly when its version
    /// fell out of the history, and always ends equal to the store.
    #[test]
    fn a_resuming_watcher_ends_equal_to_the_store(
        steps in prop::collection::vec(step(), 10..40),
        history in 3u64..10,
    ) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(run_history(steps, history));
    }
}

/// A history long enough to overflow: the 410 and the resume both happen at least once.
#[tokio::test]
async fn a_watcher_too_far_behind_gets_410_and_one_within_the_history_resumes() {
    let steps = vec![
        Step::Insert(0),
        Step::Resume,
        Step::Insert(1),
        Step::Update(0),
        Step::Restart,
        Step::Resume,
        Step::Update(1),
        Step::Update(0),
        Step::Delete(1),
        Step::Update(0),
        Step::Insert(2),
        Step::Resume,
        Step::Delete(0),
        Step::Resume,
    ];
    // The third resume is 5 versions behind a history of 3; the others are within it.
    assert_eq!(run_history(steps, 3).await, 1);
}

/// `limit`/`continue` pages through kube-rs at one version; a next page whose objects changed
/// since the first is refused with 410; with a token file, only requests bearing it get in.
#[tokio::test]
async fn lists_page_at_one_version_and_the_token_is_required() {
    let dir = tempfile::tempdir().expect("temp dir");
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cret\n").expect("token");
    let node = Node::start_with(Options {
        metaserver_yaml: format!("  token_file: {}\n", token.display()),
        ..Options::default()
    })
    .await;
    let client = node.client().await;
    for name in ["a", "b", "c", "d", "e"] {
        change(&client, "insert", name, 1).await;
    }
    let url = format!("http://127.0.0.1:{}", node.metaserver_port);
    let anonymous: Api<Pod> = Api::all(
        kube::Client::try_from(kube::Config::new(url.parse().expect("url"))).expect("client"),
    );
    match anonymous.list(&ListParams::default()).await {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 401, "{status:?}"),
        other => panic!("without the token: {other:?}"),
    }
    let mut config = kube::Config::new(url.parse().expect("url"));
    config.auth_info.token = Some("s3cret".to_owned().into());
    let api: Api<Pod> = Api::namespaced(kube::Client::try_from(config).expect("client"), "default");
    // Everything inserted (version 5), then pages of two.
    wait_until("the five pods listed", WAIT, async || {
        api.list(&ListParams::default())
            .await
            .expect("list")
            .items
            .len()
            >= 5
    })
    .await;
    let mut names = Vec::new();
    let mut params = ListParams::default().limit(2);
    let mut versions = Vec::new();
    loop {
        let page = api.list(&params).await.expect("page");
        versions.push(page.metadata.resource_version.clone().expect("version"));
        names.extend(page.items.iter().filter_map(|p| p.metadata.name.clone()));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => break,
        }
    }
    assert_eq!(names, ["a", "b", "c", "d", "e"]);
    assert!(versions.iter().all(|v| v == "5"), "{versions:?}");
    // A change after the first page's last object: the next page would not be at version 5.
    let first = api
        .list(&ListParams::default().limit(2))
        .await
        .expect("page");
    let token = first.metadata.continue_.expect("more");
    change(&client, "update", "d", 2).await;
    // Until the update commits, the next page is still served.
    wait_until(
        "410 for the next page once the update committed",
        WAIT,
        async || match api
            .list(&ListParams::default().limit(2).continue_token(&token))
            .await
        {
            Err(kube::Error::Api(status)) => {
                assert_eq!(status.code, 410, "{status:?}");
                true
            }
            Ok(_) => false,
            Err(e) => panic!("{e}"),
        },
    )
    .await;
}
