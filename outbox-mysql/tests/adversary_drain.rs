//! Adversarial checks of the MySQL/MariaDB store's lock-first claim and its one-statement
//! lease write, head probes and completions (the `mysql-drain` rewrite), against the real
//! server: interleavings forced with held transactions on other connections, waited for in
//! `information_schema`.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope};
use sqlx::Executor;

use common::{claim, event, lease, published};

/// `maybe_delivered` of an event's row.
async fn maybe_delivered(ctx: &common::Ctx, e: &Envelope) -> bool {
    sqlx::query_scalar::<_, bool>(&format!(
        "SELECT maybe_delivered FROM {} WHERE event_id = ?",
        ctx.table("outbox_events")
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A lease that ended without outcome or release may have sent its row: the claim that takes
/// the row over hands it out as maybe sent before and records that in the row (the lease
/// write's `resend` column), so it stays known after that claim is released.
#[tokio::test]
async fn a_taken_over_lease_marks_the_row_maybe_delivered_for_good() {
    let ctx = ctx!(6);
    let a = ctx.store(lease(0.3)).await;
    let b = ctx.store(lease(30.0)).await;
    let e = event("resend", 1);
    common::append(&ctx, &a, std::slice::from_ref(&e)).await;
    let first = claim(&a, "relay-a", 10).await;
    assert_eq!(first.records.len(), 1);
    assert!(!first.records[0].maybe_sent_before);
    assert!(!maybe_delivered(&ctx, &e).await);
    tokio::time::sleep(Duration::from_millis(500)).await; // A's lease expired
    let taken = claim(&b, "relay-b", 10).await;
    assert_eq!(taken.records.len(), 1);
    assert!(
        taken.records[0].maybe_sent_before,
        "the expired lease named the row: it may have been sent"
    );
    assert!(
        maybe_delivered(&ctx, &e).await,
        "the takeover's lease write records it in the row"
    );
    // Released: the lease no longer names the row; the row still says it.
    b.release(&taken.handle).await.unwrap();
    let again = claim(&b, "relay-b", 10).await;
    assert_eq!(again.records.len(), 1);
    assert!(again.records[0].maybe_sent_before, "kept after a release");
    // A plain claim of a fresh row does not mark it.
    let f = event("fresh", 1);
    common::append(&ctx, &a, std::slice::from_ref(&f)).await;
    let fresh = claim(&b, "relay-b", 10).await;
    assert_eq!(fresh.records.len(), 1);
    assert!(!fresh.records[0].maybe_sent_before);
    assert!(!maybe_delivered(&ctx, &f).await);
    ctx.drop().await;
}

/// Waits until this test's database has a statement inserting state rows that has run for
/// 300 ms (waiting on a lock: MariaDB 10.11 lists such a wait in neither `INNODB_LOCK_WAITS`
/// nor `INNODB_TRX`); `false` when `done` finished first.
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

/// Relays racing to create the same missing state rows: three other claims have each
/// inserted the state row of one new aggregate and not committed yet, while this claim meets
/// rows of all three. Its insert waits on each in turn, and each commits while it waits
/// (every wait ends in a duplicate key). The claim must take the three aggregates, not fail
/// with the duplicate of the last one.
#[tokio::test]
async fn a_claim_racing_three_inserters_of_its_missing_state_rows_succeeds() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(10);
        let store = ctx.store(mode).await;
        let aggs = ["race1", "race2", "race3"];
        let events: Vec<Envelope> = aggs.iter().map(|a| event(a, 1)).collect();
        common::append(&ctx, &store, &events).await;
        // The other claims: one uncommitted insert of a state row each.
        let mut held = Vec::new();
        for agg in aggs {
            let mut conn = ctx.pool.acquire().await.unwrap();
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
                .await
                .unwrap();
            sqlx::query(&format!(
                "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
                 SELECT aggregate_key, aggregate_type, aggregate_id, UTC_TIMESTAMP(6) \
                 FROM {} WHERE aggregate_id = ?",
                ctx.table("outbox_events_aggregate"),
                ctx.table("outbox_events")
            ))
            .bind(agg)
            .execute(&mut *conn)
            .await
            .unwrap();
            let key: Vec<u8> = sqlx::query_scalar(&format!(
                "SELECT aggregate_key FROM {} WHERE aggregate_id = ?",
                ctx.table("outbox_events")
            ))
            .bind(agg)
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
            held.push((key, conn));
        }
        // The claim inserts in key order, so it waits on the inserters in that order.
        held.sort_by(|a, b| a.0.cmp(&b.0));
        let s = store.clone();
        let task =
            tokio::spawn(
                async move { s.claim(&outbox_core::ClaimRequest::new("relay", 10)).await },
            );
        // Commit each inserter while the claim waits on it.
        let mut commits = 0;
        let mut open = held.into_iter();
        while insert_waits(&ctx, &task).await {
            let (_, mut conn) = open.next().expect("a wait on an inserter");
            conn.execute("COMMIT").await.unwrap();
            commits += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Inserters the claim did not wait on are closed (the server rolls them back).
        open.for_each(|(_, conn)| drop(conn.detach()));
        let batch = task
            .await
            .unwrap()
            .expect("a claim racing other claims' inserts of its state rows");
        assert_eq!(commits, 3, "the claim waited on each inserter");
        assert_eq!(
            common::versions(&batch),
            vec![
                ("race1".to_owned(), 1),
                ("race2".to_owned(), 1),
                ("race3".to_owned(), 1)
            ]
        );
        common::publish_all(&store, &batch).await;
        ctx.drop().await;
    }
}

/// The head probes' numbers near `i64::MAX` (read through `JSON_ARRAY` and written through
/// `JSON_TABLE` `BIGINT` columns): an aggregate whose first version is `i64::MAX - 2`
/// (`accept_first_version`) is delivered in order up to `i64::MAX`, with a duplicate of the
/// last version parked as out of order.
#[tokio::test]
async fn versions_near_i64_max_are_delivered_in_order() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(6);
        let store = ctx
            .builder(mode)
            .accept_first_version(true)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let top = i64::MAX;
        let events: Vec<Envelope> = [top, top - 1, top - 2]
            .iter()
            .map(|v| event("huge", *v))
            .collect();
        common::append(&ctx, &store, &events).await;
        for want in [top - 2, top - 1, top] {
            let batch = claim(&store, "relay", 10).await;
            assert_eq!(
                common::versions(&batch),
                vec![("huge".to_owned(), want)],
                "{mode:?}"
            );
            common::publish_all(&store, &batch).await;
        }
        let dup = event("huge", top);
        common::append(&ctx, &store, std::slice::from_ref(&dup)).await;
        let batch = claim(&store, "relay", 10).await;
        assert!(batch.records.is_empty(), "{:?}", common::versions(&batch));
        assert_eq!(batch.parked.len(), 1, "the duplicate is parked");
        ctx.drop().await;
    }
}

