//! [`KafkaSource`]: the consumer side, a [`MessageSource`] with explicit offset commits.
//!
//! See [`KafkaSource`] for how offsets move.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox_core::watermark::OffsetTracker;
use outbox_core::{
    async_trait, wire, ConfigError, ErrorClass, LogPosition, MessageSource, ReceivedMessage,
    SourceError,
};
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{check_consumer_overrides, Properties};
use crate::error::source_error;

/// Default `session.timeout.ms`: 10 s (tests use about 6 s; see the crate docs).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Supplies the offsets that are final for partitions being revoked.
///
/// Called from librdkafka's rebalance callback, on the thread that polls the consumer: it must
/// return quickly and must not block on the engine's async work.
pub trait RevokeHook: Send + Sync + 'static {
    /// `(topic, partition, next_offset)` for those of `revoked` whose outcome is final up to
    /// `next_offset` (last final offset + 1). Entries for other partitions are ignored.
    fn final_offsets(&self, revoked: &[(String, i32)]) -> Vec<(String, i32, i64)>;
}

impl RevokeHook for Mutex<OffsetTracker> {
    fn final_offsets(&self, revoked: &[(String, i32)]) -> Vec<(String, i32, i64)> {
        let mut tracker = self.lock().unwrap_or_else(PoisonError::into_inner);
        revoked
            .iter()
            .filter_map(|(t, p)| tracker.revoke(t, *p))
            .collect()
    }
}

/// A [`RevokeHook`] from a closure.
pub struct FnRevokeHook<F>(pub F);

impl<F> RevokeHook for FnRevokeHook<F>
where
    F: Fn(&[(String, i32)]) -> Vec<(String, i32, i64)> + Send + Sync + 'static,
{
    fn final_offsets(&self, revoked: &[(String, i32)]) -> Vec<(String, i32, i64)> {
        (self.0)(revoked)
    }
}

/// Where a group without committed offsets starts reading.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartFrom {
    /// The oldest retained record (`auto.offset.reset=earliest`): nothing is skipped.
    #[default]
    Earliest,
    /// Only records produced after the first assignment.
    Latest,
}

/// Configuration of a [`KafkaSource`]. Build it with [`KafkaSource::builder`].
///
/// | field | default | meaning |
/// |---|---|---|
/// | `brokers` | (required) | `bootstrap.servers` |
/// | `group_id` | (required) | consumer group |
/// | `topics` | (required, ≥ 1) | subscription |
/// | `session_timeout` | 10 s | `session.timeout.ms`; the first assignment takes about half of it |
/// | `start_from` | `Earliest` | `auto.offset.reset` |
/// | `client_id` | `outbox-consumer` | `client.id` |
/// | `properties` | empty | other librdkafka properties; secrets redacted in `Debug` |
///
/// Always set: `enable.auto.commit=false`, `enable.auto.offset.store=false`,
/// `enable.partition.eof=false`; overriding the first two with `true` is rejected.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct KafkaSourceConfig {
    /// Bootstrap servers.
    pub brokers: String,
    /// Consumer group.
    pub group_id: String,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// `session.timeout.ms`.
    pub session_timeout: Duration,
    /// `auto.offset.reset`.
    pub start_from: StartFrom,
    /// `client.id`.
    pub client_id: String,
    /// Extra librdkafka properties.
    pub properties: Properties,
}

impl KafkaSourceConfig {
    /// A configuration with the defaults above.
    pub fn new(brokers: impl Into<String>, group_id: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            group_id: group_id.into(),
            topics: Vec::new(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            start_from: StartFrom::Earliest,
            client_id: "outbox-consumer".into(),
            properties: Properties::default(),
        }
    }

