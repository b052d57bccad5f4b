//! The cloud bridge: carries messages between the node and a cloud MQTT broker with durable
//! store-and-forward, and tells the node when the cloud link goes up or down.
//!
//! # Layout
//! - [`config`]: the `cloud:` settings and the MQTT options built from them.
//! - [`tls`]: `mqtts://`: server verification, client certificates, ALPN; files re-read per session.
//! - [`topic_map`]: local `<root>/cloud/...` ↔ cloud `<cloud_root>/<node_id>/up|down/...` topics.
//! - [`cloud`]: the bridge's run loop (`mod.rs`: sessions with backoff, task ownership), one
//!   connection's lifetime (`session.rs`), egress (`egress.rs`: local traffic → outbox → cloud,
//!   deleted after the cloud broker's PUBACK, the in-flight `Window`), ingress (`ingress.rs`:
//!   cloud → MetaManager, acknowledged after commit), the connection signal (`signal.rs`).

mod cloud;
mod config;
mod error;
mod tls;
mod topic_map;

pub use cloud::{CloudBridge, CloudStatus};
pub use config::CloudConfig;
pub use error::Error;
pub use topic_map::TopicMap;
