//! A publisher far faster than the store: nothing it was told "OK" about may be lost, and
//! nothing may be silently dropped on the way to the MetaManager.

mod common;

use common::{envelope, topic, Node};
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
    // Wait until the store stops growing.
    let mut last = 0;
    let mut still = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(240);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let rows = node.meta_rows().await.len();
        if rows == TOTAL {
            return;
        }
        if rows != last {
            last = rows;
            still = Instant::now();
        }
        assert!(
            still.elapsed() < Duration::from_secs(10) && Instant::now() < deadline,
            "{rows} of {TOTAL} inserts stored; the rest were lost:\n{}",
            node.log()
                .lines()
                .rev()
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
