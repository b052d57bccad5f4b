//! The cloud bridge under stress, against a real mosquitto as the cloud broker: the connection
//! signal, a long upward stream across repeated cloud restarts, `kill -9` of the node during a
//! burst and with cloud messages in flight, and local answers while the cloud is unreachable.

mod common;

use common::{
    envelope, free_port, send, unique_id, Client, CloudBroker, CloudOptions, Msg, Node, Options,
};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// Where the cloud bridge announces its session state on the local broker.
const CONNECTION: &str = "ke/meta/edgehub/connect/node/connection";

/// A node bridged to `cloud` with a fresh node id.
async fn bridged(cloud: &CloudBroker) -> (Node, CloudOptions) {
    let bridge = CloudOptions::to(cloud);
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..Options::default()
    })
    .await;
    (node, bridge)
}

/// Waits for the next connection signal and checks its envelope; returns its state.
async fn next_signal(watcher: &mut Client) -> String {
    let m = watcher.expect(CONNECTION).await;
    let body = m.json();
    assert_eq!(body["route"]["source"], "edgehub", "{body}");
    assert_eq!(body["route"]["operation"], "connect", "{body}");
    assert_eq!(body["route"]["resource"], "node/connection", "{body}");
    assert!(body["header"]["msg_id"].is_string(), "{body}");
    m.content().as_str().unwrap_or_default().to_owned()
}

/// Skips connection signals until `state` arrives (a flapping link may report the other state
/// in between), within `limit`.
async fn await_signal(watcher: &mut Client, state: &str, limit: Duration, node: &Node) {
    let deadline = Instant::now() + limit;
    loop {
        assert!(
            Instant::now() < deadline,
            "no {state} signal within {limit:?}; node log:\n{}",
            tail(&node.log(), 40)
        );
        if next_signal(watcher).await == state {
            return;
        }
    }
}

/// Drains the cloud-side client into `into` until every id in `want` was seen or `limit`
/// passed; returns how many of `want` are still missing.
async fn collect(
    cloud_side: &mut Client,
    want: &HashSet<String>,
    limit: Duration,
    into: &mut Vec<Msg>,
) -> usize {
    let deadline = Instant::now() + limit;
    let mut seen: HashSet<String> = into.iter().map(Msg::msg_id).collect();
    loop {
        let missing = want.iter().filter(|id| !seen.contains(*id)).count();
        if missing == 0 || Instant::now() >= deadline {
            return missing;
        }
        for m in cloud_side.drain(Duration::from_millis(250)).await {
            seen.insert(m.msg_id());
            into.push(m);
        }
    }
}

