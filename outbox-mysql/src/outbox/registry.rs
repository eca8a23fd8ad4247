//! The relay registry ([`RelayRegistry`]) in `<table>_relays` (migration 4), on the server's
//! UTC clock.

use std::time::Duration;

use chrono::NaiveDateTime;
use sqlx::Row;

use outbox_core::store::FORGET_AFTER;
use outbox_core::{
    async_trait, ClaimMode, RelayEntry, RelayRegistration, RelayRegistry, StoreError,
};

use super::rows::utc;
use super::MySqlOutboxStore;
use crate::error::{db, text};

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl RelayRegistry for MySqlOutboxStore {
    async fn register_relay(&self, r: &RelayRegistration) -> Result<(), StoreError> {
        let t = &self.inner.tables.relays;
        sqlx::query(&format!(
            "DELETE FROM {t} WHERE heartbeat_at < UTC_TIMESTAMP(6) - INTERVAL ? SECOND"
        ))
        .bind(i64::try_from(FORGET_AFTER.as_secs()).unwrap_or(i64::MAX))
        .execute(&self.inner.pool)
        .await
        .map_err(db)?;
        sqlx::query(&format!(
            "INSERT INTO {t} (owner, host, pid, version, claim_mode, heartbeat_interval_ms, \
                              started_at, heartbeat_at, held) \
             VALUES (CAST(? AS BINARY), ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 0) \
             ON DUPLICATE KEY UPDATE host = VALUES(host), pid = VALUES(pid), \
               version = VALUES(version), claim_mode = VALUES(claim_mode), \
               heartbeat_interval_ms = VALUES(heartbeat_interval_ms), \
               started_at = VALUES(started_at), heartbeat_at = VALUES(heartbeat_at), held = 0"
        ))
        .bind(&r.owner)
        .bind(&r.host)
        .bind(i64::from(r.pid))
        .bind(&r.version)
        .bind(&r.claim_mode)
        .bind(millis(r.heartbeat_interval).max(1))
        .execute(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn heartbeat_relay(&self, owner: &str, held: u64) -> Result<bool, StoreError> {
        // `found` rows, not `changed`: sqlx asks the server for found rows, so a heartbeat
        // within the same microsecond with the same count still counts.
        let done = sqlx::query(&format!(
            "UPDATE {} SET heartbeat_at = UTC_TIMESTAMP(6), held = ? \
             WHERE owner = CAST(? AS BINARY)",
            self.inner.tables.relays
        ))
        .bind(i64::try_from(held).unwrap_or(i64::MAX))
        .bind(owner)
        .execute(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(done.rows_affected() > 0)
    }

    async fn deregister_relay(&self, owner: &str) -> Result<(), StoreError> {
        sqlx::query(&format!(
            "DELETE FROM {} WHERE owner = CAST(? AS BINARY)",
            self.inner.tables.relays
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
                    GREATEST(TIMESTAMPDIFF(MICROSECOND, heartbeat_at, UTC_TIMESTAMP(6)), 0) \
                      AS age_us \
             FROM {} ORDER BY owner",
            self.inner.tables.relays
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|row| -> Result<RelayEntry, StoreError> {
                let owner: Vec<u8> = row.try_get("owner").map_err(db)?;
                let registration = RelayRegistration::new(
                    String::from_utf8_lossy(&owner).into_owned(),
                    text(row, "host")?,
                    u32::try_from(row.try_get::<i64, _>("pid").map_err(db)?).unwrap_or(u32::MAX),
                    text(row, "version")?,
                    text(row, "claim_mode")?,
                    Duration::from_millis(
                        u64::try_from(row.try_get::<i64, _>("heartbeat_interval_ms").map_err(db)?)
                            .unwrap_or(1),
                    ),
                );
                let started: NaiveDateTime = row.try_get("started_at").map_err(db)?;
                let heartbeat: NaiveDateTime = row.try_get("heartbeat_at").map_err(db)?;
                let age: i64 = row.try_get("age_us").map_err(db)?;
                Ok(RelayEntry::new(
                    registration,
                    utc(started),
                    utc(heartbeat),
                    Duration::from_micros(u64::try_from(age).unwrap_or(0)),
                    u64::try_from(row.try_get::<i64, _>("held").map_err(db)?).unwrap_or(0),
                ))
            })
            .collect()
    }

    async fn live_claims_of(&self, owner: &str) -> Result<u64, StoreError> {
        if self.inner.settings.claim_mode == ClaimMode::LockedTransaction {
            return Ok(0);
        }
        // What `release_claims_of` selects: the live rows of the owner's lease batches (the
        // token on the event row), and the live leases a relay of the previous version wrote
        // in the state rows.
        let t = &self.inner.tables;
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT (SELECT COUNT(*) FROM {events} e JOIN {lease} l ON e.claim_token = l.token \
                      WHERE l.owner = CAST(? AS BINARY) AND e.status = 'pending' \
                        AND e.next_attempt_at > UTC_TIMESTAMP(6)) \
                  + (SELECT COUNT(*) FROM {state} WHERE lease_owner = CAST(? AS BINARY) \
                      AND lease_until > UTC_TIMESTAMP(6) AND lease_row IS NOT NULL)",
            events = t.events,
            lease = t.lease,
            state = t.state,
        ))
        .bind(owner)
        .bind(owner)
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
