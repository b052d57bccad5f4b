//! A mapper asking for the node's devices: `$hw/events/node/<node>/membership/get`.

use crate::devices::wire::{Base, Device, Membership};
use crate::devices::{device_of, local, Event};
use crate::error::Error;
use crate::handlers::device::parse;
use crate::handlers::family::{applying, Family, ResultTopic, Shape};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family {
    kind: "membership_get",
    shape: Shape::Node {
        action: "membership/get",
    },
    result: ResultTopic::Node("/membership/get/result"),
    answers_failures: false,
    apply: applying!(apply),
};

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    membership_get(&event.payload, cx).await
}

/// `dealMembershipGetInner`: answered on this node's topic, whatever node the request named.
async fn membership_get(payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let topic = FAMILY.result_topic("", cx.node()).unwrap_or_default();
    let reason = "Unmarshal get membership info failed";
    let Some(base) = parse::<Base>(cx, &topic, payload, reason) else {
        return Ok(());
    };
    let mut devices = Vec::new();
    for row in cx
        .db()
        .devices()
        .await
        .map_err(Error::store("query devices"))?
    {
        let attributes = cx
            .db()
            .attributes(&row.id)
            .await
            .map_err(Error::store("query device attributes"))?;
        devices.push(Device {
            attributes: (!attributes.is_empty())
                .then(|| attributes.into_iter().map(|(k, v)| (k, Some(v))).collect()),
            ..device_of(row)
        });
    }
    let result = Membership {
        base: Base::now(base.event_id),
        devices,
    };
    cx.publish(local(&topic, &result));
    Ok(())
}
