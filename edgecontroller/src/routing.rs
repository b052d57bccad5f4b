//! Which node needs which object (KubeEdge v1.3 cloud/pkg/edgecontroller/controller/
//! downstream.go and manager/location.go): pods bound to edge nodes, the configmaps and
//! secrets they reference, counted per node so an object stops going to a node when its last
//! pod there goes (KubeEdge's LocationCache only grows), and each edge node's own Node.
//!
//! Pure state: every change returns the messages it causes, in the order to send them.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::Deserialize;
use serde_json::Value;

use crate::delivery::Outgoing;
use crate::refs::{pod_refs, Ref};

/// The label that makes a Node an edge node (KubeEdge common/constants `EdgeNodeRoleKey`).
pub const EDGE_LABEL: &str = "node-role.kubernetes.io/edge";

/// KubeEdge's namespace for cluster-scoped objects sent to a node (`models.NullNamespace`).
pub const NULL_NAMESPACE: &str = "null";

/// What we know of a pod: what routing decides on, and the pod as JSON text for what is sent
/// again (a resync, a node that lost it); a tree of `Value`s costs several times its text.
#[derive(Debug, Clone)]
pub struct PodEntry {
    /// The edge node it is bound to (`None`: unbound or on a non-edge node).
    pub node: Option<String>,
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub rv: Option<u64>,
    /// `spec.nodeName` of a pod bound to a Node not known as an edge node (yet).
    waiting_for: Option<Box<str>>,
    json: Box<str>,
    /// Sorted, as [`pod_refs`] lists them.
    refs: Box<[Ref]>,
    /// A `delete` went to the node because of its `deletionTimestamp`.
    pub deleting: bool,
}

/// The one field of a pod the status merge reads, parsed without building the rest.
#[derive(Deserialize)]
struct StatusOnly {
    #[serde(default)]
    status: Value,
}

impl PodEntry {
    /// The pod as last watched.
    pub fn object(&self) -> Value {
        serde_json::from_str(&self.json).unwrap_or(Value::Null)
    }

    /// Its `status` as last watched (`Null` when it has none).
    pub fn status(&self) -> Value {
        serde_json::from_str::<StatusOnly>(&self.json)
            .map(|s| s.status)
            .unwrap_or(Value::Null)
    }
}

/// The routing state.
#[derive(Debug, Default)]
pub struct Routing {
    edge_nodes: HashMap<String, Value>,
    pods: HashMap<(String, String), PodEntry>,
    /// `configmap`/`secret` objects by (kind, ns, name).
    config: HashMap<Ref, Value>,
    /// Per configmap/secret: node -> how many of its pods reference it.
    users: HashMap<Ref, HashMap<String, usize>>,
}

fn rv_of(object: &Value) -> Option<u64> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|r| r.parse().ok())
}

