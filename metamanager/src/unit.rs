//! The unit of work: what the store worker is handed ([`Job`]), the message it applies, undone
//! alone if it fails ([`Work`]), everything a handler may touch while doing so ([`Context`]), and the
//! state the MetaManager keeps besides the store ([`State`]). The worker and the handlers import
//! this module; it imports neither.

use std::collections::HashMap;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use bytes::Bytes;
use edgemeta_broker::{Ack, Message, Publisher};
use serde_json::value::RawValue;
use tokio::sync::oneshot;
use tokio_util::time::{delay_queue, DelayQueue};

use crate::devices::Event;
use crate::error::Error;
use crate::outbox::{self, OutboxLimit, Read, Write};
use crate::request::{Request, Requester};
use crate::store::{Db, OutboxStats};
use edgemeta_protocol::Envelope;
use edgemeta_protocol::Operation;
use edgemeta_protocol::{outbound, CLOUD};

/// Fired once a message has been dealt with: committed, or answered with an error.
#[derive(Debug)]
pub(crate) enum Done {
    /// An in-process sender (the cloud bridge) waits for the outcome.
    Told(oneshot::Sender<Outcome>),
    /// A client's publish: dropping the promise sends its PUBACK (protocol §6.5).
    Acked(Ack),
}

impl Done {
    /// Tells whoever waits how the message ended.
    pub(crate) fn send(self, outcome: Outcome) {
        match self {
            Done::Told(tx) => drop(tx.send(outcome)),
            Done::Acked(ack) => drop(ack),
        }
    }

    /// Who waits: a connection, or the cloud bridge (one sender, whatever its messages).
    pub(crate) fn sender(&self) -> usize {
        match self {
            Done::Told(_) => 0,
            Done::Acked(ack) => ack.sender(),
        }
    }

    /// The client's socket its acknowledgement may be written into by the thread releasing it
    /// ([`edgemeta_broker::Ack::socket`]).
    pub(crate) fn socket(&self) -> Option<usize> {
        match self {
            Done::Told(_) => None,
            Done::Acked(ack) => ack.socket(),
        }
    }

    /// What `kept` holds for the client goes out with its acknowledgement, in one write
    /// ([`edgemeta_broker::Ack::send_with`]).
    pub(crate) fn send_with(&self, kept: edgemeta_broker::Kept) {
        match self {
            Done::Told(_) => drop(kept),
            Done::Acked(ack) => ack.send_with(kept),
        }
    }

    /// How soon after its previous acknowledgement a client sent this, with nothing else
    /// waiting for one ([`edgemeta_broker::Ack::after_ack`]); the cloud bridge pipelines.
    pub(crate) fn after_ack(&self) -> Option<std::time::Duration> {
        match self {
            Done::Told(_) => None,
            Done::Acked(ack) => ack.after_ack(),
        }
    }

    /// Committed, but its commit may not be durable (a failed sync): no acknowledgement, so the
    /// sender delivers it again.
    pub(crate) fn refuse(self) {
        match self {
            Done::Told(tx) => drop(tx.send(Outcome::Retry)),
            Done::Acked(ack) => ack.abandon(),
        }
    }
}

/// How a message submitted through [`crate::Ingress`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Committed, or refused for good with an error reply: the sender may forget it.
    Final,
    /// Refused for now (outbox full, a failed commit): the sender should deliver it again later.
    Retry,
}

impl Outcome {
    pub(crate) fn of(error: &Error) -> Outcome {
        if error.is_temporary() {
            Outcome::Retry
        } else {
            Outcome::Final
        }
    }
}

/// A message the worker applies: a parsed `<root>/meta/...` request, or a device message.
#[derive(Debug)]
pub(crate) enum Work {
    Request(Box<Request>),
    Device(Box<Event>),
    /// A device message from the node's DMI server, which hears whether it was stored.
    Report(Box<Report>),
}

/// A device message whose sender waits for more than the commit: whether it was refused.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) event: Event,
    /// Set once applied: `None` stored, else the refusal's code and reason. Read after the
    /// commit ([`Outcome::Final`]); unset then, the message failed.
    pub(crate) verdict: std::sync::Arc<std::sync::OnceLock<Option<(u16, String)>>>,
}

/// The counter row a message is counted in (`edgemeta_messages_total` by operation,
/// `edgemeta_device_messages_total` by family).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    Operation(Operation),
    Device(usize),
}

impl Work {
    pub(crate) fn counted(&self) -> Counted {
        match self {
            Work::Request(request) => Counted::Operation(request.operation),
            Work::Device(event) => Counted::Device(event.family),
            Work::Report(report) => Counted::Device(report.event.family),
        }
    }
}

/// Work for the store worker.
pub(crate) enum Job {
    /// A message, and whom to tell once it is committed.
    Apply(Work, Option<Done>),
    /// An outbox change, committed with the batch it arrives in.
    Write(Write),
    /// An outbox read, answered after that batch.
    Read(Read),
}

/// One unit of a batch, in arrival order.
pub(crate) enum Step {
    Apply(Work, Option<Done>),
    Expired(String),
    SyncPodStatus,
}

