//! Broker link → parsed requests: checks topic, size and envelope, answers what is malformed
//! and hands the rest to the store worker. Parsing happens here, on the tokio side, so the
//! store thread only sees well-formed work.

use edgemeta_broker::{Message, Publisher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::envelope::Envelope;
use crate::error::Error;
use crate::request::{Request, Requester};
use crate::topic::{InboundTopic, META};
use crate::worker::{Done, Job, Outcome};

/// Limits and names the intake needs.
#[derive(Debug, Clone)]
pub struct IntakeConfig {
    pub root: String,
    pub max_payload_bytes: usize,
}

/// A message handed in by another in-process component (the cloud bridge), with the signal to
/// fire once it is committed or refused.
pub type Submission = (Message, Done);

/// Reads the link and the submissions until cancelled; then takes what is already queued, so
/// nothing handed over is dropped, and returns (dropping its job sender lets the worker finish).
pub async fn run(
    config: IntakeConfig,
    mut inbox: mpsc::Receiver<Message>,
    mut submissions: mpsc::Receiver<Submission>,
    jobs: mpsc::Sender<Job>,
    publisher: Publisher,
    cancel: CancellationToken,
) {
    loop {
        let (message, done) = tokio::select! {
            _ = cancel.cancelled() => break,
            message = inbox.recv() => match message {
                Some(message) => (message, None),
                None => return,
            },
            Some((message, done)) = submissions.recv() => (message, Some(done)),
        };
        if !intake(&config, message, done, &jobs, &publisher).await {
            return;
        }
    }
    while let Ok((message, done)) = submissions.try_recv() {
        if !intake(&config, message, Some(done), &jobs, &publisher).await {
            return;
        }
    }
    while let Ok(message) = inbox.try_recv() {
        if !intake(&config, message, None, &jobs, &publisher).await {
            return;
        }
    }
}

/// Handles one message; `false` once the worker is gone.
async fn intake(
    config: &IntakeConfig,
    message: Message,
    done: Option<Done>,
    jobs: &mpsc::Sender<Job>,
    publisher: &Publisher,
) -> bool {
    match parse(config, &message) {
        Ok(Some(request)) => jobs
            .send(Job::Request(Box::new(request), done))
            .await
            .is_ok(),
        Ok(None) => {
            if let Some(done) = done {
                let _ = done.send(Outcome::Final);
            }
            true
        }
        Err(refused) => {
            let Refused { requester, error } = *refused;
            for reply in requester.error_messages(&config.root, &error) {
                if publisher.publish(reply).await.is_err() {
                    return false;
                }
            }
            if let Some(done) = done {
                let _ = done.send(Outcome::Final);
            }
            true
        }
    }
}

/// A message that cannot be applied, and whom to tell.
#[derive(Debug)]
pub struct Refused {
    pub requester: Requester,
    pub error: Error,
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
                requester.msg_id = crate::envelope::sender_msg_id(&message.payload);
            }
            return Err(refuse(requester, error, topic.operation));
        }
    };
    // Ids of a malformed envelope are unknown, so its error reply has no parent id.
    match Envelope::parse(&message.payload) {
        Ok(envelope) => Ok(Some(Request::new(
            topic.from, operation, resource, envelope, message,
        ))),
        Err(e) => {
            requester.resource = resource.key().to_owned();
            Err(refuse(requester, Error::Envelope(e), topic.operation))
        }
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
    Box::new(Refused { requester, error })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> IntakeConfig {
        IntakeConfig {
            root: "ke".into(),
            max_payload_bytes: 64,
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
        assert_eq!(
            who.topic("ke", crate::Operation::Error),
            "ke/edged/meta/error/default/pod/x"
        );
    }

    #[test]
    fn bad_resource_shapes_are_answered_with_the_shape_wanted() {
        let (who, e) = refused("ke/meta/device/insert/a/b/c/d", b"{}");
        assert_eq!(
            e.to_string(),
            "invalid resource \"a/b/c/d\": want <namespace>/<type>[/<id>]"
        );
        assert_eq!(
            who.topic("ke", crate::Operation::Error),
            "ke/device/meta/error/a/b/c/d"
        );
        let (_, e) = refused("ke/meta/device/insert/pod", b"{}");
        assert!(matches!(e, Error::InvalidResource(_)));
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
        assert_eq!(
            who.topic("ke", crate::Operation::Error),
            "ke/cloud/meta/error/default/pod/x"
        );
    }
}
