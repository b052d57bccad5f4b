//! Devices and DeviceModels (`devices.kubeedge.io/v1beta1`, through kube-rs' dynamic API: no
//! generated types) as the watches hand them over: each object cut down to what the controller
//! keeps, in the watch task, so the owner task never holds a Device's JSON.

use std::sync::Arc;

use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::{json, Value};

use super::state::{DeviceSpec, ModelSpec, Property};
use crate::watch::key;

/// KubeEdge's device API group and the version served.
pub const GROUP: &str = "devices.kubeedge.io";
pub const VERSION: &str = "v1beta1";

/// The API resource of `kind` (`Device`) under `plural` (`devices`).
pub fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

fn text(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty()).map(str::to_owned)
}

/// A Device as the controller keeps it.
pub fn device(o: &DynamicObject) -> DeviceSpec {
    let (namespace, name) = key(o);
    let spec = &o.data["spec"];
    let properties = spec["properties"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some(Property {
                name: text(&p["name"])?,
                desired: text(&p["desired"]["value"]),
            })
        })
        .collect();
    DeviceSpec {
        namespace,
        name,
        uid: o.metadata.uid.clone().unwrap_or_default(),
        rv: o
            .metadata
            .resource_version
            .as_deref()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0),
        node: text(&spec["nodeName"]),
        model: text(&spec["deviceModelRef"]["name"]).unwrap_or_default(),
        description: o
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("description"))
            .cloned()
            .unwrap_or_default(),
        properties,
        object: Some(Arc::new(object_of(o))),
    }
}

/// What a node stores of a Device or DeviceModel for DMI mappers: its identity and `spec`
/// (not its status, managed fields or annotations, which mappers never read).
fn object_of(o: &DynamicObject) -> Value {
    let meta = &o.metadata;
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": o.types.as_ref().map(|t| t.kind.clone()).unwrap_or_default(),
        "metadata": {
            "name": meta.name,
            "namespace": meta.namespace,
            "uid": meta.uid,
            "resourceVersion": meta.resource_version,
        },
        "spec": o.data["spec"],
    })
}

/// A DeviceModel as the controller keeps it.
pub fn model(o: &DynamicObject) -> ModelSpec {
    let (namespace, name) = key(o);
    let types = o.data["spec"]["properties"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((text(&p["name"])?, text(&p["type"]).unwrap_or_default())))
        .collect();
    ModelSpec {
        namespace,
        name,
        types,
        object: Some(Arc::new(object_of(o))),
    }
}
