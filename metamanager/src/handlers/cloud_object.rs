//! The devicecontroller's Devices and DeviceModels as objects (KubeEdge's `sendDeviceMsg`,
//! `sendDeviceModelMsg`): `update` / `delete` of `<ns>/device/<name>` and
//! `<ns>/devicemodel/<name>`, stored in `meta` under those keys as KubeEdge's metamanager does,
//! and handed to the DMI server after the commit ([`crate::devices::feed`]). Also the DMI
//! server's resync: every stored one again.

use serde_json::Value;
use tracing::{info, warn};

use crate::devices::feed::{self, DEVICE, DEVICE_MAPPER, DEVICE_MODEL, MAPPER_NAMESPACE};
use crate::devices::Event;
use crate::error::Error;
use crate::handlers::device::bad_cloud_content;
use crate::handlers::family::{applying, Family, Shape};
use crate::unit::Context;
use edgemeta_protocol::InboundTopic;

pub(crate) const DEVICES: Family = Family::cloud_objects(
    "cloud_device",
    None,
    DEVICE,
    true,
    &["insert", "update", "delete"],
    applying!(apply_device),
);

pub(crate) const MODELS: Family = Family::cloud_objects(
    "cloud_devicemodel",
    None,
    DEVICE_MODEL,
    true,
    &["insert", "update", "delete"],
    applying!(apply_model),
);

pub(crate) const RESYNC: Family = Family {
    kind: "dmi_resync",
    shape: Shape::Internal,
    result: crate::handlers::family::ResultTopic::None,
    answers_failures: false,
    apply: applying!(resync),
};

pub(crate) const MAPPER: Family = Family {
    kind: "dmi_mapper",
    shape: Shape::Internal,
    result: crate::handlers::family::ResultTopic::None,
    answers_failures: false,
    apply: applying!(mapper),
};

/// A mapper the DMI server registered: its `MapperInfo` (JSON) stored under
/// `node/devicemapper/<protocol>` (the event's id).
async fn mapper(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    let key = format!("{MAPPER_NAMESPACE}/{DEVICE_MAPPER}/{}", event.id);
    let value = String::from_utf8_lossy(&event.payload);
    cx.db()
        .upsert(&key, DEVICE_MAPPER, &value)
        .await
        .map_err(Error::store("store device mapper"))
}

async fn apply_device(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    apply_object(DEVICE, event, cx).await
}

async fn apply_model(event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    apply_object(DEVICE_MODEL, event, cx).await
}

/// `(uid, resourceVersion)` of a stored or sent object.
fn version_of(object: &Value) -> (Option<&str>, u64) {
    let meta = &object["metadata"];
    let rv = meta["resourceVersion"]
        .as_str()
        .and_then(|rv| rv.parse().ok())
        .or_else(|| meta["resourceVersion"].as_u64())
        .unwrap_or(0);
    (meta["uid"].as_str(), rv)
}

/// Stores or removes one object. An object older than the stored one of the same uid (a
/// resend overtaken by a newer version) changes nothing.
async fn apply_object(res_type: &str, event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    let Some((namespace, name)) = event.id.split_once('/') else {
        warn!(error_code = "EM-DEVICE-ID", id = %event.id, res_type, "a device object without a namespace; ignored");
        return Ok(());
    };
    let delete = InboundTopic::parse(cx.root(), &event.topic)
        .map(|t| t.operation == "delete")
        .unwrap_or(false);
    let key = format!("{namespace}/{res_type}/{name}");
    let sent: Value = match serde_json::from_slice(&event.payload) {
        Ok(sent) => sent,
        Err(e) => return bad_cloud_content(res_type, &e),
    };
    if delete || sent.is_null() {
        let removed = cx
            .db()
            .delete(&key)
            .await
            .map_err(Error::store("delete device object"))?;
        if removed > 0 {
            info!(%key, "device object removed");
            cx.publish(feed::object(res_type, namespace, name, None));
        }
        return Ok(());
    }
    if !sent.is_object() || sent["spec"].is_null() {
        warn!(error_code = "EM-DEVICE-CLOUD-JSON", %key, "a device object without a spec; ignored");
        return Ok(());
    }
    let stored = cx
        .db()
        .get(&key)
        .await
        .map_err(Error::store("query device object"))?;
    if let Some(stored) = stored.as_deref() {
        let stored: Value = serde_json::from_str(stored).unwrap_or(Value::Null);
        let (old_uid, old_rv) = version_of(&stored);
        let (uid, rv) = version_of(&sent);
        if old_uid == uid && old_rv > rv {
            return Ok(());
        }
        if stored == sent {
            return Ok(());
        }
    }
    let value = sent.to_string();
    cx.db()
        .upsert(&key, res_type, &value)
        .await
        .map_err(Error::store("store device object"))?;
    cx.publish(feed::object(res_type, namespace, name, Some(&value)));
    Ok(())
}

/// Every stored model, then every device, then the mappers registered before, then the end
/// mark: the DMI server starts over from these (it asks once its link is subscribed, so nothing committed after is missed).
async fn resync(_event: &Event, cx: &mut Context<'_>) -> Result<(), Error> {
    for res_type in [DEVICE_MODEL, DEVICE, DEVICE_MAPPER] {
        let rows = cx
            .db()
            .rows_by_type(res_type)
            .await
            .map_err(Error::store("list device objects"))?;
        for (key, value) in rows {
            let mut levels = key.splitn(3, '/');
            if let (Some(namespace), Some(_), Some(name)) =
                (levels.next(), levels.next(), levels.next())
            {
                cx.publish(feed::object(res_type, namespace, name, Some(&value)));
            }
        }
    }
    cx.publish(feed::synced());
    Ok(())
}

/// Removes the stored Devices whose ids are not in `listed` (the cloud's full list): they left
/// the node while it was away.
pub(crate) async fn forget_unlisted(listed: &[String], cx: &mut Context<'_>) -> Result<(), Error> {
    let rows = cx
        .db()
        .rows_by_type(DEVICE)
        .await
        .map_err(Error::store("list device objects"))?;
    for (key, _) in rows {
        let mut levels = key.splitn(3, '/');
        let (Some(namespace), Some(_), Some(name)) = (levels.next(), levels.next(), levels.next())
        else {
            continue;
        };
        if listed.iter().any(|id| *id == format!("{namespace}/{name}")) {
            continue;
        }
        cx.db()
            .delete(&key)
            .await
            .map_err(Error::store("delete device object"))?;
        cx.publish(feed::object(DEVICE, namespace, name, None));
    }
    Ok(())
}
