//! How far the in-process links lag behind what is published to their filters.
//!
//! rumqttd acknowledges a publish as soon as it is in the filter's in-memory log, and a reader
//! that falls more than the log's size behind silently skips ahead: under a long burst the
//! MetaManager would lose messages the clients saw PUBACKed. The front therefore stops reading
//! from clients while the backlog is above half the log, and resumes once the links catch up.
//!
//! The backlog counts what the front has passed on and rumqttd has not yet read too: a client's
//! window of publishes sits in the loopback socket for a while, and a count that started only
//! when rumqttd read them let a burst of 10 KB reports past the pause and rumqttd's log skip one.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::warn;

/// A backlog that has not moved for this long, with the links idle, is a miscount: let go.
const STALL: Duration = Duration::from_secs(2);

/// Bytes published to link filters and not yet received by the links.
#[derive(Debug)]
pub struct Backlog {
    bytes: AtomicI64,
    /// Packet bytes of publishes to our links the front passed to rumqttd, not yet read there.
    carried: AtomicI64,
    limit: i64,
    drained: Notify,
    filters: RwLock<Vec<String>>,
    started: Instant,
    /// When a link last received something, in ms since `started`.
    last_consumed_ms: AtomicU64,
    /// Clients held before a publish to our links right now, and how often one was.
    paused: AtomicU64,
    pauses: AtomicU64,
}

impl Backlog {
    /// `limit`: the backlog (bytes) above which clients are paused.
    pub fn new(limit: u64) -> Backlog {
        Backlog {
            bytes: AtomicI64::new(0),
            carried: AtomicI64::new(0),
            limit: i64::try_from(limit).unwrap_or(i64::MAX),
            drained: Notify::new(),
            filters: RwLock::new(Vec::new()),
            started: Instant::now(),
            last_consumed_ms: AtomicU64::new(0),
            paused: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
        }
    }

    /// Registers a link's filters: publishes they match are counted.
    pub fn watch(&self, filters: &[String]) {
        let mut watched = self.filters.write().unwrap_or_else(|p| p.into_inner());
        watched.extend(filters.iter().cloned());
    }

    /// Whether our links read `topic` (broker form): a client's publish there is acknowledged
    /// only once the node has taken it, and waits while the links lag.
    pub fn consumes(&self, topic: &str) -> bool {
        let watched = self.filters.read().unwrap_or_else(|p| p.into_inner());
        watched
            .iter()
            .any(|filter| rumqttd::protocol::matches(topic, filter))
    }

    /// [`Backlog::consumes`] for a topic as a client sent it (an empty topic is a v5 alias,
    /// which the front does not follow: it counts as consumed).
    pub fn consumes_client_topic(&self, topic: &[u8]) -> bool {
        if topic.is_empty() {
            return true;
        }
        let topic = String::from_utf8_lossy(topic);
        self.consumes(&crate::dollar::to_broker(&topic))
    }

    /// A publish to `topic` of `len` payload bytes entered the broker.
    pub fn published(&self, topic: &str, len: usize) {
        let watched = self.filters.read().unwrap_or_else(|p| p.into_inner());
        if watched
            .iter()
            .any(|filter| rumqttd::protocol::matches(topic, filter))
        {
            self.bytes.fetch_add(len as i64, Ordering::Relaxed);
        }
    }

    /// A link received a message of `len` payload bytes.
    pub fn consumed(&self, len: usize) {
        self.last_consumed_ms
            .store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.bytes.fetch_sub(len as i64, Ordering::Relaxed);
        self.maybe_drained();
    }

    /// rumqttd read `len` bytes of carried publishes (see [`Backlog::admit`]).
    pub fn landed(&self, len: i64) {
        self.carried.fetch_sub(len, Ordering::Relaxed);
        self.maybe_drained();
    }

    fn maybe_drained(&self) {
        if self.bytes() <= self.limit / 2 {
            self.drained.notify_waiters();
        }
    }

