//! Twin updates from a mapper: `$hw/events/device/<id>/twin/update`.

use crate::devices::twin::{self, Source};
use crate::devices::wire::{Base, TwinResult, TwinUpdate};
use crate::devices::{local, Event};
use crate::error::Error;
use crate::handlers::device::{
    after_twin_change, device_exists, load_twins, parse, refuse, write_twins,
};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;
use edgemeta_protocol::now_ms;

pub(crate) const FAMILY: Family =
    Family::mapper_request("twin_update", "/twin/update", "/twin/update/result", applying!(apply));

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    twin_update(&event.id, &event.payload, cx).await
}

/// `dealTwinUpdate` / `DealDeviceTwin` with `RestDealType`.
async fn twin_update(id: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = FAMILY.result_topic(id, cx.node()).unwrap_or_default();
    let reason = "Unmarshal update request body failed, please check the request";
    let Some(update) = parse::<TwinUpdate>(cx, &topic, payload, reason) else {
        return Ok(());
    };
    let event_id = update.base.event_id.clone();
    let Some(changes) = update.twin else {
        return refuse(
            cx,
            &topic,
            &event_id,
            400,
            "Update twin error, key:twin does not exist",
            "",
        );
    };
    if let Err(reason) = twin::check_update(&changes) {
        return refuse(cx, &topic, &event_id, 400, &reason, "");
    }
    if !device_exists(id, cx).await? {
        return refuse(
            cx,
            &topic,
            &event_id,
            404,
            "update rejected due to the device is not existed",
            id,
        );
    }
    let mut twins = load_twins(id, cx).await?;
    let now = now_ms();
    let merged = match twin::merge(&mut twins, &changes, Source::Device, now) {
        Ok(merged) => merged,
        Err(reason) => return refuse(cx, &topic, &event_id, 400, &reason, ""),
    };
    write_twins(id, &merged.changed, cx).await?;
    let base = Base {
        event_id: event_id.clone(),
        timestamp: now,
    };
    cx.publish(local(
        &topic,
        &TwinResult {
            base: base.clone(),
            twin: merged.result,
        },
    ));
    after_twin_change(id, base, merged.document, &twins, merged.sync, cx).await
}
