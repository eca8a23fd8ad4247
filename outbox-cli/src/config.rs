//! Configuration: defaults < TOML file < environment < command-line flags, layered with
//! [figment]. Every key, its default and its environment variable are listed in the crate docs
//! (`docs/config.md`).
//!
//! Secrets (the database password, whether in the URL or in `database.password`, and every
//! secret librdkafka property such as `sasl.password`) are held in [`Secret`] / [`DatabaseUrl`],
//! whose `Debug` and `Display` never show them, and errors are built from the redacted forms.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::CliError;

/// The default configuration file, read when it exists and no `--config` is given.
pub const DEFAULT_CONFIG_FILE: &str = "outbox.toml";
/// Prefix of the environment variables (`OUTBOX_RELAY__WORKERS=4` sets `relay.workers`).
pub const ENV_PREFIX: &str = "OUTBOX_";

/// A duration written as `"30s"`, `"5m"`, `"1h 30m"`, `"7d"` (humantime).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

impl Dur {
    /// From seconds.
    pub const fn secs(s: u64) -> Self {
        Self(Duration::from_secs(s))
    }
    /// From milliseconds.
    pub const fn millis(ms: u64) -> Self {
        Self(Duration::from_millis(ms))
    }
}

impl fmt::Debug for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = Scalar::deserialize(d)?.0;
        humantime::parse_duration(raw.trim()).map(Dur).map_err(|e| {
            serde::de::Error::custom(format!(
                "{raw:?} is not a duration ({e}); write e.g. \"500ms\", \"30s\", \"5m\", \"7d\""
            ))
        })
    }
}

/// A scalar read as text (TOML and environment values may be strings, numbers or booleans).
struct Scalar(String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_owned()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_char<E: serde::de::Error>(self, v: char) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// A secret value: `Debug` and `Display` print `***`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a value.
    pub fn new(v: impl Into<String>) -> Self {
        Self(v.into())
    }
    /// The value, for the one place that needs it (a connection).
    pub fn expose(&self) -> &str {
        &self.0
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "***" })
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Serialized only for the defaults layer and `outbox config`, never in clear.
        s.serialize_str(if self.0.is_empty() { "" } else { "***" })
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self(Scalar::deserialize(d)?.0))
    }
}

/// A PostgreSQL URL that may carry a password: shown only as [`DatabaseUrl::redacted`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct DatabaseUrl(String);

impl DatabaseUrl {
    /// Wraps a URL.
    pub fn new(v: impl Into<String>) -> Self {
        Self(v.into())
    }
    /// The URL, for the connection only.
    pub fn expose(&self) -> &str {
        &self.0
    }
    /// Whether no URL is configured.
    pub fn is_empty(&self) -> bool {
        self.0.trim().is_empty()
    }
    /// The URL with its password (and any `password=` parameter) replaced by `***`.
    pub fn redacted(&self) -> String {
        redact_url(&self.0)
    }
}

/// Replaces the password of `scheme://user:password@host/...` and `password=` query parameters.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest_start = scheme_end + 3;
        let authority_end = out[rest_start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| rest_start + i);
        if let Some(at) = out[rest_start..authority_end].rfind('@') {
            let userinfo = &out[rest_start..rest_start + at];
            if let Some(colon) = userinfo.find(':') {
                let start = rest_start + colon + 1;
                let end = rest_start + at;
                out.replace_range(start..end, "***");
            }
        }
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let redacted: Vec<String> = query
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => kv.to_owned(),
            })
            .collect();
        out = format!("{head}{}", redacted.join("&"));
    }
    out
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for DatabaseUrl {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for DatabaseUrl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self(Scalar::deserialize(d)?.0))
    }
}

/// librdkafka properties (`"linger.ms" = 5`); secret ones (`sasl.password`, ...) are redacted in
/// `Debug` and serialization.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Props(pub BTreeMap<String, String>);

/// Whether a `[kafka] producer` property is a secret: librdkafka's secret keys, by
/// `outbox-kafka`'s list. A build without the feature `kafka` cannot tell, and redacts
/// every value (its `[kafka]` section is never used).
fn secret_prop(key: &str) -> bool {
    #[cfg(feature = "kafka")]
    return outbox_kafka::is_secret_key(key);
    #[cfg(not(feature = "kafka"))]
    {
        let _ = key;
        true
    }
}

impl fmt::Debug for Props {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        for (k, v) in &self.0 {
            if secret_prop(k) {
                m.entry(k, &"***");
            } else {
                m.entry(k, v);
            }
        }
        m.finish()
    }
}

