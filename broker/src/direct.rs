//! A plain-TCP subscriber's queue written into its socket by the thread that queued for it,
//! while its connection task is not writing: a commit's hand-on reaches the client with no task
//! switch (ARCHITECTURE.md, "hand-offs"). Whoever writes holds [`Direct`]'s lock, so bytes never
//! interleave and deliveries keep their queue's order; a socket that is full leaves the rest to
//! the task, which waits for it without holding anyone up.

use std::cell::RefCell;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use rumqttc::v5::mqttbytes::v5::{Publish, PublishProperties};
use rumqttc::v5::mqttbytes::QoS;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use crate::mailbox::{Mailbox, Outgoing};
use crate::wire::{Packet, Wire};

thread_local! {
    /// What a [`Together`] on this thread holds back until its end.
    static TOGETHER: RefCell<Option<Held>> = const { RefCell::new(None) };
}

/// Who waits for a client's bytes: written or rung once, at a [`Together`]'s end.
pub(crate) trait Waiting: Send + Sync {
    fn send(&self);
}

/// What a [`Together`] on this thread holds back: each once, in the order first held.
#[derive(Default)]
struct Held(Vec<Arc<dyn Waiting>>);

/// While it lives, what this thread releases or publishes is written to each client at its
/// end, together: one write per client rather than one per message. A commit's
/// acknowledgements and hand-ons go out under one.
pub struct Together {
    outer: Option<Held>,
}

impl Together {
    pub fn begin() -> Together {
        Together {
            outer: TOGETHER.with(|t| t.borrow_mut().replace(Held::default())),
        }
    }
}

impl Drop for Together {
    fn drop(&mut self) {
        let held = TOGETHER.with(|t| std::mem::replace(&mut *t.borrow_mut(), self.outer.take()));
        for waiting in held.map(|h| h.0).unwrap_or_default() {
            waiting.send();
        }
    }
}

/// Holds `waiting` back if a [`Together`] lasts on this thread; false when none does.
pub(crate) fn later(waiting: Arc<dyn Waiting>) -> bool {
    TOGETHER.with(|t| match t.borrow_mut().as_mut() {
        Some(held) => {
            let at = Arc::as_ptr(&waiting).cast::<()>();
            if !held.0.iter().any(|o| Arc::as_ptr(o).cast::<()>() == at) {
                held.0.push(waiting);
            }
            true
        }
        None => false,
    })
}

/// A plain TCP connection whose write half the connection's task shares with [`Direct`].
pub struct SharedTcp {
    read: OwnedReadHalf,
    write: Arc<OwnedWriteHalf>,
}

impl SharedTcp {
    pub fn new(stream: TcpStream) -> SharedTcp {
        let (read, write) = stream.into_split();
        SharedTcp {
            read,
            write: Arc::new(write),
        }
    }

    /// The write half, for [`Direct::new`].
    pub fn writer(&self) -> Arc<OwnedWriteHalf> {
        self.write.clone()
    }
}

impl AsyncRead for SharedTcp {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for SharedTcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let socket: &TcpStream = (*self.write).as_ref();
        loop {
            ready!(socket.poll_write_ready(cx))?;
            match self.write.try_write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                written => return Poll::Ready(written),
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        let socket: &TcpStream = (*self.write).as_ref();
        Poll::Ready(socket2::SockRef::from(socket).shutdown(std::net::Shutdown::Write))
    }
}

/// One connection's socket as the threads that queue for it see it.
#[derive(Debug)]
pub struct Direct {
    socket: Arc<OwnedWriteHalf>,
    wire: Wire,
    /// The client's Maximum Packet Size.
    max_out: Option<u32>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The task has bytes of its own on their way: nobody else writes until it is done.
    task_writing: bool,
    /// The connection is ending: only its task writes now.
    closed: bool,
    /// What a full socket did not take from an outside write; the task writes it next.
    leftover: BytesMut,
}

impl State {
    /// Puts what an outside write left before `out`: it is the rest of bytes already begun.
    fn leftover_first(&mut self, out: &mut BytesMut) {
        if !self.leftover.is_empty() {
            let mine = std::mem::replace(out, std::mem::take(&mut self.leftover));
            out.extend_from_slice(&mine);
        }
    }
}

/// What [`Direct::flush`] did.
#[derive(Debug, PartialEq, Eq)]
pub struct Flushed {
    /// Something was taken from the queue.
    pub took: bool,
    /// The task must run: it is writing, the socket was full, or the connection is ending.
    pub ring: bool,
}

