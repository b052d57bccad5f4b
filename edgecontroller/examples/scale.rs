//! The edgecontroller at scale: the fake API server with N edge Nodes and P pods (P/N each,
//! all referencing one configmap), D KubeEdge Devices (D/N each; KubeEdge's CRDs applied with
//! `kubectl`), a mosquitto cloud broker, the controller in its own process, and N simulated
//! nodes (MQTT sessions from this process that ack like a MetaManager, report pod status like
//! edged and twins like mappers). Prints initial sync time, configmap fan-out latency, status
//! writes per second, desired-value fan-out latency, reported-value writes per second and the
//! controller's RSS; then every node heartbeats as edged does (node status and Lease every
//! 10 s, spread over the interval) and it prints the controller's API writes per second for
//! them and its CPU; finally it restarts the controller with nothing changed and counts the
//! pod and configmap messages the nodes get after it.
//!
//! Run with:
//! `cargo run --profile kube-bench -p edgemeta-edgecontroller --example scale -- --nodes 1000 --pods 10000 --devices 10000`

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edgemeta_fakeapi::{Config, FakeApi};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// The shipped `edgemeta-edgecontroller`'s allocator, so its RSS is what is measured.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Pod and configmap changes (`insert`/`update`/`delete` from the edgecontroller) the simulated
/// nodes received, resends included: what a restarted controller sends is counted by it.
static CHANGES_RECEIVED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What the simulated nodes saw: per node, when each (resource, rv) first arrived.
#[derive(Default)]
struct Seen {
    arrivals: HashMap<(usize, String), (String, Instant)>,
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18_830)
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// User plus system CPU time of process `pid`, in clock ticks (100 a second).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name's closing parenthesis: fields 3.. of stat(5); utime and stime
    // are the 14th and 15th.
    stat.rsplit_once(')')
        .map(|(_, rest)| {
            rest.split_whitespace()
                .skip(11)
                .take(2)
                .filter_map(|v| v.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() * p).div_ceil(100)).max(1) - 1]
}

/// How often a node heartbeats (edged's default for both its status and its Lease).
const HEARTBEAT: Duration = Duration::from_secs(10);