impl Serialize for Props {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            let shown = if secret_prop(k) { "***" } else { v };
            m.serialize_entry(k, shown)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Props {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: BTreeMap<String, Scalar> = BTreeMap::deserialize(d)?;
        Ok(Self(raw.into_iter().map(|(k, v)| (k, v.0)).collect()))
    }
}

/// How the relay claims events.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClaimModeName {
    /// Lease with fencing (`outbox.lease`).
    Lease,
    /// Locked transaction held until the batch is marked.
    Locked,
}

/// The whole configuration. See the crate docs for every key.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Config {
    /// `[database]`
    pub database: DatabaseConfig,
    /// `[outbox]`
    pub outbox: OutboxConfig,
    /// `[relay]`
    pub relay: RelayConfig,
    /// `[transport]`: which broker the relay publishes to.
    pub transport: TransportSection,
    /// `[kafka]`
    pub kafka: KafkaConfig,
    /// `[nats]` (read when `transport.kind = "nats"`)
    pub nats: NatsConfig,
    /// `[rabbitmq]` (read when `transport.kind = "rabbitmq"`)
    pub rabbitmq: RabbitConfig,
    /// `[http]`
    pub http: HttpConfig,
    /// `[console]`: the web console (`outbox console`, and `/console` on the relay's HTTP port).
    pub console: ConsoleConfig,
    /// `[cleanup]`
    pub cleanup: CleanupConfig,
    /// `[status]`
    pub status: StatusConfig,
    /// `[backpressure]`
    pub backpressure: BackpressureConfig,
    /// `[retention]`
    pub retention: RetentionConfig,
    /// `[[consumers]]`
    pub consumers: Vec<ConsumerConfig>,
    /// `[reconcile]`
    pub reconcile: ReconcileConfig,
    /// `[log]`
    pub log: LogConfig,
}

/// `[database]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DatabaseConfig {
    /// PostgreSQL URL. Env: `DATABASE_URL` or `OUTBOX_DATABASE__URL`.
    pub url: DatabaseUrl,
    /// Password, replacing any in the URL (keep it out of the URL and the file: set
    /// `OUTBOX_DATABASE__PASSWORD`).
    pub password: Secret,
    /// Time allowed to open the first connection before the command fails. Default 5 s.
    pub connect_timeout: Dur,
    /// Pool size; 0 = sized from `relay.workers`. Default 0.
    pub max_connections: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: DatabaseUrl::default(),
            password: Secret::default(),
            connect_timeout: Dur::secs(5),
            max_connections: 0,
        }
    }
}

/// `[outbox]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct OutboxConfig {
    /// Schema of the outbox tables. Default `outbox` (the library's default).
    pub schema: String,
    /// Outbox table. Default `outbox_events`.
    pub table: String,
    /// `lease` or `locked`. Default `lease`.
    pub claim_mode: ClaimModeName,
    /// Lease duration (lease mode). Must outlive `kafka.delivery_timeout` + `relay.lease_margin`.
    /// Default 45 s.
    pub lease: Dur,
    /// Locked mode: the server ends a claim transaction idle this long. Default 5 min.
    pub locked_max_hold: Dur,
    /// How long a head that skips a version is held before it is parked. Default 5 min.
    pub gap_timeout: Dur,
    /// Accept the lowest pending version of an aggregate the store has no state for as its
    /// first, instead of holding it as a version gap unless it is version 1 (for aggregates
    /// adopted with a history, and after the upgrade to migration 3 when cleanup had removed
    /// every row of quiet aggregates). Default false.
    pub accept_first_version: bool,
    /// Cleanup copies rows into `<table>_archive` before deleting them. Default false.
    pub archive: bool,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            schema: outbox_postgres::DEFAULT_SCHEMA.to_owned(),
            table: outbox_postgres::DEFAULT_OUTBOX_TABLE.to_owned(),
            claim_mode: ClaimModeName::Lease,
            lease: Dur::secs(45),
            locked_max_hold: Dur::secs(300),
            gap_timeout: Dur::secs(300),
            accept_first_version: false,
            archive: false,
        }
    }
}

/// The shortest `relay.heartbeat_interval`.
pub const MIN_HEARTBEAT: Duration = Duration::from_millis(100);
/// The longest `relay.heartbeat_interval`.
pub const MAX_HEARTBEAT: Duration = Duration::from_secs(300);

