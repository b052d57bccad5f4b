//! One client connection on the one path: its task owns the socket, reads and answers its
//! packets, applies the session rules, and writes what its session is owed when its mailbox
//! rings. Buffers are empty while the client is idle.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, ConnAckProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode, PubAck,
    PubComp, PubRec, PubRel, Publish, PublishProperties, RetainForwardRule, SubAck,
    SubscribeReasonCode, UnsubAck, UnsubAckReason,
};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::hub::{Hub, Mailroom};
use crate::index::{valid_topic, Options, RetainHandling, SessionId};
use crate::mailbox::{Limits, Outgoing, Published, Resend};
use crate::registry::Will;
use crate::wire::{Packet, Wire, WireError};

/// The largest packet the node reads, and says so in its CONNACK.
const MAX_PACKET: u32 = 1 << 20;
/// Topic aliases a client may use towards the node (§3.2.2.3.8).
const ALIASES_IN: u16 = 16;
/// QoS 2 publishes a client may have unreleased at once (the node's Receive Maximum, §3.2.2.3.3).
const RECEIVE_MAX: u16 = 100;
/// A read buffer larger than this is given back once drained.
const KEEP_BUFFER: usize = 4096;
/// How long a new connection has to send its CONNECT.
const CONNECT_WITHIN: Duration = Duration::from_secs(10);

fn qos_num(qos: QoS) -> u8 {
    qos as u8
}

fn qos_of(n: u8) -> QoS {
    match n {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    }
}

/// Why a connection ended, for the will (§3.1.2.5: no will after a normal DISCONNECT).
enum End {
    Normal {
        expiry: Option<u32>,
    },
    WithWill {
        expiry: Option<u32>,
    },
    Lost,
    /// The client broke the protocol: a v5 client is told why (§4.13) before the close.
    Refused(DisconnectReasonCode),
}

/// The state of one connection after its CONNECT.
struct Conn {
    wire: Wire,
    client_id: String,
    session: SessionId,
    connection: u64,
    room: Arc<Mailroom>,
    /// The client's Maximum Packet Size.
    max_out: Option<u32>,
    aliases_in: HashMap<u16, Bytes>,
    /// QoS 2 packet ids received and not yet released (§4.3.3, method A).
    qos2_in: HashSet<u16>,
    out: BytesMut,
}

