//! The resources the fake serves; the discovery documents come from `edgemeta-kubewire`.

pub use edgemeta_kubewire::kinds::{
    core, core_versions, group, groups, resources, Kind, READ_WRITE,
};

/// Everything the fake serves: what the edgecontroller reads and writes, plus what `kubectl`
/// asks for along the way.
pub const KINDS: &[Kind] = &[
    core("pods", "pod", "Pod", true, true, &["po"]),
    core("configmaps", "configmap", "ConfigMap", true, false, &["cm"]),
    core("secrets", "secret", "Secret", true, false, &[]),
    core("nodes", "node", "Node", false, true, &["no"]),
    core("services", "service", "Service", true, true, &["svc"]),
    core("endpoints", "endpoints", "Endpoints", true, false, &["ep"]),
    core("namespaces", "namespace", "Namespace", false, true, &["ns"]),
    core(
        "persistentvolumes",
        "persistentvolume",
        "PersistentVolume",
        false,
        true,
        &["pv"],
    ),
    core(
        "persistentvolumeclaims",
        "persistentvolumeclaim",
        "PersistentVolumeClaim",
        true,
        true,
        &["pvc"],
    ),
    core("events", "event", "Event", true, false, &["ev"]),
    Kind {
        group: "coordination.k8s.io",
        version: "v1",
        plural: "leases",
        singular: "lease",
        kind: "Lease",
        namespaced: true,
        status: false,
        short_names: &[],
    },
    crate::crd::CRD,
];

/// The built-in type at `group`/`version` under `plural` (custom kinds: [`crate::crd::Crds`]).
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static Kind> {
    Kind::find(KINDS, group, version, plural)
}
