use bytes::BytesMut;
use rumqttd::protocol::{Error as CodecError, Packet, Protocol};
use tracing::warn;

use crate::RESERVED_CLIENT_PREFIX;

/// Wraps rumqttd's codec to vet CONNECT before rumqttd acts on it.
///
/// rumqttd poisons a listener when a client id it refuses (`/ + # $`) connects twice (#1062), and a
/// remote client could take over an in-process link by reusing its id. A refused CONNECT is
/// rewritten to an empty id with a persistent session, which rumqttd answers with CONNACK
/// "identifier rejected" before it touches the state that the bug poisons.
#[derive(Debug, Clone)]
pub struct ConnectGuard<P> {
    inner: P,
}

impl<P> ConnectGuard<P> {
    pub fn new(inner: P) -> Self {
        ConnectGuard { inner }
    }
}

/// Why a client id is refused, or `None` when it is acceptable.
pub fn refuse_client_id(client_id: &str) -> Option<&'static str> {
    if client_id.contains(['/', '+', '#', '$']) {
        Some("contains one of / + # $")
    } else if client_id.starts_with(RESERVED_CLIENT_PREFIX) {
        Some("uses the prefix reserved for the node's own links")
    } else {
        None
    }
}

impl<P: Protocol> Protocol for ConnectGuard<P> {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, CodecError> {
        let mut packet = self.inner.read_mut(stream, max_size)?;
        if let Packet::Connect(connect, ..) = &mut packet {
            if let Some(reason) = refuse_client_id(&connect.client_id) {
                warn!(
                    error_code = "EM-BROKER-CLIENT-ID",
                    client_id = %connect.client_id,
                    reason,
                    "refused MQTT client id"
                );
                connect.client_id.clear();
                connect.clean_session = false;
            }
        }
        Ok(packet)
    }

    fn write(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, CodecError> {
        self.inner.write(packet, write)
    }
}

#[cfg(test)]
mod tests {
    use super::refuse_client_id;

    #[test]
    fn ids_rumqttd_cannot_handle_are_refused() {
        for id in ["dev/1", "a+b", "a#", "$sys", "edgemeta-metamanager"] {
            assert!(refuse_client_id(id).is_some(), "{id} should be refused");
        }
    }

    #[test]
    fn ordinary_ids_pass() {
        for id in ["dev-1", "sensor_7", "mosq-abc123", "", "edgemeta"] {
            assert!(refuse_client_id(id).is_none(), "{id} should pass");
        }
    }
}
