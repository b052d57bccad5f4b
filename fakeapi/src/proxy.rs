//! `pods/log` as kube-apiserver proxies it: find the pod's Node, dial the address and kubelet
//! port the Node reports over HTTPS with the kubelet client certificate, and stream
//! `/containerLogs/...` back. A kubelet error comes back as a `Status` with its code.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio_rustls::TlsConnector;

use crate::server::Shared;

/// kube-apiserver's default `--kubelet-preferred-address-types`.
pub const DEFAULT_ADDRESS_TYPES: [&str; 5] = [
    "Hostname",
    "InternalDNS",
    "InternalIP",
    "ExternalDNS",
    "ExternalIP",
];
/// Dialling a kubelet and reading its response head.
const KUBELET_TIMEOUT: Duration = Duration::from_secs(15);
/// An error body from a kubelet is read up to this size.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// The `pods/log` parameters passed on to the kubelet (kube-apiserver's `LogLocation`).
const LOG_PARAMETERS: [&str; 6] = [
    "follow",
    "previous",
    "timestamps",
    "sinceSeconds",
    "sinceTime",
    "tailLines",
];

/// How the fake reaches kubelets (kube-apiserver's `--kubelet-*` flags).
#[derive(Debug, Clone)]
pub struct KubeletClient {
    /// `--kubelet-client-certificate` / `--kubelet-client-key` (PEM).
    pub cert: PathBuf,
    pub key: PathBuf,
    /// `--kubelet-certificate-authority`: kubelets' serving certificates are verified with it.
    pub ca: PathBuf,
    /// `--kubelet-preferred-address-types`.
    pub preferred_address_types: Vec<String>,
    /// Dial this address whatever the Node's address resolves to (the name is still sent as
    /// TLS server name and `Host`): stands in for a DNS record in tests and the demo.
    pub dial: Option<SocketAddr>,
}

/// The `pods/log` route's state.
pub(crate) struct Proxy {
    pub shared: Arc<Shared>,
    pub kubelet: Option<(TlsConnector, KubeletClient)>,
}

/// The TLS client for kubelets, from `client`'s files.
pub(crate) fn connector(client: &KubeletClient) -> Result<TlsConnector, String> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read = |path: &PathBuf| std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()));
    let certs = |path: &PathBuf| -> Result<Vec<CertificateDer<'static>>, String> {
        let pem = read(path)?;
        rustls_pemfile::certs(&mut pem.as_slice())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    for ca in certs(&client.ca)? {
        roots
            .add(ca)
            .map_err(|e| format!("{}: {e}", client.ca.display()))?;
    }
    let key_pem = read(&client.key)?;
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_slice())
        .map_err(|e| format!("{}: {e}", client.key.display()))?
        .ok_or_else(|| format!("{}: no private key", client.key.display()))?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| e.to_string())?
    .with_root_certificates(roots)
    .with_client_auth_cert(certs(&client.cert)?, key)
    .map_err(|e| format!("kubelet client certificate: {e}"))?;
    Ok(TlsConnector::from(Arc::new(config)))
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = edgemeta_kubewire::failure(code.as_u16(), reason, message, serde_json::json!({}));
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn reason_of(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

/// Where a pod's kubelet is: address, port and the container asked for.
struct KubeletTarget<'a> {
    connector: &'a TlsConnector,
    client: &'a KubeletClient,
    address: String,
    port: u16,
    container: String,
}

/// An answer of the API instead of a kubelet's: code, reason, message.
type Refused = (u16, &'static str, String);

/// The pod's container (`container`, or the only one) and its Node's kubelet, or the API's
/// error for it.
fn kubelet_of<'a>(
    proxy: &'a Proxy,
    namespace: &str,
    name: &str,
    container: Option<&str>,
) -> Result<KubeletTarget<'a>, Refused> {
    let found = {
        let store = proxy.shared.store();
        let pods = crate::kinds::find("", "v1", "pods").expect("pods are served");
        let nodes = crate::kinds::find("", "v1", "nodes").expect("nodes are served");
        store.get(pods, namespace, name).map(|pod| {
            let node = pod["spec"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let node_object = (!node.is_empty())
                .then(|| store.get(nodes, "", &node).ok())
                .flatten();
            (pod, node, node_object)
        })
    };
    let (pod, node, node_object) =
        found.map_err(|e| (e.code(), reason_of(e.code()), e.to_string()))?;
    let containers: Vec<&str> = pod["spec"]["containers"]
        .as_array()
        .map(|c| c.iter().filter_map(|c| c["name"].as_str()).collect())
        .unwrap_or_default();
    let container = match container {
        Some(c) if !c.is_empty() => {
            if !containers.contains(&c) {
                return Err((
                    400,
                    "BadRequest",
                    format!("container {c} is not valid for pod {name}"),
                ));
            }
            c.to_owned()
        }
        _ if containers.len() == 1 => containers[0].to_owned(),
        _ => {
            return Err((
                400,
                "BadRequest",
                format!(
                    "a container name must be specified for pod {name}, choose one of: [{}]",
                    containers.join(" ")
                ),
            ))
        }
    };
    if node.is_empty() {
        return Err((
            400,
            "BadRequest",
            format!("pod {name} does not have a host assigned"),
        ));
    }
    let Some(node_object) = node_object else {
        return Err((404, "NotFound", format!("nodes \"{node}\" not found")));
    };
    let Some((connector, client)) = &proxy.kubelet else {
        return Err((
            503,
            "ServiceUnavailable",
            "no kubelet client certificate configured (--kubelet-client-certificate)".to_owned(),
        ));
    };
    let Some((address, port)) = kubelet_address(&node_object, &client.preferred_address_types)
    else {
        return Err((
            503,
            "ServiceUnavailable",
            format!("node {node} reports no kubelet address and port"),
        ));
    };
    Ok(KubeletTarget {
        connector,
        client,
        address,
        port,
        container,
    })
}

