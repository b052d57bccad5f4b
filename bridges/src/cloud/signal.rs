//! The `cloud_connected` / `cloud_disconnected` signal, published on the local broker so that the
//! MetaManager and every other module learn the cloud link's state as KubeEdge's edgehub tells it.

use edgemeta_broker::{Message, Publisher};
use edgemeta_metamanager::envelope::{json_string, Envelope, Route};
use tracing::{error, info};

/// The cloud link's state as the signal names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkState {
    Connected,
    Disconnected,
}

impl LinkState {
    fn as_str(self) -> &'static str {
        match self {
            LinkState::Connected => "cloud_connected",
            LinkState::Disconnected => "cloud_disconnected",
        }
    }
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
        let state = state.as_str();
        let route = Route {
            source: "edgehub".to_owned(),
            group: "meta".to_owned(),
            operation: "connect".to_owned(),
            resource: "node/connection".to_owned(),
        };
        let payload = Envelope::new(route, json_string(state)).to_bytes();
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
