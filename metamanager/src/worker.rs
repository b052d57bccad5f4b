//! The store worker: the one owner of the SQLite connection and of the MetaManager's state.
//!
//! It runs on its own thread with its own single-threaded runtime, because libsql executes
//! SQLite synchronously. Messages arrive over a bounded channel; whatever has queued up is
//! applied in one transaction (group commit), and a message that fails is undone alone
//! (`Worker::apply_steps`). Nothing is published until the commit succeeded.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::stages::{self, Stage};
use edgemeta_broker::{Message, Publisher};
use tokio::sync::{broadcast, mpsc, oneshot, Notify};
use tokio::time::{interval_at, Instant, MissedTickBehavior};
use tracing::{error, warn};

use crate::durable::{Release, Syncer};
use crate::error::Error;
use crate::handlers;
use crate::handon::Feed;
use crate::meters::{self, Meters, Tally};
use crate::outbox::{self, OutboxLimit, Read, Write};
use crate::store::{Changes, Checkpointer, Db, StoreConfig, StoreError, Synchronous};
use crate::unit::{Context, Done, Effects, Job, Outcome, Settings, State, Step, Waits, Work};

/// What the worker needs besides the store.
pub(crate) struct WorkerConfig {
    pub(crate) root: String,
    /// This node's name (`cloud.node_id`).
    pub(crate) node: String,
    pub(crate) waits: Waits,
    pub(crate) podstatus_sync_interval: Duration,
    pub(crate) batch_max: usize,
    pub(crate) outbox_limit: OutboxLimit,
    /// Standalone: the outbox is relayed to the local broker, not sent to a cloud.
    pub(crate) local_relay: bool,
}

/// What the worker announces after a commit.
pub(crate) struct Announce {
    /// The outbox has new rows (relay, cloud bridge).
    pub(crate) outbox_changed: Arc<Notify>,
    /// Committed changes of served objects (the MetaServer's live watches).
    pub(crate) changes: broadcast::Sender<Changes>,
}

/// How the store thread ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stopped {
    /// Every job sender was gone and the last batch committed.
    Finished,
    /// The thread panicked: the node must stop, since nobody would answer its clients.
    Panicked,
}

/// Opens the store on a new thread and serves `jobs` until every sender is gone.
///
/// Returns once the store is open (or failed to open); `done` tells how the thread ended.
pub(crate) async fn spawn(
    store: StoreConfig,
    config: WorkerConfig,
    jobs: mpsc::Receiver<Job>,
    publisher: Publisher,
    feed: Feed,
    announce: Announce,
    meters: Arc<Meters>,
) -> Result<oneshot::Receiver<Stopped>, Error> {
    let Announce {
        outbox_changed,
        changes,
    } = announce;
    let (opened_tx, opened_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("edgemeta-store".into())
        .spawn(move || {
            let runtime = match crate::store::thread_runtime() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = opened_tx.send(Err(Error::Open(e)));
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
                    match db.handon_last().await {
                        Ok(last) => feed.gauge().left_from_before(last),
                        Err(e) => {
                            let _ = opened_tx.send(Err(Error::Open(e.into())));
                            return;
                        }
                    }
                    let checkpointer = match Checkpointer::start(&store.path) {
                        Ok(checkpointer) => checkpointer,
                        Err(e) => {
                            let _ = opened_tx.send(Err(Error::Open(e)));
                            return;
                        }
                    };
                    let outbox_last = match db.outbox_last().await {
                        Ok(last) => last,
                        Err(e) => {
                            let _ = opened_tx.send(Err(Error::Open(e.into())));
                            return;
                        }
                    };
                    let syncer = match store.early_handon.then(|| {
                        Syncer::start(
                            &store.path,
                            store.synchronous == Synchronous::Full,
                            Duration::from_millis(store.sync_delay_ms),
                            outbox_last,
                        )
                    }) {
                        None => None,
                        Some(Ok(syncer)) => Some(syncer),
                        Some(Err(e)) => {
                            let _ = opened_tx.send(Err(Error::Open(StoreError::Thread(e))));
                            return;
                        }
                    };
                    let _ = opened_tx.send(Ok(()));
                    let state = State::new(outbox);
                    let worker = Worker {
                        db,
                        config,
                        publisher,
                        feed,
                        outbox_changed,
                        state,
                        meters,
                        changes,
                        syncer,
                        checkpointer: Some(checkpointer),
                    };
                    worker.run(jobs).await;
                })
            }));
            // Nothing is acknowledged before its commit, so stopping after a panic loses nothing
            // a client was told is safe; the binary decides the exit code.
            let stopped = match served {
                Ok(()) => Stopped::Finished,
                Err(_) => {
                    error!(error_code = "EM-STORE-PANIC", "store thread panicked");
                    Stopped::Panicked
                }
            };
            let _ = done_tx.send(stopped);
        })
        .map_err(|e| Error::Open(StoreError::Thread(e)))?;
    opened_rx.await.map_err(|_| Error::Closed)??;
    Ok(done_rx)
}

