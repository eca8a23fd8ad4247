//! Run claims on PostgreSQL (issue 25, `docs/design/hot-aggregate.md`, *Run claims*): after
//! an aggregate's head a claim hands out the next consecutive versions of the aggregate under
//! the head's claim, and the completion applies a published prefix of them.
//!
//! Each rule in both claim modes where it applies: what a run is (consecutive from the head,
//! ended by a gap, a duplicate version, a parked or a not-due row), its place in the batch and
//! against the limit, the completion's prefix rule and its release of the rest, and what counts
//! whole runs (stats, release, an operator's release, a claim after an expired lease, the
//! completion by another store instance).

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::RelayRegistry;
use outbox_core::{ClaimMode, ClaimedBatch, Envelope, EventId};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run, run_layout as run_of};

use common::{event, lease, published, retry, Ctx};

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

async fn append(ctx: &Ctx, store: &PostgresOutboxStore, events: &[Envelope]) {
    store.append_many(&ctx.pool, events).await.unwrap();
}

async fn exec(ctx: &Ctx, sql: &str) {
    sqlx::query(&sql.replace("{s}", &ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();
}

async fn finish(store: &PostgresOutboxStore, batch: &ClaimedBatch) {
    store.release(&batch.handle).await.unwrap();
}

/// A run is consecutive from the head and ends before a missing version; a claim without
/// `run` hands out the head alone, as before runs.
#[tokio::test]
async fn a_run_is_consecutive_from_the_head_and_stops_at_a_gap() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = ctx.store(mode).await;
        let evs: Vec<_> = [1, 2, 3, 5, 6].iter().map(|v| event("a", *v)).collect();
        append(&ctx, &store, &evs).await;
        let heads = claim_run(&store, "relay", 10, 1).await;
        assert_eq!(layout(&heads), run_of("a", 1..=1), "{mode:?}");
        finish(&store, &heads).await;
        let b = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&b), run_of("a", 1..=3), "{mode:?}");
        assert!(b.records.iter().all(|r| !r.is_resend()), "{mode:?}");
        finish(&store, &b).await;
        ctx.drop().await;
    }
}

/// A second row of one version ends the run before that version; a parked row and a row
/// that is not due end it before themselves.
#[tokio::test]
async fn a_duplicate_a_parked_or_a_not_due_row_ends_the_run() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = ctx.store(mode).await;
        let mut evs: Vec<_> = (1..=4).map(|v| event("dup", v)).collect();
        evs.push(event("dup", 3));
        evs.extend((1..=4).map(|v| event("parked", v)));
        evs.extend((1..=4).map(|v| event("later", v)));
        append(&ctx, &store, &evs).await;
        exec(
            &ctx,
            "UPDATE \"{s}\".outbox_events SET status = 'parked', parked_at = now(), \
             park_kind = 'permanent_error' WHERE aggregate_id = 'parked' AND aggregate_version = 3",
        )
        .await;
        exec(
            &ctx,
            "UPDATE \"{s}\".outbox_events SET next_attempt_at = now() + interval '1 hour' \
             WHERE aggregate_id = 'later' AND aggregate_version = 4",
        )
        .await;
        let b = claim_run(&store, "relay", 100, 10).await;
        let mut want = run_of("dup", 1..=2);
        want.extend(run_of("parked", 1..=2));
        want.extend(run_of("later", 1..=3));
        assert_eq!(layout(&b), want, "{mode:?}");
        finish(&store, &b).await;
        ctx.drop().await;
    }
}

/// A run's rows count against the limit, after every head of the claim: heads first, then the
/// runs fill what is left, each run right after its head.
#[tokio::test]
async fn run_rows_count_against_the_limit_after_the_heads() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = ctx.store(mode).await;
        let mut evs: Vec<_> = (1..=6).map(|v| event("a", v)).collect();
        evs.extend((1..=3).map(|v| event("b", v)));
        evs.push(event("c", 1));
        append(&ctx, &store, &evs).await;
        // A first claim blocks the followers it meets: the next claim's window holds the
        // three heads.
        // (A completion without outcomes ends the claim and keeps what it wrote: a locked
        // claim's release would roll the blocking back.)
        let heads = claim_run(&store, "relay", 100, 1).await;
        assert_eq!(heads.records.len(), 3, "{mode:?}");
        store.complete(&heads.handle, &[]).await.unwrap();
        let b = claim_run(&store, "relay", 5, 10).await;
        let mut want = run_of("a", 1..=3);
        want.extend(run_of("b", 1..=1));
        want.extend(run_of("c", 1..=1));
        assert_eq!(layout(&b), want, "{mode:?}");
        finish(&store, &b).await;
        ctx.drop().await;
    }
}

