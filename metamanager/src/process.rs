//! What each operation does to the store and whom it tells: runs on the store worker, inside
//! the message's savepoint, and returns the local messages to publish once the batch commits.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use edgemeta_broker::Message;
use edgemeta_protocol::{json_string, new_msg_id, null, raw, Envelope, Route};
use edgemeta_protocol::{outbound, Operation, Resource, CLOUD, META};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio_util::time::{delay_queue, DelayQueue};
use tracing::{debug, info, warn};

use crate::error::Error;
use crate::outbox::{self, OutboxLimit};
use crate::request::{Request, Requester};
use crate::routing::{self, Forward, Reply, Rule, Special, Store, When};
use crate::store::{Db, OutboxStats};

/// State the MetaManager keeps besides the store; owned by the store worker.
pub struct State {
    /// Whether the cloud link is up (§4); starts down.
    pub connected: bool,
    /// Requests waiting for another module's answer, by the id that answer will carry as parent.
    pub pending: HashMap<String, Pending>,
    pub expiries: DelayQueue<String>,
    /// What waits in the outbox, kept in step with every push and acknowledgement.
    pub outbox: OutboxStats,
}

/// A request waiting for an answer from the cloud (remote query) or from edged (volume call).
pub struct Pending {
    pub kind: PendingKind,
    pub request: Request,
    pub expiry: delay_queue::Key,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PendingKind {
    RemoteQuery,
    Volume,
}

impl State {
    pub fn new() -> State {
        State {
            connected: false,
            pending: HashMap::new(),
            expiries: DelayQueue::new(),
            outbox: OutboxStats::default(),
        }
    }
}

impl Default for State {
    fn default() -> Self {
        State::new()
    }
}

/// Timeouts for requests that wait on another module.
#[derive(Debug, Clone, Copy)]
pub struct Waits {
    pub remote_query: Duration,
    pub volume: Duration,
}

/// Everything an operation may touch.
pub struct Context<'a> {
    pub db: &'a Db,
    pub root: &'a str,
    /// This node's name (`cloud.node_id`): devices' membership topics carry it.
    pub node: &'a str,
    pub state: &'a mut State,
    pub waits: Waits,
    pub outbox_limit: OutboxLimit,
    /// Local messages to publish after the commit.
    pub local: Vec<Message>,
    /// Whether anything was queued in the outbox.
    pub outbox_written: bool,
    /// Whether a device message was answered with an error result (bad input, nothing stored).
    pub refused: bool,
}

impl Context<'_> {
    /// Sends an envelope to `module`: cloud-bound messages go into the outbox (same transaction),
    /// the rest are published after the commit.
    async fn send(&mut self, module: &str, from: &str, envelope: &Envelope) -> Result<(), Error> {
        let topic = outbound(
            self.root,
            module,
            from,
            &envelope.route.operation,
            &envelope.route.resource,
        );
        let payload = envelope.to_bytes();
        if module == CLOUD {
            self.queue_for_cloud(&topic, &payload).await
        } else {
            self.local.push(Message::new(topic, payload));
            Ok(())
        }
    }

    /// Appends to the outbox in this message's savepoint (see [`outbox::append`]).
    pub(crate) async fn queue_for_cloud(
        &mut self,
        topic: &str,
        payload: &[u8],
    ) -> Result<(), Error> {
        outbox::append(
            self.db,
            &mut self.state.outbox,
            self.outbox_limit,
            topic,
            payload,
        )
        .await?;
        self.outbox_written = true;
        Ok(())
    }

    /// Answers `requester` (and its v5 Response Topic) with `operation` and `content`.
    async fn reply(
        &mut self,
        requester: &Requester,
        operation: Operation,
        content: Box<RawValue>,
    ) -> Result<(), Error> {
        let envelope = requester.envelope(operation, content);
        if let Some(copy) = requester.v5_copy(&Bytes::from(envelope.to_bytes())) {
            self.local.push(copy);
        }
        self.send(requester.module(), META, &envelope).await
    }

    fn forward_from<'e>(&self, request: &'e Request) -> (&'e str, &'e Envelope) {
        (&request.requester.from, &request.envelope)
    }
}

