//! Consumer-side traits: [`InboxStore`] (deduplication, version tracking and parking in the
//! effect's transaction), [`InboxParking`] (the operator's view of parked messages) and
//! [`MessageSource`] (where messages come from and where offsets are committed), with the typed
//! values they exchange.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::delivery::ParkKind;
use crate::envelope::{Envelope, EventId};
use crate::error::{SourceError, StoreError};
use crate::watermark::SharedOffsetTracker;
use crate::wire::{self, DecodeError};

/// Result of registering an event for a consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Registration {
    /// First time this consumer sees the event: apply the effect in the same transaction.
    Fresh,
    /// Already applied (or discarded) and committed: do not repeat the effect.
    Duplicate,
}

/// Result of registering an event **for its aggregate** ([`InboxStore::register_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AggregateRegistration {
    /// Not registered before: registered now, for this aggregate.
    Fresh,
    /// Registered before for the same aggregate (or without an aggregate, by
    /// [`InboxStore::register`]): a duplicate.
    Duplicate,
    /// Registered before for **another** aggregate: not this event (a record whose original-id
    /// header names another aggregate's event, which only a foreign or buggy producer sends).
    /// Nothing was recorded for it.
    OtherAggregate,
}

impl From<Registration> for AggregateRegistration {
    fn from(r: Registration) -> Self {
        match r {
            Registration::Fresh => Self::Fresh,
            Registration::Duplicate => Self::Duplicate,
        }
    }
}

/// Namespace of [`scoped_dedup_id`] (a fixed, random UUID).
const SCOPED_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6f0b_2c4e_91d3_4a57_b8e6_0d2f_7a13_c945);

/// The id under which an event of `aggregate` is registered when its dedup id was registered
/// before by another aggregate's event ([`AggregateRegistration::OtherAggregate`]): a UUID v5
/// of the aggregate and the id, the same for every store and every redelivery, so the event
/// is still deduplicated against itself (and against other copies naming the same original in
/// the same aggregate) and never against the other aggregate's event.
pub fn scoped_dedup_id(aggregate: &AggregateKey, id: EventId) -> EventId {
    let mut name =
        Vec::with_capacity(aggregate.aggregate_type.len() + aggregate.aggregate_id.len() + 32);
    for part in [
        aggregate.aggregate_type.as_bytes(),
        aggregate.aggregate_id.as_bytes(),
    ] {
        name.extend_from_slice(&(part.len() as u64).to_be_bytes());
        name.extend_from_slice(part);
    }
    name.extend_from_slice(id.as_uuid().as_bytes());
    EventId::from_uuid(uuid::Uuid::new_v5(&SCOPED_NAMESPACE, &name))
}

/// A partition of a topic.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicPartition {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
}

impl TopicPartition {
    /// A partition.
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        Self {
            topic: topic.into(),
            partition,
        }
    }

    /// The commit "resume reading this partition at `next_offset`".
    pub fn at_next(&self, next_offset: i64) -> CommitOffset {
        CommitOffset {
            topic: self.topic.clone(),
            partition: self.partition,
            next_offset,
        }
    }
}

impl fmt::Display for TopicPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.topic, self.partition)
    }
}

/// Position of a message in a partitioned log.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogPosition {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset of the message.
    pub offset: i64,
}

impl LogPosition {
    /// A position.
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            offset,
        }
    }

    /// The partition.
    pub fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.clone(), self.partition)
    }

    /// The commit that marks this message and everything before it as final (offset + 1).
    pub fn next(&self) -> CommitOffset {
        CommitOffset::new(self.topic.clone(), self.partition, self.offset + 1)
    }
}

impl fmt::Display for LogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
    }
}

/// An offset to commit: the **next** offset to read in a partition (Kafka's convention: last
/// final offset + 1). A distinct type from [`LogPosition`] so the two are never confused.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommitOffset {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Next offset to read.
    pub next_offset: i64,
}

impl CommitOffset {
    /// A commit.
    pub fn new(topic: impl Into<String>, partition: i32, next_offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            next_offset,
        }
    }

    /// The partition.
    pub fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.clone(), self.partition)
    }
}

impl fmt::Display for CommitOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} next {}",
            self.topic, self.partition, self.next_offset
        )
    }
}

/// One record header as it came from the log. `value: None` is a null header value, which is
/// not the same as an empty one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordHeader {
    /// Name.
    pub name: String,
    /// Value; `None` when the producer sent a null value.
    pub value: Option<Vec<u8>>,
}

impl RecordHeader {
    /// A header with a value.
    pub fn new(name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self {
            name: name.into(),
            value: Some(value.into()),
        }
    }

    /// A header with a null value.
    pub fn null(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: None,
        }
    }
}

/// The identity of an aggregate: type and id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AggregateKey {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
}

impl AggregateKey {
    /// A key.
    pub fn new(aggregate_type: impl Into<String>, aggregate_id: impl Into<String>) -> Self {
        Self {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
        }
    }

    /// The aggregate of `e`.
    pub fn of(e: &Envelope) -> Self {
        Self::new(e.aggregate_type.clone(), e.aggregate_id.clone())
    }
}

impl fmt::Display for AggregateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.aggregate_type, self.aggregate_id)
    }
}

