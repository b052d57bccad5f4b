//! Devices end to end (issue 13, docs/devices.md): the tests play a KubeEdge mapper against the
//! real node over real MQTT on KubeEdge's `$hw/...` and `$ke/...` topics, and the cloud's
//! devicecontroller through the bridge to a real mosquitto. Payloads are KubeEdge's own shapes;
//! each helper names the KubeEdge source it copies (KubeEdge's tests build these messages from
//! the Go structs, `dttype/types.go`, rather than from JSON literals).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cloud::{await_signal, bridged, cloud_client, tail, CONNECTION};
use common::pki::Pki;
use common::raw::{self, Raw};
use common::Options;
use common::{forward_lines, readme_section_commands, QUIET, WAIT};
use common::{
    paho_script, shell_words, unique_id, wait_until, Client, CloudBroker, CloudOptions, Msg, Node,
};
use serde_json::{json, Value};

/// `cloud.node_id` when the configuration sets none: what a standalone node calls itself.
const NODE: &str = "edge-node";

/// The local topic of the cloud's membership updates: what the bridge submits to the
/// MetaManager for `<root>/<node>/down/devicecontroller/update/node/membership` (protocol §5).
const MEMBERSHIP: &str = "ke/meta/devicecontroller/update/node/membership";

/// How long a twin report may take to be answered with the cloud away: "at once".
const LOCAL_ANSWER: Duration = Duration::from_secs(2);

/// What a mapper listens to for its device (mapper-framework subscribes to the delta, KubeEdge's
/// e2e `tests/e2e/utils/common.go` to the get result; the others answer what it asks).
const ANSWERS: [&str; 5] = [
    "twin/update/result",
    "twin/update/document",
    "twin/update/delta",
    "twin/get/result",
    "state/update/result",
];

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// `$hw/events/device/<id>/<rest>` (`dtcommon/common.go` `DeviceETPrefix` and suffixes).
fn device_topic(id: &str, rest: &str) -> String {
    format!("$hw/events/device/{id}/{rest}")
}

/// `$hw/events/node/<node>/<rest>` (`dtcommon/common.go` `MemETPrefix` and suffixes).
fn node_topic(node: &str, rest: &str) -> String {
    format!("$hw/events/node/{node}/{rest}")
}

/// The device's name: the last level of its id (`<namespace>/<name>` from KubeEdge 1.15).
fn name_of(id: &str) -> &str {
    id.rsplit('/').next().expect("an id")
}

/// The device's namespace in cloud envelopes: `_` for a one-level id (docs/devices.md).
fn namespace_of(id: &str) -> &str {
    id.split_once('/').map_or("_", |(ns, _)| ns)
}

/// `<namespace>/<kind>/<name>`: how a cloud envelope names the device (`devicetwin`,
/// `devicestate`, `devicedata`).
fn cloud_resource(id: &str, kind: &str) -> String {
    format!("{}/{kind}/{}", namespace_of(id), name_of(id))
}

/// The twins the cloud's devicecontroller sends for `(property, desired value, type)`:
/// `createDevice` and `addUpdatedTwins` in `cloud/pkg/devicecontroller/controller/downstream.go`
/// (v1.13.0): the desired value as `expected` with a timestamp, `optional: false`, the type from
/// the desired metadata, and `expected_version {cloud: <the Device's resourceVersion>, edge: 0}`.
fn desired_twins(twins: &[(&str, &str, &str)], resource_version: i64) -> Value {
    let mut out = serde_json::Map::new();
    for (property, value, kind) in twins {
        out.insert(
            (*property).to_owned(),
            json!({
                "expected": {"value": value, "metadata": {"timestamp": now_ms()}},
                "optional": false,
                "metadata": {"type": kind},
                "expected_version": {"cloud": resource_version, "edge": 0},
            }),
        );
    }
    Value::Object(out)
}

/// A `types.Device` as `createDevice` (downstream.go) builds it: `id` and `name` from the Device
/// (`util.GetResourceID(namespace, name)` as the id from KubeEdge 1.15), and its twins.
fn cloud_device(id: &str, twins: &[(&str, &str, &str)], resource_version: i64) -> Value {
    json!({
        "id": id,
        "name": name_of(id),
        "twin": desired_twins(twins, resource_version),
    })
}

/// `types.MembershipUpdate` as `deviceAdded` (downstream.go) sends it: one device added per
/// message, `removed_devices` a nil slice.
fn membership_added(device: Value) -> Value {
    json!({
        "event_id": unique_id("event"),
        "timestamp": now_ms(),
        "added_devices": [device],
        "removed_devices": null,
    })
}

/// `types.MembershipUpdate` as `deviceDeleted` (downstream.go) sends it.
fn membership_removed(device: Value) -> Value {
    json!({
        "event_id": unique_id("event"),
        "timestamp": now_ms(),
        "added_devices": null,
        "removed_devices": [device],
    })
}

/// `types.DeviceTwinUpdate` as `deviceUpdated` (downstream.go) sends it on
/// `node/<node>/device/<id>/twin/cloud_updated`: the changed desired values.
fn desired_update(twins: &[(&str, &str, &str)], resource_version: i64) -> Value {
    json!({
        "event_id": unique_id("event"),
        "timestamp": now_ms(),
        "twin": desired_twins(twins, resource_version),
    })
}

/// A full envelope from the cloud's devicecontroller: `msg.BuildRouter(
/// modules.DeviceControllerModuleName, constants.GroupTwin, resource, model.UpdateOperation)`.
fn devicecontroller(resource: &str, content: Value) -> String {
    json!({
        "header": {"msg_id": unique_id("msg"), "timestamp": now_ms()},
        "route": {
            "source": "devicecontroller",
            "group": "twin",
            "operation": "update",
            "resource": resource,
        },
        "content": content,
    })
    .to_string()
}

/// The cloud's devicecontroller, seen from the node: membership changes on the local topic the
/// bridge would submit them on (a standalone node), or published on the cloud broker.
enum Controller<'a> {
    Local(Client),
    Cloud(Client, &'a CloudOptions),
}

/// A mapper for `id` that was connected when the cloud added the device (a `temperature` twin,
/// desired 20, resourceVersion 100), once the node has told it so.
async fn thermometer_added(
    node: &Node,
    controller: &Controller<'_>,
    id: &str,
    node_id: &str,
) -> Mapper {
    let mut mapper = Mapper::connect_to(node, id, node_id).await;
    controller
        .add(cloud_device(id, &[("temperature", "20", "int")], 100))
        .await;
    mapper.added().await;
    mapper
}

impl Controller<'_> {
    async fn local(node: &Node) -> Controller<'static> {
        Controller::Local(node.client().await)
    }

    async fn cloud<'a>(cloud: &CloudBroker, bridge: &'a CloudOptions) -> Controller<'a> {
        Controller::Cloud(cloud.client(&unique_id("devicecontroller")).await, bridge)
    }

    /// Sends `rest` (`devicecontroller/update/...`, after `down/` or `ke/meta/`).
    async fn send(&self, rest: &str, resource: &str, content: Value) {
        let payload = devicecontroller(resource, content);
        match self {
            Controller::Local(client) => client.publish(&format!("ke/meta/{rest}"), payload).await,
            Controller::Cloud(client, bridge) => client.publish(&bridge.down(rest), payload).await,
        }
    }

    async fn add(&self, device: Value) {
        self.send(
            "devicecontroller/update/node/membership",
            "node/membership",
            membership_added(device),
        )
        .await;
    }

    async fn remove(&self, device: Value) {
        self.send(
            "devicecontroller/update/node/membership",
            "node/membership",
            membership_removed(device),
        )
        .await;
    }

    /// The cloud's new desired values for device `id`.
    async fn desire(&self, id: &str, twins: &[(&str, &str, &str)], resource_version: i64) {
        self.send(
            &format!("devicecontroller/update/{}/devicetwin", namespace_of(id)),
            &cloud_resource(id, "devicetwin"),
            desired_update(twins, resource_version),
        )
        .await;
    }
}

