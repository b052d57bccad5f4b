//! One client connection on the one path: its task owns the socket, reads and answers its
//! packets, applies the session rules and the node's policy (login, ACL, limits), and writes
//! what its session is owed when its mailbox rings, and the PUBACKs the node's modules release
//! after their commit. Buffers are empty while the client is idle.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, ConnAckProperties, ConnectReturnCode, Disconnect, DisconnectReasonCode, PubAck,
    PubAckReason, PubComp, PubRec, PubRel, Publish, PublishProperties, RetainForwardRule, SubAck,
    SubscribeReasonCode, UnsubAck, UnsubAckReason,
};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::ack::{Ack, AckKind, Acks};
use crate::direct::{drain, publish_of, Direct, SharedTcp};
use crate::dollar::to_broker;
use crate::events::ClientEvents;
use crate::hub::{hand_to_links, Behind, ForLinks, Hub, Mailroom};
use crate::index::{valid_topic, Options, RetainHandling, SessionId};
use crate::mailbox::{Limits, Published, Resend};
use crate::registry::Will;
use crate::security::{publishable, reserved, Grants, Identity, Policy};
use crate::wire::{Packet, Wire, WireError};
use crate::RESERVED_CLIENT_PREFIX;

/// Topic aliases a client may use towards the node (§3.2.2.3.8).
const ALIASES_IN: u16 = 16;
/// QoS 1 and 2 publishes a client may have unacknowledged at once (the node's Receive
/// Maximum, §3.2.2.3.3); an MQTT 5 client past it is disconnected with 0x93.
const RECEIVE_MAX: u16 = 100;
/// QoS 1 and 2 publishes the node has in flight to one client at most, whatever the client's
/// Receive Maximum (an MQTT 3.1.1 client has none): what waits beyond them stays in its queue,
/// which is bounded, rather than in the socket.
const INFLIGHT_MAX: u16 = 100;
/// A read buffer larger than this is given back once drained.
const KEEP_BUFFER: usize = 4096;
/// What a busy connection reads at a time once a read filled its small buffer.
const READ_MORE: usize = 16 * 1024;

/// What every connection of the node shares: the hub, the policy, and the counts the node's
/// metrics read.
pub struct Shared {
    pub hub: Arc<Hub>,
    pub policy: Arc<Policy>,
    pub events: Option<Arc<ClientEvents>>,
    /// The largest packet the node reads, and says so in its CONNACK.
    pub max_packet: u32,
    /// Clients admitted at most at once (the node's own links do not count).
    pub max_clients: usize,
    /// How long a new connection has to send its CONNECT (and finish its TLS handshake).
    pub connect_within: Duration,
    admitted: AtomicUsize,
    /// Connections open now.
    pub open: AtomicU64,
    /// Clients waiting now for a module's inbox to have room, and how many times one did.
    pub paused: AtomicU64,
    pub pauses: AtomicU64,
}

impl Shared {
    pub fn new(hub: Arc<Hub>, policy: Arc<Policy>, max_packet: u32) -> Shared {
        Shared {
            hub,
            policy,
            events: None,
            max_packet,
            max_clients: usize::MAX,
            connect_within: Duration::from_secs(10),
            admitted: AtomicUsize::new(0),
            open: AtomicU64::new(0),
            paused: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
        }
    }

    /// The hub served with no login, no ACL and no limits but the protocol's: for running
    /// the one path alone (conformance suites, tests).
    pub fn open_to_all(hub: Arc<Hub>) -> Shared {
        let policy = Policy::new(
            "ke",
            &crate::security::AuthConfig::default(),
            &crate::security::AclConfig::default(),
            usize::MAX,
        )
        .unwrap_or_else(|e| unreachable!("the default policy is valid: {e}"));
        Shared::new(hub, Arc::new(policy), 1 << 20)
    }

    /// Counts a client in, unless that would pass the limit.
    fn admit(&self) -> bool {
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_clients).then_some(n + 1)
            })
            .is_ok()
    }
}

