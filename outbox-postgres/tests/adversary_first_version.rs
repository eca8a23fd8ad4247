//! Adversary pass on issue 20, item 1: an aggregate's last version stays unknown (NULL) until a
//! publication or a discard, so that `accept_first_version` accepts the aggregate's first
//! version again after a claim that did not publish. Attacked here: every way a claim can end
//! without a publication, a lower version that commits late against a first version that may
//! already be at the broker, operator actions on an aggregate without state, and a first claim
//! raced by a late lower version.
//!
//! Interleavings are forced: a producer's transaction is held open, a lease is ended through
//! its state row (as its expiry would), a locked claim's connection is dropped (as a crash
//! would).
//!
//! Tests marked `// FOUND` reproduced a defect; the others held.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, ErrorClass, LastError, Outcome, ParkKind, StoreErrorKind};
use outbox_postgres::PostgresOutboxStore;

use common::{claim, event, lease, park, publish_all, versions};

/// A store that accepts an aggregate's lowest unfinished version as its first (or not).
async fn store(ctx: &common::Ctx, mode: ClaimMode, accept_first: bool) -> PostgresOutboxStore {
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first)
        .gap_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    store
}

fn modes() -> [ClaimMode; 2] {
    [lease(30.0), ClaimMode::LockedTransaction]
}

fn tag(mode: ClaimMode) -> &'static str {
    if matches!(mode, ClaimMode::Lease { .. }) {
        "lease"
    } else {
        "locked"
    }
}

/// A transient failure of kind `kind` (`timeout`: the broker may have stored the record).
fn transient(kind: &str) -> LastError {
    LastError {
        class: ErrorClass::Transient,
        kind: kind.into(),
        message: "injected".into(),
    }
}