/// A KubeEdge mapper for one device, subscribed to what the node tells it ([`ANSWERS`]) and to
/// the node's membership changes. What arrives while it waits for something else is kept until
/// a test takes it: the node publishes a change's messages in an order the tests do not fix
/// (KubeEdge's own sends the delta of an added device before the membership update).
struct Mapper {
    client: Client,
    id: String,
    node: String,
    pending: Vec<Msg>,
}

impl Mapper {
    /// A standalone node on which the cloud added device `id` with `twins` (resource version
    /// 100), and the device's mapper, which has seen the add.
    async fn on_new_node(id: &str, twins: &[(&str, &str, &str)]) -> (Node, Mapper) {
        let node = Node::start().await;
        let mapper = Mapper::on_node(&node, id, twins).await;
        (node, mapper)
    }

    /// A mapper for device `id` with `twins`, which the cloud has just added to `node`.
    async fn on_node(node: &Node, id: &str, twins: &[(&str, &str, &str)]) -> Mapper {
        let controller = Controller::local(node).await;
        let mut mapper = Mapper::connect(node, id).await;
        controller.add(cloud_device(id, twins, 100)).await;
        mapper.added().await;
        mapper
    }

    async fn connect(node: &Node, id: &str) -> Mapper {
        Mapper::connect_to(node, id, NODE).await
    }

    /// A mapper on a node whose `cloud.node_id` is `node_id`.
    async fn connect_to(node: &Node, id: &str, node_id: &str) -> Mapper {
        let mut client = Client::connect(node.port, &unique_id("mapper")).await;
        for rest in ANSWERS {
            client.subscribe(&device_topic(id, rest)).await;
        }
        client
            .subscribe(&node_topic(node_id, "membership/updated"))
            .await;
        Mapper {
            client,
            id: id.to_owned(),
            node: node_id.to_owned(),
            pending: Vec::new(),
        }
    }

    fn topic(&self, rest: &str) -> String {
        device_topic(&self.id, rest)
    }

    /// Publishes `body` with a fresh `event_id` and the `timestamp` (`dttype.BaseMessage`) on
    /// the device's `rest` topic; returns the event id.
    async fn send(&self, rest: &str, mut body: Value) -> String {
        let event_id = unique_id("event");
        body["event_id"] = json!(event_id);
        body["timestamp"] = json!(now_ms());
        self.client
            .publish(&self.topic(rest), body.to_string())
            .await;
        event_id
    }

    /// Reports measured values as mapper-framework's `CreateMessageTwinUpdate`
    /// (`mapper-framework/pkg/common/event.go`) does, the actual value and the type of each
    /// `(property, value, type)`; returns the event id.
    async fn report(&self, twins: &[(&str, &str, &str)]) -> String {
        let mut twin = serde_json::Map::new();
        for (property, value, kind) in twins {
            twin.insert(
                (*property).to_owned(),
                json!({"actual": {"value": value}, "metadata": {"type": kind}}),
            );
        }
        self.send("twin/update", json!({ "twin": twin })).await
    }

    /// The first message on `topic` (kept or arriving within [`WAIT`]) whose payload `matches`;
    /// every other message is kept.
    async fn take(&mut self, topic: &str, what: &str, matches: impl Fn(&Value) -> bool) -> Value {
        if let Some(i) = self
            .pending
            .iter()
            .position(|m| m.topic == topic && matches(&json_of(m)))
        {
            return json_of(&self.pending.remove(i));
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.client.next_within(left).await {
                Some(m) if m.topic == topic && matches(&json_of(&m)) => return json_of(&m),
                Some(m) => self.pending.push(m),
                None => {
                    let there: Vec<_> = self
                        .pending
                        .iter()
                        .filter(|m| m.topic == topic)
                        .map(|m| String::from_utf8_lossy(&m.payload))
                        .collect();
                    panic!("no {what} on {topic} within {WAIT:?}; there: {there:#?}")
                }
            }
        }
    }

    /// Asserts that nothing is (or comes within [`QUIET`]) on the device's `rest` topic.
    async fn quiet(&mut self, rest: &str) {
        let topic = self.topic(rest);
        self.pending.extend(self.client.drain(QUIET).await);
        let there: Vec<_> = self.pending.iter().filter(|m| m.topic == topic).collect();
        assert!(there.is_empty(), "unexpected on {topic}: {there:?}");
    }

    /// Discards what was kept and what arrives within [`QUIET`].
    async fn forget(&mut self) {
        self.client.drain(QUIET).await;
        self.pending.clear();
    }

    /// The answer on the device's `rest` topic to the request `event_id`.
    async fn answer(&mut self, rest: &str, event_id: &str) -> Value {
        let topic = self.topic(rest);
        self.take(&topic, &format!("answer to {event_id}"), |m| {
            m["event_id"] == event_id
        })
        .await
    }

    /// The next message on the device's `rest` topic for which `matches` holds.
    async fn next(&mut self, rest: &str, what: &str, matches: impl Fn(&Value) -> bool) -> Value {
        let topic = self.topic(rest);
        self.take(&topic, what, matches).await
    }

    /// The twin as `twin/get/result` shows it.
    async fn get(&mut self) -> Value {
        let event_id = self.send("twin/get", json!({})).await;
        let got = self.answer("twin/get/result", &event_id).await;
        assert!(got["code"].is_null(), "{got}");
        got
    }

    /// The next `membership/updated` that `matches`.
    async fn membership_updated(&mut self, what: &str, matches: impl Fn(&Value) -> bool) -> Value {
        let topic = node_topic(&self.node, "membership/updated");
        self.take(&topic, what, matches).await
    }

    /// Waits for the `membership/updated` that adds this device.
    async fn added(&mut self) -> Value {
        let id = self.id.clone();
        let updated = self
            .membership_updated(&format!("{id} added"), |u| {
                u["added_devices"][0]["id"] == id.as_str()
            })
            .await;
        let devices = updated["added_devices"].as_array().expect("added_devices");
        assert_eq!(devices.len(), 1, "one message per device: {updated}");
        assert!(
            updated["removed_devices"]
                .as_array()
                .is_none_or(Vec::is_empty),
            "{updated}"
        );
        updated
    }
}

/// A payload as JSON, or null if it is not JSON.
fn json_of(m: &Msg) -> Value {
    serde_json::from_slice(&m.payload).unwrap_or(Value::Null)
}

/// A version column (`{"cloud":N,"edge":M}` as text) as JSON.
fn version(column: &Value) -> Value {
    let text = column
        .as_str()
        .unwrap_or_else(|| panic!("a version as text: {column}"));
    serde_json::from_str(text).unwrap_or_else(|e| panic!("version {text:?}: {e}"))
}

/// Whether `text` looks like an RFC 3339 time (`2024-11-22T08:00:00Z`, `…+01:00`, `….123Z`).
fn is_rfc3339(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() >= 20
        && b[..4].iter().all(u8::is_ascii_digit)
        && (b[4], b[7], b[10], b[13], b[16]) == (b'-', b'-', b'T', b':', b':')
        && (text.ends_with('Z') || b[b.len() - 6] == b'+' || b[b.len() - 6] == b'-')
}

/// The device's rows in `device_twin`, by twin name.
async fn twin_rows(node: &Node, id: &str) -> Vec<Value> {
    node.rows(&format!(
        "SELECT name, expected, actual, expected_version, actual_version, attr_type \
         FROM device_twin WHERE deviceid = '{id}' ORDER BY name"
    ))
    .await
}

