//! kube-controller-manager's node lifecycle controller and taint-based eviction, simulated (off
//! unless [`crate::Config::lifecycle`] is set): a Node whose `Ready` heartbeat and
//! `kube-node-lease` Lease have both not moved for the grace period turns `Unknown`; a Node
//! whose `Ready` is not `True` gets the `unreachable` (Unknown) or `not-ready` (False) taints,
//! `NoSchedule` and `NoExecute`, lifted once it is `True` again; a pod on a `NoExecute`-tainted
//! Node is deleted gracefully when its toleration runs out, the `DefaultTolerationSeconds`
//! admission plugin's toleration counted for pods without their own. Not simulated: pods'
//! `Ready` set to False, rate limits, zones.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::kinds::{self, Kind};
use crate::server::Shared;
use crate::store::{now, Store};

/// The simulated controller's timings (kube-controller-manager's flags and defaults).
#[derive(Debug, Clone)]
pub struct Lifecycle {
    /// How often Nodes are looked at (`--node-monitor-period`, 5 s): a taint lands within one
    /// period after the grace ran out, an eviction within one after its toleration did.
    pub monitor_period: Duration,
    /// `--node-monitor-grace-period` (40 s; 50 s from Kubernetes 1.32).
    pub grace: Duration,
    /// The toleration pods without their own get (`--default-not-ready-toleration-seconds`,
    /// `--default-unreachable-toleration-seconds`: 300 s).
    pub default_toleration: Duration,
}

impl Default for Lifecycle {
    fn default() -> Self {
        Lifecycle {
            monitor_period: Duration::from_secs(5),
            grace: Duration::from_secs(40),
            default_toleration: Duration::from_secs(300),
        }
    }
}

const UNREACHABLE: &str = "node.kubernetes.io/unreachable";
const NOT_READY: &str = "node.kubernetes.io/not-ready";

/// When a Node's heartbeats were last seen to move.
struct Probe {
    heartbeat: Value,
    renew: Value,
    at: Instant,
}

fn kind(group: &str, plural: &str) -> Option<&'static Kind> {
    kinds::find(group, "v1", plural)
}

/// Looks at every Node each `monitor_period` until `cancel`.
pub(crate) async fn run(shared: Arc<Shared>, config: Lifecycle, cancel: CancellationToken) {
    let mut probes = HashMap::new();
    let mut tick = tokio::time::interval(config.monitor_period);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        pass(&mut shared.store(), &config, &mut probes, Instant::now());
    }
}

fn ready(node: &Value) -> Option<&Value> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
}

