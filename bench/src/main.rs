//! `edgemeta-bench`: drives edgemeta and mosquitto from this separate process over real MQTT on
//! loopback, with the same load generator, and prints a Markdown table of the figures.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::Parser;
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use serde_json::json;
use tokio::sync::mpsc;

mod auth_storm;
mod burst;
mod cloud;
mod connections;
mod devices;
mod devices_dmi;
mod http;
mod mappers;
mod metaserver;
mod readers;
mod schedule;
mod stages;

#[derive(Parser)]
#[command(about = "edgemeta against mosquitto, same load, same run")]
struct Args {
    /// Tiny sizes: checks the harness end to end in well under two minutes.
    #[arg(long)]
    quick: bool,
    /// The edgemeta binary to measure.
    #[arg(long, default_value = "target/release/edgemeta")]
    edgemeta: PathBuf,
    /// The mosquitto broker to compare with.
    #[arg(long, default_value = "/usr/sbin/mosquitto")]
    mosquitto: PathBuf,
    /// The controller the devices row's DMI half runs as its cloud (default: the
    /// `edgemeta-edgecontroller` beside `--edgemeta`).
    #[arg(long)]
    controller: Option<PathBuf>,
    /// The fake API server the devices row's DMI half runs as its cloud's Kubernetes (default:
    /// the `edgemeta-fakeapi` beside `--edgemeta`).
    #[arg(long)]
    fakeapi: Option<PathBuf>,
    /// Also write the P2 latency figures as CSV here (for the plot).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Also write the devices row's course as CSV here (for the plot): per side and interval of
    /// the run, RSS, CPU per report and the latency of the reports scheduled in it.
    #[arg(long)]
    devices_csv: Option<PathBuf>,
    /// Also write each burst run's course as CSV here (for the plot): every 100 ms, the messages
    /// each reader has received and the broker's RSS.
    #[arg(long)]
    burst_csv: Option<PathBuf>,
    /// Only offer P1's load, `--rounds` times, to an edgemeta already serving on this port
    /// (to profile it: `perf record -p <pid>`), and print the rates.
    #[arg(long)]
    load_port: Option<u16>,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// With `--load-port`: every round writes the same resources (else each its own).
    #[arg(long)]
    same_names: bool,
    /// With `--load-port`: P2 at this offered rate instead of P1.
    #[arg(long)]
    latency_rate: Option<u64>,
    /// With `--load-port`: first store this many pods (`pre/pod/q<i>`, as P5 preloads them).
    #[arg(long)]
    fill: Option<usize>,
    /// Only the P5 rows (the store sizes of the full run, or 100 and 1,000 with --quick).
    #[arg(long)]
    scaling: bool,
    /// With `--load-port`: P1 names each pod in its topic as well (topic contract v1,
    /// `.../insert/<ns>/pod/<name>`), to compare with builds from before contract v2, which took
    /// the name from the topic and would store every type-level publish under one row.
    #[arg(long)]
    v1_topics: bool,
    /// Only the long-running row (1M distinct resources into one process; 20k with --quick).
    #[arg(long)]
    long_running: bool,
    /// Only the burst row: an open-loop burst of QoS 1 inserts (200,000 from 4 publishers, ten
    /// runs), a QoS 1 and a QoS 0 reader of everything handed on.
    #[arg(long)]
    burst: bool,
    /// With the burst row: this many inserts per run instead.
    #[arg(long)]
    burst_total: Option<usize>,
    /// With the burst row: this many runs instead.
    #[arg(long)]
    burst_runs: Option<usize>,
    /// Only the edged rows: start of `edgemeta edged` to 1, 10 and 100 stored pods Running.
    #[arg(long)]
    edged: bool,
    /// Only the devices row: simulated mappers' twin reports, 1,000 devices once a second for
    /// 60 s (100 for 5 s with --quick), edgemeta against mosquitto with a pass-through responder,
    /// then the same devices as Device objects in the fake API server, brought to a node by the
    /// controller through a cloud broker, reporting through one gRPC mapper on the node's DMI
    /// socket until their DeviceStatuses hold the last report.
    #[arg(long)]
    devices: bool,
    /// With the devices row: this many devices instead.
    #[arg(long)]
    device_count: Option<usize>,
    /// With the devices row: report for this many seconds instead.
    #[arg(long)]
    device_seconds: Option<u64>,
    /// With the devices row: spread the devices over this many MQTT connections instead (50,
    /// 10 with --quick; as many as devices: one connection each).
    #[arg(long)]
    device_connections: Option<usize>,
    /// Only the one-connection-each devices row: 10,000 devices (50 with --quick) for 60 s,
    /// each on its own connection, edgemeta against mosquitto with the pass-through responder;
    /// `--device-count`, `--device-seconds` and `--device-connections` apply to it.
    #[arg(long)]
    devices_many: bool,
    /// With the devices row: mosquitto with its default `set_tcp_nodelay false` (Nagle on).
    #[arg(long)]
    device_nagle: bool,
    /// With the devices row: instead of mosquitto, this other edgemeta build, alternated with
    /// `--edgemeta` for `--device-rounds` rounds (each a fresh node, the order swapped every
    /// round), to tell a regression from this machine's drift.
    #[arg(long)]
    devices_baseline: Option<PathBuf>,
    /// With `--devices-baseline`: rounds per build.
    #[arg(long, default_value_t = 8)]
    device_rounds: usize,
    /// Only the MetaServer rows: list of 10,000 pods over HTTP, commit → watch event latency at
    /// 1,000 changes/s with 10 watches open, and the node's RSS with them.
    #[arg(long)]
    metaserver: bool,
    /// Only the auth-storm rows: with a user configured, 1,000 wrong-password CONNECTs over
    /// 10 s from 64 connections (100 over 1 s from 8 with --quick) while an honest client logs
    /// in again and again: RSS rise and the honest CONNACK latency, mosquitto beside it.
    #[arg(long)]
    auth_storm: bool,
    /// Only the per-stage budget: µs per message in each stage of the node's path (the node's
    /// own stage clocks) for `--rounds` P1 runs and for the devices row's twin reports.
    #[arg(long)]
    stages: bool,
    /// Only the readers rows: what a reader that reads 10 messages a second costs two that
    /// keep up with 10,000 a second, and RSS with 10,000 sessions away, each sent more than
    /// its queue holds.
    #[arg(long)]
    readers: bool,
    /// Only the connections row: 10,000 MQTT 3.1.1 clients (200 with --quick) connect with
    /// keep-alive 60, subscribe to a QoS 1 topic each and get one message each.
    #[arg(long)]
    connections: bool,
    /// With the connections row: this many clients instead.
    #[arg(long)]
    connection_count: Option<usize>,
    /// With `--connections`: load the broker already serving at this address (host:port) in
    /// edgemeta's column instead of a node the bench starts; mosquitto still runs beside it.
    /// Start it afresh for each run: memory it kept from earlier clients hides new ones' cost.
    #[arg(long, requires = "connection_pid")]
    connection_target: Option<String>,
    /// With `--connection-target`: the process whose RSS is read.
    #[arg(long, requires = "connection_target")]
    connection_pid: Option<u32>,
    /// Internal: run as the devices row's pass-through responder against a mosquitto on this
    /// port.
    #[arg(long, hide = true)]
    device_responder: Option<u16>,
    /// Most P1 and long-running messages between publish and arrival at the subscriber; 0 = no
    /// limit (open loop, as before 2026-11-23: the node then cuts the P1 subscriber off).
    #[arg(long, default_value_t = WINDOW)]
    window: usize,
    /// With `--load-port`: the P1 and P2 subscriber's filter (`ke/meta/#` to load a mosquitto).
    #[arg(long, default_value = "ke/edged/#")]
    watch: String,
}

/// How much load each scenario offers.
#[derive(Clone)]
struct Sizes {
    publishers: usize,
    per_publisher: usize,
    rates: Vec<u64>,
    rate_seconds: u64,
    queries: usize,
    list_size: usize,
    /// Resources already stored in the P5 scaling runs.
    preloads: Vec<usize>,
    /// Messages queued while the cloud is down in P4.
    backlog: usize,
    /// Distinct resources offered to one process in the long-running row, and per round.
    long_total: usize,
    long_round: usize,
    /// P1 puts each pod's name in its topic too (contract v1, `--v1-topics`).
    v1_topics: bool,
    /// Most P1 and long-running messages on their way (`--window`); 0 = no limit.
    window: usize,
}

