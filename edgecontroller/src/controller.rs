//! The owner task. Watchers (kube-rs `watcher`) and the cloud broker's `up` messages feed one
//! loop that owns the routing and delivery state; API writes run beside it, bounded.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher;
use kube::Client;
use rumqttc::{AsyncClient, Event as MqttEvent, LastWill, MqttOptions, Packet, QoS};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::delivery::{Delivery, Dispatch, Outgoing};
use crate::envelope::{down_topic, resource_name, Envelope, UpTopic};
use crate::heartbeat::{self, Heartbeats, LeaseWork, StatusWork};
use crate::refs::Ref;
use crate::routing::{Routing, EDGE_LABEL};
use crate::watch::Change;
use crate::{status, Config, Error};

/// Which watch an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    Pod,
    Node,
    ConfigMap,
    Secret,
}

impl Watched {
    fn kind(self) -> &'static str {
        match self {
            Watched::Pod => "pod",
            Watched::Node => "node",
            Watched::ConfigMap => "configmap",
            Watched::Secret => "secret",
        }
    }
}

/// What the owner task reacts to.
#[derive(Debug)]
enum Input {
    Watch(Watched, Change<Value>),
    Up {
        topic: String,
        payload: Vec<u8>,
    },
    /// The API write for a pod status finished (`ok`: written).
    StatusWritten {
        key: (String, String),
        ok: bool,
    },
    /// A node status write finished: the Node it left, or `failed`.
    NodeStatusWritten {
        node: String,
        object: Option<Value>,
        failed: bool,
    },
    /// A Lease write finished: its new resourceVersion (`None`: unknown).
    LeaseWritten {
        node: String,
        rv: Option<String>,
    },
    Devices(crate::devices::Event),
}

/// Where nodes' heartbeat Leases live (as kubelet's).
const NODE_LEASE_NAMESPACE: &str = "kube-node-lease";

/// How many API writes run at once.
const WRITERS: usize = 32;

