//! From a pod document and the configmaps/secrets it names to a [`PodPlan`]: argv, environment,
//! working directory, volume files and log paths for each container. Pure: no I/O, so every
//! rule is unit-tested here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use crate::spec::{self, ConfigKind, Data, Pod, Probe, RestartPolicy};

/// The default `PATH` of a container (processes do not inherit the agent's environment).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Kubernetes' default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE_S: u64 = 30;

/// What the agent knows of one configmap or secret.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    /// Not asked for yet, or the answer is still on its way.
    Unknown,
    /// The MetaManager has no such object.
    Missing,
    Found(Data),
}

/// Why a pod cannot be planned yet.
#[derive(Debug, Clone, PartialEq)]
pub enum Blocked {
    /// These references must be looked up first.
    Unknown(Vec<(ConfigKind, String)>),
    /// kubelet's `CreateContainerConfigError`: a required reference or key is missing.
    ConfigError(String),
}

/// A pod ready to run.
#[derive(Debug, Clone, PartialEq)]
pub struct PodPlan {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub restart_policy: RestartPolicy,
    pub grace: Duration,
    pub dir: PathBuf,
    pub volumes: Vec<VolumeFiles>,
    pub containers: Vec<ContainerPlan>,
}

/// Files of one configmap or secret volume (or none, for `emptyDir`).
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeFiles {
    pub dir: PathBuf,
    pub files: Vec<(String, Vec<u8>)>,
    pub secret: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ContainerPlan {
    pub name: String,
    /// Empty when the container names no command (the process runtime cannot run images).
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub working_dir: PathBuf,
    pub log_path: PathBuf,
    pub pid_path: PathBuf,
    pub liveness: Option<Probe>,
    pub readiness: Option<Probe>,
}

/// The directory of pod `namespace/name` under `pods_dir`.
pub fn pod_dir(pods_dir: &Path, namespace: &str, name: &str) -> PathBuf {
    pods_dir.join(format!("{namespace}_{name}"))
}

/// Plans `pod` of `namespace`; `lookup(kind, name)` answers from the agent's cache.
pub fn plan(
    pod: &Pod,
    namespace: &str,
    pods_dir: &Path,
    node_ip: &str,
    lookup: impl Fn(ConfigKind, &str) -> Lookup,
) -> Result<PodPlan, Blocked> {
    let unknown: Vec<(ConfigKind, String)> = pod
        .references()
        .into_iter()
        .filter(|(kind, name, _)| lookup(*kind, name) == Lookup::Unknown)
        .map(|(kind, name, _)| (kind, name))
        .collect();
    if !unknown.is_empty() {
        return Err(Blocked::Unknown(unknown));
    }
    let name = &pod.metadata.name;
    let dir = pod_dir(pods_dir, namespace, name);
    let get = |kind: ConfigKind, object: &str, optional: bool| -> Result<Option<Data>, Blocked> {
        match lookup(kind, object) {
            Lookup::Found(data) => Ok(Some(data)),
            _ if optional => Ok(None),
            _ => Err(Blocked::ConfigError(format!(
                "{} \"{object}\" not found",
                kind.resource_type()
            ))),
        }
    };
    let mut volumes = Vec::new();
    let mut volume_dirs = BTreeMap::new();
    for v in &pod.spec.volumes {
        let vdir = dir.join("volumes").join(&v.name);
        let (data, items, secret) = if let Some(cm) = &v.config_map {
            (
                get(ConfigKind::ConfigMap, &cm.name, cm.optional)?,
                &cm.items,
                false,
            )
        } else if let Some(s) = &v.secret {
            (
                get(ConfigKind::Secret, &s.secret_name, s.optional)?,
                &s.items,
                true,
            )
        } else {
            (None, &Vec::new(), false)
        };
        let files = match data {
            None => Vec::new(),
            Some(data) if items.is_empty() => {
                data.into_iter().filter(|(k, _)| spec::is_name(k)).collect()
            }
            Some(data) => {
                let mut files = Vec::new();
                for item in items {
                    if !spec::is_relative_path(&item.path) {
                        return Err(Blocked::ConfigError(format!(
                            "volume {}: item path {:?} is not a relative path",
                            v.name, item.path
                        )));
                    }
                    match data.get(&item.key) {
                        Some(bytes) => files.push((item.path.clone(), bytes.clone())),
                        None => {
                            return Err(Blocked::ConfigError(format!(
                                "volume {}: couldn't find key {}",
                                v.name, item.key
                            )))
                        }
                    }
                }
                files
            }
        };
        volume_dirs.insert(v.name.clone(), vdir.clone());
        volumes.push(VolumeFiles {
            dir: vdir,
            files,
            secret,
        });
    }
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let mut containers = Vec::new();
    for c in &pod.spec.containers {
        let mut env: Vec<(String, String)> = vec![
            ("PATH".to_owned(), DEFAULT_PATH.to_owned()),
            ("HOSTNAME".to_owned(), name.clone()),
            ("EDGED_POD_NAME".to_owned(), name.clone()),
            ("EDGED_POD_NAMESPACE".to_owned(), namespace.to_owned()),
            ("EDGED_POD_DIR".to_owned(), dir.display().to_string()),
        ];
        for m in &c.volume_mounts {
            let Some(vdir) = volume_dirs.get(&m.name) else {
                return Err(Blocked::ConfigError(format!(
                    "container {}: volume mount {:?} names no volume of the pod",
                    c.name, m.name
                )));
            };
            set(
                &mut env,
                &volume_variable(&m.name),
                vdir.display().to_string(),
            );
        }
        for from in &c.env_from {
            let (kind, r) = match (&from.config_map_ref, &from.secret_ref) {
                (Some(r), _) => (ConfigKind::ConfigMap, r),
                (None, Some(r)) => (ConfigKind::Secret, r),
                (None, None) => continue,
            };
            if let Some(data) = get(kind, &r.name, r.optional)? {
                for (k, v) in data {
                    let key = format!("{}{k}", from.prefix);
                    if is_env_name(&key) {
                        set(&mut env, &key, String::from_utf8_lossy(&v).into_owned());
                    }
                }
            }
        }
        for e in &c.env {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => Some(expand(v, &env)),
                (None, Some(from)) => {
                    if let Some(r) = &from.config_map_key_ref {
                        key_value(
                            get(ConfigKind::ConfigMap, &r.name, r.optional)?,
                            r,
                            "ConfigMap",
                            namespace,
                        )?
                    } else if let Some(r) = &from.secret_key_ref {
                        key_value(
                            get(ConfigKind::Secret, &r.name, r.optional)?,
                            r,
                            "Secret",
                            namespace,
                        )?
                    } else if let Some(f) = &from.field_ref {
                        Some(match f.field_path.as_str() {
                            "metadata.name" => name.clone(),
                            "metadata.namespace" => namespace.to_owned(),
                            "metadata.uid" => uid.clone(),
                            "status.podIP" | "status.hostIP" => node_ip.to_owned(),
                            "spec.nodeName" => pod.spec.node_name.clone().unwrap_or_default(),
                            other => {
                                return Err(Blocked::ConfigError(format!(
                                    "env {}: unsupported fieldPath {other:?}",
                                    e.name
                                )))
                            }
                        })
                    } else {
                        None
                    }
                }
                (None, None) => Some(String::new()),
            };
            if let Some(value) = value {
                set(&mut env, &e.name, value);
            }
        }
        let argv: Vec<String> = c
            .command
            .iter()
            .chain(&c.args)
            .map(|a| expand(a, &env))
            .collect();
        let working_dir = match c.working_dir.as_deref() {
            None | Some("") => dir.clone(),
            Some(w) => dir.join(w), // an absolute path replaces the pod directory
        };
        containers.push(ContainerPlan {
            name: c.name.clone(),
            argv,
            env,
            working_dir,
            log_path: dir.join("logs").join(format!("{}.log", c.name)),
            pid_path: dir.join(format!("{}.pid", c.name)),
            liveness: c.liveness_probe.clone(),
            readiness: c.readiness_probe.clone(),
        });
    }
    Ok(PodPlan {
        namespace: namespace.to_owned(),
        name: name.clone(),
        uid,
        restart_policy: pod.spec.restart_policy,
        grace: Duration::from_secs(
            pod.spec
                .termination_grace_period_seconds
                .unwrap_or(DEFAULT_GRACE_S),
        ),
        dir,
        volumes,
        containers,
    })
}

