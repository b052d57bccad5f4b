//! `edgemeta`: KubeEdge's edge MetaManager on an embedded MQTT broker.
//!
//! # Layout
//! - `config`: settings from `conf/edge.yaml` or `--config`, plus `EDGEMETA_*` overrides.
//! - `telemetry`: tracing setup (`RUST_LOG` wins).
//! - `app`: broker → MetaManager wiring and bounded shutdown.
//! - `observe`: `/metrics`, `/healthz`, `/readyz` on `observe.address`.
//! - `cli`: the operator's commands: `get` (the store, read-only) and `status` (the endpoints).
//! - `shutdown`: SIGINT / SIGTERM.
//!
//! The cloud side for Kubernetes is its own binary, `edgemeta-edgecontroller`
//! (`src/bin/edgemeta-edgecontroller.rs`), so a node does not carry kube-rs.

mod app;
mod cli;
mod config;
mod limits;
mod observe;
mod shutdown;
mod telemetry;

use std::path::PathBuf;

/// jemalloc: the store thread and the broker allocate and free per message, and glibc's
/// malloc cost about a quarter more CPU per P1 message (docs/benchmarks.md, "jemalloc").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
            let hash = edgemeta_broker::hash_password(password).map_err(anyhow::Error::msg)?;
            println!("{hash}");
            Ok(())
        }
        Command::Edged { config } => {
            let settings = config::Settings::load(config.as_deref())?;
            telemetry::init(&settings.log, None);
            let edged = settings.edged()?;
            let root = settings.broker.topic_root.clone();
            shutdown::until_signal("edgemeta-edged", |cancel| async move {
                edgemeta_edged::run(edged, &root, cancel).await
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
            let mut settings = config::Settings::load(config.as_deref())?;
            let registry = if settings.observe.enabled {
                Some(observe::Registry::new()?)
            } else {
                None
            };
            telemetry::init(&settings.log, registry.as_ref().map(|r| r.error_layer()));
            limits::fit(&mut settings.broker.max_connections)?;
            if settings.observe.stage_clocks {
                edgemeta_broker::stages::switch_on();
            }
            let served = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .worker_threads(settings.workers())
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