/// Why a client id is refused, or `None` when it is acceptable.
pub fn refuse_client_id(client_id: &str) -> Option<&'static str> {
    if client_id.contains(['/', '+', '#', '$']) {
        Some("contains one of / + # $")
    } else if client_id.starts_with(RESERVED_CLIENT_PREFIX) {
        Some("uses the prefix reserved for the node's own links")
    } else {
        None
    }
}

fn qos_num(qos: QoS) -> u8 {
    qos as u8
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
    /// Cut off for not taking what it held: the session ends with the connection.
    Cut,
    /// The client broke the protocol: a v5 client is told why (§4.13) before the close.
    Refused(DisconnectReasonCode),
}

/// What a packet from the client leaves to do.
enum Step {
    /// The connection ends.
    End(End),
    /// A publish waits for room in a module's inbox and in the queues of the readers it
    /// filled; then its acknowledgement is settled.
    Wait(ForLinks, Behind, Option<(AckKind, u16, Ack)>),
    /// A publish nobody subscribes to: routed once more after the other connections ran.
    Unheard(Arc<Published>, u8, Option<(AckKind, u16, Ack)>),
}

/// What woke a connection's task.
enum Woke {
    Cut,
    Mail,
    Acked,
    Silent,
    /// Bytes were read: how many (None: the stream ended or failed).
    Read(Option<usize>),
}

/// The state of one connection after its CONNECT.
struct Conn {
    wire: Wire,
    client_id: String,
    session: SessionId,
    connection: u64,
    room: Arc<Mailroom>,
    grants: Grants,
    /// The client's Maximum Packet Size.
    max_out: Option<u32>,
    aliases_in: HashMap<u16, Bytes>,
    /// QoS 2 packet ids received and not yet released (§4.3.3, method A).
    qos2_in: HashSet<u16>,
    /// QoS 2 packet ids whose PUBREC waits for a module's commit.
    qos2_held: HashSet<u16>,
    /// Subscriptions held, against `broker.max_subscriptions_per_client`.
    subscriptions: HashSet<String>,
    /// Acknowledgements modules release; made at the first publish one consumes.
    acks: Option<Arc<Acks>>,
    out: BytesMut,
    /// Plain TCP: publishers write this session's queue into the socket while the task idles.
    direct: Option<Arc<Direct>>,
}

/// Serves one client until it leaves, breaks the protocol, or `cancel` fires. Futures it awaits
/// only now and then (the CONNECT, a login, a cut, a wait for a module) are boxed: a task is as
/// large as its future, and an idle connection is mostly its task.
/// `certified` is
/// the name its TLS client certificate proved, if any: its identity, whatever login it sends;
/// `socket` the write half of a plain TCP connection, which publishers may write to directly.
pub async fn serve<S>(
    mut stream: S,
    certified: Option<String>,
    socket: Option<Arc<OwnedWriteHalf>>,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin,
{
    shared.open.fetch_add(1, Ordering::Relaxed);
    let _open = Defer(|| {
        shared.open.fetch_sub(1, Ordering::Relaxed);
    });
    let mut buf = BytesMut::new();
    // The CONNECT and what it decides, boxed: its locals are gone before the long wait below.
    let Some(opened) = Box::pin(open(
        &mut stream,
        &mut buf,
        certified,
        socket,
        &shared,
        &cancel,
    ))
    .await
    else {
        return;
    };
    let Opened {
        mut conn,
        will,
        expiry,
        keep_alive,
        token,
        announced,
        admitted,
    } = opened;
    let end = conn
        .run(&mut stream, &mut buf, &shared, &token, &cancel, keep_alive)
        .await;
    drop(admitted);
    if let Some(direct) = conn.direct.take() {
        direct.close(&mut BytesMut::new());
        conn.room.unplug(&direct);
    }
    let (will, expiry_now) = match end {
        End::Normal { expiry } => (None, expiry),
        End::WithWill { expiry } => (will, expiry),
        End::Lost | End::Refused(_) => (will, None),
        End::Cut => (will, Some(0)),
    };
    let expiry = expiry_now.map_or(expiry, |s| Duration::from_secs(s.into()));
    conn.room.release(conn.connection);
    shared
        .hub
        .disconnect(&conn.client_id, conn.connection, will, expiry);
    if let (Some(events), Some(number)) = (&shared.events, announced) {
        events.ended(&conn.client_id, number);
    }
}

/// Serves a plain TCP client, whose socket publishers may write to directly.
pub async fn serve_tcp(
    stream: tokio::net::TcpStream,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    let stream = SharedTcp::new(stream);
    let socket = Some(stream.writer());
    serve(stream, None, socket, shared, cancel).await;
}

/// What a CONNECT opened: the connection's state and what its end needs.
struct Opened<'a> {
    conn: Conn,
    will: Option<Will>,
    /// The Session Expiry Interval the CONNECT asked for.
    expiry: Duration,
    keep_alive: Duration,
    token: CancellationToken,
    /// Its connection event's number, to announce its end.
    announced: Option<u64>,
    admitted: Admitted<'a>,
}

