use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::Deserialize;

use crate::security::{AclConfig, AuthConfig, Policy};

/// Broker settings (`broker:` in the YAML config).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    /// First topic level of module traffic (`ke/<to>/<from>/<operation>/<resource>`).
    #[serde(default = "default_topic_root")]
    pub topic_root: String,
    /// Listeners by name; each binds one address and speaks one MQTT version.
    #[serde(default = "default_listeners")]
    pub listeners: BTreeMap<String, ListenerConfig>,
    /// Largest MQTT packet a client may send (topic and properties included), in bytes.
    #[serde(default = "default_max_packet_bytes")]
    pub max_packet_bytes: usize,
    /// Most simultaneous client connections, in-process links included.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How long a new TCP connection may take to send CONNECT, in milliseconds (at most 65535).
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u16,
    /// Size of one in-memory log segment per subscribed filter, in bytes (topic + payload + 4
    /// per message, as rumqttd counts; the memory it takes is about twice that).
    #[serde(default = "default_segment_bytes")]
    pub segment_bytes: usize,
    /// Segments kept per filter (at least 2): a QoS 1/2 subscriber owed more than
    /// `(count - 1) × segment_bytes` is disconnected before rumqttd would skip messages.
    #[serde(default = "default_segment_count")]
    pub segment_count: usize,
    /// Segment size of the filters our own links read (`<root>/meta/#`, `<root>/cloud/#`):
    /// clients are paused while a link is owed half of `(count - 1) × link_segment_bytes`.
    #[serde(default = "default_link_segment_bytes")]
    pub link_segment_bytes: usize,
    /// Segment size of the filters devices and mappers subscribe to under `$hw/events/device/`
    /// and `$ke/events/device/`: one log per device filter, each small, so a node's memory does not grow
    /// by `segment_count × segment_bytes` for every device.
    #[serde(default = "default_device_segment_bytes")]
    pub device_segment_bytes: usize,
    /// A subscriber owed messages that takes none for this many seconds is disconnected
    /// (`EM-BROKER-SUBSCRIBER-LAG`): the node's hand-ons wait for its filter meanwhile.
    #[serde(default = "default_subscriber_stall_s")]
    pub subscriber_stall_s: u64,
    /// Most subscriptions one client may hold; further SUBSCRIBEs get a failure return code.
    #[serde(default = "default_max_subscriptions_per_client")]
    pub max_subscriptions_per_client: usize,
    /// Turn Nagle off towards clients and ACK rumqttd at once on the loopback hop (rumqttd
    /// leaves Nagle on: a reply after a PUBACK then waits ~40 ms for the client's ACK).
    #[serde(default = "default_true")]
    pub low_latency: bool,
    /// The front writes the node's hand-ons to a topic that only exact subscriptions of
    /// clean-session clients take (a device's results) itself, past rumqttd, whose logs would
    /// keep each for every device filter (docs/protocol.md §6).
    #[serde(default = "default_true")]
    pub front_delivery: bool,
    /// Client publishes that only one of the node's links reads are handed to it by the front,
    /// past rumqttd (protocol §6.12).
    #[serde(default = "default_true")]
    pub front_intake: bool,
    /// Who may connect.
    #[serde(default)]
    pub auth: AuthConfig,
    /// What each identity may publish and subscribe to.
    #[serde(default)]
    pub acl: AclConfig,
}

/// Filters (broker form) whose logs are `device_segment_bytes`: what devices and mappers
/// subscribe to, typically several per device. Node-wide topics (`$hw/events/node/...`, one
/// message per device on a bulk membership change) keep the default log.
pub const DEVICE_FILTERS: [&str; 2] =
    ["edgemeta$hw/events/device/#", "edgemeta$ke/events/device/#"];

/// Segments per device filter: with hand-ons paced to each subscriber's room, one segment of
/// room is enough, and rumqttd holds every full segment of every device filter for good.
pub const DEVICE_SEGMENT_COUNT: usize = 2;

/// One listener.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to bind, e.g. `127.0.0.1:1883`.
    pub address: SocketAddr,
    /// MQTT protocol version spoken on this port: `v4` (3.1.1) or `v5`.
    #[serde(default)]
    pub protocol: MqttVersion,
    /// Serve MQTT over TLS with this certificate and key (PEM files).
    #[serde(default)]
    pub tls: Option<ListenerTls>,
}