/// `[relay]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Identity in leases and logs; workers append `-<n>`. Default `<hostname>-<pid>`.
    pub owner: String,
    /// Relay loops in this process (each claims its own batches). Default 2.
    pub workers: u16,
    /// Most events per claim. Default 500.
    pub batch_size: usize,
    /// Longest run per aggregate (`outbox_core::RelayConfig::run`): up to this many
    /// consecutive versions of one aggregate published in one claim, each once the one
    /// before it is acknowledged. Default 1 (runs off); 1..=10000. A store without runs
    /// (MariaDB) hands out heads only whatever this says.
    pub run: usize,
    /// Longest time a cycle spends on its runs' waves after the first
    /// (`outbox_core::RelayConfig::run_budget`); the rest of each run is released unsent and
    /// sent by a later cycle. Default 5 ms; 1 ms..=60 s.
    pub run_budget: Dur,
    /// Claim the next batch while a full one is published. Default true.
    pub prefetch: bool,
    /// With `prefetch`: once a batch that was not full is published, claim the next one while
    /// its completion is written (`outbox_core::RelayConfig::early_claim`). Default true.
    pub early_claim: bool,
    /// Shortest idle sleep. Default 10 ms.
    pub idle_min: Dur,
    /// Longest idle sleep (fallback polling when wake-ups are lost). Default 1 s.
    pub idle_max: Dur,
    /// Lease time that must be left beyond the delivery timeout to publish. Default 2 s.
    pub lease_margin: Dur,
    /// Failed attempts (the record's own failures) before an event is parked. Default 12.
    pub max_attempts: u32,
    /// First retry backoff ceiling. Default 200 ms.
    pub retry_base: Dur,
    /// Largest retry backoff ceiling. Default 60 s.
    pub retry_max: Dur,
    /// First pause of the circuit breaker. Default 500 ms.
    pub circuit_base: Dur,
    /// Longest pause of the circuit breaker. Default 30 s.
    pub circuit_max: Dur,
    /// Longest a shutdown waits for in-flight batches before leaving them to lease expiry.
    /// Default 60 s.
    pub shutdown_timeout: Dur,
    /// How often backlog gauges (and `/readyz`) are refreshed. Default 5 s.
    pub stats_interval: Dur,
    /// How often each worker heartbeats in the relay registry (`<table>_relays`). A relay
    /// whose heartbeat is older than three intervals is stale (`outbox status`). Default 5 s;
    /// 100 ms..=5 min.
    pub heartbeat_interval: Dur,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            owner: String::new(),
            workers: 2,
            batch_size: 500,
            run: 1,
            run_budget: Dur(outbox_core::DEFAULT_RUN_BUDGET),
            prefetch: true,
            early_claim: true,
            idle_min: Dur::millis(10),
            idle_max: Dur::secs(1),
            lease_margin: Dur::secs(2),
            max_attempts: 12,
            retry_base: Dur::millis(200),
            retry_max: Dur::secs(60),
            circuit_base: Dur::millis(500),
            circuit_max: Dur::secs(30),
            shutdown_timeout: Dur::secs(60),
            stats_interval: Dur::secs(5),
            heartbeat_interval: Dur::secs(5),
        }
    }
}

/// The transport the relay publishes through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TransportKind {
    /// Kafka (`[kafka]`), the default.
    #[default]
    Kafka,
    /// NATS JetStream (`[nats]`).
    Nats,
    /// RabbitMQ (`[rabbitmq]`).
    #[serde(rename = "rabbitmq")]
    RabbitMq,
}

impl TransportKind {
    /// The name as written in the configuration.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::Nats => "nats",
            Self::RabbitMq => "rabbitmq",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `[transport]`
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct TransportSection {
    /// `kafka` (default), `nats` or `rabbitmq`. Env: `OUTBOX_TRANSPORT__KIND`.
    pub kind: TransportKind,
}

/// Where a NATS subject carries the aggregate id (`outbox_nats::SubjectMapping`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectMappingName {
    /// `<prefix>.<aggregate_type>` (or the route).
    #[default]
    AggregateType,
    /// `<prefix>.<aggregate_type>.<aggregate_id>` (or `<route>.<aggregate_id>`).
    AggregateTypeAndId,
}

