//! The devicecontroller's desired twins: `update` of `<ns>/devicetwin/<name>`.

use tracing::warn;

use crate::devices::wire::TwinUpdate;
use crate::devices::{Event, DEVICETWIN};
use crate::error::Error;
use crate::handlers::device::{bad_cloud_content, device_exists, sync_twins};
use crate::handlers::family::{applying, Family};
use crate::unit::Context;

pub(crate) const FAMILY: Family =
    Family::from_cloud("cloud_twin", None, DEVICETWIN, true, applying!(apply));

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    cloud_twin(&event.id, &event.payload, cx).await
}

/// `dealTwinSync`: the devicecontroller's desired values.
async fn cloud_twin(id: &str, content: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let update: TwinUpdate = match serde_json::from_slice(content) {
        Ok(update) => update,
        Err(e) => return bad_cloud_content("device twin", &e),
    };
    if !device_exists(id, cx).await? {
        warn!(error_code = "EM-DEVICE-UNKNOWN", device = %id, "desired twin for a device this node does not have; ignored");
        return Ok(());
    }
    let changes = update.twin.unwrap_or_default();
    sync_twins(id, &update.base.event_id, &changes, cx).await
}
