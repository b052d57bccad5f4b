//! The cloud side of edgemeta (KubeEdge's edgecontroller + cloudhub, on MQTT): watches the
//! Kubernetes API with kube-rs and drives edgemeta nodes through a cloud MQTT broker.
//!
//! # Layout
//! - `envelope`: the message envelope and the cloud broker's topics (docs/protocol.md §1, §5).
//! - `refs`: the configmaps and secrets a pod references.
//! - `routing`: which node needs which object, with reference counts.
//! - `delivery`: per node and object: one in flight, newer versions coalesced, resends, acks.
//! - `status`: pod status merging (transition times kept, no-op writes skipped).
//! - `heartbeat`: node status and Lease writes per node, the write rule, Unknown on a Last Will.
//! - `leader`: Lease-based leader election, for a hot standby.
//! - `devices`: KubeEdge's Devices and DeviceModels down to nodes, DeviceStatus up.
//! - `watch`: the watch loop every kind shares, objects cut down before the owner sees them.
//! - `stream`: kubelet's API for the managed nodes, relayed to their edged over the broker.
//! - `controller`: the owner task: watch events and node messages in, MQTT and API writes out.

mod acked;
mod controller;
mod delivery;
mod devices;
mod envelope;
mod error;
mod heartbeat;
mod leader;
mod refs;
mod routing;
mod status;
pub mod stream;
mod watch;

use std::path::PathBuf;
use std::time::Duration;

pub use controller::run;
pub use delivery::{Delivery, Dispatch, Outgoing};
pub use envelope::{Envelope, UpTopic};
pub use error::Error;
pub use leader::LeaseConfig;
pub use refs::{pod_refs, Ref};
pub use routing::{Routing, EDGE_LABEL};
pub use stream::StreamConfig;

/// How the controller runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// A kubeconfig file; `None`: in-cluster config or `$KUBECONFIG` / `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// The cloud MQTT broker, `mqtt://host:port`.
    pub broker: String,
    pub username: Option<String>,
    pub password: Option<String>,
    /// The cloud broker's topic root (the nodes' `cloud.root`).
    pub root: String,
    /// The controller's MQTT client id (a persistent session: node messages wait for it).
    pub client_id: String,
    /// First resend of an unacknowledged message; doubles up to `resend_max`.
    pub resend: Duration,
    pub resend_max: Duration,
    /// Run only while holding this Lease (replicas as hot standbys); `None`: always run.
    pub leader: Option<LeaseConfig>,
    /// An unchanged node status is written again once its heartbeat is this old (kept under
    /// the node lifecycle controller's 40 s grace with a 10 s heartbeat).
    pub node_status_refresh: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            kubeconfig: None,
            broker: "mqtt://127.0.0.1:1883".to_owned(),
            username: None,
            password: None,
            root: "kubeedge".to_owned(),
            client_id: "edgemeta-edgecontroller".to_owned(),
            resend: Duration::from_secs(5),
            resend_max: Duration::from_secs(60),
            leader: None,
            node_status_refresh: Duration::from_secs(20),
        }
    }
}

impl Config {
    /// `(host, port)` of [`Config::broker`].
    ///
    /// # Errors
    /// [`Error::Config`] for anything but `mqtt://host[:port]`.
    pub fn broker_address(&self) -> Result<(String, u16), Error> {
        let rest = self
            .broker
            .strip_prefix("mqtt://")
            .or_else(|| self.broker.strip_prefix("tcp://"))
            .ok_or_else(|| {
                Error::Config(format!("broker {:?}: want mqtt://host:port", self.broker))
            })?;
        let rest = rest.trim_end_matches('/');
        match rest.rsplit_once(':') {
            Some((host, port)) => port
                .parse()
                .map(|p| (host.to_owned(), p))
                .map_err(|_| Error::Config(format!("broker {:?}: bad port", self.broker))),
            None => Ok((rest.to_owned(), 1883)),
        }
    }
}
