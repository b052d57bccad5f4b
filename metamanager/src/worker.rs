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
use crate::process::{self, Context, State, Waits};
use crate::request::Request;
use crate::store::{Db, OutboxEntry, StoreConfig};

/// Work for the store worker.
pub enum Job {
    /// A parsed message from the broker.
    Request(Box<Request>),
    /// Read the oldest outbox entries (after the current batch commits).
    OutboxPeek {
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
            runtime.block_on(async move {
                let db = match Db::open(&store).await {
                    Ok(db) => db,
                    Err(e) => {
                        let _ = opened_tx.send(Err(Error::Open(e)));
                        return;
                    }
                };
                let _ = opened_tx.send(Ok(()));
                let worker = Worker {
                    db,
                    config,
                    publisher,
                    outbox_changed,
                    state: State::new(),
                };
                worker.run(jobs).await;
            });
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

/// One unit of a batch, in arrival order.
enum Step {
    Request(Box<Request>),
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
        let mut local: Vec<Message> = Vec::new();
        let mut acks = Vec::new();
        let mut peeks = Vec::new();
        if let Err(e) = self.db.control("BEGIN IMMEDIATE").await {
            return self
                .fail_batch(steps, others, Error::Commit(e.to_string()))
                .await;
        }
        let mut applied = Vec::with_capacity(steps.len());
        let mut outbox_written = false;
        for step in steps {
            let _ = self.db.control("SAVEPOINT step").await;
            let mut cx = Context {
                db: &self.db,
                root: &self.config.root,
                state: &mut self.state,
                waits: self.config.waits,
                local: Vec::new(),
                outbox_written: false,
            };
            let result = match &step {
                Step::Request(request) => process::apply(request, &mut cx).await,
                Step::Expired(id) => process::expire(id, &mut cx).await,
                Step::SyncPodStatus => process::sync_pod_status(&mut cx).await,
            };
            let produced = cx.local;
            let wrote = cx.outbox_written;
            match result {
                Ok(()) => {
                    let _ = self.db.control("RELEASE step").await;
                    outbox_written |= wrote;
                    local.extend(produced);
                }
                Err(error) => {
                    let _ = self.db.control("ROLLBACK TO step").await;
                    let _ = self.db.control("RELEASE step").await;
                    local.extend(self.error_reply(&step, &error));
                }
            }
            applied.push(step);
        }
        for job in others {
            match job {
                Job::OutboxAck { seq, reply } => {
                    let result = self.db.outbox_ack(seq).await.map(drop);
                    acks.push((reply, result.map_err(Error::store("acknowledge outbox"))));
                }
                Job::OutboxPeek { limit, reply } => peeks.push((limit, reply)),
                Job::Request(_) => unreachable!("requests are sorted into steps"),
            }
        }
        if let Err(e) = self.db.control("COMMIT").await {
            let _ = self.db.control("ROLLBACK").await;
            let error = Error::Commit(e.to_string());
            for (reply, _) in acks {
                let _ = reply.send(Err(Error::Commit(error.to_string())));
            }
            return self.fail_batch(applied, Vec::new(), error).await;
        }
        for message in local {
            if self.publisher.publish(message).await.is_err() {
                warn!(
                    error_code = "EM-META-PUBLISH",
                    "broker link closed; reply dropped"
                );
            }
        }
        for (reply, result) in acks {
            let _ = reply.send(result);
        }
        for (limit, reply) in peeks {
            let result = self.db.outbox_peek(limit).await;
            let _ = reply.send(result.map_err(Error::store("read outbox")));
        }
        if outbox_written {
            self.outbox_changed.notify_one();
        }
    }

    /// Nothing of the batch was committed: every request is told so.
    async fn fail_batch(&mut self, steps: Vec<Step>, others: Vec<Job>, error: Error) {
        error!(error_code = error.code(), error = %error, "batch not committed");
        for step in &steps {
            for message in self.error_reply(step, &error) {
                let _ = self.publisher.publish(message).await;
            }
        }
        for job in others {
            match job {
                Job::OutboxAck { reply, .. } => {
                    let _ = reply.send(Err(Error::Closed));
                }
                Job::OutboxPeek { reply, .. } => {
                    let _ = reply.send(Err(Error::Closed));
                }
                Job::Request(_) => {}
            }
        }
    }

    fn error_reply(&self, step: &Step, error: &Error) -> Vec<Message> {
        match step {
            Step::Request(request) => {
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
        Job::Request(request) => steps.push(Step::Request(request)),
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
