//! The MetaManager: KubeEdge's edge metadata hub on MQTT. Messages addressed to `<root>/meta/...`
//! are parsed, applied to the SQLite store and routed on to edged, edgemesh, edgefunction and
//! the cloud (through the durable outbox), exactly as KubeEdge v1.3's `process.go` does.
//!
//! # Layout (in the order a message flows)
//! - `intake`: a link message (on its publisher's task) or a cloud submission → topic and
//!   envelope checks → [`Request`] or a device `Event`; malformed input answered.
//! - the grammar (topics, envelope, operations, resources) is `edgemeta-protocol`'s.
//! - `unit`: the unit of work: `Job`, `Work`, `Step`, the handlers' `Context`, the state.
//! - `worker`: the store owner thread; group commit, one savepoint per message.
//! - `handlers/`: what each message family does, one file each, driven for requests by the
//!   `routing` table; `reply`: the one place a failure becomes what a client sees.
//! - `devices/`: KubeEdge's DeviceTwin, its domain part (ids, topics, JSON shapes, twin merge).
//! - [`store`]: libsql on a local file: `meta` (KubeEdge's table), `outbox` and `handon`.
//! - `durable`: the durability watermark: acknowledgements wait for the WAL's fsync.
//! - `handon`: committed local messages, handed to the broker at their subscribers' pace.
//! - `outbox`: every rule of the cloud outbox; `outbox_handle`: the handle its deliverers use.
//! - `meters`: message counters and commit latency, registered once for the node's metrics.
//! - `relay`: without a cloud bridge, the outbox goes to the local `<root>/cloud/...` topics.

mod devices;
mod durable;
mod error;
mod handlers;
mod handon;
mod intake;
mod meters;
mod outbox;
mod outbox_handle;
mod relay;
mod reply;
mod request;
mod routing;
pub mod store;
mod unit;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::{Link, Message};
use serde::Deserialize;
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use devices::feed as dmi_feed;
pub use edgemeta_protocol::Operation;
pub use error::Error;
pub use handon::HandonGauge;
pub use intake::{parse as parse_message, IntakeConfig, Refused};
pub use meters::Meters;
pub use outbox::{OutboxEntry, OutboxStats};
pub use outbox_handle::{OutboxHandle, PendingAck};
pub use request::{Request, Requester};
pub use store::StoreConfig;
pub use unit::Outcome;
use worker::Stopped;

/// Committed batches of changes a live watch may fall behind by before it reads the history.
const CHANGES_CAPACITY: usize = 1024;

/// MetaManager settings (`metamanager:` in the YAML config).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MetaConfig {
    /// Largest payload accepted on `<root>/meta/...`; larger ones get an `error` reply.
    #[serde(default = "default_max_payload_bytes")]
    pub max_payload_bytes: usize,
    /// How long a remote query waits for the cloud before answering from the store or failing.
    #[serde(default = "default_wait_ms")]
    pub remote_query_timeout_ms: u64,
    /// How long a CSI volume call waits for edged's answer.
    #[serde(default = "default_wait_ms")]
    pub volume_timeout_ms: u64,
    /// Seconds between pod-status syncs to the cloud (KubeEdge `podStatusSyncInterval`).
    #[serde(default = "default_podstatus_sync_interval_s")]
    pub podstatus_sync_interval_s: u64,
    /// Messages that may wait for the store worker before the clients publishing to it wait.
    #[serde(default = "default_queue_capacity")]
    pub queue_capacity: usize,
}

const fn default_max_payload_bytes() -> usize {
    1024 * 1024
}
const fn default_wait_ms() -> u64 {
    60_000
}
const fn default_podstatus_sync_interval_s() -> u64 {
    60
}
const fn default_queue_capacity() -> usize {
    4096
}

impl Default for MetaConfig {
    fn default() -> Self {
        MetaConfig {
            max_payload_bytes: default_max_payload_bytes(),
            remote_query_timeout_ms: default_wait_ms(),
            volume_timeout_ms: default_wait_ms(),
            podstatus_sync_interval_s: default_podstatus_sync_interval_s(),
            queue_capacity: default_queue_capacity(),
        }
    }
}