    fn consumer_config(&self) -> Result<ClientConfig, ConfigError> {
        if self.brokers.trim().is_empty() {
            return Err(ConfigError::new("brokers must not be empty"));
        }
        if self.group_id.trim().is_empty() {
            return Err(ConfigError::new("group_id must not be empty"));
        }
        if self.topics.is_empty() || self.topics.iter().any(|t| t.is_empty()) {
            return Err(ConfigError::new(
                "subscribe to at least one (non-empty) topic",
            ));
        }
        if self.session_timeout < Duration::from_millis(1000)
            || self.session_timeout.as_millis() > i32::MAX as u128
        {
            return Err(ConfigError::new(format!(
                "session timeout {:?} is out of range",
                self.session_timeout
            )));
        }
        if self.properties.get("bootstrap.servers").is_some() {
            return Err(ConfigError::new(
                "bootstrap.servers: set the brokers through the builder, not as a property",
            ));
        }
        check_consumer_overrides(&self.properties)?;
        let mut cc = ClientConfig::new();
        cc.set("client.id", &self.client_id);
        cc.set(
            "auto.offset.reset",
            match self.start_from {
                StartFrom::Earliest => "earliest",
                StartFrom::Latest => "latest",
            },
        );
        cc.set(
            "session.timeout.ms",
            self.session_timeout.as_millis().to_string(),
        );
        // librdkafka requires heartbeat.interval.ms < session.timeout.ms; keep its ratio.
        let heartbeat = (self.session_timeout.as_millis() / 3).clamp(100, 3000);
        cc.set("heartbeat.interval.ms", heartbeat.to_string());
        for (k, v) in self.properties.iter() {
            cc.set(k, v);
        }
        cc.set("bootstrap.servers", &self.brokers);
        cc.set("group.id", &self.group_id);
        cc.set("enable.auto.commit", "false");
        cc.set("enable.auto.offset.store", "false");
        cc.set("enable.partition.eof", "false");
        cc.set_log_level(crate::config::log_level(&self.properties));
        Ok(cc)
    }
}

/// Builder of a [`KafkaSource`].
pub struct KafkaSourceBuilder {
    config: KafkaSourceConfig,
    hook: Option<Arc<dyn RevokeHook>>,
}

impl fmt::Debug for KafkaSourceBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSourceBuilder")
            .field("config", &self.config)
            .field("revoke_hook", &self.hook.is_some())
            .finish()
    }
}

impl KafkaSourceBuilder {
    /// Subscribes to `topic` as well.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.config.topics.push(topic.into());
        self
    }

    /// Sets `session.timeout.ms`. Default 10 s.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.config.session_timeout = timeout;
        self
    }

    /// Where a group without committed offsets starts. Default [`StartFrom::Earliest`].
    pub fn start_from(mut self, start: StartFrom) -> Self {
        self.config.start_from = start;
        self
    }

    /// Sets `client.id`. Default `outbox-consumer`.
    pub fn client_id(mut self, client_id: impl Into<String>) -> Self {
        self.config.client_id = client_id.into();
        self
    }

    /// Sets any librdkafka consumer property. Turning auto-commit or the automatic offset
    /// store on is rejected by [`build`](Self::build).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.properties.set(key, value);
        self
    }

    /// Commits what `hook` reports final when partitions are revoked.
    pub fn on_revoke(mut self, hook: Arc<dyn RevokeHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Commits the contiguous watermark of `tracker` (shared with the engine) when partitions
    /// are revoked. Shorthand for [`on_revoke`](Self::on_revoke).
    pub fn offset_tracker(self, tracker: Arc<Mutex<OffsetTracker>>) -> Self {
        self.on_revoke(tracker)
    }

    /// The configuration so far.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.config
    }

    /// Validates the configuration, creates the consumer and subscribes. Must be called inside
    /// a tokio runtime.
    pub fn build(self) -> Result<KafkaSource, ConfigError> {
        let cc = self.config.consumer_config()?;
        let revoke_log = Arc::new(Mutex::new(VecDeque::new()));
        let context = SourceContext {
            hook: self.hook,
            revoke_log: Arc::clone(&revoke_log),
        };
        let consumer: StreamConsumer<SourceContext> = cc
            .create_with_context(context)
            .map_err(|e| crate::config::refused("consumer", &e, &cc))?;
        let topics: Vec<&str> = self.config.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| ConfigError::new(format!("cannot subscribe to {topics:?}: {e}")))?;
        Ok(KafkaSource {
            consumer: Arc::new(consumer),
            config: self.config,
            revoke_log,
        })
    }
}

