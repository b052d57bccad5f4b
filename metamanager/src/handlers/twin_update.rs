//! Twin updates from a mapper: `$hw/events/device/<id>/twin/update`.

use crate::devices::twin::{self, Source};
use crate::devices::wire::{Base, TwinResult, TwinUpdate};
use crate::devices::{local, Event};
use crate::error::Error;
use crate::handlers::device::{after_twin_change, known_twins, read_request, refuse, write_twins};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;
use edgemeta_protocol::now_ms;

pub(crate) const FAMILY: Family =
    Family::mapper_request("twin_update", "/twin/update", applying!(apply));

/// `dealTwinUpdate` / `DealDeviceTwin` with `RestDealType`.
async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    let reason = "Unmarshal update request body failed, please check the request";
    let Some((topic, update)) = read_request::<TwinUpdate>(&FAMILY, event, cx, reason) else {
        return Ok(());
    };
    let (id, event_id) = (event.id.as_str(), update.base.event_id.clone());
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
    let Some(mut twins) = known_twins(id, cx).await? else {
        return refuse(
            cx,
            &topic,
            &event_id,
            404,
            "update rejected due to the device is not existed",
            id,
        );
    };
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
