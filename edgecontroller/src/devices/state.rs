//! Which node holds which device, and the messages each change causes (KubeEdge's
//! downstream.go `deviceAdded`, `deviceUpdated`, `deviceDeleted`, reshaped). Pure state: every
//! change returns the messages to send, in order.
//!
//! Per device and node there are two delivery slots: membership (`node/membership/<ns>.<name>`:
//! added with every twin, or removed) and twins (`<ns>/devicetwin/<name>`: desired values).
//! A twin update goes only to a node that acknowledged the device's addition with nothing
//! newer pending there; otherwise the desired values ride on the (coalesced) addition. Every
//! desired value carries `expected_version.cloud` = the Device's resourceVersion, so a node
//! never applies an older value after a newer one, whatever order resends arrive in.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::delivery::{Delivery, Outgoing};
use crate::envelope::new_msg_id;

/// `(namespace, name)`.
pub type Key = (String, String);

/// One property of a Device: its name and desired value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Property {
    pub name: String,
    pub desired: Option<String>,
}

/// What the controller keeps of a Device: what its messages and status need, not its JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub rv: u64,
    pub node: Option<String>,
    pub model: String,
    /// The `description` label (KubeEdge `createDevice`).
    pub description: String,
    pub properties: Vec<Property>,
    /// The Device as its node stores it for DMI mappers (`<ns>/device/<name>`: metadata and
    /// `spec`); `None` sends no object, only membership and twins.
    pub object: Option<Arc<Value>>,
}

impl DeviceSpec {
    pub fn key(&self) -> Key {
        (self.namespace.clone(), self.name.clone())
    }
}

/// What the controller keeps of a DeviceModel: its properties' twin types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    pub namespace: String,
    pub name: String,
    pub types: Vec<(String, String)>,
    /// The DeviceModel as nodes store it for DMI mappers (metadata and `spec`).
    pub object: Option<Arc<Value>>,
}

#[derive(Debug)]
struct Entry {
    spec: DeviceSpec,
    /// Per property, the edge count of its expected value the node reported (almost always 0:
    /// only a device that writes its own expected value raises it).
    edge: BTreeMap<String, i64>,
    /// Not sent yet: its model is not known, and the models are still being listed. A node
    /// fixes a twin's type when the twin is created, so it must come with the model's types.
    held: bool,
}

/// One side of a reported twin (`reported` or `observedDesired`) as the DeviceStatus stores it,
/// `{"value", "metadata": {"timestamp", "type"}}`: fields, not a JSON tree, since a burst of
/// reports waits as these for a writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TwinValue {
    pub value: String,
    pub timestamp: Option<i64>,
    pub kind: Option<String>,
}

impl TwinValue {
    /// The DeviceStatus form (the timestamp as a string, as KubeEdge writes it).
    pub fn to_json(&self) -> Value {
        let mut metadata = Map::new();
        if let Some(ts) = self.timestamp {
            metadata.insert("timestamp".to_owned(), json!(ts.to_string()));
        }
        if let Some(kind) = &self.kind {
            metadata.insert("type".to_owned(), json!(kind));
        }
        json!({"value": self.value, "metadata": metadata})
    }
}

/// Per property: `reported` and `observedDesired`, when sent.
pub type TwinReport = (Option<TwinValue>, Option<TwinValue>);

/// What a node reported about a device, for its DeviceStatus.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Per property, sorted by name (a report names one or a few: a list, not a tree).
    pub twins: Vec<(String, TwinReport)>,
    /// `state` and `lastOnlineTime`.
    pub state: Option<(String, String)>,
}

impl Report {
    /// The entry of property `name`, made empty when missing.
    fn entry(&mut self, name: String) -> &mut TwinReport {
        let i = match self.twins.binary_search_by(|(n, _)| n.cmp(&name)) {
            Ok(i) => i,
            Err(i) => {
                self.twins.insert(i, (name, (None, None)));
                i
            }
        };
        &mut self.twins[i].1
    }

