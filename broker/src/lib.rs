//! The bus: the node's MQTT broker, which devices and edge modules talk to over MQTT 3.1.1 and
//! 5, and the in-process links the node's own modules use. It terminates MQTT itself with
//! rumqttc's codecs and owns sessions and routing (ARCHITECTURE.md, "The broker's one path").
//!
//! # Layout, in the order a packet flows
//! - [`config`]: our YAML listener/limit settings.
//! - [`server`]: the listeners' accept loops and the node's modules' links; a listener that
//!   cannot bind is fatal.
//! - [`tls`]: TLS, and a client certificate's common name as the identity.
//! - [`conn`]: one connection's task: CONNECT (login, limits), then every packet both ways.
//! - [`wire`]: MQTT 3.1.1 and 5 read into and written from one model.
//! - [`security`]: authentication and the topic ACL a connection is held to.
//! - [`login`]: password checks on a small pool of threads, with back-off for failing clients.
//! - [`dollar`]: KubeEdge's `$hw/...` and `$ke/...` topics, open to clients, and the key the ACL
//!   matches them by.
//! - [`hub`]: the shared state and its one `publish`.
//! - [`index`]: the subscription index: MQTT 5's subscription options, shared groups, `$` topics.
//! - [`registry`]: sessions by client id: take-over, expiry, delayed wills.
//! - [`mailbox`]: what one session is owed, within its client's bounds.
//! - [`retained`]: retained messages.
//! - [`ack`]: PUBACK once the node's module is done with a publish (after its commit).
//! - [`link`]: an in-process client: receive [`Message`]s, publish them.
//! - [`events`]: `$hw/events/connected|disconnected/<client id>`.
//! - [`message`]: the one value all crates exchange.

mod ack;
mod config;
mod conn;
mod direct;
mod dollar;
mod error;
mod events;
mod hub;
mod index;
mod link;
mod log_every;
mod login;
mod mailbox;
mod message;
mod registry;
mod retained;
mod security;
mod server;
pub mod stages;
mod tls;
mod wire;

pub use ack::{release_together, Ack, AckKind};
pub use config::{BrokerConfig, ListenerConfig};
pub use conn::{serve_tcp as serve_connection, Shared};
pub use direct::{Kept, Together};
pub use dollar::is_carried;
pub use error::Error;
pub use hub::{Heard, Hub, HubLimits, Later, Mailroom, Take, Taken};
pub use index::{valid_topic, Delivery, FilterError, Index, Options, RetainHandling, SessionId};
pub use link::{Link, Links, Publisher};
pub use login::CheckConfig;
pub use mailbox::{Dropped, Limits, Mailbox, Outgoing, Owed, Published, Resend};
pub use message::{Message, Reserved};
pub use registry::{Connected, Fired, Registry, Session as KeptSession, Will};
pub use retained::{Refused, Retained};
pub use security::{hash_password, Policy};
pub use server::{reachable, Broker, BrokerStats};
pub use wire::{Packet as WirePacket, Wire, WireError};

/// Client ids starting with this prefix are reserved for the node's own in-process links.
pub const RESERVED_CLIENT_PREFIX: &str = "edgemeta-";

/// Whether `topic` matches `filter` (MQTT's rules; a `$` topic never matches a filter that
/// starts with a wildcard).
pub fn matches(topic: &str, filter: &str) -> bool {
    index::matches(filter, topic)
}
