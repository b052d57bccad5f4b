use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rumqttd::local::{LinkBuilder, LinkRx, LinkTx};
use rumqttd::protocol::{v4::V4, v5::V5};
use rumqttd::{LinkType, Router, Server};
use std::sync::atomic::Ordering;
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::backlog::Backlog;
use crate::lag::Lag;
use crate::security::Policy;
use crate::session::Sessions;

use crate::config::{BrokerConfig, MqttVersion};
use crate::guard::ConnectGuard;
use crate::link::Link;
use crate::{Error, RESERVED_CLIENT_PREFIX};

/// Spawns one rumqttd listener on our runtime, its codec wrapped in [`ConnectGuard`].
///
/// A macro because rumqttd's router channel type cannot be named outside rumqttd.
macro_rules! spawn_listener {
    ($set:expr, $settings:expr, $router_tx:expr, $guard:expr) => {{
        let settings: rumqttd::ServerSettings = $settings;
        let (name, address) = (settings.name.clone(), settings.listen);
        let mut server = Server::new(settings, $router_tx, $guard);
        $set.spawn(async move {
            let reason = match server.start(LinkType::Remote).await {
                Ok(()) => "accept loop ended".to_owned(),
                Err(e) => e.to_string(),
            };
            Error::ListenerStopped {
                name,
                address,
                reason,
            }
        });
    }};
}

/// Spawns a listener speaking `protocol` behind a [`ConnectGuard`] (optionally behind the
/// client-certificate front, whose secret it then requires).
macro_rules! spawn_guarded {
    ($set:expr, $settings:expr, $router_tx:expr, $protocol:expr, $policy:expr, $front:expr, $backlog:expr, $lag:expr) => {{
        let (secret, sessions): (Arc<str>, Arc<Sessions>) = $front;
        match $protocol {
            MqttVersion::V4 => {
                let guard = ConnectGuard::new(V4, $policy.clone(), false)
                    .counting($backlog.clone())
                    .watching($lag.clone())
                    .behind_front(secret, sessions);
                spawn_listener!($set, $settings, $router_tx, guard)
            }
            MqttVersion::V5 => {
                let guard = ConnectGuard::new(V5, $policy.clone(), true)
                    .counting($backlog.clone())
                    .watching($lag.clone())
                    .behind_front(secret, sessions);
                spawn_listener!($set, $settings, $router_tx, guard)
            }
        }
    }};
}

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

/// How long a listener may take to bind once its task is spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

type LinkFactory = dyn Fn(&str) -> Result<(LinkTx, LinkRx), Error> + Send + Sync;

/// The running broker: rumqttd's router thread plus one task per listener on our runtime.
///
/// Dropping it stops the listeners (existing connections and the router live until process exit,
/// rumqttd has no shutdown).
pub struct Broker {
    listeners: JoinSet<Error>,
    new_link: Arc<LinkFactory>,
    open: Option<Box<OpenListeners>>,
    addresses: Vec<(String, SocketAddr)>,
    policy: Arc<Policy>,
    backlog: Arc<Backlog>,
    lag: Arc<Lag>,
}

/// Spawns the configured listeners; a closure because it captures rumqttd's unnameable sender.
type OpenListeners =
    dyn FnOnce(&mut JoinSet<Error>) -> Result<Vec<(String, SocketAddr, MqttVersion)>, Error> + Send;

