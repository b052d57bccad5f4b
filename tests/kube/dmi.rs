//! Devices through DMI, end to end: KubeEdge's CRDs and a Device applied with `kubectl` to the
//! fake API server, the real controller and cloud broker, a node serving DMI on a unix socket,
//! and a mapper built in Python grpcio from the same `api.proto` (`dmi_mapper.py`), speaking
//! gRPC as mapper-framework's template does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;

use super::common::cloud::bridged_with;
use super::common::{wait_until, Options};
use super::devices::{
    api, apply_device, kubectl_apply, kubectl_patch_json, status, twin_get, DEVICE, ID,
};
use super::{CloudBroker, Cluster, Controller};

const WAIT: Duration = Duration::from_secs(20);

/// The Python mapper: its stdout's JSON lines, its stdin for commands.
struct PyMapper {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<Value>,
    seen: Vec<Value>,
}

impl PyMapper {
    /// Starts it (stubs generated into `dir` the first time) and waits until it registered
    /// and serves.
    async fn start(node_socket: &Path, dir: &Path) -> PyMapper {
        PyMapper::start_for(node_socket, dir, "modbus").await
    }

    /// A mapper of `protocol`, serving on `<dir>/<protocol>.sock`.
    async fn start_for(node_socket: &Path, dir: &Path, protocol: &str) -> PyMapper {
        let script = format!("{}/tests/kube/dmi_mapper.py", env!("CARGO_MANIFEST_DIR"));
        let own = dir.join(format!("{protocol}.sock"));
        let stubs = dir.join("stubs");
        std::fs::create_dir_all(&stubs).expect("stub dir");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(node_socket)
            .arg(&own)
            .arg(&stubs)
            .arg(protocol)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (scripts/test installs grpcio and grpcio-tools)");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel(4096);
        tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let value = serde_json::from_str(&line).unwrap_or(json!({"text": line}));
                if tx.send(value).await.is_err() {
                    return;
                }
            }
        });
        let mut mapper = PyMapper {
            child,
            stdin,
            lines,
            seen: Vec::new(),
        };
        mapper.next("serving", |e| e["event"] == "serving").await;
        mapper
    }

    /// The first line `pick` accepts, of those passed over before (`seen`) or the next ones.
    async fn next(&mut self, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
        if let Some(i) = self.seen.iter().position(&pick) {
            return self.seen.remove(i);
        }
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv()).await;
            match line {
                Ok(Some(line)) if pick(&line) => return line,
                Ok(Some(line)) => self.seen.push(line),
                Ok(None) => panic!("the mapper ended before {what}; saw {:#?}", self.seen),
                Err(_) => panic!(
                    "no {what} from the mapper within {WAIT:?}; saw {:#?}",
                    self.seen
                ),
            }
        }
    }

    /// Sends a command without waiting for anything.
    async fn tell(&mut self, command: &str) {
        self.stdin
            .write_all(format!("{command}\n").as_bytes())
            .await
            .expect("mapper stdin");
    }

    /// Sends a command and returns its answer line.
    async fn ask(&mut self, command: &str) -> Value {
        self.tell(command).await;
        let word = command.split(' ').next().unwrap_or_default().to_owned();
        self.next(command, |e| e["answer"] == word.as_str()).await
    }

    async fn kill(mut self) {
        let _ = self.child.kill().await;
    }
}

/// What most DMI tests start from: a cluster, a cloud broker, the controller, and a bridged
/// node serving DMI on `<dir>/dmi.sock` with more `EDGEMETA_DEVICES__DMI__*` settings.
/// Destructured in the field order below, the node goes first and the cluster last.
struct DmiRig {
    cluster: Cluster,
    cloud: CloudBroker,
    controller: Controller,
    dir: tempfile::TempDir,
    node: super::common::Node,
    bridge: super::common::CloudOptions,
    socket: PathBuf,
}

