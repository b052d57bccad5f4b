//! Served resource types, and the discovery documents (`/api`, `/apis`, `/api/v1`) that
//! describe a set of them.

use serde_json::{json, Value};

/// One served resource type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    /// API group; "" is the core group (`/api/v1`).
    pub group: &'static str,
    pub version: &'static str,
    /// The URL segment (`pods`).
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    /// Has a `/status` subresource: the main resource's writes keep the stored status, and
    /// status writes change nothing else.
    pub status: bool,
    pub short_names: &'static [&'static str],
}

pub const fn core(
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
    status: bool,
    short_names: &'static [&'static str],
) -> Kind {
    Kind {
        group: "",
        version: "v1",
        plural,
        singular,
        kind,
        namespaced,
        status,
        short_names,
    }
}

impl Kind {
    /// `v1` or `<group>/<version>`, as in `apiVersion`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The store's name for the type: `pods`, `leases.coordination.k8s.io`.
    pub fn resource(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_owned()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }

    /// The type of `kinds` served at `group`/`version` under `plural`.
    pub fn find(
        kinds: &'static [Kind],
        group: &str,
        version: &str,
        plural: &str,
    ) -> Option<&'static Kind> {
        kinds
            .iter()
            .find(|k| k.group == group && k.version == version && k.plural == plural)
    }
}

/// `GET /api`.
pub fn core_versions(server: &str) -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"],
           "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server}]})
}

/// `GET /apis`: every non-core group of `kinds`, with its versions in the order `kinds` first
/// names them (the first is the preferred one).
pub fn groups(kinds: &[Kind]) -> Value {
    let mut names: Vec<&str> = Vec::new();
    for k in kinds.iter().filter(|k| !k.group.is_empty()) {
        if !names.contains(&k.group) {
            names.push(k.group);
        }
    }
    let groups: Vec<Value> = names
        .iter()
        .map(|g| {
            let mut versions: Vec<&str> = Vec::new();
            for k in kinds.iter().filter(|k| k.group == *g) {
                if !versions.contains(&k.version) {
                    versions.push(k.version);
                }
            }
            let versions: Vec<Value> = versions
                .iter()
                .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                .collect();
            let preferred = versions.first().cloned().unwrap_or(Value::Null);
            json!({"name": g, "preferredVersion": preferred, "versions": versions})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `GET /apis/<group>`, or `None` for a group `kinds` does not have.
pub fn group(kinds: &[Kind], name: &str) -> Option<Value> {
    let groups = groups(kinds);
    groups["groups"]
        .as_array()?
        .iter()
        .find(|g| g["name"] == name)
        .map(|g| {
            let mut g = g.clone();
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            g
        })
}

/// The verbs of a read-write resource.
pub const READ_WRITE: &[&str] = &[
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "update",
    "watch",
];
/// The verbs of a read-only resource.
pub const READ_ONLY: &[&str] = &["get", "list", "watch"];

/// `GET /api/v1` or `/apis/<group>/<version>` for `kinds`, each offering `verbs` (and its
/// `/status` subresource, when it has one, get/patch/update), or `None` when nothing is
/// served there.
pub fn resources(kinds: &[Kind], verbs: &[&str], group: &str, version: &str) -> Option<Value> {
    let mut list = Vec::new();
    for k in kinds
        .iter()
        .filter(|k| k.group == group && k.version == version)
    {
        list.push(
            json!({"name": k.plural, "singularName": k.singular, "namespaced": k.namespaced,
                         "kind": k.kind, "verbs": verbs, "shortNames": k.short_names}),
        );
        if k.status && verbs.contains(&"update") {
            list.push(
                json!({"name": format!("{}/status", k.plural), "singularName": "",
                             "namespaced": k.namespaced, "kind": k.kind,
                             "verbs": ["get", "patch", "update"]}),
            );
        }
    }
    if list.is_empty() {
        return None;
    }
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": list}),
    )
}
