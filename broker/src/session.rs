//! One client connection as both the front (which owns its socket) and the guard (which sees its
//! packets) know it. The front registers it under a number that travels to the guard in the
//! preamble, so a decision the guard takes (cut this client off) reaches the socket.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

/// A connection the node may cut off.
#[derive(Debug, Default)]
pub struct Session {
    id: u64,
    cut: CancellationToken,
}

impl Session {
    /// The number the preamble carries.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Ends the connection: the front drops both sockets, the guard writes nothing more.
    pub fn cut(&self) {
        self.cut.cancel();
    }

    pub fn is_cut(&self) -> bool {
        self.cut.is_cancelled()
    }

    /// Resolves once the connection has been cut.
    pub async fn cut_off(&self) {
        self.cut.cancelled().await;
    }
}

/// Sessions the front has opened and the guard has not yet claimed.
#[derive(Debug, Default)]
pub struct Sessions {
    next: AtomicU64,
    /// Connections the front holds open right now (opened, not yet closed).
    open: AtomicU64,
    unclaimed: Mutex<HashMap<u64, Arc<Session>>>,
}

impl Sessions {
    /// Registers a new connection; the front holds the session until the connection ends.
    pub fn open(&self) -> Arc<Session> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.open.fetch_add(1, Ordering::Relaxed);
        let session = Arc::new(Session {
            id,
            cut: CancellationToken::new(),
        });
        self.lock().insert(id, session.clone());
        session
    }

    /// Hands the session to the guard that read its number in the preamble (once).
    pub fn claim(&self, id: u64) -> Option<Arc<Session>> {
        self.lock().remove(&id)
    }

    /// The connection ended; forgets its session if it was never claimed (the client left
    /// before its first packet). Called once per [`Sessions::open`].
    pub fn close(&self, id: u64) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        self.lock().remove(&id);
    }

    /// Client connections open right now.
    pub fn open_count(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.unclaimed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_claimed_once_and_a_cut_reaches_every_holder() {
        let sessions = Sessions::default();
        let front = sessions.open();
        let guard = sessions.claim(front.id()).expect("claimed");
        assert!(sessions.claim(front.id()).is_none(), "only once");
        guard.cut();
        assert!(front.is_cut());
        let other = sessions.open();
        assert_ne!(other.id(), front.id());
        sessions.close(other.id());
        assert!(sessions.claim(other.id()).is_none());
    }
}
