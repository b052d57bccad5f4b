//! KubeEdge's MetaManager unit-test scenarios (reference §7) translated to MQTT: every row is
//! driven over a real broker connection against a real SQLite store.
//!
//! KubeEdge mocks the database to make it fail; here SQLite triggers make writes to keys under the
//! `fail` namespace abort, and a value stored as a BLOB makes reads of it fail. KubeEdge's
//! "content that cannot be marshalled" (a Go channel) becomes a payload that is not valid JSON.

mod common;

use common::{send, topic, unique_id, wait_until, Client, Msg, Node, Options, QUIET, WAIT};
use edgemeta_testkit::ModuleBus;
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

/// How a failed insert or update starts its error text.
const WRITE_FAILED: &str = "insert or update meta failed:";

/// SQL that stores one row, for [`seeded`]; `value` must not contain `'`.
fn meta_row(key: &str, kind: &str, value: &str) -> String {
    format!("INSERT INTO meta(key, type, value) VALUES ('{key}', '{kind}', '{value}');")
}

/// The topics under which `from` gets its `kind` ("response" or "error") replies, followed by
/// `<ns>/<type>`: the cloud's modules share `ke/cloud/`, an edge module has its own `ke/<module>/`.
fn reply_prefix(from: &str, kind: &str) -> String {
    let to = match from {
        "edgecontroller" | "funcmgr" => "cloud",
        module => module,
    };
    format!("ke/{to}/meta/{kind}")
}

/// A node plus a client that sees everything under `ke/`.
struct Scene {
    node: Node,
    bus: Client,
}

impl ModuleBus for Scene {
    type Received = Msg;

    async fn send_as(&mut self, from: &str, op: &str, resource: &str, content: Value) -> String {
        self.send(from, op, resource, content).await
    }

    async fn received(&mut self, prefix: &str, resource: &str) -> Msg {
        self.bus.expect_about(prefix, resource).await
    }

    fn msg_id_of(received: &Msg) -> String {
        received.msg_id()
    }
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

    /// A node already told that the cloud link is up, so queries may go on to the cloud.
    async fn connected(options: Options) -> Scene {
        let mut s = Scene::with(options).await;
        s.cloud("cloud_connected").await;
        s
    }

    async fn send(&self, from: &str, op: &str, resource: &str, content: Value) -> String {
        send(&self.bus, from, op, resource, content).await
    }

    /// Publishes `payload` as is on `ke/meta/<from>/<op>/<resource>`, name level included, as
    /// a v1 sender or a hand-made request does.
    async fn send_raw(&self, from: &str, op: &str, resource: &str, payload: &str) {
        self.bus
            .publish(&format!("ke/meta/{from}/{op}/{resource}"), payload)
            .await;
    }

    /// Tells the MetaManager the cloud link is up or down, as the bridge does.
    async fn cloud(&mut self, state: &str) {
        // The MetaManager logs `cloud connected` / `cloud disconnected` once it took the signal.
        let taken = state.replace('_', " ");
        let count = |log: String| {
            log.lines()
                .filter(|l| l.trim_end().ends_with(taken.as_str()))
                .count()
        };
        let before = count(self.node.log());
        self.send("edgehub", "connect", "node/connection", json!(state))
            .await;
        // Not waiting for the bus's own copy of the signal: the node's answers to it come from
        // another publisher (the node) and may arrive first, and would be skipped.
        // The signal and the next request travel on different topics; let it land first.
        wait_until(format_args!("{taken:?} logged"), WAIT, || {
            std::future::ready(count(self.node.log()) > before)
        })
        .await;
    }

    /// Publishes `source`'s answer to message `parent`, as the cloud or edged would; returns the
    /// answer's own id.
    async fn answer(
        &self,
        source: &str,
        op: &str,
        resource: &str,
        parent: &str,
        content: Value,
    ) -> String {
        let id = unique_id("answer");
        let payload = json!({
            "header": {"msg_id": id, "parent_msg_id": parent, "timestamp": 0},
            "route": {"source": source, "group": "resource", "operation": op, "resource": resource},
            "content": content,
        });
        self.bus
            .publish(
                &topic(&format!("ke/meta/{source}/{op}"), resource),
                payload.to_string(),
            )
            .await;
        id
    }