/// Per resource, the first delivery of each message carries a larger `seq` than the previous
/// first delivery (redeliveries, recognised by a repeated `msg_id`, are skipped). Also checks
/// that a repeated `msg_id` always repeats the same message. Returns the number of duplicates.
fn assert_ordered_per_resource(received: &[Msg]) -> usize {
    let mut first: HashMap<String, (String, i64)> = HashMap::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    let mut duplicates = 0;
    for m in received {
        let body = m.json();
        let resource = body["route"]["resource"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let seq = body["content"]["seq"]
            .as_i64()
            .unwrap_or_else(|| panic!("no seq in {body}"));
        if let Some((r, s)) = first.get(&m.msg_id()) {
            assert_eq!(
                (r, *s),
                (&resource, seq),
                "msg_id {} reused for a different message",
                m.msg_id()
            );
            duplicates += 1;
            continue;
        }
        first.insert(m.msg_id(), (resource.clone(), seq));
        if let Some(previous) = last_seq.insert(resource.clone(), seq) {
            assert!(
                seq > previous,
                "{resource}: seq {seq} first arrived after seq {previous}"
            );
        }
    }
    duplicates
}

/// Waits until the node's outbox is empty (everything acknowledged by the cloud was deleted).
async fn await_empty_outbox(node: &Node, limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let len = node.outbox_len().await;
        if len == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{len} entries still in the outbox after {limit:?}; node log:\n{}",
            tail(&node.log(), 40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The last `n` lines of a log, for failure messages.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[tokio::test]
async fn cloud_connected_and_disconnected_are_signalled() {
    // The cloud is down when the node starts, so the first signal cannot be missed: the
    // watcher subscribes before the bridge can possibly connect.
    let mut cloud = CloudBroker::start().await;
    cloud.stop();
    let (node, _bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    // A bridge that never reached the cloud has nothing to report as lost.
    watcher.expect_silence(CONNECTION).await;

    cloud.restart().await;
    assert_eq!(next_signal(&mut watcher).await, "cloud_connected");

    // Graceful stop (the broker closes the socket)...
    cloud.stop();
    assert_eq!(next_signal(&mut watcher).await, "cloud_disconnected");
    cloud.restart().await;
    assert_eq!(next_signal(&mut watcher).await, "cloud_connected");

    // ...and a crash of the cloud broker (the kernel closes it).
    cloud.kill9();
    assert_eq!(next_signal(&mut watcher).await, "cloud_disconnected");
    cloud.restart().await;
    assert_eq!(next_signal(&mut watcher).await, "cloud_connected");

    // Exactly one signal per transition.
    watcher.expect_silence(CONNECTION).await;
    let log = node.log();
    assert!(log.contains("EM-BRIDGE-DISCONNECTED"), "{log}");
}

#[tokio::test]
async fn upward_stream_survives_ten_cloud_restarts() {
    const TOTAL: usize = 5_000;
    const RESOURCES: usize = 20;
    const RESTARTS: usize = 10;
    let mut cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    // A fixed id and a persistent session: mosquitto queues for it while it is disconnected.
    let mut cloud_side = cloud.client(&unique_id("controller")).await;
    cloud_side.subscribe(&bridge.up_filter()).await;
    // The node may have connected before the watcher subscribed: make sure it is up now by
    // a round trip through the cloud.
    let probe = node.client().await;
    let probe_id = send(
        &probe,
        "edged",
        "update",
        "default/podstatus/probe",
        json!({"seq": -1}),
    )
    .await;
    let mut received = Vec::new();
    let missing = collect(
        &mut cloud_side,
        &HashSet::from([probe_id]),
        common::WAIT,
        &mut received,
    )
    .await;
    assert_eq!(missing, 0, "the bridge never came up:\n{}", node.log());

    // edged's pod status updates are stored and forwarded to the cloud through the outbox.
    let edged = node.client().await;
    let producer = tokio::spawn(async move {
        let mut ids = HashSet::new();
        for seq in 0..TOTAL {
            let resource = format!("default/podstatus/p{}", seq % RESOURCES);
            let (id, payload) = envelope("edged", "update", &resource, json!({"seq": seq}));
            edged
                .publish(&format!("ke/meta/edged/update/{resource}"), payload)
                .await;
            ids.insert(id);
            // Spread the stream over the restarts (about 5 s at least).
            if seq % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        (edged, ids)
    });

    // The restarts use SIGTERM (`stop`), not `kill -9`: mosquitto PUBACKs the node's messages
    // and only saves the test subscriber's queue once a second, so after a `kill -9` of the
    // cloud broker a message that edgemeta rightly deleted from its outbox could be lost by
    // mosquitto itself. What is under test is edgemeta's outbox, not mosquitto's persistence.
    // Each restart waits for the bridge's `cloud_connected` first, so every one of the ten
    // interrupts a live session (with messages in flight while the producer runs).
    let mut restarts_during_stream = 0;
    for _ in 0..RESTARTS {
        received.extend(cloud_side.drain(Duration::from_millis(200)).await);
        restarts_during_stream += usize::from(!producer.is_finished());
        cloud.stop();
        await_signal(&mut watcher, "cloud_disconnected", common::WAIT, &node).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        cloud.restart().await;
        await_signal(&mut watcher, "cloud_connected", common::WAIT, &node).await;
    }
    let (_edged, ids) = tokio::time::timeout(Duration::from_secs(60), producer)
        .await
        .expect("the producer finished within 60 s")
        .expect("producer");
    eprintln!("{restarts_during_stream} of {RESTARTS} cloud restarts during the stream");

    let started = Instant::now();
    let missing = collect(
        &mut cloud_side,
        &ids,
        Duration::from_secs(120),
        &mut received,
    )
    .await;
    assert_eq!(
        missing,
        0,
        "{missing} of {TOTAL} messages never reached the cloud (after {:?} more); {} entries in \
         the outbox; node log:\n{}",
        started.elapsed(),
        node.outbox_len().await,
        tail(&node.log(), 60)
    );
    let duplicates = assert_ordered_per_resource(&received);
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert_eq!(
        unique.len(),
        TOTAL + 1,
        "only the sent ids (and the probe) arrive"
    );
    for m in &received {
        let resource = m.json()["route"]["resource"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert_eq!(m.topic, bridge.up(&format!("edged/update/{resource}")));
        assert_eq!(m.source(), "edged");
        assert_eq!(m.operation(), "update");
    }
    eprintln!(
        "{} deliveries for {} messages ({duplicates} duplicates)",
        received.len(),
        unique.len()
    );
    // Every acknowledged entry is deleted, and the last status of each pod is stored.
    await_empty_outbox(&node, common::WAIT).await;
    for k in 0..RESOURCES {
        let last = TOTAL - RESOURCES + k;
        assert_eq!(
            node.stored(&format!("default/podstatus/p{k}"))
                .await
                .as_deref(),
            Some(format!(r#"{{"seq":{last}}}"#).as_str())
        );
    }
}

#[tokio::test]
async fn kill9_during_burst_loses_nothing_acked() {
    const TOTAL: usize = 5_000;
    const RESOURCES: usize = 20;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud.client(&unique_id("controller")).await;
    cloud_side.subscribe(&bridge.up_filter()).await;
    // edged is answered "OK" on ke/edged/meta/response/<resource>, after the commit that also
    // put the cloud-bound copy in the outbox.
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;
    let publisher = node.client().await;

    let producer = tokio::spawn(async move {
        let mut sent = HashSet::new();
        for seq in 0..TOTAL {
            let resource = format!("default/podstatus/p{}", seq % RESOURCES);
            let (id, payload) = envelope("edged", "update", &resource, json!({"seq": seq}));
            publisher
                .publish(&format!("ke/meta/edged/update/{resource}"), payload)
                .await;
            sent.insert(id);
        }
        (publisher, sent)
    });

    let mut acked = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.len() < TOTAL / 3 {
        assert!(
            Instant::now() < deadline,
            "only {} OKs in 60 s; node log:\n{}",
            acked.len(),
            tail(&node.log(), 40)
        );
        let m = edged.next().await;
        assert_eq!(m.content(), json!("OK"), "{:?}", m.payload);
        acked.insert(m.parent_id().expect("reply names its request"));
    }
    node.kill9();
    // OKs that were already on their way to us before the kill count too.
    for m in edged.drain(Duration::from_millis(300)).await {
        if m.content() == json!("OK") {
            acked.extend(m.parent_id());
        }
    }
    eprintln!("{} of {TOTAL} acked when the node was killed", acked.len());
    node.restart().await;
    // The producer may be blocked on a full client queue until the node is back.
    let (_publisher, sent) = tokio::time::timeout(Duration::from_secs(60), producer)
        .await
        .expect("the producer finished within 60 s")
        .expect("producer");
    assert!(acked.is_subset(&sent), "OKs only for requests we sent");

    let mut received = Vec::new();
    let missing = collect(
        &mut cloud_side,
        &acked,
        Duration::from_secs(90),
        &mut received,
    )
    .await;
    assert_eq!(
        missing,
        0,
        "{missing} of {} messages acked OK before the kill -9 never reached the cloud; \
         {} entries in the outbox; node log:\n{}",
        acked.len(),
        node.outbox_len().await,
        tail(&node.log(), 60)
    );
    assert_ordered_per_resource(&received);
    // Nothing reaches the cloud that was not sent.
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert!(unique.is_subset(&sent));
    await_empty_outbox(&node, Duration::from_secs(30)).await;
}

#[tokio::test]
async fn cloud_message_in_flight_at_kill_is_redelivered() {
    const BEFORE: usize = 200;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut controller = cloud.client(&unique_id("controller")).await;
    controller.subscribe(&bridge.up("meta/response/#")).await;

    // Make sure the node's persistent session on the cloud broker exists and is subscribed:
    // mosquitto drops what is published before the bridge's first SUBSCRIBE, so repeat a
    // harmless insert until one is acknowledged.
    let deadline = Instant::now() + common::WAIT;
    let mut warm_ids = HashSet::new();
    'warm: loop {
        assert!(
            Instant::now() < deadline,
            "the bridge never subscribed to its down topics; node log:\n{}",
            tail(&node.log(), 40)
        );
        let (warm_id, payload) =
            envelope("edgecontroller", "insert", "default/pod/warm", json!({}));
        controller
            .publish(
                &bridge.down("edgecontroller/insert/default/pod/warm"),
                payload,
            )
            .await;
        warm_ids.insert(warm_id);
        for m in controller.drain(Duration::from_millis(500)).await {
            if m.parent_id().is_some_and(|p| warm_ids.contains(&p)) {
                assert_eq!(m.content(), json!("OK"));
                break 'warm;
            }
        }
    }

    // A batch published just before the kill: some are in flight to, or inside, the node.
    let mut want: HashMap<String, String> = HashMap::new();
    for i in 0..BEFORE {
        let resource = format!("default/pod/before{i}");
        let (id, payload) = envelope("edgecontroller", "insert", &resource, json!({"i": i}));
        controller
            .publish(
                &bridge.down(&format!("edgecontroller/insert/{resource}")),
                payload,
            )
            .await;
        want.insert(id, resource);
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    node.kill9();

    // One published while the node is down: mosquitto queues it for the node's session.
    let resource = "default/configmap/while-down";
    let (down_id, payload) = envelope(
        "edgecontroller",
        "insert",
        resource,
        json!({"data": {"k": "v"}}),
    );
    controller
        .publish(
            &bridge.down(&format!("edgecontroller/insert/{resource}")),
            payload,
        )
        .await;
    want.insert(down_id.clone(), resource.to_owned());
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.restart().await;

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut oks: HashSet<String> = HashSet::new();
    loop {
        for m in controller.drain(Duration::from_millis(300)).await {
            if m.content() == json!("OK") {
                let parent = m.parent_id().expect("ack names its request");
                if let Some(resource) = want.get(&parent) {
                    assert_eq!(m.topic, bridge.up(&format!("meta/response/{resource}")));
                }
                oks.insert(parent);
            }
        }
        let missing: Vec<&String> = want.keys().filter(|id| !oks.contains(*id)).collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} cloud inserts never acked (e.g. {:?}); node log:\n{}",
            missing.len(),
            want.len(),
            missing
                .iter()
                .take(3)
                .map(|id| &want[*id])
                .collect::<Vec<_>>(),
            tail(&node.log(), 60)
        );
    }
    assert_eq!(
        node.stored(resource).await.as_deref(),
        Some(r#"{"data":{"k":"v"}}"#)
    );
    for i in 0..BEFORE {
        assert_eq!(
            node.stored(&format!("default/pod/before{i}"))
                .await
                .as_deref(),
            Some(format!(r#"{{"i":{i}}}"#).as_str()),
            "before{i}"
        );
    }
    // An ack is sent only after the commit, and each insert lands exactly once in the store.
    assert_eq!(node.meta_rows().await.len(), BEFORE + 2);
}

#[tokio::test]
async fn cloud_unreachable_local_queries_answer_at_once() {
    let node = Node::start_with(Options {
        // Nothing listens there: the bridge keeps failing to connect.
        cloud: Some(CloudOptions {
            port: free_port(),
            node_id: unique_id("node"),
            backoff_min_ms: 50,
            backoff_max_ms: 500,
        }),
        // A node that waited for the cloud would be caught by the 2 s bound below.
        remote_query_timeout_ms: 30_000,
        store_setup: Some(
            "INSERT INTO meta(key, type, value) VALUES
               ('default/configmap/cm1', 'configmap', '{\"data\":{\"a\":\"1\"}}'),
               ('default/secret/s1', 'secret', '{\"data\":{\"p\":\"x\"}}'),
               ('default/node/edge-1', 'node', '{\"status\":\"Ready\"}'),
               ('default/pod/web', 'pod', '{\"n\":\"web\"}'),
               ('default/pod/db', 'pod', '{\"n\":\"db\"}'),
               ('kube-system/pod/dns', 'pod', '{\"n\":\"dns\"}');"
                .to_owned(),
        ),
        ..Options::default()
    })
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/#").await;

    // The bridge has really tried and failed before we ask.
    let deadline = Instant::now() + common::WAIT;
    while !node.log().contains("EM-BRIDGE-CONNECT") {
        assert!(
            Instant::now() < deadline,
            "no connect failure logged:\n{}",
            node.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let cases = [
        // Remote-query types fall back to the local copy at once.
        ("default/configmap/cm1", json!([r#"{"data":{"a":"1"}}"#])),
        ("default/secret/s1", json!([r#"{"data":{"p":"x"}}"#])),
        ("default/node/edge-1", json!([r#"{"status":"Ready"}"#])),
        ("default/configmap/absent", json!([])),
        // edged's start-up pod list, by type.
        (
            "default/pod",
            json!([r#"{"n":"web"}"#, r#"{"n":"db"}"#, r#"{"n":"dns"}"#]),
        ),
    ];
    for (resource, expected) in cases {
        let started = Instant::now();
        let id = send(&edged, "edged", "query", resource, Value::Null).await;
        let reply = edged
            .expect_reply(&format!("ke/edged/meta/response/{resource}"), &id)
            .await;
        let took = started.elapsed();
        let mut got: Vec<String> = serde_json::from_value(reply.content())
            .unwrap_or_else(|e| panic!("{resource}: not a list of strings ({e}): {reply:?}"));
        let mut expected: Vec<String> = serde_json::from_value(expected).unwrap();
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "{resource}");
        assert!(took < Duration::from_secs(2), "{resource} took {took:?}");
        eprintln!("{resource}: answered in {took:?}");
    }
}
