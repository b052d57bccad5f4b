//! MQTT 5 (and 3.1.1) rules a client we did not write relies on, each against the real binary:
//! paho-mqtt for Python and `mosquitto_pub/sub -V 5` where they exercise the rule, exact bytes
//! where only a hostile client would send them. docs/conformance.md lists each rule with its test.

mod common;

use std::process::Command;

use common::raw::{connect, packet, props, publish, string, subscribe, Raw};
use common::{mosquitto_pub, Node, Options, QUIET};

/// Runs a Python script (paho-mqtt 2) with the node's port as its argument; its stdout.
fn python(script: &str, port: u16) -> String {
    let out = Command::new("python3")
        .args(["-c", script, &port.to_string()])
        .output()
        .expect("python3 runs (scripts/test installs paho-mqtt)");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A clean-start MQTT 5 CONNECT for `id` with a will on `will_topic`.
fn connect_with_will(id: &str, will_topic: &str) -> Vec<u8> {
    let mut body = string(b"MQTT");
    body.extend_from_slice(&[5, 0b0000_0110, 0, 30, 0]);
    body.extend_from_slice(&string(id.as_bytes()));
    body.push(0);
    body.extend_from_slice(&string(will_topic.as_bytes()));
    body.extend_from_slice(&string(b"gone"));
    packet(0x10, &body)
}

const PAHO_DISCONNECT: &str = r#"
import sys, threading
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
port = int(sys.argv[1])
c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="paho-will", protocol=mqtt.MQTTv5)
c.will_set("gone/paho", "gone")
up = threading.Event()
c.on_connect = lambda *a: up.set()
c.connect("127.0.0.1", port)
c.loop_start()
assert up.wait(10), "no CONNACK"
c.disconnect()
c.loop_stop()
print("disconnected")
"#;

/// §3.14.2.1: a DISCONNECT may leave out its reason code (0x00) and properties; a normal
/// DISCONNECT discards the will [MQTT-3.1.2-10]. rumqttc's decoder refuses `E0 00` and
/// `E0 01 00`: the node read them as malformed and published the will.
#[tokio::test(flavor = "multi_thread")]
async fn a_normal_disconnect_in_its_short_forms_publishes_no_will() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("gone/#").await;
    let (ok, err) = mosquitto_pub(
        node.port,
        &[
            "-V",
            "5",
            "-i",
            "mosq-will",
            "--will-topic",
            "gone/mosquitto",
            "--will-payload",
            "gone",
            "-t",
            "plain/x",
            "-m",
            "hi",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(python(PAHO_DISCONNECT, node.port).trim(), "disconnected");
    for (n, bye) in [&[0xE0, 0x00][..], &[0xE0, 0x01, 0x00][..]]
        .iter()
        .enumerate()
    {
        let id = format!("short-{n}");
        let (mut raw, code) = Raw::connected(node.port, &connect_with_will(&id, "gone/raw")).await;
        assert_eq!(code, 0);
        raw.send(bye).await;
        assert!(raw.next().await.is_none(), "the node closes without a word");
    }
    // The control: "disconnect with will message" (0x04) does publish it.
    let (mut raw, _) =
        Raw::connected(node.port, &connect_with_will("control", "gone/control")).await;
    raw.send(&[0xE0, 0x01, 0x04]).await;
    let first = watcher.next().await;
    assert_eq!(
        first.topic, "gone/control",
        "only the control's will is published"
    );
}

const PAHO_TAKEOVER: &str = r#"
import sys, threading
import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
port, clean = int(sys.argv[1]), sys.argv[2] == "1"
def client():
    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="twin", protocol=mqtt.MQTTv5,
                    reconnect_on_failure=False)
    up, gone = threading.Event(), threading.Event()
    c.on_connect = lambda *a: up.set()
    def on_disconnect(client, userdata, flags, reason, properties):
        c.reason = reason.value
        gone.set()
    c.on_disconnect = on_disconnect
    c.connect("127.0.0.1", port, clean_start=clean)
    c.loop_start()
    assert up.wait(10), "no CONNACK"
    return c, gone
old, old_gone = client()
new, _ = client()
print(old.reason if old_gone.wait(10) else "still open")
new.disconnect()
"#;

/// [MQTT-3.1.4-3]: a CONNECT with a client id in use closes the other connection, Clean Start
/// 1 as well as 0; an MQTT 5 client is told 0x8E Session taken over.
#[tokio::test(flavor = "multi_thread")]
async fn a_take_over_closes_the_old_connection_with_0x8e_for_both_clean_start_values() {
    let node = Node::start().await;
    for clean in ["1", "0"] {
        let out = Command::new("python3")
            .args(["-c", PAHO_TAKEOVER, &node.port.to_string(), clean])
            .output()
            .expect("python3");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(stdout.trim(), "142", "clean start {clean}: {out:?}");
    }
}