/// `[nats]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct NatsConfig {
    /// Server URLs, comma-separated (required when `transport.kind = "nats"`). Env: `NATS_URL`
    /// or `OUTBOX_NATS__SERVERS`. Passwords in them are never printed.
    pub servers: ServerList,
    /// Subject of aggregate types without a route: `<prefix>.<aggregate_type>`. Default
    /// `outbox`.
    pub subject_prefix: String,
    /// `aggregate_type` (default) or `aggregate_type_and_id`.
    pub subject_mapping: SubjectMappingName,
    /// Aggregate type → subject.
    pub routes: BTreeMap<String, String>,
    /// From the start of a batch to its last `PubAck`. Default 10 s.
    pub delivery_timeout: Dur,
    /// Connecting and each request of the stream check. Default 5 s.
    pub connect_timeout: Dur,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: ServerList::default(),
            subject_prefix: "outbox".to_owned(),
            subject_mapping: SubjectMappingName::AggregateType,
            routes: BTreeMap::new(),
            delivery_timeout: Dur::secs(10),
            connect_timeout: Dur::secs(5),
        }
    }
}

/// What a RabbitMQ routing key is (`outbox_rabbitmq::RoutingKey`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutingKeyName {
    /// The aggregate type (or its route).
    #[default]
    AggregateType,
    /// The aggregate id (for an `x-consistent-hash` exchange).
    AggregateId,
}

/// The exchange type `check` and the relay expect (`outbox_rabbitmq::ExchangeKind`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExchangeKindName {
    /// `topic`.
    #[default]
    Topic,
    /// `direct`.
    Direct,
    /// `fanout`.
    Fanout,
    /// `headers`.
    Headers,
    /// `x-consistent-hash`.
    #[serde(rename = "x-consistent-hash")]
    ConsistentHash,
}

/// `[rabbitmq]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RabbitConfig {
    /// AMQP URI (required when `transport.kind = "rabbitmq"`). Env: `AMQP_URL` or
    /// `OUTBOX_RABBITMQ__URI`. Its password is never printed.
    pub uri: DatabaseUrl,
    /// A named, durable exchange. Default `outbox`.
    pub exchange: String,
    /// The exchange type expected: `topic` (default), `direct`, `fanout`, `headers`,
    /// `x-consistent-hash`.
    pub exchange_kind: ExchangeKindName,
    /// `aggregate_type` (default) or `aggregate_id`.
    pub routing_key: RoutingKeyName,
    /// Aggregate type → routing key.
    pub routes: BTreeMap<String, String>,
    /// From the start of a batch to its last confirm. Default 10 s.
    pub delivery_timeout: Dur,
    /// Connecting and each request of the exchange check. Default 5 s.
    pub connect_timeout: Dur,
    /// Larger messages fail as `record_too_large` before they are sent. Default 16 MiB.
    pub max_message_bytes: usize,
}

impl Default for RabbitConfig {
    fn default() -> Self {
        Self {
            uri: DatabaseUrl::default(),
            exchange: "outbox".to_owned(),
            exchange_kind: ExchangeKindName::Topic,
            routing_key: RoutingKeyName::AggregateType,
            routes: BTreeMap::new(),
            delivery_timeout: Dur::secs(10),
            connect_timeout: Dur::secs(5),
            max_message_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Comma-separated server URLs that may carry passwords: shown only with each password
/// replaced by `***`.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ServerList(String);

impl ServerList {
    /// Wraps a list.
    pub fn new(v: impl Into<String>) -> Self {
        Self(v.into())
    }
    /// The list, for the connection only.
    pub fn expose(&self) -> &str {
        &self.0
    }
    /// Whether no server is configured.
    pub fn is_empty(&self) -> bool {
        self.0.trim().is_empty()
    }
    /// Each URL redacted.
    pub fn redacted(&self) -> String {
        self.0
            .split(',')
            .map(|u| redact_url(u.trim()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl fmt::Debug for ServerList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for ServerList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for ServerList {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for ServerList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self(Scalar::deserialize(d)?.0))
    }
}

/// `[kafka]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct KafkaConfig {
    /// Bootstrap servers. Env: `KAFKA_BROKERS` or `OUTBOX_KAFKA__BROKERS`.
    pub brokers: String,
    /// Topic of aggregate types without a route. Default `outbox-events`.
    pub topic: String,
    /// Aggregate type → topic (routes are by aggregate type, never by event type).
    pub routes: BTreeMap<String, String>,
    /// `message.timeout.ms`. Default 30 s.
    pub delivery_timeout: Dur,
    /// Timeout of metadata and admin requests. Default 10 s.
    pub metadata_timeout: Dur,
    /// `client.id`. Default `outbox-relay`.
    pub client_id: String,
    /// Extra producer properties from the publisher's allow-list (`"linger.ms" = 5`,
    /// `"sasl.password" = "..."`; secrets are never printed).
    pub producer: Props,
    /// Topics (or aggregate types' topics) that carry critical flows: `outbox check` warns when
    /// one of them lives on a single replica or `min.insync.replicas` < 2.
    pub critical_topics: Vec<String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            brokers: String::new(),
            topic: "outbox-events".to_owned(),
            routes: BTreeMap::new(),
            delivery_timeout: Dur::secs(30),
            metadata_timeout: Dur::secs(10),
            client_id: "outbox-relay".to_owned(),
            producer: Props::default(),
            critical_topics: Vec::new(),
        }
    }
}

/// `[http]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct HttpConfig {
    /// Serve `/metrics`, `/healthz`, `/readyz` from `outbox relay`. Default true.
    pub enabled: bool,
    /// Listen address. Default `127.0.0.1:9464` (loopback: expose it on purpose).
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:9464".to_owned(),
        }
    }
}

