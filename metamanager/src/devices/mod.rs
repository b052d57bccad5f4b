//! KubeEdge's DeviceTwin, the domain part: devices' topics and ids, the JSON shapes
//! ([`wire`]), the twin merge ([`twin`]) and how device messages are made. What each device
//! message does is in [`crate::handlers`], one file per family (docs/devices.md).

pub mod feed;
pub mod twin;
pub mod wire;

use bytes::Bytes;
use edgemeta_broker::Message;
use serde::Serialize;
use serde_json::value::RawValue;

use crate::store::DeviceRow;
use edgemeta_protocol::{new_msg_id, now_ms, raw, Header};
use wire::{Base, Device, ErrorResult};

/// The cloud module whose device messages this part applies (protocol §2 `<from>`).
pub const DEVICECONTROLLER: &str = "devicecontroller";
/// The module name on what the node reports to the cloud (KubeEdge's `twin`).
pub const TWIN: &str = "twin";
/// The module name on uploads carried to the cloud (KubeEdge's `eventbus`).
pub const EVENTBUS: &str = "eventbus";
/// Namespace of a device whose id has none (KubeEdge < 1.15): no Kubernetes namespace has `_`.
pub const NO_NAMESPACE: &str = "_";

/// Resource types (`<ns>/<type>/<name>`) of device messages.
pub const DEVICETWIN: &str = "devicetwin";
pub const DEVICESTATE: &str = "devicestate";
pub const DEVICEDATA: &str = "devicedata";
pub const MEMBERSHIP: &str = "membership";
pub const MEMBERSHIP_DETAIL: &str = "membershipdetail";

/// The device states a mapper may report, compared lower-cased: KubeEdge's five
/// (`dtcommon/common.go` `DeviceStatus*`) and the two more mappers-go sends
/// (`mappers/common/const.go` `DEVSTDISCONN`, `DEVSTERR`), which KubeEdge drops unrecorded.
pub const STATES: [&str; 7] = [
    "online",
    "offline",
    "ok",
    "unknown",
    "unhealthy",
    "disconnected",
    "error",
];

/// A device message for the store worker: `payload` is the MQTT payload of a local message, or
/// the envelope's content of a cloud one.
#[derive(Debug, Clone)]
pub struct Event {
    /// Its family: the row of `handlers::DEVICES` that took it.
    pub family: usize,
    /// The device id its topic names (empty for families whose topics name none).
    pub id: String,
    /// The topic it came on, in the clients' form (`$hw/...`).
    pub topic: String,
    pub payload: Bytes,
    /// A devicecontroller message's `msg_id` and resource: once applied, the node answers
    /// `response "OK"` so the cloud's acked delivery stops resending it.
    pub ack: Option<(String, String)>,
}

/// The filters the MetaManager's link takes device messages and uploads on: four broad filters
/// rather than one per topic shape. The link never gets back what the MetaManager publishes
/// itself (No Local); intake drops the node's results if one comes from another module. No
/// topic may match two of them (each copy would be acknowledged to its publisher): `+/user/#`
/// gets no `$hw/...` or `$ke/...` topic (MQTT §4.7.2).
pub fn filters() -> Vec<String> {
    [
        "$hw/events/#",
        "$ke/events/#",
        "SYS/dis/upload_records",
        USER_FILTER,
    ]
    .iter()
    .map(|f| (*f).to_owned())
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

/// `<namespace>/<name>` of a resource → the device id (`_` stands for no namespace).
pub fn device_id(namespace: &str, name: &str) -> String {
    if namespace == NO_NAMESPACE {
        name.to_owned()
    } else {
        format!("{namespace}/{name}")
    }
}

/// The resource `<ns>/<res_type>/<name>` that names device `id` in cloud envelopes.
pub fn resource_of(id: &str, res_type: &str) -> String {
    match id.split_once('/') {
        Some((namespace, name)) => format!("{namespace}/{res_type}/{name}"),
        None => format!("{NO_NAMESPACE}/{res_type}/{id}"),
    }
}

pub fn is_level(level: &str) -> bool {
    !level.is_empty() && !level.contains(['/', '+', '#'])
}

/// A device id: one or two topic levels, at most 64 bytes (`device.id` is `varchar(64)`).
pub fn valid_id(id: &str) -> bool {
    id.len() <= 64 && {
        let levels: Vec<&str> = id.split('/').collect();
        levels.len() <= 2 && levels.iter().all(|l| is_level(l))
    }
}

/// `$hw/events/device/<id><suffix>`: a device's own topics (results, documents, deltas).
pub fn device_topic(id: &str, suffix: &str) -> String {
    format!("$hw/events/device/{id}{suffix}")
}

/// `$hw/events/node/<node><suffix>`: the node's membership topics.
pub fn node_topic(node: &str, suffix: &str) -> String {
    format!("$hw/events/node/{node}{suffix}")
}

/// The event id of a device payload that has one, else empty.
pub fn event_id_of(payload: &[u8]) -> String {
    serde_json::from_slice::<Base>(payload)
        .map(|b| b.event_id)
        .unwrap_or_default()
}

/// KubeEdge's error result: the event id, a code and why.
pub fn error_result(event_id: &str, code: u16, reason: &str) -> ErrorResult {
    ErrorResult {
        base: Base::now(event_id),
        code,
        reason: reason.to_owned(),
    }
}

/// A message for a device topic (clients' form), published after the commit. Topic and payload
/// are trimmed to size: a reader's queue may keep them a while.
pub fn local(topic: &str, body: &impl Serialize) -> Message {
    let mut topic = topic.to_owned();
    topic.shrink_to_fit();
    let mut payload = to_json(body);
    payload.shrink_to_fit();
    Message::new(topic, payload)
}

fn to_json(body: &impl Serialize) -> Vec<u8> {
    serde_json::to_vec(body).unwrap_or_default()
}

pub fn to_raw(body: &impl Serialize) -> Box<RawValue> {
    serde_json::value::to_raw_value(body).unwrap_or_else(|_| raw("null"))
}

/// An upload's payload as envelope content: its JSON, or a JSON string if it is not JSON.
pub fn content_of(payload: &[u8]) -> Box<RawValue> {
    match serde_json::from_slice::<Box<RawValue>>(payload) {
        Ok(json) => json,
        Err(_) => edgemeta_protocol::json_string(&String::from_utf8_lossy(payload)),
    }
}

pub fn header() -> Header {
    Header {
        msg_id: new_msg_id(),
        parent_msg_id: None,
        timestamp: now_ms(),
        resourceversion: None,
        sync: None,
    }
}

pub fn fresh_base() -> Base {
    Base::now(new_msg_id())
}

pub fn device_of(row: DeviceRow) -> Device {
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
    fn filters_name_dollar_topics_as_clients_do() {
        assert_eq!(
            filters(),
            [
                "$hw/events/#",
                "$ke/events/#",
                "SYS/dis/upload_records",
                "+/user/#"
            ]
        );
        // No topic reaches the link twice; a `$hw` user topic not at all.
        for (topic, times) in [("$hw/user/x", 0), ("$hw/events/user/x", 1), ("a/user/b", 1)] {
            let matching = filters()
                .iter()
                .filter(|f| edgemeta_broker::matches(topic, f))
                .count();
            assert_eq!(matching, times, "{topic}");
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
