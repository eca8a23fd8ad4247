//! The wake-up gate: appends `NOTIFY` only while a relay is idle and waiting for one.
//!
//! PostgreSQL serializes the commits of notifying transactions on one global lock (taken before
//! the commit record and held through its flush), so a `NOTIFY` in every append takes group
//! commit away from the business transactions exactly when they are busiest. A relay that is
//! busy does not need the signal: it claims again right after its batch. So:
//!
//! * A relay whose claim comes back empty **arms** the gate: on a dedicated connection it takes
//!   the session advisory lock `(k1, k2)` of the table in exclusive mode, then claims once more.
//! * Every append runs `pg_try_advisory_xact_lock_shared(k1, k2)` in its statement and raises
//!   the `NOTIFY` only when that fails (a relay holds or waits for the lock). When it succeeds,
//!   the append holds the shared lock until its transaction ends.
//! * The next non-empty claim **disarms** the gate (unlocks).
//!
//! No wake-up is lost: the exclusive lock is granted only after every transaction that took the
//! shared lock (and so did not notify) has ended, and the claim after arming runs in a snapshot
//! taken after that, so it sees their rows. An append that comes later fails its try (the lock
//! is held or requested) and notifies. Advisory locks are not part of any snapshot, so this holds
//! at every isolation level.
//!
//! The arm waits at most [`OutboxSettings::wake_gate_wait`](crate::OutboxSettings) for the
//! appends in flight (a long business transaction, or another relay process that holds the
//! gate armed); when it gives up, the relay stays unarmed for that idle period and its polling is
//! the fallback (appends keep notifying while another relay holds the gate). Only a store that
//! runs a listener ([`PostgresOutboxStore::spawn_listener`]) arms: nothing else waits for a
//! `NOTIFY`. When the gate's connection is lost, the lock goes with it and the relay polls
//! until its next arm opens a new connection.

use std::sync::atomic::Ordering;

use sqlx::{Connection, PgConnection};
use tracing::{debug, warn};

use outbox_core::{ClaimRequest, ClaimedBatch, StoreError};

use super::PostgresOutboxStore;

/// The two `int4` keys of the gate's advisory lock (the two-key space never meets the one-key
/// space of the per-aggregate locks).
pub(crate) fn gate_keys(seed: i64) -> (i32, i32) {
    ((seed >> 32) as i32, seed as i32)
}

/// The gate's state inside the store: the connection that holds the lock while armed.
#[derive(Default)]
pub(super) struct WakeGate {
    pub(super) conn: tokio::sync::Mutex<Option<PgConnection>>,
}

impl PostgresOutboxStore {
    /// `true` while this store holds the wake-up gate armed (a claim came back empty and no
    /// claim found work since): appends, from any process, then raise a `NOTIFY`.
    pub fn wake_gate_armed(&self) -> bool {
        self.inner.gate_armed.load(Ordering::Acquire)
    }

    /// Append statements through this store instance that raised a `NOTIFY` (counted when the
    /// statement ran, whether or not its transaction then committed).
    pub fn notifications_raised(&self) -> u64 {
        self.inner.notifies.load(Ordering::Relaxed)
    }

    /// Marks this store as one whose relay waits for `NOTIFY` (its empty claims arm the gate).
    pub(crate) fn set_listening(&self) {
        self.inner.listening.store(true, Ordering::Release);
    }