const REVOKE_LOG_LEN: usize = 64;

type RevokeLog = Arc<Mutex<VecDeque<(String, i32, i64)>>>;

/// Consumer context: logs, and commits final offsets on revoke.
struct SourceContext {
    hook: Option<Arc<dyn RevokeHook>>,
    revoke_log: RevokeLog,
}

impl ClientContext for SourceContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        crate::publisher::TracingContext.log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(error = %error, reason, "kafka consumer error");
    }
}

impl ConsumerContext for SourceContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(tpl) => {
                tracing::info!(partitions = ?partitions_of(tpl), "partitions assigned");
            }
            Rebalance::Revoke(tpl) => {
                let revoked = partitions_of(tpl);
                tracing::info!(partitions = ?revoked, "partitions revoked");
                self.commit_final(consumer, &revoked);
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }
}

impl SourceContext {
    fn commit_final(&self, consumer: &BaseConsumer<Self>, revoked: &[(String, i32)]) {
        let Some(hook) = &self.hook else {
            return;
        };
        if consumer.assignment_lost() {
            // The group already gave these partitions away; a commit would be refused and the
            // new owner redelivers what is not committed.
            tracing::warn!(partitions = ?revoked, "assignment lost; not committing on revoke");
            return;
        }
        let finals: Vec<(String, i32, i64)> = hook
            .final_offsets(revoked)
            .into_iter()
            .filter(|(t, p, o)| *o >= 0 && revoked.iter().any(|(rt, rp)| rt == t && rp == p))
            .collect();
        if finals.is_empty() {
            return;
        }
        let tpl = match to_tpl(&finals) {
            Ok(tpl) => tpl,
            Err(e) => {
                tracing::warn!(error = %e, "cannot build the revoke commit");
                return;
            }
        };
        match consumer.commit(&tpl, CommitMode::Sync) {
            Ok(()) => {
                tracing::info!(offsets = ?finals, "committed final offsets of revoked partitions");
                let mut log = self
                    .revoke_log
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                for f in finals {
                    if log.len() == REVOKE_LOG_LEN {
                        log.pop_front();
                    }
                    log.push_back(f);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, offsets = ?finals, "commit on revoke failed; those messages will be delivered again")
            }
        }
    }
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<(String, i32)> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_owned(), e.partition()))
        .collect()
}

fn to_tpl(offsets: &[(String, i32, i64)]) -> Result<TopicPartitionList, KafkaError> {
    let mut tpl = TopicPartitionList::with_capacity(offsets.len());
    for (topic, partition, offset) in offsets {
        tpl.add_partition_offset(topic, *partition, Offset::Offset(*offset))?;
    }
    Ok(tpl)
}

/// Converts a consumed record into a [`ReceivedMessage`]; decoding failures become a typed
/// [`wire::DecodeError`] inside the message, never a panic.
fn to_received(msg: &BorrowedMessage<'_>) -> ReceivedMessage {
    let headers: Vec<(&str, &[u8])> = msg
        .headers()
        .map(|h| h.iter().map(|h| (h.key, h.value.unwrap_or(&[]))).collect())
        .unwrap_or_default();
    let envelope = wire::decode(&headers, msg.payload().unwrap_or(&[]));
    if let Err(e) = &envelope {
        tracing::warn!(topic = msg.topic(), partition = msg.partition(), offset = msg.offset(), error = %e, "message cannot be decoded into an envelope");
    }
    ReceivedMessage::new(
        LogPosition {
            topic: msg.topic().to_owned(),
            partition: msg.partition(),
            offset: msg.offset(),
        },
        msg.key().map(<[u8]>::to_vec),
        envelope,
    )
}

