//! The devices row: simulated KubeEdge mappers report device twins on
//! `$hw/events/device/<id>/twin/update` once a second each and wait for
//! `.../twin/update/result` (docs/devices.md). edgemeta answers those itself; the peer is a
//! mosquitto with a pass-through responder (a separate process) that republishes each update to
//! its result topic.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rumqttc::QoS;
use serde_json::json;
use tokio::io::AsyncBufReadExt as _;

use super::cloud::Cloud;
use super::devices_dmi;
use super::mappers::{Mapper, MapperOutcome};
use super::schedule::{now_ms, WARM_UP};
use super::{client, cpu_of, rss_of, subscribe, Args, Row, Server};

/// How many devices report, for how long, over how many MQTT connections.
#[derive(Clone, Copy)]
pub struct DeviceLoad {
    pub devices: usize,
    pub seconds: u64,
    pub connections: usize,
}

impl DeviceLoad {
    /// 1,000 devices for 60 s over 50 connections (20 devices each, like a mapper serving
    /// several devices); `--quick`: 100 devices for 5 s over 10 connections.
    pub fn new(args: &Args) -> DeviceLoad {
        let (devices, seconds, connections) = if args.quick {
            (100, 5, 10)
        } else {
            (1_000, 60, 50)
        };
        let devices = args.device_count.unwrap_or(devices).max(1);
        DeviceLoad {
            devices,
            seconds: args.device_seconds.unwrap_or(seconds).max(1),
            connections: args
                .device_connections
                .unwrap_or(connections)
                .clamp(1, devices),
        }
    }
}

impl DeviceLoad {
    /// The one-connection-each row: 10,000 devices for 60 s, each on its own connection
    /// (`--quick`: 50 for 3 s); `--device-count`, `--device-seconds` and
    /// `--device-connections` apply to it under `--devices-many`.
    pub fn many(args: &Args) -> DeviceLoad {
        let (devices, seconds) = if args.quick {
            (50, 3)
        } else {
            (MANY_DEVICES, 60)
        };
        let overrides = args.devices_many;
        let devices = if overrides { args.device_count } else { None }
            .unwrap_or(devices)
            .max(1);
        let connections = if overrides {
            args.device_connections
        } else {
            None
        };
        DeviceLoad {
            devices,
            seconds: if overrides { args.device_seconds } else { None }
                .unwrap_or(seconds)
                .max(1),
            connections: connections.unwrap_or(devices).clamp(1, devices),
        }
    }
}

/// Devices in the full run's one-connection-each row.
const MANY_DEVICES: usize = 10_000;

/// The node's id in `$hw/events/node/<node>/...`: `cloud.node_id`'s default.
const NODE: &str = "edge-node";
/// Devices per membership message from the (simulated) cloud.
const MEMBERSHIP_CHUNK: usize = 100;
/// How long the last reports may take to be answered before they count as lost.
const GRACE: Duration = Duration::from_secs(5);

/// What one side did under the load.
struct Outcome {
    /// Report → result, µs, of every result received.
    samples: Vec<u64>,
    /// The same, of reports scheduled from [`WARM_UP`] on: each device's first report (a new
    /// filter for rumqttd, a first twin row) weighs on the whole run's p99.
    steady: Vec<u64>,
    sent: usize,
    /// Reports never answered within `GRACE` of the last publish.
    lost: usize,
    /// Error results (`"code"` in the payload).
    errors: usize,
    /// Results per second, first scheduled report → last result.
    rate: f64,
    /// Largest delay of a publish behind its schedule (the load generator's own lag), µs.
    late_max: u64,
    /// CPU used from just before the first report to the last result (the connects and
    /// subscribes before it left out): the bench process (the load generator), the broker, and
    /// the helper beside it (the responder), if any.
    generator_cpu: Duration,
    broker_cpu: Duration,
    helper_cpu: Duration,
    /// Per second of the run, the results that took longer than `SLOW`.
    slow: Vec<usize>,
    /// Report → result, µs, by minute of the run (when the report was scheduled).
    minutes: Vec<Vec<u64>>,
    /// Report → result, µs, by second of the run (when the report was scheduled).
    seconds: Vec<Vec<u64>>,
    /// The broker's course over the run, one entry per [`Course::interval`].
    course: Course,
}

/// A result later than this is counted per second on stderr, to show when stalls happen.
const SLOW: Duration = Duration::from_millis(10);

impl Outcome {
    /// p50, p99 and max of the latencies, µs.
    fn percentiles(&self) -> (u64, u64, u64) {
        percentiles(&self.samples)
    }

    /// The broker's CPU µs per report sent, over the load.
    fn cpu(&self) -> f64 {
        self.per_report(self.broker_cpu)
    }

    /// The helper's (responder's) CPU µs per report sent, over the load.
    fn helper_cpu(&self) -> f64 {
        self.per_report(self.helper_cpu)
    }

    /// The load generator's CPU µs per report sent.
    fn generator_cpu(&self) -> f64 {
        self.per_report(self.generator_cpu)
    }

    fn per_report(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() * 1e6 / self.sent.max(1) as f64
    }
}

