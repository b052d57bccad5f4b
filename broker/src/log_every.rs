//! Log lines about what a client can make happen many times a second (drops, refusals) are
//! written at most once per interval, with the count so far, so a flood costs a line, not a line
//! each.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Whether a line may be written now: at most once per `every`, decided without a lock (one
/// caller wins each interval).
#[derive(Debug)]
pub(crate) struct LogEvery {
    every: Duration,
    /// When a line was last written, in ms since `started` (`u64::MAX`: never).
    last: AtomicU64,
    started: Instant,
}

impl LogEvery {
    pub(crate) fn new(every: Duration) -> LogEvery {
        LogEvery {
            every,
            last: AtomicU64::new(u64::MAX),
            started: Instant::now(),
        }
    }

    /// True for the first caller of each interval.
    pub(crate) fn due(&self) -> bool {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        let last = self.last.load(Ordering::Relaxed);
        let every = u64::try_from(self.every.as_millis()).unwrap_or(u64::MAX);
        (last == u64::MAX || now.saturating_sub(last) >= every)
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_call_of_an_interval_is_due_and_the_rest_are_not() {
        let log = LogEvery::new(Duration::from_secs(3600));
        assert!(log.due());
        assert!(!log.due());
        let always = LogEvery::new(Duration::ZERO);
        assert!(always.due());
        assert!(always.due());
    }
}
