//! One pod's worker: writes its volume files, runs each container in its own task (start,
//! probes, restart with kubelet's back-off), folds their states into the pod's status, and on
//! a stop request sends SIGTERM, waits the grace period, then SIGKILL.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::plan::{ContainerPlan, PodPlan, VolumeFiles};
use crate::probe;
use crate::runtime::{Container, Exit, Runtime};
use crate::spec::RestartPolicy;
use crate::status::{self, ContainerStatus, PodFacts, Report, State};

/// The longest a container may take to stop when the agent itself shuts down.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Timings shared by every pod.
#[derive(Debug, Clone)]
pub struct Timing {
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub backoff_reset: Duration,
    pub node_ip: String,
}

/// A running pod worker.
pub struct PodWorker {
    stop: watch::Sender<Option<Duration>>,
    task: JoinHandle<()>,
}

/// What a pod worker runs: the plan, the images it pulls, where its statuses go, and the
/// previous incarnation of the pod (`after`), which must have stopped first.
pub struct PodStart {
    pub plan: PodPlan,
    pub images: Vec<String>,
    pub runtime: Arc<dyn Runtime>,
    pub timing: Arc<Timing>,
    pub reports: mpsc::Sender<Report>,
    pub after: Option<JoinHandle<()>>,
    pub cancel: CancellationToken,
}

impl PodWorker {
    /// Starts the pod once `start.after` has stopped.
    pub fn spawn(start: PodStart) -> PodWorker {
        let (stop, stop_rx) = watch::channel(None);
        let task = tokio::spawn(run_pod(start, stop_rx));
        PodWorker { stop, task }
    }

    /// Asks every container to stop within `grace`; the returned handle ends when they have.
    pub fn stop(self, grace: Duration) -> JoinHandle<()> {
        let _ = self.stop.send(Some(grace));
        self.task
    }
}

async fn run_pod(start: PodStart, stop: watch::Receiver<Option<Duration>>) {
    let PodStart {
        plan,
        images,
        runtime,
        timing,
        reports,
        after,
        cancel,
    } = start;
    if let Some(previous) = after {
        let _ = previous.await;
    }
    let key = format!("{}/{}", plan.namespace, plan.name);
    let facts = PodFacts {
        policy: plan.restart_policy,
        node_ip: &timing.node_ip,
        start_time: SystemTime::now(),
    };
    let mut statuses: Vec<ContainerStatus> = plan
        .containers
        .iter()
        .zip(&images)
        .map(|(c, image)| {
            ContainerStatus::new(&c.name, image, State::waiting("ContainerCreating", ""))
        })
        .collect();
    let report = |statuses: &[ContainerStatus]| Report::Status {
        key: key.clone(),
        namespace: plan.namespace.clone(),
        name: plan.name.clone(),
        uid: plan.uid.clone(),
        status: status::pod_status(&facts, statuses),
    };
    let dir = plan.dir.clone();
    let volumes = plan.volumes.clone();
    let logs = dir.join("logs");
    let written = tokio::task::spawn_blocking(move || write_volumes(&dir, &logs, &volumes)).await;
    if let Some(message) = match written {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(e) => Some(e.to_string()),
    } {
        warn!(error_code = "EM-EDGED-IO", pod = %key, error = %message, "cannot prepare the pod directory");
        for s in &mut statuses {
            s.state = State::waiting("CreateContainerConfigError", message.clone());
        }
        let _ = reports.send(report(&statuses)).await;
        let mut stop = stop;
        let _ = stop_requested(&mut stop, &cancel).await;
        return;
    }
    // The first report comes from the containers themselves (Running at once, usually): a
    // ContainerCreating in between would only spend the pod's first slot of the rate limit.
    let (tx, mut rx) = mpsc::channel::<(usize, ContainerStatus)>(64);
    let mut tasks = JoinSet::new();
    for (index, (container, status)) in plan.containers.iter().zip(&statuses).enumerate() {
        let supervisor = Supervisor {
            index,
            pod: key.clone(),
            plan: container.clone(),
            policy: plan.restart_policy,
            grace: plan.grace,
            runtime: runtime.clone(),
            timing: timing.clone(),
            status: status.clone(),
            updates: tx.clone(),
            stop: stop.clone(),
            cancel: cancel.clone(),
        };
        tasks.spawn(supervisor.run());
    }
    drop(tx);
    while let Some((index, status)) = rx.recv().await {
        if let Some(slot) = statuses.get_mut(index) {
            *slot = status;
        }
        // Coalesce what is already queued into one report.
        while let Ok((index, status)) = rx.try_recv() {
            if let Some(slot) = statuses.get_mut(index) {
                *slot = status;
            }
        }
        let _ = reports.send(report(&statuses)).await;
    }
    while tasks.join_next().await.is_some() {}
}

