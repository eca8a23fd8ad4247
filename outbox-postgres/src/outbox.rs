//! [`PostgresOutboxStore`]: the outbox on PostgreSQL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Executor, PgConnection, PgPool, Postgres, Row, Transaction};
use tracing::warn;
use uuid::Uuid;

use outbox_core::{
    async_trait, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, ClaimedRecord,
    CleanupReport, CompletionReport, Envelope, EnvelopeLimits, ErrorClass, EventId, LastError,
    OperatorAction, OutboxStats, OutboxStore, Outcome, ParkKind, ParkReason, ParkedEvent, Payload,
    StoreError, StoreErrorKind,
};

use crate::config::{AppendGuard, OutboxSettings};
use crate::error::{config, db};
use crate::schema::{self, validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};
use crate::sql::OutboxSql;

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
    /// Open claim transactions of [`ClaimMode::LockedTransaction`], by claim token.
    locked: Mutex<HashMap<Uuid, LockedClaim>>,
    /// Row ids of lease claims made by this instance, by token (saves a scan on complete).
    leased: Mutex<HashMap<Uuid, (ClaimedRows, Instant)>>,
}

/// Transactions of claims and completions: custom plans (the statements take id arrays whose
/// size a generic plan cannot know), in the same round trip as BEGIN.
const BEGIN_CLAIM: &str = "BEGIN; SET LOCAL plan_cache_mode = force_custom_plan";

/// Completions commit without waiting for the WAL flush (see the crate docs, "Durability of
/// completions"): a completion lost in a server crash leaves its rows unpublished (and, in
/// lease mode, leased until expiry), so they are published again: a duplicate, never a loss,
/// and never a reordering, because any later claim of the aggregate commits synchronously and
/// thereby flushes the earlier completion's commit record first.
const ASYNC_COMMIT: &str = "SET LOCAL synchronous_commit = off";

/// (row id, event id, aggregate lock key) of the rows of one claim.
type ClaimedRows = Vec<(i64, Uuid, i64)>;

