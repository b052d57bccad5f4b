//! A plain-TCP subscriber's queue written into its socket by the thread that queued for it,
//! while its connection task is not writing: a commit's hand-on reaches the client with no task
//! switch (ARCHITECTURE.md, "hand-offs"). Whoever writes holds [`Direct`]'s lock, so bytes never
//! interleave and deliveries keep their queue's order; a socket that is full leaves the rest to
//! the task, which waits for it without holding anyone up.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
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
    /// The buffer this thread encodes outside writes into, kept between them: a commit's
    /// hand-ons do not grow a fresh one each time.
    static SCRATCH: Cell<BytesMut> = Cell::new(BytesMut::new());
}

/// The most a thread's [`SCRATCH`] keeps between writes.
const SCRATCH_KEEP: usize = 128 * 1024;

/// This thread's encoding buffer, empty, for bytes that leave in one write: a batch of
/// deliveries does not grow a fresh buffer each time (a grown buffer is copied at each doubling).
pub(crate) fn lend() -> BytesMut {
    SCRATCH.with(Cell::take)
}

/// Returns a buffer [`lend`] gave, once its bytes are written: cleared, kept for this thread's
/// next write unless it grew past [`SCRATCH_KEEP`], so a thread holds at most that much.
pub(crate) fn give_back(mut out: BytesMut) {
    out.clear();
    if out.capacity() <= SCRATCH_KEEP {
        SCRATCH.with(|scratch| scratch.set(out));
    }
}

/// Who waits for a client's bytes: written or rung once, at a [`Together`]'s end, in one
/// write with whatever else that end holds for the same socket.
pub(crate) trait Waiting: Send + Sync {
    /// The socket its bytes may be written into from outside the connection's task, if any.
    fn socket(&self) -> Option<Arc<Direct>>;
    /// Adds its bytes to `out`: whether there were any, or `None` if they are the task's to
    /// write.
    fn encode(&self, wire: Wire, max_out: Option<u32>, out: &mut BytesMut) -> Option<bool>;
    /// The connection's task must write them (the socket was busy or full, or it declined).
    fn ring(&self);
    /// Bytes it encoded went into the socket (all, or the task writes the rest).
    fn took(&self) {}
}

/// What a [`Together`] on this thread holds back: each once, in the order first held.
#[derive(Default)]
struct Held(Vec<Arc<dyn Waiting>>);

/// While it lives, what this thread releases or publishes is written to each client at its
/// end, together: one write per client rather than one per message. A commit's
/// acknowledgements and hand-ons go out under one.
pub struct Together {
    /// What an enclosing one holds, put back at the end; `None` once ended.
    outer: Option<Option<Held>>,
}

impl Together {
    pub fn begin() -> Together {
        Together {
            outer: Some(TOGETHER.with(|t| t.borrow_mut().replace(Held::default()))),
        }
    }

    /// Ends it, but what it holds for one of `sockets` ([`crate::Ack::socket`]) is kept back,
    /// by socket, until each [`Kept`] is sent, to share a write with what that client is owed
    /// then ([`crate::Ack::send_with`]); the rest is sent now.
    pub fn keep_for(mut self, mut sockets: Vec<usize>) -> HashMap<usize, Kept> {
        sockets.sort_unstable();
        let mut kept: HashMap<usize, Kept> = HashMap::new();
        let mut now = Vec::new();
        for waiting in self.end() {
            match waiting.socket().map(|d| Arc::as_ptr(&d) as usize) {
                Some(socket) if sockets.binary_search(&socket).is_ok() => {
                    kept.entry(socket)
                        .or_insert_with(|| Kept(Vec::new()))
                        .0
                        .push(waiting);
                }
                _ => now.push(waiting),
            }
        }
        send(now);
        kept
    }

    fn end(&mut self) -> Vec<Arc<dyn Waiting>> {
        let Some(outer) = self.outer.take() else {
            return Vec::new();
        };
        let held = TOGETHER.with(|t| std::mem::replace(&mut *t.borrow_mut(), outer));
        held.map(|h| h.0).unwrap_or_default()
    }
}

impl Drop for Together {
    fn drop(&mut self) {
        send(self.end());
    }
}

/// What a [`Together`] kept back for one client ([`Together::keep_for`]). Sent when it is
/// dropped, inside the [`Together`] of the thread dropping it if there is one, so it is
/// never lost.
#[must_use = "dropping it sends it at once"]
pub struct Kept(Vec<Arc<dyn Waiting>>);

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Kept").field(&self.0.len()).finish()
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let now = std::mem::take(&mut self.0)
            .into_iter()
            .filter(|waiting| !later(waiting.clone()))
            .collect();
        send(now);
    }
}

/// Runs `f` inside the current [`Together`], or inside one of its own if there is none.
pub(crate) fn together<R>(f: impl FnOnce() -> R) -> R {
    if TOGETHER.with(|t| t.borrow().is_some()) {
        f()
    } else {
        let _together = Together::begin();
        f()
    }
}

