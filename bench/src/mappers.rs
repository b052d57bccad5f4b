//! The devices row's load generator and mosquitto's pass-through responder: plain sockets
//! speaking MQTT 3.1.1, one task per connection. Packets are read with rumqttc's codecs; the
//! reports and results are encoded in place into buffers each connection reuses, so that
//! 10,000 connections cost the bench far less than the broker it measures.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use bytes::BytesMut;
use rumqttc::mqttbytes::v4::{
    ConnectReturnCode, Packet, PingReq, Subscribe, SubscribeFilter, SubscribeReasonCode,
};
use rumqttc::mqttbytes::{Error as CodecError, QoS};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::connections::read_packet;
use super::schedule::report_value;

/// Largest packet a connection accepts; results are a few hundred bytes.
const MAX_PACKET: usize = 1 << 16;

/// The connections' keep-alive (s): a connection silent for half of it pings before the load.
const KEEP_ALIVE_S: u16 = 60;

/// Longest wait for a CONNACK, a SUBACK or the probe's result.
const STEP: Duration = Duration::from_secs(10);

/// One simulated mapper's connection, serving `devices` (index in the run, id).
pub(super) struct Mapper {
    stream: TcpStream,
    /// Bytes read and not yet parsed.
    buf: BytesMut,
    /// Packets to write, encoded in place.
    out: Vec<u8>,
    /// A report's payload, before its PUBLISH header is known.
    payload: Vec<u8>,
    pkid: u16,
    /// When the connection last sent a packet, for its keep-alive.
    sent: Instant,
    devices: Vec<Device>,
}

struct Device {
    /// Index of the device in the run (its place in each second).
    j: usize,
    id: String,
    update: String,
    result: String,
}

/// What one connection saw during the load.
pub(super) struct MapperOutcome {
    /// (second of the run the report was scheduled in, report → result µs) of each result.
    pub results: Vec<(u64, u64)>,
    pub sent: usize,
    /// Reports not answered within the grace period after the last publish.
    pub lost: usize,
    /// Error results (a `"code"` in the payload).
    pub errors: usize,
    /// Largest delay of a publish behind its schedule, µs.
    pub late_max: u64,
    pub last_result: tokio::time::Instant,
}

impl Mapper {
    /// Connects with a clean session, subscribes to its devices' result topics at QoS 1 and
    /// waits for a SUBACK granting each.
    pub async fn connect(
        port: u16,
        client_id: &str,
        devices: Vec<(usize, String)>,
    ) -> anyhow::Result<Mapper> {
        let stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .context("TCP connect")?;
        stream.set_nodelay(true)?;
        let devices: Vec<Device> = devices
            .into_iter()
            .map(|(j, id)| Device {
                j,
                update: format!("$hw/events/device/{id}/twin/update"),
                result: format!("$hw/events/device/{id}/twin/update/result"),
                id,
            })
            .collect();
        let mut mapper = Mapper {
            stream,
            buf: BytesMut::with_capacity(512),
            out: Vec::with_capacity(512),
            payload: Vec::with_capacity(256),
            pkid: 0,
            sent: Instant::now(),
            devices,
        };
        let mut connect = rumqttc::mqttbytes::v4::Connect::new(client_id);
        connect.keep_alive = KEEP_ALIVE_S;
        let mut out = BytesMut::new();
        connect.write(&mut out)?;
        mapper.stream.write_all(&out).await?;
        // The SUBSCRIBE after the CONNACK, as rumqttc and paho send it: the node leaves a
        // packet that arrives with the CONNECT unread until the client sends again.
        match tokio::time::timeout(STEP, mapper.next())
            .await
            .context("no CONNACK within 10 s")??
        {
            Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => {}
            Packet::ConnAck(ack) => bail!("CONNECT refused: {:?}", ack.code),
            other => bail!("{other:?} before the CONNACK"),
        }
        let filters = mapper
            .devices
            .iter()
            .map(|d| SubscribeFilter::new(d.result.clone(), QoS::AtLeastOnce));
        let mut subscribe = Subscribe::new_many(filters);
        subscribe.pkid = 1;
        out.clear();
        subscribe.write(&mut out)?;
        mapper.stream.write_all(&out).await?;
        match tokio::time::timeout(STEP, mapper.next())
            .await
            .context("no SUBACK within 10 s")??
        {
            Packet::SubAck(ack)
                if ack
                    .return_codes
                    .iter()
                    .all(|c| *c == SubscribeReasonCode::Success(QoS::AtLeastOnce)) => {}
            Packet::SubAck(ack) => bail!("SUBACK {:?}", ack.return_codes),
            other => bail!("{other:?} before the SUBACK"),
        }
        Ok(mapper)
    }

