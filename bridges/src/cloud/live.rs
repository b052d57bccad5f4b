//! Node heartbeats are session state, not history: what edged sends on
//! `<root>/cloud/<from>/<insert|update>/<ns>/<nodestatus|lease>` skips the outbox. The newest per
//! topic waits here for a cloud session and goes once, at QoS 0, so one sent while the cloud is
//! unreachable is replaced by the next instead of being replayed in bulk after the outage
//! (protocol §5).

use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::sync::futures::Notified;
use tokio::sync::Notify;

/// The newest heartbeat per local topic, not yet sent.
#[derive(Debug, Default)]
pub(super) struct Live {
    slots: Mutex<BTreeMap<String, Vec<u8>>>,
    changed: Notify,
}

impl Live {
    /// Keeps `payload` as the newest on `topic`, replacing one not sent yet.
    pub(super) fn put(&self, topic: String, payload: Vec<u8>) {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic, payload);
        self.changed.notify_one();
    }

    /// Everything waiting, in topic order (a registration's `insert` before the `update`s,
    /// the status before the Lease).
    pub(super) fn take(&self) -> Vec<(String, Vec<u8>)> {
        std::mem::take(&mut *self.slots.lock().unwrap_or_else(|e| e.into_inner()))
            .into_iter()
            .collect()
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
}
