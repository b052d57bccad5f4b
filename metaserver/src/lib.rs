//! The node's Kubernetes API (KubeEdge's MetaServer): read-only `get`, `list` and `watch` of the
//! objects the node stores, over HTTP on `metaserver.address` (127.0.0.1:10550), answered from
//! the store whether or not the cloud is connected.
//!
//! Versions are node-local (docs/protocol.md §9): the store gives every change of a served
//! object the next value of one sequence in the change's own transaction, and keeps the last
//! `metaserver.history` changes. A watch replays the history after the version it asks for,
//! then streams the committed changes live; a version the history no longer covers gets an
//! `ERROR` event with a 410 `Status`, as the API server does.
//!
//! # Layout
//! - [`kinds`]: the served types and their store types.
//! - [`object`]: a stored object served with the node's version; selectors.
//! - `http`: paths, discovery, list and get, the token check, 405 for writes.
//! - `watch`: history replay, live changes, bookmarks, timeouts.
//! - [`error`]: the crate's error and its `Status` body.

mod error;
mod http;
mod kinds;
mod object;
mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use edgemeta_metamanager::store::{Changes, Reader};
use edgemeta_metamanager::Meters;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

pub use error::Error;

/// MetaServer settings (`metaserver:` in the YAML config).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetaServerConfig {
    /// `false`: no listener (versions and history are still kept).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Where it listens; keep it on loopback unless the node's pods must reach it otherwise.
    #[serde(default = "default_address")]
    pub address: SocketAddr,
    /// Changes kept for watches to resume from; a version older than that gets 410.
    #[serde(default = "default_history")]
    pub history: u64,
    /// Serve secrets.
    #[serde(default = "default_true")]
    pub secrets: bool,
    /// A file holding a bearer token every request must carry; none: no authentication.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// How long a watch without `timeoutSeconds` stays open, in seconds.
    #[serde(default = "default_watch_timeout_s")]
    pub watch_timeout_s: u64,
    /// How often a watch that allows bookmarks gets one, in seconds.
    #[serde(default = "default_bookmark_interval_s")]
    pub bookmark_interval_s: u64,
}

const fn default_true() -> bool {
    true
}
fn default_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 10550))
}
const fn default_history() -> u64 {
    edgemeta_metamanager::store::default_history()
}
const fn default_watch_timeout_s() -> u64 {
    1800
}
const fn default_bookmark_interval_s() -> u64 {
    60
}

impl Default for MetaServerConfig {
    fn default() -> Self {
        MetaServerConfig {
            enabled: true,
            address: default_address(),
            history: default_history(),
            secrets: true,
            token_file: None,
            watch_timeout_s: default_watch_timeout_s(),
            bookmark_interval_s: default_bookmark_interval_s(),
        }
    }
}

/// What every request shares.
pub(crate) struct Shared {
    pub reader: Reader,
    pub changes: broadcast::Sender<Changes>,
    /// Where a live event's delay after its commit is recorded.
    pub meters: Arc<Meters>,
    pub kinds: &'static [edgemeta_kubewire::Kind],
    pub token: Option<String>,
    pub watch_timeout: Duration,
    pub bookmark_interval: Duration,
    pub address: String,
    pub cancel: CancellationToken,
}

/// Binds `config.address` (start-up fails on a taken address, naming it).
pub async fn bind(config: &MetaServerConfig) -> Result<TcpListener, Error> {
    TcpListener::bind(config.address)
        .await
        .map_err(|source| Error::Bind {
            address: config.address.to_string(),
            source,
        })
}

/// A MetaServer ready to serve: its token read.
pub struct MetaServer {
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl MetaServer {
    /// Prepares serving on `listener` from `reader` and the committed `changes`; `meters`
    /// records how long after its commit each live event reaches a watch.
    pub fn new(
        config: &MetaServerConfig,
        listener: TcpListener,
        reader: Reader,
        changes: broadcast::Sender<Changes>,
        meters: Arc<Meters>,
        cancel: CancellationToken,
    ) -> Result<MetaServer, Error> {
        let token = match &config.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| Error::TokenFile {
                    path: path.display().to_string(),
                    source,
                })?;
                let token = text.trim().to_owned();
                if token.is_empty() {
                    return Err(Error::EmptyToken(path.display().to_string()));
                }
                Some(token)
            }
            None => None,
        };
        let address = listener
            .local_addr()
            .map_or_else(|_| config.address.to_string(), |a| a.to_string());
        Ok(MetaServer {
            shared: Arc::new(Shared {
                reader,
                changes,
                meters,
                kinds: kinds::kinds(config.secrets),
                token,
                watch_timeout: Duration::from_secs(config.watch_timeout_s.max(1)),
                bookmark_interval: Duration::from_secs(config.bookmark_interval_s.max(1)),
                address,
                cancel,
            }),
            listener,
        })
    }

    /// The listener and the app to serve on it (with the node's other HTTP listener's serve
    /// loop); open watches end when the token given to [`MetaServer::new`] is cancelled.
    pub fn into_parts(self) -> (TcpListener, axum::Router) {
        let app = axum::Router::new()
            .fallback(http::handle)
            .with_state(self.shared);
        (self.listener, app)
    }
}
