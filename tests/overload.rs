//! A publisher far faster than the store: nothing it was told "OK" about may be lost, and
//! nothing may be silently dropped on the way to the MetaManager.

mod common;

use common::{envelope, topic, wait_until, Node};
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