/// Everything the device tables hold, for "nothing changed" checks.
async fn device_tables(node: &Node) -> Vec<Value> {
    let mut all = node.rows("SELECT * FROM device ORDER BY id").await;
    all.extend(node.rows("SELECT * FROM device_attr ORDER BY id").await);
    all.extend(node.rows("SELECT * FROM device_twin ORDER BY id").await);
    all
}

/// Whether a stored value column holds nothing (KubeEdge stores an empty string).
fn unset(column: &Value) -> bool {
    column.is_null() || column == ""
}

/// A report whose sync starts at once (its mapper alone on the node) is answered in one write:
/// its result and its PUBACK together, once the report is durable, rather than the result at
/// the commit and the PUBACK after the sync, two writes and two wake-ups of the mapper. Not
/// every time: the connection's task may write the result itself if it runs between the
/// commit and the sync. Every report gets both, and the last one is stored.
#[tokio::test]
async fn a_reports_result_shares_a_write_with_its_puback_once_durable() {
    let (node, _mapper) = Mapper::on_new_node("meter-1", &[("power", "0", "int")]).await;
    let (mut raw, code) = Raw::connected(node.port, &raw::connect(false, "meter-1-raw", &[])).await;
    assert_eq!(code, 0);
    let result_topic = device_topic("meter-1", "twin/update/result");
    raw.send(&raw::subscribe(false, 1, result_topic.as_bytes()))
        .await;
    let suback = raw.next().await.expect("a SUBACK");
    assert_eq!(suback.kind(), 9, "{suback:?}");
    let topic = device_topic("meter-1", "twin/update");
    let mut shared = 0;
    for value in 1..=10 {
        // Nobody else commits within the sync delay, so the report's sync starts at once.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let report = json!({
            "event_id": unique_id("event"),
            "timestamp": now_ms(),
            "twin": {"power": {"actual": {"value": value.to_string()}, "metadata": {"type": "int"}}},
        });
        raw.send(&raw::publish(
            false,
            topic.as_bytes(),
            1,
            report.to_string().as_bytes(),
        ))
        .await;
        let first = raw.next_write().await;
        let mut frames = first.clone();
        while frames.len() < 2 {
            frames.push(raw.next().await.expect("the node stays connected"));
        }
        let mut kinds: Vec<u8> = frames.iter().map(raw::Frame::kind).collect();
        kinds.sort_unstable();
        assert_eq!(kinds, [3, 4], "the result and the PUBACK: {frames:?}");
        shared += usize::from(first.len() == 2);
        let ack = frames.iter().find(|f| f.kind() == 4).expect("a PUBACK");
        assert_eq!(ack.body, [0, 1], "the PUBACK of packet 1: {frames:?}");
        let publish = frames.iter().find(|f| f.kind() == 3).expect("the result");
        let body = &publish.body;
        let topic_len = usize::from(u16::from_be_bytes([body[0], body[1]]));
        assert_eq!(&body[2..2 + topic_len], result_topic.as_bytes());
        let id_len = if publish.first & 0x06 == 0 { 0 } else { 2 };
        let result: Value = serde_json::from_slice(&body[2 + topic_len + id_len..]).expect("JSON");
        assert_eq!(
            result["twin"]["power"]["actual"]["value"],
            value.to_string(),
            "{result}"
        );
        if publish.first & 0x06 != 0 {
            // QoS 1: the mapper acknowledges the result, as a client does.
            raw.send(&raw::packet(0x40, &body[2 + topic_len..2 + topic_len + 2]))
                .await;
        }
    }
    assert!(shared >= 1, "no report's result shared its PUBACK's write");
    let twins = twin_rows(&node, "meter-1").await;
    assert_eq!(twins[0]["actual"], "10", "{twins:?}");
}

/// A paho-mqtt mapper leaves Nagle's algorithm on: after it acknowledges a result, its next
/// report waits in its socket until the node's TCP ACK, which the kernel delays 40 ms when the
/// node has nothing to send back. For a client that writes again that soon the node sends the
/// ACK at once (`AckNow`), over plain TCP and TLS alike; only its first reports may wait.
#[tokio::test]
async fn a_python_mapper_with_nagles_algorithm_is_answered_without_the_delayed_ack() {
    let (node, _mapper) = Mapper::on_new_node("meter-2", &[("power", "0", "int")]).await;
    nagle_mapper_answered(&node, node.port, "meter-2", None).await;
}

#[tokio::test]
async fn a_python_mapper_with_nagles_algorithm_over_tls_is_answered_without_the_delayed_ack() {
    let pki = Pki::new();
    let tls_port = common::free_port();
    let node = Node::start_with(Options {
        extra_listeners: pki.listener(tls_port),
        ..Options::default()
    })
    .await;
    let _mapper = Mapper::on_node(&node, "meter-3", &[("power", "0", "int")]).await;
    let ca = pki.path("ca.pem").display().to_string();
    nagle_mapper_answered(&node, tls_port, "meter-3", Some(&ca)).await;
}

/// Runs `tests/py/nagle_mapper.py` for `device` on `port` (over TLS trusting `ca`): 30 reports,
/// each answered, at most two of them held for the kernel's delayed ACK, the last one stored.
async fn nagle_mapper_answered(node: &Node, port: u16, device: &str, ca: Option<&str>) {
    let port = port.to_string();
    let mut args = vec![port.as_str(), device, "30"];
    args.extend(ca);
    let (printed, stderr) = paho_script("nagle_mapper.py", &args).await;
    assert!(
        printed.starts_with("answered 30 of 30;"),
        "{printed} {stderr}"
    );
    // Held for the delayed ACK, a report waits ~35 ms (40 less the mapper's 5 ms pause). Before
    // the node acknowledged at once, 24–28 of 30 over plain TCP were held, and 5–20 over TLS.
    let held: usize = printed
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|count| count.parse().ok())
        .expect("a count of held reports");
    assert!(
        held <= 2,
        "reports held for the node's delayed ACK: {printed}"
    );
    let twins = twin_rows(node, device).await;
    assert_eq!(twins[0]["actual"], "29", "{twins:?}");
}

