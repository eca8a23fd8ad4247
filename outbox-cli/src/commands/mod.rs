//! The commands, each a testable function of the configuration and its options.

pub mod check;
pub mod cleanup;
pub mod consumer_parked;
pub mod migrate;
pub mod parked;
pub mod reconcile;
pub mod relay;
pub mod replay;
pub mod status;

use chrono::{DateTime, Utc};

use crate::config::{Config, Dur};
use crate::error::CliError;
use crate::output::Output;

/// `outbox config`: the effective configuration, secrets redacted.
pub fn show_config(config: &Config, out: &Output) -> Result<(), CliError> {
    let value = serde_json::to_value(config).map_err(|e| CliError::failed(e.to_string()))?;
    if out.json {
        out.json(&value);
    } else {
        println!(
            "{}",
            serde_json::to_string_pretty(&value).unwrap_or_default()
        );
    }
    Ok(())
}

/// Parses a duration flag (`30s`, `5m`).
pub fn parse_duration(flag: &str, s: &str) -> Result<Dur, CliError> {
    humantime::parse_duration(s.trim()).map(Dur).map_err(|e| {
        CliError::config(
            format!("{flag} {s:?} is not a duration: {e}"),
            "write e.g. 500ms, 30s, 5m, 24h, 7d",
        )
    })
}

/// Parses a time flag: RFC 3339, or a duration meaning that long ago.
pub fn parse_time(flag: &str, s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, CliError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(t.with_timezone(&Utc));
    }
    match humantime::parse_duration(s.trim()) {
        Ok(d) => chrono::Duration::from_std(d)
            .ok()
            .and_then(|d| now.checked_sub_signed(d))
            .ok_or_else(|| {
                CliError::config(
                    format!("{flag} {s:?} is too far back"),
                    "use a shorter duration",
                )
            }),
        Err(_) => Err(CliError::config(
            format!("{flag} {s:?} is neither a time nor a duration"),
            "write an RFC 3339 time (2024-05-01T12:00:00Z) or a duration ago (24h, 7d)",
        )),
    }
}

/// Who acts: `--actor`, else `$USER@<hostname>`.
pub fn actor(given: Option<&str>) -> String {
    if let Some(a) = given.filter(|a| !a.trim().is_empty()) {
        return a.to_owned();
    }
    let user = std::env::var("USER").unwrap_or_else(|_| "operator".into());
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    if host.is_empty() {
        user
    } else {
        format!("{user}@{host}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_parse_as_rfc3339_or_durations_ago() {
        let now = DateTime::parse_from_rfc3339("2024-05-02T00:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let t = parse_time("--since", "24h", now).unwrap();
        assert_eq!(t.to_rfc3339(), "2024-05-01T00:00:00+00:00");
        let t = parse_time("--since", "2024-04-01T10:00:00Z", now).unwrap();
        assert_eq!(t.to_rfc3339(), "2024-04-01T10:00:00+00:00");
        let e = parse_time("--since", "yesterday", now).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.hint.unwrap().contains("RFC 3339"));
    }
}