/// A message read from a source: its position, the raw record and the decoded envelope.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// Where it was read.
    pub position: LogPosition,
    /// The record key, if any.
    pub key: Option<Vec<u8>>,
    /// The record headers exactly as received (parked messages keep them).
    pub headers: Vec<RecordHeader>,
    /// The broker's timestamp of the record, when known.
    pub timestamp: Option<DateTime<Utc>>,
    /// The decoded envelope, or why it could not be decoded (the engine parks such messages;
    /// a malformed message never panics).
    pub envelope: Result<Envelope, DecodeError>,
    /// The raw value, kept only when decoding failed (else it is the envelope's payload).
    undecoded_value: Option<Vec<u8>>,
}

impl ReceivedMessage {
    /// A message with an already decoded (or failed) envelope; the headers are the wire
    /// mapping of the envelope (none when decoding failed). For tests and in-process sources.
    pub fn new(
        position: LogPosition,
        key: Option<Vec<u8>>,
        envelope: Result<Envelope, DecodeError>,
    ) -> Self {
        let headers = match &envelope {
            Ok(e) => wire::encode_headers(e)
                .into_iter()
                .map(|(k, v)| RecordHeader::new(k, v))
                .collect(),
            Err(_) => Vec::new(),
        };
        Self {
            position,
            key,
            headers,
            timestamp: None,
            envelope,
            undecoded_value: None,
        }
    }

    /// Decodes a raw record ([`wire::decode_record`]); never panics on hostile input.
    pub fn from_record(
        position: LogPosition,
        key: Option<Vec<u8>>,
        headers: Vec<RecordHeader>,
        value: Option<Vec<u8>>,
        timestamp: Option<DateTime<Utc>>,
    ) -> Self {
        let envelope = wire::decode_record(&headers, value.as_deref());
        let undecoded_value = if envelope.is_err() { value } else { None };
        Self {
            position,
            key,
            headers,
            timestamp,
            envelope,
            undecoded_value,
        }
    }

    /// The record value (`None`: a null value).
    pub fn value(&self) -> Option<&[u8]> {
        match &self.envelope {
            Ok(e) => Some(&e.payload.bytes),
            Err(_) => self.undecoded_value.as_deref(),
        }
    }

    /// The aggregate this message belongs to: from the envelope, or, for a message that cannot
    /// be decoded, from its `aggregate_type` and `aggregate_id` headers when those are readable
    /// ([`wire::aggregate_of`]).
    pub fn aggregate(&self) -> Option<AggregateKey> {
        match &self.envelope {
            Ok(e) => Some(AggregateKey::of(e)),
            Err(_) => wire::aggregate_of(&self.headers),
        }
    }

    /// The raw record, for parking.
    pub fn to_record(&self) -> ParkedRecord {
        let envelope = self.envelope.as_ref().ok();
        ParkedRecord {
            position: self.position.clone(),
            key: self.key.clone(),
            headers: self.headers.clone(),
            value: self.value().map(<[u8]>::to_vec),
            aggregate: self.aggregate(),
            event_id: envelope.map(|e| e.event_id),
            dedup_id: envelope.map(Envelope::dedup_id),
            aggregate_version: envelope.map(|e| e.aggregate_version),
        }
    }
}

/// Lag of one partition: how far the consumer group's committed offset is behind the end of
/// the partition.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionLag {
    /// The partition.
    pub partition: TopicPartition,
    /// The group's committed next offset (`None`: nothing committed yet).
    pub committed: Option<i64>,
    /// The earliest offset still available (log start).
    pub earliest: i64,
    /// The end of the partition (high watermark: next offset to be written).
    pub end: i64,
}

impl PartitionLag {
    /// A lag record.
    pub fn new(partition: TopicPartition, committed: Option<i64>, earliest: i64, end: i64) -> Self {
        Self {
            partition,
            committed,
            earliest,
            end,
        }
    }

    /// Messages between the committed offset (or the log start) and the end.
    pub fn lag(&self) -> i64 {
        (self.end - self.committed.unwrap_or(self.earliest).max(self.earliest)).max(0)
    }

    /// Records the consumer lost to retention: committed offset below the log start.
    pub fn lost_to_retention(&self) -> Option<i64> {
        self.committed
            .filter(|c| *c < self.earliest)
            .map(|c| self.earliest - c)
    }
}

