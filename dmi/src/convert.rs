//! `devices.kubeedge.io/v1beta1` Devices and DeviceModels (the JSON the node stores) → DMI
//! protobuf, as KubeEdge's `dtcommon/util.go` `ConvertDevice` / `ConvertDeviceModel` and the
//! model defaults of `dmicache.go` `GetOverriddenDevice` do. Go's JSON decoder matches keys
//! case-insensitively, so the CRD's `hostName`, `requestPath`, `TDEngine`, `dbName` land in the
//! proto's `hostname`, `requestpath`, `tdengine`, `dbname`: [`field`] does the same.
//!
//! One difference, on purpose: a `configData` value that is an object, a list or null is sent
//! as a `StringValue` holding its JSON, where KubeEdge drops the whole device.

use std::collections::HashMap;

use prost::Message as _;
use prost_types::Any;
use serde_json::{Map, Value};

use crate::pb;

/// The value of `key` in `object`, matched as Go's `encoding/json` does: exactly, else
/// ignoring ASCII case.
pub fn field<'a>(object: &'a Value, key: &str) -> &'a Value {
    static NULL: Value = Value::Null;
    let Some(map) = object.as_object() else {
        return &NULL;
    };
    map.get(key)
        .or_else(|| {
            map.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v)
        })
        .unwrap_or(&NULL)
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn int(v: &Value) -> i64 {
    v.as_i64()
        .or_else(|| v.as_f64().map(|f| f as i64))
        .unwrap_or(0)
}

fn int32(v: &Value) -> i32 {
    i32::try_from(int(v)).unwrap_or(0)
}

fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| field(v, k))
}

fn list(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or_default()
}

const WRAPPERS: &str = "type.googleapis.com/google.protobuf.";

/// `dataToAny`: a JSON value as KubeEdge wraps it. JSON numbers are `float64` in Go, so every
/// number becomes a `FloatValue` (32-bit), as KubeEdge sends them.
pub fn to_any(v: &Value) -> Any {
    let (kind, value) = match v {
        Value::String(s) => ("StringValue", s.encode_to_vec()),
        Value::Bool(b) => ("BoolValue", b.encode_to_vec()),
        Value::Number(n) => (
            "FloatValue",
            (n.as_f64().unwrap_or(0.0) as f32).encode_to_vec(),
        ),
        other => ("StringValue", other.to_string().encode_to_vec()),
    };
    Any {
        type_url: format!("{WRAPPERS}{kind}"),
        value,
    }
}

fn customized(config: &Value) -> Option<pb::CustomizedValue> {
    let map = config.as_object()?;
    Some(pb::CustomizedValue {
        data: map.iter().map(|(k, v)| (k.clone(), to_any(v))).collect(),
    })
}

fn twin_property(v: &Value) -> Option<pb::TwinProperty> {
    if v.is_null() {
        return None;
    }
    let metadata = field(v, "metadata")
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), text(v))).collect())
        .unwrap_or_default();
    Some(pb::TwinProperty {
        value: text(field(v, "value")),
        metadata,
    })
}

fn push_method(v: &Value) -> Option<pb::PushMethod> {
    if v.is_null() {
        return None;
    }
    let http = field(v, "http");
    let mqtt = field(v, "mqtt");
    let otel = field(v, "otel");
    let db = field(v, "dbMethod");
    let anomaly = field(v, "anomalyDetection");
    let some = |v: &Value| !v.is_null();
    Some(pb::PushMethod {
        http: some(http).then(|| pb::PushMethodHttp {
            hostname: text(field(http, "hostname")),
            port: int(field(http, "port")),
            requestpath: text(field(http, "requestpath")),
            timeout: int(field(http, "timeout")),
        }),
        mqtt: some(mqtt).then(|| pb::PushMethodMqtt {
            address: text(field(mqtt, "address")),
            topic: text(field(mqtt, "topic")),
            qos: int32(field(mqtt, "qos")),
            retained: field(mqtt, "retained").as_bool().unwrap_or(false),
        }),
        otel: some(otel).then(|| pb::PushMethodOtel {
            endpoint_url: text(field(otel, "endpointURL")),
        }),
        db_method: some(db).then(|| db_method(db)),
        anomaly_detection: some(anomaly).then(|| pb::AnomalyDetection {
            data: customized(anomaly).map(|c| c.data).unwrap_or_default(),
        }),
    })
}

