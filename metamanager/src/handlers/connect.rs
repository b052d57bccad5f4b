//! The cloud link going up or down (§3.7).

use tracing::info;

use crate::error::Error;
use crate::handlers::device::request_detail;
use crate::handlers::query::local_answer;
use crate::request::Request;
use crate::unit::{Context, PendingKind};

/// §3.7: the cloud link went up or down. Going down answers waiting remote queries locally.
pub(crate) async fn apply(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    match request.envelope.content_str().as_deref() {
        Some("cloud_connected") => {
            let was = cx.set_connected(true);
            info!("cloud connected");
            // KubeEdge's twin asks for the full device list each time the link comes up.
            if !was {
                request_detail(cx).await?;
            }
            Ok(())
        }
        Some("cloud_disconnected") => {
            cx.set_connected(false);
            info!("cloud disconnected");
            let waiting = cx.waiting(PendingKind::RemoteQuery);
            for id in waiting {
                if let Some(pending) = cx.take_pending(&id) {
                    local_answer(&pending.request, cx).await?;
                }
            }
            Ok(())
        }
        _ => Err(Error::Content {
            what: "connect",
            reason: format!(
                "{} is neither \"cloud_connected\" nor \"cloud_disconnected\"",
                request.envelope.content.get()
            ),
        }),
    }
}
