//! File descriptors for the clients the broker admits. A client holds one in the process (its
//! socket, plain or TLS), so at start the node raises its soft `RLIMIT_NOFILE` to the hard
//! limit, as servers do, and admits no more clients than what is left carries: past it, a
//! client is refused at CONNECT with a clear reason instead of the listener failing to accept.

use anyhow::bail;
use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
use tracing::{info, warn};

/// Descriptors one client holds at most.
pub const PER_CLIENT: u64 = 1;

/// Descriptors kept for everything but clients: the store's files on its three connections,
/// the listeners, the links, the cloud bridge, and the observe and MetaServer connections
/// (each open watch is one).
pub const RESERVED: u64 = 256;

/// Linux's default ceiling on a process's open files (`fs.nr_open`): what an unlimited hard
/// limit is raised to, since the kernel refuses infinity here.
const NR_OPEN: u64 = 1 << 20;

/// Raises the soft limit to the hard one; returns the soft limit now in force (`None`:
/// unlimited).
fn raise() -> Option<u64> {
    let limit = getrlimit(Resource::Nofile);
    let wanted = limit.maximum.unwrap_or(NR_OPEN);
    match limit.current {
        Some(current) if current < wanted => {
            let raised = Rlimit {
                current: Some(wanted),
                maximum: limit.maximum,
            };
            match setrlimit(Resource::Nofile, raised) {
                Ok(()) => Some(wanted),
                Err(e) => {
                    warn!(error_code = "EM-BROKER-FD-LIMIT", error = %e, "could not raise the open-files limit");
                    Some(current)
                }
            }
        }
        current => current,
    }
}

/// The clients `limit` descriptors carry beside [`RESERVED`].
pub fn clients_carried(limit: u64) -> u64 {
    limit.saturating_sub(RESERVED) / PER_CLIENT
}

/// Raises the open-files limit and caps `max_connections` to what it carries, saying so; an
/// error when it carries no client at all.
pub fn fit(max_connections: &mut usize) -> anyhow::Result<()> {
    let Some(limit) = raise() else {
        return Ok(());
    };
    let carried = clients_carried(limit);
    let configured = *max_connections as u64;
    if carried == 0 {
        bail!(
            "the process may open only {limit} files; the node needs at least {} \
             (raise `ulimit -n`, or LimitNOFILE under systemd)",
            RESERVED + PER_CLIENT
        );
    }
    if carried < configured {
        warn!(
            error_code = "EM-BROKER-FD-LIMIT",
            open_files = limit,
            max_connections = configured,
            admitted = carried,
            "broker.max_connections {configured} needs {} open files and the process may open \
             {limit}: admitting at most {carried} clients (raise `ulimit -n`, or LimitNOFILE \
             under systemd)",
            RESERVED.saturating_add(configured.saturating_mul(PER_CLIENT))
        );
        *max_connections = carried as usize;
    } else {
        info!(
            open_files = limit,
            max_connections = configured,
            "open-files limit"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_takes_four_descriptors_beside_the_reserve() {
        assert_eq!(clients_carried(0), 0);
        assert_eq!(clients_carried(RESERVED + PER_CLIENT - 1), 0);
        assert_eq!(clients_carried(RESERVED + PER_CLIENT), 1);
        // A shell's usual soft limit carries a few hundred; the default 10,000 clients need
        // systemd's usual hard limit.
        assert_eq!(clients_carried(1024), 768);
        assert!(clients_carried(524_288) >= 10_000);
    }
}
