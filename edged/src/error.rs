//! The crate's one error type. Errors about a pod's input become its status (see `status`);
//! these are the agent's own failures.

/// What can go wrong in edged.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("mqtt: {0}")]
    Mqtt(#[from] rumqttc::ClientError),
    #[error("malformed message on {topic}: {detail}")]
    Message { topic: String, detail: String },
    #[error("the agent stopped")]
    Stopped,
}

impl Error {
    /// The stable code logged with this error (`error_code` field).
    pub fn code(&self) -> &'static str {
        match self {
            Error::Config(_) => "EM-EDGED-CONFIG",
            Error::Io { .. } => "EM-EDGED-IO",
            Error::Mqtt(_) => "EM-EDGED-MQTT",
            Error::Message { .. } => "EM-EDGED-MESSAGE",
            Error::Stopped => "EM-EDGED-STOPPED",
        }
    }

    pub(crate) fn io(what: &'static str, path: &std::path::Path, source: std::io::Error) -> Error {
        Error::Io {
            what,
            path: path.display().to_string(),
            source,
        }
    }
}
