//! [`Backend::hold_head`](crate::Backend::hold_head) on PostgreSQL: a transaction of the
//! simulation's own locks what the next claim of an aggregate writes after its decision's
//! snapshot, so the claim stops there, holding the aggregate's lock, and the sessions that
//! then wait behind it are seen in `pg_stat_activity` (`pg_blocking_pids`).

use outbox_core::{async_trait, EventId};
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::backend::Hold;

/// A held row lock and the session that holds it.
struct PgHold {
    tx: Transaction<'static, Postgres>,
    pool: PgPool,
    pid: i32,
}

/// Holds the pending row of `event` and, when a claim would not write that row (it is marked
/// as maybe delivered already), its aggregate's state row: a lease claim that takes the
/// aggregate over writes the state row (the lease) and then marks the row it re-sends, after
/// its snapshot and its aggregate lock. Locking only the row the claim reaches last keeps the
/// claim and a completion waiting behind it in one line (no deadlock between them). `None`:
/// the event is not pending.
pub(crate) async fn hold_head(
    pool: &PgPool,
    schema: &str,
    event: EventId,
) -> Result<Option<Box<dyn Hold>>, String> {
    let t = format!("\"{schema}\".{}", outbox_postgres::DEFAULT_OUTBOX_TABLE);
    let a = format!(
        "\"{schema}\".{}_aggregate",
        outbox_postgres::DEFAULT_OUTBOX_TABLE
    );
    let err = |e: sqlx::Error| format!("holding the head {event}: {e}");
    let mut tx = pool.begin().await.map_err(err)?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .map_err(err)?;
    let row = sqlx::query(&format!(
        "SELECT maybe_delivered, aggregate_type, aggregate_id FROM {t} \
         WHERE event_id = $1 AND status = 'pending' FOR UPDATE"
    ))
    .bind(event.as_uuid())
    .fetch_optional(&mut *tx)
    .await
    .map_err(err)?;
    let Some(row) = row else {
        tx.rollback().await.map_err(err)?;
        return Ok(None);
    };
    if row.get::<bool, _>(0) {
        sqlx::query(&format!(
            "SELECT 1 FROM {a} WHERE aggregate_type = $1 AND aggregate_id = $2 FOR UPDATE"
        ))
        .bind(row.get::<String, _>(1))
        .bind(row.get::<String, _>(2))
        .execute(&mut *tx)
        .await
        .map_err(err)?;
    }
    Ok(Some(Box::new(PgHold {
        tx,
        pool: pool.clone(),
        pid,
    })))
}

#[async_trait]
impl Hold for PgHold {
    async fn waiting(&mut self) -> Result<usize, String> {
        let n: i64 = sqlx::query_scalar(
            "WITH w AS (SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))) \
             SELECT (SELECT count(*) FROM w) + \
                    (SELECT count(*) FROM pg_stat_activity s \
                     WHERE s.pid <> $1 AND NOT s.pid = ANY(ARRAY(SELECT pid FROM w)) \
                       AND pg_blocking_pids(s.pid) && ARRAY(SELECT pid FROM w))",
        )
        .bind(self.pid)
        .fetch_one(&self.pool)
        .await
        .map_err(|e| format!("reading the lock waits: {e}"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    async fn release(self: Box<Self>) -> Result<(), String> {
        self.tx
            .commit()
            .await
            .map_err(|e| format!("releasing the hold: {e}"))
    }
}