/// Writes or rings each of `owed` once, one write per socket, in the order first held.
fn send(owed: Vec<Arc<dyn Waiting>>) {
    match owed.as_slice() {
        [] => {}
        [one] => send_one(&**one),
        _ => {
            let mut groups: Vec<(Arc<Direct>, Vec<&dyn Waiting>)> = Vec::new();
            let mut at = HashMap::new();
            for waiting in &owed {
                let Some(direct) = waiting.socket() else {
                    waiting.ring();
                    continue;
                };
                let i = *at
                    .entry(Arc::as_ptr(&direct) as usize)
                    .or_insert(groups.len());
                match groups.get_mut(i) {
                    Some((_, group)) => group.push(&**waiting),
                    None => groups.push((direct, vec![&**waiting])),
                }
            }
            for (direct, group) in groups {
                direct.write_owed(&group);
            }
        }
    }
}

/// Writes or rings `waiting` alone.
pub(crate) fn send_one(waiting: &dyn Waiting) {
    match waiting.socket() {
        Some(direct) => direct.write_owed(&[waiting]),
        None => waiting.ring(),
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

/// A client's stream, whose TCP ACK its connection's task may ask for at once.
pub(crate) trait AckNow {
    /// Acknowledges at once what the client sent, instead of after the kernel's delayed-ACK
    /// timer (40 ms): a client with Nagle's algorithm on holds its next write until then.
    fn ack_now(&self);
}

impl AckNow for SharedTcp {
    fn ack_now(&self) {
        ack_now((*self.write).as_ref());
    }
}

/// [`AckNow::ack_now`] on the TCP socket under a client's stream.
pub(crate) fn ack_now(socket: &TcpStream) {
    let socket = socket2::SockRef::from(socket);
    // Setting TCP_QUICKACK sends the pending ACK and leaves interactive ("pingpong") mode;
    // clearing it re-enters that mode, so the ACK of the client's next packet still rides on
    // the node's answer instead of going alone (Linux `__tcp_sock_set_quickack`). A refusal
    // only leaves the ACK to the kernel's timer.
    let _ = socket.set_tcp_quickack(true);
    let _ = socket.set_tcp_quickack(false);
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

    /// Writes what each of `owed` (all of them this socket's) has for the client in one write
    /// if the socket is free, and rings those whose task must write.
    fn write_owed(&self, owed: &[&dyn Waiting]) {
        let written = self.write_free(|wire, max_out, out| {
            owed.iter()
                .map(|waiting| waiting.encode(wire, max_out, out))
                .collect::<Vec<_>>()
        });
        let Some((encoded, all)) = written else {
            owed.iter().for_each(|waiting| waiting.ring());
            return;
        };
        for (waiting, encoded) in owed.iter().zip(encoded) {
            if encoded == Some(true) {
                waiting.took();
            }
            if encoded.is_none() || !all {
                waiting.ring();
            }
        }
    }

    /// Writes what `fill` adds if nobody else may be writing: `None` when the task must (it is
    /// writing, the connection is ending, or a full socket left it bytes to finish); else what
    /// `fill` returned and whether all of it went. Lock order: this state, then what `fill` locks.
    fn write_free<T>(
        &self,
        fill: impl FnOnce(Wire, Option<u32>, &mut BytesMut) -> T,
    ) -> Option<(T, bool)> {
        let Ok(mut state) = self.state.try_lock() else {
            return None;
        };
        if state.task_writing || state.closed || !state.leftover.is_empty() {
            return None;
        }
        let mut out = lend();
        let filled = fill(self.wire, self.max_out, &mut out);
        let all = out.is_empty() || self.write(&mut state, &mut out);
        give_back(out);
        Some((filled, all))
    }

    /// Writes `out` without waiting; what a full socket does not take is left for the task.
    /// Whether all of it went.
    fn write(&self, state: &mut State, out: &mut BytesMut) -> bool {
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
    // One clock read per drain: the messages' expiry is counted in seconds.
    let now = Instant::now();
    while let Some(next) = mailbox.next(now, |o| {
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
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// What [`flush`] did.
    #[derive(Debug, PartialEq, Eq)]
    struct Flushed {
        /// Something was taken from the queue.
        took: bool,
        /// The task must run: it is writing, the socket was full, or the connection is ending.
        ring: bool,
    }

    /// As a thread that just queued into `mailbox` writes it: what the client may take now,
    /// unless the task is writing.
    fn flush(direct: &Direct, mailbox: &Mutex<Mailbox>) -> Flushed {
        match direct.write_free(|wire, max_out, out| {
            drain(
                &mut mailbox.lock().unwrap_or_else(PoisonError::into_inner),
                wire,
                max_out,
                out,
            )
        }) {
            Some((took, all)) => Flushed { took, ring: !all },
            None => Flushed {
                took: false,
                ring: true,
            },
        }
    }

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
        let rung = flush(&direct, &mailbox);
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
            flush(&direct, &mailbox),
            Flushed {
                took: true,
                ring: false
            }
        );
        assert_eq!(numbers(&mut client, 3).await, [0, 1, 2]);
        let mut out = BytesMut::from(&b"\xd0\x00"[..]);
        direct.turn(&mut out, |_| {});
        assert!(
            !flush(&direct, &mailbox_of(1, 8)).took,
            "the task's turn excludes everyone else"
        );
        direct.done();
        direct.close(&mut BytesMut::new());
        assert!(
            !flush(&direct, &mailbox_of(1, 8)).took,
            "only the task writes once the connection ends"
        );
    }

    /// Bytes owed on one socket, counted as they are rung.
    struct Owes {
        direct: Arc<Direct>,
        bytes: &'static [u8],
        rung: std::sync::atomic::AtomicUsize,
    }

    impl Waiting for Owes {
        fn socket(&self) -> Option<Arc<Direct>> {
            Some(self.direct.clone())
        }

        fn encode(&self, _: Wire, _: Option<u32>, out: &mut BytesMut) -> Option<bool> {
            out.extend_from_slice(self.bytes);
            Some(true)
        }

        fn ring(&self) {
            self.rung.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn owes(direct: &Arc<Direct>, bytes: &'static [u8]) -> Arc<Owes> {
        Arc::new(Owes {
            direct: direct.clone(),
            bytes,
            rung: 0.into(),
        })
    }

    /// What one read of `client` returns within a short wait (empty: nothing came).
    async fn one_read(client: &mut TcpStream) -> Vec<u8> {
        let mut chunk = [0u8; 1024];
        match tokio::time::timeout(Duration::from_millis(200), client.read(&mut chunk)).await {
            Ok(read) => chunk[..read.unwrap()].to_vec(),
            Err(_) => Vec::new(),
        }
    }

    #[tokio::test]
    async fn what_is_kept_for_a_socket_goes_out_later_in_one_write_with_its_acknowledgement() {
        let (socket, _read, mut client) = pair().await;
        let (other_socket, _other_read, mut other) = pair().await;
        let direct = Direct::new(socket, Wire::V4, None);
        let other_direct = Direct::new(other_socket, Wire::V4, None);
        direct.done();
        other_direct.done();
        let acks = crate::ack::Acks::new(Some(direct.clone()));
        let ack = acks.promise(crate::AckKind::PubAck, 7);
        let held_by_task = ack.clone();
        let together = Together::begin();
        assert!(later(owes(&direct, b"result-")));
        assert!(later(owes(&other_direct, b"hand-on")));
        assert!(later(owes(&direct, b"document-")));
        let socket_id = ack.socket().expect("a plain TCP socket");
        let mut kept = together.keep_for(vec![socket_id]);
        assert_eq!(
            one_read(&mut other).await,
            b"hand-on",
            "not kept: sent at the end"
        );
        assert_eq!(one_read(&mut client).await, b"", "kept back");
        ack.send_with(kept.remove(&socket_id).expect("kept for the socket"));
        assert!(kept.is_empty());
        crate::release_together(|| drop(ack));
        assert_eq!(
            one_read(&mut client).await,
            b"",
            "a copy still holds the PUBACK"
        );
        // The last copy released on another thread, outside any Together: still one write.
        std::thread::spawn(move || drop(held_by_task))
            .join()
            .unwrap();
        assert_eq!(
            one_read(&mut client).await,
            b"result-document-\x40\x02\x00\x07",
            "one write: what was kept, then the PUBACK"
        );
        // Abandoned (never committed), what was kept still goes, without a PUBACK.
        let ack = acks.promise(crate::AckKind::PubAck, 8);
        let together = Together::begin();
        assert!(later(owes(&direct, b"late")));
        let mut kept = together.keep_for(vec![socket_id]);
        ack.send_with(kept.remove(&socket_id).expect("kept"));
        ack.abandon();
        drop(ack);
        assert_eq!(one_read(&mut client).await, b"late");
        // While the task writes, the task is rung for it instead.
        let together = Together::begin();
        let pending = owes(&direct, b"later");
        assert!(later(pending.clone()));
        let kept = together.keep_for(vec![socket_id]);
        direct.turn(&mut BytesMut::from(&b"\xd0\x00"[..]), |_| {});
        drop(kept);
        assert_eq!(
            pending.rung.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "its task writes it"
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
        let flushed = flush(&direct, &mailbox);
        assert!(
            flushed.took && flushed.ring,
            "25 MiB fills the socket: {flushed:?}"
        );
        assert_eq!(
            flush(&direct, &mailbox_of(1, 8)),
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
