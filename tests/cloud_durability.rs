//! Store-and-forward under failure, against a real mosquitto as the cloud broker: restarts of the
//! cloud, `kill -9` of the node, messages in flight either way, and a cloud that is not there.

mod common;

use common::{
    envelope, free_port, send, unique_id, Client, CloudBroker, CloudOptions, Msg, Node, Options,
};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const CONNECTION: &str = "ke/meta/edgehub/connect/node/connection";

async fn bridged(cloud: &CloudBroker) -> (Node, CloudOptions) {
    let bridge = CloudOptions::to(cloud);
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..Options::default()
    })
    .await;
    (node, bridge)
}

/// Collects up-messages until every id in `want` has arrived, or `limit` passes.
async fn collect(
    cloud_side: &mut Client,
    want: &HashSet<String>,
    limit: Duration,
    into: &mut Vec<Msg>,
) -> usize {
    let deadline = Instant::now() + limit;
    let mut seen: HashSet<String> = into.iter().map(Msg::msg_id).collect();
    while Instant::now() < deadline && !want.iter().all(|id| seen.contains(id)) {
        for m in cloud_side.drain(Duration::from_millis(300)).await {
            seen.insert(m.msg_id());
            into.push(m);
        }
    }
    want.iter().filter(|id| !seen.contains(*id)).count()
}

/// Asserts per-resource order of first deliveries, and that every duplicate repeats an id.
fn assert_ordered_per_resource(received: &[Msg]) {
    let mut first_seen = HashSet::new();
    let mut last_seq: HashMap<String, i64> = HashMap::new();
    for m in received {
        let body = m.json();
        let id = m.msg_id();
        if !first_seen.insert(id) {
            continue; // a redelivery: same msg_id, allowed by at-least-once
        }
        let resource = body["route"]["resource"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let seq = body["content"]["seq"].as_i64().expect("seq in content");
        if let Some(previous) = last_seq.insert(resource.clone(), seq) {
            assert!(
                seq > previous,
                "{resource}: seq {seq} arrived after {previous}"
            );
        }
    }
}

#[tokio::test]
async fn connection_up_and_down_are_signalled_on_the_local_broker() {
    let mut cloud = CloudBroker::start().await;
    let (node, _bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;

    cloud.stop();
    let down = watcher.expect(CONNECTION).await;
    assert_eq!(down.content(), json!("cloud_disconnected"));
    assert_eq!(down.source(), "edgehub");
    cloud.restart().await;
    let up = watcher.expect(CONNECTION).await;
    assert_eq!(up.content(), json!("cloud_connected"));
}

#[tokio::test]
async fn an_upward_stream_survives_ten_cloud_restarts() {
    const TOTAL: usize = 5_000;
    const RESOURCES: usize = 20;
    let mut cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud.client(&unique_id("controller")).await;
    cloud_side.subscribe(&bridge.up_filter()).await;

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
            if seq % 50 == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        (edged, ids)
    });

    // SIGTERM, not kill -9: mosquitto must keep the test subscriber's queue; what is under test
    // is edgemeta's outbox, not mosquitto's persistence.
    let mut received = Vec::new();
    for _ in 0..10 {
        received.extend(cloud_side.drain(Duration::from_millis(150)).await);
        cloud.stop();
        tokio::time::sleep(Duration::from_millis(200)).await;
        cloud.restart().await;
    }
    let (_edged, ids) = producer.await.expect("producer");
    let missing = collect(
        &mut cloud_side,
        &ids,
        Duration::from_secs(90),
        &mut received,
    )
    .await;
    assert_eq!(
        missing,
        0,
        "{missing} of {TOTAL} messages never reached the cloud; {} wait in the outbox; \
         node log:\n{}",
        node.outbox_len().await,
        tail(&cloud.log(), 60)
    );
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert_eq!(unique.len(), TOTAL, "only sent ids arrive");
    assert!(received.iter().all(|m| m
        .topic
        .starts_with(&bridge.up("edged/update/default/podstatus/p"))));
    assert_ordered_per_resource(&received);
    assert!(node.log().contains("cloud_disconnected"));
}

#[tokio::test]
async fn every_message_acked_before_a_kill_9_reaches_the_cloud_after_restart() {
    const TOTAL: usize = 5_000;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud.client(&unique_id("controller")).await;
    cloud_side.subscribe(&bridge.up_filter()).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;

    for seq in 0..TOTAL {
        let resource = format!("default/podstatus/p{}", seq % 20);
        send(&edged, "edged", "update", &resource, json!({"seq": seq})).await;
    }
    let mut acked = HashSet::new();
    while acked.len() < 1_000 {
        if let Some(parent) = edged.next().await.parent_id() {
            acked.insert(parent);
        }
    }
    node.kill9();
    acked.extend(
        edged
            .drain(Duration::from_millis(50))
            .await
            .iter()
            .filter_map(Msg::parent_id),
    );
    node.restart().await;

    let mut received = Vec::new();
    let missing = collect(
        &mut cloud_side,
        &acked,
        Duration::from_secs(60),
        &mut received,
    )
    .await;
    assert_eq!(
        missing,
        0,
        "{missing} of {} acked messages lost",
        acked.len()
    );
    assert_ordered_per_resource(&received);
}

