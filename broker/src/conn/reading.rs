//! The bytes every connection's read buffer holds past [`KEEP_BUFFER`], counted against one
//! budget (`broker.read_buffers_bytes`): a packet being read grows its buffer up to
//! `max_packet_bytes`, and clients that stop part-way through large packets must not together
//! hold more than the node set aside for that.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::sync::Semaphore;
use tracing::warn;

use super::KEEP_BUFFER;
use crate::log_every::LogEvery;
use crate::wire::WireError;

/// The budget is counted in KiB: a permit per KiB keeps the counts small.
const UNIT: usize = 1024;

/// The most bytes an MQTT fixed header takes: the type byte and four of remaining length.
const FIXED_HEADER: usize = 5;

/// How often at most a connection closed over the budget is logged.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// What all connections' read buffers may hold past [`KEEP_BUFFER`] each.
#[derive(Debug)]
pub struct ReadBudget {
    free: Semaphore,
    /// Connections closed for want of it, logged at most every [`LOG_EVERY`].
    closed: AtomicU64,
    log: LogEvery,
    /// Connections closed over a packet that took longer than `packet_timeout_ms`.
    slow: AtomicU64,
    slow_log: LogEvery,
    bytes: usize,
    /// The most one buffer ever needs: the largest packet with its fixed header.
    largest: usize,
}

impl ReadBudget {
    pub fn new(bytes: usize, max_packet: usize) -> Arc<ReadBudget> {
        let units = bytes.div_ceil(UNIT).min(Semaphore::MAX_PERMITS);
        Arc::new(ReadBudget {
            free: Semaphore::new(units),
            closed: AtomicU64::new(0),
            log: LogEvery::new(LOG_EVERY),
            slow: AtomicU64::new(0),
            slow_log: LogEvery::new(LOG_EVERY),
            bytes,
            largest: max_packet.saturating_add(FIXED_HEADER),
        })
    }

    /// Connections closed so far because their packet found no room.
    pub fn closed(&self) -> u64 {
        self.closed.load(Ordering::Relaxed)
    }

    /// Connections closed so far because a packet took longer than `packet_timeout_ms`.
    pub fn slow(&self) -> u64 {
        self.slow.load(Ordering::Relaxed)
    }

    /// Counts a connection closed over a packet that did not all arrive in time, `held` bytes
    /// of it read; logged as [`ReadBudget::refused`] is.
    pub(crate) fn too_slow(&self, client_id: &str, held: usize, within: Duration) {
        let slow = self.slow.fetch_add(1, Ordering::Relaxed) + 1;
        if self.slow_log.due() {
            warn!(
                error_code = "EM-BROKER-SLOW-PACKET",
                client_id,
                held,
                packet_timeout_ms = u64::try_from(within.as_millis()).unwrap_or(u64::MAX),
                slow,
                "closed a connection whose packet did not all arrive within \
                 broker.packet_timeout_ms"
            );
        }
    }

    /// Counts a connection closed for want of room; logs at most once per [`LOG_EVERY`],
    /// with the count so far (a flood of them costs a line per interval).
    pub(crate) fn refused(&self, client_id: &str, needed: usize) {
        let closed = self.closed.fetch_add(1, Ordering::Relaxed) + 1;
        if self.log.due() {
            warn!(
                error_code = "EM-BROKER-READ-BUFFERS",
                client_id,
                needed,
                read_buffers_bytes = self.bytes,
                closed,
                "closed a connection whose packet found no room: broker.read_buffers_bytes are \
                 held by packets being read"
            );
        }
    }
}

/// One connection's share of the [`ReadBudget`]: taken as its buffer grows, given back as it
/// shrinks and when the connection ends.
#[derive(Debug)]
pub(crate) struct Reading {
    budget: Arc<ReadBudget>,
    held: usize,
}

impl Reading {
    pub(crate) fn new(budget: Arc<ReadBudget>) -> Reading {
        Reading { budget, held: 0 }
    }

    /// Makes room in `buf` for `additional` more bytes, as `BytesMut::reserve` does, once the
    /// budget covers the capacity that may take (twice the present one, or what is asked, but
    /// never past the largest packet's need); `OverBudget`, with `buf` untouched, when it cannot.
    pub(crate) fn reserve(
        &mut self,
        buf: &mut BytesMut,
        additional: usize,
    ) -> Result<(), WireError> {
        // Room already there, or behind the bytes already taken: nothing to allocate.
        if buf.capacity() - buf.len() >= additional || buf.try_reclaim(additional) {
            return Ok(());
        }
        let want = buf.len() + additional;
        let doubled = (2 * buf.capacity()).max(want);
        // Doubling past the largest packet would ask the budget for room no packet needs: a
        // budget of `max_packet_bytes` could then not read the largest packet. The buffer
        // grows to exactly that size instead.
        let at_most = doubled.min(self.budget.largest.max(want));
        self.cover(at_most)?;
        if at_most < doubled {
            let mut grown = BytesMut::with_capacity(at_most);
            grown.extend_from_slice(buf);
            *buf = grown;
        } else {
            buf.reserve(additional);
        }
        // What the buffer took is at most what was covered: this only gives back.
        self.cover(buf.capacity())
    }

