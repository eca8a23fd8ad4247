//! [`KafkaSource`]: the consumer side, a [`MessageSource`] with explicit offset commits.
//!
//! See [`KafkaSource`] for how offsets move.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, CommitOffset, ConfigError, ErrorClass, LogPosition, MessageSource, PartitionLag,
    ReceivedMessage, RecordHeader, SourceError, TopicPartition,
};
use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use crate::config::{check_consumer_overrides, Properties};
use crate::error::source_error;

/// Default `session.timeout.ms`: 10 s (tests use about 6 s; see the crate docs).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long calls made from the rebalance callback (committed offsets, watermarks, the revoke
/// commit) may wait for the broker.
const CALLBACK_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a partition without a committed offset starts reading.
///
/// The source decides this itself when a partition is assigned (it sets the start offset of
/// every partition without a committed offset explicitly), so the librdkafka property
/// `auto.offset.reset` is not used for it and is refused as a property: it would silently
/// override this choice. librdkafka's own reset runs only for an offset that is out of range,
/// and the source answers that itself (see [`KafkaSource`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StartFrom {
    /// The oldest retained record: nothing is skipped.
    #[default]
    Earliest,
    /// The end of the partition at the moment the partition is assigned to the group **for
    /// the first time** (the group has no committed offset for it). The source commits that
    /// position at once, so a later re-assignment (a rebalance before anything was processed,
    /// a restart) resumes there: records produced after the first assignment are never
    /// skipped, whichever member reads them. (Without that commit, every assignment of a
    /// partition without a committed offset would start at the then current end, and a
    /// rebalance would skip what arrived in between.)
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
/// | `start_from` | `Earliest` | where a partition without a committed offset starts ([`StartFrom`]) |
/// | `client_id` | `outbox-consumer` | `client.id` |
/// | `properties` | empty | other librdkafka properties; secrets redacted in `Debug` |
///
/// Always set: `enable.auto.commit=false`, `enable.auto.offset.store=false`,
/// `enable.partition.eof=false`, `auto.offset.reset=error`; overriding the first two with
/// `true` is rejected, and so is any `auto.offset.reset` (use [`StartFrom`]).
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
    /// Where a partition without a committed offset starts.
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
        for key in ["auto.offset.reset", "offset.store.method"] {
            if self.properties.get(key).is_some() {
                return Err(ConfigError::new(format!(
                    "{key} is refused as a property: where a partition without a committed \
                     offset starts is set with KafkaSourceBuilder::start_from, and an offset \
                     out of range is answered by the source (never a silent jump)"
                )));
            }
        }
        check_consumer_overrides(&self.properties)?;
        let mut cc = ClientConfig::new();
        cc.set("client.id", &self.client_id);
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
        // Start offsets are set explicitly on assignment; an out-of-range offset is reported
        // to the source instead of being reset silently.
        cc.set("auto.offset.reset", "error");
        cc.set_log_level(crate::config::log_level(&self.properties));
        Ok(cc)
    }
}

/// Builder of a [`KafkaSource`].
#[derive(Debug)]
pub struct KafkaSourceBuilder {
    config: KafkaSourceConfig,
    failing_assign_reads: u32,
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

    /// Where a partition without a committed offset starts. Default [`StartFrom::Earliest`].
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
    /// store on, and `auto.offset.reset`, are rejected by [`build`](Self::build).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.properties.set(key, value);
        self
    }

    /// The configuration so far.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.config
    }

    /// Test seam (fault injection): the next `n` committed-offsets reads made when partitions
    /// are assigned fail without reaching the broker. Not for production use.
    #[doc(hidden)]
    pub fn fail_committed_reads_on_assignment(mut self, n: u32) -> Self {
        self.failing_assign_reads = n;
        self
    }

    /// Validates the configuration, creates the consumer and subscribes. Must be called inside
    /// a tokio runtime.
    pub fn build(self) -> Result<KafkaSource, ConfigError> {
        let cc = self.config.consumer_config()?;
        let shared = Arc::new(Shared::default());
        shared.failing_assign_reads.store(
            self.failing_assign_reads,
            std::sync::atomic::Ordering::SeqCst,
        );
        let context = SourceContext {
            shared: Arc::clone(&shared),
            start_from: self.config.start_from,
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
            shared,
        })
    }
}

const REVOKE_LOG_LEN: usize = 64;

/// State shared by the source and its rebalance callback.
#[derive(Default)]
struct Shared {
    tracker: Mutex<Option<SharedOffsetTracker>>,
    revoke_log: Mutex<VecDeque<CommitOffset>>,
    /// An error found in a callback, returned by the next poll.
    pending_error: Mutex<Option<SourceError>>,
    /// Assigned partitions whose committed offset could not be read on assignment: the poll
    /// finds their start (committed offset, or the configured start) and seeks there.
    unresolved: Mutex<Vec<TopicPartition>>,
    /// When the poll last tried to resolve them.
    last_resolve: Mutex<Option<std::time::Instant>>,
    /// Test seam: committed-offsets reads on assignment that fail before reaching the broker.
    failing_assign_reads: std::sync::atomic::AtomicU32,
}