/// A lease release after a publication keeps the aggregate's last version (the joined state
/// update writes `COALESCE(new, last_version)` and a release passes no new one), and a
/// replayed completion changes nothing.
#[tokio::test]
async fn release_and_replayed_completion_keep_the_last_version() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(30.0)).await;
    let v1 = event("keep", 1);
    let v2 = event("keep", 2);
    common::append(&ctx, &store, &[v1.clone(), v2.clone()]).await;
    let b1 = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&b1), vec![("keep".to_owned(), 1)]);
    let outs = vec![published(&b1.records[0].envelope, 7)];
    assert_eq!(store.complete(&b1.handle, &outs).await.unwrap().applied, 1);
    // Replayed: refused, nothing moves.
    let rep = store.complete(&b1.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (0, 1));
    let b2 = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&b2), vec![("keep".to_owned(), 2)]);
    store.release(&b2.handle).await.unwrap();
    let last: Option<i64> = sqlx::query_scalar(&format!(
        "SELECT last_version FROM {} WHERE aggregate_id = 'keep'",
        ctx.table("outbox_events_aggregate")
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(last, Some(1), "a release keeps the last version");
    let b3 = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&b3), vec![("keep".to_owned(), 2)]);
    common::publish_all(&store, &b3).await;
    // v1 again (a duplicate of a published version) is parked, not sent.
    let dup = event("keep", 1);
    common::append(&ctx, &store, std::slice::from_ref(&dup)).await;
    let b4 = claim(&store, "relay", 10).await;
    assert!(b4.records.is_empty());
    assert_eq!(b4.parked.len(), 1);
    ctx.drop().await;
}

/// Lock first: an aggregate whose state row another transaction holds (another relay's claim
/// or completion) is skipped at once, not waited for, while the claim's other aggregates
/// (one met before, one new) are claimed; once the holder ends, the skipped one is claimed.
#[tokio::test]
async fn a_state_row_held_elsewhere_is_skipped_not_waited_for() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let store = ctx.store(mode).await;
        common::append(&ctx, &store, &[event("held", 1), event("seen", 1)]).await;
        // Both state rows exist now (a claim created them); the claim is released.
        let first = claim(&store, "relay", 10).await;
        assert_eq!(first.records.len(), 2);
        store.release(&first.handle).await.unwrap();
        common::append(&ctx, &store, &[event("new", 1)]).await;
        let mut holder = ctx.pool.acquire().await.unwrap();
        holder
            .execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
            .await
            .unwrap();
        sqlx::query(&format!(
            "SELECT aggregate_key FROM {} WHERE aggregate_id = 'held' FOR UPDATE",
            ctx.table("outbox_events_aggregate")
        ))
        .fetch_all(&mut *holder)
        .await
        .unwrap();
        let started = std::time::Instant::now();
        let batch = tokio::time::timeout(Duration::from_secs(10), claim(&store, "relay", 10))
            .await
            .expect("the claim waited on a held state row");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(
            common::versions(&batch),
            vec![("new".to_owned(), 1), ("seen".to_owned(), 1)],
            "{mode:?}"
        );
        common::publish_all(&store, &batch).await;
        holder.execute("COMMIT").await.unwrap();
        drop(holder);
        let rest = claim(&store, "relay", 10).await;
        assert_eq!(common::versions(&rest), vec![("held".to_owned(), 1)]);
        common::publish_all(&store, &rest).await;
        ctx.drop().await;
    }
}

