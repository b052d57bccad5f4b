//! The cloud bridge against a real mosquitto broker standing in for the cloud.

mod common;

use common::cloud::{bridged, cloud_client, cloud_insert, expect_applied};
use common::{wait_until, CloudBroker};
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

/// Publishes, as the cloud's edgecontroller, `operation` of `resource` at `rv` with message id
/// `id` (the same id again is what a redelivery carries).
async fn cloud_change(
    controller: &common::Client,
    bridge: &common::CloudOptions,
    (operation, resource, rv, id): (&str, &str, u64, &str),
) {
    let payload = json!({
        "header": {"msg_id": id, "timestamp": 1_732_262_400_000_i64, "resourceversion": rv.to_string()},
        "route": {"source": "edgecontroller", "group": "resource", "operation": operation, "resource": resource},
        "content": {"metadata": {"name": "web", "resourceVersion": rv.to_string()}},
    });
    controller
        .publish(
            &bridge.down(&common::topic(
                &format!("edgecontroller/{operation}"),
                resource,
            )),
            payload.to_string(),
        )
        .await;
}

#[tokio::test]
async fn a_cloud_change_delivered_again_or_overtaken_is_acked_but_not_applied_again() {
    let cloud = CloudBroker::start().await;
    let (node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/response/#")).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;
    let web = "default/pod/web";
    let stored_rv = async || -> Option<String> {
        let value: serde_json::Value = serde_json::from_str(&node.stored(web).await?).ok()?;
        value["metadata"]["resourceVersion"]
            .as_str()
            .map(str::to_owned)
    };

    // (operation, rv, id, applied): a redelivery, an older version after a newer one, and an
    // insert older than the delete that followed it are acknowledged and nothing more.
    let changes = [
        ("insert", 5, "m-a", true),
        ("insert", 5, "m-a", false),
        ("update", 7, "m-b", true),
        ("update", 6, "m-c", false),
        ("update", 7, "m-b", false),
        ("delete", 7, "m-d", true),
        ("insert", 7, "m-e", false),
        ("insert", 9, "m-f", true),
    ];
    let mut current = None;
    for (operation, rv, id, applied) in changes {
        cloud_change(&controller, &bridge, (operation, web, rv, id)).await;
        let ack = controller
            .expect_reply_about(&bridge.up("meta/response"), web, id)
            .await;
        assert_eq!(ack.content(), json!("OK"), "{operation} {rv} acknowledged");
        if applied {
            current = (operation != "delete").then(|| rv.to_string());
        }
        assert_eq!(stored_rv().await, current, "after {operation} {rv} ({id})");
    }
    let handed: Vec<String> = edged
        .drain(std::time::Duration::from_millis(500))
        .await
        .iter()
        .filter(|m| m.topic.starts_with("ke/edged/edgecontroller/"))
        .map(common::Msg::msg_id)
        .collect();
    let applied: Vec<&str> = changes.iter().filter(|c| c.3).map(|c| c.2).collect();
    assert_eq!(
        handed, applied,
        "each change handed to edged once, in order"
    );

    // edged removed the pod on its own (it asks the cloud to finish the delete); the
    // controller answers with the version the node had: news again, applied.
    common::send(&edged, "edged", "delete", web, serde_json::Value::Null).await;
    wait_until(
        "edged's delete committed",
        common::WAIT,
        async || match node.stored(web).await {
            None => Ok(()),
            Some(v) => Err(v),
        },
    )
    .await;
    cloud_change(&controller, &bridge, ("insert", web, 9, "m-g")).await;
    controller
        .expect_reply_about(&bridge.up("meta/response"), web, "m-g")
        .await;
    assert_eq!(stored_rv().await.as_deref(), Some("9"));
}
