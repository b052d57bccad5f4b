//! A listener's TLS: the server's certificate, and with `client_ca_file` a demand for client
//! certificates whose common name is the client's identity for the ACL.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tracing::warn;

use crate::config::ListenerTls;
use crate::Error;

/// A common name longer than this is not taken as an identity.
const MAX_NAME: usize = 512;

/// The TLS side of a listener.
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

    /// The handshake, within `limit`; with client certificates, also the name it proves.
    pub async fn accept(
        &self,
        stream: TcpStream,
        limit: Duration,
    ) -> Result<(TlsStream<TcpStream>, Option<String>), String> {
        let stream = tokio::time::timeout(limit, self.acceptor.accept(stream))
            .await
            .map_err(|_| "TLS handshake timed out".to_owned())?
            .map_err(|e| format!("TLS handshake: {e}"))?;
        if !self.client_certificates {
            return Ok((stream, None));
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
        Ok((stream, Some(name)))
    }
}

impl crate::direct::AckNow for TlsStream<TcpStream> {
    fn ack_now(&self) {
        crate::direct::ack_now(self.get_ref().0);
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

/// The subject's common name, if it is non-empty text without control characters.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    let usable = !cn.is_empty() && cn.len() < MAX_NAME && !cn.chars().any(char::is_control);
    usable.then(|| cn.to_owned())
}
