//! The KubeEdge envelope as edged sends and reads it, and the v2 topics (protocol §1–§2):
//! edged publishes on `<root>/meta/edged/<op>/<ns>/<type>` with the object in `route.resource`,
//! and reads `<root>/edged/<from>/<op>/<ns>/<type>[/<name>]`.

use edgemeta_protocol::{new_msg_id, null, outbound, Envelope, Operation, Route};
use edgemeta_protocol::{InboundTopic, EDGED, META};
use serde_json::Value;

use crate::Error;

/// A message for edged, with the topic's levels applied (the topic wins over the envelope).
#[derive(Debug, Clone, PartialEq)]
pub struct Incoming {
    pub from: String,
    /// `None` for an operation this node does not implement (the agent ignores it).
    pub operation: Option<Operation>,
    pub namespace: String,
    pub resource_type: String,
    /// From the topic, else `route.resource`, else `content.metadata.name`.
    pub name: Option<String>,
    pub msg_id: String,
    pub parent_msg_id: Option<String>,
    /// `route.resource` as sent (answered as is by volume replies).
    pub resource: String,
    pub content: Value,
}

/// The subscription that brings everything addressed to edged.
pub fn filter(root: &str) -> String {
    format!("{root}/{EDGED}/#")
}

/// `<root>/meta/edged/<operation>/<namespace>/<type>`.
pub fn topic(root: &str, operation: Operation, namespace: &str, resource_type: &str) -> String {
    outbound(
        root,
        META,
        EDGED,
        operation.as_str(),
        &format!("{namespace}/{resource_type}"),
    )
}

/// A fresh message id.
pub fn new_id() -> String {
    new_msg_id()
}

/// An envelope from edged (built as the MetaManager builds its own); returns `(msg_id, payload)`.
pub fn envelope(
    parent: Option<&str>,
    operation: Operation,
    resource: &str,
    content: Value,
) -> (String, Vec<u8>) {
    let route = Route {
        source: EDGED.to_owned(),
        group: META.to_owned(),
        operation: operation.as_str().to_owned(),
        resource: resource.to_owned(),
    };
    let content = serde_json::value::to_raw_value(&content).unwrap_or_else(|_| null());
    let mut envelope = Envelope::new(route, content);
    envelope.header.parent_msg_id = parent.map(str::to_owned);
    (envelope.header.msg_id.clone(), envelope.to_bytes())
}

/// Reads a message published on `topic` under `<root>/edged/`.
pub fn parse(root: &str, topic: &str, payload: &[u8]) -> Result<Incoming, Error> {
    let bad = |detail: &str| Error::Message {
        topic: topic.to_owned(),
        detail: detail.to_owned(),
    };
    // The MetaManager's grammar, stricter: an operation and a well-formed resource too.
    let inbound = InboundTopic::addressed_to(root, EDGED, topic)
        .ok()
        .filter(|t| !t.operation.is_empty());
    let Some((inbound, addressed)) =
        inbound.and_then(|t| t.resource().ok().map(|resource| (t, resource)))
    else {
        return Err(bad(
            "want <root>/edged/<from>/<op>/<namespace>/<type>[/<name>]",
        ));
    };
    let value: Value = if payload.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(payload).map_err(|e| bad(&format!("not JSON: {e}")))?
    };
    let (header, route, content) = match &value {
        Value::Object(map) if map.contains_key("header") && map.contains_key("route") => (
            map.get("header").cloned().unwrap_or(Value::Null),
            map.get("route").cloned().unwrap_or(Value::Null),
            map.get("content").cloned().unwrap_or(Value::Null),
        ),
        _ => (Value::Null, Value::Null, value),
    };
    let resource = route["resource"].as_str().unwrap_or_default().to_owned();
    let name = addressed
        .id()
        .map(str::to_owned)
        .or_else(|| resource.split('/').nth(2).map(str::to_owned))
        .or_else(|| {
            content
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .filter(|n| !n.is_empty());
    Ok(Incoming {
        from: inbound.from.to_owned(),
        operation: inbound.operation(),
        namespace: addressed.namespace().to_owned(),
        resource_type: addressed.res_type().to_owned(),
        name,
        msg_id: header["msg_id"].as_str().map_or_else(new_id, str::to_owned),
        parent_msg_id: header["parent_msg_id"].as_str().map(str::to_owned),
        resource: if resource.is_empty() {
            addressed.key().to_owned()
        } else {
            resource
        },
        content,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_topic_names_the_type_and_the_envelope_the_object() {
        let (_, payload) = envelope(
            Some("p1"),
            Operation::Insert,
            "default/pod/web",
            json!({"spec": {}}),
        );
        let m =
            parse("ke", "ke/edged/edgecontroller/insert/default/pod", &payload).expect("parses");
        assert_eq!(
            (
                m.from.as_str(),
                m.operation,
                m.namespace.as_str(),
                m.resource_type.as_str()
            ),
            ("edgecontroller", Some(Operation::Insert), "default", "pod")
        );
        assert_eq!(m.name.as_deref(), Some("web"));
        assert_eq!(m.parent_msg_id.as_deref(), Some("p1"));
    }

    #[test]
    fn a_bare_payload_takes_its_name_from_metadata() {
        let m = parse(
            "ke",
            "ke/edged/x/insert/ns/pod",
            br#"{"metadata":{"name":"a"}}"#,
        )
        .expect("parses");
        assert_eq!(m.name.as_deref(), Some("a"));
        assert!(parse("ke", "ke/edged/x/insert/ns", b"{}").is_err());
        assert!(parse("ke", "ke/edged/x/insert/ns/pod", b"{oops").is_err());
        assert!(parse("ke", "other/edged/x/insert/ns/pod", b"").is_err());
    }

    #[test]
    fn other_shapes_are_refused_and_unknown_operations_are_kept_as_none() {
        for topic in [
            "ke/edged//insert/ns/pod",
            "ke/edged/x//ns/pod",
            "ke/edged/x/insert/ns/pod/a/b",
            "ke/edged/x/insert/ns//a",
            "ke/edged/x/insert/ns/pod/",
            "ke/edgedx/x/insert/ns/pod",
        ] {
            assert!(parse("ke", topic, b"").is_err(), "{topic}");
        }
        let m = parse("ke", "ke/edged/x/frobnicate/ns/pod/a", b"").expect("parses");
        assert_eq!(
            (m.operation, m.name.as_deref(), m.resource.as_str()),
            (None, Some("a"), "ns/pod/a")
        );
    }

    #[test]
    fn edged_publishes_to_the_metamanager_by_type() {
        assert_eq!(
            topic("ke", Operation::Update, "default", "podstatus"),
            "ke/meta/edged/update/default/podstatus"
        );
    }
}
