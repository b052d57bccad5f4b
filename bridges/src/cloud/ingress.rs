//! Cloud → MetaManager: each cloud message is submitted in order and acknowledged to the cloud
//! broker only once committed, so one left unacknowledged is redelivered after a reconnect.

use std::collections::VecDeque;
use std::sync::Arc;

use edgemeta_broker::Message;
use edgemeta_metamanager::{Ingress, Outcome};
use rumqttc::{AsyncClient, Publish};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;
use tracing::warn;

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
/// the same order as each submission ends. `redeliver` is notified when a message was refused
/// for now: acknowledging stops there, and the session must end so that the cloud broker
/// delivers it and everything after it again.
pub(super) fn start(
    tasks: &mut Tasks,
    meta: Ingress,
    client: AsyncClient,
    map: TopicMap,
    redeliver: Arc<Notify>,
    status: Arc<super::CloudStatus>,
    cancel: &CancellationToken,
) -> DownQueue {
    let (down_tx, down_rx) = mpsc::channel(DOWN_QUEUE);
    let (order_tx, order_rx) = mpsc::channel(DOWN_QUEUE);
    tasks.spawn(
        cancel
            .clone()
            .run_until_cancelled_owned(submit(down_rx, meta, map, order_tx)),
    );
    tasks.spawn(
        cancel
            .clone()
            .run_until_cancelled_owned(acknowledge(order_rx, client, redeliver, status)),
    );
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
        let done = match map.down(&publish.topic) {
            Some(local) => match meta
                .submit(Message::new(local, publish.payload.clone()))
                .await
            {
                Ok(done) => done,
                Err(_) => return,
            },
            None => {
                warn!(error_code = "EM-BRIDGE-TOPIC", topic = %publish.topic, "cloud message on an unexpected topic; acknowledged and dropped");
                let (tx, rx) = oneshot::channel();
                let _ = tx.send(Outcome::Final);
                rx
            }
        };
        if order_tx.send((done, publish)).await.is_err() {
            return;
        }
    }
}

async fn acknowledge(
    mut order_rx: mpsc::Receiver<Submitted>,
    client: AsyncClient,
    redeliver: Arc<Notify>,
    status: Arc<super::CloudStatus>,
) {
    while let Some((done, publish)) = order_rx.recv().await {
        match done.await {
            Ok(Outcome::Final) => {
                status.count_down_applied();
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
}