/// A partitioned log consumer with manual offset commits.
///
/// # Contract
///
/// * Automatic offset commits MUST be off: offsets move only through [`commit`](Self::commit)
///   and the revoke commits of the attached tracker.
/// * [`commit`](Self::commit) takes *next offsets to read* ([`CommitOffset`]). Offsets of
///   partitions this member no longer owns (or whose assignment was lost) MUST NOT be
///   committed; a commit refused because the group rebalanced MUST be reported as
///   [`SourceErrorKind::Rebalanced`](crate::SourceErrorKind::Rebalanced), which the engine
///   answers by dropping those commits and polling again.
/// * After a rebalance or restart, reading MUST resume from the last committed offset, so any
///   message whose outcome was not final is delivered again.
/// * [`poll`](Self::poll) MUST be cancellation safe: a poll dropped before it completed loses
///   no message.
/// * A source whose committed offset fell below the earliest available offset (records lost
///   to retention) MUST fail the poll with
///   [`SourceErrorKind::RetentionGap`](crate::SourceErrorKind::RetentionGap) naming the
///   partitions and the gap, and MUST NOT skip ahead silently.
/// * [`attach_offsets`](Self::attach_offsets) is called by the engine once, before the first
///   poll. A source with rebalance callbacks MUST, on revoke, commit the tracker's final
///   offsets ([`SharedOffsetTracker::revoke`]); on assignment call
///   [`SharedOffsetTracker::assign`]; on a lost assignment call [`SharedOffsetTracker::lose`]
///   and commit nothing.
/// * [`pause`](Self::pause) and [`resume`](Self::resume) hold back and restart delivery of
///   some partitions (the engine pauses a partition whose messages fill its buffer, so one
///   slow aggregate does not stop the others, and keeps polling, which serves rebalances). A
///   source that returns `Ok(true)` from `pause` MUST, for a paused partition: deliver no
///   message of it from a later poll until it is resumed (at most the messages already handed
///   out before the call); keep its position exactly: after `resume`, delivery continues with
///   the first message not yet delivered (nothing skipped, nothing delivered twice, so order
///   is kept); keep serving the other partitions and the group (rebalances, commits) while
///   it is paused. Pausing a partition the member does not own (any more) is not an error.
///   After a rebalance, a newly assigned partition starts unpaused. A transport without
///   partitions (per-message acknowledgements) maps "partition" to its unit of ordered
///   delivery and MUST keep the same promises, or keep the default, which pauses nothing
///   (the engine then stops polling altogether while it is full).
#[async_trait]
pub trait MessageSource: Send + Sync {
    /// Waits up to `timeout` for the next message. `Ok(None)` when none arrived.
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError>;

    /// Commits next offsets synchronously.
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError>;

    /// Takes the engine's offset tracker, so rebalance callbacks commit exactly what is final.
    fn attach_offsets(&self, offsets: SharedOffsetTracker);

    /// Lag of the assigned partitions. The default reports nothing (a source that cannot tell);
    /// sources over a broker SHOULD implement it.
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        Ok(Vec::new())
    }

    /// Holds back delivery of `partitions` (see the contract). Returns whether the source can
    /// pause; the default cannot (`Ok(false)`, nothing paused).
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        let _ = partitions;
        Ok(false)
    }

    /// Restarts delivery of paused `partitions` where each stopped. The default does nothing.
    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        let _ = partitions;
        Ok(())
    }
}

/// What an inbox knows about one aggregate of a consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AggregateState {
    /// Highest version applied (or discarded) by this consumer; `None` when the consumer has
    /// not tracked the aggregate yet.
    pub applied_version: Option<i64>,
    /// A parked message blocks the aggregate: later messages wait behind it.
    pub blocked: bool,
}

impl AggregateState {
    /// A state.
    pub fn new(applied_version: Option<i64>, blocked: bool) -> Self {
        Self {
            applied_version,
            blocked,
        }
    }
}

/// Moves an aggregate's applied version from `expected` to `version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionAdvance {
    /// The aggregate.
    pub aggregate: AggregateKey,
    /// The version read in this transaction ([`AggregateState::applied_version`]).
    pub expected: Option<i64>,
    /// The new applied version.
    pub version: i64,
}

/// Identifier of a parked message (unique per store).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParkedId(pub i64);

impl fmt::Display for ParkedId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::str::FromStr for ParkedId {
    type Err = std::num::ParseIntError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(ParkedId)
    }
}

/// A message as it came from the log, with what could be decoded of it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRecord {
    /// Where it was read.
    pub position: LogPosition,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record headers, raw.
    pub headers: Vec<RecordHeader>,
    /// Record value, raw (`None`: null).
    pub value: Option<Vec<u8>>,
    /// Its aggregate, when known.
    pub aggregate: Option<AggregateKey>,
    /// Its event id, when decodable.
    pub event_id: Option<EventId>,
    /// The id the inbox deduplicates it by ([`Envelope::dedup_id`]), when decodable.
    pub dedup_id: Option<EventId>,
    /// Its aggregate version, when decodable.
    pub aggregate_version: Option<i64>,
}

impl ParkedRecord {
    /// A record from its raw parts, with what can be decoded of it (for stores reading rows
    /// back, and for tests).
    pub fn new(
        position: LogPosition,
        key: Option<Vec<u8>>,
        headers: Vec<RecordHeader>,
        value: Option<Vec<u8>>,
    ) -> Self {
        ReceivedMessage::from_record(position, key, headers, value, None).to_record()
    }

    /// Decodes the record again.
    pub fn decode(&self) -> Result<Envelope, DecodeError> {
        wire::decode_record(&self.headers, self.value.as_deref())
    }
}

/// Where a message is parked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParkAs {
    /// It blocks its aggregate: the message that could not be applied.
    Head(ParkKind),
    /// It waits behind the aggregate's head.
    Waiting,
}

/// A message to park.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NewParkedMessage {
    /// The record.
    pub record: ParkedRecord,
    /// Head or waiting.
    pub park_as: ParkAs,
    /// Why (never the payload).
    pub reason: String,
    /// Attempts made to apply it.
    pub attempts: u32,
}