/// `(status, park_kind)` of `e`.
async fn row(ctx: &common::Ctx, e: &Envelope) -> (String, Option<String>) {
    sqlx::query_as(&format!(
        "SELECT status, park_kind FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// `last_version` of `agg`'s state row (`None`: no row; `Some(None)`: unknown).
async fn last(ctx: &common::Ctx, agg: &str) -> Option<Option<i64>> {
    sqlx::query_scalar(&format!(
        "SELECT last_version FROM \"{}\".outbox_events_aggregate WHERE aggregate_id = $1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
}

/// Ends `agg`'s lease as its expiry would (the relay that held it is gone or slow).
async fn expire_lease(ctx: &common::Ctx, agg: &str) {
    let n = sqlx::query(&format!(
        "UPDATE \"{}\".outbox_events_aggregate \
            SET lease_until = clock_timestamp() - interval '1 millisecond' \
          WHERE aggregate_id = $1 AND lease_token IS NOT NULL",
        ctx.schema
    ))
    .bind(agg)
    .execute(&ctx.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "{agg} had a lease to expire");
}

/// Ends `batch`'s claim without a publication, as `how` says. `true` when the first version
/// may have reached the broker (the store can know it).
async fn end_without_publication(
    ctx: &common::Ctx,
    store: &PostgresOutboxStore,
    mode: ClaimMode,
    batch: &outbox_core::ClaimedBatch,
    how: &str,
) {
    let e = &batch.records[0].envelope;
    match how {
        "release" => store.release(&batch.handle).await.unwrap(),
        "certain_retry" | "uncertain_retry" | "uncertain_defer" => {
            let error = transient(if how == "certain_retry" {
                "queue_full"
            } else {
                "timeout"
            });
            let outcome = if how == "uncertain_defer" {
                Outcome::Defer {
                    event_id: e.event_id,
                    delay: Duration::ZERO,
                    error,
                }
            } else {
                Outcome::Retry {
                    event_id: e.event_id,
                    delay: Duration::ZERO,
                    error,
                }
            };
            let rep = store.complete(&batch.handle, &[outcome]).await.unwrap();
            assert_eq!(rep.applied, 1);
        }
        "expiry" => {
            assert!(matches!(mode, ClaimMode::Lease { .. }));
            expire_lease(ctx, &e.aggregate_id).await;
        }
        other => panic!("unknown ending {other}"),
    }
}

// FOUND: with `accept_first_version`, an aggregate whose first version (5) was sent and whose
// claim then ended without a publication (the lease expired under a relay that crashed after
// the broker stored it; a timeout or a broker outage, whose record may be stored) has no last
// version, so the next claim took the lowest unfinished version as the first again: a version
// 3 that committed meanwhile went out (after 5 was delivered), then 5 again. The consumers saw
// 5 before 3, what the option promises never to do ("a lower version that commits later is
// then parked as out of order"). Fix: for an aggregate without a last version, a version that
// may have been sent (`maybe_delivered`, or the row of a lease that ended without release) is
// the first; lower versions are out of order.
#[tokio::test]
async fn a_late_lower_version_never_follows_a_first_version_that_may_have_been_sent() {
    let ctx = ctx!(6);
    for mode in modes() {
        let store = store(&ctx, mode, true).await;
        let endings: &[&str] = if matches!(mode, ClaimMode::Lease { .. }) {
            &["expiry", "uncertain_retry", "uncertain_defer"]
        } else {
            &["uncertain_retry", "uncertain_defer"]
        };
        for how in endings {
            let agg = format!("sent-{}-{how}", tag(mode));
            let (v5, v6) = (event(&agg, 5), event(&agg, 6));
            store
                .append_many(&ctx.pool, &[v5.clone(), v6.clone()])
                .await
                .unwrap();
            let first = claim(&store, "a", 10).await;
            assert_eq!(versions(&first), vec![(agg.clone(), 5)], "{how}");
            // The relay sends v5 (the broker stores it), then the claim ends without outcome.
            end_without_publication(&ctx, &store, mode, &first, how).await;
            assert_eq!(
                last(&ctx, &agg).await.flatten(),
                None,
                "{how}: no last version"
            );
            // A lower version commits now.
            let v3 = event(&agg, 3);
            store.append(&ctx.pool, &v3).await.unwrap();
            let again = claim(&store, "b", 10).await;
            assert_eq!(
                versions(&again),
                vec![(agg.clone(), 5)],
                "{} {how}: v5 may be at the broker already; v3 must not go out after it \
                 (parked: {:?})",
                tag(mode),
                again.parked
            );
            assert!(again.records[0].is_resend(), "{how}: a re-send");
            assert_eq!(
                row(&ctx, &v3).await,
                ("parked".into(), Some("out_of_order".into())),
                "{how}"
            );
            // The relay gives v5 back (a shutdown); the operator cannot send v3 any more
            // (before v5 is published too) and discards it: v5 stays next.
            store.release(&again.handle).await.unwrap();
            let retry = store.retry_parked(v3.event_id, "ops").await.unwrap_err();
            assert_eq!(retry.kind, StoreErrorKind::Conflict, "{how}: {retry}");
            let reissue = store
                .reissue_parked(v3.event_id, "ops", "again")
                .await
                .unwrap_err();
            assert_eq!(reissue.kind, StoreErrorKind::Conflict, "{how}: {reissue}");
            store
                .discard_parked(v3.event_id, "ops", "late")
                .await
                .unwrap();
            assert_eq!(last(&ctx, &agg).await.flatten(), Some(4), "{how}");
            for v in [5, 6] {
                let next = claim(&store, "b", 10).await;
                assert_eq!(
                    versions(&next),
                    vec![(agg.clone(), v)],
                    "{how} (held {}, parked {:?})",
                    next.gaps_held,
                    next.parked
                );
                publish_all(&store, &next).await;
            }
            assert_eq!(last(&ctx, &agg).await.flatten(), Some(6), "{how}");
        }
    }
    ctx.drop().await;
}

/// The same race, but the first claim ended in a way that leaves no doubt the broker never got
/// version 5 (a release, a certain failure): the late version 3 is then the first, and goes
/// out before 5 (nothing is parked).
#[tokio::test]
async fn a_late_lower_version_goes_first_when_the_first_was_certainly_not_sent() {
    let ctx = ctx!(6);
    for mode in modes() {
        let store = store(&ctx, mode, true).await;
        for how in ["release", "certain_retry"] {
            let agg = format!("unsent-{}-{how}", tag(mode));
            let v5 = event(&agg, 5);
            store.append(&ctx.pool, &v5).await.unwrap();
            let first = claim(&store, "a", 10).await;
            assert_eq!(versions(&first), vec![(agg.clone(), 5)]);
            end_without_publication(&ctx, &store, mode, &first, how).await;
            let (v3, v4) = (event(&agg, 3), event(&agg, 4));
            store
                .append_many(&ctx.pool, &[v3.clone(), v4.clone()])
                .await
                .unwrap();
            for v in [3, 4, 5] {
                let b = claim(&store, "b", 10).await;
                assert_eq!(
                    versions(&b),
                    vec![(agg.clone(), v)],
                    "{} {how}: (held {}, parked {:?})",
                    tag(mode),
                    b.gaps_held,
                    b.parked
                );
                publish_all(&store, &b).await;
            }
        }
    }
    ctx.drop().await;
}

/// A late version 3 whose transaction is still open while two relays race for the aggregate's
/// first claim (version 5): one relay gets 5, the other nothing of the aggregate; once 3
/// commits it waits behind the lease, and after 5's publication it is parked as out of order.
/// Never published after 5.
#[tokio::test]
async fn two_relays_race_the_first_claim_while_a_lower_version_commits() {
    let ctx = ctx!(8);
    for mode in modes() {
        let a = store(&ctx, mode, true).await;
        let b = store(&ctx, mode, true).await;
        let agg = format!("race-{}", tag(mode));
        let v5 = event(&agg, 5);
        a.append(&ctx.pool, &v5).await.unwrap();
        let v3 = event(&agg, 3);
        let mut producer = ctx.pool.begin().await.unwrap();
        a.append(&mut *producer, &v3).await.unwrap();
        let (ca, cb) = tokio::join!(claim(&a, "a", 10), claim(&b, "b", 10));
        let (winner, store_w, loser, store_l) = if ca.is_empty() {
            (cb, &b, ca, &a)
        } else {
            (ca, &a, cb, &b)
        };
        assert_eq!(versions(&winner), vec![(agg.clone(), 5)], "{}", tag(mode));
        assert!(
            loser.is_empty(),
            "{}: both relays got the aggregate",
            tag(mode)
        );
        producer.commit().await.unwrap();
        let during = claim(store_l, "b", 10).await;
        assert!(
            during.is_empty() && during.parked.is_empty(),
            "{}: v3 went out or was decided while v5 is in flight: {:?}",
            tag(mode),
            versions(&during)
        );
        store_l.release(&during.handle).await.unwrap();
        publish_all(store_w, &winner).await;
        let after = claim(store_l, "b", 10).await;
        assert!(after.is_empty(), "{}: {:?}", tag(mode), versions(&after));
        assert_eq!(
            after.parked.iter().map(|p| p.kind).collect::<Vec<_>>(),
            vec![ParkKind::OutOfOrder],
            "{}",
            tag(mode)
        );
        assert_eq!(
            row(&ctx, &v3).await,
            ("parked".into(), Some("out_of_order".into()))
        );
        store_l.release(&after.handle).await.unwrap();
    }
    ctx.drop().await;
}

/// A lease taken over by another relay after expiry, then released by it: the aggregate still
/// has no last version; with `accept_first_version` its first version is handed out again (and
/// marked as a possible re-send, since the first lease ended without outcome).
#[tokio::test]
async fn a_takeover_after_expiry_then_a_release_leaves_the_first_version_accepted() {
    let ctx = ctx!(6);
    let store = store(&ctx, lease(30.0), true).await;
    let agg = "takeover";
    let (v7, v8) = (event(agg, 7), event(agg, 8));
    store
        .append_many(&ctx.pool, &[v7.clone(), v8.clone()])
        .await
        .unwrap();
    let first = claim(&store, "a", 10).await;
    expire_lease(&ctx, agg).await;
    let second = claim(&store, "b", 10).await;
    assert_eq!(versions(&second), vec![(agg.into(), 7)]);
    assert!(second.records[0].maybe_sent_before);
    store.release(&second.handle).await.unwrap();
    // The first relay's late completion is fenced.
    let late = store
        .complete(&first.handle, &[common::published(&v7, 0)])
        .await
        .unwrap();
    assert_eq!(late.applied, 0);
    assert_eq!(last(&ctx, agg).await, Some(None));
    let third = claim(&store, "c", 10).await;
    assert_eq!(versions(&third), vec![(agg.into(), 7)]);
    assert_eq!((third.gaps_held, third.parked.len()), (0, 0));
    publish_all(&store, &third).await;
    let fourth = claim(&store, "c", 10).await;
    assert_eq!(versions(&fourth), vec![(agg.into(), 8)]);
    publish_all(&store, &fourth).await;
    ctx.drop().await;
}

/// Operator actions on an aggregate whose state row exists with an unknown last version (a
/// claim created it), with and without `accept_first_version`: a discard of the parked first
/// version makes the next flow; a retry sends it; neither leaves a last version below what was
/// already decided.
#[tokio::test]
async fn operator_actions_on_an_aggregate_without_a_last_version() {
    let ctx = ctx!(6);
    for accept in [true, false] {
        for mode in modes() {
            let store = store(&ctx, mode, accept).await;
            for action in ["discard", "retry"] {
                let agg = format!("op-{accept}-{}-{action}", tag(mode));
                // Without accept_first the first event must be 1.
                let first_v = if accept { 3 } else { 1 };
                let (va, vb) = (event(&agg, first_v), event(&agg, first_v + 1));
                store
                    .append_many(&ctx.pool, &[va.clone(), vb.clone()])
                    .await
                    .unwrap();
                let b = claim(&store, "a", 10).await;
                assert_eq!(versions(&b), vec![(agg.clone(), first_v)]);
                let rep = store.complete(&b.handle, &[park(&va)]).await.unwrap();
                assert_eq!(rep.applied, 1);
                assert_eq!(
                    last(&ctx, &agg).await.flatten(),
                    None,
                    "a park sets no version"
                );
                let expect = if action == "discard" {
                    store
                        .discard_parked(va.event_id, "ops", "bad")
                        .await
                        .unwrap();
                    vec![first_v + 1]
                } else {
                    store.retry_parked(va.event_id, "ops").await.unwrap();
                    vec![first_v, first_v + 1]
                };
                for v in expect {
                    let n = claim(&store, "a", 10).await;
                    assert_eq!(
                        versions(&n),
                        vec![(agg.clone(), v)],
                        "{accept} {} {action} (held {}, parked {:?})",
                        tag(mode),
                        n.gaps_held,
                        n.parked
                    );
                    publish_all(&store, &n).await;
                }
                assert_eq!(last(&ctx, &agg).await.flatten(), Some(first_v + 1));
            }
        }
    }
    ctx.drop().await;
}

/// Without `accept_first_version`, an aggregate whose first event is 3 is held as a gap, then
/// parked; a claim that released another aggregate meanwhile writes no version for it. An
/// operator retry of the parked 3 accepts it; a late 1 and 2 that then commit are parked as out
/// of order, never sent after 3.
#[tokio::test]
async fn a_retried_gap_without_state_becomes_the_baseline() {
    let ctx = ctx!(6);
    for mode in modes() {
        let store = store(&ctx, mode, false).await;
        let agg = format!("gap-{}", tag(mode));
        let v3 = event(&agg, 3);
        store.append(&ctx.pool, &v3).await.unwrap();
        let held = claim(&store, "a", 10).await;
        assert_eq!(held.gaps_held, 1);
        store.release(&held.handle).await.unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await; // past the gap timeout
        let parked = claim(&store, "a", 10).await;
        assert_eq!(
            parked.parked.iter().map(|p| p.kind).collect::<Vec<_>>(),
            vec![ParkKind::VersionGap]
        );
        store.release(&parked.handle).await.unwrap();
        store.retry_parked(v3.event_id, "ops").await.unwrap();
        assert_eq!(last(&ctx, &agg).await.flatten(), Some(2));
        let (v1, v2) = (event(&agg, 1), event(&agg, 2));
        store
            .append_many(&ctx.pool, &[v1.clone(), v2.clone()])
            .await
            .unwrap();
        let b = claim(&store, "a", 10).await;
        assert_eq!(versions(&b), vec![(agg.clone(), 3)], "{}", tag(mode));
        publish_all(&store, &b).await;
        let rest = claim(&store, "a", 10).await;
        assert!(rest.is_empty());
        store.release(&rest.handle).await.unwrap();
        for e in [&v1, &v2] {
            assert_eq!(
                row(&ctx, e).await,
                ("parked".into(), Some("out_of_order".into()))
            );
        }
    }
    ctx.drop().await;
}

/// A locked claim whose connection drops (the relay crashed) writes nothing: the aggregate has
/// no state, and with `accept_first_version` the same first version is claimed again.
#[tokio::test]
async fn a_dropped_locked_claim_leaves_no_state() {
    let ctx = ctx!(6);
    let store = store(&ctx, ClaimMode::LockedTransaction, true).await;
    let agg = "dropped";
    let v4 = event(agg, 4);
    store.append(&ctx.pool, &v4).await.unwrap();
    let first = claim(&store, "a", 10).await;
    assert_eq!(versions(&first), vec![(agg.into(), 4)]);
    assert!(store.abandon_locked_claim(&first.handle).await);
    assert_eq!(last(&ctx, agg).await, None, "no state row at all");
    let again = claim(&store, "b", 10).await;
    assert_eq!(versions(&again), vec![(agg.into(), 4)]);
    publish_all(&store, &again).await;
    assert_eq!(last(&ctx, agg).await, Some(Some(4)));
    ctx.drop().await;
}