/// [MQTT-4.3.3-10]: the packet ids awaiting PUBREL are the session's. A QoS 2 PUBLISH, its
/// PUBREC lost with the connection, the session resumed and the PUBLISH resent with DUP and the
/// same id: the subscriber (`mosquitto_sub -V 5`) gets it once.
#[tokio::test(flavor = "multi_thread")]
async fn a_qos_2_publish_resent_after_a_reconnect_is_delivered_once() {
    let node = Node::start().await;
    let sub = common::MosquittoSub::start(&[
        "-h",
        "127.0.0.1",
        "-p",
        &node.port.to_string(),
        "-V",
        "5",
        "-v",
        "-q",
        "2",
        "-t",
        "q2/#",
        "-C",
        "2",
        "-W",
        "10",
    ])
    .await;
    // Clean Start 0, Session Expiry Interval 60 s.
    let mut kept = string(b"MQTT");
    kept.extend_from_slice(&[5, 0, 0, 30]);
    kept.extend_from_slice(&props(&[0x11, 0, 0, 0, 60]));
    kept.extend_from_slice(&string(b"qos2-pub"));
    let kept = packet(0x10, &kept);
    let first = publish(true, b"q2/x", 2, b"first");
    let (mut raw, _) = Raw::connected(node.port, &kept).await;
    raw.send(&first).await;
    let pubrec = raw.next().await.expect("PUBREC");
    assert_eq!(pubrec.kind(), 5);
    drop(raw); // the PUBREC is lost with the connection
    let mut raw = Raw::open(node.port).await;
    raw.send(&kept).await;
    let connack = raw.next().await.expect("CONNACK");
    assert_eq!(connack.body[0], 1, "session present");
    let mut dup = first.clone();
    dup[0] |= 0x08;
    raw.send(&dup).await;
    let pubrec = raw.next().await.expect("PUBREC again");
    assert_eq!(pubrec.kind(), 5);
    raw.send(&packet(0x62, &[0, 1])).await;
    let pubcomp = raw.next().await.expect("PUBCOMP");
    assert_eq!(pubcomp.kind(), 7);
    raw.send(&publish(true, b"q2/x", 1, b"second")).await;
    let lines = common::sub_output(sub).await;
    // libmosquitto hands a QoS 2 message over at its PUBREL, so `second` may print first.
    let mut payloads: Vec<&str> = lines
        .iter()
        .map(|l| l.rsplit(' ').next().unwrap_or(""))
        .collect();
    payloads.sort_unstable();
    assert_eq!(payloads, ["first", "second"], "{lines:?}");
}

/// §1.5.4: an MQTT 5 topic that is not UTF-8 makes the PUBLISH malformed: DISCONNECT 0x81, no
/// PUBACK, nothing delivered (it was PUBACKed and forwarded with U+FFFD).
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_that_is_not_utf_8_closes_the_connection() {
    let node = Node::start().await;
    let mut watcher = node.client().await;
    watcher.subscribe("bad/#").await;
    for v5 in [true, false] {
        let (mut raw, _) = Raw::connected(node.port, &connect(v5, "bad", &props(&[]))).await;
        raw.send(&publish(v5, b"bad/\xff\xfe", 1, b"x")).await;
        raw.expect_closed(v5.then_some(0x81)).await;
    }
    assert!(
        watcher.next_within(QUIET).await.is_none(),
        "nothing delivered"
    );
}

/// §3.1.2.2: an unsupported protocol level gets CONNACK 0x84 (MQTT 5) or return code 1 (3.1.1),
/// then the close.
#[tokio::test(flavor = "multi_thread")]
async fn an_unsupported_protocol_level_is_answered_then_closed() {
    let node = Node::start().await;
    for (level, expected) in [(3u8, vec![0x20, 2, 0, 1]), (6, vec![0x20, 3, 0, 0x84, 0])] {
        let mut bytes = connect(false, "old", &[]);
        bytes[8] = level;
        let mut raw = Raw::open(node.port).await;
        raw.send(&bytes).await;
        let connack = raw.next().await.expect("CONNACK");
        let mut got = vec![connack.first, connack.body.len() as u8];
        got.extend_from_slice(&connack.body);
        assert_eq!(got, expected, "level {level}");
        assert!(raw.next().await.is_none(), "closed");
    }
}