    /// Current backlog in bytes: published and not yet received, or on the way to rumqttd.
    pub fn bytes(&self) -> i64 {
        self.bytes.load(Ordering::Relaxed) + self.carried.load(Ordering::Relaxed)
    }

    /// Waits for [`Backlog::room`] for a client's publish of `len` bytes (the whole packet) to our
    /// links, counted while it waits; then counts it as carried until [`Backlog::landed`].
    pub async fn admit(&self, len: usize) {
        if self.bytes() > self.limit {
            self.hold().await;
        }
        self.carried.fetch_add(len as i64, Ordering::Relaxed);
    }

    async fn hold(&self) {
        struct Held<'a>(&'a AtomicU64);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.paused.fetch_add(1, Ordering::Relaxed);
        self.pauses.fetch_add(1, Ordering::Relaxed);
        let _held = Held(&self.paused);
        self.room().await;
    }

    /// Publishers held right now, and how many times one was held so far.
    pub fn paused(&self) -> (u64, u64) {
        (
            self.paused.load(Ordering::Relaxed),
            self.pauses.load(Ordering::Relaxed),
        )
    }

    /// Returns at once while the backlog is within its limit; otherwise waits until the links
    /// have worked it down to half.
    pub async fn room(&self) {
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.bytes() <= self.limit {
                return;
            }
            if tokio::time::timeout(STALL, drained).await.is_err() && self.links_idle() {
                // The links receive nothing, so nothing is pending for them: the count drifted
                // (a counted publish they never got). Pausing on would stop every client.
                let drift = self.bytes.swap(0, Ordering::Relaxed);
                warn!(
                    error_code = "EM-BROKER-BACKLOG",
                    drift, "backlog count reset"
                );
                self.drained.notify_waiters();
                return;
            }
        }
    }

    fn links_idle(&self) -> bool {
        let last = Duration::from_millis(self.last_consumed_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last) >= STALL
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_full_backlog_holds_writers_until_the_links_catch_up() {
        let backlog = Arc::new(Backlog::new(100));
        backlog.watch(&["ke/meta/#".to_owned()]);
        backlog.published("ke/edged/x", 1_000);
        backlog.room().await; // not a watched filter: no backlog
        backlog.published("ke/meta/a/insert/ns/pod/x", 150);
        let waiting = tokio::spawn({
            let backlog = backlog.clone();
            async move { backlog.room().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "150 bytes behind a limit of 100");
        backlog.consumed(60); // 90 left: within the limit, but not yet down to half
        backlog.consumed(50); // 40 left
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("released once drained")
            .expect("task");
    }

    #[tokio::test]
    async fn publishes_on_their_way_to_rumqttd_count_before_it_reads_them() {
        let backlog = Arc::new(Backlog::new(100));
        backlog.watch(&["ke/meta/#".to_owned()]);
        // A client's window of publishes passes the front before rumqttd reads the first.
        backlog.admit(80).await;
        backlog.admit(80).await;
        let third = tokio::spawn({
            let backlog = backlog.clone();
            async move { backlog.admit(80).await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !third.is_finished(),
            "160 bytes carried, over a limit of 100"
        );
        // rumqttd reads both (and counts their payloads); the link receives them.
        backlog.landed(160);
        backlog.published("ke/meta/a/insert/ns/pod/x", 70);
        backlog.published("ke/meta/a/insert/ns/pod/y", 70);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!third.is_finished(), "140 bytes behind");
        backlog.consumed(70);
        backlog.consumed(70);
        tokio::time::timeout(Duration::from_secs(1), third)
            .await
            .expect("released once drained")
            .expect("task");
        assert_eq!(backlog.bytes(), 80, "the third publish is carried");
    }

    #[tokio::test]
    async fn a_count_the_links_never_work_down_is_let_go() {
        let backlog = Backlog::new(100);
        backlog.watch(&["ke/meta/#".to_owned()]);
        backlog.published("ke/meta/a/insert/ns/pod/x", 500);
        tokio::time::timeout(STALL * 3, backlog.room())
            .await
            .expect("writers are not held forever");
        assert_eq!(backlog.bytes(), 0);
    }
}
