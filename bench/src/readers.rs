//! The readers rows (protocol §6.10): what a reader that crawls costs the others, and what
//! sessions that nobody reads hold in memory.
//!
//! - Crawl: one publisher offers 10,000 QoS 1 messages a second (100 bytes, `t/x/<n>`) for a
//!   while; two readers of `t/#` keep up. Runs alternate between no third reader and a third
//!   that reads 10 messages' worth of bytes a second off its socket (a plain socket at QoS 0,
//!   so it never stops for want of acknowledgements). The figure is how much later the two
//!   readers had everything with the crawler there, and that the crawler was cut off.
//! - Budget: 10,000 persistent sessions subscribe to a topic each and go away; then each is
//!   sent more than its queue holds. The node's RSS must stay within `broker.queues_bytes`
//!   beyond what the sessions cost with empty queues; what did not fit is dropped, counted
//!   (`EM-BROKER-QUEUE-FULL`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::BytesMut;
use rumqttc::mqttbytes::v4::{Connect, ConnectReturnCode, Disconnect, Packet, Subscribe};
use rumqttc::mqttbytes::QoS;
use rumqttc::{AsyncClient, Event, MqttOptions};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::{client, median, subscribe, verdict, Args, Row, Server, LAG_CUTS};

/// Messages a second the publisher offers in the crawl rows.
const RATE: usize = 10_000;
/// Bytes of each message's payload.
const PAYLOAD: usize = 100;
/// What the crawler reads each tenth of a second: about one message.
const CRAWL_BYTES: usize = PAYLOAD + 9;

pub async fn readers(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let (seconds, pairs) = if args.quick { (2, 1) } else { (20, 3) };
    let (mut alone, mut crawled) = (Vec::new(), Vec::new());
    let mut cut = 0;
    for _ in 0..pairs {
        alone.push(crawl_run(args, seconds, false).await?.0);
        let (took, was_cut) = crawl_run(args, seconds, true).await?;
        crawled.push(took);
        cut += usize::from(was_cut);
    }
    let (alone, crawled) = (median(alone), median(crawled));
    let ratio = crawled / alone;
    println!(
        "crawl: {seconds} s of {RATE}/s; both readers had all at {alone:.2} s alone, \
         {crawled:.2} s beside a crawler (medians of {pairs}); crawler cut off in {cut} of {pairs} runs"
    );
    rows.push(Row {
        name: format!("readers: {RATE} msg/s for {seconds} s, beside one reading 10/s"),
        edgemeta: format!("{crawled:.2} s vs {alone:.2} s alone (×{ratio:.3})"),
        mosquitto: "-".into(),
        target: "≤ ×1.10".into(),
        verdict: verdict(
            ratio <= 1.10,
            &format!("×{ratio:.3}, crawler cut in {cut} of {pairs}"),
        ),
    });
    budget(args, rows).await
}

/// One crawl run on a fresh node: seconds until both fast readers had every message, and
/// whether the crawler (if any) was cut off.
async fn crawl_run(args: &Args, seconds: usize, crawler: bool) -> anyhow::Result<(f64, bool)> {
    let dir = tempfile::tempdir()?;
    let node = Server::edgemeta(&args.edgemeta, dir.path()).await?;
    let total = seconds * RATE;
    let received = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for n in 0..2 {
        let (reader, mut rx) = client(node.port, &format!("fast{n}")).await?;
        subscribe(&reader, &mut rx, "t/#").await?;
        let received = received.clone();
        readers.push(tokio::spawn(async move {
            let _reader = reader;
            let mut got = 0;
            while got < total {
                match rx.recv().await {
                    Some((topic, _)) if topic.starts_with("t/") => got += 1,
                    Some(_) => {}
                    None => return Err(anyhow::anyhow!("a fast reader's connection ended")),
                }
            }
            received.fetch_add(1, Ordering::Relaxed);
            Ok(Instant::now())
        }));
    }
    let crawling = if crawler {
        Some(tokio::spawn(crawl(node.port)))
    } else {
        None
    };
    // Let the crawler connect and subscribe.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    publish_at_rate(node.port, total).await?;
    let mut last = start;
    for reader in readers {
        let done = tokio::time::timeout(Duration::from_secs(seconds as u64 * 5 + 30), reader)
            .await
            .context("the fast readers get every message")???;
        last = last.max(done);
    }
    if let Some(task) = crawling {
        task.abort();
    }
    // Stopping the node reads its log for cuts: the crawler's (it would take minutes to read
    // what its socket holds before it saw the close itself) is the point of the run, not a
    // bench subscriber falling behind.
    drop(node);
    let was_cut = crawler && LAG_CUTS.swap(0, Ordering::Relaxed) > 0;
    Ok((last.duration_since(start).as_secs_f64(), was_cut))
}