/// p50, p99 and max of `samples`.
fn percentiles(samples: &[u64]) -> (u64, u64, u64) {
    let mut s = samples.to_vec();
    s.sort_unstable();
    let at = |q: f64| {
        s.get(((s.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    (at(0.5), at(0.99), s.last().copied().unwrap_or(0))
}

/// `edgemeta-bench --devices` and the row in the full run: the same device load against a
/// node and against mosquitto with the pass-through responder.
pub async fn devices(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let load = DeviceLoad::new(args);
    let ids = ids(load);

    let dir = tempfile::tempdir()?;
    let Pair {
        mq,
        em,
        mq_rss: (mq_rss_before, mq_rss),
        em_rss: (em_rss_before, em_rss),
    } = pair(args, load, &ids, dir.path()).await?;
    let (em_cpu, mq_cpu, responder_cpu) = (em.cpu(), mq.cpu(), mq.helper_cpu());

    // The same devices as Device objects in Kubernetes, which the controller brings through a
    // cloud broker to a fresh node serving DMI; one gRPC mapper registers and reports them.
    let dmi_dir = dir.path().join("dmi");
    std::fs::create_dir(&dmi_dir)?;
    let cloud = Cloud::start(args, &dmi_dir).await?;
    let (socket, yaml) = devices_dmi::socket_config(&dmi_dir);
    let yaml = format!("{yaml}{}", cloud.node_config(NODE));
    let node = Server::edgemeta_with(&args.edgemeta, &dmi_dir, &yaml).await?;
    let synced = Instant::now();
    devices_dmi::create_devices(&cloud, NODE, &ids).await?;
    await_devices(node.port, ids.len()).await?;
    devices_dmi::register(&socket, &dmi_dir.join("mapper.sock"), ids.len()).await?;
    eprintln!(
        "devices through DMI: {} Devices created and on the node, and the mapper registered with them, in {:.1} s",
        ids.len(),
        synced.elapsed().as_secs_f64()
    );
    let before = node.cpu()?;
    let cloud_before = cloud.cpu()?;
    let dmi_rss_before = node.rss_kib()?;
    let commits_before = commits(&node).await;
    let dmi = devices_dmi::run_load(&socket, &ids, load.seconds).await?;
    let commits_after = commits(&node).await;
    let dmi_cpu = (node.cpu()? - before).as_secs_f64() * 1e6 / dmi.sent as f64;
    let dmi_rss = node.rss_kib()?;
    let (in_status, status_lag) =
        devices_dmi::in_device_status(&cloud, &ids, load.seconds, Duration::from_secs(60)).await?;
    let cloud_cpu = cloud.cpu()?;
    let stored = devices_dmi::stored(node.port, &ids, load.seconds).await?;
    drop(node);
    let controller_log = cloud.controller_log();
    drop(cloud);
    let (p50, p99, max) = percentiles(&dmi.samples);
    let (_, steady_p99, _) = percentiles(&dmi.steady);
    eprintln!(
        "devices through DMI: {} reports sent, {} acknowledged, errors {:?}, {} lost; p50 / p99 / max {p50} / {p99} / {max} µs (p99 from {WARM_UP} s on: {steady_p99} µs), {:.0} OKs/s; the mapper was at most {} µs behind its schedule; {stored} of {} twins on the node and {in_status} DeviceStatuses hold their last report, the DeviceStatuses {:.1} s after the last OK",
        dmi.sent,
        dmi.acknowledged,
        dmi.errors,
        dmi.lost,
        dmi.rate,
        dmi.late_max,
        ids.len(),
        status_lag.as_secs_f64()
    );
    let per_report = |d: Duration| d.as_secs_f64() * 1e6 / dmi.sent as f64;
    eprintln!(
        "devices through DMI: CPU µs per report until the DeviceStatuses held the last: controller {:.0}, fake API server {:.0}, cloud broker {:.0}",
        per_report(cloud_cpu.controller - cloud_before.controller),
        per_report(cloud_cpu.api - cloud_before.api),
        per_report(cloud_cpu.broker - cloud_before.broker)
    );
    if let (Some(before), Some(after)) = (commits_before, commits_after) {
        eprintln!(
            "devices through DMI: {:.0} store commits during the load; outbox {:.0} → {:.0} entries",
            after[0] - before[0],
            before[3],
            after[3]
        );
    }
    for (code, message) in &dmi.first_errors {
        eprintln!("devices through DMI: the first {code}: {message}");
    }
    if in_status < ids.len() {
        let log = controller_log.lines().rev().take(20).collect::<Vec<_>>();
        eprintln!(
            "the controller's last log lines, newest first:\n{}",
            log.join("\n")
        );
    }

    let stats = |o: &Outcome| {
        let (p50, p99, max) = o.percentiles();
        format!("{p50} / {p99} / {max}; {:.0}; {}", o.rate, o.lost)
    };
    let errors = if em.errors > 0 {
        format!(" ({} error results)", em.errors)
    } else {
        String::new()
    };
    rows.push(Row {
        name: format!(
            "devices: {} devices × 1 twin report/s for {} s ({} connections, QoS 1): report → result p50 / p99 / max (µs); results/s; lost; CPU µs per report",
            load.devices, load.seconds, load.connections
        ),
        edgemeta: format!("{}{errors}; {em_cpu:.0}", stats(&em)),
        mosquitto: format!(
            "{}; {:.0} + {:.0} responder (pass-through)",
            stats(&mq),
            mq_cpu,
            responder_cpu
        ),
        target: "—".into(),
        verdict: format!(
            "p99 {:.1} vs {:.1} ms",
            em.percentiles().1 as f64 / 1e3,
            mq.percentiles().1 as f64 / 1e3
        ),
    });
    let dmi_errors: usize = dmi.errors.values().sum();
    rows.push(Row {
        name: format!(
            "devices through DMI: the same {} devices as Device objects (fake API server → controller → cloud broker → node) × 1 ReportDeviceStatus/s for {} s through one gRPC mapper (one unix-socket connection): call → OK p50 / p99 / max (µs); OKs/s; lost; node CPU µs per report; twins on the node and DeviceStatuses holding their last report (the DeviceStatuses how long after the last OK)",
            load.devices, load.seconds
        ),
        edgemeta: format!(
            "{p50} / {p99} / {max}; {:.0}; {}{}; {dmi_cpu:.0}; {stored} and {in_status} of {} ({:.1} s)",
            dmi.rate,
            dmi.lost,
            if dmi_errors > 0 {
                format!(" ({dmi_errors} errors: {:?})", dmi.errors)
            } else {
                String::new()
            },
            ids.len(),
            status_lag.as_secs_f64()
        ),
        mosquitto: "— (no DMI)".into(),
        target: "every report acknowledged, on the node and in its DeviceStatus".into(),
        verdict: format!(
            "{}; p99 {:.1} ms vs {:.1} ms over MQTT, CPU {dmi_cpu:.0} vs {em_cpu:.0} µs per report",
            super::verdict(
                dmi.lost == 0
                    && dmi_errors == 0
                    && stored == ids.len()
                    && in_status == ids.len(),
                ""
            ),
            p99 as f64 / 1e3,
            em.percentiles().1 as f64 / 1e3
        ),
    });
    let mb = |kib: u64| kib as f64 / 1024.0;
    rows.push(Row {
        name: format!(
            "devices: RSS before the {} devices connect / right after their load",
            load.devices
        ),
        edgemeta: format!("{:.1} MB / {:.1} MB", mb(em_rss_before), mb(em_rss)),
        mosquitto: format!("{:.1} MB / {:.1} MB", mb(mq_rss_before), mb(mq_rss)),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    rows.push(Row {
        name: format!(
            "devices through DMI: RSS before the {} devices report / right after their load",
            load.devices
        ),
        edgemeta: format!("{:.1} MB / {:.1} MB", mb(dmi_rss_before), mb(dmi_rss)),
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    if let Some(path) = &args.devices_csv {
        let mut csv = String::from(
            "system,t_s,rss_mb,cpu_us_per_report,responder_cpu_us_per_report,p50_us,p99_us\n",
        );
        course_csv(&mut csv, "edgemeta", &em, load.devices);
        course_csv(&mut csv, "mosquitto", &mq, load.devices);
        std::fs::write(path, csv)?;
    }
    if dmi_errors > 0 || dmi.lost > 0 || stored < ids.len() || in_status < ids.len() {
        bail!(
            "through DMI: {dmi_errors} reports refused ({:?}), {} lost; {stored} of {} twins and {in_status} DeviceStatuses hold their last report",
            dmi.errors,
            dmi.lost,
            ids.len()
        );
    }
    if em.errors > 0 {
        bail!(
            "edgemeta answered {} device twin reports with an error result",
            em.errors
        );
    }
    Ok(())
}

/// One device load against both sides, each measured alone: mosquitto with the pass-through
/// responder, then a fresh node.
struct Pair {
    mq: Outcome,
    em: Outcome,
    /// VmRSS (KiB) before the devices connect and right after their load.
    mq_rss: (u64, u64),
    em_rss: (u64, u64),
}

/// Connections a node admits beyond the devices': the membership publisher, the readiness
/// probes and the node's in-process links, which count against `broker.max_connections`
/// (default 10,000: one connection per device at 10,000 devices needs more).
const SPARE_CONNECTIONS: usize = 64;

/// A node for `load`: its defaults, but admitting a connection per device and the spare ones.
async fn device_node(
    binary: &std::path::Path,
    dir: &std::path::Path,
    load: DeviceLoad,
) -> anyhow::Result<Server> {
    let admit = (load.connections + SPARE_CONNECTIONS).max(10_000);
    Server::edgemeta_broker(binary, dir, &format!("  max_connections: {admit}\n"), "").await
}

/// `load` on `ids` against mosquitto with the responder, then against a node that the
/// cloud's membership message told of the devices; both sides' progress on stderr.
async fn pair(
    args: &Args,
    load: DeviceLoad,
    ids: &[String],
    dir: &std::path::Path,
) -> anyhow::Result<Pair> {
    // The reference first: the devices and schedule edgemeta gets below, each report answered
    // by the responder with its own payload. mosquitto sets TCP_NODELAY, as edgemeta's accept
    // loop does: with Nagle on (its default) each result waits for the delayed ACK of the PUBACK
    // sent just before it on the same connection (p50 ~42 ms here, `--device-nagle`).
    let nodelay = if args.device_nagle {
        ""
    } else {
        "set_tcp_nodelay true\n"
    };
    let mosquitto = Server::mosquitto_with(
        &args.mosquitto,
        dir,
        "mosquitto",
        super::free_port()?,
        nodelay,
    )
    .await?;
    let responder = Responder::start(mosquitto.port).await?;
    let mq_rss_before = mosquitto.rss_kib()?;
    let sampler = rss_sampler(mosquitto.pid(), "mosquitto", !args.quick);
    let watched = Watched {
        broker: mosquitto.pid(),
        helper: Some(responder.pid()?),
    };
    let mq = run_load(mosquitto.port, ids, load, "mosquitto", watched).await?;
    sampler.abort();
    let mq_rss = mosquitto.rss_kib()?;
    drop(responder);
    drop(mosquitto);
    progress("mosquitto", &mq);

    // edgemeta: the cloud's membership message adds the devices, then they report.
    let node = device_node(&args.edgemeta, dir, load).await?;
    add_devices(node.port, ids).await?;
    let em_rss_before = node.rss_kib()?;
    let commits_before = commits(&node).await;
    let sampler = rss_sampler(node.pid(), "edgemeta", !args.quick);
    let watched = Watched {
        broker: node.pid(),
        helper: None,
    };
    let em = run_load(node.port, ids, load, "edgemeta", watched).await;
    sampler.abort();
    let em = match em {
        Ok(em) => em,
        Err(e) => {
            let tail = node_log_tail(&node);
            return Err(e.context(format!("the node's last log lines:\n{tail}")));
        }
    };
    let commits_after = commits(&node).await;
    let em_rss = node.rss_kib()?;
    drop(node);
    progress("edgemeta", &em);
    if let (Some(before), Some(after)) = (commits_before, commits_after) {
        let d = |i: usize| after[i] - before[i];
        eprintln!(
            "devices on edgemeta: {:.0} store commits during the load, {:.0} over 10 ms, {:.0} over 100 ms (edgemeta_store_commit_seconds); outbox {:.0} → {:.0} entries (no cloud configured)",
            d(0),
            d(0) - d(1),
            d(0) - d(2),
            before[3],
            after[3]
        );
    }
    Ok(Pair {
        mq,
        em,
        mq_rss: (mq_rss_before, mq_rss),
        em_rss: (em_rss_before, em_rss),
    })
}

/// The last lines of the node's log of this run, newest last.
fn node_log_tail(node: &Server) -> String {
    let Some((path, start)) = &node.log else {
        return String::new();
    };
    let log = std::fs::read(path).unwrap_or_default();
    let ours = String::from_utf8_lossy(log.get(*start as usize..).unwrap_or_default()).into_owned();
    let lines: Vec<&str> = ours.lines().collect();
    lines[lines.len().saturating_sub(10)..].join("\n")
}

/// The one-connection-each row ([`DeviceLoad::many`]): the same MQTT device load as
/// [`devices`] against a node and against mosquitto with the responder, no DMI half; per side
/// the CPU per report of the broker (and responder) and of the load generator, and the RSS.
pub async fn many(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let load = DeviceLoad::many(args);
    super::connections::bench_files(load.connections, "the one-connection-each devices row")?;
    let ids = ids(load);
    let dir = tempfile::tempdir()?;
    let Pair {
        mq,
        em,
        mq_rss,
        em_rss,
    } = pair(args, load, &ids, dir.path()).await?;
    let mb = |kib: u64| kib as f64 / 1024.0;
    let side = |o: &Outcome, cpu: String, rss: (u64, u64)| {
        let (p50, p99, max) = o.percentiles();
        format!(
            "{p50} / {p99} / {max}; {:.0}; {}; {cpu}; {:.1} → {:.1} MB (load generator {:.0} µs per report)",
            o.rate,
            o.lost,
            mb(rss.0),
            mb(rss.1),
            o.generator_cpu()
        )
    };
    let errors = if em.errors > 0 {
        format!(" ({} error results)", em.errors)
    } else {
        String::new()
    };
    let (_, p99, _) = em.percentiles();
    // Each target the node missed, named in the verdict.
    let missed: Vec<&str> = [
        (em.cpu() > 100.0, "CPU per report"),
        (p99 > 5_000, "p99"),
        (em.lost > 0 || em.errors > 0, "lost"),
        (mb(em_rss.1) > 150.0, "RSS"),
    ]
    .into_iter()
    .filter_map(|(missed, what)| missed.then_some(what))
    .collect();
    rows.push(Row {
        name: format!(
            "devices, one connection each: {} devices × 1 twin report/s for {} s ({} connections, QoS 1): report → result p50 / p99 / max (µs); results/s; lost; CPU µs per report over the load; RSS before the devices connect → after their load",
            load.devices, load.seconds, load.connections
        ),
        edgemeta: format!("{}{errors}", side(&em, format!("{:.0}", em.cpu()), em_rss)),
        mosquitto: side(
            &mq,
            format!("{:.0} + {:.0} responder (pass-through)", mq.cpu(), mq.helper_cpu()),
            mq_rss,
        ),
        target: "≤ 100 µs per report (≤ 1 core at 10,000), p99 ≤ 5 ms, RSS ≤ 150 MB, 0 lost".into(),
        verdict: verdict_many(&missed, &em, &mq),
    });
    if em.errors > 0 {
        bail!(
            "edgemeta answered {} device twin reports with an error result",
            em.errors
        );
    }
    Ok(())
}

/// The one-connection-each row's verdict: met, or the targets missed; and the two sides' p99.
fn verdict_many(missed: &[&str], em: &Outcome, mq: &Outcome) -> String {
    let p99s = format!(
        "p99 {:.1} vs {:.1} ms",
        em.percentiles().1 as f64 / 1e3,
        mq.percentiles().1 as f64 / 1e3
    );
    if missed.is_empty() {
        super::verdict(true, &p99s)
    } else {
        super::verdict(false, &format!("{}; {p99s}", missed.join(", ")))
    }
}

/// `--devices --devices-baseline OLD`: the same device load against two edgemeta builds,
/// alternated round by round in the same minutes; each round's figures on stderr, per build the
/// medians of p50, p99 and CPU per report, and the median of the rounds' ratios of each.
pub async fn compare(
    args: &Args,
    baseline: &std::path::Path,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let load = DeviceLoad::new(args);
    let ids = ids(load);
    let builds = [args.edgemeta.as_path(), baseline];
    // Per build: (p50, p99, CPU µs per report) of each round.
    let mut figures: [Vec<(u64, u64, f64)>; 2] = [Vec::new(), Vec::new()];
    for round in 0..args.device_rounds {
        let order = [[0, 1], [1, 0]][round % 2];
        for b in order {
            let dir = tempfile::tempdir()?;
            let node = device_node(builds[b], dir.path(), load).await?;
            add_devices(node.port, &ids).await?;
            let watched = Watched {
                broker: node.pid(),
                helper: None,
            };
            let side = if b == 0 { "edgemeta" } else { "baseline" };
            let o = run_load(node.port, &ids, load, side, watched).await?;
            let cpu = o.cpu();
            if o.errors > 0 || o.lost > 0 {
                bail!("{side}: {} error results, {} lost", o.errors, o.lost);
            }
            let (p50, _, _) = o.percentiles();
            let (_, p99, _) = percentiles(&o.steady);
            eprintln!(
                "round {round} {side} ({}): p50 {p50} µs, p99 from {WARM_UP} s on {p99} µs, CPU {cpu:.0} µs per report",
                builds[b].display()
            );
            figures[b].push((p50, p99, cpu));
        }
    }
    let medians = |f: &[(u64, u64, f64)]| {
        let mut p50: Vec<u64> = f.iter().map(|x| x.0).collect();
        let mut p99: Vec<u64> = f.iter().map(|x| x.1).collect();
        let cpu: Vec<f64> = f.iter().map(|x| x.2).collect();
        p50.sort_unstable();
        p99.sort_unstable();
        (median_u64(&p50), median_u64(&p99), super::median(cpu))
    };
    let (new, old) = (medians(&figures[0]), medians(&figures[1]));
    // Rounds are pairs run in the same minutes: each figure's new / baseline ratio per round,
    // and its median, follows the machine's drift where the medians per build do not.
    let paired = |figure: fn(&(u64, u64, f64)) -> f64| {
        let ratios: Vec<f64> = figures[0]
            .iter()
            .zip(&figures[1])
            .map(|(n, o)| figure(n) / figure(o))
            .collect();
        let lower = ratios.iter().filter(|r| **r < 1.0).count();
        (super::median(ratios), lower)
    };
    let (p50, _) = paired(|f| f.0 as f64);
    let (p99, p99_lower) = paired(|f| f.1 as f64);
    let (cpu, _) = paired(|f| f.2);
    let change = |ratio: f64| format!("{:+.0} %", (ratio - 1.0) * 100.0);
    rows.push(Row {
        name: format!(
            "devices, two builds alternated ({} rounds each, {} devices × 1 report/s for {} s): medians of p50 / p99 from {WARM_UP} s on (µs); CPU µs per report",
            args.device_rounds, load.devices, load.seconds
        ),
        edgemeta: format!("{} / {}; {:.0}", new.0, new.1, new.2),
        mosquitto: format!("{} / {}; {:.0} (baseline)", old.0, old.1, old.2),
        target: "—".into(),
        verdict: format!(
            "median of the rounds' ratios: p50 {}, p99 {}, CPU {}; p99 lower in {p99_lower} of {} rounds",
            change(p50),
            change(p99),
            change(cpu),
            args.device_rounds
        ),
    });
    Ok(())
}

/// The median of sorted `values`.
fn median_u64(values: &[u64]) -> u64 {
    match values.len() {
        0 => 0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2,
    }
}

/// The node's store commits so far: all, within 10 ms, within 100 ms, and the cloud-bound
/// changes in its outbox (from `/metrics`); `None` if they cannot be read.
async fn commits(node: &Server) -> Option<[f64; 4]> {
    let text = node.metrics().await.ok()?;
    let value = |prefix: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))?
            .trim()
            .parse()
            .ok()
    };
    Some([
        value("edgemeta_store_commit_seconds_count ")?,
        value("edgemeta_store_commit_seconds_bucket{le=\"0.01\"} ")?,
        value("edgemeta_store_commit_seconds_bucket{le=\"0.1\"} ")?,
        value("edgemeta_outbox_entries ")?,
    ])
}

/// Prints `side`'s RSS every 10 s on stderr while the load runs (if `print`).
fn rss_sampler(pid: u32, side: &'static str, print: bool) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_secs(10)).await;
            if let (true, Ok(kib)) = (print, rss_of(pid)) {
                eprintln!(
                    "devices on {side}: RSS {:.1} MB after {} s",
                    kib as f64 / 1024.0,
                    started.elapsed().as_secs()
                );
            }
        }
    })
}

/// One side's counts, on stderr.
fn progress(side: &str, o: &Outcome) {
    let (p50, p99, max) = o.percentiles();
    let (_, steady_p99, _) = percentiles(&o.steady);
    eprintln!(
        "devices on {side}: {} reports sent, {} answered, {} error results, {} lost; p50 / p99 / max {p50} / {p99} / {max} µs (p99 from {WARM_UP} s on: {steady_p99} µs), {:.0} results/s; CPU µs per report: {side} {:.0}{}, the load generator {:.1} (at most {} µs behind its schedule)",
        o.sent,
        o.samples.len(),
        o.errors,
        o.lost,
        o.rate,
        o.cpu(),
        if o.helper_cpu.is_zero() {
            String::new()
        } else {
            format!(", the responder {:.0}", o.helper_cpu())
        },
        o.generator_cpu(),
        o.late_max
    );
    let slow: Vec<String> = o
        .slow
        .iter()
        .enumerate()
        .filter(|(_, n)| **n > 0)
        .map(|(second, n)| format!("{second}: {n}"))
        .collect();
    if o.minutes.len() > 1 {
        let p99s: Vec<String> = o
            .minutes
            .iter()
            .map(|m| percentiles(m).1.to_string())
            .collect();
        eprintln!(
            "devices on {side}: p99 by minute of the run (µs): {}",
            p99s.join(", ")
        );
    }
    if !slow.is_empty() {
        eprintln!(
            "devices on {side}: results over {} ms, by second of the run: {}",
            SLOW.as_millis(),
            slow.join(", ")
        );
    }
}

/// The devices' ids, `dev-0001` on.
pub fn ids(load: DeviceLoad) -> Vec<String> {
    (1..=load.devices).map(|i| format!("dev-{i:04}")).collect()
}

/// For the stage budget: `load` offered to a node that already knows `ids`; the reports sent,
/// or an error if any went unanswered.
pub async fn offer(node: &Server, ids: &[String], load: DeviceLoad) -> anyhow::Result<usize> {
    let watched = Watched {
        broker: node.pid(),
        helper: None,
    };
    let outcome = run_load(node.port, ids, load, "edgemeta", watched).await?;
    anyhow::ensure!(outcome.lost == 0, "{} reports unanswered", outcome.lost);
    Ok(outcome.sent)
}

/// Adds `ids` to the node as the cloud's devicecontroller would (membership updates on the
/// local `ke/meta/...` topic, `MEMBERSHIP_CHUNK` devices each), then waits until a membership
/// get lists them all.
pub async fn add_devices(port: u16, ids: &[String]) -> anyhow::Result<()> {
    let (c, _) = client(port, "devicecontroller").await?;
    for chunk in ids.chunks(MEMBERSHIP_CHUNK) {
        let added: Vec<_> = chunk
            .iter()
            .map(|id| {
                json!({
                    "id": id,
                    "name": id,
                    "twin": {"temperature": {
                        "expected": {"value": "20"},
                        "metadata": {"type": "int"},
                        "expected_version": {"cloud": 1, "edge": 0},
                        "optional": false,
                    }},
                })
            })
            .collect();
        let envelope = json!({
            "header": {"msg_id": uuid::Uuid::new_v4().to_string(), "timestamp": now_ms()},
            "route": {"source": "devicecontroller", "group": "twin", "operation": "update", "resource": "node/membership"},
            "content": {
                "event_id": uuid::Uuid::new_v4().to_string(),
                "timestamp": now_ms(),
                "added_devices": added,
                "removed_devices": [],
            },
        });
        c.publish(
            "ke/meta/devicecontroller/update/node/membership",
            QoS::AtLeastOnce,
            false,
            envelope.to_string(),
        )
        .await?;
    }
    // The publisher stays connected until the node lists them all (its publishes are sent).
    let listed = await_devices(port, ids.len()).await;
    let _ = c.disconnect().await;
    listed
}

/// Waits until a membership get on the node at `port` (as `NODE`) lists `count` devices; gives
/// up after 60 s.
pub(super) async fn await_devices(port: u16, count: usize) -> anyhow::Result<()> {
    let (c, mut rx) = client(port, "membership").await?;
    let result = format!("$hw/events/node/{NODE}/membership/get/result");
    subscribe(&c, &mut rx, &result).await?;
    let started = Instant::now();
    let mut listed = 0;
    loop {
        let event_id = uuid::Uuid::new_v4().to_string();
        c.publish(
            format!("$hw/events/node/{NODE}/membership/get"),
            QoS::AtLeastOnce,
            false,
            json!({"event_id": event_id, "timestamp": now_ms()}).to_string(),
        )
        .await?;
        let asked = Instant::now();
        while asked.elapsed() < Duration::from_secs(2) {
            let Ok(Some((topic, payload))) =
                tokio::time::timeout(Duration::from_millis(250), rx.recv()).await
            else {
                continue;
            };
            if topic != result {
                continue;
            }
            let body: serde_json::Value = serde_json::from_slice(&payload)?;
            if body["event_id"] == event_id.as_str() {
                listed = body["devices"].as_array().map_or(0, Vec::len);
                break;
            }
        }
        if listed >= count {
            let _ = c.disconnect().await;
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("membership get on the node lists {listed} of {count} devices after 60 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Every device reports once a second for `load.seconds`, open loop: device `j` (of `N`) at
/// `j/N` s into each second, so reports are spread evenly; devices are dealt to the connections
/// round-robin. Each report's result is matched to it by `event_id`.
async fn run_load(
    port: u16,
    ids: &[String],
    load: DeviceLoad,
    side: &str,
    watched: Watched,
) -> anyhow::Result<Outcome> {
    // The mappers run on a single-threaded runtime of their own, on a thread of its own: no
    // wake-ups handed between worker threads, and at most one core of the two.
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (answered_tx, answered_rx) = tokio::sync::oneshot::channel();
    let generator = {
        let (ids, side) = (ids.to_vec(), side.to_owned());
        std::thread::Builder::new().name("mappers".into()).spawn(
            move || -> anyhow::Result<Vec<anyhow::Result<MapperOutcome>>> {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
                    .block_on(mappers(port, ids, load, side, started_tx, answered_tx))
            },
        )?
    };
    let n = ids.len();
    let Ok(start) = started_rx.await else {
        let failed = tokio::task::spawn_blocking(move || generator.join())
            .await?
            .map_err(|_| anyhow::anyhow!("the mappers' thread panicked"))?;
        return Err(failed
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("the mappers stopped before the load")));
    };
    let sampler = tokio::spawn(Course::sample(start, load.seconds, watched));
    let helper_cpu = |w: Watched| w.helper.map_or(Ok(Duration::ZERO), cpu_of);
    let cpu_before = (
        cpu_of(std::process::id())?,
        cpu_of(watched.broker)?,
        helper_cpu(watched)?,
    );
    // The CPU of the load ends with its last result, before the devices leave.
    let _ = answered_rx.await;
    let cpu_after = (
        cpu_of(std::process::id())?,
        cpu_of(watched.broker)?,
        helper_cpu(watched)?,
    );
    let results = tokio::task::spawn_blocking(move || generator.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the mappers' thread panicked"))??;
    let mut outcome = Outcome {
        samples: Vec::with_capacity(n * load.seconds as usize),
        steady: Vec::with_capacity(n * load.seconds as usize),
        sent: 0,
        lost: 0,
        errors: 0,
        rate: 0.0,
        late_max: 0,
        generator_cpu: Duration::ZERO,
        broker_cpu: Duration::ZERO,
        helper_cpu: Duration::ZERO,
        slow: vec![0; load.seconds as usize],
        minutes: vec![Vec::new(); load.seconds.div_ceil(60) as usize],
        seconds: vec![Vec::new(); load.seconds as usize],
        course: Course::default(),
    };
    let mut last = start;
    let mut first_error = None;
    for result in results {
        let c = match result {
            Ok(c) => c,
            Err(e) => {
                first_error.get_or_insert(e);
                continue;
            }
        };
        outcome.sent += c.sent;
        outcome.lost += c.lost;
        outcome.errors += c.errors;
        outcome.late_max = outcome.late_max.max(c.late_max);
        for (second, took) in c.results {
            outcome.samples.push(took);
            if second >= WARM_UP {
                outcome.steady.push(took);
            }
            if took > SLOW.as_micros() as u64 {
                outcome.slow[second as usize] += 1;
            }
            outcome.minutes[(second / 60) as usize].push(took);
            outcome.seconds[second as usize].push(took);
        }
        last = last.max(c.last_result);
    }
    outcome.generator_cpu = cpu_after.0.saturating_sub(cpu_before.0);
    outcome.broker_cpu = cpu_after.1.saturating_sub(cpu_before.1);
    outcome.helper_cpu = cpu_after.2.saturating_sub(cpu_before.2);
    if let Some(e) = first_error {
        return Err(e.context(format!("{side}: a device connection failed")));
    }
    outcome.course = sampler.await?;
    outcome.rate = outcome.samples.len() as f64 / (last - start).as_secs_f64().max(1e-6);
    Ok(outcome)
}

/// The mappers of [`run_load`]: connects and subscribes them, one after another, sends the
/// probe, tells `started` when the load starts and runs it, tells `answered` once every
/// connection is done, and only then disconnects them; each connection's outcome.
async fn mappers(
    port: u16,
    ids: Vec<String>,
    load: DeviceLoad,
    side: String,
    started: tokio::sync::oneshot::Sender<tokio::time::Instant>,
    answered: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<Vec<anyhow::Result<MapperOutcome>>> {
    let connecting = Instant::now();
    let mut connections = Vec::with_capacity(load.connections);
    for c in 0..load.connections {
        let own: Vec<(usize, String)> = (c..ids.len())
            .step_by(load.connections)
            .map(|j| (j, ids[j].clone()))
            .collect();
        let client_id = format!("mapper-{c}-{}", uuid::Uuid::new_v4().simple());
        let mapper = Mapper::connect(port, &client_id, own)
            .await
            .with_context(|| {
                format!(
                    "{side}: device connection {} of {} (after {c} connected)",
                    c + 1,
                    load.connections
                )
            })?;
        connections.push(mapper);
    }
    if load.connections >= 1_000 {
        eprintln!(
            "devices on {side}: {} connections connected and subscribed in {:.1} s",
            load.connections,
            connecting.elapsed().as_secs_f64()
        );
    }
    // One round trip first, outside the measurement: the path works end to end.
    connections[0]
        .probe()
        .await
        .with_context(|| format!("{side}: the probe report"))?;
    let start = tokio::time::Instant::now() + Duration::from_millis(100);
    let _ = started.send(start);
    let tasks: Vec<_> = connections
        .into_iter()
        .map(|mapper| tokio::spawn(mapper.run(start, load.seconds, ids.len(), GRACE)))
        .collect();
    let mut outcomes = Vec::with_capacity(tasks.len());
    let mut done = Vec::with_capacity(tasks.len());
    for task in tasks {
        match task.await.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok((outcome, mapper)) => {
                outcomes.push(Ok(outcome));
                done.push(mapper);
            }
            Err(e) => outcomes.push(Err(e)),
        }
    }
    // Only now do the devices leave: the last second's reports are not answered while
    // thousands of connections close around them (a load of its own, not this row's).
    let _ = answered.send(());
    for mapper in done {
        mapper.leave().await;
    }
    Ok(outcomes)
}

/// The processes a side's course follows: the broker (RSS and CPU) and the pass-through
/// responder beside it, if any (CPU).
#[derive(Clone, Copy)]
struct Watched {
    broker: u32,
    helper: Option<u32>,
}

/// A side's RSS and CPU time at the start of the load and at the end of each interval.
#[derive(Default)]
struct Course {
    interval: u64,
    /// (broker RSS KiB, broker CPU, helper CPU), the first at the start of the load.
    samples: Vec<(u64, Duration, Duration)>,
}

impl Course {
    /// Seconds per interval: 5 for runs of 30 s and more, else 1.
    fn interval(seconds: u64) -> u64 {
        if seconds >= 30 {
            5
        } else {
            1
        }
    }

    /// Samples `watched` at `start` and at the end of every interval of a load of `seconds`;
    /// stops early if a process is gone.
    async fn sample(start: tokio::time::Instant, seconds: u64, watched: Watched) -> Course {
        let interval = Course::interval(seconds);
        let mut samples = Vec::new();
        for k in 0..=seconds / interval {
            tokio::time::sleep_until(start + Duration::from_secs(k * interval)).await;
            let helper = match watched.helper {
                Some(pid) => cpu_of(pid),
                None => Ok(Duration::ZERO),
            };
            match (rss_of(watched.broker), cpu_of(watched.broker), helper) {
                (Ok(rss), Ok(cpu), Ok(helper)) => samples.push((rss, cpu, helper)),
                _ => break,
            }
        }
        Course { interval, samples }
    }
}

/// Appends `side`'s course to the devices CSV: per interval, the RSS at its end, CPU µs per
/// report scheduled in it (the broker's, the responder's), and p50 / p99 of those reports.
fn course_csv(csv: &mut String, side: &str, o: &Outcome, devices: usize) {
    let interval = o.course.interval;
    let reports = (devices as u64 * interval) as f64;
    for (k, pair) in o.course.samples.windows(2).enumerate() {
        let ((_, cpu0, helper0), (rss, cpu1, helper1)) = (pair[0], pair[1]);
        let from = k * interval as usize;
        let took: Vec<u64> = o
            .seconds
            .iter()
            .skip(from)
            .take(interval as usize)
            .flatten()
            .copied()
            .collect();
        let (p50, p99, _) = percentiles(&took);
        csv.push_str(&format!(
            "{side},{},{:.1},{:.0},{:.0},{p50},{p99}\n",
            from as u64 + interval,
            rss as f64 / 1024.0,
            (cpu1 - cpu0).as_secs_f64() * 1e6 / reports,
            (helper1 - helper0).as_secs_f64() * 1e6 / reports,
        ));
    }
}

/// The pass-through responder for mosquitto: this binary run as
/// `edgemeta-bench --device-responder PORT`, a process of its own so that its CPU is measured
/// apart from the load generator's. Stopped (killed) when dropped.
struct Responder(tokio::process::Child);

impl Responder {
    async fn start(port: u16) -> anyhow::Result<Responder> {
        let mut child = tokio::process::Command::new(std::env::current_exe()?)
            .arg("--device-responder")
            .arg(port.to_string())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("start the responder")?;
        let stdout = child.stdout.take().context("responder stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .context("responder not ready")??;
        if line.as_deref() != Some("ready") {
            bail!("responder: {line:?}");
        }
        Ok(Responder(child))
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.0.id().context("responder gone")
    }
}
