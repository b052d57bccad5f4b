//! `edged:` in the YAML configuration: how the agent reaches the node's broker, which
//! namespaces it runs, where pods live on disk, and its timings.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use edgemeta_protocol::MqttUrl;
use serde::Deserialize;

use crate::Error;

/// Settings of `edgemeta edged`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EdgedConfig {
    /// The node's broker, `mqtt://host:port`. Empty: the first plain (not TLS) listener of the
    /// same configuration file (`0.0.0.0` is reached as `127.0.0.1`).
    #[serde(default)]
    pub broker_url: String,
    /// MQTT client id (ids starting with `edgemeta-` are reserved for the node's own links).
    #[serde(default = "default_client_id")]
    pub client_id: String,
    /// Login at the node's broker; with the ACL on, the username must be a module (`edged`).
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Namespaces whose pods this agent runs.
    #[serde(default = "default_namespaces")]
    pub namespaces: Vec<String>,
    /// Pod directories (volume files, logs, pid files) go under `<root_dir>/pods/`.
    #[serde(default = "default_root_dir")]
    pub root_dir: PathBuf,
    /// Reported as the pods' `hostIP` and `podIP` (processes share the host's network).
    #[serde(default = "default_node_ip")]
    pub node_ip: String,
    /// At most one `podstatus` per pod this often; changes in between are coalesced.
    #[serde(default = "default_status_interval_ms")]
    pub status_interval_ms: u64,
    /// Restart back-off of a failed container: `base`, doubling up to `max` (kubelet: 10 s, 5 min).
    #[serde(default = "default_restart_backoff_base_ms")]
    pub restart_backoff_base_ms: u64,
    #[serde(default = "default_restart_backoff_max_ms")]
    pub restart_backoff_max_ms: u64,
    /// A container that ran this long starts its back-off over (kubelet: 10 min).
    #[serde(default = "default_restart_backoff_reset_ms")]
    pub restart_backoff_reset_ms: u64,
    /// Reconnect delay to the node's broker: doubling from min to max.
    #[serde(default = "default_reconnect_min_ms")]
    pub reconnect_min_ms: u64,
    #[serde(default = "default_reconnect_max_ms")]
    pub reconnect_max_ms: u64,
    /// How long a query to the MetaManager may take before it is asked again (longer than
    /// the MetaManager's remote query timeout).
    #[serde(default = "default_query_timeout_ms")]
    pub query_timeout_ms: u64,
    /// A container log is rotated when it reaches this size ...
    #[serde(default = "default_log_max_bytes")]
    pub log_max_bytes: u64,
    /// ... keeping this many rotated files (`<container>.log.1` is the newest).
    #[serde(default = "default_log_max_files")]
    pub log_max_files: u32,
    #[serde(default = "default_keep_alive_s")]
    pub keep_alive_s: u64,
    /// The Kubernetes Node this agent runs: registration and heartbeats (docs/edged.md).
    #[serde(default)]
    pub node: NodeConfig,
    /// kubelet's API for this agent's pods, on loopback only (docs/edged.md).
    #[serde(default)]
    pub kubelet: KubeletConfig,
    /// The link that carries kubelet API requests from the cloud (docs/edged.md).
    #[serde(default)]
    pub stream: StreamConfig,
}

/// `edged.kubelet`: the kubelet API server, always bound to 127.0.0.1.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KubeletConfig {
    /// `false`: nothing is served, and streams from the cloud are refused.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The loopback port; 0 (the default) picks a free one, logged at start. Only edged's
    /// stream link needs it, so no fixed port can collide with another edged on the host.
    #[serde(default = "default_kubelet_port")]
    pub port: u16,
    /// `false`: `exec` answers 403.
    #[serde(default = "default_true")]
    pub exec: bool,
}

impl Default for KubeletConfig {
    fn default() -> Self {
        KubeletConfig {
            enabled: true,
            port: default_kubelet_port(),
            exec: true,
        }
    }
}

