//! The lease release of a completion is fenced on the row it writes, not only on what the
//! statement read: a lease that another holder writes while the completion runs (committed
//! after the completion's snapshot, while its release waits on the row) is neither ended nor
//! given the completion's version.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use sqlx::{Connection, PgPool};

use common::{claim, event, lease, published, versions};

async fn wait_blocked_by(pool: &PgPool, holder: i32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
        )
        .bind(holder)
        .fetch_optional(pool)
        .await
        .unwrap();
        if waiting.is_some() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing ever waited on backend {holder}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A completion whose aggregate's lease passes to another token while its release waits on
/// the state row: its own outcome was decided on the lease it read, but the release re-checks
/// the token on the row it updates and leaves the newer lease and `last_version` alone.
#[tokio::test]
async fn a_release_waiting_on_a_newer_lease_leaves_it_and_its_version() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let v1 = event("fenced", 1);
    store
        .append_many(&ctx.pool, std::slice::from_ref(&v1))
        .await
        .unwrap();
    let b = claim(&store, "old", 100).await;
    assert_eq!(versions(&b), vec![("fenced".into(), 1)]);

    // Another writer takes the lease over (a new token) without committing yet.
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| common::DEFAULT_URL.to_owned());
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut other)
        .await
        .unwrap();
    let newer = uuid::Uuid::now_v7();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    let n = sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_aggregate SET lease_owner = 'newer', lease_token = $1, \
                lease_until = clock_timestamp() + interval '1 hour' \
          WHERE aggregate_id = 'fenced'",
        ctx.schema
    ))
    .bind(newer)
    .execute(&mut other)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);

    let s2 = store.clone();
    let handle = b.handle.clone();
    let done =
        tokio::spawn(async move { s2.complete(&handle, &[published(&v1, 7)]).await.unwrap() });
    wait_blocked_by(&ctx.pool, holder).await;
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();
    done.await.unwrap();

    let (owner, token, last): (Option<String>, Option<uuid::Uuid>, Option<i64>) =
        sqlx::query_as(&format!(
            "SELECT lease_owner, lease_token, last_version \
               FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = 'fenced'",
            ctx.schema
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert_eq!(
        (owner.as_deref(), token, last),
        (Some("newer"), Some(newer), None),
        "the newer lease is intact and no version was recorded"
    );
    ctx.drop().await;
}
