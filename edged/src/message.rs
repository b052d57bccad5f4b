//! The KubeEdge envelope as edged sends and reads it, and the v2 topics (protocol §1–§2):
//! edged publishes on `<root>/meta/edged/<op>/<ns>/<type>` with the object in `route.resource`,
//! and reads `<root>/edged/<from>/<op>/<ns>/<type>[/<name>]`.

use edgemeta_metamanager::envelope::{new_msg_id, null, Envelope, Route};
use serde_json::Value;

use crate::Error;

/// A message for edged, with the topic's levels applied (the topic wins over the envelope).
#[derive(Debug, Clone, PartialEq)]
pub struct Incoming {
    pub from: String,
    pub operation: String,
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
    format!("{root}/edged/#")
}

/// `<root>/meta/edged/<operation>/<namespace>/<type>`.
pub fn topic(root: &str, operation: &str, namespace: &str, resource_type: &str) -> String {
    format!("{root}/meta/edged/{operation}/{namespace}/{resource_type}")
}

/// A fresh message id.
pub fn new_id() -> String {
    new_msg_id()
}

/// An envelope from edged (built as the MetaManager builds its own); returns `(msg_id, payload)`.
pub fn envelope(
    parent: Option<&str>,
    operation: &str,
    resource: &str,
    content: Value,
) -> (String, Vec<u8>) {
    let route = Route {
        source: "edged".to_owned(),
        group: "meta".to_owned(),
        operation: operation.to_owned(),
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
    let rest = topic
        .strip_prefix(root)
        .and_then(|t| t.strip_prefix("/edged/"))
        .ok_or_else(|| bad("not under <root>/edged/"))?;
    let levels: Vec<&str> = rest.split('/').collect();
    if !(4..=5).contains(&levels.len()) || levels.iter().any(|l| l.is_empty()) {
        return Err(bad(
            "want <root>/edged/<from>/<op>/<namespace>/<type>[/<name>]",
        ));
    }
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
    let name = levels
        .get(4)
        .map(|n| (*n).to_owned())
        .or_else(|| resource.split('/').nth(2).map(str::to_owned))
        .or_else(|| {
            content
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .filter(|n| !n.is_empty());
    Ok(Incoming {
        from: levels[0].to_owned(),
        operation: levels[1].to_owned(),
        namespace: levels[2].to_owned(),
        resource_type: levels[3].to_owned(),
        name,
        msg_id: header["msg_id"].as_str().map_or_else(new_id, str::to_owned),
        parent_msg_id: header["parent_msg_id"].as_str().map(str::to_owned),
        resource: if resource.is_empty() {
            levels[2..].join("/")
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
        let (_, payload) = envelope(Some("p1"), "insert", "default/pod/web", json!({"spec": {}}));
        let m =
            parse("ke", "ke/edged/edgecontroller/insert/default/pod", &payload).expect("parses");
        assert_eq!(
            (
                m.from.as_str(),
                m.operation.as_str(),
                m.namespace.as_str(),
                m.resource_type.as_str()
            ),
            ("edgecontroller", "insert", "default", "pod")
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
}