/// §3.1.4 (3.1.1 and 5): a client may send packets right behind its CONNECT, before the
/// CONNACK; sent in one write with it, they are answered, in order, with nothing else sent.
#[tokio::test(flavor = "multi_thread")]
async fn packets_sent_in_the_same_write_as_the_connect_are_answered() {
    let node = Node::start().await;
    for v5 in [false, true] {
        let properties = if v5 { props(&[]) } else { Vec::new() };
        let mut bytes = connect(v5, &format!("eager{v5}"), &properties);
        bytes.extend_from_slice(&subscribe(v5, 7, b"eager/#"));
        bytes.extend_from_slice(&publish(v5, b"eager/t", 0, b"hello"));
        let mut raw = Raw::open(node.port).await;
        raw.send(&bytes).await;
        let connack = raw.next().await.expect("CONNACK");
        assert_eq!(connack.kind(), 2, "{connack:?}");
        let suback = raw.next().await.expect("SUBACK");
        assert_eq!(suback.kind(), 9, "v5 {v5}: {suback:?}");
        assert_eq!(&suback.body[..2], &[0, 7], "its packet id");
        let delivered = raw
            .next()
            .await
            .expect("the publish, to its own subscription");
        assert_eq!(delivered.kind(), 3, "v5 {v5}: {delivered:?}");
        assert!(delivered.body.ends_with(b"hello"));
    }
}

/// Malformed and protocol errors each get the reason code the spec names, then the close.
#[tokio::test(flavor = "multi_thread")]
async fn malformed_packets_and_protocol_errors_are_answered_as_the_spec_says() {
    let node = Node::start_with(Options {
        max_packet_bytes: 4096,
        ..Options::default()
    })
    .await;
    let port = node.port;
    // [MQTT-3.1.2-3]: the CONNECT flags' reserved bit set: closed, no CONNACK.
    let mut reserved = connect(true, "r", &props(&[]));
    reserved[9] |= 1;
    let mut raw = Raw::open(port).await;
    raw.send(&reserved).await;
    assert!(raw.next().await.is_none(), "closed without a CONNACK");
    // §3.1.2.11.3: Receive Maximum 0 is a Protocol Error: CONNACK 0x82.
    let zero = connect(true, "rm0", &props(&[0x21, 0, 0]));
    assert_eq!(Raw::connected(port, &zero).await.1, 0x82);
    // §2.2.2.2: a property given twice (Session Expiry Interval): CONNACK 0x82.
    let twice = connect(true, "dup", &props(&[0x11, 0, 0, 0, 1, 0x11, 0, 0, 0, 2]));
    assert_eq!(Raw::connected(port, &twice).await.1, 0x82);

    let cases: [(&str, Vec<u8>, Option<u8>); 6] = [
        // [MQTT-3.8.1-1]: SUBSCRIBE's fixed header flags must be 0010.
        (
            "reserved SUBSCRIBE flags",
            {
                let mut s = subscribe(true, 1, b"a/b");
                s[0] = 0x80;
                s
            },
            Some(0x81),
        ),
        // §1.5.4: U+0000 in a filter.
        ("NUL in a filter", subscribe(true, 1, b"a/\0"), Some(0x81)),
        // §3.8.2.1.2: Subscription Identifier 0.
        (
            "Subscription Identifier 0",
            {
                let mut body = vec![0, 1];
                body.extend_from_slice(&props(&[0x0B, 0]));
                body.extend_from_slice(&string(b"a/b"));
                body.push(1);
                packet(0x82, &body)
            },
            Some(0x82),
        ),
        // §2.2.2.2: Message Expiry Interval twice in a PUBLISH.
        (
            "a duplicate property",
            {
                let mut body = string(b"a/b");
                body.extend_from_slice(&props(&[0x02, 0, 0, 0, 9, 0x02, 0, 0, 0, 9]));
                packet(0x30, &body)
            },
            Some(0x82),
        ),
        // §3.3.1.2: QoS 3.
        (
            "QoS 3",
            {
                let mut p = publish(true, b"a/b", 1, b"x");
                p[0] |= 0b0110;
                p
            },
            Some(0x81),
        ),
        // Larger than the node's Maximum Packet Size: 0x95 Packet too large.
        (
            "an oversize packet",
            publish(true, b"a/b", 0, &[b'x'; 5000]),
            Some(0x95),
        ),
    ];
    for (what, bytes, reason) in cases {
        let (mut raw, code) = Raw::connected(port, &connect(true, "rules", &props(&[]))).await;
        assert_eq!(code, 0, "{what}");
        raw.send(&bytes).await;
        raw.expect_closed(reason).await;
    }
    // 3.1.1 clients are closed for the same packets (3.1.1 has no DISCONNECT from the server).
    let (mut raw, _) = Raw::connected(port, &connect(false, "rules4", &[])).await;
    let mut s = subscribe(false, 1, b"a/b");
    s[0] = 0x80;
    raw.send(&s).await;
    raw.expect_closed(None).await;
}
