//! Broker link → parsed requests: checks topic, size and envelope, answers what is malformed
//! and hands the rest to the store worker. Parsing happens here, on the tokio side (for a
//! client's publish on that client's own task), so the store thread only sees well-formed work.

use std::borrow::Cow;
use std::sync::{Arc, PoisonError, RwLock};

use edgemeta_broker::is_carried;
use edgemeta_broker::stages::{self, Stage};
use edgemeta_broker::{Later, Message, Publisher, Take, Taken};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::devices::{self, Event};
use crate::error::Error;
use crate::handlers;
use crate::meters::{self, Meters};
use crate::reply::{code_of, error_reply, Asker};
use crate::request::{Request, Requester};
use crate::unit::{Done, Job, Outcome, Work};
use edgemeta_protocol::Operation;
use edgemeta_protocol::{is_name, Resource};
use edgemeta_protocol::{Envelope, ObjectMeta};
use edgemeta_protocol::{InboundTopic, META};

/// Limits and names the intake needs.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    pub root: String,
    /// This node's name (`cloud.node_id`).
    pub node: String,
    pub max_payload_bytes: usize,
    /// Counts the messages refused here.
    pub meters: Arc<Meters>,
}

/// A message handed in by another in-process component (the cloud bridge), with the signal to
/// fire once it is committed or refused.
pub(crate) type Submission = (Message, tokio::sync::oneshot::Sender<Outcome>);

/// The intake run on the publishing client's own task ([`Take`]): a well-formed message goes
/// straight into the store worker's queue, with no hand-off to the intake task. A full queue
/// or a refusal to answer is left for that client's task to await, so its messages keep
/// their order.
pub(crate) struct Taker {
    config: IntakeConfig,
    /// The worker's queue, and the publisher refusals are answered through; `None` once
    /// intake stops (what reaches the link then goes to its inbox). Dropped then, as the
    /// publisher holds the hub, which holds this.
    open: RwLock<Option<(mpsc::Sender<Job>, Publisher)>>,
}

impl Taker {
    pub(crate) fn new(config: IntakeConfig, jobs: mpsc::Sender<Job>, publisher: Publisher) -> Self {
        Taker {
            config,
            open: RwLock::new(Some((jobs, publisher))),
        }
    }

    /// Takes nothing more; its job sender is dropped, so the worker can end.
    fn close(&self) {
        self.open
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }
}

impl Take for Taker {
    fn take(&self, message: Message) -> Taken {
        let open = self.open.read().unwrap_or_else(PoisonError::into_inner);
        let Some((jobs, publisher)) = open.as_ref() else {
            return Taken::Back(message);
        };
        let (message, done) = from_link(message);
        let later: Later = match examine(&self.config, &message) {
            Examined::Work(work) => match jobs.try_send(Job::Apply(work, done)) {
                Ok(()) => return Taken::Done,
                Err(mpsc::error::TrySendError::Full(job)) => {
                    let jobs = jobs.clone();
                    Box::pin(async move {
                        queue(&jobs, job).await;
                    })
                }
                Err(mpsc::error::TrySendError::Closed(job)) => {
                    unqueued(job);
                    return Taken::Done;
                }
            },
            Examined::Final => {
                if let Some(done) = done {
                    done.send(Outcome::Final);
                }
                return Taken::Done;
            }
            Examined::Refused(replies) => {
                let publisher = publisher.clone();
                Box::pin(async move {
                    answer(&publisher, replies, done).await;
                })
            }
        };
        Taken::Later(later)
    }
}

/// A job the worker is gone for: its sender is not acknowledged, so it delivers it again.
fn unqueued(job: Job) {
    if let Job::Apply(_, Some(done)) = job {
        done.refuse();
    }
}

/// Queues `job` once the worker has room; `false` once the worker is gone.
async fn queue(jobs: &mpsc::Sender<Job>, job: Job) -> bool {
    match jobs.send(job).await {
        Ok(()) => true,
        Err(mpsc::error::SendError(job)) => {
            unqueued(job);
            false
        }
    }
}

/// Tells a refused message's sender why, then that it is final; `false` once the link is gone.
async fn answer(publisher: &Publisher, replies: Vec<Message>, done: Option<Done>) -> bool {
    for reply in replies {
        if publisher.publish(reply).await.is_err() {
            return false;
        }
    }
    if let Some(done) = done {
        done.send(Outcome::Final);
    }
    true
}

