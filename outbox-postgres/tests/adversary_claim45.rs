//! Adversary pass (helper adv45) over the PostgreSQL claim in three shapes the earlier passes
//! did not force:
//!
//! 1. appends that commit out of id order against the follower rule of f30d801 (a blocked
//!    earlier copy of the candidate's version counts as its predecessor): copies of one version
//!    and later versions appended in transactions held open on their own connections and
//!    committed in an order other than their ids', with claims and completions between the
//!    commits (also while the lower-id transaction is still open, so a claim sees the higher-id
//!    copy only);
//! 2. a head lease lost while a second copy of its version waits (a later-id copy, or a
//!    lower-id copy that committed during the lease) and with runs: the first relay completes
//!    late, before or after the takeover, with publications and failures (lease mode; in locked
//!    mode the claim's transaction is ended by the server's `locked_max_hold`);
//! 3. a lease-mode and a locked-mode store claiming concurrently from one table while producers
//!    append versions and copies in transactions that commit out of id order or roll back
//!    (randomized, seeded: `ADV45_SEED`).
//!
//! Every step is judged against a ledger of what was appended (and when each transaction
//! committed, on one sequence with the start of every claim) and what was published (with the
//! claim that handed it out): "the first appended copy" is judged among the copies committed
//! before the claim that handed the version out (README: "the first appended of those
//! committed when the version goes out"), and a row parked out of order must be explained by a
//! version at or above it that went out before the row committed (or an earlier copy of its
//! version that was published).
//!
//! Finding (test `a_lease_lost_to_a_locked_relay_with_a_lower_copy`, failed before the fix of
//! stop 45): a locked-mode claim that took over an aggregate whose lease expired left the
//! lease's token in the state row, so the lease holder's late completion was applied after the
//! takeover: with a lower-id copy that committed during the lease, one version was published
//! twice. The locked decision now clears such a lease (`unlease` in `src/sql.rs`).
//! Observation (contract-conform, asserted as such): a copy handed out, then retried, released
//! or parked, is superseded by a lower-id copy that committed after it went out, so two copies
//! of one version may reach the broker (`a_lower_copy_commits_while_the_higher_copy_is_in_flight`).

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, CompletionReport, Envelope, Outcome, StoreError};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::{batch_layout as layout, claim_run};
use uuid::Uuid;

use common::{event, lease, park, published, retry, Ctx};

include!("common/ledger45.rs");

/// A copy of version v (A, the lower id) is appended in a transaction held open; a second copy
/// (B) and version v+1 commit in another; a claim hands out B (with v+1 in its run); A commits
/// while B is in flight, and another relay's claim gets nothing of the aggregate. The claim
/// ends in every way. Publication of B: A is parked out of order (it was not committed when v
/// went out). B retried, released or parked: A, committed before v goes out again and
/// appended first, is the head and goes out; B is parked out of order (or stays parked).
#[tokio::test]
async fn a_lower_copy_commits_while_the_higher_copy_is_in_flight() {
    for end in ["publish", "prefix-retry", "retry", "release", "park"] {
        each_config(true, |ctx, store, run, fresh, what| async move {
            let what = format!("{end} {what}");
            let l = L::default();
            let v = prelude(&ctx, &l, &store, "a", fresh, &what).await;
            let mut t1 = open(&ctx).await;
            let a = t1.put(&store, &l, "a", &[v]).await[0];
            let mut t2 = open(&ctx).await;
            let b = t2.put(&store, &l, "a", &[v, v + 1]).await;
            t2.commit(&l).await;
            check(&ctx, &l, true, &what).await;
            let x = claim(&l, &store, "x", 10, run).await;
            let want: Vec<Uuid> = if run > 1 { b.clone() } else { vec![b[0]] };
            assert_eq!(x.ids(), want, "{what}: {:?}", layout(&x.b));
            t1.commit(&l).await;
            let y = claim(&l, &store, "y", 10, run).await;
            assert!(y.b.records.is_empty(), "{what}: {:?}", layout(&y.b));
            store.release(&y.b.handle).await.unwrap();
            check(&ctx, &l, true, &what).await;
            let outs = match end {
                "publish" => outcomes(&x.b, usize::MAX, None),
                "prefix-retry" => outcomes(&x.b, 1, Some(retry)),
                "retry" => outcomes(&x.b, 0, Some(retry)),
                "park" => outcomes(&x.b, 0, Some(park)),
                _ => Vec::new(),
            };
            if end == "release" {
                store.release(&x.b.handle).await.unwrap();
            } else {
                complete(&l, &store, &x, &outs).await;
            }
            check(&ctx, &l, true, &what).await;
            settle(&ctx, &l, &store, run, &what).await;
            check(&ctx, &l, true, &what).await;
            let got = published_copy(&ctx, "a", v).await;
            let want = match end {
                "publish" | "prefix-retry" => Some(b[0]),
                _ => Some(a),
            };
            assert_eq!(got, want, "{what}: A {} B {}", short(a), short(b[0]));
            assert_eq!(published_copy(&ctx, "a", v + 1).await, Some(b[1]), "{what}");
            if matches!(end, "retry" | "release" | "park") {
                // Version v was handed out as B, then as A: two copies of it may be at the
                // broker (B's delivery uncertain or never known). Contract-conform (A is the
                // first appended of those committed when v goes out again); reported.
                let two = l.g().two_copies_sent.clone();
                assert_eq!(two.len(), 1, "{what}: {two:?}");
            }
            ctx.drop().await;
        })
        .await;
    }
}

