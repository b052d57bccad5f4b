//! kubelet's API for this agent's pods, served on 127.0.0.1 only: `containerLogs`,
//! `/metrics/resource`, `/healthz`, and `exec` over WebSocket (refused with 403 when turned off). Nothing
//! outside the host reaches it; the cloud's requests arrive over the stream link (`stream.rs`),
//! which relays them to this port.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{Path, Query, State, WebSocketUpgrade};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::plan::{ContainerPlan, PodPlan};
use crate::Error;

/// Output chunks a log response may hold before its reader waits (a slow client slows its own
/// stream only).
const LOG_QUEUE: usize = 8;

/// A pod as started on this node: what the kubelet API needs of it.
#[derive(Debug)]
pub struct RunningPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub containers: Vec<ContainerPlan>,
}

type Pods = BTreeMap<String, Arc<RunningPod>>;

/// The pods started here, keyed `<namespace>/<name>`; the agent is its only writer.
pub struct Registry {
    tx: watch::Sender<Pods>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry {
            tx: watch::Sender::new(Pods::new()),
        }
    }

    pub fn reader(&self) -> watch::Receiver<Pods> {
        self.tx.subscribe()
    }

    pub fn insert(&self, key: &str, plan: &PodPlan) {
        let pod = Arc::new(RunningPod {
            namespace: plan.namespace.clone(),
            name: plan.name.clone(),
            uid: plan.uid.clone(),
            containers: plan.containers.clone(),
        });
        self.tx.send_modify(|pods| {
            pods.insert(key.to_owned(), pod);
        });
    }

    pub fn remove(&self, key: &str) {
        self.tx.send_if_modified(|pods| pods.remove(key).is_some());
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct Kubelet {
    pub pods: watch::Receiver<Pods>,
    pub exec: bool,
    /// The followed logs' shared watches.
    pub logs: crate::logwatch::LogWatcher,
    /// Ends the log followers when edged stops.
    pub cancel: CancellationToken,
}

impl Kubelet {
    fn pod(&self, namespace: &str, name: &str) -> Option<Arc<RunningPod>> {
        self.pods
            .borrow()
            .get(&format!("{namespace}/{name}"))
            .cloned()
    }
}

/// The routes, as kubelet's debugging handlers name them.
pub fn router(kubelet: Kubelet) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/containerLogs/:ns/:pod/:container", get(container_logs))
        .route("/metrics/resource", get(resource_metrics))
        .route("/exec/:ns/:pod/:container", any(exec))
        .route("/exec/:ns/:pod/:uid/:container", any(exec_with_uid))
        .fallback(|| async { (StatusCode::NOT_FOUND, "404 page not found\n") })
        .with_state(kubelet)
}

/// Binds 127.0.0.1:`port` (loopback only, by construction) and serves until `cancel`.
pub async fn serve(
    kubelet: Kubelet,
    port: u16,
    cancel: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), Error> {
    let address = SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(address).await.map_err(|e| {
        Error::io(
            "binding kubelet API",
            std::path::Path::new(&address.to_string()),
            e,
        )
    })?;
    let bound = listener.local_addr().map_err(|e| {
        Error::io(
            "binding kubelet API",
            std::path::Path::new(&address.to_string()),
            e,
        )
    })?;
    info!(address = %bound, "kubelet API listening (loopback only)");
    let app = router(kubelet);
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
        if let Err(e) = served {
            warn!(error_code = "EM-EDGED-KUBELET", error = %e, "kubelet API stopped");
        }
    });
    Ok((bound, task))
}

fn text(status: StatusCode, message: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        message,
    )
        .into_response()
}

/// The pod and container named, or kubelet's 404 message.
fn find(
    kubelet: &Kubelet,
    namespace: &str,
    pod: &str,
    container: &str,
) -> Result<(Arc<RunningPod>, ContainerPlan), String> {
    let Some(running) = kubelet.pod(namespace, pod) else {
        return Err(format!(
            "pod \"{pod}\" in namespace \"{namespace}\" does not exist on this node\n"
        ));
    };
    let Some(plan) = running
        .containers
        .iter()
        .find(|c| c.name == container)
        .cloned()
    else {
        return Err(format!(
            "container \"{container}\" not found in pod \"{pod}\"\n"
        ));
    };
    Ok((running, plan))
}

