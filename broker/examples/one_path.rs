//! The one path serving MQTT on its own, for conformance runs before it serves the node:
//! `cargo run --release -p edgemeta-broker --example one_path -- 127.0.0.1:1883 127.0.0.1:1885`
//! (both versions on every address; `scripts/paho CHECKOUT --server "target/release/examples/one_path"`).

use std::sync::Arc;

use edgemeta_broker::{serve_connection, Hub, HubLimits, Shared};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() {
    let mut addresses: Vec<String> = std::env::args().skip(1).collect();
    if addresses.is_empty() {
        addresses = vec!["127.0.0.1:1883".into(), "127.0.0.1:1885".into()];
    }
    let hub = Arc::new(Hub::new(HubLimits {
        queue_bytes: 1 << 20,
        retained_bytes: 16 << 20,
        max_away_sessions: 10_000,
        queues_bytes: 64 << 20,
        reader_stall: std::time::Duration::from_secs(30),
    }));
    let cancel = CancellationToken::new();
    tokio::spawn(hub.clone().run_timers(cancel.clone()));
    for address in addresses {
        let listener = TcpListener::bind(&address).await.expect("bind");
        let (shared, cancel) = (Arc::new(Shared::open_to_all(hub.clone())), cancel.clone());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve_connection(stream, shared.clone(), cancel.clone()));
            }
        });
    }
    let _ = tokio::signal::ctrl_c().await;
    cancel.cancel();
}
