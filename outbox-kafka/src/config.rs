//! librdkafka properties: safety rules, secret redaction.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use outbox_core::ConfigError;

use crate::partitioner::{Partitioner, DEFAULT_PARTITIONER};

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

/// Largest `max.in.flight.requests.per.connection` that keeps order with idempotence.
pub const MAX_IN_FLIGHT_LIMIT: u32 = 5;

/// What the publisher does with a producer property a user sets.
#[derive(Clone, Copy)]
enum Rule {
    /// Connection, security or logging: any value, also given to the publisher's admin client.
    Connection,
    /// Producer tuning (batching, buffering, compression, sizes): any value librdkafka accepts.
    Tuning,
    /// Accepted only with values that keep the guarantees; the check explains a refusal.
    Guarded(fn(&str, &str) -> Result<(), String>),
    /// Never accepted; the text is the reason and the fix.
    Refused(&'static str),
}

/// The producer properties a user may set. Anything not listed is refused, so a property that
/// librdkafka adds later (or one nobody thought about, like `delivery.report.only.error`) can
/// not weaken ordering, acknowledgement or delivery reports unnoticed.
const PRODUCER_PROPERTIES: &[(&str, Rule)] = &[
    // Guarantees: forced by the publisher, overridable only with values that keep them.
    ("enable.idempotence", Rule::Guarded(must_be_true)),
    ("acks", Rule::Guarded(must_be_all)),
    ("request.required.acks", Rule::Guarded(must_be_all)),
    ("max.in.flight.requests.per.connection", Rule::Guarded(in_flight_limit)),
    ("max.in.flight", Rule::Guarded(in_flight_limit)),
    ("retries", Rule::Guarded(retries_positive)),
    ("message.send.max.retries", Rule::Guarded(retries_positive)),
    ("partitioner", Rule::Guarded(key_partitioner)),
    ("delivery.report.only.error", Rule::Guarded(reports_for_all)),
    ("allow.auto.create.topics", Rule::Guarded(no_auto_create)),
    ("message.timeout.ms", Rule::Guarded(milliseconds)),
    ("delivery.timeout.ms", Rule::Guarded(milliseconds)),
    // Set through the builder, or not supported.
    ("bootstrap.servers", Rule::Refused("set the brokers with KafkaPublisher::builder(brokers, ..), not as a property")),
    ("metadata.broker.list", Rule::Refused("set the brokers with KafkaPublisher::builder(brokers, ..), not as a property")),
    ("transactional.id", Rule::Refused("the outbox publisher is idempotent, not transactional (the outbox table is the transaction); remove the property")),
    ("transaction.timeout.ms", Rule::Refused("the outbox publisher is idempotent, not transactional; remove the property")),
    // Producer tuning.
    ("message.max.bytes", Rule::Tuning),
    ("message.copy.max.bytes", Rule::Tuning),
    ("queue.buffering.max.messages", Rule::Tuning),
    ("queue.buffering.max.kbytes", Rule::Tuning),
    ("queue.buffering.max.ms", Rule::Tuning),
    ("linger.ms", Rule::Tuning),
    ("queue.buffering.backpressure.threshold", Rule::Tuning),
    ("batch.num.messages", Rule::Tuning),
    ("batch.size", Rule::Tuning),
    ("compression.codec", Rule::Tuning),
    ("compression.type", Rule::Tuning),
    ("compression.level", Rule::Tuning),
    ("request.timeout.ms", Rule::Tuning),
    ("topic.metadata.propagation.max.ms", Rule::Tuning),
    // Connection, metadata, logging.
    ("client.id", Rule::Connection),
    ("client.rack", Rule::Connection),
    ("client.dns.lookup", Rule::Connection),
    ("receive.message.max.bytes", Rule::Connection),
    ("metadata.recovery.strategy", Rule::Connection),
    ("metadata.recovery.rebootstrap.trigger.ms", Rule::Connection),
    ("topic.metadata.refresh.interval.ms", Rule::Connection),
    ("topic.metadata.refresh.fast.interval.ms", Rule::Connection),
    ("topic.metadata.refresh.sparse", Rule::Connection),
    ("metadata.max.age.ms", Rule::Connection),
    ("socket.timeout.ms", Rule::Connection),
    ("socket.send.buffer.bytes", Rule::Connection),
    ("socket.receive.buffer.bytes", Rule::Connection),
    ("socket.keepalive.enable", Rule::Connection),
    ("socket.nagle.disable", Rule::Connection),
    ("socket.max.fails", Rule::Connection),
    ("socket.connection.setup.timeout.ms", Rule::Connection),
    ("connections.max.idle.ms", Rule::Connection),
    ("broker.address.ttl", Rule::Connection),
    ("broker.address.family", Rule::Connection),
    ("reconnect.backoff.ms", Rule::Connection),
    ("reconnect.backoff.max.ms", Rule::Connection),
    ("retry.backoff.ms", Rule::Connection),
    ("retry.backoff.max.ms", Rule::Connection),
    ("api.version.request.timeout.ms", Rule::Connection),
    ("enable.metrics.push", Rule::Connection),
    ("debug", Rule::Connection),
    ("log_level", Rule::Connection),
    ("log.thread.name", Rule::Connection),
    ("log.connection.close", Rule::Connection),
    // Security.
    ("security.protocol", Rule::Connection),
    ("ssl.cipher.suites", Rule::Connection),
    ("ssl.curves.list", Rule::Connection),
    ("ssl.sigalgs.list", Rule::Connection),
    ("ssl.key.location", Rule::Connection),
    ("ssl.key.password", Rule::Connection),
    ("ssl.key.pem", Rule::Connection),
    ("ssl.certificate.location", Rule::Connection),
    ("ssl.certificate.pem", Rule::Connection),
    ("ssl.ca.location", Rule::Connection),
    ("ssl.ca.pem", Rule::Connection),
    ("ssl.ca.certificate.stores", Rule::Connection),
    ("ssl.crl.location", Rule::Connection),
    ("ssl.keystore.location", Rule::Connection),
    ("ssl.keystore.password", Rule::Connection),
    ("ssl.providers", Rule::Connection),
    ("enable.ssl.certificate.verification", Rule::Connection),
    ("ssl.endpoint.identification.algorithm", Rule::Connection),
    ("https.ca.location", Rule::Connection),
    ("https.ca.pem", Rule::Connection),
    ("sasl.mechanisms", Rule::Connection),
    ("sasl.mechanism", Rule::Connection),
    ("sasl.username", Rule::Connection),
    ("sasl.password", Rule::Connection),
    ("sasl.kerberos.service.name", Rule::Connection),
    ("sasl.kerberos.principal", Rule::Connection),
    ("sasl.kerberos.kinit.cmd", Rule::Connection),
    ("sasl.kerberos.keytab", Rule::Connection),
    ("sasl.kerberos.min.time.before.relogin", Rule::Connection),
    ("sasl.oauthbearer.config", Rule::Connection),
    ("enable.sasl.oauthbearer.unsecure.jwt", Rule::Connection),
    ("sasl.oauthbearer.method", Rule::Connection),
    ("sasl.oauthbearer.client.id", Rule::Connection),
    ("sasl.oauthbearer.client.secret", Rule::Connection),
    ("sasl.oauthbearer.client.credentials.client.id", Rule::Connection),
    ("sasl.oauthbearer.client.credentials.client.secret", Rule::Connection),
    ("sasl.oauthbearer.scope", Rule::Connection),
    ("sasl.oauthbearer.extensions", Rule::Connection),
    ("sasl.oauthbearer.token.endpoint.url", Rule::Connection),
    ("sasl.oauthbearer.grant.type", Rule::Connection),
    ("sasl.oauthbearer.assertion.algorithm", Rule::Connection),
    ("sasl.oauthbearer.assertion.private.key.file", Rule::Connection),
    ("sasl.oauthbearer.assertion.private.key.passphrase", Rule::Connection),
    ("sasl.oauthbearer.assertion.private.key.pem", Rule::Connection),
    ("sasl.oauthbearer.assertion.file", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.aud", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.exp.seconds", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.iss", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.jti.include", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.nbf.seconds", Rule::Connection),
    ("sasl.oauthbearer.assertion.claim.sub", Rule::Connection),
    ("sasl.oauthbearer.assertion.jwt.template.file", Rule::Connection),
    ("sasl.oauthbearer.metadata.authentication.type", Rule::Connection),
];

/// Properties the publisher always sets, whatever the user gave (a user value that passed its
/// [`Rule::Guarded`] check may replace the in-flight limit and the partitioner, see
/// [`ProducerProperties`]).
pub(crate) const PRODUCER_FORCED: [(&str, &str); 5] = [
    ("enable.idempotence", "true"),
    ("acks", "all"),
    ("max.in.flight.requests.per.connection", "5"),
    ("delivery.report.only.error", "false"),
    ("allow.auto.create.topics", "false"),
];

fn rule(key: &str) -> Option<Rule> {
    PRODUCER_PROPERTIES
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, r)| *r)
}

