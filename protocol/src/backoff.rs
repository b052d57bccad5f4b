//! Reconnect delays: doubling from `min` to `max`, each drawn at random from its upper half so
//! a fleet of nodes does not reconnect in lock step after a cloud outage.

use std::time::Duration;

/// Capped exponential backoff with jitter.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Backoff {
        let min = min.max(Duration::from_millis(1));
        Backoff {
            min,
            max: max.max(min),
            current: min,
        }
    }

    /// The next delay; the one after it doubles, up to `max`.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.current;
        self.current = (self.current * 2).min(self.max);
        let half = ceiling / 2;
        let spread = (ceiling - half).as_millis() as u64;
        let random = (uuid::Uuid::new_v4().as_u128() % (u128::from(spread) + 1)) as u64;
        half + Duration::from_millis(random)
    }

    /// Back to `min` after a successful connection.
    pub fn reset(&mut self) {
        self.current = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_and_stay_in_the_upper_half() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(1000));
        let mut ceiling = 100;
        for _ in 0..10 {
            let d = b.next_delay().as_millis() as u64;
            assert!(
                d >= ceiling / 2 && d <= ceiling,
                "{d} not in [{}, {ceiling}]",
                ceiling / 2
            );
            ceiling = (ceiling * 2).min(1000);
        }
    }

    #[test]
    fn reset_starts_over() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(60));
        for _ in 0..8 {
            b.next_delay();
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
