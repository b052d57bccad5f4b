//! The cloud link across a cloud outage, against a real mosquitto as the cloud broker: while the
//! cloud broker is away and just after it returns, the cloud queues changes for the node; once
//! back, the node keeps one session, applies each change once and publishes its will at most
//! once for the whole outage.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::cloud::{await_signal, cloud_insert, tail, CONNECTION};
use common::{wait_until, CloudBroker, CloudOptions, Msg, Node, Options};
use serde_json::json;

/// How long the cloud broker stays away; `OUTAGE_TEST_S` sets another length (the field
/// report was 20 s; a few seconds reproduce the same). Not an `EDGEMETA_` name: the node
/// reads those as configuration.
fn outage() -> Duration {
    let seconds = std::env::var("OUTAGE_TEST_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    Duration::from_secs(seconds)
}

/// Counts what one client saw, by a key the caller picks.
fn tally(messages: &[Msg], key: impl Fn(&Msg) -> Option<String>) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for m in messages {
        if let Some(k) = key(m) {
            *counts.entry(k).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test]
async fn after_an_outage_with_queued_changes_the_node_keeps_one_session_and_applies_each_once() {
    const CHANGES: usize = 2_000;
    let mut cloud = CloudBroker::start().await;
    // Reconnect attempts 1–2 s apart, so the cloud's changes are queued in the node's
    // persistent session before the node is back, as after any outage longer than a moment.
    let bridge = CloudOptions {
        backoff_min_ms: 2_000,
        backoff_max_ms: 2_000,
        ..CloudOptions::to(&cloud)
    };
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..Options::default()
    })
    .await;
    common::cloud::await_log(&node, common::cloud::SUBSCRIBED).await;
    let mut signals = node.client().await;
    signals.subscribe(CONNECTION).await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;
    // The cloud side: the node's replies, and its birth and will (persistent sessions, so both
    // reconnect to the returning broker with their subscriptions).
    let mut controller = cloud.client(&common::unique_id("controller")).await;
    controller.subscribe(&bridge.up("meta/response/#")).await;
    let connection = format!("kubeedge/{}/connection", bridge.node_id);
    let mut births_and_wills = cloud.client(&common::unique_id("watch")).await;
    births_and_wills.subscribe(&connection).await;
    // The retained birth of the first session.
    births_and_wills.drain(Duration::from_millis(300)).await;

    cloud.stop();
    await_signal(&mut signals, "cloud_disconnected", common::WAIT, &node).await;
    // fault injection: the cloud stays away; the node keeps trying.
    tokio::time::sleep(outage()).await;
    cloud.restart().await;
    let returned = Instant::now();
    let mut ids = Vec::with_capacity(CHANGES);
    for i in 0..CHANGES {
        let resource = format!("default/pod/p{i}");
        ids.push(cloud_insert(&controller, &bridge, &resource, json!({"i": i})).await);
    }
    eprintln!(
        "{CHANGES} changes published {:?} after the cloud returned",
        returned.elapsed()
    );

    // Every change handed to edged; then a quiet while in which a dropped session would be
    // redelivered and applied again.
    let mut handed: Vec<Msg> = Vec::new();
    wait_until(
        format_args!("{CHANGES} changes handed to edged"),
        Duration::from_secs(90),
        async || {
            handed.extend(
                edged
                    .drain(Duration::from_millis(300))
                    .await
                    .into_iter()
                    .filter(|m| m.topic.starts_with("ke/edged/edgecontroller/insert/")),
            );
            let unique = tally(&handed, |m| Some(m.msg_id())).len();
            if unique == CHANGES {
                Ok(())
            } else {
                Err(format!(
                    "{unique} handed on; node log:\n{}",
                    tail(&node.log(), 30)
                ))
            }
        },
    )
    .await;
    eprintln!(
        "all handed to edged {:?} after the return",
        returned.elapsed()
    );
    handed.extend(
        edged
            .drain(Duration::from_secs(3))
            .await
            .into_iter()
            .filter(|m| m.topic.starts_with("ke/edged/edgecontroller/insert/")),
    );
    let signals_after = signals.drain(Duration::from_millis(300)).await;
    let cloud_connection: Vec<String> = births_and_wills
        .drain(Duration::from_millis(300))
        .await
        .iter()
        .filter_map(|m| m.content().as_str().map(str::to_owned))
        .collect();
    let replies = controller.drain(Duration::from_millis(300)).await;

    let sessions = tally(&signals_after, |m| m.content().as_str().map(str::to_owned));
    // mosquitto publishes the will of a session it holds when it stops, and again when it
    // restores that session at start: those are the outage's. After the birth, none may come.
    let birth = cloud_connection
        .iter()
        .position(|state| state == "cloud_connected");
    let repeats = handed.len() - CHANGES;
    eprintln!(
        "local signals {sessions:?}; on the cloud's connection topic {cloud_connection:?}; \
         {} hand-ons ({repeats} repeated); {} replies so far",
        handed.len(),
        replies.len()
    );
    assert_eq!(
        sessions.get("cloud_connected"),
        Some(&1),
        "one session after the return; node log:\n{}",
        tail(&node.log(), 40)
    );
    assert_eq!(sessions.get("cloud_disconnected"), None, "no session lost");
    assert_eq!(repeats, 0, "each change handed to edged once");
    let birth = birth.expect("the node's birth message reached the cloud");
    assert_eq!(
        &cloud_connection[birth..],
        ["cloud_connected"],
        "one birth, and no will after it"
    );
    for (i, id) in ids.iter().enumerate().step_by(97) {
        let stored = node.stored(&format!("default/pod/p{i}")).await;
        assert_eq!(stored, Some(format!(r#"{{"i":{i}}}"#)), "{id}");
    }
    assert_eq!(
        node.log().matches("EM-BRIDGE-DISCONNECTED").count(),
        1,
        "only the outage itself ended a session"
    );
}

#[tokio::test]
async fn a_node_that_waited_finds_the_returning_cloud_at_once_and_reports_its_heartbeat_again() {
    // The heartbeat goes at QoS 0 the moment the node is back, which may be before the
    // observer below has reconnected.
    let mut cloud = CloudBroker::start_keeping_qos0().await;
    // The shipped reconnect settings (conf/edge.yaml).
    let bridge = CloudOptions {
        backoff_min_ms: 200,
        backoff_max_ms: 1_500,
        ..CloudOptions::to(&cloud)
    };
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        ..Options::default()
    })
    .await;
    common::cloud::await_log(&node, common::cloud::SUBSCRIBED).await;
    let mut signals = node.client().await;
    signals.subscribe(CONNECTION).await;
    let mut heartbeats = cloud.client(&common::unique_id("controller")).await;
    let heartbeat_topic = bridge.up("edged/update/default/nodestatus");
    heartbeats.subscribe(&heartbeat_topic).await;
    // edged's heartbeat, sent once before the outage and not again.
    let edged = node.client().await;
    let (id, payload) = common::envelope(
        "edged",
        "update",
        &format!("default/nodestatus/{}", bridge.node_id),
        json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
    );
    edged
        .publish("ke/cloud/edged/update/default/nodestatus", payload)
        .await;
    let first = heartbeats.expect(&heartbeat_topic).await;
    assert_eq!(first.msg_id(), id);

    cloud.stop();
    await_signal(&mut signals, "cloud_disconnected", common::WAIT, &node).await;
    // fault injection: long enough for the reconnect delay to reach its cap many times over.
    tokio::time::sleep(outage()).await;
    cloud.restart().await;
    let returned = Instant::now();
    await_signal(&mut signals, "cloud_connected", common::WAIT, &node).await;
    let back = returned.elapsed();
    let again = heartbeats.expect(&heartbeat_topic).await;
    let reported = returned.elapsed();
    eprintln!(
        "connected {back:?} and heartbeat at the cloud {reported:?} after the cloud returned"
    );
    assert_eq!(again.msg_id(), id, "the last heartbeat, sent again");
    // The cap (1.5 s) plus room for a loaded test machine.
    assert!(
        back < Duration::from_millis(2_500),
        "back after {back:?}; node log:\n{}",
        tail(&node.log(), 20)
    );
}
