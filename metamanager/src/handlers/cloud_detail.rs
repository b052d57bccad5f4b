//! The devicecontroller's full device list: `update` of `node/membershipdetail`.

use crate::devices::wire::{Device, Membership};
use crate::devices::{Event, MEMBERSHIP_DETAIL};
use crate::error::Error;
use crate::handlers::cloud_object::forget_unlisted;
use crate::handlers::device::{add_device, bad_cloud_content, remove_device};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family::from_cloud(
    "cloud_detail",
    Some("node"),
    MEMBERSHIP_DETAIL,
    false,
    applying!(apply),
);

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    cloud_detail(&event.payload, cx).await
}

/// `dealMembershipDetail`: the cloud's full list; what the node has beyond it is removed.
async fn cloud_detail(content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let detail: Membership = match serde_json::from_slice(content) {
        Ok(detail) => detail,
        Err(e) => return bad_cloud_content("membership detail", &e),
    };
    let listed: Vec<String> = detail.devices.iter().map(|d| d.id.clone()).collect();
    for device in detail.devices {
        add_device(device, cx).await?;
    }
    forget_unlisted(&listed, cx).await?;
    for row in cx
        .db()
        .devices()
        .await
        .map_err(Error::store("query devices"))?
    {
        if !listed.contains(&row.id) {
            let id = row.id.clone();
            remove_device(
                Device {
                    id,
                    ..Device::default()
                },
                cx,
            )
            .await?;
        }
    }
    Ok(())
}