/// A TLS listener's server identity.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// PEM certificate chain, server certificate first.
    pub cert_file: String,
    /// PEM private key (PKCS#8 or RSA).
    pub key_file: String,
    /// PEM CA certificates: when set, clients must present a certificate signed by one of them,
    /// and the certificate's common name is the client's identity (username) for the ACL.
    #[serde(default)]
    pub client_ca_file: Option<String>,
}

/// MQTT protocol version of a listener.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum MqttVersion {
    #[default]
    V4,
    V5,
}

const fn default_true() -> bool {
    true
}
fn default_topic_root() -> String {
    "ke".to_owned()
}
fn default_listeners() -> BTreeMap<String, ListenerConfig> {
    let mqtt = ListenerConfig {
        address: SocketAddr::from(([127, 0, 0, 1], 1883)),
        protocol: MqttVersion::V4,
        tls: None,
    };
    BTreeMap::from([("mqtt".to_owned(), mqtt)])
}
const fn default_max_packet_bytes() -> usize {
    2 * 1024 * 1024
}
/// Router slots kept for the node's in-process links beyond `max_connections` clients.
const LOCAL_LINK_HEADROOM: usize = 64;

const fn default_max_connections() -> usize {
    10_000
}
const fn default_connect_timeout_ms() -> u16 {
    5_000
}
const fn default_device_segment_bytes() -> usize {
    4 * 1024
}
fn default_segment_bytes() -> usize {
    256 * 1024
}
fn default_link_segment_bytes() -> usize {
    1024 * 1024
}
const fn default_subscriber_stall_s() -> u64 {
    30
}
const fn default_segment_count() -> usize {
    4
}
const fn default_max_subscriptions_per_client() -> usize {
    1_000
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            topic_root: default_topic_root(),
            listeners: default_listeners(),
            max_packet_bytes: default_max_packet_bytes(),
            max_connections: default_max_connections(),
            connect_timeout_ms: default_connect_timeout_ms(),
            segment_bytes: default_segment_bytes(),
            segment_count: default_segment_count(),
            link_segment_bytes: default_link_segment_bytes(),
            device_segment_bytes: default_device_segment_bytes(),
            subscriber_stall_s: default_subscriber_stall_s(),
            max_subscriptions_per_client: default_max_subscriptions_per_client(),
            low_latency: true,
            front_delivery: true,
            front_intake: true,
            auth: AuthConfig::default(),
            acl: AclConfig::default(),
        }
    }
}

impl BrokerConfig {
    /// Checks what serde cannot; errors name the offending key.
    pub fn validate(&self) -> Result<(), crate::Error> {
        let bad = |m: String| Err(crate::Error::Config(m));
        if self.topic_root.is_empty() || self.topic_root.contains(['/', '+', '#']) {
            return bad(format!(
                "broker.topic_root {:?} must be one non-empty topic level without wildcards",
                self.topic_root
            ));
        }
        if self.listeners.is_empty() {
            return bad("broker.listeners must name at least one listener".into());
        }
        if self.subscriber_stall_s == 0 {
            return bad("broker.subscriber_stall_s must be at least 1".into());
        }
        // rumqttd's router panics on segments under 1 KiB; with one segment, any subscriber
        // that is behind at all can be skipped.
        if self.segment_bytes < 1024
            || self.link_segment_bytes < 1024
            || self.device_segment_bytes < 1024
            || self.segment_count < 2
        {
            return bad(
                "broker.segment_bytes, link_segment_bytes and device_segment_bytes must be >= 1024 and \
                 broker.segment_count >= 2"
                    .into(),
            );
        }
        if self.max_packet_bytes < 1024 {
            return bad("broker.max_packet_bytes must be >= 1024".into());
        }
        if self.max_connections == 0 {
            return bad("broker.max_connections must be >= 1".into());
        }
        for (name, listener) in &self.listeners {
            if let Some(tls) = &listener.tls {
                let files = [
                    ("cert_file", Some(&tls.cert_file)),
                    ("key_file", Some(&tls.key_file)),
                    ("client_ca_file", tls.client_ca_file.as_ref()),
                ];
                for (key, path) in files.into_iter().filter_map(|(k, p)| Some((k, p?))) {
                    if !std::path::Path::new(path).is_file() {
                        return bad(format!(
                            "broker.listeners.{name}.tls.{key}: no file at {path:?}"
                        ));
                    }
                }
            }
        }
        self.policy().map(drop)
    }

