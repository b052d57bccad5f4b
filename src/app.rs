//! Wiring: broker → MetaManager link → cloud bridge → listeners; on a stop signal, cancel, then
//! wait (bounded) until every accepted message is committed.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use edgemeta_bridges::CloudBridge;
use edgemeta_bridges::TopicMap;
use edgemeta_broker::Broker;
use edgemeta_metamanager::store::Reader;
use edgemeta_metamanager::{subscriptions, MetaManager, Meters, Names};
use edgemeta_metaserver::MetaServer;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Settings;
use crate::observe::{self, Registry};

/// Messages buffered between the broker link and the MetaManager's intake.
const LINK_CAPACITY: usize = 1024;

/// Runs the node until `shutdown` resolves or a listener dies; with `registry` (metrics on),
/// the observe endpoints are served on `observe.address`.
pub async fn run(
    settings: Settings,
    registry: Option<Registry>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    // Bound first: a taken address stops start-up before anything else is opened.
    let observe_listener = match &registry {
        Some(_) => Some(observe::bind(&settings.observe).await?),
        None => None,
    };
    let metaserver_listener = if settings.metaserver.enabled {
        Some(edgemeta_metaserver::bind(&settings.metaserver).await?)
    } else {
        None
    };
    let meters = (registry.as_ref()).map_or_else(|| Arc::new(Meters::noop()), |r| r.meters.clone());
    let root = settings.broker.topic_root.clone();
    let map = TopicMap::new(&root, &settings.cloud.root, &settings.cloud.node_id);
    let meta_filters = subscriptions(&root);
    let cloud_filter = map.local_cloud_filter();
    let dmi_on = settings.devices.dmi.socket.is_some();
    let mut broker = Broker::new(&settings.broker).context("starting the MQTT broker")?;
    let link = broker
        .link("metamanager", &meta_filters, LINK_CAPACITY)
        .await
        .context("linking the metamanager to the broker")?;
    broker.announce_clients(link.publisher.clone());
    let cloud = settings.cloud.enabled;
    // Without a cloud bridge the outbox is relayed to the local `<root>/cloud/...` topics.
    let store = edgemeta_metamanager::StoreConfig {
        history: settings.metaserver.history,
        ..settings.store.clone()
    };
    let mut meta = MetaManager::start(
        &settings.metamanager,
        &store,
        Names {
            root: &root,
            node: &settings.cloud.node_id,
        },
        link,
        !cloud,
        meters.clone(),
        cancel.child_token(),
    )
    .await
    .with_context(|| format!("opening the store {}", settings.store.path.display()))?;
    // Gone before the MetaManager stops: it holds a way into the store worker.
    let mut dmi = if dmi_on {
        let link = broker
            .link("dmi", &edgemeta_dmi::subscriptions(), LINK_CAPACITY)
            .await
            .context("linking the DMI server to the broker")?;
        let dmi = edgemeta_dmi::Dmi::start(
            &settings.devices.dmi,
            link,
            meta.device_reports(),
            cancel.child_token(),
        )
        .await
        .context("starting the DMI server (devices.dmi)")?;
        Some(dmi)
    } else {
        None
    };
    let mut cloud_status = None;
    let mut bridge = if cloud {
        let link = broker
            .link("cloud-bridge", &[cloud_filter], LINK_CAPACITY)
            .await
            .context("linking the cloud bridge to the broker")?;
        let bridge = CloudBridge::new(
            settings.cloud.clone(),
            &root,
            link,
            meta.ingress(),
            meta.outbox(),
        )
        .context("configuring the cloud bridge")?;
        cloud_status = Some(bridge.status());
        Some(tokio::spawn(bridge.run(cancel.child_token())))
    } else {
        None
    };
    broker
        .listen()
        .await
        .context("starting the MQTT listeners")?;
    let listeners_up = Arc::new(AtomicBool::new(true));
    let mut observer = match (registry, observe_listener) {
        (Some(registry), Some(listener)) => {
            let sources = observe::Sources {
                outbox: meta.outbox(),
                broker: broker.stats(),
                handons: meta.handons(),
                cloud: cloud_status,
                listeners_up: listeners_up.clone(),
                store_path: settings.store.path.clone(),
                max_outbox_age: Duration::from_secs(settings.observe.max_outbox_age_s),
            };
            info!(address = %settings.observe.address, "observe listener ready");
            Some(tokio::spawn(observe::serve(
                listener,
                registry,
                sources,
                cancel.child_token(),
            )))
        }
        _ => None,
    };
    let mut metaserver = match metaserver_listener {
        Some(listener) => {
            let reader = Reader::open(&settings.store.path)
                .await
                .context("opening the store for the MetaServer")?;
            let server = MetaServer::new(
                &settings.metaserver,
                listener,
                reader,
                meta.changes(),
                meters.clone(),
                cancel.child_token(),
            )?;
            info!(address = %settings.metaserver.address, "metaserver listener ready");
            let (listener, app) = server.into_parts();
            Some(tokio::spawn(observe::serve_app(
                listener,
                app,
                cancel.child_token(),
                "EM-METASERVER-SERVE",
                None::<(Duration, fn())>,
            )))
        }
        None => None,
    };
    info!(store = %settings.store.path.display(), "edgemeta serving");

    let failure: Option<anyhow::Error> = tokio::select! {
        _ = shutdown => None,
        e = broker.failed() => {
            error!(error_code = "EM-BROKER-LISTENER", error = %e, "listener failed");
            Some(anyhow::Error::new(e).context("an MQTT listener stopped"))
        }
        e = meta.failed() => {
            error!(error_code = e.code(), error = %e, "the metamanager stopped");
            Some(from_meta(e).context("the metamanager stopped"))
        }
        Err(e) = bridge_stopped(&mut bridge), if bridge.is_some() => Some(e),
    };
    listeners_up.store(false, Ordering::Relaxed);
    cancel.cancel();
    // No new connections from here on.
    let links = broker.close();
    let grace = Duration::from_millis(settings.shutdown_grace_ms);
    let stopped = async {
        let mut errors = Vec::new();
        // It holds an outbox handle, which keeps the store worker alive.
        if let Some(observer) = observer.take() {
            if observer.await.is_err() {
                errors.push(anyhow::Error::new(Panicked("observe server")));
            }
        }
        if let Some(server) = metaserver.take() {
            if server.await.is_err() {
                errors.push(anyhow::Error::new(Panicked("metaserver")));
            }
        }
        if let Err(e) = bridge_stopped(&mut bridge).await {
            errors.push(e);
        }
        if let Some(dmi) = dmi.take() {
            dmi.stopped().await;
        }
        if let Err(e) = meta.stopped().await {
            errors.push(from_meta(e).context("the metamanager did not stop cleanly"));
        }
        // Every publisher is gone now, so the links' threads finish what was queued and end.
        if let Err(e) = links.join().await {
            errors.push(anyhow::Error::new(e).context("a broker link did not stop cleanly"));
        }
        errors
    };
    let errors = match tokio::time::timeout(grace, stopped).await {
        Ok(errors) => {
            info!("stopped; every accepted message is committed");
            errors
        }
        Err(_) => {
            warn!(
                error_code = "EM-SHUTDOWN-GRACE",
                grace_ms = settings.shutdown_grace_ms,
                "stopped before the store worker finished"
            );
            Vec::new()
        }
    };
    match failure.into_iter().chain(errors).next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A part of the node panicked: a bug, not a configuration or environment problem.
#[derive(Debug)]
struct Panicked(&'static str);

impl std::fmt::Display for Panicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the {} panicked", self.0)
    }
}

