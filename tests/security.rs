//! Security end to end against the real binary: password logins, a server-only TLS listener with
//! certificates made by `openssl` at test time (none committed), the topic ACL for a device
//! identity, hostile client ids and connection floods, and the per-client limits. Client
//! certificates are in `client_certs.rs`.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::pki::{Key, Pki};
use common::{
    assert_quiet_for, auth_yaml, mosquitto_pub, send, unique_id, wait_until, Client, Node, Options,
    QUIET, WAIT,
};
use rumqttc::{
    AsyncClient, ConnectionError, Event, EventLoop, MqttOptions, Packet, QoS, SubscribeReasonCode,
};
use serde_json::json;

/// Polls the store until `key` has a value, at most [`WAIT`].
async fn stored_soon(node: &Node, key: &str) -> Option<String> {
    Some(
        wait_until(format_args!("{key} stored"), WAIT, async || {
            node.stored(key).await
        })
        .await,
    )
}

/// A bare MQTT 3.1.1 connection that reports CONNACK, SUBACK and PUBACK outcomes exactly.
struct Raw {
    client: AsyncClient,
    events: EventLoop,
    received: Vec<(String, Bytes)>,
}

impl Raw {
    /// Connects; `Err` carries the refusal (or a timeout / network error as text).
    async fn connect(port: u16, id: &str, login: Option<(&str, &str)>) -> Result<Raw, String> {
        let mut options = MqttOptions::new(id, "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        if let Some((user, password)) = login {
            options.set_credentials(user, password);
        }
        let (client, events) = AsyncClient::new(options, 1000);
        let mut raw = Raw {
            client,
            events,
            received: Vec::new(),
        };
        let result = tokio::time::timeout(WAIT, async {
            loop {
                match raw.events.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => return Ok(()),
                    Ok(_) => {}
                    Err(ConnectionError::ConnectionRefused(code)) => {
                        return Err(format!("refused: {code:?}"))
                    }
                    Err(e) => return Err(format!("error: {e}")),
                }
            }
        })
        .await;
        match result {
            Ok(Ok(())) => Ok(raw),
            Ok(Err(e)) => Err(e),
            Err(_) => Err("no CONNACK within the wait".into()),
        }
    }

    /// Polls until `done` picks an incoming packet; publications seen meanwhile are kept.
    async fn until<T>(&mut self, what: &str, mut done: impl FnMut(&Packet) -> Option<T>) -> T {
        let deadline = Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.poll()).await {
                Ok(Ok(Event::Incoming(packet))) => {
                    if let Packet::Publish(p) = &packet {
                        self.received.push((p.topic.clone(), p.payload.clone()));
                    }
                    if let Some(found) = done(&packet) {
                        return found;
                    }
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("connection lost waiting for {what}: {e}"),
                Err(_) => panic!("no {what} within {WAIT:?}"),
            }
        }
    }

    /// Waits for a publication `wanted` picks, including one that arrived while this client
    /// waited for an ack (a query's reply can overtake its PUBACK, which follows the commit).
    async fn until_published(&mut self, what: &str, wanted: impl Fn(&str, &[u8]) -> bool) {
        if self.received.iter().any(|(t, p)| wanted(t, p)) {
            return;
        }
        self.until(what, |p| match p {
            Packet::Publish(p) => wanted(&p.topic, &p.payload).then_some(()),
            _ => None,
        })
        .await;
    }

    /// Subscribes at QoS 1; the SUBACK's return code.
    async fn subscribe(&mut self, filter: &str) -> SubscribeReasonCode {
        self.client
            .subscribe(filter, QoS::AtLeastOnce)
            .await
            .expect("subscribe");
        self.until("SUBACK", |p| match p {
            Packet::SubAck(ack) => Some(ack.return_codes[0]),
            _ => None,
        })
        .await
    }

    async fn unsubscribe(&mut self, filter: &str) {
        self.client.unsubscribe(filter).await.expect("unsubscribe");
        self.until("UNSUBACK", |p| {
            matches!(p, Packet::UnsubAck(_)).then_some(())
        })
        .await
    }

    /// Publishes at QoS 1 and waits for the PUBACK.
    async fn publish(&mut self, topic: &str, payload: impl Into<Vec<u8>>) {
        self.client
            .publish(topic, QoS::AtLeastOnce, false, payload.into())
            .await
            .expect("publish");
        self.until("PUBACK", |p| matches!(p, Packet::PubAck(_)).then_some(()))
            .await
    }

    /// Everything that arrives during `window`, plus what arrived while waiting for acks.
    async fn drain(&mut self, window: Duration) -> Vec<(String, Bytes)> {
        let deadline = Instant::now() + window;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.events.poll()).await {
                Ok(Ok(Event::Incoming(Packet::Publish(p)))) => {
                    self.received.push((p.topic.clone(), p.payload.clone()))
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("connection lost while draining: {e}"),
                Err(_) => return std::mem::take(&mut self.received),
            }
        }
    }
}

