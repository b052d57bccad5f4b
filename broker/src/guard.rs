//! The codec wrapper that is edgemeta's front door: rumqttd decodes, we vet, rumqttd acts.
//!
//! rumqttd 0.20 clones the codec given to `Server::new` for every connection, so a wrapper sees
//! that connection's CONNECT (identity) and every PUBLISH and SUBSCRIBE, and can keep
//! per-connection state. It enforces what rumqttd cannot: client ids that would poison a
//! listener (rumqttd #1062), anonymous access, the topic ACL and the subscription limit. It also
//! contains rumqttd defects that only the codec can reach:
//! - keep-alive 0 (allowed by MQTT, refused by rumqttd #943) becomes the longest keep-alive;
//! - every stored publish is copied out of the connection's read buffer, which rumqttd would
//!   otherwise keep alive whole for each message in its logs (rumqttd #1001);
//! - a v5 client's topic aliases are resolved before the ACL sees the topic, and the broker never
//!   sends aliases (rumqttd 0.20 keys them by subscription filter, not by topic);
//! - what each QoS 1/2 subscriber is owed is counted, so one that lags is cut off ([`Lag`]);
//! - `$hw/...` and `$ke/...`, which rumqttd would refuse, travel inside it as `edgemeta$...`
//!   ([`dollar`]): clients' topics and filters are converted on the way in and out, and the ACL,
//!   the backlog and the lag all see the broker form; such a message reaches a client only
//!   through a filter that names `$hw` or `$ke` ([`withhold`]: not through `#` or `+/...`).

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use rumqttd::protocol::{
    Connect, ConnectReturnCode, Error as CodecError, Login, Packet, Protocol, PubAckReason,
    Publish, PublishProperties, QoS, SubscribeReasonCode,
};
use tracing::warn;

use crate::backlog::Backlog;
use crate::dollar;
use crate::events::ClientEvents;
use crate::framing::{head, Head};
use crate::front::{take_preamble, Preamble};
use crate::lag::{log_size, Lag, Owed, Via};
use crate::security::{publishable, reserved, Grants, Identity, Policy, DENIED_FILTER};
use crate::session::{ack_tag, AckKind, Rights, Session, Sessions, ACK_PROPERTY};
use crate::withhold::Withheld;
use crate::RESERVED_CLIENT_PREFIX;

/// Where refused publications go: rumqttd never matches a `$` topic against any filter.
const DENIED_TOPIC: &str = "$edgemeta/denied";
/// Stands in for a keep-alive of 0: rumqttd then drops the client only after 1.5 × this many
/// seconds of silence (27 h), and an MQTT 5 client is told to ping at least this often.
pub const KEEP_ALIVE_FOR_ZERO: u16 = u16::MAX;

/// Wraps rumqttd's codec to vet CONNECT, PUBLISH and SUBSCRIBE before rumqttd acts on them.
pub struct ConnectGuard<P> {
    inner: P,
    policy: Arc<Policy>,
    v5: bool,
    connection: Mutex<Connection>,
    /// Set on a listener's back end: the secret its preamble must carry, and where the front
    /// registered the connection's session.
    front: Option<(Arc<str>, Arc<Sessions>)>,
    /// Counts publishes to our links' filters, so the front can pause clients in time.
    backlog: Option<Arc<Backlog>>,
    /// Counts what QoS 1/2 subscribers are owed, so a lagging one is cut off.
    lag: Option<Arc<Lag>>,
    /// Tells subscribers when a client's connection is accepted and when it ends.
    events: Option<Arc<ClientEvents>>,
}

