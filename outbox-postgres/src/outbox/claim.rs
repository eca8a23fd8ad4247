//! Claims: candidates and their aggregate locks (step 1), then the decision in a snapshot taken
//! after the locks (step 2). See `docs/claims.md`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{Postgres, Row, Transaction};
use tracing::warn;
use uuid::Uuid;

use outbox_core::{
    ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, ClaimedRecord, EventId, ParkKind,
    ParkedAtClaim, StoreError,
};

use super::rows::envelope_from_row;
use super::PostgresOutboxStore;
use crate::error::db;
use crate::sql::OutboxSql;

/// Transactions of claims, completions and operator actions: custom plans (the statements take
/// id arrays whose size a generic plan cannot know) and no JIT compilation (their cost
/// estimates can pass `jit_above_cost`, and compiling takes longer than running them), set in
/// the same round trip as BEGIN.
///
/// Custom plans are planned again for every call, for the tables' current size: about 2 ms of
/// server time per claim on a two-core machine, half of a small batch's claim. Generic plans
/// (planned once per session, kept until the server invalidates them) halved the claim in a
/// quiet benchmark (BENCHMARKS.md, "Generic plans for the claim, stop 42") but are not used:
/// a generic plan made while a table was small is still the plan once it is large, and there
/// the completions compared every outcome with every pending row (a lease completion of 100:
/// 2,000,000 rows on 20,000; a locked one of 1,000: 18,600,000), and the decision's `promote`
/// hash-joined a scan of the whole table. `tests/adversary_generic_plans.rs` holds those
/// shapes.
///
/// The isolation level is set explicitly: every decision is taken by a statement whose snapshot
/// postdates the aggregate locks, which holds only under READ COMMITTED (a new snapshot per
/// statement), whatever the role's or database's default.
pub(super) const BEGIN_CLAIM: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; \
     SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off";

/// A claim's candidate scan must walk the claim index in id order and stop at its limit: its
/// filter try-locks aggregates, so a plan that filters every pending row and sorts afterwards
/// (a bitmap scan, chosen when the row estimate is stale after a burst of appends) would lock
/// the whole backlog. Sorting and bitmap scans are ruled out for the claim's transaction.
const ORDERED_SCAN: &str = "SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off";

/// Lease claims and operator actions wait for the WAL flush at commit whatever the role's or
/// database's default: a lease or an operator decision lost in a server crash could let a
/// second relay publish while the first one still does.
pub(super) const SYNC_COMMIT: &str = "SET LOCAL synchronous_commit = on";

/// Completions commit without waiting for the WAL flush (see the crate docs, "Durability of
/// completions"): a completion lost in a server crash leaves its rows unpublished, so they are
/// published again, a duplicate and never a loss or a reordering.
pub(super) const ASYNC_COMMIT: &str = "SET LOCAL synchronous_commit = off";

/// Longest time a version-gap head waits before it is checked again.
const GAP_RECHECK: Duration = Duration::from_secs(1);

/// One claimed row, carried from the claim to its completion, so the completion needs no
/// lookups (row id, event id, aggregate key, type, id and version).
#[derive(Clone, Debug)]
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) event: Uuid,
    pub(crate) key: i64,
    pub(crate) agg_type: String,
    pub(crate) agg_id: String,
    pub(crate) version: i64,
    /// Its place in its aggregate's run: 0 for the head (`ClaimedRecord::run_position`).
    pub(crate) run_position: u32,
}

/// A claim of [`ClaimMode::LockedTransaction`]: its transaction holds the aggregate locks.
pub(crate) struct LockedClaim {
    pub(crate) tx: Transaction<'static, Postgres>,
    pub(crate) rows: Vec<ClaimedRow>,
    pub(crate) since: Instant,
}

/// Commits `tx` after `result` succeeded, else rolls it back at once: a transaction that is
/// merely dropped is rolled back only when its pooled connection is used again, and until then
/// it keeps holding the aggregate locks it took.
pub(super) async fn finish<T>(
    tx: Transaction<'static, Postgres>,
    result: Result<T, StoreError>,
) -> Result<T, StoreError> {
    match result {
        Ok(v) => {
            tx.commit().await.map_err(db)?;
            Ok(v)
        }
        Err(e) => abort(tx, e).await,
    }
}