/// `GET /api/v1/namespaces/{ns}/pods/{name}/log`.
pub(crate) async fn log(
    State(proxy): State<Arc<Proxy>>,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    let target = match kubelet_of(
        &proxy,
        &namespace,
        &name,
        params.get("container").map(String::as_str),
    ) {
        Ok(target) => target,
        Err((code, reason, message)) => return status(code, reason, &message),
    };
    let KubeletTarget {
        connector,
        client,
        address,
        port,
        container,
    } = target;
    let mut query: Vec<String> = Vec::new();
    for key in LOG_PARAMETERS {
        if let Some(value) = params.get(key) {
            query.push(format!("{key}={}", encode(value)));
        }
    }
    if let Some(limit) = params.get("limitBytes") {
        query.push(format!("limitBytes={}", encode(limit)));
    }
    let path = format!(
        "/containerLogs/{namespace}/{name}/{container}{}{}",
        if query.is_empty() { "" } else { "?" },
        query.join("&")
    );
    match send(
        connector,
        client,
        &address,
        port,
        plain_get(&address, port, &path),
    )
    .await
    {
        Ok(response) if response.status().is_success() => {
            let body = Body::new(response.into_body());
            ([(header::CONTENT_TYPE, "text/plain")], body).into_response()
        }
        Ok(response) => kubelet_error(response).await,
        Err(message) => status(
            500,
            "InternalError",
            &format!("Get \"https://{address}:{port}{path}\": {message}"),
        ),
    }
}

/// A kubelet's error answer as the API's `Status` with its code.
async fn kubelet_error(response: hyper::Response<hyper::body::Incoming>) -> Response {
    {
        {
            let code = response.status().as_u16();
            let text = tokio::time::timeout(KUBELET_TIMEOUT, async {
                let mut body = response.into_body();
                let mut text = Vec::new();
                while let Some(Ok(frame)) = body.frame().await {
                    if let Ok(data) = frame.into_data() {
                        text.extend_from_slice(&data);
                        if text.len() > MAX_ERROR_BODY {
                            break;
                        }
                    }
                }
                text
            })
            .await
            .unwrap_or_default();
            let text = String::from_utf8_lossy(&text);
            status(code, reason_of(code), text.trim_end())
        }
    }
}

/// The `pods/exec` parameters passed on to the kubelet.
const EXEC_PARAMETERS: [&str; 5] = ["command", "stdin", "stdout", "stderr", "tty"];
/// Request headers of a protocol upgrade passed on to the kubelet.
const UPGRADE_HEADERS: [&str; 6] = [
    "upgrade",
    "connection",
    "sec-websocket-key",
    "sec-websocket-version",
    "sec-websocket-protocol",
    "x-stream-protocol-version",
];

