//! The `<root>/meta/...` operations the [`crate::routing`] table (`RULES`) describes: store,
//! forward and answer as each row says.

use serde::Deserialize;
use serde_json::value::RawValue;
use tracing::debug;

use crate::error::Error;
use crate::request::Request;
use crate::routing::{self, Reply, Rule, Store, When};
use crate::store::{Applied, Db};
use crate::unit::Context;
use edgemeta_protocol::Resource;
use edgemeta_protocol::{json_string, null};
use edgemeta_protocol::{Operation, CLOUD_SOURCES};

/// Applies `request` as the first matching row of the table says.
pub(crate) async fn apply(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let resource = &request.resource;
    let content = request.envelope.content.get();
    let candidates = routing::candidates(
        request.operation,
        &request.requester.from,
        resource.res_type(),
    );
    for rule in candidates {
        if rule.when == When::StoredValueUnchanged {
            let stored = cx
                .db()
                .get(resource.key())
                .await
                .map_err(Error::store("query meta"))?;
            if stored.as_deref() != Some(content) {
                continue;
            }
            debug!(resource = %resource, "podstatus unchanged");
        }
        return run_rule(rule, request, cx).await;
    }
    // Every table operation ends in a catch-all row (checked by a unit test).
    Err(Error::UnsupportedOperation(request.operation.to_string()))
}

async fn run_rule(rule: &Rule, request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let resource = &request.resource;
    let content = &request.envelope.content;
    let cloud_change = cloud_change(rule, request);
    if let Some(change) = &cloud_change {
        // A stored object's change is remembered by the upsert that stores it; a delete's or
        // a list's in `cloud_applied`.
        let new = if rule.store == Store::Upsert {
            let insert = request.operation == Operation::Insert;
            cx.db()
                .upsert_cloud_change(
                    resource.key(),
                    resource.res_type(),
                    content.get(),
                    change,
                    insert,
                )
                .await
                .map_err(Error::store("insert or update meta"))?
        } else {
            cx.db()
                .claim_cloud_change(resource.key(), change)
                .await
                .map_err(Error::store("write cloud_applied"))?
        };
        if !new {
            // Delivered again (a new session, a resend) or overtaken by a newer version:
            // acknowledged again, neither stored nor handed on again (protocol §6.4).
            debug!(resource = %resource, msg_id = %change.msg_id, "cloud change already applied");
            return reply(rule, request, cx).await;
        }
    }
    match rule.store {
        Store::Nothing => {}
        Store::Upsert if cloud_change.is_some() => {}
        Store::Upsert => upsert(cx.db(), resource, content.get()).await?,
        Store::UpsertUnlessAck => {
            if request.envelope.content_str().as_deref() != Some("OK") {
                upsert(cx.db(), resource, content.get()).await?;
            }
        }
        Store::UpsertItems(item_type) => {
            for (item, value) in list_items(resource, item_type, content)? {
                upsert(cx.db(), &item, value.get()).await?;
            }
        }
        Store::Delete => {
            cx.db()
                .delete(resource.key())
                .await
                .map_err(Error::store("delete meta"))?;
        }
    }
    if let (None, Store::Delete) = (&cloud_change, rule.store) {
        // edged removed it on its own: the cloud's next copy of that version is news again.
        cx.db()
            .forget_cloud_applied(resource.key())
            .await
            .map_err(Error::store("write cloud_applied"))?;
    }
    if let Some(forward) = rule.forward {
        cx.send(forward.module(), &request.requester.from, &request.envelope)
            .await?;
    }
    reply(rule, request, cx).await
}

/// A change from the cloud that writes the store, as [`Applied`] would remember it once applied.
fn cloud_change(rule: &Rule, request: &Request) -> Option<Applied> {
    let writes = matches!(
        rule.store,
        Store::Upsert | Store::UpsertItems(_) | Store::Delete
    );
    let operation = matches!(
        request.operation,
        Operation::Insert | Operation::Update | Operation::Delete
    );
    if !writes || !operation || !CLOUD_SOURCES.contains(&request.requester.from.as_str()) {
        return None;
    }
    let header = &request.envelope.header;
    Some(Applied {
        rv: header
            .resourceversion
            .as_deref()
            .and_then(|rv| rv.parse().ok()),
        msg_id: header.msg_id.clone(),
        deleted: rule.store == Store::Delete,
    })
}

async fn reply(rule: &Rule, request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    match rule.reply {
        Reply::Nothing => Ok(()),
        Reply::Ok => {
            cx.reply(&request.requester, Operation::Response, || {
                json_string("OK")
            })
            .await
        }
        Reply::Null => {
            cx.reply(&request.requester, Operation::Response, null)
                .await
        }
    }
}

pub(crate) async fn upsert(db: &Db, resource: &Resource, value: &str) -> Result<(), Error> {
    db.upsert(resource.key(), resource.res_type(), value)
        .await
        .map_err(Error::store("insert or update meta"))
}

/// Splits a `servicelist`/`endpointslist` into `(<ns>/<item_type>/<name>, item)` pairs.
fn list_items(
    list: &Resource,
    item_type: &'static str,
    content: &RawValue,
) -> Result<Vec<(Resource, Box<RawValue>)>, Error> {
    #[derive(Deserialize)]
    struct Item {
        metadata: Metadata,
    }
    #[derive(Deserialize)]
    struct Metadata {
        name: String,
        #[serde(default)]
        namespace: String,
    }
    let bad = |reason: String| Error::Content {
        what: "list",
        reason,
    };
    let items: Vec<Box<RawValue>> = serde_json::from_str(content.get())
        .map_err(|e| bad(format!("{} is not an array: {e}", list.res_type())))?;
    items
        .into_iter()
        .map(|raw_item| {
            let item: Item = serde_json::from_str(raw_item.get())
                .map_err(|e| bad(format!("item without metadata.name: {e}")))?;
            let namespace = if item.metadata.namespace.is_empty() {
                list.namespace()
            } else {
                &item.metadata.namespace
            };
            let key = Resource::from_parts(namespace, item_type, &item.metadata.name)
                .map_err(|e| bad(e.to_string()))?;
            Ok((key, raw_item))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use edgemeta_protocol::raw;

    #[test]
    fn list_items_are_keyed_by_their_own_namespace_and_name() {
        let list = Resource::parse("namespace/servicelist/service").unwrap();
        let content =
            raw(r#"[{"metadata":{"name":"a","namespace":"ns1"}},{"metadata":{"name":"b"}}]"#);
        let items = list_items(&list, "service", &content).unwrap();
        let keys: Vec<_> = items.iter().map(|(k, _)| k.key().to_owned()).collect();
        assert_eq!(keys, ["ns1/service/a", "namespace/service/b"]);
        assert_eq!(
            items[0].1.get(),
            r#"{"metadata":{"name":"a","namespace":"ns1"}}"#
        );
    }

    #[test]
    fn a_list_that_is_not_an_array_of_named_items_is_refused() {
        let list = Resource::parse("namespace/servicelist/service").unwrap();
        for bad in [
            r#"{"a":1}"#,
            r#"[{"spec":{}}]"#,
            r#"[{"metadata":{"name":"x/y"}}]"#,
            "\"x\"",
        ] {
            assert!(list_items(&list, "service", &raw(bad)).is_err(), "{bad}");
        }
    }
}