/// What one connection has been granted and refused.
#[derive(Debug, Default)]
struct Connection {
    identity: Option<Identity>,
    grants: Grants,
    /// Filters this connection holds (broker form), for the subscription limit.
    held: HashSet<String>,
    /// Packet ids of refused QoS 1 publishes, answered "not authorized" (MQTT 5).
    denied_publishes: HashSet<u16>,
    /// Packet id of a SUBSCRIBE → indices of its refused filters.
    denied_filters: HashMap<u16, Vec<usize>>,
    /// Back end of the front: whether the preamble was read, whether the front vouched for the
    /// connection, and the client certificate's name if it had one.
    preamble_read: bool,
    vouched: bool,
    certificate_name: Option<String>,
    /// The front's handle on this connection.
    session: Option<Arc<Session>>,
    client_id: String,
    /// The client asked for keep-alive 0: its CONNACK tells an MQTT 5 client the one in force.
    keep_alive_zero: bool,
    /// Nothing of the session outlives the connection (clean session, no v5 session expiry):
    /// the front may write hand-ons to it past rumqttd.
    clean: bool,
    /// MQTT 5 topic aliases the client set up.
    aliases: HashMap<u16, Bytes>,
    /// The last topic stored, shared by the next publishes to it instead of copied again.
    last_topic: Bytes,
    /// QoS 1/2 subscriptions by filter (broker form), with what each is owed.
    owed: HashMap<String, Arc<Owed>>,
    /// Shared subscriptions held (`$share/<group>/<filter>`), counted only as reaching a topic.
    shared: HashSet<String>,
    /// rumqttd's own PUBACKs / PUBCOMPs still to come for publishes the node acknowledges after
    /// commit, by packet id: they are not written (counted, since a packet id can be reused
    /// before rumqttd's early answer to its previous use is written).
    swallow: HashMap<(AckKind, u16), u32>,
    /// Filters of a SUBSCRIBE by packet id, counted once rumqttd acknowledges it: the router
    /// has registered them by then, and a subscription delivers only what is published after.
    subscribing: HashMap<u16, Vec<(String, QoS)>>,
    /// Counted among the broker's clients ([`Sessions::admit_client`]), or refused for the
    /// connection limit.
    admitted: bool,
    over_limit: bool,
    /// `$` messages rumqttd sent through a wildcard filter, kept from the client.
    withheld: Withheld,
    /// The number [`ClientEvents`] gave this connection once it was accepted.
    announced: Option<u64>,
}

/// What the guard does with a packet rumqttd is sending.
enum Answer {
    Write,
    /// Nothing: the front writes this acknowledgement after the commit, or it is the PUBREL of a
    /// withheld publish.
    Skip,
    /// A publish the client may not have; rumqttd is told it was acknowledged.
    Withhold,
}

impl<P> ConnectGuard<P> {
    pub fn new(inner: P, policy: Arc<Policy>, v5: bool) -> Self {
        ConnectGuard {
            inner,
            policy,
            v5,
            connection: Mutex::new(Connection::default()),
            front: None,
            backlog: None,
            lag: None,
            events: None,
        }
    }

    /// Counts this listener's publishes in `backlog`.
    pub fn counting(mut self, backlog: Arc<Backlog>) -> Self {
        self.backlog = Some(backlog);
        self
    }

    /// Counts what this listener's QoS 1/2 subscribers are owed in `lag`.
    pub fn watching(mut self, lag: Arc<Lag>) -> Self {
        self.lag = Some(lag);
        self
    }

    /// Announces this listener's clients' connections through `events`.
    pub fn announcing(mut self, events: Arc<ClientEvents>) -> Self {
        self.events = Some(events);
        self
    }

    /// The guard of a listener reachable only through our front (`front.rs`).
    pub fn behind_front(mut self, secret: Arc<str>, sessions: Arc<Sessions>) -> Self {
        self.front = Some((secret, sessions));
        self
    }
}

/// A connection's subscriptions stop being counted, and its end is announced, when rumqttd
/// drops its codec.
impl<P> Drop for ConnectGuard<P> {
    fn drop(&mut self) {
        let connection = self.connection.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(lag) = &self.lag {
            for owed in connection.owed.values() {
                lag.unsubscribe(owed);
            }
            for path in &connection.shared {
                if let Some(filter) = shared_filter(path) {
                    lag.unshare(filter);
                }
            }
        }
        if let (true, Some((_, sessions))) = (connection.admitted, &self.front) {
            sessions.client_left();
        }
        if let (Some(events), Some(number)) = (&self.events, connection.announced) {
            events.ended(&connection.client_id, number);
        }
    }
}