/// A client counted against `max_connections`, until dropped.
struct Admitted<'a>(&'a Shared);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads the CONNECT and answers it: refused (client id, limit, login), or the session it
/// starts or resumes with its CONNACK and what it is owed written to `conn.out`.
async fn open<'a, S>(
    stream: &mut S,
    buf: &mut BytesMut,
    certified: Option<String>,
    socket: Option<Arc<OwnedWriteHalf>>,
    shared: &'a Shared,
    cancel: &CancellationToken,
) -> Option<Opened<'a>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let first = tokio::time::timeout(
        shared.connect_within,
        Box::pin(first_packet(&mut *stream, buf, shared.max_packet)),
    )
    .await;
    let (wire, connect) = match first {
        Ok(Ok(Some(first))) => first,
        Ok(Err(e)) => {
            debug!(error = %e, "connection closed before a valid CONNECT");
            return None;
        }
        _ => return None,
    };
    let Packet::Connect(connect, will, login) = connect else {
        return None;
    };
    let refuse = |code: ConnectReturnCode| {
        let mut out = BytesMut::new();
        let refusal = ConnAck {
            session_present: false,
            code,
            properties: None,
        };
        let _ = wire.write(Packet::ConnAck(refusal), &mut out, None);
        out
    };
    if let Some(reason) = refuse_client_id(&connect.client_id) {
        warn!(error_code = "EM-BROKER-CLIENT-ID", client_id = %connect.client_id, reason, "refused MQTT client id");
        let _ = stream
            .write_all(&refuse(ConnectReturnCode::ClientIdentifierNotValid))
            .await;
        return None;
    }
    if !shared.admit() {
        warn!(error_code = "EM-BROKER-CONNECTION-LIMIT", client_id = %connect.client_id, "refused a client: broker.max_connections reached");
        let code = if wire == Wire::V5 {
            ConnectReturnCode::QuotaExceeded
        } else {
            ConnectReturnCode::ServerUnavailable
        };
        let _ = stream.write_all(&refuse(code)).await;
        Box::pin(linger(&mut *stream)).await;
        return None;
    }
    let admitted = Admitted(shared);
    let username = certified.clone().or_else(|| {
        login
            .as_ref()
            .map(|l| l.username.clone())
            .filter(|u| !u.is_empty())
    });
    if certified.is_none() && shared.policy.needs_login_check() {
        let policy = shared.policy.clone();
        let (user, password) = login.map(|l| (l.username, l.password)).unwrap_or_default();
        // argon2 is slow on purpose: keep it off the async workers.
        let checked = user.clone();
        let ok = Box::pin(tokio::task::spawn_blocking(move || {
            policy.check_login(&checked, &password)
        }))
        .await
        .unwrap_or(false);
        if !ok {
            warn!(error_code = "EM-AUTH-REFUSED", client_id = %connect.client_id, username = %user, "login refused");
            let code = if user.is_empty() {
                ConnectReturnCode::NotAuthorized
            } else {
                ConnectReturnCode::BadUserNamePassword
            };
            let _ = stream.write_all(&refuse(code)).await;
            return None;
        }
    }
    // A username nobody checked (no users configured) is only a claim: such a client is
    // anonymous to the ACL, or naming a module would grant its rights.
    let verified = shared.policy.needs_login_check() || certified.is_some();
    let identity = Identity {
        username: username.filter(|_| verified),
        client_id: connect.client_id.clone(),
    };
    let grants = shared.policy.grants(&identity);

    let hub = &shared.hub;
    let props = connect.properties.clone().unwrap_or_default();
    let mut assigned = None;
    let client_id = if connect.client_id.is_empty() {
        if !connect.clean_start && wire == Wire::V4 {
            // 3.1.1 §3.1.3.1: an empty id needs a clean session.
            let _ = stream
                .write_all(&refuse(ConnectReturnCode::ClientIdentifierNotValid))
                .await;
            return None;
        }
        let id = format!(
            "{RESERVED_CLIENT_PREFIX}assigned-{}",
            uuid::Uuid::new_v4().simple()
        );
        assigned = Some(id.clone());
        id
    } else {
        connect.client_id.clone()
    };
    let expiry = Duration::from_secs(u64::from(props.session_expiry_interval.unwrap_or(0)));
    let limits = Limits {
        receive_maximum: props
            .receive_maximum
            .unwrap_or(u16::MAX)
            .clamp(1, INFLIGHT_MAX),
        maximum_packet_size: props.max_packet_size,
        topic_alias_maximum: props.topic_alias_max.unwrap_or(0),
        queue_bytes: hub.limits.queue_bytes,
    };
    let will = will.and_then(|w| {
        let topic = String::from_utf8_lossy(&w.topic).into_owned();
        // A will is published without asking anyone: its topic is vetted as a publish now,
        // or a device could send as the cloud by dropping its connection.
        if publishable(&grants, &topic).is_none() {
            shared.policy.count_denied_publish();
            warn!(error_code = "EM-ACL-WILL-DENIED", %client_id, %topic, "will topic not permitted; the will goes nowhere");
            return None;
        }
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
        Some(Will {
            message: Arc::new(Published {
                topic: topic.into(),
                payload: w.message,
                received: Instant::now(),
                expiry: expiry.map(|s| Duration::from_secs(s.into())),
                properties,
            }),
            qos: qos_num(w.qos),
            retain: w.retain,
            delay: Duration::from_secs(delay.into()),
        })
    });
    let token = cancel.child_token();
    let (connected, room) = hub.connect(
        &client_id,
        connect.clean_start,
        expiry,
        limits,
        token.clone(),
    );

    let mut conn = Conn {
        wire,
        client_id,
        session: connected.session,
        connection: connected.connection,
        room,
        grants,
        max_out: limits.maximum_packet_size,
        aliases_in: HashMap::new(),
        qos2_in: HashSet::new(),
        qos2_held: HashSet::new(),
        subscriptions: HashSet::new(),
        acks: None,
        out: BytesMut::new(),
        direct: socket.map(|socket| Direct::new(socket, wire, limits.maximum_packet_size)),
    };
    if let Some(direct) = &conn.direct {
        conn.room.plug(direct.clone());
    }
    let connack = ConnAck {
        session_present: connected.session_present,
        code: ConnectReturnCode::Success,
        // Keep-alive 0 is honoured as asked (§3.1.2.10): no Server Keep Alive is imposed.
        properties: (wire == Wire::V5).then(|| ConnAckProperties {
            session_expiry_interval: None,
            receive_max: Some(RECEIVE_MAX),
            max_qos: None,
            retain_available: None,
            max_packet_size: Some(shared.max_packet),
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
                let publish = publish_of(&out);
                conn.send(Packet::Publish(publish));
            }
            Resend::Release(pkid) => conn.send(Packet::PubRel(PubRel::new(pkid, None))),
        }
    }
    let announced = shared.events.as_ref().map(|e| e.connected(&conn.client_id));

    let keep_alive = Duration::from_secs(u64::from(connect.keep_alive));
    Some(Opened {
        conn,
        will,
        expiry,
        keep_alive,
        token,
        announced,
        admitted,
    })
}