async fn kube_client(config: &Config) -> Result<Client, Error> {
    let kube_config = match &config.kubeconfig {
        Some(path) => {
            let file = Kubeconfig::read_from(path)
                .map_err(|e| Error::Kubeconfig(format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kubeconfig(format!("{}: {e}", path.display())))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| Error::Kubeconfig(e.to_string()))?,
    };
    Ok(Client::try_from(kube_config)?)
}

/// A watched object as the owner keeps it: JSON (routing cuts pods down further).
fn json<K: Serialize>(o: &K) -> Value {
    serde_json::to_value(o).unwrap_or(Value::Null)
}

/// Runs the watch of one of the owner's kinds.
fn spawn_watch<K>(
    api: Api<K>,
    config: watcher::Config,
    watched: Watched,
    tx: mpsc::Sender<Input>,
    cancel: CancellationToken,
) where
    K: kube::Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug + Send + 'static,
{
    let wrap = move |change| Input::Watch(watched, change);
    crate::watch::spawn(api, config, watched.kind(), json::<K>, wrap, tx, cancel);
}

fn mqtt_options(config: &Config) -> Result<MqttOptions, Error> {
    let (host, port) = config.broker_address()?;
    let mut options = MqttOptions::new(config.client_id.clone(), host, port);
    options.set_keep_alive(Duration::from_secs(15));
    // A persistent session: what nodes send while the controller is away waits for it.
    options.set_clean_session(false);
    options.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
    options.set_inflight(1000);
    if let (Some(user), Some(password)) = (&config.username, &config.password) {
        options.set_credentials(user.clone(), password.clone());
    }
    // Nothing depends on the controller's will today; it marks the session in broker logs.
    options.set_last_will(LastWill::new(
        format!("{}/_controller/{}", config.root, config.client_id),
        "offline",
        QoS::AtMostOnce,
        false,
    ));
    Ok(options)
}

/// Runs the controller until `cancel`.
///
/// # Errors
/// Configuration and kubeconfig errors at start-up; afterwards everything is retried.
pub async fn run(config: Config, cancel: CancellationToken) -> Result<(), Error> {
    let client = kube_client(&config).await?;
    // With leader election: nothing runs before the Lease is ours, everything stops when it
    // is lost (the process exits; its supervisor starts it again as a candidate).
    let lost = match config.leader.clone() {
        Some(lease) => Some(crate::leader::lead(client.clone(), lease, cancel.clone()).await?),
        None => None,
    };
    let cancel = cancel.child_token();
    if let Some(lost) = lost.clone() {
        let stop = cancel.clone();
        tokio::spawn(async move {
            tokio::select! {
                () = lost.cancelled() => stop.cancel(),
                () = stop.cancelled() => {}
            }
        });
    }
    let options = mqtt_options(&config)?;
    let (mqtt, mut eventloop) = AsyncClient::new(options, 4096);
    let (tx, mut rx) = mpsc::channel::<Input>(4096);
    // Node messages must never wait on the owner task while it waits on a publish.
    let (up_tx, mut up_rx) = mpsc::unbounded_channel::<Input>();

    let edge_nodes = watcher::Config::default().labels(EDGE_LABEL);
    spawn_watch(
        Api::<Node>::all(client.clone()),
        edge_nodes,
        Watched::Node,
        tx.clone(),
        cancel.clone(),
    );
    spawn_watch(
        Api::<Pod>::all(client.clone()),
        watcher::Config::default(),
        Watched::Pod,
        tx.clone(),
        cancel.clone(),
    );
    spawn_watch(
        Api::<ConfigMap>::all(client.clone()),
        watcher::Config::default(),
        Watched::ConfigMap,
        tx.clone(),
        cancel.clone(),
    );
    spawn_watch(
        Api::<Secret>::all(client.clone()),
        watcher::Config::default(),
        Watched::Secret,
        tx.clone(),
        cancel.clone(),
    );

    let filter = format!("{}/+/up/#", config.root);
    // Every node's birth message or Last Will (retained): resync on birth (protocol §5).
    let connections = format!("{}/+/connection", config.root);
    let subscriber = mqtt.clone();
    let stop = cancel.clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = stop.cancelled() => return,
                event = eventloop.poll() => event,
            };
            match event {
                Ok(MqttEvent::Incoming(Packet::ConnAck(_))) => {
                    info!(filter = %filter, "connected to the cloud broker");
                    for f in [&filter, &connections] {
                        if let Err(e) = subscriber.try_subscribe(f.clone(), QoS::AtLeastOnce) {
                            warn!(error_code = "EM-EC-MQTT", error = %e, "subscribe not queued");
                        }
                    }
                }
                Ok(MqttEvent::Incoming(Packet::Publish(p))) => {
                    let input = Input::Up {
                        topic: p.topic,
                        payload: p.payload.to_vec(),
                    };
                    if up_tx.send(input).is_err() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(error_code = "EM-EC-BROKER", error = %e, "cloud broker connection lost; reconnecting");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(500)) => {}
                    }
                }
            }
        }
    });

    let (devices, mut device_events) = crate::devices::start(client.clone(), cancel.clone());
    // What the nodes acknowledged before a restart: not sent to them again.
    let mut delivery = Delivery::new(config.resend, config.resend_max);
    for (node, acked) in crate::acked::load(&client).await {
        delivery.preload(&node, &acked);
    }
    let (acked_tx, acked_rx) = mpsc::channel(64);
    tokio::spawn(crate::acked::save(client.clone(), acked_rx, cancel.clone()));
    let mut save_acked = tokio::time::interval(crate::acked::SAVE_EVERY);
    let mut owner = Owner {
        devices,
        root: config.root.clone(),
        routing: Routing::default(),
        delivery,
        relisting: HashMap::new(),
        written: HashMap::new(),
        statuses: status::Queue::new(WRITERS),
        delete_after: HashMap::new(),
        mqtt: mqtt.clone(),
        client,
        writers: Arc::new(Semaphore::new(WRITERS)),
        results: tx.clone(),
        cancel: cancel.clone(),
        beats: Heartbeats::new(config.node_status_refresh),
    };
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        let input = tokio::select! {
            () = cancel.cancelled() => break,
            Some(input) = rx.recv() => input,
            Some(input) = up_rx.recv() => input,
            Some(event) = device_events.recv() => Input::Devices(event),
            _ = tick.tick() => {
                let due = owner.delivery.due(Instant::now());
                owner.publish_all(due).await;
                continue;
            }
            _ = save_acked.tick() => {
                let changed = owner.delivery.take_dirty();
                if changed.is_empty() {
                    continue;
                }
                if let Err(mpsc::error::TrySendError::Full(changed)) = acked_tx.try_send(changed) {
                    // The writer is behind: these nodes go with the next second's.
                    for (node, _) in changed {
                        owner.delivery.mark_dirty(node);
                    }
                }
                continue;
            }
        };
        owner.handle(input).await;
    }
    let _ = mqtt.disconnect().await;
    if lost.is_some_and(|l| l.is_cancelled()) {
        return Err(Error::LeadershipLost);
    }
    Ok(())
}

/// The state the owner task keeps, and its handles.
struct Owner {
    devices: crate::devices::Devices,
    root: String,
    routing: Routing,
    delivery: Delivery,
    /// Per kind, the names listed again since a watch restarted (`Init` .. `InitDone`).
    relisting: HashMap<&'static str, HashSet<(String, String)>>,
    /// The last status written (or being written) per pod, as JSON text, so a repeated report
    /// is no write.
    written: HashMap<(String, String), String>,
    /// Pod status writes: at most [`WRITERS`] running, the rest waiting as patches.
    statuses: status::Queue,
    /// Pods to delete once their last status is written (their node has stopped them).
    delete_after: HashMap<(String, String), String>,
    mqtt: AsyncClient,
    client: Client,
    writers: Arc<Semaphore>,
    results: mpsc::Sender<Input>,
    cancel: CancellationToken,
    beats: Heartbeats,
}

