//! The transport the relay publishes through, chosen by `[transport] kind`: Kafka (the
//! default, `[kafka]`), NATS JetStream (`[nats]`, cargo feature `nats`) or RabbitMQ
//! (`[rabbitmq]`, cargo feature `rabbitmq`).
//!
//! The relay stays generic over one concrete publisher type, [`AnyPublisher`], an enum that
//! forwards [`Publisher`] to the adapter it holds: one `match` per batch, no `dyn` on the hot
//! path. The results of a publication pass through untouched (the relay stores each
//! transport's acknowledgement as the adapter reports it).
//!
//! What is checked when:
//!
//! | stage | Kafka | NATS | RabbitMQ |
//! |---|---|---|---|
//! | loading the configuration (every command, no network) | topic names | server URLs, subject prefix and routes, timeouts | URI, exchange name, routes, timeouts |
//! | `relay` / `check` before any network access (exit 2) | brokers set, producer allow-list, lease vs delivery timeout | `nats.servers` set, lease vs delivery timeout | `rabbitmq.uri` set, lease vs delivery timeout |
//! | start of `relay` | topics exist (exit 4), broker reachable (exit 3) | a stream captures every subject (exit 4), server reachable (exit 3); warnings for the duplicate window, storage, replicas, retention | exchange exists, durable, of the configured type (exit 4), broker reachable (exit 3) |
//! | `/readyz` while running | topics present | streams capture the subjects | exchange present and durable |
//!
//! The relay creates none of these; `outbox topics create` does (Kafka topics, the NATS
//! stream, the RabbitMQ exchange; see [`crate::commands::topics`]).
//!
//! Kafka's producer is shared by the relay's workers (one idempotent producer orders per
//! partition); so is the NATS client (one connection keeps publish order). A RabbitMQ
//! publisher runs one batch at a time on its confirm channel, so each worker gets its own
//! publisher (its own connection and channel).

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{async_trait, Envelope, PublishResult, Publisher};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::RecordedTopic;

use crate::commands::check::{Finding, Severity};
use crate::config::{ClaimModeName, Config, TransportKind};
use crate::error::CliError;

/// The publisher of the configured transport: forwards [`Publisher`] to the adapter.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyPublisher {
    /// Kafka (shared by the workers).
    Kafka(Arc<KafkaPublisher>),
    /// NATS JetStream (shared by the workers).
    #[cfg(feature = "nats")]
    Nats(Arc<outbox_nats::NatsPublisher>),
    /// RabbitMQ (one per worker).
    #[cfg(feature = "rabbitmq")]
    RabbitMq(Arc<outbox_rabbitmq::RabbitPublisher>),
}

#[async_trait]
impl Publisher for AnyPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        match self {
            Self::Kafka(p) => p.publish(batch).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish(batch).await,
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(p) => p.publish(batch).await,
        }
    }

    fn delivery_timeout(&self) -> Duration {
        match self {
            Self::Kafka(p) => p.delivery_timeout(),
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.delivery_timeout(),
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(p) => p.delivery_timeout(),
        }
    }
}

/// A started transport: hands each relay worker its publisher and answers `/readyz`.
#[derive(Debug)]
#[non_exhaustive]
pub enum Transport {
    /// Kafka, topics checked.
    Kafka(Arc<KafkaPublisher>),
    /// NATS, streams checked.
    #[cfg(feature = "nats")]
    Nats(Arc<outbox_nats::NatsPublisher>),
    /// RabbitMQ, exchange checked by `first`; `builder` makes the other workers' publishers.
    #[cfg(feature = "rabbitmq")]
    RabbitMq {
        /// The publisher that checked the exchange (the first worker's).
        first: Arc<outbox_rabbitmq::RabbitPublisher>,
        /// For the other workers.
        builder: outbox_rabbitmq::RabbitPublisherBuilder,
    },
}