/// `EDGED_VOLUME_<NAME>`: where volume `name`'s files are (a process cannot have mounts).
pub fn volume_variable(name: &str) -> String {
    let upper: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("EDGED_VOLUME_{upper}")
}

fn key_value(
    data: Option<Data>,
    r: &spec::KeyRef,
    kind: &str,
    namespace: &str,
) -> Result<Option<String>, Blocked> {
    match data.and_then(|d| d.get(&r.key).cloned()) {
        Some(v) => Ok(Some(String::from_utf8_lossy(&v).into_owned())),
        None if r.optional => Ok(None),
        None => Err(Blocked::ConfigError(format!(
            "couldn't find key {} in {kind} {namespace}/{}",
            r.key, r.name
        ))),
    }
}

fn set(env: &mut Vec<(String, String)>, key: &str, value: String) {
    match env.iter_mut().find(|(k, _)| k == key) {
        Some(slot) => slot.1 = value,
        None => env.push((key.to_owned(), value)),
    }
}

fn is_env_name(key: &str) -> bool {
    !key.is_empty()
        && !key.starts_with(|c: char| c.is_ascii_digit())
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// Kubernetes' `$(VAR)` expansion against the variables defined so far; `$$` is a literal `$`,
/// an unknown `$(VAR)` stays as written.
pub fn expand(input: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(') {
            match inner.find(')') {
                Some(close) => {
                    let name = &inner[..close];
                    match env.iter().rev().find(|(k, _)| k == name) {
                        Some((_, v)) => out.push_str(v),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &inner[close + 1..];
                }
                None => {
                    out.push_str(&rest[at..]);
                    rest = "";
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The `spec` part of a pod document and its uid: a change in either restarts the pod.
pub fn identity(document: &Value) -> Value {
    serde_json::json!({
        "uid": document.pointer("/metadata/uid"),
        "spec": document.get("spec"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn data(pairs: &[(&str, &str)]) -> Data {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect()
    }

    fn pod(value: Value) -> Pod {
        Pod::parse(&value).expect("pod parses")
    }

    fn env_of(plan: &PodPlan, key: &str) -> Option<String> {
        plan.containers[0]
            .env
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    #[test]
    fn env_from_then_env_with_expansion_and_volume_files() {
        let p = pod(json!({"metadata": {"name": "web", "uid": "u1"}, "spec": {
            "containers": [{"name": "main", "command": ["sh", "-c"], "args": ["echo $(GREETING)"],
                "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                "env": [{"name": "GREETING", "value": "hi $(CFG_mode)"},
                        {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                "volumeMounts": [{"name": "conf", "mountPath": "/etc/conf"}]}],
            "volumes": [{"name": "conf", "configMap": {"name": "cfg"}}]}}));
        let plan = plan(
            &p,
            "default",
            Path::new("/r/pods"),
            "10.0.0.1",
            |kind, name| match (kind, name) {
                (ConfigKind::ConfigMap, "cfg") => Lookup::Found(data(&[("mode", "eco")])),
                (ConfigKind::Secret, "s") => Lookup::Found(data(&[("pw", "hunter2")])),
                _ => Lookup::Missing,
            },
        )
        .expect("plans");
        assert_eq!(plan.containers[0].argv, ["sh", "-c", "echo hi eco"]);
        assert_eq!(env_of(&plan, "PW").as_deref(), Some("hunter2"));
        assert_eq!(env_of(&plan, "ME").as_deref(), Some("web"));
        assert_eq!(
            env_of(&plan, "EDGED_VOLUME_CONF").as_deref(),
            Some("/r/pods/default_web/volumes/conf")
        );
        assert_eq!(
            plan.volumes[0].files,
            vec![("mode".to_owned(), b"eco".to_vec())]
        );
        assert_eq!(plan.grace, Duration::from_secs(30));
        assert_eq!(
            plan.containers[0].working_dir,
            Path::new("/r/pods/default_web")
        );
    }

    #[test]
    fn unknown_references_are_looked_up_first_and_missing_ones_are_config_errors() {
        let p = pod(
            json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c",
            "envFrom": [{"configMapRef": {"name": "nope"}}]}]}}),
        );
        let pods = Path::new("/r");
        assert_eq!(
            plan(&p, "default", pods, "", |_, _| Lookup::Unknown),
            Err(Blocked::Unknown(vec![(
                ConfigKind::ConfigMap,
                "nope".to_owned()
            )]))
        );
        assert_eq!(
            plan(&p, "default", pods, "", |_, _| Lookup::Missing),
            Err(Blocked::ConfigError(
                "configmap \"nope\" not found".to_owned()
            ))
        );
        let optional = pod(
            json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c",
            "envFrom": [{"configMapRef": {"name": "nope", "optional": true}}]}]}}),
        );
        assert!(plan(&optional, "default", pods, "", |_, _| Lookup::Missing).is_ok());
    }

    #[test]
    fn a_missing_key_is_a_config_error() {
        let p = pod(
            json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "c",
            "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}]}}),
        );
        let err = plan(&p, "ns", Path::new("/r"), "", |_, _| {
            Lookup::Found(Data::new())
        });
        assert_eq!(
            err,
            Err(Blocked::ConfigError(
                "couldn't find key k in ConfigMap ns/cm".to_owned()
            ))
        );
    }

    #[test]
    fn expansion_follows_kubernetes() {
        let env = vec![("A".to_owned(), "1".to_owned())];
        assert_eq!(expand("$(A)-$(B)-$$(A)-$", &env), "1-$(B)-$(A)-$");
        assert_eq!(expand("x$(A", &env), "x$(A");
    }
}
