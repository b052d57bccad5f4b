//! Our own accept loop in front of a rumqttd listener, for what rumqttd's cannot do:
//!
//! - TLS with client certificates, the certificate's common name being the identity (rumqttd only
//!   exposes the O= field, as a tenant prefix of the client id);
//! - low latency: rumqttd leaves Nagle on for accepted sockets, so a reply that follows a PUBACK
//!   waits for the client's delayed ACK (~40 ms). The front sets TCP_NODELAY towards the client
//!   and acknowledges rumqttd's segments at once (TCP_QUICKACK) on the loopback hop.
//!
//! - back-pressure: it stops reading from a client that is about to publish to a topic our
//!   links consume while they lag (backlog.rs); other clients and other packets go on;
//! - acknowledging what the node consumes only once it is committed: the guard keeps rumqttd's
//!   early PUBACK / PUBCOMP, and the node's is written between rumqttd's packets: over plain
//!   TCP by the thread that releases it while this front idles between packets (no wake-up of
//!   the front, `Session::attach`), else by the front;
//! - delivering the node's hand-ons to a topic only clean-session subscribers hold (a device's
//!   results, edged's `ke/edged/#`) past rumqttd: written between rumqttd's packets with packet
//!   ids of its own, whose PUBACKs it keeps from rumqttd. rumqttd would keep each in the
//!   filter's log, for every device (`lag.rs`, [`crate::session::Session::deliver`]);
//! - rumqttd 0.20's connection races: it never lets rumqttd see a client's end of stream before
//!   rumqttd is done with the connection (see `splice`).
//!
//! - cutting off a client the guard decided to drop (a subscriber that lags, `lag.rs`): rumqttd
//!   can only be made to drop a connection from the socket side.
//!
//! Every listener is served this way. Each connection is spliced to a loopback rumqttd listener,
//! preceded by a one-line preamble with a per-process secret, the connection's session number and
//! the certificate name (if any). The guard on that back end takes the session and the name from
//! the preamble and refuses clients without it.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use socket2::SockRef;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use crate::backlog::Backlog;
use crate::config::ListenerTls;
use crate::framing::{head, Boundaries, Head};
use crate::intake::Intake;
use crate::session::{is_front_pkid, Session, Sessions};
use crate::Error;

/// Starts the preamble; an MQTT client starts with CONNECT (0x10), so a missing preamble shows
/// at the first byte.
const MAGIC: &[u8] = b"EMCERT1 ";
/// A preamble longer than this is not ours.
const MAX_PREAMBLE: usize = 1024;

/// The TLS side of a listener: certificate and key, and with `client_ca_file` a demand for client
/// certificates signed by one of those CAs.
#[derive(Clone)]
pub struct Tls {
    acceptor: TlsAcceptor,
    client_certificates: bool,
}

impl Tls {
    pub fn new(name: &str, tls: &ListenerTls) -> Result<Tls, Error> {
        let bad = |what: String| Error::Config(format!("broker.listeners.{name}.tls: {what}"));
        let certs = read_certs(&tls.cert_file).map_err(bad)?;
        let key = read_key(&tls.key_file).map_err(bad)?;
        let builder = ServerConfig::builder();
        let builder = match &tls.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(ca_file) => {
                let mut roots = RootCertStore::empty();
                for ca in read_certs(ca_file).map_err(bad)? {
                    roots
                        .add(ca)
                        .map_err(|e| bad(format!("client_ca_file {ca_file}: {e}")))?;
                }
                let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .map_err(|e| bad(format!("client_ca_file {ca_file}: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| bad(format!("cert_file/key_file: {e}")))?;
        Ok(Tls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            client_certificates: tls.client_ca_file.is_some(),
        })
    }
}

fn read_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{path}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{path}: no PEM certificate"));
    }
    Ok(certs)
}

fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| format!("{path}: {e}"))?
        .ok_or_else(|| format!("{path}: no PEM private key"))
}