impl Direct {
    /// The task writes first (its CONNACK and what a resumed session is owed).
    pub fn new(socket: Arc<OwnedWriteHalf>, wire: Wire, max_out: Option<u32>) -> Arc<Direct> {
        Arc::new(Direct {
            socket,
            wire,
            max_out,
            state: Mutex::new(State {
                task_writing: true,
                closed: false,
                leftover: BytesMut::new(),
            }),
        })
    }

    /// From a thread that just queued into `mailbox`: writes what the client may take now,
    /// unless the task is writing (or another thread is, then it rings instead of waiting).
    pub fn flush(&self, mailbox: &Mutex<Mailbox>) -> Flushed {
        let Ok(mut state) = self.state.try_lock() else {
            return Flushed {
                took: false,
                ring: true,
            };
        };
        if state.task_writing || state.closed || !state.leftover.is_empty() {
            return Flushed {
                took: false,
                ring: true,
            };
        }
        let mut out = BytesMut::new();
        let took = drain(
            &mut mailbox.lock().unwrap_or_else(PoisonError::into_inner),
            self.wire,
            self.max_out,
            &mut out,
        );
        let ring = !self.write(&mut state, out);
        Flushed { took, ring }
    }

    /// From a thread that has bytes for the client: `encode` adds them to the write if the
    /// socket is free (it may decline, returning false); false when the task must run.
    pub fn flush_with(
        &self,
        encode: impl FnOnce(Wire, Option<u32>, &mut BytesMut) -> bool,
    ) -> bool {
        let Ok(mut state) = self.state.try_lock() else {
            return false;
        };
        if state.task_writing || state.closed || !state.leftover.is_empty() {
            return false;
        }
        let mut out = BytesMut::new();
        if !encode(self.wire, self.max_out, &mut out) {
            return false;
        }
        self.write(&mut state, out)
    }

    /// Writes `out` without waiting; what a full socket does not take is left for the task.
    /// Whether all of it went.
    fn write(&self, state: &mut State, mut out: BytesMut) -> bool {
        let _write = crate::stages::enter(crate::stages::Stage::Write);
        let mut written = 0;
        while written < out.len() {
            match self.socket.try_write(&out[written..]) {
                Ok(n) if n > 0 => written += n,
                // Full (or failing: the task's next read or write finds out).
                _ => break,
            }
        }
        if written < out.len() {
            state.leftover = out.split_off(written);
            return false;
        }
        true
    }

    /// The task's turn to write: what an outside write left comes first, then what `fill`
    /// adds. While `out` is not empty afterwards the task owns the socket, until [`Direct::done`].
    pub fn turn(&self, out: &mut BytesMut, fill: impl FnOnce(&mut BytesMut)) {
        let mut state = self.lock();
        state.leftover_first(out);
        fill(out);
        state.task_writing = !out.is_empty();
    }

    /// The task's bytes are written: the socket is free again.
    pub fn done(&self) {
        self.lock().task_writing = false;
    }