/// `[console]`: the web console (see `docs/console.md`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConsoleConfig {
    /// `outbox relay` serves the console under `/console` on `http.listen`. Default true.
    pub enabled: bool,
    /// Listen address of `outbox console`. Default `127.0.0.1:9465` (loopback: anyone who
    /// reaches the port reads the outbox, payloads included; expose it on purpose, behind a
    /// proxy with TLS and authentication).
    pub listen: String,
    /// The token an operator types to retry, discard or re-issue a parked event. Empty (the
    /// default): the console is read-only. Env: `OUTBOX_CONSOLE__OPERATOR_TOKEN`. Never printed.
    pub operator_token: Secret,
    /// How far back the console's charts look. Default 1 h.
    pub history: Dur,
    /// How often `outbox console` samples the backlog for its charts (the relay samples every
    /// `relay.stats_interval`). Default 10 s.
    pub sample_interval: Dur,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: "127.0.0.1:9465".to_owned(),
            operator_token: Secret::default(),
            history: Dur::secs(3600),
            sample_interval: Dur::secs(10),
        }
    }
}

/// `[cleanup]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct CleanupConfig {
    /// The relay deletes finished rows on a schedule. Default true.
    pub enabled: bool,
    /// Published and discarded rows are kept this long (diagnostics, replay). Default 7 days.
    pub retention: Dur,
    /// Schedule of the relay's cleanup. Default 5 min.
    pub interval: Dur,
    /// Rows per transaction. Default 1000.
    pub batch_size: usize,
}

impl Default for CleanupConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            retention: Dur::secs(7 * 86_400),
            interval: Dur::secs(300),
            batch_size: 1000,
        }
    }
}

/// `[status]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct StatusConfig {
    /// Window of the publish latency percentiles and of the created / published counts that
    /// `outbox status` shows (its rate and forecast follow `trend_window`). Default 15 min.
    pub window: Dur,
    /// Window of the backlog trend, from which `outbox_backlog_forecast_seconds`,
    /// `backpressure.min_forecast` and `outbox status`'s rate and forecast are computed
    /// (least-squares slope of the backlog every `relay.stats_interval`; see `trend`).
    /// Default 1 min.
    pub trend_window: Dur,
    /// Backlog (events) at which the outbox is considered full: the forecast says when it is
    /// reached at the current rate. Default 1,000,000.
    pub capacity: u64,
}

impl Default for StatusConfig {
    fn default() -> Self {
        Self {
            window: Dur::secs(900),
            trend_window: Dur::secs(60),
            capacity: 1_000_000,
        }
    }
}

/// `[backpressure]`: thresholds above which appends of non-critical events are refused. The
/// application enforces them (`outbox_core::backpressure`); `status` and `/metrics` show the
/// state.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct BackpressureConfig {
    /// Refuse non-critical events while the backlog is at least this. Default none.
    pub max_backlog: Option<u64>,
    /// ... while the oldest claimable event (`OutboxStats::oldest_claimable_age`) is at least
    /// this old. Default none.
    pub max_age: Option<Dur>,
    /// ... while the backlog reaches `status.capacity` within this at the current rate.
    /// Default none.
    pub min_forecast: Option<Dur>,
    /// Event types that always go in (`payment.*` matches a prefix).
    pub critical_event_types: Vec<String>,
}

/// `[retention]`: the retention chain `outbox check` compares.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RetentionConfig {
    /// Longest consumer lag tolerated before it is an incident. Default 1 day.
    pub max_consumer_lag: Dur,
    /// How far back an operator may replay (`outbox replay`). Default 3 days.
    pub replay_window: Dur,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            max_consumer_lag: Dur::secs(86_400),
            replay_window: Dur::secs(3 * 86_400),
        }
    }
}

