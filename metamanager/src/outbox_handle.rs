//! The outbox's way in for whoever delivers it (the local relay, the cloud bridge) and for the
//! hand-on pump: each call is a [`Job`] for the store worker, answered after its batch.

use std::sync::Arc;

use edgemeta_broker::Message;
use tokio::sync::{mpsc, oneshot, Notify};

use crate::error::Error;
use crate::outbox::{OutboxEntry, OutboxStats, Read, Reply, Write};
use crate::unit::Job;

/// An outbox deletion handed to the store, whose outcome is read later.
pub struct PendingAck(oneshot::Receiver<Result<(), Error>>);

impl PendingAck {
    /// Waits for the deletion's commit.
    pub async fn finish(self) -> Result<(), Error> {
        self.0.await.map_err(|_| Error::Closed)?
    }
}

/// Access to the outbox for whoever delivers it (the local relay or the cloud bridge).
#[derive(Clone)]
pub struct OutboxHandle {
    jobs: mpsc::Sender<Job>,
    changed: Arc<Notify>,
}

impl OutboxHandle {
    pub(crate) fn new(jobs: mpsc::Sender<Job>, changed: Arc<Notify>) -> OutboxHandle {
        OutboxHandle { jobs, changed }
    }

    /// The oldest `limit` entries with a sequence number above `after`, oldest first.
    pub async fn peek(&self, after: i64, limit: usize) -> Result<Vec<OutboxEntry>, Error> {
        self.ask(|reply| {
            Job::Read(Read::Peek {
                after,
                limit,
                reply,
            })
        })
        .await
    }

    /// Deletes every entry up to and including `seq`, after it was delivered.
    pub async fn ack(&self, seq: i64) -> Result<(), Error> {
        self.start_ack(seq).await?.finish().await
    }

    /// Queues the deletion of every entry up to `seq` without waiting for its commit; jobs run
    /// in order, so a later [`OutboxHandle::peek`] already sees it.
    pub async fn start_ack(&self, seq: i64) -> Result<PendingAck, Error> {
        let rx = self
            .call(|reply| Job::Write(Write::Ack { seq, reply }))
            .await?;
        Ok(PendingAck(rx))
    }

    /// The oldest `limit` hand-ons with a sequence number above `after`, oldest first.
    pub async fn handon_peek(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<(i64, Message)>, Error> {
        self.ask(|reply| {
            Job::Read(Read::HandonPeek {
                after,
                limit,
                reply,
            })
        })
        .await
    }

    /// Queues the deletion of every hand-on up to `seq`, without waiting for its commit.
    pub async fn handon_start_ack(&self, seq: i64) -> Result<PendingAck, Error> {
        let rx = self
            .call(|reply| Job::Write(Write::HandonAck { seq, reply }))
            .await?;
        Ok(PendingAck(rx))
    }

    /// Queues a message another module published for the cloud; returns after the commit.
    pub async fn append(&self, topic: String, payload: Vec<u8>) -> Result<(), Error> {
        self.ask(|reply| {
            Job::Write(Write::Append {
                topic,
                payload,
                reply,
            })
        })
        .await
    }

    /// Depth, size and oldest entry of the outbox.
    pub async fn stats(&self) -> Result<OutboxStats, Error> {
        self.ask(|reply| Job::Read(Read::Stats { reply })).await
    }

    /// Depth and size from the worker's running counters, and the oldest entry: cheap enough
    /// for every scrape and health check.
    pub async fn summary(&self) -> Result<OutboxStats, Error> {
        self.ask(|reply| Job::Read(Read::Summary { reply })).await
    }

    /// Wakes when new entries may have been committed.
    pub fn changed(&self) -> Arc<Notify> {
        self.changed.clone()
    }

    /// Hands the worker a job carrying a reply channel; the receiver yields its result.
    async fn call<T>(
        &self,
        job: impl FnOnce(Reply<T>) -> Job,
    ) -> Result<oneshot::Receiver<Result<T, Error>>, Error> {
        let (reply, rx) = oneshot::channel();
        self.jobs
            .send(job(reply))
            .await
            .map_err(|_| Error::Closed)?;
        Ok(rx)
    }

    /// [`OutboxHandle::call`], then waits for the result.
    async fn ask<T>(&self, job: impl FnOnce(Reply<T>) -> Job) -> Result<T, Error> {
        self.call(job).await?.await.map_err(|_| Error::Closed)?
    }
}
