//! What one session is owed, within the bounds its client and the node set: a queue with a byte
//! share of one node-wide [`Budget`] (kept while the client is away, for a persistent session),
//! at most the client's Receive Maximum in flight, nothing larger than its Maximum Packet Size
//! as sent, expired messages dropped, and topic aliases keyed by topic. It also keeps what its
//! reader took, so a reader that crawls or stopped is told from one that is merely slower than
//! its writers ([`Mailbox::progress`]). No I/O: the connection task asks what to write next.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rumqttc::v5::mqttbytes::v5::PublishProperties;

/// The bytes all session queues of the node hold together, against one limit: each session's
/// queue is a share of it, so many sessions cannot add up past it.
#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// A budget no queue ever fills: for a mailbox no hub has joined yet.
    fn unbounded() -> Arc<Budget> {
        Budget::new(usize::MAX)
    }

    /// Bytes held in all queues now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether `weight` more fits below `limit` (the whole budget, or the part sessions
    /// that are away may fill).
    fn fits(&self, weight: usize, limit: usize) -> bool {
        self.used().saturating_add(weight) <= limit
    }

    fn take(&self, weight: usize) {
        self.used.fetch_add(weight, Ordering::Relaxed);
    }

    fn give(&self, weight: usize) {
        self.used.fetch_sub(weight, Ordering::Relaxed);
    }
}

/// What a reader's taking says about it while writers wait for room in its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Its queue has room: nobody needs to wait for it.
    Room,
    /// No room yet, but it took what it held when the wait began, or the window is not over.
    Behind,
    /// Within the window it did not take what it held when the wait began: it stopped, or
    /// crawls so slowly that its writers would wait for it far longer than for anyone else.
    Stopped,
}

/// A published message as every recipient shares it.
#[derive(Debug)]
pub struct Published {
    pub topic: Arc<str>,
    pub payload: Bytes,
    /// When the node took it, for its Message Expiry Interval.
    pub received: Instant,
    /// The publisher's Message Expiry Interval (MQTT 5.0 §3.3.2.3.3).
    pub expiry: Option<Duration>,
    /// The properties passed on unchanged (§3.3.2.3: payload format, content type, response
    /// topic, correlation data, user properties); alias, expiry and identifiers are per delivery.
    pub properties: Option<PublishProperties>,
}

/// One message owed to this session, as the index routed it.
#[derive(Clone, Debug)]
pub struct Owed {
    pub message: Arc<Published>,
    pub qos: u8,
    pub retain: bool,
    pub subscription_ids: Vec<u32>,
}

impl Owed {
    /// What it holds in the queue's byte count.
    pub fn weight(&self) -> usize {
        self.message.topic.len() + self.message.payload.len()
    }
}

/// The bounds of one session; the client's come from its CONNECT, the queue's from the node.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// The client's Receive Maximum: QoS 1 and 2 publishes unacknowledged at once (§3.1.2.11.3).
    pub receive_maximum: u16,
    /// The client's Maximum Packet Size (§3.1.2.11.4); None: the protocol's own limit.
    pub maximum_packet_size: Option<u32>,
    /// The client's Topic Alias Maximum (§3.1.2.11.5); 0: no aliases.
    pub topic_alias_maximum: u16,
    /// Bytes of topic and payload the queue holds before it refuses more.
    pub queue_bytes: usize,
}

/// A PUBLISH to write: the connection task encodes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Outgoing {
    pub pkid: u16,
    pub qos: u8,
    pub retain: bool,
    pub dup: bool,
    /// Empty when the alias stands for it (§3.3.2.3.4).
    pub topic: Arc<str>,
    pub topic_alias: Option<u16>,
    pub payload: Bytes,
    /// The expiry left, sent in place of the publisher's (§3.3.2.3.3).
    pub expiry_left: Option<u32>,
    pub subscription_ids: Vec<u32>,
    pub properties: Option<PublishProperties>,
}

