//! The broker layer as standard clients meet it: keep-alive 0, MQTT 5 shared subscriptions and
//! request/response, and a QoS 1 subscriber that stops reading during a burst larger than its
//! filter's log (cut off with an error code, never handed a gap, whole again after a re-list).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{unique_id, wait_until, Client, Node, Options, WAIT};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::{json, Value};

// ---- keep-alive 0 ---------------------------------------------------------------------------

/// An MQTT string: two-byte length, then the bytes.
fn mqtt_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

/// A CONNECT with keep-alive 0 and a clean session, for protocol level 4 (3.1.1) or 5.
fn connect_keep_alive_zero(level: u8, client_id: &str) -> Vec<u8> {
    let mut body = mqtt_string("MQTT");
    body.push(level);
    body.push(0x02); // clean session / clean start
    body.extend_from_slice(&[0, 0]); // keep-alive 0
    if level == 5 {
        body.push(0); // no properties
    }
    body.extend_from_slice(&mqtt_string(client_id));
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend(body);
    packet
}

/// Reads one whole MQTT packet (short packets only: one-byte remaining length).
fn read_packet(stream: &mut TcpStream) -> Vec<u8> {
    let mut header = [0_u8; 2];
    stream
        .read_exact(&mut header)
        .expect("a packet from the node, not a closed socket");
    let mut body = vec![0_u8; usize::from(header[1])];
    stream.read_exact(&mut body).expect("the packet's body");
    [header.to_vec(), body].concat()
}

fn open(port: u16) -> TcpStream {
    let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream.set_read_timeout(Some(WAIT)).expect("timeout");
    stream
}

#[tokio::test]
async fn a_311_client_with_keep_alive_0_is_accepted_and_served() {
    let node = Node::start().await;
    let mut stream = open(node.port);
    stream
        .write_all(&connect_keep_alive_zero(4, &unique_id("ka0")))
        .expect("CONNECT");
    assert_eq!(
        read_packet(&mut stream),
        [0x20, 0x02, 0x00, 0x00],
        "CONNACK accepted"
    );
    stream.write_all(&[0xC0, 0x00]).expect("PINGREQ");
    assert_eq!(read_packet(&mut stream), [0xD0, 0x00], "PINGRESP");

    // The session works: a QoS 1 insert is acknowledged and stored.
    let mut publish = mqtt_string("ke/meta/edgecontroller/insert/default/configmap/ka0");
    publish.extend_from_slice(&[0x00, 0x01]); // packet id 1
    publish.extend_from_slice(br#"{"metadata":{"name":"ka0"}}"#);
    let mut packet = vec![0x32, publish.len() as u8];
    packet.extend(publish);
    stream.write_all(&packet).expect("PUBLISH");
    assert_eq!(read_packet(&mut stream), [0x40, 0x02, 0x00, 0x01], "PUBACK");
    wait_until("the keep-alive 0 publish stored", WAIT, || async {
        node.stored("default/configmap/ka0").await.is_some()
    })
    .await;
}

#[tokio::test]
async fn a_v5_client_with_keep_alive_0_is_accepted_and_not_held_to_another_keep_alive() {
    let node = Node::start_with(Options {
        v5: true,
        ..Options::default()
    })
    .await;
    let mut stream = open(node.v5_port.expect("v5 listener"));
    stream
        .write_all(&connect_keep_alive_zero(5, &unique_id("ka0")))
        .expect("CONNECT");
    let connack = read_packet(&mut stream);
    assert_eq!(connack[0], 0x20, "CONNACK: {connack:02x?}");
    assert_eq!(connack[3], 0x00, "reason code success: {connack:02x?}");
    // Keep-alive 0 turns the mechanism off (MQTT 5.0 §3.1.2.10): no Server Keep Alive
    // (property 0x13) overrides it.
    assert!(
        !connack.windows(1).any(|w| w == [0x13]),
        "a Server Keep Alive in {connack:02x?}"
    );
    stream.write_all(&[0xC0, 0x00]).expect("PINGREQ");
    assert_eq!(read_packet(&mut stream), [0xD0, 0x00], "PINGRESP");
}

// ---- MQTT 5 ---------------------------------------------------------------------------------

mod v5 {
    use super::*;
    use rumqttc::v5::mqttbytes::v5::{Packet, PublishProperties};
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{AsyncClient, Event, EventLoop, MqttOptions};
    use tokio::sync::mpsc;

    /// A v5 client whose received publishes (topic, payload, properties) arrive on a channel.
    pub struct V5 {
        pub client: AsyncClient,
        pub rx: mpsc::UnboundedReceiver<(String, Vec<u8>, Option<PublishProperties>)>,
        subacks: mpsc::UnboundedReceiver<()>,
        task: tokio::task::JoinHandle<()>,
    }

    impl V5 {
        pub async fn connect(port: u16) -> V5 {
            let (client, events) =
                AsyncClient::new(MqttOptions::new(unique_id("v5"), "127.0.0.1", port), 100);
            let (tx, rx) = mpsc::unbounded_channel();
            let (sub_tx, subacks) = mpsc::unbounded_channel();
            let task = tokio::spawn(drive(events, tx, sub_tx));
            V5 {
                client,
                rx,
                subacks,
                task,
            }
        }

        pub async fn subscribe(&mut self, filter: &str) {
            let sent = self.client.subscribe(filter, QoS::AtLeastOnce);
            common::acknowledged(sent, &mut self.subacks, "SUBSCRIBE").await;
        }

        pub async fn next(&mut self) -> (String, Vec<u8>, Option<PublishProperties>) {
            tokio::time::timeout(WAIT, self.rx.recv())
                .await
                .expect("a message within the wait")
                .expect("event loop alive")
        }
    }

    impl Drop for V5 {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn drive(
        mut events: EventLoop,
        tx: mpsc::UnboundedSender<(String, Vec<u8>, Option<PublishProperties>)>,
        subacks: mpsc::UnboundedSender<()>,
    ) {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::Publish(p))) => {
                    let topic = String::from_utf8_lossy(&p.topic).into_owned();
                    let _ = tx.send((topic, p.payload.to_vec(), p.properties));
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    let _ = subacks.send(());
                }
                Ok(_) => {}
                Err(e) => panic!("v5 connection failed: {e}"),
            }
        }
    }
}

