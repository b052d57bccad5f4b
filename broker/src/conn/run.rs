//! A connection's loop: what wakes it (its socket, its mailbox, released acknowledgements, a
//! cut), every packet read handled in turn, and how it ends.

use super::*;

/// The DISCONNECT reason code for a packet the node could not take (§4.13).
fn reason_for(error: &WireError) -> DisconnectReasonCode {
    match error {
        WireError::TooLarge(_) => DisconnectReasonCode::PacketTooLarge,
        WireError::Duplicate(_) => DisconnectReasonCode::ProtocolError,
        WireError::OverBudget => DisconnectReasonCode::QuotaExceeded,
        WireError::Slow => DisconnectReasonCode::KeepAliveTimeout,
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

/// A client that publishes within this long of acknowledging may have been held by Nagle's
/// algorithm for the node's delayed ACK (Linux's is 40 ms, `TCP_DELACK_MIN`).
const BRISK: Duration = Duration::from_millis(100);

/// What the loop does after a packet was handled.
enum Next {
    On,
    End(End),
    /// Cut while it waited: `Conn::cut` tells the client why.
    Cut,
}

impl Conn {
    pub(super) async fn run<S: AsyncRead + AsyncWrite + AckNow + Unpin>(
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
        // When the first byte of a packet not yet whole arrived: it must all be in within
        // `packet_within`, whatever the keep-alive (0 waits forever), so a client that stops or
        // trickles part-way through cannot hold its read buffer longer.
        let mut partial_since: Option<Instant> = None;
        // §3.1.4: a client may send packets right behind its CONNECT, without waiting for the
        // CONNACK; they may have come in the read that brought the CONNECT, and no read wakes
        // the loop for them.
        if !buf.is_empty() {
            if let Some(end) = self
                .take_packets(stream, buf, shared, false, token, node)
                .await
            {
                return end;
            }
            partial_since = (!buf.is_empty()).then(Instant::now);
        }
        // A read of only acknowledgements gets no answer to carry its TCP ACK, and the kernel
        // delays that ACK. For a client that wrote again soon after its last such read, the
        // ACK goes at once unless bytes go back now (`AckNow`). Clients that write less often
        // (a sensor reporting each second) are left to the kernel: an ACK at once costs the
        // node a syscall and a packet each time.
        let mut acked_at: Option<Instant> = None;
        let mut brisk = false;
        let mut ack_now = false;
        loop {
            if self.out.is_empty() {
                self.borrow_out();
            }
            if self.fill() {
                self.room.taken();
            }
            if self.out.is_empty() {
                self.return_out();
            }
            if std::mem::take(&mut ack_now) && self.out.is_empty() {
                stream.ack_now();
            }
            if !self.out.is_empty() {
                // A reader that stopped takes nothing: its writers wait, and the hub cuts it
                // off through `token` while this write waits (protocol §6.10).
                let writing = crate::stages::on().then(Instant::now);
                tokio::select! {
                    written = stream.write_all(&self.out) => if written.is_err() {
                        return End::Lost;
                    },
                    _ = token.cancelled() => return Box::pin(self.cut(stream, node)).await,
                }
                if let Some(writing) = writing {
                    crate::stages::Stage::Write.add(writing);
                }
                self.out.clear();
                self.return_out();
                if let Some(direct) = &self.direct {
                    direct.done();
                }
            }
            let quiet = if keep_alive.is_zero() {
                Duration::from_secs(u64::from(u32::MAX))
            } else {
                grace.saturating_sub(last_heard.elapsed())
            };
            // One timer for both: the packet's deadline when it comes first.
            let silent = tokio::time::sleep(match partial_since {
                Some(since) => quiet.min(shared.packet_within.saturating_sub(since.elapsed())),
                None => quiet,
            });
            if buf.capacity() - buf.len() < 64 {
                // A packet that does not fit must grow the buffer: past the budget, the
                // connection ends as over a malformed packet, told 0x97 (MQTT 5).
                if let Err(e) = self.reading.reserve(buf, 256) {
                    self.reading
                        .budget()
                        .refused(&self.client_id, buf.len() + 256);
                    return self.refuse_packet(stream, &e).await;
                }
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
                Woke::Silent => {
                    if partial_since.is_some_and(|since| since.elapsed() >= shared.packet_within) {
                        let budget = self.reading.budget();
                        budget.too_slow(&self.client_id, buf.len(), shared.packet_within);
                        return self.refuse_packet(stream, &WireError::Slow).await;
                    }
                    return End::Lost;
                }
                Woke::Read(None) => return End::Lost,
                Woke::Read(Some(read)) => {
                    last_heard = Instant::now();
                    let filled = read == spare;
                    let whole = self.packets_in;
                    self.acks_only = true;
                    self.published = false;
                    let taken = self.take_packets(stream, buf, shared, filled, token, node);
                    if let Some(end) = taken.await {
                        return end;
                    }
                    if self.packets_in != whole {
                        if self.published {
                            let since = acked_at.map(|at| last_heard.saturating_duration_since(at));
                            brisk = since.is_some_and(|since| since < BRISK);
                        }
                        acked_at = (self.acks_only && buf.is_empty()).then_some(last_heard);
                        ack_now = brisk && acked_at.is_some();
                    }
                    // Time spent handling counts against neither clock: handling may have
                    // waited for room, and the client's next bytes stayed in the socket. A
                    // packet begun after a whole one is timed from now.
                    if self.packets_in != whole {
                        last_heard = Instant::now();
                    }
                    partial_since = match partial_since {
                        _ if buf.is_empty() => None,
                        Some(since) if self.packets_in == whole => Some(since),
                        _ => Some(Instant::now()),
                    };
                    if buf.is_empty() && buf.capacity() > KEEP_BUFFER {
                        *buf = BytesMut::new();
                        let _ = self.reading.cover(0);
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
        token: &CancellationToken,
        node: &CancellationToken,
    ) -> Option<End> {
        loop {
            let decoded = {
                let _decode = crate::stages::enter(crate::stages::Stage::Decode);
                self.wire.read(buf, shared.max_packet)
            };
            let packet = match decoded {
                // More is likely waiting. It is taken in larger reads, many packets a call,
                // without waiting for it; an idle connection keeps only the small buffer. With
                // no budget left for that, the loop reads on in small steps.
                Ok(None) if filled && self.reading.reserve(buf, READ_MORE).is_ok() => {
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
                    self.packets_in += 1;
                    let step = self.handle(packet, shared);
                    match self.step(step, shared, token).await {
                        Next::On => {}
                        Next::End(end) => return Some(self.ending(stream, end).await),
                        Next::Cut => return Some(Box::pin(self.cut(stream, node)).await),
                    }
                }
                Ok(None) => return None,
                Err(e) => {
                    debug!(client_id = %self.client_id, error = %e, "malformed packet");
                    return Some(self.refuse_packet(stream, &e).await);
                }
            }
        }
    }

    /// Ends the connection over a packet the node cannot take: an MQTT 5 client is told why.
    async fn refuse_packet<S: AsyncWrite + Unpin>(&mut self, stream: &mut S, e: &WireError) -> End {
        self.closing();
        if self.wire == Wire::V5 {
            let bye = Disconnect::new(reason_for(e));
            self.send(Packet::Disconnect(bye));
            let _ = stream.write_all(&self.out).await;
        }
        End::Lost
    }

    /// What a handled packet left to do: go on, end, or be cut (this connection's token was
    /// cancelled while it waited for a reader).
    async fn step(
        &mut self,
        step: Option<Step>,
        shared: &Shared,
        token: &CancellationToken,
    ) -> Next {
        let Some(step) = step else {
            return Next::On;
        };
        match step {
            Step::End(end) => Next::End(end),
            Step::Wait(waiting, behind, owed) => {
                // A module's inbox or a reader's queue is full: this client waits (its bytes
                // stay in its socket) while the others go on (protocol §6.10).
                shared.paused.fetch_add(1, Ordering::Relaxed);
                shared.pauses.fetch_add(1, Ordering::Relaxed);
                Box::pin(hand_to_links(waiting)).await;
                let on = Box::pin(shared.hub.wait_for(behind, token)).await;
                shared.paused.fetch_sub(1, Ordering::Relaxed);
                if !on {
                    return Next::Cut;
                }
                self.settle(owed);
                Next::On
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
                let routed = hub.publish(Some(self.session), message, qos, false, ack);
                Box::pin(hand_to_links(routed.links)).await;
                if !Box::pin(hub.wait_for(routed.behind, token)).await {
                    return Next::Cut;
                }
                self.settle(owed);
                Next::On
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

    /// The connection was cut: for not taking what it held (0x97), because the node is
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
}