impl Transport {
    /// The publisher of relay worker `worker` (0-based).
    pub fn worker_publisher(&self, worker: u16) -> Result<AnyPublisher, CliError> {
        Ok(match self {
            Self::Kafka(p) => AnyPublisher::Kafka(p.clone()),
            #[cfg(feature = "nats")]
            Self::Nats(p) => AnyPublisher::Nats(p.clone()),
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq { first, builder } => {
                if worker == 0 {
                    AnyPublisher::RabbitMq(first.clone())
                } else {
                    let p = builder
                        .clone()
                        .connection_name(format!("outbox-relay-{worker}"))
                        .connect()
                        .map_err(|e| rabbit_config_error(&e))?;
                    AnyPublisher::RabbitMq(Arc::new(p))
                }
            }
        })
    }

    /// The Kafka publisher, when the transport is Kafka (topic facts are recorded from it).
    pub fn kafka(&self) -> Option<&Arc<KafkaPublisher>> {
        match self {
            Self::Kafka(p) => Some(p),
            #[allow(unreachable_patterns)]
            _ => None,
        }
    }

    /// The broker's side of `/readyz`: `Ok(detail)` while the destinations are in place.
    pub async fn health(&self, config: &Config) -> Result<String, CliError> {
        match self {
            Self::Kafka(p) => p
                .check_topics()
                .await
                .map(|_| "reachable; topics present".to_owned())
                .map_err(|e| crate::kafka::topic_error(&e, &config.kafka.brokers)),
            #[cfg(feature = "nats")]
            Self::Nats(p) => p
                .check_streams()
                .await
                .map(|r| {
                    let names: Vec<&str> = r.streams.iter().map(|s| s.name.as_str()).collect();
                    format!("reachable; stream(s) {names:?} capture the outbox subjects")
                })
                .map_err(|e| nats_stream_error(&e, config)),
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq { first, .. } => first
                .check_exchange()
                .await
                .map(|r| format!("reachable; exchange {:?} present and durable", r.name))
                .map_err(|e| rabbit_topology_error(&e, config)),
        }
    }
}

/// The kind a command runs with, refused when this build lacks its cargo feature.
pub fn kind(config: &Config) -> Result<TransportKind, CliError> {
    let kind = config.transport.kind;
    let built = match kind {
        TransportKind::Kafka => true,
        TransportKind::Nats => cfg!(feature = "nats"),
        TransportKind::RabbitMq => cfg!(feature = "rabbitmq"),
    };
    if built {
        Ok(kind)
    } else {
        Err(CliError::config(
            format!("transport.kind = \"{kind}\": this build of `outbox` has no {kind} support"),
            format!("build outbox-cli with the cargo feature `{kind}` (on by default)"),
        ))
    }
}

/// What a relay or a check needs of the chosen transport's section that a default cannot
/// give: its address. Other commands run without it.
pub fn require(config: &Config) -> Result<(), CliError> {
    match kind(config)? {
        TransportKind::Kafka => config.brokers().map(drop),
        TransportKind::Nats if config.nats.servers.is_empty() => Err(CliError::config(
            "transport.kind = \"nats\" but no NATS server is configured",
            "set NATS_URL, OUTBOX_NATS__SERVERS or [nats] servers = \"nats://host:4222\"",
        )),
        TransportKind::RabbitMq if config.rabbitmq.uri.is_empty() => Err(CliError::config(
            "transport.kind = \"rabbitmq\" but no RabbitMQ URI is configured",
            "set AMQP_URL, OUTBOX_RABBITMQ__URI or [rabbitmq] uri = \"amqp://user@host:5672/%2f\" \
             (the password in OUTBOX_RABBITMQ__URI or AMQP_URL, not in the file)",
        )),
        _ => Ok(()),
    }
}

/// Checks the chosen transport's section without the network (from `Config::validate`, for
/// every command): the values a publisher would be built from. A missing address is left to
/// [`require`], so that commands that never publish do not need one.
pub fn validate(config: &Config) -> Result<(), CliError> {
    match kind(config)? {
        TransportKind::Kafka => Ok(()),
        #[cfg(feature = "nats")]
        TransportKind::Nats => nats_builder(config, nats_servers_or_placeholder(config))
            .build()
            .map(drop)
            .map_err(|e| nats_config_error(&e)),
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => rabbit_builder(config, rabbit_uri_or_placeholder(config))
            .build()
            .map(drop)
            .map_err(|e| rabbit_config_error(&e)),
        #[allow(unreachable_patterns)]
        _ => Ok(()),
    }
}