/// Where and how the front hands each client on to its rumqttd back end.
#[derive(Clone)]
pub struct Backend {
    pub address: SocketAddr,
    pub secret: Arc<str>,
    /// Time limit for the TLS handshake and for rumqttd's CONNACK.
    pub connect_timeout: Duration,
    pub backlog: Arc<Backlog>,
    /// Where each connection is registered for the guard to claim.
    pub sessions: Arc<Sessions>,
    /// TCP_NODELAY towards clients, TCP_QUICKACK on the loopback hop.
    pub low_latency: bool,
    /// Where the front hands publishes for our links past rumqttd.
    pub intake: Arc<Intake>,
}

/// Accepts clients on `listener` until the task is dropped; each is spliced to the back end,
/// after a TLS handshake when `tls` is given.
pub async fn serve(
    name: String,
    listener: std::net::TcpListener,
    tls: Option<Tls>,
    backend: Backend,
) -> Error {
    let address = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let stopped = |reason: String| Error::ListenerStopped {
        name: name.clone(),
        address,
        reason,
    };
    let listener = match listener
        .set_nonblocking(true)
        .and_then(|()| TcpListener::from_std(listener))
    {
        Ok(listener) => listener,
        Err(e) => return stopped(e.to_string()),
    };
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                warn!(error_code = "EM-FRONT-ACCEPT", listener = %name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let tls = tls.clone();
        let backend = backend.clone();
        // The handshake runs in the connection's own task, with a time limit: one silent client
        // cannot hold up the others (rumqttd's own TLS accept loop can be).
        tokio::spawn(async move {
            if backend.low_latency {
                let _ = stream.set_nodelay(true);
            }
            let result = match tls {
                Some(tls) => splice_tls(stream, &tls, &backend).await,
                None => {
                    // A second handle for writing acknowledgements and deliveries from the
                    // thread that releases them (Session::attach).
                    let direct = stream
                        .as_fd()
                        .try_clone_to_owned()
                        .ok()
                        .map(std::net::TcpStream::from);
                    splice(stream, None, direct, &backend).await
                }
            };
            if let Err(reason) = result {
                debug!(%peer, reason, "client dropped by the front");
            }
        });
    }
}

async fn splice_tls(stream: TcpStream, tls: &Tls, backend: &Backend) -> Result<(), String> {
    let stream = tokio::time::timeout(backend.connect_timeout, tls.acceptor.accept(stream))
        .await
        .map_err(|_| "TLS handshake timed out".to_owned())?
        .map_err(|e| format!("TLS handshake: {e}"))?;
    if !tls.client_certificates {
        return splice(stream, None, None, backend).await;
    }
    let (_, session) = stream.get_ref();
    let name = session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .and_then(|leaf| common_name(leaf.as_ref()));
    let Some(name) = name else {
        warn!(
            error_code = "EM-TLS-CLIENT-CERT",
            "client certificate without a usable common name refused"
        );
        return Err("no usable common name".to_owned());
    };
    splice(stream, Some(&name), None, backend).await
}

/// How far the back end has got, as the client side sees it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BackendState {
    Silent,
    Answered,
    Closed,
}

/// How long a back-end connection outlives its client when rumqttd does not close it first.
const LINGER: Duration = Duration::from_millis(500);

/// Copies both ways between the client and the back end until the back end closes, or until
/// the guard cuts the connection off. `direct`: the client's plain TCP socket once more.
async fn splice<S>(
    client: S,
    name: Option<&str>,
    direct: Option<std::net::TcpStream>,
    backend: &Backend,
) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let session = backend.sessions.open();
    if let Some(socket) = direct {
        session.attach(socket);
    }
    let result = tokio::select! {
        result = relay(client, name, backend, &session) => result,
        // Dropping both sockets ends rumqttd's side even while it is blocked writing.
        () = session.cut_off() => Err("cut off by the broker".to_owned()),
    };
    session.detach();
    backend.sessions.close(session.id());
    backend.backlog.landed(session.drop_carried());
    result
}

