//! The KubeEdge `model.Message` JSON envelope (protocol §1), full or bare.

use std::borrow::Cow;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::Error;

/// `header` of a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    #[serde(default = "new_msg_id")]
    pub msg_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_msg_id: Option<String>,
    #[serde(default = "now_ms")]
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resourceversion: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<bool>,
}

/// `route` of a message: who sent it and what it is about.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Route {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub group: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub operation: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource: String,
}

/// A whole message. `content` stays the sender's JSON text: it is stored and forwarded verbatim.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    pub header: Header,
    pub route: Route,
    pub content: Box<RawValue>,
}

/// `t` as `YYYY-MM-DDTHH:MM:SSZ`, as Kubernetes and Go's `time.RFC3339` write UTC times.
pub fn rfc3339(t: SystemTime) -> String {
    let t = time::OffsetDateTime::from(t);
    t.replace_nanosecond(0)
        .unwrap_or(t)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// A fresh UUIDv4 message id.
pub fn new_msg_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Milliseconds since the epoch, KubeEdge's timestamp unit.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The JSON `null`, for messages with no content.
pub fn null() -> Box<RawValue> {
    raw("null")
}

/// Wraps JSON text that is known to be valid (it panics on anything else).
pub fn raw(json: &str) -> Box<RawValue> {
    RawValue::from_string(json.to_owned()).expect("caller passes valid JSON")
}

/// A JSON string value holding `text`.
pub fn json_string(text: &str) -> Box<RawValue> {
    serde_json::value::to_raw_value(text).expect("a string always serializes")
}

/// The `msg_id` a sender put in a full envelope, read even when the message is refused for its
/// topic, so the error reply can name the request.
pub fn sender_msg_id(payload: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Ids {
        header: Header,
    }
    #[derive(Deserialize)]
    struct Header {
        msg_id: String,
    }
    serde_json::from_slice::<Ids>(payload)
        .ok()
        .map(|ids| ids.header.msg_id)
        .filter(|id| !id.is_empty())
}

/// `metadata.name` and `metadata.namespace` of a Kubernetes-style object in `content`, where
/// they are JSON strings; borrowed from the content unless they contain escapes.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ObjectMeta<'a> {
    pub name: Option<Cow<'a, str>>,
    pub namespace: Option<Cow<'a, str>>,
}

impl<'a> ObjectMeta<'a> {
    /// Reads only these two fields, skipping the rest of the document without building it.
    /// Anything that is not an object with an object `metadata` has neither.
    pub fn of(content: &'a RawValue) -> ObjectMeta<'a> {
        #[derive(Deserialize)]
        struct Object<'a> {
            #[serde(borrow)]
            metadata: Option<ObjectOnly<Fields<'a>>>,
        }
        #[derive(Deserialize)]
        struct Fields<'a> {
            #[serde(borrow)]
            name: Option<&'a RawValue>,
            #[serde(borrow)]
            namespace: Option<&'a RawValue>,
        }
        // serde would also read a struct from a JSON array, by position.
        fn object<'a, T: Deserialize<'a>>(raw: &'a RawValue) -> Option<T> {
            let text = raw.get();
            text.starts_with('{')
                .then(|| serde_json::from_str(text).ok())
                .flatten()
        }
        fn text(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
            let raw = raw?.get();
            match serde_json::from_str::<&str>(raw) {
                Ok(text) => Some(Cow::Borrowed(text)),
                Err(_) => serde_json::from_str::<String>(raw).ok().map(Cow::Owned),
            }
        }
        // One pass: a `metadata` that is not an object fails it, as no metadata.
        let fields = object::<Object<'a>>(content)
            .and_then(|o| o.metadata)
            .map(|ObjectOnly(fields)| fields);
        match fields {
            Some(f) => ObjectMeta {
                name: text(f.name),
                namespace: text(f.namespace),
            },
            None => ObjectMeta::default(),
        }
    }
}

/// The only keys we look at to tell a full envelope from a bare payload.
#[derive(Deserialize)]
struct Probe<'a> {
    #[serde(borrow)]
    header: Option<&'a RawValue>,
    #[serde(borrow)]
    route: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
}

/// A payload read in one pass, header and route straight into their types; what this cannot
/// read (a header that is an array, say) is read again the [`Probe`] way, for its error.
#[derive(Deserialize)]
struct Full<'a> {
    header: Option<ObjectOnly<Header>>,
    route: Option<ObjectOnly<Route>>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
}

/// A `T` read only from a JSON object: serde's derive would also read a struct from an array,
/// by position.
struct ObjectOnly<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Object<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Object<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        deserializer
            .deserialize_map(Object(std::marker::PhantomData))
            .map(ObjectOnly)
    }
}

