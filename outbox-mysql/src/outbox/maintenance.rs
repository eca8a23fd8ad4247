//! Maintenance and reporting: cleanup of finished rows in bounded batches, and the monitoring
//! snapshot.

use std::time::Duration;

use sqlx::Row;

use outbox_core::{ClaimMode, CleanupReport, OutboxStats, StoreError};

use super::head::marks;
use super::tx::{self, begin, finish, micros};
use super::MySqlOutboxStore;
use crate::error::db;

/// Columns copied into the archive (the table's, without the generated key expression).
const ARCHIVE_COLS: &str = "id, event_id, aggregate_type, aggregate_id, aggregate_key, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at, \
    status, attempts, maybe_delivered, last_error_class, last_error_kind, last_error_message, \
    published_at, ack_topic, ack_partition, ack_offset, discard_reason, finished_at, inserted_at";

/// How many of the oldest due candidates the locked-mode in-flight probe looks at.
const IN_FLIGHT_PROBE: i64 = 10_000;

impl MySqlOutboxStore {
    pub(super) async fn cleanup_inner(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        let batch = batch_size.clamp(1, 100_000) as i64;
        let retention_us = micros(retention);
        let mut removed = 0u64;
        let mut batches = 0u32;
        // One short transaction per batch. The per-aggregate state (last version) stays: it is
        // what keeps a late lower version from going out after a cleaned-up higher one.
        loop {
            let n = tx::retry_lock_conflicts!(self.cleanup_once(retention_us, batch).await)?;
            if n > 0 {
                batches += 1;
                removed += n;
            }
            if n < batch as u64 {
                break;
            }
        }
        Ok(CleanupReport::new(removed, batches))
    }

    async fn cleanup_once(&self, retention_us: i64, batch: i64) -> Result<u64, StoreError> {
        let mut tx = begin(&self.inner.pool).await?;
        let done = self.cleanup_batch(&mut tx, retention_us, batch).await;
        finish(tx, done).await
    }

    async fn cleanup_batch(
        &self,
        conn: &mut sqlx::MySqlConnection,
        retention_us: i64,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let t = &self.inner.tables;
        let ids: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} \
             WHERE finished_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
               AND status IN ('published', 'discarded') \
             ORDER BY finished_at LIMIT ? FOR UPDATE SKIP LOCKED",
            t.events
        ))
        .bind(retention_us)
        .bind(batch)
        .fetch_all(&mut *conn)
        .await
        .map_err(db)?;
        if ids.is_empty() {
            return Ok(0);
        }
        let list = marks(ids.len());
        if self.inner.settings.archive {
            let sql = format!(
                "INSERT INTO {} ({ARCHIVE_COLS}, archived_at) \
                 SELECT {ARCHIVE_COLS}, UTC_TIMESTAMP(6) FROM {} WHERE id IN ({list})",
                t.archive, t.events
            );
            let mut q = sqlx::query(&sql);
            for id in &ids {
                q = q.bind(id);
            }
            q.execute(&mut *conn).await.map_err(db)?;
        }
        let sql = format!(
            "DELETE FROM {} WHERE id IN ({list}) AND status IN ('published', 'discarded')",
            t.events
        );
        let mut q = sqlx::query(&sql);
        for id in &ids {
            q = q.bind(id);
        }
        Ok(q.execute(&mut *conn).await.map_err(db)?.rows_affected())
    }

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
        stats.oldest_unpublished_age = class_of("flowing").1;
        stats.oldest_parked_age = age("oldest_parked_us")?;
        let mut extra = vec![
            ("blocked_rows".to_owned(), get("blocked")? as f64),
            (
                "blocked_by_parked_rows".to_owned(),
                class_of("parked").0 as f64,
            ),
        ];
        if let Some(a) = class_of("gap").1 {
            extra.push(("oldest_gap_held_age_seconds".to_owned(), a.as_secs_f64()));
        }
        if let Some(a) = class_of("parked").1 {
            extra.push((
                "oldest_blocked_by_parked_age_seconds".to_owned(),
                a.as_secs_f64(),
            ));
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
