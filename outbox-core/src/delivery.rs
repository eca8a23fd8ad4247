//! Delivery state: relay mechanics that are stored beside the envelope and never published.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::envelope::{Envelope, EventId};
use crate::error::{ConfigError, ErrorClass};

/// Lifecycle of an outbox row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum DeliveryStatus {
    /// Waiting to be published (possibly after a transient failure, possibly under a lease).
    Pending,
    /// Acknowledged by the broker.
    Published,
    /// Stopped for an operator; blocks later events of its aggregate.
    Parked,
    /// Removed from delivery by an operator, with a recorded reason.
    Discarded,
}

impl DeliveryStatus {
    /// Stable lowercase name, as stored.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Published => "published",
            Self::Parked => "parked",
            Self::Discarded => "discarded",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "published" => Self::Published,
            "parked" => Self::Parked,
            "discarded" => Self::Discarded,
            _ => return None,
        })
    }
}

/// The transport that acknowledged a record: the `ack_transport` column of the stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TransportKind {
    /// Apache Kafka (and its protocol: Redpanda, tansu).
    Kafka,
    /// NATS JetStream.
    Nats,
    /// RabbitMQ (AMQP 0-9-1 with publisher confirms).
    #[serde(rename = "rabbitmq")]
    RabbitMq,
}

impl TransportKind {
    /// Stable lowercase name, as stored.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Kafka => "kafka",
            Self::Nats => "nats",
            Self::RabbitMq => "rabbitmq",
        }
    }

    /// Parses the stored name; `None` for a name this version does not know.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "kafka" => Self::Kafka,
            "nats" => Self::Nats,
            "rabbitmq" => Self::RabbitMq,
            _ => return None,
        })
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stored, addressable position: a Kafka partition and offset, or a JetStream stream
/// sequence (no partition). The `ack_partition` and `ack_position` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct StoredPosition {
    /// The Kafka partition; `None` for a transport without partitions.
    pub partition: Option<i32>,
    /// The Kafka offset or the JetStream stream sequence.
    pub offset: i64,
}

/// Where the broker stored a record, as the transport itself says it: returned by the
/// transport's acknowledgement (delivery report, `PubAck`, publisher confirm) and stored with
/// the outbox row. A transport fills only its own variant; nothing is padded with zeros.
///
/// ```
/// use outbox_core::{AckMetadata, TransportKind};
///
/// let ack = AckMetadata::kafka("orders", 3, 41);
/// assert_eq!(ack.transport(), TransportKind::Kafka);
/// assert_eq!(ack.destination(), "orders");
/// assert_eq!(ack.to_string(), "orders/3@41");
/// let ack = AckMetadata::RabbitMq { exchange: "outbox".into(), routing_key: "order.created".into() };
/// assert_eq!(ack.position(), None);
/// assert_eq!(ack.to_string(), "outbox -> order.created");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "transport", rename_all = "snake_case")]
#[non_exhaustive]
pub enum AckMetadata {
    /// A Kafka delivery report.
    Kafka {
        /// Topic written to.
        topic: String,
        /// Partition written to.
        partition: i32,
        /// Offset assigned by the broker.
        offset: i64,
    },
    /// A JetStream `PubAck`.
    #[serde(rename = "nats")]
    JetStream {
        /// The stream that stored the message.
        stream: String,
        /// Its stream sequence (for a duplicate: the sequence of the copy stored before).
        sequence: u64,
        /// The subject published to.
        subject: String,
        /// The stream already held a message with this id (`Nats-Msg-Id`) within its
        /// duplicate window and stored nothing new: the record was delivered before.
        duplicate: bool,
    },
    /// A RabbitMQ publisher confirm. A confirm names no stored position: it says the message
    /// is stored in every queue the exchange routed it to.
    #[serde(rename = "rabbitmq")]
    RabbitMq {
        /// The exchange published to.
        exchange: String,
        /// The routing key published with.
        routing_key: String,
    },
}

impl AckMetadata {
    /// A Kafka acknowledgement.
    pub fn kafka(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self::Kafka {
            topic: topic.into(),
            partition,
            offset,
        }
    }

    /// `(topic, partition, offset)` of a Kafka acknowledgement; `None` for the others.
    pub fn as_kafka(&self) -> Option<(&str, i32, i64)> {
        match self {
            Self::Kafka {
                topic,
                partition,
                offset,
            } => Some((topic, *partition, *offset)),
            _ => None,
        }
    }

    /// The transport that acknowledged the record.
    pub const fn transport(&self) -> TransportKind {
        match self {
            Self::Kafka { .. } => TransportKind::Kafka,
            Self::JetStream { .. } => TransportKind::Nats,
            Self::RabbitMq { .. } => TransportKind::RabbitMq,
        }
    }