impl Shared {
    fn tracker(&self) -> Option<SharedOffsetTracker> {
        self.tracker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn unresolved(&self) -> std::sync::MutexGuard<'_, Vec<TopicPartition>> {
        self.unresolved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn fail(&self, e: SourceError) {
        *self
            .pending_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(e);
    }
}

/// Attempts of the committed-offsets read made on assignment, and the pauses between them.
const ASSIGN_READ_PAUSES_MS: [u64; 2] = [100, 400];

/// How often a poll tries again to find the start of partitions whose start is unknown.
const RESOLVE_EVERY: Duration = Duration::from_millis(500);

/// Consumer context: logs, sets start offsets and checks retention on assignment, and
/// commits final offsets on revoke.
struct SourceContext {
    shared: Arc<Shared>,
    start_from: StartFrom,
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
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let partitions = partitions_of(tpl);
        let result = match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                tracing::info!(partitions = ?partitions, "partitions assigned");
                if let Some(t) = self.shared.tracker() {
                    t.assign(&partitions);
                }
                self.set_start_offsets(consumer, tpl);
                let assigned = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                // A new assignment starts unpaused (librdkafka keeps a partition paused across
                // a revoke and a re-assignment): the engine pauses what it needs again.
                if assigned.is_ok() {
                    if let Err(e) = consumer.resume(tpl) {
                        tracing::warn!(error = %e, "cannot resume newly assigned partitions");
                    }
                }
                assigned
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                tracing::info!(partitions = ?partitions, lost = consumer.assignment_lost(), "partitions revoked");
                self.commit_final(consumer, &partitions);
                if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                }
            }
            other => {
                let code: RDKafkaErrorCode = other.into();
                tracing::warn!(error = %code, "rebalance error; dropping the assignment");
                if let Some(t) = self.shared.tracker() {
                    t.lose(&partitions);
                }
                consumer.unassign()
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "applying the rebalance failed");
        }
    }
}

/// What to do with an assigned partition, from its committed offset and watermarks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StartDecision {
    /// Resume at the committed offset.
    Committed,
    /// No committed offset: start at the beginning.
    Beginning,
    /// No committed offset: start at this end offset and commit it.
    EndCommitted(i64),
    /// The committed offset is below the earliest available one: records were lost.
    Gap {
        /// Committed next offset.
        committed: i64,
        /// Earliest available offset.
        earliest: i64,
    },
}

pub(crate) fn decide_start(
    committed: Option<i64>,
    watermarks: Option<(i64, i64)>,
    start_from: StartFrom,
) -> StartDecision {
    match (committed, watermarks, start_from) {
        (Some(c), Some((low, _)), _) if c < low => StartDecision::Gap {
            committed: c,
            earliest: low,
        },
        (Some(_), _, _) => StartDecision::Committed,
        (None, _, StartFrom::Earliest) => StartDecision::Beginning,
        (None, Some((_, high)), StartFrom::Latest) => StartDecision::EndCommitted(high),
        // Watermarks unknown: start at the end without committing it.
        (None, None, StartFrom::Latest) => StartDecision::EndCommitted(-1),
    }
}

