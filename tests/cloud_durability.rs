//! Store-and-forward under failure, against a real mosquitto as the cloud broker: the connection
//! signal, a long upward stream across repeated cloud restarts, `kill -9` of the node during a
//! burst and with cloud messages in flight, a full outbox, and a cloud that is not there.

mod common;

use common::cloud::{
    await_empty_outbox, await_log, await_signal, bridged, bridged_with, cloud_client, cloud_insert,
    cut_off_node, expect_applied, expect_delivered, local_query, next_signal, queue_pod_statuses,
    spawn_status_stream, stream_finished, tail, Valve, CONNECTION, SUBSCRIBED,
};
use common::{topic, wait_until, CloudBroker, CloudOptions, Msg, Node, Options};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

#[tokio::test]
async fn cloud_connected_and_disconnected_are_signalled_once_per_transition() {
    // The cloud is down when the node starts, so the first signal cannot be missed: the
    // watcher subscribes before the bridge can possibly connect.
    let mut cloud = CloudBroker::start().await;
    cloud.stop();
    let (node, _bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    // A bridge that never reached the cloud has nothing to report as lost.
    watcher.expect_silence(CONNECTION).await;
    cloud.restart().await;
    assert_eq!(next_signal(&mut watcher).await, "cloud_connected");

    // A graceful stop (the broker closes the socket), then a crash (the kernel closes it).
    for crash in [false, true] {
        if crash {
            cloud.kill9();
        } else {
            cloud.stop();
        }
        assert_eq!(next_signal(&mut watcher).await, "cloud_disconnected");
        cloud.restart().await;
        assert_eq!(next_signal(&mut watcher).await, "cloud_connected");
    }
    watcher.expect_silence(CONNECTION).await;
    assert!(
        node.log().contains("EM-BRIDGE-DISCONNECTED"),
        "{}",
        node.log()
    );
}

/// How many times the flap test restarts the cloud broker; `FLAP_TEST_RESTARTS` sets another
/// count (the issue's acceptance run is 50). Not an `EDGEMETA_` name: the node reads those as
/// configuration.
fn flaps() -> usize {
    std::env::var("FLAP_TEST_RESTARTS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10)
}

/// Publishes, as the cloud's edgecontroller, `total` pod updates (`{"seq": n}`, round-robin
/// over `objects` pods, `header.resourceversion` n + 1) in a task, paced so that the cloud
/// restarts fall inside the stream; yields the ids per pod in the order sent.
fn spawn_cloud_updates(
    controller: common::Client,
    bridge: common::CloudOptions,
    total: usize,
    objects: usize,
) -> tokio::task::JoinHandle<(common::Client, HashMap<String, Vec<String>>)> {
    tokio::spawn(async move {
        let mut sent: HashMap<String, Vec<String>> = HashMap::new();
        for seq in 0..total {
            let resource = format!("default/pod/flap{}", seq % objects);
            let id = common::unique_id("msg");
            let payload = json!({
                "header": {"msg_id": id, "timestamp": 1_732_262_400_000_i64,
                           "resourceversion": (seq + 1).to_string()},
                "route": {"source": "edgecontroller", "group": "resource",
                          "operation": "update", "resource": resource},
                "content": {"seq": seq},
            });
            // The client queues while the cloud broker is away and sends again on reconnect.
            controller
                .publish(
                    &bridge.down(&topic("edgecontroller/update", &resource)),
                    payload.to_string(),
                )
                .await;
            sent.entry(resource).or_default().push(id);
            if seq % 20 == 19 {
                // pacing: the stream is spread out so that cloud restarts fall inside it.
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        }
        (controller, sent)
    })
}

#[tokio::test]
async fn streams_both_ways_survive_cloud_restarts_in_order_complete_and_applied_once() {
    const TOTAL: usize = 5_000;
    const RESOURCES: usize = 20;
    const CLOUD_OBJECTS: usize = 20;
    let restarts = flaps();
    let cloud_changes = 200 * restarts;
    // Started with the cloud down, as above, so that the watcher sees the first connection.
    let mut cloud = CloudBroker::start().await;
    cloud.stop();
    let (node, bridge) = bridged(&cloud).await;
    let mut watcher = node.client().await;
    watcher.subscribe(CONNECTION).await;
    // What the node hands on to edged of the cloud's changes.
    let mut edged_in = node.client().await;
    edged_in.subscribe("ke/edged/edgecontroller/update/#").await;
    cloud.restart().await;
    await_signal(&mut watcher, "cloud_connected", common::WAIT, &node).await;
    await_log(&node, common::cloud::SUBSCRIBED).await;
    // A persistent session: mosquitto queues for it while the cloud restarts. edged's messages
    // only: the node's replies to the cloud's changes go to `controller`.
    let mut cloud_side = cloud_client(&cloud, &bridge.up("edged/#")).await;
    let controller = cloud_client(&cloud, &bridge.up("meta/response/#")).await;
    let mut spy = cloud_client(&cloud, &bridge.down("#")).await;

    // edged's pod status updates go to the cloud through the outbox, spread over the restarts;
    // the cloud's pod updates come down at the same time.
    let producer = spawn_status_stream(
        node.client().await,
        TOTAL,
        RESOURCES,
        Some((10, Duration::from_millis(10))),
    );
    let downward = spawn_cloud_updates(controller, bridge.clone(), cloud_changes, CLOUD_OBJECTS);
    // SIGTERM, not `kill -9`: mosquitto PUBACKs the node's messages and saves the test
    // subscriber's queue only once a second, so after a crash it could lose a message edgemeta
    // rightly deleted. What is under test is edgemeta's outbox, not mosquitto's persistence.
    // Each restart waits for `cloud_connected`, so each interrupts a live session.
    let mut received = Vec::new();
    let mut handed = Vec::new();
    let mut restarts_during_stream = 0;
    for _ in 0..restarts {
        received.extend(cloud_side.drain(Duration::from_millis(200)).await);
        handed.extend(edged_in.drain(Duration::from_millis(1)).await);
        restarts_during_stream += usize::from(!producer.is_finished() || !downward.is_finished());
        cloud.stop();
        await_signal(&mut watcher, "cloud_disconnected", common::WAIT, &node).await;
        // fault injection: the cloud stays away a while, so the node queues meanwhile.
        tokio::time::sleep(Duration::from_millis(100)).await;
        cloud.restart().await;
        await_signal(&mut watcher, "cloud_connected", common::WAIT, &node).await;
    }
    let (_edged, ids) = stream_finished(producer).await;
    let (mut controller, sent) = tokio::time::timeout(Duration::from_secs(120), downward)
        .await
        .expect("the cloud's updates all published within 120 s")
        .expect("cloud update task");
    eprintln!("{restarts_during_stream} of {restarts} cloud restarts during the streams");

    let limit = Duration::from_secs(120);
    let duplicates = expect_delivered(&mut cloud_side, &ids, limit, &mut received, &node).await;
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert_eq!(unique, ids, "only the sent ids arrive");
    eprintln!("{} deliveries, {duplicates} duplicates", received.len());
    // Up topics name the type; which pod is in the envelope.
    for m in &received {
        assert_eq!(m.topic, bridge.up("edged/update/default/podstatus"));
        assert!(
            m.resource().starts_with("default/podstatus/p"),
            "{}",
            m.resource()
        );
        assert_eq!(
            (m.source(), m.operation()),
            ("edged".into(), "update".into())
        );
    }
    // Every acknowledged entry is deleted, and the last status of each pod is stored.
    await_empty_outbox(&node, common::WAIT).await;
    for k in 0..RESOURCES {
        let last = format!(r#"{{"seq":{}}}"#, TOTAL - RESOURCES + k);
        let stored = node.stored(&format!("default/podstatus/p{k}")).await;
        assert_eq!(stored.as_deref(), Some(last.as_str()));
    }

    // Downward: each pod's last change handed to edged; then a quiet while in which a
    // redelivered change would be applied again.
    let last_ids: HashSet<String> = sent
        .values()
        .map(|ids| ids.last().expect("each pod changed").clone())
        .collect();
    wait_until(
        "each pod's last cloud change handed to edged",
        Duration::from_secs(120),
        async || {
            handed.extend(edged_in.drain(Duration::from_millis(300)).await);
            let got: HashSet<String> = handed.iter().map(Msg::msg_id).collect();
            let missing = last_ids.difference(&got).count();
            if missing == 0 {
                return Ok(());
            }
            Err(format!(
                "{missing} pods without their last change, {} hand-ons; node log:\n{}",
                handed.len(),
                tail(&node.log(), 30)
            ))
        },
    )
    .await;
    // Nothing lost: the node acknowledged every change the cloud made ("OK"), whether it
    // applied it or recognised it as already applied or overtaken.
    let made: HashSet<String> = sent.values().flatten().cloned().collect();
    let mut oks: HashSet<String> = HashSet::new();
    wait_until(
        "every cloud change acknowledged by the node",
        Duration::from_secs(120),
        async || {
            for m in controller.drain(Duration::from_millis(300)).await {
                if m.content() == json!("OK") {
                    oks.extend(m.parent_id());
                }
            }
            let missing = made.difference(&oks).count();
            if missing == 0 {
                return Ok(());
            }
            Err(format!(
                "{missing} of {} cloud changes never acknowledged; node log:\n{}",
                made.len(),
                tail(&node.log(), 30)
            ))
        },
    )
    .await;
    handed.extend(edged_in.drain(Duration::from_secs(2)).await);
    // What the cloud broker routed, per pod in the order it did: the cloud's own client sends
    // its unacknowledged publishes again after a reconnect, by packet id, not in their order, so
    // an older version may reach the node after a newer one. The node must not apply that one.
    let routed = spy.drain(Duration::from_millis(300)).await;
    let mut newest: HashMap<String, u64> = HashMap::new();
    let mut overtaken: HashSet<String> = HashSet::new();
    for m in &routed {
        let seq = m.content()["seq"].as_u64().expect("seq");
        let top = newest.entry(m.resource()).or_insert(0);
        if seq < *top {
            overtaken.insert(m.msg_id());
        }
        *top = (*top).max(seq);
    }
    let routed_late = overtaken.len();
    let ids: Vec<String> = handed.iter().map(Msg::msg_id).collect();
    let unique: HashSet<&String> = ids.iter().collect();
    let mut per_pod: HashMap<String, Vec<u64>> = HashMap::new();
    for m in &handed {
        let seq = m.content()["seq"].as_u64().expect("seq");
        per_pod.entry(m.resource()).or_default().push(seq);
    }
    let superseded = cloud_changes - unique.len();
    eprintln!(
        "{cloud_changes} cloud changes made, {} handed to edged ({} repeated), {superseded} not \
         handed on for a newer version already applied; the cloud broker routed {routed_late} \
         after a newer one of the same pod",
        handed.len(),
        ids.len() - unique.len()
    );
    assert_eq!(ids.len(), unique.len(), "duplicates applied: none");
    for (pod, seqs) in &per_pod {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "{pod}: handed on out of order {seqs:?}"
        );
    }
    // Each change never handed on is one the cloud broker routed after a newer version of
    // its pod: skipped rightly, not lost.
    let handed_ids: HashSet<String> = ids.iter().cloned().collect();
    let skipped_wrongly: Vec<String> = sent
        .iter()
        .flat_map(|(pod, pod_ids)| pod_ids.iter().enumerate().map(move |(k, id)| (pod, k, id)))
        .filter(|(_, _, id)| !handed_ids.contains(*id) && !overtaken.contains(*id))
        .map(|(pod, k, id)| format!("{pod} change {k} ({id})"))
        .collect();
    assert!(
        skipped_wrongly.is_empty(),
        "{} changes never handed on though no newer version overtook them on the way: {:?}",
        skipped_wrongly.len(),
        &skipped_wrongly[..skipped_wrongly.len().min(5)]
    );
    for k in 0..CLOUD_OBJECTS {
        let resource = format!("default/pod/flap{k}");
        let last = cloud_changes - CLOUD_OBJECTS + k;
        let stored = node.stored(&resource).await;
        assert_eq!(stored, Some(format!(r#"{{"seq":{last}}}"#)), "{resource}");
    }
}

#[tokio::test]
async fn every_message_acked_before_a_kill_9_reaches_the_cloud_after_restart() {
    const TOTAL: usize = 5_000;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut cloud_side = cloud_client(&cloud, &bridge.up_filter()).await;
    // edged is answered "OK" after the commit that also put the cloud-bound copy in the outbox.
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/response/#").await;
    let producer = spawn_status_stream(node.client().await, TOTAL, 20, None);

    let mut acked = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.len() < TOTAL / 3 {
        assert!(
            Instant::now() < deadline,
            "only {} OKs in 60 s; node log:\n{}",
            acked.len(),
            tail(&node.log(), 40)
        );
        let m = edged.next().await;
        assert_eq!(m.content(), json!("OK"), "{:?}", m.payload);
        acked.insert(m.parent_id().expect("reply names its request"));
    }
    node.kill9();
    // OKs that were already on their way to us before the kill count too.
    let late = edged.drain(Duration::from_millis(300)).await;
    acked.extend(
        late.iter()
            .filter(|m| m.content() == json!("OK"))
            .filter_map(Msg::parent_id),
    );
    eprintln!("{} of {TOTAL} acked when the node was killed", acked.len());
    node.restart().await;
    // The producer may be blocked on a full client queue until the node is back.
    let (_publisher, sent) = stream_finished(producer).await;
    assert!(acked.is_subset(&sent), "OKs only for requests we sent");

    let mut received = Vec::new();
    let limit = Duration::from_secs(90);
    expect_delivered(&mut cloud_side, &acked, limit, &mut received, &node).await;
    let unique: HashSet<String> = received.iter().map(Msg::msg_id).collect();
    assert!(
        unique.is_subset(&sent),
        "nothing reaches the cloud that was not sent"
    );
    await_empty_outbox(&node, Duration::from_secs(30)).await;
}

#[tokio::test]
async fn cloud_messages_in_flight_at_a_kill_9_are_applied_once_after_restart() {
    const BEFORE: usize = 200;
    let cloud = CloudBroker::start().await;
    let (mut node, bridge) = bridged(&cloud).await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/response/#")).await;
    // Sees what the cloud broker routes to the node: then it is also queued for its session.
    let mut spy = cloud_client(&cloud, &bridge.down("#")).await;

    // mosquitto drops what is published before the bridge's first SUBSCRIBE: repeat a harmless
    // insert until one is acknowledged, so the node's persistent session exists.
    let mut warm_ids = HashSet::new();
    wait_until(
        "the bridge subscribed to its down topics (a warm-up insert acknowledged)",
        common::WAIT,
        async || {
            warm_ids
                .insert(cloud_insert(&controller, &bridge, "default/pod/warm", json!({})).await);
            for m in controller.drain(Duration::from_millis(500)).await {
                if m.parent_id().is_some_and(|p| warm_ids.contains(&p)) {
                    assert_eq!(m.content(), json!("OK"));
                    return Ok(());
                }
            }
            Err(format!("node log:\n{}", tail(&node.log(), 40)))
        },
    )
    .await;

    // A batch published just before the kill: some are in flight to, or inside, the node.
    let mut want: HashMap<String, String> = HashMap::new();
    for i in 0..BEFORE {
        let resource = format!("default/pod/before{i}");
        let id = cloud_insert(&controller, &bridge, &resource, json!({"i": i})).await;
        want.insert(id, resource);
    }
    // fault injection: the kill falls while the batch is on its way to, or inside, the node.
    tokio::time::sleep(Duration::from_millis(30)).await;
    node.kill9();
    // One published while the node is down: mosquitto queues it for the node's session.
    let resource = "default/configmap/while-down";
    let down_id = cloud_insert(&controller, &bridge, resource, json!({"data": {"k": "v"}})).await;
    want.insert(down_id.clone(), resource.to_owned());
    spy.expect_matching(
        &bridge.down(&topic("edgecontroller/insert", resource)),
        "the insert published while the node is down",
        |m| m.msg_id() == down_id,
    )
    .await;
    node.restart().await;

    let mut oks: HashSet<String> = HashSet::new();
    wait_until(
        "every cloud insert acknowledged",
        Duration::from_secs(60),
        async || {
            for m in controller.drain(Duration::from_millis(300)).await {
                if m.content() == json!("OK") {
                    let parent = m.parent_id().expect("ack names its request");
                    if let Some(resource) = want.get(&parent) {
                        assert_eq!(m.topic, topic(&bridge.up("meta/response"), resource));
                        assert_eq!(&m.resource(), resource);
                    }
                    oks.insert(parent);
                }
            }
            let missing: Vec<&String> = want.keys().filter(|id| !oks.contains(*id)).collect();
            if missing.is_empty() {
                return Ok(());
            }
            Err(format!(
                "{} of {} never acked (e.g. {:?}); node log:\n{}",
                missing.len(),
                want.len(),
                missing
                    .iter()
                    .take(3)
                    .map(|id| &want[*id])
                    .collect::<Vec<_>>(),
                tail(&node.log(), 60)
            ))
        },
    )
    .await;
    assert_eq!(
        node.stored(resource).await.as_deref(),
        Some(r#"{"data":{"k":"v"}}"#)
    );
    for i in 0..BEFORE {
        let stored = node.stored(&format!("default/pod/before{i}")).await;
        assert_eq!(stored, Some(format!(r#"{{"i":{i}}}"#)), "before{i}");
    }
    // An ack is sent only after the commit, and each insert lands exactly once in the store.
    assert_eq!(node.meta_rows().await.len(), BEFORE + 2);
}

#[tokio::test]
async fn with_the_cloud_unreachable_queries_answer_from_the_store_at_once() {
    let node = cut_off_node(
        "INSERT INTO meta(key, type, value) VALUES
           ('default/configmap/cm1', 'configmap', '{\"data\":{\"a\":\"1\"}}'),
           ('default/secret/s1', 'secret', '{\"data\":{\"p\":\"x\"}}'),
           ('default/node/edge-1', 'node', '{\"status\":\"Ready\"}'),
           ('default/pod/web', 'pod', '{\"n\":\"web\"}'),
           ('default/pod/db', 'pod', '{\"n\":\"db\"}'),
           ('kube-system/pod/dns', 'pod', '{\"n\":\"dns\"}');",
    )
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/meta/#").await;
    // The bridge has really tried and failed before we ask.
    await_log(&node, "EM-BRIDGE-CONNECT").await;

    for (resource, expected) in [
        // Remote-query types fall back to the local copy at once.
        ("default/configmap/cm1", vec![r#"{"data":{"a":"1"}}"#]),
        ("default/secret/s1", vec![r#"{"data":{"p":"x"}}"#]),
        ("default/node/edge-1", vec![r#"{"status":"Ready"}"#]),
        ("default/configmap/absent", vec![]),
        // edged's start-up pod list, by type.
        (
            "default/pod",
            vec![r#"{"n":"db"}"#, r#"{"n":"dns"}"#, r#"{"n":"web"}"#],
        ),
    ] {
        assert_eq!(
            local_query(&mut edged, resource).await,
            expected,
            "{resource}"
        );
    }
}

#[tokio::test]
async fn a_cloud_change_refused_for_a_full_outbox_is_delivered_again_not_lost() {
    let cloud = CloudBroker::start().await;
    // No room at all: every change that must tell the cloud something is refused for now.
    let options = Options {
        store_yaml: "  outbox_max_entries: 0\n".to_owned(),
        ..Options::default()
    };
    let (mut node, bridge) = bridged_with(&cloud, options).await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/#")).await;
    let web = "default/pod/web";
    let id = cloud_insert(&controller, &bridge, web, json!({"v": 1})).await;
    await_log(&node, "EM-BRIDGE-REDELIVER").await;
    assert_eq!(node.stored(web).await, None);

    // With room again, the cloud broker's redelivery applies it and the ack reaches the cloud.
    node.kill9();
    node.options.store_yaml = String::new();
    node.reconfigure();
    node.restart().await;
    expect_applied(&mut controller, &bridge, &node, web, &id, r#"{"v":1}"#).await;
}

#[tokio::test]
async fn a_cloud_change_refused_while_the_outbox_is_full_is_taken_in_the_same_session_once_it_drains(
) {
    const ROOM: i64 = 20;
    let cloud = CloudBroker::start().await;
    let valve = Valve::to(&cloud).await;
    let bridge = CloudOptions {
        port: valve.port,
        ..CloudOptions::to(&cloud)
    };
    let node = Node::start_with(Options {
        cloud: Some(bridge.clone()),
        store_yaml: format!("  outbox_max_entries: {ROOM}\n"),
        ..Options::default()
    })
    .await;
    await_log(&node, SUBSCRIBED).await;
    let mut controller = cloud_client(&cloud, &bridge.up("meta/#")).await;

    // The link stalls one way: edged's status reports fill the outbox and stay unacknowledged.
    valve.hold();
    queue_pod_statuses(&node, ROOM).await;

    // A change from the cloud finds no room for its reply: refused for now, not stored.
    let web = "default/pod/web";
    let id = cloud_insert(&controller, &bridge, web, json!({"v": 1})).await;
    await_log(&node, "EM-BRIDGE-REDELIVER").await;
    assert_eq!(node.stored(web).await, None);

    // The link recovers: the reports are acknowledged, the outbox drains, and the change is
    // taken and acknowledged in the session it came in.
    valve.release();
    expect_applied(&mut controller, &bridge, &node, web, &id, r#"{"v":1}"#).await;
    let log = node.log();
    assert_eq!(
        log.matches("EM-BRIDGE-DISCONNECTED").count(),
        0,
        "the session ended: {}",
        tail(&log, 20)
    );
    assert!(
        log.contains("cloud message taken after being refused for now"),
        "{}",
        tail(&log, 20)
    );
    // Applied once: no redelivery follows (the controller sees one reply).
    controller
        .expect_silence_about(&bridge.up("meta/response"), web)
        .await;
}
