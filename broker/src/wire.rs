//! MQTT on the wire for the one path: the pinned rumqttc's codecs (every packet in both
//! directions, public fields), and one packet model, MQTT 5's. A 3.1.1 client's packets are read
//! into it and written back from it, so each session rule is written once; the version is the
//! CONNECT's protocol level, so one listener serves both.

use bytes::BytesMut;
use rumqttc::mqttbytes::{self as m4, v4};
use rumqttc::v5::mqttbytes::{self as m5, v5};
use thiserror::Error;

pub use v5::Packet;

/// A byte stream that is not MQTT the node speaks; the connection is closed.
#[derive(Debug, Error)]
pub enum WireError {
    #[error("the first packet is not a CONNECT")]
    NotConnect,
    #[error("protocol level {0} (this node speaks 4, MQTT 3.1.1, and 5)")]
    Level(u8),
    #[error("malformed MQTT 3.1.1 packet: {0:?}")]
    V4(m4::Error),
    #[error("malformed MQTT 5 packet: {0:?}")]
    V5(m5::Error),
    #[error("an MQTT 3.1.1 client cannot be sent {0}")]
    NoV4Form(&'static str),
    /// Larger than the node reads (MQTT 5: 0x95 Packet too large).
    #[error("a packet of {0} bytes, more than the node reads")]
    TooLarge(usize),
    /// A form the spec calls malformed that the codec lets through (MQTT 5: 0x81).
    #[error("malformed packet: {0}")]
    Malformed(&'static str),
    /// The connections' read buffers hold `broker.read_buffers_bytes` already, and this
    /// packet needs more (MQTT 5: 0x97 Quota exceeded).
    #[error("no room left in broker.read_buffers_bytes for this packet")]
    OverBudget,
    /// A packet begun more than `broker.packet_timeout_ms` ago has not all arrived (MQTT 5:
    /// 0x8D Keep Alive timeout: no whole packet came in time).
    #[error("a packet took longer than broker.packet_timeout_ms to arrive")]
    Slow,
    /// A property that may appear once appeared again (MQTT 5: 0x82 Protocol Error).
    #[error("property 0x{0:02x} appears more than once")]
    Duplicate(u8),
}

/// The version a connection speaks, chosen by its CONNECT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    V4,
    V5,
}

impl Wire {
    /// The version of the CONNECT at the start of `buf`; None until enough bytes arrived.
    pub fn detect(buf: &[u8]) -> Result<Option<Wire>, WireError> {
        let Some(&first) = buf.first() else {
            return Ok(None);
        };
        if first >> 4 != 1 {
            return Err(WireError::NotConnect);
        }
        // The remaining length takes 1 to 4 bytes; then the protocol name's length and the name.
        let mut at = 1;
        while at < 5 {
            let Some(&byte) = buf.get(at) else {
                return Ok(None);
            };
            at += 1;
            if byte & 0x80 == 0 {
                break;
            }
        }
        let (Some(&hi), Some(&lo)) = (buf.get(at), buf.get(at + 1)) else {
            return Ok(None);
        };
        let level_at = at + 2 + usize::from(u16::from_be_bytes([hi, lo]));
        match buf.get(level_at) {
            None => Ok(None),
            Some(4) => Ok(Some(Wire::V4)),
            Some(5) => Ok(Some(Wire::V5)),
            Some(&level) => Err(WireError::Level(level)),
        }
    }

    /// The next whole packet in `buf`, taken out of it; None until one has fully arrived.
    /// The packet is framed and its fixed header checked here, before the codec: the codec
    /// then only ever sees a whole packet, so running short inside one is a malformed packet,
    /// never "wait for more".
    pub fn read(self, buf: &mut BytesMut, max_size: u32) -> Result<Option<Packet>, WireError> {
        let Some((first, header, remaining)) = fixed_header(buf)? else {
            return Ok(None);
        };
        let whole = header + remaining;
        if whole > max_size as usize {
            return Err(WireError::TooLarge(whole));
        }
        if buf.len() < whole {
            return Ok(None);
        }
        let body = &buf[header..whole];
        check_fixed_header(self, first)?;
        if first >> 4 == 1 {
            check_connect_flags(body)?;
        }
        if self == Wire::V5 {
            no_duplicate_properties(first, body)?;
            if let Some(disconnect) = short_disconnect(first, body)? {
                let _ = buf.split_to(whole);
                return Ok(Some(disconnect));
            }
        }
        let mut packet = buf.split_to(whole);
        match self {
            Wire::V5 => match v5::Packet::read(&mut packet, None) {
                Ok(packet) => Ok(Some(packet)),
                Err(m5::Error::InsufficientBytes(_)) => Err(WireError::Malformed("truncated")),
                Err(e) => Err(WireError::V5(e)),
            },
            Wire::V4 => match v4::Packet::read(&mut packet, whole) {
                Ok(packet) => Ok(Some(up(packet))),
                Err(m4::Error::InsufficientBytes(_)) => Err(WireError::Malformed("truncated")),
                Err(e) => Err(WireError::V4(e)),
            },
        }
    }