/// Reads the link and the submissions until cancelled; then takes what is already queued, so
/// nothing handed over is dropped, and returns (dropping its job sender, and the taker's, lets
/// the worker finish).
pub(crate) async fn run(
    config: IntakeConfig,
    inbox: mpsc::Receiver<Message>,
    submissions: mpsc::Receiver<Submission>,
    jobs: mpsc::Sender<Job>,
    (taker, publisher): (Arc<Taker>, Publisher),
    cancel: CancellationToken,
) {
    read(
        &config,
        inbox,
        submissions,
        &jobs,
        &publisher,
        &taker,
        cancel,
    )
    .await;
    taker.close();
}

async fn read(
    config: &IntakeConfig,
    mut inbox: mpsc::Receiver<Message>,
    mut submissions: mpsc::Receiver<Submission>,
    jobs: &mpsc::Sender<Job>,
    publisher: &Publisher,
    taker: &Taker,
    cancel: CancellationToken,
) {
    loop {
        let (message, done) = tokio::select! {
            _ = cancel.cancelled() => break,
            message = inbox.recv() => match message {
                Some(message) => from_link(message),
                None => return,
            },
            Some((message, done)) = submissions.recv() => (message, Some(Done::Told(done))),
        };
        if !intake(config, message, done, jobs, publisher).await {
            return;
        }
    }
    // From here on the link's messages come to the inbox, which is read to its end below.
    taker.close();
    while let Ok((message, done)) = submissions.try_recv() {
        if !intake(config, message, Some(Done::Told(done)), jobs, publisher).await {
            return;
        }
    }
    while let Ok(message) = inbox.try_recv() {
        let (message, done) = from_link(message);
        if !intake(config, message, done, jobs, publisher).await {
            return;
        }
    }
}

/// A message from the broker, and the PUBACK its publisher waits for (sent once it is done).
fn from_link(mut message: Message) -> (Message, Option<Done>) {
    let done = message.ack.take().map(Done::Acked);
    (message, done)
}

/// What intake makes of one message.
enum Examined {
    /// Work for the store worker.
    Work(Work),
    /// Nothing to do but say so (nobody to answer, or our own result coming back).
    Final,
    /// Refused: these replies tell its sender.
    Refused(Vec<Message>),
}

/// Checks and parses one message; no I/O, so it runs on whichever task has the message.
fn examine(config: &IntakeConfig, message: &Message) -> Examined {
    let _intake = stages::enter(Stage::Intake);
    match device_event(config, message) {
        Some(Ok(event)) => return Examined::Work(Work::Device(Box::new(event))),
        Some(Err(reply)) => return Examined::Refused(reply.into_iter().collect()),
        None => {}
    }
    match parse(config, message) {
        Ok(Some(request)) => Examined::Work(Work::Request(Box::new(request))),
        Ok(None) => Examined::Final,
        Err(refused) => {
            config
                .meters
                .messages(refused.operation, meters::Outcome::Refused, 1);
            Examined::Refused(refused.replies(&config.root))
        }
    }
}

/// Handles one message on the intake task; `false` once the worker is gone.
async fn intake(
    config: &IntakeConfig,
    message: Message,
    done: Option<Done>,
    jobs: &mpsc::Sender<Job>,
    publisher: &Publisher,
) -> bool {
    match examine(config, &message) {
        Examined::Work(work) => queue(jobs, Job::Apply(work, done)).await,
        Examined::Final => {
            if let Some(done) = done {
                done.send(Outcome::Final);
            }
            true
        }
        Examined::Refused(replies) => answer(publisher, replies, done).await,
    }
}

