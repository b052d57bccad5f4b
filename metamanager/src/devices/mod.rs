//! KubeEdge's DeviceTwin on the MetaManager: mappers' `$hw/...` topics, the twins in KubeEdge's
//! tables, and the devicecontroller's membership and desired twins from the cloud
//! (docs/devices.md). One table, [`LOCAL`], maps topics to handlers; everything runs on the
//! store worker inside the message's savepoint, so what goes up is in the same transaction.

pub mod twin;
pub mod wire;

use std::collections::BTreeMap;

use bytes::Bytes;
use edgemeta_broker::to_broker;
use edgemeta_broker::Message;
use edgemeta_protocol::{new_msg_id, now_ms, raw, rfc3339, Envelope, Header, Route, CLOUD};
use serde::Serialize;
use serde_json::value::RawValue;
use tracing::{info, warn};

use crate::error::Error;
use crate::process::Context;
use crate::store::DeviceRow;
use twin::{Source, Twin};
use wire::{
    Base, DetailRequest, Device, DeviceState, ErrorResult, Membership, MembershipUpdate,
    StateResult, StateUpdate, TwinDelta, TwinDocument, TwinResult, TwinUpdate,
};

/// The cloud module whose device messages this part applies (protocol §2 `<from>`).
pub const DEVICECONTROLLER: &str = "devicecontroller";
/// The module name on what the node reports to the cloud (KubeEdge's `twin`).
const TWIN: &str = "twin";
/// The module name on uploads carried to the cloud (KubeEdge's `eventbus`).
const EVENTBUS: &str = "eventbus";
/// Namespace of a device whose id has none (KubeEdge < 1.15): no Kubernetes namespace has `_`.
const NO_NAMESPACE: &str = "_";

/// Resource types (`<ns>/<type>/<name>`) of device messages.
pub const DEVICETWIN: &str = "devicetwin";
const DEVICESTATE: &str = "devicestate";
const DEVICEDATA: &str = "devicedata";
const MEMBERSHIP: &str = "membership";
const MEMBERSHIP_DETAIL: &str = "membershipdetail";

/// The device states a mapper may report, compared lower-cased: KubeEdge's five
/// (`dtcommon/common.go` `DeviceStatus*`) and the two more mappers-go sends
/// (`mappers/common/const.go` `DEVSTDISCONN`, `DEVSTERR`), which KubeEdge drops unrecorded.
const STATES: [&str; 7] = [
    "online",
    "offline",
    "ok",
    "unknown",
    "unhealthy",
    "disconnected",
    "error",
];

/// What a device message asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    TwinUpdate(String),
    TwinGet(String),
    StateUpdate(String),
    MembershipGet,
    /// `$hw/events/upload/#`, `SYS/dis/upload_records` and user topics (`+/user/#`): carried
    /// to the cloud.
    Upload,
    /// `$ke/events/device/<id>/data/update`.
    Data(String),
    /// The devicecontroller's membership changes, full list, and desired twins.
    CloudMembership,
    CloudDetail,
    CloudTwin(String),
}

/// The `kind` label of `edgemeta_device_messages_total`, in [`Kind::index`] order.
pub const KINDS: [&str; 9] = [
    "twin_update",
    "twin_get",
    "state_update",
    "membership_get",
    "upload",
    "data",
    "cloud_membership",
    "cloud_detail",
    "cloud_twin",
];

impl Kind {
    /// Its row in [`KINDS`].
    pub fn index(&self) -> usize {
        match self {
            Kind::TwinUpdate(_) => 0,
            Kind::TwinGet(_) => 1,
            Kind::StateUpdate(_) => 2,
            Kind::MembershipGet => 3,
            Kind::Upload => 4,
            Kind::Data(_) => 5,
            Kind::CloudMembership => 6,
            Kind::CloudDetail => 7,
            Kind::CloudTwin(_) => 8,
        }
    }
}

/// A device message for the store worker: `payload` is the MQTT payload of a local message, or
/// the envelope's content of a cloud one.
#[derive(Debug, Clone)]
pub struct Event {
    pub kind: Kind,
    /// The topic it came on, in the clients' form (`$hw/...`).
    pub topic: String,
    pub payload: Bytes,
}

/// A topic shape: (prefix, suffix, the kind for the id between them).
type Shape = (&'static str, &'static str, fn(String) -> Kind);

