//! Watches of Devices and DeviceModels (`devices.kubeedge.io/v1beta1`, through kube-rs'
//! dynamic API: no generated types). Each object is cut down to what the controller keeps in
//! the watch task, so the owner task never holds a Device's JSON.

use futures_util::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::state::{DeviceSpec, Key, ModelSpec, Property};
use super::Event;

/// KubeEdge's device API group and the version served.
pub const GROUP: &str = "devices.kubeedge.io";
pub const VERSION: &str = "v1beta1";

/// The API resource of `kind` (`Device`) under `plural` (`devices`).
pub fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

/// A watch event, the object already cut down.
#[derive(Debug)]
pub enum Change<T> {
    Apply(T),
    Delete(Key),
    Init,
    InitApply(T),
    InitDone,
}

fn key(o: &DynamicObject) -> Key {
    (
        o.metadata.namespace.clone().unwrap_or_default(),
        o.metadata.name.clone().unwrap_or_default(),
    )
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
    }
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
    }
}

/// Runs a watch of `resource` until cancelled, handing each event over cut down by `cut` and
/// wrapped by `wrap`. Errors are retried with kube-rs' default back-off.
pub fn spawn<T: Send + 'static>(
    client: Client,
    resource: ApiResource,
    cut: fn(&DynamicObject) -> T,
    wrap: fn(Change<T>) -> Event,
    tx: mpsc::Sender<Event>,
    cancel: CancellationToken,
) {
    tokio::spawn(async move {
        let api: Api<DynamicObject> = Api::all_with(client, &resource);
        let stream = watcher::watcher(api, watcher::Config::default()).default_backoff();
        futures_util::pin_mut!(stream);
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                event = stream.next() => event,
            };
            let change = match event {
                None => return,
                Some(Err(e)) => {
                    warn!(error_code = "EM-EC-WATCH", kind = %resource.kind, error = %e, "watch failed; retrying");
                    continue;
                }
                Some(Ok(watcher::Event::Apply(o))) => Change::Apply(cut(&o)),
                Some(Ok(watcher::Event::Delete(o))) => Change::Delete(key(&o)),
                Some(Ok(watcher::Event::Init)) => Change::Init,
                Some(Ok(watcher::Event::InitApply(o))) => Change::InitApply(cut(&o)),
                Some(Ok(watcher::Event::InitDone)) => Change::InitDone,
            };
            if tx.send(wrap(change)).await.is_err() {
                return;
            }
        }
    });
}
