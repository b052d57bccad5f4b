//! What each message does, one file per message family, dispatched here.
//!
//! `<root>/meta/...` requests: the [`crate::routing`] table (`RULES`, [`meta`]), queries
//! ([`query`]), CSI volume calls ([`volume`]), the cloud link's state ([`connect`]), the pod-status
//! sync ([`podstatus`]) and the answers requests wait for ([`answer`]). Their sender hears a
//! failure as an `error` reply on its reply topic.
//!
//! Device messages: one [`Family`] per file, each declaring its topic shape, its result topic,
//! its `apply` and whether its failures are answered, and one row of [`DEVICES`]. Steps they
//! share are in [`device`]. Adding a family is one new file and one row.
//!
//! Everything runs on the store worker inside the batch's transaction, so what goes up is in
//! the same transaction as the change. [`failure_reply`] is what a failed message's sender hears.

mod answer;
mod cloud_detail;
mod cloud_membership;
mod cloud_object;
mod cloud_twin;
mod connect;
mod data;
mod device;
mod family;
mod membership_get;
mod meta;
mod podstatus;
mod query;
mod state_update;
mod twin_get;
mod twin_update;
mod upload;
mod volume;

use edgemeta_broker::Message;
use tracing::{error, warn};

use crate::devices::{event_id_of, Event};
use crate::error::Error;
use crate::reply::{code_of, error_reply, Asker};
use crate::request::Request;
use crate::routing::{self, Special};
use crate::unit::{Context, Work};
use edgemeta_protocol::Operation;
use family::Family;

/// Every device message family, in the order of their `kind` label's rows: a new one goes last.
const DEVICES: &[&Family] = &[
    &twin_update::FAMILY,
    &twin_get::FAMILY,
    &state_update::FAMILY,
    &membership_get::FAMILY,
    &upload::FAMILY,
    &data::FAMILY,
    &cloud_membership::FAMILY,
    &cloud_detail::FAMILY,
    &cloud_twin::FAMILY,
    &cloud_object::DEVICES,
    &cloud_object::MODELS,
    &cloud_object::RESYNC,
    &cloud_object::MAPPER,
];

/// The row of [`DEVICES`] whose `kind` is `kind` (a family the node's DMI server hands in).
pub(crate) fn family(kind: &str) -> Option<usize> {
    DEVICES.iter().position(|f| f.kind == kind)
}

/// The `kind` label of `edgemeta_device_messages_total`, one per row of [`DEVICES`].
pub(crate) const KINDS: [&str; DEVICES.len()] = {
    let mut kinds = [""; DEVICES.len()];
    let mut i = 0;
    while i < DEVICES.len() {
        kinds[i] = DEVICES[i].kind;
        i += 1;
    }
    kinds
};

/// The device message a local topic (clients' form) carries, if any: its family and device id.
pub(crate) fn classify(topic: &str) -> Option<(usize, String)> {
    DEVICES
        .iter()
        .enumerate()
        .find_map(|(family, f)| f.shape.local(topic).map(|id| (family, id)))
}

/// The device message a devicecontroller message on `<ns>/<type>[/<name>]` is, if any.
pub(crate) fn classify_cloud(
    operation: &str,
    namespace: &str,
    res_type: &str,
    name: Option<&str>,
) -> Option<(usize, String)> {
    DEVICES.iter().enumerate().find_map(|(family, f)| {
        f.shape
            .cloud(operation, namespace, res_type, name)
            .map(|id| (family, id))
    })
}

/// Applies one message.
pub(crate) async fn apply(work: &Work, cx: &mut Context<'_>) -> Result<(), Error> {
    match work {
        Work::Request(request) => apply_request(request, cx).await,
        Work::Device(event) => {
            (DEVICES[event.family].apply)(event, cx).await?;
            match &event.ack {
                Some((msg_id, resource)) => device::ack_cloud(msg_id, resource, cx).await,
                None => Ok(()),
            }
        }
        Work::Report(report) => {
            (DEVICES[report.event.family].apply)(&report.event, cx).await?;
            let _ = report.verdict.set(cx.refusal());
            cx.unrepeatable();
            Ok(())
        }
    }
}

async fn apply_request(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    if matches!(request.operation, Operation::Response | Operation::Error) {
        if let Some(parent) = &request.envelope.header.parent_msg_id {
            if let Some(pending) = cx.take_pending(parent) {
                return answer::answer_pending(pending, request, cx).await;
            }
        }
    }
    match routing::special(request.operation) {
        Some(Special::Query) => query::apply(request, cx).await,
        Some(Special::Connect) => connect::apply(request, cx).await,
        Some(Special::SyncPodStatus) => podstatus::apply(cx).await,
        Some(Special::Volume) => volume::apply(request, cx).await,
        None => meta::apply(request, cx).await,
    }
}

/// A pending request ran out of time.
pub(crate) async fn expire(id: &str, cx: &mut Context<'_>) -> Result<(), Error> {
    answer::expire(id, cx).await
}