impl DmiRig {
    async fn start(settings: &[(&str, &str)]) -> DmiRig {
        let cluster = Cluster::start().await;
        let cloud = CloudBroker::start().await;
        let controller = Controller::start(&cluster, &cloud);
        let dir = tempfile::tempdir().expect("dir");
        let (node, bridge, socket) = dmi_node_with(&cloud, dir.path(), settings).await;
        DmiRig {
            cluster,
            cloud,
            controller,
            dir,
            node,
            bridge,
            socket,
        }
    }
}

/// A bridged node serving DMI on `<dir>/dmi.sock`, with `EDGEMETA_DEVICES__DMI__*` settings.
async fn dmi_node_with(
    cloud: &CloudBroker,
    dir: &Path,
    settings: &[(&str, &str)],
) -> (super::common::Node, super::common::CloudOptions, PathBuf) {
    let socket = dir.join("dmi.sock");
    let mut env = vec![(
        "EDGEMETA_DEVICES__DMI__SOCKET".to_owned(),
        socket.display().to_string(),
    )];
    env.extend(
        settings
            .iter()
            .map(|(k, v)| (format!("EDGEMETA_DEVICES__DMI__{k}"), (*v).to_owned())),
    );
    let (node, bridge) = bridged_with(
        cloud,
        Options {
            env,
            ..Options::default()
        },
    )
    .await;
    (node, bridge, socket)
}

/// Waits until the DeviceStatus holds `value` as the reported `temp`; `what` names the wait.
async fn await_reported_temp(cluster: &Cluster, controller: &Controller, what: &str, value: &str) {
    wait_until(what, WAIT, async || {
        let status = status(cluster).await;
        if twin(&status, "temp")["reported"]["value"] == value {
            Ok(())
        } else {
            Err(format!("{status}\n--- controller\n{}", controller.log()))
        }
    })
    .await;
}

