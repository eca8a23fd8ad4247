//! Per-aggregate order against a real MySQL/MariaDB with an interleaving forced
//! deterministically: a transaction holds a row lock and the test waits (through
//! `information_schema.PROCESSLIST`) until the store's completion is blocked behind it. The counterpart of
//! `outbox-postgres/tests/order.rs`'s `a_park_or_retry_in_progress_is_never_overtaken_by_a_claim`
//! (the late-lower-version case is shared: `tests/relays.rs`).
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use sqlx::MySqlPool;

use common::{claim, event, lease, park, retry, versions};

async fn status(ctx: &common::Ctx, e: &outbox_core::Envelope) -> String {
    sqlx::query_scalar(&format!(
        "SELECT CAST(status AS CHAR) FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// Waits until an `UPDATE` of this test's database (the name is unique to the test) is held
/// up in the server, as `information_schema.PROCESSLIST` shows it: the completion waiting for
/// the row lock the test holds. (MariaDB's `INNODB_TRX` does not list a transaction that has
/// written nothing yet, and refreshes from a cache.)
async fn wait_until_blocked_on(pool: &MySqlPool, database: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE ID <> CONNECTION_ID() AND INSTR(INFO, ?) > 0 AND INFO LIKE 'UPDATE%'",
        )
        .bind(database)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing on {database} ever waited for a lock"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A completion with a Park or Retry outcome serializes with claims of the same aggregate.
/// Relay A's lease on X has expired (so another relay may take X over), and A's completion is
/// in progress (held up behind a row lock this test holds). Relay B's claim must not hand X
/// out, then or after: X is parked, or comes back only after the retry delay.
#[tokio::test]
async fn a_park_or_retry_in_progress_is_never_overtaken_by_a_claim() {
    for outcome_kind in ["park", "retry"] {
        let ctx = ctx!(6);
        let a = ctx.store(lease(0.2)).await;
        let b = ctx.store(lease(0.2)).await;
        let (x1, x2) = (event("x", 1), event("x", 2));
        common::append(&ctx, &a, &[x1.clone(), x2.clone()]).await;
        let claimed = claim(&a, "relay-a", 100).await;
        assert_eq!(versions(&claimed), vec![("x".into(), 1)]);
        tokio::time::sleep(Duration::from_millis(300)).await; // A's lease has expired
        let outcome = match outcome_kind {
            "park" => park(&x1),
            _ => retry(&x1, Duration::from_secs(3)),
        };
        // Hold X's row so that A's completion stops in the middle.
        let mut blocker = ctx.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE event_id = ? FOR UPDATE",
            ctx.table("outbox_events")
        ))
        .bind(x1.event_id.as_uuid())
        .execute(&mut *blocker)
        .await
        .unwrap();
        let completing = {
            let (a, handle) = (a.clone(), claimed.handle.clone());
            tokio::spawn(async move { a.complete(&handle, &[outcome]).await })
        };
        wait_until_blocked_on(&ctx.pool, &ctx.database).await;
        // B claims while A's completion is in progress. (It may return at once or wait behind
        // A; either way it must not end up with X.)
        let racing = {
            let b = b.clone();
            tokio::spawn(async move { claim(&b, "relay-b", 100).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        blocker.commit().await.unwrap();
        let during = racing.await.unwrap();
        assert!(
            during.is_empty(),
            "{outcome_kind}: relay B was handed {:?} while A's completion was in progress",
            versions(&during)
        );
        let rep = completing.await.unwrap().unwrap();
        assert_eq!((rep.applied, rep.superseded), (1, 0), "{outcome_kind}");
        let after = claim(&b, "relay-b", 100).await;
        assert!(
            after.is_empty(),
            "{outcome_kind}: X was handed out after its {outcome_kind}: {:?}",
            versions(&after)
        );
        if outcome_kind == "park" {
            assert_eq!(status(&ctx, &x1).await, "parked");
        } else {
            tokio::time::sleep(Duration::from_millis(3200)).await;
            let later = claim(&b, "relay-b", 100).await;
            assert_eq!(versions(&later), vec![("x".into(), 1)]);
            assert_eq!(later.records[0].attempts, 1);
        }
        ctx.drop().await;
    }
}
