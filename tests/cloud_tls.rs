//! The cloud bridge over TLS (`mqtts://`) to a real mosquitto TLS listener that requires a client
//! certificate; every certificate is made by openssl at test time.

mod common;

use std::path::Path;

use common::cloud::{await_log, cloud_client, cloud_insert, expect_applied, SUBSCRIBED};
use common::pki::Pki;
use common::{run_expecting_exit, wait_until, CloudBroker, CloudOptions, Node, Options, WAIT};
use serde_json::json;

/// The TLS listener: the server certificate for `localhost` and the CA that client certificates
/// must come from (`client-ca.pem`, replaced by the rotation test), copied where mosquitto, which
/// drops root, can read them.
fn tls_listener(pki: &Pki) -> impl FnOnce(&Path) -> String + '_ {
    move |dir| {
        for (from, to) in [
            ("ca.pem", "client-ca.pem"),
            ("server.pem", "server.pem"),
            ("server.key", "server.key"),
        ] {
            copy_readable(&pki.path(from), &dir.join(to));
        }
        format!(
            "cafile {0}/client-ca.pem\ncertfile {0}/server.pem\nkeyfile {0}/server.key\nrequire_certificate true\nuse_identity_as_username true\n",
            dir.display()
        )
    }
}

fn copy_readable(from: &Path, to: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::copy(from, to).expect("copy a PEM file");
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o644)).expect("chmod");
}

/// `cloud.tls` lines for the node, with the client certificate `<client>.pem` / `.key`.
fn tls_yaml(ca: &Path, client: Option<(&Path, &Path)>, extra: &str) -> String {
    let mut yaml = format!("  tls:\n    ca_file: {}\n", ca.display());
    if let Some((cert, key)) = client {
        yaml += &format!(
            "    cert_file: {}\n    key_file: {}\n",
            cert.display(),
            key.display()
        );
    }
    yaml + extra
}

/// A node bridged over TLS to `cloud` at `host`, with `tls` as its `cloud.tls` lines.
async fn tls_node(cloud: &CloudBroker, host: &str, tls: String) -> (Node, CloudOptions) {
    let bridge = CloudOptions::to(cloud);
    let port = cloud.tls_port.expect("a TLS listener");
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        cloud_url: Some(format!("mqtts://{host}:{port}")),
        cloud_yaml: tls,
        ..Options::default()
    })
    .await;
    (node, bridge)
}

/// mosquitto's line for a client that connected, authenticated as certificate name `cn`.
fn connected_as(cloud: &CloudBroker, cn: &str) -> bool {
    cloud.log().contains(&format!("u'{cn}'"))
}

#[tokio::test]
async fn mutual_tls_carries_both_ways_across_an_outage_and_picks_up_a_rotated_certificate() {
    let pki = Pki::new();
    let node_cert = pki.client("node-a", "ca");
    let mut cloud = CloudBroker::start_tls(tls_listener(&pki)).await;
    // The node's certificate files, in a place the test rotates later.
    let keys = tempfile::tempdir().expect("temp dir");
    let (cert, key) = (keys.path().join("node.pem"), keys.path().join("node.key"));
    std::fs::copy(pki.path(&format!("{node_cert}.pem")), &cert).expect("cert");
    std::fs::copy(pki.path(&format!("{node_cert}.key")), &key).expect("key");
    let (node, bridge) = tls_node(
        &cloud,
        "localhost",
        tls_yaml(&pki.path("ca.pem"), Some((&cert, &key)), ""),
    )
    .await;
    let mut controller = cloud_client(&cloud, &bridge.up_filter()).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;

    // Down: the cloud's insert is applied and answered up, over TLS.
    await_log(&node, SUBSCRIBED).await;
    let id = cloud_insert(&controller, &bridge, "default/pod/a", json!({"v": 1})).await;
    expect_applied(
        &mut controller,
        &bridge,
        &node,
        "default/pod/a",
        &id,
        r#"{"v":1}"#,
    )
    .await;
    assert!(connected_as(&cloud, "node-a"), "{}", cloud.log());
    // Up: what edged reports locally reaches the cloud.
    edged
        .publish(
            "ke/meta/edged/update/default/podstatus/a",
            common::envelope(
                "edged",
                "update",
                "default/podstatus/a",
                json!({"phase": "Running"}),
            )
            .1,
        )
        .await;
    controller
        .expect_about(&bridge.up("edged/update"), "default/podstatus/a")
        .await;

    // An outage: the cloud goes away and comes back; the bridge reconnects over TLS.
    cloud.stop();
    cloud.restart().await;
    let id = cloud_insert(&controller, &bridge, "default/pod/b", json!({"v": 2})).await;
    expect_applied(
        &mut controller,
        &bridge,
        &node,
        "default/pod/b",
        &id,
        r#"{"v":2}"#,
    )
    .await;

    // Rotation: the cloud now trusts only a new client CA; the node's files are replaced on disk
    // and picked up at the next reconnect, with no restart of the node.
    pki.authority("ca2");
    let rotated = pki.client("node-b", "ca2");
    cloud.stop();
    copy_readable(&pki.path("ca2.pem"), &cloud.dir().join("client-ca.pem"));
    std::fs::copy(pki.path(&format!("{rotated}.pem")), &cert).expect("rotate cert");
    std::fs::copy(pki.path(&format!("{rotated}.key")), &key).expect("rotate key");
    cloud.restart().await;
    let id = cloud_insert(&controller, &bridge, "default/pod/c", json!({"v": 3})).await;
    expect_applied(
        &mut controller,
        &bridge,
        &node,
        "default/pod/c",
        &id,
        r#"{"v":3}"#,
    )
    .await;
    assert!(connected_as(&cloud, "node-b"), "{}", cloud.log());
}

