//! The routing rules of KubeEdge v1.3's `process.go` as one table.
//!
//! Each row says, for an operation from a source about a resource type, what is written to the
//! store, where the message is forwarded after the commit and what the requester is answered.
//! The first matching row wins. `kubeedge` points at the section of
//! `shared/reference/kubeedge-metamanager.md` the row implements; "edgemeta:" marks a deliberate
//! difference. Queries, connection signals, pod-status sync and CSI volume calls need state
//! beyond one row (cache, timers, waits) and are dispatched to their handlers by [`Special`].

use edgemeta_protocol::{Operation, CLOUD_SOURCES};

/// Resource types that belong to EdgeMesh (`isEdgeMeshResource`, plus `endpoints` on delete).
pub const EDGEMESH_TYPES: &[&str] = &["service", "servicelist", "endpoints", "podlist"];

/// Which senders a row applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceMatch {
    Any,
    /// `edgecontroller`, `funcmgr`, `devicecontroller`.
    Cloud,
    Named(&'static str),
}

/// Which resource types a row applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeMatch {
    Any,
    OneOf(&'static [&'static str]),
}

/// A condition on the stored state, checked inside the transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// The stored value equals the new content byte for byte.
    StoredValueUnchanged,
}

/// What the row writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Nothing,
    /// Insert or replace the content under the resource key.
    Upsert,
    /// Content is a JSON array of objects; each is stored as `<its ns>/<type>/<its name>`.
    UpsertItems(&'static str),
    /// Like `Upsert`, except that the plain `"OK"` ack content is never stored.
    UpsertUnlessAck,
    Delete,
}

/// A module a message is forwarded to, as `<root>/<module>/<from>/<op>/<namespace>/<type>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    Edged,
    EdgeMesh,
    EdgeFunction,
    /// Through the outbox, committed with the state change.
    Cloud,
}

impl Forward {
    pub const fn module(self) -> &'static str {
        match self {
            Forward::Edged => "edged",
            Forward::EdgeMesh => "edgemesh",
            Forward::EdgeFunction => "edgefunction",
            Forward::Cloud => edgemeta_protocol::CLOUD,
        }
    }
}

/// What the requester is answered after the commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Nothing,
    /// `response` with content `"OK"`.
    Ok,
    /// `response` with content `null`.
    Null,
}

/// Operations handled outside the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// §2.3/§2.4: local answer, cache-first remote query, or local fallback when offline.
    Query,
    /// §3.7: `cloud_connected` / `cloud_disconnected`.
    Connect,
    /// §3.8: pod-status sync to the cloud, orphan removal.
    SyncPodStatus,
    /// §3.10: relayed to edged, edged's answer goes back to the requester.
    Volume,
}

/// One routing rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub operation: Operation,
    pub source: SourceMatch,
    pub types: TypeMatch,
    pub when: When,
    pub store: Store,
    pub forward: Option<Forward>,
    pub reply: Reply,
    pub kubeedge: &'static str,
}

const fn rule(
    operation: Operation,
    source: SourceMatch,
    types: TypeMatch,
    store: Store,
    forward: Option<Forward>,
    reply: Reply,
    kubeedge: &'static str,
) -> Rule {
    Rule {
        operation,
        source,
        types,
        when: When::Always,
        store,
        forward,
        reply,
        kubeedge,
    }
}

use Forward::{Cloud, EdgeFunction, EdgeMesh, Edged};
use Operation as Op;
use SourceMatch::{Any as AnySource, Cloud as FromCloud, Named};
use TypeMatch::{Any as AnyType, OneOf};

