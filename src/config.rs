//! Settings: the embedded default (`conf/edge.yaml`) or `--config FILE`, then `EDGEMETA_*`
//! environment overrides; unknown keys are refused by name.

use std::net::SocketAddr;
use std::path::Path;

use anyhow::Context as _;
use config::{Config, Environment, File, FileFormat};
use edgemeta_bridges::CloudConfig;
use edgemeta_broker::BrokerConfig;
use edgemeta_edged::EdgedConfig;
use edgemeta_metamanager::{MetaConfig, StoreConfig};
use edgemeta_metaserver::MetaServerConfig;
use serde::Deserialize;

/// The default configuration, compiled in so the binary runs with no files around it.
pub const DEFAULT_YAML: &str = include_str!("../conf/edge.yaml");

/// Everything `edgemeta run` is configured with.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub broker: BrokerConfig,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub metamanager: MetaConfig,
    #[serde(default)]
    pub cloud: CloudConfig,
    /// `edgemeta edged`: the reference edge agent (a separate process, an MQTT client).
    #[serde(default)]
    pub edged: EdgedConfig,
    #[serde(default)]
    pub observe: ObserveConfig,
    /// The node's read-only Kubernetes API (KubeEdge's MetaServer).
    #[serde(default)]
    pub metaserver: MetaServerConfig,
    /// Devices beyond the MQTT mapper topics: KubeEdge's DMI for gRPC mappers.
    #[serde(default)]
    pub devices: edgemeta_dmi::DevicesConfig,
    /// How long SIGINT/SIGTERM may take to commit accepted work and stop, in milliseconds.
    #[serde(default = "default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// tokio worker threads serving the clients; 0: one per core (tokio's default). Fewer saves
    /// CPU per message but lets one busy task stall every client (docs/benchmarks.md,
    /// "One tokio worker per core").
    #[serde(default)]
    pub worker_threads: usize,
}

/// Logging settings.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// A tracing filter (`info`, `info,edgemeta_broker=debug`); `RUST_LOG` wins over it.
    #[serde(default = "default_level")]
    pub level: String,
    /// `text` for people (coloured only on a terminal), `json` (one object a line) for shippers.
    #[serde(default)]
    pub format: LogFormat,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The metrics and health endpoints (`/metrics`, `/healthz`, `/readyz`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObserveConfig {
    /// `false`: no HTTP listener and no metrics are kept.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Where the HTTP listener binds; `edgemeta status` asks the node there.
    #[serde(default = "default_observe_address")]
    pub address: SocketAddr,
    /// With the cloud enabled, `/readyz` fails once the oldest outbox entry is older than this.
    #[serde(default = "default_max_outbox_age_s")]
    pub max_outbox_age_s: u64,
    /// Time each stage of the message path (`edgemeta_stage_nanoseconds_total`, for
    /// `edgemeta-bench --stages`); off by default: the clock reads cost ~2 µs a message.
    #[serde(default)]
    pub stage_clocks: bool,
}

const fn default_true() -> bool {
    true
}
fn default_observe_address() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9464))
}
const fn default_max_outbox_age_s() -> u64 {
    300
}

impl Default for ObserveConfig {
    fn default() -> Self {
        ObserveConfig {
            enabled: true,
            address: default_observe_address(),
            max_outbox_age_s: default_max_outbox_age_s(),
            stage_clocks: false,
        }
    }
}

fn default_level() -> String {
    "info".to_owned()
}
const fn default_shutdown_grace_ms() -> u64 {
    5_000
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: default_level(),
            format: LogFormat::default(),
        }
    }
}

impl Settings {
    /// The tokio worker threads to start: `worker_threads`, or with 0 one per core.
    pub fn workers(&self) -> usize {
        match self.worker_threads {
            0 => std::thread::available_parallelism().map_or(1, |cores| cores.get()),
            n => n,
        }
    }

    /// Loads `file` (or the embedded default) with environment overrides on top.
    pub fn load(file: Option<&Path>) -> anyhow::Result<Settings> {
        let builder = match file {
            Some(path) => Config::builder()
                .add_source(File::from(path).format(FileFormat::Yaml).required(true)),
            None => Config::builder().add_source(File::from_str(DEFAULT_YAML, FileFormat::Yaml)),
        };
        let settings: Settings = builder
            // `prefix_separator` is required with `__`, or config expects `EDGEMETA__`.
            .add_source(
                Environment::with_prefix("EDGEMETA")
                    .prefix_separator("_")
                    .separator("__"),
            )
            .build()
            .and_then(Config::try_deserialize)
            .with_context(|| match file {
                Some(path) => format!("invalid configuration in {}", path.display()),
                None => {
                    "invalid configuration (embedded default + EDGEMETA_* environment)".to_owned()
                }
            })?;
        settings.broker.validate()?;
        if settings.cloud.enabled {
            settings.cloud.mqtt_options()?;
        }
        settings.edged.validate()?;
        settings.devices.dmi.validate()?;
        Ok(settings)
    }

