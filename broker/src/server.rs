//! The router and the listeners: rumqttd's router thread, and per configured listener our
//! [`front`](crate::front) on its address with a guarded rumqttd listener behind it on loopback.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttd::local::{LinkBuilder, LinkRx, LinkTx};
use rumqttd::{LinkType, Router, Server};
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::backlog::Backlog;
use crate::codec::Codec;
use crate::config::{BrokerConfig, ListenerConfig, MqttVersion};
use crate::events::ClientEvents;
use crate::guard::ConnectGuard;
use crate::intake::Intake;
use crate::lag::Lag;
use crate::link::{Link, Links, Publisher};
use crate::security::Policy;
use crate::session::Sessions;
use crate::{Error, RESERVED_CLIENT_PREFIX};

/// The codec every rumqttd listener of ours runs.
type Guarded = ConnectGuard<Codec>;

/// Has rumqttd check logins through the policy when any credential check is on.
fn with_auth(
    mut settings: rumqttd::ServerSettings,
    policy: &Arc<Policy>,
) -> rumqttd::ServerSettings {
    if policy.needs_login_check() {
        let policy = policy.clone();
        settings.connections.set_auth_handler(move |client_id, username, password| {
            let policy = policy.clone();
            async move {
                // argon2 is slow on purpose: keep it off the async workers.
                let user = username.clone();
                let ok = tokio::task::spawn_blocking(move || policy.check_login(&user, &password))
                    .await
                    .unwrap_or(false);
                if !ok {
                    warn!(error_code = "EM-AUTH-REFUSED", %client_id, %username, "login refused");
                }
                ok
            }
        });
    }
    settings
}

/// How often subscribers are checked for having stopped reading.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How long a listener may take to bind once its task is spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

// Closures, because they capture rumqttd's router sender, whose type rumqttd does not export.
type LinkFactory = dyn Fn(&str) -> Result<(LinkTx, LinkRx), Error> + Send + Sync;
type ServerFactory = dyn Fn(rumqttd::ServerSettings, Guarded) -> Server<Guarded> + Send + Sync;

/// The broker's counters, read when the node's metrics are scraped (nothing is counted twice).
#[derive(Clone)]
pub struct BrokerStats {
    policy: Arc<Policy>,
    sessions: Arc<Sessions>,
    lag: Arc<Lag>,
    backlog: Arc<Backlog>,
    intake: Arc<Intake>,
}

impl BrokerStats {
    /// Client connections open right now, on every listener.
    pub fn connections(&self) -> u64 {
        self.sessions.open_count()
    }

    /// Publishes and subscribes refused by the ACL or the subscription cap so far.
    pub fn denials(&self) -> (u64, u64) {
        self.policy.denials()
    }

    /// Subscribers disconnected so far for falling behind (`EM-BROKER-SUBSCRIBER-LAG`).
    pub fn lagging_subscribers_cut(&self) -> u64 {
        self.lag.cut_count()
    }

    /// Hand-ons the front wrote to subscribers past rumqttd so far, one per subscriber.
    pub fn front_delivered(&self) -> u64 {
        self.lag.front_delivered()
    }

    /// Client publishes the front handed to a link past rumqttd so far.
    pub fn front_taken(&self) -> u64 {
        self.intake.taken()
    }

    /// Clients held right now before a publish to our links, and how many times one was.
    pub fn paused_publishers(&self) -> (u64, u64) {
        self.backlog.paused()
    }
}

/// The running broker: rumqttd's router thread plus, per listener, the front and a guarded
/// rumqttd listener, each a task on our runtime.
///
/// Dropping it stops the listeners (existing connections and the router live until process exit,
/// rumqttd has no shutdown).
pub struct Broker {
    config: BrokerConfig,
    listeners: JoinSet<Error>,
    new_link: Arc<LinkFactory>,
    new_server: Box<ServerFactory>,
    listening: bool,
    links: Links,
    policy: Arc<Policy>,
    sessions: Arc<Sessions>,
    backlog: Arc<Backlog>,
    lag: Arc<Lag>,
    events: Arc<ClientEvents>,
    intake: Arc<Intake>,
}

