//! The node's own modules on the one path: a [`Link`] is a session with no socket. The hub
//! puts what its filters match straight into its inbox; its [`Publisher`] calls the hub's
//! `publish` like a client's connection task does.

use std::sync::Arc;
use std::time::Instant;

use rumqttc::v5::mqttbytes::v5::PublishProperties;
use tokio::sync::mpsc;

use crate::dollar::to_client;
use crate::hub::{hand_to_links, Hub};
use crate::mailbox::Published;
use crate::{Error, Message};

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
    Hub(Arc<Hub>),
    /// A test's channel, whose receiver stands for a subscriber of every topic.
    Channel(mpsc::Sender<Message>),
}

impl Publisher {
    pub(crate) fn of(hub: Arc<Hub>) -> Publisher {
        Publisher {
            to: Target::Hub(hub),
        }
    }

    /// Publishes `message` (topic in the broker form) to every subscriber; waits only while a
    /// module's inbox is full.
    pub async fn publish(&self, message: Message) -> Result<(), Error> {
        match &self.to {
            Target::Channel(tx) => tx.send(message).await.map_err(|_| Error::LinkClosed),
            Target::Hub(hub) => {
                let properties = (message.correlation.is_some()
                    || message.response_topic.is_some())
                .then(|| PublishProperties {
                    correlation_data: message.correlation,
                    response_topic: message.response_topic,
                    ..PublishProperties::default()
                });
                let published = Arc::new(Published {
                    topic: Arc::from(to_client(&message.topic).as_ref()),
                    payload: message.payload,
                    received: Instant::now(),
                    expiry: None,
                    properties,
                });
                let waiting = hub.publish(None, published, NODE_QOS, false, None);
                hand_to_links(waiting).await;
                Ok(())
            }
        }
    }

    /// [`Publisher::publish`]: each subscriber has a bounded queue of its own, so nobody is
    /// waited for (one a whole queue behind is cut off, protocol §6.10).
    pub async fn publish_paced(&self, message: Message) -> Result<(), Error> {
        self.publish(message).await
    }

    /// Whether a client subscribes to `topic` (broker form) now, shared subscriptions
    /// included (the node's own links are not counted).
    pub fn reaches_anyone(&self, topic: &str) -> bool {
        match &self.to {
            Target::Channel(_) => true,
            Target::Hub(hub) => hub.reaches_clients(&to_client(topic)),
        }
    }

    /// Whether `message` may be published now without waiting for its subscribers: always,
    /// since each has its own bounded queue.
    pub fn reserve_now(&self, _message: &mut Message) -> bool {
        true
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
