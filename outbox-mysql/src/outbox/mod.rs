//! [`MySqlOutboxStore`]: the outbox on MySQL 8 / MariaDB, one module per concern, grouped by
//! the role that calls it, so that a split of `OutboxStore` into role traits maps onto files:
//!
//! * append (the application): `append`, `wake`;
//! * relay (claim, complete, release): `claim`, `decide`, `head`, `complete`;
//! * operator (parked events, claims of a relay that is gone, audit): `operator`;
//! * maintenance (cleanup): `maintenance`;
//! * read-only reporting (stats; the operator's reads: publish latency, published events in
//!   publication order for replay, reconciliation counts): `reporting`, `admin`;
//! * shared: `builder`, `rows`, `tx`.

mod admin;
mod append;
mod builder;
mod claim;
mod complete;
mod decide;
mod head;
mod maintenance;
mod operator;
mod registry;
mod reporting;
pub(crate) mod rows;
pub(crate) mod tx;
mod wake;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{MySqlConnection, MySqlPool};
use uuid::Uuid;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, Envelope, EventId, OutboxStats, Outcome, ParkedEvent, StoreError,
};

pub use admin::{IntervalCount, LatencySummary, PublishedFilter, PublishedPosition, PublishedRow};
pub use builder::MySqlOutboxStoreBuilder;
pub use wake::WakeSubscription;

use crate::config::OutboxSettings;
use crate::schema::{self, qualified};
use claim::{ClaimedRow, LockedClaim};

/// The outbox on MySQL 8.0.13+ or MariaDB 10.6+ (InnoDB). Cheap to clone (shared state behind
/// an `Arc`).
///
/// * `append` joins the caller's transaction: `Tx = MySqlConnection`, so pass `&mut *tx` of
///   your own `sqlx::Transaction`; or use the inherent [`append`](Self::append) /
///   [`append_many`](Self::append_many), generic over any sqlx MySQL executor (one statement),
///   or [`append_many_in`](Self::append_many_in) for a batch of any size.
/// * Claims follow the configured [`ClaimMode`]; see the crate docs for the mechanism.
#[derive(Clone)]
pub struct MySqlOutboxStore {
    inner: Arc<Inner>,
}

/// Qualified names of the store's tables.
#[derive(Debug)]
pub(crate) struct Tables {
    /// The outbox table.
    pub(crate) events: String,
    /// Per-aggregate delivery state.
    pub(crate) state: String,
    pub(crate) audit: String,
    pub(crate) archive: String,
    /// Lease mode: one row per claim batch (owner, expiry); the rows carry its token.
    pub(crate) lease: String,
    /// The relay registry.
    pub(crate) relays: String,
}

struct Inner {
    pool: MySqlPool,
    settings: OutboxSettings,
    tables: Tables,
    /// Open claims of [`ClaimMode::LockedTransaction`], by claim token.
    locked: Mutex<HashMap<Uuid, LockedClaim>>,
    /// Rows of lease claims made by this instance, by token (saves a lookup on complete).
    /// The lease's end is the claim's one reading of the database clock, which fences its
    /// completion (see `complete::Fence`).
    leased: Mutex<HashMap<Uuid, LeasedClaim>>,
    /// Relays of this process to wake after a commit that appended (see `wake`).
    wakers: wake::Wakers,
}

/// A lease claim this instance made: its rows, its lease's end (the claim's one reading of the
/// database clock), and when it was made (for forgetting claims never completed).
type LeasedClaim = (Vec<ClaimedRow>, chrono::NaiveDateTime, Instant);

impl std::fmt::Debug for MySqlOutboxStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlOutboxStore")
            .field("table", &self.inner.tables.events)
            .field("claim_mode", &self.inner.settings.claim_mode)
            .finish_non_exhaustive()
    }
}

impl MySqlOutboxStore {
    /// A builder with the defaults of [`OutboxSettings`].
    pub fn builder(pool: MySqlPool) -> MySqlOutboxStoreBuilder {
        MySqlOutboxStoreBuilder {
            pool,
            settings: OutboxSettings::default(),
            delivery_timeout: None,
        }
    }

