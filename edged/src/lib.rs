//! edged: a reference edge agent. It consumes what the MetaManager hands to `<root>/edged/...`,
//! runs the pods of its namespaces as local processes, and reports their status back; at every
//! new session it lists the stored pods again, so a node whose cloud is unreachable still brings
//! its pods back after a reboot.
//!
//! # Layout (in the order a pod travels)
//! - [`session`]: the MQTT session to the node's broker (subscribe, reconnect with back-off).
//! - [`message`]: the envelope and the v2 topics.
//! - [`agent`]: the pod set: list at start-up, hand-ons, convergence, CSI refusals.
//! - [`spec`]: the Pod fields acted on; [`plan`]: pod + configmaps/secrets → what to run.
//! - [`pod`]: one pod's worker (containers, probes, restart back-off, grace period).
//! - [`runtime`]: the runtime trait and the process runtime; [`probe`]: exec/HTTP/TCP probes.
//! - [`status`]: `PodStatus` and the coalescing, rate-limited reporter.
//! - [`node`]: the Node: registration, node status from the host, the heartbeat Lease.
//! - [`kubelet`]: kubelet's API on loopback: [`logs`] (`containerLogs`), [`metrics`]
//!   (`/metrics/resource`), [`exec`].
//! - [`stream`]: the cloud's kubelet API requests, carried over the cloud broker to [`kubelet`].

mod agent;
mod config;
mod error;
mod exec;
mod kubelet;
mod logs;
mod logwatch;
mod message;
mod metrics;
mod node;
mod plan;
mod pod;
mod probe;
mod pty;
mod runtime;
mod session;
mod spec;
mod status;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use rumqttc::{AsyncClient, MqttOptions};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::info;

pub use config::{EdgedConfig, KubeletConfig, NodeConfig, StreamConfig};
pub use error::Error;

/// Requests rumqttc may hold before `try_publish` refuses (100 pods start in one burst).
const REQUEST_CAPACITY: usize = 8192;
/// Largest packet accepted from the broker (a pod list answer can be long).
const MAX_INCOMING_PACKET: usize = 64 * 1024 * 1024;

/// Runs the agent against the broker at `config.broker_url` until `cancel`; then stops its pods
/// (SIGTERM, at most 2 s each) and returns.
pub async fn run(config: EdgedConfig, root: &str, cancel: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let (host, port) = config.broker_address()?;
    let pods_dir = config.root_dir.join("pods");
    std::fs::create_dir_all(&pods_dir).map_err(|e| Error::io("creating", &pods_dir, e))?;
    // Absolute: containers run in their pod's directory, and read paths handed to them.
    let pods_dir = pods_dir
        .canonicalize()
        .map_err(|e| Error::io("resolving", &pods_dir, e))?;
    let leftovers = pods_dir.clone();
    let killed =
        tokio::task::spawn_blocking(move || runtime::ProcessRuntime::kill_leftovers(&leftovers))
            .await
            .unwrap_or(0);
    if killed > 0 {
        info!(killed, "stopped containers a previous run left behind");
    }
    let mut options = MqttOptions::new(config.client_id.clone(), host, port);
    options.set_clean_session(true);
    options.set_keep_alive(Duration::from_secs(config.keep_alive_s.max(5)));
    options.set_max_packet_size(MAX_INCOMING_PACKET, 2 * 1024 * 1024);
    if let Some(user) = &config.username {
        options.set_credentials(user.clone(), config.password.clone().unwrap_or_default());
    }
    let (client, eventloop) = AsyncClient::new(options, REQUEST_CAPACITY);
    let (inbound_tx, inbound_rx) = mpsc::channel(1024);
    let (report_tx, report_rx) = mpsc::channel(4096);

    let session_cancel = CancellationToken::new();
    let session = tokio::spawn(session::run(
        eventloop,
        client.clone(),
        root.to_owned(),
        edgemeta_protocol::Backoff::new(
            EdgedConfig::ms(config.reconnect_min_ms),
            EdgedConfig::ms(config.reconnect_max_ms),
        ),
        inbound_tx,
        session_cancel.clone(),
    ));
    let reporter_cancel = CancellationToken::new();
    let reporter = tokio::spawn(
        status::Reporter::new(
            client.clone(),
            root,
            EdgedConfig::ms(config.status_interval_ms),
        )
        .run(report_rx, reporter_cancel.clone()),
    );
    let timing = Arc::new(pod::Timing {
        backoff_base: EdgedConfig::ms(config.restart_backoff_base_ms),
        backoff_max: EdgedConfig::ms(config.restart_backoff_max_ms),
        backoff_reset: EdgedConfig::ms(config.restart_backoff_reset_ms),
        node_ip: config.node_ip.clone(),
    });
    let heartbeat = (!config.node.name.is_empty()).then(|| {
        tokio::spawn(node::run(
            client.clone(),
            root.to_owned(),
            node::NodeSettings {
                name: config.node.name.clone(),
                config: config.node.clone(),
                node_ip: config.node_ip.clone(),
                pods_dir: pods_dir.clone(),
            },
            cancel.clone(),
        ))
    });
    let runtime: Arc<dyn runtime::Runtime> = Arc::new(runtime::ProcessRuntime::new(
        config.log_max_bytes,
        config.log_max_files,
    ));
    let registry = kubelet::Registry::new();
    let kubelet_cancel = CancellationToken::new();
    let kubelet_server = if config.kubelet.enabled {
        let api = kubelet::Kubelet {
            pods: registry.reader(),
            exec: config.kubelet.exec,
            logs: logwatch::LogWatcher::start(kubelet_cancel.child_token()),
            cancel: kubelet_cancel.clone(),
        };
        let (address, task) =
            kubelet::serve(api, config.kubelet.port, kubelet_cancel.clone()).await?;
        Some((address, task))
    } else {
        None
    };
    let stream_link = match (&kubelet_server, stream::Settings::from_config(&config)) {
        (Some((address, _)), Some(settings)) => Some(tokio::spawn(stream::run(
            settings,
            *address,
            kubelet_cancel.clone(),
        ))),
        _ => None,
    };
    let agent = agent::Agent::new(
        agent::AgentSettings {
            root: root.to_owned(),
            namespaces: config.namespaces.clone(),
            pods_dir,
            node_ip: config.node_ip.clone(),
            query_timeout: EdgedConfig::ms(config.query_timeout_ms),
        },
        client,
        runtime,
        timing,
        report_tx,
        registry,
        cancel.clone(),
    );
    info!(namespaces = ?config.namespaces, "edged starting");
    // The agent returns once `cancel` fired and its pods have stopped; their last statuses
    // then go out before the session closes.
    agent.run(inbound_rx).await;
    if let Some(heartbeat) = heartbeat {
        let _ = heartbeat.await;
    }
    kubelet_cancel.cancel();
    if let Some(link) = stream_link {
        let _ = tokio::time::timeout(Duration::from_secs(1), link).await;
    }
    if let Some((_, server)) = kubelet_server {
        let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    }
    reporter_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), reporter).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    session_cancel.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), session).await;
    info!("edged stopped");
    Ok(())
}
