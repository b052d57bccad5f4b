//! KubeEdge's DMI (Device Management Interface) on the node: `DeviceManagerService` on a unix
//! socket for mappers built from mapper-framework, and the `DeviceMapperService` calls that
//! keep each mapper holding exactly the node's devices and models of its protocol.
//!
//! - [`pb`]: KubeEdge's `api.proto` (`proto/api.proto`), compiled by tonic-build into
//!   `src/generated/` (regenerate: `cargo run --manifest-path dmi/codegen/Cargo.toml`).
//! - `convert`: the stored Device / DeviceModel JSON → proto, as KubeEdge converts them.
//! - `server`: the gRPC service; reports go to the MetaManager's device families.
//! - `registry`: the owner of the node's device set (from the MetaManager's DMI feed), the
//!   registered mappers and their report limits.
//! - `dispatch`: one task per mapper: the calls, in order per device, retried with back-off.

pub mod convert;
mod dispatch;
mod error;
mod registry;
mod server;

/// KubeEdge's DMI API, `v1beta1` (package `v1beta1`).
#[allow(clippy::all, missing_docs, rust_2018_idioms)]
pub mod pb {
    include!("generated/v1beta1.rs");
}

use std::path::PathBuf;

use edgemeta_broker::Link;
use edgemeta_metamanager::DeviceReports;
use serde::Deserialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use error::Error;

/// `devices:` in the node's configuration.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DevicesConfig {
    #[serde(default)]
    pub dmi: DmiConfig,
}

/// `devices.dmi`: the DMI server. Off unless `socket` is set.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DmiConfig {
    /// The unix socket `DeviceManagerService` listens on (KubeEdge's default and the one
    /// mapper-framework's config names: `/etc/kubeedge/dmi.sock`). Unset: no DMI server.
    #[serde(default)]
    pub socket: Option<PathBuf>,
    /// Reports (twins and states) each mapper may make per second, its tokens refilled at
    /// this rate; past it a report gets `RESOURCE_EXHAUSTED` (`EM-DMI-LIMIT`).
    #[serde(default = "default_reports_per_s")]
    pub reports_per_s: u32,
    /// How many reports a mapper may make at once above its rate.
    #[serde(default = "default_report_burst")]
    pub report_burst: u32,
    /// Largest gRPC request accepted (bytes); a larger one gets `OUT_OF_RANGE`.
    #[serde(default = "default_max_request_bytes")]
    pub max_request_bytes: usize,
    /// Twins one `ReportDeviceStatus` may carry.
    #[serde(default = "default_max_twins")]
    pub max_twins_per_report: usize,
    /// Mappers (protocols) that may be registered at once.
    #[serde(default = "default_max_mappers")]
    pub max_mappers: usize,
    /// Connections to the socket open at once; one past it is closed before any HTTP/2 work
    /// (`EM-DMI-CONNECTIONS`). Twice `max_mappers`: a restarted mapper connects while the node
    /// may not yet have seen its old connection close, and tools (grpcurl) connect too.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How long a new connection may stay silent before its first bytes (the HTTP/2 preface);
    /// past it the node closes it, freeing its `max_connections` slot (`EM-DMI-SILENT`), so
    /// silent connections cannot lock mappers out. Once it has sent a byte, no deadline.
    #[serde(default = "default_preface_timeout_ms")]
    pub preface_timeout_ms: u64,
    /// Requests one connection may have open at once (HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`);
    /// past it the mapper's client waits instead of HTTP/2 closing the connection on a backlog.
    #[serde(default = "default_max_streams_per_connection")]
    pub max_streams_per_connection: u32,
    /// Requests of one connection served at once; the rest of its open ones wait their turn.
    #[serde(default = "default_max_served_per_connection")]
    pub max_served_per_connection: usize,
    /// How long one call to a mapper may take before it counts as failed (KubeEdge: 10 s).
    #[serde(default = "default_call_timeout_ms")]
    pub call_timeout_ms: u64,
    /// The longest wait between retries of a failed call to a mapper.
    #[serde(default = "default_retry_max_ms")]
    pub retry_max_ms: u64,
}

