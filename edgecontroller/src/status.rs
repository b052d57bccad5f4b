//! Pod status from a node, merged into what the API has (KubeEdge v1.3 upstream.go
//! `updatePodStatus`): transition times of unchanged conditions and the start time are kept,
//! and a status that changes nothing is not written.

use std::collections::{HashMap, HashSet, VecDeque};

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

/// A pod: `(namespace, name)`.
pub type Key = (String, String);

/// Now in the API's time format.
pub fn now() -> String {
    let now = time::OffsetDateTime::now_utc();
    now.replace_nanosecond(0)
        .unwrap_or(now)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The status to store: `reported`, with `lastTransitionTime` of each condition whose status
/// did not change taken from `current` (and set to `now` for a new or changed one), and
/// `current`'s `startTime` when it has one.
pub fn merge(current: &Value, reported: &Value, now: &str) -> Value {
    let mut merged = reported.clone();
    if !merged.is_object() {
        merged = json!({});
    }
    if let Some(start) = current.get("startTime").filter(|s| s.is_string()) {
        merged["startTime"] = start.clone();
    }
    let old_conditions = current["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if let Some(conditions) = merged["conditions"].as_array_mut() {
        for condition in conditions {
            let old = old_conditions
                .iter()
                .find(|c| c["type"] == condition["type"]);
            let time = match old {
                Some(old) if old["status"] == condition["status"] => {
                    old["lastTransitionTime"].clone()
                }
                _ => condition["lastTransitionTime"].clone(),
            };
            condition["lastTransitionTime"] = if time.is_string() { time } else { json!(now) };
            if old.is_some_and(|o| o["status"] == condition["status"]) {
                for field in ["lastProbeTime"] {
                    if let Some(v) = old.and_then(|o| o.get(field)) {
                        condition[field] = v.clone();
                    }
                }
            }
        }
    }
    merged
}

/// A JSON merge patch taking the stored status `current` to `wanted` (removed keys as null).
pub fn patch(current: &Value, wanted: &Value) -> Value {
    let mut status = wanted.as_object().cloned().unwrap_or_else(Map::new);
    if let Some(old) = current.as_object() {
        for key in old.keys() {
            if !status.contains_key(key) {
                status.insert(key.clone(), Value::Null);
            }
        }
    }
    json!({"status": status})
}

/// Whether a pod in this status has finished for good: Succeeded or Failed, or no container
/// running any more (KubeEdge `isPodNotRunning`).
pub fn terminal(status: &Value) -> bool {
    if matches!(status["phase"].as_str(), Some("Succeeded" | "Failed")) {
        return true;
    }
    let containers = status["containerStatuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    !containers.is_empty()
        && containers
            .iter()
            .all(|c| c["state"]["running"].is_null() && c["state"]["waiting"].is_null())
}

/// Pod status writes waiting for a writer. Per pod one write runs at a time; a newer status
/// replaces the one still waiting (both patches are taken against the same stored status, so
/// the newer alone is right). At most `limit` run, so a burst waits here as patches, not tasks.
#[derive(Debug)]
pub struct Queue {
    limit: usize,
    writing: HashSet<Key>,
    waiting: HashMap<Key, Box<RawValue>>,
    /// Pods with a waiting patch and none running, oldest first.
    ready: VecDeque<Key>,
}

impl Queue {
    pub fn new(limit: usize) -> Queue {
        Queue {
            limit,
            writing: HashSet::new(),
            waiting: HashMap::new(),
            ready: VecDeque::new(),
        }
    }

    /// Queues `patch` (a merge patch) for `key`.
    pub fn push(&mut self, key: Key, patch: Box<RawValue>) {
        let ready = !self.writing.contains(&key);
        if self.waiting.insert(key.clone(), patch).is_none() && ready {
            self.ready.push_back(key);
        }
    }

    /// The writes to start now; each counts as running until [`Queue::done`].
    pub fn start(&mut self) -> Vec<(Key, Box<RawValue>)> {
        let mut started = Vec::new();
        while self.writing.len() < self.limit {
            let Some(key) = self.ready.pop_front() else {
                break;
            };
            // A key forgotten and queued again can be listed twice; `done` lists it again.
            if self.writing.contains(&key) {
                continue;
            }
            if let Some(patch) = self.waiting.remove(&key) {
                self.writing.insert(key.clone());
                started.push((key, patch));
            }
        }
        started
    }

    /// The write for `key` finished; a patch that waited behind it becomes ready.
    pub fn done(&mut self, key: &Key) {
        self.writing.remove(key);
        if self.waiting.contains_key(key) {
            self.ready.push_back(key.clone());
        }
    }

    /// Drops the write waiting for `key` (the pod is gone: a pod made again under its name
    /// must not get its status); one running finishes.
    pub fn forget(&mut self, key: &Key) {
        self.waiting.remove(key);
    }

    /// Whether a write for `key` runs or waits.
    pub fn pending(&self, key: &Key) -> bool {
        self.writing.contains(key) || self.waiting.contains_key(key)
    }

    /// Whether a write for `key` waits (not started yet).
    pub fn waiting(&self, key: &Key) -> bool {
        self.waiting.contains_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unchanged_conditions_keep_their_transition_time_and_the_start_time_stays() {
        let current = json!({"phase": "Pending", "startTime": "2026-01-01T00:00:00Z",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                           {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        let reported = json!({"phase": "Running", "startTime": "2026-02-02T00:00:00Z",
            "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]});
        let merged = merge(&current, &reported, "2026-03-03T00:00:00Z");
        assert_eq!(merged["startTime"], "2026-01-01T00:00:00Z");
        assert_eq!(
            merged["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
        assert_eq!(
            merged["conditions"][1]["lastTransitionTime"],
            "2026-03-03T00:00:00Z"
        );
        // The same report again merges to the same status: nothing to write.
        assert_eq!(merge(&merged, &reported, "2026-04-04T00:00:00Z"), merged);
        assert_eq!(
            patch(
                &json!({"phase": "x", "message": "m"}),
                &json!({"phase": "y"})
            ),
            json!({"status": {"phase": "y", "message": null}})
        );
    }

    #[test]
    fn terminal_means_finished_or_nothing_running() {
        assert!(terminal(&json!({"phase": "Succeeded"})));
        assert!(!terminal(
            &json!({"phase": "Running", "containerStatuses": [{"state": {"running": {}}}]})
        ));
        assert!(terminal(
            &json!({"phase": "Running", "containerStatuses": [{"state": {"terminated": {"exitCode": 0}}}]})
        ));
        assert!(!terminal(&json!({"phase": "Pending"})));
    }

    fn raw(v: &str) -> Box<RawValue> {
        RawValue::from_string(v.to_owned()).expect("JSON")
    }

    fn key(name: &str) -> Key {
        ("default".to_owned(), name.to_owned())
    }

    #[test]
    fn a_burst_waits_as_patches_one_write_per_pod_the_newest_wins() {
        let mut q = Queue::new(2);
        q.push(key("a"), raw("1"));
        q.push(key("b"), raw("1"));
        q.push(key("c"), raw("1"));
        let started: Vec<String> = q.start().into_iter().map(|(k, _)| k.1).collect();
        assert_eq!(started, ["a", "b"]);
        assert!(q.start().is_empty(), "two run at most");
        // A newer status for a pod being written waits behind it; a third replaces the second.
        q.push(key("a"), raw("2"));
        q.push(key("a"), raw("3"));
        assert!(q.pending(&key("a")) && q.waiting(&key("a")));
        q.done(&key("b"));
        let next: Vec<(String, String)> = q
            .start()
            .into_iter()
            .map(|(k, p)| (k.1, p.get().to_owned()))
            .collect();
        assert_eq!(next, [("c".to_owned(), "1".to_owned())]);
        q.done(&key("a"));
        let next: Vec<(String, String)> = q
            .start()
            .into_iter()
            .map(|(k, p)| (k.1, p.get().to_owned()))
            .collect();
        assert_eq!(next, [("a".to_owned(), "3".to_owned())]);
        q.done(&key("a"));
        q.done(&key("c"));
        assert!(!q.pending(&key("a")) && !q.pending(&key("c")));
        assert!(q.start().is_empty());
    }

    #[test]
    fn a_forgotten_pod_loses_its_waiting_write_and_one_pod_never_has_two_running() {
        let started = |q: &mut Queue| -> Vec<String> {
            q.start()
                .into_iter()
                .map(|(k, p)| format!("{}={}", k.1, p.get()))
                .collect()
        };
        let mut q = Queue::new(2);
        q.push(key("x"), raw("1"));
        q.push(key("a"), raw("1"));
        q.forget(&key("a"));
        assert!(!q.pending(&key("a")));
        // Queued again before its old place in line is taken: listed twice.
        q.push(key("a"), raw("2"));
        assert_eq!(started(&mut q), ["x=1", "a=2"]);
        q.push(key("a"), raw("3"));
        q.done(&key("x"));
        assert!(
            started(&mut q).is_empty(),
            "a second write for a while one runs"
        );
        q.done(&key("a"));
        assert_eq!(started(&mut q), ["a=3"]);
    }
}