/// Serves one client until it leaves, breaks the protocol, or `cancel` fires.
pub async fn serve(mut stream: TcpStream, hub: Arc<Hub>, cancel: CancellationToken) {
    let mut buf = BytesMut::new();
    let (wire, connect) =
        match tokio::time::timeout(CONNECT_WITHIN, first_packet(&mut stream, &mut buf)).await {
            Ok(Ok(Some(first))) => first,
            Ok(Err(e)) => {
                debug!(error = %e, "connection closed before a valid CONNECT");
                return;
            }
            _ => return,
        };
    let Packet::Connect(connect, will, _login) = connect else {
        return;
    };
    let props = connect.properties.clone().unwrap_or_default();
    let mut assigned = None;
    let client_id = if connect.client_id.is_empty() {
        if !connect.clean_start && wire == Wire::V4 {
            // 3.1.1 §3.1.3.1: an empty id needs a clean session.
            let mut out = BytesMut::new();
            let refuse = ConnAck {
                session_present: false,
                code: ConnectReturnCode::ClientIdentifierNotValid,
                properties: None,
            };
            let _ = wire.write(Packet::ConnAck(refuse), &mut out, None);
            let _ = stream.write_all(&out).await;
            return;
        }
        let id = format!("edgemeta-assigned-{}", uuid::Uuid::new_v4().simple());
        assigned = Some(id.clone());
        id
    } else {
        connect.client_id.clone()
    };
    let expiry = Duration::from_secs(u64::from(props.session_expiry_interval.unwrap_or(0)));
    let limits = Limits {
        receive_maximum: props.receive_maximum.unwrap_or(u16::MAX).max(1),
        maximum_packet_size: props.max_packet_size,
        topic_alias_maximum: props.topic_alias_max.unwrap_or(0),
        queue_bytes: hub.limits.queue_bytes,
    };
    let token = cancel.child_token();
    let (connected, room) = hub.connect(
        &client_id,
        connect.clean_start,
        expiry,
        limits,
        token.clone(),
    );
    let will = will.map(|w| {
        let wp = w.properties;
        let delay = wp.as_ref().and_then(|p| p.delay_interval).unwrap_or(0);
        let expiry = wp.as_ref().and_then(|p| p.message_expiry_interval);
        let properties = wp.map(|p| PublishProperties {
            payload_format_indicator: p.payload_format_indicator,
            content_type: p.content_type,
            response_topic: p.response_topic,
            correlation_data: p.correlation_data,
            user_properties: p.user_properties,
            ..PublishProperties::default()
        });
        Will {
            message: Arc::new(Published {
                topic: String::from_utf8_lossy(&w.topic).into(),
                payload: w.message,
                received: Instant::now(),
                expiry: expiry.map(|s| Duration::from_secs(s.into())),
                properties,
            }),
            qos: qos_num(w.qos),
            retain: w.retain,
            delay: Duration::from_secs(delay.into()),
        }
    });

    let mut conn = Conn {
        wire,
        client_id,
        session: connected.session,
        connection: connected.connection,
        room,
        max_out: limits.maximum_packet_size,
        aliases_in: HashMap::new(),
        qos2_in: HashSet::new(),
        out: BytesMut::new(),
    };
    let connack = ConnAck {
        session_present: connected.session_present,
        code: ConnectReturnCode::Success,
        // Keep-alive 0 is honoured as asked (§3.1.2.10): no Server Keep Alive is imposed.
        properties: (wire == Wire::V5).then(|| ConnAckProperties {
            session_expiry_interval: None,
            receive_max: Some(RECEIVE_MAX),
            max_qos: None,
            retain_available: None,
            max_packet_size: Some(MAX_PACKET),
            assigned_client_identifier: assigned,
            topic_alias_max: Some(ALIASES_IN),
            reason_string: None,
            user_properties: Vec::new(),
            wildcard_subscription_available: None,
            subscription_identifiers_available: None,
            shared_subscription_available: None,
            server_keep_alive: None,
            response_information: None,
            server_reference: None,
            authentication_method: None,
            authentication_data: None,
        }),
    };
    conn.send(Packet::ConnAck(connack));
    let resend = conn
        .room
        .mailbox
        .lock()
        .map(|mut m| m.resume(limits, Instant::now()));
    for item in resend.unwrap_or_default() {
        match item {
            Resend::Publish(out) => {
                let publish = conn.publish_packet(*out);
                conn.send(Packet::Publish(publish));
            }
            Resend::Release(pkid) => conn.send(Packet::PubRel(PubRel::new(pkid, None))),
        }
    }

    let keep_alive = Duration::from_secs(u64::from(connect.keep_alive));
    let end = conn
        .run(&mut stream, &mut buf, &hub, &token, keep_alive)
        .await;
    let (will, expiry_now) = match end {
        End::Normal { expiry } => (None, expiry),
        End::WithWill { expiry } => (will, expiry),
        End::Lost | End::Refused(_) => (will, None),
    };
    let expiry = expiry_now.map_or(expiry, |s| Duration::from_secs(s.into()));
    conn.room.release(conn.connection);
    hub.disconnect(&conn.client_id, conn.connection, will, expiry);
}

