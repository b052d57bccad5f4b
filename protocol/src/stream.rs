//! kubelet API streams over the cloud broker (docs/protocol.md §8): the controller relays an
//! apiserver connection's bytes to a node's edged and back, one MQTT topic per stream and
//! direction, with a credit window per direction.
//!
//! Topics (`<root>` is the cloud root, `<id>` the controller's stream id):
//! - `<root>/<node>/stream/down/<id>`: controller → node;
//! - `<root>/<node>/stream/up/<id>`: node → controller;
//! - `<root>/<node>/stream/state`: the node's stream link, retained `online` / `offline` (its
//!   Last Will);
//! - `<root>/stream/controller/<controller>`: a controller's stream link, likewise.
//!
//! They sit beside the node's `up/` and `down/`, so the bridge's `down/#` subscription and the
//! controller's `up/#` never see them.

/// Largest data a frame carries.
pub const MAX_DATA: usize = 16 * 1024;

/// One message of a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame<'a> {
    /// Controller → node: open a stream to the node's kubelet API. Both directions start with
    /// `window` bytes of credit; `controller` names the controller's state topic.
    Open { window: u32, controller: &'a str },
    /// Bytes of the connection; `seq` counts frames from 0 in each direction, so a lost one
    /// is seen.
    Data { seq: u32, bytes: &'a [u8] },
    /// The receiver wrote this many more bytes out: the sender may send that many more.
    Credit(u32),
    /// The sender is done: an empty reason is the end of its bytes (TCP's FIN); any other
    /// reason aborts the stream.
    Close(&'a str),
}

const OPEN: u8 = 0;
const DATA: u8 = 1;
const CREDIT: u8 = 2;
const CLOSE: u8 = 3;

impl Frame<'_> {
    /// The MQTT payload: a kind byte, then the kind's fields (integers big-endian).
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Frame::Open { window, controller } => {
                let mut out = vec![OPEN];
                out.extend_from_slice(&window.to_be_bytes());
                out.extend_from_slice(controller.as_bytes());
                out
            }
            Frame::Data { seq, bytes } => {
                let mut out = Vec::with_capacity(5 + bytes.len());
                out.push(DATA);
                out.extend_from_slice(&seq.to_be_bytes());
                out.extend_from_slice(bytes);
                out
            }
            Frame::Credit(n) => {
                let mut out = vec![CREDIT];
                out.extend_from_slice(&n.to_be_bytes());
                out
            }
            Frame::Close(reason) => {
                let mut out = vec![CLOSE];
                out.extend_from_slice(reason.as_bytes());
                out
            }
        }
    }

    /// Reads a payload; `Err` says what is wrong with it.
    pub fn decode(payload: &[u8]) -> Result<Frame<'_>, String> {
        let (&kind, rest) = payload.split_first().ok_or("empty stream frame")?;
        let number = |rest: &[u8]| -> Result<u32, String> {
            rest.get(..4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_be_bytes)
                .ok_or_else(|| "stream frame too short".to_owned())
        };
        let text = |bytes: &'_ [u8]| -> Result<(), String> {
            std::str::from_utf8(bytes)
                .map(|_| ())
                .map_err(|_| "stream frame text is not UTF-8".to_owned())
        };
        match kind {
            OPEN => {
                let window = number(rest)?;
                text(&rest[4..])?;
                let controller = std::str::from_utf8(&rest[4..]).unwrap_or_default();
                Ok(Frame::Open { window, controller })
            }
            DATA => {
                let seq = number(rest)?;
                let bytes = &rest[4..];
                if bytes.len() > MAX_DATA {
                    return Err(format!("stream data frame of {} bytes", bytes.len()));
                }
                Ok(Frame::Data { seq, bytes })
            }
            CREDIT => Ok(Frame::Credit(number(rest)?)),
            CLOSE => {
                text(rest)?;
                Ok(Frame::Close(std::str::from_utf8(rest).unwrap_or_default()))
            }
            other => Err(format!("unknown stream frame kind {other}")),
        }
    }
}