struct LockedClaim {
    tx: Transaction<'static, Postgres>,
    /// The claimed rows.
    rows: ClaimedRows,
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

/// Builder of a [`PostgresOutboxStore`]; [`build`](Self::build) validates.
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresOutboxStoreBuilder {
    pool: PgPool,
    settings: OutboxSettings,
    channel_set: bool,
    delivery_timeout: Option<Duration>,
}

impl PostgresOutboxStoreBuilder {
    /// Schema of the tables (default `outbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.settings.schema = schema.into();
        self
    }
    /// Outbox table name (default `outbox_events`, at most 40 characters).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.settings.table = table.into();
        self
    }
    /// Claim mode (default: 30 s lease).
    pub fn claim_mode(mut self, mode: ClaimMode) -> Self {
        self.settings.claim_mode = mode;
        self
    }
    /// The `NOTIFY` channel raised by appends (default `<schema>_<table>`); `None` disables.
    pub fn notify_channel(mut self, channel: Option<&str>) -> Self {
        self.settings.notify_channel = channel.map(str::to_owned);
        self.channel_set = true;
        self
    }
    /// Archive rows into `<table>_archive` on cleanup (default off).
    pub fn archive(mut self, archive: bool) -> Self {
        self.settings.archive = archive;
        self
    }
    /// Envelope limits checked on append.
    pub fn limits(mut self, limits: EnvelopeLimits) -> Self {
        self.settings.limits = limits;
        self
    }
    /// Longest idle time of a locked claim transaction (default 5 min).
    pub fn locked_max_hold(mut self, d: Duration) -> Self {
        self.settings.locked_max_hold = d;
        self
    }
    /// Completions wait for the WAL flush at commit (default `false`: they commit
    /// asynchronously, which is safe under at-least-once delivery; see the crate docs).
    pub fn synchronous_completion(mut self, on: bool) -> Self {
        self.settings.synchronous_completion = on;
        self
    }
    /// The publisher's delivery timeout: `build()` then rejects a lease (or, in locked mode, a
    /// `locked_max_hold`) that does not outlive it, since such a claim could end while the
    /// broker still holds a record and let another relay send the aggregate's next version.
    /// (`outbox_core::Relay::new` checks the lease against the publisher too.)
    pub fn publisher_delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = Some(d);
        self
    }
    /// The backpressure hook, see [`AppendGuard`].
    pub fn append_guard(mut self, guard: Arc<dyn AppendGuard>) -> Self {
        self.settings.append_guard = Some(guard);
        self
    }

    /// Validates names and durations. A hostile or malformed identifier is a `Configuration`
    /// error; it never reaches SQL.
    pub fn build(mut self) -> Result<PostgresOutboxStore, StoreError> {
        let s = &mut self.settings;
        validate_identifier("schema", &s.schema, MAX_IDENTIFIER_LEN)?;
        validate_identifier("table", &s.table, MAX_TABLE_NAME_LEN)?;
        if !self.channel_set {
            let ch = format!("{}_{}", s.schema, s.table);
            s.notify_channel = (ch.len() <= MAX_IDENTIFIER_LEN).then_some(ch);
        }
        if let Some(ch) = &s.notify_channel {
            validate_identifier("notify channel", ch, MAX_IDENTIFIER_LEN)?;
        }
        match s.claim_mode {
            ClaimMode::Lease { duration } if duration < Duration::from_millis(1) => {
                return Err(config("lease duration must be at least 1 ms"));
            }
            ClaimMode::LockedTransaction if s.locked_max_hold < Duration::from_millis(10) => {
                return Err(config("locked_max_hold must be at least 10 ms"));
            }
            ClaimMode::Lease { .. } | ClaimMode::LockedTransaction => {}
            other => return Err(config(format!("unsupported claim mode {other:?}"))),
        }
        if let Some(timeout) = self.delivery_timeout {
            let (what, claim) = match s.claim_mode {
                ClaimMode::Lease { duration } => ("lease", duration),
                _ => ("locked_max_hold", s.locked_max_hold),
            };
            if claim <= timeout {
                return Err(config(format!(
                    "the {what} ({claim:?}) must outlive the publisher's delivery timeout \
                     ({timeout:?})"
                )));
            }
        }
        let sql = OutboxSql::new(&s.schema, &s.table);
        Ok(PostgresOutboxStore {
            inner: Arc::new(Inner {
                pool: self.pool,
                settings: self.settings,
                sql,
                locked: Mutex::new(HashMap::new()),
                leased: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// Columns of one append, as arrays for `UNNEST`.
#[derive(Default)]
struct AppendArrays {
    ids: Vec<Uuid>,
    agg_types: Vec<String>,
    agg_ids: Vec<String>,
    versions: Vec<i64>,
    event_types: Vec<String>,
    schema_versions: Vec<i32>,
    content_types: Vec<String>,
    payloads: Vec<Vec<u8>>,
    headers: Vec<String>,
    created: Vec<DateTime<Utc>>,
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

    /// Applies the embedded migrations (outbox, audit and archive tables) that are missing.
    /// Safe to call from several processes at once. Returns how many were applied.
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

    /// Appends one event through any executor (`&mut *tx`, `&mut PgConnection`, `&PgPool`).
    pub async fn append<'e, E>(&self, executor: E, event: &Envelope) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        self.append_many(executor, std::slice::from_ref(event))
            .await
    }

    /// Appends many events in one statement (one round trip, `INSERT .. SELECT FROM UNNEST`).
    ///
    /// Validates every envelope first (a `Validation` error writes nothing), then asks the
    /// [`AppendGuard`] (a `Backpressure` error writes nothing). A duplicate event id is a
    /// `Constraint` error; inside a transaction, that transaction is then aborted.
    pub async fn append_many<'e, E>(
        &self,
        executor: E,
        events: &[Envelope],
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        if events.is_empty() {
            return Ok(());
        }
        let s = &self.inner.settings;
        for e in events {
            e.validate(&s.limits)?;
        }
        if let Some(guard) = &s.append_guard {
            guard.check(events)?;
        }
        let mut a = AppendArrays::default();
        for e in events {
            a.ids.push(e.event_id.as_uuid());
            a.agg_types.push(e.aggregate_type.clone());
            a.agg_ids.push(e.aggregate_id.clone());
            a.versions.push(e.aggregate_version);
            a.event_types.push(e.event_type.clone());
            a.schema_versions.push(e.schema_version);
            a.content_types.push(e.payload.content_type.clone());
            a.payloads.push(e.payload.bytes.clone());
            a.headers.push(
                serde_json::to_string(&e.headers)
                    .map_err(|err| StoreError::new(StoreErrorKind::Validation, err.to_string()))?,
            );
            a.created.push(e.created_at);
        }
        let row = sqlx::query(&self.inner.sql.append)
            .bind(a.ids)
            .bind(a.agg_types)
            .bind(a.agg_ids)
            .bind(a.versions)
            .bind(a.event_types)
            .bind(a.schema_versions)
            .bind(a.content_types)
            .bind(a.payloads)
            .bind(a.headers)
            .bind(a.created)
            .bind(s.notify_channel.as_deref())
            .fetch_one(executor)
            .await
            .map_err(db)?;
        let n: i64 = row.try_get("n").map_err(db)?;
        if n as usize != events.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("appended {n} of {} events", events.len()),
            ));
        }
        Ok(())
    }

    /// Runs both claim statements under `EXPLAIN (ANALYZE, BUFFERS)` in a transaction that is
    /// rolled back (nothing is claimed), and returns the two plans: step 1 (candidates, locks,
    /// and the claim of those it can decide on its snapshot), and step 2 (the re-check in a new
    /// snapshot) as it would run if every candidate needed it. For capacity checks: the claim
    /// should read a number of buffers that depends on `limit`, not on the backlog.
    pub async fn explain_claim(&self, limit: usize) -> Result<Vec<String>, StoreError> {
        let limit = limit.clamp(1, 100_000) as i64;
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        let explain = |sql: &str| format!("EXPLAIN (ANALYZE, BUFFERS) {sql}");
        // The candidates step 2 would get, read before step 1 writes anything.
        let ids: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} WHERE status = 'pending' AND NOT blocked ORDER BY id LIMIT $1",
            self.inner.sql.table
        ))
        .bind(limit)
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let sql = &self.inner.sql;
        let (first_sql, recheck_sql, lease) = match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => (&sql.claim_first_locked, &sql.claim_locked, None),
            _ => (
                &sql.claim_first_lease,
                &sql.claim_lease,
                Some(("explain", Uuid::now_v7(), 1_000_000i64)),
            ),
        };
        let plan = |rows: Vec<PgRow>| -> Result<String, StoreError> {
            let lines: Vec<String> = rows
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()
                .map_err(db)?;
            Ok(lines.join("\n"))
        };
        let first_sql = explain(first_sql);
        let first = lease_args(sqlx::query(&first_sql).bind(limit), lease)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        let recheck_sql = explain(recheck_sql);
        let second = lease_args(sqlx::query(&recheck_sql).bind(&ids), lease)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        let (first, second) = (plan(first)?, plan(second)?);
        tx.rollback().await.map_err(db)?;
        Ok(vec![first, second])
    }

    /// Runs the completion statement of `claim` under `EXPLAIN (ANALYZE, BUFFERS)` in a
    /// transaction that is rolled back (lease mode only; nothing is recorded).
    #[doc(hidden)]
    pub async fn explain_complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<String, StoreError> {
        let rows = self.lease_rows(claim.token).await?;
        self.inner
            .leased
            .lock()
            .expect("poisoned")
            .insert(claim.token, (rows.clone(), Instant::now()));
        let keys: Vec<i64> = rows.iter().map(|&(_, _, k)| k).collect();
        let arrays = OutcomeArrays::new(outcomes, &rows);
        let mut tx = self.inner.pool.begin_with(BEGIN_CLAIM).await.map_err(db)?;
        let sql = format!(
            "EXPLAIN (ANALYZE, BUFFERS) {}",
            self.inner.sql.complete_lease
        );
        let lines: Vec<String> = arrays
            .bind(sqlx::query(&sql))
            .bind(claim.token)
            .bind(&keys)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<_, _>>()
            .map_err(db)?;
        tx.rollback().await.map_err(db)?;
        Ok(lines.join("\n"))
    }

    /// Test support: ends a locked claim as a crash would (its transaction is rolled back,
    /// so its row and aggregate locks go), without the relay calling `complete` or `release`.
    /// Returns `false` when the store holds no such claim.
    #[doc(hidden)]
    pub async fn abandon_locked_claim(&self, claim: &ClaimHandle) -> bool {
        let taken = self
            .inner
            .locked
            .lock()
            .expect("poisoned")
            .remove(&claim.token);
        match taken {
            Some(held) => {
                let mut conn = held.tx;
                // Closing the connection is what a crash does; rolling back frees the same locks.
                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                drop(conn);
                true
            }
            None => false,
        }
    }

    async fn claim_inner(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let token = Uuid::now_v7();
        let handle = ClaimHandle {
            token,
            owner: request.owner.clone(),
        };
        let limit = request.limit.clamp(1, 100_000) as i64;
        let mode = self.inner.settings.claim_mode;
        let mut tx = if mode == ClaimMode::LockedTransaction {
            let ms = self.inner.settings.locked_max_hold.as_millis().max(1);
            // A SET cannot take bind parameters; the value is an integer we formatted.
            self.inner
                .pool
                .begin_with(format!(
                    "{BEGIN_CLAIM}; SET LOCAL idle_in_transaction_session_timeout = {ms}{}",
                    if self.inner.settings.synchronous_completion {
                        String::new()
                    } else {
                        // The claim transaction ends with the completion (locks only before).
                        format!("; {ASYNC_COMMIT}")
                    }
                ))
                .await
        } else {
            self.inner.pool.begin_with(BEGIN_CLAIM).await
        }
        .map_err(db)?;
        // Lease mode: the owner, token and lease length of every claim statement ($2..$4).
        let lease = match mode {
            ClaimMode::Lease { duration } => Some((
                request.owner.as_str(),
                token,
                duration.as_micros().min(i64::MAX as u128) as i64,
            )),
            _ => None,
        };
        let sql = &self.inner.sql;
        let (first_sql, recheck_sql) = match lease {
            Some(_) => (&sql.claim_first_lease, &sql.claim_lease),
            None => (&sql.claim_first_locked, &sql.claim_locked),
        };
        // Step 1: candidates, locks and (lease mode) the leases of the `fast` ones.
        let first = lease_args(sqlx::query(first_sql).bind(limit), lease)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        if first.is_empty() {
            tx.commit().await.map_err(db)?;
            return Ok(ClaimedBatch::new(handle, Vec::new(), None));
        }
        let limits = &self.inner.settings.limits;
        let mut claimed: Vec<(i64, i64, ClaimedRecord)> = Vec::with_capacity(first.len());
        let mut remaining_us: Option<i64> = None;
        let mut take = |row: &PgRow| -> Result<(), StoreError> {
            let envelope = envelope_from_row(row, limits)?;
            let attempts: i32 = row.try_get("attempts").map_err(db)?;
            let id = row.try_get::<i64, _>("id").map_err(db)?;
            let k = row.try_get::<i64, _>("k").map_err(db)?;
            if let Some(r) = row.try_get::<Option<i64>, _>("remaining_us").map_err(db)? {
                remaining_us = Some(remaining_us.map_or(r, |m| m.min(r)));
            }
            claimed.push((id, k, ClaimedRecord::new(envelope, attempts.max(0) as u32)));
            Ok(())
        };
        let mut recheck: Vec<i64> = Vec::new();
        for row in &first {
            if !row.try_get::<bool, _>("fast").map_err(db)? {
                recheck.push(row.try_get::<i64, _>("id").map_err(db)?);
            } else if row.try_get::<bool, _>("claimed").map_err(db)? {
                take(row)?;
            }
            // Fast but not claimed: a newer live lease of the aggregate (or a colliding key)
            // won; the row stays for a later claim.
        }
        // Step 2: the candidates whose view in step 1 may have been stale, in a new snapshot.
        if !recheck.is_empty() {
            let rows = lease_args(sqlx::query(recheck_sql).bind(&recheck), lease)
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?;
            for row in &rows {
                take(row)?;
            }
        }
        // Oldest first (the result order of the claim statement is not guaranteed).
        claimed.sort_unstable_by_key(|c| c.0);
        let claimed_rows: ClaimedRows = claimed
            .iter()
            .map(|(id, k, r)| (*id, r.envelope.event_id.as_uuid(), *k))
            .collect();
        let records: Vec<ClaimedRecord> = claimed.into_iter().map(|(_, _, r)| r).collect();
        match mode {
            ClaimMode::LockedTransaction if !records.is_empty() => {
                self.inner.locked.lock().expect("poisoned").insert(
                    token,
                    LockedClaim {
                        tx,
                        rows: claimed_rows,
                    },
                );
                Ok(ClaimedBatch::new(handle, records, None))
            }
            _ => {
                tx.commit().await.map_err(db)?;
                if !claimed_rows.is_empty() {
                    if let ClaimMode::Lease { duration } = mode {
                        let mut leased = self.inner.leased.lock().expect("poisoned");
                        // Forget claims that were never completed (crashed relay tasks).
                        let horizon = duration * 2 + Duration::from_secs(60);
                        leased.retain(|_, (_, at)| at.elapsed() < horizon);
                        leased.insert(token, (claimed_rows, Instant::now()));
                    }
                }
                let remaining = remaining_us.map(|us| Duration::from_micros(us.max(0) as u64));
                Ok(ClaimedBatch::new(handle, records, remaining))
            }
        }
    }

    async fn complete_inner(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => {
                let taken = self
                    .inner
                    .locked
                    .lock()
                    .expect("poisoned")
                    .remove(&claim.token);
                let Some(mut held) = taken else {
                    // Unknown token: the claim ended (released, timed out) or belongs to
                    // another store instance. Nothing applied; every outcome is refused.
                    return Ok(CompletionReport::new(
                        0,
                        outcomes.iter().map(Outcome::event_id).collect(),
                    ));
                };
                let arrays = OutcomeArrays::new(outcomes, &held.rows);
                // The aggregate locks were taken by the claim in this very transaction.
                let applied: Vec<i64> = arrays
                    .statement(&self.inner.sql, false)
                    .fetch_one(&mut *held.tx)
                    .await
                    .map_err(|e| lost_claim(db(e)))?
                    .try_get("applied")
                    .map_err(db)?;
                held.tx.commit().await.map_err(|e| lost_claim(db(e)))?;
                Ok(report(outcomes, &held.rows, &applied))
            }
            _ => {
                let rows = self.lease_rows(claim.token).await?;
                // Every lease of the claim ends here (rows without an outcome are released).
                let keys: Vec<i64> = rows.iter().map(|&(_, _, k)| k).collect();
                let arrays = OutcomeArrays::new(outcomes, &rows);
                let begin = if self.inner.settings.synchronous_completion {
                    BEGIN_CLAIM.to_owned()
                } else {
                    format!("{BEGIN_CLAIM}; {ASYNC_COMMIT}")
                };
                let mut tx = self.inner.pool.begin_with(begin).await.map_err(db)?;
                // Serialize with claims that classify rows of the same aggregates: a row
                // blocked behind a head we publish now is then always seen by the promotion.
                let published = arrays.published_keys();
                if !published.is_empty() {
                    sqlx::query(&self.inner.sql.lock_aggregates_of_events)
                        .bind(&published)
                        .execute(&mut *tx)
                        .await
                        .map_err(db)?;
                }
                let applied: Vec<i64> = arrays
                    .statement(&self.inner.sql, true)
                    .bind(claim.token)
                    .bind(&keys)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?
                    .try_get("applied")
                    .map_err(db)?;
                tx.commit().await.map_err(db)?;
                Ok(report(outcomes, &rows, &applied))
            }
        }
    }

    /// The rows of a lease claim: from memory (claimed here), else by a candidate-index scan.
    async fn lease_rows(&self, token: Uuid) -> Result<ClaimedRows, StoreError> {
        let known = self.inner.leased.lock().expect("poisoned").remove(&token);
        match known {
            Some((rows, _)) => Ok(rows),
            None => {
                let rows = sqlx::query(&self.inner.sql.lease_rows)
                    .bind(token)
                    .fetch_all(&self.inner.pool)
                    .await
                    .map_err(db)?;
                rows.iter()
                    .map(|r| Ok((r.try_get("id")?, r.try_get("event_id")?, r.try_get("k")?)))
                    .collect::<Result<_, sqlx::Error>>()
                    .map_err(db)
            }
        }
    }

    /// Runs `f` in a transaction after locking the aggregate of `event_id`. `NotFound` when the
    /// event does not exist.
    async fn with_event_lock(
        &self,
        event_id: EventId,
    ) -> Result<(Transaction<'static, Postgres>, String, String), StoreError> {
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        let row = sqlx::query(&self.inner.sql.lock_event_aggregate)
            .bind(event_id.as_uuid())
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?
            .ok_or_else(|| not_found(event_id))?;
        let k: i64 = row.try_get("k").map_err(db)?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(k)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let at: String = row.try_get("aggregate_type").map_err(db)?;
        let ai: String = row.try_get("aggregate_id").map_err(db)?;
        Ok((tx, at, ai))
    }

    async fn notify_after(&self, conn: &mut PgConnection) -> Result<(), StoreError> {
        if let Some(ch) = &self.inner.settings.notify_channel {
            sqlx::query("SELECT pg_notify($1, '')::text")
                .bind(ch)
                .execute(conn)
                .await
                .map_err(db)?;
        }
        Ok(())
    }

    async fn table_extra(&self) -> Result<Vec<(String, f64)>, StoreError> {
        let s = &self.inner.settings;
        let row = sqlx::query(&self.inner.sql.table_stats)
            .bind(&s.schema)
            .bind(&s.table)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(db)?;
        let mut extra = Vec::new();
        if let Some(row) = row {
            for name in [
                "total_bytes",
                "table_bytes",
                "index_bytes",
                "live_tuples",
                "dead_tuples",
                "autovacuum_age",
                "autoanalyze_age",
            ] {
                if let Some(v) = row.try_get::<Option<f64>, _>(name).map_err(db)? {
                    let key = match name {
                        "autovacuum_age" => "last_autovacuum_age_seconds",
                        "autoanalyze_age" => "last_autoanalyze_age_seconds",
                        other => other,
                    };
                    extra.push((key.to_owned(), v));
                }
            }
        }
        Ok(extra)
    }
}

