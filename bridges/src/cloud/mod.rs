//! The cloud bridge: one session after another with a backoff between them, and the tasks that
//! outlive sessions (carrying local cloud-bound traffic into the outbox, reporting its depth).

mod egress;
mod ingress;
mod live;
mod session;
mod signal;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use edgemeta_broker::Link;
use edgemeta_metamanager::{Ingress, OutboxHandle};
use edgemeta_protocol::Backoff;
use rumqttc::MqttOptions;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::topic_map::TopicMap;
use crate::{CloudConfig, Error};
use session::{Session, SessionEnd};
use signal::{LinkState, Signal};

/// What the bridge has done so far, read by the node's metrics and readiness check: plain
/// atomics, set where the bridge already knows the fact.
#[derive(Debug, Default)]
pub struct CloudStatus {
    connected: AtomicBool,
    reconnects: AtomicU64,
    down_applied: AtomicU64,
}

impl CloudStatus {
    /// Whether a session with the cloud broker is up right now.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Established sessions lost so far (each is followed by a reconnect attempt).
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Cloud messages the MetaManager finished with (committed or refused for good) and the
    /// bridge acknowledged.
    pub fn down_applied(&self) -> u64 {
        self.down_applied.load(Ordering::Relaxed)
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    pub(crate) fn count_down_applied(&self) {
        self.down_applied.fetch_add(1, Ordering::Relaxed);
    }
}

/// The bridge, ready to run.
pub struct CloudBridge {
    config: CloudConfig,
    options: MqttOptions,
    map: TopicMap,
    local_root: String,
    ingress: Ingress,
    outbox: OutboxHandle,
    link: Link,
    status: Arc<CloudStatus>,
}

impl CloudBridge {
    /// Checks the config. `link` must subscribe to `<root>/cloud/#` (see [`TopicMap::local_cloud_filter`]).
    pub fn new(
        config: CloudConfig,
        local_root: &str,
        link: Link,
        ingress: Ingress,
        outbox: OutboxHandle,
    ) -> Result<CloudBridge, Error> {
        let mut options = config.mqtt_options()?;
        let map = TopicMap::new(local_root, &config.root, &config.node_id);
        // The broker publishes this when the session ends without a DISCONNECT (protocol §5).
        options.set_last_will(rumqttc::LastWill::new(
            map.connection(),
            signal::envelope(LinkState::Disconnected),
            rumqttc::QoS::AtLeastOnce,
            true,
        ));
        Ok(CloudBridge {
            config,
            options,
            map,
            local_root: local_root.to_owned(),
            ingress,
            outbox,
            link,
            status: Arc::default(),
        })
    }

    /// The bridge's connection state and counters, shared with whoever reports them.
    pub fn status(&self) -> Arc<CloudStatus> {
        self.status.clone()
    }

