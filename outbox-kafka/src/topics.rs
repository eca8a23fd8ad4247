//! Topic checks on start: existence, partition count, partitioner, cleanup policy, and the
//! producer's batch size against the topic's `max.message.bytes` (see [`crate::size`]).
//!
//! A publisher whose topic does not exist would otherwise wait for metadata until the delivery
//! timeout of every record; [`crate::KafkaPublisher::check_topics`] turns that into a clear error
//! at start. The partition count is recorded because a change of it moves keys to other
//! partitions (per-aggregate order across the change is then not guaranteed); a change of the
//! partitioner between runs moves keys just the same and is reported the same way (see
//! [`crate::Partitioner`]). Compacted
//! topics are reported because compaction may remove intermediate facts that consumers replaying
//! the topic would need.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaResult;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::metadata::Metadata;
use rdkafka::types::RDKafkaRespErr;

use crate::partitioner::Partitioner;

/// The `cleanup.policy` of a topic, as far as the broker reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CleanupPolicy {
    /// Time/size-based deletion only.
    Delete,
    /// Log compaction: older records of a key may disappear.
    Compact,
    /// Both compaction and deletion.
    CompactDelete,
    /// The broker answered but did not list `cleanup.policy` for the topic (tansu 0.6 lists
    /// only properties set at creation; Kafka's default is `delete`).
    NotReported,
    /// The configuration could not be read (the broker lacks DescribeConfigs, or the request
    /// failed). The reason is kept for the log.
    Unavailable(String),
}

impl CleanupPolicy {
    /// Parses a `cleanup.policy` value (`delete`, `compact`, `compact,delete`).
    pub fn parse(value: &str) -> Self {
        let mut compact = false;
        let mut delete = false;
        for part in value.split(',') {
            match part.trim().to_ascii_lowercase().as_str() {
                "compact" => compact = true,
                "delete" => delete = true,
                _ => {}
            }
        }
        match (compact, delete) {
            (true, true) => Self::CompactDelete,
            (true, false) => Self::Compact,
            _ => Self::Delete,
        }
    }

    /// `true` if the topic is compacted (intermediate facts may vanish).
    pub fn is_compacted(&self) -> bool {
        matches!(self, Self::Compact | Self::CompactDelete)
    }
}

/// What the broker said about one topic.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicInfo {
    /// Topic name.
    pub name: String,
    /// Number of partitions.
    pub partitions: usize,
    /// Cleanup policy.
    pub cleanup_policy: CleanupPolicy,
    /// `max.message.bytes` (the largest record batch the topic accepts), when the broker
    /// reports it (tansu 0.6 reports it only when it was set at creation).
    pub max_message_bytes: Option<u64>,
}

/// A partition count that differs from the one recorded earlier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionChange {
    /// Topic name.
    pub topic: String,
    /// Count recorded before.
    pub before: usize,
    /// Count now.
    pub after: usize,
}

/// A partitioner that maps keys differently from the one of the previous run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartitionerChange {
    /// The partitioner expected (recorded at the previous run).
    pub before: Partitioner,
    /// The partitioner in force now.
    pub after: Partitioner,
    /// The topics whose keys move.
    pub topics: Vec<String>,
}

/// Result of a successful topic check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicReport {
    /// Every checked topic, in name order.
    pub topics: Vec<TopicInfo>,
    /// Partition counts that changed since the previous check.
    pub partition_changes: Vec<PartitionChange>,
    /// The partitioner in force; record it with the partition counts for the next start.
    pub partitioner: Partitioner,
    /// The partitioner maps keys differently from the expected one (reported once).
    pub partitioner_change: Option<PartitionerChange>,
}

impl TopicReport {
    /// Topics that are compacted.
    pub fn compacted(&self) -> impl Iterator<Item = &TopicInfo> {
        self.topics
            .iter()
            .filter(|t| t.cleanup_policy.is_compacted())
    }

    /// The info of `topic`, if it was checked.
    pub fn topic(&self, topic: &str) -> Option<&TopicInfo> {
        self.topics.iter().find(|t| t.name == topic)
    }
}

