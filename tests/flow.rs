//! The basic promise: a resource published over MQTT is stored, handed on and acknowledged.

mod common;

use common::{send, Node};
use serde_json::json;

#[tokio::test]
async fn an_inserted_pod_is_stored_handed_to_edged_and_acked_to_the_cloud() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/#").await;
    let cloud = node.client().await;

    let id = send(
        &cloud,
        "edgecontroller",
        "insert",
        "default/pod/nginx",
        json!({"metadata": {"name": "nginx"}}),
    )
    .await;

    let to_edged = watcher
        .expect("ke/edged/edgecontroller/insert/default/pod/nginx")
        .await;
    assert_eq!(to_edged.msg_id(), id);
    assert_eq!(to_edged.content(), json!({"metadata": {"name": "nginx"}}));
    let ack = watcher
        .expect_reply("ke/cloud/meta/response/default/pod/nginx", &id)
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        node.stored("default/pod/nginx").await.as_deref(),
        Some(r#"{"metadata":{"name":"nginx"}}"#)
    );
}
