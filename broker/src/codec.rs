//! Both MQTT versions as one codec type, so one listener type (and one spawn function) serves
//! either; the match per packet costs nothing next to parsing it.

use bytes::BytesMut;
use rumqttd::protocol::{v4::V4, v5::V5, Error, Packet, Protocol};

use crate::config::MqttVersion;

/// rumqttd's codec for the version a listener speaks.
#[derive(Debug, Clone)]
pub enum Codec {
    V4(V4),
    V5(V5),
}

impl Codec {
    pub fn of(version: MqttVersion) -> Codec {
        match version {
            MqttVersion::V4 => Codec::V4(V4),
            MqttVersion::V5 => Codec::V5(V5),
        }
    }

    pub fn is_v5(&self) -> bool {
        matches!(self, Codec::V5(_))
    }
}

impl Protocol for Codec {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, Error> {
        match self {
            Codec::V4(codec) => codec.read_mut(stream, max_size),
            Codec::V5(codec) => codec.read_mut(stream, max_size),
        }
    }

    fn write(&self, packet: Packet, write: &mut BytesMut) -> Result<usize, Error> {
        match self {
            Codec::V4(codec) => codec.write(packet, write),
            Codec::V5(codec) => codec.write(packet, write),
        }
    }
}
