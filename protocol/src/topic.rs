//! Topic grammar `<root>/<to>/<from>/<operation>/<namespace>/<type>[/<name>]` (protocol §2, v2):
//! requests may carry the name level, everything the node publishes leaves it out.

use crate::operation::Operation;
use crate::resource::Resource;
use crate::Error;

/// The module name the MetaManager uses as `<to>` and `<from>`.
pub const META: &str = "meta";
/// The module that stands for everything the cloud bridge carries up.
pub const CLOUD: &str = "cloud";
/// The module name of the edge agent, edged.
pub const EDGED: &str = "edged";

/// Cloud-side sources relayed by the bridge; their replies go to the `cloud` module.
pub const CLOUD_SOURCES: [&str; 3] = ["edgecontroller", "funcmgr", "devicecontroller"];

/// Where a reply to `source` is addressed: cloud sources are all reached through `cloud`.
pub fn reply_module(source: &str) -> &str {
    if CLOUD_SOURCES.contains(&source) {
        CLOUD
    } else {
        source
    }
}

/// A topic addressed to a module (`ke/meta/...`, `ke/edged/...`) split into its parts; the
/// operation and resource are checked later so that a bad one can still be answered on the
/// sender's error topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundTopic<'a> {
    pub from: &'a str,
    pub operation: &'a str,
    /// Everything after the operation: `<namespace>/<type>[/<name>]`, or possibly empty or of
    /// the wrong shape.
    pub resource: &'a str,
}

impl<'a> InboundTopic<'a> {
    /// Splits a topic addressed to the MetaManager.
    pub fn parse(root: &str, topic: &'a str) -> Result<InboundTopic<'a>, Error> {
        InboundTopic::addressed_to(root, META, topic)
    }

    /// Splits a topic addressed to `module`; [`Error::UnaddressableTopic`] when it is not under
    /// `<root>/<module>/` or names no sender (there is nobody to answer).
    pub fn addressed_to(
        root: &str,
        module: &str,
        topic: &'a str,
    ) -> Result<InboundTopic<'a>, Error> {
        let bad = || Error::UnaddressableTopic {
            topic: topic.to_owned(),
            module: module.to_owned(),
        };
        let rest = topic
            .strip_prefix(root)
            .and_then(|t| t.strip_prefix('/'))
            .and_then(|t| t.strip_prefix(module))
            .and_then(|t| t.strip_prefix('/'))
            .ok_or_else(bad)?;
        let (from, after) = first_level(rest);
        let after = after.filter(|_| !from.is_empty()).ok_or_else(bad)?;
        let (operation, resource) = first_level(after);
        let resource = resource.unwrap_or("");
        Ok(InboundTopic {
            from,
            operation,
            resource,
        })
    }

    /// The operation, if this node implements it.
    pub fn operation(&self) -> Option<Operation> {
        Operation::parse(self.operation)
    }

    pub fn resource(&self) -> Result<Resource, Error> {
        Resource::parse(self.resource)
    }
}

/// The first level of `levels` and what follows its `/`, if one does. A byte scan: topics are
/// split on every message, and `str`'s char searchers cost several times as much.
fn first_level(levels: &str) -> (&str, Option<&str>) {
    match levels.bytes().position(|b| b == b'/') {
        Some(at) => (&levels[..at], Some(&levels[at + 1..])),
        None => (levels, None),
    }
}

/// At most the first two levels of a resource string: `<namespace>/<type>` of a valid one.
/// Malformed text is cut the same way, so an error reply's topic stays bounded too.
pub fn type_level(resource: &str) -> &str {
    match first_level(resource) {
        (namespace, Some(rest)) => {
            let (res_type, _) = first_level(rest);
            &resource[..namespace.len() + 1 + res_type.len()]
        }
        (_, None) => resource,
    }
}