    /// Topic, stream or exchange: what `outbox parked/reconcile --topic` filters on (the
    /// `ack_destination` column).
    pub fn destination(&self) -> &str {
        match self {
            Self::Kafka { topic, .. } => topic,
            Self::JetStream { stream, .. } => stream,
            Self::RabbitMq { exchange, .. } => exchange,
        }
    }

    /// Partition and offset, or stream sequence, when the transport stores the record at an
    /// addressable position (RabbitMQ does not). A stream sequence above `i64::MAX` (2^63
    /// messages in one stream) does not fit the stores' `bigint` and is given as `i64::MAX`.
    pub fn position(&self) -> Option<StoredPosition> {
        match self {
            Self::Kafka {
                partition, offset, ..
            } => Some(StoredPosition {
                partition: Some(*partition),
                offset: *offset,
            }),
            Self::JetStream { sequence, .. } => Some(StoredPosition {
                partition: None,
                offset: i64::try_from(*sequence).unwrap_or(i64::MAX),
            }),
            Self::RabbitMq { .. } => None,
        }
    }

    /// The subject or routing key the record was published with (the `ack_route` column);
    /// `None` for Kafka.
    pub fn route(&self) -> Option<&str> {
        match self {
            Self::Kafka { .. } => None,
            Self::JetStream { subject, .. } => Some(subject),
            Self::RabbitMq { routing_key, .. } => Some(routing_key),
        }
    }

    /// Whether JetStream reported the publication a duplicate (the `ack_duplicate` column);
    /// `None` for the other transports.
    pub const fn duplicate(&self) -> Option<bool> {
        match self {
            Self::JetStream { duplicate, .. } => Some(*duplicate),
            _ => None,
        }
    }

    /// Maps the stored columns `(ack_transport, ack_destination, ack_partition, ack_position,
    /// ack_route, ack_duplicate)` back. No destination and no transport: no acknowledgement
    /// (`Ok(None)`). Refuses (instead of guessing) an unknown transport, a destination without
    /// a transport, and a column its transport needs that is missing or out of range.
    pub fn from_columns(
        transport: Option<&str>,
        destination: Option<String>,
        partition: Option<i32>,
        position: Option<i64>,
        route: Option<String>,
        duplicate: Option<bool>,
    ) -> Result<Option<Self>, AckColumnsError> {
        let (transport, destination) = match (transport, destination) {
            (None, None) => return Ok(None),
            (Some(t), Some(d)) => (t, d),
            (None, Some(d)) => {
                return Err(AckColumnsError::new(format!(
                    "an acknowledgement at {d:?} names no transport"
                )))
            }
            (Some(t), None) => {
                return Err(AckColumnsError::new(format!(
                    "a {t:?} acknowledgement names no destination"
                )))
            }
        };
        let kind = TransportKind::parse(transport).ok_or_else(|| {
            AckColumnsError::new(format!(
                "unknown transport {transport:?} (this version knows kafka, nats, rabbitmq)"
            ))
        })?;
        let missing =
            |what: &str| AckColumnsError::new(format!("a {kind} acknowledgement without {what}"));
        Ok(Some(match kind {
            TransportKind::Kafka => Self::Kafka {
                topic: destination,
                partition: partition.ok_or_else(|| missing("a partition"))?,
                offset: position.ok_or_else(|| missing("an offset"))?,
            },
            TransportKind::Nats => Self::JetStream {
                stream: destination,
                sequence: position
                    .ok_or_else(|| missing("a stream sequence"))
                    .and_then(|p| {
                        u64::try_from(p).map_err(|_| {
                            AckColumnsError::new(format!("a negative stream sequence {p}"))
                        })
                    })?,
                subject: route.ok_or_else(|| missing("a subject"))?,
                duplicate: duplicate.ok_or_else(|| missing("its duplicate flag"))?,
            },
            TransportKind::RabbitMq => Self::RabbitMq {
                exchange: destination,
                routing_key: route.ok_or_else(|| missing("a routing key"))?,
            },
        }))
    }
}

/// The transport's own form: `orders/3@41` (topic/partition@offset), `ORDERS#41` (stream
/// #sequence, with ` (duplicate)` for a duplicate `PubAck`), `outbox -> order.created`
/// (exchange -> routing key).
impl fmt::Display for AckMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Kafka {
                topic,
                partition,
                offset,
            } => write!(f, "{topic}/{partition}@{offset}"),
            Self::JetStream {
                stream,
                sequence,
                duplicate,
                ..
            } => {
                write!(f, "{stream}#{sequence}")?;
                if *duplicate {
                    f.write_str(" (duplicate)")?;
                }
                Ok(())
            }
            Self::RabbitMq {
                exchange,
                routing_key,
            } => write!(f, "{exchange} -> {routing_key}"),
        }
    }
}

