//! Leader election on a `coordination.k8s.io/v1` Lease, as kube-controller-manager does it:
//! one replica holds the Lease and renews it; the others wait until it has not changed for a
//! whole lease duration (observed on their own clock, so clocks need not agree), then take it
//! with a resourceVersion precondition, so two candidates can never both win.
//!
//! All replicas use the same MQTT client id: the new leader's CONNECT takes the persistent
//! session over at the broker (with what nodes sent meanwhile) and cuts off a stale leader.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::Error;

/// Which Lease, and who this replica is.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity in `holderIdentity` (e.g. the pod name).
    pub identity: String,
    /// How long a Lease not renewed stays with its holder.
    pub duration: Duration,
}

/// `MicroTime` as the API writes it.
fn micro_now() -> String {
    let now = time::OffsetDateTime::now_utc();
    let format = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
    );
    now.format(&format).unwrap_or_default()
}

fn lease_object(
    config: &LeaseConfig,
    transitions: i64,
    rv: Option<String>,
    acquired: &str,
) -> Result<Lease, Error> {
    let seconds = i64::try_from(config.duration.as_secs())
        .unwrap_or(15)
        .max(1);
    let mut value = json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": config.name, "namespace": config.namespace},
        "spec": {"holderIdentity": config.identity, "leaseDurationSeconds": seconds,
                 "acquireTime": acquired, "renewTime": micro_now(),
                 "leaseTransitions": transitions}});
    if let Some(rv) = rv {
        value["metadata"]["resourceVersion"] = json!(rv);
    }
    serde_json::from_value(value).map_err(|e| Error::Config(format!("lease: {e}")))
}

/// What a candidate saw of the Lease, to tell a live holder from a dead one.
struct Observed {
    rv: Option<String>,
    since: Instant,
}

/// One attempt: `Ok(true)` when this replica holds the Lease now.
async fn try_acquire(
    api: &Api<Lease>,
    config: &LeaseConfig,
    observed: &mut Option<Observed>,
) -> Result<bool, Error> {
    let Some(current) = api.get_opt(&config.name).await? else {
        let lease = lease_object(config, 0, None, &micro_now())?;
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e.into()),
        };
    };
    let spec = current.spec.clone().unwrap_or_default();
    let rv = current.metadata.resource_version.clone();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    if holder != config.identity && !holder.is_empty() {
        // Someone else's: wait until it has not been renewed for a whole duration.
        let seen = observed.get_or_insert_with(|| Observed {
            rv: rv.clone(),
            since: Instant::now(),
        });
        if seen.rv != rv {
            *seen = Observed {
                rv: rv.clone(),
                since: Instant::now(),
            };
        }
        let duration = spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(config.duration, Duration::from_secs);
        if seen.since.elapsed() < duration {
            return Ok(false);
        }
    }
    let transitions =
        i64::from(spec.lease_transitions.unwrap_or(0)) + i64::from(holder != config.identity);
    let acquired = if holder == config.identity {
        serde_json::to_value(&spec.acquire_time)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(micro_now)
    } else {
        micro_now()
    };
    let lease = lease_object(config, transitions, rv, &acquired)?;
    match api
        .replace(&config.name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => Ok(true),
        // Someone renewed or took it in between: not ours.
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Waits until this replica holds the Lease, then keeps renewing it. Returns a token that is
/// cancelled when leadership is lost (a renewal failed for a whole lease duration); the
/// renewing task stops with `cancel`.
///
/// # Errors
/// Only when `cancel` fires before leadership was won ([`Error::Stopped`]).
pub async fn lead(
    client: Client,
    config: LeaseConfig,
    cancel: CancellationToken,
) -> Result<CancellationToken, Error> {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let retry = (config.duration / 4).max(Duration::from_millis(100));
    let mut observed = None;
    info!(lease = %config.name, identity = %config.identity, "waiting for the lease");
    loop {
        match try_acquire(&api, &config, &mut observed).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                warn!(error_code = "EM-EC-LEASE", error = %e, "lease not read or written; retrying")
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return Err(Error::Stopped),
            () = tokio::time::sleep(retry) => {}
        }
    }
    info!(lease = %config.name, identity = %config.identity, "became leader");
    let lost = CancellationToken::new();
    let signal = lost.clone();
    tokio::spawn(async move {
        let mut renewed = Instant::now();
        let mut observed = None;
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(retry) => {}
            }
            match try_acquire(&api, &config, &mut observed).await {
                Ok(true) => renewed = Instant::now(),
                Ok(false) => {
                    warn!(error_code = "EM-EC-LEASE-LOST", lease = %config.name, "another replica holds the lease");
                    signal.cancel();
                    return;
                }
                Err(e) => {
                    warn!(error_code = "EM-EC-LEASE", error = %e, "lease not renewed; retrying")
                }
            }
            if renewed.elapsed() >= config.duration {
                warn!(error_code = "EM-EC-LEASE-LOST", lease = %config.name, "lease not renewed for a whole duration");
                signal.cancel();
                return;
            }
        }
    });
    Ok(lost)
}
