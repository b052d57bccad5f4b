//! Uploads carried to the cloud: `SYS/dis/upload_records`, `$hw/events/upload/#` and edge
//! apps' user topics (`+/user/#`).

use crate::devices::{content_of, header, Event, EVENTBUS};
use crate::error::Error;
use crate::handlers::family::{applying, Family, ResultTopic, Shape};
use crate::unit::Context;
use edgemeta_protocol::{outbound, CLOUD};
use edgemeta_protocol::{Envelope, Route};

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

/// An upload carried to the cloud as KubeEdge's eventbus does: op `upload`, the topic as resource.
async fn upload(topic: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let envelope = Envelope {
        header: header(),
        route: Route {
            source: EVENTBUS.into(),
            group: "user".into(),
            operation: "upload".into(),
            resource: topic.to_owned(),
        },
        content: content_of(payload),
    };
    let cloud = outbound(cx.root(), CLOUD, EVENTBUS, "upload", "node/upload");
    cx.queue_for_cloud(&cloud, &envelope.to_bytes()).await
}