    /// `edged:` with `broker_url` filled in: when empty, the first plain (not TLS) listener of
    /// this configuration (an unspecified address is reached on loopback); and `node.name`,
    /// when empty, from `cloud.node_id` if the cloud is enabled.
    pub fn edged(&self) -> anyhow::Result<EdgedConfig> {
        let mut edged = self.edged.clone();
        if edged.broker_url.is_empty() {
            let listener = self
                .broker
                .listeners
                .values()
                .find(|l| l.tls.is_none())
                .context(
                    "edged.broker_url is empty and no plain (not TLS) listener is configured",
                )?;
            let mut address = listener.address;
            if address.ip().is_unspecified() {
                address.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            edged.broker_url = format!("mqtt://{address}");
        }
        // The Node edged reports is the one the cloud knows this node as.
        if edged.node.name.is_empty() && self.cloud.enabled {
            edged.node.name = self.cloud.node_id.clone();
        }
        // kubelet API streams ride edged's own connection to the bridge's cloud broker.
        if self.cloud.enabled
            && edged.stream.broker_url.is_empty()
            && self.cloud.url.starts_with("mqtt://")
        {
            edged.stream.broker_url = self.cloud.url.clone();
            if edged.stream.username.is_none() {
                edged.stream.username = self.cloud.username.clone();
                edged.stream.password = self.cloud.password.clone();
            }
        }
        if edged.stream.root.is_empty() {
            edged.stream.root = self.cloud.root.clone();
        }
        Ok(edged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_default_equals_the_built_in_defaults() {
        let from_yaml: Settings = Config::builder()
            .add_source(File::from_str(DEFAULT_YAML, FileFormat::Yaml))
            .build()
            .and_then(Config::try_deserialize)
            .expect("conf/edge.yaml parses");
        let built_in: Settings = Config::builder()
            .build()
            .and_then(Config::try_deserialize)
            .expect("empty config takes defaults");
        assert_eq!(from_yaml, built_in);
    }

    #[test]
    fn worker_threads_default_to_one_per_core() {
        let mut settings: Settings = Config::builder()
            .build()
            .and_then(Config::try_deserialize)
            .expect("defaults");
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(settings.workers(), cores);
        settings.worker_threads = 3;
        assert_eq!(settings.workers(), 3);
    }

    #[test]
    fn an_unknown_key_is_refused_by_name() {
        let err = Config::builder()
            .add_source(File::from_str(
                "broker:\n  max_conections: 3\n",
                FileFormat::Yaml,
            ))
            .build()
            .and_then(Config::try_deserialize::<Settings>)
            .unwrap_err();
        assert!(err.to_string().contains("max_conections"), "{err}");
    }

    #[test]
    fn a_zero_dmi_bound_is_refused_by_name() {
        for key in [
            "max_connections",
            "preface_timeout_ms",
            "max_streams_per_connection",
            "max_served_per_connection",
        ] {
            let settings = parsed(&format!("devices:\n  dmi:\n    {key}: 0\n"));
            let err = settings.devices.dmi.validate().unwrap_err();
            assert!(err.to_string().contains(key), "{key}: {err}");
        }
    }

    /// Settings from `yaml` alone, before validation.
    fn parsed(yaml: &str) -> Settings {
        Config::builder()
            .add_source(File::from_str(yaml, FileFormat::Yaml))
            .build()
            .and_then(Config::try_deserialize)
            .expect("parses")
    }

    /// The error `broker_yaml` (the `broker:` section's lines) gets from validation.
    fn broker_refusal(broker_yaml: &str) -> String {
        let settings = parsed(&format!("broker:\n{broker_yaml}"));
        settings.broker.validate().unwrap_err().to_string()
    }

    #[test]
    fn a_packet_timeout_of_zero_is_refused_by_name() {
        let err = broker_refusal("  packet_timeout_ms: 0\n");
        assert!(err.contains("broker.packet_timeout_ms"), "{err}");
    }

    #[test]
    fn read_buffers_too_small_for_the_largest_packet_are_refused_by_name() {
        let err = broker_refusal("  max_packet_bytes: 2097152\n  read_buffers_bytes: 1048576\n");
        assert!(err.contains("broker.read_buffers_bytes"), "{err}");
        parsed(DEFAULT_YAML)
            .broker
            .validate()
            .expect("the defaults hold");
    }
}