/// The completion applies the published prefix, advances the last version to its end and
/// releases the rest of the run unchanged: its first row is the head of the next claim, no
/// attempt counted.
#[tokio::test]
async fn a_published_prefix_advances_last_and_the_rest_is_released_unchanged() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = ctx.store(mode).await;
        let evs: Vec<_> = (1..=5).map(|v| event("a", v)).collect();
        append(&ctx, &store, &evs).await;
        let b = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&b), run_of("a", 1..=5), "{mode:?}");
        let rep = store
            .complete(
                &b.handle,
                &[
                    published(&b.records[0].envelope, 1),
                    published(&b.records[1].envelope, 2),
                ],
            )
            .await
            .unwrap();
        assert_eq!((rep.applied, rep.superseded), (2, 0), "{mode:?}");
        let next = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&next), run_of("a", 3..=5), "{mode:?}");
        assert!(
            next.records
                .iter()
                .all(|r| r.attempts == 0 && !r.is_resend()),
            "{mode:?}"
        );
        // The row after the prefix with an outcome of its own: applied, it is the head.
        let rep = store
            .complete(
                &next.handle,
                &[
                    published(&next.records[0].envelope, 3),
                    retry(&next.records[1].envelope),
                ],
            )
            .await
            .unwrap();
        assert_eq!((rep.applied, rep.superseded), (2, 0), "{mode:?}");
        let last = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&last), run_of("a", 4..=5), "{mode:?}");
        assert_eq!(last.records[0].attempts, 1, "{mode:?}");
        assert_eq!(last.records[1].attempts, 0, "{mode:?}");
        finish(&store, &last).await;
        ctx.drop().await;
    }
}

/// A publication whose predecessor is neither published in the same completion nor the last
/// version is refused and counted superseded, as is any outcome after the first
/// non-published one; the last version stays at the prefix's end.
#[tokio::test]
async fn a_publication_after_a_hole_is_refused_as_superseded() {
    for mode in modes() {
        let ctx = ctx!(4);
        let store = ctx.store(mode).await;
        let evs: Vec<_> = (1..=4).map(|v| event("a", v)).collect();
        append(&ctx, &store, &evs).await;
        let b = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&b), run_of("a", 1..=4), "{mode:?}");
        let e = |i: usize| &b.records[i].envelope;
        // 1 published, 2 retried, 3 published (a hole at 2), 4 retried (after the first
        // non-published outcome).
        let rep = store
            .complete(
                &b.handle,
                &[
                    published(e(0), 1),
                    retry(e(1)),
                    published(e(2), 3),
                    retry(e(3)),
                ],
            )
            .await
            .unwrap();
        assert_eq!((rep.applied, rep.superseded), (2, 2), "{mode:?}");
        let refused: Vec<EventId> = vec![e(2).event_id, e(3).event_id];
        assert_eq!(rep.superseded_events, refused, "{mode:?}");
        let next = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&next), run_of("a", 2..=4), "{mode:?}");
        let attempts: Vec<u32> = next.records.iter().map(|r| r.attempts).collect();
        assert_eq!(attempts, vec![1, 0, 0], "{mode:?}");
        // The head unpublished, a run row published: refused.
        let e = |i: usize| &next.records[i].envelope;
        let rep = store
            .complete(&next.handle, &[retry(e(0)), published(e(1), 3)])
            .await
            .unwrap();
        assert_eq!((rep.applied, rep.superseded), (1, 1), "{mode:?}");
        let again = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&again), run_of("a", 2..=4), "{mode:?}");
        finish(&store, &again).await;
        ctx.drop().await;
    }
}