    /// Holds what a buffer of `capacity` bytes needs past [`KEEP_BUFFER`], taking or giving
    /// back the difference; `OverBudget` when not enough is free.
    pub(crate) fn cover(&mut self, capacity: usize) -> Result<(), WireError> {
        let need = capacity.saturating_sub(KEEP_BUFFER).div_ceil(UNIT);
        if need > self.held {
            let more = u32::try_from(need - self.held).map_err(|_| WireError::OverBudget)?;
            let permits = self
                .budget
                .free
                .try_acquire_many(more)
                .map_err(|_| WireError::OverBudget)?;
            permits.forget();
        } else if need < self.held {
            self.budget.free.add_permits(self.held - need);
        }
        self.held = need;
        Ok(())
    }

    /// The budget this share is taken from.
    pub(crate) fn budget(&self) -> &ReadBudget {
        &self.budget
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.budget.free.add_permits(self.held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_share_the_budget_and_give_it_back_as_they_shrink_and_end() {
        let budget = ReadBudget::new(64 * UNIT, usize::MAX);
        let mut a = Reading::new(budget.clone());
        let mut b = Reading::new(budget.clone());
        // The first KEEP_BUFFER bytes of each are free.
        a.cover(KEEP_BUFFER).expect("free part");
        assert_eq!(budget.free.available_permits(), 64);
        a.cover(KEEP_BUFFER + 40 * UNIT).expect("40 of 64");
        assert!(matches!(
            b.cover(KEEP_BUFFER + 30 * UNIT),
            Err(WireError::OverBudget)
        ));
        b.cover(KEEP_BUFFER + 24 * UNIT).expect("the rest");
        assert_eq!(budget.free.available_permits(), 0);
        a.cover(KEEP_BUFFER).expect("shrunk");
        assert_eq!(budget.free.available_permits(), 40);
        drop(b);
        assert_eq!(budget.free.available_permits(), 64);
        drop(a);
        assert_eq!(budget.free.available_permits(), 64);
    }

    #[test]
    fn a_buffer_grows_only_within_the_budget_and_is_left_alone_past_it() {
        let budget = ReadBudget::new(64 * UNIT, usize::MAX);
        let mut reading = Reading::new(budget.clone());
        let mut buf = BytesMut::with_capacity(KEEP_BUFFER);
        buf.extend_from_slice(&[0; KEEP_BUFFER]);
        reading
            .reserve(&mut buf, 16 * UNIT)
            .expect("room for 16 KiB more");
        assert!(buf.capacity() >= KEEP_BUFFER + 16 * UNIT);
        let held = 64 - budget.free.available_permits();
        assert_eq!(held, (buf.capacity() - KEEP_BUFFER).div_ceil(UNIT));
        buf.extend_from_slice(&vec![0; buf.capacity() - buf.len()]);
        let before = buf.capacity();
        assert!(matches!(
            reading.reserve(&mut buf, 64 * UNIT),
            Err(WireError::OverBudget)
        ));
        assert_eq!(buf.capacity(), before, "nothing allocated past the budget");
    }

    #[test]
    fn a_budget_of_the_largest_packet_reads_the_largest_packet() {
        let largest = 64 * UNIT;
        let budget = ReadBudget::new(largest, largest);
        let mut reading = Reading::new(budget.clone());
        let mut buf = BytesMut::with_capacity(KEEP_BUFFER);
        // As the connection's loop reads: 256 bytes more whenever under 64 are free.
        while buf.len() < largest + FIXED_HEADER {
            if buf.capacity() - buf.len() < 64 {
                reading
                    .reserve(&mut buf, 256)
                    .expect("the largest packet fits");
            }
            let room = (buf.capacity() - buf.len()).min(largest + FIXED_HEADER - buf.len());
            buf.extend_from_slice(&vec![0; room]);
        }
        // Not doubled to 128 KiB: at most one step of 256 past the packet.
        assert!(
            buf.capacity() <= largest + FIXED_HEADER + 256,
            "{}",
            buf.capacity()
        );
    }
}
