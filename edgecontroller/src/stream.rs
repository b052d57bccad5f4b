//! kubelet's API for the managed nodes: an HTTPS server the apiserver dials (the address and
//! port each Node reports), which authenticates it by its client certificate and carries each
//! connection's bytes over the cloud broker to the node's edged and back
//! (`edgemeta_protocol::stream`: one topic per stream and direction, a credit window each).
//!
//! The node is the request's `Host` (`<node>.<domain>`); edged answers from its loopback
//! kubelet API, so status codes, chunked bodies and upgrades pass through unchanged.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use edgemeta_protocol::stream::{self as wire, Frame, Incoming, Prefixed};
use rumqttc::{AsyncClient, Event, LastWill, MqttOptions, Packet, QoS};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{Config, Error};

/// A request head longer than this is refused (431).
const MAX_HEAD: usize = 16 * 1024;
/// TLS handshake and request head, each.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How the stream server runs (`--stream-*` flags).
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Where the apiserver dials: the port every managed Node reports as its kubelet port.
    pub listen: SocketAddr,
    /// The server certificate chain and key (PEM); the names the Nodes report must be in it.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Client certificates must be signed by this CA (the apiserver's
    /// `--kubelet-client-certificate`); a connection without one gets 401.
    pub client_ca: PathBuf,
    /// The Nodes' kubelet address is `<node>.<domain>`; empty: the `Host` is the node name.
    pub domain: String,
    /// Bytes in flight per stream and direction (the memory bound of a stream on each side).
    pub window: u32,
    /// How long a node has to answer a new stream.
    pub open_timeout: Duration,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            listen: SocketAddr::from(([0, 0, 0, 0], 10350)),
            cert: PathBuf::new(),
            key: PathBuf::new(),
            client_ca: PathBuf::new(),
            domain: String::new(),
            window: 64 * 1024,
            open_timeout: Duration::from_secs(10),
            max_connections: 1024,
        }
    }
}

/// What the connection handlers ask of the MQTT task, which owns the streams and node states.
enum Command {
    /// Registers stream `id` to `node`; the answer is whether the node's stream link is up.
    Open {
        node: String,
        id: String,
        tx: mpsc::Sender<Incoming>,
        reply: oneshot::Sender<bool>,
    },
}

/// A stream's frames go to `<root>/<node>/stream/down/<id>`.
struct DownPublisher {
    client: AsyncClient,
    topic: String,
}

impl wire::Publisher for DownPublisher {
    async fn publish(&self, payload: Vec<u8>) -> bool {
        self.client
            .publish(self.topic.clone(), QoS::AtLeastOnce, false, payload)
            .await
            .is_ok()
    }
}

/// What every connection handler shares.
struct Shared {
    client: AsyncClient,
    root: String,
    name: String,
    domain: String,
    window: u32,
    open_timeout: Duration,
    commands: mpsc::Sender<Command>,
}

