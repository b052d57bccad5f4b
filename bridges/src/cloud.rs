//! One cloud session after another: connect (persistent session, manual acks), signal
//! `cloud_connected`, subscribe to this node's down topics, then at the same time
//! - ingress: each cloud message goes to the MetaManager and is acknowledged to the cloud broker
//!   only once committed (in order; an unacknowledged one is redelivered after a reconnect);
//! - egress: the outbox is published in order with at most `inflight` unacknowledged; entries
//!   are deleted once the cloud broker's PUBACK has arrived for them and all before them.
//!
//! Each session gets a fresh rumqttc event loop, so rumqttc's own replay (which it silently
//! drops on a fresh broker session) is never relied on: everything unacknowledged is still in
//! the outbox and is sent again, with the same `msg_id`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::{Link, Message, Publisher};
use edgemeta_metamanager::envelope::{json_string, Envelope, Route};
use edgemeta_metamanager::{Ingress, OutboxHandle, OutboxStats, Outcome};
use rumqttc::{
    AsyncClient, ConnectReturnCode, Event, EventLoop, MqttOptions, Outgoing, Packet, Publish, QoS,
};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::backoff::Backoff;
use crate::topic_map::TopicMap;
use crate::{CloudConfig, Error};

/// How often the outbox depth is looked at (and logged when it changed).
const REPORT_EVERY: Duration = Duration::from_secs(10);
/// Cloud messages waiting to be handed to the MetaManager.
const DOWN_QUEUE: usize = 256;
/// Cloud messages received but not yet queued for the MetaManager, past which reading pauses.
const DOWN_BACKLOG: usize = 4096;

/// The bridge, ready to run.
pub struct CloudBridge {
    config: CloudConfig,
    options: MqttOptions,
    map: TopicMap,
    local_root: String,
    ingress: Ingress,
    outbox: OutboxHandle,
    link: Link,
}

/// How a session ended.
enum SessionEnd {
    Cancelled,
    Lost { error: Error, was_connected: bool },
}

impl CloudBridge {
    /// Checks the config. `link` must subscribe to `<root>/cloud/#` (see [`TopicMap::local_cloud_filter`]).
    pub fn new(
        config: CloudConfig,
        local_root: &str,
        link: Link,
        ingress: Ingress,
        outbox: OutboxHandle,
    ) -> Result<CloudBridge, Error> {
        let options = config.mqtt_options()?;
        let map = TopicMap::new(local_root, &config.root, &config.node_id);
        Ok(CloudBridge {
            config,
            options,
            map,
            local_root: local_root.to_owned(),
            ingress,
            outbox,
            link,
        })
    }

