//! Merging a twin update into a device's stored twins, with KubeEdge's versions and checks
//! (`edge/pkg/devicetwin/dtmanager/twin.go` `DealMsgTwin`, `dealTwinCompare`, `dealTwinAdd`,
//! `dealTwinDelete`, `dealVersion`; `dtcommon/util.go` for validation). Pure: the caller loads
//! the twins and writes back [`Merged::changed`].

use std::collections::BTreeMap;

use super::wire::{MsgTwin, TwinDoc, TwinValue, TwinVersion, TypeMetadata, ValueMetadata};

/// `attr_type` of a deleted twin (`dtcommon.TypeDeleted`).
pub const DELETED: &str = "deleted";
const STRING: &str = "string";

/// Who sent an update: a device (KubeEdge `RestDealType`) or the cloud (`SyncDealType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Device,
    Cloud,
}

/// One `device_twin` row.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Twin {
    pub name: String,
    pub description: String,
    pub expected: Option<String>,
    pub actual: Option<String>,
    pub expected_meta: Option<ValueMetadata>,
    pub actual_meta: Option<ValueMetadata>,
    pub expected_version: Option<TwinVersion>,
    pub actual_version: Option<TwinVersion>,
    pub optional: bool,
    pub attr_type: String,
    pub metadata: String,
    /// The row's `id`; `None` until stored.
    pub row: Option<i64>,
}

impl Twin {
    /// The twin as messages carry it (`DeviceTwinToMsgTwin`).
    pub fn to_msg(&self, versions: bool) -> MsgTwin {
        let value = |v: &Option<String>, meta: &Option<ValueMetadata>| {
            v.as_ref().filter(|v| !v.is_empty()).map(|v| TwinValue {
                value: Some(v.clone()),
                metadata: *meta,
            })
        };
        MsgTwin {
            expected: value(&self.expected, &self.expected_meta),
            actual: value(&self.actual, &self.actual_meta),
            optional: Some(self.optional),
            metadata: Some(TypeMetadata {
                kind: self.attr_type.clone(),
            }),
            expected_version: self.expected_version.filter(|_| versions),
            actual_version: self.actual_version.filter(|_| versions),
        }
    }

    pub fn is_deleted(&self) -> bool {
        self.attr_type == DELETED
    }
}

/// What an update changed.
#[derive(Debug, Default)]
pub struct Merged {
    /// Rows to write: inserted when `row` is `None`, else updated.
    pub changed: Vec<Twin>,
    /// The device's result: each changed property, `null` if deleted (no versions).
    pub result: BTreeMap<String, Option<MsgTwin>>,
    /// What the cloud is told (with versions): a device's changes, or the edge's value where it
    /// refused a cloud update.
    pub sync: BTreeMap<String, Option<MsgTwin>>,
    pub document: BTreeMap<String, TwinDoc>,
}

/// Why a device's update is refused as a whole (code 400); a cloud update is never refused,
/// the properties it cannot apply are skipped or answered with the edge's value.
pub type Refusal = String;

/// Merges `update` into `twins` (by property name); `now` stamps the values set.
pub fn merge(
    twins: &mut BTreeMap<String, Twin>,
    update: &BTreeMap<String, Option<MsgTwin>>,
    source: Source,
    now: i64,
) -> Result<Merged, Refusal> {
    let mut merged = Merged::default();
    for (key, incoming) in update {
        match (twins.get(key), incoming) {
            (Some(twin), None) if source == Source::Device => {
                delete(&mut merged, key, twin.clone(), None, source);
            }
            (Some(twin), Some(m)) if source == Source::Cloud && m.kind() == Some(DELETED) => {
                delete(&mut merged, key, twin.clone(), Some(m), source);
            }
            (Some(twin), Some(m)) => compare(&mut merged, key, twin.clone(), m, source, now)?,
            (None, Some(m)) => add(&mut merged, key, m, source, now)?,
            // Deleting what does not exist, or a cloud `null`: nothing to do.
            (_, None) => {}
        }
        if let Some(changed) = merged.changed.last() {
            if changed.name == *key {
                twins.insert(key.clone(), changed.clone());
            }
        }
    }
    Ok(merged)
}