/// A device message (a mapper's `$hw`/`$ke` topic, or the devicecontroller's membership and
/// twins), `None` for any other; an oversized one is refused with the reply its sender reads.
fn device_event(
    config: &IntakeConfig,
    message: &Message,
) -> Option<Result<Event, Option<Message>>> {
    let topic = &message.topic;
    if let Some((family, id)) = handlers::classify(topic) {
        let event = Event {
            family,
            id,
            topic: topic.clone(),
            payload: message.payload.clone(),
            ack: None,
        };
        if message.payload.len() > config.max_payload_bytes {
            let error = Error::PayloadTooLarge {
                size: message.payload.len(),
                limit: config.max_payload_bytes,
            };
            warn!(error_code = error.code(), topic = %event.topic, error = %error, "device message refused");
            config
                .meters
                .device_messages(event.family, meters::Outcome::Refused, 1);
            let work = Work::Device(Box::new(event));
            let reply = handlers::failure_reply(&config.root, &config.node, &work, &error);
            return Some(Err(reply.into_iter().next()));
        }
        return Some(Ok(event));
    }
    if is_carried(message.topic.as_bytes()) {
        // Our own results and deltas, back through the link's broad `$hw/events/#` filter.
        return Some(Err(None));
    }
    let inbound = InboundTopic::parse(&config.root, &message.topic).ok()?;
    if inbound.from != devices::DEVICECONTROLLER || message.payload.len() > config.max_payload_bytes
    {
        return None;
    }
    let mut levels = inbound.resource.splitn(3, '/');
    let (namespace, res_type) = (levels.next()?, levels.next()?);
    let envelope = Envelope::parse(&message.payload).ok()?;
    let name = match levels.next() {
        Some(name) => Some(name.to_owned()),
        None => Resource::parse(&envelope.route.resource)
            .ok()
            .filter(|r| r.namespace() == namespace && r.res_type() == res_type)
            .and_then(|r| r.id().map(str::to_owned)),
    };
    let (family, id) =
        handlers::classify_cloud(inbound.operation, namespace, res_type, name.as_deref())?;
    Some(Ok(Event {
        family,
        id,
        topic: message.topic.clone(),
        payload: bytes::Bytes::copy_from_slice(envelope.content.get().as_bytes()),
        ack: Some((
            envelope.header.msg_id.clone(),
            envelope.route.resource.clone(),
        ))
        .filter(|(id, _)| !id.is_empty()),
    }))
}

/// A message that cannot be applied, and whom to tell.
#[derive(Debug)]
pub struct Refused {
    pub requester: Requester,
    pub error: Error,
    /// The topic's operation, when it is one.
    pub operation: Option<Operation>,
}

impl Refused {
    /// What the sender hears: an `error` reply on its reply topic (and its v5 Response Topic).
    pub fn replies(&self, root: &str) -> Vec<Message> {
        let asker = Asker::Requester(&self.requester);
        error_reply(root, asker, code_of(&self.error), &self.error.to_string())
    }
}

/// A request, `None` for a message nobody can be answered about, or why it is refused.
pub fn parse(config: &IntakeConfig, message: &Message) -> Result<Option<Request>, Box<Refused>> {
    let topic = match InboundTopic::parse(&config.root, &message.topic) {
        Ok(topic) => topic,
        Err(e) => {
            warn!(error_code = "EM-META-TOPIC", topic = %message.topic, error = %e, "message dropped: no sender to answer");
            return Ok(None);
        }
    };
    if topic.from == META {
        debug!(topic = %message.topic, "ignored a message that claims to come from the MetaManager");
        return Ok(None);
    }
    let mut requester = Requester {
        from: topic.from.to_owned(),
        resource: topic.resource.to_owned(),
        msg_id: None,
        group: "resource".to_owned(),
        response_topic: message.response_topic.clone(),
        correlation: message.correlation.clone(),
    };
    let checked = (|| {
        if message.payload.len() > config.max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                size: message.payload.len(),
                limit: config.max_payload_bytes,
            });
        }
        let operation = topic
            .operation()
            .ok_or_else(|| Error::UnsupportedOperation(topic.operation.to_owned()))?;
        let resource = topic.resource()?;
        Ok((operation, resource))
    })();
    let (operation, resource) = match checked {
        Ok(parts) => parts,
        Err(error) => {
            // A payload within the limit may still name the request it carries.
            if !matches!(error, Error::PayloadTooLarge { .. }) {
                requester.msg_id = edgemeta_protocol::sender_msg_id(&message.payload);
            }
            return Err(refuse(requester, error, topic.operation));
        }
    };
    // Ids of a malformed envelope are unknown, so its error reply has no parent id.
    let envelope = match Envelope::parse(&message.payload) {
        Ok(envelope) => envelope,
        Err(e) => {
            requester.resource = resource.key().to_owned();
            return Err(refuse(requester, Error::Envelope(e), topic.operation));
        }
    };
    match named(operation, resource, &envelope) {
        Ok(resource) => Ok(Some(Request::new(
            topic.from, operation, resource, envelope, message,
        ))),
        Err((error, about)) => {
            // The envelope was read: the reply names the request, as a worker's error would.
            requester.resource = about;
            requester.msg_id = Some(envelope.header.msg_id);
            if !envelope.route.group.is_empty() {
                requester.group = envelope.route.group;
            }
            Err(refuse(requester, error, topic.operation))
        }
    }
}