/// Locked claims completing at once on a small table (statistics fresh from `ANALYZE
/// TABLE`, so the optimizer would scan it whole): each completion's joined `UPDATE`s must
/// touch only its own aggregates' rows, or the two wait on each other's state rows (1213,
/// one claim rolled back). Several rounds, every aggregate published in order once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_completions_on_a_small_table_do_not_deadlock() {
    small_table_rounds(8).await;
}

/// The same with one version per aggregate (an event table as small as the state table),
/// several times over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_completions_on_a_tiny_event_table_do_not_deadlock() {
    for _ in 0..5 {
        small_table_rounds(1).await;
    }
}

async fn small_table_rounds(rounds: i64) {
    let ctx = ctx!(12);
    let a = ctx.store(ClaimMode::LockedTransaction).await;
    let b = ctx.store(ClaimMode::LockedTransaction).await;
    const AGGS: usize = 12;
    let events: Vec<Envelope> = (1..=rounds)
        .flat_map(|v| (0..AGGS).map(move |i| event(&format!("small{i:02}"), v)))
        .collect();
    common::append(&ctx, &a, &events).await;
    for round in 1..=rounds {
        for t in ["outbox_events", "outbox_events_aggregate"] {
            sqlx::query(&format!("ANALYZE TABLE {}", ctx.table(t)))
                .execute(&ctx.pool)
                .await
                .unwrap();
        }
        let ca = claim(&a, "relay-a", AGGS / 2).await;
        let cb = claim(&b, "relay-b", AGGS).await;
        assert_eq!(
            ca.records.len() + cb.records.len(),
            AGGS,
            "round {round}: every aggregate's head claimed once"
        );
        let outs = |batch: &outbox_core::ClaimedBatch| -> Vec<outbox_core::Outcome> {
            batch
                .records
                .iter()
                .map(|r| published(&r.envelope, r.envelope.aggregate_version))
                .collect()
        };
        let (oa, ob) = (outs(&ca), outs(&cb));
        let (ra, rb) = tokio::join!(a.complete(&ca.handle, &oa), b.complete(&cb.handle, &ob));
        let (ra, rb) = (
            ra.unwrap_or_else(|e| panic!("round {round}: A's completion: {e:?}")),
            rb.unwrap_or_else(|e| panic!("round {round}: B's completion: {e:?}")),
        );
        assert_eq!(ra.applied + rb.applied, AGGS, "round {round}");
        for r in ca.records.iter().chain(&cb.records) {
            assert_eq!(r.envelope.aggregate_version, round);
        }
    }
    ctx.drop().await;
}

/// An aggregate with no last version whose only unfinished row is parked
/// (`accept_first_version`, first version 5 parked by its relay): a later version waits
/// behind it (the head probe reads the parked row), and after the operator retries the
/// parked one both go out in order.
#[tokio::test]
async fn a_parked_first_version_without_a_last_version_holds_its_followers() {
    use outbox_core::OperatorStore;
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(6);
        let store = ctx
            .builder(mode)
            .accept_first_version(true)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let v5 = event("only-parked", 5);
        common::append(&ctx, &store, std::slice::from_ref(&v5)).await;
        let b = claim(&store, "relay", 10).await;
        assert_eq!(common::versions(&b), vec![("only-parked".to_owned(), 5)]);
        let rep = store
            .complete(&b.handle, &[common::park(&b.records[0].envelope)])
            .await
            .unwrap();
        assert_eq!(rep.applied, 1);
        let v6 = event("only-parked", 6);
        common::append(&ctx, &store, std::slice::from_ref(&v6)).await;
        let held = claim(&store, "relay", 10).await;
        assert!(
            held.records.is_empty(),
            "{mode:?}: v6 waits behind the parked v5: {:?}",
            common::versions(&held)
        );
        assert!(held.parked.is_empty(), "{:?}", held.parked);
        store.retry_parked(v5.event_id, "ops").await.unwrap();
        for want in [5, 6] {
            let b = claim(&store, "relay", 10).await;
            assert_eq!(
                common::versions(&b),
                vec![("only-parked".to_owned(), want)],
                "{mode:?}"
            );
            common::publish_all(&store, &b).await;
        }
        ctx.drop().await;
    }
}
