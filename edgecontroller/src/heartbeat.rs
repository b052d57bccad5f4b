//! Node heartbeats on the cloud side: the node status edged reports every 10 s and its
//! `kube-node-lease` Lease, written per node one at a time (a newer report replaces one
//! waiting), and `Ready=Unknown` the moment a node's Last Will arrives.
//!
//! The rule for the status: it is written when anything but the heartbeat times differs from
//! what the API has, or when the stored heartbeat (`lastHeartbeatTime` of `Ready`) is at least
//! `refresh` old, so the status alone stays fresh within the node lifecycle controller's grace
//! period; otherwise the report costs no API request at all. The Lease is written on every
//! renewal (that is what renewing is), one request each while its resourceVersion is known.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::{json, Value};

use crate::envelope::Envelope;
use crate::status;

/// What a status write for one node is to do.
#[derive(Debug, Clone)]
pub enum StatusWork {
    /// The request with a status edged reported (content `{"status": ...}` or
    /// `{"Status": ...}`, the Node's metadata beside it), answered only if the write fails.
    Report(Box<Envelope>),
    /// The node's Last Will: every condition `Unknown`.
    Offline,
}

/// A Lease renewal: the node's spec, and the request (answered if `answer` or on failure).
#[derive(Debug, Clone)]
pub struct LeaseWork {
    pub spec: Value,
    pub request: Envelope,
    pub answer: bool,
}

#[derive(Debug, Default)]
struct Beat {
    status_busy: bool,
    status_next: Option<StatusWork>,
    lease_busy: bool,
    lease_next: Option<LeaseWork>,
    lease_rv: Option<String>,
    /// The Node as our last status write left it.
    written: Option<Value>,
}

/// Per node: one status write and one Lease write at a time, the newest waiting behind each.
#[derive(Debug)]
pub struct Heartbeats {
    /// An unchanged status is written again once its heartbeat is this old.
    pub refresh: Duration,
    nodes: HashMap<String, Beat>,
}

impl Heartbeats {
    pub fn new(refresh: Duration) -> Heartbeats {
        Heartbeats {
            refresh,
            nodes: HashMap::new(),
        }
    }

    /// `work` for `node`'s status: returned to start now, or kept behind the running write.
    pub fn status(&mut self, node: &str, work: StatusWork) -> Option<StatusWork> {
        let beat = self.nodes.entry(node.to_owned()).or_default();
        if beat.status_busy {
            beat.status_next = Some(work);
            return None;
        }
        beat.status_busy = true;
        Some(work)
    }

    /// A status write ended (`node_after`: the Node it wrote; `failed`: what we knew may be
    /// stale, so the next write starts from the watch or a fresh read); what waited starts now.
    pub fn status_done(
        &mut self,
        node: &str,
        node_after: Option<Value>,
        failed: bool,
    ) -> Option<StatusWork> {
        let beat = self.nodes.get_mut(node)?;
        if failed {
            beat.written = None;
        } else if node_after.is_some() {
            beat.written = node_after;
        }
        let next = beat.status_next.take();
        beat.status_busy = next.is_some();
        next
    }

    /// The Node our last write left, if no newer one is known.
    pub fn written(&self, node: &str) -> Option<&Value> {
        self.nodes.get(node)?.written.as_ref()
    }

    /// `work` for `node`'s Lease, with the resourceVersion to replace, when it starts now.
    pub fn lease(&mut self, node: &str, work: LeaseWork) -> Option<(LeaseWork, Option<String>)> {
        let beat = self.nodes.entry(node.to_owned()).or_default();
        if beat.lease_busy {
            beat.lease_next = Some(work);
            return None;
        }
        beat.lease_busy = true;
        Some((work, beat.lease_rv.clone()))
    }

    /// A Lease write ended with the Lease's new resourceVersion (`None`: unknown now).
    pub fn lease_done(
        &mut self,
        node: &str,
        rv: Option<String>,
    ) -> Option<(LeaseWork, Option<String>)> {
        let beat = self.nodes.get_mut(node)?;
        beat.lease_rv = rv;
        let next = beat.lease_next.take();
        beat.lease_busy = next.is_some();
        next.map(|n| (n, beat.lease_rv.clone()))
    }

