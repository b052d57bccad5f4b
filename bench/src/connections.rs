//! The connections row (issue 43): 10,000 MQTT 3.1.1 clients connect (keep-alive 60), each
//! subscribes to a topic of its own at QoS 1 and gets one message there from one publisher.
//! Connect rate, the broker's RSS per client and the delivery time, edgemeta beside mosquitto.
//!
//! The clients are plain sockets speaking through rumqttc's packet codecs: an event loop per
//! client would load the bench's two cores more than the brokers under test.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::BytesMut;
use rumqttc::mqttbytes::v4::{
    ConnectReturnCode, Packet, PingReq, PubAck, Publish, Subscribe, SubscribeReasonCode,
};
use rumqttc::mqttbytes::{Error as CodecError, QoS};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{free_port, rss_of, verdict, Args, Row, Server};

/// Connects (and subscribes) on their way at once. mosquitto listens with a backlog of 100;
/// more in flight would let SYNs be dropped and retried a second later, timing the retry.
const IN_FLIGHT: usize = 100;

/// The clients' keep-alive (s); a client silent for half of it pings before its next step.
const KEEP_ALIVE_S: u16 = 60;

/// Longest wait for one client's CONNACK or SUBACK, and for the next of all clients to finish a
/// step: past it the row fails.
const STEP: Duration = Duration::from_secs(30);

/// Pause before each RSS reading, so that what the broker allocates for the last clients is in.
const SETTLE: Duration = Duration::from_secs(1);

/// Publishes the publisher may have sent without a PUBACK.
const WINDOW: usize = 1_000;

/// Connections the brokers admit beyond the clients: the publisher and readiness probes.
const SPARE: usize = 16;

/// Largest packet the clients accept; the broker sends none near it.
const MAX_PACKET: usize = 1 << 16;

/// What one broker did under the load.
struct Figures {
    connect: Duration,
    subscribe: Duration,
    delivery: Duration,
    /// VmRSS (KiB) before any client, with every client connected, with every one subscribed.
    rss: (u64, u64, u64),
}

impl Figures {
    fn connect_rate(&self, n: usize) -> f64 {
        n as f64 / self.connect.as_secs_f64().max(1e-9)
    }

    /// KiB of RSS per client: connected and idle, and subscribed.
    fn per_client(&self, n: usize) -> (f64, f64) {
        let (before, connected, subscribed) = self.rss;
        let each = |after: u64| (after as f64 - before as f64) / n as f64;
        (each(connected), each(subscribed))
    }
}