/// Why the topic check failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TopicCheckError {
    /// These topics do not exist (create them, or fix the routing).
    Missing {
        /// Missing topic names.
        topics: Vec<String>,
    },
    /// The broker reported an error for a topic other than "unknown".
    Topic {
        /// Topic name.
        topic: String,
        /// The broker's error code.
        code: RDKafkaErrorCode,
    },
    /// Metadata could not be fetched (broker unreachable within the metadata timeout).
    Unreachable {
        /// Detail.
        message: String,
    },
    /// The producer builds record batches larger than the topic accepts: the broker would
    /// refuse a whole batch of records that each fit (see [`crate::size`]).
    BatchTooLarge {
        /// Topic name.
        topic: String,
        /// The topic's `max.message.bytes`.
        max_message_bytes: u64,
        /// The producer's largest batch ([`crate::size::producer_batch_bytes`]).
        batch_bytes: u64,
    },
}

impl fmt::Display for TopicCheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Missing { topics } => write!(
                f,
                "topic(s) {topics:?} do not exist on the broker; create them before starting the \
                 publisher (automatic topic creation is not used)"
            ),
            Self::Topic { topic, code } => {
                write!(f, "broker reported {code} for topic {topic:?}")
            }
            Self::Unreachable { message } => {
                write!(f, "could not read topic metadata: {message}")
            }
            Self::BatchTooLarge {
                topic,
                max_message_bytes,
                batch_bytes,
            } => write!(
                f,
                "topic {topic:?} accepts record batches of at most {max_message_bytes} bytes \
                 (max.message.bytes), but the producer builds batches of up to {batch_bytes} \
                 bytes (the smaller of batch.size and message.max.bytes): the broker would \
                 refuse a whole batch of small records, and librdkafka fails every record of it. \
                 Set the producer property batch.size to at most {max_message_bytes}, or raise \
                 the topic's max.message.bytes"
            ),
        }
    }
}

impl std::error::Error for TopicCheckError {}

impl TopicCheckError {
    /// `true` if retrying later can succeed without a change by a person.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Missing { .. } | Self::BatchTooLarge { .. } => false,
            Self::Topic { code, .. } => crate::error::classify_code(*code)
                .1
                .eq(&outbox_core::ErrorClass::Transient),
            Self::Unreachable { .. } => true,
        }
    }
}

pub(crate) type Admin = Arc<AdminClient<DefaultClientContext>>;

/// Reads partition counts (metadata), cleanup policies and `max.message.bytes`
/// (DescribeConfigs) of `topics`.
pub(crate) async fn describe_topics(
    admin: &Admin,
    topics: &[String],
    timeout: Duration,
) -> Result<Vec<TopicInfo>, TopicCheckError> {
    let admin2 = Arc::clone(admin);
    let fetch = move |topic: &str, timeout| admin2.inner().fetch_metadata(Some(topic), timeout);
    let (counts, missing) = partition_counts(fetch, topics, timeout).await?;
    if !missing.is_empty() {
        return Err(TopicCheckError::Missing { topics: missing });
    }
    let mut configs = describe_topic_configs(admin, topics, timeout).await;
    Ok(counts
        .into_iter()
        .map(|(name, partitions)| {
            let (cleanup_policy, max_message_bytes) = configs
                .remove(&name)
                .unwrap_or((CleanupPolicy::NotReported, None));
            TopicInfo {
                name,
                partitions,
                cleanup_policy,
                max_message_bytes,
            }
        })
        .collect())
}

/// Those of `topics` that the broker says do not exist, asked with `fetch` (a client's
/// metadata request) within `timeout` in all. An error when the
/// broker did not answer (then nothing is known about the topics).
pub(crate) async fn missing_topics<F>(
    fetch: F,
    topics: &[String],
    timeout: Duration,
) -> Result<Vec<String>, TopicCheckError>
where
    F: Fn(&str, Duration) -> KafkaResult<Metadata> + Clone + Send + 'static,
{
    match tokio::time::timeout(timeout, partition_counts(fetch, topics, timeout)).await {
        Ok(result) => result.map(|(_, missing)| missing),
        Err(_) => Err(TopicCheckError::Unreachable {
            message: format!("no metadata answer within {timeout:?}"),
        }),
    }
}