async fn relay<S>(
    client: S,
    name: Option<&str>,
    backend: &Backend,
    session: &Session,
) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let address = backend.address;
    let inner = TcpStream::connect(address)
        .await
        .map_err(|e| format!("back end {address}: {e}"))?;
    let _ = inner.set_nodelay(backend.low_latency);
    let (mut from_backend, mut to_backend) = inner.into_split();
    to_backend
        .write_all(&preamble(&backend.secret, session.id(), name))
        .await
        .map_err(|e| format!("back end {address}: {e}"))?;
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let (state_tx, mut state) = tokio::sync::watch::channel(BackendState::Silent);
    let up = async {
        let mut pending = BytesMut::new();
        // Bytes of the packet being passed on still to come; `None`: not MQTT, pass everything.
        let mut left = Some(0_usize);
        let mut forwarded = Instant::now();
        'client: loop {
            while !pending.is_empty() {
                let n = match left {
                    None => pending.len(),
                    Some(0) => match head(&pending) {
                        Head::Incomplete => break,
                        Head::Malformed => {
                            left = None;
                            continue;
                        }
                        Head::Packet {
                            len,
                            puback: Some(pkid),
                            ..
                        } if is_front_pkid(pkid) => {
                            // The client acknowledges a publish the front wrote: rumqttd never
                            // sent it, so it never sees the answer.
                            if pending.len() < len {
                                break;
                            }
                            pending.advance(len);
                            session.heard(true);
                            if !kept_alive(&mut to_backend, &mut forwarded).await {
                                break 'client;
                            }
                            continue;
                        }
                        Head::Packet { len, topic, .. } => {
                            if topic.is_some_and(|t| backend.backlog.consumes_client_topic(t)) {
                                if backend.intake.wants(len) {
                                    if pending.len() < len {
                                        // Whole, it may go to its link past rumqttd.
                                        break;
                                    }
                                    if let Some((inbox, message)) =
                                        backend.intake.take(session, &pending[..len])
                                    {
                                        // A full inbox leaves the client's next bytes in its
                                        // socket, as a lagging link does below.
                                        let permit = tokio::select! {
                                            permit = inbox.reserve() => permit,
                                            _ = state.wait_for(|s| *s == BackendState::Closed) => Err(tokio::sync::mpsc::error::SendError(())),
                                        };
                                        let Ok(permit) = permit else {
                                            // The node is stopping, or the client is gone: no
                                            // PUBACK for what will not be committed.
                                            if let Some(ack) = &message.ack {
                                                ack.abandon();
                                            }
                                            break 'client;
                                        };
                                        permit.send(message);
                                        pending.advance(len);
                                        session.heard(false);
                                        if !kept_alive(&mut to_backend, &mut forwarded).await {
                                            break 'client;
                                        }
                                        continue;
                                    }
                                }
                                // While our links lag, leave the client's bytes in its socket:
                                // TCP pushes back. Its other packets wait behind this one.
                                tokio::select! {
                                    () = backend.backlog.admit(len) => {
                                        session.carry(len);
                                        session.routed();
                                    }
                                    _ = state.wait_for(|s| *s == BackendState::Closed) => break 'client,
                                }
                            }
                            left = Some(len);
                            continue;
                        }
                    },
                    Some(more) => more.min(pending.len()),
                };
                if to_backend.write_all(&pending[..n]).await.is_err() {
                    break 'client;
                }
                forwarded = Instant::now();
                pending.advance(n);
                left = left.map(|more| more - n);
            }
            if pending.capacity() - pending.len() < 1024 {
                pending.reserve(READ_CHUNK);
            }
            let read = tokio::select! {
                read = from_client.read_buf(&mut pending) => read,
                // rumqttd dropped the client: so does the front, whatever the client does.
                _ = state.wait_for(|s| *s == BackendState::Closed) => break,
            };
            if matches!(read, Ok(0) | Err(_)) {
                break;
            }
        }
        // The client is gone, but rumqttd 0.20 must not see that before it has finished with
        // the connection: a CONNACK it cannot write leaves a dead will handler behind that
        // panics the next CONNECT with that client id while holding the listener's lock
        // (poisoning it for every client), and an end of stream it sees before it has handled
        // the client's DISCONNECT makes it disconnect the router slot a second time, by then
        // often reused by another client. So wait until rumqttd closes (it does after a
        // DISCONNECT) or has answered and had LINGER to do so.
        let closed = tokio::time::timeout(LINGER, state.wait_for(|s| *s == BackendState::Closed));
        if closed.await.is_err() {
            let _ = tokio::time::timeout(
                backend.connect_timeout,
                state.wait_for(|s| *s >= BackendState::Answered),
            )
            .await;
        }
        let _ = to_backend.shutdown().await;
    };
    let down = async {
        let mut buffer = vec![0_u8; READ_CHUNK];
        let mut client_gone = false;
        let mut packets = Boundaries::default();
        loop {
            if packets.between() && !client_gone {
                session.front_idle();
            }
            let n = tokio::select! {
                read = from_backend.read(&mut buffer) => {
                    session.front_busy();
                    match read {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    }
                },
                // The node committed what the client published, or delivers a publish past
                // rumqttd: write it now, between two of rumqttd's packets.
                () = session.out_ready(), if packets.between() && !client_gone => {
                    let out = session.take_out();
                    session.writing();
                    client_gone = to_client.write_all(&out.bytes).await.is_err();
                    session.written();
                    if !client_gone {
                        out.done(session);
                    }
                    continue;
                }
            };
            state_tx.send_if_modified(|s| {
                let first = *s == BackendState::Silent;
                if first {
                    *s = BackendState::Answered;
                }
                first
            });
            if client_gone {
                continue;
            }
            if backend.low_latency {
                // Acknowledge at once, or rumqttd's Nagle holds its next small packet for our
                // delayed ACK. The flag does not stick, hence after every read.
                let _ = SockRef::from(from_backend.as_ref()).set_tcp_quickack(true);
            }
            // Keep reading after the client has gone, to see when rumqttd closes.
            let read = &buffer[..n];
            session.writing();
            client_gone = match packets.feed(read) {
                Some(end) if end < n => {
                    let out = session.take_out();
                    let written = to_client.write_all(&read[..end]).await;
                    let written = match (written, out.bytes.is_empty()) {
                        (Ok(()), false) => to_client.write_all(&out.bytes).await,
                        (written, _) => written,
                    };
                    if written.is_ok() {
                        out.done(session);
                    }
                    match written {
                        Ok(()) => to_client.write_all(&read[end..]).await.is_err(),
                        Err(_) => true,
                    }
                }
                _ => to_client.write_all(read).await.is_err(),
            };
            session.written();
        }
        session.front_busy();
        state_tx.send_replace(BackendState::Closed);
        let _ = to_client.shutdown().await;
    };
    tokio::join!(up, down);
    Ok(())
}