    /// The values reported for property `name`.
    #[cfg(test)]
    pub fn twin(&self, name: &str) -> Option<&TwinReport> {
        self.twins
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| &self.twins[i].1)
    }

    /// Folds a newer report into this one (newer values win, per property and field).
    pub fn merge(&mut self, newer: Report) {
        for (name, (reported, observed)) in newer.twins {
            let entry = self.entry(name);
            if reported.is_some() {
                entry.0 = reported;
            }
            if observed.is_some() {
                entry.1 = observed;
            }
        }
        if newer.state.is_some() {
            self.state = newer.state;
        }
    }
}

/// Why a report is not written.
#[derive(Debug, PartialEq)]
pub enum Refused {
    /// No such Device, or it is bound to another node: that node is told to drop it.
    NotBound(Vec<Outgoing>),
    /// Not a twin or state report.
    Malformed(String),
}

/// The device routing state.
#[derive(Debug, Default)]
pub struct Devices {
    devices: HashMap<Key, Entry>,
    models: HashMap<Key, Vec<(String, String)>>,
    /// Each model's object, for the nodes whose devices use it.
    model_objects: HashMap<Key, Arc<Value>>,
    by_node: HashMap<String, BTreeSet<Key>>,
    /// The DeviceModel watch has listed everything once: a model unknown now does not exist.
    models_synced: bool,
}

/// The membership slot of a device: one per device, so devices never coalesce together.
/// Namespaces have no dots, so `<ns>.<name>` is unambiguous.
pub fn membership_resource((ns, name): &Key) -> String {
    format!("node/membership/{ns}.{name}")
}

/// Where a node stores a Device (`<ns>/device/<name>`) or DeviceModel for DMI mappers.
pub fn object_resource(kind: &str, (ns, name): &Key) -> String {
    format!("{ns}/{kind}/{name}")
}

fn rv_of(object: &Value) -> Option<u64> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
}

pub fn twin_resource((ns, name): &Key) -> String {
    format!("{ns}/devicetwin/{name}")
}

/// The device id on the node (KubeEdge ≥ 1.15 `util.GetResourceID`).
pub fn device_id((ns, name): &Key) -> String {
    format!("{ns}/{name}")
}

fn now_ms() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or_default()
}

/// A model's property type as twins name it (`INT` → `int`); unknown: `string`.
fn twin_type(model_type: Option<&str>) -> String {
    match model_type.map(str::to_ascii_lowercase).as_deref() {
        Some(t @ ("int" | "float" | "double" | "boolean" | "string" | "bytes")) => t.to_owned(),
        _ => "string".to_owned(),
    }
}

/// An object's removal: always sent, never coalesced away by an acked version.
fn delete(node: &str, resource: String) -> Outgoing {
    Outgoing {
        node: node.to_owned(),
        operation: "delete",
        resource,
        content: Value::Null,
        rv: None,
        force: true,
    }
}

fn update(node: &str, resource: String, content: Value, rv: Option<u64>, force: bool) -> Outgoing {
    Outgoing {
        node: node.to_owned(),
        operation: "update",
        resource,
        content,
        rv,
        force,
    }
}

impl Devices {
    /// The device, if known.
    pub fn spec(&self, key: &Key) -> Option<&DeviceSpec> {
        self.devices.get(key).map(|e| &e.spec)
    }

    /// The devices and models known, for a relist.
    pub fn known_devices(&self) -> BTreeSet<Key> {
        self.devices.keys().cloned().collect()
    }

    pub fn known_models(&self) -> BTreeSet<Key> {
        self.models.keys().cloned().collect()
    }