/// The table. Order matters: the first matching row wins.
#[rustfmt::skip]
pub const RULES: &[Rule] = &[
    // insert (§3.1). edgemeta: insert of an existing key updates it (#3620); every insert is
    // answered to its requester, cloud sources through the outbox.
    rule(Op::Insert, AnySource, OneOf(&["listener"]), Store::Upsert, None, Reply::Null,
        "§3.1.2 listener: SendResp(nil) to edgemesh, no cloud ack"),
    rule(Op::Insert, AnySource, OneOf(&["servicelist"]), Store::UpsertItems("service"), Some(EdgeMesh), Reply::Ok,
        "§3.1.1 servicelist: each Service saved as <ns>/service/<name>; §3.1.3 to edgemesh; §3.1.4 ack"),
    rule(Op::Insert, AnySource, OneOf(EDGEMESH_TYPES), Store::Upsert, Some(EdgeMesh), Reply::Ok,
        "§3.1.3 edgemesh type to edgemesh; §3.1.4 ack"),
    rule(Op::Insert, AnySource, AnyType, Store::Upsert, Some(Edged), Reply::Ok,
        "§3.1.3 to edged; §3.1.4 ack"),
    // update (§3.2)
    Rule { when: When::StoredValueUnchanged, ..rule(Op::Update, AnySource, OneOf(&["podstatus"]), Store::Nothing, None, Reply::Ok,
        "§3.2.2 podstatus unchanged: OK to the requester, nothing forwarded") },
    rule(Op::Update, AnySource, OneOf(&["endpointslist"]), Store::UpsertItems("endpoints"), Some(EdgeMesh), Reply::Ok,
        "§3.2.1 endpointslist: each item as <ns>/endpoints/<name>, to edgemesh, ack"),
    rule(Op::Update, AnySource, OneOf(&["servicelist"]), Store::UpsertItems("service"), Some(EdgeMesh), Reply::Ok,
        "§3.2.1 servicelist: each item as <ns>/service/<name>, to edgemesh, ack"),
    rule(Op::Update, AnySource, OneOf(&["podlist"]), Store::Upsert, Some(EdgeMesh), Reply::Ok,
        "§3.2.1 podlist: whole document under its key, to edgemesh, ack"),
    rule(Op::Update, Named("edged"), AnyType, Store::Upsert, Some(Cloud), Reply::Ok,
        "§3.2.4 edged: forward to the cloud, OK to edged"),
    rule(Op::Update, Named("edgecontroller"), OneOf(EDGEMESH_TYPES), Store::Upsert, Some(EdgeMesh), Reply::Ok,
        "§3.2.4 edgecontroller, edgemesh type: to edgemesh, ack"),
    rule(Op::Update, Named("edgecontroller"), AnyType, Store::Upsert, Some(Edged), Reply::Ok,
        "§3.2.4 edgecontroller: to edged, ack"),
    rule(Op::Update, Named("funcmgr"), AnyType, Store::Upsert, Some(EdgeFunction), Reply::Ok,
        "§3.2.4 funcmgr: to edgefunction (edgemeta: also acked)"),
    rule(Op::Update, Named("edgefunction"), AnyType, Store::Upsert, Some(Cloud), Reply::Ok,
        "§3.2.4 edgefunction: to the cloud (edgemeta: also acked)"),
    rule(Op::Update, AnySource, AnyType, Store::Upsert, None, Reply::Ok,
        "§3.2.4 other source: stored (edgemeta: acked instead of 'unsupport message source')"),
    // delete (§3.4): the row goes first, then the message.
    rule(Op::Delete, AnySource, OneOf(&["listener"]), Store::Delete, None, Reply::Ok,
        "§3.4 listener: OK to edgemesh"),
    rule(Op::Delete, AnySource, OneOf(&["service", "endpoints"]), Store::Delete, Some(EdgeMesh), Reply::Ok,
        "§3.4 service/endpoints: to edgemesh, ack"),
    rule(Op::Delete, Named("edged"), OneOf(&["pod"]), Store::Delete, Some(Cloud), Reply::Ok,
        "§3.4 pod deleted by edged: to the cloud only (edgemeta: OK to edged)"),
    rule(Op::Delete, AnySource, AnyType, Store::Delete, Some(Edged), Reply::Ok,
        "§3.4 to edged, ack"),
    // response (§3.6); answers to our own remote queries and volume calls are matched first.
    rule(Op::Response, FromCloud, OneOf(&["service", "endpoints", "listener"]), Store::UpsertUnlessAck, Some(EdgeMesh), Reply::Nothing,
        "§3.6 from the cloud, edgemesh type: stored, to edgemesh"),
    rule(Op::Response, FromCloud, AnyType, Store::UpsertUnlessAck, Some(Edged), Reply::Nothing,
        "§3.6 from the cloud: stored, to edged (edgemeta: an \"OK\" ack is not stored)"),
    rule(Op::Response, AnySource, AnyType, Store::UpsertUnlessAck, Some(Cloud), Reply::Nothing,
        "§3.6 from an edge module: stored, to the cloud"),
    // error: KubeEdge ignores it; edgemeta passes it on like a response, storing nothing.
    rule(Op::Error, FromCloud, AnyType, Store::Nothing, Some(Edged), Reply::Nothing,
        "edgemeta: a cloud error reaches edged"),
    rule(Op::Error, AnySource, AnyType, Store::Nothing, Some(Cloud), Reply::Nothing,
        "edgemeta: an edge module's error reaches the cloud"),
    // function operations (§3.9). edgemeta: upsert instead of insert-ignore; acked.
    rule(Op::Action, AnySource, AnyType, Store::Upsert, Some(EdgeFunction), Reply::Ok,
        "§3.9 action: saved, to edgefunction"),
    rule(Op::ActionResult, AnySource, AnyType, Store::Upsert, Some(Cloud), Reply::Ok,
        "§3.9 action_result: saved, to the cloud"),
];

/// Which handler serves an operation that the table does not describe.
pub const fn special(operation: Operation) -> Option<Special> {
    match operation {
        Op::Query => Some(Special::Query),
        Op::Connect => Some(Special::Connect),
        Op::MetaInternalSync => Some(Special::SyncPodStatus),
        op if op.is_volume() => Some(Special::Volume),
        _ => None,
    }
}

