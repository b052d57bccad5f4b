//! Twin reads from a mapper: `$hw/events/device/<id>/twin/get`.

use crate::devices::wire::{Base, TwinResult};
use crate::devices::{local, Event};
use crate::error::Error;
use crate::handlers::device::{known_twins, read_request, refuse};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family::mapper_request("twin_get", "/twin/get", applying!(apply));

/// `DealGetTwin`.
async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    let reason = "Unmarshal twin info failed";
    let Some((topic, base)) = read_request::<Base>(&FAMILY, event, cx, reason) else {
        return Ok(());
    };
    let id = event.id.as_str();
    let Some(twins) = known_twins(id, cx).await? else {
        let reason = format!("Device {id} not found while getting twin");
        return refuse(cx, &topic, &base.event_id, 404, &reason, "");
    };
    let twin = twins
        .into_iter()
        .filter(|(_, t)| !t.is_deleted())
        .map(|(k, t)| (k, Some(t.to_msg(false))))
        .collect();
    let result = TwinResult {
        base: Base::now(base.event_id),
        twin,
    };
    cx.publish(local(&topic, &result));
    Ok(())
}