    /// `{<prop>: MsgTwin}`: every property, with its desired value and versions when it has one.
    fn twins(&self, entry: &Entry) -> Value {
        let spec = &entry.spec;
        let types = self
            .models
            .get(&(spec.namespace.clone(), spec.model.clone()));
        let mut twins = Map::new();
        for p in &spec.properties {
            let kind = twin_type(
                types
                    .and_then(|t| t.iter().find(|(n, _)| *n == p.name))
                    .map(|(_, t)| t.as_str()),
            );
            let mut twin = json!({"metadata": {"type": kind}, "optional": false});
            if let Some(value) = &p.desired {
                twin["expected"] = json!({"value": value});
            }
            // Without a value, the version alone tells the node to drop the one it holds.
            let edge = entry.edge.get(&p.name).copied().unwrap_or(0);
            twin["expected_version"] = json!({"cloud": spec.rv, "edge": edge});
            twins.insert(p.name.clone(), twin);
        }
        Value::Object(twins)
    }

    /// KubeEdge's `types.Device` as membership messages carry it.
    fn device(&self, entry: &Entry, with_twins: bool) -> Value {
        let key = entry.spec.key();
        let mut device = json!({"id": device_id(&key), "name": entry.spec.name});
        if !entry.spec.description.is_empty() {
            device["description"] = json!(entry.spec.description);
        }
        if with_twins {
            device["twin"] = self.twins(entry);
        }
        device
    }

    fn add(&self, node: &str, entry: &Entry, force: bool) -> Outgoing {
        let content = json!({"event_id": new_msg_id(), "timestamp": now_ms(),
                             "added_devices": [self.device(entry, true)], "removed_devices": null});
        update(
            node,
            membership_resource(&entry.spec.key()),
            content,
            Some(entry.spec.rv),
            force,
        )
    }

    /// A removal has no version: it is always sent, and an acked one (`(None, false)`) is told
    /// apart from an acked addition.
    fn remove(&self, node: &str, entry: &Entry) -> Outgoing {
        let content = json!({"event_id": new_msg_id(), "timestamp": now_ms(),
                             "added_devices": null, "removed_devices": [self.device(entry, false)]});
        update(
            node,
            membership_resource(&entry.spec.key()),
            content,
            None,
            true,
        )
    }

    /// New desired values for a device on `node`: a twin update where the node holds the
    /// device, else a new addition (which replaces one still waiting).
    fn desired_changed(
        &self,
        node: &str,
        entry: &Entry,
        delivery: &Delivery,
        force: bool,
    ) -> Outgoing {
        let key = entry.spec.key();
        let membership = membership_resource(&key);
        let joined = matches!(delivery.acked(node, &membership), Some((Some(_), false)))
            && !delivery.pending(node, &membership);
        if !joined {
            return self.add(node, entry, force);
        }
        let content = json!({"event_id": new_msg_id(), "timestamp": now_ms(),
                             "twin": self.twins(entry)});
        update(
            node,
            twin_resource(&key),
            content,
            Some(entry.spec.rv),
            force,
        )
    }

    fn bind(&mut self, key: &Key, node: Option<&String>, unbind: Option<&String>) {
        if let Some(old) = unbind {
            if let Some(set) = self.by_node.get_mut(old) {
                set.remove(key);
                if set.is_empty() {
                    self.by_node.remove(old);
                }
            }
        }
        if let Some(node) = node {
            self.by_node
                .entry(node.clone())
                .or_default()
                .insert(key.clone());
        }
    }

