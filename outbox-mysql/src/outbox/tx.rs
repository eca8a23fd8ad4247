//! Transactions of the store: READ COMMITTED whatever the server's default, rolled back at once
//! on failure, and run again after a deadlock or a lock wait timeout.
//!
//! Every decision about an aggregate is taken by a statement that starts after the aggregate's
//! state-row lock was granted. Under READ COMMITTED each statement reads the latest committed
//! data (InnoDB's REPEATABLE READ default would read the transaction's first snapshot, taken
//! before the lock, and add gap locks that make claimers deadlock on each other), so the
//! isolation level is set for each transaction, never left to the server.
//!
//! Every multi-table `UPDATE` (the batch writes joined with a `JSON_TABLE`) is driven by its
//! `JSON_TABLE` (`STRAIGHT_JOIN`) and finds each row by primary key (`FORCE INDEX (PRIMARY)`),
//! and the blocking locking read of a list of state rows names the primary key too. Left to
//! the optimizer, a small table is scanned whole whatever the `IN (..)` list (MariaDB 10.11:
//! 12 state rows, 5 keys), and such a statement waits on every row it reads, not only the ones
//! it changes (a multi-table `UPDATE` gets no semi-consistent read): two locked claims
//! completing at once each waited on the other's state rows, a deadlock (1213) that rolled one
//! claim back.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlPool, Transaction};
use tracing::warn;

use outbox_core::StoreError;

use crate::error::db;

/// Begins a READ COMMITTED transaction (the isolation level applies to this transaction only:
/// the pool may be shared with the application).
pub(crate) const BEGIN_RC: &str =
    "SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION";

/// How many times an operation is run when deadlocks or lock wait timeouts roll it back.
pub(crate) const LOCK_CONFLICT_ATTEMPTS: u32 = 6;

/// A READ COMMITTED transaction from `pool`.
///
/// Begun in a task of its own, so that it is cancel-safe: sqlx counts a transaction as open
/// only once its `BEGIN` statement answered, so a caller cancelled while the statement is in
/// flight (a relay task aborted, a timeout around a store call) would drop a connection whose
/// transaction the server has started, and the pool would hand it out again with the
/// transaction open: the next `SET TRANSACTION` there fails (1568, "Transaction
/// characteristics can't be changed while a transaction is in progress") and a plain
/// statement there never commits. The task always runs the begin to its end; a transaction
/// nobody takes any more is dropped, which rolls it back before the connection is used again.
pub(crate) async fn begin(pool: &MySqlPool) -> Result<Transaction<'static, MySql>, StoreError> {
    let pool = pool.clone();
    match tokio::spawn(async move { pool.begin_with(BEGIN_RC).await }).await {
        Ok(begun) => begun.map_err(db),
        Err(e) => Err(StoreError::new(
            outbox_core::StoreErrorKind::Other,
            format!("the task beginning a transaction did not finish: {e}"),
        )),
    }
}

/// Begins a read-only transaction on one consistent snapshot (`REPEATABLE READ`, the snapshot
/// taken at once): the reports that read in more than one statement see one state. Begun in
/// a task of its own, as [`begin`].
pub(crate) async fn begin_snapshot(
    pool: &MySqlPool,
) -> Result<Transaction<'static, MySql>, StoreError> {
    let pool = pool.clone();
    match tokio::spawn(async move { pool.begin_with(BEGIN_SNAPSHOT).await }).await {
        Ok(begun) => begun.map_err(db),
        Err(e) => Err(StoreError::new(
            outbox_core::StoreErrorKind::Other,
            format!("the task beginning a transaction did not finish: {e}"),
        )),
    }
}

/// A read-only transaction on a consistent snapshot taken at its start.
const BEGIN_SNAPSHOT: &str = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; \
     START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY";