/// Sends every pod status to the cloud (the periodic sync).
pub(crate) async fn sync_pod_status(cx: &mut Context<'_>) -> Result<(), Error> {
    podstatus::apply(cx).await
}

/// What the sender of `work`, which failed with `error`, hears: a request's sender an `error`
/// reply, a device a 400 (bad input) or 500 (ours) on its family's result topic, where it
/// answers failures there.
pub(crate) fn failure_reply(root: &str, node: &str, work: &Work, error: &Error) -> Vec<Message> {
    let reason = error.to_string();
    match work {
        Work::Request(request) => error_reply(
            root,
            Asker::Requester(&request.requester),
            code_of(error),
            &reason,
        ),
        // The DMI server answers its mapper with a gRPC status itself.
        Work::Report(_) => Vec::new(),
        Work::Device(event) => {
            let family = DEVICES[event.family];
            let Some(result) = family
                .answers_failures
                .then(|| family.result_topic(&event.id, node))
                .flatten()
            else {
                return Vec::new();
            };
            let event_id = event_id_of(&event.payload);
            let asker = Asker::Device {
                result: &result,
                event_id: &event_id,
            };
            error_reply(root, asker, code_of(error), &reason)
        }
    }
}

/// One log line per failed message, at a level that says whose fault it was.
pub(crate) fn log_failure(work: &Work, error: &Error) {
    match work {
        Work::Request(request) => {
            let from = &request.requester.from;
            let resource = &request.requester.resource;
            if error.is_bad_input() {
                warn!(error_code = error.code(), %from, %resource, operation = %request.operation, error = %error, "message refused");
            } else {
                error!(error_code = error.code(), %from, %resource, operation = %request.operation, error = %error, "message failed");
            }
        }
        Work::Device(event) => log_device_failure(event, error),
        Work::Report(report) => log_device_failure(&report.event, error),
    }
}

fn log_device_failure(event: &Event, error: &Error) {
    error!(error_code = error.code(), topic = %event.topic, error = %error, "device message failed");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(topic: &str) -> Option<(&'static str, String)> {
        classify(topic).map(|(family, id)| (KINDS[family], id))
    }

    #[test]
    fn topics_name_one_or_two_level_device_ids() {
        let some = |kind: &'static str, id: &str| Some((kind, id.to_owned()));
        assert_eq!(
            kind("$hw/events/device/thermo-1/twin/update"),
            some("twin_update", "thermo-1")
        );
        assert_eq!(
            kind("$hw/events/device/default/thermo-2/twin/get"),
            some("twin_get", "default/thermo-2")
        );
        assert_eq!(kind("$ke/events/device/d/data/update"), some("data", "d"));
        assert_eq!(
            kind("$hw/events/node/n1/membership/get"),
            some("membership_get", "")
        );
        assert_eq!(kind("$hw/events/upload/a/b"), some("upload", ""));
        assert_eq!(kind("SYS/dis/upload_records"), some("upload", ""));
        assert_eq!(kind("$hw/events/upload"), some("upload", ""));
        assert_eq!(kind("$hw/events/uploads/x"), None);
        assert_eq!(kind("factory/user/line-1/alarm"), some("upload", ""));
        assert_eq!(kind("factory/user"), some("upload", ""));
        assert_eq!(kind("/user/x"), some("upload", ""));
        assert_eq!(kind("$hw/user/x"), None);
        assert_eq!(kind("factory/users/x"), None);
        assert_eq!(kind("user/x"), None);
        // Our own results, three-level ids and wildcards are not requests.
        assert_eq!(kind("$hw/events/device/d/twin/update/result"), None);
        assert_eq!(kind("$hw/events/device/a/b/c/twin/update"), None);
        assert_eq!(kind("$hw/events/device//twin/update"), None);
    }

    #[test]
    fn cloud_messages_name_their_family() {
        let cloud = |op, ns, ty, name| {
            classify_cloud(op, ns, ty, name).map(|(family, id)| (KINDS[family], id))
        };
        assert_eq!(
            cloud("update", "node", "membership", None),
            Some(("cloud_membership", String::new()))
        );
        assert_eq!(
            cloud("update", "node", "membershipdetail", None),
            Some(("cloud_detail", String::new()))
        );
        assert_eq!(
            cloud("update", "default", "devicetwin", Some("t2")),
            Some(("cloud_twin", "default/t2".to_owned()))
        );
        assert_eq!(
            cloud("update", "_", "devicetwin", Some("t1")),
            Some(("cloud_twin", "t1".to_owned()))
        );
        assert_eq!(cloud("update", "default", "devicetwin", None), None);
        assert_eq!(cloud("insert", "node", "membership", None), None);
        assert_eq!(cloud("update", "other", "membership", None), None);
    }

    #[test]
    fn kinds_keep_their_metric_rows() {
        // A new family goes last: the rows before it keep their labels.
        assert_eq!(
            KINDS[..9],
            [
                "twin_update",
                "twin_get",
                "state_update",
                "membership_get",
                "upload",
                "data",
                "cloud_membership",
                "cloud_detail",
                "cloud_twin",
            ]
        );
    }
}
