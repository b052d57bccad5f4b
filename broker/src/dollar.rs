//! KubeEdge's `$hw/...` and `$ke/...` topics: the one `$` roots open to clients.
//!
//! A `$hw/a` topic has that one name end to end: for clients, the hub and the node's modules
//! alike (a `$` topic, hidden from filters that start with a wildcard, MQTT §4.7.2). The ACL
//! alone matches it by a key, `edgemeta$hw/a`, so that rules with a leading wildcard (`#`)
//! grant it; clients may not use that prefix, so no topic of theirs shares a key.

use std::borrow::Cow;

/// What a `$hw`/`$ke` topic's ACL key starts with; clients may not use it.
pub const INTERNAL_PREFIX: &str = "edgemeta$";

/// What is put in front of a carried topic: [`INTERNAL_PREFIX`] without its `$`, which the
/// topic brings.
const CARRIER: &str = "edgemeta";

/// The `$` roots open to clients.
const CARRIED: [&str; 2] = ["$hw/", "$ke/"];

/// Whether a topic or filter starts with one of the [`CARRIED`] roots.
pub fn is_carried(client: &[u8]) -> bool {
    CARRIED
        .iter()
        .any(|root| client.starts_with(root.as_bytes()))
}

/// The ACL's key of a client's topic or filter: `$hw/a` → `edgemeta$hw/a`; anything else is
/// its own key.
pub fn to_broker(client: &str) -> Cow<'_, str> {
    if is_carried(client.as_bytes()) {
        Cow::Owned(format!("{CARRIER}{client}"))
    } else {
        Cow::Borrowed(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hw_and_ke_topics_are_keyed_under_the_internal_prefix() {
        let topic = "$hw/events/device/d1/twin/update";
        assert_eq!(to_broker(topic), "edgemeta$hw/events/device/d1/twin/update");
        assert_eq!(
            to_broker("$ke/events/device/#"),
            "edgemeta$ke/events/device/#"
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
        }
    }
}