impl SourceContext {
    /// Sets an explicit start offset on every assigned partition without a committed offset
    /// and checks the committed ones against the earliest available offset.
    fn set_start_offsets(&self, consumer: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let mut attempt = 0;
        let committed = loop {
            let read = if self
                .shared
                .failing_assign_reads
                .fetch_update(
                    std::sync::atomic::Ordering::SeqCst,
                    std::sync::atomic::Ordering::SeqCst,
                    |n| n.checked_sub(1),
                )
                .is_ok()
            {
                Err(KafkaError::MetadataFetch(
                    RDKafkaErrorCode::OperationTimedOut,
                ))
            } else {
                consumer.committed_offsets(tpl.clone(), CALLBACK_TIMEOUT)
            };
            match read {
                Ok(c) => break c,
                Err(e) if attempt < ASSIGN_READ_PAUSES_MS.len() => {
                    tracing::warn!(error = %e, attempt = attempt + 1, "cannot read committed offsets on assignment; trying again");
                    std::thread::sleep(Duration::from_millis(ASSIGN_READ_PAUSES_MS[attempt]));
                    attempt += 1;
                }
                Err(e) => {
                    // The partitions keep no explicit start: librdkafka fetches their committed
                    // offsets itself, and one without a committed offset would stop at
                    // auto.offset.reset=error. The poll finds their start (the committed
                    // offset, or the configured start) and seeks there.
                    let partitions = partitions_of(tpl);
                    tracing::warn!(error = %e, partitions = ?partitions, "cannot read committed offsets on assignment; the next polls find the start of these partitions");
                    self.shared.unresolved().extend(partitions);
                    return;
                }
            }
        };
        // These are resolved now (a re-assignment of a partition whose start was unknown).
        {
            let now = partitions_of(tpl);
            self.shared.unresolved().retain(|p| !now.contains(p));
        }
        let mut gaps = Vec::new();
        let mut to_commit = Vec::new();
        for e in committed.elements() {
            let (topic, partition) = (e.topic().to_owned(), e.partition());
            let c = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            let watermarks = consumer
                .fetch_watermarks(&topic, partition, CALLBACK_TIMEOUT)
                .map_err(|err| {
                    tracing::warn!(topic = %topic, partition, error = %err, "watermarks unknown on assignment");
                })
                .ok();
            let set = |tpl: &mut TopicPartitionList, o: Offset| {
                if let Err(err) = tpl.set_partition_offset(&topic, partition, o) {
                    tracing::warn!(topic = %topic, partition, error = %err, "cannot set the start offset");
                }
            };
            match decide_start(c, watermarks, self.start_from) {
                StartDecision::Committed => {}
                StartDecision::Beginning => set(tpl, Offset::Beginning),
                StartDecision::EndCommitted(high) if high >= 0 => {
                    set(tpl, Offset::Offset(high));
                    to_commit.push(CommitOffset::new(topic.clone(), partition, high));
                }
                StartDecision::EndCommitted(_) => set(tpl, Offset::End),
                StartDecision::Gap {
                    committed,
                    earliest,
                } => gaps.push(format!(
                    "{topic}/{partition}: committed next offset {committed} < earliest available \
                     {earliest} ({} records lost to retention)",
                    earliest - committed
                )),
            }
        }
        if !to_commit.is_empty() {
            // StartFrom::Latest: remember the start so a re-assignment resumes here.
            match to_tpl(&to_commit).and_then(|t| consumer.commit(&t, CommitMode::Sync)) {
                Ok(()) => {
                    tracing::info!(offsets = ?to_commit, "committed the start position of new partitions")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot commit the start position; a re-assignment may start later")
                }
            }
        }
        if !gaps.is_empty() {
            let e = SourceError::retention_gap(format!(
                "the group's committed offsets fell below the earliest available offsets: {}",
                gaps.join("; ")
            ));
            tracing::error!(error = %e, "records were lost to retention before this group read them");
            self.shared.fail(e);
        }
    }

    fn commit_final(&self, consumer: &BaseConsumer<Self>, revoked: &[TopicPartition]) {
        let Some(tracker) = self.shared.tracker() else {
            tracing::warn!(partitions = ?revoked, "no offset tracker attached; nothing committed on revoke");
            return;
        };
        if consumer.assignment_lost() {
            // The group already gave these partitions away; a commit would be refused or,
            // worse, move the new owner's position. The new owner redelivers what is not
            // committed.
            tracing::warn!(partitions = ?revoked, "assignment lost; not committing on revoke");
            tracker.lose(revoked);
            return;
        }
        let finals: Vec<CommitOffset> = tracker
            .revoke(revoked)
            .into_iter()
            .filter(|c| c.next_offset >= 0)
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
                    .shared
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

fn partitions_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| TopicPartition::new(e.topic(), e.partition()))
        .collect()
}

fn tpl_of(partitions: &[TopicPartition]) -> Result<TopicPartitionList, KafkaError> {
    let mut tpl = TopicPartitionList::with_capacity(partitions.len());
    for p in partitions {
        tpl.add_partition(&p.topic, p.partition);
    }
    Ok(tpl)
}

fn to_tpl(offsets: &[CommitOffset]) -> Result<TopicPartitionList, KafkaError> {
    let mut tpl = TopicPartitionList::with_capacity(offsets.len());
    for c in offsets {
        tpl.add_partition_offset(&c.topic, c.partition, Offset::Offset(c.next_offset))?;
    }
    Ok(tpl)
}

/// A commit error that means "the group moved on": the commits are dropped, the engine polls
/// again (which serves the rebalance). Table-tested.
pub(crate) fn is_rebalance_code(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::UnknownMemberId
            | RDKafkaErrorCode::IllegalGeneration
            | RDKafkaErrorCode::RebalanceInProgress
            | RDKafkaErrorCode::FencedInstanceId
            | RDKafkaErrorCode::StaleMemberEpoch
            | RDKafkaErrorCode::AssignmentLost
    )
}

