//! KubeEdge's `model.Message` as docs/protocol.md §1 describes it, and the cloud broker's topics
//! (§5): `<root>/<node>/down/edgecontroller/<op>/<ns>/<type>` and `<root>/<node>/up/...`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The message header.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Header {
    pub msg_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_msg_id: Option<String>,
    #[serde(default)]
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resourceversion: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<bool>,
}

/// Where a message goes.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Route {
    pub source: String,
    #[serde(default)]
    pub group: String,
    pub operation: String,
    pub resource: String,
}

/// The envelope.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Envelope {
    pub header: Header,
    pub route: Route,
    #[serde(default)]
    pub content: Value,
}

/// The source every message of this controller names (KubeEdge's `edgecontroller`).
pub const SOURCE: &str = "edgecontroller";

/// The source of device membership and twin messages (KubeEdge's `devicecontroller`).
pub const DEVICE_SOURCE: &str = "devicecontroller";

/// The module and group a message about `resource` comes from: device membership and twins
/// are the devicecontroller's (group `twin`), everything else the edgecontroller's.
pub fn source_of(resource: &str) -> (&'static str, &'static str) {
    let mut levels = resource.splitn(3, '/');
    let (ns, kind) = (levels.next(), levels.next());
    match (ns, kind) {
        (Some("node"), Some("membership" | "membershipdetail")) | (_, Some("devicetwin")) => {
            (DEVICE_SOURCE, "twin")
        }
        // The objects DMI mappers get (KubeEdge's `sendDeviceMsg`: group `resource`).
        (_, Some("device" | "devicemodel")) => (DEVICE_SOURCE, "resource"),
        _ => (SOURCE, "resource"),
    }
}

fn now_ms() -> i64 {
    let now = time::OffsetDateTime::now_utc();
    i64::try_from(now.unix_timestamp_nanos() / 1_000_000).unwrap_or_default()
}

/// A fresh message id.
pub fn new_msg_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

impl Envelope {
    /// A message from the edgecontroller about `resource` (`<ns>/<type>/<name>`).
    pub fn new(operation: &str, resource: String, content: Value, rv: Option<String>) -> Envelope {
        Envelope {
            header: Header {
                msg_id: new_msg_id(),
                parent_msg_id: None,
                timestamp: now_ms(),
                resourceversion: rv,
                sync: None,
            },
            route: Route {
                source: source_of(&resource).0.to_owned(),
                group: source_of(&resource).1.to_owned(),
                operation: operation.to_owned(),
                resource,
            },
            content,
        }
    }

    /// A `response` or `error` answering `request`.
    pub fn reply(operation: &str, request: &Envelope, content: Value) -> Envelope {
        let mut reply = Envelope::new(operation, request.route.resource.clone(), content, None);
        reply.header.parent_msg_id = Some(request.header.msg_id.clone());
        reply
    }
}

/// What an `up` topic says: `<root>/<node>/up/<from>/<op>/<ns>/<type>[/<name>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpTopic {
    pub node: String,
    pub from: String,
    pub operation: String,
    pub namespace: String,
    pub kind: String,
    pub name: Option<String>,
}

impl UpTopic {
    /// Parses an up topic under `root`; `None` for anything else.
    pub fn parse(root: &str, topic: &str) -> Option<UpTopic> {
        let rest = topic.strip_prefix(root)?.strip_prefix('/')?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [node, "up", from, op, ns, kind, tail @ ..] if tail.len() <= 1 => Some(UpTopic {
                node: (*node).to_owned(),
                from: (*from).to_owned(),
                operation: (*op).to_owned(),
                namespace: (*ns).to_owned(),
                kind: (*kind).to_owned(),
                name: tail.first().map(|n| (*n).to_owned()),
            }),
            _ => None,
        }
    }
}

/// `<root>/<node>/down/<source>/<op>/<ns>/<type>`: the type-level down topic (§5).
pub fn down_topic(root: &str, node: &str, operation: &str, resource: &str) -> String {
    let mut parts = resource.splitn(3, '/');
    let ns = parts.next().unwrap_or_default();
    let kind = parts.next().unwrap_or_default();
    let source = source_of(resource).0;
    format!("{root}/{node}/down/{source}/{operation}/{ns}/{kind}")
}

/// The name in an up message: the topic's, else the envelope resource's third level.
pub fn resource_name(topic: &UpTopic, envelope: &Envelope) -> Option<String> {
    topic.name.clone().or_else(|| {
        envelope
            .route
            .resource
            .splitn(3, '/')
            .nth(2)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_topics_parse_and_down_topics_are_type_level() {
        let t = UpTopic::parse("kubeedge", "kubeedge/n1/up/edged/update/default/podstatus")
            .expect("up");
        assert_eq!(t.node, "n1");
        assert_eq!(t.operation, "update");
        assert_eq!(t.kind, "podstatus");
        assert_eq!(t.name, None);
        assert!(UpTopic::parse("kubeedge", "kubeedge/n1/down/x/y/z/w").is_none());
        assert!(UpTopic::parse("kubeedge", "other/n1/up/edged/update/default/podstatus").is_none());
        assert_eq!(
            down_topic("kubeedge", "n1", "insert", "default/pod/web"),
            "kubeedge/n1/down/edgecontroller/insert/default/pod"
        );
        assert_eq!(
            down_topic("kubeedge", "n1", "update", "default/devicetwin/t1"),
            "kubeedge/n1/down/devicecontroller/update/default/devicetwin"
        );
        assert_eq!(
            source_of("node/membership/default.t1"),
            ("devicecontroller", "twin")
        );
    }
}