/// The completion report: outcomes whose row was not updated were refused.
fn report(outcomes: &[Outcome], rows: &[(i64, Uuid, i64)], applied: &[i64]) -> CompletionReport {
    let applied_events: std::collections::HashSet<Uuid> = rows
        .iter()
        .filter(|(id, _, _)| applied.contains(id))
        .map(|&(_, e, _)| e)
        .collect();
    let refused = outcomes
        .iter()
        .map(Outcome::event_id)
        .filter(|e| !applied_events.contains(&e.as_uuid()))
        .collect();
    CompletionReport::new(applied.len(), refused)
}

fn lost_claim(e: StoreError) -> StoreError {
    if e.kind == StoreErrorKind::Connection {
        StoreError::new(
            StoreErrorKind::LeaseLost,
            format!("the locked claim transaction was lost: {}", e.message),
        )
        .with_source(e)
    } else {
        e
    }
}

fn not_found(event_id: EventId) -> StoreError {
    StoreError::new(
        StoreErrorKind::NotFound,
        format!("event {event_id} is not parked (or does not exist)"),
    )
}

/// Outcome columns for `UNNEST`, keyed by row id.
type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// Binds the lease parameters of a claim statement (`$2` owner, `$3` token, `$4` lease length
/// in µs); locked-mode statements take none.
fn lease_args<'q>(q: PgQuery<'q>, lease: Option<(&'q str, Uuid, i64)>) -> PgQuery<'q> {
    match lease {
        Some((owner, token, micros)) => q.bind(owner).bind(token).bind(micros),
        None => q,
    }
}

struct OutcomeArrays {
    ids: Vec<i64>,
    keys: Vec<i64>,
    kinds: Vec<&'static str>,
    topics: Vec<Option<String>>,
    parts: Vec<Option<i32>>,
    offsets: Vec<Option<i64>>,
    delays: Vec<Option<i64>>,
    eclass: Vec<Option<&'static str>>,
    ekind: Vec<Option<String>>,
    emsg: Vec<Option<String>>,
    pkind: Vec<Option<&'static str>>,
}

impl OutcomeArrays {
    /// The arrays for the outcomes of events in `claimed` (others are not part of the claim
    /// and are refused).
    fn new(outcomes: &[Outcome], claimed: &[(i64, Uuid, i64)]) -> Self {
        let n = outcomes.len();
        let by_event: HashMap<Uuid, (i64, i64)> =
            claimed.iter().map(|&(id, e, k)| (e, (id, k))).collect();
        let mut a = Self {
            ids: Vec::with_capacity(n),
            keys: Vec::with_capacity(n),
            kinds: Vec::with_capacity(n),
            topics: Vec::with_capacity(n),
            parts: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n),
            delays: Vec::with_capacity(n),
            eclass: Vec::with_capacity(n),
            ekind: Vec::with_capacity(n),
            emsg: Vec::with_capacity(n),
            pkind: Vec::with_capacity(n),
        };
        let mut seen = std::collections::HashSet::with_capacity(n);
        for o in outcomes {
            let Some(&(id, key)) = by_event.get(&o.event_id().as_uuid()) else {
                continue;
            };
            if !seen.insert(id) {
                continue;
            }
            a.ids.push(id);
            a.keys.push(key);
            let (kind, ack, delay, err, park) = match o {
                Outcome::Published { ack, .. } => ("published", Some(ack), None, None, None),
                Outcome::Retry { delay, error, .. } => {
                    ("retry", None, Some(*delay), Some(error), None)
                }
                Outcome::Defer { delay, error, .. } => {
                    ("defer", None, Some(*delay), Some(error), None)
                }
                Outcome::Park { reason, .. } => {
                    ("park", None, None, Some(&reason.error), Some(reason.kind))
                }
            };
            a.kinds.push(kind);
            a.topics.push(ack.map(|a| a.topic.clone()));
            a.parts.push(ack.map(|a| a.partition));
            a.offsets.push(ack.map(|a| a.offset));
            a.delays
                .push(delay.map(|d| d.as_micros().min(i64::MAX as u128) as i64));
            a.eclass.push(err.map(|e| e.class.as_str()));
            a.ekind.push(err.map(|e| e.kind.clone()));
            a.emsg.push(err.map(|e| e.message.clone()));
            a.pkind.push(park.map(ParkKind::as_str));
        }
        a
    }

    fn published_keys(&self) -> Vec<i64> {
        self.keys
            .iter()
            .zip(&self.kinds)
            .filter(|(_, k)| **k == "published")
            .map(|(id, _)| *id)
            .collect()
    }

    /// Every outcome is a publication: the completion can use its short form.
    fn all_published(&self) -> bool {
        self.kinds.iter().all(|k| *k == "published")
    }

    /// Binds the parameters of the completion's form for these outcomes, and returns it.
    fn statement<'q>(self, sql: &'q OutboxSql, lease: bool) -> PgQuery<'q> {
        if self.all_published() {
            let q = sqlx::query(if lease {
                &sql.complete_lease_published
            } else {
                &sql.complete_locked_published
            });
            q.bind(self.ids)
                .bind(self.topics)
                .bind(self.parts)
                .bind(self.offsets)
        } else {
            let q = sqlx::query(if lease {
                &sql.complete_lease
            } else {
                &sql.complete_locked
            });
            self.bind(q)
        }
    }

    fn bind<'q>(self, q: PgQuery<'q>) -> PgQuery<'q> {
        q.bind(self.ids)
            .bind(self.kinds)
            .bind(self.topics)
            .bind(self.parts)
            .bind(self.offsets)
            .bind(self.delays)
            .bind(self.eclass)
            .bind(self.ekind)
            .bind(self.emsg)
            .bind(self.pkind)
    }
}

