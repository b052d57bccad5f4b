//! The node's Devices and DeviceModels as its DMI server follows them: after each commit that
//! stores or removes one, the store worker publishes it on `$dmi/<type>/<ns>/<name>`, a topic
//! only modules can use (`$` roots other than `$hw`/`$ke` are the broker's, closed to clients).
//! Published after the commit, through the hand-on path, so the server sees them in commit order.

use bytes::Bytes;
use edgemeta_broker::Message;

/// The filter the DMI server's link subscribes to.
pub const FILTER: &str = "$dmi/#";
/// `meta.type` of a Device (KubeEdge's metamanager stores it so, `<ns>/device/<name>`).
pub const DEVICE: &str = "device";
/// `meta.type` of a DeviceModel.
pub const DEVICE_MODEL: &str = "devicemodel";
/// `meta.type` of a registered DMI mapper (`node/devicemapper/<protocol>`, its `MapperInfo`), so
/// a node that restarts still calls the mappers that keep running (KubeEdge 1.23
/// `initDeviceMapperInfoFromDB`).
pub const DEVICE_MAPPER: &str = "devicemapper";
/// The namespace level of a mapper's key.
pub const MAPPER_NAMESPACE: &str = "node";
/// Published after a resync's objects: the server holds the node's whole set from here on.
const SYNCED: &str = "$dmi/synced";

/// One message of the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    /// `res_type` is [`DEVICE`], [`DEVICE_MODEL`] or [`DEVICE_MAPPER`]; `object` is the stored
    /// JSON, `None` once it is removed.
    Object {
        res_type: String,
        namespace: String,
        name: String,
        object: Option<Bytes>,
    },
    /// Every object the node held at a resync has been published.
    Synced,
}

/// The feed message for the object at `<ns>/<res_type>/<name>` (`None`: removed).
pub(crate) fn object(res_type: &str, namespace: &str, name: &str, value: Option<&str>) -> Message {
    let payload = value.map(|v| v.as_bytes().to_vec()).unwrap_or_default();
    Message::new(format!("$dmi/{res_type}/{namespace}/{name}"), payload)
}

pub(crate) fn synced() -> Message {
    Message::new(SYNCED.to_owned(), Vec::new())
}

/// What a feed message says; `None` for a topic that is not one.
pub fn parse(topic: &str, payload: &Bytes) -> Option<Item> {
    if topic == SYNCED {
        return Some(Item::Synced);
    }
    let rest = topic.strip_prefix("$dmi/")?;
    let mut levels = rest.splitn(3, '/');
    let (res_type, namespace, name) = (levels.next()?, levels.next()?, levels.next()?);
    if ![DEVICE, DEVICE_MODEL, DEVICE_MAPPER].contains(&res_type) || name.contains('/') {
        return None;
    }
    Some(Item::Object {
        res_type: res_type.to_owned(),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        object: (!payload.is_empty()).then(|| payload.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feed_messages_read_back() {
        let m = object(DEVICE, "default", "t1", Some("{}"));
        assert_eq!(
            parse(&m.topic, &m.payload),
            Some(Item::Object {
                res_type: DEVICE.into(),
                namespace: "default".into(),
                name: "t1".into(),
                object: Some(Bytes::from_static(b"{}")),
            })
        );
        let gone = object(DEVICE_MODEL, "default", "m", None);
        assert!(matches!(
            parse(&gone.topic, &gone.payload),
            Some(Item::Object { object: None, .. })
        ));
        assert_eq!(parse(&synced().topic, &Bytes::new()), Some(Item::Synced));
        assert_eq!(parse("$dmi/pod/a/b", &Bytes::new()), None);
    }
}
