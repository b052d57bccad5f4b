//! KubeEdge's MetaManager unit-test scenarios (reference §7) translated to MQTT: every row is
//! driven over a real broker connection against a real SQLite store.
//!
//! KubeEdge mocks the database to make it fail; here SQLite triggers make writes to keys under the
//! `fail` namespace abort, and a value stored as a BLOB makes reads of it fail. KubeEdge's
//! "content that cannot be marshalled" (a Go channel) becomes a payload that is not valid JSON.

mod common;

use common::{send, unique_id, Client, Node, Options, QUIET, WAIT};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Writes to `fail/...` keys abort, as KubeEdge's mocked `Failed DB Operation` did.
const FAILING_WRITES: &str = "
CREATE TRIGGER fail_insert BEFORE INSERT ON meta WHEN NEW.key LIKE 'fail/%'
  BEGIN SELECT RAISE(ABORT, 'Failed DB Operation'); END;
CREATE TRIGGER fail_update BEFORE UPDATE ON meta WHEN NEW.key LIKE 'fail/%'
  BEGIN SELECT RAISE(ABORT, 'Failed DB Operation'); END;
CREATE TRIGGER fail_delete BEFORE DELETE ON meta WHEN OLD.key LIKE 'fail/%'
  BEGIN SELECT RAISE(ABORT, 'Failed DB Operation'); END;";

/// A node plus a client that sees everything under `ke/`.
struct Scene {
    node: Node,
    bus: Client,
}

impl Scene {
    async fn start() -> Scene {
        Scene::with(Options::default()).await
    }

    async fn with(options: Options) -> Scene {
        let node = Node::start_with(options).await;
        let mut bus = node.client().await;
        bus.subscribe("ke/#").await;
        Scene { node, bus }
    }

    /// A node whose store already holds `sql` (run after KubeEdge's table is created).
    async fn seeded(sql: &str) -> Scene {
        Scene::with(Options {
            store_setup: Some(sql.to_owned()),
            ..Options::default()
        })
        .await
    }

    async fn send(&self, from: &str, op: &str, resource: &str, content: Value) -> String {
        send(&self.bus, from, op, resource, content).await
    }

    /// Publishes `payload` as is on `ke/meta/<from>/<op>/<resource>`.
    async fn send_raw(&self, from: &str, op: &str, resource: &str, payload: &str) {
        self.bus
            .publish(&format!("ke/meta/{from}/{op}/{resource}"), payload)
            .await;
    }

