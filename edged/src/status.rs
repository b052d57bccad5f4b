//! Pod status in the Kubernetes `PodStatus` shape, and the reporter that publishes it:
//! `update` of `<ns>/podstatus/<name>` to the MetaManager (which stores it and carries it up),
//! on every change, coalesced, at most once per `status_interval_ms` per pod.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use edgemeta_protocol::{rfc3339, Operation};
use rumqttc::{AsyncClient, QoS};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::message;
use crate::spec::{Key, RestartPolicy};

/// A container's state, as in `ContainerState`.
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Waiting {
        reason: String,
        message: String,
    },
    Running {
        started_at: SystemTime,
    },
    Terminated {
        exit_code: i32,
        signal: Option<i32>,
        reason: String,
        message: String,
        started_at: SystemTime,
        finished_at: SystemTime,
    },
}

impl State {
    pub fn waiting(reason: &str, message: impl Into<String>) -> State {
        State::Waiting {
            reason: reason.to_owned(),
            message: message.into(),
        }
    }

    fn to_json(&self) -> Value {
        match self {
            State::Waiting { reason, message } => {
                let mut w = json!({"reason": reason});
                if !message.is_empty() {
                    w["message"] = json!(message);
                }
                json!({"waiting": w})
            }
            State::Running { started_at } => {
                json!({"running": {"startedAt": rfc3339(*started_at)}})
            }
            State::Terminated {
                exit_code,
                signal,
                reason,
                message,
                started_at,
                finished_at,
            } => {
                let mut t = json!({
                    "exitCode": exit_code,
                    "reason": reason,
                    "startedAt": rfc3339(*started_at),
                    "finishedAt": rfc3339(*finished_at),
                });
                if let Some(signal) = signal {
                    t["signal"] = json!(signal);
                }
                if !message.is_empty() {
                    t["message"] = json!(message);
                }
                json!({"terminated": t})
            }
        }
    }
}

/// One `containerStatuses` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ContainerStatus {
    pub name: String,
    pub state: State,
    pub last_state: Option<State>,
    pub ready: bool,
    pub restart_count: u32,
    pub container_id: Option<String>,
    pub image: String,
}

impl ContainerStatus {
    pub fn new(name: &str, image: &str, state: State) -> ContainerStatus {
        ContainerStatus {
            name: name.to_owned(),
            state,
            last_state: None,
            ready: false,
            restart_count: 0,
            container_id: None,
            image: image.to_owned(),
        }
    }

    fn to_json(&self) -> Value {
        let mut c = json!({
            "name": self.name,
            "state": self.state.to_json(),
            "lastState": self.last_state.as_ref().map_or(json!({}), State::to_json),
            "ready": self.ready,
            "restartCount": self.restart_count,
            "image": self.image,
            "imageID": "",
            "started": matches!(self.state, State::Running { .. }),
        });
        if let Some(id) = &self.container_id {
            c["containerID"] = json!(id);
        }
        c
    }
}

/// Pod-level facts a status is built from.
#[derive(Debug, Clone)]
pub struct PodFacts<'a> {
    pub policy: RestartPolicy,
    pub node_ip: &'a str,
    pub start_time: SystemTime,
}

/// kubelet's `getPhase`: Pending while a container has never run, Running while one runs or
/// will be restarted, then Succeeded or Failed.
pub fn phase(policy: RestartPolicy, containers: &[ContainerStatus]) -> &'static str {
    let (mut waiting, mut running, mut stopped, mut failed) = (0, 0, 0, 0);
    for c in containers {
        match &c.state {
            State::Running { .. } => running += 1,
            State::Terminated { exit_code, .. } => {
                stopped += 1;
                if *exit_code != 0 {
                    failed += 1;
                }
            }
            State::Waiting { .. } => match &c.last_state {
                Some(State::Terminated { exit_code, .. }) => {
                    stopped += 1;
                    if *exit_code != 0 {
                        failed += 1;
                    }
                }
                _ => waiting += 1,
            },
        }
    }
    if waiting > 0 || containers.is_empty() {
        "Pending"
    } else if running > 0 {
        "Running"
    } else if stopped > 0 {
        match policy {
            RestartPolicy::Always => "Running",
            RestartPolicy::OnFailure if failed > 0 => "Running",
            RestartPolicy::Never if failed > 0 => "Failed",
            _ => "Succeeded",
        }
    } else {
        "Pending"
    }
}