/// A batch [v, v+1] (A, lower ids, v+1 blocked at insert) held open while a single copy B of
/// v+1 commits: the claim meets B alone (held as a gap, or with accept_first on a fresh
/// aggregate taken as its first version). Then the batch commits, in time or after the gap
/// timeout parked B. Also the other id order: B appended first, committing after the batch's
/// head went out.
#[tokio::test]
async fn a_batch_with_a_blocked_copy_commits_after_a_single_copy() {
    for (order, late) in [
        ("batch-first", false),
        ("batch-first", true),
        ("single-first", false),
    ] {
        each_config(true, |ctx, store, run, fresh, what| async move {
            let what = format!("{order} late={late} {what}");
            let l = L::default();
            let v = prelude(&ctx, &l, &store, "a", fresh, &what).await;
            let accept = what.contains("accept_first=true") && fresh;
            let (a, b);
            if order == "batch-first" {
                let mut t1 = open(&ctx).await;
                a = t1.put(&store, &l, "a", &[v, v + 1]).await;
                let mut t2 = open(&ctx).await;
                b = t2.put(&store, &l, "a", &[v + 1]).await[0];
                t2.commit(&l).await;
                let c = claim(&l, &store, "x", 10, run).await;
                if accept {
                    // The first version seen is accepted: B goes out as v+1.
                    assert_eq!(c.ids(), vec![b], "{what}");
                    complete(&l, &store, &c, &outcomes(&c.b, usize::MAX, None)).await;
                } else {
                    assert!(c.b.records.is_empty(), "{what}: {:?}", layout(&c.b));
                    assert_eq!(c.b.gaps_held, 1, "{what}");
                    store.release(&c.b.handle).await.unwrap();
                }
                check(&ctx, &l, true, &what).await;
                if late {
                    tokio::time::sleep(Duration::from_millis(450)).await;
                    let c = claim(&l, &store, "x", 10, run).await;
                    assert!(c.b.records.is_empty(), "{what}: {:?}", layout(&c.b));
                    store.release(&c.b.handle).await.unwrap();
                    check(&ctx, &l, true, &what).await;
                }
                t1.commit(&l).await;
                check(&ctx, &l, true, &what).await;
                settle(&ctx, &l, &store, run, &what).await;
                if !accept {
                    assert_eq!(published_copy(&ctx, "a", v).await, Some(a[0]), "{what}");
                    assert_eq!(published_copy(&ctx, "a", v + 1).await, Some(a[1]), "{what}");
                } else {
                    assert_eq!(published_copy(&ctx, "a", v).await, None, "{what}");
                    assert_eq!(published_copy(&ctx, "a", v + 1).await, Some(b), "{what}");
                }
            } else {
                let mut t2 = open(&ctx).await;
                b = t2.put(&store, &l, "a", &[v + 1]).await[0];
                let mut t1 = open(&ctx).await;
                a = t1.put(&store, &l, "a", &[v, v + 1]).await;
                t1.commit(&l).await;
                let x = claim(&l, &store, "x", 10, run).await;
                let want = if run > 1 { a.clone() } else { vec![a[0]] };
                assert_eq!(x.ids(), want, "{what}: {:?}", layout(&x.b));
                t2.commit(&l).await;
                let y = claim(&l, &store, "y", 10, run).await;
                assert!(y.b.records.is_empty(), "{what}: {:?}", layout(&y.b));
                store.release(&y.b.handle).await.unwrap();
                complete(&l, &store, &x, &outcomes(&x.b, 1, Some(retry))).await;
                check(&ctx, &l, true, &what).await;
                settle(&ctx, &l, &store, run, &what).await;
                assert_eq!(published_copy(&ctx, "a", v).await, Some(a[0]), "{what}");
                // With a run, A's v+1 was handed out (and retried) before B committed; B, the
                // lower id, is the head after that.
                assert_eq!(published_copy(&ctx, "a", v + 1).await, Some(b), "{what}");
            }
            ctx.drop().await;
        })
        .await;
    }
}

