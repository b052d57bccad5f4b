//! Logging: structured `tracing` to stderr; `RUST_LOG` overrides the configured filter. With
//! metrics on, a second layer counts events by `error_code`, whatever the log filter shows.

use std::io::IsTerminal as _;

use tracing_subscriber::filter::filter_fn;
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
    // The counting layer sees every event with an `error_code`, even one the log filter hides,
    // and nothing else: decided once per callsite, so no other event or span costs anything
    // more than before.
    let coded = filter_fn(|m| m.is_event() && m.fields().field("error_code").is_some());
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(errors.map(|layer| layer.with_filter(coded)))
        .init();
}
