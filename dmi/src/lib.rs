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
            call_timeout_ms: default_call_timeout_ms(),
            retry_max_ms: default_retry_max_ms(),
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
