//! The Node edged runs, as kubelet keeps it: registered once at start (`insert
//! default/nodestatus/<node>`), then its status every `status_interval_ms` and its
//! `kube-node-lease` Lease every `lease_interval_ms`. Everything goes to `<root>/cloud/edged/...`,
//! where the cloud bridge sends heartbeats live instead of through the outbox (protocol §5).
//! The host is measured afresh for every status: capacity, and pressure as kubelet's default
//! hard eviction thresholds see it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use edgemeta_protocol::{outbound, Operation, CLOUD, EDGED};
use rumqttc::{AsyncClient, QoS};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::NodeConfig;
use crate::message;

/// The label that makes a Node an edge node for the edgecontroller.
const EDGE_LABEL: &str = "node-role.kubernetes.io/edge";
/// The Kubernetes API level edged's objects follow; `kubeletVersion` names it with ours.
const KUBE_VERSION: &str = "v1.33.0";
/// Memory pressure below this much available (kubelet: `memory.available<100Mi`).
const MEMORY_AVAILABLE_MIN_KIB: u64 = 100 * 1024;
/// Disk pressure below these shares free (kubelet: `nodefs.available<10%`,
/// `nodefs.inodesFree<5%`), in percent.
const DISK_FREE_MIN_PERCENT: u64 = 10;
const INODES_FREE_MIN_PERCENT: u64 = 5;
/// PID pressure below this share of `pid_max` left, in percent (kubelet has no default).
const PIDS_FREE_MIN_PERCENT: u64 = 10;

/// What edged reports its Node with, besides the host's own facts.
#[derive(Debug, Clone)]
pub struct NodeSettings {
    pub name: String,
    pub config: NodeConfig,
    pub node_ip: String,
    /// Where pods live: its filesystem is the Node's `ephemeral-storage`.
    pub pods_dir: PathBuf,
}

/// One look at the host.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Host {
    pub cpus: u64,
    pub memory_kib: u64,
    pub memory_available_kib: u64,
    pub disk_bytes: u64,
    pub disk_free_bytes: u64,
    pub inodes: u64,
    pub inodes_free: u64,
    pub pid_max: u64,
    pub processes: u64,
    pub kernel: String,
    pub os_image: String,
    pub machine_id: String,
    pub system_uuid: String,
    pub boot_id: String,
    pub hostname: String,
    /// Why the pods' filesystem could not be measured (Ready is False then).
    pub disk_error: Option<String>,
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// `field:  123 kB` of /proc/meminfo, in KiB.
fn meminfo(text: &str, field: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `PRETTY_NAME` of an os-release file.
fn os_image(text: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_owned())
        .unwrap_or_else(|| "Linux".to_owned())
}

/// The host as it is now (blocking: files under /proc and a statvfs).
pub fn measure(pods_dir: &Path) -> Host {
    let meminfo_text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    // /proc/loadavg's fourth field: runnable/total scheduling entities.
    let processes = read_trimmed("/proc/loadavg")
        .split_whitespace()
        .nth(3)
        .and_then(|f| f.split_once('/'))
        .and_then(|(_, total)| total.parse().ok())
        .unwrap_or(0);
    let os_release = std::fs::read_to_string("/etc/os-release")
        .or_else(|_| std::fs::read_to_string("/usr/lib/os-release"))
        .unwrap_or_default();
    let mut host = Host {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        memory_kib: meminfo(&meminfo_text, "MemTotal"),
        memory_available_kib: meminfo(&meminfo_text, "MemAvailable"),
        pid_max: read_trimmed("/proc/sys/kernel/pid_max")
            .parse()
            .unwrap_or(0),
        processes,
        kernel: read_trimmed("/proc/sys/kernel/osrelease"),
        os_image: os_image(&os_release),
        machine_id: read_trimmed("/etc/machine-id"),
        system_uuid: read_trimmed("/sys/class/dmi/id/product_uuid"),
        boot_id: read_trimmed("/proc/sys/kernel/random/boot_id"),
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        ..Host::default()
    };
    match rustix::fs::statvfs(pods_dir) {
        Ok(fs) => {
            host.disk_bytes = fs.f_blocks.saturating_mul(fs.f_frsize);
            host.disk_free_bytes = fs.f_bavail.saturating_mul(fs.f_frsize);
            host.inodes = fs.f_files;
            host.inodes_free = fs.f_favail;
        }
        Err(e) => host.disk_error = Some(format!("{}: {e}", pods_dir.display())),
    }
    host
}

/// Go's name for this architecture, as Kubernetes reports it.
fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// `part` below `percent` % of `whole` (a whole of 0 is no pressure: nothing was measured).
fn below(part: u64, whole: u64, percent: u64) -> bool {
    whole > 0 && part.saturating_mul(100) < whole.saturating_mul(percent)
}

fn condition(kind: &str, status: bool, reason: &str, message: &str) -> Value {
    json!({"type": kind, "status": if status { "True" } else { "False" }, "reason": reason, "message": message})
}