/// `<root>/<node>/stream/down/<id>`.
pub fn down_topic(root: &str, node: &str, id: &str) -> String {
    format!("{root}/{node}/stream/down/{id}")
}

/// `<root>/<node>/stream/up/<id>`.
pub fn up_topic(root: &str, node: &str, id: &str) -> String {
    format!("{root}/{node}/stream/up/{id}")
}

/// `<root>/<node>/stream/state`.
pub fn node_state_topic(root: &str, node: &str) -> String {
    format!("{root}/{node}/stream/state")
}

/// `<root>/stream/controller/<controller>`.
pub fn controller_state_topic(root: &str, controller: &str) -> String {
    format!("{root}/stream/controller/{controller}")
}

/// The stream id of a node's down topic, or `None`.
pub fn parse_down<'a>(root: &str, node: &str, topic: &'a str) -> Option<&'a str> {
    let id = topic
        .strip_prefix(root)?
        .strip_prefix('/')?
        .strip_prefix(node)?
        .strip_prefix("/stream/down/")?;
    is_stream_id(id).then_some(id)
}

/// What a topic the controller receives is: `(node, Some(id))` for stream data,
/// `(node, None)` for a node's state.
pub fn parse_up<'a>(root: &str, topic: &'a str) -> Option<(&'a str, Option<&'a str>)> {
    let rest = topic.strip_prefix(root)?.strip_prefix('/')?;
    let (node, rest) = rest.split_once('/')?;
    if rest == "stream/state" {
        return Some((node, None));
    }
    let id = rest.strip_prefix("stream/up/")?;
    is_stream_id(id).then_some((node, Some(id)))
}

/// Stream ids are 1–64 characters of `[A-Za-z0-9_-]` (one topic level).
pub fn is_stream_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// A frame as a stream's task receives it (the payload copied out of the MQTT message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    Data { seq: u32, bytes: Vec<u8> },
    Credit(u32),
    Close(String),
}

impl Incoming {
    /// `None` for frames a running stream does not take (`Open`).
    pub fn from_frame(frame: &Frame<'_>) -> Option<Incoming> {
        match frame {
            Frame::Open { .. } => None,
            Frame::Data { seq, bytes } => Some(Incoming::Data {
                seq: *seq,
                bytes: bytes.to_vec(),
            }),
            Frame::Credit(n) => Some(Incoming::Credit(*n)),
            Frame::Close(reason) => Some(Incoming::Close((*reason).to_owned())),
        }
    }
}

/// Frames a stream's task may have queued; a peer that overruns this (it ignored its credit,
/// or sent tiny frames) has its stream aborted. With [`MAX_DATA`] frames this bounds a
/// stream's inbound queue at 4 MiB whatever the peer does; a peer that keeps to its credit
/// has at most the window queued.
pub const QUEUED_FRAMES: usize = 256;

/// Where a stream's own frames go (its MQTT topic).
pub trait Publisher {
    /// Publishes one frame; `false` when the link is gone.
    fn publish(&self, payload: Vec<u8>) -> impl std::future::Future<Output = bool> + Send;
}