/// `dealVersion`: a device's change adds one to `edge`; a cloud change must be based on at least
/// what is stored, and then the stored versions become the cloud's.
fn version(
    stored: &mut TwinVersion,
    sent: Option<TwinVersion>,
    source: Source,
) -> Result<(), String> {
    match source {
        Source::Device => {
            stored.edge += 1;
            Ok(())
        }
        Source::Cloud => {
            let sent = sent.ok_or("version not allowed be nil while syncing")?;
            if stored.cloud > sent.cloud {
                return Err("version not allowed".into());
            }
            if stored.edge > sent.edge {
                return Err("not allowed to sync due to version conflict".into());
            }
            *stored = sent;
            Ok(())
        }
    }
}

/// `dealTwinDelete`: an optional twin's values are cleared and it is kept as `deleted`, so its
/// versions go on counting.
fn delete(merged: &mut Merged, key: &str, before: Twin, sent: Option<&MsgTwin>, source: Source) {
    if before.is_deleted() || (source == Source::Device && !before.optional) {
        return;
    }
    let mut twin = before.clone();
    let mut changed = false;
    let (sent_expected, sent_actual) = match sent {
        Some(m) => (m.expected_version, m.actual_version),
        None => (None, None),
    };
    for (version_of, sent_version, value, meta) in [
        (
            &mut twin.expected_version,
            sent_expected,
            &mut twin.expected,
            &mut twin.expected_meta,
        ),
        (
            &mut twin.actual_version,
            sent_actual,
            &mut twin.actual,
            &mut twin.actual_meta,
        ),
    ] {
        let Some(stored) = version_of else { continue };
        // A cloud delete without versions is applied as is (`SyncTwinDeleteDealType`).
        if source == Source::Cloud && sent_version.is_none() {
        } else if version(stored, sent_version, source).is_err() {
            merged
                .sync
                .insert(key.to_owned(), Some(before.to_msg(true)));
            return;
        }
        *value = None;
        *meta = None;
        changed = true;
    }
    if !changed {
        return;
    }
    twin.attr_type = DELETED.into();
    merged.document.insert(
        key.to_owned(),
        TwinDoc {
            last: Some(before.to_msg(false)),
            current: None,
        },
    );
    if source == Source::Device {
        merged.result.insert(key.to_owned(), None);
        merged.sync.insert(key.to_owned(), Some(twin.to_msg(true)));
    }
    merged.changed.push(twin);
}

