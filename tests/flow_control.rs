//! Flow control end to end (protocol §6.5–6.6, §6.10): publishers are slowed instead of readers
//! being cut, hand-ons wait in the store until their subscribers have room, only a subscriber
//! that stopped reading (took less than it held within its window) is cut off, and a PUBACK for
//! a message the node consumes means it is stored.

mod common;

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{envelope, mosquitto_sub, unique_id, Node, Options, WAIT};
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS};
use serde_json::{json, Value};
use tokio::sync::mpsc;

/// A raw MQTT client: every publish it receives, with nothing in between to slow it down.
struct Reader {
    /// Kept so the connection stays open while the reader is alive.
    _client: AsyncClient,
    rx: mpsc::UnboundedReceiver<(String, Vec<u8>)>,
    task: tokio::task::JoinHandle<()>,
}

impl Reader {
    /// Connects and subscribes to each filter at `qos`; returns once every SUBACK is in.
    async fn subscribe(port: u16, filters: &[&str], qos: QoS) -> Reader {
        let mut options = MqttOptions::new(unique_id("reader"), "127.0.0.1", port);
        options.set_max_packet_size(4 << 20, 4 << 20);
        let (client, mut events) = AsyncClient::new(options, 100);
        for filter in filters {
            client.subscribe(*filter, qos).await.expect("subscribe");
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let (subscribed_tx, mut subscribed) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                match events.poll().await {
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let topic = p.topic.clone();
                        if tx.send((topic, p.payload.to_vec())).is_err() {
                            return;
                        }
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        let _ = subscribed_tx.send(());
                    }
                    Ok(_) => {}
                    Err(_) => return,
                }
            }
        });
        for _ in filters {
            tokio::time::timeout(WAIT, subscribed.recv())
                .await
                .expect("SUBACK within the wait");
        }
        Reader {
            _client: client,
            rx,
            task,
        }
    }

    /// Everything received until `count` messages are in or nothing came for `quiet`.
    async fn take(&mut self, count: usize, quiet: Duration) -> Vec<(String, Vec<u8>)> {
        let mut got = Vec::with_capacity(count);
        while got.len() < count {
            match tokio::time::timeout(quiet, self.rx.recv()).await {
                Ok(Some(message)) => got.push(message),
                _ => break,
            }
        }
        got
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `(route.resource, route.operation)` of a hand-on.
fn route(payload: &[u8]) -> (String, String) {
    let v: Value = serde_json::from_slice(payload).expect("hand-ons are JSON envelopes");
    let at = |k: &str| v["route"][k].as_str().unwrap_or_default().to_owned();
    (at("resource"), at("operation"))
}

/// Checks that every resource was handed on as insert, then update, once each.
fn assert_whole_and_in_order(got: &[(String, Vec<u8>)], resources: usize, who: &str) {
    let mut seen: HashMap<String, Vec<String>> = HashMap::new();
    for (_, payload) in got {
        let (resource, operation) = route(payload);
        seen.entry(resource).or_default().push(operation);
    }
    assert_eq!(seen.len(), resources, "{who}: resources handed on");
    for (resource, operations) in &seen {
        assert_eq!(operations, &["insert", "update"], "{who}: {resource}");
    }
}

/// Publishes an insert and then an update of each of `names` at QoS 1, as fast as rumqttc goes.
async fn burst(port: u16, names: Vec<String>, pad: String) {
    let mut options = MqttOptions::new(unique_id("burst"), "127.0.0.1", port);
    options.set_inflight(100);
    let (client, mut events) = AsyncClient::new(options, 1000);
    let total = names.len() * 2;
    let poll = tokio::spawn(async move {
        let mut acked = 0;
        while acked < total {
            match events.poll().await {
                Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                Ok(_) => {}
                Err(e) => panic!("publisher connection failed: {e}"),
            }
        }
    });
    for operation in ["insert", "update"] {
        for name in &names {
            let resource = format!("default/pod/{name}");
            let (_, payload) = envelope(
                "edgecontroller",
                operation,
                &resource,
                json!({"metadata": {"name": name}, "pad": pad}),
            );
            client
                .publish(
                    format!("ke/meta/edgecontroller/{operation}/default/pod"),
                    QoS::AtLeastOnce,
                    false,
                    payload,
                )
                .await
                .expect("publish");
        }
    }
    tokio::time::timeout(Duration::from_secs(180), poll)
        .await
        .expect("every publish acknowledged")
        .expect("publisher task");
}

/// A burst far larger than the broker's logs (3 × 256 KiB for `ke/edged/#`) from two publishers:
/// a QoS 1 and a QoS 0 subscriber that keep reading get all of it, in order, and nobody is cut.
#[tokio::test]
async fn a_burst_reaches_qos_1_and_qos_0_readers_whole_and_in_order() {
    const PER_PUBLISHER: usize = 2_500;
    let node = Node::start().await;
    let mut qos1 = Reader::subscribe(node.port, &["ke/edged/#"], QoS::AtLeastOnce).await;
    let mut qos0 = Reader::subscribe(node.port, &["ke/edged/#"], QoS::AtMostOnce).await;
    let pad = "x".repeat(300);
    let publishers: Vec<_> = (0..2)
        .map(|p| {
            let names = (0..PER_PUBLISHER).map(|i| format!("p{p}-{i}")).collect();
            tokio::spawn(burst(node.port, names, pad.clone()))
        })
        .collect();
    let expected = 2 * PER_PUBLISHER * 2;
    let (got1, got0) = tokio::join!(
        qos1.take(expected, Duration::from_secs(20)),
        qos0.take(expected, Duration::from_secs(20))
    );
    for publisher in publishers {
        publisher.await.expect("publisher");
    }
    assert_whole_and_in_order(&got1, 2 * PER_PUBLISHER, "QoS 1 reader");
    assert_whole_and_in_order(&got0, 2 * PER_PUBLISHER, "QoS 0 reader");
    assert!(
        !node.log().contains("EM-BROKER-SUBSCRIBER-LAG"),
        "a reader that keeps up was cut off:\n{}",
        node.log()
    );
}

/// A paho-mqtt (Python) reader of `filter` at `qos`: returns once it is subscribed; its count
/// of what it received comes when nothing arrived for 5 s or its connection ended.
async fn python_reader(port: u16, filter: &str, qos: u8) -> tokio::task::JoinHandle<String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/count_reader.py");
    let mut child = tokio::process::Command::new("python3")
        .args([script, &port.to_string(), filter, &qos.to_string(), "5"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 runs (paho-mqtt: python3 -m pip install paho-mqtt)");
    let stdout = child.stdout.take().expect("piped");
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout));
    let first = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("the Python reader subscribes within the wait")
        .expect("its output");
    assert_eq!(
        first.as_deref(),
        Some("subscribed"),
        "paho-mqtt is installed"
    );
    tokio::spawn(async move {
        let last = tokio::time::timeout(Duration::from_secs(300), lines.next_line()).await;
        let _ = child.wait().await;
        last.ok().and_then(Result::ok).flatten().unwrap_or_default()
    })
}

