//! Adversarial races of claims, completions, releases and operator actions against the real
//! server, each interleaving forced by a lock held from a connection of the test's own (a
//! state row, an event row, a lease row, an uncommitted state-row insert) and a wait until the
//! store's statement is held up on it: a relay's release against its own completion, in both
//! orders; the claim of the next version against the completion of the previous one, in both
//! orders; two prefetching relays on batches longer than one `IN` list over the same
//! aggregates; operator actions between a claim and its completion, on the claimed aggregate
//! and on a neighbour; a completion or a claim whose connection is killed between each pair of
//! its statements; a lease that ends while its completion waits on the aggregate's lock.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, ClaimedBatch, Envelope, OperatorAction, Outcome, StoreErrorKind,
};
use outbox_mysql::MySqlOutboxStore;
use uuid::Uuid;

use common::race::{
    claim_nonempty, event_ids, hold_aggregate, hold_event, hold_lease_row, hold_state_insert, kill,
    last_version, published_versions, row, statuses, wait_waiting,
};
use common::{claim, event, lease, park, publish_all, published, retry, versions};

/// The modes and `accept_first_version` settings every race runs in.
fn settings() -> Vec<(ClaimMode, bool)> {
    vec![
        (lease(30.0), false),
        (lease(30.0), true),
        (ClaimMode::LockedTransaction, false),
        (ClaimMode::LockedTransaction, true),
    ]
}

async fn store(ctx: &common::Ctx, mode: ClaimMode, afv: bool) -> MySqlOutboxStore {
    let s = ctx
        .builder(mode)
        .accept_first_version(afv)
        .build()
        .expect("build");
    s.migrate().await.expect("migrate");
    s
}

fn agg_versions(b: &ClaimedBatch, agg: &str) -> Vec<i64> {
    versions(b)
        .into_iter()
        .filter(|(a, _)| a == agg)
        .map(|(_, v)| v)
        .collect()
}

// ---------------------------------------------------------------------------------------
// 1. A relay's release racing its own completion of the same claim.
// ---------------------------------------------------------------------------------------

/// Lease mode, the completion first: it retries the row (due in an hour) and is held up on
/// its lease row's delete, holding the aggregate; the relay's release of the same claim (its
/// rows read from the database: the completion took the claim's memory) queues on the
/// aggregate's lock. Once both end, the retry stands: the row is not due before its delay,
/// without the token, and no claim hands it out. Then the other order: the release holds the
/// aggregate (held up on its lease row's delete) and the completion of the same claim queues;
/// the completion applies nothing (superseded), the row is pending, due, not marked maybe
/// sent, and the next claim hands it out once.
///
/// (Not yet seen failing: with only `AND e.claim_token = ?` removed from the joined marking it
/// stays green, the lease end (`next_attempt_at = ?`) fences the released row alone; the
/// breaks of both conditions, and of the release's own fence, were not run before the
/// deadline.)
#[tokio::test]
async fn a_relays_release_racing_its_own_completion_in_both_orders() {
    let ctx = ctx!(8);
    let s = ctx.store(lease(30.0)).await;
    // Order 1: the completion holds the aggregate.
    let e = event("one", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let c = claim(&s, "relay", 10).await;
    assert_eq!(event_ids(&c), vec![e.event_id]);
    let lock = hold_lease_row(&ctx, c.handle.token).await;
    let completing = {
        let (s, h, e) = (s.clone(), c.handle.clone(), e.clone());
        tokio::spawn(async move {
            s.complete(&h, &[retry(&e, Duration::from_secs(3600))])
                .await
        })
    };
    wait_waiting(&ctx, "DELETE", "outbox_events_lease", 1).await;
    let releasing = {
        let (s, h) = (s.clone(), c.handle.clone());
        tokio::spawn(async move { s.release(&h).await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    lock.close().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 1, "{rep:?}");
    releasing.await.unwrap().unwrap();
    let (status, token, later, _, _) = row(&ctx, &e).await;
    assert_eq!(
        (status.as_str(), token, later),
        ("pending", Uuid::nil(), true),
        "the retry stands: not due for an hour"
    );
    let b = claim(&s, "other", 10).await;
    assert!(b.records.is_empty(), "handed out {:?}", versions(&b));

    // Order 2: the release holds the aggregate.
    let e = event("two", 1);
    common::append(&ctx, &s, std::slice::from_ref(&e)).await;
    let c = claim(&s, "relay", 10).await;
    assert_eq!(event_ids(&c), vec![e.event_id]);
    let lock = hold_lease_row(&ctx, c.handle.token).await;
    let releasing = {
        let (s, h) = (s.clone(), c.handle.clone());
        tokio::spawn(async move { s.release(&h).await })
    };
    wait_waiting(&ctx, "DELETE", "outbox_events_lease", 1).await;
    let completing = {
        let (s, h, e) = (s.clone(), c.handle.clone(), e.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 7)]).await })
    };
    wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
    lock.close().await.unwrap();
    releasing.await.unwrap().unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    assert_eq!(rep.superseded_events, vec![e.event_id]);
    let (status, token, later, maybe, ack) = row(&ctx, &e).await;
    assert_eq!(
        (status.as_str(), token, later, maybe, ack),
        ("pending", Uuid::nil(), false, false, None)
    );
    assert_eq!(last_version(&ctx, "two").await, None);
    let again = claim(&s, "other", 10).await;
    assert_eq!(event_ids(&again), vec![e.event_id]);
    assert!(!again.records[0].maybe_sent_before, "released, not lost");
    publish_all(&s, &again).await;
    assert_eq!(published_versions(&ctx, "two").await, vec![1]);
    ctx.drop().await;
}

