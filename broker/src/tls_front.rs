//! Our own accept loop in front of a rumqttd listener, for what rumqttd's cannot do:
//!
//! - TLS with client certificates, the certificate's common name being the identity (rumqttd only
//!   exposes the O= field, as a tenant prefix of the client id);
//! - low latency: rumqttd leaves Nagle on for accepted sockets, so a reply that follows a PUBACK
//!   waits for the client's delayed ACK (~40 ms). The front sets TCP_NODELAY towards the client
//!   and acknowledges rumqttd's segments at once (TCP_QUICKACK) on the loopback hop.
//!
//! Each connection is spliced to a loopback rumqttd listener, preceded by a one-line preamble with
//! a per-process secret and the certificate name (if any). The guard on that back end takes the
//! name from the preamble and refuses clients without it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
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
use crate::Error;

/// Starts the preamble; an MQTT client starts with CONNECT (0x10), so a missing preamble shows
/// at the first byte.
const MAGIC: &[u8] = b"EMCERT1 ";
/// A preamble longer than this is not ours.
const MAX_PREAMBLE: usize = 1024;

/// The server side of a client-certificate listener.
pub fn acceptor(name: &str, tls: &ListenerTls, ca_file: &str) -> Result<TlsAcceptor, Error> {
    let bad = |what: String| Error::Config(format!("broker.listeners.{name}.tls: {what}"));
    let certs = read_certs(&tls.cert_file).map_err(bad)?;
    let key = read_key(&tls.key_file).map_err(bad)?;
    let mut roots = RootCertStore::empty();
    for ca in read_certs(ca_file).map_err(bad)? {
        roots
            .add(ca)
            .map_err(|e| bad(format!("client_ca_file {ca_file}: {e}")))?;
    }
    let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| bad(format!("client_ca_file {ca_file}: {e}")))?;
    let config = ServerConfig::builder()
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| bad(format!("cert_file/key_file: {e}")))?;
    Ok(TlsAcceptor::from(Arc::new(config)))
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

/// Accepts clients on `listener` until the task is dropped; each is spliced to `backend`, after a
/// TLS handshake when `acceptor` is given.
pub async fn serve(
    name: String,
    listener: std::net::TcpListener,
    acceptor: Option<TlsAcceptor>,
    backend: SocketAddr,
    secret: Arc<str>,
    handshake_timeout: Duration,
    backlog: Arc<Backlog>,
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
        let acceptor = acceptor.clone();
        let secret = secret.clone();
        let backlog = backlog.clone();
        tokio::spawn(async move {
            let _ = stream.set_nodelay(true);
            let result = match acceptor {
                Some(acceptor) => {
                    splice_tls(
                        stream,
                        &acceptor,
                        backend,
                        &secret,
                        handshake_timeout,
                        &backlog,
                    )
                    .await
                }
                None => splice(stream, None, backend, &secret, &backlog).await,
            };
            if let Err(reason) = result {
                debug!(%peer, reason, "client dropped by the front");
            }
        });
    }
}

async fn splice_tls(
    stream: TcpStream,
    acceptor: &TlsAcceptor,
    backend: SocketAddr,
    secret: &str,
    handshake_timeout: Duration,
    backlog: &Backlog,
) -> Result<(), String> {
    let tls = tokio::time::timeout(handshake_timeout, acceptor.accept(stream))
        .await
        .map_err(|_| "TLS handshake timed out".to_owned())?
        .map_err(|e| format!("TLS handshake: {e}"))?;
    let (_, session) = tls.get_ref();
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
    splice(tls, Some(&name), backend, secret, backlog).await
}

/// Copies both ways between the client and the back end until either side closes.
async fn splice<S>(
    client: S,
    name: Option<&str>,
    backend: SocketAddr,
    secret: &str,
    backlog: &Backlog,
) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let inner = TcpStream::connect(backend)
        .await
        .map_err(|e| format!("back end {backend}: {e}"))?;
    let _ = inner.set_nodelay(true);
    let (mut from_backend, mut to_backend) = inner.into_split();
    to_backend
        .write_all(&preamble(secret, name))
        .await
        .map_err(|e| format!("back end {backend}: {e}"))?;
    let (mut from_client, mut to_client) = tokio::io::split(client);
    let up = async {
        let mut buffer = vec![0_u8; 16 * 1024];
        loop {
            // While our links lag, leave the client's bytes in its socket: TCP pushes back.
            backlog.room().await;
            match from_client.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to_backend.write_all(&buffer[..n]).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to_backend.shutdown().await;
    };
    let down = async {
        let mut buffer = vec![0_u8; 16 * 1024];
        while let Ok(n) = from_backend.read(&mut buffer).await {
            if n == 0 {
                break;
            }
            // Acknowledge at once, or rumqttd's Nagle holds its next small packet for our
            // delayed ACK. The flag does not stick, hence after every read.
            let _ = SockRef::from(from_backend.as_ref()).set_tcp_quickack(true);
            if to_client.write_all(&buffer[..n]).await.is_err() {
                break;
            }
        }
        let _ = to_client.shutdown().await;
    };
    tokio::join!(up, down);
    Ok(())
}

/// The subject's common name, if it is non-empty text without control characters.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let usable = !cn.is_empty() && cn.len() < MAX_PREAMBLE / 2 && !cn.chars().any(char::is_control);
    usable.then(|| cn.to_owned())
}

/// `EMCERT1 <secret> <name>\n`; the name is empty without a client certificate.
pub fn preamble(secret: &str, name: Option<&str>) -> Vec<u8> {
    let name = name.unwrap_or_default();
    [MAGIC, secret.as_bytes(), b" ", name.as_bytes(), b"\n"].concat()
}

/// What a back-end connection started with.
#[derive(Debug, PartialEq, Eq)]
pub enum Preamble {
    /// Not all of it has arrived yet.
    Incomplete,
    /// The connection came through the front, with this certificate name if it had one.
    Vouched(Option<String>),
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
        .and_then(|text| text.split_once(' '));
    match fields {
        Some((given, name)) if given == secret => {
            Preamble::Vouched((!name.is_empty()).then(|| name.to_owned()))
        }
        _ => Preamble::Absent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preamble_round_trips_and_leaves_the_mqtt_bytes() {
        let mut stream = BytesMut::from(&preamble("s3cret", Some("device 1"))[..]);
        stream.extend_from_slice(&[0x10, 0x0c]);
        assert_eq!(
            take_preamble(&mut stream, "s3cret"),
            Preamble::Vouched(Some("device 1".into()))
        );
        assert_eq!(&stream[..], &[0x10, 0x0c]);
    }

    #[test]
    fn a_partial_preamble_waits_for_more() {
        let full = preamble("s3cret", Some("dev"));
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
        let mut forged = BytesMut::from(&preamble("guess", Some("edgecontroller"))[..]);
        assert_eq!(take_preamble(&mut forged, "s3cret"), Preamble::Absent);
        let mut endless = BytesMut::from(MAGIC);
        endless.extend_from_slice(&[b'x'; MAX_PREAMBLE + 1]);
        assert_eq!(take_preamble(&mut endless, "s3cret"), Preamble::Absent);
    }
}