/// `dealTwinCompare`: sets the values a message carries on an existing twin.
fn compare(
    merged: &mut Merged,
    key: &str,
    before: Twin,
    m: &MsgTwin,
    source: Source,
    now: i64,
) -> Result<(), Refusal> {
    let mut twin = before.clone();
    let mut sync = MsgTwin::default();
    let mut changed = false;
    let mut allowed = true;
    // A deleted twin takes the type the message brings.
    let kind = if twin.is_deleted() {
        m.kind().unwrap_or(STRING).to_owned()
    } else {
        twin.attr_type.clone()
    };
    for which in [Side::Expected, Side::Actual] {
        if !allowed {
            break;
        }
        let Some(sent) = which.value(m) else { continue };
        let value = sent.value.clone().unwrap_or_default();
        if let Err(e) = check_typed(&kind, &value) {
            match source {
                Source::Device => return Err(e),
                Source::Cloud => continue,
            }
        }
        let (value_of, meta_of, version_of) = which.fields(&mut twin);
        let mut stored = version_of.unwrap_or_default();
        match version(&mut stored, which.version(m), source) {
            Ok(()) => {
                *value_of = Some(value.clone());
                *meta_of = Some(ValueMetadata { timestamp: now });
                *version_of = Some(stored);
                which.set(
                    &mut sync,
                    TwinValue {
                        value: Some(value),
                        metadata: Some(ValueMetadata { timestamp: now }),
                    },
                    stored,
                );
                changed = true;
            }
            Err(e) if source == Source::Device => return Err(e),
            Err(_) => {
                // The edge's value wins; the cloud hears it back.
                let current = before.to_msg(true);
                if let Some(value) = which.value(&current) {
                    which.set(
                        &mut sync,
                        value.clone(),
                        which.version(&current).unwrap_or_default(),
                    );
                }
                allowed = false;
            }
        }
    }
    // The cloud's twin names a version but no expected value: the desired value was removed
    // from the Device, so the node drops the one it holds (KubeEdge keeps it for ever).
    if allowed && source == Source::Cloud && m.expected.is_none() && twin.expected.is_some() {
        if let Some(sent) = m.expected_version {
            let mut stored = twin.expected_version.unwrap_or_default();
            if version(&mut stored, Some(sent), source).is_ok() {
                twin.expected = None;
                twin.expected_meta = None;
                twin.expected_version = Some(stored);
                changed = true;
            }
        }
    }
    if allowed {
        if let Some(optional) = m.optional {
            if optional != twin.optional && twin.optional {
                twin.optional = optional;
                changed = true;
            }
        }
        match &m.metadata {
            Some(meta) if meta.kind != twin.attr_type => {
                twin.metadata = "{}".into();
                if twin.is_deleted() {
                    twin.attr_type = meta.kind.clone();
                }
                changed = true;
            }
            None if twin.is_deleted() => {
                twin.attr_type = STRING.into();
                changed = true;
            }
            _ => {}
        }
    }
    sync.optional = Some(twin.optional);
    sync.metadata = Some(TypeMetadata {
        kind: twin.attr_type.clone(),
    });
    if changed {
        merged.document.insert(
            key.to_owned(),
            TwinDoc {
                last: (!before.is_deleted()).then(|| before.to_msg(false)),
                current: Some(twin.to_msg(false)),
            },
        );
        if source == Source::Device {
            merged
                .result
                .insert(key.to_owned(), Some(sync.without_versions()));
        }
        merged.changed.push(twin);
    }
    if source == Source::Device && changed || !allowed {
        merged.sync.insert(key.to_owned(), Some(sync));
    }
    Ok(())
}

/// `dealTwinAdd`: a property the device did not have.
fn add(
    merged: &mut Merged,
    key: &str,
    m: &MsgTwin,
    source: Source,
    now: i64,
) -> Result<(), Refusal> {
    let kind = match m.kind() {
        Some(kind) if !kind.is_empty() => kind.to_owned(),
        _ => STRING.to_owned(),
    };
    let mut twin = Twin {
        name: key.to_owned(),
        optional: m.optional.unwrap_or(true),
        attr_type: kind.clone(),
        metadata: "{}".into(),
        ..Twin::default()
    };
    if source == Source::Cloud && kind == DELETED {
        twin.expected_version = m.expected_version;
        twin.actual_version = m.actual_version;
    }
    for which in [Side::Expected, Side::Actual] {
        let Some(sent) = which.value(m) else { continue };
        let value = sent.value.clone().unwrap_or_default();
        let mut stored = TwinVersion::default();
        let checked = version(&mut stored, which.version(m), source)
            .and_then(|()| check_typed(&kind, &value));
        match checked {
            Ok(()) => {
                let (value_of, meta_of, version_of) = which.fields(&mut twin);
                *value_of = Some(value);
                *meta_of = Some(ValueMetadata { timestamp: now });
                *version_of = Some(stored);
            }
            Err(e) if source == Source::Device => return Err(e),
            // The cloud's property is not added (KubeEdge rejects the add silently).
            Err(_) => return Ok(()),
        }
    }
    merged.document.insert(
        key.to_owned(),
        TwinDoc {
            last: None,
            current: (!twin.is_deleted()).then(|| twin.to_msg(false)),
        },
    );
    if source == Source::Device {
        merged
            .result
            .insert(key.to_owned(), Some(twin.to_msg(false)));
        merged.sync.insert(key.to_owned(), Some(twin.to_msg(true)));
    }
    merged.changed.push(twin);
    Ok(())
}

