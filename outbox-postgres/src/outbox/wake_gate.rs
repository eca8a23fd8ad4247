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
//!
//! ## One server session, or no gate
//!
//! A session advisory lock belongs to the server session that took it. Behind a pooler in
//! transaction mode (PgBouncer `pool_mode = transaction`) consecutive transactions of one client
//! connection run on whichever server session is free: the lock could be taken on one session
//! and the unlock run on another (it fails, and the lock stays held by a session the pooler
//! hands to other clients: their appends then take the shared lock beside it and never notify,
//! every other append notifies for ever, and another relay can never arm); a `SET lock_timeout`
//! made on one session would not bound a lock request made on another, so an arm behind such a
//! leaked lock would wait for ever. So the gate checks that its connection keeps one session:
//!
//! * Its statements use the simple query protocol (no prepared statement to lose when the
//!   session changes) and each returns `pg_backend_pid()`, which must be the pid the gate's
//!   connection was opened on.
//! * When it opens its connection it asks a second connection of the pool, held at the same
//!   time, for its pid: two connections held at once never share a session on a direct or
//!   session-pooled connection, while PgBouncer in transaction mode hands the second one the
//!   session the first just released (it reuses the most recently released one). This finds the
//!   pooler before any lock is taken.
//! * The arm runs in a transaction of its own (one session for all of it, whatever the pooler)
//!   with `SET LOCAL lock_timeout`, so it never waits longer than `wake_gate_wait`; a lock
//!   granted to another session than the gate's is released in that same transaction.
//! * The disarm checks what `pg_advisory_unlock` returns: `false` means the lock was not held by
//!   the session that ran it.
//!
//! Any of these turns the gate off for the store's lifetime, with one warning
//! ([`PostgresOutboxStore::wake_gate_disabled`] says why): the relay then polls at its idle
//! backoff, as it does whenever a wake-up is missing, so nothing is lost or held. A lock left on
//! a pooled session by a late detection (after the lock was taken) stays there until the pooler
//! closes that server connection; meanwhile appends through that session do not notify and
//! other appends do, which costs a `NOTIFY` each, never an event.

use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use sqlx::{Connection, Executor, PgConnection, Row};
use tracing::{debug, warn};

use outbox_core::{ClaimRequest, ClaimedBatch, StoreError};

use super::PostgresOutboxStore;

/// The two `int4` keys of the gate's advisory lock (the two-key space never meets the one-key
/// space of the per-aggregate locks).
pub(crate) fn gate_keys(seed: i64) -> (i32, i32) {
    ((seed >> 32) as i32, seed as i32)
}

/// The gate's connection and the server session it must stay on.
pub(super) struct GateSession {
    conn: PgConnection,
    /// `pg_backend_pid()` of the session the connection was opened on.
    pid: i32,
}

/// The gate's state inside the store: the session that holds the lock while armed.
#[derive(Default)]
pub(super) struct WakeGate {
    session: tokio::sync::Mutex<Option<GateSession>>,
    /// Why the gate is off for good: its connection did not keep one server session.
    disabled: OnceLock<String>,
}

/// The backend pid of the session `conn` runs its next statement on.
async fn backend_pid(conn: &mut PgConnection) -> Result<i32, sqlx::Error> {
    // A plain `&str`: the simple query protocol, nothing prepared (so the Executor method,
    // whose boxed future is `Send` for any lifetime, unlike `RawSql`'s generic ones).
    conn.fetch_one("SELECT pg_backend_pid()").await?.try_get(0)
}

/// Releases the gate's lock on the session `conn` runs its next statement on: that session's
/// backend pid, and whether it held the lock.
async fn unlock(conn: &mut PgConnection, (k1, k2): (i32, i32)) -> Result<(i32, bool), sqlx::Error> {
    let sql = format!("SELECT pg_backend_pid(), pg_advisory_unlock({k1}, {k2})");
    let row = conn.fetch_one(sql.as_str()).await?;
    Ok((row.try_get(0)?, row.try_get(1)?))
}

