//! `DeviceManagerService` on the node's unix socket. Registrations go to the registry; reports
//! become the MQTT mapper topics' messages (`twin/update`, `state/update`), applied by the same
//! MetaManager families and answered only once committed.

// Helpers here return tonic's `Status`, which the service methods answer as it is.
#![allow(clippy::result_large_err)]

use std::future::Future;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use edgemeta_metamanager::{DeviceReports, Verdict};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};
use tracing::{error, info, warn};

use crate::error::Error;
use crate::pb;
use crate::pb::device_manager_service_server::{DeviceManagerService, DeviceManagerServiceServer};
use crate::registry::Ask;
use crate::DmiConfig;

/// Longest mapper socket path accepted (a `sockaddr_un` holds 108 bytes).
const MAX_ADDRESS: usize = 108;
/// Longest name, namespace, protocol or state a request may carry.
const MAX_NAME: usize = 253;
/// How often at most a refused connection, or one closed silent, is logged; the line counts
/// those since the last of its kind.
const CLOSED_LOG_EVERY: Duration = Duration::from_secs(10);

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
    let served_at_once = config.max_served_per_connection;
    // Bounded, never tonic's unlimited default: see `default_max_streams_per_connection`.
    let streams = config.max_streams_per_connection;
    let limits = Limits {
        max_connections: config.max_connections,
        preface_timeout: Duration::from_millis(config.preface_timeout_ms),
    };
    let incoming = Admit::new(UnixListenerStream::new(listener), limits, &cancel);
    let service = DeviceManagerServiceServer::new(Manager {
        asks,
        reports,
        config,
    })
    .max_decoding_message_size(limit);
    info!(socket = %path.display(), "DMI server listening");
    let served = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(served_at_once)
        .max_concurrent_streams(streams)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, cancel.cancelled_owned())
        .await;
    if let Err(e) = served {
        error!(error_code = "EM-DMI-SOCKET", error = %e, "DMI server stopped");
    }
    let _ = std::fs::remove_file(&path);
}

/// Closed connections of one kind, counted for a log line at most once per
/// [`CLOSED_LOG_EVERY`]: a burst of hostile connections costs a line at its start and one with
/// the rest of its count at the interval's end, not one each, and no close goes uncounted.
#[derive(Debug, Default)]
struct Tally {
    /// Closed since the last log line, and when that line was.
    count: u64,
    logged: Option<Instant>,
    /// A line for the count is already due at the interval's end.
    due: bool,
}

/// What a close asks of the log.
#[derive(Debug, PartialEq)]
enum LogNow {
    /// A line with this count, now.
    Line(u64),
    /// A line with the count then, at this instant (the interval's end).
    At(Instant),
    /// Nothing: a line is already due.
    Counted,
}

impl Tally {
    /// Counts one close at `now`.
    fn closed(&mut self, now: Instant) -> LogNow {
        self.count += 1;
        match self.logged {
            Some(at) if now.duration_since(at) < CLOSED_LOG_EVERY => {
                if std::mem::replace(&mut self.due, true) {
                    LogNow::Counted
                } else {
                    LogNow::At(at + CLOSED_LOG_EVERY)
                }
            }
            _ => {
                self.logged = Some(now);
                LogNow::Line(std::mem::take(&mut self.count))
            }
        }
    }

    /// At the interval's end: the count since the last line, to log now (0: nothing).
    fn due(&mut self, now: Instant) -> u64 {
        self.due = false;
        if self.count > 0 {
            self.logged = Some(now);
        }
        std::mem::take(&mut self.count)
    }
}

/// One kind of close (refused at accept, or silent past its deadline), shared by the accept
/// loop and every connection: its [`Tally`] behind a lock, taken only when one closes.
struct Closes {
    tally: Mutex<Tally>,
    /// Writes the kind's log line with a count.
    line: fn(&Limits, u64),
    limits: Limits,
    /// A line due at the interval's end is written at once when the server stops.
    cancel: CancellationToken,
}

/// The settings a close's log line names.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    preface_timeout: Duration,
}

impl Closes {
    fn new(line: fn(&Limits, u64), limits: Limits, cancel: CancellationToken) -> Arc<Closes> {
        Arc::new(Closes {
            tally: Mutex::new(Tally::default()),
            line,
            limits,
            cancel,
        })
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one close; logs it now, or leaves it to the line due at the interval's end (a
    /// task that sleeps until then, one per interval at most).
    fn closed(self: &Arc<Self>) {
        let log = self.tally().closed(Instant::now());
        match log {
            LogNow::Line(count) => (self.line)(&self.limits, count),
            LogNow::At(at) => {
                let closes = self.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at.into()) => {}
                        _ = closes.cancel.cancelled() => {}
                    }
                    let count = closes.tally().due(Instant::now());
                    if count > 0 {
                        (closes.line)(&closes.limits, count);
                    }
                });
            }
            LogNow::Counted => {}
        }
    }
}

