//! The burst row (flow control, protocol §6.10): an open-loop burst of QoS 1 inserts from four
//! publishers as fast as they go, with a QoS 1 and a QoS 0 reader of everything handed on. Each
//! reader must get every message once; the node must cut nobody off and stay within its memory.
//! mosquitto passes the same load through (`ke/meta/#`) in the same run, runs alternating.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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
    /// Every [`SAMPLE`] from the start of the burst.
    course: Vec<Sample>,
}

/// The course of a run, sampled this often.
const SAMPLE: Duration = Duration::from_millis(100);

/// One sample of a run's course.
#[derive(Clone, Copy)]
struct Sample {
    /// Since the burst started.
    ms: u64,
    rss_kib: u64,
    /// Distinct messages the QoS 1 and the QoS 0 reader have received so far.
    received: (usize, usize),
}

pub async fn burst(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let (total, runs) = sizes(args);
    let (mut em, mut mq) = (Vec::new(), Vec::new());
    let mut csv = String::from("system,run,t_ms,rss_mb,qos1_received,qos0_received\n");
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
        course(&mut csv, "edgemeta", run, &result);
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
        course(&mut csv, "mosquitto", run, &result);
        mq.push(result);
    }
    if let Some(path) = &args.burst_csv {
        std::fs::write(path, &csv)?;
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

/// Appends one run's course to the CSV.
fn course(csv: &mut String, system: &str, run: usize, result: &Run) {
    for s in &result.course {
        csv.push_str(&format!(
            "{system},{run},{},{:.1},{},{}\n",
            s.ms,
            s.rss_kib as f64 / 1024.0,
            s.received.0,
            s.received.1
        ));
    }
}

/// One burst of `total` inserts into `server`, read on `watch` at QoS 1 and QoS 0.
async fn one(server: &Server, watch: &str, total: usize, ns: &str) -> anyhow::Result<Run> {
    let (reliable, mut reliable_rx) = client(server.port, "burst-q1").await?;
    subscribe_at(&reliable, &mut reliable_rx, watch, QoS::AtLeastOnce).await?;
    let (quick, mut quick_rx) = client(server.port, "burst-q0").await?;
    subscribe_at(&quick, &mut quick_rx, watch, QoS::AtMostOnce).await?;
    let received = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
    let course = Arc::new(Mutex::new(Vec::new()));
    let started = Instant::now();
    let sampler = tokio::spawn({
        let (received, course) = (received.clone(), course.clone());
        let pid = server.pid();
        async move {
            while let Ok(rss_kib) = rss_of(pid) {
                let sample = Sample {
                    ms: started.elapsed().as_millis() as u64,
                    rss_kib,
                    received: (
                        received.0.load(Ordering::Relaxed),
                        received.1.load(Ordering::Relaxed),
                    ),
                };
                course.lock().expect("course").push(sample);
                tokio::time::sleep(SAMPLE).await;
            }
        }
    });
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
        read_all(&mut reliable_rx, total, &received.0),
        read_all(&mut quick_rx, total, &received.1)
    );
    let elapsed = started.elapsed();
    sampler.abort();
    // The course ends where the readers did.
    if let Ok(rss_kib) = rss_of(server.pid()) {
        course.lock().expect("course").push(Sample {
            ms: elapsed.as_millis() as u64,
            rss_kib,
            received: (a, b),
        });
    }
    for publisher in publishers {
        let (client, _acks) = publisher.await.context("publisher")?;
        let _ = client.disconnect().await;
    }
    let complete = a == total && b == total;
    if !complete {
        eprintln!("burst: QoS 1 reader got {a} of {total}, QoS 0 reader {b}");
    }
    let mut course = std::mem::take(&mut *course.lock().expect("course"));
    // The sampler may have taken one more sample after the readers' last.
    course.sort_by_key(|s| s.ms);
    Ok(Run {
        rate: total as f64 / elapsed.as_secs_f64(),
        complete,
        peak_rss_kib: course.iter().map(|s| s.rss_kib).max().unwrap_or(0),
        course,
    })
}

/// Distinct resources received until `total` or 30 s of silence; a repeat is not counted.
/// `so_far` follows the count, for the sampler.
async fn read_all(rx: &mut Inbox, total: usize, so_far: &AtomicUsize) -> usize {
    let mut seen = HashSet::with_capacity(total);
    while seen.len() < total {
        match tokio::time::timeout(Duration::from_secs(30), rx.recv()).await {
            Ok(Some((topic, payload))) if topic != PUBACK && topic != SUBACK => {
                seen.insert(resource_of(&payload));
                so_far.store(seen.len(), Ordering::Relaxed);
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