/// The topic root (`broker.topic_root`) and this node's name (`cloud.node_id`, which devices'
/// membership topics carry).
#[derive(Debug, Clone, Copy)]
pub struct Names<'a> {
    pub root: &'a str,
    pub node: &'a str,
}

/// The filters the MetaManager's link subscribes to: its own topics and the devices' ones.
pub fn subscriptions(root: &str) -> Vec<String> {
    let mut filters = vec![format!("{root}/{}/#", edgemeta_protocol::META)];
    filters.extend(devices::filters());
    filters
}

/// Hands messages to the MetaManager as if they had arrived on its topics, and says when each
/// is final: the cloud bridge acknowledges a cloud message only after that.
#[derive(Clone)]
pub struct Ingress {
    tx: mpsc::Sender<intake::Submission>,
}

impl Ingress {
    /// Queues `message` (its topic is `<root>/meta/...`); the receiver tells once the message is
    /// committed or refused for good ([`Outcome::Final`]), or should be delivered again later.
    pub async fn submit(&self, message: Message) -> Result<oneshot::Receiver<Outcome>, Error> {
        let (done, rx) = oneshot::channel();
        self.tx
            .send((message, done))
            .await
            .map_err(|_| Error::Closed)?;
        Ok(rx)
    }
}

/// What a device message handed in through [`DeviceReports`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Committed (and durable, as a client's PUBACK would say).
    Stored,
    /// Refused as the mapper topics refuse it (400 bad input, 404 unknown device); nothing
    /// changed.
    Refused { code: u16, reason: String },
    /// Not stored: the store failed or the node is stopping; the sender may try again.
    Retry,
}

/// The node's DMI server's way in: a gRPC mapper's reports applied by the same families as
/// the MQTT topics (`twin_update`, `state_update`), each answered only once committed.
#[derive(Clone)]
pub struct DeviceReports {
    jobs: mpsc::Sender<unit::Job>,
}

impl DeviceReports {
    /// `$hw/events/device/<id>/twin/update` with `payload`, as a mapper would publish it.
    pub async fn twin_update(&self, id: &str, payload: bytes::Bytes) -> Verdict {
        self.apply("twin_update", id, "/twin/update", payload).await
    }

    /// `$hw/events/device/<id>/state/update` with `payload`.
    pub async fn state_update(&self, id: &str, payload: bytes::Bytes) -> Verdict {
        self.apply("state_update", id, "/state/update", payload)
            .await
    }

    /// Every stored Device and DeviceModel again on the DMI feed ([`dmi_feed`]), then its end
    /// mark, in commit order with every other change.
    pub async fn resync(&self) -> Verdict {
        self.apply("dmi_resync", "", "", bytes::Bytes::new()).await
    }

    /// Stores the mapper of `protocol` (one topic level) as registered, `info` its JSON: a
    /// restarted node finds it in the resync.
    pub async fn mapper_registered(&self, protocol: &str, info: bytes::Bytes) -> Verdict {
        if !devices::is_level(protocol) {
            return Verdict::Refused {
                code: 400,
                reason: format!("protocol {protocol:?} is not one topic level"),
            };
        }
        self.apply("dmi_mapper", protocol, "", info).await
    }