/// Each clone serves one new connection, so it starts with no state.
impl<P: Clone> Clone for ConnectGuard<P> {
    fn clone(&self) -> Self {
        let mut guard = ConnectGuard::new(self.inner.clone(), self.policy.clone(), self.v5);
        guard.front = self.front.clone();
        guard.backlog = self.backlog.clone();
        guard.lag = self.lag.clone();
        guard.events = self.events.clone();
        guard
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

/// The filter a subscription matches topics with: `$share/<group>/<filter>` shares `<filter>`.
fn shared_filter(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("$share/")?;
    let (group, filter) = rest.split_once('/')?;
    (!group.is_empty() && !filter.is_empty()).then_some(filter)
}

/// Whether a client with `grants` may subscribe to its filter `path` (a shared subscription is
/// checked by the filter it shares; other `$` filters would make rumqttd drop the client).
fn may_subscribe(grants: &Grants, path: &str) -> bool {
    let filter = shared_filter(path).unwrap_or(path);
    !reserved(filter) && grants.may_subscribe(&dollar::to_broker(filter))
}

/// A client's topic as rumqttd stores it, copied out of the read buffer (see [`own`]).
fn broker_topic(client: &[u8]) -> Bytes {
    Bytes::from([dollar::broker_prefix(client), client].concat())
}

/// Copies what rumqttd will store out of the connection's read buffer, whose allocation each
/// `Bytes` slice would otherwise keep alive (rumqttd #1001), the topic in its broker form. A
/// topic repeated from the last publish shares that one's copy.
fn own(publish: &mut Publish, properties: &mut Option<PublishProperties>, last_topic: &mut Bytes) {
    let prefix = dollar::broker_prefix(&publish.topic);
    let repeated = last_topic
        .strip_prefix(prefix)
        .is_some_and(|rest| rest == &publish.topic[..]);
    if !repeated {
        *last_topic = broker_topic(&publish.topic);
    }
    publish.topic = last_topic.clone();
    publish.payload = Bytes::copy_from_slice(&publish.payload);
    if let Some(data) = properties
        .as_mut()
        .and_then(|p| p.correlation_data.as_mut())
    {
        *data = Bytes::copy_from_slice(data);
    }
}

/// What a complete QoS 1/2 PUBLISH at the start of `stream` is acknowledged with, and its packet
/// id, read before rumqttd decodes it (rumqttd keeps `Publish::qos` and `pkid` private).
fn publish_ack(stream: &[u8]) -> Option<(AckKind, u16)> {
    let first = *stream.first()?;
    let kind = match (first >> 1) & 0b11 {
        _ if first >> 4 != 3 => return None,
        1 => AckKind::PubAck,
        2 => AckKind::PubComp,
        _ => return None,
    };
    let mut offset = 1;
    let mut shift = 0;
    loop {
        let byte = *stream.get(offset)?;
        offset += 1;
        if byte & 0x80 == 0 || shift > 21 {
            break;
        }
        shift += 7;
    }
    let topic_len = usize::from(u16::from_be_bytes([
        *stream.get(offset)?,
        *stream.get(offset + 1)?,
    ]));
    let at = offset + 2 + topic_len;
    let pkid = u16::from_be_bytes([*stream.get(at)?, *stream.get(at + 1)?]);
    Some((kind, pkid))
}

impl<P: Protocol> ConnectGuard<P> {
    fn vet(&self, packet: &mut Packet, ack: Option<(AckKind, u16)>) {
        let pkid = ack.map(|(_, pkid)| pkid);
        let mut connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(session) = &connection.session {
            session.heard(matches!(packet, Packet::PubAck(..) | Packet::PubRec(..)));
        }
        connection.withheld.client_answered(packet);
        match packet {
            Packet::Connect(connect, properties, will, _, login) => {
                let unvouched = self.front.is_some() && !connection.vouched;
                let refusal = if unvouched {
                    Some("reached a listener's back end without its front")
                } else {
                    refuse_client_id(&connect.client_id)
                };
                if let Some(reason) = refusal {
                    warn!(error_code = "EM-BROKER-CLIENT-ID", client_id = %connect.client_id, reason, "refused MQTT client id");
                    refuse_before_rumqttd(connect);
                    return;
                }
                if let Some((_, sessions)) = &self.front {
                    if !sessions.admit_client() {
                        warn!(error_code = "EM-BROKER-CONNECTION-LIMIT", client_id = %connect.client_id, "refused a client: broker.max_connections reached");
                        refuse_before_rumqttd(connect);
                        connection.over_limit = true;
                        return;
                    }
                    connection.admitted = true;
                }
                connection.client_id = connect.client_id.clone();
                if let Some(lag) = &self.lag {
                    if lag.take_cut_client(&connect.client_id) {
                        connect.clean_session = true;
                    }
                }
                connection.clean = connect.clean_session
                    && properties
                        .as_ref()
                        .is_none_or(|p| p.session_expiry_interval.unwrap_or(0) == 0);
                if connect.keep_alive == 0 {
                    connect.keep_alive = KEEP_ALIVE_FOR_ZERO;
                    connection.keep_alive_zero = true;
                }
                if let Some(properties) = properties {
                    properties.topic_alias_max = None;
                }
                // A verified certificate's name is the identity, whatever login was sent.
                if let (Some(name), Some((secret, _))) = (&connection.certificate_name, &self.front)
                {
                    *login = Some(Login {
                        username: name.clone(),
                        password: secret.to_string(),
                    });
                }
                // rumqttd refuses a login-less CONNECT once any credential check is on; an
                // empty username stands for the anonymous client, which the check may admit.
                if login.is_none() && self.policy.needs_login_check() {
                    *login = Some(Login {
                        username: String::new(),
                        password: String::new(),
                    });
                }
                // A username nobody checked (no users configured) is only a claim: such a
                // client is anonymous to the ACL, or naming a module would grant its rights.
                let verified =
                    self.policy.needs_login_check() || connection.certificate_name.is_some();
                let identity = Identity {
                    username: login
                        .as_ref()
                        .map(|l| l.username.clone())
                        .filter(|u| verified && !u.is_empty()),
                    client_id: connect.client_id.clone(),
                };
                connection.grants = self.policy.grants(&identity);
                // rumqttd publishes a will without asking anyone: its topic is vetted as a
                // publish now, or a device could send as the cloud by dropping its connection.
                if let Some(will) = will {
                    will.message = Bytes::copy_from_slice(&will.message);
                    let topic = String::from_utf8_lossy(&will.topic).into_owned();
                    if publishable(&connection.grants, &topic).is_some() {
                        will.topic = broker_topic(&will.topic);
                    } else {
                        self.policy.count_denied_publish();
                        warn!(error_code = "EM-ACL-WILL-DENIED", client_id = %connect.client_id, %topic, "will topic not permitted; the will goes nowhere");
                        will.topic = DENIED_TOPIC.into();
                    }
                }
                connection.identity = Some(identity);
            }
            Packet::Publish(publish, properties) => {
                let alias = properties.as_ref().and_then(|p| p.topic_alias);
                if let Some(alias) = alias {
                    if publish.topic.is_empty() {
                        // Unknown aliases are rumqttd's to refuse (protocol error).
                        if let Some(topic) = connection.aliases.get(&alias) {
                            publish.topic = topic.clone();
                        }
                    } else {
                        let topic = Bytes::copy_from_slice(&publish.topic);
                        connection.aliases.insert(alias, topic);
                    }
                }
                let client_topic = String::from_utf8_lossy(&publish.topic).into_owned();
                if let Some(topic) = publishable(&connection.grants, &client_topic) {
                    own(publish, properties, &mut connection.last_topic);
                    if let Some(p) = properties.as_mut() {
                        p.user_properties.retain(|(key, _)| key != ACK_PROPERTY);
                    }
                    if let Some(backlog) = &self.backlog {
                        backlog.published(&topic, publish.payload.len());
                        let session = connection.session.as_ref().map(|s| s.id());
                        if let (Some(session), true) = (session, backlog.consumes(&topic)) {
                            // QoS 0 too: the link's receipt tells the front it may hand this
                            // client's next publishes to the links itself (see `Session::routed`).
                            properties
                                .get_or_insert_with(Default::default)
                                .user_properties
                                .push((ACK_PROPERTY.to_owned(), ack_tag(session, ack)));
                            if let Some(ack) = ack {
                                *connection.swallow.entry(ack).or_default() += 1;
                            }
                        }
                    }
                    if let Some(lag) = &self.lag {
                        lag.published(&topic, log_size(topic.len(), publish.payload.len()));
                    }
                    return;
                }
                let denied = self.policy.count_denied_publish();
                warn!(
                    error_code = "EM-ACL-PUBLISH-DENIED",
                    identity = ?connection.identity,
                    topic = %client_topic,
                    denied,
                    "publish refused by the ACL"
                );
                publish.topic = DENIED_TOPIC.into();
                publish.payload = bytes::Bytes::new();
                if let Some(pkid) = pkid {
                    connection.denied_publishes.insert(pkid);
                }
            }
            Packet::Subscribe(subscribe, _) => {
                let mut refused = Vec::new();
                for (index, filter) in subscribe.filters.iter_mut().enumerate() {
                    let allowed = may_subscribe(&connection.grants, &filter.path);
                    let path = dollar::filter_to_broker(&filter.path);
                    let room = connection.held.contains(path.as_ref())
                        || connection.held.len() < self.policy.max_subscriptions();
                    if allowed && room {
                        let path = path.into_owned();
                        connection.held.insert(path.clone());
                        connection
                            .subscribing
                            .entry(subscribe.pkid)
                            .or_default()
                            .push((path.clone(), filter.qos));
                        filter.path = path;
                        continue;
                    }
                    let denied = self.policy.count_denied_subscribe();
                    let reason = if allowed {
                        "subscription limit reached"
                    } else {
                        "not allowed by the ACL"
                    };
                    warn!(
                        error_code = "EM-ACL-SUBSCRIBE-DENIED",
                        identity = ?connection.identity,
                        filter = %filter.path,
                        reason,
                        denied,
                        "subscribe refused"
                    );
                    filter.path = DENIED_FILTER.to_owned();
                    refused.push(index);
                }
                if !refused.is_empty() {
                    connection.denied_filters.insert(subscribe.pkid, refused);
                }
            }
            Packet::Unsubscribe(unsubscribe, _) => {
                for filter in &mut unsubscribe.filters {
                    let path = dollar::filter_to_broker(filter);
                    if let Cow::Owned(path) = path {
                        *filter = path;
                    }
                    connection.held.remove(filter.as_str());
                    for pending in connection.subscribing.values_mut() {
                        pending.retain(|(path, _)| path != filter);
                    }
                    self.count_owed(&mut connection, filter, None);
                }
            }
            _ => {}
        }
    }

    /// Counts what a subscription to `path` at `qos` is owed; `None`: unsubscribed. Shared
    /// subscriptions are not counted (each member gets only some of the filter's messages),
    /// only known to reach their filter's topics.
    fn count_owed(&self, connection: &mut Connection, path: &str, qos: Option<QoS>) {
        let Some(lag) = &self.lag else { return };
        if let Some(filter) = shared_filter(path) {
            match qos {
                Some(_) if connection.session.is_some() => {
                    if connection.shared.insert(path.to_owned()) {
                        lag.share(filter);
                    }
                }
                _ => {
                    if connection.shared.remove(path) {
                        lag.unshare(filter);
                    }
                }
            }
            return;
        }
        // A new subscription to a filter held replaces it (its QoS may differ).
        if let Some(owed) = connection.owed.remove(path) {
            lag.unsubscribe(&owed);
        }
        let (Some(qos), Some(session)) = (qos, &connection.session) else {
            return;
        };
        if !connection.clean {
            lag.keep(path);
        }
        let reliable = qos != QoS::AtMostOnce;
        // rumqttd resumes a persistent session from its logs, and answers QoS 2 itself.
        let via = if connection.clean && qos != QoS::ExactlyOnce {
            Via::Front { v5: self.v5 }
        } else {
            Via::Router
        };
        let owed = lag.subscribe(path, &connection.client_id, session, reliable, via);
        connection.owed.insert(path.to_owned(), owed);
    }

    /// rumqttd is writing a publish to this subscriber (or withheld it, `written` false): pay it
    /// off against the subscription it came through (with overlapping filters, the one owed most).
    fn paid(&self, connection: &Connection, publish: &Publish, written: bool) {
        // Retained messages sent on subscribing come from the retained store, not the log.
        if publish.retain || connection.owed.is_empty() {
            return;
        }
        let topic = String::from_utf8_lossy(&publish.topic);
        let owed = connection
            .owed
            .values()
            .filter(|o| rumqttd::protocol::matches(&topic, o.filter()))
            .max_by_key(|o| o.bytes());
        if let (Some(owed), Some(lag)) = (owed, &self.lag) {
            lag.delivered(owed);
            if owed.is_reliable() && written {
                if let Some(session) = &connection.session {
                    session.sent_reliable();
                }
            }
        }
    }

    /// Adjusts what rumqttd sends. An error stops rumqttd writing to a client that was cut off.
    fn answer(&self, packet: &mut Packet) -> Result<Answer, CodecError> {
        let mut connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
        if let (Packet::ConnAck(ack, _), Some(events)) = (&packet, &self.events) {
            // A client without an id has none to announce (rumqttd makes one up).
            let accepted = ack.code == ConnectReturnCode::Success;
            if accepted && !connection.client_id.is_empty() && connection.announced.is_none() {
                connection.announced = Some(events.connected(&connection.client_id));
            }
        }
        match packet {
            Packet::PubAck(ack, _) if swallowed(&mut connection, AckKind::PubAck, ack.pkid) => {
                return Ok(Answer::Skip);
            }
            Packet::PubComp(ack, _) if swallowed(&mut connection, AckKind::PubComp, ack.pkid) => {
                return Ok(Answer::Skip);
            }
            Packet::PubRel(rel, _) if connection.withheld.swallow_pubrel(rel.pkid) => {
                return Ok(Answer::Skip);
            }
            Packet::Publish(publish, properties) => {
                // Our tag travels with the message inside rumqttd; no subscriber sees it, and a
                // 3.1.1 codec cannot write properties at all.
                if let Some(p) = properties.as_mut() {
                    p.user_properties.retain(|(key, _)| key != ACK_PROPERTY);
                }
                if !self.v5 || properties.as_ref() == Some(&PublishProperties::default()) {
                    *properties = None;
                }
                // Cut off for lagging: nothing after the gap rumqttd is about to skip may reach
                // the client. The error ends rumqttd's side of the connection.
                if connection.session.as_ref().is_some_and(|s| s.is_cut()) {
                    return Err(CodecError::IncorrectPacketFormat);
                }
                let topic = String::from_utf8_lossy(&publish.topic);
                if !dollar::reaches(&topic, &connection.held) {
                    self.paid(&connection, publish, false);
                    return Ok(Answer::Withhold);
                }
                self.paid(&connection, publish, true);
                if let Some(topic) = dollar::bytes_to_client(&publish.topic) {
                    publish.topic = topic;
                }
            }
            Packet::ConnAck(ack, _) if connection.over_limit => {
                ack.code = if self.v5 {
                    ConnectReturnCode::QuotaExceeded
                } else {
                    ConnectReturnCode::ServiceUnavailable
                };
            }
            Packet::ConnAck(_, properties) if self.v5 && connection.keep_alive_zero => {
                properties
                    .get_or_insert_with(Default::default)
                    .server_keep_alive = Some(KEEP_ALIVE_FOR_ZERO);
            }
            Packet::PubAck(ack, _) if connection.denied_publishes.remove(&ack.pkid) && self.v5 => {
                ack.reason = PubAckReason::NotAuthorized;
            }
            Packet::SubAck(ack, _) => {
                for (path, qos) in connection.subscribing.remove(&ack.pkid).unwrap_or_default() {
                    self.count_owed(&mut connection, &path, Some(qos));
                }
                if let Some(refused) = connection.denied_filters.remove(&ack.pkid) {
                    for index in refused {
                        if let Some(code) = ack.return_codes.get_mut(index) {
                            *code = if self.v5 {
                                SubscribeReasonCode::NotAuthorized
                            } else {
                                SubscribeReasonCode::Failure
                            };
                        }
                    }
                }
            }
            _ => {}
        }
        if let (Packet::ConnAck(ack, _), Some(session)) = (&packet, &connection.session) {
            if ack.code == ConnectReturnCode::Success {
                session.grant(Rights {
                    grants: connection.grants.clone(),
                    v5: self.v5,
                });
            }
        }
        Ok(Answer::Write)
    }
}

/// Whether `packet` is a publish the guard tagged for a link ([`ACK_PROPERTY`]).
fn tagged(packet: &Packet) -> bool {
    let Packet::Publish(_, Some(properties)) = packet else {
        return false;
    };
    properties
        .user_properties
        .iter()
        .any(|(key, _)| key == ACK_PROPERTY)
}

/// An empty id with a persistent session makes rumqttd answer CONNACK "identifier rejected"
/// before it touches the state that #1062 poisons.
fn refuse_before_rumqttd(connect: &mut Connect) {
    connect.client_id.clear();
    connect.clean_session = false;
}

/// Whether rumqttd's answer to `pkid` is one the front sends after the commit instead.
fn swallowed(connection: &mut Connection, kind: AckKind, pkid: u16) -> bool {
    let std::collections::hash_map::Entry::Occupied(mut left) =
        connection.swallow.entry((kind, pkid))
    else {
        return false;
    };
    *left.get_mut() -= 1;
    if *left.get() == 0 {
        left.remove();
    }
    true
}

impl<P: Protocol> ConnectGuard<P> {
    /// The length of the publish at the front of `stream` if the front counted it as carried
    /// to our links (the same test on the same bytes as the front's).
    fn carried(&self, stream: &[u8]) -> Option<usize> {
        let backlog = self.backlog.as_ref()?;
        self.front.as_ref()?;
        match head(stream) {
            Head::Packet {
                len,
                topic: Some(topic),
                ..
            } if stream.len() >= len && backlog.consumes_client_topic(topic) => Some(len),
            _ => None,
        }
    }
}

impl<P: Protocol> Protocol for ConnectGuard<P> {
    fn read_mut(&mut self, stream: &mut BytesMut, max_size: usize) -> Result<Packet, CodecError> {
        if let Some((secret, sessions)) = &self.front {
            let connection = self.connection.get_mut().unwrap_or_else(|p| p.into_inner());
            if !connection.preamble_read {
                match take_preamble(stream, secret) {
                    Preamble::Incomplete => return Err(CodecError::InsufficientBytes(1)),
                    Preamble::Vouched { session, name } => {
                        connection.vouched = true;
                        connection.certificate_name = name;
                        connection.session = sessions.claim(session);
                    }
                    Preamble::Absent => {}
                }
                connection.preamble_read = true;
            }
        }
        // Acknowledgements of withheld publishes first: rumqttd reads again after every write.
        let connection = self.connection.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(packet) = connection.withheld.take_given() {
            return Ok(packet);
        }
        let ack = publish_ack(stream);
        let carried = self.carried(stream);
        let mut packet = self.inner.read_mut(stream, max_size)?;
        self.vet(&mut packet, ack);
        if let (Some(len), Some(backlog)) = (carried, &self.backlog) {
            let connection = self.connection.get_mut().unwrap_or_else(|p| p.into_inner());
            if let Some(session) = &connection.session {
                backlog.landed(session.landed(len));
                if !tagged(&packet) {
                    // Refused, or not for a link after all: no link will report it.
                    session.arrived();
                }
            }
        }
        Ok(packet)
    }

    fn write(&self, mut packet: Packet, write: &mut BytesMut) -> Result<usize, CodecError> {
        // rumqttd ignores the count of bytes written.
        let withhold = match self.answer(&mut packet)? {
            Answer::Skip => return Ok(0),
            Answer::Write => false,
            Answer::Withhold => true,
        };
        let publish = matches!(packet, Packet::Publish(..));
        let start = write.len();
        let written = self.inner.write(packet, write)?;
        if !publish {
            return Ok(written);
        }
        // QoS and packet id are private to rumqttd's `Publish`: read them off the encoding.
        if let Some((kind, pkid)) = publish_ack(&write[start..]) {
            let mut connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
            connection.withheld.sent(kind, pkid, withhold);
        }
        if withhold {
            write.truncate(start);
            return Ok(0);
        }
        Ok(written)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carried_dollar_topics_are_published_in_broker_form_and_the_carrier_is_reserved() {
        let open = Grants::default();
        assert_eq!(
            publishable(&open, "$hw/events/device/d/twin/update").as_deref(),
            Some("edgemeta$hw/events/device/d/twin/update")
        );
        assert_eq!(publishable(&open, "ke/a").as_deref(), Some("ke/a"));
        for topic in [
            "edgemeta$hw/a",
            "edgemeta$x",
            "$SYS/a",
            "$hw",
            DENIED_FILTER,
        ] {
            assert_eq!(publishable(&open, topic), None, "{topic}");
        }
        for filter in ["$hw/events/#", "$share/g/$ke/#", "#", "$share/g/a/#"] {
            assert!(may_subscribe(&open, filter), "{filter}");
        }
        for filter in [
            "edgemeta$hw/#",
            "$share/g/edgemeta$hw/#",
            "$SYS/#",
            "$share/g/",
        ] {
            assert!(!may_subscribe(&open, filter), "{filter}");
        }
    }

    #[test]
    fn an_owned_topic_is_in_broker_form_and_shared_with_the_last_one() {
        let mut last = Bytes::new();
        let mut first = Publish::new("$hw/a", "1", false);
        own(&mut first, &mut None, &mut last);
        assert_eq!(&first.topic[..], b"edgemeta$hw/a");
        let mut second = Publish::new("$hw/a", "2", false);
        own(&mut second, &mut None, &mut last);
        assert_eq!(first.topic.as_ptr(), second.topic.as_ptr());
        let mut plain = Publish::new("hw/a", "3", false);
        own(&mut plain, &mut None, &mut last);
        assert_eq!(&plain.topic[..], b"hw/a");
    }

    #[test]
    fn a_shared_subscription_is_judged_by_the_filter_it_shares() {
        assert_eq!(shared_filter("$share/g/ke/edged/#"), Some("ke/edged/#"));
        assert_eq!(shared_filter("$share/g/"), None);
        assert_eq!(shared_filter("$share//a"), None);
        assert_eq!(shared_filter("ke/edged/#"), None);
    }

    #[test]
    fn ids_rumqttd_cannot_handle_are_refused() {
        for id in ["dev/1", "a+b", "a#", "$sys", "edgemeta-metamanager"] {
            assert!(refuse_client_id(id).is_some(), "{id} should be refused");
        }
    }

    #[test]
    fn ordinary_ids_pass() {
        for id in ["dev-1", "sensor_7", "mosq-abc123", "", "edgemeta"] {
            assert!(refuse_client_id(id).is_none(), "{id} should pass");
        }
    }

    #[test]
    fn the_packet_id_of_a_qos1_publish_is_read_from_the_wire() {
        // PUBLISH qos1, remaining length 7, topic "a/b", pkid 0x1234, payload "x"
        let packet = [0x32, 0x08, 0x00, 0x03, b'a', b'/', b'b', 0x12, 0x34, b'x'];
        assert_eq!(publish_ack(&packet), Some((AckKind::PubAck, 0x1234)));
        let mut qos2 = packet;
        qos2[0] = 0x34;
        assert_eq!(publish_ack(&qos2), Some((AckKind::PubComp, 0x1234)));
        let qos0 = [0x30, 0x06, 0x00, 0x03, b'a', b'/', b'b', b'x'];
        assert_eq!(publish_ack(&qos0), None);
        assert_eq!(publish_ack(&[0x32, 0x08, 0x00]), None);
        assert_eq!(publish_ack(&[0x82, 0x08]), None);
    }
}
