//! The burst row (flow control, protocol §6.10): an open-loop burst of QoS 1 inserts from four
//! publishers as fast as they go, with a QoS 1 and a QoS 0 reader of everything handed on. Each
//! reader must get every message once; the node must cut nobody off and stay within its memory.
//! mosquitto passes the same load through (`ke/meta/#`) in the same run, runs alternating.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rumqttc::QoS;

use super::{
    client, insert, median, rss_of, subscribe_at, Args, Inbox, Row, Server, PUBACK, SUBACK,
};

/// Inserts per run and runs per system (`--quick`: 4 × 2,500, two runs).
fn sizes(args: &Args) -> (usize, usize) {
    if args.quick {
        (10_000, 2)
    } else {
        (
            args.burst_total.unwrap_or(200_000),
            args.burst_runs.unwrap_or(10),
        )
    }
}

/// What one run saw.
struct Run {
    rate: f64,
    complete: bool,
    peak_rss_kib: u64,
}

pub async fn burst(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let (total, runs) = sizes(args);
    let (mut em, mut mq) = (Vec::new(), Vec::new());
    for run in 0..runs {
        // A fresh process per run: its memory is measured from its start.
        let dir = tempfile::tempdir()?;
        let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
        let result = one(&node, "ke/edged/#", total, &format!("b{run}")).await?;
        eprintln!(
            "burst run {run}: edgemeta {:.0} msg/s, complete {}, peak RSS {:.1} MB",
            result.rate,
            result.complete,
            result.peak_rss_kib as f64 / 1024.0
        );
        em.push(result);
        drop(node);
        let mosquitto = Server::mosquitto(&args.mosquitto, dir.path()).await?;
        let result = one(&mosquitto, "ke/meta/#", total, &format!("b{run}")).await?;
        eprintln!(
            "burst run {run}: mosquitto {:.0} msg/s, complete {}, peak RSS {:.1} MB",
            result.rate,
            result.complete,
            result.peak_rss_kib as f64 / 1024.0
        );
        mq.push(result);
    }
    let summary = |runs: &[Run]| {
        let complete = runs.iter().filter(|r| r.complete).count();
        let rate = median(runs.iter().map(|r| r.rate).collect());
        let peak = runs.iter().map(|r| r.peak_rss_kib).max().unwrap_or(0);
        (complete, rate, peak)
    };
    let (em_complete, em_rate, em_peak) = summary(&em);
    let (mq_complete, mq_rate, mq_peak) = summary(&mq);
    let met = em_complete == runs && em_peak <= 60 * 1024;
    rows.push(Row {
        name: format!(
            "B1 open-loop burst (window 0): 4 publishers × {} QoS 1 inserts, a QoS 1 and a QoS 0 reader: runs where both got all / delivered msg/s (median) / peak RSS",
            total / 4
        ),
        edgemeta: format!(
            "{em_complete} of {runs} / {em_rate:.0} / {:.1} MB",
            em_peak as f64 / 1024.0
        ),
        mosquitto: format!(
            "{mq_complete} of {runs} / {mq_rate:.0} / {:.1} MB",
            mq_peak as f64 / 1024.0
        ),
        target: "all runs, nobody cut off, RSS ≤ 60 MB".into(),
        verdict: super::verdict(met, &format!("ratio {:.2}", em_rate / mq_rate)),
    });
    Ok(())
}

/// One burst of `total` inserts into `server`, read on `watch` at QoS 1 and QoS 0.
async fn one(server: &Server, watch: &str, total: usize, ns: &str) -> anyhow::Result<Run> {
    let (reliable, mut reliable_rx) = client(server.port, "burst-q1").await?;
    subscribe_at(&reliable, &mut reliable_rx, watch, QoS::AtLeastOnce).await?;
    let (quick, mut quick_rx) = client(server.port, "burst-q0").await?;
    subscribe_at(&quick, &mut quick_rx, watch, QoS::AtMostOnce).await?;
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = tokio::spawn({
        let peak = peak.clone();
        let pid = server.pid();
        async move {
            while let Ok(rss) = rss_of(pid) {
                peak.fetch_max(rss, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    let started = Instant::now();
    let mut publishers = Vec::new();
    for p in 0..4 {
        let (publisher, acks) = client(server.port, "burst-pub").await?;
        let per = total / 4;
        let ns = ns.to_owned();
        publishers.push(tokio::spawn(async move {
            let topic = format!("ke/meta/edgecontroller/insert/{ns}/pod");
            for i in 0..per {
                let resource = format!("{ns}/pod/p{p}-{i}");
                if publisher
                    .publish(&topic, QoS::AtLeastOnce, false, insert(&resource, 0))
                    .await
                    .is_err()
                {
                    break;
                }
            }
            // Keep the connection until every PUBACK is in.
            (publisher, acks)
        }));
    }
    let (a, b) = tokio::join!(
        read_all(&mut reliable_rx, total),
        read_all(&mut quick_rx, total)
    );
    let elapsed = started.elapsed();
    sampler.abort();
    for publisher in publishers {
        let (client, _acks) = publisher.await.context("publisher")?;
        let _ = client.disconnect().await;
    }
    let complete = a == total && b == total;
    if !complete {
        eprintln!("burst: QoS 1 reader got {a} of {total}, QoS 0 reader {b}");
    }
    Ok(Run {
        rate: total as f64 / elapsed.as_secs_f64(),
        complete,
        peak_rss_kib: peak.load(Ordering::Relaxed),
    })
}

/// Distinct resources received until `total` or 30 s of silence; a repeat is not counted.
async fn read_all(rx: &mut Inbox, total: usize) -> usize {
    let mut seen = HashSet::with_capacity(total);
    while seen.len() < total {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some((topic, payload))) if topic != PUBACK && topic != SUBACK => {
                seen.insert(resource_of(&payload));
            }
            Ok(Some(_)) => {}
            _ => break,
        }
    }
    seen.len()
}

/// `route.resource` of an envelope, found without parsing the rest.
fn resource_of(payload: &[u8]) -> String {
    let text = String::from_utf8_lossy(payload);
    let key = "\"resource\":\"";
    text.find(key)
        .and_then(|at| {
            let rest = &text[at + key.len()..];
            rest.find('"').map(|end| rest[..end].to_owned())
        })
        .unwrap_or_default()
}
