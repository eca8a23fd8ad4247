//! Adversary pass (helper atk45) over the fix of ad32f9d: a LockedTransaction-mode claim that
//! takes over an aggregate whose lease (written by a Lease-mode store on the same table) has
//! expired clears the lease (`unlease`; `unlease_locked` since stop 46) and marks the head `maybe_delivered` (`unlease_mark`).
//!
//! Attacked here (each step checked against the ledger of `adversary_claim45`, whose helpers
//! both files include from `common/ledger45.rs`):
//! 1. the takeover ends without a completion (release, a relay that dies, the server's
//!    `locked_max_hold`): the lease must be back as it was and the lease holder's late
//!    completion applied as before any takeover;
//! 2. the lease holder completes while the locked claim holds the aggregate (its completion
//!    waits on the aggregate lock), with publish/retry/park, and the locked claim ends with
//!    publish/retry/release;
//! 3. the locked claim's park-commit-and-relock round: the first decision's parks commit
//!    before the relock, and the lease holder's (waiting) completion takes the aggregate lock
//!    between the rounds (forced with a test trigger that slows the park); since stop 46 the
//!    lease is cleared in the transaction the claim keeps (`unlease_locked`), not with the
//!    parks, so that completion is applied;
//! 4. leases covering a run of three versions, taken over by locked claims with and without
//!    runs, ended in several ways, the lease holder completing late with publish/retry/park;
//! 5. the stores' in-flight counts while this happens;
//! 6. an operator action (discard, retry) on a parked row of the aggregate mid-takeover.
#![allow(dead_code)]

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, CompletionReport, Envelope, Outcome, StoreError};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run};
use uuid::Uuid;

use common::{event, lease, park, published, retry, Ctx};

include!("common/ledger45.rs");

// ---------------------------------------------------------------------------------------------
// atk45: takeovers of expired leases by locked claims.
// ---------------------------------------------------------------------------------------------

