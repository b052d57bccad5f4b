//! The parts of a Kubernetes Pod this agent acts on, read leniently (unknown fields ignored,
//! missing ones defaulted) from the JSON the MetaManager hands on.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

/// `<namespace>/<name>`: how pods, configmaps and secrets are keyed.
pub type Key = String;

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Pod {
    pub metadata: Metadata,
    pub spec: PodSpec,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Metadata {
    pub name: String,
    pub namespace: Option<String>,
    pub uid: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct PodSpec {
    pub containers: Vec<Container>,
    pub restart_policy: RestartPolicy,
    pub termination_grace_period_seconds: Option<u64>,
    pub volumes: Vec<Volume>,
    pub node_name: Option<String>,
}

#[derive(Debug, Clone, Copy, Deserialize, Default, PartialEq, Eq)]
pub enum RestartPolicy {
    #[default]
    Always,
    OnFailure,
    Never,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Container {
    pub name: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub working_dir: Option<String>,
    pub env: Vec<EnvVar>,
    pub env_from: Vec<EnvFromSource>,
    pub volume_mounts: Vec<VolumeMount>,
    pub liveness_probe: Option<Probe>,
    pub readiness_probe: Option<Probe>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct EnvVar {
    pub name: String,
    pub value: Option<String>,
    pub value_from: Option<EnvVarSource>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct EnvVarSource {
    pub config_map_key_ref: Option<KeyRef>,
    pub secret_key_ref: Option<KeyRef>,
    pub field_ref: Option<FieldRef>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct KeyRef {
    pub name: String,
    pub key: String,
    pub optional: bool,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct FieldRef {
    pub field_path: String,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct EnvFromSource {
    pub prefix: String,
    pub config_map_ref: Option<NameRef>,
    pub secret_ref: Option<NameRef>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct NameRef {
    pub name: String,
    pub optional: bool,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct VolumeMount {
    pub name: String,
    pub mount_path: String,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Volume {
    pub name: String,
    pub config_map: Option<ConfigMapVolume>,
    pub secret: Option<SecretVolume>,
    pub empty_dir: Option<Value>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct ConfigMapVolume {
    pub name: String,
    pub items: Vec<KeyToPath>,
    pub optional: bool,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct SecretVolume {
    pub secret_name: String,
    pub items: Vec<KeyToPath>,
    pub optional: bool,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct KeyToPath {
    pub key: String,
    pub path: String,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct Probe {
    pub exec: Option<ExecAction>,
    pub http_get: Option<HttpGetAction>,
    pub tcp_socket: Option<TcpSocketAction>,
    pub initial_delay_seconds: u64,
    pub period_seconds: u64,
    pub timeout_seconds: u64,
    pub success_threshold: u32,
    pub failure_threshold: u32,
}

impl Default for Probe {
    /// Kubernetes' defaults for the timing fields.
    fn default() -> Self {
        Probe {
            exec: None,
            http_get: None,
            tcp_socket: None,
            initial_delay_seconds: 0,
            period_seconds: 10,
            timeout_seconds: 1,
            success_threshold: 1,
            failure_threshold: 3,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct ExecAction {
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct HttpGetAction {
    pub path: String,
    pub port: Value,
    pub host: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default, PartialEq)]
#[serde(rename_all = "camelCase", default)]
pub struct TcpSocketAction {
    pub port: Value,
    pub host: Option<String>,
}

/// A ConfigMap's or Secret's data, decoded to bytes (secrets' `data` is base64).
pub type Data = BTreeMap<String, Vec<u8>>;

/// Reads a ConfigMap (`data` and `binaryData`) or a Secret (`data` base64, `stringData`).
pub fn read_data(kind: ConfigKind, object: &Value) -> Result<Data, String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Data::new();
    let text = |field: &str| -> Result<Vec<(String, String)>, String> {
        match object.get(field) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Object(map)) => map
                .iter()
                .map(|(k, v)| match v {
                    Value::String(s) => Ok((k.clone(), s.clone())),
                    other => Err(format!("{field}.{k} is not a string: {other}")),
                })
                .collect(),
            Some(other) => Err(format!("{field} is not an object: {other}")),
        }
    };
    match kind {
        ConfigKind::ConfigMap => {
            for (k, v) in text("data")? {
                out.insert(k, v.into_bytes());
            }
            for (k, v) in text("binaryData")? {
                let bytes = b64
                    .decode(v.as_bytes())
                    .map_err(|e| format!("binaryData.{k} is not base64: {e}"))?;
                out.insert(k, bytes);
            }
        }
        ConfigKind::Secret => {
            for (k, v) in text("data")? {
                let bytes = b64
                    .decode(v.as_bytes())
                    .map_err(|e| format!("data.{k} is not base64: {e}"))?;
                out.insert(k, bytes);
            }
            for (k, v) in text("stringData")? {
                out.insert(k, v.into_bytes());
            }
        }
    }
    Ok(out)
}

/// The two kinds of object a pod can take configuration from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConfigKind {
    ConfigMap,
    Secret,
}

impl ConfigKind {
    /// The resource type in topics and store keys.
    pub fn resource_type(self) -> &'static str {
        match self {
            ConfigKind::ConfigMap => "configmap",
            ConfigKind::Secret => "secret",
        }
    }

    pub fn from_resource_type(t: &str) -> Option<ConfigKind> {
        match t {
            "configmap" => Some(ConfigKind::ConfigMap),
            "secret" => Some(ConfigKind::Secret),
            _ => None,
        }
    }
}

/// A name usable as one path component and one topic level: DNS-1123-ish, no `/`, not `.`/`..`.
pub fn is_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
}

/// A relative path of names (`a/b.txt`), for volume items.
pub fn is_relative_path(path: &str) -> bool {
    !path.is_empty() && path.split('/').all(is_name)
}

impl Pod {
    /// Parses a pod document; `Err` is the reason it cannot run (`InvalidPodSpec`).
    pub fn parse(document: &Value) -> Result<Pod, String> {
        let pod: Pod = serde_json::from_value(document.clone())
            .map_err(|e| format!("pod spec does not parse: {e}"))?;
        Ok(pod)
    }

    /// What is wrong with a parsed pod that stops every container from running.
    pub fn invalid(&self) -> Option<String> {
        if self.spec.containers.is_empty() {
            return Some("pod spec has no containers".to_owned());
        }
        let mut seen = std::collections::BTreeSet::new();
        for c in &self.spec.containers {
            if !is_name(&c.name) {
                return Some(format!("container name {:?} is not valid", c.name));
            }
            if !seen.insert(c.name.as_str()) {
                return Some(format!("container name {:?} is used twice", c.name));
            }
        }
        for v in &self.spec.volumes {
            if !is_name(&v.name) {
                return Some(format!("volume name {:?} is not valid", v.name));
            }
        }
        None
    }

    /// Every configmap and secret the pod refers to, with whether the reference is optional.
    pub fn references(&self) -> Vec<(ConfigKind, String, bool)> {
        let mut out = Vec::new();
        for c in &self.spec.containers {
            for e in &c.env {
                if let Some(from) = &e.value_from {
                    if let Some(r) = &from.config_map_key_ref {
                        out.push((ConfigKind::ConfigMap, r.name.clone(), r.optional));
                    }
                    if let Some(r) = &from.secret_key_ref {
                        out.push((ConfigKind::Secret, r.name.clone(), r.optional));
                    }
                }
            }
            for e in &c.env_from {
                if let Some(r) = &e.config_map_ref {
                    out.push((ConfigKind::ConfigMap, r.name.clone(), r.optional));
                }
                if let Some(r) = &e.secret_ref {
                    out.push((ConfigKind::Secret, r.name.clone(), r.optional));
                }
            }
        }
        for v in &self.spec.volumes {
            if let Some(cm) = &v.config_map {
                out.push((ConfigKind::ConfigMap, cm.name.clone(), cm.optional));
            }
            if let Some(s) = &v.secret {
                out.push((ConfigKind::Secret, s.secret_name.clone(), s.optional));
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pod_reads_leniently_with_kubernetes_defaults() {
        let pod = Pod::parse(&json!({
            "metadata": {"name": "p", "labels": {"a": "b"}},
            "spec": {"containers": [{"name": "c", "command": ["sleep", "1"],
                     "livenessProbe": {"exec": {"command": ["true"]}}}]}
        }))
        .expect("parses");
        assert_eq!(pod.spec.restart_policy, RestartPolicy::Always);
        let probe = pod.spec.containers[0]
            .liveness_probe
            .clone()
            .expect("probe");
        assert_eq!((probe.period_seconds, probe.failure_threshold), (10, 3));
        assert!(pod.invalid().is_none());
    }

    #[test]
    fn no_containers_and_bad_names_are_invalid() {
        let empty = Pod::parse(&json!({"metadata": {"name": "p"}, "spec": {}})).expect("parses");
        assert_eq!(
            empty.invalid().as_deref(),
            Some("pod spec has no containers")
        );
        let bad = Pod::parse(&json!({"spec": {"containers": [{"name": "../x"}]}})).expect("parses");
        assert!(bad.invalid().is_some());
        assert!(Pod::parse(&json!({"spec": {"containers": "x"}})).is_err());
    }

    #[test]
    fn secrets_are_base64_and_configmaps_are_text() {
        let s = read_data(
            ConfigKind::Secret,
            &json!({"data": {"pw": "aHVudGVyMg=="}, "stringData": {"u": "bob"}}),
        )
        .expect("decodes");
        assert_eq!(s["pw"], b"hunter2");
        assert_eq!(s["u"], b"bob");
        let c = read_data(ConfigKind::ConfigMap, &json!({"data": {"k": "v"}})).expect("reads");
        assert_eq!(c["k"], b"v");
        assert!(read_data(ConfigKind::Secret, &json!({"data": {"pw": "!!"}})).is_err());
    }

    #[test]
    fn references_are_collected_once() {
        let pod = Pod::parse(&json!({"spec": {
            "containers": [{"name": "c",
                "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "a"}}}],
                "envFrom": [{"configMapRef": {"name": "cm"}}, {"secretRef": {"name": "s", "optional": true}}]}],
            "volumes": [{"name": "v", "secret": {"secretName": "s2"}}]}}))
        .expect("parses");
        assert_eq!(
            pod.references(),
            vec![
                (ConfigKind::ConfigMap, "cm".to_owned(), false),
                (ConfigKind::Secret, "s".to_owned(), true),
                (ConfigKind::Secret, "s2".to_owned(), false),
            ]
        );
    }
}