fn twin<'a>(status: &'a Value, property: &str) -> &'a Value {
    status["twins"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["propertyName"] == property))
        .unwrap_or(&Value::Null)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_mapper_gets_its_kubectl_device_and_edits_and_its_reports_reach_the_devicestatus() {
    let DmiRig {
        cluster,
        cloud: _cloud,
        controller,
        dir,
        node: _node,
        bridge,
        socket,
    } = DmiRig::start(&[]).await;
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    let registered = mapper
        .next("MapperRegister", |e| e["call"] == "MapperRegister")
        .await;
    assert_eq!(registered["devices"], json!([]), "{registered}");

    // kubectl apply: the model goes first, then RegisterDevice with the Device's spec.
    apply_device(&cluster, &bridge.node_id);
    mapper
        .next("CreateDeviceModel", |e| e["call"] == "CreateDeviceModel")
        .await;
    let device = mapper
        .next("RegisterDevice", |e| {
            e["call"] == "RegisterDevice" && e["name"] == DEVICE
        })
        .await;
    assert_eq!(device["model"], "beta1-model", "{device}");
    assert_eq!(device["desired"]["temp"], "30", "{device}");
    assert_eq!(device["protocol"], "modbus", "{device}");
    // configData as KubeEdge sends it: strings as StringValue, numbers as FloatValue.
    assert_eq!(device["config"]["ip"], "172.17.0.3", "{device}");
    assert_eq!(device["config"]["port"], 1502.0, "{device}");
    assert_eq!(
        device["visitors"]["temp"]["register"], "HoldingRegister",
        "{device}"
    );

    // Desired values edited with `kubectl patch --type json` reach the mapper as UpdateDevice.
    let mut latencies = Vec::new();
    for i in 0..20 {
        let value = (100 + i).to_string();
        kubectl_patch_json(
            &cluster,
            DEVICE,
            &json!([{"op": "replace", "path": "/spec/properties/0/desired/value", "value": value}]),
        );
        let edited = Instant::now();
        mapper
            .next("UpdateDevice", |e| {
                e["call"] == "UpdateDevice" && e["desired"]["temp"] == value.as_str()
            })
            .await;
        latencies.push(edited.elapsed());
    }
    latencies.sort();
    eprintln!(
        "kubectl patch → UpdateDevice over {} edits: p50 {:?}, p99 {:?}",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99)
    );

    // A report reaches the DeviceStatus, and the state too.
    let answer = mapper.ask("report default beta1-device temp 41").await;
    assert_eq!(answer["ok"], true, "{answer}");
    let reported = Instant::now();
    await_reported_temp(
        &cluster,
        &controller,
        "the report in the DeviceStatus",
        "41",
    )
    .await;
    eprintln!(
        "ReportDeviceStatus → DeviceStatus: {:?}",
        reported.elapsed()
    );
    let answer = mapper.ask("state default beta1-device online").await;
    assert_eq!(answer["ok"], true, "{answer}");
    wait_until("the state in the DeviceStatus", WAIT, async || {
        let status = status(&cluster).await;
        if status["state"] == "online" {
            Ok(())
        } else {
            Err(status.to_string())
        }
    })
    .await;

    // Refused reports get a status and change nothing.
    let unknown = mapper.ask("report default no-such-device temp 1").await;
    assert_eq!(unknown["code"], "NOT_FOUND", "{unknown}");
    let typed = mapper.ask("report default beta1-device temp warm").await;
    assert_eq!(typed["code"], "INVALID_ARGUMENT", "{typed}");
    let state = mapper.ask("state default beta1-device exploded").await;
    assert_eq!(state["code"], "INVALID_ARGUMENT", "{state}");
    let malformed = mapper.ask("raw ffffffff0a").await;
    assert_eq!(malformed["ok"], false, "{malformed}");
    let big = mapper.ask("big default beta1-device 2000000").await;
    assert_eq!(big["code"], "OUT_OF_RANGE", "{big}");
    let status = status(&cluster).await;
    assert_eq!(twin(&status, "temp")["reported"]["value"], "41", "{status}");
    assert_eq!(status["state"], "online", "{status}");
    // The node still serves after all that.
    let answer = mapper.ask("report default beta1-device temp 43").await;
    assert_eq!(answer["ok"], true, "{answer}");

    // The desired value removed from the Device is removed at the mapper.
    kubectl_patch_json(
        &cluster,
        DEVICE,
        &json!([{"op": "remove", "path": "/spec/properties/0/desired"}]),
    );
    mapper
        .next("UpdateDevice without a desired value", |e| {
            e["call"] == "UpdateDevice" && e["desired"]["temp"].is_null()
        })
        .await;

    // The mapper is killed; devices change meanwhile; once it registers again it holds
    // exactly the node's devices at their latest spec.
    mapper.kill().await;
    let second = std::fs::read_to_string(super::devices::conf("demo-device.yaml"))
        .expect("device manifest")
        .replace("nodeName: edge-1", &format!("nodeName: {}", bridge.node_id))
        .replace("name: beta1-device", "name: beta1-device-2");
    kubectl_apply(&cluster, &["-f", "-"], Some(&second));
    kubectl_patch_json(
        &cluster,
        DEVICE,
        &json!([{"op": "add", "path": "/spec/properties/0/desired", "value": {"value": "77"}}]),
    );
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    let want =
        json!({"default/beta1-device": {"temp": "77"}, "default/beta1-device-2": {"temp": "30"}});
    wait_until(
        "the restarted mapper holding the node's devices",
        WAIT,
        async || {
            let held = mapper.ask("held").await;
            if held["desired"] == want {
                Ok(held)
            } else {
                Err(held.to_string())
            }
        },
    )
    .await;
}

/// Sets device `name`'s desired `temp` (its properties list replaced whole, as a merge patch
/// does).
async fn set_desired_of(devices: &Api<DynamicObject>, name: &str, value: &str) {
    let patch = json!({"spec": {"properties": [{"name": "temp", "desired": {"value": value}}]}});
    devices
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap_or_else(|e| panic!("patch {name}: {e}"));
}