/// `$hw` topic shapes: (prefix, suffix, kind). The id is the one or two levels in between.
/// `dtcommon/common.go` (`DeviceETPrefix`, `TwinETUpdateSuffix`, ...), eventbus `SubTopics`.
const LOCAL: [Shape; 4] = [
    ("$hw/events/device/", "/twin/update", Kind::TwinUpdate),
    ("$hw/events/device/", "/twin/get", Kind::TwinGet),
    ("$hw/events/device/", "/state/update", Kind::StateUpdate),
    // mapper-framework pkg/common/event.go TopicDataUpdate.
    ("$ke/events/device/", "/data/update", Kind::Data),
];

/// The filters the MetaManager's link takes device messages and uploads on, in the broker's
/// form. Broad on purpose: rumqttd keeps a message log per filter (up to `segment_count` ×
/// `segment_bytes` each), so four filters bound the memory where one per topic shape would
/// hold a dozen logs. The price is that our own `$hw` results come back to the link; intake
/// drops them unread. No topic may match two of them (each copy would be acknowledged to its
/// publisher): `+/user/#` also matches `edgemeta$hw/user/...`, hence `$hw/events/#`.
pub fn filters() -> Vec<String> {
    [
        "$hw/events/#",
        "$ke/events/#",
        "SYS/dis/upload_records",
        USER_FILTER,
    ]
    .iter()
    .map(|f| to_broker(f).into_owned())
    .collect()
}

/// Edge apps' user topics, carried to the cloud like edgecore's eventbus does
/// (`edge/pkg/eventbus/mqtt/client.go` `SubTopics`, `handler.go` `handleUploadTopic`).
pub const USER_FILTER: &str = "+/user/#";

/// Whether `topic` (clients' form) is a user topic: second level `user`, first level not `$`
/// (MQTT 3.1.1 §4.7.2: a filter starting with `+` does not match `$` topics).
pub fn is_user_topic(topic: &str) -> bool {
    let mut levels = topic.split('/');
    let first = levels.next().unwrap_or_default();
    !first.starts_with('$') && levels.next() == Some("user")
}

/// The device message a topic (clients' form) carries, if any.
pub fn classify(topic: &str) -> Option<Kind> {
    // `$hw/events/upload/#` matches its parent level too (MQTT 3.1.1 §4.7.1.2).
    if topic == "SYS/dis/upload_records"
        || topic == "$hw/events/upload"
        || topic.starts_with("$hw/events/upload/")
        || is_user_topic(topic)
    {
        return Some(Kind::Upload);
    }
    if let Some(rest) = topic.strip_prefix("$hw/events/node/") {
        let (node, action) = rest.split_once('/')?;
        return (is_level(node) && action == "membership/get").then_some(Kind::MembershipGet);
    }
    LOCAL.iter().find_map(|(prefix, suffix, kind)| {
        let id = topic.strip_prefix(prefix)?.strip_suffix(suffix)?;
        valid_id(id).then(|| kind(id.to_owned()))
    })
}

/// The device message a devicecontroller message on `<ns>/<type>[/<name>]` is, if any.
pub fn classify_cloud(
    operation: &str,
    namespace: &str,
    res_type: &str,
    name: Option<&str>,
) -> Option<Kind> {
    if operation != "update" {
        return None;
    }
    match (namespace, res_type, name) {
        ("node", MEMBERSHIP, _) => Some(Kind::CloudMembership),
        ("node", MEMBERSHIP_DETAIL, _) => Some(Kind::CloudDetail),
        (_, DEVICETWIN, Some(name)) => Some(Kind::CloudTwin(device_id(namespace, name))),
        _ => None,
    }
}

/// `<namespace>/<name>` of a resource → the device id (`_` stands for no namespace).
pub fn device_id(namespace: &str, name: &str) -> String {
    if namespace == NO_NAMESPACE {
        name.to_owned()
    } else {
        format!("{namespace}/{name}")
    }
}

/// The resource `<ns>/<res_type>/<name>` that names device `id` in cloud envelopes.
fn resource_of(id: &str, res_type: &str) -> String {
    match id.split_once('/') {
        Some((namespace, name)) => format!("{namespace}/{res_type}/{name}"),
        None => format!("{NO_NAMESPACE}/{res_type}/{id}"),
    }
}