/// The line for connections refused at accept, `max_connections` being open.
fn refused_line(limits: &Limits, refused: u64) {
    warn!(
        error_code = "EM-DMI-CONNECTIONS",
        max_connections = limits.max_connections,
        refused,
        "closed DMI connections at once: devices.dmi.max_connections are open"
    );
}

/// The line for connections closed for sending nothing within the preface timeout.
fn silent_line(limits: &Limits, closed: u64) {
    warn!(
        error_code = "EM-DMI-SILENT",
        preface_timeout_ms = limits.preface_timeout.as_millis() as u64,
        closed,
        "closed DMI connections that sent nothing within devices.dmi.preface_timeout_ms"
    );
}

/// The accepted connections, each holding one of `max_connections` permits until it closes;
/// one accepted with none left is closed at once, before HTTP/2 reads or writes a byte.
struct Admit {
    inner: UnixListenerStream,
    permits: Arc<Semaphore>,
    preface_timeout: Duration,
    refused: Arc<Closes>,
    silent: Arc<Closes>,
}

impl Admit {
    fn new(inner: UnixListenerStream, limits: Limits, cancel: &CancellationToken) -> Admit {
        Admit {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            preface_timeout: limits.preface_timeout,
            refused: Closes::new(refused_line, limits, cancel.clone()),
            silent: Closes::new(silent_line, limits, cancel.clone()),
        }
    }
}

impl Stream for Admit {
    type Item = std::io::Result<Admitted>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            let stream = match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(stream))) => stream,
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            };
            match self.permits.clone().try_acquire_owned() {
                Ok(permit) => {
                    return Poll::Ready(Some(Ok(Admitted {
                        inner: stream,
                        _permit: permit,
                        preface: Some(Box::pin(tokio::time::sleep(self.preface_timeout))),
                        silent: self.silent.clone(),
                    })))
                }
                Err(_) => {
                    drop(stream);
                    self.refused.closed();
                }
            }
        }
    }
}

/// An admitted connection: its permit is given back when tonic drops it (the connection closed).
/// Until its first bytes arrive, a read past the `preface_timeout_ms` deadline set at accept
/// fails with `TimedOut`, so HTTP/2 drops the connection and frees the permit.
struct Admitted {
    inner: UnixStream,
    _permit: OwnedSemaphorePermit,
    /// The deadline for the first bytes; `None` once they came.
    preface: Option<Pin<Box<Sleep>>>,
    silent: Arc<Closes>,
}

impl Connected for Admitted {
    type ConnectInfo = <UnixStream as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl AsyncRead for Admitted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let read = Pin::new(&mut this.inner).poll_read(cx, buf);
        let Some(deadline) = this.preface.as_mut() else {
            return read;
        };
        match read {
            Poll::Ready(Ok(())) if buf.filled().len() > before => this.preface = None,
            // The end of the stream or an error: HTTP/2 closes the connection on either.
            Poll::Ready(_) => {}
            Poll::Pending => {
                if deadline.as_mut().poll(cx).is_ready() {
                    this.preface = None;
                    this.silent.closed();
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "nothing sent within devices.dmi.preface_timeout_ms",
                    )));
                }
            }
        }
        read
    }
}

impl AsyncWrite for Admitted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_closes_is_logged_at_its_start_and_the_rest_of_its_count_at_the_interval_end() {
        let mut tally = Tally::default();
        let start = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(tally.closed(start), LogNow::Line(1));
        assert_eq!(
            tally.closed(start + ms(1)),
            LogNow::At(start + CLOSED_LOG_EVERY)
        );
        for _ in 0..35 {
            assert_eq!(tally.closed(start + ms(2)), LogNow::Counted);
        }
        let end = start + CLOSED_LOG_EVERY;
        assert_eq!(tally.due(end), 36, "every close after the first line");
        // One close in the next interval waits for that interval's end, too.
        assert_eq!(
            tally.closed(end + ms(500)),
            LogNow::At(end + CLOSED_LOG_EVERY)
        );
        assert_eq!(tally.due(end + CLOSED_LOG_EVERY), 1);
        // A quiet interval ends without a line, and the next close is logged at once.
        let quiet = end + 3 * CLOSED_LOG_EVERY;
        assert_eq!(tally.due(quiet), 0);
        assert_eq!(tally.closed(quiet + ms(1)), LogNow::Line(1));
    }
}