/// Applies one request.
pub async fn apply(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    if matches!(request.operation, Operation::Response | Operation::Error) {
        if let Some(parent) = &request.envelope.header.parent_msg_id {
            if let Some(pending) = take_pending(cx.state, parent) {
                return answer_pending(pending, request, cx).await;
            }
        }
    }
    match routing::special(request.operation) {
        Some(Special::Query) => query(request, cx).await,
        Some(Special::Connect) => connect(request, cx).await,
        Some(Special::SyncPodStatus) => sync_pod_status(cx).await,
        Some(Special::Volume) => volume(request, cx).await,
        None => by_table(request, cx).await,
    }
}

async fn by_table(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
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
                .db
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
    match rule.store {
        Store::Nothing => {}
        Store::Upsert => upsert(cx.db, resource, content.get()).await?,
        Store::UpsertUnlessAck => {
            if request.envelope.content_str().as_deref() != Some("OK") {
                upsert(cx.db, resource, content.get()).await?;
            }
        }
        Store::UpsertItems(item_type) => {
            for (item, value) in list_items(resource, item_type, content)? {
                upsert(cx.db, &item, value.get()).await?;
            }
        }
        Store::Delete => {
            cx.db
                .delete(resource.key())
                .await
                .map_err(Error::store("delete meta"))?;
        }
    }
    if let Some(forward) = rule.forward {
        let (from, envelope) = cx.forward_from(request);
        cx.send(forward.module(), from, envelope).await?;
    }
    match rule.reply {
        Reply::Nothing => Ok(()),
        Reply::Ok => {
            cx.reply(&request.requester, Operation::Response, json_string("OK"))
                .await
        }
        Reply::Null => {
            cx.reply(&request.requester, Operation::Response, null())
                .await
        }
    }
}