/// In flight (`stats`) counts every row of a lease's run; a release ends the whole run (all
/// of it claimable again at once), and an operator's release of a gone relay's claims too,
/// marking every row of the run as possibly sent (audited once, under the head).
#[tokio::test]
async fn stats_release_and_an_operators_release_cover_whole_runs() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (1..=5).map(|v| event("a", v)).collect();
    append(&ctx, &store, &evs).await;
    let b = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(b.records.len(), 5);
    assert_eq!(store.stats().await.unwrap().in_flight, 5);
    store.release(&b.handle).await.unwrap();
    assert_eq!(store.stats().await.unwrap().in_flight, 0);
    let again = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(layout(&again), run_of("a", 1..=5));
    assert!(again.records.iter().all(|r| !r.is_resend()));
    assert_eq!(store.live_claims_of("relay").await.unwrap(), 5);
    assert_eq!(store.release_claims_of("relay", "ops").await.unwrap(), 1);
    assert_eq!(store.stats().await.unwrap().in_flight, 0);
    let audited = store.audit_trail(None).await.unwrap();
    assert_eq!(audited.len(), 1, "one release, under the head: {audited:?}");
    assert_eq!(audited[0].event_id, again.records[0].envelope.event_id);
    let after = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(layout(&after), run_of("a", 1..=5));
    let flags: Vec<bool> = after.records.iter().map(|r| r.maybe_sent_before).collect();
    assert_eq!(flags, vec![true; 5]);
    finish(&store, &after).await;
    ctx.drop().await;
}

/// A run whose lease ended without an outcome may have been sent whole: the next claim hands
/// its rows out as possible re-sends, and the rows it does not take this time stay marked for
/// the claim after (whether or not the claim met them as blocked followers).
#[tokio::test]
async fn an_expired_run_is_possibly_sent_whole() {
    // The run's rows blocked (the claim met them as followers), or not (the next claim meets
    // them as followers: a claim whose window did not reach them).
    for unblocked in [false, true] {
        let first_limit = unblocked;
        let ctx = ctx!(4);
        let store = ctx.store(lease(1.0)).await;
        let evs: Vec<_> = (1..=5).map(|v| event("a", v)).collect();
        append(&ctx, &store, &evs).await;
        let b = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&b), run_of("a", 1..=5), "{first_limit}");
        if unblocked {
            exec(&ctx, "UPDATE \"{s}\".outbox_events SET blocked = false").await;
        }
        tokio::time::sleep(Duration::from_millis(1200)).await;
        // Two of the five now; the others later.
        let short = claim_run(&store, "relay", 10, 2).await;
        assert_eq!(layout(&short), run_of("a", 1..=2), "{first_limit}");
        assert!(
            short.records.iter().all(|r| r.maybe_sent_before),
            "{first_limit}"
        );
        let outs: Vec<_> = short
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| published(&r.envelope, i as i64))
            .collect();
        let rep = store.complete(&short.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, 2, "{first_limit}");
        let rest = claim_run(&store, "relay", 10, 10).await;
        assert_eq!(layout(&rest), run_of("a", 3..=5), "{first_limit}");
        let flags: Vec<bool> = rest.records.iter().map(|r| r.maybe_sent_before).collect();
        assert_eq!(flags, vec![true; 3], "{first_limit}");
        finish(&store, &rest).await;
        ctx.drop().await;
    }
}

/// A store instance that did not make the claim completes a run (its rows read from the
/// database): the whole prefix applies.
#[tokio::test]
async fn another_instance_completes_a_run() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let other = ctx.store(lease(30.0)).await;
    let evs: Vec<_> = (1..=4).map(|v| event("a", v)).collect();
    append(&ctx, &store, &evs).await;
    let b = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(b.records.len(), 4);
    let outs: Vec<_> = b.records[..3]
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = other.complete(&b.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (3, 0));
    let next = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(layout(&next), run_of("a", 4..=4));
    finish(&store, &next).await;
    ctx.drop().await;
}

