//! The cloud bridge against a real mosquitto broker standing in for the cloud.

mod common;

use common::cloud::{bridged, cloud_client, cloud_insert, expect_applied};
use common::CloudBroker;
use serde_json::json;

#[tokio::test]
async fn a_cloud_insert_is_committed_then_acked_up_and_handed_to_edged() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up_filter()).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;

    let id = cloud_insert(&controller, &bridge, "default/pod/web", json!({"spec": 1})).await;

    expect_applied(
        &mut controller,
        &bridge,
        &node,
        "default/pod/web",
        &id,
        r#"{"spec":1}"#,
    )
    .await;
    let handed = edged
        .expect_about("ke/edged/edgecontroller/insert", "default/pod/web")
        .await;
    assert_eq!(handed.msg_id(), id);
}