/// Locked mode: the completion is held up in its last statement (the unblocking of the next
/// version, whose row a connection of the test holds) while the relay releases the same
/// claim: the release finds the claim already ended (no error), the completion's publication
/// stands, and the next version is handed out once. Then the release first: the completion of
/// the released claim applies nothing and the version is handed out again.
///
/// (Not yet seen failing: no break was run before the deadline.)
#[tokio::test]
async fn a_locked_release_racing_its_own_completion_in_both_orders() {
    let ctx = ctx!(10);
    let s = ctx.store(ClaimMode::LockedTransaction).await;
    let (e1, e2) = (event("a", 1), event("a", 2));
    common::append(&ctx, &s, &[e1.clone(), e2.clone()]).await;
    let c = claim(&s, "relay", 10).await;
    assert_eq!(event_ids(&c), vec![e1.event_id], "v2 blocked behind v1");
    let lock = hold_event(&ctx, &e2).await;
    let completing = {
        let (s, h, e) = (s.clone(), c.handle.clone(), e1.clone());
        tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
    };
    wait_waiting(&ctx, "UPDATE", "SET blocked = 0", 1).await;
    s.release(&c.handle).await.unwrap();
    lock.close().await.unwrap();
    let rep = completing.await.unwrap().unwrap();
    assert_eq!(rep.applied, 1, "{rep:?}");
    assert_eq!(s.open_locked_claims(), 0);
    assert_eq!(last_version(&ctx, "a").await, Some(1));
    let next = claim(&s, "relay", 10).await;
    assert_eq!(event_ids(&next), vec![e2.event_id]);
    // The release first.
    s.release(&next.handle).await.unwrap();
    let rep = s
        .complete(&next.handle, &[published(&e2, 2)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 0, "{rep:?}");
    assert_eq!(row(&ctx, &e2).await.0, "pending");
    let again = claim_nonempty(&s, "relay", 10).await;
    assert_eq!(event_ids(&again), vec![e2.event_id]);
    publish_all(&s, &again).await;
    assert_eq!(published_versions(&ctx, "a").await, vec![1, 2]);
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------
// 2. The claim of the next version racing the completion of the previous one.
// ---------------------------------------------------------------------------------------

/// Relay A's completion of `a` v1 is held up in its unblocking of v2 (the test holds v2's
/// row), after its marking and its last version, holding the aggregate; relay B claims
/// meanwhile and gets only the other aggregate's event (nothing of `a`: not v1 again, not v2
/// before A commits, never v3). Once A commits, B gets exactly v2, a third relay nothing of
/// `a` while v2 is out, then v3 after it. Every mode, with and without
/// `accept_first_version`.
///
/// (Seen failing with the completion writing one more than the version published as the last
/// version, `current.unwrap_or(0).max(*v) + 1` in `new_last_versions`: B got v3, not v2.)
#[tokio::test]
async fn a_claim_racing_the_previous_versions_completion_gets_exactly_the_next() {
    for (mode, afv) in settings() {
        let ctx = ctx!(10);
        let s = store(&ctx, mode, afv).await;
        let a: Vec<Envelope> = (1..=3).map(|v| event("a", v)).collect();
        common::append(&ctx, &s, &a).await;
        let first = claim(&s, "relay-a", 10).await;
        assert_eq!(agg_versions(&first, "a"), vec![1], "{mode:?} {afv}");
        let b1 = event("b", 1);
        common::append(&ctx, &s, std::slice::from_ref(&b1)).await;
        let lock = hold_event(&ctx, &a[1]).await;
        let completing = {
            let (s, h, e) = (s.clone(), first.handle.clone(), a[0].clone());
            tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
        };
        wait_waiting(&ctx, "UPDATE", "SET blocked = 0", 1).await;
        let during = claim(&s, "relay-b", 10).await;
        assert_eq!(
            versions(&during),
            vec![("b".to_owned(), 1)],
            "{mode:?} {afv}: nothing of `a` while its completion holds it"
        );
        publish_all(&s, &during).await;
        lock.close().await.unwrap();
        let rep = completing.await.unwrap().unwrap();
        assert_eq!(rep.applied, 1, "{mode:?} {afv}: {rep:?}");
        let next = claim(&s, "relay-b", 10).await;
        assert_eq!(versions(&next), vec![("a".to_owned(), 2)], "{mode:?} {afv}");
        assert!(!next.records[0].maybe_sent_before, "{mode:?} {afv}");
        let third = claim(&s, "relay-c", 10).await;
        assert!(
            third.records.is_empty(),
            "{mode:?} {afv}: {:?} beside v2",
            versions(&third)
        );
        publish_all(&s, &next).await;
        let last = claim(&s, "relay-c", 10).await;
        assert_eq!(versions(&last), vec![("a".to_owned(), 3)], "{mode:?} {afv}");
        publish_all(&s, &last).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2, 3]);
        assert_eq!(last_version(&ctx, "a").await, Some(3));
        ctx.drop().await;
    }
}