/// Commits `tx` after `result` succeeded, else rolls it back at once.
pub(crate) async fn finish<T>(
    tx: Transaction<'static, MySql>,
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
pub(crate) async fn abort<T>(
    tx: Transaction<'static, MySql>,
    e: StoreError,
) -> Result<T, StoreError> {
    if let Err(rollback) = tx.rollback().await {
        warn!(error = %rollback, "rollback after a failed store operation failed; the connection is dropped");
    }
    Err(e)
}

/// How long to pause before running a transaction again after lock conflict number
/// `attempt`.
pub(crate) fn conflict_pause(attempt: u32) -> Duration {
    jitter(Duration::from_millis(2 << attempt.min(6)))
}

/// Evaluates `$op` (an awaited whole transaction) again when a deadlock or a lock wait timeout
/// rolled it back, up to a few times with a short jittered pause; any other outcome is the
/// value. (A macro, not a function taking a closure: an async closure borrowing the store
/// makes the futures of `async_trait` methods fail the `Send` check.)
macro_rules! retry_lock_conflicts {
    ($op:expr) => {{
        let mut attempt = 1u32;
        loop {
            let result = $op;
            let again = match &result {
                Err(e) => {
                    attempt < $crate::outbox::tx::LOCK_CONFLICT_ATTEMPTS
                        && $crate::error::is_lock_conflict(e)
                }
                Ok(_) => false,
            };
            if !again {
                break result;
            }
            drop(result);
            tracing::debug!(attempt, "lock conflict; running the transaction again");
            tokio::time::sleep($crate::outbox::tx::conflict_pause(attempt)).await;
            attempt += 1;
        }
    }};
}
pub(crate) use retry_lock_conflicts;

/// Full jitter in [d/2, d).
pub(crate) fn jitter(d: Duration) -> Duration {
    let r = (uuid::Uuid::new_v4().as_u128() % 1000) as u32;
    d.mul_f64(0.5 + f64::from(r) / 2000.0)
}

pub(crate) fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// `locked_max_hold` in whole seconds, rounded up (the server's `wait_timeout` unit).
pub(crate) fn hold_secs(d: Duration) -> u64 {
    let s = d.as_secs();
    if d.subsec_nanos() > 0 {
        s + 1
    } else {
        s.max(1)
    }
}

/// A pooled connection in a transaction of a locked claim. The session's `wait_timeout` is
/// the claim's hold: a relay that never completes makes the server close the connection, which
/// rolls the claim back. Dropped while the transaction is open (a relay task aborted, a claim
/// the store gave up on), the connection is detached from the pool and closed, never returned
/// with an open transaction or a shortened `wait_timeout`: the server rolls back and frees the
/// aggregates, as a crash does.
pub(crate) struct HeldConnection {
    conn: Option<PoolConnection<MySql>>,
}

impl HeldConnection {
    /// Acquires a connection and begins a READ COMMITTED transaction whose session closes
    /// after `hold` of idleness.
    ///
    /// Cancel-safe: the connection is held (closed when dropped) from before the statement is
    /// sent, so a caller cancelled while it is in flight never returns it to the pool.
    pub(crate) async fn begin(pool: &MySqlPool, hold: Duration) -> Result<Self, StoreError> {
        let mut held = Self {
            conn: Some(pool.acquire().await.map_err(db)?),
        };
        // A SET cannot take a bind parameter; the value is an integer formatted here.
        let begin = format!("SET SESSION wait_timeout = {}; {BEGIN_RC}", hold_secs(hold));
        // On failure `held` is dropped: the connection is closed.
        sqlx::Executor::execute(held.conn(), begin.as_str())
            .await
            .map_err(db)?;
        Ok(held)
    }

    /// The connection.
    pub(crate) fn conn(&mut self) -> &mut sqlx::MySqlConnection {
        self.conn.as_mut().expect("a held connection until it ends")
    }

    /// Commits (or rolls back) and gives the connection back to the pool with the server's
    /// `wait_timeout`. On failure the connection is closed (its transaction goes with it).
    /// Cancel-safe: the connection stays held until the statement answered, so a caller
    /// cancelled meanwhile closes it (a commit that did not answer is then in doubt, as after
    /// a crash) instead of returning it to the pool mid-transaction.
    pub(crate) async fn end(mut self, commit: bool) -> Result<(), StoreError> {
        let end = if commit { "COMMIT" } else { "ROLLBACK" };
        let sql = format!("{end}; SET SESSION wait_timeout = DEFAULT");
        // On failure `self` is dropped: the connection is closed.
        sqlx::Executor::execute(self.conn(), sql.as_str())
            .await
            .map_err(db)?;
        // Back to the pool, with the server's `wait_timeout` and no transaction.
        drop(self.conn.take());
        Ok(())
    }
}

impl Drop for HeldConnection {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Closing the session is what a crash does: the server rolls back.
            drop(conn.detach());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_rounds_up_to_whole_seconds() {
        assert_eq!(hold_secs(Duration::from_millis(1)), 1);
        assert_eq!(hold_secs(Duration::from_secs(3)), 3);
        assert_eq!(hold_secs(Duration::from_millis(3001)), 4);
        assert_eq!(hold_secs(Duration::ZERO), 1);
    }

    #[tokio::test]
    async fn only_lock_conflicts_are_run_again() {
        use outbox_core::StoreErrorKind;
        // A deadlock as the server reports it cannot be built here (the error type is the
        // driver's); `is_lock_conflict` is checked against the real server in tests/errors.rs.
        // Other errors, a plain `Conflict` included, return at once.
        let mut calls = 0;
        let r: Result<(), StoreError> = retry_lock_conflicts!({
            calls += 1;
            Err(StoreError::new(
                StoreErrorKind::Conflict,
                "not a lock conflict",
            ))
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }
}