/// Stored acknowledgement columns that do not describe an acknowledgement this version can
/// read ([`AckMetadata::from_columns`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AckColumnsError {
    message: String,
}

impl AckColumnsError {
    fn new(message: String) -> Self {
        Self { message }
    }
}

impl fmt::Display for AckColumnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored acknowledgement: {}", self.message)
    }
}

impl std::error::Error for AckColumnsError {}

/// The last failure recorded for an event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastError {
    /// Retry class.
    pub class: ErrorClass,
    /// Stable kind name (e.g. `timeout`, `record_too_large`).
    pub kind: String,
    /// Detail, never containing the payload.
    pub message: String,
}

impl LastError {
    /// Whether this failure leaves open that the broker stored the record (see
    /// [`crate::PublishErrorKind::delivery_uncertain`]; unknown kinds count as uncertain).
    pub fn delivery_uncertain(&self) -> bool {
        crate::error::PublishErrorKind::parse(&self.kind).is_none_or(|k| k.delivery_uncertain())
    }
}

impl From<&crate::error::PublishError> for LastError {
    fn from(e: &crate::error::PublishError) -> Self {
        Self {
            class: e.class,
            kind: e.kind.as_str().to_owned(),
            message: e.message.clone(),
        }
    }
}

/// Why an event was parked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ParkKind {
    /// The transport reported a permanent error.
    PermanentError,
    /// Transient errors exceeded the attempt limit.
    AttemptsExhausted,
    /// The aggregate's previous version never arrived within the grace period.
    VersionGap,
    /// A consumer could not apply the event.
    Unprocessable,
    /// Its aggregate version is at or below the last version published (or discarded) for its
    /// aggregate: publishing it now would deliver it after a later version.
    OutOfOrder,
}

impl ParkKind {
    /// Stable snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PermanentError => "permanent_error",
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::VersionGap => "version_gap",
            Self::Unprocessable => "unprocessable",
            Self::OutOfOrder => "out_of_order",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "permanent_error" => Self::PermanentError,
            "attempts_exhausted" => Self::AttemptsExhausted,
            "version_gap" => Self::VersionGap,
            "unprocessable" => Self::Unprocessable,
            "out_of_order" => Self::OutOfOrder,
            _ => return None,
        })
    }
}

/// A parking decision with its reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkReason {
    /// The category.
    pub kind: ParkKind,
    /// The last error behind the decision.
    pub error: LastError,
}

/// How a store hands out work and fences stale relays.
///
/// There is deliberately no mode that selects rows with `SKIP LOCKED`, closes the transaction and
/// publishes without a lease: a second relay would see the same rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimMode {
    /// Rows are locked by a transaction that stays open until the batch is marked. A crashed
    /// relay's connection drops and the locks go with it.
    LockedTransaction,
    /// Rows get a lease (owner, unique token, expiry) in a short transaction; marking succeeds
    /// only while the token still matches.
    Lease {
        /// How long a claim stays valid.
        duration: Duration,
    },
}

/// Longest accepted lease: a relay that dies holding a lease keeps its aggregates unpublished
/// until the lease expires (or an operator releases it, `OperatorStore::release_claims_of`).
pub const MAX_LEASE: Duration = Duration::from_secs(3600);

impl ClaimMode {
    /// A lease mode; rejects a zero duration and one above [`MAX_LEASE`].
    pub fn lease(duration: Duration) -> Result<Self, ConfigError> {
        if duration.is_zero() {
            return Err(ConfigError::new("lease duration must be greater than zero"));
        }
        if duration > MAX_LEASE {
            return Err(ConfigError::new(format!(
                "a lease of {duration:?} is longer than {MAX_LEASE:?}: a relay that dies \
                 holding it would keep its events unpublished that long"
            )));
        }
        Ok(Self::Lease { duration })
    }
}

/// Longest run a claim may ask for ([`ClaimRequest::run`]); a relay's configuration refuses a
/// longer one, and stores cap a request at it.
pub const MAX_RUN: usize = 10_000;

/// Parameters of one claim.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// Identity of the claiming relay (appears in leases and logs).
    pub owner: String,
    /// Largest number of events to claim (the events of runs included, one each).
    pub limit: usize,
    /// Longest *run* per aggregate: how many consecutive versions of one aggregate the claim
    /// may hand out under its head's claim (the head counts as one). Default 1: heads only.
    /// A store that does not support runs ignores it and hands out heads only, which the
    /// contract allows (`outbox_core::store`, *Runs*). 0 is read as 1; stores cap it at
    /// [`MAX_RUN`].
    pub run: usize,
}

