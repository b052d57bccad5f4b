//! The object store: one resourceVersion counter for everything (etcd's revision), the objects,
//! and a bounded history of changes that watches replay from (older versions answer 410).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;
use tokio::sync::broadcast;

use crate::crd::{self, Crds};
use crate::kinds::Kind;
use crate::Error;

/// `(resource, namespace, name)`; cluster-scoped objects have namespace "".
pub type Key = (String, String, String);

/// One committed change, as watches see it.
#[derive(Debug, Clone)]
pub struct Change {
    pub rv: u64,
    pub resource: String,
    pub namespace: String,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub kind: &'static str,
    pub object: Value,
}

/// The store's state; callers hold the server's lock around every call.
#[derive(Debug)]
pub struct Store {
    rv: u64,
    objects: BTreeMap<Key, Value>,
    history: VecDeque<Arc<Change>>,
    /// Watches may resume from any version at or above this one.
    floor: u64,
    window: usize,
    changes: broadcast::Sender<Arc<Change>>,
    /// Writes that changed something, per resource (`pods/status` for status writes).
    pub writes: BTreeMap<String, u64>,
    /// The custom kinds the stored CRDs serve.
    pub crds: Crds,
}

/// Now, as the API server writes times (`2026-11-25T14:00:00Z`).
pub fn now() -> String {
    let now = OffsetDateTime::now_utc()
        .replace_nanosecond(0)
        .unwrap_or_else(|_| OffsetDateTime::now_utc());
    now.format(&Rfc3339).unwrap_or_default()
}

/// `seconds` from now, in the same format.
pub fn later(seconds: i64) -> String {
    let at = OffsetDateTime::now_utc() + time::Duration::seconds(seconds);
    at.replace_nanosecond(0)
        .unwrap_or(at)
        .format(&Rfc3339)
        .unwrap_or_default()
}

fn meta_str<'a>(object: &'a Value, field: &str) -> Option<&'a str> {
    object["metadata"][field].as_str()
}

/// A stored object as the API returns it: with `apiVersion` and `kind`.
fn typed(kind: &Kind, mut object: Value) -> Value {
    object["apiVersion"] = json!(kind.api_version());
    object["kind"] = json!(kind.kind);
    object
}

/// Whether two versions of an object differ outside the fields the server maintains.
fn same_content(a: &Value, b: &Value) -> bool {
    let strip = |v: &Value| {
        let mut v = v.clone();
        if let Some(meta) = v["metadata"].as_object_mut() {
            meta.remove("resourceVersion");
            meta.remove("managedFields");
            meta.remove("generation");
        }
        v
    };
    strip(a) == strip(b)
}

impl Store {
    /// An empty store whose history keeps the last `window` changes.
    pub fn new(window: usize) -> Store {
        let (changes, _) = broadcast::channel(16_384);
        Store {
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            floor: 1,
            window: window.max(1),
            changes,
            writes: BTreeMap::new(),
            crds: Crds::default(),
        }
    }

    /// The newest resourceVersion.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// The oldest resourceVersion a watch may still start from.
    pub fn floor(&self) -> u64 {
        self.floor
    }