/// Rolls `tx` back now and returns `e`.
pub(super) async fn abort<T>(
    tx: Transaction<'static, Postgres>,
    e: StoreError,
) -> Result<T, StoreError> {
    if let Err(rollback) = tx.rollback().await {
        warn!(error = %rollback, "rollback after a failed store operation failed; the connection is dropped");
    }
    Err(e)
}

pub(super) fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

impl PostgresOutboxStore {
    /// The advisory lock key of aggregate key `k` (per-table seed, so tables never share).
    pub(super) fn lock_key(&self, k: i64) -> i64 {
        k ^ self.inner.seed
    }

    /// A claim's transaction: READ COMMITTED, custom plans, no JIT, the candidate scan in
    /// order; lease claims commit synchronously; a locked claim's transaction (ended by its
    /// completion) gets the server-side hold limit.
    ///
    /// Before it reads a table, the claim takes the migration key shared (same round trip):
    /// it waits for a migration of this table in progress, holding nothing the migration
    /// needs, and never runs on the schema the migration is replacing.
    async fn begin_claim(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        let settings = &self.inner.settings;
        let after_migrations = format!(
            "SELECT pg_advisory_xact_lock_shared({})",
            crate::schema::migration_lock_key(self.inner.seed)
        );
        if settings.claim_mode == ClaimMode::LockedTransaction {
            let ms = settings.locked_max_hold.as_millis().max(1);
            // A SET cannot take bind parameters; the value is an integer we formatted. The
            // claim's transaction ends with its completion: asynchronous unless configured.
            self.inner
                .pool
                .begin_with(format!(
                    "{BEGIN_CLAIM}; {ORDERED_SCAN}; \
                     SET LOCAL idle_in_transaction_session_timeout = {ms}; {}; {after_migrations}",
                    if settings.synchronous_completion {
                        SYNC_COMMIT
                    } else {
                        ASYNC_COMMIT
                    }
                ))
                .await
        } else {
            self.inner
                .pool
                .begin_with(format!(
                    "{BEGIN_CLAIM}; {ORDERED_SCAN}; {SYNC_COMMIT}; {after_migrations}"
                ))
                .await
        }
        .map_err(db)
    }