fn db_method(db: &Value) -> pb::DbMethod {
    let influx = field(db, "influxdb2");
    let redis = field(db, "redis");
    let td = field(db, "tdengine");
    let mysql = field(db, "mysql");
    let some = |v: &Value| !v.is_null();
    pb::DbMethod {
        influxdb2: some(influx).then(|| {
            let client = field(influx, "influxdb2ClientConfig");
            let data = field(influx, "influxdb2DataConfig");
            pb::DbMethodInfluxdb2 {
                influxdb2_client_config: some(client).then(|| pb::Influxdb2ClientConfig {
                    url: text(field(client, "url")),
                    org: text(field(client, "org")),
                    bucket: text(field(client, "bucket")),
                }),
                influxdb2_data_config: some(data).then(|| pb::Influxdb2DataConfig {
                    measurement: text(field(data, "measurement")),
                    tag: field(data, "tag")
                        .as_object()
                        .map(|m| m.iter().map(|(k, v)| (k.clone(), text(v))).collect())
                        .unwrap_or_default(),
                    field_key: text(field(data, "fieldKey")),
                }),
            }
        }),
        redis: some(redis).then(|| {
            let c = field(redis, "redisClientConfig");
            pb::DbMethodRedis {
                redis_client_config: some(c).then(|| pb::RedisClientConfig {
                    addr: text(field(c, "addr")),
                    db: int32(field(c, "db")),
                    poolsize: int32(field(c, "poolsize")),
                    min_idle_conns: int32(field(c, "minIdleConns")),
                }),
            }
        }),
        tdengine: some(td).then(|| {
            let c = field(td, "tdEngineClientConfig");
            pb::DbMethodTdEngine {
                td_engine_client_config: some(c).then(|| pb::TdEngineClientConfig {
                    addr: text(field(c, "addr")),
                    dbname: text(field(c, "dbname")),
                }),
            }
        }),
        mysql: some(mysql).then(|| {
            let c = field(mysql, "mysqlClientConfig");
            pb::DbMethodMySql {
                mysql_client_config: some(c).then(|| pb::MySqlClientConfig {
                    addr: text(field(c, "addr")),
                    database: text(field(c, "database")),
                    user_name: text(field(c, "userName")),
                }),
            }
        }),
    }
}

/// `a` with `b`'s keys added where `a` has none (instance keys win over the model's).
fn with_defaults(a: &Value, b: &Value) -> Value {
    let mut merged: Map<String, Value> = b.as_object().cloned().unwrap_or_default();
    for (k, v) in a.as_object().into_iter().flatten() {
        merged.insert(k.clone(), v.clone());
    }
    Value::Object(merged)
}

/// The protocol a Device names (`spec.protocol.protocolName`): which mapper it is for.
pub fn device_protocol(device: &Value) -> String {
    text(at(device, &["spec", "protocol", "protocolName"]))
}

/// The `(namespace, name)` of a Device's model.
pub fn model_of(device: &Value) -> (String, String) {
    (
        text(at(device, &["metadata", "namespace"])),
        text(at(device, &["spec", "deviceModelRef", "name"])),
    )
}

