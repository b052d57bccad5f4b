use edgemeta_protocol::Error as ProtocolError;

use crate::store::StoreError;

/// Everything a message can fail with. `Display` is the text the requester reads in its `error`
/// reply; [`Error::code`] is the stable code in the log line.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unsupported operation {0:?}")]
    UnsupportedOperation(String),
    /// [`ProtocolError::InvalidResource`].
    #[error(transparent)]
    InvalidResource(ProtocolError),
    /// A type-level topic, and the content belongs to another namespace (protocol §2, v2).
    #[error("namespace mismatch: the topic names namespace {topic:?}, content.metadata.namespace is {content:?}")]
    NamespaceMismatch { topic: String, content: String },
    /// A type-level topic for an operation on one object, and nothing names the object.
    #[error("no resource name: the topic has no <name> level and neither route.resource nor content.metadata.name gives one{}", invalid_name(.metadata_name))]
    NoName { metadata_name: Option<String> },
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    PayloadTooLarge { size: usize, limit: usize },
    /// A payload that is not a message: [`ProtocolError::NotText`], `MalformedJson` or
    /// `InvalidEnvelope`.
    #[error(transparent)]
    Envelope(ProtocolError),
    #[error("invalid {what} content: {reason}")]
    Content { what: &'static str, reason: String },
    #[error("{action} failed: {source}")]
    Store {
        action: &'static str,
        source: libsql::Error,
    },
    #[error("no answer from the cloud to query {resource} within {waited_ms} ms and nothing stored locally")]
    RemoteTimeout { resource: String, waited_ms: u64 },
    #[error("edged did not answer {operation} {resource} within {waited_ms} ms")]
    VolumeTimeout {
        operation: String,
        resource: String,
        waited_ms: u64,
    },
    #[error("outbox full: {entries} messages ({bytes} bytes) wait for the cloud; change refused")]
    OutboxFull { entries: u64, bytes: u64 },
    #[error("commit failed: {0}")]
    Commit(String),
    #[error("store unavailable: {0}")]
    Open(#[from] StoreError),
    #[error("the metamanager is shutting down")]
    Closed,
    #[error("the {task} task panicked")]
    Panicked { task: &'static str },
    #[error("the {task} task ended while the node was running")]
    Ended { task: &'static str },
}

impl Error {
    /// Wraps a store failure with what was being done, in KubeEdge's words.
    pub fn store(action: &'static str) -> impl FnOnce(libsql::Error) -> Error {
        move |source| Error::Store { action, source }
    }

    /// A stable code for logs and alerts.
    pub fn code(&self) -> &'static str {
        match self {
            Error::UnsupportedOperation(_) => "EM-META-OPERATION",
            Error::InvalidResource(_) => "EM-META-RESOURCE",
            Error::NamespaceMismatch { .. } => "EM-META-NAMESPACE",
            Error::NoName { .. } => "EM-META-NO-NAME",
            Error::PayloadTooLarge { .. } => "EM-META-PAYLOAD-SIZE",
            Error::Envelope(ProtocolError::NotText) => "EM-META-PAYLOAD-BINARY",
            Error::Envelope(ProtocolError::MalformedJson(_)) => "EM-META-JSON",
            Error::Envelope(_) => "EM-META-ENVELOPE",
            Error::Content { .. } => "EM-META-CONTENT",
            Error::Store { .. } => "EM-STORE-WRITE",
            Error::RemoteTimeout { .. } => "EM-META-REMOTE-TIMEOUT",
            Error::VolumeTimeout { .. } => "EM-META-VOLUME-TIMEOUT",
            Error::OutboxFull { .. } => "EM-STORE-OUTBOX-FULL",
            Error::Commit(_) => "EM-STORE-COMMIT",
            Error::Open(_) => "EM-STORE-OPEN",
            Error::Closed => "EM-META-CLOSED",
            Error::Panicked { task: "store" } => "EM-STORE-PANIC",
            Error::Panicked { .. } => "EM-META-PANIC",
            Error::Ended { .. } => "EM-META-ENDED",
        }
    }

    /// Refused for now, not for good (a full outbox, a failed commit, shutting down): a sender
    /// that can hold the message (the cloud bridge) delivers it again later.
    pub fn is_temporary(&self) -> bool {
        matches!(
            self,
            Error::OutboxFull { .. } | Error::Commit(_) | Error::Closed
        )
    }

    /// Bad input is the sender's problem (logged at warn); the rest is ours (logged at error).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Error::UnsupportedOperation(_)
                | Error::InvalidResource(_)
                | Error::NamespaceMismatch { .. }
                | Error::NoName { .. }
                | Error::PayloadTooLarge { .. }
                | Error::Envelope(_)
                | Error::Content { .. }
        )
    }
}

/// `?` on the protocol's parsers: a resource string that is not one is `InvalidResource`; the
/// rest are payloads that are not messages (topics are matched where they are read, and the
/// MetaManager parses no URLs).
impl From<ProtocolError> for Error {
    fn from(error: ProtocolError) -> Error {
        match error {
            ProtocolError::InvalidResource(_) => Error::InvalidResource(error),
            _ => Error::Envelope(error),
        }
    }
}

/// Why a `content.metadata.name` that was there did not count as a name.
fn invalid_name(metadata_name: &Option<String>) -> String {
    match metadata_name {
        Some(name) => format!(
            " (content.metadata.name {name:?} is not one topic level: empty, or has '/', '+' or '#')"
        ),
        None => String::new(),
    }
}
