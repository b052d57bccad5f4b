//! Who may connect and what they may touch: passwords, a server-only TLS listener, the topic ACL
//! for password identities, and listeners that survive hostile client ids and connection floods.

mod common;

use common::pki::Pki;
use common::{mosquitto_pub, send, unique_id, Client, Node, Options, QUIET};
use serde_json::json;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

/// An argon2 hash made by `edgemeta passwd`, as an operator would.
fn hash(password: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_edgemeta"))
        .arg("passwd")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("edgemeta passwd");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("write password");
    let out = child.wait_with_output().expect("passwd output");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_owned()
}

/// Users `device1`, `edged` and `watcher` (who may read everything); no anonymous access.
async fn locked_node(acl: bool) -> Node {
    let users: String = ["device1", "edged", "watcher"]
        .iter()
        .map(|u| {
            format!(
                "      {u}: {{ password_hash: \"{}\" }}\n",
                hash(&format!("{u}-pw"))
            )
        })
        .collect();
    Node::start_with(Options {
        broker_yaml: format!(
            "  auth:\n    allow_anonymous: false\n    users:\n{users}  acl:\n    enabled: {acl}\n    rules:\n      - identity: watcher\n        subscribe: ['ke/#']\n"
        ),
        ..Options::default()
    })
    .await
}

async fn login(node: &Node, user: &str) -> Client {
    Client::connect_as(node.port, &unique_id(user), user, &format!("{user}-pw")).await
}

#[tokio::test]
async fn a_wrong_or_missing_password_is_refused_and_the_right_one_admitted() {
    let node = locked_node(false).await;
    let topic = ["-t", "ke/meta/device/insert/default/sensor/a", "-m", "{}"];
    let (ok, _) = mosquitto_pub(
        node.port,
        &[&["-u", "device1", "-P", "wrong"][..], &topic].concat(),
    );
    assert!(!ok, "a wrong password was admitted");
    let (ok, _) = mosquitto_pub(node.port, &topic);
    assert!(!ok, "an anonymous client was admitted");
    let (ok, _) = mosquitto_pub(
        node.port,
        &[&["-u", "nobody", "-P", "device1-pw"][..], &topic].concat(),
    );
    assert!(!ok, "an unknown user was admitted");
    assert!(node.meta_rows().await.is_empty());
    assert!(node.log().contains("EM-AUTH-REFUSED"));

    let (ok, stderr) = mosquitto_pub(
        node.port,
        &[
            &["-q", "1", "-u", "device1", "-P", "device1-pw"][..],
            &topic,
        ]
        .concat(),
    );
    assert!(ok, "{stderr}");
    let mut watcher = login(&node, "watcher").await;
    watcher.subscribe("ke/#").await;
    let id = send(&watcher, "device", "query", "default/sensor/a", json!(null)).await;
    watcher
        .expect_reply_about("ke/device/meta/response", "default/sensor/a", &id)
        .await;
}

#[tokio::test]
async fn a_tls_listener_serves_mosquitto_with_cafile_and_refuses_plain_tcp() {
    let pki = Pki::new();
    let tls_port = common::free_port();
    let node = Node::start_with(Options {
        extra_listeners: format!(
            "    mqtts:\n      address: 127.0.0.1:{tls_port}\n      tls:\n        cert_file: {}\n        key_file: {}\n",
            pki.path("server.pem").display(),
            pki.path("server.key").display(),
        ),
        ..Options::default()
    })
    .await;
    let out = Command::new("mosquitto_pub")
        .args([
            "-h",
            "localhost",
            "-p",
            &tls_port.to_string(),
            "-q",
            "1",
            "--cafile",
        ])
        .arg(pki.path("ca.pem"))
        .args([
            "-t",
            "ke/meta/edgecontroller/insert/default/pod/secure",
            "-m",
            r#"{"tls":true}"#,
        ])
        .output()
        .expect("mosquitto_pub");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, _) = mosquitto_pub(
        tls_port,
        &[
            "-t",
            "ke/meta/edgecontroller/insert/default/pod/plain",
            "-m",
            "{}",
        ],
    );
    assert!(!ok, "plain MQTT was served on the TLS port");
    // The insert over TLS is committed; the plain one never arrived.
    let mut waited = 0;
    while node.stored("default/pod/secure").await.is_none() && waited < 50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
    }
    assert_eq!(
        node.stored("default/pod/secure").await.as_deref(),
        Some(r#"{"tls":true}"#)
    );
    assert_eq!(node.stored("default/pod/plain").await, None);
}

