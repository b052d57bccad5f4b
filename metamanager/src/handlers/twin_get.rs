//! Twin reads from a mapper: `$hw/events/device/<id>/twin/get`.

use crate::devices::wire::{Base, TwinResult};
use crate::devices::{local, Event};
use crate::error::Error;
use crate::handlers::device::{device_exists, load_twins, parse, refuse};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;

pub(crate) const FAMILY: Family =
    Family::mapper_request("twin_get", "/twin/get", "/twin/get/result", applying!(apply));

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    twin_get(&event.id, &event.payload, cx).await
}

/// `DealGetTwin`.
async fn twin_get(id: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = FAMILY.result_topic(id, cx.node()).unwrap_or_default();
    let Some(base) = parse::<Base>(cx, &topic, payload, "Unmarshal twin info failed") else {
        return Ok(());
    };
    if !device_exists(id, cx).await? {
        let reason = format!("Device {id} not found while getting twin");
        return refuse(cx, &topic, &base.event_id, 404, &reason, "");
    }
    let twin = load_twins(id, cx)
        .await?
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