/// Serves kubelet's API for the managed nodes until `cancel`.
///
/// # Errors
/// [`Error::Stream`] when the certificates cannot be read or the address cannot be bound.
pub async fn run(
    config: &Config,
    stream: StreamConfig,
    cancel: CancellationToken,
) -> Result<(), Error> {
    let acceptor = tls_acceptor(&stream)?;
    let listener = tokio::net::TcpListener::bind(stream.listen)
        .await
        .map_err(|e| Error::Stream(format!("binding {}: {e}", stream.listen)))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::Stream(format!("binding {}: {e}", stream.listen)))?;
    let (host, port) = config.broker_address()?;
    // Replicas share `--client-id`; each stream link needs its own.
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let name = format!("{}-stream-{}", config.client_id, &suffix[..8]);
    let mut options = MqttOptions::new(name.clone(), host, port);
    options.set_clean_session(true);
    options.set_keep_alive(Duration::from_secs(15));
    options.set_max_packet_size(64 * 1024, 64 * 1024);
    options.set_inflight(200);
    if let (Some(user), Some(password)) = (&config.username, &config.password) {
        options.set_credentials(user.clone(), password.clone());
    }
    let state = wire::controller_state_topic(&config.root, &name);
    options.set_last_will(LastWill::new(&state, "offline", QoS::AtLeastOnce, true));
    let (client, eventloop) = AsyncClient::new(options, 1024);
    let (commands, commands_rx) = mpsc::channel(256);
    let link = tokio::spawn(link(
        eventloop,
        client.clone(),
        config.root.clone(),
        state,
        commands_rx,
        cancel.clone(),
    ));
    let shared = Arc::new(Shared {
        client,
        root: config.root.clone(),
        name,
        domain: stream.domain.clone(),
        window: stream.window.max(1024),
        open_timeout: stream.open_timeout,
        commands,
    });
    info!(address = %bound, domain = %stream.domain, "kubelet stream server listening");
    let slots = Arc::new(Semaphore::new(stream.max_connections.max(1)));
    loop {
        let permit = tokio::select! {
            _ = cancel.cancelled() => break,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                warn!(error_code = "EM-EC-STREAM", error = %e, "accepting a stream connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, shared, stop) = (acceptor.clone(), shared.clone(), cancel.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = serve(tcp, peer, acceptor, &shared) => {}
            }
            drop(permit);
        });
    }
    let _ = link.await;
    Ok(())
}

/// The server's TLS: its certificate, and client certificates verified against `client_ca`
/// but not required at the handshake, so a request without one gets an HTTP 401.
fn tls_acceptor(stream: &StreamConfig) -> Result<TlsAcceptor, Error> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read = |path: &PathBuf| {
        std::fs::read(path).map_err(|e| Error::Stream(format!("reading {}: {e}", path.display())))
    };
    let certs = |path: &PathBuf| -> Result<Vec<CertificateDer<'static>>, Error> {
        let pem = read(path)?;
        let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<_, _>>()
            .map_err(|e| Error::Stream(format!("{}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(Error::Stream(format!("{}: no certificate", path.display())));
        }
        Ok(certs)
    };
    let chain = certs(&stream.cert)?;
    let key_pem = read(&stream.key)?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| Error::Stream(format!("{}: {e}", stream.key.display())))?
        .ok_or_else(|| Error::Stream(format!("{}: no private key", stream.key.display())))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in certs(&stream.client_ca)? {
        roots
            .add(ca)
            .map_err(|e| Error::Stream(format!("{}: {e}", stream.client_ca.display())))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .allow_unauthenticated()
    .build()
    .map_err(|e| Error::Stream(format!("client CA: {e}")))?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Stream(format!("TLS: {e}")))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| Error::Stream(format!("server certificate: {e}")))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// A plain-text HTTP answer that ends the connection.
async fn refuse<S: tokio::io::AsyncWrite + Unpin>(
    socket: &mut S,
    code: u16,
    reason: &str,
    body: &str,
) {
    let response = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = socket.write_all(response.as_bytes()).await;
    let _ = socket.shutdown().await;
}

/// The request head (up to its blank line, plus whatever followed it in the same reads).
async fn read_head<S: tokio::io::AsyncRead + Unpin>(socket: &mut S) -> Result<Vec<u8>, u16> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    loop {
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            return Err(431);
        }
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return Err(400),
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
}

/// The node a request is for: its `Host` less the port and `.<domain>`.
fn node_of(head: &[u8], domain: &str) -> Result<String, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut request = httparse::Request::new(&mut headers);
    request
        .parse(head)
        .map_err(|e| format!("malformed request: {e}"))?;
    let host = request
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("host"))
        .and_then(|h| std::str::from_utf8(h.value).ok())
        .ok_or("the request has no Host")?;
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    };
    let node = if domain.is_empty() {
        name
    } else {
        name.strip_suffix(domain)
            .and_then(|n| n.strip_suffix('.'))
            .ok_or_else(|| format!("host {name:?} is not under {domain:?}"))?
    };
    let valid = !node.is_empty()
        && node.len() <= 253
        && node
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if valid {
        Ok(node.to_owned())
    } else {
        Err(format!("{node:?} is not a node name"))
    }
}