/// Lease mode, the other order: relay B's claim holds the aggregate (it has locked `a`'s
/// state row and waits to create the state row of a new aggregate, which a transaction of the
/// test has inserted and not committed) while A's completion of v1 queues on `a`'s lock. B
/// hands out nothing of `a` (v1 is leased, v2 and v3 follow it) and must not block them
/// for good; once A commits, the next claim gets exactly v2, then v3.
///
/// (Not yet seen failing: no break was run before the deadline; the planned one is the
/// completion's locks taken with `SKIP LOCKED` in `owned_rows`, which turned
/// `a_lease_that_ends_while_its_completion_waits_on_the_aggregate` red.)
#[tokio::test]
async fn a_claim_holding_the_aggregate_while_the_completion_queues_leaves_the_next_version() {
    for afv in [false, true] {
        let ctx = ctx!(10);
        let s = store(&ctx, lease(30.0), afv).await;
        let a1 = event("a", 1);
        common::append(&ctx, &s, std::slice::from_ref(&a1)).await;
        let first = claim(&s, "relay-a", 1).await;
        assert_eq!(event_ids(&first), vec![a1.event_id]);
        // v2 and v3 are not blocked yet: B's scan takes them as candidates.
        let rest = vec![event("a", 2), event("a", 3), event("n", 1)];
        common::append(&ctx, &s, &rest).await;
        let insert = hold_state_insert(&ctx, "n").await;
        let claiming = {
            let s = s.clone();
            tokio::spawn(async move { claim(&s, "relay-b", 10).await })
        };
        wait_waiting(&ctx, "INSERT", "outbox_events_aggregate", 1).await;
        let completing = {
            let (s, h, e) = (s.clone(), first.handle.clone(), a1.clone());
            tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
        };
        wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
        insert.close().await.unwrap();
        let during = claiming.await.unwrap();
        assert_eq!(versions(&during), vec![("n".to_owned(), 1)], "afv {afv}");
        let rep = completing.await.unwrap().unwrap();
        assert_eq!(rep.applied, 1, "afv {afv}: {rep:?}");
        publish_all(&s, &during).await;
        let next = claim(&s, "relay-c", 10).await;
        assert_eq!(versions(&next), vec![("a".to_owned(), 2)], "afv {afv}");
        publish_all(&s, &next).await;
        let last = claim(&s, "relay-c", 10).await;
        assert_eq!(versions(&last), vec![("a".to_owned(), 3)], "afv {afv}");
        publish_all(&s, &last).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2, 3]);
        ctx.drop().await;
    }
}

