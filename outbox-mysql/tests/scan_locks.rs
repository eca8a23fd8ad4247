//! The claim's candidate scan (seventh pass of issue 21): it locks only the rows it takes, so a
//! claim passing over rows in flight does not hold up their completion; claims racing for the
//! same rows still fill their batches with the rows the others left; the ranges of this
//! instance's own claims in flight that the scan passes over hide nothing else.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope};
use sqlx::Executor;

use common::{claim, event, lease, versions};

/// Waits until this test's database has a statement inserting state rows that has run for
/// 300 ms (the claim waits there on an uncommitted insert of the same state row); `false`
/// when `done` finished first.
async fn insert_waits(ctx: &common::Ctx, done: &tokio::task::JoinHandle<impl Send>) -> bool {
    let pattern = format!("INSERT INTO `{}`.`outbox_events_aggregate`%", ctx.database);
    for _ in 0..2000 {
        if done.is_finished() {
            return false;
        }
        let n: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST \
             WHERE INFO LIKE ? AND TIME_MS > 300",
        )
        .bind(&pattern)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if n > 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the claim neither finished nor waited on an insert within 20 s");
}

/// The row id of `agg` version `v`.
async fn id_of(ctx: &common::Ctx, agg: &str, v: i64) -> i64 {
    sqlx::query_scalar(&format!(
        "SELECT id FROM {} WHERE aggregate_id = ? AND aggregate_version = ?",
        ctx.table("outbox_events")
    ))
    .bind(agg)
    .bind(v)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A claim in the middle of its transaction holds no lock on the rows in flight it passed
/// over: another relay's batch is in flight (lease mode), and a second claim meets those rows
/// first in id order, then a row of a new aggregate, whose state-row insert waits on an
/// uncommitted insert of the same row (another claim's). While it waits, each row in flight can
/// be locked at once (as the completion of that batch locks them to mark them published).
/// (Seen failing with the single locking scan, `.. ORDER BY id LIMIT n FOR UPDATE SKIP
/// LOCKED`: the rows it passed over stayed locked until its transaction ended, and `NOWAIT`
/// failed on the first of them.)
#[tokio::test]
async fn a_claim_holds_no_lock_on_the_rows_in_flight_it_passed_over() {
    let ctx = ctx!(8);
    let first = ctx.store(lease(30.0)).await;
    let second = ctx.store(lease(30.0)).await;
    let flying: Vec<Envelope> = (0..5).map(|i| event(&format!("fly{i}"), 1)).collect();
    common::append(&ctx, &first, &flying).await;
    let newcomer = event("newcomer", 1);
    common::append(&ctx, &first, std::slice::from_ref(&newcomer)).await;
    // The first relay's batch: the five rows before the newcomer's, in flight.
    let batch = claim(&first, "relay-a", 5).await;
    assert_eq!(batch.records.len(), 5);
    // Another claim's uncommitted insert of the newcomer's state row.
    let mut inserter = ctx.pool.acquire().await.unwrap();
    inserter
        .execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
         SELECT aggregate_key, aggregate_type, aggregate_id, UTC_TIMESTAMP(6) \
         FROM {} WHERE aggregate_id = 'newcomer'",
        ctx.table("outbox_events_aggregate"),
        ctx.table("outbox_events")
    ))
    .execute(&mut *inserter)
    .await
    .unwrap();
    let s = second.clone();
    let task = tokio::spawn(async move { claim(&s, "relay-b", 10).await });
    assert!(
        insert_waits(&ctx, &task).await,
        "the second claim did not wait on the newcomer's state row"
    );
    // The second claim's transaction is open and has scanned: the rows in flight are free.
    for i in 0..5 {
        let id = id_of(&ctx, &format!("fly{i}"), 1).await;
        let mut tx = ctx.pool.begin().await.unwrap();
        let locked: Result<Option<i64>, _> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} WHERE id = ? FOR UPDATE NOWAIT",
            ctx.table("outbox_events")
        ))
        .bind(id)
        .fetch_optional(&mut *tx)
        .await;
        assert!(
            matches!(locked, Ok(Some(_))),
            "row in flight fly{i} is locked by the claim that passed over it: {locked:?}"
        );
        tx.rollback().await.unwrap();
    }
    inserter.execute("ROLLBACK").await.unwrap();
    drop(inserter);
    let took = task.await.unwrap();
    assert_eq!(versions(&took), vec![("newcomer".to_string(), 1)]);
    ctx.drop().await;
}

/// Claims racing for the same candidates still fill their batches: another claim holds the
/// first three candidates (uncommitted), so a claim of five that found them first takes the
/// five after them, not the two of its first five that were left. (Seen failing without the
/// locking scan after the plain read came up short: the claim took two rows.)
#[tokio::test]
async fn a_claim_whose_candidates_another_claim_took_fills_its_batch_after_them() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let store = ctx.store(mode).await;
        let events: Vec<Envelope> = (0..10).map(|i| event(&format!("agg{i}"), 1)).collect();
        common::append(&ctx, &store, &events).await;
        // Another claim's scan: the first three candidates, locked and not committed.
        let mut other = ctx.pool.acquire().await.unwrap();
        other
            .execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
            .await
            .unwrap();
        let held: Vec<i64> = sqlx::query_scalar(&format!(
            "SELECT id FROM {} ORDER BY id LIMIT 3 FOR UPDATE",
            ctx.table("outbox_events")
        ))
        .fetch_all(&mut *other)
        .await
        .unwrap();
        assert_eq!(held.len(), 3);
        let batch = claim(&store, "relay", 5).await;
        let want: Vec<(String, i64)> = (3..8).map(|i| (format!("agg{i}"), 1)).collect();
        let mut got = versions(&batch);
        got.sort_by_key(|(a, _)| a[3..].parse::<i64>().unwrap());
        assert_eq!(got, want, "{mode:?}");
        other.execute("ROLLBACK").await.unwrap();
        drop(other);
        if mode == ClaimMode::LockedTransaction {
            store.release(&batch.handle).await.unwrap();
        }
        ctx.drop().await;
    }
}

/// The scan passes over the ids of this instance's own claims in flight, and over nothing
/// else: with two batches in flight (twenty rows each, in ranges of consecutive ids), the next
/// claims of the same instance take the row right after each batch and the rows between them.
/// (Seen failing with the passed-over ranges one id too long: the row after the first batch
/// was left out.)
#[tokio::test]
async fn own_batches_in_flight_hide_only_their_own_rows() {
    let ctx = ctx!(8);
    let store = ctx.store(lease(30.0)).await;
    let events: Vec<Envelope> = (0..45).map(|i| event(&format!("agg{i}"), 1)).collect();
    common::append(&ctx, &store, &events).await;
    let a = claim(&store, "relay", 20).await;
    assert_eq!(a.records.len(), 20);
    // A row between the two batches, released: due again while both batches are in flight.
    let gap = claim(&store, "relay", 1).await;
    assert_eq!(versions(&gap), vec![("agg20".to_string(), 1)]);
    let b = claim(&store, "relay", 20).await;
    assert_eq!(b.records.len(), 20);
    store.release(&gap.handle).await.unwrap();
    // Left: agg20 (released, between the batches) and agg41..agg44 (after the second).
    let rest = claim(&store, "relay", 10).await;
    let mut got: Vec<String> = versions(&rest).into_iter().map(|(a, _)| a).collect();
    got.sort();
    assert_eq!(got, vec!["agg20", "agg41", "agg42", "agg43", "agg44"]);
    assert!(claim(&store, "relay", 10).await.records.is_empty());
    ctx.drop().await;
}