    async fn apply(&self, kind: &str, id: &str, suffix: &str, payload: bytes::Bytes) -> Verdict {
        let Some(family) = handlers::family(kind) else {
            return Verdict::Refused {
                code: 500,
                reason: format!("no device family {kind}"),
            };
        };
        let topic = if suffix.is_empty() {
            String::new()
        } else {
            devices::device_topic(id, suffix)
        };
        let event = devices::Event {
            family,
            id: id.to_owned(),
            topic,
            payload,
            ack: None,
        };
        let verdict = Arc::new(std::sync::OnceLock::new());
        let report = unit::Report {
            event,
            verdict: verdict.clone(),
        };
        let (done, rx) = oneshot::channel();
        let job = unit::Job::Apply(
            unit::Work::Report(Box::new(report)),
            Some(unit::Done::Told(done)),
        );
        if self.jobs.send(job).await.is_err() {
            return Verdict::Retry;
        }
        match rx.await {
            Ok(Outcome::Final) => match verdict.get() {
                Some(None) => Verdict::Stored,
                Some(Some((code, reason))) => Verdict::Refused {
                    code: *code,
                    reason: reason.clone(),
                },
                None => Verdict::Refused {
                    code: 500,
                    reason: "the report could not be applied".to_owned(),
                },
            },
            Ok(Outcome::Retry) | Err(_) => Verdict::Retry,
        }
    }
}

/// A running MetaManager: it owns its tasks (intake, the relay) and its store thread.
pub struct MetaManager {
    outbox: OutboxHandle,
    /// Committed changes of served objects, batch by batch (the MetaServer's live watches).
    changes: broadcast::Sender<store::Changes>,
    ingress: Ingress,
    reports: DeviceReports,
    intake: Option<JoinHandle<()>>,
    relay: Option<JoinHandle<()>>,
    /// Hands committed messages on at their subscribers' pace (`handon.rs`).
    pump: Option<JoinHandle<()>>,
    handons: Arc<HandonGauge>,
    store_done: oneshot::Receiver<Stopped>,
    /// How the store thread ended, once [`MetaManager::failed`] saw it end.
    store_stopped: Option<Stopped>,
}

impl MetaManager {
    /// Opens the store and starts intake and worker on `link` (subscribed to [`subscriptions`]).
    ///
    /// With `local_relay`, the outbox is delivered to the local broker (no cloud bridge).
    /// `meters` counts messages and commits ([`Meters::noop`] for none).
    pub async fn start(
        config: &MetaConfig,
        store: &StoreConfig,
        names: Names<'_>,
        link: Link,
        local_relay: bool,
        meters: Arc<Meters>,
        cancel: CancellationToken,
    ) -> Result<MetaManager, Error> {
        let (jobs_tx, jobs_rx) = mpsc::channel(config.queue_capacity.max(1));
        let changed = Arc::new(Notify::new());
        let Names { root, node } = names;
        let worker_config = worker::WorkerConfig {
            root: root.to_owned(),
            node: node.to_owned(),
            waits: unit::Waits {
                remote_query: Duration::from_millis(config.remote_query_timeout_ms),
                volume: Duration::from_millis(config.volume_timeout_ms),
            },
            podstatus_sync_interval: Duration::from_secs(config.podstatus_sync_interval_s.max(1)),
            batch_max: store.batch_max.max(1),
            outbox_limit: outbox::OutboxLimit {
                entries: store.outbox_max_entries,
                bytes: store.outbox_max_bytes,
            },
            local_relay,
        };
        let Link { inbox, publisher } = link;
        let (feed, pump, handons) = handon::channel();
        let (changes, _) = broadcast::channel(CHANGES_CAPACITY);
        let store_done = worker::spawn(
            store.clone(),
            worker_config,
            jobs_rx,
            publisher.clone(),
            feed,
            worker::Announce {
                outbox_changed: changed.clone(),
                changes: changes.clone(),
            },
            meters.clone(),
        )
        .await?;
        let outbox = OutboxHandle::new(jobs_tx.clone(), changed.clone());
        let reports = DeviceReports {
            jobs: jobs_tx.clone(),
        };
        let pump = tokio::spawn(handon::run(
            pump,
            outbox.clone(),
            publisher.clone(),
            cancel.clone(),
        ));
        let relay = local_relay.then(|| {
            tokio::spawn(relay::run(
                outbox.clone(),
                publisher.clone(),
                changed,
                cancel.clone(),
            ))
        });
        let intake_config = intake::IntakeConfig {
            root: root.to_owned(),
            node: node.to_owned(),
            max_payload_bytes: config.max_payload_bytes,
            meters,
        };
        let (submit_tx, submissions) = mpsc::channel(config.queue_capacity.max(1));
        let taker = Arc::new(intake::Taker::new(
            intake_config.clone(),
            jobs_tx.clone(),
            publisher.clone(),
        ));
        publisher.take_with(taker.clone());
        let intake = tokio::spawn(intake::run(
            intake_config,
            inbox,
            submissions,
            jobs_tx,
            (taker, publisher),
            cancel,
        ));
        Ok(MetaManager {
            outbox,
            changes,
            ingress: Ingress { tx: submit_tx },
            reports,
            intake: Some(intake),
            relay,
            pump: Some(pump),
            handons,
            store_done,
            store_stopped: None,
        })
    }