impl NewParkedMessage {
    /// A message to park.
    pub fn new(
        record: ParkedRecord,
        park_as: ParkAs,
        reason: impl Into<String>,
        attempts: u32,
    ) -> Self {
        Self {
            record,
            park_as,
            reason: reason.into(),
            attempts,
        }
    }
}

/// What [`InboxStore::park`] did with one message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parking {
    /// Stored as the aggregate's head (or standalone when the aggregate is unknown).
    Head(ParkedId),
    /// Stored as waiting behind the head. A head requested for an aggregate that is already
    /// blocked is stored as waiting.
    Waiting(ParkedId),
    /// The same message (same aggregate and dedup id, or for an undecodable message the same
    /// position) is parked already: nothing stored.
    AlreadyParked,
}

/// State of a parked message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ParkedStatus {
    /// Blocks its aggregate; waits for an operator.
    Parked,
    /// Waits behind its aggregate's parked message.
    Waiting,
    /// Applied after an operator action.
    Applied,
    /// Found to be a duplicate or stale when released: nothing applied.
    Skipped,
    /// Discarded by an operator (registered without effect).
    Discarded,
}

impl ParkedStatus {
    /// Stable name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Parked => "parked",
            Self::Waiting => "waiting",
            Self::Applied => "applied",
            Self::Skipped => "skipped",
            Self::Discarded => "discarded",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "parked" => Self::Parked,
            "waiting" => Self::Waiting,
            "applied" => Self::Applied,
            "skipped" => Self::Skipped,
            "discarded" => Self::Discarded,
            _ => return None,
        })
    }

    /// Parked or waiting: not resolved yet.
    pub const fn is_open(self) -> bool {
        matches!(self, Self::Parked | Self::Waiting)
    }
}

/// A parked message as shown to an operator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedMessage {
    /// Its id.
    pub id: ParkedId,
    /// The consumer that parked it.
    pub consumer: String,
    /// The record.
    pub record: ParkedRecord,
    /// State.
    pub status: ParkedStatus,
    /// Why it blocks (for [`ParkedStatus::Parked`]): [`ParkKind::Unprocessable`] or
    /// [`ParkKind::VersionGap`]. `None` for a message that only waits.
    pub kind: Option<ParkKind>,
    /// Why (never the payload).
    pub reason: String,
    /// Attempts made to apply it (by the engine and by operator retries).
    pub attempts: u32,
    /// When it was parked.
    pub parked_at: DateTime<Utc>,
    /// When it was resolved (applied, skipped or discarded).
    pub resolved_at: Option<DateTime<Utc>>,
    /// A pending retry request (recorded by an operator, performed by the consumer service
    /// that has the handler at its next check).
    pub retry_request: Option<RetryRequest>,
}

/// An operator's request that a parked message be retried by the consumer service (which has
/// the handler); see [`InboxParking::request_retry`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryRequest {
    /// Who asked.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// When (as stored; a store may round it).
    pub requested_at: DateTime<Utc>,
}

impl RetryRequest {
    /// A request.
    pub fn new(
        actor: impl Into<String>,
        reason: impl Into<String>,
        requested_at: DateTime<Utc>,
    ) -> Self {
        Self {
            actor: actor.into(),
            reason: reason.into(),
            requested_at,
        }
    }
}

impl ParkedMessage {
    /// A parked message (for store implementations).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: ParkedId,
        consumer: impl Into<String>,
        record: ParkedRecord,
        status: ParkedStatus,
        kind: Option<ParkKind>,
        reason: impl Into<String>,
        attempts: u32,
        parked_at: DateTime<Utc>,
        resolved_at: Option<DateTime<Utc>>,
    ) -> Self {
        Self {
            id,
            consumer: consumer.into(),
            record,
            status,
            kind,
            reason: reason.into(),
            attempts,
            parked_at,
            resolved_at,
            retry_request: None,
        }
    }

    /// With a pending retry request (for store implementations).
    pub fn with_retry_request(mut self, request: Option<RetryRequest>) -> Self {
        self.retry_request = request;
        self
    }
}

/// How a parked message changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParkedChange {
    /// Resolved: [`ParkedStatus::Applied`], [`ParkedStatus::Skipped`] or
    /// [`ParkedStatus::Discarded`].
    Resolved(ParkedStatus),
    /// It failed again: it becomes (or stays) the aggregate's parked head.
    Failed {
        /// Why it blocks now.
        kind: ParkKind,
        /// Why.
        reason: String,
        /// Attempts so far.
        attempts: u32,
    },
}

/// Which parked messages to list.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedFilter {
    /// Only open ones (parked or waiting). Default `true`.
    pub open_only: bool,
    /// Only those of one aggregate.
    pub aggregate: Option<AggregateKey>,
    /// At most this many, oldest first. Default 100.
    pub limit: usize,
}

impl Default for ParkedFilter {
    fn default() -> Self {
        Self {
            open_only: true,
            aggregate: None,
            limit: 100,
        }
    }
}