/// The consumer source for the inbox engine.
///
/// # Offsets
///
/// Auto-commit and the automatic offset store are off. Offsets move only when
///
/// 1. the engine calls [`MessageSource::commit`] (after the effect's transaction committed;
///    offsets of partitions this member no longer owns are skipped), or
/// 2. partitions are revoked (rebalance, or the source is dropped) and a [`RevokeHook`] is
///    installed: the hook names the offsets that are final for the revoked partitions and they
///    are committed synchronously before the partitions go to another member.
///
/// The usual hook is the engine's [`OffsetTracker`] behind a mutex
/// ([`KafkaSourceBuilder::offset_tracker`]): the engine calls `begin`/`finish` as messages are
/// handled and `take_commits` for regular commits; on revoke the source calls
/// [`OffsetTracker::revoke`], which yields the contiguous watermark, never an offset past an
/// unfinished message. Anything not final is delivered again to the next owner.
///
/// The engine must keep calling [`poll`](MessageSource::poll): rebalances (and so the
/// revoke commits) are served while polling.
///
/// Dropping the source closes the consumer: its partitions are revoked (the [`RevokeHook`]
/// commits what is final) and the group rebalances.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<SourceContext>>,
    config: KafkaSourceConfig,
    revoke_log: RevokeLog,
}

impl fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSource")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// A builder for a source in consumer group `group_id`.
    pub fn builder(brokers: impl Into<String>, group_id: impl Into<String>) -> KafkaSourceBuilder {
        KafkaSourceBuilder {
            config: KafkaSourceConfig::new(brokers, group_id),
            hook: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.config
    }

    /// Leaves the group: revokes the partitions (the [`RevokeHook`] commits what is final) and
    /// closes the consumer, off the async worker threads. Dropping the source does the same but
    /// blocks the current thread while librdkafka closes.
    pub async fn close(self) {
        let consumer = self.consumer;
        let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
    }

    /// Partitions currently assigned to this member.
    pub fn assignment(&self) -> Result<Vec<(String, i32)>, SourceError> {
        self.consumer
            .assignment()
            .map(|tpl| partitions_of(&tpl))
            .map_err(|e| source_error("assignment", e))
    }

    /// Offsets committed on revoke so far (the most recent 64), oldest first.
    pub fn revoke_commits(&self) -> Vec<(String, i32, i64)> {
        self.revoke_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// The group's committed next offsets for `partitions` (`None` where nothing is committed).
    pub async fn committed(
        &self,
        partitions: &[(String, i32)],
        timeout: Duration,
    ) -> Result<Vec<(String, i32, Option<i64>)>, SourceError> {
        let consumer = Arc::clone(&self.consumer);
        let partitions = partitions.to_vec();
        let tpl = tokio::task::spawn_blocking(move || {
            let mut tpl = TopicPartitionList::with_capacity(partitions.len());
            for (t, p) in &partitions {
                tpl.add_partition(t, *p);
            }
            consumer.committed_offsets(tpl, timeout)
        })
        .await
        .map_err(|e| SourceError::new(ErrorClass::Transient, e.to_string()))?
        .map_err(|e| source_error("committed offsets", e))?;
        Ok(tpl
            .elements()
            .iter()
            .map(|e| {
                let offset = match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                };
                (e.topic().to_owned(), e.partition(), offset)
            })
            .collect())
    }
}

