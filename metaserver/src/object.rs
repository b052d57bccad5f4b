//! A stored object made ready to serve: the JSON the cloud sent, with `metadata.resourceVersion`
//! set to the node-local version (and `kind`, `apiVersion`, `metadata.name`,
//! `metadata.namespace` filled in when missing). Only the top level and `metadata` are split,
//! borrowing from the stored text; every value is copied as it is, so a list of thousands of
//! pods is mostly copied, not rebuilt.

use std::collections::{BTreeMap, HashMap};

use edgemeta_kubewire::{FieldSelector, Kind, LabelSelector};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::Error;

/// One object to serve, borrowing the stored text.
pub struct Object<'a> {
    fields: BTreeMap<&'a str, &'a RawValue>,
    metadata: BTreeMap<&'a str, &'a RawValue>,
    kind: &'static Kind,
    /// From the key, for a `metadata` without them.
    namespace: &'a str,
    name: &'a str,
    rv: u64,
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
    pub fn matches(&self, object: &Object<'_>) -> bool {
        if !self.any {
            return true;
        }
        let view = object.view(self.node_name);
        self.labels.matches(&view) && self.fields.matches(&view)
    }
}

/// The selectors of a list or watch request.
pub(crate) fn selectors(params: &HashMap<String, String>) -> Result<Selectors, crate::Error> {
    Selectors::parse(
        params.get("labelSelector").map(String::as_str),
        params.get("fieldSelector").map(String::as_str),
    )
}

#[derive(Deserialize)]
struct Spec {
    #[serde(rename = "nodeName", default)]
    node_name: Option<String>,
}

/// Appends `text` as a JSON string.
fn push_string(out: &mut String, text: &str) {
    out.push_str(&serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into()));
}

impl<'a> Object<'a> {
    /// Reads the stored `value` of `key` (`<namespace>/<type>/<name>`) as an object of `kind` at
    /// version `rv`; `None` when the value is not a JSON object (or has escaped keys).
    pub fn parse(kind: &'static Kind, key: &'a str, value: &'a str, rv: u64) -> Option<Object<'a>> {
        let mut fields: BTreeMap<&'a str, &'a RawValue> = serde_json::from_str(value).ok()?;
        let metadata = match fields.remove("metadata") {
            Some(raw) => serde_json::from_str(raw.get()).ok()?,
            None => BTreeMap::new(),
        };
        fields.remove("kind");
        fields.remove("apiVersion");
        let mut levels = key.splitn(3, '/');
        let (namespace, name) = (levels.next()?, levels.nth(1)?);
        Some(Object {
            fields,
            metadata,
            kind,
            namespace,
            name,
            rv,
        })
    }

    /// `metadata.<field>` as a JSON value (small: labels, name, namespace).
    fn meta(&self, field: &str) -> Value {
        self.metadata
            .get(field)
            .and_then(|raw| serde_json::from_str(raw.get()).ok())
            .unwrap_or(Value::Null)
    }

    /// What selectors look at: name, namespace, labels (and `spec.nodeName` when asked).
    fn view(&self, node_name: bool) -> Value {
        let name = match self.meta("name") {
            Value::Null => json!(self.name),
            name => name,
        };
        let mut view = json!({"metadata": {"name": name, "labels": self.meta("labels")}});
        if self.kind.namespaced {
            view["metadata"]["namespace"] = match self.meta("namespace") {
                Value::Null => json!(self.namespace),
                namespace => namespace,
            };
        }
        if node_name {
            view["spec"] = json!({"nodeName": self.node_name()});
        }
        view
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
        let mut out = String::with_capacity(512);
        self.write(&mut out);
        out
    }

    /// Appends the object as JSON text to `out`.
    pub fn write(&self, out: &mut String) {
        out.push_str("{\"kind\":");
        push_string(out, self.kind.kind);
        out.push_str(",\"apiVersion\":");
        push_string(out, &self.kind.api_version());
        out.push_str(",\"metadata\":{\"resourceVersion\":\"");
        out.push_str(&self.rv.to_string());
        out.push('"');
        if !self.metadata.contains_key("name") {
            out.push_str(",\"name\":");
            push_string(out, self.name);
        }
        if self.kind.namespaced && !self.metadata.contains_key("namespace") {
            out.push_str(",\"namespace\":");
            push_string(out, self.namespace);
        }
        for (key, raw) in &self.metadata {
            if *key == "resourceVersion" || (*key == "namespace" && !self.kind.namespaced) {
                continue;
            }
            out.push(',');
            push_string(out, key);
            out.push(':');
            out.push_str(raw.get());
        }
        out.push('}');
        for (key, raw) in &self.fields {
            out.push(',');
            push_string(out, key);
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
