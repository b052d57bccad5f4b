//! The per-stage budget: where the node's time goes per P1 insert and per twin report, from
//! the node's own stage clocks (`edgemeta_stage_nanoseconds_total`, `edgemeta_broker::stages`)
//! read before and after a load, beside the process's CPU time over the same load.

use std::collections::BTreeMap;

use anyhow::Context as _;

use super::devices::{self, DeviceLoad};
use super::{throughput, Args, Server, Sizes};

/// The stages in the order a message meets them, as `/metrics` names them.
const STAGES: [&str; 8] = [
    "decode", "route", "intake", "store", "commit", "hand_on", "encode", "write",
];

/// Nanoseconds per stage and the process's CPU time, at one moment.
struct Clocks {
    stages: BTreeMap<String, u64>,
    cpu: std::time::Duration,
}

async fn clocks(node: &Server) -> anyhow::Result<Clocks> {
    let text = node.metrics().await?;
    let mut stages = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("edgemeta_stage_nanoseconds_total{stage=\"") else {
            continue;
        };
        let (stage, value) = rest.split_once("\"}").context("a stage line")?;
        stages.insert(stage.to_owned(), value.trim().parse()?);
    }
    Ok(Clocks {
        stages,
        cpu: node.cpu()?,
    })
}

/// µs per message of each stage, the stages' sum and the process's CPU, between two readings.
fn budget(before: &Clocks, after: &Clocks, messages: usize) -> Vec<(String, f64)> {
    let per = |nanos: u64| nanos as f64 / 1_000.0 / messages as f64;
    let mut rows = Vec::new();
    let mut sum = 0;
    for stage in STAGES {
        let spent = after.stages.get(stage).copied().unwrap_or(0)
            - before.stages.get(stage).copied().unwrap_or(0);
        sum += spent;
        rows.push((stage.to_owned(), per(spent)));
    }
    let cpu = u64::try_from((after.cpu - before.cpu).as_nanos()).unwrap_or(u64::MAX);
    rows.push(("sum of the stages".into(), per(sum)));
    rows.push(("process CPU (all threads)".into(), per(cpu)));
    rows
}

/// Prints the budget of a P1 insert and of a twin report as a Markdown table.
pub async fn stages(args: &Args, sizes: &Sizes) -> anyhow::Result<()> {
    // The nodes started below inherit it: their stage clocks run (off by default).
    std::env::set_var("EDGEMETA_OBSERVE__STAGE_CLOCKS", "true");
    let dir = tempfile::tempdir()?;
    let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    // One round outside the measurement: tables, caches and connections warm.
    throughput(node.port, "ke/edged/#", sizes, "warm").await?;
    let before = clocks(&node).await?;
    let mut rates = Vec::new();
    for round in 0..args.rounds {
        rates.push(throughput(node.port, "ke/edged/#", sizes, &format!("st{round}")).await?);
    }
    let after = clocks(&node).await?;
    drop(node);
    let inserts = args.rounds * sizes.publishers * sizes.per_publisher;
    let p1 = budget(&before, &after, inserts);

    let load = DeviceLoad::new(args);
    let twin_dir = dir.path().join("devices");
    std::fs::create_dir(&twin_dir)?;
    let node = Server::edgemeta(&args.edgemeta, &twin_dir).await?;
    let ids = devices::ids(load);
    devices::add_devices(node.port, &ids).await?;
    let before = clocks(&node).await?;
    let reports = devices::offer(&node, &ids, load).await?;
    let after = clocks(&node).await?;
    drop(node);
    let twin = budget(&before, &after, reports);

    println!(
        "Per-stage budget, µs per message: P1 ({} rounds of {} inserts, {:.0} msg/s median) and a twin report ({} devices over {} connections, one report a second for {} s, {reports} reports)",
        args.rounds,
        sizes.publishers * sizes.per_publisher,
        super::median(rates),
        load.devices,
        load.connections,
        load.seconds,
    );
    println!();
    println!("| stage | P1 insert | twin report |");
    println!("|---|---|---|");
    for ((stage, insert), (_, report)) in p1.iter().zip(&twin) {
        println!("| {stage} | {insert:.1} | {report:.1} |");
    }
    Ok(())
}
