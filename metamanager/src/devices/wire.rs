//! KubeEdge's device JSON shapes (`edge/pkg/devicetwin/dttype/types.go`, `types_helper.go`);
//! field names and omissions match Go's `encoding/json` tags, so mappers read them unchanged.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `BaseMessage`: every device message carries these two.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Base {
    #[serde(default)]
    pub event_id: String,
    #[serde(default)]
    pub timestamp: i64,
}

impl Base {
    /// `event_id`, stamped now.
    pub fn now(event_id: impl Into<String>) -> Base {
        Base {
            event_id: event_id.into(),
            timestamp: edgemeta_protocol::now_ms(),
        }
    }
}

/// `TwinValue`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TwinValue {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ValueMetadata>,
}

/// `ValueMetadata`: when the value was set (ms).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ValueMetadata {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub timestamp: i64,
}

/// `TypeMetadata`: the value's type (`string`, `int`, `float`, `boolean`, or `deleted`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TypeMetadata {
    #[serde(rename = "type", default, skip_serializing_if = "String::is_empty")]
    pub kind: String,
}

/// `TwinVersion`: how many cloud and edge changes a value has seen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TwinVersion {
    #[serde(default)]
    pub cloud: i64,
    #[serde(default)]
    pub edge: i64,
}

/// `MsgTwin`: one twin property as messages carry it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MsgTwin {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<TwinValue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual: Option<TwinValue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TypeMetadata>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_version: Option<TwinVersion>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_version: Option<TwinVersion>,
}

impl MsgTwin {
    /// The copy devices see: KubeEdge's `CopyMsgTwin(twin, true)` drops the versions.
    pub fn without_versions(&self) -> MsgTwin {
        MsgTwin {
            expected_version: None,
            actual_version: None,
            ..self.clone()
        }
    }

    pub fn kind(&self) -> Option<&str> {
        self.metadata.as_ref().map(|m| m.kind.as_str())
    }
}

/// `MsgAttr`: a device attribute.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MsgAttr {
    #[serde(default)]
    pub value: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TypeMetadata>,
}

/// `Device`, as membership messages carry it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Device {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub state: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub last_online: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<BTreeMap<String, Option<MsgAttr>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub twin: Option<BTreeMap<String, Option<MsgTwin>>>,
}

/// `DeviceTwinUpdate` (a device's report, a cloud desired update); a `null` twin deletes it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TwinUpdate {
    #[serde(flatten)]
    pub base: Base,
    pub twin: Option<BTreeMap<String, Option<MsgTwin>>>,
}

/// `DeviceTwinResult`: twin update and get results, and the edge's report to the cloud.
#[derive(Debug, Clone, Serialize)]
pub struct TwinResult {
    #[serde(flatten)]
    pub base: Base,
    pub twin: BTreeMap<String, Option<MsgTwin>>,
}

/// `TwinDoc`: a property before and after a change.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TwinDoc {
    pub last: Option<MsgTwin>,
    pub current: Option<MsgTwin>,
}

/// `DeviceTwinDocument`.
#[derive(Debug, Clone, Serialize)]
pub struct TwinDocument {
    #[serde(flatten)]
    pub base: Base,
    pub twin: BTreeMap<String, TwinDoc>,
}

/// `DeviceTwinDelta`.
#[derive(Debug, Clone, Serialize)]
pub struct TwinDelta {
    #[serde(flatten)]
    pub base: Base,
    pub twin: BTreeMap<String, MsgTwin>,
    pub delta: BTreeMap<String, String>,
}

/// `Result`: what every `.../result` topic gets on failure.
#[derive(Debug, Clone, Serialize)]
pub struct ErrorResult {
    #[serde(flatten)]
    pub base: Base,
    pub code: u16,
    pub reason: String,
}

/// `DeviceUpdate`: a device's state report.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StateUpdate {
    #[serde(flatten)]
    pub base: Base,
    #[serde(default)]
    pub state: String,
}

/// `DeviceMsg`: the state result, and the state report to the cloud.
#[derive(Debug, Clone, Serialize)]
pub struct StateResult {
    #[serde(flatten)]
    pub base: Base,
    pub device: DeviceState,
}

/// `DeviceCloudMsg` as the state result fills it.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceState {
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub state: String,
    #[serde(rename = "lastOnlineTime", skip_serializing_if = "String::is_empty")]
    pub last_online_time: String,
}

/// `MembershipUpdate`: devices added to or removed from the node.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MembershipUpdate {
    #[serde(flatten)]
    pub base: Base,
    #[serde(default)]
    pub added_devices: Option<Vec<Device>>,
    #[serde(default)]
    pub removed_devices: Option<Vec<Device>>,
}

/// `MembershipDetail` (the cloud's full list) and `MembershipGetResult`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Membership {
    #[serde(flatten)]
    pub base: Base,
    #[serde(default)]
    pub devices: Vec<Device>,
}

/// `GetDetailNode`: the node asks the cloud for its full membership.
#[derive(Debug, Clone, Serialize)]
pub struct DetailRequest {
    pub event_type: &'static str,
    pub event_id: String,
    pub operation: &'static str,
    pub group_id: String,
    pub timestamp: i64,
}

/// `AttrUpdate` (`DeviceAttrUpdate`), published on `$hw/events/device/<id>/updated`.
#[derive(Debug, Clone, Serialize)]
pub struct AttrUpdate {
    #[serde(flatten)]
    pub base: Base,
    pub attributes: BTreeMap<String, Option<MsgAttr>>,
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapper_report_reads_as_kubeedge_writes_it() {
        // mapper-framework pkg/common/event.go CreateMessageTwinUpdate.
        let raw = r#"{"event_id":"","timestamp":1700000000000,"twin":{"temperature":{"actual":{"value":"25"},"expected":{"value":"20"},"metadata":{"type":"int"}}}}"#;
        let update: TwinUpdate = serde_json::from_str(raw).unwrap();
        let twin = update.twin.unwrap()["temperature"].clone().unwrap();
        assert_eq!(twin.actual.unwrap().value.as_deref(), Some("25"));
        assert_eq!(twin.metadata.unwrap().kind, "int");
    }

    #[test]
    fn results_omit_what_go_omits() {
        let twin = MsgTwin {
            actual: Some(TwinValue {
                value: Some("1".into()),
                metadata: Some(ValueMetadata { timestamp: 5 }),
            }),
            optional: Some(true),
            metadata: Some(TypeMetadata { kind: "int".into() }),
            ..MsgTwin::default()
        };
        assert_eq!(
            serde_json::to_string(&twin).unwrap(),
            r#"{"actual":{"value":"1","metadata":{"timestamp":5}},"optional":true,"metadata":{"type":"int"}}"#
        );
        let error = ErrorResult {
            base: Base {
                event_id: "e".into(),
                timestamp: 1,
            },
            code: 404,
            reason: "r".into(),
        };
        assert_eq!(
            serde_json::to_string(&error).unwrap(),
            r#"{"event_id":"e","timestamp":1,"code":404,"reason":"r"}"#
        );
    }
}
