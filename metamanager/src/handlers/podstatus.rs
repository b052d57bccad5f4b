//! The pod-status sync (§3.8): every pod status to the cloud, one message per namespace.

use std::collections::BTreeMap;

use serde_json::value::RawValue;
use tracing::info;

use crate::error::Error;
use crate::unit::Context;
use edgemeta_protocol::Operation;
use edgemeta_protocol::{raw, Envelope, Route};
use edgemeta_protocol::{CLOUD, META};

/// §3.8: sends every pod status to the cloud, one message per namespace, and drops statuses
/// whose pod is gone. (KubeEdge took the namespace of the first row for all of them.)
pub(crate) async fn apply(cx: &mut Context<'_>) -> Result<(), Error> {
    let rows = cx
        .db()
        .rows_by_type("podstatus")
        .await
        .map_err(Error::store("query meta"))?;
    let mut by_namespace: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (key, value) in rows {
        let namespace = key.split('/').next().unwrap_or_default().to_owned();
        let statuses = by_namespace.entry(namespace).or_default();
        let pod_key = key.replacen("/podstatus/", "/pod/", 1);
        let pod = cx
            .db()
            .get(&pod_key)
            .await
            .map_err(Error::store("query meta"))?;
        if pod.is_none() {
            cx.db()
                .delete(&key)
                .await
                .map_err(Error::store("delete meta"))?;
            info!(%key, "removed pod status of a pod that is gone");
            continue;
        }
        if serde_json::from_str::<&RawValue>(&value).is_ok() {
            statuses.push(value);
        }
    }
    for (namespace, statuses) in by_namespace {
        let route = Route {
            source: META.to_owned(),
            group: "resource".to_owned(),
            operation: Operation::Update.as_str().to_owned(),
            resource: format!("{namespace}/podstatus"),
        };
        let content = raw(&format!("[{}]", statuses.join(",")));
        cx.send(CLOUD, META, &Envelope::new(route, content)).await?;
    }
    Ok(())
}