/// Reads the envelope columns (see `sql::ENVELOPE_COLS`) of a row.
pub(crate) fn envelope_from_row(
    row: &PgRow,
    limits: &EnvelopeLimits,
) -> Result<Envelope, StoreError> {
    let event_id: Uuid = row.try_get("event_id").map_err(db)?;
    let headers: serde_json::Value = row.try_get("headers").map_err(db)?;
    let mut b = Envelope::builder(
        row.try_get::<String, _>("aggregate_type").map_err(db)?,
        row.try_get::<String, _>("aggregate_id").map_err(db)?,
        row.try_get::<i64, _>("aggregate_version").map_err(db)?,
        row.try_get::<String, _>("event_type").map_err(db)?,
    )
    .event_id(EventId::from_uuid(event_id))
    .schema_version(row.try_get("schema_version").map_err(db)?)
    .payload(Payload::new(
        row.try_get::<String, _>("content_type").map_err(db)?,
        row.try_get::<Vec<u8>, _>("payload").map_err(db)?,
    ))
    .created_at(row.try_get("created_at").map_err(db)?)
    .limits(limits.clone());
    if let serde_json::Value::Object(map) = headers {
        for (k, v) in map {
            if let serde_json::Value::String(v) = v {
                b = b.header(k, v);
            }
        }
    }
    b.build().map_err(|e| {
        StoreError::new(
            StoreErrorKind::Schema,
            format!("stored event {event_id} no longer passes validation: {e}"),
        )
        .with_source(e)
    })
}

