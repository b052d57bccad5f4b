//! What the MetaServer serves: core/v1 types the node stores, and the store type of each.

use edgemeta_kubewire::kinds::core;
use edgemeta_kubewire::Kind;

/// A served type and its `meta.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub kind: &'static Kind,
    /// `meta.type` in the store (`pod`).
    pub res_type: &'static str,
}

/// A request's target under `/api/v1`.
pub(crate) struct Target {
    pub served: Served,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Every type the node can serve (secrets only with `metaserver.secrets`).
pub static ALL: &[Kind] = &[
    core("pods", "pod", "Pod", true, false, &["po"]),
    core("configmaps", "configmap", "ConfigMap", true, false, &["cm"]),
    core("services", "service", "Service", true, false, &["svc"]),
    core("endpoints", "endpoints", "Endpoints", true, false, &["ep"]),
    core("nodes", "node", "Node", false, false, &["no"]),
    core("secrets", "secret", "Secret", true, false, &[]),
];

/// Without secrets: every type but the last.
pub static WITHOUT_SECRETS: &[Kind] = {
    let (kinds, _) = ALL.split_at(ALL.len() - 1);
    kinds
};

/// The kinds to serve.
pub fn kinds(secrets: bool) -> &'static [Kind] {
    if secrets {
        ALL
    } else {
        WITHOUT_SECRETS
    }
}

impl Served {
    /// The type served under `/api/v1/<plural>`.
    pub fn find(kinds: &'static [Kind], plural: &str) -> Option<Served> {
        let kind = Kind::find(kinds, "", "v1", plural)?;
        Some(Served {
            kind,
            res_type: kind.singular,
        })
    }
}
