//! The listeners and the node's modules on the one path: every listener's accept loop hands
//! each connection (after its TLS handshake, if any) to its own task (`conn/`); the node's
//! modules attach to the same hub as socket-less sessions (`link.rs`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{BrokerConfig, ListenerConfig};
use crate::conn::{serve, serve_tcp_admitted, Accepted, Shared};
use crate::events::ClientEvents;
use crate::hub::{Hub, HubLimits};
use crate::index::TopicBounds;
use crate::link::{Link, Links, Publisher};
use crate::security::Policy;
use crate::tls::Tls;
use crate::{Error, RESERVED_CLIENT_PREFIX};

/// The broker's counters, read when the node's metrics are scraped (nothing is counted twice).
#[derive(Clone)]
pub struct BrokerStats {
    policy: Arc<Policy>,
    shared: Arc<Shared>,
}

impl BrokerStats {
    /// Client connections open right now, on every listener.
    pub fn connections(&self) -> u64 {
        self.shared.open.load(Ordering::Relaxed)
    }

    /// Publishes and subscribes refused by the ACL or the subscription cap so far.
    pub fn denials(&self) -> (u64, u64) {
        self.policy.denials()
    }

    /// Subscribers disconnected so far for not taking what they held
    /// (`EM-BROKER-SUBSCRIBER-LAG`).
    pub fn lagging_subscribers_cut(&self) -> u64 {
        self.shared.hub.lag_cuts.load(Ordering::Relaxed)
    }

    /// Messages dropped so far for sessions that are away (`EM-BROKER-QUEUE-FULL`, logged
    /// at most every 10 s).
    pub fn away_dropped(&self) -> u64 {
        self.shared.hub.away_drops.load(Ordering::Relaxed)
    }

    /// Connections closed so far because their packet found no room in
    /// `broker.read_buffers_bytes` (`EM-BROKER-READ-BUFFERS`, logged at most every 10 s).
    pub fn read_buffers_refused(&self) -> u64 {
        self.shared.reading.closed()
    }

    /// Connections closed so far because a packet took longer than `broker.packet_timeout_ms`
    /// to arrive (`EM-BROKER-SLOW-PACKET`, logged at most every 10 s).
    pub fn slow_packets(&self) -> u64 {
        self.shared.reading.slow()
    }

    /// Sessions held, connected or not (MQTT 5 Session Expiry, 3.1.1 clean session flag 0).
    pub fn sessions(&self) -> u64 {
        self.shared.hub.sessions() as u64
    }

    /// Clients waiting right now for a module's inbox, and how many times one did.
    pub fn paused_publishers(&self) -> (u64, u64) {
        (
            self.shared.paused.load(Ordering::Relaxed),
            self.shared.pauses.load(Ordering::Relaxed),
        )
    }
}

/// The running broker: one accept loop per listener and the hub they and the node's modules
/// share, each a task on our runtime.
pub struct Broker {
    config: BrokerConfig,
    shared: Arc<Shared>,
    events: Arc<ClientEvents>,
    listeners: JoinSet<Error>,
    links: Links,
    cancel: CancellationToken,
    listening: bool,
}

impl Broker {
    /// Validates the config and starts the hub; listeners open with [`Broker::listen`], so the
    /// node's modules can subscribe before the first client arrives.
    pub fn new(config: &BrokerConfig) -> Result<Broker, Error> {
        config.validate()?;
        let policy = Arc::new(config.policy()?);
        let hub = Arc::new(Hub::new(HubLimits {
            queue_bytes: config.queue_bytes,
            retained_bytes: config.retained_bytes,
            max_away_sessions: config.max_away_sessions,
            queues_bytes: config.queues_bytes,
            reader_stall: Duration::from_secs(config.subscriber_stall_s),
        }));
        let events = Arc::new(ClientEvents::default());
        let mut shared = Shared::new(
            hub.clone(),
            policy,
            u32::try_from(config.max_packet_bytes).unwrap_or(u32::MAX),
        );
        shared.events = Some(events.clone());
        shared.max_clients = config.max_connections;
        shared.reading =
            crate::conn::ReadBudget::new(config.read_buffers_bytes, config.max_packet_bytes);
        shared.connect_within = Duration::from_millis(u64::from(config.connect_timeout_ms));
        shared.packet_within = Duration::from_millis(u64::from(config.packet_timeout_ms));
        shared.topics = TopicBounds {
            max_levels: config.max_topic_levels,
            max_bytes: config.max_topic_bytes,
        };
        let cancel = CancellationToken::new();
        let mut links = Links::default();
        links.spawn(hub.clone().run_timers(cancel.clone()));
        Ok(Broker {
            config: config.clone(),
            shared: Arc::new(shared),
            events,
            listeners: JoinSet::new(),
            links,
            cancel,
            listening: false,
        })
    }

    /// Opens every listener; returns once all of them accept connections.
    ///
    /// # Errors
    /// A listener that cannot bind (address in use, bad address) is fatal and named.
    pub async fn listen(&mut self) -> Result<(), Error> {
        if std::mem::replace(&mut self.listening, true) {
            return Ok(());
        }
        for (name, listener) in self.config.listeners.clone() {
            self.open(&name, &listener)?;
            info!(listener = %name, address = %listener.address, "mqtt listener ready (MQTT 3.1.1 and 5)");
        }
        Ok(())
    }