/// `BuildDeviceTwinDelta`: every twin with an expected value, and those whose actual value
/// differs; `None` when none differs.
pub fn delta(
    twins: &BTreeMap<String, Twin>,
) -> Option<(BTreeMap<String, MsgTwin>, BTreeMap<String, String>)> {
    let mut all = BTreeMap::new();
    let mut delta = BTreeMap::new();
    for (key, twin) in twins {
        let Some(expected) = twin.expected.as_ref().filter(|e| !e.is_empty()) else {
            continue;
        };
        if twin.is_deleted() {
            continue;
        }
        if twin.actual.as_deref().unwrap_or("") != expected {
            delta.insert(key.clone(), expected.clone());
        }
        all.insert(key.clone(), twin.to_msg(false));
    }
    (!delta.is_empty()).then_some((all, delta))
}

/// Expected or actual: the two halves of a twin are handled alike.
#[derive(Clone, Copy)]
enum Side {
    Expected,
    Actual,
}

impl Side {
    fn value(self, m: &MsgTwin) -> Option<&TwinValue> {
        match self {
            Side::Expected => m.expected.as_ref(),
            Side::Actual => m.actual.as_ref(),
        }
    }

    fn version(self, m: &MsgTwin) -> Option<TwinVersion> {
        match self {
            Side::Expected => m.expected_version,
            Side::Actual => m.actual_version,
        }
    }

    fn set(self, m: &mut MsgTwin, value: TwinValue, version: TwinVersion) {
        match self {
            Side::Expected => {
                m.expected = Some(value);
                m.expected_version = Some(version);
            }
            Side::Actual => {
                m.actual = Some(value);
                m.actual_version = Some(version);
            }
        }
    }

    fn fields(
        self,
        t: &mut Twin,
    ) -> (
        &mut Option<String>,
        &mut Option<ValueMetadata>,
        &mut Option<TwinVersion>,
    ) {
        match self {
            Side::Expected => (
                &mut t.expected,
                &mut t.expected_meta,
                &mut t.expected_version,
            ),
            Side::Actual => (&mut t.actual, &mut t.actual_meta, &mut t.actual_version),
        }
    }
}

/// `ValidateTwinKey`: `^[a-zA-Z0-9-_.,:/@#]{1,128}$`.
pub fn valid_key(key: &str) -> bool {
    (1..=128).contains(&key.len()) && key.chars().all(allowed_char)
}

/// `ValidateTwinValue`: `^[a-zA-Z0-9-_.,:/@#]{1,512}$`; an empty value is allowed.
pub fn valid_value(value: &str) -> bool {
    value.is_empty() || (value.len() <= 512 && value.chars().all(allowed_char))
}

fn allowed_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "-_.,:/@#".contains(c)
}

/// `ValidateValue`: whether `value` parses as the twin's type.
pub fn check_typed(kind: &str, value: &str) -> Result<(), String> {
    match kind {
        "" | STRING | DELETED => Ok(()),
        "int" | "integer" => value
            .parse::<i64>()
            .map(drop)
            .map_err(|_| "the value is not int or integer".into()),
        "float" | "double" => value
            .parse::<f64>()
            .map(drop)
            .map_err(|_| "the value is not float".into()),
        "boolean" => match value {
            "true" | "false" => Ok(()),
            _ => Err("the bool value must be true or false".into()),
        },
        _ => Err("the value type is not allowed".into()),
    }
}