/// The transport in one line for logs and `status`: kind, address (redacted) and
/// destinations.
pub fn describe(config: &Config) -> String {
    match config.transport.kind {
        TransportKind::Kafka => format!(
            "kafka {} topics {:?}",
            config.kafka.brokers,
            config.topics()
        ),
        TransportKind::Nats => {
            let mut spaces = vec![format!("{}.>", config.nats.subject_prefix)];
            spaces.extend(config.nats.routes.values().cloned());
            format!("nats {} subjects {spaces:?}", config.nats.servers)
        }
        TransportKind::RabbitMq => format!(
            "rabbitmq {} exchange {:?}",
            config.rabbitmq.uri, config.rabbitmq.exchange
        ),
    }
}

/// The JSON form of [`describe`] for `status --json`.
pub fn describe_json(config: &Config) -> serde_json::Value {
    match config.transport.kind {
        TransportKind::Kafka => serde_json::json!({
            "kind": "kafka", "brokers": config.kafka.brokers, "topics": config.topics(),
        }),
        TransportKind::Nats => serde_json::json!({
            "kind": "nats", "servers": config.nats.servers.redacted(),
            "subject_prefix": config.nats.subject_prefix, "routes": config.nats.routes,
        }),
        TransportKind::RabbitMq => serde_json::json!({
            "kind": "rabbitmq", "uri": config.rabbitmq.uri.redacted(),
            "exchange": config.rabbitmq.exchange, "routes": config.rabbitmq.routes,
        }),
    }
}

#[cfg_attr(not(feature = "nats"), allow(dead_code))]
/// The claim duration a re-send can follow a publication by: the lease, or the locked
/// claim's longest hold.
fn claim_duration(config: &Config) -> Duration {
    match config.outbox.claim_mode {
        ClaimModeName::Lease => config.outbox.lease.0,
        ClaimModeName::Locked => config.outbox.locked_max_hold.0,
    }
}

/// Validates everything about the transport that needs no network (Kafka: the producer's
/// allow-list and guarded values; NATS and RabbitMQ: the publisher's configuration) and
/// returns the publisher's delivery timeout, for the relay's offline check of the claim
/// against it.
pub fn validate_offline(config: &Config) -> Result<Duration, CliError> {
    require(config)?;
    match kind(config)? {
        TransportKind::Kafka => Ok(crate::kafka::build_publisher(config)?.delivery_timeout()),
        #[cfg(feature = "nats")]
        TransportKind::Nats => nats_builder(config, config.nats.servers.expose())
            .build()
            .map(|c| c.delivery_timeout)
            .map_err(|e| nats_config_error(&e)),
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => rabbit_builder(config, config.rabbitmq.uri.expose())
            .build()
            .map(|c| c.delivery_timeout)
            .map_err(|e| rabbit_config_error(&e)),
        #[allow(unreachable_patterns)]
        _ => unreachable!("kind() refuses transports this build lacks"),
    }
}

/// A publisher that only states a delivery timeout: what the relay's constructor reads when
/// the configuration is checked before any connection. It is never asked to publish.
#[derive(Debug, Clone, Copy)]
pub struct OfflinePublisher(pub Duration);

#[async_trait]
impl Publisher for OfflinePublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        batch
            .iter()
            .map(|_| {
                Err(outbox_core::PublishError::new(
                    outbox_core::PublishErrorKind::BrokerUnavailable,
                    "offline configuration check: not connected",
                ))
            })
            .collect()
    }
    fn delivery_timeout(&self) -> Duration {
        self.0
    }
}