impl ClaimRequest {
    /// A claim of at most `limit` events for `owner`, heads only (`run` 1).
    pub fn new(owner: impl Into<String>, limit: usize) -> Self {
        Self {
            owner: owner.into(),
            limit,
            run: 1,
        }
    }

    /// Asks for runs of up to `run` consecutive versions per aggregate (see
    /// [`run`](Self::run)); 0 is taken as 1, anything above [`MAX_RUN`] as [`MAX_RUN`].
    ///
    /// ```
    /// use outbox_core::ClaimRequest;
    ///
    /// assert_eq!(ClaimRequest::new("relay-1", 100).run, 1);
    /// assert_eq!(ClaimRequest::new("relay-1", 100).with_run(50).run, 50);
    /// assert_eq!(ClaimRequest::new("relay-1", 100).with_run(0).run, 1);
    /// ```
    pub fn with_run(mut self, run: usize) -> Self {
        self.run = run.clamp(1, MAX_RUN);
        self
    }

    /// The run length a store should use: [`run`](Self::run) clamped to `1..=MAX_RUN` (the
    /// field is public, so it may hold anything).
    pub fn run_len(&self) -> usize {
        self.run.clamp(1, MAX_RUN)
    }
}

/// Identifies one claim; presented again when the outcome is recorded (fencing).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClaimHandle {
    /// Unique token of this claim.
    pub token: Uuid,
    /// The owner that claimed.
    pub owner: String,
}

/// One claimed event.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimedRecord {
    /// The event to publish.
    pub envelope: Envelope,
    /// Failed attempts before this one.
    pub attempts: u32,
    /// An earlier claim of this event ended without an outcome or a release (a relay that
    /// crashed, a completion that was lost, a lease that expired under a slow relay): it may
    /// have sent the event, so this publication may be a re-send. Stores that cannot tell
    /// leave it `false`.
    pub maybe_sent_before: bool,
    /// Its place in its aggregate's *run* (`outbox_core::store`, *Runs*): 0 for an aggregate's
    /// head (every record of a claim without runs), `k` for the head's version + `k`, handed
    /// out under the head's claim. A record with `run_position` `k > 0` directly follows the
    /// record at `k - 1` of the same aggregate in the batch; the relay sends it only after
    /// that one's publication was acknowledged.
    pub run_position: u32,
}

impl ClaimedRecord {
    /// A claimed record, an aggregate's head (`run_position` 0).
    pub fn new(envelope: Envelope, attempts: u32) -> Self {
        Self {
            envelope,
            attempts,
            maybe_sent_before: false,
            run_position: 0,
        }
    }

    /// Sets [`run_position`](Self::run_position).
    pub fn with_run_position(mut self, position: u32) -> Self {
        self.run_position = position;
        self
    }

    /// Whether it continues a run (it is not its aggregate's head): `run_position > 0`.
    pub fn in_run_after_head(&self) -> bool {
        self.run_position > 0
    }

    /// Sets [`maybe_sent_before`](Self::maybe_sent_before).
    pub fn with_maybe_sent_before(mut self, yes: bool) -> Self {
        self.maybe_sent_before = yes;
        self
    }

    /// Whether publishing it now may send it more than once: a failed attempt before, or an
    /// earlier claim that may have sent it.
    pub fn is_resend(&self) -> bool {
        self.attempts > 0 || self.maybe_sent_before
    }
}

/// A bounded batch handed to one relay.
///
/// Contract: per aggregate, its head (its lowest version that is neither published nor
/// discarded, at `last + 1`), followed, when the request asked for runs and the store supports
/// them, by the rest of its *run*: the next consecutive versions, adjacent in the batch, in
/// version order, with [`ClaimedRecord::run_position`] 1, 2, ... (`outbox_core::store`,
/// *Runs*). Without runs: at most one event per aggregate.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ClaimedBatch {
    /// The claim's identity.
    pub handle: ClaimHandle,
    /// The events: heads, each followed by the rest of its run if any.
    pub records: Vec<ClaimedRecord>,
    /// For leases: time left on the lease when the store granted it, on the store's clock
    /// (before the claim committed). The relay adds this to its own clock reading taken before
    /// it asked for the claim, so the claim's round trip and commit make its deadline err early,
    /// never late.
    pub lease_remaining: Option<Duration>,
    /// Events the claim parked instead of handing out (version order violations), for
    /// signals and logs.
    pub parked: Vec<ParkedAtClaim>,
    /// Aggregates whose head skips a version and is held, waiting for the missing version
    /// (until the store's gap timeout parks it).
    pub gaps_held: usize,
}

