//! [`PostgresOutboxStore`]: the outbox on PostgreSQL, one module per concern.

mod admin;
mod append;
mod builder;
mod claim;
mod complete;
mod maintenance;
mod operator;
mod registry;
pub(crate) mod rows;
mod wake_gate;
pub(crate) use wake_gate::gate_keys;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, Envelope, EventId, OutboxStats, Outcome, ParkedEvent, StoreError,
};

pub use admin::{
    IntervalCount, LatencySummary, PublishedFilter, PublishedPosition, PublishedRow, RecordedTopic,
};
pub use builder::PostgresOutboxStoreBuilder;

use crate::config::OutboxSettings;
use crate::schema;
use crate::sql::OutboxSql;
use claim::{ClaimedRow, LockedClaim};

/// The outbox on PostgreSQL. Cheap to clone (shared state behind an `Arc`).
///
/// * `append` joins the caller's transaction: `Tx = PgConnection`, so pass `&mut *tx` of your
///   own `sqlx::Transaction`; or use the inherent [`append`](Self::append) /
///   [`append_many`](Self::append_many), generic over any sqlx executor.
/// * Claims follow the configured [`ClaimMode`]; see the crate docs for the ordering mechanism.
#[derive(Clone)]
pub struct PostgresOutboxStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    settings: OutboxSettings,
    sql: OutboxSql,
    /// Per-table seed of the advisory lock keys.
    seed: i64,
    /// Open claim transactions of [`ClaimMode::LockedTransaction`], by claim token.
    locked: Mutex<HashMap<Uuid, LockedClaim>>,
    /// Rows of lease claims made by this instance, by token (saves a lookup on complete).
    leased: Mutex<HashMap<Uuid, (Vec<ClaimedRow>, Instant)>>,
    /// The wake-up gate's connection (see `wake_gate`).
    gate: wake_gate::WakeGate,
    /// The gate is armed: appends notify.
    gate_armed: AtomicBool,
    /// [`PostgresOutboxStore::spawn_listener`] runs for this store: an empty claim arms the gate.
    listening: AtomicBool,
    /// Append statements through this instance that raised a `NOTIFY`.
    notifies: AtomicU64,
}

impl std::fmt::Debug for PostgresOutboxStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresOutboxStore")
            .field("table", &self.inner.sql.table)
            .field("claim_mode", &self.inner.settings.claim_mode)
            .field("notify_channel", &self.inner.settings.notify_channel)
            .finish_non_exhaustive()
    }
}

impl PostgresOutboxStore {
    /// A builder with the defaults of [`OutboxSettings`].
    pub fn builder(pool: PgPool) -> PostgresOutboxStoreBuilder {
        PostgresOutboxStoreBuilder {
            pool,
            settings: OutboxSettings::default(),
            channel_set: false,
            delivery_timeout: None,
        }
    }

    /// The settings in effect.
    pub fn settings(&self) -> &OutboxSettings {
        &self.inner.settings
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// Applies the embedded migrations (outbox, per-aggregate state, audit and archive tables)
    /// that are missing. Safe to call from several processes at once. Returns how many were
    /// applied. Migration 8 renames the acknowledgement columns (docs/transports.md §2): relays
    /// of the previous version fail their completions until they are upgraded.
    ///
    /// On an existing table, the indexes of migrations 4 and 10 are built after the
    /// migrations' transaction with `CREATE INDEX CONCURRENTLY` (appends go on meanwhile; an
    /// invalid index an interrupted build left is built again by the next call). Such a build
    /// waits for the database's transactions older than it, and is serialized across
    /// processes by a session advisory lock: migrate over a direct connection or a pooler in
    /// session mode.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        let s = &self.inner.settings;
        schema::migrate(
            &self.inner.pool,
            schema::Component::Outbox,
            &s.schema,
            &s.table,
        )
        .await
    }

    /// The schema of this store as plain SQL (for your own migration tool).
    pub fn schema_sql(&self) -> String {
        let s = &self.inner.settings;
        schema::outbox_schema_sql(&s.schema, &s.table).expect("names validated by build()")
    }
}

#[async_trait]
impl AppendStore for PostgresOutboxStore {
    type Tx = PgConnection;

    async fn append(&self, tx: &mut PgConnection, events: &[Envelope]) -> Result<(), StoreError> {
        self.append_many(&mut *tx, events).await
    }
}

#[async_trait]
impl RelayStore for PostgresOutboxStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        self.claim_gated(request).await
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
            .then_some(self.inner.settings.locked_max_hold)
    }
}

#[async_trait]
impl OperatorStore for PostgresOutboxStore {
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
impl MaintenanceStore for PostgresOutboxStore {
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