/// Runs a closure when dropped: a count given back however the connection ends.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// After a DISCONNECT that refuses the client, stops writing but reads (and drops) what the
/// client still sends for a moment, so its last writes do not make the DISCONNECT a reset.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) {
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 512];
    let drain = async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// Polls `future` once: its output if it is ready now, without waiting for it.
fn poll_once<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => None,
    }
}

/// Reads until the CONNECT has arrived: the version it names, and the packet.
async fn first_packet<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    max_packet: u32,
) -> Result<Option<(Wire, Packet)>, WireError> {
    loop {
        if let Some(wire) = Wire::detect(buf)? {
            if let Some(packet) = wire.read(buf, max_packet)? {
                return Ok(Some((wire, packet)));
            }
        }
        buf.reserve(256);
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
}

impl Conn {
    async fn run<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        stream: &mut S,
        buf: &mut BytesMut,
        shared: &Shared,
        token: &CancellationToken,
        node: &CancellationToken,
        keep_alive: Duration,
    ) -> End {
        // §3.1.2.10: one and a half keep-alives without a packet ends the connection.
        let grace = keep_alive + keep_alive / 2;
        let mut last_heard = Instant::now();
        loop {
            if self.fill() {
                self.room.taken();
            }
            if !self.out.is_empty() {
                // A reader that stopped takes nothing: its queue fills and the hub cuts it
                // off through `token` while this write waits.
                tokio::select! {
                    written = stream.write_all(&self.out) => if written.is_err() {
                        return End::Lost;
                    },
                    _ = token.cancelled() => return Box::pin(self.cut(stream, node)).await,
                }
                self.out.clear();
                if self.out.capacity() > KEEP_BUFFER {
                    self.out = BytesMut::new();
                }
                if let Some(direct) = &self.direct {
                    direct.done();
                }
            }
            let silent = tokio::time::sleep(if keep_alive.is_zero() {
                Duration::from_secs(u64::from(u32::MAX))
            } else {
                grace.saturating_sub(last_heard.elapsed())
            });
            if buf.capacity() - buf.len() < 64 {
                buf.reserve(256);
            }
            let spare = buf.capacity() - buf.len();
            let woke = {
                let acks = self.acks.as_deref();
                let acked = async {
                    match acks {
                        Some(acks) => acks.bell.notified().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = token.cancelled() => Woke::Cut,
                    _ = self.room.ready.notified() => Woke::Mail,
                    () = acked => Woke::Acked,
                    _ = silent => Woke::Silent,
                    read = stream.read_buf(buf) => Woke::Read(read.ok().filter(|&n| n > 0)),
                }
            };
            match woke {
                Woke::Cut => return Box::pin(self.cut(stream, node)).await,
                Woke::Mail | Woke::Acked => {}
                Woke::Silent | Woke::Read(None) => return End::Lost,
                Woke::Read(Some(read)) => {
                    last_heard = Instant::now();
                    let mut filled = read == spare;
                    loop {
                        let packet = match self.wire.read(buf, shared.max_packet) {
                            Ok(None) if filled => {
                                // The read filled what was free: more is likely waiting. It is
                                // taken in larger reads, many packets a call, without waiting
                                // for it; an idle connection keeps only the small buffer.
                                buf.reserve(READ_MORE);
                                let spare = buf.capacity() - buf.len();
                                match poll_once(stream.read_buf(buf)) {
                                    None => break,
                                    Some(Ok(n)) if n > 0 => {
                                        filled = n == spare;
                                        continue;
                                    }
                                    Some(_) => return End::Lost,
                                }
                            }
                            other => other,
                        };
                        match packet {
                            Ok(Some(packet)) => {
                                let end = match self.handle(packet, shared) {
                                    None => None,
                                    Some(Step::End(end)) => Some(end),
                                    Some(Step::Wait(waiting, behind, owed)) => {
                                        // A module's inbox or a reader's queue is full: this
                                        // client waits (its bytes stay in its socket) while
                                        // the others go on (protocol §6.10).
                                        shared.paused.fetch_add(1, Ordering::Relaxed);
                                        shared.pauses.fetch_add(1, Ordering::Relaxed);
                                        Box::pin(hand_to_links(waiting)).await;
                                        let on = Box::pin(shared.hub.wait_for(behind, token)).await;
                                        shared.paused.fetch_sub(1, Ordering::Relaxed);
                                        if !on {
                                            return Box::pin(self.cut(stream, node)).await;
                                        }
                                        self.settle(owed);
                                        None
                                    }
                                    Some(Step::Unheard(message, qos, owed)) => {
                                        // MQTT orders packets per connection only, but a client
                                        // that subscribes on one connection and at once
                                        // publishes on another expects the message. Tasks woken
                                        // together run last-woken first (tokio's LIFO slot), so
                                        // a publish that reached nobody goes to the back of the
                                        // queue once, letting a SUBSCRIBE that arrived first be
                                        // handled, and is routed again. Only publishes nobody
                                        // hears pay for it.
                                        tokio::task::yield_now().await;
                                        let ack = owed.as_ref().map(|(_, _, ack)| ack);
                                        let routed = shared.hub.publish(
                                            Some(self.session),
                                            message,
                                            qos,
                                            false,
                                            ack,
                                        );
                                        Box::pin(hand_to_links(routed.links)).await;
                                        let hub = &shared.hub;
                                        if !Box::pin(hub.wait_for(routed.behind, token)).await {
                                            return Box::pin(self.cut(stream, node)).await;
                                        }
                                        self.settle(owed);
                                        None
                                    }
                                };
                                if let Some(end) = end {
                                    self.closing();
                                    if let End::Refused(reason) = end {
                                        let bye = Disconnect::new(reason);
                                        if self.wire == Wire::V5 {
                                            self.send(Packet::Disconnect(bye));
                                        }
                                    }
                                    let _ = stream.write_all(&self.out).await;
                                    if matches!(end, End::Refused(_)) {
                                        Box::pin(linger(stream)).await;
                                    }
                                    return end;
                                }
                            }
                            Ok(None) => break,
                            Err(e) => {
                                debug!(client_id = %self.client_id, error = %e, "malformed packet");
                                self.closing();
                                if self.wire == Wire::V5 {
                                    let bye =
                                        Disconnect::new(DisconnectReasonCode::MalformedPacket);
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

    /// The connection was cut: for not taking what it held (0x97), because the node is
    /// stopping (0x8B), else taken over (§3.1.4-3). A v5 client is told which.
    async fn cut<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        stream: &mut S,
        node: &CancellationToken,
    ) -> End {
        let lagged = self.room.lagged.load(Ordering::Relaxed);
        let reason = if lagged {
            DisconnectReasonCode::QuotaExceeded
        } else if node.is_cancelled() {
            DisconnectReasonCode::ServerShuttingDown
        } else {
            DisconnectReasonCode::SessionTakenOver
        };
        let mut out = BytesMut::new();
        if let Some(direct) = &self.direct {
            // A partial packet a direct write left must be finished before anything else.
            direct.close(&mut out);
        }
        if self.wire == Wire::V5 {
            let bye = Disconnect::new(reason);
            if self
                .wire
                .write(Packet::Disconnect(bye), &mut out, self.max_out)
                .is_ok()
            {
                let write = stream.write_all(&out);
                let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
            }
        }
        if lagged {
            Box::pin(linger(stream)).await;
            // What did not fit is gone: the session ends, so the client resyncs (its next
            // CONNECT finds no session present) and is never handed a gap.
            return End::Cut;
        }
        End::Lost
    }

    /// Writes the acknowledgements modules released since the last look.
    fn drain_acks(&mut self) {
        let Some(acks) = self.acks.clone() else {
            return;
        };
        for released in acks.take() {
            self.acked(released);
        }
    }

    fn acked(&mut self, (kind, pkid): (AckKind, u16)) {
        match kind {
            AckKind::PubAck => self.send(Packet::PubAck(PubAck::new(pkid, None))),
            AckKind::PubRec => {
                self.qos2_held.remove(&pkid);
                self.send(Packet::PubRec(PubRec::new(pkid, None)));
            }
        }
    }

    /// One packet from the client; Some when the connection ends.
    fn handle(&mut self, packet: Packet, shared: &Shared) -> Option<Step> {
        let hub = &*shared.hub;
        match packet {
            Packet::Publish(publish) => return self.inbound(publish, shared),
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
                    if let Some(refusal) = self.may_subscribe(&filter.path, &shared.policy) {
                        let denied = shared.policy.count_denied_subscribe();
                        warn!(error_code = "EM-ACL-SUBSCRIBE-DENIED", client_id = %self.client_id,
                            filter = %filter.path, reason = refusal, denied, "subscribe refused");
                        codes.push(if self.wire == Wire::V5 {
                            SubscribeReasonCode::NotAuthorized
                        } else {
                            SubscribeReasonCode::Unspecified
                        });
                        continue;
                    }
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
                            self.subscriptions.insert(filter.path.clone());
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
                        self.subscriptions.remove(f.as_str());
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
                return Some(Step::End(match d.reason_code {
                    DisconnectReasonCode::DisconnectWithWillMessage => End::WithWill { expiry },
                    DisconnectReasonCode::NormalDisconnection => End::Normal { expiry },
                    _ => End::WithWill { expiry },
                }));
            }
            // A second CONNECT, or a server's packet from a client (§3.1.0-2): protocol error.
            _ => return Some(Step::End(End::Refused(DisconnectReasonCode::ProtocolError))),
        }
        None
    }

    /// Why a SUBSCRIBE to `path` is refused: the ACL, a `$` filter that is the broker's own,
    /// or the subscription limit.
    fn may_subscribe(&self, path: &str, policy: &Policy) -> Option<&'static str> {
        let filter = path
            .strip_prefix("$share/")
            .and_then(|rest| rest.split_once('/').map(|(_, f)| f))
            .unwrap_or(path);
        if reserved(filter) || !self.grants.may_subscribe(&to_broker(filter)) {
            return Some("not allowed by the ACL");
        }
        let held = self.subscriptions.contains(path);
        (!held && self.subscriptions.len() >= policy.max_subscriptions())
            .then_some("subscription limit reached")
    }

    /// A client's PUBLISH: alias resolved, vetted, routed, acknowledged (§4.3); what a module
    /// consumes is acknowledged once the module is done with it (protocol §6.5).
    fn inbound(&mut self, mut publish: Publish, shared: &Shared) -> Option<Step> {
        let mut properties = publish.properties.take();
        if let Some(alias) = properties.as_mut().and_then(|p| p.topic_alias.take()) {
            // §3.3.2.3.4: 0 or above the maximum the node gave is a Topic Alias invalid.
            if alias == 0 || alias > ALIASES_IN {
                return Some(Step::End(End::Refused(
                    DisconnectReasonCode::TopicAliasInvalid,
                )));
            }
            if publish.topic.is_empty() {
                match self.aliases_in.get(&alias) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => {
                        return Some(Step::End(End::Refused(DisconnectReasonCode::ProtocolError)))
                    }
                }
            } else {
                self.aliases_in.insert(alias, publish.topic.clone());
            }
        }
        let topic = String::from_utf8_lossy(&publish.topic).into_owned();
        if !valid_topic(&topic) {
            return Some(Step::End(End::Refused(
                DisconnectReasonCode::TopicNameInvalid,
            )));
        }
        let qos = qos_num(publish.qos);
        if qos == 2 && self.qos2_in.contains(&publish.pkid) {
            // A resent QoS 2 publish (§4.3.3): answered once its first copy is.
            if !self.qos2_held.contains(&publish.pkid) {
                self.send(Packet::PubRec(PubRec::new(publish.pkid, None)));
            }
            return None;
        }
        if publishable(&self.grants, &topic).is_none() {
            let denied = shared.policy.count_denied_publish();
            warn!(error_code = "EM-ACL-PUBLISH-DENIED", client_id = %self.client_id, %topic, denied,
                "publish refused by the ACL");
            let mut ack = PubAck::new(publish.pkid, None);
            ack.reason = PubAckReason::NotAuthorized;
            match qos {
                1 => self.send(Packet::PubAck(ack)),
                2 => {
                    let mut rec = PubRec::new(publish.pkid, None);
                    rec.reason = rumqttc::v5::mqttbytes::v5::PubRecReason::NotAuthorized;
                    self.send(Packet::PubRec(rec));
                }
                _ => {}
            }
            return None;
        }
        if qos == 2 {
            self.qos2_in.insert(publish.pkid);
            if self.qos2_in.len() > usize::from(RECEIVE_MAX) && self.wire == Wire::V5 {
                return Some(Step::End(End::Refused(
                    DisconnectReasonCode::ReceiveMaximumExceeded,
                )));
            }
        }
        let expiry = properties
            .as_mut()
            .and_then(|p| p.message_expiry_interval.take())
            .map(|s| Duration::from_secs(s.into()));
        if let Some(p) = properties.as_mut() {
            p.subscription_identifiers.clear();
        }
        let message = Arc::new(Published {
            topic: topic.into(),
            payload: publish.payload,
            received: Instant::now(),
            expiry,
            properties,
        });
        let kind = match qos {
            1 => Some(AckKind::PubAck),
            2 => Some(AckKind::PubRec),
            _ => None,
        };
        let ack = kind.map(|kind| self.promise(kind, publish.pkid));
        let routed = shared.hub.publish(
            Some(self.session),
            message.clone(),
            qos,
            publish.retain,
            ack.as_ref(),
        );
        let owed = kind.zip(ack).map(|(kind, ack)| (kind, publish.pkid, ack));
        if !routed.heard && !publish.retain {
            return Some(Step::Unheard(message, qos, owed));
        }
        if !routed.links.is_empty() || !routed.behind.is_empty() {
            return Some(Step::Wait(routed.links, routed.behind, owed));
        }
        self.settle(owed);
        None
    }

    /// After a publish was handed on: its acknowledgement now if no module took it, as a
    /// broker does; else the module's commit releases it.
    fn settle(&mut self, owed: Option<(AckKind, u16, Ack)>) {
        let Some((kind, pkid, ack)) = owed else {
            return;
        };
        if ack.sole() {
            ack.abandon();
            self.acked((kind, pkid));
        } else if kind == AckKind::PubRec {
            self.qos2_held.insert(pkid);
        }
    }

    /// A promise to acknowledge `pkid`, released to this connection's queue.
    fn promise(&mut self, kind: AckKind, pkid: u16) -> Ack {
        let direct = self.direct.clone();
        let acks = self.acks.get_or_insert_with(|| Acks::new(direct));
        acks.promise(kind, pkid)
    }

    /// Writes what the session may be sent now; whether it took anything.
    fn drain_mailbox(&mut self) -> bool {
        let mut mailbox = self
            .room
            .mailbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drain(&mut mailbox, self.wire, self.max_out, &mut self.out)
    }

    /// The task's own bytes for the socket: what its session may be sent and the released
    /// acknowledgements, after what a publisher's direct write left; whether it took any mail.
    fn fill(&mut self) -> bool {
        let Some(direct) = self.direct.clone() else {
            let took = self.drain_mailbox();
            self.drain_acks();
            return took;
        };
        let mut took = false;
        let mut out = std::mem::take(&mut self.out);
        direct.turn(&mut out, |out| {
            self.out = std::mem::take(out);
            took = self.drain_mailbox();
            self.drain_acks();
            *out = std::mem::take(&mut self.out);
        });
        self.out = out;
        took
    }

    /// The connection ends: only this task writes from now on, what a direct write left first.
    fn closing(&mut self) {
        if let Some(direct) = &self.direct {
            direct.close(&mut self.out);
        }
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