/// Checks a device's update before anything is merged (`UnmarshalDeviceTwinUpdate`).
pub fn check_update(update: &BTreeMap<String, Option<MsgTwin>>) -> Result<(), Refusal> {
    for (key, twin) in update {
        if !valid_key(key) {
            return Err("The key of twin must only include upper or lowercase letters, number, english, and special letter - _ . , : / @ # and the length of key should be less than 128 bytes".into());
        }
        let values = twin.iter().flat_map(|t| [&t.expected, &t.actual]).flatten();
        for value in values {
            if !valid_value(value.value.as_deref().unwrap_or("")) {
                return Err("The value of twin must only include upper or lowercase letters, number, english, and special letter - _ . , : / @ # and the length of value should be less than 512 bytes".into());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reported(value: &str, kind: &str) -> MsgTwin {
        MsgTwin {
            actual: Some(TwinValue {
                value: Some(value.into()),
                metadata: None,
            }),
            metadata: Some(TypeMetadata { kind: kind.into() }),
            ..MsgTwin::default()
        }
    }

    fn desired(value: &str, cloud: i64, edge: i64) -> MsgTwin {
        MsgTwin {
            expected: Some(TwinValue {
                value: Some(value.into()),
                metadata: None,
            }),
            metadata: Some(TypeMetadata { kind: "int".into() }),
            optional: Some(false),
            expected_version: Some(TwinVersion { cloud, edge }),
            ..MsgTwin::default()
        }
    }

    /// The cloud wants `t` = `value` at `now`, with its `(cloud, edge)` versions.
    fn cloud_desires(
        twins: &mut BTreeMap<String, Twin>,
        value: &str,
        (cloud, edge): (i64, i64),
        now: i64,
    ) -> Merged {
        merge(
            twins,
            &one("t", Some(desired(value, cloud, edge))),
            Source::Cloud,
            now,
        )
        .unwrap()
    }

    /// The device reports `t` = `value` (an int) at `now`.
    fn device_reports(twins: &mut BTreeMap<String, Twin>, value: &str, now: i64) -> Merged {
        merge(
            twins,
            &one("t", Some(reported(value, "int"))),
            Source::Device,
            now,
        )
        .unwrap()
    }

    fn one(key: &str, twin: Option<MsgTwin>) -> BTreeMap<String, Option<MsgTwin>> {
        BTreeMap::from([(key.to_owned(), twin)])
    }

    #[test]
    fn a_device_report_adds_then_counts_edge_versions() {
        let mut twins = BTreeMap::new();
        let merged = device_reports(&mut twins, "25", 7);
        assert_eq!(merged.changed.len(), 1);
        let t = &twins["t"];
        assert_eq!(t.actual.as_deref(), Some("25"));
        assert_eq!(t.actual_version, Some(TwinVersion { cloud: 0, edge: 1 }));
        assert!(t.optional, "a device's new twin is optional by default");
        let result = merged.result["t"].clone().unwrap();
        assert_eq!(result.actual_version, None, "devices never see versions");
        assert!(merged.sync["t"].as_ref().unwrap().actual_version.is_some());
        device_reports(&mut twins, "26", 8);
        assert_eq!(
            twins["t"].actual_version,
            Some(TwinVersion { cloud: 0, edge: 2 })
        );
    }

    #[test]
    fn a_value_of_the_wrong_type_refuses_the_whole_update() {
        let mut twins = BTreeMap::new();
        device_reports(&mut twins, "25", 1);
        let before = twins.clone();
        let update = BTreeMap::from([
            ("a".to_owned(), Some(reported("1", "int"))),
            ("t".to_owned(), Some(reported("warm", "int"))),
        ]);
        let refused = merge(&mut twins.clone(), &update, Source::Device, 2).unwrap_err();
        assert_eq!(refused, "the value is not int or integer");
        assert_eq!(twins, before);
    }

    #[test]
    fn a_cloud_desired_value_applies_when_its_versions_are_current() {
        let mut twins = BTreeMap::new();
        cloud_desires(&mut twins, "20", (100, 0), 1);
        assert_eq!(
            twins["t"].expected_version,
            Some(TwinVersion {
                cloud: 100,
                edge: 0
            })
        );
        assert!(!twins["t"].optional);
        device_reports(&mut twins, "25", 2);
        assert_eq!(delta(&twins).unwrap().1["t"], "20");
        let merged = cloud_desires(&mut twins, "30", (101, 0), 3);
        assert!(
            merged.sync.is_empty(),
            "an accepted cloud change is not echoed"
        );
        assert_eq!(twins["t"].expected.as_deref(), Some("30"));
        assert_eq!(delta(&twins).unwrap().1["t"], "30");
    }

    #[test]
    fn a_desired_value_removed_in_the_cloud_is_dropped_unless_stale() {
        let mut twins = BTreeMap::new();
        cloud_desires(&mut twins, "20", (100, 0), 1);
        let without = |cloud| {
            let mut m = desired("x", cloud, 0);
            m.expected = None;
            one("t", Some(m))
        };
        // An older message naming no value changes nothing.
        merge(&mut twins, &without(99), Source::Cloud, 2).unwrap();
        assert_eq!(twins["t"].expected.as_deref(), Some("20"));
        let merged = merge(&mut twins, &without(101), Source::Cloud, 3).unwrap();
        assert_eq!(twins["t"].expected, None);
        assert_eq!(twins["t"].expected_version.map(|v| v.cloud), Some(101));
        assert_eq!(merged.changed.len(), 1, "the row is written");
        assert!(delta(&twins).is_none(), "no delta without a desired value");
        // A value that comes back later applies.
        cloud_desires(&mut twins, "21", (102, 0), 4);
        assert_eq!(twins["t"].expected.as_deref(), Some("21"));
    }

    #[test]
    fn a_stale_cloud_value_loses_to_the_edge_and_is_reported_back() {
        let mut twins = BTreeMap::new();
        cloud_desires(&mut twins, "20", (100, 0), 1);
        let merged = cloud_desires(&mut twins, "10", (99, 0), 2);
        assert_eq!(twins["t"].expected.as_deref(), Some("20"));
        let back = merged.sync["t"].clone().unwrap();
        assert_eq!(back.expected.unwrap().value.as_deref(), Some("20"));
        assert_eq!(
            back.expected_version,
            Some(TwinVersion {
                cloud: 100,
                edge: 0
            })
        );
        // Without versions the cloud cannot change a value either.
        let unversioned = MsgTwin {
            expected_version: None,
            ..desired("5", 0, 0)
        };
        merge(&mut twins, &one("t", Some(unversioned)), Source::Cloud, 3).unwrap();
        assert_eq!(twins["t"].expected.as_deref(), Some("20"));
    }

    #[test]
    fn null_deletes_an_optional_twin_and_keeps_it_as_deleted() {
        let mut twins = BTreeMap::new();
        device_reports(&mut twins, "1", 1);
        let merged = merge(&mut twins, &one("t", None), Source::Device, 2).unwrap();
        assert_eq!(merged.result["t"], None);
        assert!(twins["t"].is_deleted());
        assert_eq!(twins["t"].actual, None);
        assert_eq!(
            twins["t"].actual_version,
            Some(TwinVersion { cloud: 0, edge: 2 })
        );
        assert_eq!(merged.document["t"].current, None);
    }

    #[test]
    fn keys_and_values_follow_kubeedge_patterns() {
        assert!(valid_key("temperature-1.a:b/c@d#e"));
        assert!(!valid_key("with space"));
        assert!(!valid_key(&"k".repeat(129)));
        assert!(valid_value(""));
        assert!(!valid_value("a b"));
        assert!(check_typed("boolean", "true").is_ok());
        assert!(check_typed("float", "1.5").is_ok());
        assert!(check_typed("bytes", "x").is_err());
    }
}
