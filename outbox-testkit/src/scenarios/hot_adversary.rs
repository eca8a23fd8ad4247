//! Adversary pass on issue 25 (claims block an aggregate's every follower, not only the
//! window's), against the real servers in both claim modes, through [`hot_adversary_tests!`]
//! (`outbox-postgres/tests/adversary_hot.rs`, `outbox-mysql/tests/adversary_hot.rs`).
//!
//! * [`claim_does_not_wait_for_an_open_append`]: a claim that blocks an aggregate's followers
//!   must not wait for a business transaction that appended a later version of that aggregate
//!   and has not committed yet (the claim module's "a busy aggregate is skipped, never waited
//!   for"); the other aggregates of the batch must come out at once.
//! * [`late_lower_versions_behind_a_blocked_backlog_drain_in_order`]: versions 3 and 4 arrive
//!   after 5..=`n` were blocked behind a gap-held head; every version still comes out, in
//!   version order, each once.

use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, Envelope, Outcome};

use super::{event, params};
use crate::randomized::RandomizedBackend;

/// A store of `backend` in `mode` with a gap timeout of five minutes (tables created).
async fn store_of<B: RandomizedBackend>(backend: &B, mode: ClaimMode) -> B::Store {
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(500));
    let store = backend.store(&p);
    backend.prepare(&store).await.expect("migrate");
    store
}

/// Appends `events` in one committed transaction.
async fn append_committed<B: RandomizedBackend>(
    backend: &B,
    store: &B::Store,
    events: &[Envelope],
) {
    let mut tx = backend.begin().await.expect("begin");
    for chunk in events.chunks(500) {
        backend.append(store, &mut tx, chunk).await.expect("append");
    }
    backend.commit(tx).await.expect("commit");
}

/// Claims once with `limit`, completes everything claimed as published, returns the
/// (aggregate, version) pairs in the order handed out.
async fn claim_and_publish<S: RelayStore>(store: &S, limit: usize) -> Vec<(String, i64)> {
    let batch = store
        .claim(&ClaimRequest::new("adv-hot", limit))
        .await
        .expect("claim");
    let out: Vec<(String, i64)> = batch
        .records
        .iter()
        .map(|r| {
            (
                r.envelope.aggregate_id.clone(),
                r.envelope.aggregate_version,
            )
        })
        .collect();
    let outcomes: Vec<Outcome> = super::published_in_order(&batch);
    if !outcomes.is_empty() {
        let rep = store
            .complete(&batch.handle, &outcomes)
            .await
            .expect("complete");
        assert_eq!(rep.applied, outcomes.len(), "{rep:?}");
    }
    out
}

/// Aggregate `x` has versions 1 and 2 committed, `y` version 1; a business transaction has
/// appended `x` version 3 and stays open for eight seconds. A claim (limit 10) sees `x` 1 as
/// the head and `x` 2 as a follower, so it blocks `x`'s followers: it must hand out `x` 1 and
/// `y` 1 within three seconds, not wait for the business transaction. Then the transaction
/// commits and `x` 2, 3 come out in order.
pub async fn claim_does_not_wait_for_an_open_append<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let store = store_of(backend, mode).await;
    append_committed(
        backend,
        &store,
        &[event("x", 1), event("x", 2), event("y", 1)],
    )
    .await;
    let mut open = backend.begin().await.expect("begin");
    backend
        .append(&store, &mut open, &[event("x", 3)])
        .await
        .expect("append in the open transaction");
    let claimer = store.clone();
    let claim = tokio::spawn(async move {
        let started = Instant::now();
        let got = claim_and_publish(&claimer, 10).await;
        (got, started.elapsed())
    });
    tokio::time::sleep(Duration::from_secs(8)).await;
    backend
        .commit(open)
        .await
        .expect("commit the business transaction");
    let (got, took) = claim.await.expect("claim task");
    assert!(
        took < Duration::from_secs(3),
        "the claim waited {took:?} for the open business transaction that appended x 3 \
         (handed out {got:?})"
    );
    let mut got = got;
    got.sort();
    assert_eq!(got, vec![("x".to_owned(), 1), ("y".to_owned(), 1)]);
    let mut rest = Vec::new();
    for _ in 0..20 {
        rest.extend(claim_and_publish(&store, 10).await);
        if rest.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rest, vec![("x".to_owned(), 2), ("x".to_owned(), 3)]);
}

