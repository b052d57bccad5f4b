//! The crate's one error type.

/// What the edgecontroller can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("cloud broker client: {0}")]
    Mqtt(#[from] rumqttc::ClientError),
    #[error("malformed message on {topic}: {detail}")]
    Message { topic: String, detail: String },
    #[error("the controller stopped")]
    Stopped,
    #[error("leadership lost: another replica holds the lease")]
    LeadershipLost,
    #[error("kubelet stream server: {0}")]
    Stream(String),
}

impl Error {
    /// The stable code logged with this error (`error_code` field).
    pub fn code(&self) -> &'static str {
        match self {
            Error::Config(_) => "EM-EC-CONFIG",
            Error::Kubeconfig(_) => "EM-EC-KUBECONFIG",
            Error::Kube(_) => "EM-EC-KUBE",
            Error::Mqtt(_) => "EM-EC-MQTT",
            Error::Message { .. } => "EM-EC-MESSAGE",
            Error::Stopped => "EM-EC-STOPPED",
            Error::LeadershipLost => "EM-EC-LEASE-LOST",
            Error::Stream(_) => "EM-EC-STREAM",
        }
    }
}
