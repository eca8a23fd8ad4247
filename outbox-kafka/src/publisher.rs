//! [`KafkaPublisher`]: the outbox [`Publisher`] on rdkafka's idempotent producer.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use futures::future::{join_all, Either};
use outbox_core::{
    async_trait, wire, AckMetadata, ConfigError, Envelope, ErrorClass, FailureScope, PublishError,
    PublishErrorKind, PublishResult, Publisher,
};
use rdkafka::admin::AdminClient;
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use tokio::time::Instant;

use crate::config::{check_producer_overrides, connection_properties, Properties, PRODUCER_FORCED};
use crate::error::{publish_error, publish_error_to, unknown_topic};
use crate::partitioner::Partitioner;
use crate::size::{
    envelope_batch_bytes, is_size_refusal, producer_batch_bytes, producer_compresses,
    size_refusal_error,
};
use crate::topics::{
    check_batch_fits, describe_topics, missing_topics, Admin, PartitionChange, PartitionerChange,
    TopicCheckError, TopicReport,
};

/// Default delivery timeout (`message.timeout.ms`): 30 s.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Default timeout of metadata and admin requests in topic checks: 10 s.
pub const DEFAULT_METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`KafkaPublisherBuilder::rebuild_after_timeouts`]: 2 batches.
pub const DEFAULT_REBUILD_AFTER_TIMEOUTS: u32 = 2;
/// Extra time [`KafkaPublisher::publish`] waits beyond the delivery timeout for the last reports.
pub const REPORT_GRACE: Duration = Duration::from_millis(500);
/// `linger.ms` of the producer unless the configuration sets it (or its alias
/// `queue.buffering.max.ms`): 0. [`KafkaPublisher::publish`] enqueues a whole batch at once
/// and then waits for its delivery reports, so batching is done by the relay; librdkafka's own
/// default (5 ms) would only hold each batch back that long once it is enqueued.
pub const DEFAULT_LINGER_MS: u32 = 0;
/// Pause between enqueue attempts while librdkafka's local queue is full.
const QUEUE_FULL_PAUSE: Duration = Duration::from_millis(5);
/// Least time left before the report deadline for asking the broker whether the topics of
/// timed-out records still exist.
const MIN_TOPIC_PROBE: Duration = Duration::from_millis(50);

/// Configuration of a [`KafkaPublisher`]. Build it with [`KafkaPublisher::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `brokers` | (required) | `bootstrap.servers` |
/// | `default_topic` | (required) | topic of every aggregate type without a route |
/// | `aggregate_routes` | empty | `aggregate_type` → topic (one aggregate never spans two topics) |
/// | `delivery_timeout` | 30 s | `message.timeout.ms`: bound from enqueue to final delivery report |
/// | `metadata_timeout` | 10 s | topic checks (metadata, DescribeConfigs) |
/// | `client_id` | `outbox-publisher` | `client.id` |
/// | `linger.ms` | 0 ([`DEFAULT_LINGER_MS`]) | librdkafka's batching delay; set it (`properties`) to batch across publish calls |
/// | `properties` | empty | librdkafka properties from the allow-list (connection, security, logging, tuning, `partitioner`); secrets are redacted in `Debug` |
/// | `expected_partitions` | empty | partition counts to compare at the first topic check |
/// | `expected_partitioner` | none | partitioner of the previous run, compared at the first topic check |
/// | `rebuild_after_timeouts` | 2 | replace a producer whose batches keep timing out entirely (0 = never) |
///
/// Always set and not overridable to weaker values: `enable.idempotence=true`, `acks=all`,
/// `max.in.flight.requests.per.connection=5` (1..=5 accepted), `retries` > 0,
/// `delivery.report.only.error=false`, `allow.auto.create.topics=false`, a key-hashing
/// `partitioner` (default `murmur2_random`, see [`Partitioner`]), no `transactional.id`.
/// Properties outside the allow-list are refused ([`crate::is_allowed_producer_property`]).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KafkaPublisherConfig {
    /// Bootstrap servers, `host:port[,host:port...]`.
    pub brokers: String,
    /// Topic for aggregate types without a route.
    pub default_topic: String,
    /// Topic per aggregate type. Routes are by aggregate type, never by event type, so every
    /// event of one aggregate goes to one topic (and, keyed by the aggregate id, one partition).
    pub aggregate_routes: BTreeMap<String, String>,
    /// `message.timeout.ms`.
    pub delivery_timeout: Duration,
    /// Timeout of metadata and admin requests.
    pub metadata_timeout: Duration,
    /// `client.id`.
    pub client_id: String,
    /// Extra librdkafka properties.
    pub properties: Properties,
    /// Partition counts expected before the first topic check (see
    /// [`KafkaPublisherBuilder::expect_partitions`]).
    pub expected_partitions: BTreeMap<String, usize>,
    /// Replace the producer after this many consecutive batches in which every record timed
    /// out (0 = never). See [`KafkaPublisherBuilder::rebuild_after_timeouts`].
    pub rebuild_after_timeouts: u32,
    /// The partitioner of the previous run (see [`KafkaPublisherBuilder::expect_partitioner`]).
    pub expected_partitioner: Option<Partitioner>,
}

