//! `edgemeta`: KubeEdge's edge MetaManager on an embedded MQTT broker.
//!
//! # Layout
//! - `config`: settings from `conf/edge.yaml` or `--config`, plus `EDGEMETA_*` overrides.
//! - `telemetry`: tracing setup (`RUST_LOG` wins).
//! - `app`: broker → MetaManager wiring and bounded shutdown.
//! - `observe`: `/metrics`, `/healthz`, `/readyz` on `observe.address`.
//! - `cli`: the operator's commands: `get` (the store, read-only) and `status` (the endpoints).
//! - `shutdown`: SIGINT / SIGTERM.
//! - `edgecontroller` (crate `edgemeta-edgecontroller`): the cloud side, for Kubernetes.

mod app;
mod cli;
mod config;
mod observe;
mod shutdown;
mod telemetry;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "edgemeta",
    version,
    about = "KubeEdge's edge MetaManager on MQTT"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the node: embedded MQTT broker, MetaManager and store.
    Run {
        /// YAML configuration file (default: the embedded conf/edge.yaml).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Run edged, the reference edge agent: it runs the pods the MetaManager hands to
    /// `ke/edged/...` as local processes and reports their status (section `edged:`).
    Edged {
        /// YAML configuration file (default: the embedded conf/edge.yaml).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// List stored objects like `kubectl get`: `<namespace>/<type>` or `<namespace>/<type>/<name>`.
    /// Reads the store read-only, so it is safe while the node runs.
    Get {
        /// `<namespace>/<type>[/<name>]`.
        selector: String,
        /// `table` (NAMESPACE TYPE NAME SIZE), or the documents as `json` or `yaml`.
        #[arg(long, short, value_enum, default_value_t = cli::Output::Table)]
        output: cli::Output,
        /// The node's configuration file, for the store's path (default: as `run` loads it).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Ask the running node for its health: listeners, connections, cloud, outbox, store.
    /// Exits 0 when it is ready, 1 when not or unreachable.
    Status {
        /// The node's configuration file, for `observe.address` (default: as `run` loads it).
        #[arg(long, short)]
        config: Option<PathBuf>,
    },
    /// Run the cloud side: watch Kubernetes (kube-rs) and drive edge nodes through the cloud
    /// MQTT broker (pods, configmaps, secrets, Nodes down; pod status and queries up).
    Edgecontroller {
        /// A kubeconfig file (default: in-cluster config, `$KUBECONFIG` or `~/.kube/config`).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
        /// The cloud MQTT broker the nodes' bridges use.
        #[arg(long, default_value = "mqtt://127.0.0.1:1883")]
        broker: String,
        /// The nodes' `cloud.root`.
        #[arg(long, default_value = "kubeedge")]
        root: String,
        /// MQTT client id (a persistent session at the broker).
        #[arg(long, default_value = "edgemeta-edgecontroller")]
        client_id: String,
        /// MQTT username; the password comes from `EDGEMETA_CONTROLLER_PASSWORD`.
        #[arg(long)]
        username: Option<String>,
        /// First resend of an unacknowledged message, in milliseconds (doubles up to 60 s).
        #[arg(long, default_value_t = 5000)]
        resend_ms: u64,
        /// Run only while holding a Lease, so replicas are hot standbys. All replicas must use
        /// the same `--client-id`.
        #[arg(long)]
        leader_elect: bool,
        /// The Lease's namespace and name.
        #[arg(long, default_value = "default")]
        lease_namespace: String,
        #[arg(long, default_value = "edgemeta-edgecontroller")]
        lease_name: String,
        /// How long an unrenewed Lease stays with its holder, in seconds.
        #[arg(long, default_value_t = 15)]
        lease_duration_s: u64,
        /// This replica's name in the Lease (default: `$HOSTNAME`, else `edgecontroller-<pid>`).
        #[arg(long)]
        identity: Option<String>,
    },
    /// Print the embedded default configuration.
    DefaultConfig,
    /// Read a password from standard input and print its argon2 hash for
    /// `broker.auth.users.<name>.password_hash`.
    Passwd,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::DefaultConfig => {
            print!("{}", config::DEFAULT_YAML);
            Ok(())
        }
        Command::Passwd => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            let password = line.trim_end_matches(['\r', '\n']);
            anyhow::ensure!(!password.is_empty(), "no password on standard input");
            let hash =
                edgemeta_broker::security::hash_password(password).map_err(anyhow::Error::msg)?;
            println!("{hash}");
            Ok(())
        }
        Command::Edged { config } => {
            let settings = config::Settings::load(config.as_deref())?;
            telemetry::init(&settings.log, None);
            let edged = settings.edged()?;
            let root = settings.broker.topic_root.clone();
            until_signal("edgemeta-edged", |cancel| async move {
                edgemeta_edged::run(edged, &root, cancel).await
            })?;
            Ok(())
        }
        Command::Edgecontroller {
            kubeconfig,
            broker,
            root,
            client_id,
            username,
            resend_ms,
            leader_elect,
            lease_namespace,
            lease_name,
            lease_duration_s,
            identity,
        } => {
            // The node's log settings (`RUST_LOG` wins), from the embedded defaults.
            telemetry::init(&config::Settings::load(None)?.log, None);
            let config = edgemeta_edgecontroller::Config {
                kubeconfig,
                broker,
                root,
                client_id,
                password: username
                    .as_ref()
                    .and_then(|_| std::env::var("EDGEMETA_CONTROLLER_PASSWORD").ok()),
                username,
                resend: std::time::Duration::from_millis(resend_ms),
                leader: leader_elect.then(|| edgemeta_edgecontroller::LeaseConfig {
                    namespace: lease_namespace,
                    name: lease_name,
                    identity: identity
                        .or_else(|| std::env::var("HOSTNAME").ok())
                        .unwrap_or_else(|| format!("edgecontroller-{}", std::process::id())),
                    duration: std::time::Duration::from_secs(lease_duration_s),
                }),
                ..edgemeta_edgecontroller::Config::default()
            };
            until_signal("edgemeta-edgecontroller", |cancel| {
                edgemeta_edgecontroller::run(config, cancel)
            })?;
            Ok(())
        }
        Command::Get {
            selector,
            output,
            config,
        } => {
            let settings = config::Settings::load(config.as_deref())?;
            let found = cli::get(&settings, &selector, output)?;
            std::process::exit(if found { 0 } else { 1 });
        }
        Command::Status { config } => {
            let settings = config::Settings::load(config.as_deref())?;
            let ready = cli::status(&settings)?;
            std::process::exit(if ready { 0 } else { 1 });
        }
        Command::Run { config } => {
            let settings = config::Settings::load(config.as_deref())?;
            let registry = if settings.observe.enabled {
                Some(observe::Registry::new()?)
            } else {
                None
            };
            telemetry::init(&settings.log, registry.as_ref().map(|r| r.error_layer()));
            let served = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("edgemeta")
                .build()?
                .block_on(app::run(settings, registry, shutdown::signal()));
            if let Err(e) = served {
                eprintln!("Error: {e:?}");
                std::process::exit(i32::from(app::exit_code(&e)));
            }
            Ok(())
        }
    }
}

/// Runs `job` on a runtime of its own, with a token cancelled on SIGINT/SIGTERM (the separate
/// processes `edged` and `edgecontroller` stop this way).
fn until_signal<F, Fut, T, E>(thread_name: &str, job: F) -> anyhow::Result<T>
where
    F: FnOnce(tokio_util::sync::CancellationToken) -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
    anyhow::Error: From<E>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(thread_name)
        .build()?;
    let result = runtime.block_on(async move {
        let cancel = tokio_util::sync::CancellationToken::new();
        let stop = cancel.clone();
        tokio::spawn(async move {
            shutdown::signal().await;
            stop.cancel();
        });
        job(cancel).await
    });
    Ok(result?)
}
