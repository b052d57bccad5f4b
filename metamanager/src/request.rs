//! A message parsed from its topic and payload, and the address its answers go to.

use bytes::Bytes;
use edgemeta_broker::Message;
use serde_json::value::RawValue;

use edgemeta_protocol::Operation;
use edgemeta_protocol::Resource;
use edgemeta_protocol::{outbound, reply_module, META};
use edgemeta_protocol::{Envelope, Route};

/// A well-formed request: the topic has been checked and wins over the envelope's route.
#[derive(Debug, Clone)]
pub struct Request {
    pub operation: Operation,
    pub resource: Resource,
    /// The message as received, its route rewritten from the topic.
    pub envelope: Envelope,
    pub requester: Requester,
}

/// Who gets the `response`/`error` for a message, and how to correlate it.
#[derive(Debug, Clone)]
pub struct Requester {
    /// The sender module (`<from>` of the topic).
    pub from: String,
    /// The request's resource, names included; for a request refused before it was known, the
    /// text the sender's topic gave, valid or not. Replies carry it in `route.resource`.
    pub resource: String,
    /// The request's `msg_id`, copied to the reply's `parent_msg_id`.
    pub msg_id: Option<String>,
    pub group: String,
    /// MQTT v5 Response Topic and Correlation Data of the request.
    pub response_topic: Option<String>,
    pub correlation: Option<Bytes>,
}

impl Request {
    /// Builds the request from a checked topic and a parsed envelope (topic wins).
    pub fn new(
        from: &str,
        operation: Operation,
        resource: Resource,
        mut envelope: Envelope,
        message: &Message,
    ) -> Request {
        envelope.route.source = from.to_owned();
        envelope.route.operation = operation.as_str().to_owned();
        envelope.route.resource = resource.key().to_owned();
        if envelope.route.group.is_empty() {
            envelope.route.group = "resource".to_owned();
        }
        let requester = Requester {
            from: from.to_owned(),
            resource: resource.key().to_owned(),
            msg_id: Some(envelope.header.msg_id.clone()),
            group: envelope.route.group.clone(),
            response_topic: message.response_topic.clone(),
            correlation: message.correlation.clone(),
        };
        Request {
            operation,
            resource,
            envelope,
            requester,
        }
    }
}

impl Requester {
    /// The module the reply is published to (cloud sources are reached through `cloud`).
    pub fn module(&self) -> &str {
        reply_module(&self.from)
    }

    /// A reply envelope: `parent_msg_id` is the request's id, the resource is the request's.
    pub fn envelope(&self, operation: Operation, content: Box<RawValue>) -> Envelope {
        let route = Route {
            source: META.to_owned(),
            group: self.group.clone(),
            operation: operation.as_str().to_owned(),
            resource: self.resource.clone(),
        };
        let mut envelope = Envelope::new(route, content);
        envelope.header.parent_msg_id = self.msg_id.clone();
        envelope
    }

    /// `<root>/<requester>/meta/<operation>/<namespace>/<type>`: no name level (protocol §2, v2).
    pub fn topic(&self, root: &str, operation: Operation) -> String {
        outbound(
            root,
            self.module(),
            META,
            operation.as_str(),
            &self.resource,
        )
    }

    /// The copy of a reply for an MQTT v5 requester's own Response Topic, if it set one.
    pub fn v5_copy(&self, payload: &Bytes) -> Option<Message> {
        let topic = self.response_topic.clone()?;
        Some(Message {
            topic,
            payload: payload.clone(),
            correlation: self.correlation.clone(),
            ..Message::default()
        })
    }
}