impl KafkaPublisherConfig {
    /// A configuration with the defaults above.
    pub fn new(brokers: impl Into<String>, default_topic: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            default_topic: default_topic.into(),
            aggregate_routes: BTreeMap::new(),
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            metadata_timeout: DEFAULT_METADATA_TIMEOUT,
            client_id: "outbox-publisher".into(),
            properties: Properties::default(),
            expected_partitions: BTreeMap::new(),
            rebuild_after_timeouts: DEFAULT_REBUILD_AFTER_TIMEOUTS,
            expected_partitioner: None,
        }
    }

    /// The topic every event of an aggregate of `aggregate_type` is published to.
    pub fn topic_for_aggregate(&self, aggregate_type: &str) -> &str {
        self.aggregate_routes
            .get(aggregate_type)
            .map_or(self.default_topic.as_str(), String::as_str)
    }

    /// The partitioner the producer uses: the `partitioner` property if set (and accepted),
    /// else [`crate::DEFAULT_PARTITIONER`].
    pub fn partitioner(&self) -> Result<Partitioner, ConfigError> {
        Ok(check_producer_overrides(&self.properties)?.partitioner)
    }

    /// The largest record batch the producer builds: the smaller of the `batch.size` and
    /// `message.max.bytes` properties (librdkafka's defaults, 1,000,000 bytes each, when
    /// unset). Every topic's `max.message.bytes` must be at least this (see [`crate::size`]).
    pub fn max_batch_bytes(&self) -> u64 {
        producer_batch_bytes(&self.properties)
    }

    /// Every topic this configuration can publish to.
    pub fn topics(&self) -> Vec<String> {
        let mut set: BTreeSet<&str> = self.aggregate_routes.values().map(String::as_str).collect();
        set.insert(&self.default_topic);
        set.into_iter().map(str::to_owned).collect()
    }

    /// Validates the configuration and returns the effective librdkafka producer configuration
    /// together with the effective delivery timeout and partitioner.
    fn producer_config(&self) -> Result<(ClientConfig, Duration, Partitioner), ConfigError> {
        if self.brokers.trim().is_empty() {
            return Err(ConfigError::new("brokers must not be empty"));
        }
        validate_topic_name("default_topic", &self.default_topic)?;
        for (aggregate_type, topic) in &self.aggregate_routes {
            if aggregate_type.trim().is_empty() {
                return Err(ConfigError::new("a route has an empty aggregate type"));
            }
            validate_topic_name(
                &format!("route for aggregate type {aggregate_type:?}"),
                topic,
            )?;
        }
        let checked = check_producer_overrides(&self.properties)?;
        let timeout = checked.delivery_timeout.unwrap_or(self.delivery_timeout);
        if timeout.is_zero() || timeout.as_millis() > i32::MAX as u128 {
            return Err(ConfigError::new(format!(
                "delivery timeout {timeout:?} must be between 1 ms and {} ms",
                i32::MAX
            )));
        }
        if self.metadata_timeout.is_zero() {
            return Err(ConfigError::new(
                "metadata timeout must be greater than zero",
            ));
        }
        let mut cc = ClientConfig::new();
        cc.set("client.id", &self.client_id);
        if self.properties.get("linger.ms").is_none()
            && self.properties.get("queue.buffering.max.ms").is_none()
        {
            cc.set("linger.ms", DEFAULT_LINGER_MS.to_string());
        }
        for (k, v) in self.properties.iter() {
            cc.set(k, v);
        }
        // Aliases of what is set below go, so one value is in force.
        for alias in [
            "delivery.timeout.ms",
            "request.required.acks",
            "max.in.flight",
        ] {
            cc.remove(alias);
        }
        cc.set("bootstrap.servers", &self.brokers);
        cc.set("message.timeout.ms", timeout.as_millis().to_string());
        for (k, v) in PRODUCER_FORCED {
            cc.set(k, v);
        }
        if let Some(n) = checked.max_in_flight {
            // A stricter in-flight limit (1..=5) passed the allow-list; keep it.
            cc.set("max.in.flight.requests.per.connection", n.to_string());
        }
        cc.set("partitioner", checked.partitioner.as_str());
        cc.set_log_level(crate::config::log_level(&self.properties));
        Ok((cc, timeout, checked.partitioner))
    }
}

/// Checks a Kafka topic name from configuration: 1..=249 of `[a-zA-Z0-9._-]`, not `.` or `..`
/// (what Kafka accepts). `what` names the setting in the error. The publisher's builder checks
/// every topic with it; programs check topic names from their arguments with it before anything
/// connects.
pub fn validate_topic_name(what: &str, topic: &str) -> Result<(), ConfigError> {
    let ok = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::new(format!(
            "{what}: {topic:?} is not a valid Kafka topic name (1..=249 of [a-zA-Z0-9._-])"
        )))
    }
}

/// Builder of a [`KafkaPublisher`].
#[derive(Clone, Debug)]
pub struct KafkaPublisherBuilder {
    config: KafkaPublisherConfig,
    /// Routes that would split an aggregate type over two topics, refused by `build`.
    route_conflicts: Vec<String>,
}

impl KafkaPublisherBuilder {
    /// Publishes every event of aggregates of `aggregate_type` to `topic` instead of the
    /// default topic.
    ///
    /// Routing is by aggregate type, never by event type: order is promised per aggregate, and
    /// a consumer reading two topics has no order between them, so one aggregate's events must
    /// all go to one topic (where the aggregate id, the key, puts them on one partition). Routing
    /// one aggregate type to two different topics is refused by [`build`](Self::build).
    pub fn route_aggregate(
        mut self,
        aggregate_type: impl Into<String>,
        topic: impl Into<String>,
    ) -> Self {
        let (aggregate_type, topic) = (aggregate_type.into(), topic.into());
        if let Some(before) = self.config.aggregate_routes.get(&aggregate_type) {
            if *before != topic {
                self.route_conflicts.push(format!(
                    "aggregate type {aggregate_type:?} is routed to both {before:?} and \
                     {topic:?}: its aggregates' events would be split over two topics, and a \
                     consumer of both could see a later version first. Route each aggregate \
                     type to exactly one topic"
                ));
            }
        }
        self.config.aggregate_routes.insert(aggregate_type, topic);
        self
    }

    /// Sets the delivery timeout (`message.timeout.ms`). Default 30 s.
    pub fn delivery_timeout(mut self, timeout: Duration) -> Self {
        self.config.delivery_timeout = timeout;
        self
    }

    /// Sets the timeout of the topic checks' requests. Default 10 s.
    pub fn metadata_timeout(mut self, timeout: Duration) -> Self {
        self.config.metadata_timeout = timeout;
        self
    }

    /// Sets `client.id`. Default `outbox-publisher`.
    pub fn client_id(mut self, client_id: impl Into<String>) -> Self {
        self.config.client_id = client_id.into();
        self
    }

