//! The `cloud_connected` / `cloud_disconnected` signal, published on the local broker so that the
//! MetaManager and every other module learn the cloud link's state as KubeEdge's edgehub tells it.

use edgemeta_broker::{Message, Publisher};
use edgemeta_protocol::{json_string, Envelope, Route};
use tracing::{error, info};

/// The cloud link's state as the signal names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkState {
    Connected,
    Disconnected,
}

impl LinkState {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            LinkState::Connected => "cloud_connected",
            LinkState::Disconnected => "cloud_disconnected",
        }
    }
}

/// The connection signal's envelope: locally, and to the cloud as birth message and Last Will.
pub(super) fn envelope(state: LinkState) -> Vec<u8> {
    let route = Route {
        source: "edgehub".to_owned(),
        group: "meta".to_owned(),
        operation: "connect".to_owned(),
        resource: "node/connection".to_owned(),
    };
    Envelope::new(route, json_string(state.as_str())).to_bytes()
}

/// Publishes the connection signal through the bridge's link.
pub(super) struct Signal {
    publisher: Publisher,
    topic: String,
}

impl Signal {
    pub(super) fn new(publisher: Publisher, local_root: &str) -> Signal {
        Signal {
            publisher,
            topic: format!("{local_root}/meta/edgehub/connect/node/connection"),
        }
    }

    /// A signal that cannot be published is logged, not returned: the session goes on either way.
    pub(super) async fn send(&self, state: LinkState) {
        let payload = envelope(state);
        let state = state.as_str();
        if self
            .publisher
            .publish(Message::new(self.topic.clone(), payload))
            .await
            .is_err()
        {
            error!(
                error_code = "EM-BRIDGE-SIGNAL",
                state, "cannot publish the connection signal"
            );
        }
        info!(state, "cloud connection signal");
    }
}
