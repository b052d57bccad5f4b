/// Everything the cloud bridge can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid cloud config: {0}")]
    Config(String),
    #[error("cloud connection: {0}")]
    Connection(Box<rumqttc::ConnectionError>),
    #[error("cloud broker refused the connection: {0:?}")]
    Refused(rumqttc::ConnectReturnCode),
    #[error("cloud client: {0}")]
    Client(#[from] rumqttc::ClientError),
    #[error("metamanager: {0}")]
    Meta(#[from] edgemeta_metamanager::Error),
    #[error("local broker link closed")]
    LinkClosed,
    /// A bug, not a condition to retry: the bridge stops and the node decides what follows.
    #[error("a cloud bridge task panicked: {0}")]
    Panicked(String),
}

impl From<rumqttc::ConnectionError> for Error {
    fn from(error: rumqttc::ConnectionError) -> Self {
        Error::Connection(Box::new(error))
    }
}