/// An event parked by a claim because of its aggregate version.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedAtClaim {
    /// The event.
    pub event_id: EventId,
    /// Its aggregate type.
    pub aggregate_type: String,
    /// Its aggregate id.
    pub aggregate_id: String,
    /// Its aggregate version.
    pub aggregate_version: i64,
    /// [`ParkKind::OutOfOrder`] or [`ParkKind::VersionGap`].
    pub kind: ParkKind,
}

impl ParkedAtClaim {
    /// A notice.
    pub fn new(
        event_id: EventId,
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        aggregate_version: i64,
        kind: ParkKind,
    ) -> Self {
        Self {
            event_id,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version,
            kind,
        }
    }
}

impl ClaimedBatch {
    /// A batch.
    pub fn new(
        handle: ClaimHandle,
        records: Vec<ClaimedRecord>,
        lease_remaining: Option<Duration>,
    ) -> Self {
        Self {
            handle,
            records,
            lease_remaining,
            parked: Vec::new(),
            gaps_held: 0,
        }
    }

    /// Adds the version notices of the claim.
    pub fn with_version_notices(mut self, parked: Vec<ParkedAtClaim>, gaps_held: usize) -> Self {
        self.parked = parked;
        self.gaps_held = gaps_held;
        self
    }

    /// `true` when nothing was claimed.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// The recorded result of one publication attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Acknowledged by the broker: set `published_at` and store the ack metadata.
    Published {
        /// The event.
        event_id: EventId,
        /// Where the broker stored it.
        ack: AckMetadata,
    },
    /// Failed transiently: count the attempt, make it claimable again after `delay` (on the
    /// store's clock, counted from when the completion writes the row; a store may count from
    /// the start of its completion when another transaction held the row meanwhile, as
    /// PostgreSQL does after waiting on a row lock), keep the error.
    Retry {
        /// The event.
        event_id: EventId,
        /// Wait before the next attempt.
        delay: Duration,
        /// The failure.
        error: LastError,
    },
    /// The transport failed, not the record (broker down, timeout, topic or leader
    /// missing): make it claimable again after `delay` and keep the error, but do NOT count an
    /// attempt. A broker outage of any length never parks an event.
    Defer {
        /// The event.
        event_id: EventId,
        /// Wait before the next attempt.
        delay: Duration,
        /// The failure.
        error: LastError,
    },
    /// Stop delivery and raise a signal; blocks the aggregate.
    Park {
        /// The event.
        event_id: EventId,
        /// Why.
        reason: ParkReason,
    },
}

impl Outcome {
    /// The event this outcome is about.
    pub fn event_id(&self) -> EventId {
        match self {
            Self::Published { event_id, .. }
            | Self::Retry { event_id, .. }
            | Self::Defer { event_id, .. }
            | Self::Park { event_id, .. } => *event_id,
        }
    }
}

/// What a store did with a batch of outcomes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompletionReport {
    /// Outcomes applied.
    pub applied: usize,
    /// Outcomes refused because the claim no longer owned the rows (lease expired and another
    /// relay claimed them). The events were possibly published twice: a duplicate, never a loss.
    pub superseded: usize,
    /// The events of the refused outcomes (as many as `superseded`), so that a relay counts
    /// only what was recorded.
    pub superseded_events: Vec<EventId>,
}

impl CompletionReport {
    /// A report whose refused outcomes are `superseded_events`.
    pub fn new(applied: usize, superseded_events: Vec<EventId>) -> Self {
        Self {
            applied,
            superseded: superseded_events.len(),
            superseded_events,
        }
    }
}

/// A parked event as shown to an operator.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedEvent {
    /// The event.
    pub envelope: Envelope,
    /// Attempts made.
    pub attempts: u32,
    /// Why it was parked.
    pub reason: ParkReason,
    /// When.
    pub parked_at: DateTime<Utc>,
    /// `true` when an earlier attempt may have reached the broker although it was not
    /// acknowledged (a timeout, a transport failure after sending): the event may already be
    /// in the log, so a re-issue can deliver it twice (consumers deduplicate the copy through
    /// [`crate::wire::ORIGINAL_EVENT_ID`]).
    pub delivery_uncertain: bool,
}