    pub(super) async fn claim_inner(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimedBatch, StoreError> {
        let token = Uuid::now_v7();
        let handle = ClaimHandle {
            token,
            owner: request.owner.clone(),
        };
        if request.limit == 0 {
            return Ok(ClaimedBatch::new(handle, Vec::new(), None));
        }
        let mode = self.inner.settings.claim_mode;
        let limit = request.limit.min(100_000) as i64;
        self.sweep_locked_claims();
        let mut tx = self.begin_claim().await?;
        // Step 1: candidates whose aggregates this transaction could lock.
        let ids = sqlx::query_scalar::<_, i64>(&self.inner.sql.claim_candidates)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .map_err(db);
        let ids = match ids {
            Ok(ids) if ids.is_empty() => {
                tx.commit().await.map_err(db)?;
                return Ok(ClaimedBatch::new(handle, Vec::new(), None));
            }
            Ok(ids) => ids,
            Err(e) => return abort(tx, e).await,
        };
        // Step 2: the decision, in a snapshot taken after the locks.
        let decided = self.decide(&mut tx, &ids, request, token).await;
        let mut decided = match decided {
            Ok(d) => d,
            Err(e) => return abort(tx, e).await,
        };
        let mut parked = std::mem::take(&mut decided.parked);
        // Locked mode: what the decision parked would roll back with the claim if it ended
        // without a completion (a relay that dies, a release), after the claim had reported it
        // parked. Parks commit on their own, then the claimed aggregates are locked and
        // decided again (rarely more than once).
        let mut rounds = 0;
        // Each decision's holds commit (as its parks do): the batch reports them all.
        let mut gaps_held = 0;
        while mode == ClaimMode::LockedTransaction
            && !decided.claimed.is_empty()
            && (!parked.is_empty() && rounds == 0 || !decided.parked.is_empty())
            && rounds < 3
        {
            rounds += 1;
            parked.append(&mut decided.parked);
            gaps_held += decided.gaps_held;
            tx.commit().await.map_err(db)?;
            tx = self.begin_claim().await?;
            let again = self
                .relock_and_decide(&mut tx, &decided, request, token)
                .await;
            decided = match again {
                Ok(d) => d,
                Err(e) => return abort(tx, e).await,
            };
        }
        parked.append(&mut decided.parked);
        // Locked mode: the expired leases of the heads handed out are cleared in the
        // transaction the claim keeps (see `unlease_locked` in sql.rs): a claim that ends
        // without completion gives them back.
        let unlease: Vec<&ClaimedRow> = decided
            .claimed
            .iter()
            .map(|(r, _)| r)
            .filter(|r| r.run_position == 0 && decided.lease_left.contains(&r.id))
            .collect();
        if mode == ClaimMode::LockedTransaction && !unlease.is_empty() {
            let done = sqlx::query(&self.inner.sql.unlease_locked)
                .bind(unlease.iter().map(|r| r.key).collect::<Vec<i64>>())
                .bind(
                    unlease
                        .iter()
                        .map(|r| r.agg_type.as_str())
                        .collect::<Vec<&str>>(),
                )
                .bind(
                    unlease
                        .iter()
                        .map(|r| r.agg_id.as_str())
                        .collect::<Vec<&str>>(),
                )
                .execute(&mut *tx)
                .await
                .map_err(db);
            if let Err(e) = done {
                return abort(tx, e).await;
            }
        }
        let batch_rows: Vec<ClaimedRow> = decided.claimed.iter().map(|(r, _)| r.clone()).collect();
        let records: Vec<ClaimedRecord> = decided.claimed.into_iter().map(|(_, r)| r).collect();
        let remaining = decided
            .remaining_us
            .map(|us| Duration::from_micros(us.max(0) as u64));
        match mode {
            ClaimMode::LockedTransaction if !records.is_empty() => {
                self.inner.locked.lock().expect("poisoned").insert(
                    token,
                    LockedClaim {
                        tx,
                        rows: batch_rows,
                        since: Instant::now(),
                    },
                );
            }
            _ => {
                tx.commit().await.map_err(db)?;
                if let ClaimMode::Lease { duration } = mode {
                    if !batch_rows.is_empty() {
                        let mut leased = self.inner.leased.lock().expect("poisoned");
                        // Forget claims that were never completed (crashed relay tasks).
                        let horizon = duration * 2 + Duration::from_secs(60);
                        leased.retain(|_, (_, at)| at.elapsed() < horizon);
                        leased.insert(token, (batch_rows, Instant::now()));
                    }
                }
            }
        }
        Ok(ClaimedBatch::new(handle, records, remaining)
            .with_version_notices(parked, gaps_held + decided.gaps_held))
    }

    /// Claim step 2 on `ids` (whose aggregates this transaction holds), including the parking
    /// of claimed rows that no longer decode.
    async fn decide(
        &self,
        tx: &mut sqlx::PgConnection,
        ids: &[i64],
        request: &ClaimRequest,
        token: Uuid,
    ) -> Result<Decided, StoreError> {
        let settings = &self.inner.settings;
        let sql = &self.inner.sql;
        let gap_us = micros(settings.gap_timeout);
        let recheck_us = micros(settings.gap_timeout.min(GAP_RECHECK));
        // A run counts against the limit, so it is never longer than the claim.
        let limit = request.limit.min(100_000) as i64;
        let run = (request.run_len() as i64).min(limit);
        let statement = decision_sql(sql, settings.claim_mode, run);
        let rows = bind_decision(
            sqlx::query(statement),
            settings.claim_mode,
            ids,
            &request.owner,
            token,
            (gap_us, recheck_us),
            (run, limit),
        )
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let decided = self.decided(&rows)?;
        if !decided.undecodable.is_empty() {
            let ids: Vec<i64> = decided.undecodable.iter().map(|u| u.0).collect();
            let keys: Vec<i64> = decided.undecodable.iter().map(|u| u.1).collect();
            let why: Vec<String> = decided.undecodable.iter().map(|u| u.2.clone()).collect();
            sqlx::query(&sql.park_undecodable)
                .bind(&ids)
                .bind(&why)
                .bind(token)
                .bind(&keys)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        Ok(decided)
    }

    /// Locked mode, after the parks of a claim were committed: try-locks the aggregates of the
    /// rows it had claimed again and decides on those that could be locked.
    async fn relock_and_decide(
        &self,
        tx: &mut sqlx::PgConnection,
        previous: &Decided,
        request: &ClaimRequest,
        token: Uuid,
    ) -> Result<Decided, StoreError> {
        // Heads only: their runs are decided again with them.
        let heads: Vec<&ClaimedRow> = previous
            .claimed
            .iter()
            .map(|(r, _)| r)
            .filter(|r| r.run_position == 0)
            .collect();
        let keys: Vec<i64> = heads.iter().map(|r| self.lock_key(r.key)).collect();
        let locked: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_try_advisory_xact_lock(u.k) FROM UNNEST($1::int8[]) WITH ORDINALITY \
             AS u(k, n) ORDER BY u.n",
        )
        .bind(&keys)
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let ids: Vec<i64> = heads
            .iter()
            .zip(&locked)
            .filter(|(_, ok)| **ok)
            .map(|(r, _)| r.id)
            .collect();
        if ids.is_empty() {
            return Ok(Decided::default());
        }
        self.decide(tx, &ids, request, token).await
    }

    /// Reads the rows of claim step 2: claimed records (heads oldest first, each followed by
    /// its run in version order), parked notices, gaps.
    fn decided(&self, rows: &[PgRow]) -> Result<Decided, StoreError> {
        let mut out = Decided::default();
        // (head row id, run position, row, record); `None` for a row that failed to decode.
        let mut claimed: Vec<(i64, u32, Option<Claimed>)> = Vec::with_capacity(rows.len());
        // The heads claimed: a lease claim's run rows carry no `claimed` of their own (NULL)
        // and go with their head. Joining them to the lease writes in SQL was a nested loop
        // over two CTE scans (heads x run rows: 172,159 rows compared for a claim of 1,000 in
        // runs of 50, `tests/adversary_generic_plans.rs`).
        let mut heads: HashSet<i64> = HashSet::new();
        for row in rows {
            if row.try_get::<String, _>("action").map_err(db)? == "claim"
                && row.try_get::<Option<bool>, _>("claimed").map_err(db)? == Some(true)
            {
                heads.insert(row.try_get("id").map_err(db)?);
            }
        }
        for row in rows {
            let action: String = row.try_get("action").map_err(db)?;
            let id: i64 = row.try_get("id").map_err(db)?;
            match action.as_str() {
                "claim" | "run" => {
                    let head: i64 = row.try_get("head").map_err(db)?;
                    let won = match row.try_get::<Option<bool>, _>("claimed").map_err(db)? {
                        Some(won) => won,
                        None => heads.contains(&head),
                    };
                    if !won {
                        // A live lease won (a colliding key or a relay of the other mode),
                        // for the head and so for its run.
                        continue;
                    }
                    let position = u32::try_from(row.try_get::<i64, _>("pos").map_err(db)?)
                        .unwrap_or(u32::MAX);
                    let envelope = match envelope_from_row(row) {
                        Ok(e) => e,
                        Err(e) => {
                            // A stored row that no longer decodes is parked, alone: it must
                            // not stop the claims of every other aggregate. A run ends before
                            // it (below).
                            out.undecodable.push((
                                id,
                                row.try_get("k").map_err(db)?,
                                e.message.clone(),
                            ));
                            out.parked.push(ParkedAtClaim::new(
                                EventId::from_uuid(row.try_get("event_id").map_err(db)?),
                                row.try_get::<String, _>("aggregate_type").map_err(db)?,
                                row.try_get::<String, _>("aggregate_id").map_err(db)?,
                                row.try_get::<i64, _>("aggregate_version").map_err(db)?,
                                ParkKind::PermanentError,
                            ));
                            claimed.push((head, position, None));
                            continue;
                        }
                    };
                    if position == 0
                        && self.inner.settings.claim_mode == ClaimMode::LockedTransaction
                        && row.try_get::<Option<bool>, _>("lease_left").map_err(db)? == Some(true)
                    {
                        out.lease_left.insert(id);
                    }
                    let attempts: i32 = row.try_get("attempts").map_err(db)?;
                    if let Some(r) = row.try_get::<Option<i64>, _>("remaining_us").map_err(db)? {
                        out.remaining_us = Some(out.remaining_us.map_or(r, |m| m.min(r)));
                    }
                    let claimed_row = ClaimedRow {
                        id,
                        event: envelope.event_id.as_uuid(),
                        key: row.try_get("k").map_err(db)?,
                        agg_type: envelope.aggregate_type.clone(),
                        agg_id: envelope.aggregate_id.clone(),
                        version: envelope.aggregate_version,
                        run_position: position,
                    };
                    claimed.push((
                        head,
                        position,
                        // Possibly sent before: the aggregate's lease still names this row or
                        // its run covers it (an earlier claim ended without outcome or release:
                        // a crash, a lost completion, an expired lease), or an earlier failure
                        // left delivery uncertain (`maybe_delivered`).
                        Some((
                            claimed_row,
                            ClaimedRecord::new(envelope, attempts.max(0) as u32)
                                .with_maybe_sent_before(row.try_get("resend").map_err(db)?)
                                .with_run_position(position),
                        )),
                    ));
                }
                "stale" | "gap_park" | "bad_key" => {
                    let kind = match action.as_str() {
                        "stale" => ParkKind::OutOfOrder,
                        "gap_park" => ParkKind::VersionGap,
                        _ => ParkKind::PermanentError,
                    };
                    out.parked.push(ParkedAtClaim::new(
                        EventId::from_uuid(row.try_get("event_id").map_err(db)?),
                        row.try_get::<String, _>("aggregate_type").map_err(db)?,
                        row.try_get::<String, _>("aggregate_id").map_err(db)?,
                        row.try_get::<i64, _>("aggregate_version").map_err(db)?,
                        kind,
                    ));
                }
                "gap_hold" => out.gaps_held += 1,
                other => warn!(action = other, "unexpected claim action"),
            }
        }
        // Heads oldest first, each followed by its run in order (the result order of the
        // statement is not guaranteed).
        claimed.sort_unstable_by_key(|(head, position, _)| (*head, *position));
        // A run is handed out up to its first row that failed to decode (parked above); a head
        // that failed to decode takes its run with it (its lease is released by the park).
        let mut cut: Option<i64> = None;
        let mut last: Option<(i64, u32)> = None;
        for (head, position, entry) in claimed {
            if cut == Some(head) {
                continue;
            }
            let follows = position == 0 || last == Some((head, position - 1));
            match entry {
                Some(e) if follows => {
                    out.claimed.push(e);
                    last = Some((head, position));
                }
                _ => cut = Some(head),
            }
        }
        Ok(out)
    }

    /// Drops locked claims held longer than the server allows (`locked_max_hold`: the server
    /// has ended their transactions), so a relay that never completes nor releases a claim
    /// does not leak its connection here.
    fn sweep_locked_claims(&self) {
        if self.inner.settings.claim_mode != ClaimMode::LockedTransaction {
            return;
        }
        let hold = self.inner.settings.locked_max_hold;
        let expired: Vec<LockedClaim> = {
            let mut locked = self.inner.locked.lock().expect("poisoned");
            let tokens: Vec<Uuid> = locked
                .iter()
                .filter(|(_, c)| c.since.elapsed() > hold)
                .map(|(t, _)| *t)
                .collect();
            tokens.iter().filter_map(|t| locked.remove(t)).collect()
        };
        if !expired.is_empty() {
            warn!(
                claims = expired.len(),
                "dropping locked claims that were neither completed nor released within locked_max_hold"
            );
        }
        // Dropping a transaction rolls it back on its connection (or the connection is gone).
        drop(expired);
    }

    /// Rows after the head in the runs of this instance's locked claims (pending until their
    /// completion commits), after dropping the claims the server has ended by
    /// `locked_max_hold`; a claim whose transaction ended otherwise (its connection killed)
    /// counts only while its aggregate's lock is still held, which the server lists.
    pub(super) async fn own_locked_run_rows(&self) -> Result<u64, StoreError> {
        self.sweep_locked_claims();
        // Each row once: a claim whose transaction the server ended stays listed until the
        // sweep, and a later claim of this instance may hold the same rows again.
        let keys: Vec<i64> = {
            let locked = self.inner.locked.lock().expect("poisoned");
            let rows: std::collections::HashMap<i64, i64> = locked
                .values()
                .flat_map(|c| c.rows.iter().filter(|r| r.run_position > 0))
                .map(|r| (r.id, self.lock_key(r.key)))
                .collect();
            rows.into_values().collect()
        };
        if keys.is_empty() {
            return Ok(0);
        }
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM UNNEST($1::int8[]) AS u(k) \
             WHERE u.k IN (SELECT (l.classid::int8 << 32) | l.objid::int8 FROM pg_locks l \
                           WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
                             AND l.database = (SELECT oid FROM pg_database \
                                               WHERE datname = current_database()))",
        )
        .bind(&keys)
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(held.max(0) as u64)
    }