/// `pods/exec`: the upgrade (WebSocket, as kubectl ≥ 1.30 asks) passed through to the kubelet,
/// then the bytes both ways.
pub(crate) async fn exec(
    State(proxy): State<Arc<Proxy>>,
    Path((namespace, name)): Path<(String, String)>,
    Query(params): Query<Vec<(String, String)>>,
    mut request: axum::extract::Request,
) -> Response {
    let container = params
        .iter()
        .find(|(k, _)| k == "container")
        .map(|(_, v)| v.as_str());
    let target = match kubelet_of(&proxy, &namespace, &name, container) {
        Ok(target) => target,
        Err((code, reason, message)) => return status(code, reason, &message),
    };
    let query: Vec<String> = params
        .iter()
        .filter(|(k, _)| EXEC_PARAMETERS.contains(&k.as_str()))
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect();
    let path = format!(
        "/exec/{namespace}/{name}/{}?{}",
        target.container,
        query.join("&")
    );
    let Some(client_side) = request
        .extensions_mut()
        .remove::<hyper::upgrade::OnUpgrade>()
    else {
        return status(400, "BadRequest", "exec needs a connection upgrade");
    };
    let mut forwarded = Request::builder()
        .method(request.method().clone())
        .uri(&path)
        .header(header::HOST, format!("{}:{}", target.address, target.port));
    for (name, value) in request.headers() {
        if UPGRADE_HEADERS.contains(&name.as_str()) {
            forwarded = forwarded.header(name, value);
        }
    }
    let Ok(forwarded) = forwarded.body(Empty::new()) else {
        return status(400, "BadRequest", "malformed upgrade request");
    };
    let response = match send(
        target.connector,
        target.client,
        &target.address,
        target.port,
        forwarded,
    )
    .await
    {
        Ok(response) => response,
        Err(message) => {
            return status(
                500,
                "InternalError",
                &format!(
                    "https://{}:{}{path}: {message}",
                    target.address, target.port
                ),
            )
        }
    };
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return kubelet_error(response).await;
    }
    let mut switched = Response::builder().status(StatusCode::SWITCHING_PROTOCOLS);
    for (name, value) in response.headers() {
        switched = switched.header(name, value);
    }
    let kubelet_side = hyper::upgrade::on(response);
    tokio::spawn(async move {
        match tokio::join!(client_side, kubelet_side) {
            (Ok(client), Ok(kubelet)) => {
                let _ = tokio::io::copy_bidirectional(
                    &mut TokioIo::new(client),
                    &mut TokioIo::new(kubelet),
                )
                .await;
            }
            (client, kubelet) => {
                tracing::warn!(error_code = "EM-FAKEAPI-UPGRADE", client = ?client.err(), kubelet = ?kubelet.err(), "an exec connection could not be upgraded");
            }
        }
    });
    switched
        .body(Body::empty())
        .unwrap_or_else(|_| status(500, "InternalError", "upgrade response"))
}

/// The Node's first address of the preferred types, and its kubelet port.
fn kubelet_address(node: &Value, preferred: &[String]) -> Option<(String, u16)> {
    let port = node["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"].as_u64()?;
    let port = u16::try_from(port).ok().filter(|p| *p != 0)?;
    let addresses = node["status"]["addresses"].as_array()?;
    preferred.iter().find_map(|wanted| {
        addresses
            .iter()
            .find(|a| a["type"].as_str() == Some(wanted.as_str()))
            .and_then(|a| a["address"].as_str())
            .filter(|a| !a.is_empty())
            .map(|a| (a.to_owned(), port))
    })
}

/// Percent-encodes a query value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A GET of `path` for the kubelet at `address:port`.
fn plain_get(address: &str, port: u16, path: &str) -> Request<Empty<Bytes>> {
    Request::get(path)
        .header(header::HOST, format!("{address}:{port}"))
        .body(Empty::new())
        .expect("a GET of a path built here is valid")
}

/// One HTTPS request to a kubelet; the response's body (or upgraded connection) goes on.
async fn send(
    connector: &TlsConnector,
    client: &KubeletClient,
    address: &str,
    port: u16,
    request: Request<Empty<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, String> {
    let name = rustls::pki_types::ServerName::try_from(address.to_owned())
        .map_err(|e| format!("{address}: {e}"))?;
    let connected = tokio::time::timeout(KUBELET_TIMEOUT, async {
        let tcp = match client.dial {
            Some(dial) => tokio::net::TcpStream::connect(dial).await,
            None => tokio::net::TcpStream::connect((address, port)).await,
        }
        .map_err(|e| format!("dial tcp {address}:{port}: {e}"))?;
        let tls = connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("tls: {e}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection.with_upgrades());
        sender
            .send_request(request)
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    connected.unwrap_or_else(|_| Err("timed out".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_preferred_address_type_wins() {
        let node = serde_json::json!({"status": {
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10350}},
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"},
                          {"type": "Hostname", "address": "box"},
                          {"type": "InternalDNS", "address": "n1.edge.test"}]}});
        let default: Vec<String> = DEFAULT_ADDRESS_TYPES
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        assert_eq!(
            kubelet_address(&node, &default),
            Some(("box".to_owned(), 10350))
        );
        let dns = vec!["InternalDNS".to_owned(), "InternalIP".to_owned()];
        assert_eq!(
            kubelet_address(&node, &dns),
            Some(("n1.edge.test".to_owned(), 10350))
        );
        let no_port = serde_json::json!({"status": {"addresses": node["status"]["addresses"]}});
        assert_eq!(kubelet_address(&no_port, &default), None);
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(
            encode("2026-01-01T00:00:00+01:00"),
            "2026-01-01T00%3A00%3A00%2B01%3A00"
        );
    }
}
