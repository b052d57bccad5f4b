//! One client connection on the one path: its task owns the socket, reads and answers its
//! packets, applies the session rules and the node's policy (login, ACL, limits), and writes
//! what its session is owed when its mailbox rings, and the PUBACKs the node's modules release
//! after their commit. Buffers are empty while the client is idle.

mod connect;
mod publish;
mod reading;
mod run;
mod subscribe;

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
use crate::direct::{drain, publish_of, AckNow, Direct, SharedTcp};
use crate::events::ClientEvents;
use crate::hub::{hand_to_links, Behind, ForLinks, Hub, Mailroom};
use crate::index::{valid_topic, Options, RetainHandling, SessionId, TopicBounds};
use crate::login::Verdict;
use crate::mailbox::{Limits, Published, Resend};
use crate::registry::Will;
use crate::security::{publishable, reserved, Grants, Identity, Policy};
use crate::wire::{Packet, Wire, WireError};
use crate::RESERVED_CLIENT_PREFIX;

use connect::{open, refuse_over_limit};
pub use reading::ReadBudget;
use reading::Reading;

/// Topic aliases a client may use towards the node (§3.2.2.3.8).
const ALIASES_IN: u16 = 16;

/// QoS 1 and 2 publishes a client may have unacknowledged at once (the node's Receive
/// Maximum, §3.2.2.3.3); an MQTT 5 client past it is disconnected with 0x93.
const RECEIVE_MAX: u16 = 100;

/// QoS 1 and 2 publishes the node has in flight to one client at most, whatever the client's
/// Receive Maximum (an MQTT 3.1.1 client has none): what waits beyond them stays in its queue,
/// which is bounded, rather than in the socket.
const INFLIGHT_MAX: u16 = 100;

/// A read or write buffer larger than this is given back once drained.
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
    /// How long one packet may take from its first byte to its last (`packet_timeout_ms`).
    pub packet_within: Duration,
    /// The most levels and bytes of a client's topic or filter.
    pub topics: TopicBounds,
    /// What the connections' read buffers hold together past [`KEEP_BUFFER`] each at most.
    pub reading: Arc<ReadBudget>,
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
            packet_within: Duration::from_secs(60),
            topics: TopicBounds::PROTOCOL,
            reading: ReadBudget::new(usize::MAX, usize::MAX),
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
    /// The read buffer's share of `broker.read_buffers_bytes`.
    reading: Reading,
    /// Whole packets read so far: a read that completed one began the part after it.
    packets_in: u64,
    /// Every packet of the last read was an acknowledgement (PUBACK, PUBCOMP): nothing the
    /// node answers, so nothing carries the TCP ACK for it.
    acks_only: bool,
    /// The last read held a PUBLISH.
    published: bool,
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
    S: AsyncRead + AsyncWrite + AckNow + Unpin,
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
    let admitted = shared.admit();
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    serve_tcp_admitted(stream, peer, admitted, shared, cancel).await;
}

/// [`serve_tcp`] of a connection counted already (`None`: it is over the limit) from `peer`,
/// as its accept gave it (no system call to ask again). The accept loop counts each before it
/// spawns its task, so connections are counted in the order they came, whichever task runs first.
pub(crate) async fn serve_tcp_admitted(
    stream: tokio::net::TcpStream,
    peer: Option<IpAddr>,
    admitted: Option<Admitted>,
    shared: Arc<Shared>,
    cancel: CancellationToken,
) {
    let Some(admitted) = admitted else {
        return refuse_over_limit(stream, &shared).await;
    };
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

impl Conn {
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
        self.acks_only &= matches!(packet, Packet::PubAck(_) | Packet::PubComp(_));
        self.published |= matches!(packet, Packet::Publish(_));
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

    /// Writes what the session may be sent now; whether it took anything.
    fn drain_mailbox(&mut self) -> bool {
        let mut mailbox = self
            .room
            .mailbox
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        drain(&mut mailbox, self.wire, self.max_out, &mut self.out)
    }

    /// Before an empty write buffer is filled: the thread's larger one, if it has one free, so a
    /// batch of deliveries (up to the receive maximum) is encoded without regrowing a buffer.
    fn borrow_out(&mut self) {
        let lent = crate::direct::lend();
        if lent.capacity() > self.out.capacity() {
            crate::direct::give_back(std::mem::replace(&mut self.out, lent));
        } else {
            crate::direct::give_back(lent);
        }
    }

    /// Once the write buffer is empty again: one larger than [`KEEP_BUFFER`] goes back to the
    /// thread, so an idle connection holds at most that much.
    fn return_out(&mut self) {
        if self.out.capacity() > KEEP_BUFFER {
            crate::direct::give_back(std::mem::take(&mut self.out));
        }
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