impl ParkedFilter {
    /// Open messages, oldest first, up to 100.
    pub fn open() -> Self {
        Self::default()
    }
    /// Includes resolved messages.
    pub fn all(mut self) -> Self {
        self.open_only = false;
        self
    }
    /// Only `aggregate`.
    pub fn aggregate(mut self, aggregate: AggregateKey) -> Self {
        self.aggregate = Some(aggregate);
        self
    }
    /// At most `n`.
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = n;
        self
    }
}

/// An operator action on a consumer's parked message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum InboxAction {
    /// Apply now, then release the aggregate's waiting messages.
    Retry,
    /// Resolve without effect, with a reason, then release the waiting messages.
    Discard,
    /// Ask the consumer service to retry the message at its next check (the retry itself is
    /// audited as [`InboxAction::Retry`]).
    RequestRetry,
}

impl InboxAction {
    /// Stable name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Discard => "discard",
            Self::RequestRetry => "request_retry",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "retry" => Self::Retry,
            "discard" => Self::Discard,
            "request_retry" => Self::RequestRetry,
            _ => return None,
        })
    }
}

/// One audited operator action on a parked message.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxAuditEntry {
    /// The consumer.
    pub consumer: String,
    /// The parked message acted upon.
    pub parked_id: ParkedId,
    /// The action.
    pub action: InboxAction,
    /// Who.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// What came of it (e.g. `applied 3, released the aggregate`).
    pub outcome: String,
    /// When (set by the store on write).
    pub at: DateTime<Utc>,
}

impl InboxAuditEntry {
    /// An audit entry.
    pub fn new(
        consumer: impl Into<String>,
        parked_id: ParkedId,
        action: InboxAction,
        actor: impl Into<String>,
        reason: impl Into<String>,
        outcome: impl Into<String>,
        at: DateTime<Utc>,
    ) -> Self {
        Self {
            consumer: consumer.into(),
            parked_id,
            action,
            actor: actor.into(),
            reason: reason.into(),
            outcome: outcome.into(),
            at,
        }
    }
}

/// Parked-message counts of a consumer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedStats {
    /// Messages blocking an aggregate (or standalone).
    pub parked: u64,
    /// Messages waiting behind a parked one.
    pub waiting: u64,
    /// When the oldest open message was parked.
    pub oldest_parked_at: Option<DateTime<Utc>>,
}

impl ParkedStats {
    /// Stats.
    pub fn new(parked: u64, waiting: u64, oldest_parked_at: Option<DateTime<Utc>>) -> Self {
        Self {
            parked,
            waiting,
            oldest_parked_at,
        }
    }
}

/// The consumer's store, used inside the transaction that applies an effect: deduplication,
/// per-aggregate versions, and parking.
///
/// # Contract
///
/// * [`register`](Self::register) MUST record `(consumer, id)` for each id inside `tx`, so the
///   record commits or rolls back with the effect; a rolled-back registration MUST leave the
///   id fresh. It returns one [`Registration`] per id, in order; an id repeated in the slice is
///   `Fresh` the first time and `Duplicate` after. It MUST return `Duplicate` only for ids
///   registered by a committed transaction or earlier in `tx`. Two concurrent transactions
///   registering the same pair MUST NOT both commit as fresh: the second either blocks and
///   then sees a duplicate, or fails with a transient `Conflict`. Callers register by
///   [`Envelope::dedup_id`] ([`InboxStoreExt::register_event`]), so a re-issued copy and its
///   original are one event.
/// * [`register_for`](Self::register_for) is `register` with each id's aggregate recorded:
///   an id registered before for the same aggregate, or without one (by `register`), is
///   [`AggregateRegistration::Duplicate`]; one registered before for another aggregate is
///   [`AggregateRegistration::OtherAggregate`] and nothing is written for it (the caller
///   registers it under [`scoped_dedup_id`] instead). A re-issued copy names its original by
///   id, and only an event of its own aggregate can be its original: a record naming another
///   aggregate's event MUST NOT be deduplicated against it (its effect would be applied zero
///   times). Repeats inside one call answer as if registered one after the other.
/// * [`aggregates`](Self::aggregates) MUST return one state per key, in order, as seen by
///   `tx`; an aggregate never written is `AggregateState::default()`.
/// * [`advance_versions`](Self::advance_versions) MUST set each aggregate's applied version in
///   `tx`, and MUST fail with a transient `Conflict` (changing nothing) when an aggregate's
///   current version is not the `expected` one (another transaction moved it).
/// * [`park`](Self::park) MUST store each message durably in `tx` with its raw record, reason
///   and attempts. A [`ParkAs::Head`] with a known aggregate MUST mark the aggregate blocked
///   (stored as waiting when it is blocked already). A [`ParkAs::Waiting`] MUST fail with a
///   transient `Conflict` when the aggregate is not blocked as `tx` commits (an operator
///   released it meanwhile). A message parked already (same consumer, aggregate and dedup
///   id; for an undecodable one, same position) is reported as [`Parking::AlreadyParked`].
///   A message whose dedup id a parked message of **another** aggregate holds (a record whose
///   original-id header names another aggregate's event, or the event such a record named)
///   is not that message: it MUST be parked, under [`scoped_dedup_id`] (as
///   [`register_for`](Self::register_for) registers it), whichever of the two came first;
///   taking it for parked already would lose it (its offset final, nothing of it kept).
/// * [`cleanup`](Self::cleanup) removes at most one batch of `consumer`'s registrations older
///   than the retention, in its own short transaction, and returns how many. It MUST NOT
///   remove another consumer's registrations: consumers sharing a table may keep different
///   dedup windows, and a registration removed before its consumer's window ends lets a
///   redelivered event be applied twice.
#[async_trait]
pub trait InboxStore: Send + Sync {
    /// The transaction in which registration and effect happen.
    type Tx: Send;