/// Whether the outbox publisher accepts producer property `key` at all (some are accepted only
/// with certain values). Everything else is refused at build: the list is an allow-list.
pub fn is_allowed_producer_property(key: &str) -> bool {
    matches!(
        rule(&key.trim().to_ascii_lowercase()),
        Some(Rule::Connection | Rule::Tuning | Rule::Guarded(_))
    )
}

fn must_be_true(key: &str, value: &str) -> Result<(), String> {
    match parse_bool(key, value) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!(
            "{key}={value} is refused: the outbox publisher requires enable.idempotence=true so \
             that the producer's own retries cannot reorder or duplicate records of one \
             aggregate. Remove the property (it is forced to true)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn must_be_all(key: &str, value: &str) -> Result<(), String> {
    let v = value.trim().to_ascii_lowercase();
    if v == "all" || v == "-1" {
        return Ok(());
    }
    Err(format!(
        "{key}={value} is refused: the outbox publisher requires acks=all (a record is reported \
         published only when every in-sync replica has it). Remove the property (it is forced \
         to all)"
    ))
}

fn in_flight_limit(key: &str, value: &str) -> Result<(), String> {
    let n: u32 = value
        .trim()
        .parse()
        .map_err(|_| format!("{key}={value:?} is not a positive integer; use 1..={MAX_IN_FLIGHT_LIMIT} or remove the property"))?;
    if n == 0 || n > MAX_IN_FLIGHT_LIMIT {
        return Err(format!(
            "{key}={n} is refused: with enable.idempotence the producer keeps order only with \
             1..={MAX_IN_FLIGHT_LIMIT} requests in flight per connection. Use a value in \
             1..={MAX_IN_FLIGHT_LIMIT}, or remove the property (default {MAX_IN_FLIGHT_LIMIT})"
        ));
    }
    Ok(())
}

fn retries_positive(key: &str, value: &str) -> Result<(), String> {
    match value.trim().parse::<i64>() {
        Ok(n) if n >= 1 => Ok(()),
        Ok(_) => Err(format!(
            "{key}={value} is refused: the idempotent producer needs retries to keep its \
             ordering guarantee. Remove the property (librdkafka's default retries without \
             limit, bounded by the delivery timeout)"
        )),
        Err(_) => Err(format!(
            "{key}={value:?} is not an integer; remove the property"
        )),
    }
}

fn key_partitioner(_key: &str, value: &str) -> Result<(), String> {
    Partitioner::parse(value)
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn reports_for_all(key: &str, value: &str) -> Result<(), String> {
    match parse_bool(key, value) {
        Ok(false) => Ok(()),
        Ok(true) => Err(format!(
            "{key}={value} is refused: a record counts as published only from its successful \
             delivery report; without those reports every delivered record would look failed, \
             be published again and finally be parked although the broker has it. Remove the \
             property (it is forced to false)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn no_auto_create(key: &str, value: &str) -> Result<(), String> {
    match parse_bool(key, value) {
        Ok(false) => Ok(()),
        Ok(true) => Err(format!(
            "{key}={value} is refused: outbox topics are created on purpose (with their \
             partition count and retention) and checked at start; a missing topic is reported, \
             not created. Remove the property (it is forced to false)"
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn milliseconds(key: &str, value: &str) -> Result<(), String> {
    parse_ms(key, value).map(|_| ()).map_err(|e| e.to_string())
}

/// User producer properties that passed the allow-list, with what the publisher reads from them.
#[derive(Debug)]
pub(crate) struct ProducerProperties {
    /// The delivery timeout, if set as `message.timeout.ms` / `delivery.timeout.ms`.
    pub(crate) delivery_timeout: Option<Duration>,
    /// The partitioner (the default when not set).
    pub(crate) partitioner: Partitioner,
    /// A stricter in-flight limit, if set.
    pub(crate) max_in_flight: Option<u32>,
}

/// Checks user producer properties against the allow-list and the guarded values.
///
/// Every refused property is named in one error, each with its reason and the fix.
pub(crate) fn check_producer_overrides(p: &Properties) -> Result<ProducerProperties, ConfigError> {
    let mut refusals = Vec::new();
    for (key, value) in p.iter() {
        match rule(key) {
            Some(Rule::Connection | Rule::Tuning) => {}
            Some(Rule::Guarded(check)) => {
                if let Err(why) = check(key, value) {
                    refusals.push(why);
                }
            }
            Some(Rule::Refused(why)) => refusals.push(format!("{key} is refused: {why}")),
            None => refusals.push(format!(
                "{key} is refused: it is not on the outbox publisher's allow-list of producer \
                 properties (connection, security, logging and tuning settings that cannot \
                 weaken ordering, acknowledgements or delivery reports). Remove it; if you need \
                 it, have it reviewed and added to the allow-list in outbox-kafka"
            )),
        }
    }
    if !refusals.is_empty() {
        return Err(ConfigError::new(refusals.join("; ")));
    }
    let mut delivery_timeout = None;
    for key in ["message.timeout.ms", "delivery.timeout.ms"] {
        if let Some(v) = p.get(key) {
            let d = parse_ms(key, v)?;
            if delivery_timeout.is_some_and(|t| t != d) {
                return Err(ConfigError::new(
                    "message.timeout.ms and delivery.timeout.ms are aliases and disagree; set \
                     one of them (or use KafkaPublisherBuilder::delivery_timeout)",
                ));
            }
            delivery_timeout = Some(d);
        }
    }
    let partitioner = match p.get("partitioner") {
        Some(v) => Partitioner::parse(v)?,
        None => DEFAULT_PARTITIONER,
    };
    let mut max_in_flight = None;
    for key in ["max.in.flight.requests.per.connection", "max.in.flight"] {
        if let Some(v) = p.get(key) {
            let n: u32 = v
                .trim()
                .parse()
                .map_err(|_| ConfigError::new(format!("{key}={v:?} is not a positive integer")))?;
            if max_in_flight.is_some_and(|m| m != n) {
                return Err(ConfigError::new(
                    "max.in.flight.requests.per.connection and max.in.flight are aliases and \
                     disagree; set one of them",
                ));
            }
            max_in_flight = Some(n);
        }
    }
    Ok(ProducerProperties {
        delivery_timeout,
        partitioner,
        max_in_flight,
    })
}

/// The user properties the publisher's admin client shares with its producer: connection,
/// security and logging only.
pub(crate) fn connection_properties(p: &Properties) -> impl Iterator<Item = (&str, &str)> {
    p.iter()
        .filter(|(k, _)| matches!(rule(k), Some(Rule::Connection)))
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
        // (key, value, a word the refusal must contain besides the key: reason or fix)
        let refused: &[(&str, &str, &str)] = &[
            ("enable.idempotence", "false", "Remove the property"),
            ("enable.idempotence", "0", "forced to true"),
            ("enable.idempotence", "maybe", "not a boolean"),
            ("acks", "1", "forced to all"),
            ("acks", "0", "acks=all"),
            ("request.required.acks", "1", "acks=all"),
            ("max.in.flight.requests.per.connection", "6", "1..=5"),
            ("max.in.flight.requests.per.connection", "0", "1..=5"),
            ("max.in.flight", "1000000", "1..=5"),
            ("max.in.flight", "many", "1..=5"),
            ("retries", "0", "Remove the property"),
            ("message.send.max.retries", "0", "needs retries"),
            ("partitioner", "random", "ignores the key"),
            ("partitioner", "whatever", "hash the key"),
            ("delivery.report.only.error", "true", "delivery report"),
            ("delivery.report.only.error", "1", "forced to false"),
            ("allow.auto.create.topics", "true", "forced to false"),
            ("transactional.id", "x", "not transactional"),
            ("transaction.timeout.ms", "1000", "not transactional"),
            ("bootstrap.servers", "elsewhere:9092", "builder"),
            ("metadata.broker.list", "elsewhere:9092", "builder"),
            ("message.timeout.ms", "soon", "milliseconds"),
            // Not on the allow-list: refused by default, whatever the value.
            ("queuing.strategy", "lifo", "allow-list"),
            ("plugin.library.paths", "/tmp/x.so", "allow-list"),
            ("enable.gapless.guarantee", "false", "allow-list"),
            ("no.such.property", "1", "allow-list"),
        ];
        for (k, v, word) in refused {
            let err = check_producer_overrides(&props(&[(k, v)])).unwrap_err();
            let shown = err.to_string();
            assert!(shown.contains(k), "{k}={v}: {shown}");
            assert!(shown.contains(word), "{k}={v}: {shown}");
            assert!(!is_allowed_producer_property(k) || !shown.contains("allow-list"));
        }
        let allowed: &[(&str, &str)] = &[
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("acks", "-1"),
            ("max.in.flight.requests.per.connection", "5"),
            ("max.in.flight.requests.per.connection", "1"),
            ("retries", "10"),
            ("partitioner", "consistent_random"),
            ("partitioner", "murmur2"),
            ("delivery.report.only.error", "false"),
            ("allow.auto.create.topics", "false"),
            ("linger.ms", "20"),
            ("compression.type", "zstd"),
            ("security.protocol", "sasl_ssl"),
            ("sasl.password", "x"),
            ("debug", "broker"),
        ];
        for (k, v) in allowed {
            assert!(
                check_producer_overrides(&props(&[(k, v)])).is_ok(),
                "{k}={v}"
            );
            assert!(is_allowed_producer_property(k), "{k}");
        }
        let read = check_producer_overrides(&props(&[
            ("delivery.timeout.ms", "1500"),
            ("partitioner", "consistent"),
            ("max.in.flight", "2"),
        ]))
        .unwrap();
        assert_eq!(read.delivery_timeout, Some(Duration::from_millis(1500)));
        assert_eq!(read.partitioner, Partitioner::Consistent);
        assert_eq!(read.max_in_flight, Some(2));
        let defaults = check_producer_overrides(&Properties::default()).unwrap();
        assert_eq!(defaults.partitioner, DEFAULT_PARTITIONER);
        assert_eq!(defaults.delivery_timeout, None);
        assert!(check_producer_overrides(&props(&[
            ("delivery.timeout.ms", "1500"),
            ("message.timeout.ms", "1000")
        ]))
        .is_err());
        // Keys are normalized, so casing cannot slip past the rules.
        assert!(check_producer_overrides(&props(&[(" ACKS", "1")])).is_err());
        assert!(
            check_producer_overrides(&props(&[("Delivery.Report.Only.Error", "true")])).is_err()
        );
        // Every refusal is reported at once.
        let all = check_producer_overrides(&props(&[
            ("acks", "1"),
            ("partitioner", "random"),
            ("frobnicate", "yes"),
        ]))
        .unwrap_err()
        .to_string();
        for k in ["acks=1", "partitioner=random", "frobnicate"] {
            assert!(all.contains(k), "{all}");
        }
    }

    #[test]
    fn only_connection_properties_reach_the_admin_client() {
        let p = props(&[
            ("sasl.password", "x"),
            ("security.protocol", "sasl_plaintext"),
            ("linger.ms", "5"),
            ("partitioner", "murmur2"),
            ("acks", "all"),
        ]);
        let shared: Vec<&str> = connection_properties(&p).map(|(k, _)| k).collect();
        assert_eq!(shared, vec!["sasl.password", "security.protocol"]);
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