fn is_level(level: &str) -> bool {
    !level.is_empty() && !level.contains(['/', '+', '#'])
}

/// A device id: one or two topic levels, at most 64 bytes (`device.id` is `varchar(64)`).
pub fn valid_id(id: &str) -> bool {
    id.len() <= 64 && {
        let levels: Vec<&str> = id.split('/').collect();
        levels.len() <= 2 && levels.iter().all(|l| is_level(l))
    }
}

/// Applies one device message. Bad input is answered on the device's result topic and changes
/// nothing; only a store failure is an `Err` (the savepoint is rolled back).
pub async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    match &event.kind {
        Kind::TwinUpdate(id) => twin_update(id, &event.payload, cx).await,
        Kind::TwinGet(id) => twin_get(id, &event.payload, cx).await,
        Kind::StateUpdate(id) => state_update(id, &event.payload, cx).await,
        Kind::MembershipGet => membership_get(&event.payload, cx).await,
        Kind::Upload => upload(&event.topic, &event.payload, cx).await,
        Kind::Data(id) => data(id, &event.topic, &event.payload, cx).await,
        Kind::CloudMembership => cloud_membership(&event.payload, cx).await,
        Kind::CloudDetail => cloud_detail(&event.payload, cx).await,
        Kind::CloudTwin(id) => cloud_twin(id, &event.payload, cx).await,
    }
}

/// What a failed device message's sender hears: a 500 on its result topic, where it has one.
pub fn failure_reply(event: &Event, error: &Error) -> Option<Message> {
    refusal(event, 500, &error.to_string())
}

/// The error result for `event` on its result topic, where it has one.
pub fn refusal(event: &Event, code: u16, reason: &str) -> Option<Message> {
    let (id, suffix) = match &event.kind {
        Kind::TwinUpdate(id) => (id, "/twin/update/result"),
        Kind::TwinGet(id) => (id, "/twin/get/result"),
        Kind::StateUpdate(id) => (id, "/state/update/result"),
        _ => return None,
    };
    let event_id = serde_json::from_slice::<Base>(&event.payload)
        .map(|b| b.event_id)
        .unwrap_or_default();
    Some(local(
        &format!("$hw/events/device/{id}{suffix}"),
        &error_result(&event_id, code, reason),
    ))
}

/// `dealTwinUpdate` / `DealDeviceTwin` with `RestDealType`.
async fn twin_update(id: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = format!("$hw/events/device/{id}/twin/update/result");
    let reason = "Unmarshal update request body failed, please check the request";
    let Some(update) = parse::<TwinUpdate>(cx, &topic, payload, reason) else {
        return Ok(());
    };
    let event_id = update.base.event_id.clone();
    let Some(changes) = update.twin else {
        return refuse(
            cx,
            &topic,
            &event_id,
            400,
            "Update twin error, key:twin does not exist",
            "",
        );
    };
    if let Err(reason) = twin::check_update(&changes) {
        return refuse(cx, &topic, &event_id, 400, &reason, "");
    }
    if cx
        .db
        .device(id)
        .await
        .map_err(Error::store("query device"))?
        .is_none()
    {
        return refuse(
            cx,
            &topic,
            &event_id,
            404,
            "update rejected due to the device is not existed",
            id,
        );
    }
    let mut twins = load_twins(id, cx).await?;
    let now = now_ms();
    let merged = match twin::merge(&mut twins, &changes, Source::Device, now) {
        Ok(merged) => merged,
        Err(reason) => return refuse(cx, &topic, &event_id, 400, &reason, ""),
    };
    write_twins(id, &merged.changed, cx).await?;
    let base = Base {
        event_id: event_id.clone(),
        timestamp: now,
    };
    cx.local.push(local(
        &topic,
        &TwinResult {
            base: base.clone(),
            twin: merged.result,
        },
    ));
    after_twin_change(id, base, merged.document, &twins, merged.sync, cx).await
}

