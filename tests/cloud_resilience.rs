//! The cloud bridge under stress, against a real mosquitto as the cloud broker: the connection
//! signal, a long upward stream across repeated cloud restarts, `kill -9` of the node during a
//! burst and with cloud messages in flight, and local answers while the cloud is unreachable.

mod common;

use common::cloud::{
    assert_ordered_per_resource, await_empty_outbox, await_log, await_signal, bridged,
    cloud_client, cloud_insert, cut_off_node, expect_delivered, local_query, next_signal,
    spawn_status_stream, tail, CONNECTION,
};
use common::{send, topic, CloudBroker, Msg};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

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
    let mut cloud_side = cloud_client(&cloud, &bridge.up_filter()).await;
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
    expect_delivered(
        &mut cloud_side,
        &HashSet::from([probe_id]),
        common::WAIT,
        &mut received,
        &node,
    )
    .await;

    // edged's pod status updates are stored and forwarded to the cloud through the outbox,
    // spread over the restarts (about 5 s at least).
    let producer = spawn_status_stream(
        node.client().await,
        TOTAL,
        RESOURCES,
        Some((10, Duration::from_millis(10))),
    );

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

    expect_delivered(
        &mut cloud_side,
        &ids,
        Duration::from_secs(120),
        &mut received,
        &node,
    )
    .await;
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
        assert_eq!(m.topic, bridge.up("edged/update/default/podstatus"));
        assert!(resource.starts_with("default/podstatus/p"), "{resource}");
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
    let mut cloud_side = cloud_client(&cloud, &bridge.up_filter()).await;
    // edged is answered "OK" on ke/edged/meta/response/<ns>/<type>, after the commit that also
    // put the cloud-bound copy in the outbox.
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;
    let producer = spawn_status_stream(node.client().await, TOTAL, RESOURCES, None);

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

    // Every message acked OK before the kill -9.
    let mut received = Vec::new();
    expect_delivered(
        &mut cloud_side,
        &acked,
        Duration::from_secs(90),
        &mut received,
        &node,
    )
    .await;
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
    let mut controller = cloud_client(&cloud, &bridge.up("meta/response/#")).await;

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
        warm_ids.insert(cloud_insert(&controller, &bridge, "default/pod/warm", json!({})).await);
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
        let id = cloud_insert(&controller, &bridge, &resource, json!({"i": i})).await;
        want.insert(id, resource);
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    node.kill9();

    // One published while the node is down: mosquitto queues it for the node's session.
    let resource = "default/configmap/while-down";
    let down_id = cloud_insert(&controller, &bridge, resource, json!({"data": {"k": "v"}})).await;
    want.insert(down_id, resource.to_owned());
    tokio::time::sleep(Duration::from_millis(300)).await;
    node.restart().await;

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut oks: HashSet<String> = HashSet::new();
    loop {
        for m in controller.drain(Duration::from_millis(300)).await {
            if m.content() == json!("OK") {
                let parent = m.parent_id().expect("ack names its request");
                if let Some(resource) = want.get(&parent) {
                    assert_eq!(m.topic, topic(&bridge.up("meta/response"), resource));
                    assert_eq!(&m.resource(), resource);
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
    // Nothing listens at the cloud's address: the bridge keeps failing to connect, and a node
    // that waited for the cloud would be caught by the 2 s bound of `local_query`.
    let node = cut_off_node(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/configmap/cm1', 'configmap', '{\"data\":{\"a\":\"1\"}}'),
           ('default/secret/s1', 'secret', '{\"data\":{\"p\":\"x\"}}'),
           ('default/node/edge-1', 'node', '{\"status\":\"Ready\"}'),
           ('default/pod/web', 'pod', '{\"n\":\"web\"}'),
           ('default/pod/db', 'pod', '{\"n\":\"db\"}'),
           ('kube-system/pod/dns', 'pod', '{\"n\":\"dns\"}');",
    )
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/#").await;

    // The bridge has really tried and failed before we ask.
    await_log(&node, "EM-BRIDGE-CONNECT").await;

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
        let content = local_query(&mut edged, resource).await;
        let mut got: Vec<String> = serde_json::from_value(content.clone())
            .unwrap_or_else(|e| panic!("{resource}: not a list of strings ({e}): {content}"));
        let mut expected: Vec<String> = serde_json::from_value(expected).unwrap();
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "{resource}");
    }
}