    /// The settings in effect.
    pub fn settings(&self) -> &OutboxSettings {
        &self.inner.settings
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The qualified name of the outbox table (`` `database`.`table` ``).
    pub fn table_name(&self) -> &str {
        &self.inner.tables.events
    }

    /// Applies the embedded migrations (outbox, per-aggregate state, audit and archive tables)
    /// that are missing, creating the database when one is configured. Safe to call from
    /// several processes at once (a named lock serializes the runs). Returns how many were
    /// applied. Outbox migration 2 renames the acknowledgement columns (docs/transports.md
    /// §2): relays of the previous version fail their completions until they are upgraded.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        let s = &self.inner.settings;
        schema::migrate(
            &self.inner.pool,
            schema::Component::Outbox,
            s.database.as_deref(),
            &s.table,
        )
        .await
    }

    /// What [`migrate`](Self::migrate) has applied for this store's table and what it would
    /// still apply; reads the migration log only (a missing log: nothing applied).
    pub async fn migration_status(&self) -> Result<crate::MigrationStatus, StoreError> {
        let s = &self.inner.settings;
        schema::migration_status(
            &self.inner.pool,
            schema::Component::Outbox,
            s.database.as_deref(),
            &s.table,
        )
        .await
    }

    /// The schema of this store as plain SQL (for your own migration tool).
    pub fn schema_sql(&self) -> String {
        let s = &self.inner.settings;
        schema::outbox_schema_sql(s.database.as_deref(), &s.table)
            .expect("names validated by build()")
    }
}

impl Tables {
    fn new(database: Option<&str>, table: &str) -> Self {
        Self {
            events: qualified(database, table),
            state: qualified(database, &format!("{table}_aggregate")),
            audit: qualified(database, &format!("{table}_audit")),
            archive: qualified(database, &format!("{table}_archive")),
            lease: qualified(database, &format!("{table}_lease")),
            relays: qualified(database, &format!("{table}_relays")),
        }
    }
}

#[async_trait]
impl AppendStore for MySqlOutboxStore {
    type Tx = MySqlConnection;

    async fn append(
        &self,
        tx: &mut MySqlConnection,
        events: &[Envelope],
    ) -> Result<(), StoreError> {
        self.append_many_in(tx, events).await
    }
}

#[async_trait]
impl RelayStore for MySqlOutboxStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        self.claim_inner(request).await
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        self.complete_inner(claim, outcomes).await
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.release_inner(claim).await
    }

    fn claim_mode(&self) -> ClaimMode {
        self.inner.settings.claim_mode
    }

    fn locked_claim_timeout(&self) -> Option<Duration> {
        (self.inner.settings.claim_mode == ClaimMode::LockedTransaction)
            .then(|| tx::hold_secs(self.inner.settings.locked_max_hold))
            .map(Duration::from_secs)
    }
}

#[async_trait]
impl OperatorStore for MySqlOutboxStore {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        self.list_parked_inner(limit).await
    }

    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        self.parked_event_inner(event_id).await
    }

    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        self.retry_parked_inner(event_id, actor, "").await
    }

    async fn retry_parked_with_reason(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.retry_parked_inner(event_id, actor, reason.trim())
            .await
    }

    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.discard_parked_inner(event_id, actor, reason).await
    }

    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        self.reissue_parked_inner(event_id, actor, reason).await
    }

    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        self.audit_trail_inner(event_id).await
    }

    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        self.release_claims_of_inner(owner, actor).await
    }
}

#[async_trait]
impl MaintenanceStore for MySqlOutboxStore {
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        self.cleanup_inner(retention, batch_size).await
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        self.stats_inner().await
    }
}

impl MySqlOutboxStore {
    /// [`crate::check_durability`] for this store's server and tables.
    pub async fn check_durability(&self) -> Result<crate::DurabilityReport, StoreError> {
        let s = &self.inner.settings;
        let names = [
            s.table.clone(),
            format!("{}_aggregate", s.table),
            format!("{}_audit", s.table),
            format!("{}_lease", s.table),
        ];
        let tables: Vec<&str> = names.iter().map(String::as_str).collect();
        crate::check_durability(&self.inner.pool, s.database.as_deref(), &tables).await
    }
}

pub(crate) use head::marks;
pub(crate) use tx::begin;
