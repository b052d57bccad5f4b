use bytes::Bytes;
use rumqttd::local::{LinkRx, LinkTx};
use rumqttd::protocol::{Packet, Publish, PublishProperties};
use rumqttd::Notification;
use tokio::sync::mpsc;
use tracing::{debug, error, warn};

use std::sync::Arc;
use std::time::Duration;

use crate::backlog::Backlog;
use crate::dollar::to_client;
use crate::lag::{log_size, Lag, Route};
use crate::message::Front;
use crate::session::{deliverable, parse_ack_tag, Ack, Sessions, ACK_PROPERTY};
use crate::{Error, Message};

/// An in-process MQTT client: [`Link::inbox`] yields what its filters match, [`Publisher`] sends.
///
/// Receiving runs as a tokio task (rumqttd's `LinkRx::next` is async); publishing runs on its own
/// thread because `LinkTx` blocks on rumqttd's bounded router channel.
pub struct Link {
    pub inbox: mpsc::Receiver<Message>,
    pub publisher: Publisher,
}

/// Cheap, cloneable handle that publishes through a [`Link`].
#[derive(Clone, Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Message>,
    lag: Arc<Lag>,
    /// A test channel's receiver stands for a subscriber of every topic.
    reaches_all: bool,
}

/// How long a paced publish waits before it looks at its subscribers' room again, in case a
/// wake-up was missed.
const RECHECK: Duration = Duration::from_millis(50);

impl Publisher {
    /// Queues `message` for the broker; waits while the link's queue is full. A message routed
    /// past rumqttd ([`Publisher::reserve_now`]) is handed to the front at once.
    pub async fn publish(&self, mut message: Message) -> Result<(), Error> {
        if let Some(subscriptions) = message.front.0.take() {
            let topic = to_client(&message.topic);
            for owed in &subscriptions {
                owed.deliver(&self.lag, &topic, &message.payload);
            }
            return Ok(());
        }
        self.tx.send(message).await.map_err(|_| Error::LinkClosed)
    }

    /// [`Publisher::publish`] once every subscriber the message reaches has room for it in its
    /// filter's log, so rumqttd never skips a message under a subscriber that keeps reading.
    pub async fn publish_paced(&self, mut message: Message) -> Result<(), Error> {
        while !self.reserve_now(&mut message) {
            self.lag.room(RECHECK).await;
        }
        self.publish(message).await
    }

    /// Whether a client subscribes to `topic` now, shared subscriptions included (the node's
    /// own links are not counted).
    pub fn reaches_anyone(&self, topic: &str) -> bool {
        self.reaches_all || self.lag.reaches(topic)
    }

    /// Counts `message` against its subscribers' room if it fits now (then it is marked paced
    /// and must be published); `false` counts nothing.
    pub fn reserve_now(&self, message: &mut Message) -> bool {
        let size = log_size(message.topic.len(), message.payload.len());
        // v5 properties travel only through rumqttd.
        let front = message.correlation.is_none()
            && message.response_topic.is_none()
            && deliverable(message.topic.as_bytes(), &message.payload);
        match self.lag.reserve(&message.topic, size, front) {
            None => false,
            Some(route) => {
                message.paced = true;
                if let Route::Front(subscriptions) = route {
                    message.front = Front(Some(subscriptions));
                }
                true
            }
        }
    }

    /// A publisher whose messages land in the returned receiver: for tests of broker-free code.
    /// The receiver counts as a subscriber of every topic.
    pub fn channel(capacity: usize) -> (Publisher, mpsc::Receiver<Message>) {
        let (mut publisher, rx) = Self::counted(capacity, Arc::new(Lag::new(u64::MAX)));
        publisher.reaches_all = true;
        (publisher, rx)
    }

    fn counted(capacity: usize, lag: Arc<Lag>) -> (Publisher, mpsc::Receiver<Message>) {
        let (tx, rx) = mpsc::channel(capacity);
        let publisher = Publisher {
            tx,
            lag,
            reaches_all: false,
        };
        (publisher, rx)
    }
}

impl Link {
    /// Starts the link's receive task and publisher thread, both owned by `links`.
    pub(crate) fn spawn(
        client_id: String,
        link_tx: LinkTx,
        link_rx: LinkRx,
        capacity: usize,
        accounts: Accounts,
        links: &mut Links,
        filters: &[String],
    ) -> Result<Link, Error> {
        let Accounts {
            backlog,
            lag,
            sessions,
            intake,
        } = accounts;
        let (inbox_tx, inbox) = mpsc::channel(capacity);
        intake.register(filters, inbox_tx.clone());
        let (publisher, outgoing) = Publisher::counted(capacity, lag.clone());
        let thread = std::thread::Builder::new()
            .name(format!("{client_id}-tx"))
            .spawn({
                let client_id = client_id.clone();
                let backlog = backlog.clone();
                move || send(client_id, link_tx, outgoing, &backlog, &lag)
            })
            .map_err(|e| Error::Link {
                client_id: client_id.clone(),
                reason: format!("cannot start its publisher thread: {e}"),
            })?;
        links.threads.push((client_id.clone(), thread));
        links
            .receivers
            .spawn(receive(client_id, link_rx, inbox_tx, backlog, sessions));
        Ok(Link { inbox, publisher })
    }
}

