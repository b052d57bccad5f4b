//! Topic contract v2 (protocol §2) end to end: topics name the type, `route.resource` names the
//! object. Requests on type-level topics find their name in the envelope or the object's
//! metadata; v1 requests with a name level keep working; nothing the node publishes has one.

mod common;

use common::{envelope, send, Client, Msg, Node, Options};
use serde_json::{json, Value};

/// A node and a client that sees everything under `ke/`.
async fn watched() -> (Node, Client) {
    watched_with(Options::default()).await
}

async fn watched_with(options: Options) -> (Node, Client) {
    let node = Node::start_with(options).await;
    let mut bus = node.client().await;
    bus.subscribe("ke/#").await;
    (node, bus)
}

/// The text of an error reply.
fn text(reply: &Msg) -> String {
    reply.content().as_str().unwrap_or_default().to_owned()
}

/// Expects edgecontroller's insert of `key` handed to edged on the type-level topic with the
/// full resource in its route, then the cloud's "OK" to it on its type-level topic, and
/// `content` stored under `key`. Returns the id edged was handed (a bare payload's is new).
async fn expect_inserted(bus: &mut Client, node: &Node, key: &str, content: &Value) -> String {
    let handed = bus
        .expect_about("ke/edged/edgecontroller/insert", key)
        .await;
    assert_eq!(handed.topic, "ke/edged/edgecontroller/insert/default/pod");
    assert_eq!(handed.source(), "edgecontroller");
    assert_eq!(&handed.content(), content);
    let ack = bus
        .expect_reply_about("ke/cloud/meta/response", key, &handed.msg_id())
        .await;
    assert_eq!(ack.topic, "ke/cloud/meta/response/default/pod");
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        node.stored(key).await.as_deref(),
        Some(content.to_string().as_str())
    );
    handed.msg_id()
}

#[tokio::test]
async fn a_bare_payload_on_a_type_level_topic_is_named_by_its_metadata() {
    let (node, mut bus) = watched().await;
    let content = json!({"metadata": {"name": "web", "namespace": "default"}, "spec": {}});
    bus.publish(
        "ke/meta/edgecontroller/insert/default/pod",
        content.to_string(),
    )
    .await;
    expect_inserted(&mut bus, &node, "default/pod/web", &content).await;
    assert_eq!(node.meta_rows().await.len(), 1);
}

#[tokio::test]
async fn a_name_level_in_the_topic_wins_and_the_node_still_publishes_type_level() {
    let (node, mut bus) = watched().await;
    let content = json!({"metadata": {"name": "from-metadata"}});
    bus.publish(
        "ke/meta/edgecontroller/insert/default/pod/from-topic",
        content.to_string(),
    )
    .await;
    expect_inserted(&mut bus, &node, "default/pod/from-topic", &content).await;
    assert_eq!(node.stored("default/pod/from-metadata").await, None);
}

#[tokio::test]
async fn a_full_envelope_on_a_type_level_topic_is_named_by_its_route() {
    let (node, mut bus) = watched().await;
    // The route's name wins over metadata.name; the topic wins for namespace and type.
    let content = json!({"metadata": {"name": "other"}, "v": 1});
    let (id, payload) = envelope(
        "edgecontroller",
        "insert",
        "elsewhere/secret/web",
        content.clone(),
    );
    bus.publish("ke/meta/edgecontroller/insert/default/pod", payload)
        .await;
    let handed = expect_inserted(&mut bus, &node, "default/pod/web", &content).await;
    assert_eq!(handed, id, "the request keeps its id when handed on");
    let keys: Vec<String> = node.meta_rows().await.into_iter().map(|r| r.0).collect();
    assert_eq!(keys, ["default/pod/web"]);
}

#[tokio::test]
async fn a_namespace_the_topic_contradicts_is_an_error_and_nothing_is_stored() {
    let (node, mut bus) = watched().await;
    let content = json!({"metadata": {"name": "web", "namespace": "kube-system"}});
    bus.publish("ke/meta/edged/insert/default/pod", content.to_string())
        .await;
    let reply = bus.expect("ke/edged/meta/error/default/pod").await;
    assert_eq!(reply.operation(), "error");
    assert_eq!(reply.source(), "meta");
    assert_eq!(reply.resource(), "default/pod/web");
    assert_eq!(
        text(&reply),
        r#"namespace mismatch: the topic names namespace "default", content.metadata.namespace is "kube-system""#
    );
    // edged is not handed anything about it, and nothing is stored.
    bus.expect_silence_about("ke/edged/edged/insert", "default/pod/web")
        .await;
    assert!(node.meta_rows().await.is_empty());
    assert!(node.log().contains("EM-META-NAMESPACE"), "{}", node.log());
}

