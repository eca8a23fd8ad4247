//! Parked messages on the consumer side: what is stored, how an operator sees and changes it
//! ([`InboxParking`]), filters, stats and the audit trail.

use std::fmt;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{AggregateKey, InboxStore, ParkedRecord};
use crate::delivery::ParkKind;
use crate::error::StoreError;

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
    /// The same message is parked already: nothing stored. The same message: the same
    /// aggregate and dedup id; for an undecodable message, the same dedup id derived from the
    /// transport's identity of the message ([`ParkedRecord::dedup_id`]: a redelivery at a new
    /// JetStream delivery sequence or RabbitMQ tag is the same message), or, without one, the
    /// same position.
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