    /// The `kind` reply to request `id` that `from` sent about `resource`.
    async fn reply(&mut self, from: &str, kind: &str, resource: &str, id: &str) -> Msg {
        self.bus
            .expect_reply_about(&reply_prefix(from, kind), resource, id)
            .await
    }

    /// The error `from` got for request `id` about `resource`, as text.
    async fn error(&mut self, from: &str, resource: &str, id: &str) -> String {
        let reply = self.reply(from, "error", resource, id).await;
        assert_eq!(reply.operation(), "error");
        reply
            .content()
            .as_str()
            .unwrap_or_else(|| panic!("error content is a string: {:?}", reply.payload))
            .to_owned()
    }

    /// Asserts that `from` got "OK" for request `id` about `resource`.
    async fn ok(&mut self, from: &str, resource: &str, id: &str) {
        let reply = self.reply(from, "response", resource, id).await;
        assert_eq!(reply.content(), json!("OK"), "on {}", reply.topic);
    }

    /// Sends a request the MetaManager must refuse; returns the error text its sender got.
    async fn refused(&mut self, from: &str, op: &str, resource: &str, content: Value) -> String {
        let id = self.send(from, op, resource, content).await;
        self.error(from, resource, &id).await
    }

    /// Publishes a payload that is not JSON as `from`'s `op`; asserts that `from` is told so on
    /// its error topic (no request id can be read from it, so none is matched).
    async fn malformed_is_refused(&mut self, from: &str, op: &str, resource: &str) {
        const MALFORMED: &str = r#"{"header": {"msg_id": "m1"}, "content": "#;
        self.send_raw(from, op, resource, MALFORMED).await;
        let reply = self
            .bus
            .expect_about(&reply_prefix(from, "error"), resource)
            .await;
        let text = reply.content().as_str().unwrap_or_default().to_owned();
        assert!(text.starts_with("malformed JSON"), "{op}: {text}");
    }

    /// edged queries `resource` and is answered at once; returns the answer's content.
    async fn query(&mut self, resource: &str) -> Value {
        let id = self.send("edged", "query", resource, json!(null)).await;
        self.reply("edged", "response", resource, &id)
            .await
            .content()
    }

    /// edged queries `resource` and the query goes on to the cloud; returns edged's request id
    /// and the id of the query the cloud got.
    async fn query_sent_to_cloud(&mut self, resource: &str) -> (String, String) {
        let id = self.send("edged", "query", resource, json!(null)).await;
        let remote = self
            .bus
            .expect_about("ke/cloud/edged/query", resource)
            .await;
        (id, remote.msg_id())
    }

    /// Asserts that the store holds `value` under `key`.
    async fn assert_stored(&self, key: &str, value: &str) {
        assert_eq!(
            self.node.stored(key).await.as_deref(),
            Some(value),
            "stored under {key}"
        );
    }
}

// ---- insert -------------------------------------------------------------------------------

