//! One client connection on the one path: its task owns the socket, reads and answers its
//! packets, applies the session rules and the node's policy (login, ACL, limits), and writes
//! what its session is owed when its mailbox rings, and the PUBACKs the node's modules release
//! after their commit. Buffers are empty while the client is idle.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{
    ConnAck, ConnAckProperties, Connect, ConnectReturnCode, Disconnect, DisconnectReasonCode,
    LastWill, PubAck, PubAckReason, PubComp, PubRec, PubRel, Publish, PublishProperties,
    RetainForwardRule, SubAck, Subscribe, SubscribeReasonCode, UnsubAck, UnsubAckReason,
    Unsubscribe,
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
use crate::hub::{hand_to_links, ForLinks, Hub, Mailroom};
use crate::index::{valid_topic, Options, RetainHandling, SessionId, TopicBounds};
use crate::login::Verdict;
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
    /// The most levels and bytes of a client's topic or filter.
    pub topics: TopicBounds,
    /// Connections counted against `max_clients`, from their accept to their end.
    admitted: AtomicUsize,
    /// Connections over the limit being told so (a CONNACK) right now.
    refusing: AtomicUsize,
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
            topics: TopicBounds::PROTOCOL,
            admitted: AtomicUsize::new(0),
            refusing: AtomicUsize::new(0),
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

    /// Counts a new connection in, before its CONNECT, unless that would pass the limit: a
    /// connection that has not finished CONNECT holds a task and a buffer too.
    pub(crate) fn admit(self: &Arc<Self>) -> Option<Admitted> {
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max_clients).then_some(n + 1)
            })
            .ok()
            .map(|_| Admitted(self.clone()))
    }
}

/// Connections over the limit told so at once, each for at most a second; past them a new
/// connection is closed unanswered.
const REFUSING_MAX: usize = 64;

/// A connection over `max_connections`: its CONNECT's first bytes name the version, the
/// CONNACK refuses it in that version, and it is closed. Reads at most 512 bytes.
async fn refuse_over_limit<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, shared: &Shared) {
    let refusing = shared.refusing.fetch_add(1, Ordering::AcqRel);
    let _refusing = Defer(|| {
        shared.refusing.fetch_sub(1, Ordering::AcqRel);
    });
    if refusing >= REFUSING_MAX {
        return;
    }
    warn!(
        error_code = "EM-BROKER-CONNECTION-LIMIT",
        "refused a client: broker.max_connections reached"
    );
    let mut head = BytesMut::with_capacity(512);
    let detect = async {
        loop {
            match Wire::detect(&head) {
                Ok(Some(wire)) => return Some(wire),
                Err(_) => return None,
                Ok(None) if head.len() >= 512 => return None,
                Ok(None) => {}
            }
            match stream.read_buf(&mut head).await {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            }
        }
    };
    let Ok(Some(wire)) = tokio::time::timeout(Duration::from_secs(1), detect).await else {
        return;
    };
    let code = if wire == Wire::V5 {
        ConnectReturnCode::QuotaExceeded
    } else {
        ConnectReturnCode::ServerUnavailable
    };
    let _ = stream.write_all(&refusal(wire, code)).await;
    Box::pin(linger(&mut stream)).await;
}

/// A CONNACK refusing a client with `code`, in its version.
fn refusal(wire: Wire, code: ConnectReturnCode) -> BytesMut {
    let mut out = BytesMut::new();
    let refusal = ConnAck {
        session_present: false,
        code,
        properties: None,
    };
    let _ = wire.write(Packet::ConnAck(refusal), &mut out, None);
    out
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
    /// Cut off for falling a whole queue behind: the session ends with the connection.
    Cut,
    /// The client broke the protocol: a v5 client is told why (§4.13) before the close.
    Refused(DisconnectReasonCode),
}