impl Envelope {
    /// Reads a payload: a JSON object with `header` and `route` is a full envelope; anything else
    /// is the content of a new message (invalid JSON becomes a JSON string, empty becomes `null`).
    pub fn parse(payload: &[u8]) -> Result<Envelope, Error> {
        // One pass for what arrives well-formed; [`Probe`] tells the rest apart as before.
        // UTF-8 checked once for the whole payload: from bytes, serde_json checks each string
        // again as it reads it (a sixth of the pass for a pod). A payload that is not UTF-8 is
        // no JSON serde_json would read either: it goes straight to the paths below.
        let full = std::str::from_utf8(payload)
            .map_err(drop)
            .and_then(|text| serde_json::from_str::<Full<'_>>(text).map_err(drop));
        match full {
            Ok(Full {
                header: Some(ObjectOnly(header)),
                route: Some(ObjectOnly(route)),
                content,
            }) => {
                let content = content.map_or_else(null, |c| c.to_owned());
                return Ok(Envelope {
                    header,
                    route,
                    content,
                });
            }
            Ok(_) => {
                let content = raw_json(payload).ok_or(Error::NotText)?;
                return Ok(Envelope::new(Route::default(), content));
            }
            Err(_) => {}
        }
        let content = match serde_json::from_slice::<Probe<'_>>(payload) {
            Ok(Probe {
                header: Some(header),
                route: Some(route),
                content,
            }) => {
                let header = object(header, "header")?;
                let route = object(route, "route")?;
                let content = content.map_or_else(null, |c| c.to_owned());
                return Ok(Envelope {
                    header,
                    route,
                    content,
                });
            }
            Ok(_) => raw_json(payload).ok_or(Error::NotText)?,
            Err(_) => bare_content(payload)?,
        };
        Ok(Envelope::new(Route::default(), content))
    }

    /// A new message with a fresh id and timestamp.
    pub fn new(route: Route, content: Box<RawValue>) -> Envelope {
        Envelope {
            header: Header {
                msg_id: new_msg_id(),
                parent_msg_id: None,
                timestamp: now_ms(),
                resourceversion: None,
                sync: None,
            },
            route,
            content,
        }
    }

    /// The wire form: what `serde_json::to_vec` writes (a test holds them equal), written by hand
    /// because every hand-on is one. serde_json escapes each key and string byte by byte; here
    /// keys are literals and a string with nothing to escape is copied whole.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Sized for the content and a usual header and route: one allocation, no regrowth.
        let mut out = Vec::with_capacity(self.content.get().len() + 384);
        let Header {
            msg_id,
            parent_msg_id,
            timestamp,
            resourceversion,
            sync,
        } = &self.header;
        out.extend_from_slice(b"{\"header\":{\"msg_id\":");
        json_str(&mut out, msg_id);
        if let Some(parent) = parent_msg_id {
            out.extend_from_slice(b",\"parent_msg_id\":");
            json_str(&mut out, parent);
        }
        out.extend_from_slice(b",\"timestamp\":");
        out.extend_from_slice(itoa::Buffer::new().format(*timestamp).as_bytes());
        if let Some(version) = resourceversion {
            out.extend_from_slice(b",\"resourceversion\":");
            json_str(&mut out, version);
        }
        if let Some(sync) = sync {
            out.extend_from_slice(if *sync {
                b",\"sync\":true"
            } else {
                b",\"sync\":false"
            });
        }
        out.extend_from_slice(b"},\"route\":{");
        let mut first = true;
        for (key, value) in [
            (&b"\"source\":"[..], &self.route.source),
            (b"\"group\":", &self.route.group),
            (b"\"operation\":", &self.route.operation),
            (b"\"resource\":", &self.route.resource),
        ] {
            if value.is_empty() {
                continue;
            }
            if !first {
                out.push(b',');
            }
            first = false;
            out.extend_from_slice(key);
            json_str(&mut out, value);
        }
        out.extend_from_slice(b"},\"content\":");
        out.extend_from_slice(self.content.get().as_bytes());
        out.push(b'}');
        out
    }

    /// `content` when it is a JSON string, unescaped.
    pub fn content_str(&self) -> Option<String> {
        serde_json::from_str::<String>(self.content.get()).ok()
    }
}

/// Appends `text` as a JSON string, escaped as serde_json escapes it.
fn json_str(out: &mut Vec<u8>, text: &str) {
    if !needs_escape(text.as_bytes()) {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(out, text).expect("a string always serializes");
    }
}