/// Writes configmap/secret volume files (secrets 0600) and creates the log directory.
pub(crate) fn write_volumes(
    dir: &Path,
    logs: &Path,
    volumes: &[VolumeFiles],
) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let io = |what: &str, path: &Path, e: std::io::Error| format!("{what} {}: {e}", path.display());
    std::fs::create_dir_all(logs).map_err(|e| io("creating", logs, e))?;
    std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    for volume in volumes {
        std::fs::create_dir_all(&volume.dir).map_err(|e| io("creating", &volume.dir, e))?;
        for (relative, bytes) in &volume.files {
            let path = volume.dir.join(relative);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| io("creating", parent, e))?;
            }
            // Write then rename, so a running process never reads half a file.
            let temporary = path.with_extension("edged-tmp");
            std::fs::write(&temporary, bytes).map_err(|e| io("writing", &temporary, e))?;
            let mode = if volume.secret { 0o600 } else { 0o644 };
            std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(mode))
                .map_err(|e| io("chmod", &temporary, e))?;
            std::fs::rename(&temporary, &path).map_err(|e| io("renaming", &path, e))?;
        }
    }
    Ok(())
}

/// Waits for a stop request (or the agent's shutdown); returns the grace period to use.
async fn stop_requested(
    stop: &mut watch::Receiver<Option<Duration>>,
    cancel: &CancellationToken,
) -> Duration {
    tokio::select! {
        _ = cancel.cancelled() => SHUTDOWN_GRACE,
        grace = stop.wait_for(Option::is_some) => match grace {
            Ok(grace) => grace.unwrap_or(SHUTDOWN_GRACE),
            // The agent dropped the worker: stop as at shutdown.
            Err(_) => SHUTDOWN_GRACE,
        },
    }
}

/// One container's life: start, watch, probe, restart.
struct Supervisor {
    index: usize,
    pod: String,
    plan: ContainerPlan,
    policy: RestartPolicy,
    grace: Duration,
    runtime: Arc<dyn Runtime>,
    timing: Arc<Timing>,
    status: ContainerStatus,
    updates: mpsc::Sender<(usize, ContainerStatus)>,
    stop: watch::Receiver<Option<Duration>>,
    cancel: CancellationToken,
}

/// How a run of the container ended.
enum Ended {
    /// It exited by itself (or was killed by its liveness probe).
    Exited(State),
    /// The pod was stopped.
    Stopped(State),
}

impl Supervisor {
    async fn run(mut self) {
        let mut failures: u32 = 0;
        loop {
            if self.stop.borrow().is_some() || self.cancel.is_cancelled() {
                return;
            }
            let started_at = SystemTime::now();
            let started = Instant::now();
            let terminated = match self.runtime.start(&self.plan) {
                Err(cannot) => {
                    warn!(pod = %self.pod, container = %self.plan.name, reason = "ContainerCannotRun", error = %cannot.message, "container cannot run");
                    State::Terminated {
                        exit_code: cannot.code,
                        signal: None,
                        reason: "ContainerCannotRun".to_owned(),
                        message: cannot.message,
                        started_at,
                        finished_at: SystemTime::now(),
                    }
                }
                Ok(mut container) => {
                    self.status.state = State::Running { started_at };
                    self.status.container_id = Some(container.id());
                    self.status.ready = self.plan.readiness.is_none();
                    self.send().await;
                    match self.supervise(container.as_mut(), started_at).await {
                        Ended::Exited(state) => state,
                        Ended::Stopped(state) => {
                            self.status.state = state;
                            self.status.ready = false;
                            self.send().await;
                            return;
                        }
                    }
                }
            };
            let exit_code = match &terminated {
                State::Terminated { exit_code, .. } => *exit_code,
                _ => 0,
            };
            let restart = match self.policy {
                RestartPolicy::Always => true,
                RestartPolicy::OnFailure => exit_code != 0,
                RestartPolicy::Never => false,
            };
            self.status.ready = false;
            if !restart {
                self.status.state = terminated;
                self.send().await;
                return;
            }
            if started.elapsed() >= self.timing.backoff_reset {
                failures = 0;
            }
            let delay = backoff(&self.timing, failures);
            failures = failures.saturating_add(1);
            self.status.last_state = Some(terminated.clone());
            self.status.state = State::waiting(
                "CrashLoopBackOff",
                format!(
                    "back-off {}ms restarting failed container={} pod={}",
                    delay.as_millis(),
                    self.plan.name,
                    self.pod
                ),
            );
            self.send().await;
            let mut stop = self.stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = stop_requested(&mut stop, &self.cancel) => {
                    self.status.state = terminated;
                    self.send().await;
                    return;
                }
            }
            self.status.restart_count += 1;
        }
    }

    async fn send(&self) {
        let _ = self.updates.send((self.index, self.status.clone())).await;
    }

    /// Watches a running container until it exits or the pod stops; runs its probes.
    async fn supervise(&mut self, container: &mut dyn Container, started_at: SystemTime) -> Ended {
        let start = tokio::time::Instant::now();
        let mut liveness = self.plan.liveness.clone().map(|p| Prober::new(p, start));
        let mut readiness = self.plan.readiness.clone().map(|p| Prober::new(p, start));
        let mut stop = self.stop.clone();
        let host = self.timing.node_ip.clone();
        loop {
            let live_at = liveness.as_ref().map(|p| p.next);
            let ready_at = readiness.as_ref().map(|p| p.next);
            tokio::select! {
                exit = container.wait() => {
                    return Ended::Exited(terminated(exit, started_at, None));
                }
                grace = stop_requested(&mut stop, &self.cancel) => {
                    let exit = stop_within(container, grace).await;
                    return Ended::Stopped(terminated(exit, started_at, None));
                }
                _ = sleep_until_opt(live_at) => {
                    let Some(prober) = liveness.as_mut() else { continue };
                    let ok = probe::check(&prober.probe, &self.plan, &host).await;
                    if prober.record(ok) == Some(false) {
                        info!(pod = %self.pod, container = %self.plan.name, "liveness probe failed; restarting the container");
                        let exit = stop_within(container, self.grace).await;
                        return Ended::Exited(terminated(exit, started_at, Some("liveness probe failed")));
                    }
                }
                _ = sleep_until_opt(ready_at) => {
                    let Some(prober) = readiness.as_mut() else { continue };
                    let ok = probe::check(&prober.probe, &self.plan, &host).await;
                    if let Some(ready) = prober.record(ok) {
                        if ready != self.status.ready {
                            self.status.ready = ready;
                            self.send().await;
                        }
                    }
                }
            }
        }
    }
}

