//! Clients that try to bring the node down: topic filters and names as deep and as long as
//! MQTT carries, connections that never finish CONNECT, and wrong passwords in a storm. After
//! each, the node must still answer a query.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::raw::{connect, packet, props, publish, string, subscribe, unsubscribe, Raw};
use common::{auth_yaml, send, Node, Options};
use serde_json::json;

/// An insert acknowledged and a query answered with what it stored: the node serves.
async fn assert_answers_a_query(node: &Node, name: &str) {
    let resource = format!("default/configmap/{name}");
    let mut client = node.client().await;
    client.subscribe("ke/cloud/meta/response/#").await;
    client.subscribe("ke/edged/meta/response/#").await;
    let id = send(
        &client,
        "edgecontroller",
        "insert",
        &resource,
        json!({"n": name}),
    )
    .await;
    client
        .expect_reply_about("ke/cloud/meta/response", &resource, &id)
        .await;
    let id = send(&client, "edged", "query", &resource, json!(null)).await;
    let answer = client
        .expect_reply_about("ke/edged/meta/response", &resource, &id)
        .await;
    assert!(
        answer.content().to_string().contains(name),
        "query answer {}",
        answer.content()
    );
}

/// `+/+/…/+` with `levels` levels.
fn pluses(levels: usize) -> String {
    vec!["+"; levels].join("/")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_10_000_level_filter_is_refused_by_the_default_bound_and_the_node_serves_on() {
    let node = Node::start().await;
    // The command that aborted the node: a 10,000-level wildcard SUBSCRIBE, then exit.
    let out = Command::new("mosquitto_sub")
        .args(["-h", "127.0.0.1", "-p", &node.port.to_string()])
        .args(["-t", &pluses(10_000), "-W", "1"])
        .output()
        .expect("mosquitto_sub is installed");
    assert!(node.log().contains("EM-BROKER-TOPIC-BOUND"), "{out:?}");
    let deep = pluses(10_000);
    for v5 in [true, false] {
        let (mut raw, code) = Raw::connected(node.port, &connect(v5, "deep", &props(&[]))).await;
        assert_eq!(code, 0);
        raw.send(&subscribe(v5, 1, deep.as_bytes())).await;
        let suback = raw.next().await.expect("SUBACK");
        // MQTT 5: 0x8F Topic Filter invalid; 3.1.1: 0x80 Failure.
        let refused = if v5 { 0x8F } else { 0x80 };
        assert_eq!((suback.kind(), suback.body.last()), (9, Some(&refused)));
        raw.send(&unsubscribe(v5, 2, deep.as_bytes())).await;
        let unsuback = raw.next().await.expect("UNSUBACK");
        assert_eq!(unsuback.kind(), 11);
        if v5 {
            assert_eq!(unsuback.body.last(), Some(&0x8F));
        }
        // A topic past the bound ends the connection: MQTT 5 is told 0x90 Topic Name invalid.
        let topic = vec!["t"; 200].join("/");
        raw.send(&publish(v5, topic.as_bytes(), 1, b"x")).await;
        raw.expect_closed(v5.then_some(0x90)).await;
    }
    assert_answers_a_query(&node, "after-deep").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_bound_raised_the_deepest_filters_and_topics_mqtt_carries_are_routed_and_freed() {
    let node = Node::start_with(Options {
        broker_yaml: "  max_topic_levels: 1000000\n  max_topic_bytes: 65535\n".into(),
        ..Options::default()
    })
    .await;
    // A UTF-8 string holds at most 65,535 bytes: 32,768 levels of `+` and of `a`, and 65,535
    // empty levels under a `#`. (The index itself is tested at 100,000 levels in index.rs.)
    let levels = 32_768;
    let plus = pluses(levels);
    let topic = vec!["a"; levels].join("/");
    let hash = format!("{}#", "/".repeat(65_534));
    let empty_levels = "/".repeat(65_535);
    assert!(plus.len() <= 65_535 && topic.len() <= 65_535 && hash.len() <= 65_535);
    for v5 in [true, false] {
        let id = if v5 { "deep5" } else { "deep4" };
        let (mut raw, code) = Raw::connected(node.port, &connect(v5, id, &props(&[]))).await;
        assert_eq!(code, 0);
        raw.send(&subscribe(v5, 1, plus.as_bytes())).await;
        raw.send(&subscribe(v5, 2, hash.as_bytes())).await;
        for _ in 0..2 {
            let suback = raw.next().await.expect("SUBACK");
            assert_eq!((suback.kind(), suback.body.last()), (9, Some(&1)));
        }
        for t in [&topic, &empty_levels] {
            raw.send(&publish(v5, t.as_bytes(), 1, b"deep")).await;
            let mut delivered = false;
            let mut acked = false;
            while !(delivered && acked) {
                let frame = raw.next().await.expect("PUBLISH and PUBACK");
                match frame.kind() {
                    3 => {
                        let len = u16::from_be_bytes([frame.body[0], frame.body[1]]);
                        assert_eq!(usize::from(len), t.len());
                        delivered = true;
                        // QoS 1: acknowledge the delivery.
                        let pkid = &frame.body[2 + t.len()..4 + t.len()];
                        raw.send(&packet(0x40, pkid)).await;
                    }
                    4 => acked = true,
                    other => panic!("unexpected packet type {other}"),
                }
            }
        }
        raw.send(&unsubscribe(v5, 3, plus.as_bytes())).await;
        let unsuback = raw.next_not_publish().await.expect("UNSUBACK");
        assert_eq!(unsuback.kind(), 11);
        if v5 {
            assert_eq!(unsuback.body.last(), Some(&0), "the deep filter was held");
        }
        // The `#` filter goes with the connection (a clean session ends with it).
    }
    assert_answers_a_query(&node, "after-deepest").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn connections_that_never_send_connect_count_against_max_connections_and_time_out() {
    let node = Node::start_with(Options {
        broker_yaml: "  max_connections: 4\n  connect_timeout_ms: 1500\n".into(),
        ..Options::default()
    })
    .await;
    // Four silent connections take every place: the node counts each as it accepts it, so
    // they hold their places before the late client comes, whichever task runs first.
    let mut silent = Vec::new();
    for _ in 0..4 {
        silent.push(Raw::open(node.port).await);
    }
    let (mut refused, code) = Raw::connected(node.port, &connect(true, "late", &props(&[]))).await;
    assert_eq!(code, 0x97, "MQTT 5: Quota exceeded");
    assert!(refused.next().await.is_none(), "closed after the CONNACK");
    let (_, code) = Raw::connected(node.port, &connect(false, "late4", &[])).await;
    assert_eq!(code, 3, "3.1.1: server unavailable");
    // Past connect_timeout_ms the node closes them and gives their places back.
    let started = Instant::now();
    for raw in &mut silent {
        assert!(raw.next().await.is_none(), "closed unanswered");
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    let (_, code) = Raw::connected(node.port, &connect(true, "now", &props(&[]))).await;
    assert_eq!(code, 0);
}

/// A node with user `alice` (password `alice-pw`); anonymous clients too.
async fn node_with_users() -> Node {
    Node::start_with(Options {
        broker_yaml: auth_yaml(true, &["alice"]),
        ..Options::default()
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_passwords_are_held_off_while_a_known_client_logs_in() {
    let node = node_with_users().await;
    let port = node.port;
    // alice has logged in from here before.
    let (_, code) = Raw::connected(port, &login("alice", "alice", "alice-pw")).await;
    assert_eq!(code, 0);
    // 64 connections guess alice's password, 4 times each, at once.
    let storm: Vec<_> = (0..64)
        .map(|i| {
            tokio::spawn(async move {
                let mut codes = Vec::new();
                for _ in 0..4 {
                    let guess = login(&format!("g{i}"), "alice", "guess");
                    codes.push(Raw::connected(port, &guess).await.1);
                }
                codes
            })
        })
        .collect();
    for _ in 0..10 {
        let (_, code) = Raw::connected(port, &login("alice", "alice", "alice-pw")).await;
        assert_eq!(
            code, 0,
            "alice, who logged in before, is admitted during the storm"
        );
    }
    let mut codes = Vec::new();
    for guesser in storm {
        codes.extend(guesser.await.expect("guesser"));
    }
    // 0x86 Bad User Name or Password (checked), 0x89 Server busy (not checked).
    assert!(codes.iter().all(|&c| c == 0x86 || c == 0x89), "{codes:?}");
    let busy = codes.iter().filter(|&&c| c == 0x89).count();
    assert!(
        busy > codes.len() / 2,
        "most guesses are refused unchecked: {busy} of {}",
        codes.len()
    );
    assert!(node.log().contains("EM-AUTH-BUSY"));
    assert_answers_a_query(&node, "after-storm").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_address_is_held_off_and_another_address_is_not() {
    let node = Node::start_with(Options {
        broker_yaml: auth_yaml(true, &["alice", "bob"]),
        ..Options::default()
    })
    .await;
    let port = node.port;
    let guesser = std::net::Ipv4Addr::new(127, 0, 0, 2);
    // Three failures are free (`login.free_failures`); the fourth holds the address off 1 s.
    for i in 0..4 {
        let guess = login(&format!("g{i}"), "alice", "guess");
        let (_, code) = Raw::connected_from(port, guesser, &guess).await;
        assert_eq!(code, 0x86, "guess {i} is checked and refused");
    }
    // bob's right password from the guessing address is not even checked: 0x89 Server busy.
    let bob = login("bob", "bob", "bob-pw");
    let (_, code) = Raw::connected_from(port, guesser, &bob).await;
    assert_eq!(code, 0x89, "the guessing address is held off");
    // From another address, bob is checked and admitted: the hold is the guesser's address,
    // as the node accepted its connections, not every client's.
    let (_, code) = Raw::connected(port, &bob).await;
    assert_eq!(code, 0, "bob from 127.0.0.1 logs in");
    assert_answers_a_query(&node, "after-guesses").await;
}

/// A CONNECT (MQTT 5) with a username and password.
fn login(id: &str, user: &str, password: &str) -> Vec<u8> {
    let mut body = string(b"MQTT");
    body.push(5);
    body.push(0b1100_0010);
    body.extend_from_slice(&30u16.to_be_bytes());
    body.push(0);
    body.extend_from_slice(&string(id.as_bytes()));
    body.extend_from_slice(&string(user.as_bytes()));
    body.extend_from_slice(&string(password.as_bytes()));
    packet(0x10, &body)
}

/// `publish`, a raw PUBLISH to `t/big` sent by a new client `id`, reaches a subscriber with
/// its `payload_len` bytes.
async fn assert_delivered(node: &Node, publish: &[u8], payload_len: usize, id: &str) {
    let mut reader = node.client().await;
    reader.subscribe("t/big").await;
    let (mut writer, code) = Raw::connected(node.port, &connect(true, id, &props(&[]))).await;
    assert_eq!(code, 0);
    writer.send(publish).await;
    assert_eq!(reader.expect("t/big").await.payload.len(), payload_len);
}

/// A counter or gauge of the node's `/metrics` without labels (0 while it is absent).
async fn metric(node: &Node, name: &str) -> f64 {
    let (_, metrics) = common::http_get(node.observe_port, "/metrics").await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The node's resident memory, in bytes.
fn rss(node: &Node) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", node.pid())).expect("status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread")]
async fn clients_stopping_part_way_through_large_packets_hold_no_more_than_the_read_budget() {
    const PACKET: usize = 1024 * 1024;
    const BUDGET: u64 = 4 * 1024 * 1024;
    let node = Node::start_with(Options {
        max_packet_bytes: PACKET,
        broker_yaml: format!("  read_buffers_bytes: {BUDGET}\n"),
        ..Options::default()
    })
    .await;
    let before = rss(&node);
    // Forty clients, ten times what the budget carries, each stopping 1,000 bytes short of a
    // PUBLISH the size of the largest packet, and holding on.
    let whole = publish(true, b"t/big", 0, &vec![b'x'; PACKET - 64]);
    let mut clients = Vec::new();
    for i in 0..40 {
        let (mut raw, code) =
            Raw::connected(node.port, &connect(true, &format!("big{i}"), &props(&[]))).await;
        assert_eq!(code, 0);
        raw.send(&whole[..whole.len() - 1_000]).await;
        clients.push(raw);
    }
    // Those that found no room are closed, told 0x97 Quota exceeded when the DISCONNECT is read
    // before the close; the few the budget carries are still open.
    // One deadline for all: the holders' waits must not add up to their keep-alive (45 s).
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut closed = 0;
    for raw in &mut clients {
        let left = deadline.saturating_duration_since(Instant::now());
        match raw.next_within(left.max(Duration::from_millis(50))).await {
            None => {}
            Some(None) => closed += 1,
            Some(Some(frame)) => {
                assert_eq!(frame.kind(), 14, "{frame:?}");
                assert_eq!(frame.body.first(), Some(&0x97), "{frame:?}");
                closed += 1;
            }
        }
    }
    let grown = rss(&node).saturating_sub(before);
    eprintln!("{closed} of 40 closed; RSS grew {} KiB", grown / 1024);
    assert!(
        closed >= 30,
        "{closed} of 40 closed; RSS grew {} KiB",
        grown / 1024
    );
    // What they hold is the budget, not forty packets (40 MiB).
    assert!(
        grown < BUDGET + 12 * 1024 * 1024,
        "RSS grew {} KiB with {} clients held",
        grown / 1024,
        40 - closed
    );
    assert!(node.log().contains("EM-BROKER-READ-BUFFERS"));
    // Every close is counted for the operator, whatever the log's rate limit wrote.
    let counted = metric(&node, "edgemeta_broker_read_buffers_refused_total").await;
    assert!(
        counted >= closed as f64,
        "{counted} counted, {closed} closed"
    );
    assert_answers_a_query(&node, "read-budget").await;

    // Once the holders leave, the largest packet is read and delivered again.
    drop(clients);
    assert_delivered(&node, &whole, PACKET - 64, "big-again").await;
}

/// A CONNECT as [`connect`] makes, with keep-alive 0: the client may stay silent for ever.
fn connect_no_keep_alive(v5: bool, id: &str) -> Vec<u8> {
    let mut bytes = connect(v5, id, &props(&[]));
    let name = bytes
        .windows(4)
        .position(|w| w == b"MQTT")
        .expect("protocol name");
    bytes[name + 6..name + 8].copy_from_slice(&0u16.to_be_bytes());
    bytes
}

#[tokio::test(flavor = "multi_thread")]
async fn a_packet_that_does_not_all_arrive_within_packet_timeout_frees_its_read_buffer() {
    const PACKET: usize = 1024 * 1024;
    const TIMEOUT_MS: u64 = 1_000;
    let node = Node::start_with(Options {
        max_packet_bytes: PACKET,
        broker_yaml: format!(
            "  read_buffers_bytes: {}\n  packet_timeout_ms: {TIMEOUT_MS}\n",
            2 * PACKET
        ),
        ..Options::default()
    })
    .await;
    let whole = publish(true, b"t/big", 0, &vec![b'x'; PACKET - 64]);
    // Twenty clients with no keep-alive, ten times what the budget carries, each stopping
    // 1,000 bytes short of the largest packet; one MQTT 5 and one 3.1.1 client trickling a
    // byte every 100 ms into a packet they never finish, for ten times the timeout.
    let mut holders = Vec::new();
    for i in 0..20 {
        let (mut raw, code) =
            Raw::connected(node.port, &connect_no_keep_alive(true, &format!("hold{i}"))).await;
        assert_eq!(code, 0);
        raw.send(&whole[..whole.len() - 1_000]).await;
        holders.push(raw);
    }
    let mut tricklers = Vec::new();
    for v5 in [true, false] {
        let (mut raw, code) = Raw::connected(
            node.port,
            &connect_no_keep_alive(v5, &format!("trickle-{v5}")),
        )
        .await;
        assert_eq!(code, 0);
        let small = publish(v5, b"t/trickle", 0, &vec![b'y'; 2_000]);
        raw.send(&small[..100]).await;
        tricklers.push((raw, small, v5));
    }
    // An idle client with no keep-alive and nothing begun is left alone.
    let (mut idle, code) = Raw::connected(node.port, &connect_no_keep_alive(true, "idle")).await;
    assert_eq!(code, 0);
    let started = Instant::now();
    let mut trickled = 100;
    let mut closed_at = [None, None];
    while closed_at.iter().any(Option::is_none)
        && started.elapsed() < Duration::from_millis(10 * TIMEOUT_MS)
    {
        for (k, (raw, small, v5)) in tricklers.iter_mut().enumerate() {
            if closed_at[k].is_some() {
                continue;
            }
            raw.send(&small[trickled..trickled + 1]).await;
            match raw.next_within(Duration::from_millis(100)).await {
                None => {}
                Some(None) => closed_at[k] = Some(started.elapsed()),
                Some(Some(frame)) => {
                    assert!(*v5, "a 3.1.1 client is sent no DISCONNECT: {frame:?}");
                    assert_eq!(frame.kind(), 14, "{frame:?}");
                    assert_eq!(frame.body.first(), Some(&0x8D), "{frame:?}");
                    closed_at[k] = Some(started.elapsed());
                }
            }
        }
        trickled += 1;
    }
    for (k, at) in closed_at.iter().enumerate() {
        let at =
            at.unwrap_or_else(|| panic!("trickler {k} still open after {:?}", started.elapsed()));
        assert!(
            at >= Duration::from_millis(TIMEOUT_MS - 100)
                && at < Duration::from_millis(3 * TIMEOUT_MS),
            "trickler {k} closed after {at:?}"
        );
    }
    // Every holder is gone by now: the budget's refusals at once (0x97), the rest at the
    // timeout (0x8D).
    let mut reasons = Vec::new();
    for raw in &mut holders {
        match raw.next_within(Duration::from_millis(500)).await {
            None => panic!("a holder is still open after {:?}", started.elapsed()),
            Some(None) => reasons.push(None),
            Some(Some(frame)) => {
                assert_eq!(frame.kind(), 14, "{frame:?}");
                reasons.push(frame.body.first().copied());
            }
        }
    }
    assert!(reasons.contains(&Some(0x8D)), "{reasons:?}");
    idle.send(&[0xC0, 0]).await;
    let pong = idle.next_within(Duration::from_secs(5)).await;
    assert!(matches!(&pong, Some(Some(f)) if f.kind() == 13), "{pong:?}");

    // The budget is whole again: the largest packet is read and delivered.
    assert_delivered(&node, &whole, PACKET - 64, "big-after").await;

    assert!(node.log().contains("EM-BROKER-SLOW-PACKET"));
    let counted = metric(&node, "edgemeta_broker_slow_packets_total").await;
    let slow = reasons.iter().filter(|r| **r == Some(0x8D)).count() + 2;
    assert!(counted >= slow as f64, "{counted} counted, {slow} seen");
    assert_answers_a_query(&node, "slow-packet").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_connect_that_finds_no_room_in_the_read_budget_is_refused_and_may_retry() {
    const PACKET: usize = 1024 * 1024;
    let node = Node::start_with(Options {
        max_packet_bytes: PACKET,
        broker_yaml: format!("  read_buffers_bytes: {PACKET}\n"),
        ..Options::default()
    })
    .await;
    // A holder stopping short of the largest packet takes all but a few KiB of the budget.
    let whole = publish(true, b"t/big", 0, &vec![b'x'; PACKET - 64]);
    let (mut holder, code) = Raw::connected(node.port, &connect(true, "hold", &props(&[]))).await;
    assert_eq!(code, 0);
    holder.send(&whole[..whole.len() - 1_000]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // An MQTT 5 CONNECT of ~900 KB (user properties) and a 3.1.1 one of ~184 KB (will,
    // username, password): both larger than what is left.
    let pair = |k: u8| {
        let mut p = vec![0x26];
        p.extend_from_slice(&string(&[k]));
        p.extend_from_slice(&string(&vec![b'u'; 60_000]));
        p
    };
    let user: Vec<u8> = (0..15).flat_map(pair).collect();
    let big_v5 = connect(true, "big-connect-5", &props(&user));
    let mut body = string(b"MQTT");
    body.extend_from_slice(&[4, 0xC6]);
    body.extend_from_slice(&30u16.to_be_bytes());
    body.extend_from_slice(&string(b"big-connect-4"));
    body.extend_from_slice(&string(&[b'w'; 4_000]));
    for field in [b'p', b'n', b's'] {
        body.extend_from_slice(&string(&vec![field; 60_000]));
    }
    let big_v4 = packet(0x10, &body);
    for (bytes, refused) in [(&big_v5, 0x97), (&big_v4, 3)] {
        let mut raw = Raw::open(node.port).await;
        raw.send(bytes).await;
        let connack = raw.next().await.expect("a CONNACK");
        assert_eq!(connack.kind(), 2, "{connack:?}");
        assert_eq!(connack.body.get(1), Some(&refused), "{connack:?}");
    }
    assert!(metric(&node, "edgemeta_broker_read_buffers_refused_total").await >= 2.0);

    // Once the holder leaves, the same CONNECTs are read and accepted.
    drop(holder);
    for bytes in [&big_v5, &big_v4] {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut raw = Raw::open(node.port).await;
            raw.send(bytes).await;
            let connack = raw.next().await.expect("a CONNACK");
            if connack.body.get(1) == Some(&0) {
                break;
            }
            assert!(Instant::now() < deadline, "still refused: {connack:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_answers_a_query(&node, "big-connect").await;
}