#[tokio::test]
async fn an_operation_on_an_object_that_names_none_is_an_error_and_nothing_is_stored() {
    let (node, mut bus) = watched().await;
    // A bare payload without metadata.name.
    bus.publish("ke/meta/edged/insert/default/pod", r#"{"spec":{}}"#)
        .await;
    let reply = bus.expect("ke/edged/meta/error/default/pod").await;
    assert_eq!(reply.resource(), "default/pod");
    assert_eq!(
        text(&reply),
        "no resource name: the topic has no <name> level and neither route.resource nor content.metadata.name gives one"
    );
    // A full envelope whose route names no object: the reply carries its id.
    let id = send(
        &bus,
        "edged",
        "update",
        "default/podstatus",
        json!({"phase": "x"}),
    )
    .await;
    let reply = bus
        .expect_reply_about("ke/edged/meta/error", "default/podstatus", &id)
        .await;
    assert!(
        text(&reply).starts_with("no resource name"),
        "{}",
        text(&reply)
    );
    // Nothing went to the cloud or to edged, and nothing is stored.
    bus.expect_silence("ke/cloud/edged/update/default/podstatus")
        .await;
    bus.expect_silence("ke/edged/edged/insert/default/pod")
        .await;
    assert!(node.meta_rows().await.is_empty());
    assert!(node.log().contains("EM-META-NO-NAME"), "{}", node.log());
}

#[tokio::test]
async fn a_list_query_on_a_type_level_topic_is_still_answered() {
    let (_node, mut bus) = watched_with(Options::seeded(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/pod/a', 'pod', '{\"n\":\"a\"}'),
           ('default/pod/b', 'pod', '{\"n\":\"b\"}'),
           ('default/configmap/c', 'configmap', '{}');",
    ))
    .await;
    // A bare query: no name anywhere, so it lists the type.
    bus.publish("ke/meta/edged/query/default/pod", "").await;
    let answer = bus.expect("ke/edged/meta/response/default/pod").await;
    assert_eq!(answer.resource(), "default/pod");
    let mut pods: Vec<String> = serde_json::from_value(answer.content()).expect("[]string");
    pods.sort();
    assert_eq!(pods, [r#"{"n":"a"}"#, r#"{"n":"b"}"#]);
    // A full envelope naming one object on the same topic gets that object only.
    let id = send(&bus, "edged", "query", "default/pod/b", Value::Null).await;
    let one = bus
        .expect_reply_about("ke/edged/meta/response", "default/pod/b", &id)
        .await;
    assert_eq!(one.topic, "ke/edged/meta/response/default/pod");
    assert_eq!(one.content(), json!([r#"{"n":"b"}"#]));
}

#[tokio::test]
async fn a_v1_sender_with_names_in_its_topics_still_works() {
    let (node, mut bus) = watched().await;
    // Exactly what a v1 module sent: the name in the topic and in the route.
    let key = "default/podstatus/web";
    let (id, payload) = envelope("edged", "update", key, json!({"phase": "Running"}));
    bus.publish("ke/meta/edged/update/default/podstatus/web", payload)
        .await;
    let [up, ok] = bus
        .expect_each_about([
            ("ke/cloud/edged/update", key),
            ("ke/edged/meta/response", key),
        ])
        .await;
    assert_eq!(up.topic, "ke/cloud/edged/update/default/podstatus");
    assert_eq!(up.msg_id(), id);
    assert_eq!(ok.topic, "ke/edged/meta/response/default/podstatus");
    assert_eq!(ok.parent_id().as_deref(), Some(id.as_str()));
    assert_eq!(ok.content(), json!("OK"));
    assert_eq!(
        node.stored(key).await.as_deref(),
        Some(r#"{"phase":"Running"}"#)
    );
    // And a v1 query by name.
    let (qid, query) = envelope("edged", "query", key, Value::Null);
    bus.publish("ke/meta/edged/query/default/podstatus/web", query)
        .await;
    let answer = bus
        .expect_reply_about("ke/edged/meta/response", key, &qid)
        .await;
    assert_eq!(answer.content(), json!([r#"{"phase":"Running"}"#]));
}

#[tokio::test]
async fn nothing_the_node_publishes_has_a_name_level() {
    let (_node, mut bus) = watched().await;
    let sent = [
        send(&bus, "edgecontroller", "insert", "default/pod/a", json!({})).await,
        send(
            &bus,
            "edgecontroller",
            "insert",
            "default/service/s",
            json!({}),
        )
        .await,
        send(&bus, "edged", "update", "default/podstatus/a", json!({})).await,
        send(&bus, "edged", "query", "default/pod/a", Value::Null).await,
        send(&bus, "funcmgr", "action", "default/function/f", json!({})).await,
    ];
    bus.publish("ke/meta/edged/frobnicate/default/pod/a", "{}")
        .await;
    bus.publish("ke/meta/edged/insert/a/b/c/d/e", "{}").await;
    let seen = bus.drain(std::time::Duration::from_secs(1)).await;
    let published: Vec<&Msg> = seen
        .iter()
        .filter(|m| !m.topic.starts_with("ke/meta/"))
        .collect();
    // Hand-ons to edged, edgemesh and edgefunction (3), the podstatus copy for the cloud (1),
    // replies to the five requests (5), and the two error replies (2).
    assert_eq!(published.len(), 11, "{published:#?}");
    for m in &published {
        assert_eq!(m.topic.split('/').count(), 6, "{}", m.topic);
        let type_level = m.topic.splitn(5, '/').nth(4).unwrap_or_default();
        assert!(
            m.resource().starts_with(type_level),
            "{} is about {}",
            m.topic,
            m.resource()
        );
    }
    for id in sent {
        assert!(
            published
                .iter()
                .any(|m| m.parent_id().as_deref() == Some(id.as_str())),
            "no reply to {id}"
        );
    }
    assert!(published
        .iter()
        .any(|m| m.topic == "ke/edged/meta/error/a/b" && m.resource() == "a/b/c/d/e"));
}