/// `[[consumers]]`: a consumer of the outbox's topics, for lag, parked counts, retention checks
/// and reconciliation.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ConsumerConfig {
    /// Inbox consumer name (the dedup key prefix).
    pub name: String,
    /// The consumer on the broker: the Kafka consumer group, the NATS JetStream durable
    /// consumer (on the stream that captures the outbox's subjects), or the RabbitMQ queue.
    /// Default: `name`.
    pub group: String,
    /// Topics it reads. Default: every outbox topic.
    pub topics: Vec<String>,
    /// Its database, when it is not the outbox's.
    pub database_url: DatabaseUrl,
    /// Schema of its inbox. Default `outbox`.
    pub inbox_schema: String,
    /// Its inbox table. Default `processed_events`.
    pub inbox_table: String,
    /// Its inbox deduplication window (the inbox cleanup's retention). Default 14 days.
    pub dedup_retention: Dur,
    /// Its version policy (`reject`, `hold` or `unchecked`), as the consumer's engine is
    /// configured: an operator discard moves the aggregate's applied version only when the
    /// consumer tracks versions. Default `reject`.
    pub version_policy: VersionPolicyName,
}

/// A consumer's version policy (`outbox_inbox::VersionPolicy`), as far as operator actions
/// need it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VersionPolicyName {
    /// Gaps are parked at once (versions tracked).
    #[default]
    Reject,
    /// Gaps are held, then parked (versions tracked).
    Hold,
    /// No version tracking.
    Unchecked,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            group: String::new(),
            topics: Vec::new(),
            database_url: DatabaseUrl::default(),
            inbox_schema: outbox_postgres::DEFAULT_SCHEMA.to_owned(),
            inbox_table: outbox_postgres::DEFAULT_INBOX_TABLE.to_owned(),
            dedup_retention: Dur::secs(14 * 86_400),
            version_policy: VersionPolicyName::Reject,
        }
    }
}

impl ConsumerConfig {
    /// The Kafka group, NATS durable consumer or RabbitMQ queue (`group`, else `name`).
    pub fn group(&self) -> &str {
        if self.group.is_empty() {
            &self.name
        } else {
            &self.group
        }
    }
}

/// `[reconcile]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ReconcileConfig {
    /// Interval of the report. Default 1 h.
    pub interval: Dur,
    /// Events younger than this are still in flight, not missing. Default 5 min.
    pub grace: Dur,
    /// Per event type: the user's count of state transitions.
    pub checks: Vec<ReconcileCheck>,
}

impl Default for ReconcileConfig {
    fn default() -> Self {
        Self {
            interval: Dur::secs(3600),
            grace: Dur::secs(300),
            checks: Vec::new(),
        }
    }
}

/// `[[reconcile.checks]]`
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ReconcileCheck {
    /// The event type the transitions should have produced.
    pub event_type: String,
    /// SQL returning one count: the transitions in `[$1, $2)` (two `timestamptz`), run in a
    /// read-only transaction on the outbox's database.
    pub query: String,
}

/// `[log]`
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct LogConfig {
    /// `text` or `json` (for log shippers). Default `text`.
    pub format: String,
    /// Filter (`RUST_LOG` syntax); `RUST_LOG` wins when set. Default `info`.
    pub level: String,
    /// `auto` (colour on a terminal only), `always`, `never`. Default `auto`.
    pub color: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: "text".to_owned(),
            level: "info".to_owned(),
            color: "auto".to_owned(),
        }
    }
}

/// Where the configuration came from, for messages.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// The file read, if any.
    pub file: Option<PathBuf>,
}

