//! The agent: owns the set of pods on this node and the configmaps/secrets they use. It lists
//! pods at every new session (KubeEdge's `syncPod`), converges the running set to the stored
//! set without touching unchanged pods, applies the MetaManager's hand-ons one by one, and
//! answers CSI volume calls with "not supported".

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use edgemeta_protocol::Operation;
use rumqttc::{AsyncClient, QoS};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::message::{self, Incoming};
use crate::plan::{self, Blocked, Lookup};
use crate::pod::{PodStart, PodWorker, Timing};
use crate::runtime::Runtime;
use crate::session::Inbound;
use crate::spec::{self, ConfigKind, Key, Pod};
use crate::status::{self, ContainerStatus, PodFacts, Report, State};

/// How often timed-out queries are looked for.
const TICK: Duration = Duration::from_millis(500);
/// The longest the agent waits for its pods at shutdown (each has 2 s, then SIGKILL).
const SHUTDOWN_LIMIT: Duration = Duration::from_secs(10);

/// What one pod is doing.
enum Run {
    Running(PodWorker),
    /// Waiting for configmaps/secrets to be looked up.
    Resolving,
    /// Cannot run until its input changes (the status says why).
    Blocked,
}

struct PodEntry {
    namespace: String,
    name: String,
    /// `spec` and uid: what decides whether an update restarts the pod.
    identity: Value,
    pod: Option<Pod>,
    run: Run,
}

enum Query {
    Pods { namespace: String },
    Config { kind: ConfigKind, key: Key },
}

struct Pending {
    query: Query,
    sent: Instant,
}

/// An in-progress list of the pods of every configured namespace.
struct Listing {
    waiting: BTreeSet<String>,
    pods: HashMap<Key, (String, Value)>,
}

pub struct Agent {
    client: AsyncClient,
    root: String,
    namespaces: BTreeSet<String>,
    pods_dir: PathBuf,
    node_ip: String,
    query_timeout: Duration,
    runtime: Arc<dyn Runtime>,
    timing: Arc<Timing>,
    reports: mpsc::Sender<Report>,
    pods: HashMap<Key, PodEntry>,
    /// Pods being stopped: a new incarnation starts after its predecessor's handle ends.
    stopping: HashMap<Key, JoinHandle<()>>,
    configs: HashMap<(ConfigKind, Key), Lookup>,
    pending: HashMap<String, Pending>,
    listing: Option<Listing>,
    connected: bool,
    /// The pods started here, as kubelet's API serves them (this task is its only writer).
    running: crate::kubelet::Registry,
    cancel: CancellationToken,
}

/// The agent's settings, taken from [`crate::EdgedConfig`].
pub struct AgentSettings {
    pub root: String,
    pub namespaces: Vec<String>,
    pub pods_dir: PathBuf,
    pub node_ip: String,
    pub query_timeout: Duration,
}

impl Agent {
    pub fn new(
        settings: AgentSettings,
        client: AsyncClient,
        runtime: Arc<dyn Runtime>,
        timing: Arc<Timing>,
        reports: mpsc::Sender<Report>,
        running: crate::kubelet::Registry,
        cancel: CancellationToken,
    ) -> Agent {
        Agent {
            client,
            root: settings.root,
            namespaces: settings.namespaces.into_iter().collect(),
            pods_dir: settings.pods_dir,
            node_ip: settings.node_ip,
            query_timeout: settings.query_timeout,
            runtime,
            timing,
            reports,
            pods: HashMap::new(),
            stopping: HashMap::new(),
            configs: HashMap::new(),
            pending: HashMap::new(),
            listing: None,
            connected: false,
            running,
            cancel,
        }
    }

