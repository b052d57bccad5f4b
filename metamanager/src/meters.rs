//! The MetaManager's metrics: handles registered once at start-up, so counting a message on the
//! hot path is one atomic add (no lookup, lock or allocation). Without a recorder they are no-ops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use metrics::{counter, histogram, Counter, Histogram};

use crate::handlers::KINDS;
use crate::unit::Counted;
use edgemeta_protocol::Operation;

/// What became of a message, as the `result` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Applied and committed.
    Ok = 0,
    /// Bad input, answered with an `error` reply.
    Refused = 1,
    /// Our own failure (store, outbox full, commit), answered with an `error` reply.
    Failed = 2,
}

const OUTCOMES: [(Outcome, &str); 3] = [
    (Outcome::Ok, "ok"),
    (Outcome::Refused, "refused"),
    (Outcome::Failed, "failed"),
];

/// Rows of the message table: every operation, then one for messages whose operation is unknown.
const OPERATIONS: usize = Operation::ALL.len() + 1;

/// Counters and the commit-latency histogram, shared by intake and the store worker.
pub struct Meters {
    /// `edgemeta_messages_total{operation, result}`, indexed by operation then outcome.
    messages: [[Counter; 3]; OPERATIONS],
    /// `edgemeta_device_messages_total{kind, result}`, indexed by family (`handlers::KINDS`) then outcome.
    devices: [[Counter; 3]; KINDS.len()],
    /// `edgemeta_store_commit_seconds`: one sample per batch commit.
    commit_seconds: Histogram,
    /// `edgemeta_store_commits_total{result="failed"}`.
    commits_failed: Counter,
    /// `edgemeta_metaserver_event_delay_seconds`: a committed change's `COMMIT` → its watch
    /// event written, one sample per event per watch.
    event_delay: Histogram,
    /// Whether the last batch failed to commit; the node's readiness reads it.
    failing: AtomicBool,
}

impl Meters {
    /// Registers every series with the recorder in effect (global or `with_local_recorder`).
    pub fn register() -> Meters {
        let messages = std::array::from_fn(|row| {
            let operation = Operation::ALL.get(row).map_or("unknown", |op| op.as_str());
            OUTCOMES.map(|(_, result)| {
                counter!("edgemeta_messages_total", "operation" => operation, "result" => result)
            })
        });
        let devices = KINDS.map(|kind| {
            OUTCOMES.map(|(_, result)| {
                counter!("edgemeta_device_messages_total", "kind" => kind, "result" => result)
            })
        });
        Meters {
            messages,
            devices,
            commit_seconds: histogram!("edgemeta_store_commit_seconds"),
            commits_failed: counter!("edgemeta_store_commits_total", "result" => "failed"),
            event_delay: histogram!("edgemeta_metaserver_event_delay_seconds"),
            failing: AtomicBool::new(false),
        }
    }

    /// Handles that count nothing, for a node without metrics and for tests.
    pub fn noop() -> Meters {
        Meters {
            messages: std::array::from_fn(|_| std::array::from_fn(|_| Counter::noop())),
            devices: std::array::from_fn(|_| std::array::from_fn(|_| Counter::noop())),
            commit_seconds: Histogram::noop(),
            commits_failed: Counter::noop(),
            event_delay: Histogram::noop(),
            failing: AtomicBool::new(false),
        }
    }

    /// Counts `n` messages of `operation` (`None`: not known) that ended as `outcome`.
    pub fn messages(&self, operation: Option<Operation>, outcome: Outcome, n: u64) {
        let row = operation.map_or(Operation::ALL.len(), |op| op as usize);
        self.messages[row][outcome as usize].increment(n);
    }

    /// Counts `n` device messages of family `kind` (its row of `handlers::KINDS`) that ended as
    /// `outcome`.
    pub fn device_messages(&self, kind: usize, outcome: Outcome, n: u64) {
        if let Some(row) = self.devices.get(kind) {
            row[outcome as usize].increment(n);
        }
    }

    /// Counts `n` messages in their operation's or their family's row.
    pub(crate) fn count(&self, counted: Counted, outcome: Outcome, n: u64) {
        match counted {
            Counted::Operation(operation) => self.messages(Some(operation), outcome, n),
            Counted::Device(kind) => self.device_messages(kind, outcome, n),
        }
    }

    /// Records a batch commit: how long `COMMIT` took, or that the batch was not committed.
    pub fn committed(&self, took: Option<Duration>) {
        match took {
            Some(took) => self.commit_seconds.record(took.as_secs_f64()),
            None => self.commits_failed.increment(1),
        }
        self.failing.store(took.is_none(), Ordering::Relaxed);
    }

    /// Records how long after its `COMMIT` a change reached a watch's stream.
    pub fn watch_event(&self, took: Duration) {
        self.event_delay.record(took.as_secs_f64());
    }

    /// Whether the store's last batch failed to commit.
    pub fn store_failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for Meters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meters")
            .field("store_failing", &self.store_failing())
            .finish_non_exhaustive()
    }
}

/// Messages of one batch counted on the stack and added to the counters once the batch has
/// committed: one add per series touched rather than per message.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    counts: [[u32; 3]; OPERATIONS],
    devices: [[u32; 3]; KINDS.len()],
}

impl Tally {
    /// Counts one message, in its operation's or its family's row.
    pub(crate) fn add(&mut self, counted: Counted, outcome: Outcome) {
        match counted {
            Counted::Operation(operation) => {
                self.counts[operation as usize][outcome as usize] += 1;
            }
            Counted::Device(kind) => {
                if let Some(row) = self.devices.get_mut(kind) {
                    row[outcome as usize] += 1;
                }
            }
        }
    }

    /// Adds the tally to `meters`.
    pub fn flush(self, meters: &Meters) {
        for (row, counts) in self.counts.iter().enumerate() {
            let operation = Operation::ALL.get(row).copied();
            for (outcome, _) in OUTCOMES {
                let n = counts[outcome as usize];
                if n > 0 {
                    meters.messages(operation, outcome, u64::from(n));
                }
            }
        }
        for (kind, counts) in self.devices.iter().enumerate() {
            for (outcome, _) in OUTCOMES {
                let n = counts[outcome as usize];
                if n > 0 {
                    meters.device_messages(kind, outcome, u64::from(n));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_index_the_table_in_declaration_order() {
        for (i, op) in Operation::ALL.iter().enumerate() {
            assert_eq!(*op as usize, i, "{op}");
        }
    }
}
