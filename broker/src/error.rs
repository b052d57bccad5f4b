use std::net::SocketAddr;

/// Everything that can go wrong while starting or using the embedded broker.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot listen on {address} (listener `{name}`): {source}")]
    Bind {
        name: String,
        address: SocketAddr,
        source: std::io::Error,
    },
    #[error("listener `{name}` on {address} stopped: {reason}")]
    ListenerStopped {
        name: String,
        address: SocketAddr,
        reason: String,
    },
    #[error("invalid broker config: {0}")]
    Config(String),
    #[error("in-process link `{client_id}` refused by the router: {reason}")]
    Link { client_id: String, reason: String },
    #[error("the broker link is closed")]
    LinkClosed,
}