/// A node status as edged reports it (the same fields and about the same size).
fn node_status(i: usize) -> Value {
    let condition = |kind: &str, status: &str, reason: &str, message: &str| json!({"type": kind, "status": status, "reason": reason, "message": message});
    json!({"metadata": {"name": format!("n{i}"), "labels": {"node-role.kubernetes.io/edge": "",
            "kubernetes.io/hostname": format!("n{i}"), "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
        "status": {
            "capacity": {"cpu": "4", "memory": "8048124Ki", "pods": "110", "ephemeral-storage": "61255492Ki"},
            "allocatable": {"cpu": "4000m", "memory": "8048124Ki", "pods": "110", "ephemeral-storage": "61255492Ki"},
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "True", "KubeletReady", "kubelet is posting ready status")],
            "addresses": [{"type": "InternalIP", "address": format!("10.1.{}.{}", i / 250, i % 250 + 1)},
                          {"type": "Hostname", "address": format!("n{i}")}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {"machineID": format!("{i:032x}"), "systemUUID": "", "bootID": format!("boot-{i}"),
                "kernelVersion": "6.1.0-27-amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                "containerRuntimeVersion": "process://edgemeta-edged-0.1.0", "kubeletVersion": "v1.33.0-edgemeta-0.1.0",
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"}}})
}

/// The node's status and Lease heartbeats, as the node's bridge sends them (QoS 0).
fn send_heartbeats(client: &AsyncClient, i: usize, beat: u64) {
    let node = format!("n{i}");
    for (kind, ns, content) in [
        ("nodestatus", "default", node_status(i)),
        (
            "lease",
            "kube-node-lease",
            json!({"spec": {"holderIdentity": node, "leaseDurationSeconds": 40}}),
        ),
    ] {
        let envelope = json!({"header": {"msg_id": format!("h-{i}-{beat}-{kind}"), "timestamp": 0},
            "route": {"source": "edged", "group": "meta", "operation": "update", "resource": format!("{ns}/{kind}/{node}")},
            "content": content});
        let _ = client.try_publish(
            format!("kubeedge/{node}/up/edged/update/{ns}/{kind}"),
            QoS::AtMostOnce,
            false,
            envelope.to_string(),
        );
    }
}

/// One simulated node: acks every down message, answers each pod with a Running status once
/// `report` is set, reports twins once `report_twins` is set, heartbeats once `heartbeat` is
/// set, and records arrivals.
fn spawn_node(
    i: usize,
    port: u16,
    seen: Arc<Mutex<Seen>>,
    flags: [Arc<std::sync::atomic::AtomicBool>; 3],
    nodes: usize,
    subscribed: tokio::sync::mpsc::UnboundedSender<usize>,
) {
    let [report, report_twins, heartbeat] = flags;
    tokio::spawn(async move {
        let mut options = MqttOptions::new(format!("sim-{i}"), "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(60));
        options.set_max_packet_size(1 << 20, 1 << 20);
        let (client, mut eventloop) = AsyncClient::new(options, 256);
        let node = format!("n{i}");
        let mut pods: Vec<(String, String)> = Vec::new();
        let mut devices: Vec<String> = Vec::new();
        let mut reported = false;
        let mut twins_reported = false;
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        // Each node's beats at its own offset in the interval, as nodes started at random do.
        let offset = HEARTBEAT.mul_f64(i as f64 / nodes as f64);
        let mut beats = tokio::time::interval_at(tokio::time::Instant::now() + offset, HEARTBEAT);
        let mut beat = 0u64;
        loop {
            tokio::select! {
                _ = beats.tick() => {
                    if heartbeat.load(std::sync::atomic::Ordering::Relaxed) {
                        beat += 1;
                        send_heartbeats(&client, i, beat);
                    }
                }
                _ = tick.tick() => {
                    if !reported && report.load(std::sync::atomic::Ordering::Relaxed) {
                        reported = true;
                        let items: Vec<Value> = pods.iter().map(|(name, uid)| json!({"UID": uid, "Name": name,
                            "Status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}})).collect();
                        let envelope = json!({"header": {"msg_id": format!("s-{i}"), "timestamp": 0},
                            "route": {"source": "meta", "group": "meta", "operation": "update", "resource": "default/podstatus"},
                            "content": items});
                        let _ = client.try_publish(format!("kubeedge/{node}/up/meta/update/default/podstatus"), QoS::AtLeastOnce, false, envelope.to_string());
                    }
                    if !twins_reported && report_twins.load(std::sync::atomic::Ordering::Relaxed) {
                        twins_reported = true;
                        // A mapper's report per device, as the node carries it up (edge_updated).
                        for name in &devices {
                            let envelope = json!({"header": {"msg_id": format!("t-{name}"), "timestamp": 0},
                                "route": {"source": "twin", "group": "resource", "operation": "update", "resource": format!("default/devicetwin/{name}")},
                                "content": {"event_id": "", "timestamp": 0, "twin": {"temp": {"actual": {"value": "21", "metadata": {"timestamp": 1}},
                                    "metadata": {"type": "int"}, "actual_version": {"cloud": 0, "edge": 1}}}}});
                            let _ = client.publish(format!("kubeedge/{node}/up/twin/update/default/devicetwin"), QoS::AtLeastOnce, false, envelope.to_string()).await;
                        }
                    }
                }
                event = eventloop.poll() => match event {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => {
                        let _ = client.try_subscribe(format!("kubeedge/{node}/down/#"), QoS::AtLeastOnce);
                    }
                    Ok(Event::Incoming(Packet::SubAck(_))) => {
                        let _ = subscribed.send(i);
                    }
                    Ok(Event::Incoming(Packet::Publish(p))) => {
                        let Ok(envelope) = serde_json::from_slice::<Value>(&p.payload) else { continue };
                        let resource = envelope["route"]["resource"].as_str().unwrap_or_default().to_owned();
                        let change = ["insert", "update", "delete"].iter().any(|op| envelope["route"]["operation"] == *op);
                        if change && (resource.contains("/pod/") || resource.contains("/configmap/")) {
                            CHANGES_RECEIVED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        let rv = envelope["header"]["resourceversion"].as_str().unwrap_or_default().to_owned();
                        if resource.contains("/pod/") && envelope["route"]["operation"] == "insert" {
                            let name = envelope["content"]["metadata"]["name"].as_str().unwrap_or_default().to_owned();
                            let uid = envelope["content"]["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
                            pods.push((name, uid));
                        }
                        for added in envelope["content"]["added_devices"].as_array().into_iter().flatten() {
                            let name = added["name"].as_str().unwrap_or_default().to_owned();
                            if !devices.contains(&name) {
                                devices.push(name);
                            }
                        }
                        if let Ok(mut seen) = seen.lock() {
                            let slot = seen.arrivals.entry((i, resource.clone())).or_insert((String::new(), Instant::now()));
                            if slot.0 != rv {
                                *slot = (rv, Instant::now());
                            }
                        }
                        let ack = json!({"header": {"msg_id": format!("a-{i}-{}", p.pkid), "parent_msg_id": envelope["header"]["msg_id"], "timestamp": 0},
                            "route": {"source": "meta", "group": "resource", "operation": "response", "resource": resource},
                            "content": "OK"});
                        let _ = client.try_publish(format!("kubeedge/{node}/up/meta/response/default/x"), QoS::AtLeastOnce, false, ack.to_string());
                    }
                    Ok(_) => {}
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                },
            }
        }
    });
}

async fn controller_mode() -> Result<(), edgemeta_edgecontroller::Error> {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_default()
    };
    let config = edgemeta_edgecontroller::Config {
        kubeconfig: Some(value("--kubeconfig").into()),
        broker: value("--broker"),
        ..edgemeta_edgecontroller::Config::default()
    };
    edgemeta_edgecontroller::run(config, CancellationToken::new()).await
}

#[tokio::main]
async fn main() {
    if std::env::args().any(|a| a == "--controller") {
        if let Err(e) = controller_mode().await {
            eprintln!("controller: {e}");
            std::process::exit(1);
        }
        return;
    }
    let nodes = arg("--nodes", 1000);
    let pods = arg("--pods", 10_000);
    let devices = arg("--devices", 10_000);
    let dir = std::env::temp_dir().join(format!("edgemeta-scale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");

    // The cluster.
    let api = FakeApi::start(Config::default(), CancellationToken::new())
        .await
        .expect("fake API");
    std::fs::write(dir.join("kubeconfig"), api.kubeconfig()).expect("kubeconfig");
    api.create(
        "configmaps",
        "default",
        json!({"metadata": {"name": "shared"}, "data": {"v": "0"}}),
    )
    .expect("configmap");
    for n in 0..nodes {
        api.create("nodes", "", json!({"metadata": {"name": format!("n{n}"), "labels": {"node-role.kubernetes.io/edge": ""}}}))
            .expect("node");
    }
    for p in 0..pods {
        api.create("pods", "default", json!({"metadata": {"name": format!("p{p}")},
            "spec": {"nodeName": format!("n{}", p % nodes), "containers": [{"name": "c", "image": "x"}],
                     "volumes": [{"name": "v", "configMap": {"name": "shared"}}]}}))
            .expect("pod");
    }

    // KubeEdge's CRDs as they are, a DeviceModel and the Devices.
    let crds = concat!(env!("CARGO_MANIFEST_DIR"), "/../conf/kube/crds");
    let applied = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .args(["apply", "--validate=false", "-f", crds])
        .stdout(Stdio::null())
        .status()
        .expect("kubectl");
    assert!(applied.success(), "kubectl apply of the CRDs");
    const DEVICES_API: &str = "devices.kubeedge.io/v1beta1";
    api.create_at(DEVICES_API, "devicemodels", "default", json!({"metadata": {"name": "thermo"},
        "spec": {"properties": [{"name": "temp", "type": "INT", "accessMode": "ReadWrite"}], "protocol": "modbus"}}))
        .expect("device model");
    let device = |d: usize, desired: &str| {
        json!({"metadata": {"name": format!("d{d}"), "namespace": "default"},
               "spec": {"deviceModelRef": {"name": "thermo"}, "nodeName": format!("n{}", d % nodes),
                        "properties": [{"name": "temp", "desired": {"value": desired}}],
                        "protocol": {"protocolName": "modbus"}}})
    };
    for d in 0..devices {
        api.create_at(DEVICES_API, "devices", "default", device(d, "0"))
            .expect("device");
    }

    // The cloud broker.
    let port = free_port();
    std::fs::write(
        dir.join("mosquitto.conf"),
        format!("listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\nmax_inflight_messages 100\n"),
    )
    .expect("mosquitto.conf");
    let mut mosquitto = Command::new("/usr/sbin/mosquitto")
        .arg("-c")
        .arg(dir.join("mosquitto.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto");
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The simulated nodes, all subscribed before the controller starts.
    let seen = Arc::new(Mutex::new(Seen::default()));
    let report = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let report_twins = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let heartbeat = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for i in 0..nodes {
        let flags = [report.clone(), report_twins.clone(), heartbeat.clone()];
        spawn_node(i, port, seen.clone(), flags, nodes, tx.clone());
    }
    for _ in 0..nodes {
        rx.recv().await;
    }
    eprintln!("{nodes} simulated nodes subscribed");

    // The controller.
    let started = Instant::now();
    let mut controller = Command::new(std::env::current_exe().expect("exe"))
        .arg("--controller")
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .arg("--broker")
        .arg(format!("mqtt://127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("controller");
    let pid = controller.id();
    // Initial sync: every node has its pods, the configmap, its Node and its devices.
    // Without pods the configmap goes nowhere.
    let per_node = if pods > 0 { pods / nodes + 2 } else { 1 };
    let want = nodes * per_node + devices;
    // ... and the controller has created every Device's DeviceStatus.
    let statuses = "devicestatuses.devices.kubeedge.io";
    loop {
        let have = seen.lock().map(|s| s.arrivals.len()).unwrap_or(0);
        if have >= want && api.writes(statuses) >= devices as u64 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "sync stuck at {have}/{want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sync = started.elapsed();
    let rss_sync = rss_kib(pid, "VmRSS:");
    eprintln!("initial sync {sync:?}");

    // Fan-out: one configmap edit reaches every node.
    let mut latencies = Vec::new();
    // Without pods no node holds the configmap: no fan-out to measure.
    let rounds = if pods > 0 { 3 } else { 0 };
    for round in 1..=rounds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let edited = Instant::now();
        let cm = api
            .update("configmaps", "default", "shared", json!({"metadata": {"name": "shared", "namespace": "default"}, "data": {"v": round.to_string()}}))
            .expect("edit");
        let rv = cm["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        loop {
            let done: Vec<Duration> = seen
                .lock()
                .map(|s| {
                    (0..nodes)
                        .filter_map(|n| s.arrivals.get(&(n, "default/configmap/shared".to_owned())))
                        .filter(|(v, _)| *v == rv)
                        .map(|(_, at)| at.saturating_duration_since(edited))
                        .collect()
                })
                .unwrap_or_default();
            if done.len() == nodes {
                latencies.extend(done);
                break;
            }
            assert!(
                edited.elapsed() < Duration::from_secs(120),
                "fan-out stuck at {}",
                done.len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    latencies.sort();

    // Status: every node reports all its pods Running at once (meta-internal-sync lists).
    let before = api.writes("pods/status");
    let reported = Instant::now();
    report.store(true, std::sync::atomic::Ordering::Relaxed);
    loop {
        let written = api.writes("pods/status") - before;
        if written >= pods as u64 {
            break;
        }
        assert!(
            reported.elapsed() < Duration::from_secs(600),
            "status writes stuck at {written}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status_time = reported.elapsed();
    let rate = pods as f64 / status_time.as_secs_f64();

    // Desired values: every Device gets a new one at once; each reaches its node as a twin.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut edits = Vec::with_capacity(devices);
    for d in 0..devices {
        let edited = Instant::now();
        let written = api
            .update_at(
                DEVICES_API,
                "devices",
                "default",
                &format!("d{d}"),
                device(d, "1"),
            )
            .expect("edit device");
        let rv = written["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        edits.push((d, rv, edited));
    }
    let desired_started = Instant::now();
    let mut desired = loop {
        let done: Vec<Duration> = seen
            .lock()
            .map(|s| {
                edits
                    .iter()
                    .filter_map(|(d, rv, at)| {
                        let (v, arrived) = s
                            .arrivals
                            .get(&(d % nodes, format!("default/devicetwin/d{d}")))?;
                        (v == rv).then(|| arrived.saturating_duration_since(*at))
                    })
                    .collect()
            })
            .unwrap_or_default();
        if done.len() == devices {
            break done;
        }
        assert!(
            desired_started.elapsed() < Duration::from_secs(300),
            "desired fan-out stuck at {}",
            done.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    desired.sort();

    // Reported values: every mapper reports its twin; each lands in its DeviceStatus.
    let before = api.writes(statuses);
    let twins_started = Instant::now();
    report_twins.store(true, std::sync::atomic::Ordering::Relaxed);
    loop {
        let written = api.writes(statuses) - before;
        if written >= devices as u64 {
            break;
        }
        assert!(
            twins_started.elapsed() < Duration::from_secs(600),
            "reported writes stuck at {written}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let twin_rate = devices as f64 / twins_started.elapsed().as_secs_f64();
    let rss = rss_kib(pid, "VmRSS:");
    let hwm = rss_kib(pid, "VmHWM:");
    println!(
        "| {nodes} nodes, {pods} pods, {devices} devices | initial sync {:.1} s | fan-out p50 {} ms, p99 {} ms | {:.0} status writes/s | desired fan-out p50 {} ms, p99 {} ms | {:.0} reported writes/s | controller RSS {:.1} MB after sync, {:.1} MB at the end, peak {:.1} MB |",
        sync.as_secs_f64(),
        percentile(&latencies, 50).as_millis(),
        percentile(&latencies, 99).as_millis(),
        rate,
        percentile(&desired, 50).as_millis(),
        percentile(&desired, 99).as_millis(),
        twin_rate,
        rss_sync as f64 / 1024.0,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0,
    );

    // Heartbeats: every node's status and Lease every 10 s. The first round writes every
    // status (the Nodes were created without one); the steady state starts after the refresh
    // interval (20 s) has gone round once.
    heartbeat.store(true, std::sync::atomic::Ordering::Relaxed);
    let warm_up = Duration::from_secs(arg("--heartbeat-warm-up-s", 30) as u64);
    let window = Duration::from_secs(arg("--heartbeat-window-s", 60) as u64);
    tokio::time::sleep(warm_up).await;
    let writes = |api: &FakeApi| {
        (
            api.writes("nodes/status"),
            api.writes("leases.coordination.k8s.io"),
        )
    };
    let (status_before, leases_before) = writes(&api);
    let cpu_before = cpu_ticks(pid);
    let measured = Instant::now();
    tokio::time::sleep(window).await;
    let seconds = measured.elapsed().as_secs_f64();
    let (status_after, leases_after) = writes(&api);
    let cpu = (cpu_ticks(pid) - cpu_before) as f64 / 100.0 / seconds;
    println!(
        "| {nodes} nodes heartbeating every {} s | {:.1} node status writes/s | {:.1} Lease writes/s | controller CPU {:.1} % of one core | RSS {:.1} MB |",
        HEARTBEAT.as_secs(),
        (status_after - status_before) as f64 / seconds,
        (leases_after - leases_before) as f64 / seconds,
        cpu * 100.0,
        rss_kib(pid, "VmRSS:") as f64 / 1024.0,
    );
    // A restart with nothing changed meanwhile: what each node acknowledged is kept in
    // Kubernetes (the ConfigMaps are written once a second), so it is not sent again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = controller.kill();
    let _ = controller.wait();
    let before = CHANGES_RECEIVED.load(std::sync::atomic::Ordering::Relaxed);
    let restarted = Instant::now();
    let mut controller = Command::new(std::env::current_exe().expect("exe"))
        .arg("--controller")
        .arg("--kubeconfig")
        .arg(dir.join("kubeconfig"))
        .arg("--broker")
        .arg(format!("mqtt://127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("controller");
    let settle = Duration::from_secs(arg("--restart-window-s", 30) as u64);
    tokio::time::sleep(settle).await;
    println!(
        "| controller restarted, {nodes} nodes x {} pods unchanged | {} pod and configmap messages to nodes in the {} s after (changes made meanwhile: 0) |",
        pods / nodes.max(1),
        CHANGES_RECEIVED.load(std::sync::atomic::Ordering::Relaxed) - before,
        restarted.elapsed().as_secs(),
    );
    let _ = controller.kill();
    let _ = controller.wait();
    let _ = mosquitto.kill();
    let _ = mosquitto.wait();
    let _ = std::fs::remove_dir_all(&dir);
    std::process::exit(0);
}
