//! Cloud → MetaManager: each cloud message is submitted in order and acknowledged to the cloud
//! broker only once committed, so one left unacknowledged is redelivered after a reconnect. One
//! refused for now (a full outbox, a failed commit) is submitted again in the same session,
//! after a back-off, its acknowledgement and the ones after it held meanwhile.

use std::collections::VecDeque;
use std::sync::Arc;

use edgemeta_broker::Message;
use edgemeta_metamanager::{Ingress, Outcome};
use edgemeta_protocol::Backoff;
use rumqttc::{AsyncClient, Publish};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Tasks;
use crate::topic_map::TopicMap;
use crate::Error;

/// Cloud messages waiting to be handed to the MetaManager, and submissions waiting for their ack.
pub(super) const DOWN_QUEUE: usize = 256;
/// Cloud messages received but not yet queued for the MetaManager, past which reading pauses.
const DOWN_BACKLOG: usize = 4096;

/// The session's side of ingress: cloud messages read off the event loop, waiting for room in
/// the queue to the submitting task. The event loop is polled even while ingress is busy: the
/// acks ingress sends go through it, so blocking it on ingress would deadlock.
pub(super) struct DownQueue {
    /// The cloud broker's in-flight window bounds this for QoS 1; the cap stops QoS 0 floods.
    pending: VecDeque<Publish>,
    down_tx: mpsc::Sender<Publish>,
}

impl DownQueue {
    pub(super) fn received(&mut self, publish: Publish) {
        self.pending.push_back(publish);
    }

    /// Whether the event loop may be read: false once the backlog is full.
    pub(super) fn has_room(&self) -> bool {
        self.pending.len() < DOWN_BACKLOG
    }

    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Hands the oldest pending message on. Cancel safe: it is taken off only once there is room.
    pub(super) async fn hand_over(&mut self) -> Result<(), Error> {
        let permit = self
            .down_tx
            .reserve()
            .await
            .map_err(|_| Error::LinkClosed)?;
        if let Some(publish) = self.pending.pop_front() {
            permit.send(publish);
        }
        Ok(())
    }
}

/// Spawns the session's ingress into `tasks`: one task submits in order, one acknowledges in
/// the same order as each submission ends, submitting again after `retry`'s delays one that
/// was refused for now.
pub(super) fn start(
    tasks: &mut Tasks,
    meta: Ingress,
    client: AsyncClient,
    map: TopicMap,
    retry: Backoff,
    status: Arc<super::CloudStatus>,
    cancel: &CancellationToken,
) -> DownQueue {
    let (down_tx, down_rx) = mpsc::channel(DOWN_QUEUE);
    let (order_tx, order_rx) = mpsc::channel(DOWN_QUEUE);
    tasks.spawn(cancel.clone().run_until_cancelled_owned(submit(
        down_rx,
        meta.clone(),
        map.clone(),
        order_tx,
    )));
    tasks.spawn(cancel.clone().run_until_cancelled_owned(acknowledge(
        order_rx,
        client,
        (meta, map),
        retry,
        status,
    )));
    DownQueue {
        pending: VecDeque::new(),
        down_tx,
    }
}

/// A cloud message submitted to the MetaManager, and how its submission ended.
type Submitted = (oneshot::Receiver<Outcome>, Publish);

async fn submit(
    mut down_rx: mpsc::Receiver<Publish>,
    meta: Ingress,
    map: TopicMap,
    order_tx: mpsc::Sender<Submitted>,
) {
    while let Some(publish) = down_rx.recv().await {
        let Some(done) = submit_one(&meta, &map, &publish).await else {
            return;
        };
        if order_tx.send((done, publish)).await.is_err() {
            return;
        }
    }
}

/// Submits one cloud message; `None` once the MetaManager has stopped. One on a topic the map
/// does not know ends at once, to be acknowledged and dropped.
async fn submit_one(
    meta: &Ingress,
    map: &TopicMap,
    publish: &Publish,
) -> Option<oneshot::Receiver<Outcome>> {
    match map.down(&publish.topic) {
        Some(local) => meta
            .submit(Message::new(local, publish.payload.clone()))
            .await
            .ok(),
        None => {
            warn!(error_code = "EM-BRIDGE-TOPIC", topic = %publish.topic, "cloud message on an unexpected topic; acknowledged and dropped");
            let (tx, rx) = oneshot::channel();
            let _ = tx.send(Outcome::Final);
            Some(rx)
        }
    }
}

/// Acknowledges each cloud message once its submission ended for good, in arrival order (MQTT
/// §4.6). One refused for now is submitted again after `retry`'s next delay until it is taken:
/// the session stays, so the cloud broker neither fires the node's will nor redelivers what
/// came after it, and the controller does not resync the node. Ends (leaving the rest to be
/// redelivered) once the MetaManager or the session has stopped.
async fn acknowledge(
    mut order_rx: mpsc::Receiver<Submitted>,
    client: AsyncClient,
    (meta, map): (Ingress, TopicMap),
    mut retry: Backoff,
    status: Arc<super::CloudStatus>,
) {
    while let Some((done, publish)) = order_rx.recv().await {
        let mut outcome = done.await;
        let mut refusals: u64 = 0;
        while let Ok(Outcome::Retry) = outcome {
            refusals += 1;
            if refusals == 1 || refusals.is_multiple_of(10) {
                warn!(error_code = "EM-BRIDGE-REDELIVER", topic = %publish.topic, refusals, "cloud message refused for now; submitting it again after a back-off");
            }
            tokio::time::sleep(retry.next_delay()).await;
            outcome = match submit_one(&meta, &map, &publish).await {
                Some(done) => done.await,
                None => return,
            };
        }
        if refusals > 0 {
            retry.reset();
            info!(topic = %publish.topic, refusals, "cloud message taken after being refused for now");
        }
        match outcome {
            Ok(_) => {
                status.count_down_applied();
                if client.ack(&publish).await.is_err() {
                    return;
                }
            }
            // MetaManager stopped: leave it unacknowledged, the broker redelivers.
            Err(_) => return,
        }
    }
}
