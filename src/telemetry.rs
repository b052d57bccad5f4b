//! Logging: structured `tracing` to stderr; `RUST_LOG` overrides the configured filter.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber.
pub fn init(configured: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(configured))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
