//! CustomResourceDefinitions, as the API server serves them: an `apiextensions.k8s.io/v1`
//! CRD stored here makes each of its served versions a resource under
//! `/apis/<group>/<version>/...` (list, watch, selectors, discovery, and `/status` when the
//! version declares that subresource). All versions share one storage and no conversion runs:
//! an object reads back under any served version with only `apiVersion` changed.

use serde_json::{json, Value};

use edgemeta_kubewire::kinds::Kind;

/// The CRD type itself.
pub const CRD: Kind = Kind {
    group: "apiextensions.k8s.io",
    version: "v1",
    plural: "customresourcedefinitions",
    singular: "customresourcedefinition",
    kind: "CustomResourceDefinition",
    namespaced: false,
    status: true,
    short_names: &["crd", "crds"],
};

/// One served version of a definition, with owned names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Served {
    group: String,
    version: String,
    plural: String,
    singular: String,
    kind: String,
    namespaced: bool,
    status: bool,
    short_names: Vec<String>,
}

impl Served {
    fn same_as(&self, k: &Kind) -> bool {
        self.group == k.group
            && self.version == k.version
            && self.plural == k.plural
            && self.singular == k.singular
            && self.kind == k.kind
            && self.namespaced == k.namespaced
            && self.status == k.status
            && self.short_names.iter().eq(k.short_names.iter())
    }

    fn leak(self) -> &'static Kind {
        let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
        let short_names: Vec<&'static str> = self.short_names.into_iter().map(leak).collect();
        Box::leak(Box::new(Kind {
            group: leak(self.group),
            version: leak(self.version),
            plural: leak(self.plural),
            singular: leak(self.singular),
            kind: leak(self.kind),
            namespaced: self.namespaced,
            status: self.status,
            short_names: Box::leak(short_names.into_boxed_slice()),
        }))
    }
}

/// The custom kinds served now. Kinds are `&'static` everywhere in the server, so each
/// distinct definition is leaked once and found again when a CRD is re-applied: memory grows
/// only with definitions never seen before.
#[derive(Debug, Default)]
pub struct Crds {
    /// Per CRD name, its served versions (the storage version first: the preferred one).
    served: Vec<(String, Vec<&'static Kind>)>,
    known: Vec<&'static Kind>,
}

/// The versions `crd` serves; the storage version first, then the others in their order.
fn versions(crd: &Value) -> Vec<Served> {
    let spec = &crd["spec"];
    let names = &spec["names"];
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let plural = text(&names["plural"]);
    let kind = text(&names["kind"]);
    let singular = match names["singular"].as_str() {
        Some(s) if !s.is_empty() => s.to_owned(),
        _ => kind.to_lowercase(),
    };
    let short_names: Vec<String> = names["shortNames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect();
    let mut out: Vec<(bool, Served)> = spec["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["served"] != false)
        .filter_map(|v| {
            let version = v["name"].as_str().filter(|n| !n.is_empty())?;
            Some((
                v["storage"] == true,
                Served {
                    group: text(&spec["group"]),
                    version: version.to_owned(),
                    plural: plural.clone(),
                    singular: singular.clone(),
                    kind: kind.clone(),
                    namespaced: spec["scope"] != "Cluster",
                    status: v["subresources"]["status"].is_object(),
                    short_names: short_names.clone(),
                },
            ))
        })
        .collect();
    if out
        .iter()
        .any(|(_, s)| s.group.is_empty() || s.plural.is_empty() || s.kind.is_empty())
    {
        return Vec::new();
    }
    out.sort_by_key(|(storage, _)| !*storage);
    out.into_iter().map(|(_, s)| s).collect()
}

impl Crds {
    /// A CRD was stored (`ADDED`, `MODIFIED`) or removed (`DELETED`): what it serves changes.
    pub fn changed(&mut self, event: &str, crd: &Value) {
        let name = crd["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        self.served.retain(|(n, _)| *n != name);
        if event == "DELETED" {
            return;
        }
        let mut kinds = Vec::new();
        for served in versions(crd) {
            let kind = match self.known.iter().find(|k| served.same_as(k)) {
                Some(k) => *k,
                None => {
                    let k = served.leak();
                    self.known.push(k);
                    k
                }
            };
            kinds.push(kind);
        }
        self.served.push((name, kinds));
    }

    /// The custom kind served at `group`/`version` under `plural`.
    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<&'static Kind> {
        self.served
            .iter()
            .flat_map(|(_, kinds)| kinds.iter())
            .find(|k| k.group == group && k.version == version && k.plural == plural)
            .copied()
    }

    /// `builtin` and every custom kind, for discovery.
    pub fn with(&self, builtin: &[Kind]) -> Vec<Kind> {
        let mut all = builtin.to_vec();
        all.extend(
            self.served
                .iter()
                .flat_map(|(_, kinds)| kinds.iter().map(|k| **k)),
        );
        all
    }
}

/// What the API server fills in when it accepts a definition: the names it accepted and the
/// `Established` condition (`kubectl wait --for condition=established` waits for it).
pub fn establish(crd: &mut Value, now: &str) {
    let condition = |kind: &str, reason: &str| {
        json!({"type": kind, "status": "True", "lastTransitionTime": now, "reason": reason,
               "message": ""})
    };
    crd["status"] = json!({
        "acceptedNames": crd["spec"]["names"].clone(),
        "conditions": [condition("NamesAccepted", "NoConflicts"),
                       condition("Established", "InitialNamesAccepted")],
        "storedVersions": crd["spec"]["versions"].as_array().into_iter().flatten()
            .filter(|v| v["storage"] == true).map(|v| v["name"].clone()).collect::<Vec<_>>(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crd(versions: Value) -> Value {
        json!({"metadata": {"name": "devices.devices.kubeedge.io"},
               "spec": {"group": "devices.kubeedge.io", "scope": "Namespaced",
                        "names": {"kind": "Device", "plural": "devices", "singular": "device"},
                        "versions": versions}})
    }

    #[test]
    fn served_versions_come_and_go_and_a_reapplied_definition_is_not_leaked_again() {
        let mut crds = Crds::default();
        let v = json!([{"name": "v1alpha2", "served": true, "storage": false},
                       {"name": "v1beta1", "served": true, "storage": true,
                        "subresources": {"status": {}}},
                       {"name": "v1", "served": false, "storage": false}]);
        crds.changed("ADDED", &crd(v.clone()));
        let beta = crds
            .find("devices.kubeedge.io", "v1beta1", "devices")
            .expect("served");
        assert!(beta.status && beta.namespaced);
        assert!(crds.find("devices.kubeedge.io", "v1", "devices").is_none());
        // The storage version is listed first: discovery prefers it.
        let all = crds.with(&[]);
        assert_eq!(all[0].version, "v1beta1");
        crds.changed("MODIFIED", &crd(v));
        assert_eq!(crds.known.len(), 2);
        crds.changed("DELETED", &crd(json!([])));
        assert!(crds
            .find("devices.kubeedge.io", "v1beta1", "devices")
            .is_none());
    }
}