/// The node of a `<root>/<node>/connection` topic.
fn connection_topic<'a>(root: &str, topic: &'a str) -> Option<&'a str> {
    topic
        .strip_prefix(root)?
        .strip_prefix('/')?
        .strip_suffix("/connection")
        .filter(|n| !n.is_empty() && !n.contains('/'))
}

fn names(object: &Value) -> (String, String) {
    let get = |f: &str| {
        object["metadata"][f]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    (get("namespace"), get("name"))
}

impl Owner {
    async fn publish(&self, node: &str, envelope: &Envelope) {
        let topic = down_topic(
            &self.root,
            node,
            &envelope.route.operation,
            &envelope.route.resource,
        );
        let payload = match serde_json::to_vec(envelope) {
            Ok(p) => p,
            Err(e) => {
                warn!(error_code = "EM-EC-ENCODE", error = %e, "message not encoded");
                return;
            }
        };
        debug!(%topic, resource = %envelope.route.resource, "down");
        if let Err(e) = self
            .mqtt
            .publish(topic, QoS::AtLeastOnce, false, payload)
            .await
        {
            warn!(error_code = "EM-EC-MQTT", error = %e, "publish not queued; resent later");
        }
    }

    /// Publishes what delivery released: its encoded envelopes, as they are.
    async fn publish_all(&self, sends: Vec<Dispatch>) {
        for send in sends {
            let topic = down_topic(&self.root, &send.node, send.operation, &send.resource);
            debug!(%topic, resource = %send.resource, "down");
            if let Err(e) = self
                .mqtt
                .publish_bytes(topic, QoS::AtLeastOnce, false, send.payload)
                .await
            {
                warn!(error_code = "EM-EC-MQTT", error = %e, "publish not queued; resent later");
            }
        }
    }

    async fn submit(&mut self, outgoing: Vec<Outgoing>) {
        let now = Instant::now();
        let mut sends = Vec::new();
        for out in outgoing {
            sends.extend(self.delivery.submit(out, now));
        }
        self.publish_all(sends).await;
    }

    async fn handle(&mut self, input: Input) {
        match input {
            Input::Watch(watched, change) => {
                let sends = self.watched(watched, change);
                self.submit(sends).await;
            }
            Input::Up { topic, payload } => self.up(&topic, &payload).await,
            Input::StatusWritten { key, ok } => {
                self.statuses.done(&key);
                // A failed write is tried again by the next report, unless a newer one waits.
                if !ok && !self.statuses.waiting(&key) {
                    self.written.remove(&key);
                }
                if !self.statuses.pending(&key) {
                    if let Some(uid) = self.delete_after.remove(&key) {
                        self.finish_delete(&key.0, &key.1, &uid);
                    }
                }
                self.start_status_writes();
            }
            Input::NodeStatusWritten {
                node,
                object,
                failed,
            } => {
                if let Some(next) = self.beats.status_done(&node, object, failed) {
                    self.write_node_status(node, next);
                }
            }
            Input::LeaseWritten { node, rv } => {
                if let Some((next, rv)) = self.beats.lease_done(&node, rv) {
                    self.write_lease(node, next, rv);
                }
            }
            Input::Devices(event) => {
                let sends = self.devices.handle(event, &self.delivery);
                self.submit(sends).await;
            }
        }
    }

    fn apply(&mut self, watched: Watched, object: &Value) -> Vec<Outgoing> {
        match watched {
            Watched::Pod => self.routing.pod_applied(object),
            Watched::Node => self.routing.node_applied(object),
            Watched::ConfigMap => self.routing.config_applied("configmap", object),
            Watched::Secret => self.routing.config_applied("secret", object),
        }
    }

    fn delete(&mut self, watched: Watched, (ns, name): (String, String)) -> Vec<Outgoing> {
        match watched {
            Watched::Pod => {
                let key = (ns, name);
                self.written.remove(&key);
                // Gone already: nothing left to finish, and a status waiting for it would land on
                // a pod made again under its name.
                self.delete_after.remove(&key);
                self.statuses.forget(&key);
                self.routing.pod_deleted(&key.0, &key.1)
            }
            Watched::Node => {
                let sends = self.routing.node_deleted(&name);
                self.delivery.forget_node(&name);
                self.beats.forget(&name);
                sends
            }
            Watched::ConfigMap => self.routing.config_deleted("configmap", &ns, &name),
            Watched::Secret => self.routing.config_deleted("secret", &ns, &name),
        }
    }

    fn watched(&mut self, watched: Watched, change: Change<Value>) -> Vec<Outgoing> {
        match change {
            Change::Apply(object) => self.apply(watched, &object),
            Change::Delete(key) => self.delete(watched, key),
            Change::Init => {
                self.relisting.insert(watched.kind(), HashSet::new());
                Vec::new()
            }
            Change::InitApply(object) => {
                let (ns, name) = names(&object);
                let key = if watched == Watched::Node {
                    (String::new(), name)
                } else {
                    (ns, name)
                };
                self.relisting
                    .entry(watched.kind())
                    .or_default()
                    .insert(key);
                self.apply(watched, &object)
            }
            Change::InitDone => {
                // What was not listed again is gone (kube-rs: "assume deleted").
                let listed = self.relisting.remove(watched.kind()).unwrap_or_default();
                let gone: Vec<(String, String)> = self
                    .routing
                    .known(watched.kind())
                    .into_iter()
                    .filter(|k| !listed.contains(k))
                    .collect();
                let mut sends = Vec::new();
                for key in gone {
                    sends.extend(self.delete(watched, key));
                }
                if watched != Watched::Node {
                    // Pods, ConfigMaps and Secrets a node acknowledged before a restart that
                    // were deleted meanwhile: no controller saw their delete. Only absence
                    // counts: a pod's node may not be known as an edge node yet (its watch may
                    // sync later); a pod moved elsewhere is routing's.
                    sends.extend(self.delivery.restored_gone(watched.kind(), |_, resource| {
                        let mut parts = resource.splitn(3, '/');
                        let (ns, name) = (parts.next(), parts.nth(1));
                        ns.zip(name).is_some_and(|(ns, name)| {
                            listed.contains(&(ns.to_owned(), name.to_owned()))
                        })
                    }));
                }
                info!(kind = watched.kind(), listed = listed.len(), "watch synced");
                sends
            }
        }
    }

    async fn reply(&self, node: &str, request: &Envelope, operation: &str, content: Value) {
        let reply = Envelope::reply(operation, request, content);
        self.publish(node, &reply).await;
    }

    async fn up(&mut self, topic: &str, payload: &[u8]) {
        let envelope: Envelope = match serde_json::from_slice(payload) {
            Ok(e) => e,
            Err(e) => {
                warn!(error_code = "EM-EC-MESSAGE", %topic, error = %e, "not an envelope; dropped");
                return;
            }
        };
        if let Some(node) = connection_topic(&self.root, topic) {
            self.connection(node, &envelope).await;
            return;
        }
        let Some(up) = UpTopic::parse(&self.root, topic) else {
            return;
        };
        match (up.operation.as_str(), up.kind.as_str()) {
            ("response", _) => {
                let Some(parent) = envelope.header.parent_msg_id.as_deref() else {
                    return;
                };
                if envelope.content != json!("OK") {
                    debug!(node = %up.node, content = %envelope.content, "a response that is not an ack");
                }
                let next = self.delivery.ack(&up.node, parent, Instant::now());
                self.publish_all(next.into_iter().collect()).await;
            }
            ("error", _) => {
                // The node refused one of our messages for good: stop resending it.
                if let Some(parent) = envelope.header.parent_msg_id.as_deref() {
                    warn!(error_code = "EM-EC-NODE-REFUSED", node = %up.node, resource = %envelope.route.resource,
                          content = %envelope.content, "node refused a message");
                    let next = self.delivery.ack(&up.node, parent, Instant::now());
                    self.publish_all(next.into_iter().collect()).await;
                }
            }
            ("update", "podstatus") => self.pod_status(&up, &envelope).await,
            ("insert", "nodestatus") => self.node_status(&up, envelope),
            ("update", "nodestatus") => self.heartbeat_status(&up, envelope).await,
            ("insert" | "update", "lease") => self.node_lease(&up, envelope).await,
            ("delete", "pod") => self.pod_gone(&up, &envelope).await,
            ("update", "devicetwin" | "devicestate") => {
                let sends = self.devices.up(&up, &envelope);
                self.submit(sends).await;
            }
            ("query", "membershipdetail") => {
                let sends = self.devices.detail(&up.node);
                self.submit(sends).await;
            }
            ("query", _) => self.query(&up, &envelope).await,
            (op, kind) => debug!(node = %up.node, op, kind, "up message not handled"),
        }
    }

    /// The node's bridge announced its session (birth) or lost it (Last Will).
    async fn connection(&mut self, node: &str, envelope: &Envelope) {
        let now = Instant::now();
        if envelope.content == json!("cloud_disconnected") {
            info!(node, "node offline");
            self.delivery.node_offline(node);
            // Its Node turns Unknown now, not when the lifecycle controller's grace runs out.
            if let Some(work) = self.beats.status(node, StatusWork::Offline) {
                self.write_node_status(node.to_owned(), work);
            }
            return;
        }
        info!(node, "node online: resyncing");
        let mut sends = self.delivery.node_online(node, now);
        for out in self
            .routing
            .desired(node)
            .into_iter()
            .chain(self.devices.desired(node))
        {
            sends.extend(self.delivery.submit(out, now));
        }
        self.publish_all(sends).await;
    }

    /// `insert <ns>/nodestatus/<node>` registers the node: its Node is created (with the edge
    /// label) unless it exists (KubeEdge v1.3 upstream.go `registerNode`). A node speaks only
    /// for itself; the answer is `response "OK"` or `error`.
    fn node_status(&self, up: &UpTopic, envelope: Envelope) {
        let name = resource_name(up, &envelope).unwrap_or_else(|| up.node.clone());
        let api: Api<Node> = Api::all(self.client.clone());
        let node = up.node.clone();
        let content = envelope.content.clone();
        self.answer_later(up, envelope, "EM-EC-NODESTATUS", async move {
            if name != node {
                return Err(format!(
                    "forbidden: node {node} may not write the status of node {name}"
                ));
            }
            register_node(&api, &name, &content).await?;
            Ok(json!("OK"))
        });
    }

    /// `update <ns>/nodestatus/<node>`, the heartbeat (KubeEdge's `NodeStatusRequest{Status}`):
    /// written by the rule of `heartbeat.rs`, answered only when refused or failed.
    async fn heartbeat_status(&mut self, up: &UpTopic, envelope: Envelope) {
        let name = resource_name(up, &envelope).unwrap_or_else(|| up.node.clone());
        if name != up.node {
            let text = format!(
                "forbidden: node {} may not write the status of node {name}",
                up.node
            );
            warn!(error_code = "EM-EC-NODESTATUS", node = %up.node, error = %text, "request refused");
            self.reply(&up.node, &envelope, "error", json!(text)).await;
            return;
        }
        let work = StatusWork::Report(Box::new(envelope));
        if let Some(work) = self.beats.status(&up.node, work) {
            self.write_node_status(up.node.clone(), work);
        }
    }

    /// `insert|update kube-node-lease/lease/<node>`: the node's heartbeat Lease is renewed with
    /// the node's `spec` and the controller's clock as `renewTime`; an `insert` is answered with
    /// the stored Lease, an `update` only when it fails. A node writes only the Lease named
    /// after itself, in `kube-node-lease`.
    async fn node_lease(&mut self, up: &UpTopic, envelope: Envelope) {
        let name = resource_name(up, &envelope).unwrap_or_else(|| up.node.clone());
        if name != up.node || up.namespace != NODE_LEASE_NAMESPACE {
            let text = format!(
                "forbidden: node {node} may write only lease {NODE_LEASE_NAMESPACE}/{node}, not {}/{name}",
                up.namespace,
                node = up.node
            );
            warn!(error_code = "EM-EC-LEASE-WRITE", node = %up.node, error = %text, "request refused");
            self.reply(&up.node, &envelope, "error", json!(text)).await;
            return;
        }
        let work = LeaseWork {
            spec: envelope
                .content
                .get("spec")
                .cloned()
                .unwrap_or_else(|| json!({})),
            answer: up.operation == "insert",
            request: envelope,
        };
        if let Some((work, rv)) = self.beats.lease(&up.node, work) {
            self.write_lease(up.node.clone(), work, rv);
        }
    }

    /// The newest Node object known for `node`: the watched one, or our last write's.
    fn current_node(&self, node: &str) -> Option<Value> {
        let rv = |o: &Value| {
            o["metadata"]["resourceVersion"]
                .as_str()
                .and_then(|r| r.parse::<u64>().ok())
                .unwrap_or(0)
        };
        match (self.routing.node_object(node), self.beats.written(node)) {
            (Some(watched), Some(ours)) if rv(ours) > rv(watched) => Some(ours.clone()),
            (Some(watched), _) => Some(watched.clone()),
            (None, ours) => ours.cloned(),
        }
    }

    /// Runs one status write for `node` beside the owner task; its end comes back as
    /// `Input::NodeStatusWritten`.
    fn write_node_status(&self, node: String, work: StatusWork) {
        let current = self.current_node(&node);
        let api: Api<Node> = Api::all(self.client.clone());
        let (writers, results, refresh) = (
            self.writers.clone(),
            self.results.clone(),
            self.beats.refresh,
        );
        let (mqtt, root) = (self.mqtt.clone(), self.root.clone());
        tokio::spawn(async move {
            let Ok(_permit) = writers.acquire_owned().await else {
                return;
            };
            let written = write_status(&api, &node, current, &work, refresh).await;
            let failed = written.is_err();
            let object = match written {
                Ok(object) => object,
                Err(text) => {
                    warn!(error_code = "EM-EC-NODESTATUS", node = %node, error = %text, "node status not written");
                    if let StatusWork::Report(request) = &work {
                        let reply = Envelope::reply("error", request, json!(text));
                        send_reply(&mqtt, &root, &node, &reply).await;
                    }
                    None
                }
            };
            let _ = results
                .send(Input::NodeStatusWritten {
                    node,
                    object,
                    failed,
                })
                .await;
        });
    }

    /// Runs one Lease renewal for `node` (replacing version `rv` when known) beside the owner
    /// task; its end comes back as `Input::LeaseWritten`.
    fn write_lease(&self, node: String, work: LeaseWork, rv: Option<String>) {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), NODE_LEASE_NAMESPACE);
        let (writers, results) = (self.writers.clone(), self.results.clone());
        let (mqtt, root) = (self.mqtt.clone(), self.root.clone());
        tokio::spawn(async move {
            let Ok(_permit) = writers.acquire_owned().await else {
                return;
            };
            let rv = match renew_lease(&api, &node, &work.spec, rv).await {
                Ok(lease) => {
                    let rv = lease.metadata.resource_version.clone();
                    if work.answer {
                        let content = serde_json::to_value(&lease).unwrap_or(Value::Null);
                        let reply = Envelope::reply("response", &work.request, content);
                        send_reply(&mqtt, &root, &node, &reply).await;
                    }
                    rv
                }
                Err(text) => {
                    warn!(error_code = "EM-EC-LEASE-WRITE", node = %node, error = %text, "lease not renewed");
                    let reply = Envelope::reply("error", &work.request, json!(text));
                    send_reply(&mqtt, &root, &node, &reply).await;
                    None
                }
            };
            let _ = results.send(Input::LeaseWritten { node, rv }).await;
        });
    }

    /// Runs `work` beside the owner task (bounded by the writers) and answers `request` with
    /// `response` and its value, or `error` and its text (logged with `code`).
    fn answer_later<F>(&self, up: &UpTopic, request: Envelope, code: &'static str, work: F)
    where
        F: std::future::Future<Output = Result<Value, String>> + Send + 'static,
    {
        let (mqtt, root, node) = (self.mqtt.clone(), self.root.clone(), up.node.clone());
        let writers = self.writers.clone();
        tokio::spawn(async move {
            let Ok(_permit) = writers.acquire_owned().await else {
                return;
            };
            let reply = match work.await {
                Ok(content) => Envelope::reply("response", &request, content),
                Err(text) => {
                    warn!(error_code = code, node = %node, resource = %request.route.resource, error = %text, "request refused or failed");
                    Envelope::reply("error", &request, json!(text))
                }
            };
            send_reply(&mqtt, &root, &node, &reply).await;
        });
    }

    /// `update <ns>/podstatus[/<name>]`: one `{UID, Name, Status}` or a list of them.
    async fn pod_status(&mut self, up: &UpTopic, envelope: &Envelope) {
        let items = match &envelope.content {
            Value::Array(items) => items.clone(),
            item => vec![item.clone()],
        };
        for item in items {
            let name = item["Name"]
                .as_str()
                .map(str::to_owned)
                .or_else(|| resource_name(up, envelope));
            let (Some(name), Some(uid)) = (name, item["UID"].as_str()) else {
                warn!(error_code = "EM-EC-MESSAGE", node = %up.node, "podstatus without UID and Name; dropped");
                continue;
            };
            self.one_status(&up.node, &up.namespace, &name, uid, &item["Status"])
                .await;
        }
    }

    async fn one_status(&mut self, node: &str, ns: &str, name: &str, uid: &str, reported: &Value) {
        let key = (ns.to_owned(), name.to_owned());
        let Some(pod) = self.routing.pod(ns, name).filter(|p| p.uid == uid) else {
            // No such pod (or another one of that name): the node must stop it (KubeEdge
            // upstream.go: NotFound or UID mismatch -> delete down).
            let out = Outgoing {
                node: node.to_owned(),
                operation: "delete",
                resource: format!("{ns}/pod/{name}"),
                content: json!({"metadata": {"name": name, "namespace": ns, "uid": uid}}),
                rv: None,
                force: true,
            };
            self.submit(vec![out]).await;
            return;
        };
        if pod.node.as_deref() != Some(node) {
            warn!(error_code = "EM-EC-FORBIDDEN", node, pod = %format!("{ns}/{name}"),
                  "status for a pod bound elsewhere; ignored");
            return;
        }
        let current = pod.status();
        let wanted = status::merge(&current, reported, &status::now());
        let deleting = pod.deleting;
        let finished = deleting && status::terminal(&wanted);
        // The last status queued is kept as its text: exact, and a fraction of a `Value`.
        let text = serde_json::to_string(&wanted).unwrap_or_default();
        let unchanged = current == wanted || self.written.get(&key) == Some(&text);
        if !unchanged {
            match serde_json::value::to_raw_value(&status::patch(&current, &wanted)) {
                Ok(patch) => {
                    self.written.insert(key.clone(), text);
                    self.statuses.push(key.clone(), patch);
                    self.start_status_writes();
                }
                Err(e) => {
                    warn!(error_code = "EM-EC-ENCODE", pod = %name, error = %e, "pod status not encoded")
                }
            }
        }
        if finished {
            if self.statuses.pending(&key) {
                // Deleted once its last status is written, as a write queued before it.
                self.delete_after.insert(key, uid.to_owned());
            } else {
                self.finish_delete(ns, name, uid);
            }
        }
    }

    /// Starts the pod status writes a writer is free for; each ends as `Input::StatusWritten`.
    fn start_status_writes(&mut self) {
        for ((ns, name), patch) in self.statuses.start() {
            let api: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            let (writers, results) = (self.writers.clone(), self.results.clone());
            tokio::spawn(async move {
                let Ok(_permit) = writers.acquire_owned().await else {
                    return;
                };
                let written = api
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await;
                if let Err(e) = &written {
                    warn!(error_code = "EM-EC-STATUS", pod = %name, error = %e, "pod status not written");
                }
                let _ = results
                    .send(Input::StatusWritten {
                        key: (ns, name),
                        ok: written.is_ok(),
                    })
                    .await;
            });
        }
    }

    /// Deletes with grace 0 and a UID precondition: the node has stopped the pod.
    fn finish_delete(&self, ns: &str, name: &str, uid: &str) {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let (writers, name, cancel) = (self.writers.clone(), name.to_owned(), self.cancel.clone());
        tokio::spawn(async move {
            let Ok(_permit) = writers.acquire_owned().await else {
                return;
            };
            if cancel.is_cancelled() {
                return;
            }
            match api.delete(&name, &params).await {
                Ok(_) => info!(pod = %name, "graceful deletion finished"),
                // Gone already, or replaced by a new pod of that name: nothing to finish.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
                Err(e) => {
                    warn!(error_code = "EM-EC-DELETE", pod = %name, error = %e, "pod not deleted")
                }
            }
        });
    }

    /// `delete <ns>/pod`: edged stopped and removed a pod. Finishes a graceful deletion; a pod
    /// the API still wants there is sent again (the node lost it).
    async fn pod_gone(&mut self, up: &UpTopic, envelope: &Envelope) {
        let Some(name) = resource_name(up, envelope) else {
            return;
        };
        let uid = envelope.content["metadata"]["uid"]
            .as_str()
            .or_else(|| envelope.content.as_str())
            .unwrap_or_default()
            .to_owned();
        let Some(pod) = self.routing.pod(&up.namespace, &name) else {
            return;
        };
        if pod.node.as_deref() != Some(up.node.as_str()) || (!uid.is_empty() && pod.uid != uid) {
            return;
        }
        if pod.deleting {
            let uid = pod.uid.clone();
            self.finish_delete(&up.namespace, &name, &uid);
            return;
        }
        let out = Outgoing {
            node: up.node.clone(),
            operation: "insert",
            resource: format!("{}/pod/{name}", up.namespace),
            content: pod.object(),
            rv: pod.rv,
            force: true,
        };
        self.submit(vec![out]).await;
    }

    /// `query`: configmaps and secrets a pod on that node references, and the node's own Node;
    /// everything else is refused (a node reads only what its pods need).
    async fn query(&mut self, up: &UpTopic, envelope: &Envelope) {
        let name = resource_name(up, envelope).unwrap_or_default();
        let answer = match up.kind.as_str() {
            kind @ ("configmap" | "secret") => {
                let kind = if kind == "configmap" {
                    "configmap"
                } else {
                    "secret"
                };
                let r = Ref {
                    kind,
                    namespace: up.namespace.clone(),
                    name: name.clone(),
                };
                match self.routing.readable(&up.node, &r) {
                    Ok(object) => Ok(object.clone()),
                    Err(true) => Err(format!("{kind}s \"{name}\" not found")),
                    Err(false) => Err(format!(
                        "forbidden: node {} may not read {kind} {}/{name}: no pod bound to it references it",
                        up.node, up.namespace
                    )),
                }
            }
            "node" if name == up.node => self
                .routing
                .node_object(&name)
                .cloned()
                .ok_or_else(|| format!("nodes \"{name}\" not found")),
            kind => Err(format!(
                "forbidden: node {} may not read {kind} {}/{name}",
                up.node, up.namespace
            )),
        };
        match answer {
            Ok(object) => self.reply(&up.node, envelope, "response", object).await,
            Err(text) => {
                info!(node = %up.node, resource = %envelope.route.resource, reason = %text, "query refused");
                self.reply(&up.node, envelope, "error", json!(text)).await;
            }
        }
    }
}