impl Broker {
    /// Validates the config and starts rumqttd's router; listeners open with [`Broker::listen`],
    /// so in-process links can subscribe before the first client arrives. `link_filters` are the
    /// filters our links will read, whose logs are sized by `link_segment_bytes`.
    pub fn new(config: &BrokerConfig, link_filters: &[String]) -> Result<Broker, Error> {
        config.validate()?;
        let policy = Arc::new(config.policy()?);
        let router_tx = Router::new(0, config.router_config(link_filters)).spawn();
        let listener_tx = router_tx.clone();
        let new_link: Arc<LinkFactory> = Arc::new(move |client_id: &str| {
            LinkBuilder::new(client_id, router_tx.clone())
                .clean_session(true)
                .build()
                .map(|(tx, rx, _ack)| (tx, rx))
                .map_err(|e| link_error(client_id, e))
        });
        let new_server: Box<ServerFactory> =
            Box::new(move |settings, guard| Server::new(settings, listener_tx.clone(), guard));
        let sessions = Arc::new(Sessions::default());
        sessions.limit_clients(config.max_connections);
        let lag = Arc::new(
            Lag::new(config.subscriber_lag_limit() as u64)
                .with_smaller_logs(
                    &crate::config::DEVICE_FILTERS,
                    config.device_lag_limit() as u64,
                )
                .with_stall(Duration::from_secs(config.subscriber_stall_s))
                .with_front_delivery(config.front_delivery),
        );
        let intake = Arc::new(Intake::new(
            config.front_intake,
            config.max_packet_bytes,
            lag.clone(),
            sessions.clone(),
        ));
        Ok(Broker {
            config: config.clone(),
            listeners: JoinSet::new(),
            new_link,
            new_server,
            listening: false,
            links: Links::default(),
            policy,
            sessions,
            backlog: Arc::new(Backlog::new(config.link_pause_bytes() as u64)),
            lag,
            events: Arc::new(ClientEvents::default()),
            intake,
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
        let mut opened = Vec::new();
        for (name, listener) in self.config.listeners.clone() {
            opened.extend(self.open(&name, &listener)?);
        }
        for (name, address, protocol) in opened {
            wait_until_bound(&mut self.listeners, &name, address).await?;
            info!(listener = %name, %address, ?protocol, "mqtt listener ready");
        }
        // Cuts off subscribers that stopped reading; lives as long as the listeners.
        let lag = self.lag.clone();
        self.listeners.spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                lag.sweep();
            }
        });
        Ok(())
    }

    /// Spawns the front on the listener's address and a guarded rumqttd listener behind it on a
    /// loopback port; returns both, back end first, to wait for.
    fn open(
        &mut self,
        name: &str,
        listener: &ListenerConfig,
    ) -> Result<[(String, SocketAddr, MqttVersion); 2], Error> {
        // rumqttd only logs a failed bind; bind first so the failure is ours to report.
        let bound =
            std::net::TcpListener::bind(listener.address).map_err(|source| Error::Bind {
                name: name.to_owned(),
                address: listener.address,
                source,
            })?;
        let tls = (listener.tls.as_ref())
            .map(|tls| crate::front::Tls::new(name, tls))
            .transpose()?;
        let backend_name = format!("{name}-backend");
        let backend = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|probe| probe.local_addr())
            .map_err(|source| Error::Bind {
                name: backend_name.clone(),
                address: listener.address,
                source,
            })?;
        let plain = ListenerConfig {
            address: backend,
            tls: None,
            ..listener.clone()
        };
        let settings = with_auth(
            self.config.server_settings(&backend_name, &plain),
            &self.policy,
        );
        let codec = Codec::of(listener.protocol);
        let v5 = codec.is_v5();
        let guard = ConnectGuard::new(codec, self.policy.clone(), v5)
            .counting(self.backlog.clone())
            .watching(self.lag.clone())
            .announcing(self.events.clone())
            .behind_front(self.policy.cert_secret(), self.sessions.clone());
        let mut server = (self.new_server)(settings, guard);
        let stopped = backend_name.clone();
        self.listeners.spawn(async move {
            let reason = match server.start(LinkType::Remote).await {
                Ok(()) => "accept loop ended".to_owned(),
                Err(e) => e.to_string(),
            };
            Error::ListenerStopped {
                name: stopped,
                address: backend,
                reason,
            }
        });
        self.listeners.spawn(crate::front::serve(
            name.to_owned(),
            bound,
            tls,
            crate::front::Backend {
                address: backend,
                secret: self.policy.cert_secret(),
                connect_timeout: Duration::from_millis(u64::from(self.config.connect_timeout_ms)),
                backlog: self.backlog.clone(),
                sessions: self.sessions.clone(),
                low_latency: self.config.low_latency,
                intake: self.intake.clone(),
            },
        ));
        Ok([
            (backend_name, backend, listener.protocol),
            (name.to_owned(), listener.address, listener.protocol),
        ])
    }

    /// Subscribers cut off so far for falling behind their filter's log.
    pub fn lagging_subscribers_cut(&self) -> u64 {
        self.lag.cut_count()
    }

    /// A handle on the broker's counters that outlives [`Broker::close`], for the node's metrics.
    pub fn stats(&self) -> BrokerStats {
        BrokerStats {
            policy: self.policy.clone(),
            sessions: self.sessions.clone(),
            lag: self.lag.clone(),
            backlog: self.backlog.clone(),
            intake: self.intake.clone(),
        }
    }

    /// Publishes clients' `$hw/events/connected/<id>` and `…/disconnected/<id>` through
    /// `publisher` (docs/devices.md); until this is called, they wait (up to 1,024).
    pub fn announce_clients(&mut self, publisher: Publisher) {
        let events = self.events.clone();
        self.links.spawn(async move { events.run(publisher).await });
    }

    /// Opens an in-process client named `edgemeta-<name>` subscribed to `filters`.
    pub async fn link(
        &mut self,
        name: &str,
        filters: &[String],
        capacity: usize,
    ) -> Result<Link, Error> {
        let client_id = format!("{RESERVED_CLIENT_PREFIX}{name}");
        self.backlog.watch(filters);
        let factory = self.new_link.clone();
        let filters = filters.to_vec();
        let filters_read = filters.clone();
        let id = client_id.clone();
        // Registering with the router is a blocking round trip; keep it off the tokio workers.
        let (tx, rx) = tokio::task::spawn_blocking(move || {
            let (mut tx, rx) = factory(&id)?;
            for filter in filters {
                tx.subscribe(filter).map_err(|e| link_error(&id, e))?;
            }
            Ok::<_, Error>((tx, rx))
        })
        .await
        .map_err(|e| Error::Link {
            client_id: client_id.clone(),
            reason: e.to_string(),
        })??;
        Link::spawn(
            client_id,
            tx,
            rx,
            capacity,
            crate::link::Accounts {
                backlog: self.backlog.clone(),
                lag: self.lag.clone(),
                sessions: self.sessions.clone(),
                intake: self.intake.clone(),
            },
            &mut self.links,
            &filters_read,
        )
    }

    /// Stops the listeners, so no new connection is accepted, and hands over the links to be
    /// joined once their users have stopped. rumqttd cannot close the connections it has, nor
    /// its router (rumqttd #771); those live until the process exits.
    pub fn close(self) -> Links {
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

fn link_error(client_id: &str, error: rumqttd::local::LinkError) -> Error {
    Error::Link {
        client_id: client_id.to_owned(),
        reason: error.to_string(),
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

/// Waits until rumqttd accepts connections on the port, or its task has died.
async fn wait_until_bound(
    set: &mut JoinSet<Error>,
    name: &str,
    address: SocketAddr,
) -> Result<(), Error> {
    let started = Instant::now();
    loop {
        if let Some(done) = set.try_join_next() {
            return Err(match done {
                Ok(e) => e,
                Err(join) => Error::ListenerStopped {
                    name: name.to_owned(),
                    address,
                    reason: join.to_string(),
                },
            });
        }
        // Connect rather than bind to test it: a test bind would hold the port for an instant
        // and could make rumqttd's own bind fail.
        let probe = tokio::net::TcpStream::connect(reachable(address));
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(100), probe).await {
            return Ok(());
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(Error::NotReady {
                name: name.to_owned(),
                address,
                waited_ms: READY_TIMEOUT.as_millis() as u64,
            });
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