/// The lease columns and last version of `agg`'s state row: (token, row, upto, last).
async fn state(ctx: &Ctx, agg: &str) -> (Option<Uuid>, Option<i64>, Option<i64>, Option<i64>) {
    sqlx::query_as(&format!(
        "SELECT lease_token, lease_row, lease_upto, last_version \
         FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .unwrap_or((None, None, None, None))
}

async fn row_of(ctx: &Ctx, id: Uuid) -> Row {
    rows(ctx)
        .await
        .into_iter()
        .find(|r| r.event_id == id)
        .unwrap()
}

/// Lease relay `xs` (lease 0.3 s) claims `a` (versions `vs`, committed) in runs of `x_run`;
/// with `copy`, a lower-id copy A of version `vs[0]` is appended before in a transaction held
/// open and committed during the lease. Returns x's claim, A and the committed rows, after
/// the lease has expired.
async fn lost_lease(
    ctx: &Ctx,
    l: &L,
    xs: &PostgresOutboxStore,
    copy: bool,
    vs: &[i64],
    x_run: usize,
    what: &str,
) -> (Claim, Option<Uuid>, Vec<Uuid>) {
    let mut t1 = None;
    let mut a = None;
    if copy {
        let mut t = open(ctx).await;
        a = Some(t.put(xs, l, "a", &vs[..1]).await[0]);
        t1 = Some(t);
    }
    let h = append_now(ctx, xs, l, "a", vs).await;
    let x = claim(l, xs, "x", 10, x_run).await;
    let want: Vec<Uuid> = h.iter().take(x_run).copied().collect();
    assert_eq!(x.ids(), want, "{what}: x's claim {:?}", layout(&x.b));
    if let Some(t) = t1 {
        t.commit(l).await;
    }
    let (tok, _, upto, _) = state(ctx, "a").await;
    assert_eq!(tok, Some(x.b.handle.token), "{what}: x's lease");
    assert_eq!(
        upto,
        Some(vs[0] + x_run as i64 - 1),
        "{what}: x's lease_upto"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    (x, a, h)
}

fn late_outcomes(x: &Claim, late: &str) -> Vec<Outcome> {
    match late {
        "publish" => outcomes(&x.b, usize::MAX, None),
        "retry" => outcomes(&x.b, 0, Some(retry)),
        _ => outcomes(&x.b, 0, Some(park)),
    }
}

/// Every version in `vs` of `a` is published exactly once (settled).
async fn all_published_once(ctx: &Ctx, vs: &[i64], what: &str) {
    let rs = rows(ctx).await;
    for v in vs {
        let n = rs
            .iter()
            .filter(|r| {
                r.aggregate_id == "a" && r.aggregate_version == *v && r.status == "published"
            })
            .count();
        assert_eq!(n, 1, "{what}: a v{v} published {n} times");
    }
}

/// 1. A locked claim takes the expired lease over, then ends without a completion (release,
/// a crash, the server's hold limit): its transaction rolls back, so the lease is back in the
/// state row with x's token, and x's late completion is applied as before any takeover.
#[tokio::test]
async fn a_takeover_that_ends_without_completion_gives_the_lease_back() {
    for end in ["release", "abandon", "max_hold"] {
        for copy in [false, true] {
            for x_run in [1, 3] {
                let what = format!("end={end} copy={copy} x_run={x_run}");
                let Some(ctx) = Ctx::new(8).await else {
                    return;
                };
                let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
                xs.migrate().await.unwrap();
                let hold = if end == "max_hold" {
                    Duration::from_millis(300)
                } else {
                    Duration::from_secs(30)
                };
                let ys = locked_store(&ctx, false, hold);
                let l = L::default();
                let (x, a, h) = lost_lease(&ctx, &l, &xs, copy, &[1, 2, 3], x_run, &what).await;
                let y = claim(&l, &ys, "y", 10, 1).await;
                let head = a.unwrap_or(h[0]);
                assert_eq!(y.ids(), vec![head], "{what}: {:?}", layout(&y.b));
                assert!(
                    y.b.records[0].maybe_sent_before,
                    "{what}: the lease said the head may have been sent"
                );
                match end {
                    "release" => ys.release(&y.b.handle).await.unwrap(),
                    "abandon" => assert!(ys.abandon_locked_claim(&y.b.handle).await),
                    _ => tokio::time::sleep(Duration::from_millis(700)).await,
                }
                let (tok, row, upto, last) = state(&ctx, "a").await;
                let h_row = row_of(&ctx, h[0]).await;
                assert_eq!(
                    (tok, row, upto, last),
                    (
                        Some(x.b.handle.token),
                        Some(h_row.id),
                        Some(x_run as i64),
                        None
                    ),
                    "{what}: the lease is back as it was"
                );
                let late = outcomes(&x.b, usize::MAX, None);
                let rep = try_complete(&l, &xs, &x, &late).await.unwrap();
                assert_eq!(
                    (rep.applied, rep.superseded),
                    (late.len(), 0),
                    "{what}: no takeover stands, x's late completion applies"
                );
                check(&ctx, &l, true, &what).await;
                assert_eq!(state(&ctx, "a").await.3, Some(x_run as i64), "{what}: last");
                settle(&ctx, &l, &ys, 1, &what).await;
                check(&ctx, &l, true, &what).await;
                all_published_once(&ctx, &[1, 2, 3], &what).await;
                assert_eq!(published_copy(&ctx, "a", 1).await, Some(h[0]), "{what}");
                ctx.drop().await;
            }
        }
    }
}

/// 2. x completes late while the locked claim holds the aggregate: the completion waits for
/// the aggregate lock; the locked claim then publishes or retries (x must be refused: the
/// takeover stands) or is released (the lease is back: x's outcomes apply as before any
/// takeover).
#[tokio::test]
async fn a_late_completion_waits_for_the_locked_takeover() {
    for y_end in ["publish", "retry", "release"] {
        for late in ["publish", "retry", "park"] {
            for copy in [false, true] {
                for x_run in [1, 3] {
                    let what = format!("y_end={y_end} late={late} copy={copy} x_run={x_run}");
                    let Some(ctx) = Ctx::new(8).await else {
                        return;
                    };
                    let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
                    xs.migrate().await.unwrap();
                    let ys = locked_store(&ctx, false, Duration::from_secs(30));
                    let l = L::default();
                    let (x, a, h) = lost_lease(&ctx, &l, &xs, copy, &[1, 2, 3], x_run, &what).await;
                    let y = claim(&l, &ys, "y", 10, 1).await;
                    let head = a.unwrap_or(h[0]);
                    assert_eq!(y.ids(), vec![head], "{what}: {:?}", layout(&y.b));
                    let outs = late_outcomes(&x, late);
                    let n_late = outs.len();
                    let task = {
                        let (l, xs) = (l.clone(), xs.clone());
                        tokio::spawn(async move {
                            let rep = try_complete(&l, &xs, &x, &outs).await;
                            (x, rep)
                        })
                    };
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    assert!(
                        !task.is_finished(),
                        "{what}: x's completion did not wait for the locked claim"
                    );
                    match y_end {
                        "publish" => complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await,
                        "retry" => complete(&l, &ys, &y, &outcomes(&y.b, 0, Some(retry))).await,
                        _ => ys.release(&y.b.handle).await.unwrap(),
                    }
                    let (_x, rep) = task.await.unwrap();
                    let rep = rep.unwrap();
                    println!("{what}: x's late completion {rep:?}");
                    let want_applied = match (y_end, late) {
                        ("release", "publish") => n_late,
                        ("release", _) => 1,
                        _ => 0,
                    };
                    assert_eq!(
                        rep.applied,
                        want_applied,
                        "{what}: x's late completion\nrows:{}",
                        dump(&rows(&ctx).await, &l.g())
                    );
                    check(&ctx, &l, true, &what).await;
                    let (tok, ..) = state(&ctx, "a").await;
                    assert_eq!(tok, None, "{what}: no lease is left");
                    if y_end != "release" && late == "park" {
                        let parked_by_x = rows(&ctx)
                            .await
                            .iter()
                            .any(|r| r.park_kind.as_deref() == Some("permanent_error"));
                        assert!(!parked_by_x, "{what}: x's refused park parked a row");
                    }
                    // H (the row x had) is never both published and superseded by y's head.
                    if y_end == "publish" {
                        assert_eq!(published_copy(&ctx, "a", 1).await, Some(head), "{what}");
                    }
                    settle(&ctx, &l, &ys, 1, &what).await;
                    check(&ctx, &l, true, &what).await;
                    all_published_once(&ctx, &[1, 2, 3], &what).await;
                    ctx.drop().await;
                }
            }
        }
    }
}

/// 3. The locked claim's parks commit before it locks its heads again (`relock_and_decide`):
/// `unlease` commits with them. A trigger (test schema only) slows the park by 0.5 s, so x's
/// late completion, started meanwhile, waits for the aggregate lock and gets it when the first
/// round commits, before the relock. The contract: x is refused if y hands the head out (the
/// version must not be published by both); when y lost the head to x's completion, whatever
/// x's completion did, the next claim hands the head out as possibly sent before, and every
/// version goes out once, in order.
#[tokio::test]
async fn the_park_round_commits_the_unlease_before_the_relock() {
    for late in ["publish", "retry"] {
        for copy in [false, true] {
            for x_run in [1, 3] {
                let what = format!("late={late} copy={copy} x_run={x_run}");
                let Some(ctx) = Ctx::new(8).await else {
                    return;
                };
                let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
                xs.migrate().await.unwrap();
                let ys = locked_store(&ctx, false, Duration::from_secs(30));
                let l = L::default();
                // b v1 published; a copy of it appended later is parked by y's claim.
                append_now(&ctx, &ys, &l, "b", &[1]).await;
                drain(&ctx, &l, &ys, 1, &what).await;
                let (x, a, h) = lost_lease(&ctx, &l, &xs, copy, &[1, 2, 3], x_run, &what).await;
                let stale = append_now(&ctx, &ys, &l, "b", &[1]).await[0];
                let s = &ctx.schema;
                for stmt in [
                    format!(
                        "CREATE FUNCTION \"{s}\".atk45_slow_park() RETURNS trigger \
                         LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.5); RETURN NEW; END $$"
                    ),
                    format!(
                        "CREATE TRIGGER atk45_slow_park BEFORE UPDATE ON \"{s}\".outbox_events \
                         FOR EACH ROW WHEN (NEW.status = 'parked' AND OLD.status = 'pending') \
                         EXECUTE FUNCTION \"{s}\".atk45_slow_park()"
                    ),
                ] {
                    sqlx::query(&stmt).execute(&ctx.pool).await.unwrap();
                }
                let y_task = {
                    let (l, ys) = (l.clone(), ys.clone());
                    tokio::spawn(async move { claim(&l, &ys, "y", 10, 1).await })
                };
                tokio::time::sleep(Duration::from_millis(200)).await;
                let outs = late_outcomes(&x, late);
                let n_late = outs.len();
                let x_task = {
                    let (l, xs) = (l.clone(), xs.clone());
                    tokio::spawn(async move { try_complete(&l, &xs, &x, &outs).await })
                };
                let y = y_task.await.unwrap();
                let head = a.unwrap_or(h[0]);
                let y_has_head = y.ids().contains(&head);
                if y_has_head {
                    // y won the relock: x's completion ran between the rounds (it must have
                    // been refused: asserted below) or waits for y's aggregate lock.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    println!(
                        "{what}: x finished before y's completion: {}",
                        x_task.is_finished()
                    );
                    assert!(y.b.records[0].maybe_sent_before, "{what}");
                    complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await;
                }
                let rep = x_task.await.unwrap().unwrap();
                sqlx::query(&format!(
                    "DROP TRIGGER atk45_slow_park ON \"{s}\".outbox_events"
                ))
                .execute(&ctx.pool)
                .await
                .unwrap();
                println!(
                    "{what}: y {:?} parked {:?}; y kept the head: {y_has_head}; x's late \
                     completion {rep:?}",
                    layout(&y.b),
                    y.b.parked.len()
                );
                assert!(
                    y.b.parked.iter().any(|p| p.event_id.as_uuid() == stale),
                    "{what}: y's claim parked b's stale copy: {:?}",
                    y.b.parked
                );
                // The first round commits its parks, not the lease's takeover (cleared in the
                // transaction y keeps): x, run between the rounds, is applied, and y's relock
                // finds the head published, or pending again after x's retry (y may hand it
                // out then, flagged: asserted above); x waiting for y's lock is refused.
                if !y_has_head {
                    assert_eq!(
                        rep.applied, n_late,
                        "{what}: x's late completion between y's rounds: {rep:?}"
                    );
                } else if late == "publish" {
                    assert_eq!(
                        (rep.applied, rep.superseded),
                        (0, n_late),
                        "{what}: x's late publication after y's takeover"
                    );
                } else {
                    assert_eq!(
                        rep.applied + rep.superseded,
                        n_late,
                        "{what}: x's late retry: {rep:?}"
                    );
                }
                if !y_has_head {
                    if !y.b.records.is_empty() {
                        complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await;
                    } else {
                        ys.release(&y.b.handle).await.unwrap();
                    }
                    // x's completion applied in full: v1 is x's copy (its lease's row).
                    if late == "publish" {
                        assert_eq!(
                            published_copy(&ctx, "a", 1).await,
                            Some(h[0]),
                            "{what}: x published the head"
                        );
                    }
                }
                check(&ctx, &l, true, &what).await;
                settle(&ctx, &l, &ys, 1, &what).await;
                check(&ctx, &l, true, &what).await;
                all_published_once(&ctx, &[1, 2, 3], &what).await;
                ctx.drop().await;
            }
        }
    }
}

/// 4. A lease over a run of three versions (lease_upto 3) taken over by a locked claim (runs of
/// 1 or 3): every record the locked claim hands out at or below the lease's end is possibly
/// sent before; the locked claim ends (all published, one published then a retry, the head
/// retried) and x's late completion (publish, retry, park) applies nothing.
#[tokio::test]
async fn a_run_lease_taken_over_by_a_locked_claim() {
    for y_run in [1, 3] {
        for y_end in ["publish", "prefix-retry", "retry"] {
            for late in ["publish", "retry", "park"] {
                for copy in [false, true] {
                    let what = format!("y_run={y_run} y_end={y_end} late={late} copy={copy}");
                    let Some(ctx) = Ctx::new(8).await else {
                        return;
                    };
                    let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
                    xs.migrate().await.unwrap();
                    let ys = locked_store(&ctx, false, Duration::from_secs(30));
                    let l = L::default();
                    let (x, a, h) = lost_lease(&ctx, &l, &xs, copy, &[1, 2, 3, 4], 3, &what).await;
                    let y = claim(&l, &ys, "y", 10, y_run).await;
                    let head = a.unwrap_or(h[0]);
                    assert_eq!(y.ids().first(), Some(&head), "{what}: {:?}", layout(&y.b));
                    for r in &y.b.records {
                        if r.envelope.aggregate_version <= 3 {
                            assert!(
                                r.maybe_sent_before,
                                "{what}: v{} was in x's run: possibly sent",
                                r.envelope.aggregate_version
                            );
                        }
                    }
                    let outs = match y_end {
                        "publish" => outcomes(&y.b, usize::MAX, None),
                        "prefix-retry" => outcomes(&y.b, 1, Some(retry)),
                        _ => outcomes(&y.b, 0, Some(retry)),
                    };
                    complete(&l, &ys, &y, &outs).await;
                    check(&ctx, &l, true, &what).await;
                    let lo = late_outcomes(&x, late);
                    let rep = try_complete(&l, &xs, &x, &lo).await.unwrap();
                    assert_eq!(
                        (rep.applied, rep.superseded),
                        (0, lo.len()),
                        "{what}: x's late completion after the takeover\nrows:{}",
                        dump(&rows(&ctx).await, &l.g())
                    );
                    check(&ctx, &l, true, &what).await;
                    // The rows x's run covered keep `maybe_delivered` until they go out.
                    let c = claim(&l, &ys, "z", 10, 3).await;
                    for r in &c.b.records {
                        if r.envelope.aggregate_version <= 3 {
                            assert!(
                                r.maybe_sent_before,
                                "{what}: v{} (in x's run) handed out again as never sent",
                                r.envelope.aggregate_version
                            );
                        }
                    }
                    if c.b.records.is_empty() {
                        ys.release(&c.b.handle).await.unwrap();
                    } else {
                        complete(&l, &ys, &c, &outcomes(&c.b, usize::MAX, None)).await;
                    }
                    settle(&ctx, &l, &ys, 3, &what).await;
                    check(&ctx, &l, true, &what).await;
                    all_published_once(&ctx, &[1, 2, 3, 4], &what).await;
                    ctx.drop().await;
                }
            }
        }
    }
}

/// 5. In-flight counts: x's live lease counts its run; once it has expired nothing is in
/// flight; the locked claim's takeover counts at least what it holds (and no more than is
/// unpublished); after its completion nothing is in flight again.
#[tokio::test]
async fn in_flight_counts_through_a_takeover() {
    for copy in [false, true] {
        for x_run in [1, 3] {
            let what = format!("copy={copy} x_run={x_run}");
            let Some(ctx) = Ctx::new(8).await else {
                return;
            };
            let xs = store_with(&ctx, lease(1.0), false, LONG_GAP);
            xs.migrate().await.unwrap();
            let ys = locked_store(&ctx, false, Duration::from_secs(30));
            let l = L::default();
            let mut t1 = None;
            let mut a = None;
            if copy {
                let mut t = open(&ctx).await;
                a = Some(t.put(&xs, &l, "a", &[1]).await[0]);
                t1 = Some(t);
            }
            let h = append_now(&ctx, &xs, &l, "a", &[1, 2, 3]).await;
            let x = claim(&l, &xs, "x", 10, x_run).await;
            assert_eq!(x.ids().len(), x_run, "{what}");
            if let Some(t) = t1 {
                t.commit(&l).await;
            }
            let sx = xs.stats().await.unwrap();
            let sy = ys.stats().await.unwrap();
            println!("{what}: during the lease: lease store {sx:?}\nlocked store {sy:?}");
            assert_eq!(sx.in_flight, x_run as u64, "{what}: the live lease's run");
            assert!(
                sy.in_flight >= x_run as u64,
                "{what}: the locked store's view"
            );
            tokio::time::sleep(Duration::from_millis(1100)).await;
            assert_eq!(xs.stats().await.unwrap().in_flight, 0, "{what}: expired");
            assert_eq!(ys.stats().await.unwrap().in_flight, 0, "{what}: expired");
            let y = claim(&l, &ys, "y", 10, 1).await;
            assert_eq!(y.ids(), vec![a.unwrap_or(h[0])], "{what}");
            let sy = ys.stats().await.unwrap();
            let sx = xs.stats().await.unwrap();
            println!(
                "{what}: y holds {:?}: locked store in_flight {} unpublished {}, lease store \
                 in_flight {}",
                layout(&y.b),
                sy.in_flight,
                sy.unpublished,
                sx.in_flight
            );
            assert!(
                sy.in_flight == y.b.records.len() as u64,
                "{what}: locked in_flight {} for {} held",
                sy.in_flight,
                y.b.records.len()
            );
            complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await;
            let rep = try_complete(&l, &xs, &x, &outcomes(&x.b, usize::MAX, None))
                .await
                .unwrap();
            assert_eq!(rep.applied, 0, "{what}");
            assert_eq!(ys.stats().await.unwrap().in_flight, 0, "{what}: after");
            assert_eq!(xs.stats().await.unwrap().in_flight, 0, "{what}: after");
            check(&ctx, &l, true, &what).await;
            settle(&ctx, &l, &ys, 1, &what).await;
            all_published_once(&ctx, &[1, 2, 3], &what).await;
            ctx.drop().await;
        }
    }
}

/// 6. An operator action on a parked row of the aggregate while a locked claim holds its
/// takeover: `a` v1 published; x leases v2 (H); a copy S of v1 is appended (stale); the lease
/// expires; y's locked claim hands out H (taking the lease over) and parks S. The operator
/// discards (or retries: a conflict, S is at `last`) S meanwhile: it waits for the aggregate
/// lock. y ends (publish or release); x completes late: refused after y's publication,
/// applied after y's release. H is published once, S discarded, last 2.
#[tokio::test]
async fn an_operator_action_mid_takeover() {
    for op in ["discard", "retry"] {
        for y_end in ["publish", "release"] {
            let what = format!("op={op} y_end={y_end}");
            let Some(ctx) = Ctx::new(8).await else {
                return;
            };
            let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
            xs.migrate().await.unwrap();
            let ys = locked_store(&ctx, false, Duration::from_secs(30));
            let l = L::default();
            append_now(&ctx, &ys, &l, "a", &[1]).await;
            drain(&ctx, &l, &ys, 1, &what).await;
            let h = append_now(&ctx, &xs, &l, "a", &[2]).await[0];
            let x = claim(&l, &xs, "x", 10, 1).await;
            assert_eq!(x.ids(), vec![h], "{what}");
            let s_id = append_now(&ctx, &xs, &l, "a", &[1]).await[0];
            tokio::time::sleep(Duration::from_millis(400)).await;
            let y = claim(&l, &ys, "y", 10, 1).await;
            assert_eq!(y.ids(), vec![h], "{what}: {:?}", layout(&y.b));
            assert!(y.b.records[0].maybe_sent_before, "{what}");
            let parked = y.b.parked.iter().any(|p| p.event_id.as_uuid() == s_id);
            assert_eq!(
                row_of(&ctx, s_id).await.status,
                "parked",
                "{what}: {parked}"
            );
            let op_task = {
                let ys = ys.clone();
                let id = outbox_core::EventId::from_uuid(s_id);
                tokio::spawn(async move {
                    if op == "discard" {
                        ys.discard_parked(id, "op", "stale copy").await
                    } else {
                        ys.retry_parked(id, "op").await
                    }
                })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                !op_task.is_finished(),
                "{what}: the operator waits for the claim"
            );
            if y_end == "publish" {
                complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await;
            } else {
                ys.release(&y.b.handle).await.unwrap();
            }
            let op_res = op_task.await.unwrap();
            match op {
                "discard" => op_res.unwrap(),
                _ => assert_eq!(
                    op_res.unwrap_err().kind,
                    outbox_core::StoreErrorKind::Conflict,
                    "{what}"
                ),
            }
            let late = outcomes(&x.b, usize::MAX, None);
            let rep = try_complete(&l, &xs, &x, &late).await.unwrap();
            // Refused after y's publication; applied after y's release (the lease is cleared
            // in the transaction y keeps, which the release rolls back, not with y's parks).
            let expected = if y_end == "publish" { 0 } else { 1 };
            assert_eq!(rep.applied, expected, "{what}: x's late completion {rep:?}");
            check(&ctx, &l, true, &what).await;
            assert_eq!(state(&ctx, "a").await.3, Some(2), "{what}: last");
            assert_eq!(published_copy(&ctx, "a", 2).await, Some(h), "{what}");
            if op == "discard" {
                assert_eq!(row_of(&ctx, s_id).await.status, "discarded", "{what}");
            }
            ctx.drop().await;
        }
    }
}

/// The fix's own comment (src/sql.rs, `locked_decision`): "A claim that ends without
/// completion rolls both back with its transaction: the lease is as it was, and a late
/// completion of it is applied as before any takeover." Not so when the locked claim parked
/// something: its first decision (with `unlease`) commits with the parks before the relock
/// (claim.rs `claim_inner`), so a release of the claim rolls back only the second round.
///
/// FINDING (stop 45, fixed in stop 46; minor: no version went out twice or out of order, the
/// lease holder's real publication was refused and its version re-sent, flagged as possibly
/// sent): `a` v1 published (row 1); `a` v2 appended (row 2, H); lease relay x (0.3 s) claims
/// H; a copy of v1 appended (row 3, S); after 0.4 s a LockedTransaction claim hands out H and
/// parks S out of order (round 1: `unlease` and the park commit; round 2 holds H); the claim
/// is released; the state row of `a` had lease_token NULL (not x's token), and x's completion
/// publishing H returned CompletionReport { applied: 0, superseded: 1 }. The same with an
/// out-of-order copy of another aggregate in the claim. The takeover now clears the lease in
/// the transaction the claim keeps (`unlease_locked`).
#[tokio::test]
async fn a_released_takeover_after_a_park_round_gives_the_lease_back() {
    for other_aggregate in [true, false] {
        let what = format!("park of another aggregate={other_aggregate}");
        let Some(ctx) = Ctx::new(8).await else {
            return;
        };
        let xs = store_with(&ctx, lease(0.3), false, LONG_GAP);
        xs.migrate().await.unwrap();
        let ys = locked_store(&ctx, false, Duration::from_secs(30));
        let l = L::default();
        let stale_agg = if other_aggregate { "b" } else { "a" };
        append_now(&ctx, &ys, &l, "a", &[1]).await;
        if other_aggregate {
            append_now(&ctx, &ys, &l, "b", &[1]).await;
        }
        drain(&ctx, &l, &ys, 1, &what).await;
        let h = append_now(&ctx, &xs, &l, "a", &[2]).await[0];
        let x = claim(&l, &xs, "x", 10, 1).await;
        assert_eq!(x.ids(), vec![h], "{what}");
        let stale = append_now(&ctx, &xs, &l, stale_agg, &[1]).await[0];
        tokio::time::sleep(Duration::from_millis(400)).await;
        let y = claim(&l, &ys, "y", 10, 1).await;
        assert_eq!(y.ids(), vec![h], "{what}: {:?}", layout(&y.b));
        assert!(
            y.b.parked.iter().any(|p| p.event_id.as_uuid() == stale),
            "{what}: {:?}",
            y.b.parked
        );
        ys.release(&y.b.handle).await.unwrap();
        let (tok, row, ..) = state(&ctx, "a").await;
        let late = outcomes(&x.b, usize::MAX, None);
        let rep = try_complete(&l, &xs, &x, &late).await.unwrap();
        println!("{what}: after y's release: lease_token {tok:?} lease_row {row:?}; x {rep:?}");
        check(&ctx, &l, true, &what).await;
        assert_eq!(
            tok,
            Some(x.b.handle.token),
            "{what}: the released takeover left the lease cleared"
        );
        assert_eq!(rep.applied, 1, "{what}: x's late completion {rep:?}");
        ctx.drop().await;
    }
}

/// Locked-mode `stats().in_flight` counts aggregates whose lock is held (with a due
/// unblocked row), so a locked claim's run of three counts one; a lease claim's run counts
/// every row of it (`tests/runs.rs`, `stats_release_and_an_operators_release_cover_whole_runs`).
///
/// FINDING (stop 45, fixed in stop 46; stats only): `a` v1..v3 appended in one statement; a
/// LockedTransaction claim with runs of 3 holds all three (run positions 0, 1, 2):
/// `stats().in_flight` was 1; the same rows claimed by a lease claim with runs of 3 give 3
/// (`src/sql.rs` stats: `count(DISTINCT l.k)` of pg_locks joined to pending, unblocked, due
/// rows). The store instance now adds the rows after the heads of its own locked claims' runs
/// (another instance's claimed run still counts its head only: a lock does not say how long
/// the run behind it is).
#[tokio::test]
async fn locked_in_flight_counts_every_row_of_a_run() {
    let Some(ctx) = Ctx::new(4).await else {
        return;
    };
    let ys = locked_store(&ctx, false, Duration::from_secs(30));
    ys.migrate().await.unwrap();
    let l = L::default();
    append_now(&ctx, &ys, &l, "a", &[1, 2, 3]).await;
    let y = claim(&l, &ys, "y", 10, 3).await;
    assert_eq!(y.b.records.len(), 3, "{:?}", layout(&y.b));
    let n = ys.stats().await.unwrap().in_flight;
    ys.release(&y.b.handle).await.unwrap();
    let xs = store_with(&ctx, lease(30.0), false, LONG_GAP);
    let x = claim(&l, &xs, "x", 10, 3).await;
    let m = xs.stats().await.unwrap().in_flight;
    xs.release(&x.b.handle).await.unwrap();
    assert_eq!(m, 3, "lease mode counts the run");
    assert_eq!(
        n, 3,
        "locked mode: in_flight {n} while a run of 3 is claimed"
    );
    ctx.drop().await;
}

/// 7. x's late completion from another store instance (no rows in memory: `lease_rows` reads
/// them by token), while the locked claim holds the takeover, with and without
/// `accept_first_version`: refused after y's publication, applied after y's release (no parks:
/// the lease is back).
#[tokio::test]
async fn a_late_completion_from_another_instance_during_the_takeover() {
    for y_end in ["publish", "release"] {
        for copy in [false, true] {
            for x_run in [1, 3] {
                for accept_first in [false, true] {
                    let what = format!(
                        "y_end={y_end} copy={copy} x_run={x_run} accept_first={accept_first}"
                    );
                    let Some(ctx) = Ctx::new(8).await else {
                        return;
                    };
                    let xs = store_with(&ctx, lease(0.3), accept_first, LONG_GAP);
                    xs.migrate().await.unwrap();
                    let other = store_with(&ctx, lease(0.3), accept_first, LONG_GAP);
                    let ys = PostgresOutboxStore::builder(ctx.pool.clone())
                        .schema(&ctx.schema)
                        .claim_mode(ClaimMode::LockedTransaction)
                        .accept_first_version(accept_first)
                        .gap_timeout(LONG_GAP)
                        .build()
                        .unwrap();
                    let l = L::default();
                    let (x, a, h) = lost_lease(&ctx, &l, &xs, copy, &[1, 2, 3], x_run, &what).await;
                    let y = claim(&l, &ys, "y", 10, 1).await;
                    assert_eq!(
                        y.ids(),
                        vec![a.unwrap_or(h[0])],
                        "{what}: {:?}",
                        layout(&y.b)
                    );
                    let late = outcomes(&x.b, usize::MAX, None);
                    let n_late = late.len();
                    let task = {
                        let (l, other) = (l.clone(), other.clone());
                        tokio::spawn(async move { try_complete(&l, &other, &x, &late).await })
                    };
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    assert!(!task.is_finished(), "{what}: x's completion waits for y");
                    if y_end == "publish" {
                        complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await;
                    } else {
                        ys.release(&y.b.handle).await.unwrap();
                    }
                    let rep = task.await.unwrap().unwrap();
                    let want = if y_end == "publish" { 0 } else { n_late };
                    assert_eq!(rep.applied, want, "{what}: {rep:?}");
                    check(&ctx, &l, true, &what).await;
                    settle(&ctx, &l, &ys, 1, &what).await;
                    check(&ctx, &l, true, &what).await;
                    all_published_once(&ctx, &[1, 2, 3], &what).await;
                    ctx.drop().await;
                }
            }
        }
    }
}
