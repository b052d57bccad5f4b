//! Uploads carried to the cloud: `SYS/dis/upload_records`, `$hw/events/upload/#` and edge
//! apps' user topics (`+/user/#`).

use crate::devices::Event;
use crate::error::Error;
use crate::handlers::device;
use crate::handlers::family::{applying, Family, ResultTopic, Shape};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family {
    kind: "upload",
    shape: Shape::Upload,
    result: ResultTopic::None,
    answers_failures: false,
    apply: applying!(apply),
};

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    upload(&event.topic, &event.payload, cx).await
}

/// An upload carried to the cloud with the topic as its resource.
async fn upload(topic: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    device::upload(topic.to_owned(), "node/upload", payload, cx).await
}
