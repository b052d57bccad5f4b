//! The fake API server checked with independent clients: the real kube-rs client and watcher,
//! and Debian's `kubectl` (client-go). If these agree with it, tests built on it mean something.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use edgemeta_fakeapi::{Config, FakeApi, Faults};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

async fn start(config: Config) -> (FakeApi, kube::Client) {
    let api = FakeApi::start(config, CancellationToken::new())
        .await
        .expect("fake API server");
    let client =
        kube::Client::try_from(kube::Config::new(api.url().parse().expect("url"))).expect("client");
    (api, client)
}

fn configmap(name: &str, value: u32) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"v": value.to_string()}}))
        .expect("configmap")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_watcher_loses_no_event_across_dropped_watches_and_410s() {
    let (api, client) = start(Config {
        history: 50,
        bookmark_interval: Duration::from_millis(100),
        ..Config::default()
    })
    .await;
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    // The watcher's view: name -> value, and how often it (re)listed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let stream = watcher(configmaps.clone(), watcher::Config::default()).default_backoff();
    tokio::spawn(async move {
        futures_util::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Ok(event) = event {
                if tx.send(event).is_err() {
                    return;
                }
            }
        }
    });
    let mut view: BTreeMap<String, String> = BTreeMap::new();
    let mut relists = 0;
    let mut apply = |event: watcher::Event<ConfigMap>, view: &mut BTreeMap<String, String>| {
        let value = |cm: &ConfigMap| cm.data.as_ref().and_then(|d| d.get("v").cloned());
        match event {
            watcher::Event::Apply(cm) | watcher::Event::InitApply(cm) => {
                view.insert(
                    cm.metadata.name.clone().unwrap_or_default(),
                    value(&cm).unwrap_or_default(),
                );
            }
            watcher::Event::Delete(cm) => {
                view.remove(&cm.metadata.name.unwrap_or_default());
            }
            watcher::Event::Init => {
                relists += 1;
                view.clear();
            }
            watcher::Event::InitDone => {}
        }
    };
    // 300 writes over 20 objects; every 40 a dropped watch, every 100 a 410 Expired.
    let mut want: BTreeMap<String, String> = BTreeMap::new();
    for i in 0..300u32 {
        let name = format!("cm{}", i % 20);
        if i % 37 == 36 {
            configmaps
                .delete(&name, &DeleteParams::default())
                .await
                .ok();
            want.remove(&name);
        } else {
            let exists = want.insert(name.clone(), i.to_string()).is_some();
            if exists {
                configmaps
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"data": {"v": i.to_string()}})),
                    )
                    .await
                    .expect("patch");
            } else {
                configmaps
                    .create(&PostParams::default(), &configmap(&name, i))
                    .await
                    .expect("create");
            }
        }
        if i % 40 == 39 {
            api.drop_watches();
        }
        if i % 100 == 99 {
            // The next watch is answered 410 Expired, as after an etcd compaction.
            api.set_faults(Faults {
                expire_watches: 1,
                ..Faults::default()
            });
            api.drop_watches();
        }
        while let Ok(event) = rx.try_recv() {
            apply(event, &mut view);
        }
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let started = Instant::now();
    while view != want {
        let Ok(Some(event)) = tokio::time::timeout(WAIT, rx.recv()).await else {
            panic!("the watcher stopped; view {view:?}\nwant {want:?}");
        };
        apply(event, &mut view);
        assert!(
            started.elapsed() < WAIT,
            "never converged: {view:?}\nwant {want:?}"
        );
    }
    // The 410s made kube-rs list again (the initial list counts once).
    assert!(relists >= 2, "relists: {relists}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_page_and_select_and_status_and_delete_follow_the_api() {
    let (api, client) = start(Config::default()).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for i in 0..25 {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"name": format!("p{i:02}"),
            "labels": {"app": if i % 2 == 0 { "even" } else { "odd" }}},
            "spec": {"nodeName": if i < 5 { "n1" } else { "n2" }, "containers": [{"name": "c", "image": "x"}]}}))
            .expect("pod");
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create");
    }
    // Paging: 10 + 10 + 5, one resourceVersion across the pages.
    let first = pods
        .list(&ListParams::default().limit(10))
        .await
        .expect("page 1");
    assert_eq!(first.items.len(), 10);
    let token = first.metadata.continue_.clone().expect("continue");
    let second = pods
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await
        .expect("page 2");
    assert_eq!(second.items.len(), 10);
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );
    let third = pods
        .list(
            &ListParams::default()
                .limit(10)
                .continue_token(second.metadata.continue_.as_deref().expect("continue")),
        )
        .await
        .expect("page 3");
    assert_eq!(third.items.len(), 5);
    assert!(third.metadata.continue_.is_none());
    // An expired continue token is HTTP 410.
    api.compact();
    pods.patch(
        "p00",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}})),
    )
    .await
    .expect("bump");
    api.compact();
    match pods
        .list(&ListParams::default().limit(10).continue_token(&token))
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 410),
        other => panic!("expected 410, got {other:?}"),
    }
    // Selectors.
    let on_n1 = pods
        .list(&ListParams::default().fields("spec.nodeName=n1"))
        .await
        .expect("fields");
    assert_eq!(on_n1.items.len(), 5);
    let odd = pods
        .list(&ListParams::default().labels("app in (odd),app!=even"))
        .await
        .expect("labels");
    assert_eq!(odd.items.len(), 12);
    // Status writes go through the status subresource only; a no-op write changes nothing.
    let before = api.writes("pods/status");
    let status = json!({"status": {"phase": "Running"}});
    let written = pods
        .patch_status("p01", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status");
    let rv = written.metadata.resource_version.clone();
    let again = pods
        .patch_status("p01", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status again");
    assert_eq!(again.metadata.resource_version, rv);
    assert_eq!(api.writes("pods/status"), before + 1);
    let spec_write = pods
        .patch(
            "p01",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Failed"}})),
        )
        .await
        .expect("main patch");
    assert_eq!(
        spec_write.status.and_then(|s| s.phase).as_deref(),
        Some("Running")
    );
    // Graceful delete of a bound pod marks it; a wrong UID precondition is a conflict; grace 0
    // with the right UID removes it.
    let marked = pods
        .delete("p01", &DeleteParams::default())
        .await
        .expect("delete");
    let marked = marked.left().expect("marked pod");
    assert!(marked.metadata.deletion_timestamp.is_some());
    let wrong = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(kube::api::Preconditions {
            uid: Some("nope".into()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    match pods.delete("p01", &wrong).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("expected 409, got {other:?}"),
    }
    let right = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: marked.metadata.uid.clone(),
            resource_version: None,
        }),
        ..wrong
    };
    pods.delete("p01", &right).await.expect("delete for good");
    assert!(pods.get_opt("p01").await.expect("get").is_none());
    // Injected faults answer with the code asked for (500: kube-rs retries a 503 itself).
    api.set_faults(Faults {
        fail_requests: 1,
        fail_code: 500,
        ..Faults::default()
    });
    match pods.get("p02").await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 500),
        other => panic!("expected 500, got {other:?}"),
    }
    pods.get("p02").await.expect("after the fault");
}

