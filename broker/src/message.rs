use bytes::Bytes;

use crate::ack::Ack;
use crate::index::Delivery;

/// One MQTT publication as our modules see it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub topic: String,
    pub payload: Bytes,
    /// MQTT v5 Response Topic a requester asked its replies to go to (incoming only).
    pub response_topic: Option<String>,
    /// MQTT v5 Correlation Data: read from a request, attached to its reply.
    pub correlation: Option<Bytes>,
    /// A client's publish the node consumes: dropping this (after the commit, or the error
    /// reply) sends the client its PUBACK / PUBCOMP.
    pub ack: Option<Ack>,
    /// Room was promised to it in its readers' queues (`Publisher::reserve_now`): it is
    /// queued for them, by the route the promise found, whatever else arrived meanwhile.
    pub reserved: Option<Reserved>,
}

impl Message {
    /// A publication with no v5 properties.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            response_topic: None,
            correlation: None,
            ack: None,
            reserved: None,
        }
    }
}

/// Room promised to a message in its readers' queues, and the route that found them
/// ([`crate::Hub::reserve`]); the message must then be published with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reserved(pub(crate) Vec<Delivery>);
