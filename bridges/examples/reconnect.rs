//! Simulated nodes coming back after a cloud outage, each reconnecting as the cloud bridge does
//! (a fresh MQTT session per attempt, `Backoff` from `cloud.backoff_min_ms` to
//! `cloud.backoff_max_ms`, defaults 200 ms and 1.5 s): a mosquitto cloud broker, N persistent
//! sessions, the broker stopped for the outage and started again. Prints how long after the
//! return every node was connected again, the highest connect rate (CONNACKs in any 100 ms,
//! per second) and how many attempts failed once the broker was back.
//!
//! Run with:
//! `cargo run --release -p edgemeta-bridges --example reconnect -- --nodes 1000 --outage-s 60`

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use edgemeta_protocol::Backoff;
use rumqttc::{AsyncClient, ConnectReturnCode, Event, MqttOptions, Packet};

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Connects, failed attempts and the nodes up now, shared by every simulated node.
#[derive(Default)]
struct Log {
    connects: Mutex<Vec<Instant>>,
    failures: Mutex<Vec<Instant>>,
    up: AtomicUsize,
}

fn start_broker(dir: &std::path::Path, port: u16) -> Child {
    std::fs::write(
        dir.join("mosquitto.conf"),
        format!("listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\n"),
    )
    .expect("mosquitto.conf");
    Command::new("/usr/sbin/mosquitto")
        .arg("-c")
        .arg(dir.join("mosquitto.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto (apt-get install mosquitto)")
}

/// One node: a session after another, with the bridge's back-off between them.
fn spawn_node(i: u64, port: u16, (min, max): (Duration, Duration), log: Arc<Log>) {
    tokio::spawn(async move {
        let mut options = MqttOptions::new(format!("edgemeta-sim-{i}"), "127.0.0.1", port);
        options.set_keep_alive(Duration::from_secs(30));
        options.set_clean_session(false);
        let mut backoff = Backoff::new(min, max);
        loop {
            let (_client, mut eventloop) = AsyncClient::new(options.clone(), 10);
            let mut connected = false;
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack)))
                        if ack.code == ConnectReturnCode::Success =>
                    {
                        connected = true;
                        backoff.reset();
                        log.connects.lock().expect("log").push(Instant::now());
                        log.up.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            if connected {
                log.up.fetch_sub(1, Ordering::SeqCst);
            } else {
                log.failures.lock().expect("log").push(Instant::now());
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    });
}

async fn wait_up(log: &Log, nodes: usize, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if log.up.load(Ordering::SeqCst) == nodes {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::main]
async fn main() {
    let nodes = arg("--nodes", 1000) as usize;
    let outage = Duration::from_secs(arg("--outage-s", 60));
    let min = Duration::from_millis(arg("--backoff-min-ms", 200));
    let max = Duration::from_millis(arg("--backoff-max-ms", 1500));
    let dir = std::env::temp_dir().join(format!("edgemeta-reconnect-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let mut broker = start_broker(&dir, port);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = Arc::new(Log::default());
    for i in 0..nodes as u64 {
        spawn_node(i, port, (min, max), log.clone());
    }
    wait_up(&log, nodes, Duration::from_secs(120))
        .await
        .expect("every node connected at first");
    eprintln!("{nodes} nodes connected; stopping the cloud broker for {outage:?}");

    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(broker.id().to_string())
        .status();
    let _ = broker.wait();
    tokio::time::sleep(outage).await;
    broker = start_broker(&dir, port);
    let returned = Instant::now();
    let back = wait_up(&log, nodes, Duration::from_secs(60)).await;
    let connects: Vec<Duration> = log
        .connects
        .lock()
        .expect("log")
        .iter()
        .filter(|t| **t >= returned)
        .map(|t| t.duration_since(returned))
        .collect();
    let failures = log
        .failures
        .lock()
        .expect("log")
        .iter()
        .filter(|t| **t >= returned + Duration::from_millis(200))
        .count();
    let mut per_window = std::collections::BTreeMap::<u128, usize>::new();
    for t in &connects {
        *per_window.entry(t.as_millis() / 100).or_default() += 1;
    }
    let peak = per_window.values().copied().max().unwrap_or(0) * 10;
    println!(
        "| {nodes} nodes, {} s outage, back-off {} ms → {} ms | all connected again {} after the return | {} connects | peak {peak}/s (100 ms windows) | {failures} failed attempts once the broker was back |",
        outage.as_secs(),
        min.as_millis(),
        max.as_millis(),
        back.map_or("NOT within 60 s".to_owned(), |d| format!("{:.2} s", d.as_secs_f64())),
        connects.len(),
    );
    let _ = broker.kill();
    let _ = broker.wait();
    let _ = std::fs::remove_dir_all(&dir);
    std::process::exit(0);
}