#[tokio::test]
async fn cloud_messages_in_flight_at_a_kill_9_are_applied_after_restart() {
    const TOTAL: usize = 1_000;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut controller = cloud.client(&unique_id("controller")).await;
    controller.subscribe(&bridge.up("meta/response/#")).await;

    for i in 0..TOTAL {
        let resource = format!("default/pod/p{i}");
        let (_, payload) = envelope("edgecontroller", "insert", &resource, json!({"i": i}));
        controller
            .publish(
                &bridge.down(&format!("edgecontroller/insert/{resource}")),
                payload,
            )
            .await;
    }
    // Kill the node while the cloud is still delivering.
    let mut oks = 0;
    let deadline = Instant::now() + common::WAIT;
    while oks < 100 {
        let batch = controller.drain(Duration::from_millis(200)).await;
        oks += batch.iter().filter(|m| m.content() == json!("OK")).count();
        assert!(
            Instant::now() < deadline,
            "only {oks} acks; node log:\n{}",
            node.log()
        );
    }
    node.kill9();
    // And one more sent while it is down: the cloud broker holds it for the node's session.
    let (late_id, payload) = envelope("edgecontroller", "insert", "default/pod/late", json!({}));
    controller
        .publish(
            &bridge.down("edgecontroller/insert/default/pod/late"),
            payload,
        )
        .await;
    node.restart().await;

    let deadline = Instant::now() + Duration::from_secs(60);
    let mut late_acked = false;
    loop {
        for m in controller.drain(Duration::from_millis(300)).await {
            late_acked |= m.parent_id().as_deref() == Some(late_id.as_str());
        }
        let rows = node.meta_rows().await.len();
        if rows == TOTAL + 1 && late_acked {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{rows} of {} cloud inserts stored, late one acked: {late_acked}\n{}",
            TOTAL + 1,
            node.log()
        );
    }
}

#[tokio::test]
async fn with_the_cloud_unreachable_queries_answer_from_the_store_at_once() {
    let node = Node::start_with(Options {
        cloud: Some(CloudOptions {
            port: free_port(),
            node_id: unique_id("node"),
            backoff_min_ms: 50,
            backoff_max_ms: 500,
        }),
        remote_query_timeout_ms: 30_000,
        store_setup: Some(
            "INSERT INTO meta(key, type, value) VALUES
               ('default/configmap/app', 'configmap', '{\"data\":1}'),
               ('default/pod/a', 'pod', '{\"n\":\"a\"}'),
               ('default/pod/b', 'pod', '{\"n\":\"b\"}');"
                .to_owned(),
        ),
        ..Options::default()
    })
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;

    for (resource, expected) in [
        ("default/configmap/app", json!([r#"{"data":1}"#])),
        ("default/secret/none", json!([])),
        ("default/pod", json!([r#"{"n":"a"}"#, r#"{"n":"b"}"#])),
    ] {
        let started = Instant::now();
        let id = send(&edged, "edged", "query", resource, Value::Null).await;
        let reply = edged
            .expect_reply(&format!("ke/edged/meta/response/{resource}"), &id)
            .await;
        assert_eq!(reply.content(), expected, "{resource}");
        let took = started.elapsed();
        assert!(took < Duration::from_secs(2), "{resource} took {took:?}");
    }
    assert!(node.log().contains("EM-BRIDGE-CONNECT"), "{}", node.log());
}

/// The last `n` lines of a log, for failure messages.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[tokio::test]
async fn a_cloud_change_refused_for_a_full_outbox_is_delivered_again_not_lost() {
    let cloud = CloudBroker::start().await;
    let bridge = CloudOptions::to(&cloud);
    // No room at all: every change that must tell the cloud something is refused for now.
    let mut node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        store_yaml: "  outbox_max_entries: 0\n".to_owned(),
        ..Options::default()
    })
    .await;
    let mut controller = cloud.client(&unique_id("controller")).await;
    controller.subscribe(&bridge.up("meta/#")).await;
    let (id, payload) = envelope(
        "edgecontroller",
        "insert",
        "default/pod/web",
        json!({"v": 1}),
    );
    controller
        .publish(
            &bridge.down("edgecontroller/insert/default/pod/web"),
            payload,
        )
        .await;
    let deadline = Instant::now() + common::WAIT;
    while !node.log().contains("EM-BRIDGE-REDELIVER") {
        assert!(Instant::now() < deadline, "no redelivery:\n{}", node.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(node.stored("default/pod/web").await, None);

    // With room again, the cloud broker's redelivery applies it and the ack reaches the cloud.
    node.kill9();
    node.options.store_yaml = String::new();
    node.reconfigure();
    node.restart().await;
    let ack = controller
        .expect_reply(&bridge.up("meta/response/default/pod/web"), &id)
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        node.stored("default/pod/web").await.as_deref(),
        Some(r#"{"v":1}"#)
    );
}