    /// A Device was added or changed.
    pub fn applied(&mut self, spec: DeviceSpec, delivery: &Delivery) -> Vec<Outgoing> {
        let key = spec.key();
        let old = self.devices.remove(&key);
        let moved = old.as_ref().is_none_or(|o| o.spec.node != spec.node);
        let edge = match &old {
            // A device replaced by a new one of that name starts over.
            Some(o) if o.spec.uid == spec.uid => o.edge.clone(),
            _ => BTreeMap::new(),
        };
        let held = spec.node.is_some()
            && !spec.model.is_empty()
            && !self.models_synced
            && !self
                .models
                .contains_key(&(spec.namespace.clone(), spec.model.clone()));
        let was_held = old.as_ref().is_some_and(|o| o.held);
        let entry = Entry { spec, edge, held };
        let mut sends = Vec::new();
        let replaced = old.as_ref().is_some_and(|o| o.spec.uid != entry.spec.uid);
        if let Some(old) = old.as_ref().filter(|o| !o.held) {
            if let Some(node) = &old.spec.node {
                if moved || replaced {
                    sends.push(self.remove(node, old));
                }
            }
        }
        if let Some(node) = entry.spec.node.as_ref().filter(|_| !held) {
            if moved || replaced || was_held {
                sends.push(self.add(node, &entry, false));
            } else if old.as_ref().is_some_and(|o| {
                o.spec.properties != entry.spec.properties
                    || o.spec.model != entry.spec.model
                    || o.spec.description != entry.spec.description
            }) {
                sends.push(self.desired_changed(node, &entry, delivery, false));
            }
        }
        let object_changed = moved
            || replaced
            || was_held
            || old.as_ref().is_none_or(|o| {
                // As KubeEdge: only a change of `spec` reaches the mapper.
                let spec = |d: &DeviceSpec| d.object.as_ref().map(|v| v["spec"].clone());
                spec(&o.spec) != spec(&entry.spec)
            });
        self.bind(
            &key,
            entry.spec.node.as_ref(),
            old.as_ref().and_then(|o| o.spec.node.as_ref()),
        );
        if let Some(old) = old.as_ref().filter(|o| !o.held) {
            if let Some(node) = old.spec.node.as_ref().filter(|_| moved || replaced) {
                sends.extend(self.object_gone(node, old));
            }
        }
        if let Some(node) = entry.spec.node.as_ref().filter(|_| !held && object_changed) {
            sends.extend(self.object_sends(node, &entry));
        }
        self.devices.insert(key, entry);
        sends
    }

    /// The device's model (when known) and the device itself, as the node stores them for DMI
    /// mappers. They travel in separate delivery slots: the node's DMI server holds a device
    /// until its model is there.
    fn object_sends(&self, node: &str, entry: &Entry) -> Vec<Outgoing> {
        let Some(object) = entry.spec.object.as_ref() else {
            return Vec::new();
        };
        let mut sends = Vec::new();
        let model = (entry.spec.namespace.clone(), entry.spec.model.clone());
        if let Some(model_object) = self.model_objects.get(&model) {
            sends.push(self.model_send(node, &model, model_object));
        }
        sends.push(update(
            node,
            object_resource("device", &entry.spec.key()),
            Value::clone(object),
            Some(entry.spec.rv),
            false,
        ));
        sends
    }

    fn model_send(&self, node: &str, model: &Key, object: &Value) -> Outgoing {
        update(
            node,
            object_resource("devicemodel", model),
            object.clone(),
            rv_of(object),
            false,
        )
    }

    /// `entry` left `node`: its object goes, and its model too when no other device there
    /// uses it (KubeEdge's `isExistModel`).
    fn object_gone(&self, node: &str, entry: &Entry) -> Vec<Outgoing> {
        if entry.spec.object.is_none() {
            return Vec::new();
        }
        let key = entry.spec.key();
        let mut sends = vec![delete(node, object_resource("device", &key))];
        let model = (entry.spec.namespace.clone(), entry.spec.model.clone());
        let used = self
            .on(node)
            .any(|e| e.spec.key() != key && e.spec.namespace == model.0 && e.spec.model == model.1);
        if !used && !model.1.is_empty() {
            sends.push(delete(node, object_resource("devicemodel", &model)));
        }
        sends
    }

    /// A Device is gone: its node drops it.
    pub fn deleted(&mut self, key: &Key) -> Vec<Outgoing> {
        let Some(old) = self.devices.remove(key) else {
            return Vec::new();
        };
        self.bind(key, None, old.spec.node.as_ref());
        if old.held {
            return Vec::new();
        }
        let Some(node) = old.spec.node.as_ref() else {
            return Vec::new();
        };
        let mut sends = vec![self.remove(node, &old)];
        sends.extend(self.object_gone(node, &old));
        sends
    }

