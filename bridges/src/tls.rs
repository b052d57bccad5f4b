//! TLS to the cloud broker (`mqtts://`): server verification against the system roots or
//! `cloud.tls.ca_file`, optional client certificate, ALPN. Files are read each time a config is
//! built, once per session, so a rotated certificate is picked up at the next reconnect.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::ring;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use serde::Deserialize;
use tracing::warn;

use crate::Error;

/// `cloud.tls`: used when `cloud.url` is `mqtts://`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM CA certificates to trust for the cloud broker; the system's roots when unset.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain) for mutual TLS; needs `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC) of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// ALPN protocols offered, e.g. `["mqtt"]` for services that route MQTT on 443 by ALPN.
    #[serde(default)]
    pub alpn: Vec<String>,
    /// Accepts a certificate that does not name the host. For test rigs only: anyone with a
    /// certificate from a trusted CA can then pose as the cloud.
    #[serde(default)]
    pub insecure_skip_hostname_check: bool,
}

impl TlsConfig {
    /// Reads the files and builds the rustls config; errors name the key, the file and what is
    /// wrong with it.
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, Error> {
        let provider = Arc::new(ring::default_provider());
        let roots = Arc::new(self.roots()?);
        let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| Error::Config(format!("cloud.tls.ca_file: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = if self.insecure_skip_hostname_check {
            warn!(
                error_code = "EM-BRIDGE-TLS-INSECURE",
                "cloud.tls.insecure_skip_hostname_check is on: the cloud broker's certificate is not checked against its host name; never use this outside a test rig"
            );
            Arc::new(AnyName(verifier))
        } else {
            verifier
        };
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("cloud.tls: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match (&self.cert_file, &self.key_file) {
            (None, None) => builder.with_no_client_auth(),
            (Some(_), None) => {
                return Err(Error::Config(
                    "cloud.tls.cert_file is set but cloud.tls.key_file is not".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::Config(
                    "cloud.tls.key_file is set but cloud.tls.cert_file is not".into(),
                ))
            }
            (Some(cert), Some(key)) => {
                let chain = certificates("cloud.tls.cert_file", cert)?;
                let key_der = private_key(key)?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    Error::Config(format!(
                        "cloud.tls.key_file {}: does not fit cloud.tls.cert_file {}: {e}",
                        key.display(),
                        cert.display()
                    ))
                })?
            }
        };
        config.alpn_protocols = self.alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
        Ok(Arc::new(config))
    }

    fn roots(&self) -> Result<RootCertStore, Error> {
        let mut roots = RootCertStore::empty();
        match &self.ca_file {
            Some(path) => {
                for cert in certificates("cloud.tls.ca_file", path)? {
                    roots.add(cert).map_err(|e| {
                        Error::Config(format!(
                            "cloud.tls.ca_file {}: not a usable CA certificate: {e}",
                            path.display()
                        ))
                    })?;
                }
            }
            None => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(Error::Config(
                        "cloud.tls: no system root certificates found; set cloud.tls.ca_file"
                            .into(),
                    ));
                }
            }
        }
        Ok(roots)
    }
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path)
        .map_err(|e| Error::Config(format!("{key} {}: cannot read: {e}", path.display())))
}

/// Every certificate in a PEM file; at least one.
fn certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = read(key, path)?;
    let certs = rustls_pemfile::certs(&mut pem.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Config(format!("{key} {}: not PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Config(format!(
            "{key} {}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, Error> {
    let key = "cloud.tls.key_file";
    let pem = read(key, path)?;
    rustls_pemfile::private_key(&mut pem.as_slice())
        .map_err(|e| Error::Config(format!("{key} {}: not PEM: {e}", path.display())))?
        .ok_or_else(|| {
            Error::Config(format!(
                "{key} {}: no PEM private key in it (PKCS#8, RSA or EC)",
                path.display()
            ))
        })
}

/// Verifies the chain as the inner verifier does, but not the host name
/// (`insecure_skip_hostname_check`).
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
