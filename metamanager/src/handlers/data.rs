//! A mapper's data: `$ke/events/device/<id>/data/update`.

use tracing::warn;

use crate::devices::{resource_of, Event, DEVICEDATA};
use crate::error::Error;
use crate::handlers::device;
use crate::handlers::family::{applying, Family, ResultTopic, Shape};
use crate::unit::Context;

pub(crate) const FAMILY: Family = Family {
    kind: "data",
    shape: Shape::Device {
        prefix: "$ke/events/device/",
        suffix: "/data/update",
    },
    result: ResultTopic::None,
    answers_failures: false,
    apply: applying!(apply),
};

async fn apply(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    data(&event.id, &event.topic, &event.payload, cx).await
}

/// A mapper's data: merged into the latest values per property, kept in `meta`, carried up.
async fn data(id: &str, topic: &str, payload: &[u8], cx: &mut Context<'_>) -> Result<(), Error> {
    let Ok(serde_json::Value::Object(incoming)) = serde_json::from_slice(payload) else {
        warn!(error_code = "EM-DEVICE-JSON", %topic, "device data is not a JSON object; dropped");
        return Ok(());
    };
    let key = resource_of(id, DEVICEDATA);
    let stored = cx
        .db()
        .get(&key)
        .await
        .map_err(Error::store("query meta"))?;
    let mut latest = stored
        .and_then(|s| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&s).ok())
        .unwrap_or_default();
    for (field, value) in &incoming {
        match (field.as_str(), value, latest.get_mut(field)) {
            ("data", serde_json::Value::Object(new), Some(serde_json::Value::Object(old))) => {
                old.extend(new.clone());
            }
            _ => {
                latest.insert(field.clone(), value.clone());
            }
        }
    }
    let value = serde_json::Value::Object(latest).to_string();
    cx.db()
        .upsert(&key, DEVICEDATA, &value)
        .await
        .map_err(Error::store("insert or update meta"))?;
    // `<namespace>/devicedata`: the key's first two levels.
    device::upload(key.clone(), &key, payload, cx).await
}