/// One apiserver connection: authenticate, find the node, open a stream, relay.
async fn serve(
    tcp: tokio::net::TcpStream,
    peer: SocketAddr,
    acceptor: TlsAcceptor,
    shared: &Shared,
) {
    let mut tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "stream connection refused at the TLS handshake");
            return;
        }
        Err(_) => return,
    };
    let authenticated = tls
        .get_ref()
        .1
        .peer_certificates()
        .is_some_and(|certs| !certs.is_empty());
    let head = match tokio::time::timeout(HANDSHAKE_TIMEOUT, read_head(&mut tls)).await {
        Ok(Ok(head)) => head,
        Ok(Err(431)) => {
            return refuse(
                &mut tls,
                431,
                "Request Header Fields Too Large",
                "request head too large\n",
            )
            .await
        }
        _ => return refuse(&mut tls, 400, "Bad Request", "no complete request head\n").await,
    };
    if !authenticated {
        warn!(error_code = "EM-EC-STREAM-AUTH", %peer, "kubelet API request without a client certificate refused");
        return refuse(
            &mut tls,
            401,
            "Unauthorized",
            "Unauthorized: a client certificate signed by the configured CA is required\n",
        )
        .await;
    }
    let node = match node_of(&head, &shared.domain) {
        Ok(node) => node,
        Err(message) => return refuse(&mut tls, 400, "Bad Request", &format!("{message}\n")).await,
    };
    let id = uuid::Uuid::new_v4().simple().to_string();
    let (tx, mut rx) = mpsc::channel(wire::QUEUED_FRAMES);
    let (reply, online) = oneshot::channel();
    let asked = shared
        .commands
        .send(Command::Open {
            node: node.clone(),
            id: id.clone(),
            tx,
            reply,
        })
        .await;
    if asked.is_err() || online.await != Ok(true) {
        return refuse(
            &mut tls,
            502,
            "Bad Gateway",
            &format!("node {node:?} has no stream link to this controller\n"),
        )
        .await;
    }
    let down = DownPublisher {
        client: shared.client.clone(),
        topic: wire::down_topic(&shared.root, &node, &id),
    };
    use wire::Publisher as _;
    let open = Frame::Open {
        window: shared.window,
        controller: &shared.name,
    };
    if !down.publish(open.encode()).await {
        return refuse(
            &mut tls,
            503,
            "Service Unavailable",
            "the cloud broker is unreachable\n",
        )
        .await;
    }
    match tokio::time::timeout(shared.open_timeout, rx.recv()).await {
        Ok(Some(Incoming::Credit(_))) => {}
        Ok(Some(Incoming::Close(reason))) => {
            return refuse(
                &mut tls,
                502,
                "Bad Gateway",
                &format!("node {node:?}: {reason}\n"),
            )
            .await
        }
        Ok(_) => return refuse(&mut tls, 502, "Bad Gateway", "the stream ended\n").await,
        Err(_) => {
            let _ = down
                .publish(Frame::Close("not answered in time").encode())
                .await;
            return refuse(
                &mut tls,
                504,
                "Gateway Timeout",
                &format!("node {node:?} did not answer the stream\n"),
            )
            .await;
        }
    }
    debug!(%node, stream = %id, "stream open");
    if let Err(reason) = wire::relay(Prefixed::new(head, tls), rx, &down, shared.window).await {
        debug!(%node, stream = %id, reason, "stream aborted");
    }
}

