//! KubeEdge's DeviceTwin tables (`device`, `device_attr`, `device_twin`), read and written in
//! the worker's transaction. Values are kept as KubeEdge writes them: JSON text for metadata
//! and versions, `optional` as 0/1.

use std::collections::BTreeMap;

use libsql::{params, Value};

use super::{text, Db};
use crate::devices::twin::Twin;
use crate::devices::wire::MsgAttr;

/// One `device` row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceRow {
    pub id: String,
    pub name: String,
    pub description: String,
    pub state: String,
    pub last_online: String,
}

impl Db {
    /// The device `id`, if this node has it.
    pub async fn device(&self, id: &str) -> Result<Option<DeviceRow>, libsql::Error> {
        const SQL: &str =
            "SELECT id, name, description, state, last_online FROM device WHERE id = ?1";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([id]).await?;
        let device = match rows.next().await? {
            Some(row) => Some(device_row(&row)?),
            None => None,
        };
        drop(rows);
        self.keep(SQL, statement);
        Ok(device)
    }

    /// Every device of this node, by id.
    pub async fn devices(&self) -> Result<Vec<DeviceRow>, libsql::Error> {
        let mut rows = self
            .conn
            .query(
                "SELECT id, name, description, state, last_online FROM device ORDER BY id",
                (),
            )
            .await?;
        let mut out = Vec::new();
        while let Some(row) = rows.next().await? {
            out.push(device_row(&row)?);
        }
        Ok(out)
    }

    /// Whether this node has any device.
    pub async fn has_devices(&self) -> Result<bool, libsql::Error> {
        Ok(self
            .scalar_i64("SELECT EXISTS (SELECT 1 FROM device)")
            .await?
            != 0)
    }