/// Creates Node `name` from the node's document unless it exists, with the edge label.
async fn register_node(api: &Api<Node>, name: &str, content: &Value) -> Result<(), String> {
    match api.get_opt(name).await {
        Ok(Some(_)) => return Ok(()),
        Ok(None) => {}
        Err(e) => return Err(e.to_string()),
    }
    let mut document = if content.is_object() {
        content.clone()
    } else {
        json!({})
    };
    document["apiVersion"] = json!("v1");
    document["kind"] = json!("Node");
    document["metadata"] = json!({"name": name, "labels": document["metadata"]["labels"].clone()});
    if !document["metadata"]["labels"].is_object() {
        document["metadata"]["labels"] = json!({});
    }
    document["metadata"]["labels"][EDGE_LABEL] = json!("");
    // Its first status counts as a heartbeat: the Node is Ready from the start.
    let now = status::now();
    if let Some(conditions) = document["status"]["conditions"].as_array_mut() {
        for condition in conditions {
            condition["lastHeartbeatTime"] = json!(now);
            condition["lastTransitionTime"] = json!(now);
        }
    }
    let node: Node = serde_json::from_value(document).map_err(|e| format!("not a Node: {e}"))?;
    match api.create(&PostParams::default(), &node).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// Publishes `reply` to `node` from a task beside the owner.
async fn send_reply(mqtt: &AsyncClient, root: &str, node: &str, reply: &Envelope) {
    let topic = down_topic(root, node, &reply.route.operation, &reply.route.resource);
    if let Ok(payload) = serde_json::to_vec(reply) {
        if let Err(e) = mqtt.publish(topic, QoS::AtLeastOnce, false, payload).await {
            warn!(error_code = "EM-EC-MQTT", error = %e, "reply not queued");
        }
    }
}

/// One status write for Node `name` over `current` (fetched when unknown); the Node it left,
/// `None` when nothing needed writing. A report for a Node that does not exist registers it
/// (the heartbeat overtook the registration, or the Node was deleted while the node ran).
async fn write_status(
    api: &Api<Node>,
    name: &str,
    current: Option<Value>,
    work: &StatusWork,
    refresh: Duration,
) -> Result<Option<Value>, String> {
    let current = match current {
        Some(current) => current,
        None => match api.get_opt(name).await.map_err(|e| e.to_string())? {
            Some(node) => serde_json::to_value(&node).unwrap_or(Value::Null),
            None => {
                if let StatusWork::Report(request) = work {
                    register_node(api, name, &request.content).await?;
                }
                return Ok(None);
            }
        },
    };
    let now = status::now();
    let wanted = match work {
        StatusWork::Report(request) => {
            let reported = heartbeat::reported_status(&request.content)
                .ok_or_else(|| "no node status in the message".to_owned())?;
            heartbeat::status_to_write(&current["status"], reported, &now, refresh)
        }
        StatusWork::Offline => heartbeat::offline_status(&current["status"], &now),
    };
    let Some(wanted) = wanted else {
        return Ok(None);
    };
    let patch = status::patch(&current["status"], &wanted);
    let node = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| e.to_string())?;
    Ok(Some(serde_json::to_value(&node).unwrap_or(Value::Null)))
}

