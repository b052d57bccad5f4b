//! Where MQTT packets begin and end in a byte stream, without decoding them: the front pauses a
//! client before a publish the node consumes, and writes acknowledgements between rumqttd's
//! packets. The fixed header (type byte, remaining length) is the same in MQTT 3.1.1 and 5.

/// The start of the packet at the front of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Head<'a> {
    /// More bytes are needed to tell.
    Incomplete,
    /// A packet of `len` bytes in all; for a PUBLISH, its topic (empty: a v5 topic alias); for
    /// a PUBACK, the packet id it acknowledges.
    Packet {
        len: usize,
        topic: Option<&'a [u8]>,
        puback: Option<u16>,
    },
    /// Not MQTT: the caller stops looking and passes bytes on (rumqttd refuses them).
    Malformed,
}

/// The fixed header at the start of `buffer`: its length and the remaining length.
fn fixed(buffer: &[u8]) -> Result<Option<(usize, usize)>, ()> {
    let mut remaining = 0_usize;
    let mut at = 1;
    loop {
        let Some(&byte) = buffer.get(at) else {
            return Ok(None);
        };
        remaining |= usize::from(byte & 0x7f) << (7 * (at - 1));
        at += 1;
        if byte & 0x80 == 0 {
            return Ok(Some((at, remaining)));
        }
        if at > 4 {
            return Err(());
        }
    }
}

/// Reads the fixed header at the start of `buffer`, and a PUBLISH's topic.
pub fn head(buffer: &[u8]) -> Head<'_> {
    let Some(&first) = buffer.first() else {
        return Head::Incomplete;
    };
    let (at, remaining) = match fixed(buffer) {
        Ok(Some(header)) => header,
        Ok(None) => return Head::Incomplete,
        Err(()) => return Head::Malformed,
    };
    let len = at + remaining;
    if first >> 4 == 4 {
        return match (remaining, buffer.get(at), buffer.get(at + 1)) {
            (0 | 1, _, _) => Head::Malformed,
            (_, Some(&hi), Some(&lo)) => Head::Packet {
                len,
                topic: None,
                puback: Some(u16::from_be_bytes([hi, lo])),
            },
            _ => Head::Incomplete,
        };
    }
    if first >> 4 != 3 {
        return Head::Packet {
            len,
            topic: None,
            puback: None,
        };
    }
    let (Some(&hi), Some(&lo)) = (buffer.get(at), buffer.get(at + 1)) else {
        return if remaining < 2 {
            Head::Malformed
        } else {
            Head::Incomplete
        };
    };
    let topic_len = usize::from(u16::from_be_bytes([hi, lo]));
    if topic_len + 2 > remaining {
        return Head::Malformed;
    }
    match buffer.get(at + 2..at + 2 + topic_len) {
        Some(topic) => Head::Packet {
            len,
            topic: Some(topic),
            puback: None,
        },
        None => Head::Incomplete,
    }
}

/// Follows packet boundaries across the reads of one direction of a connection.
#[derive(Debug, Default)]
pub struct Boundaries {
    /// The fixed header read so far of a packet whose header is split across reads.
    header: Vec<u8>,
    /// Bytes of the current packet not yet seen.
    left: usize,
    /// The stream stopped looking like MQTT: no boundary is reported again.
    lost: bool,
}

impl Boundaries {
    /// Takes the next bytes of the stream; returns the offset in `data` just past the last packet
    /// that ends in it, if any.
    pub fn feed(&mut self, data: &[u8]) -> Option<usize> {
        let mut at = 0;
        let mut last = None;
        while at < data.len() && !self.lost {
            if self.left > 0 {
                let take = self.left.min(data.len() - at);
                at += take;
                self.left -= take;
                if self.left == 0 {
                    last = Some(at);
                }
                continue;
            }
            self.header.push(data[at]);
            at += 1;
            if self.header.len() < 2 {
                continue;
            }
            match fixed(&self.header) {
                Ok(None) => {}
                Ok(Some((_, remaining))) => {
                    self.left = remaining;
                    self.header.clear();
                    if self.left == 0 {
                        last = Some(at);
                    }
                }
                Err(()) => self.lost = true,
            }
        }
        last
    }

    /// Whether the stream is between two packets now.
    pub fn between(&self) -> bool {
        !self.lost && self.left == 0 && self.header.is_empty()
    }
}

/// A whole PUBLISH packet the front can hand to a link itself: QoS 0 or 1, not retained, with
/// a topic (no v5 alias) and, in MQTT 5, no properties.
#[derive(Debug, PartialEq, Eq)]
pub struct Plain<'a> {
    pub topic: &'a [u8],
    /// The packet id of a QoS 1 publish.
    pub pkid: Option<u16>,
    pub payload: &'a [u8],
}