// ---------------------------------------------------------------------------------------
// 3. Two prefetching relays on long batches over the same aggregates.
// ---------------------------------------------------------------------------------------

/// What the relays have in flight and what each aggregate must get next.
#[derive(Default)]
struct Ledger {
    in_flight: HashSet<String>,
    next: HashMap<String, i64>,
    violations: Vec<String>,
}

impl Ledger {
    fn claimed(&mut self, who: &str, b: &ClaimedBatch) {
        for r in &b.records {
            let agg = r.envelope.aggregate_id.clone();
            let v = r.envelope.aggregate_version;
            if !self.in_flight.insert(agg.clone()) {
                self.violations.push(format!(
                    "{who}: {agg} v{v} handed out while {agg} was in flight"
                ));
            }
            let want = self.next.get(&agg).copied().unwrap_or(1);
            if v != want {
                self.violations
                    .push(format!("{who}: {agg} v{v} handed out, v{want} expected"));
            }
        }
    }

    /// Before the completion is sent: the next claim may hand out the next versions as soon
    /// as it commits.
    fn completing(&mut self, b: &ClaimedBatch) {
        for r in &b.records {
            self.in_flight.remove(&r.envelope.aggregate_id);
            self.next.insert(
                r.envelope.aggregate_id.clone(),
                r.envelope.aggregate_version + 1,
            );
        }
    }
}

