//! Edge → cloud: local cloud-bound traffic goes into the outbox, and the outbox goes to the cloud
//! in order with a bounded window; rows are deleted only once the cloud has acknowledged them.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::Message;
use edgemeta_metamanager::{OutboxEntry, OutboxHandle, OutboxStats};
use rumqttc::{AsyncClient, ClientError, QoS, Request};
use tokio::sync::futures::Notified;
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::live::Live;
use crate::topic_map::TopicMap;
use crate::Error;

/// How often the outbox depth is looked at (and logged when it changed).
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// Where one outbox entry in the window stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Handed to rumqttc, which has not said yet which packet id it took.
    Queued,
    /// On the wire as this packet id.
    Sent(u16),
    /// Acknowledged by the cloud, or never sent (not cloud-bound).
    Done,
}

/// The outbox entries sent to the cloud and not yet deleted, oldest first. The cloud may
/// acknowledge out of order; only a prefix that is acknowledged throughout is deleted, so a
/// lost session resends everything after it and nothing before it.
#[derive(Debug)]
pub(super) struct Window {
    capacity: usize,
    slots: VecDeque<(i64, Slot)>,
    /// Last seq of the acknowledged prefix taken off the window and not yet deleted.
    acked_upto: Option<i64>,
    /// How many entries that prefix holds: deleting them is one write, so it waits for a batch.
    unflushed: usize,
}

impl Window {
    pub(super) fn new(capacity: usize) -> Window {
        Window {
            capacity,
            slots: VecDeque::with_capacity(capacity),
            acked_upto: None,
            unflushed: 0,
        }
    }

    /// How many entries to read next: refilled once half the window is free, so each outbox
    /// read is a batch rather than one row per acknowledgement.
    pub(super) fn room(&self) -> usize {
        if self.slots.len() <= self.capacity / 2 {
            self.capacity - self.slots.len()
        } else {
            0
        }
    }

    /// Entry `seq` was handed to rumqttc for publishing.
    pub(super) fn push_queued(&mut self, seq: i64) {
        self.slots.push_back((seq, Slot::Queued));
    }

    /// Entry `seq` is not sent at all; it is deleted with the prefix it ends up in.
    pub(super) fn push_done(&mut self, seq: i64) {
        self.slots.push_back((seq, Slot::Done));
    }

    /// rumqttc sent a publish as `pkid`: rumqttc sends in the order it was given them, so that
    /// is the oldest entry still waiting for its packet id.
    pub(super) fn sent(&mut self, pkid: u16) {
        if let Some(slot) = self.slots.iter_mut().find(|(_, s)| *s == Slot::Queued) {
            slot.1 = Slot::Sent(pkid);
        }
    }

    /// The cloud acknowledged `pkid`; the acknowledged prefix moves off the window.
    pub(super) fn acked(&mut self, pkid: u16) {
        if let Some(slot) = self.slots.iter_mut().find(|(_, s)| *s == Slot::Sent(pkid)) {
            slot.1 = Slot::Done;
        }
        while let Some(&(seq, Slot::Done)) = self.slots.front() {
            self.slots.pop_front();
            self.acked_upto = Some(seq);
            self.unflushed += 1;
        }
    }

    /// Whether the acknowledged prefix should be deleted now: half a window of it, or nothing
    /// is left in flight (so the outbox is empty once the cloud has everything).
    pub(super) fn flush_due(&self) -> bool {
        self.slots.is_empty() || self.unflushed >= self.capacity / 2
    }

    /// The seq up to which the outbox may be deleted, if anything was acknowledged since the
    /// last call.
    pub(super) fn take_acknowledged(&mut self) -> Option<i64> {
        self.unflushed = 0;
        self.acked_upto.take()
    }
}

/// One session's egress: what has been read from the outbox and where each entry stands.
pub(super) struct Egress<'a> {
    outbox: &'a OutboxHandle,
    map: &'a TopicMap,
    changed: Arc<Notify>,
    window: Window,
    /// Entries read from the outbox that rumqttc's request queue had no room for yet: they go
    /// first, in order, before anything more is read.
    unsent: VecDeque<OutboxEntry>,
    last_sent: i64,
    /// The last read filled the room it had, so more may be waiting; otherwise wait for a commit.
    more: bool,
}

