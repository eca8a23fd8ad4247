//! librdkafka properties: safety rules, secret redaction.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_core::ConfigError;

/// Extra librdkafka properties, as `key = value` strings.
///
/// `Debug` prints the keys of secret properties (passwords, keys, tokens, SASL settings) with
/// their values replaced by `***`, so a configuration can be logged safely.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Properties(BTreeMap<String, String>);

impl Properties {
    /// Sets `key` (lower-cased and trimmed, as librdkafka treats keys) to `value`.
    pub fn set(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.0
            .insert(key.into().trim().to_ascii_lowercase(), value.into());
    }

    /// The value of `key`, if set.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        self.0.remove(key)
    }

    /// All properties, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

/// `true` for properties whose value must never be logged.
pub fn is_secret_key(key: &str) -> bool {
    const MARKERS: [&str; 7] = [
        "password",
        "secret",
        "token",
        "sasl.oauthbearer.config",
        "sasl.username",
        "ssl.key.pem",
        "ssl_key",
    ];
    let key = key.to_ascii_lowercase();
    MARKERS.iter().any(|m| key.contains(m)) || key == "ssl.key.location"
}

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.0 {
            if is_secret_key(k) {
                m.entry(k, &"***");
            } else {
                m.entry(k, v);
            }
        }
        m.finish()
    }
}

/// A [`ConfigError`] for a configuration librdkafka refused. librdkafka's message quotes the
/// offending value, so every secret value of `cc` is masked in it.
pub(crate) fn refused(
    what: &str,
    err: &rdkafka::error::KafkaError,
    cc: &rdkafka::ClientConfig,
) -> ConfigError {
    let mut message = err.to_string();
    // config_map() masks librdkafka's own list of sensitive keys; read the real values by key.
    for key in cc.config_map().keys() {
        match cc.get(key) {
            Some(value) if is_secret_key(key) && !value.is_empty() => {
                message = message.replace(value, "***");
            }
            _ => {}
        }
    }
    ConfigError::new(format!(
        "librdkafka refused the {what} configuration: {message}"
    ))
}

/// librdkafka log level forwarded to `tracing`: warnings and worse, or everything when the
/// user asked for librdkafka's `debug` contexts.
pub(crate) fn log_level(p: &Properties) -> rdkafka::config::RDKafkaLogLevel {
    if p.get("debug").is_some_and(|v| !v.trim().is_empty()) {
        rdkafka::config::RDKafkaLogLevel::Debug
    } else {
        rdkafka::config::RDKafkaLogLevel::Warning
    }
}

fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        other => Err(ConfigError::new(format!(
            "{key}={other:?} is not a boolean"
        ))),
    }
}

fn parse_ms(key: &str, value: &str) -> Result<Duration, ConfigError> {
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| ConfigError::new(format!("{key}={value:?} is not a number of milliseconds")))
}

/// Producer properties that the outbox's ordering guarantee depends on.
pub(crate) const PRODUCER_ENFORCED: [(&str, &str); 3] = [
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "5"),
];

/// Largest `max.in.flight.requests.per.connection` that keeps order with idempotence.
pub const MAX_IN_FLIGHT_LIMIT: u32 = 5;

/// Checks user overrides of producer properties and extracts the delivery timeout, if set there.
///
/// Rejects anything that breaks per-key ordering under the producer's own retries or the
/// at-least-once contract: idempotence off, acks other than all, more than 5 requests in flight,
/// retries disabled, transactions (not supported by this publisher).
pub(crate) fn check_producer_overrides(p: &Properties) -> Result<Option<Duration>, ConfigError> {
    for key in ["enable.idempotence"] {
        if let Some(v) = p.get(key) {
            if !parse_bool(key, v)? {
                return Err(ConfigError::new(format!(
                    "{key}={v} is refused: the outbox publisher requires enable.idempotence=true \
                     so that the producer's own retries cannot reorder or duplicate records of \
                     one aggregate"
                )));
            }
        }
    }
    for key in ["acks", "request.required.acks"] {
        if let Some(v) = p.get(key) {
            let v = v.trim().to_ascii_lowercase();
            if v != "all" && v != "-1" {
                return Err(ConfigError::new(format!(
                    "{key}={v} is refused: the outbox publisher requires acks=all (a record is \
                     reported published only when every in-sync replica has it)"
                )));
            }
        }
    }
    for key in ["max.in.flight.requests.per.connection", "max.in.flight"] {
        if let Some(v) = p.get(key) {
            let n: u32 = v
                .trim()
                .parse()
                .map_err(|_| ConfigError::new(format!("{key}={v:?} is not a positive integer")))?;
            if n == 0 || n > MAX_IN_FLIGHT_LIMIT {
                return Err(ConfigError::new(format!(
                    "{key}={n} is refused: with enable.idempotence the producer keeps order only \
                     with 1..={MAX_IN_FLIGHT_LIMIT} requests in flight per connection"
                )));
            }
        }
    }
    for key in ["retries", "message.send.max.retries"] {
        if let Some(v) = p.get(key) {
            if v.trim() == "0" {
                return Err(ConfigError::new(format!(
                    "{key}=0 is refused: the idempotent producer needs retries to keep its \
                     ordering guarantee"
                )));
            }
        }
    }
    if p.get("transactional.id").is_some() {
        return Err(ConfigError::new(
            "transactional.id is refused: the outbox publisher is idempotent, not transactional \
             (the outbox table is the transaction)",
        ));
    }
    let mut timeout = None;
    for key in ["message.timeout.ms", "delivery.timeout.ms"] {
        if let Some(v) = p.get(key) {
            let d = parse_ms(key, v)?;
            if timeout.is_some_and(|t| t != d) {
                return Err(ConfigError::new(
                    "message.timeout.ms and delivery.timeout.ms are aliases and disagree",
                ));
            }
            timeout = Some(d);
        }
    }
    Ok(timeout)
}

