//! The store traits, split by role so that each caller depends on what it uses.
//!
//! | trait | used by | methods |
//! |---|---|---|
//! | [`AppendStore`] | the application | `append` |
//! | [`RelayStore`] | [`crate::Relay`] | `claim` (heads, and runs where supported), `complete`, `release`, `claim_mode`, `locked_claim_timeout` |
//! | [`OperatorStore`] | operators (`outbox parked`, `outbox release`) | parked events, audit trail, `release_claims_of` |
//! | [`MaintenanceStore`] | cleanup jobs, the relay daemon's gauges, backpressure | `cleanup`, `stats` |
//! | [`ReportingStore`] | the `outbox` command (`status`, `replay`, `reconcile`, `cleanup --dry-run`) | read-only reports |
//! | [`RelayRegistry`] | the relay daemon (register, heartbeat, deregister), `outbox status`, `outbox parked release-claims` | which relays run and what they hold |
//!
//! [`OutboxStore`] is the umbrella of the first four, implemented for every type that
//! implements them, for code that wants a whole store. [`ReportingStore`] stays outside it: it
//! is read-only, and a store that cannot report (or a test double) is still a whole store.
//!
//! A wrapper (backpressure, metering, fault injection) implements the roles it changes and
//! forwards the others with [`forward_store_roles!`](crate::forward_store_roles): a method added
//! to a role touches the backends and that macro, never every wrapper. (A blanket "layer" impl
//! that forwards by default and lets a wrapper override one role is not expressible without
//! specialization; a macro per role keeps each wrapper's impls explicit and checked.)
//!
//! # The contract of an outbox store
//!
//! These clauses hold across the roles; each method says which it carries.
//!
//! * **Atomic append.** [`AppendStore::append`] MUST write inside the caller's transaction
//!   ([`AppendStore::Tx`]), so the events commit or roll back with the business change. It
//!   MUST validate each envelope and MUST NOT call the broker.
//! * **Version order.** Per aggregate the store keeps `last`: the highest version published or
//!   discarded (0 before any; it survives cleanup of old rows). The aggregate's *head* is its
//!   first unfinished (pending or parked) event in (version, append order) whose version is
//!   above `last`. [`RelayStore::claim`] MUST return an event only when it is its aggregate's
//!   head, pending, due (its retry time has come), under no other live claim, and its version
//!   is exactly `last + 1`, or when it continues that head's run under the same claim (the
//!   *Runs* clause below). So at most one event per aggregate is in flight across all relays,
//!   version N+1 is never sent before N is acknowledged (handed out before, only inside a run,
//!   to the relay that sends N), a parked head blocks its aggregate, and a lower version that
//!   commits after a higher one never goes out after it.
//!   * A head above `last + 1` (a version is missing) MUST be held and counted
//!     ([`ClaimedBatch::gaps_held`]), and parked as [`crate::ParkKind::VersionGap`] once it
//!     has waited longer than the store's gap timeout. Nothing is skipped automatically.
//!   * A pending event at or below `last` MUST NOT be handed out; a claim that meets it MUST
//!     park it as [`crate::ParkKind::OutOfOrder`] ([`ClaimedBatch::parked`]).
//!   * Every change of an aggregate's delivery state (completion with any outcome, release,
//!     operator action, parking by a claim) MUST be serialized with claims of that aggregate:
//!     a claim never hands out an event that is not pending and due at the moment its claim
//!     takes effect.
//! * **Runs** (optional for a store; design: `docs/design/hot-aggregate.md`). A claim whose
//!   request asks for runs ([`ClaimRequest::run`] above 1) MAY hand out, after an aggregate's
//!   head at `last + 1`, up to `run - 1` further events of the same aggregate, all under the
//!   head's claim: its *run*. A store that does not support runs ignores `run` and hands out
//!   heads only; that is conformant.
//!   * A run MUST be consecutive: versions `last + 1, last + 2, ...` with no gap, each the
//!     aggregate's only unfinished row of its version (a duplicate version ends the run before
//!     it), each pending, unparked and due. A run counts one per event against the limit. The
//!     records of a run MUST be adjacent in the batch, in version order, the head first, with
//!     [`crate::ClaimedRecord::run_position`] 0, 1, 2, ...
//!   * The relay ([`crate::Relay`]) MUST send a run's event k+1 only after event k's publish
//!     result came back `Ok`; on the first failure of a run (retry, park, defer, transport
//!     failure) it MUST NOT send the rest of the run, and gives the rest no outcome. It starts
//!     event k only while its claim still covers one more publication (the lease, or in
//!     locked mode [`RelayStore::locked_claim_timeout`]); otherwise it stops the run there.
//!     So a run never outlives its claim, whatever its length.
//!   * [`RelayStore::complete`]: a run's outcomes MUST form a *published prefix* (versions
//!     `last + 1 ..= p`, each [`Outcome::Published`]), then optionally one non-published
//!     outcome for version `p + 1`, then none: the rest of the run is released unchanged (no
//!     attempt counted, claimable again at once). A store MUST refuse (count in
//!     [`CompletionReport::superseded`], as fenced) a `Published` outcome whose predecessor in
//!     the run is neither published in the same completion nor already `last`, and any
//!     outcome for a run row after the first non-published one. A publication MUST advance
//!     `last` to the highest version of the published prefix. The release MUST make the first
//!     unpublished row of the run the aggregate's head again.
//!   * A crash mid-run re-sends the acknowledged but uncompleted prefix (duplicates, allowed),
//!     as a crashed batch does: every row of a run whose claim ended without an outcome or a
//!     release may have been sent ([`crate::ClaimedRecord::maybe_sent_before`] on its next
//!     claim, where the store tracks it).
//! * **No skipping.** Claim eligibility MUST NOT depend on a high-water mark of ids: a row that
//!   commits after rows with higher ids MUST still be claimed.
//! * **Fencing.** [`RelayStore::complete`] MUST apply an outcome only while the claim still
//!   owns the row, and MUST count refused outcomes in [`CompletionReport::superseded`].
//! * **Published means acknowledged.** A row MUST become published only through an
//!   [`Outcome::Published`], which carries the broker's ack metadata.
//! * **Nothing is skipped.** Only an operator action ([`OperatorStore`]: retry, discard,
//!   re-issue) moves a parked event; each action MUST be recorded in the audit trail.

