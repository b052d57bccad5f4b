//! Property tests: whatever bytes arrive as topic or payload, parsing yields a value or an
//! error, never a panic, and every error reply is itself a well-formed message.

use edgemeta_broker::Message;
use edgemeta_metamanager::{parse_message as parse, IntakeConfig};
use edgemeta_protocol::Envelope;
use edgemeta_protocol::InboundTopic;
use edgemeta_protocol::Resource;
use proptest::prelude::*;

fn config() -> IntakeConfig {
    IntakeConfig {
        root: "ke".into(),
        node: "n1".into(),
        max_payload_bytes: 4096,
        meters: std::sync::Arc::new(edgemeta_metamanager::Meters::noop()),
    }
}

/// Topics that look like ours often enough to reach every branch.
fn topic() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "(ke|kx)(/[a-z]{0,6}){0,8}",
        "ke/meta/[a-z]{0,8}/(insert|update|delete|query|response|error|connect|meta-internal-sync|action|action_result|createvolume|frob)(/[a-z0-9/]{0,4}){0,6}",
        // Type-level topics, whose name must come from the payload.
        "ke/meta/(edged|edgecontroller)/(insert|update|query|response)/[a-z]{1,3}/[a-z]{1,3}",
    ]
}

/// Payloads: random bytes, random text, and envelope-shaped JSON with random parts.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        any::<String>().prop_map(String::into_bytes),
        (
            "[a-z0-9\"{}\\[\\]:, ]{0,40}",
            "[a-z0-9\"{}\\[\\]:, ]{0,40}",
            "[a-z0-9\"{}\\[\\]:, ]{0,40}"
        )
            .prop_map(
                |(h, r, c)| format!(r#"{{"header":{h},"route":{r},"content":{c}}}"#).into_bytes()
            ),
        // Objects with metadata and routes that may or may not name them.
        (
            "[a-z0-9/+#\"]{0,8}",
            "[a-z0-9/+#\"]{0,8}",
            "[a-z0-9/+#\"]{0,12}"
        )
            .prop_map(|(name, ns, resource)| format!(
                r#"{{"header":{{}},"route":{{"resource":"{resource}"}},"content":{{"metadata":{{"name":"{name}","namespace":"{ns}"}}}}}}"#
            ).into_bytes()),
        ("[a-z0-9/+#]{0,8}", "[a-z0-9]{0,3}")
            .prop_map(|(name, ns)| format!(r#"{{"metadata":{{"name":"{name}","namespace":"{ns}"}}}}"#).into_bytes()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn any_payload_parses_or_is_refused(bytes in payload()) {
        if let Ok(envelope) = Envelope::parse(&bytes) {
            // What we accept we can write back, and it reads the same.
            let again = Envelope::parse(&envelope.to_bytes()).expect("our own output parses");
            prop_assert_eq!(again.content.get(), envelope.content.get());
            prop_assert_eq!(again.header, envelope.header);
        }
    }

    #[test]
    fn any_topic_splits_or_is_refused(topic in topic()) {
        if let Ok(t) = InboundTopic::parse("ke", &topic) {
            prop_assert!(!t.from.is_empty());
            let _ = t.operation();
            if let Ok(r) = t.resource() {
                prop_assert_eq!(r.key(), t.resource);
                prop_assert!(!r.namespace().is_empty() && !r.res_type().is_empty());
            }
        }
    }

    #[test]
    fn any_resource_string_parses_or_is_refused(raw in any::<String>()) {
        if let Ok(r) = Resource::parse(&raw) {
            let rebuilt = match r.id() {
                Some(id) => format!("{}/{}/{}", r.namespace(), r.res_type(), id),
                None => format!("{}/{}", r.namespace(), r.res_type()),
            };
            prop_assert_eq!(rebuilt, raw);
        }
    }

    #[test]
    fn any_message_becomes_a_request_or_a_well_formed_error_reply(topic in topic(), bytes in payload()) {
        let message = Message::new(topic, bytes);
        match parse(&config(), &message) {
            Ok(Some(request)) => {
                // Operations on one object always end up with its name (protocol §2, v2).
                if request.operation.needs_name() {
                    prop_assert!(request.resource.id().is_some());
                }
                prop_assert_eq!(request.envelope.route.resource.as_str(), request.resource.key());
            }
            Ok(None) => {}
            Err(refused) => {
                for reply in refused.replies("ke") {
                    let envelope = Envelope::parse(&reply.payload).expect("error replies parse");
                    prop_assert_eq!(envelope.route.operation.as_str(), "error");
                    prop_assert!(reply.topic.starts_with("ke/"));
                    // ke/<to>/meta/error and at most <namespace>/<type>: names stay out.
                    prop_assert!(reply.topic.split('/').count() <= 6, "{}", reply.topic);
                }
            }
        }
    }
}