/// The four conditions kubelet reports, with its reasons and messages.
pub fn conditions(host: &Host) -> Vec<Value> {
    let memory = host.memory_kib > 0 && host.memory_available_kib < MEMORY_AVAILABLE_MIN_KIB;
    let disk = below(host.disk_free_bytes, host.disk_bytes, DISK_FREE_MIN_PERCENT)
        || below(host.inodes_free, host.inodes, INODES_FREE_MIN_PERCENT);
    let pids = below(
        host.pid_max.saturating_sub(host.processes),
        host.pid_max,
        PIDS_FREE_MIN_PERCENT,
    );
    let ready = match &host.disk_error {
        None => condition(
            "Ready",
            true,
            "KubeletReady",
            "kubelet is posting ready status",
        ),
        Some(e) => condition(
            "Ready",
            false,
            "KubeletNotReady",
            &format!("pods directory unusable: {e}"),
        ),
    };
    vec![
        if memory {
            condition(
                "MemoryPressure",
                true,
                "KubeletHasInsufficientMemory",
                "kubelet has insufficient memory available",
            )
        } else {
            condition(
                "MemoryPressure",
                false,
                "KubeletHasSufficientMemory",
                "kubelet has sufficient memory available",
            )
        },
        if disk {
            condition(
                "DiskPressure",
                true,
                "KubeletHasDiskPressure",
                "kubelet has disk pressure",
            )
        } else {
            condition(
                "DiskPressure",
                false,
                "KubeletHasNoDiskPressure",
                "kubelet has no disk pressure",
            )
        },
        if pids {
            condition(
                "PIDPressure",
                true,
                "KubeletHasInsufficientPID",
                "kubelet has insufficient PID available",
            )
        } else {
            condition(
                "PIDPressure",
                false,
                "KubeletHasSufficientPID",
                "kubelet has sufficient PID available",
            )
        },
        ready,
    ]
}

/// The Node document edged reports: `metadata` (name, labels) and `status`.
pub fn document(settings: &NodeSettings, host: &Host) -> Value {
    let config = &settings.config;
    let mib = 1024;
    let capacity = json!({
        "cpu": host.cpus.to_string(),
        "memory": format!("{}Ki", host.memory_kib),
        "pods": config.max_pods.to_string(),
        "ephemeral-storage": format!("{}Ki", host.disk_bytes / 1024),
    });
    let allocatable = json!({
        "cpu": format!("{}m", (host.cpus * 1000).saturating_sub(config.reserved_cpu_millis)),
        "memory": format!("{}Ki", host.memory_kib.saturating_sub(config.reserved_memory_mib * mib)),
        "pods": config.max_pods.to_string(),
        "ephemeral-storage": format!("{}Ki", (host.disk_bytes / 1024).saturating_sub(config.reserved_ephemeral_storage_mib * mib)),
    });
    let mut labels = json!({EDGE_LABEL: ""});
    for (k, v) in &config.labels {
        labels[k] = json!(v);
    }
    for (k, v) in [
        ("kubernetes.io/hostname", settings.name.as_str()),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", architecture()),
    ] {
        if labels.get(k).is_none() {
            labels[k] = json!(v);
        }
    }
    let version = env!("CARGO_PKG_VERSION");
    json!({
        "metadata": {"name": settings.name, "labels": labels},
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": conditions(host),
            "addresses": addresses(settings, host),
            "daemonEndpoints": {"kubeletEndpoint": {"Port": config.kubelet_port}},
            "nodeInfo": {
                "machineID": host.machine_id,
                "systemUUID": host.system_uuid,
                "bootID": host.boot_id,
                "kernelVersion": host.kernel,
                "osImage": host.os_image,
                "containerRuntimeVersion": format!("process://edgemeta-edged-{version}"),
                "kubeletVersion": format!("{KUBE_VERSION}-edgemeta-{version}"),
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": architecture(),
            },
        },
    })
}

/// The Node's addresses; the kubelet address (the controller's stream server, which routes by
/// it) as `InternalDNS`, the type apiservers are told to prefer (README "kubectl logs").
fn addresses(settings: &NodeSettings, host: &Host) -> Value {
    let mut addresses = vec![
        json!({"type": "InternalIP", "address": settings.node_ip}),
        json!({"type": "Hostname", "address": host.hostname}),
    ];
    if !settings.config.kubelet_address.is_empty() {
        addresses.push(json!({"type": "InternalDNS", "address": settings.config.kubelet_address}));
    }
    Value::Array(addresses)
}

/// The Lease spec edged renews (`renewTime` is the controller's clock: see docs/edged.md).
fn lease(settings: &NodeSettings) -> Value {
    json!({"spec": {"holderIdentity": settings.name,
                    "leaseDurationSeconds": settings.config.lease_duration_s}})
}