impl Config {
    /// Loads defaults < `file` (or `outbox.toml` when it exists) < environment < `overrides`
    /// (a nested map of flag values, e.g. `{"relay": {"workers": 4}}`).
    pub fn load(
        file: Option<&Path>,
        overrides: &serde_json::Value,
    ) -> Result<(Self, Sources), CliError> {
        let mut figment = Figment::from(Serialized::defaults(Config::default()));
        let mut sources = Sources::default();
        match file {
            Some(path) => {
                if !path.is_file() {
                    return Err(CliError::config(
                        format!("configuration file {} not found", path.display()),
                        "pass an existing file with --config, or leave it out to use defaults, \
                         the environment and flags",
                    ));
                }
                figment = figment.merge(Toml::file(path));
                sources.file = Some(path.to_owned());
            }
            None => {
                let default = Path::new(DEFAULT_CONFIG_FILE);
                if default.is_file() {
                    figment = figment.merge(Toml::file(default));
                    sources.file = Some(default.to_owned());
                }
            }
        }
        figment = figment
            .merge(
                Env::raw()
                    .only(&["DATABASE_URL"])
                    .map(|_| "database.url".into()),
            )
            .merge(
                Env::raw()
                    .only(&["KAFKA_BROKERS"])
                    .map(|_| "kafka.brokers".into()),
            )
            .merge(
                Env::raw()
                    .only(&["NATS_URL"])
                    .map(|_| "nats.servers".into()),
            )
            .merge(
                Env::raw()
                    .only(&["AMQP_URL"])
                    .map(|_| "rabbitmq.uri".into()),
            )
            // Only nested keys (`OUTBOX_RELAY__WORKERS`): other `OUTBOX_*` variables (test
            // switches, `OUTBOX_CONFIG`) are not configuration keys.
            .merge(
                Env::prefixed(ENV_PREFIX)
                    .filter(|k| k.as_str().contains("__"))
                    .split("__"),
            )
            .merge(Serialized::defaults(overrides.clone()));
        let config: Config = figment.extract().map_err(|e| {
            // figment's messages name the key and its source; values are never secrets here
            // except through a type error on a secret key, which shows no value.
            let mut msg = String::new();
            for (i, err) in e.into_iter().enumerate() {
                if i > 0 {
                    msg.push_str("; ");
                }
                msg.push_str(&describe_figment_error(&err));
            }
            CliError::config(
                format!("invalid configuration: {msg}"),
                "see `outbox --help` and the configuration reference in the crate docs \
                 (every key, default and environment variable)",
            )
        })?;
        config.validate()?;
        Ok((config, sources))
    }

    /// Checks what can be checked without connecting anywhere.
    pub fn validate(&self) -> Result<(), CliError> {
        let o = &self.outbox;
        outbox_postgres::validate_identifier(
            "outbox.schema",
            &o.schema,
            outbox_postgres::MAX_IDENTIFIER_LEN,
        )
        .map_err(|e| CliError::config(e.message, "use a plain lowercase identifier"))?;
        outbox_postgres::validate_identifier(
            "outbox.table",
            &o.table,
            outbox_postgres::MAX_TABLE_NAME_LEN,
        )
        .map_err(|e| CliError::config(e.message, "use a plain lowercase identifier"))?;
        for c in &self.consumers {
            if c.name.trim().is_empty() {
                return Err(CliError::config(
                    "a [[consumers]] entry has no name",
                    "set name = \"<inbox consumer name>\"",
                ));
            }
            for (what, v, max) in [
                (
                    "inbox_schema",
                    &c.inbox_schema,
                    outbox_postgres::MAX_IDENTIFIER_LEN,
                ),
                (
                    "inbox_table",
                    &c.inbox_table,
                    outbox_postgres::MAX_TABLE_NAME_LEN,
                ),
            ] {
                outbox_postgres::validate_identifier(&format!("consumers.{what}"), v, max)
                    .map_err(|e| CliError::config(e.message, "use a plain lowercase identifier"))?;
            }
        }
        // Without the feature `kafka` the section is never used (a Kafka kind is refused
        // below, by `transport::validate`).
        #[cfg(feature = "kafka")]
        {
            outbox_kafka::validate_topic_name("kafka.topic", &self.kafka.topic)
                .map_err(|e| CliError::config(e.0, "use 1..=249 of [a-zA-Z0-9._-]"))?;
            for (agg, topic) in &self.kafka.routes {
                outbox_kafka::validate_topic_name(&format!("kafka.routes.{agg}"), topic)
                    .map_err(|e| CliError::config(e.0, "use 1..=249 of [a-zA-Z0-9._-]"))?;
            }
        }
        match self.log.format.as_str() {
            "text" | "json" => {}
            other => {
                return Err(CliError::config(
                    format!("log.format = {other:?} is not text or json"),
                    "use \"text\" or \"json\"",
                ))
            }
        }
        match self.log.color.as_str() {
            "auto" | "always" | "never" => {}
            other => {
                return Err(CliError::config(
                    format!("log.color = {other:?} is not auto, always or never"),
                    "use \"auto\" (colour on a terminal only), \"always\" or \"never\"",
                ))
            }
        }
        if self.relay.workers == 0 || self.relay.workers > 64 {
            return Err(CliError::config(
                format!("relay.workers = {} is outside 1..=64", self.relay.workers),
                "set relay.workers between 1 and 64",
            ));
        }
        let hb = self.relay.heartbeat_interval.0;
        if hb < MIN_HEARTBEAT || hb > MAX_HEARTBEAT {
            return Err(CliError::config(
                format!(
                    "relay.heartbeat_interval = {} is outside 100ms..=5min",
                    self.relay.heartbeat_interval
                ),
                "set relay.heartbeat_interval between 100ms and 5min (default 5s); a relay is \
                 reported stale after three intervals without a heartbeat",
            ));
        }
        if self.cleanup.batch_size == 0 {
            return Err(CliError::config(
                "cleanup.batch_size must be at least 1",
                "set cleanup.batch_size (e.g. 1000)",
            ));
        }
        // Only the chosen transport's section must be complete: a `[nats]` section beside
        // `kind = "kafka"` is kept for a later switch.
        crate::transport::validate(self)
    }