/// Aggregate `x`: versions 1, 2, 5..=`n` (3 and 4 missing) and `y` 1. Claims (limit 20,
/// each completed) take 1 and 2 (blocking 2..=`n` at the first), then 5 is promoted and held
/// for the gap. Versions 3 and 4 arrive late, in two transactions; then claims go on until
/// everything came out or 60 s passed. Every version of `x` must come out once, in version
/// order, and `y` 1 too.
pub async fn late_lower_versions_behind_a_blocked_backlog_drain_in_order<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    n: i64,
) {
    let store = store_of(backend, mode).await;
    let mut first: Vec<Envelope> = vec![event("x", 1), event("x", 2)];
    first.extend((5..=n).map(|v| event("x", v)));
    first.push(event("y", 1));
    append_committed(backend, &store, &first).await;
    let mut out: Vec<(String, i64)> = Vec::new();
    // Until x 2 came out and x 5 was looked at once more (promoted, then held).
    for _ in 0..4 {
        out.extend(claim_and_publish(&store, 20).await);
    }
    assert!(
        out.contains(&("x".to_owned(), 2)),
        "x 2 did not come out in the first claims: {out:?}"
    );
    append_committed(backend, &store, &[event("x", 3)]).await;
    append_committed(backend, &store, &[event("x", 4)]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let total = n as usize + 1;
    while out.len() < total && Instant::now() < deadline {
        let got = claim_and_publish(&store, 20).await;
        if got.is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out.extend(got);
    }
    let xs: Vec<i64> = out
        .iter()
        .filter(|(a, _)| a == "x")
        .map(|(_, v)| *v)
        .collect();
    let want: Vec<i64> = (1..=n).collect();
    assert_eq!(
        xs,
        want,
        "x did not come out exactly once in version order within 60 s ({} of {n})",
        xs.len()
    );
    assert!(out.contains(&("y".to_owned(), 1)), "y 1 never came out");
}

/// Aggregate `x`: version 1 published, then versions 3..=`n` (2 missing), with a gap timeout
/// of one second. Claims hold 3 for the gap and block 4..=`n` behind it; after the timeout 3 is
/// parked (version gap). Version 2 arrives late and comes out; then the operator retries 3.
/// Every version 2..=`n` must come out once, in version order, within 60 s.
pub async fn gap_parked_head_with_a_blocked_backlog_drains_after_retry<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    n: i64,
) {
    let p = crate::randomized::StoreParams {
        mode,
        locked_hold: Duration::from_secs(60),
        gap_timeout: Duration::from_secs(1),
        delivery_timeout: Duration::from_millis(500),
    };
    let store = backend.store(&p);
    backend.prepare(&store).await.expect("migrate");
    append_committed(backend, &store, &[event("x", 1)]).await;
    let mut out = claim_and_publish(&store, 20).await;
    assert_eq!(out, vec![("x".to_owned(), 1)]);
    let three = event("x", 3);
    let three_id = three.event_id;
    let mut rest = vec![three];
    rest.extend((4..=n).map(|v| event("x", v)));
    append_committed(backend, &store, &rest).await;
    // Claims until 3 is parked for the gap (past the one-second timeout).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut parked = false;
    while !parked && Instant::now() < deadline {
        let batch = store
            .claim(&ClaimRequest::new("adv-hot", 20))
            .await
            .expect("claim");
        assert!(
            batch.records.is_empty(),
            "a version behind the gap came out: {:?}",
            batch
                .records
                .iter()
                .map(|r| r.envelope.aggregate_version)
                .collect::<Vec<_>>()
        );
        parked = batch.parked.iter().any(|p| p.event_id == three_id);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(parked, "version 3 was not parked for the gap within 20 s");
    append_committed(backend, &store, &[event("x", 2)]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut retried = false;
    let total = n as usize;
    while out.len() < total && Instant::now() < deadline {
        let got = claim_and_publish(&store, 20).await;
        if got.is_empty() {
            if out.contains(&("x".to_owned(), 2)) && !retried {
                store
                    .retry_parked(three_id, "adv-hot")
                    .await
                    .expect("retry 3");
                retried = true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        out.extend(got);
    }
    let xs: Vec<i64> = out.iter().map(|(_, v)| *v).collect();
    let want: Vec<i64> = (1..=n).collect();
    assert_eq!(
        xs,
        want,
        "x did not come out exactly once in version order within 60 s ({} of {n})",
        xs.len()
    );
}

/// What the two relays of [`two_relays_drain_two_hot_aggregates`] were handed.
#[derive(Default)]
struct HandedOut {
    /// (aggregate, version) in hand-out order: noted as each claim returns, before it is
    /// completed, so a version handed out only after its predecessor's completion committed
    /// is always noted after it (a note taken after the completion returned could come after
    /// the next claim's, under load, with nothing wrong in the store).
    seen: Vec<(String, i64)>,
    /// Aggregates claimed and not yet being completed, by claim token.
    in_flight: std::collections::HashMap<String, uuid::Uuid>,
    /// A claim handed out an aggregate another claim still held.
    overlaps: Vec<String>,
}

/// Two stores (two relays) claim side by side (limit 50, each claim completed) while two hot
/// aggregates of `n` versions each and 50 single events drain: no claim or completion may
/// fail, no claim may hand out an aggregate another claim holds (between its hand-out and the
/// start of its completion), and within 90 s every event comes out once, each aggregate in
/// version order (the order in which the claims handed the versions out).
pub async fn two_relays_drain_two_hot_aggregates<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    n: i64,
) {
    let store = store_of(backend, mode).await;
    let other = backend.store(&params(
        mode,
        Duration::from_secs(60),
        Duration::from_millis(500),
    ));
    let mut all = Vec::new();
    for v in 1..=n {
        all.push(event("hot-a", v));
        all.push(event("hot-b", v));
        if v % (n / 50).max(1) == 0 {
            all.push(event(&format!("cold-{v}"), 1));
        }
    }
    let total = all.len();
    append_committed(backend, &store, &all).await;
    let log = std::sync::Arc::new(std::sync::Mutex::new(HandedOut::default()));
    let deadline = Instant::now() + Duration::from_secs(90);
    let relay = |s: B::Store| {
        let log = std::sync::Arc::clone(&log);
        tokio::spawn(async move {
            while Instant::now() < deadline && log.lock().expect("log").seen.len() < total {
                let batch = s
                    .claim(&ClaimRequest::new("adv-hot", 50))
                    .await
                    .expect("claim");
                if batch.records.is_empty() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                let token = batch.handle.token;
                {
                    let mut log = log.lock().expect("log");
                    for r in &batch.records {
                        let (aggregate, version) =
                            (&r.envelope.aggregate_id, r.envelope.aggregate_version);
                        if let Some(held) = log.in_flight.insert(aggregate.clone(), token) {
                            if held != token {
                                log.overlaps.push(format!(
                                    "{aggregate} {version} handed out while claim {held} held it"
                                ));
                            }
                        }
                        log.seen.push((aggregate.clone(), version));
                    }
                }
                // The broker's round trip: the window in which another claim of these
                // aggregates would be seen as an overlap.
                tokio::time::sleep(Duration::from_millis(2)).await;
                let outcomes: Vec<Outcome> = super::published_in_order(&batch);
                log.lock()
                    .expect("log")
                    .in_flight
                    .retain(|_, held| *held != token);
                let rep = s
                    .complete(&batch.handle, &outcomes)
                    .await
                    .expect("complete");
                assert_eq!(rep.applied, outcomes.len(), "{rep:?}");
            }
        })
    };
    let a = relay(store.clone());
    let b = relay(other);
    a.await.expect("relay a (a claim or completion failed)");
    b.await.expect("relay b (a claim or completion failed)");
    let log = log.lock().expect("log");
    assert!(
        log.overlaps.is_empty(),
        "two claims held one aggregate at once: {:?}",
        log.overlaps
    );
    let seen = &log.seen;
    for hot in ["hot-a", "hot-b"] {
        let vs: Vec<i64> = seen
            .iter()
            .filter(|(a, _)| a == hot)
            .map(|(_, v)| *v)
            .collect();
        let want: Vec<i64> = (1..=n).collect();
        assert_eq!(vs, want, "{hot} not exactly once in order within 90 s");
    }
    assert_eq!(
        seen.len(),
        total,
        "not every event came out once within 90 s"
    );
}

/// Emits this module's scenarios as named tests in both claim modes, for a
/// [`RandomizedBackend`] type with an `async fn new(connections: u32) -> Option<Self>`.
#[macro_export]
macro_rules! hot_adversary_tests {
    ($backend:ty) => {
        $crate::hot_adversary_tests!(@case $backend, claim_does_not_wait_for_an_open_append_lease,
            claim_does_not_wait_for_an_open_append($crate::scenarios::early_claim::lease(30.0)));
        $crate::hot_adversary_tests!(@case $backend, claim_does_not_wait_for_an_open_append_locked,
            claim_does_not_wait_for_an_open_append(::outbox_core::ClaimMode::LockedTransaction));
        $crate::hot_adversary_tests!(@case $backend, late_lower_versions_drain_in_order_lease,
            late_lower_versions_behind_a_blocked_backlog_drain_in_order(
                $crate::scenarios::early_claim::lease(30.0), 300));
        $crate::hot_adversary_tests!(@case $backend, late_lower_versions_drain_in_order_locked,
            late_lower_versions_behind_a_blocked_backlog_drain_in_order(
                ::outbox_core::ClaimMode::LockedTransaction, 300));
        $crate::hot_adversary_tests!(@case $backend, gap_parked_head_drains_after_retry_lease,
            gap_parked_head_with_a_blocked_backlog_drains_after_retry(
                $crate::scenarios::early_claim::lease(30.0), 200));
        $crate::hot_adversary_tests!(@case $backend, gap_parked_head_drains_after_retry_locked,
            gap_parked_head_with_a_blocked_backlog_drains_after_retry(
                ::outbox_core::ClaimMode::LockedTransaction, 200));
        $crate::hot_adversary_tests!(@case $backend, two_relays_drain_two_hot_aggregates_lease,
            two_relays_drain_two_hot_aggregates($crate::scenarios::early_claim::lease(30.0), 400));
        $crate::hot_adversary_tests!(@case $backend, two_relays_drain_two_hot_aggregates_locked,
            two_relays_drain_two_hot_aggregates(::outbox_core::ClaimMode::LockedTransaction, 400));
    };
    (@case $backend:ty, $name:ident, $scenario:ident($($arg:expr),*)) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some(b) = <$backend>::new(6).await else {
                return;
            };
            $crate::scenarios::hot_adversary::$scenario(&b, $($arg),*).await;
            $crate::randomized::RandomizedBackend::finish(&b).await;
        }
    };
}