/// What the mapper's `held` answers when it holds `desired` (device name → its desired temp).
fn held_as(desired: &BTreeMap<String, String>) -> Value {
    desired
        .iter()
        .map(|(name, value)| (format!("default/{name}"), json!({"temp": value})))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Waits until the mapper holds exactly `desired`.
async fn await_held(mapper: &mut PyMapper, desired: &BTreeMap<String, String>, what: &str) {
    let want = held_as(desired);
    wait_until(what, WAIT, async || {
        let held = mapper.ask("held").await;
        if held["desired"] == want {
            Ok(())
        } else {
            Err(format!("held {}\nwanted {want}", held["desired"]))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapper_killed_while_twenty_devices_change_holds_exactly_the_nodes_twenty_again() {
    let DmiRig {
        cluster,
        cloud: _cloud,
        controller: _controller,
        dir,
        node: _node,
        bridge,
        socket,
    } = DmiRig::start(&[]).await;
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    // The docs' device and 19 more of the same model, in one `kubectl apply`.
    apply_device(&cluster, &bridge.node_id);
    let manifest = std::fs::read_to_string(super::devices::conf("demo-device.yaml"))
        .expect("device manifest")
        .replace("nodeName: edge-1", &format!("nodeName: {}", bridge.node_id));
    let named = |name: &str| manifest.replace("name: beta1-device", &format!("name: {name}"));
    let more: Vec<String> = (1..20).map(|i| named(&format!("dev-{i:02}"))).collect();
    kubectl_apply(&cluster, &["-f", "-"], Some(&more.join("\n---\n")));
    let mut desired: BTreeMap<String, String> = (1..20)
        .map(|i| (format!("dev-{i:02}"), "30".to_owned()))
        .chain([(DEVICE.to_owned(), "30".to_owned())])
        .collect();
    await_held(&mut mapper, &desired, "the mapper holding the 20 devices").await;

    // While it is down, every device's desired value changes, one device goes and one comes.
    mapper.kill().await;
    let devices = api(&cluster, "Device", "devices");
    for (i, (name, value)) in desired.iter_mut().enumerate() {
        *value = (100 + i).to_string();
        set_desired_of(&devices, name, value).await;
    }
    devices
        .delete("dev-19", &DeleteParams::default())
        .await
        .expect("delete dev-19");
    desired.remove("dev-19");
    kubectl_apply(&cluster, &["-f", "-"], Some(&named("dev-20")));
    desired.insert("dev-20".to_owned(), "30".to_owned());

    // It starts again and registers while every value changes once more.
    let last: BTreeMap<String, String> = desired
        .keys()
        .enumerate()
        .map(|(i, name)| (name.clone(), (200 + i).to_string()))
        .collect();
    let edits = {
        let (devices, last) = (devices.clone(), last.clone());
        tokio::spawn(async move {
            for (name, value) in &last {
                set_desired_of(&devices, name, value).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    tokio::time::timeout(WAIT, edits)
        .await
        .expect("the edits within the wait")
        .expect("the edits");
    await_held(
        &mut mapper,
        &last,
        "the restarted mapper holding exactly the node's 20 devices at their latest spec",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_flight_when_the_mapper_registers_again_lands_before_the_new_list() {
    let DmiRig {
        cluster,
        cloud: _cloud,
        controller: _controller,
        dir,
        node,
        bridge,
        socket,
    } = DmiRig::start(&[]).await;
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    apply_device(&cluster, &bridge.node_id);
    mapper
        .next("RegisterDevice", |e| {
            e["call"] == "RegisterDevice" && e["name"] == DEVICE
        })
        .await;
    let mut reader = node.client().await;
    reader
        .subscribe(&format!("$hw/events/device/{ID}/twin/get/result"))
        .await;

    // The mapper takes 2 s over UpdateDevice(61); meanwhile the value becomes 62 on the node
    // and the mapper registers again, its server still running.
    let slow = mapper.ask("slow 2").await;
    assert_eq!(slow["ok"], true, "{slow}");
    let set = |value: &str| json!([{"op": "replace", "path": "/spec/properties/0/desired/value", "value": value}]);
    kubectl_patch_json(&cluster, DEVICE, &set("61"));
    mapper
        .next("UpdateDevice(61) under way", |e| {
            e["event"] == "slow" && e["desired"]["temp"] == "61"
        })
        .await;
    kubectl_patch_json(&cluster, DEVICE, &set("62"));
    wait_until("62 on the node", WAIT, async || {
        match twin_get(&mut reader).await {
            Ok(v) if v == "62" => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    mapper.tell("register").await;
    let again = mapper
        .next("MapperRegister listing the device", |e| {
            e["call"] == "MapperRegister" && e["devices"][0]["name"] == DEVICE
        })
        .await;
    assert_eq!(again["devices"][0]["desired"]["temp"], "62", "{again}");
    // The call under way was answered before the registration was: it cannot land on top of
    // the new list, and the mapper ends with the node's latest value.
    assert!(
        mapper
            .seen
            .iter()
            .any(|e| e["call"] == "UpdateDevice" && e["desired"]["temp"] == "61"),
        "UpdateDevice(61) applied only after the new registration; saw {:#?}",
        mapper.seen
    );
    let want: BTreeMap<String, String> = [(DEVICE.to_owned(), "62".to_owned())].into();
    await_held(&mut mapper, &want, "the mapper holding 62").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_mapper_gets_the_latest_spec_after_the_node_was_down_and_reports_outlast_the_cloud(
) {
    let DmiRig {
        cluster,
        mut cloud,
        controller,
        dir,
        mut node,
        bridge,
        socket,
    } = DmiRig::start(&[]).await;
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    apply_device(&cluster, &bridge.node_id);
    mapper
        .next("RegisterDevice", |e| {
            e["call"] == "RegisterDevice" && e["name"] == DEVICE
        })
        .await;

    // The node is killed while the desired value changes 20 times; the mapper keeps running
    // and does not register again: the node calls it with the latest once it is back.
    node.kill9();
    for i in 1..=20 {
        kubectl_patch_json(
            &cluster,
            DEVICE,
            &json!([{"op": "replace", "path": "/spec/properties/0/desired/value", "value": i.to_string()}]),
        );
    }
    node.restart().await;
    mapper
        .next("UpdateDevice with the latest value", |e| {
            e["call"] == "UpdateDevice" && e["desired"]["temp"] == "20"
        })
        .await;

    // Reports made while the cloud is away are acknowledged once stored and reach the
    // DeviceStatus when it is back.
    cloud.kill9();
    for value in ["51", "52", "53"] {
        let answer = mapper
            .ask(&format!("report default beta1-device temp {value}"))
            .await;
        assert_eq!(answer["ok"], true, "{answer}");
    }
    cloud.restart().await;
    await_reported_temp(
        &cluster,
        &controller,
        "the last report in the DeviceStatus",
        "53",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapper_over_its_report_limit_is_refused_and_another_mapper_is_not_held_back() {
    // 1 report a second, 5 at once; up to 4 twins a report.
    let DmiRig {
        cluster,
        cloud: _cloud,
        controller: _controller,
        dir,
        node: _node,
        bridge,
        socket,
    } = DmiRig::start(&[
        ("REPORTS_PER_S", "1"),
        ("REPORT_BURST", "5"),
        ("MAX_TWINS_PER_REPORT", "4"),
    ])
    .await;
    let mut modbus = PyMapper::start(&socket, dir.path()).await;
    let mut opcua = PyMapper::start_for(&socket, dir.path(), "opcua").await;
    apply_device(&cluster, &bridge.node_id);
    let other = std::fs::read_to_string(super::devices::conf("demo-device.yaml"))
        .expect("device manifest")
        .replace("nodeName: edge-1", &format!("nodeName: {}", bridge.node_id))
        .replace("name: beta1-device", "name: opcua-device")
        .replace("protocolName: modbus", "protocolName: opcua");
    kubectl_apply(&cluster, &["-f", "-"], Some(&other));
    modbus
        .next("RegisterDevice", |e| {
            e["call"] == "RegisterDevice" && e["name"] == DEVICE
        })
        .await;
    let registered = opcua
        .next("RegisterDevice", |e| e["call"] == "RegisterDevice")
        .await;
    assert_eq!(registered["name"], "opcua-device", "{registered}");
    // Ten times the burst at once: the burst is taken, the rest refused with the code.
    let burst = modbus.ask("burst default beta1-device 50").await;
    let taken = burst["codes"]["OK"].as_i64().unwrap_or(0);
    let refused = burst["codes"]["RESOURCE_EXHAUSTED"].as_i64().unwrap_or(0);
    assert!((5..=8).contains(&taken), "{burst}");
    assert_eq!(taken + refused, 50, "{burst}");
    // The other mapper's limit is its own.
    let answer = opcua.ask("report default opcua-device temp 12").await;
    assert_eq!(answer["ok"], true, "{answer}");
    // Ten times the twins a report may carry.
    let many = opcua.ask("twins default opcua-device 40").await;
    assert_eq!(many["code"], "OUT_OF_RANGE", "{many}");
}

/// Connects to the node's DMI socket without sending a byte and returns whether the node
/// closed it before any HTTP/2 (end of stream, nothing read) or kept it (its HTTP/2 settings
/// read), with the stream to hold.
async fn silent_connection(socket: &Path) -> (bool, tokio::net::UnixStream) {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect to the DMI socket");
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(WAIT, stream.read(&mut buf))
        .await
        .expect("the node either closes a connection or greets it in HTTP/2 within the wait");
    let closed = match read {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => true,
        Err(e) => panic!("reading the DMI socket: {e}"),
    };
    (closed, stream)
}

/// Ten times a limit of 4: 40 silent connections, held open; with how many the node closed at
/// once (see [`silent_connection`]).
async fn forty_silent_connections(socket: &Path) -> (Vec<tokio::net::UnixStream>, usize) {
    let mut held = Vec::new();
    let mut closed = 0;
    for _ in 0..40 {
        let (was_closed, stream) = silent_connection(socket).await;
        closed += usize::from(was_closed);
        held.push(stream);
    }
    (held, closed)
}

/// Waits until the node's `code` lines count at least `closes` closed connections in their
/// `field`s (the rest of a burst is logged at the end of the 10 s interval begun by its first
/// line), and checks that the burst took at most two lines, not one each.
async fn logged_in_few_lines(node: &super::common::Node, code: &str, field: &str, closes: usize) {
    let counted = |log: &str| -> usize {
        log.lines()
            .filter(|l| l.contains(code))
            .filter_map(|l| {
                let at = l.find(&format!("{field}="))? + field.len() + 1;
                let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<usize>().ok()
            })
            .sum()
    };
    wait_until(
        format_args!("{closes} closes counted in {code} lines"),
        Duration::from_secs(10) + WAIT,
        || {
            let log = node.log();
            std::future::ready(if counted(&log) >= closes {
                Ok(())
            } else {
                Err(format!("{} counted so far", counted(&log)))
            })
        },
    )
    .await;
    let lines = node.log().matches(code).count();
    assert!(
        lines <= 2,
        "{closes} closed connections logged in {lines} lines, not one each"
    );
}

/// The `SETTINGS_MAX_CONCURRENT_STREAMS` the node's HTTP/2 advertises on a new connection.
async fn advertised_max_streams(socket: &Path) -> Option<u32> {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect to the DMI socket");
    // The client preface and an empty SETTINGS frame.
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.expect("HTTP/2 preface");
    let read = async {
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.expect("a frame header");
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut body = vec![0u8; len];
            stream.read_exact(&mut body).await.expect("a frame body");
            // A SETTINGS frame (type 4) that is not an ACK (flag 1): 6-byte id/value pairs.
            if head[3] == 4 && head[4] & 1 == 0 {
                return body.chunks_exact(6).find_map(|p| {
                    (u16::from_be_bytes([p[0], p[1]]) == 3)
                        .then(|| u32::from_be_bytes([p[2], p[3], p[4], p[5]]))
                });
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the node's SETTINGS within the wait")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dmi_connections_past_the_limit_are_closed_at_once_and_a_closed_one_frees_its_slot() {
    let cloud = CloudBroker::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let (node, _bridge, socket) =
        dmi_node_with(&cloud, dir.path(), &[("MAX_CONNECTIONS", "4")]).await;
    // The mapper's channel holds one of the 4.
    let mut mapper = PyMapper::start(&socket, dir.path()).await;

    // Ten times the limit, silent and held open: 3 are kept, the rest closed before HTTP/2.
    let (held, closed) = forty_silent_connections(&socket).await;
    assert_eq!(
        closed, 37,
        "of 40 connections past the mapper's, all but 3 closed"
    );

    // A new mapper's call is refused fast, not left waiting; the admitted mapper is served
    // (a device the node does not have: NOT_FOUND is an answer).
    let fresh = mapper.ask("fresh 10 default no-such-device temp 1").await;
    assert_eq!(fresh["code"], "UNAVAILABLE", "{fresh}");
    assert!(
        fresh["seconds"].as_f64().unwrap_or(f64::MAX) < 5.0,
        "{fresh}"
    );
    let served = mapper.ask("try 10 default no-such-device temp 1").await;
    assert_eq!(served["code"], "NOT_FOUND", "{served}");
    logged_in_few_lines(&node, "EM-DMI-CONNECTIONS", "refused", 38).await;

    // The node's MQTT side serves meanwhile.
    let mut client = node.client().await;
    let topic = format!("test/{}", super::common::unique_id("dmi"));
    client.subscribe(&topic).await;
    client.publish(&topic, "up").await;
    client.expect(&topic).await;

    // Once the silent connections close, a new connection is served.
    drop(held);
    wait_until("a new mapper's call served", WAIT, async || {
        let fresh = mapper.ask("fresh 10 default no-such-device temp 1").await;
        if fresh["code"] == "NOT_FOUND" {
            Ok(())
        } else {
            Err(fresh.to_string())
        }
    })
    .await;
}

/// Reads `stream` until the node closes it (end of stream, or reset), discarding what HTTP/2
/// sent; `false` if it is still open at `deadline`.
async fn closed_by(stream: &mut tokio::net::UnixStream, deadline: tokio::time::Instant) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) => return true,
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Ok(Err(e)) => panic!("reading the DMI socket: {e}"),
        }
    }
}

/// Reads HTTP/2 frames until one of `kind` without the ACK flag (or with it, `ack`): its body;
/// `None` if the node closed the connection first.
async fn frame_of(stream: &mut tokio::net::UnixStream, kind: u8, ack: bool) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let read = async {
        loop {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.ok()?;
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut body = vec![0u8; len];
            stream.read_exact(&mut body).await.ok()?;
            if head[3] == kind && (head[4] & 1 == 1) == ack {
                return Some(body);
            }
        }
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("the node's frame, or its close, within the wait")
}

/// A connection that sent the HTTP/2 preface and settings, read the node's and acknowledged them.
async fn greeted_connection(socket: &Path) -> tokio::net::UnixStream {
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect to the DMI socket");
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    stream.write_all(&hello).await.expect("HTTP/2 preface");
    frame_of(&mut stream, 4, false)
        .await
        .expect("the node's SETTINGS");
    stream
        .write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0])
        .await
        .expect("SETTINGS ACK");
    stream
}

/// Whether the node's HTTP/2 answers a PING on `stream` with its ACK.
async fn answers_ping(stream: &mut tokio::net::UnixStream) -> bool {
    let ping = [0, 0, 8, 6, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
    if stream.write_all(&ping).await.is_err() {
        return false;
    }
    frame_of(stream, 6, true).await.as_deref() == Some(&ping[9..])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dmi_silent_connections_are_closed_after_the_preface_timeout_and_free_their_slots() {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let cloud = CloudBroker::start().await;
    let dir = tempfile::tempdir().expect("dir");
    let (node, _bridge, socket) = dmi_node_with(
        &cloud,
        dir.path(),
        &[
            ("MAX_CONNECTIONS", "4"),
            ("PREFACE_TIMEOUT_MS", &TIMEOUT.as_millis().to_string()),
        ],
    )
    .await;
    // The mapper's channel and a connection that sent its preface, then idles: 2 of the 4.
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    let greeted_at = Instant::now();
    let mut greeted = greeted_connection(&socket).await;

    // Ten times the limit, connected and silent, held open: each admitted one (greeted by the
    // node's HTTP/2) is closed by the node once the timeout passes, the others at once.
    let (mut held, closed) = forty_silent_connections(&socket).await;
    let admitted = 40 - closed;
    assert!(
        admitted >= 2,
        "the 2 free slots admitted silent connections: {admitted}"
    );
    let deadline = tokio::time::Instant::now() + 10 * TIMEOUT + Duration::from_secs(5);
    for (i, stream) in held.iter_mut().enumerate() {
        assert!(
            closed_by(stream, deadline).await,
            "silent connection {i} of 40 ({admitted} admitted) still open {:?} after the last \
             connected (10 times the preface timeout and 5 s)",
            10 * TIMEOUT + Duration::from_secs(5)
        );
    }
    logged_in_few_lines(&node, "EM-DMI-SILENT", "closed", admitted).await;

    // The slots are free while the test still holds the silent sockets: a new mapper's call,
    // on a connection of its own, is served (NOT_FOUND is an answer).
    let fresh = mapper.ask("fresh 10 default no-such-device temp 1").await;
    assert_eq!(fresh["code"], "NOT_FOUND", "{fresh}");

    // The timeout is for the first bytes only: the greeted connection, idle 3 times the
    // timeout, is still served, and so is the mapper's channel.
    tokio::time::sleep((3 * TIMEOUT).saturating_sub(greeted_at.elapsed())).await;
    assert!(
        answers_ping(&mut greeted).await,
        "an idle connection past its preface is served"
    );
    let served = mapper.ask("try 10 default no-such-device temp 1").await;
    assert_eq!(served["code"], "NOT_FOUND", "{served}");
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dmi_eighty_reports_at_once_on_one_connection_are_all_answered_within_its_stream_bound() {
    // 8 requests open per connection, 4 served at once; the report rate out of the way.
    let DmiRig {
        cluster,
        cloud: _cloud,
        controller,
        dir,
        node: _node,
        bridge,
        socket,
    } = DmiRig::start(&[
        ("MAX_CONNECTIONS", "4"),
        ("MAX_STREAMS_PER_CONNECTION", "8"),
        ("MAX_SERVED_PER_CONNECTION", "4"),
        ("REPORTS_PER_S", "100000"),
        ("REPORT_BURST", "100000"),
    ])
    .await;
    assert_eq!(advertised_max_streams(&socket).await, Some(8));
    let mut mapper = PyMapper::start(&socket, dir.path()).await;
    apply_device(&cluster, &bridge.node_id);
    mapper
        .next("RegisterDevice", |e| {
            e["call"] == "RegisterDevice" && e["name"] == DEVICE
        })
        .await;
    let answer = mapper.ask("report default beta1-device temp 41").await;
    assert_eq!(answer["ok"], true, "{answer}");

    // Ten times the streams at once on the mapper's one channel: every one answered OK (none
    // timed out, the connection not closed on them), and the reports reach the DeviceStatus.
    let burst = mapper.ask("burst default beta1-device 80").await;
    assert_eq!(burst["codes"], json!({"OK": 80}), "{burst}");
    await_reported_temp(
        &cluster,
        &controller,
        "the burst's value in the DeviceStatus",
        "7",
    )
    .await;

    // 7 calls whose requests never come hold the 4 served at once: the next call waits its
    // turn (its deadline passes); once they end it is served. grpcio opens the held calls on
    // threads of its own, after `hold` answers: a call made before they reach the node is
    // still served, so the test tries until one waits (bounded), rather than racing them.
    let hold = mapper.ask("hold 7").await;
    assert_eq!(hold["ok"], true, "{hold}");
    let mut waiting = Value::Null;
    for _ in 0..20 {
        waiting = mapper.ask("try 1 default beta1-device temp 8").await;
        if waiting["code"] == "DEADLINE_EXCEEDED" {
            break;
        }
        assert_eq!(
            waiting["ok"], true,
            "served before the held calls came: {waiting}"
        );
    }
    assert_eq!(waiting["code"], "DEADLINE_EXCEEDED", "{waiting}");
    let released = mapper.ask("release").await;
    assert!(released["codes"].get("OK").is_none(), "{released}");
    let served = mapper.ask("try 10 default beta1-device temp 9").await;
    assert_eq!(served["ok"], true, "{served}");
}