/// Renews Lease `name` with `spec` and the controller's clock: one replace while `rv` is
/// the stored version; a conflict or a missing Lease learns the version and tries again.
async fn renew_lease(
    api: &Api<Lease>,
    name: &str,
    spec: &Value,
    mut rv: Option<String>,
) -> Result<Lease, String> {
    let mut spec = if spec.is_object() {
        spec.clone()
    } else {
        json!({})
    };
    // The controller's clock: an edge device without a real-time clock cannot move it back.
    spec["renewTime"] = json!(heartbeat::micro_now());
    if spec.get("holderIdentity").is_none() {
        spec["holderIdentity"] = json!(name);
    }
    for _ in 0..3 {
        let mut document = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                   "metadata": {"name": name}, "spec": spec});
        if let Some(rv) = &rv {
            document["metadata"]["resourceVersion"] = json!(rv);
        }
        let lease: Lease =
            serde_json::from_value(document).map_err(|e| format!("not a Lease spec: {e}"))?;
        let written = match rv {
            Some(_) => api.replace(name, &PostParams::default(), &lease).await,
            None => api.create(&PostParams::default(), &lease).await,
        };
        match written {
            Ok(lease) => return Ok(lease),
            Err(kube::Error::Api(s)) if s.code == 409 || s.code == 404 => {
                rv = api
                    .get_opt(name)
                    .await
                    .map_err(|e| e.to_string())?
                    .and_then(|l| l.metadata.resource_version);
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!("lease {name} kept changing; not written"))
}