impl<'a> Egress<'a> {
    /// Starts from the outbox's oldest entry: a new session resends everything not deleted.
    pub(super) fn new(outbox: &'a OutboxHandle, map: &'a TopicMap, window: usize) -> Egress<'a> {
        Egress {
            outbox,
            map,
            changed: outbox.changed(),
            window: Window::new(window),
            unsent: VecDeque::new(),
            last_sent: 0,
            more: true,
        }
    }

    /// Reads the next entries into the window's free room and publishes them.
    pub(super) async fn fill(&mut self, client: &AsyncClient) -> Result<(), Error> {
        self.publish_unsent(client);
        let room = self.window.room();
        if !self.unsent.is_empty() || !self.more || room == 0 {
            return Ok(());
        }
        let entries = self.outbox.peek(self.last_sent, room).await?;
        self.more = entries.len() == room;
        if let Some(last) = entries.last() {
            self.last_sent = last.seq;
        }
        self.unsent.extend(entries);
        self.publish_unsent(client);
        Ok(())
    }

    /// Hands the unsent entries to rumqttc in order, until its request queue is full. A full
    /// queue is no error: the session's own loop drains it (acks share it), and the rest goes
    /// on the next turn of that loop.
    fn publish_unsent(&mut self, client: &AsyncClient) {
        while let Some(entry) = self.unsent.pop_front() {
            let Some(topic) = self.map.up(&entry.topic) else {
                warn!(error_code = "EM-BRIDGE-TOPIC", topic = %entry.topic, "outbox entry is not cloud-bound; dropped");
                self.window.push_done(entry.seq);
                continue;
            };
            match client.try_publish(topic, QoS::AtLeastOnce, false, entry.payload) {
                Ok(()) => self.window.push_queued(entry.seq),
                // The queue's receiver is the event loop this session polls, so a refused
                // request means a full queue; the payload comes back with it.
                Err(refused) => {
                    let payload = match refused {
                        ClientError::Request(Request::Publish(p))
                        | ClientError::TryRequest(Request::Publish(p)) => Vec::from(p.payload),
                        ClientError::Request(_) | ClientError::TryRequest(_) => {
                            unreachable!("try_publish returns the publish it could not queue")
                        }
                    };
                    self.unsent.push_front(OutboxEntry { payload, ..entry });
                    return;
                }
            }
        }
    }

    /// Resolves on the next commit that wrote the outbox; only worth waiting for once the
    /// outbox has been read to its end ([`Egress::caught_up`]).
    pub(super) fn changed(&self) -> Notified<'_> {
        self.changed.notified()
    }

    pub(super) fn caught_up(&self) -> bool {
        !self.more
    }

    pub(super) fn outbox_changed(&mut self) {
        self.more = true;
    }

    pub(super) fn sent(&mut self, pkid: u16) {
        self.window.sent(pkid);
    }

    pub(super) async fn acked(&mut self, pkid: u16) -> Result<(), Error> {
        self.window.acked(pkid);
        if self.window.flush_due() {
            self.flush().await?;
        }
        Ok(())
    }

    /// Deletes the acknowledged prefix from the outbox.
    pub(super) async fn flush(&mut self) -> Result<(), Error> {
        if let Some(seq) = self.window.take_acknowledged() {
            self.outbox.ack(seq).await?;
        }
        Ok(())
    }
}

/// Local `<root>/cloud/...` traffic from other modules → the outbox, so it is as durable and
/// ordered as the MetaManager's own; heartbeats go to `live` instead (`live.rs`).
pub(super) async fn carry_local(
    mut inbox: mpsc::Receiver<Message>,
    outbox: OutboxHandle,
    live: Arc<Live>,
    map: TopicMap,
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
        if map.heartbeat(&message.topic) {
            live.put(message.topic.clone(), message.payload.to_vec());
            continue;
        }
        if let Err(e) = outbox
            .append(message.topic.clone(), message.payload.to_vec())
            .await
        {
            error!(error_code = e.code(), topic = %message.topic, error = %e, "cloud-bound message not queued");
        }
    }
}

/// Logs the outbox depth and the age of its oldest entry whenever they changed.
pub(super) async fn report_outbox(outbox: OutboxHandle, cancel: CancellationToken) {
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
                .map(|t| edgemeta_protocol::now_ms().saturating_sub(t));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn window_with(capacity: usize, sent: &[(i64, u16)]) -> Window {
        let mut window = Window::new(capacity);
        for &(seq, pkid) in sent {
            window.push_queued(seq);
            window.sent(pkid);
        }
        window
    }

    /// Acknowledges `pkid`; returns up to where the outbox may now be deleted.
    fn ack(window: &mut Window, pkid: u16) -> Option<i64> {
        window.acked(pkid);
        window.take_acknowledged()
    }

    #[test]
    fn an_ack_out_of_order_deletes_nothing_until_the_prefix_is_acknowledged() {
        let mut window = window_with(10, &[(1, 1), (2, 2), (3, 3)]);
        assert_eq!(ack(&mut window, 2), None);
        assert_eq!(ack(&mut window, 1), Some(2));
        assert_eq!(ack(&mut window, 3), Some(3));
    }

    #[test]
    fn an_entry_that_is_not_sent_takes_no_packet_id_and_is_deleted_with_its_prefix() {
        let mut window = Window::new(10);
        window.push_queued(1);
        window.push_done(2);
        window.push_queued(3);
        window.sent(7);
        window.sent(8);
        assert_eq!(ack(&mut window, 7), Some(2));
        assert_eq!(ack(&mut window, 8), Some(3));
    }

    #[test]
    fn a_packet_id_reused_after_its_ack_names_the_newer_entry() {
        let mut window = window_with(10, &[(1, 5), (2, 6)]);
        assert_eq!(ack(&mut window, 5), Some(1));
        window.push_queued(3);
        window.sent(5);
        // Entry 2 is still in flight: this ack of 5 is for entry 3.
        assert_eq!(ack(&mut window, 5), None);
        assert_eq!(ack(&mut window, 6), Some(3));
    }

    #[test]
    fn the_window_refills_once_half_of_it_is_free() {
        assert_eq!(Window::new(4).room(), 4);
        let mut window = window_with(4, &[(1, 1), (2, 2), (3, 3)]);
        assert_eq!(window.room(), 0);
        window.acked(1);
        assert_eq!(window.room(), 2);
    }

    #[test]
    fn a_deletion_is_due_per_half_window_or_when_nothing_is_in_flight() {
        let mut window = window_with(4, &[(1, 1), (2, 2), (3, 3)]);
        window.acked(1);
        assert!(!window.flush_due());
        window.acked(2);
        assert!(window.flush_due());
        assert_eq!(window.take_acknowledged(), Some(2));
        assert!(!window.flush_due());
        window.acked(3);
        assert!(window.flush_due());
    }
}