/// Publishes one message on `<root>/cloud/edged/<op>/<ns>/<type>` (QoS 0: a heartbeat lost is
/// replaced by the next).
fn publish(client: &AsyncClient, root: &str, operation: Operation, resource: &str, content: Value) {
    let topic = outbound(root, CLOUD, EDGED, operation.as_str(), resource);
    let (_, payload) = message::envelope(None, operation, resource, content);
    if let Err(e) = client.try_publish(topic, QoS::AtMostOnce, false, payload) {
        warn!(error_code = "EM-EDGED-MQTT", resource, error = %e, "node heartbeat not sent");
    }
}

async fn measured(settings: &NodeSettings) -> Value {
    let dir = settings.pods_dir.clone();
    let host = tokio::task::spawn_blocking(move || measure(&dir))
        .await
        .unwrap_or_default();
    document(settings, &host)
}

/// Registers the Node, then sends its status and Lease on their intervals until `cancel`.
pub async fn run(
    client: AsyncClient,
    root: String,
    settings: NodeSettings,
    cancel: CancellationToken,
) {
    let name = settings.name.clone();
    let status_resource = format!("default/nodestatus/{name}");
    let lease_resource = format!("kube-node-lease/lease/{name}");
    let ms = Duration::from_millis;
    let mut status_tick = tokio::time::interval(ms(settings.config.status_interval_ms));
    let mut lease_tick = tokio::time::interval(ms(settings.config.lease_interval_ms));
    for tick in [&mut status_tick, &mut lease_tick] {
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    let registration = measured(&settings).await;
    publish(
        &client,
        &root,
        Operation::Insert,
        &status_resource,
        registration,
    );
    info!(node = %name, "node registration sent");
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = status_tick.tick() => {
                let status = measured(&settings).await;
                publish(&client, &root, Operation::Update, &status_resource, status);
            }
            _ = lease_tick.tick() => {
                publish(&client, &root, Operation::Update, &lease_resource, lease(&settings));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> NodeSettings {
        NodeSettings {
            name: "edge-1".to_owned(),
            config: NodeConfig {
                reserved_cpu_millis: 500,
                reserved_memory_mib: 1,
                ..NodeConfig::default()
            },
            node_ip: "10.0.0.7".to_owned(),
            pods_dir: PathBuf::from("/"),
        }
    }

    fn healthy() -> Host {
        Host {
            cpus: 2,
            memory_kib: 4096,
            memory_available_kib: 1024 * 1024,
            disk_bytes: 100 << 20,
            disk_free_bytes: 50 << 20,
            inodes: 1000,
            inodes_free: 900,
            pid_max: 1000,
            processes: 100,
            ..Host::default()
        }
    }

    fn status_of(conditions: &[Value], kind: &str) -> (String, String) {
        let c = conditions.iter().find(|c| c["type"] == kind).expect(kind);
        (
            c["status"].as_str().unwrap_or_default().to_owned(),
            c["reason"].as_str().unwrap_or_default().to_owned(),
        )
    }

    #[test]
    fn pressure_follows_the_host_with_kubelets_reasons() {
        let ok = conditions(&healthy());
        assert_eq!(status_of(&ok, "Ready").1, "KubeletReady");
        assert_eq!(
            status_of(&ok, "MemoryPressure"),
            ("False".into(), "KubeletHasSufficientMemory".into())
        );
        let tight = Host {
            memory_available_kib: 50 * 1024,
            disk_free_bytes: 5 << 20,
            processes: 950,
            ..healthy()
        };
        let tight = conditions(&tight);
        assert_eq!(
            status_of(&tight, "MemoryPressure"),
            ("True".into(), "KubeletHasInsufficientMemory".into())
        );
        assert_eq!(
            status_of(&tight, "DiskPressure"),
            ("True".into(), "KubeletHasDiskPressure".into())
        );
        assert_eq!(
            status_of(&tight, "PIDPressure"),
            ("True".into(), "KubeletHasInsufficientPID".into())
        );
        let broken = Host {
            disk_error: Some("gone".to_owned()),
            ..healthy()
        };
        assert_eq!(status_of(&conditions(&broken), "Ready").0, "False");
    }

    #[test]
    fn allocatable_is_capacity_less_the_reserve() {
        let doc = document(&settings(), &healthy());
        let status = &doc["status"];
        assert_eq!(status["capacity"]["cpu"], "2");
        assert_eq!(status["allocatable"]["cpu"], "1500m");
        assert_eq!(status["capacity"]["memory"], "4096Ki");
        assert_eq!(status["allocatable"]["memory"], "3072Ki");
        assert_eq!(status["capacity"]["pods"], "110");
        assert_eq!(status["addresses"][0]["address"], "10.0.0.7");
        assert_eq!(doc["metadata"]["labels"][EDGE_LABEL], "");
        let version = status["nodeInfo"]["kubeletVersion"]
            .as_str()
            .unwrap_or_default();
        assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    }

    #[test]
    fn this_host_can_be_measured() {
        let host = measure(Path::new("/"));
        assert!(
            host.cpus > 0 && host.memory_kib > 0 && host.disk_bytes > 0,
            "{host:?}"
        );
        assert!(!host.kernel.is_empty());
    }
}