#[tokio::test]
async fn a_mapper_reads_and_reports_its_twin_and_state_on_a_standalone_node() {
    let node = Node::start().await;
    let mut mapper = Mapper::connect(&node, "thermo-1").await;
    let controller = Controller::local(&node).await;

    // The cloud adds the device with a desired temperature: the membership message, as the
    // bridge would submit it.
    controller
        .add(cloud_device(
            "thermo-1",
            &[("temperature", "20", "int")],
            100,
        ))
        .await;
    let updated = mapper.added().await;
    let device = &updated["added_devices"][0];
    assert_eq!(device["name"], "thermo-1", "{updated}");
    let twin = &device["twin"]["temperature"];
    assert_eq!(twin["expected"]["value"], "20", "{updated}");
    assert_eq!(twin["metadata"]["type"], "int", "{updated}");
    // `MarshalMembershipUpdate` (dttype/types.go) leaves versions out for devices.
    assert!(twin.get("expected_version").is_none(), "{updated}");
    // The add is a change while the expected value differs from the (absent) actual one:
    // KubeEdge's `DealDeviceTwin` publishes a delta after it.
    let delta = mapper
        .next("twin/update/delta", "delta towards 20", |d| {
            d["delta"]["temperature"] == "20"
        })
        .await;
    assert_eq!(delta["twin"]["temperature"]["expected"]["value"], "20");
    assert!(
        unset(&delta["twin"]["temperature"]["actual"]["value"]),
        "{delta}"
    );

    // KubeEdge's tables in the same file.
    let devices = node.rows("SELECT id, name FROM device").await;
    assert_eq!(devices, vec![json!({"id": "thermo-1", "name": "thermo-1"})]);
    let twins = twin_rows(&node, "thermo-1").await;
    assert_eq!(twins.len(), 1, "{twins:?}");
    assert_eq!(twins[0]["name"], "temperature");
    assert_eq!(twins[0]["expected"], "20");
    assert!(unset(&twins[0]["actual"]), "{twins:?}");
    assert_eq!(twins[0]["attr_type"], "int");
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 100, "edge": 0})
    );

    // The mapper asks for its twin.
    let got = mapper.get().await;
    let twin = &got["twin"]["temperature"];
    assert_eq!(twin["expected"]["value"], "20", "{got}");
    assert_eq!(twin["metadata"]["type"], "int", "{got}");
    assert!(twin.get("expected_version").is_none(), "{got}");

    // It reports the measured value.
    let event_id = mapper.report(&[("temperature", "25", "int")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert!(result["code"].is_null(), "{result}");
    assert_eq!(
        result["twin"]["temperature"]["actual"]["value"], "25",
        "{result}"
    );
    assert!(result["timestamp"].is_i64(), "{result}");
    let document = mapper
        .next("twin/update/document", "document with actual 25", |d| {
            d["twin"]["temperature"]["current"]["actual"]["value"] == "25"
        })
        .await;
    let doc = &document["twin"]["temperature"];
    assert_eq!(doc["last"]["expected"]["value"], "20", "{document}");
    assert!(unset(&doc["last"]["actual"]["value"]), "{document}");
    assert_eq!(doc["current"]["expected"]["value"], "20", "{document}");
    let delta = mapper
        .next("twin/update/delta", "delta with actual 25", |d| {
            d["twin"]["temperature"]["actual"]["value"] == "25"
        })
        .await;
    assert_eq!(delta["delta"], json!({"temperature": "20"}), "{delta}");
    let twins = twin_rows(&node, "thermo-1").await;
    assert_eq!(twins[0]["actual"], "25");
    // A device's update adds 1 to `edge` of the value it sets; the expected one is untouched.
    assert_eq!(
        version(&twins[0]["actual_version"]),
        json!({"cloud": 0, "edge": 1})
    );
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 100, "edge": 0})
    );

    // The device reaches the desired value: a document, and no delta any more.
    let event_id = mapper.report(&[("temperature", "20", "int")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(result["twin"]["temperature"]["actual"]["value"], "20");
    let document = mapper
        .next("twin/update/document", "document with actual 20", |d| {
            d["twin"]["temperature"]["current"]["actual"]["value"] == "20"
        })
        .await;
    assert_eq!(
        document["twin"]["temperature"]["last"]["actual"]["value"],
        "25"
    );
    mapper.quiet("twin/update/delta").await;
    let got = mapper.get().await;
    assert_eq!(got["twin"]["temperature"]["actual"]["value"], "20", "{got}");
    assert_eq!(
        version(&twin_rows(&node, "thermo-1").await[0]["actual_version"]),
        json!({"cloud": 0, "edge": 2})
    );

    // The node's membership, asked on its own topic and on another node's (answered on this
    // node's topic, as KubeEdge's `dealMembershipGet` does).
    let mut asker = node.client().await;
    let result_topic = node_topic(NODE, "membership/get/result");
    asker.subscribe(&result_topic).await;
    for node_id in [NODE, "some-other-node"] {
        let event_id = unique_id("event");
        asker
            .publish(
                &node_topic(node_id, "membership/get"),
                json!({"event_id": event_id, "timestamp": now_ms()}).to_string(),
            )
            .await;
        let result = asker
            .expect_matching(&result_topic, "membership", |m| {
                json_of(m)["event_id"] == event_id.as_str()
            })
            .await
            .json();
        let devices = result["devices"].as_array().expect("devices");
        assert_eq!(devices.len(), 1, "{result}");
        assert_eq!(devices[0]["id"], "thermo-1", "{result}");
        assert_eq!(devices[0]["name"], "thermo-1", "{result}");
    }

    // The device goes online.
    let event_id = mapper
        .send("state/update", json!({"state": "online"}))
        .await;
    let result = mapper.answer("state/update/result", &event_id).await;
    assert_eq!(result["device"]["name"], "thermo-1", "{result}");
    assert_eq!(result["device"]["state"], "online", "{result}");
    let last_online = result["device"]["lastOnlineTime"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(is_rfc3339(&last_online), "{result}");
    let devices = node.rows("SELECT state, last_online FROM device").await;
    assert_eq!(devices[0]["state"], "online", "{devices:?}");
    assert!(!unset(&devices[0]["last_online"]), "{devices:?}");

    // The cloud removes the device: its rows go, and the mapper is told.
    controller
        .remove(cloud_device(
            "thermo-1",
            &[("temperature", "20", "int")],
            100,
        ))
        .await;
    let updated = mapper
        .membership_updated("thermo-1 removed", |u| {
            u["removed_devices"][0]["id"] == "thermo-1"
        })
        .await;
    assert!(
        updated["added_devices"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{updated}"
    );
    assert_eq!(device_tables(&node).await, Vec::<Value>::new());
    let event_id = mapper.report(&[("temperature", "21", "int")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(result["code"], 404, "{result}");
}

#[tokio::test]
async fn a_two_level_device_id_has_its_own_topics_and_rows() {
    let node = Node::start().await;
    let controller = Controller::local(&node).await;
    // KubeEdge ≥ 1.15 names a device `<namespace>/<name>`; a one-level device of the same name
    // is another device.
    let mut mapper = Mapper::connect(&node, "default/thermo-2").await;
    let mut old = Mapper::connect(&node, "thermo-2").await;
    controller
        .add(cloud_device(
            "default/thermo-2",
            &[("humidity", "40.5", "float")],
            7,
        ))
        .await;
    let updated = mapper.added().await;
    assert_eq!(updated["added_devices"][0]["name"], "thermo-2", "{updated}");
    controller
        .add(cloud_device("thermo-2", &[("temperature", "20", "int")], 8))
        .await;
    old.added().await;

    let event_id = mapper.report(&[("humidity", "41.5", "float")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(
        result["twin"]["humidity"]["actual"]["value"], "41.5",
        "{result}"
    );
    let delta = mapper
        .next("twin/update/delta", "delta with actual 41.5", |d| {
            d["twin"]["humidity"]["actual"]["value"] == "41.5"
        })
        .await;
    assert_eq!(delta["delta"], json!({"humidity": "40.5"}), "{delta}");
    let got = mapper.get().await;
    assert_eq!(got["twin"]["humidity"]["actual"]["value"], "41.5", "{got}");
    assert!(got["twin"].get("temperature").is_none(), "{got}");
    let got = old.get().await;
    assert!(got["twin"].get("humidity").is_none(), "{got}");
    assert!(
        unset(&got["twin"]["temperature"]["actual"]["value"]),
        "{got}"
    );

    let event_id = mapper.send("state/update", json!({"state": "ok"})).await;
    let result = mapper.answer("state/update/result", &event_id).await;
    assert_eq!(result["device"]["name"], "thermo-2", "{result}");
    assert_eq!(result["device"]["state"], "ok", "{result}");
    assert!(
        result["device"]["lastOnlineTime"]
            .as_str()
            .is_some_and(is_rfc3339),
        "{result}"
    );

    let devices = node
        .rows("SELECT id, name, state FROM device ORDER BY id")
        .await;
    assert_eq!(devices.len(), 2, "{devices:?}");
    assert_eq!(
        (&devices[0]["id"], &devices[0]["name"], &devices[0]["state"]),
        (&json!("default/thermo-2"), &json!("thermo-2"), &json!("ok")),
        "{devices:?}"
    );
    assert_eq!(devices[1]["id"], "thermo-2", "{devices:?}");
    let twins = twin_rows(&node, "default/thermo-2").await;
    assert_eq!(twins.len(), 1, "{twins:?}");
    assert_eq!(
        (
            &twins[0]["name"],
            &twins[0]["expected"],
            &twins[0]["actual"]
        ),
        (&json!("humidity"), &json!("40.5"), &json!("41.5"))
    );
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 7, "edge": 0})
    );
}

#[tokio::test]
async fn the_cloud_adds_devices_sets_desired_values_and_hears_reports_and_states() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut up = cloud_client(&cloud, &bridge.up("twin/#")).await;
    let controller = Controller::cloud(&cloud, &bridge).await;

    for id in ["thermo-1", "default/thermo-2"] {
        let mut mapper = thermometer_added(&node, &controller, id, &bridge.node_id).await;
        mapper
            .next("twin/update/delta", "delta towards 20", |d| {
                d["delta"]["temperature"] == "20"
            })
            .await;

        // A new desired value (the Device's resourceVersion went up): the mapper is told.
        controller
            .desire(id, &[("temperature", "30", "int")], 101)
            .await;
        let delta = mapper
            .next("twin/update/delta", "delta towards 30", |d| {
                d["delta"]["temperature"] == "30"
            })
            .await;
        assert_eq!(
            delta["twin"]["temperature"]["expected"]["value"], "30",
            "{delta}"
        );
        let twins = twin_rows(&node, id).await;
        assert_eq!(twins[0]["expected"], "30", "{twins:?}");
        assert_eq!(
            version(&twins[0]["expected_version"]),
            json!({"cloud": 101, "edge": 0})
        );

        // The mapper reports: the cloud hears the new actual value with its version.
        let event_id = mapper.report(&[("temperature", "28", "int")]).await;
        mapper.answer("twin/update/result", &event_id).await;
        let devicetwin = cloud_resource(id, "devicetwin");
        let report = up
            .expect_matching(
                &bridge.up(&format!("twin/update/{}/devicetwin", namespace_of(id))),
                &format!("{devicetwin} with actual 28"),
                |m| m.resource() == devicetwin,
            )
            .await;
        assert_eq!(report.operation(), "update");
        let content = report.content();
        let twin = &content["twin"]["temperature"];
        assert_eq!(twin["actual"]["value"], "28", "{content}");
        assert_eq!(
            twin["actual_version"],
            json!({"cloud": 0, "edge": 1}),
            "{content}"
        );
        assert!(content["event_id"].is_string(), "{content}");
        assert!(content["timestamp"].is_i64(), "{content}");

        // The device goes online: the cloud hears its state.
        let event_id = mapper
            .send("state/update", json!({"state": "online"}))
            .await;
        mapper.answer("state/update/result", &event_id).await;
        let devicestate = cloud_resource(id, "devicestate");
        let state = up
            .expect_matching(
                &bridge.up(&format!("twin/update/{}/devicestate", namespace_of(id))),
                &devicestate,
                |m| m.resource() == devicestate,
            )
            .await;
        assert_eq!(state.operation(), "update");
        let content = state.content();
        assert_eq!(content["device"]["name"], name_of(id), "{content}");
        assert_eq!(content["device"]["state"], "online", "{content}");
        assert!(
            content["device"]["lastOnlineTime"]
                .as_str()
                .is_some_and(is_rfc3339),
            "{content}"
        );
    }
}

#[tokio::test]
async fn reports_made_while_the_cloud_is_away_are_answered_at_once_and_reach_it_in_order() {
    let mut cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    // A persistent session: mosquitto keeps what the node sends while this client is away too.
    let mut up = cloud_client(&cloud, &bridge.up("twin/#")).await;
    let controller = Controller::cloud(&cloud, &bridge).await;
    let mut mapper = thermometer_added(&node, &controller, "thermo-1", &bridge.node_id).await;

    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    cloud.stop();
    await_signal(&mut watcher, "cloud_disconnected", WAIT, &node).await;

    for value in ["21", "22", "23"] {
        let started = Instant::now();
        let event_id = mapper.report(&[("temperature", value, "int")]).await;
        let result = mapper.answer("twin/update/result", &event_id).await;
        let took = started.elapsed();
        assert!(
            took < LOCAL_ANSWER,
            "answered in {took:?} with the cloud away"
        );
        assert_eq!(result["twin"]["temperature"]["actual"]["value"], value);
    }
    let got = mapper.get().await;
    assert_eq!(got["twin"]["temperature"]["actual"]["value"], "23", "{got}");
    assert!(
        node.outbox_len().await >= 3,
        "the reports wait in the outbox"
    );

    // The cloud returns: the reports arrive in order (a redelivery repeats its msg_id and is
    // skipped), and the node asks for its membership (KubeEdge's `detailRequest` on connect).
    cloud.restart().await;
    let reports = bridge.up("twin/update/_/devicetwin");
    let detail = bridge.up("twin/query/node/membershipdetail");
    let mut first_seen: Vec<(String, Value)> = Vec::new();
    let mut detail_request = None;
    wait_until(
        "three reports and the detail request in the cloud",
        Duration::from_secs(30),
        async || {
            for m in up.drain(Duration::from_millis(250)).await {
                if m.topic == reports && !first_seen.iter().any(|(id, _)| *id == m.msg_id()) {
                    assert_eq!(m.resource(), "_/devicetwin/thermo-1");
                    first_seen.push((m.msg_id(), m.content()["twin"]["temperature"].clone()));
                } else if m.topic == detail {
                    detail_request = Some(m);
                }
            }
            if first_seen.len() >= 3 && detail_request.is_some() {
                Ok(())
            } else {
                Err(format!(
                    "reports {first_seen:?}, detail request {detail_request:?}; node log:\n{}",
                    tail(&node.log(), 40)
                ))
            }
        },
    )
    .await;
    let values: Vec<&Value> = first_seen
        .iter()
        .map(|(_, t)| &t["actual"]["value"])
        .collect();
    assert_eq!(values, ["21", "22", "23"], "{first_seen:?}");
    let edges: Vec<&Value> = first_seen
        .iter()
        .map(|(_, t)| &t["actual_version"]["edge"])
        .collect();
    assert_eq!(edges, [1, 2, 3], "{first_seen:?}");

    let request = detail_request.expect("detail request");
    assert_eq!(request.resource(), "node/membershipdetail");
    // KubeEdge sends this content as a JSON string; the contract shows the object.
    let mut content = request.content();
    if let Some(text) = content.as_str() {
        content = serde_json::from_str(text).expect("a JSON string");
    }
    assert_eq!(content["event_type"], "group_membership_event", "{content}");
    assert_eq!(content["operation"], "detail", "{content}");
    assert_eq!(content["group_id"], bridge.node_id.as_str(), "{content}");
}

#[tokio::test]
async fn a_desired_value_sent_while_the_node_was_killed_is_applied_after_restart() {
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let controller = Controller::cloud(&cloud, &bridge).await;
    {
        let _mapper = thermometer_added(&node, &controller, "thermo-1", &bridge.node_id).await;
    }
    // Sees what the cloud broker routes to the node: then it is also queued for its session.
    let mut spy = cloud_client(&cloud, &bridge.down("#")).await;
    node.kill9();
    // mosquitto queues it in the bridge's persistent session.
    controller
        .desire("thermo-1", &[("temperature", "35", "int")], 101)
        .await;
    let twin_topic = format!(
        "devicecontroller/update/{}/devicetwin",
        namespace_of("thermo-1")
    );
    spy.expect(&bridge.down(&twin_topic)).await;
    node.restart().await;

    // The mapper's broker restarted with the node: it connects again and asks for its twin
    // until the desired value is there.
    let mut mapper = Mapper::connect_to(&node, "thermo-1", &bridge.node_id).await;
    wait_until("desired 35 applied after the restart", WAIT, async || {
        let got = mapper.get().await;
        if got["twin"]["temperature"]["expected"]["value"] == "35" {
            Ok(())
        } else {
            Err(format!("{got}; node log:\n{}", tail(&node.log(), 40)))
        }
    })
    .await;
    let twins = twin_rows(&node, "thermo-1").await;
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 101, "edge": 0})
    );
    // A report now gets a delta towards the new desired value.
    let event_id = mapper.report(&[("temperature", "22", "int")]).await;
    mapper.answer("twin/update/result", &event_id).await;
    let delta = mapper
        .next("twin/update/delta", "delta with actual 22", |d| {
            d["twin"]["temperature"]["actual"]["value"] == "22"
        })
        .await;
    assert_eq!(delta["delta"], json!({"temperature": "35"}), "{delta}");
}