/// Two v5 members of the shared subscription `shared` on a fresh node, `payloads` published at
/// QoS 1 to `topic`: what each member got once as many arrived, and whether anything arrived
/// after that within [`common::QUIET`].
async fn shared_group(
    shared: &str,
    topic: &str,
    payloads: Vec<String>,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>, Option<String>) {
    let node = Node::start_with(Options {
        v5: true,
        ..Options::default()
    })
    .await;
    let port = node.v5_port.expect("v5 listener");
    let mut first = v5::V5::connect(port).await;
    let mut second = v5::V5::connect(port).await;
    first.subscribe(shared).await;
    second.subscribe(shared).await;
    let publisher = v5::V5::connect(port).await;
    let count = payloads.len();
    for payload in payloads {
        publisher
            .client
            .publish(
                topic,
                rumqttc::v5::mqttbytes::QoS::AtLeastOnce,
                false,
                payload,
            )
            .await
            .expect("publish");
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    while a.len() + b.len() < count {
        tokio::select! {
            m = first.next() => a.push(m.1),
            m = second.next() => b.push(m.1),
        }
    }
    let late = tokio::time::timeout(common::QUIET, async {
        tokio::select! { m = first.next() => m, m = second.next() => m }
    })
    .await;
    (a, b, late.ok().map(|m| format!("{m:?}")))
}

#[tokio::test]
async fn a_v5_shared_subscription_gives_each_message_to_one_member() {
    let topic = format!("jobs/{}", unique_id("q"));
    let jobs = (0..10).map(|i| format!("job-{i}")).collect();
    let (a, b, late) = shared_group(&format!("$share/workers/{topic}"), &topic, jobs).await;
    let (served_a, served_b) = (a.len(), b.len());
    let mut got: Vec<Vec<u8>> = a.into_iter().chain(b).collect();
    got.sort();
    let mut want: Vec<Vec<u8>> = (0..10).map(|i| format!("job-{i}").into_bytes()).collect();
    want.sort();
    assert_eq!(got, want, "every job exactly once across the group");
    assert!(
        served_a > 0 && served_b > 0,
        "both members served: {served_a} and {served_b}"
    );
    assert!(late.is_none(), "a job was delivered twice: {late:?}");
}

/// The node's own hand-ons to a shared group (here edged's topics) take turns among its
/// members as a client's publishes do; each once went to the same member.
#[tokio::test]
async fn the_nodes_hand_ons_take_turns_in_a_shared_subscription() {
    let pods = (0..10)
        .map(|i| format!(r#"{{"metadata":{{"name":"p{i}"}}}}"#))
        .collect();
    let (a, b, late) = shared_group(
        "$share/edged/ke/edged/#",
        "ke/meta/edgecontroller/insert/default/pod",
        pods,
    )
    .await;
    assert_eq!((a.len(), b.len()), (5, 5), "the members take turns");
    assert!(late.is_none(), "a hand-on was delivered twice: {late:?}");
}

#[tokio::test]
async fn v5_request_response_properties_pass_through_the_node() {
    use rumqttc::v5::mqttbytes::v5::PublishProperties;
    use rumqttc::v5::mqttbytes::QoS;
    let node = Node::start_with(Options {
        v5: true,
        ..Options::default()
    })
    .await;
    let port = node.v5_port.expect("v5 listener");
    let request_topic = format!("svc/{}/request", unique_id("rr"));
    let reply_topic = format!("svc/{}/reply", unique_id("rr"));
    let mut requester = v5::V5::connect(port).await;
    let mut responder = v5::V5::connect(port).await;
    requester.subscribe(&reply_topic).await;
    responder.subscribe(&request_topic).await;
    let asked = PublishProperties {
        response_topic: Some(reply_topic.clone()),
        correlation_data: Some(bytes::Bytes::from_static(b"corr-7")),
        ..PublishProperties::default()
    };
    requester
        .client
        .publish_with_properties(&request_topic, QoS::AtLeastOnce, false, "ask", asked)
        .await
        .expect("request");
    let (topic, payload, properties) = responder.next().await;
    assert_eq!(
        (topic.as_str(), payload.as_slice()),
        (request_topic.as_str(), &b"ask"[..])
    );
    let properties = properties.expect("request properties");
    assert_eq!(
        properties.response_topic.as_deref(),
        Some(reply_topic.as_str())
    );
    let correlation = properties.correlation_data.expect("correlation data");
    assert_eq!(&correlation[..], b"corr-7");
    let answer = PublishProperties {
        correlation_data: Some(correlation),
        ..PublishProperties::default()
    };
    responder
        .client
        .publish_with_properties(&reply_topic, QoS::AtLeastOnce, false, "answer", answer)
        .await
        .expect("response");
    let (topic, payload, properties) = requester.next().await;
    assert_eq!(
        (topic.as_str(), payload.as_slice()),
        (reply_topic.as_str(), &b"answer"[..])
    );
    let correlation = properties.and_then(|p| p.correlation_data);
    assert_eq!(correlation.as_deref(), Some(&b"corr-7"[..]));
}

// ---- a subscriber that lags ------------------------------------------------------------------

/// The pod a hand-on to edged is about, from its envelope.
fn pod_name(payload: &[u8]) -> String {
    let body: Value = serde_json::from_slice(payload).expect("JSON hand-on");
    let resource = body["route"]["resource"].as_str().expect("route.resource");
    resource.rsplit('/').next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_stalled_qos1_subscriber_is_cut_off_with_an_error_code_never_handed_a_gap() {
    const PODS: usize = 600;
    // A queue of 64 KiB per session: a reader that stops with its queue full is cut off once
    // it has taken nothing for 2 s (the burst ends before the store's bound is reached).
    let node = Node::start_with(Options {
        broker_yaml: "  queue_bytes: 65536\n  subscriber_stall_s: 2\n".into(),
        max_payload_bytes: 1024 * 1024,
        max_packet_bytes: 8 * 1024 * 1024,
        ..Options::default()
    })
    .await;

    // edged subscribes at QoS 1, then stops reading its socket (its event loop is not polled).
    let edged_id = unique_id("edged");
    let mut options = MqttOptions::new(&edged_id, "127.0.0.1", node.port);
    options.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
    options.set_keep_alive(Duration::from_secs(60));
    options.set_clean_session(false);
    let (edged, mut events) = AsyncClient::new(options, 100);
    edged
        .subscribe("ke/edged/#", QoS::AtLeastOnce)
        .await
        .expect("subscribe");
    tokio::time::timeout(WAIT, async {
        loop {
            if let Event::Incoming(Packet::SubAck(_)) = events.poll().await.expect("connection") {
                return;
            }
        }
    })
    .await
    .expect("SUBACK within the wait");

    // The cloud sends a burst: 600 pods of ~6 KiB, far more than the subscriber's queue and
    // its 100 unacknowledged deliveries.
    let cloud = node.client().await;
    let pad = "x".repeat(6_000);
    let names: Vec<String> = (0..PODS).map(|i| format!("p{i:04}")).collect();
    for name in &names {
        cloud
            .publish(
                &format!("ke/meta/edgecontroller/insert/default/pod/{name}"),
                json!({"metadata": {"name": name}, "pad": pad}).to_string(),
            )
            .await;
    }
    wait_until("the burst stored", Duration::from_secs(60), || async {
        let rows = node.meta_rows().await.len();
        if rows >= PODS {
            Ok(())
        } else {
            Err(format!("{rows} rows\n{}", node.log()))
        }
    })
    .await;
    let cut = node.await_log("EM-BROKER-SUBSCRIBER-LAG").await;
    assert!(cut.contains(&edged_id), "the cut names the client: {cut}");
    assert!(cut.contains("stopped reading"), "the cut says why: {cut}");

    // edged reads again: what it gets is the burst's beginning, in order, then the connection
    // ends; nothing after a gap.
    let mut received = Vec::new();
    tokio::time::timeout(WAIT, async {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::Publish(p))) => received.push(pod_name(&p.payload)),
                Ok(_) => {}
                Err(_) => return,
            }
        }
    })
    .await
    .expect("the connection ends after what was written before the cut");
    assert!(
        received.len() < PODS,
        "the stalled subscriber was not cut off"
    );
    assert_eq!(
        received[..],
        names[..received.len()],
        "a gap was handed to the subscriber"
    );

    // It reconnects asking for its persistent session, and is told there is none: the messages
    // it missed are gone from the broker, so it must resync.
    let ack = tokio::time::timeout(WAIT, async {
        loop {
            match events.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => return ack,
                Ok(_) => {}
                // pacing: rumqttc reconnects on the next poll; don't spin meanwhile.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("reconnected");
    assert!(!ack.session_present, "a session past the gap was resumed");
    drop(edged);

    // It lists its pods, and has every one of them.
    let mut relisted = Client::connect(node.port, &unique_id("edged")).await;
    relisted.subscribe("ke/edged/meta/response/#").await;
    let asked = common::send(&relisted, "edged", "query", "default/pod", json!(null)).await;
    let answer = relisted
        .expect_reply("ke/edged/meta/response/default/pod", &asked)
        .await;
    let listed: Vec<String> = answer
        .content()
        .as_array()
        .expect("a list")
        .iter()
        .map(|doc| {
            let doc: Value = serde_json::from_str(doc.as_str().expect("a JSON string"))
                .expect("a stored document");
            doc["metadata"]["name"].as_str().expect("name").to_owned()
        })
        .collect();
    let mut listed_sorted = listed.clone();
    listed_sorted.sort();
    assert_eq!(listed_sorted, names, "the re-list misses pods");
}

/// A session away sent far more than its queue holds keeps the first of it, in order; every
/// message it could not keep is counted in `/metrics`, and the log says so in a line or two,
/// not a line per message (a publisher must not be able to fill the node's log).
#[tokio::test]
async fn a_session_away_sent_ten_times_its_queue_keeps_the_first_and_logs_its_drops_in_a_line_or_two(
) {
    const SENT: usize = 2_000;
    // 4 KiB a session: 2,000 messages of ~40 bytes are about ten times that.
    let node = Node::start_with(Options {
        broker_yaml: "  queue_bytes: 4096\n".into(),
        ..Options::default()
    })
    .await;
    let dropped_before = away_dropped(&node).await;
    let (topic, base) = gone_away(&node).await;
    let base: Vec<&str> = base.iter().map(String::as_str).collect();

    // The publisher hears its own messages: once the last is back, each was routed.
    let mut publisher = node.client().await;
    publisher.subscribe(&topic).await;
    for n in 0..SENT {
        publisher.publish(&topic, format!("{n:0>32}")).await;
    }
    let last = format!("{:0>32}", SENT - 1);
    while publisher.next().await.payload != last.as_bytes() {}
    // What it kept arrives at once on its return; -W ends the wait for more.
    let got = mosquitto_sub_lines(&[&base[..], &["-c", "-W", "3"]].concat()).await;
    let kept = got.len();
    assert!(
        (1..SENT / 5).contains(&kept),
        "a 4 KiB queue keeps some of {SENT}, not all: {kept}"
    );
    let wanted: Vec<String> = (0..kept).map(|n| format!("{n:0>32}")).collect();
    assert_eq!(got, wanted, "the first ones, in order");
    assert_eq!(
        away_dropped(&node).await - dropped_before,
        (SENT - kept) as u64,
        "every message not kept is counted"
    );
    let line = node.await_log("EM-BROKER-QUEUE-FULL").await;
    assert!(line.contains("dropped="), "{line}");
    let lines = node.log().matches("EM-BROKER-QUEUE-FULL").count();
    assert!(
        lines <= 2,
        "{} drops logged in {lines} lines, not one each",
        SENT - kept
    );
}

/// The node's `edgemeta_broker_sessions` now.
async fn sessions_held(node: &Node) -> u64 {
    metric(node, "edgemeta_broker_sessions").await
}

/// The node's `edgemeta_broker_away_dropped_total` now.
async fn away_dropped(node: &Node) -> u64 {
    metric(node, "edgemeta_broker_away_dropped_total").await
}

/// An unlabelled metric of the node's `/metrics` now.
async fn metric(node: &Node, name: &str) -> u64 {
    let (status, body) = common::http_get(node.observe_port, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map_or_else(|| panic!("no {name} in:\n{body}"), |v| v as u64)
}

/// A device's MQTT 5 session (`mosquitto_sub -V 5 -x 60`) that subscribed to a topic of its
/// own and left once acknowledged (`-E`): the topic, and the arguments that bring it back.
async fn gone_away(node: &Node) -> (String, Vec<String>) {
    let id = unique_id("sleepy");
    let topic = format!("sleepy/{id}");
    let port = node.port.to_string();
    let base: Vec<String> = [
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-V",
        "5",
        "-q",
        "1",
        "-i",
        &id,
        "-t",
        &topic,
        "-x",
        "60",
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let first: Vec<&str> = base.iter().map(String::as_str).chain(["-E"]).collect();
    let (status, _) = common::MosquittoSub::start(&first).await.output().await;
    assert!(status.success(), "the first connection ended cleanly");
    (topic, base)
}

/// What `mosquitto_sub` with `args` printed, a line a message, once it ended.
async fn mosquitto_sub_lines(args: &[&str]) -> Vec<String> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("mosquitto_sub")
            .args(&args)
            .output()
            .expect("mosquitto_sub is installed (scripts/test installs it)")
    })
    .await
    .expect("mosquitto_sub ran");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A device that starts each boot with a fresh session but keeps it while it sleeps (MQTT 5.0
/// §3.1.2.4 Clean Start 1, §3.1.2.11.2 Session Expiry Interval), with the command-line client:
/// `mosquitto_sub -V 5 -x 60` subscribes and leaves, 500 QoS 1 messages are published while it
/// is away, and `mosquitto_sub -V 5 -c -x 60` gets all 500, in order.
#[tokio::test]
async fn a_v5_session_with_an_expiry_keeps_what_was_published_while_its_client_was_away() {
    const AWAY: usize = 500;
    let node = Node::start().await;
    let held = sessions_held(&node).await;
    let (topic, base) = gone_away(&node).await;
    let base: Vec<&str> = base.iter().map(String::as_str).collect();
    assert_eq!(
        sessions_held(&node).await,
        held + 1,
        "the session is kept while away"
    );

    let publisher = node.client().await;
    for n in 0..AWAY {
        publisher.publish(&topic, n.to_string()).await;
    }
    let wait = WAIT.as_secs().to_string();
    let count = AWAY.to_string();
    // Run whole: what the kept session is owed arrives before its new SUBACK.
    let got = mosquitto_sub_lines(&[&base[..], &["-c", "-C", &count, "-W", &wait]].concat()).await;
    let wanted: Vec<String> = (0..AWAY).map(|n| n.to_string()).collect();
    assert_eq!(
        got, wanted,
        "everything published while it was away, in order"
    );
}