fn commit_error(err: KafkaError) -> SourceError {
    let code = match &err {
        KafkaError::ConsumerCommit(code) => Some(*code),
        other => other.rdkafka_error_code(),
    };
    match code {
        Some(c) if is_rebalance_code(c) => {
            SourceError::rebalanced(format!("commit refused by a rebalance: {err}"))
                .with_source(err)
        }
        _ => source_error("commit", err),
    }
}

/// Converts a consumed record into a [`ReceivedMessage`]: raw headers (null values kept), raw
/// value, broker timestamp; decoding failures become a typed [`outbox_core::DecodeError`]
/// inside the message, never a panic.
fn to_received(msg: &BorrowedMessage<'_>) -> ReceivedMessage {
    let headers: Vec<RecordHeader> = msg
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| RecordHeader {
                    name: h.key.to_owned(),
                    value: h.value.map(<[u8]>::to_vec),
                })
                .collect()
        })
        .unwrap_or_default();
    let timestamp = msg
        .timestamp()
        .to_millis()
        .and_then(DateTime::<Utc>::from_timestamp_millis);
    let m = ReceivedMessage::from_record(
        LogPosition::new(msg.topic(), msg.partition(), msg.offset()),
        msg.key().map(<[u8]>::to_vec),
        headers,
        msg.payload().map(<[u8]>::to_vec),
        timestamp,
    );
    if let Err(e) = &m.envelope {
        tracing::warn!(topic = msg.topic(), partition = msg.partition(), offset = msg.offset(), error = %e, "message cannot be decoded into an envelope");
    }
    m
}

/// Where an out-of-range partition stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum OutOfRange {
    /// Below the earliest offset: records were deleted before they were read.
    Lost { position: i64, earliest: i64 },
    /// Beyond the end: the log lost records (or the topic was recreated). Reading starts
    /// again at the earliest offset: redelivery, never loss.
    Beyond { earliest: i64 },
    /// In range now (a transient out-of-range during a leader change).
    InRange { position: i64 },
}

pub(crate) fn classify_out_of_range(position: i64, low: i64, high: i64) -> OutOfRange {
    if position < low {
        OutOfRange::Lost {
            position,
            earliest: low,
        }
    } else if position > high {
        OutOfRange::Beyond { earliest: low }
    } else {
        OutOfRange::InRange { position }
    }
}

