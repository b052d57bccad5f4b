//! Devices from Kubernetes (KubeEdge's devicecontroller, cloud/pkg/devicecontroller/controller/
//! downstream.go and upstream.go): `devices.kubeedge.io/v1beta1` Devices and DeviceModels become
//! membership and twin messages to each Device's node, through the pods' acked, coalescing
//! delivery; what the node's mappers report becomes the Device's DeviceStatus.
//!
//! - `state`: which node holds which device; the messages each change causes.
//! - `watch`: Devices and DeviceModels cut down to what is kept (the watch loop is `crate::watch`).
//! - `status`: DeviceStatus creation and writes, coalesced per device.

#[cfg(test)]
mod convergence;
mod state;
mod status;
mod watch;

use std::collections::BTreeSet;

use kube::api::{Api, DynamicObject};
use kube::runtime::watcher;
use kube::Client;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::delivery::{Delivery, Outgoing};
use crate::envelope::{resource_name, Envelope, UpTopic};

use crate::watch::Change;
use state::{device_id, DeviceSpec, Devices as DeviceState, Key, ModelSpec, Refused};

/// What the device side reacts to, besides node messages.
#[derive(Debug)]
pub enum Event {
    Device(Change<DeviceSpec>),
    Model(Change<ModelSpec>),
    /// A DeviceStatus write finished (`ok`: written).
    Written {
        key: Key,
        ok: bool,
    },
}

/// The device side of the owner task: routing state, relists, DeviceStatus writer.
pub struct Devices {
    state: DeviceState,
    writer: status::Writer,
    /// Names listed again since a watch restarted, per watch (`Init` .. `InitDone`).
    relisting_devices: Option<BTreeSet<Key>>,
    relisting_models: Option<BTreeSet<Key>>,
}

/// Starts the Device and DeviceModel watches; their events, and finished status writes,
/// arrive on the returned receiver.
pub fn start(client: Client, cancel: CancellationToken) -> (Devices, mpsc::Receiver<Event>) {
    let (tx, rx) = mpsc::channel(4096);
    let models: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &watch::resource("DeviceModel", "devicemodels"),
    );
    let devices: Api<DynamicObject> =
        Api::all_with(client.clone(), &watch::resource("Device", "devices"));
    crate::watch::spawn(
        models,
        watcher::Config::default(),
        "DeviceModel",
        watch::model,
        Event::Model,
        tx.clone(),
        cancel.clone(),
    );
    crate::watch::spawn(
        devices,
        watcher::Config::default(),
        "Device",
        watch::device,
        Event::Device,
        tx.clone(),
        cancel.clone(),
    );
    let devices = Devices {
        state: DeviceState::default(),
        writer: status::Writer::new(client, tx, cancel),
        relisting_devices: None,
        relisting_models: None,
    };
    (devices, rx)
}

impl Devices {
    /// A watch event or a finished write; the messages it causes.
    pub fn handle(&mut self, event: Event, delivery: &Delivery) -> Vec<Outgoing> {
        match event {
            Event::Device(change) => self.device(change, delivery),
            Event::Model(change) => self.model(change, delivery),
            Event::Written { key, ok } => {
                self.writer.written(key, ok);
                Vec::new()
            }
        }
    }

    fn device_applied(&mut self, spec: DeviceSpec, delivery: &Delivery) -> Vec<Outgoing> {
        self.writer.ensure(&spec);
        self.state.applied(spec, delivery)
    }

    fn device(&mut self, change: Change<DeviceSpec>, delivery: &Delivery) -> Vec<Outgoing> {
        match change {
            Change::Apply(spec) => self.device_applied(spec, delivery),
            Change::Delete(key) => {
                self.writer.forget(&key);
                self.state.deleted(&key)
            }
            Change::Init => {
                self.relisting_devices = Some(BTreeSet::new());
                Vec::new()
            }
            Change::InitApply(spec) => {
                if let Some(listed) = self.relisting_devices.as_mut() {
                    listed.insert(spec.key());
                }
                self.device_applied(spec, delivery)
            }
            Change::InitDone => {
                let listed = self.relisting_devices.take().unwrap_or_default();
                let mut sends = Vec::new();
                for key in self.state.known_devices().difference(&listed) {
                    self.writer.forget(key);
                    sends.extend(self.state.deleted(key));
                }
                info!(kind = "device", listed = listed.len(), "watch synced");
                sends
            }
        }
    }

    fn model(&mut self, change: Change<ModelSpec>, delivery: &Delivery) -> Vec<Outgoing> {
        match change {
            Change::Apply(model) => self.state.model_applied(model, delivery),
            Change::Delete(key) => {
                self.state.model_deleted(&key);
                Vec::new()
            }
            Change::Init => {
                self.relisting_models = Some(BTreeSet::new());
                Vec::new()
            }
            Change::InitApply(model) => {
                if let Some(listed) = self.relisting_models.as_mut() {
                    listed.insert((model.namespace.clone(), model.name.clone()));
                }
                self.state.model_applied(model, delivery)
            }
            Change::InitDone => {
                let listed = self.relisting_models.take().unwrap_or_default();
                for key in self.state.known_models().difference(&listed) {
                    self.state.model_deleted(key);
                }
                info!(kind = "devicemodel", listed = listed.len(), "watch synced");
                self.state.models_synced()
            }
        }
    }

    /// Everything `node` should hold, for a resync when it connects.
    pub fn desired(&self, node: &str) -> Vec<Outgoing> {
        self.state.desired(node)
    }

    /// `query node/membershipdetail`: the node's full device list goes down.
    pub fn detail(&self, node: &str) -> Vec<Outgoing> {
        vec![self.state.detail(node)]
    }

    /// `update <ns>/devicetwin/<name>` (twins the mappers reported) or `<ns>/devicestate/<name>`
    /// from `up.node`: written into the DeviceStatus. A node that does not hold the Device is
    /// told to drop it (KubeEdge writes whatever any node says).
    pub fn up(&mut self, up: &UpTopic, envelope: &Envelope) -> Vec<Outgoing> {
        let Some(name) = resource_name(up, envelope) else {
            return Vec::new();
        };
        let key = (up.namespace.clone(), name);
        let content: &Value = &envelope.content;
        match self.state.reported(&up.node, &key, &up.kind, content) {
            Ok(report) => {
                if let Some(spec) = self.state.spec(&key) {
                    self.writer
                        .submit(key.clone(), status::Owner::of(spec), report);
                }
                Vec::new()
            }
            Err(Refused::NotBound(sends)) => {
                debug!(node = %up.node, device = %device_id(&key), "report for a device not bound to that node; the node drops it");
                sends
            }
            Err(Refused::Malformed(detail)) => {
                warn!(error_code = "EM-EC-MESSAGE", node = %up.node, device = %device_id(&key), %detail, "device report dropped");
                Vec::new()
            }
        }
    }
}