    /// Runs sessions until cancelled; every task it spawned has ended when it returns.
    ///
    /// # Errors
    /// [`Error::Panicked`] when one of its tasks panicked; the bridge stops then (logged as
    /// `EM-BRIDGE-PANIC`) rather than run on without it.
    pub async fn run(self, cancel: CancellationToken) -> Result<(), Error> {
        let CloudBridge {
            config,
            options,
            map,
            local_root,
            ingress,
            outbox,
            link,
            status,
        } = self;
        let Link { inbox, publisher } = link;
        let stop = cancel.child_token();
        let mut helpers = Tasks::default();
        let live = Arc::new(live::Live::default());
        helpers.spawn(egress::carry_local(
            inbox,
            outbox.clone(),
            live.clone(),
            map.clone(),
            stop.clone(),
        ));
        helpers.spawn(egress::report_outbox(outbox.clone(), stop.clone()));
        let signal = Signal::new(publisher, &local_root);
        let mut backoff = Backoff::new(
            Duration::from_millis(config.backoff_min_ms),
            Duration::from_millis(config.backoff_max_ms),
        );
        let mut reconnects: u64 = 0;
        info!(url = %config.url, node_id = %config.node_id, client_id = %config.client_id(), "cloud bridge starting");
        let sessions = async {
            let mut options = options;
            loop {
                // Rebuilt per session so rotated TLS certificates are read again; files that are
                // unreadable right now (mid-rotation) leave the last good options in use.
                if config.uses_tls() {
                    match config.mqtt_options() {
                        Ok(fresh) => options = fresh,
                        Err(e) => {
                            error!(error_code = "EM-BRIDGE-TLS", error = %e, "cannot reload the TLS settings; reconnecting with the previous ones");
                        }
                    }
                }
                let session = Session {
                    options: options.clone(),
                    window: usize::from(config.inflight),
                    map: &map,
                    ingress: &ingress,
                    outbox: &outbox,
                    signal: &signal,
                    status: &status,
                    live: &live,
                };
                let end = session.run(&stop, &mut backoff).await;
                status.set_connected(false);
                match end {
                    SessionEnd::Cancelled => return Ok(()),
                    SessionEnd::Failed(error) => return Err(error),
                    SessionEnd::Lost {
                        error,
                        was_connected,
                    } => {
                        if was_connected {
                            signal.send(LinkState::Disconnected).await;
                            reconnects += 1;
                            status.reconnects.fetch_add(1, Ordering::Relaxed);
                            warn!(error_code = "EM-BRIDGE-DISCONNECTED", error = %error, reconnects, "cloud connection lost");
                        } else {
                            warn!(error_code = "EM-BRIDGE-CONNECT", error = %error, "cannot reach the cloud broker");
                        }
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
        };
        let result = tokio::select! {
            result = sessions => result,
            error = helpers.panicked() => Err(error),
        };
        stop.cancel();
        let result = result.and(helpers.join().await);
        match &result {
            Ok(()) => info!(reconnects, "cloud bridge stopped"),
            Err(e) => error!(error_code = "EM-BRIDGE-PANIC", error = %e, "cloud bridge failed"),
        }
        result
    }
}

/// The tasks of the bridge or of one session. Their owner cancels and joins them before it
/// returns, so none outlives it and a panic in one becomes the owner's error instead of
/// vanishing; dropping the owner aborts them.
#[derive(Default)]
struct Tasks {
    set: JoinSet<()>,
}

impl Tasks {
    fn spawn<F>(&mut self, task: F)
    where
        F: Future + Send + 'static,
        F::Output: Send,
    {
        self.set.spawn(async move {
            task.await;
        });
    }

    /// Resolves when a task panicked; tasks that end normally are only reaped. Cancel safe.
    async fn panicked(&mut self) -> Error {
        loop {
            match self.set.join_next().await {
                Some(Err(e)) if e.is_panic() => return Error::Panicked(e.to_string()),
                Some(_) => {}
                None => std::future::pending().await,
            }
        }
    }

    /// Waits for every task to end (the owner has cancelled them); the first panic is the error.
    async fn join(mut self) -> Result<(), Error> {
        let mut result = Ok(());
        while let Some(joined) = self.set.join_next().await {
            if let Err(e) = joined {
                if e.is_panic() && result.is_ok() {
                    result = Err(Error::Panicked(e.to_string()));
                }
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panic_in_a_task_is_its_owners_error() {
        let mut tasks = Tasks::default();
        tasks.spawn(async {});
        tasks.spawn(async { panic!("boom") });
        assert!(matches!(tasks.panicked().await, Error::Panicked(e) if e.contains("boom")));

        let mut tasks = Tasks::default();
        tasks.spawn(async { panic!("boom") });
        assert!(matches!(tasks.join().await, Err(Error::Panicked(_))));
    }

    #[tokio::test]
    async fn tasks_that_end_normally_join_cleanly() {
        let mut tasks = Tasks::default();
        let cancel = CancellationToken::new();
        tasks.spawn(cancel.clone().cancelled_owned());
        cancel.cancel();
        assert!(tasks.join().await.is_ok());
    }
}