/// Two relays, each holding its batch k while it claims batch k+1 (a prefetching relay), on
/// 600 aggregates of 3 versions each, claiming 700 at a time: every claim's candidates,
/// aggregates and completions are lists longer than one `IN` list of 500. No aggregate is
/// ever out twice at once (across both relays' two batches each), every aggregate's versions
/// are handed out in order, each exactly once (all publications apply), and everything is
/// published. Lease and locked modes.
///
/// (Not yet seen failing: the break of `head::in_list` joining the lists with `AND` was
/// started but cut short at the deadline.)
#[tokio::test]
async fn two_prefetching_relays_on_long_batches_keep_one_version_per_aggregate_out() {
    const AGGS: usize = 600;
    const VERSIONS: i64 = 3;
    for mode in [lease(60.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(16);
        let s = ctx.store(mode).await;
        for v in 1..=VERSIONS {
            let evs: Vec<Envelope> = (0..AGGS).map(|i| event(&format!("g{i:04}"), v)).collect();
            for chunk in evs.chunks(500) {
                common::append(&ctx, &s, chunk).await;
            }
        }
        let total = AGGS * VERSIONS as usize;
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let deadline = Instant::now() + Duration::from_secs(150);
        let mut relays = Vec::new();
        for who in ["relay-a", "relay-b"] {
            let (s, ledger, done) = (s.clone(), ledger.clone(), done.clone());
            relays.push(tokio::spawn(async move {
                let mut holding: Option<ClaimedBatch> = None;
                let mut offset = 0i64;
                while done.load(std::sync::atomic::Ordering::SeqCst) < total
                    && Instant::now() < deadline
                {
                    let b = s
                        .claim(&ClaimRequest::new(who, 700))
                        .await
                        .unwrap_or_else(|e| panic!("{who}: claim failed: {e}"));
                    ledger.lock().unwrap().claimed(who, &b);
                    if let Some(prev) = holding.take() {
                        ledger.lock().unwrap().completing(&prev);
                        let outs: Vec<Outcome> = prev
                            .records
                            .iter()
                            .map(|r| {
                                offset += 1;
                                published(&r.envelope, offset)
                            })
                            .collect();
                        let rep = s
                            .complete(&prev.handle, &outs)
                            .await
                            .unwrap_or_else(|e| panic!("{who}: completion failed: {e}"));
                        assert_eq!(rep.applied, outs.len(), "{who}: {rep:?}");
                        done.fetch_add(rep.applied, std::sync::atomic::Ordering::SeqCst);
                    }
                    if b.records.is_empty() {
                        s.release(&b.handle).await.unwrap();
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    } else {
                        holding = Some(b);
                    }
                }
                if let Some(prev) = holding.take() {
                    ledger.lock().unwrap().completing(&prev);
                    let outs: Vec<Outcome> = prev
                        .records
                        .iter()
                        .map(|r| published(&r.envelope, 0))
                        .collect();
                    let rep = s.complete(&prev.handle, &outs).await.unwrap();
                    done.fetch_add(rep.applied, std::sync::atomic::Ordering::SeqCst);
                }
            }));
        }
        for r in relays {
            r.await.unwrap();
        }
        {
            let l = ledger.lock().unwrap();
            assert!(
                l.violations.is_empty(),
                "{mode:?}: {} violations, first {:?}",
                l.violations.len(),
                &l.violations[..l.violations.len().min(5)]
            );
        }
        assert_eq!(
            done.load(std::sync::atomic::Ordering::SeqCst),
            total,
            "{mode:?}: published"
        );
        assert_eq!(
            statuses(&ctx).await,
            vec![("published".to_owned(), total as i64)],
            "{mode:?}"
        );
        for i in [0, AGGS / 2, AGGS - 1] {
            let agg = format!("g{i:04}");
            assert_eq!(
                published_versions(&ctx, &agg).await,
                (1..=VERSIONS).collect::<Vec<_>>(),
                "{mode:?}"
            );
        }
        ctx.drop().await;
    }
}

// ---------------------------------------------------------------------------------------
// 4. Operator actions between a claim and its completion.
// ---------------------------------------------------------------------------------------

/// The audited actions, per kind.
async fn audited(s: &MySqlOutboxStore) -> Vec<(OperatorAction, outbox_core::EventId)> {
    s.audit_trail(None)
        .await
        .unwrap()
        .into_iter()
        .map(|a| (a.action, a.event_id))
        .collect()
}

/// Parks the row of `e` as a relay's permanent failure would (a parked row the operator acts
/// on; the row was blocked behind an earlier version).
async fn park_row(ctx: &common::Ctx, e: &Envelope) {
    let n = sqlx::query(&format!(
        "UPDATE {} SET status = 'parked', park_kind = ?, parked_at = UTC_TIMESTAMP(6), \
           blocked = 0 WHERE event_id = ? AND status = 'pending'",
        ctx.table("outbox_events")
    ))
    .bind(outbox_core::ParkKind::PermanentError.as_str())
    .bind(e.event_id.as_uuid())
    .execute(&ctx.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
}

/// A claim of `a` v2 is out; `a` v3 behind it and a stale copy of `a` v1 are parked, and so
/// is `n` v1 of a neighbour aggregate. Between the claim and its completion an operator
/// retries the neighbour (done at once in both modes: it does not wait for the claim),
/// discards the stale copy and re-issues v3. Lease mode: the discard is done at once, the
/// re-issue refused (v2 is still out below it), nothing audited for it. Locked mode: the claim
/// holds the aggregate, so both wait for its completion, then succeed. Meanwhile nothing of
/// `a` is handed out (only the retried neighbour). After the completion `a`'s last version is
/// 2 (never lowered by the discard), v3 (or its copy) comes next and is published once, and
/// the audit trail holds exactly the actions that were applied, in order.
///
/// (Not yet seen failing: no break was run before the deadline; the planned one is the
/// operator's count of the versions waiting below forced to 0, under which the lease-mode
/// re-issue is no longer refused.)
#[tokio::test]
async fn operator_actions_between_a_claim_and_its_completion() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let locked = matches!(mode, ClaimMode::LockedTransaction);
        let ctx = ctx!(12);
        let s = ctx.store(mode).await;
        let (a1, n1, n2) = (event("a", 1), event("n", 1), event("n", 2));
        common::append(&ctx, &s, &[a1.clone(), n1.clone(), n2.clone()]).await;
        let b = claim(&s, "relay", 10).await;
        assert_eq!(
            versions(&b),
            vec![("a".to_owned(), 1), ("n".to_owned(), 1)],
            "{mode:?}"
        );
        let rep = s
            .complete(&b.handle, &[published(&a1, 1), park(&n1)])
            .await
            .unwrap();
        assert_eq!(rep.applied, 2, "{mode:?}");
        let (a2, a3, a1_copy) = (event("a", 2), event("a", 3), event("a", 1));
        common::append(&ctx, &s, &[a2.clone(), a3.clone(), a1_copy.clone()]).await;
        let x = claim(&s, "relay", 10).await;
        assert_eq!(versions(&x), vec![("a".to_owned(), 2)], "{mode:?}");
        assert_eq!(x.parked.len(), 1, "{mode:?}: the stale copy parked");
        park_row(&ctx, &a3).await;
        // Between the claim and its completion.
        tokio::time::timeout(Duration::from_secs(10), s.retry_parked(n1.event_id, "ops"))
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: the neighbour's retry waited on the claim"))
            .unwrap();
        let mut discarding = Some({
            let s = s.clone();
            let id = a1_copy.event_id;
            tokio::spawn(async move { s.discard_parked(id, "ops", "stale copy").await })
        });
        if locked {
            wait_waiting(&ctx, "INSERT", "aggregate_key = aggregate_key", 1).await;
        } else {
            discarding.take().unwrap().await.unwrap().unwrap();
        }
        let mut reissuing = Some({
            let s = s.clone();
            let id = a3.event_id;
            tokio::spawn(async move { s.reissue_parked(id, "ops", "send again").await })
        });
        if locked {
            wait_waiting(&ctx, "INSERT", "aggregate_key = aggregate_key", 2).await;
        } else {
            let err = reissuing.take().unwrap().await.unwrap().unwrap_err();
            assert_eq!(err.kind, StoreErrorKind::Conflict, "{err:?}");
        }
        let during = claim(&s, "relay-2", 10).await;
        assert_eq!(
            versions(&during),
            vec![("n".to_owned(), 1)],
            "{mode:?}: only the retried neighbour"
        );
        publish_all(&s, &during).await;
        let rep = s.complete(&x.handle, &[published(&a2, 2)]).await.unwrap();
        assert_eq!(rep.applied, 1, "{mode:?}: {rep:?}");
        let copy = if locked {
            discarding.take().unwrap().await.unwrap().unwrap();
            Some(reissuing.take().unwrap().await.unwrap().unwrap())
        } else {
            s.retry_parked(a3.event_id, "ops").await.unwrap();
            None
        };
        assert_eq!(last_version(&ctx, "a").await, Some(2), "{mode:?}");
        let next = claim_nonempty(&s, "relay-2", 10).await;
        let got: Vec<_> = next
            .records
            .iter()
            .filter(|r| r.envelope.aggregate_id == "a")
            .map(|r| (r.envelope.aggregate_version, r.envelope.event_id))
            .collect();
        assert_eq!(
            got,
            vec![(3, copy.unwrap_or(a3.event_id))],
            "{mode:?}: {:?}",
            versions(&next)
        );
        publish_all(&s, &next).await;
        let rest = claim(&s, "relay-2", 10).await;
        publish_all(&s, &rest).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2, 3]);
        assert_eq!(published_versions(&ctx, "n").await, vec![1, 2]);
        assert_eq!(row(&ctx, &a1_copy).await.0, "discarded", "{mode:?}");
        let mut want = vec![
            (OperatorAction::Retry, n1.event_id),
            (OperatorAction::Discard, a1_copy.event_id),
        ];
        want.push(if locked {
            (OperatorAction::Reissue, a3.event_id)
        } else {
            (OperatorAction::Retry, a3.event_id)
        });
        assert_eq!(audited(&s).await, want, "{mode:?}");
        ctx.drop().await;
    }
}

