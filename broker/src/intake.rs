//! Client publishes the front hands to a link itself, past rumqttd (protocol §6.12).
//!
//! A publish to a topic only one of our links reads, and no client's subscription (nor a
//! persistent session's, connected or not), needs nothing rumqttd does: the front parses it and
//! puts it in that link's inbox, skipping the loopback hop, rumqttd's connection task, the router
//! and the link's log. Anything else (QoS 2, retained, v5 properties, an alias, a subscriber, a
//! publish of the same client still on its way through rumqttd) goes through rumqttd as before.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::framing::plain_publish;
use crate::lag::Lag;
use crate::message::{Front, Message};
use crate::security::publishable;
use crate::session::{AckKind, Session, Sessions};

/// The largest publish handed over this way: a larger one streams through rumqttd instead of
/// being held whole in the front's buffer.
const MOST: usize = 64 * 1024;

/// Where the front hands client publishes to the node's links.
#[derive(Debug)]
pub struct Intake {
    enabled: bool,
    /// rumqttd's packet limit (`broker.max_packet_bytes`): a larger packet is rumqttd's to refuse.
    max_packet: usize,
    lag: Arc<Lag>,
    sessions: Arc<Sessions>,
    /// Each link's filters (broker form) and inbox.
    links: RwLock<Vec<(Vec<String>, mpsc::Sender<Message>)>>,
    taken: AtomicU64,
}

impl Intake {
    pub fn new(enabled: bool, max_packet: usize, lag: Arc<Lag>, sessions: Arc<Sessions>) -> Intake {
        Intake {
            enabled,
            max_packet,
            lag,
            sessions,
            links: RwLock::new(Vec::new()),
            taken: AtomicU64::new(0),
        }
    }

    /// A link reads `filters` into `inbox`.
    pub fn register(&self, filters: &[String], inbox: mpsc::Sender<Message>) {
        let mut links = self.links.write().unwrap_or_else(|p| p.into_inner());
        links.push((filters.to_vec(), inbox));
    }

    /// Whether a consumed publish of `len` bytes may be handed over (then the front waits for
    /// all of it before deciding); otherwise it streams through rumqttd as it arrives.
    pub fn wants(&self, len: usize) -> bool {
        self.enabled && len <= MOST.min(self.max_packet)
    }

    /// Publishes handed to links by the front so far.
    pub fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    /// The message `packet` (one whole PUBLISH from the client of `session`) carries, and the
    /// inbox of the one link it goes to, if the front may hand it over; `None`: through rumqttd.
    /// A QoS 1 publish carries the promise of its PUBACK (sent once the node has committed it).
    pub fn take(
        &self,
        session: &Session,
        packet: &[u8],
    ) -> Option<(mpsc::Sender<Message>, Message)> {
        if !self.wants(packet.len()) || session.routing() {
            return None;
        }
        let rights = session.rights()?;
        let plain = plain_publish(packet, rights.v5)?;
        let client_topic = std::str::from_utf8(plain.topic).ok()?;
        if client_topic.contains(['+', '#', '\0']) {
            return None;
        }
        let topic = publishable(&rights.grants, client_topic)?;
        if self.lag.reaches_any_session(&topic) {
            return None;
        }
        let inbox = self.inbox_for(&topic)?;
        let ack = match plain.pkid {
            Some(pkid) => Some(self.sessions.promise(session.id(), AckKind::PubAck, pkid)?),
            None => None,
        };
        self.taken.fetch_add(1, Ordering::Relaxed);
        let message = Message {
            topic: topic.into_owned(),
            payload: Bytes::copy_from_slice(plain.payload),
            response_topic: None,
            correlation: None,
            ack,
            paced: false,
            front: Front::default(),
        };
        Some((inbox, message))
    }

    /// The inbox of the one link that reads `topic`; `None` if none does or several do.
    fn inbox_for(&self, topic: &str) -> Option<mpsc::Sender<Message>> {
        let links = self.links.read().unwrap_or_else(|p| p.into_inner());
        let mut reading = links.iter().filter(|(filters, _)| {
            filters
                .iter()
                .any(|filter| rumqttd::protocol::matches(topic, filter))
        });
        let (_, inbox) = reading.next()?;
        reading.next().is_none().then(|| inbox.clone())
    }
}