    /// The claim with the gate around it (see the module docs).
    pub(super) async fn claim_gated(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimedBatch, StoreError> {
        let batch = self.claim_inner(request).await?;
        let s = &self.inner.settings;
        if !s.wake_gate || s.notify_channel.is_none() || request.limit == 0 {
            return Ok(batch);
        }
        if !batch.is_empty() {
            if self.wake_gate_armed() {
                self.disarm().await;
            }
            return Ok(batch);
        }
        if !self.inner.listening.load(Ordering::Acquire) {
            return Ok(batch);
        }
        // Armed: the lock lives as long as the gate's session; a session ended under it (a
        // terminated backend, a lost connection) took the lock with it, and appends stopped
        // notifying. Check it on every empty claim (the relay is idle) and arm anew if gone.
        if self.wake_gate_armed() && self.gate_alive().await {
            return Ok(batch);
        }
        if !self.arm().await {
            return Ok(batch);
        }
        // The appends that did not notify have ended: look again.
        let again = self.claim_inner(request).await?;
        if !again.is_empty() {
            self.disarm().await;
        }
        Ok(again)
    }

    async fn arm(&self) -> bool {
        let mut guard = self.inner.gate.conn.lock().await;
        if self.wake_gate_armed() {
            return true;
        }
        if guard.is_none() {
            match self.gate_connection().await {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    warn!(error = %e, "wake-up gate: no connection; the relay polls");
                    return false;
                }
            }
        }
        // Taken out of the guard while the lock is requested: a claim dropped meanwhile (a
        // caller's timeout) drops the connection with it, and its session ends with whatever
        // the server granted, instead of staying here holding the lock with the gate unarmed
        // (the next arm would then lock it twice, and the disarm leave it held).
        let mut conn = guard.take().expect("just set");
        let (k1, k2) = gate_keys(self.inner.seed);
        match sqlx::query("SELECT pg_advisory_lock($1, $2)")
            .bind(k1)
            .bind(k2)
            .execute(&mut conn)
            .await
        {
            Ok(_) => {
                *guard = Some(conn);
                self.inner.gate_armed.store(true, Ordering::Release);
                true
            }
            Err(e) => {
                // lock_timeout: appends in flight for longer than the wait, or another relay
                // holds the gate. Either way appends notify meanwhile; this relay polls.
                debug!(error = %e, "wake-up gate not armed");
                if is_lock_timeout(&e) {
                    *guard = Some(conn);
                }
                false
            }
        }
    }

    /// Whether the armed gate's session still answers (it holds the lock while it lives);
    /// disarms and drops the connection when it does not.
    async fn gate_alive(&self) -> bool {
        let mut guard = self.inner.gate.conn.lock().await;
        let alive = match guard.as_mut() {
            Some(conn) => conn.ping().await.is_ok(),
            None => false,
        };
        if !alive {
            warn!("wake-up gate: its connection was lost while armed; arming again");
            *guard = None;
            self.inner.gate_armed.store(false, Ordering::Release);
        }
        alive
    }

    async fn disarm(&self) {
        let mut guard = self.inner.gate.conn.lock().await;
        // Claims through one store instance may run concurrently (a prefetch beside a probe,
        // two relays sharing a store): a second claim that found work may come here after the
        // first one disarmed. Session advisory locks do not stack across an unlock, so unlock
        // only what this store holds (an unlock of a lock not held is refused with a notice).
        if !self.inner.gate_armed.swap(false, Ordering::AcqRel) {
            return;
        }
        // Out of the guard while unlocking: dropped mid-way (a cancelled claim), the connection
        // goes and its session ends with the lock, rather than staying here holding it unarmed.
        let Some(mut conn) = guard.take() else {
            return;
        };
        let (k1, k2) = gate_keys(self.inner.seed);
        match sqlx::query("SELECT pg_advisory_unlock($1, $2)")
            .bind(k1)
            .bind(k2)
            .execute(&mut conn)
            .await
        {
            Ok(_) => *guard = Some(conn),
            // Dropping the connection ends the session, and the lock with it.
            Err(e) => warn!(error = %e, "wake-up gate: unlock failed; closing its connection"),
        }
    }

    async fn gate_connection(&self) -> Result<PgConnection, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?.detach();
        let wait_ms = self.inner.settings.wake_gate_wait.as_millis().max(1);
        sqlx::query(&format!("SET lock_timeout = {wait_ms}"))
            .execute(&mut conn)
            .await?;
        conn.ping().await?;
        Ok(conn)
    }
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}