/// The stream link's MQTT session: routes node frames to their streams, keeps which nodes'
/// links are up (their retained state), and serves [`Command`]s. It never waits on a stream.
async fn link(
    mut eventloop: rumqttc::EventLoop,
    client: AsyncClient,
    root: String,
    state: String,
    mut commands: mpsc::Receiver<Command>,
    cancel: CancellationToken,
) {
    let mut streams: HashMap<String, (String, mpsc::Sender<Incoming>)> = HashMap::new();
    let mut online: HashSet<String> = HashSet::new();
    let mut backoff =
        edgemeta_protocol::Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let event = tokio::select! {
            _ = cancel.cancelled() => break,
            command = commands.recv() => {
                let Some(Command::Open { node, id, tx, reply }) = command else { break };
                streams.retain(|_, (_, tx)| !tx.is_closed());
                let up = online.contains(&node);
                if up {
                    streams.insert(id, (node, tx));
                }
                let _ = reply.send(up);
                continue;
            }
            event = eventloop.poll() => event,
        };
        match event {
            Ok(Event::Incoming(Packet::ConnAck(_))) => {
                backoff.reset();
                info!("stream link connected to the cloud broker");
                let _ = client.try_subscribe(format!("{root}/+/stream/up/+"), QoS::AtLeastOnce);
                let _ = client.try_subscribe(format!("{root}/+/stream/state"), QoS::AtLeastOnce);
                let _ = client.try_publish(state.clone(), QoS::AtLeastOnce, true, "online");
            }
            Ok(Event::Incoming(Packet::Publish(publish))) => {
                let Some((node, id)) = wire::parse_up(&root, &publish.topic) else {
                    continue;
                };
                let Some(id) = id else {
                    if publish.payload.as_ref() == b"online" {
                        online.insert(node.to_owned());
                    } else {
                        online.remove(node);
                        // Its streams end: dropping their senders aborts them.
                        streams.retain(|_, (n, _)| n != node);
                    }
                    continue;
                };
                let frame = match Frame::decode(&publish.payload) {
                    Ok(frame) => frame,
                    Err(e) => {
                        warn!(error_code = "EM-EC-STREAM", topic = %publish.topic, error = %e, "malformed stream frame dropped");
                        continue;
                    }
                };
                let Some(incoming) = Incoming::from_frame(&frame) else {
                    continue;
                };
                if let Some((owner, tx)) = streams.get(id) {
                    if owner != node || tx.try_send(incoming).is_err() {
                        warn!(error_code = "EM-EC-STREAM", stream = %id, %node, "stream frame from the wrong node or over its queue; aborting the stream");
                        streams.remove(id);
                    }
                }
            }
            Ok(_) => {}
            Err(e) => {
                streams.clear();
                online.clear();
                let delay = backoff.next_delay();
                warn!(error_code = "EM-EC-STREAM-DISCONNECTED", error = %e, retry_ms = delay.as_millis() as u64, "stream link to the cloud broker lost");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(delay) => {}
                }
            }
        }
    }
    let _ = client.try_publish(state, QoS::AtLeastOnce, true, "offline");
    let _ = client.try_disconnect();
    let _ = tokio::time::timeout(Duration::from_millis(300), async {
        while eventloop.poll().await.is_ok() {}
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_is_the_host_under_the_domain() {
        let head =
            b"GET /containerLogs/default/web/main HTTP/1.1\r\nHost: n-1.edge.test:10350\r\n\r\n";
        assert_eq!(node_of(head, "edge.test").as_deref(), Ok("n-1"));
        assert!(node_of(head, "other.test").is_err());
        assert_eq!(node_of(head, "").as_deref(), Ok("n-1.edge.test"));
        let bare = b"GET / HTTP/1.1\r\nhost: n2\r\n\r\n";
        assert_eq!(node_of(bare, "").as_deref(), Ok("n2"));
        assert!(node_of(b"GET / HTTP/1.1\r\n\r\n", "").is_err());
        let evil = b"GET / HTTP/1.1\r\nHost: a+b/#.edge.test\r\n\r\n";
        assert!(node_of(evil, "edge.test").is_err());
    }
}