    /// A DeviceModel was added or changed: devices whose twin types change get them again.
    pub fn model_applied(&mut self, model: ModelSpec, delivery: &Delivery) -> Vec<Outgoing> {
        let key = (model.namespace.clone(), model.name.clone());
        let before: Vec<(Key, Value)> = self.using(&key, |d, e| d.twins(e));
        self.models.insert(key.clone(), model.types);
        let mut sends = Vec::new();
        if let Some(object) = model.object {
            if self.model_objects.get(&key) != Some(&object) {
                // Every node with a device of this model that is not held gets it now.
                let nodes: BTreeSet<String> = self
                    .devices
                    .values()
                    .filter(|e| !e.held && e.spec.namespace == key.0 && e.spec.model == key.1)
                    .filter_map(|e| e.spec.node.clone())
                    .collect();
                for node in nodes {
                    sends.push(self.model_send(&node, &key, &object));
                }
                self.model_objects.insert(key.clone(), object);
            }
        }
        for (device, twins) in before {
            let held = match self.devices.get_mut(&device) {
                Some(entry) => std::mem::replace(&mut entry.held, false),
                None => continue,
            };
            let Some(entry) = self.devices.get(&device) else {
                continue;
            };
            if let Some(node) = &entry.spec.node {
                if held {
                    sends.push(self.add(node, entry, false));
                    sends.extend(self.object_sends(node, entry));
                } else if self.twins(entry) != twins {
                    sends.push(self.desired_changed(node, entry, delivery, true));
                }
            }
        }
        sends
    }

    /// Every DeviceModel has been listed: devices waiting for a model that does not exist go
    /// with `string` twins.
    pub fn models_synced(&mut self) -> Vec<Outgoing> {
        self.models_synced = true;
        let mut sends = Vec::new();
        let held: Vec<Key> = self
            .devices
            .iter()
            .filter(|(_, e)| e.held)
            .map(|(k, _)| k.clone())
            .collect();
        for key in held {
            if let Some(entry) = self.devices.get_mut(&key) {
                entry.held = false;
            }
            if let Some(entry) = self.devices.get(&key) {
                if let Some(node) = &entry.spec.node {
                    sends.push(self.add(node, entry, false));
                    sends.extend(self.object_sends(node, entry));
                }
            }
        }
        sends
    }

    /// A DeviceModel is gone: its devices keep the types the nodes have.
    pub fn model_deleted(&mut self, key: &Key) {
        self.models.remove(key);
        self.model_objects.remove(key);
    }

    fn using<T>(&self, model: &Key, f: impl Fn(&Devices, &Entry) -> T) -> Vec<(Key, T)> {
        self.devices
            .iter()
            .filter(|(k, e)| k.0 == model.0 && e.spec.model == model.1)
            .map(|(k, e)| (k.clone(), f(self, e)))
            .collect()
    }

    /// Everything `node` should hold, for a resync: each device's addition (not sent again
    /// where the node acknowledged that version).
    pub fn desired(&self, node: &str) -> Vec<Outgoing> {
        self.on(node)
            .flat_map(|entry| {
                let mut sends = vec![self.add(node, entry, false)];
                sends.extend(self.object_sends(node, entry));
                sends
            })
            .collect()
    }