/// Whether any byte is a control character, `"` or `\`: eight bytes a step. Each word test is
/// true only when some byte of the word matches (the "haszero"/"hasless" tests of Bit Twiddling
/// Hacks), so no string is escaped that serde_json would not escape.
fn needs_escape(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    let zero_in = |v: u64| v.wrapping_sub(ONES) & !v & HIGH != 0;
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        let v = u64::from_ne_bytes(word.try_into().expect("eight bytes"));
        if v.wrapping_sub(ONES * 0x20) & !v & HIGH != 0
            || zero_in(v ^ (ONES * u64::from(b'"')))
            || zero_in(v ^ (ONES * u64::from(b'\\')))
        {
            return true;
        }
    }
    words
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

/// Deserializes a header or route, which must be a JSON object (serde would also take an array).
fn object<T: serde::de::DeserializeOwned>(raw: &RawValue, what: &str) -> Result<T, Error> {
    if !raw.get().starts_with('{') {
        let e = <serde_json::Error as serde::de::Error>::custom(format!(
            "{what} must be a JSON object"
        ));
        return Err(Error::InvalidEnvelope(e));
    }
    serde_json::from_str(raw.get()).map_err(Error::InvalidEnvelope)
}

fn raw_json(payload: &[u8]) -> Option<Box<RawValue>> {
    let text = std::str::from_utf8(payload).ok()?;
    RawValue::from_string(text.trim().to_owned()).ok()
}