    /// Sets a librdkafka producer property from the allow-list (connection, security,
    /// logging, batching, compression, ...). Properties outside the allow-list, and values that
    /// would weaken ordering, acknowledgements or delivery reports, are refused by
    /// [`build`](Self::build), each with its reason and the fix.
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.properties.set(key, value);
        self
    }

    /// Sets the partitioner (the `partitioner` property). Default
    /// [`crate::DEFAULT_PARTITIONER`] (`murmur2_random`, the Java client's keyed partitioning);
    /// see [`Partitioner`] before changing it for a topic that already holds events.
    pub fn partitioner(mut self, partitioner: Partitioner) -> Self {
        self.config
            .properties
            .set("partitioner", partitioner.as_str());
        self
    }

    /// The partitioner the previous run used, e.g. [`TopicReport::partitioner`] as recorded at
    /// the previous start. [`KafkaPublisher::check_topics`] reports a partitioner that maps keys
    /// differently as a [`PartitionerChange`] (logged, counted), like a partition count change:
    /// either moves keys to other partitions.
    pub fn expect_partitioner(mut self, partitioner: Partitioner) -> Self {
        self.config.expected_partitioner = Some(partitioner);
        self
    }

    /// The partition count `topic` is expected to have, e.g. as recorded at the previous start.
    /// [`KafkaPublisher::check_topics`] reports a different count as a [`PartitionChange`], so a
    /// change made while no publisher ran is surfaced too.
    pub fn expect_partitions(mut self, topic: impl Into<String>, partitions: usize) -> Self {
        self.config
            .expected_partitions
            .insert(topic.into(), partitions);
        self
    }

    /// Replaces the producer after `batches` consecutive batches in which every record timed
    /// out (0 = never). Default 2. An idempotent producer whose id the broker forgot (a broker
    /// restarted without its state, producer-id expiry) otherwise retries into
    /// `UNKNOWN_PRODUCER_ID` until every record times out, forever.
    pub fn rebuild_after_timeouts(mut self, batches: u32) -> Self {
        self.config.rebuild_after_timeouts = batches;
        self
    }

    /// The configuration so far.
    pub fn config(&self) -> &KafkaPublisherConfig {
        &self.config
    }

    /// Validates the configuration and creates the producer. No network round trip happens
    /// here; call [`KafkaPublisher::check_topics`] (or use [`start`](Self::start)) before
    /// publishing.
    pub fn build(self) -> Result<KafkaPublisher, ConfigError> {
        if !self.route_conflicts.is_empty() {
            return Err(ConfigError::new(self.route_conflicts.join("; ")));
        }
        KafkaPublisher::from_config(self.config)
    }

    /// [`build`](Self::build), then [`KafkaPublisher::check_topics`]: fails at start on a
    /// missing topic instead of at the first delivery timeout.
    pub async fn start(self) -> Result<KafkaPublisher, StartError> {
        let publisher = self.build().map_err(StartError::Config)?;
        publisher.check_topics().await.map_err(StartError::Topics)?;
        Ok(publisher)
    }
}

/// Why [`KafkaPublisherBuilder::start`] failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is invalid or unsafe.
    Config(ConfigError),
    /// A topic is missing or the broker could not be asked.
    Topics(TopicCheckError),
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Config(e) => write!(f, "{e}"),
            Self::Topics(e) => write!(f, "topic check failed: {e}"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Config(e) => Some(e),
            Self::Topics(e) => Some(e),
        }
    }
}

/// Routes librdkafka's logs and client errors to `tracing`.
#[derive(Clone, Debug, Default)]
pub(crate) struct TracingContext;

impl ClientContext for TracingContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{log_message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", fac, "{log_message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{log_message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if crate::error::is_fatal(&error) {
            tracing::error!(error = %error, reason, "fatal producer error; the producer will be rebuilt");
        } else {
            tracing::warn!(error = %error, reason, "kafka client error");
        }
    }
}

type Producer_ = FutureProducer<TracingContext>;

/// The outbox [`Publisher`] for Kafka.
///
/// * A batch is enqueued as a whole, then every delivery report is awaited; a result is `Ok`
///   only from a successful delivery report, with the topic, partition and offset it reports.
/// * While librdkafka's local queue is full, enqueueing is retried until the delivery timeout.
/// * If enqueueing an event fails, later events of the same aggregate in the batch are not sent
///   (they fail transiently), so a later version never overtakes an earlier one. An event that
///   fails only in its delivery report cannot hold back the ones already sent after it; the
///   relay never puts two events of one aggregate in a batch (it claims aggregate heads), and
///   direct users who do should expect that case.
/// * [`publish`](Publisher::publish) returns within
///   [`delivery_timeout`](Publisher::delivery_timeout) + [`REPORT_GRACE`] of its start.
/// * A fatal producer error (the idempotent producer lost its guarantees) fails the affected
///   records transiently and the producer is replaced before the next batch.
pub struct KafkaPublisher {
    config: KafkaPublisherConfig,
    client_config: ClientConfig,
    delivery_timeout: Duration,
    partitioner: Partitioner,
    /// The partitioner to compare with at the next topic check (the expected one, then ours).
    known_partitioner: Mutex<Option<Partitioner>>,
    producer: RwLock<(u64, Producer_)>,
    admin: Admin,
    partitions: Mutex<BTreeMap<String, usize>>,
    /// `max.message.bytes` of the topics that report it, from the last topic check.
    size_limits: Mutex<BTreeMap<String, u64>>,
    /// The producer compresses batches (the broker compares sizes after compression).
    compressed: bool,
    last_report: Mutex<Option<TopicReport>>,
    timeout_streak: AtomicU32,
}

impl fmt::Debug for KafkaPublisher {
    // The librdkafka ClientConfig is left out on purpose: it holds secrets in clear text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("config", &self.config)
            .field("delivery_timeout", &self.delivery_timeout)
            .field("partitioner", &self.partitioner)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// A builder for a publisher to `brokers` with `default_topic`.
    pub fn builder(
        brokers: impl Into<String>,
        default_topic: impl Into<String>,
    ) -> KafkaPublisherBuilder {
        KafkaPublisherBuilder {
            config: KafkaPublisherConfig::new(brokers, default_topic),
            route_conflicts: Vec::new(),
        }
    }

