//! The bus: an embedded rumqttd broker that devices and edge modules talk to over MQTT, plus the
//! in-process links our own modules use. Only this crate knows rumqttd's types.
//!
//! # Layout
//! - [`backlog`]: how far our links lag; the front pauses clients before rumqttd would drop.
//! - [`config`]: our YAML listener/limit settings, turned into rumqttd's settings.
//! - [`codec`]: MQTT 3.1.1 and 5 as one codec type, so one listener type serves both.
//! - [`guard`]: the codec wrapper that vets every CONNECT, PUBLISH and SUBSCRIBE.
//! - [`framing`]: packet boundaries in a byte stream, for the front.
//! - [`dollar`]: `$hw/...` and `$ke/...` carried as `edgemeta$...` (rumqttd refuses `$` topics).
//! - [`security`]: authentication and the topic ACL the guard applies.
//! - [`lag`]: what each QoS 1/2 subscriber is owed; one that falls behind is cut off.
//! - [`server`]: starts the router and the listeners; a listener that cannot bind is fatal.
//! - [`front`]: our accept loop on every listener's address, spliced to rumqttd on loopback (TLS,
//!   client certificates, low latency, back-pressure, cutting clients off).
//! - [`intake`]: client publishes the front hands to a link itself, past rumqttd.
//! - [`session`]: one connection as both the front and the guard know it.
//! - [`link`]: an in-process client: subscribe, receive [`Message`]s, publish them.
//! - [`message`]: the one value all crates exchange.
//! - [`index`]: the subscription index the one path routes with (ARCHITECTURE.md, "The broker's
//!   one path"): MQTT 5's subscription options, shared groups, `$` topics.
//! - [`mailbox`]: what one session of the one path is owed, within its client's bounds.
//! - [`retained`]: the one path's retained messages.
//! - [`registry`]: the one path's sessions by client id: take-over, expiry, delayed wills.
//! - [`wire`]: the one path's codecs: MQTT 3.1.1 and 5 read into and written from one model.
//! - [`hub`]: the one path's shared state and its one `publish`.
//! - [`conn`]: the one path's connection task.

mod backlog;
mod codec;
mod config;
mod conn;
mod dollar;
mod error;
mod events;
mod framing;
mod front;
mod guard;
mod hub;
mod index;
mod intake;
mod lag;
mod link;
mod mailbox;
mod message;
mod registry;
mod retained;
mod security;
mod server;
mod session;
mod wire;
mod withhold;

pub use config::{BrokerConfig, ListenerConfig, MqttVersion};
pub use conn::serve as serve_one_path;
pub use dollar::{to_broker, to_client, INTERNAL_PREFIX};
pub use error::Error;
pub use hub::{Hub, HubLimits, Mailroom};
pub use index::{
    matches as filter_matches, valid_topic, Delivery, FilterError, Index, Options, RetainHandling,
    SessionId,
};
pub use link::{Link, Publisher};
pub use mailbox::{Dropped, Limits, Mailbox, Outgoing, Owed, Published, Resend};
pub use message::{Front, Message};
pub use registry::{Connected, Fired, Registry, Session as KeptSession, Will};
pub use retained::{Refused, Retained};
/// rumqttd's topic matching (broker forms), for checks on filters our links hold.
pub use rumqttd::protocol::matches;
pub use security::hash_password;
pub use server::{reachable, Broker, BrokerStats};
pub use session::{Ack, AckKind, Cork};
pub use wire::{Packet as WirePacket, Wire, WireError};

/// Client ids starting with this prefix are reserved for the node's own in-process links.
pub const RESERVED_CLIENT_PREFIX: &str = "edgemeta-";
