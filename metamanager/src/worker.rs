//! The store worker: the one owner of the SQLite connection and of the MetaManager's state.
//!
//! It runs on its own thread with its own single-threaded runtime, because libsql executes
//! SQLite synchronously. Messages arrive over a bounded channel; whatever has queued up is
//! applied in one transaction (group commit), each message inside its own savepoint so one
//! failure rolls back only that message. Nothing is published until the commit succeeded.

use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::{Message, Publisher};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::{interval_at, Instant, MissedTickBehavior};
use tracing::{error, warn};

use crate::error::Error;
use crate::process::{self, Context, OutboxLimit, State, Waits};
use crate::request::Request;
use crate::store::{Db, OutboxEntry, OutboxStats, StoreConfig};

/// Fired once a request has been dealt with.
pub type Done = oneshot::Sender<Outcome>;

/// How a request submitted through [`crate::Ingress`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Committed, or refused for good with an error reply: the sender may forget it.
    Final,
    /// Refused for now (outbox full, a failed commit): the sender should deliver it again later.
    Retry,
}

impl Outcome {
    fn of(error: &Error) -> Outcome {
        match error {
            Error::OutboxFull { .. } | Error::Commit(_) | Error::Closed => Outcome::Retry,
            _ => Outcome::Final,
        }
    }
}

/// Work for the store worker.
pub enum Job {
    /// A parsed message, and whom to tell once it is committed.
    Request(Box<Request>, Option<Done>),
    /// Queue a message for the cloud that another module published on `<root>/cloud/...`.
    OutboxAppend {
        topic: String,
        payload: Vec<u8>,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    /// Outbox depth, size and the creation time of its oldest entry.
    OutboxStats {
        reply: oneshot::Sender<Result<OutboxStats, Error>>,
    },
    /// Read the oldest outbox entries with `seq > after` (once the current batch commits).
    OutboxPeek {
        after: i64,
        limit: usize,
        reply: oneshot::Sender<Result<Vec<OutboxEntry>, Error>>,
    },
    /// Delete outbox entries up to `seq` once delivered.
    OutboxAck {
        seq: i64,
        reply: oneshot::Sender<Result<(), Error>>,
    },
}

/// What the worker needs besides the store.
pub struct WorkerConfig {
    pub root: String,
    pub waits: Waits,
    pub podstatus_sync_interval: Duration,
    pub batch_max: usize,
    pub outbox_limit: OutboxLimit,
}

/// Opens the store on a new thread and serves `jobs` until every sender is gone.
///
/// Returns once the store is open (or failed to open); `done` fires after the last commit.
pub async fn spawn(
    store: StoreConfig,
    config: WorkerConfig,
    jobs: mpsc::Receiver<Job>,
    publisher: Publisher,
    outbox_changed: Arc<Notify>,
) -> Result<oneshot::Receiver<()>, Error> {
    let (opened_tx, opened_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("edgemeta-store".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = opened_tx.send(Err(Error::Content {
                        what: "runtime",
                        reason: e.to_string(),
                    }));
                    return;
                }
            };
            let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runtime.block_on(async move {
                    let db = match Db::open(&store).await {
                        Ok(db) => db,
                        Err(e) => {
                            let _ = opened_tx.send(Err(Error::Open(e)));
                            return;
                        }
                    };
                    let outbox = match db.outbox_stats().await {
                        Ok(stats) => stats,
                        Err(e) => {
                            let _ = opened_tx.send(Err(Error::Open(e.into())));
                            return;
                        }
                    };
                    let _ = opened_tx.send(Ok(()));
                    let mut state = State::new();
                    state.outbox = outbox;
                    let worker = Worker {
                        db,
                        config,
                        publisher,
                        outbox_changed,
                        state,
                    };
                    worker.run(jobs).await;
                })
            }));
            if served.is_err() {
                // Nothing is acknowledged before its commit, so stopping loses nothing a client
                // was told is safe; serving on without a store would answer nobody.
                error!(
                    error_code = "EM-STORE-PANIC",
                    "store thread panicked; exiting"
                );
                std::process::exit(70);
            }
            let _ = done_tx.send(());
        })
        .map_err(|e| Error::Content {
            what: "store thread",
            reason: e.to_string(),
        })?;
    opened_rx.await.map_err(|_| Error::Closed)??;
    Ok(done_rx)
}

struct Worker {
    db: Db,
    config: WorkerConfig,
    publisher: Publisher,
    outbox_changed: Arc<Notify>,
    state: State,
}

/// An outbox read: entries after `seq`, at most `limit`, and where to send them.
type Peek = (i64, usize, oneshot::Sender<Result<Vec<OutboxEntry>, Error>>);

