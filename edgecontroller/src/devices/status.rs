//! DeviceStatus writes (KubeEdge upstream.go `updateDeviceStatus`, reshaped): per device one
//! write at a time, reports arriving meanwhile folded into the next one, and each write a
//! read-modify-replace with the resourceVersion as precondition, so concurrent writers and a
//! restarted controller lose no other property's value (KubeEdge patches the whole twin list
//! from its cache).

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, PostParams};
use kube::Client;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::state::{DeviceSpec, Key, Report};
use super::watch::{resource, GROUP, VERSION};
use super::Event;

/// How many DeviceStatus writes run at once.
const WRITERS: usize = 32;

/// What a write needs of its Device.
#[derive(Debug, Clone)]
pub struct Owner {
    pub uid: String,
    pub properties: Vec<String>,
}

impl Owner {
    pub fn of(spec: &DeviceSpec) -> Owner {
        Owner {
            uid: spec.uid.clone(),
            properties: spec.properties.iter().map(|p| p.name.clone()).collect(),
        }
    }
}

/// The DeviceStatus writer: what is being written, and what waits for the next write. At most
/// [`WRITERS`] write tasks exist at once; the rest wait here as reports, not as tasks.
pub struct Writer {
    client: Client,
    resource: ApiResource,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
    writing: HashSet<Key>,
    waiting: HashMap<Key, (Owner, Report)>,
    /// Devices whose report waits for a free writer, oldest first.
    ready: VecDeque<Key>,
    /// DeviceStatuses this controller created or found.
    created: HashSet<Key>,
}

/// A new DeviceStatus owned by its Device (KubeEdge `getOrCreateDeviceStatusForDevice`).
fn fresh((ns, name): &Key, owner: &Owner) -> Value {
    json!({"apiVersion": format!("{GROUP}/{VERSION}"), "kind": "DeviceStatus",
           "metadata": {"name": name, "namespace": ns,
                        "ownerReferences": [{"apiVersion": format!("{GROUP}/{VERSION}"),
                            "kind": "Device", "name": name, "uid": owner.uid,
                            "controller": true, "blockOwnerDeletion": true}]},
           "spec": {}, "status": {}})
}

/// `status` with `report` applied: twins by property name, of the Device's properties only.
fn apply(status: &mut Value, report: &Report, properties: &[String]) {
    if !status.is_object() {
        *status = json!({});
    }
    let mut twins: Vec<Value> = status["twins"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|t| {
            t["propertyName"]
                .as_str()
                .is_some_and(|n| properties.iter().any(|p| p == n))
        })
        .collect();
    for (name, (reported, observed)) in &report.twins {
        if !properties.iter().any(|p| p == name) {
            continue;
        }
        let index = match twins
            .iter()
            .position(|t| t["propertyName"] == name.as_str())
        {
            Some(i) => i,
            None => {
                twins.push(json!({"propertyName": name}));
                twins.len() - 1
            }
        };
        if let Some(reported) = reported {
            twins[index]["reported"] = reported.to_json();
        }
        if let Some(observed) = observed {
            twins[index]["observedDesired"] = observed.to_json();
        }
    }
    status["twins"] = Value::Array(twins);
    if let Some((state, since)) = &report.state {
        status["state"] = json!(state);
        if !since.is_empty() {
            status["lastOnlineTime"] = json!(since);
        }
    }
}

/// Writes `report` into the DeviceStatus of `key`, creating it if missing; a concurrent change
/// is read again and retried.
async fn write(
    api: &Api<DynamicObject>,
    key: &Key,
    owner: &Owner,
    report: &Report,
) -> Result<(), kube::Error> {
    let mut attempts = 0;
    loop {
        attempts += 1;
        let result = match api.get_opt(&key.1).await? {
            None => {
                let mut object: DynamicObject =
                    serde_json::from_value(fresh(key, owner)).map_err(kube::Error::SerdeError)?;
                apply(&mut object.data["status"], report, &owner.properties);
                api.create(&PostParams::default(), &object).await
            }
            Some(mut object) => {
                let before = object.data["status"].clone();
                apply(&mut object.data["status"], report, &owner.properties);
                if object.data["status"] == before {
                    return Ok(());
                }
                api.replace(&key.1, &PostParams::default(), &object).await
            }
        };
        match result {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 && attempts < 5 => continue,
            Err(e) => return Err(e),
        }
    }
}