// ---------------------------------------------------------------------------------------
// 5. A crash between the statements of a completion and of a claim.
// ---------------------------------------------------------------------------------------

/// Where a lease completion is held up, and by what.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// The aggregates' locks (a state row held).
    Lock,
    /// The marking (the published row held).
    Marking,
    /// The rows without an outcome made due again (such a row held).
    Unclaim,
    /// The lease row's delete (the lease row held).
    LeaseRow,
    /// The unblocking of the next version (its row held).
    Unblock,
}

/// A lease completion (of `a` v1 published, `b` v1 without an outcome) whose connection the
/// server kills while it is held up before each of its statements in turn: every write is
/// rolled back (both rows pending under the claim's token, no last version, the lease row
/// there), no aggregate is stuck beyond the lease: once it ends, the takeover hands out both
/// rows as maybe sent; then v2 of `a`; each version published once.
///
/// (Seen failing with the candidates' scan requiring `claim_token = {NO_TOKEN}`: the rows of
/// the killed completion were never handed out again.)
#[tokio::test]
async fn a_completion_killed_before_each_statement_loses_nothing() {
    for stop in [
        Stop::Lock,
        Stop::Marking,
        Stop::Unclaim,
        Stop::LeaseRow,
        Stop::Unblock,
    ] {
        let ctx = ctx!(10);
        let s = ctx.store(lease(1.0)).await;
        let (a1, a2, b1) = (event("a", 1), event("a", 2), event("b", 1));
        common::append(&ctx, &s, &[a1.clone(), a2.clone(), b1.clone()]).await;
        let c = claim(&s, "relay-1", 10).await;
        assert_eq!(
            versions(&c),
            vec![("a".to_owned(), 1), ("b".to_owned(), 1)],
            "{stop:?}"
        );
        let (lock, prefix, part) = match stop {
            Stop::Lock => (hold_aggregate(&ctx, "a").await, "SELECT", "FOR UPDATE"),
            Stop::Marking => (hold_event(&ctx, &a1).await, "UPDATE", "JSON_TABLE"),
            Stop::Unclaim => (
                hold_event(&ctx, &b1).await,
                "UPDATE",
                "SET next_attempt_at = UTC_TIMESTAMP(6), claim_token",
            ),
            Stop::LeaseRow => (
                hold_lease_row(&ctx, c.handle.token).await,
                "DELETE",
                "outbox_events_lease",
            ),
            Stop::Unblock => (hold_event(&ctx, &a2).await, "UPDATE", "SET blocked = 0"),
        };
        let completing = {
            let (s, h, e) = (s.clone(), c.handle.clone(), a1.clone());
            tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
        };
        let conns = wait_waiting(&ctx, prefix, part, 1).await;
        kill(&ctx, conns[0]).await;
        let res = completing.await.unwrap();
        assert!(res.is_err(), "{stop:?}: the killed completion said {res:?}");
        lock.close().await.unwrap();
        for e in [&a1, &b1] {
            let (status, token, _, _, ack) = row(&ctx, e).await;
            assert_eq!(
                (status.as_str(), token, ack),
                ("pending", c.handle.token, None),
                "{stop:?}: rolled back"
            );
        }
        assert_eq!(last_version(&ctx, "a").await, None, "{stop:?}");
        let taken = claim_nonempty(&s, "relay-2", 10).await;
        assert_eq!(
            versions(&taken),
            vec![("a".to_owned(), 1), ("b".to_owned(), 1)],
            "{stop:?}"
        );
        assert!(
            taken.records.iter().all(|r| r.maybe_sent_before),
            "{stop:?}"
        );
        publish_all(&s, &taken).await;
        let next = claim(&s, "relay-2", 10).await;
        assert_eq!(versions(&next), vec![("a".to_owned(), 2)], "{stop:?}");
        publish_all(&s, &next).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2], "{stop:?}");
        assert_eq!(published_versions(&ctx, "b").await, vec![1], "{stop:?}");
        ctx.drop().await;
    }
}

