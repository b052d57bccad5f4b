//! The owner of the node's Devices and DeviceModels as DMI sees them (fed, in commit order, by
//! the MetaManager's DMI feed), of the registered mappers (one per protocol, as KubeEdge: a
//! second registration of a protocol replaces the first) and of their report limits.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use edgemeta_broker::Link;
use edgemeta_metamanager::dmi_feed::{self, Item, DEVICE, DEVICE_MAPPER, DEVICE_MODEL};
use edgemeta_metamanager::{DeviceReports, Verdict};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tracing::{info, warn};

use crate::convert;
use crate::dispatch::{self, Handover, Key, Op, Unsettled};
use crate::pb;
use crate::DmiConfig;

/// What the gRPC service asks the registry.
pub(crate) enum Ask {
    Register {
        mapper: pb::MapperInfo,
        address: PathBuf,
        with_data: bool,
        reply: oneshot::Sender<Result<pb::MapperRegisterResponse, Status>>,
    },
    /// May the mapper of this device report now?
    Admit {
        namespace: String,
        name: String,
        reply: oneshot::Sender<Result<(), Status>>,
    },
}

/// A token bucket: `rate` per second, up to `burst` at once.
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, rate: f64, burst: f64, now: Instant) -> bool {
        let refill = now.duration_since(self.at).as_secs_f64() * rate;
        self.tokens = (self.tokens + refill).min(burst);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

struct Mapper {
    name: String,
    /// Closed to hand over to a new registration's dispatcher.
    ops: mpsc::Sender<Op>,
    cancel: CancellationToken,
    task: JoinHandle<Option<Unsettled>>,
}

struct Registry {
    config: DmiConfig,
    devices: HashMap<Key, Value>,
    models: HashMap<Key, Value>,
    mappers: HashMap<String, Mapper>,
    buckets: HashMap<String, Bucket>,
    /// The feed has delivered the node's whole set once: registrations are answered.
    synced: bool,
    waiting: Vec<Ask>,
    reports: DeviceReports,
    cancel: CancellationToken,
}

/// Starts the registry: it asks the MetaManager for a resync once its link is subscribed.
pub(crate) fn spawn(
    config: DmiConfig,
    link: Link,
    reports: DeviceReports,
    cancel: CancellationToken,
) -> (mpsc::Sender<Ask>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(1024);
    let registry = Registry {
        config,
        devices: HashMap::new(),
        models: HashMap::new(),
        mappers: HashMap::new(),
        buckets: HashMap::new(),
        synced: false,
        waiting: Vec::new(),
        reports: reports.clone(),
        cancel: cancel.clone(),
    };
    let task = tokio::spawn(registry.run(link, rx, reports));
    (tx, task)
}

impl Registry {
    async fn run(mut self, link: Link, mut asks: mpsc::Receiver<Ask>, reports: DeviceReports) {
        let Link { mut inbox, .. } = link;
        // Until the store has handed over what it holds, registrations wait.
        let resync = {
            let reports = reports.clone();
            tokio::spawn(async move {
                let mut wait = Duration::from_millis(50);
                while reports.resync().await != Verdict::Stored {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            })
        };
        drop(reports);
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => break,
                message = inbox.recv() => match message {
                    Some(message) => {
                        if let Some(item) = dmi_feed::parse(&message.topic, &message.payload) {
                            self.feed(item).await;
                        }
                    }
                    None => break,
                },
                Some(ask) = asks.recv() => self.ask(ask).await,
            }
        }
        resync.abort();
        for (_, mapper) in self.mappers.drain() {
            mapper.cancel.cancel();
            let _ = mapper.task.await;
        }
    }

    async fn ask(&mut self, ask: Ask) {
        match ask {
            Ask::Admit {
                namespace,
                name,
                reply,
            } => {
                let _ = reply.send(self.admit(namespace, name));
            }
            register @ Ask::Register { .. } if !self.synced => self.waiting.push(register),
            Ask::Register {
                mapper,
                address,
                with_data,
                reply,
            } => self.register(mapper, address, with_data, reply).await,
        }
    }

    // The gRPC service answers this `Status` as it is; boxing it would only unbox it there.
    #[allow(clippy::result_large_err)]
    fn admit(&mut self, namespace: String, name: String) -> Result<(), Status> {
        let key = (namespace, name);
        let Some(device) = self.devices.get(&key) else {
            // A device only an MQTT membership added (no Device object) is still the node's:
            // the store answers 404 where it is not.
            return Ok(());
        };
        let protocol = convert::device_protocol(device);
        let (rate, burst) = (
            f64::from(self.config.reports_per_s.max(1)),
            f64::from(self.config.report_burst.max(1)),
        );
        let now = Instant::now();
        let bucket = self.buckets.entry(protocol.clone()).or_insert(Bucket {
            tokens: burst,
            at: now,
        });
        if bucket.take(rate, burst, now) {
            Ok(())
        } else {
            warn!(error_code = "EM-DMI-LIMIT", %protocol, device = %key.1, "mapper over its report limit; report refused");
            Err(Status::resource_exhausted(format!(
                "EM-DMI-LIMIT: the {protocol} mapper reports more than {} a second (burst {})",
                self.config.reports_per_s, self.config.report_burst
            )))
        }
    }

    /// Registers the mapper: its dispatcher answers `reply` once the one before (if the
    /// protocol was registered already) has ended.
    async fn register(
        &mut self,
        mapper: pb::MapperInfo,
        address: PathBuf,
        with_data: bool,
        reply: oneshot::Sender<Result<pb::MapperRegisterResponse, Status>>,
    ) {
        let protocol = mapper.protocol.clone();
        if !self.mappers.contains_key(&protocol) && self.mappers.len() >= self.config.max_mappers {
            let _ = reply.send(Err(Status::resource_exhausted(format!(
                "EM-DMI-LIMIT: {} mappers registered already",
                self.mappers.len()
            ))));
            return;
        }
        // KubeEdge's two parallel lists: each device with its model (models repeat).
        let mut response = pb::MapperRegisterResponse::default();
        let mut held_devices = HashMap::new();
        let mut held_models = HashMap::new();
        let mut listed = HashMap::new();
        let mut keys: Vec<&Key> = self.devices.keys().collect();
        keys.sort();
        for key in keys {
            let Some((device, model)) = self.converted(key, &protocol) else {
                continue;
            };
            held_devices.insert(key.clone(), device.clone());
            held_models.insert(model.0.clone(), model.1.clone());
            response.device_list.push(device.clone());
            response.model_list.push(model.1.clone());
            listed.insert(key.clone(), (device, model));
        }
        // The dispatcher before, its channel closed (dropped with `old`): it ends once its
        // running call is answered, and the new one waits for that before answering.
        let previous = self.mappers.remove(&protocol).map(|old| {
            info!(%protocol, old = %old.name, new = %mapper.name, "mapper registered again; it gets the node's devices afresh");
            old.task
        });
        info!(%protocol, mapper = %mapper.name, address = %address.display(), devices = response.device_list.len(), with_data, "mapper registered");
        let info = serde_json::json!({
            "name": mapper.name, "version": mapper.version, "api_version": mapper.api_version,
            "protocol": protocol, "address": address.display().to_string(), "state": mapper.state,
        });
        let stored = self
            .reports
            .mapper_registered(&protocol, bytes::Bytes::from(info.to_string()))
            .await;
        if stored != Verdict::Stored {
            warn!(error_code = "EM-DMI-STORE", %protocol, ?stored, "mapper not stored: after a node restart it gets calls only once it registers again");
        }
        if !with_data {
            response = pb::MapperRegisterResponse::default();
        }
        let handover = Handover {
            previous,
            listed,
            reply,
            response,
        };
        let (ops, task, cancel) = dispatch::spawn(
            protocol.clone(),
            address,
            held_devices,
            held_models,
            Some(handover),
            &self.config,
            self.cancel.child_token(),
        );
        self.mappers.insert(
            protocol,
            Mapper {
                name: mapper.name,
                ops,
                cancel,
                task,
            },
        );
    }

    /// The device at `key` and its model, converted, if it is for `protocol` and its model is
    /// on the node (KubeEdge skips a device whose model it lacks).
    fn converted(&self, key: &Key, protocol: &str) -> Option<(pb::Device, (Key, pb::DeviceModel))> {
        let device = self.devices.get(key)?;
        if convert::device_protocol(device) != protocol {
            return None;
        }
        let model_key = convert::model_of(device);
        let model = self.models.get(&model_key)?;
        Some((
            convert::device(device, Some(model)),
            (model_key, convert::model(model)),
        ))
    }

    /// A mapper registered before the node (re)started, as stored: it is called again at its
    /// address. What it holds is not known, so every device of its protocol is sent again as
    /// an update (and each model), which brings it to the node's set if it kept running.
    async fn restore(&mut self, protocol: String, info: &Value) {
        if self.mappers.contains_key(&protocol) {
            return;
        }
        let Some(address) = info["address"].as_str().filter(|a| !a.is_empty()) else {
            return;
        };
        let mut keys: Vec<Key> = self.devices.keys().cloned().collect();
        keys.sort();
        let wanted: Vec<(Key, dispatch::Wanted)> = keys
            .into_iter()
            .filter_map(|k| self.converted(&k, &protocol).map(|w| (k, w)))
            .collect();
        // Held as "something": never equal to what is wanted, so updates, not registrations.
        let held_devices = wanted
            .iter()
            .map(|(k, _)| (k.clone(), pb::Device::default()))
            .collect();
        let held_models = wanted
            .iter()
            .map(|(_, (_, (m, _)))| (m.clone(), pb::DeviceModel::default()))
            .collect();
        let (ops, task, cancel) = dispatch::spawn(
            protocol.clone(),
            PathBuf::from(address),
            held_devices,
            held_models,
            None,
            &self.config,
            self.cancel.child_token(),
        );
        info!(%protocol, %address, devices = wanted.len(), "mapper registered before the node started; calling it again");
        for (key, want) in wanted {
            let _ = ops.send(Op::Device(key, Some(Box::new(want)))).await;
        }
        let name = info["name"].as_str().unwrap_or_default().to_owned();
        self.mappers.insert(
            protocol,
            Mapper {
                name,
                ops,
                cancel,
                task,
            },
        );
    }

    async fn send(&self, protocol: &str, op: Op) {
        if let Some(mapper) = self.mappers.get(protocol) {
            // The dispatcher drains its channel at once; a full one means it is gone.
            let _ = mapper.ops.send(op).await;
        }
    }

    async fn feed(&mut self, item: Item) {
        match item {
            Item::Synced => {
                if !self.synced {
                    info!(
                        devices = self.devices.len(),
                        models = self.models.len(),
                        "DMI has the node's devices"
                    );
                }
                self.synced = true;
                for ask in std::mem::take(&mut self.waiting) {
                    self.ask(ask).await;
                }
            }
            Item::Object {
                res_type,
                namespace,
                name,
                object,
            } => {
                let key = (namespace, name);
                let object = object.and_then(|bytes| match serde_json::from_slice(&bytes) {
                    Ok(value) => Some(value),
                    Err(e) => {
                        warn!(error_code = "EM-DMI-FEED", error = %e, "a stored device object is not JSON; ignored");
                        None
                    }
                });
                if res_type == DEVICE {
                    self.device_changed(key, object).await;
                } else if res_type == DEVICE_MODEL {
                    self.model_changed(key, object).await;
                } else if res_type == DEVICE_MAPPER {
                    if let Some(object) = object {
                        self.restore(key.1, &object).await;
                    }
                }
            }
        }
    }

    async fn device_changed(&mut self, key: Key, object: Option<Value>) {
        let old_protocol = self.devices.get(&key).map(convert::device_protocol);
        match object {
            Some(object) => {
                let protocol = convert::device_protocol(&object);
                self.devices.insert(key.clone(), object);
                if let Some(old) = old_protocol.filter(|old| *old != protocol) {
                    self.send(&old, Op::Device(key.clone(), None)).await;
                }
                if let Some((device, model)) = self.converted(&key, &protocol) {
                    self.send(&protocol, Op::Device(key, Some(Box::new((device, model)))))
                        .await;
                }
            }
            None => {
                self.devices.remove(&key);
                if let Some(old) = old_protocol {
                    self.send(&old, Op::Device(key, None)).await;
                }
            }
        }
    }

    async fn model_changed(&mut self, key: Key, object: Option<Value>) {
        let model = object.as_ref().map(convert::model);
        match object {
            Some(object) => {
                self.models.insert(key.clone(), object);
            }
            None => {
                self.models.remove(&key);
            }
        }
        let protocols: Vec<String> = self.mappers.keys().cloned().collect();
        for protocol in protocols {
            self.send(&protocol, Op::Model(key.clone(), model.clone()))
                .await;
        }
        // Its devices take the model's defaults: they go again (unchanged ones are skipped).
        let using: Vec<Key> = self
            .devices
            .iter()
            .filter(|(_, d)| convert::model_of(d) == key)
            .map(|(k, _)| k.clone())
            .collect();
        for device in using {
            let protocol = self
                .devices
                .get(&device)
                .map(convert::device_protocol)
                .unwrap_or_default();
            if let Some(converted) = self.converted(&device, &protocol) {
                self.send(&protocol, Op::Device(device, Some(Box::new(converted))))
                    .await;
            }
        }
    }
}
