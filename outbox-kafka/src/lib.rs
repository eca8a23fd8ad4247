//! # outbox-kafka
//!
//! Kafka adapters for the outbox, on [rdkafka](https://docs.rs/rdkafka) (librdkafka):
//!
//! * [`KafkaPublisher`]: the relay's [`outbox_core::Publisher`]. Idempotent producer with
//!   `acks=all`; a record counts as published only from its successful delivery report.
//! * [`KafkaSource`]: the inbox engine's [`outbox_core::MessageSource`]. Manual offsets only;
//!   the engine's offset tracker commits what is final when partitions are revoked.
//! * [`topic_retention`]: a topic's `retention.ms` and compaction, for the consumer's
//!   retention check.
//!
//! Usable alone: nothing here depends on a store.
//!
//! ## Capabilities
//!
//! | capability | status | how |
//! |---|---|---|
//! | batch enqueued whole, all reports awaited | yes | `FutureProducer::send_result` per record, then all `DeliveryFuture`s |
//! | `Ok` only from a delivery report | yes | [`outbox_core::AckMetadata`] = topic, partition, offset of the report |
//! | local queue full | retried | enqueue retried until the delivery timeout |
//! | ordering under producer retries | enforced | `enable.idempotence=true`, `acks=all`, `max.in.flight.requests.per.connection` ≤ 5; unsafe overrides are a [`outbox_core::ConfigError`] at build |
//! | producer properties | allow-list | connection, security, logging and tuning properties only; guarded ones only with safe values; anything else (e.g. `delivery.report.only.error=true`, an unknown or future property) is refused at build, naming the property and the fix ([`is_allowed_producer_property`]) |
//! | delivery reports for every record | enforced | `delivery.report.only.error=false` |
//! | delivery timeout exposed | yes | [`Publisher::delivery_timeout`](outbox_core::Publisher::delivery_timeout) = `message.timeout.ms` (default 30 s) |
//! | key | aggregate id | one aggregate → one partition |
//! | partitioner | key hash, default `murmur2_random` | keyless partitioners (`random`) refused; see [Partitioner](#partitioner) |
//! | partitioner change between runs | surfaced | [`KafkaPublisherBuilder::expect_partitioner`] → [`TopicReport::partitioner_change`], warning log, metric `outbox_kafka_partitioner_changes_total` |
//! | headers | [`outbox_core::wire`] | `event_id`, `event_type`, `schema_version`, `aggregate_*`, `content_type`, `created_at`, user headers (`traceparent`) |
//! | routing | aggregate type → topic, default topic | [`KafkaPublisherBuilder::route_aggregate`]; see [Routing](#routing) |
//! | error classes | typed | [`error::classify_code`] from `RDKafkaErrorCode`, table-tested |
//! | failure scope | typed | broker outage, batch timeouts, missing topic or leader: [`outbox_core::FailureScope::Transport`] (no attempt spent, the relay pauses as a whole); the record's own failures: `Record` ([`error`]) |
//! | topic missing mid-run | `unknown_topic`, naming the topic | timed-out records whose topic the broker no longer knows are reported as [`outbox_core::PublishErrorKind::UnknownTopic`], not as timeouts |
//! | fatal producer errors | handled | affected records fail transiently, the producer is rebuilt |
//! | stuck idempotent producer | handled | rebuilt after consecutive all-timed-out batches ([`KafkaPublisherBuilder::rebuild_after_timeouts`]) |
//! | missing topic | error at start | [`KafkaPublisher::check_topics`] / [`KafkaPublisherBuilder::start`] |
//! | batches larger than a topic accepts | error at start | the producer's largest batch (`batch.size`, `message.max.bytes`) against each topic's `max.message.bytes` ([`TopicCheckError::BatchTooLarge`]) |
//! | "too large" refusals | by the record's own size | a record over its topic's `max.message.bytes` is permanent; one that fits alone (its batch was refused) is transient, the transport's ([`size`]) |
//! | partition count change | surfaced | [`TopicReport::partition_changes`], warning log, metric `outbox_kafka_partition_count_changes_total` |
//! | compacted topics | reported | `cleanup.policy` via DescribeConfigs; [`CleanupPolicy::Unavailable`] with a warning when the broker cannot describe configs |
//! | consumer auto-commit | off, enforced | `enable.auto.commit=false`, `enable.auto.offset.store=false` |
//! | commit | synchronous, exactly the given offsets | [`outbox_core::MessageSource::commit`]; refused after a lost assignment or a rebalance code (`SourceErrorKind::Rebalanced`) |
//! | commit on revoke | what is final | the engine's tracker, handed over by [`outbox_core::MessageSource::attach_offsets`]; nothing after a lost assignment |
//! | start position | explicit per partition | [`StartFrom`]; `auto.offset.reset` refused as a property (set to `error` internally) |
//! | retention gap | stops | committed offset below the earliest: `SourceErrorKind::RetentionGap` |
//! | lag | yes | [`outbox_core::MessageSource::lag`]: committed offset vs watermarks |
//! | malformed message | typed error, raw record kept | `ReceivedMessage::envelope = Err(DecodeError)`, headers with null values and the raw value kept for parking, never a panic |
//! | transactions / exactly-once | no | the contract is at-least-once plus idempotent effect |
//!
//! Secrets set as properties (`sasl.password`, `ssl.key.password`, ...) never appear in `Debug`
//! output.
//!
//! ## Partitioner
//!
//! One aggregate's events keep their order only if they share a partition, so only partitioners
//! that hash the key (the aggregate id) are accepted; `partitioner=random` is refused at build.
//! The default is pinned to **`murmur2_random`** rather than librdkafka's own default
//! (`consistent_random`, a CRC32 hash): murmur2 is the hash of the Java client's default
//! partitioner, so Java producers (Kafka Streams, Connect, a service's own producer) that write
//! the same aggregate ids to the same topic put them on the same partitions as this publisher,
//! and a consumer sees one order per aggregate whoever produced it. The test
//! `default_partitioner_places_keys_like_the_java_client` checks every placement against the
//! Java formula `(murmur2(key) & 0x7fffffff) % partitions`.
//!
//! Changing the partitioner of a topic that already holds events moves keys to other
//! partitions, exactly like adding partitions. Both are surfaced the same way: pass what the
//! previous run recorded ([`TopicReport::partitioner`], partition counts) to
//! [`KafkaPublisherBuilder::expect_partitioner`] / [`KafkaPublisherBuilder::expect_partitions`]
//! and the first [`KafkaPublisher::check_topics`] reports the change, logs a warning and counts
//! it. A publisher upgraded from a version that used librdkafka's default keeps that mapping
//! with `.partitioner(Partitioner::ConsistentRandom)`.
//!
//! ## Routing
//!
//! Events are routed **by aggregate type**, never by event type: a consumer reading two topics
//! has no order between them, so if `order.created` went to one topic and `order.paid` to
//! another, a consumer of both could apply the payment first. With
//! [`KafkaPublisherBuilder::route_aggregate`] every event of an aggregate goes to its type's
//! topic (or the default topic), and the key puts it on one partition there. Routing one
//! aggregate type to two topics is refused at build.
//!
//! ## Example
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_core::watermark::SharedOffsetTracker;
//! use outbox_core::{Envelope, MessageSource, Publisher};
//! use outbox_kafka::{KafkaPublisher, KafkaSource};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Producer side: fails here if a topic is missing, instead of at the first timeout.
//! let publisher = KafkaPublisher::builder("localhost:9092", "orders")
//!     .route_aggregate("payment", "payments")
//!     .delivery_timeout(Duration::from_secs(20))
//!     .start()
//!     .await?;
//! let report = publisher.topic_report().expect("checked at start");
//! for t in report.compacted() {
//!     eprintln!("warning: {} is compacted", t.name);
//! }
//! let event = Envelope::builder("order", "o-1", 1, "order.created").build()?;
//! let results = publisher.publish(&[&event]).await;
//! let ack = results[0].as_ref().map_err(|e| e.to_string())?;
//! println!("stored at {ack}"); // topic/partition@offset
//!
//! // Consumer side: normally `outbox_inbox::ConsumerEngine` does this; by hand, the tracker
//! // is handed to the source once, so a revoke commits exactly what is final.
//! let source = KafkaSource::builder("localhost:9092", "billing")
//!     .topic("orders")
//!     .build()?;
//! let tracker = SharedOffsetTracker::new();
//! source.attach_offsets(tracker.clone());
//! if let Some(msg) = source.poll(Duration::from_secs(1)).await? {
//!     let ticket = tracker.lock().begin(&msg.position);
//!     // ... apply the effect and commit its transaction (or park a malformed message) ...
//!     tracker.lock().finish(&ticket);
//!     let commits = tracker.lock().take_commits();
//!     source.commit(&commits).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! ## Against tansu
//!
//! The tests run against [tansu](https://crates.io/crates/tansu) 0.6 (a Kafka-compatible broker)
//! or a real cluster named by `KAFKA_BROKERS`. Differences found there:
//!
//! * tansu does not enforce `max.message.bytes`; the oversize test uses the producer's
//!   `message.max.bytes`, which librdkafka enforces before sending (same permanent error kind).
//! * DescribeConfigs lists only properties set when the topic was created, so `cleanup.policy`
//!   is [`CleanupPolicy::NotReported`] for a topic created without it (Kafka's default is
//!   `delete`).
//! * The high watermark is understated when the last batch holds several records (base offset
//!   of the last batch + 1). Nothing here relies on watermarks, but tansu itself does: **a fetch
//!   that starts inside a multi-record batch returns nothing** until a later batch raises the
//!   watermark past the fetch offset. A consumer that resumes at a committed offset in the
//!   middle of such a batch therefore waits (seen: 8 records in one batch, resume at offset 3,
//!   nothing within 30 s). The tests that resume mid-stream publish one record per request.
//!   Kafka serves such fetches normally.
//! * After a restart with memory storage, tansu does not know the idempotent producer's id and
//!   answers `UNKNOWN_PRODUCER_ID` to every retry of librdkafka's locally bumped epochs, which
//!   is never fatal: all records time out, batch after batch. The publisher replaces a producer
//!   after [`DEFAULT_REBUILD_AFTER_TIMEOUTS`] such batches in a row (the same can happen on
//!   Kafka after producer-id expiry).
//! * tansu has no CreatePartitions; the partition-change check is tested with
//!   [`KafkaPublisherBuilder::expect_partitions`].
//! * After DeleteTopics, tansu's metadata no longer lists the topic, but it still acknowledges
//!   records produced to it by a client that has the leader cached (Kafka answers
//!   `UNKNOWN_TOPIC_OR_PARTITION`). The deleted-topic test lets the producer refresh its
//!   metadata first (`topic.metadata.refresh.interval.ms=500`).

mod config;
pub mod error;
pub mod partitioner;
mod publisher;
mod retention;
pub mod size;
mod source;
mod topics;

pub use config::{is_allowed_producer_property, is_secret_key, Properties, MAX_IN_FLIGHT_LIMIT};
pub use partitioner::{KeyHash, Partitioner, DEFAULT_PARTITIONER};
pub use publisher::{
    validate_topic_name, KafkaPublisher, KafkaPublisherBuilder, KafkaPublisherConfig, StartError,
    DEFAULT_DELIVERY_TIMEOUT, DEFAULT_LINGER_MS, DEFAULT_METADATA_TIMEOUT,
    DEFAULT_REBUILD_AFTER_TIMEOUTS, REPORT_GRACE,
};
pub use retention::{topic_retention, TopicRetentionInfo};
pub use source::{
    KafkaSource, KafkaSourceBuilder, KafkaSourceConfig, StartFrom, DEFAULT_SESSION_TIMEOUT,
};
pub use topics::{
    check_batch_fits, CleanupPolicy, PartitionChange, PartitionerChange, TopicCheckError,
    TopicInfo, TopicReport,
};