/// The document, the delta and the cloud report that follow every twin change.
async fn after_twin_change(
    id: &str,
    base: Base,
    document: BTreeMap<String, wire::TwinDoc>,
    twins: &BTreeMap<String, Twin>,
    sync: BTreeMap<String, Option<wire::MsgTwin>>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    if !document.is_empty() {
        cx.local.push(local(
            &format!("$hw/events/device/{id}/twin/update/document"),
            &TwinDocument {
                base: base.clone(),
                twin: document,
            },
        ));
    }
    if let Some((twin, delta)) = twin::delta(twins) {
        cx.local.push(local(
            &format!("$hw/events/device/{id}/twin/update/delta"),
            &TwinDelta {
                base: fresh_base(),
                twin,
                delta,
            },
        ));
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

/// `DealGetTwin`.
async fn twin_get(id: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = format!("$hw/events/device/{id}/twin/get/result");
    let Some(base) = parse::<Base>(cx, &topic, payload, "Unmarshal twin info failed") else {
        return Ok(());
    };
    if cx
        .db
        .device(id)
        .await
        .map_err(Error::store("query device"))?
        .is_none()
    {
        let reason = format!("Device {id} not found while getting twin");
        return refuse(cx, &topic, &base.event_id, 404, &reason, "");
    }
    let twin = load_twins(id, cx)
        .await?
        .into_iter()
        .filter(|(_, t)| !t.is_deleted())
        .map(|(k, t)| (k, Some(t.to_msg(false))))
        .collect();
    let result = TwinResult {
        base: Base::now(base.event_id),
        twin,
    };
    cx.local.push(local(&topic, &result));
    Ok(())
}

/// `dealDeviceStateUpdate`. KubeEdge ignores an unknown device or state; a mapper hears why here.
async fn state_update(id: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = format!("$hw/events/device/{id}/state/update/result");
    let reason = "Unmarshal device state failed";
    let Some(update) = parse::<StateUpdate>(cx, &topic, payload, reason) else {
        return Ok(());
    };
    let event_id = update.base.event_id.clone();
    let state = update.state.to_lowercase();
    if !STATES.contains(&state.as_str()) {
        let reason = format!(
            "unknown state {:?}: want one of {}",
            update.state,
            STATES.join(", ")
        );
        return refuse(cx, &topic, &event_id, 400, &reason, "");
    }
    let Some(device) = cx
        .db
        .device(id)
        .await
        .map_err(Error::store("query device"))?
    else {
        return refuse(
            cx,
            &topic,
            &event_id,
            404,
            "update rejected due to the device is not existed",
            id,
        );
    };
    let last_online = if state == "online" || state == "ok" {
        rfc3339(std::time::SystemTime::now())
    } else {
        String::new()
    };
    cx.db
        .set_device_state(id, &update.state, &last_online)
        .await
        .map_err(Error::store("update device state"))?;
    let result = StateResult {
        base: Base::now(if event_id.is_empty() {
            new_msg_id()
        } else {
            event_id
        }),
        device: DeviceState {
            name: device.name,
            state: update.state,
            last_online_time: last_online,
        },
    };
    cx.local.push(local(&topic, &result));
    up(cx, TWIN, "update", &resource_of(id, DEVICESTATE), &result).await
}

/// `dealMembershipGetInner`: answered on this node's topic, whatever node the request named.
async fn membership_get(payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = format!("$hw/events/node/{}/membership/get/result", cx.node);
    let reason = "Unmarshal get membership info failed";
    let Some(base) = parse::<Base>(cx, &topic, payload, reason) else {
        return Ok(());
    };
    let mut devices = Vec::new();
    for row in cx
        .db
        .devices()
        .await
        .map_err(Error::store("query devices"))?
    {
        let attributes = cx
            .db
            .attributes(&row.id)
            .await
            .map_err(Error::store("query device attributes"))?;
        devices.push(Device {
            attributes: (!attributes.is_empty())
                .then(|| attributes.into_iter().map(|(k, v)| (k, Some(v))).collect()),
            ..device_of(row)
        });
    }
    let result = Membership {
        base: Base::now(base.event_id),
        devices,
    };
    cx.local.push(local(&topic, &result));
    Ok(())
}

/// An upload carried to the cloud as KubeEdge's eventbus does: op `upload`, the topic as resource.
async fn upload(topic: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let envelope = Envelope {
        header: header(),
        route: Route {
            source: EVENTBUS.into(),
            group: "user".into(),
            operation: "upload".into(),
            resource: topic.to_owned(),
        },
        content: content_of(payload),
    };
    let cloud = format!("{}/{CLOUD}/{EVENTBUS}/upload/node/upload", cx.root);
    cx.queue_for_cloud(&cloud, &envelope.to_bytes()).await
}

/// A mapper's data: merged into the latest values per property, kept in `meta`, carried up.
async fn data(id: &str, topic: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let Ok(serde_json::Value::Object(incoming)) = serde_json::from_slice(payload) else {
        warn!(error_code = "EM-DEVICE-JSON", %topic, "device data is not a JSON object; dropped");
        return Ok(());
    };
    let key = resource_of(id, DEVICEDATA);
    let stored = cx.db.get(&key).await.map_err(Error::store("query meta"))?;
    let mut latest = stored
        .and_then(|s| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&s).ok())
        .unwrap_or_default();
    for (field, value) in &incoming {
        match (field.as_str(), value, latest.get_mut(field)) {
            ("data", serde_json::Value::Object(new), Some(serde_json::Value::Object(old))) => {
                old.extend(new.clone());
            }
            _ => {
                latest.insert(field.clone(), value.clone());
            }
        }
    }
    let value = serde_json::Value::Object(latest).to_string();
    cx.db
        .upsert(&key, DEVICEDATA, &value)
        .await
        .map_err(Error::store("insert or update meta"))?;
    let envelope = Envelope {
        header: header(),
        route: Route {
            source: EVENTBUS.into(),
            group: "user".into(),
            operation: "upload".into(),
            resource: key.clone(),
        },
        content: content_of(payload),
    };
    let (namespace, _) = key.split_once('/').unwrap_or((NO_NAMESPACE, ""));
    let cloud = format!(
        "{}/{CLOUD}/{EVENTBUS}/upload/{namespace}/{DEVICEDATA}",
        cx.root
    );
    cx.queue_for_cloud(&cloud, &envelope.to_bytes()).await
}

/// `dealMembershipUpdate`: devices added (their twins as a cloud update) and removed.
async fn cloud_membership(content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let update: MembershipUpdate = match serde_json::from_slice(content) {
        Ok(update) => update,
        Err(e) => return bad_cloud_content("membership", &e),
    };
    for device in update.added_devices.unwrap_or_default() {
        add_device(device, cx).await?;
    }
    for device in update.removed_devices.unwrap_or_default() {
        remove_device(device, cx).await?;
    }
    Ok(())
}

/// `dealMembershipDetail`: the cloud's full list; what the node has beyond it is removed.
async fn cloud_detail(content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let detail: Membership = match serde_json::from_slice(content) {
        Ok(detail) => detail,
        Err(e) => return bad_cloud_content("membership detail", &e),
    };
    let listed: Vec<String> = detail.devices.iter().map(|d| d.id.clone()).collect();
    for device in detail.devices {
        add_device(device, cx).await?;
    }
    for row in cx
        .db
        .devices()
        .await
        .map_err(Error::store("query devices"))?
    {
        if !listed.contains(&row.id) {
            let id = row.id.clone();
            remove_device(
                Device {
                    id,
                    ..Device::default()
                },
                cx,
            )
            .await?;
        }
    }
    Ok(())
}

/// `dealTwinSync`: the devicecontroller's desired values.
async fn cloud_twin(id: &str, content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let update: TwinUpdate = match serde_json::from_slice(content) {
        Ok(update) => update,
        Err(e) => return bad_cloud_content("device twin", &e),
    };
    if cx
        .db
        .device(id)
        .await
        .map_err(Error::store("query device"))?
        .is_none()
    {
        warn!(error_code = "EM-DEVICE-UNKNOWN", device = %id, "desired twin for a device this node does not have; ignored");
        return Ok(());
    }
    let changes = update.twin.unwrap_or_default();
    sync_twins(id, &update.base.event_id, &changes, cx).await
}

/// Applies a cloud twin update to a stored device and tells the device and the cloud.
async fn sync_twins(
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
async fn add_device(device: Device, cx: &mut Context<'_>) -> Result<(), Error> {
    if !valid_id(&device.id) {
        warn!(error_code = "EM-DEVICE-ID", id = %device.id, "device id is not one or two topic levels of at most 64 bytes; not added");
        return Ok(());
    }
    let known = cx
        .db
        .device(&device.id)
        .await
        .map_err(Error::store("query device"))?
        .is_some();
    if !known {
        cx.db
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

async fn remove_device(device: Device, cx: &mut Context<'_>) -> Result<(), Error> {
    let known = cx
        .db
        .device(&device.id)
        .await
        .map_err(Error::store("query device"))?
        .is_some();
    if !known {
        return Ok(());
    }
    cx.db
        .delete_device(&device.id)
        .await
        .map_err(Error::store("delete device"))?;
    info!(device = %device.id, "device removed");
    announce(cx, None, Some(device));
    Ok(())
}

/// `MarshalMembershipUpdate`: one message per device; twins without versions, deleted as null.
fn announce(cx: &mut Context<'_>, added: Option<Device>, removed: Option<Device>) {
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
    let topic = format!("$hw/events/node/{}/membership/updated", cx.node);
    cx.local.push(local(&topic, &update));
}

/// `DealMsgAttr` (sync): the cloud's set replaces the stored one; devices hear what changed.
async fn set_attributes(
    id: &str,
    attributes: &BTreeMap<String, Option<wire::MsgAttr>>,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let before = cx
        .db
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
    cx.db
        .set_attributes(id, &after)
        .await
        .map_err(Error::store("update device attributes"))?;
    let update = wire::AttrUpdate {
        base: fresh_base(),
        attributes: changed,
    };
    cx.local
        .push(local(&format!("$hw/events/device/{id}/updated"), &update));
    Ok(())
}

/// Asks the cloud for the full membership (`detailRequest`) when the cloud link comes up, so
/// devices removed while the node was away go. A node without devices does not ask: whatever
/// is added reaches it as a membership update through its persistent cloud session.
pub async fn request_detail(cx: &mut Context<'_>) -> Result<(), Error> {
    if !cx
        .db
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
        group_id: cx.node.to_owned(),
        timestamp: now_ms(),
    };
    let resource = format!("node/{MEMBERSHIP_DETAIL}");
    up(cx, TWIN, "query", &resource, &request).await
}

async fn load_twins(id: &str, cx: &mut Context<'_>) -> Result<BTreeMap<String, Twin>, Error> {
    cx.db
        .twins(id)
        .await
        .map_err(Error::store("query device twin"))
}

async fn write_twins(id: &str, changed: &[Twin], cx: &mut Context<'_>) -> Result<(), Error> {
    for twin in changed {
        cx.db
            .write_twin(id, twin)
            .await
            .map_err(Error::store("update device twin"))?;
    }
    Ok(())
}

/// Queues a report for the cloud on `<root>/cloud/<from>/<op>/<ns>/<type>`.
async fn up(
    cx: &mut Context<'_>,
    from: &str,
    operation: &str,
    resource: &str,
    content: &impl Serialize,
) -> Result<(), Error> {
    let envelope = Envelope {
        header: header(),
        route: Route {
            source: from.into(),
            group: "resource".into(),
            operation: operation.into(),
            resource: resource.into(),
        },
        content: to_raw(content),
    };
    let topic = edgemeta_protocol::outbound(cx.root, CLOUD, from, operation, resource);
    cx.queue_for_cloud(&topic, &envelope.to_bytes()).await
}

/// A device's JSON payload as `T`; otherwise answers 400 with `reason` and the parser's error on
/// `topic` and gives `None` (KubeEdge's result has no event id then: it could not be read).
fn parse<T: serde::de::DeserializeOwned>(
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
fn refuse(
    cx: &mut Context<'_>,
    topic: &str,
    event_id: &str,
    code: u16,
    reason: &str,
    detail: &str,
) -> Result<(), Error> {
    warn!(error_code = "EM-DEVICE-REFUSED", %topic, code, reason, detail, "device message refused");
    cx.refused = true;
    cx.local
        .push(local(topic, &error_result(event_id, code, reason)));
    Ok(())
}

fn error_result(event_id: &str, code: u16, reason: &str) -> ErrorResult {
    ErrorResult {
        base: Base::now(event_id),
        code,
        reason: reason.to_owned(),
    }
}

/// A cloud message whose content does not parse: logged, and acknowledged (redelivery would
/// not make it parse).
fn bad_cloud_content(what: &str, error: &serde_json::Error) -> Result<(), Error> {
    warn!(error_code = "EM-DEVICE-CLOUD-JSON", what, error = %error, "devicecontroller message not applied");
    Ok(())
}

/// A message for a device topic (clients' form), published after the commit. Topic and payload
/// are trimmed to size: rumqttd keeps them in every matching filter's log until it is full.
fn local(topic: &str, body: &impl Serialize) -> Message {
    let mut topic = to_broker(topic).into_owned();
    topic.shrink_to_fit();
    let mut payload = to_json(body);
    payload.shrink_to_fit();
    Message::new(topic, payload)
}

fn to_json(body: &impl Serialize) -> Vec<u8> {
    serde_json::to_vec(body).unwrap_or_default()
}

fn to_raw(body: &impl Serialize) -> Box<RawValue> {
    serde_json::value::to_raw_value(body).unwrap_or_else(|_| raw("null"))
}

/// An upload's payload as envelope content: its JSON, or a JSON string if it is not JSON.
fn content_of(payload: &[u8]) -> Box<RawValue> {
    match serde_json::from_slice::<Box<RawValue>>(payload) {
        Ok(json) => json,
        Err(_) => edgemeta_protocol::json_string(&String::from_utf8_lossy(payload)),
    }
}

fn header() -> Header {
    Header {
        msg_id: new_msg_id(),
        parent_msg_id: None,
        timestamp: now_ms(),
        resourceversion: None,
        sync: None,
    }
}

fn fresh_base() -> Base {
    Base::now(new_msg_id())
}

fn device_of(row: DeviceRow) -> Device {
    Device {
        id: row.id,
        name: row.name,
        description: row.description,
        state: row.state,
        last_online: row.last_online,
        attributes: None,
        twin: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_name_one_or_two_level_device_ids() {
        assert_eq!(
            classify("$hw/events/device/thermo-1/twin/update"),
            Some(Kind::TwinUpdate("thermo-1".into()))
        );
        assert_eq!(
            classify("$hw/events/device/default/thermo-2/twin/get"),
            Some(Kind::TwinGet("default/thermo-2".into()))
        );
        assert_eq!(
            classify("$ke/events/device/d/data/update"),
            Some(Kind::Data("d".into()))
        );
        assert_eq!(
            classify("$hw/events/node/n1/membership/get"),
            Some(Kind::MembershipGet)
        );
        assert_eq!(classify("$hw/events/upload/a/b"), Some(Kind::Upload));
        assert_eq!(classify("SYS/dis/upload_records"), Some(Kind::Upload));
        assert_eq!(classify("$hw/events/upload"), Some(Kind::Upload));
        assert_eq!(classify("$hw/events/uploads/x"), None);
        assert_eq!(classify("factory/user/line-1/alarm"), Some(Kind::Upload));
        assert_eq!(classify("factory/user"), Some(Kind::Upload));
        assert_eq!(classify("/user/x"), Some(Kind::Upload));
        assert_eq!(classify("$hw/user/x"), None);
        assert_eq!(classify("factory/users/x"), None);
        assert_eq!(classify("user/x"), None);
        // Our own results, three-level ids and wildcards are not requests.
        assert_eq!(classify("$hw/events/device/d/twin/update/result"), None);
        assert_eq!(classify("$hw/events/device/a/b/c/twin/update"), None);
        assert_eq!(classify("$hw/events/device//twin/update"), None);
    }

    #[test]
    fn filters_are_in_the_brokers_form() {
        assert_eq!(
            filters(),
            [
                "edgemeta$hw/events/#",
                "edgemeta$ke/events/#",
                "SYS/dis/upload_records",
                "+/user/#"
            ]
        );
        // No topic reaches the link twice.
        for topic in [
            "edgemeta$hw/user/x",
            "edgemeta$hw/events/user/x",
            "a/user/b",
        ] {
            let matching = filters()
                .iter()
                .filter(|f| edgemeta_broker::matches(topic, f))
                .count();
            assert_eq!(matching, 1, "{topic}");
        }
    }

    #[test]
    fn ids_map_to_resources_and_back() {
        assert_eq!(resource_of("thermo-1", DEVICETWIN), "_/devicetwin/thermo-1");
        assert_eq!(
            resource_of("default/t2", DEVICETWIN),
            "default/devicetwin/t2"
        );
        assert_eq!(device_id("_", "thermo-1"), "thermo-1");
        assert_eq!(device_id("default", "t2"), "default/t2");
        assert!(!valid_id(&"x".repeat(65)));
    }
}