/// One row of the results table.
struct Row {
    name: String,
    edgemeta: String,
    mosquitto: String,
    target: String,
    verdict: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(port) = args.device_responder {
        return mappers::responder(port).await;
    }
    let sizes = if args.quick {
        Sizes {
            publishers: 2,
            per_publisher: 500,
            rates: vec![1_000],
            rate_seconds: 1,
            queries: 100,
            list_size: 1_000,
            preloads: vec![100, 1_000],
            backlog: 2_000,
            long_total: 20_000,
            long_round: 2_000,
            v1_topics: args.v1_topics,
            window: args.window,
        }
    } else {
        Sizes {
            publishers: 4,
            per_publisher: 10_000,
            rates: vec![1_000, 5_000, 10_000, 20_000, 40_000],
            rate_seconds: 3,
            queries: 2_000,
            list_size: 10_000,
            preloads: vec![1_000, 100_000, 1_000_000],
            backlog: 100_000,
            long_total: 1_000_000,
            long_round: 100_000,
            v1_topics: args.v1_topics,
            window: args.window,
        }
    };
    if args.v1_topics && args.load_port.is_none() {
        bail!("--v1-topics is for --load-port only: the table measures contract v2");
    }
    if let Some(port) = args.load_port {
        if let Some(count) = args.fill {
            let started = Instant::now();
            fill(port, "pre", count).await?;
            println!("filled {count} in {:.1} s", started.elapsed().as_secs_f64());
        }
        for round in 0..args.rounds {
            if let Some(rate) = args.latency_rate {
                let (p, delivered) = latency(port, &args.watch, rate, 3).await?;
                println!("round {round}: p50 / p99 / p999 {p} µs, delivered {delivered:.0} msg/s");
                continue;
            }
            let ns = format!("load{}", if args.same_names { 0 } else { round });
            let rate = throughput(port, &args.watch, &sizes, &ns).await?;
            println!("round {round}: {rate:.0} msg/s");
        }
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let mut rows = Vec::new();
    if args.long_running {
        long_running(&args, &sizes, &mut rows).await?;
        return print_rows(rows);
    }
    if args.edged {
        edged_start(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.burst {
        burst::burst(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if let (true, Some(baseline)) = (args.devices, &args.devices_baseline) {
        devices::compare(&args, baseline, &mut rows).await?;
        return print_rows(rows);
    }
    if args.devices {
        devices::devices(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.devices_many {
        devices::many(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.metaserver {
        metaserver::metaserver(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.stages {
        return stages::stages(&args, &sizes).await;
    }
    if args.auth_storm {
        auth_storm::auth_storm(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.connections {
        connections::connections(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.readers {
        readers::readers(&args, &mut rows).await?;
        return print_rows(rows);
    }
    if args.scaling {
        scaling(&args, &sizes, &mut rows).await?;
        return print_rows(rows);
    }
    if args.connection_target.is_some() {
        bail!("--connection-target is for --connections only");
    }

    let mosquitto = Server::mosquitto(&args.mosquitto, dir.path()).await?;
    let edgemeta = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    rows.push(Row::sized(
        "RSS idle",
        edgemeta.rss_kib()?,
        mosquitto.rss_kib()?,
        "≤ 25 MB",
        25 * 1024,
    ));

    // P1: throughput.
    let total = sizes.publishers * sizes.per_publisher;
    // Runs alternate between the two (who goes first swaps each time) and each side reports
    // its median, so a burst of noise on this shared machine cannot land on one side only:
    // mosquitto's median of three moved 80k–89k msg/s between full runs.
    let (mut ems, mut mqs) = (Vec::new(), Vec::new());
    // Each run starts once both servers are idle: the node checkpoints and prunes for a while
    // after a run, and that work must not land on mosquitto's.
    for run in 0..P1_RUNS {
        let ns = format!("tp{run}");
        for edgemeta_now in [run % 2 == 0, run % 2 == 1] {
            settle(&[&edgemeta, &mosquitto]).await?;
            if edgemeta_now {
                ems.push(throughput(edgemeta.port, "ke/edged/#", &sizes, &ns).await?);
            } else {
                mqs.push(throughput(mosquitto.port, "ke/meta/#", &sizes, &ns).await?);
            }
        }
    }
    let (em, mq) = (median(ems), median(mqs));
    let ratio = em / mq;
    rows.push(Row {
        name: format!(
            "P1 throughput, {} publishers × {} inserts, median of {P1_RUNS} alternated (msg/s)",
            sizes.publishers, sizes.per_publisher
        ),
        edgemeta: format!("{em:.0}"),
        mosquitto: format!("{mq:.0}"),
        target: "ratio ≥ 1.0".into(),
        verdict: verdict(ratio >= 1.0, &format!("ratio {ratio:.2}")),
    });

    // P2: latency against offered load. A p99 of one 3 s run moves by half between identical
    // runs on this host, so each side runs three times, alternating (who goes first swaps),
    // and each figure is that side's median.
    let mut csv = String::from("system,offered,delivered,p50_us,p99_us,p999_us,cpu_us_per_msg\n");
    for &rate in &sizes.rates {
        let messages = (rate * sizes.rate_seconds) as f64;
        let (mut ems, mut mqs) = (Vec::new(), Vec::new());
        for run in 0..P2_RUNS {
            for side in [run % 2, 1 - run % 2] {
                let (server, watch, runs) = if side == 0 {
                    (&edgemeta, "ke/edged/#", &mut ems)
                } else {
                    (&mosquitto, "ke/meta/#", &mut mqs)
                };
                settle(&[&edgemeta, &mosquitto]).await?;
                let before = server.cpu()?;
                let (p, delivered) = latency(server.port, watch, rate, sizes.rate_seconds).await?;
                let cpu = (server.cpu()? - before).as_secs_f64() * 1e6 / messages;
                runs.push((p, delivered, cpu));
            }
        }
        let (em, em_rate, em_cpu) = medians(&ems);
        let (mq, mq_rate, mq_cpu) = medians(&mqs);
        for (system, p, delivered, cpu) in [
            ("edgemeta", &em, em_rate, em_cpu),
            ("mosquitto", &mq, mq_rate, mq_cpu),
        ] {
            csv.push_str(&format!(
                "{system},{rate},{delivered:.0},{},{},{},{cpu:.0}\n",
                p.p50, p.p99, p.p999
            ));
        }
        let (target, verdict) = match rate {
            1_000 => ("p50 ≤ 0.3 ms".into(), verdict(em.p50 <= 300, "")),
            10_000 => (
                "p99 ≤ 1.5 ms and ≤ mosquitto's".into(),
                verdict(
                    em.p99 <= 1_500 && em.p99 <= mq.p99,
                    &format!(
                        "p99 {:+.0} %",
                        (em.p99 as f64 / mq.p99.max(1) as f64 - 1.0) * 100.0
                    ),
                ),
            ),
            _ => ("—".into(), "—".into()),
        };
        rows.push(Row {
            name: format!(
                "P2 at {rate} msg/s offered: latency p50 / p99 / p999 (µs); delivered msg/s; broker CPU µs per message; medians of {P2_RUNS} runs alternated"
            ),
            edgemeta: format!("{em}; {em_rate:.0}; {em_cpu:.0}"),
            mosquitto: format!("{mq}; {mq_rate:.0}; {mq_cpu:.0}"),
            target,
            verdict,
        });
    }
    if let Some(path) = &args.csv {
        std::fs::write(path, &csv)?;
    }

    // P3: local queries.
    fill(edgemeta.port, "list", sizes.list_size).await?;
    let by_key = query_latency(
        edgemeta.port,
        "tp0/pod/p0-0",
        sizes.queries,
        QoS::AtLeastOnce,
    )
    .await?;
    rows.push(Row {
        name: format!("P3 query by key, p50 / p99 (µs), {} queries", sizes.queries),
        edgemeta: format!("{} / {}", by_key.p50, by_key.p99),
        mosquitto: "no query".into(),
        target: "p99 ≤ 1 ms".into(),
        verdict: verdict(by_key.p99 <= 1_000, ""),
    });
    // The same at QoS 0: no PUBACK precedes the answer, so the broker's Nagle wait goes away.
    let by_key0 = query_latency(
        edgemeta.port,
        "tp0/pod/p0-0",
        sizes.queries,
        QoS::AtMostOnce,
    )
    .await?;
    rows.push(Row {
        name: "P3 query by key at QoS 0, p50 / p99 (µs)".into(),
        edgemeta: format!("{} / {}", by_key0.p50, by_key0.p99),
        mosquitto: "no query".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    // A two-level query lists the type in every namespace (KubeEdge's semantics), so the list is
    // measured on a node that stores exactly `list_size` pods.
    let list = {
        let dir = tempfile::tempdir()?;
        let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
        fill(node.port, "list", sizes.list_size).await?;
        query_latency(node.port, "list/pod", 5, QoS::AtLeastOnce).await?
    };
    rows.push(Row {
        name: format!("P3 list {} pods, p50 (ms)", sizes.list_size),
        edgemeta: format!("{:.1}", list.p50 as f64 / 1000.0),
        mosquitto: "no query".into(),
        target: "≤ 50 ms".into(),
        verdict: verdict(list.p50 <= 50_000, ""),
    });

    // Each P1 run stored its own resources.
    let stored = P1_RUNS * total + sizes.list_size;
    rows.push(Row {
        target: "(diagnostic)".into(),
        verdict: "—".into(),
        ..Row::sized(
            &format!("RSS right after P1–P3 ({stored} resources stored)"),
            edgemeta.rss_kib()?,
            mosquitto.rss_kib()?,
            "",
            0,
        )
    });
    let size = std::fs::metadata(&args.edgemeta)?.len();
    rows.push(Row {
        name: "release binary size".into(),
        edgemeta: format!("{:.1} MB", size as f64 / 1e6),
        mosquitto: format!(
            "{:.1} MB",
            std::fs::metadata(&args.mosquitto)?.len() as f64 / 1e6
        ),
        target: "≤ 15 MB".into(),
        verdict: verdict(size <= 15_000_000, ""),
    });
    drop(edgemeta);
    let started = Instant::now();
    let edgemeta = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    query_latency(edgemeta.port, "tp0/pod/p0-0", 1, QoS::AtLeastOnce).await?;
    let ready = started.elapsed();
    rows.push(Row {
        name: format!("start to first answer with {stored} resources"),
        edgemeta: format!("{} ms", ready.as_millis()),
        mosquitto: "—".into(),
        target: "≤ 300 ms".into(),
        verdict: verdict(ready <= Duration::from_millis(300), ""),
    });

    drop(edgemeta);
    burst::burst(&args, &mut rows).await?;
    scaling(&args, &sizes, &mut rows).await?;
    long_running(&args, &sizes, &mut rows).await?;
    backlog(&args, &sizes, &mut rows).await?;
    edged_start(&args, &mut rows).await?;
    devices::devices(&args, &mut rows).await?;
    devices::many(&args, &mut rows).await?;
    connections::connections(&args, &mut rows).await?;
    auth_storm::auth_storm(&args, &mut rows).await?;
    drop(mosquitto);
    print_rows(rows)
}

/// Prints the table; fails the run if a node cut off one of the bench's subscribers.
/// A reboot with `n` pods (`sleep` processes) stored and no cloud: the time from starting the
/// node and `edgemeta edged` to a `podstatus` of Running for every pod (the node's start, edged's
/// start-up list from the store, the processes, the reports back through the broker), with
/// the default configuration.
async fn edged_start(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    for n in [1usize, 10, 100] {
        let dir = tempfile::tempdir()?;
        let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
        let (c, mut rx) = client(node.port, "edged-bench").await?;
        subscribe(&c, &mut rx, "ke/edged/edgecontroller/insert/default/pod").await?;
        for i in 0..n {
            let pod = json!({
                "metadata": {"name": format!("p{i}"), "namespace": "default", "uid": format!("u{i}")},
                "spec": {"containers": [{"name": "main", "command": ["sleep", "600"]}],
                         "terminationGracePeriodSeconds": 1},
            });
            insert_pod(&c, &pod).await?;
        }
        wait_for(&mut rx, n, |_| true, "storing pods").await?;
        drop(c);
        drop(node);
        // The reboot: the node and edged start together.
        let started = Instant::now();
        let (node, edged) = node_and_edged(args, dir.path()).await?;
        let (c, mut rx) = client(node.port, "edged-bench").await?;
        subscribe(&c, &mut rx, "ke/meta/edged/update/default/podstatus").await?;
        let mut running = std::collections::HashSet::new();
        while running.len() < n {
            let (_, payload) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .with_context(|| format!("edged: {} of {n} pods Running", running.len()))?
                .context("connection gone")?;
            let message: serde_json::Value = serde_json::from_slice(&payload)?;
            if message["content"]["Status"]["phase"] == "Running" {
                if let Some(resource) = message["route"]["resource"].as_str() {
                    running.insert(resource.to_owned());
                }
            }
        }
        let took = started.elapsed();
        drop(edged);
        drop(node);
        let target = if n == 100 { "≤ 2 s" } else { "" };
        rows.push(Row {
            name: format!(
                "reboot, no cloud: node + edged start to {n} stored pod{} Running",
                if n == 1 { "" } else { "s" }
            ),
            edgemeta: format!("{} ms", took.as_millis()),
            mosquitto: "—".into(),
            target: if target.is_empty() {
                "(diagnostic)".into()
            } else {
                target.into()
            },
            verdict: if n == 100 {
                verdict(took <= Duration::from_secs(2), "")
            } else {
                "—".into()
            },
        });
    }
    chatty_container(args, rows).await
}

/// Inserts `pod` into namespace `default` as the cloud would, at QoS 1.
async fn insert_pod(c: &AsyncClient, pod: &serde_json::Value) -> anyhow::Result<()> {
    c.publish(
        "ke/meta/edgecontroller/insert/default/pod",
        QoS::AtLeastOnce,
        false,
        pod.to_string(),
    )
    .await?;
    Ok(())
}

/// A node on `dir` with edged's section, and `edgemeta edged` beside it on the same
/// configuration (its log in `dir/edged.log`).
async fn node_and_edged(args: &Args, dir: &Path) -> anyhow::Result<(Server, Process)> {
    let node = Server::edgemeta_with(
        &args.edgemeta,
        dir,
        &format!("edged:\n  root_dir: {}\n", dir.join("edged").display()),
    )
    .await?;
    let edged = Process(
        Command::new(&args.edgemeta)
            .arg("edged")
            .arg("--config")
            .arg(dir.join("edge.yaml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("edged.log"))?)
            .spawn()
            .context("start edgemeta edged")?,
    );
    Ok((node, edged))
}

/// Lines the chatty container of [`chatty_container`] writes.
const CHATTY_LINES: u64 = 300_000;

/// One pod whose container writes [`CHATTY_LINES`] log lines of 88 bytes as fast as a pipe
/// takes them, then exits: edged's CPU over the run (it writes each line to the container's
/// CRI log), per line, and the time to the pod's `Succeeded`.
async fn chatty_container(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (node, edged) = node_and_edged(args, dir.path()).await?;
    let (c, mut rx) = client(node.port, "edged-bench").await?;
    subscribe(&c, &mut rx, "ke/meta/edged/update/default/podstatus").await?;
    let script = format!(
        "yes 'level=info msg=\"a chatty container writes this line again and again\" n=12345' \
         | head -n {CHATTY_LINES}"
    );
    let pod = json!({
        "metadata": {"name": "chatty", "namespace": "default", "uid": "chatty"},
        "spec": {"containers": [{"name": "main", "command": ["sh", "-c", script]}],
                 "restartPolicy": "Never"},
    });
    let started = Instant::now();
    insert_pod(&c, &pod).await?;
    loop {
        let (topic, payload) = tokio::time::timeout(Duration::from_secs(120), rx.recv())
            .await
            .context("edged: the chatty pod did not succeed")?
            .context("connection gone")?;
        // This client published the pod: its PUBACK comes here too.
        if topic == PUBACK {
            continue;
        }
        let message: serde_json::Value = serde_json::from_slice(&payload)?;
        match message["content"]["Status"]["phase"].as_str() {
            Some("Succeeded") => break,
            Some("Failed") => bail!("the chatty pod failed: {message}"),
            _ => {}
        }
    }
    let took = started.elapsed();
    let cpu = cpu_of(edged.0.id())?;
    drop(edged);
    drop(node);
    rows.push(Row {
        name: format!(
            "edged, a chatty container: {CHATTY_LINES} log lines of 88 bytes written as fast as \
             a pipe takes them: edged CPU (ms) / µs per line; pod start to Succeeded (s)"
        ),
        edgemeta: format!(
            "{} / {:.1}; {:.2}",
            cpu.as_millis(),
            cpu.as_secs_f64() * 1e6 / CHATTY_LINES as f64,
            took.as_secs_f64()
        ),
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    Ok(())
}

/// A process the bench started (`edgemeta edged`, the fake API server, the controller), stopped
/// with SIGTERM when dropped (edged stops its pods then) and waited for.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let _ = self.0.wait();
    }
}

fn print_rows(rows: Vec<Row>) -> anyhow::Result<()> {
    println!("| measure | edgemeta | mosquitto | target | met |\n|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            r.name, r.edgemeta, r.mosquitto, r.target, r.verdict
        );
    }
    let cuts = LAG_CUTS.load(std::sync::atomic::Ordering::Relaxed);
    if cuts > 0 {
        bail!("{cuts} bench subscriber(s) cut off for falling behind (EM-BROKER-SUBSCRIBER-LAG, above): the figures are not valid");
    }
    Ok(())
}

/// What one long-running load did to a broker process.
struct LongRun {
    /// VmRSS after the first round and after the last.
    rss_kib: (u64, u64),
    /// Messages per second of each round.
    rates: Vec<f64>,
}

/// The long-running row: `sizes.long_total` distinct pods offered to one fresh process by P1's
/// publishers in rounds of `sizes.long_round`, with an edged-like subscriber that must see each
/// round before the next; memory and throughput of the first round against the last.
async fn long_running(args: &Args, sizes: &Sizes, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    // Each round on stderr for the full run (--quick checks the harness only).
    let progress = !args.quick;
    let em = long_run(&node, "ke/edged/#", sizes, progress).await?;
    drop(node);
    // The peer, also a fresh process: the same publishes passed through to a subscriber, as in
    // P1.
    let mosquitto = Server::mosquitto(&args.mosquitto, dir.path()).await?;
    let mq = long_run(&mosquitto, "ke/meta/#", sizes, progress).await?;
    drop(mosquitto);

    let (first, last) = (count(sizes.long_round), count(sizes.long_total));
    let growth = em.rss_kib.1 as f64 / em.rss_kib.0.max(1) as f64 - 1.0;
    let limit_kib = 40 * 1024;
    let mb = |kib: u64| kib as f64 / 1024.0;
    rows.push(Row {
        name: format!(
            "long-running: RSS after {first} / after {last} distinct resources (one process, edged subscribed)"
        ),
        edgemeta: format!("{:.1} MB / {:.1} MB", mb(em.rss_kib.0), mb(em.rss_kib.1)),
        mosquitto: format!("{:.1} MB / {:.1} MB", mb(mq.rss_kib.0), mb(mq.rss_kib.1)),
        target: "≤ 40 MB, flat within 10 %".into(),
        verdict: verdict(
            em.rss_kib.0 <= limit_kib && em.rss_kib.1 <= limit_kib && growth.abs() <= 0.10,
            &format!("{:+.0} %", growth * 100.0),
        ),
    });
    // Every round's rate is shown: on this shared machine one round can be a fifth off.
    let ends = |rates: &[f64]| (rates[0], rates[rates.len() - 1]);
    let span = |rates: &[f64]| {
        let (lo, hi) = rates
            .iter()
            .fold((f64::MAX, 0.0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        format!("rounds {lo:.0}–{hi:.0}")
    };
    let ((em_first, em_last), (mq_first, mq_last)) = (ends(&em.rates), ends(&mq.rates));
    let change = em_last / em_first - 1.0;
    rows.push(Row {
        name: format!(
            "long-running: msg/s first {first} / last {first} ({} publishers)",
            sizes.publishers
        ),
        edgemeta: format!("{em_first:.0} / {em_last:.0} ({})", span(&em.rates)),
        mosquitto: format!("{mq_first:.0} / {mq_last:.0} ({})", span(&mq.rates)),
        target: "last within 10 % of first".into(),
        verdict: verdict(
            em_last >= 0.9 * em_first,
            &format!("{:+.0} %", change * 100.0),
        ),
    });
    Ok(())
}

/// Offers `sizes.long_total` distinct pods to `server` in rounds, through `sizes.publishers`
/// QoS 1 publishers kept for the whole run (one type-level topic, full envelopes naming each pod,
/// as in P1, at most `sizes.window` on their way), and counts them at a QoS 1 subscriber on `watch`.
/// Each round is seen whole at the subscriber before the next is sent, so each round's rate
/// (first publish → last arrival) is its own; RSS is read after the first round and the last.
async fn long_run(
    server: &Server,
    watch: &str,
    sizes: &Sizes,
    progress: bool,
) -> anyhow::Result<LongRun> {
    let (sub, mut rx) = client(server.port, "edged").await?;
    subscribe(&sub, &mut rx, watch).await?;
    let mut publishers = Vec::new();
    for _ in 0..sizes.publishers {
        publishers.push(client(server.port, "pub").await?.0);
    }
    let rounds = sizes.long_total.div_ceil(sizes.long_round);
    let mut rates = Vec::new();
    let mut rss = Vec::new();
    let window = window(sizes.window);
    for round in 0..rounds {
        let size = sizes
            .long_round
            .min(sizes.long_total - round * sizes.long_round);
        let started = Instant::now();
        for (p, publisher) in publishers.iter().enumerate() {
            // This publisher's share of the round: every `publishers`-th pod.
            let names: Vec<usize> = (p..size).step_by(sizes.publishers).collect();
            let publisher = publisher.clone();
            let window = window.clone();
            tokio::spawn(async move {
                let topic = "ke/meta/edgecontroller/insert/long/pod";
                for i in names {
                    let resource = format!("long/pod/r{round}-{i}");
                    if !windowed_insert(&publisher, &window, topic, &resource).await {
                        return;
                    }
                }
            });
        }
        let mut got = 0;
        while got < size {
            let (topic, _) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .with_context(|| format!("long-running round {round} stalled at {got} of {size}"))?
                .context("long-running: subscriber gone")?;
            if !topic.starts_with('$') {
                window.add_permits(1);
                got += 1;
            }
        }
        rates.push(size as f64 / started.elapsed().as_secs_f64());
        rss.push(server.rss_kib()?);
        if progress {
            eprintln!(
                "long-running on {watch}: round {} of {rounds}: {:.0} msg/s, RSS {:.1} MB",
                round + 1,
                rates[round],
                rss[round] as f64 / 1024.0
            );
        }
    }
    Ok(LongRun {
        rss_kib: (rss[0], *rss.last().context("no round")?),
        rates,
    })
}

/// 1000000 → "1M", 100000 → "100k", 2500 → "2500".
fn count(n: usize) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

/// P5: P1 and P3 on a node restarted on a store that already holds each of `sizes.preloads`
/// resources, plus memory and start-up time with the largest. Each store is loaded once; every
/// round then measures a fresh copy of each, in rotated order, so the sizes are compared as
/// medians of runs taken in the same minutes, each on exactly its preload.
async fn scaling(args: &Args, sizes: &Sizes, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let mut loaded = Vec::new();
    for &preload in &sizes.preloads {
        let dir = tempfile::tempdir()?;
        let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
        fill(node.port, "pre", preload).await?;
        // With names in topics (contract v1) the process that loaded them held rumqttd's state
        // for every topic it saw, which slowed it down (see Findings); type-level topics (v2)
        // should end that. One P1 run shows how much is left.
        let rate_loaded = throughput(node.port, "ke/edged/#", sizes, "loaded").await?;
        let rss = node.rss_kib()?;
        drop(node);
        loaded.push((preload, dir, rate_loaded, rss));
    }
    let mut runs: Vec<Vec<P5Run>> = loaded.iter().map(|_| Vec::new()).collect();
    for round in 0..P5_ROUNDS {
        for k in 0..loaded.len() {
            let i = (k + round) % loaded.len();
            let copy = tempfile::tempdir()?;
            copy_store(loaded[i].1.path(), copy.path())?;
            // Restarted, the node holds only what is stored: that is what P5 compares.
            let started = Instant::now();
            let node = Server::edgemeta(&args.edgemeta, copy.path()).await?;
            query_latency(node.port, "pre/pod/q0", 1, QoS::AtLeastOnce).await?;
            let ready = started.elapsed();
            let rss_restarted = node.rss_kib()?;
            let query =
                query_latency(node.port, "pre/pod/q0", sizes.queries, QoS::AtLeastOnce).await?;
            let rate = throughput(node.port, "ke/edged/#", sizes, "tp").await?;
            runs[i].push(P5Run {
                rate,
                query,
                ready,
                rss: rss_restarted,
            });
        }
    }
    let mut figures = Vec::new();
    for ((preload, _, rate_loaded, rss), runs) in loaded.iter().zip(&runs) {
        let middle = |f: fn(&P5Run) -> f64| median(runs.iter().map(f).collect());
        let query = middle_percentiles(runs.iter().map(|r| &r.query));
        figures.push((
            *preload,
            middle(|r| r.rate),
            query,
            (*rss, middle(|r| r.rss as f64) as u64),
            Duration::from_secs_f64(middle(|r| r.ready.as_secs_f64())),
            *rate_loaded,
        ));
    }
    let (Some(first), Some(last)) = (figures.first(), figures.last()) else {
        return Ok(());
    };
    for &(preload, rate, ref query, _, _, _) in &figures {
        let rate_change = rate / first.1 - 1.0;
        // Flatness is judged on the median: the p99 of a few hundred µs round trips on a shared
        // 2-core machine moves by a third between identical runs, whatever the store holds.
        let query_change = query.p50 as f64 / first.2.p50.max(1) as f64 - 1.0;
        let flat = rate_change.abs() <= 0.2 && query_change.abs() <= 0.2;
        rows.push(Row {
            name: format!(
                "P5 with {preload} stored (restarted): P1 msg/s ({} × {}) / P3 by key p50, p99 µs, medians of {P5_ROUNDS} rounds alternated over the sizes",
                sizes.publishers, sizes.per_publisher
            ),
            edgemeta: format!("{rate:.0} / {}, {}", query.p50, query.p99),
            mosquitto: "—".into(),
            target: format!("within ±20 % of {} stored", first.0),
            verdict: verdict(
                flat,
                &format!(
                    "{:+.0} % / {:+.0} %",
                    rate_change * 100.0,
                    query_change * 100.0
                ),
            ),
        });
    }
    let (preload, _, _, (after_traffic, restarted), ready, rate_loaded) = *last;
    rows.push(Row {
        name: format!("P1 msg/s on the process that just loaded {preload} (no restart)"),
        edgemeta: format!("{rate_loaded:.0}"),
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    rows.push(Row {
        mosquitto: "—".into(),
        ..Row::sized(
            &format!("RSS with {preload} stored (restarted, one query)"),
            restarted,
            0,
            "≤ 25 MB",
            25 * 1024,
        )
    });
    rows.push(Row {
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
        ..Row::sized(
            &format!("RSS with {preload} stored, right after loading them and one P1"),
            after_traffic,
            0,
            "",
            0,
        )
    });
    rows.push(Row {
        name: format!("start to first answer with {preload} stored"),
        edgemeta: format!("{} ms", ready.as_millis()),
        mosquitto: "—".into(),
        target: "≤ 300 ms".into(),
        verdict: verdict(ready <= Duration::from_millis(300), ""),
    });
    Ok(())
}

/// Waits (at most 10 s) until every one of `servers` used no CPU tick (10 ms) in 200 ms: what a
/// server still does after a run (a checkpoint, a queue drained) stays out of the next.
async fn settle(servers: &[&Server]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let before: Vec<Duration> = servers.iter().map(|s| s.cpu()).collect::<Result<_, _>>()?;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let busy = servers.iter().zip(&before).any(|(s, b)| {
            s.cpu()
                .map_or(true, |now| now - *b >= Duration::from_millis(2))
        });
        if !busy {
            return Ok(());
        }
    }
    Ok(())
}

/// Rounds of P5: each measures every store once.
const P5_ROUNDS: usize = 3;

/// One P5 measurement of a restarted copy of a store.
struct P5Run {
    /// P1 msg/s.
    rate: f64,
    /// P3 by key.
    query: Percentiles,
    /// Start to the first answer.
    ready: Duration,
    /// RSS (KiB) after the first answer.
    rss: u64,
}

/// Copies a stopped node's store (the database and its WAL) from `from` to `to`.
fn copy_store(from: &Path, to: &Path) -> anyhow::Result<()> {
    for name in ["bench.db", "bench.db-wal"] {
        let source = from.join(name);
        if source.exists() {
            let target = to.join(name);
            std::fs::copy(&source, &target)
                .with_context(|| format!("copy {}", source.display()))?;
            // On disk before the node starts, as a restarted node's store is: left to the
            // kernel, the copy's writeback (490 MB at 1M) lands on the node's first fsyncs.
            std::fs::File::open(&target)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("sync {}", target.display()))?;
        }
    }
    std::fs::File::open(to)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("sync {}", to.display()))?;
    Ok(())
}

/// P4: `sizes.backlog` cloud-bound messages queued while the cloud broker is down, then the time
/// from its return until the last one reached a cloud subscriber; edgemeta's outbox against a
/// mosquitto bridge carrying the same stream.
async fn backlog(args: &Args, sizes: &Sizes, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n = sizes.backlog;
    let dir = tempfile::tempdir()?;
    // Started as root, mosquitto drops to its own user and must still write its persistence.
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )?;

    // edgemeta: the bridge reconnects within 200 ms (backoff_max_ms) once the cloud is back.
    let cloud_port = free_port()?;
    let persist = |name: &str| {
        format!(
            "persistence true\npersistence_location {}/\npersistence_file {name}.db\n",
            dir.path().display()
        )
    };
    let cloud = Server::mosquitto_with(
        &args.mosquitto,
        dir.path(),
        "cloud1",
        cloud_port,
        &persist("cloud1"),
    )
    .await?;
    prepare_subscriber(cloud.port, "p4-edgemeta", "kubeedge/bench/up/#").await?;
    drop(cloud);
    let node_dir = dir.path().join("node");
    std::fs::create_dir_all(&node_dir)?;
    let node = Server::edgemeta_with(&args.edgemeta, &node_dir, &format!(
        "cloud:\n  enabled: true\n  url: mqtt://127.0.0.1:{cloud_port}\n  node_id: bench\n  backoff_min_ms: 50\n  backoff_max_ms: 200\n"
    )).await?;
    let (edged, mut acks) = client(node.port, "p4-edged").await?;
    subscribe(&edged, &mut acks, "ke/edged/meta/response/#").await?;
    // In chunks whose answers are read before the next, like `fill`: edged is a QoS 1
    // subscriber of its answers, and one owed more than 3 MiB is cut off.
    for start in (0..n).step_by(WINDOW / 2) {
        let end = (start + WINDOW / 2).min(n);
        podstatus_updates(&edged, "ke/meta/edged/update", start..end).await?;
        wait_for(
            &mut acks,
            end - start,
            |topic| topic.starts_with("ke/edged/meta/response/"),
            "edgemeta commits",
        )
        .await?;
    }
    let cloud = ("cloud1", persist("cloud1"));
    let edgemeta = drain_on_return(args, dir.path(), cloud_port, cloud, "edgemeta", n).await?;
    drop(node);

    // mosquitto: an edge mosquitto bridging ke/cloud/# up, queueing while the cloud is away.
    let cloud_port = free_port()?;
    let cloud = Server::mosquitto_with(
        &args.mosquitto,
        dir.path(),
        "cloud2",
        cloud_port,
        &persist("cloud2"),
    )
    .await?;
    prepare_subscriber(cloud.port, "p4-mosquitto", "kubeedge/bench/up/#").await?;
    drop(cloud);
    let bridge = format!(
        "connection cloud\naddress 127.0.0.1:{cloud_port}\ntopic # out 1 ke/cloud/ kubeedge/bench/up/\ncleansession false\nrestart_timeout 1 1\n"
    );
    let edge =
        Server::mosquitto_with(&args.mosquitto, dir.path(), "edge", free_port()?, &bridge).await?;
    let (publisher, mut pubacks) = client(edge.port, "p4-pub").await?;
    podstatus_updates(&publisher, "ke/cloud/edged/update", 0..n).await?;
    wait_for(
        &mut pubacks,
        n,
        |topic| topic == PUBACK,
        "mosquitto accepts",
    )
    .await?;
    let cloud = ("cloud2", persist("cloud2"));
    let mosquitto = drain_on_return(args, dir.path(), cloud_port, cloud, "mosquitto", n).await?;
    drop(edge);

    rows.push(Row {
        name: format!("P4 {n} queued messages: cloud back → first arrives / first → last (s)"),
        edgemeta: format!(
            "{:.2} / {:.2}",
            edgemeta.0.as_secs_f64(),
            edgemeta.1.as_secs_f64()
        ),
        mosquitto: format!(
            "{:.2} / {:.2} (bridge)",
            mosquitto.0.as_secs_f64(),
            mosquitto.1.as_secs_f64()
        ),
        target: "—".into(),
        verdict: format!(
            "drain {:.0} vs {:.0} msg/s",
            n as f64 / edgemeta.1.as_secs_f64().max(1e-6),
            n as f64 / mosquitto.1.as_secs_f64().max(1e-6)
        ),
    });
    Ok(())
}

/// Makes a persistent session under `id` subscribed to `filter`, then leaves it.
async fn prepare_subscriber(port: u16, id: &str, filter: &str) -> anyhow::Result<()> {
    let (client, mut rx) = session(port, id, false).await?;
    subscribe(&client, &mut rx, filter).await?;
    client.disconnect().await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}

/// Publishes an insert of `resource` once `window` has room (the subscriber side gives the room
/// back as messages arrive); `false` once the window or the client is closed.
async fn windowed_insert(
    publisher: &AsyncClient,
    window: &tokio::sync::Semaphore,
    topic: impl Into<String>,
    resource: &str,
) -> bool {
    match window.acquire().await {
        Ok(permit) => permit.forget(),
        Err(_) => return false,
    }
    publisher
        .publish(topic, QoS::AtLeastOnce, false, insert(resource, 0))
        .await
        .is_ok()
}

/// Publishes edged's pod-status updates number `range` (over 1,000 pods) on `<prefix>/<ns>/<type>`.
async fn podstatus_updates(
    client: &AsyncClient,
    prefix: &str,
    range: std::ops::Range<usize>,
) -> anyhow::Result<()> {
    for i in range {
        let resource = format!("default/podstatus/p{}", i % 1000);
        client
            .publish(
                format!("{prefix}/{}", type_level(&resource)),
                QoS::AtLeastOnce,
                false,
                update(&resource, i),
            )
            .await?;
    }
    Ok(())
}

/// Starts the cloud broker `(name, config)` again on its port and times the `n` messages `peer`
/// queued for it: from the start to the first arrival, and from the first to the last.
async fn drain_on_return(
    args: &Args,
    dir: &std::path::Path,
    port: u16,
    (name, config): (&str, String),
    peer: &str,
    n: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let started = Instant::now();
    let cloud = Server::mosquitto_with(&args.mosquitto, dir, name, port, &config).await?;
    let (_sub, mut up) = session(cloud.port, &format!("p4-{peer}"), false).await?;
    let first = wait_for(
        &mut up,
        n,
        |topic| topic.starts_with("kubeedge/bench/up/"),
        &format!("{peer} drain"),
    )
    .await?;
    Ok((first - started, first.elapsed()))
}

/// Waits until `n` messages whose topic passes `wanted` have arrived; returns when the first
/// of them did.
async fn wait_for(
    rx: &mut Inbox,
    n: usize,
    wanted: impl Fn(&str) -> bool,
    what: &str,
) -> anyhow::Result<Instant> {
    let mut got = 0;
    let mut first = Instant::now();
    while got < n {
        let (topic, _) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .with_context(|| format!("{what}: stalled at {got} of {n}"))?
            .with_context(|| format!("{what}: connection gone"))?;
        if wanted(&topic) {
            if got == 0 {
                first = Instant::now();
            }
            got += 1;
        }
    }
    Ok(first)
}

/// `<namespace>/<type>` of a resource: all of it that a topic carries (protocol §2, v2); the
/// name travels in the envelope's `route.resource`.
fn type_level(resource: &str) -> &str {
    match resource.match_indices('/').nth(1) {
        Some((end, _)) => &resource[..end],
        None => resource,
    }
}

/// An edged pod-status update envelope.
fn update(resource: &str, seq: usize) -> Vec<u8> {
    json!({
        "header": {"msg_id": uuid::Uuid::new_v4().to_string(), "timestamp": 0},
        "route": {"source": "edged", "group": "resource", "operation": "update", "resource": resource},
        "content": {"seq": seq, "phase": "Running", "pad": "x".repeat(200)},
    })
    .to_string()
    .into_bytes()
}

impl Row {
    fn sized(name: &str, edgemeta: u64, mosquitto: u64, target: &str, limit_kib: u64) -> Row {
        Row {
            name: name.into(),
            edgemeta: format!("{:.1} MB", edgemeta as f64 / 1024.0),
            mosquitto: format!("{:.1} MB", mosquitto as f64 / 1024.0),
            target: target.into(),
            verdict: verdict(edgemeta <= limit_kib, ""),
        }
    }
}

fn verdict(met: bool, detail: &str) -> String {
    let word = if met { "met" } else { "**not met**" };
    if detail.is_empty() {
        word.into()
    } else {
        format!("{word} ({detail})")
    }
}

/// A broker process under test.
struct Server {
    child: Child,
    port: u16,
    /// edgemeta's log and where this process's lines start in it, read when it stops for
    /// subscribers it cut off.
    log: Option<(PathBuf, u64)>,
    /// edgemeta's observe port (`/metrics`).
    observe: Option<u16>,
    /// edgemeta's MetaServer port (the Kubernetes API).
    metaserver: Option<u16>,
}

/// Subscribers of this bench that a node disconnected for falling behind
/// (EM-BROKER-SUBSCRIBER-LAG): any makes the run fail, since its figures are not valid.
static LAG_CUTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl Server {
    async fn mosquitto(binary: &Path, dir: &Path) -> anyhow::Result<Server> {
        Server::mosquitto_with(binary, dir, "mosquitto", free_port()?, "").await
    }

    /// A mosquitto on `port` with `extra` configuration, its files named after `name` in `dir`.
    async fn mosquitto_with(
        binary: &Path,
        dir: &Path,
        name: &str,
        port: u16,
        extra: &str,
    ) -> anyhow::Result<Server> {
        Server::mosquitto_limited(binary, dir, name, port, extra, None).await
    }

    /// [`Server::mosquitto_with`] under an open-files limit of `open_files` (see [`limited`]).
    async fn mosquitto_limited(
        binary: &Path,
        dir: &Path,
        name: &str,
        port: u16,
        extra: &str,
        open_files: Option<u64>,
    ) -> anyhow::Result<Server> {
        let conf = dir.join(format!("{name}.conf"));
        std::fs::write(&conf, format!("listener {port} 127.0.0.1\nallow_anonymous true\nmax_queued_messages 0\nmax_inflight_messages 100\n{extra}"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{name}.log")))?;
        let child = limited(binary, open_files)
            .arg("-c")
            .arg(&conf)
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start mosquitto")?;
        Server::ready(child, port).await
    }

    /// edgemeta with its defaults (synchronous=full), its store in `dir`.
    async fn edgemeta(binary: &Path, dir: &Path) -> anyhow::Result<Server> {
        Server::edgemeta_with(binary, dir, "").await
    }

    /// edgemeta with `extra` YAML sections appended to its configuration.
    async fn edgemeta_with(binary: &Path, dir: &Path, extra: &str) -> anyhow::Result<Server> {
        Server::edgemeta_broker(binary, dir, "", extra).await
    }

    /// edgemeta with `broker` lines (indented keys) added to its `broker` section and `extra`
    /// sections appended.
    async fn edgemeta_broker(
        binary: &Path,
        dir: &Path,
        broker: &str,
        extra: &str,
    ) -> anyhow::Result<Server> {
        // The observe endpoints stay on, as by default, on a port of their own. The three are
        // taken together: one at a time, the kernel may hand the same free port out twice.
        let [port, observe, metaserver] = free_ports()?;
        let conf = dir.join("edge.yaml");
        std::fs::write(&conf, format!("broker:\n  listeners:\n    mqtt:\n      address: 127.0.0.1:{port}\n{broker}store:\n  path: {}\nobserve:\n  address: 127.0.0.1:{observe}\nmetaserver:\n  address: 127.0.0.1:{metaserver}\n{extra}", dir.join("bench.db").display()))?;
        let log_path = dir.join("edgemeta.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let start = log.metadata()?.len();
        let child = Command::new(binary)
            .arg("run")
            .arg("--config")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let mut server = Server::ready(child, port).await?;
        // The front accepts on the port before the node serves (its broker's back end, the
        // MetaManager): a client connecting in between is dropped. The node says when it serves.
        let started = Instant::now();
        loop {
            let log = std::fs::read(&log_path)?;
            let ours = log.get(usize::try_from(start)?..).unwrap_or_default();
            let ours = String::from_utf8_lossy(ours);
            if ours.contains("edgemeta serving") {
                break;
            }
            // What the node said is the only account of why it did not start: the bench
            // removes its directory.
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "edgemeta on port {port} exited ({status}) before it served; its log ends:\n{}",
                    last_lines(&ours, 20)
                );
            }
            if started.elapsed() > Duration::from_secs(10) {
                bail!(
                    "edgemeta on port {port} did not log \"edgemeta serving\" within 10 s; its log ends:\n{}",
                    last_lines(&ours, 20)
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        server.log = Some((log_path, start));
        server.observe = Some(observe);
        server.metaserver = Some(metaserver);
        Ok(server)
    }

    async fn ready(child: Child, port: u16) -> anyhow::Result<Server> {
        let server = Server {
            child,
            port,
            log: None,
            observe: None,
            metaserver: None,
        };
        let started = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if started.elapsed() > Duration::from_secs(10) {
                bail!("server on port {port} not ready");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(server)
    }

    /// CPU time (user + system, all threads) the process has used so far.
    fn cpu(&self) -> anyhow::Result<Duration> {
        cpu_of(self.child.id())
    }

    fn rss_kib(&self) -> anyhow::Result<u64> {
        rss_of(self.child.id())
    }

    /// edgemeta's `/metrics` text, from its observe endpoint.
    async fn metrics(&self) -> anyhow::Result<String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let port = self.observe.context("not an edgemeta")?;
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        Ok(response)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
        // A node restarted in the same directory appends to the same log.
        let log = self
            .log
            .as_ref()
            .and_then(|(path, start)| {
                let all = std::fs::read(path).ok()?;
                let own = all.get(*start as usize..)?;
                Some(String::from_utf8_lossy(own).into_owned())
            })
            .unwrap_or_default();
        let cuts: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("EM-BROKER-SUBSCRIBER-LAG"))
            .collect();
        if !cuts.is_empty() {
            LAG_CUTS.fetch_add(cuts.len(), std::sync::atomic::Ordering::Relaxed);
            for line in cuts {
                eprintln!(
                    "edgemeta on port {} cut a subscriber off: {line}",
                    self.port
                );
            }
        }
    }
}

/// A command for `binary`, run with `open_files` as its soft and hard open-files limit when
/// given: set by bash's `ulimit` before it execs the binary (same pid), as the bench has no
/// `setrlimit` of its own. Beyond the hard limit this needs CAP_SYS_RESOURCE.
fn limited(binary: &Path, open_files: Option<u64>) -> Command {
    let Some(files) = open_files else {
        return Command::new(binary);
    };
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(r#"ulimit -n "$1" && shift && exec "$@""#)
        .arg("bash")
        .arg(files.to_string())
        .arg(binary);
    command
}

fn free_port() -> anyhow::Result<u16> {
    let [port] = free_ports()?;
    Ok(port)
}

/// The last `n` lines of `text`.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `N` distinct free ports: each held until all are chosen.
fn free_ports<const N: usize>() -> anyhow::Result<[u16; N]> {
    let held = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()?;
    let mut ports = [0; N];
    for (port, listener) in ports.iter_mut().zip(&held) {
        *port = listener.local_addr()?.port();
    }
    Ok(ports)
}

/// A connected client whose received publishes arrive on a channel.
async fn client(
    port: u16,
    id: &str,
) -> anyhow::Result<(AsyncClient, mpsc::UnboundedReceiver<(String, bytes::Bytes)>)> {
    let unique = format!("{id}-{}", uuid::Uuid::new_v4().simple());
    session(port, &unique, true).await
}

/// A client under exactly `id`, with a clean or a persistent session.
async fn session(
    port: u16,
    id: &str,
    clean: bool,
) -> anyhow::Result<(AsyncClient, mpsc::UnboundedReceiver<(String, bytes::Bytes)>)> {
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_clean_session(clean);
    options.set_max_packet_size(64 << 20, 64 << 20);
    options.set_keep_alive(Duration::from_secs(30));
    let (client, mut eventloop) = AsyncClient::new(options, 10_000);
    // Like any latency-minded client; the broker's side is what is measured.
    let mut network = rumqttc::NetworkOptions::new();
    network.set_tcp_nodelay(true);
    eventloop.set_network_options(network);
    let (tx, rx) = mpsc::unbounded_channel();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(drive(eventloop, tx, ready_tx));
    tokio::time::timeout(Duration::from_secs(10), ready_rx)
        .await
        .context("CONNACK")??;
    Ok((client, rx))
}

async fn drive(
    mut eventloop: EventLoop,
    tx: mpsc::UnboundedSender<(String, bytes::Bytes)>,
    ready: tokio::sync::oneshot::Sender<()>,
) {
    let mut ready = Some(ready);
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                if let Some(r) = ready.take() {
                    let _ = r.send(());
                }
            }
            Ok(Event::Incoming(Packet::PubAck(_))) => {
                // Publishers drop their inbox; their event loop must go on regardless.
                let _ = tx.send((PUBACK.to_owned(), bytes::Bytes::new()));
            }
            Ok(Event::Incoming(Packet::SubAck(_))) => {
                let _ = tx.send((SUBACK.to_owned(), bytes::Bytes::new()));
            }
            Ok(Event::Incoming(Packet::Publish(p))) => {
                let _ = tx.send((p.topic, p.payload));
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

/// What `drive` passes on for a SUBACK (no real topic starts with `$`).
const SUBACK: &str = "$suback";
/// What `drive` passes on for a PUBACK.
const PUBACK: &str = "$puback";

/// Subscribes at QoS 1 and waits for the SUBACK.
async fn subscribe(client: &AsyncClient, rx: &mut Inbox, filter: &str) -> anyhow::Result<()> {
    subscribe_at(client, rx, filter, QoS::AtLeastOnce).await
}

/// Subscribes at `qos` and waits for the SUBACK (what arrives before it is dropped).
async fn subscribe_at(
    client: &AsyncClient,
    rx: &mut Inbox,
    filter: &str,
    qos: QoS,
) -> anyhow::Result<()> {
    client.subscribe(filter, qos).await?;
    loop {
        let (topic, _) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .context("SUBACK")?
            .context("connection gone")?;
        if topic == SUBACK {
            return Ok(());
        }
    }
}

type Inbox = mpsc::UnboundedReceiver<(String, bytes::Bytes)>;

/// A KubeEdge envelope with ~300 bytes of content, whose metadata agrees with `resource`
/// (`<namespace>/<type>/<name>`): the node refuses a namespace that contradicts its topic.
fn insert(resource: &str, sent_us: u64) -> Vec<u8> {
    let namespace = resource.split('/').next().unwrap_or_default();
    let name = resource.rsplit('/').next().unwrap_or_default();
    json!({
        "header": {"msg_id": uuid::Uuid::new_v4().to_string(), "timestamp": 0},
        "route": {"source": "edgecontroller", "group": "resource", "operation": "insert", "resource": resource},
        "content": {"t": sent_us, "metadata": {"name": name, "namespace": namespace}, "pad": "x".repeat(240)},
    })
    .to_string()
    .into_bytes()
}

/// An edged query of `resource` (a 2-level one lists the type); returns its id and payload.
fn query(resource: &str) -> (String, Vec<u8>) {
    let id = uuid::Uuid::new_v4().to_string();
    let payload = json!({
        "header": {"msg_id": id, "timestamp": 0},
        "route": {"source": "edged", "group": "resource", "operation": "query", "resource": resource},
        "content": null,
    });
    (id, payload.to_string().into_bytes())
}

/// Whether `payload` answers request `id`. The node writes `header` first, so only the head is
/// searched: parsing a large list answer would add its own time to the measured round trip.
fn answers(payload: &[u8], id: &str) -> bool {
    let needle = format!("\"parent_msg_id\":\"{id}\"");
    let head = &payload[..payload.len().min(256)];
    head.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Most messages the publishers of a run may have sent that its subscriber has not seen yet.
/// The node disconnects a QoS 1 subscriber owed more than (segment_count - 1) x segment_bytes,
/// 3 MiB by default (EM-BROKER-SUBSCRIBER-LAG), and it commits faster than it can hand on to one
/// subscriber (100 in flight per PUBACK round trip): an open-loop burst of 40k inserts put
/// 6–12 MiB in that subscriber's debt. 4,000 hand-ons of ~540 log bytes are ~2.2 MB.
const WINDOW: usize = 4_000;

/// Permits to publish: taken one per message, given back one per arrival at the subscriber;
/// `size` 0 is no limit.
fn window(size: usize) -> std::sync::Arc<tokio::sync::Semaphore> {
    let permits = match size {
        0 => tokio::sync::Semaphore::MAX_PERMITS / 2,
        n => n,
    };
    std::sync::Arc::new(tokio::sync::Semaphore::new(permits))
}

/// Messages per second from the first publish to the last arrival at the subscriber, with at
/// most `sizes.window` on their way.
async fn throughput(port: u16, watch: &str, sizes: &Sizes, ns: &str) -> anyhow::Result<f64> {
    let (sub, mut rx) = client(port, "sub").await?;
    subscribe(&sub, &mut rx, watch).await?;
    let total = sizes.publishers * sizes.per_publisher;
    let window = window(sizes.window);
    let started = Instant::now();
    let mut publishers = Vec::new();
    for p in 0..sizes.publishers {
        let (publisher, _) = client(port, "pub").await?;
        publishers.push(publisher.clone());
        let per = sizes.per_publisher;
        let ns = ns.to_owned();
        let v1_topics = sizes.v1_topics;
        let window = window.clone();
        tokio::spawn(async move {
            // One type-level topic; each envelope names its pod.
            let type_topic = format!("ke/meta/edgecontroller/insert/{ns}/pod");
            for i in 0..per {
                let resource = format!("{ns}/pod/p{p}-{i}");
                let topic = if v1_topics {
                    format!("ke/meta/edgecontroller/insert/{resource}")
                } else {
                    type_topic.clone()
                };
                if !windowed_insert(&publisher, &window, topic, &resource).await {
                    return;
                }
            }
        });
    }
    let mut got = 0;
    while got < total {
        tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .context("throughput stalled")?
            .context("subscriber gone")?;
        window.add_permits(1);
        got += 1;
    }
    let rate = total as f64 / started.elapsed().as_secs_f64();
    window.close();
    // Each run's clients leave with it: a subscriber left behind would still be fed every
    // message of the runs after it (mosquitto's P1 fell from 78k to 41k msg/s over four runs).
    for client in &publishers {
        let _ = client.disconnect().await;
    }
    leave(&sub, &mut rx).await;
    Ok(rate)
}

/// Waits (at most 5 s) until the client whose inbox is `rx` has left: its event loop ends once
/// the broker has its DISCONNECT. Until then it is one more subscriber the broker feeds, so the
/// next run would pay for it (mosquitto's second P1 run fell from 83k to 55k msg/s).
async fn gone(rx: &mut Inbox) {
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while rx.recv().await.is_some() {}
    })
    .await;
}

/// Disconnects `client` and waits until it has left ([`gone`]).
async fn leave(client: &AsyncClient, rx: &mut Inbox) {
    let _ = client.disconnect().await;
    gone(rx).await;
}

/// Latency percentiles in microseconds.
struct Percentiles {
    p50: u64,
    p99: u64,
    p999: u64,
}

impl std::fmt::Display for Percentiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} / {} / {}", self.p50, self.p99, self.p999)
    }
}

/// Runs of each side at each P2 rate.
const P2_RUNS: usize = 3;

/// P1 runs a side in one bench run, alternated.
const P1_RUNS: usize = 5;

/// Each P2 figure's median over runs: percentiles, delivered rate, CPU µs per message.
fn medians(runs: &[(Percentiles, f64, f64)]) -> (Percentiles, f64, f64) {
    (
        middle_percentiles(runs.iter().map(|r| &r.0)),
        median(runs.iter().map(|r| r.1).collect()),
        median(runs.iter().map(|r| r.2).collect()),
    )
}

/// Each percentile's median over runs.
fn middle_percentiles<'a>(runs: impl Iterator<Item = &'a Percentiles> + Clone) -> Percentiles {
    let of =
        |f: fn(&Percentiles) -> u64| median(runs.clone().map(|p| f(p) as f64).collect()) as u64;
    Percentiles {
        p50: of(|p| p.p50),
        p99: of(|p| p.p99),
        p999: of(|p| p.p999),
    }
}

/// The middle value (the upper one of the two middles for an even count); 0 for none.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

fn percentiles(mut samples: Vec<u64>) -> Percentiles {
    samples.sort_unstable();
    let at = |q: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    Percentiles {
        p50: at(0.5),
        p99: at(0.99),
        p999: at(0.999),
    }
}

/// Publishes `total` inserts at `rate` per second, a share every millisecond, to 1,000 pods
/// of namespace `lat`, each with its send time (µs since `epoch`) in `content.t`; then idles
/// until aborted.
fn paced_inserts(
    publisher: AsyncClient,
    epoch: Instant,
    rate: u64,
    total: u64,
) -> tokio::task::JoinHandle<()> {
    let per_tick = (rate / 1000).max(1);
    tokio::spawn(async move {
        // Every millisecond, that millisecond's share of the offered rate.
        let mut tick = tokio::time::interval(Duration::from_millis(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut sent = 0;
        while sent < total {
            tick.tick().await;
            for _ in 0..per_tick {
                let resource = format!("lat/pod/r{}", sent % 1000);
                let now = epoch.elapsed().as_micros() as u64;
                let topic = "ke/meta/edgecontroller/insert/lat/pod";
                if publisher
                    .publish(topic, QoS::AtLeastOnce, false, insert(&resource, now))
                    .await
                    .is_err()
                {
                    return;
                }
                sent += 1;
            }
        }
        tokio::time::sleep(Duration::from_secs(3600)).await;
    })
}

/// Publish → subscriber latency at a paced offered rate, and the rate actually delivered
/// (messages over first publish → last receive).
async fn latency(
    port: u16,
    watch: &str,
    rate: u64,
    seconds: u64,
) -> anyhow::Result<(Percentiles, f64)> {
    let epoch = Instant::now();
    let (sub, mut rx) = client(port, "lsub").await?;
    subscribe(&sub, &mut rx, watch).await?;
    let (publisher, mut acks) = client(port, "lpub").await?;
    let total = rate * seconds;
    let started = Instant::now();
    let producer = paced_inserts(publisher.clone(), epoch, rate, total);
    let mut samples = Vec::with_capacity(total as usize);
    let mut sent_at = Vec::with_capacity(total as usize);
    while (samples.len() as u64) < total {
        let (_, payload) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .context("latency run stalled")?
            .context("subscriber gone")?;
        let now = epoch.elapsed().as_micros() as u64;
        let body: serde_json::Value = serde_json::from_slice(&payload)?;
        if let Some(sent) = body["content"]["t"].as_u64() {
            samples.push(now.saturating_sub(sent));
            sent_at.push(sent);
        }
    }
    let delivered = total as f64 / started.elapsed().as_secs_f64();
    producer.abort();
    // The run's clients leave with it: a subscriber left behind is fed every later run's
    // messages (a third P2 run at 1k msg/s against one mosquitto read p99 1,867 µs against its
    // first run's 475 with two runs' clients still connected).
    leave(&publisher, &mut acks).await;
    leave(&sub, &mut rx).await;
    // Every sample in send order, to see when the slow ones happened (not in any table). The
    // first line is the send times' origin: wall-clock µs, and the monotonic clock as Rust
    // prints an `Instant` (CLOCK_MONOTONIC on Linux), to lay them beside `perf record -k mono`.
    if let Ok(path) = std::env::var("BENCH_SAMPLES") {
        let epoch_unix_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_micros()
            .saturating_sub(epoch.elapsed().as_micros());
        let lines: String = std::iter::once(format!("# epoch {epoch_unix_us} {epoch:?}\n"))
            .chain(
                sent_at
                    .iter()
                    .zip(&samples)
                    .map(|(sent, took)| format!("{sent} {took}\n")),
            )
            .collect();
        std::fs::write(path, lines)?;
    }
    Ok((percentiles(samples), delivered))
}

/// Stores `count` pods under namespace `ns`, waiting until the last is handed to edged.
async fn fill(port: u16, ns: &str, count: usize) -> anyhow::Result<()> {
    let (c, mut rx) = client(port, "fill").await?;
    subscribe(
        &c,
        &mut rx,
        &format!("ke/edged/edgecontroller/insert/{ns}/#"),
    )
    .await?;
    // The "OK"s to the cloud leave through the outbox after the commit: wait for them too, so
    // that the next measurement does not share the node with the relay still draining them.
    subscribe(&c, &mut rx, &format!("ke/cloud/meta/response/{ns}/#")).await?;
    // In chunks, reading back each before sending the next: the node disconnects a QoS 1
    // subscriber owed more than (segment_count - 1) x segment_bytes (3 MiB by default,
    // EM-BROKER-SUBSCRIBER-LAG), and this one client receives what it sends on each of its two
    // filters. 2,000 hand-ons of ~540 log bytes are ~1.1 MB per filter.
    const CHUNK: usize = WINDOW / 2;
    for start in (0..count).step_by(CHUNK) {
        let end = (start + CHUNK).min(count);
        for i in start..end {
            let resource = format!("{ns}/pod/q{i}");
            c.publish(
                format!("ke/meta/edgecontroller/insert/{ns}/pod"),
                QoS::AtLeastOnce,
                false,
                insert(&resource, 0),
            )
            .await?;
        }
        wait_for(
            &mut rx,
            2 * (end - start),
            |topic| !topic.starts_with('$'),
            "fill",
        )
        .await?;
    }
    leave(&c, &mut rx).await;
    Ok(())
}

/// Round trip of `n` sequential edged queries of `resource`: full envelopes on the type-level
/// topic, each answer matched to its query by `parent_msg_id` (answers share that topic).
async fn query_latency(
    port: u16,
    resource: &str,
    n: usize,
    qos: QoS,
) -> anyhow::Result<Percentiles> {
    let (c, mut rx) = client(port, "query").await?;
    let type_level = type_level(resource);
    subscribe(&c, &mut rx, &format!("ke/edged/meta/response/{type_level}")).await?;
    let topic = format!("ke/meta/edged/query/{type_level}");
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let (id, payload) = query(resource);
        let started = Instant::now();
        c.publish(&topic, qos, false, payload).await?;
        loop {
            let (_, answer) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .context("query: no answer")?
                .context("query: connection gone")?;
            if answers(&answer, &id) {
                break;
            }
        }
        samples.push(started.elapsed().as_micros() as u64);
    }
    // Answers share the topic: one left behind would receive every later query's.
    leave(&c, &mut rx).await;
    Ok(percentiles(samples))
}

/// CPU time (user + system, all threads) process `pid` has used so far.
fn cpu_of(pid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which may hold spaces; utime and stime are 14 and 15,
    // in USER_HZ ticks, which Linux fixes at 100 per second for /proc.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("/proc stat")?
        .1
        .split_whitespace()
        .collect();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        Ok(fields.get(i).context("/proc stat field")?.parse()?)
    };
    Ok(Duration::from_millis((ticks(11)? + ticks(12)?) * 10))
}

/// VmRSS of process `pid`, KiB.
fn rss_of(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS")
}