    /// A receiver of every change committed after this call.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Change>> {
        self.changes.subscribe()
    }

    /// Changes after `rv` still in the history, oldest first.
    pub fn since(&self, rv: u64) -> Vec<Arc<Change>> {
        self.history.iter().filter(|c| c.rv > rv).cloned().collect()
    }

    /// Forgets the history: every watch from a version before now gets 410 Expired.
    pub fn compact(&mut self) {
        self.history.clear();
        self.floor = self.rv;
    }

    fn commit(&mut self, kind: &Kind, namespace: &str, event: &'static str, object: Value) {
        if *kind == crd::CRD {
            self.crds.changed(event, &object);
        }
        let change = Arc::new(Change {
            rv: self.rv,
            resource: kind.resource(),
            namespace: namespace.to_owned(),
            kind: event,
            object,
        });
        self.history.push_back(change.clone());
        while self.history.len() > self.window {
            if let Some(old) = self.history.pop_front() {
                self.floor = old.rv;
            }
        }
        let _ = self.changes.send(change);
    }

    fn count(&mut self, what: String) {
        *self.writes.entry(what).or_default() += 1;
    }

    fn next_rv(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    /// The stored object (without `apiVersion` and `kind`) and its key.
    fn stored(&self, kind: &Kind, namespace: &str, name: &str) -> Result<(Key, Value), Error> {
        let key = (kind.resource(), namespace.to_owned(), name.to_owned());
        match self.objects.get(&key).cloned() {
            Some(object) => Ok((key, object)),
            None => Err(Error::not_found(kind, name)),
        }
    }

    /// The object, with `apiVersion` and `kind`.
    pub fn get(&self, kind: &Kind, namespace: &str, name: &str) -> Result<Value, Error> {
        self.objects
            .get(&(kind.resource(), namespace.to_owned(), name.to_owned()))
            .map(|o| typed(kind, o.clone()))
            .ok_or_else(|| Error::not_found(kind, name))
    }

    /// Every object of `kind` in `namespace` (all namespaces when `None`), in key order, from
    /// after `after` (a `(namespace, name)` continue point).
    pub fn list(
        &self,
        kind: &Kind,
        namespace: Option<&str>,
        after: Option<(&str, &str)>,
    ) -> Vec<(String, String, Value)> {
        let resource = kind.resource();
        self.objects
            .iter()
            .filter(|((r, ns, _), _)| *r == resource && namespace.is_none_or(|n| n == ns))
            .filter(|((_, ns, name), _)| {
                after.is_none_or(|(a_ns, a_name)| (ns.as_str(), name.as_str()) > (a_ns, a_name))
            })
            .map(|((_, ns, name), v)| (ns.clone(), name.clone(), v.clone()))
            .collect()
    }

    /// Creates `object` (the server fills uid, times, version); the stored object.
    pub fn create(
        &mut self,
        kind: &Kind,
        namespace: &str,
        mut object: Value,
    ) -> Result<Value, Error> {
        if !object["metadata"].is_object() {
            object["metadata"] = json!({});
        }
        let name = match meta_str(&object, "name") {
            Some(name) if !name.is_empty() => name.to_owned(),
            _ => match meta_str(&object, "generateName") {
                Some(prefix) => {
                    let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_owned();
                    format!("{prefix}{suffix}")
                }
                None => {
                    return Err(Error::Invalid(format!(
                        "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                        kind.kind
                    )))
                }
            },
        };
        if let Some(ns) = meta_str(&object, "namespace") {
            if kind.namespaced && ns != namespace {
                return Err(Error::BadRequest(format!(
                    "the namespace of the provided object ({ns}) does not match the namespace sent on the request ({namespace})"
                )));
            }
        }
        let key = (kind.resource(), namespace.to_owned(), name.clone());
        if self.objects.contains_key(&key) {
            return Err(Error::AlreadyExists {
                kind: kind.kind,
                plural: kind.plural,
                group: kind.group,
                name,
            });
        }
        let rv = self.next_rv();
        object["metadata"]["name"] = json!(name);
        if kind.namespaced {
            object["metadata"]["namespace"] = json!(namespace);
        } else if let Some(meta) = object["metadata"].as_object_mut() {
            meta.remove("namespace");
        }
        object["metadata"]["uid"] = json!(uuid::Uuid::new_v4().to_string());
        object["metadata"]["creationTimestamp"] = json!(now());
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        object["metadata"]["generation"] = json!(1);
        for field in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
        ] {
            if let Some(meta) = object["metadata"].as_object_mut() {
                meta.remove(field);
            }
        }
        if kind.plural == "pods" && !object["status"].is_object() {
            object["status"] = json!({"phase": "Pending", "qosClass": "BestEffort"});
        }
        if kind.plural == "namespaces" && !object["status"].is_object() {
            object["status"] = json!({"phase": "Active"});
        }
        if *kind == crd::CRD {
            crd::establish(&mut object, &now());
        }
        let object = typed(kind, object);
        self.objects.insert(key, object.clone());
        self.count(kind.resource());
        self.commit(kind, namespace, "ADDED", object.clone());
        Ok(object)
    }

    /// Replaces the object (`status_only`: only its status; otherwise everything but its
    /// status, for kinds with a status subresource). A `metadata.resourceVersion` in `object`
    /// must be the stored one. A write that changes nothing keeps the version.
    pub fn update(
        &mut self,
        kind: &Kind,
        namespace: &str,
        name: &str,
        object: Value,
        status_only: bool,
    ) -> Result<Value, Error> {
        let (key, old) = self.stored(kind, namespace, name)?;
        if let Some(rv) = meta_str(&object, "resourceVersion") {
            if !rv.is_empty() && Some(rv) != meta_str(&old, "resourceVersion") {
                return Err(Error::Conflict(format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                    kind.resource()
                )));
            }
        }
        if let Some(uid) = meta_str(&object, "uid") {
            if Some(uid) != meta_str(&old, "uid") {
                return Err(Error::Conflict(format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or_default()
                )));
            }
        }
        let mut new = if status_only {
            let mut new = old.clone();
            new["status"] = object["status"].clone();
            new
        } else {
            let mut new = object;
            if !new["metadata"].is_object() {
                new["metadata"] = json!({});
            }
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "name",
                "namespace",
                "generation",
            ] {
                match old["metadata"].get(field) {
                    Some(v) => new["metadata"][field] = v.clone(),
                    None => {
                        if let Some(meta) = new["metadata"].as_object_mut() {
                            meta.remove(field);
                        }
                    }
                }
            }
            if kind.status {
                new["status"] = old["status"].clone();
            }
            if new["spec"] != old["spec"] {
                let generation = old["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                new["metadata"]["generation"] = json!(generation);
            }
            new
        };
        new = typed(kind, new);
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
        if same_content(&new, &old) {
            return Ok(old);
        }
        let rv = self.next_rv();
        new["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.objects.insert(key, new.clone());
        self.count(if status_only {
            format!("{}/status", kind.resource())
        } else {
            kind.resource()
        });
        self.commit(kind, namespace, "MODIFIED", new.clone());
        Ok(new)
    }

    /// Deletes the object. A pod bound to a node with a grace period other than 0 is only
    /// marked (`deletionTimestamp`), as the API server does: its node finishes the deletion.
    pub fn delete(
        &mut self,
        kind: &Kind,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
        uid: Option<&str>,
        rv_precondition: Option<&str>,
    ) -> Result<Value, Error> {
        let (key, old) = self.stored(kind, namespace, name)?;
        if let Some(uid) = uid {
            if Some(uid) != meta_str(&old, "uid") {
                return Err(Error::Conflict(format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or_default()
                )));
            }
        }
        if let Some(rv) = rv_precondition {
            if Some(rv) != meta_str(&old, "resourceVersion") {
                return Err(Error::Conflict(format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion").unwrap_or_default()
                )));
            }
        }
        let bound = old["spec"]["nodeName"]
            .as_str()
            .is_some_and(|n| !n.is_empty());
        let grace = grace.unwrap_or_else(|| {
            old["spec"]["terminationGracePeriodSeconds"]
                .as_i64()
                .unwrap_or(30)
        });
        if kind.plural == "pods" && bound && grace > 0 {
            let current = old["metadata"]["deletionGracePeriodSeconds"].as_i64();
            if current.is_some_and(|c| c <= grace) {
                return Ok(old);
            }
            let mut new = old;
            new["metadata"]["deletionTimestamp"] = json!(later(grace));
            new["metadata"]["deletionGracePeriodSeconds"] = json!(grace);
            let rv = self.next_rv();
            new["metadata"]["resourceVersion"] = json!(rv.to_string());
            self.objects.insert(key, new.clone());
            self.count(format!("{}/graceful-delete", kind.resource()));
            self.commit(kind, namespace, "MODIFIED", new.clone());
            return Ok(new);
        }
        self.objects.remove(&key);
        let rv = self.next_rv();
        let mut gone = old;
        gone["metadata"]["resourceVersion"] = json!(rv.to_string());
        self.count(format!("{}/delete", kind.resource()));
        self.commit(kind, namespace, "DELETED", gone.clone());
        Ok(gone)
    }
}