/// A locked claim whose connection dies: idle between the claim and the completion, or while
/// its completion is held up in its unblocking of the next version. The server rolls the
/// claim back: its aggregate is free at once (no lease to wait for), the completion reports
/// the claim lost (or nothing applied), v1 is handed out again and published once, then v2.
///
/// (Seen failing with `lost_claim` keeping the connection error's kind: the killed completion
/// reported `Connection`, not the lost claim.)
#[tokio::test]
async fn a_locked_claim_whose_connection_dies_frees_its_aggregate_at_once() {
    for during_completion in [false, true] {
        let ctx = ctx!(10);
        let s = ctx.store(ClaimMode::LockedTransaction).await;
        let (a1, a2) = (event("a", 1), event("a", 2));
        common::append(&ctx, &s, &[a1.clone(), a2.clone()]).await;
        let c = claim(&s, "relay-1", 10).await;
        assert_eq!(event_ids(&c), vec![a1.event_id]);
        let res = if during_completion {
            let lock = hold_event(&ctx, &a2).await;
            let completing = {
                let (s, h, e) = (s.clone(), c.handle.clone(), a1.clone());
                tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
            };
            let conns = wait_waiting(&ctx, "UPDATE", "SET blocked = 0", 1).await;
            kill(&ctx, conns[0]).await;
            let res = completing.await.unwrap();
            lock.close().await.unwrap();
            res
        } else {
            // The claim's own connection closed, as a crash would (the store's test hook).
            assert!(s.abandon_locked_claim(&c.handle).await);
            s.complete(&c.handle, &[published(&a1, 1)]).await
        };
        match &res {
            Ok(rep) => assert_eq!(rep.applied, 0, "{during_completion}: {rep:?}"),
            Err(e) => assert_eq!(
                e.kind,
                StoreErrorKind::LeaseLost,
                "{during_completion}: {e:?}"
            ),
        }
        assert_eq!(row(&ctx, &a1).await.0, "pending");
        assert_eq!(last_version(&ctx, "a").await, None);
        let again = claim_nonempty(&s, "relay-2", 10).await;
        assert_eq!(event_ids(&again), vec![a1.event_id], "{during_completion}");
        publish_all(&s, &again).await;
        let next = claim_nonempty(&s, "relay-2", 10).await;
        assert_eq!(event_ids(&next), vec![a2.event_id], "{during_completion}");
        publish_all(&s, &next).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2]);
        assert_eq!(s.open_locked_claims(), 0);
        ctx.drop().await;
    }
}

