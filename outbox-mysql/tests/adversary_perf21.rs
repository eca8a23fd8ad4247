//! Adversarial checks of the claim that reads each candidate's aggregate state in the same
//! statement (`sole`: no other pending row at or below its version, no parked row between the
//! last version and it; otherwise the per-aggregate head probes) and of the completion fence
//! on the lease's end (`claim_token` and `next_attempt_at` = the lease row's `until`), against
//! the real server: duplicates of a version in one batch, a parked copy below a pending copy,
//! a live token on a row the last version has passed, the table's only parked row, and a
//! relay of the previous version (its statements before migration 3) on a database clock
//! frozen at exactly the lease's end.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{Envelope, Outcome};
use outbox_mysql::MySqlOutboxStore;
use sqlx::MySqlPool;
use uuid::Uuid;

use common::lease::{fence_of, frozen_at, ids, park_a_copy_beside_its_uncommitted_twin, status_of};
use common::{claim, event, lease, park, published};

/// A relay of the previous version (before migration 3) on `pool` takes the row of `e` over
/// once its `next_attempt_at` has come (its lease in the state row, the row due again at the
/// lease's end) and then releases it (its release: the state-row lease ends, the row is due
/// now; it never reads nor writes `claim_token`). Returns whether the takeover found the row
/// due.
async fn old_takeover_then_release(ctx: &common::Ctx, pool: &MySqlPool, e: &Envelope) -> bool {
    let (a, ev) = (
        ctx.table("outbox_events_aggregate"),
        ctx.table("outbox_events"),
    );
    let token = Uuid::now_v7();
    let mut tx = pool.begin().await.unwrap();
    let n = sqlx::query(&format!(
        "UPDATE {a} s JOIN {ev} e ON e.aggregate_key = s.aggregate_key \
         SET s.lease_owner = 'relay-old', s.lease_token = ?, \
             s.lease_until = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND, s.lease_row = e.id, \
             e.next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 30 SECOND \
         WHERE e.event_id = ? AND e.status = 'pending' \
           AND e.next_attempt_at <= UTC_TIMESTAMP(6) \
           AND (s.lease_until IS NULL OR s.lease_until <= UTC_TIMESTAMP(6))"
    ))
    .bind(token)
    .bind(e.event_id.as_uuid())
    .execute(&mut *tx)
    .await
    .unwrap()
    .rows_affected();
    tx.commit().await.unwrap();
    if n == 0 {
        return false;
    }
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE {a} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
           lease_row = NULL WHERE aggregate_id = ? AND lease_token = ?"
    ))
    .bind(&e.aggregate_id)
    .bind(token)
    .execute(&mut *tx)
    .await
    .unwrap();
    sqlx::query(&format!(
        "UPDATE {ev} SET next_attempt_at = UTC_TIMESTAMP(6) \
         WHERE event_id = ? AND status = 'pending'"
    ))
    .bind(e.event_id.as_uuid())
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    true
}

/// The fence on the lease's end at the clock edge: a claim of this version (token T1, lease
/// end U written into the row) ends; a relay of the previous version whose database clock
/// reads exactly U (the row is due: `next_attempt_at <= now`) takes the row over and releases
/// it: the row carries T1 and `next_attempt_at` = U again, exactly what the claim wrote. The
/// claim taken over must still complete nothing. (On perf21 the completion applies: the fence
/// assumes every later writer writes a strictly later clock reading, which a clock reading U
/// again — a frozen or stepped-back clock, or two statements in one microsecond — breaks.)
///
/// Known limitation, documented in `docs/claims.md` ("Migrations beside running processes") and
/// the README's upgrade paragraph: ignored until the fence takes something an old relay always
/// changes (it reproduces the gap when run with `--ignored`).
#[tokio::test]
#[ignore = "known gap during a rolling upgrade from before migration 3 with a database clock that reads the lease's end again (frozen or stepped back): see docs/claims.md"]
async fn a_takeover_and_release_by_an_old_relay_at_exactly_the_lease_end_fences_the_claim() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let e = event("a", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let new = claim(&s, "relay-new", 10).await;
    assert_eq!(ids(&new), vec![e.event_id]);
    let (t1, until) = fence_of(&ctx, &e).await;
    let old = frozen_at(until).await;
    assert!(
        old_takeover_then_release(&ctx, &old, &e).await,
        "the row is due at its lease's end"
    );
    assert_eq!(
        fence_of(&ctx, &e).await,
        (t1, until),
        "the row is back as claimed"
    );
    let rep = s.complete(&new.handle, &[published(&e, 1)]).await.unwrap();
    assert_eq!(
        rep.applied, 0,
        "the claim taken over by the old relay completed: {rep:?}"
    );
    assert_eq!(status_of(&ctx, &e).await.0, "pending");
    old.close().await;
    ctx.drop().await;
}

