//! Logging setup: `tracing` with `RUST_LOG` filtering and `LOG_FORMAT=json|plain`.

use tracing_subscriber::{fmt, EnvFilter};

/// Installs the global subscriber. Logs go to stderr.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second init (tests) is harmless: keep the first subscriber.
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}