/// Why a message was not kept for the client (counted, and logged by the caller).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// The queue was at its byte limit, or the node's budget was (a session that is away).
    QueueFull,
    /// Larger than the client's Maximum Packet Size ([MQTT-3.1.2-25]).
    TooLarge,
    /// Its Message Expiry Interval ran out while it waited.
    Expired,
}

/// A delivery in flight: its packet id, and whether its PUBREC came (QoS 2).
#[derive(Debug)]
struct Flight {
    pkid: u16,
    owed: Owed,
    released: bool,
}

/// What one session is owed. Owned by the session's lock; every call is short and never waits.
#[derive(Debug)]
pub struct Mailbox {
    limits: Limits,
    queued: VecDeque<Owed>,
    queued_bytes: usize,
    /// Bytes promised to paced publishers' messages on their way ([`Mailbox::reserve`]).
    reserved: usize,
    inflight: VecDeque<Flight>,
    last_pkid: u16,
    aliases: HashMap<Arc<str>, u16>,
    /// Messages dropped so far, by reason, for the session's metrics.
    pub dropped: [u64; 3],
    /// The node-wide budget its queued and promised bytes count against.
    budget: Arc<Budget>,
    /// Bytes its reader took off the queue, ever.
    taken: u64,
    /// Since when writers wait for room here: then, what was taken and what was queued.
    waited: Option<(Instant, u64, usize)>,
}

impl Mailbox {
    pub fn new(limits: Limits) -> Mailbox {
        Mailbox {
            limits,
            queued: VecDeque::new(),
            queued_bytes: 0,
            reserved: 0,
            inflight: VecDeque::new(),
            last_pkid: 0,
            aliases: HashMap::new(),
            dropped: [0; 3],
            budget: Budget::unbounded(),
            taken: 0,
            waited: None,
        }
    }

    /// Counts this queue against the node's `budget` from now on.
    pub fn join(&mut self, budget: &Arc<Budget>) {
        if Arc::ptr_eq(&self.budget, budget) {
            return;
        }
        let held = self.queued_bytes + self.reserved;
        self.budget.give(held);
        budget.take(held);
        self.budget = budget.clone();
    }

    /// Whether a message of `weight` bytes at `qos` fits now, beside what is promised: within
    /// the node's budget (a session that is `away` may fill half of it, so sessions nobody
    /// reads cannot starve those that are read) and the session's share of it. One message
    /// always fits an empty queue's share, so a message larger than the share still reaches
    /// a reader that keeps up.
    pub fn has_room(&self, weight: usize, qos: u8, away: bool) -> bool {
        let owed = self.queued_bytes + self.reserved;
        let node = if away {
            self.budget.limit() / 2
        } else {
            self.budget.limit()
        };
        self.budget.fits(weight, node) && (owed == 0 || owed + weight <= self.bound(qos))
    }

    /// Promises room to a message on its way; [`Mailbox::push_reserved`] takes it.
    pub fn reserve(&mut self, weight: usize) {
        self.reserved += weight;
        self.budget.take(weight);
    }

    /// Takes back a promise that was not used.
    pub fn unreserve(&mut self, weight: usize) {
        let weight = weight.min(self.reserved);
        self.reserved -= weight;
        self.budget.give(weight);
    }

    /// Queues a message that was promised room: it is taken whatever the bound.
    pub fn push_reserved(&mut self, owed: Owed) {
        let weight = owed.weight();
        let promised = weight.min(self.reserved);
        self.reserved -= promised;
        self.budget.take(weight - promised);
        self.queued_bytes += weight;
        self.queued.push_back(owed);
    }

    /// Queues a message for a connected reader whatever the bound: whoever sent it is paced
    /// instead ([`Mailbox::progress`]). Whether it was within the room.
    pub fn push_over(&mut self, owed: Owed) -> bool {
        let fits = self.has_room(owed.weight(), owed.qos, false);
        let weight = owed.weight();
        self.budget.take(weight);
        self.queued_bytes += weight;
        self.queued.push_back(owed);
        fits
    }

