//! The crate's one error type: why a payload, a resource string, a topic or an MQTT URL cannot
//! be read. `Display` is the text a requester or an operator reads; callers add their own key
//! (`cloud.url ...`) or code where they report it.

/// What can go wrong reading the protocol.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A payload that is neither JSON nor UTF-8 text.
    #[error("payload is neither JSON nor UTF-8 text")]
    NotText,
    /// Text that opens like a JSON object or array but does not parse.
    #[error("malformed JSON: {0}")]
    MalformedJson(#[source] serde_json::Error),
    /// A full envelope whose `header` or `route` is not the expected object.
    #[error("invalid envelope: {0}")]
    InvalidEnvelope(#[source] serde_json::Error),
    /// A resource string that is not `<namespace>/<type>[/<id>]`.
    #[error("invalid resource {0:?}: want <namespace>/<type>[/<id>]")]
    InvalidResource(String),
    /// A topic with no sender to answer: not `<root>/<module>/<from>/<operation>/...`.
    #[error(
        "topic {topic:?} is not <root>/{module}/<from>/<operation>/<namespace>/<type>[/<name>]"
    )]
    UnaddressableTopic { topic: String, module: String },
    /// An MQTT URL with another scheme.
    #[error("{url:?} must start with mqtt:// or mqtts://")]
    UrlScheme { url: String },
    /// An MQTT URL whose port is not a number of 16 bits.
    #[error("{url:?}: bad port {port:?}")]
    UrlPort { url: String, port: String },
    /// An MQTT URL without a host.
    #[error("{url:?} has no host")]
    UrlHost { url: String },
}