/// RFC 7386 JSON merge patch (strategic merge patches are applied the same way: for the maps
/// `kubectl apply` changes, the two agree; lists are replaced whole).
pub fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(fields) => {
            if !target.is_object() {
                *target = json!({});
            }
            for (k, v) in fields {
                if v.is_null() {
                    if let Some(map) = target.as_object_mut() {
                        map.remove(k);
                    }
                } else {
                    merge_patch(&mut target[k], v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::KINDS;

    fn pods() -> &'static Kind {
        &KINDS[0]
    }

    #[test]
    fn versions_are_one_counter_and_no_op_writes_keep_them() {
        let mut store = Store::new(100);
        let a = store
            .create(
                pods(),
                "default",
                json!({"metadata": {"name": "a"}, "spec": {}}),
            )
            .expect("create");
        assert_eq!(a["metadata"]["resourceVersion"], "2");
        assert_eq!(a["status"]["phase"], "Pending");
        let same = store
            .update(pods(), "default", "a", a.clone(), true)
            .expect("no-op");
        assert_eq!(same["metadata"]["resourceVersion"], "2");
        let mut running = a.clone();
        running["status"]["phase"] = json!("Running");
        let b = store
            .update(pods(), "default", "a", running, true)
            .expect("status");
        assert_eq!(b["metadata"]["resourceVersion"], "3");
        // A stale version is a conflict.
        let mut stale = a;
        stale["spec"] = json!({"x": 1});
        assert!(matches!(
            store.update(pods(), "default", "a", stale, false),
            Err(Error::Conflict(_))
        ));
    }

    #[test]
    fn a_bound_pod_is_marked_then_removed_by_a_grace_zero_delete() {
        let mut store = Store::new(100);
        let pod = store
            .create(
                pods(),
                "default",
                json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n"}}),
            )
            .expect("create");
        let marked = store
            .delete(pods(), "default", "p", None, None, None)
            .expect("graceful");
        assert_eq!(marked["metadata"]["deletionGracePeriodSeconds"], 30);
        assert!(store.get(pods(), "default", "p").is_ok());
        assert!(matches!(
            store.delete(pods(), "default", "p", Some(0), Some("other"), None),
            Err(Error::Conflict(_))
        ));
        let uid = pod["metadata"]["uid"].as_str().expect("uid");
        store
            .delete(pods(), "default", "p", Some(0), Some(uid), None)
            .expect("delete");
        assert!(store.get(pods(), "default", "p").is_err());
        let kinds: Vec<&str> = store.since(0).iter().map(|c| c.kind).collect();
        assert_eq!(kinds, ["ADDED", "MODIFIED", "DELETED"]);
    }

    #[test]
    fn history_beyond_the_window_moves_the_floor() {
        let mut store = Store::new(2);
        for i in 0..5 {
            store
                .create(
                    pods(),
                    "default",
                    json!({"metadata": {"name": format!("p{i}")}}),
                )
                .expect("create");
        }
        assert_eq!(store.since(0).len(), 2);
        assert_eq!(store.floor(), 4);
        store.compact();
        assert_eq!(store.floor(), store.rv());
    }

    #[test]
    fn merge_patch_removes_nulls_and_replaces_lists() {
        let mut doc = json!({"data": {"a": "1", "b": "2"}, "list": [1, 2]});
        merge_patch(
            &mut doc,
            &json!({"data": {"a": null, "c": "3"}, "list": [3]}),
        );
        assert_eq!(doc, json!({"data": {"b": "2", "c": "3"}, "list": [3]}));
    }
}