/// Checks user overrides of consumer properties.
pub(crate) fn check_consumer_overrides(p: &Properties) -> Result<(), ConfigError> {
    for key in ["enable.auto.commit", "enable.auto.offset.store"] {
        if let Some(v) = p.get(key) {
            if parse_bool(key, v)? {
                return Err(ConfigError::new(format!(
                    "{key}=true is refused: offsets move only through explicit commits after \
                     the effect's transaction committed"
                )));
            }
        }
    }
    if p.get("group.id").is_some() {
        return Err(ConfigError::new(
            "group.id is set through the builder, not as a property",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(pairs: &[(&str, &str)]) -> Properties {
        let mut p = Properties::default();
        for (k, v) in pairs {
            p.set(*k, *v);
        }
        p
    }

    #[test]
    fn producer_rules_table() {
        let refused: &[(&str, &str)] = &[
            ("enable.idempotence", "false"),
            ("enable.idempotence", "0"),
            ("enable.idempotence", "maybe"),
            ("acks", "1"),
            ("acks", "0"),
            ("request.required.acks", "1"),
            ("max.in.flight.requests.per.connection", "6"),
            ("max.in.flight.requests.per.connection", "0"),
            ("max.in.flight", "1000000"),
            ("max.in.flight", "many"),
            ("retries", "0"),
            ("message.send.max.retries", "0"),
            ("transactional.id", "x"),
            ("message.timeout.ms", "soon"),
        ];
        for (k, v) in refused {
            let err = check_producer_overrides(&props(&[(k, v)])).unwrap_err();
            assert!(err.to_string().contains(k), "{k}={v}: {err}");
        }
        let allowed: &[(&str, &str)] = &[
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("acks", "-1"),
            ("max.in.flight.requests.per.connection", "5"),
            ("max.in.flight.requests.per.connection", "1"),
            ("linger.ms", "20"),
            ("compression.type", "zstd"),
        ];
        for (k, v) in allowed {
            assert!(
                check_producer_overrides(&props(&[(k, v)])).is_ok(),
                "{k}={v}"
            );
        }
        assert_eq!(
            check_producer_overrides(&props(&[("delivery.timeout.ms", "1500")])).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert!(check_producer_overrides(&props(&[
            ("delivery.timeout.ms", "1500"),
            ("message.timeout.ms", "1000")
        ]))
        .is_err());
        // Keys are normalized, so casing cannot slip past the rules.
        assert!(check_producer_overrides(&props(&[(" ACKS", "1")])).is_err());
    }

    #[test]
    fn consumer_rules_table() {
        for (k, v) in [
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
            ("group.id", "g"),
        ] {
            assert!(check_consumer_overrides(&props(&[(k, v)])).is_err(), "{k}");
        }
        assert!(check_consumer_overrides(&props(&[("enable.auto.commit", "false")])).is_ok());
    }

    #[test]
    fn refusals_never_quote_secrets() {
        let mut cc = rdkafka::ClientConfig::new();
        cc.set("sasl.password", "hunter2");
        let err = rdkafka::error::KafkaError::ClientConfig(
            rdkafka::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID,
            "Invalid value \"hunter2\"".into(),
            "sasl.password".into(),
            "hunter2".into(),
        );
        let shown = refused("producer", &err, &cc).to_string();
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("sasl.password"), "{shown}");
    }

    #[test]
    fn secrets_are_redacted() {
        let p = props(&[
            ("sasl.password", "hunter2"),
            ("sasl.username", "svc-user"),
            ("ssl.key.password", "k3y"),
            ("sasl.oauthbearer.client.secret", "s3cret"),
            ("ssl.key.pem", "-----BEGIN PRIVATE KEY-----"),
            ("linger.ms", "7"),
        ]);
        let shown = format!("{p:?}");
        for secret in ["hunter2", "svc-user", "k3y", "s3cret", "PRIVATE KEY"] {
            assert!(!shown.contains(secret), "{secret} leaked: {shown}");
        }
        assert!(shown.contains("sasl.password"));
        assert!(shown.contains("\"7\""));
    }
}
