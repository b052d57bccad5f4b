//! CSI volume calls (§3.10): forwarded to edged, whose answer goes back to the requester (see
//! [`super::answer`]).

use crate::error::Error;
use crate::request::Request;
use crate::routing::Forward;
use crate::unit::{Context, PendingKind};

/// §3.10: the volume call goes to edged; edged's answer is returned to the requester.
pub(crate) async fn apply(request: &Request, cx: &mut Context<'_>) -> Result<(), Error> {
    cx.send(
        Forward::Edged.module(),
        &request.requester.from,
        &request.envelope,
    )
    .await?;
    let id = request.envelope.header.msg_id.clone();
    let timeout = cx.waits().volume;
    cx.wait_for(id, PendingKind::Volume, request, timeout);
    Ok(())
}