impl std::error::Error for Panicked {}

/// Waits for the cloud bridge's task, if it is still running, and returns how it ended. The
/// bridge ends on its own only when one of its tasks panicked (it logs `EM-BRIDGE-PANIC`).
async fn bridge_stopped(
    bridge: &mut Option<JoinHandle<Result<(), edgemeta_bridges::Error>>>,
) -> anyhow::Result<()> {
    let Some(task) = bridge.as_mut() else {
        return Ok(());
    };
    let ended = task.await;
    // A finished JoinHandle must not be polled again.
    *bridge = None;
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(edgemeta_bridges::Error::Panicked(reason))) => {
            Err(anyhow::Error::new(Panicked("cloud bridge")).context(reason))
        }
        Ok(Err(other)) => Err(anyhow::Error::new(other).context("the cloud bridge stopped")),
        Err(_) => Err(anyhow::Error::new(Panicked("cloud bridge"))),
    }
}

fn from_meta(error: edgemeta_metamanager::Error) -> anyhow::Error {
    match error {
        edgemeta_metamanager::Error::Panicked { task } => anyhow::Error::new(Panicked(task)),
        other => anyhow::Error::new(other),
    }
}

/// The process exit code for an error [`run`] returned: 70 (EX_SOFTWARE) when a part of the node
/// panicked, so a supervisor can tell a bug from a configuration or bind failure (1).
pub fn exit_code(error: &anyhow::Error) -> u8 {
    if error.chain().any(|cause| cause.is::<Panicked>()) {
        70
    } else {
        1
    }
}
