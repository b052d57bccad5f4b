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
    /// Bytes all connections' read buffers hold together past 4 KiB each: a packet being read
    /// grows its connection's buffer up to `max_packet_bytes`, so without this many clients
    /// stopping part-way through large packets would each hold that much. A connection that
    /// needs more than is free is closed (MQTT 5: 0x97; before its CONNECT, CONNACK 0x97 / 3).
    #[serde(default = "default_read_buffers_bytes")]
    pub read_buffers_bytes: usize,
    /// How long one packet may take from its first byte to its last, in milliseconds: a
    /// slower one ends its connection (MQTT 5: DISCONNECT 0x8D), so a client that stops or
    /// trickles part-way through a packet holds its share of `read_buffers_bytes` this long.
    #[serde(default = "default_packet_timeout_ms")]
    pub packet_timeout_ms: u32,
    /// Most simultaneous client connections, TCP and TLS, each counted from its accept to its
    /// close (the node's own modules are in-process links and not counted).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Most levels a client's topic name or filter may have (a `$share/<group>/` prefix
    /// counts): a deeper SUBSCRIBE filter gets 0x8F (3.1.1: 0x80), a deeper PUBLISH topic
    /// ends the connection (MQTT 5: DISCONNECT 0x90), a deeper will topic gets CONNACK 0x90.
    #[serde(default = "default_max_topic_levels")]
    pub max_topic_levels: usize,
    /// Most bytes a client's topic name or filter may have, refused as past `max_topic_levels`.
    #[serde(default = "default_max_topic_bytes")]
    pub max_topic_bytes: usize,
    /// How long a new TCP connection may take to send CONNECT, in milliseconds (at most 65535).
    /// Until then it counts against `max_connections` like any client.
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u16,
    /// Bytes of topic and payload one session's queue holds, connected or not: past it the
    /// publishers of a connected reader wait for it, and a session away drops what does not
    /// fit (`EM-BROKER-QUEUE-FULL`). QoS 0 messages fill half of it at most.
    #[serde(default = "default_queue_bytes")]
    pub queue_bytes: usize,
    /// Bytes all sessions' queues hold together (each session's `queue_bytes` is a share of
    /// it); sessions that are away fill half of it at most.
    #[serde(default = "default_queues_bytes")]
    pub queues_bytes: usize,
    /// A reader its publishers wait for must take what it held when they began to wait
    /// within this many seconds, else it is cut off (`EM-BROKER-SUBSCRIBER-LAG`).
    #[serde(default = "default_subscriber_stall_s")]
    pub subscriber_stall_s: u64,
    /// Sessions kept for clients that are away (MQTT 5 Session Expiry Interval, or 3.1.1's
    /// clean session flag 0); past it the one that would expire first ends
    /// (`EM-BROKER-SESSIONS-FULL`).
    #[serde(default = "default_max_away_sessions")]
    pub max_away_sessions: usize,
    /// Bytes of retained messages kept in all; a retained message past it is not kept
    /// (`EM-BROKER-RETAINED-FULL`) but still delivered.
    #[serde(default = "default_retained_bytes")]
    pub retained_bytes: usize,
    /// Most subscriptions one client may hold; further SUBSCRIBEs get a failure return code.
    #[serde(default = "default_max_subscriptions_per_client")]
    pub max_subscriptions_per_client: usize,
    /// Turn Nagle off towards clients: a reply written after a PUBACK would otherwise wait
    /// ~40 ms for the client's ACK.
    #[serde(default = "default_true")]
    pub low_latency: bool,
    /// Who may connect.
    #[serde(default)]
    pub auth: AuthConfig,
    /// What each identity may publish and subscribe to.
    #[serde(default)]
    pub acl: AclConfig,
}

/// One listener; it serves MQTT 3.1.1 and 5 alike (a CONNECT's protocol level says which).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// Address to bind, e.g. `127.0.0.1:1883`.
    pub address: SocketAddr,
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

const fn default_true() -> bool {
    true
}
fn default_topic_root() -> String {
    "ke".to_owned()
}
fn default_listeners() -> BTreeMap<String, ListenerConfig> {
    let mqtt = ListenerConfig {
        address: SocketAddr::from(([127, 0, 0, 1], 1883)),
        tls: None,
    };
    BTreeMap::from([("mqtt".to_owned(), mqtt)])
}
const fn default_max_packet_bytes() -> usize {
    2 * 1024 * 1024
}
const fn default_read_buffers_bytes() -> usize {
    64 * 1024 * 1024
}
const fn default_packet_timeout_ms() -> u32 {
    60_000
}
const fn default_max_connections() -> usize {
    10_000
}
const fn default_max_topic_levels() -> usize {
    128
}
const fn default_max_topic_bytes() -> usize {
    8 * 1024
}
const fn default_connect_timeout_ms() -> u16 {
    5_000
}
const fn default_queue_bytes() -> usize {
    256 * 1024
}
const fn default_queues_bytes() -> usize {
    64 * 1024 * 1024
}
const fn default_subscriber_stall_s() -> u64 {
    2
}
const fn default_max_away_sessions() -> usize {
    1_000
}
const fn default_retained_bytes() -> usize {
    16 * 1024 * 1024
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
            read_buffers_bytes: default_read_buffers_bytes(),
            packet_timeout_ms: default_packet_timeout_ms(),
            max_connections: default_max_connections(),
            max_topic_levels: default_max_topic_levels(),
            max_topic_bytes: default_max_topic_bytes(),
            connect_timeout_ms: default_connect_timeout_ms(),
            queue_bytes: default_queue_bytes(),
            queues_bytes: default_queues_bytes(),
            subscriber_stall_s: default_subscriber_stall_s(),
            max_away_sessions: default_max_away_sessions(),
            retained_bytes: default_retained_bytes(),
            max_subscriptions_per_client: default_max_subscriptions_per_client(),
            low_latency: true,
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
        if self.queue_bytes < 1024 {
            return bad("broker.queue_bytes must be >= 1024".into());
        }
        if self.queues_bytes < self.queue_bytes {
            return bad("broker.queues_bytes must be >= broker.queue_bytes".into());
        }
        if self.max_packet_bytes < 1024 {
            return bad("broker.max_packet_bytes must be >= 1024".into());
        }
        if self.read_buffers_bytes < self.max_packet_bytes {
            return bad(
                "broker.read_buffers_bytes must be >= broker.max_packet_bytes (else the largest \
                 packet could never be read)"
                    .into(),
            );
        }
        if self.packet_timeout_ms == 0 {
            return bad("broker.packet_timeout_ms must be >= 1".into());
        }
        if self.max_topic_levels == 0 || self.max_topic_bytes == 0 {
            return bad("broker.max_topic_levels and broker.max_topic_bytes must be >= 1".into());
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
}