impl ParkedEvent {
    /// A parked event.
    pub fn new(
        envelope: Envelope,
        attempts: u32,
        reason: ParkReason,
        parked_at: DateTime<Utc>,
    ) -> Self {
        Self {
            envelope,
            attempts,
            reason,
            parked_at,
            delivery_uncertain: false,
        }
    }
}

impl ParkedEvent {
    /// Sets [`delivery_uncertain`](Self::delivery_uncertain).
    pub fn with_delivery_uncertain(mut self, uncertain: bool) -> Self {
        self.delivery_uncertain = uncertain;
        self
    }
}

/// An operator action on a parked event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum OperatorAction {
    /// Made claimable again with the same event id.
    Retry,
    /// Removed from delivery, with a reason.
    Discard,
    /// Replaced by a copy with a new event id at the same aggregate version.
    Reissue,
    /// The claim of a relay that is gone was ended by an operator
    /// (`OperatorStore::release_claims_of`).
    ReleaseClaim,
}

impl OperatorAction {
    /// Stable name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Discard => "discard",
            Self::Reissue => "reissue",
            Self::ReleaseClaim => "release_claim",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "retry" => Self::Retry,
            "discard" => Self::Discard,
            "reissue" => Self::Reissue,
            "release_claim" => Self::ReleaseClaim,
            _ => return None,
        })
    }
}

/// One audited operator action.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditEntry {
    /// The event acted upon.
    pub event_id: EventId,
    /// The action.
    pub action: OperatorAction,
    /// Who did it.
    pub actor: String,
    /// Why.
    pub reason: String,
    /// For re-issue: the new event id.
    pub new_event_id: Option<EventId>,
    /// When.
    pub at: DateTime<Utc>,
}

impl AuditEntry {
    /// An audit entry.
    pub fn new(
        event_id: EventId,
        action: OperatorAction,
        actor: impl Into<String>,
        reason: impl Into<String>,
        new_event_id: Option<EventId>,
        at: DateTime<Utc>,
    ) -> Self {
        Self {
            event_id,
            action,
            actor: actor.into(),
            reason: reason.into(),
            new_event_id,
            at,
        }
    }
}

/// Result of a cleanup pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanupReport {
    /// Published rows deleted (or archived).
    pub removed: u64,
    /// Number of transactions used.
    pub batches: u32,
}

impl CleanupReport {
    /// A report.
    pub fn new(removed: u64, batches: u32) -> Self {
        Self { removed, batches }
    }
}