async fn container_logs(
    State(kubelet): State<Kubelet>,
    Path((namespace, pod, container)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let options = match crate::logs::LogOptions::parse(&query, SystemTime::now()) {
        Ok(o) => o,
        Err(message) => return text(StatusCode::BAD_REQUEST, format!("{message}\n")),
    };
    let (running, plan) = match find(&kubelet, &namespace, &pod, &container) {
        Ok(found) => found,
        Err(message) => return text(StatusCode::NOT_FOUND, message),
    };
    let files = crate::logs::run_files(&plan.log_path, options.previous);
    if files.is_empty() {
        let message = if options.previous {
            format!("previous terminated container \"{container}\" in pod \"{pod}\" not found\n")
        } else {
            format!("container \"{container}\" in pod \"{pod}\" is waiting to start\n")
        };
        return text(StatusCode::BAD_REQUEST, message);
    }
    let (tx, rx) = mpsc::channel(LOG_QUEUE);
    let pods = kubelet.pods.clone();
    let key = format!("{namespace}/{pod}");
    let uid = running.uid.clone();
    let watch = crate::logs::RunWatch {
        pid_file: plan.pid_path.clone(),
        pod_alive: Box::new(move || pods.borrow().get(&key).is_some_and(|p| p.uid == uid)),
        watcher: kubelet.logs.clone(),
        cancel: kubelet.cancel.child_token(),
    };
    let logs = kubelet.logs.clone();
    let log = plan.log_path.clone();
    tokio::spawn(async move {
        crate::logs::stream(log, options, watch, tx).await;
        let held = logs.stats();
        debug!(
            watches = held.watches,
            subscriptions = held.subscriptions,
            "log stream ended"
        );
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    ([(header::CONTENT_TYPE, "text/plain")], body).into_response()
}

async fn resource_metrics(State(kubelet): State<Kubelet>) -> Response {
    let containers: Vec<crate::metrics::ContainerRef> = kubelet
        .pods
        .borrow()
        .values()
        .flat_map(|p| {
            p.containers.iter().map(|c| crate::metrics::ContainerRef {
                namespace: p.namespace.clone(),
                pod: p.name.clone(),
                container: c.name.clone(),
                pid_file: c.pid_path.clone(),
            })
        })
        .collect();
    match tokio::task::spawn_blocking(move || crate::metrics::render(&containers)).await {
        Ok(body) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response(),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

async fn exec_with_uid(
    State(kubelet): State<Kubelet>,
    Path((namespace, pod, _uid, container)): Path<(String, String, String, String)>,
    Query(query): Query<Vec<(String, String)>>,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    exec_response(&kubelet, (&namespace, &pod, &container), &query, ws)
}

async fn exec(
    State(kubelet): State<Kubelet>,
    Path((namespace, pod, container)): Path<(String, String, String)>,
    Query(query): Query<Vec<(String, String)>>,
    ws: Option<WebSocketUpgrade>,
) -> Response {
    exec_response(&kubelet, (&namespace, &pod, &container), &query, ws)
}

/// exec: refused when turned off; otherwise the command over WebSocket (`exec.rs`).
fn exec_response(
    kubelet: &Kubelet,
    (namespace, pod, container): (&str, &str, &str),
    query: &[(String, String)],
    ws: Option<WebSocketUpgrade>,
) -> Response {
    if !kubelet.exec {
        return text(
            StatusCode::FORBIDDEN,
            "exec is turned off on this node (edged.kubelet.exec: false)\n".to_owned(),
        );
    }
    let plan = match find(kubelet, namespace, pod, container) {
        Ok((_, plan)) => plan,
        Err(message) => return text(StatusCode::NOT_FOUND, message),
    };
    let request = match crate::exec::ExecRequest::parse(query) {
        Ok(request) => request,
        Err(message) => return text(StatusCode::BAD_REQUEST, format!("{message}\n")),
    };
    let Some(ws) = ws else {
        return text(
            StatusCode::BAD_REQUEST,
            "exec needs a WebSocket upgrade (v5.channel.k8s.io or v4.channel.k8s.io); SPDY is not served\n"
                .to_owned(),
        );
    };
    ws.protocols(crate::exec::PROTOCOLS)
        .on_upgrade(move |socket| crate::exec::run(socket, plan, request))
}
