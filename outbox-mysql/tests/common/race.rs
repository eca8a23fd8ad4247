//! Forcing interleavings on the server: transactions of their own that hold row locks the
//! store's statements need, a wait until a statement of the store is held up on one, and reads
//! of a row's delivery state.

use std::time::Duration;

use outbox_core::{ClaimedBatch, Envelope};
use outbox_mysql::MySqlOutboxStore;
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql};
use uuid::Uuid;

use super::Ctx;

/// A READ COMMITTED transaction on a connection of its own.
pub async fn held(ctx: &Ctx) -> PoolConnection<MySql> {
    let mut conn = ctx.pool.acquire().await.unwrap();
    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    conn
}

/// The ids of the connections running a statement on this test's database that starts with
/// `prefix` and contains `part` (other than the caller's).
pub async fn running(ctx: &Ctx, prefix: &str, part: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT ID FROM information_schema.PROCESSLIST \
         WHERE ID <> CONNECTION_ID() AND INSTR(INFO, ?) > 0 AND INSTR(INFO, ?) > 0 \
           AND INFO LIKE CONCAT(?, '%')",
    )
    .bind(&ctx.database)
    .bind(part)
    .bind(prefix)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Waits until `n` statements of this test's database starting with `prefix` and containing
/// `part` are held up in the server; returns their connection ids.
pub async fn wait_waiting(ctx: &Ctx, prefix: &str, part: &str, n: usize) -> Vec<i64> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let ids = running(ctx, prefix, part).await;
        if ids.len() >= n {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let again = running(ctx, prefix, part).await;
            if again.len() >= n {
                return again;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} statement(s) `{prefix}..{part}..` never waited on {}",
            ctx.database
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Kills the connection `id` on the server (a relay's process or network gone).
pub async fn kill(ctx: &Ctx, id: i64) {
    sqlx::query(&format!("KILL CONNECTION {id}"))
        .execute(&ctx.pool)
        .await
        .unwrap();
}

/// Holds the state row of `agg` (`FOR UPDATE`) in a transaction of its own.
pub async fn hold_aggregate(ctx: &Ctx, agg: &str) -> PoolConnection<MySql> {
    let mut c = held(ctx).await;
    sqlx::query(&format!(
        "SELECT aggregate_key FROM {} WHERE aggregate_id = ? FOR UPDATE",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg)
    .fetch_one(&mut *c)
    .await
    .unwrap();
    c
}

/// Holds the event row of `e` (`FOR UPDATE`) in a transaction of its own.
pub async fn hold_event(ctx: &Ctx, e: &Envelope) -> PoolConnection<MySql> {
    let mut c = held(ctx).await;
    sqlx::query(&format!(
        "SELECT id FROM {} WHERE event_id = ? FOR UPDATE",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&mut *c)
    .await
    .unwrap();
    c
}

/// Holds the lease row of `token` (`FOR UPDATE`) in a transaction of its own.
pub async fn hold_lease_row(ctx: &Ctx, token: Uuid) -> PoolConnection<MySql> {
    let mut c = held(ctx).await;
    let n: Vec<Uuid> = sqlx::query_scalar(&format!(
        "SELECT token FROM {} WHERE token = ? FOR UPDATE",
        ctx.table("outbox_events_lease")
    ))
    .bind(token)
    .fetch_all(&mut *c)
    .await
    .unwrap();
    assert_eq!(n.len(), 1, "the batch has its lease row");
    c
}

/// Inserts, and leaves uncommitted, the state row of `agg` (which has no state row yet): a
/// claim that creates it waits on the duplicate key.
pub async fn hold_state_insert(ctx: &Ctx, agg: &str) -> PoolConnection<MySql> {
    let mut c = held(ctx).await;
    let n = sqlx::query(&format!(
        "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
         SELECT aggregate_key, MIN(aggregate_type), MIN(aggregate_id), UTC_TIMESTAMP(6) \
         FROM {} WHERE aggregate_id = ? GROUP BY aggregate_key",
        ctx.table("outbox_events_aggregate"),
        ctx.table("outbox_events")
    ))
    .bind(agg)
    .execute(&mut *c)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "the state row of {agg} inserted");
    c
}

/// (status, claim token, `next_attempt_at` in the future, `maybe_delivered`, ack position) of
/// the row of event `e`.
pub async fn row(ctx: &Ctx, e: &Envelope) -> (String, Uuid, bool, bool, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), claim_token, next_attempt_at > UTC_TIMESTAMP(6), \
                maybe_delivered = 1, ack_position \
         FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// The aggregate's `last_version` (`None` without a state row or without a last version).
pub async fn last_version(ctx: &Ctx, agg: &str) -> Option<i64> {
    sqlx::query_scalar::<_, Option<i64>>(&format!(
        "SELECT last_version FROM {} WHERE aggregate_id = ?",
        ctx.table("outbox_events_aggregate")
    ))
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .flatten()
}

/// Counts of the rows per status, sorted by status.
pub async fn statuses(ctx: &Ctx) -> Vec<(String, i64)> {
    sqlx::query_as(&format!(
        "SELECT CAST(status AS CHAR), COUNT(*) FROM {} GROUP BY status ORDER BY 1",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Claims until the batch is not empty (a lease ends on the database clock; a rolled-back
/// transaction's row locks go a moment after its connection).
pub async fn claim_nonempty(s: &MySqlOutboxStore, owner: &str, limit: usize) -> ClaimedBatch {
    for _ in 0..200 {
        let b = super::claim(s, owner, limit).await;
        if !b.records.is_empty() {
            return b;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nothing claimable within 10 s");
}

/// The versions of `agg` published, in the order they were marked (`published_at`, id).
pub async fn published_versions(ctx: &Ctx, agg: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "SELECT aggregate_version FROM {} WHERE aggregate_id = ? AND status = 'published' \
         ORDER BY published_at, id",
        ctx.table("outbox_events")
    ))
    .bind(agg)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// The envelopes' event ids, for comparisons.
pub fn event_ids(batch: &ClaimedBatch) -> Vec<outbox_core::EventId> {
    batch.records.iter().map(|r| r.envelope.event_id).collect()
}

/// Waits until `cond` reports true (polled every 20 ms, at most 10 s).
pub async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..500 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never: {what}");
}

/// Holds every gap of the lease table (REPEATABLE READ next-key locks up to the supremum):
/// a claim's lease-row insert waits there, after the claim locked its rows and aggregates.
pub async fn hold_lease_inserts(ctx: &Ctx) -> PoolConnection<MySql> {
    let mut c = ctx.pool.acquire().await.unwrap();
    c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; START TRANSACTION")
        .await
        .unwrap();
    sqlx::query(&format!(
        "SELECT token FROM {} WHERE until > '1000-01-01' FOR UPDATE",
        ctx.table("outbox_events_lease")
    ))
    .fetch_all(&mut *c)
    .await
    .unwrap();
    c
}