/// A run's lease taken over after it expired fences the first relay's late completion, whole.
#[tokio::test]
async fn a_late_completion_of_an_expired_run_is_fenced() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(1.0)).await;
    let evs: Vec<_> = (1..=3).map(|v| event("a", v)).collect();
    append(&ctx, &store, &evs).await;
    let first = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(first.records.len(), 3);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let second = claim_run(&store, "relay", 10, 10).await;
    assert_eq!(layout(&second), run_of("a", 1..=3));
    let outs: Vec<_> = first
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&first.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (0, 3));
    let outs: Vec<_> = second
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&second.handle, &outs).await.unwrap();
    assert_eq!((rep.applied, rep.superseded), (3, 0));
    assert!(claim_run(&store, "relay", 10, 10).await.is_empty());
    ctx.drop().await;
}

/// The claim's plan with runs reads the partial indexes, never a whole table: the runs are
/// ranges of the unfinished index after their heads.
#[tokio::test]
async fn the_run_claim_plan_reads_the_indexes() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    // 200 aggregates with 50 versions each, one hot aggregate with 5,000.
    let mut evs: Vec<_> = (0..10_000)
        .map(|i| event(&format!("x{}", i % 200), i / 200 + 1))
        .collect();
    evs.extend((1..=5_000).map(|v| event("hot", v)));
    for chunk in evs.chunks(5000) {
        store.append_many(&ctx.pool, chunk).await.unwrap();
    }
    let b = claim_run(&store, "relay", 1000, 1).await;
    store.release(&b.handle).await.unwrap();
    for table in ["outbox_events", "outbox_events_aggregate"] {
        sqlx::query(&format!("ANALYZE \"{}\".{table}", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
    }
    let plans = store.explain_claim_run(1000, 100).await.unwrap();
    assert!(
        plans[1].contains("outbox_events_unfinished_idx"),
        "{}",
        plans[1]
    );
    // (A plan node the executor never reached costs nothing.)
    assert!(
        !plans[1]
            .lines()
            .any(|l| l.contains("Seq Scan") && !l.contains("never executed")),
        "{}",
        plans[1]
    );
    ctx.drop().await;
}

/// A run goes with its head's lease: when the lease write of a head loses (a lease another
/// writer committed on the aggregate after the claim's snapshot, met by the claim's `INSERT ..
/// ON CONFLICT` once that writer commits), neither the head nor any row of its run is handed
/// out, while another aggregate's run in the same claim is. The statement returns run rows
/// without joining them to the lease writes (a nested loop, heads x run rows); the store keeps
/// those whose head it leased.
#[tokio::test]
async fn a_run_whose_head_lease_is_lost_is_not_handed_out() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let mut evs: Vec<_> = (1..=4).map(|v| event("a", v)).collect();
    evs.extend((1..=3).map(|v| event("b", v)));
    append(&ctx, &store, &evs).await;
    // The aggregates' state rows exist (a claim released), with no lease.
    let b = claim_run(&store, "relay", 10, 1).await;
    assert_eq!(b.records.len(), 2);
    finish(&store, &b).await;
    // Another writer leases "a" and holds the row until the claim's decision waits for it.
    let mut other = ctx.pool.begin().await.unwrap();
    sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_aggregate SET lease_owner = 'other', \
         lease_token = gen_random_uuid(), lease_until = clock_timestamp() + interval '1 hour', \
         lease_row = (SELECT min(id) FROM \"{}\".outbox_events WHERE aggregate_id = 'a') \
         WHERE aggregate_id = 'a'",
        ctx.schema, ctx.schema
    ))
    .execute(&mut *other)
    .await
    .unwrap();
    let other_xid = common::xact_id(&mut other).await;
    let claiming = {
        let store = store.clone();
        tokio::spawn(async move { claim_run(&store, "relay", 10, 10).await })
    };
    common::wait_for_waiter_on(&ctx, &other_xid).await;
    other.commit().await.unwrap();
    let b = claiming.await.unwrap();
    assert_eq!(
        layout(&b),
        run_of("b", 1..=3),
        "the lost head's run must not go out; the other aggregate's must"
    );
    let lease: Option<String> = sqlx::query_scalar(&format!(
        "SELECT lease_owner FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = 'a'",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        lease.as_deref(),
        Some("other"),
        "the other writer's lease stands"
    );
    finish(&store, &b).await;
    ctx.drop().await;
}
