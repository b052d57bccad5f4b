use std::time::Duration;

use edgemeta_protocol::MqttUrl;
use rumqttc::{MqttOptions, TlsConfiguration, Transport};
use serde::Deserialize;

use crate::tls::TlsConfig;
use crate::Error;

/// Cloud bridge settings (`cloud:` in the YAML config).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CloudConfig {
    /// `false` runs the node standalone: cloud-bound messages go to the local `<root>/cloud/...`.
    #[serde(default)]
    pub enabled: bool,
    /// The cloud broker, `mqtt://host:port` or, over TLS, `mqtts://host:port` (see `tls`).
    #[serde(default = "default_url")]
    pub url: String,
    /// TLS settings for an `mqtts://` url.
    #[serde(default)]
    pub tls: TlsConfig,
    /// This node's name in cloud topics.
    #[serde(default = "default_node_id")]
    pub node_id: String,
    /// First level of cloud topics: `<root>/<node_id>/up|down/...`.
    #[serde(default = "default_root")]
    pub root: String,
    /// MQTT client id at the cloud broker (default: `edgemeta-<node_id>`). The session is
    /// persistent, so the id must stay the same across restarts.
    #[serde(default)]
    pub client_id: Option<String>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    #[serde(default = "default_keep_alive_s")]
    pub keep_alive_s: u64,
    /// First reconnect delay; it doubles up to `backoff_max_ms`.
    #[serde(default = "default_backoff_min_ms")]
    pub backoff_min_ms: u64,
    /// Longest reconnect delay, each drawn from its upper half: a returning cloud is found
    /// within it, however long the node waited, and a fleet's connects spread over half of it.
    #[serde(default = "default_backoff_max_ms")]
    pub backoff_max_ms: u64,
    /// Messages sent to the cloud and not yet acknowledged by it.
    #[serde(default = "default_inflight")]
    pub inflight: u16,
    /// Largest MQTT packet sent or accepted, in bytes.
    #[serde(default = "default_max_packet_bytes")]
    pub max_packet_bytes: usize,
}

fn default_url() -> String {
    "mqtt://127.0.0.1:1884".to_owned()
}
fn default_node_id() -> String {
    "edge-node".to_owned()
}
fn default_root() -> String {
    "kubeedge".to_owned()
}
const fn default_keep_alive_s() -> u64 {
    30
}
const fn default_backoff_min_ms() -> u64 {
    200
}
const fn default_backoff_max_ms() -> u64 {
    1_500
}
const fn default_inflight() -> u16 {
    100
}
const fn default_max_packet_bytes() -> usize {
    2 * 1024 * 1024
}

impl Default for CloudConfig {
    fn default() -> Self {
        CloudConfig {
            enabled: false,
            url: default_url(),
            tls: TlsConfig::default(),
            node_id: default_node_id(),
            root: default_root(),
            client_id: None,
            username: None,
            password: None,
            keep_alive_s: default_keep_alive_s(),
            backoff_min_ms: default_backoff_min_ms(),
            backoff_max_ms: default_backoff_max_ms(),
            inflight: default_inflight(),
            max_packet_bytes: default_max_packet_bytes(),
        }
    }
}

impl CloudConfig {
    /// Checks the settings and builds the MQTT options; errors name the key. With TLS, the
    /// certificate files are read now: call it once per session to pick up rotated ones.
    pub fn mqtt_options(&self) -> Result<MqttOptions, Error> {
        let bad = |m: String| Err(Error::Config(m));
        let (tls, host, port) = match MqttUrl::parse(&self.url) {
            Ok(url) => (url.tls, url.host.clone(), url.port_or_default()),
            Err(e) => return bad(format!("cloud.url {e}")),
        };
        if !tls && self.tls != TlsConfig::default() {
            return bad(format!(
                "cloud.tls is set but cloud.url {:?} is not mqtts://",
                self.url
            ));
        }
        for (key, value) in [("cloud.node_id", &self.node_id), ("cloud.root", &self.root)] {
            if value.is_empty() || value.contains(['/', '+', '#']) {
                return bad(format!(
                    "{key} {value:?} must be one topic level without wildcards"
                ));
            }
        }
        if self.keep_alive_s < 5 {
            return bad("cloud.keep_alive_s must be at least 5".into());
        }
        if self.inflight == 0 {
            return bad("cloud.inflight must be at least 1".into());
        }
        if self.username.is_none() && self.password.is_some() {
            return bad("cloud.password is set but cloud.username is not".into());
        }
        let mut options = MqttOptions::new(self.client_id(), host, port);
        options
            .set_keep_alive(Duration::from_secs(self.keep_alive_s))
            .set_clean_session(false)
            .set_manual_acks(true)
            .set_inflight(self.inflight)
            .set_max_packet_size(self.max_packet_bytes, self.max_packet_bytes);
        if let Some(user) = &self.username {
            options.set_credentials(user, self.password.clone().unwrap_or_default());
        }
        if tls {
            let config = self.tls.client_config()?;
            options.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(config)));
        }
        Ok(options)
    }

    /// Whether the cloud broker is reached over TLS (`mqtts://`).
    pub fn uses_tls(&self) -> bool {
        self.url.starts_with("mqtts://")
    }

    /// The MQTT client id used at the cloud broker.
    pub fn client_id(&self) -> String {
        self.client_id
            .clone()
            .unwrap_or_else(|| format!("edgemeta-{}", self.node_id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_url(url: &str) -> CloudConfig {
        CloudConfig {
            url: url.to_owned(),
            ..CloudConfig::default()
        }
    }

    #[test]
    fn urls_give_host_and_port() {
        let options = with_url("mqtt://cloud.example:8883")
            .mqtt_options()
            .unwrap();
        assert_eq!(options.broker_address(), ("cloud.example".into(), 8883));
        let options = with_url("mqtt://10.0.0.1").mqtt_options().unwrap();
        assert_eq!(options.broker_address(), ("10.0.0.1".into(), 1883));
    }

    #[test]
    fn bad_urls_name_the_key() {
        for (url, text) in [
            (
                "tcp://x:1",
                r#"cloud.url "tcp://x:1" must start with mqtt:// or mqtts://"#,
            ),
            ("mqtt://:1", r#"cloud.url "mqtt://:1" has no host"#),
            (
                "mqtt://x:port",
                r#"cloud.url "mqtt://x:port": bad port "port""#,
            ),
            ("mqtts://:8883", r#"cloud.url "mqtts://:8883" has no host"#),
            ("x", r#"cloud.url "x" must start with mqtt:// or mqtts://"#),
        ] {
            let err = with_url(url).mqtt_options().unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid cloud config: {text}"),
                "{url}"
            );
        }
    }

    #[test]
    fn the_session_is_persistent_with_manual_acks() {
        let options = CloudConfig::default().mqtt_options().unwrap();
        assert!(!options.clean_session());
        assert!(options.manual_acks());
        assert_eq!(options.client_id(), "edgemeta-edge-node");
    }
}