fn meta_str(object: &Value, field: &str) -> String {
    object["metadata"][field]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// A pod as the node compares it: metadata (less server bookkeeping) and spec; status-only
/// changes never go down (KubeEdge manager/pod.go `isPodUpdated`).
fn pod_shape(pod: &Value) -> Value {
    let mut meta = pod["metadata"].clone();
    if let Some(m) = meta.as_object_mut() {
        m.remove("resourceVersion");
        m.remove("managedFields");
        m.remove("generation");
    }
    serde_json::json!({"metadata": meta, "spec": pod["spec"]})
}

fn out(node: &str, operation: &'static str, resource: String, object: &Value) -> Outgoing {
    Outgoing {
        node: node.to_owned(),
        operation,
        resource,
        content: object.clone(),
        rv: rv_of(object),
        force: false,
    }
}

fn pod_resource(ns: &str, name: &str) -> String {
    format!("{ns}/pod/{name}")
}

impl Routing {
    /// Whether `name` is a known edge node.
    pub fn is_edge(&self, name: &str) -> bool {
        self.edge_nodes.contains_key(name)
    }

    /// The edge nodes.
    pub fn nodes(&self) -> impl Iterator<Item = &String> {
        self.edge_nodes.keys()
    }

    /// The pod, if known.
    pub fn pod(&self, ns: &str, name: &str) -> Option<&PodEntry> {
        self.pods.get(&(ns.to_owned(), name.to_owned()))
    }

    /// The configmap or secret, if `node` runs a pod that references it; `Err(false)` when no
    /// pod there references it, `Err(true)` when one does but it does not exist.
    pub fn readable(&self, node: &str, r: &Ref) -> Result<&Value, bool> {
        let referenced = self
            .users
            .get(r)
            .is_some_and(|nodes| nodes.contains_key(node));
        if !referenced {
            return Err(false);
        }
        self.config.get(r).ok_or(true)
    }

    /// The Node object of an edge node.
    pub fn node_object(&self, name: &str) -> Option<&Value> {
        self.edge_nodes.get(name)
    }

    /// Everything `node` should hold now, for a resync.
    pub fn desired(&self, node: &str) -> Vec<Outgoing> {
        let mut sends = Vec::new();
        if let Some(object) = self.edge_nodes.get(node) {
            sends.push(out(
                node,
                "update",
                format!("{NULL_NAMESPACE}/node/{node}"),
                object,
            ));
        }
        for (r, nodes) in &self.users {
            if nodes.contains_key(node) {
                if let Some(object) = self.config.get(r) {
                    sends.push(out(node, "insert", r.resource(), object));
                }
            }
        }
        for ((ns, name), pod) in &self.pods {
            if pod.node.as_deref() == Some(node) && !pod.deleting {
                sends.push(out(node, "insert", pod_resource(ns, name), &pod.object()));
            }
        }
        sends
    }

    fn add_ref(&mut self, node: &str, r: &Ref, sends: &mut Vec<Outgoing>) {
        let count = self
            .users
            .entry(r.clone())
            .or_default()
            .entry(node.to_owned())
            .or_default();
        *count += 1;
        if *count == 1 {
            if let Some(object) = self.config.get(r) {
                sends.push(out(node, "insert", r.resource(), object));
            }
        }
    }

    fn drop_ref(&mut self, node: &str, r: &Ref, sends: &mut Vec<Outgoing>) {
        let Some(nodes) = self.users.get_mut(r) else {
            return;
        };
        let Some(count) = nodes.get_mut(node) else {
            return;
        };
        *count -= 1;
        if *count == 0 {
            nodes.remove(node);
            if nodes.is_empty() {
                self.users.remove(r);
            }
            let object = self.config.get(r).cloned().unwrap_or(Value::Null);
            sends.push(out(node, "delete", r.resource(), &object));
        }
    }

    /// A pod was added or changed.
    pub fn pod_applied(&mut self, pod: &Value) -> Vec<Outgoing> {
        let ns = meta_str(pod, "namespace");
        let name = meta_str(pod, "name");
        let key = (ns.clone(), name.clone());
        let bound = pod["spec"]["nodeName"].as_str();
        let node = bound
            .filter(|n| self.edge_nodes.contains_key(*n))
            .map(str::to_owned);
        let refs = if node.is_some() {
            pod_refs(pod)
        } else {
            BTreeSet::new()
        };
        let old = self.pods.remove(&key);
        let mut sends = Vec::new();
        let mut deleting = pod["metadata"]["deletionTimestamp"].is_string();
        let uid = meta_str(pod, "uid");
        // Moved, unbound, or replaced by a pod of the same name: the old one goes first.
        let mut fresh = true;
        if let Some(old) = &old {
            if old.node == node && old.uid == uid {
                fresh = false;
            } else if let Some(old_node) = &old.node {
                if !old.deleting {
                    sends.push(out(
                        old_node,
                        "delete",
                        pod_resource(&ns, &name),
                        &old.object(),
                    ));
                }
                for r in &old.refs {
                    self.drop_ref(old_node, r, &mut sends);
                }
            }
        }
        if let Some(node) = &node {
            let before: BTreeSet<Ref> = if fresh {
                BTreeSet::new()
            } else {
                old.as_ref()
                    .map(|o| o.refs.iter().cloned().collect())
                    .unwrap_or_default()
            };
            for r in refs.difference(&before) {
                self.add_ref(node, r, &mut sends);
            }
            let was_deleting = !fresh && old.as_ref().is_some_and(|o| o.deleting);
            if deleting {
                // The node stops it; edged reports it gone and we finish the deletion.
                if !was_deleting {
                    sends.push(out(node, "delete", pod_resource(&ns, &name), pod));
                }
            } else if fresh {
                sends.push(out(node, "insert", pod_resource(&ns, &name), pod));
            } else if old
                .as_ref()
                .is_some_and(|o| pod_shape(&o.object()) != pod_shape(pod))
            {
                sends.push(out(node, "update", pod_resource(&ns, &name), pod));
            }
            for r in before.difference(&refs) {
                self.drop_ref(node, r, &mut sends);
            }
            deleting = deleting || was_deleting;
        }
        let waiting_for = match (&node, bound) {
            (None, Some(bound)) => Some(bound.into()),
            _ => None,
        };
        self.pods.insert(
            key,
            PodEntry {
                node,
                uid,
                rv: rv_of(pod),
                waiting_for,
                // A `Value` always encodes; empty text would read back as `Null`.
                json: serde_json::to_string(pod).unwrap_or_default().into(),
                refs: refs.into_iter().collect(),
                deleting,
            },
        );
        sends
    }

    /// A pod is gone from the API.
    pub fn pod_deleted(&mut self, ns: &str, name: &str) -> Vec<Outgoing> {
        let mut sends = Vec::new();
        let Some(old) = self.pods.remove(&(ns.to_owned(), name.to_owned())) else {
            return sends;
        };
        if let Some(node) = &old.node {
            if !old.deleting {
                sends.push(out(node, "delete", pod_resource(ns, name), &old.object()));
            }
            for r in &old.refs {
                self.drop_ref(node, r, &mut sends);
            }
        }
        sends
    }

    /// A Node was added or changed; only nodes with [`EDGE_LABEL`] are edge nodes.
    pub fn node_applied(&mut self, node: &Value) -> Vec<Outgoing> {
        let name = meta_str(node, "name");
        let edge = node["metadata"]["labels"].get(EDGE_LABEL).is_some();
        if !edge {
            return self.node_deleted(&name);
        }
        let new = !self.edge_nodes.contains_key(&name);
        self.edge_nodes.insert(name.clone(), node.clone());
        let mut sends = vec![out(
            &name,
            "update",
            format!("{NULL_NAMESPACE}/node/{name}"),
            node,
        )];
        if new {
            // Pods bound before the node was known as an edge node.
            let waiting: Vec<Value> = self
                .pods
                .values()
                .filter(|p| p.node.is_none() && p.waiting_for.as_deref() == Some(name.as_str()))
                .map(PodEntry::object)
                .collect();
            for pod in waiting {
                sends.extend(self.pod_applied(&pod));
            }
        }
        sends
    }

    /// A Node is gone, or no longer an edge node: its pods are no longer routed anywhere.
    pub fn node_deleted(&mut self, name: &str) -> Vec<Outgoing> {
        if self.edge_nodes.remove(name).is_none() {
            return Vec::new();
        }
        let keys: Vec<(String, String)> = self
            .pods
            .iter()
            .filter(|(_, p)| p.node.as_deref() == Some(name))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            if let Some(pod) = self.pods.get_mut(&key) {
                // It waits for its Node to be an edge node again.
                pod.waiting_for = pod.node.take().map(Into::into);
                pod.refs = Box::default();
            }
        }
        self.users.retain(|_, nodes| {
            nodes.remove(name);
            !nodes.is_empty()
        });
        // Nothing is sent: the node is gone (its Node delete goes to it for KubeEdge parity).
        vec![Outgoing {
            node: name.to_owned(),
            operation: "delete",
            resource: format!("{NULL_NAMESPACE}/node/{name}"),
            content: Value::Null,
            rv: None,
            force: false,
        }]
    }

    /// A configmap (`kind` "configmap") or secret was added or changed.
    pub fn config_applied(&mut self, kind: &'static str, object: &Value) -> Vec<Outgoing> {
        let r = Ref {
            kind,
            namespace: meta_str(object, "namespace"),
            name: meta_str(object, "name"),
        };
        let existed = self.config.insert(r.clone(), object.clone()).is_some();
        // KubeEdge v1.3 sends secrets as `update` always; configmaps insert then update.
        let operation = if existed || kind == "secret" {
            "update"
        } else {
            "insert"
        };
        self.users
            .get(&r)
            .map(|nodes| {
                nodes
                    .keys()
                    .map(|n| out(n, operation, r.resource(), object))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A configmap or secret is gone.
    pub fn config_deleted(&mut self, kind: &'static str, ns: &str, name: &str) -> Vec<Outgoing> {
        let r = Ref {
            kind,
            namespace: ns.to_owned(),
            name: name.to_owned(),
        };
        let object = self.config.remove(&r).unwrap_or(Value::Null);
        self.users
            .get(&r)
            .map(|nodes| {
                nodes
                    .keys()
                    .map(|n| out(n, "delete", r.resource(), &object))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Names known of one kind, for a relist: what was not listed again is gone.
    pub fn known(&self, kind: &str) -> HashSet<(String, String)> {
        match kind {
            "pod" => self.pods.keys().cloned().collect(),
            "node" => self
                .edge_nodes
                .keys()
                .map(|n| (String::new(), n.clone()))
                .collect(),
            kind => self
                .config
                .keys()
                .filter(|r| r.kind == kind)
                .map(|r| (r.namespace.clone(), r.name.clone()))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn edge_node(name: &str) -> Value {
        json!({"metadata": {"name": name, "resourceVersion": "1", "labels": {EDGE_LABEL: ""}}})
    }

    fn pod(name: &str, node: &str, cm: &str, rv: u64) -> Value {
        json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                            "resourceVersion": rv.to_string()},
               "spec": {"nodeName": node, "containers": [{"name": "c"}],
                        "volumes": [{"name": "v", "configMap": {"name": cm}}]}})
    }

    fn cm(name: &str, rv: u64) -> Value {
        json!({"metadata": {"name": name, "namespace": "default", "resourceVersion": rv.to_string()},
               "data": {"k": "v"}})
    }

    fn ops(sends: &[Outgoing]) -> Vec<String> {
        sends
            .iter()
            .map(|s| format!("{} {} {}", s.node, s.operation, s.resource))
            .collect()
    }

    #[test]
    fn a_configmap_follows_its_pods_and_leaves_with_the_last_one() {
        let mut r = Routing::default();
        assert_eq!(
            ops(&r.node_applied(&edge_node("n1"))),
            ["n1 update null/node/n1"]
        );
        assert!(r.config_applied("configmap", &cm("app", 2)).is_empty());
        assert_eq!(
            ops(&r.pod_applied(&pod("a", "n1", "app", 3))),
            ["n1 insert default/configmap/app", "n1 insert default/pod/a"]
        );
        assert_eq!(
            ops(&r.pod_applied(&pod("b", "n1", "app", 4))),
            ["n1 insert default/pod/b"]
        );
        assert_eq!(
            ops(&r.config_applied("configmap", &cm("app", 5))),
            ["n1 update default/configmap/app"]
        );
        assert!(r
            .readable(
                "n1",
                &Ref {
                    kind: "configmap",
                    namespace: "default".into(),
                    name: "app".into()
                }
            )
            .is_ok());
        assert_eq!(
            ops(&r.pod_deleted("default", "a")),
            ["n1 delete default/pod/a"]
        );
        assert_eq!(
            ops(&r.pod_deleted("default", "b")),
            ["n1 delete default/pod/b", "n1 delete default/configmap/app"]
        );
        assert_eq!(
            r.readable(
                "n1",
                &Ref {
                    kind: "configmap",
                    namespace: "default".into(),
                    name: "app".into()
                }
            ),
            Err(false)
        );
    }

    #[test]
    fn status_only_changes_stay_up_and_a_deletion_timestamp_goes_down_as_delete() {
        let mut r = Routing::default();
        r.node_applied(&edge_node("n1"));
        r.pod_applied(&pod("a", "n1", "app", 3));
        let mut running = pod("a", "n1", "app", 4);
        running["status"] = json!({"phase": "Running"});
        assert!(r.pod_applied(&running).is_empty());
        let mut deleting = running.clone();
        deleting["metadata"]["deletionTimestamp"] = json!("2026-11-25T15:00:00Z");
        deleting["metadata"]["resourceVersion"] = json!("5");
        assert_eq!(ops(&r.pod_applied(&deleting)), ["n1 delete default/pod/a"]);
        assert!(r.pod_applied(&deleting).is_empty());
        // Gone from the API: the node stopped it already; only its configmap goes.
        assert_eq!(
            ops(&r.pod_deleted("default", "a")),
            ["n1 delete default/configmap/app"]
        );
    }

    #[test]
    fn pods_wait_for_their_node_to_be_an_edge_node_and_move_between_nodes() {
        let mut r = Routing::default();
        assert!(r.pod_applied(&pod("a", "n1", "app", 3)).is_empty());
        r.config_applied("configmap", &cm("app", 2));
        assert_eq!(
            ops(&r.node_applied(&edge_node("n1"))),
            [
                "n1 update null/node/n1",
                "n1 insert default/configmap/app",
                "n1 insert default/pod/a"
            ]
        );
        r.node_applied(&edge_node("n2"));
        let mut moved = pod("a", "n2", "app", 6);
        moved["metadata"]["uid"] = json!("uid-a2");
        assert_eq!(
            ops(&r.pod_applied(&moved)),
            [
                "n1 delete default/pod/a",
                "n1 delete default/configmap/app",
                "n2 insert default/configmap/app",
                "n2 insert default/pod/a"
            ]
        );
        assert_eq!(r.desired("n2").len(), 3);
    }
}