pub async fn connections(args: &Args, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let n = args
        .connection_count
        .unwrap_or(if args.quick { 200 } else { 10_000 })
        .max(1);
    bench_files(n, "the connections row")?;
    let asked = n;
    let dir = tempfile::tempdir()?;
    let (side, n, em) = match (&args.connection_target, args.connection_pid) {
        (Some(address), Some(pid)) => (
            format!("{address}, pid {pid}"),
            n,
            measure(address, pid, n, address).await?,
        ),
        _ => {
            // The node raises its soft open-files limit to the hard one and admits only the
            // clients that carries (src/limits.rs); a host whose hard limit is too low for `n`
            // gets the row at the count the node admits, for both brokers alike.
            let node = Server::edgemeta_broker(
                &args.edgemeta,
                dir.path(),
                &format!("  max_connections: {}\n", n + SPARE),
                "",
            )
            .await?;
            let n = match admitted(&node)? {
                Some(admitted) if admitted < n + SPARE => {
                    let fits = admitted.saturating_sub(SPARE).max(1);
                    eprintln!("connections: edgemeta's open-files limit carries {admitted} clients, not {}: the row runs {fits} clients against both brokers (raise `ulimit -Hn` for {n})", n + SPARE);
                    fits
                }
                _ => n,
            };
            let address = format!("127.0.0.1:{}", node.port);
            let figures = measure(&address, node.pid(), n, "edgemeta").await?;
            drop(node);
            ("edgemeta".to_owned(), n, figures)
        }
    };
    let files = (n + 1_024) as u64;
    child_files(files, "mosquitto")?;
    let mosquitto = Server::mosquitto_limited(
        &args.mosquitto,
        dir.path(),
        "mosquitto",
        free_port()?,
        "max_connections -1\n",
        Some(files),
    )
    .await?;
    let address = format!("127.0.0.1:{}", mosquitto.port);
    let mq = measure(&address, mosquitto.pid(), n, "mosquitto").await?;
    drop(mosquitto);

    // With another broker in edgemeta's column, the row names it.
    let mut of = if side == "edgemeta" {
        String::new()
    } else {
        format!(" [edgemeta column: {side}]")
    };
    if n < asked {
        of.push_str(&format!(
            " [{n} of {}: all the node's open-files limit carries]",
            super::count(asked)
        ));
    }
    let count = super::count(n);
    let mb = |kib: u64| kib as f64 / 1024.0;
    let ratio = em.connect_rate(n) / mq.connect_rate(n);
    rows.push(Row {
        name: format!(
            "connections{of}: {count} MQTT 3.1.1 clients connect (keep-alive 60, {IN_FLIGHT} at a time): all CONNACKed (s) / connects/s"
        ),
        edgemeta: format!("{:.2} / {:.0}", em.connect.as_secs_f64(), em.connect_rate(n)),
        mosquitto: format!("{:.2} / {:.0}", mq.connect.as_secs_f64(), mq.connect_rate(n)),
        target: "rate ≥ 0.8 × mosquitto's".into(),
        verdict: verdict(ratio >= 0.8, &format!("ratio {ratio:.2}")),
    });
    let rss = |f: &Figures| {
        format!(
            "{:.1} MB / {:.1} MB / {:.1} MB",
            mb(f.rss.0),
            mb(f.rss.1),
            mb(f.rss.2)
        )
    };
    rows.push(Row {
        name: format!(
            "connections{of}: broker RSS before any client / {count} connected / {count} subscribed (one QoS 1 topic each)"
        ),
        edgemeta: rss(&em),
        mosquitto: rss(&mq),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    let (em_idle, em_subscribed) = em.per_client(n);
    let (mq_idle, mq_subscribed) = mq.per_client(n);
    rows.push(Row {
        name: format!(
            "connections{of}: KB of RSS per client, connected idle / subscribed ({count} clients)"
        ),
        edgemeta: format!("{em_idle:.1} / {em_subscribed:.1}"),
        mosquitto: format!("{mq_idle:.1} / {mq_subscribed:.1}"),
        target: "≤ 8 idle, ≤ 10 subscribed".into(),
        verdict: verdict(em_idle <= 8.0 && em_subscribed <= 10.0, ""),
    });
    rows.push(Row {
        name: format!(
            "connections{of}: all {count} subscribed (s) / one publisher, a QoS 1 message to each: first publish → last receipt (s)"
        ),
        edgemeta: format!(
            "{:.2} / {:.2}",
            em.subscribe.as_secs_f64(),
            em.delivery.as_secs_f64()
        ),
        mosquitto: format!(
            "{:.2} / {:.2}",
            mq.subscribe.as_secs_f64(),
            mq.delivery.as_secs_f64()
        ),
        target: "(diagnostic)".into(),
        verdict: "—".into(),
    });
    Ok(())
}

/// Runs the load against the broker at `address` (process `pid`, named `who` in errors).
async fn measure(address: &str, pid: u32, n: usize, who: &str) -> anyhow::Result<Figures> {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let tag = tag.get(..8).unwrap_or(&tag).to_owned();
    tokio::time::sleep(SETTLE).await;
    let before = rss_of(pid)?;

    let gate = Arc::new(Semaphore::new(IN_FLIGHT));
    let overflows = listen_overflows();
    let started = Instant::now();
    let mut set = JoinSet::new();
    for i in 0..n {
        let (gate, address) = (gate.clone(), address.to_owned());
        let topic = format!("bench/conn/{tag}/{i}");
        let id = format!("conn-{tag}-{i}");
        set.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            tokio::time::timeout(STEP, Client::connect(&address, &id, topic))
                .await
                .context("no CONNACK within 30 s")?
        });
    }
    let clients = gather(set, who, "connect").await?;
    let connect = started.elapsed();
    if let (Some(before), Some(after)) = (overflows, listen_overflows()) {
        if after > before {
            eprintln!(
                "connections: {} SYNs dropped for a full listen backlog during {who}'s connects (this host's count, other programs' included): some connects waited for a retransmit",
                after - before
            );
        }
    }
    tokio::time::sleep(SETTLE).await;
    let connected = rss_of(pid)?;

    let started = Instant::now();
    let mut set = JoinSet::new();
    for client in clients {
        let gate = gate.clone();
        set.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            tokio::time::timeout(STEP, client.subscribe())
                .await
                .context("no SUBACK within 30 s")?
        });
    }
    let clients = gather(set, who, "subscribe").await?;
    let subscribe = started.elapsed();
    tokio::time::sleep(SETTLE).await;
    let subscribed = rss_of(pid)?;

    let delivery = deliver(address, clients, who, &tag).await?;
    Ok(Figures {
        connect,
        subscribe,
        delivery,
        rss: (before, connected, subscribed),
    })
}