    /// Tells the MetaManager the cloud link is up or down, as the bridge does.
    async fn cloud(&mut self, state: &str) {
        self.send("edgehub", "connect", "node/connection", json!(state))
            .await;
        // The signal and the next request travel on different topics; let it land first.
        self.bus
            .expect("ke/meta/edgehub/connect/node/connection")
            .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    /// The error reply to `id` on `topic`, as text.
    async fn error(&mut self, topic: &str, id: &str) -> String {
        let reply = self.bus.expect_reply(topic, id).await;
        assert_eq!(reply.operation(), "error");
        reply
            .content()
            .as_str()
            .unwrap_or_else(|| panic!("error content is a string: {:?}", reply.payload))
            .to_owned()
    }

    async fn ok(&mut self, topic: &str, id: &str) {
        let reply = self.bus.expect_reply(topic, id).await;
        assert_eq!(reply.content(), json!("OK"), "on {topic}");
    }
}

/// A reply envelope to `parent`, as the cloud or edged would send it.
fn answer(source: &str, op: &str, resource: &str, parent: &str, content: Value) -> String {
    json!({
        "header": {"msg_id": unique_id("answer"), "parent_msg_id": parent, "timestamp": 0},
        "route": {"source": source, "group": "resource", "operation": op, "resource": resource},
        "content": content,
    })
    .to_string()
}

const MALFORMED: &str = r#"{"header": {"msg_id": "m1"}, "content": "#;

// ---- insert -------------------------------------------------------------------------------

#[tokio::test]
async fn row01_02_a_failed_insert_is_an_error_to_the_requester_and_stores_nothing() {
    let mut s = Scene::seeded(FAILING_WRITES).await;
    let id = s
        .send(
            "edgecontroller",
            "insert",
            "fail/podstatus/p",
            json!({"a": 1}),
        )
        .await;
    let text = s.error("ke/cloud/meta/error/fail/podstatus/p", &id).await;
    assert!(text.starts_with("insert or update meta failed:"), "{text}");
    assert!(text.contains("Failed DB Operation"), "{text}");

    let id = s
        .send(
            "edged",
            "insert",
            "fail/podstatus/secondRes",
            json!({"a": 1}),
        )
        .await;
    let text = s
        .error("ke/edged/meta/error/fail/podstatus/secondRes", &id)
        .await;
    assert!(text.starts_with("insert or update meta failed:"), "{text}");
    s.bus
        .expect_silence("ke/edged/edged/insert/fail/podstatus/secondRes")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row03_05_12_28_31_content_that_is_not_json_is_refused_for_every_operation() {
    let mut s = Scene::start().await;
    for op in ["insert", "update", "response", "action", "action_result"] {
        s.send_raw("edged", op, "default/podstatus/p", MALFORMED)
            .await;
        let reply = s
            .bus
            .expect("ke/edged/meta/error/default/podstatus/p")
            .await;
        let text = reply.content().as_str().unwrap_or_default().to_owned();
        assert!(text.starts_with("malformed JSON"), "{op}: {text}");
    }
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row04_an_edged_insert_is_stored_handed_to_edged_and_acked() {
    let mut s = Scene::start().await;
    let id = s
        .send(
            "edged",
            "insert",
            "podstatus/secondRes/thirdRes",
            json!({"phase": "Running"}),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edged/edged/insert/podstatus/secondRes/thirdRes")
        .await;
    assert_eq!(handed.msg_id(), id);
    assert_eq!(handed.operation(), "insert");
    s.ok("ke/edged/meta/response/podstatus/secondRes/thirdRes", &id)
        .await;
    assert_eq!(
        s.node
            .stored("podstatus/secondRes/thirdRes")
            .await
            .as_deref(),
        Some(r#"{"phase":"Running"}"#)
    );
}

#[tokio::test]
async fn inserting_an_existing_key_updates_it() {
    let mut s = Scene::start().await;
    for version in [1, 2] {
        let id = s
            .send(
                "edgecontroller",
                "insert",
                "default/pod/web",
                json!({"v": version}),
            )
            .await;
        s.ok("ke/cloud/meta/response/default/pod/web", &id).await;
    }
    assert_eq!(
        s.node.meta_rows().await,
        vec![(
            "default/pod/web".to_owned(),
            "pod".to_owned(),
            r#"{"v":2}"#.to_owned()
        )]
    );
}

#[tokio::test]
async fn a_servicelist_is_stored_item_by_item_and_handed_to_edgemesh() {
    let mut s = Scene::start().await;
    let list = json!([
        {"metadata": {"namespace": "default", "name": "a"}},
        {"metadata": {"namespace": "kube-system", "name": "b"}},
    ]);
    let id = s
        .send(
            "edgecontroller",
            "insert",
            "default/servicelist",
            list.clone(),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edgemesh/edgecontroller/insert/default/servicelist")
        .await;
    assert_eq!(handed.content(), list);
    s.ok("ke/cloud/meta/response/default/servicelist", &id)
        .await;
    let keys: Vec<String> = s.node.meta_rows().await.into_iter().map(|r| r.0).collect();
    assert_eq!(keys, ["default/service/a", "kube-system/service/b"]);
}

// ---- update -------------------------------------------------------------------------------

#[tokio::test]
async fn row06_13_a_failed_update_or_response_is_an_error_to_edged() {
    let mut s = Scene::seeded(FAILING_WRITES).await;
    for op in ["update", "response"] {
        let id = s
            .send("edged", op, "fail/podstatus/p", json!({"phase": "x"}))
            .await;
        let text = s.error("ke/edged/meta/error/fail/podstatus/p", &id).await;
        assert!(
            text.starts_with("insert or update meta failed:"),
            "{op}: {text}"
        );
    }
    s.bus
        .expect_silence("ke/cloud/edged/update/fail/podstatus/p")
        .await;
}

#[tokio::test]
async fn row07_an_unchanged_podstatus_is_acked_and_not_forwarded() {
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('test/podstatus', 'podstatus', '\"test\"');",
    )
    .await;
    let id = s
        .send("edged", "update", "test/podstatus", json!("test"))
        .await;
    s.ok("ke/edged/meta/response/test/podstatus", &id).await;
    s.bus
        .expect_silence("ke/cloud/edged/update/test/podstatus")
        .await;
}

#[tokio::test]
async fn row08_an_edged_update_goes_to_the_cloud_and_edged_gets_ok() {
    let mut s = Scene::start().await;
    let id = s
        .send(
            "edged",
            "update",
            "default/podstatus/web",
            json!({"phase": "Running"}),
        )
        .await;
    // The OK is published at commit, the cloud copy by the relay after it: any order.
    let [up, ok] = s
        .bus
        .expect_each([
            "ke/cloud/edged/update/default/podstatus/web",
            "ke/edged/meta/response/default/podstatus/web",
        ])
        .await;
    assert_eq!(up.msg_id(), id);
    assert_eq!(up.source(), "edged");
    assert_eq!(ok.parent_id().as_deref(), Some(id.as_str()));
    assert_eq!(ok.content(), json!("OK"));
    assert_eq!(
        s.node.stored("default/podstatus/web").await.as_deref(),
        Some(r#"{"phase":"Running"}"#)
    );
}

#[tokio::test]
async fn row09_an_edgecontroller_update_goes_to_edged_and_the_cloud_gets_ok() {
    let mut s = Scene::start().await;
    let id = s
        .send(
            "edgecontroller",
            "update",
            "default/podstatus/web",
            json!({"v": 1}),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edged/edgecontroller/update/default/podstatus/web")
        .await;
    assert_eq!(handed.source(), "edgecontroller");
    s.ok("ke/cloud/meta/response/default/podstatus/web", &id)
        .await;
}

#[tokio::test]
async fn row10_11_function_updates_go_to_edgefunction_and_back_to_the_cloud() {
    let mut s = Scene::start().await;
    let id = s
        .send(
            "funcmgr",
            "update",
            "default/function/f",
            json!({"code": "x"}),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edgefunction/funcmgr/update/default/function/f")
        .await;
    assert_eq!(handed.msg_id(), id);

    let id = s
        .send(
            "edgefunction",
            "update",
            "default/function/f",
            json!({"code": "y"}),
        )
        .await;
    let up = s
        .bus
        .expect("ke/cloud/edgefunction/update/default/function/f")
        .await;
    assert_eq!(up.msg_id(), id);
    assert_eq!(up.source(), "edgefunction");
    assert_eq!(
        s.node.stored("default/function/f").await.as_deref(),
        Some(r#"{"code":"y"}"#)
    );
}

// ---- response -----------------------------------------------------------------------------

#[tokio::test]
async fn row14_15_responses_cross_between_edged_and_the_cloud() {
    let mut s = Scene::start().await;
    let id = s
        .send(
            "edged",
            "response",
            "default/pod/web",
            json!({"from": "edged"}),
        )
        .await;
    let up = s
        .bus
        .expect("ke/cloud/edged/response/default/pod/web")
        .await;
    assert_eq!(up.msg_id(), id);

    let id = s
        .send(
            "edgecontroller",
            "response",
            "default/pod/web",
            json!({"from": "cloud"}),
        )
        .await;
    let down = s
        .bus
        .expect("ke/edged/edgecontroller/response/default/pod/web")
        .await;
    assert_eq!(down.msg_id(), id);
    assert_eq!(
        s.node.stored("default/pod/web").await.as_deref(),
        Some(r#"{"from":"cloud"}"#)
    );
}

// ---- delete -------------------------------------------------------------------------------

#[tokio::test]
async fn row16_a_failed_delete_is_an_error_and_the_row_stays() {
    let mut s = Scene::seeded(&format!(
        "INSERT INTO meta(key, type, value) VALUES ('fail/podstatus/p', 'podstatus', '{{}}');{FAILING_WRITES}"
    ))
    .await;
    let id = s
        .send("edgecontroller", "delete", "fail/podstatus/p", json!(null))
        .await;
    let text = s.error("ke/cloud/meta/error/fail/podstatus/p", &id).await;
    assert!(text.starts_with("delete meta failed:"), "{text}");
    assert_eq!(
        s.node.stored("fail/podstatus/p").await.as_deref(),
        Some("{}")
    );
}

#[tokio::test]
async fn row17_a_cloud_delete_removes_the_row_goes_to_edged_and_is_acked() {
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('default/pod/web', 'pod', '{}');",
    )
    .await;
    let id = s
        .send(
            "edgecontroller",
            "delete",
            "default/pod/web",
            json!({"uid": "1"}),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edged/edgecontroller/delete/default/pod/web")
        .await;
    assert_eq!(handed.operation(), "delete");
    s.ok("ke/cloud/meta/response/default/pod/web", &id).await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn a_pod_deleted_by_edged_goes_to_the_cloud_only() {
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('default/pod/web', 'pod', '{}');",
    )
    .await;
    let id = s
        .send("edged", "delete", "default/pod/web", json!(null))
        .await;
    let up = s.bus.expect("ke/cloud/edged/delete/default/pod/web").await;
    assert_eq!(up.msg_id(), id);
    s.bus
        .expect_silence("ke/edged/edged/delete/default/pod/web")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

// ---- query --------------------------------------------------------------------------------

#[tokio::test]
async fn row18_19_20_connected_uncached_query_goes_to_the_cloud_and_its_answer_is_cached() {
    let mut s = Scene::start().await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "default/configmap/cm", json!(null))
        .await;
    let remote = s
        .bus
        .expect("ke/cloud/edged/query/default/configmap/cm")
        .await;
    let remote_id = remote.msg_id();
    assert_ne!(remote_id, id, "the remote query carries a fresh id");

    let payload = answer(
        "edgecontroller",
        "response",
        "default/configmap/cm",
        &remote_id,
        json!({"data": {"k": "v"}}),
    );
    s.send_raw(
        "edgecontroller",
        "response",
        "default/configmap/cm",
        &payload,
    )
    .await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/configmap/cm", &id)
        .await;
    assert_eq!(reply.content(), json!([r#"{"data":{"k":"v"}}"#]));
    let ack = s
        .bus
        .expect("ke/cloud/meta/response/default/configmap/cm")
        .await;
    assert_eq!(ack.content(), json!("OK"));
    assert_eq!(
        s.node.stored("default/configmap/cm").await.as_deref(),
        Some(r#"{"data":{"k":"v"}}"#)
    );
}

#[tokio::test]
async fn row19_an_unparsable_cloud_answer_is_refused_and_the_query_times_out() {
    let mut s = Scene::with(Options {
        remote_query_timeout_ms: 500,
        ..Options::default()
    })
    .await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "default/secret/s", json!(null))
        .await;
    s.bus.expect("ke/cloud/edged/query/default/secret/s").await;
    s.send_raw("edgecontroller", "response", "default/secret/s", MALFORMED)
        .await;
    let refused = s.bus.expect("ke/cloud/meta/error/default/secret/s").await;
    assert!(refused
        .content()
        .as_str()
        .unwrap_or_default()
        .starts_with("malformed JSON"));
    let text = s.error("ke/edged/meta/error/default/secret/s", &id).await;
    assert!(text.contains("no answer from the cloud"), "{text}");
}

#[tokio::test]
async fn row20_the_answer_reaches_edged_even_when_caching_it_fails() {
    let mut s = Scene::seeded(FAILING_WRITES).await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "fail/configmap/cm", json!(null))
        .await;
    let remote = s.bus.expect("ke/cloud/edged/query/fail/configmap/cm").await;
    let payload = answer(
        "edgecontroller",
        "response",
        "fail/configmap/cm",
        &remote.msg_id(),
        json!("TestMessage"),
    );
    s.send_raw("edgecontroller", "response", "fail/configmap/cm", &payload)
        .await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/fail/configmap/cm", &id)
        .await;
    assert_eq!(reply.content(), json!([r#""TestMessage""#]));
    s.bus
        .expect("ke/cloud/meta/response/fail/configmap/cm")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row21_a_cached_remote_type_is_answered_locally_while_connected() {
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('test/configmap/cm', 'configmap', '\"Test\"');",
    )
    .await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "test/configmap/cm", json!(null))
        .await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/test/configmap/cm", &id)
        .await;
    assert_eq!(reply.content(), json!([r#""Test""#]));
    s.bus
        .expect_silence("ke/cloud/edged/query/test/configmap/cm")
        .await;
}

#[tokio::test]
async fn row22_23_a_failing_read_is_an_error_to_the_requester() {
    // A BLOB where KubeEdge stores text cannot be read back as a document.
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('test/test/configmap', 'test', X'00FF');",
    )
    .await;
    let id = s
        .send(
            "edgecontroller",
            "query",
            "test/test/configmap",
            json!(null),
        )
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    eprintln!("LOG {}", s.node.log());
    let text = s
        .error("ke/cloud/meta/error/test/test/configmap", &id)
        .await;
    assert!(text.starts_with("query meta failed:"), "{text}");
    let id = s.send("edged", "query", "test/test", json!(null)).await;
    let text = s.error("ke/edged/meta/error/test/test", &id).await;
    assert!(text.starts_with("query meta failed:"), "{text}");
}

#[tokio::test]
async fn row24_queries_by_key_and_by_type_answer_from_the_store() {
    let mut s = Scene::seeded(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/pod/a', 'pod', '{\"n\":\"a\"}'),
           ('default/pod/b', 'pod', '{\"n\":\"b\"}'),
           ('default/configmap/c', 'configmap', '{}');",
    )
    .await;
    let id = s.send("edged", "query", "default/pod/a", json!(null)).await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/pod/a", &id)
        .await;
    assert_eq!(reply.content(), json!([r#"{"n":"a"}"#]));

    let id = s.send("edged", "query", "default/pod", json!(null)).await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/pod", &id)
        .await;
    let mut pods: Vec<String> = serde_json::from_value(reply.content()).unwrap();
    pods.sort();
    assert_eq!(pods, [r#"{"n":"a"}"#, r#"{"n":"b"}"#]);
}

#[tokio::test]
async fn row25_26_disconnected_queries_answer_locally_at_once() {
    let mut s = Scene::start().await;
    s.cloud("cloud_connected").await;
    s.cloud("cloud_disconnected").await;
    let started = Instant::now();
    let id = s
        .send("edged", "query", "default/configmap/absent", json!(null))
        .await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/configmap/absent", &id)
        .await;
    assert_eq!(reply.content(), json!([]));
    assert!(started.elapsed() < Duration::from_secs(2));
    s.bus
        .expect_silence("ke/cloud/edged/query/default/configmap/absent")
        .await;
}

#[tokio::test]
async fn a_disconnect_answers_waiting_remote_queries_from_the_store() {
    let mut s = Scene::with(Options {
        remote_query_timeout_ms: 60_000,
        ..Options::default()
    })
    .await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "default/secret/s", json!(null))
        .await;
    s.bus.expect("ke/cloud/edged/query/default/secret/s").await;
    s.cloud("cloud_disconnected").await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/secret/s", &id)
        .await;
    assert_eq!(reply.content(), json!([]));
}

#[tokio::test]
async fn a_silent_cloud_gets_the_stale_local_copy_of_an_always_remote_type() {
    let mut s = Scene::with(Options {
        remote_query_timeout_ms: 300,
        store_setup: Some(
            "INSERT INTO meta(key, type, value) VALUES ('default/node/edge1', 'node', '{\"old\":true}');"
                .to_owned(),
        ),
        ..Options::default()
    })
    .await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "default/node/edge1", json!(null))
        .await;
    s.bus
        .expect("ke/cloud/edged/query/default/node/edge1")
        .await;
    let reply = s
        .bus
        .expect_reply("ke/edged/meta/response/default/node/edge1", &id)
        .await;
    assert_eq!(reply.content(), json!([r#"{"old":true}"#]));
}

#[tokio::test]
async fn a_cloud_error_answer_reaches_edged_and_is_acked() {
    let mut s = Scene::start().await;
    s.cloud("cloud_connected").await;
    let id = s
        .send("edged", "query", "default/secret/s", json!(null))
        .await;
    let remote = s.bus.expect("ke/cloud/edged/query/default/secret/s").await;
    let payload = answer(
        "edgecontroller",
        "error",
        "default/secret/s",
        &remote.msg_id(),
        json!("secret not found"),
    );
    s.send_raw("edgecontroller", "error", "default/secret/s", &payload)
        .await;
    let text = s.error("ke/edged/meta/error/default/secret/s", &id).await;
    assert_eq!(text, "secret not found");
    s.bus
        .expect("ke/cloud/meta/response/default/secret/s")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

// ---- meta-internal-sync -------------------------------------------------------------------

#[tokio::test]
async fn row27_t1_the_sync_timer_sends_pod_statuses_and_drops_orphans() {
    let mut s = Scene::with(Options {
        podstatus_sync_interval_s: 1,
        store_setup: Some(
            "INSERT INTO meta(key, type, value) VALUES
               ('Test/pod/Test', 'pod', '{}'),
               ('Test/podstatus/Test', 'podstatus', '\"Test\"'),
               ('Test/podstatus/gone', 'podstatus', '\"Gone\"');"
                .to_owned(),
        ),
        ..Options::default()
    })
    .await;
    let sync = s.bus.expect("ke/cloud/meta/update/Test/podstatus").await;
    assert_eq!(sync.content(), json!(["Test"]));
    assert_eq!(sync.source(), "meta");
    assert_eq!(s.node.stored("Test/podstatus/gone").await, None);
    assert!(s.node.stored("Test/podstatus/Test").await.is_some());
}

// ---- action / action_result ---------------------------------------------------------------

#[tokio::test]
async fn row28_33_actions_go_to_edgefunction_and_results_to_the_cloud() {
    let mut s = Scene::seeded(FAILING_WRITES).await;
    let id = s
        .send(
            "edgecontroller",
            "action",
            "default/function/f",
            json!({"run": 1}),
        )
        .await;
    let handed = s
        .bus
        .expect("ke/edgefunction/edgecontroller/action/default/function/f")
        .await;
    assert_eq!(handed.msg_id(), id);

    let id = s
        .send(
            "edgefunction",
            "action_result",
            "default/function/f",
            json!({"out": 2}),
        )
        .await;
    let up = s
        .bus
        .expect("ke/cloud/edgefunction/action_result/default/function/f")
        .await;
    assert_eq!(up.msg_id(), id);
    assert_eq!(
        s.node.stored("default/function/f").await.as_deref(),
        Some(r#"{"out":2}"#)
    );

    let id = s
        .send("edgecontroller", "action", "fail/function/f", json!({}))
        .await;
    let text = s.error("ke/cloud/meta/error/fail/function/f", &id).await;
    assert!(text.starts_with("insert or update meta failed:"), "{text}");
    let id = s
        .send(
            "edgefunction",
            "action_result",
            "fail/function/f",
            json!({}),
        )
        .await;
    let text = s
        .error("ke/edgefunction/meta/error/fail/function/f", &id)
        .await;
    assert!(text.starts_with("insert or update meta failed:"), "{text}");
}

// ---- CSI volumes --------------------------------------------------------------------------

#[tokio::test]
async fn a_volume_call_is_relayed_to_edged_and_its_answer_returned_to_the_cloud() {
    let mut s = Scene::start().await;
    for op in [
        "createvolume",
        "deletevolume",
        "controllerpublishvolume",
        "controllerunpublishvolume",
    ] {
        let resource = format!("default/volume/{op}");
        let id = s
            .send("edgecontroller", op, &resource, json!({"volume_id": "v1"}))
            .await;
        let relayed = s
            .bus
            .expect(&format!("ke/edged/edgecontroller/{op}/{resource}"))
            .await;
        assert_eq!(relayed.msg_id(), id);
        let payload = answer("edged", "response", &resource, &id, json!({"done": op}));
        s.send_raw("edged", "response", &resource, &payload).await;
        let reply = s
            .bus
            .expect_reply(&format!("ke/cloud/meta/response/{resource}"), &id)
            .await;
        assert_eq!(reply.content(), json!({"done": op}));
    }
}

#[tokio::test]
async fn a_volume_call_edged_does_not_answer_times_out_with_an_error() {
    let mut s = Scene::with(Options {
        volume_timeout_ms: 300,
        ..Options::default()
    })
    .await;
    let id = s
        .send(
            "edgecontroller",
            "createvolume",
            "default/volume/v",
            json!({}),
        )
        .await;
    let text = s.error("ke/cloud/meta/error/default/volume/v", &id).await;
    assert!(text.contains("edged did not answer createvolume"), "{text}");
}

// ---- MQTT v5 ------------------------------------------------------------------------------

#[tokio::test]
async fn a_v5_requester_gets_the_reply_on_its_response_topic_with_its_correlation_data() {
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, MqttOptions};

    let node = Node::start_with(Options {
        v5: true,
        store_setup: Some(
            "INSERT INTO meta(key, type, value) VALUES ('default/pod/a', 'pod', '{}');".to_owned(),
        ),
        ..Options::default()
    })
    .await;
    let port = node.v5_port.expect("v5 listener");
    let (client, mut events) =
        AsyncClient::new(MqttOptions::new(unique_id("v5"), "127.0.0.1", port), 100);
    let reply_to = format!("replies/{}", unique_id("me"));
    client
        .subscribe(&reply_to, QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    let (id, payload) = common::envelope("edged", "query", "default/pod/a", json!(null));
    let properties = PublishProperties {
        response_topic: Some(reply_to.clone()),
        correlation_data: Some(bytes::Bytes::from_static(b"corr-42")),
        ..PublishProperties::default()
    };
    let mut published = false;
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = tokio::time::timeout(left, events.poll())
            .await
            .expect("the reply within the wait")
            .expect("v5 connection");
        match event {
            Event::Incoming(Packet::SubAck(_)) if !published => {
                client
                    .publish_with_properties(
                        "ke/meta/edged/query/default/pod/a",
                        QoS::AtLeastOnce,
                        false,
                        payload.clone(),
                        properties.clone(),
                    )
                    .await
                    .expect("publish");
                published = true;
            }
            Event::Incoming(Packet::Publish(p)) if p.topic == reply_to.as_bytes() => {
                let body: Value = serde_json::from_slice(&p.payload).expect("JSON reply");
                assert_eq!(body["header"]["parent_msg_id"], json!(id));
                assert_eq!(body["content"], json!(["{}"]));
                let correlation = p.properties.and_then(|p| p.correlation_data);
                assert_eq!(correlation.as_deref(), Some(&b"corr-42"[..]));
                return;
            }
            _ => {}
        }
    }
}

/// Guards against a harness that hears nothing: a request on a topic nobody handles stays quiet.
#[tokio::test]
async fn messages_for_other_modules_are_not_answered_by_the_metamanager() {
    let mut s = Scene::start().await;
    s.bus
        .publish("ke/edged/edgecontroller/insert/default/pod/x", "{}")
        .await;
    s.bus
        .expect("ke/edged/edgecontroller/insert/default/pod/x")
        .await;
    let seen = s.bus.drain(QUIET).await;
    assert!(seen.iter().all(|m| !m.topic.contains("/meta/")), "{seen:?}");
}
