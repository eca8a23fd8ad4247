//! The relay registry ([`RelayRegistry`]) in `<table>_relays` (migration 9), on the
//! database's clock.

use std::time::Duration;

use sqlx::Row;

use outbox_core::store::FORGET_AFTER;
use outbox_core::{async_trait, RelayEntry, RelayRegistration, RelayRegistry, StoreError};

use super::PostgresOutboxStore;
use crate::error::db;
use crate::schema::qualified;

impl PostgresOutboxStore {
    fn relays_table(&self) -> String {
        let s = &self.inner.settings;
        qualified(&s.schema, &format!("{}_relays", s.table))
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl RelayRegistry for PostgresOutboxStore {
    async fn register_relay(&self, r: &RelayRegistration) -> Result<(), StoreError> {
        let t = self.relays_table();
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        sqlx::query(&format!(
            "DELETE FROM {t} WHERE heartbeat_at < clock_timestamp() - $1::int8 * interval '1 millisecond'"
        ))
        .bind(millis(FORGET_AFTER))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        sqlx::query(&format!(
            "INSERT INTO {t} (owner, host, pid, version, claim_mode, heartbeat_interval_ms, \
                              started_at, heartbeat_at, held) \
             VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp(), clock_timestamp(), 0) \
             ON CONFLICT (owner) DO UPDATE SET host = EXCLUDED.host, pid = EXCLUDED.pid, \
               version = EXCLUDED.version, claim_mode = EXCLUDED.claim_mode, \
               heartbeat_interval_ms = EXCLUDED.heartbeat_interval_ms, \
               started_at = EXCLUDED.started_at, heartbeat_at = EXCLUDED.heartbeat_at, held = 0"
        ))
        .bind(&r.owner)
        .bind(&r.host)
        .bind(i64::from(r.pid))
        .bind(&r.version)
        .bind(&r.claim_mode)
        .bind(millis(r.heartbeat_interval).max(1))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)
    }

    async fn heartbeat_relay(&self, owner: &str, held: u64) -> Result<bool, StoreError> {
        let done = sqlx::query(&format!(
            "UPDATE {} SET heartbeat_at = clock_timestamp(), held = $2 WHERE owner = $1",
            self.relays_table()
        ))
        .bind(owner)
        .bind(i64::try_from(held).unwrap_or(i64::MAX))
        .execute(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(done.rows_affected() > 0)
    }

    async fn deregister_relay(&self, owner: &str) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "DELETE FROM {} WHERE owner = $1",
            self.relays_table()
        ))
        .bind(owner)
        .execute(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn relays(&self) -> Result<Vec<RelayEntry>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT owner, host, pid, version, claim_mode, heartbeat_interval_ms, started_at, \
                    heartbeat_at, held, \
                    GREATEST(EXTRACT(EPOCH FROM clock_timestamp() - heartbeat_at), 0)::float8 \
                      AS age \
             FROM {} ORDER BY owner",
            self.relays_table()
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|row| -> Result<RelayEntry, StoreError> {
                let registration = RelayRegistration::new(
                    row.try_get::<String, _>("owner").map_err(db)?,
                    row.try_get::<String, _>("host").map_err(db)?,
                    u32::try_from(row.try_get::<i64, _>("pid").map_err(db)?).unwrap_or(u32::MAX),
                    row.try_get::<String, _>("version").map_err(db)?,
                    row.try_get::<String, _>("claim_mode").map_err(db)?,
                    Duration::from_millis(
                        u64::try_from(row.try_get::<i64, _>("heartbeat_interval_ms").map_err(db)?)
                            .unwrap_or(1),
                    ),
                );
                Ok(RelayEntry::new(
                    registration,
                    row.try_get("started_at").map_err(db)?,
                    row.try_get("heartbeat_at").map_err(db)?,
                    Duration::from_secs_f64(row.try_get::<f64, _>("age").map_err(db)?.max(0.0)),
                    u64::try_from(row.try_get::<i64, _>("held").map_err(db)?).unwrap_or(0),
                ))
            })
            .collect()
    }

    async fn live_claims_of(&self, owner: &str) -> Result<u64, StoreError> {
        if self.inner.settings.claim_mode == outbox_core::ClaimMode::LockedTransaction {
            return Ok(0);
        }
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM ({}) l",
            self.inner.sql.owner_leases
        ))
        .bind(owner)
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