    fn on<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a Entry> + 'a {
        self.by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|k| self.devices.get(k))
            .filter(|e| !e.held)
    }

    /// The node asked for its full membership (it connected with devices): the list goes
    /// down, so devices it lost track of come back and those it should not have go.
    pub fn detail(&self, node: &str) -> Outgoing {
        let devices: Vec<Value> = self.on(node).map(|e| self.device(e, true)).collect();
        let content = json!({"event_id": new_msg_id(), "timestamp": now_ms(), "devices": devices});
        update(
            node,
            "node/membershipdetail".to_owned(),
            content,
            None,
            true,
        )
    }

    /// `node`'s report about device `key` (`kind` `devicetwin` or `devicestate`), as the
    /// DeviceStatus change it makes. Only the node the Device is bound to is heard.
    pub fn reported(
        &mut self,
        node: &str,
        key: &Key,
        kind: &str,
        content: &Value,
    ) -> Result<Report, Refused> {
        let bound = self
            .devices
            .get(key)
            .is_some_and(|e| e.spec.node.as_deref() == Some(node));
        if !bound {
            let id = device_id(key);
            let content = json!({"event_id": new_msg_id(), "timestamp": now_ms(),
                                 "added_devices": null, "removed_devices": [{"id": id, "name": key.1}]});
            return Err(Refused::NotBound(vec![update(
                node,
                membership_resource(key),
                content,
                None,
                true,
            )]));
        }
        let mut report = Report::default();
        match kind {
            "devicestate" => {
                let device = &content["device"];
                let state = device["state"].as_str().ok_or_else(|| {
                    Refused::Malformed("a device state report without a state".to_owned())
                })?;
                let since = device["lastOnlineTime"].as_str().unwrap_or_default();
                report.state = Some((state.to_owned(), since.to_owned()));
            }
            "devicetwin" => {
                let twins = content["twin"]
                    .as_object()
                    .ok_or_else(|| Refused::Malformed("a twin report without twins".to_owned()))?;
                let entry = self.devices.get_mut(key);
                let mut edges = Vec::new();
                for (name, twin) in twins {
                    let kind = twin["metadata"]["type"].as_str();
                    let side = |which: &str| {
                        Some(TwinValue {
                            value: twin[which]["value"].as_str()?.to_owned(),
                            timestamp: twin[which]["metadata"]["timestamp"].as_i64(),
                            kind: kind.map(str::to_owned),
                        })
                    };
                    let (reported, observed) = (side("actual"), side("expected"));
                    if let Some(edge) = twin["expected_version"]["edge"].as_i64() {
                        edges.push((name.clone(), edge));
                    }
                    if reported.is_some() || observed.is_some() {
                        *report.entry(name.clone()) = (reported, observed);
                    }
                }
                // Kept until a writer is free: no spare capacity.
                report.twins.shrink_to_fit();
                if let Some(entry) = entry {
                    for (name, edge) in edges {
                        if edge > 0 {
                            entry.edge.insert(name, edge);
                        }
                    }
                }
            }
            other => return Err(Refused::Malformed(format!("no report of kind {other}"))),
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    pub(super) fn spec(name: &str, node: Option<&str>, desired: &str, rv: u64) -> DeviceSpec {
        DeviceSpec {
            namespace: "default".to_owned(),
            name: name.to_owned(),
            uid: format!("uid-{name}"),
            rv,
            node: node.map(str::to_owned),
            model: "thermo".to_owned(),
            description: String::new(),
            properties: vec![Property {
                name: "temp".to_owned(),
                desired: Some(desired.to_owned()),
            }],
            object: None,
        }
    }

    fn ops(sends: &[Outgoing]) -> Vec<String> {
        sends
            .iter()
            .map(|s| {
                let what = if s.content["added_devices"].is_array() {
                    "add"
                } else if s.content["removed_devices"].is_array() {
                    "remove"
                } else {
                    "twin"
                };
                format!("{} {what} {}", s.node, s.resource)
            })
            .collect()
    }

    #[test]
    fn a_device_joins_its_node_moves_and_leaves() {
        let now = Instant::now();
        let mut d = Devices::default();
        let mut delivery = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        let models = ModelSpec {
            namespace: "default".to_owned(),
            name: "thermo".to_owned(),
            types: vec![("temp".to_owned(), "INT".to_owned())],
            object: None,
        };
        // Held until its model is known (the models are still being listed).
        assert!(d
            .applied(spec("t1", Some("n1"), "20", 5), &delivery)
            .is_empty());
        let sends = d.model_applied(models, &delivery);
        assert_eq!(ops(&sends), ["n1 add node/membership/default.t1"]);
        let twin = &sends[0].content["added_devices"][0]["twin"]["temp"];
        assert_eq!(twin["expected"]["value"], "20");
        assert_eq!(twin["metadata"]["type"], "int");
        assert_eq!(twin["expected_version"]["cloud"], 5);
        // Not acked yet: a new desired value rides on a new addition.
        let sent = delivery
            .submit(sends[0].clone(), now)
            .and_then(|s| s.envelope().ok())
            .expect("sent");
        let again = d.applied(spec("t1", Some("n1"), "21", 6), &delivery);
        assert_eq!(ops(&again), ["n1 add node/membership/default.t1"]);
        assert!(delivery.submit(again[0].clone(), now).is_none());
        let queued = delivery
            .ack("n1", &sent.header.msg_id, now)
            .and_then(|s| s.envelope().ok())
            .expect("the newer addition follows");
        delivery.ack("n1", &queued.header.msg_id, now);
        // Acked: the next desired value is a twin update.
        let twin = d.applied(spec("t1", Some("n1"), "22", 7), &delivery);
        assert_eq!(ops(&twin), ["n1 twin default/devicetwin/t1"]);
        assert_eq!(twin[0].content["twin"]["temp"]["expected"]["value"], "22");
        // A change elsewhere than the properties sends nothing.
        assert!(d
            .applied(spec("t1", Some("n1"), "22", 8), &delivery)
            .is_empty());
        // Moved: removed from n1, added to n2.
        assert_eq!(
            ops(&d.applied(spec("t1", Some("n2"), "22", 9), &delivery)),
            [
                "n1 remove node/membership/default.t1",
                "n2 add node/membership/default.t1"
            ]
        );
        assert!(d.desired("n1").is_empty());
        assert_eq!(d.desired("n2").len(), 1);
        assert_eq!(
            ops(&d.deleted(&("default".to_owned(), "t1".to_owned()))),
            ["n2 remove node/membership/default.t1"]
        );
    }

    #[test]
    fn only_the_bound_node_is_heard_and_a_stray_one_drops_the_device() {
        let mut d = Devices::default();
        assert!(d.models_synced().is_empty());
        let delivery = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        d.applied(spec("t1", Some("n1"), "20", 5), &delivery);
        let key = ("default".to_owned(), "t1".to_owned());
        let report = json!({"twin": {"temp": {"actual": {"value": "19", "metadata": {"timestamp": 1700}},
            "expected": {"value": "20"}, "metadata": {"type": "int"},
            "expected_version": {"cloud": 5, "edge": 0}}}});
        let written = d
            .reported("n1", &key, "devicetwin", &report)
            .expect("bound");
        let (reported, observed) = written.twin("temp").expect("temp reported");
        assert_eq!(
            reported.as_ref().expect("reported").to_json(),
            json!({"value": "19", "metadata": {"timestamp": "1700", "type": "int"}})
        );
        assert_eq!(
            observed.as_ref().expect("observed").to_json()["value"],
            "20"
        );
        let Err(Refused::NotBound(sends)) = d.reported("n2", &key, "devicetwin", &report) else {
            panic!("n2 is not the device's node");
        };
        assert_eq!(ops(&sends), ["n2 remove node/membership/default.t1"]);
        let state =
            json!({"device": {"state": "online", "lastOnlineTime": "2026-11-27T00:00:00Z"}});
        let written = d
            .reported("n1", &key, "devicestate", &state)
            .expect("bound");
        assert_eq!(
            written.state,
            Some(("online".to_owned(), "2026-11-27T00:00:00Z".to_owned()))
        );
    }
}
