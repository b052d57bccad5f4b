//! The MetaServer rows (issue 22): the node's Kubernetes API over plain HTTP/1.1 on loopback.
//!
//! - list: `GET /api/v1/namespaces/list/pods` (JSON, what kube-rs asks for) with 10,000 pods
//!   stored, connect to last byte, 20 times;
//! - watch: 10 watches of one namespace open (`?watch=true`), one publisher paced at 1,000
//!   changes/s (inserts and updates of 1,000 pods) for 10 s; per event, publish (a timestamp in
//!   the object) → the event line read by each watcher: an upper bound of commit → event, as
//!   it includes the MQTT hop and the commit itself;
//! - the node's VmRSS with the 10 watches still open, after that run.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::http::get;
use super::{
    client, fill, median, paced_inserts, percentiles, rss_of, subscribe, verdict, Args, Row, Server,
};

const WATCHERS: usize = 10;

/// One watch: every event's publish → read latency (µs) goes to `samples`.
async fn watch(
    port: u16,
    path: String,
    epoch: Instant,
    samples: mpsc::UnboundedSender<u64>,
    ready: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    stream.set_nodelay(true)?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut lines = BufReader::new(stream).lines();
    // The head, up to its blank line.
    while let Some(line) = lines.next_line().await? {
        if line.is_empty() {
            break;
        }
    }
    let _ = ready.send(());
    // Chunked: size lines, then each event line (JSON), then an empty line.
    while let Some(line) = lines.next_line().await? {
        if !line.starts_with('{') {
            continue;
        }
        let now = epoch.elapsed().as_micros() as u64;
        let event: serde_json::Value = serde_json::from_str(&line)?;
        if let Some(sent) = event["object"]["t"].as_u64() {
            if samples.send(now.saturating_sub(sent)).is_err() {
                return Ok(());
            }
        }
    }
    Ok(())
}

pub async fn metaserver(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let server = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    let api = server.metaserver.context("the MetaServer's port")?;
    let (listed, rate, seconds) = if args.quick {
        (1_000, 1_000, 2)
    } else {
        (10_000, 1_000, 10)
    };

    fill(server.port, "list", listed).await?;
    let path = "/api/v1/namespaces/list/pods";
    let body = get(api, path).await?;
    let list: serde_json::Value = serde_json::from_slice(&body)?;
    let items = list["items"].as_array().map_or(0, Vec::len);
    if items != listed {
        bail!("listed {items} pods of {listed}");
    }
    let mut times = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        get(api, path).await?;
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    let p50 = median(times.clone());
    times.sort_by(f64::total_cmp);
    let worst = times.last().copied().unwrap_or_default();
    rows.push(Row {
        name: format!(
            "MetaServer list of {listed} pods (JSON, {} KB), p50 / max of 20 (ms)",
            body.len() / 1024
        ),
        edgemeta: format!("{p50:.1} / {worst:.1}"),
        mosquitto: "—".into(),
        target: "≤ 50 ms".into(),
        verdict: verdict(p50 <= 50.0, ""),
    });

    let epoch = Instant::now();
    let (samples_tx, mut samples) = mpsc::unbounded_channel();
    let mut watchers = Vec::new();
    for _ in 0..WATCHERS {
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        watchers.push(tokio::spawn(watch(
            api,
            "/api/v1/namespaces/lat/pods?watch=true".into(),
            epoch,
            samples_tx.clone(),
            ready_tx,
        )));
        ready.await.context("a watch did not start")?;
    }
    drop(samples_tx);
    // The same changes handed on to edged over MQTT (also after the commit): the machine's
    // baseline for publish → commit → delivery, without the MetaServer.
    let (edged, mut handed) = client(server.port, "msedged").await?;
    subscribe(&edged, &mut handed, "ke/edged/edgecontroller/insert/lat/#").await?;
    let mqtt = tokio::spawn(async move {
        let mut samples = Vec::new();
        while let Ok(Some((_, payload))) =
            tokio::time::timeout(Duration::from_secs(5), handed.recv()).await
        {
            let now = epoch.elapsed().as_micros() as u64;
            let body: serde_json::Value = serde_json::from_slice(&payload).unwrap_or_default();
            if let Some(sent) = body["content"]["t"].as_u64() {
                samples.push(now.saturating_sub(sent));
            }
        }
        samples
    });
    let (publisher, _) = client(server.port, "mspub").await?;
    let total = rate * seconds;
    let producer = paced_inserts(publisher, epoch, rate, total);
    let want = (total as usize) * WATCHERS;
    let mut latencies = Vec::with_capacity(want);
    while latencies.len() < want {
        let sample = tokio::time::timeout(Duration::from_secs(30), samples.recv())
            .await
            .context("the watches stalled")?
            .context("every watch ended")?;
        latencies.push(sample);
    }
    let rss = rss_of(server.child.id())?;
    producer.abort();
    for watcher in watchers {
        watcher.abort();
    }
    let p = percentiles(latencies);
    let handed = percentiles(mqtt.await?);
    rows.push(Row {
        name: format!("MetaServer publish → watch event at {rate} changes/s, {WATCHERS} watches, {seconds} s: p50 / p99 / p999 (µs)"),
        edgemeta: p.to_string(),
        mosquitto: "—".into(),
        target: "p99 ≤ 5 ms".into(),
        verdict: verdict(p.p99 <= 5_000, ""),
    });
    // The measure, taken inside the node: COMMIT returned → event written to a watch.
    let delay = event_delay(&server).await?;
    let [count, within_1ms, within_2_5ms, within_5ms] = delay;
    let share = |n: f64| if count > 0.0 { 100.0 * n / count } else { 0.0 };
    rows.push(Row {
        name: format!("MetaServer COMMIT → watch event, same run (edgemeta_metaserver_event_delay_seconds, {count:.0} events): within 1 / 2.5 / 5 ms (%)"),
        edgemeta: format!(
            "{:.2} / {:.2} / {:.2}",
            share(within_1ms),
            share(within_2_5ms),
            share(within_5ms)
        ),
        mosquitto: "—".into(),
        target: "p99 ≤ 5 ms".into(),
        verdict: verdict(count > 0.0 && share(within_5ms) >= 99.0, ""),
    });
    rows.push(Row {
        name: "the same changes handed on to an MQTT subscriber of ke/edged (same run, baseline): p50 / p99 / p999 (µs)".into(),
        edgemeta: handed.to_string(),
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    rows.push(Row {
        name: format!(
            "RSS with {WATCHERS} watches open (after that run, {listed} + 1000 pods stored)"
        ),
        edgemeta: format!("{:.1} MB", rss as f64 / 1024.0),
        mosquitto: "—".into(),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    Ok(())
}

/// The node's commit → watch event histogram: events, and those within 1, 2.5 and 5 ms.
async fn event_delay(node: &Server) -> anyhow::Result<[f64; 4]> {
    let text = node.metrics().await?;
    let value = |bound: &str| -> anyhow::Result<f64> {
        let prefix = match bound {
            "count" => "edgemeta_metaserver_event_delay_seconds_count ".to_owned(),
            le => format!("edgemeta_metaserver_event_delay_seconds_bucket{{le=\"{le}\"}} "),
        };
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .context("edgemeta_metaserver_event_delay_seconds is not in /metrics")?
            .trim()
            .parse()
            .context("a histogram value")
    };
    Ok([
        value("count")?,
        value("0.001")?,
        value("0.0025")?,
        value("0.005")?,
    ])
}