    /// Begins a transaction. Its commit MUST be durable when it returns (a store on PostgreSQL
    /// sets `synchronous_commit = on` for it, whatever the server's default).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Registers `ids` for `consumer` in `tx`.
    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError>;

    /// Registers each id **for its aggregate** in `tx` (see the contract). The default keeps
    /// no aggregate: it answers through [`register`](Self::register), so an id registered by
    /// any aggregate is a duplicate; stores SHOULD override it (the conformance suite holds
    /// them to the scoped answer).
    async fn register_for(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        events: &[(EventId, AggregateKey)],
    ) -> Result<Vec<AggregateRegistration>, StoreError> {
        let ids: Vec<EventId> = events.iter().map(|(id, _)| *id).collect();
        Ok(self
            .register(tx, consumer, &ids)
            .await?
            .into_iter()
            .map(AggregateRegistration::from)
            .collect())
    }

    /// The states of `aggregates` for `consumer`, as seen by `tx`.
    async fn aggregates(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        aggregates: &[AggregateKey],
    ) -> Result<Vec<AggregateState>, StoreError>;

    /// Advances applied versions in `tx`.
    async fn advance_versions(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError>;

    /// Parks `messages` in `tx`.
    async fn park(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        messages: &[NewParkedMessage],
    ) -> Result<Vec<Parking>, StoreError>;

    /// Commits `tx`. After `Ok`, everything done in it is durable.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls `tx` back; nothing done in it remains.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Removes at most `batch_size` of `consumer`'s registrations older than `retention` (its
    /// dedup window); other consumers' registrations stay. Returns the number removed.
    async fn cleanup(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError>;
}

/// Conveniences over any [`InboxStore`].
#[async_trait]
pub trait InboxStoreExt: InboxStore {
    /// Registers one id.
    async fn register_one(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: EventId,
    ) -> Result<Registration, StoreError> {
        let mut r = self.register(tx, consumer, &[id]).await?;
        r.pop().ok_or_else(|| {
            StoreError::new(
                crate::StoreErrorKind::Other,
                "register returned no registration",
            )
        })
    }

    /// Registers an event by its [`Envelope::dedup_id`], for its aggregate: a re-issued copy
    /// and its original are one event; a record naming another aggregate's event as its
    /// original is not a copy of it ([`register_events`](Self::register_events)).
    async fn register_event(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event: &Envelope,
    ) -> Result<Registration, StoreError> {
        let mut r = self.register_events(tx, consumer, &[event]).await?;
        r.pop().ok_or_else(|| {
            StoreError::new(
                crate::StoreErrorKind::Other,
                "register returned no registration",
            )
        })
    }

    /// Registers events by their [`Envelope::dedup_id`], each for its aggregate
    /// ([`InboxStore::register_for`]), answering one [`Registration`] per event in order. An
    /// event whose dedup id another aggregate's event holds is registered under
    /// [`scoped_dedup_id`] (a second round trip, only then): it is deduplicated against its own
    /// redeliveries, never against the other aggregate's event.
    async fn register_events(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        events: &[&Envelope],
    ) -> Result<Vec<Registration>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let first: Vec<(EventId, AggregateKey)> = events
            .iter()
            .map(|e| (e.dedup_id(), AggregateKey::of(e)))
            .collect();
        let answers = self.register_for(tx, consumer, &first).await?;
        if answers.len() != events.len() {
            return Err(StoreError::new(
                crate::StoreErrorKind::Other,
                format!(
                    "the inbox answered {} registrations for {} ids",
                    answers.len(),
                    events.len()
                ),
            ));
        }
        let others: Vec<usize> = (0..events.len())
            .filter(|i| answers[*i] == AggregateRegistration::OtherAggregate)
            .collect();
        let mut out: Vec<Registration> = answers
            .iter()
            .map(|a| match a {
                AggregateRegistration::Fresh => Registration::Fresh,
                _ => Registration::Duplicate,
            })
            .collect();
        if !others.is_empty() {
            let scoped: Vec<(EventId, AggregateKey)> = others
                .iter()
                .map(|i| {
                    let (id, key) = &first[*i];
                    (scoped_dedup_id(key, *id), key.clone())
                })
                .collect();
            let again = self.register_for(tx, consumer, &scoped).await?;
            if again.len() != others.len() {
                return Err(StoreError::new(
                    crate::StoreErrorKind::Other,
                    "the inbox answered the wrong number of scoped registrations",
                ));
            }
            for (i, a) in others.into_iter().zip(again) {
                out[i] = match a {
                    AggregateRegistration::Fresh => Registration::Fresh,
                    AggregateRegistration::Duplicate => Registration::Duplicate,
                    AggregateRegistration::OtherAggregate => {
                        return Err(StoreError::new(
                            crate::StoreErrorKind::Other,
                            format!("scoped id of {} is held by another aggregate", first[i].1),
                        ))
                    }
                };
            }
        }
        Ok(out)
    }

    /// Runs [`InboxStore::cleanup`] for `consumer` batch after batch until a batch comes back
    /// short or `max_batches` ran. Returns the number removed.
    async fn cleanup_batches(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
        max_batches: usize,
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        for _ in 0..max_batches {
            let n = self.cleanup(consumer, retention, batch_size).await?;
            removed += n;
            if n < batch_size as u64 {
                break;
            }
        }
        Ok(removed)
    }
}

impl<T: InboxStore + ?Sized> InboxStoreExt for T {}

/// The operator's side of an inbox: what is parked, and the writes an operator action makes.
/// Kept apart from [`InboxStore`] so the hot path does not depend on it; the release logic
/// (apply in order, audit) lives in `outbox-inbox`.
///
/// # Contract
///
/// * [`open_parked_of`](Self::open_parked_of) MUST return the open (parked or waiting)
///   messages of the aggregate in release order (aggregate version, undecodable ones first,
///   then the order they were parked) and MUST serialize `tx` with concurrent
///   [`InboxStore::park`] calls for the same aggregate (a row lock), so nothing is parked as
///   waiting behind an aggregate that this transaction is about to release.
/// * [`change_parked`](Self::change_parked) records a resolution or a new failure in `tx`.
/// * [`unblock`](Self::unblock) MUST fail with a `Conflict` when open messages of the aggregate
///   remain, and otherwise clear the aggregate's blocked mark in `tx`.
/// * [`audit`](Self::audit) appends the entry in `tx`; [`audit_trail`](Self::audit_trail) lists
///   entries oldest first.
/// * [`request_retry`](Self::request_retry) records a retry request on an open message in `tx`
///   (replacing a pending one) and MUST fail with a `NotFound` error when the message is
///   unknown or resolved; [`requested_retries`](Self::requested_retries) lists the open
///   messages with a pending request, oldest request first, each with its
///   [`ParkedMessage::retry_request`]; [`clear_retry_request`](Self::clear_retry_request)
///   removes a request made at or before the given time in `tx` (a newer request stays).
#[async_trait]
pub trait InboxParking: InboxStore {
    /// Parked messages of `consumer`, oldest first.
    async fn list_parked(
        &self,
        consumer: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedMessage>, StoreError>;

    /// One parked message.
    async fn parked_message(
        &self,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError>;

    /// The open messages of `aggregate` in release order, locking the aggregate in `tx`.
    async fn open_parked_of(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError>;

    /// The discarded messages of `aggregate`, read in `tx`. The default reads committed state
    /// outside `tx` with [`list_parked`](Self::list_parked); a store whose transaction holds a
    /// pooled connection overrides it, so that an operator action needs one connection and
    /// not two (with a pool of N, N concurrent actions would otherwise wait on each other).
    async fn discarded_of(
        &self,
        _tx: &mut Self::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        let mut filter = ParkedFilter::open().all().aggregate(aggregate.clone());
        filter.limit = usize::MAX;
        Ok(self
            .list_parked(consumer, &filter)
            .await?
            .into_iter()
            .filter(|m| m.status == ParkedStatus::Discarded)
            .collect())
    }

    /// One parked message, read in `tx` (for messages without an aggregate).
    async fn parked_in(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError>;

    /// Changes a parked message in `tx`.
    async fn change_parked(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: ParkedId,
        change: &ParkedChange,
    ) -> Result<(), StoreError>;

    /// Clears the aggregate's blocked mark in `tx` (no open messages may remain).
    async fn unblock(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<(), StoreError>;

    /// Appends an audit entry in `tx`.
    async fn audit(&self, tx: &mut Self::Tx, entry: &InboxAuditEntry) -> Result<(), StoreError>;

    /// Audit entries of `consumer` (of one parked message, or all), oldest first.
    async fn audit_trail(
        &self,
        consumer: &str,
        id: Option<ParkedId>,
    ) -> Result<Vec<InboxAuditEntry>, StoreError>;

    /// Counts for metrics.
    async fn parked_stats(&self, consumer: &str) -> Result<ParkedStats, StoreError>;

    /// Records in `tx` that open message `id` is to be retried by the consumer service.
    async fn request_retry(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: ParkedId,
        request: &RetryRequest,
    ) -> Result<(), StoreError>;

    /// Open messages with a pending retry request, oldest request first.
    async fn requested_retries(&self, consumer: &str) -> Result<Vec<ParkedMessage>, StoreError>;

    /// Clears `id`'s retry request in `tx` if it was made at or before `requested_at`.
    async fn clear_retry_request(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: ParkedId,
        requested_at: DateTime<Utc>,
    ) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_and_commits_are_distinct_and_display() {
        let p = LogPosition::new("orders", 2, 41);
        assert_eq!(p.next(), CommitOffset::new("orders", 2, 42));
        assert_eq!(p.to_string(), "orders/2@41");
        assert_eq!(p.next().to_string(), "orders/2 next 42");
        assert_eq!(p.topic_partition().at_next(7).next_offset, 7);
        assert_eq!(p.next().topic_partition(), TopicPartition::new("orders", 2));
    }

    #[test]
    fn lag_and_retention_gap() {
        let tp = TopicPartition::new("t", 0);
        let table = [
            (Some(10), 0, 15, 5, None),
            (None, 3, 15, 12, None),
            (Some(2), 5, 15, 10, Some(3)),
            (Some(15), 0, 15, 0, None),
        ];
        for (committed, earliest, end, lag, lost) in table {
            let l = PartitionLag::new(tp.clone(), committed, earliest, end);
            assert_eq!(l.lag(), lag, "{l:?}");
            assert_eq!(l.lost_to_retention(), lost, "{l:?}");
        }
    }

    #[test]
    fn received_message_keeps_raw_value_only_when_undecodable() {
        let e = Envelope::builder("order", "o-1", 3, "order.paid")
            .build()
            .unwrap();
        let headers: Vec<RecordHeader> = wire::encode_headers(&e)
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect();
        let m = ReceivedMessage::from_record(
            LogPosition::new("t", 0, 1),
            Some(b"o-1".to_vec()),
            headers.clone(),
            Some(e.payload.bytes.clone()),
            None,
        );
        assert_eq!(m.envelope.as_ref().unwrap(), &e);
        assert_eq!(m.value(), Some(e.payload.bytes.as_slice()));
        let r = m.to_record();
        assert_eq!(r.dedup_id, Some(e.event_id));
        assert_eq!(r.aggregate_version, Some(3));
        assert_eq!(r.decode().unwrap(), e);

        let mut bad = headers;
        bad.retain(|h| h.name != wire::EVENT_ID);
        let m = ReceivedMessage::from_record(
            LogPosition::new("t", 0, 2),
            None,
            bad,
            Some(b"raw".to_vec()),
            None,
        );
        assert!(m.envelope.is_err());
        assert_eq!(m.value(), Some(b"raw".as_slice()));
        // The aggregate is still known from its headers.
        assert_eq!(m.aggregate(), Some(AggregateKey::new("order", "o-1")));
        let r = m.to_record();
        assert_eq!(
            (r.event_id, r.dedup_id, r.aggregate_version),
            (None, None, None)
        );
    }

    #[test]
    fn committed_offset_at_the_log_start_lost_nothing() {
        let tp = TopicPartition::new("t", 0);
        assert_eq!(
            PartitionLag::new(tp.clone(), Some(5), 5, 9).lost_to_retention(),
            None
        );
        assert_eq!(
            PartitionLag::new(tp.clone(), Some(4), 5, 9).lost_to_retention(),
            Some(1)
        );
        assert_eq!(PartitionLag::new(tp, None, 5, 9).lost_to_retention(), None);
    }

    #[test]
    fn keys_ids_and_values_display_and_carry_their_fields() {
        let key = AggregateKey::new("order", "o-1");
        assert_eq!(key.to_string(), "order/o-1");
        let e = Envelope::builder("order", "o-1", 2, "order.paid")
            .build()
            .unwrap();
        assert_eq!(AggregateKey::of(&e), key);
        let m = ReceivedMessage::new(LogPosition::new("t", 1, 7), None, Ok(e.clone()));
        assert_eq!(m.aggregate(), Some(key));
        // The headers are the envelope's wire mapping, so the record decodes back.
        assert_eq!(m.to_record().decode(), Ok(e));
        assert_eq!(TopicPartition::new("t", 3).to_string(), "t/3");
        assert_eq!(ParkedId(12).to_string(), "12");
        assert_eq!(
            AggregateState::new(Some(3), true),
            AggregateState {
                applied_version: Some(3),
                blocked: true
            }
        );
        assert_eq!(
            ParkedStats::new(2, 5, None),
            ParkedStats {
                parked: 2,
                waiting: 5,
                oldest_parked_at: None
            }
        );
        assert_eq!(RecordHeader::null("h").value, None);
    }

    #[test]
    fn parked_filter_builder() {
        let open = ParkedFilter::open();
        assert_eq!(
            (open.open_only, open.aggregate.clone(), open.limit),
            (true, None, 100)
        );
        let key = AggregateKey::new("order", "o-1");
        let f = ParkedFilter::open().all().aggregate(key.clone()).limit(5);
        assert_eq!((f.open_only, f.aggregate, f.limit), (false, Some(key), 5));
    }

    #[test]
    fn names_round_trip() {
        for s in [
            ParkedStatus::Parked,
            ParkedStatus::Waiting,
            ParkedStatus::Applied,
            ParkedStatus::Skipped,
            ParkedStatus::Discarded,
        ] {
            assert_eq!(ParkedStatus::parse(s.as_str()), Some(s));
        }
        assert!(ParkedStatus::Parked.is_open() && !ParkedStatus::Applied.is_open());
        assert_eq!(ParkedStatus::parse("x"), None);
        for a in [
            InboxAction::Retry,
            InboxAction::Discard,
            InboxAction::RequestRetry,
        ] {
            assert_eq!(InboxAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(InboxAction::parse("x"), None);
        assert_eq!("17".parse::<ParkedId>().unwrap(), ParkedId(17));
    }
}