#[tokio::test]
async fn a_cloud_update_behind_the_devices_own_change_is_refused_and_the_device_value_goes_up() {
    // `dealVersion` (dtmanager/twin.go): a cloud update is applied only when it is based on the
    // stored versions, both `cloud` and `edge`; otherwise the edge's value wins and is reported.
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut up = cloud_client(&cloud, &bridge.up("twin/#")).await;
    let controller = Controller::cloud(&cloud, &bridge).await;
    let mut mapper = thermometer_added(&node, &controller, "thermo-1", &bridge.node_id).await;
    let devicetwin = bridge.up("twin/update/_/devicetwin");

    // The device changes the desired value itself (the update payload may carry `expected`).
    let event_id = mapper
        .send(
            "twin/update",
            json!({"twin": {"temperature": {"expected": {"value": "22"}, "metadata": {"type": "int"}}}}),
        )
        .await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(
        result["twin"]["temperature"]["expected"]["value"], "22",
        "{result}"
    );
    let report = up
        .expect_matching(&devicetwin, "the device's expected 22", |m| {
            m.content()["twin"]["temperature"]["expected"]["value"] == "22"
        })
        .await;
    assert_eq!(
        report.content()["twin"]["temperature"]["expected_version"],
        json!({"cloud": 100, "edge": 1})
    );

    // The cloud, not having seen it, sends a desired value based on edge version 0: refused,
    // and the device's value goes back up with its versions.
    controller
        .desire("thermo-1", &[("temperature", "30", "int")], 101)
        .await;
    let back = up
        .expect_matching(&devicetwin, "the device's expected 22 again", |m| {
            m.content()["twin"]["temperature"]["expected"]["value"] == "22"
        })
        .await;
    assert_ne!(
        back.msg_id(),
        report.msg_id(),
        "a new report, not a redelivery"
    );
    assert_eq!(
        back.content()["twin"]["temperature"]["expected_version"],
        json!({"cloud": 100, "edge": 1}),
        "{:?}",
        back.payload
    );
    let twins = twin_rows(&node, "thermo-1").await;
    assert_eq!(twins[0]["expected"], "22", "{twins:?}");
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 100, "edge": 1})
    );
    assert_eq!(
        mapper.get().await["twin"]["temperature"]["expected"]["value"],
        "22"
    );

    // Based on what the edge reported, the cloud's next value is applied.
    controller
        .send(
            "devicecontroller/update/_/devicetwin",
            "_/devicetwin/thermo-1",
            json!({
                "event_id": unique_id("event"),
                "timestamp": now_ms(),
                "twin": {"temperature": {
                    "expected": {"value": "30", "metadata": {"timestamp": now_ms()}},
                    "optional": false,
                    "metadata": {"type": "int"},
                    "expected_version": {"cloud": 102, "edge": 1},
                }},
            }),
        )
        .await;
    mapper
        .next("twin/update/delta", "delta towards 30", |d| {
            d["delta"]["temperature"] == "30"
        })
        .await;
    let twins = twin_rows(&node, "thermo-1").await;
    assert_eq!(twins[0]["expected"], "30", "{twins:?}");
    assert_eq!(
        version(&twins[0]["expected_version"]),
        json!({"cloud": 102, "edge": 1})
    );
}

