//! The wire protocol the node's modules share (protocol §1–§2): what edged, the cloud bridge and
//! the MetaManager all read and write, with no broker, store or MQTT client behind it.
//!
//! # Layout
//! - `envelope`: the KubeEdge `model.Message` JSON envelope, full or bare, and its helpers.
//! - `operation`: the operations a topic may carry ([`Operation`]).
//! - `resource`: `<namespace>/<type>[/<id>]` ([`Resource`]).
//! - `topic`: the module topics `<root>/<to>/<from>/<operation>/<namespace>/<type>[/<name>]`.
//! - `url`: `mqtt://` and `mqtts://` broker URLs ([`MqttUrl`]).
//! - `backoff`: capped exponential reconnect delay with jitter ([`Backoff`]).
//! - `error`: the one error type ([`Error`]).

mod backoff;
mod envelope;
mod error;
mod operation;
mod resource;
pub mod stream;
mod topic;
mod url;

pub use backoff::Backoff;
pub use envelope::{
    json_string, new_msg_id, now_ms, null, raw, rfc3339, sender_msg_id, Envelope, Header,
    ObjectMeta, Route,
};
pub use error::Error;
pub use operation::Operation;
pub use resource::{is_name, Resource};
pub use topic::{
    outbound, reply_module, type_level, InboundTopic, CLOUD, CLOUD_SOURCES, EDGED, META,
};
pub use url::MqttUrl;
