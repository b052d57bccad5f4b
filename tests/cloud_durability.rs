//! Store-and-forward under failure, against a real mosquitto as the cloud broker: restarts of the
//! cloud, `kill -9` of the node, messages in flight either way, and a cloud that is not there.

mod common;

use common::cloud::{
    assert_ordered_per_resource, await_log, bridged, bridged_with, cloud_client, cloud_insert,
    cut_off_node, expect_applied, expect_delivered, local_query, next_signal, spawn_status_stream,
    CONNECTION,
};
use common::{send, CloudBroker, Msg, Options};
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

#[tokio::test]
async fn connection_up_and_down_are_signalled_on_the_local_broker() {
    let mut cloud = CloudBroker::start().await;
    let (node, _bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;

    cloud.stop();
    assert_eq!(next_signal(&mut watcher).await, "cloud_disconnected");
    cloud.restart().await;
    assert_eq!(next_signal(&mut watcher).await, "cloud_connected");
}

#[tokio::test]
async fn an_upward_stream_survives_ten_cloud_restarts() {
    const TOTAL: usize = 5_000;
    const RESOURCES: usize = 20;
    let mut cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud_client(&cloud, &bridge.up_filter()).await;

    let producer = spawn_status_stream(
        node.client().await,
        TOTAL,
        RESOURCES,
        Some((50, Duration::from_millis(20))),
    );

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
    expect_delivered(
        &mut cloud_side,
        &ids,
        Duration::from_secs(90),
        &mut received,
        &node,
    )
    .await;
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert_eq!(unique.len(), TOTAL, "only sent ids arrive");
    // Up topics name the type; which pod is in the envelope.
    assert!(received
        .iter()
        .all(|m| m.topic == bridge.up("edged/update/default/podstatus")
            && m.resource().starts_with("default/podstatus/p")));
    assert_ordered_per_resource(&received);
    assert!(node.log().contains("cloud_disconnected"));
}

#[tokio::test]
async fn every_message_acked_before_a_kill_9_reaches_the_cloud_after_restart() {
    const TOTAL: usize = 5_000;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud_client(&cloud, &bridge.up_filter()).await;
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

    // Every message acked before the kill.
    let mut received = Vec::new();
    expect_delivered(
        &mut cloud_side,
        &acked,
        Duration::from_secs(60),
        &mut received,
        &node,
    )
    .await;
    assert_ordered_per_resource(&received);
}

#[tokio::test]
async fn cloud_messages_in_flight_at_a_kill_9_are_applied_after_restart() {
    const TOTAL: usize = 1_000;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/response/#")).await;

    for i in 0..TOTAL {
        let resource = format!("default/pod/p{i}");
        cloud_insert(&controller, &bridge, &resource, json!({"i": i})).await;
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
    let late_id = cloud_insert(&controller, &bridge, "default/pod/late", json!({})).await;
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
    let node = cut_off_node(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/configmap/app', 'configmap', '{\"data\":1}'),
           ('default/pod/a', 'pod', '{\"n\":\"a\"}'),
           ('default/pod/b', 'pod', '{\"n\":\"b\"}');",
    )
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;

    for (resource, expected) in [
        ("default/configmap/app", json!([r#"{"data":1}"#])),
        ("default/secret/none", json!([])),
        ("default/pod", json!([r#"{"n":"a"}"#, r#"{"n":"b"}"#])),
    ] {
        assert_eq!(
            local_query(&mut edged, resource).await,
            expected,
            "{resource}"
        );
    }
    assert!(node.log().contains("EM-BRIDGE-CONNECT"), "{}", node.log());
}

#[tokio::test]
async fn a_cloud_change_refused_for_a_full_outbox_is_delivered_again_not_lost() {
    let cloud = CloudBroker::start().await;
    // No room at all: every change that must tell the cloud something is refused for now.
    let (mut node, bridge) = bridged_with(
        &cloud,
        Options {
            store_yaml: "  outbox_max_entries: 0\n".to_owned(),
            ..Options::default()
        },
    )
    .await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/#")).await;
    let id = cloud_insert(&controller, &bridge, "default/pod/web", json!({"v": 1})).await;
    await_log(&node, "EM-BRIDGE-REDELIVER").await;
    assert_eq!(node.stored("default/pod/web").await, None);

    // With room again, the cloud broker's redelivery applies it and the ack reaches the cloud.
    node.kill9();
    node.options.store_yaml = String::new();
    node.reconfigure();
    node.restart().await;
    expect_applied(
        &mut controller,
        &bridge,
        &node,
        "default/pod/web",
        &id,
        r#"{"v":1}"#,
    )
    .await;
}