    /// A publisher from a complete configuration (see [`KafkaPublisherConfig`]).
    pub fn from_config(config: KafkaPublisherConfig) -> Result<Self, ConfigError> {
        let (client_config, delivery_timeout, partitioner) = config.producer_config()?;
        let producer = create_producer(&client_config)?;
        let admin = create_admin(&config)?;
        Ok(Self {
            client_config,
            delivery_timeout,
            partitioner,
            known_partitioner: Mutex::new(config.expected_partitioner),
            producer: RwLock::new((0, producer)),
            admin,
            partitions: Mutex::new(config.expected_partitions.clone()),
            size_limits: Mutex::new(BTreeMap::new()),
            compressed: producer_compresses(&config.properties),
            config,
            last_report: Mutex::new(None),
            timeout_streak: AtomicU32::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaPublisherConfig {
        &self.config
    }

    /// The partitioner in force (record it, and pass it to
    /// [`KafkaPublisherBuilder::expect_partitioner`] at the next start).
    pub fn partitioner(&self) -> Partitioner {
        self.partitioner
    }

    /// Checks every configured topic: it must exist; its partition count is recorded (a change
    /// since the previous check is reported in [`TopicReport::partition_changes`], logged and
    /// counted); a partitioner that maps keys differently from the expected one is reported in
    /// [`TopicReport::partitioner_change`] (logged, counted; once); compacted topics are
    /// logged. The cleanup policy is
    /// [`CleanupPolicy::Unavailable`](crate::CleanupPolicy::Unavailable) with a warning when the
    /// broker cannot describe topic configurations. A topic whose `max.message.bytes` is below
    /// the producer's largest batch ([`KafkaPublisherConfig::max_batch_bytes`]) fails the check
    /// ([`TopicCheckError::BatchTooLarge`]); the limits read are kept to class "too large"
    /// refusals by the record's own size (see [`crate::size`]).
    ///
    /// Call it at start (see [`KafkaPublisherBuilder::start`]) and, if partition changes
    /// matter to you, periodically.
    pub async fn check_topics(&self) -> Result<TopicReport, TopicCheckError> {
        let topics = self.config.topics();
        let infos = describe_topics(&self.admin, &topics, self.config.metadata_timeout).await?;
        *self
            .size_limits
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = infos
            .iter()
            .filter_map(|i| Some((i.name.clone(), i.max_message_bytes?)))
            .collect();
        check_batch_fits(
            infos.iter().map(|i| (i.name.as_str(), i.max_message_bytes)),
            self.config.max_batch_bytes(),
        )?;
        let mut changes = Vec::new();
        {
            let mut known = self
                .partitions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for info in &infos {
                if let Some(before) = known.insert(info.name.clone(), info.partitions) {
                    if before != info.partitions {
                        changes.push(PartitionChange {
                            topic: info.name.clone(),
                            before,
                            after: info.partitions,
                        });
                    }
                }
            }
        }
        for c in &changes {
            report_partition_change(c);
        }
        let partitioner_change = {
            let mut known = self
                .known_partitioner
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let before = known.replace(self.partitioner);
            before
                .filter(|b| !b.maps_keys_like(self.partitioner))
                .map(|before| PartitionerChange {
                    before,
                    after: self.partitioner,
                    topics: infos.iter().map(|i| i.name.clone()).collect(),
                })
        };
        if let Some(c) = &partitioner_change {
            report_partitioner_change(c);
        }
        for info in &infos {
            tracing::info!(topic = %info.name, partitions = info.partitions, cleanup_policy = ?info.cleanup_policy, partitioner = %self.partitioner, "outbox topic checked");
        }
        let report = TopicReport {
            topics: infos,
            partition_changes: changes,
            partitioner: self.partitioner,
            partitioner_change,
        };
        *self
            .last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(report.clone());
        Ok(report)
    }

    /// The report of the last successful [`check_topics`](Self::check_topics).
    pub fn topic_report(&self) -> Option<TopicReport> {
        self.last_report
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Partition counts known from topic checks and delivery reports.
    pub fn partition_counts(&self) -> BTreeMap<String, usize> {
        self.partitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many times the producer was replaced (fatal error or a run of timed-out batches).
    pub fn producer_generation(&self) -> u64 {
        self.producer
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .0
    }

    /// Waits up to `timeout` for every enqueued record to get its delivery report.
    pub fn flush(&self, timeout: Duration) -> Result<(), PublishError> {
        self.current_producer()
            .1
            .flush(timeout)
            .map_err(|e| publish_error(&e))
    }

    fn current_producer(&self) -> (u64, Producer_) {
        let guard = self.producer.read().unwrap_or_else(PoisonError::into_inner);
        (guard.0, guard.1.clone())
    }

    /// Replaces the producer of `generation` (unless another batch already did).
    fn replace_producer(&self, generation: u64, why: &str) {
        let mut guard = self
            .producer
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if guard.0 != generation {
            return; // another batch already replaced it
        }
        match create_producer(&self.client_config) {
            Ok(fresh) => {
                tracing::warn!(generation = generation + 1, why, "replaced the producer (affected records failed transiently and are retried by the relay)");
                *guard = (generation + 1, fresh);
            }
            Err(e) => {
                tracing::error!(why, error = %e, "could not recreate the producer");
            }
        }
    }

    /// Decides after a batch whether the producer must be replaced: after a fatal error, or
    /// after `rebuild_after_timeouts` consecutive batches in which every record timed out.
    ///
    /// The second rule exists because the idempotent producer can get stuck without a fatal
    /// error: when the broker forgot its producer id (a broker restarted without its state, or
    /// producer-id expiry), librdkafka bumps the epoch locally and every retry is answered with
    /// `UNKNOWN_PRODUCER_ID` until the records time out, batch after batch. A new producer
    /// obtains a fresh id. Replacing the producer is safe for order: every record of the old
    /// one already has a final (failed) report, and the relay re-publishes them.
    fn after_batch(&self, generation: u64, producer: &Producer_, results: &[PublishResult]) {
        if let Some((code, reason)) = producer.client().fatal_error() {
            tracing::error!(%code, reason, "producer failed fatally");
            self.timeout_streak.store(0, Ordering::Relaxed);
            self.replace_producer(generation, "fatal producer error");
            return;
        }
        if results
            .iter()
            .any(|r| matches!(r, Err(e) if e.kind == PublishErrorKind::Fatal))
        {
            self.timeout_streak.store(0, Ordering::Relaxed);
            self.replace_producer(generation, "fatal error in a delivery report");
            return;
        }
        let all_timed_out = !results.is_empty()
            && results
                .iter()
                .all(|r| matches!(r, Err(e) if e.kind == PublishErrorKind::Timeout));
        if !all_timed_out {
            if results.iter().any(Result::is_ok) {
                self.timeout_streak.store(0, Ordering::Relaxed);
            }
            return;
        }
        let streak = self.timeout_streak.fetch_add(1, Ordering::Relaxed) + 1;
        let limit = self.config.rebuild_after_timeouts;
        if limit > 0 && streak >= limit {
            self.timeout_streak.store(0, Ordering::Relaxed);
            self.replace_producer(generation, "every record of consecutive batches timed out");
        }
    }

    /// Which of `topics` the broker says do not exist, asked through `producer` within what is
    /// left until `deadline`; `None` when there is no time left or the broker does not answer
    /// (nothing is known then).
    ///
    /// A record whose topic was deleted while the publisher runs (or whose broker came back
    /// without it) usually just times out: librdkafka waits for the topic to reappear. Asking
    /// the broker lets [`name_missing_topics`](Self::name_missing_topics) report such records as
    /// a missing topic, naming it, instead of as timeouts. The producer's own client is asked:
    /// its connections are the ones in use (an idle admin client may still be waiting to
    /// reconnect after a broker restart).
    async fn probe_topics(
        &self,
        producer: &Producer_,
        topics: &BTreeSet<&str>,
        deadline: Instant,
    ) -> Option<Vec<String>> {
        let budget = deadline
            .saturating_duration_since(Instant::now())
            .min(self.config.metadata_timeout);
        if topics.is_empty() || budget < MIN_TOPIC_PROBE {
            return None;
        }
        let names: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
        let producer = producer.clone();
        let fetch =
            move |topic: &str, timeout| producer.client().fetch_metadata(Some(topic), timeout);
        match missing_topics(fetch, &names, budget).await {
            Ok(missing) => Some(missing),
            Err(e) => {
                tracing::debug!(error = %e, "could not ask whether the topics of late records exist");
                None
            }
        }
    }

    /// Reports the timed-out records of a `missing` topic as [`PublishErrorKind::UnknownTopic`]
    /// naming it. Either kind is a transport failure: no attempt is spent, the relay pauses
    /// until the topic is back.
    fn name_missing_topics(
        &self,
        batch: &[&Envelope],
        results: &mut [PublishResult],
        missing: &[String],
    ) {
        if missing.is_empty() {
            return;
        }
        let mut named = 0usize;
        for (e, r) in batch.iter().zip(results.iter_mut()) {
            let topic = self.config.topic_for_aggregate(&e.aggregate_type);
            if let Err(err) = r {
                if err.kind == PublishErrorKind::Timeout && missing.iter().any(|m| m == topic) {
                    *r = Err(unknown_topic(topic, &err.message));
                    named += 1;
                }
            }
        }
        if named > 0 {
            tracing::warn!(topics = ?missing, records = named, "outbox topic missing on the broker (deleted, or not created again after a broker reset); records to it fail until it exists again");
        }
    }

    /// The error of `record` refused by the broker as too large: classed by the record's own
    /// size against its topic's `max.message.bytes` (see [`crate::size`]), since librdkafka
    /// fails every record of a refused batch alike.
    fn size_refusal(&self, topic: &str, record: &Envelope, err: &KafkaError) -> PublishError {
        let limit = self
            .size_limits
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(topic)
            .copied();
        let e = size_refusal_error(
            topic,
            err,
            envelope_batch_bytes(record),
            limit,
            self.compressed,
        );
        if e.scope == FailureScope::Transport {
            tracing::warn!(event_id = %record.event_id, topic, max_batch_bytes = self.config.max_batch_bytes(), max_message_bytes = limit, "the broker refused a record batch as too large, though its records fit the topic alone: lower the producer's batch.size (the relay retries without spending attempts)");
        }
        e
    }

    /// Records partitions seen in delivery reports; a partition beyond the known count means the
    /// topic grew.
    fn note_partitions(&self, acks: &[&AckMetadata]) {
        let mut changes = Vec::new();
        {
            let mut known = self
                .partitions
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for ack in acks {
                // This publisher fills only Kafka acknowledgements.
                let AckMetadata::Kafka {
                    topic, partition, ..
                } = ack
                else {
                    continue;
                };
                let Ok(p) = usize::try_from(*partition) else {
                    continue;
                };
                if let Some(count) = known.get_mut(topic) {
                    if p >= *count {
                        changes.push(PartitionChange {
                            topic: topic.clone(),
                            before: *count,
                            after: p + 1,
                        });
                        *count = p + 1;
                    }
                }
            }
        }
        for c in &changes {
            report_partition_change(c);
        }
    }
}

fn report_partition_change(c: &PartitionChange) {
    tracing::warn!(
        topic = %c.topic, before = c.before, after = c.after,
        "partition count of an outbox topic changed: keys now map to other partitions, so \
         per-aggregate order across the change is not guaranteed"
    );
    metrics::counter!("outbox_kafka_partition_count_changes_total", "topic" => c.topic.clone())
        .increment(1);
    metrics::gauge!("outbox_kafka_topic_partitions", "topic" => c.topic.clone())
        .set(c.after as f64);
}

fn report_partitioner_change(c: &PartitionerChange) {
    tracing::warn!(
        before = %c.before, after = %c.after, topics = ?c.topics,
        "partitioner of the outbox publisher changed: keys now map to other partitions, so \
         per-aggregate order across the change is not guaranteed (let consumers drain the old \
         partitions first, or keep the previous partitioner)"
    );
    metrics::counter!("outbox_kafka_partitioner_changes_total").increment(1);
}

fn create_producer(cc: &ClientConfig) -> Result<Producer_, ConfigError> {
    cc.create_with_context(TracingContext)
        .map_err(|e| crate::config::refused("producer", &e, cc))
}

fn create_admin(config: &KafkaPublisherConfig) -> Result<Admin, ConfigError> {
    // The admin client shares the connection, security and logging settings, nothing of the
    // producer's.
    let mut cc = ClientConfig::new();
    cc.set("client.id", &config.client_id);
    for (k, v) in connection_properties(&config.properties) {
        cc.set(k, v);
    }
    cc.set("bootstrap.servers", &config.brokers);
    cc.set("allow.auto.create.topics", "false");
    cc.set_log_level(crate::config::log_level(&config.properties));
    let admin: AdminClient<DefaultClientContext> = cc
        .create()
        .map_err(|e| crate::config::refused("admin", &e, &cc))?;
    Ok(Arc::new(admin))
}

/// The record headers of `e`, copied once: from the envelope straight into librdkafka's list.
fn encode_headers(e: &Envelope) -> Result<OwnedHeaders, PublishError> {
    // `insert` takes the list by value; the Option lets the closure move it through.
    let mut headers = Some(OwnedHeaders::new_with_capacity(8 + e.headers.len()));
    let mut bad_name = None;
    wire::for_each_header(e, |key, value| {
        // librdkafka takes header names as C strings; a NUL would abort deep inside rdkafka.
        if key.contains('\0') {
            bad_name.get_or_insert_with(|| key.to_owned());
        }
        if bad_name.is_none() {
            headers = headers.take().map(|h| {
                h.insert(Header {
                    key,
                    value: Some(value),
                })
            });
        }
    });
    match (bad_name, headers) {
        (None, Some(headers)) => Ok(headers),
        (Some(key), _) => Err(PublishError::new(
            PublishErrorKind::Serialization,
            format!("header name {key:?} contains a NUL byte"),
        )),
        (None, None) => unreachable!("the header list is put back after every insert"),
    }
}

enum Slot<'a> {
    Done(PublishResult),
    Waiting {
        topic: &'a str,
        record: &'a Envelope,
        report: DeliveryFuture,
    },
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let (generation, producer) = self.current_producer();
        let started = Instant::now();
        let enqueue_deadline = started + self.delivery_timeout;
        let mut failed_aggregates: HashSet<&str> = HashSet::new();
        let mut slots: Vec<Slot<'_>> = Vec::with_capacity(batch.len());
        let mut queue_was_full = false;

        for e in batch {
            if failed_aggregates.contains(e.aggregate_id.as_str()) {
                // Held back so it cannot overtake its predecessor; nothing is wrong with this
                // record, so it spends no attempt (the relay never batches two events of one
                // aggregate; direct users may).
                slots.push(Slot::Done(Err(PublishError::new(
                    PublishErrorKind::Other,
                    "not sent: an earlier event of the same aggregate in this batch failed",
                )
                .with_class(ErrorClass::Transient)
                .with_scope(FailureScope::Transport))));
                continue;
            }
            let topic = self.config.topic_for_aggregate(&e.aggregate_type);
            let headers = match encode_headers(e) {
                Ok(h) => h,
                Err(err) => {
                    failed_aggregates.insert(e.aggregate_id.as_str());
                    slots.push(Slot::Done(Err(err)));
                    continue;
                }
            };
            let mut record: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic)
                .key(e.aggregate_id.as_str())
                .payload(e.payload.bytes.as_slice())
                .headers(headers);
            let slot = loop {
                match producer.send_result(record) {
                    Ok(report) => {
                        break Slot::Waiting {
                            topic,
                            record: e,
                            report,
                        }
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                        if Instant::now() < enqueue_deadline =>
                    {
                        // The producer's own thread serves delivery reports, which frees space.
                        if !queue_was_full {
                            queue_was_full = true;
                            tracing::debug!(
                                "librdkafka's local queue is full; waiting to enqueue the rest"
                            );
                        }
                        record = back;
                        tokio::time::sleep(QUEUE_FULL_PAUSE).await;
                    }
                    Err((err, _)) => {
                        failed_aggregates.insert(e.aggregate_id.as_str());
                        tracing::warn!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, topic, error = %err, stage = "enqueue", "record not enqueued");
                        break Slot::Done(Err(publish_error_to(topic, &err)));
                    }
                }
            };
            slots.push(slot);
        }

        // librdkafka reports every enqueued record within message.timeout.ms of enqueueing it.
        // The relay needs publish() to end within delivery_timeout (+ grace) of its start, to
        // stay inside its lease: a record enqueued late (after a full queue) that has no report
        // by then is a transient timeout. If it is stored after all, that is a duplicate, which
        // at-least-once allows; it is never reported published without its report.
        let report_deadline = started + self.delivery_timeout + REPORT_GRACE;
        let waiting_topics: BTreeSet<&str> = slots
            .iter()
            .filter_map(|s| match s {
                Slot::Waiting { topic, .. } => Some(*topic),
                Slot::Done(_) => None,
            })
            .collect();
        let reports = join_all(slots.into_iter().map(|slot| async move {
            match slot {
                Slot::Done(result) => result,
                Slot::Waiting {
                    topic,
                    record,
                    report,
                } => match tokio::time::timeout_at(report_deadline, report).await {
                    Ok(Ok(Ok(delivery))) => Ok(AckMetadata::kafka(
                        topic.to_owned(),
                        delivery.partition,
                        delivery.offset,
                    )),
                    Ok(Ok(Err((err, _message)))) if is_size_refusal(&err) => {
                        Err(self.size_refusal(topic, record, &err))
                    }
                    Ok(Ok(Err((err, _message)))) => Err(publish_error_to(topic, &err)),
                    Ok(Err(_canceled)) => Err(publish_error_to(topic, &KafkaError::Canceled)),
                    Err(_elapsed) => Err(PublishError::new(
                        PublishErrorKind::Timeout,
                        format!("topic {topic:?}: no delivery report within the delivery timeout"),
                    )),
                },
            }
        }));
        // Reports still missing when the delivery timeout is up: ask whether their topics
        // still exist, while librdkafka times the records out (see `probe_topics`).
        let probe = async {
            tokio::time::sleep_until(started + self.delivery_timeout).await;
            self.probe_topics(&producer, &waiting_topics, report_deadline)
                .await
        };
        let (reports, probe) = (std::pin::pin!(reports), std::pin::pin!(probe));
        let (mut results, missing) = match futures::future::select(reports, probe).await {
            Either::Left((results, probe)) => {
                let timed_out = results
                    .iter()
                    .any(|r| matches!(r, Err(e) if e.kind == PublishErrorKind::Timeout));
                let missing = if timed_out {
                    tokio::time::timeout_at(report_deadline, probe)
                        .await
                        .ok()
                        .flatten()
                } else {
                    None
                };
                (results, missing)
            }
            Either::Right((missing, reports)) => (reports.await, missing),
        };
        if let Some(missing) = missing {
            self.name_missing_topics(batch, &mut results, &missing);
        }

        let acks: Vec<&AckMetadata> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        self.note_partitions(&acks);
        self.after_batch(generation, &producer, &results);
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> KafkaPublisherBuilder {
        KafkaPublisher::builder("127.0.0.1:1", "orders")
    }

    #[test]
    fn unsafe_overrides_are_rejected_at_build() {
        let cases = [
            ("enable.idempotence", "false"),
            ("acks", "1"),
            ("acks", "0"),
            ("max.in.flight.requests.per.connection", "6"),
            ("retries", "0"),
            ("transactional.id", "relay-1"),
            ("bootstrap.servers", "elsewhere:9092"),
            ("delivery.report.only.error", "true"),
            ("partitioner", "random"),
            ("queuing.strategy", "lifo"),
            ("some.future.property", "on"),
        ];
        for (k, v) in cases {
            let err = builder().set(k, v).build().unwrap_err();
            assert!(err.to_string().contains(k), "{k}={v}: {err}");
        }
    }

    #[test]
    fn defaults_and_enforced_settings() {
        let p = builder().build().unwrap();
        assert_eq!(p.delivery_timeout(), DEFAULT_DELIVERY_TIMEOUT);
        let cc = &p.client_config;
        assert_eq!(cc.get("enable.idempotence"), Some("true"));
        assert_eq!(cc.get("acks"), Some("all"));
        assert_eq!(cc.get("max.in.flight.requests.per.connection"), Some("5"));
        assert_eq!(cc.get("message.timeout.ms"), Some("30000"));
        assert_eq!(cc.get("allow.auto.create.topics"), Some("false"));
        assert_eq!(cc.get("delivery.report.only.error"), Some("false"));
        assert_eq!(cc.get("partitioner"), Some("murmur2_random"));
        assert_eq!(p.partitioner(), Partitioner::Murmur2Random);
        // The relay enqueues whole batches: no linger unless asked for, under either name.
        assert_eq!(cc.get("linger.ms"), Some("0"));
        let p = builder().set("linger.ms", "5").build().unwrap();
        assert_eq!(p.client_config.get("linger.ms"), Some("5"));
        let p = builder()
            .set("queue.buffering.max.ms", "7")
            .build()
            .unwrap();
        assert_eq!(p.client_config.get("linger.ms"), None);
        assert_eq!(p.client_config.get("queue.buffering.max.ms"), Some("7"));

        let p = builder()
            .set("max.in.flight.requests.per.connection", "1")
            .set("delivery.timeout.ms", "1500")
            .build()
            .unwrap();
        assert_eq!(p.delivery_timeout(), Duration::from_millis(1500));
        assert_eq!(
            p.client_config.get("max.in.flight.requests.per.connection"),
            Some("1")
        );
        assert_eq!(p.client_config.get("message.timeout.ms"), Some("1500"));
        assert_eq!(p.client_config.get("delivery.timeout.ms"), None);

        // The alias form of a stricter limit is kept too, under the canonical name.
        let p = builder().set("max.in.flight", "3").build().unwrap();
        assert_eq!(
            p.client_config.get("max.in.flight.requests.per.connection"),
            Some("3")
        );
        assert_eq!(p.client_config.get("max.in.flight"), None);

        // A key-hashing partitioner may be chosen, by property or by builder.
        let p = builder()
            .set("partitioner", "consistent_random")
            .build()
            .unwrap();
        assert_eq!(p.partitioner(), Partitioner::ConsistentRandom);
        assert_eq!(
            p.client_config.get("partitioner"),
            Some("consistent_random")
        );
        let p = builder().partitioner(Partitioner::Fnv1a).build().unwrap();
        assert_eq!(p.client_config.get("partitioner"), Some("fnv1a"));

        let p = builder()
            .delivery_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        assert_eq!(p.delivery_timeout(), Duration::from_secs(2));
        assert!(builder().delivery_timeout(Duration::ZERO).build().is_err());
    }

    #[test]
    fn routing_is_by_aggregate_type_and_topic_names_are_checked() {
        let b = builder()
            .route_aggregate("payment", "payments")
            .route_aggregate("shipment", "shipping")
            // Repeating the same route is harmless.
            .route_aggregate("payment", "payments");
        assert_eq!(b.config().topic_for_aggregate("payment"), "payments");
        assert_eq!(b.config().topic_for_aggregate("order"), "orders");
        assert_eq!(b.config().topics(), vec!["orders", "payments", "shipping"]);
        assert!(b.build().is_ok());

        // One aggregate type on two topics would split its aggregates: refused.
        let err = builder()
            .route_aggregate("order", "orders-a")
            .route_aggregate("order", "orders-b")
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"order\""), "{err}");
        assert!(
            err.contains("orders-a") && err.contains("orders-b"),
            "{err}"
        );
        assert!(err.contains("exactly one topic"), "{err}");

        assert!(builder().route_aggregate("", "t").build().is_err());
        assert!(builder().route_aggregate("x", "bad topic").build().is_err());
        assert!(KafkaPublisher::builder("b:1", "").build().is_err());
        assert!(KafkaPublisher::builder(" ", "t").build().is_err());
    }

    /// Kafka topic names are the publisher's identifiers from configuration: anything but
    /// `[a-zA-Z0-9._-]{1,249}` is refused before any client exists.
    #[test]
    fn hostile_topic_names_are_refused() {
        let long = "t".repeat(250);
        for bad in [
            "x\"; DROP TABLE victim; --",
            "orders topic",
            "",
            ".",
            "..",
            "orders/../x",
            "orders\0",
            "événements",
            long.as_str(),
        ] {
            let err = KafkaPublisher::builder("b:1", bad)
                .build()
                .expect_err(bad)
                .to_string();
            assert!(
                err.contains("not a valid Kafka topic name"),
                "{bad:?}: {err}"
            );
            assert!(
                builder().route_aggregate("order", bad).build().is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn librdkafka_refusals_do_not_leak_secrets() {
        // This librdkafka is built without OpenSSL, so an SSL key password is refused; on a
        // build with OpenSSL it is accepted. Either way the value never shows.
        if let Err(e) = builder()
            .set("ssl.key.password", "p4ss-w0rd-value")
            .set("security.protocol", "ssl")
            .build()
        {
            assert!(!e.to_string().contains("p4ss-w0rd-value"), "{e}");
        }
    }

    #[test]
    fn debug_never_shows_secrets() {
        let p = builder()
            .set("security.protocol", "sasl_plaintext")
            .set("sasl.mechanism", "PLAIN")
            .set("sasl.username", "relay")
            .set("sasl.password", "hunter2-very-secret")
            .build()
            .unwrap();
        let shown = format!("{p:?}");
        assert!(!shown.contains("hunter2-very-secret"), "{shown}");
        assert!(shown.contains("sasl.password"));
        let shown = format!("{:?}", p.config());
        assert!(!shown.contains("hunter2-very-secret"), "{shown}");
    }

    #[tokio::test]
    async fn unreachable_broker_is_a_transient_start_error_within_the_metadata_timeout() {
        let started = std::time::Instant::now();
        let err = builder()
            .metadata_timeout(Duration::from_millis(500))
            .set("log_level", "0")
            .start()
            .await
            .unwrap_err();
        match &err {
            StartError::Topics(e @ TopicCheckError::Unreachable { .. }) => {
                assert!(e.is_transient())
            }
            other => panic!("{other}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn partition_growth_seen_in_delivery_reports_is_recorded() {
        let p = builder().expect_partitions("orders", 2).build().unwrap();
        assert_eq!(p.partition_counts().get("orders"), Some(&2));
        let ack = |partition| AckMetadata::kafka("orders", partition, 0);
        p.note_partitions(&[&ack(1)]);
        assert_eq!(p.partition_counts().get("orders"), Some(&2));
        p.note_partitions(&[&ack(4)]);
        assert_eq!(p.partition_counts().get("orders"), Some(&5));
    }

    #[test]
    fn producer_is_replaced_after_consecutive_all_timed_out_batches() {
        let p = builder().build().unwrap();
        let timeout =
            || -> PublishResult { Err(PublishError::new(PublishErrorKind::Timeout, "t")) };
        let ok = || -> PublishResult { Ok(AckMetadata::kafka("orders", 0, 1)) };
        let step = |results: &[PublishResult]| {
            let (generation, producer) = p.current_producer();
            p.after_batch(generation, &producer, results);
            p.producer_generation()
        };
        assert_eq!(step(&[timeout(), timeout()]), 0);
        // A success in between resets the streak.
        assert_eq!(step(&[ok(), timeout()]), 0);
        assert_eq!(step(&[timeout()]), 0);
        assert_eq!(step(&[timeout()]), 1, "second all-timed-out batch in a row");
        // Mixed failures (not all timeouts) do not count.
        let unavailable: PublishResult = Err(PublishError::new(
            PublishErrorKind::BrokerUnavailable,
            "down",
        ));
        assert_eq!(step(&[timeout(), unavailable]), 1);
        assert_eq!(step(&[]), 1);
        // A fatal error replaces it at once.
        assert_eq!(
            step(&[Err(PublishError::new(PublishErrorKind::Fatal, "f"))]),
            2
        );

        let never = builder().rebuild_after_timeouts(0).build().unwrap();
        for _ in 0..5 {
            let (g, pr) = never.current_producer();
            never.after_batch(g, &pr, &[timeout()]);
        }
        assert_eq!(never.producer_generation(), 0);
    }

    /// A "too large" delivery report is classed by the record's own size against the limit the
    /// last topic check read (librdkafka fails every record of a refused batch alike).
    #[test]
    fn too_large_reports_are_classed_by_the_records_own_size_against_the_checked_limit() {
        let p = builder().build().unwrap();
        let small = Envelope::builder("order", "o-1", 1, "order.placed")
            .build()
            .unwrap();
        let big = Envelope::builder("order", "o-2", 1, "order.placed")
            .payload(outbox_core::Payload::new(
                "application/octet-stream",
                vec![7u8; 5_000],
            ))
            .build()
            .unwrap();
        let err = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let classed = |e: &Envelope| {
            let r = p.size_refusal("orders", e, &err);
            assert_eq!(r.kind, PublishErrorKind::RecordTooLarge);
            (r.class, r.scope)
        };
        // No topic check yet: the limit is unknown, retried as the record's own failure.
        assert_eq!(
            classed(&small),
            (ErrorClass::Transient, FailureScope::Record)
        );
        p.size_limits.lock().unwrap().insert("orders".into(), 2_000);
        assert_eq!(
            classed(&small),
            (ErrorClass::Transient, FailureScope::Transport),
            "a small record of a refused batch"
        );
        assert_eq!(classed(&big), (ErrorClass::Permanent, FailureScope::Record));
        // Another topic's limit says nothing about this one.
        let r = p.size_refusal("payments", &big, &err);
        assert_eq!(
            (r.class, r.scope),
            (ErrorClass::Transient, FailureScope::Record)
        );
    }

    #[test]
    fn headers_follow_the_wire_mapping() {
        use rdkafka::message::Headers;
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        let h = encode_headers(&e).unwrap();
        let pairs: Vec<(&str, &[u8])> = h.iter().map(|h| (h.key, h.value.unwrap_or(&[]))).collect();
        assert_eq!(wire::decode(&pairs, &e.payload.bytes).unwrap(), e);
        assert!(pairs.iter().any(|(k, _)| *k == "traceparent"));
    }
}
