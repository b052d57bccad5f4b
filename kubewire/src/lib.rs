//! Kubernetes API wire pieces shared by the node's MetaServer (`edgemeta-metaserver`) and the
//! fake API server (`edgemeta-fakeapi`): what both answer must look the same to kubectl and
//! kube-rs.
//!
//! # Layout
//! - [`kinds`]: a served resource type ([`Kind`]) and the discovery documents.
//! - [`selector`]: `labelSelector` and `fieldSelector`.
//! - [`table`]: `meta.k8s.io/v1` Tables for `kubectl get`.
//! - this file: `Status` bodies, watch event lines, the `/version` document.

pub mod kinds;
mod selector;
pub mod table;

pub use kinds::Kind;
pub use selector::{FieldSelector, LabelSelector, SelectorError};

use serde_json::{json, Value};

/// A `Status` object with `status: Failure`, as the API server answers errors (and as the
/// object of a watch's `ERROR` event).
pub fn failure(code: u16, reason: &str, message: &str, details: Value) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "details": details, "code": code})
}

/// One watch event: `{"type": …, "object": …}` and a newline (watches are JSON lines).
pub fn event_line(kind: &str, object: &Value) -> String {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    line
}

/// The object of a `BOOKMARK` event: only the kind and the resourceVersion.
pub fn bookmark(kind: &Kind, rv: &str) -> Value {
    json!({"kind": kind.kind, "apiVersion": kind.api_version(),
           "metadata": {"resourceVersion": rv}})
}

/// `GET /version` for `git_version` (`v1.33.0-edgemeta-fake`).
pub fn version(git_version: &str) -> Value {
    json!({"major": "1", "minor": "33", "gitVersion": git_version,
           "gitCommit": "", "gitTreeState": "clean", "buildDate": "",
           "goVersion": "", "compiler": "rustc", "platform": "linux/amd64"})
}
