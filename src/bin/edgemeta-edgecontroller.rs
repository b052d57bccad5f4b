//! `edgemeta-edgecontroller`: the cloud side for Kubernetes (KubeEdge's edgecontroller and
//! cloudhub, on MQTT). Its own binary, so an edge node's `edgemeta` does not carry kube-rs and
//! its TLS stack.

#[path = "../shutdown.rs"]
mod shutdown;

use std::path::PathBuf;

/// jemalloc gives back more of what a burst (an initial sync, thousands of status writes) took:
/// 193 → 144 MB after the scale example's initial sync (docs/benchmarks.md, devices at scale).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// Watch Kubernetes (kube-rs) and drive edge nodes through the cloud MQTT broker (pods,
/// configmaps, secrets, Nodes down; pod status and queries up).
#[derive(Parser)]
#[command(name = "edgemeta-edgecontroller", version)]
struct Cli {
    /// A kubeconfig file (default: in-cluster config, `$KUBECONFIG` or `~/.kube/config`).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The cloud MQTT broker the nodes' bridges use.
    #[arg(long, default_value = "mqtt://127.0.0.1:1883")]
    broker: String,
    /// The nodes' `cloud.root`.
    #[arg(long, default_value = "kubeedge")]
    root: String,
    /// MQTT client id (a persistent session at the broker).
    #[arg(long, default_value = "edgemeta-edgecontroller")]
    client_id: String,
    /// MQTT username; the password comes from `EDGEMETA_CONTROLLER_PASSWORD`.
    #[arg(long)]
    username: Option<String>,
    /// First resend of an unacknowledged message, in milliseconds (doubles up to 60 s).
    #[arg(long, default_value_t = 5000)]
    resend_ms: u64,
    /// Run only while holding a Lease, so replicas are hot standbys. All replicas must use
    /// the same `--client-id`.
    #[arg(long)]
    leader_elect: bool,
    /// The Lease's namespace and name.
    #[arg(long, default_value = "default")]
    lease_namespace: String,
    #[arg(long, default_value = "edgemeta-edgecontroller")]
    lease_name: String,
    /// How long an unrenewed Lease stays with its holder, in seconds.
    #[arg(long, default_value_t = 15)]
    lease_duration_s: u64,
    /// This replica's name in the Lease (default: `$HOSTNAME`, else `edgecontroller-<pid>`).
    #[arg(long)]
    identity: Option<String>,
    /// An unchanged node status is written again once its heartbeat is this old, in
    /// milliseconds (keep it under the node monitor grace period less one heartbeat).
    #[arg(long, default_value_t = 20_000)]
    node_status_refresh_ms: u64,
    /// Serve kubelet's API for the managed nodes here (HTTPS; the port every Node reports as
    /// its kubelet port), relayed to their edged over the broker. Needs the three files below.
    #[arg(long)]
    stream_listen: Option<std::net::SocketAddr>,
    /// The stream server's certificate chain and key (PEM), valid for `*.<stream-domain>`.
    #[arg(long, requires = "stream_listen")]
    stream_cert: Option<PathBuf>,
    #[arg(long, requires = "stream_listen")]
    stream_key: Option<PathBuf>,
    /// The CA that signed the apiserver's kubelet client certificate; others get 401.
    #[arg(long, requires = "stream_listen")]
    stream_client_ca: Option<PathBuf>,
    /// The Nodes' kubelet address is `<node>.<stream-domain>` (empty: the node name itself).
    #[arg(long, default_value = "")]
    stream_domain: String,
    /// Bytes in flight per stream and direction.
    #[arg(long, default_value_t = 64 * 1024)]
    stream_window_bytes: u32,
}

fn main() -> anyhow::Result<()> {
    let Cli {
        kubeconfig,
        broker,
        root,
        client_id,
        username,
        resend_ms,
        leader_elect,
        lease_namespace,
        lease_name,
        lease_duration_s,
        identity,
        node_status_refresh_ms,
        stream_listen,
        stream_cert,
        stream_key,
        stream_client_ca,
        stream_domain,
        stream_window_bytes,
    } = Cli::parse();
    // `RUST_LOG` wins, as for the node.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let config = edgemeta_edgecontroller::Config {
        kubeconfig,
        broker,
        root,
        client_id,
        password: username
            .as_ref()
            .and_then(|_| std::env::var("EDGEMETA_CONTROLLER_PASSWORD").ok()),
        username,
        resend: std::time::Duration::from_millis(resend_ms),
        leader: leader_elect.then(|| edgemeta_edgecontroller::LeaseConfig {
            namespace: lease_namespace,
            name: lease_name,
            identity: identity
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| format!("edgecontroller-{}", std::process::id())),
            duration: std::time::Duration::from_secs(lease_duration_s),
        }),
        node_status_refresh: std::time::Duration::from_millis(node_status_refresh_ms),
        ..edgemeta_edgecontroller::Config::default()
    };
    let stream = match (stream_listen, stream_cert, stream_key, stream_client_ca) {
        (None, ..) => None,
        (Some(listen), Some(cert), Some(key), Some(client_ca)) => {
            Some(edgemeta_edgecontroller::StreamConfig {
                listen,
                cert,
                key,
                client_ca,
                domain: stream_domain,
                window: stream_window_bytes,
                ..edgemeta_edgecontroller::StreamConfig::default()
            })
        }
        _ => anyhow::bail!(
            "--stream-listen needs --stream-cert, --stream-key and --stream-client-ca"
        ),
    };
    shutdown::until_signal("edgemeta-edgecontroller", |cancel| async move {
        // The stream server runs on every replica: streams need no leadership.
        let streams = stream.map(|stream| {
            let (config, cancel) = (config.clone(), cancel.clone());
            tokio::spawn(async move {
                let served =
                    edgemeta_edgecontroller::stream::run(&config, stream, cancel.clone()).await;
                // A stream server that cannot start stops the controller with its error.
                if served.is_err() {
                    cancel.cancel();
                }
                served
            })
        });
        let ran = edgemeta_edgecontroller::run(config, cancel.clone()).await;
        cancel.cancel();
        if let Some(streams) = streams {
            if let Ok(Err(e)) = streams.await {
                return Err(e);
            }
        }
        ran
    })?;
    Ok(())
}
