//! One watch loop for every kind the controller follows (pods, Nodes, configmaps, secrets,
//! Devices, DeviceModels): kube-rs' `watcher` with its default back-off (relisting after a
//! 410), each object cut down in the watch task to what the owner task keeps.

use futures_util::StreamExt;
use kube::api::Api;
use kube::runtime::{watcher, WatchStreamExt};
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
pub type Key = (String, String);

/// A watch event, the object already cut down; a deletion needs only the key.
#[derive(Debug)]
pub enum Change<T> {
    Apply(T),
    Delete(Key),
    Init,
    InitApply(T),
    InitDone,
}

/// The key of `o`.
pub fn key<K: Resource>(o: &K) -> Key {
    let meta = o.meta();
    (
        meta.namespace.clone().unwrap_or_default(),
        meta.name.clone().unwrap_or_default(),
    )
}

/// Runs a watch of `api` until cancelled, handing each event over cut down by `cut` and
/// wrapped by `wrap`; `kind` names it in logs. Errors are logged and retried.
pub fn spawn<K, T, M, W>(
    api: Api<K>,
    config: watcher::Config,
    kind: &'static str,
    cut: fn(&K) -> T,
    wrap: W,
    tx: mpsc::Sender<M>,
    cancel: CancellationToken,
) where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
    T: Send + 'static,
    M: Send + 'static,
    W: Fn(Change<T>) -> M + Send + 'static,
{
    tokio::spawn(async move {
        let stream = watcher::watcher(api, config).default_backoff();
        futures_util::pin_mut!(stream);
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                event = stream.next() => event,
            };
            let change = match event {
                None => return,
                Some(Err(e)) => {
                    warn!(error_code = "EM-EC-WATCH", kind, error = %e, "watch failed; retrying");
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