    /// Appends `packet` to `out` in this connection's version. A packet larger than the
    /// client's Maximum Packet Size is refused here too, so none slips past the session's check.
    pub fn write(
        self,
        packet: Packet,
        out: &mut BytesMut,
        max_size: Option<u32>,
    ) -> Result<usize, WireError> {
        match self {
            Wire::V5 => packet.write(out, max_size).map_err(WireError::V5),
            Wire::V4 => {
                // 3.1.1 has no Maximum Packet Size; the protocol's own limit is 256 MiB.
                let max = max_size.map_or(268_435_455, |m| m as usize);
                down(packet)?.write(out, max).map_err(WireError::V4)
            }
        }
    }
}

/// The first byte, the fixed header's length and the remaining length of the packet at the
/// start of `buf`; None until its fixed header has arrived.
fn fixed_header(buf: &[u8]) -> Result<Option<(u8, usize, usize)>, WireError> {
    let Some(&first) = buf.first() else {
        return Ok(None);
    };
    let mut remaining = 0usize;
    for i in 0..4 {
        let Some(&byte) = buf.get(1 + i) else {
            return Ok(None);
        };
        remaining |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((first, 2 + i, remaining)));
        }
    }
    Err(WireError::Malformed(
        "a remaining length longer than four bytes",
    ))
}

/// The fixed header's flags are fixed for every packet but PUBLISH (§2.1.3, 3.1.1 §2.2.2),
/// and a PUBLISH has no QoS 3 (§3.3.1.2); rumqttc reads some of these (a SUBSCRIBE's) without
/// looking at the flags.
fn check_fixed_header(wire: Wire, first: u8) -> Result<(), WireError> {
    let flags = first & 0x0f;
    let ok = match first >> 4 {
        0 => false,
        3 => flags & 0b0110 != 0b0110,
        6 | 8 | 10 => flags == 0b0010,
        15 => wire == Wire::V5 && flags == 0,
        _ => flags == 0,
    };
    if ok {
        Ok(())
    } else {
        Err(WireError::Malformed("reserved fixed header flags"))
    }
}

/// The CONNECT flags' reserved bit must be 0 [MQTT-3.1.2-3]; rumqttc does not look at it.
fn check_connect_flags(body: &[u8]) -> Result<(), WireError> {
    let (Some(&hi), Some(&lo)) = (body.first(), body.get(1)) else {
        return Ok(());
    };
    let flags_at = 2 + usize::from(u16::from_be_bytes([hi, lo])) + 1;
    match body.get(flags_at) {
        Some(flags) if flags & 1 != 0 => Err(WireError::Malformed("CONNECT reserved flag set")),
        _ => Ok(()),
    }
}

/// A DISCONNECT without properties: `E0 00` (no reason code: 0x00) and `E0 01 <code>` (no
/// property length), both valid (§3.14.2.1). rumqttc 0.25.1 refuses them: its
/// `Packet::read` answers any remaining length 0 but PINGREQ's and PINGRESP's with
/// `PayloadRequired` (src/v5/mqttbytes/v5/mod.rs, `Packet::read`), and `Disconnect::read`
/// reads a property length after the reason code whatever the remaining length
/// (src/v5/mqttbytes/v5/disconnect.rs, `Disconnect::read` via `DisconnectProperties::extract`).
fn short_disconnect(first: u8, body: &[u8]) -> Result<Option<Packet>, WireError> {
    if first != 0xE0 || body.len() > 1 {
        return Ok(None);
    }
    let code = body.first().copied().unwrap_or(0);
    let reason_code = v5::DisconnectReasonCode::try_from(code)
        .map_err(|_| WireError::Malformed("unknown DISCONNECT reason code"))?;
    Ok(Some(Packet::Disconnect(v5::Disconnect {
        reason_code,
        properties: None,
    })))
}

