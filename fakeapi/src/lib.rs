//! A fake Kubernetes API server for tests and the demo: the real JSON wire format over HTTP on
//! 127.0.0.1, so the real kube-rs client and `kubectl` talk to it unchanged.
//!
//! # Layout
//! - `kinds`: the served resources (pods, configmaps, secrets, nodes, services, endpoints,
//!   namespaces, pvs, pvcs, events, coordination.k8s.io leases) and discovery.
//! - `crd`: CustomResourceDefinitions make their kinds servable (KubeEdge's device CRDs apply
//!   unmodified); no schema validation, defaulting or version conversion.
//! - `store`: one resourceVersion counter, the objects, a bounded change history.
//! - `selector`: label and field selectors.
//! - `server`: verbs, paging, watches (bookmarks, timeouts, 410 as an `ERROR` event), the
//!   status subresource, graceful pod deletion, and the `/fake/faults` knobs.
//! - `table`: `meta.k8s.io/v1` Tables for `kubectl get`.
//! - `lifecycle`: the node lifecycle controller and taint-based eviction, when turned on.
//! - `proxy`: `pods/log` and `pods/exec` (WebSocket, passed through) proxied to the kubelet
//!   port the pod's Node reports, over HTTPS with a kubelet client certificate.
//!
//! Not a real API server: no authentication, admission, defaulting beyond a pod's initial
//! status, or server-side apply; strategic merge patches are applied as JSON merge patches; no
//! OpenAPI documents (`kubectl apply --validate=false`) and no protobuf bodies (`kubectl
//! create <kind>` fails); a watch whose selector stops matching an object does not turn its
//! MODIFIED into DELETED. As with the real one, a gracefully deleted pod bound to a node stays,
//! marked, until a grace-0 delete (its node's job): nothing removes it when the period ends.

mod crd;
mod error;
mod kinds;
mod lifecycle;
mod proxy;
mod server;
mod store;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use edgemeta_kubewire::{FieldSelector, LabelSelector};
pub use error::Error;
pub use lifecycle::Lifecycle;
pub use proxy::{KubeletClient, DEFAULT_ADDRESS_TYPES};

/// How the fake behaves.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen; port 0 picks a free one.
    pub address: SocketAddr,
    /// How long a watch without `timeoutSeconds` stays open.
    pub watch_timeout: Duration,
    /// How often a watch that allows bookmarks gets one.
    pub bookmark_interval: Duration,
    /// Changes kept for watches to resume from; older versions get 410 Expired.
    pub history: usize,
    /// Simulate kube-controller-manager's node lifecycle controller; `None`: Nodes are left
    /// as written.
    pub lifecycle: Option<Lifecycle>,
    /// How `pods/log` reaches kubelets; `None`: it answers 503.
    pub kubelet: Option<KubeletClient>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            address: SocketAddr::from(([127, 0, 0, 1], 0)),
            watch_timeout: Duration::from_secs(1800),
            bookmark_interval: Duration::from_secs(5),
            history: 10_000,
            lifecycle: None,
            kubelet: None,
        }
    }
}

/// Faults to inject, set with `POST /fake/faults`.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Every request waits this long first.
    pub latency_ms: u64,
    /// The next this many non-watch requests fail with `fail_code`.
    pub fail_requests: u32,
    pub fail_code: u16,
    /// The next this many watches get an `ERROR` event with a 410 Status at once, as after a
    /// compaction of the version they asked for.
    pub expire_watches: u32,
}

/// A running fake API server.
pub struct FakeApi {
    address: SocketAddr,
    shared: Arc<server::Shared>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
}

