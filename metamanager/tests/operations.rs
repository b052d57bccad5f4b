//! Each operation against the MetaManager core with no broker: messages go in through the link's
//! inbox channel, everything published comes out of the link's publisher channel, and the store
//! is a real SQLite file in a temporary directory.

use std::time::Duration;

use edgemeta_broker::{Link, Message, Publisher};
use edgemeta_metamanager::{MetaConfig, MetaManager, Names, StoreConfig};
use edgemeta_testkit::ModuleBus;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(5);

struct Meta {
    inbox: mpsc::Sender<Message>,
    out: mpsc::Receiver<Message>,
    cancel: CancellationToken,
    meta: Option<MetaManager>,
    dir: tempfile::TempDir,
    /// Publications received but not yet expected: local replies and relayed outbox entries
    /// travel different paths, so only the order within one topic is guaranteed.
    held: Vec<(String, Value)>,
}

async fn start() -> Meta {
    start_with(MetaConfig {
        remote_query_timeout_ms: 300,
        volume_timeout_ms: 300,
        ..MetaConfig::default()
    })
    .await
}

async fn start_with(config: MetaConfig) -> Meta {
    let dir = tempfile::tempdir().unwrap();
    let store = StoreConfig {
        path: dir.path().join("meta.db"),
        ..StoreConfig::default()
    };
    let (inbox_tx, inbox) = mpsc::channel(64);
    let (publisher, out) = Publisher::channel(256);
    let cancel = CancellationToken::new();
    let link = Link { inbox, publisher };
    let meters = std::sync::Arc::new(edgemeta_metamanager::Meters::noop());
    let meta = MetaManager::start(
        &config,
        &store,
        Names {
            root: "ke",
            node: "edge-node",
        },
        link,
        true,
        meters,
        cancel.clone(),
    )
    .await
    .unwrap();
    Meta {
        inbox: inbox_tx,
        out,
        cancel,
        meta: Some(meta),
        dir,
        held: Vec::new(),
    }
}

impl ModuleBus for Meta {
    type Received = Value;

    async fn send_as(&mut self, from: &str, op: &str, resource: &str, content: Value) -> String {
        self.send(from, op, resource, content).await
    }

    async fn received(&mut self, prefix: &str, resource: &str) -> Value {
        self.expect(prefix, resource).await
    }

