//! A connection's CONNECT: read within its time, vetted (client id, protocol rules, login on
//! the check pool), the session started or resumed and the CONNACK written; a connection over
//! the limit refused.

use super::*;

/// Connections over the limit told so at once, each for at most a second; past them a new
/// connection is closed unanswered.
const REFUSING_MAX: usize = 64;

/// A connection over `max_connections`: its CONNECT's first bytes name the version, the
/// CONNACK refuses it in that version, and it is closed. Reads at most 512 bytes.
pub(super) async fn refuse_over_limit<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    shared: &Shared,
) {
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

/// Reads the CONNECT and answers it: refused (client id, login, a rule of the protocol), or
/// the session it starts or resumes with its CONNACK and what it is owed written to
/// `conn.out`.
pub(super) async fn open<S>(
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
    let mut reading = Reading::new(shared.reading.clone());
    let (wire, connect, will, login) =
        Box::pin(read_connect(stream, buf, &mut reading, shared)).await?;
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
    let mut opened = start(wire, connect, grants, socket, reading, (shared, cancel));
    opened.will = will;
    Some(opened)
}

/// Reads until the CONNECT has arrived within `connect_timeout_ms`; a client that sends an
/// unsupported protocol level or too large a CONNECT is told so in a CONNACK.
async fn read_connect<S>(
    stream: &mut S,
    buf: &mut BytesMut,
    reading: &mut Reading,
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
        Box::pin(first_packet(&mut *stream, buf, reading, shared.max_packet)),
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
        // No room to read it: refused as a client over `max_connections` is, free to retry.
        Ok(Err(WireError::OverBudget)) => match Wire::detect(buf).ok().flatten() {
            Some(Wire::V5) => refusal(Wire::V5, ConnectReturnCode::QuotaExceeded),
            _ => refusal(Wire::V4, ConnectReturnCode::ServerUnavailable),
        },
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
    if !publishable(grants, &topic) {
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
    reading: Reading,
    (shared, cancel): (&Shared, &CancellationToken),
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
        reading,
        packets_in: 0,
        acks_only: false,
        published: false,
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

/// Reads until the CONNECT has arrived: the version it names, and the packet.
async fn first_packet<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    reading: &mut Reading,
    max_packet: u32,
) -> Result<Option<(Wire, Packet)>, WireError> {
    loop {
        if let Some(wire) = Wire::detect(buf)? {
            if let Some(packet) = wire.read(buf, max_packet)? {
                return Ok(Some((wire, packet)));
            }
        }
        if let Err(e) = reading.reserve(buf, 256) {
            // What was read stays, for the refusal to name the version.
            reading.budget().refused("", buf.len() + 256);
            return Err(e);
        }
        match stream.read_buf(buf).await {
            Ok(0) | Err(_) => return Ok(None),
            Ok(_) => {}
        }
    }
}
