//! A publisher far faster than the store: nothing it was told "OK" about may be lost, and
//! nothing may be silently dropped on the way to the MetaManager.

mod common;

use common::{envelope, topic, wait_until, Node, Options};
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test]
async fn a_burst_larger_than_the_brokers_buffers_is_stored_completely() {
    const TOTAL: usize = 200_000;
    let node = Node::start().await;
    let client = node.client().await;
    let pad = "x".repeat(1_000);
    for i in 0..TOTAL {
        let resource = format!("default/pod/p{i}");
        let (_, payload) = envelope("edgecontroller", "insert", &resource, json!({"pad": pad}));
        // One type-level topic for all of them (v2): the names are in the envelopes.
        client
            .publish(&topic("ke/meta/edgecontroller/insert", &resource), payload)
            .await;
    }
    // Everything is stored; the store must not stop growing short of that.
    let mut last = 0;
    let mut still = Instant::now();
    wait_until(
        format_args!("all {TOTAL} inserts stored"),
        Duration::from_secs(240),
        async || {
            let rows = node.rows("SELECT count(*) AS n FROM meta").await[0]["n"]
                .as_u64()
                .expect("a count") as usize;
            if rows == TOTAL {
                return Ok(());
            }
            if rows != last {
                last = rows;
                still = Instant::now();
            }
            let log = node.log();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            let report = format!(
                "{rows} of {TOTAL} inserts stored; the rest were lost:\n{}",
                tail.join("\n")
            );
            assert!(still.elapsed() < Duration::from_secs(10), "{report}");
            Err(report)
        },
    )
    .await;
}

/// One client's messages keep their order however each reaches the store worker: at once,
/// after waiting for room in the worker's queue (two jobs here), or after its refusal was
/// answered. edged hears every update in order, the store ends on the last, and each malformed
/// message is answered.
#[tokio::test]
async fn a_client_that_fills_the_store_queue_keeps_its_order_and_hears_each_refusal() {
    const UPDATES: u64 = 2_000;
    const MALFORMED_EVERY: u64 = 100;
    let node = Node::start_with(Options {
        env: vec![(
            "EDGEMETA_METAMANAGER__QUEUE_CAPACITY".to_owned(),
            "2".to_owned(),
        )],
        ..Options::default()
    })
    .await;
    let mut edged = node.client().await;
    edged.subscribe("ke/edged/#").await;
    let mut cloud = node.client().await;
    cloud.subscribe("ke/cloud/meta/error/#").await;
    let client = node.client().await;
    let on = "ke/meta/edgecontroller/update/default/configmap/c";
    for n in 0..UPDATES {
        if n % MALFORMED_EVERY == MALFORMED_EVERY / 2 {
            client.publish(on, "{not json").await;
        }
        let (_, payload) = envelope(
            "edgecontroller",
            "update",
            "default/configmap/c",
            json!({"data": {"n": n.to_string()}}),
        );
        client.publish(on, payload).await;
    }
    let mut heard = Vec::new();
    while heard.len() < UPDATES as usize {
        let m = edged.next().await;
        if m.topic.ends_with("/configmap") || m.topic.ends_with("/configmap/c") {
            heard.push(m.content()["data"]["n"].as_str().map(str::to_owned));
        }
    }
    let expected: Vec<Option<String>> = (0..UPDATES).map(|n| Some(n.to_string())).collect();
    assert!(
        heard == expected,
        "edged heard the updates out of order or not all of them: first differences {:?}",
        heard
            .iter()
            .zip(&expected)
            .enumerate()
            .filter(|(_, (h, e))| h != e)
            .take(5)
            .collect::<Vec<_>>()
    );
    let stored: serde_json::Value =
        serde_json::from_str(&node.stored("default/configmap/c").await.expect("stored"))
            .expect("stored JSON");
    assert_eq!(
        stored["data"]["n"],
        json!((UPDATES - 1).to_string()),
        "the store ends on the last update"
    );
    let refusals = (0..UPDATES)
        .filter(|n| n % MALFORMED_EVERY == MALFORMED_EVERY / 2)
        .count();
    for i in 0..refusals {
        let m = cloud
            .next_within(Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("only {i} of {refusals} malformed messages were answered"));
        assert_eq!(m.topic, "ke/cloud/meta/error/default/configmap");
    }
}