async fn upsert(db: &Db, resource: &Resource, value: &str) -> Result<(), Error> {
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

/// §2.3: local answer, or a cache-first remote query while the cloud is connected.
async fn query(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let res_type = request.resource.res_type();
    if cx.state.connected && routing::REMOTE_QUERY_TYPES.contains(&res_type) {
        let cached = if routing::ALWAYS_REMOTE_TYPES.contains(&res_type) {
            None
        } else {
            cx.db
                .get(request.resource.key())
                .await
                .map_err(Error::store("query meta"))?
        };
        return match cached {
            Some(value) => answer_values(&request.requester, vec![value], cx).await,
            None => remote_query(request, cx).await,
        };
    }
    local_answer(request, cx).await
}

async fn local_values(db: &Db, resource: &Resource) -> Result<Vec<String>, Error> {
    let values = match resource.id() {
        None => db.list_by_type(resource.res_type()).await,
        Some(_) => db
            .get(resource.key())
            .await
            .map(|v| v.into_iter().collect()),
    };
    values.map_err(Error::store("query meta"))
}

async fn local_answer(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let values = local_values(cx.db, &request.resource).await?;
    answer_values(&request.requester, values, cx).await
}

/// Answers with KubeEdge's `[]string`: each stored document as a JSON string.
async fn answer_values(
    requester: &Requester,
    values: Vec<String>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let content = serde_json::value::to_raw_value(&values).expect("strings serialize");
    cx.reply(requester, Operation::Response, content).await
}

/// §2.4: the query goes to the cloud under a fresh id; the answer is matched by that id.
async fn remote_query(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    let mut envelope = request.envelope.clone();
    envelope.header.msg_id = new_msg_id();
    cx.send(CLOUD, &request.requester.from, &envelope).await?;
    wait_for(
        cx,
        envelope.header.msg_id,
        PendingKind::RemoteQuery,
        request,
        cx.waits.remote_query,
    );
    Ok(())
}

/// §3.10: the volume call goes to edged; edged's answer is returned to the requester.
async fn volume(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    cx.send(
        Forward::Edged.module(),
        &request.requester.from,
        &request.envelope,
    )
    .await?;
    let id = request.envelope.header.msg_id.clone();
    wait_for(cx, id, PendingKind::Volume, request, cx.waits.volume);
    Ok(())
}

fn wait_for(
    cx: &mut Context<'_>,
    id: String,
    kind: PendingKind,
    request: &Request,
    timeout: Duration,
) {
    let expiry = cx.state.expiries.insert(id.clone(), timeout);
    let pending = Pending {
        kind,
        request: request.clone(),
        expiry,
    };
    cx.state.pending.insert(id, pending);
}

fn take_pending(state: &mut State, id: &str) -> Option<Pending> {
    let pending = state.pending.remove(id)?;
    state.expiries.remove(&pending.expiry);
    Some(pending)
}

/// The cloud answered a remote query, or edged answered a volume call.
async fn answer_pending(
    pending: Pending,
    answer: &Request,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let original = &pending.request;
    let failed = answer.operation == Operation::Error;
    match pending.kind {
        PendingKind::Volume => {
            cx.reply(
                &original.requester,
                answer.operation,
                answer.envelope.content.clone(),
            )
            .await
        }
        PendingKind::RemoteQuery => {
            if failed {
                cx.reply(
                    &original.requester,
                    Operation::Error,
                    answer.envelope.content.clone(),
                )
                .await?;
            } else {
                let value = answer.envelope.content.get().to_owned();
                // The requester still gets the cloud's answer when caching it fails (KubeEdge
                // §7 row 20); the next query simply goes remote again.
                if let Err(e) = upsert(cx.db, &original.resource, &value).await {
                    warn!(error_code = "EM-STORE-CACHE", resource = %original.resource, error = %e,
                        "remote query answer not cached");
                }
                answer_values(&original.requester, vec![value], cx).await?;
            }
            // §2.4.6: the cloud's answer is itself acknowledged.
            cx.reply(&answer.requester, Operation::Response, json_string("OK"))
                .await
        }
    }
}

/// A pending request ran out of time.
pub async fn expire(id: &str, cx: &mut Context<'_>) -> Result<(), Error> {
    let Some(pending) = cx.state.pending.remove(id) else {
        return Ok(());
    };
    let request = &pending.request;
    let error = match pending.kind {
        PendingKind::RemoteQuery => {
            // The cloud is silent: a stale local copy beats a timeout (offline autonomy).
            let values = local_values(cx.db, &request.resource).await?;
            if !values.is_empty() {
                return answer_values(&request.requester, values, cx).await;
            }
            Error::RemoteTimeout {
                resource: request.resource.to_string(),
                waited_ms: cx.waits.remote_query.as_millis() as u64,
            }
        }
        PendingKind::Volume => Error::VolumeTimeout {
            operation: request.operation.to_string(),
            resource: request.resource.to_string(),
            waited_ms: cx.waits.volume.as_millis() as u64,
        },
    };
    cx.reply(
        &request.requester,
        Operation::Error,
        json_string(&error.to_string()),
    )
    .await
}

/// §3.7: the cloud link went up or down. Going down answers waiting remote queries locally.
async fn connect(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    match request.envelope.content_str().as_deref() {
        Some("cloud_connected") => {
            let was = std::mem::replace(&mut cx.state.connected, true);
            info!("cloud connected");
            // KubeEdge's twin asks for the full device list each time the link comes up.
            if !was {
                crate::devices::request_detail(cx).await?;
            }
            Ok(())
        }
        Some("cloud_disconnected") => {
            cx.state.connected = false;
            info!("cloud disconnected");
            let waiting: Vec<String> = cx
                .state
                .pending
                .iter()
                .filter(|(_, p)| p.kind == PendingKind::RemoteQuery)
                .map(|(id, _)| id.clone())
                .collect();
            for id in waiting {
                if let Some(pending) = take_pending(cx.state, &id) {
                    local_answer(&pending.request, cx).await?;
                }
            }
            Ok(())
        }
        _ => Err(Error::Content {
            what: "connect",
            reason: format!(
                "{} is neither \"cloud_connected\" nor \"cloud_disconnected\"",
                request.envelope.content.get()
            ),
        }),
    }
}

/// §3.8: sends every pod status to the cloud, one message per namespace, and drops statuses
/// whose pod is gone. (KubeEdge took the namespace of the first row for all of them.)
pub async fn sync_pod_status(cx: &mut Context<'_>) -> Result<(), Error> {
    let rows = cx
        .db
        .rows_by_type("podstatus")
        .await
        .map_err(Error::store("query meta"))?;
    let mut by_namespace: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (key, value) in rows {
        let namespace = key.split('/').next().unwrap_or_default().to_owned();
        let statuses = by_namespace.entry(namespace).or_default();
        let pod_key = key.replacen("/podstatus/", "/pod/", 1);
        let pod = cx
            .db
            .get(&pod_key)
            .await
            .map_err(Error::store("query meta"))?;
        if pod.is_none() {
            cx.db
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

#[cfg(test)]
mod tests {
    use super::*;

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