/// `kubectl`, or a failure that says how to get it.
fn kubectl(kubeconfig: &std::path::Path) -> Command {
    let mut command = Command::new("kubectl");
    command.arg("--kubeconfig").arg(kubeconfig);
    command
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_applies_gets_and_watches() {
    let (api, _client) = start(Config::default()).await;
    let dir = tempfile::tempdir().expect("dir");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, api.kubeconfig()).expect("kubeconfig");
    let manifest = |version: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: web\n  labels:\n    version: \"{version}\"\nspec:\n  nodeName: edge-1\n  containers:\n  - name: main\n    image: busybox\n"
        )
    };
    let apply = |version: &str| {
        let mut child = kubectl(&kubeconfig)
            .args(["apply", "--validate=false", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl is installed (scripts/test installs kubernetes-client)");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(manifest(version).as_bytes())
            .expect("manifest");
        let out = child.wait_with_output().expect("kubectl apply");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // `get -w` lists, then watches: the pod's creation and its change both show.
    let mut watch = kubectl(&kubeconfig)
        .args([
            "get",
            "pods",
            "-w",
            "--output-watch-events",
            "--show-labels",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl get -w");
    let stdout = watch.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(apply("1").contains("pod/web created"));
    assert!(apply("2").contains("pod/web configured"));
    let mut seen = Vec::new();
    let deadline = Instant::now() + WAIT;
    while !seen.iter().any(|l: &String| l.contains("version=2")) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => seen.push(line),
            Err(_) => panic!("kubectl get -w printed {seen:?}"),
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    assert!(
        seen.iter()
            .any(|l| l.contains("ADDED") && l.contains("version=1")),
        "{seen:?}"
    );
    assert!(
        seen.iter()
            .any(|l| l.contains("MODIFIED") && l.contains("version=2")),
        "{seen:?}"
    );
    // `get -o wide` prints the server's table.
    let out = kubectl(&kubeconfig)
        .args(["get", "pod", "web", "-o", "wide"])
        .output()
        .expect("kubectl get");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("NODE") && table.contains("edge-1"),
        "{table}"
    );
}