/// `ConvertDevice` of `GetOverriddenDevice`: the Device with its model's visitors and
/// protocol config as defaults.
pub fn device(device: &Value, model: Option<&Value>) -> pb::Device {
    let spec = field(device, "spec");
    let model_spec = model.map(|m| field(m, "spec")).unwrap_or(&Value::Null);
    let model_visitors: HashMap<String, &Value> = list(field(model_spec, "properties"))
        .iter()
        .map(|p| (text(field(p, "name")), field(p, "visitors")))
        .collect();
    let protocol = field(spec, "protocol");
    let protocol_config = with_defaults(
        field(protocol, "configData"),
        field(model_spec, "protocolConfigData"),
    );
    let properties = list(field(spec, "properties"))
        .iter()
        .map(|p| {
            let name = text(field(p, "name"));
            let own = field(p, "visitors");
            let default = model_visitors.get(&name).copied().unwrap_or(&Value::Null);
            let visitors = (!own.is_null() || !default.is_null()).then(|| {
                let protocol_name = match field(own, "protocolName") {
                    Value::Null => text(field(default, "protocolName")),
                    v => text(v),
                };
                let config = with_defaults(field(own, "configData"), field(default, "configData"));
                pb::VisitorConfig {
                    protocol_name,
                    config_data: customized(&config),
                }
            });
            pb::DeviceProperty {
                name,
                desired: twin_property(field(p, "desired")),
                visitors,
                report_cycle: int(field(p, "reportCycle")),
                collect_cycle: int(field(p, "collectCycle")),
                report_to_cloud: field(p, "reportToCloud").as_bool().unwrap_or(false),
                push_method: push_method(field(p, "pushMethod")),
            }
        })
        .collect();
    let methods = list(field(spec, "methods"))
        .iter()
        .map(|m| pb::DeviceMethod {
            name: text(field(m, "name")),
            description: text(field(m, "description")),
            property_names: list(field(m, "propertyNames")).iter().map(text).collect(),
        })
        .collect();
    let state_report = field(spec, "stateReport");
    let status = (!state_report.is_null()).then(|| pb::DeviceStatus {
        twins: Vec::new(),
        report_to_cloud: field(state_report, "reportToCloud")
            .as_bool()
            .unwrap_or(false),
        report_cycle: int(field(state_report, "reportCycle")),
    });
    pb::Device {
        name: text(at(device, &["metadata", "name"])),
        namespace: text(at(device, &["metadata", "namespace"])),
        spec: Some(pb::DeviceSpec {
            device_model_reference: text(at(spec, &["deviceModelRef", "name"])),
            protocol: (!protocol.is_null()).then(|| pb::ProtocolConfig {
                protocol_name: text(field(protocol, "protocolName")),
                config_data: customized(&protocol_config),
            }),
            properties,
            methods,
        }),
        status,
    }
}

/// `ConvertDeviceModel`: the model's name, namespace and properties. Its `protocol`,
/// `protocolConfigData` and visitors have no proto field (they reach devices as defaults).
pub fn model(model: &Value) -> pb::DeviceModel {
    let spec = field(model, "spec");
    pb::DeviceModel {
        name: text(at(model, &["metadata", "name"])),
        namespace: text(at(model, &["metadata", "namespace"])),
        spec: Some(pb::DeviceModelSpec {
            properties: list(field(spec, "properties"))
                .iter()
                .map(|p| pb::ModelProperty {
                    name: text(field(p, "name")),
                    description: text(field(p, "description")),
                    r#type: text(field(p, "type")),
                    access_mode: text(field(p, "accessMode")),
                    minimum: text(field(p, "minimum")),
                    maximum: text(field(p, "maximum")),
                    unit: text(field(p, "unit")),
                })
                .collect(),
            commands: Vec::new(),
        }),
    }
}

