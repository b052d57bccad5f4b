//! The crate's one error type.

use std::path::PathBuf;

/// What starting the DMI server can fail with (calls and reports answer gRPC statuses).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("devices.dmi.socket is not set")]
    NoSocket,
    #[error("DMI socket {path}: {source}")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The stable `error_code` of its log line.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Config(_) => "EM-DMI-CONFIG",
            Error::NoSocket | Error::Socket { .. } => "EM-DMI-SOCKET",
        }
    }
}