/// Publishes `total` QoS 1 messages on `t/x/<n>` on a schedule of [`RATE`] a second (catching
/// up after any wait), and returns once every one is acknowledged.
async fn publish_at_rate(port: u16, total: usize) -> anyhow::Result<()> {
    let mut options = MqttOptions::new(
        format!("rate-{}", uuid::Uuid::new_v4().simple()),
        "127.0.0.1",
        port,
    );
    options.set_inflight(1000);
    let (publisher, events) = AsyncClient::new(options, 1000);
    let acks = tokio::spawn(acked(events, total));
    let start = Instant::now();
    let payload = vec![b'r'; PAYLOAD];
    let mut sent = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while sent < total {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * RATE as f64) as usize).min(total);
        while sent < due {
            let topic = format!("t/x/{}", sent % 10);
            publisher
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload.clone())
                .await?;
            sent += 1;
        }
    }
    tokio::time::timeout(Duration::from_secs(120), acks)
        .await
        .context("every publish acknowledged")??
}

/// Drives a publisher's event loop until `total` PUBACKs came.
async fn acked(mut events: rumqttc::EventLoop, total: usize) -> anyhow::Result<()> {
    let mut acked = 0;
    while acked < total {
        match events.poll().await {
            Ok(Event::Incoming(rumqttc::Packet::PubAck(_))) => acked += 1,
            Ok(_) => {}
            Err(e) => bail!("publisher: {e}"),
        }
    }
    Ok(())
}

/// A reader of `t/#` at QoS 0 that takes about one message's bytes off its socket every
/// tenth of a second, until the node closes its connection (or the run ends).
async fn crawl(port: u16) -> anyhow::Result<()> {
    let mut stream = connected(port, "crawler", true).await?;
    let mut out = BytesMut::new();
    let mut subscribe = Subscribe::new("t/#", QoS::AtMostOnce);
    subscribe.pkid = 1;
    subscribe.write(&mut out)?;
    stream.write_all(&out).await?;
    let mut chunk = [0u8; CRAWL_BYTES];
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if stream.read(&mut chunk).await? == 0 {
            return Ok(());
        }
    }
}

/// A plain socket past its CONNACK (keep-alive off).
async fn connected(port: u16, id: &str, clean: bool) -> anyhow::Result<TcpStream> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut connect = Connect::new(id);
    connect.keep_alive = 0;
    connect.clean_session = clean;
    let mut out = BytesMut::new();
    connect.write(&mut out)?;
    stream.write_all(&out).await?;
    let mut buf = BytesMut::new();
    loop {
        match Packet::read(&mut buf, 1 << 20) {
            Ok(Packet::ConnAck(ack)) if ack.code == ConnectReturnCode::Success => {
                return Ok(stream)
            }
            Ok(other) => bail!("{other:?} instead of a CONNACK"),
            Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => {}
            Err(e) => bail!("{e}"),
        }
        if stream.read_buf(&mut buf).await? == 0 {
            bail!("closed before the CONNACK");
        }
    }
}

