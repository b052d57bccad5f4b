//! Retained messages of the one path: the last retained publish per topic, sent to a new
//! subscription whose filter matches it (MQTT 5.0 §3.3.1.3), within a byte limit.

use std::collections::HashMap;
use std::sync::Arc;

use crate::index::matches;
use crate::mailbox::Published;

/// Why a retained message was not kept.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// The store was at its byte limit; the topic keeps what it had.
    Full,
}

/// The retained messages, by topic. Written by retained publishes, read on subscribe.
#[derive(Debug)]
pub struct Retained {
    /// Each topic's message and the QoS it was published at (a retained message is sent at the
    /// lower of that and the subscription's, §3.8.4).
    by_topic: HashMap<Arc<str>, (Arc<Published>, u8)>,
    bytes: usize,
    limit: usize,
}

impl Retained {
    pub fn new(limit: usize) -> Retained {
        Retained {
            by_topic: HashMap::new(),
            bytes: 0,
            limit,
        }
    }

    /// Keeps `message` as its topic's retained one; an empty payload removes it (§3.3.1.3).
    pub fn set(&mut self, message: Arc<Published>, qos: u8) -> Result<(), Refused> {
        let weight = |m: &Published| m.topic.len() + m.payload.len();
        let old = self
            .by_topic
            .get(&message.topic)
            .map_or(0, |(m, _)| weight(m));
        if message.payload.is_empty() {
            if self.by_topic.remove(&message.topic).is_some() {
                self.bytes -= old;
            }
            return Ok(());
        }
        let new = weight(&message);
        if self.bytes - old + new > self.limit {
            return Err(Refused::Full);
        }
        self.bytes = self.bytes - old + new;
        self.by_topic.insert(message.topic.clone(), (message, qos));
        Ok(())
    }

    /// The retained messages a new subscription to `filter` gets, with the QoS each was
    /// published at; expired ones left out.
    pub fn matching<'a>(
        &'a self,
        filter: &'a str,
    ) -> impl Iterator<Item = &'a (Arc<Published>, u8)> {
        let now = std::time::Instant::now();
        self.by_topic
            .values()
            .filter(move |(m, _)| matches(filter, &m.topic))
            .filter(move |(m, _)| m.expiry.is_none_or(|e| now.duration_since(m.received) < e))
    }

    pub fn len(&self) -> usize {
        self.by_topic.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_topic.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use bytes::Bytes;

    use super::*;

    fn message(topic: &str, payload: &str, expiry: Option<u64>) -> Arc<Published> {
        Arc::new(Published {
            topic: topic.into(),
            payload: Bytes::copy_from_slice(payload.as_bytes()),
            received: Instant::now(),
            expiry: expiry.map(Duration::from_secs),
            properties: None,
        })
    }

    fn topics(retained: &Retained, filter: &str) -> Vec<String> {
        let mut t: Vec<String> = retained
            .matching(filter)
            .map(|(m, _)| m.topic.to_string())
            .collect();
        t.sort();
        t
    }

    #[test]
    fn the_last_one_per_topic_is_kept_and_an_empty_payload_clears_it() {
        let mut retained = Retained::new(1 << 20);
        retained.set(message("room/1", "20", None), 1).unwrap();
        retained.set(message("room/1", "21", None), 1).unwrap();
        retained.set(message("room/2", "19", None), 1).unwrap();
        retained.set(message("$hw/x", "1", None), 1).unwrap();
        assert_eq!(topics(&retained, "room/+"), ["room/1", "room/2"]);
        assert_eq!(
            topics(&retained, "#"),
            ["room/1", "room/2"],
            "no $ topic through '#'"
        );
        assert_eq!(
            &retained.matching("room/1").next().unwrap().0.payload[..],
            b"21"
        );
        retained.set(message("room/1", "", None), 1).unwrap();
        assert_eq!(topics(&retained, "room/#"), ["room/2"]);
        assert_eq!(retained.bytes, "room/2".len() + 2 + "$hw/x".len() + 1);
    }

    #[test]
    fn past_the_limit_a_topic_keeps_what_it_had() {
        let mut retained = Retained::new(10);
        retained.set(message("a", "12345", None), 1).unwrap();
        assert_eq!(
            retained.set(message("b", "123456", None), 1),
            Err(Refused::Full)
        );
        retained.set(message("a", "123456789", None), 1).unwrap();
        assert_eq!(retained.len(), 1);
    }

    #[test]
    fn an_expired_retained_message_is_not_sent() {
        let mut retained = Retained::new(1 << 20);
        retained
            .set(
                Arc::new(Published {
                    topic: "t".into(),
                    payload: Bytes::from_static(b"old"),
                    received: Instant::now() - Duration::from_secs(5),
                    expiry: Some(Duration::from_secs(1)),
                    properties: None,
                }),
                1,
            )
            .unwrap();
        assert!(topics(&retained, "t").is_empty());
    }
}
