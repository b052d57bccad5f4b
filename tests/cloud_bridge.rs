//! The cloud bridge against a real mosquitto broker standing in for the cloud.

mod common;

use common::{envelope, CloudBroker, CloudOptions, Node, Options};
use serde_json::json;

#[tokio::test]
async fn a_cloud_insert_is_committed_then_acked_up_and_handed_to_edged() {
    let cloud = CloudBroker::start().await;
    let bridge = CloudOptions::to(&cloud);
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..Options::default()
    })
    .await;
    let mut controller = cloud.client(&common::unique_id("controller")).await;
    controller.subscribe(&bridge.up_filter()).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;

    let (id, payload) = envelope(
        "edgecontroller",
        "insert",
        "default/pod/web",
        json!({"spec": 1}),
    );
    controller
        .publish(
            &bridge.down("edgecontroller/insert/default/pod/web"),
            payload,
        )
        .await;

    let ack = controller
        .expect_reply(&bridge.up("meta/response/default/pod/web"), &id)
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        node.stored("default/pod/web").await.as_deref(),
        Some(r#"{"spec":1}"#)
    );
    let handed = edged
        .expect("ke/edged/edgecontroller/insert/default/pod/web")
        .await;
    assert_eq!(handed.msg_id(), id);
}
