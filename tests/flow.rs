//! The basic promise: a resource published over MQTT is stored, handed on and acknowledged.

mod common;

use std::time::Duration;

use common::{send, wait_until, Node};
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

    // The topic names the type, the envelope the pod.
    let to_edged = watcher
        .expect_about("ke/edged/edgecontroller/insert", "default/pod/nginx")
        .await;
    assert_eq!(to_edged.topic, "ke/edged/edgecontroller/insert/default/pod");
    assert_eq!(to_edged.msg_id(), id);
    assert_eq!(to_edged.content(), json!({"metadata": {"name": "nginx"}}));
    let ack = watcher
        .expect_reply_about("ke/cloud/meta/response", "default/pod/nginx", &id)
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        node.stored("default/pod/nginx").await.as_deref(),
        Some(r#"{"metadata":{"name":"nginx"}}"#)
    );
}

/// Standalone mode: the outbox reaches `ke/cloud/...` whole, once, in order, and is emptied, so
/// a restart sends nothing again. 600 answers span several relay rounds of 256 rows.
#[tokio::test]
async fn the_local_relay_delivers_every_cloud_message_once_in_order_and_empties_the_outbox() {
    const COUNT: usize = 600;
    let mut node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/cloud/#").await;
    let cloud = node.client().await;
    let mut sent = Vec::with_capacity(COUNT);
    for i in 0..COUNT {
        let resource = format!("relay/pod/p{i}");
        sent.push(
            send(
                &cloud,
                "edgecontroller",
                "insert",
                &resource,
                json!({"n": i}),
            )
            .await,
        );
    }

    let mut answered = Vec::with_capacity(COUNT);
    wait_until(
        format_args!("{COUNT} answers on ke/cloud"),
        Duration::from_secs(30),
        async || {
            for m in watcher.drain(Duration::from_millis(200)).await {
                assert_eq!(
                    m.topic, "ke/cloud/meta/response/relay/pod",
                    "type-level topic"
                );
                answered.push(m.parent_id().expect("an answer names its request"));
            }
            if answered.len() >= COUNT {
                Ok(())
            } else {
                Err(format!("{} answers", answered.len()))
            }
        },
    )
    .await;
    assert_eq!(
        answered, sent,
        "answers on ke/cloud: missing, repeated or out of order"
    );

    // The outbox is emptied after delivery.
    common::cloud::await_empty_outbox(&node, Duration::from_secs(10)).await;
    node.terminate();
    node.restart().await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/cloud/#").await;
    let again = watcher.drain(Duration::from_secs(1)).await;
    assert!(
        again.is_empty(),
        "{} answers sent again after a restart",
        again.len()
    );
}

/// Standalone mode: a row relayed while no client subscribes to its topic is deleted
/// unpublished, and the outbox still empties; a shared subscription counts as a subscriber and
/// gets the rows relayed from then on, in order.
#[tokio::test]
async fn the_relay_serves_shared_subscribers_and_deletes_rows_nobody_subscribes_to() {
    let node = Node::start().await;
    let cloud = node.client().await;
    let unheard = send(
        &cloud,
        "edgecontroller",
        "insert",
        "relay/pod/unheard",
        json!({}),
    )
    .await;
    // Committed (its answer is then an outbox row), then relayed: the outbox is empty again.
    wait_until(
        "the unheard insert is stored",
        Duration::from_secs(10),
        async || node.stored("relay/pod/unheard").await.is_some(),
    )
    .await;
    common::cloud::await_empty_outbox(&node, Duration::from_secs(10)).await;

    let mut member = node.client().await;
    member.subscribe("$share/group/ke/cloud/#").await;
    let mut heard = Vec::new();
    for i in 0..3 {
        heard.push(
            send(
                &cloud,
                "edgecontroller",
                "insert",
                &format!("relay/pod/heard{i}"),
                json!({"n": i}),
            )
            .await,
        );
    }
    let mut answered = Vec::new();
    wait_until(
        "the shared subscriber gets the 3 answers",
        Duration::from_secs(10),
        async || {
            for m in member.drain(Duration::from_millis(100)).await {
                answered.push(m.parent_id().expect("an answer names its request"));
            }
            if answered.len() >= heard.len() {
                Ok(())
            } else {
                Err(format!("{} answers", answered.len()))
            }
        },
    )
    .await;
    assert_eq!(answered, heard, "answers missing, repeated or out of order");
    assert!(
        !answered.contains(&unheard),
        "a row relayed before anyone subscribed was published"
    );
    common::cloud::await_empty_outbox(&node, Duration::from_secs(10)).await;
}