/// Reads `packet` (exactly one whole packet) as a [`Plain`] publish, or `None` for anything else.
pub fn plain_publish(packet: &[u8], v5: bool) -> Option<Plain<'_>> {
    let first = *packet.first()?;
    // PUBLISH, not retained, QoS 0 or 1 (the DUP flag does not matter).
    if first >> 4 != 3 || first & 0x01 != 0 || (first >> 1) & 0x03 > 1 {
        return None;
    }
    let qos1 = (first >> 1) & 0x03 == 1;
    let (at, remaining) = fixed(packet).ok()??;
    if at + remaining != packet.len() {
        return None;
    }
    let body = &packet[at..];
    let topic_len = usize::from(u16::from_be_bytes([*body.first()?, *body.get(1)?]));
    let topic = body.get(2..2 + topic_len)?;
    let mut rest = 2 + topic_len;
    let pkid = if qos1 {
        let id = u16::from_be_bytes([*body.get(rest)?, *body.get(rest + 1)?]);
        rest += 2;
        // Packet id 0 is a protocol error: rumqttd's to answer.
        (id != 0).then_some(id)?;
        Some(id)
    } else {
        None
    };
    if v5 {
        // A property length of 0: one byte.
        if *body.get(rest)? != 0 {
            return None;
        }
        rest += 1;
    }
    if topic.is_empty() {
        return None;
    }
    Some(Plain {
        topic,
        pkid,
        payload: body.get(rest..)?,
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_plain_publish_is_read_and_anything_else_is_left_to_rumqttd() {
        // 3.1.1 QoS 1, topic "a/b", packet id 7, payload "hi".
        let qos1 = [0x32, 9, 0, 3, b'a', b'/', b'b', 0, 7, b'h', b'i'];
        assert_eq!(
            plain_publish(&qos1, false),
            Some(Plain {
                topic: b"a/b",
                pkid: Some(7),
                payload: b"hi"
            })
        );
        // QoS 0, MQTT 5 with no properties.
        let v5 = [0x30, 6, 0, 1, b't', 0, b'x', b'y'];
        assert_eq!(
            plain_publish(&v5, true),
            Some(Plain {
                topic: b"t",
                pkid: None,
                payload: b"xy"
            })
        );
        let with_property = [0x30, 8, 0, 1, b't', 2, 0x01, 1, b'x', b'y'];
        assert_eq!(plain_publish(&with_property, true), None, "v5 properties");
        let retained = [0x31, 4, 0, 1, b't', b'x'];
        assert_eq!(plain_publish(&retained, false), None, "retained");
        let qos2 = [0x34, 6, 0, 1, b't', 0, 1, b'x'];
        assert_eq!(plain_publish(&qos2, false), None, "QoS 2");
        let alias = [0x30, 3, 0, 0, 0];
        assert_eq!(plain_publish(&alias, true), None, "a topic alias");
        let pkid0 = [0x32, 6, 0, 1, b't', 0, 0, b'x'];
        assert_eq!(plain_publish(&pkid0, false), None, "packet id 0");
        assert_eq!(
            plain_publish(&qos1[..10], false),
            None,
            "not the whole packet"
        );
        let puback = [0x40, 2, 0, 1];
        assert_eq!(plain_publish(&puback, false), None);
    }
    use super::*;

    const PUBLISH: [u8; 10] = [0x32, 0x08, 0x00, 0x03, b'a', b'/', b'b', 0x12, 0x34, b'x'];
    const PUBACK: [u8; 4] = [0x40, 0x02, 0x00, 0x01];

    #[test]
    fn a_publish_head_names_its_topic_once_it_has_arrived() {
        assert_eq!(
            head(&PUBLISH),
            Head::Packet {
                len: 10,
                topic: Some(b"a/b"),
                puback: None,
            }
        );
        for cut in 0..6 {
            assert_eq!(head(&PUBLISH[..cut]), Head::Incomplete, "{cut}");
        }
        assert_eq!(
            head(&PUBACK),
            Head::Packet {
                len: 4,
                topic: None,
                puback: Some(1),
            }
        );
        assert_eq!(head(&PUBACK[..3]), Head::Incomplete);
        // MQTT 5: a reason code after the packet id.
        assert_eq!(
            head(&[0x40, 0x03, 0x80, 0x02, 0x10]),
            Head::Packet {
                len: 5,
                topic: None,
                puback: Some(0x8002),
            }
        );
        assert_eq!(head(&[0x40, 0x01, 0x00]), Head::Malformed);
        assert_eq!(
            head(&[0xc0, 0x00]),
            Head::Packet {
                len: 2,
                topic: None,
                puback: None,
            }
        );
        // A remaining length of 321 (two bytes).
        let long = [0x30, 0xc1, 0x02, 0x00, 0x00];
        assert_eq!(
            head(&long),
            Head::Packet {
                len: 324,
                topic: Some(b""),
                puback: None,
            }
        );
        assert_eq!(head(&[0x30, 0xff, 0xff, 0xff, 0xff, 0x01]), Head::Malformed);
        assert_eq!(head(&[0x30, 0x04, 0x00, 0x09, b'a']), Head::Malformed);
    }

    #[test]
    fn boundaries_are_found_however_the_stream_is_cut() {
        let stream: Vec<u8> = [&PUBLISH[..], &PUBACK, &PUBLISH, &[0xc0, 0x00]].concat();
        let ends = [10, 14, 24, 26];
        for cut in 0..=stream.len() {
            let mut boundaries = Boundaries::default();
            let (a, b) = stream.split_at(cut);
            let first = boundaries.feed(a);
            assert_eq!(first, ends.iter().copied().filter(|&e| e <= cut).max());
            if !b.is_empty() {
                let second = boundaries.feed(b).map(|at| at + cut);
                assert_eq!(second, Some(26), "{cut}");
            }
            assert!(boundaries.between());
        }
        let mut boundaries = Boundaries::default();
        assert_eq!(boundaries.feed(&PUBLISH[..3]), None);
        assert!(!boundaries.between());
    }
}