    /// One report of the first device and its result, outside the measurement: the path
    /// works end to end. An error result fails it.
    pub async fn probe(&mut self) -> anyhow::Result<()> {
        let event_id = format!("{}-probe", self.devices[0].id);
        self.report(0, &event_id, self.devices[0].j)?;
        self.flush().await?;
        let started = Instant::now();
        loop {
            let left = STEP.saturating_sub(started.elapsed());
            let packet = tokio::time::timeout(left, self.next())
                .await
                .with_context(|| format!("no {} within 10 s", self.devices[0].result))??;
            if let Packet::Publish(p) = packet {
                self.ack(p.pkid);
                self.flush().await?;
                if p.topic == self.devices[0].result {
                    if find(&p.payload, b"\"code\":").is_some() {
                        bail!(
                            "the probe report was answered with an error: {}",
                            String::from_utf8_lossy(&p.payload)
                        );
                    }
                    return Ok(());
                }
            }
        }
    }

    /// Reports every second from `start` for `seconds`, device `j` (of `n`) at `j/n` s into
    /// each second, and matches each result to its report by `event_id`, until all are
    /// answered or `grace` after the last publish. The connection stays open: the caller
    /// [`Mapper::leave`]s once every mapper is done, so no report is answered while others
    /// disconnect.
    pub async fn run(
        mut self,
        start: tokio::time::Instant,
        seconds: u64,
        n: usize,
        grace: Duration,
    ) -> anyhow::Result<(MapperOutcome, Mapper)> {
        if self.sent.elapsed() > Duration::from_secs(u64::from(KEEP_ALIVE_S / 2)) {
            let mut ping = BytesMut::new();
            PingReq.write(&mut ping)?;
            self.out.extend_from_slice(&ping);
            self.flush().await?;
        }
        let per = self.devices.len();
        let total = per * seconds as usize;
        // The report `k * per + d` (device `d`, second `k`) is due at `at(i)`; while it waits for
        // its result, `pending[i]` holds when it was sent.
        let offsets: Vec<Duration> = self
            .devices
            .iter()
            .map(|d| Duration::from_nanos(d.j as u64 * 1_000_000_000 / n as u64))
            .collect();
        let at = |i: usize| start + Duration::from_secs((i / per) as u64) + offsets[i % per];
        let mut pending: Vec<Option<Instant>> = vec![None; total];
        let mut waiting = 0usize;
        let mut out = MapperOutcome {
            results: Vec::with_capacity(total),
            sent: 0,
            lost: 0,
            errors: 0,
            late_max: 0,
            last_result: tokio::time::Instant::now(),
        };
        let mut next = 0;
        let mut give_up = None;
        loop {
            let wake = if next < total {
                at(next)
            } else {
                *give_up.get_or_insert_with(|| tokio::time::Instant::now() + grace)
            };
            tokio::select! {
                biased;
                read = self.stream.read_buf(&mut self.buf) => {
                    if read? == 0 {
                        bail!("the broker closed a device connection");
                    }
                    let arrived = Instant::now();
                    loop {
                        let packet = match Packet::read(&mut self.buf, MAX_PACKET) {
                            Ok(packet) => packet,
                            Err(CodecError::InsufficientBytes(_)) => break,
                            Err(e) => bail!("malformed packet from the broker: {e}"),
                        };
                        let p = match packet {
                            Packet::Publish(p) => p,
                            Packet::PubAck(_) | Packet::PingResp => continue,
                            other => bail!("{other:?} on a device connection"),
                        };
                        if p.qos == QoS::AtLeastOnce {
                            self.ack(p.pkid);
                        }
                        let Some(i) = self.report_index(&p.payload) else {
                            continue; // the probe's, or not ours
                        };
                        let Some(sent) = pending.get_mut(i).and_then(Option::take) else {
                            continue; // a duplicate
                        };
                        waiting -= 1;
                        if find(&p.payload, b"\"code\":").is_some() {
                            out.errors += 1;
                        } else {
                            let took = arrived.saturating_duration_since(sent);
                            out.results.push(((i / per) as u64, took.as_micros() as u64));
                        }
                        out.last_result = tokio::time::Instant::now();
                    }
                    self.flush().await?;
                    if next == total && waiting == 0 {
                        break;
                    }
                }
                () = tokio::time::sleep_until(wake) => {
                    if next == total {
                        break;
                    }
                    // Every report due by now, in one write.
                    let now = tokio::time::Instant::now();
                    while next < total && at(next) <= now {
                        out.late_max = out.late_max.max((now - at(next)).as_micros() as u64);
                        let (d, k) = (next % per, next / per);
                        let mut event_id = [0u8; 64];
                        let len = {
                            let mut w = &mut event_id[..];
                            write!(w, "{}-{k}", self.devices[d].id)?;
                            64 - w.len()
                        };
                        let event_id = std::str::from_utf8(&event_id[..len])?;
                        self.report(d, event_id, self.devices[d].j + k)?;
                        pending[next] = Some(Instant::now());
                        waiting += 1;
                        out.sent += 1;
                        next += 1;
                    }
                    self.flush().await?;
                }
            }
        }
        out.lost = waiting;
        Ok((out, self))
    }

    /// DISCONNECT, then the socket closes.
    pub async fn leave(mut self) {
        let _ = self.stream.write_all(&[0xE0, 0]).await;
    }

