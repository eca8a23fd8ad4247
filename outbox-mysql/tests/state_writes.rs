//! The state-row writes of a completion (the new last versions, one multi-row upsert of the
//! aggregates' state rows) refuse to run on a state row that is missing, instead of creating
//! one; a lease claim writes no state row (its lease is on the claimed event rows, since
//! migration 3). A state row cannot go missing under the locks the store takes; these tests
//! remove it from inside the store's own transaction (a trigger) to reach that path.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use outbox_core::prelude::*;
use outbox_core::{ClaimRequest, Outcome};

use common::{claim, event, lease, published, versions};

/// Installs `trigger` (an `AFTER UPDATE` on the events table deleting the updated row's state
/// row when `when` holds for it).
async fn delete_state_on(ctx: &common::Ctx, name: &str, when: &str) {
    sqlx::raw_sql(&format!(
        "CREATE TRIGGER `{db}`.`{name}` AFTER UPDATE ON {events} FOR EACH ROW \
         DELETE FROM {state} WHERE aggregate_key = NEW.aggregate_key AND ({when})",
        db = ctx.database,
        events = ctx.table("outbox_events"),
        state = ctx.table("outbox_events_aggregate"),
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

async fn drop_trigger(ctx: &common::Ctx, name: &str) {
    sqlx::raw_sql(&format!("DROP TRIGGER `{}`.`{name}`", ctx.database))
        .execute(&ctx.pool)
        .await
        .unwrap();
}

/// (state rows, event rows under a live lease claim, state rows named '').
async fn state_counts(ctx: &common::Ctx) -> (i64, i64, i64) {
    sqlx::query_as(&format!(
        "SELECT COUNT(*), \
                (SELECT COUNT(*) FROM {} WHERE claim_token <> X'00000000000000000000000000000000' \
                   AND status = 'pending' AND next_attempt_at > UTC_TIMESTAMP(6)), \
                COUNT(CASE WHEN aggregate_id = '' THEN 1 END) \
         FROM {}",
        ctx.table("outbox_events"),
        ctx.table("outbox_events_aggregate")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A claim whose state row of a claimed head disappears before the lease is written hands the
/// head out with its lease on the event row (a lease claim writes no state row, so none is
/// created); the completion, whose last-version write finds the state row missing, fails and
/// rolls back. (Before migration 3 the claim wrote the lease into the state row and this
/// claim failed; seen failing with the completion's row-count check removed: the upsert
/// created a nameless state row and reported the publication applied.)
#[tokio::test]
async fn a_claim_whose_state_row_disappears_writes_none_and_its_completion_fails() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(30.0)).await;
    let evs = vec![event("a", 1), event("a", 2), event("b", 1)];
    common::append(&ctx, &s, &evs).await;
    // `a` v2 follows `a` v1: the claim blocks it, which deletes `a`'s state row inside the
    // claim's transaction, after the lock and before the lease write.
    delete_state_on(
        &ctx,
        "drop_state_on_block",
        "NEW.blocked = 1 AND OLD.blocked = 0",
    )
    .await;
    let batch = s.claim(&ClaimRequest::new("relay", 10)).await.unwrap();
    drop_trigger(&ctx, "drop_state_on_block").await;
    assert_eq!(
        versions(&batch),
        vec![("a".to_string(), 1), ("b".to_string(), 1)]
    );
    // `a`'s state row is gone, none was created; both heads are leased on their rows.
    assert_eq!(state_counts(&ctx).await, (1, 2, 0));
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let err = s
        .complete(&batch.handle, &outs)
        .await
        .expect_err("a completion whose state row went missing must fail");
    assert!(
        err.message.contains("state row was missing"),
        "{}",
        err.message
    );
    assert_eq!(state_counts(&ctx).await, (1, 2, 0), "rolled back whole");
    ctx.drop().await;
}

/// A completion whose state row disappears before the leases end fails and rolls back: the
/// publication is not recorded, no state row is created by the write; run again on the
/// restored state it applies. (Seen failing with the previous lease end, one `UPDATE` joined
/// with the aggregates: it skipped the missing row and reported the publication applied.)
#[tokio::test]
async fn ending_a_lease_missing_its_state_row_fails_the_completion() {
    let ctx = ctx!(4);
    let s = ctx.store(lease(30.0)).await;
    let evs = vec![event("a", 1), event("b", 1)];
    common::append(&ctx, &s, &evs).await;
    let batch = claim(&s, "relay", 10).await;
    assert_eq!(batch.records.len(), 2);
    delete_state_on(
        &ctx,
        "drop_state_on_publish",
        "NEW.status = 'published' AND OLD.status = 'pending' AND NEW.aggregate_id = 'a'",
    )
    .await;
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let err = s
        .complete(&batch.handle, &outs)
        .await
        .expect_err("a completion whose state row went missing must fail");
    assert!(
        err.message.contains("state row was missing"),
        "{}",
        err.message
    );
    let pending: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE status = 'pending'",
        ctx.table("outbox_events")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(pending, 2, "nothing recorded");
    assert_eq!(
        state_counts(&ctx).await,
        (2, 2, 0),
        "leases kept, no row added"
    );
    drop_trigger(&ctx, "drop_state_on_publish").await;
    let rep = s.complete(&batch.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 2);
    assert_eq!(state_counts(&ctx).await, (2, 0, 0));
    ctx.drop().await;
}

/// Locked mode: a completion whose state row disappears before the last versions are written
/// fails and rolls the claim back: the publication is not recorded, no state row is created
/// by the write, and the rows are claimed again. (Seen failing with the previous write, one
/// `UPDATE` joined with the last versions: it skipped the missing row and reported the
/// publication applied.)
#[tokio::test]
async fn a_locked_completion_missing_its_state_row_fails() {
    let ctx = ctx!(4);
    let s = ctx.store(outbox_core::ClaimMode::LockedTransaction).await;
    let evs = vec![event("a", 1), event("b", 1)];
    common::append(&ctx, &s, &evs).await;
    // Installed before the claim: a trigger waits for the metadata lock of the table, which
    // the locked claim's open transaction holds.
    delete_state_on(
        &ctx,
        "drop_state_on_publish",
        "NEW.status = 'published' AND OLD.status = 'pending' AND NEW.aggregate_id = 'a'",
    )
    .await;
    let batch = claim(&s, "relay", 10).await;
    assert_eq!(batch.records.len(), 2);
    let outs: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let err = s
        .complete(&batch.handle, &outs)
        .await
        .expect_err("a completion whose state row went missing must fail");
    assert!(
        err.message.contains("state row was missing"),
        "{}",
        err.message
    );
    drop_trigger(&ctx, "drop_state_on_publish").await;
    // The claim's connection is closed: once the server has rolled it back, its rows are
    // claimed again, unpublished, and the state rows are as before.
    let mut again = Vec::new();
    for _ in 0..100 {
        let b = claim(&s, "relay", 10).await;
        if !b.records.is_empty() {
            again = versions(&b);
            s.release(&b.handle).await.unwrap();
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(again, vec![("a".to_string(), 1), ("b".to_string(), 1)]);
    let (rows, _, nameless) = state_counts(&ctx).await;
    assert_eq!((rows, nameless), (2, 0));
    ctx.drop().await;
}
