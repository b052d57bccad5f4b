//! The crate's one error type, and the `Status` body the API server answers errors with.

use serde_json::{json, Value};

use crate::kinds::Kind;

/// What a request, or starting the server, can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{kind} \"{name}\" not found")]
    NotFound { kind: String, name: String },
    #[error("{plural} \"{name}\" already exists")]
    AlreadyExists {
        kind: &'static str,
        plural: &'static str,
        group: &'static str,
        name: String,
    },
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Expired(String),
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    #[error("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json")]
    UnsupportedMediaType,
    /// Injected by the `fail_requests` fault knob.
    #[error("injected fault")]
    Injected(u16),
    #[error("kubelet client: {0}")]
    Kubelet(String),
    #[error("binding {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<edgemeta_kubewire::SelectorError> for Error {
    fn from(error: edgemeta_kubewire::SelectorError) -> Error {
        Error::BadRequest(error.0)
    }
}

impl Error {
    pub(crate) fn not_found(kind: &Kind, name: &str) -> Error {
        Error::NotFound {
            kind: kind.resource(),
            name: name.to_owned(),
        }
    }

    /// The HTTP status code the API server uses.
    pub fn code(&self) -> u16 {
        match self {
            Error::BadRequest(_) => 400,
            Error::NotFound { .. } => 404,
            Error::MethodNotAllowed => 405,
            Error::AlreadyExists { .. } | Error::Conflict(_) => 409,
            Error::Expired(_) => 410,
            Error::UnsupportedMediaType => 415,
            Error::Invalid(_) => 422,
            Error::Injected(code) => *code,
            Error::Bind { .. } | Error::Kubelet(_) => 500,
        }
    }

    fn reason(&self) -> &'static str {
        match self {
            Error::BadRequest(_) => "BadRequest",
            Error::NotFound { .. } => "NotFound",
            Error::MethodNotAllowed => "MethodNotAllowed",
            Error::AlreadyExists { .. } => "AlreadyExists",
            Error::Conflict(_) => "Conflict",
            Error::Expired(_) => "Expired",
            Error::UnsupportedMediaType => "UnsupportedMediaType",
            Error::Invalid(_) => "Invalid",
            Error::Injected(429) => "TooManyRequests",
            Error::Injected(503) => "ServiceUnavailable",
            Error::Injected(_) | Error::Bind { .. } | Error::Kubelet(_) => "InternalError",
        }
    }

    /// The `Status` object for this error.
    pub fn status(&self) -> Value {
        let details = match self {
            Error::NotFound { kind, name } => json!({"name": name, "kind": kind}),
            Error::AlreadyExists {
                plural,
                group,
                name,
                ..
            } => json!({"name": name, "group": group, "kind": plural}),
            _ => json!({}),
        };
        edgemeta_kubewire::failure(self.code(), self.reason(), &self.to_string(), details)
    }
}
