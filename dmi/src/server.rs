//! `DeviceManagerService` on the node's unix socket. Registrations go to the registry; reports
//! become the MQTT mapper topics' messages (`twin/update`, `state/update`), applied by the same
//! MetaManager families and answered only once committed.

// Helpers here return tonic's `Status`, which the service methods answer as it is.
#![allow(clippy::result_large_err)]

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use edgemeta_metamanager::{DeviceReports, Verdict};
use serde_json::{json, Map, Value};
use tokio::net::UnixListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::{error, info};

use crate::error::Error;
use crate::pb;
use crate::pb::device_manager_service_server::{DeviceManagerService, DeviceManagerServiceServer};
use crate::registry::Ask;
use crate::DmiConfig;

/// Longest mapper socket path accepted (a `sockaddr_un` holds 108 bytes).
const MAX_ADDRESS: usize = 108;
/// Longest name, namespace, protocol or state a request may carry.
const MAX_NAME: usize = 253;
/// Requests a mapper may have open at once on one connection (HTTP/2
/// `SETTINGS_MAX_CONCURRENT_STREAMS`); past it the mapper's client waits. tonic leaves this
/// unlimited, and h2 (0.4.20, `proto/streams/streams.rs` `recv_data`, `Counts::
/// record_data_frame`) closes a connection with `ENHANCE_YOUR_CALM` ("too_many_data_frames")
/// once the small DATA frames it holds unread pass a budget: a mapper of 1,000 devices whose
/// node stalled for 4 s had about 4,000 reports waiting and lost them all with the connection.
/// Four times the requests served at once per connection (64).
const MAX_STREAMS: u32 = 256;

/// Binds `path`: its directory made (0750, as KubeEdge's `CreateListener`), a stale socket
/// removed, the socket itself 0660 (the node's user and group).
pub(crate) async fn bind(path: &Path) -> Result<UnixListener, Error> {
    let fail = |source| Error::Socket {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(dir)
                .map_err(fail)?;
        }
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let listener = UnixListener::bind(path).map_err(fail)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(fail)?;
    Ok(listener)
}

/// Serves until `cancel`; then removes the socket file.
pub(crate) async fn serve(
    listener: UnixListener,
    path: PathBuf,
    config: DmiConfig,
    asks: mpsc::Sender<Ask>,
    reports: DeviceReports,
    cancel: CancellationToken,
) {
    let limit = config.max_request_bytes;
    let service = DeviceManagerServiceServer::new(Manager {
        asks,
        reports,
        config,
    })
    .max_decoding_message_size(limit);
    info!(socket = %path.display(), "DMI server listening");
    let served = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(64)
        .max_concurrent_streams(MAX_STREAMS)
        .add_service(service)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), cancel.cancelled_owned())
        .await;
    if let Err(e) = served {
        error!(error_code = "EM-DMI-SOCKET", error = %e, "DMI server stopped");
    }
    let _ = std::fs::remove_file(&path);
}

struct Manager {
    asks: mpsc::Sender<Ask>,
    reports: DeviceReports,
    config: DmiConfig,
}

fn bad(what: &str) -> Status {
    Status::invalid_argument(format!("EM-DMI-REQUEST: {what}"))
}

fn name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_NAME && !s.contains(['/', '+', '#'])
}

/// The node's device id of a report (`<namespace>/<name>`; a report without a namespace names
/// a one-level id, as MQTT mappers of KubeEdge < 1.15 do).
fn device_id(namespace: &str, name: &str) -> Result<String, Status> {
    if !name_ok(name) || !(namespace.is_empty() || name_ok(namespace)) {
        return Err(bad(
            "deviceName and deviceNamespace must be one topic level each",
        ));
    }
    Ok(if namespace.is_empty() {
        name.to_owned()
    } else {
        format!("{namespace}/{name}")
    })
}

fn answer(verdict: Verdict) -> Result<(), Status> {
    match verdict {
        Verdict::Stored => Ok(()),
        Verdict::Refused { code: 404, reason } => {
            Err(Status::not_found(format!("EM-DMI-UNKNOWN: {reason}")))
        }
        Verdict::Refused { code, reason } if code < 500 => Err(Status::invalid_argument(format!(
            "EM-DEVICE-REFUSED: {reason}"
        ))),
        Verdict::Refused { reason, .. } => Err(Status::internal(format!("EM-DMI-STORE: {reason}"))),
        Verdict::Retry => Err(Status::unavailable(
            "EM-DMI-STORE: not stored now; report again",
        )),
    }
}