/// f30d801's shape with the commits out of id order: [stale v-1, A at v] (A blocked behind the
/// stale row) held open, a single copy B of v commits and goes out; the batch commits while B
/// is in flight. And the other id order: B appended first and committing while A (promoted
/// once the stale row is parked) is in flight. The claim ends published, retried or released.
#[tokio::test]
async fn a_stale_row_before_the_first_copy_commits_out_of_id_order() {
    for order in ["batch-first", "single-first"] {
        for end in ["publish", "retry", "release"] {
            each_config(false, |ctx, store, run, fresh, what| async move {
                let what = format!("{order} {end} {what}");
                let l = L::default();
                let v = prelude(&ctx, &l, &store, "a", fresh, &what).await;
                let (a, b, x);
                if order == "batch-first" {
                    let mut t1 = open(&ctx).await;
                    a = t1.put(&store, &l, "a", &[v - 1, v]).await[1];
                    let mut t2 = open(&ctx).await;
                    b = t2.put(&store, &l, "a", &[v]).await[0];
                    t2.commit(&l).await;
                    x = claim(&l, &store, "x", 10, run).await;
                    assert_eq!(x.ids(), vec![b], "{what}");
                    t1.commit(&l).await;
                } else {
                    let mut t2 = open(&ctx).await;
                    b = t2.put(&store, &l, "a", &[v]).await[0];
                    let mut t1 = open(&ctx).await;
                    a = t1.put(&store, &l, "a", &[v - 1, v]).await[1];
                    t1.commit(&l).await;
                    // The stale row is parked and A promoted; a later claim hands A out.
                    let mut got = None;
                    for _ in 0..3 {
                        let c = claim(&l, &store, "x", 10, run).await;
                        check(&ctx, &l, true, &what).await;
                        if !c.b.records.is_empty() {
                            got = Some(c);
                            break;
                        }
                        store.release(&c.b.handle).await.unwrap();
                    }
                    x = got.expect("A handed out");
                    assert_eq!(x.ids(), vec![a], "{what}");
                    t2.commit(&l).await;
                }
                let y = claim(&l, &store, "y", 10, run).await;
                assert!(y.b.records.is_empty(), "{what}: {:?}", layout(&y.b));
                store.release(&y.b.handle).await.unwrap();
                check(&ctx, &l, true, &what).await;
                match end {
                    "publish" => complete(&l, &store, &x, &outcomes(&x.b, 1, None)).await,
                    "retry" => complete(&l, &store, &x, &outcomes(&x.b, 0, Some(retry))).await,
                    _ => store.release(&x.b.handle).await.unwrap(),
                }
                check(&ctx, &l, true, &what).await;
                settle(&ctx, &l, &store, run, &what).await;
                let first_out = x.ids()[0];
                let other = if first_out == a { b } else { a };
                // Published: the copy that went out; otherwise the lower id of the two (both
                // committed when v goes out again).
                let want = if end == "publish" {
                    first_out
                } else if order == "batch-first" {
                    a
                } else {
                    b
                };
                assert_eq!(
                    published_copy(&ctx, "a", v).await,
                    Some(want),
                    "{what}: first out {} other {}",
                    short(first_out),
                    short(other)
                );
                ctx.drop().await;
            })
            .await;
        }
    }
}