/// Waits until the node's log has `wanted`, or fails with both logs.
async fn node_logs(node: &Node, cloud: &CloudBroker, wanted: &str) {
    wait_until(format_args!("{wanted:?} in the node's log"), WAIT, || {
        let log = node.log();
        std::future::ready(if log.contains(wanted) {
            Ok(())
        } else {
            Err(format!("{log}\ncloud:\n{}", cloud.log()))
        })
    })
    .await;
}

#[tokio::test]
async fn a_wrong_ca_an_expired_certificate_or_a_wrong_host_name_never_connect() {
    let pki = Pki::new();
    let good = pki.client("node-good", "ca");
    // An expired client certificate from the right CA.
    let expired = pki.client("node-expired", "ca");
    pki.openssl(&[
        "x509",
        "-req",
        "-in",
        &format!("{expired}.csr"),
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        &format!("{expired}.pem"),
        "-days",
        "-1",
        "-extfile",
        &format!("{expired}.ext"),
    ]);
    pki.authority("other");
    let cloud = CloudBroker::start_tls(tls_listener(&pki)).await;
    let pair = |stem: &str| {
        (
            pki.path(&format!("{stem}.pem")),
            pki.path(&format!("{stem}.key")),
        )
    };
    let (good_cert, good_key) = pair(&good);
    let (old_cert, old_key) = pair(&expired);

    let (wrong_ca, _) = tls_node(
        &cloud,
        "localhost",
        tls_yaml(&pki.path("other.pem"), Some((&good_cert, &good_key)), ""),
    )
    .await;
    let (expired_node, _) = tls_node(
        &cloud,
        "localhost",
        tls_yaml(&pki.path("ca.pem"), Some((&old_cert, &old_key)), ""),
    )
    .await;
    // The server certificate names localhost, not 127.0.0.1.
    let (wrong_host, _) = tls_node(
        &cloud,
        "127.0.0.1",
        tls_yaml(&pki.path("ca.pem"), Some((&good_cert, &good_key)), ""),
    )
    .await;

    node_logs(&wrong_ca, &cloud, "UnknownIssuer").await;
    node_logs(&wrong_host, &cloud, "certificate not valid for name").await;
    node_logs(&expired_node, &cloud, "EM-BRIDGE-CONNECT").await;
    for node in [&wrong_ca, &expired_node, &wrong_host] {
        assert!(node.log().contains("EM-BRIDGE-CONNECT"), "{}", node.log());
        assert!(!node.log().contains("cloud_connected"), "{}", node.log());
    }
    assert!(!connected_as(&cloud, "node-good"), "{}", cloud.log());
    assert!(!connected_as(&cloud, "node-expired"), "{}", cloud.log());
    assert!(
        cloud.log().contains("certificate verify failed"),
        "{}",
        cloud.log()
    );

    // The opt-out, for test rigs: the wrong host name is accepted, loudly.
    let (rig, _) = tls_node(
        &cloud,
        "127.0.0.1",
        tls_yaml(
            &pki.path("ca.pem"),
            Some((&good_cert, &good_key)),
            "    insecure_skip_hostname_check: true\n",
        ),
    )
    .await;
    node_logs(&rig, &cloud, "EM-BRIDGE-TLS-INSECURE").await;
    node_logs(&rig, &cloud, "cloud_connected").await;
}