/// A snapshot of the outbox for monitoring, the same for every store.
///
/// **Where an unpublished event stands.** Per aggregate, let *last* be the highest version
/// published or discarded (see [`crate::OutboxStore`]'s version rule) and the *head* its first
/// unfinished (pending or parked) event above *last*, in (version, insertion) order. Every
/// unpublished event is in exactly one of three places:
///
/// * **blocked**: a parked event of its aggregate above *last* comes before it. It moves only
///   after an operator acted on that event; its age says how long the aggregate has been
///   stuck, not how far behind the relay is.
/// * **gap-held**: its aggregate's head skips a version (above *last* + 1), a claim found it so
///   and holds it (it is parked as a version gap after the gap timeout), and it is that head
///   or comes after it.
/// * **claimable**: everything else: claimable now, waiting for a retry or the end of a
///   broker outage, in flight, or queued behind its aggregate's claimable head.
///
/// **Ages** are measured from the event's insertion into the store, on the store's clock
/// (PostgreSQL: `inserted_at`, the clock of the append statement, so an event appended at the
/// end of a long business transaction does not look as old as the transaction; a row inserted
/// by plain SQL gets the column default, its transaction's start), never from the envelope's
/// `created_at`, which the producer's clock wrote (a producer whose clock runs behind, or an
/// import that keeps the original times, would otherwise look like a stuck outbox). Events
/// that waited behind a parked event become claimable with the age they have when an operator
/// acts on it: the main age rises until the relay has sent them (one at a time per aggregate).
///
/// The main health signal (and the backpressure gate's age) is
/// [`oldest_claimable_age`](Self::oldest_claimable_age): it grows while the relay does not
/// keep up (a broker outage, too few relays), and one parked event with events of its
/// aggregate behind it does not move it.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct OutboxStats {
    /// Events not yet published, parked or discarded: claimable, in flight, waiting for a
    /// retry, blocked or gap-held.
    pub unpublished: u64,
    /// Of those, claimed right now.
    pub in_flight: u64,
    /// Of those, blocked: waiting behind a parked event of their aggregate.
    pub blocked: u64,
    /// Of those, gap-held: their aggregate's head is held as a version gap (the head and the
    /// events after it).
    pub gap_held: u64,
    /// Parked events.
    pub parked: u64,
    /// Published rows still retained. A store may estimate it on a large table (PostgreSQL
    /// counts up to 10,000 exactly, then estimates from the table's statistics, and says so
    /// with `published_retained_estimated` 1 in [`extra`](Self::extra)).
    pub published_retained: u64,
    /// Age of the oldest claimable event (neither blocked nor gap-held; in flight and waiting
    /// for a retry included), since its insertion: the main health signal. `None` when no
    /// event is claimable.
    pub oldest_claimable_age: Option<Duration>,
    /// Age of the oldest blocked event, since its insertion.
    pub oldest_blocked_age: Option<Duration>,
    /// Age of the oldest parked event, since its insertion.
    pub oldest_parked_age: Option<Duration>,
    /// Aggregates whose head a claim found skipping a version and holds, waiting for the
    /// missing one.
    pub version_gaps_held: u64,
    /// Backend-specific figures (table size, dead tuples, ...), name to value.
    pub extra: Vec<(String, f64)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{PublishError, PublishErrorKind};

    fn jet(sequence: u64, duplicate: bool) -> AckMetadata {
        AckMetadata::JetStream {
            stream: "ORDERS".into(),
            sequence,
            subject: "outbox.order".into(),
            duplicate,
        }
    }

    fn rabbit() -> AckMetadata {
        AckMetadata::RabbitMq {
            exchange: "outbox".into(),
            routing_key: "order.created".into(),
        }
    }

    /// Each transport's acknowledgement goes to the columns and back unchanged, and prints in
    /// the transport's own form.
    #[test]
    fn acks_round_trip_through_columns_and_print_per_transport() {
        let table = [
            (
                AckMetadata::kafka("orders", 3, 41),
                TransportKind::Kafka,
                "orders",
                Some((Some(3), 41)),
                None,
                None,
                "orders/3@41",
            ),
            (
                jet(41, false),
                TransportKind::Nats,
                "ORDERS",
                Some((None, 41)),
                Some("outbox.order"),
                Some(false),
                "ORDERS#41",
            ),
            (
                jet(7, true),
                TransportKind::Nats,
                "ORDERS",
                Some((None, 7)),
                Some("outbox.order"),
                Some(true),
                "ORDERS#7 (duplicate)",
            ),
            (
                rabbit(),
                TransportKind::RabbitMq,
                "outbox",
                None,
                Some("order.created"),
                None,
                "outbox -> order.created",
            ),
        ];
        for (ack, kind, destination, position, route, duplicate, shown) in table {
            assert_eq!(ack.transport(), kind, "{ack:?}");
            assert_eq!(ack.destination(), destination, "{ack:?}");
            assert_eq!(
                ack.position().map(|p| (p.partition, p.offset)),
                position,
                "{ack:?}"
            );
            assert_eq!(ack.route(), route, "{ack:?}");
            assert_eq!(ack.duplicate(), duplicate, "{ack:?}");
            assert_eq!(ack.to_string(), shown);
            let back = AckMetadata::from_columns(
                Some(ack.transport().as_str()),
                Some(ack.destination().to_owned()),
                ack.position().and_then(|p| p.partition),
                ack.position().map(|p| p.offset),
                ack.route().map(str::to_owned),
                ack.duplicate(),
            );
            assert_eq!(back, Ok(Some(ack.clone())), "{ack:?}");
            assert_eq!(TransportKind::parse(kind.as_str()), Some(kind));
            // The JSON form names the transport as stored.
            let json = serde_json::to_value(&ack).unwrap();
            assert_eq!(json["transport"], kind.as_str(), "{json}");
            assert_eq!(serde_json::from_value::<AckMetadata>(json).unwrap(), ack);
        }
        // 2^63 messages in one stream do not fit a bigint: the largest one is given.
        assert_eq!(jet(u64::MAX, false).position().unwrap().offset, i64::MAX);
    }

    /// No columns: no acknowledgement. Anything else that does not describe an
    /// acknowledgement is refused with a reason, never guessed.
    #[test]
    fn from_columns_refuses_what_it_cannot_read() {
        let s = |v: &str| Some(v.to_owned());
        assert_eq!(
            AckMetadata::from_columns(None, None, None, None, None, None),
            Ok(None)
        );
        let refused = [
            (
                Some("pulsar"),
                s("t"),
                Some(0),
                Some(1),
                None,
                None,
                "unknown transport \"pulsar\"",
            ),
            (
                Some("Kafka"),
                s("t"),
                Some(0),
                Some(1),
                None,
                None,
                "unknown transport \"Kafka\"",
            ),
            (
                Some(""),
                s("t"),
                Some(0),
                Some(1),
                None,
                None,
                "unknown transport",
            ),
            (
                None,
                s("t"),
                Some(0),
                Some(1),
                None,
                None,
                "names no transport",
            ),
            (
                Some("kafka"),
                None,
                Some(0),
                Some(1),
                None,
                None,
                "names no destination",
            ),
            (
                Some("kafka"),
                s("t"),
                None,
                Some(1),
                None,
                None,
                "kafka acknowledgement without a partition",
            ),
            (
                Some("kafka"),
                s("t"),
                Some(0),
                None,
                None,
                None,
                "kafka acknowledgement without an offset",
            ),
            (
                Some("nats"),
                s("S"),
                None,
                None,
                s("x"),
                Some(false),
                "without a stream sequence",
            ),
            (
                Some("nats"),
                s("S"),
                None,
                Some(-1),
                s("x"),
                Some(false),
                "negative stream sequence -1",
            ),
            (
                Some("nats"),
                s("S"),
                None,
                Some(1),
                None,
                Some(false),
                "without a subject",
            ),
            (
                Some("nats"),
                s("S"),
                None,
                Some(1),
                s("x"),
                None,
                "without its duplicate flag",
            ),
            (
                Some("rabbitmq"),
                s("x"),
                None,
                None,
                None,
                None,
                "rabbitmq acknowledgement without a routing key",
            ),
        ];
        for (transport, destination, partition, position, route, duplicate, reason) in refused {
            let err = AckMetadata::from_columns(
                transport,
                destination,
                partition,
                position,
                route,
                duplicate,
            )
            .expect_err(reason);
            assert!(err.to_string().contains(reason), "{err} / {reason}");
        }
    }

    /// The stored names are a storage format: each is fixed, and parsing gives the value back.
    #[test]
    fn stored_names_are_fixed_and_parse_back() {
        let statuses = [
            (DeliveryStatus::Pending, "pending"),
            (DeliveryStatus::Published, "published"),
            (DeliveryStatus::Parked, "parked"),
            (DeliveryStatus::Discarded, "discarded"),
        ];
        for (v, name) in statuses {
            assert_eq!(v.as_str(), name);
            assert_eq!(DeliveryStatus::parse(name), Some(v));
        }
        let kinds = [
            (ParkKind::PermanentError, "permanent_error"),
            (ParkKind::AttemptsExhausted, "attempts_exhausted"),
            (ParkKind::VersionGap, "version_gap"),
            (ParkKind::Unprocessable, "unprocessable"),
            (ParkKind::OutOfOrder, "out_of_order"),
        ];
        for (v, name) in kinds {
            assert_eq!(v.as_str(), name);
            assert_eq!(ParkKind::parse(name), Some(v));
        }
        let actions = [
            (OperatorAction::Retry, "retry"),
            (OperatorAction::Discard, "discard"),
            (OperatorAction::Reissue, "reissue"),
            (OperatorAction::ReleaseClaim, "release_claim"),
        ];
        for (v, name) in actions {
            assert_eq!(v.as_str(), name);
            assert_eq!(OperatorAction::parse(name), Some(v));
        }
        for unknown in ["", "Pending", "parked ", "other"] {
            assert_eq!(DeliveryStatus::parse(unknown), None, "{unknown:?}");
            assert_eq!(ParkKind::parse(unknown), None, "{unknown:?}");
            assert_eq!(OperatorAction::parse(unknown), None, "{unknown:?}");
        }
    }

    /// A stored last error keeps whether the broker may have the record: a refused record is
    /// certain, a timeout is not, and a kind this version does not know counts as uncertain.
    #[test]
    fn last_error_tells_whether_delivery_is_uncertain() {
        let of = |kind| LastError::from(&PublishError::new(kind, "x"));
        assert!(!of(PublishErrorKind::RecordTooLarge).delivery_uncertain());
        assert!(!of(PublishErrorKind::UnknownTopic).delivery_uncertain());
        assert!(of(PublishErrorKind::Timeout).delivery_uncertain());
        let unknown = LastError {
            class: crate::error::ErrorClass::Transient,
            kind: "from_a_newer_version".into(),
            message: String::new(),
        };
        assert!(unknown.delivery_uncertain());
    }

    #[test]
    fn lease_bounds_are_inclusive_of_the_maximum() {
        assert_eq!(
            ClaimMode::lease(MAX_LEASE).ok(),
            Some(ClaimMode::Lease {
                duration: MAX_LEASE
            })
        );
        assert!(ClaimMode::lease(MAX_LEASE + Duration::from_nanos(1)).is_err());
        assert!(ClaimMode::lease(Duration::ZERO).is_err());
    }
}