#[tokio::test]
async fn the_clouds_membership_detail_adds_what_is_listed_and_removes_the_rest() {
    // `dealMembershipDetail` (dtmanager/membership.go): the cloud's full list of the node's
    // devices, the answer to the node's detail request.
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let controller = Controller::cloud(&cloud, &bridge).await;
    let mut mapper = Mapper::connect_to(&node, "thermo-1", &bridge.node_id).await;
    for id in ["thermo-1", "thermo-9"] {
        controller
            .add(cloud_device(id, &[("temperature", "20", "int")], 100))
            .await;
        mapper
            .membership_updated(&format!("{id} added"), |u| {
                u["added_devices"][0]["id"] == id
            })
            .await;
    }
    let event_id = mapper.report(&[("temperature", "25", "int")]).await;
    mapper.answer("twin/update/result", &event_id).await;

    controller
        .send(
            "devicecontroller/update/node/membershipdetail",
            "node/membershipdetail",
            json!({
                "event_id": unique_id("event"),
                "timestamp": now_ms(),
                "devices": [
                    cloud_device("thermo-1", &[("temperature", "20", "int")], 100),
                    cloud_device("thermo-3", &[("humidity", "40", "float")], 100),
                ],
            }),
        )
        .await;
    mapper
        .membership_updated("thermo-9 removed", |u| {
            u["removed_devices"][0]["id"] == "thermo-9"
        })
        .await;
    mapper
        .membership_updated("thermo-3 added", |u| {
            u["added_devices"][0]["id"] == "thermo-3"
        })
        .await;
    let devices = node.rows("SELECT id FROM device ORDER BY id").await;
    assert_eq!(
        devices,
        [json!({"id": "thermo-1"}), json!({"id": "thermo-3"})]
    );
    assert!(twin_rows(&node, "thermo-9").await.is_empty());
    assert!(node
        .rows("SELECT * FROM device_attr WHERE deviceid = 'thermo-9'")
        .await
        .is_empty());
    // A device that stays keeps what it reported.
    let got = mapper.get().await;
    assert_eq!(got["twin"]["temperature"]["actual"]["value"], "25", "{got}");
}