#[tokio::test]
async fn row01_02_a_failed_insert_is_an_error_to_the_requester_and_stores_nothing() {
    let mut s = Scene::with(Options::seeded(FAILING_WRITES)).await;
    for (from, resource) in [
        ("edgecontroller", "fail/podstatus/p"),
        ("edged", "fail/podstatus/secondRes"),
    ] {
        let text = s.refused(from, "insert", resource, json!({"a": 1})).await;
        assert!(text.starts_with(WRITE_FAILED), "{from}: {text}");
        assert!(text.contains("Failed DB Operation"), "{from}: {text}");
    }
    s.bus
        .expect_silence_about("ke/edged/edged/insert", "fail/podstatus/secondRes")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row03_05_12_28_31_content_that_is_not_json_is_refused_for_every_operation() {
    let mut s = Scene::start().await;
    for op in ["insert", "update", "response", "action", "action_result"] {
        s.malformed_is_refused("edged", op, "default/podstatus/p")
            .await;
    }
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row04_an_edged_insert_is_stored_handed_to_edged_and_acked() {
    let mut s = Scene::start().await;
    let key = "podstatus/secondRes/thirdRes";
    let (id, handed) = s
        .handed_on("edged", "insert", key, json!({"phase": "Running"}), "edged")
        .await;
    assert_eq!(handed.operation(), "insert");
    s.ok("edged", key, &id).await;
    s.assert_stored(key, r#"{"phase":"Running"}"#).await;
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
        s.ok("edgecontroller", "default/pod/web", &id).await;
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
    let (id, handed) = s
        .handed_on(
            "edgecontroller",
            "insert",
            "default/servicelist/service",
            list.clone(),
            "edgemesh",
        )
        .await;
    assert_eq!(handed.content(), list);
    s.ok("edgecontroller", "default/servicelist/service", &id)
        .await;
    let keys: Vec<String> = s.node.meta_rows().await.into_iter().map(|r| r.0).collect();
    assert_eq!(keys, ["default/service/a", "kube-system/service/b"]);
}

// ---- update -------------------------------------------------------------------------------

#[tokio::test]
async fn row06_13_a_failed_update_or_response_is_an_error_to_edged() {
    let mut s = Scene::with(Options::seeded(FAILING_WRITES)).await;
    for op in ["update", "response"] {
        let text = s
            .refused("edged", op, "fail/podstatus/p", json!({"phase": "x"}))
            .await;
        assert!(text.starts_with(WRITE_FAILED), "{op}: {text}");
    }
    s.bus
        .expect_silence_about("ke/cloud/edged/update", "fail/podstatus/p")
        .await;
}

#[tokio::test]
async fn row07_an_unchanged_podstatus_is_acked_and_not_forwarded() {
    // KubeEdge's row uses the 2-level "test/podstatus"; an update needs a name since v2.
    let key = "test/podstatus/p";
    let mut s = Scene::with(Options::seeded(&meta_row(key, "podstatus", "\"test\""))).await;
    let id = s.send("edged", "update", key, json!("test")).await;
    s.ok("edged", key, &id).await;
    s.bus
        .expect_silence_about("ke/cloud/edged/update", key)
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
        .expect_each_about([
            ("ke/cloud/edged/update", "default/podstatus/web"),
            ("ke/edged/meta/response", "default/podstatus/web"),
        ])
        .await;
    assert_eq!(up.msg_id(), id);
    assert_eq!(up.source(), "edged");
    assert_eq!(ok.parent_id().as_deref(), Some(id.as_str()));
    assert_eq!(ok.content(), json!("OK"));
    s.assert_stored("default/podstatus/web", r#"{"phase":"Running"}"#)
        .await;
}

#[tokio::test]
async fn row09_an_edgecontroller_update_goes_to_edged_and_the_cloud_gets_ok() {
    let mut s = Scene::start().await;
    let key = "default/podstatus/web";
    let (id, handed) = s
        .handed_on("edgecontroller", "update", key, json!({"v": 1}), "edged")
        .await;
    assert_eq!(handed.source(), "edgecontroller");
    s.ok("edgecontroller", key, &id).await;
}

#[tokio::test]
async fn row10_11_function_updates_go_to_edgefunction_and_back_to_the_cloud() {
    let mut s = Scene::start().await;
    let key = "default/function/f";
    s.handed_on(
        "funcmgr",
        "update",
        key,
        json!({"code": "x"}),
        "edgefunction",
    )
    .await;
    let (_, up) = s
        .handed_on("edgefunction", "update", key, json!({"code": "y"}), "cloud")
        .await;
    assert_eq!(up.source(), "edgefunction");
    s.assert_stored(key, r#"{"code":"y"}"#).await;
}

// ---- response -----------------------------------------------------------------------------

#[tokio::test]
async fn row14_15_responses_cross_between_edged_and_the_cloud() {
    let mut s = Scene::start().await;
    let key = "default/pod/web";
    s.handed_on("edged", "response", key, json!({"from": "edged"}), "cloud")
        .await;
    s.handed_on(
        "edgecontroller",
        "response",
        key,
        json!({"from": "cloud"}),
        "edged",
    )
    .await;
    s.assert_stored(key, r#"{"from":"cloud"}"#).await;
}

// ---- delete -------------------------------------------------------------------------------

#[tokio::test]
async fn row16_a_failed_delete_is_an_error_and_the_row_stays() {
    let mut s = Scene::with(Options::seeded(&format!(
        "{}{FAILING_WRITES}",
        meta_row("fail/podstatus/p", "podstatus", "{}")
    )))
    .await;
    let text = s
        .refused("edgecontroller", "delete", "fail/podstatus/p", json!(null))
        .await;
    assert!(text.starts_with("delete meta failed:"), "{text}");
    s.assert_stored("fail/podstatus/p", "{}").await;
}

#[tokio::test]
async fn row17_a_cloud_delete_removes_the_row_goes_to_edged_and_is_acked() {
    let key = "default/pod/web";
    let mut s = Scene::with(Options::seeded(&meta_row(key, "pod", "{}"))).await;
    let (id, handed) = s
        .handed_on(
            "edgecontroller",
            "delete",
            key,
            json!({"uid": "1"}),
            "edged",
        )
        .await;
    assert_eq!(handed.operation(), "delete");
    s.ok("edgecontroller", key, &id).await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn a_pod_deleted_by_edged_goes_to_the_cloud_only() {
    let key = "default/pod/web";
    let mut s = Scene::with(Options::seeded(&meta_row(key, "pod", "{}"))).await;
    s.handed_on("edged", "delete", key, json!(null), "cloud")
        .await;
    s.bus
        .expect_silence_about("ke/edged/edged/delete", "default/pod/web")
        .await;
    assert!(s.node.meta_rows().await.is_empty());
}

// ---- query --------------------------------------------------------------------------------

#[tokio::test]
async fn row18_19_20_connected_uncached_query_goes_to_the_cloud_and_its_answer_is_cached() {
    let mut s = Scene::connected(Options::default()).await;
    let key = "default/configmap/cm";
    let (id, remote_id) = s.query_sent_to_cloud(key).await;
    assert_ne!(remote_id, id, "the remote query carries a fresh id");

    let content = json!({"data": {"k": "v"}});
    let answer = s
        .answer("edgecontroller", "response", key, &remote_id, content)
        .await;
    let reply = s.reply("edged", "response", key, &id).await;
    assert_eq!(reply.content(), json!([r#"{"data":{"k":"v"}}"#]));
    s.ok("edgecontroller", key, &answer).await;
    s.assert_stored(key, r#"{"data":{"k":"v"}}"#).await;
}

#[tokio::test]
async fn row19_an_unparsable_cloud_answer_is_refused_and_the_query_times_out() {
    let mut s = Scene::connected(Options {
        remote_query_timeout_ms: 500,
        ..Options::default()
    })
    .await;
    let key = "default/secret/s";
    let (id, _) = s.query_sent_to_cloud(key).await;
    s.malformed_is_refused("edgecontroller", "response", key)
        .await;
    let text = s.error("edged", key, &id).await;
    assert!(text.contains("no answer from the cloud"), "{text}");
}

#[tokio::test]
async fn row20_the_answer_reaches_edged_even_when_caching_it_fails() {
    let mut s = Scene::connected(Options::seeded(FAILING_WRITES)).await;
    let key = "fail/configmap/cm";
    let (id, remote_id) = s.query_sent_to_cloud(key).await;
    let answer = s
        .answer(
            "edgecontroller",
            "response",
            key,
            &remote_id,
            json!("TestMessage"),
        )
        .await;
    let reply = s.reply("edged", "response", key, &id).await;
    assert_eq!(reply.content(), json!([r#""TestMessage""#]));
    s.ok("edgecontroller", key, &answer).await;
    assert!(s.node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn row21_a_cached_remote_type_is_answered_locally_while_connected() {
    let key = "test/configmap/cm";
    let mut s = Scene::connected(Options::seeded(&meta_row(key, "configmap", "\"Test\""))).await;
    assert_eq!(s.query(key).await, json!([r#""Test""#]));
    s.bus
        .expect_silence_about("ke/cloud/edged/query", "test/configmap/cm")
        .await;
}

#[tokio::test]
async fn row22_23_a_failing_read_is_an_error_to_the_requester() {
    // A BLOB where KubeEdge stores text cannot be read back as a document.
    let mut s = Scene::with(Options::seeded(
        "INSERT INTO meta(key, type, value) VALUES ('test/test/configmap', 'test', X'00FF');",
    ))
    .await;
    for (from, resource) in [
        ("edgecontroller", "test/test/configmap"),
        ("edged", "test/test"),
    ] {
        let text = s.refused(from, "query", resource, json!(null)).await;
        assert!(text.starts_with("query meta failed:"), "{from}: {text}");
    }
}

#[tokio::test]
async fn row24_queries_by_key_and_by_type_answer_from_the_store() {
    let mut s = Scene::with(Options::seeded(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/pod/a', 'pod', '{\"n\":\"a\"}'),
           ('default/pod/b', 'pod', '{\"n\":\"b\"}'),
           ('default/configmap/c', 'configmap', '{}');",
    ))
    .await;
    assert_eq!(s.query("default/pod/a").await, json!([r#"{"n":"a"}"#]));

    let mut pods: Vec<String> = serde_json::from_value(s.query("default/pod").await).unwrap();
    pods.sort();
    assert_eq!(pods, [r#"{"n":"a"}"#, r#"{"n":"b"}"#]);
}

#[tokio::test]
async fn row25_26_disconnected_queries_answer_locally_at_once() {
    let mut s = Scene::connected(Options::default()).await;
    s.cloud("cloud_disconnected").await;
    let started = Instant::now();
    assert_eq!(s.query("default/configmap/absent").await, json!([]));
    assert!(started.elapsed() < Duration::from_secs(2));
    s.bus
        .expect_silence_about("ke/cloud/edged/query", "default/configmap/absent")
        .await;
}

#[tokio::test]
async fn a_disconnect_answers_waiting_remote_queries_from_the_store() {
    let mut s = Scene::connected(Options {
        remote_query_timeout_ms: 60_000,
        ..Options::default()
    })
    .await;
    let key = "default/secret/s";
    let (id, _) = s.query_sent_to_cloud(key).await;
    s.cloud("cloud_disconnected").await;
    let reply = s.reply("edged", "response", key, &id).await;
    assert_eq!(reply.content(), json!([]));
}

#[tokio::test]
async fn a_silent_cloud_gets_the_stale_local_copy_of_an_always_remote_type() {
    let key = "default/node/edge1";
    let mut s = Scene::connected(Options {
        remote_query_timeout_ms: 300,
        ..Options::seeded(&meta_row(key, "node", r#"{"old":true}"#))
    })
    .await;
    let (id, _) = s.query_sent_to_cloud(key).await;
    let reply = s.reply("edged", "response", key, &id).await;
    assert_eq!(reply.content(), json!([r#"{"old":true}"#]));
}

#[tokio::test]
async fn a_cloud_error_answer_reaches_edged_and_is_acked() {
    let mut s = Scene::connected(Options::default()).await;
    let key = "default/secret/s";
    let (id, remote_id) = s.query_sent_to_cloud(key).await;
    let answer = s
        .answer(
            "edgecontroller",
            "error",
            key,
            &remote_id,
            json!("secret not found"),
        )
        .await;
    assert_eq!(s.error("edged", key, &id).await, "secret not found");
    s.ok("edgecontroller", key, &answer).await;
    assert!(s.node.meta_rows().await.is_empty());
}

// ---- meta-internal-sync -------------------------------------------------------------------

#[tokio::test]
async fn row27_t1_the_sync_timer_sends_pod_statuses_and_drops_orphans() {
    let mut s = Scene::with(Options {
        podstatus_sync_interval_s: 1,
        ..Options::seeded(
            "INSERT INTO meta(key, type, value) VALUES
               ('Test/pod/Test', 'pod', '{}'),
               ('Test/podstatus/Test', 'podstatus', '\"Test\"'),
               ('Test/podstatus/gone', 'podstatus', '\"Gone\"');",
        )
    })
    .await;
    let sync = s
        .bus
        .expect_about("ke/cloud/meta/update", "Test/podstatus")
        .await;
    assert_eq!(sync.content(), json!(["Test"]));
    assert_eq!(sync.source(), "meta");
    assert_eq!(s.node.stored("Test/podstatus/gone").await, None);
    assert!(s.node.stored("Test/podstatus/Test").await.is_some());
}

// ---- action / action_result ---------------------------------------------------------------

#[tokio::test]
async fn row28_33_actions_go_to_edgefunction_and_results_to_the_cloud() {
    let mut s = Scene::with(Options::seeded(FAILING_WRITES)).await;
    let key = "default/function/f";
    let (id, _) = s
        .handed_on(
            "edgecontroller",
            "action",
            key,
            json!({"run": 1}),
            "edgefunction",
        )
        .await;
    s.reply("edgecontroller", "response", key, &id).await;
    // The cloud's copy goes through the outbox, the sender's OK straight out: either comes first.
    let id = s
        .send("edgefunction", "action_result", key, json!({"out": 2}))
        .await;
    let [handed, ok] = s
        .bus
        .expect_each_about([
            ("ke/cloud/edgefunction/action_result", key),
            ("ke/edgefunction/meta/response", key),
        ])
        .await;
    assert_eq!((handed.msg_id(), ok.parent_id()), (id.clone(), Some(id)));
    s.assert_stored(key, r#"{"out":2}"#).await;

    for (from, op) in [
        ("edgecontroller", "action"),
        ("edgefunction", "action_result"),
    ] {
        let text = s.refused(from, op, "fail/function/f", json!({})).await;
        assert!(text.starts_with(WRITE_FAILED), "{op}: {text}");
    }
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
        let (id, _) = s
            .handed_on(
                "edgecontroller",
                op,
                &resource,
                json!({"volume_id": "v1"}),
                "edged",
            )
            .await;
        s.answer("edged", "response", &resource, &id, json!({"done": op}))
            .await;
        let reply = s.reply("edgecontroller", "response", &resource, &id).await;
        assert_eq!(reply.content(), json!({"done": op}), "{op}");
    }
}

#[tokio::test]
async fn a_volume_call_edged_does_not_answer_times_out_with_an_error() {
    let mut s = Scene::with(Options {
        volume_timeout_ms: 300,
        ..Options::default()
    })
    .await;
    let text = s
        .refused(
            "edgecontroller",
            "createvolume",
            "default/volume/v",
            json!({}),
        )
        .await;
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
        ..Options::seeded(&meta_row("default/pod/a", "pod", "{}"))
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
                        "ke/meta/edged/query/default/pod",
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
                assert_eq!(body["route"]["resource"], json!("default/pod/a"));
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
        .publish("ke/edged/edgecontroller/insert/default/pod", "{}")
        .await;
    s.bus
        .expect("ke/edged/edgecontroller/insert/default/pod")
        .await;
    let seen = s.bus.drain(QUIET).await;
    assert!(seen.iter().all(|m| !m.topic.contains("/meta/")), "{seen:?}");
}