/// A paho-mqtt (Python) reader of `ke/#` at QoS 1 while a client publishes pod changes at QoS 1
/// without waiting for each PUBACK: it reads more slowly than the node produces (the publishes
/// themselves, the hand-ons to edged, the replies), and gets every delivery a fast reader of the
/// same filter gets, without being cut off; the publisher is paced instead.
#[tokio::test]
async fn a_python_reader_of_everything_gets_every_delivery_of_a_large_sync() {
    let node = Node::start().await;
    let python = python_reader(node.port, "ke/#", 1).await;
    let mut fast = Reader::subscribe(node.port, &["ke/#"], QoS::AtLeastOnce).await;
    let names = (0..500).map(|i| format!("sync-{i}")).collect();
    burst(node.port, names, "x".repeat(200)).await;
    let got = fast.take(100_000, Duration::from_secs(5)).await;
    assert!(
        got.len() >= 2_000,
        "{} deliveries to the fast reader",
        got.len()
    );
    let printed = python.await.expect("the Python reader's count");
    assert_eq!(
        printed,
        format!("received {} ended None", got.len()),
        "the Python reader got every delivery:\n{}",
        node.log()
    );
    assert!(
        !node.log().contains("EM-BROKER-SUBSCRIBER-LAG"),
        "a reader that keeps reading was cut off:\n{}",
        node.log()
    );
}