/// A property other than User Property given twice is a Protocol Error (§2.2.2.2); rumqttc
/// keeps the last. Checks each property block a client's packet can carry; a block the walk
/// cannot read is left to the codec, which refuses it.
fn no_duplicate_properties(first: u8, body: &[u8]) -> Result<(), WireError> {
    let mut at = match first >> 4 {
        // CONNECT: protocol name, level, flags, keep alive; then its properties and, with a
        // will, the will's after the client id.
        1 => {
            let Some(name) = u16_at(body, 0) else {
                return Ok(());
            };
            let props = 2 + usize::from(name) + 4;
            let Some(after) = properties_unique(body, props)? else {
                return Ok(());
            };
            let will = body
                .get(2 + usize::from(name) + 1)
                .is_some_and(|f| f & 0b100 != 0);
            if !will {
                return Ok(());
            }
            let Some(id) = u16_at(body, after) else {
                return Ok(());
            };
            after + 2 + usize::from(id)
        }
        3 => {
            let Some(topic) = u16_at(body, 0) else {
                return Ok(());
            };
            let id = if first & 0b0110 != 0 { 2 } else { 0 };
            2 + usize::from(topic) + id
        }
        4..=7 if body.len() >= 4 => 3,
        8 | 10 => 2,
        14 | 15 if body.len() >= 2 => 1,
        _ => return Ok(()),
    };
    if at > body.len() {
        at = body.len();
    }
    properties_unique(body, at).map(drop)
}

/// Walks the property block at `at` in `body`: where it ends, or None if it cannot be read.
fn properties_unique(body: &[u8], at: usize) -> Result<Option<usize>, WireError> {
    let Some((len, len_len)) = varint_at(body, at) else {
        return Ok(None);
    };
    let end = at + len_len + len;
    let mut seen = [false; 64];
    let mut p = at + len_len;
    while p < end.min(body.len()) {
        let id = body[p];
        p += 1;
        let size = match id {
            0x01 | 0x17 | 0x19 | 0x24 | 0x25 | 0x28 | 0x29 | 0x2A => 1,
            0x13 | 0x21 | 0x22 | 0x23 => 2,
            0x02 | 0x11 | 0x18 | 0x27 => 4,
            0x0B => match varint_at(body, p) {
                Some((_, n)) => n,
                None => return Ok(None),
            },
            0x03 | 0x08 | 0x09 | 0x12 | 0x15 | 0x16 | 0x1A | 0x1C | 0x1F => match u16_at(body, p) {
                Some(n) => 2 + usize::from(n),
                None => return Ok(None),
            },
            0x26 => {
                let Some(key) = u16_at(body, p) else {
                    return Ok(None);
                };
                let Some(value) = u16_at(body, p + 2 + usize::from(key)) else {
                    return Ok(None);
                };
                4 + usize::from(key) + usize::from(value)
            }
            _ => return Ok(None),
        };
        if id != 0x26 && std::mem::replace(&mut seen[usize::from(id)], true) {
            return Err(WireError::Duplicate(id));
        }
        p += size;
    }
    Ok(Some(end))
}

fn u16_at(body: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*body.get(at)?, *body.get(at + 1)?]))
}

