//! `edgemeta`: KubeEdge's edge MetaManager on an embedded MQTT broker.
//!
//! # Layout
//! - `config`: settings from `conf/edge.yaml` or `--config`, plus `EDGEMETA_*` overrides.
//! - `telemetry`: tracing setup (`RUST_LOG` wins).
//! - `app`: broker → MetaManager wiring and bounded shutdown.
//! - `shutdown`: SIGINT / SIGTERM.

mod app;
mod config;
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
            telemetry::init(&settings.log);
            let edged = settings.edged()?;
            let root = settings.broker.topic_root.clone();
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("edgemeta-edged")
                .build()?
                .block_on(async move {
                    let cancel = tokio_util::sync::CancellationToken::new();
                    let stop = cancel.clone();
                    tokio::spawn(async move {
                        shutdown::signal().await;
                        stop.cancel();
                    });
                    edgemeta_edged::run(edged, &root, cancel).await
                })?;
            Ok(())
        }
        Command::Run { config } => {
            let settings = config::Settings::load(config.as_deref())?;
            telemetry::init(&settings.log);
            let served = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .thread_name("edgemeta")
                .build()?
                .block_on(app::run(settings, shutdown::signal()));
            if let Err(e) = served {
                eprintln!("Error: {e:?}");
                std::process::exit(i32::from(app::exit_code(&e)));
            }
            Ok(())
        }
    }
}