impl Manager {
    /// Asks the registry whether `id`'s mapper may report now (the device is the node's, its
    /// mapper within its limit).
    async fn admit(&self, namespace: &str, name: &str) -> Result<(), Status> {
        let (reply, rx) = oneshot::channel();
        let ask = Ask::Admit {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            reply,
        };
        self.asks
            .send(ask)
            .await
            .map_err(|_| Status::unavailable("EM-DMI-CLOSED: the node is stopping"))?;
        rx.await
            .map_err(|_| Status::unavailable("EM-DMI-CLOSED: the node is stopping"))?
    }
}

#[tonic::async_trait]
impl DeviceManagerService for Manager {
    async fn mapper_register(
        &self,
        request: Request<pb::MapperRegisterRequest>,
    ) -> Result<Response<pb::MapperRegisterResponse>, Status> {
        let request = request.into_inner();
        let mapper = request.mapper.ok_or_else(|| bad("mapper is required"))?;
        if !name_ok(&mapper.protocol) {
            return Err(bad("mapper.protocol is required, one topic level"));
        }
        if mapper.address.is_empty() || mapper.address.len() > MAX_ADDRESS {
            return Err(bad("mapper.address must be the mapper's unix socket path"));
        }
        let Ok(address) = String::from_utf8(mapper.address.clone()) else {
            return Err(bad("mapper.address is not UTF-8"));
        };
        if mapper.name.len() > MAX_NAME || mapper.version.len() > MAX_NAME {
            return Err(bad("mapper.name or version too long"));
        }
        let (reply, rx) = oneshot::channel();
        let ask = Ask::Register {
            mapper,
            address: PathBuf::from(address),
            with_data: request.with_data,
            reply,
        };
        self.asks
            .send(ask)
            .await
            .map_err(|_| Status::unavailable("EM-DMI-CLOSED: the node is stopping"))?;
        let response = rx
            .await
            .map_err(|_| Status::unavailable("EM-DMI-CLOSED: the node is stopping"))??;
        Ok(Response::new(response))
    }

    async fn report_device_status(
        &self,
        request: Request<pb::ReportDeviceStatusRequest>,
    ) -> Result<Response<pb::ReportDeviceStatusResponse>, Status> {
        let request = request.into_inner();
        let id = device_id(&request.device_namespace, &request.device_name)?;
        let status = request
            .reported_device
            .ok_or_else(|| bad("reportedDevice is required"))?;
        if status.twins.is_empty() {
            return Err(bad("reportedDevice.twins is empty"));
        }
        if status.twins.len() > self.config.max_twins_per_report {
            return Err(Status::out_of_range(format!(
                "EM-DMI-REQUEST: {} twins in one report; at most {}",
                status.twins.len(),
                self.config.max_twins_per_report
            )));
        }
        let twin = twins_of(&status.twins)?;
        self.admit(&request.device_namespace, &request.device_name)
            .await?;
        let payload = json!({"event_id": "", "timestamp": now_ms(), "twin": twin});
        let verdict = self
            .reports
            .twin_update(&id, Bytes::from(payload.to_string()))
            .await;
        answer(verdict).map(|()| Response::new(pb::ReportDeviceStatusResponse {}))
    }

    async fn report_device_states(
        &self,
        request: Request<pb::ReportDeviceStatesRequest>,
    ) -> Result<Response<pb::ReportDeviceStatesResponse>, Status> {
        let request = request.into_inner();
        let id = device_id(&request.device_namespace, &request.device_name)?;
        if request.state.is_empty() || request.state.len() > MAX_NAME {
            return Err(bad("state is required"));
        }
        self.admit(&request.device_namespace, &request.device_name)
            .await?;
        let payload = json!({"event_id": "", "timestamp": now_ms(), "state": request.state});
        let verdict = self
            .reports
            .state_update(&id, Bytes::from(payload.to_string()))
            .await;
        answer(verdict).map(|()| Response::new(pb::ReportDeviceStatesResponse {}))
    }
}

/// A report's twins as a mapper's `twin/update` names them: the reported value as `actual`,
/// with the type the mapper gives in its metadata. `observedDesired` is not written back as
/// `expected` (KubeEdge does): the node's expected value is the desired one the cloud set, and
/// a mapper's echo would outrank a newer desired value by version (docs/devices.md).
fn twins_of(twins: &[pb::Twin]) -> Result<Value, Status> {
    let mut out = Map::new();
    for twin in twins {
        if twin.property_name.is_empty() {
            return Err(bad("a twin without propertyName"));
        }
        let reported = twin
            .reported
            .as_ref()
            .ok_or_else(|| bad("a twin without reported"))?;
        let mut entry = json!({"actual": {"value": reported.value}});
        if let Some(kind) = reported.metadata.get("type").filter(|t| !t.is_empty()) {
            entry["metadata"] = json!({"type": kind.to_ascii_lowercase()});
        }
        out.insert(twin.property_name.clone(), entry);
    }
    Ok(Value::Object(out))
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}