/// Two copies of version 1 in one batch's candidates (neither is `sole`: each sees the other
/// at its version): only the first in (version, id) is handed out, the other is parked out of
/// order once the first is published; version 2 follows. (Seen failing with `AND w.id IS
/// NULL` removed from `sole`: both copies were handed out in one batch.)
#[tokio::test]
async fn two_copies_of_a_version_in_one_batch_hand_out_one() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let (c1, c2, v2) = (event("a", 1), event("a", 1), event("a", 2));
    common::append(&ctx, &s, std::slice::from_ref(&c1)).await;
    common::append(&ctx, &s, std::slice::from_ref(&c2)).await;
    let one = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&one), vec![c1.event_id], "one copy of version 1");
    common::append(&ctx, &s, std::slice::from_ref(&v2)).await;
    let two = claim(&s, "relay-2", 10).await;
    assert!(two.records.is_empty(), "handed out {:?}", ids(&two));
    common::publish_all(&s, &one).await;
    let three = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&three), vec![v2.event_id]);
    assert_eq!(
        status_of(&ctx, &c2).await,
        ("parked".to_string(), Some("out_of_order".to_string()))
    );
    ctx.drop().await;
}

/// A parked copy of version 2 (lower id) below a pending copy of version 2 that committed
/// later, the table's only parked row: the pending copy is not its aggregate's head while the
/// parked copy is unresolved (the parked-row probe of `sole`, switched on by this one row).
/// (Seen failing with the parked-row probe removed from `sole`: the later copy was handed out
/// beside the parked version.)
#[tokio::test]
async fn a_pending_copy_behind_the_tables_only_parked_copy_waits() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let (v1, p2, c2) = (event("a", 1), event("a", 2), event("a", 2));
    common::append(&ctx, &s, std::slice::from_ref(&v1)).await;
    let b = claim(&s, "relay-1", 10).await;
    common::publish_all(&s, &b).await;
    // The copy to be parked is inserted and committed first (the lower id).
    common::append(&ctx, &s, std::slice::from_ref(&p2)).await;
    let b = claim(&s, "relay-1", 10).await;
    assert_eq!(ids(&b), vec![p2.event_id]);
    let rep = s.complete(&b.handle, &[park(&p2)]).await.unwrap();
    assert_eq!(rep.applied, 1);
    common::append(&ctx, &s, std::slice::from_ref(&c2)).await;
    // Other aggregates move on beside it.
    let o = event("other", 1);
    common::append(&ctx, &s, std::slice::from_ref(&o)).await;
    let b = claim(&s, "relay-2", 10).await;
    assert_eq!(
        ids(&b),
        vec![o.event_id],
        "the copy behind the parked version 2 was handed out: {:?}",
        common::versions(&b)
    );
    ctx.drop().await;
}

/// A live token on a row the last version has passed: version 1 leased (the lower-id copy,
/// committed after the other copy was parked), the parked copy discarded (the last version
/// becomes 1), version 2 appended afterwards, never blocked, and a third aggregate's row in
/// the same batch. Version 2 is not `sole` (the leased row is pending at or below it) and
/// waits until version 1 is published. (Seen failing with the pending left join removed from
/// `sole`: version 2 was handed out beside the leased version 1.)
#[tokio::test]
async fn a_live_token_below_the_last_version_holds_the_next_version() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let (copy, leased, v2) = (event("a", 1), event("a", 1), event("a", 2));
    park_a_copy_beside_its_uncommitted_twin(&ctx, &s, &copy, &leased).await;
    let one = claim(&s, "relay-2", 10).await;
    assert_eq!(ids(&one), vec![leased.event_id]);
    s.discard_parked(copy.event_id, "ops", "a duplicate")
        .await
        .unwrap();
    common::append(&ctx, &s, std::slice::from_ref(&v2)).await;
    let o = event("other", 1);
    common::append(&ctx, &s, std::slice::from_ref(&o)).await;
    let two = claim(&s, "relay-3", 10).await;
    assert_eq!(
        ids(&two),
        vec![o.event_id],
        "version 2 handed out while version 1 is leased: {:?}",
        common::versions(&two)
    );
    common::publish_all(&s, &one).await;
    let next = claim(&s, "relay-3", 10).await;
    assert_eq!(ids(&next), vec![v2.event_id]);
    ctx.drop().await;
}

/// A store of another instance (no memory of the claim) completes a lease claim through the
/// lease row's `until`, read back from the database: the value written into the rows must
/// round-trip exactly (microseconds) or the completion applies nothing. Then a stale second
/// completion applies nothing.
#[tokio::test]
async fn another_instance_completes_through_the_lease_rows_until() {
    let ctx = ctx!(6);
    let s = ctx.store(lease(30.0)).await;
    let other: MySqlOutboxStore = ctx.store(lease(30.0)).await;
    let es: Vec<Envelope> = (1..=3).map(|i| event(&format!("k{i}"), 1)).collect();
    common::append(&ctx, &s, &es).await;
    let b = claim(&s, "relay-1", 10).await;
    assert_eq!(b.records.len(), 3);
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = other.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 3, "{rep:?}");
    let rep = s.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    tokio::time::sleep(Duration::from_millis(1)).await;
    ctx.drop().await;
}
