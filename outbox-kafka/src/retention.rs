//! Reading a topic's retention from the broker, for the consumer's retention check
//! ([`outbox_core::retention`]).

use std::time::Duration;

use outbox_core::retention::{RetentionCheck, TopicRetention};
use outbox_core::{ConfigError, ErrorClass, SourceError};
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;

/// What the broker says about a topic's retention.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopicRetentionInfo {
    /// The topic.
    pub topic: String,
    /// `retention.ms` ([`TopicRetention::Unknown`] when the broker does not report it, as tansu
    /// does for a topic created without it).
    pub retention: TopicRetention,
    /// `cleanup.policy` contains `compact`.
    pub compacted: bool,
}

impl TopicRetentionInfo {
    /// A retention check of `dedup_retention` against this topic.
    pub fn check(&self, dedup_retention: Option<Duration>) -> RetentionCheck {
        RetentionCheck::new(dedup_retention, self.retention).compacted(self.compacted)
    }
}

pub(crate) fn parse(
    topic: &str,
    retention_ms: Option<&str>,
    policy: Option<&str>,
) -> Result<TopicRetentionInfo, SourceError> {
    let retention = match retention_ms {
        None => TopicRetention::Unknown,
        Some(v) => TopicRetention::from_millis(v.trim().parse::<i64>().map_err(|e| {
            SourceError::new(
                ErrorClass::Permanent,
                format!("retention.ms of {topic} is not a number ({v:?}): {e}"),
            )
        })?),
    };
    let compacted = policy.is_some_and(|p| p.split(',').any(|x| x.trim() == "compact"));
    Ok(TopicRetentionInfo {
        topic: topic.to_owned(),
        retention,
        compacted,
    })
}

/// Reads `retention.ms` and `cleanup.policy` of `topics` (DescribeConfigs).
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use outbox_core::retention::Strictness;
/// let day = Duration::from_secs(86_400);
/// let info = outbox_kafka::topic_retention("localhost:9092", &["orders"], Duration::from_secs(5))
///     .await?;
/// // Refuse to start when the inbox forgets events sooner than Kafka can redeliver them.
/// info[0]
///     .check(Some(14 * day))
///     .max_lag(day)
///     .replay_window(2 * day)
///     .evaluate(Strictness::Refuse)?;
/// # Ok(()) }
/// ```
pub async fn topic_retention(
    brokers: &str,
    topics: &[&str],
    timeout: Duration,
) -> Result<Vec<TopicRetentionInfo>, SourceError> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(|e| {
            SourceError::new(
                ErrorClass::Permanent,
                ConfigError::new(e.to_string()).to_string(),
            )
        })?;
    // Some brokers (tansu) answer DescribeConfigs for a topic that does not exist with an
    // empty config: check existence through the metadata first.
    let probe = topics.iter().map(|t| (*t).to_owned()).collect::<Vec<_>>();
    let admin = std::sync::Arc::new(admin);
    let meta_admin = std::sync::Arc::clone(&admin);
    let missing = tokio::task::spawn_blocking(move || {
        let mut missing = Vec::new();
        for t in &probe {
            match meta_admin.inner().fetch_metadata(Some(t), timeout) {
                Ok(md) => {
                    let found = md.topics().iter().any(|mt| {
                        mt.name() == t && mt.error().is_none() && !mt.partitions().is_empty()
                    });
                    if !found {
                        missing.push(t.clone());
                    }
                }
                Err(e) => return Err(crate::error::source_error("topic metadata", e)),
            }
        }
        Ok(missing)
    })
    .await
    .map_err(|e| SourceError::new(ErrorClass::Transient, e.to_string()))??;
    if !missing.is_empty() {
        return Err(SourceError::new(
            ErrorClass::Permanent,
            format!("topics do not exist: {missing:?}"),
        ));
    }
    let specs: Vec<ResourceSpecifier<'_>> =
        topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
    let opts = AdminOptions::new().request_timeout(Some(timeout));
    let results = tokio::time::timeout(
        timeout + Duration::from_secs(1),
        admin.describe_configs(specs.iter(), &opts),
    )
    .await
    .map_err(|_| {
        SourceError::new(
            ErrorClass::Transient,
            format!("no DescribeConfigs answer within {timeout:?}"),
        )
    })?
    .map_err(|e| crate::error::source_error("describe configs", e))?;
    let mut out = Vec::with_capacity(topics.len());
    for (topic, r) in topics.iter().zip(results) {
        let resource = r.map_err(|code| {
            SourceError::new(
                ErrorClass::Permanent,
                format!("DescribeConfigs failed for {topic:?}: {code}"),
            )
        })?;
        out.push(parse(
            topic,
            resource
                .get("retention.ms")
                .and_then(|e| e.value.as_deref()),
            resource
                .get("cleanup.policy")
                .and_then(|e| e.value.as_deref()),
        )?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_table() {
        let day = Duration::from_secs(86_400);
        let cases = [
            (
                Some("604800000"),
                Some("delete"),
                TopicRetention::Limited(7 * day),
                false,
            ),
            (Some("-1"), None, TopicRetention::Unlimited, false),
            (None, Some("compact,delete"), TopicRetention::Unknown, true),
            (None, Some("compact"), TopicRetention::Unknown, true),
        ];
        for (ms, policy, retention, compacted) in cases {
            let r = parse("t", ms, policy).unwrap();
            assert_eq!(
                (r.retention, r.compacted),
                (retention, compacted),
                "{ms:?} {policy:?}"
            );
        }
        let e = parse("t", Some("soon"), None).unwrap_err();
        assert!(e.to_string().contains("retention.ms of t"), "{e}");
    }
}