/// One QoS 1 message to each client's topic from one publisher: the time from the first publish
/// to the last receipt. Fails unless every client got its message and the publisher every PUBACK.
async fn deliver(
    address: &str,
    clients: Vec<Client>,
    who: &str,
    tag: &str,
) -> anyhow::Result<Duration> {
    let n = clients.len();
    let topics: Vec<String> = clients.iter().map(|c| c.topic.clone()).collect();
    let mut receivers = JoinSet::new();
    for client in clients {
        receivers.spawn(client.receive());
    }
    let publisher = tokio::time::timeout(
        STEP,
        Client::connect(address, &format!("conn-{tag}-pub"), String::new()),
    )
    .await
    .with_context(|| format!("{who}: the publisher got no CONNACK within 30 s"))??;
    let (mut read, mut write) = publisher.stream.into_split();
    let mut inbox = publisher.buf;
    let window = Arc::new(Semaphore::new(WINDOW));
    let acks = {
        let window = window.clone();
        tokio::spawn(async move {
            for _ in 0..n {
                match read_packet(&mut read, &mut inbox).await? {
                    Packet::PubAck(_) => window.add_permits(1),
                    Packet::PingResp => {}
                    other => bail!("{other:?} instead of a PUBACK"),
                }
            }
            Ok(())
        })
    };
    let first = Instant::now();
    let mut out = BytesMut::new();
    for (i, topic) in topics.iter().enumerate() {
        window.acquire().await?.forget();
        let mut publish = Publish::new(topic.as_str(), QoS::AtLeastOnce, format!("m{i}"));
        // Packet ids 1..=65535 in turn; the window keeps far fewer than that outstanding.
        publish.pkid = (i % 65_535 + 1) as u16;
        out.clear();
        publish.write(&mut out)?;
        write
            .write_all(&out)
            .await
            .with_context(|| format!("{who}: publisher"))?;
    }
    let received = gather(receivers, who, "receive its message").await?;
    let last = received
        .iter()
        .map(|(at, _)| *at)
        .max()
        .context("no client")?;
    tokio::time::timeout(STEP, acks)
        .await
        .with_context(|| format!("{who}: the publisher's PUBACKs stalled"))?
        .context("PUBACK reader")?
        .with_context(|| format!("{who}: publisher"))?;
    Ok(last.saturating_duration_since(first))
}