/// Partition counts of the topics that exist, and the names of those that do not, from
/// metadata requests made by `fetch`.
async fn partition_counts<F>(
    fetch: F,
    topics: &[String],
    timeout: Duration,
) -> Result<(BTreeMap<String, usize>, Vec<String>), TopicCheckError>
where
    F: Fn(&str, Duration) -> KafkaResult<Metadata> + Clone + Send + 'static,
{
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut missing = Vec::new();
    for topic in topics {
        let fetch = fetch.clone();
        let name = topic.clone();
        // fetch_metadata blocks on the network: keep it off the async worker threads.
        let metadata = tokio::task::spawn_blocking(move || fetch(&name, timeout))
            .await
            .map_err(|e| TopicCheckError::Unreachable {
                message: e.to_string(),
            })?
            .map_err(|e| TopicCheckError::Unreachable {
                message: e.to_string(),
            })?;
        let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
            missing.push(topic.clone());
            continue;
        };
        match t.error() {
            None if !t.partitions().is_empty() => {
                counts.insert(topic.clone(), t.partitions().len());
            }
            None
            | Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART)
            | Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR__UNKNOWN_TOPIC) => {
                missing.push(topic.clone());
            }
            Some(err) => {
                return Err(TopicCheckError::Topic {
                    topic: topic.clone(),
                    code: err.into(),
                })
            }
        }
    }
    Ok((counts, missing))
}

/// Cleanup policies and `max.message.bytes` by topic. Never fails: a broker without
/// DescribeConfigs (or a failed request) yields [`CleanupPolicy::Unavailable`] (and no size
/// limit) with a warning, because the policy is advice to the operator, not a precondition of
/// publishing, and an unknown limit only leaves "too large" refusals unclassified
/// ([`crate::size::SizeVerdict::Unknown`]).
async fn describe_topic_configs(
    admin: &Admin,
    topics: &[String],
    timeout: Duration,
) -> BTreeMap<String, (CleanupPolicy, Option<u64>)> {
    let specs: Vec<ResourceSpecifier<'_>> = topics
        .iter()
        .map(|t| ResourceSpecifier::Topic(t.as_str()))
        .collect();
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let unavailable = |reason: String| -> BTreeMap<String, (CleanupPolicy, Option<u64>)> {
        tracing::warn!(
            reason = %reason,
            "could not read the configuration of the outbox topics (DescribeConfigs); \
             compacted topics cannot be reported, and max.message.bytes is unknown"
        );
        topics
            .iter()
            .map(|t| {
                (
                    t.clone(),
                    (CleanupPolicy::Unavailable(reason.clone()), None),
                )
            })
            .collect()
    };
    let results = match tokio::time::timeout(
        timeout + Duration::from_secs(1),
        admin.describe_configs(specs.iter(), &opts),
    )
    .await
    {
        Err(_) => return unavailable(format!("no DescribeConfigs answer within {timeout:?}")),
        Ok(Err(e)) => return unavailable(e.to_string()),
        Ok(Ok(results)) => results,
    };
    let mut out = BTreeMap::new();
    for (topic, result) in topics.iter().zip(results) {
        let (policy, max_message_bytes) = match result {
            Ok(resource) => (
                match resource
                    .get("cleanup.policy")
                    .and_then(|e| e.value.as_deref())
                {
                    Some(v) => CleanupPolicy::parse(v),
                    None => CleanupPolicy::NotReported,
                },
                resource
                    .get("max.message.bytes")
                    .and_then(|e| e.value.as_deref())
                    .and_then(|v| v.trim().parse().ok()),
            ),
            Err(code) => {
                let reason = format!("DescribeConfigs failed for {topic:?}: {code}");
                tracing::warn!(topic = %topic, reason = %reason, "cleanup.policy and max.message.bytes unknown");
                (CleanupPolicy::Unavailable(reason), None)
            }
        };
        if policy.is_compacted() {
            tracing::warn!(
                topic = %topic,
                "outbox topic is compacted: older events of an aggregate may be removed by \
                 compaction, so consumers replaying the topic can miss intermediate facts"
            );
        }
        out.insert(topic.clone(), (policy, max_message_bytes));
    }
    out
}