    /// The database URL, or a configuration error saying how to set it.
    pub fn database_url(&self) -> Result<&DatabaseUrl, CliError> {
        if self.database.url.is_empty() {
            return Err(CliError::config(
                "no database URL configured",
                "set DATABASE_URL, OUTBOX_DATABASE__URL, [database] url in the file, or \
                 --database-url",
            ));
        }
        Ok(&self.database.url)
    }

    /// The brokers, or a configuration error saying how to set them.
    pub fn brokers(&self) -> Result<&str, CliError> {
        if self.kafka.brokers.trim().is_empty() {
            return Err(CliError::config(
                "no Kafka brokers configured",
                "set KAFKA_BROKERS, OUTBOX_KAFKA__BROKERS, [kafka] brokers in the file, or \
                 --brokers",
            ));
        }
        Ok(&self.kafka.brokers)
    }

    /// Every topic the outbox publishes to (default topic and routes).
    pub fn topics(&self) -> Vec<String> {
        let mut t: Vec<String> = self.kafka.routes.values().cloned().collect();
        t.push(self.kafka.topic.clone());
        t.sort();
        t.dedup();
        t
    }

    /// The relay owner (`relay.owner`, else `<hostname>-<pid>`).
    pub fn owner(&self) -> String {
        if !self.relay.owner.trim().is_empty() {
            return self.relay.owner.clone();
        }
        format!("{}-{}", hostname(), std::process::id())
    }
}

fn describe_figment_error(e: &figment::Error) -> String {
    let path = e.path.join(".");
    let source = e
        .metadata
        .as_ref()
        .map(|m| {
            m.source
                .as_ref()
                .map_or_else(|| m.name.to_string(), |s| format!("{} ({s})", m.name))
        })
        .unwrap_or_default();
    let what = match &e.kind {
        figment::error::Kind::UnknownField(field, _) => format!("unknown key {field:?}"),
        kind => kind.to_string(),
    };
    match (path.is_empty(), source.is_empty()) {
        (true, true) => what,
        (false, true) => format!("{path}: {what}"),
        (true, false) => format!("{what} in {source}"),
        (false, false) => format!("{path}: {what} in {source}"),
    }
}

/// This host's name (`/etc/hostname`, else `$HOSTNAME`, else `outbox`).
pub fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "outbox".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        let table = [
            (
                "postgres://app:hunter2@db:5432/shop",
                "postgres://app:***@db:5432/shop",
            ),
            ("postgres://app@db/shop", "postgres://app@db/shop"),
            (
                "postgres://db/shop?user=app&password=hunter2&sslmode=require",
                "postgres://db/shop?user=app&password=***&sslmode=require",
            ),
            ("postgresql://a:b:c@h/d", "postgresql://a:***@h/d"),
        ];
        for (url, want) in table {
            assert_eq!(redact_url(url), want, "{url}");
            let u = DatabaseUrl::new(url);
            assert!(!format!("{u:?} {u}").contains("hunter2"));
        }
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "*** ***");
    }

    #[test]
    fn durations_parse_from_strings_and_show_a_hint() {
        let d: Dur = serde_json::from_value(serde_json::json!("1m 30s")).unwrap();
        assert_eq!(d.0, Duration::from_secs(90));
        let err = serde_json::from_value::<Dur>(serde_json::json!("soon")).unwrap_err();
        assert!(err.to_string().contains("\"30s\""), "{err}");
    }

    #[test]
    fn secret_producer_properties_are_redacted() {
        let mut p = Props::default();
        p.0.insert("sasl.password".into(), "hunter2".into());
        p.0.insert("linger.ms".into(), "5".into());
        let shown = format!("{p:?} {}", serde_json::to_string(&p).unwrap());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("linger.ms"));
    }
}