/// Jobs queued after a batch from which the store counts as busy: it syncs at once. A trickle
/// of senders leaves one or two queued; a burst, hundreds.
const BUSY: usize = 8;

/// Resolves at `due`, never when there is none.
async fn until(due: Option<std::time::Instant>) {
    match due {
        Some(due) => tokio::time::sleep_until(due.into()).await,
        None => std::future::pending().await,
    }
}

struct Worker {
    db: Db,
    config: WorkerConfig,
    publisher: Publisher,
    feed: Feed,
    outbox_changed: Arc<Notify>,
    state: State,
    meters: Arc<Meters>,
    /// Committed changes of served objects, for the MetaServer's live watches. Sending never
    /// waits: a watcher that falls behind the channel catches up from the history.
    changes: broadcast::Sender<Changes>,
    /// Early hand-on: what is acknowledged outward waits for the WAL's fsync (on the sync
    /// thread), after the batch's hand-ons have left.
    syncer: Option<Syncer>,
    /// Folds the WAL into the database file off this thread; `None` once stopped for the
    /// final checkpoint.
    checkpointer: Option<Checkpointer>,
}

impl Worker {
    async fn run(mut self, mut jobs: mpsc::Receiver<Job>) {
        let period = self.config.podstatus_sync_interval;
        let mut sync = interval_at(Instant::now() + period, period);
        sync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            let mut batch = Batch::default();
            let due = self.syncer.as_ref().and_then(Syncer::due);
            tokio::select! {
                () = until(due) => {
                    self.flush_sync();
                    continue;
                }
                job = jobs.recv() => match job {
                    Some(job) => {
                        // Sized once for what has queued: a burst's batch does not regrow.
                        batch.steps.reserve(jobs.len().min(self.config.batch_max) + 1);
                        batch.add(job);
                        while batch.len() < self.config.batch_max {
                            match jobs.try_recv() {
                                Ok(job) => batch.add(job),
                                Err(_) => break,
                            }
                        }
                    }
                    None => break,
                },
                Some(expired) = std::future::poll_fn(|cx| self.state.poll_expired(cx)) => {
                    batch.steps.push(Step::Expired(expired));
                }
                _ = sync.tick() => batch.steps.push(Step::SyncPodStatus),
            }
            let Batch {
                steps,
                writes,
                reads,
            } = batch;
            // Reads only (the relay or the bridge asking for rows) open no transaction.
            if !steps.is_empty() || !writes.is_empty() {
                self.write_batch(steps, writes, &jobs).await;
            }
            // Busy (a queue built up during this batch): sync now, and the queue forms the
            // next batch meanwhile, as it would without the delay; committing it first in
            // small batches would rewrite the same pages more often.
            if jobs.len() >= BUSY || due.is_some_and(|due| due <= std::time::Instant::now()) {
                self.flush_sync();
            } else if jobs.is_empty() {
                self.idle_sync();
            }
            // Reads see what is committed, whether or not this batch's writes were; but outbox
            // rows are read for the cloud or the relay only once durable (protocol §6.1): a
            // peek sees them up to the sync thread's watermark, and their release's notify
            // prompts the next.
            let synced = self.outbox_synced();
            for read in reads {
                outbox::answer(read, &self.db, self.state.outbox(), synced).await;
            }
        }
        if let Some(syncer) = self.syncer.as_mut() {
            syncer.settle();
        }
        // Stopped first, so the final checkpoint is not answered `busy` by a passive one.
        drop(self.checkpointer.take());
        if let Err(e) = self.db.checkpoint().await {
            warn!(error_code = "EM-STORE-CHECKPOINT", error = %e, "final checkpoint failed");
        }
    }

    /// Applies requests and outbox writes in one transaction; answers only after `COMMIT`.
    async fn write_batch(
        &mut self,
        steps: Vec<Step>,
        writes: Vec<Write>,
        jobs: &mpsc::Receiver<Job>,
    ) {
        // This thread runs only this future: a stage may span its awaits.
        let store = stages::enter(Stage::Store);
        let durable = outbox::needs_fsync(steps.len(), &writes);
        let outbox_before = *self.state.outbox();
        let tx = match self.db.begin(durable).await {
            Ok(tx) => tx,
            Err(e) => {
                self.meters.committed(None);
                count_failed(&self.meters, steps.iter());
                let steps = steps.into_iter().map(|s| (s, Outcome::Retry)).collect();
                return self
                    .fail_batch(steps, writes, Error::Commit(e.to_string()))
                    .await;
            }
        };
        let BatchResult {
            local,
            outbox_written: steps_wrote,
            applied,
            aborted,
            tally,
        } = Worker::apply_steps(
            Parts {
                db: &self.db,
                config: &self.config,
                publisher: &self.publisher,
                state: &mut self.state,
            },
            &tx,
            steps,
        )
        .await;
        let mut outbox_written = steps_wrote;
        // What the batch hands on is committed with it, and leaves at its subscribers' pace.
        // If the store cannot take it (a full disk), it is published at once instead: replies
        // to queries must not depend on room to write.
        let hand_on = stages::enter(Stage::HandOn);
        let stored = match aborted {
            Some(error) => Err(error),
            None => self.store_handons(&tx, local).await,
        };
        drop(hand_on);
        let (handons, direct) = match stored {
            Ok(split) => split,
            Err(error) => {
                if let Err(e) = tx.rollback().await {
                    warn!(error_code = "EM-STORE-TRANSACTION", error = %e, "rollback of an aborted batch failed");
                }
                *self.state.outbox() = outbox_before;
                self.meters.committed(None);
                count_failed(&self.meters, applied.iter().map(|(step, _)| step));
                return self.fail_batch(applied, writes, error).await;
            }
        };
        let mut replies = Vec::with_capacity(writes.len());
        for write in writes {
            let (reply, result, appended) = outbox::apply(
                write,
                &self.db,
                self.state.outbox(),
                self.config.outbox_limit,
            )
            .await;
            outbox_written |= appended;
            replies.push((reply, result));
        }
        drop(store);
        let commit = stages::enter(Stage::Commit);
        let committing = std::time::Instant::now();
        let committed = tx.commit().await;
        drop(commit);
        let _hand_on = stages::enter(Stage::HandOn);
        self.meters
            .committed(committed.is_ok().then(|| committing.elapsed()));
        if committed.is_ok() {
            tally.flush(&self.meters);
        } else {
            count_failed(&self.meters, applied.iter().map(|(step, _)| step));
        }
        if let Err(e) = committed {
            *self.state.outbox() = outbox_before;
            let error = Error::Commit(e.to_string());
            for (reply, _) in replies {
                let _ = reply.send(Err(Error::Commit(error.to_string())));
            }
            return self.fail_batch(applied, Vec::new(), error).await;
        }
        // Committed: only now may anyone hear about it.
        if let Some(checkpointer) = &self.checkpointer {
            checkpointer.committed();
        }
        let changes = self.db.take_changes();
        if !changes.is_empty() {
            // No receiver (no watch open) is not an error.
            let _ = self.changes.send(Arc::new(crate::store::Committed {
                at: std::time::Instant::now(),
                changes,
            }));
        }
        let dones: Vec<(Done, Outcome, bool)> = applied
            .into_iter()
            .filter_map(|(step, outcome)| match step {
                Step::Apply(work, done) => {
                    done.map(|done| (done, outcome, matches!(work, Work::Device(_))))
                }
                _ => None,
            })
            .collect();
        let senders: Vec<usize> = dones.iter().map(|(done, ..)| done.sender()).collect();
        let after_ack = dones.iter().filter_map(|(done, ..)| done.after_ack()).min();
        // The newest outbox row this commit wrote, for the watermark of what peeks may see.
        let outbox_last = match (&self.syncer, outbox_written) {
            (Some(_), true) => match self.db.outbox_last().await {
                Ok(last) => Some(last),
                Err(e) => {
                    // Its rows become readable with the next commit's that writes the outbox.
                    warn!(error_code = "EM-STORE-WRITE", error = %e, "reading the outbox's newest row failed; its new rows leave with the next commit's");
                    None
                }
            },
            _ => None,
        };
        let sync_now = match &mut self.syncer {
            Some(syncer) => {
                syncer.committed(durable, &senders, after_ack, !jobs.is_empty(), outbox_last)
            }
            None => true,
        };
        // Each subscriber gets this commit's messages in one write (this thread runs only
        // this future, so the guard stays on its thread across the awaits).
        let together = edgemeta_broker::Together::begin();
        for message in direct {
            if self.publisher.publish(message).await.is_err() {
                warn!(
                    error_code = "EM-META-PUBLISH",
                    "broker link closed; reply dropped"
                );
            }
        }
        // A device whose PUBACK follows this commit's sync at once gets its results in the
        // same write, after the sync: one write per report instead of two (protocol §6.1).
        let sockets = if sync_now {
            dones
                .iter()
                .filter(|(_, _, device)| *device)
                .filter_map(|(done, ..)| done.socket())
                .collect()
        } else {
            Vec::new()
        };
        let mut kept = together.keep_for(sockets);
        for (done, ..) in dones.iter().rev() {
            if let Some(kept) = done.socket().and_then(|socket| kept.remove(&socket)) {
                done.send_with(kept);
            }
        }
        self.feed.committed(handons);
        let outbox_changed = outbox_written.then(|| self.outbox_changed.clone());
        let release: Release = Box::new(move |durable| {
            // One write of acknowledgements per client and commit, not one per publish.
            edgemeta_broker::release_together(|| {
                for (done, outcome, _) in dones {
                    if durable {
                        done.send(outcome);
                    } else {
                        done.refuse();
                    }
                }
            });
            for (reply, result) in replies {
                let _ = reply.send(if durable {
                    result
                } else {
                    Err(Error::Commit("the store could not be synced".into()))
                });
            }
            if let (true, Some(changed)) = (durable, outbox_changed) {
                changed.notify_one();
            }
        });
        match &mut self.syncer {
            Some(syncer) => syncer.hand(release, sync_now),
            None => release(true),
        }
    }

    /// Applies a batch's steps inside `tx`, each undoable alone. Steps run in segments without a
    /// savepoint each (SQLite's `SAVEPOINT`/`RELEASE` and its sub-journal copies were an eighth
    /// of an insert's cost); when one fails, its segment is undone and applied again one
    /// savepoint per step, the failed one answered with its error. A step that did what applying
    /// it again would repeat (it changed a wait, the link state, a report's verdict) ends its
    /// segment, so it is never applied twice.
    async fn apply_steps(
        parts: Parts<'_>,
        tx: &crate::store::Transaction<'_>,
        steps: Vec<Step>,
    ) -> BatchResult {
        let Parts {
            db,
            config,
            publisher,
            state,
        } = parts;
        let mut done = BatchResult {
            // Most steps hand one message on.
            local: Vec::with_capacity(steps.len()),
            outbox_written: false,
            applied: Vec::with_capacity(steps.len()),
            aborted: None,
            tally: Tally::default(),
        };
        let mut queue: VecDeque<Queued> = steps.into_iter().map(Queued::Run).collect();
        // One savepoint per step from the first failure on: a batch is applied again once at most.
        let mut careful = false;
        let mut segment: Option<Segment<'_>> = None;
        while let Some(next) = queue.pop_front() {
            let step = match next {
                Queued::Failed(failed) => {
                    done.failed(&error_reply(config, &failed.step, &failed.error), failed);
                    continue;
                }
                Queued::Run(step) => step,
            };
            if done.aborted.is_some() {
                done.applied.push((step, Outcome::Retry));
                continue;
            }
            let opened = match (&segment, careful) {
                (Some(_), false) => Ok(None),
                // A fresh transaction needs no `SAVEPOINT`: undoing it undoes the transaction.
                (None, false) if done.applied.is_empty() => tx.first_savepoint().await.map(Some),
                _ => tx.savepoint().await.map(Some),
            };
            let savepoint = match opened {
                Ok(savepoint) => savepoint,
                Err(e) => {
                    done.aborted = Some(Error::Commit(format!("cannot open a savepoint: {e}")));
                    done.applied.push((step, Outcome::Retry));
                    continue;
                }
            };
            let counters = *state.outbox();
            let (step_savepoint, new_segment) = match (savepoint, careful) {
                (Some(savepoint), true) => (Some(savepoint), None),
                (Some(savepoint), false) => (
                    None,
                    Some(Segment {
                        savepoint,
                        restore: Restore {
                            start: done.applied.len(),
                            local: done.local.len(),
                            outbox_written: done.outbox_written,
                            tally: done.tally.clone(),
                            counters,
                        },
                    }),
                ),
                (None, _) => (None, None),
            };
            if new_segment.is_some() {
                segment = new_segment;
            }
            let settings = settings(config, publisher);
            let mut cx = Context::new(db, settings, state);
            let result = match &step {
                Step::Apply(work, _) => handlers::apply(work, &mut cx).await,
                Step::Expired(id) => handlers::expire(id, &mut cx).await,
                Step::SyncPodStatus => handlers::sync_pod_status(&mut cx).await,
            };
            let effects = cx.finish();
            let outcome = result.as_ref().err().map_or(Outcome::Final, Outcome::of);
            let counted = match &result {
                Ok(()) if effects.refused => meters::Outcome::Refused,
                Ok(()) => meters::Outcome::Ok,
                Err(e) if e.is_bad_input() => meters::Outcome::Refused,
                Err(_) => meters::Outcome::Failed,
            };
            let error = match result {
                Ok(()) => {
                    let closed = match step_savepoint {
                        Some(savepoint) => savepoint.release().await,
                        None if effects.unrepeatable => match segment.take() {
                            Some(segment) => segment.savepoint.release().await,
                            None => Ok(()),
                        },
                        None => Ok(()),
                    };
                    if let Err(e) = closed {
                        done.aborted =
                            Some(Error::Commit(format!("cannot release a savepoint: {e}")));
                    }
                    done.ok(step, effects, counted);
                    continue;
                }
                Err(error) => error,
            };
            if !tx.is_open() {
                // SQLite gave up the whole transaction: nothing of this batch will commit.
                done.aborted = Some(Error::Commit(format!(
                    "the store rolled the batch back: {error}"
                )));
                done.applied.push((step, outcome));
                continue;
            }
            let failed = Failed {
                step,
                outcome,
                counted,
                error,
            };
            if let Some(savepoint) = step_savepoint {
                match savepoint.rollback().await {
                    Ok(()) => {
                        *state.outbox() = counters;
                        done.failed(&error_reply(config, &failed.step, &failed.error), failed);
                    }
                    Err(e) => done.cannot_undo(failed, &e),
                }
                continue;
            }
            // Undo the segment, then apply its steps again, each in a savepoint of its own.
            let undone = match segment.take() {
                Some(Segment { savepoint, restore }) => {
                    savepoint.rollback().await.map(|()| restore)
                }
                None => Err(libsql::Error::Misuse("a step ran outside a segment".into())),
            };
            let undone = match undone {
                Ok(undone) => undone,
                Err(e) => {
                    done.cannot_undo(failed, &e);
                    continue;
                }
            };
            *state.outbox() = undone.counters;
            done.local.truncate(undone.local);
            done.outbox_written = undone.outbox_written;
            done.tally = undone.tally;
            careful = true;
            queue.push_front(Queued::Failed(failed));
            for (step, _) in done.applied.drain(undone.start..).rev() {
                queue.push_front(Queued::Run(step));
            }
        }
        // An aborted transaction is rolled back whole: its segment needs no release.
        if let (Some(segment), None) = (segment, &done.aborted) {
            if let Err(e) = segment.savepoint.release().await {
                done.aborted = Some(Error::Commit(format!("cannot release a savepoint: {e}")));
            }
        }
        done
    }

    /// Writes the batch's local messages to the `handon` table in a savepoint of `tx`: the
    /// stored ones with their seqs, or (the store refused them) none stored and all to publish
    /// at once. An error only when the transaction itself is lost.
    async fn store_handons(
        &self,
        tx: &crate::store::Transaction<'_>,
        mut local: Vec<Message>,
    ) -> Result<(Vec<(i64, Message)>, Vec<Message>), Error> {
        local.retain(|message| !crate::handon::unheard(&self.publisher, message));
        // Nothing waits: what every subscriber has room for now goes out after the commit
        // without a row; from the first that does not fit on, the rest wait in order.
        let mut direct = Vec::new();
        if self.feed.gauge().caught_up() {
            let mut fits = 0;
            for message in local.iter_mut() {
                if !self.publisher.reserve_now(message) {
                    break;
                }
                fits += 1;
            }
            direct = local.drain(..fits).collect();
        }
        if local.is_empty() {
            return Ok((Vec::new(), direct));
        }
        let savepoint = tx
            .savepoint()
            .await
            .map_err(|e| Error::Commit(format!("cannot open a savepoint: {e}")))?;
        let mut stored = Vec::with_capacity(local.len());
        let mut refused = None;
        for message in &local {
            match self.db.handon_push(message).await {
                Ok(seq) => stored.push(seq),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let Some(refused) = refused else {
            savepoint
                .release()
                .await
                .map_err(|e| Error::Commit(format!("cannot release a savepoint: {e}")))?;
            return Ok((stored.into_iter().zip(local).collect(), direct));
        };
        if !tx.is_open() {
            return Err(Error::Commit(format!(
                "the store rolled the batch back: {refused}"
            )));
        }
        savepoint
            .rollback()
            .await
            .map_err(|e| Error::Commit(format!("cannot undo hand-ons ({refused}): {e}")))?;
        warn!(error_code = "EM-STORE-WRITE", error = %refused, "hand-ons not stored; published at once, unpaced");
        direct.extend(local);
        Ok((Vec::new(), direct))
    }

    /// Nothing of the batch was committed: every request is told so.
    async fn fail_batch(&mut self, steps: Vec<(Step, Outcome)>, writes: Vec<Write>, error: Error) {
        // Earlier commits are acknowledged first: a client's acknowledgements stay in order.
        if let Some(syncer) = self.syncer.as_mut() {
            syncer.settle();
        }
        error!(error_code = error.code(), error = %error, "batch not committed");
        for (step, _) in steps {
            for message in self.error_reply(&step, &error) {
                let _ = self.publisher.publish(message).await;
            }
            if let Step::Apply(_, Some(done)) = step {
                done.send(Outcome::Retry);
            }
        }
        for write in writes {
            write.fail(&error);
        }
    }

    /// Nothing is queued: syncs now unless other senders' commits may still share the sync.
    fn idle_sync(&mut self) {
        if let Some(syncer) = self.syncer.as_mut() {
            syncer.idle();
        }
    }

    /// Hands what is committed to the sync thread, which releases what waited for it.
    fn flush_sync(&mut self) {
        if let Some(syncer) = self.syncer.as_mut().filter(|syncer| syncer.waiting()) {
            syncer.flush();
        }
    }

    /// The newest outbox row that may be read for the cloud or the relay: every committed one
    /// without early hand-on (each commit fsyncs).
    fn outbox_synced(&self) -> i64 {
        self.syncer.as_ref().map_or(i64::MAX, Syncer::outbox_synced)
    }

    fn error_reply(&self, step: &Step, error: &Error) -> Vec<Message> {
        error_reply(&self.config, step, error)
    }
}

/// The answer to a message that failed, logged.
fn error_reply(config: &WorkerConfig, step: &Step, error: &Error) -> Vec<Message> {
    match step {
        Step::Apply(work, _) => {
            handlers::log_failure(work, error);
            handlers::failure_reply(&config.root, &config.node, work, error)
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

/// The parts of the worker a batch's steps use, borrowed apart from its open transaction.
struct Parts<'a> {
    db: &'a Db,
    config: &'a WorkerConfig,
    publisher: &'a Publisher,
    state: &'a mut State,
}

/// What applying a batch's steps left for its commit.
struct BatchResult {
    /// Local messages to publish (or store as hand-ons) once committed.
    local: Vec<Message>,
    outbox_written: bool,
    /// Every step, in order, with how it ended.
    applied: Vec<(Step, Outcome)>,
    /// Set when the transaction cannot commit: the steps after it were not applied.
    aborted: Option<Error>,
    tally: Tally,
}

impl BatchResult {
    fn ok(&mut self, step: Step, effects: Effects, counted: meters::Outcome) {
        if let Step::Apply(work, _) = &step {
            self.tally.add(work.counted(), counted);
        }
        self.outbox_written |= effects.outbox_written;
        self.local.extend(effects.local);
        self.applied.push((step, Outcome::Final));
    }

    /// A failed step's changes could not be undone: the transaction cannot commit.
    fn cannot_undo(&mut self, failed: Failed, e: &libsql::Error) {
        self.aborted = Some(Error::Commit(format!(
            "cannot undo a failed message ({}): {e}",
            failed.error
        )));
        self.applied.push((failed.step, failed.outcome));
    }

    /// A step whose changes were undone: answered with its error.
    fn failed(&mut self, reply: &[Message], failed: Failed) {
        if let Step::Apply(work, _) = &failed.step {
            self.tally.add(work.counted(), failed.counted);
        }
        self.local.extend_from_slice(reply);
        self.applied.push((failed.step, failed.outcome));
    }
}

/// A step whose changes were undone, and why.
struct Failed {
    step: Step,
    outcome: Outcome,
    counted: meters::Outcome,
    error: Error,
}

/// A step still to apply in [`Worker::apply_steps`].
enum Queued {
    Run(Step),
    /// Applied once already and failed: only its error is answered.
    Failed(Failed),
}

/// Steps applied under one savepoint, and what to restore when it is undone.
struct Segment<'a> {
    savepoint: crate::store::Savepoint<'a>,
    restore: Restore,
}

/// What a segment's undo restores.
struct Restore {
    /// Where its steps begin in [`BatchResult::applied`].
    start: usize,
    /// [`BatchResult::local`]'s length when it opened.
    local: usize,
    outbox_written: bool,
    tally: Tally,
    counters: crate::store::OutboxStats,
}

/// What one wake-up of the worker collected, sorted by how it is served.
#[derive(Default)]
struct Batch {
    steps: Vec<Step>,
    writes: Vec<Write>,
    reads: Vec<Read>,
}

impl Batch {
    fn add(&mut self, job: Job) {
        match job {
            Job::Apply(work, done) => self.steps.push(Step::Apply(work, done)),
            Job::Write(write) => self.writes.push(write),
            Job::Read(read) => self.reads.push(read),
        }
    }

    fn len(&self) -> usize {
        self.steps.len() + self.writes.len() + self.reads.len()
    }
}

/// Counts every request of a batch that was not committed as failed (the error path: one add each).
fn count_failed<'a>(meters: &Meters, steps: impl Iterator<Item = &'a Step>) {
    for step in steps {
        if let Step::Apply(work, _) = step {
            meters.count(work.counted(), meters::Outcome::Failed, 1);
        }
    }
}

/// What every handler reads of the worker's configuration.
fn settings<'a>(config: &'a WorkerConfig, broker: &'a Publisher) -> Settings<'a> {
    Settings {
        root: &config.root,
        node: &config.node,
        waits: config.waits,
        outbox_limit: config.outbox_limit,
        broker,
        relay: config.local_relay,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intake::{self, IntakeConfig};
    use crate::unit::{PendingKind, Work};

    /// A store whose writes of `fail/...` keys fail, as a full disk fails one message's write;
    /// its directory lives as long as the returned guard.
    async fn failing_store() -> (tempfile::TempDir, Db) {
        let dir = tempfile::tempdir().expect("temp dir");
        let config = StoreConfig {
            path: dir.path().join("meta.db"),
            ..StoreConfig::default()
        };
        let db = Db::open(&config).await.expect("open");
        let other = libsql::Builder::new_local(&config.path)
            .build()
            .await
            .expect("second connection");
        other
            .connect()
            .expect("connect")
            .execute_batch(
                "CREATE TRIGGER fail_insert BEFORE INSERT ON meta WHEN NEW.key LIKE 'fail/%'
                   BEGIN SELECT RAISE(ABORT, 'Failed DB Operation'); END;",
            )
            .await
            .expect("trigger");
        (dir, db)
    }

    fn step(topic: &str, payload: &str) -> Step {
        let config = IntakeConfig {
            root: "ke".into(),
            node: "n1".into(),
            max_payload_bytes: 4096,
            meters: Arc::new(Meters::noop()),
        };
        let message = Message::new(topic, payload.as_bytes().to_vec());
        let request = intake::parse(&config, &message)
            .expect("a valid request")
            .expect("addressed to the MetaManager");
        Step::Apply(Work::Request(Box::new(request)), None)
    }

    fn insert(key: &str) -> Step {
        step(
            &format!("ke/meta/edgecontroller/insert/{key}"),
            r#"{"v":1}"#,
        )
    }

    /// Applies `steps` as one batch of a cloud-connected node and commits it; returns the
    /// outcomes, the local messages' topics and the worker's state.
    async fn batch(db: &Db, steps: Vec<Step>) -> (Vec<Outcome>, Vec<String>, State) {
        let config = WorkerConfig {
            root: "ke".into(),
            node: "n1".into(),
            waits: WAITS,
            podstatus_sync_interval: Duration::from_secs(60),
            batch_max: 256,
            outbox_limit: LIMIT,
            local_relay: false,
        };
        let (publisher, _out) = Publisher::channel(16);
        let mut state = State::new(crate::store::OutboxStats::default());
        let tx = db.begin(true).await.expect("begin");
        let done = Worker::apply_steps(
            Parts {
                db,
                config: &config,
                publisher: &publisher,
                state: &mut state,
            },
            &tx,
            steps,
        )
        .await;
        assert!(done.aborted.is_none(), "{:?}", done.aborted);
        tx.commit().await.expect("commit");
        let outcomes = done.applied.iter().map(|(_, outcome)| *outcome).collect();
        let topics = done.local.iter().map(|m| m.topic.to_string()).collect();
        (outcomes, topics, state)
    }

    const WAITS: Waits = Waits {
        remote_query: Duration::from_secs(60),
        volume: Duration::from_secs(60),
    };
    const LIMIT: OutboxLimit = OutboxLimit {
        entries: 1000,
        bytes: 1 << 20,
    };

    async fn outbox_topics(db: &Db) -> Vec<String> {
        let entries = db.outbox_peek(0, i64::MAX, 100).await.expect("peek");
        entries.into_iter().map(|e| e.topic).collect()
    }

    /// Two failing inserts among six, after the cloud link came up and a query went to the
    /// cloud: each failure is undone alone, every other message is stored and handed on once,
    /// and the link change and the query, which a second application would repeat, are not.
    #[tokio::test]
    async fn failed_messages_are_undone_alone_and_nothing_is_applied_twice() {
        let (_dir, db) = failing_store().await;
        let steps = vec![
            insert("default/pod/a"),
            step(
                "ke/meta/edgehub/connect/node/connection",
                r#""cloud_connected""#,
            ),
            step("ke/meta/edged/query/default/configmap/cm", "null"),
            insert("default/pod/b"),
            insert("fail/pod/x"),
            insert("default/pod/c"),
            insert("fail/pod/y"),
            insert("default/pod/d"),
        ];
        let (outcomes, local, mut state) = batch(&db, steps).await;
        assert_eq!(outcomes, vec![Outcome::Final; 8]);
        for (key, stored) in [
            ("default/pod/a", true),
            ("default/pod/b", true),
            ("fail/pod/x", false),
            ("default/pod/c", true),
            ("fail/pod/y", false),
            ("default/pod/d", true),
        ] {
            let value = db.get(key).await.expect("get");
            assert_eq!(value.is_some(), stored, "{key}");
        }
        let sent = |topic: &str| local.iter().filter(|t| *t == topic).count();
        assert_eq!(
            sent("ke/edged/edgecontroller/insert/default/pod"),
            4,
            "{local:?}"
        );
        assert_eq!(sent("ke/cloud/meta/error/fail/pod"), 2, "{local:?}");
        let changes: Vec<String> = db.take_changes().into_iter().map(|c| c.key).collect();
        assert_eq!(
            changes,
            [
                "default/pod/a",
                "default/pod/b",
                "default/pod/c",
                "default/pod/d"
            ]
        );
        let outbox = outbox_topics(&db).await;
        let count = |part: &str| outbox.iter().filter(|t| t.contains(part)).count();
        assert_eq!(
            count("/query/"),
            1,
            "the query went to the cloud once: {outbox:?}"
        );
        assert_eq!(
            count("/response/"),
            4,
            "each stored insert acknowledged once: {outbox:?}"
        );
        let settings = Settings {
            root: "ke",
            node: "n1",
            waits: WAITS,
            outbox_limit: LIMIT,
            broker: &Publisher::channel(1).0,
            relay: false,
        };
        let cx = Context::new(&db, settings, &mut state);
        assert!(cx.connected());
        assert_eq!(cx.waiting(PendingKind::RemoteQuery).len(), 1);
    }

    /// A failure in a batch's first messages, which run with no savepoint at all.
    #[tokio::test]
    async fn a_failure_before_any_savepoint_undoes_only_its_message() {
        let (_dir, db) = failing_store().await;
        let steps = vec![
            insert("default/pod/a"),
            insert("fail/pod/x"),
            insert("default/pod/b"),
        ];
        let (outcomes, local, _) = batch(&db, steps).await;
        assert_eq!(outcomes, vec![Outcome::Final; 3]);
        assert!(db.get("default/pod/a").await.expect("get").is_some());
        assert!(db.get("fail/pod/x").await.expect("get").is_none());
        assert!(db.get("default/pod/b").await.expect("get").is_some());
        assert_eq!(
            local,
            [
                "ke/edged/edgecontroller/insert/default/pod",
                "ke/cloud/meta/error/fail/pod",
                "ke/edged/edgecontroller/insert/default/pod"
            ]
        );
        let changes: Vec<String> = db.take_changes().into_iter().map(|c| c.key).collect();
        assert_eq!(changes, ["default/pod/a", "default/pod/b"]);
    }
}
