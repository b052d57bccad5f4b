//! Reliable delivery to nodes (KubeEdge's cloudhub NodeMessagePool + ObjectSync, reshaped):
//! per (node, object) one message in flight, the newest wanted version queued behind it
//! (a newer replaces an older), resends with back-off until the node's MetaManager acks
//! (`response "OK"` with `parent_msg_id`), and the acked resourceVersion kept.
//!
//! The acked versions are kept in Kubernetes too, one ConfigMap per node written at most once a
//! second (`acked.rs`), and loaded again at start: a restarted controller sends a node only
//! what changed since, not everything.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::Value;
use tracing::warn;

use crate::envelope::Envelope;

/// What one node acknowledged: resource → (resourceVersion, [`shape`]).
pub type Acked = BTreeMap<String, (u64, u64)>;

/// A change one node must get.
#[derive(Debug, Clone, PartialEq)]
pub struct Outgoing {
    pub node: String,
    /// `insert`, `update` or `delete`.
    pub operation: &'static str,
    /// `<ns>/<type>/<name>`.
    pub resource: String,
    pub content: Value,
    /// The object's resourceVersion (deletes carry the last one known).
    pub rv: Option<u64>,
    /// Send even when this version was acked already (the node said it lost it).
    pub force: bool,
}

/// A message waiting for its ack, kept as the bytes published: a resend sends them again, and
/// 20,000 objects in flight during a sync cost their wire size, not a JSON tree each.
#[derive(Debug)]
struct InFlight {
    operation: &'static str,
    shape: u64,
    payload: Bytes,
    rv: Option<u64>,
    delete: bool,
    next_at: Instant,
    wait: Duration,
}

impl InFlight {
    /// The same message again (same id: the node's MetaManager acks it once more).
    fn send(&self, node: &str, resource: &str) -> Dispatch {
        Dispatch {
            node: node.to_owned(),
            operation: self.operation,
            resource: resource.to_owned(),
            payload: self.payload.clone(),
        }
    }
}

/// Per (node, object). In-flight and queued messages are boxed: most slots hold only the acked
/// version, and a slot's size is paid for every table bucket.
#[derive(Debug, Default)]
struct Slot {
    /// The version the node acknowledged last, and whether it was a delete.
    acked: Option<(Option<u64>, bool)>,
    /// The [`shape`] of what the node acknowledged last.
    acked_shape: Option<u64>,
    /// `acked` was kept from before a restart: a newer version of the same shape (a status
    /// write since) is not sent again either.
    restored: bool,
    in_flight: Option<Box<InFlight>>,
    queued: Option<Box<Outgoing>>,
}

/// A fingerprint of what a node holds of an object: everything but its status and the API
/// server's bookkeeping, so status writes (which change the resourceVersion) leave it alone.
/// std's hasher may change between Rust releases: a controller built by another one resends
/// once.
pub fn shape(content: &Value) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut shaped = content.clone();
    if let Some(object) = shaped.as_object_mut() {
        object.remove("status");
        if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
            meta.remove("managedFields");
            meta.remove("generation");
        }
    }
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    shaped.to_string().hash(&mut hasher);
    hasher.finish()
}

/// What to publish: an encoded envelope for one node, and what its topic is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    pub node: String,
    pub operation: &'static str,
    /// `<ns>/<type>/<name>`.
    pub resource: String,
    /// The envelope as JSON.
    pub payload: Bytes,
}

impl Dispatch {
    /// The envelope the payload encodes (tests and diagnostics read it back).
    ///
    /// # Errors
    /// When the payload is not an envelope (never for one [`Delivery`] made).
    pub fn envelope(&self) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(&self.payload)
    }
}

/// Per node and object delivery state.
#[derive(Debug)]
pub struct Delivery {
    slots: HashMap<(String, String), Slot>,
    by_msg: HashMap<String, (String, String)>,
    offline: HashSet<String>,
    /// Nodes whose acked versions changed since they were last taken for saving.
    dirty: HashSet<String>,
    first_wait: Duration,
    max_wait: Duration,
}

