//! The devices row's DMI half: the devices are Device objects in the fake API server, which the
//! controller brings through the cloud broker to a node serving DMI; one gRPC mapper registers
//! (KubeEdge's `MapperRegister`) and reports each device's twin once a second
//! (`ReportDeviceStatus`, docs/devices.md "Mappers over DMI"), each call timed to its OK. Then
//! every device's twin is read back from the node with `twin/get`, and its DeviceStatus from
//! the API, to check that both hold the device's last report.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use edgemeta_dmi::pb;
use edgemeta_dmi::pb::device_manager_service_client::DeviceManagerServiceClient;
use hyper_util::rt::TokioIo;
use rumqttc::QoS;
use serde_json::json;
use tokio::task::JoinSet;
use tonic::transport::{Channel, Endpoint, Uri};

use super::cloud::Cloud;
use super::schedule::{report_value, WARM_UP};
use super::{client, subscribe, PUBACK, SUBACK};

/// Where the devices are, in Kubernetes and in a report.
const NAMESPACE: &str = "default";
/// The devices' protocol: the one mapper's.
const PROTOCOL: &str = "modbus";
/// The devices' DeviceModel.
const MODEL: &str = "bench-thermometer";
/// KubeEdge's device API in `NAMESPACE`.
const DEVICES_API: &str = "/apis/devices.kubeedge.io/v1beta1/namespaces/default";

/// A call's answer: OK, or its status code and message.
type Answer = Result<(), (tonic::Code, String)>;

/// How long one call may take before it counts as lost.
const GRACE: Duration = Duration::from_secs(5);

/// What the DMI mapper saw.
pub struct DmiOutcome {
    /// Call → OK, µs, of every acknowledged report.
    pub samples: Vec<u64>,
    /// The same, of reports scheduled from [`WARM_UP`] on.
    pub steady: Vec<u64>,
    pub sent: usize,
    /// Calls answered OK.
    pub acknowledged: usize,
    /// Calls answered with an error status, by gRPC code.
    pub errors: BTreeMap<String, usize>,
    /// The first message of each error code, to tell what refused the call.
    pub first_errors: BTreeMap<String, String>,
    /// Calls not answered within `GRACE`.
    pub lost: usize,
    /// OKs per second, first scheduled report → last answer.
    pub rate: f64,
    /// Largest delay of a call behind its schedule (the load generator's own lag), µs.
    pub late_max: u64,
}

/// The node's DMI socket in `dir`, and the configuration section that turns it on.
pub fn socket_config(dir: &Path) -> (PathBuf, String) {
    let socket = dir.join("dmi.sock");
    let yaml = format!("devices:\n  dmi:\n    socket: {}\n", socket.display());
    (socket, yaml)
}