/// A payload that is not a JSON object with header and route.
fn bare_content(payload: &[u8]) -> Result<Box<RawValue>, Error> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(null());
    }
    if let Some(json) = raw_json(payload) {
        return Ok(json);
    }
    let text = std::str::from_utf8(payload).map_err(|_| Error::NotText)?;
    if text.contains('\0') {
        return Err(Error::NotText);
    }
    // Text that opens like an object or array was meant as JSON: storing it as a string would
    // keep a truncated document and tell the sender "OK".
    if text.trim_start().starts_with(['{', '[']) {
        let error = serde_json::from_str::<&RawValue>(text).expect_err("it did not parse before");
        return Err(Error::MalformedJson(error));
    }
    Ok(json_string(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn needs_escape_finds_every_byte_serde_escapes_at_every_position() {
        for byte in 0..=u8::MAX {
            let escaped = byte < 0x20 || byte == b'"' || byte == b'\\';
            for at in 0..17 {
                let mut text = [b'a'; 17];
                text[at] = byte;
                assert_eq!(needs_escape(&text), escaped, "byte {byte:#x} at {at}");
            }
        }
    }

    proptest! {
        /// The hand-written wire form is serde's, byte for byte, whatever the strings hold.
        #[test]
        fn to_bytes_writes_what_serde_writes(
            msg_id in ".{0,40}",
            parent in proptest::option::of("[a-z0-9\"\\\\\u{0}-\u{1f}\u{7f}é😀-]{0,20}"),
            timestamp in any::<i64>(),
            version in proptest::option::of("\\PC{0,8}"),
            sync in proptest::option::of(any::<bool>()),
            route in proptest::array::uniform4(proptest::option::of(".{0,24}")),
            content in prop_oneof![Just("null"), Just("{\"a\":[1,\"\\u0000\"]}"), Just("\"x\\ny\"")],
        ) {
            let [source, group, operation, resource] = route.map(Option::unwrap_or_default);
            let envelope = Envelope {
                header: Header { msg_id, parent_msg_id: parent, timestamp, resourceversion: version, sync },
                route: Route { source, group, operation, resource },
                content: RawValue::from_string(content.to_owned()).unwrap(),
            };
            prop_assert_eq!(
                String::from_utf8(envelope.to_bytes()).unwrap(),
                serde_json::to_string(&envelope).unwrap()
            );
        }
    }

    #[test]
    fn a_full_envelope_keeps_ids_route_and_raw_content() {
        let payload = br#"{"header":{"msg_id":"m1","parent_msg_id":"p0","timestamp":5,"resourceversion":"9","sync":true},
            "route":{"source":"edgecontroller","group":"resource","operation":"insert","resource":"default/pod/nginx"},
            "content":{"b": 1,  "a":[2]}}"#;
        let e = Envelope::parse(payload).unwrap();
        assert_eq!(e.header.msg_id, "m1");
        assert_eq!(e.header.parent_msg_id.as_deref(), Some("p0"));
        assert_eq!(e.header.timestamp, 5);
        assert_eq!(e.header.sync, Some(true));
        assert_eq!(e.route.source, "edgecontroller");
        assert_eq!(e.content.get(), r#"{"b": 1,  "a":[2]}"#);
    }

    #[test]
    fn a_full_envelope_without_content_has_null_content_and_fills_missing_ids() {
        let e = Envelope::parse(br#"{"header":{},"route":{}}"#).unwrap();
        assert_eq!(e.content.get(), "null");
        assert_eq!(e.header.msg_id.len(), 36);
        assert!(e.header.timestamp > 0);
    }

    #[test]
    fn the_senders_msg_id_is_read_from_a_full_envelope_only() {
        let full = br#"{"header":{"msg_id":"m7","timestamp":1},"route":{},"content":[1]}"#;
        assert_eq!(sender_msg_id(full).as_deref(), Some("m7"));
        assert_eq!(sender_msg_id(br#"{"data":1}"#), None);
        assert_eq!(sender_msg_id(b"not json"), None);
        assert_eq!(sender_msg_id(br#"{"header":{"msg_id":""}}"#), None);
    }

    #[test]
    fn a_json_object_without_header_and_route_is_bare_content() {
        let e = Envelope::parse(br#"{"data":{"k":"v"},"route":1}"#).unwrap();
        assert_eq!(e.content.get(), r#"{"data":{"k":"v"},"route":1}"#);
        assert_eq!(e.header.msg_id.len(), 36);
    }

    #[test]
    fn bare_json_values_of_every_kind_are_content() {
        for json in ["[1,2]", "\"text\"", "42", "true", "null"] {
            assert_eq!(
                Envelope::parse(json.as_bytes()).unwrap().content.get(),
                json
            );
        }
    }

    #[test]
    fn an_empty_payload_is_null_content() {
        assert_eq!(Envelope::parse(b"").unwrap().content.get(), "null");
        assert_eq!(Envelope::parse(b" \n").unwrap().content.get(), "null");
    }

    #[test]
    fn text_that_is_not_json_becomes_a_json_string() {
        let e = Envelope::parse(b"cloud_connected").unwrap();
        assert_eq!(e.content.get(), "\"cloud_connected\"");
        assert_eq!(e.content_str().as_deref(), Some("cloud_connected"));
    }

    #[test]
    fn text_that_opens_like_json_but_does_not_parse_is_malformed() {
        for payload in [
            "{\"unterminated\": ",
            "[1,2",
            " {\"a\":1}}",
            "{'single':'quotes'}",
        ] {
            let err = Envelope::parse(payload.as_bytes()).unwrap_err();
            assert!(matches!(err, Error::MalformedJson(_)), "{payload}");
            assert!(err.to_string().starts_with("malformed JSON: "), "{err}");
        }
    }

    #[test]
    fn binary_garbage_is_refused() {
        for payload in [&[0xff, 0xfe, 0x00, 0x80][..], &[0xc3, 0x28], b"a\0b"] {
            assert!(
                matches!(Envelope::parse(payload), Err(Error::NotText)),
                "{payload:?}"
            );
        }
    }

    #[test]
    fn a_malformed_header_or_route_is_an_invalid_envelope() {
        for payload in [
            r#"{"header":{"msg_id":5},"route":{}}"#,
            r#"{"header":[],"route":{}}"#,
            r#"{"header":{},"route":"x"}"#,
            r#"{"header":{"timestamp":"soon"},"route":{}}"#,
            r#"{"header":{},"route":{"source":7}}"#,
        ] {
            let err = Envelope::parse(payload.as_bytes()).unwrap_err();
            assert!(matches!(err, Error::InvalidEnvelope(_)), "{payload}");
            assert!(err.to_string().starts_with("invalid envelope: "));
        }
    }

    #[test]
    fn object_metadata_is_read_from_objects_only() {
        let meta = |json: &str| {
            let content = raw(json);
            let m = ObjectMeta::of(&content);
            (
                m.name.map(Cow::into_owned),
                m.namespace.map(Cow::into_owned),
            )
        };
        let some = |s: &str| Some(s.to_owned());
        assert_eq!(
            meta(
                r#"{"kind":"Pod","metadata":{"namespace":"ns","labels":{"a":"b"},"name":"web"},"spec":[1]}"#
            ),
            (some("web"), some("ns"))
        );
        assert_eq!(
            meta(r#"{"metadata":{"name":"caf\u00e9"}}"#),
            (some("café"), None)
        );
        for none in [
            r#"{"metadata":{"name":5,"namespace":null}}"#,
            r#"{"metadata":["web","ns"]}"#,
            r#"[{"name":"web"}]"#,
            r#"{"metadata":null}"#,
            r#"{"spec":{"metadata":{"name":"inner"}}}"#,
            r#""web""#,
            "null",
        ] {
            assert_eq!(meta(none), (None, None), "{none}");
        }
    }

    #[test]
    fn serialization_round_trips() {
        let mut e = Envelope::new(Route::default(), raw(r#"{"x":[1]}"#));
        e.route.operation = "insert".into();
        e.header.parent_msg_id = Some("p".into());
        let back = Envelope::parse(&e.to_bytes()).unwrap();
        assert_eq!(back.header, e.header);
        assert_eq!(back.route, e.route);
        assert_eq!(back.content.get(), e.content.get());
    }
}