/// After a DISCONNECT that refuses the client, stops writing but reads (and drops) what the
/// client still sends for a moment, so its last writes do not make the DISCONNECT a reset.
async fn linger(stream: &mut TcpStream) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 512];
    let drain = async {
        loop {
            match tokio::io::AsyncReadExt::read(stream, &mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Reads until the CONNECT has arrived: the version it names, and the packet.
async fn first_packet(
    stream: &mut TcpStream,
    buf: &mut BytesMut,
) -> Result<Option<(Wire, Packet)>, WireError> {
    loop {
        if let Some(wire) = Wire::detect(buf)? {
            if let Some(packet) = wire.read(buf, MAX_PACKET)? {
                return Ok(Some((wire, packet)));
            }
        }
        if stream.readable().await.is_err() {
            return Ok(None);
        }
        buf.reserve(256);
        match stream.try_read_buf(buf) {
            Ok(0) => return Ok(None),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return Ok(None),
        }
    }
}

impl Conn {
    async fn run(
        &mut self,
        stream: &mut TcpStream,
        buf: &mut BytesMut,
        hub: &Hub,
        token: &CancellationToken,
        keep_alive: Duration,
    ) -> End {
        // §3.1.2.10: one and a half keep-alives without a packet ends the connection.
        let grace = keep_alive + keep_alive / 2;
        let mut last_heard = Instant::now();
        loop {
            self.drain_mailbox();
            if !self.out.is_empty() {
                if stream.write_all(&self.out).await.is_err() {
                    return End::Lost;
                }
                self.out.clear();
                if self.out.capacity() > KEEP_BUFFER {
                    self.out = BytesMut::new();
                }
            }
            let silent = tokio::time::sleep(if keep_alive.is_zero() {
                Duration::from_secs(u64::from(u32::MAX))
            } else {
                grace.saturating_sub(last_heard.elapsed())
            });
            tokio::select! {
                _ = token.cancelled() => {
                    // Cut off for lagging a whole queue behind (0x97), else taken over
                    // (§3.1.4-3) or the node is stopping.
                    let lagged = self.room.lagged.load(std::sync::atomic::Ordering::Relaxed);
                    let reason = if lagged {
                        DisconnectReasonCode::QuotaExceeded
                    } else {
                        DisconnectReasonCode::SessionTakenOver
                    };
                    let mut out = BytesMut::new();
                    let bye = Disconnect::new(reason);
                    if self.wire.write(Packet::Disconnect(bye), &mut out, self.max_out).is_ok() {
                        let _ = stream.write_all(&out).await;
                    }
                    if lagged {
                        linger(stream).await;
                    }
                    return End::Lost;
                }
                _ = self.room.ready.notified() => {}
                _ = silent => return End::Lost,
                ready = stream.readable() => {
                    if ready.is_err() {
                        return End::Lost;
                    }
                    // Tasks woken together run last-woken first (tokio's LIFO slot); going to
                    // the back of the queue once lets a packet that arrived earlier on another
                    // connection (a SUBSCRIBE before this PUBLISH) be handled first.
                    tokio::task::yield_now().await;
                    buf.reserve(256);
                    match stream.try_read_buf(buf) {
                        Ok(0) => return End::Lost,
                        Ok(_) => last_heard = Instant::now(),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        Err(_) => return End::Lost,
                    }
                    loop {
                        match self.wire.read(buf, MAX_PACKET) {
                            Ok(Some(packet)) => {
                                if let Some(end) = self.handle(packet, hub) {
                                    if let End::Refused(reason) = end {
                                        let bye = Disconnect::new(reason);
                                        if self.wire == Wire::V5 {
                                            self.send(Packet::Disconnect(bye));
                                        }
                                    }
                                    let _ = stream.write_all(&self.out).await;
                                    if matches!(end, End::Refused(_)) {
                                        linger(stream).await;
                                    }
                                    return end;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                debug!(client_id = %self.client_id, error = %e, "malformed packet");
                                if self.wire == Wire::V5 {
                                    let bye = Disconnect::new(DisconnectReasonCode::MalformedPacket);
                                    self.send(Packet::Disconnect(bye));
                                    let _ = stream.write_all(&self.out).await;
                                }
                                return End::Lost;
                            }
                        }
                    }
                    if buf.is_empty() && buf.capacity() > KEEP_BUFFER {
                        *buf = BytesMut::new();
                    }
                }
            }
        }
    }

    /// One packet from the client; Some when the connection ends.
    fn handle(&mut self, packet: Packet, hub: &Hub) -> Option<End> {
        match packet {
            Packet::Publish(publish) => return self.inbound(publish, hub),
            Packet::PubRel(rel) => {
                self.qos2_in.remove(&rel.pkid);
                self.send(Packet::PubComp(PubComp::new(rel.pkid, None)));
            }
            Packet::PubAck(ack) => {
                self.mailbox(|m| m.completed(ack.pkid));
            }
            Packet::PubComp(comp) => {
                self.mailbox(|m| m.completed(comp.pkid));
            }
            Packet::PubRec(rec) => {
                if self.mailbox(|m| m.received(rec.pkid)) {
                    self.send(Packet::PubRel(PubRel::new(rec.pkid, None)));
                }
            }
            Packet::Subscribe(subscribe) => {
                let id = subscribe
                    .properties
                    .as_ref()
                    .and_then(|p| p.id)
                    .map(|id| id as u32);
                let mut codes = Vec::with_capacity(subscribe.filters.len());
                let mut retained = Vec::new();
                for filter in subscribe.filters {
                    let options = Options {
                        qos: qos_num(filter.qos),
                        no_local: filter.nolocal,
                        retain_as_published: filter.preserve_retain,
                        retain_handling: match filter.retain_forward_rule {
                            RetainForwardRule::OnEverySubscribe => RetainHandling::OnSubscribe,
                            RetainForwardRule::OnNewSubscribe => RetainHandling::OnNewSubscribe,
                            RetainForwardRule::Never => RetainHandling::Never,
                        },
                        id,
                    };
                    match hub.subscribe(
                        &self.client_id,
                        self.session,
                        &filter.path,
                        options.clone(),
                    ) {
                        Ok(new) => {
                            codes.push(SubscribeReasonCode::Success(filter.qos));
                            let send = match options.retain_handling {
                                RetainHandling::OnSubscribe => true,
                                RetainHandling::OnNewSubscribe => new,
                                RetainHandling::Never => false,
                            };
                            // §3.3.1.3: no retained messages for a shared subscription.
                            if send && !filter.path.starts_with("$share/") {
                                for message in hub.retained_for(&filter.path) {
                                    retained.push((message, options.clone()));
                                }
                            }
                        }
                        Err(_) => codes.push(SubscribeReasonCode::TopicFilterInvalid),
                    }
                }
                self.send(Packet::SubAck(SubAck {
                    pkid: subscribe.pkid,
                    return_codes: codes,
                    properties: None,
                }));
                for ((message, qos), options) in retained {
                    let owed = crate::mailbox::Owed {
                        qos: qos.min(options.qos),
                        retain: true,
                        subscription_ids: options.id.into_iter().collect(),
                        message,
                    };
                    self.mailbox(|m| m.push(owed).is_ok());
                }
            }
            Packet::Unsubscribe(unsubscribe) => {
                let reasons = unsubscribe
                    .filters
                    .iter()
                    .map(|f| {
                        if hub.unsubscribe(&self.client_id, self.session, f) {
                            UnsubAckReason::Success
                        } else {
                            UnsubAckReason::NoSubscriptionExisted
                        }
                    })
                    .collect();
                self.send(Packet::UnsubAck(UnsubAck {
                    pkid: unsubscribe.pkid,
                    reasons,
                    properties: None,
                }));
            }
            Packet::PingReq(_) => self.send(Packet::PingResp(rumqttc::v5::mqttbytes::v5::PingResp)),
            Packet::Disconnect(d) => {
                let expiry = d.properties.and_then(|p| p.session_expiry_interval);
                return Some(match d.reason_code {
                    DisconnectReasonCode::DisconnectWithWillMessage => End::WithWill { expiry },
                    DisconnectReasonCode::NormalDisconnection => End::Normal { expiry },
                    _ => End::WithWill { expiry },
                });
            }
            // A second CONNECT, or a server's packet from a client (§3.1.0-2): protocol error.
            _ => return Some(End::Refused(DisconnectReasonCode::ProtocolError)),
        }
        None
    }

    /// A client's PUBLISH: alias resolved, routed, acknowledged (§4.3).
    fn inbound(&mut self, mut publish: Publish, hub: &Hub) -> Option<End> {
        let mut properties = publish.properties.take();
        if let Some(alias) = properties.as_mut().and_then(|p| p.topic_alias.take()) {
            // §3.3.2.3.4: 0 or above the maximum the node gave is a Topic Alias invalid.
            if alias == 0 || alias > ALIASES_IN {
                return Some(End::Refused(DisconnectReasonCode::TopicAliasInvalid));
            }
            if publish.topic.is_empty() {
                match self.aliases_in.get(&alias) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => return Some(End::Refused(DisconnectReasonCode::ProtocolError)),
                }
            } else {
                self.aliases_in.insert(alias, publish.topic.clone());
            }
        }
        let topic = String::from_utf8_lossy(&publish.topic).into_owned();
        if !valid_topic(&topic) {
            return Some(End::Refused(DisconnectReasonCode::TopicNameInvalid));
        }
        let expiry = properties
            .as_mut()
            .and_then(|p| p.message_expiry_interval.take())
            .map(|s| Duration::from_secs(s.into()));
        if let Some(p) = properties.as_mut() {
            p.subscription_identifiers.clear();
        }
        let qos = qos_num(publish.qos);
        let duplicate = qos == 2 && !self.qos2_in.insert(publish.pkid);
        if self.qos2_in.len() > usize::from(RECEIVE_MAX) {
            return Some(End::Refused(DisconnectReasonCode::ReceiveMaximumExceeded));
        }
        if !duplicate {
            let message = Arc::new(Published {
                topic: topic.into(),
                payload: publish.payload,
                received: Instant::now(),
                expiry,
                properties,
            });
            hub.publish(Some(self.session), message, qos, publish.retain);
        }
        match qos {
            1 => self.send(Packet::PubAck(PubAck::new(publish.pkid, None))),
            2 => self.send(Packet::PubRec(PubRec::new(publish.pkid, None))),
            _ => {}
        }
        None
    }

    fn drain_mailbox(&mut self) {
        let wire = self.wire;
        loop {
            let next = self.mailbox(|m| {
                m.next(Instant::now(), |o| {
                    let mut probe = BytesMut::new();
                    let packet = Packet::Publish(publish_of(o));
                    wire.write(packet, &mut probe, None)
                        .map_or(usize::MAX, |n| n)
                })
            });
            let Some(out) = next else {
                return;
            };
            let publish = self.publish_packet(out);
            self.send(Packet::Publish(publish));
        }
    }

    fn publish_packet(&self, out: Outgoing) -> Publish {
        publish_of(&out)
    }

    fn mailbox<T>(&self, f: impl FnOnce(&mut crate::mailbox::Mailbox) -> T) -> T {
        let mut mailbox = self
            .room
            .mailbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut mailbox)
    }

    fn send(&mut self, packet: Packet) {
        if let Err(e) = self.wire.write(packet, &mut self.out, self.max_out) {
            debug!(client_id = %self.client_id, error = %e, "packet not written");
        }
    }
}

/// The PUBLISH for one delivery: its own QoS, alias, expiry left and identifiers.
fn publish_of(out: &Outgoing) -> Publish {
    let mut properties = out.properties.clone();
    let per_delivery =
        out.topic_alias.is_some() || out.expiry_left.is_some() || !out.subscription_ids.is_empty();
    if per_delivery {
        let p = properties.get_or_insert_with(PublishProperties::default);
        p.topic_alias = out.topic_alias;
        p.message_expiry_interval = out.expiry_left;
        p.subscription_identifiers = out.subscription_ids.iter().map(|&i| i as usize).collect();
    }
    Publish {
        dup: out.dup,
        qos: qos_of(out.qos),
        retain: out.retain,
        topic: Bytes::copy_from_slice(out.topic.as_bytes()),
        pkid: out.pkid,
        payload: out.payload.clone(),
        properties,
    }
}