/// A PINGREQ, sent to rumqttd for a client it has not heard from for [`NUDGE_AFTER`] while the
/// client acknowledged the front's publishes (rumqttd answers the client with a PINGRESP, which
/// MQTT clients take without having asked).
const PINGREQ: [u8; 2] = [0xc0, 0x00];
const NUDGE_AFTER: Duration = Duration::from_secs(1);

/// rumqttd times a client out on what reaches it: for a client whose packets the front kept
/// from it (acknowledgements of the front's publishes, publishes handed to a link), send it a
/// PINGREQ once `forwarded` is [`NUDGE_AFTER`] old. `false`: rumqttd's socket is gone.
async fn kept_alive<W: AsyncWrite + Unpin>(to_backend: &mut W, forwarded: &mut Instant) -> bool {
    if forwarded.elapsed() < NUDGE_AFTER {
        return true;
    }
    *forwarded = Instant::now();
    to_backend.write_all(&PINGREQ).await.is_ok()
}

/// Bytes read from a socket at a time (each connection holds one such buffer per direction).
const READ_CHUNK: usize = 8 * 1024;

/// The subject's common name, if it is non-empty text without control characters.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let usable = !cn.is_empty() && cn.len() < MAX_PREAMBLE / 2 && !cn.chars().any(char::is_control);
    usable.then(|| cn.to_owned())
}