// ---------------------------------------------------------------------------------------
// 6. A lease that ends while its completion waits on the aggregate's lock.
// ---------------------------------------------------------------------------------------

/// A lease completion waits on its aggregate's state row (held by another transaction) until
/// well past its lease's end; a claim meanwhile finds the row due but the aggregate locked and
/// hands out nothing of it (nor the next version). When the lock is let go the completion
/// applies (the row still carries its token and lease end: no claim took it over), the last
/// version moves, and the next claim hands out v2 (not v1 again, not marked maybe sent).
///
/// (Seen failing with the completion's locks taken with `SKIP LOCKED` in `owned_rows`: the
/// completion never waited on the held state row.)
#[tokio::test]
async fn a_lease_that_ends_while_its_completion_waits_on_the_aggregate() {
    for afv in [false, true] {
        let ctx = ctx!(10);
        let s = store(&ctx, lease(0.5), afv).await;
        let (a1, a2) = (event("a", 1), event("a", 2));
        common::append(&ctx, &s, std::slice::from_ref(&a1)).await;
        let c = claim(&s, "relay-1", 10).await;
        assert_eq!(event_ids(&c), vec![a1.event_id]);
        common::append(&ctx, &s, std::slice::from_ref(&a2)).await;
        let lock = hold_aggregate(&ctx, "a").await;
        let completing = {
            let (s, h, e) = (s.clone(), c.handle.clone(), a1.clone());
            tokio::spawn(async move { s.complete(&h, &[published(&e, 1)]).await })
        };
        wait_waiting(&ctx, "SELECT", "FOR UPDATE", 1).await;
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(!row(&ctx, &a1).await.2, "the lease has ended");
        let during = claim(&s, "relay-2", 10).await;
        assert!(
            during.records.is_empty(),
            "afv {afv}: handed out {:?} while the completion waits",
            versions(&during)
        );
        lock.close().await.unwrap();
        let rep = completing.await.unwrap().unwrap();
        assert_eq!((rep.applied, rep.superseded), (1, 0), "afv {afv}: {rep:?}");
        assert_eq!(last_version(&ctx, "a").await, Some(1));
        let next = claim_nonempty(&s, "relay-2", 10).await;
        assert_eq!(event_ids(&next), vec![a2.event_id], "afv {afv}");
        assert!(!next.records[0].maybe_sent_before);
        publish_all(&s, &next).await;
        assert_eq!(published_versions(&ctx, "a").await, vec![1, 2]);
        ctx.drop().await;
    }
}