    /// The schedule index of the report a result answers: its `event_id` is `<id>-<k>`.
    fn report_index(&self, payload: &[u8]) -> Option<usize> {
        const KEY: &[u8] = b"\"event_id\":\"";
        let from = find(payload, KEY)? + KEY.len();
        let len = payload.get(from..)?.iter().position(|b| *b == b'"')?;
        let event_id = std::str::from_utf8(&payload[from..from + len]).ok()?;
        let (id, k) = event_id.rsplit_once('-')?;
        let k: usize = k.parse().ok()?;
        let d = self.devices.iter().position(|d| d.id == id)?;
        Some(k * self.devices.len() + d)
    }

    /// Appends device `d`'s twin report with `event_id` (an actual temperature that changes
    /// every second) as a QoS 1 PUBLISH.
    fn report(&mut self, d: usize, event_id: &str, value: usize) -> anyhow::Result<()> {
        self.payload.clear();
        write!(
            self.payload,
            r#"{{"event_id":"{event_id}","timestamp":{},"twin":{{"temperature":{{"actual":{{"value":"{}"}},"metadata":{{"type":"int"}}}}}}}}"#,
            super::schedule::now_ms(),
            report_value(value)
        )?;
        self.pkid = self.pkid % u16::MAX + 1;
        publish(
            &mut self.out,
            self.devices[d].update.as_bytes(),
            &[],
            self.pkid,
            &self.payload,
        )
    }

    fn ack(&mut self, pkid: u16) {
        let [hi, lo] = pkid.to_be_bytes();
        self.out.extend_from_slice(&[0x40, 2, hi, lo]);
    }

    async fn flush(&mut self) -> anyhow::Result<()> {
        if !self.out.is_empty() {
            self.stream.write_all(&self.out).await?;
            self.out.clear();
            self.sent = Instant::now();
        }
        Ok(())
    }

    async fn next(&mut self) -> anyhow::Result<Packet> {
        read_packet(&mut self.stream, &mut self.buf).await
    }
}

/// Appends a QoS 1 PUBLISH of `payload` on `topic` followed by `suffix` to `out`.
fn publish(
    out: &mut Vec<u8>,
    topic: &[u8],
    suffix: &[u8],
    pkid: u16,
    payload: &[u8],
) -> anyhow::Result<()> {
    let topic_len = u16::try_from(topic.len() + suffix.len()).context("topic too long")?;
    let mut remaining = 2 + usize::from(topic_len) + 2 + payload.len();
    out.push(0x32);
    loop {
        let byte = (remaining % 128) as u8;
        remaining /= 128;
        if remaining == 0 {
            out.push(byte);
            break;
        }
        out.push(byte | 0x80);
    }
    out.extend_from_slice(&topic_len.to_be_bytes());
    out.extend_from_slice(topic);
    out.extend_from_slice(suffix);
    out.extend_from_slice(&pkid.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// Where `needle` starts in `haystack`.
fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// `--device-responder PORT`: subscribes to every device's twin update and republishes each
/// payload unchanged on its `/result` topic at QoS 1 (mosquitto delivers `$hw/...` to explicit
/// `$hw` filters); prints `ready` once subscribed. One connection, whatever it read answered
/// in one write.
pub async fn responder(port: u16) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .context("TCP connect")?;
    stream.set_nodelay(true)?;
    let mut connect = rumqttc::mqttbytes::v4::Connect::new(format!(
        "responder-{}",
        uuid::Uuid::new_v4().simple()
    ));
    // Silent only before the load; the bench ends it after.
    connect.keep_alive = 0;
    let mut handshake = BytesMut::new();
    connect.write(&mut handshake)?;
    let mut subscribe = Subscribe::new("$hw/events/device/+/twin/update", QoS::AtLeastOnce);
    subscribe.pkid = 1;
    subscribe.write(&mut handshake)?;
    stream.write_all(&handshake).await?;
    let mut buf = BytesMut::with_capacity(64 << 10);
    loop {
        match read_packet(&mut stream, &mut buf).await? {
            Packet::ConnAck(ack) if ack.code == ConnectReturnCode::Success => {}
            Packet::ConnAck(ack) => bail!("CONNECT refused: {:?}", ack.code),
            Packet::SubAck(_) => break,
            other => bail!("{other:?} before the SUBACK"),
        }
    }
    println!("ready");
    let mut out = Vec::with_capacity(64 << 10);
    let mut pkid = 0u16;
    loop {
        if stream.read_buf(&mut buf).await? == 0 {
            return Ok(());
        }
        loop {
            let p = match Packet::read(&mut buf, MAX_PACKET) {
                Ok(Packet::Publish(p)) => p,
                Ok(_) => continue, // PUBACKs of the results
                Err(CodecError::InsufficientBytes(_)) => break,
                Err(e) => bail!("malformed packet from the broker: {e}"),
            };
            if p.qos == QoS::AtLeastOnce {
                let [hi, lo] = p.pkid.to_be_bytes();
                out.extend_from_slice(&[0x40, 2, hi, lo]);
            }
            pkid = pkid % u16::MAX + 1;
            publish(&mut out, p.topic.as_bytes(), b"/result", pkid, &p.payload)?;
        }
        stream.write_all(&out).await?;
        out.clear();
    }
}
