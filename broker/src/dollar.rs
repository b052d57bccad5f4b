//! KubeEdge's `$hw/...` and `$ke/...` topics as the node's modules name them.
//!
//! Clients and the hub use `$hw/a` as it is (a `$` topic, hidden from filters that start with a
//! wildcard, MQTT §4.7.2). The node's modules name it `edgemeta$hw/a` (the broker form), which
//! keeps their filters and stored hand-ons apart from clients' topics; a link converts at its
//! edge, and clients may not use the `edgemeta$` form at all.

use std::borrow::Cow;

/// What a `$hw`/`$ke` topic starts with in the modules' form; clients may not use it.
pub const INTERNAL_PREFIX: &str = "edgemeta$";

/// What is put in front of a carried topic: [`INTERNAL_PREFIX`] without its `$`, which the
/// topic brings.
const CARRIER: &str = "edgemeta";

/// The `$` roots the modules name under [`INTERNAL_PREFIX`].
const CARRIED: [&str; 2] = ["$hw/", "$ke/"];

/// Whether a client's topic or filter starts with one of the [`CARRIED`] roots.
pub fn is_carried(client: &[u8]) -> bool {
    CARRIED
        .iter()
        .any(|root| client.starts_with(root.as_bytes()))
}

/// The modules' form of a client's topic or filter: `$hw/a` → `edgemeta$hw/a`; anything
/// else is returned as it is.
pub fn to_broker(client: &str) -> Cow<'_, str> {
    if is_carried(client.as_bytes()) {
        Cow::Owned(format!("{CARRIER}{client}"))
    } else {
        Cow::Borrowed(client)
    }
}

/// The form a client sees of a topic or filter in the modules' form: `edgemeta$hw/a` → `$hw/a`;
/// anything else is returned as it is.
pub fn to_client(broker: &str) -> Cow<'_, str> {
    match broker.strip_prefix(CARRIER) {
        Some(client) if is_carried(client.as_bytes()) => Cow::Borrowed(client),
        _ => Cow::Borrowed(broker),
    }
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
}
