//! MQTT broker URLs: `mqtt://host[:port]` in plain text, `mqtts://host[:port]` over TLS.

use crate::Error;

/// A broker address read from a `mqtt://` or `mqtts://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MqttUrl {
    /// `mqtts://`: the broker is reached over TLS.
    pub tls: bool,
    /// Everything between the scheme and the last `:`, as written.
    pub host: String,
    /// The port, when the URL gives one.
    pub port: Option<u16>,
}

impl MqttUrl {
    /// Reads `mqtt://host[:port]` or `mqtts://host[:port]`; the port is what follows the last
    /// `:`, and the host must not be empty. Errors name the URL, not the setting it came from.
    pub fn parse(url: &str) -> Result<MqttUrl, Error> {
        let (tls, rest) = if let Some(rest) = url.strip_prefix("mqtt://") {
            (false, rest)
        } else if let Some(rest) = url.strip_prefix("mqtts://") {
            (true, rest)
        } else {
            return Err(Error::UrlScheme {
                url: url.to_owned(),
            });
        };
        let (host, port) = match rest.rsplit_once(':') {
            Some((host, port)) => {
                let port = port.parse::<u16>().map_err(|_| Error::UrlPort {
                    url: url.to_owned(),
                    port: port.to_owned(),
                })?;
                (host, Some(port))
            }
            None => (rest, None),
        };
        if host.is_empty() {
            return Err(Error::UrlHost {
                url: url.to_owned(),
            });
        }
        Ok(MqttUrl {
            tls,
            host: host.to_owned(),
            port,
        })
    }

    /// The port given, else MQTT's: 1883, or 8883 over TLS.
    pub fn port_or_default(&self) -> u16 {
        self.port.unwrap_or(if self.tls { 8883 } else { 1883 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(url: &str) -> (bool, String, u16) {
        let url = MqttUrl::parse(url).unwrap();
        (url.tls, url.host.clone(), url.port_or_default())
    }

    #[test]
    fn urls_give_host_and_port() {
        assert_eq!(
            parts("mqtt://cloud.example:8883"),
            (false, "cloud.example".into(), 8883)
        );
        assert_eq!(parts("mqtt://10.0.0.1"), (false, "10.0.0.1".into(), 1883));
        assert_eq!(
            parts("mqtts://cloud.example"),
            (true, "cloud.example".into(), 8883)
        );
        assert_eq!(MqttUrl::parse("mqtt://x").unwrap().port, None);
        assert_eq!(MqttUrl::parse("mqtt://x:1").unwrap().port, Some(1));
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, text) in [
            (
                "tcp://x:1",
                r#""tcp://x:1" must start with mqtt:// or mqtts://"#,
            ),
            ("x", r#""x" must start with mqtt:// or mqtts://"#),
            ("mqtt://:1", r#""mqtt://:1" has no host"#),
            ("mqtts://:8883", r#""mqtts://:8883" has no host"#),
            ("mqtt://x:port", r#""mqtt://x:port": bad port "port""#),
            ("mqtt://x:1/", r#""mqtt://x:1/": bad port "1/""#),
        ] {
            assert_eq!(MqttUrl::parse(url).unwrap_err().to_string(), text, "{url}");
        }
    }
}