/// The outbox reads of a batch, answered after its writes.
#[derive(Default)]
struct Reads {
    peeks: Vec<Peek>,
    stats: Vec<oneshot::Sender<Result<OutboxStats, Error>>>,
}

/// One unit of a batch, in arrival order.
enum Step {
    Request(Box<Request>, Option<Done>),
    Expired(String),
    SyncPodStatus,
}

impl Worker {
    async fn run(mut self, mut jobs: mpsc::Receiver<Job>) {
        let period = self.config.podstatus_sync_interval;
        let mut sync = interval_at(Instant::now() + period, period);
        sync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let mut steps = Vec::new();
            let mut others = Vec::new();
            tokio::select! {
                job = jobs.recv() => match job {
                    Some(job) => {
                        sort(job, &mut steps, &mut others);
                        while steps.len() + others.len() < self.config.batch_max {
                            match jobs.try_recv() {
                                Ok(job) => sort(job, &mut steps, &mut others),
                                Err(_) => break,
                            }
                        }
                    }
                    None => break,
                },
                Some(expired) = std::future::poll_fn(|cx| self.state.expiries.poll_expired(cx)) => {
                    steps.push(Step::Expired(expired.into_inner()));
                }
                _ = sync.tick() => steps.push(Step::SyncPodStatus),
            }
            self.run_batch(steps, others).await;
        }
        if let Err(e) = self.db.checkpoint().await {
            warn!(error_code = "EM-STORE-CHECKPOINT", error = %e, "final checkpoint failed");
        }
    }

    async fn run_batch(&mut self, steps: Vec<Step>, others: Vec<Job>) {
        let mut reads = Reads::default();
        let mut writes = Vec::new();
        for job in others {
            match job {
                Job::OutboxPeek {
                    after,
                    limit,
                    reply,
                } => reads.peeks.push((after, limit, reply)),
                Job::OutboxStats { reply } => reads.stats.push(reply),
                other => writes.push(other),
            }
        }
        // Reads only (the relay or the bridge asking for rows) open no transaction.
        if !steps.is_empty() || !writes.is_empty() {
            self.write_batch(steps, writes).await;
        }
        // Reads see what is committed, whether or not this batch's writes were.
        self.answer(reads).await;
    }

    /// Applies requests and outbox writes in one transaction; answers only after `COMMIT`.
    async fn write_batch(&mut self, steps: Vec<Step>, others: Vec<Job>) {
        // A batch that only deletes delivered outbox rows needs no fsync: a power cut that undid
        // it would send those rows again, which the at-least-once contract allows. In standalone
        // mode every batch of requests is followed by such a batch, so this saves many fsyncs.
        let durable = !steps.is_empty()
            || others
                .iter()
                .any(|job| matches!(job, Job::OutboxAppend { .. }));
        if let Err(e) = self.db.begin(durable).await {
            let steps = steps.into_iter().map(|s| (s, Outcome::Retry)).collect();
            return self
                .fail_batch(steps, others, Error::Commit(e.to_string()))
                .await;
        }
        let outbox_before = self.state.outbox;
        let mut local: Vec<Message> = Vec::new();
        let mut outbox_written = false;
        let mut applied = Vec::with_capacity(steps.len());
        let mut aborted = None;
        for step in steps {
            if aborted.is_some() {
                applied.push((step, Outcome::Retry));
                continue;
            }
            let _ = self.db.control("SAVEPOINT step").await;
            let counters = self.state.outbox;
            let mut cx = self.context();
            let result = match &step {
                Step::Request(request, _) => process::apply(request, &mut cx).await,
                Step::Expired(id) => process::expire(id, &mut cx).await,
                Step::SyncPodStatus => process::sync_pod_status(&mut cx).await,
            };
            let (produced, wrote) = (cx.local, cx.outbox_written);
            let outcome = result.as_ref().err().map_or(Outcome::Final, Outcome::of);
            match result {
                Ok(()) => {
                    let _ = self.db.control("RELEASE step").await;
                    outbox_written |= wrote;
                    local.extend(produced);
                }
                Err(error) if !self.db.in_transaction() => {
                    // SQLite gave up the whole transaction: nothing of this batch will commit.
                    aborted = Some(Error::Commit(format!(
                        "the store rolled the batch back: {error}"
                    )));
                }
                Err(error) => {
                    let _ = self.db.control("ROLLBACK TO step").await;
                    let _ = self.db.control("RELEASE step").await;
                    self.state.outbox = counters;
                    local.extend(self.error_reply(&step, &error));
                }
            }
            applied.push((step, outcome));
        }
        if let Some(error) = aborted {
            self.state.outbox = outbox_before;
            return self.fail_batch(applied, others, error).await;
        }
        let mut replies = Vec::new();
        for job in others {
            match job {
                Job::OutboxAck { seq, reply } => {
                    let result = self.db.outbox_ack(seq).await;
                    if let Ok((entries, bytes)) = result {
                        self.state.outbox.entries =
                            self.state.outbox.entries.saturating_sub(entries);
                        self.state.outbox.bytes = self.state.outbox.bytes.saturating_sub(bytes);
                    }
                    let result = result.map(drop).map_err(Error::store("acknowledge outbox"));
                    replies.push((reply, result));
                }
                Job::OutboxAppend {
                    topic,
                    payload,
                    reply,
                } => {
                    let result = self.context().queue_for_cloud(&topic, &payload).await;
                    outbox_written |= result.is_ok();
                    replies.push((reply, result));
                }
                Job::Request(..) | Job::OutboxPeek { .. } | Job::OutboxStats { .. } => {
                    unreachable!("requests and reads are sorted out before")
                }
            }
        }
        if let Err(e) = self.db.control("COMMIT").await {
            let _ = self.db.control("ROLLBACK").await;
            self.state.outbox = outbox_before;
            let error = Error::Commit(e.to_string());
            for (reply, _) in replies {
                let _ = reply.send(Err(Error::Commit(error.to_string())));
            }
            return self.fail_batch(applied, Vec::new(), error).await;
        }
        // Committed: only now may anyone hear about it.
        for message in local {
            if self.publisher.publish(message).await.is_err() {
                warn!(
                    error_code = "EM-META-PUBLISH",
                    "broker link closed; reply dropped"
                );
            }
        }
        for (step, outcome) in applied {
            if let Step::Request(_, Some(done)) = step {
                let _ = done.send(outcome);
            }
        }
        for (reply, result) in replies {
            let _ = reply.send(result);
        }
        if outbox_written {
            self.outbox_changed.notify_one();
        }
    }

    /// Outbox reads, answered from committed state.
    async fn answer(&mut self, reads: Reads) {
        for (after, limit, reply) in reads.peeks {
            let result = self.db.outbox_peek(after, limit).await;
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
        for reply in reads.stats {
            // Authoritative numbers, which also re-anchor the running counters.
            let result = self.db.outbox_stats().await;
            if let Ok(stats) = result {
                self.state.outbox = stats;
            }
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
    }

    fn context(&mut self) -> Context<'_> {
        Context {
            db: &self.db,
            root: &self.config.root,
            state: &mut self.state,
            waits: self.config.waits,
            outbox_limit: self.config.outbox_limit,
            local: Vec::new(),
            outbox_written: false,
        }
    }

    /// Nothing of the batch was committed: every request is told so.
    async fn fail_batch(&mut self, steps: Vec<(Step, Outcome)>, others: Vec<Job>, error: Error) {
        error!(error_code = error.code(), error = %error, "batch not committed");
        for (step, _) in steps {
            for message in self.error_reply(&step, &error) {
                let _ = self.publisher.publish(message).await;
            }
            if let Step::Request(_, Some(done)) = step {
                let _ = done.send(Outcome::Retry);
            }
        }
        let failed = || Error::Commit(error.to_string());
        for job in others {
            match job {
                Job::OutboxAck { reply, .. } | Job::OutboxAppend { reply, .. } => {
                    let _ = reply.send(Err(failed()));
                }
                Job::OutboxPeek { reply, .. } => {
                    let _ = reply.send(Err(failed()));
                }
                Job::OutboxStats { reply } => {
                    let _ = reply.send(Err(failed()));
                }
                Job::Request(..) => {}
            }
        }
    }

    fn error_reply(&self, step: &Step, error: &Error) -> Vec<Message> {
        match step {
            Step::Request(request, _) => {
                log_failure(request, error);
                request.requester.error_messages(&self.config.root, error)
            }
            Step::Expired(id) => {
                error!(error_code = error.code(), %id, error = %error, "expiring a pending request failed");
                Vec::new()
            }
            Step::SyncPodStatus => {
                error!(error_code = error.code(), error = %error, "pod status sync failed");
                Vec::new()
            }
        }
    }
}

fn sort(job: Job, steps: &mut Vec<Step>, others: &mut Vec<Job>) {
    match job {
        Job::Request(request, done) => steps.push(Step::Request(request, done)),
        other => others.push(other),
    }
}

/// One log line per failed message, at a level that says whose fault it was.
pub fn log_failure(request: &Request, error: &Error) {
    let from = &request.requester.from;
    let resource = &request.requester.resource;
    if error.is_bad_input() {
        warn!(error_code = error.code(), %from, %resource, operation = %request.operation, error = %error, "message refused");
    } else {
        error!(error_code = error.code(), %from, %resource, operation = %request.operation, error = %error, "message failed");
    }
}
