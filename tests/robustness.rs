//! What an operator relies on: state survives restarts and `kill -9`, bad input is refused
//! without harm, shutdown is bounded, configuration mistakes are named, and the command-line
//! mosquitto clients work against the node.

mod common;

use common::{
    envelope, mosquitto_pub, mosquitto_sub, run_expecting_exit, send, shell_words, sub_output,
    Client, MosquittoSub, Msg, Node, Options, WAIT,
};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

/// How many inserts a burst sends: enough that many are still in flight when the node stops.
const BURST: usize = 2000;

/// A client of `node` subscribed to `filter`.
async fn watching(node: &Node, filter: &str) -> Client {
    let mut client = node.client().await;
    client.subscribe(filter).await;
    client
}

/// edgecontroller inserts `content` under `resource` and waits for the reply to the cloud.
/// `client` must watch `ke/cloud/meta/response/#`.
async fn insert_acked(client: &mut Client, resource: &str, content: Value) {
    let id = send(client, "edgecontroller", "insert", resource, content).await;
    client
        .expect_reply_about("ke/cloud/meta/response", resource, &id)
        .await;
}

/// edged queries `resource`; returns the answer's content. `client` must watch
/// `ke/edged/meta/response/#`.
async fn query(client: &mut Client, resource: &str) -> Value {
    let id = send(client, "edged", "query", resource, json!(null)).await;
    client
        .expect_reply_about("ke/edged/meta/response", resource, &id)
        .await
        .content()
}

/// The text of an error reply.
fn text(reply: &Msg) -> String {
    reply.content().as_str().unwrap_or_default().to_owned()
}

/// Sends [`BURST`] edgecontroller inserts, `default/pod/p<i>`; returns their ids in order.
async fn send_burst(client: &Client) -> Vec<String> {
    let mut ids = Vec::with_capacity(BURST);
    for i in 0..BURST {
        let resource = format!("default/pod/p{i}");
        ids.push(
            send(
                client,
                "edgecontroller",
                "insert",
                &resource,
                json!({"i": i}),
            )
            .await,
        );
    }
    ids
}

/// Reads replies until at least `count` distinct requests have been acknowledged.
async fn acks(client: &mut Client, count: usize) -> HashSet<String> {
    let mut acked = HashSet::new();
    while acked.len() < count {
        if let Some(parent) = client.next().await.parent_id() {
            acked.insert(parent);
        }
    }
    acked
}

/// Adds the acknowledgements still arriving within `window` (sent before the node stopped).
async fn late_acks(client: &mut Client, acked: &mut HashSet<String>, window: Duration) {
    acked.extend(client.drain(window).await.iter().filter_map(Msg::parent_id));
}

/// Asserts that every burst insert in `acked` is in the store; returns the stored keys.
async fn assert_acked_stored(
    node: &Node,
    ids: &[String],
    acked: &HashSet<String>,
) -> HashSet<String> {
    let stored: HashSet<String> = node.meta_rows().await.into_iter().map(|r| r.0).collect();
    for (i, id) in ids.iter().enumerate() {
        if acked.contains(id) {
            assert!(
                stored.contains(&format!("default/pod/p{i}")),
                "acked p{i} lost"
            );
        }
    }
    stored
}

/// Stops `node` with SIGTERM; it must exit successfully within five seconds.
fn terminate_cleanly(node: &mut Node) {
    let (status, took) = node.terminate();
    assert!(status.success(), "exit status {status}:\n{}", node.log());
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
}