    fn msg_id_of(received: &Value) -> String {
        received["header"]["msg_id"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

impl Meta {
    async fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.inbox
            .send(Message::new(topic, payload.into()))
            .await
            .unwrap();
    }

    /// Sends a full envelope from `from` about `resource` on the type-level topic (the name in
    /// `route.resource` only, as v2 senders do); returns its id.
    async fn send(&self, from: &str, op: &str, resource: &str, content: Value) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let payload = json!({"header": {"msg_id": id}, "route": {"source": from, "resource": resource}, "content": content});
        self.publish(
            &format!("ke/meta/{from}/{op}/{}", type_level(resource)),
            payload.to_string(),
        )
        .await;
        id
    }

    async fn next(&mut self) -> (String, Value) {
        let m = tokio::time::timeout(WAIT, self.out.recv())
            .await
            .expect("a publication within the wait")
            .expect("metamanager alive");
        let json = serde_json::from_slice(&m.payload).expect("JSON payload");
        (m.topic, json)
    }

    /// The oldest publication about `resource` (its `route.resource`) on its type-level topic
    /// `<prefix>/<namespace>/<type>`: topics name the type, the envelope names the object.
    async fn expect(&mut self, prefix: &str, resource: &str) -> Value {
        let topic = format!("{prefix}/{}", type_level(resource));
        let about = |t: &str, json: &Value| t == topic && json["route"]["resource"] == resource;
        if let Some(i) = self.held.iter().position(|(t, json)| about(t, json)) {
            return self.held.remove(i).1;
        }
        loop {
            let (got, json) = self.next().await;
            if about(&got, &json) {
                return json;
            }
            self.held.push((got, json));
        }
    }

    /// Nothing else is published for a while.
    async fn expect_nothing(&mut self) {
        assert!(
            self.held.is_empty(),
            "unexpected publications: {:?}",
            self.held
        );
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), self.out.recv()).await
        {
            panic!("unexpected publication on {}: {:?}", m.topic, m.payload);
        }
    }

    /// Stops the MetaManager (everything accepted is committed) and reads the store file.
    async fn stored(&mut self, key: &str) -> Option<String> {
        if let Some(meta) = self.meta.take() {
            self.cancel.cancel();
            meta.stopped().await.expect("the metamanager stops cleanly");
        }
        let db = libsql::Builder::new_local(self.dir.path().join("meta.db"))
            .build()
            .await
            .unwrap();
        let conn = db.connect().unwrap();
        let mut rows = conn
            .query("SELECT value FROM meta WHERE key = ?1", [key])
            .await
            .unwrap();
        rows.next()
            .await
            .unwrap()
            .map(|r| r.get::<String>(0).unwrap())
    }

    /// Tells the MetaManager the cloud link is up or down, as the bridge does.
    async fn connection(&self, state: &str) {
        self.publish("ke/meta/edgehub/connect/node/connection", state)
            .await;
    }

    /// The oldest publication about `resource` under `prefix`, which must be a reply to
    /// request `id`.
    async fn expect_reply(&mut self, prefix: &str, resource: &str, id: &str) -> Value {
        let reply = self.expect(prefix, resource).await;
        assert_eq!(parent(&reply), id, "reply on {prefix} about {resource}");
        reply
    }

    /// edgecontroller inserts `content` under `resource`: edged is handed it and the cloud is
    /// answered "OK".
    async fn insert_from_the_cloud(&mut self, resource: &str, content: Value) {
        let (id, _) = self
            .handed_on("edgecontroller", "insert", resource, content, "edged")
            .await;
        let ack = self
            .expect_reply("ke/cloud/meta/response", resource, &id)
            .await;
        assert_eq!(ack["content"], json!("OK"));
    }

    /// edged reports a changed `content` for `resource`: the cloud is handed it and edged is
    /// answered.
    async fn update_from_edged(&mut self, resource: &str, content: Value) {
        let (id, _) = self
            .handed_on("edged", "update", resource, content, "cloud")
            .await;
        self.expect_reply("ke/edged/meta/response", resource, &id)
            .await;
    }

    /// edged queries `resource`; returns the content of the answer.
    async fn query(&mut self, resource: &str) -> Value {
        let id = self.send("edged", "query", resource, json!(null)).await;
        let answer = self
            .expect_reply("ke/edged/meta/response", resource, &id)
            .await;
        answer["content"].clone()
    }

    /// Stops the MetaManager and asserts what the store holds under `key`.
    async fn assert_stored(&mut self, key: &str, value: Option<&str>) {
        assert_eq!(
            self.stored(key).await.as_deref(),
            value,
            "stored under {key}"
        );
    }
}

/// `<namespace>/<type>` of a resource: all of it that v2 topics carry.
fn type_level(resource: &str) -> String {
    resource.split('/').take(2).collect::<Vec<_>>().join("/")
}