    pub async fn insert_device(&self, device: &DeviceRow) -> Result<(), libsql::Error> {
        self.exec(
            "INSERT OR REPLACE INTO device (id, name, description, state, last_online)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![
                device.id.as_str(),
                device.name.as_str(),
                device.description.as_str(),
                device.state.as_str(),
                device.last_online.as_str()
            ],
        )
        .await
        .map(drop)
    }

    pub async fn set_device_state(
        &self,
        id: &str,
        state: &str,
        last_online: &str,
    ) -> Result<(), libsql::Error> {
        self.exec(
            "UPDATE device SET state = ?2, last_online = ?3 WHERE id = ?1",
            params![id, state, last_online],
        )
        .await
        .map(drop)
    }

    /// Removes the device with its attributes and twins (KubeEdge `DeleteDeviceTrans`).
    pub async fn delete_device(&self, id: &str) -> Result<(), libsql::Error> {
        self.exec("DELETE FROM device_attr WHERE deviceid = ?1", [id])
            .await?;
        self.exec("DELETE FROM device_twin WHERE deviceid = ?1", [id])
            .await?;
        self.exec("DELETE FROM device WHERE id = ?1", [id]).await?;
        Ok(())
    }

    /// The device's twins by property name.
    pub async fn twins(&self, device: &str) -> Result<BTreeMap<String, Twin>, libsql::Error> {
        const SQL: &str = "SELECT id, name, description, expected, actual, expected_meta,
            actual_meta, expected_version, actual_version, optional, attr_type, metadata
            FROM device_twin WHERE deviceid = ?1 ORDER BY id";
        let statement = self.statement(SQL).await?;
        let mut rows = statement.query([device]).await?;
        let mut twins = BTreeMap::new();
        while let Some(row) = rows.next().await? {
            let twin = Twin {
                row: Some(row.get::<i64>(0)?),
                name: text(&row, 1)?.unwrap_or_default(),
                description: text(&row, 2)?.unwrap_or_default(),
                expected: text(&row, 3)?,
                actual: text(&row, 4)?,
                expected_meta: json_column(&row, 5)?,
                actual_meta: json_column(&row, 6)?,
                expected_version: json_column(&row, 7)?,
                actual_version: json_column(&row, 8)?,
                optional: flag(&row, 9)?,
                attr_type: text(&row, 10)?.unwrap_or_default(),
                metadata: text(&row, 11)?.unwrap_or_default(),
            };
            twins.insert(twin.name.clone(), twin);
        }
        drop(rows);
        self.keep(SQL, statement);
        Ok(twins)
    }

    /// Inserts a twin that has no row yet, else updates its row.
    pub async fn write_twin(&self, device: &str, twin: &Twin) -> Result<(), libsql::Error> {
        let json = |v: Option<String>| v.map_or(Value::Null, Value::Text);
        let meta = |m: &Option<crate::devices::wire::ValueMetadata>| {
            json(m.as_ref().and_then(|m| serde_json::to_string(m).ok()))
        };
        let version = |v: &Option<crate::devices::wire::TwinVersion>| {
            json(v.as_ref().and_then(|v| serde_json::to_string(v).ok()))
        };
        let values = [
            Value::Text(device.to_owned()),
            Value::Text(twin.name.clone()),
            Value::Text(twin.description.clone()),
            json(twin.expected.clone()),
            json(twin.actual.clone()),
            meta(&twin.expected_meta),
            meta(&twin.actual_meta),
            version(&twin.expected_version),
            version(&twin.actual_version),
            Value::Integer(i64::from(twin.optional)),
            Value::Text(twin.attr_type.clone()),
            Value::Text(twin.metadata.clone()),
        ];
        match twin.row {
            None => {
                self.exec(
                    "INSERT INTO device_twin (deviceid, name, description, expected, actual,
                     expected_meta, actual_meta, expected_version, actual_version, optional,
                     attr_type, metadata) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                    values.to_vec(),
                )
                .await?
            }
            Some(row) => {
                // A row keeps its device and name, and leaving them out of the SET keeps SQLite
                // from rewriting their index entry: one page less per report in the WAL.
                let mut with_row = values[2..].to_vec();
                with_row.push(Value::Integer(row));
                self.exec(
                    "UPDATE device_twin SET description = ?1, expected = ?2, actual = ?3,
                     expected_meta = ?4, actual_meta = ?5, expected_version = ?6,
                     actual_version = ?7, optional = ?8, attr_type = ?9, metadata = ?10
                     WHERE id = ?11",
                    with_row,
                )
                .await?
            }
        };
        Ok(())
    }

    /// The device's attributes by name.
    pub async fn attributes(
        &self,
        device: &str,
    ) -> Result<BTreeMap<String, MsgAttr>, libsql::Error> {
        let mut rows = self
            .conn
            .query(
                "SELECT name, value, optional, attr_type FROM device_attr WHERE deviceid = ?1
                 ORDER BY id",
                [device],
            )
            .await?;
        let mut out = BTreeMap::new();
        while let Some(row) = rows.next().await? {
            let name = text(&row, 0)?.unwrap_or_default();
            let attr = MsgAttr {
                value: text(&row, 1)?.unwrap_or_default(),
                optional: Some(flag(&row, 2)?),
                metadata: Some(crate::devices::wire::TypeMetadata {
                    kind: text(&row, 3)?.unwrap_or_default(),
                }),
            };
            out.insert(name, attr);
        }
        Ok(out)
    }

    /// Replaces the device's attributes with `attributes` (the cloud sends the whole set).
    pub async fn set_attributes(
        &self,
        device: &str,
        attributes: &BTreeMap<String, MsgAttr>,
    ) -> Result<(), libsql::Error> {
        self.exec("DELETE FROM device_attr WHERE deviceid = ?1", [device])
            .await?;
        for (name, attr) in attributes {
            let kind = attr.metadata.as_ref().map_or("string", |m| m.kind.as_str());
            self.exec(
                "INSERT INTO device_attr (deviceid, name, description, value, optional,
                 attr_type, metadata) VALUES (?1, ?2, '', ?3, ?4, ?5, '{}')",
                params![
                    device,
                    name.as_str(),
                    attr.value.as_str(),
                    i64::from(attr.optional.unwrap_or(true)),
                    kind
                ],
            )
            .await?;
        }
        Ok(())
    }
}

fn device_row(row: &libsql::Row) -> Result<DeviceRow, libsql::Error> {
    Ok(DeviceRow {
        id: text(row, 0)?.unwrap_or_default(),
        name: text(row, 1)?.unwrap_or_default(),
        description: text(row, 2)?.unwrap_or_default(),
        state: text(row, 3)?.unwrap_or_default(),
        last_online: text(row, 4)?.unwrap_or_default(),
    })
}

/// A JSON text column; empty or unreadable text (a hand-edited file) reads as absent.
fn json_column<T: serde::de::DeserializeOwned>(
    row: &libsql::Row,
    index: i32,
) -> Result<Option<T>, libsql::Error> {
    Ok(text(row, index)?
        .filter(|s| !s.is_empty())
        .and_then(|s| serde_json::from_str(&s).ok()))
}

/// A boolean column as gorm (1/0) or by hand (`true`) may have stored it.
fn flag(row: &libsql::Row, index: i32) -> Result<bool, libsql::Error> {
    Ok(match row.get_value(index)? {
        Value::Integer(i) => i != 0,
        Value::Text(s) => matches!(s.as_str(), "1" | "true" | "TRUE" | "t"),
        _ => false,
    })
}
