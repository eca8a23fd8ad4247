//! Cleanup of finished rows and the monitoring snapshot.

use std::time::Duration;

use sqlx::Row;

use outbox_core::{CleanupReport, OutboxStats, StoreError};

use super::claim::micros;
use super::PostgresOutboxStore;
use crate::error::db;

/// How the stats and the latency report start their read-only transaction. No JIT: the
/// statements' cost estimates pass `jit_above_cost` with a large table, and compiling them
/// takes longer than running them (seconds against a few hundred ms at 200,000 pending
/// rows). No parallel workers: each read is short (index ranges), and starting workers cost
/// more than it saved (30-50 ms instead of 4-9 ms for a one-minute latency window on a
/// loaded 2-core machine; `outbox status` makes seven such reads).
pub(super) const REPORT_BEGIN: &str =
    "BEGIN READ ONLY; SET LOCAL jit = off; SET LOCAL max_parallel_workers_per_gather = 0";

impl PostgresOutboxStore {
    pub(super) async fn cleanup_inner(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        let batch = batch_size.clamp(1, 1_000_000) as i64;
        let retention_us = micros(retention);
        let mut removed = 0u64;
        let mut batches = 0u32;
        // One short transaction per batch. The per-aggregate state (last version) stays: it
        // is what keeps a late lower version from going out after a cleaned-up higher one.
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
        Ok(CleanupReport::new(removed, batches))
    }

    pub(super) async fn stats_inner(&self) -> Result<OutboxStats, StoreError> {
        let mut tx = self.inner.pool.begin_with(REPORT_BEGIN).await.map_err(db)?;
        let row = sqlx::query(&self.inner.sql.stats)
            .fetch_one(&mut *tx)
            .await
            .map_err(db);
        let row = super::claim::finish(tx, row).await?;
        let get = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        let age = |name: &str| -> Result<Option<Duration>, StoreError> {
            Ok(row
                .try_get::<Option<f64>, _>(name)
                .map_err(db)?
                .map(|s| Duration::from_secs_f64(s.max(0.0))))
        };
        let mut stats = OutboxStats::default();
        // Claim candidates and the rows queued behind a lower version: every pending row.
        let queued = get("queued")?;
        stats.unpublished = get("candidates")? + queued;
        // Lease mode: live leases (a run's rows included). Locked mode: aggregates whose lock
        // is held by some session with a due unblocked row (the claims of every relay, not
        // only this instance's), plus the rows after the head of this instance's own claims'
        // runs whose aggregate lock is still held: a held lock says nothing of how long a run
        // behind it is, so another instance's claimed run counts its head only.
        stats.in_flight = match self.inner.settings.claim_mode {
            outbox_core::ClaimMode::LockedTransaction => {
                get("leased")? + get("locked")? + self.own_locked_run_rows().await?
            }
            _ => get("leased")?,
        };
        stats.parked = get("parked")?;
        // Exact while the finished rows are no more than PUBLISHED_EXACT_UP_TO (else
        // `published_upto` is one more than that); above, the table's rows as the planner
        // estimates them (rows per page at the last vacuum or analyze, times the pages now)
        // less the unfinished ones: discarded rows and the estimate's error (dead rows not
        // vacuumed yet count as live) make it an estimate, reported as such in `extra`
        // ("published_retained_estimated" 1).
        let published = get("published_upto")?;
        let estimated = published > crate::sql::PUBLISHED_EXACT_UP_TO;
        stats.published_retained = if estimated {
            get("live_rows")?
                .saturating_sub(stats.unpublished + stats.parked)
                // At least the finished rows counted (the estimate counts the discarded
                // ones as published either way).
                .max(published)
        } else {
            published
        };
        stats.version_gaps_held = get("gaps_held")?;
        stats.blocked = get("blocked")?;
        stats.gap_held = get("gap_held")?;
        // Ages from the insertion (`inserted_at`, the database's clock), not `created_at`.
        stats.oldest_claimable_age = age("oldest_claimable")?;
        stats.oldest_blocked_age = age("oldest_blocked")?;
        stats.oldest_parked_age = age("oldest_parked")?;
        stats.extra = self.table_extra().await?;
        // Rows out of the candidate index because a lower unfinished version of their
        // aggregate comes first (in flight, retrying, parked or held): taken out by a claim,
        // or written so by an append that carried a lower version of the aggregate too.
        stats.extra.push(("queued_rows".to_owned(), queued as f64));
        stats.extra.push((
            "published_retained_estimated".to_owned(),
            if estimated { 1.0 } else { 0.0 },
        ));
        stats.extra.extend(self.admin_extra().await?);
        Ok(stats)
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
                "vacuum_age",
            ] {
                if let Some(v) = row.try_get::<Option<f64>, _>(name).map_err(db)? {
                    let key = match name {
                        "autovacuum_age" => "last_autovacuum_age_seconds",
                        "autoanalyze_age" => "last_autoanalyze_age_seconds",
                        "vacuum_age" => "last_vacuum_age_seconds",
                        other => other,
                    };
                    extra.push((key.to_owned(), v));
                }
            }
        }
        Ok(extra)
    }
}