/// One HTTP/2 connection to the node's DMI socket (a mapper keeps one), retried until the
/// node listens or 10 s pass.
async fn channel(socket: &Path) -> anyhow::Result<Channel> {
    let started = Instant::now();
    loop {
        let path = socket.to_path_buf();
        let connected = Endpoint::from_static("http://dmi-node")
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await;
        match connected {
            Ok(channel) => return Ok(channel),
            Err(e) if started.elapsed() > Duration::from_secs(10) => {
                return Err(e).with_context(|| format!("connect to {}", socket.display()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A mapper's `ReportDeviceStatus` of device `id`'s temperature (the MQTT half's twin, typed
/// int).
fn request(id: &str, value: String) -> pb::ReportDeviceStatusRequest {
    pb::ReportDeviceStatusRequest {
        device_name: id.to_owned(),
        device_namespace: NAMESPACE.to_owned(),
        reported_device: Some(pb::DeviceStatus {
            twins: vec![pb::Twin {
                property_name: "temperature".into(),
                observed_desired: None,
                reported: Some(pb::TwinProperty {
                    value,
                    metadata: HashMap::from([("type".to_owned(), "int".to_owned())]),
                }),
            }],
            ..Default::default()
        }),
    }
}

/// Every device reports once a second for `seconds` through one gRPC connection, open loop on
/// the MQTT half's schedule: device `j` (of `N`) at `j/N` s into each second, with the value
/// the MQTT half sends then.
pub async fn run_load(socket: &Path, ids: &[String], seconds: u64) -> anyhow::Result<DmiOutcome> {
    let client = DeviceManagerServiceClient::new(channel(socket).await?);
    // One call first, outside the measurement: the path works end to end.
    client
        .clone()
        .report_device_status(request(&ids[0], report_value(0)))
        .await
        .context("DMI: the probe report was refused")?;

    let n = ids.len();
    let mut out = DmiOutcome {
        samples: Vec::with_capacity(n * seconds as usize),
        steady: Vec::with_capacity(n * seconds as usize),
        sent: 0,
        acknowledged: 0,
        errors: BTreeMap::new(),
        first_errors: BTreeMap::new(),
        lost: 0,
        rate: 0.0,
        late_max: 0,
    };
    let mut tally = |(second, took, answer): (u64, Duration, Option<Answer>)| match answer {
        Some(Ok(())) => {
            out.acknowledged += 1;
            out.samples.push(took.as_micros() as u64);
            if second >= WARM_UP {
                out.steady.push(took.as_micros() as u64);
            }
        }
        Some(Err((code, message))) => {
            let code = format!("{code:?}");
            *out.errors.entry(code.clone()).or_default() += 1;
            out.first_errors.entry(code).or_insert(message);
        }
        None => out.lost += 1,
    };
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let mut calls = JoinSet::new();
    let (mut sent, mut late_max) = (0, 0);
    for k in 0..seconds {
        for (j, id) in ids.iter().enumerate() {
            let at = start
                + Duration::from_secs(k)
                + Duration::from_nanos(j as u64 * 1_000_000_000 / n as u64);
            tokio::time::sleep_until(at).await;
            late_max = late_max.max(at.elapsed().as_micros() as u64);
            let mut c = client.clone();
            let req = request(id, report_value(j + k as usize));
            calls.spawn(async move {
                let sent = Instant::now();
                let answer = tokio::time::timeout(GRACE, c.report_device_status(req)).await;
                let took = sent.elapsed();
                let answer = answer.ok().map(|r| {
                    r.map(|_| ())
                        .map_err(|s| (s.code(), s.message().to_owned()))
                });
                (k, took, answer)
            });
            sent += 1;
            while let Some(done) = calls.try_join_next() {
                tally(done?);
            }
        }
    }
    while let Some(done) = calls.join_next().await {
        tally(done?);
    }
    let last = tokio::time::Instant::now();
    out.sent = sent;
    out.late_max = late_max;
    out.rate = out.samples.len() as f64 / (last - start).as_secs_f64().max(1e-6);
    Ok(out)
}

/// How many of `ids` hold, in the node's twin (`twin/get` over MQTT on `port`), the value of
/// their last report of a `seconds`-long run.
pub async fn stored(port: u16, ids: &[String], seconds: u64) -> anyhow::Result<usize> {
    let (c, mut rx) = client(port, "twin-check").await?;
    subscribe(&c, &mut rx, "$hw/events/device/+/+/twin/get/result").await?;
    for id in ids {
        c.publish(
            format!("$hw/events/device/{NAMESPACE}/{id}/twin/get"),
            QoS::AtLeastOnce,
            false,
            json!({"event_id": id, "timestamp": 0}).to_string(),
        )
        .await?;
    }
    let expected: HashMap<&str, String> = ids
        .iter()
        .enumerate()
        .map(|(j, id)| (id.as_str(), report_value(j + seconds as usize - 1)))
        .collect();
    let (mut answered, mut matching) = (0, 0);
    let started = Instant::now();
    while answered < ids.len() {
        let left = Duration::from_secs(30).saturating_sub(started.elapsed());
        let Ok(got) = tokio::time::timeout(left, rx.recv()).await else {
            bail!(
                "twin/get answered for {answered} of {} devices within 30 s",
                ids.len()
            );
        };
        let (topic, payload) = got.context("connection gone")?;
        if topic == PUBACK || topic == SUBACK {
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&payload)?;
        let Some(want) = body["event_id"].as_str().and_then(|e| expected.get(e)) else {
            continue;
        };
        answered += 1;
        if body["twin"]["temperature"]["actual"]["value"].as_str() == Some(want.as_str()) {
            matching += 1;
        }
    }
    let _ = c.disconnect().await;
    Ok(matching)
}

/// KubeEdge's device CRDs as they are (`conf/kube/crds`, with `kubectl`), then a DeviceModel
/// with the twin's property (`temperature`, INT) and a Device bound to `node` for each of
/// `ids`, posted to the API as a user's tooling would.
pub async fn create_devices(cloud: &Cloud, node: &str, ids: &[String]) -> anyhow::Result<()> {
    let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/../conf/kube/crds");
    cloud.kubectl_apply(Path::new(crds))?;
    // The CRDs are served once stored; the first POST may come just before.
    let model = json!({"apiVersion": "devices.kubeedge.io/v1beta1", "kind": "DeviceModel",
        "metadata": {"name": MODEL, "namespace": NAMESPACE},
        "spec": {"properties": [{"name": "temperature", "type": "INT", "accessMode": "ReadWrite",
                                 "minimum": "-40", "maximum": "125", "unit": "Celsius"}],
                 "protocol": PROTOCOL}});
    let started = Instant::now();
    while let Err(e) = cloud
        .create(&format!("{DEVICES_API}/devicemodels"), &model)
        .await
    {
        if started.elapsed() > Duration::from_secs(10) {
            return Err(e.context("the DeviceModel"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (j, id) in ids.iter().enumerate() {
        let device = json!({"apiVersion": "devices.kubeedge.io/v1beta1", "kind": "Device",
            "metadata": {"name": id, "namespace": NAMESPACE},
            "spec": {"deviceModelRef": {"name": MODEL}, "nodeName": node,
                     "properties": [{"name": "temperature", "desired": {"value": "20"},
                                     "collectCycle": 1000, "reportCycle": 1000,
                                     "reportToCloud": true,
                                     "visitors": {"protocolName": PROTOCOL, "configData":
                                         {"register": "HoldingRegister", "offset": j, "limit": 1}}}],
                     "protocol": {"protocolName": PROTOCOL,
                                  "configData": {"ip": "127.0.0.1", "port": 502}}}});
        cloud
            .create(&format!("{DEVICES_API}/devices"), &device)
            .await
            .with_context(|| format!("Device {id}"))?;
    }
    Ok(())
}

/// The mapper registers as mapper-framework's do on start (`withData`), naming `address` as its
/// own socket, until the node's answer lists all `count` devices (their models may reach the
/// node after the last device does); gives up after 30 s.
pub async fn register(socket: &Path, address: &Path, count: usize) -> anyhow::Result<()> {
    let mut client = DeviceManagerServiceClient::new(channel(socket).await?);
    let started = Instant::now();
    loop {
        let answer = client
            .mapper_register(pb::MapperRegisterRequest {
                with_data: true,
                mapper: Some(pb::MapperInfo {
                    name: "bench-mapper".into(),
                    version: "v1.0".into(),
                    api_version: "v1beta1".into(),
                    protocol: PROTOCOL.into(),
                    address: address.as_os_str().as_encoded_bytes().to_vec(),
                    state: "ok".into(),
                }),
            })
            .await
            .context("MapperRegister")?
            .into_inner();
        if answer.device_list.len() >= count {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!(
                "MapperRegister lists {} of {count} devices after 30 s",
                answer.device_list.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls the DeviceStatuses until every one of `ids` holds the value of its last report of a
/// `seconds`-long run, or `within` has passed: how many hold it, and when the last one did
/// (from the call).
pub async fn in_device_status(
    cloud: &Cloud,
    ids: &[String],
    seconds: u64,
    within: Duration,
) -> anyhow::Result<(usize, Duration)> {
    let expected: HashMap<&str, String> = ids
        .iter()
        .enumerate()
        .map(|(j, id)| (id.as_str(), report_value(j + seconds as usize - 1)))
        .collect();
    let started = Instant::now();
    loop {
        let statuses = cloud.list(&format!("{DEVICES_API}/devicestatuses")).await?;
        let holding = statuses
            .iter()
            .filter(|s| {
                let Some(want) = s["metadata"]["name"].as_str().and_then(|n| expected.get(n))
                else {
                    return false;
                };
                s["status"]["twins"].as_array().is_some_and(|twins| {
                    twins.iter().any(|t| {
                        t["propertyName"] == "temperature"
                            && t["reported"]["value"].as_str() == Some(want.as_str())
                    })
                })
            })
            .count();
        if holding == ids.len() || started.elapsed() > within {
            return Ok((holding, started.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
