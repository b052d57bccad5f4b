//! Answers to requests that wait on another module: the cloud's answer to a remote query, edged's
//! to a volume call, or none in time.

use tracing::warn;

use crate::error::Error;
use crate::handlers::meta::upsert;
use crate::handlers::query::{answer_values, local_values};
use crate::request::Request;
use crate::unit::{Context, Pending, PendingKind};
use edgemeta_protocol::json_string;
use edgemeta_protocol::Operation;

/// The cloud answered a remote query, or edged answered a volume call.
pub(crate) async fn answer_pending(
    pending: Pending,
    answer: &Request,
    cx: &mut Context<'_>,
) -> Result<(), Error> {
    let original = &pending.request;
    let failed = answer.operation == Operation::Error;
    match pending.kind {
        PendingKind::Volume => {
            cx.reply(&original.requester, answer.operation, || {
                answer.envelope.content.clone()
            })
            .await
        }
        PendingKind::RemoteQuery => {
            if failed {
                cx.reply(&original.requester, Operation::Error, || {
                    answer.envelope.content.clone()
                })
                .await?;
            } else {
                let value = answer.envelope.content.get().to_owned();
                // The requester still gets the cloud's answer when caching it fails (KubeEdge
                // §7 row 20); the next query simply goes remote again.
                if let Err(e) = upsert(cx.db(), &original.resource, &value).await {
                    warn!(error_code = "EM-STORE-CACHE", resource = %original.resource, error = %e,
                        "remote query answer not cached");
                }
                answer_values(&original.requester, vec![value], cx).await?;
            }
            // §2.4.6: the cloud's answer is itself acknowledged.
            cx.reply(&answer.requester, Operation::Response, || json_string("OK"))
                .await
        }
    }
}

/// A pending request ran out of time.
pub(crate) async fn expire(id: &str, cx: &mut Context<'_>) -> Result<(), Error> {
    let Some(pending) = cx.expired(id) else {
        return Ok(());
    };
    let request = &pending.request;
    let error = match pending.kind {
        PendingKind::RemoteQuery => {
            // The cloud is silent: a stale local copy beats a timeout (offline autonomy).
            let values = local_values(cx.db(), &request.resource).await?;
            if !values.is_empty() {
                return answer_values(&request.requester, values, cx).await;
            }
            Error::RemoteTimeout {
                resource: request.resource.to_string(),
                waited_ms: cx.waits().remote_query.as_millis() as u64,
            }
        }
        PendingKind::Volume => Error::VolumeTimeout {
            operation: request.operation.to_string(),
            resource: request.resource.to_string(),
            waited_ms: cx.waits().volume.as_millis() as u64,
        },
    };
    cx.reply(&request.requester, Operation::Error, || {
        json_string(&error.to_string())
    })
    .await
}