/// The request a reply answers.
fn parent(json: &Value) -> &str {
    json["header"]["parent_msg_id"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn insert_stores_forwards_to_edged_and_acks_the_cloud() {
    let mut m = start().await;
    m.insert_from_the_cloud("default/pod/p", json!({"a": 1}))
        .await;
    m.assert_stored("default/pod/p", Some(r#"{"a":1}"#)).await;
}

#[tokio::test]
async fn insert_of_an_existing_key_replaces_it() {
    let mut m = start().await;
    for value in [1, 2] {
        m.insert_from_the_cloud("default/configmap/c", json!(value))
            .await;
    }
    m.assert_stored("default/configmap/c", Some("2")).await;
}

#[tokio::test]
async fn update_from_edged_goes_to_the_cloud_and_is_acked_to_edged_unless_unchanged() {
    let mut m = start().await;
    let status = json!({"phase": "Running"});
    m.update_from_edged("default/podstatus/p", status.clone())
        .await;
    // Same status again: OK, nothing forwarded.
    let again = m
        .send("edged", "update", "default/podstatus/p", status)
        .await;
    m.expect_reply("ke/edged/meta/response", "default/podstatus/p", &again)
        .await;
    m.expect_nothing().await;
}

#[tokio::test]
async fn delete_removes_the_row_and_tells_edged() {
    let mut m = start().await;
    m.insert_from_the_cloud("default/secret/s", json!("x"))
        .await;
    let (id, _) = m
        .handed_on(
            "edgecontroller",
            "delete",
            "default/secret/s",
            json!(null),
            "edged",
        )
        .await;
    m.expect_reply("ke/cloud/meta/response", "default/secret/s", &id)
        .await;
    m.assert_stored("default/secret/s", None).await;
}

#[tokio::test]
async fn query_answers_from_the_store_as_an_array_of_strings() {
    let mut m = start().await;
    for name in ["a", "b"] {
        m.insert_from_the_cloud(&format!("ns/pod/{name}"), json!({ "n": name }))
            .await;
    }
    assert_eq!(
        m.query("ns/pod").await,
        json!([r#"{"n":"a"}"#, r#"{"n":"b"}"#])
    );
    assert_eq!(m.query("ns/pod/zzz").await, json!([]));
}

#[tokio::test]
async fn response_from_the_cloud_is_stored_and_handed_to_edged() {
    let mut m = start().await;
    let key = "default/configmap/r";
    m.handed_on("edgecontroller", "response", key, json!({"v": 1}), "edged")
        .await;
    m.assert_stored(key, Some(r#"{"v":1}"#)).await;
}

#[tokio::test]
async fn error_from_the_cloud_reaches_edged_and_stores_nothing() {
    let mut m = start().await;
    let (_, e) = m
        .handed_on(
            "edgecontroller",
            "error",
            "default/pod/e",
            json!("boom"),
            "edged",
        )
        .await;
    assert_eq!(e["content"], json!("boom"));
    m.assert_stored("default/pod/e", None).await;
}

#[tokio::test]
async fn connect_switches_remote_queries_on_and_off() {
    let mut m = start().await;
    m.connection("cloud_connected").await;
    let id = m
        .send("edged", "query", "default/secret/s", json!(null))
        .await;
    let remote = m.expect("ke/cloud/edged/query", "default/secret/s").await;
    assert_ne!(
        remote["header"]["msg_id"], id,
        "the remote query gets a fresh id"
    );
    m.connection("cloud_disconnected").await;
    let local = m
        .expect_reply("ke/edged/meta/response", "default/secret/s", &id)
        .await;
    assert_eq!(local["content"], json!([]));
}

#[tokio::test]
async fn a_connect_message_with_other_content_is_an_error() {
    let mut m = start().await;
    m.connection("maybe").await;
    let e = m.expect("ke/edgehub/meta/error", "node/connection").await;
    assert!(e["content"].as_str().unwrap().contains("cloud_connected"));
}

#[tokio::test]
async fn meta_internal_sync_reports_statuses_and_drops_orphans() {
    let mut m = start().await;
    m.insert_from_the_cloud("ns/pod/live", json!({})).await;
    for name in ["live", "gone"] {
        m.update_from_edged(&format!("ns/podstatus/{name}"), json!({ "Name": name }))
            .await;
    }
    m.send("edged", "meta-internal-sync", "ns/podstatus", json!(null))
        .await;
    let sync = m.expect("ke/cloud/meta/update", "ns/podstatus").await;
    assert_eq!(sync["content"], json!([{"Name": "live"}]));
    m.assert_stored("ns/podstatus/gone", None).await;
}

#[tokio::test]
async fn every_volume_operation_is_relayed_to_edged_and_its_answer_returned() {
    let mut m = start().await;
    for op in [
        "createvolume",
        "deletevolume",
        "controllerpublishvolume",
        "controllerunpublishvolume",
    ] {
        let (id, _) = m
            .handed_on(
                "edgecontroller",
                op,
                "default/volume/v1",
                json!({"size": 1}),
                "edged",
            )
            .await;
        // edged answers on the type-level topic; the parent id matches the call.
        let answer = json!({"header": {"msg_id": "e", "parent_msg_id": id}, "route": {}, "content": {"done": op}});
        m.publish("ke/meta/edged/response/default/volume", answer.to_string())
            .await;
        let reply = m
            .expect_reply("ke/cloud/meta/response", "default/volume/v1", &id)
            .await;
        assert_eq!(reply["content"], json!({"done": op}), "{op}");
    }
    // Volume answers are not metadata.
    m.assert_stored("default/volume/v1", None).await;
}

#[tokio::test]
async fn a_volume_call_edged_does_not_answer_fails_after_the_timeout() {
    let mut m = start().await;
    let (id, _) = m
        .handed_on(
            "edgecontroller",
            "createvolume",
            "default/volume/v2",
            json!({}),
            "edged",
        )
        .await;
    let e = m
        .expect_reply("ke/cloud/meta/error", "default/volume/v2", &id)
        .await;
    assert!(e["content"]
        .as_str()
        .unwrap()
        .contains("edged did not answer"));
}

#[tokio::test]
async fn accepted_messages_are_committed_when_stopped() {
    let mut m = start().await;
    for i in 0..50 {
        m.send(
            "edgecontroller",
            "insert",
            &format!("default/pod/p{i}"),
            json!(i),
        )
        .await;
    }
    m.assert_stored("default/pod/p49", Some("49")).await;
}