    /// Whether writers that wait for room here should go on waiting: a reader is judged by
    /// what it takes, not by how far behind it is. Over `window` from the moment writers began
    /// to wait, it must take what it held then; each time it does, a new window begins. A
    /// reader slower than its writers passes every window (they are paced to it); one that
    /// stopped, or takes less than its queue per window, does not.
    pub fn progress(&mut self, weight: usize, qos: u8, now: Instant, window: Duration) -> Progress {
        if self.has_room(weight, qos, false) {
            self.waited = None;
            return Progress::Room;
        }
        match self.waited {
            Some((since, mark, owed)) if self.taken - mark < owed as u64 => {
                if now.saturating_duration_since(since) >= window {
                    Progress::Stopped
                } else {
                    Progress::Behind
                }
            }
            _ => {
                self.waited = Some((now, self.taken, self.queued_bytes));
                Progress::Behind
            }
        }
    }

    fn bound(&self, qos: u8) -> usize {
        if qos == 0 {
            self.limits.queue_bytes / 2
        } else {
            self.limits.queue_bytes
        }
    }

    /// Queues a message for a session that is away: refused when its queue or the half of
    /// the node's budget such sessions may fill has no room (counted).
    pub fn push_away(&mut self, owed: Owed) -> Result<(), Dropped> {
        if !self.has_room(owed.weight(), owed.qos, true) {
            return self.drop(Dropped::QueueFull);
        }
        let weight = owed.weight();
        self.budget.take(weight);
        self.queued_bytes += weight;
        self.queued.push_back(owed);
        Ok(())
    }

    /// Queues a message; refused when the queue is at its byte limit or the node's budget is
    /// spent. QoS 0 messages are refused first: while the queue is over half full only QoS 1
    /// and 2 are taken.
    pub fn push(&mut self, owed: Owed) -> Result<(), Dropped> {
        let weight = owed.weight();
        let bound = self.bound(owed.qos);
        // One message always fits an empty queue, so a message larger than the bound is not
        // refused for ever to a reader that keeps up.
        let node = self.budget.limit();
        if !self.queued.is_empty()
            && (self.queued_bytes + weight > bound || !self.budget.fits(weight, node))
        {
            return self.drop(Dropped::QueueFull);
        }
        self.budget.take(weight);
        self.queued_bytes += weight;
        self.queued.push_back(owed);
        Ok(())
    }

    /// The next PUBLISH to write, if the client may take one: in order, skipping (and counting)
    /// expired and oversized messages. `encoded_len` is the PUBLISH's size on the wire; it is
    /// asked of the packet as it will be sent, alias and packet id in place ([MQTT-3.1.2-25]).
    pub fn next(
        &mut self,
        now: Instant,
        encoded_len: impl Fn(&Outgoing) -> usize,
    ) -> Option<Outgoing> {
        loop {
            let front = self.queued.front()?;
            // §4.9: no more QoS 1 and 2 in flight than the client's Receive Maximum.
            if front.qos > 0 && self.inflight.len() >= usize::from(self.limits.receive_maximum) {
                return None;
            }
            let owed = self.queued.pop_front()?;
            let weight = owed.weight();
            self.queued_bytes -= weight;
            self.budget.give(weight);
            self.taken += weight as u64;
            let Some(expiry_left) = left(&owed.message, now) else {
                self.dropped[Dropped::Expired as usize] += 1;
                continue;
            };
            let mut out = self.outgoing(&owed, 0, expiry_left, false);
            let new_alias = self.alias(&mut out);
            if owed.qos > 0 {
                out.pkid = self.next_pkid();
            }
            if let Some(max) = self.limits.maximum_packet_size {
                if encoded_len(&out) > max as usize {
                    // [MQTT-3.1.2-25]: discarded for this client, as if sent; an alias it
                    // would have brought is not taken.
                    if new_alias {
                        self.aliases.remove(&owed.message.topic);
                    }
                    self.dropped[Dropped::TooLarge as usize] += 1;
                    continue;
                }
            }
            if owed.qos > 0 {
                self.inflight.push_back(Flight {
                    pkid: out.pkid,
                    owed,
                    released: false,
                });
            }
            return Some(out);
        }
    }

