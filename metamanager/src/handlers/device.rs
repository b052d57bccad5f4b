//! Steps the device families share: parsing a device's payload or refusing it, loading and
//! writing twins, adding and removing devices, and reporting up to the cloud.

use std::collections::BTreeMap;

use serde::Serialize;
use tracing::{info, warn};

use crate::devices::twin::{self, Source, Twin};
use crate::devices::wire::{
    self, Base, DetailRequest, Device, MembershipUpdate, TwinDelta, TwinDocument, TwinResult,
};
use crate::devices::{
    content_of, device_topic, fresh_base, header, local, node_topic, resource_of, to_raw, valid_id,
    Event, DEVICETWIN, EVENTBUS, MEMBERSHIP_DETAIL, TWIN,
};
use crate::error::Error;
use crate::handlers::family::Family;
use crate::reply::{error_reply, Asker};
use crate::store::DeviceRow;
use crate::unit::Context;
use edgemeta_protocol::{new_msg_id, now_ms, Envelope, Route};
use edgemeta_protocol::{outbound, CLOUD};

/// The document, the delta and the cloud report that follow every twin change.
pub(crate) async fn after_twin_change(
    id: &str,
    base: Base,
    document: BTreeMap<String, wire::TwinDoc>,
    twins: &BTreeMap<String, Twin>,
    sync: BTreeMap<String, Option<wire::MsgTwin>>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    // What no client subscribes to would be dropped at the commit: not built at all.
    let topic = device_topic(id, "/twin/update/document");
    if !document.is_empty() && cx.heard(&topic) {
        cx.publish(local(
            &topic,
            &TwinDocument {
                base: base.clone(),
                twin: document,
            },
        ));
    }
    let topic = device_topic(id, "/twin/update/delta");
    if cx.heard(&topic) {
        if let Some((twin, delta)) = twin::delta(twins) {
            cx.publish(local(
                &topic,
                &TwinDelta {
                    base: fresh_base(),
                    twin,
                    delta,
                },
            ));
        }
    }
    if !sync.is_empty() {
        let report = TwinResult {
            base: fresh_base(),
            twin: sync,
        };
        up(cx, TWIN, "update", &resource_of(id, DEVICETWIN), &report).await?;
    }
    Ok(())
}

/// Applies a cloud twin update to a stored device and tells the device and the cloud.
pub(crate) async fn sync_twins(
    id: &str,
    event_id: &str,
    changes: &BTreeMap<String, Option<wire::MsgTwin>>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let mut twins = load_twins(id, cx).await?;
    let now = now_ms();
    let merged = match twin::merge(&mut twins, changes, Source::Cloud, now) {
        Ok(merged) => merged,
        Err(reason) => {
            warn!(error_code = "EM-DEVICE-TWIN", device = %id, %reason, "cloud twin update not applied");
            return Ok(());
        }
    };
    write_twins(id, &merged.changed, cx).await?;
    let base = Base {
        event_id: event_id.to_owned(),
        timestamp: now,
    };
    after_twin_change(id, base, merged.document, &twins, merged.sync, cx).await
}

/// `addDevice` (not delta): a known device gets its attributes and twins updated; a new one is
/// stored and announced on `membership/updated`.
pub(crate) async fn add_device(device: Device, cx: &mut Context<'_>) -> Result<(), Error> {
    if !valid_id(&device.id) {
        warn!(error_code = "EM-DEVICE-ID", id = %device.id, "device id is not one or two topic levels of at most 64 bytes; not added");
        return Ok(());
    }
    let known = device_exists(&device.id, cx).await?;
    if !known {
        cx.db()
            .insert_device(&DeviceRow {
                id: device.id.clone(),
                name: device.name.clone(),
                description: device.description.clone(),
                state: device.state.clone(),
                last_online: String::new(),
            })
            .await
            .map_err(Error::store("insert device"))?;
        info!(device = %device.id, "device added");
    }
    if let Some(attributes) = &device.attributes {
        set_attributes(&device.id, attributes, cx).await?;
    }
    if let Some(changes) = &device.twin {
        sync_twins(&device.id, "", changes, cx).await?;
    }
    if !known {
        announce(cx, Some(device), None);
    }
    Ok(())
}