/// Two transactions with versions v..v+2 (A, lower ids) and v+1..v+2 (B): B commits first
/// (held as a gap, or accepted first on a fresh aggregate with accept_first), A later. Runs
/// stop before each duplicate; the first copies go out, B's are parked out of order (or, B
/// accepted first, A's v below it and the copies of what B sent before A committed are).
#[tokio::test]
async fn later_versions_of_a_lower_id_transaction_commit_last() {
    each_config(true, |ctx, store, run, fresh, what| async move {
        let l = L::default();
        let v = prelude(&ctx, &l, &store, "a", fresh, &what).await;
        let accept = what.contains("accept_first=true") && fresh;
        let mut t1 = open(&ctx).await;
        let a = t1.put(&store, &l, "a", &[v, v + 1, v + 2]).await;
        let mut t2 = open(&ctx).await;
        let b = t2.put(&store, &l, "a", &[v + 1, v + 2]).await;
        t2.commit(&l).await;
        let c = claim(&l, &store, "x", 10, run).await;
        let outs = outcomes(&c.b, usize::MAX, None);
        complete(&l, &store, &c, &outs).await;
        check(&ctx, &l, true, &what).await;
        t1.commit(&l).await;
        // Claims with runs meet A's rows beside B's.
        let c = claim(&l, &store, "x", 10, run).await;
        for r in &c.b.records {
            assert!(
                r.run_position == 0,
                "{what}: a run across duplicates {:?}",
                layout(&c.b)
            );
        }
        let outs = outcomes(&c.b, usize::MAX, None);
        complete(&l, &store, &c, &outs).await;
        check(&ctx, &l, true, &what).await;
        settle(&ctx, &l, &store, run, &what).await;
        for (k, want) in [(0, a[0]), (1, a[1]), (2, a[2])] {
            let got = published_copy(&ctx, "a", v + k).await;
            if accept {
                // B's v+1 was taken as the first version; its v+2 too when it went out in
                // B's run before A committed; else A's v+2, the lower id, is the head of v+2
                // once A committed (f30d801: B's v+2 is a follower of A's blocked copy).
                let want = match k {
                    0 => None,
                    1 => Some(b[0]),
                    _ if run > 1 => Some(b[1]),
                    _ => Some(a[2]),
                };
                assert_eq!(got, want, "{what} v{}", v + k);
            } else {
                assert_eq!(got, Some(want), "{what} v{}", v + k);
            }
        }
        ctx.drop().await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// 2. A lost head lease with duplicates.
// ---------------------------------------------------------------------------------------------

/// Lease 0.3 s. The head (with a run of [1, 2] when `run` is 3) is leased by relay x; a second
/// copy waits: a later-id copy of 1 and of 2 appended during the lease, or a lower-id copy of
/// 1 (or of 2) that was appended before the head and commits during the lease. The lease expires. x
/// completes late (publications, a published prefix and a retry, a retry, a park), before any
/// takeover, after relay y's takeover claim, or after y completed. A late completion after a
/// takeover is refused whole; one before it applies (no relay took the aggregate over); the
/// first copy of each version committed when it goes out is the one published.
#[tokio::test]
async fn a_lost_head_lease_with_a_second_copy_waiting() {
    for copy in ["later", "lower", "lower2"] {
        for late in ["publish", "prefix-retry", "retry", "park"] {
            for when in [
                "before-takeover",
                "after-takeover",
                "after-takeover-completed",
            ] {
                for run in [1, 3] {
                    for accept_first in [false, true] {
                        lost_lease_case(copy, late, when, run, accept_first).await;
                    }
                }
            }
        }
    }
}

async fn lost_lease_case(copy: &str, late: &str, when: &str, run: usize, accept_first: bool) {
    let what = format!("copy={copy} late={late} when={when} run={run} accept_first={accept_first}");
    let Some(ctx) = Ctx::new(8).await else {
        return;
    };
    let store = store_with(&ctx, lease(0.3), accept_first, LONG_GAP);
    store.migrate().await.unwrap();
    let l = L::default();
    let mut lower = None;
    let mut lower2 = None;
    let mut t1 = None;
    if copy == "lower" {
        let mut t = open(&ctx).await;
        lower = Some(t.put(&store, &l, "a", &[1]).await[0]);
        t1 = Some(t);
    } else if copy == "lower2" {
        // A lower-id copy of version 2 (the run's second row, or the blocked row behind the
        // head).
        let mut t = open(&ctx).await;
        lower2 = Some(t.put(&store, &l, "a", &[2]).await[0]);
        t1 = Some(t);
    }
    let h = append_now(&ctx, &store, &l, "a", &[1, 2]).await;
    let x = claim(&l, &store, "x", 10, run).await;
    let want: Vec<Uuid> = if run > 1 { h.clone() } else { vec![h[0]] };
    assert_eq!(x.ids(), want, "{what}");
    let mut later = Vec::new();
    if let Some(t) = t1 {
        t.commit(&l).await;
    } else {
        later = append_now(&ctx, &store, &l, "a", &[1]).await;
        later.extend(append_now(&ctx, &store, &l, "a", &[2]).await);
    }
    // During the lease nobody else gets the aggregate.
    let y0 = claim(&l, &store, "y", 10, run).await;
    assert!(y0.b.records.is_empty(), "{what}: {:?}", layout(&y0.b));
    store.release(&y0.b.handle).await.unwrap();
    check(&ctx, &l, true, &what).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let late_outs = match late {
        "publish" => outcomes(&x.b, usize::MAX, None),
        "prefix-retry" => outcomes(&x.b, 1, Some(retry)),
        "retry" => outcomes(&x.b, 0, Some(retry)),
        _ => outcomes(&x.b, 0, Some(park)),
    };
    let mut y = None;
    if when != "before-takeover" {
        let c = claim(&l, &store, "y", 10, run).await;
        // The takeover hands out the head again: the first appended copy committed now (the
        // lower-id copy when there is one), flagged as possibly sent; never a run across the
        // copies of 1 or 2.
        let head = lower.unwrap_or(h[0]);
        assert_eq!(c.ids().first(), Some(&head), "{what}: {:?}", layout(&c.b));
        assert!(
            c.b.records[0].maybe_sent_before,
            "{what}: the expired lease covered v1"
        );
        if copy == "later" {
            assert_eq!(c.ids().len(), 1, "{what}: the copy of 2 ends the run");
        }
        if when == "after-takeover-completed" {
            complete(&l, &store, &c, &outcomes(&c.b, usize::MAX, None)).await;
        } else {
            y = Some(c);
        }
        check(&ctx, &l, true, &what).await;
    }
    let rep = try_complete(&l, &store, &x, &late_outs).await.unwrap();
    println!("{what}: late completion {rep:?}");
    if when == "before-takeover" {
        assert_eq!(
            rep.superseded, 0,
            "{what}: nobody took the aggregate over: {rep:?}"
        );
        assert_eq!(rep.applied, late_outs.len(), "{what}: {rep:?}");
    } else {
        assert_eq!(
            rep.applied, 0,
            "{what}: a late completion after a takeover: {rep:?}"
        );
        assert_eq!(rep.superseded, late_outs.len(), "{what}: {rep:?}");
    }
    check(&ctx, &l, true, &what).await;
    if let Some(c) = y {
        complete(&l, &store, &c, &outcomes(&c.b, usize::MAX, None)).await;
        check(&ctx, &l, true, &what).await;
    }
    settle(&ctx, &l, &store, run, &what).await;
    check(&ctx, &l, true, &what).await;
    // Version 1: x's copy when its late publication applied, else the first appended of those
    // committed when 1 went out again.
    let x_published = when == "before-takeover" && late != "retry" && late != "park";
    let want1 = if x_published {
        h[0]
    } else {
        lower.unwrap_or(h[0])
    };
    assert_eq!(published_copy(&ctx, "a", 1).await, Some(want1), "{what}");
    // Version 2: the batch's copy (its later-id copy was appended after it), unless a lower-id
    // copy committed before 2 went out (x's late publication of its run sent the batch's).
    let x_sent_2 = x_published && run > 1 && late == "publish";
    let want2 = if x_sent_2 {
        h[1]
    } else {
        lower2.unwrap_or(h[1])
    };
    assert_eq!(published_copy(&ctx, "a", 2).await, Some(want2), "{what}");
    for id in later {
        let st: String = sqlx::query_scalar(&format!(
            "SELECT status FROM \"{}\".outbox_events WHERE event_id = $1",
            ctx.schema
        ))
        .bind(id)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_ne!(st, "published", "{what}: a later copy went out");
    }
    ctx.drop().await;
}

/// The same in locked mode: the claim's transaction is ended by the server
/// (`locked_max_hold` 300 ms: idle_in_transaction_session_timeout) while a second copy waits.
/// Relay y (another store instance, or the same one, which sweeps the dead claim) takes the
/// aggregate over; x's late completion fails as a lost claim or is refused, and changes
/// nothing.
#[tokio::test]
async fn a_lost_locked_claim_with_a_second_copy_waiting() {
    for copy in ["later", "lower"] {
        for late in ["publish", "retry", "park"] {
            for same in [false, true] {
                for run in [1, 3] {
                    for accept_first in [false, true] {
                        let what = format!(
                            "locked copy={copy} late={late} same_instance={same} run={run} \
                             accept_first={accept_first}"
                        );
                        let Some(ctx) = Ctx::new(8).await else {
                            return;
                        };
                        let xs = locked_store(&ctx, accept_first, Duration::from_millis(300));
                        xs.migrate().await.unwrap();
                        let ys = if same {
                            xs.clone()
                        } else {
                            locked_store(&ctx, accept_first, Duration::from_secs(30))
                        };
                        let l = L::default();
                        let mut lower = None;
                        let mut t1 = None;
                        if copy == "lower" {
                            let mut t = open(&ctx).await;
                            lower = Some(t.put(&xs, &l, "a", &[1]).await[0]);
                            t1 = Some(t);
                        }
                        let h = append_now(&ctx, &xs, &l, "a", &[1, 2]).await;
                        let x = claim(&l, &xs, "x", 10, run).await;
                        let want: Vec<Uuid> = if run > 1 { h.clone() } else { vec![h[0]] };
                        assert_eq!(x.ids(), want, "{what}");
                        if let Some(t) = t1 {
                            t.commit(&l).await;
                        } else {
                            append_now(&ctx, &xs, &l, "a", &[1]).await;
                            append_now(&ctx, &xs, &l, "a", &[2]).await;
                        }
                        let y0 = claim(&l, &ys, "y", 10, run).await;
                        assert!(y0.b.records.is_empty(), "{what}: {:?}", layout(&y0.b));
                        ys.release(&y0.b.handle).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let c = claim(&l, &ys, "y", 10, run).await;
                        let head = lower.unwrap_or(h[0]);
                        assert_eq!(c.ids().first(), Some(&head), "{what}: {:?}", layout(&c.b));
                        let late_outs = match late {
                            "publish" => outcomes(&x.b, usize::MAX, None),
                            "retry" => outcomes(&x.b, 0, Some(retry)),
                            _ => outcomes(&x.b, 0, Some(park)),
                        };
                        match try_complete(&l, &xs, &x, &late_outs).await {
                            Ok(rep) => assert_eq!(rep.applied, 0, "{what}: {rep:?}"),
                            Err(e) => assert_eq!(
                                e.kind,
                                outbox_core::StoreErrorKind::LeaseLost,
                                "{what}: {e:?}"
                            ),
                        }
                        check(&ctx, &l, true, &what).await;
                        complete(&l, &ys, &c, &outcomes(&c.b, usize::MAX, None)).await;
                        settle(&ctx, &l, &ys, run, &what).await;
                        assert_eq!(published_copy(&ctx, "a", 1).await, Some(head), "{what}");
                        assert_eq!(published_copy(&ctx, "a", 2).await, Some(h[1]), "{what}");
                        ctx.drop().await;
                    }
                }
            }
        }
    }
}

/// Mixed modes: a lease relay x holds the head H of version 1 (lease 0.3 s) while a lower-id
/// copy A of version 1, appended before H in a transaction held open, commits. The lease
/// expires and a locked-mode relay y (a store of the other mode on the same table) takes the
/// aggregate over: A, the first appended copy committed now, is its head. y ends its claim
/// (publishing A, or retrying it), then x completes late with H published. x's claim no longer
/// owns the aggregate (y's claim took it over and ended): its late completion must be refused
/// (fencing), as it is when the takeover is a lease claim
/// (`a_lost_head_lease_with_a_second_copy_waiting`, copy=lower, after-takeover-completed).
///
/// FINDING (adv45): a locked claim takes an expired lease's aggregate over without touching the
/// lease columns of its state row, so x's token still matches and x's late completion is
/// applied: with y_end=publish version 1 ends up published twice, from A (row 1) and from H
/// (row 2); with y_end=retry, H is published over y's retry. Minimal reproduction (run 1,
/// accept_first off, y_end=publish): T1 `BEGIN; append a v1` (row 1, A, left open);
/// `append_many [a v1, a v2]` committed (rows 2 H, 3 blocked); x (lease 0.3 s) claims row 2;
/// T1 commits; after 0.4 s a LockedTransaction store's claim hands out row 1 (row 2 becomes a
/// blocked follower) and publishes it (last_version 1); x completes row 2 as published:
/// CompletionReport { applied: 1, superseded: 0 }, and the table holds rows 1 and 2 both
/// `published` at version 1 (row 3 pending, unblocked); with run 3 x's late completion also
/// publishes row 3 (version 2, in x's run). The window is until the next claim of the
/// aggregate: it parks row 2 as out of order (y_end=publish-and-next: the late completion then
/// finds no pending row and is refused; that variant passes).
#[tokio::test]
async fn a_lease_lost_to_a_locked_relay_with_a_lower_copy() {
    // ADV45_Y_END and ADV45_RUN pick one variant (each fails on its own).
    let only = std::env::var("ADV45_Y_END").ok();
    let only_run: Option<usize> = common::env_seed("ADV45_RUN").map(|r| r as usize);
    for y_end in ["publish", "publish-and-next", "retry"] {
        if only.as_deref().is_some_and(|o| o != y_end) {
            continue;
        }
        for run in [1, 3] {
            if only_run.is_some_and(|r| r != run) {
                continue;
            }
            for accept_first in [false, true] {
                let what = format!("y_end={y_end} run={run} accept_first={accept_first}");
                let Some(ctx) = Ctx::new(8).await else {
                    return;
                };
                let xs = store_with(&ctx, lease(0.3), accept_first, LONG_GAP);
                xs.migrate().await.unwrap();
                let ys = store_with(&ctx, ClaimMode::LockedTransaction, accept_first, LONG_GAP);
                let l = L::default();
                let mut t1 = open(&ctx).await;
                let a = t1.put(&xs, &l, "a", &[1]).await[0];
                let h = append_now(&ctx, &xs, &l, "a", &[1, 2]).await;
                let x = claim(&l, &xs, "x", 10, run).await;
                assert_eq!(x.ids()[0], h[0], "{what}");
                t1.commit(&l).await;
                let y0 = claim(&l, &ys, "y", 10, run).await;
                assert!(
                    y0.b.records.is_empty(),
                    "{what}: the lease holds: {:?}",
                    layout(&y0.b)
                );
                ys.release(&y0.b.handle).await.unwrap();
                tokio::time::sleep(Duration::from_millis(400)).await;
                let y = claim(&l, &ys, "y", 10, run).await;
                assert_eq!(y.ids(), vec![a], "{what}: {:?}", layout(&y.b));
                match y_end {
                    "retry" => complete(&l, &ys, &y, &outcomes(&y.b, 0, Some(retry))).await,
                    _ => complete(&l, &ys, &y, &outcomes(&y.b, usize::MAX, None)).await,
                }
                if y_end == "publish-and-next" {
                    // Version 2 goes out too (the locked relay), after a claim parked H as
                    // out of order: x's late completion then finds no pending row to write.
                    for _ in 0..3 {
                        let z = claim(&l, &ys, "z", 10, run).await;
                        if z.b.records.is_empty() {
                            ys.release(&z.b.handle).await.unwrap();
                            continue;
                        }
                        assert_eq!(z.ids(), vec![h[1]], "{what}: {:?}", layout(&z.b));
                        complete(&l, &ys, &z, &outcomes(&z.b, usize::MAX, None)).await;
                        break;
                    }
                }
                check(&ctx, &l, true, &what).await;
                let late = outcomes(&x.b, usize::MAX, None);
                let rep = try_complete(&l, &xs, &x, &late).await.unwrap();
                println!("{what}: x's late completion {rep:?}");
                let st = rows(&ctx).await;
                println!("{what}: rows after it:{}", dump(&st, &l.g()));
                check(&ctx, &l, true, &what).await;
                assert_eq!(
                    (rep.applied, rep.superseded),
                    (0, late.len()),
                    "{what}: a completion after a takeover is fenced"
                );
                settle(&ctx, &l, &xs, run, &what).await;
                check(&ctx, &l, true, &what).await;
                ctx.drop().await;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Mixed relays: a lease store and a locked store on one table, producers committing out of
//    id order, randomized.
// ---------------------------------------------------------------------------------------------

/// xorshift64*: a small seeded generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The statements of one business transaction: versions (new ones from `next`, or copies).
fn shape(rng: &mut Rng, next: &mut i64) -> Vec<Vec<i64>> {
    let n = *next;
    match rng.below(8) {
        0 | 1 => {
            let k = 1 + rng.below(3) as i64;
            *next += k;
            vec![(n..n + k).collect()]
        }
        // A copy of a recent version alone (its first copy may still be uncommitted).
        2 => vec![vec![(n - 1 - rng.below(2) as i64).max(1)]],
        // A stale copy in front of new versions (the first of them blocked behind it), and
        // sometimes a second copy of that version alone (f30d801's shape once the stale row
        // is parked).
        3 => {
            *next += 2;
            let mut stmts = vec![vec![(n - 1).max(1), n, n + 1]];
            if rng.below(2) == 0 {
                stmts.push(vec![n]);
            }
            stmts
        }
        // New versions, then a copy of the first of them alone in the same transaction.
        4 => {
            *next += 2;
            vec![vec![n, n + 1], vec![n]]
        }
        // A copy of the next version alone, then the rest in one batch (its first row a
        // second copy, unblocked).
        5 => {
            *next += 2;
            vec![vec![n], vec![n, n + 1]]
        }
        _ => {
            *next += 1;
            vec![vec![n]]
        }
    }
}

async fn mixed_relays(seed: u64) {
    let mut rng = Rng(seed);
    let accept_first = rng.below(2) == 0;
    let short_lease = rng.below(3) == 0;
    let lease_secs = if short_lease { 0.5 } else { 30.0 };
    println!(
        "mixed_relays seed {seed} (set ADV45_SEED to replay): accept_first {accept_first}, \
         lease {lease_secs} s"
    );
    let Some(ctx) = Ctx::new(24).await else {
        return;
    };
    let gap = Duration::from_secs(2);
    let lease_store = store_with(&ctx, lease(lease_secs), accept_first, gap);
    lease_store.migrate().await.unwrap();
    let locked = store_with(&ctx, ClaimMode::LockedTransaction, accept_first, gap);
    let ctx = Arc::new(ctx);
    let l = L::default();
    let stop_producers = Arc::new(AtomicBool::new(false));
    let stop_relays = Arc::new(AtomicBool::new(false));
    let next: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
    // aggregate -> (relay, claim token) of the claim that holds it (long leases only: short
    // ones expire on purpose).
    let inflight: Arc<Mutex<HashMap<String, (String, Uuid)>>> = Arc::default();
    let fenced = Arc::new(std::sync::atomic::AtomicUsize::new(0));

    let mut producers = Vec::new();
    for p in 0..3u64 {
        let (ctx, store, l, stop, next) = (
            ctx.clone(),
            lease_store.clone(),
            l.clone(),
            stop_producers.clone(),
            next.clone(),
        );
        let mut rng = Rng(seed ^ (p + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        producers.push(tokio::spawn(async move {
            let mut txs = 0;
            while !stop.load(Ordering::SeqCst) {
                let agg = format!("m{}", rng.below(3));
                if rng.below(5) == 0 {
                    // Two transactions: a copy of n alone (the lower id) held open while
                    // [n, n+1] (higher ids) commits and may go out; then the copy commits (or
                    // rolls back: n has a committed copy anyway).
                    let n = {
                        let mut g = next.lock().unwrap();
                        let n = g.entry(agg.clone()).or_insert(1);
                        *n += 2;
                        *n - 2
                    };
                    let mut ta = open(&ctx).await;
                    ta.put(&store, &l, &agg, &[n]).await;
                    let mut tb = open(&ctx).await;
                    tb.put(&store, &l, &agg, &[n, n + 1]).await;
                    tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                    tb.commit(&l).await;
                    tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
                    txs += 2;
                    if rng.below(8) == 0 {
                        ta.rollback(&l).await;
                    } else {
                        ta.commit(&l).await;
                    }
                    continue;
                }
                let stmts = {
                    let mut g = next.lock().unwrap();
                    let n = g.entry(agg.clone()).or_insert(1);
                    shape(&mut rng, n)
                };
                // A transaction that rolls back is retried (new event ids), so every version
                // gets a committed copy; the retry commits after others that started later.
                loop {
                    let mut t = open(&ctx).await;
                    for vs in &stmts {
                        t.put(&store, &l, &agg, vs).await;
                        if rng.below(2) == 0 {
                            tokio::time::sleep(Duration::from_millis(rng.below(30))).await;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(rng.below(60))).await;
                    txs += 1;
                    if rng.below(8) == 0 {
                        t.rollback(&l).await;
                    } else {
                        t.commit(&l).await;
                        break;
                    }
                }
            }
            txs
        }));
    }

    let mut relays = Vec::new();
    for (i, store) in [
        lease_store.clone(),
        locked.clone(),
        lease_store.clone(),
        locked.clone(),
    ]
    .into_iter()
    .enumerate()
    {
        let (l, stop, inflight, fenced) = (
            l.clone(),
            stop_relays.clone(),
            inflight.clone(),
            fenced.clone(),
        );
        let mut rng = Rng(seed ^ (i as u64 + 11).wrapping_mul(0x2545_f491_4f6c_dd1d));
        let run = 1 + rng.below(4) as usize;
        let owner = format!("relay{i}-{}", if i % 2 == 0 { "lease" } else { "locked" });
        println!("{owner}: run {run}");
        relays.push(tokio::spawn(async move {
            let mut claims = 0;
            while !stop.load(Ordering::SeqCst) {
                let limit = 1 + rng.below(6) as usize;
                let c = claim(&l, &store, &owner, limit, run).await;
                claims += 1;
                let aggs: HashSet<String> =
                    c.b.records
                        .iter()
                        .map(|r| r.envelope.aggregate_id.clone())
                        .collect();
                if !short_lease {
                    let mut f = inflight.lock().unwrap();
                    for a in &aggs {
                        if let Some(o) = f.insert(a.clone(), (owner.clone(), c.b.handle.token)) {
                            panic!("seed {seed}: {a} handed to {owner} while {o:?} holds it");
                        }
                    }
                }
                // Runs: consecutive versions after their head.
                for w in c.b.records.windows(2) {
                    if w[1].run_position > 0 {
                        assert_eq!(
                            w[1].envelope.aggregate_version,
                            w[0].envelope.aggregate_version + 1,
                            "seed {seed}: {:?}",
                            layout(&c.b)
                        );
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.below(10))).await;
                if short_lease && i % 2 == 0 && !c.b.records.is_empty() && rng.below(8) == 0 {
                    // Outlive the lease: another relay may take the aggregate over.
                    tokio::time::sleep(Duration::from_millis(600)).await;
                }
                let outs = match rng.below(20) {
                    0..=11 => Some(outcomes(&c.b, usize::MAX, None)),
                    12 | 13 => Some(outcomes(&c.b, rng.below(3) as usize, Some(retry))),
                    14 | 15 => Some(outcomes(&c.b, rng.below(3) as usize, None)),
                    16 => Some(outcomes(&c.b, rng.below(2) as usize, Some(park))),
                    _ => None,
                };
                if !short_lease {
                    let mut f = inflight.lock().unwrap();
                    for a in &aggs {
                        f.remove(a);
                    }
                }
                match outs {
                    Some(outs) => {
                        let rep = try_complete(&l, &store, &c, &outs).await.unwrap();
                        if !short_lease {
                            assert_eq!(rep.superseded, 0, "seed {seed}: {owner}: {rep:?}");
                        }
                        fenced.fetch_add(rep.superseded, Ordering::SeqCst);
                    }
                    None => store.release(&c.b.handle).await.unwrap(),
                }
                if c.b.records.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
            claims
        }));
    }

    // Checks while everything runs (not quiet: publications may be in the database before
    // the ledger has them).
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(400)).await;
        check(&ctx, &l, false, &format!("seed {seed}")).await;
    }
    stop_producers.store(true, Ordering::SeqCst);
    let mut txs = 0;
    for p in producers {
        txs += p.await.unwrap();
    }
    // Let the relays drain.
    let deadline = Instant::now() + Duration::from_secs(6);
    loop {
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events WHERE status = 'pending'",
            ctx.schema
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if left == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_relays.store(true, Ordering::SeqCst);
    let mut claims = 0;
    for r in relays {
        claims += r.await.unwrap();
    }
    let what = format!("seed {seed}");
    check(&ctx, &l, true, &what).await;
    settle(&ctx, &l, &lease_store, 3, &what).await;
    check(&ctx, &l, true, &what).await;
    // Every version with a committed copy went out once, unless all its copies were parked
    // out of order (explained by the check: they committed after a higher version went out,
    // or by the end-of-test operator's discards of rows at or below `last`).
    let rows = rows(&ctx).await;
    let mut by_version: BTreeMap<(String, i64), Vec<&Row>> = BTreeMap::new();
    for r in &rows {
        by_version
            .entry((r.aggregate_id.clone(), r.aggregate_version))
            .or_default()
            .push(r);
    }
    let mut skipped = Vec::new();
    for ((a, v), copies) in &by_version {
        let out = copies.iter().any(|r| r.status == "published");
        let all_ooo = copies.iter().all(|r| {
            r.status == "discarded"
                || r.status == "parked" && r.park_kind.as_deref() == Some("out_of_order")
        });
        if !out && !all_ooo {
            skipped.push(format!("{a} v{v}"));
        }
    }
    assert!(
        skipped.is_empty(),
        "{what}: versions neither published nor parked out of order: {skipped:?}\nrows:{}",
        dump(&rows, &l.g())
    );
    let parked: BTreeMap<String, usize> =
        rows.iter()
            .filter(|r| r.status != "published")
            .fold(BTreeMap::new(), |mut m, r| {
                *m.entry(format!(
                    "{}:{}",
                    r.status,
                    r.park_kind.clone().unwrap_or_default()
                ))
                .or_insert(0) += 1;
                m
            });
    let published = rows.iter().filter(|r| r.status == "published").count();
    let two = l.g().two_copies_sent.len();
    println!(
        "{what}: {txs} transactions, {claims} claims, {} rows, {published} published, \
         others {parked:?}, {} late outcomes fenced, {two} versions handed out as two copies",
        rows.len(),
        fenced.load(Ordering::SeqCst),
    );
    let ctx = Arc::try_unwrap(ctx).ok().expect("ctx");
    ctx.drop().await;
}

#[tokio::test]
async fn mixed_lease_and_locked_relays_with_out_of_order_commits() {
    let seed = common::env_seed("ADV45_SEED").unwrap_or_else(common::clock_seed);
    mixed_relays(seed).await;
}