    /// A PUBACK (QoS 1) or PUBCOMP (QoS 2) ends a delivery; false for an unknown packet id.
    pub fn completed(&mut self, pkid: u16) -> bool {
        match self.inflight.iter().position(|f| f.pkid == pkid) {
            Some(at) => self.inflight.remove(at).is_some(),
            None => false,
        }
    }

    /// A PUBREC: the PUBREL is owed from now on, also after a reconnect (§4.3.3).
    pub fn received(&mut self, pkid: u16) -> bool {
        match self.inflight.iter_mut().find(|f| f.pkid == pkid) {
            Some(flight) => {
                flight.released = true;
                true
            }
            None => false,
        }
    }

    /// A new connection took the session over (Clean Start 0): the client's new limits apply,
    /// aliases start anew (they live only as long as a connection, §3.3.2.3.4), and what was in
    /// flight is sent again with its packet id, a PUBLISH with DUP set or a PUBREL
    /// ([MQTT-4.4.0-1]). Returns those, in their original order.
    pub fn resume(&mut self, limits: Limits, now: Instant) -> Vec<Resend> {
        self.limits = limits;
        self.aliases.clear();
        let mut resend = Vec::with_capacity(self.inflight.len());
        for flight in &self.inflight {
            if flight.released {
                resend.push(Resend::Release(flight.pkid));
            } else {
                // Onward delivery began, so it is finished even past the expiry (§3.3.2.3.3).
                let left = left(&flight.owed.message, now).unwrap_or(Some(1));
                resend.push(Resend::Publish(Box::new(self.outgoing(
                    &flight.owed,
                    flight.pkid,
                    left,
                    true,
                ))));
            }
        }
        resend
    }