/// The budget row: 10,000 sessions away, each sent more than its queue holds.
async fn budget(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let sessions = if args.quick { 500 } else { 10_000 };
    let (queue, budget) = (64usize << 10, 64usize << 20);
    let dir = tempfile::tempdir()?;
    let broker = format!(
        "  queue_bytes: {queue}\n  queues_bytes: {budget}\n  max_away_sessions: {sessions}\n  max_connections: {}\n",
        sessions + 100
    );
    let node = Server::edgemeta_broker(&args.edgemeta, dir.path(), &broker, "").await?;
    let base = node.rss_kib()?;
    let ids: Vec<String> = (0..sessions)
        .map(|n| format!("away-{n}-{}", uuid::Uuid::new_v4().simple()))
        .collect();
    for batch in ids.chunks(100) {
        let mut joins = tokio::task::JoinSet::new();
        for id in batch {
            let (id, port) = (id.clone(), node.port);
            joins.spawn(async move { go_away(port, &id).await });
        }
        while let Some(joined) = joins.join_next().await {
            joined??;
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let empty = node.rss_kib()?;
    // Each session is sent 1.5 times its queue: 6 messages of 16 KiB.
    let per = 6;
    let mut options = MqttOptions::new("filler", "127.0.0.1", node.port);
    options.set_inflight(1000);
    options.set_max_packet_size(1 << 20, 1 << 20);
    let (filler, events) = AsyncClient::new(options, 1000);
    let acks = tokio::spawn(acked(events, ids.len() * per));
    let payload = vec![b'f'; 16 << 10];
    for round in 0..per {
        for id in &ids {
            let topic = format!("away/{id}/{round}");
            filler
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload.clone())
                .await?;
        }
    }
    tokio::time::timeout(Duration::from_secs(300), acks)
        .await
        .context("every fill acknowledged")???;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let full = node.rss_kib()?;
    // Counted in /metrics: the log line (`EM-BROKER-QUEUE-FULL`) comes at most every 10 s.
    let metrics = node.metrics().await?;
    let dropped = metrics
        .lines()
        .find_map(|line| line.strip_prefix("edgemeta_broker_away_dropped_total "))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .context("edgemeta_broker_away_dropped_total is not in /metrics")? as u64;
    drop(node);
    let grew_mib = (full.saturating_sub(empty)) as f64 / 1024.0;
    println!(
        "budget: RSS {:.1} MiB at start, {:.1} MiB with {sessions} sessions away, {:.1} MiB once \
         each was sent {} KiB (queue {} KiB, budget {} MiB, away sessions half of it); \
         {dropped} messages dropped (EM-BROKER-QUEUE-FULL)",
        base as f64 / 1024.0,
        empty as f64 / 1024.0,
        full as f64 / 1024.0,
        per * 16,
        queue >> 10,
        budget >> 20,
    );
    let within = grew_mib <= (budget >> 20) as f64;
    rows.push(Row {
        name: format!("{sessions} sessions away, each sent 1.5 queues"),
        edgemeta: format!("+{grew_mib:.1} MiB RSS, {dropped} dropped"),
        mosquitto: "-".into(),
        target: format!("≤ +{} MiB (queues_bytes)", budget >> 20),
        verdict: verdict(within && dropped > 0, &format!("+{grew_mib:.1} MiB")),
    });
    Ok(())
}

/// Connects a persistent session, subscribes it to its topic and leaves with a DISCONNECT.
async fn go_away(port: u16, id: &str) -> anyhow::Result<()> {
    let mut stream = connected(port, id, false).await?;
    let mut out = BytesMut::new();
    let mut subscribe = Subscribe::new(format!("away/{id}/+"), QoS::AtLeastOnce);
    subscribe.pkid = 1;
    subscribe.write(&mut out)?;
    stream.write_all(&out).await?;
    let mut buf = BytesMut::new();
    loop {
        match Packet::read(&mut buf, 1 << 20) {
            Ok(Packet::SubAck(_)) => break,
            Ok(other) => bail!("{other:?} instead of a SUBACK"),
            Err(rumqttc::mqttbytes::Error::InsufficientBytes(_)) => {}
            Err(e) => bail!("{e}"),
        }
        if stream.read_buf(&mut buf).await? == 0 {
            bail!("closed before the SUBACK");
        }
    }
    let mut out = BytesMut::new();
    Disconnect.write(&mut out)?;
    stream.write_all(&out).await?;
    Ok(())
}