use async_trait::async_trait;

use crate::delivery::{
    AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, OutboxStats, Outcome, ParkedEvent,
};
use crate::envelope::{Envelope, EventId};
use crate::error::StoreError;

mod forward;
pub mod registry;
pub mod reporting;

pub use registry::{
    relay_state, RelayEntry, RelayRegistration, RelayRegistry, RelayState, FORGET_AFTER,
    STALE_AFTER_HEARTBEATS,
};

pub use reporting::{
    IntervalCount, LatencySummary, PublishedFilter, PublishedId, PublishedPosition, PublishedRow,
    ReportingStore, WindowFlow,
};

/// The application's role: append events inside its own transaction.
///
/// Carries the **atomic append** clause of the [module contract](self).
#[async_trait]
pub trait AppendStore: Send + Sync {
    /// The caller's unit of work that [`append`](Self::append) joins (a database transaction or
    /// connection for SQL backends).
    type Tx: Send;

    /// Appends `events` in the caller's transaction.
    ///
    /// MUST validate every envelope (returning a `Validation` error and writing nothing on the
    /// first invalid one), MUST reject a duplicate event id with a `Constraint` error, and SHOULD
    /// write all events in one round trip.
    async fn append(&self, tx: &mut Self::Tx, events: &[Envelope]) -> Result<(), StoreError>;
}

/// The relay's role: claim due aggregate heads, record their outcomes, give claims back.
///
/// Carries the **version order**, **no skipping**, **fencing** and **published means
/// acknowledged** clauses of the [module contract](self). [`crate::Relay`] needs only this.
#[async_trait]
pub trait RelayStore: Send + Sync {
    /// Claims at most `request.limit` events: aggregate heads that are due, each followed by
    /// its run when `request.run` is above 1 and the store supports runs.
    ///
    /// MUST honour the head-of-line and exclusivity rules of the module contract, and for a
    /// run its *Runs* clause. SHOULD return the oldest events first. MAY return fewer events
    /// than the limit, or none. MAY hand out shorter runs than asked, or heads only.
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError>;

    /// Records the outcomes of a claimed batch and ends the claim.
    ///
    /// MUST apply all outcomes atomically (one transaction) and only for rows the claim still
    /// owns. Rows of the claim that have no outcome MUST be released unchanged. For
    /// [`Outcome::Retry`], the attempt counter MUST increase and the row MUST NOT be claimable
    /// before `delay` has passed. [`Outcome::Defer`] is the same without counting an attempt.
    /// A publication MUST advance the aggregate's `last` to the event's version. For a run,
    /// the prefix rule of the module contract's *Runs* clause: outcomes out of prefix order are
    /// refused, the rest of the run is released, `last` advances to the prefix's end. MUST
    /// report the events of refused outcomes in [`CompletionReport::superseded_events`].
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError>;

    /// Gives a claim's rows back without counting an attempt (graceful shutdown, lease about to
    /// expire). MUST be a no-op for rows the claim no longer owns.
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError>;

    /// The claim mode, so a relay can check its lease against the publisher's delivery timeout.
    fn claim_mode(&self) -> ClaimMode;

    /// In locked-transaction mode: the longest a claim may be held before the store ends it
    /// (PostgreSQL: `idle_in_transaction_session_timeout`). The relay checks it against the
    /// publisher's delivery timeout (twice that with prefetch). `None`: no such limit.
    fn locked_claim_timeout(&self) -> Option<std::time::Duration> {
        None
    }
}

