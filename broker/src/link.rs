//! The node's own modules on the one path: a [`Link`] is a session with no socket. The hub
//! puts what its filters match straight into its inbox; its [`Publisher`] calls the hub's
//! `publish` like a client's connection task does.

use std::sync::Arc;
use std::time::Instant;

use rumqttc::v5::mqttbytes::v5::PublishProperties;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::hub::{hand_to_links, Heard, Hub, Take};
use crate::index::SessionId;
use crate::mailbox::Published;
use crate::{Error, Message};

/// How long a paced publish waits before it looks again, in case a wake-up was missed.
const RECHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// The QoS the node publishes at: each subscriber gets the QoS it subscribed with (the lower
/// of the two, MQTT 5.0 §3.8.4).
const NODE_QOS: u8 = 2;

/// An in-process MQTT client: [`Link::inbox`] yields what its filters match, [`Publisher`] sends.
pub struct Link {
    pub inbox: mpsc::Receiver<Message>,
    pub publisher: Publisher,
}

/// Cheap, cloneable handle that publishes as the node.
#[derive(Clone, Debug)]
pub struct Publisher {
    to: Target,
}

#[derive(Clone, Debug)]
enum Target {
    /// The hub, and the link's own session (its publishes never come back to it).
    Hub(Arc<Hub>, SessionId),
    /// A test's channel, whose receiver stands for a subscriber of every topic.
    Channel(mpsc::Sender<Message>),
}

impl Publisher {
    pub(crate) fn of(hub: Arc<Hub>, session: SessionId) -> Publisher {
        Publisher {
            to: Target::Hub(hub, session),
        }
    }

    /// Publishes `message` to every subscriber; waits only while a
    /// module's inbox is full.
    pub async fn publish(&self, message: Message) -> Result<(), Error> {
        match &self.to {
            Target::Channel(tx) => tx.send(message).await.map_err(|_| Error::LinkClosed),
            Target::Hub(hub, session) => {
                let properties = (message.correlation.is_some()
                    || message.response_topic.is_some())
                .then(|| PublishProperties {
                    correlation_data: message.correlation,
                    response_topic: message.response_topic,
                    ..PublishProperties::default()
                });
                let published = Arc::new(Published {
                    topic: Arc::from(message.topic.as_str()),
                    payload: message.payload.clone(),
                    received: Instant::now(),
                    expiry: None,
                    properties,
                });
                let routed = match message.reserved {
                    Some(reserved) => {
                        hub.publish_reserved(Some(*session), published, NODE_QOS, reserved)
                    }
                    None => hub.publish(Some(*session), published, NODE_QOS, false, None),
                };
                hand_to_links(routed.links).await;
                // Nothing cancels a module's publish: its readers have room or are cut off
                // within their window.
                hub.wait_for(routed.behind, &CancellationToken::new()).await;
                Ok(())
            }
        }
    }

    /// [`Publisher::publish`] once every connected reader it reaches has room for it in its
    /// queue, so a reader that keeps reading misses nothing however large the burst: what
    /// follows waits in the store meanwhile. A reader that does not take what it held within
    /// [`HubLimits::reader_stall`](crate::HubLimits) is cut off (it resyncs when it comes
    /// back), so one that stopped or crawls holds the others up only that long.
    pub async fn publish_paced(&self, message: Message) -> Result<(), Error> {
        let mut message = message;
        if let Target::Hub(hub, session) = &self.to {
            let topic = message.topic.clone();
            let weight = topic.len() + message.payload.len();
            loop {
                // Registered before the look, so room made in between is not missed.
                let room = hub.room.notified();
                if let Some(reserved) = hub.reserve(Some(*session), &topic, NODE_QOS, weight) {
                    message.reserved = Some(reserved);
                    break;
                }
                let mut behind = hub.blocking(&topic, weight);
                hub.judge(&mut behind);
                if behind.is_empty() {
                    continue;
                }
                let _ = tokio::time::timeout(RECHECK, room).await;
            }
        }
        self.publish(message).await
    }

    /// Lets `taker` take what reaches this module on the publisher's task ([`Take`]); a test's
    /// channel publisher has no hub and keeps its inbox.
    pub fn take_with(&self, taker: Arc<dyn Take>) {
        if let Target::Hub(hub, session) = &self.to {
            hub.set_taker(*session, taker);
        }
    }

    /// Whether a client subscribes to `topic` now, shared subscriptions
    /// included (the node's own links are not counted).
    pub fn reaches_anyone(&self, topic: &str) -> bool {
        match &self.to {
            Target::Channel(_) => true,
            Target::Hub(hub, _) => hub.reaches_clients(topic),
        }
    }

    /// [`Publisher::reaches_anyone`], remembered in `heard` until a subscription changes.
    pub fn reaches_anyone_heard(&self, topic: &str, heard: &mut Heard) -> bool {
        match &self.to {
            Target::Channel(_) => true,
            Target::Hub(hub, _) => hub.reaches_clients_heard(topic, heard),
        }
    }

    /// Promises `message` room in every connected reader's queue if each has it now (then it
    /// is marked and must be published); false promises nothing.
    pub fn reserve_now(&self, message: &mut Message) -> bool {
        match &self.to {
            Target::Channel(_) => true,
            Target::Hub(hub, session) => {
                let topic = &message.topic;
                let weight = topic.len() + message.payload.len();
                message.reserved = hub.reserve(Some(*session), topic, NODE_QOS, weight);
                message.reserved.is_some()
            }
        }
    }

    /// A publisher whose messages land in the returned receiver: for tests of broker-free code.
    /// The receiver counts as a subscriber of every topic.
    pub fn channel(capacity: usize) -> (Publisher, mpsc::Receiver<Message>) {
        let (tx, rx) = mpsc::channel(capacity);
        let publisher = Publisher {
            to: Target::Channel(tx),
        };
        (publisher, rx)
    }
}

/// The tasks the broker runs for the node's modules (connection events), stopped at shutdown.
#[derive(Default)]
pub struct Links {
    tasks: tokio::task::JoinSet<()>,
}

impl Links {
    pub(crate) fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Stops them; call once every publisher is dropped.
    pub async fn join(mut self) -> Result<(), Error> {
        self.tasks.shutdown().await;
        Ok(())
    }
}