/// Relays `socket` and the stream's frames both ways until both sides are done (`Ok`) or one
/// fails (`Err` with the reason, sent to the peer as an aborting `Close` when it is ours).
/// Each direction sends at most `window` bytes the receiver has not credited back; credit is
/// returned once a quarter of the window was written out, so a slow reader stalls its own
/// stream and nothing else.
pub async fn relay<S, P>(
    socket: S,
    mut incoming: tokio::sync::mpsc::Receiver<Incoming>,
    publisher: &P,
    window: u32,
) -> Result<(), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    P: Publisher,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let (mut reader, mut writer) = tokio::io::split(socket);
    let mut credit = window;
    let (mut seq_out, mut seq_in) = (0u32, 0u32);
    let (mut reading, mut peer_done) = (true, false);
    let mut uncredited = 0u32;
    let mut buf = vec![0u8; MAX_DATA];
    let abort = |reason: String| async move {
        let _ = publisher.publish(Frame::Close(&reason).encode()).await;
        Err::<(), String>(reason)
    };
    while reading || !peer_done {
        let room = usize::try_from(credit).unwrap_or(MAX_DATA).min(MAX_DATA);
        tokio::select! {
            read = reader.read(&mut buf[..room]), if reading && room > 0 => match read {
                Ok(n) if n > 0 => {
                    let frame = Frame::Data { seq: seq_out, bytes: &buf[..n] };
                    if !publisher.publish(frame.encode()).await {
                        return Err("the stream link is gone".to_owned());
                    }
                    seq_out = seq_out.wrapping_add(1);
                    credit -= u32::try_from(n).unwrap_or(credit);
                }
                _ => {
                    reading = false;
                    if !publisher.publish(Frame::Close("").encode()).await {
                        return Err("the stream link is gone".to_owned());
                    }
                }
            },
            frame = incoming.recv() => match frame {
                None => return abort("the stream was dropped (its queue overran or the link closed)".to_owned()).await,
                Some(Incoming::Data { seq, bytes }) => {
                    if seq != seq_in {
                        return abort(format!("stream frame {seq_in} lost")).await;
                    }
                    seq_in = seq_in.wrapping_add(1);
                    if peer_done || writer.write_all(&bytes).await.is_err() {
                        return abort("the connection went away".to_owned()).await;
                    }
                    uncredited += u32::try_from(bytes.len()).unwrap_or(0);
                    if uncredited >= window / 4 {
                        if !publisher.publish(Frame::Credit(uncredited).encode()).await {
                            return Err("the stream link is gone".to_owned());
                        }
                        uncredited = 0;
                    }
                }
                Some(Incoming::Credit(n)) => credit = credit.saturating_add(n).min(window),
                Some(Incoming::Close(reason)) if reason.is_empty() => {
                    peer_done = true;
                    let _ = writer.shutdown().await;
                }
                Some(Incoming::Close(reason)) => return Err(reason),
            },
        }
    }
    Ok(())
}

/// A connection whose first bytes were already read (a request head looked at before the
/// stream opened): reads give those bytes first, then the connection's.
pub struct Prefixed<S> {
    prefix: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(prefix: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed {
            prefix,
            at: 0,
            inner,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = buf.remaining().min(self.prefix.len() - self.at);
            let from = self.at;
            buf.put_slice(&self.prefix[from..from + n]);
            self.at += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        for frame in [
            Frame::Open {
                window: 65536,
                controller: "c-1",
            },
            Frame::Data {
                seq: 7,
                bytes: b"\x00\xffhello",
            },
            Frame::Credit(4096),
            Frame::Close(""),
            Frame::Close("kubelet unreachable"),
        ] {
            let bytes = frame.encode();
            assert_eq!(Frame::decode(&bytes), Ok(frame));
        }
        assert!(Frame::decode(b"").is_err());
        assert!(Frame::decode(&[1, 0, 0]).is_err());
        assert!(Frame::decode(&[9]).is_err());
        let mut big = vec![1, 0, 0, 0, 0];
        big.resize(5 + MAX_DATA + 1, 0);
        assert!(Frame::decode(&big).is_err());
    }

    #[test]
    fn topics_name_the_node_and_the_stream() {
        assert_eq!(down_topic("ke", "n1", "s1"), "ke/n1/stream/down/s1");
        assert_eq!(parse_down("ke", "n1", "ke/n1/stream/down/s1"), Some("s1"));
        assert_eq!(parse_down("ke", "n1", "ke/n2/stream/down/s1"), None);
        assert_eq!(parse_down("ke", "n1", "ke/n1/stream/down/a+b"), None);
        assert_eq!(
            parse_up("ke", "ke/n1/stream/up/s1"),
            Some(("n1", Some("s1")))
        );
        assert_eq!(parse_up("ke", "ke/n1/stream/state"), Some(("n1", None)));
        assert_eq!(parse_up("ke", "ke/n1/up/edged/update"), None);
    }
}
