//! Wiring: broker → MetaManager link → cloud bridge → listeners; on a stop signal, cancel, then
//! wait (bounded) until every accepted message is committed.

use std::future::Future;
use std::time::Duration;

use anyhow::Context as _;
use edgemeta_bridges::topic_map::TopicMap;
use edgemeta_bridges::CloudBridge;
use edgemeta_broker::Broker;
use edgemeta_metamanager::{subscription, MetaManager};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::Settings;

/// Messages buffered between the broker link and the MetaManager's intake.
const LINK_CAPACITY: usize = 1024;

/// Runs the node until `shutdown` resolves or a listener dies.
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let cancel = CancellationToken::new();
    let root = settings.broker.topic_root.clone();
    let map = TopicMap::new(&root, &settings.cloud.root, &settings.cloud.node_id);
    let meta_filter = subscription(&root);
    let cloud_filter = map.local_cloud_filter();
    let mut broker = Broker::new(
        &settings.broker,
        &[meta_filter.clone(), cloud_filter.clone()],
    )
    .context("starting the MQTT broker")?;
    let link = broker
        .link("metamanager", &[meta_filter], LINK_CAPACITY)
        .await
        .context("linking the metamanager to the broker")?;
    let cloud = settings.cloud.enabled;
    // Without a cloud bridge the outbox is relayed to the local `<root>/cloud/...` topics.
    let meta = MetaManager::start(
        &settings.metamanager,
        &settings.store,
        &root,
        link,
        !cloud,
        cancel.child_token(),
    )
    .await
    .with_context(|| format!("opening the store {}", settings.store.path.display()))?;
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
        Some(tokio::spawn(bridge.run(cancel.child_token())))
    } else {
        None
    };
    broker
        .listen()
        .await
        .context("starting the MQTT listeners")?;
    info!(store = %settings.store.path.display(), "edgemeta serving");

    let mut bridge_failure = None;
    let failure = tokio::select! {
        _ = shutdown => None,
        e = broker.failed() => Some(e),
        Err(e) = bridge_stopped(&mut bridge), if bridge.is_some() => {
            bridge_failure = Some(e);
            None
        }
    };
    cancel.cancel();
    // No new connections from here on; rumqttd cannot close the ones it has (rumqttd #771).
    drop(broker);
    let grace = Duration::from_millis(settings.shutdown_grace_ms);
    let stopped = async {
        let bridge = bridge_stopped(&mut bridge).await;
        meta.stopped().await;
        bridge
    };
    match tokio::time::timeout(grace, stopped).await {
        Ok(bridge) => {
            info!("stopped; every accepted message is committed");
            bridge_failure = bridge_failure.or(bridge.err());
        }
        Err(_) => warn!(
            error_code = "EM-SHUTDOWN-GRACE",
            grace_ms = settings.shutdown_grace_ms,
            "stopped before the store worker finished"
        ),
    }
    if let Some(e) = failure {
        error!(error_code = "EM-BROKER-LISTENER", error = %e, "listener failed");
        return Err(e).context("an MQTT listener stopped");
    }
    bridge_failure.map_or(Ok(()), Err)
}

/// Waits for the cloud bridge's task, if it is still running, and returns how it ended. The
/// bridge ends on its own only on a panic (already logged by it); the node then stops, non-zero.
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
        Ok(result) => result.context("the cloud bridge failed"),
        Err(join) => Err(join).context("the cloud bridge task panicked"),
    }
}