/// Remote-query types of KubeEdge v1.2–v1.7 (`requireRemoteQuery`, §2.2).
pub const REMOTE_QUERY_TYPES: &[&str] = &[
    "configmap",
    "secret",
    "endpoints",
    "persistentvolume",
    "persistentvolumeclaim",
    "volumeattachment",
    "node",
];

/// Remote-query types that always go to the cloud while connected (§2.3.1).
pub const ALWAYS_REMOTE_TYPES: &[&str] = &["node", "volumeattachment"];

impl SourceMatch {
    pub fn matches(self, source: &str) -> bool {
        match self {
            SourceMatch::Any => true,
            SourceMatch::Cloud => CLOUD_SOURCES.contains(&source),
            SourceMatch::Named(name) => name == source,
        }
    }
}

impl TypeMatch {
    pub fn matches(self, res_type: &str) -> bool {
        match self {
            TypeMatch::Any => true,
            TypeMatch::OneOf(types) => types.contains(&res_type),
        }
    }
}

/// The rows that may apply to a message, in table order; `When` is checked by the caller.
pub fn candidates<'a>(
    operation: Operation,
    source: &'a str,
    res_type: &'a str,
) -> impl Iterator<Item = &'static Rule> + 'a {
    RULES.iter().filter(move |r| {
        r.operation == operation && r.source.matches(source) && r.types.matches(res_type)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn first(op: Operation, source: &str, res_type: &str) -> &'static Rule {
        candidates(op, source, res_type)
            .find(|r| r.when == When::Always)
            .expect("a rule applies")
    }

    #[test]
    fn every_table_operation_ends_in_a_catch_all_row() {
        for op in Operation::ALL
            .into_iter()
            .filter(|op| special(*op).is_none())
        {
            let last = RULES
                .iter()
                .rev()
                .find(|r| r.operation == op)
                .expect("op has rows");
            assert_eq!(
                (last.source, last.types, last.when),
                (SourceMatch::Any, TypeMatch::Any, When::Always),
                "{op}"
            );
        }
    }

    #[test]
    fn special_operations_have_no_rows() {
        for op in Operation::ALL
            .into_iter()
            .filter(|op| special(*op).is_some())
        {
            assert!(RULES.iter().all(|r| r.operation != op), "{op}");
        }
    }

    #[test]
    fn inserts_go_to_edged_or_edgemesh_by_type() {
        assert_eq!(
            first(Op::Insert, "edgecontroller", "pod").forward,
            Some(Edged)
        );
        assert_eq!(
            first(Op::Insert, "edgecontroller", "service").forward,
            Some(EdgeMesh)
        );
        assert_eq!(
            first(Op::Insert, "edgecontroller", "servicelist").store,
            Store::UpsertItems("service")
        );
        assert_eq!(first(Op::Insert, "edgemesh", "listener").reply, Reply::Null);
    }

    #[test]
    fn updates_are_forwarded_by_source() {
        assert_eq!(first(Op::Update, "edged", "podstatus").forward, Some(Cloud));
        assert_eq!(
            first(Op::Update, "edgecontroller", "pod").forward,
            Some(Edged)
        );
        assert_eq!(
            first(Op::Update, "edgecontroller", "endpoints").forward,
            Some(EdgeMesh)
        );
        assert_eq!(
            first(Op::Update, "funcmgr", "function").forward,
            Some(EdgeFunction)
        );
        assert_eq!(
            first(Op::Update, "edgefunction", "function").forward,
            Some(Cloud)
        );
        assert_eq!(first(Op::Update, "device", "devicestatus").forward, None);
    }

    #[test]
    fn the_podstatus_shortcut_comes_before_the_source_rows() {
        let rows: Vec<_> = candidates(Op::Update, "edged", "podstatus").collect();
        assert_eq!(rows[0].when, When::StoredValueUnchanged);
        assert_eq!(rows[0].forward, None);
        assert_eq!(rows[1].forward, Some(Cloud));
    }

    #[test]
    fn a_pod_delete_from_edged_goes_to_the_cloud_only() {
        assert_eq!(first(Op::Delete, "edged", "pod").forward, Some(Cloud));
        assert_eq!(
            first(Op::Delete, "edgecontroller", "pod").forward,
            Some(Edged)
        );
        assert_eq!(
            first(Op::Delete, "edgecontroller", "service").forward,
            Some(EdgeMesh)
        );
    }

    #[test]
    fn responses_flow_away_from_their_sender() {
        assert_eq!(
            first(Op::Response, "edgecontroller", "pod").forward,
            Some(Edged)
        );
        assert_eq!(
            first(Op::Response, "edgecontroller", "service").forward,
            Some(EdgeMesh)
        );
        assert_eq!(first(Op::Response, "edged", "pod").forward, Some(Cloud));
    }
}
