//! `$hw/events/connected/<client id>` and `$hw/events/disconnected/<client id>`: the broker
//! tells subscribers when an MQTT client's connection is accepted and when it ends.
//!
//! KubeEdge names these topics (`edge/pkg/eventbus/mqtt/client.go` `ConnectedTopic`,
//! `DisconnectedTopic`) but never publishes them; the payload is cloudhub's node event
//! (`cloud/pkg/cloudhub/common/helper.go` `ConstructConnectMessage`), timestamp in ms.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde_json::json;
use tokio::sync::mpsc;
use tracing::warn;

use crate::link::Publisher;
use crate::Message;

/// Events waiting for the publisher; beyond this (a storm of connections) they are dropped.
const CAPACITY: usize = 1024;

/// Connection events from every guard, published through one link.
#[derive(Debug)]
pub struct ClientEvents {
    tx: mpsc::Sender<Message>,
    rx: Mutex<Option<mpsc::Receiver<Message>>>,
    next: AtomicU64,
    /// Client id → the number of its newest connection: a connection another one with the same
    /// id took over ends without a `disconnected`, since the client is still connected.
    live: Mutex<HashMap<String, u64>>,
}

impl Default for ClientEvents {
    fn default() -> Self {
        let (tx, rx) = mpsc::channel(CAPACITY);
        ClientEvents {
            tx,
            rx: Mutex::new(Some(rx)),
            next: AtomicU64::new(0),
            live: Mutex::new(HashMap::new()),
        }
    }
}

impl ClientEvents {
    /// `client_id`'s connection was accepted; returns its number for [`ClientEvents::ended`].
    pub fn connected(&self, client_id: &str) -> u64 {
        let number = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.lock().insert(client_id.to_owned(), number);
        self.send("connected", client_id);
        number
    }

    /// Connection `number` of `client_id` ended.
    pub fn ended(&self, client_id: &str, number: u64) {
        let mut live = self.lock();
        if live.get(client_id) != Some(&number) {
            return;
        }
        live.remove(client_id);
        drop(live);
        self.send("disconnected", client_id);
    }

    /// Publishes the events through `publisher` until the link closes (once; later calls do
    /// nothing).
    pub async fn run(&self, publisher: Publisher) {
        let taken = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(mut rx) = taken else { return };
        while let Some(message) = rx.recv().await {
            // With nobody listening an event tells no one: it is not published at all.
            if !publisher.reaches_anyone(&message.topic) {
                continue;
            }
            if publisher.publish(message).await.is_err() {
                return;
            }
        }
    }

    fn send(&self, event: &str, client_id: &str) {
        let topic = format!("$hw/events/{event}/{client_id}");
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        let payload = json!({"event_type": event, "timestamp": timestamp, "client_id": client_id});
        let message = Message::new(topic, payload.to_string());
        if self.tx.try_send(message).is_err() {
            warn!(error_code = "EM-BROKER-CLIENT-EVENT", %client_id, event, "connection event dropped: too many waiting");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, u64>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_over_connection_ends_without_an_event() {
        let events = ClientEvents::default();
        let mut rx = events.rx.lock().unwrap().take().unwrap();
        let first = events.connected("dev-1");
        let second = events.connected("dev-1");
        events.ended("dev-1", first);
        events.ended("dev-1", second);
        let topics: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|m| m.topic)
            .collect();
        assert_eq!(
            topics,
            [
                "$hw/events/connected/dev-1",
                "$hw/events/connected/dev-1",
                "$hw/events/disconnected/dev-1"
            ]
        );
    }
}