    /// Runs until `cancel`; then stops every pod (bounded) and returns once they have stopped.
    pub async fn run(mut self, mut inbound: mpsc::Receiver<Inbound>) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                event = inbound.recv() => match event {
                    Some(Inbound::Connected) => self.resync().await,
                    Some(Inbound::Disconnected) => self.connected = false,
                    Some(Inbound::Message(m)) => self.handle(*m).await,
                    None => break,
                },
                _ = tick.tick() => self.expire_queries().await,
            }
        }
        // Pod workers watch the same token and stop their containers (SIGTERM, at most 2 s).
        let mut handles: Vec<JoinHandle<()>> = self.stopping.drain().map(|(_, h)| h).collect();
        for (_, entry) in self.pods.drain() {
            if let Run::Running(worker) = entry.run {
                handles.push(worker.stop(Duration::from_secs(2)));
            }
        }
        let stopped = async {
            for handle in handles {
                let _ = handle.await;
            }
        };
        if tokio::time::timeout(SHUTDOWN_LIMIT, stopped).await.is_err() {
            warn!(
                error_code = "EM-EDGED-SHUTDOWN-GRACE",
                limit_s = SHUTDOWN_LIMIT.as_secs(),
                "pods still stopping; exiting anyway (the next start kills what is left)"
            );
        }
    }

    /// A new session: list the pods of every namespace again, and look up again what was
    /// missing (the cloud may have it now).
    async fn resync(&mut self) {
        self.connected = true;
        let _ = self.reports.send(Report::Resync).await;
        self.configs
            .retain(|_, lookup| matches!(lookup, Lookup::Found(_)));
        self.pending.clear();
        self.listing = Some(Listing {
            waiting: self.namespaces.clone(),
            pods: HashMap::new(),
        });
        for namespace in self.namespaces.clone() {
            self.query(
                Query::Pods {
                    namespace: namespace.clone(),
                },
                &format!("{namespace}/pod"),
            );
        }
        // Configmaps and secrets may have changed while edged was away (pushed changes were
        // handed on to nobody): look each known one up again; a changed answer rewrites the
        // volume files of the pods using it.
        let known: Vec<(ConfigKind, Key)> = self.configs.keys().cloned().collect();
        for (kind, key) in known {
            let resource = config_resource(kind, &key);
            self.query(Query::Config { kind, key }, &resource);
        }
        // Pods that wait on a lookup ask again (the answers of the old session are lost).
        let waiting: Vec<Key> = self
            .pods
            .iter()
            .filter(|(_, e)| matches!(e.run, Run::Resolving | Run::Blocked))
            .map(|(k, _)| k.clone())
            .collect();
        for key in waiting {
            self.try_start(&key).await;
        }
    }

    fn query(&mut self, query: Query, resource: &str) {
        let mut levels = resource.splitn(3, '/');
        let (Some(namespace), Some(resource_type)) = (levels.next(), levels.next()) else {
            return;
        };
        let (id, payload) = message::envelope(None, Operation::Query, resource, Value::Null);
        let topic = message::topic(&self.root, Operation::Query, namespace, resource_type);
        match self
            .client
            .try_publish(topic, QoS::AtLeastOnce, false, payload)
        {
            Ok(()) => {
                self.pending.insert(
                    id,
                    Pending {
                        query,
                        sent: Instant::now(),
                    },
                );
            }
            // The next session asks again.
            Err(e) => {
                warn!(error_code = "EM-EDGED-MQTT", resource = %resource, error = %e, "query not sent")
            }
        }
    }

    async fn expire_queries(&mut self) {
        if !self.connected {
            return;
        }
        let timeout = self.query_timeout;
        let expired: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, p)| p.sent.elapsed() >= timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                warn!(error_code = "EM-EDGED-QUERY-TIMEOUT", msg_id = %id, "no answer from the MetaManager; asking again");
                match p.query {
                    Query::Pods { namespace } => {
                        let resource = format!("{namespace}/pod");
                        self.query(Query::Pods { namespace }, &resource);
                    }
                    Query::Config { kind, key } => {
                        let resource = config_resource(kind, &key);
                        self.query(Query::Config { kind, key }, &resource);
                    }
                }
            }
        }
    }

    async fn handle(&mut self, m: Incoming) {
        let Some(operation) = m.operation else {
            debug!(resource = %m.resource, "ignored: an operation this node does not implement");
            return;
        };
        if matches!(operation, Operation::Response | Operation::Error) {
            if let Some(p) = m
                .parent_msg_id
                .as_ref()
                .and_then(|id| self.pending.remove(id))
            {
                self.answer(p.query, &m).await;
                return;
            }
        }
        // The controller answers a node heartbeat only when it could not write it.
        if operation == Operation::Error
            && matches!(m.resource_type.as_str(), "nodestatus" | "lease")
        {
            warn!(error_code = "EM-EDGED-NODE", resource = %m.resource, content = %m.content, "the cloud refused a node heartbeat");
            return;
        }
        // The CSI operations the MetaManager forwards to edged (protocol §3.5).
        if operation.is_volume() {
            self.refuse_volume(operation, &m);
            return;
        }
        if !self.namespaces.contains(&m.namespace) {
            debug!(namespace = %m.namespace, "not one of this agent's namespaces");
            return;
        }
        match (operation, m.resource_type.as_str()) {
            (Operation::Insert | Operation::Update, "pod") => {
                let Some(name) = m.name.clone() else {
                    warn!(error_code = "EM-EDGED-MESSAGE", resource = %m.resource, "pod without a name");
                    return;
                };
                let mut document = m.content;
                if let Some(meta) = document
                    .as_object_mut()
                    .map(|o| o.entry("metadata").or_insert_with(|| json!({})))
                {
                    if let Some(meta) = meta.as_object_mut() {
                        meta.entry("name").or_insert_with(|| json!(name));
                    }
                }
                self.apply_pod(&m.namespace, &name, document).await;
            }
            (Operation::Delete, "pod") => {
                if let Some(name) = &m.name {
                    self.remove_pod(&format!("{}/{name}", m.namespace), true);
                }
            }
            (Operation::Insert | Operation::Update | Operation::Response, t)
                if ConfigKind::from_resource_type(t).is_some() =>
            {
                if let (Some(kind), Some(name)) = (ConfigKind::from_resource_type(t), &m.name) {
                    if !m.content.is_null() && !m.content.is_string() {
                        self.set_config(kind, format!("{}/{name}", m.namespace), &m.content)
                            .await;
                    }
                }
            }
            (Operation::Delete, t) if ConfigKind::from_resource_type(t).is_some() => {
                if let (Some(kind), Some(name)) = (ConfigKind::from_resource_type(t), &m.name) {
                    self.configs
                        .insert((kind, format!("{}/{name}", m.namespace)), Lookup::Missing);
                }
            }
            _ => debug!(%operation, resource = %m.resource, "ignored"),
        }
    }

    /// The answer to one of our queries.
    async fn answer(&mut self, query: Query, m: &Incoming) {
        let documents: Vec<Value> = match (m.operation, &m.content) {
            (Some(Operation::Response), Value::Array(items)) => items
                .iter()
                .filter_map(|item| match item {
                    Value::String(text) => serde_json::from_str(text).ok(),
                    other => Some(other.clone()),
                })
                .collect(),
            _ => {
                warn!(error_code = "EM-EDGED-QUERY", resource = %m.resource, content = %m.content, "query failed");
                Vec::new()
            }
        };
        match query {
            Query::Pods { namespace } => {
                let Some(listing) = self.listing.as_mut() else {
                    return;
                };
                for document in documents {
                    let pod_namespace = document
                        .pointer("/metadata/namespace")
                        .and_then(Value::as_str)
                        .unwrap_or(&namespace)
                        .to_owned();
                    let Some(name) = document.pointer("/metadata/name").and_then(Value::as_str)
                    else {
                        continue;
                    };
                    if self.namespaces.contains(&pod_namespace) && spec::is_name(name) {
                        listing
                            .pods
                            .insert(format!("{pod_namespace}/{name}"), (pod_namespace, document));
                    }
                }
                listing.waiting.remove(&namespace);
                if listing.waiting.is_empty() {
                    if let Some(listing) = self.listing.take() {
                        self.converge(listing.pods).await;
                    }
                }
            }
            Query::Config { kind, key } => match documents.into_iter().next() {
                Some(document) => self.set_config(kind, key, &document).await,
                None => {
                    self.configs.insert((kind, key), Lookup::Missing);
                    self.retry_waiting().await;
                }
            },
        }
    }

    /// Makes the running set the listed set; unchanged pods keep running.
    async fn converge(&mut self, listed: HashMap<Key, (String, Value)>) {
        let gone: Vec<Key> = self
            .pods
            .keys()
            .filter(|k| !listed.contains_key(*k))
            .cloned()
            .collect();
        info!(pods = listed.len(), removed = gone.len(), "pod list synced");
        for key in gone {
            self.remove_pod(&key, true);
        }
        for (_, (namespace, document)) in listed {
            if let Some(name) = document
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(str::to_owned)
            {
                self.apply_pod(&namespace, &name, document).await;
            }
        }
    }

    async fn set_config(&mut self, kind: ConfigKind, key: Key, document: &Value) {
        match spec::read_data(kind, document) {
            Ok(data) => {
                let found = Lookup::Found(data);
                let changed = self.configs.get(&(kind, key.clone())) != Some(&found);
                let known = matches!(
                    self.configs.get(&(kind, key.clone())),
                    Some(Lookup::Found(_))
                );
                self.configs.insert((kind, key.clone()), found);
                if changed && known {
                    self.refresh_volumes(kind, &key);
                }
            }
            Err(e) => {
                warn!(error_code = "EM-EDGED-CONFIG-DATA", object = %key, error = %e, "unreadable {}", kind.resource_type());
                self.configs.insert((kind, key), Lookup::Missing);
            }
        }
        self.retry_waiting().await;
    }

    /// Rewrites the volume files of running pods that use configmap/secret `key`, as kubelet
    /// updates projected volumes (environment variables keep the values they started with).
    fn refresh_volumes(&self, kind: ConfigKind, key: &Key) {
        let Some((namespace, name)) = key.split_once('/') else {
            return;
        };
        for (pod_key, entry) in &self.pods {
            let (Run::Running(_), Some(pod)) = (&entry.run, &entry.pod) else {
                continue;
            };
            let uses = entry.namespace == namespace
                && pod.spec.volumes.iter().any(|v| match kind {
                    ConfigKind::ConfigMap => v.config_map.as_ref().is_some_and(|c| c.name == name),
                    ConfigKind::Secret => v.secret.as_ref().is_some_and(|s| s.secret_name == name),
                });
            if !uses {
                continue;
            }
            let configs = &self.configs;
            let planned = plan::plan(pod, namespace, &self.pods_dir, &self.node_ip, |k, n| {
                configs
                    .get(&(k, format!("{namespace}/{n}")))
                    .cloned()
                    .unwrap_or(Lookup::Unknown)
            });
            let Ok(planned) = planned else {
                // Now incomplete (a key gone): the files stay as they were.
                continue;
            };
            let pod_key = pod_key.clone();
            tokio::task::spawn_blocking(move || {
                let logs = planned.dir.join("logs");
                if let Err(e) = crate::pod::write_volumes(&planned.dir, &logs, &planned.volumes) {
                    warn!(error_code = "EM-EDGED-IO", pod = %pod_key, error = %e, "cannot refresh volume files");
                }
            });
        }
    }

    async fn retry_waiting(&mut self) {
        let waiting: Vec<Key> = self
            .pods
            .iter()
            .filter(|(_, e)| matches!(e.run, Run::Resolving | Run::Blocked) && e.pod.is_some())
            .map(|(k, _)| k.clone())
            .collect();
        for key in waiting {
            self.try_start(&key).await;
        }
    }

    /// Starts, restarts or leaves alone pod `namespace/name` as `document` says.
    async fn apply_pod(&mut self, namespace: &str, name: &str, document: Value) {
        let key = format!("{namespace}/{name}");
        if !spec::is_name(name) {
            warn!(error_code = "EM-EDGED-MESSAGE", pod = %key, "pod name is not valid");
            return;
        }
        let identity = plan::identity(&document);
        if let Some(entry) = self.pods.get(&key) {
            if entry.identity == identity {
                return;
            }
            info!(pod = %key, "pod spec changed; restarting it");
            self.remove_pod(&key, false);
        }
        let parsed = Pod::parse(&document).and_then(|pod| match pod.invalid() {
            Some(reason) => Err(reason),
            None => Ok(pod),
        });
        let uid = document
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let (pod, run, invalid) = match parsed {
            Ok(pod) => (Some(pod), Run::Resolving, None),
            Err(reason) => (None, Run::Blocked, Some(reason)),
        };
        self.pods.insert(
            key.clone(),
            PodEntry {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                identity,
                pod,
                run,
            },
        );
        match invalid {
            Some(reason) => {
                warn!(pod = %key, reason = "InvalidPodSpec", error = %reason, "pod cannot run");
                self.report(&key, uid, status::invalid_status(&self.node_ip, &reason))
                    .await;
            }
            None => self.try_start(&key).await,
        }
    }

    /// Plans the pod from what is known of its configmaps and secrets; starts it, asks for
    /// what is unknown, or reports why it cannot run.
    async fn try_start(&mut self, key: &Key) {
        let Some(entry) = self.pods.get(key) else {
            return;
        };
        let Some(pod) = entry.pod.clone() else {
            return;
        };
        let namespace = entry.namespace.clone();
        let configs = &self.configs;
        let planned = plan::plan(
            &pod,
            &namespace,
            &self.pods_dir,
            &self.node_ip,
            |kind, name| {
                configs
                    .get(&(kind, format!("{namespace}/{name}")))
                    .cloned()
                    .unwrap_or(Lookup::Unknown)
            },
        );
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let images: Vec<String> = pod
            .spec
            .containers
            .iter()
            .map(|c| c.image.clone())
            .collect();
        match planned {
            Ok(plan) => {
                self.running.insert(key, &plan);
                let worker = PodWorker::spawn(PodStart {
                    plan,
                    images,
                    runtime: self.runtime.clone(),
                    timing: self.timing.clone(),
                    reports: self.reports.clone(),
                    after: self.stopping.remove(key),
                    cancel: self.cancel.child_token(),
                });
                if let Some(entry) = self.pods.get_mut(key) {
                    entry.run = Run::Running(worker);
                }
            }
            Err(Blocked::Unknown(references)) => {
                for (kind, name) in references {
                    let config_key = format!("{namespace}/{name}");
                    let asked = self.pending.values().any(|p| {
                        matches!(&p.query, Query::Config { kind: k, key: c } if *k == kind && *c == config_key)
                    });
                    if !asked {
                        let resource = config_resource(kind, &config_key);
                        self.query(
                            Query::Config {
                                kind,
                                key: config_key,
                            },
                            &resource,
                        );
                    }
                }
                if let Some(entry) = self.pods.get_mut(key) {
                    entry.run = Run::Resolving;
                }
                let status = self.waiting_status(&pod, "ContainerCreating", "");
                self.report(key, uid, status).await;
            }
            Err(Blocked::ConfigError(message)) => {
                warn!(pod = %key, reason = "CreateContainerConfigError", error = %message, "pod cannot start yet");
                if let Some(entry) = self.pods.get_mut(key) {
                    entry.run = Run::Blocked;
                }
                let status = self.waiting_status(&pod, "CreateContainerConfigError", &message);
                self.report(key, uid, status).await;
            }
        }
    }

    fn waiting_status(&self, pod: &Pod, reason: &str, message: &str) -> Value {
        let containers: Vec<ContainerStatus> = pod
            .spec
            .containers
            .iter()
            .map(|c| ContainerStatus::new(&c.name, &c.image, State::waiting(reason, message)))
            .collect();
        let facts = PodFacts {
            policy: pod.spec.restart_policy,
            node_ip: &self.node_ip,
            start_time: std::time::SystemTime::now(),
        };
        status::pod_status(&facts, &containers)
    }

    async fn report(&self, key: &Key, uid: String, status: Value) {
        let Some(entry) = self.pods.get(key) else {
            return;
        };
        let _ = self
            .reports
            .send(Report::Status {
                key: key.clone(),
                namespace: entry.namespace.clone(),
                name: entry.name.clone(),
                uid,
                status,
            })
            .await;
    }

    /// Stops pod `key` within its grace period; `deleted` also reports its removal.
    fn remove_pod(&mut self, key: &Key, deleted: bool) {
        let Some(entry) = self.pods.remove(key) else {
            return;
        };
        self.running.remove(key);
        let grace = entry
            .pod
            .as_ref()
            .and_then(|p| p.spec.termination_grace_period_seconds)
            .map_or(Duration::from_secs(30), Duration::from_secs);
        let previous = self.stopping.remove(key);
        let stopped = match entry.run {
            Run::Running(worker) => Some(worker.stop(grace)),
            Run::Resolving | Run::Blocked => None,
        };
        let reports = self.reports.clone();
        let key_owned = key.clone();
        info!(pod = %key, deleted, "stopping pod");
        let handle = tokio::spawn(async move {
            if let Some(previous) = previous {
                let _ = previous.await;
            }
            if let Some(stopped) = stopped {
                let _ = stopped.await;
            }
            if deleted {
                let _ = reports.send(Report::Removed { key: key_owned }).await;
            }
        });
        self.stopping.insert(key.clone(), handle);
        self.stopping.retain(|_, h| !h.is_finished());
    }

    /// CSI calls: this runtime has no volume driver; say so at once instead of letting the
    /// caller time out.
    fn refuse_volume(&self, operation: Operation, m: &Incoming) {
        let text = format!(
            "{operation} {}: not supported by this runtime (edged runs pods as local processes and has no CSI driver)",
            m.resource
        );
        let (_, payload) =
            message::envelope(Some(&m.msg_id), Operation::Error, &m.resource, json!(text));
        let topic = message::topic(&self.root, Operation::Error, &m.namespace, &m.resource_type);
        if let Err(e) = self
            .client
            .try_publish(topic, QoS::AtLeastOnce, false, payload)
        {
            warn!(error_code = "EM-EDGED-MQTT", resource = %m.resource, error = %e, "volume refusal not sent");
        }
    }
}

fn config_resource(kind: ConfigKind, key: &str) -> String {
    let (namespace, name) = key.split_once('/').unwrap_or(("", key));
    format!("{namespace}/{}/{name}", kind.resource_type())
}
