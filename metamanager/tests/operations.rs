//! Each operation against the MetaManager core with no broker: messages go in through the link's
//! inbox channel, everything published comes out of the link's publisher channel, and the store
//! is a real SQLite file in a temporary directory.

use std::time::Duration;

use edgemeta_broker::{Link, Message, Publisher};
use edgemeta_metamanager::{MetaConfig, MetaManager, StoreConfig};
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
    let meta = MetaManager::start(&config, &store, "ke", link, true, cancel.clone())
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

impl Meta {
    async fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.inbox
            .send(Message::new(topic, payload.into()))
            .await
            .unwrap();
    }

    /// Sends a full envelope from `from`; returns its id.
    async fn send(&self, from: &str, op: &str, resource: &str, content: Value) -> String {
        let id = uuid::Uuid::new_v4().to_string();
        let payload =
            json!({"header": {"msg_id": id}, "route": {"source": from}, "content": content});
        self.publish(
            &format!("ke/meta/{from}/{op}/{resource}"),
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

    /// The oldest publication on `topic`.
    async fn expect(&mut self, topic: &str) -> Value {
        if let Some(i) = self.held.iter().position(|(t, _)| t == topic) {
            return self.held.remove(i).1;
        }
        loop {
            let (got, json) = self.next().await;
            if got == topic {
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
            meta.stopped().await;
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
}

fn parent(json: &Value) -> &str {
    json["header"]["parent_msg_id"].as_str().unwrap_or_default()
}

#[tokio::test]
async fn insert_stores_forwards_to_edged_and_acks_the_cloud() {
    let mut m = start().await;
    let id = m
        .send("edgecontroller", "insert", "default/pod/p", json!({"a": 1}))
        .await;
    let fwd = m
        .expect("ke/edged/edgecontroller/insert/default/pod/p")
        .await;
    assert_eq!(fwd["header"]["msg_id"], id);
    let ack = m.expect("ke/cloud/meta/response/default/pod/p").await;
    assert_eq!((parent(&ack), &ack["content"]), (id.as_str(), &json!("OK")));
    assert_eq!(
        m.stored("default/pod/p").await.as_deref(),
        Some(r#"{"a":1}"#)
    );
}

#[tokio::test]
async fn insert_of_an_existing_key_replaces_it() {
    let mut m = start().await;
    m.send("edgecontroller", "insert", "default/configmap/c", json!(1))
        .await;
    m.expect("ke/edged/edgecontroller/insert/default/configmap/c")
        .await;
    m.expect("ke/cloud/meta/response/default/configmap/c").await;
    m.send("edgecontroller", "insert", "default/configmap/c", json!(2))
        .await;
    m.expect("ke/edged/edgecontroller/insert/default/configmap/c")
        .await;
    m.expect("ke/cloud/meta/response/default/configmap/c").await;
    assert_eq!(m.stored("default/configmap/c").await.as_deref(), Some("2"));
}

#[tokio::test]
async fn update_from_edged_goes_to_the_cloud_and_is_acked_to_edged_unless_unchanged() {
    let mut m = start().await;
    let id = m
        .send(
            "edged",
            "update",
            "default/podstatus/p",
            json!({"phase": "Running"}),
        )
        .await;
    let up = m.expect("ke/cloud/edged/update/default/podstatus/p").await;
    assert_eq!(up["header"]["msg_id"], id);
    let ok = m.expect("ke/edged/meta/response/default/podstatus/p").await;
    assert_eq!(parent(&ok), id);
    // Same status again: OK, nothing forwarded.
    let again = m
        .send(
            "edged",
            "update",
            "default/podstatus/p",
            json!({"phase": "Running"}),
        )
        .await;
    let ok = m.expect("ke/edged/meta/response/default/podstatus/p").await;
    assert_eq!(parent(&ok), again);
    m.expect_nothing().await;
}

#[tokio::test]
async fn delete_removes_the_row_and_tells_edged() {
    let mut m = start().await;
    m.send("edgecontroller", "insert", "default/secret/s", json!("x"))
        .await;
    m.expect("ke/edged/edgecontroller/insert/default/secret/s")
        .await;
    m.expect("ke/cloud/meta/response/default/secret/s").await;
    let id = m
        .send("edgecontroller", "delete", "default/secret/s", json!(null))
        .await;
    m.expect("ke/edged/edgecontroller/delete/default/secret/s")
        .await;
    let ack = m.expect("ke/cloud/meta/response/default/secret/s").await;
    assert_eq!(parent(&ack), id);
    assert_eq!(m.stored("default/secret/s").await, None);
}

#[tokio::test]
async fn query_answers_from_the_store_as_an_array_of_strings() {
    let mut m = start().await;
    for name in ["a", "b"] {
        m.send(
            "edgecontroller",
            "insert",
            &format!("ns/pod/{name}"),
            json!({ "n": name }),
        )
        .await;
        m.expect(&format!("ke/edged/edgecontroller/insert/ns/pod/{name}"))
            .await;
        m.expect(&format!("ke/cloud/meta/response/ns/pod/{name}"))
            .await;
    }
    let id = m.send("edged", "query", "ns/pod", json!(null)).await;
    let answer = m.expect("ke/edged/meta/response/ns/pod").await;
    assert_eq!(parent(&answer), id);
    assert_eq!(answer["content"], json!([r#"{"n":"a"}"#, r#"{"n":"b"}"#]));
    m.send("edged", "query", "ns/pod/zzz", json!(null)).await;
    assert_eq!(
        m.expect("ke/edged/meta/response/ns/pod/zzz").await["content"],
        json!([])
    );
}

#[tokio::test]
async fn response_from_the_cloud_is_stored_and_handed_to_edged() {
    let mut m = start().await;
    m.send(
        "edgecontroller",
        "response",
        "default/configmap/r",
        json!({"v": 1}),
    )
    .await;
    m.expect("ke/edged/edgecontroller/response/default/configmap/r")
        .await;
    assert_eq!(
        m.stored("default/configmap/r").await.as_deref(),
        Some(r#"{"v":1}"#)
    );
}

#[tokio::test]
async fn error_from_the_cloud_reaches_edged_and_stores_nothing() {
    let mut m = start().await;
    m.send("edgecontroller", "error", "default/pod/e", json!("boom"))
        .await;
    let e = m
        .expect("ke/edged/edgecontroller/error/default/pod/e")
        .await;
    assert_eq!(e["content"], json!("boom"));
    assert_eq!(m.stored("default/pod/e").await, None);
}

#[tokio::test]
async fn connect_switches_remote_queries_on_and_off() {
    let mut m = start().await;
    m.publish("ke/meta/edgehub/connect/node/connection", "cloud_connected")
        .await;
    let id = m
        .send("edged", "query", "default/secret/s", json!(null))
        .await;
    let remote = m.expect("ke/cloud/edged/query/default/secret/s").await;
    assert_ne!(
        remote["header"]["msg_id"], id,
        "the remote query gets a fresh id"
    );
    m.publish(
        "ke/meta/edgehub/connect/node/connection",
        "cloud_disconnected",
    )
    .await;
    let local = m.expect("ke/edged/meta/response/default/secret/s").await;
    assert_eq!(
        (parent(&local), &local["content"]),
        (id.as_str(), &json!([]))
    );
}

#[tokio::test]
async fn a_connect_message_with_other_content_is_an_error() {
    let mut m = start().await;
    m.publish("ke/meta/edgehub/connect/node/connection", "maybe")
        .await;
    let e = m.expect("ke/edgehub/meta/error/node/connection").await;
    assert!(e["content"].as_str().unwrap().contains("cloud_connected"));
}

#[tokio::test]
async fn meta_internal_sync_reports_statuses_and_drops_orphans() {
    let mut m = start().await;
    m.send("edgecontroller", "insert", "ns/pod/live", json!({}))
        .await;
    m.expect("ke/edged/edgecontroller/insert/ns/pod/live").await;
    m.expect("ke/cloud/meta/response/ns/pod/live").await;
    for name in ["live", "gone"] {
        m.send(
            "edged",
            "update",
            &format!("ns/podstatus/{name}"),
            json!({ "Name": name }),
        )
        .await;
        m.expect(&format!("ke/cloud/edged/update/ns/podstatus/{name}"))
            .await;
        m.expect(&format!("ke/edged/meta/response/ns/podstatus/{name}"))
            .await;
    }
    m.send("edged", "meta-internal-sync", "ns/podstatus", json!(null))
        .await;
    let sync = m.expect("ke/cloud/meta/update/ns/podstatus").await;
    assert_eq!(sync["content"], json!([{"Name": "live"}]));
    assert_eq!(m.stored("ns/podstatus/gone").await, None);
}

#[tokio::test]
async fn action_goes_to_edgefunction_and_action_result_to_the_cloud() {
    let mut m = start().await;
    let id = m
        .send("funcmgr", "action", "default/function/f", json!({"run": 1}))
        .await;
    m.expect("ke/edgefunction/funcmgr/action/default/function/f")
        .await;
    assert_eq!(
        parent(&m.expect("ke/cloud/meta/response/default/function/f").await),
        id
    );
    m.send(
        "edgefunction",
        "action_result",
        "default/function/f",
        json!({"out": 2}),
    )
    .await;
    m.expect("ke/cloud/edgefunction/action_result/default/function/f")
        .await;
    m.expect("ke/edgefunction/meta/response/default/function/f")
        .await;
    assert_eq!(
        m.stored("default/function/f").await.as_deref(),
        Some(r#"{"out":2}"#)
    );
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
        let id = m
            .send(
                "edgecontroller",
                op,
                "default/volume/v1",
                json!({"size": 1}),
            )
            .await;
        let to_edged = m
            .expect(&format!("ke/edged/edgecontroller/{op}/default/volume/v1"))
            .await;
        assert_eq!(to_edged["header"]["msg_id"], id);
        let answer = json!({"header": {"msg_id": "e", "parent_msg_id": id}, "route": {}, "content": {"done": op}});
        m.publish(
            "ke/meta/edged/response/default/volume/v1",
            answer.to_string(),
        )
        .await;
        let reply = m.expect("ke/cloud/meta/response/default/volume/v1").await;
        assert_eq!(
            (parent(&reply), &reply["content"]),
            (id.as_str(), &json!({"done": op}))
        );
    }
    // Volume answers are not metadata.
    assert_eq!(m.stored("default/volume/v1").await, None);
}

#[tokio::test]
async fn a_volume_call_edged_does_not_answer_fails_after_the_timeout() {
    let mut m = start().await;
    let id = m
        .send(
            "edgecontroller",
            "createvolume",
            "default/volume/v2",
            json!({}),
        )
        .await;
    m.expect("ke/edged/edgecontroller/createvolume/default/volume/v2")
        .await;
    let e = m.expect("ke/cloud/meta/error/default/volume/v2").await;
    assert_eq!(parent(&e), id);
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
    assert_eq!(m.stored("default/pod/p49").await.as_deref(), Some("49"));
}