    /// QoS 1 and 2 messages owed: queued and in flight.
    pub fn len(&self) -> usize {
        self.queued.len() + self.inflight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of topic and payload queued (not yet written).
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    fn drop(&mut self, why: Dropped) -> Result<(), Dropped> {
        self.dropped[why as usize] += 1;
        Err(why)
    }

    fn outgoing(&self, owed: &Owed, pkid: u16, expiry_left: Option<u32>, dup: bool) -> Outgoing {
        Outgoing {
            pkid,
            qos: owed.qos,
            retain: owed.retain,
            dup,
            topic: owed.message.topic.clone(),
            topic_alias: None,
            payload: owed.message.payload.clone(),
            expiry_left,
            subscription_ids: owed.subscription_ids.clone(),
            properties: owed.message.properties.clone(),
        }
    }

    /// Topic aliases to the client, keyed by topic, up to its Topic Alias Maximum: the first
    /// PUBLISH on a topic carries the topic and its new alias, later ones the alias alone.
    /// Whether it gave the topic a new alias.
    fn alias(&mut self, out: &mut Outgoing) -> bool {
        if self.limits.topic_alias_maximum == 0 {
            return false;
        }
        if let Some(&alias) = self.aliases.get(&out.topic) {
            out.topic_alias = Some(alias);
            out.topic = Arc::from("");
        } else if self.aliases.len() < usize::from(self.limits.topic_alias_maximum) {
            let alias = self.aliases.len() as u16 + 1;
            self.aliases.insert(out.topic.clone(), alias);
            out.topic_alias = Some(alias);
            return true;
        }
        false
    }

    /// Packet ids 1..=65535 in turn, skipping those still in flight (§2.2.1).
    fn next_pkid(&mut self) -> u16 {
        loop {
            self.last_pkid = self.last_pkid.checked_add(1).unwrap_or(1);
            if !self.inflight.iter().any(|f| f.pkid == self.last_pkid) {
                return self.last_pkid;
            }
        }
    }
}

impl Drop for Mailbox {
    fn drop(&mut self) {
        // An ended session gives its bytes back to the node.
        self.budget.give(self.queued_bytes + self.reserved);
    }
}

/// What a resumed session writes first.
#[derive(Debug, PartialEq, Eq)]
pub enum Resend {
    Publish(Box<Outgoing>),
    Release(u16),
}

/// The expiry left in whole seconds: None when it ran out, Some(None) when it has none.
fn left(message: &Published, now: Instant) -> Option<Option<u32>> {
    match message.expiry {
        None => Some(None),
        Some(expiry) => {
            let waited = now.saturating_duration_since(message.received);
            let left = expiry.checked_sub(waited)?;
            if left.is_zero() {
                return None;
            }
            Some(Some(left.as_secs().max(1).min(u64::from(u32::MAX)) as u32))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(receive_maximum: u16) -> Limits {
        Limits {
            receive_maximum,
            maximum_packet_size: None,
            topic_alias_maximum: 0,
            queue_bytes: 1 << 20,
        }
    }

    fn owed(topic: &str, payload: &[u8], qos: u8, expiry: Option<u64>) -> Owed {
        Owed {
            message: Arc::new(Published {
                topic: topic.into(),
                payload: Bytes::copy_from_slice(payload),
                received: Instant::now(),
                expiry: expiry.map(Duration::from_secs),
                properties: None,
            }),
            qos,
            retain: false,
            subscription_ids: Vec::new(),
        }
    }

    fn len(out: &Outgoing) -> usize {
        2 + out.topic.len() + 2 + out.payload.len()
    }

    #[test]
    fn never_more_in_flight_than_the_clients_receive_maximum() {
        let mut mailbox = Mailbox::new(limits(5));
        for i in 0..10_000u32 {
            mailbox.push(owed("t", &i.to_be_bytes(), 1, None)).unwrap();
        }
        let now = Instant::now();
        let mut delivered = Vec::new();
        loop {
            let mut window = Vec::new();
            while let Some(out) = mailbox.next(now, len) {
                window.push(out);
            }
            assert!(window.len() <= 5, "{} in flight", window.len());
            if window.is_empty() {
                break;
            }
            for out in window {
                assert!(mailbox.completed(out.pkid));
                delivered.push(u32::from_be_bytes(out.payload[..].try_into().unwrap()));
            }
        }
        assert_eq!(
            delivered,
            (0..10_000).collect::<Vec<_>>(),
            "all of them, in order"
        );
        assert!(mailbox.is_empty());
    }

    #[test]
    fn qos_0_does_not_wait_for_the_window() {
        let mut mailbox = Mailbox::new(limits(1));
        mailbox.push(owed("t", b"1", 1, None)).unwrap();
        let first = mailbox.next(Instant::now(), len).unwrap();
        mailbox.push(owed("t", b"0", 0, None)).unwrap();
        let zero = mailbox.next(Instant::now(), len).unwrap();
        assert_eq!((first.qos, zero.qos, zero.pkid), (1, 0, 0));
    }

    #[test]
    fn a_message_larger_than_the_clients_maximum_is_discarded_for_it() {
        let mut mailbox = Mailbox::new(Limits {
            maximum_packet_size: Some(64),
            ..limits(10)
        });
        mailbox.push(owed("t", &[0; 100], 1, None)).unwrap();
        mailbox.push(owed("t", b"small", 1, None)).unwrap();
        let out = mailbox.next(Instant::now(), len).unwrap();
        assert_eq!(&out.payload[..], b"small");
        assert_eq!(mailbox.dropped[Dropped::TooLarge as usize], 1);
    }

    #[test]
    fn an_expired_message_is_dropped_and_the_rest_carry_what_is_left() {
        let mut mailbox = Mailbox::new(limits(10));
        mailbox.push(owed("t", b"short", 1, Some(1))).unwrap();
        mailbox.push(owed("t", b"long", 1, Some(60))).unwrap();
        mailbox.push(owed("t", b"none", 1, None)).unwrap();
        let later = Instant::now() + Duration::from_secs(2);
        let first = mailbox.next(later, len).unwrap();
        assert_eq!(&first.payload[..], b"long");
        assert!(
            matches!(first.expiry_left, Some(57..=58)),
            "{:?}",
            first.expiry_left
        );
        assert_eq!(mailbox.next(later, len).unwrap().expiry_left, None);
        assert_eq!(mailbox.dropped[Dropped::Expired as usize], 1);
    }

    #[test]
    fn the_queue_refuses_past_its_byte_limit_qos_0_first() {
        let mut mailbox = Mailbox::new(Limits {
            queue_bytes: 1000,
            ..limits(10)
        });
        for _ in 0..5 {
            mailbox.push(owed("t", &[0; 99], 1, None)).unwrap();
        }
        assert_eq!(
            mailbox.push(owed("t", &[0; 99], 0, None)),
            Err(Dropped::QueueFull)
        );
        for _ in 0..5 {
            mailbox.push(owed("t", &[0; 99], 1, None)).unwrap();
        }
        assert_eq!(
            mailbox.push(owed("t", &[0; 99], 1, None)),
            Err(Dropped::QueueFull)
        );
        assert_eq!(mailbox.queued_bytes(), 1000);
        assert_eq!(mailbox.dropped[Dropped::QueueFull as usize], 2);
    }

    #[test]
    fn aliases_are_keyed_by_topic_within_the_clients_maximum() {
        let mut mailbox = Mailbox::new(Limits {
            topic_alias_maximum: 1,
            ..limits(10)
        });
        for topic in ["a/1", "a/2", "a/1"] {
            mailbox.push(owed(topic, b"x", 0, None)).unwrap();
        }
        let now = Instant::now();
        let sent: Vec<_> = std::iter::from_fn(|| mailbox.next(now, len))
            .map(|o| (o.topic.to_string(), o.topic_alias))
            .collect();
        assert_eq!(
            sent,
            [
                ("a/1".to_string(), Some(1)),
                ("a/2".to_string(), None),
                (String::new(), Some(1))
            ]
        );
    }

    /// The PUBLISH as rumqttc writes it: refuses a QoS 1 or 2 packet without its id, as the
    /// real encoder does.
    fn encoded(out: &Outgoing) -> usize {
        if out.qos > 0 && out.pkid == 0 {
            return usize::MAX;
        }
        len(out) + usize::from(out.qos > 0) * 2
    }

    #[test]
    fn a_clients_maximum_packet_size_is_measured_on_the_packet_as_sent() {
        let mut mailbox = Mailbox::new(Limits {
            maximum_packet_size: Some(64),
            topic_alias_maximum: 1,
            ..limits(10)
        });
        mailbox.push(owed("big", &[0; 100], 1, None)).unwrap();
        for qos in [1, 2, 0] {
            mailbox.push(owed("t", b"fits", qos, None)).unwrap();
        }
        let now = Instant::now();
        let sent: Vec<_> = std::iter::from_fn(|| mailbox.next(now, encoded)).collect();
        assert_eq!(
            sent.iter().map(|o| (o.qos, o.pkid > 0)).collect::<Vec<_>>(),
            [(1, true), (2, true), (0, false)],
            "every QoS that fits is delivered"
        );
        assert_eq!(mailbox.dropped[Dropped::TooLarge as usize], 1);
        assert_eq!(
            sent[0].topic_alias,
            Some(1),
            "the alias of a dropped packet is not taken"
        );
    }

    #[test]
    fn every_queue_counts_against_the_nodes_budget_and_gives_back_what_it_held() {
        let budget = Budget::new(1000);
        let mut boxes: Vec<Mailbox> = (0..4)
            .map(|_| {
                let mut mailbox = Mailbox::new(Limits {
                    queue_bytes: 600,
                    ..limits(100)
                });
                mailbox.join(&budget);
                mailbox
            })
            .collect();
        for mailbox in &mut boxes[..2] {
            for _ in 0..5 {
                mailbox.push(owed("t", &[0; 99], 1, None)).unwrap();
            }
        }
        assert_eq!(budget.used(), 1000);
        assert!(
            !boxes[0].has_room(100, 1, false),
            "within its own share, not the node's"
        );
        assert!(
            !boxes[2].has_room(100, 1, false),
            "not even an empty queue past the budget"
        );
        let now = Instant::now();
        while boxes[0].next(now, len).is_some() {}
        assert_eq!(budget.used(), 500, "taken messages give their bytes back");
        assert_eq!(
            boxes[2].push_away(owed("t", &[0; 99], 1, None)),
            Err(Dropped::QueueFull),
            "a session away fills half the budget at most"
        );
        assert!(
            boxes[2].has_room(100, 1, false),
            "a connected reader all of it"
        );
        assert!(boxes[2].push_over(owed("t", &[0; 99], 1, None)));
        assert_eq!(budget.used(), 600);
        boxes.truncate(1);
        assert_eq!(budget.used(), 0, "an ended session gives back what it held");
    }

    #[test]
    fn a_reader_is_judged_by_what_it_takes_not_by_how_far_behind_it_is() {
        let window = Duration::from_secs(2);
        let full = |mailbox: &mut Mailbox| {
            while mailbox.has_room(100, 1, false) {
                mailbox.push_over(owed("t", &[0; 99], 1, None));
            }
        };
        let start = Instant::now();
        // A slow reader: takes what it held within each window, however often it is full.
        let mut slow = Mailbox::new(Limits {
            queue_bytes: 1000,
            ..limits(u16::MAX)
        });
        full(&mut slow);
        assert_eq!(slow.progress(100, 1, start, window), Progress::Behind);
        for round in 1..=10u32 {
            while slow.next(start, len).is_some() {}
            full(&mut slow);
            let at = start + window * round - Duration::from_millis(1);
            assert_eq!(slow.progress(100, 1, at, window), Progress::Behind);
        }
        // A crawling one takes a little each window, never what it held: it is let go.
        let mut crawler = Mailbox::new(Limits {
            queue_bytes: 1000,
            ..limits(u16::MAX)
        });
        full(&mut crawler);
        assert_eq!(crawler.progress(100, 1, start, window), Progress::Behind);
        crawler.next(start, len).unwrap();
        crawler.push_over(owed("t", &[0; 99], 1, None));
        let later = start + window / 2;
        assert_eq!(crawler.progress(100, 1, later, window), Progress::Behind);
        assert_eq!(
            crawler.progress(100, 1, start + window, window),
            Progress::Stopped
        );
        // One with room is not waited for at all.
        let mut idle = Mailbox::new(limits(10));
        assert_eq!(idle.progress(100, 1, start, window), Progress::Room);
    }

    #[test]
    fn a_resumed_session_resends_what_was_in_flight_with_its_packet_ids() {
        let mut mailbox = Mailbox::new(limits(10));
        for payload in [b"1", b"2", b"3"] {
            mailbox.push(owed("t", payload, 2, None)).unwrap();
        }
        let now = Instant::now();
        let sent: Vec<_> = std::iter::from_fn(|| mailbox.next(now, len)).collect();
        assert!(mailbox.completed(sent[0].pkid));
        assert!(mailbox.received(sent[1].pkid));
        let resend = mailbox.resume(limits(10), now);
        assert_eq!(resend.len(), 2);
        assert_eq!(resend[0], Resend::Release(sent[1].pkid));
        match &resend[1] {
            Resend::Publish(out) => {
                assert!(out.dup);
                assert_eq!((out.pkid, &out.payload[..]), (sent[2].pkid, &b"3"[..]));
            }
            other => panic!("expected a publish, got {other:?}"),
        }
    }
}
