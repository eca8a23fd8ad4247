//! The broker side: the publisher from the configuration (errors with host and fix), topic
//! facts through the admin API (partitions, replication, `min.insync.replicas`,
//! `retention.ms`, `cleanup.policy`, `max.message.bytes`) and consumer groups' lag through a plain consumer.
//!
//! Everything that talks to a broker needs the cargo feature `kafka` (rdkafka); the facts'
//! types are plain data and stay in every build (the pure comparisons of `topics` use them).

#[cfg(feature = "kafka")]
use std::collections::BTreeMap;
#[cfg(feature = "kafka")]
use std::time::Duration;

#[cfg(feature = "kafka")]
use outbox_kafka::{KafkaPublisher, Partitioner, StartError, TopicCheckError};
#[cfg(feature = "kafka")]
use outbox_postgres::RecordedTopic;
#[cfg(feature = "kafka")]
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
#[cfg(feature = "kafka")]
use rdkafka::client::DefaultClientContext;
#[cfg(feature = "kafka")]
use rdkafka::consumer::{BaseConsumer, Consumer};
#[cfg(feature = "kafka")]
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;

#[cfg(feature = "kafka")]
use crate::config::Config;
#[cfg(feature = "kafka")]
use crate::error::CliError;

#[cfg(feature = "kafka")]
/// Producer properties shared with admin and consumer clients (connection and security only).
fn connection_props(config: &Config) -> impl Iterator<Item = (&String, &String)> {
    config.kafka.producer.0.iter().filter(|(k, _)| {
        [
            "security.",
            "sasl.",
            "ssl.",
            "socket.",
            "broker.address.",
            "client.dns.",
        ]
        .iter()
        .any(|p| k.starts_with(p))
    })
}

#[cfg(feature = "kafka")]
/// A client configuration for admin requests and lag reads.
pub fn client_config(config: &Config) -> Result<ClientConfig, CliError> {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", config.brokers()?);
    cc.set("client.id", format!("{}-admin", config.kafka.client_id));
    cc.set("log_level", "3");
    for (k, v) in connection_props(config) {
        cc.set(k, v);
    }
    Ok(cc)
}

#[cfg(feature = "kafka")]
/// Builds the publisher without contacting the broker: every producer setting is checked
/// (allow-list, guarded values, routes), so that a configuration error is reported as one even
/// while the broker is down.
pub fn build_publisher(config: &Config) -> Result<KafkaPublisher, CliError> {
    let brokers = config.brokers()?;
    publisher_builder(config, &[])?
        .build()
        .map_err(|e| start_error(StartError::Config(e), brokers))
}

#[cfg(feature = "kafka")]
/// Builds and starts the publisher (topic check included), comparing with `recorded` facts so
/// that a partition count or partitioner change is reported.
pub async fn start_publisher(
    config: &Config,
    recorded: &[RecordedTopic],
) -> Result<KafkaPublisher, CliError> {
    let brokers = config.brokers()?;
    publisher_builder(config, recorded)?
        .start()
        .await
        .map_err(|e| start_error(e, brokers))
}

#[cfg(feature = "kafka")]
fn publisher_builder(
    config: &Config,
    recorded: &[RecordedTopic],
) -> Result<outbox_kafka::KafkaPublisherBuilder, CliError> {
    let k = &config.kafka;
    let brokers = config.brokers()?;
    let mut b = KafkaPublisher::builder(brokers, &k.topic)
        .delivery_timeout(k.delivery_timeout.0)
        .metadata_timeout(k.metadata_timeout.0)
        .client_id(&k.client_id);
    for (agg, topic) in &k.routes {
        b = b.route_aggregate(agg, topic);
    }
    for (key, v) in &k.producer.0 {
        b = b.set(key, v);
    }
    for r in recorded {
        b = b.expect_partitions(&r.topic, r.partitions as usize);
    }
    if let Some(p) = recorded
        .first()
        .and_then(|r| Partitioner::parse(&r.partitioner).ok())
    {
        b = b.expect_partitioner(p);
    }
    Ok(b)
}

