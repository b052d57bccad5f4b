//! edgecore's eventbus paths on edgemeta (issue 23, docs/devices.md "What edgecore's eventbus
//! serves"): user topics carried to a real mosquitto cloud across an outage, clients'
//! connection events, and `$hw`/`$ke` messages kept from wildcard subscriptions, with real
//! MQTT clients (rumqttc, mosquitto_sub) in MQTT 3.1.1 and 5.

mod common;

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cloud::{
    await_empty_outbox, await_outbox, await_signal, bridged, cloud_client, tail, CONNECTION,
};
use common::{
    forward_lines, mosquitto_pub, unique_id, wait_until, Client, CloudBroker, Msg, Node, QUIET,
    WAIT,
};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

/// An edge app's user topic (edgecore subscribes `+/user/#`, `eventbus/mqtt/client.go`).
const ALARM: &str = "factory/user/line-1/alarm";

/// Publishes alarms `seq` in `range` on [`ALARM`], QoS 1, in order.
async fn alarms(app: &Client, range: std::ops::Range<usize>) {
    for seq in range {
        app.publish(ALARM, json!({"level": "high", "seq": seq}).to_string())
            .await;
    }
}

#[tokio::test]
async fn user_topics_reach_the_cloud_in_order_across_an_outage_with_nothing_lost() {
    const BEFORE: usize = 20;
    const DURING: usize = 30;
    const TOTAL: usize = 60;
    let mut cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    let mut up = cloud_client(&cloud, &bridge.up("eventbus/upload/#")).await;
    let app = node.client().await;

    alarms(&app, 0..BEFORE).await;
    let mut received: Vec<Msg> = Vec::new();
    let seen = |received: &[Msg]| -> HashSet<i64> {
        received
            .iter()
            .filter_map(|m| m.content()["seq"].as_i64())
            .collect()
    };
    wait_until(
        format_args!("{BEFORE} alarms in the cloud"),
        WAIT,
        async || {
            received.extend(up.drain(Duration::from_millis(100)).await);
            let got = seen(&received);
            if got.len() >= BEFORE {
                Ok(())
            } else {
                Err(format!("got {got:?}"))
            }
        },
    )
    .await;

    // The cloud goes away: what the app publishes meanwhile is committed to the outbox (and
    // only then PUBACKed), then carried up once the cloud is back.
    cloud.stop();
    await_signal(&mut watcher, "cloud_disconnected", WAIT, &node).await;
    alarms(&app, BEFORE..BEFORE + DURING).await;
    // What the node acknowledged is stored.
    await_outbox(&node, DURING as i64, WAIT).await;
    cloud.restart().await;
    await_signal(&mut watcher, "cloud_connected", WAIT, &node).await;
    alarms(&app, BEFORE + DURING..TOTAL).await;

    wait_until(
        format_args!("all {TOTAL} alarms in the cloud"),
        3 * WAIT,
        async || {
            received.extend(up.drain(Duration::from_millis(200)).await);
            let got = seen(&received);
            if got.len() >= TOTAL {
                return Ok(());
            }
            let missing: Vec<i64> = (0..TOTAL as i64).filter(|s| !got.contains(s)).collect();
            Err(format!(
                "missing {missing:?}; node log:\n{}",
                tail(&node.log(), 40)
            ))
        },
    )
    .await;
    // At least once, in order: a resent suffix may repeat, nothing arrives before its turn.
    let mut first_seen = Vec::new();
    for m in &received {
        let seq = m.content()["seq"].as_i64().expect("seq");
        if !first_seen.contains(&seq) {
            first_seen.push(seq);
        }
        // What edgecore's `handleUploadTopic` sends: op `upload`, group `user`, the topic as
        // resource, the payload as content.
        assert_eq!(m.topic, bridge.up("eventbus/upload/node/upload"));
        assert_eq!(m.resource(), ALARM);
        assert_eq!(m.operation(), "upload");
        assert_eq!(m.json()["route"]["group"], "user");
        assert_eq!(m.content(), json!({"level": "high", "seq": seq}));
    }
    assert_eq!(first_seen, (0..TOTAL as i64).collect::<Vec<_>>());
    await_empty_outbox(&node, WAIT).await;
}

/// The JSON of a connection event, checked against what its topic says.
fn event(m: &Msg, kind: &str, client_id: &str) {
    let body: Value = serde_json::from_slice(&m.payload).expect("JSON event");
    assert_eq!(body["event_type"], kind, "{body}");
    assert_eq!(body["client_id"], client_id, "{body}");
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as i64;
    let at = body["timestamp"].as_i64().expect("timestamp in ms");
    assert!((now - at).abs() < 60_000, "{body}");
}

