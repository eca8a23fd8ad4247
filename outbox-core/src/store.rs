//! The [`OutboxStore`] trait: durable outbox rows and their delivery state.

use async_trait::async_trait;

use crate::delivery::{
    AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, OutboxStats, Outcome, ParkedEvent,
};
use crate::envelope::{Envelope, EventId};
use crate::error::StoreError;

/// Storage of outbox events and their delivery state.
///
/// Implementations: `outbox_postgres::PostgresOutboxStore`, `outbox_testkit::MemoryOutboxStore`.
/// Every implementation runs the conformance suite in `outbox-testkit`.
///
/// # Contract
///
/// * **Atomic append.** [`append`](Self::append) MUST write inside the caller's transaction
///   `Self::Tx`, so the events commit or roll back with the business change. It MUST validate
///   each envelope and MUST NOT call the broker.
/// * **Head-of-line claiming.** [`claim`](Self::claim) MUST only return an aggregate's *head*:
///   its lowest-version event that is neither published nor discarded. It MUST NOT return an
///   event whose aggregate has a parked event, an event under another live claim, or an event
///   whose retry time has not come. So at most one event per aggregate is in flight across all
///   relays, and version N+1 is never handed out before N is acknowledged.
/// * **No skipping.** Claim eligibility MUST NOT depend on a high-water mark of ids: a row that
///   commits after rows with higher ids MUST still be claimed.
/// * **Fencing.** [`complete`](Self::complete) MUST apply an outcome only while the claim still
///   owns the row, and MUST count refused outcomes in [`CompletionReport::superseded`].
/// * **Published means acknowledged.** A row MUST become published only through an
///   [`Outcome::Published`], which carries the broker's ack metadata.
/// * **Nothing is skipped.** Only an operator action (retry, discard, re-issue) moves a parked
///   event; each action MUST be recorded in the audit trail.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// The caller's unit of work that [`append`](Self::append) joins (a database transaction or
    /// connection for SQL backends).
    type Tx: Send;

    /// Appends `events` in the caller's transaction.
    ///
    /// MUST validate every envelope (returning a `Validation` error and writing nothing on the
    /// first invalid one), MUST reject a duplicate event id with a `Constraint` error, and SHOULD
    /// write all events in one round trip.
    async fn append(&self, tx: &mut Self::Tx, events: &[Envelope]) -> Result<(), StoreError>;

    /// Claims at most `request.limit` aggregate heads that are due.
    ///
    /// MUST honour the head-of-line and exclusivity rules above. SHOULD return the oldest events
    /// first. MAY return fewer events than the limit, or none.
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError>;

    /// Records the outcomes of a claimed batch and ends the claim.
    ///
    /// MUST apply all outcomes atomically (one transaction) and only for rows the claim still
    /// owns. Rows of the claim that have no outcome MUST be released unchanged. For
    /// [`Outcome::Retry`], the attempt counter MUST increase and the row MUST NOT be claimable
    /// before `delay` has passed.
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError>;

    /// Gives a claim's rows back without counting an attempt (graceful shutdown, lease about to
    /// expire). MUST be a no-op for rows the claim no longer owns.
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError>;

    /// Lists parked events, oldest first.
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError>;

    /// Makes a parked event claimable again, keeping its event id and resetting its attempts.
    /// MUST fail with `NotFound` unless the event is parked. MUST be audited.
    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError>;

    /// Removes a parked event from delivery; the aggregate's later events flow again.
    /// MUST require a non-empty reason, MUST fail with `NotFound` unless the event is parked, and
    /// MUST be audited.
    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError>;

    /// Replaces a parked event by a copy with a new event id at the same aggregate version and
    /// returns the new id. The original is marked discarded. Consumers treat the copy as a new
    /// event. MUST be audited.
    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError>;

    /// The audit trail, newest last; `event_id` filters to one event.
    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError>;

    /// Deletes published (and discarded) rows older than `retention`, at most `batch_size` rows
    /// per transaction. MUST NOT touch pending or parked rows.
    async fn cleanup(
        &self,
        retention: std::time::Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError>;

    /// A monitoring snapshot.
    async fn stats(&self) -> Result<OutboxStats, StoreError>;

    /// The claim mode, so a relay can check its lease against the publisher's delivery timeout.
    fn claim_mode(&self) -> ClaimMode;
}
