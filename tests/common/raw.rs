//! MQTT as bytes: a client that sends exactly the packets a test writes, valid or not, and reads
//! back what the node answers, so the conformance tests see each byte the spec speaks of.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::WAIT;

/// A packet the node sent: its first byte and the bytes after the remaining length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub first: u8,
    pub body: Vec<u8>,
}

impl Frame {
    /// The packet type (the first byte's high nibble).
    pub fn kind(&self) -> u8 {
        self.first >> 4
    }
}

/// A packet with its fixed header: `first`, the remaining length, `body`.
pub fn packet(first: u8, body: &[u8]) -> Vec<u8> {
    let mut out = vec![first];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if len == 0 {
            break;
        }
    }
    out.extend_from_slice(body);
    out
}

/// A UTF-8 string or binary field: its two-byte length, then the bytes.
pub fn string(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u16).to_be_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

/// A properties block (MQTT 5): its length, then `props` as written.
pub fn props(props: &[u8]) -> Vec<u8> {
    packet(0, props)[1..].to_vec()
}

/// A CONNECT for `id`; MQTT 5 with `properties` (already a block) when `v5`, keep-alive 30 s,
/// clean start.
pub fn connect(v5: bool, id: &str, properties: &[u8]) -> Vec<u8> {
    let mut body = string(b"MQTT");
    body.push(if v5 { 5 } else { 4 });
    body.push(0b0000_0010);
    body.extend_from_slice(&30u16.to_be_bytes());
    if v5 {
        body.extend_from_slice(properties);
    }
    body.extend_from_slice(&string(id.as_bytes()));
    packet(0x10, &body)
}

/// A SUBSCRIBE of `filter` at QoS 1 with packet id `pkid`.
pub fn subscribe(v5: bool, pkid: u16, filter: &[u8]) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if v5 {
        body.push(0);
    }
    body.extend_from_slice(&string(filter));
    body.push(1);
    packet(0x82, &body)
}

/// An UNSUBSCRIBE of `filter` with packet id `pkid`.
pub fn unsubscribe(v5: bool, pkid: u16, filter: &[u8]) -> Vec<u8> {
    let mut body = pkid.to_be_bytes().to_vec();
    if v5 {
        body.push(0);
    }
    body.extend_from_slice(&string(filter));
    packet(0xA2, &body)
}

/// A PUBLISH of `payload` to `topic` at `qos` (packet id 1 when QoS > 0).
pub fn publish(v5: bool, topic: &[u8], qos: u8, payload: &[u8]) -> Vec<u8> {
    let mut body = string(topic);
    if qos > 0 {
        body.extend_from_slice(&1u16.to_be_bytes());
    }
    if v5 {
        body.push(0);
    }
    body.extend_from_slice(payload);
    packet(0x30 | (qos << 1), &body)
}

/// A raw MQTT connection.
pub struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    pub async fn open(port: u16) -> Raw {
        Raw::open_from(port, std::net::Ipv4Addr::LOCALHOST).await
    }

    /// A connection to the node from `local`, another loopback address (127.0.0.0/8): a
    /// second client host, as the node tells clients apart.
    pub async fn open_from(port: u16, local: std::net::Ipv4Addr) -> Raw {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind((local, 0).into())
            .expect("bind a loopback address");
        let to = (std::net::Ipv4Addr::LOCALHOST, port).into();
        let stream = tokio::time::timeout(WAIT, socket.connect(to))
            .await
            .expect("connect in time")
            .expect("connect");
        Raw {
            stream,
            buf: Vec::new(),
        }
    }

    /// Opens a connection and sends `connect`; the CONNACK's reason code (its second byte).
    pub async fn connected(port: u16, connect: &[u8]) -> (Raw, u8) {
        Raw::connected_from(port, std::net::Ipv4Addr::LOCALHOST, connect).await
    }

    /// [`Raw::connected`] from `local` ([`Raw::open_from`]).
    pub async fn connected_from(port: u16, local: std::net::Ipv4Addr, connect: &[u8]) -> (Raw, u8) {
        let mut raw = Raw::open_from(port, local).await;
        raw.send(connect).await;
        let connack = raw.next().await.expect("a CONNACK");
        assert_eq!(connack.kind(), 2, "{connack:?}");
        let code = connack.body[1];
        (raw, code)
    }

    pub async fn send(&mut self, bytes: &[u8]) {
        // The node may have closed already; what it sent before is still read.
        let _ = self.stream.write_all(bytes).await;
    }

    /// The next packet, or None when the node closed the connection; panics past [`WAIT`].
    pub async fn next(&mut self) -> Option<Frame> {
        self.next_within(WAIT)
            .await
            .unwrap_or_else(|| panic!("nothing from the node within {WAIT:?}"))
    }

    /// The next packet (Some(None): closed), or None when nothing came within `wait`.
    pub async fn next_within(&mut self, wait: Duration) -> Option<Option<Frame>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(frame) = self.take() {
                return Some(Some(frame));
            }
            let mut chunk = [0u8; 64 * 1024];
            match tokio::time::timeout_at(deadline, self.stream.read(&mut chunk)).await {
                Err(_) => return None,
                Ok(Ok(0)) | Ok(Err(_)) => return Some(None),
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    /// Every packet of the node's next write that reaches the socket, as one read returns
    /// them (nothing may be buffered from before); panics past [`WAIT`].
    pub async fn next_write(&mut self) -> Vec<Frame> {
        assert!(self.buf.is_empty(), "bytes from before: {:?}", self.buf);
        let mut chunk = [0u8; 64 * 1024];
        let n = tokio::time::timeout(WAIT, self.stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("nothing from the node within {WAIT:?}"))
            .expect("read");
        self.buf.extend_from_slice(&chunk[..n]);
        std::iter::from_fn(|| self.take()).collect()
    }

    /// The next packet that is not a PUBLISH, or None when the node closed the connection.
    pub async fn next_not_publish(&mut self) -> Option<Frame> {
        loop {
            match self.next().await {
                Some(frame) if frame.kind() == 3 => {}
                other => return other,
            }
        }
    }

    fn take(&mut self) -> Option<Frame> {
        let mut len = 0usize;
        let mut at = 1;
        loop {
            let byte = *self.buf.get(at)?;
            len |= usize::from(byte & 0x7f) << (7 * (at - 1));
            at += 1;
            if byte & 0x80 == 0 {
                break;
            }
        }
        if self.buf.len() < at + len {
            return None;
        }
        let frame = Frame {
            first: self.buf[0],
            body: self.buf[at..at + len].to_vec(),
        };
        self.buf.drain(..at + len);
        Some(frame)
    }

    /// Asserts the node ends the connection, after a DISCONNECT with `reason` when given (MQTT
    /// 5), and sends nothing else first but PUBLISHes.
    pub async fn expect_closed(&mut self, reason: Option<u8>) {
        match (self.next_not_publish().await, reason) {
            (None, None) => {}
            (Some(frame), Some(reason)) if frame.kind() == 14 => {
                assert_eq!(frame.body.first(), Some(&reason), "DISCONNECT {frame:?}");
                assert!(self.next_not_publish().await.is_none(), "closed after it");
            }
            (other, _) => panic!("expected the close (DISCONNECT {reason:?}), got {other:?}"),
        }
    }
}
