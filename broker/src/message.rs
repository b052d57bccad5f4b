use std::sync::Arc;

use bytes::Bytes;

use crate::lag::Owed;
use crate::session::Ack;

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
    /// Already counted against its subscribers' room (`Lag::reserve`): published as it is.
    pub paced: bool,
    /// Counted, and to be written by the front to these subscribers instead of going through
    /// rumqttd (`lag::Route::Front`).
    pub front: Front,
}

/// The subscriptions the front writes a message to, if it goes past rumqttd.
#[derive(Debug, Clone, Default)]
pub struct Front(pub(crate) Option<Vec<Arc<Owed>>>);

impl PartialEq for Front {
    fn eq(&self, _: &Front) -> bool {
        // Messages compare by content; how they travel does not change what they are.
        true
    }
}

impl Eq for Front {}

impl Message {
    /// A publication with no v5 properties.
    pub fn new(topic: impl Into<String>, payload: impl Into<Bytes>) -> Self {
        Message {
            topic: topic.into(),
            payload: payload.into(),
            response_topic: None,
            correlation: None,
            ack: None,
            paced: false,
            front: Front::default(),
        }
    }
}