    /// Runs sessions until cancelled; between them waits a capped, jittered backoff.
    pub async fn run(self, cancel: CancellationToken) {
        let CloudBridge {
            config,
            options,
            map,
            local_root,
            ingress,
            outbox,
            link,
        } = self;
        let Link { inbox, publisher } = link;
        let carry = tokio::spawn(carry_local(inbox, outbox.clone(), cancel.clone()));
        let report = tokio::spawn(report_outbox(outbox.clone(), cancel.clone()));
        let signal = Signal {
            publisher,
            topic: format!("{local_root}/meta/edgehub/connect/node/connection"),
        };
        let mut backoff = Backoff::new(
            Duration::from_millis(config.backoff_min_ms),
            Duration::from_millis(config.backoff_max_ms),
        );
        let mut reconnects: u64 = 0;
        info!(url = %config.url, node_id = %config.node_id, client_id = %config.client_id(), "cloud bridge starting");
        loop {
            let session = Session {
                options: options.clone(),
                window: usize::from(config.inflight),
                map: &map,
                ingress: &ingress,
                outbox: &outbox,
                signal: &signal,
            };
            match session.run(&cancel, &mut backoff).await {
                SessionEnd::Cancelled => break,
                SessionEnd::Lost {
                    error,
                    was_connected,
                } => {
                    if was_connected {
                        signal.send("cloud_disconnected").await;
                        reconnects += 1;
                        warn!(error_code = "EM-BRIDGE-DISCONNECTED", error = %error, reconnects, "cloud connection lost");
                    } else {
                        warn!(error_code = "EM-BRIDGE-CONNECT", error = %error, "cannot reach the cloud broker");
                    }
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
        let _ = carry.await;
        let _ = report.await;
        info!(reconnects, "cloud bridge stopped");
    }
}

/// Publishes the connection signal on the local broker, where the MetaManager and every other
/// module see it.
struct Signal {
    publisher: Publisher,
    topic: String,
}

impl Signal {
    async fn send(&self, state: &str) {
        let route = Route {
            source: "edgehub".to_owned(),
            group: "meta".to_owned(),
            operation: "connect".to_owned(),
            resource: "node/connection".to_owned(),
        };
        let payload = Envelope::new(route, json_string(state)).to_bytes();
        if self
            .publisher
            .publish(Message::new(self.topic.clone(), payload))
            .await
            .is_err()
        {
            error!(
                error_code = "EM-BRIDGE-SIGNAL",
                state, "cannot publish the connection signal"
            );
        }
        info!(state, "cloud connection signal");
    }
}

/// One outbox entry sent to the cloud and not yet acknowledged.
struct InFlight {
    seq: i64,
    pkid: Option<u16>,
    acked: bool,
}

struct Session<'a> {
    options: MqttOptions,
    window: usize,
    map: &'a TopicMap,
    ingress: &'a Ingress,
    outbox: &'a OutboxHandle,
    signal: &'a Signal,
}

impl Session<'_> {
    async fn run(self, cancel: &CancellationToken, backoff: &mut Backoff) -> SessionEnd {
        // Room for a full window of publishes plus subscribes and acks, so try_publish never
        // finds the request channel full.
        let (client, mut eventloop) = AsyncClient::new(self.options.clone(), self.window * 2 + 64);
        let lost = |error: Error, was_connected: bool| SessionEnd::Lost {
            error,
            was_connected,
        };
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return SessionEnd::Cancelled,
                event = eventloop.poll() => match event {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) if ack.code == ConnectReturnCode::Success => break,
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => return lost(Error::Refused(ack.code), false),
                    Ok(_) => {}
                    Err(e) => return lost(e.into(), false),
                },
            }
        }
        backoff.reset();
        self.signal.send("cloud_connected").await;
        // Subscriptions are not restored by rumqttc: subscribe on every connection.
        if let Err(e) = client.try_subscribe(self.map.down_filter(), QoS::AtLeastOnce) {
            return lost(e.into(), true);
        }
        let (down_tx, down_rx) = mpsc::channel(DOWN_QUEUE);
        let redeliver = Arc::new(Notify::new());
        let ingress_task = tokio::spawn(ingress(
            down_rx,
            self.ingress.clone(),
            client.clone(),
            self.map.clone(),
            redeliver.clone(),
        ));
        let end = self
            .exchange(cancel, &client, &mut eventloop, down_tx, &redeliver)
            .await;
        if matches!(end, SessionEnd::Cancelled) {
            let _ = client.try_disconnect();
            // Let the DISCONNECT go out; bounded so shutdown stays bounded.
            let _ = tokio::time::timeout(Duration::from_millis(500), async {
                while eventloop.poll().await.is_ok() {}
            })
            .await;
        }
        ingress_task.abort();
        end
    }

    /// The connected part of a session: egress window and ingress hand-off.
    async fn exchange(
        &self,
        cancel: &CancellationToken,
        client: &AsyncClient,
        eventloop: &mut EventLoop,
        down_tx: mpsc::Sender<Publish>,
        redeliver: &Notify,
    ) -> SessionEnd {
        let changed: Arc<Notify> = self.outbox.changed();
        let mut inflight: VecDeque<InFlight> = VecDeque::new();
        let mut last_sent = 0_i64;
        let mut more = true;
        let mut acked_upto: Option<i64> = None;
        let mut unflushed = 0_usize;
        // Cloud messages not yet handed to ingress. The event loop is polled even while ingress
        // is busy: the acks ingress sends go through it, so blocking it on ingress deadlocks.
        // The cloud broker's in-flight window bounds this for QoS 1; the cap stops QoS 0 floods.
        let mut pending_down: VecDeque<Publish> = VecDeque::new();
        let lost = |error: Error| SessionEnd::Lost {
            error,
            was_connected: true,
        };
        loop {
            if more && inflight.len() <= self.window / 2 {
                let room = self.window - inflight.len();
                let entries = match self.outbox.peek(last_sent, room).await {
                    Ok(entries) => entries,
                    Err(e) => return lost(e.into()),
                };
                more = entries.len() == room;
                for entry in entries {
                    last_sent = entry.seq;
                    let Some(topic) = self.map.up(&entry.topic) else {
                        warn!(error_code = "EM-BRIDGE-TOPIC", topic = %entry.topic, "outbox entry is not cloud-bound; dropped");
                        inflight.push_back(InFlight {
                            seq: entry.seq,
                            pkid: Some(0),
                            acked: true,
                        });
                        continue;
                    };
                    if let Err(e) =
                        client.try_publish(topic, QoS::AtLeastOnce, false, entry.payload)
                    {
                        return lost(e.into());
                    }
                    inflight.push_back(InFlight {
                        seq: entry.seq,
                        pkid: None,
                        acked: false,
                    });
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => {
                    let _ = flush(self.outbox, &mut acked_upto, &mut unflushed).await;
                    return SessionEnd::Cancelled;
                }
                _ = changed.notified(), if !more => more = true,
                _ = redeliver.notified() => {
                    let _ = flush(self.outbox, &mut acked_upto, &mut unflushed).await;
                    return lost(Error::Redeliver);
                }
                permit = down_tx.reserve(), if !pending_down.is_empty() => match permit {
                    Ok(permit) => permit.send(pending_down.pop_front().expect("not empty")),
                    Err(_) => return lost(Error::LinkClosed),
                },
                event = eventloop.poll(), if pending_down.len() < DOWN_BACKLOG => match event {
                    Ok(Event::Outgoing(Outgoing::Publish(pkid))) => {
                        if let Some(slot) = inflight.iter_mut().find(|s| s.pkid.is_none()) {
                            slot.pkid = Some(pkid);
                        }
                    }
                    Ok(Event::Incoming(Packet::PubAck(ack))) => {
                        if let Some(slot) = inflight.iter_mut().find(|s| s.pkid == Some(ack.pkid) && !s.acked) {
                            slot.acked = true;
                        }
                        // Delete only a prefix whose every entry the cloud has acknowledged.
                        while inflight.front().is_some_and(|s| s.acked) {
                            let slot = inflight.pop_front().expect("front exists");
                            acked_upto = Some(slot.seq);
                            unflushed += 1;
                        }
                        if inflight.is_empty() || unflushed >= self.window / 2 {
                            if let Err(e) = flush(self.outbox, &mut acked_upto, &mut unflushed).await {
                                return lost(e);
                            }
                        }
                    }
                    Ok(Event::Incoming(Packet::Publish(publish))) => pending_down.push_back(publish),
                    Ok(_) => {}
                    Err(e) => {
                        let _ = flush(self.outbox, &mut acked_upto, &mut unflushed).await;
                        return lost(e.into());
                    }
                },
            }
        }
    }
}