/// Waits for every task of `set`, the next never more than [`STEP`] after the last; fails naming
/// how many of the clients could not `what` and the first reason.
async fn gather<T: 'static>(
    mut set: JoinSet<anyhow::Result<T>>,
    who: &str,
    what: &str,
) -> anyhow::Result<Vec<T>> {
    let total = set.len();
    let mut done = Vec::with_capacity(total);
    let mut failed = 0;
    let mut first: Option<anyhow::Error> = None;
    loop {
        let Ok(next) = tokio::time::timeout(STEP, set.join_next()).await else {
            bail!(
                "{who}: {} of {total} clients could {what}, none more for {} s ({failed} failed)",
                done.len(),
                STEP.as_secs()
            );
        };
        let Some(joined) = next else { break };
        match joined.map_err(anyhow::Error::from).and_then(|r| r) {
            Ok(t) => done.push(t),
            Err(e) => {
                failed += 1;
                first.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first {
        bail!("{who}: {failed} of {total} clients could not {what}; the first: {e:#}");
    }
    Ok(done)
}

/// One client's connection.
struct Client {
    stream: TcpStream,
    /// Bytes read and not yet parsed.
    buf: BytesMut,
    /// The client's own topic.
    topic: String,
    /// When the client last sent a packet, for its keep-alive.
    sent: Instant,
}

impl Client {
    /// Connects with a clean session and waits for a CONNACK that accepts it.
    async fn connect(address: &str, id: &str, topic: String) -> anyhow::Result<Client> {
        let stream = TcpStream::connect(address).await.context("TCP connect")?;
        stream.set_nodelay(true)?;
        let mut client = Client {
            stream,
            buf: BytesMut::with_capacity(64),
            topic,
            sent: Instant::now(),
        };
        let mut connect = rumqttc::mqttbytes::v4::Connect::new(id);
        connect.keep_alive = KEEP_ALIVE_S;
        let mut out = BytesMut::new();
        connect.write(&mut out)?;
        client.send(&out).await?;
        match client.next().await? {
            Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => Ok(client),
            Packet::ConnAck(ack) => bail!("refused: {:?}", ack.code),
            other => bail!("{other:?} before the CONNACK"),
        }
    }

    /// Subscribes to the client's topic at QoS 1 and waits for a SUBACK granting QoS 1.
    async fn subscribe(mut self) -> anyhow::Result<Client> {
        let mut out = self.ping_if_due()?;
        let mut subscribe = Subscribe::new(self.topic.as_str(), QoS::AtLeastOnce);
        subscribe.pkid = 1;
        subscribe.write(&mut out)?;
        self.send(&out).await?;
        loop {
            match self.next().await? {
                Packet::SubAck(ack)
                    if ack.return_codes == [SubscribeReasonCode::Success(QoS::AtLeastOnce)] =>
                {
                    return Ok(self)
                }
                Packet::SubAck(ack) => bail!("SUBACK {:?}", ack.return_codes),
                Packet::PingResp => {}
                other => bail!("{other:?} before the SUBACK"),
            }
        }
    }

    /// Waits for the message on the client's topic and acknowledges it; returns when it was
    /// read, and the client, kept connected until every client has its message.
    async fn receive(mut self) -> anyhow::Result<(Instant, Client)> {
        let out = self.ping_if_due()?;
        if !out.is_empty() {
            self.send(&out).await?;
        }
        loop {
            match self.next().await? {
                Packet::Publish(p) if p.topic == self.topic => {
                    let at = Instant::now();
                    if p.qos == QoS::AtLeastOnce {
                        let mut out = BytesMut::new();
                        PubAck::new(p.pkid).write(&mut out)?;
                        self.send(&out).await?;
                    }
                    return Ok((at, self));
                }
                Packet::Publish(p) => bail!("a message on {} for {}", p.topic, self.topic),
                Packet::PingResp => {}
                other => bail!("{other:?} instead of the message"),
            }
        }
    }

    /// A PINGREQ when the client has been silent for half its keep-alive, else nothing.
    fn ping_if_due(&self) -> anyhow::Result<BytesMut> {
        let mut out = BytesMut::new();
        if self.sent.elapsed() > Duration::from_secs(u64::from(KEEP_ALIVE_S / 2)) {
            PingReq.write(&mut out)?;
        }
        Ok(out)
    }

    async fn send(&mut self, bytes: &[u8]) -> anyhow::Result<()> {
        self.stream.write_all(bytes).await?;
        self.sent = Instant::now();
        Ok(())
    }

    async fn next(&mut self) -> anyhow::Result<Packet> {
        read_packet(&mut self.stream, &mut self.buf).await
    }
}

/// The next packet from `stream`, with `buf` holding what was read beyond the last one.
pub(super) async fn read_packet<R: AsyncRead + Unpin>(
    stream: &mut R,
    buf: &mut BytesMut,
) -> anyhow::Result<Packet> {
    loop {
        match Packet::read(buf, MAX_PACKET) {
            Ok(packet) => return Ok(packet),
            Err(CodecError::InsufficientBytes(_)) => {}
            Err(e) => bail!("malformed packet from the broker: {e}"),
        }
        if stream.read_buf(buf).await? == 0 {
            bail!("the broker closed the connection");
        }
    }
}

/// Fails unless this process may open a socket for each of `n` clients and some more; `row`
/// names who needs them.
pub(super) fn bench_files(n: usize, row: &str) -> anyhow::Result<()> {
    let limits = std::fs::read_to_string("/proc/self/limits")?;
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|rest| rest.split_whitespace().next())
        .context("open-files limit in /proc/self/limits")?;
    let needed = (n + 256) as u64;
    if soft != "unlimited" && soft.parse::<u64>()? < needed {
        bail!("{row} opens {n} sockets: raise `ulimit -n` to at least {needed} (it is {soft}; scripts/bench raises it to the hard limit)");
    }
    Ok(())
}

/// Fails unless a child may be given `files` open files (beyond the hard limit only with
/// CAP_SYS_RESOURCE).
fn child_files(files: u64, who: &str) -> anyhow::Result<()> {
    let ok = std::process::Command::new("bash")
        .arg("-c")
        .arg(r#"ulimit -n "$1""#)
        .arg("bash")
        .arg(files.to_string())
        .stderr(std::process::Stdio::null())
        .status()
        .context("bash")?
        .success();
    if !ok {
        bail!("the connections row runs {who} with {files} open files, above this shell's hard limit (`ulimit -Hn`): raise the hard limit, or run with CAP_SYS_RESOURCE");
    }
    Ok(())
}

/// The clients the node says it admits when its open-files limit carries fewer than configured
/// (its EM-BROKER-FD-LIMIT warning, `admitted=N`); `None` when it admits all.
fn admitted(node: &Server) -> anyhow::Result<Option<usize>> {
    let Some((path, start)) = &node.log else {
        return Ok(None);
    };
    let log = std::fs::read(path)?;
    let ours = String::from_utf8_lossy(log.get(usize::try_from(*start)?..).unwrap_or_default())
        .into_owned();
    let Some(line) = ours
        .lines()
        .find(|l| l.contains("EM-BROKER-FD-LIMIT") && l.contains("admitted="))
    else {
        return Ok(None);
    };
    let value = line
        .split_once("admitted=")
        .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next())
        .with_context(|| format!("no admitted= in the node's line: {line}"))?;
    Ok(Some(value.parse()?))
}

/// The host's count of SYNs dropped for a full listen queue (`TcpExt: ListenOverflows`).
fn listen_overflows() -> Option<u64> {
    let netstat = std::fs::read_to_string("/proc/net/netstat").ok()?;
    let mut tcp_ext = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (tcp_ext.next()?, tcp_ext.next()?);
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "ListenOverflows")
        .and_then(|(_, value)| value.parse().ok())
}
