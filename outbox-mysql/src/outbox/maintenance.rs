//! Maintenance (the maintenance role): cleanup of finished rows in bounded batches, one short
//! transaction each, optionally archived.

use std::time::Duration;

use outbox_core::{CleanupReport, StoreError};

use super::head::marks;
use super::tx::{self, begin, finish, micros};
use super::MySqlOutboxStore;
use crate::error::db;

/// Columns copied into the archive (the table's, without the generated key expression).
const ARCHIVE_COLS: &str = "id, event_id, aggregate_type, aggregate_id, aggregate_key, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at, \
    status, attempts, maybe_delivered, last_error_class, last_error_kind, last_error_message, \
    published_at, ack_transport, ack_destination, ack_partition, ack_position, ack_route, \
    ack_duplicate, discard_reason, finished_at, inserted_at";

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
        self.cleanup_lease_rows(batch).await?;
        Ok(CleanupReport::new(removed, batches))
    }

    /// Deletes the lease rows of claims whose lease has ended (`until`, on the database
    /// clock), in bounded batches: a completion or release deletes its own, so these are the
    /// rows of relays that stopped without either. A lease row only names the relay that
    /// holds a live claim (for `release_claims_of` and the reports); an expired claim's
    /// completion does not need it (its rows carry its token). At most 100 batches per
    /// cleanup; the next cleanup goes on.
    async fn cleanup_lease_rows(&self, batch: i64) -> Result<u64, StoreError> {
        let sql = format!(
            "DELETE FROM {} WHERE until < UTC_TIMESTAMP(6) ORDER BY until LIMIT ?",
            self.inner.tables.lease
        );
        let mut removed = 0;
        for _ in 0..100 {
            let n = tx::retry_lock_conflicts!(sqlx::query(&sql)
                .bind(batch)
                .execute(&self.inner.pool)
                .await
                .map_err(db))?
            .rows_affected();
            removed += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(removed)
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
}