#[tokio::test]
async fn state_survives_a_graceful_restart_and_a_kill_9_after_ok() {
    let mut node = Node::start().await;
    let mut client = watching(&node, "ke/cloud/meta/response/#").await;
    insert_acked(&mut client, "default/pod/a", json!({"v": 1})).await;
    drop(client);
    terminate_cleanly(&mut node);
    node.restart().await;

    let mut client = watching(&node, "ke/cloud/meta/response/#").await;
    insert_acked(&mut client, "default/pod/b", json!({"v": 2})).await;
    // The OK has been seen: from here nothing may lose pod b, not even SIGKILL.
    node.kill9();
    node.restart().await;

    let mut client = watching(&node, "ke/edged/meta/response/#").await;
    assert_eq!(
        query(&mut client, "default/pod").await,
        json!([r#"{"v":1}"#, r#"{"v":2}"#])
    );
}

#[tokio::test]
async fn every_insert_acked_before_a_kill_9_is_stored_after_it() {
    let mut node = Node::start().await;
    let mut client = watching(&node, "ke/cloud/meta/response/#").await;
    let ids = send_burst(&client).await;
    // Kill as soon as a few hundred are acknowledged: the rest are in flight.
    let mut acked = acks(&mut client, 300).await;
    node.kill9();
    late_acks(&mut client, &mut acked, Duration::from_millis(50)).await;
    node.restart().await;
    let stored = assert_acked_stored(&node, &ids, &acked).await;
    assert!(stored.len() >= acked.len());
}

#[tokio::test]
async fn sigterm_during_a_burst_stops_within_five_seconds_with_every_ack_committed() {
    let mut node = Node::start().await;
    let mut client = watching(&node, "ke/cloud/meta/response/#").await;
    let ids = send_burst(&client).await;
    let mut acked = acks(&mut client, 100).await;
    terminate_cleanly(&mut node);
    late_acks(&mut client, &mut acked, Duration::from_millis(100)).await;
    let log = node.log();
    assert!(log.contains("every accepted message is committed"), "{log}");
    node.restart().await;
    assert_acked_stored(&node, &ids, &acked).await;
}

/// Each bad input gets an `error` reply naming the problem on the sender's error topic (at
/// most `<ns>/<type>` of what it sent), with all of what it sent in `route.resource`.
#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error_and_the_store_is_unchanged() {
    let node = Node::start_with(Options {
        max_payload_bytes: 4096,
        ..Options::seeded(
            "INSERT INTO meta(key, type, value) VALUES ('default/pod/keep', 'pod', '{\"keep\":1}');",
        )
    })
    .await;
    let before = node.meta_rows().await;
    let mut client = watching(&node, "ke/edged/meta/error/#").await;

    let cases: Vec<(&str, Vec<u8>, &str, &str, &str)> = vec![
        (
            "ke/meta/edged/insert/default/pod/x",
            br#"{"header": {"msg_id": "#.to_vec(),
            "ke/edged/meta/error/default/pod",
            "default/pod/x",
            "malformed JSON",
        ),
        (
            "ke/meta/edged/insert/default",
            b"{}".to_vec(),
            "ke/edged/meta/error/default",
            "default",
            "invalid resource",
        ),
        (
            "ke/meta/edged/insert/a/b/c/d/e",
            b"{}".to_vec(),
            "ke/edged/meta/error/a/b",
            "a/b/c/d/e",
            "invalid resource",
        ),
        (
            "ke/meta/edged/frobnicate/default/pod/x",
            b"{}".to_vec(),
            "ke/edged/meta/error/default/pod",
            "default/pod/x",
            "unsupported operation \"frobnicate\"",
        ),
        (
            "ke/meta/edged/insert/default/pod/big",
            format!("\"{}\"", "x".repeat(5000)).into_bytes(),
            "ke/edged/meta/error/default/pod",
            "default/pod/big",
            "exceeds the limit of 4096 bytes",
        ),
        (
            "ke/meta/edged/insert/default/pod/bin",
            vec![0xff, 0x00, 0xfe, 0x13, 0x37],
            "ke/edged/meta/error/default/pod",
            "default/pod/bin",
            "neither JSON nor UTF-8 text",
        ),
        (
            "ke/meta/edged/insert/default/pod/arr",
            br#"{"header": [], "route": 1, "content": {}}"#.to_vec(),
            "ke/edged/meta/error/default/pod",
            "default/pod/arr",
            "invalid envelope",
        ),
        (
            "ke/meta/edged/insert/default/pod",
            br#"{"spec": {}}"#.to_vec(),
            "ke/edged/meta/error/default/pod",
            "default/pod",
            "no resource name",
        ),
        (
            "ke/meta/edged/insert/default/pod",
            br#"{"metadata": {"name": "n", "namespace": "other"}}"#.to_vec(),
            "ke/edged/meta/error/default/pod",
            "default/pod/n",
            "namespace mismatch",
        ),
    ];
    for (topic, payload, error_topic, resource, expected) in cases {
        client.publish(topic, payload).await;
        let reply = client.expect(error_topic).await;
        let said = text(&reply);
        assert!(
            said.contains(expected),
            "{topic}: {said:?} should say {expected:?}"
        );
        assert_eq!(reply.operation(), "error");
        assert_eq!(reply.resource(), resource, "{topic}");
    }
    assert_eq!(node.meta_rows().await, before);

    // And the node keeps answering.
    client.subscribe("ke/edged/meta/response/#").await;
    assert_eq!(
        query(&mut client, "default/pod/keep").await,
        json!([r#"{"keep":1}"#])
    );
}

#[tokio::test]
async fn a_client_id_with_a_slash_is_refused_twice_and_the_listener_keeps_serving() {
    let node = Node::start().await;
    for _ in 0..2 {
        let (ok, stderr) = mosquitto_pub(
            node.port,
            &[
                "-i",
                "dev/1",
                "-t",
                "ke/meta/edged/insert/default/pod/x",
                "-m",
                "{}",
            ],
        );
        assert!(!ok, "dev/1 must be refused");
        assert!(
            stderr.to_lowercase().contains("identifier rejected"),
            "{stderr}"
        );
    }
    let mut client = watching(&node, "ke/edged/meta/response/#").await;
    let id = send(&client, "edged", "insert", "default/pod/x", json!({})).await;
    client
        .expect_reply_about("ke/edged/meta/response", "default/pod/x", &id)
        .await;
    assert_eq!(node.stored("default/pod/x").await.as_deref(), Some("{}"));
    assert!(node.log().contains("EM-BROKER-CLIENT-ID"));
}

/// Publishes `payload` on `topic` at QoS 1 with `mosquitto_pub`, which must succeed.
fn mosquitto_pub_qos1(port: u16, topic: &str, payload: &str) {
    let (ok, stderr) = mosquitto_pub(port, &["-q", "1", "-t", topic, "-m", payload]);
    assert!(ok, "{topic}: {stderr}");
}

#[tokio::test]
async fn mosquitto_clients_drive_the_node_with_bare_and_full_payloads() {
    let node = Node::start().await;
    let port = node.port;
    let watcher = mosquitto_sub(port, "ke/edged/#", 3).await;

    mosquitto_pub_qos1(
        port,
        "ke/meta/edgecontroller/insert/default/configmap/app",
        r#"{"data":{"mode":"eco"}}"#,
    );
    // A full envelope names the object in its route, on the type-level topic.
    let (_, full) = envelope("edged", "query", "default/configmap/app", json!(null));
    mosquitto_pub_qos1(port, "ke/meta/edged/query/default/configmap", &full);

    let about_app = r#""resource":"default/configmap/app""#;
    let lines = sub_output(watcher).await;
    assert!(
        lines.iter().any(|l| l
            .starts_with(r#"ke/edged/edgecontroller/insert/default/configmap {"#)
            && l.contains(about_app)
            && l.contains(r#""content":{"data":{"mode":"eco"}}"#)),
        "{lines:#?}"
    );
    assert!(
        lines.iter().any(
            |l| l.starts_with("ke/edged/meta/response/default/configmap ")
                && l.contains(about_app)
                && l.contains(r#""content":["{\"data\":{\"mode\":\"eco\"}}"]"#)
        ),
        "{lines:#?}"
    );
    assert_eq!(
        node.stored("default/configmap/app").await.as_deref(),
        Some(r#"{"data":{"mode":"eco"}}"#)
    );
}

/// The README, whose walkthroughs the tests below run verbatim.
fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).expect("README.md")
}

/// The README's `mosquitto_pub`/`mosquitto_sub` lines for port `documented`, aimed at `actual`.
fn readme_commands(readme: &str, documented: u16, actual: u16) -> Vec<String> {
    let documented = format!("-p {documented}");
    readme
        .lines()
        .filter(|l| l.starts_with("mosquitto_pub ") || l.starts_with("mosquitto_sub "))
        .filter(|l| l.contains(&documented))
        .map(|l| l.replace(&documented, &format!("-p {actual}")))
        .collect()
}

/// Starts `mosquitto_sub` with `args`, exiting after one message or the wait; returns once it
/// is subscribed.
async fn mosquitto_sub_once(args: &[String]) -> MosquittoSub {
    let wait = WAIT.as_secs().to_string();
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    all.extend(["-C", "1", "-W", &wait]);
    MosquittoSub::start(&all).await
}

/// Runs `mosquitto_pub` with `args`; returns whether it succeeded.
fn run_mosquitto_pub(args: &[String]) -> bool {
    Command::new("mosquitto_pub")
        .args(args)
        .status()
        .expect("mosquitto_pub")
        .success()
}

#[tokio::test]
async fn the_readme_walkthrough_works_verbatim() {
    // The README's commands, with the port the test picked instead of 1883.
    let node = Node::start().await;
    let commands = readme_commands(&readme(), 1883, node.port);
    assert!(
        commands.len() >= 3,
        "walkthrough commands in README: {commands:?}"
    );
    let mut watchers = Vec::new();
    for command in &commands {
        let args = shell_words(command);
        if args[0] == "mosquitto_sub" {
            watchers.push((command, mosquitto_sub_once(&args[1..]).await));
        } else {
            assert!(run_mosquitto_pub(&args[1..]), "{command}");
        }
    }
    for (command, watcher) in watchers {
        let (status, lines) = watcher.output().await;
        assert!(
            status.success() && !lines.is_empty(),
            "nothing arrived for `{command}`"
        );
    }
}

/// A configuration whose one listener is `address`, with the store in the working directory.
fn listening_on(address: &str) -> String {
    format!(
        "broker:\n  listeners:\n    mqtt:\n      address: {address}\nstore:\n  path: store.db\nobserve:\n  enabled: false\n"
    )
}

#[tokio::test]
async fn an_unknown_configuration_key_is_refused_by_name() {
    let (status, text) = run_expecting_exit("metamanager:\n  max_payload_byte: 10\n", &[]);
    assert!(!status.success());
    assert!(text.contains("max_payload_byte"), "{text}");
}

#[tokio::test]
async fn a_listener_that_cannot_bind_stops_start_up_naming_the_address() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("addr").to_string();
    let (status, text) = run_expecting_exit(&listening_on(&address), &[]);
    assert!(!status.success());
    assert!(text.contains(&address), "{text}");
}

#[tokio::test]
async fn an_environment_variable_overrides_the_file() {
    // The file says 64 KiB ([`Options::max_payload_bytes`]); the environment says 64 bytes.
    let node = Node::start_with(Options {
        env: vec![(
            "EDGEMETA_METAMANAGER__MAX_PAYLOAD_BYTES".to_owned(),
            "64".to_owned(),
        )],
        ..Options::default()
    })
    .await;
    let mut client = node.client().await;
    client.subscribe("ke/edged/meta/error/#").await;
    client
        .publish("ke/meta/edged/insert/default/pod/x", "x".repeat(100))
        .await;
    let reply = client.expect("ke/edged/meta/error/default/pod").await;
    assert!(text(&reply).contains("exceeds the limit of 64 bytes"));
    assert_eq!(reply.resource(), "default/pod/x");
}

#[tokio::test]
async fn the_readme_cloud_walkthrough_works_verbatim() {
    // The README's cloud section, with the ports the test picked instead of 1883 and 1884.
    let cloud = common::CloudBroker::start().await;
    let readme = readme();
    let run = readme
        .lines()
        .find(|l| l.starts_with("EDGEMETA_CLOUD__ENABLED="))
        .expect("the cloud run command in README");
    let cloud_port = cloud.port.to_string();
    let env: Vec<(String, String)> = run
        .split(' ')
        .take_while(|w| w.starts_with("EDGEMETA_"))
        .map(|w| {
            let (k, v) = w.split_once('=').expect("KEY=value");
            (k.to_owned(), v.replace(":1884", &format!(":{cloud_port}")))
        })
        .collect();
    let mut node = Node::start_with(Options {
        env,
        ..Options::default()
    })
    .await;
    // As a person would, wait for the node to say it reached the cloud, and for its down
    // subscription, which must exist before the cloud publishes.
    node.await_log("cloud_connected").await;
    node.await_log(common::cloud::SUBSCRIBED).await;

    let commands: Vec<Vec<String>> = readme_commands(&readme, 1884, cloud.port)
        .iter()
        .map(|l| shell_words(l))
        .collect();
    assert_eq!(commands.len(), 2, "{commands:?}");
    let watcher = mosquitto_sub_once(&commands[0][1..]).await;
    assert!(run_mosquitto_pub(&commands[1][1..]));
    let (_, out) = watcher.output().await;
    let line = out.join("\n");
    node.kill9();
    assert!(
        line.starts_with("kubeedge/edge-1/up/meta/response/default/pod ")
            && line.contains(r#""resource":"default/pod/web""#)
            && line.contains(r#""content":"OK""#),
        "{line}"
    );
}

#[tokio::test]
async fn a_full_store_refuses_writes_with_an_error_and_keeps_answering_queries() {
    let node = Node::start_with(Options {
        max_pages: 40,
        ..Options::default()
    })
    .await;
    let mut client = watching(&node, "ke/edged/meta/#").await;
    let big = "x".repeat(30_000);
    let mut refused = None;
    let mut stored = Vec::new();
    for i in 0..100 {
        let resource = format!("default/configmap/c{i}");
        let id = send(&client, "edged", "insert", &resource, json!(big)).await;
        let reply = loop {
            let m = client.next().await;
            if m.parent_id().as_deref() == Some(id.as_str()) {
                break m;
            }
        };
        if reply.operation() == "error" {
            refused = Some(text(&reply));
            break;
        }
        stored.push(resource);
    }
    let refused = refused.expect("a 40-page store fills up");
    assert!(refused.contains("full"), "{refused}");
    assert!(!stored.is_empty());
    // What was acknowledged is there, and reads still work.
    let answer = query(&mut client, &stored[0]).await;
    assert_eq!(answer.as_array().map(Vec::len), Some(1));
    assert_eq!(node.meta_rows().await.len(), stored.len());
}

#[tokio::test]
async fn a_refused_full_envelope_is_answered_with_its_own_id() {
    let node = Node::start().await;
    let mut client = watching(&node, "ke/edged/meta/error/#").await;
    for (topic, error_topic, resource) in [
        (
            "ke/meta/edged/frobnicate/default/pod/x",
            "ke/edged/meta/error/default/pod",
            "default/pod/x",
        ),
        (
            "ke/meta/edged/insert/a/b/c/d/e",
            "ke/edged/meta/error/a/b",
            "a/b/c/d/e",
        ),
        (
            "ke/meta/edged/insert/default/pod",
            "ke/edged/meta/error/default/pod",
            "default/pod",
        ),
    ] {
        // The route names no object, so the type-level insert has no name either.
        let (id, payload) = envelope("edged", "insert", "default/pod", json!({}));
        client.publish(topic, payload).await;
        let reply = client.expect_reply(error_topic, &id).await;
        assert_eq!(reply.operation(), "error", "{topic}");
        assert_eq!(reply.resource(), resource, "{topic}");
    }
}

/// Starts a node with `log_yaml` (lines of its `log:` section; stdout and stderr go to a file),
/// sends one malformed message, waits for its error reply and returns the log once the node has
/// stopped.
async fn log_of_a_refused_message(log_yaml: &str) -> String {
    let mut node = Node::start_with(Options {
        log_yaml: log_yaml.to_owned(),
        ..Options::default()
    })
    .await;
    let mut client = node.client().await;
    client.subscribe("ke/edged/meta/error/#").await;
    client
        .publish("ke/meta/edged/insert/default/pod/x", "{not json")
        .await;
    client.expect("ke/edged/meta/error/default/pod").await;
    node.kill9();
    node.log()
}

#[tokio::test]
async fn logs_written_to_a_file_carry_no_colour_codes_and_json_lines_parse() {
    let text = log_of_a_refused_message("").await;
    assert!(text.contains("EM-META-JSON"), "{text}");
    assert!(!text.contains('\u{1b}'), "colour codes in a file:\n{text}");

    let json = log_of_a_refused_message("  format: json\n").await;
    let lines: Vec<Value> = json
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let refused = lines
        .iter()
        .find(|l| l["error_code"] == "EM-META-JSON")
        .unwrap_or_else(|| panic!("no EM-META-JSON line:\n{json}"));
    assert_eq!(refused["level"], "WARN", "{refused}");
    assert_eq!(refused["resource"], "default/pod/x", "{refused}");
    assert!(refused["timestamp"].is_string(), "{refused}");
}
