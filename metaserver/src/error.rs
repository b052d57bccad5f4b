//! The crate's one error type, and the `Status` body each request error is answered with.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use edgemeta_metamanager::store::StoreError;
use serde_json::{json, Value};
use tracing::error;

/// What starting the MetaServer or serving a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("binding the MetaServer on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the MetaServer token file {path}: {source}")]
    TokenFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the MetaServer token file {0} is empty")]
    EmptyToken(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{kind} \"{name}\" not found")]
    NotFound { kind: String, name: String },
    #[error("the server could not find the requested resource ({0})")]
    NoResource(String),
    #[error("{0}")]
    Expired(String),
    #[error("the node's API is read-only: {0} is not allowed")]
    MethodNotAllowed(String),
    #[error("Unauthorized")]
    Unauthorized,
    #[error("the store could not be read: {0}")]
    Store(#[from] StoreError),
}

impl From<edgemeta_kubewire::SelectorError> for Error {
    fn from(error: edgemeta_kubewire::SelectorError) -> Error {
        Error::BadRequest(error.0)
    }
}

impl Error {
    /// The HTTP status code the API server uses.
    pub fn code(&self) -> u16 {
        match self {
            Error::BadRequest(_) => 400,
            Error::Unauthorized => 401,
            Error::NotFound { .. } | Error::NoResource(_) => 404,
            Error::MethodNotAllowed(_) => 405,
            Error::Expired(_) => 410,
            Error::Bind { .. }
            | Error::TokenFile { .. }
            | Error::EmptyToken(_)
            | Error::Store(_) => 500,
        }
    }

    /// The `Status` reason.
    fn reason(&self) -> &'static str {
        match self {
            Error::BadRequest(_) => "BadRequest",
            Error::Unauthorized => "Unauthorized",
            Error::NotFound { .. } | Error::NoResource(_) => "NotFound",
            Error::MethodNotAllowed(_) => "MethodNotAllowed",
            Error::Expired(_) => "Expired",
            Error::Bind { .. }
            | Error::TokenFile { .. }
            | Error::EmptyToken(_)
            | Error::Store(_) => "InternalError",
        }
    }

    /// The `Status` object for this error.
    pub fn status(&self) -> Value {
        let details = match self {
            Error::NotFound { kind, name } => json!({"name": name, "kind": kind}),
            _ => json!({}),
        };
        edgemeta_kubewire::failure(self.code(), self.reason(), &self.to_string(), details)
    }
}

/// A JSON body with status `code`.
pub(crate) fn json_response(code: u16, body: String) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The reply a client sees for `error` (a Kubernetes `Status`); server-side failures are logged.
pub(crate) fn error_response(error: &Error) -> Response {
    if error.code() >= 500 {
        error!(error_code = "EM-METASERVER-READ", error = %error, "request failed");
    }
    json_response(error.code(), error.status().to_string())
}