#[async_trait]
impl MessageSource for KafkaSource {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        // recv() is cancellation safe: a timeout loses no message.
        match tokio::time::timeout(timeout, self.consumer.recv()).await {
            Err(_elapsed) => Ok(None),
            Ok(Ok(msg)) => Ok(Some(to_received(&msg))),
            Ok(Err(e)) => Err(source_error("poll", e)),
        }
    }

    async fn commit(&self, offsets: &[(String, i32, i64)]) -> Result<(), SourceError> {
        if offsets.is_empty() {
            return Ok(());
        }
        if let Some((t, p, o)) = offsets.iter().find(|(_, _, o)| *o < 0) {
            return Err(SourceError::new(
                ErrorClass::Permanent,
                format!("refusing to commit negative offset {o} for {t}/{p}"),
            ));
        }
        let consumer = Arc::clone(&self.consumer);
        let offsets = offsets.to_vec();
        // A synchronous commit waits for the coordinator: keep it off the async workers.
        tokio::task::spawn_blocking(move || {
            // Offsets of partitions this member no longer owns are left out: the broker would
            // accept them and could move the new owner's position backwards. What they cover
            // is redelivered to the new owner, which at-least-once allows.
            let assigned = partitions_of(&consumer.assignment()?);
            let (mine, stale): (Vec<_>, Vec<_>) = offsets
                .into_iter()
                .partition(|(t, p, _)| assigned.iter().any(|(at, ap)| at == t && ap == p));
            if !stale.is_empty() {
                tracing::info!(offsets = ?stale, "not committing offsets of partitions no longer assigned");
            }
            if mine.is_empty() {
                return Ok(());
            }
            consumer.commit(&to_tpl(&mine)?, CommitMode::Sync)
        })
        .await
        .map_err(|e| SourceError::new(ErrorClass::Transient, format!("commit task failed: {e}")))?
        .map_err(|e| source_error("commit", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsafe_consumer_overrides_are_rejected() {
        for (k, v) in [
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
        ] {
            let err = KafkaSource::builder("127.0.0.1:1", "g")
                .topic("t")
                .set(k, v)
                .build()
                .unwrap_err();
            assert!(err.to_string().contains(k), "{err}");
        }
        assert!(KafkaSource::builder("127.0.0.1:1", "g").build().is_err());
        assert!(KafkaSource::builder("127.0.0.1:1", "")
            .topic("t")
            .build()
            .is_err());
    }

    #[test]
    fn enforced_consumer_settings() {
        let mut config = KafkaSourceConfig::new("b:1", "g");
        config.topics.push("t".into());
        config.session_timeout = Duration::from_secs(6);
        config.properties.set("enable.auto.commit", "false");
        let cc = config.consumer_config().unwrap();
        assert_eq!(cc.get("enable.auto.commit"), Some("false"));
        assert_eq!(cc.get("enable.auto.offset.store"), Some("false"));
        assert_eq!(cc.get("session.timeout.ms"), Some("6000"));
        assert_eq!(cc.get("heartbeat.interval.ms"), Some("2000"));
        assert_eq!(cc.get("auto.offset.reset"), Some("earliest"));
        assert_eq!(cc.get("group.id"), Some("g"));
    }

    #[test]
    fn tracker_hook_returns_contiguous_watermark_of_revoked_only() {
        let tracker = Mutex::new(OffsetTracker::default());
        {
            let mut t = tracker.lock().unwrap();
            for o in 0..5 {
                t.begin("a", 0, o);
                t.begin("a", 1, o);
            }
            for o in [0, 1, 3] {
                t.finish("a", 0, o);
            }
            t.finish("a", 1, 0);
        }
        let finals = tracker.final_offsets(&[("a".into(), 0)]);
        assert_eq!(finals, vec![("a".to_string(), 0, 2)]);
        // partition 1 was not revoked: still tracked
        assert_eq!(tracker.lock().unwrap().in_flight(), 4);
        let hook =
            FnRevokeHook(|r: &[(String, i32)]| r.iter().map(|(t, p)| (t.clone(), *p, 7)).collect());
        assert_eq!(
            hook.final_offsets(&[("x".into(), 2)]),
            vec![("x".into(), 2, 7)]
        );
    }
}
