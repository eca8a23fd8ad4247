//! The transport the relay publishes through, chosen by `[transport] kind`: Kafka (the
//! default, `[kafka]`, cargo feature `kafka`), NATS JetStream (`[nats]`, cargo feature `nats`)
//! or RabbitMQ (`[rabbitmq]`, cargo feature `rabbitmq`). All three features are on by
//! default; a build without one refuses its kind at start-up ([`select`]), naming the feature
//! and the rebuild command.
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
#[cfg(feature = "kafka")]
use outbox_kafka::KafkaPublisher;
use outbox_postgres::RecordedTopic;

#[cfg(not(any(feature = "kafka", feature = "nats", feature = "rabbitmq")))]
compile_error!(
    "outbox-cli needs at least one transport: build it with the cargo feature `kafka`, `nats` \
     or `rabbitmq` (all three are on by default)"
);

use crate::commands::check::{Finding, Severity};
use crate::config::{ClaimModeName, Config, ConsumerConfig, TransportKind};
use crate::error::CliError;

/// The publisher of the configured transport: forwards [`Publisher`] to the adapter.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AnyPublisher {
    /// Kafka (shared by the workers).
    #[cfg(feature = "kafka")]
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
            #[cfg(feature = "kafka")]
            Self::Kafka(p) => p.publish(batch).await,
            #[cfg(feature = "nats")]
            Self::Nats(p) => p.publish(batch).await,
            #[cfg(feature = "rabbitmq")]
            Self::RabbitMq(p) => p.publish(batch).await,
        }
    }

    fn delivery_timeout(&self) -> Duration {
        match self {
            #[cfg(feature = "kafka")]
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
    #[cfg(feature = "kafka")]
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
            #[cfg(feature = "kafka")]
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
    #[cfg(feature = "kafka")]
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
            #[cfg(feature = "kafka")]
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

/// The transports a build of `outbox` carries: its cargo features `kafka`, `nats` and
/// `rabbitmq` (all on by default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Built {
    /// Feature `kafka` (rdkafka, librdkafka).
    pub kafka: bool,
    /// Feature `nats` (async-nats).
    pub nats: bool,
    /// Feature `rabbitmq` (lapin).
    pub rabbitmq: bool,
}

impl Built {
    /// This build's.
    pub const THIS: Self = Self {
        kafka: cfg!(feature = "kafka"),
        nats: cfg!(feature = "nats"),
        rabbitmq: cfg!(feature = "rabbitmq"),
    };

    /// Whether `kind` is compiled in.
    pub const fn has(self, kind: TransportKind) -> bool {
        match kind {
            TransportKind::Kafka => self.kafka,
            TransportKind::Nats => self.nats,
            TransportKind::RabbitMq => self.rabbitmq,
        }
    }

    /// The kinds compiled in, in the order of the features.
    pub fn kinds(self) -> Vec<TransportKind> {
        [
            TransportKind::Kafka,
            TransportKind::Nats,
            TransportKind::RabbitMq,
        ]
        .into_iter()
        .filter(|k| self.has(*k))
        .collect()
    }
}

/// The rebuild command that adds the feature of `kind` to an installed `outbox`.
fn rebuild_hint(kind: TransportKind, built: Built) -> String {
    let mut features: Vec<&str> = built
        .kinds()
        .into_iter()
        .map(TransportKind::as_str)
        .collect();
    features.push(kind.as_str());
    let others: Vec<String> = built
        .kinds()
        .into_iter()
        .map(|k| format!("\"{k}\""))
        .collect();
    let mut hint = format!(
        "rebuild with the feature: `cargo install --path outbox-cli --locked --force \
         --no-default-features --features {}` (or without --no-default-features: all three \
         transports are in the default build)",
        features.join(",")
    );
    if !others.is_empty() {
        hint.push_str(&format!(
            ", or set transport.kind to one this build has: {}",
            others.join(" or ")
        ));
    }
    hint
}

/// The kind a command runs with: `kind` when this build has it, else a configuration error
/// (exit 2) naming the missing cargo feature and the rebuild command. `built` is
/// [`Built::THIS`] in the command; the tests pass every combination.
pub fn select(kind: TransportKind, built: Built) -> Result<TransportKind, CliError> {
    if built.has(kind) {
        return Ok(kind);
    }
    let default = if kind == TransportKind::Kafka {
        " (the default when transport.kind is not set)"
    } else {
        ""
    };
    Err(CliError::config(
        format!(
            "transport.kind = \"{kind}\"{default}: this build of `outbox` was compiled without \
             the cargo feature `{kind}`"
        ),
        rebuild_hint(kind, built),
    ))
}

/// Refuses Kafka's own flags (`--brokers`, `relay --topic`, `relay --producer-property`) in a
/// build without Kafka: they ask for a transport the build cannot publish through.
pub fn refuse_kafka_flags(flags: &[&str], built: Built) -> Result<(), CliError> {
    match flags.first() {
        Some(flag) if !built.kafka => Err(CliError::config(
            format!(
                "{flag} sets a Kafka option, and this build of `outbox` was compiled without \
                 the cargo feature `kafka`"
            ),
            rebuild_hint(TransportKind::Kafka, built),
        )),
        _ => Ok(()),
    }
}

/// The kind a command runs with, refused when this build lacks its cargo feature.
pub fn kind(config: &Config) -> Result<TransportKind, CliError> {
    select(config.transport.kind, Built::THIS)
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
        #[cfg(feature = "kafka")]
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
#[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
pub async fn start(config: &Config, recorded: &[RecordedTopic]) -> Result<Transport, CliError> {
    require(config)?;
    match kind(config)? {
        #[cfg(feature = "kafka")]
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

/// A consumer's lag as `outbox status` reads it from the transport.
#[derive(Debug, Default)]
pub struct ConsumerLag {
    /// Messages the consumer has still to finish.
    pub total: i64,
    /// Per partition (Kafka), stream (NATS) or queue (RabbitMQ), as JSON.
    pub parts: Vec<serde_json::Value>,
    /// What `status` should warn of (Kafka: a group behind the retention).
    pub warnings: Vec<String>,
}

/// The lag of consumer `c`, read from the broker without joining the consumer (no group
/// membership, no subscription, nothing created):
///
/// | transport | read | lag |
/// |---|---|---|
/// | Kafka | the group's committed offsets and the watermarks of `topics` | records from the committed offset to the end, per partition |
/// | NATS | the durable consumer `group` on the stream(s) capturing the outbox subjects (consumer info) | `num_pending` (not yet delivered) + `num_ack_pending` (delivered, not acknowledged) |
/// | RabbitMQ | the queue `group` (passive declare) | its ready messages (AMQP does not report the unacknowledged ones) |
///
/// The consumer's own gauge `outbox_inbox_lag` reads the same figures through
/// `MessageSource::lag` of its running source.
#[cfg_attr(not(feature = "kafka"), allow(unused_variables))]
pub async fn consumer_lag(
    config: &Config,
    c: &ConsumerConfig,
    topics: &[String],
) -> Result<ConsumerLag, CliError> {
    match kind(config)? {
        #[cfg(feature = "kafka")]
        TransportKind::Kafka => {
            if config.kafka.brokers.trim().is_empty() {
                return Err(CliError::config(
                    "not read (no broker)",
                    "set KAFKA_BROKERS or kafka.brokers",
                ));
            }
            let parts = crate::kafka::consumer_lag(config, c.group(), topics).await?;
            let warnings = parts
                .iter()
                .filter(|p| p.below_retention)
                .map(|p| {
                    format!(
                        "consumer {} lost records to retention on {}[{}]: committed {} < earliest {}",
                        c.name,
                        p.topic,
                        p.partition,
                        p.committed.unwrap_or(-1),
                        p.low
                    )
                })
                .collect();
            Ok(ConsumerLag {
                total: parts.iter().map(|p| p.lag).sum(),
                parts: parts
                    .iter()
                    .map(|p| serde_json::to_value(p).unwrap_or_default())
                    .collect(),
                warnings,
            })
        }
        #[cfg(feature = "nats")]
        TransportKind::Nats => nats_consumer_lag(config, c).await,
        #[cfg(feature = "rabbitmq")]
        TransportKind::RabbitMq => rabbit_consumer_lag(config, c).await,
        #[allow(unreachable_patterns)]
        _ => unreachable!("kind() refuses transports this build lacks"),
    }
}

// ---- NATS -------------------------------------------------------------------------------

/// The durable consumer `c.group()` on the streams that capture the outbox's subjects.
#[cfg(feature = "nats")]
async fn nats_consumer_lag(config: &Config, c: &ConsumerConfig) -> Result<ConsumerLag, CliError> {
    use async_nats::jetstream::context::ConsumerInfoErrorKind;
    use async_nats::jetstream::ErrorCode;
    if config.nats.servers.is_empty() {
        return Err(CliError::config(
            "not read (no NATS server configured)",
            "set NATS_URL or [nats] servers",
        ));
    }
    let p = nats_builder(config, config.nats.servers.expose())
        .connect()
        .await
        .map_err(|e| nats_start_error(e, config))?;
    let report = p
        .check_streams()
        .await
        .map_err(|e| nats_stream_error(&e, config))?;
    let js = async_nats::jetstream::new(p.client().clone());
    let bound = config.nats.connect_timeout.0;
    let durable = c.group();
    let mut lag = ConsumerLag::default();
    for s in &report.streams {
        let stream = js
            .get_stream_no_info(&s.name)
            .await
            .map_err(|e| CliError::failed(format!("NATS stream {:?}: {e}", s.name)))?;
        let info = match tokio::time::timeout(bound, stream.consumer_info(durable)).await {
            Err(_) => {
                return Err(CliError::unreachable(
                    format!(
                        "NATS at {}: no answer to the consumer info of {durable:?} on stream {:?} within {}",
                        config.nats.servers,
                        s.name,
                        humantime::format_duration(bound)
                    ),
                    "check that nats-server runs with JetStream",
                ))
            }
            Ok(Err(e))
                if matches!(e.kind(), ConsumerInfoErrorKind::NotFound)
                    || matches!(e.kind(), ConsumerInfoErrorKind::JetStream(j) if j.error_code() == ErrorCode::CONSUMER_NOT_FOUND) =>
            {
                continue
            }
            Ok(Err(e)) => {
                return Err(CliError::failed(format!(
                    "NATS consumer {durable:?} on stream {:?}: {e}",
                    s.name
                )))
            }
            Ok(Ok(info)) => info,
        };
        let pending = i64::try_from(info.num_pending).unwrap_or(i64::MAX);
        let ack_pending = i64::try_from(info.num_ack_pending).unwrap_or(i64::MAX);
        lag.total = lag
            .total
            .saturating_add(pending)
            .saturating_add(ack_pending);
        lag.parts.push(serde_json::json!({
            "stream": s.name,
            "consumer": durable,
            "pending": pending,
            "ack_pending": ack_pending,
            "redelivered": info.num_redelivered,
            "delivered_stream_sequence": info.delivered.stream_sequence,
            "ack_floor_stream_sequence": info.ack_floor.stream_sequence,
            "lag": pending.saturating_add(ack_pending),
        }));
    }
    if lag.parts.is_empty() {
        let names: Vec<&str> = report.streams.iter().map(|s| s.name.as_str()).collect();
        return Err(CliError::not_ready(
            format!(
                "no durable consumer {durable:?} on stream(s) {names:?}: the consumer has not \
                 started yet, or its durable name is not {durable:?}"
            ),
            format!(
                "set consumers.group to the consumer's durable name (`nats consumer ls {}`)",
                names.first().copied().unwrap_or("<stream>")
            ),
        ));
    }
    Ok(lag)
}

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

/// An AMQP connection for the command's own requests (declares, checks), bounded by
/// `rabbitmq.connect_timeout`; unreachable: exit 3.
#[cfg(feature = "rabbitmq")]
async fn rabbit_connect(config: &Config, name: &str) -> Result<lapin::Connection, CliError> {
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
        .with_connection_name(name.into());
    tokio::time::timeout(
        timeout,
        lapin::Connection::connect(config.rabbitmq.uri.expose(), props),
    )
    .await
    .map_err(|_| unreachable("no AMQP connection in time".into()))?
    .map_err(|e| unreachable(e.to_string()))
}

/// The ready messages of queue `c.group()`, by a passive declare.
#[cfg(feature = "rabbitmq")]
async fn rabbit_consumer_lag(config: &Config, c: &ConsumerConfig) -> Result<ConsumerLag, CliError> {
    if config.rabbitmq.uri.is_empty() {
        return Err(CliError::config(
            "not read (no RabbitMQ URI configured)",
            "set AMQP_URL or [rabbitmq] uri",
        ));
    }
    let conn = rabbit_connect(config, "outbox-status").await?;
    let timeout = config.rabbitmq.connect_timeout.0;
    let queue = c.group();
    let read = async {
        let ch = conn.create_channel().await?;
        ch.queue_declare(
            queue,
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
    };
    let read = tokio::time::timeout(timeout, read).await;
    let _ = tokio::time::timeout(timeout, conn.close(200, "read")).await;
    let q = match read {
        Err(_) => {
            return Err(CliError::unreachable(
                format!(
                    "RabbitMQ at {}: no answer about queue {queue:?} in time",
                    config.rabbitmq.uri
                ),
                "check that RabbitMQ runs; raise rabbitmq.connect_timeout for a slow network",
            ))
        }
        Ok(Err(e)) if e.to_string().contains("NOT_FOUND") => {
            return Err(CliError::not_ready(
                format!(
                    "queue {queue:?} does not exist on RabbitMQ at {}",
                    config.rabbitmq.uri
                ),
                "set consumers.group to the consumer's queue, or declare it (`outbox check` \
                 names what it must be)",
            ))
        }
        Ok(Err(e)) => {
            return Err(CliError::failed(format!(
                "RabbitMQ at {}: queue {queue:?}: {e}",
                config.rabbitmq.uri
            )))
        }
        Ok(Ok(q)) => q,
    };
    let ready = i64::from(q.message_count());
    Ok(ConsumerLag {
        total: ready,
        parts: vec![serde_json::json!({
            "queue": queue,
            "ready": ready,
            "consumers": q.consumer_count(),
            "lag": ready,
        })],
        warnings: Vec::new(),
    })
}

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
    let conn = rabbit_connect(config, "outbox-topics").await?;
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
                exchange_kind_name(config)
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
    if !config.consumers.is_empty() {
        rabbit_queue_checks(config, out).await;
    }
}

/// How the relay routes, in words and as the binding a consumer's queue needs.
#[cfg(feature = "rabbitmq")]
fn rabbit_routing(config: &Config) -> (String, String) {
    use crate::config::{ExchangeKindName as K, RoutingKeyName as R};
    let r = &config.rabbitmq;
    let key = match r.routing_key {
        R::AggregateType => "the aggregate type",
        R::AggregateId => "the aggregate id",
    };
    let mut said = format!(
        "the relay publishes to {} exchange {:?} with {key} as routing key",
        exchange_kind_name(config),
        r.exchange
    );
    if !r.routes.is_empty() && r.routing_key == R::AggregateType {
        said.push_str(&format!(" (routes: {:?})", r.routes));
    }
    let binding = match r.exchange_kind {
        K::ConsistentHash => {
            "a weight (e.g. \"1\") as binding key, one queue per share of the aggregates"
        }
        K::Fanout => "any binding key (fanout)",
        K::Headers => "the header match of the aggregate types it consumes",
        K::Topic => "the aggregate types it consumes (or \"#\" for all) as binding keys",
        K::Direct => "each aggregate type it consumes as a binding key",
    };
    (said, binding.to_owned())
}

#[cfg(feature = "rabbitmq")]
fn exchange_kind_name(config: &Config) -> &'static str {
    rabbit_builder(config, "amqp://h")
        .config()
        .exchange_kind
        .as_str()
}

/// `outbox check` for each `[[consumers]]` section on RabbitMQ: its queue (`group`) exists
/// and is a durable quorum queue with single active consumer that drops no message on its
/// own ([`outbox_rabbitmq::judge_queue`]); the binding, which AMQP 0-9-1 cannot read, is
/// named for the operator to verify.
#[cfg(feature = "rabbitmq")]
pub(crate) async fn rabbit_queue_checks(config: &Config, out: &mut Vec<Finding>) {
    let conn = match rabbit_connect(config, "outbox-check").await {
        Ok(c) => c,
        Err(e) => {
            out.push(finding("queue", Severity::Error, e.message, e.hint));
            return;
        }
    };
    let timeout = config.rabbitmq.connect_timeout.0;
    let exchange = &config.rabbitmq.exchange;
    let (routing, binding) = rabbit_routing(config);
    for c in &config.consumers {
        let queue = c.group();
        let facts = match outbox_rabbitmq::describe_queue(&conn, queue, timeout).await {
            Ok(f) => f,
            Err(outbox_rabbitmq::TopologyError::Missing { .. }) => {
                out.push(finding(
                    "queue",
                    Severity::Error,
                    format!(
                        "consumer {}: queue {queue:?} does not exist (consumers.group names the \
                         consumer's queue)",
                        c.name
                    ),
                    Some(format!(
                        "declare it: `rabbitmqadmin declare queue name={queue} durable=true \
                         arguments='{{\"x-queue-type\":\"quorum\",\"x-single-active-consumer\":true}}'` \
                         and bind it to exchange {exchange:?} with {binding}; or set \
                         consumers.group to the queue's name"
                    )),
                ));
                continue;
            }
            Err(e) => {
                out.push(finding(
                    "queue",
                    Severity::Error,
                    format!("consumer {}: queue {queue:?}: {e}", c.name),
                    Some("check that RabbitMQ runs and that rabbitmq.uri names it".into()),
                ));
                continue;
            }
        };
        let problems = outbox_rabbitmq::judge_queue(&facts);
        for p in &problems {
            out.push(finding(
                "queue",
                match p.severity {
                    outbox_rabbitmq::QueueSeverity::Refuse => Severity::Error,
                    _ => Severity::Warning,
                },
                format!("consumer {}: {}", c.name, p.message),
                Some(p.fix.clone()),
            ));
        }
        if problems.is_empty() {
            let dlx = facts
                .dead_letter_exchange()
                .map(|x| format!(", dead-letters to {x:?}"))
                .unwrap_or_default();
            out.push(finding(
                "queue",
                Severity::Ok,
                format!(
                    "consumer {}: {queue:?} is a durable quorum queue with single active \
                     consumer{dlx}; {} ready, {} consumer(s)",
                    c.name, facts.messages, facts.consumers
                ),
                None,
            ));
        }
        out.push(finding(
            "binding",
            Severity::Warning,
            format!(
                "consumer {}: the bindings of {queue:?} cannot be read over AMQP 0-9-1, so they \
                 were not checked: {routing}; an aggregate must reach one queue",
                c.name
            ),
            Some(format!(
                "verify that {queue:?} is bound to {exchange:?} with {binding}: `rabbitmqctl \
                 list_bindings source_name destination_name routing_key | grep -w {queue}`"
            )),
        ));
    }
    let _ = tokio::time::timeout(timeout, conn.close(200, "checked")).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    const ALL: Built = Built {
        kafka: true,
        nats: true,
        rabbitmq: true,
    };
    const NO_KAFKA: Built = Built {
        kafka: false,
        nats: true,
        rabbitmq: true,
    };
    const NATS_ONLY: Built = Built {
        kafka: false,
        nats: true,
        rabbitmq: false,
    };

    /// Every kind is selected in a build that has it; in one that lacks it, the error is a
    /// configuration error (exit 2) naming the feature, the rebuild command and the kinds the
    /// build has.
    #[test]
    fn a_kind_is_selected_only_when_built() {
        for kind in [
            TransportKind::Kafka,
            TransportKind::Nats,
            TransportKind::RabbitMq,
        ] {
            assert_eq!(select(kind, ALL).unwrap(), kind);
        }
        assert_eq!(
            select(TransportKind::Nats, NO_KAFKA).unwrap(),
            TransportKind::Nats
        );
        let e = select(TransportKind::Kafka, NO_KAFKA).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config);
        assert!(
            e.message
                .contains("compiled without the cargo feature `kafka`"),
            "{}",
            e.message
        );
        assert!(e
            .message
            .contains("the default when transport.kind is not set"));
        let hint = e.hint.unwrap();
        assert!(
            hint.contains(
                "cargo install --path outbox-cli --locked --force --no-default-features \
                 --features nats,rabbitmq,kafka"
            ),
            "{hint}"
        );
        assert!(hint.contains("\"nats\" or \"rabbitmq\""), "{hint}");
        let e = select(TransportKind::RabbitMq, NATS_ONLY).unwrap_err();
        assert!(
            e.message.contains("cargo feature `rabbitmq`"),
            "{}",
            e.message
        );
        assert!(!e.message.contains("the default"), "{}", e.message);
        let hint = e.hint.unwrap();
        assert!(hint.contains("--features nats,rabbitmq"), "{hint}");
        assert!(hint.ends_with("one this build has: \"nats\""), "{hint}");
    }

    /// Kafka's flags are refused by a build without Kafka, accepted by one with it, and no
    /// flag is never refused.
    #[test]
    fn kafka_flags_need_the_kafka_feature() {
        assert!(refuse_kafka_flags(&["--brokers"], ALL).is_ok());
        assert!(refuse_kafka_flags(&[], NO_KAFKA).is_ok());
        let e = refuse_kafka_flags(&["--producer-property", "--topic"], NO_KAFKA).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config);
        assert!(
            e.message
                .starts_with("--producer-property sets a Kafka option")
                && e.message.contains("cargo feature `kafka`"),
            "{}",
            e.message
        );
        assert!(e.hint.unwrap().contains("--features nats,rabbitmq,kafka"));
    }
}