impl Writer {
    pub fn new(client: Client, tx: mpsc::Sender<Event>, cancel: CancellationToken) -> Writer {
        Writer {
            client,
            resource: resource("DeviceStatus", "devicestatuses"),
            tx,
            cancel,
            writing: HashSet::new(),
            waiting: HashMap::new(),
            ready: VecDeque::new(),
            created: HashSet::new(),
        }
    }

    /// Makes sure the Device's DeviceStatus exists (once per device and controller run).
    pub fn ensure(&mut self, spec: &DeviceSpec) {
        if self.created.contains(&spec.key()) {
            return;
        }
        self.submit(spec.key(), Owner::of(spec), Report::default());
    }

    /// The Device is gone: its DeviceStatus goes with it (owner reference), nothing is written.
    pub fn forget(&mut self, key: &Key) {
        self.created.remove(key);
        self.waiting.remove(key);
    }

    /// Writes `report` once a writer is free and no write for that device is in flight; a
    /// report still waiting is merged with it.
    pub fn submit(&mut self, key: Key, owner: Owner, report: Report) {
        match self.waiting.get_mut(&key) {
            Some((o, waiting)) => {
                *o = owner;
                waiting.merge(report);
            }
            None => {
                if !self.writing.contains(&key) {
                    self.ready.push_back(key.clone());
                }
                self.waiting.insert(key, (owner, report));
            }
        }
        self.start();
    }

    /// Starts waiting writes while writers are free.
    fn start(&mut self) {
        while self.writing.len() < WRITERS {
            let Some(key) = self.ready.pop_front() else {
                return;
            };
            let Some((owner, report)) = self.waiting.remove(&key) else {
                continue;
            };
            self.spawn(key, owner, report);
        }
    }

    fn spawn(&mut self, key: Key, owner: Owner, report: Report) {
        self.writing.insert(key.clone());
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &key.0, &self.resource);
        let (tx, cancel) = (self.tx.clone(), self.cancel.clone());
        tokio::spawn(async move {
            let mut wait = Duration::from_millis(250);
            let ok = loop {
                match write(&api, &key, &owner, &report).await {
                    Ok(()) => break true,
                    Err(e) => {
                        warn!(error_code = "EM-EC-DEVICESTATUS", device = %format!("{}/{}", key.0, key.1),
                              error = %e, "device status not written; retrying");
                    }
                }
                tokio::select! {
                    () = cancel.cancelled() => break false,
                    () = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(Duration::from_secs(8));
            };
            let _ = tx.send(Event::Written { key, ok }).await;
        });
    }

    /// A write finished: what waited behind it goes next.
    pub fn written(&mut self, key: Key, ok: bool) {
        self.writing.remove(&key);
        if ok {
            self.created.insert(key.clone());
        }
        if self.waiting.contains_key(&key) {
            self.ready.push_back(key);
        }
        self.start();
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::TwinValue;
    use super::*;

    #[test]
    fn a_report_sets_its_twins_and_keeps_the_others_of_the_device() {
        let mut status = json!({"twins": [
            {"propertyName": "humidity", "reported": {"value": "40"}},
            {"propertyName": "gone", "reported": {"value": "1"}}]});
        let value = |v: &str| TwinValue {
            value: v.to_owned(),
            timestamp: None,
            kind: None,
        };
        let mut report = Report::default();
        report.merge(Report {
            twins: vec![("temp".to_owned(), (Some(value("19")), Some(value("20"))))],
            state: None,
        });
        // A later report without an observed value keeps the earlier one.
        report.merge(Report {
            twins: vec![("temp".to_owned(), (Some(value("19")), None))],
            state: None,
        });
        report.state = Some(("online".to_owned(), "2026-11-27T00:00:00Z".to_owned()));
        apply(
            &mut status,
            &report,
            &["temp".to_owned(), "humidity".to_owned()],
        );
        assert_eq!(
            status,
            json!({"twins": [
                {"propertyName": "humidity", "reported": {"value": "40"}},
                {"propertyName": "temp", "reported": {"value": "19", "metadata": {}},
                 "observedDesired": {"value": "20", "metadata": {}}}],
                "state": "online", "lastOnlineTime": "2026-11-27T00:00:00Z"})
        );
    }
}