/// The protocol a DeviceModel names (`spec.protocol`).
pub fn model_protocol(model: &Value) -> String {
    text(at(model, &["spec", "protocol"]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn unwrap_any(any: &Any) -> (String, Vec<u8>) {
        (
            any.type_url.trim_start_matches(WRAPPERS).to_owned(),
            any.value.clone(),
        )
    }

    #[test]
    fn the_docs_device_converts_with_its_models_defaults() {
        let model = json!({"metadata": {"name": "m", "namespace": "default"},
            "spec": {"protocol": "modbus", "protocolConfigData": {"slaveID": 1, "ip": "0.0.0.0"},
                     "properties": [{"name": "temp", "type": "INT", "accessMode": "ReadWrite",
                                      "maximum": "100", "minimum": "1", "unit": "C",
                                      "visitors": {"protocolName": "modbus",
                                                   "configData": {"register": "CoilRegister", "offset": 9}}}]}});
        let device = json!({"metadata": {"name": "d", "namespace": "default"},
            "spec": {"deviceModelRef": {"name": "m"},
                     "protocol": {"protocolName": "modbus", "configData": {"ip": "172.17.0.3", "port": 1502}},
                     "properties": [{"name": "temp", "desired": {"value": "30"}, "collectCycle": 2000,
                                     "reportCycle": 2000, "reportToCloud": true,
                                     "visitors": {"configData": {"register": "HoldingRegister", "nested": {"a": 1}}},
                                     "pushMethod": {"http": {"hostName": "h", "port": 80, "requestPath": "/p"},
                                                    "dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "a", "dbName": "n"}}}}}],
                     "methods": [{"name": "set", "propertyNames": ["temp"]}]}});
        let d = super::device(&device, Some(&model));
        assert_eq!(d.name, "d");
        let spec = d.spec.expect("spec");
        assert_eq!(spec.device_model_reference, "m");
        let protocol = spec.protocol.expect("protocol");
        assert_eq!(protocol.protocol_name, "modbus");
        let data = protocol.config_data.expect("config").data;
        // Instance keys win; the model's fill in; numbers are FloatValue.
        assert_eq!(
            unwrap_any(&data["ip"]).1,
            "172.17.0.3".to_owned().encode_to_vec()
        );
        assert_eq!(
            unwrap_any(&data["slaveID"]),
            ("FloatValue".into(), 1.0f32.encode_to_vec())
        );
        let p = &spec.properties[0];
        assert_eq!(p.desired.as_ref().expect("desired").value, "30");
        assert_eq!((p.collect_cycle, p.report_to_cloud), (2000, true));
        let visitors = p.visitors.as_ref().expect("visitors");
        assert_eq!(visitors.protocol_name, "modbus");
        let vdata = &visitors.config_data.as_ref().expect("config").data;
        assert_eq!(
            unwrap_any(&vdata["register"]).1,
            "HoldingRegister".to_owned().encode_to_vec()
        );
        assert_eq!(unwrap_any(&vdata["offset"]).0, "FloatValue");
        assert_eq!(
            unwrap_any(&vdata["nested"]),
            (
                "StringValue".into(),
                r#"{"a":1}"#.to_owned().encode_to_vec()
            )
        );
        let push = p.push_method.as_ref().expect("push");
        let http = push.http.as_ref().expect("http");
        assert_eq!(
            (http.hostname.as_str(), http.requestpath.as_str(), http.port),
            ("h", "/p", 80)
        );
        let td = push
            .db_method
            .as_ref()
            .and_then(|d| d.tdengine.as_ref())
            .and_then(|t| t.td_engine_client_config.as_ref())
            .expect("tdengine");
        assert_eq!(td.dbname, "n");
        assert_eq!(spec.methods[0].property_names, ["temp"]);
        let m = super::model(&model);
        let mp = &m.spec.expect("spec").properties[0];
        assert_eq!((mp.r#type.as_str(), mp.maximum.as_str()), ("INT", "100"));
        assert_eq!(model_protocol(&model), "modbus");
        assert_eq!(device_protocol(&device), "modbus");
    }

    #[test]
    fn a_property_without_a_desired_value_has_none() {
        let device = json!({"metadata": {"name": "d", "namespace": "n"},
            "spec": {"properties": [{"name": "temp"}]}});
        let d = super::device(&device, None);
        assert!(d.spec.expect("spec").properties[0].desired.is_none());
    }
}