/// The `PodStatus` of a pod whose containers are `containers`.
pub fn pod_status(facts: &PodFacts<'_>, containers: &[ContainerStatus]) -> Value {
    let ready = !containers.is_empty() && containers.iter().all(|c| c.ready);
    let started = !containers.is_empty();
    let condition =
        |kind: &str, ok: bool| json!({"type": kind, "status": if ok { "True" } else { "False" }});
    json!({
        "phase": phase(facts.policy, containers),
        "conditions": [
            condition("PodScheduled", true),
            condition("Initialized", started),
            condition("ContainersReady", ready),
            condition("Ready", ready),
        ],
        "hostIP": facts.node_ip,
        "podIP": facts.node_ip,
        "startTime": rfc3339(facts.start_time),
        "containerStatuses": containers.iter().map(ContainerStatus::to_json).collect::<Vec<_>>(),
    })
}

/// The status of a pod that cannot run at all (`InvalidPodSpec`): Failed, with the reason.
pub fn invalid_status(node_ip: &str, message: &str) -> Value {
    json!({
        "phase": "Failed",
        "reason": "InvalidPodSpec",
        "message": message,
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "hostIP": node_ip,
        "containerStatuses": [],
    })
}

/// What the reporter is told.
#[derive(Debug)]
pub enum Report {
    /// The latest status of a pod (content of the `podstatus` update).
    Status {
        key: Key,
        namespace: String,
        name: String,
        uid: String,
        status: Value,
    },
    /// The pod is gone from this node: send its last status, then `delete` of the pod (as
    /// KubeEdge's edged does, so the cloud can finish a graceful deletion).
    Removed { key: Key },
    /// The session to the broker is new: send every status again.
    Resync,
}

struct Entry {
    namespace: String,
    name: String,
    uid: String,
    latest: Value,
    sent: Option<Value>,
    last_sent: Option<Instant>,
}

/// Publishes pod statuses, coalesced and rate-limited per pod.
pub struct Reporter {
    client: AsyncClient,
    root: String,
    interval: Duration,
    entries: HashMap<Key, Entry>,
}

impl Reporter {
    pub fn new(client: AsyncClient, root: &str, interval: Duration) -> Reporter {
        Reporter {
            client,
            root: root.to_owned(),
            interval,
            entries: HashMap::new(),
        }
    }

    /// Runs until `cancel`, then sends what is still pending once.
    pub async fn run(mut self, mut reports: mpsc::Receiver<Report>, cancel: CancellationToken) {
        loop {
            let due = self.next_due();
            tokio::select! {
                _ = cancel.cancelled() => break,
                report = reports.recv() => match report {
                    Some(report) => self.apply(report),
                    None => break,
                },
                _ = sleep_until_opt(due) => self.flush(Instant::now(), false),
            }
        }
        while let Ok(report) = reports.try_recv() {
            self.apply(report);
        }
        self.flush(Instant::now(), true);
    }

    fn apply(&mut self, report: Report) {
        match report {
            Report::Status {
                key,
                namespace,
                name,
                uid,
                status,
            } => {
                let entry = self.entries.entry(key).or_insert_with(|| Entry {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    uid: uid.clone(),
                    latest: Value::Null,
                    sent: None,
                    last_sent: None,
                });
                entry.uid = uid;
                entry.latest = status;
            }
            Report::Removed { key } => {
                if let Some(mut entry) = self.entries.remove(&key) {
                    if entry.sent.as_ref() != Some(&entry.latest) {
                        self.publish_status(&mut entry, Instant::now());
                    }
                    let (id, payload) = message::envelope(
                        None,
                        Operation::Delete,
                        &format!("{}/pod/{}", entry.namespace, entry.name),
                        json!({"metadata": {"name": entry.name, "namespace": entry.namespace, "uid": entry.uid}}),
                    );
                    let topic =
                        message::topic(&self.root, Operation::Delete, &entry.namespace, "pod");
                    if let Err(e) = self
                        .client
                        .try_publish(topic, QoS::AtLeastOnce, false, payload)
                    {
                        warn!(error_code = "EM-EDGED-MQTT", pod = %key, msg_id = %id, error = %e, "pod removal not reported");
                    }
                }
            }
            Report::Resync => {
                for entry in self.entries.values_mut() {
                    entry.sent = None;
                }
            }
        }
    }