impl PostgresOutboxStore {
    /// `true` while this store holds the wake-up gate armed (a claim came back empty and no
    /// claim found work since): appends, from any process, then raise a `NOTIFY`.
    pub fn wake_gate_armed(&self) -> bool {
        self.inner.gate_armed.load(Ordering::Acquire)
    }

    /// Why the wake-up gate is off for good, if it is: its connection turned out not to keep
    /// one server session (a pooler in transaction mode between the store and PostgreSQL; see
    /// the crate docs). The relay then polls instead of waiting for `NOTIFY`. Logged once, as a
    /// warning, when it happens.
    pub fn wake_gate_disabled(&self) -> Option<&str> {
        self.inner.gate.disabled.get().map(String::as_str)
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
        if !s.wake_gate
            || s.notify_channel.is_none()
            || request.limit == 0
            || self.wake_gate_disabled().is_some()
        {
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

    /// Turns the gate off for good (see the module docs), warning once.
    fn turn_gate_off(&self, reason: String) {
        self.inner.gate_armed.store(false, Ordering::Release);
        if self.inner.gate.disabled.set(reason).is_ok() {
            warn!(
                reason = self.wake_gate_disabled().unwrap_or_default(),
                "wake-up gate turned off: the database connection does not keep one server \
                 session (a pooler in transaction mode, such as PgBouncer with pool_mode = \
                 transaction, between the relay and PostgreSQL?). Session advisory locks and \
                 LISTEN need a session: the relay now polls at its idle backoff instead of \
                 waiting for NOTIFY. Connect the relay directly, or through a pool in session \
                 mode"
            );
        }
    }

    async fn arm(&self) -> bool {
        let mut guard = self.inner.gate.session.lock().await;
        if self.wake_gate_armed() {
            return true;
        }
        if self.wake_gate_disabled().is_some() {
            return false;
        }
        if guard.is_none() {
            match self.open_gate_session().await {
                Ok(Ok(session)) => *guard = Some(session),
                Ok(Err(shared)) => {
                    self.turn_gate_off(shared);
                    return false;
                }
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
        let mut session = guard.take().expect("just set");
        match self.lock_in_own_transaction(&mut session).await {
            Ok(None) => {
                *guard = Some(session);
                self.inner.gate_armed.store(true, Ordering::Release);
                true
            }
            Ok(Some(other)) => {
                // Granted to another session, and released there in the same transaction.
                self.turn_gate_off(format!(
                    "the gate's connection, opened on server session {}, ran its arm on server \
                     session {other} (backend pids)",
                    session.pid
                ));
                false
            }
            Err(e) => {
                // lock_timeout: appends in flight for longer than the wait, or another relay
                // holds the gate. Either way appends notify meanwhile; this relay polls.
                debug!(error = %e, "wake-up gate not armed");
                if is_lock_timeout(&e) {
                    *guard = Some(session);
                }
                false
            }
        }
    }

    /// Takes the gate's lock in a transaction of its own, bounded by `wake_gate_wait`. `Some`
    /// with the backend pid that ran it when that is not the gate's session (the lock is then
    /// released again before the transaction ends).
    async fn lock_in_own_transaction(
        &self,
        session: &mut GateSession,
    ) -> Result<Option<i32>, sqlx::Error> {
        let (k1, k2) = gate_keys(self.inner.seed);
        let wait_ms = self.inner.settings.wake_gate_wait.as_millis().max(1);
        let set_timeout = format!("SET LOCAL lock_timeout = {wait_ms}");
        let lock = format!("SELECT pg_backend_pid(), pg_advisory_lock({k1}, {k2})");
        let unlock = format!("SELECT pg_advisory_unlock({k1}, {k2})");
        let mut tx = session.conn.begin().await?;
        tx.execute(set_timeout.as_str()).await?;
        let pid: i32 = tx.fetch_one(lock.as_str()).await?.try_get(0)?;
        if pid != session.pid {
            tx.execute(unlock.as_str()).await?;
            tx.commit().await?;
            return Ok(Some(pid));
        }
        tx.commit().await?;
        Ok(None)
    }

    /// Whether the armed gate's session still answers, as the same session (it holds the lock
    /// while it lives); disarms and drops the connection when it does not, and turns the gate
    /// off when another session answered.
    async fn gate_alive(&self) -> bool {
        let mut guard = self.inner.gate.session.lock().await;
        let Some(mut session) = guard.take() else {
            self.inner.gate_armed.store(false, Ordering::Release);
            return false;
        };
        match backend_pid(&mut session.conn).await {
            Ok(pid) if pid == session.pid => {
                *guard = Some(session);
                true
            }
            Ok(pid) => {
                self.turn_gate_off(format!(
                    "the gate's connection, armed on server session {}, answered from server \
                     session {pid} (backend pids): the lock may stay held by the first one",
                    session.pid
                ));
                false
            }
            Err(_) => {
                warn!("wake-up gate: its connection was lost while armed; arming again");
                self.inner.gate_armed.store(false, Ordering::Release);
                false
            }
        }
    }

    async fn disarm(&self) {
        let mut guard = self.inner.gate.session.lock().await;
        // Claims through one store instance may run concurrently (a prefetch beside a probe,
        // two relays sharing a store): a second claim that found work may come here after the
        // first one disarmed. Session advisory locks do not stack across an unlock, so unlock
        // only what this store holds (an unlock of a lock not held is refused with a notice).
        if !self.inner.gate_armed.swap(false, Ordering::AcqRel) {
            return;
        }
        // Out of the guard while unlocking: dropped mid-way (a cancelled claim), the connection
        // goes and its session ends with the lock, rather than staying here holding it unarmed.
        let Some(mut session) = guard.take() else {
            return;
        };
        let unlocked = unlock(&mut session.conn, gate_keys(self.inner.seed)).await;
        match unlocked {
            Ok((pid, true)) if pid == session.pid => *guard = Some(session),
            Ok((pid, released)) => self.turn_gate_off(format!(
                "the gate's connection, armed on server session {}, released its lock from \
                 server session {pid} (backend pids; pg_advisory_unlock returned {released})",
                session.pid
            )),
            // Dropping the connection ends the session, and the lock with it.
            Err(e) => warn!(error = %e, "wake-up gate: unlock failed; closing its connection"),
        }
    }

    /// Opens the gate's connection and checks that it is a server session of its own: a second
    /// connection of the pool, held at the same time, must run on another session (see the
    /// module docs). `Ok(Err(why))` when it does not.
    async fn open_gate_session(&self) -> Result<Result<GateSession, String>, sqlx::Error> {
        let mut conn = self.inner.pool.acquire().await?.detach();
        let pid = backend_pid(&mut conn).await?;
        // Bounded: a pool whose connections are all in use skips the check (the checks of
        // every gate statement remain).
        let wait = self.inner.settings.wake_gate_wait;
        if let Ok(Ok(mut other)) = tokio::time::timeout(wait, self.inner.pool.acquire()).await {
            let other_pid = backend_pid(&mut other).await?;
            drop(other);
            let again = backend_pid(&mut conn).await?;
            if other_pid == pid || again != pid {
                return Ok(Err(format!(
                    "two connections of the pool held at the same time ran on one server \
                     session: the gate's ran on server sessions {pid} then {again}, the other \
                     on {other_pid} (backend pids)"
                )));
            }
        }
        Ok(Ok(GateSession { conn, pid }))
    }
}

fn is_lock_timeout(e: &sqlx::Error) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == "55P03")
}

#[cfg(test)]
#[path = "wake_gate_tests.rs"]
mod tests;