    /// The connection ends: from now on only its task writes, and what was left is its to send.
    pub fn close(&self, out: &mut BytesMut) {
        let mut state = self.lock();
        state.closed = true;
        state.leftover_first(out);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Encodes into `out` every PUBLISH the session may be sent now; whether it took any.
pub fn drain(mailbox: &mut Mailbox, wire: Wire, max_out: Option<u32>, out: &mut BytesMut) -> bool {
    let _encode = crate::stages::enter(crate::stages::Stage::Encode);
    let mut took = false;
    while let Some(next) = mailbox.next(Instant::now(), |o| {
        let mut probe = BytesMut::new();
        wire.write(Packet::Publish(publish_of(o)), &mut probe, None)
            .map_or(usize::MAX, |n| n)
    }) {
        took = true;
        if let Err(e) = wire.write(Packet::Publish(publish_of(&next)), out, max_out) {
            tracing::debug!(error = %e, "publish not written");
        }
    }
    took
}

/// The PUBLISH for one delivery: its own QoS, alias, expiry left and identifiers.
pub fn publish_of(out: &Outgoing) -> Publish {
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
        qos: match out.qos {
            0 => QoS::AtMostOnce,
            1 => QoS::AtLeastOnce,
            _ => QoS::ExactlyOnce,
        },
        retain: out.retain,
        topic: Bytes::copy_from_slice(out.topic.as_bytes()),
        pkid: out.pkid,
        payload: out.payload.clone(),
        properties,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mailbox::{Limits, Owed, Published};
    use tokio::io::AsyncReadExt;

    /// A connected pair: the node's write half (as `Direct` holds it) and the client's socket.
    async fn pair() -> (Arc<OwnedWriteHalf>, OwnedReadHalf, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (node, _) = listener.accept().await.unwrap();
        let (read, write) = node.into_split();
        (Arc::new(write), read, client)
    }

    fn mailbox_of(count: u32, size: usize) -> Mutex<Mailbox> {
        let mut mailbox = Mailbox::new(Limits {
            receive_maximum: 100,
            maximum_packet_size: None,
            topic_alias_maximum: 0,
            queue_bytes: usize::MAX,
        });
        for n in 0..count {
            let mut payload = n.to_be_bytes().to_vec();
            payload.resize(size, 0);
            let owed = Owed {
                message: Arc::new(Published {
                    topic: Arc::from("t"),
                    payload: Bytes::from(payload),
                    received: Instant::now(),
                    expiry: None,
                    properties: None,
                }),
                qos: 0,
                retain: false,
                subscription_ids: Vec::new(),
            };
            mailbox.push(owed).unwrap();
        }
        Mutex::new(mailbox)
    }

    /// Every PUBLISH's number, in the order the client reads them, until `count` arrived.
    async fn numbers(client: &mut TcpStream, count: usize) -> Vec<u32> {
        let mut buf = BytesMut::new();
        let mut seen = Vec::new();
        loop {
            while let Some(packet) = Wire::V4.read(&mut buf, 1 << 24).unwrap() {
                let Packet::Publish(p) = packet else {
                    panic!("only publishes were written, got {packet:?}");
                };
                seen.push(u32::from_be_bytes(p.payload[..4].try_into().unwrap()));
            }
            if seen.len() >= count {
                return seen;
            }
            assert!(client.read_buf(&mut buf).await.unwrap() > 0, "closed");
        }
    }

    #[tokio::test]
    async fn a_publisher_writes_only_while_the_task_does_not() {
        let (socket, _read, mut client) = pair().await;
        let direct = Direct::new(socket, Wire::V4, None);
        let mailbox = mailbox_of(3, 8);
        let rung = direct.flush(&mailbox);
        assert_eq!(
            rung,
            Flushed {
                took: false,
                ring: true
            },
            "the task writes first"
        );
        direct.done();
        assert_eq!(
            direct.flush(&mailbox),
            Flushed {
                took: true,
                ring: false
            }
        );
        assert_eq!(numbers(&mut client, 3).await, [0, 1, 2]);
        let mut out = BytesMut::from(&b"\xd0\x00"[..]);
        direct.turn(&mut out, |_| {});
        assert!(
            !direct.flush_with(|_, _, _| panic!("nobody else encodes during the task's turn")),
            "the task's turn excludes everyone else"
        );
        direct.done();
        direct.close(&mut BytesMut::new());
        assert!(
            !direct.flush_with(|_, _, _| panic!("nor once the connection is closing")),
            "only the task writes once the connection ends"
        );
    }

    /// A full socket: what a publisher's write left is the task's to write first, so every
    /// packet arrives whole and in order, however the writes were split.
    #[tokio::test]
    async fn what_a_full_socket_left_is_written_first_by_the_task_in_order() {
        let (socket, _read, mut client) = pair().await;
        let direct = Direct::new(socket.clone(), Wire::V4, None);
        direct.done();
        const COUNT: u32 = 400;
        let mailbox = mailbox_of(COUNT, 64 << 10);
        let flushed = direct.flush(&mailbox);
        assert!(
            flushed.took && flushed.ring,
            "25 MiB fills the socket: {flushed:?}"
        );
        assert_eq!(
            direct.flush(&mailbox_of(1, 8)),
            Flushed {
                took: false,
                ring: true
            },
            "nobody writes past a partial packet"
        );
        let mut out = BytesMut::new();
        direct.turn(&mut out, |_| {});
        assert!(!out.is_empty(), "the rest of the write is the task's");
        let reader = tokio::spawn(async move { numbers(&mut client, COUNT as usize).await });
        let mut written = 0;
        while written < out.len() {
            socket.writable().await.unwrap();
            match socket.try_write(&out[written..]) {
                Ok(n) => written += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        direct.done();
        assert_eq!(
            reader.await.unwrap(),
            (0..COUNT).collect::<Vec<_>>(),
            "every publish whole and in queue order"
        );
    }
}