    fn open(&mut self, name: &str, listener: &ListenerConfig) -> Result<(), Error> {
        let bind_error = |source| Error::Bind {
            name: name.to_owned(),
            address: listener.address,
            source,
        };
        let bound = std::net::TcpListener::bind(listener.address).map_err(bind_error)?;
        bound.set_nonblocking(true).map_err(bind_error)?;
        let bound = TcpListener::from_std(bound).map_err(bind_error)?;
        let tls = (listener.tls.as_ref())
            .map(|tls| Tls::new(name, tls))
            .transpose()?;
        let accept = Accept {
            name: name.to_owned(),
            address: listener.address,
            tls,
            shared: self.shared.clone(),
            low_latency: self.config.low_latency,
            cancel: self.cancel.clone(),
        };
        self.listeners.spawn(accept.run(bound));
        Ok(())
    }

    /// Subscribers cut off so far for not taking what they held.
    pub fn lagging_subscribers_cut(&self) -> u64 {
        self.shared.hub.lag_cuts.load(Ordering::Relaxed)
    }

    /// A handle on the broker's counters that outlives [`Broker::close`], for the node's metrics.
    pub fn stats(&self) -> BrokerStats {
        BrokerStats {
            policy: self.shared.policy.clone(),
            shared: self.shared.clone(),
        }
    }

    /// Publishes clients' `$hw/events/connected/<id>` and `…/disconnected/<id>` through
    /// `publisher` (docs/devices.md); until this is called, they wait (up to 1,024).
    pub fn announce_clients(&mut self, publisher: Publisher) {
        let events = self.events.clone();
        self.links.spawn(async move { events.run(publisher).await });
    }

    /// Attaches a node module named `edgemeta-<name>`: what `filters` match
    /// reaches its inbox, which holds `capacity` messages before publishers wait.
    pub async fn link(
        &mut self,
        name: &str,
        filters: &[String],
        capacity: usize,
    ) -> Result<Link, Error> {
        let (inbox_tx, inbox) = tokio::sync::mpsc::channel(capacity);
        let session = self
            .shared
            .hub
            .attach_link(filters, inbox_tx)
            .map_err(|e| Error::Link {
                client_id: format!("{RESERVED_CLIENT_PREFIX}{name}"),
                reason: format!("{e:?}"),
            })?;
        Ok(Link {
            inbox,
            publisher: Publisher::of(self.shared.hub.clone(), session),
        })
    }

    /// Stops the listeners and ends every client connection (MQTT 5 clients are told the
    /// server is shutting down); hands over the modules' tasks to be joined once their users
    /// have stopped.
    pub fn close(mut self) -> Links {
        self.cancel.cancel();
        self.listeners.abort_all();
        self.links
    }

    /// Resolves when a listener stops after start-up; the node cannot serve without it.
    pub async fn failed(&mut self) -> Error {
        match self.listeners.join_next().await {
            Some(Ok(error)) => error,
            Some(Err(join)) => Error::ListenerStopped {
                name: "?".into(),
                address: SocketAddr::from(([0, 0, 0, 0], 0)),
                reason: join.to_string(),
            },
            None => std::future::pending().await,
        }
    }
}

/// One listener's accept loop.
struct Accept {
    name: String,
    address: SocketAddr,
    tls: Option<Tls>,
    shared: Arc<Shared>,
    low_latency: bool,
    cancel: CancellationToken,
}

impl Accept {
    async fn run(self, listener: TcpListener) -> Error {
        loop {
            let (stream, from) = tokio::select! {
                _ = self.cancel.cancelled() => {
                    return Error::ListenerStopped {
                        name: self.name,
                        address: self.address,
                        reason: "the node is stopping".into(),
                    };
                }
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        warn!(error_code = "EM-FRONT-ACCEPT", listener = %self.name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            if self.low_latency {
                let _ = stream.set_nodelay(true);
            }
            let (shared, cancel) = (self.shared.clone(), self.cancel.clone());
            // Two spawns, not one future with both arms: a task is as large as its future, and
            // the TLS arm (rustls' connection state inline) would make every plain one pay it.
            match self.tls.clone() {
                None => {
                    // Counted here, in the order connections came: their tasks may run in
                    // another order, and a later one must not take an earlier one's place.
                    let admitted = shared.admit();
                    let peer = Some(from.ip());
                    tokio::spawn(serve_tcp_admitted(stream, peer, admitted, shared, cancel));
                }
                Some(tls) => {
                    // Counted before the handshake, which holds memory too; one over the limit
                    // is closed without a handshake (it cannot be answered in MQTT before it).
                    let Some(admitted) = shared.admit() else {
                        drop(stream);
                        warn!(error_code = "EM-BROKER-CONNECTION-LIMIT", listener = %self.name, "closed a TLS connection: broker.max_connections reached");
                        continue;
                    };
                    let peer = Some(from.ip());
                    tokio::spawn(async move {
                        match tls.accept(stream, shared.connect_within).await {
                            Ok((stream, certified)) => {
                                let accepted = Accepted {
                                    certified,
                                    socket: None,
                                    peer,
                                    admitted,
                                };
                                serve(stream, accepted, shared, cancel).await;
                            }
                            Err(e) => debug!(error = %e, "TLS connection refused"),
                        }
                    });
                }
            }
        }
    }
}

/// Where a client on this host reaches a listener bound to `address` (unspecified means loopback).
pub fn reachable(address: SocketAddr) -> SocketAddr {
    let ip = match address.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, address.port())
}
