//! KubeEdge's DeviceTwin tables (`device`, `device_attr`, `device_twin`), read and written in
//! the worker's transaction. Values are kept as KubeEdge writes them: JSON text for metadata
//! and versions, `optional` as 0/1.

use std::collections::{BTreeMap, HashMap};
use std::sync::{MutexGuard, PoisonError};

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

/// Each cached device's twins as a read of its rows would return them. A write updates the
/// entry (an inserted twin, whose row id SQLite picks, drops it), and any rollback drops them
/// all: what the cache holds never outlives the transaction that wrote it. Kept as a slice,
/// not a map: a map's first node holds room for eleven twins, about 3 KiB a device.
pub(super) struct TwinCache {
    devices: HashMap<String, Box<[Twin]>>,
    max: usize,
}

impl TwinCache {
    pub(super) fn new(max: usize) -> TwinCache {
        TwinCache {
            devices: HashMap::new(),
            max,
        }
    }

    fn keep(&mut self, device: &str, twins: &BTreeMap<String, Twin>) {
        if self.max == 0 {
            return;
        }
        if self.devices.len() >= self.max {
            // Any one: the bound is on memory, and a dropped device costs one read later.
            if let Some(other) = self.devices.keys().next().cloned() {
                self.devices.remove(&other);
            }
        }
        self.devices
            .insert(device.to_owned(), twins.values().cloned().collect());
    }
}

impl Db {
    fn twin_cache(&self) -> MutexGuard<'_, TwinCache> {
        self.twins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Drops every cached twin: a rollback may have undone any of them.
    pub(super) fn forget_twins(&self) {
        self.twin_cache().devices.clear();
    }

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
        self.twin_cache().devices.remove(id);
        self.exec("DELETE FROM device_attr WHERE deviceid = ?1", [id])
            .await?;
        self.exec("DELETE FROM device_twin WHERE deviceid = ?1", [id])
            .await?;
        self.exec("DELETE FROM device WHERE id = ?1", [id]).await?;
        Ok(())
    }

    /// The device's twins by property name.
    pub async fn twins(&self, device: &str) -> Result<BTreeMap<String, Twin>, libsql::Error> {
        if let Some(twins) = self.twin_cache().devices.get(device) {
            return Ok(twins
                .iter()
                .map(|twin| (twin.name.clone(), twin.clone()))
                .collect());
        }
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
        self.twin_cache().keep(device, &twins);
        Ok(twins)
    }

    /// Inserts a twin that has no row yet, else updates its row.
    pub async fn write_twin(&self, device: &str, twin: &Twin) -> Result<(), libsql::Error> {
        // Out of the cache while written: back only once its row holds the twin.
        let cached = self.twin_cache().devices.remove(device);
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
                .await?;
            }
            Some(row) => {
                // A row keeps its device and name, and leaving them out of the SET keeps SQLite
                // from rewriting their index entry: one page less per report in the WAL.
                let mut with_row = values[2..].to_vec();
                with_row.push(Value::Integer(row));
                let changed = self
                    .exec(
                        "UPDATE device_twin SET description = ?1, expected = ?2, actual = ?3,
                         expected_meta = ?4, actual_meta = ?5, expected_version = ?6,
                         actual_version = ?7, optional = ?8, attr_type = ?9, metadata = ?10
                         WHERE id = ?11",
                        with_row,
                    )
                    .await?;
                if let (1, Some(mut twins)) = (changed, cached) {
                    let same = |kept: &&mut Twin| kept.row == Some(row) && kept.name == twin.name;
                    if let Some(kept) = twins.iter_mut().find(same) {
                        kept.clone_from(twin);
                        self.twin_cache().devices.insert(device.to_owned(), twins);
                    }
                }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreConfig;

    async fn open(dir: &tempfile::TempDir, twin_cache: usize) -> Db {
        let config = StoreConfig {
            path: dir.path().join("meta.db"),
            twin_cache,
            ..StoreConfig::default()
        };
        Db::open(&config).await.expect("open")
    }

    fn reported(name: &str, actual: &str) -> Twin {
        Twin {
            name: name.into(),
            actual: Some(actual.into()),
            ..Twin::default()
        }
    }

    async fn actual(db: &Db, device: &str, name: &str) -> Option<String> {
        let twins = db.twins(device).await.expect("read twins");
        twins.get(name).and_then(|twin| twin.actual.clone())
    }

    /// Writes `value` as d1's temperature (its row exists).
    async fn write(db: &Db, twin: &mut Twin, value: &str) {
        twin.actual = Some(value.into());
        db.write_twin("d1", twin).await.expect("update");
    }

    /// d1's temperature as the store reads it.
    async fn temperature(db: &Db) -> Option<String> {
        actual(db, "d1", "temperature").await
    }

    /// A twin written and then undone, by a savepoint or the whole transaction, reads as the
    /// row holds it again, though the write had put it in the cache.
    #[tokio::test]
    async fn an_undone_twin_write_is_not_read_back() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = open(&dir, 16).await;
        db.write_twin("d1", &reported("temperature", "20"))
            .await
            .expect("insert");
        let mut twin = db.twins("d1").await.expect("read")["temperature"].clone();

        let tx = db.begin(true).await.expect("begin");
        let step = tx.savepoint().await.expect("savepoint");
        write(&db, &mut twin, "21").await;
        assert_eq!(temperature(&db).await.as_deref(), Some("21"));
        step.rollback().await.expect("roll back the step");
        assert_eq!(temperature(&db).await.as_deref(), Some("20"));

        write(&db, &mut twin, "22").await;
        assert_eq!(temperature(&db).await.as_deref(), Some("22"));
        tx.rollback().await.expect("roll back");
        assert_eq!(temperature(&db).await.as_deref(), Some("20"));

        let tx = db.begin(true).await.expect("begin");
        write(&db, &mut twin, "23").await;
        tx.commit().await.expect("commit");
        drop(db);
        let db = open(&dir, 16).await;
        assert_eq!(temperature(&db).await.as_deref(), Some("23"));
    }

    /// With room for two devices, twenty read in turn each get their own twins while the cache
    /// stays at two, and a deleted device's twins are gone.
    #[tokio::test]
    async fn a_full_cache_still_reads_each_device_right() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = open(&dir, 2).await;
        let devices: Vec<String> = (0..20).map(|i| format!("d{i}")).collect();
        for (i, device) in devices.iter().enumerate() {
            db.write_twin(device, &reported("t", &i.to_string()))
                .await
                .expect("insert");
        }
        for _ in 0..2 {
            for (i, device) in devices.iter().enumerate() {
                let value = i.to_string();
                assert_eq!(actual(&db, device, "t").await, Some(value));
                assert!(db.twin_cache().devices.len() <= 2);
            }
        }
        db.delete_device("d19").await.expect("delete");
        assert!(db.twins("d19").await.expect("read").is_empty());
    }
}