#[tokio::test]
async fn connections_and_disconnections_of_clients_reach_subscribers() {
    let node = Node::start_v5().await;
    let mut watcher = node.client().await;
    watcher.subscribe("$hw/events/connected/+").await;
    watcher.subscribe("$hw/events/disconnected/+").await;

    // A device over MQTT 3.1.1 (rumqttc) that drops its connection.
    let lamp = unique_id("lamp");
    let device = Client::connect(node.port, &lamp).await;
    event(
        &watcher
            .expect(&format!("$hw/events/connected/{lamp}"))
            .await,
        "connected",
        &lamp,
    );
    drop(device);
    event(
        &watcher
            .expect(&format!("$hw/events/disconnected/{lamp}"))
            .await,
        "disconnected",
        &lamp,
    );

    // A client over MQTT 5 (mosquitto_pub) that disconnects cleanly.
    let v5 = node.v5_port.expect("v5 listener");
    let sensor = unique_id("sensor");
    let args = [
        "-V",
        "mqttv5",
        "-i",
        &sensor,
        "-q",
        "1",
        "-t",
        "plain/reading",
        "-m",
        "1",
    ];
    let (published, stderr) = mosquitto_pub(v5, &args);
    assert!(published, "{stderr}");
    let connected = watcher
        .expect(&format!("$hw/events/connected/{sensor}"))
        .await;
    event(&connected, "connected", &sensor);
    let disconnected = watcher
        .expect(&format!("$hw/events/disconnected/{sensor}"))
        .await;
    event(&disconnected, "disconnected", &sensor);

    // A refused client (an id with a wildcard) never connected: nothing to announce.
    let (published, _) = mosquitto_pub(node.port, &["-i", "bad#id", "-t", "plain/x", "-m", "1"]);
    assert!(!published);
    let later = watcher.drain_topics(QUIET).await;
    assert!(later.iter().all(|t| !t.contains("bad")), "{later:?}");
}

/// A `mosquitto_sub -v` on `filters` at QoS 1, in MQTT `version`, printing into `lines`.
fn mosquitto_sub(port: u16, version: &str, filters: &[&str]) -> (Child, UnboundedReceiver<String>) {
    let mut command = Command::new("mosquitto_sub");
    command.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "-V",
        version,
        "-v",
    ]);
    command.args(["-q", "1", "-W", "60", "-i", &unique_id("sub")]);
    for filter in filters {
        command.args(["-t", filter]);
    }
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto_sub is installed (scripts/test installs it)");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    forward_lines(&mut child, tx);
    (child, rx)
}

/// Waits until `lines` shows `topic`, publishing it meanwhile (the subscription is in place
/// once it arrives).
async fn await_subscribed(lines: &mut UnboundedReceiver<String>, prober: &Client, topic: &str) {
    wait_until(
        format_args!("mosquitto_sub subscribed ({topic} arrives)"),
        WAIT,
        async || {
            prober.publish(topic, "ready").await;
            while let Ok(Some(line)) =
                tokio::time::timeout(Duration::from_millis(200), lines.recv()).await
            {
                if line.starts_with(topic) {
                    return true;
                }
            }
            false
        },
    )
    .await;
}

/// Lines until one starts with `last`, at most 3 × [`WAIT`].
async fn lines_until(
    node: &Node,
    lines: &mut UnboundedReceiver<String>,
    last: &str,
) -> Vec<String> {
    let mut out = Vec::new();
    let deadline = Instant::now() + 3 * WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, lines.recv()).await {
            Ok(Some(line)) => {
                let done = line.starts_with(last);
                out.push(line);
                if done {
                    return out;
                }
            }
            _ => panic!(
                "no {last} within {:?}; printed {out:#?}; node log:\n{}",
                3 * WAIT,
                tail(&node.log(), 30)
            ),
        }
    }
}

/// Messages until one on `last`, at most 3 × [`WAIT`].
async fn messages_until(client: &mut Client, last: &str) -> Vec<Msg> {
    let mut out = Vec::new();
    let deadline = Instant::now() + 3 * WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = client
            .next_within(left)
            .await
            .unwrap_or_else(|| panic!("no {last}; got {} messages", out.len()));
        let done = m.topic == last;
        out.push(m);
        if done {
            return out;
        }
    }
}

