//! KubeEdge's `$hw/...` and `$ke/...` topics, carried through a broker that refuses `$` topics.
//!
//! rumqttd 0.20 never delivers a topic that starts with `$` (`protocol::matches`) and drops a
//! client that subscribes to a `$` filter other than `$share/...`. Inside rumqttd these topics
//! and filters therefore carry [`INTERNAL_PREFIX`]: `$hw/a` travels as `edgemeta$hw/a`. The guard
//! converts what clients send and receive; our in-process links use the broker form directly.

use std::borrow::Cow;

use bytes::Bytes;

/// What a carried `$` topic starts with inside rumqttd; clients may not use it themselves.
pub const INTERNAL_PREFIX: &str = "edgemeta$";

/// What is put in front of a carried topic: [`INTERNAL_PREFIX`] without its `$`, which the
/// topic brings.
const CARRIER: &str = "edgemeta";

/// The `$` roots clients use that rumqttd carries under [`INTERNAL_PREFIX`].
const CARRIED: [&str; 2] = ["$hw/", "$ke/"];

/// Whether a client's topic or filter starts with one of the [`CARRIED`] roots.
pub fn is_carried(client: &[u8]) -> bool {
    CARRIED
        .iter()
        .any(|root| client.starts_with(root.as_bytes()))
}

/// The form rumqttd handles of a client's topic or filter: `$hw/a` → `edgemeta$hw/a`; anything
/// else is returned as it is.
pub fn to_broker(client: &str) -> Cow<'_, str> {
    if is_carried(client.as_bytes()) {
        Cow::Owned(format!("{CARRIER}{client}"))
    } else {
        Cow::Borrowed(client)
    }
}

/// The form a client sees of a topic or filter inside rumqttd: `edgemeta$hw/a` → `$hw/a`;
/// anything else is returned as it is.
pub fn to_client(broker: &str) -> Cow<'_, str> {
    match broker.strip_prefix(CARRIER) {
        Some(client) if is_carried(client.as_bytes()) => Cow::Borrowed(client),
        _ => Cow::Borrowed(broker),
    }
}

/// [`to_broker`] for a subscription, which may be shared: `$share/<group>/<filter>` carries
/// `<filter>`.
pub fn filter_to_broker(client: &str) -> Cow<'_, str> {
    let shared = client
        .strip_prefix("$share/")
        .and_then(|rest| rest.split_once('/'));
    match shared {
        Some((group, filter)) if is_carried(filter.as_bytes()) => {
            Cow::Owned(format!("$share/{group}/{CARRIER}{filter}"))
        }
        Some(_) => Cow::Borrowed(client),
        None => to_broker(client),
    }
}

/// What rumqttd stores before a client's topic as read off the wire: `edgemeta` for a carried
/// topic, nothing otherwise. Bytes, so a topic that is not UTF-8 stays rumqttd's to refuse.
pub fn broker_prefix(client: &[u8]) -> &'static [u8] {
    if is_carried(client) {
        CARRIER.as_bytes()
    } else {
        b""
    }
}

/// The client form of a topic rumqttd is sending, sharing its bytes; `None` when it is not a
/// carried topic (the usual case, decided by one prefix comparison).
pub fn bytes_to_client(broker: &Bytes) -> Option<Bytes> {
    if !broker.starts_with(INTERNAL_PREFIX.as_bytes()) {
        return None;
    }
    let client = &broker[CARRIER.len()..];
    is_carried(client).then(|| broker.slice(CARRIER.len()..))
}

/// Whether a client holding `filters` (broker form) may be sent `topic` (broker form). A carried
/// topic only through a filter that names its `$` root: MQTT 3.1.1 and 5 §4.7.2 keep `$` topics
/// from filters that start with a wildcard, which rumqttd would match against `edgemeta$...`.
pub fn reaches<'a>(topic: &str, filters: impl IntoIterator<Item = &'a String>) -> bool {
    if !topic.starts_with(INTERNAL_PREFIX) {
        return true;
    }
    filters.into_iter().any(|filter| {
        let shared = filter
            .strip_prefix("$share/")
            .and_then(|rest| rest.split_once('/'))
            .map(|(_, filter)| filter);
        let filter = shared.unwrap_or(filter);
        filter.starts_with(INTERNAL_PREFIX) && rumqttd::protocol::matches(topic, filter)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hw_and_ke_topics_travel_under_the_internal_prefix() {
        let topic = "$hw/events/device/d1/twin/update";
        assert_eq!(to_broker(topic), "edgemeta$hw/events/device/d1/twin/update");
        assert_eq!(to_client(&to_broker(topic)), topic);
        assert_eq!(
            to_broker("$ke/events/device/#"),
            "edgemeta$ke/events/device/#"
        );
        assert_eq!(
            to_client("edgemeta$ke/events/device/#"),
            "$ke/events/device/#"
        );
    }

    #[test]
    fn other_topics_are_left_as_they_are_and_borrowed() {
        for topic in [
            "ke/meta/device/update/a/b",
            "$SYS/broker",
            "$hw",
            "$hwx/a",
            "hw/a",
            "#",
            "",
            "edgemeta$x/a",
            "edgemeta-refused",
        ] {
            assert!(
                matches!(to_broker(topic), Cow::Borrowed(t) if t == topic),
                "{topic}"
            );
            assert!(
                matches!(to_client(topic), Cow::Borrowed(t) if t == topic),
                "{topic}"
            );
        }
    }

    #[test]
    fn a_shared_subscription_carries_the_filter_it_shares() {
        assert_eq!(
            filter_to_broker("$share/g/$hw/events/#"),
            "$share/g/edgemeta$hw/events/#"
        );
        assert_eq!(filter_to_broker("$share/g/ke/#"), "$share/g/ke/#");
        assert_eq!(filter_to_broker("$hw/events/#"), "edgemeta$hw/events/#");
        assert_eq!(filter_to_broker("$share/$hw/"), "$share/$hw/");
    }

    #[test]
    fn a_carried_topic_reaches_only_filters_that_name_its_root() {
        let held = |filters: &[&str]| filters.iter().map(|f| f.to_string()).collect::<Vec<_>>();
        let topic = "edgemeta$hw/events/device/d/twin/update/delta";
        assert!(!reaches(topic, &held(&["#", "+/events/#", "ke/#"])));
        assert!(reaches(
            topic,
            &held(&["#", "edgemeta$hw/events/device/+/twin/#"])
        ));
        assert!(reaches(topic, &held(&["$share/g/edgemeta$hw/#"])));
        assert!(!reaches(topic, &held(&["edgemeta$ke/#"])));
        assert!(reaches("factory/user/a", &held(&["#"])));
        assert!(
            reaches("factory/user/a", &held(&[])),
            "not the guard's to judge"
        );
    }

    #[test]
    fn wire_topics_are_converted_without_copying_the_others() {
        assert_eq!(broker_prefix(b"$hw/a"), b"edgemeta");
        assert_eq!(broker_prefix(b"ke/a"), b"");
        let carried = Bytes::from_static(b"edgemeta$ke/events/device/d/data/update");
        assert_eq!(
            bytes_to_client(&carried).as_deref(),
            Some(&b"$ke/events/device/d/data/update"[..])
        );
        for topic in ["ke/device/x", "edgemeta$x/y", "edgemeta", "edgemeta$hw"] {
            assert_eq!(bytes_to_client(&Bytes::from(topic)), None, "{topic}");
        }
    }
}