impl Delivery {
    /// Resends wait `first_wait`, doubling up to `max_wait`.
    pub fn new(first_wait: Duration, max_wait: Duration) -> Delivery {
        Delivery {
            slots: HashMap::new(),
            by_msg: HashMap::new(),
            offline: HashSet::new(),
            dirty: HashSet::new(),
            first_wait,
            max_wait,
        }
    }

    /// Messages waiting for an ack.
    pub fn in_flight(&self) -> usize {
        self.by_msg.len()
    }

    /// The version `node` acknowledged for `resource`, if any (`None` inside: unversioned).
    pub fn acked(&self, node: &str, resource: &str) -> Option<(Option<u64>, bool)> {
        self.slots
            .get(&(node.to_owned(), resource.to_owned()))
            .and_then(|s| s.acked)
    }

    /// Whether a message about `resource` is in flight to `node` or queued behind one.
    pub fn pending(&self, node: &str, resource: &str) -> bool {
        self.slots
            .get(&(node.to_owned(), resource.to_owned()))
            .is_some_and(|s| s.in_flight.is_some() || s.queued.is_some())
    }

    fn start(&mut self, key: (String, String), out: Outgoing, now: Instant) -> Option<Dispatch> {
        let rv = out.rv.map(|v| v.to_string());
        let shaped = shape(&out.content);
        let envelope = Envelope::new(out.operation, out.resource, out.content, rv);
        let payload = match serde_json::to_vec(&envelope) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                // Only a map with non-string keys fails; such a message could never be sent.
                warn!(error_code = "EM-EC-ENCODE", resource = %key.1, error = %e, "message not encoded");
                return None;
            }
        };
        self.by_msg.insert(envelope.header.msg_id, key.clone());
        let slot = self.slots.entry(key.clone()).or_default();
        slot.in_flight = Some(Box::new(InFlight {
            operation: out.operation,
            shape: shaped,
            payload: payload.clone(),
            rv: out.rv,
            delete: out.operation == "delete",
            next_at: now + self.first_wait,
            wait: self.first_wait,
        }));
        let (node, resource) = key;
        Some(Dispatch {
            node,
            operation: out.operation,
            resource,
            payload,
        })
    }

    /// Queues `out`; returns it to publish now when nothing for that object is in flight.
    /// A version the node already acked is not sent again (unless forced).
    pub fn submit(&mut self, out: Outgoing, now: Instant) -> Option<Dispatch> {
        let key = (out.node.clone(), out.resource.clone());
        let slot = self.slots.entry(key.clone()).or_default();
        let delete = out.operation == "delete";
        if !out.force && slot.queued.is_none() {
            let same_as_acked = slot.acked == Some((out.rv, delete));
            let same_as_flying = slot
                .in_flight
                .as_ref()
                .is_some_and(|f| f.rv == out.rv && f.delete == delete);
            let nothing_to_delete =
                delete && slot.acked.is_none_or(|(_, d)| d) && slot.in_flight.is_none();
            let same_shape_as_restored = slot.restored
                && !delete
                && slot.acked.is_some_and(|(_, d)| !d)
                && slot.acked_shape == Some(shape(&out.content));
            if same_shape_as_restored && slot.in_flight.is_none() {
                slot.acked = Some((out.rv, false));
                return None;
            }
            if (same_as_acked && slot.in_flight.is_none()) || same_as_flying || nothing_to_delete {
                return None;
            }
        }
        if slot.in_flight.is_some() {
            slot.queued = Some(Box::new(out));
            return None;
        }
        self.start(key, out, now)
    }

    /// The node acknowledged `msg_id`: record the version, start what was queued behind it.
    pub fn ack(&mut self, node: &str, msg_id: &str, now: Instant) -> Option<Dispatch> {
        let key = self.by_msg.get(msg_id)?.clone();
        if key.0 != node {
            return None;
        }
        self.by_msg.remove(msg_id);
        let slot = self.slots.get_mut(&key)?;
        let flight = slot.in_flight.take()?;
        slot.acked = Some((flight.rv, flight.delete));
        slot.acked_shape = Some(flight.shape);
        slot.restored = false;
        self.dirty.insert(key.0.clone());
        let Some(queued) = slot.queued.take() else {
            // A delete the node has: nothing is left to remember about that object.
            if flight.delete {
                self.slots.remove(&key);
            }
            return None;
        };
        self.submit(*queued, now)
    }

    /// Messages whose ack is overdue, for nodes not known to be offline; each waits twice as
    /// long before its next resend.
    pub fn due(&mut self, now: Instant) -> Vec<Dispatch> {
        let mut out = Vec::new();
        for ((node, resource), slot) in &mut self.slots {
            if self.offline.contains(node) {
                continue;
            }
            if let Some(flight) = slot.in_flight.as_mut().filter(|f| f.next_at <= now) {
                flight.wait = (flight.wait * 2).min(self.max_wait);
                flight.next_at = now + flight.wait;
                out.push(flight.send(node, resource));
            }
        }
        out
    }

    /// The node went away (its Last Will): stop resending to it until it is back.
    pub fn node_offline(&mut self, node: &str) {
        self.offline.insert(node.to_owned());
    }

    /// The node is back (its birth message): everything in flight is sent again now.
    pub fn node_online(&mut self, node: &str, now: Instant) -> Vec<Dispatch> {
        self.offline.remove(node);
        let mut out = Vec::new();
        for ((n, resource), slot) in &mut self.slots {
            if n != node {
                continue;
            }
            if let Some(flight) = slot.in_flight.as_mut() {
                flight.wait = self.first_wait;
                flight.next_at = now + flight.wait;
                out.push(flight.send(n, resource));
            }
        }
        out
    }

    /// Forgets everything about `node` (it is no longer an edge node).
    pub fn forget_node(&mut self, node: &str) {
        self.slots.retain(|(n, _), _| n != node);
        self.by_msg.retain(|_, (n, _)| n != node);
        self.offline.remove(node);
        self.dirty.remove(node);
    }

    /// Takes what `node` acknowledged as kept from before a restart: the same versions are
    /// not sent to it again.
    pub fn preload(&mut self, node: &str, acked: &Acked) {
        for (resource, &(rv, shape)) in acked {
            let slot = self
                .slots
                .entry((node.to_owned(), resource.clone()))
                .or_default();
            if slot.acked.is_none() {
                slot.acked = Some((Some(rv), false));
                slot.acked_shape = Some(shape);
                slot.restored = true;
            }
        }
    }

    /// Objects of `res_type` a node acknowledged before a restart and has not acknowledged
    /// since, for which `exists(node, resource)` is false: deleted while no controller ran.
    /// Each comes as the delete to send, with the version the node holds.
    pub fn restored_gone(
        &self,
        res_type: &str,
        exists: impl Fn(&str, &str) -> bool,
    ) -> Vec<Outgoing> {
        self.slots
            .iter()
            .filter(|((_, resource), slot)| {
                slot.restored
                    && slot.in_flight.is_none()
                    && resource.split('/').nth(1) == Some(res_type)
            })
            .filter(|((node, resource), _)| !exists(node, resource))
            .map(|((node, resource), slot)| {
                let mut parts = resource.splitn(3, '/');
                let namespace = parts.next().unwrap_or_default();
                let name = parts.nth(1).unwrap_or_default();
                Outgoing {
                    node: node.clone(),
                    operation: "delete",
                    resource: resource.clone(),
                    content: serde_json::json!({"metadata": {"name": name, "namespace": namespace}}),
                    rv: slot.acked.and_then(|(rv, _)| rv),
                    force: false,
                }
            })
            .collect()
    }

    /// `node`'s acked versions are to be taken again (their save was put off).
    pub fn mark_dirty(&mut self, node: String) {
        self.dirty.insert(node);
    }

    /// The acked versions and shapes of every node that acknowledged something since the last
    /// call, per node: the objects it holds (deletes and unversioned objects are not kept).
    pub fn take_dirty(&mut self) -> Vec<(String, Acked)> {
        if self.dirty.is_empty() {
            return Vec::new();
        }
        let dirty = std::mem::take(&mut self.dirty);
        let mut out: HashMap<String, Acked> =
            dirty.into_iter().map(|n| (n, BTreeMap::new())).collect();
        for ((node, resource), slot) in &self.slots {
            if let (Some(acked), Some((Some(rv), false)), Some(shape)) =
                (out.get_mut(node), slot.acked, slot.acked_shape)
            {
                acked.insert(resource.clone(), (rv, shape));
            }
        }
        out.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::VecDeque;

    fn env(send: Dispatch) -> Envelope {
        send.envelope().expect("an envelope")
    }

    fn change(rv: u64, delete: bool) -> Outgoing {
        Outgoing {
            node: "n".to_owned(),
            operation: if delete { "delete" } else { "update" },
            resource: "default/configmap/c".to_owned(),
            content: json!({"rv": rv}),
            rv: Some(rv),
            force: false,
        }
    }

    #[test]
    fn newer_versions_coalesce_behind_the_one_in_flight() {
        let now = Instant::now();
        let mut d = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        let first = env(d.submit(change(1, false), now).expect("sent"));
        assert!(d.submit(change(2, false), now).is_none());
        assert!(d.submit(change(3, false), now).is_none());
        let next = env(d.ack("n", &first.header.msg_id, now).expect("queued one"));
        assert_eq!(next.header.resourceversion.as_deref(), Some("3"));
        assert!(d.ack("n", &next.header.msg_id, now).is_none());
        assert_eq!(d.acked("n", "default/configmap/c"), Some((Some(3), false)));
        // The acked version is not sent again; a forced one is.
        assert!(d.submit(change(3, false), now).is_none());
        let mut forced = change(3, false);
        forced.force = true;
        assert!(d.submit(forced, now).is_some());
    }

    #[test]
    fn acked_versions_are_taken_once_per_change_and_preloaded_ones_are_not_sent_again() {
        let now = Instant::now();
        let mut d = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        let sent = env(d.submit(change(4, false), now).expect("sent"));
        assert!(d.take_dirty().is_empty(), "nothing acked yet");
        d.ack("n", &sent.header.msg_id, now);
        let kept = d.take_dirty();
        assert_eq!(kept.len(), 1);
        assert_eq!(
            kept[0].1.get("default/configmap/c"),
            Some(&(4, shape(&json!({"rv": 4}))))
        );
        assert!(d.take_dirty().is_empty());

        let mut restarted = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        restarted.preload("n", &kept[0].1);
        assert!(
            restarted.submit(change(4, false), now).is_none(),
            "acked before"
        );
        assert!(
            restarted.submit(change(5, false), now).is_some(),
            "changed since"
        );
        // A newer version whose only change is its status is not sent after a restart.
        let mut restarted = Delivery::new(Duration::from_secs(1), Duration::from_secs(8));
        restarted.preload("n", &kept[0].1);
        let mut status_only = change(6, false);
        status_only.content = json!({"rv": 4, "status": {"phase": "Running"}});
        assert!(restarted.submit(status_only, now).is_none());
        // One deleted while no controller ran is deleted on the node.
        let gone = restarted.restored_gone("configmap", |_, _| false);
        assert_eq!(gone.len(), 1);
        assert_eq!((gone[0].operation, gone[0].rv), ("delete", Some(6)));
        assert!(restarted.restored_gone("configmap", |_, _| true).is_empty());
    }

    #[test]
    fn unacked_messages_are_resent_with_back_off_but_not_to_offline_nodes() {
        let now = Instant::now();
        let mut d = Delivery::new(Duration::from_secs(1), Duration::from_secs(4));
        let sent = env(d.submit(change(1, false), now).expect("sent"));
        assert!(d.due(now).is_empty());
        let again = d.due(now + Duration::from_secs(1));
        assert_eq!(again.len(), 1);
        assert_eq!(env(again[0].clone()).header.msg_id, sent.header.msg_id);
        assert_eq!(again[0].resource, "default/configmap/c");
        assert!(d.due(now + Duration::from_secs(2)).is_empty());
        assert_eq!(d.due(now + Duration::from_secs(3)).len(), 1);
        d.node_offline("n");
        assert!(d.due(now + Duration::from_secs(60)).is_empty());
        assert_eq!(d.node_online("n", now).len(), 1);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Change { delete: bool },
        Outage,
        Back,
        Deliver,
        Tick,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Change { delete: false }),
            1 => Just(Step::Change { delete: true }),
            1 => Just(Step::Outage),
            1 => Just(Step::Back),
            6 => Just(Step::Deliver),
            2 => Just(Step::Tick),
        ]
    }

    /// The cloud broker's queue for the node: small, dropping the oldest on overflow.
    fn publish(sends: Vec<Dispatch>, broker: &mut VecDeque<Envelope>) {
        for send in sends {
            let e = env(send);
            if broker.len() >= 5 {
                broker.pop_front();
            }
            broker.push_back(e);
        }
    }

    /// The node applies the next queued message (checking it is not older than what it has)
    /// and acks it; what the ack releases is published.
    fn deliver(
        d: &mut Delivery,
        broker: &mut VecDeque<Envelope>,
        applied: &mut Option<(u64, bool)>,
        now: Instant,
    ) -> Result<(), TestCaseError> {
        let Some(e) = broker.pop_front() else {
            return Ok(());
        };
        let v: u64 = e
            .header
            .resourceversion
            .as_deref()
            .unwrap_or("0")
            .parse()
            .unwrap_or(0);
        if let Some((old, _)) = *applied {
            prop_assert!(v >= old, "applied {} after {}", v, old);
        }
        *applied = Some((v, e.route.operation == "delete"));
        publish(
            d.ack("n", &e.header.msg_id, now).into_iter().collect(),
            broker,
        );
        Ok(())
    }

    proptest! {
        /// A node offline while changes happen converges after it is back, and never applies an
        /// older version after a newer one.
        #[test]
        fn a_node_converges_and_never_goes_back_in_versions(steps in prop::collection::vec(step(), 1..200)) {
            let mut now = Instant::now();
            let mut d = Delivery::new(Duration::from_millis(100), Duration::from_secs(2));
            let mut rv = 0u64;
            let mut latest: Option<(u64, bool)> = None;
            let mut broker = VecDeque::new();
            let mut online = true;
            let mut applied = None;
            for s in steps {
                now += Duration::from_millis(50);
                match s {
                    Step::Change { delete } => {
                        rv += 1;
                        latest = Some((rv, delete));
                        publish(d.submit(change(rv, delete), now).into_iter().collect(), &mut broker);
                    }
                    Step::Outage => {
                        online = false;
                        d.node_offline("n");
                    }
                    Step::Back => {
                        online = true;
                        publish(d.node_online("n", now), &mut broker);
                    }
                    Step::Deliver if online => deliver(&mut d, &mut broker, &mut applied, now)?,
                    Step::Deliver => {}
                    Step::Tick => publish(d.due(now), &mut broker),
                }
            }
            // The node comes back for good: deliver and resend until quiet.
            publish(d.node_online("n", now), &mut broker);
            for _ in 0..1_000 {
                now += Duration::from_millis(500);
                deliver(&mut d, &mut broker, &mut applied, now)?;
                if broker.is_empty() {
                    publish(d.due(now), &mut broker);
                }
            }
            match latest {
                // A delete leaves the node without the object, whichever delete it saw.
                Some((_, true)) => prop_assert!(applied.is_none_or(|(_, deleted)| deleted)),
                Some((v, false)) => prop_assert_eq!(applied, Some((v, false))),
                None => {}
            }
            prop_assert_eq!(d.in_flight(), 0);
        }
    }
}