/// What a packet from the client leaves to do.
enum Step {
    /// The connection ends.
    End(End),
    /// A publish waits for room in a module's inbox; then its acknowledgement is settled.
    Wait(ForLinks, Option<(AckKind, u16, Ack)>),
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
    /// QoS 2 packet ids received and not yet released (§4.3.3, method A): the session's.
    qos2_in: Arc<Mutex<HashSet<u16>>>,
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
/// `socket` the write half of a plain TCP connection, which publishers may write to directly;
/// `peer` the client's address, for the back-off of failing logins.
pub(crate) struct Accepted {
    pub certified: Option<String>,
    pub socket: Option<Arc<OwnedWriteHalf>>,
    pub peer: Option<IpAddr>,
    pub admitted: Admitted,
}

pub(crate) async fn serve<S>(
    mut stream: S,
    accepted: Accepted,
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
    let Accepted {
        certified,
        socket,
        peer,
        admitted,
    } = accepted;
    let Some(opened) = Box::pin(open(
        &mut stream,
        &mut buf,
        Login { certified, peer },
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

/// Serves a plain TCP client, whose socket publishers may write to directly; one over
/// `max_connections` is refused.
pub async fn serve_tcp(
    stream: tokio::net::TcpStream,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    let Some(admitted) = shared.admit() else {
        return refuse_over_limit(stream, &shared).await;
    };
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let stream = SharedTcp::new(stream);
    let accepted = Accepted {
        certified: None,
        socket: Some(stream.writer()),
        peer,
        admitted,
    };
    serve(stream, accepted, shared, cancel).await;
}

/// Who a connection is before its CONNECT: a certificate's name, and its address.
struct Login {
    certified: Option<String>,
    peer: Option<IpAddr>,
}

/// What a CONNECT opened: the connection's state and what its end needs.
struct Opened {
    conn: Conn,
    will: Option<Will>,
    /// The Session Expiry Interval the CONNECT asked for.
    expiry: Duration,
    keep_alive: Duration,
    token: CancellationToken,
    /// Its connection event's number, to announce its end.
    announced: Option<u64>,
}

/// A connection counted against `max_connections`, until dropped.
pub(crate) struct Admitted(Arc<Shared>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads the CONNECT and answers it: refused (client id, login, a rule of the protocol), or
/// the session it starts or resumes with its CONNACK and what it is owed written to
/// `conn.out`.
async fn open<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    who: Login,
    socket: Option<Arc<OwnedWriteHalf>>,
    shared: &Shared,
    cancel: &CancellationToken,
) -> Option<Opened>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (wire, connect, will, login) = Box::pin(read_connect(stream, buf, shared)).await?;
    let refused = match vet_connect(wire, &connect, will.as_ref(), shared) {
        Ok(()) => Box::pin(check_login(wire, &connect, login, who, shared)).await,
        Err(code) => Err(code),
    };
    let identity = match refused {
        Ok(identity) => identity,
        Err(code) => {
            let _ = stream.write_all(&refusal(wire, code)).await;
            Box::pin(linger(&mut *stream)).await;
            return None;
        }
    };
    let grants = shared.policy.grants(&identity);
    let will = will.and_then(|w| will_of(w, &grants, &identity.client_id, shared));
    let mut opened = start(wire, connect, grants, socket, shared, cancel);
    opened.will = will;
    Some(opened)
}

/// Reads until the CONNECT has arrived within `connect_timeout_ms`; a client that sends an
/// unsupported protocol level or too large a CONNECT is told so in a CONNACK.
async fn read_connect<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    shared: &Shared,
) -> Option<(
    Wire,
    Connect,
    Option<LastWill>,
    Option<rumqttc::v5::mqttbytes::v5::Login>,
)>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let first = tokio::time::timeout(
        shared.connect_within,
        Box::pin(first_packet(&mut *stream, buf, shared.max_packet)),
    )
    .await;
    let refused = match first {
        Ok(Ok(Some((wire, Packet::Connect(connect, will, login))))) => {
            return Some((wire, connect, will, login))
        }
        // §3.1.2.2: CONNACK 0x84 (MQTT 5) or return code 1 (3.1.1) for a level the node does
        // not speak, in the form the client's level is closest to.
        Ok(Err(WireError::Level(level))) if level > 5 => {
            refusal(Wire::V5, ConnectReturnCode::UnsupportedProtocolVersion)
        }
        Ok(Err(WireError::Level(_))) => {
            refusal(Wire::V4, ConnectReturnCode::UnsupportedProtocolVersion)
        }
        Ok(Err(WireError::TooLarge(size)))
            if Wire::detect(buf).ok().flatten() == Some(Wire::V5) =>
        {
            debug!(size, "CONNECT larger than the node reads");
            refusal(Wire::V5, ConnectReturnCode::PacketTooLarge)
        }
        Ok(Err(WireError::Duplicate(_))) => refusal(Wire::V5, ConnectReturnCode::ProtocolError),
        Ok(Err(e)) => {
            debug!(error = %e, "connection closed before a valid CONNECT");
            return None;
        }
        _ => return None,
    };
    let _ = stream.write_all(&refused).await;
    Box::pin(linger(&mut *stream)).await;
    None
}

/// What the CONNECT asks that the protocol or the node refuses: a client id, a Receive
/// Maximum or Maximum Packet Size of 0 (§3.1.2.11.3, .5: Protocol Error), a will topic.
fn vet_connect(
    wire: Wire,
    connect: &Connect,
    will: Option<&LastWill>,
    shared: &Shared,
) -> Result<(), ConnectReturnCode> {
    if let Some(reason) = refuse_client_id(&connect.client_id) {
        warn!(error_code = "EM-BROKER-CLIENT-ID", client_id = %connect.client_id, reason, "refused MQTT client id");
        return Err(ConnectReturnCode::ClientIdentifierNotValid);
    }
    if connect.client_id.is_empty() && !connect.clean_start && wire == Wire::V4 {
        // 3.1.1 §3.1.3.1: an empty id needs a clean session.
        return Err(ConnectReturnCode::ClientIdentifierNotValid);
    }
    let props = connect.properties.as_ref();
    if props.and_then(|p| p.receive_maximum) == Some(0)
        || props.and_then(|p| p.max_packet_size) == Some(0)
    {
        return Err(ConnectReturnCode::ProtocolError);
    }
    if let Some(will) = will {
        let topic = std::str::from_utf8(&will.topic).ok();
        if !topic.is_some_and(|t| valid_topic(t) && shared.topics.admit(t)) {
            warn!(error_code = "EM-BROKER-TOPIC-BOUND", client_id = %connect.client_id,
                "refused a will topic: invalid or past broker.max_topic_levels / max_topic_bytes");
            return Err(ConnectReturnCode::TopicNameInvalid);
        }
    }
    Ok(())
}

/// Checks the login (a certificate's name wins); who the client is to the ACL, or the
/// CONNACK code that refuses it.
async fn check_login(
    wire: Wire,
    connect: &Connect,
    login: Option<rumqttc::v5::mqttbytes::v5::Login>,
    who: Login,
    shared: &Shared,
) -> Result<Identity, ConnectReturnCode> {
    let username = who.certified.clone().or_else(|| {
        login
            .as_ref()
            .map(|l| l.username.clone())
            .filter(|u| !u.is_empty())
    });
    if who.certified.is_none() && shared.policy.needs_login_check() {
        let (user, password) = login.map(|l| (l.username, l.password)).unwrap_or_default();
        let checked = shared
            .policy
            .check_login(who.peer, &user, &connect.client_id, password);
        match checked.await {
            Verdict::Admitted => {}
            Verdict::Busy => {
                warn!(error_code = "EM-AUTH-BUSY", client_id = %connect.client_id, username = %user,
                    peer = ?who.peer, "login not checked: the check queue is full or this address or username is held off after failures");
                return Err(if wire == Wire::V5 {
                    ConnectReturnCode::ServerBusy
                } else {
                    ConnectReturnCode::ServerUnavailable
                });
            }
            Verdict::Refused => {
                warn!(error_code = "EM-AUTH-REFUSED", client_id = %connect.client_id, username = %user, peer = ?who.peer, "login refused");
                return Err(if user.is_empty() {
                    ConnectReturnCode::NotAuthorized
                } else {
                    ConnectReturnCode::BadUserNamePassword
                });
            }
        }
    }
    // A username nobody checked (no users configured) is only a claim: such a client is
    // anonymous to the ACL, or naming a module would grant its rights.
    let verified = shared.policy.needs_login_check() || who.certified.is_some();
    Ok(Identity {
        username: username.filter(|_| verified),
        client_id: connect.client_id.clone(),
    })
}

/// The will a CONNECT carries, if its topic may be published to by this client: a will is
/// published without asking anyone, so a device could otherwise send as the cloud by dropping
/// its connection.
fn will_of(w: LastWill, grants: &Grants, client_id: &str, shared: &Shared) -> Option<Will> {
    let topic = String::from_utf8_lossy(&w.topic).into_owned();
    if publishable(grants, &topic).is_none() {
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
}

/// Starts or resumes the session, writes the CONNACK and what the session is owed.
fn start(
    wire: Wire,
    connect: Connect,
    grants: Grants,
    socket: Option<Arc<OwnedWriteHalf>>,
    shared: &Shared,
    cancel: &CancellationToken,
) -> Opened {
    let hub = &shared.hub;
    let props = connect.properties.clone().unwrap_or_default();
    let mut assigned = None;
    let client_id = if connect.client_id.is_empty() {
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
        qos2_in: connected.awaiting_release.clone(),
        qos2_held: HashSet::new(),
        subscriptions: HashSet::new(),
        acks: None,
        out: BytesMut::new(),
        direct: socket.map(|socket| Direct::new(socket, wire, limits.maximum_packet_size)),
    };
    if let Some(direct) = &conn.direct {
        conn.room.plug(direct.clone());
    }
    conn.send(Packet::ConnAck(ConnAck {
        session_present: connected.session_present,
        code: ConnectReturnCode::Success,
        properties: (wire == Wire::V5).then(|| connack_properties(shared, assigned)),
    }));
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
    Opened {
        conn,
        will: None,
        expiry,
        keep_alive: Duration::from_secs(u64::from(connect.keep_alive)),
        token,
        announced,
    }
}

/// The node's side of an MQTT 5 session: its limits and an assigned client id.
fn connack_properties(shared: &Shared, assigned: Option<String>) -> ConnAckProperties {
    ConnAckProperties {
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
        // Keep-alive 0 is honoured as asked (§3.1.2.10): no Server Keep Alive is imposed.
        server_keep_alive: None,
        response_information: None,
        server_reference: None,
        authentication_method: None,
        authentication_data: None,
    }
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

/// The DISCONNECT reason code for a packet the node could not take (§4.13).
fn reason_for(error: &WireError) -> DisconnectReasonCode {
    match error {
        WireError::TooLarge(_) => DisconnectReasonCode::PacketTooLarge,
        WireError::Duplicate(_) => DisconnectReasonCode::ProtocolError,
        _ => DisconnectReasonCode::MalformedPacket,
    }
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
                self.room.taken(&shared.hub);
                shared.hub.room.notify_waiters();
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
                    if let Some(end) = self.take_packets(stream, buf, shared, read == spare).await {
                        return end;
                    }
                    if buf.is_empty() && buf.capacity() > KEEP_BUFFER {
                        *buf = BytesMut::new();
                    }
                }
            }
        }
    }

    /// Handles every whole packet read; `filled`: the last read filled what was free, so more
    /// is likely waiting. Some when the connection ends.
    async fn take_packets<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        stream: &mut S,
        buf: &mut BytesMut,
        shared: &Shared,
        mut filled: bool,
    ) -> Option<End> {
        loop {
            let packet = match self.wire.read(buf, shared.max_packet) {
                Ok(None) if filled => {
                    // More is likely waiting. It is taken in larger reads, many packets a call,
                    // without waiting for it; an idle connection keeps only the small buffer.
                    buf.reserve(READ_MORE);
                    let spare = buf.capacity() - buf.len();
                    match poll_once(stream.read_buf(buf)) {
                        None => return None,
                        Some(Ok(n)) if n > 0 => {
                            filled = n == spare;
                            continue;
                        }
                        Some(_) => return Some(End::Lost),
                    }
                }
                other => other,
            };
            match packet {
                Ok(Some(packet)) => {
                    let step = self.handle(packet, shared);
                    if let Some(end) = self.step(step, shared).await {
                        return Some(self.ending(stream, end).await);
                    }
                }
                Ok(None) => return None,
                Err(e) => {
                    debug!(client_id = %self.client_id, error = %e, "malformed packet");
                    self.closing();
                    if self.wire == Wire::V5 {
                        let bye = Disconnect::new(reason_for(&e));
                        self.send(Packet::Disconnect(bye));
                        let _ = stream.write_all(&self.out).await;
                    }
                    return Some(End::Lost);
                }
            }
        }
    }

    /// What a handled packet left to do; Some when the connection ends.
    async fn step(&mut self, step: Option<Step>, shared: &Shared) -> Option<End> {
        match step? {
            Step::End(end) => Some(end),
            Step::Wait(waiting, owed) => {
                // A module's inbox is full: this client waits (its bytes stay in its socket)
                // while the others go on (protocol §6.10).
                shared.paused.fetch_add(1, Ordering::Relaxed);
                shared.pauses.fetch_add(1, Ordering::Relaxed);
                Box::pin(hand_to_links(waiting)).await;
                shared.paused.fetch_sub(1, Ordering::Relaxed);
                self.settle(owed);
                None
            }
            Step::Unheard(message, qos, owed) => {
                // MQTT orders packets per connection only, but a client that subscribes on one
                // connection and at once publishes on another expects the message. Tasks woken
                // together run last-woken first (tokio's LIFO slot), so a publish that reached
                // nobody goes to the back of the queue once, letting a SUBSCRIBE that arrived
                // first be handled, and is routed again. Only publishes nobody hears pay for it.
                tokio::task::yield_now().await;
                let ack = owed.as_ref().map(|(_, _, ack)| ack);
                let hub = &shared.hub;
                let (waiting, _) = hub.publish_heard(Some(self.session), message, qos, false, ack);
                if !waiting.is_empty() {
                    Box::pin(hand_to_links(waiting)).await;
                }
                self.settle(owed);
                None
            }
        }
    }

    /// The connection ends as `end` says: what is owed written, and a v5 client refused told
    /// why (§4.13).
    async fn ending<S: AsyncRead + AsyncWrite + Unpin>(&mut self, stream: &mut S, end: End) -> End {
        self.closing();
        if let End::Refused(reason) = end {
            if self.wire == Wire::V5 {
                self.send(Packet::Disconnect(Disconnect::new(reason)));
            }
        }
        let _ = stream.write_all(&self.out).await;
        if matches!(end, End::Refused(_)) {
            Box::pin(linger(stream)).await;
        }
        end
    }

    /// The connection was cut: for lagging a whole queue behind (0x97), because the node is
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
        match packet {
            Packet::Publish(publish) => return self.inbound(publish, shared),
            Packet::PubRel(rel) => {
                self.released(rel.pkid);
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
            Packet::Subscribe(subscribe) => return self.subscribe(subscribe, shared),
            Packet::Unsubscribe(unsubscribe) => return self.unsubscribe(unsubscribe, shared),
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

    /// A SUBSCRIBE: each filter granted or refused with its reason code, then the retained
    /// messages the granted ones get. A NUL in a filter is a malformed packet (§1.5.4), a
    /// Subscription Identifier of 0 a Protocol Error (§3.8.2.1.2).
    fn subscribe(&mut self, subscribe: Subscribe, shared: &Shared) -> Option<Step> {
        let hub = &*shared.hub;
        if subscribe.filters.iter().any(|f| f.path.contains('\0')) {
            return Some(Step::End(End::Refused(
                DisconnectReasonCode::MalformedPacket,
            )));
        }
        let id = subscribe.properties.as_ref().and_then(|p| p.id);
        if id == Some(0) {
            return Some(Step::End(End::Refused(DisconnectReasonCode::ProtocolError)));
        }
        let id = id.map(|id| id as u32);
        let mut codes = Vec::with_capacity(subscribe.filters.len());
        let mut retained = Vec::new();
        for filter in subscribe.filters {
            if !shared.topics.admit(&filter.path) {
                warn!(error_code = "EM-BROKER-TOPIC-BOUND", client_id = %self.client_id,
                    bytes = filter.path.len(), "subscribe refused: filter past broker.max_topic_levels or max_topic_bytes");
                codes.push(SubscribeReasonCode::TopicFilterInvalid);
                continue;
            }
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
            match hub.subscribe(&self.client_id, self.session, &filter.path, options.clone()) {
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
        None
    }

    /// An UNSUBSCRIBE: a filter past the bounds cannot be held, so it is answered 0x8F
    /// without a look.
    fn unsubscribe(&mut self, unsubscribe: Unsubscribe, shared: &Shared) -> Option<Step> {
        let hub = &*shared.hub;
        if unsubscribe.filters.iter().any(|f| f.contains('\0')) {
            return Some(Step::End(End::Refused(
                DisconnectReasonCode::MalformedPacket,
            )));
        }
        let bounds = shared.topics;
        let reasons = unsubscribe
            .filters
            .iter()
            .map(|f| {
                if !bounds.admit(f) {
                    return UnsubAckReason::TopicFilterInvalid;
                }
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
        let topic = match self.topic_of(&mut publish, properties.as_mut(), shared) {
            Ok(topic) => topic,
            Err(reason) => return Some(Step::End(End::Refused(reason))),
        };
        let qos = qos_num(publish.qos);
        if qos == 2 && self.awaiting_release(publish.pkid) {
            // A resent QoS 2 publish (§4.3.3): answered once its first copy is.
            if !self.qos2_held.contains(&publish.pkid) {
                self.send(Packet::PubRec(PubRec::new(publish.pkid, None)));
            }
            return None;
        }
        if publishable(&self.grants, &topic).is_none() {
            self.refuse_publish(&topic, qos, publish.pkid, &shared.policy);
            return None;
        }
        if qos == 2 {
            let awaiting = self.await_release(publish.pkid);
            if awaiting > usize::from(RECEIVE_MAX) && self.wire == Wire::V5 {
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
        let (waiting, heard) = shared.hub.publish_heard(
            Some(self.session),
            message.clone(),
            qos,
            publish.retain,
            ack.as_ref(),
        );
        let owed = kind.zip(ack).map(|(kind, ack)| (kind, publish.pkid, ack));
        if !heard && !publish.retain {
            return Some(Step::Unheard(message, qos, owed));
        }
        if !waiting.is_empty() {
            return Some(Step::Wait(waiting, owed));
        }
        self.settle(owed);
        None
    }

    /// A PUBLISH's topic: its alias resolved (§3.3.2.3.4), then checked: ill-formed UTF-8 or
    /// a NUL is a malformed packet (§1.5.4), a wildcard or a topic past the node's bounds one
    /// it does not accept (0x90).
    fn topic_of(
        &mut self,
        publish: &mut Publish,
        properties: Option<&mut PublishProperties>,
        shared: &Shared,
    ) -> Result<String, DisconnectReasonCode> {
        if let Some(alias) = properties.and_then(|p| p.topic_alias.take()) {
            // §3.3.2.3.4: 0 or above the maximum the node gave is a Topic Alias invalid.
            if alias == 0 || alias > ALIASES_IN {
                return Err(DisconnectReasonCode::TopicAliasInvalid);
            }
            if publish.topic.is_empty() {
                match self.aliases_in.get(&alias) {
                    Some(topic) => publish.topic = topic.clone(),
                    None => return Err(DisconnectReasonCode::ProtocolError),
                }
            } else {
                self.aliases_in.insert(alias, publish.topic.clone());
            }
        }
        // §1.5.4: ill-formed UTF-8 or a NUL in a topic is a malformed packet, not a topic to
        // repair; a topic past the node's bounds is one it does not accept (0x90).
        let Ok(topic) = String::from_utf8(publish.topic.to_vec()) else {
            return Err(DisconnectReasonCode::MalformedPacket);
        };
        if topic.contains('\0') {
            return Err(DisconnectReasonCode::MalformedPacket);
        }
        if !shared.topics.admit(&topic) {
            warn!(error_code = "EM-BROKER-TOPIC-BOUND", client_id = %self.client_id,
                bytes = topic.len(), "publish refused: topic past broker.max_topic_levels or max_topic_bytes");
            return Err(DisconnectReasonCode::TopicNameInvalid);
        }
        if !valid_topic(&topic) {
            return Err(DisconnectReasonCode::TopicNameInvalid);
        }
        Ok(topic)
    }

    /// A publish the ACL refuses: counted, logged and answered "not authorized" (QoS 1, 2).
    fn refuse_publish(&mut self, topic: &str, qos: u8, pkid: u16, policy: &Policy) {
        let denied = policy.count_denied_publish();
        warn!(error_code = "EM-ACL-PUBLISH-DENIED", client_id = %self.client_id, %topic, denied,
            "publish refused by the ACL");
        match qos {
            1 => {
                let mut ack = PubAck::new(pkid, None);
                ack.reason = PubAckReason::NotAuthorized;
                self.send(Packet::PubAck(ack));
            }
            2 => {
                let mut rec = PubRec::new(pkid, None);
                rec.reason = rumqttc::v5::mqttbytes::v5::PubRecReason::NotAuthorized;
                self.send(Packet::PubRec(rec));
            }
            _ => {}
        }
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

    fn qos2(&self) -> std::sync::MutexGuard<'_, HashSet<u16>> {
        self.qos2_in
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn awaiting_release(&self, pkid: u16) -> bool {
        self.qos2().contains(&pkid)
    }

    /// Records a QoS 2 id as received; how many await release now.
    fn await_release(&self, pkid: u16) -> usize {
        let mut ids = self.qos2();
        ids.insert(pkid);
        ids.len()
    }

    fn released(&self, pkid: u16) {
        self.qos2().remove(&pkid);
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
