//! The devicecontroller's membership changes: `update` of `node/membership`.

use crate::devices::wire::MembershipUpdate;
use crate::devices::{Event, MEMBERSHIP};
use crate::error::Error;
use crate::handlers::device::{add_device, bad_cloud_content, remove_device};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family::from_cloud(
    "cloud_membership",
    Some("node"),
    MEMBERSHIP,
    false,
    applying!(apply),
);

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    cloud_membership(&event.payload, cx).await
}

/// `dealMembershipUpdate`: devices added (their twins as a cloud update) and removed.
async fn cloud_membership(content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let update: MembershipUpdate = match serde_json::from_slice(content) {
        Ok(update) => update,
        Err(e) => return bad_cloud_content("membership", &e),
    };
    for device in update.added_devices.unwrap_or_default() {
        add_device(device, cx).await?;
    }
    for device in update.removed_devices.unwrap_or_default() {
        remove_device(device, cx).await?;
    }
    Ok(())
}