    /// Number of locked claims held by this store instance (not completed or released).
    #[doc(hidden)]
    pub fn open_locked_claims(&self) -> usize {
        self.inner.locked.lock().expect("poisoned").len()
    }

    /// Runs both claim statements under `EXPLAIN (ANALYZE, BUFFERS)` in a transaction that is
    /// rolled back (nothing is claimed), and returns the two plans: step 1 (candidates and
    /// locks) and step 2 (the decision, with every candidate of step 1; heads only, no runs). For capacity checks:
    /// the claim should read a number of buffers that depends on `limit`, not on the backlog.
    pub async fn explain_claim(&self, limit: usize) -> Result<Vec<String>, StoreError> {
        self.explain_claim_run(limit, 1).await
    }

    /// [`explain_claim`](Self::explain_claim) of a claim that asks for runs of up to `run`
    /// events per aggregate.
    pub async fn explain_claim_run(
        &self,
        limit: usize,
        run: usize,
    ) -> Result<Vec<String>, StoreError> {
        let limit = limit.clamp(1, 100_000) as i64;
        let run = (run.clamp(1, outbox_core::MAX_RUN) as i64).min(limit);
        let mut tx = self
            .inner
            .pool
            .begin_with(format!("{BEGIN_CLAIM}; {ORDERED_SCAN}"))
            .await
            .map_err(db)?;
        let sql = &self.inner.sql;
        let plan = |rows: Vec<PgRow>| -> Result<String, StoreError> {
            let lines: Vec<String> = rows
                .iter()
                .map(|r| r.try_get(0))
                .collect::<Result<_, _>>()
                .map_err(db)?;
            Ok(lines.join("\n"))
        };
        let ids: Vec<i64> = sqlx::query_scalar(&sql.claim_candidates)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
        let first = sqlx::query(&format!(
            "EXPLAIN (ANALYZE, BUFFERS) {}",
            sql.claim_candidates
        ))
        .bind(limit)
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let gap_us = micros(self.inner.settings.gap_timeout);
        let mode = self.inner.settings.claim_mode;
        let second_sql = format!(
            "EXPLAIN (ANALYZE, BUFFERS) {}",
            decision_sql(sql, mode, run)
        );
        let second = bind_decision(
            sqlx::query(&second_sql),
            mode,
            &ids,
            "explain",
            Uuid::now_v7(),
            (gap_us, gap_us),
            (run, limit),
        )
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let (first, second) = (plan(first)?, plan(second)?);
        tx.rollback().await.map_err(db)?;
        Ok(vec![first, second])
    }