/// State the MetaManager keeps besides the store; owned by the store worker.
pub(crate) struct State {
    /// Whether the cloud link is up (§4); starts down.
    connected: bool,
    /// Requests waiting for another module's answer, by the id that answer will carry as parent.
    pending: HashMap<String, Pending>,
    expiries: DelayQueue<String>,
    /// What waits in the outbox, kept in step with every push and acknowledgement.
    outbox: OutboxStats,
    /// Whether clients subscribe to the topics asked about, until a subscription changes.
    heard: edgemeta_broker::Heard,
}

/// A request waiting for an answer from the cloud (remote query) or from edged (volume call).
pub(crate) struct Pending {
    pub(crate) kind: PendingKind,
    pub(crate) request: Request,
    expiry: delay_queue::Key,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PendingKind {
    RemoteQuery,
    Volume,
}

impl State {
    /// Starts disconnected, with nothing pending and the outbox as `outbox` says.
    pub(crate) fn new(outbox: OutboxStats) -> State {
        State {
            connected: false,
            pending: HashMap::new(),
            expiries: DelayQueue::new(),
            outbox,
            heard: edgemeta_broker::Heard::default(),
        }
    }

    /// The outbox's running counters.
    pub(crate) fn outbox(&mut self) -> &mut OutboxStats {
        &mut self.outbox
    }

    /// The id of the next pending request that ran out of time.
    pub(crate) fn poll_expired(&mut self, cx: &mut TaskContext<'_>) -> Poll<Option<String>> {
        self.expiries
            .poll_expired(cx)
            .map(|expired| expired.map(|e| e.into_inner()))
    }
}

/// Timeouts for requests that wait on another module.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Waits {
    pub(crate) remote_query: Duration,
    pub(crate) volume: Duration,
}

/// What the worker's configuration gives every handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings<'a> {
    pub(crate) root: &'a str,
    /// This node's name (`cloud.node_id`): devices' membership topics carry it.
    pub(crate) node: &'a str,
    pub(crate) waits: Waits,
    pub(crate) outbox_limit: OutboxLimit,
    /// The node's link to the local broker: who subscribes to what.
    pub(crate) broker: &'a Publisher,
    /// Standalone: the outbox is relayed to the local broker, not carried to a cloud.
    pub(crate) relay: bool,
}

/// Everything a handler may touch, borrowed field by field so the open transaction (which
/// borrows the store) can live beside it.
pub(crate) struct Context<'a> {
    db: &'a Db,
    settings: Settings<'a>,
    state: &'a mut State,
    /// Local messages to publish after the commit.
    local: Vec<Message>,
    /// Whether anything was queued in the outbox.
    outbox_written: bool,
    /// Whether a device message was answered with an error result (bad input, nothing stored).
    refused: bool,
    /// The last refusal's code and reason, for a sender that waits for it ([`Report`]).
    refusal: Option<(u16, String)>,
    /// It changed what undoing its store changes would not undo ([`Effects::unrepeatable`]).
    unrepeatable: bool,
}

/// What applying one message left behind.
pub(crate) struct Effects {
    /// Local messages to publish after the commit.
    pub(crate) local: Vec<Message>,
    /// Whether anything was queued in the outbox.
    pub(crate) outbox_written: bool,
    /// Whether the message was answered with an error result (bad input, nothing stored).
    pub(crate) refused: bool,
    /// It changed state outside the store (a wait, the link state, a report's verdict), so it
    /// must not be applied a second time.
    pub(crate) unrepeatable: bool,
}

impl<'a> Context<'a> {
    pub(crate) fn new(db: &'a Db, settings: Settings<'a>, state: &'a mut State) -> Context<'a> {
        Context {
            db,
            settings,
            state,
            local: Vec::new(),
            outbox_written: false,
            refused: false,
            refusal: None,
            unrepeatable: false,
        }
    }

    /// Records why a device message was refused (its error result says the same).
    pub(crate) fn note_refusal(&mut self, code: u16, reason: &str) {
        self.refusal = Some((code, reason.to_owned()));
    }

    /// Marks the message as having changed something outside the store.
    pub(crate) fn unrepeatable(&mut self) {
        self.unrepeatable = true;
    }

    /// The refusal noted while applying this message, if any.
    pub(crate) fn refusal(&self) -> Option<(u16, String)> {
        self.refusal.clone()
    }

    /// What the message left behind, once applied.
    pub(crate) fn finish(self) -> Effects {
        Effects {
            local: self.local,
            outbox_written: self.outbox_written,
            refused: self.refused,
            unrepeatable: self.unrepeatable,
        }
    }

    pub(crate) fn db(&self) -> &'a Db {
        self.db
    }

