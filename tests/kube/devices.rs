//! Devices from Kubernetes, end to end: KubeEdge's own CRD manifests applied unmodified with
//! `kubectl` to the fake API server, a Device and DeviceModel as KubeEdge's docs write them,
//! the real controller, a mosquitto cloud broker, real nodes, and a mapper speaking KubeEdge's
//! `$hw` topics over MQTT.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{json, Value};

use super::common::cloud::bridged;
use super::common::{assert_quiet_for, wait_until, Client, CloudBroker, CloudOptions, Node};
use super::{Cluster, Controller};

pub(super) const DEVICE: &str = "beta1-device";
pub(super) const ID: &str = "default/beta1-device";
const WAIT: Duration = Duration::from_secs(20);

pub(super) fn conf(file: &str) -> String {
    format!("{}/conf/kube/{file}", env!("CARGO_MANIFEST_DIR"))
}

/// `kubectl apply --validate=false -f -` of `manifest`; its output.
pub(super) fn kubectl_apply(cluster: &Cluster, args: &[&str], manifest: Option<&str>) -> String {
    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(["apply", "--validate=false"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl is installed (scripts/test installs kubernetes-client)");
    let mut stdin = child.stdin.take().expect("stdin");
    if let Some(manifest) = manifest {
        stdin.write_all(manifest.as_bytes()).expect("manifest");
    }
    drop(stdin);
    let out = child.wait_with_output().expect("kubectl apply");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubectl apply failed: {text}");
    text
}

pub(super) fn api(cluster: &Cluster, kind: &str, plural: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("devices.kubeedge.io", "v1beta1", kind);
    let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
    Api::namespaced_with(cluster.client.clone(), "default", &resource)
}

/// The CRDs, KubeEdge's files as they are; then the docs' DeviceModel and Device, bound to
/// `node`.
pub(super) fn apply_device(cluster: &Cluster, node: &str) {
    let out = kubectl_apply(cluster, &["-f", &conf("crds")], None);
    assert_eq!(out.matches(" created").count(), 3, "{out}");
    kubectl_apply(cluster, &["-f", &conf("demo-devicemodel.yaml")], None);
    let device = std::fs::read_to_string(conf("demo-device.yaml")).expect("device manifest");
    let device = device.replace("nodeName: edge-1", &format!("nodeName: {node}"));
    kubectl_apply(cluster, &["-f", "-"], Some(&device));
}

/// Sets the Device's desired `temp` (KubeEdge's properties list, replaced whole).
async fn set_desired(cluster: &Cluster, value: &str) {
    let patch = json!({"spec": {"properties": [{"name": "temp", "desired": {"value": value}}]}});
    api(cluster, "Device", "devices")
        .patch(DEVICE, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch device");
}

async fn move_to(cluster: &Cluster, node: &str) {
    let patch = json!({"spec": {"nodeName": node}});
    api(cluster, "Device", "devices")
        .patch(DEVICE, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch device");
}

/// A mapper on `node`'s broker, subscribed to the device's deltas and the node's membership.
async fn mapper(node: &Node, bridge: &CloudOptions) -> Client {
    let mut mapper = node.client().await;
    mapper
        .subscribe(&format!("$hw/events/device/{ID}/twin/update/delta"))
        .await;
    mapper
        .subscribe(&format!("$hw/events/device/{ID}/twin/get/result"))
        .await;
    mapper
        .subscribe(&format!(
            "$hw/events/node/{}/membership/updated",
            bridge.node_id
        ))
        .await;
    mapper
}

/// Waits for a message on a topic ending in `suffix` that `pick` accepts.
async fn next_where(client: &mut Client, suffix: &str, pick: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let Some(m) = client.next_within(left).await else {
            panic!("nothing on …{suffix} as wanted within {WAIT:?}; saw {seen:#?}");
        };
        if m.topic.ends_with(suffix) {
            let body = m.json();
            if pick(&body) {
                return body;
            }
            seen.push(body);
        }
    }
}

async fn delta_of(mapper: &mut Client, value: &str) {
    next_where(mapper, "/twin/update/delta", |d| {
        d["delta"]["temp"] == value
    })
    .await;
}

/// The mapper's `twin/get`: the expected value the node holds, or the error code.
pub(super) async fn twin_get(mapper: &mut Client) -> Result<String, i64> {
    let event = super::common::unique_id("get");
    mapper
        .publish(
            &format!("$hw/events/device/{ID}/twin/get"),
            json!({"event_id": event, "timestamp": 0}).to_string(),
        )
        .await;
    let result = next_where(mapper, "/twin/get/result", |r| r["event_id"] == event).await;
    match result["code"].as_i64() {
        Some(code) => Err(code),
        None => Ok(result["twin"]["temp"]["expected"]["value"]
            .as_str()
            .unwrap_or_default()
            .to_owned()),
    }
}

pub(super) async fn status(cluster: &Cluster) -> Value {
    api(cluster, "DeviceStatus", "devicestatuses")
        .get_opt(DEVICE)
        .await
        .ok()
        .flatten()
        .map(|o| o.data["status"].clone())
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeedges_crds_apply_and_desired_values_reach_the_mapper_and_reports_the_devicestatus() {
    let cluster = Cluster::start().await;
    let cloud = CloudBroker::start().await;
    let controller = Controller::start(&cluster, &cloud);
    let (node, bridge) = bridged(&cloud).await;
    let mut mapper = mapper(&node, &bridge).await;
    apply_device(&cluster, &bridge.node_id);
    // The device joins the node with the docs' desired value, typed by its model (INT).
    let joined = next_where(&mut mapper, "/membership/updated", |m| {
        m["added_devices"][0]["id"] == ID
    })
    .await;
    assert_eq!(
        joined["added_devices"][0]["twin"]["temp"]["metadata"]["type"],
        "int"
    );
    assert_eq!(twin_get(&mut mapper).await, Ok("30".to_owned()));
    // An edit with the API reaches the mapper as a delta.
    set_desired(&cluster, "42").await;
    delta_of(&mut mapper, "42").await;
    // What the mapper reports reaches the DeviceStatus the controller created.
    mapper
        .publish(
            &format!("$hw/events/device/{ID}/twin/update"),
            json!({"event_id": "r1", "timestamp": 0,
                   "twin": {"temp": {"actual": {"value": "41"}, "metadata": {"type": "int"}}}})
            .to_string(),
        )
        .await;
    mapper
        .publish(
            &format!("$hw/events/device/{ID}/state/update"),
            json!({"event_id": "s1", "timestamp": 0, "state": "online"}).to_string(),
        )
        .await;
    let written = wait_until("the report in the DeviceStatus", WAIT, async || {
        let status = status(&cluster).await;
        let twin = status["twins"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["propertyName"] == "temp"))
            .cloned()
            .unwrap_or(Value::Null);
        if twin["reported"]["value"] == "41" && status["state"] == "online" {
            Ok(status)
        } else {
            Err(format!("{status}\n--- controller\n{}", controller.log()))
        }
    })
    .await;
    assert!(written["lastOnlineTime"].is_string(), "{written}");
    let twin = &written["twins"][0];
    assert_eq!(twin["reported"]["metadata"]["type"], "int", "{written}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_moved_between_nodes_leaves_the_first_and_joins_the_second() {
    let cluster = Cluster::start().await;
    let cloud = CloudBroker::start().await;
    let _controller = Controller::start(&cluster, &cloud);
    let (first, first_bridge) = bridged(&cloud).await;
    let (second, second_bridge) = bridged(&cloud).await;
    let mut on_first = mapper(&first, &first_bridge).await;
    let mut on_second = mapper(&second, &second_bridge).await;
    apply_device(&cluster, &first_bridge.node_id);
    next_where(&mut on_first, "/membership/updated", |m| {
        m["added_devices"][0]["id"] == ID
    })
    .await;
    assert_eq!(twin_get(&mut on_first).await, Ok("30".to_owned()));
    move_to(&cluster, &second_bridge.node_id).await;
    next_where(&mut on_first, "/membership/updated", |m| {
        m["removed_devices"][0]["id"] == ID
    })
    .await;
    next_where(&mut on_second, "/membership/updated", |m| {
        m["added_devices"][0]["id"] == ID
    })
    .await;
    // The first node's mapper can neither read nor write the twin any more.
    assert_eq!(twin_get(&mut on_first).await, Err(404));
    on_first
        .subscribe(&format!("$hw/events/device/{ID}/twin/update/result"))
        .await;
    on_first
        .publish(
            &format!("$hw/events/device/{ID}/twin/update"),
            json!({"event_id": "w1", "timestamp": 0,
                   "twin": {"temp": {"actual": {"value": "1"}, "metadata": {"type": "int"}}}})
            .to_string(),
        )
        .await;
    let refused = next_where(&mut on_first, "/twin/update/result", |r| {
        r["event_id"] == "w1"
    })
    .await;
    assert_eq!(refused["code"], 404, "{refused}");
    assert_eq!(twin_get(&mut on_second).await, Ok("30".to_owned()));
    // Desired values now go to the second node only.
    set_desired(&cluster, "7").await;
    delta_of(&mut on_second, "7").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_offline_while_fifty_desired_values_change_gets_the_latest() {
    let cluster = Cluster::start().await;
    let cloud = CloudBroker::start().await;
    let controller = Controller::start(&cluster, &cloud);
    let (mut node, bridge) = bridged(&cloud).await;
    let mut first = mapper(&node, &bridge).await;
    apply_device(&cluster, &bridge.node_id);
    assert_eq!(
        wait_until("the device on the node", WAIT, async || {
            twin_get(&mut first).await.map_err(|c| format!("code {c}"))
        })
        .await,
        "30"
    );
    drop(first);
    node.kill9();
    for i in 1..=50 {
        set_desired(&cluster, &i.to_string()).await;
    }
    node.restart().await;
    let mut mapper = mapper(&node, &bridge).await;
    let latest = wait_until(
        "the latest desired value on the node",
        WAIT,
        async || match twin_get(&mut mapper).await {
            Ok(v) if v == "50" => Ok(v),
            other => Err(format!("{other:?}\n--- controller\n{}", controller.log())),
        },
    )
    .await;
    assert_eq!(latest, "50");
    // Nothing older arrives afterwards (resends of what was in flight are refused by version).
    assert_quiet_for(
        "an older desired value",
        Duration::from_secs(2),
        async || match twin_get(&mut mapper).await {
            Ok(v) if v == "50" => None,
            other => Some(format!("{other:?}")),
        },
    )
    .await;
}

/// `kubectl patch device beta1-device --type json -p <patch>`: the output.
pub(super) fn kubectl_patch_json(cluster: &Cluster, name: &str, patch: &Value) -> String {
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(["patch", "device", name, "--type", "json", "-p"])
        .arg(patch.to_string())
        .output()
        .expect("kubectl is installed (scripts/test installs kubernetes-client)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "kubectl patch failed: {text}");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_patch_sets_a_desired_value_and_removing_it_removes_it_on_the_node() {
    let cluster = Cluster::start().await;
    let cloud = CloudBroker::start().await;
    let _controller = Controller::start(&cluster, &cloud);
    let (node, bridge) = bridged(&cloud).await;
    let mut mapper = mapper(&node, &bridge).await;
    apply_device(&cluster, &bridge.node_id);
    assert_eq!(
        wait_until("the device on the node", WAIT, async || {
            twin_get(&mut mapper).await.map_err(|c| format!("code {c}"))
        })
        .await,
        "30"
    );
    // One property of the list edited in place, as users do with a JSON patch.
    let out = kubectl_patch_json(
        &cluster,
        DEVICE,
        &json!([{"op": "test", "path": "/spec/properties/0/name", "value": "temp"},
                {"op": "replace", "path": "/spec/properties/0/desired/value", "value": "55"}]),
    );
    assert!(out.contains("patched"), "{out}");
    delta_of(&mut mapper, "55").await;
    // A failing `test` changes nothing and is refused.
    let refused = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(cluster.kubeconfig())
        .args(["patch", "device", DEVICE, "--type", "json", "-p"])
        .arg(r#"[{"op":"test","path":"/spec/properties/0/name","value":"other"},{"op":"replace","path":"/spec/nodeName","value":"nowhere"}]"#)
        .output()
        .expect("kubectl");
    assert!(!refused.status.success());
    let device = api(&cluster, "Device", "devices")
        .get(DEVICE)
        .await
        .expect("device");
    assert_eq!(device.data["spec"]["nodeName"], bridge.node_id.as_str());
    // The desired value removed from the Device is removed on the node.
    kubectl_patch_json(
        &cluster,
        DEVICE,
        &json!([{"op": "remove", "path": "/spec/properties/0/desired"}]),
    );
    let gone = wait_until(
        "the desired value gone on the node",
        WAIT,
        async || match twin_get(&mut mapper).await {
            Ok(v) if v.is_empty() => Ok(v),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    assert_eq!(gone, "");
}
