//! The commands, each a testable function of the configuration and its options.

pub mod check;
pub mod cleanup;
pub mod consumer_parked;
pub mod help;
pub mod migrate;
pub mod migrate_info;
pub mod parked;
pub mod reconcile;
pub mod relay;
pub mod replay;
pub mod status;
pub mod topics;

use chrono::{DateTime, Utc};

use crate::config::{Config, Dur};
use crate::error::CliError;
use crate::output::Output;

/// `outbox config`: the effective configuration, secrets redacted: as text in the layout of
/// `outbox.toml` (sections, `key = value`; a value that is not set is shown as a comment), or
/// with `--json` as one JSON document.
pub fn show_config(config: &Config, out: &Output) -> Result<(), CliError> {
    let value = serde_json::to_value(config).map_err(|e| CliError::failed(e.to_string()))?;
    if out.json {
        out.json(&value);
    } else {
        print!("{}", config_text(&value));
    }
    Ok(())
}

/// The configuration as text laid out like `outbox.toml`: top-level values first, then one
/// `[section]` per table (nested ones as `[a.b]`), arrays of tables as `[[name]]`.
pub fn config_text(value: &serde_json::Value) -> String {
    use serde_json::Value;
    fn key(k: &str) -> String {
        if !k.is_empty()
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            k.to_owned()
        } else {
            Value::String(k.to_owned()).to_string()
        }
    }
    fn is_table(v: &Value) -> bool {
        v.is_object()
    }
    fn is_table_array(v: &Value) -> bool {
        matches!(v, Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_object))
    }
    fn scalar(v: &Value) -> String {
        match v {
            Value::Array(a) => format!("[{}]", a.iter().map(scalar).collect::<Vec<_>>().join(", ")),
            Value::Object(m) => format!(
                "{{ {} }}",
                m.iter()
                    .map(|(k, v)| format!("{} = {}", key(k), scalar(v)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            other => other.to_string(),
        }
    }
    fn section(path: &str, map: &serde_json::Map<String, Value>, text: &mut String) {
        for (k, v) in map {
            if is_table(v) || is_table_array(v) {
                continue;
            }
            match v {
                Value::Null => text.push_str(&format!("# {} is not set\n", key(k))),
                v => text.push_str(&format!("{} = {}\n", key(k), scalar(v))),
            }
        }
        for (k, v) in map {
            let name = if path.is_empty() {
                key(k)
            } else {
                format!("{path}.{}", key(k))
            };
            match v {
                Value::Object(m) => {
                    text.push_str(&format!("\n[{name}]\n"));
                    section(&name, m, text);
                }
                Value::Array(items) if is_table_array(v) => {
                    for item in items {
                        text.push_str(&format!("\n[[{name}]]\n"));
                        if let Value::Object(m) = item {
                            section(&name, m, text);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    let mut text = String::from(
        "# the effective configuration (file, environment, flags); secrets shown as ***\n",
    );
    match value {
        Value::Object(m) => section("", m, &mut text),
        other => text.push_str(&format!("{}\n", scalar(other))),
    }
    text
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
    fn the_configuration_text_is_laid_out_like_the_file() {
        let v = serde_json::json!({
            "top": 1,
            "database": {"url": "postgres://u:***@h/db", "password": "***", "max": null},
            "kafka": {"producer": {"linger.ms": "5"}},
            "consumers": [{"name": "a"}, {"name": "b"}],
            "empty": [],
        });
        let text = config_text(&v);
        for line in [
            "top = 1",
            "empty = []",
            "[database]",
            "url = \"postgres://u:***@h/db\"",
            "# max is not set",
            "[kafka]",
            "[kafka.producer]",
            "\"linger.ms\" = \"5\"",
            "[[consumers]]",
            "name = \"a\"",
            "name = \"b\"",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} missing: {text}");
        }
        assert_eq!(text.matches("[[consumers]]").count(), 2, "{text}");
    }

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
