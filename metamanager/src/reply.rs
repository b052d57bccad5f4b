//! The one place where a failure becomes what a client sees. A request's sender gets an `error`
//! envelope whose content is the reason, on its reply topic (and its MQTT v5 Response Topic); a
//! device gets KubeEdge's error result (event id, code, reason) on its family's result topic.
//!
//! Published directly or with the batch, never through the outbox alone: the failure may be the
//! store itself.

use bytes::Bytes;
use edgemeta_broker::Message;

use crate::devices::{error_result, local};
use crate::error::Error;
use crate::request::Requester;
use edgemeta_protocol::json_string;
use edgemeta_protocol::Operation;

/// Who hears about a failed or refused message.
pub(crate) enum Asker<'a> {
    /// A `<root>/meta/...` request's sender.
    Requester(&'a Requester),
    /// A device, on its result topic, about the event it sent.
    Device { result: &'a str, event_id: &'a str },
}

/// The code a device's error result carries for `error`: 400 for bad input, 500 for ours.
pub(crate) fn code_of(error: &Error) -> u16 {
    if error.is_bad_input() {
        400
    } else {
        500
    }
}

/// What `asker` hears: `reason` (and, for a device, `code`).
pub(crate) fn error_reply(root: &str, asker: Asker<'_>, code: u16, reason: &str) -> Vec<Message> {
    match asker {
        Asker::Requester(requester) => {
            let envelope = requester.envelope(Operation::Error, json_string(reason));
            let payload = Bytes::from(envelope.to_bytes());
            let mut out = vec![Message::new(
                requester.topic(root, Operation::Error),
                payload.clone(),
            )];
            out.extend(requester.v5_copy(&payload));
            out
        }
        Asker::Device { result, event_id } => {
            vec![local(result, &error_result(event_id, code, reason))]
        }
    }
}
