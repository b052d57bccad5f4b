//! Server-side printing: `kubectl get` asks for `meta.k8s.io/v1` Tables and prints their
//! columns (without them it prints only NAME and AGE).

use serde_json::{json, Value};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

use crate::Kind;

/// Whether the request's `Accept` header asks for a Table.
pub fn wanted(accept: &str) -> bool {
    accept.contains("as=Table")
}

/// kubectl's age format: `45s`, `7m`, `3h`, `2d`.
fn age(object: &Value) -> String {
    let Some(created) = object["metadata"]["creationTimestamp"]
        .as_str()
        .and_then(|t| OffsetDateTime::parse(t, &Rfc3339).ok())
    else {
        return "<unknown>".to_owned();
    };
    let seconds = (OffsetDateTime::now_utc() - created).whole_seconds().max(0);
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 7_200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3_600),
        s => format!("{}d", s / 86_400),
    }
}

fn column(name: &str, priority: u8) -> Value {
    json!({"name": name, "type": "string", "format": if name == "Name" { "name" } else { "" },
           "description": "", "priority": priority})
}

fn columns(kind: &Kind) -> Vec<Value> {
    match kind.plural {
        "pods" => vec![
            column("Name", 0),
            column("Ready", 0),
            column("Status", 0),
            column("Restarts", 0),
            column("Age", 0),
            column("IP", 1),
            column("Node", 1),
            column("Nominated Node", 1),
            column("Readiness Gates", 1),
        ],
        "nodes" => vec![
            column("Name", 0),
            column("Status", 0),
            column("Roles", 0),
            column("Age", 0),
            column("Version", 0),
            column("Internal-IP", 1),
            column("External-IP", 1),
            column("OS-Image", 1),
            column("Kernel-Version", 1),
            column("Container-Runtime", 1),
        ],
        _ => vec![column("Name", 0), column("Age", 0)],
    }
}

/// kubectl's pod STATUS: the deletion, a waiting or terminated container's reason, or the phase.
fn pod_status(pod: &Value) -> String {
    if pod["metadata"]["deletionTimestamp"].is_string() {
        return "Terminating".to_owned();
    }
    let statuses = pod["status"]["containerStatuses"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for s in &statuses {
        for state in ["waiting", "terminated"] {
            if let Some(reason) = s["state"][state]["reason"].as_str() {
                return reason.to_owned();
            }
        }
    }
    pod["status"]["phase"]
        .as_str()
        .unwrap_or("Unknown")
        .to_owned()
}

fn cells(kind: &Kind, object: &Value) -> Vec<Value> {
    let name = json!(object["metadata"]["name"].as_str().unwrap_or_default());
    match kind.plural {
        "pods" => {
            let total = object["spec"]["containers"].as_array().map_or(0, Vec::len);
            let statuses = object["status"]["containerStatuses"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let ready = statuses.iter().filter(|s| s["ready"] == true).count();
            let restarts: i64 = statuses
                .iter()
                .map(|s| s["restartCount"].as_i64().unwrap_or(0))
                .sum();
            let text = |v: &Value| json!(v.as_str().unwrap_or("<none>"));
            vec![
                name,
                json!(format!("{ready}/{total}")),
                json!(pod_status(object)),
                json!(restarts),
                json!(age(object)),
                text(&object["status"]["podIP"]),
                text(&object["spec"]["nodeName"]),
                json!("<none>"),
                json!("<none>"),
            ]
        }
        "nodes" => {
            let ready = object["status"]["conditions"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
                .map(|c| c["status"] == "True");
            let status = match ready {
                Some(true) => "Ready",
                Some(false) => "NotReady",
                None => "Unknown",
            };
            let mut roles: Vec<String> = object["metadata"]["labels"]
                .as_object()
                .map(|l| {
                    l.keys()
                        .filter_map(|k| k.strip_prefix("node-role.kubernetes.io/"))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default();
            roles.sort();
            let roles = if roles.is_empty() {
                "<none>".to_owned()
            } else {
                roles.join(",")
            };
            let info = &object["status"]["nodeInfo"];
            let text = |v: &Value| json!(v.as_str().filter(|t| !t.is_empty()).unwrap_or("<none>"));
            let address = |kind: &str| {
                let found = object["status"]["addresses"]
                    .as_array()
                    .and_then(|a| a.iter().find(|a| a["type"] == kind));
                text(found.map_or(&Value::Null, |a| &a["address"]))
            };
            vec![
                name,
                json!(status),
                json!(roles),
                json!(age(object)),
                json!(info["kubeletVersion"].as_str().unwrap_or_default()),
                address("InternalIP"),
                address("ExternalIP"),
                text(&info["osImage"]),
                text(&info["kernelVersion"]),
                text(&info["containerRuntimeVersion"]),
            ]
        }
        _ => vec![name, json!(age(object))],
    }
}

/// What each row carries, from `includeObject` (`None`, `Metadata` (default), `Object`):
/// `kubectl get -o custom-columns` asks for whole objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Include {
    Nothing,
    Metadata,
    Object,
}

impl Include {
    pub fn from_param(param: Option<&str>) -> Include {
        match param {
            Some("None") => Include::Nothing,
            Some("Object") => Include::Object,
            _ => Include::Metadata,
        }
    }
}

/// A Table of `objects`; `rv` and `cont` go into its list metadata.
pub fn of(kind: &Kind, objects: &[Value], rv: &str, cont: Option<&str>, include: Include) -> Value {
    let rows: Vec<Value> = objects
        .iter()
        .map(|o| {
            let object = match include {
                Include::Nothing => Value::Null,
                Include::Metadata => json!({"kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}),
                Include::Object => o.clone(),
            };
            json!({"cells": cells(kind, o), "object": object})
        })
        .collect();
    let mut metadata = json!({"resourceVersion": rv});
    if let Some(c) = cont {
        metadata["continue"] = json!(c);
    }
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
           "columnDefinitions": columns(kind), "rows": rows})
}