#[async_trait]
impl OutboxStore for PostgresOutboxStore {
    type Tx = PgConnection;

    async fn append(&self, tx: &mut PgConnection, events: &[Envelope]) -> Result<(), StoreError> {
        self.append_many(&mut *tx, events).await
    }

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
        match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => {
                let taken = self
                    .inner
                    .locked
                    .lock()
                    .expect("poisoned")
                    .remove(&claim.token);
                if let Some(held) = taken {
                    if let Err(e) = held.tx.rollback().await {
                        // The connection is gone, and with it the locks.
                        warn!(error = %e, "rollback of a released claim failed");
                    }
                }
                Ok(())
            }
            _ => {
                let keys: Vec<i64> = self
                    .lease_rows(claim.token)
                    .await?
                    .into_iter()
                    .map(|(_, _, k)| k)
                    .collect();
                sqlx::query(&self.inner.sql.release_lease)
                    .bind(claim.token)
                    .bind(&keys)
                    .execute(&self.inner.pool)
                    .await
                    .map_err(db)?;
                Ok(())
            }
        }
    }

    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        let rows = sqlx::query(&self.inner.sql.list_parked)
            .bind(limit.min(i64::MAX as usize) as i64)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        let limits = &self.inner.settings.limits;
        rows.iter()
            .map(|row| {
                let envelope = envelope_from_row(row, limits)?;
                let attempts: i32 = row.try_get("attempts").map_err(db)?;
                let kind: Option<String> = row.try_get("park_kind").map_err(db)?;
                let class: Option<String> = row.try_get("last_error_class").map_err(db)?;
                let reason = ParkReason {
                    kind: kind
                        .as_deref()
                        .and_then(ParkKind::parse)
                        .unwrap_or(ParkKind::PermanentError),
                    error: LastError {
                        class: if class.as_deref() == Some("transient") {
                            ErrorClass::Transient
                        } else {
                            ErrorClass::Permanent
                        },
                        kind: row
                            .try_get::<Option<String>, _>("last_error_kind")
                            .map_err(db)?
                            .unwrap_or_default(),
                        message: row
                            .try_get::<Option<String>, _>("last_error_message")
                            .map_err(db)?
                            .unwrap_or_default(),
                    },
                };
                let parked_at: Option<DateTime<Utc>> = row.try_get("parked_at").map_err(db)?;
                Ok(ParkedEvent::new(
                    envelope,
                    attempts.max(0) as u32,
                    reason,
                    parked_at.unwrap_or_default(),
                ))
            })
            .collect()
    }

    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        let _ = event_id;
        Err(StoreError::new(
            StoreErrorKind::Other,
            "parked_event: not yet on PostgreSQL",
        ))
    }

    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        let _ = (owner, actor);
        Err(StoreError::new(
            StoreErrorKind::Other,
            "release_claims_of: not yet on PostgreSQL",
        ))
    }

    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        let (mut tx, _, _) = self.with_event_lock(event_id).await?;
        let done = sqlx::query(&self.inner.sql.retry_parked)
            .bind(event_id.as_uuid())
            .bind(actor)
            .bind("")
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
        if done.is_none() {
            return Err(not_found(event_id));
        }
        self.notify_after(&mut tx).await?;
        tx.commit().await.map_err(db)
    }

    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        if reason.trim().is_empty() {
            return Err(StoreError::new(
                StoreErrorKind::Validation,
                "discarding a parked event requires a reason",
            ));
        }
        let (mut tx, agg_type, agg_id) = self.with_event_lock(event_id).await?;
        let done = sqlx::query(&self.inner.sql.discard_parked)
            .bind(event_id.as_uuid())
            .bind(actor)
            .bind(reason)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
        if done.is_none() {
            return Err(not_found(event_id));
        }
        // A new statement: sees the discard, unblocks the aggregate's next row.
        sqlx::query(&self.inner.sql.promote_aggregate)
            .bind(&agg_type)
            .bind(&agg_id)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        self.notify_after(&mut tx).await?;
        tx.commit().await.map_err(db)
    }

    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        let (mut tx, _, _) = self.with_event_lock(event_id).await?;
        let new_id = EventId::now_v7();
        let n: i64 = sqlx::query_scalar(&self.inner.sql.reissue_parked)
            .bind(event_id.as_uuid())
            .bind(actor)
            .bind(reason)
            .bind(new_id.as_uuid())
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
        if n == 0 {
            return Err(not_found(event_id));
        }
        self.notify_after(&mut tx).await?;
        tx.commit().await.map_err(db)?;
        Ok(new_id)
    }

    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = sqlx::query(&self.inner.sql.audit_trail)
            .bind(event_id.map(|e| e.as_uuid()))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|row| {
                let action: String = row.try_get("action").map_err(db)?;
                Ok(AuditEntry::new(
                    EventId::from_uuid(row.try_get("event_id").map_err(db)?),
                    OperatorAction::parse(&action).ok_or_else(|| {
                        StoreError::new(StoreErrorKind::Schema, format!("unknown action {action}"))
                    })?,
                    row.try_get::<String, _>("actor").map_err(db)?,
                    row.try_get::<String, _>("reason").map_err(db)?,
                    row.try_get::<Option<Uuid>, _>("new_event_id")
                        .map_err(db)?
                        .map(EventId::from_uuid),
                    row.try_get("at").map_err(db)?,
                ))
            })
            .collect()
    }

    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        let batch = batch_size.clamp(1, 1_000_000) as i64;
        let retention_us = retention.as_micros().min(i64::MAX as u128) as i64;
        let mut removed = 0u64;
        let mut batches = 0u32;
        loop {
            let mut tx = self.inner.pool.begin().await.map_err(db)?;
            let row = sqlx::query(&self.inner.sql.cleanup)
                .bind(retention_us)
                .bind(batch)
                .bind(self.inner.settings.archive)
                .fetch_one(&mut *tx)
                .await
                .map_err(db)?;
            tx.commit().await.map_err(db)?;
            let n: i64 = row.try_get("removed").map_err(db)?;
            if n > 0 {
                batches += 1;
                removed += n as u64;
            }
            if n < batch {
                break;
            }
        }
        // Released leases of quiet aggregates, in bounded batches too.
        loop {
            let n = sqlx::query(&self.inner.sql.cleanup_leases)
                .bind(retention_us)
                .bind(batch)
                .execute(&self.inner.pool)
                .await
                .map_err(db)?
                .rows_affected();
            if n < batch as u64 {
                break;
            }
        }
        Ok(CleanupReport::new(removed, batches))
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let row = sqlx::query(&self.inner.sql.stats)
            .fetch_one(&self.inner.pool)
            .await
            .map_err(db)?;
        let get = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        let age = |name: &str| -> Result<Option<Duration>, StoreError> {
            Ok(row
                .try_get::<Option<f64>, _>(name)
                .map_err(db)?
                .map(|s| Duration::from_secs_f64(s.max(0.0))))
        };
        let locked_in_flight: u64 = self
            .inner
            .locked
            .lock()
            .expect("poisoned")
            .values()
            .map(|c| c.rows.len() as u64)
            .sum();
        let mut stats = OutboxStats::default();
        stats.unpublished = get("unpublished")?;
        stats.in_flight = get("leased")? + locked_in_flight;
        stats.parked = get("parked")?;
        stats.published_retained = get("published")?;
        // Every pending row counts: claimable, in flight, waiting for a retry, or blocked
        // behind its aggregate's parked head (as `OutboxStats` documents it).
        stats.oldest_unpublished_age = age("oldest_pending")?;
        stats.oldest_parked_age = age("oldest_parked")?;
        stats.extra = self.table_extra().await?;
        stats
            .extra
            .push(("blocked_rows".to_owned(), get("blocked")? as f64));
        Ok(stats)
    }

    fn claim_mode(&self) -> ClaimMode {
        self.inner.settings.claim_mode
    }
}
