//! Node heartbeats are session state, not history: what edged sends on
//! `<root>/cloud/<from>/<insert|update>/<ns>/<nodestatus|lease>` skips the outbox. The newest per
//! topic waits here for a cloud session and goes once, at QoS 0, so one sent while the cloud is
//! unreachable is replaced by the next instead of being replayed in bulk after the outage
//! (protocol §5). Every new session starts with the newest of each topic, sent before or not
//! (if sent at most [`RESEND_WITHIN`] ago), so the cloud sees the node Ready again at once
//! rather than at edged's next report.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// How old a heartbeat already sent may be to go again with a new session: the node lifecycle
/// controller's grace period. An older one would report an edged that stopped as alive.
pub(super) const RESEND_WITHIN: Duration = Duration::from_secs(40);

/// Per local topic, the newest heartbeat not yet sent, and the last one sent and when.
#[derive(Debug, Default)]
struct Slots {
    waiting: BTreeMap<String, Vec<u8>>,
    sent: BTreeMap<String, (Vec<u8>, Instant)>,
}

/// The node's heartbeats, shared by the task that receives them and the sessions that send them.
#[derive(Debug, Default)]
pub(super) struct Live {
    slots: Mutex<Slots>,
    changed: Notify,
}

impl Live {
    fn slots(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `payload` as the newest on `topic`, replacing one not sent yet.
    pub(super) fn put(&self, topic: String, payload: Vec<u8>) {
        self.slots().waiting.insert(topic, payload);
        self.changed.notify_one();
    }

    /// Puts back one that could not be sent, unless a newer one came meanwhile; it goes with the
    /// next heartbeat or session (no wake-up: a full request queue is not worth a busy loop).
    pub(super) fn keep(&self, topic: String, payload: Vec<u8>) {
        self.slots().waiting.entry(topic).or_insert(payload);
    }

    /// Everything waiting, in topic order (a registration's `insert` before the `update`s,
    /// the status before the Lease); it counts as sent.
    pub(super) fn take(&self) -> Vec<(String, Vec<u8>)> {
        let mut slots = self.slots();
        let waiting = std::mem::take(&mut slots.waiting);
        let now = Instant::now();
        for (topic, payload) in &waiting {
            slots.sent.insert(topic.clone(), (payload.clone(), now));
        }
        waiting.into_iter().collect()
    }

    /// For a new session: the newest of every topic, waiting or sent within [`RESEND_WITHIN`].
    pub(super) fn take_newest(&self) -> Vec<(String, Vec<u8>)> {
        {
            let mut slots = self.slots();
            let Slots { waiting, sent } = &mut *slots;
            for (topic, (payload, at)) in sent.iter() {
                if at.elapsed() < RESEND_WITHIN {
                    waiting
                        .entry(topic.clone())
                        .or_insert_with(|| payload.clone());
                }
            }
        }
        self.take()
    }

    /// Resolves once something was put since the last wait (a put while nobody waited counts).
    pub(super) fn changed(&self) -> Notified<'_> {
        self.changed.notified()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_heartbeat_replaces_the_unsent_one() {
        let live = Live::default();
        live.put("b".to_owned(), b"1".to_vec());
        live.put("a".to_owned(), b"1".to_vec());
        live.put("b".to_owned(), b"2".to_vec());
        assert_eq!(
            live.take(),
            [
                ("a".to_owned(), b"1".to_vec()),
                ("b".to_owned(), b"2".to_vec())
            ]
        );
        assert!(live.take().is_empty());
    }

    #[test]
    fn a_new_session_gets_the_newest_of_each_topic_sent_or_not() {
        let live = Live::default();
        live.put("a".to_owned(), b"1".to_vec());
        live.take();
        live.put("b".to_owned(), b"1".to_vec());
        assert_eq!(
            live.take_newest(),
            [
                ("a".to_owned(), b"1".to_vec()),
                ("b".to_owned(), b"1".to_vec())
            ]
        );
        live.put("a".to_owned(), b"2".to_vec());
        assert_eq!(live.take(), [("a".to_owned(), b"2".to_vec())]);
        assert_eq!(live.take_newest().len(), 2);
    }

    #[test]
    fn a_heartbeat_sent_long_ago_is_not_sent_again() {
        let live = Live::default();
        live.put("a".to_owned(), b"1".to_vec());
        live.take();
        if let Some((_, at)) = live.slots().sent.get_mut("a") {
            *at = at
                .checked_sub(RESEND_WITHIN)
                .expect("the clock is past 40 s");
        }
        assert!(
            live.take_newest().is_empty(),
            "edged may have stopped since"
        );
    }
}