/// SIGTERM, up to `grace`, then SIGKILL.
async fn stop_within(container: &mut dyn Container, grace: Duration) -> Exit {
    container.terminate().await;
    match tokio::time::timeout(grace, container.wait()).await {
        Ok(exit) => exit,
        Err(_) => {
            container.kill().await;
            container.wait().await
        }
    }
}

fn terminated(exit: Exit, started_at: SystemTime, why: Option<&str>) -> State {
    State::Terminated {
        exit_code: exit.code,
        signal: exit.signal,
        reason: if exit.code == 0 { "Completed" } else { "Error" }.to_owned(),
        message: why.unwrap_or_default().to_owned(),
        started_at,
        finished_at: SystemTime::now(),
    }
}

/// kubelet's restart delay after `failures` consecutive failures: base × 2^failures, capped.
pub fn backoff(timing: &Timing, failures: u32) -> Duration {
    let factor = 1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX);
    timing
        .backoff_base
        .checked_mul(factor)
        .unwrap_or(timing.backoff_max)
        .min(timing.backoff_max)
}

/// A probe's schedule and its success/failure run lengths.
struct Prober {
    probe: crate::spec::Probe,
    next: tokio::time::Instant,
    successes: u32,
    failures: u32,
}

impl Prober {
    fn new(probe: crate::spec::Probe, start: tokio::time::Instant) -> Prober {
        let next = start + probe_seconds(probe.initial_delay_seconds);
        Prober {
            probe,
            next,
            successes: 0,
            failures: 0,
        }
    }

    /// Records one result; `Some(verdict)` once a threshold is reached.
    fn record(&mut self, ok: bool) -> Option<bool> {
        self.next = tokio::time::Instant::now() + probe_seconds(self.probe.period_seconds.max(1));
        if ok {
            self.failures = 0;
            self.successes += 1;
            (self.successes >= self.probe.success_threshold.max(1)).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (self.failures >= self.probe.failure_threshold.max(1)).then_some(false)
        }
    }
}

/// A probe's seconds field, held to Kubernetes' int32 range so that adding it to a clock
/// reading cannot overflow.
fn probe_seconds(seconds: u64) -> Duration {
    Duration::from_secs(seconds.min(i32::MAX as u64))
}

async fn sleep_until_opt(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_the_base_up_to_the_cap() {
        let timing = Timing {
            backoff_base: Duration::from_secs(10),
            backoff_max: Duration::from_secs(300),
            backoff_reset: Duration::from_secs(600),
            node_ip: String::new(),
        };
        let delays: Vec<u64> = (0..8).map(|n| backoff(&timing, n).as_secs()).collect();
        assert_eq!(delays, [10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(backoff(&timing, 1000).as_secs(), 300);
    }
}