/// Whether the node has the device `id`.
pub(crate) async fn device_exists(id: &str, cx: &Context<'_>) -> Result<bool, Error> {
    let row = cx
        .db()
        .device(id)
        .await
        .map_err(Error::store("query device"))?;
    Ok(row.is_some())
}

/// Carries `payload` to the cloud as KubeEdge's eventbus does: op `upload`, `resource` in the
/// envelope, on the cloud topic of `cloud_resource`.
pub(crate) async fn upload(
    resource: String,
    cloud_resource: &str,
    payload: &[u8],
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let cloud = outbound(cx.root(), CLOUD, EVENTBUS, "upload", cloud_resource);
    cx.queue_for_cloud(&cloud, || {
        Envelope {
            header: header(),
            route: Route {
                source: EVENTBUS.into(),
                group: "user".into(),
                operation: "upload".into(),
                resource,
            },
            content: content_of(payload),
        }
        .to_bytes()
    })
    .await
}

pub(crate) async fn remove_device(device: Device, cx: &mut Context<'_>) -> Result<(), Error> {
    let known = device_exists(&device.id, cx).await?;
    if !known {
        return Ok(());
    }
    cx.db()
        .delete_device(&device.id)
        .await
        .map_err(Error::store("delete device"))?;
    info!(device = %device.id, "device removed");
    announce(cx, None, Some(device));
    Ok(())
}

/// `MarshalMembershipUpdate`: one message per device; twins without versions, deleted as null.
pub(crate) fn announce(cx: &mut Context<'_>, added: Option<Device>, removed: Option<Device>) {
    let strip = |mut device: Device| {
        if let Some(twins) = device.twin.as_mut() {
            for twin in twins.values_mut() {
                *twin = twin
                    .take()
                    .filter(|t| t.kind() != Some(twin::DELETED))
                    .map(|t| t.without_versions());
            }
        }
        device
    };
    let update = MembershipUpdate {
        base: fresh_base(),
        added_devices: added.map(|d| vec![strip(d)]),
        removed_devices: removed.map(|d| vec![strip(d)]),
    };
    cx.publish(local(
        &node_topic(cx.node(), "/membership/updated"),
        &update,
    ));
}

/// `DealMsgAttr` (sync): the cloud's set replaces the stored one; devices hear what changed.
pub(crate) async fn set_attributes(
    id: &str,
    attributes: &BTreeMap<String, Option<wire::MsgAttr>>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let before = cx
        .db()
        .attributes(id)
        .await
        .map_err(Error::store("query device attributes"))?;
    let after: BTreeMap<String, wire::MsgAttr> = attributes
        .iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
        .collect();
    let mut changed = BTreeMap::new();
    for (name, attr) in &after {
        if before.get(name).map(|b| &b.value) != Some(&attr.value) {
            changed.insert(name.clone(), Some(attr.clone()));
        }
    }
    for name in before.keys().filter(|k| !after.contains_key(*k)) {
        changed.insert(name.clone(), None);
    }
    if changed.is_empty() {
        return Ok(());
    }
    cx.db()
        .set_attributes(id, &after)
        .await
        .map_err(Error::store("update device attributes"))?;
    let update = wire::AttrUpdate {
        base: fresh_base(),
        attributes: changed,
    };
    cx.publish(local(&device_topic(id, "/updated"), &update));
    Ok(())
}

/// Asks the cloud for the full membership (`detailRequest`) when the cloud link comes up, so
/// devices removed while the node was away go. A node without devices does not ask: whatever
/// is added reaches it as a membership update through its persistent cloud session.
pub(crate) async fn request_detail(cx: &mut Context<'_>) -> Result<(), Error> {
    if !cx
        .db()
        .has_devices()
        .await
        .map_err(Error::store("query devices"))?
    {
        return Ok(());
    }
    let request = DetailRequest {
        event_type: "group_membership_event",
        event_id: new_msg_id(),
        operation: "detail",
        group_id: cx.node().to_owned(),
        timestamp: now_ms(),
    };
    let resource = format!("node/{MEMBERSHIP_DETAIL}");
    up(cx, TWIN, "query", &resource, &request).await
}

/// The twins of the device `id`, or `None` if the node has no such device. A device with
/// twins exists (removing a device removes its twins first), so only one without any costs a
/// second query: a report is one statement shorter.
pub(crate) async fn known_twins(
    id: &str,
    cx: &mut Context<'_>,
) -> Result<Option<BTreeMap<String, Twin>>, Error> {
    let twins = load_twins(id, cx).await?;
    if twins.is_empty() && !device_exists(id, cx).await? {
        return Ok(None);
    }
    Ok(Some(twins))
}