/// `edged.stream`: a connection edged opens to the cloud broker for kubelet API streams, beside
/// the node's bridge (whose up traffic goes through the durable outbox, wrong for byte streams).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StreamConfig {
    /// The cloud broker, `mqtt://host:port`; empty: `cloud.url` when the node is bridged, else off.
    #[serde(default)]
    pub broker_url: String,
    /// First level of cloud topics; empty: `cloud.root`.
    #[serde(default)]
    pub root: String,
    /// MQTT client id; empty: `edgemeta-<node>-stream`.
    #[serde(default)]
    pub client_id: String,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// Bytes one stream may have in flight in each direction (its memory bound on each side).
    #[serde(default = "default_stream_window")]
    pub window_bytes: u32,
    /// Streams open at once; more are refused.
    #[serde(default = "default_max_streams")]
    pub max_streams: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            broker_url: String::new(),
            root: String::new(),
            client_id: String::new(),
            username: None,
            password: None,
            window_bytes: default_stream_window(),
            max_streams: default_max_streams(),
        }
    }
}

const fn default_true() -> bool {
    true
}
const fn default_kubelet_port() -> u16 {
    0
}
const fn default_stream_window() -> u32 {
    64 * 1024
}
const fn default_max_streams() -> usize {
    256
}

/// `edged.node`: the Node edged registers and keeps Ready, as kubelet does.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// The Node's name; empty: `cloud.node_id` when `cloud.enabled`, else no Node is reported.
    #[serde(default)]
    pub name: String,
    /// The node status is sent this often (kubelet's `nodeStatusUpdateFrequency`).
    #[serde(default = "default_heartbeat_ms")]
    pub status_interval_ms: u64,
    /// The `kube-node-lease` Lease is renewed this often ...
    #[serde(default = "default_heartbeat_ms")]
    pub lease_interval_ms: u64,
    /// ... and names this duration.
    #[serde(default = "default_lease_duration_s")]
    pub lease_duration_s: u64,
    /// Capacity `pods`.
    #[serde(default = "default_max_pods")]
    pub max_pods: u64,
    /// Kept from the host's capacity for the system: allocatable = capacity − reserved.
    #[serde(default)]
    pub reserved_cpu_millis: u64,
    #[serde(default)]
    pub reserved_memory_mib: u64,
    #[serde(default)]
    pub reserved_ephemeral_storage_mib: u64,
    /// Labels the Node is registered with (the edge label is always added).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// `daemonEndpoints.kubeletEndpoint.Port`: the port of the controller's stream server,
    /// which carries kubelet API requests to this node; 0: none.
    #[serde(default)]
    pub kubelet_port: u16,
    /// Reported as the Node's `InternalDNS` address: a name resolving to the controller's
    /// stream server (`<node>.<stream domain>`), which routes by it; empty: not reported.
    #[serde(default)]
    pub kubelet_address: String,
}

const fn default_heartbeat_ms() -> u64 {
    10_000
}
const fn default_lease_duration_s() -> u64 {
    40
}
const fn default_max_pods() -> u64 {
    110
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            name: String::new(),
            status_interval_ms: default_heartbeat_ms(),
            lease_interval_ms: default_heartbeat_ms(),
            lease_duration_s: default_lease_duration_s(),
            max_pods: default_max_pods(),
            reserved_cpu_millis: 0,
            reserved_memory_mib: 0,
            reserved_ephemeral_storage_mib: 0,
            labels: BTreeMap::new(),
            kubelet_port: 0,
            kubelet_address: String::new(),
        }
    }
}

fn default_client_id() -> String {
    "edged".to_owned()
}
fn default_namespaces() -> Vec<String> {
    vec!["default".to_owned()]
}
fn default_root_dir() -> PathBuf {
    PathBuf::from("edged")
}
fn default_node_ip() -> String {
    "127.0.0.1".to_owned()
}
const fn default_status_interval_ms() -> u64 {
    1_000
}
const fn default_restart_backoff_base_ms() -> u64 {
    10_000
}
const fn default_restart_backoff_max_ms() -> u64 {
    300_000
}
const fn default_restart_backoff_reset_ms() -> u64 {
    600_000
}
const fn default_reconnect_min_ms() -> u64 {
    200
}
const fn default_reconnect_max_ms() -> u64 {
    30_000
}
const fn default_query_timeout_ms() -> u64 {
    70_000
}
const fn default_log_max_bytes() -> u64 {
    10 * 1024 * 1024
}
const fn default_log_max_files() -> u32 {
    5
}
const fn default_keep_alive_s() -> u64 {
    30
}

