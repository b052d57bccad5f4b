//! Where a message's time goes: wall time per stage of the message path, summed for the
//! process, so a benchmark can divide each by the messages it sent (docs/benchmarks.md, the
//! per-stage budget) and every change shows which stage it moved.
//!
//! Off unless `observe.stage_clocks` is set ([`switch_on`]): reading the clock costs about
//! 0.1 µs here, some 2 µs per message, which a node in service should not pay.
//!
//! Stages nest exclusively: a stage entered inside another (a route inside a hand-on) stops
//! the outer one's clock until it ends, so the stages add up to no more than the time spent.
//! A [`Timing`] must not be held across an await on a multi-threaded runtime (the task may
//! move to another thread); the store thread runs one future and may.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// A stage of the message path, in the order a message meets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// A packet decoded from a client's read buffer (rumqttc's codec and our checks).
    Decode,
    /// A message matched against the subscriptions and queued for each reader and module.
    Route,
    /// A module message parsed into a request (topic, envelope, resource) before the store.
    Intake,
    /// The store thread applying a batch's requests: statements, replies, hand-ons built.
    Store,
    /// `COMMIT` of a batch.
    Commit,
    /// After a commit: hand-ons reserved, stored or published, acknowledgements handed over.
    HandOn,
    /// Queued messages encoded into a client's write buffer.
    Encode,
    /// A client's write buffer written to its socket.
    Write,
}

impl Stage {
    pub const ALL: [Stage; 8] = [
        Stage::Decode,
        Stage::Route,
        Stage::Intake,
        Stage::Store,
        Stage::Commit,
        Stage::HandOn,
        Stage::Encode,
        Stage::Write,
    ];

    /// The name in `/metrics` (`edgemeta_stage_seconds_total{stage=…}`) and in the bench.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Decode => "decode",
            Stage::Route => "route",
            Stage::Intake => "intake",
            Stage::Store => "store",
            Stage::Commit => "commit",
            Stage::HandOn => "hand_on",
            Stage::Encode => "encode",
            Stage::Write => "write",
        }
    }

    /// Nanoseconds spent in this stage since the process started.
    pub fn nanos(self) -> u64 {
        SPENT[self as usize].load(Ordering::Relaxed)
    }

    /// Adds time measured outside a [`Timing`] (an await that may move threads).
    pub fn add(self, since: Instant) {
        if on() {
            charge(self, since, Instant::now());
        }
    }
}

/// Process-wide like the tracing subscriber: one relaxed add per stage left.
static SPENT: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];

static ON: AtomicBool = AtomicBool::new(false);

/// Starts the stage clocks for the rest of the process (`observe.stage_clocks`).
pub fn switch_on() {
    ON.store(true, Ordering::Relaxed);
}

/// Whether the stage clocks run.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

thread_local! {
    /// The stage this thread is in, and since when its clock runs.
    static CURRENT: Cell<Option<(Stage, Instant)>> = const { Cell::new(None) };
}

fn charge(stage: Stage, since: Instant, now: Instant) {
    let nanos = u64::try_from(now.saturating_duration_since(since).as_nanos()).unwrap_or(u64::MAX);
    SPENT[stage as usize].fetch_add(nanos, Ordering::Relaxed);
}

/// Time in a stage, until dropped; the stage it interrupted resumes then.
#[must_use = "the stage ends when this is dropped"]
pub struct Timing {
    /// None while the clocks are off.
    outer: Option<Option<Stage>>,
}

/// Enters `stage` on this thread (see [`Timing`]).
pub fn enter(stage: Stage) -> Timing {
    if !on() {
        return Timing { outer: None };
    }
    let now = Instant::now();
    let outer = CURRENT.with(|c| c.replace(Some((stage, now))));
    if let Some((outer, since)) = outer {
        charge(outer, since, now);
    }
    Timing {
        outer: Some(outer.map(|(stage, _)| stage)),
    }
}

impl Drop for Timing {
    fn drop(&mut self) {
        let Some(outer) = self.outer else {
            return;
        };
        let now = Instant::now();
        let left = CURRENT.with(|c| c.replace(outer.map(|stage| (stage, now))));
        if let Some((stage, since)) = left {
            charge(stage, since, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn spin(d: Duration) {
        let start = Instant::now();
        while start.elapsed() < d {}
    }

    #[test]
    fn a_nested_stage_stops_the_outer_clock() {
        switch_on();
        // Other tests in this process may time stages too: compare differences only.
        let (route, hand_on) = (Stage::Route.nanos(), Stage::HandOn.nanos());
        {
            let _outer = enter(Stage::HandOn);
            spin(Duration::from_millis(5));
            {
                let _inner = enter(Stage::Route);
                spin(Duration::from_millis(100));
            }
            spin(Duration::from_millis(5));
        }
        let route = Stage::Route.nanos() - route;
        let hand_on = Stage::HandOn.nanos() - hand_on;
        assert!(route >= 100_000_000, "route {route} ns");
        assert!(
            (10_000_000..100_000_000).contains(&hand_on),
            "the hand-on's own time, without the route inside it: {hand_on} ns"
        );
    }
}