/// Deletes the acknowledged prefix of the outbox.
async fn flush(
    outbox: &OutboxHandle,
    acked_upto: &mut Option<i64>,
    unflushed: &mut usize,
) -> Result<(), Error> {
    if let Some(seq) = acked_upto.take() {
        *unflushed = 0;
        outbox.ack(seq).await?;
    }
    Ok(())
}

/// Cloud → MetaManager, in order; each message is acknowledged to the cloud broker only after
/// the MetaManager committed it (or refused it for good, with an error reply). A message refused
/// for now (outbox full) stops the acks and ends the session, so that the cloud broker delivers
/// it and everything after it again, in order.
async fn ingress(
    mut down_rx: mpsc::Receiver<Publish>,
    meta: Ingress,
    client: AsyncClient,
    map: TopicMap,
    redeliver: Arc<Notify>,
) {
    let (order_tx, mut order_rx) =
        mpsc::channel::<(oneshot::Receiver<Outcome>, Publish)>(DOWN_QUEUE);
    let acker = tokio::spawn(async move {
        while let Some((done, publish)) = order_rx.recv().await {
            match done.await {
                Ok(Outcome::Final) => {
                    if client.ack(&publish).await.is_err() {
                        return;
                    }
                }
                Ok(Outcome::Retry) => {
                    warn!(error_code = "EM-BRIDGE-REDELIVER", topic = %publish.topic, "cloud message refused for now; reconnecting to have it delivered again");
                    redeliver.notify_one();
                    return;
                }
                // MetaManager stopped: leave it unacknowledged, the broker redelivers.
                Err(_) => return,
            }
        }
    });
    while let Some(publish) = down_rx.recv().await {
        let done = match map.down(&publish.topic) {
            Some(local) => match meta
                .submit(Message::new(local, publish.payload.clone()))
                .await
            {
                Ok(done) => done,
                Err(_) => break,
            },
            None => {
                warn!(error_code = "EM-BRIDGE-TOPIC", topic = %publish.topic, "cloud message on an unexpected topic; acknowledged and dropped");
                let (tx, rx) = oneshot::channel();
                let _ = tx.send(Outcome::Final);
                rx
            }
        };
        if order_tx.send((done, publish)).await.is_err() {
            break;
        }
    }
    drop(order_tx);
    let _ = acker.await;
}

/// Local `<root>/cloud/...` traffic from other modules → the outbox, so it is as durable and
/// ordered as the MetaManager's own.
async fn carry_local(
    mut inbox: mpsc::Receiver<Message>,
    outbox: OutboxHandle,
    cancel: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            message = inbox.recv() => match message {
                Some(message) => message,
                None => return,
            },
        };
        if let Err(e) = outbox
            .append(message.topic.clone(), message.payload.to_vec())
            .await
        {
            error!(error_code = e.code(), topic = %message.topic, error = %e, "cloud-bound message not queued");
        }
    }
}

/// Logs the outbox depth and the age of its oldest entry whenever they changed.
async fn report_outbox(outbox: OutboxHandle, cancel: CancellationToken) {
    let mut last = OutboxStats::default();
    let mut tick = tokio::time::interval(REPORT_EVERY);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Ok(stats) = outbox.stats().await else {
            return;
        };
        if (stats.entries, stats.bytes) != (last.entries, last.bytes) {
            let oldest_age_ms = stats
                .oldest_ms
                .map(|t| edgemeta_metamanager::envelope::now_ms().saturating_sub(t));
            info!(
                entries = stats.entries,
                bytes = stats.bytes,
                ?oldest_age_ms,
                "outbox"
            );
            last = stats;
        }
    }
}