/// A fresh client's insert of `default/sensor/<name>` is answered and stored: the node serves.
async fn assert_serves(node: &Node, name: &str) {
    let resource = format!("default/sensor/{name}");
    let mut client = node.client().await;
    client.subscribe("ke/device/meta/response/#").await;
    let id = send(&client, "device", "insert", &resource, json!({"ok": true})).await;
    client
        .expect_reply_about("ke/device/meta/response", &resource, &id)
        .await;
    assert_eq!(
        node.stored(&resource).await.as_deref(),
        Some(r#"{"ok":true}"#)
    );
}

/// `user` (password `<user>-pw`) publishes `{}` to `topic` at QoS 1 with `mosquitto_pub` on the
/// node's MQTT 5 listener, and its PUBACK says "not authorized".
fn told_not_authorized(node: &Node, user: &str, topic: &str) {
    let port = node.v5_port.expect("v5 listener").to_string();
    let password = format!("{user}-pw");
    let out = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &port, "-V", "mqttv5"])
        .args(["-u", user, "-P", &password, "-q", "1", "-d"])
        .args(["-t", topic, "-m", "{}"])
        .output()
        .expect("mosquitto_pub");
    let text = String::from_utf8_lossy(&out.stdout).to_lowercase()
        + &String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        text.contains("not authori") || text.contains("rc135") || text.contains("(135)"),
        "MQTT 5 PUBACK to {user} on {topic} does not say not authorized: {text}"
    );
}

/// A QoS 1 subscription granted as asked.
const GRANTED: SubscribeReasonCode = SubscribeReasonCode::Success(QoS::AtLeastOnce);

/// Connects without a login, which the node must accept; the client id starts with `prefix`.
async fn anonymous(port: u16, prefix: &str) -> Raw {
    Raw::connect(port, &unique_id(prefix), None)
        .await
        .unwrap_or_else(|e| panic!("anonymous {prefix} refused: {e}"))
}

/// Connects as `user` with the password `<user>-pw`, which the node must accept.
async fn admitted(port: u16, user: &str) -> Raw {
    let password = format!("{user}-pw");
    Raw::connect(port, &unique_id(user), Some((user, &password)))
        .await
        .unwrap_or_else(|e| panic!("{user} refused: {e}"))
}