/// Starts the configured transport: builds the publisher and checks its destinations
/// (topics, streams, exchange). `recorded`: the topic facts a Kafka relay compares with.
pub async fn start(config: &Config, recorded: &[RecordedTopic]) -> Result<Transport, CliError> {
    require(config)?;
    match kind(config)? {
        TransportKind::Kafka => Ok(Transport::Kafka(Arc::new(
            crate::kafka::start_publisher(config, recorded).await?,
        ))),
        #[cfg(feature = "nats")]
        TransportKind::Nats => {
            let p = nats_builder(config, config.nats.servers.expose())
                .connect()
                .await
                .map_err(|e| nats_start_error(e, config))?;
            let report = p
                .check_streams()
                .await
                .map_err(|e| nats_stream_error(&e, config))?;
            for s in &report.streams {
                tracing::info!(stream = %s.name, subjects = ?s.subjects, duplicate_window = ?s.duplicate_window, storage = ?s.storage, replicas = s.replicas, retention = ?s.retention, "outbox stream checked");
            }
            for w in &report.warnings {
                tracing::warn!("{w}");
            }
            Ok(Transport::Nats(Arc::new(p)))
        }
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => {
            let builder = rabbit_builder(config, config.rabbitmq.uri.expose());
            let first = builder
                .clone()
                .connection_name("outbox-relay-0")
                .connect()
                .map_err(|e| rabbit_config_error(&e))?;
            let r = first
                .check_exchange()
                .await
                .map_err(|e| rabbit_topology_error(&e, config))?;
            tracing::info!(exchange = %r.name, kind = r.kind.as_str(), durable = r.durable, confirms = r.confirms, mandatory = r.mandatory, "outbox exchange checked");
            Ok(Transport::RabbitMq {
                first: Arc::new(first),
                builder,
            })
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!("kind() refuses transports this build lacks"),
    }
}

// ---- NATS -------------------------------------------------------------------------------

#[cfg(feature = "nats")]
fn nats_builder(config: &Config, servers: &str) -> outbox_nats::NatsPublisherBuilder {
    let n = &config.nats;
    let mut b = outbox_nats::NatsPublisher::builder(servers, &n.subject_prefix)
        .delivery_timeout(n.delivery_timeout.0)
        .connect_timeout(n.connect_timeout.0)
        .relay_lease(claim_duration(config))
        .client_name("outbox-relay")
        .subject_mapping(match n.subject_mapping {
            crate::config::SubjectMappingName::AggregateType => {
                outbox_nats::SubjectMapping::AggregateType
            }
            crate::config::SubjectMappingName::AggregateTypeAndId => {
                outbox_nats::SubjectMapping::AggregateTypeAndId
            }
        });
    for (agg, subject) in &n.routes {
        b = b.route_aggregate(agg, subject);
    }
    b
}

#[cfg(feature = "nats")]
fn nats_config_error(e: &outbox_core::ConfigError) -> CliError {
    CliError::config(
        format!("[nats]: {}", e.0),
        "fix [nats] (servers, subject_prefix, routes, delivery_timeout; the delivery timeout \
         must fit in outbox.lease)",
    )
}

#[cfg(feature = "nats")]
fn nats_start_error(e: outbox_nats::StartError, config: &Config) -> CliError {
    match e {
        outbox_nats::StartError::Config(c) => nats_config_error(&c),
        outbox_nats::StartError::Streams(s) => nats_stream_error(&s, config),
        other => CliError::unreachable(
            format!("NATS at {}: {other}", config.nats.servers),
            "check that nats-server runs with JetStream and that nats.servers (NATS_URL) names it",
        ),
    }
}

#[cfg(feature = "nats")]
fn nats_stream_error(e: &outbox_nats::StreamCheckError, config: &Config) -> CliError {
    if e.is_transient() {
        CliError::unreachable(
            format!(
                "cannot reach NATS JetStream at {}: {e}",
                config.nats.servers
            ),
            "check that nats-server runs with JetStream (-js) and that nats.servers (NATS_URL) \
             names it; raise nats.connect_timeout for a slow network",
        )
    } else {
        CliError::not_ready(
            format!("NATS at {}: {e}", config.nats.servers),
            "create a stream capturing the outbox subjects (file storage, a duplicate window at \
             least outbox.lease; `outbox topics create` makes one), or fix \
             nats.subject_prefix / nats.routes",
        )
    }
}

/// `outbox check` on NATS: the publisher's settings (offline), then the streams.
#[cfg(feature = "nats")]
pub(crate) fn nats_static(config: &Config, out: &mut Vec<Finding>) -> Duration {
    match nats_builder(config, nats_servers_or_placeholder(config)).build() {
        Ok(c) => {
            out.push(finding(
                "publisher",
                Severity::Ok,
                format!(
                    "NATS JetStream: a record counts as published only from its PubAck; event \
                     id as Nats-Msg-Id; delivery timeout {}",
                    humantime::format_duration(c.delivery_timeout)
                ),
                None,
            ));
            c.delivery_timeout
        }
        Err(e) => {
            out.push(finding(
                "publisher",
                Severity::Error,
                e.0,
                Some("fix [nats] (the delivery timeout must fit in outbox.lease)".into()),
            ));
            config.nats.delivery_timeout.0
        }
    }
}

#[cfg(feature = "nats")]
fn nats_servers_or_placeholder(config: &Config) -> &str {
    if config.nats.servers.is_empty() {
        "nats://127.0.0.1:4222"
    } else {
        config.nats.servers.expose()
    }
}

/// The stream checks: a stream captures every subject space; its duplicate window against
/// the claim duration, storage, replicas and retention.
#[cfg(feature = "nats")]
pub(crate) async fn nats_checks(config: &Config, out: &mut Vec<Finding>) {
    if let Err(e) = require(config) {
        out.push(finding("stream", Severity::Error, e.message, e.hint));
        return;
    }
    let p = match nats_builder(config, config.nats.servers.expose())
        .connect()
        .await
    {
        Ok(p) => p,
        Err(e) => {
            let e = nats_start_error(e, config);
            out.push(finding("stream", Severity::Error, e.message, e.hint));
            return;
        }
    };
    let report = match p.check_streams().await {
        Ok(r) => r,
        Err(e) => {
            let e = nats_stream_error(&e, config);
            out.push(finding("stream", Severity::Error, e.message, e.hint));
            return;
        }
    };
    let lease = claim_duration(config);
    let d = |d: Duration| humantime::format_duration(d).to_string();
    for s in &report.streams {
        out.push(finding(
            "stream",
            Severity::Ok,
            format!(
                "{}: captures {:?} (subjects {:?}), {} message(s)",
                s.name, s.captures, s.subjects, s.messages
            ),
            None,
        ));
        if s.duplicate_window < lease {
            out.push(finding(
                "duplicate_window",
                Severity::Warning,
                format!(
                    "{}: duplicate window {} is shorter than the claim ({}): a re-send after a \
                     lost PubAck or an expired claim is stored twice (consumers deduplicate, \
                     but the stream holds both)",
                    s.name,
                    d(s.duplicate_window),
                    d(lease)
                ),
                Some(format!(
                    "raise the stream's duplicate_window to at least {} (nats stream edit {} \
                     --dupe-window {})",
                    d(lease),
                    s.name,
                    d(lease)
                )),
            ));
        } else {
            out.push(finding(
                "duplicate_window",
                Severity::Ok,
                format!(
                    "{}: duplicate window {} covers the claim ({})",
                    s.name,
                    d(s.duplicate_window),
                    d(lease)
                ),
                None,
            ));
        }
        match s.storage {
            outbox_nats::Storage::Memory => out.push(finding(
                "storage",
                Severity::Warning,
                format!(
                    "{}: memory storage: a server restart loses acknowledged events",
                    s.name
                ),
                Some("use file storage for outbox streams".into()),
            )),
            _ => out.push(finding(
                "storage",
                Severity::Ok,
                format!("{}: file storage", s.name),
                None,
            )),
        }
        if s.replicas < 2 {
            out.push(finding(
                "replication",
                Severity::Warning,
                format!(
                    "{}: {} replica: losing that server's disk loses acknowledged events",
                    s.name, s.replicas
                ),
                Some("run the stream with 3 replicas in a cluster".into()),
            ));
        } else {
            out.push(finding(
                "replication",
                Severity::Ok,
                format!("{}: {} replicas", s.name, s.replicas),
                None,
            ));
        }
        match s.retention {
            outbox_nats::Retention::Limits => out.push(finding(
                "stream_retention",
                Severity::Ok,
                format!("{}: limits retention (consumers can replay)", s.name),
                None,
            )),
            other => out.push(finding(
                "stream_retention",
                Severity::Warning,
                format!(
                    "{}: {other:?} retention: consumed messages are deleted and cannot be \
                     replayed",
                    s.name
                ),
                Some("use limits retention for outbox streams".into()),
            )),
        }
    }
}

/// The stream `outbox topics create` makes on NATS when none captures the subjects.
#[cfg(feature = "nats")]
#[derive(Clone, Debug, serde::Serialize)]
pub struct NatsStreamSpec {
    /// Stream name.
    pub name: String,
    /// The subject spaces it captures (the publisher's, as the relay's check wants them).
    pub subjects: Vec<String>,
    /// Replicas.
    pub replicas: usize,
    /// Duplicate window (at least the claim, so a re-send is stored once).
    pub duplicate_window: Duration,
    /// `max_age`, by the retention rule.
    pub max_age: Duration,
}

/// The subject spaces the relay publishes to (the stream must capture each).
#[cfg(feature = "nats")]
pub fn nats_subject_spaces(config: &Config) -> Vec<String> {
    nats_builder(config, nats_servers_or_placeholder(config))
        .config()
        .subject_spaces()
}

/// Creates `spec` unless streams capture the subjects already (then `Ok(false)`): file
/// storage, limits retention, discard old. Unreachable: exit 3; refused by the server: exit
/// 2 for replicas a single server cannot hold, else 1 with the server's reason.
#[cfg(feature = "nats")]
pub async fn nats_create_stream(config: &Config, spec: &NatsStreamSpec) -> Result<bool, CliError> {
    use async_nats::jetstream::stream::{
        Config as StreamConfig, DiscardPolicy, RetentionPolicy, StorageType,
    };
    require(config)?;
    let p = nats_builder(config, config.nats.servers.expose())
        .connect()
        .await
        .map_err(|e| nats_start_error(e, config))?;
    match p.check_streams().await {
        Ok(_) => return Ok(false),
        Err(e) if e.is_transient() => return Err(nats_stream_error(&e, config)),
        Err(_) => {}
    }
    let js = async_nats::jetstream::new(p.client().clone());
    let wanted = StreamConfig {
        name: spec.name.clone(),
        subjects: spec.subjects.clone(),
        storage: StorageType::File,
        num_replicas: spec.replicas,
        duplicate_window: spec.duplicate_window,
        max_age: spec.max_age,
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::Old,
        ..Default::default()
    };
    let bound = config.nats.connect_timeout.0 * 2;
    match tokio::time::timeout(bound, js.create_stream(wanted)).await {
        Err(_) => Err(CliError::unreachable(
            format!(
                "NATS at {}: no answer to the stream creation within {}",
                config.nats.servers,
                humantime::format_duration(bound)
            ),
            "check that nats-server runs with JetStream (-js); `outbox topics create` is \
             idempotent: run it again",
        )),
        Ok(Err(e)) => {
            let reason = e.to_string();
            if reason.contains("replicas") {
                Err(CliError::config(
                    format!(
                        "NATS at {} refused stream {}: {reason}",
                        config.nats.servers, spec.name
                    ),
                    "pass --replication-factor 1 for a single server (no JetStream cluster); \
                     run 3 servers for 3 replicas",
                ))
            } else {
                Err(CliError::failed(format!(
                    "NATS at {} refused stream {} (subjects {:?}): {reason}; a stream that \
                     captures part of the subjects or holds the name already is not changed: \
                     fix it or nats.subject_prefix / nats.routes",
                    config.nats.servers, spec.name, spec.subjects
                )))
            }
        }
        Ok(Ok(_)) => Ok(true),
    }
}

// ---- RabbitMQ ---------------------------------------------------------------------------

/// Declares the configured exchange (durable, of `rabbitmq.exchange_kind`) unless it exists
/// (then `Ok(false)`; an existing one of another type or not durable is reported by the
/// relay's check, never redeclared). Unreachable: exit 3.
#[cfg(feature = "rabbitmq")]
pub async fn rabbit_declare_exchange(config: &Config) -> Result<bool, CliError> {
    use lapin::options::ExchangeDeclareOptions;
    use lapin::types::FieldTable;
    require(config)?;
    let first = rabbit_builder(config, config.rabbitmq.uri.expose())
        .connect()
        .map_err(|e| rabbit_config_error(&e))?;
    match first.check_exchange().await {
        Ok(_) => return Ok(false),
        Err(e) if e.is_transient() => return Err(rabbit_topology_error(&e, config)),
        Err(outbox_rabbitmq::TopologyError::Missing { .. }) => {}
        Err(e) => return Err(rabbit_topology_error(&e, config)),
    }
    let timeout = config.rabbitmq.connect_timeout.0;
    let unreachable = |e: String| {
        CliError::unreachable(
            format!("cannot reach RabbitMQ at {}: {e}", config.rabbitmq.uri),
            "check that RabbitMQ runs and that rabbitmq.uri (AMQP_URL) names it",
        )
    };
    let props = lapin::ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name("outbox-topics".into());
    let conn = tokio::time::timeout(
        timeout,
        lapin::Connection::connect(config.rabbitmq.uri.expose(), props),
    )
    .await
    .map_err(|_| unreachable("no AMQP connection in time".into()))?
    .map_err(|e| unreachable(e.to_string()))?;
    let ch = tokio::time::timeout(timeout, conn.create_channel())
        .await
        .map_err(|_| unreachable("no channel in time".into()))?
        .map_err(|e| unreachable(e.to_string()))?;
    let kind = match rabbit_builder(config, "amqp://h").config().exchange_kind {
        outbox_rabbitmq::ExchangeKind::Direct => lapin::ExchangeKind::Direct,
        outbox_rabbitmq::ExchangeKind::Fanout => lapin::ExchangeKind::Fanout,
        outbox_rabbitmq::ExchangeKind::Headers => lapin::ExchangeKind::Headers,
        outbox_rabbitmq::ExchangeKind::ConsistentHash => {
            lapin::ExchangeKind::Custom("x-consistent-hash".into())
        }
        _ => lapin::ExchangeKind::Topic,
    };
    let declared = tokio::time::timeout(
        timeout,
        ch.exchange_declare(
            &config.rabbitmq.exchange,
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .map_err(|_| unreachable("no answer to the exchange declaration in time".into()))?;
    let _ = tokio::time::timeout(timeout, conn.close(200, "declared")).await;
    declared.map_err(|e| {
        CliError::failed(format!(
            "RabbitMQ at {} refused exchange {:?}: {e}",
            config.rabbitmq.uri, config.rabbitmq.exchange
        ))
    })?;
    Ok(true)
}

#[cfg(feature = "rabbitmq")]
fn rabbit_builder(config: &Config, uri: &str) -> outbox_rabbitmq::RabbitPublisherBuilder {
    use crate::config::{ExchangeKindName as K, RoutingKeyName as R};
    let r = &config.rabbitmq;
    let mut b = outbox_rabbitmq::RabbitPublisher::builder(uri, &r.exchange)
        .exchange_kind(match r.exchange_kind {
            K::Topic => outbox_rabbitmq::ExchangeKind::Topic,
            K::Direct => outbox_rabbitmq::ExchangeKind::Direct,
            K::Fanout => outbox_rabbitmq::ExchangeKind::Fanout,
            K::Headers => outbox_rabbitmq::ExchangeKind::Headers,
            K::ConsistentHash => outbox_rabbitmq::ExchangeKind::ConsistentHash,
        })
        .routing_key(match r.routing_key {
            R::AggregateType => outbox_rabbitmq::RoutingKey::AggregateType,
            R::AggregateId => outbox_rabbitmq::RoutingKey::AggregateId,
        })
        .delivery_timeout(r.delivery_timeout.0)
        .connect_timeout(r.connect_timeout.0)
        .max_message_bytes(r.max_message_bytes)
        .connection_name("outbox-relay");
    for (agg, key) in &r.routes {
        b = b.route_aggregate(agg, key);
    }
    b
}

#[cfg(feature = "rabbitmq")]
fn rabbit_config_error(e: &outbox_core::ConfigError) -> CliError {
    CliError::config(
        format!("[rabbitmq]: {}", e.0),
        "fix [rabbitmq] (uri, exchange, routing_key, routes, delivery_timeout)",
    )
}

#[cfg(feature = "rabbitmq")]
fn rabbit_topology_error(e: &outbox_rabbitmq::TopologyError, config: &Config) -> CliError {
    if e.is_transient() {
        CliError::unreachable(
            format!("cannot reach RabbitMQ at {}: {e}", config.rabbitmq.uri),
            "check that RabbitMQ runs and that rabbitmq.uri (AMQP_URL) names it (host, port, \
             vhost, credentials); raise rabbitmq.connect_timeout for a slow network",
        )
    } else {
        CliError::not_ready(
            format!("RabbitMQ at {}: {e}", config.rabbitmq.uri),
            format!(
                "declare exchange {:?} durable, of type {:?}, and bind the consumers' quorum \
                 queues to it; or fix rabbitmq.exchange / rabbitmq.exchange_kind",
                config.rabbitmq.exchange,
                rabbit_builder(config, "amqp://h")
                    .config()
                    .exchange_kind
                    .as_str()
            ),
        )
    }
}

/// The configured URI, or a well-formed stand-in while none is set (the values beside it are
/// checked all the same; [`require`] reports the missing URI where one is needed).
#[cfg(feature = "rabbitmq")]
fn rabbit_uri_or_placeholder(config: &Config) -> &str {
    if config.rabbitmq.uri.is_empty() {
        "amqp://127.0.0.1:5672/%2f"
    } else {
        config.rabbitmq.uri.expose()
    }
}

/// `outbox check` on RabbitMQ: the publisher's settings (offline).
#[cfg(feature = "rabbitmq")]
pub(crate) fn rabbit_static(config: &Config, out: &mut Vec<Finding>) -> Duration {
    match rabbit_builder(config, rabbit_uri_or_placeholder(config)).build() {
        Ok(c) => {
            out.push(finding(
                "publisher",
                Severity::Ok,
                format!(
                    "RabbitMQ: publisher confirms, mandatory routing, persistent messages, \
                     event id as message_id; delivery timeout {}",
                    humantime::format_duration(c.delivery_timeout)
                ),
                None,
            ));
            c.delivery_timeout
        }
        Err(e) => {
            out.push(finding(
                "publisher",
                Severity::Error,
                e.0,
                Some("fix [rabbitmq]".into()),
            ));
            config.rabbitmq.delivery_timeout.0
        }
    }
}

/// The exchange checks: it exists, is durable and of the configured type; confirms.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn rabbit_checks(config: &Config, out: &mut Vec<Finding>) {
    if let Err(e) = require(config) {
        out.push(finding("exchange", Severity::Error, e.message, e.hint));
        return;
    }
    let p = match rabbit_builder(config, config.rabbitmq.uri.expose()).connect() {
        Ok(p) => p,
        Err(e) => {
            let e = rabbit_config_error(&e);
            out.push(finding("exchange", Severity::Error, e.message, e.hint));
            return;
        }
    };
    match p.check_exchange().await {
        Ok(r) => {
            out.push(finding(
                "exchange",
                Severity::Ok,
                format!("{}: durable {} exchange", r.name, r.kind.as_str()),
                None,
            ));
            out.push(finding(
                "confirms",
                Severity::Ok,
                format!(
                    "publisher confirms {}, mandatory routing {} (an unroutable message is \
                     reported, never dropped)",
                    if r.confirms { "on" } else { "OFF" },
                    if r.mandatory { "on" } else { "OFF" }
                ),
                None,
            ));
        }
        Err(e) => {
            let e = rabbit_topology_error(&e, config);
            out.push(finding("exchange", Severity::Error, e.message, e.hint));
        }
    }
}

fn finding(
    check: &'static str,
    severity: Severity,
    message: impl Into<String>,
    fix: Option<String>,
) -> Finding {
    Finding {
        check,
        severity,
        message: message.into(),
        fix,
    }
}

/// How long one `/readyz` check of the transport may take before it counts as no answer.
pub fn check_bound(config: &Config) -> Duration {
    let one = match config.transport.kind {
        TransportKind::Kafka => config.kafka.metadata_timeout.0,
        // A stream lookup and a stream info per subject space.
        TransportKind::Nats => config.nats.connect_timeout.0 * 2,
        // A connection and two declares.
        TransportKind::RabbitMq => config.rabbitmq.connect_timeout.0 * 3,
    };
    one + Duration::from_secs(1)
}