/// The resource a message is about (protocol §2, v2). A topic with a `<name>` level wins whole,
/// as in v1. A type-level topic gives namespace and type; the name comes from a full envelope's
/// `route.resource`, else from `content.metadata.name`. A refusal also gives the resource its
/// reply names: with the name, when one was found.
fn named(
    operation: Operation,
    topic: Resource,
    envelope: &Envelope,
) -> Result<Resource, (Error, String)> {
    if topic.id().is_some() {
        return Ok(topic);
    }
    // One pass over the content for both fields, and only for type-level topics.
    let meta = ObjectMeta::of(&envelope.content);
    let from_route = Resource::parse(&envelope.route.resource)
        .ok()
        .and_then(|r| r.id().filter(|id| is_name(id)).map(str::to_owned));
    let name = match (from_route, meta.name) {
        (Some(name), _) => Some(Ok(Cow::Owned(name))),
        (None, Some(name)) if is_name(&name) => Some(Ok(name)),
        (None, Some(invalid)) => Some(Err(invalid)),
        (None, None) => None,
    };
    let (resource, refusal) = match name {
        Some(Ok(name)) => {
            let named = Resource::from_parts(topic.namespace(), topic.res_type(), &name)
                .map_err(|e| (Error::from(e), topic.key().to_owned()))?;
            (named, None)
        }
        Some(Err(invalid)) => {
            let metadata_name = Some(invalid.into_owned());
            (topic, Some(Error::NoName { metadata_name }))
        }
        None if operation.needs_name() => (
            topic,
            Some(Error::NoName {
                metadata_name: None,
            }),
        ),
        // A list query, or an operation on the type (connection signal, sync, answers, volumes).
        None => (topic, None),
    };
    // An empty namespace is Kubernetes' "not set" (cluster-scoped objects).
    if let Some(namespace) = meta.namespace.filter(|ns| !ns.is_empty()) {
        if namespace != resource.namespace() {
            let error = Error::NamespaceMismatch {
                topic: resource.namespace().to_owned(),
                content: namespace.into_owned(),
            };
            return Err((error, resource.key().to_owned()));
        }
    }
    match refusal {
        Some(error) => Err((error, resource.key().to_owned())),
        None => Ok(resource),
    }
}