pub(crate) async fn load_twins(
    id: &str,
    cx: &mut Context<'_>,
) -> Result<BTreeMap<String, Twin>, Error> {
    cx.db()
        .twins(id)
        .await
        .map_err(Error::store("query device twin"))
}

pub(crate) async fn write_twins(
    id: &str,
    changed: &[Twin],
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    for twin in changed {
        cx.db()
            .write_twin(id, twin)
            .await
            .map_err(Error::store("update device twin"))?;
    }
    Ok(())
}

/// Tells the devicecontroller its message `msg_id` is applied (`response "OK"`, as the
/// MetaManager acks the edgecontroller's), in the transaction that applied it: the cloud stops
/// resending it and sends what it queued behind it.
pub(crate) async fn ack_cloud(
    msg_id: &str,
    resource: &str,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let topic = outbound(cx.root(), CLOUD, TWIN, "response", resource);
    cx.queue_for_cloud(&topic, || {
        let mut envelope = Envelope {
            header: header(),
            route: Route {
                source: TWIN.into(),
                group: TWIN.into(),
                operation: "response".into(),
                resource: resource.into(),
            },
            content: to_raw(&"OK"),
        };
        envelope.header.parent_msg_id = Some(msg_id.to_owned());
        envelope.to_bytes()
    })
    .await
}

/// Queues a report for the cloud on `<root>/cloud/<from>/<op>/<ns>/<type>`.
pub(crate) async fn up(
    cx: &mut Context<'_>,
    from: &str,
    operation: &str,
    resource: &str,
    content: &impl Serialize,
) -> Result<(), Error> {
    let topic = outbound(cx.root(), CLOUD, from, operation, resource);
    cx.queue_for_cloud(&topic, || {
        Envelope {
            header: header(),
            route: Route {
                source: from.into(),
                group: "resource".into(),
                operation: operation.into(),
                resource: resource.into(),
            },
            content: to_raw(content),
        }
        .to_bytes()
    })
    .await
}

/// A mapper's request to `family`: its result topic and the payload as `T`; `None` once a 400
/// with `reason` is answered there ([`parse`]).
pub(crate) fn read_request<T: serde::de::DeserializeOwned>(
    family: &Family,
    event: &Event,
    cx: &mut Context<'_>,
    reason: &str,
) -> Option<(String, T)> {
    let topic = family
        .result_topic(&event.id, cx.node())
        .unwrap_or_default();
    let request = parse::<T>(cx, &topic, &event.payload, reason)?;
    Some((topic, request))
}

/// A device's JSON payload as `T`; otherwise answers 400 with `reason` and the parser's error on
/// `topic` and gives `None` (KubeEdge's result has no event id then: it could not be read).
pub(crate) fn parse<T: serde::de::DeserializeOwned>(
    cx: &mut Context<'_>,
    topic: &str,
    payload: &[u8],
    reason: &str,
) -> Option<T> {
    match serde_json::from_slice(payload) {
        Ok(value) => Some(value),
        Err(e) => {
            let _ = refuse(cx, topic, "", 400, &format!("{reason}, err: {e}"), "");
            None
        }
    }
}

/// Answers a refused device message on its result topic; nothing is stored.
pub(crate) fn refuse(
    cx: &mut Context<'_>,
    topic: &str,
    event_id: &str,
    code: u16,
    reason: &str,
    detail: &str,
) -> Result<(), Error> {
    warn!(error_code = "EM-DEVICE-REFUSED", %topic, code, reason, detail, "device message refused");
    cx.note_refusal(code, reason);
    let asker = Asker::Device {
        result: topic,
        event_id,
    };
    for message in error_reply(cx.root(), asker, code, reason) {
        cx.refuse(message);
    }
    Ok(())
}

/// A cloud message whose content does not parse: logged, and acknowledged (redelivery would
/// not make it parse).
pub(crate) fn bad_cloud_content(what: &str, error: &serde_json::Error) -> Result<(), Error> {
    warn!(error_code = "EM-DEVICE-CLOUD-JSON", what, error = %error, "devicecontroller message not applied");
    Ok(())
}
