//! What each node acknowledged, kept in Kubernetes so a restarted controller sends a node only
//! what it lacks (KubeEdge keeps an ObjectSync object per node and object for the same end).
//! One ConfigMap per node, `edgemeta-acked-<node>` in [`NAMESPACE`], labelled [`LABEL`], whose
//! `node` key names the node and `acked` holds `{"<ns>/<type>/<name>": [resourceVersion,
//! shape]}` (`delivery::shape`: a newer version that differs only in its status is not sent
//! either): one write per node covers every ack of the last second, where ObjectSyncs cost one
//! write per ack.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::Client;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Where the ConfigMaps live: KubeEdge's own namespace.
pub const NAMESPACE: &str = "kubeedge";
/// The label that marks them, so they are listed at start without the rest.
pub const LABEL: &str = "edgemeta.io/acked-by";
/// How often the nodes whose acks changed are written.
pub const SAVE_EVERY: Duration = Duration::from_secs(1);

pub use crate::delivery::Acked;

fn name(node: &str) -> String {
    format!("edgemeta-acked-{node}")
}

/// Every node's acked versions as last saved; an unreadable store gives none (the controller
/// then resends, as it would without it).
pub async fn load(client: &Client) -> HashMap<String, Acked> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), NAMESPACE);
    let list = match api.list(&ListParams::default().labels(LABEL)).await {
        Ok(list) => list,
        Err(e) => {
            warn!(error_code = "EM-EC-ACKED", error = %e, "acked versions not loaded; nodes get everything again");
            return HashMap::new();
        }
    };
    let mut out = HashMap::new();
    for cm in list.items {
        let data = cm.data.unwrap_or_default();
        let node = data.get("node").cloned();
        let acked = data
            .get("acked")
            .and_then(|text| serde_json::from_str::<Acked>(text).ok());
        if let (Some(node), Some(acked)) = (node, acked) {
            out.insert(node, acked);
        }
    }
    info!(nodes = out.len(), "acked versions loaded");
    out
}

/// Writes the snapshots it is sent, the newest per node, one node at a time; a failed write
/// is logged and left to the node's next change.
pub async fn save(
    client: Client,
    mut rx: mpsc::Receiver<Vec<(String, Acked)>>,
    cancel: CancellationToken,
) {
    let api: Api<ConfigMap> = Api::namespaced(client, NAMESPACE);
    let mut waiting: BTreeMap<String, Acked> = BTreeMap::new();
    loop {
        if waiting.is_empty() {
            tokio::select! {
                () = cancel.cancelled() => return,
                batch = rx.recv() => match batch {
                    Some(batch) => waiting.extend(batch),
                    None => return,
                },
            }
        }
        while let Ok(batch) = rx.try_recv() {
            waiting.extend(batch);
        }
        let Some((node, acked)) = waiting.pop_first() else {
            continue;
        };
        if let Err(e) = write(&api, &node, &acked).await {
            warn!(error_code = "EM-EC-ACKED", node, error = %e, "acked versions not saved");
        }
    }
}

async fn write(api: &Api<ConfigMap>, node: &str, acked: &Acked) -> Result<(), kube::Error> {
    let text = serde_json::to_string(acked).unwrap_or_else(|_| "{}".to_owned());
    let patch = json!({"data": {"acked": text}});
    match api
        .patch(&name(node), &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 404 => {
            let cm: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": name(node), "namespace": NAMESPACE,
                             "labels": {LABEL: "edgecontroller"}},
                "data": {"node": node, "acked": text},
            }))
            .expect("a ConfigMap literal");
            api.create(&PostParams::default(), &cm).await.map(drop)
        }
        other => other.map(drop),
    }
}
