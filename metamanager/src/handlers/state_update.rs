//! Device states from a mapper: `$hw/events/device/<id>/state/update`.

use crate::devices::wire::{Base, DeviceState, StateResult, StateUpdate};
use crate::devices::{local, resource_of, Event, DEVICESTATE, STATES, TWIN};
use crate::error::Error;
use crate::handlers::device::{read_request, refuse, up};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;
use edgemeta_protocol::{new_msg_id, rfc3339};

pub(crate) const FAMILY: Family =
    Family::mapper_request("state_update", "/state/update", applying!(apply));

/// `dealDeviceStateUpdate`. KubeEdge ignores an unknown device or state; a mapper hears why here.
async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    let reason = "Unmarshal device state failed";
    let Some((topic, update)) = read_request::<StateUpdate>(&FAMILY, event, cx, reason) else {
        return Ok(());
    };
    let (id, event_id) = (event.id.as_str(), update.base.event_id.clone());
    let state = update.state.to_lowercase();
    if !STATES.contains(&state.as_str()) {
        let reason = format!(
            "unknown state {:?}: want one of {}",
            update.state,
            STATES.join(", ")
        );
        return refuse(cx, &topic, &event_id, 400, &reason, "");
    }
    let Some(device) = cx
        .db()
        .device(id)
        .await
        .map_err(Error::store("query device"))?
    else {
        return refuse(
            cx,
            &topic,
            &event_id,
            404,
            "update rejected due to the device is not existed",
            id,
        );
    };
    let last_online = if state == "online" || state == "ok" {
        rfc3339(std::time::SystemTime::now())
    } else {
        String::new()
    };
    cx.db()
        .set_device_state(id, &update.state, &last_online)
        .await
        .map_err(Error::store("update device state"))?;
    let result = StateResult {
        base: Base::now(if event_id.is_empty() {
            new_msg_id()
        } else {
            event_id
        }),
        device: DeviceState {
            name: device.name,
            state: update.state,
            last_online_time: last_online,
        },
    };
    cx.publish(local(&topic, &result));
    up(cx, TWIN, "update", &resource_of(id, DEVICESTATE), &result).await
}