/// The consumer source for the inbox engine.
///
/// # Offsets
///
/// Auto-commit and the automatic offset store are off. Offsets move only when
///
/// 1. the engine calls [`MessageSource::commit`] after the effect's transaction committed.
///    Offsets of partitions this member no longer owns are skipped; when the member's
///    assignment was lost (it stalled past `max.poll.interval.ms` and the group gave its
///    partitions away, a state the assignment list does not show until the next poll serves
///    the revoke) nothing is committed and the call fails with
///    [`outbox_core::SourceErrorKind::Rebalanced`], as it does when the broker refuses the
///    commit with `UNKNOWN_MEMBER_ID`, `ILLEGAL_GENERATION` or `REBALANCE_IN_PROGRESS`. The
///    engine drops those commits and polls again.
/// 2. partitions are revoked (rebalance, or the source is closed): the offsets the engine's
///    tracker ([`MessageSource::attach_offsets`]) holds final for them are committed
///    synchronously before they go to another member, never an offset past an unfinished
///    message. A lost assignment commits nothing.
/// 3. a partition without a committed offset is assigned with [`StartFrom::Latest`]: its start
///    position is committed at once.
///
/// On assignment the tracker forgets what it held for the partitions (reading resumes at the
/// committed offsets), every partition without a committed offset gets an explicit start
/// offset ([`StartFrom`]), and a committed offset below the earliest available one (records
/// deleted by retention before the group read them) makes the next poll fail with
/// [`outbox_core::SourceErrorKind::RetentionGap`], naming the partitions and the gap.
/// `auto.offset.reset` is `error`: when an offset becomes out of range while reading, the
/// source looks at every assigned partition: one below the earliest offset is a retention gap
/// (the poll fails, nothing is skipped); one beyond the end (the broker lost records, the topic
/// was recreated) is read again from its earliest offset, which the engine sees as a rewind.
///
/// The engine must keep calling [`poll`](MessageSource::poll): rebalances (and so the
/// revoke commits) are served while polling.
///
/// Dropping the source closes the consumer: its partitions are revoked (final offsets
/// committed) and the group rebalances.
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<SourceContext>>,
    config: KafkaSourceConfig,
    shared: Arc<Shared>,
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
            failing_assign_reads: 0,
            config: KafkaSourceConfig::new(brokers, group_id),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaSourceConfig {
        &self.config
    }

    /// Leaves the group: revokes the partitions (final offsets committed) and closes the
    /// consumer, off the async worker threads. Dropping the source does the same but blocks the
    /// current thread while librdkafka closes.
    pub async fn close(self) {
        let consumer = self.consumer;
        let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
    }

    /// Partitions currently assigned to this member.
    pub fn assignment(&self) -> Result<Vec<TopicPartition>, SourceError> {
        self.consumer
            .assignment()
            .map(|tpl| partitions_of(&tpl))
            .map_err(|e| source_error("assignment", e))
    }

    /// Whether the group took this member's assignment away (it has not polled since).
    pub fn assignment_lost(&self) -> bool {
        self.consumer.assignment_lost()
    }

    /// Offsets committed on revoke so far (the most recent 64), oldest first.
    pub fn revoke_commits(&self) -> Vec<CommitOffset> {
        self.shared
            .revoke_log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// The group's committed next offsets for `partitions` (`None` where nothing is committed).
    pub async fn committed(
        &self,
        partitions: &[TopicPartition],
        timeout: Duration,
    ) -> Result<Vec<(TopicPartition, Option<i64>)>, SourceError> {
        let consumer = Arc::clone(&self.consumer);
        let partitions = partitions.to_vec();
        let tpl = tokio::task::spawn_blocking(move || {
            let mut tpl = TopicPartitionList::with_capacity(partitions.len());
            for p in &partitions {
                tpl.add_partition(&p.topic, p.partition);
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
                (TopicPartition::new(e.topic(), e.partition()), offset)
            })
            .collect())
    }

    /// Answers `auto.offset.reset=error`: a partition below its earliest offset is a retention
    /// gap; one beyond its end is read again from its earliest offset.
    fn out_of_range(
        consumer: &StreamConsumer<SourceContext>,
        start_from: StartFrom,
    ) -> SourceError {
        let positions = match consumer.position() {
            Ok(p) => p,
            Err(e) => return source_error("offset out of range; positions unknown", e),
        };
        let mut lost = Vec::new();
        let mut actions = Vec::new();
        let mut no_position = Vec::new();
        for e in positions.elements() {
            let Offset::Offset(pos) = e.offset() else {
                // No position: a partition without a committed offset (or whose committed
                // offset could not be read) stopped at auto.offset.reset=error. It is started
                // where the configuration says, below.
                no_position.push(TopicPartition::new(e.topic(), e.partition()));
                continue;
            };
            let (topic, partition) = (e.topic(), e.partition());
            let Ok((low, high)) = consumer.fetch_watermarks(topic, partition, CALLBACK_TIMEOUT)
            else {
                continue;
            };
            match classify_out_of_range(pos, low, high) {
                OutOfRange::Lost { position, earliest } => lost.push(format!(
                    "{topic}/{partition}: next offset {position} < earliest available {earliest} \
                     ({} records lost to retention)",
                    earliest - position
                )),
                OutOfRange::Beyond { earliest } => {
                    tracing::warn!(topic, partition, position = pos, end = high, earliest, "offset beyond the end of the partition (records lost on the broker or topic recreated); reading again from the earliest offset");
                    match consumer.seek(
                        topic,
                        partition,
                        Offset::Offset(earliest),
                        CALLBACK_TIMEOUT,
                    ) {
                        Ok(()) => actions.push(format!(
                            "{topic}/{partition} read again from its earliest offset {earliest}"
                        )),
                        Err(err) => {
                            tracing::warn!(topic, partition, error = %err, "seek failed")
                        }
                    }
                }
                OutOfRange::InRange { .. } => {}
            }
        }
        if !no_position.is_empty() {
            match Self::start_unresolved(consumer, &no_position, start_from) {
                Ok(mut done) => actions.append(&mut done),
                Err(e) => {
                    tracing::warn!(error = %e, partitions = ?no_position, "cannot find where these partitions start; trying again at a later poll");
                    consumer.context().shared.unresolved().extend(no_position);
                }
            }
        }
        if lost.is_empty() {
            SourceError::new(
                ErrorClass::Transient,
                if actions.is_empty() {
                    "an offset was out of range; nothing could be started yet (see the \
                     warnings); polling again"
                        .to_owned()
                } else {
                    format!(
                        "an offset was out of range: {}; polling again",
                        actions.join("; ")
                    )
                },
            )
        } else {
            SourceError::retention_gap(format!(
                "records were deleted before this group read them: {}",
                lost.join("; ")
            ))
        }
    }
}

