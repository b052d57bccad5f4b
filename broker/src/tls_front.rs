//! TLS listeners that require client certificates, with the certificate's common name as the
//! connection's identity.
//!
//! rumqttd only exposes a client certificate's O= field (as a tenant prefix of the client id), so
//! such a listener does its own handshake and splices each connection to a loopback rumqttd
//! listener behind it, preceded by a one-line preamble with a per-process secret and the name.
//! The guard on that back end takes the name from the preamble and refuses clients without one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

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

/// Accepts TLS clients on `listener` until the task is dropped; each is spliced to `backend`.
pub async fn serve(
    name: String,
    listener: std::net::TcpListener,
    acceptor: TlsAcceptor,
    backend: SocketAddr,
    secret: Arc<str>,
    handshake_timeout: Duration,
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
                warn!(error_code = "EM-TLS-ACCEPT", listener = %name, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let acceptor = acceptor.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            if let Err(reason) =
                splice(stream, &acceptor, backend, &secret, handshake_timeout).await
            {
                debug!(%peer, reason, "TLS client dropped");
            }
        });
    }
}

async fn splice(
    stream: TcpStream,
    acceptor: &TlsAcceptor,
    backend: SocketAddr,
    secret: &str,
    handshake_timeout: Duration,
) -> Result<(), String> {
    let mut tls = tokio::time::timeout(handshake_timeout, acceptor.accept(stream))
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
    let mut inner = TcpStream::connect(backend)
        .await
        .map_err(|e| format!("back end {backend}: {e}"))?;
    let _ = inner.set_nodelay(true);
    inner
        .write_all(&preamble(secret, &name))
        .await
        .map_err(|e| format!("back end {backend}: {e}"))?;
    tokio::io::copy_bidirectional(&mut tls, &mut inner)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// The subject's common name, if it is non-empty text without control characters.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let usable = !cn.is_empty() && cn.len() < MAX_PREAMBLE / 2 && !cn.chars().any(char::is_control);
    usable.then(|| cn.to_owned())
}

/// `EMCERT1 <secret> <name>\n`.
pub fn preamble(secret: &str, name: &str) -> Vec<u8> {
    [MAGIC, secret.as_bytes(), b" ", name.as_bytes(), b"\n"].concat()
}

/// What a back-end connection started with.
#[derive(Debug, PartialEq, Eq)]
pub enum Preamble {
    /// Not all of it has arrived yet.
    Incomplete,
    /// The front vouched for this certificate name.
    Vouched(String),
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
        Some((given, name)) if given == secret && !name.is_empty() => {
            Preamble::Vouched(name.to_owned())
        }
        _ => Preamble::Absent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preamble_round_trips_and_leaves_the_mqtt_bytes() {
        let mut stream = BytesMut::from(&preamble("s3cret", "device 1")[..]);
        stream.extend_from_slice(&[0x10, 0x0c]);
        assert_eq!(
            take_preamble(&mut stream, "s3cret"),
            Preamble::Vouched("device 1".into())
        );
        assert_eq!(&stream[..], &[0x10, 0x0c]);
    }

    #[test]
    fn a_partial_preamble_waits_for_more() {
        let full = preamble("s3cret", "dev");
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
        let mut forged = BytesMut::from(&preamble("guess", "edgecontroller")[..]);
        assert_eq!(take_preamble(&mut forged, "s3cret"), Preamble::Absent);
        let mut endless = BytesMut::from(MAGIC);
        endless.extend_from_slice(&[b'x'; MAX_PREAMBLE + 1]);
        assert_eq!(take_preamble(&mut endless, "s3cret"), Preamble::Absent);
    }
}
