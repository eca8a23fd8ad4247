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
use outbox_core::{AckMetadata, ClaimMode, ClaimRequest, Envelope, Outcome};

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
    let outcomes: Vec<Outcome> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| Outcome::Published {
            event_id: r.envelope.event_id,
            ack: AckMetadata::kafka("orders", 0, i as i64),
        })
        .collect();
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