/// A Variable Byte Integer at `at`: its value and how many bytes it took.
fn varint_at(body: &[u8], at: usize) -> Option<(usize, usize)> {
    let mut value = 0usize;
    for i in 0..4 {
        let byte = *body.get(at + i)?;
        value |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

fn qos_up(qos: m4::QoS) -> m5::QoS {
    match qos {
        m4::QoS::AtMostOnce => m5::QoS::AtMostOnce,
        m4::QoS::AtLeastOnce => m5::QoS::AtLeastOnce,
        m4::QoS::ExactlyOnce => m5::QoS::ExactlyOnce,
    }
}

fn qos_down(qos: m5::QoS) -> m4::QoS {
    match qos {
        m5::QoS::AtMostOnce => m4::QoS::AtMostOnce,
        m5::QoS::AtLeastOnce => m4::QoS::AtLeastOnce,
        m5::QoS::ExactlyOnce => m4::QoS::ExactlyOnce,
    }
}

/// A 3.1.1 client's packet in MQTT 5's model: no properties, and 3.1.1's meanings (a clean
/// session is a Clean Start whose session ends with the connection: Session Expiry 0, which
/// is also what no property says).
fn up(packet: v4::Packet) -> Packet {
    match packet {
        v4::Packet::Connect(c) => {
            let will = c.last_will.map(|w| v5::LastWill {
                topic: w.topic.into(),
                message: w.message,
                qos: qos_up(w.qos),
                retain: w.retain,
                properties: None,
            });
            let login = c.login.map(|l| v5::Login {
                username: l.username,
                password: l.password,
            });
            // A 3.1.1 persistent session never expires (3.1.1 §3.1.2.4); the node's bound on
            // kept sessions applies instead.
            let properties = (!c.clean_session).then(|| v5::ConnectProperties {
                session_expiry_interval: Some(u32::MAX),
                ..v5::ConnectProperties::new()
            });
            Packet::Connect(
                v5::Connect {
                    keep_alive: c.keep_alive,
                    client_id: c.client_id,
                    clean_start: c.clean_session,
                    properties,
                },
                will,
                login,
            )
        }
        v4::Packet::Publish(p) => Packet::Publish(v5::Publish {
            dup: p.dup,
            qos: qos_up(p.qos),
            retain: p.retain,
            topic: p.topic.into(),
            pkid: p.pkid,
            payload: p.payload,
            properties: None,
        }),
        v4::Packet::PubAck(a) => Packet::PubAck(v5::PubAck::new(a.pkid, None)),
        v4::Packet::PubRec(a) => Packet::PubRec(v5::PubRec::new(a.pkid, None)),
        v4::Packet::PubRel(a) => Packet::PubRel(v5::PubRel::new(a.pkid, None)),
        v4::Packet::PubComp(a) => Packet::PubComp(v5::PubComp::new(a.pkid, None)),
        v4::Packet::Subscribe(s) => Packet::Subscribe(v5::Subscribe {
            pkid: s.pkid,
            filters: s
                .filters
                .into_iter()
                .map(|f| v5::Filter::new(f.path, qos_up(f.qos)))
                .collect(),
            properties: None,
        }),
        v4::Packet::Unsubscribe(u) => Packet::Unsubscribe(v5::Unsubscribe {
            pkid: u.pkid,
            filters: u.topics,
            properties: None,
        }),
        v4::Packet::PingReq => Packet::PingReq(v5::PingReq),
        v4::Packet::PingResp => Packet::PingResp(v5::PingResp),
        v4::Packet::Disconnect => Packet::Disconnect(v5::Disconnect::new(
            v5::DisconnectReasonCode::NormalDisconnection,
        )),
        v4::Packet::ConnAck(_) => {
            Packet::Disconnect(v5::Disconnect::new(v5::DisconnectReasonCode::ProtocolError))
        }
        v4::Packet::SubAck(_) | v4::Packet::UnsubAck(_) => {
            Packet::Disconnect(v5::Disconnect::new(v5::DisconnectReasonCode::ProtocolError))
        }
    }
}

/// What the node sends, in 3.1.1's form: reason codes become 3.1.1's return codes, properties
/// are left out (a 3.1.1 client has none).
fn down(packet: Packet) -> Result<v4::Packet, WireError> {
    Ok(match packet {
        Packet::ConnAck(c) => v4::Packet::ConnAck(v4::ConnAck {
            session_present: c.session_present,
            code: match c.code {
                v5::ConnectReturnCode::Success => v4::ConnectReturnCode::Success,
                v5::ConnectReturnCode::UnsupportedProtocolVersion => {
                    v4::ConnectReturnCode::RefusedProtocolVersion
                }
                v5::ConnectReturnCode::ClientIdentifierNotValid => {
                    v4::ConnectReturnCode::BadClientId
                }
                v5::ConnectReturnCode::BadUserNamePassword => {
                    v4::ConnectReturnCode::BadUserNamePassword
                }
                v5::ConnectReturnCode::NotAuthorized => v4::ConnectReturnCode::NotAuthorized,
                _ => v4::ConnectReturnCode::ServiceUnavailable,
            },
        }),
        Packet::Publish(p) => v4::Packet::Publish(v4::Publish {
            dup: p.dup,
            qos: qos_down(p.qos),
            retain: p.retain,
            topic: String::from_utf8_lossy(&p.topic).into_owned(),
            pkid: p.pkid,
            payload: p.payload,
        }),
        Packet::PubAck(a) => v4::Packet::PubAck(v4::PubAck::new(a.pkid)),
        Packet::PubRec(a) => v4::Packet::PubRec(v4::PubRec::new(a.pkid)),
        Packet::PubRel(a) => v4::Packet::PubRel(v4::PubRel::new(a.pkid)),
        Packet::PubComp(a) => v4::Packet::PubComp(v4::PubComp::new(a.pkid)),
        Packet::SubAck(s) => v4::Packet::SubAck(v4::SubAck {
            pkid: s.pkid,
            return_codes: s
                .return_codes
                .into_iter()
                .map(|code| match code {
                    v5::SubscribeReasonCode::Success(qos) => {
                        v4::SubscribeReasonCode::Success(qos_down(qos))
                    }
                    _ => v4::SubscribeReasonCode::Failure,
                })
                .collect(),
        }),
        Packet::UnsubAck(u) => v4::Packet::UnsubAck(v4::UnsubAck { pkid: u.pkid }),
        Packet::PingResp(_) => v4::Packet::PingResp,
        Packet::Disconnect(_) => return Err(WireError::NoV4Form("a DISCONNECT")),
        Packet::Auth(_) => return Err(WireError::NoV4Form("an AUTH")),
        Packet::Connect(..)
        | Packet::Subscribe(_)
        | Packet::Unsubscribe(_)
        | Packet::PingReq(_) => return Err(WireError::NoV4Form("a client's packet")),
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// CONNECT bytes as a 3.1.1 client writes them (rumqttc's client side of the same codec).
    fn v4_connect(clean: bool) -> BytesMut {
        let mut connect = v4::Connect::new("sensor-1");
        connect.clean_session = clean;
        connect.keep_alive = 30;
        connect.set_login("user", "secret");
        let mut out = BytesMut::new();
        connect.write(&mut out).unwrap();
        out
    }

    #[test]
    fn the_connects_protocol_level_chooses_the_version() {
        let bytes = v4_connect(true);
        assert_eq!(Wire::detect(&bytes).unwrap(), Some(Wire::V4));
        assert_eq!(Wire::detect(&bytes[..6]).unwrap(), None, "not enough yet");
        let mut v5 = BytesMut::new();
        let connect = v5::Connect {
            keep_alive: 0,
            client_id: "dev".into(),
            clean_start: true,
            properties: None,
        };
        v5::Packet::Connect(connect, None, None)
            .write(&mut v5, None)
            .unwrap();
        assert_eq!(Wire::detect(&v5).unwrap(), Some(Wire::V5));
        assert!(matches!(
            Wire::detect(&[0x30, 0]),
            Err(WireError::NotConnect)
        ));
        let mut v3 = bytes.clone();
        v3[8] = 3;
        assert!(matches!(Wire::detect(&v3), Err(WireError::Level(3))));
    }

    #[test]
    fn a_v4_connect_reads_as_mqtt_5_with_its_meanings() {
        let mut bytes = v4_connect(false);
        let Some(Packet::Connect(connect, will, login)) =
            Wire::V4.read(&mut bytes, 1 << 20).unwrap()
        else {
            panic!("a CONNECT");
        };
        assert_eq!(
            (connect.client_id.as_str(), connect.keep_alive),
            ("sensor-1", 30)
        );
        assert!(!connect.clean_start);
        let expiry = connect.properties.and_then(|p| p.session_expiry_interval);
        assert_eq!(
            expiry,
            Some(u32::MAX),
            "a persistent 3.1.1 session does not expire"
        );
        assert!(will.is_none());
        assert_eq!(login.map(|l| l.password), Some("secret".into()));
        assert!(bytes.is_empty());
    }

    #[test]
    fn a_partial_packet_waits_and_a_whole_one_is_taken() {
        let mut publish = BytesMut::new();
        let mut packet = v4::Publish::new("a/b", m4::QoS::AtLeastOnce, b"x".to_vec());
        packet.pkid = 1;
        packet.write(&mut publish).unwrap();
        let mut partial = BytesMut::from(&publish[..publish.len() - 1]);
        assert!(Wire::V4.read(&mut partial, 1 << 20).unwrap().is_none());
        let mut whole = publish.clone();
        let Some(Packet::Publish(p)) = Wire::V4.read(&mut whole, 1 << 20).unwrap() else {
            panic!("a PUBLISH");
        };
        assert_eq!((&p.topic[..], p.qos), (&b"a/b"[..], m5::QoS::AtLeastOnce));
    }

    #[test]
    fn what_the_node_sends_a_v4_client_is_3_1_1() {
        let mut out = BytesMut::new();
        let suback = Packet::SubAck(v5::SubAck {
            pkid: 7,
            return_codes: vec![
                v5::SubscribeReasonCode::Success(m5::QoS::AtLeastOnce),
                v5::SubscribeReasonCode::NotAuthorized,
            ],
            properties: None,
        });
        Wire::V4.write(suback, &mut out, None).unwrap();
        assert_eq!(&out[..], &[0x90, 4, 0, 7, 1, 0x80]);

        let mut out = BytesMut::new();
        let mut publish =
            v5::Publish::new("t", m5::QoS::AtLeastOnce, Bytes::from_static(b"p"), None);
        publish.pkid = 1;
        Wire::V4
            .write(Packet::Publish(publish), &mut out, None)
            .unwrap();
        let mut back = out.clone();
        assert!(matches!(
            v4::Packet::read(&mut back, 1 << 20),
            Ok(v4::Packet::Publish(_))
        ));
        assert!(Wire::V4
            .write(
                Packet::Disconnect(v5::Disconnect::new(
                    v5::DisconnectReasonCode::SessionTakenOver
                )),
                &mut out,
                None
            )
            .is_err());
    }

    fn read5(bytes: &[u8]) -> Result<Option<Packet>, WireError> {
        Wire::V5.read(&mut BytesMut::from(bytes), 1 << 20)
    }

    #[test]
    fn the_short_disconnect_forms_are_normal_disconnects() {
        for bytes in [&[0xE0, 0x00][..], &[0xE0, 0x01, 0x00]] {
            let Ok(Some(Packet::Disconnect(d))) = read5(bytes) else {
                panic!("{bytes:?} is a DISCONNECT");
            };
            assert_eq!(d.reason_code, v5::DisconnectReasonCode::NormalDisconnection);
        }
        let Ok(Some(Packet::Disconnect(d))) = read5(&[0xE0, 0x01, 0x04]) else {
            panic!("with will");
        };
        assert_eq!(
            d.reason_code,
            v5::DisconnectReasonCode::DisconnectWithWillMessage
        );
        assert!(read5(&[0xE0, 0x01, 0x05]).is_err(), "no such reason code");
        assert!(read5(&[0xE2, 0x00]).is_err(), "reserved flags");
    }

    #[test]
    fn reserved_flags_qos_3_and_a_truncated_body_are_malformed() {
        assert!(matches!(
            read5(&[0x80, 6, 0, 1, 0, 0, 1, b'a']),
            Err(WireError::Malformed(_))
        ));
        assert!(matches!(
            read5(&[0x36, 6, 0, 1, b'a', 0, 1, 0]),
            Err(WireError::Malformed(_))
        ));
        // A SUBSCRIBE whose filter runs past the packet's end.
        assert!(
            read5(&[0x82, 5, 0, 1, 0, 0, 9]).is_err(),
            "never 'wait for more'"
        );
        assert!(
            read5(&[0x82, 5, 0, 1]).unwrap().is_none(),
            "not all there yet"
        );
    }

    #[test]
    fn a_property_given_twice_is_a_protocol_error_but_user_properties_repeat() {
        // PUBLISH a/b, Message Expiry Interval twice.
        let twice = [
            0x30, 16, 0, 3, b'a', b'/', b'b', 10, 2, 0, 0, 0, 9, 2, 0, 0, 0, 9,
        ];
        assert!(matches!(read5(&twice[..]), Err(WireError::Duplicate(2))));
        // Two User Properties k=v.
        let users = [
            0x30, 20, 0, 3, b'a', b'/', b'b', 14, 0x26, 0, 1, b'k', 0, 1, b'v', 0x26, 0, 1, b'k',
            0, 1, b'v',
        ];
        assert!(matches!(read5(&users[..]), Ok(Some(Packet::Publish(_)))));
    }

    #[test]
    fn a_packet_past_the_maximum_is_too_large_before_it_arrives() {
        let mut head = BytesMut::from(&[0x30, 0xE8, 0x07][..]);
        assert!(matches!(
            Wire::V5.read(&mut head, 512),
            Err(WireError::TooLarge(1003))
        ));
    }

    #[test]
    fn a_packet_larger_than_the_clients_maximum_is_not_written() {
        let publish = v5::Publish::new("t", m5::QoS::AtMostOnce, Bytes::from(vec![0u8; 100]), None);
        let mut out = BytesMut::new();
        assert!(Wire::V5
            .write(Packet::Publish(publish), &mut out, Some(64))
            .is_err());
        assert!(out.is_empty());
    }
}