#[cfg(feature = "kafka")]
fn start_error(e: StartError, brokers: &str) -> CliError {
    match e {
        StartError::Config(c) => CliError::config(
            format!("Kafka producer configuration refused: {}", c.0),
            "fix [kafka] (producer properties are an allow-list; see the message for the \
             property and its fix)",
        ),
        StartError::Topics(t) => topic_error(&t, brokers),
        other => CliError::failed(other.to_string()),
    }
}

#[cfg(feature = "kafka")]
/// The error for a failed topic check.
pub fn topic_error(t: &TopicCheckError, brokers: &str) -> CliError {
    match t {
        TopicCheckError::Missing { topics } => CliError::not_ready(
            format!("topic(s) {topics:?} do not exist on the broker at {brokers}"),
            "create them: `outbox topics create` (partitions, replication, retention by the \
             retention rule; --dry-run prints the kafka-topics.sh commands); automatic topic \
             creation is not used. Or fix kafka.topic / kafka.routes",
        ),
        TopicCheckError::BatchTooLarge {
            topic,
            max_message_bytes,
            ..
        } => CliError::config(
            format!("broker at {brokers}: {t}"),
            format!(
                "set kafka.producer \"batch.size\" = {max_message_bytes} (or less), or raise \
                 max.message.bytes of topic {topic:?}"
            ),
        ),
        TopicCheckError::Unreachable { message } => CliError::unreachable(
            format!("cannot reach the Kafka broker(s) at {brokers}: {message}"),
            "check that the brokers run and that kafka.brokers (KAFKA_BROKERS) names them; \
             raise kafka.metadata_timeout for a slow network",
        ),
        other => CliError::failed(format!("broker at {brokers}: {other}")),
    }
}

/// What the broker says about one topic.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct TopicFacts {
    /// Topic.
    pub topic: String,
    /// Partition count.
    pub partitions: usize,
    /// Smallest replica count over the partitions.
    pub replication_factor: usize,
    /// `min.insync.replicas` if reported.
    pub min_insync_replicas: Option<u32>,
    /// `retention.ms` if reported (-1: unlimited).
    pub retention_ms: Option<i64>,
    /// `cleanup.policy` if reported.
    pub cleanup_policy: Option<String>,
    /// `max.message.bytes` if reported.
    pub max_message_bytes: Option<u64>,
}

#[cfg(feature = "kafka")]
/// Facts of `topics`; `Ok(None)` entries are topics the broker does not know.
pub async fn describe_topics(
    config: &Config,
    topics: &[String],
) -> Result<BTreeMap<String, Option<TopicFacts>>, CliError> {
    let brokers = config.brokers()?.to_owned();
    let timeout = config.kafka.metadata_timeout.0;
    let admin: AdminClient<DefaultClientContext> = client_config(config)?
        .create()
        .map_err(|e| CliError::config(format!("Kafka client: {e}"), "fix [kafka]"))?;
    let mut out = BTreeMap::new();
    let mut present = Vec::new();
    for topic in topics {
        let md = {
            let t = topic.clone();
            let inner = admin.inner();
            inner.fetch_metadata(Some(&t), timeout)
        }
        .map_err(|e| {
            topic_error(
                &TopicCheckError::Unreachable {
                    message: e.to_string(),
                },
                &brokers,
            )
        })?;
        let facts = md
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .and_then(|t| {
                (t.error().is_none() && !t.partitions().is_empty()).then(|| TopicFacts {
                    topic: topic.clone(),
                    partitions: t.partitions().len(),
                    replication_factor: t
                        .partitions()
                        .iter()
                        .map(|p| p.replicas().len())
                        .min()
                        .unwrap_or(0),
                    min_insync_replicas: None,
                    retention_ms: None,
                    cleanup_policy: None,
                    max_message_bytes: None,
                })
            });
        if facts.is_some() {
            present.push(topic.clone());
        }
        out.insert(topic.clone(), facts);
    }
    if !present.is_empty() {
        let specs: Vec<ResourceSpecifier<'_>> = present
            .iter()
            .map(|t| ResourceSpecifier::Topic(t.as_str()))
            .collect();
        let opts = AdminOptions::new().request_timeout(Some(timeout));
        if let Ok(Ok(results)) = tokio::time::timeout(
            timeout + Duration::from_secs(1),
            admin.describe_configs(specs.iter(), &opts),
        )
        .await
        {
            for (topic, result) in present.iter().zip(results) {
                let Ok(resource) = result else { continue };
                let get = |k: &str| resource.get(k).and_then(|e| e.value.clone());
                if let Some(Some(f)) = out.get_mut(topic) {
                    f.min_insync_replicas = get("min.insync.replicas").and_then(|v| v.parse().ok());
                    f.retention_ms = get("retention.ms").and_then(|v| v.parse().ok());
                    f.cleanup_policy = get("cleanup.policy");
                    f.max_message_bytes =
                        get("max.message.bytes").and_then(|v| v.trim().parse().ok());
                }
            }
        }
    }
    Ok(out)
}