impl Broker {
    /// Validates the config and starts rumqttd's router; listeners open with [`Broker::listen`],
    /// so in-process links can subscribe before the first client arrives. `link_filters` are the
    /// filters our links will read, whose logs are sized by `link_segment_bytes`.
    pub fn new(config: &BrokerConfig, link_filters: &[String]) -> Result<Broker, Error> {
        config.validate()?;
        let policy = Arc::new(config.policy()?);
        let backlog = Arc::new(Backlog::new(config.link_pause_bytes() as u64));
        let listener_backlog = backlog.clone();
        let lag = Arc::new(Lag::new(config.subscriber_lag_limit() as u64));
        let listener_lag = lag.clone();
        let sessions = Arc::new(Sessions::default());
        let denials = policy.clone();
        let router_tx = Router::new(0, config.router_config(link_filters)).spawn();
        let listener_tx = router_tx.clone();
        let new_link: Arc<LinkFactory> = Arc::new(move |client_id: &str| {
            LinkBuilder::new(client_id, router_tx.clone())
                .clean_session(true)
                .build()
                .map(|(tx, rx, _ack)| (tx, rx))
                .map_err(|e| link_error(client_id, e))
        });
        let config = config.clone();
        let open: Box<OpenListeners> = Box::new(move |listeners: &mut JoinSet<Error>| {
            let mut planned = Vec::new();
            for (name, listener) in &config.listeners {
                // rumqttd only logs a failed bind; probe first so the failure is ours to report.
                let bound = std::net::TcpListener::bind(listener.address).map_err(|source| {
                    Error::Bind {
                        name: name.clone(),
                        address: listener.address,
                        source,
                    }
                })?;
                // Every listener is our front on the address, rumqttd behind it on loopback.
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
                let plain = crate::config::ListenerConfig {
                    address: backend,
                    tls: None,
                    ..listener.clone()
                };
                let settings = with_auth(config.server_settings(&backend_name, &plain), &policy);
                spawn_guarded!(
                    listeners,
                    settings,
                    listener_tx.clone(),
                    listener.protocol,
                    &policy,
                    (policy.cert_secret(), sessions.clone()),
                    listener_backlog,
                    listener_lag
                );
                listeners.spawn(crate::front::serve(
                    name.clone(),
                    bound,
                    tls,
                    crate::front::Backend {
                        address: backend,
                        secret: policy.cert_secret(),
                        connect_timeout: Duration::from_millis(u64::from(
                            config.connect_timeout_ms,
                        )),
                        backlog: listener_backlog.clone(),
                        sessions: sessions.clone(),
                        low_latency: config.low_latency,
                    },
                ));
                planned.push((backend_name, backend, listener.protocol));
                planned.push((name.clone(), listener.address, listener.protocol));
            }
            Ok(planned)
        });
        Ok(Broker {
            listeners: JoinSet::new(),
            new_link,
            open: Some(open),
            addresses: Vec::new(),
            policy: denials,
            backlog,
            lag,
        })
    }

    /// Opens every listener; returns once all of them accept connections.
    ///
    /// # Errors
    /// A listener that cannot bind (address in use, bad address) is fatal and named.
    pub async fn listen(&mut self) -> Result<(), Error> {
        let Some(open) = self.open.take() else {
            return Ok(());
        };
        for (name, address, protocol) in open(&mut self.listeners)? {
            wait_until_bound(&mut self.listeners, &name, address).await?;
            info!(listener = %name, %address, ?protocol, "mqtt listener ready");
            self.addresses.push((name, address));
        }
        Ok(())
    }

    /// Publishes and subscribes refused so far: `(publishes, subscribes)`.
    pub fn denials(&self) -> (u64, u64) {
        let d = &self.policy.denials;
        (
            d.publishes.load(Ordering::Relaxed),
            d.subscribes.load(Ordering::Relaxed),
        )
    }

    /// Subscribers cut off so far for falling behind their filter's log.
    pub fn lagging_subscribers_cut(&self) -> u64 {
        self.lag.cut_count()
    }

    /// The listeners' names and addresses.
    pub fn addresses(&self) -> &[(String, SocketAddr)] {
        &self.addresses
    }

    /// Opens an in-process client named `edgemeta-<name>` subscribed to `filters`.
    pub async fn link(
        &self,
        name: &str,
        filters: &[String],
        capacity: usize,
    ) -> Result<Link, Error> {
        let client_id = format!("{RESERVED_CLIENT_PREFIX}{name}");
        self.backlog.watch(filters);
        let factory = self.new_link.clone();
        let filters = filters.to_vec();
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
            self.backlog.clone(),
            self.lag.clone(),
        )
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

/// Where a client on this host reaches a listener bound to `address`.
fn reachable(address: SocketAddr) -> SocketAddr {
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
