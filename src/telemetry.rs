//! Logging: structured `tracing` to stderr; `RUST_LOG` overrides the configured filter. With
//! metrics on, a second layer counts events by `error_code`, whatever the log filter shows.

use std::io::IsTerminal as _;

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

use crate::config::{LogConfig, LogFormat};
use crate::observe::ErrorLayer;

/// Installs the global subscriber. Colour codes only reach a terminal: in a file, a pipe or a
/// journal they would be noise in every line.
pub fn init(config: &LogConfig, errors: Option<ErrorLayer>) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match config.format {
        LogFormat::Text => fmt.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).boxed(),
    };
    // Codes are logged at warn or error: the counting layer sees those even when the log
    // filter hides them.
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(errors.map(|layer| layer.with_filter(LevelFilter::WARN)))
        .init();
}
