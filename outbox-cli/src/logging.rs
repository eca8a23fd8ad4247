//! Logs on stderr: text (ANSI colour only on a terminal, unless configured) or JSON lines for
//! log shippers. `RUST_LOG` wins over the configured level.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogConfig;

/// Installs the global subscriber. `default_level` applies when neither `RUST_LOG` nor
/// `log.level` (or `--log-level`) was given.
pub fn init(log: &LogConfig, level_given: bool, default_level: &str) {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(v),
        _ if level_given => EnvFilter::try_new(&log.level),
        _ => EnvFilter::try_new(default_level),
    }
    .unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = use_color(&log.color, std::io::stderr().is_terminal());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if log.format == "json" {
        builder
            .json()
            .with_current_span(false)
            .with_ansi(false)
            .try_init()
    } else {
        builder.with_ansi(ansi).try_init()
    };
}

/// Whether to colour: `always`, `never`, or `auto` = only on a terminal (and not with
/// `NO_COLOR` set).
pub fn use_color(setting: &str, terminal: bool) -> bool {
    match setting {
        "always" => true,
        "never" => false,
        _ => terminal && std::env::var_os("NO_COLOR").is_none(),
    }
}