/// The operator's role: parked events and what was done to them, and claims of a relay that
/// is gone.
///
/// Carries the **nothing is skipped** clause of the [module contract](self): every action
/// here MUST be audited.
#[async_trait]
pub trait OperatorStore: Send + Sync {
    /// Lists parked events, oldest first.
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError>;

    /// One parked event, with what is known of its earlier attempts
    /// ([`ParkedEvent::delivery_uncertain`]): show it to an operator before a re-issue. MUST fail
    /// with `NotFound` unless the event is parked.
    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError>;

    /// Makes a parked event claimable again, keeping its event id and resetting its attempts.
    /// MUST fail with `NotFound` unless the event is parked. A retry accepts the event's version
    /// as its aggregate's next one (`last` becomes at least `version - 1`: the operator's
    /// answer to a version gap); it MUST fail with `Conflict` for an event at or below `last`
    /// (out of order: publishing it would deliver it after a later version; discard it), and
    /// with `Conflict` while unfinished events of its aggregate between `last` and its version
    /// wait (lower versions that arrived after it was parked go out first). MUST be audited.
    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError>;

    /// [`retry_parked`](Self::retry_parked) with the operator's `reason` (what was fixed)
    /// recorded in the audit trail beside the actor; an empty reason records none, as
    /// `retry_parked` does. Stores that keep an audit trail MUST override it so the reason is
    /// recorded; wrappers MUST forward it. The default never drops a reason: it refuses a
    /// non-empty one (`Configuration`) and forwards an empty one to `retry_parked`.
    async fn retry_parked_with_reason(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        if !reason.trim().is_empty() {
            return Err(StoreError::new(
                crate::StoreErrorKind::Configuration,
                "this store does not record the reason of a retry",
            ));
        }
        self.retry_parked(event_id, actor).await
    }

    /// Removes a parked event from delivery; the aggregate's later events flow again (`last`
    /// becomes at least the event's version, so the version after it is the next one).
    /// MUST require a non-empty reason, MUST fail with `NotFound` unless the event is parked,
    /// MUST fail with `Conflict` while unfinished events of its aggregate between `last` and its
    /// version wait (they go out first; discarding above them would park them), and MUST be
    /// audited.
    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError>;

    /// Replaces a parked event by a copy with a new event id at the same aggregate version and
    /// returns the new id. The original is marked discarded. The copy MUST carry the original's
    /// id in the [`crate::wire::ORIGINAL_EVENT_ID`] header (kept from an earlier copy when the
    /// original was itself a copy), so consumers deduplicate the two as one event
    /// ([`Envelope::dedup_id`]): an original that did reach the broker (a timeout whose
    /// acknowledgement was lost) and its copy are applied once. MUST require a non-empty
    /// reason, MUST fail with `NotFound` unless the event is parked, and MUST be audited.
    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError>;

    /// The audit trail, newest last; `event_id` filters to one event.
    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError>;

    /// Ends every claim of `owner` (an operator action for a relay that is gone and whose
    /// leases would otherwise keep its aggregates until they expire). Returns the number of
    /// aggregates released. Only for a relay that is really gone: if it still publishes, the
    /// next version of an aggregate can go out before its in-flight one is acknowledged. In
    /// locked-transaction mode the claims end with the relay's connection; stores MAY return
    /// 0 there. MUST be audited where the store keeps an audit trail.
    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError>;
}

/// The maintenance role: bounded cleanup of finished rows, and the monitoring snapshot.
#[async_trait]
pub trait MaintenanceStore: Send + Sync {
    /// Deletes published (and discarded) rows older than `retention`, at most `batch_size` rows
    /// per transaction. MUST NOT touch pending or parked rows.
    async fn cleanup(
        &self,
        retention: std::time::Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError>;

    /// A monitoring snapshot.
    async fn stats(&self) -> Result<OutboxStats, StoreError>;
}

/// A whole outbox store: every role but the read-only [`ReportingStore`].
///
/// Implemented for every type that implements [`AppendStore`], [`RelayStore`],
/// [`OperatorStore`] and [`MaintenanceStore`]; implement those, never this. Bound a caller by
/// the roles it uses where it can ([`crate::Relay`] asks for [`RelayStore`] only).
pub trait OutboxStore: AppendStore + RelayStore + OperatorStore + MaintenanceStore {}

impl<T> OutboxStore for T where T: AppendStore + RelayStore + OperatorStore + MaintenanceStore {}

/// The store traits, for `use outbox_core::store::prelude::*;`: code that calls role methods
/// on a concrete store needs the role traits in scope, not only the umbrella.
pub mod prelude {
    pub use super::{
        AppendStore, MaintenanceStore, OperatorStore, OutboxStore, RelayRegistry, RelayStore,
        ReportingStore,
    };
}
