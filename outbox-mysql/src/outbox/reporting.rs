//! Reporting (the read-only reporting role): the monitoring snapshot.

use std::time::Duration;

use sqlx::Row;

use outbox_core::{ClaimMode, OutboxStats, StoreError};

use super::tx::begin;
use super::MySqlOutboxStore;
use crate::error::db;

/// How many of the oldest due candidates the locked-mode in-flight probe looks at.
const IN_FLIGHT_PROBE: i64 = 10_000;

impl MySqlOutboxStore {
    /// The monitoring snapshot.
    ///
    /// Ages are measured on the database clock from each row's insertion time (`inserted_at`,
    /// written by the server at append), never from the producer's `created_at`. The oldest
    /// unpublished age covers the rows that are claimable or in flight; rows held as version
    /// gaps and rows blocked behind a parked event of their aggregate are reported apart in
    /// `extra` (`oldest_gap_held_age_seconds`, `oldest_blocked_by_parked_age_seconds`,
    /// `blocked_by_parked_rows`), so that a parked head or a missing version does not read as
    /// a stalled relay.
    pub(super) async fn stats_inner(&self) -> Result<OutboxStats, StoreError> {
        let t = &self.inner.tables;
        // Each pending row falls in one class:
        //   gap       the head of its aggregate, held for a missing version
        //   parked    behind a parked event of its aggregate (above its last version)
        //   flowing   everything else: claimable, in flight, waiting for a retry, or queued
        //             behind a head that is itself flowing
        let classes = format!(
            "SELECT CASE \
               WHEN e.held_since IS NOT NULL \
                    AND e.aggregate_version > COALESCE(a.last_version, 0) + 1 THEN 'gap' \
               WHEN EXISTS (SELECT 1 FROM {ev} p \
                            WHERE p.aggregate_key = e.aggregate_key AND p.status = 'parked' \
                              AND p.aggregate_version > COALESCE(a.last_version, 0) \
                              AND (p.aggregate_version < e.aggregate_version \
                                   OR (p.aggregate_version = e.aggregate_version \
                                       AND p.id < e.id))) THEN 'parked' \
               ELSE 'flowing' END AS class, \
               e.inserted_at \
             FROM {ev} e LEFT JOIN {st} a ON a.aggregate_key = e.aggregate_key \
             WHERE e.status = 'pending'",
            ev = t.events,
            st = t.state
        );
        let sql = format!(
            "SELECT \
               (SELECT COUNT(*) FROM {ev} WHERE status = 'pending') AS unpublished, \
               (SELECT COUNT(*) FROM {ev} WHERE status = 'parked') AS parked, \
               (SELECT COUNT(*) FROM {ev} WHERE status = 'published') AS published, \
               (SELECT COUNT(*) FROM {ev} WHERE status = 'pending' AND blocked = 1) AS blocked, \
               (SELECT COUNT(*) FROM {st} WHERE lease_until > UTC_TIMESTAMP(6) \
                  AND lease_row IS NOT NULL) AS leased, \
               (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(parked_at), UTC_TIMESTAMP(6)) \
                  FROM {ev} WHERE status = 'parked') AS oldest_parked_us",
            ev = t.events,
            st = t.state
        );
        let row = sqlx::query(&sql)
            .fetch_one(&self.inner.pool)
            .await
            .map_err(db)?;
        let get = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        let age = |name: &str| -> Result<Option<Duration>, StoreError> {
            Ok(row
                .try_get::<Option<i64>, _>(name)
                .map_err(db)?
                .map(|us| Duration::from_micros(us.max(0) as u64)))
        };
        let by_class = sqlx::query(&format!(
            "SELECT c.class, COUNT(*) AS n, \
                    TIMESTAMPDIFF(MICROSECOND, MIN(c.inserted_at), UTC_TIMESTAMP(6)) AS age_us \
             FROM ({classes}) c GROUP BY c.class"
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        let mut class = std::collections::HashMap::new();
        for r in &by_class {
            let name: String = crate::error::text(r, "class")?;
            let n: i64 = r.try_get("n").map_err(db)?;
            let us: Option<i64> = r.try_get("age_us").map_err(db)?;
            class.insert(
                name,
                (
                    n.max(0) as u64,
                    us.map(|us| Duration::from_micros(us.max(0) as u64)),
                ),
            );
        }
        let class_of = |name: &str| class.get(name).copied().unwrap_or((0, None));
        let mut stats = OutboxStats::default();
        stats.unpublished = get("unpublished")?;
        stats.in_flight = match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => self.locked_in_flight().await?,
            _ => get("leased")?,
        };
        stats.parked = get("parked")?;
        stats.published_retained = get("published")?;
        stats.version_gaps_held = class_of("gap").0;
        (stats.gap_held, _) = class_of("gap");
        (stats.blocked, stats.oldest_blocked_age) = class_of("parked");
        stats.oldest_claimable_age = class_of("flowing").1;
        stats.oldest_parked_age = age("oldest_parked_us")?;
        let mut extra = vec![("queued_rows".to_owned(), get("blocked")? as f64)];
        if let Some(a) = class_of("gap").1 {
            extra.push(("oldest_gap_held_age_seconds".to_owned(), a.as_secs_f64()));
        }
        extra.extend(self.table_extra().await?);
        stats.extra = extra;
        Ok(stats)
    }

    /// Locked mode: the claims of every relay are row locks, which no view of the server
    /// lists on both MySQL and MariaDB. The probe locks the oldest due candidates with
    /// `SKIP LOCKED` in a transaction it rolls back at once and counts those it could not
    /// lock: rows other transactions hold (the claims; a claim deciding at that instant
    /// counts too). Bounded to the oldest [`IN_FLIGHT_PROBE`] candidates.
    async fn locked_in_flight(&self) -> Result<u64, StoreError> {
        let t = &self.inner.tables;
        let mut tx = begin(&self.inner.pool).await?;
        let counted = async {
            let all: i64 = sqlx::query_scalar(&format!(
                "SELECT COUNT(*) FROM (SELECT id FROM {} \
                   WHERE status = 'pending' AND blocked = 0 \
                     AND next_attempt_at <= UTC_TIMESTAMP(6) ORDER BY id LIMIT ?) x",
                t.events
            ))
            .bind(IN_FLIGHT_PROBE)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
            let free: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT id FROM {} WHERE status = 'pending' AND blocked = 0 \
                   AND next_attempt_at <= UTC_TIMESTAMP(6) \
                 ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
                t.events
            ))
            .bind(IN_FLIGHT_PROBE)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
            Ok::<u64, StoreError>((all - free.len() as i64).max(0) as u64)
        }
        .await;
        let _ = tx.rollback().await;
        counted
    }

    async fn table_extra(&self) -> Result<Vec<(String, f64)>, StoreError> {
        let s = &self.inner.settings;
        let row = sqlx::query(
            "SELECT CAST(DATA_LENGTH AS DOUBLE) AS table_bytes, \
                    CAST(INDEX_LENGTH AS DOUBLE) AS index_bytes, \
                    CAST(DATA_FREE AS DOUBLE) AS free_bytes, \
                    CAST(TABLE_ROWS AS DOUBLE) AS estimated_rows \
             FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
        )
        .bind(s.database.as_deref())
        .bind(&s.table)
        .fetch_optional(&self.inner.pool)
        .await
        .map_err(db)?;
        let mut extra = Vec::new();
        if let Some(row) = row {
            for name in ["table_bytes", "index_bytes", "free_bytes", "estimated_rows"] {
                if let Some(v) = row.try_get::<Option<f64>, _>(name).map_err(db)? {
                    extra.push((name.to_owned(), v));
                }
            }
        }
        Ok(extra)
    }
}
