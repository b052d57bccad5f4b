//! A stored object made ready to serve: the JSON the cloud sent, with `metadata.resourceVersion`
//! set to the node-local version (and `kind`, `apiVersion`, `metadata.namespace` filled in when
//! missing). Only `metadata` is parsed; the rest is carried as raw JSON, so a list of
//! thousands of pods is mostly copied, not rebuilt.

use std::collections::BTreeMap;

use edgemeta_kubewire::{FieldSelector, Kind, LabelSelector};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::Error;

/// One object to serve.
pub struct Object {
    fields: BTreeMap<String, Box<RawValue>>,
    metadata: Map<String, Value>,
}

/// The fields a field selector may name (the API server accepts only some per type).
const FIELDS: &[&str] = &["metadata.name", "metadata.namespace", "spec.nodeName"];

/// A label and a field selector.
#[derive(Debug, Clone, Default)]
pub struct Selectors {
    labels: LabelSelector,
    fields: FieldSelector,
    /// The field selector names `spec.nodeName`: each object's spec is read.
    node_name: bool,
    any: bool,
}

impl Selectors {
    /// Parses `labelSelector` and `fieldSelector`; fields other than [`FIELDS`] are refused.
    pub fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Selectors, Error> {
        let labels_text = labels.unwrap_or_default();
        let fields_text = fields.unwrap_or_default();
        for term in fields_text.split(',').filter(|t| !t.trim().is_empty()) {
            let path = term.split(['=', '!']).next().unwrap_or_default().trim();
            if !FIELDS.contains(&path) {
                return Err(Error::BadRequest(format!(
                    "field label not supported: {path}"
                )));
            }
        }
        Ok(Selectors {
            labels: LabelSelector::parse(labels_text)?,
            fields: FieldSelector::parse(fields_text)?,
            node_name: fields_text.contains("spec.nodeName"),
            any: !labels_text.trim().is_empty() || !fields_text.trim().is_empty(),
        })
    }

    /// Whether any selector was given.
    pub fn any(&self) -> bool {
        self.any
    }

    /// Whether `object` is selected.
    pub fn matches(&self, object: &Object) -> bool {
        if !self.any {
            return true;
        }
        let mut view = json!({"metadata": object.metadata});
        if self.node_name {
            view["spec"] = json!({"nodeName": object.node_name()});
        }
        self.labels.matches(&view) && self.fields.matches(&view)
    }
}

#[derive(Deserialize)]
struct Spec {
    #[serde(rename = "nodeName", default)]
    node_name: Option<String>,
}

impl Object {
    /// Reads the stored `value` of `key` (`<namespace>/<type>/<name>`) as an object of `kind` at
    /// version `rv`; `None` when the value is not a JSON object.
    pub fn parse(kind: &Kind, key: &str, value: &str, rv: u64) -> Option<Object> {
        let mut fields: BTreeMap<String, Box<RawValue>> = serde_json::from_str(value).ok()?;
        let mut metadata: Map<String, Value> = match fields.remove("metadata") {
            Some(raw) => serde_json::from_str(raw.get()).ok()?,
            None => Map::new(),
        };
        let mut levels = key.splitn(3, '/');
        let (namespace, name) = (levels.next()?, levels.nth(1)?);
        metadata.insert("resourceVersion".into(), Value::String(rv.to_string()));
        if !metadata.contains_key("name") {
            metadata.insert("name".into(), Value::String(name.to_owned()));
        }
        if kind.namespaced {
            if !metadata.contains_key("namespace") {
                metadata.insert("namespace".into(), Value::String(namespace.to_owned()));
            }
        } else {
            metadata.remove("namespace");
        }
        fields.insert("kind".into(), raw_string(kind.kind));
        fields.insert("apiVersion".into(), raw_string(&kind.api_version()));
        Some(Object { fields, metadata })
    }

    /// `spec.nodeName`, or "" (unscheduled, or no spec).
    fn node_name(&self) -> String {
        self.fields
            .get("spec")
            .and_then(|raw| serde_json::from_str::<Spec>(raw.get()).ok())
            .and_then(|spec| spec.node_name)
            .unwrap_or_default()
    }

    /// The object as JSON text.
    pub fn to_json(&self) -> String {
        let mut out = String::with_capacity(256);
        self.write(&mut out);
        out
    }

    /// Appends the object as JSON text to `out`.
    pub fn write(&self, out: &mut String) {
        out.push('{');
        out.push_str("\"metadata\":");
        out.push_str(&serde_json::to_string(&self.metadata).unwrap_or_else(|_| "{}".into()));
        for (key, raw) in &self.fields {
            out.push(',');
            out.push_str(&serde_json::to_string(key).unwrap_or_default());
            out.push(':');
            out.push_str(raw.get());
        }
        out.push('}');
    }

    /// The whole object as a `Value` (for Tables).
    pub fn to_value(&self) -> Value {
        serde_json::from_str(&self.to_json()).unwrap_or(Value::Null)
    }
}

fn raw_string(text: &str) -> Box<RawValue> {
    // A JSON string is always valid raw JSON.
    RawValue::from_string(Value::String(text.to_owned()).to_string())
        .unwrap_or_else(|_| RawValue::NULL.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_version_replaces_the_clouds_and_missing_fields_are_filled() {
        let kind = &crate::kinds::ALL[0];
        let stored = r#"{"metadata":{"name":"a","resourceVersion":"99","labels":{"app":"web"}},"spec":{"nodeName":"edge-1"}}"#;
        let object = Object::parse(kind, "default/pod/a", stored, 7).expect("object");
        let value: Value = serde_json::from_str(&object.to_json()).expect("json");
        assert_eq!(value["metadata"]["resourceVersion"], "7");
        assert_eq!(value["metadata"]["namespace"], "default");
        assert_eq!(value["kind"], "Pod");
        assert_eq!(value["apiVersion"], "v1");
        assert_eq!(value["spec"]["nodeName"], "edge-1");
        let on_node = Selectors::parse(Some("app=web"), Some("spec.nodeName=edge-1")).expect("ok");
        assert!(on_node.matches(&object));
        let elsewhere = Selectors::parse(None, Some("spec.nodeName=edge-2")).expect("ok");
        assert!(!elsewhere.matches(&object));
        assert!(Selectors::parse(None, Some("status.phase=Running")).is_err());
        assert!(Object::parse(kind, "default/pod/a", "[1]", 1).is_none());
    }
}