impl KafkaSource {
    /// Starts `partitions`, assigned without a known position, where they belong: at the
    /// committed offset when the group has one, else where [`StartFrom`] says (the start
    /// position committed for [`StartFrom::Latest`]). A committed offset below the earliest
    /// available one is a retention gap, reported by the next poll. Returns what it did.
    fn start_unresolved(
        consumer: &StreamConsumer<SourceContext>,
        partitions: &[TopicPartition],
        start_from: StartFrom,
    ) -> Result<Vec<String>, KafkaError> {
        let mut tpl = TopicPartitionList::with_capacity(partitions.len());
        for p in partitions {
            tpl.add_partition(&p.topic, p.partition);
        }
        let committed = consumer.committed_offsets(tpl, CALLBACK_TIMEOUT)?;
        let assigned = consumer.assignment()?;
        let mut done = Vec::new();
        let mut to_commit = Vec::new();
        let mut starts = Vec::new();
        for e in committed.elements() {
            let (topic, partition) = (e.topic(), e.partition());
            if assigned.find_partition(topic, partition).is_none() {
                continue; // revoked meanwhile
            }
            let c = match e.offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            };
            let watermarks = consumer
                .fetch_watermarks(topic, partition, CALLBACK_TIMEOUT)
                .ok();
            let target = match decide_start(c, watermarks, start_from) {
                StartDecision::Committed => c.map(Offset::Offset),
                StartDecision::Beginning => Some(Offset::Beginning),
                StartDecision::EndCommitted(high) if high >= 0 => {
                    to_commit.push(CommitOffset::new(topic, partition, high));
                    Some(Offset::Offset(high))
                }
                StartDecision::EndCommitted(_) => Some(Offset::End),
                StartDecision::Gap {
                    committed,
                    earliest,
                } => {
                    consumer
                        .context()
                        .shared
                        .fail(SourceError::retention_gap(format!(
                            "{topic}/{partition}: committed next offset {committed} < earliest \
                         available {earliest} ({} records lost to retention)",
                            earliest - committed
                        )));
                    None
                }
            };
            if let Some(offset) = target {
                starts.push((TopicPartition::new(topic, partition), offset));
                done.push(format!("{topic}/{partition} started at {offset:?}"));
            }
        }
        if !starts.is_empty() {
            Self::restart_at(consumer, &starts)?;
        }
        if !to_commit.is_empty() {
            consumer.commit(&to_tpl(&to_commit)?, CommitMode::Sync)?;
        }
        tracing::info!(started = ?done, "partitions without a known position started");
        Ok(done)
    }

    /// Starts fetching each partition of `starts` at its offset. A partition stopped by
    /// `auto.offset.reset=error` is not being fetched, and librdkafka refuses to seek it; it
    /// is assigned again with the offset instead: alone under the cooperative protocol; under
    /// the eager one with the whole assignment, every other partition at its current position
    /// (where delivery goes on: nothing skipped, nothing delivered twice).
    fn restart_at(
        consumer: &StreamConsumer<SourceContext>,
        starts: &[(TopicPartition, Offset)],
    ) -> Result<(), KafkaError> {
        let mut stopped = Vec::new();
        for (p, offset) in starts {
            if let Err(e) = consumer.seek(&p.topic, p.partition, *offset, CALLBACK_TIMEOUT) {
                tracing::debug!(partition = %p, error = %e, "seek refused; assigning the partition again");
                stopped.push((p, *offset));
            }
        }
        if stopped.is_empty() {
            return Ok(());
        }
        if matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        ) {
            let mut tpl = TopicPartitionList::with_capacity(stopped.len());
            for (p, offset) in &stopped {
                tpl.add_partition_offset(&p.topic, p.partition, *offset)?;
            }
            consumer.incremental_unassign(&tpl)?;
            return consumer.incremental_assign(&tpl);
        }
        let assigned = consumer.assignment()?;
        let positions = consumer.position()?;
        let mut tpl = TopicPartitionList::with_capacity(assigned.count());
        for e in assigned.elements() {
            let (topic, partition) = (e.topic(), e.partition());
            let offset = match stopped
                .iter()
                .find(|(p, _)| p.topic == topic && p.partition == partition)
            {
                Some((_, o)) => *o,
                None => positions
                    .find_partition(topic, partition)
                    .map(|p| p.offset())
                    .filter(|o| matches!(o, Offset::Offset(_)))
                    .unwrap_or(Offset::Invalid),
            };
            tpl.add_partition_offset(topic, partition, offset)?;
        }
        consumer.assign(&tpl)
    }

    /// Finds the start of the partitions whose committed offset could not be read on
    /// assignment, at most every [`RESOLVE_EVERY`]. librdkafka may have found a position for
    /// some of them by itself; those are left alone.
    async fn resolve_unresolved(&self) {
        let due = {
            let mut last = self
                .shared
                .last_resolve
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if self.shared.unresolved().is_empty()
                || last.is_some_and(|l| l.elapsed() < RESOLVE_EVERY)
            {
                false
            } else {
                *last = Some(std::time::Instant::now());
                true
            }
        };
        if !due {
            return;
        }
        let consumer = Arc::clone(&self.consumer);
        let start_from = self.config.start_from;
        let _ = tokio::task::spawn_blocking(move || {
            let waiting: Vec<TopicPartition> =
                std::mem::take(&mut *consumer.context().shared.unresolved());
            let positions = match consumer.position() {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(error = %e, "positions unknown; trying again later");
                    consumer.context().shared.unresolved().extend(waiting);
                    return;
                }
            };
            let without: Vec<TopicPartition> = waiting
                .into_iter()
                .filter(|p| {
                    !matches!(
                        positions
                            .find_partition(&p.topic, p.partition)
                            .map(|e| e.offset()),
                        Some(Offset::Offset(_))
                    )
                })
                .collect();
            if without.is_empty() {
                return;
            }
            if let Err(e) = Self::start_unresolved(&consumer, &without, start_from) {
                tracing::warn!(error = %e, partitions = ?without, "cannot find where these partitions start; trying again later");
                consumer.context().shared.unresolved().extend(without);
            }
        })
        .await;
    }
}