    pub(crate) fn root(&self) -> &'a str {
        self.settings.root
    }

    pub(crate) fn node(&self) -> &'a str {
        self.settings.node
    }

    pub(crate) fn waits(&self) -> Waits {
        self.settings.waits
    }

    /// Whether the cloud link is up.
    pub(crate) fn connected(&self) -> bool {
        self.state.connected
    }

    /// Records the cloud link going up or down; says whether it was up.
    pub(crate) fn set_connected(&mut self, connected: bool) -> bool {
        self.unrepeatable = true;
        std::mem::replace(&mut self.state.connected, connected)
    }

    /// Whether a client subscribes to the device topic `topic` (`$hw/...`) now: what nobody
    /// hears is dropped at the commit ([`crate::handon::unheard`]), so it need not be built.
    pub(crate) fn heard(&mut self, topic: &str) -> bool {
        self.settings
            .broker
            .reaches_anyone_heard(topic, &mut self.state.heard)
    }

    /// Publishes `message` after the commit.
    pub(crate) fn publish(&mut self, message: Message) {
        self.local.push(message);
    }

    /// Publishes `message` after the commit, and counts the message as refused.
    pub(crate) fn refuse(&mut self, message: Message) {
        self.refused = true;
        self.local.push(message);
    }

    /// Sends an envelope to `module`: cloud-bound messages go into the outbox (same transaction),
    /// the rest are published after the commit.
    pub(crate) async fn send(
        &mut self,
        module: &str,
        from: &str,
        envelope: &Envelope,
    ) -> Result<(), Error> {
        let topic = outbound(
            self.settings.root,
            module,
            from,
            &envelope.route.operation,
            &envelope.route.resource,
        );
        if module != CLOUD {
            self.local.push(Message::new(topic, envelope.to_bytes()));
            return Ok(());
        }
        if !self.cloud_hears(&topic) {
            return Ok(());
        }
        self.append_for_cloud(&topic, &envelope.to_bytes()).await
    }

    /// Appends what `payload` builds to the outbox in the batch's transaction (see
    /// [`outbox::append`]); built only when the row would reach anyone.
    pub(crate) async fn queue_for_cloud(
        &mut self,
        topic: &str,
        payload: impl FnOnce() -> Vec<u8>,
    ) -> Result<(), Error> {
        if !self.cloud_hears(topic) {
            return Ok(());
        }
        self.append_for_cloud(topic, &payload()).await
    }

    /// Whether an outbox row for `topic` reaches anyone. Standalone, a row is relayed to
    /// whoever subscribes to its topic when it goes out, and deleted: one nobody subscribes to
    /// now would only cost a write, a read and a delete, so it is neither built nor written.
    fn cloud_hears(&mut self, topic: &str) -> bool {
        !self.settings.relay
            || self
                .settings
                .broker
                .reaches_anyone_heard(topic, &mut self.state.heard)
    }

    async fn append_for_cloud(&mut self, topic: &str, payload: &[u8]) -> Result<(), Error> {
        outbox::append(
            self.db,
            &mut self.state.outbox,
            self.settings.outbox_limit,
            topic,
            payload,
        )
        .await?;
        self.outbox_written = true;
        Ok(())
    }

    /// Answers `requester` (and its v5 Response Topic) with `operation` and `content`; an
    /// answer nobody would get is not built, its content included.
    pub(crate) async fn reply(
        &mut self,
        requester: &Requester,
        operation: Operation,
        content: impl FnOnce() -> Box<RawValue>,
    ) -> Result<(), Error> {
        let module = requester.module();
        let topic = requester.topic(self.settings.root, operation);
        let to_module = module != CLOUD || self.cloud_hears(&topic);
        if !to_module && requester.response_topic.is_none() {
            return Ok(());
        }
        let payload = Bytes::from(requester.envelope(operation, content()).to_bytes());
        if let Some(copy) = requester.v5_copy(&payload) {
            self.local.push(copy);
        }
        match (to_module, module == CLOUD) {
            (false, _) => Ok(()),
            (true, true) => self.append_for_cloud(&topic, &payload).await,
            (true, false) => {
                self.local.push(Message::new(topic, payload));
                Ok(())
            }
        }
    }

    /// Waits for the answer carrying `id` as its parent, at most `timeout`.
    pub(crate) fn wait_for(
        &mut self,
        id: String,
        kind: PendingKind,
        request: &Request,
        timeout: Duration,
    ) {
        self.unrepeatable = true;
        let expiry = self.state.expiries.insert(id.clone(), timeout);
        let pending = Pending {
            kind,
            request: request.clone(),
            expiry,
        };
        self.state.pending.insert(id, pending);
    }

    /// The request waiting for `id`, no longer waiting.
    pub(crate) fn take_pending(&mut self, id: &str) -> Option<Pending> {
        let pending = self.state.pending.remove(id)?;
        self.unrepeatable = true;
        self.state.expiries.remove(&pending.expiry);
        Some(pending)
    }

    /// The request whose wait for `id` ran out (its timer is gone already).
    pub(crate) fn expired(&mut self, id: &str) -> Option<Pending> {
        self.unrepeatable = true;
        self.state.pending.remove(id)
    }

    /// The ids of requests waiting for an answer of `kind`.
    pub(crate) fn waiting(&self, kind: PendingKind) -> Vec<String> {
        self.state
            .pending
            .iter()
            .filter(|(_, p)| p.kind == kind)
            .map(|(id, _)| id.clone())
            .collect()
    }
}