/// One look at every Node and the pods bound to the tainted ones.
fn pass(store: &mut Store, config: &Lifecycle, probes: &mut HashMap<String, Probe>, at: Instant) {
    let (Some(nodes_kind), Some(leases_kind), Some(pods_kind)) = (
        kind("", "nodes"),
        kind("coordination.k8s.io", "leases"),
        kind("", "pods"),
    ) else {
        return;
    };
    let mut tainted = HashMap::new();
    for (_, name, node) in store.list(nodes_kind, None, None) {
        let heartbeat = ready(&node).map_or(Value::Null, |c| c["lastHeartbeatTime"].clone());
        let renew = store
            .get(leases_kind, "kube-node-lease", &name)
            .map_or(Value::Null, |l| l["spec"]["renewTime"].clone());
        let probe = probes.entry(name.clone()).or_insert_with(|| Probe {
            heartbeat: heartbeat.clone(),
            renew: renew.clone(),
            at,
        });
        if probe.heartbeat != heartbeat || probe.renew != renew {
            *probe = Probe {
                heartbeat,
                renew,
                at,
            };
        }
        let mut node = node;
        if at.duration_since(probe.at) > config.grace {
            if let Some(unknown) = unknown_status(&node["status"]) {
                info!(node = %name, "node lifecycle: no heartbeat within the grace period; Ready=Unknown");
                node["status"] = unknown;
                match store.update(nodes_kind, "", &name, node.clone(), true) {
                    Ok(written) => node = written,
                    Err(e) => {
                        warn!(error_code = "EM-FAKEAPI-LIFECYCLE", node = %name, error = %e, "status not written")
                    }
                }
            }
        }
        let state = ready(&node)
            .and_then(|c| c["status"].as_str())
            .unwrap_or("Unknown");
        if let Some(taints) = retaint(&node["spec"]["taints"], state) {
            info!(node = %name, ready = state, "node lifecycle: taints changed");
            node["spec"]["taints"] = taints;
            match store.update(nodes_kind, "", &name, node.clone(), false) {
                Ok(written) => node = written,
                Err(e) => {
                    warn!(error_code = "EM-FAKEAPI-LIFECYCLE", node = %name, error = %e, "taints not written")
                }
            }
        }
        let no_execute: Vec<Value> = node["spec"]["taints"]
            .as_array()
            .map(|t| {
                t.iter()
                    .filter(|t| t["effect"] == "NoExecute")
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        if !no_execute.is_empty() {
            tainted.insert(name, no_execute);
        }
    }
    probes.retain(|name, _| store.get(nodes_kind, "", name).is_ok());
    if tainted.is_empty() {
        return;
    }
    let wall = OffsetDateTime::now_utc();
    for (ns, name, pod) in store.list(pods_kind, None, None) {
        let Some(taints) = pod["spec"]["nodeName"]
            .as_str()
            .and_then(|n| tainted.get(n))
        else {
            continue;
        };
        if pod["metadata"]["deletionTimestamp"].is_string() {
            continue;
        }
        let due = eviction_at(&pod, taints, config.default_toleration);
        if due.is_some_and(|due| due <= wall) {
            info!(pod = %format!("{ns}/{name}"), "node lifecycle: toleration ran out; evicting");
            if let Err(e) = store.delete(pods_kind, &ns, &name, None, None, None) {
                warn!(error_code = "EM-FAKEAPI-LIFECYCLE", pod = %name, error = %e, "eviction failed");
            }
        }
    }
}

/// The status with every condition `Unknown` (a Node that never reported gets an Unknown
/// Ready), or `None` when `Ready` is `Unknown` already.
fn unknown_status(status: &Value) -> Option<Value> {
    let mut status = if status.is_object() {
        status.clone()
    } else {
        json!({})
    };
    let never = !status["conditions"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["type"] == "Ready"));
    if never {
        let mut conditions = status["conditions"].as_array().cloned().unwrap_or_default();
        conditions.push(json!({"type": "Ready", "reason": "NodeStatusNeverUpdated",
                               "message": "Kubelet never posted node status."}));
        status["conditions"] = Value::Array(conditions);
    } else if ready(&json!({"status": status.clone()})).is_some_and(|c| c["status"] == "Unknown") {
        return None;
    }
    let now = now();
    for c in status["conditions"].as_array_mut().into_iter().flatten() {
        if c["status"] == "Unknown" {
            continue;
        }
        c["status"] = json!("Unknown");
        if !never {
            c["reason"] = json!("NodeStatusUnknown");
            c["message"] = json!("Kubelet stopped posting node status.");
        }
        c["lastTransitionTime"] = json!(now);
    }
    Some(status)
}

/// The taints for a Node whose `Ready` is `state`: other taints kept, the lifecycle ones set
/// (a kept one keeps its `timeAdded`); `None` when nothing changes.
fn retaint(current: &Value, state: &str) -> Option<Value> {
    let current = current.as_array().cloned().unwrap_or_default();
    let key = match state {
        "True" => None,
        "False" => Some(NOT_READY),
        _ => Some(UNREACHABLE),
    };
    let mut wanted: Vec<Value> = current
        .iter()
        .filter(|t| t["key"] != UNREACHABLE && t["key"] != NOT_READY)
        .cloned()
        .collect();
    if let Some(key) = key {
        for effect in ["NoSchedule", "NoExecute"] {
            let kept = current
                .iter()
                .find(|t| t["key"] == key && t["effect"] == effect)
                .cloned();
            wanted.push(kept.unwrap_or_else(|| {
                let mut taint = json!({"key": key, "effect": effect});
                if effect == "NoExecute" {
                    taint["timeAdded"] = json!(now());
                }
                taint
            }));
        }
    }
    (wanted != current).then_some(Value::Array(wanted))
}

/// Whether `toleration` tolerates `taint` (Kubernetes' matching: empty key with `Exists`
/// matches every key, an empty effect every effect).
fn tolerates(toleration: &Value, taint: &Value) -> bool {
    let effect = toleration["effect"].as_str().unwrap_or_default();
    if !effect.is_empty() && taint["effect"] != effect {
        return false;
    }
    let key = toleration["key"].as_str().unwrap_or_default();
    match toleration["operator"].as_str().unwrap_or("Equal") {
        "Exists" => key.is_empty() || taint["key"] == key,
        _ => {
            taint["key"] == key
                && taint["value"].as_str().unwrap_or_default()
                    == toleration["value"].as_str().unwrap_or_default()
        }
    }
}

/// When the pod is evicted from a Node with these `NoExecute` taints: the earliest point any
/// taint's toleration runs out, from the taint's `timeAdded`; `None` if it tolerates them all
/// for ever.
fn eviction_at(pod: &Value, taints: &[Value], default: Duration) -> Option<OffsetDateTime> {
    let tolerations = pod["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let mut due: Option<OffsetDateTime> = None;
    for taint in taints {
        let added = taint["timeAdded"]
            .as_str()
            .and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok())
            .unwrap_or_else(OffsetDateTime::now_utc);
        let matching: Vec<&Value> = tolerations.iter().filter(|t| tolerates(t, taint)).collect();
        let seconds = if matching.is_empty() {
            let key = taint["key"].as_str().unwrap_or_default();
            let admitted = (key == UNREACHABLE || key == NOT_READY)
                && !tolerations.iter().any(|t| t["key"] == key);
            if !admitted {
                return Some(added);
            }
            Some(default.as_secs() as i64)
        } else {
            // The shortest bounded one counts; one without tolerationSeconds tolerates for ever.
            matching
                .iter()
                .map(|t| t["tolerationSeconds"].as_i64())
                .try_fold(i64::MAX, |min, s| s.map(|s| min.min(s)))
        };
        if let Some(seconds) = seconds.filter(|s| *s != i64::MAX) {
            let at = added + time::Duration::seconds(seconds.max(0));
            due = Some(due.map_or(at, |d| d.min(at)));
        }
    }
    due
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, added: &str) -> Value {
        json!({"key": key, "effect": "NoExecute", "timeAdded": added})
    }

    const T0: &str = "2026-11-27T10:00:00Z";

    fn at(seconds: i64) -> Option<OffsetDateTime> {
        OffsetDateTime::parse(T0, &Rfc3339)
            .ok()
            .map(|t| t + time::Duration::seconds(seconds))
    }

    #[test]
    fn a_pod_goes_when_its_toleration_runs_out() {
        let default = Duration::from_secs(300);
        let taints = [taint(UNREACHABLE, T0)];
        let plain = json!({"spec": {}});
        assert_eq!(eviction_at(&plain, &taints, default), at(300));
        let short = json!({"spec": {"tolerations": [{"key": UNREACHABLE, "operator": "Exists",
            "effect": "NoExecute", "tolerationSeconds": 5}]}});
        assert_eq!(eviction_at(&short, &taints, default), at(5));
        let forever = json!({"spec": {"tolerations": [{"key": UNREACHABLE, "operator": "Exists",
            "effect": "NoExecute"}]}});
        assert_eq!(eviction_at(&forever, &taints, default), None);
        let everything = json!({"spec": {"tolerations": [{"operator": "Exists"}]}});
        assert_eq!(eviction_at(&everything, &taints, default), None);
        // Another NoExecute taint nobody tolerates: at once.
        assert_eq!(eviction_at(&forever, &[taint("x", T0)], default), at(0));
    }

    #[test]
    fn taints_follow_ready_and_keep_their_time() {
        let unreachable = retaint(&Value::Null, "Unknown").expect("tainted");
        assert_eq!(unreachable.as_array().map(Vec::len), Some(2));
        assert!(retaint(&unreachable, "Unknown").is_none());
        let not_ready = retaint(&unreachable, "False").expect("changed");
        assert_eq!(not_ready[0]["key"], NOT_READY);
        let other = json!([{"key": "mine", "effect": "NoSchedule"}]);
        let mut with_other = unreachable.as_array().cloned().unwrap_or_default();
        with_other.insert(0, other[0].clone());
        assert_eq!(retaint(&Value::Array(with_other), "True"), Some(other));
    }

    #[test]
    fn unknown_once() {
        let status = json!({"conditions": [{"type": "Ready", "status": "True"},
                                           {"type": "MemoryPressure", "status": "False"}]});
        let unknown = unknown_status(&status).expect("unknown");
        assert_eq!(unknown["conditions"][1]["status"], "Unknown");
        assert_eq!(unknown["conditions"][0]["reason"], "NodeStatusUnknown");
        assert!(unknown_status(&unknown).is_none());
        assert_eq!(
            unknown_status(&Value::Null).expect("never")["conditions"][0]["reason"],
            "NodeStatusNeverUpdated"
        );
    }
}