/// `EMCERT1 <secret> <session> <name>\n`; the name is empty without a client certificate.
pub fn preamble(secret: &str, session: u64, name: Option<&str>) -> Vec<u8> {
    let name = name.unwrap_or_default();
    let session = session.to_string();
    [
        MAGIC,
        secret.as_bytes(),
        b" ",
        session.as_bytes(),
        b" ",
        name.as_bytes(),
        b"\n",
    ]
    .concat()
}

/// What a back-end connection started with.
#[derive(Debug, PartialEq, Eq)]
pub enum Preamble {
    /// Not all of it has arrived yet.
    Incomplete,
    /// The connection came through the front as `session`, with this certificate name if it
    /// had one.
    Vouched { session: u64, name: Option<String> },
    /// No preamble, or one without the right secret: not a connection from the front.
    Absent,
}

/// Reads the preamble off the front of `stream` (consuming it when it is complete).
pub fn take_preamble(stream: &mut BytesMut, secret: &str) -> Preamble {
    let n = stream.len().min(MAGIC.len());
    if stream[..n] != MAGIC[..n] {
        return Preamble::Absent;
    }
    let Some(end) = stream.iter().position(|&b| b == b'\n') else {
        return if stream.len() > MAX_PREAMBLE {
            Preamble::Absent
        } else {
            Preamble::Incomplete
        };
    };
    let line = stream.split_to(end + 1);
    let fields = std::str::from_utf8(&line[MAGIC.len()..end])
        .ok()
        .and_then(|text| text.split_once(' '))
        .and_then(|(given, rest)| Some((given, rest.split_once(' ')?)))
        .and_then(|(given, (session, name))| Some((given, session.parse().ok()?, name)));
    match fields {
        Some((given, session, name)) if given == secret => Preamble::Vouched {
            session,
            name: (!name.is_empty()).then(|| name.to_owned()),
        },
        _ => Preamble::Absent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preamble_round_trips_and_leaves_the_mqtt_bytes() {
        let mut stream = BytesMut::from(&preamble("s3cret", 42, Some("device 1"))[..]);
        stream.extend_from_slice(&[0x10, 0x0c]);
        assert_eq!(
            take_preamble(&mut stream, "s3cret"),
            Preamble::Vouched {
                session: 42,
                name: Some("device 1".into())
            }
        );
        let mut plain = BytesMut::from(&preamble("s3cret", 7, None)[..]);
        assert_eq!(
            take_preamble(&mut plain, "s3cret"),
            Preamble::Vouched {
                session: 7,
                name: None
            }
        );
        assert_eq!(&stream[..], &[0x10, 0x0c]);
    }

    #[test]
    fn a_partial_preamble_waits_for_more() {
        let full = preamble("s3cret", 1, Some("dev"));
        for cut in 0..full.len() {
            let mut stream = BytesMut::from(&full[..cut]);
            assert_eq!(
                take_preamble(&mut stream, "s3cret"),
                Preamble::Incomplete,
                "{cut}"
            );
        }
    }

    #[test]
    fn plain_mqtt_or_a_wrong_secret_is_not_vouched_for() {
        let mut connect = BytesMut::from(&[0x10u8, 0x0c, 0x00, 0x04][..]);
        assert_eq!(take_preamble(&mut connect, "s3cret"), Preamble::Absent);
        let mut forged = BytesMut::from(&preamble("guess", 1, Some("edgecontroller"))[..]);
        assert_eq!(take_preamble(&mut forged, "s3cret"), Preamble::Absent);
        let mut endless = BytesMut::from(MAGIC);
        endless.extend_from_slice(&[b'x'; MAX_PREAMBLE + 1]);
        assert_eq!(take_preamble(&mut endless, "s3cret"), Preamble::Absent);
    }
}