#[async_trait]
impl MessageSource for KafkaSource {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        if let Some(e) = self
            .shared
            .pending_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            return Err(e);
        }
        self.resolve_unresolved().await;
        // recv() is cancellation safe: a timeout loses no message.
        match tokio::time::timeout(timeout, self.consumer.recv()).await {
            Err(_elapsed) => Ok(None),
            Ok(Ok(msg)) => Ok(Some(to_received(&msg))),
            Ok(Err(KafkaError::MessageConsumption(RDKafkaErrorCode::AutoOffsetReset))) => {
                let consumer = Arc::clone(&self.consumer);
                let start_from = self.config.start_from;
                let e =
                    tokio::task::spawn_blocking(move || Self::out_of_range(&consumer, start_from))
                        .await
                        .map_err(|e| SourceError::new(ErrorClass::Transient, e.to_string()))?;
                Err(e)
            }
            Ok(Err(e)) => Err(source_error("poll", e)),
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        if offsets.is_empty() {
            return Ok(());
        }
        if let Some(c) = offsets.iter().find(|c| c.next_offset < 0) {
            return Err(SourceError::new(
                ErrorClass::Permanent,
                format!("refusing to commit negative offset {c}"),
            ));
        }
        let consumer = Arc::clone(&self.consumer);
        let offsets = offsets.to_vec();
        // A synchronous commit waits for the coordinator: keep it off the async workers.
        tokio::task::spawn_blocking(move || {
            if consumer.assignment_lost() {
                return Err(SourceError::rebalanced(
                    "the group took this member's assignment away (max.poll.interval.ms \
                     exceeded or session lost); its commits are dropped",
                ));
            }
            // Offsets of partitions this member no longer owns are left out: the broker would
            // accept them and could move the new owner's position backwards. What they cover
            // is redelivered to the new owner, which at-least-once allows.
            let assigned = partitions_of(
                &consumer
                    .assignment()
                    .map_err(|e| source_error("assignment", e))?,
            );
            let (mine, stale): (Vec<_>, Vec<_>) = offsets
                .into_iter()
                .partition(|c| assigned.contains(&c.topic_partition()));
            if !stale.is_empty() {
                tracing::info!(offsets = ?stale, "not committing offsets of partitions no longer assigned");
            }
            if mine.is_empty() {
                return Ok(());
            }
            let tpl = to_tpl(&mine).map_err(|e| source_error("commit", e))?;
            consumer.commit(&tpl, CommitMode::Sync).map_err(commit_error)
        })
        .await
        .map_err(|e| SourceError::new(ErrorClass::Transient, format!("commit task failed: {e}")))?
    }

    /// Pauses with librdkafka's `pause`: it drops what it fetched of those partitions and
    /// remembers the position after the last message handed out, so `resume` fetches from
    /// exactly there. A partition not assigned is ignored by librdkafka.
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        let tpl = tpl_of(partitions).map_err(|e| source_error("pause", e))?;
        self.consumer
            .pause(&tpl)
            .map_err(|e| source_error("pause", e))?;
        Ok(true)
    }

    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        let tpl = tpl_of(partitions).map_err(|e| source_error("resume", e))?;
        self.consumer
            .resume(&tpl)
            .map_err(|e| source_error("resume", e))
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self
            .shared
            .tracker
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(offsets);
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        let consumer = Arc::clone(&self.consumer);
        tokio::task::spawn_blocking(move || {
            let assigned = consumer
                .assignment()
                .map_err(|e| source_error("assignment", e))?;
            let committed = consumer
                .committed_offsets(assigned, CALLBACK_TIMEOUT)
                .map_err(|e| source_error("committed offsets", e))?;
            let mut out = Vec::new();
            for e in committed.elements() {
                let (low, high) = consumer
                    .fetch_watermarks(e.topic(), e.partition(), CALLBACK_TIMEOUT)
                    .map_err(|err| source_error("watermarks", err))?;
                let c = match e.offset() {
                    Offset::Offset(o) => Some(o),
                    _ => None,
                };
                out.push(PartitionLag::new(
                    TopicPartition::new(e.topic(), e.partition()),
                    c,
                    low,
                    high,
                ));
            }
            Ok(out)
        })
        .await
        .map_err(|e| SourceError::new(ErrorClass::Transient, e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::SourceErrorKind;

    #[test]
    fn unsafe_consumer_overrides_are_rejected() {
        for (k, v) in [
            ("enable.auto.commit", "true"),
            ("enable.auto.offset.store", "true"),
            ("auto.offset.reset", "latest"),
            ("auto.offset.reset", "earliest"),
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
        for start in [StartFrom::Earliest, StartFrom::Latest] {
            let mut config = KafkaSourceConfig::new("b:1", "g");
            config.topics.push("t".into());
            config.session_timeout = Duration::from_secs(6);
            config.start_from = start;
            config.properties.set("enable.auto.commit", "false");
            let cc = config.consumer_config().unwrap();
            assert_eq!(cc.get("enable.auto.commit"), Some("false"));
            assert_eq!(cc.get("enable.auto.offset.store"), Some("false"));
            assert_eq!(cc.get("session.timeout.ms"), Some("6000"));
            assert_eq!(cc.get("heartbeat.interval.ms"), Some("2000"));
            // The start position is set per partition on assignment; librdkafka's reset
            // only reports an out-of-range offset.
            assert_eq!(cc.get("auto.offset.reset"), Some("error"));
            assert_eq!(cc.get("group.id"), Some("g"));
        }
    }

    #[test]
    fn start_decision_table() {
        use StartDecision::*;
        use StartFrom::{Earliest, Latest};
        let table = [
            (Some(5), Some((0, 10)), Earliest, Committed),
            (Some(5), Some((0, 10)), Latest, Committed),
            (Some(5), None, Earliest, Committed),
            (Some(12), Some((0, 10)), Earliest, Committed), // beyond the end: answered by reset=error
            (
                Some(3),
                Some((7, 10)),
                Earliest,
                Gap {
                    committed: 3,
                    earliest: 7,
                },
            ),
            (
                Some(3),
                Some((7, 10)),
                Latest,
                Gap {
                    committed: 3,
                    earliest: 7,
                },
            ),
            (None, Some((7, 10)), Earliest, Beginning),
            (None, None, Earliest, Beginning),
            (None, Some((7, 10)), Latest, EndCommitted(10)),
            (None, None, Latest, EndCommitted(-1)),
        ];
        for (committed, wm, start, expect) in table {
            assert_eq!(
                decide_start(committed, wm, start),
                expect,
                "{committed:?} {wm:?} {start:?}"
            );
        }
    }

    #[test]
    fn out_of_range_table() {
        assert_eq!(
            classify_out_of_range(3, 7, 10),
            OutOfRange::Lost {
                position: 3,
                earliest: 7
            }
        );
        assert_eq!(
            classify_out_of_range(15, 7, 10),
            OutOfRange::Beyond { earliest: 7 }
        );
        assert_eq!(
            classify_out_of_range(8, 7, 10),
            OutOfRange::InRange { position: 8 }
        );
        assert_eq!(
            classify_out_of_range(10, 7, 10),
            OutOfRange::InRange { position: 10 }
        );
    }

    #[test]
    fn rebalance_commit_errors_are_dropped_not_retried() {
        use RDKafkaErrorCode as C;
        let table = [
            (C::UnknownMemberId, true),
            (C::IllegalGeneration, true),
            (C::RebalanceInProgress, true),
            (C::FencedInstanceId, true),
            (C::StaleMemberEpoch, true),
            (C::AssignmentLost, true),
            (C::RequestTimedOut, false),
            (C::CoordinatorNotAvailable, false),
            (C::NotCoordinator, false),
            (C::GroupAuthorizationFailed, false),
        ];
        for (code, rebalance) in table {
            assert_eq!(is_rebalance_code(code), rebalance, "{code:?}");
            let e = commit_error(KafkaError::ConsumerCommit(code));
            assert_eq!(
                e.kind == SourceErrorKind::Rebalanced,
                rebalance,
                "{code:?}: {e}"
            );
        }
        let auth = commit_error(KafkaError::ConsumerCommit(C::GroupAuthorizationFailed));
        assert_eq!(auth.class, ErrorClass::Permanent);
    }
}