fn refused(result: Result<Raw, String>) -> String {
    match result {
        Ok(_) => panic!("the connection was admitted"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Passwords
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn only_the_right_password_is_admitted_when_anonymous_access_is_off() {
    let node = Node::start_with_broker(auth_yaml(false, &["device1"])).await;
    let attempt = |key: &str| {
        [
            "-q".to_owned(),
            "1".to_owned(),
            "-t".to_owned(),
            format!("ke/meta/device/insert/default/sensor/{key}"),
            "-m".to_owned(),
            format!("{{\"by\":\"{key}\"}}"),
        ]
    };
    let refused_cases: [(&str, &[&str]); 4] = [
        ("wrong", &["-u", "device1", "-P", "device1-wrong"]),
        ("none", &[]),
        ("nopassword", &["-u", "device1"]),
        ("unknown", &["-u", "intruder", "-P", "device1-pw"]),
    ];
    for (key, login) in refused_cases {
        let args = attempt(key);
        let args: Vec<&str> = login
            .iter()
            .copied()
            .chain(args.iter().map(String::as_str))
            .collect();
        let (ok, stderr) = mosquitto_pub(node.port, &args);
        // mosquitto_pub reports the CONNACK's refusal and exits non-zero.
        assert!(!ok, "mosquitto_pub {key} was admitted: {stderr}");
    }
    // The same with rumqttc, which shows the CONNACK code.
    for login in [None, Some(("device1", "nope")), Some(("edged", "edged-pw"))] {
        refused(Raw::connect(node.port, &unique_id("r"), login).await);
    }

    let args = attempt("right");
    let args: Vec<&str> = ["-u", "device1", "-P", "device1-pw"]
        .into_iter()
        .chain(args.iter().map(String::as_str))
        .collect();
    let (ok, stderr) = mosquitto_pub(node.port, &args);
    assert!(ok, "the right password was refused: {stderr}");
    assert_eq!(
        stored_soon(&node, "default/sensor/right").await.as_deref(),
        Some(r#"{"by":"right"}"#)
    );
    let mut device = admitted(node.port, "device1").await;
    assert_eq!(device.subscribe("ke/device/#").await, GRANTED);
    // The admitted device reads the answer to its own query.
    let (id, query) = common::envelope("device", "query", "default/sensor/right", json!(null));
    device
        .publish("ke/meta/device/query/default/sensor", query)
        .await;
    device
        .until_published("the reply to the query", |topic, payload| {
            topic == "ke/device/meta/response/default/sensor"
                && String::from_utf8_lossy(payload).contains(&id)
        })
        .await;

    let keys: Vec<String> = node.meta_rows().await.into_iter().map(|r| r.0).collect();
    assert_eq!(
        keys,
        ["default/sensor/right"],
        "refused clients stored data"
    );
    assert!(node.log().contains("EM-AUTH-REFUSED"));
}

#[tokio::test]
async fn with_users_and_anonymous_access_on_anonymous_gets_in_but_unknown_names_do_not() {
    let node = Node::start_with_broker(auth_yaml(true, &["device1"])).await;
    anonymous(node.port, "anon").await;
    admitted(node.port, "device1").await;
    refused(Raw::connect(node.port, &unique_id("x"), Some(("intruder", "x"))).await);
    refused(Raw::connect(node.port, &unique_id("x"), Some(("device1", "wrong"))).await);
}

// ---------------------------------------------------------------------------------------------
// 2. TLS
// ---------------------------------------------------------------------------------------------

/// A node with an extra server-only TLS listener on `tls_port` using the server certificate of `pki`.
async fn tls_node(pki: &Pki, tls_port: u16, broker_yaml: String) -> Node {
    Node::start_with(Options {
        extra_listeners: pki.listener(tls_port),
        broker_yaml,
        ..Options::default()
    })
    .await
}

#[tokio::test]
async fn a_tls_listener_serves_clients_that_trust_its_ca_and_nobody_else() {
    // The server key in the traditional PKCS#1 form (client_certs.rs covers PKCS#8).
    let pki = Pki::with_server_key(Key::RsaPkcs1);
    pki.authority("other-ca");
    assert!(std::fs::read_to_string(pki.path("server.key"))
        .unwrap()
        .contains("BEGIN RSA PRIVATE KEY"));
    let tls_port = common::free_port();
    let node = tls_node(&pki, tls_port, auth_yaml(false, &["device1"])).await;
    let login = ["-u", "device1", "-P", "device1-pw"];
    // `mosquitto_pub` inserting pod `key`, over TLS trusting the CA `trust` (or plain MQTT).
    let insert = |trust: Option<&str>, login: &[&str], key: &str| {
        let topic = format!("ke/meta/edgecontroller/insert/default/pod/{key}");
        let message = format!("{{\"over\":\"{key}\"}}");
        let args = [login, &["-t", &topic, "-m", &message]].concat();
        match trust {
            Some(trust) => pki.tls_pub(tls_port, trust, None, &args),
            None => mosquitto_pub(tls_port, &args),
        }
    };

    // Trusted CA, host name, right password: served, and the insert is stored.
    let (ok, stderr) = insert(Some("ca"), &login, "secure");
    assert!(ok, "TLS publish failed: {stderr}");
    assert_eq!(
        stored_soon(&node, "default/pod/secure").await.as_deref(),
        Some(r#"{"over":"secure"}"#)
    );

    let (ok, _) = insert(None, &login, "plain");
    assert!(!ok, "plain MQTT was served on the TLS port");
    let (ok, _) = insert(Some("other-ca"), &login, "foreign");
    assert!(!ok, "a client that trusts another CA accepted the server");
    let (ok, _) = insert(Some("ca"), &[], "nopassword");
    assert!(
        !ok,
        "TLS replaced the password check: anonymous TLS client admitted"
    );

    // After all those failed handshakes the listener still serves.
    let (ok, stderr) = insert(Some("ca"), &login, "after");
    assert!(ok, "{stderr}");
    assert!(stored_soon(&node, "default/pod/after").await.is_some());
    for key in ["plain", "foreign", "nopassword"] {
        assert_eq!(
            node.stored(&format!("default/pod/{key}")).await,
            None,
            "{key}"
        );
    }
}

#[tokio::test]
async fn a_silent_tcp_connection_does_not_block_the_tls_listener() {
    let pki = Pki::new();
    let tls_port = common::free_port();
    // connect_timeout_ms is documented to cover a connection that sends no TLS handshake.
    let node = tls_node(&pki, tls_port, "  connect_timeout_ms: 1000\n".into()).await;
    // One client that connects and never says hello.
    let silent = std::net::TcpStream::connect(("127.0.0.1", tls_port)).expect("connect");
    let started = Instant::now();
    let (served, stderr) = pki.tls_pub(
        tls_port,
        "ca",
        None,
        &[
            "-t",
            "ke/meta/edgecontroller/insert/default/pod/behind",
            "-m",
            "{}",
        ],
    );
    drop(silent);
    assert!(
        served,
        "a TLS client waited {:?} behind one silent TCP connection and was not served \
         (a TLS handshake must not be done inline in the accept loop): {stderr}",
        started.elapsed(),
    );
    assert!(stored_soon(&node, "default/pod/behind").await.is_some());
}

// ---------------------------------------------------------------------------------------------
// 3. The ACL
// ---------------------------------------------------------------------------------------------

/// Password logins for `users` only (see [`auth_yaml`]); ACL on with:
/// - `watcher` may read `ke/#` and `site/#` and publish `site/#`;
/// - every `device*` may publish `site/%u/#` and read `site/%c/#`.
fn acl_yaml(users: &[&str]) -> String {
    format!(
        "{}\
         \x20 acl:\n    enabled: true\n    rules:\n\
         \x20     - identity: watcher\n        subscribe: ['ke/#', 'site/#']\n        publish: ['site/#']\n\
         \x20     - identity: 'device*'\n        publish: ['site/%u/#']\n        subscribe: ['site/%c/#']\n",
        auth_yaml(false, users)
    )
}

#[tokio::test]
async fn a_device_gets_nothing_through_as_edgecontroller_or_edged_and_reads_no_cloud_traffic() {
    const N: usize = 50;
    let node = Node::start_with(Options {
        broker_yaml: acl_yaml(&["device1", "edged", "watcher"]),
        v5: true,
        ..Options::default()
    })
    .await;
    let mut watcher =
        Client::connect_as(node.port, &unique_id("watch"), "watcher", "watcher-pw").await;
    watcher.subscribe("ke/#").await;
    watcher.subscribe("site/#").await;
    let device_id = unique_id("dev1");
    let mut device = Raw::connect(node.port, &device_id, Some(("device1", "device1-pw")))
        .await
        .expect("device1 admitted");

    // Subscriptions outside the device's rights fail; its own succeed.
    for filter in [
        "ke/cloud/#",
        "ke/#",
        "#",
        "ke/edged/#",
        "ke/+/meta/#",
        "site/#",
        "site/device1/#",
    ] {
        assert_eq!(
            device.subscribe(filter).await,
            SubscribeReasonCode::Failure,
            "{filter} granted"
        );
    }
    let own = format!("site/{device_id}/#");
    for filter in ["ke/device/#", own.as_str()] {
        assert_eq!(device.subscribe(filter).await, GRANTED, "{filter} refused");
    }

    let rows_before = node.meta_rows().await;
    for i in 0..N {
        device
            .publish(
                &format!("ke/meta/edgecontroller/insert/default/pod/forged{i}"),
                json!({"forged": i}).to_string(),
            )
            .await;
        device
            .publish(
                &format!("ke/meta/edged/update/default/podstatus/forged{i}"),
                json!({"forged": i}).to_string(),
            )
            .await;
    }
    for topic in [
        "ke/cloud/device/update/default/pod/forged",
        "ke/edged/meta/response/default/pod/forged",
        "site/device2/forged",
        "ke/meta/device",
    ] {
        device.publish(topic, "forged").await;
    }
    // A forgery from a separate mosquitto_pub process on the MQTT 5 listener is told why.
    // (One process: each login costs an argon2 check, seconds in a debug build.)
    told_not_authorized(
        &node,
        "device1",
        "ke/meta/edgecontroller/insert/default/pod/forged-v5",
    );

    // Meanwhile edged really talks to the cloud: none of that may reach the device.
    let edged = Client::connect_as(node.port, &unique_id("edged"), "edged", "edged-pw").await;
    for i in 0..5 {
        send(
            &edged,
            "edged",
            "update",
            &format!("default/podstatus/real{i}"),
            json!({"i": i}),
        )
        .await;
    }
    // Permitted traffic for the device still flows: its own insert, replies, and site topics.
    let (id, payload) = common::envelope(
        "device",
        "insert",
        "default/sensor/t1",
        json!({"celsius": 21}),
    );
    device
        .publish("ke/meta/device/insert/default/sensor", payload)
        .await;
    device.publish("site/device1/temp", "21").await;
    watcher
        .client
        .publish(
            format!("site/{device_id}/setpoint"),
            QoS::AtLeastOnce,
            false,
            "22",
        )
        .await
        .expect("watcher publishes");

    let seen = watcher.drain(Duration::from_secs(2)).await;
    // Since v2 a forged name would travel in the payload's route of what the node publishes,
    // not in its topic. (The device may publish on `ke/meta/device` itself.)
    let forged: Vec<&String> = seen
        .iter()
        .filter(|m| {
            m.topic.contains("forged")
                || (!m.topic.starts_with("ke/meta/")
                    && String::from_utf8_lossy(&m.payload).contains("forged"))
        })
        .map(|m| &m.topic)
        .collect();
    assert!(
        forged.is_empty(),
        "{} of {} forged messages got through: {forged:?}",
        forged.len(),
        2 * N + 5
    );
    let cloud_bound = seen
        .iter()
        .filter(|m| m.topic.starts_with("ke/cloud/edged/"))
        .count();
    assert_eq!(cloud_bound, 5, "edged's cloud traffic flows");
    assert!(seen.iter().any(|m| m.topic == "site/device1/temp"));

    let got = device.drain(QUIET).await;
    let topics: Vec<&String> = got.iter().map(|(t, _)| t).collect();
    assert!(
        topics
            .iter()
            .all(|t| t.starts_with("ke/device/") || t.starts_with(&format!("site/{device_id}/"))),
        "the device read {topics:?}"
    );
    assert!(
        got.iter()
            .any(|(t, p)| t == "ke/device/meta/response/default/sensor"
                && String::from_utf8_lossy(p).contains(&id)
                && String::from_utf8_lossy(p).contains(r#""resource":"default/sensor/t1""#)),
        "no reply to the device's own insert: {topics:?}"
    );
    assert!(topics.contains(&&format!("site/{device_id}/setpoint")));

    let rows_after = node.meta_rows().await;
    let new_keys: Vec<&String> = rows_after
        .iter()
        .filter(|r| !rows_before.contains(r))
        .map(|r| &r.0)
        .collect();
    assert!(
        new_keys.iter().all(|k| !k.contains("forged")),
        "forged rows stored: {new_keys:?}"
    );
    assert!(new_keys.contains(&&"default/sensor/t1".to_owned()));
    let log = node.log();
    assert!(log.contains("EM-ACL-PUBLISH-DENIED"));
    assert!(log.contains("EM-ACL-SUBSCRIBE-DENIED"));
}

#[tokio::test]
async fn a_module_name_claimed_without_a_password_check_gets_no_module_rights() {
    // ACL on, but no users configured and anonymous access on: nothing verifies a username.
    let node = Node::start_with_broker("  acl:\n    enabled: true\n    rules:\n      - identity: anonymous\n        subscribe: ['ke/#']\n").await;
    let mut watcher = node.client().await;
    watcher.subscribe("ke/#").await;
    let mut claimant = Raw::connect(node.port, &unique_id("c"), Some(("edged", "anything")))
        .await
        .unwrap_or_else(|e| panic!("refused ({e}): acceptable, but then this test needs updating"));
    claimant
        .publish("ke/meta/edged/update/default/podstatus/claimed", "{}")
        .await;
    claimant
        .publish("ke/cloud/edged/update/default/podstatus/claimed", "{}")
        .await;
    // Since v2 the name would travel in the payload's route, not in the topic.
    let seen: Vec<String> = watcher
        .drain(Duration::from_secs(1))
        .await
        .into_iter()
        .filter(|m| {
            m.topic.contains("claimed") || String::from_utf8_lossy(&m.payload).contains("claimed")
        })
        .map(|m| m.topic)
        .collect();
    assert!(
        seen.is_empty(),
        "an unverified username `edged` acted as the edged module: published {seen:?}"
    );
}

/// Password logins for `users`; ACL on with KubeEdge's device topics: every `dev-*` owns
/// `$hw/events/device/<its name>/#`, `mapper` reads every device's.
fn device_acl_yaml(users: &[&str]) -> String {
    format!(
        "{}\
         \x20 acl:\n    enabled: true\n    rules:\n\
         \x20     - identity: 'dev-*'\n        publish: ['$hw/events/device/%u/#']\n        subscribe: ['$hw/events/device/%u/#']\n\
         \x20     - identity: mapper\n        subscribe: ['$hw/events/device/#']\n",
        auth_yaml(false, users)
    )
}

/// Topics of everything `client` received during [`QUIET`] and while waiting for acks.
async fn topics_seen(client: &mut Raw) -> Vec<String> {
    client
        .drain(QUIET)
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

#[tokio::test]
async fn a_device_reads_and_writes_only_its_own_dollar_hw_subtree() {
    let node = Node::start_with(Options {
        broker_yaml: device_acl_yaml(&["dev-a", "dev-b", "mapper"]),
        v5: true,
        ..Options::default()
    })
    .await;
    let mut mapper = admitted(node.port, "mapper").await;
    assert_eq!(mapper.subscribe("$hw/events/device/#").await, GRANTED);
    let mut device = admitted(node.port, "dev-a").await;
    // Another device's subtree, the whole tree, and the carried form itself are refused; the
    // connection stays up: the SUBACK refuses each, it is not a reason to disconnect.
    for filter in [
        "$hw/events/device/dev-b/#",
        "$hw/events/device/#",
        "edgemeta$hw/events/device/dev-a/#",
    ] {
        assert_eq!(
            device.subscribe(filter).await,
            SubscribeReasonCode::Failure,
            "{filter} granted"
        );
    }
    assert_eq!(device.subscribe("$hw/events/device/dev-a/#").await, GRANTED);

    // A topic the MetaManager does not answer, so only the devices' own messages arrive.
    let own = "$hw/events/device/dev-a/telemetry";
    device
        .publish("$hw/events/device/dev-b/telemetry", "forged")
        .await;
    device
        .publish("edgemeta$hw/events/device/dev-a/telemetry", "carrier")
        .await;
    device.publish(own, r#"{"state":"online"}"#).await;
    // A will is vetted and carried like a publish.
    let will = "$hw/events/device/dev-b/telemetry";
    drop(connect_with_will(
        node.port,
        "dev-b",
        will,
        r#"{"state":"offline"}"#,
    ));
    mapper
        .until("dev-b's will", |p| {
            matches!(p, Packet::Publish(p) if p.topic == will).then_some(())
        })
        .await;
    assert_eq!(
        mapper.drain(QUIET).await,
        [
            (own.to_owned(), Bytes::from_static(br#"{"state":"online"}"#)),
            (
                will.to_owned(),
                Bytes::from_static(br#"{"state":"offline"}"#)
            ),
        ],
        "the mapper reads each device's own topics, in the client's form, and nothing forged"
    );
    assert_eq!(topics_seen(&mut device).await, [own]);

    // MQTT 5 is told why (one process: each login costs an argon2 check).
    told_not_authorized(&node, "dev-a", "$hw/events/device/dev-b/state/update");
    assert!(topics_seen(&mut mapper).await.is_empty());
    assert!(node.log().contains("EM-ACL-PUBLISH-DENIED"));
}

#[tokio::test]
async fn with_the_acl_off_dollar_hw_and_ke_topics_flow_and_the_carried_form_is_closed() {
    let node = Node::start().await;
    let mut mapper = anonymous(node.port, "mapper").await;
    let result = "$hw/events/device/d1/twin/update/result";
    for filter in [
        "$hw/events/device/+/twin/update/result",
        "$share/mappers/$ke/events/device/#",
    ] {
        assert_eq!(mapper.subscribe(filter).await, GRANTED, "{filter}");
    }
    for filter in ["edgemeta$hw/#", "$share/g/edgemeta$ke/#", "$SYS/#"] {
        assert_eq!(
            mapper.subscribe(filter).await,
            SubscribeReasonCode::Failure,
            "{filter}"
        );
    }
    let mut other = anonymous(node.port, "pub").await;
    for topic in [
        "edgemeta$hw/events/device/d1/twin/update/result",
        "edgemeta$ke/events/device/d1/data/update",
        result,
        "$ke/events/device/d1/data/update",
    ] {
        other.publish(topic, "x").await;
    }
    // Retained, then read by mosquitto_sub subscribing afterwards: no race with its SUBSCRIBE.
    other
        .client
        .publish(result, QoS::AtLeastOnce, true, "kept")
        .await
        .expect("publish");
    other
        .until("PUBACK", |p| matches!(p, Packet::PubAck(_)).then_some(()))
        .await;
    assert_eq!(
        topics_seen(&mut mapper).await,
        [result, "$ke/events/device/d1/data/update", result],
        "only the client-form topics are delivered, in that form"
    );
    let lines = common::sub_output(
        common::mosquitto_sub(node.port, "$hw/events/device/+/twin/update/result", 1).await,
    )
    .await;
    assert_eq!(lines, [format!("{result} kept")]);
}

// ---------------------------------------------------------------------------------------------
// 4. Hostile client ids and floods
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn hostile_client_ids_and_floods_leave_the_listener_accepting() {
    let node = Node::start().await;
    for id in [
        "dev/1",
        "a+b",
        "#",
        "edgemeta-metamanager",
        "dev/1",
        "$share",
        "$SYS",
    ] {
        let (ok, stderr) = mosquitto_pub(
            node.port,
            &[
                "-i",
                id,
                "-t",
                "ke/meta/device/insert/default/sensor/bad",
                "-m",
                "{}",
            ],
        );
        assert!(!ok, "client id {id:?} was accepted");
        assert!(
            stderr.to_lowercase().contains("identifier rejected"),
            "{id}: {stderr}"
        );
        let why = refused(Raw::connect(node.port, id, None).await);
        assert!(why.contains("BadClientId"), "{id}: {why}");
    }
    assert!(node.log().contains("EM-BROKER-CLIENT-ID"));

    // The same valid id twice: the second takes the session over and works.
    let _first = Raw::connect(node.port, "dev1", None)
        .await
        .expect("first dev1");
    let mut second = Raw::connect(node.port, "dev1", None)
        .await
        .expect("second dev1");
    assert_eq!(second.subscribe("ke/device/#").await, GRANTED);

    // 300 TCP connections opened and dropped without CONNECT, from 4 threads at once.
    let port = node.port;
    let threads: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                for _ in 0..75 {
                    if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                        drop(s);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("flood thread");
    }
    // 300 that stay open, silent, and 100 that send garbage, while a client is served below.
    // (Many quick CONNECT/DISCONNECT clients: `short_lived_clients_are_not_dropped_under_churn`.)
    let idle: Vec<_> = (0..300)
        .map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect"))
        .collect();
    for _ in 0..100 {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
        let _ = s.write_all(&[0xff, 0xff, 0xff, 0xff, 0x7f, 0x00, 0x13]);
    }

    assert_serves(&node, "after-flood").await;
    drop(idle);
}

// ---------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn the_subscription_limit_holds_and_a_refused_filter_delivers_nothing() {
    let node = Node::start_with_broker("  max_subscriptions_per_client: 3\n").await;
    let mut client = anonymous(node.port, "subs").await;
    for filter in ["a/1", "a/2", "a/3"] {
        assert_eq!(client.subscribe(filter).await, GRANTED);
    }
    assert_eq!(client.subscribe("a/4").await, SubscribeReasonCode::Failure);
    // Unsubscribing a filter it holds frees a slot.
    client.unsubscribe("a/1").await;
    assert_eq!(client.subscribe("a/5").await, GRANTED);
    // Unsubscribing filters it never held must not. (No UNSUBACK is awaited; the SUBACKs below
    // come after the UNSUBSCRIBEs were processed, as a connection's packets are handled in order.)
    for filter in ["never/1", "never/2"] {
        client
            .client
            .unsubscribe(filter)
            .await
            .expect("unsubscribe");
    }
    let extra = [client.subscribe("a/6").await, client.subscribe("a/7").await];
    assert_eq!(
        extra,
        [SubscribeReasonCode::Failure, SubscribeReasonCode::Failure],
        "unsubscribing two filters never held raised the limit: 5 subscriptions held with a limit of 3"
    );

    let mut other = anonymous(node.port, "pub").await;
    // The last two are where the broker points refused subscriptions.
    for topic in [
        "a/4",
        "a/6",
        "a/7",
        "edgemeta-refused",
        "$edgemeta/refused",
        "a/2",
    ] {
        other.publish(topic, "hello").await;
    }
    let topics: Vec<String> = client
        .drain(QUIET)
        .await
        .into_iter()
        .map(|(t, _)| t)
        .collect();
    assert_eq!(
        topics,
        ["a/2"],
        "a client received messages for a filter it was refused"
    );
}

#[tokio::test]
async fn oversized_packets_and_payloads_are_refused_and_the_node_keeps_serving() {
    let node = Node::start_with(Options {
        max_packet_bytes: 64 * 1024,
        max_payload_bytes: 8 * 1024,
        ..Options::default()
    })
    .await;
    let mut client = node.client().await;
    client.subscribe("ke/device/meta/#").await;
    // Over the payload limit (but under the packet limit): an error reply, nothing stored.
    send(
        &client,
        "device",
        "insert",
        "default/sensor/big",
        json!({"blob": "x".repeat(16 * 1024)}),
    )
    .await;
    // The envelope of an oversized payload is not parsed: the reply, on the sender's error
    // topic, has no parent id.
    let reply = client.expect("ke/device/meta/error/default/sensor").await;
    assert_eq!(reply.operation(), "error", "{:?}", reply.json());
    assert_eq!(reply.parent_id(), None);
    assert_eq!(node.stored("default/sensor/big").await, None);
    // Over the packet limit: the connection is closed; nothing stored.
    let huge = node.dir().join("huge.txt");
    std::fs::write(&huge, "y".repeat(128 * 1024)).expect("write payload file");
    let (ok, _) = mosquitto_pub(
        node.port,
        &[
            "-q",
            "1",
            "-t",
            "ke/meta/device/insert/default/sensor/huge",
            "-f",
            huge.to_str().expect("utf-8 path"),
        ],
    );
    assert!(!ok, "a packet over max_packet_bytes was accepted");
    assert_serves(&node, "small").await;
    assert_eq!(node.stored("default/sensor/huge").await, None);
}

/// Connects over bare TCP with a QoS 1 will on `topic` and login `user`/`user-pw`; returns the
/// socket once the CONNACK says accepted. Dropping it ends the connection without DISCONNECT.
fn connect_with_will(port: u16, user: &str, topic: &str, will: &str) -> std::net::TcpStream {
    let field = |bytes: &[u8]| {
        let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    };
    // Flags: username, password, will QoS 1, will, clean session.
    let mut rest = b"\x00\x04MQTT\x04\xce\x00\x3c".to_vec();
    for part in [
        unique_id("will").as_bytes(),
        topic.as_bytes(),
        will.as_bytes(),
        user.as_bytes(),
        format!("{user}-pw").as_bytes(),
    ] {
        rest.extend(field(part));
    }
    let mut packet = vec![0x10];
    let mut len = rest.len();
    loop {
        let byte = (len % 128) as u8;
        len /= 128;
        packet.push(if len > 0 { byte | 0x80 } else { byte });
        if len == 0 {
            break;
        }
    }
    packet.extend(rest);
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    stream.write_all(&packet).expect("send CONNECT");
    let mut connack = [0_u8; 4];
    std::io::Read::read_exact(&mut stream, &mut connack).expect("CONNACK");
    assert_eq!(connack, [0x20, 2, 0, 0], "{user} not admitted");
    stream
}

#[tokio::test]
async fn a_will_is_held_to_the_publish_rights_of_its_client() {
    let node = Node::start_with_broker(acl_yaml(&["device1", "watcher"])).await;
    let mut watcher =
        Client::connect_as(node.port, &unique_id("watch"), "watcher", "watcher-pw").await;
    watcher.subscribe("ke/#").await;
    watcher.subscribe("site/#").await;
    let (_, forged) = common::envelope(
        "edgecontroller",
        "insert",
        "default/pod/will-forged",
        json!({"forged": true}),
    );
    // Connections end without DISCONNECT, so the broker publishes their wills.
    drop(connect_with_will(
        node.port,
        "device1",
        "ke/meta/edgecontroller/insert/default/pod/will-forged",
        &forged,
    ));
    drop(connect_with_will(
        node.port,
        "device1",
        "site/device1/gone",
        "bye",
    ));
    let first = watcher.next().await;
    assert_eq!(
        (first.topic.as_str(), &first.payload[..]),
        ("site/device1/gone", &b"bye"[..]),
        "the permitted will is published, and first"
    );
    // Since v2 the name would travel in the payload's route, not in the topic.
    let late: Vec<String> = watcher
        .drain(QUIET)
        .await
        .into_iter()
        .map(|m| format!("{} {}", m.topic, String::from_utf8_lossy(&m.payload)))
        .collect();
    assert!(
        late.iter().all(|t| !t.contains("will-forged")),
        "a will forged the cloud: {late:?}"
    );
    assert_eq!(node.stored("default/pod/will-forged").await, None);
}

// ---------------------------------------------------------------------------------------------
// Connection races (each found in rumqttd 0.20, the broker the node once wrapped)
// ---------------------------------------------------------------------------------------------

/// A CONNECT (MQTT 3.1.1, clean session, keep-alive 60 s) for `client_id`.
fn connect_packet(client_id: &str) -> Vec<u8> {
    let mut rest = b"\x00\x04MQTT\x04\x02\x00\x3c".to_vec();
    rest.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    rest.extend_from_slice(client_id.as_bytes());
    let mut packet = vec![0x10, rest.len() as u8];
    packet.extend(rest);
    packet
}

#[tokio::test]
async fn a_client_that_drops_its_connect_repeatedly_cannot_break_the_listener_for_everyone() {
    let node = Node::start().await;
    // One client, one ordinary id, 50 times: CONNECT then close before reading the CONNACK.
    // rumqttd 0.20 kept a will-handler entry for a connection whose set-up failed; the next
    // CONNECT with that id panicked its listener for everyone after it.
    for _ in 0..50 {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", node.port)).expect("connect");
        let _ = s.write_all(&connect_packet("victim"));
    }
    // However long the node takes over the aborted CONNECTs, unrelated clients keep coming in.
    assert_quiet_for(
        "after 50 aborted CONNECTs with one id, an unrelated client refused",
        QUIET,
        async || {
            let refusal = Raw::connect(node.port, &unique_id("innocent"), None)
                .await
                .err()?;
            let panic: Vec<String> = node
                .log()
                .lines()
                .skip_while(|l| !l.contains("panicked"))
                .take(2)
                .map(str::to_owned)
                .collect();
            Some(format!("{refusal}; the node's first panic: {panic:?}"))
        },
    )
    .await;
}

/// Connects as `id`, retrying while the broker refuses, for up to [`WAIT`].
async fn admitted_soon(port: u16, id: &str) -> Raw {
    wait_until(format_args!("{id} admitted"), WAIT, async || {
        Raw::connect(port, id, None).await
    })
    .await
}

#[tokio::test]
async fn a_client_refused_at_the_connection_limit_can_retry_and_the_listener_serves_on() {
    let node = Node::start_with_broker("  max_connections: 1\n").await;
    let holder = Raw::connect(node.port, &unique_id("holder"), None)
        .await
        .expect("the first client is admitted");
    // Every client retries with its own id; a refusal must leave nothing behind that breaks
    // the retry or the listener (rumqttd 0.20's did: #1062).
    for _ in 0..3 {
        let refusal = refused(Raw::connect(node.port, "retrying", None).await);
        assert_eq!(refusal, "refused: ServiceUnavailable");
    }
    // A client that leaves without DISCONNECT holds its slot until its connection has ended.
    drop(holder);
    let retried = admitted_soon(node.port, "retrying").await;
    drop(retried);
    admitted_soon(node.port, &unique_id("innocent")).await;
    assert!(node.log().contains("EM-BROKER-CONNECTION-LIMIT"));
    assert!(!node.log().contains("PoisonError"));
}

/// The node's open-files limits as `/proc` shows them: (soft, hard).
fn open_files(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .expect("an open-files line");
    let words: Vec<&str> = line.split_whitespace().collect();
    (words[3].to_owned(), words[4].to_owned())
}

/// A node started with the open-files limits `soft` and `hard`.
async fn with_open_files(soft: u64, hard: u64) -> Node {
    Node::start_with(Options {
        nofile: Some((soft, hard)),
        ..Options::default()
    })
    .await
}

/// `count` clients with unique ids, each admitted.
async fn all_admitted(port: u16, count: usize) -> Vec<Raw> {
    let mut clients = Vec::with_capacity(count);
    for i in 0..count {
        let id = unique_id(&format!("fd{i}"));
        clients.push(Raw::connect(port, &id, None).await.expect("admitted"));
    }
    clients
}

#[tokio::test]
async fn a_low_soft_open_files_limit_is_raised_and_every_client_is_served() {
    // A soft limit of 64 would not carry the node itself (256 kept), let alone 30 clients.
    let node = with_open_files(64, 4096).await;
    assert_eq!(open_files(node.pid()), ("4096".into(), "4096".into()));
    let _clients = all_admitted(node.port, 30).await;
    let sub = common::mosquitto_sub(node.port, "fd/served", 1).await;
    let (sent, error) = mosquitto_pub(node.port, &["-q", "1", "-t", "fd/served", "-m", "yes"]);
    assert!(sent, "{error}");
    assert_eq!(common::sub_output(sub).await, ["fd/served yes"]);
    assert!(!node.log().contains("EM-FRONT-ACCEPT"), "{}", node.log());
    // What the hard limit carries is what the node admits: 4096 - 256, one per client.
    let warning = node.await_log("EM-BROKER-FD-LIMIT").await;
    assert!(
        warning.contains("admitting at most 3840 clients"),
        "{warning}"
    );
}

#[tokio::test]
async fn a_hard_open_files_limit_caps_the_clients_admitted_and_says_what_to_raise() {
    // 270 - 256 kept for the node itself, one per client: 14 of the default 10,000.
    let node = with_open_files(270, 270).await;
    let warning = node.await_log("EM-BROKER-FD-LIMIT").await;
    assert!(
        warning.contains("admitting at most 14 clients") && warning.contains("LimitNOFILE"),
        "{warning}"
    );
    let mut clients = all_admitted(node.port, 14).await;
    // Refused at CONNECT, as at broker.max_connections, not left to a failing accept.
    let refusal = refused(Raw::connect(node.port, "one-too-many", None).await);
    assert_eq!(refusal, "refused: ServiceUnavailable");
    drop(clients.pop());
    drop(admitted_soon(node.port, "one-too-many").await);
    assert!(!node.log().contains("EM-FRONT-ACCEPT"), "{}", node.log());
}

#[test]
fn an_open_files_limit_that_carries_no_client_stops_the_node_saying_so() {
    let (status, text) = common::run_limited_expecting_exit(
        "broker:\n  max_connections: 5\n",
        &[],
        Some((100, 100)),
    );
    assert!(!status.success());
    assert!(text.contains("may open only 100 files"), "{text}");
}

#[tokio::test]
async fn short_lived_clients_are_not_dropped_under_churn() {
    let node = Node::start().await;
    let started = Instant::now();
    let mut failures = Vec::new();
    for batch in 0..50 {
        let children: Vec<_> = (0..6)
            .map(|i| {
                Command::new("mosquitto_pub")
                    .args(["-h", "127.0.0.1", "-p", &node.port.to_string()])
                    .args(["-i", &unique_id(&format!("churn{batch}-{i}"))])
                    .args(["-t", "churn/x", "-m", "y"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .expect("mosquitto_pub")
            })
            .collect();
        for child in children {
            let out = child.wait_with_output().expect("wait");
            if !out.status.success() {
                failures.push(String::from_utf8_lossy(&out.stderr).trim().to_owned());
            }
        }
    }
    // A finished connection's late clean-up must never end a newer one (rumqttd 0.20 recycled
    // router connection ids, and a late Disconnect hit the connection that got the id).
    assert!(
        failures.is_empty(),
        "{} of 300 well-behaved short-lived clients were dropped: {:?}",
        failures.len(),
        failures.first()
    );
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "300 short-lived clients took {:?}",
        started.elapsed()
    );
}