    /// Test support: ends a locked claim as a crash would (its transaction is rolled back,
    /// so its aggregate locks go), without the relay calling `complete` or `release`.
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
}

/// Claim step 2's statement for `mode`: heads only when `run` is 1 (the default), else with
/// the run CTEs (`crate::sql`).
fn decision_sql(sql: &OutboxSql, mode: ClaimMode, run: i64) -> &str {
    match (mode, run > 1) {
        (ClaimMode::Lease { .. }, false) => &sql.claim_decide_lease,
        (ClaimMode::Lease { .. }, true) => &sql.claim_decide_lease_runs,
        (_, false) => &sql.claim_decide_locked,
        (_, true) => &sql.claim_decide_locked_runs,
    }
}

/// Binds [`decision_sql`]'s parameters: the run length and the limit only for the statements
/// with runs.
fn bind_decision<'q>(
    query: Query<'q, Postgres, PgArguments>,
    mode: ClaimMode,
    ids: &'q [i64],
    owner: &'q str,
    token: Uuid,
    (gap_us, recheck_us): (i64, i64),
    (run, limit): (i64, i64),
) -> Query<'q, Postgres, PgArguments> {
    let query = query.bind(ids);
    let query = match mode {
        ClaimMode::Lease { duration } => query
            .bind(owner)
            .bind(token)
            .bind(micros(duration))
            .bind(gap_us)
            .bind(recheck_us),
        _ => query.bind(gap_us).bind(recheck_us),
    };
    if run > 1 {
        query.bind(run).bind(limit)
    } else {
        query
    }
}

/// A claimed row and the record handed out for it.
type Claimed = (ClaimedRow, ClaimedRecord);

#[derive(Default)]
struct Decided {
    claimed: Vec<(ClaimedRow, ClaimedRecord)>,
    /// Claimed rows that failed to decode: (row id, aggregate key, why).
    undecodable: Vec<(i64, i64, String)>,
    remaining_us: Option<i64>,
    parked: Vec<ParkedAtClaim>,
    gaps_held: usize,
    /// Locked mode: claimed heads whose aggregate carries an expired lease, which the claim
    /// takes over (`unlease_locked`).
    lease_left: HashSet<i64>,
}
