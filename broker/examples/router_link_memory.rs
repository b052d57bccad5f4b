//! What rumqttd 0.20's router holds per connection, measured through its public link API:
//! N links idle, then each subscribed to a topic of its own, then after one burst of 150
//! messages each. Run: `cargo run --release -p edgemeta-broker --example router_link_memory -- 2000`.
//!
//! The one-path design (ARCHITECTURE.md, "The broker's one path") rests on these figures.

use std::time::{Duration, Instant};

use rumqttd::local::LinkBuilder;
use rumqttd::{Router, RouterConfig};

mod common;
use common::rss_kb;

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn report(what: &str, base: u64, n: usize) {
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss_kb().saturating_sub(base);
    println!(
        "{what}: +{grown} KB, {:.1} KB per link",
        grown as f64 / n as f64
    );
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    println!(
        "size_of: Notification {} B, Packet {} B (each link's router buffers hold 200 of each)",
        std::mem::size_of::<rumqttd::Notification>(),
        std::mem::size_of::<rumqttd::protocol::Packet>(),
    );
    let config = RouterConfig {
        max_connections: n + 10,
        max_outgoing_packet_count: 200,
        max_segment_size: 1 << 20,
        max_segment_count: 4,
        custom_segment: None,
        initialized_filters: None,
        shared_subscriptions_strategy: Default::default(),
    };
    let router = Router::new(0, config).spawn();
    std::thread::sleep(Duration::from_millis(300));
    let base = rss_kb();

    let mut links = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("device-{i}");
        let (tx, rx, _connack) = LinkBuilder::new(&id, router.clone()).build().expect("link");
        links.push((tx, rx));
    }
    report(&format!("{n} idle links"), base, n);

    for (i, (tx, _)) in links.iter_mut().enumerate() {
        tx.subscribe(format!("dev/{i}/cmd")).expect("subscribe");
    }
    report("each subscribed to its own topic", base, n);

    for (i, (tx, rx)) in links.iter_mut().enumerate() {
        for _ in 0..150 {
            tx.publish(format!("dev/{i}/cmd"), vec![0u8; 64])
                .expect("publish");
        }
        let mut got = 0;
        while got < 150 {
            match rx.recv_deadline(Instant::now() + Duration::from_millis(50)) {
                Ok(Some(_)) => got += 1,
                _ => break,
            }
        }
    }
    report("after a 150-message burst each, all read", base, n);
}