/// Builds `<root>/<to>/<from>/<operation>/<namespace>/<type>` for a message about `resource`.
/// The name stays in the envelope's `route.resource`: every distinct topic costs the broker
/// memory it never frees, so topics name types, not objects (protocol §2, v2).
pub fn outbound(root: &str, to: &str, from: &str, operation: &str, resource: &str) -> String {
    let resource = type_level(resource);
    // Built once per message on the store thread: joined by hand, `format!` costs 4× as much.
    let mut topic = String::with_capacity(
        root.len() + to.len() + from.len() + operation.len() + resource.len() + 4,
    );
    for (i, level) in [root, to, from, operation, resource]
        .into_iter()
        .enumerate()
    {
        if i == 4 && level.is_empty() {
            break;
        }
        if i > 0 {
            topic.push('/');
        }
        topic.push_str(level);
    }
    topic
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The byte scans split as `str::splitn` and `match_indices` do, on any text.
        #[test]
        fn levels_split_as_the_standard_library_splits(topic in "[a-z/é]{0,12}") {
            let mut parts = topic.splitn(3, '/');
            let expected = match (parts.next().filter(|f| !f.is_empty()), parts.next()) {
                (Some(from), Some(operation)) => Some((from, operation, parts.next().unwrap_or(""))),
                _ => None,
            };
            let split = InboundTopic::addressed_to("ke", "meta", &format!("ke/meta/{topic}"))
                .ok()
                .map(|t| (t.from.to_owned(), t.operation.to_owned(), t.resource.to_owned()));
            prop_assert_eq!(
                split,
                expected.map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()))
            );
            let cut = match topic.match_indices('/').nth(1) {
                Some((end, _)) => &topic[..end],
                None => &topic[..],
            };
            prop_assert_eq!(type_level(&topic), cut);
        }
    }

    #[test]
    fn a_three_level_resource_topic_splits() {
        let t =
            InboundTopic::parse("ke", "ke/meta/edgecontroller/insert/default/pod/nginx").unwrap();
        assert_eq!(t.from, "edgecontroller");
        assert_eq!(t.operation(), Some(Operation::Insert));
        assert_eq!(t.resource().unwrap().key(), "default/pod/nginx");
    }

    #[test]
    fn a_two_level_resource_topic_splits() {
        let t = InboundTopic::parse("ke", "ke/meta/edged/query/default/pod").unwrap();
        assert_eq!(t.resource().unwrap().id(), None);
    }

    #[test]
    fn a_custom_root_is_honoured() {
        assert!(InboundTopic::parse("site7", "site7/meta/edged/query/default/pod").is_ok());
        assert!(InboundTopic::parse("site7", "ke/meta/edged/query/default/pod").is_err());
    }

    #[test]
    fn wrong_resource_shapes_are_kept_for_the_error_reply() {
        let one = InboundTopic::parse("ke", "ke/meta/edged/insert/pod").unwrap();
        assert_eq!(one.resource, "pod");
        assert!(one.resource().is_err());
        let five = InboundTopic::parse("ke", "ke/meta/edged/insert/a/b/c/d/e").unwrap();
        assert_eq!(five.resource, "a/b/c/d/e");
        assert!(five.resource().is_err());
        let none = InboundTopic::parse("ke", "ke/meta/edged/insert").unwrap();
        assert_eq!(none.resource, "");
        assert!(none.resource().is_err());
    }

    #[test]
    fn unknown_operations_are_kept_for_the_error_reply() {
        let t = InboundTopic::parse("ke", "ke/meta/edged/frobnicate/default/pod/x").unwrap();
        assert_eq!(t.operation, "frobnicate");
        assert_eq!(t.operation(), None);
    }

    #[test]
    fn topics_without_a_sender_are_unaddressable() {
        for topic in [
            "ke",
            "ke/meta",
            "ke/meta/",
            "ke/meta//insert/a/b",
            "ke/edged/edged/insert/a/b",
            "kex/meta/edged/insert/a/b",
            "ke/metax/edged/insert/a/b",
        ] {
            assert!(InboundTopic::parse("ke", topic).is_err(), "{topic}");
        }
    }

    #[test]
    fn topics_to_other_modules_split_the_same_way() {
        let t =
            InboundTopic::addressed_to("ke", EDGED, "ke/edged/meta/response/default/pod").unwrap();
        assert_eq!(
            (t.from, t.operation, t.resource),
            ("meta", "response", "default/pod")
        );
        assert!(
            InboundTopic::addressed_to("ke", EDGED, "ke/meta/edged/query/default/pod").is_err()
        );
        let err = InboundTopic::addressed_to("ke", EDGED, "ke/edged").unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"topic "ke/edged" is not <root>/edged/<from>/<operation>/<namespace>/<type>[/<name>]"#
        );
        let err = InboundTopic::parse("ke", "ke/meta").unwrap_err();
        assert_eq!(
            err.to_string(),
            r#"topic "ke/meta" is not <root>/meta/<from>/<operation>/<namespace>/<type>[/<name>]"#
        );
    }

    #[test]
    fn replies_to_cloud_sources_go_to_the_cloud_module() {
        assert_eq!(reply_module("edgecontroller"), "cloud");
        assert_eq!(reply_module("funcmgr"), "cloud");
        assert_eq!(reply_module("edged"), "edged");
        assert_eq!(reply_module("device"), "device");
    }

    #[test]
    fn outbound_topics_name_the_type_not_the_object() {
        assert_eq!(
            outbound("ke", "cloud", "meta", "response", "default/pod/nginx"),
            "ke/cloud/meta/response/default/pod"
        );
        assert_eq!(
            outbound("ke", "edged", "edged", "query", "default/pod"),
            "ke/edged/edged/query/default/pod"
        );
        assert_eq!(
            outbound("ke", "edged", "meta", "error", ""),
            "ke/edged/meta/error"
        );
    }

    #[test]
    fn malformed_resources_are_cut_to_two_levels_too() {
        for (raw, cut) in [
            ("a/b/c/d", "a/b"),
            ("pod", "pod"),
            ("", ""),
            ("a//c", "a/"),
            ("/pod/x", "/pod"),
        ] {
            assert_eq!(type_level(raw), cut, "{raw:?}");
        }
    }
}