impl FakeApi {
    /// Binds and starts serving on the current tokio runtime; `cancel` stops it.
    ///
    /// # Errors
    /// [`Error::Bind`] when the address cannot be bound.
    pub async fn start(config: Config, cancel: CancellationToken) -> Result<FakeApi, Error> {
        let listener = tokio::net::TcpListener::bind(config.address)
            .await
            .map_err(|source| Error::Bind {
                address: config.address.to_string(),
                source,
            })?;
        let address = listener.local_addr().map_err(|source| Error::Bind {
            address: config.address.to_string(),
            source,
        })?;
        let mut store = store::Store::new(config.history);
        for ns in ["default", "kube-system", "kube-node-lease"] {
            store.create(
                &kinds::KINDS[6],
                "",
                serde_json::json!({"metadata": {"name": ns}}),
            )?;
        }
        let kubelet = match &config.kubelet {
            Some(client) => Some((
                proxy::connector(client).map_err(Error::Kubelet)?,
                client.clone(),
            )),
            None => None,
        };
        let (drops, _) = watch::channel(0);
        let shared = Arc::new(server::Shared {
            store: Mutex::new(store),
            faults: Mutex::new(Faults::default()),
            drops,
            config,
            cancel: cancel.clone(),
            address: address.to_string(),
        });
        if let Some(lifecycle) = shared.config.lifecycle.clone() {
            tokio::spawn(lifecycle::run(shared.clone(), lifecycle, cancel.clone()));
        }
        let logs = Arc::new(proxy::Proxy {
            shared: shared.clone(),
            kubelet,
        });
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/:namespace/pods/:name/log",
                axum::routing::get(proxy::log),
            )
            .route(
                "/api/v1/namespaces/:namespace/pods/:name/exec",
                axum::routing::any(proxy::exec),
            )
            .with_state(logs)
            .merge(
                axum::Router::new()
                    .fallback(server::handle)
                    .with_state(shared.clone()),
            );
        let stop = cancel.clone();
        let task = tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error_code = "EM-FAKEAPI-SERVE", error = %e, "fake API server stopped");
            }
        });
        Ok(FakeApi {
            address,
            shared,
            cancel,
            task,
        })
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// A kubeconfig for this server (no credentials), for `kubectl` and kube-rs.
    pub fn kubeconfig(&self) -> String {
        kubeconfig(&self.url())
    }

    /// Ends every open watch (as `POST /fake/faults {"drop_watches": true}`).
    pub fn drop_watches(&self) {
        self.shared.drops.send_modify(|n| *n += 1);
    }

    /// Forgets the change history: a watch from any older version gets an `ERROR` 410.
    pub fn compact(&self) {
        self.shared.store().compact();
    }

    /// Replaces the injected faults.
    pub fn set_faults(&self, faults: Faults) {
        *self.shared.faults() = faults;
    }

    /// Writes that changed something, per resource (`pods/status` for status writes).
    pub fn writes(&self, resource: &str) -> u64 {
        self.shared
            .store()
            .writes
            .get(resource)
            .copied()
            .unwrap_or(0)
    }

    /// Creates `object` in `namespace` ("" for cluster-scoped) as a POST would, without HTTP:
    /// for benchmarks that load thousands of objects. `plural` is the core resource (`pods`).
    ///
    /// # Errors
    /// As the POST would fail (unknown resource: [`Error::BadRequest`]).
    pub fn create(
        &self,
        plural: &str,
        namespace: &str,
        object: serde_json::Value,
    ) -> Result<serde_json::Value, Error> {
        let kind = kinds::find("", "v1", plural)
            .ok_or_else(|| Error::BadRequest(format!("no resource {plural}")))?;
        self.shared.store().create(kind, namespace, object)
    }

    /// Creates `object` of any served type, custom ones included, named by its `apiVersion`
    /// (`devices.kubeedge.io/v1beta1`) and `plural`, as a POST would, without HTTP.
    ///
    /// # Errors
    /// As the POST would fail (unknown resource: [`Error::BadRequest`]).
    pub fn create_at(
        &self,
        api_version: &str,
        plural: &str,
        namespace: &str,
        object: serde_json::Value,
    ) -> Result<serde_json::Value, Error> {
        let mut store = self.shared.store();
        let kind = kind_at(&store, api_version, plural)?;
        store.create(kind, namespace, object)
    }

    /// Replaces `object` of any served type, as [`FakeApi::create_at`] names it.
    ///
    /// # Errors
    /// As the PUT would fail.
    pub fn update_at(
        &self,
        api_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
        object: serde_json::Value,
    ) -> Result<serde_json::Value, Error> {
        let mut store = self.shared.store();
        let kind = kind_at(&store, api_version, plural)?;
        store.update(kind, namespace, name, object, false)
    }

    /// Replaces `object` (with its `metadata.resourceVersion`, if any, as precondition).
    ///
    /// # Errors
    /// As the PUT would fail.
    pub fn update(
        &self,
        plural: &str,
        namespace: &str,
        name: &str,
        object: serde_json::Value,
    ) -> Result<serde_json::Value, Error> {
        let kind = kinds::find("", "v1", plural)
            .ok_or_else(|| Error::BadRequest(format!("no resource {plural}")))?;
        self.shared
            .store()
            .update(kind, namespace, name, object, false)
    }

    /// Stops serving and waits for the server task.
    pub async fn stop(self) {
        self.cancel.cancel();
        let _ = self.task.await;
    }
}

/// The built-in or custom type served under `api_version` as `plural`.
fn kind_at(
    store: &store::Store,
    api_version: &str,
    plural: &str,
) -> Result<&'static kinds::Kind, Error> {
    let (group, version) = api_version.rsplit_once('/').unwrap_or(("", api_version));
    kinds::find(group, version, plural)
        .or_else(|| store.crds.find(group, version, plural))
        .ok_or_else(|| Error::BadRequest(format!("no resource {plural} in {api_version}")))
}

/// A kubeconfig naming `server` as cluster `fake`, context `fake`, namespace `default`.
pub fn kubeconfig(server: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {server}\n\
         contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: default\n\
         current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
    )
}