    /// When the next rate-limited status is due, if any is waiting.
    fn next_due(&self) -> Option<Instant> {
        self.entries
            .values()
            .filter(|e| e.sent.as_ref() != Some(&e.latest) && !e.latest.is_null())
            .map(|e| e.last_sent.map_or_else(Instant::now, |t| t + self.interval))
            .min()
    }

    fn flush(&mut self, now: Instant, all: bool) {
        let interval = self.interval;
        let due: Vec<Key> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.sent.as_ref() != Some(&e.latest)
                    && !e.latest.is_null()
                    && (all || e.last_sent.is_none_or(|t| t + interval <= now))
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            if let Some(mut entry) = self.entries.remove(&key) {
                self.publish_status(&mut entry, now);
                self.entries.insert(key, entry);
            }
        }
    }

    fn publish_status(&self, entry: &mut Entry, now: Instant) {
        let resource = format!("{}/podstatus/{}", entry.namespace, entry.name);
        // KubeEdge's PodStatusRequest: the cloud's edgecontroller reads UID, Name and Status.
        let content = json!({"UID": entry.uid, "Name": entry.name, "Status": entry.latest});
        let (_, payload) = message::envelope(None, Operation::Update, &resource, content);
        let topic = message::topic(&self.root, Operation::Update, &entry.namespace, "podstatus");
        entry.last_sent = Some(now);
        match self
            .client
            .try_publish(topic, QoS::AtLeastOnce, false, payload)
        {
            Ok(()) => entry.sent = Some(entry.latest.clone()),
            // Kept dirty: sent again at the next interval, and after a reconnect anyway.
            Err(e) => debug!(resource = %resource, error = %e, "status not queued"),
        }
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        std::time::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn terminated(code: i32) -> State {
        State::Terminated {
            exit_code: code,
            signal: None,
            reason: if code == 0 { "Completed" } else { "Error" }.to_owned(),
            message: String::new(),
            started_at: t(0),
            finished_at: t(1),
        }
    }

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(t(0)), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(t(1_732_262_400)), "2024-11-22T08:00:00Z");
        assert_eq!(rfc3339(t(951_782_400)), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn phase_follows_kubelet() {
        let c = |state: State, last: Option<State>| ContainerStatus {
            last_state: last,
            ..ContainerStatus::new("c", "", state)
        };
        let creating = c(State::waiting("ContainerCreating", ""), None);
        let running = c(State::Running { started_at: t(0) }, None);
        let backoff = c(State::waiting("CrashLoopBackOff", ""), Some(terminated(1)));
        assert_eq!(phase(RestartPolicy::Always, &[creating]), "Pending");
        assert_eq!(
            phase(RestartPolicy::Always, std::slice::from_ref(&running)),
            "Running"
        );
        assert_eq!(phase(RestartPolicy::Always, &[backoff]), "Running");
        assert_eq!(
            phase(RestartPolicy::Never, &[c(terminated(1), None)]),
            "Failed"
        );
        assert_eq!(
            phase(RestartPolicy::Never, &[c(terminated(0), None)]),
            "Succeeded"
        );
        assert_eq!(
            phase(RestartPolicy::OnFailure, &[c(terminated(0), None), running]),
            "Running"
        );
    }

    #[test]
    fn a_status_has_the_pod_status_shape() {
        let facts = PodFacts {
            policy: RestartPolicy::Always,
            node_ip: "127.0.0.1",
            start_time: t(0),
        };
        let mut c = ContainerStatus::new("main", "busybox", State::Running { started_at: t(0) });
        c.ready = true;
        let s = pod_status(&facts, &[c]);
        assert_eq!(s["phase"], "Running");
        assert_eq!(
            s["conditions"][3],
            json!({"type": "Ready", "status": "True"})
        );
        assert_eq!(
            s["containerStatuses"][0]["state"]["running"]["startedAt"],
            "1970-01-01T00:00:00Z"
        );
        assert_eq!(s["containerStatuses"][0]["restartCount"], 0);
    }
}