/// [`TopicCheckError::BatchTooLarge`] for the first topic of `limits` (name and
/// `max.message.bytes`, as [`TopicInfo`] holds them) whose limit is below `batch_bytes` (the
/// producer's largest batch, [`crate::size::producer_batch_bytes`]); topics that report no
/// limit pass.
pub fn check_batch_fits<'a>(
    limits: impl IntoIterator<Item = (&'a str, Option<u64>)>,
    batch_bytes: u64,
) -> Result<(), TopicCheckError> {
    for (topic, limit) in limits {
        if let Some(limit) = limit.filter(|l| batch_bytes > *l) {
            return Err(TopicCheckError::BatchTooLarge {
                topic: topic.to_owned(),
                max_message_bytes: limit,
                batch_bytes,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleanup_policy_parse_table() {
        let table = [
            ("delete", CleanupPolicy::Delete),
            ("compact", CleanupPolicy::Compact),
            ("compact,delete", CleanupPolicy::CompactDelete),
            ("delete, compact", CleanupPolicy::CompactDelete),
            ("COMPACT", CleanupPolicy::Compact),
            ("", CleanupPolicy::Delete),
        ];
        for (v, expect) in table {
            assert_eq!(CleanupPolicy::parse(v), expect, "{v:?}");
        }
        assert!(CleanupPolicy::Compact.is_compacted());
        assert!(!CleanupPolicy::NotReported.is_compacted());
        assert!(!CleanupPolicy::Unavailable("x".into()).is_compacted());
    }

    /// The degraded mode: a broker that cannot describe topic configs (here: none answers at
    /// all) yields `Unavailable` with the reason for every topic, never an error.
    #[tokio::test]
    async fn cleanup_policy_degrades_when_configs_cannot_be_described() {
        let admin: Admin = Arc::new(
            rdkafka::ClientConfig::new()
                .set("bootstrap.servers", "127.0.0.1:1")
                .set("log_level", "0")
                .create()
                .unwrap(),
        );
        let topics = vec!["a".to_string(), "b".to_string()];
        let configs = describe_topic_configs(&admin, &topics, Duration::from_millis(300)).await;
        assert_eq!(configs.len(), 2);
        for (topic, (policy, limit)) in configs {
            assert_eq!(limit, None, "{topic}");
            match policy {
                CleanupPolicy::Unavailable(reason) => assert!(!reason.is_empty(), "{topic}"),
                other => panic!("{topic}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_producer_batch_must_fit_every_topic_that_reports_a_limit() {
        let topics = [
            ("unreported", None),
            ("roomy", Some(2_000_000)),
            ("small", Some(50_000)),
        ];
        assert_eq!(check_batch_fits(topics, 50_000), Ok(()));
        assert_eq!(
            check_batch_fits(topics[..2].iter().copied(), 1_000_000),
            Ok(())
        );
        let err = check_batch_fits(topics, 1_000_000).unwrap_err();
        assert_eq!(
            err,
            TopicCheckError::BatchTooLarge {
                topic: "small".into(),
                max_message_bytes: 50_000,
                batch_bytes: 1_000_000
            }
        );
        assert!(!err.is_transient());
        let shown = err.to_string();
        assert!(
            shown.contains("\"small\"") && shown.contains("batch.size to at most 50000"),
            "{shown}"
        );
    }

    #[test]
    fn missing_topics_are_a_permanent_clear_error() {
        let e = TopicCheckError::Missing {
            topics: vec!["orders".into()],
        };
        assert!(!e.is_transient());
        assert!(e.to_string().contains("\"orders\""));
        assert!(e.to_string().contains("do not exist"));
        assert!(TopicCheckError::Unreachable {
            message: "x".into()
        }
        .is_transient());
    }
}