#[tokio::test]
async fn a_device_cannot_act_as_the_cloud_or_edged_nor_read_their_topics() {
    const N: usize = 25;
    let node = locked_node(true).await;
    let mut watcher = login(&node, "watcher").await;
    watcher.subscribe("ke/#").await;
    let mut device = login(&node, "device1").await;
    // Refused subscriptions are answered with a failure code and deliver nothing.
    device.subscribe("ke/cloud/#").await;
    device.subscribe("ke/edged/#").await;
    device.subscribe("ke/device/#").await;

    for i in 0..N {
        device
            .publish(
                &format!("ke/meta/edgecontroller/insert/default/pod/evil{i}"),
                "{}",
            )
            .await;
        device
            .publish(
                &format!("ke/meta/edged/update/default/podstatus/evil{i}"),
                "{}",
            )
            .await;
    }
    // Real cloud-bound and edged-bound traffic happens meanwhile, from a real module.
    let edged = login(&node, "edged").await;
    for i in 0..N {
        send(
            &edged,
            "edged",
            "update",
            &format!("default/podstatus/real{i}"),
            json!({"i": i}),
        )
        .await;
    }
    // The permitted path still works for the device.
    let id = send(
        &device,
        "device",
        "insert",
        "default/sensor/t",
        json!({"c": 20}),
    )
    .await;

    let seen = watcher.drain(Duration::from_secs(2)).await;
    // Since v2 a forged name would travel in the payload's route, not in the topic.
    let evil = seen
        .iter()
        .filter(|m| {
            m.topic.contains("evil") || String::from_utf8_lossy(&m.payload).contains("evil")
        })
        .count();
    assert_eq!(evil, 0, "{evil} of {} forged messages got through", 2 * N);
    let cloud_bound = seen
        .iter()
        .filter(|m| m.topic.starts_with("ke/cloud/edged/update/"))
        .count();
    assert_eq!(cloud_bound, N, "the module's traffic flows");

    let got = device.drain(QUIET).await;
    assert!(
        got.iter().all(|m| m.topic.starts_with("ke/device/")),
        "the device read {:?}",
        got.iter().map(|m| &m.topic).collect::<Vec<_>>()
    );
    assert!(got
        .iter()
        .any(|m| m.parent_id().as_deref() == Some(id.as_str())));
    let keys: Vec<String> = node.meta_rows().await.into_iter().map(|r| r.0).collect();
    assert!(keys.iter().all(|k| !k.contains("evil")), "{keys:?}");
    assert!(keys.contains(&"default/sensor/t".to_owned()));
    let log = node.log();
    assert!(log.contains("EM-ACL-PUBLISH-DENIED") && log.contains("EM-ACL-SUBSCRIBE-DENIED"));
}

#[tokio::test]
async fn hostile_client_ids_and_a_connection_flood_leave_the_listener_serving() {
    let node = Node::start().await;
    for id in ["dev/1", "a+b", "#", "$SYS", "edgemeta-metamanager", "dev/1"] {
        let (ok, stderr) = mosquitto_pub(
            node.port,
            &[
                "-i",
                id,
                "-t",
                "ke/meta/device/insert/default/sensor/x",
                "-m",
                "{}",
            ],
        );
        assert!(!ok, "client id {id:?} was accepted");
        assert!(
            stderr.to_lowercase().contains("identifier rejected"),
            "{id}: {stderr}"
        );
    }
    // Two clients with one ordinary id: the second takes the session over, as MQTT says.
    let _first = Client::connect(node.port, "dev1").await;
    let _second = Client::connect(node.port, "dev1").await;

    // 300 connections that never send CONNECT, 100 that send garbage, 100 that come and go.
    let address = ("127.0.0.1", node.port);
    let mut idle = Vec::new();
    for _ in 0..300 {
        idle.push(std::net::TcpStream::connect(address).expect("connect"));
    }
    for _ in 0..100 {
        let mut s = std::net::TcpStream::connect(address).expect("connect");
        let _ = s.write_all(&[0xff, 0xff, 0xff, 0xff, 0x7f, 0x00, 0x13]);
    }
    for i in 0..100 {
        let _ = mosquitto_pub(
            node.port,
            &["-i", &format!("flood{i}"), "-t", "x", "-m", "y"],
        );
    }

    let mut client = node.client().await;
    client.subscribe("ke/device/meta/response/#").await;
    let id = send(
        &client,
        "device",
        "insert",
        "default/sensor/after",
        json!({"ok": true}),
    )
    .await;
    client
        .expect_reply_about("ke/device/meta/response", "default/sensor/after", &id)
        .await;
    assert_eq!(
        node.stored("default/sensor/after").await.as_deref(),
        Some(r#"{"ok":true}"#)
    );
    drop(idle);
}
