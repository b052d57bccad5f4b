//! What a pod references: the configmaps and secrets a node needs to run it (KubeEdge v1.3
//! cloud/pkg/edgecontroller/manager/location.go; here init containers and projected volumes too).

use std::collections::BTreeSet;

use serde_json::Value;

/// A configmap or secret in a namespace.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ref {
    /// `configmap` or `secret` (the edge's type names).
    pub kind: &'static str,
    pub namespace: String,
    pub name: String,
}

impl Ref {
    /// `<ns>/<type>/<name>`, the edge's resource key.
    pub fn resource(&self) -> String {
        format!("{}/{}/{}", self.namespace, self.kind, self.name)
    }
}

/// Every configmap and secret `pod` (JSON) references: volumes, projected volume sources,
/// `envFrom`, `env[].valueFrom` of containers and init containers, and `imagePullSecrets`.
pub fn pod_refs(pod: &Value) -> BTreeSet<Ref> {
    let namespace = pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_owned();
    let mut out = BTreeSet::new();
    let mut add = |kind: &'static str, name: &Value| {
        if let Some(name) = name.as_str().filter(|n| !n.is_empty()) {
            out.insert(Ref {
                kind,
                namespace: namespace.clone(),
                name: name.to_owned(),
            });
        }
    };
    let spec = &pod["spec"];
    for volume in spec["volumes"].as_array().into_iter().flatten() {
        add("configmap", &volume["configMap"]["name"]);
        add("secret", &volume["secret"]["secretName"]);
        for source in volume["projected"]["sources"]
            .as_array()
            .into_iter()
            .flatten()
        {
            add("configmap", &source["configMap"]["name"]);
            add("secret", &source["secret"]["name"]);
        }
    }
    for list in ["containers", "initContainers", "ephemeralContainers"] {
        for container in spec[list].as_array().into_iter().flatten() {
            for from in container["envFrom"].as_array().into_iter().flatten() {
                add("configmap", &from["configMapRef"]["name"]);
                add("secret", &from["secretRef"]["name"]);
            }
            for env in container["env"].as_array().into_iter().flatten() {
                add("configmap", &env["valueFrom"]["configMapKeyRef"]["name"]);
                add("secret", &env["valueFrom"]["secretKeyRef"]["name"]);
            }
        }
    }
    for secret in spec["imagePullSecrets"].as_array().into_iter().flatten() {
        add("secret", &secret["name"]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_kind_of_reference_is_found_once() {
        let pod = json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {
            "volumes": [{"name": "a", "configMap": {"name": "cm-vol"}},
                        {"name": "b", "secret": {"secretName": "s-vol"}},
                        {"name": "c", "projected": {"sources": [{"configMap": {"name": "cm-proj"}},
                                                                {"secret": {"name": "s-proj"}}]}},
                        {"name": "d", "emptyDir": {}}],
            "initContainers": [{"name": "i", "envFrom": [{"configMapRef": {"name": "cm-init"}}]}],
            "containers": [{"name": "m",
                "envFrom": [{"secretRef": {"name": "s-from"}}],
                "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm-vol", "key": "k"}}},
                        {"name": "Y", "valueFrom": {"secretKeyRef": {"name": "s-key", "key": "k"}}},
                        {"name": "Z", "value": "plain"}]}],
            "imagePullSecrets": [{"name": "pull"}]}});
        let found: Vec<String> = pod_refs(&pod).iter().map(Ref::resource).collect();
        assert_eq!(
            found,
            [
                "ns/configmap/cm-init",
                "ns/configmap/cm-proj",
                "ns/configmap/cm-vol",
                "ns/secret/pull",
                "ns/secret/s-from",
                "ns/secret/s-key",
                "ns/secret/s-proj",
                "ns/secret/s-vol"
            ]
        );
    }
}
