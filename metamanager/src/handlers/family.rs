//! What a message family declares: its topic shape, its result topic, its `apply` and how its
//! failures are answered. A family is one file of `handlers/` and one row of
//! [`super::DEVICES`].

use std::future::Future;
use std::pin::Pin;

use crate::devices::{
    device_id, device_topic, is_level, is_user_topic, node_topic, valid_id, Event,
};
use crate::error::Error;
use crate::unit::Context;

/// A running `apply`.
pub(crate) type Applying<'a> = Pin<Box<dyn Future<Output = Result<(), Error>> + 'a>>;

/// One message family.
pub(crate) struct Family {
    /// Its `kind` label on `edgemeta_device_messages_total`.
    pub(crate) kind: &'static str,
    /// The topics it takes.
    pub(crate) shape: Shape,
    /// Where its answers go.
    pub(crate) result: ResultTopic,
    /// Whether a failure (a store error, a full outbox, bad input refused before it ran) is
    /// answered on [`Family::result`]; otherwise it is only logged.
    pub(crate) answers_failures: bool,
    /// Applies one message. Bad input is answered on the result topic and changes nothing; only
    /// a store failure is an `Err` (the message's changes are undone).
    pub(crate) apply: Apply,
}

/// A family's `apply`.
pub(crate) type Apply = for<'a, 'c> fn(&'a Event, &'a mut Context<'c>) -> Applying<'a>;

/// The topics a family takes, in the clients' form.
pub(crate) enum Shape {
    /// `<prefix><id><suffix>`: a device id of one or two levels in between.
    Device {
        prefix: &'static str,
        suffix: &'static str,
    },
    /// `$hw/events/node/<node>/<action>`, for any node.
    Node { action: &'static str },
    /// `SYS/dis/upload_records`, `$hw/events/upload/#` and edge apps' user topics (`+/user/#`).
    Upload,
    /// The devicecontroller's `operations` of `<namespace>/<res_type>`; with `named`, the
    /// resource names a device (`<ns>/<res_type>/<name>`), whose id the event carries.
    Cloud {
        namespace: Option<&'static str>,
        res_type: &'static str,
        named: bool,
        operations: &'static [&'static str],
    },
    /// No topic: only the node's own DMI server hands these in (`crate::DeviceReports`).
    Internal,
}

/// Where a family's answers go.
pub(crate) enum ResultTopic {
    /// Nowhere: nothing is answered.
    None,
    /// `$hw/events/device/<id><suffix>/result`.
    DeviceResult(&'static str),
    /// `$hw/events/node/<this node><suffix>`.
    Node(&'static str),
}

impl Family {
    /// A mapper's request about one device, `$hw/events/device/<id><suffix>`, answered (failures
    /// too) on `$hw/events/device/<id><suffix>/result`.
    pub(crate) const fn mapper_request(
        kind: &'static str,
        suffix: &'static str,
        apply: Apply,
    ) -> Family {
        Family {
            kind,
            shape: Shape::Device {
                prefix: "$hw/events/device/",
                suffix,
            },
            result: ResultTopic::DeviceResult(suffix),
            answers_failures: true,
            apply,
        }
    }

    /// The devicecontroller's `update` of `<namespace>/<res_type>[/<name>]`, answered nowhere.
    pub(crate) const fn from_cloud(
        kind: &'static str,
        namespace: Option<&'static str>,
        res_type: &'static str,
        named: bool,
        apply: Apply,
    ) -> Family {
        Family::cloud_objects(kind, namespace, res_type, named, &["update"], apply)
    }

    /// The devicecontroller's `operations` of `<namespace>/<res_type>[/<name>]`, answered
    /// nowhere.
    pub(crate) const fn cloud_objects(
        kind: &'static str,
        namespace: Option<&'static str>,
        res_type: &'static str,
        named: bool,
        operations: &'static [&'static str],
        apply: Apply,
    ) -> Family {
        Family {
            kind,
            shape: Shape::Cloud {
                namespace,
                res_type,
                named,
                operations,
            },
            result: ResultTopic::None,
            answers_failures: false,
            apply,
        }
    }

    /// The result topic for the device `id`, on node `node`.
    pub(crate) fn result_topic(&self, id: &str, node: &str) -> Option<String> {
        match self.result {
            ResultTopic::None => None,
            ResultTopic::DeviceResult(suffix) => {
                Some(device_topic(id, &format!("{suffix}/result")))
            }
            ResultTopic::Node(suffix) => Some(node_topic(node, suffix)),
        }
    }
}

impl Shape {
    /// The device id a local topic (clients' form) of this shape names, if it is one.
    pub(crate) fn local(&self, topic: &str) -> Option<String> {
        match *self {
            Shape::Device { prefix, suffix } => {
                let id = topic.strip_prefix(prefix)?.strip_suffix(suffix)?;
                valid_id(id).then(|| id.to_owned())
            }
            Shape::Node { action } => {
                let rest = topic.strip_prefix("$hw/events/node/")?;
                let (node, rest) = rest.split_once('/')?;
                (is_level(node) && rest == action).then(String::new)
            }
            // `$hw/events/upload/#` matches its parent level too (MQTT 3.1.1 §4.7.1.2).
            Shape::Upload => (topic == "SYS/dis/upload_records"
                || topic == "$hw/events/upload"
                || topic.starts_with("$hw/events/upload/")
                || is_user_topic(topic))
            .then(String::new),
            Shape::Cloud { .. } | Shape::Internal => None,
        }
    }

    /// The device id a devicecontroller message on `<ns>/<type>[/<name>]` of this shape names
    /// (empty when the shape names none), if it is one.
    pub(crate) fn cloud(
        &self,
        operation: &str,
        namespace: &str,
        res_type: &str,
        name: Option<&str>,
    ) -> Option<String> {
        let Shape::Cloud {
            namespace: want,
            res_type: want_type,
            named,
            operations,
        } = *self
        else {
            return None;
        };
        if !operations.contains(&operation) || res_type != want_type {
            return None;
        }
        if want.is_some_and(|want| want != namespace) {
            return None;
        }
        if named {
            name.map(|name| device_id(namespace, name))
        } else {
            Some(String::new())
        }
    }
}

/// An `apply` that is an `async fn`, as [`Family::apply`] holds it.
macro_rules! applying {
    ($apply:path) => {{
        fn run<'a>(
            event: &'a crate::devices::Event,
            cx: &'a mut crate::unit::Context<'_>,
        ) -> crate::handlers::family::Applying<'a> {
            Box::pin($apply(event, cx))
        }
        run
    }};
}
pub(crate) use applying;