#[tokio::test]
async fn a_twin_the_device_added_is_deleted_with_null_and_kept_as_deleted() {
    // `DealMsgTwin` and `dealTwinAdd` / `dealTwinDelete` (dtmanager/twin.go): a device may add a
    // twin of its own (optional unless it says otherwise), and delete an optional twin by
    // sending it as null; the row stays, typed `deleted`, so its versions survive.
    let (node, mut mapper) = Mapper::on_new_node("thermo-1", &[("temperature", "20", "int")]).await;

    let event_id = mapper.report(&[("label", "lab-1", "string")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(
        result["twin"]["label"]["actual"]["value"], "lab-1",
        "{result}"
    );
    let got = mapper.get().await;
    assert_eq!(got["twin"]["label"]["actual"]["value"], "lab-1", "{got}");

    let event_id = mapper
        .send("twin/update", json!({"twin": {"label": null}}))
        .await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert!(result["code"].is_null(), "{result}");
    let document = mapper
        .next("twin/update/document", "document deleting label", |d| {
            d["twin"]["label"]["last"]["actual"]["value"] == "lab-1"
        })
        .await;
    assert!(document["twin"]["label"]["current"].is_null(), "{document}");
    let got = mapper.get().await;
    assert!(got["twin"].get("label").is_none(), "{got}");
    assert_eq!(
        got["twin"]["temperature"]["expected"]["value"], "20",
        "{got}"
    );
    let twins = twin_rows(&node, "thermo-1").await;
    let label = twins
        .iter()
        .find(|t| t["name"] == "label")
        .unwrap_or_else(|| panic!("the deleted twin's row is kept: {twins:?}"));
    assert_eq!(label["attr_type"], "deleted", "{twins:?}");
    assert!(unset(&label["actual"]), "{twins:?}");
    // The delete is a device update too: `dealVersion` adds 1 to `edge` (1 for the add, 2).
    assert_eq!(
        version(&label["actual_version"]),
        json!({"cloud": 0, "edge": 2}),
        "{twins:?}"
    );

    // The cloud's twin is not optional (`createDevice` sends `optional: false`): it stays.
    let event_id = mapper
        .send("twin/update", json!({"twin": {"temperature": null}}))
        .await;
    mapper.answer("twin/update/result", &event_id).await;
    let got = mapper.get().await;
    assert_eq!(
        got["twin"]["temperature"]["expected"]["value"], "20",
        "{got}"
    );
}

#[tokio::test]
async fn what_mappers_go_sends_is_taken_double_twins_and_disconnected_state() {
    // A device model property of type `double` (the cloud's `DataTypeDouble`,
    // `cloud/pkg/devicecontroller/constants/device.go`), which mappers-go converts with
    // `ParseFloat(value, 64)` (`mappers/common/data_converter.go`).
    let (node, mut mapper) =
        Mapper::on_new_node("meter-1", &[("voltage", "230.0", "double")]).await;
    let event_id = mapper.report(&[("voltage", "229.87", "double")]).await;
    let result = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(
        result["twin"]["voltage"]["actual"]["value"], "229.87",
        "{result}"
    );
    assert_eq!(
        result["twin"]["voltage"]["metadata"]["type"], "double",
        "{result}"
    );
    let twins = twin_rows(&node, "meter-1").await;
    assert_eq!(
        (&twins[0]["actual"], &twins[0]["attr_type"]),
        (&json!("229.87"), &json!("double")),
        "{twins:?}"
    );
    let event_id = mapper.report(&[("voltage", "high", "double")]).await;
    let answer = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(answer["code"], 400, "not a number: {answer}");
    // `bytes` is a model type too, but no edge twin value can be checked as one: refused, as
    // KubeEdge's `ValidateValue` (`dtcommon/util.go`) does.
    let event_id = mapper.report(&[("blob", "AQID", "bytes")]).await;
    let answer = mapper.answer("twin/update/result", &event_id).await;
    assert_eq!(answer["code"], 400, "{answer}");

    // mappers-go's states (`mappers/common/const.go`), upper case as it sends them.
    for (state, online) in [("OK", true), ("DISCONNECTED", false), ("ERROR", false)] {
        let event_id = mapper.send("state/update", json!({"state": state})).await;
        let result = mapper.answer("state/update/result", &event_id).await;
        assert_eq!(result["device"]["state"], state, "{result}");
        let last_online = result["device"]["lastOnlineTime"].as_str().unwrap_or("");
        assert_eq!(is_rfc3339(last_online), online, "{result}");
        let rows = node.rows("SELECT state FROM device").await;
        assert_eq!(rows, vec![json!({"state": state})]);
    }
}

#[tokio::test]
async fn bad_reports_get_400_unknown_devices_404_and_nothing_changes() {
    let twins = [("temperature", "20", "int"), ("label", "lab-1", "string")];
    let (node, mut mapper) = Mapper::on_new_node("thermo-1", &twins).await;
    let event_id = mapper.report(&[("temperature", "25", "int")]).await;
    mapper.answer("twin/update/result", &event_id).await;
    mapper
        .next("twin/update/document", "document with actual 25", |d| {
            d["twin"]["temperature"]["current"]["actual"]["value"] == "25"
        })
        .await;
    mapper
        .next("twin/update/delta", "delta with actual 25", |d| {
            d["twin"]["temperature"]["actual"]["value"] == "25"
        })
        .await;
    // Whatever else the set-up caused has arrived by now.
    mapper.forget().await;
    let before = device_tables(&node).await;

    let error = |answer: &Value, code: i64, case: &str| {
        assert_eq!(answer["code"], code, "{case}: {answer}");
        assert!(
            answer["reason"].as_str().is_some_and(|r| !r.is_empty()),
            "{case}: {answer}"
        );
        assert!(
            answer.get("twin").is_none_or(Value::is_null),
            "{case}: {answer}"
        );
    };

    // Malformed JSON: no event id to echo, so the next result is the answer.
    mapper
        .client
        .publish(
            &mapper.topic("twin/update"),
            r#"{"event_id":"broken","twin":{"#,
        )
        .await;
    let answer = mapper
        .next("twin/update/result", "an answer to malformed JSON", |_| {
            true
        })
        .await;
    error(&answer, 400, "malformed JSON");

    for (case, body) in [
        ("no twin key", json!({})),
        (
            "a key outside KubeEdge's pattern",
            json!({"twin": {"temp erature": {"actual": {"value": "1"}}}}),
        ),
        (
            "a value outside KubeEdge's pattern",
            json!({"twin": {"label": {"actual": {"value": "lab 1!"}}}}),
        ),
        (
            "not an int for the int twin",
            json!({"twin": {"temperature": {"actual": {"value": "warm"}}}}),
        ),
        (
            "not an int, with the type",
            json!({"twin": {"temperature": {"actual": {"value": "25.5"}, "metadata": {"type": "int"}}}}),
        ),
    ] {
        let event_id = mapper.send("twin/update", body).await;
        let answer = mapper.answer("twin/update/result", &event_id).await;
        error(&answer, 400, case);
    }
    let event_id = mapper
        .send("state/update", json!({"state": "asleep"}))
        .await;
    let answer = mapper.answer("state/update/result", &event_id).await;
    error(&answer, 400, "an unknown state");

    // A device the node does not have.
    let mut ghost = Mapper::connect(&node, "ghost").await;
    let event_id = ghost.report(&[("temperature", "25", "int")]).await;
    let answer = ghost.answer("twin/update/result", &event_id).await;
    error(&answer, 404, "twin update of an unknown device");
    let event_id = ghost.send("twin/get", json!({})).await;
    let answer = ghost.answer("twin/get/result", &event_id).await;
    error(&answer, 404, "twin get of an unknown device");
    let event_id = ghost.send("state/update", json!({"state": "online"})).await;
    let answer = ghost.answer("state/update/result", &event_id).await;
    error(&answer, 404, "state update of an unknown device");

    // Nothing changed, and nothing told the device otherwise.
    assert_eq!(device_tables(&node).await, before);
    mapper.quiet("twin/update/document").await;
    mapper.quiet("twin/update/delta").await;
    let got = mapper.get().await;
    assert_eq!(got["twin"]["temperature"]["actual"]["value"], "25", "{got}");
    assert!(unset(&got["twin"]["label"]["actual"]["value"]), "{got}");
}

#[tokio::test]
async fn uploads_and_device_data_reach_the_cloud_and_the_latest_data_is_stored() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut up = cloud_client(&cloud, &bridge.up("eventbus/#")).await;
    let controller = Controller::cloud(&cloud, &bridge).await;
    for id in ["thermo-1", "default/thermo-2"] {
        let _mapper = thermometer_added(&node, &controller, id, &bridge.node_id).await;
    }
    let device = node.client().await;
    let upload = bridge.up("eventbus/upload/node/upload");

    // `$hw/events/upload/#` and `SYS/dis/upload_records` go up as they are, named by their topic
    // (`eventbus/mqtt/client.go` `SubTopics`); a payload that is not JSON as a JSON string.
    for (topic, payload, content) in [
        (
            "$hw/events/upload/x",
            r#"{"reading":1}"#,
            json!({"reading": 1}),
        ),
        (
            "$hw/events/upload/raw/log",
            "plain text",
            json!("plain text"),
        ),
        (
            "SYS/dis/upload_records",
            r#"{"records":[1,2]}"#,
            json!({"records": [1, 2]}),
        ),
    ] {
        device.publish(topic, payload).await;
        let m = up
            .expect_matching(&upload, topic, |m| m.resource() == topic)
            .await;
        assert_eq!(m.content(), content, "{topic}");
        assert_eq!(m.operation(), "upload", "{topic}");
    }

    // mapper-framework's `DeviceData` (`CreateMessageData`, `pkg/common/event.go`) on
    // `$ke/events/device/<id>/data/update`: carried up, and the latest value per property kept.
    for id in ["thermo-1", "default/thermo-2"] {
        let resource = cloud_resource(id, "devicedata");
        let data_topic = bridge.up(&format!("eventbus/upload/{}/devicedata", namespace_of(id)));
        for (property, value, kind) in [("temperature", "26", "int"), ("humidity", "40", "float")] {
            let data = json!({
                "event_id": "",
                "timestamp": now_ms(),
                "data": {property: {"value": value, "metadata": {"timestamp": now_ms(), "type": kind}}},
            });
            device
                .publish(
                    &format!("$ke/events/device/{id}/data/update"),
                    data.to_string(),
                )
                .await;
            let m = up
                .expect_matching(&data_topic, &format!("{resource} {property}"), |m| {
                    m.resource() == resource && m.content()["data"][property]["value"] == value
                })
                .await;
            assert_eq!(m.content()["data"][property]["metadata"]["type"], kind);
        }
        let stored: Value = serde_json::from_str(
            &node
                .stored(&resource)
                .await
                .unwrap_or_else(|| panic!("{resource} stored")),
        )
        .expect("stored JSON");
        assert_eq!(stored["data"]["temperature"]["value"], "26", "{stored}");
        assert_eq!(stored["data"]["humidity"]["value"], "40", "{stored}");
    }
    let rows = node.meta_rows().await;
    let data_rows: Vec<(&str, &str)> = rows
        .iter()
        .filter(|(_, kind, _)| kind == "devicedata")
        .map(|(key, kind, _)| (key.as_str(), kind.as_str()))
        .collect();
    assert_eq!(
        data_rows,
        [
            ("_/devicedata/thermo-1", "devicedata"),
            ("default/devicedata/thermo-2", "devicedata")
        ]
    );
}

/// The README test's node and `mosquitto_sub` processes, killed at its end.
struct Spawned(Vec<Child>);

impl Drop for Spawned {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Waits for a watcher line `<topic> <payload>` on `topic` whose payload `matches`.
async fn watch_for(
    lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    seen: &mut Vec<String>,
    topic: &str,
    matches: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        for line in seen.iter() {
            if let Some((t, payload)) = line.split_once(' ') {
                let json: Value = serde_json::from_str(payload).unwrap_or(Value::Null);
                if t == topic && matches(&json) {
                    return json;
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, lines.recv()).await {
            Ok(Some(line)) => seen.push(line),
            _ => panic!(
                "nothing on {topic} as wanted within {WAIT:?}; the watcher printed {seen:#?}"
            ),
        }
    }
}

#[tokio::test]
async fn the_readme_mapper_walkthrough_works_verbatim() {
    let commands = readme_section_commands("Connect a KubeEdge mapper");
    assert!(commands.len() >= 4, "{commands:?}");
    // A node as the README runs it: the embedded default configuration (node id `edge-node`)
    // in its own directory, moved to free ports through the environment.
    let node = Node::start_with(Options {
        embedded_config: true,
        ..Options::default()
    })
    .await;
    let port = node.port;
    // Killed at the end, or when an assertion fails.
    let mut spawned = Spawned(Vec::new());

    let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    let mut seen = Vec::new();
    let prober = Client::connect(port, &unique_id("probe")).await;
    for command in &commands {
        let words = shell_words(command);
        // The README's commands use the default port; the test's node has its own.
        let (program, args) = words.split_first().expect("a command");
        match program.as_str() {
            "mosquitto_sub" => {
                let mut child = Command::new("mosquitto_sub")
                    .args(["-p", &port.to_string()])
                    .args(args)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("mosquitto_sub is installed (scripts/test installs it)");
                forward_lines(&mut child, lines_tx.clone());
                spawned.0.push(child);
                // Subscribed once it prints a probe on its last filter (`twin/+/+`: not a topic
                // the node uses; `…/#`: a level below).
                let probe = probe_topic(args.last().expect("a filter"));
                wait_until(format_args!("`{command}` subscribed"), WAIT, async || {
                    prober.publish(&probe, "{}").await;
                    while let Ok(Some(line)) =
                        tokio::time::timeout(Duration::from_millis(200), lines.recv()).await
                    {
                        if line.starts_with(&format!("{probe} ")) {
                            return true;
                        }
                        seen.push(line);
                    }
                    false
                })
                .await;
            }
            "mosquitto_pub" => {
                let out = Command::new("mosquitto_pub")
                    .args(["-p", &port.to_string()])
                    .args(args)
                    .output()
                    .expect("mosquitto_pub is installed (scripts/test installs it)");
                assert!(
                    out.status.success(),
                    "`{command}`: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                // As a reader would, wait for the device to be added before reporting for it.
                if command.contains(MEMBERSHIP) {
                    watch_for(
                        &mut lines,
                        &mut seen,
                        &node_topic(NODE, "membership/updated"),
                        |u| u["added_devices"][0]["id"] == "thermo-1",
                    )
                    .await;
                }
            }
            other => panic!("the section runs only mosquitto clients, not {other}: {command}"),
        }
    }

    // What the README says the watcher prints.
    let topic = |rest| device_topic("thermo-1", rest);
    let delta = watch_for(&mut lines, &mut seen, &topic("twin/update/delta"), |d| {
        d["delta"]["temperature"] == "20"
    })
    .await;
    assert_eq!(delta["twin"]["temperature"]["expected"]["value"], "20");
    let result = watch_for(&mut lines, &mut seen, &topic("twin/update/result"), |r| {
        r["event_id"] == "report-1"
    })
    .await;
    assert_eq!(
        result["twin"]["temperature"]["actual"]["value"], "25",
        "{result}"
    );
    let document = watch_for(&mut lines, &mut seen, &topic("twin/update/document"), |d| {
        d["twin"]["temperature"]["current"]["actual"]["value"] == "25"
    })
    .await;
    assert_eq!(
        document["twin"]["temperature"]["last"]["expected"]["value"], "20",
        "{document}"
    );
    watch_for(&mut lines, &mut seen, &topic("twin/update/delta"), |d| {
        d["twin"]["temperature"]["actual"]["value"] == "25" && d["delta"]["temperature"] == "20"
    })
    .await;
    let got = watch_for(&mut lines, &mut seen, &topic("twin/get/result"), |g| {
        g["event_id"] == "get-1"
    })
    .await;
    assert_eq!(got["twin"]["temperature"]["actual"]["value"], "25", "{got}");
    assert_eq!(
        got["twin"]["temperature"]["expected"]["value"], "20",
        "{got}"
    );

    // The alarm on the user topic, handed to the cloud side.
    let upload = watch_for(
        &mut lines,
        &mut seen,
        "ke/cloud/eventbus/upload/node/upload",
        |u| u["route"]["resource"] == "factory/user/line-1/alarm",
    )
    .await;
    assert_eq!(upload["content"], json!({"level": "high"}), "{upload}");
    assert_eq!(
        (&upload["route"]["operation"], &upload["route"]["group"]),
        (&json!("upload"), &json!("user")),
        "{upload}"
    );

    drop(spawned);
    assert!(!node.log().contains("panicked"), "{}", node.log());
}

/// A topic `filter` matches that no part of the node answers: `+` and `#` levels as `probe`.
fn probe_topic(filter: &str) -> String {
    filter
        .split('/')
        .map(|level| match level {
            "+" | "#" => "probe",
            other => other,
        })
        .collect::<Vec<_>>()
        .join("/")
}