    /// The node is no longer an edge node.
    pub fn forget(&mut self, node: &str) {
        self.nodes.remove(node);
    }
}

/// The status in a report: `{"Status": ...}` (KubeEdge's `NodeStatusRequest`), `{"status": ...}`
/// (a Node document) or the status itself.
pub fn reported_status(content: &Value) -> Option<&Value> {
    let status = content
        .get("Status")
        .or_else(|| content.get("status"))
        .unwrap_or(content);
    status.is_object().then_some(status)
}

/// Seconds since `stamp` (RFC 3339) at `now`; `None` if either does not parse.
fn age(stamp: &Value, now: &str) -> Option<Duration> {
    let parse = |t: &str| {
        time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
    };
    let (then, now) = (parse(stamp.as_str()?)?, parse(now)?);
    Some(Duration::from_secs(
        u64::try_from((now - then).whole_seconds()).unwrap_or(0),
    ))
}

fn condition<'a>(status: &'a Value, kind: &str) -> Option<&'a Value> {
    status["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// The status with every condition's `lastHeartbeatTime` removed, for comparing.
fn without_heartbeats(status: &Value) -> Value {
    let mut status = status.clone();
    if let Some(conditions) = status["conditions"].as_array_mut() {
        for c in conditions {
            if let Some(c) = c.as_object_mut() {
                c.remove("lastHeartbeatTime");
            }
        }
    }
    status
}

/// The status to write for `reported` over the stored `current` at `now`, or `None` when it
/// changes nothing but the heartbeat and the stored heartbeat is younger than `refresh`.
pub fn status_to_write(
    current: &Value,
    reported: &Value,
    now: &str,
    refresh: Duration,
) -> Option<Value> {
    let mut wanted = status::merge(current, reported, now);
    // What the node cannot know stays as the API has it.
    for kept in [
        "daemonEndpoints",
        "volumesAttached",
        "volumesInUse",
        "images",
    ] {
        if wanted.get(kept).is_none() && !current[kept].is_null() {
            wanted[kept] = current[kept].clone();
        }
    }
    let fresh = condition(current, "Ready")
        .and_then(|c| age(&c["lastHeartbeatTime"], now))
        .is_some_and(|a| a < refresh);
    if fresh && without_heartbeats(&wanted) == without_heartbeats(current) {
        return None;
    }
    if let Some(conditions) = wanted["conditions"].as_array_mut() {
        for c in conditions {
            c["lastHeartbeatTime"] = json!(now);
        }
    }
    Some(wanted)
}

/// The stored status with every condition `Unknown` (as kube-controller-manager's node
/// lifecycle controller writes it when heartbeats stop), or `None` when it is already.
pub fn offline_status(current: &Value, now: &str) -> Option<Value> {
    let mut wanted = current.clone();
    if !wanted.is_object() {
        wanted = json!({});
    }
    if condition(&wanted, "Ready").is_none() {
        let mut conditions = wanted["conditions"].as_array().cloned().unwrap_or_default();
        conditions.push(json!({"type": "Ready"}));
        wanted["conditions"] = Value::Array(conditions);
    }
    let mut changed = false;
    if let Some(conditions) = wanted["conditions"].as_array_mut() {
        for c in conditions {
            if c["status"] == "Unknown" {
                continue;
            }
            changed = true;
            c["status"] = json!("Unknown");
            c["reason"] = json!("NodeStatusUnknown");
            c["message"] = json!("Kubelet stopped posting node status.");
            c["lastTransitionTime"] = json!(now);
            if c["lastHeartbeatTime"].is_null() {
                c["lastHeartbeatTime"] = json!(now);
            }
        }
    }
    changed.then_some(wanted)
}

/// Now as a Lease's `renewTime` (`MicroTime`: six fractional digits).
pub fn micro_now() -> String {
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    time::OffsetDateTime::now_utc()
        .format(&format)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: &str = "2026-11-27T10:00:00Z";

    fn ready(heartbeat: &str) -> Value {
        json!({"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
            "lastHeartbeatTime": heartbeat, "lastTransitionTime": T0}],
            "nodeInfo": {"bootID": "b1"}, "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}})
    }

    fn report() -> Value {
        json!({"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
               "nodeInfo": {"bootID": "b1"}})
    }

    #[test]
    fn an_unchanged_status_is_rewritten_only_once_its_heartbeat_is_old() {
        let refresh = Duration::from_secs(20);
        let stored = ready(T0);
        assert!(status_to_write(&stored, &report(), "2026-11-27T10:00:19Z", refresh).is_none());
        let written = status_to_write(&stored, &report(), "2026-11-27T10:00:20Z", refresh)
            .expect("refreshed");
        let c = &written["conditions"][0];
        assert_eq!(c["lastHeartbeatTime"], "2026-11-27T10:00:20Z");
        assert_eq!(c["lastTransitionTime"], T0);
        // Kept: the node does not report it.
        assert_eq!(written["daemonEndpoints"]["kubeletEndpoint"]["Port"], 0);
        // A change is written at once, with a new transition time.
        let mut rebooted = report();
        rebooted["nodeInfo"]["bootID"] = json!("b2");
        assert!(status_to_write(&stored, &rebooted, "2026-11-27T10:00:01Z", refresh).is_some());
        let mut pressed = report();
        pressed["conditions"][0]["status"] = json!("False");
        let written =
            status_to_write(&stored, &pressed, "2026-11-27T10:00:01Z", refresh).expect("changed");
        assert_eq!(
            written["conditions"][0]["lastTransitionTime"],
            "2026-11-27T10:00:01Z"
        );
    }

    #[test]
    fn the_last_will_makes_every_condition_unknown_once() {
        let unknown = offline_status(&ready(T0), "2026-11-27T10:01:00Z").expect("written");
        let c = &unknown["conditions"][0];
        assert_eq!(c["status"], "Unknown");
        assert_eq!(c["reason"], "NodeStatusUnknown");
        assert_eq!(c["lastHeartbeatTime"], T0);
        assert_eq!(c["lastTransitionTime"], "2026-11-27T10:01:00Z");
        assert!(offline_status(&unknown, "2026-11-27T10:02:00Z").is_none());
        // A Node that never reported gets an Unknown Ready.
        let bare = offline_status(&Value::Null, T0).expect("written");
        assert_eq!(bare["conditions"][0]["type"], "Ready");
        // The first heartbeat after the outage is a change: written at once.
        assert!(status_to_write(
            &unknown,
            &report(),
            "2026-11-27T10:01:01Z",
            Duration::from_secs(20)
        )
        .is_some());
    }

    #[test]
    fn writes_for_one_node_run_one_at_a_time_and_the_newest_waits() {
        let mut beats = Heartbeats::new(Duration::from_secs(20));
        assert!(beats.status("n", StatusWork::Offline).is_some());
        let request = Envelope::new("update", "default/nodestatus/n".to_owned(), json!(1), None);
        let report = |n: i64| {
            StatusWork::Report(Box::new(Envelope::new(
                "update",
                "default/nodestatus/n".to_owned(),
                json!(n),
                None,
            )))
        };
        assert!(beats.status("n", report(1)).is_none());
        assert!(beats.status("n", report(2)).is_none());
        assert!(beats.status("other", report(9)).is_some());
        match beats.status_done("n", Some(json!({"v": 1})), false) {
            Some(StatusWork::Report(request)) => assert_eq!(request.content, json!(2)),
            other => panic!("{other:?}"),
        }
        assert!(beats.status_done("n", None, false).is_none());
        assert_eq!(beats.written("n"), Some(&json!({"v": 1})));
        assert!(beats.status("n", report(3)).is_some());

        let lease = |answer| LeaseWork {
            spec: json!({}),
            request: request.clone(),
            answer,
        };
        assert_eq!(beats.lease("n", lease(false)).map(|(_, rv)| rv), Some(None));
        assert!(beats.lease("n", lease(true)).is_none());
        let (next, rv) = beats.lease_done("n", Some("7".to_owned())).expect("next");
        assert!(next.answer);
        assert_eq!(rv.as_deref(), Some("7"));
        assert!(beats.lease_done("n", Some("8".to_owned())).is_none());
        assert_eq!(
            beats.lease("n", lease(false)).map(|(_, rv)| rv),
            Some(Some("8".to_owned()))
        );
    }
}