/// Plain pass-through: 3,000 QoS 1 publishes of 400 bytes, pipelined, to a paho-mqtt (Python)
/// reader of `t/#`: it gets all of them, the publisher waiting for it.
#[tokio::test]
async fn a_python_reader_gets_every_pass_through_publish_of_a_pipelining_publisher() {
    const COUNT: usize = 3_000;
    let node = Node::start().await;
    let python = python_reader(node.port, "t/#", 1).await;
    let mut options = MqttOptions::new(unique_id("pipeline"), "127.0.0.1", node.port);
    options.set_inflight(1000);
    let (client, mut events) = AsyncClient::new(options, 1000);
    let acks = tokio::spawn(async move {
        let mut acked = 0;
        while acked < COUNT {
            match events.poll().await {
                Ok(Event::Incoming(Packet::PubAck(_))) => acked += 1,
                Ok(_) => {}
                Err(e) => panic!("publisher connection failed: {e}"),
            }
        }
    });
    for i in 0..COUNT {
        let topic = format!("t/x/{}", i % 10);
        client
            .publish(topic, QoS::AtLeastOnce, false, vec![b'p'; 400])
            .await
            .expect("publish");
    }
    tokio::time::timeout(Duration::from_secs(120), acks)
        .await
        .expect("every publish acknowledged")
        .expect("publisher task");
    let printed = python.await.expect("the Python reader's count");
    assert_eq!(printed, format!("received {COUNT} ended None"));
    assert!(!node.log().contains("EM-BROKER-SUBSCRIBER-LAG"));
}

/// `kill -STOP` on a subscriber during a burst: it is cut off once it has not taken what it held
/// within `subscriber_stall_s`, the other reader gets everything, and the store holds all of it
/// to re-list.
#[tokio::test]
async fn a_subscriber_that_stops_reading_is_cut_off_by_its_progress_and_no_one_else_is() {
    const RESOURCES: usize = 1_500;
    let node = stalling_node().await;
    let mut reader = Reader::subscribe(node.port, &["ke/edged/#"], QoS::AtLeastOnce).await;
    let (stopped, mut printed) = mosquitto_sub(node.port, "ke/edged/#", 1_000_000)
        .await
        .split();
    let mut stopped = common::KillOnDrop(stopped);
    // Subscribed: a probe reaches both readers.
    let probe_client = node.client().await;
    common::send(
        &probe_client,
        "edgecontroller",
        "insert",
        "default/pod/probe",
        json!({"metadata": {"name": "probe"}}),
    )
    .await;
    printed_line(&mut printed, "ke/edged/", "mosquitto_sub prints the probe").await;
    let probes = reader.take(1_000, Duration::from_millis(300)).await;
    assert!(!probes.is_empty(), "the reader got the probes");
    signal(stopped.0.id(), "STOP");
    // Large hand-ons, so the stopped reader's socket buffers fill and its filter log with them.
    let pad = "x".repeat(8 * 1024);
    let names = (0..RESOURCES).map(|i| format!("big-{i}")).collect();
    let burst_task = tokio::spawn(burst(node.port, names, pad));
    let got = reader.take(2 * RESOURCES, Duration::from_secs(30)).await;
    burst_task.await.expect("publisher");
    assert_cut_off(&node, "reader");
    assert_whole_and_in_order(&got, RESOURCES, "the reader that kept reading");
    resumed_and_closed(&mut stopped.0, "subscriber");
    // It reconnects and resyncs from the store, which has every pod.
    assert_eq!(
        node.meta_rows().await.len(),
        RESOURCES + 1,
        "every pod and the probe"
    );
    let mut lister = node.client().await;
    lister.subscribe("ke/edged/meta/response/#").await;
    let last = format!("default/pod/big-{}", RESOURCES - 1);
    common::send(&lister, "edged", "query", &last, json!(null)).await;
    let answer = lister.expect_about("ke/edged/meta/response", &last).await;
    assert_eq!(answer.content().as_array().map(Vec::len), Some(1));
}

/// A node that cuts off a reader that did not take what it held within a second.
async fn stalling_node() -> Node {
    Node::start_with(Options {
        broker_yaml: "  subscriber_stall_s: 1\n".into(),
        ..Options::default()
    })
    .await
}

/// Waits (at most [`WAIT`]) for `mosquitto_sub` to print a line starting with `prefix`.
async fn printed_line(printed: &mut mpsc::UnboundedReceiver<String>, prefix: &str, what: &str) {
    tokio::time::timeout(WAIT, async {
        while let Some(line) = printed.recv().await {
            if line.starts_with(prefix) {
                return;
            }
        }
    })
    .await
    .expect(what);
}