/// One partition's lag for a consumer group.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PartitionLag {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The group's committed next offset (`None`: nothing committed).
    pub committed: Option<i64>,
    /// Earliest offset still in the log.
    pub low: i64,
    /// End of the log (high watermark).
    pub high: i64,
    /// Records between the committed offset (or the start) and the end.
    pub lag: i64,
    /// The committed offset fell below the earliest retained offset: records were lost to
    /// retention before this group read them.
    pub below_retention: bool,
}

#[cfg(feature = "kafka")]
/// Lag of `group` on `topics`, from committed offsets and watermarks. Against tansu the high
/// watermark is understated (see `services.md`), so lag reads low there; on Kafka it is exact.
pub async fn consumer_lag(
    config: &Config,
    group: &str,
    topics: &[String],
) -> Result<Vec<PartitionLag>, CliError> {
    let brokers = config.brokers()?.to_owned();
    let timeout = config.kafka.metadata_timeout.0;
    let mut cc = client_config(config)?;
    cc.set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false");
    let topics = topics.to_vec();
    tokio::task::spawn_blocking(move || -> Result<Vec<PartitionLag>, CliError> {
        let consumer: BaseConsumer = cc
            .create()
            .map_err(|e| CliError::config(format!("Kafka consumer: {e}"), "fix [kafka]"))?;
        let unreachable = |e: rdkafka::error::KafkaError| {
            topic_error(
                &TopicCheckError::Unreachable {
                    message: e.to_string(),
                },
                &brokers,
            )
        };
        let mut tpl = TopicPartitionList::new();
        for topic in &topics {
            let md = consumer
                .fetch_metadata(Some(topic), timeout)
                .map_err(unreachable)?;
            for t in md.topics().iter().filter(|t| t.name() == topic) {
                for p in t.partitions() {
                    tpl.add_partition(topic, p.id());
                }
            }
        }
        let committed = consumer
            .committed_offsets(tpl.clone(), timeout)
            .map_err(unreachable)?;
        let mut out = Vec::new();
        for e in committed.elements() {
            let (low, high) = consumer
                .fetch_watermarks(e.topic(), e.partition(), timeout)
                .map_err(unreachable)?;
            let committed = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            let from = committed.unwrap_or(low).max(low);
            out.push(PartitionLag {
                topic: e.topic().to_owned(),
                partition: e.partition(),
                committed,
                low,
                high,
                lag: (high - from).max(0),
                below_retention: committed.is_some_and(|c| c < low),
            });
        }
        Ok(out)
    })
    .await
    .map_err(|e| CliError::failed(e.to_string()))?
}