    /// The way in for messages that do not come through the local broker (the cloud bridge).
    pub fn ingress(&self) -> Ingress {
        self.ingress.clone()
    }

    /// The DMI server's way in for its mappers' reports. Drop every clone before
    /// [`MetaManager::stopped`]: the store thread ends once no one can hand it work.
    pub fn device_reports(&self) -> DeviceReports {
        self.reports.clone()
    }

    /// Hand-ons committed and waiting for their subscribers, for the node's metrics.
    pub fn handons(&self) -> Arc<HandonGauge> {
        self.handons.clone()
    }

    /// Committed changes of served objects, each batch once after its `COMMIT`, in version
    /// order: subscribe, then read the history, and skip what the history already had.
    pub fn changes(&self) -> broadcast::Sender<store::Changes> {
        self.changes.clone()
    }

    /// The outbox, for a cloud bridge.
    pub fn outbox(&self) -> OutboxHandle {
        self.outbox.clone()
    }

    /// Resolves if the store thread, intake or the relay ends while the node runs (a panic, or a
    /// link that closed): nobody would answer the node's clients any more, so the binary stops it.
    pub async fn failed(&mut self) -> Error {
        let (task, panicked) = tokio::select! {
            stopped = &mut self.store_done => {
                let stopped = stopped.unwrap_or(Stopped::Panicked);
                self.store_stopped = Some(stopped);
                ("store", stopped == Stopped::Panicked)
            }
            joined = join(&mut self.intake) => ("intake", joined.is_err()),
            joined = join(&mut self.relay) => ("relay", joined.is_err()),
            joined = join(&mut self.pump) => ("hand-on pump", joined.is_err()),
        };
        if panicked {
            Error::Panicked { task }
        } else {
            Error::Ended { task }
        }
    }

    /// Waits until intake and the relay have stopped and the worker has committed everything
    /// it accepted. Cancel the token given to [`MetaManager::start`] first. A task or the store
    /// thread that panicked is reported, for the binary's exit code.
    pub async fn stopped(self) -> Result<(), Error> {
        let MetaManager {
            outbox,
            changes: _,
            ingress,
            reports,
            intake,
            relay,
            pump,
            handons: _,
            store_done,
            store_stopped,
        } = self;
        drop(ingress);
        drop(reports);
        let mut result = Ok(());
        for (task, handle) in [("intake", intake), ("relay", relay), ("hand-on pump", pump)] {
            if let Some(handle) = handle {
                if handle.await.is_err() {
                    result = Err(Error::Panicked { task });
                }
            }
        }
        drop(outbox);
        let stopped = match store_stopped {
            Some(stopped) => stopped,
            None => store_done.await.unwrap_or(Stopped::Panicked),
        };
        if stopped == Stopped::Panicked {
            result = Err(Error::Panicked { task: "store" });
        }
        result
    }
}

/// Waits for the task in `handle`, taking it, so a finished handle is never polled again; never
/// resolves when there is none.
async fn join(handle: &mut Option<JoinHandle<()>>) -> Result<(), tokio::task::JoinError> {
    match handle {
        Some(task) => {
            let joined = task.await;
            *handle = None;
            joined
        }
        None => std::future::pending().await,
    }
}