    /// The authentication and ACL rules in force.
    pub fn policy(&self) -> Result<Policy, crate::Error> {
        Policy::new(
            &self.topic_root,
            &self.auth,
            &self.acl,
            self.max_subscriptions_per_client,
        )
        .map_err(crate::Error::Config)
    }

    /// How far behind a link may fall before clients are paused: half of what its log can
    /// lose nothing of, leaving the other half for what is already on its way in.
    pub fn link_pause_bytes(&self) -> usize {
        // The links' `$hw`/`$ke` filters keep the default log (see `router_config`).
        self.link_segment_bytes
            .min(self.segment_bytes)
            .saturating_mul(self.segment_count.saturating_sub(1))
            / 2
    }

    /// The most a QoS 1/2 subscriber may be owed: rumqttd cannot drop the segment it reads
    /// from before it is owed more.
    pub fn subscriber_lag_limit(&self) -> usize {
        self.segment_bytes
            .saturating_mul(self.segment_count.saturating_sub(1))
    }

    /// The most a subscriber of a device filter may be owed.
    pub fn device_lag_limit(&self) -> usize {
        self.device_segment_bytes
            .saturating_mul(DEVICE_SEGMENT_COUNT - 1)
    }

    /// rumqttd's settings; `link_filters` (and client filters below them) get the links' logs,
    /// device filters ([`DEVICE_FILTERS`]) the small device logs.
    pub(crate) fn router_config(&self, link_filters: &[String]) -> rumqttd::RouterConfig {
        let log = |bytes| rumqttd::SegmentConfig {
            max_segment_size: bytes,
            max_segment_count: self.segment_count,
        };
        // rumqttd applies the last matching pattern of a HashMap, so no filter may match two:
        // the links' `edgemeta$hw/#` would match every device filter, and keeps the default log.
        let mut custom: std::collections::HashMap<_, _> = link_filters
            .iter()
            .filter(|filter| !filter.starts_with(crate::dollar::INTERNAL_PREFIX))
            .map(|filter| (filter.clone(), log(self.link_segment_bytes)))
            .collect();
        for pattern in DEVICE_FILTERS {
            custom.insert(
                pattern.to_owned(),
                rumqttd::SegmentConfig {
                    max_segment_size: self.device_segment_bytes,
                    max_segment_count: DEVICE_SEGMENT_COUNT,
                },
            );
        }
        // Every field is set on purpose: rumqttd's defaults (zero segments) panic its router.
        rumqttd::RouterConfig {
            // The front's guard holds clients to max_connections; the rest is for our own links.
            max_connections: self.max_connections + LOCAL_LINK_HEADROOM,
            max_outgoing_packet_count: 200,
            // A larger packet fills a segment by itself; the limits above still hold.
            max_segment_size: self.segment_bytes,
            max_segment_count: self.segment_count,
            custom_segment: Some(custom),
            initialized_filters: None,
            shared_subscriptions_strategy: Default::default(),
        }
    }

    pub(crate) fn server_settings(
        &self,
        name: &str,
        listener: &ListenerConfig,
    ) -> rumqttd::ServerSettings {
        rumqttd::ServerSettings {
            name: name.to_owned(),
            listen: listener.address,
            tls: listener.tls.as_ref().map(|tls| rumqttd::TlsConfig::Rustls {
                capath: None,
                certpath: tls.cert_file.clone(),
                keypath: tls.key_file.clone(),
            }),
            next_connection_delay_ms: 0,
            connections: rumqttd::ConnectionSettings {
                connection_timeout_ms: self.connect_timeout_ms,
                max_payload_size: self.max_packet_bytes,
                max_inflight_count: 100,
                auth: None,
                external_auth: None,
                dynamic_filters: false,
            },
        }
    }
}