const fn default_reports_per_s() -> u32 {
    2_000
}
const fn default_report_burst() -> u32 {
    4_000
}
const fn default_max_request_bytes() -> usize {
    1024 * 1024
}
const fn default_max_twins() -> usize {
    1_024
}
const fn default_max_mappers() -> usize {
    64
}
const fn default_max_connections() -> usize {
    2 * default_max_mappers()
}
const fn default_preface_timeout_ms() -> u64 {
    10_000
}
/// Requests a mapper may have open at once on one connection (HTTP/2
/// `SETTINGS_MAX_CONCURRENT_STREAMS`); past it the mapper's client waits. tonic leaves this
/// unlimited, and h2 (0.4.20, `proto/streams/streams.rs` `recv_data`, `Counts::
/// record_data_frame`) closes a connection with `ENHANCE_YOUR_CALM` ("too_many_data_frames")
/// once the small DATA frames it holds unread pass a budget: a mapper of 1,000 devices whose
/// node stalled for 4 s had about 4,000 reports waiting and lost them all with the connection.
/// Four times the requests served at once per connection (64).
const fn default_max_streams_per_connection() -> u32 {
    256
}
const fn default_max_served_per_connection() -> usize {
    64
}
const fn default_call_timeout_ms() -> u64 {
    10_000
}
const fn default_retry_max_ms() -> u64 {
    5_000
}

impl Default for DmiConfig {
    fn default() -> Self {
        DmiConfig {
            socket: None,
            reports_per_s: default_reports_per_s(),
            report_burst: default_report_burst(),
            max_request_bytes: default_max_request_bytes(),
            max_twins_per_report: default_max_twins(),
            max_mappers: default_max_mappers(),
            max_connections: default_max_connections(),
            preface_timeout_ms: default_preface_timeout_ms(),
            max_streams_per_connection: default_max_streams_per_connection(),
            max_served_per_connection: default_max_served_per_connection(),
            call_timeout_ms: default_call_timeout_ms(),
            retry_max_ms: default_retry_max_ms(),
        }
    }
}

impl DmiConfig {
    /// Refuses bounds the server cannot run with (a zero would refuse every connection, close
    /// it before its first bytes, or leave every request waiting), naming the key.
    pub fn validate(&self) -> Result<(), Error> {
        let zero = [
            ("max_connections", self.max_connections == 0),
            ("preface_timeout_ms", self.preface_timeout_ms == 0),
            (
                "max_streams_per_connection",
                self.max_streams_per_connection == 0,
            ),
            (
                "max_served_per_connection",
                self.max_served_per_connection == 0,
            ),
        ];
        match zero.iter().find(|(_, is_zero)| *is_zero) {
            Some((key, _)) => Err(Error::Config(format!("devices.dmi.{key} must be >= 1"))),
            None => Ok(()),
        }
    }
}

/// The filters the DMI server's broker link subscribes to.
pub fn subscriptions() -> Vec<String> {
    vec![edgemeta_metamanager::dmi_feed::FILTER.to_owned()]
}

/// A running DMI server: the gRPC listener and the registry with its mappers' tasks.
pub struct Dmi {
    server: JoinHandle<()>,
    registry: JoinHandle<()>,
}

impl Dmi {
    /// Binds `config.socket` (which must be set) and starts serving; `link` is subscribed to
    /// [`subscriptions`]. A stale socket file is replaced; its directory is created (0750).
    pub async fn start(
        config: &DmiConfig,
        link: Link,
        reports: DeviceReports,
        cancel: CancellationToken,
    ) -> Result<Dmi, Error> {
        config.validate()?;
        let path = config.socket.clone().ok_or(Error::NoSocket)?;
        let listener = server::bind(&path).await?;
        let (asks, registry) =
            registry::spawn(config.clone(), link, reports.clone(), cancel.clone());
        let server = tokio::spawn(server::serve(
            listener,
            path,
            config.clone(),
            asks,
            reports,
            cancel,
        ));
        Ok(Dmi { server, registry })
    }

    /// Waits until the server and the registry have stopped (cancel their token first), so
    /// nothing holds the MetaManager's [`DeviceReports`] any more.
    pub async fn stopped(self) {
        let _ = self.server.await;
        let _ = self.registry.await;
    }
}