#[tokio::test]
async fn wildcard_subscribers_get_no_dollar_topic_in_mqtt_3_1_1_and_5() {
    // More than the 100 publishes the node keeps in flight to a subscriber: a `$` publish that
    // took a slot of that window unseen would stall the subscriber.
    const PLAIN: usize = 300;
    let node = Node::start_v5().await;
    let v5 = node.v5_port.expect("v5 listener");
    let prober = node.client().await;
    let mut hash = node.client().await;
    hash.subscribe("#").await;
    // A QoS 2 wildcard subscriber too.
    let mut plus = node.client().await;
    plus.client
        .subscribe("+/events/#", rumqttc::QoS::ExactlyOnce)
        .await
        .expect("subscribe");
    wait_until(
        "+/events/# subscribed (a probe arrives)",
        WAIT,
        async || {
            prober.publish("probe/events/ready", "ready").await;
            plus.next_within(Duration::from_millis(200)).await.is_some()
        },
    )
    .await;
    plus.drain(QUIET).await;
    // A mapper's own filter names `$hw`: it still gets what it asked for.
    let mut mapper = node.client().await;
    mapper.subscribe("$hw/events/device/+/twin/#").await;
    let (mut sub4, mut lines4) = mosquitto_sub(node.port, "mqttv311", &["#"]);
    let (mut sub5, mut lines5) = mosquitto_sub(v5, "mqttv5", &["#"]);
    await_subscribed(&mut lines4, &prober, "probe/v4").await;
    await_subscribed(&mut lines5, &prober, "probe/v5").await;

    let device = node.client().await;
    // A twin get for a device the node does not have: the node answers on `…/twin/get/result`.
    device
        .publish(
            "$hw/events/device/ghost/twin/get",
            r#"{"event_id":"g-1","timestamp":1}"#,
        )
        .await;
    for n in 0..PLAIN {
        device
            .publish("$hw/events/device/d/twin/probe", n.to_string())
            .await;
        device.publish("$ke/events/other", n.to_string()).await;
        device
            .publish(&format!("plain/events/{n}"), n.to_string())
            .await;
    }
    let last = format!("plain/events/{}", PLAIN - 1);
    let plain: Vec<String> = (0..PLAIN).map(|n| format!("plain/events/{n}")).collect();

    for (name, client) in [("#", &mut hash), ("+/events/#", &mut plus)] {
        let mut got = messages_until(client, &last).await;
        got.extend(client.drain(QUIET).await);
        let topics: Vec<&str> = got.iter().map(|m| m.topic.as_str()).collect();
        let dollar: Vec<&&str> = topics.iter().filter(|t| t.starts_with('$')).collect();
        assert!(
            dollar.is_empty(),
            "{name} got {} `$` messages: {:?}…",
            dollar.len(),
            &dollar[..dollar.len().min(5)]
        );
        let got_plain: Vec<&str> = topics
            .iter()
            .copied()
            .filter(|t| t.starts_with("plain/"))
            .collect();
        assert_eq!(got_plain, plain, "{name}: every plain message, in order");
    }
    for (name, lines, child) in [
        ("3.1.1", &mut lines4, &mut sub4),
        ("5", &mut lines5, &mut sub5),
    ] {
        let printed = lines_until(&node, lines, &last).await;
        let _ = child.kill();
        let _ = child.wait();
        let dollar: Vec<&String> = printed.iter().filter(|l| l.starts_with('$')).collect();
        assert!(dollar.is_empty(), "MQTT {name} `#` got {dollar:?}");
        let got_plain: Vec<&str> = printed
            .iter()
            .filter_map(|l| l.split_once(' ').map(|(t, _)| t))
            .filter(|t| t.starts_with("plain/"))
            .collect();
        assert_eq!(
            got_plain, plain,
            "MQTT {name}: every plain message, once, in order"
        );
    }
    // The mapper's `$hw` filter got the `$hw` traffic, the node's answer included.
    let (mut probes, mut answered) = (0, false);
    let deadline = Instant::now() + 3 * WAIT;
    while probes < PLAIN || !answered {
        let left = deadline.saturating_duration_since(Instant::now());
        let m = mapper
            .next_within(left)
            .await
            .unwrap_or_else(|| panic!("mapper: {probes} probes, answered {answered}"));
        if m.topic == "$hw/events/device/d/twin/probe" {
            probes += 1;
        } else if m.topic == "$hw/events/device/ghost/twin/get/result" {
            let result: Value = serde_json::from_slice(&m.payload).expect("JSON");
            assert_eq!(result["code"], 404, "{result}");
            answered = true;
        }
    }
    assert!(!node.log().contains("panicked"), "{}", node.log());
}