/// The broker's shared counts a link takes part in: what its filters are owed (`backlog`), what
/// subscribers are owed (`lag`), and the connections acknowledgements go back to (`sessions`).
pub(crate) struct Accounts {
    pub backlog: Arc<Backlog>,
    pub lag: Arc<Lag>,
    pub sessions: Arc<Sessions>,
    pub intake: Arc<crate::intake::Intake>,
}

/// The tasks and threads of every in-process link, kept to be joined at shutdown.
#[derive(Default)]
pub struct Links {
    receivers: tokio::task::JoinSet<()>,
    threads: Vec<(String, std::thread::JoinHandle<()>)>,
}

impl Links {
    /// Runs `task` until the links stop receiving ([`Links::join`] aborts it first, so the
    /// publishers it holds are dropped before their threads are waited for).
    pub(crate) fn spawn(&mut self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.receivers.spawn(task);
    }

    /// Stops receiving, then waits for each publisher thread to hand over what its
    /// [`Publisher`]s queued (it ends once they are all dropped). Drop every publisher first.
    pub async fn join(mut self) -> Result<(), Error> {
        // A receiver waits on the router, which never goes away (rumqttd #771): nothing to wait for.
        self.receivers.shutdown().await;
        let mut result = Ok(());
        for (client_id, thread) in self.threads {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                result = Err(Error::Link {
                    client_id,
                    reason: "its publisher thread panicked".into(),
                });
            }
        }
        result
    }
}

/// Router notifications → inbox. Ends when the inbox is dropped or the router goes away.
async fn receive(
    client_id: String,
    mut link_rx: LinkRx,
    inbox: mpsc::Sender<Message>,
    backlog: Arc<Backlog>,
    sessions: Arc<Sessions>,
) {
    loop {
        let notification = match link_rx.next().await {
            Ok(Some(n)) => n,
            Ok(None) => continue,
            Err(e) => {
                error!(error_code = "EM-BROKER-LINK", %client_id, error = %e, "link receive failed");
                return;
            }
        };
        match notification {
            Notification::Forward(forward) => {
                backlog.consumed(forward.publish.payload.len());
                let Ok(topic) = String::from_utf8(forward.publish.topic.to_vec()) else {
                    warn!(error_code = "EM-BROKER-TOPIC-UTF8", %client_id, "dropped publish with non-UTF-8 topic");
                    continue;
                };
                let (response_topic, correlation, ack) = match forward.properties {
                    Some(p) => {
                        let ack = ack_of(&p.user_properties, &sessions);
                        (p.response_topic, p.correlation_data, ack)
                    }
                    None => (None, None, None),
                };
                let message = Message {
                    topic,
                    payload: forward.publish.payload,
                    response_topic,
                    correlation,
                    ack,
                    paced: false,
                    front: Front::default(),
                };
                if let Err(refused) = inbox.send(message).await {
                    // The node is stopping: the client publishes it again, unacknowledged.
                    if let Some(ack) = &refused.0.ack {
                        ack.abandon();
                    }
                    return;
                }
            }
            // The router parks a link whose buffer filled; without this, delivery stops silently.
            Notification::Unschedule => {
                if let Err(e) = link_rx.wake().await {
                    error!(error_code = "EM-BROKER-LINK", %client_id, error = %e, "link wake failed");
                    return;
                }
            }
            other => debug!(%client_id, notification = ?other, "link notification"),
        }
    }
}

/// The acknowledgement the guard attached to a client's publish, if its connection is still open.
fn ack_of(properties: &[(String, String)], sessions: &Sessions) -> Option<Ack> {
    let (_, tag) = properties.iter().find(|(key, _)| key == ACK_PROPERTY)?;
    let (session, ack) = parse_ack_tag(tag)?;
    sessions.reached_link(session, ack)
}

/// Outgoing queue → router, on a dedicated thread.
fn send(
    client_id: String,
    mut link_tx: LinkTx,
    mut outgoing: mpsc::Receiver<Message>,
    backlog: &Backlog,
    lag: &Lag,
) {
    while let Some(message) = outgoing.blocking_recv() {
        // Our own publishes count too, or the links' reads and subscribers' debts would not add up.
        backlog.published(&message.topic, message.payload.len());
        if !message.paced {
            lag.published(
                &message.topic,
                log_size(message.topic.len(), message.payload.len()),
            );
        }
        let result = match message.correlation {
            None => link_tx.publish(message.topic, message.payload),
            Some(correlation) => {
                let properties = PublishProperties {
                    correlation_data: Some(correlation),
                    ..Default::default()
                };
                let publish = Publish::new(Bytes::from(message.topic), message.payload, false);
                // `send` is declared async but completes without awaiting anything.
                poll_ready_now(link_tx.send(Packet::Publish(publish, Some(properties))))
            }
        };
        if let Err(e) = result {
            error!(error_code = "EM-BROKER-LINK", %client_id, error = %e, "link publish failed");
            return;
        }
    }
}

/// Polls a future that never returns `Pending` (rumqttd's `LinkTx::send`) to completion.
fn poll_ready_now<F: std::future::Future>(future: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut future = std::pin::pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::yield_now();
    }
}
