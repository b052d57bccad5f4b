//! Label and field selectors as the API server parses them (`labelSelector=`, `fieldSelector=`).

use serde_json::Value;

/// A selector the API server would refuse (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SelectorError(pub String);

/// One `labelSelector` term.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelTerm {
    Exists(String),
    Absent(String),
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A parsed `labelSelector`: every term must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelTerm>);

/// A parsed `fieldSelector`: `path=value`, `path==value` or `path!=value` terms on dotted paths
/// (`spec.nodeName`, `metadata.name`, `metadata.namespace`, `status.phase`, ...).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

/// Splits on commas outside parentheses (`a in (x,y),b`).
fn terms(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(text[start..].trim());
    out.into_iter().filter(|t| !t.is_empty()).collect()
}

fn set_values(rest: &str, term: &str) -> Result<Vec<String>, SelectorError> {
    let inner = rest
        .trim()
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| SelectorError(format!("unable to parse requirement: {term:?}")))?;
    Ok(inner.split(',').map(|v| v.trim().to_owned()).collect())
}

impl LabelSelector {
    /// Parses the API server's selector syntax; an empty text selects everything.
    pub fn parse(text: &str) -> Result<LabelSelector, SelectorError> {
        let mut out = Vec::new();
        for term in terms(text) {
            let parsed = if let Some(key) = term.strip_prefix('!') {
                LabelTerm::Absent(key.trim().to_owned())
            } else if let Some((k, v)) = term.split_once("!=") {
                LabelTerm::NotEquals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once("==") {
                LabelTerm::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = term.split_once('=') {
                LabelTerm::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, rest)) = term.split_once(" notin ") {
                LabelTerm::NotIn(k.trim().to_owned(), set_values(rest, term)?)
            } else if let Some((k, rest)) = term.split_once(" in ") {
                LabelTerm::In(k.trim().to_owned(), set_values(rest, term)?)
            } else if term.contains([' ', '(', ')']) {
                return Err(SelectorError(format!(
                    "unable to parse requirement: {term:?}"
                )));
            } else {
                LabelTerm::Exists(term.to_owned())
            };
            out.push(parsed);
        }
        Ok(LabelSelector(out))
    }

    /// Whether `object`'s `metadata.labels` satisfy every term.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|term| match term {
            LabelTerm::Exists(k) => get(k).is_some(),
            LabelTerm::Absent(k) => get(k).is_none(),
            LabelTerm::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelTerm::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelTerm::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelTerm::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
        })
    }
}

impl FieldSelector {
    /// Parses `path=value` terms; an empty text selects everything.
    pub fn parse(text: &str) -> Result<FieldSelector, SelectorError> {
        let mut out = Vec::new();
        for term in terms(text) {
            let (path, equal, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, true, v)
            } else {
                return Err(SelectorError(format!(
                    "invalid selector: {term:?}; can't understand it"
                )));
            };
            out.push((path.trim().to_owned(), equal, value.trim().to_owned()));
        }
        Ok(FieldSelector(out))
    }

    /// Whether every term holds; a missing field counts as the empty string (as for
    /// `spec.nodeName=` selecting unscheduled pods).
    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(path, equal, value)| {
            let mut at = object;
            for part in path.split('.') {
                at = &at[part];
            }
            let actual = match at {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (actual == *value) == *equal
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn label_terms_follow_the_api_server_syntax() {
        let pod =
            json!({"metadata": {"labels": {"app": "web", "node-role.kubernetes.io/edge": ""}}});
        for (selector, expected) in [
            ("", true),
            ("node-role.kubernetes.io/edge", true),
            ("node-role.kubernetes.io/edge=", true),
            ("!node-role.kubernetes.io/edge", false),
            ("app=web", true),
            ("app==web,tier", false),
            ("app!=web", false),
            ("app in (db, web)", true),
            ("app notin (db,web)", false),
            ("tier notin (x)", true),
        ] {
            let parsed = LabelSelector::parse(selector).expect(selector);
            assert_eq!(parsed.matches(&pod), expected, "{selector}");
        }
        assert!(LabelSelector::parse("app in web").is_err());
    }

    #[test]
    fn field_terms_walk_dotted_paths_and_missing_is_empty() {
        let pod = json!({"metadata": {"name": "a", "namespace": "default"}, "spec": {"nodeName": "edge-1"}});
        let unscheduled = json!({"metadata": {"name": "b"}, "spec": {}});
        let on_node = FieldSelector::parse("spec.nodeName=edge-1,metadata.namespace==default")
            .expect("parse");
        assert!(on_node.matches(&pod));
        assert!(!on_node.matches(&unscheduled));
        let pending = FieldSelector::parse("spec.nodeName=").expect("parse");
        assert!(pending.matches(&unscheduled));
        assert!(!FieldSelector::parse("metadata.name!=a")
            .expect("parse")
            .matches(&pod));
        assert!(FieldSelector::parse("nonsense").is_err());
    }
}
