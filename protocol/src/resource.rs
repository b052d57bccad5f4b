use std::fmt;

use crate::Error;

/// A KubeEdge edge resource `<namespace>/<type>[/<id>]`; the whole string is the store key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    key: String,
    type_end: usize,
    namespace_end: usize,
}

impl Resource {
    /// Parses `<namespace>/<type>[/<id>]`: two or three non-empty levels.
    pub fn parse(raw: &str) -> Result<Resource, Error> {
        Resource::of(raw.to_owned())
    }

    /// Builds `<namespace>/<type>/<id>` from parts already known to be single levels.
    pub fn from_parts(namespace: &str, res_type: &str, id: &str) -> Result<Resource, Error> {
        let mut key = String::with_capacity(namespace.len() + res_type.len() + id.len() + 2);
        for (i, level) in [namespace, res_type, id].into_iter().enumerate() {
            if i > 0 {
                key.push('/');
            }
            key.push_str(level);
        }
        Resource::of(key)
    }

    /// `key` as a resource if it has two or three non-empty levels. Parsed on every message
    /// several times over: one scan of its bytes, nothing allocated.
    fn of(key: String) -> Result<Resource, Error> {
        let mut slashes = key
            .bytes()
            .enumerate()
            .filter(|&(_, b)| b == b'/')
            .map(|(at, _)| at);
        let (namespace_end, type_end) = match (slashes.next(), slashes.next(), slashes.next()) {
            (Some(first), second, None) => (first, second.unwrap_or(key.len())),
            _ => return Err(Error::InvalidResource(key)),
        };
        let empty_level = namespace_end == 0
            || type_end == namespace_end + 1
            || (type_end < key.len() && type_end + 1 == key.len());
        if empty_level {
            return Err(Error::InvalidResource(key));
        }
        Ok(Resource {
            key,
            namespace_end,
            type_end,
        })
    }

    /// The whole resource string: the `meta.key` column.
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn namespace(&self) -> &str {
        &self.key[..self.namespace_end]
    }

    /// The `meta.type` column.
    pub fn res_type(&self) -> &str {
        &self.key[self.namespace_end + 1..self.type_end]
    }

    /// The object's name; `None` for a two-level (list) resource.
    pub fn id(&self) -> Option<&str> {
        self.key.get(self.type_end + 1..)
    }
}

/// Whether `name` can be the `<name>` level: non-empty, and no `/`, `+` or `#`, so that it also
/// fits a v1 topic (`<namespace>/<type>/<name>`) and a store key of three levels.
pub fn is_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(['/', '+', '#'])
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_levels_give_namespace_type_and_id() {
        let r = Resource::parse("default/pod/nginx").unwrap();
        assert_eq!(
            (r.namespace(), r.res_type(), r.id()),
            ("default", "pod", Some("nginx"))
        );
        assert_eq!(r.key(), "default/pod/nginx");
    }

    #[test]
    fn two_levels_are_a_list_of_a_type() {
        let r = Resource::parse("default/pod").unwrap();
        assert_eq!(
            (r.namespace(), r.res_type(), r.id()),
            ("default", "pod", None)
        );
    }

    #[test]
    fn names_are_single_topic_levels() {
        assert!(is_name("nginx-7d9f.x_y"));
        for bad in ["", "a/b", "a+", "#", "/"] {
            assert!(!is_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn other_shapes_are_rejected_with_the_expected_text() {
        for raw in [
            "",
            "pod",
            "a/b/c/d",
            "a//c",
            "/pod/x",
            "a/b/",
            "a/",
            "/b",
            "/",
            "default/pod/nginx/extra/x",
        ] {
            let err = Resource::parse(raw).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid resource {raw:?}: want <namespace>/<type>[/<id>]")
            );
        }
    }
}