fn refuse(requester: Requester, error: Error, operation: &str) -> Box<Refused> {
    warn!(
        error_code = error.code(),
        from = %requester.from,
        resource = %requester.resource,
        operation,
        error = %error,
        "message refused"
    );
    Box::new(Refused {
        requester,
        error,
        operation: Operation::parse(operation),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the sender hears why its message was refused.
    fn error_topic(who: &Requester) -> String {
        who.topic("ke", crate::Operation::Error)
    }

    fn config() -> IntakeConfig {
        IntakeConfig {
            root: "ke".into(),
            node: "n1".into(),
            max_payload_bytes: 64,
            meters: Arc::new(Meters::noop()),
        }
    }

    fn refused(topic: &str, payload: &[u8]) -> (Requester, Error) {
        let refused = parse(&config(), &Message::new(topic, payload.to_vec())).unwrap_err();
        (refused.requester, refused.error)
    }

    #[test]
    fn a_bare_payload_becomes_a_request_routed_by_the_topic() {
        let m = Message::new(
            "ke/meta/edgecontroller/insert/default/configmap/cfg",
            &br#"{"data":{"k":"v"}}"#[..],
        );
        let r = parse(&config(), &m).unwrap().unwrap();
        assert_eq!(r.requester.from, "edgecontroller");
        assert_eq!(r.envelope.route.operation, "insert");
        assert_eq!(r.envelope.route.resource, "default/configmap/cfg");
        assert_eq!(r.envelope.route.group, "resource");
        assert_eq!(r.envelope.content.get(), r#"{"data":{"k":"v"}}"#);
    }

    #[test]
    fn the_topic_wins_over_the_envelope_route() {
        let payload = br#"{"header":{"msg_id":"m"},"route":{"source":"edged","operation":"delete","resource":"x/y/z","group":"meta"},"content":1}"#;
        let m = Message::new("ke/meta/edgecontroller/insert/default/pod/p", &payload[..]);
        let r = parse(
            &IntakeConfig {
                max_payload_bytes: 1024,
                ..config()
            },
            &m,
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.envelope.route.source, "edgecontroller");
        assert_eq!(r.envelope.route.operation, "insert");
        assert_eq!(r.envelope.route.resource, "default/pod/p");
        assert_eq!(r.envelope.route.group, "meta");
        assert_eq!(r.requester.msg_id.as_deref(), Some("m"));
    }

    #[test]
    fn unaddressable_topics_and_our_own_messages_are_dropped_quietly() {
        for topic in [
            "ke/meta",
            "ke/meta/edged",
            "other/meta/edged/insert/a/b",
            "ke/meta/meta/insert/a/b",
        ] {
            assert!(
                parse(&config(), &Message::new(topic, &b"1"[..]))
                    .unwrap()
                    .is_none(),
                "{topic}"
            );
        }
    }

    #[test]
    fn an_unknown_operation_is_answered_on_the_senders_error_topic() {
        let (who, e) = refused("ke/meta/edged/frobnicate/default/pod/x", b"{}");
        assert_eq!(e.to_string(), "unsupported operation \"frobnicate\"");
        assert_eq!(error_topic(&who), "ke/edged/meta/error/default/pod");
        assert_eq!(who.resource, "default/pod/x");
    }

    #[test]
    fn bad_resource_shapes_are_answered_with_the_shape_wanted() {
        let (who, e) = refused("ke/meta/device/insert/a/b/c/d", b"{}");
        assert_eq!(
            e.to_string(),
            "invalid resource \"a/b/c/d\": want <namespace>/<type>[/<id>]"
        );
        // The topic keeps at most two levels of what the sender gave; the reply's route all.
        assert_eq!(error_topic(&who), "ke/device/meta/error/a/b");
        assert_eq!(who.resource, "a/b/c/d");
        let (who, e) = refused("ke/meta/device/insert/pod", b"{}");
        assert!(matches!(e, Error::InvalidResource(_)));
        assert_eq!(error_topic(&who), "ke/device/meta/error/pod");
    }

    #[test]
    fn oversized_payloads_are_refused_before_parsing() {
        let (_, e) = refused("ke/meta/edged/insert/default/pod/x", &[b'1'; 65]);
        assert_eq!(
            e.to_string(),
            "payload of 65 bytes exceeds the limit of 64 bytes"
        );
    }

    #[test]
    fn binary_and_malformed_envelopes_are_refused() {
        let (_, e) = refused("ke/meta/edged/insert/default/pod/x", &[0xff, 0x00, 0x81]);
        assert_eq!(e.code(), "EM-META-PAYLOAD-BINARY");
        let (_, e) = refused(
            "ke/meta/edged/insert/default/pod/x",
            br#"{"header":1,"route":{}}"#,
        );
        assert_eq!(e.code(), "EM-META-ENVELOPE");
    }

    #[test]
    fn cloud_senders_are_answered_through_the_cloud_module() {
        let (who, _) = refused("ke/meta/edgecontroller/nope/default/pod/x", b"");
        assert_eq!(error_topic(&who), "ke/cloud/meta/error/default/pod");
    }

    fn request(topic: &str, payload: &str) -> Request {
        let config = IntakeConfig {
            max_payload_bytes: 1024,
            ..config()
        };
        parse(&config, &Message::new(topic, payload.as_bytes().to_vec()))
            .unwrap()
            .unwrap()
    }

    fn refused_v2(topic: &str, payload: &str) -> (Requester, Error) {
        let config = IntakeConfig {
            max_payload_bytes: 1024,
            ..config()
        };
        let refused =
            parse(&config, &Message::new(topic, payload.as_bytes().to_vec())).unwrap_err();
        (refused.requester, refused.error)
    }

    #[test]
    fn a_bare_payload_on_a_type_level_topic_is_named_by_its_metadata() {
        let r = request(
            "ke/meta/edgecontroller/insert/default/pod",
            r#"{"metadata":{"namespace":"default","name":"web"},"spec":{}}"#,
        );
        assert_eq!(r.resource.key(), "default/pod/web");
        assert_eq!(r.envelope.route.resource, "default/pod/web");
        assert_eq!(r.requester.resource, "default/pod/web");
        assert_eq!(
            r.requester.topic("ke", crate::Operation::Response),
            "ke/cloud/meta/response/default/pod"
        );
    }

    #[test]
    fn a_full_envelope_on_a_type_level_topic_is_named_by_its_route() {
        // The route's name wins over metadata.name; the topic wins for namespace and type.
        let r = request(
            "ke/meta/edgecontroller/update/default/pod",
            r#"{"header":{"msg_id":"m"},"route":{"resource":"other/secret/a"},"content":{"metadata":{"name":"b"}}}"#,
        );
        assert_eq!(r.resource.key(), "default/pod/a");
        assert_eq!(r.envelope.route.resource, "default/pod/a");
        // A route without exactly three good levels gives no name: metadata.name does.
        for route in ["default/pod", "a/b/c/d", "", "default/pod/x+y"] {
            let payload = format!(
                r#"{{"header":{{}},"route":{{"resource":"{route}"}},"content":{{"metadata":{{"name":"b"}}}}}}"#
            );
            let r = request("ke/meta/edged/update/default/pod", &payload);
            assert_eq!(r.resource.key(), "default/pod/b", "{route:?}");
        }
    }

    #[test]
    fn a_name_level_in_the_topic_wins_over_the_envelope_and_the_metadata() {
        let r = request(
            "ke/meta/edgecontroller/insert/default/pod/t",
            r#"{"header":{},"route":{"resource":"default/pod/r"},"content":{"metadata":{"name":"m","namespace":"elsewhere"}}}"#,
        );
        assert_eq!(r.resource.key(), "default/pod/t");
    }

    #[test]
    fn a_namespace_the_topic_contradicts_is_refused() {
        let payload = r#"{"header":{"msg_id":"m9"},"route":{"group":"g"},"content":{"metadata":{"name":"web","namespace":"kube-system"}}}"#;
        let (who, e) = refused_v2("ke/meta/edged/insert/default/pod", payload);
        assert_eq!(e.code(), "EM-META-NAMESPACE");
        assert_eq!(
            e.to_string(),
            "namespace mismatch: the topic names namespace \"default\", content.metadata.namespace is \"kube-system\""
        );
        assert_eq!(error_topic(&who), "ke/edged/meta/error/default/pod");
        assert_eq!(who.resource, "default/pod/web");
        assert_eq!(who.msg_id.as_deref(), Some("m9"));
        assert_eq!(who.group, "g");
        // Also for operations that need no name; an empty namespace is no namespace.
        let (_, e) = refused_v2(
            "ke/meta/edged/query/default/pod",
            r#"{"metadata":{"namespace":"x"}}"#,
        );
        assert_eq!(e.code(), "EM-META-NAMESPACE");
        let r = request(
            "ke/meta/edged/insert/default/node",
            r#"{"metadata":{"name":"n1","namespace":""}}"#,
        );
        assert_eq!(r.resource.key(), "default/node/n1");
    }

    #[test]
    fn operations_on_one_object_need_a_name() {
        for op in ["insert", "update", "delete", "action", "action_result"] {
            let (who, e) = refused_v2(&format!("ke/meta/edged/{op}/default/pod"), r#"{"spec":{}}"#);
            assert_eq!(e.code(), "EM-META-NO-NAME", "{op}");
            assert_eq!(
                e.to_string(),
                "no resource name: the topic has no <name> level and neither route.resource nor content.metadata.name gives one"
            );
            assert_eq!(who.resource, "default/pod");
            assert!(who.msg_id.is_some(), "the generated id names the request");
        }
    }

    #[test]
    fn operations_on_a_type_keep_the_two_level_resource() {
        for op in [
            "query",
            "connect",
            "meta-internal-sync",
            "response",
            "error",
            "createvolume",
            "deletevolume",
            "controllerpublishvolume",
            "controllerunpublishvolume",
        ] {
            let r = request(&format!("ke/meta/edged/{op}/default/pod"), "null");
            assert_eq!(r.resource.key(), "default/pod", "{op}");
            assert_eq!(r.resource.id(), None, "{op}");
        }
    }

    #[test]
    fn a_metadata_name_that_is_not_one_level_is_refused() {
        for name in ["", "a/b", "x#", "+"] {
            let payload = format!(r#"{{"metadata":{{"name":"{name}"}}}}"#);
            for op in ["insert", "query"] {
                let (_, e) = refused_v2(&format!("ke/meta/device/{op}/default/pod"), &payload);
                assert_eq!(e.code(), "EM-META-NO-NAME", "{op} {name:?}");
                assert!(
                    e.to_string()
                        .contains(&format!("content.metadata.name {name:?}")),
                    "{e}"
                );
            }
        }
    }
}