impl Default for EdgedConfig {
    fn default() -> Self {
        EdgedConfig {
            broker_url: String::new(),
            client_id: default_client_id(),
            username: None,
            password: None,
            namespaces: default_namespaces(),
            root_dir: default_root_dir(),
            node_ip: default_node_ip(),
            status_interval_ms: default_status_interval_ms(),
            restart_backoff_base_ms: default_restart_backoff_base_ms(),
            restart_backoff_max_ms: default_restart_backoff_max_ms(),
            restart_backoff_reset_ms: default_restart_backoff_reset_ms(),
            reconnect_min_ms: default_reconnect_min_ms(),
            reconnect_max_ms: default_reconnect_max_ms(),
            query_timeout_ms: default_query_timeout_ms(),
            log_max_bytes: default_log_max_bytes(),
            log_max_files: default_log_max_files(),
            keep_alive_s: default_keep_alive_s(),
            node: NodeConfig::default(),
            kubelet: KubeletConfig::default(),
            stream: StreamConfig::default(),
        }
    }
}

impl EdgedConfig {
    /// `(host, port)` of `broker_url`.
    pub fn broker_address(&self) -> Result<(String, u16), Error> {
        parse_url(&self.broker_url)
    }

    /// Refuses settings the agent cannot run with, naming the key.
    pub fn validate(&self) -> Result<(), Error> {
        if !self.broker_url.is_empty() {
            parse_url(&self.broker_url)?;
        }
        if self.client_id.is_empty() || self.client_id.contains(['/', '+', '#', '$']) {
            return Err(Error::Config(format!(
                "edged.client_id {:?} must be non-empty without / + # $",
                self.client_id
            )));
        }
        if self.namespaces.is_empty() {
            return Err(Error::Config("edged.namespaces is empty".to_owned()));
        }
        if let Some(bad) = self.namespaces.iter().find(|n| !crate::spec::is_name(n)) {
            return Err(Error::Config(format!(
                "edged.namespaces: {bad:?} is not a namespace name"
            )));
        }
        if self.node.status_interval_ms == 0 || self.node.lease_interval_ms == 0 {
            return Err(Error::Config(
                "edged.node.status_interval_ms and edged.node.lease_interval_ms must be > 0"
                    .to_owned(),
            ));
        }
        if !self.node.name.is_empty() && !crate::spec::is_name(&self.node.name) {
            return Err(Error::Config(format!(
                "edged.node.name {:?} is not a node name",
                self.node.name
            )));
        }
        if !self.stream.broker_url.is_empty() {
            parse_url(&self.stream.broker_url).map_err(|_| {
                Error::Config(format!(
                    "edged.stream.broker_url {:?}: want mqtt://host:port",
                    self.stream.broker_url
                ))
            })?;
        }
        if self.stream.window_bytes < 1024 {
            return Err(Error::Config(
                "edged.stream.window_bytes must be at least 1024".to_owned(),
            ));
        }
        if self.restart_backoff_base_ms == 0 || self.status_interval_ms == 0 {
            return Err(Error::Config(
                "edged.restart_backoff_base_ms and edged.status_interval_ms must be > 0".to_owned(),
            ));
        }
        Ok(())
    }

    pub(crate) fn ms(value: u64) -> Duration {
        Duration::from_millis(value)
    }
}

/// `(host, port)` of a plain `mqtt://host:port` URL: the node's broker is local, so no TLS, and
/// the port must be given. A trailing `/` and brackets around an IPv6 host are accepted.
fn parse_url(url: &str) -> Result<(String, u16), Error> {
    let bad = || Error::Config(format!("edged.broker_url {url:?}: want mqtt://host:port"));
    match MqttUrl::parse(url.trim_end_matches('/')) {
        Ok(MqttUrl {
            tls: false,
            host,
            port: Some(port),
        }) => Ok((host.trim_matches(['[', ']']).to_owned(), port)),
        _ => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broker_url_gives_host_and_port() {
        assert_eq!(
            parse_url("mqtt://127.0.0.1:1883").ok(),
            Some(("127.0.0.1".to_owned(), 1883))
        );
        assert_eq!(
            parse_url("mqtt://[::1]:1883/").ok(),
            Some(("::1".to_owned(), 1883))
        );
        assert!(parse_url("tcp://x:1").is_err());
        assert!(parse_url("mqtt://x").is_err());
        assert!(parse_url("mqtt://:1").is_err());
        assert!(parse_url("mqtts://x:8883").is_err());
        assert!(parse_url("mqtt://x:1883x").is_err());
    }

    #[test]
    fn the_defaults_validate() {
        EdgedConfig::default()
            .validate()
            .expect("defaults are valid");
    }
}
