//! Client-certificate listeners: the certificate's common name is the identity the ACL judges.
//! Certificates are made with `openssl` at test time; none are committed.

mod common;

use common::pki::Pki;
use common::{Node, Options, QUIET};
use serde_json::json;

/// A node with ACL on and a client-certificate listener; anonymous plain-TCP clients may watch
/// everything (so the test can see what gets through) but publish only as devices.
async fn node(pki: &Pki) -> (Node, u16) {
    let port = common::free_port();
    let node = Node::start_with(Options {
        extra_listeners: format!(
            "    certs:\n      address: 127.0.0.1:{port}\n      tls:\n        cert_file: {}\n        key_file: {}\n        client_ca_file: {}\n",
            pki.path("server.pem").display(),
            pki.path("server.key").display(),
            pki.path("ca.pem").display(),
        ),
        broker_yaml: "  acl:\n    enabled: true\n    rules:\n      - identity: anonymous\n        subscribe: ['ke/#', 'site/#']\n      - identity: 'sensor-*'\n        publish: ['site/%u/#']\n".to_owned(),
        ..Options::default()
    })
    .await;
    (node, port)
}

#[tokio::test]
async fn a_certificate_gets_the_rights_of_its_name_and_a_device_cannot_pose_as_a_module() {
    let pki = Pki::new();
    let device = pki.client("device1", "ca");
    let edged = pki.client("edged", "ca");
    let (node, port) = node(&pki).await;
    let mut watch = node.client().await;
    watch.subscribe("ke/#").await;

    // Permitted: a device reports under ke/meta/device/..., edged under ke/meta/edged/...
    for (cert, from, operation, resource, content) in [
        (
            &device,
            "device",
            "insert",
            "default/sensor/t1",
            r#"{"celsius":21}"#,
        ),
        (
            &edged,
            "edged",
            "update",
            "default/podstatus/web",
            r#"{"phase":"Running"}"#,
        ),
    ] {
        let topic = format!("ke/meta/{from}/{operation}/{resource}");
        let (ok, stderr) = pki.tls_pub(port, "ca", Some(cert), &["-t", &topic, "-m", content]);
        assert!(ok, "{from}: {stderr}");
        let reply = watch
            .expect_about(&format!("ke/{from}/meta/response"), resource)
            .await;
        assert_eq!(reply.content(), json!("OK"), "{from}");
        assert_eq!(node.stored(resource).await.as_deref(), Some(content));
    }

    // Refused: 40 attempts to speak as the cloud or as edged; none may reach the store or edged.
    let before = node.meta_rows().await;
    let mut attempts = 0;
    for i in 0..20 {
        for topic in [
            format!("ke/meta/edgecontroller/insert/default/pod/evil{i}"),
            format!("ke/meta/edged/update/default/podstatus/evil{i}"),
        ] {
            pki.tls_pub(port, "ca", Some(&device), &["-t", &topic, "-m", "{}"]);
            attempts += 1;
        }
    }
    let seen = watch.drain(QUIET).await;
    // Since v2 a forged name would travel in the payload's route, not in the topic.
    let through: Vec<&String> = seen
        .iter()
        .filter(|m| {
            m.topic.contains("evil") || String::from_utf8_lossy(&m.payload).contains("evil")
        })
        .map(|m| &m.topic)
        .collect();
    assert!(
        through.is_empty(),
        "{} of {attempts} got through: {through:?}",
        through.len()
    );
    assert_eq!(node.meta_rows().await, before);
    assert!(node.log().contains("EM-ACL-PUBLISH-DENIED"));
}

#[tokio::test]
async fn no_certificate_or_a_foreign_one_is_refused() {
    let pki = Pki::new();
    pki.authority("rogue");
    let forged = pki.client("edged", "rogue");
    let (node, port) = node(&pki).await;

    for cert in [None, Some(forged.as_str())] {
        let (ok, _) = pki.tls_pub(
            port,
            "ca",
            cert,
            &["-t", "ke/meta/edged/update/default/podstatus/x", "-m", "{}"],
        );
        assert!(!ok, "{cert:?} was let in");
    }

    assert!(node.meta_rows().await.is_empty());
}

#[tokio::test]
async fn acl_rules_match_the_certificate_name() {
    let pki = Pki::new();
    let sensor = pki.client("sensor-7", "ca");
    let device = pki.client("device1", "ca");
    let (node, port) = node(&pki).await;
    let mut watch = node.client().await;
    watch.subscribe("site/#").await;
    // The rule for `sensor-*` lets sensor-7 publish under its own name (%u) only.
    for (cert, topic) in [
        (&sensor, "site/sensor-7/temp"),
        (&sensor, "site/sensor-8/temp"),
        (&device, "site/device1/temp"),
    ] {
        pki.tls_pub(port, "ca", Some(cert), &["-t", topic, "-m", "21"]);
    }
    let seen = watch.drain_topics(QUIET).await;
    assert_eq!(seen, ["site/sensor-7/temp"]);
}