/// Runs `edgemeta run` with a cloud over TLS configured by `tls` lines; it must refuse to start.
fn refused_start(tls: &str) -> String {
    let (status, text) = run_expecting_exit(
        &format!(
            "broker:\n  listeners:\n    mqtt:\n      address: 127.0.0.1:{}\nstore:\n  path: store.db\nobserve:\n  enabled: false\ncloud:\n  enabled: true\n  url: mqtts://localhost:8883\n{tls}",
            common::free_port()
        ),
        &[],
    );
    assert!(!status.success(), "{tls}");
    text
}

#[tokio::test]
async fn bad_certificate_files_stop_start_up_naming_the_file_and_the_fault() {
    let pki = Pki::new();
    let node = pki.client("node", "ca");
    let other = pki.client("other", "ca");
    let (ca, cert, key) = (
        pki.path("ca.pem"),
        pki.path(&format!("{node}.pem")),
        pki.path(&format!("{node}.key")),
    );
    let missing = pki.path("missing.key");
    let not_pem = pki.path("server.ext");
    let cases = [
        (
            tls_yaml(&ca, Some((&cert, &missing)), ""),
            format!("cloud.tls.key_file {}: cannot read", missing.display()),
        ),
        (
            tls_yaml(&not_pem, None, ""),
            format!(
                "cloud.tls.ca_file {}: no PEM certificate",
                not_pem.display()
            ),
        ),
        (
            tls_yaml(&ca, Some((&cert, &pki.path(&format!("{other}.key")))), ""),
            "does not fit cloud.tls.cert_file".to_owned(),
        ),
        (
            tls_yaml(&ca, Some((&key, &key)), ""),
            format!("cloud.tls.cert_file {}: no PEM certificate", key.display()),
        ),
        (
            format!(
                "  tls:\n    ca_file: {}\n    cert_file: {}\n",
                ca.display(),
                cert.display()
            ),
            "cloud.tls.cert_file is set but cloud.tls.key_file is not".to_owned(),
        ),
    ];
    for (tls, wanted) in cases {
        let stderr = refused_start(&tls);
        assert!(stderr.contains(&wanted), "want {wanted:?} in:\n{stderr}");
    }
}

#[tokio::test]
async fn the_readme_tls_section_connects_verbatim() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let run = readme
        .lines()
        .find(|l| l.starts_with("EDGEMETA_CLOUD__ENABLED=true EDGEMETA_CLOUD__URL=mqtts://"))
        .expect("the TLS run command in README");
    let pki = Pki::new();
    let node_cert = pki.client("edge-1", "ca");
    let cloud = CloudBroker::start_tls(tls_listener(&pki)).await;
    // The files the README names, in the node's working directory.
    let files = [
        ("ca.pem".to_owned(), "ca.pem"),
        (format!("{node_cert}.pem"), "edge-1.pem"),
        (format!("{node_cert}.key"), "edge-1.key"),
    ]
    .map(|(from, to)| (pki.path(&from), to.to_owned()))
    .to_vec();
    let tls_port = cloud.tls_port.expect("a TLS listener");
    let env: Vec<(String, String)> = run
        .split(' ')
        .take_while(|w| w.starts_with("EDGEMETA_"))
        .map(|w| {
            let (k, v) = w.split_once('=').expect("KEY=value");
            (k.to_owned(), v.replace(":8883", &format!(":{tls_port}")))
        })
        .collect();
    let mut node = Node::start_with(Options {
        env,
        files,
        ..Options::default()
    })
    .await;
    // The README's TLS settings connect.
    node_logs(&node, &cloud, "cloud_connected").await;
    node.kill9();
    assert!(connected_as(&cloud, "edge-1"), "{}", cloud.log());
}