/// The node logged that it cut off a subscriber (`who`) for having stopped reading.
fn assert_cut_off(node: &Node, who: &str) {
    let log = node.log();
    assert!(
        log.contains("EM-BROKER-SUBSCRIBER-LAG") && log.contains("stopped reading"),
        "the stopped {who} was not cut off:\n{log}"
    );
}

/// Resumes a stopped `mosquitto_sub` (`who`), whose connection the node must have closed.
fn resumed_and_closed(stopped: &mut std::process::Child, who: &str) {
    signal(stopped.id(), "CONT");
    let ended = common::exit_within(stopped, WAIT);
    let _ = stopped.kill();
    let _ = stopped.wait();
    assert!(ended.is_some(), "the cut-off {who}'s connection was closed");
}

fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("kill runs")
        .success();
    assert!(ok, "kill -{name} {pid}");
}

/// A KubeEdge mapper's QoS 0 wildcard subscriptions miss nothing when a thousand devices are
/// touched at once: one membership update adding 1,000 devices with desired values sends 1,000
/// deltas, and three back-to-back rounds of `twin/get` 3,000 results.
#[tokio::test]
async fn a_qos_0_wildcard_mapper_gets_every_delta_and_every_get_result() {
    const DEVICES: usize = 1_000;
    // One membership update names all thousand devices.
    let node = Node::start_with(Options {
        max_payload_bytes: 1024 * 1024,
        max_packet_bytes: 2 * 1024 * 1024,
        ..Options::default()
    })
    .await;
    let mut deltas = Reader::subscribe(
        node.port,
        &["$hw/events/device/+/twin/update/delta"],
        QoS::AtMostOnce,
    )
    .await;
    let mut results = Reader::subscribe(
        node.port,
        &["$hw/events/device/+/twin/get/result"],
        QoS::AtMostOnce,
    )
    .await;
    let cloud = node.client().await;
    let devices: Vec<Value> = (0..DEVICES)
        .map(|i| {
            json!({
                "id": format!("dev-{i}"),
                "name": format!("dev-{i}"),
                "twin": {"temperature": {
                    "expected": {"value": "20", "metadata": {"timestamp": 1_732_262_400_000_i64}},
                    "optional": false,
                    "metadata": {"type": "int"},
                    "expected_version": {"cloud": 1, "edge": 0},
                }},
            })
        })
        .collect();
    let membership = json!({
        "header": {"msg_id": unique_id("msg"), "timestamp": 1_732_262_400_000_i64},
        "route": {"source": "devicecontroller", "group": "twin", "operation": "update",
                  "resource": "node/membership"},
        "content": {"event_id": "bulk", "timestamp": 1_732_262_400_000_i64,
                    "added_devices": devices, "removed_devices": null},
    });
    cloud
        .publish(
            "ke/meta/devicecontroller/update/node/membership",
            membership.to_string(),
        )
        .await;
    let got = deltas.take(DEVICES, Duration::from_secs(20)).await;
    let ids: HashSet<_> = got.iter().map(|(topic, _)| topic.clone()).collect();
    assert_eq!(got.len(), DEVICES, "deltas");
    assert_eq!(ids.len(), DEVICES, "one delta per device");

    let mapper = node.client().await;
    for round in 0..3 {
        for i in 0..DEVICES {
            mapper
                .publish(
                    &format!("$hw/events/device/dev-{i}/twin/get"),
                    json!({"event_id": format!("get-{round}-{i}"), "timestamp": 1}).to_string(),
                )
                .await;
        }
    }
    let got = results.take(3 * DEVICES, Duration::from_secs(20)).await;
    let events: HashSet<String> = got
        .iter()
        .map(|(_, payload)| {
            let v: Value = serde_json::from_slice(payload).expect("JSON result");
            v["event_id"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    assert_eq!(got.len(), 3 * DEVICES, "get results");
    assert_eq!(events.len(), 3 * DEVICES, "one result per get");
}

/// `kill -9` in the middle of a QoS 1 burst: every message the node acknowledged is in the store
/// after the restart (a broker alone acknowledges once a message is in its memory). One round of
/// 4,000 here; `FLOW_KILL9_ROUNDS=20 FLOW_KILL9_TOTAL=10000` for the soak.
#[tokio::test]
async fn every_publish_acknowledged_before_a_kill_9_is_in_the_store_after_it() {
    let knob = |name: &str, default: usize| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    for round in 0..knob("FLOW_KILL9_ROUNDS", 1) {
        let (acked, lost) = kill9_round(knob("FLOW_KILL9_TOTAL", 4_000), true).await;
        eprintln!("kill -9 round {round}: {acked} acknowledged, {lost} of them lost");
        assert_eq!(lost, 0, "round {round}");
    }
    // And with every commit fsynced before anything is handed on or acknowledged.
    let (acked, lost) = kill9_round(2_000, false).await;
    assert_eq!(lost, 0, "without early hand-on: {acked} acknowledged");
}

/// One burst of `total` with a kill -9 once a quarter is acknowledged, with `store.early_handon`
/// as given; (acknowledged, lost).
async fn kill9_round(total: usize, early_handon: bool) -> (usize, usize) {
    let mut node = Node::start_with(Options {
        // With fsync: early hand-on's syncer syncs the WAL before each PUBACK.
        store_yaml: format!("  synchronous: full\n  early_handon: {early_handon}\n"),
        ..Options::default()
    })
    .await;
    let mut options = MqttOptions::new(unique_id("acked"), "127.0.0.1", node.port);
    options.set_inflight(100);
    let (client, events) = AsyncClient::new(options, 1000);
    let (acked_tx, mut acked_rx) = mpsc::unbounded_channel();
    let poll = tokio::spawn(track_acks(events, acked_tx));
    let publishing = tokio::spawn(async move {
        for i in 0..total {
            let resource = format!("default/pod/k{i}");
            let (_, payload) = envelope(
                "edgecontroller",
                "insert",
                &resource,
                json!({"metadata": {"name": format!("k{i}")}}),
            );
            if client
                .publish(
                    "ke/meta/edgecontroller/insert/default/pod",
                    QoS::AtLeastOnce,
                    false,
                    payload,
                )
                .await
                .is_err()
            {
                return;
            }
        }
    });
    // Kill once a good part is acknowledged, while the rest is in flight.
    let mut acked = Vec::new();
    let deadline = Instant::now() + WAIT;
    while acked.len() < total / 4 && Instant::now() < deadline {
        if let Ok(Some(i)) = tokio::time::timeout(WAIT, acked_rx.recv()).await {
            acked.push(i);
        }
    }
    node.kill9();
    publishing.abort();
    poll.abort();
    while let Ok(i) = acked_rx.try_recv() {
        acked.push(i);
    }
    assert!(acked.len() >= total / 4, "acknowledged before the kill");
    node.restart().await;
    let stored: HashSet<String> = node
        .meta_rows()
        .await
        .into_iter()
        .map(|(key, _, _)| key)
        .collect();
    let lost: Vec<_> = acked
        .iter()
        .filter(|i| !stored.contains(&format!("default/pod/k{i}")))
        .collect();
    if !lost.is_empty() {
        eprintln!("lost, e.g. {:?}", &lost[..lost.len().min(5)]);
    }
    (acked.len(), lost.len())
}

/// Sends the index of every publish the broker acknowledged (pkids are mapped back in order).
async fn track_acks(mut events: EventLoop, acked: mpsc::UnboundedSender<usize>) {
    let mut sent = 0;
    let mut in_flight: HashMap<u16, usize> = HashMap::new();
    loop {
        match events.poll().await {
            Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                in_flight.insert(pkid, sent);
                sent += 1;
            }
            Ok(Event::Incoming(Packet::PubAck(ack))) => {
                if let Some(i) = in_flight.remove(&ack.pkid) {
                    let _ = acked.send(i);
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// The packet ids in `mosquitto_sub -d`'s "received PUBLISH" lines so far, and how many times it
/// connected, reading `lines` for `window`.
async fn publishes_and_connects(
    lines: &mut mpsc::UnboundedReceiver<String>,
    window: Duration,
) -> (Vec<u32>, usize) {
    let (mut pkids, mut connects) = (Vec::new(), 0);
    let _ = tokio::time::timeout(window, async {
        while let Some(line) = lines.recv().await {
            if line.contains("sending CONNECT") {
                connects += 1;
            }
            if let Some(rest) = line.split(" received PUBLISH (").nth(1) {
                let pkid = rest.split(", ").find_map(|f| f.strip_prefix('m'));
                pkids.push(pkid.and_then(|m| m.parse().ok()).unwrap_or(0));
            }
        }
    })
    .await;
    (pkids, connects)
}

/// A mapper subscribed to one device's results at QoS 1 that only acknowledges them, with a
/// 5 s keep-alive (mosquitto's clients then send no PINGREQ), stays connected while it is sent
/// results; a clean-session wildcard subscriber and a persistent session get them too.
#[tokio::test]
async fn a_mapper_that_only_acks_results_stays_connected_and_every_kind_of_subscriber_gets_them() {
    let node = Node::start().await;
    let device = unique_id("dev");
    let result = format!("$hw/events/device/{device}/twin/update/result");
    let port = node.port.to_string();
    let sub_args = ["-h", "127.0.0.1", "-p", &port, "-q", "1"];
    let sub =
        common::MosquittoSub::start(&[&sub_args[..], &["-k", "5", "-t", &result]].concat()).await;
    let (mapper, mut lines) = sub.split();
    let _mapper = common::KillOnDrop(mapper);
    let reporter = node.client().await;
    let report = |n: usize| {
        json!({"event_id": format!("r{n}"), "timestamp": 1,
               "twin": {"t": {"actual": {"value": n.to_string()}}}})
        .to_string()
    };
    let update = format!("$hw/events/device/{device}/twin/update");
    const REPORTS: usize = 36;
    for n in 0..REPORTS {
        reporter.publish(&update, report(n)).await;
        // pacing: a report every 250 ms for 9 s, past the 7.5 s keep-alive timeout.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let (pkids, connects) = publishes_and_connects(&mut lines, Duration::from_secs(1)).await;
    assert_eq!(pkids.len(), REPORTS, "every result arrived: {pkids:?}");
    assert_eq!(connects, 0, "the mapper was never disconnected");

    let wildcard = "$hw/events/device/+/twin/update/result";
    let wild = mosquitto_sub(node.port, wildcard, 2).await;
    reporter.publish(&update, report(REPORTS)).await;
    let (pkids, connects) = publishes_and_connects(&mut lines, Duration::from_secs(1)).await;
    assert_eq!(pkids.len(), 1, "{pkids:?}");
    assert_eq!(connects, 0);

    let persistent_id = unique_id("keeper");
    let wait = common::WAIT.as_secs().to_string();
    let persistent = [
        "-c",
        "-i",
        &persistent_id,
        "-t",
        wildcard,
        "-C",
        "1",
        "-W",
        &wait,
    ];
    let kept = common::MosquittoSub::start(&[&sub_args[..], &persistent].concat()).await;
    reporter.publish(&update, report(REPORTS + 1)).await;
    let (pkids, connects) = publishes_and_connects(&mut lines, Duration::from_secs(1)).await;
    assert_eq!(pkids.len(), 1, "{pkids:?}");
    assert_eq!(connects, 0);
    let (_, got) = wild.output().await;
    assert_eq!(
        got.len(),
        2,
        "the clean wildcard subscriber has both: {got:?}"
    );
    let (_, got) = kept.output().await;
    assert_eq!(got.len(), 1, "the persistent one has the second: {got:?}");
}

/// `kill -STOP` on one of two mappers subscribed to the same device's results: the stopped one
/// is cut off for not taking what it held and the other gets every
/// result, in order. The reporter sends 10 KB reports with a 100-message window.
#[tokio::test]
async fn a_mapper_that_stops_reading_results_is_cut_off_and_the_other_keeps_them() {
    const REPORTS: usize = 1_500;
    let node = stalling_node().await;
    let device = unique_id("dev");
    let result = format!("$hw/events/device/{device}/twin/update/result");
    let cloud = node.client().await;
    let membership = json!({
        "header": {"msg_id": unique_id("msg"), "timestamp": 1},
        "route": {"source": "devicecontroller", "group": "twin", "operation": "update",
                  "resource": "node/membership"},
        "content": {"event_id": "add", "timestamp": 1, "removed_devices": null,
                    "added_devices": [{"id": device, "name": device, "twin": {}}]},
    });
    cloud
        .publish(
            "ke/meta/devicecontroller/update/node/membership",
            membership.to_string(),
        )
        .await;
    let mut live = Reader::subscribe(node.port, &[&result], QoS::AtLeastOnce).await;
    let (stopped, mut printed) = mosquitto_sub(node.port, &result, 1_000_000).await.split();
    let mut stopped = common::KillOnDrop(stopped);
    let update = format!("$hw/events/device/{device}/twin/update");
    // Each result carries the twins back: 20 values of 500 bytes (KubeEdge's limit is 512) fill
    // the stopped mapper's socket.
    let report = |n: usize| {
        let twin: serde_json::Map<String, Value> = (0..20)
            .map(|p| {
                let value = format!("{n:08}{}", "x".repeat(492));
                let twin = json!({"actual": {"value": value}, "metadata": {"type": "string"}});
                (format!("p{p}"), twin)
            })
            .collect();
        json!({"event_id": format!("r{n}"), "timestamp": 1, "twin": twin}).to_string()
    };
    cloud.publish(&update, report(0)).await;
    printed_line(
        &mut printed,
        &result,
        "the second mapper gets the first result",
    )
    .await;
    signal(stopped.0.id(), "STOP");
    for n in 1..REPORTS {
        cloud.publish(&update, report(n)).await;
    }
    let got = live.take(REPORTS, Duration::from_secs(30)).await;
    let events: Vec<String> = got
        .iter()
        .map(|(_, payload)| {
            let v: Value = serde_json::from_slice(payload).expect("JSON result");
            v["event_id"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    let wanted: Vec<String> = (0..REPORTS).map(|n| format!("r{n}")).collect();
    assert_eq!(
        events, wanted,
        "every result, in order, to the mapper that kept reading"
    );
    let last = String::from_utf8_lossy(&got[REPORTS - 1].1);
    assert!(
        last.len() > 8 * 1024 && !last.contains("\"code\""),
        "a result that carries the twin: {}",
        &last[..last.len().min(300)]
    );
    assert_cut_off(&node, "mapper");
    resumed_and_closed(&mut stopped.0, "mapper");
}

/// The node's unlabelled metric `name` now.
async fn metric(node: &Node, name: &str) -> u64 {
    let (status, body) = common::http_get(node.observe_port, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map_or_else(|| panic!("no {name} in:\n{body}"), |v| v as u64)
}

/// A device's reports reach the MetaManager and are answered in order whether or not a
/// monitor subscribes to them too, and the monitor gets every one.
#[tokio::test]
async fn every_report_is_answered_in_order_and_a_monitor_of_them_gets_every_one() {
    let node = Node::start().await;
    let device = unique_id("dev");
    let update = format!("$hw/events/device/{device}/twin/update");
    let mut mapper =
        Reader::subscribe(node.port, &[&format!("{update}/result")], QoS::AtLeastOnce).await;
    let reporter = node.client().await;
    let report = |n: usize| {
        json!({"event_id": format!("r{n}"), "timestamp": 1,
               "twin": {"t": {"actual": {"value": n.to_string()}}}})
        .to_string()
    };
    let answered = |got: Vec<(String, Vec<u8>)>| -> Vec<String> {
        got.iter()
            .map(|(_, payload)| {
                let v: Value = serde_json::from_slice(payload).expect("JSON result");
                v["event_id"].as_str().unwrap_or_default().to_owned()
            })
            .collect()
    };
    const ROUND: usize = 50;
    for n in 0..ROUND {
        reporter.publish(&update, report(n)).await;
    }
    let wanted: Vec<String> = (0..ROUND).map(|n| format!("r{n}")).collect();
    assert_eq!(answered(mapper.take(ROUND, WAIT).await), wanted);

    let connected = metric(&node, "edgemeta_broker_connections").await;
    let monitor = mosquitto_sub(node.port, "$hw/events/device/+/twin/update", ROUND).await;
    let mut results = Vec::new();
    for n in ROUND..2 * ROUND {
        reporter.publish(&update, report(n)).await;
        results.extend(mapper.take(1, WAIT).await);
    }
    let wanted: Vec<String> = (ROUND..2 * ROUND).map(|n| format!("r{n}")).collect();
    assert_eq!(answered(results), wanted);
    let (_, seen) = monitor.output().await;
    assert_eq!(seen.len(), ROUND, "the monitor got every report: {seen:?}");

    // The monitor has gone (it exited after its count): the reports go on being answered.
    let deadline = Instant::now() + WAIT;
    while metric(&node, "edgemeta_broker_connections").await > connected {
        assert!(
            Instant::now() < deadline,
            "the monitor's connection never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for n in 2 * ROUND..3 * ROUND {
        reporter.publish(&update, report(n)).await;
    }
    let wanted: Vec<String> = (2 * ROUND..3 * ROUND).map(|n| format!("r{n}")).collect();
    assert_eq!(answered(mapper.take(ROUND, WAIT).await), wanted);
}
