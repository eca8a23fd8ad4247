//! Adversary scenarios of *run claims* (issue 25, `docs/design/hot-aggregate.md`; the
//! contract's *Runs* clause in `outbox_core::store`): a claim that hands out, after an
//! aggregate's head, the next consecutive versions of that aggregate under the same claim, and
//! a relay that sends version k+1 of a run right after k's acknowledgement.
//!
//! Written from the contract, not from an implementation. One body for every store: the
//! in-memory store (`outbox-testkit/tests/run_adversary.rs`, through
//! [`crate::randomized::MemoryBackend`]) and the real servers through [`run_adversary_tests!`]
//! (`outbox-postgres/tests/adversary_runs.rs`, `outbox-mysql/tests/adversary_runs.rs`), in
//! both claim modes where the mode matters. A store
//! that does not support runs (MariaDB) ignores `run` and hands out heads only, which the
//! contract allows: the scenarios then check the same guarantees (`runs = false`: no loss,
//! version order, once each) and that every claim hands out heads only.
//!
//! Every scenario checks, besides its own point:
//! * **no loss**: every event published (or discarded by the scenario's operator) in the end;
//! * **order**: each aggregate's first publications in version order, without a gap;
//! * **once**: no event published twice where no crash or expiry allows a duplicate, and no
//!   aggregate held by two live claims (or in flight at two relays) at once;
//! * **prefix**: at every checkpoint an aggregate's published (or discarded) versions form a
//!   prefix `1..=p`: `last` never moved beyond a fully published prefix (a version above an
//!   unpublished one is never published);
//! * **shape**: a run is adjacent in its batch, consecutive in version, `run_position` 0, 1, ...
//!
//! The scenarios:
//! * [`expired_run_is_fenced_and_resumed`]: a run's claim ends (lease expiry / locked hold)
//!   while its relay is mid-run; another relay takes the aggregate and starts at the first
//!   version not completed; the first relay's late completion is refused (fenced).
//! * [`version_committed_during_a_run_is_claimed_after_it`]: versions committed while a run
//!   is out are never handed out to anyone before the run ends; then they come after it.
//! * [`lower_version_committed_after_the_run_is_parked`]: a duplicate of a version of the run
//!   and a version filling the gap that ended the run commit while it is out: the duplicates
//!   are parked out of order, never published; the filled gap comes next, in order.
//! * [`operator_acts_on_a_parked_row_while_a_run_is_out`]: an operator retries (or discards)
//!   a parked row of an aggregate while a run of it is out: nothing of the aggregate is
//!   handed out beside the run, and the order holds after it.
//! * [`completion_with_a_hole_is_refused`]: a completion `Published k-1, Retry k, Published
//!   k+1` applies the first two and refuses k+1, which is re-sent after k; the released rest of
//!   the run counts no attempt.
//! * [`completion_without_the_head_is_refused`]: `Published 2, 3` with no outcome for the
//!   head 1 (`last` 0) is refused whole; nothing is parked afterwards, 1..=5 go out in order.
//! * [`two_relays_hammer_one_hot_aggregate`]: two relays (optionally with prefetch and the
//!   early claim) on one hot aggregate while producers append to it: never two claims holding
//!   it, every version sent only after its predecessor's acknowledgement, once, in order.
//! * [`slow_broker_runs_stop_inside_their_claim`]: a broker too slow for a whole run inside
//!   a 2.5 s claim; two relays; each run stops while its claim covers one more publication,
//!   nothing is sent twice or by two relays at once.
//! * [`crash_mid_run_resends_in_order`]: a relay dropped mid-run (after some acknowledgements,
//!   with one event in flight, before its completion): the next relay re-sends from the first
//!   version not completed, in order, marking what may have been sent.
//! * [`publisher_failure_mid_run_stops_the_run`]: the broker fails the middle of a run (record
//!   retry, transport failure, permanent failure): the rest of the run is not sent in that
//!   cycle, no attempt is counted for the unsent rows, and the order holds afterwards.
//!
//! Each scenario was seen failing under a deliberate break (reverted): PostgreSQL's completion
//! without the prefix rule (the hole and head-less completions), its fencing accepting a run
//! row under any lease (the expired run), its completion advancing `last` to the run's end
//! (expired run, version committed during a run, hole, broker failures), its run not stopping
//! at a gap (lower version), run rows of an expired lease not marked as possibly sent (expired
//! run, crash), `discard_parked` not counting pending rows below (the discard), a claim that
//! hands out rows at or below `last` (operator retry/discard, lower version); the relay going
//! on with a run after a failure (the three broker failures), sending a run in one call
//! (both hammers, crash, broker failures) or ignoring its claim's end between waves (the slow
//! broker, PostgreSQL both modes); the in-memory store's seeded bugs
//! `seeded_bug_accept_run_holes` and `seeded_bug_run_skips_gaps`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport,
    DeliveryStatus, Envelope, EventId, FailureScope, LastError, Outcome, PublishError,
    PublishErrorKind, PublishResult, Publisher, Relay, RelayConfig, StoreError,
};

use super::{event, prepared, retry_policy, seeded_relay};
use crate::batch_layout as describe;
use crate::randomized::{RandomizedBackend, StoreParams};

/// The run length the scenarios ask for.
const RUN: usize = 10;

// ---------------------------------------------------------------------------------------------
// Helpers.

/// A lease mode of `secs` seconds.
pub fn lease(secs: f64) -> ClaimMode {
    ClaimMode::lease(Duration::from_secs_f64(secs)).expect("a positive lease")
}

/// Store parameters: `mode`, a `locked_max_hold` of `hold`, a gap timeout of `gap`, a
/// publisher delivery timeout of 100 ms.
fn params_with(mode: ClaimMode, hold: Duration, gap: Duration) -> StoreParams {
    StoreParams {
        mode,
        locked_hold: hold,
        gap_timeout: gap,
        delivery_timeout: Duration::from_millis(100),
    }
}

/// Store parameters of `mode` with a long hold and a five-minute gap timeout.
fn params_of(mode: ClaimMode) -> StoreParams {
    params_with(mode, Duration::from_secs(60), Duration::from_secs(300))
}

/// A store of `backend` in `mode` (long hold, five-minute gap timeout), tables created.
async fn store_of<B: RandomizedBackend>(backend: &B, mode: ClaimMode) -> B::Store {
    prepared(backend, &params_of(mode)).await
}

/// Relay A's store (tables created) and relay B's, both of `backend` with `p`.
async fn two_stores<B: RandomizedBackend>(backend: &B, p: &StoreParams) -> (B::Store, B::Store) {
    (prepared(backend, p).await, backend.store(p))
}

/// The events of `batch`, in order.
fn ids_of(batch: &ClaimedBatch) -> Vec<EventId> {
    batch.records.iter().map(|r| r.envelope.event_id).collect()
}

/// Claims of `owner` with `store` until one hands out something (every `pause`, for `secs`
/// seconds at the most: then `never`).
async fn claim_until_some<S: RelayStore>(
    store: &S,
    owner: &str,
    secs: u64,
    pause: Duration,
    never: &str,
) -> ClaimedBatch {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let batch = store.claim(&request(owner, 20)).await.expect("claim");
        if !batch.is_empty() {
            return batch;
        }
        assert!(Instant::now() < deadline, "{never}");
        tokio::time::sleep(pause).await;
    }
}

/// Three claims of relay B with `b` hand out nothing (`pause` after each): A's run is out
/// (`out` says what of A's is out).
async fn assert_b_gets_nothing<S: RelayStore>(b: &S, pause: Duration, out: &str) {
    for _ in 0..3 {
        let other = b.claim(&request("relay-b", 20)).await.expect("claim b");
        assert!(
            other.is_empty(),
            "relay B got {:?} while {out}",
            describe(&other)
        );
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

/// Appends `events` in one committed transaction.
async fn commit_events<B: RandomizedBackend>(backend: &B, store: &B::Store, events: &[Envelope]) {
    let mut tx = backend.begin().await.expect("begin");
    for chunk in events.chunks(500) {
        backend.append(store, &mut tx, chunk).await.expect("append");
    }
    backend.commit(tx).await.expect("commit");
}

fn events(aggregate: &str, versions: std::ops::RangeInclusive<i64>) -> Vec<Envelope> {
    versions.map(|v| event(aggregate, v)).collect()
}

/// A claim of `limit` events for `owner` asking for runs of [`RUN`].
fn request(owner: &str, limit: usize) -> ClaimRequest {
    ClaimRequest::new(owner, limit).with_run(RUN)
}

/// The records of `batch` of aggregate `agg`: (event, version), checked to be a well-formed
/// run (adjacent, consecutive versions, `run_position` 0, 1, ...; heads only when `runs` is
/// off).
fn run_of(batch: &ClaimedBatch, agg: &str, runs: bool) -> Vec<(EventId, i64)> {
    check_shape(batch, runs);
    batch
        .records
        .iter()
        .filter(|r| r.envelope.aggregate_id == agg)
        .map(|r| (r.envelope.event_id, r.envelope.aggregate_version))
        .collect()
}

fn versions(run: &[(EventId, i64)]) -> Vec<i64> {
    run.iter().map(|(_, v)| *v).collect()
}

/// Every aggregate's records in `batch`: adjacent, versions consecutive, positions 0, 1, ...,
/// at most [`RUN`] long; one per aggregate when `runs` is off.
fn check_shape(batch: &ClaimedBatch, runs: bool) {
    let mut seen: HashSet<&str> = HashSet::new();
    let mut i = 0;
    let recs = &batch.records;
    while i < recs.len() {
        let agg = recs[i].envelope.aggregate_id.as_str();
        assert!(
            seen.insert(agg),
            "the records of {agg} are not adjacent in the batch: {:?}",
            describe(batch)
        );
        let start = i;
        while i < recs.len() && recs[i].envelope.aggregate_id == agg {
            let k = i - start;
            assert_eq!(
                recs[i].run_position as usize,
                k,
                "{agg}: run_position of the {k}th record of its run: {:?}",
                describe(batch)
            );
            assert_eq!(
                recs[i].envelope.aggregate_version,
                recs[start].envelope.aggregate_version + k as i64,
                "{agg}: a run that is not consecutive: {:?}",
                describe(batch)
            );
            i += 1;
        }
        let len = i - start;
        assert!(len <= RUN, "{agg}: a run of {len}, asked for {RUN}");
        if !runs {
            assert_eq!(
                len,
                1,
                "{agg}: a store without runs handed out more than the head: {:?}",
                describe(batch)
            );
        }
    }
}

fn published(id: EventId, offset: i64) -> Outcome {
    Outcome::Published {
        event_id: id,
        ack: AckMetadata::kafka("orders", 0, offset),
    }
}

fn retry(id: EventId) -> Outcome {
    Outcome::Retry {
        event_id: id,
        delay: Duration::ZERO,
        error: LastError::from(&PublishError::new(
            PublishErrorKind::Timeout,
            "injected timeout",
        )),
    }
}

/// What the scenarios' own completions published: (event, aggregate, version) in
/// publication order, from the outcomes each store applied.
#[derive(Default)]
struct Ledger {
    published: Vec<(EventId, String, i64)>,
    offset: i64,
    versions: HashMap<EventId, (String, i64)>,
}

impl Ledger {
    fn note(&mut self, events: &[Envelope]) {
        for e in events {
            self.versions
                .insert(e.event_id, (e.aggregate_id.clone(), e.aggregate_version));
        }
    }

    /// Completes `handle` with `outcomes`; the applied publications go into the ledger.
    async fn complete<S: RelayStore>(
        &mut self,
        store: &S,
        handle: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> CompletionReport {
        let rep = store.complete(handle, outcomes).await.expect("complete");
        let refused: HashSet<EventId> = rep.superseded_events.iter().copied().collect();
        for o in outcomes {
            if let Outcome::Published { event_id, .. } = o {
                if !refused.contains(event_id) {
                    let (a, v) = self.versions[event_id].clone();
                    self.published.push((*event_id, a, v));
                }
            }
        }
        rep
    }

    /// Outcomes publishing `ids`.
    fn publish(&mut self, ids: &[EventId]) -> Vec<Outcome> {
        ids.iter()
            .map(|id| {
                self.offset += 1;
                published(*id, self.offset)
            })
            .collect()
    }

    /// Claims with `store` (runs asked for) and publishes everything claimed, until `want`
    /// events are in the ledger or 60 s passed. Returns the events parked by the claims.
    async fn drain<S: RelayStore>(&mut self, store: &S, runs: bool, want: usize) -> Vec<EventId> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut parked = Vec::new();
        while self.published.len() < want {
            assert!(
                Instant::now() < deadline,
                "not drained in 60 s: {} of {want} published: {:?}",
                self.published.len(),
                self.published
                    .iter()
                    .map(|(_, a, v)| (a.clone(), *v))
                    .collect::<Vec<_>>()
            );
            let batch = store.claim(&request("drain", 50)).await.expect("claim");
            check_shape(&batch, runs);
            parked.extend(batch.parked.iter().map(|p| p.event_id));
            if batch.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            let outcomes = self.publish(&ids_of(&batch));
            let rep = self.complete(store, &batch.handle, &outcomes).await;
            assert_eq!(
                rep.superseded, 0,
                "a plain drain completion refused: {rep:?}"
            );
        }
        parked
    }

    /// Each aggregate's publications, in order.
    fn by_aggregate(&self) -> BTreeMap<String, Vec<i64>> {
        let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (_, a, v) in &self.published {
            out.entry(a.clone()).or_default().push(*v);
        }
        out
    }

    /// No event published twice; `agg`'s publications are exactly `want`, in that order.
    fn assert_aggregate(&self, agg: &str, want: &[i64]) {
        let mut ids = HashSet::new();
        for (id, a, v) in &self.published {
            assert!(ids.insert(*id), "{a} v{v} ({id}) published twice");
        }
        let got = self.by_aggregate().remove(agg).unwrap_or_default();
        assert_eq!(got, want, "{agg}: publications (in order)");
    }
}

/// The prefix rule as stored: per aggregate, a published version has every lower version of
/// `events` published or discarded. Violations, described.
async fn prefix_violations<B: RandomizedBackend>(backend: &B, events: &[Envelope]) -> Vec<String> {
    let ids: Vec<EventId> = events.iter().map(|e| e.event_id).collect();
    let Some(st) = backend.statuses(&ids).await else {
        return vec!["the statuses could not be read".to_owned()];
    };
    // Per aggregate and version: whether some row of it is finished (published or
    // discarded), and whether some row of it is published.
    let mut per: BTreeMap<&str, BTreeMap<i64, (bool, bool)>> = BTreeMap::new();
    for e in events {
        let s = st.get(&e.event_id).copied();
        let slot = per
            .entry(e.aggregate_id.as_str())
            .or_default()
            .entry(e.aggregate_version)
            .or_default();
        slot.0 |= matches!(
            s,
            Some(DeliveryStatus::Published | DeliveryStatus::Discarded)
        );
        slot.1 |= s == Some(DeliveryStatus::Published);
    }
    let mut out = Vec::new();
    for (agg, vs) in per {
        let mut open: Option<i64> = None;
        for (v, (finished, is_published)) in vs {
            if is_published {
                if let Some(u) = open {
                    out.push(format!(
                        "{agg}: v{v} is published while v{u} is neither published nor discarded"
                    ));
                }
            }
            if !finished && open.is_none() {
                open = Some(v);
            }
        }
    }
    out
}

async fn assert_prefix<B: RandomizedBackend>(backend: &B, events: &[Envelope], when: &str) {
    let bad = prefix_violations(backend, events).await;
    assert!(bad.is_empty(), "prefix rule broken {when}: {bad:?}");
}

async fn status_of<B: RandomizedBackend>(backend: &B, id: EventId) -> Option<DeliveryStatus> {
    backend.statuses(&[id]).await?.get(&id).copied()
}

// ---------------------------------------------------------------------------------------------
// Scenarios driven at the store.

/// Aggregate `x` 1..=10 and `y` 1..=2. Relay A claims (runs of 10) and publishes `x` 1..=2
/// (1 without runs) and `y`'s claimed rows; the rest of the run is released. A claims again:
/// `x` must start at the first unpublished version; A "sends" two versions and stalls past its
/// claim (lease of 2 s; locked mode: `locked_max_hold` 3 s, the server ends the claim). Relay
/// B claims: `x` must start at that same version (the first not completed), each re-claimed row
/// of A's run marked as possibly sent (lease mode, stores with runs). A's late completion
/// (`Published` for the two) must be refused: fenced in lease mode (`superseded` 2), refused or
/// failed in locked mode, and the rows must stay pending. B publishes three and releases the
/// rest; a third claim starts after them. Then everything drains: `x` once, in order.
pub async fn expired_run_is_fenced_and_resumed<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let p = params_with(mode, Duration::from_secs(3), Duration::from_secs(300));
    let (a, b) = two_stores(backend, &p).await;
    let mut all = events("x", 1..=10);
    all.extend(events("y", 1..=2));
    commit_events(backend, &a, &all).await;
    let mut ledger = Ledger::default();
    ledger.note(&all);

    let first = a.claim(&request("relay-a", 20)).await.expect("claim 1");
    let x1 = run_of(&first, "x", runs);
    let y1 = run_of(&first, "y", runs);
    assert_eq!(
        versions(&x1),
        if runs { (1..=10).collect() } else { vec![1] },
        "{mode:?}: x's first run"
    );
    let done = if runs { 2 } else { 1 };
    let mut ids: Vec<EventId> = x1.iter().take(done).map(|(id, _)| *id).collect();
    ids.extend(y1.iter().map(|(id, _)| *id));
    let outcomes = ledger.publish(&ids);
    let rep = ledger.complete(&a, &first.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (ids.len(), 0),
        "{mode:?}: {rep:?}"
    );
    assert_prefix(backend, &all, "after A's first completion").await;

    let second = a.claim(&request("relay-a", 20)).await.expect("claim 2");
    let x2 = run_of(&second, "x", runs);
    assert_eq!(
        x2.first().map(|(_, v)| *v),
        Some(done as i64 + 1),
        "{mode:?}: the released rest of the run is not the head again: {:?}",
        describe(&second)
    );
    // A sends x2[0] and x2[1] (if it has two) and stalls past its claim.
    let sent: Vec<EventId> = x2.iter().take(2).map(|(id, _)| *id).collect();
    tokio::time::sleep(Duration::from_millis(3_500)).await;

    let third = claim_until_some(
        &b,
        "relay-b",
        20,
        Duration::from_millis(200),
        &format!("{mode:?}: relay B never got x after A's claim ended"),
    )
    .await;
    let x3 = run_of(&third, "x", runs);
    assert_eq!(
        x3.first().map(|(_, v)| *v),
        Some(done as i64 + 1),
        "{mode:?}: B does not start at the first version not completed: {:?}",
        describe(&third)
    );
    if runs && matches!(mode, ClaimMode::Lease { .. }) {
        let a_had: HashSet<EventId> = x2.iter().map(|(id, _)| *id).collect();
        for r in &third.records {
            if a_had.contains(&r.envelope.event_id) {
                assert!(
                    r.maybe_sent_before,
                    "{mode:?}: x v{} was in A's run (A's claim ended without an outcome) but \
                     is not marked maybe_sent_before",
                    r.envelope.aggregate_version
                );
            }
        }
    }

    // A's late completion of what it sent.
    let late = ledger.publish(&sent);
    match a.complete(&second.handle, &late).await {
        Ok(rep) => {
            assert_eq!(
                rep.applied, 0,
                "{mode:?}: A's late completion was applied while B holds x: {rep:?}"
            );
            assert_eq!(rep.superseded, sent.len(), "{mode:?}: {rep:?}");
        }
        Err(e) => assert!(
            matches!(mode, ClaimMode::LockedTransaction),
            "{mode:?}: a late lease completion must be fenced, not fail: {e}"
        ),
    }
    for id in &sent {
        assert_eq!(
            status_of(backend, *id).await,
            Some(DeliveryStatus::Pending),
            "{mode:?}: a row of B's claim changed by A's late completion"
        );
    }

    let take = if runs { 3 } else { 1 };
    let ids: Vec<EventId> = x3.iter().take(take).map(|(id, _)| *id).collect();
    let outcomes = ledger.publish(&ids);
    let rep = ledger.complete(&b, &third.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (take, 0),
        "{mode:?}: {rep:?}"
    );
    assert_prefix(backend, &all, "after B's completion").await;

    let fourth = b.claim(&request("relay-b", 20)).await.expect("claim 4");
    let x4 = run_of(&fourth, "x", runs);
    assert_eq!(
        x4.first().map(|(_, v)| *v),
        Some(done as i64 + take as i64 + 1),
        "{mode:?}: after B's partial completion: {:?}",
        describe(&fourth)
    );
    let outcomes = ledger.publish(&ids_of(&fourth));
    ledger.complete(&b, &fourth.handle, &outcomes).await;
    ledger.drain(&b, runs, all.len()).await;
    ledger.assert_aggregate("x", &(1..=10).collect::<Vec<_>>());
    ledger.assert_aggregate("y", &[1, 2]);
    assert_prefix(backend, &all, "at the end").await;
}

/// `x` 1..=3 committed; A claims the run. While it is out, `x` 4 and 5 commit: relay B's claims
/// must not hand out any `x` row. A publishes the run; the next claim starts at 4 (runs: 4..=5).
/// A takes 4..=5 (runs); while out, `x` 6 commits; A publishes 4 and retries 5: the next
/// claims give 5 then 6, never 6 first. Everything once, in order.
pub async fn version_committed_during_a_run_is_claimed_after_it<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let (a, b) = two_stores(backend, &params_of(mode)).await;
    let mut all = events("x", 1..=3);
    let mut ledger = Ledger::default();
    commit_events(backend, &a, &all).await;
    let first = a.claim(&request("relay-a", 20)).await.expect("claim");
    let run1 = run_of(&first, "x", runs);
    assert_eq!(
        versions(&run1),
        if runs { vec![1, 2, 3] } else { vec![1] },
        "{mode:?}"
    );
    let late = events("x", 4..=5);
    commit_events(backend, &a, &late).await;
    all.extend(late);
    ledger.note(&all);
    assert_b_gets_nothing(
        &b,
        Duration::ZERO,
        &format!("A's run of x is out ({mode:?})"),
    )
    .await;
    let ids: Vec<EventId> = run1.iter().map(|(id, _)| *id).collect();
    let outcomes = ledger.publish(&ids);
    let rep = ledger.complete(&a, &first.handle, &outcomes).await;
    assert_eq!(rep.applied, ids.len(), "{rep:?}");
    if !runs {
        ledger.drain(&b, runs, 3).await;
    }
    assert_prefix(backend, &all, "after the first run").await;

    let second = b.claim(&request("relay-b", 20)).await.expect("claim");
    let run2 = run_of(&second, "x", runs);
    assert_eq!(
        versions(&run2),
        if runs { vec![4, 5] } else { vec![4] },
        "{mode:?}: after the first run"
    );
    let six = event("x", 6);
    commit_events(backend, &a, std::slice::from_ref(&six)).await;
    all.push(six);
    ledger.note(&all);
    let other = a.claim(&request("relay-a", 20)).await.expect("claim a");
    assert!(
        other.is_empty(),
        "{mode:?}: relay A got {:?} while B's run of x is out",
        describe(&other)
    );
    let mut outcomes = ledger.publish(&[run2[0].0]);
    if let Some((five, _)) = run2.get(1) {
        outcomes.push(retry(*five));
    }
    let rep = ledger.complete(&b, &second.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (outcomes.len(), 0),
        "{rep:?}"
    );
    assert_prefix(backend, &all, "after 4 published, 5 retried").await;
    ledger.drain(&a, runs, all.len()).await;
    ledger.assert_aggregate("x", &[1, 2, 3, 4, 5, 6]);
    assert_prefix(backend, &all, "at the end").await;
}

/// `x` 1, 2, 4, 5 committed (3 missing): A's run is 1..=2 (the gap ends it). While it is out, a
/// duplicate of version 2 and one of version 1 commit, and then version 3 (filling the gap).
/// Relay B's claims hand out nothing of `x` meanwhile. A publishes 1..=2. Then: the duplicates
/// are parked (out of order), never published; 3, 4, 5 come out in order.
pub async fn lower_version_committed_after_the_run_is_parked<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let (a, b) = two_stores(backend, &params_of(mode)).await;
    let mut all = vec![event("x", 1), event("x", 2), event("x", 4), event("x", 5)];
    commit_events(backend, &a, &all).await;
    let first = a.claim(&request("relay-a", 20)).await.expect("claim");
    let run1 = run_of(&first, "x", runs);
    assert_eq!(
        versions(&run1),
        if runs { vec![1, 2] } else { vec![1] },
        "{mode:?}: a run must stop at the gap"
    );
    let (dup2, dup1, three) = (event("x", 2), event("x", 1), event("x", 3));
    let dups = [dup2.event_id, dup1.event_id];
    commit_events(backend, &a, std::slice::from_ref(&dup2)).await;
    commit_events(backend, &a, std::slice::from_ref(&dup1)).await;
    commit_events(backend, &a, std::slice::from_ref(&three)).await;
    all.extend([dup2, dup1, three]);
    let mut ledger = Ledger::default();
    ledger.note(&all);
    assert_b_gets_nothing(
        &b,
        Duration::ZERO,
        &format!("A's run of x is out ({mode:?})"),
    )
    .await;
    for (id, v) in &run1 {
        assert_eq!(
            status_of(backend, *id).await,
            Some(DeliveryStatus::Pending),
            "{mode:?}: x v{v} of A's run changed by B's claims"
        );
    }
    let ids: Vec<EventId> = run1.iter().map(|(id, _)| *id).collect();
    let outcomes = ledger.publish(&ids);
    let rep = ledger.complete(&a, &first.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (ids.len(), 0),
        "{mode:?}: A's run completion: {rep:?}"
    );
    assert_prefix(backend, &all, "after A's run").await;
    ledger.drain(&b, runs, 5).await;
    ledger.assert_aggregate("x", &[1, 2, 3, 4, 5]);
    for id in dups {
        assert_eq!(
            status_of(backend, id).await,
            Some(DeliveryStatus::Parked),
            "{mode:?}: a duplicate version committed during the run is not parked"
        );
    }
    assert_prefix(backend, &all, "at the end").await;
}

/// What the operator does to the parked row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperatorAction {
    /// `retry_parked`.
    Retry,
    /// `discard_parked` (refused with `Conflict` while a lower version is unfinished).
    Discard,
}

/// Two aggregates, one parked row of each, and a run of each out while the operator acts.
/// * `x`: 1, 2 published; a duplicate of 2 commits and is parked (out of order); 3..=8 commit
///   and A takes them as a run. The operator retries (or discards) the duplicate while the run
///   is out: relay B's claims hand out nothing of `x`; the duplicate is never published.
/// * `y`: 1 published; 3..=5 commit, 3 is parked for the gap (timeout 1 s); 2 commits and A
///   takes it (the run stops at the parked 3). The operator retries 3 (or tries to discard it:
///   `Conflict`, 2 is unfinished) while the run is out: B hands out nothing of `y`; after A
///   publishes 2, `y` goes on in order (3..=5 retried; after a discard, 4..=5).
pub async fn operator_acts_on_a_parked_row_while_a_run_is_out<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
    action: OperatorAction,
) {
    let p = params_with(mode, Duration::from_secs(60), Duration::from_secs(1));
    let (a, b) = two_stores(backend, &p).await;
    let mut all = vec![event("x", 1), event("x", 2), event("y", 1)];
    let mut ledger = Ledger::default();
    ledger.note(&all);
    commit_events(backend, &a, &all).await;
    ledger.drain(&a, runs, 3).await;
    let dup = event("x", 2);
    let dup_id = dup.event_id;
    let mut later = vec![dup];
    later.extend(events("y", 3..=5));
    commit_events(backend, &a, &later).await;
    all.extend(later);
    // Claims until the duplicate and y 3 are parked (y 3 after the gap timeout).
    let y3 = all
        .iter()
        .find(|e| e.aggregate_id == "y" && e.aggregate_version == 3);
    let y3 = y3.expect("y 3").event_id;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let batch = a.claim(&request("relay-a", 20)).await.expect("claim");
        assert!(
            batch.is_empty(),
            "{mode:?}: handed out {:?} (a duplicate or a version above a gap)",
            describe(&batch)
        );
        let parked: HashSet<EventId> = a
            .list_parked(100)
            .await
            .expect("list")
            .iter()
            .map(|p| p.envelope.event_id)
            .collect();
        if parked.contains(&dup_id) && parked.contains(&y3) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{mode:?}: the duplicate and y 3 not parked in 20 s: {parked:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut more = events("x", 3..=8);
    more.push(event("y", 2));
    commit_events(backend, &a, &more).await;
    all.extend(more);
    ledger.note(&all);

    let run = a
        .claim(&request("relay-a", 30))
        .await
        .expect("claim the runs");
    let xr = run_of(&run, "x", runs);
    let yr = run_of(&run, "y", runs);
    assert_eq!(
        versions(&xr),
        if runs { (3..=8).collect() } else { vec![3] },
        "{mode:?}: x's run"
    );
    assert_eq!(
        versions(&yr),
        vec![2],
        "{mode:?}: y's run stops at the parked 3"
    );
    // The operator acts from its own store instance, in a task: in locked mode its statements
    // may wait for the run's locks (until the run's completion), which is allowed.
    let operator = backend.store(&p);
    let acting = tokio::spawn(async move {
        match action {
            OperatorAction::Retry => (
                operator.retry_parked(dup_id, "operator").await,
                operator.retry_parked(y3, "operator").await,
            ),
            OperatorAction::Discard => (
                operator
                    .discard_parked(dup_id, "operator", "a duplicate")
                    .await,
                operator.discard_parked(y3, "operator", "skip it").await,
            ),
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_b_gets_nothing(
        &b,
        Duration::from_millis(100),
        &format!("A's runs of x and y are out ({mode:?}, {action:?})"),
    )
    .await;
    // In lease mode the operator is answered while the runs are out (nothing to wait for).
    let lease_mode = matches!(mode, ClaimMode::Lease { .. });
    let (answered, acting) = if lease_mode {
        (Some(acting.await.expect("operator task")), None)
    } else {
        (None, Some(acting))
    };
    let ids = ids_of(&run);
    let outcomes = ledger.publish(&ids);
    let rep = ledger.complete(&a, &run.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (ids.len(), 0),
        "{mode:?}: the runs' completion: {rep:?}"
    );
    assert_prefix(backend, &all, "after the runs").await;
    let (dup_result, y3_result) = match answered {
        Some(r) => r,
        None => acting
            .expect("the operator task")
            .await
            .expect("operator task"),
    };
    match action {
        OperatorAction::Retry => {
            // A duplicate below `last` may be refused a retry; either way it must not go out.
            // y 3 may be refused (`Conflict`: y 2 was unfinished): then it is retried now.
            if y3_result.is_err() {
                a.retry_parked(y3, "operator")
                    .await
                    .expect("retry y 3 once 2 is published");
            }
        }
        OperatorAction::Discard => {
            dup_result.expect("discard the duplicate");
            if lease_mode {
                assert!(
                    y3_result.is_err(),
                    "{mode:?}: y 3 discarded while y 2 (in a run) was unfinished"
                );
            }
            if y3_result.is_err() {
                a.discard_parked(y3, "operator", "skip it")
                    .await
                    .expect("discard y 3 once 2 is published");
            }
        }
    }
    let y_want: Vec<i64> = match action {
        OperatorAction::Retry => vec![1, 2, 3, 4, 5],
        OperatorAction::Discard => vec![1, 2, 4, 5],
    };
    let want = 8 + y_want.len();
    ledger.drain(&b, runs, want).await;
    ledger.assert_aggregate("x", &(1..=8).collect::<Vec<_>>());
    ledger.assert_aggregate("y", &y_want);
    assert_ne!(
        status_of(backend, dup_id).await,
        Some(DeliveryStatus::Published),
        "{mode:?}: the duplicate was published"
    );
    assert_prefix(backend, &all, "at the end").await;
}

/// `x` 1..=5 committed, one claim of `relay-a`: the whole run (or the head alone without
/// runs), checked. The opening of the completion scenarios.
async fn claim_x_one_to_five<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) -> (B::Store, Vec<Envelope>, Ledger, ClaimedBatch) {
    let store = store_of(backend, mode).await;
    let all = events("x", 1..=5);
    commit_events(backend, &store, &all).await;
    let mut ledger = Ledger::default();
    ledger.note(&all);
    let batch = store.claim(&request("relay-a", 20)).await.expect("claim");
    let run = run_of(&batch, "x", runs);
    assert_eq!(
        versions(&run),
        if runs { (1..=5).collect() } else { vec![1] },
        "{mode:?}"
    );
    (store, all, ledger, batch)
}

/// `x` 1..=5. One claim; the completion says `Published 1, Retry 2, Published 3` (a hole at
/// 2). 1 and the retry of 2 are applied; 3 is refused (superseded) and stays pending; 4 and 5
/// (no outcome) are released without an attempt. The next claim starts at 2 (attempts 1) and
/// holds 3..=5 with no attempt counted; 3 comes after 2. Without runs the claim holds 1 only,
/// and the outcomes for 2 and 3 are refused as outcomes for rows the claim does not hold.
pub async fn completion_with_a_hole_is_refused<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let (store, all, mut ledger, batch) = claim_x_one_to_five(backend, mode, runs).await;
    let id = |v: i64| all[v as usize - 1].event_id;
    let mut outcomes = ledger.publish(&[id(1)]);
    outcomes.push(retry(id(2)));
    outcomes.extend(ledger.publish(&[id(3)]));
    let rep = ledger.complete(&store, &batch.handle, &outcomes).await;
    let refused: HashSet<EventId> = rep.superseded_events.iter().copied().collect();
    assert!(
        refused.contains(&id(3)),
        "{mode:?}: Published 3 after Retry 2 was applied: {rep:?}"
    );
    assert!(
        !refused.contains(&id(1)),
        "{mode:?}: Published 1 refused: {rep:?}"
    );
    if runs {
        assert_eq!(
            (rep.applied, rep.superseded),
            (2, 1),
            "{mode:?}: 1 and the retry of 2 applied, 3 refused: {rep:?}"
        );
    }
    assert_eq!(
        status_of(backend, id(3)).await,
        Some(DeliveryStatus::Pending),
        "{mode:?}: 3 is not pending after its refused publication"
    );
    assert_prefix(backend, &all, "after the completion with a hole").await;

    let next = claim_until_some(
        &store,
        "relay-a",
        10,
        Duration::from_millis(50),
        &format!("{mode:?}: 2 never came back"),
    )
    .await;
    let again = run_of(&next, "x", runs);
    assert_eq!(
        versions(&again),
        if runs { (2..=5).collect() } else { vec![2] },
        "{mode:?}: the re-claim after the hole"
    );
    for r in &next.records {
        let v = r.envelope.aggregate_version;
        let want = u32::from(v == 2 && runs);
        assert_eq!(
            r.attempts, want,
            "{mode:?}: x v{v}: attempts after the completion with a hole"
        );
    }
    let outcomes = ledger.publish(&ids_of(&next));
    ledger.complete(&store, &next.handle, &outcomes).await;
    ledger.drain(&store, runs, 5).await;
    ledger.assert_aggregate("x", &[1, 2, 3, 4, 5]);
    assert_prefix(backend, &all, "at the end").await;
}

/// `x` 1..=5. One claim; the completion gives no outcome for the head and says `Published 2,
/// Published 3`: a publication whose predecessor is neither published in the same completion
/// nor `last` (0), so both must be refused; nothing published, 1..=5 pending, and the next
/// claims publish 1..=5 in order with nothing parked (a store that took 2, 3 would advance
/// `last` to 3 and park 1 as out of order).
pub async fn completion_without_the_head_is_refused<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let (store, all, mut ledger, batch) = claim_x_one_to_five(backend, mode, runs).await;
    let outcomes = ledger.publish(&[all[1].event_id, all[2].event_id]);
    let rep = ledger.complete(&store, &batch.handle, &outcomes).await;
    assert_eq!(
        (rep.applied, rep.superseded),
        (0, 2),
        "{mode:?}: Published 2, 3 without an outcome for 1 (last 0) must be refused: {rep:?}"
    );
    assert_prefix(backend, &all, "after a completion without the head").await;
    let parked = ledger.drain(&store, runs, 5).await;
    assert!(parked.is_empty(), "{mode:?}: parked {parked:?}");
    ledger.assert_aggregate("x", &[1, 2, 3, 4, 5]);
    assert_prefix(backend, &all, "at the end").await;
}

// ---------------------------------------------------------------------------------------------
// Scenarios driven through relays.

/// What the broker double saw.
#[derive(Default)]
struct Wire {
    /// Hand-overs in order: (relay, aggregate, version, event).
    sends: Vec<(String, String, i64, EventId)>,
    /// Acknowledged: (event, aggregate, version, relay), in acknowledgement order.
    acked: Vec<(EventId, String, i64, String)>,
    /// (aggregate, version) whose acknowledgement was returned to a relay (or that an
    /// operator discarded).
    acked_versions: HashSet<(String, i64)>,
    /// Aggregates in a publish call right now, by relay.
    in_flight: HashMap<String, String>,
    /// Hand-overs per event.
    attempts: HashMap<EventId, u32>,
    violations: Vec<String>,
}

/// The broker's answer to one hand-over.
#[derive(Clone, Debug)]
enum Verdict {
    Ack,
    Fail(PublishError),
    /// Signal and never answer (the relay is dropped there).
    Hang,
}

type Script = Arc<dyn Fn(&Envelope, u32) -> Verdict + Send + Sync>;

/// A broker double: checks the send order (a version goes out only after its predecessor's
/// acknowledgement was returned, or it is its aggregate's first), notes what is in flight,
/// takes `latency`, answers by `script` (event, hand-over number from 1).
#[derive(Clone)]
struct RunBroker {
    name: String,
    wire: Arc<Mutex<Wire>>,
    script: Script,
    latency: Duration,
    delivery_timeout: Duration,
    hung: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
}

impl RunBroker {
    fn new(name: &str, wire: &Arc<Mutex<Wire>>, script: Script) -> Self {
        Self {
            name: name.to_owned(),
            wire: Arc::clone(wire),
            script,
            latency: Duration::from_millis(1),
            delivery_timeout: Duration::from_millis(100),
            hung: Arc::default(),
        }
    }
}

/// The events acknowledged so far.
fn acked_ids(wire: &Mutex<Wire>) -> HashSet<EventId> {
    wire.lock()
        .expect("wire")
        .acked
        .iter()
        .map(|a| a.0)
        .collect()
}

/// Stops the relays driven by `relays` (`stop`) and checks that no cycle of theirs failed.
async fn stop_relays(stop: &AtomicBool, relays: Vec<tokio::task::JoinHandle<usize>>, what: &str) {
    stop.store(true, Ordering::Release);
    for r in relays {
        let errors = tokio::time::timeout(Duration::from_secs(20), r)
            .await
            .expect("relay stops")
            .expect("relay task");
        assert_eq!(errors, 0, "{what}: failed relay cycles");
    }
}

fn ack_all() -> Script {
    Arc::new(|_: &Envelope, _: u32| Verdict::Ack)
}

#[async_trait]
impl Publisher for RunBroker {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let mut verdicts = Vec::with_capacity(batch.len());
        {
            let mut wire = self.wire.lock().expect("wire");
            for e in batch {
                let (agg, v) = (e.aggregate_id.clone(), e.aggregate_version);
                if v > 1 && !wire.acked_versions.contains(&(agg.clone(), v - 1)) {
                    wire.violations.push(format!(
                        "{} sent {agg} v{v} before an acknowledgement of v{} was returned",
                        self.name,
                        v - 1
                    ));
                }
                if let Some(other) = wire.in_flight.insert(agg.clone(), self.name.clone()) {
                    if other != self.name {
                        wire.violations.push(format!(
                            "{agg} v{v} sent by {} while {other} had it in flight",
                            self.name
                        ));
                    }
                }
                wire.sends.push((self.name.clone(), agg, v, e.event_id));
                let n = wire.attempts.entry(e.event_id).or_default();
                *n += 1;
                verdicts.push((self.script)(e, *n));
            }
        }
        if verdicts.iter().any(|v| matches!(v, Verdict::Hang)) {
            // The relay is dropped while this call hangs: its sends end with it.
            {
                let mut wire = self.wire.lock().expect("wire");
                for e in batch {
                    wire.in_flight.remove(&e.aggregate_id);
                }
            }
            if let Some(tx) = self.hung.lock().expect("hung").take() {
                let _ = tx.send(());
            }
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.latency).await;
        let mut wire = self.wire.lock().expect("wire");
        let mut out = Vec::with_capacity(batch.len());
        for (e, verdict) in batch.iter().zip(verdicts) {
            wire.in_flight.remove(&e.aggregate_id);
            match verdict {
                Verdict::Ack | Verdict::Hang => {
                    wire.acked.push((
                        e.event_id,
                        e.aggregate_id.clone(),
                        e.aggregate_version,
                        self.name.clone(),
                    ));
                    wire.acked_versions
                        .insert((e.aggregate_id.clone(), e.aggregate_version));
                    let offset = wire.acked.len() as i64;
                    out.push(Ok(AckMetadata::kafka("orders", 0, offset)));
                }
                Verdict::Fail(err) => out.push(Err(err)),
            }
        }
        out
    }

    fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout
    }
}

/// What a store wrapper saw of the claims.
#[derive(Default)]
struct Claims {
    /// Aggregates held by live claims (returned, their completion or release not started),
    /// by token.
    held: HashMap<uuid::Uuid, (String, HashSet<String>)>,
    /// Claims that returned a run (two or more events of one aggregate).
    runs: usize,
    /// Every record handed out: (aggregate, version, attempts, maybe sent before, owner).
    records: Vec<(String, i64, u32, bool, String)>,
    violations: Vec<String>,
}

/// A store between a relay and the real one: checks each claim's shape and that no two live
/// claims hold one aggregate (only where no claim can end by expiry: `strict`).
struct Watched<S> {
    inner: S,
    claims: Arc<Mutex<Claims>>,
    strict: bool,
    runs: bool,
}

#[async_trait]
impl<S: RelayStore> RelayStore for Watched<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let batch = self.inner.claim(request).await?;
        check_shape(&batch, self.runs);
        let mut c = self.claims.lock().expect("claims");
        let mut aggs = HashSet::new();
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for r in &batch.records {
            let agg = r.envelope.aggregate_id.clone();
            *counts.entry(r.envelope.aggregate_id.as_str()).or_default() += 1;
            c.records.push((
                agg.clone(),
                r.envelope.aggregate_version,
                r.attempts,
                r.maybe_sent_before,
                request.owner.clone(),
            ));
            aggs.insert(agg);
        }
        if counts.values().any(|n| *n > 1) {
            c.runs += 1;
        }
        if self.strict {
            let mut found = Vec::new();
            for (token, (owner, held)) in &c.held {
                for agg in held.intersection(&aggs) {
                    found.push(format!(
                        "{agg} handed to {} while claim {token} of {owner} holds it",
                        request.owner
                    ));
                }
            }
            c.violations.extend(found);
        }
        c.held
            .insert(batch.handle.token, (request.owner.clone(), aggs));
        Ok(batch)
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        self.claims
            .lock()
            .expect("claims")
            .held
            .remove(&claim.token);
        self.inner.complete(claim, outcomes).await
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.claims
            .lock()
            .expect("claims")
            .held
            .remove(&claim.token);
        self.inner.release(claim).await
    }

    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }

    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

/// A relay asking for runs of [`RUN`].
fn run_relay<S: RelayStore, P: Publisher>(
    store: S,
    publisher: P,
    owner: &str,
    batch: usize,
    prefetch: bool,
    early: bool,
) -> Relay<S, P> {
    let config = RelayConfig::builder()
        .owner(owner)
        .batch_size(batch)
        .run(RUN)
        .prefetch(prefetch)
        .early_claim(early)
        .idle(Duration::from_millis(5), Duration::from_millis(40))
        .lease_margin(outbox_core::MIN_LEASE_MARGIN)
        .retry(retry_policy(
            Duration::from_millis(5),
            Duration::from_millis(20),
            50,
        ))
        .circuit_breaker(Duration::from_millis(5), Duration::from_millis(40))
        .build()
        .expect("relay config");
    seeded_relay(store, publisher, config, 7)
}

/// One relay's loop until `stop`: `run_once`, then the report's pause or the idle backoff.
/// Returns the cycles that failed.
async fn drive<S: RelayStore, P: Publisher>(
    mut relay: Relay<S, P>,
    stop: Arc<AtomicBool>,
) -> usize {
    let mut errors = 0;
    while !stop.load(Ordering::Acquire) {
        match relay.run_once().await {
            Ok(report) => {
                if let Some(pause) = report.pause {
                    tokio::time::sleep(pause).await;
                } else if report.is_idle() {
                    tokio::time::sleep(relay.idle_delay()).await;
                } else {
                    relay.reset_idle();
                }
            }
            Err(_) => {
                errors += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let _ = relay.release_prefetched().await;
    errors
}

/// The broker's record: every event of `expected` acknowledged; each aggregate's first
/// acknowledgements in version order without a gap; no duplicate unless `duplicates`; no
/// send-order or overlap violation.
fn check_wire(wire: &Wire, expected: &[Envelope], duplicates: bool) {
    assert!(wire.violations.is_empty(), "{:#?}", wire.violations);
    let want: HashSet<EventId> = expected.iter().map(|e| e.event_id).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (id, agg, v, relay) in &wire.acked {
        if !seen.insert(*id) {
            assert!(
                duplicates,
                "{agg} v{v} acknowledged twice (again by {relay})"
            );
            continue;
        }
        let prev = last.insert(agg.as_str(), *v).unwrap_or(0);
        assert_eq!(*v, prev + 1, "{agg}: first delivery of v{v} after v{prev}");
    }
    assert_eq!(seen, want, "every event acknowledged");
}

/// Two relays (each over its own store instance, batches of 20, optionally with prefetch and
/// the early claim) on one hot aggregate of 300 versions beside 20 single events, while two
/// producers append 100 more versions of it (one version per transaction) and a monitor
/// samples the stored statuses for the prefix rule. Checks: no two live claims ever hold the
/// aggregate, no version sent before its predecessor's acknowledgement, no two relays with it
/// in flight, every event once in version order, the prefix rule at every sample, no failed
/// cycle; with runs, that runs were handed out at all.
pub async fn two_relays_hammer_one_hot_aggregate<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
    prefetch: bool,
    early: bool,
) {
    let p = params_of(mode);
    let store = prepared(backend, &p).await;
    let mut all = events("hot", 1..=300);
    all.extend((0..20).map(|i| event(&format!("cold-{i}"), 1)));
    commit_events(backend, &store, &all).await;
    let wire = Arc::new(Mutex::new(Wire::default()));
    let claims = Arc::new(Mutex::new(Claims::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut relays = Vec::new();
    for name in ["relay-a", "relay-b"] {
        let watched = Watched {
            inner: backend.store(&p),
            claims: Arc::clone(&claims),
            strict: true,
            runs,
        };
        let relay = run_relay(
            watched,
            RunBroker::new(name, &wire, ack_all()),
            name,
            20,
            prefetch,
            early,
        );
        relays.push(tokio::spawn(drive(relay, Arc::clone(&stop))));
    }
    let sampled: Arc<Mutex<Vec<String>>> = Arc::default();
    // Producers: versions 301..=400, one transaction each, two at a time committed in
    // reverse (a higher version's row may be visible first).
    let mut late = Vec::new();
    for pair in (301..=400).collect::<Vec<i64>>().chunks(2) {
        let mut open = Vec::new();
        for v in pair {
            let e = event("hot", *v);
            let mut tx = backend.begin().await.expect("begin");
            backend
                .append(&store, &mut tx, std::slice::from_ref(&e))
                .await
                .expect("append");
            open.push(tx);
            late.push(e);
        }
        while let Some(tx) = open.pop() {
            backend.commit(tx).await.expect("commit");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        let bad = prefix_violations(backend, &all).await;
        sampled.lock().expect("sampled").extend(bad);
    }
    all.extend(late);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let bad = prefix_violations(backend, &all).await;
        assert!(bad.is_empty(), "{mode:?}: prefix rule broken: {bad:?}");
        let acked = acked_ids(&wire);
        if all.iter().all(|e| acked.contains(&e.event_id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{mode:?}: {} of {} acknowledged in 120 s",
            acked.len(),
            all.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_relays(&stop, relays, &format!("{mode:?}")).await;
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.in_flight), (0, 0), "{stats:?}");
    let sampled = sampled.lock().expect("sampled");
    assert!(
        sampled.is_empty(),
        "{mode:?}: prefix rule broken: {sampled:?}"
    );
    let c = claims.lock().expect("claims");
    assert!(c.violations.is_empty(), "{mode:?}: {:#?}", c.violations);
    if runs {
        assert!(c.runs > 0, "{mode:?}: no claim handed out a run");
    }
    check_wire(&wire.lock().expect("wire"), &all, false);
}

/// `x` 1..=10, `y` 1. A relay (lease 2 s; locked: `locked_max_hold` 3 s) gets its claim
/// acknowledged three times (`y` 1 and `x` 1, 2 with runs; one at a time without), then
/// hangs with the next `x` version in flight and is dropped. A second relay finishes: it starts
/// `x` at the first version the dead relay did not complete, re-sends what the dead relay may
/// have sent (marked `maybe_sent_before` in lease mode), never reorders: first deliveries in
/// version order, duplicates only of what the dead relay had acknowledged.
pub async fn crash_mid_run_resends_in_order<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let p = params_with(mode, Duration::from_secs(3), Duration::from_secs(300));
    let store = prepared(backend, &p).await;
    let mut all = events("x", 1..=10);
    all.push(event("y", 1));
    commit_events(backend, &store, &all).await;
    let wire = Arc::new(Mutex::new(Wire::default()));
    let acks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&acks);
    let script: Script = Arc::new(move |_: &Envelope, _: u32| {
        if counter.fetch_add(1, Ordering::SeqCst) < 3 {
            Verdict::Ack
        } else {
            Verdict::Hang
        }
    });
    let broker = RunBroker::new("doomed", &wire, script);
    let (tx, rx) = tokio::sync::oneshot::channel();
    *broker.hung.lock().expect("hung") = Some(tx);
    let claims = Arc::new(Mutex::new(Claims::default()));
    let doomed = run_relay(
        Watched {
            inner: backend.store(&p),
            claims: Arc::new(Mutex::new(Claims::default())),
            strict: false,
            runs,
        },
        broker,
        "doomed",
        20,
        false,
        false,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(drive(doomed, Arc::clone(&stop)));
    tokio::time::timeout(Duration::from_secs(20), rx)
        .await
        .expect("the doomed relay hung mid-run")
        .expect("signal");
    task.abort();
    let _ = task.await;
    let sent_by_doomed: Vec<(String, i64)> = wire
        .lock()
        .expect("wire")
        .sends
        .iter()
        .map(|s| (s.1.clone(), s.2))
        .collect();
    // The first x version not completed by the dead relay.
    let ids: Vec<EventId> = all.iter().map(|e| e.event_id).collect();
    let st = backend.statuses(&ids).await.expect("statuses");
    let first_open = all
        .iter()
        .filter(|e| e.aggregate_id == "x" && st[&e.event_id] != DeliveryStatus::Published)
        .map(|e| e.aggregate_version)
        .min()
        .expect("the dead relay cannot have completed x");
    assert_prefix(backend, &all, "after the crash").await;

    let survivor = run_relay(
        Watched {
            inner: store.clone(),
            claims: Arc::clone(&claims),
            strict: true,
            runs,
        },
        RunBroker::new("survivor", &wire, ack_all()),
        "survivor",
        20,
        false,
        false,
    );
    let sv = tokio::spawn(drive(survivor, Arc::clone(&stop)));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done = acked_ids(&wire);
        if all.iter().all(|e| done.contains(&e.event_id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{mode:?}: the survivor did not finish"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_relays(&stop, vec![sv], &format!("{mode:?}: the survivor")).await;
    assert_prefix(backend, &all, "at the end").await;
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.in_flight), (0, 0), "{stats:?}");
    let wire = wire.lock().expect("wire");
    let survivor_x: Vec<i64> = wire
        .acked
        .iter()
        .filter(|a| a.3 == "survivor" && a.1 == "x")
        .map(|a| a.2)
        .collect();
    let want: Vec<i64> = (first_open..=10).collect();
    assert_eq!(
        survivor_x, want,
        "{mode:?}: the survivor must publish x from the first version not completed, once \
         each, in order (the dead relay sent {sent_by_doomed:?})"
    );
    check_wire(&wire, &all, true);
    if matches!(mode, ClaimMode::Lease { .. }) && runs {
        let c = claims.lock().expect("claims");
        let mut first_claim = HashSet::new();
        for (agg, v, _, maybe, _) in &c.records {
            // Only the first claim after the crash: a later one follows the survivor's own
            // release, which may clear the mark.
            if !first_claim.insert((agg.clone(), *v)) {
                continue;
            }
            let sent = sent_by_doomed.contains(&(agg.clone(), *v));
            if sent && agg == "x" && *v >= first_open {
                assert!(
                    maybe,
                    "{mode:?}: {agg} v{v} was sent by the dead relay mid-run but is not marked \
                     maybe_sent_before"
                );
            }
        }
    }
}

/// A slow broker (250 ms per event, delivery timeout 400 ms) and claims of 2.5 s (lease, or
/// `locked_max_hold`): a run of 10 cannot finish inside its claim, so each relay must stop its
/// run while the claim still covers one more publication (delivery timeout + the 1 s margin)
/// and leave the rest to a later claim. Two relays drain `x` 1..=30. Checks: no two relays
/// with `x` in flight at once, every version sent only after its predecessor's
/// acknowledgement, every version acknowledged exactly once (a run that outlived its claim
/// would have the other relay take `x` over and send a version again), in order.
pub async fn slow_broker_runs_stop_inside_their_claim<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
) {
    let mode = match mode {
        ClaimMode::Lease { .. } => lease(2.5),
        other => other,
    };
    let p = StoreParams {
        mode,
        locked_hold: Duration::from_millis(2_500),
        gap_timeout: Duration::from_secs(300),
        delivery_timeout: Duration::from_millis(400),
    };
    let store = prepared(backend, &p).await;
    let all = events("x", 1..=30);
    commit_events(backend, &store, &all).await;
    let wire = Arc::new(Mutex::new(Wire::default()));
    let claims = Arc::new(Mutex::new(Claims::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut relays = Vec::new();
    for name in ["relay-a", "relay-b"] {
        let mut broker = RunBroker::new(name, &wire, ack_all());
        broker.latency = Duration::from_millis(250);
        broker.delivery_timeout = Duration::from_millis(400);
        let relay = run_relay(
            Watched {
                inner: backend.store(&p),
                claims: Arc::clone(&claims),
                strict: false,
                runs,
            },
            broker,
            name,
            20,
            false,
            false,
        );
        relays.push(tokio::spawn(drive(relay, Arc::clone(&stop))));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let acked = acked_ids(&wire);
        if all.iter().all(|e| acked.contains(&e.event_id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{mode:?}: {} of 30 acknowledged in 120 s",
            acked.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_relays(&stop, relays, &format!("{mode:?}")).await;
    assert_prefix(backend, &all, "at the end").await;
    let longest = {
        let c = claims.lock().expect("claims");
        c.runs
    };
    if runs {
        assert!(longest > 0, "{mode:?}: no claim handed out a run");
    }
    check_wire(&wire.lock().expect("wire"), &all, false);
}

/// How the broker fails the middle of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MidRunFailure {
    /// A record-scoped timeout: the relay retries it (an attempt counted).
    Retry,
    /// A transport failure (`BrokerUnavailable`): deferred, no attempt counted.
    Transport,
    /// A permanent failure (`InvalidRecord`): parked; the operator retries it later.
    Permanent,
}

/// `x` 1..=10 and `y` 1..=3; one relay. The broker fails the first hand-over of `x` 4 with
/// `failure`. Checks: `x` 5.. is never sent before an acknowledgement of 4 came back (so not in
/// the failing cycle), none of 5..=10 ever had an attempt counted (every claim of them shows
/// 0), 4's attempts as the failure says (retry: 1, transport: 0), `y` unaffected; a permanent
/// failure parks 4 and `x` 5.. stays unsent until the operator retries 4. In the end every
/// event once, in order.
pub async fn publisher_failure_mid_run_stops_the_run<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    runs: bool,
    failure: MidRunFailure,
) {
    let store = store_of(backend, mode).await;
    let mut all = events("x", 1..=10);
    all.extend(events("y", 1..=3));
    commit_events(backend, &store, &all).await;
    let four = all[3].event_id;
    let wire = Arc::new(Mutex::new(Wire::default()));
    let script: Script = Arc::new(move |e: &Envelope, n: u32| {
        if e.event_id == four && n == 1 {
            Verdict::Fail(match failure {
                MidRunFailure::Retry => {
                    PublishError::new(PublishErrorKind::Timeout, "injected: record timed out")
                        .with_scope(FailureScope::Record)
                }
                MidRunFailure::Transport => {
                    PublishError::new(PublishErrorKind::BrokerUnavailable, "injected: no broker")
                }
                MidRunFailure::Permanent => {
                    PublishError::new(PublishErrorKind::InvalidRecord, "injected: invalid")
                }
            })
        } else {
            Verdict::Ack
        }
    });
    let claims = Arc::new(Mutex::new(Claims::default()));
    let mut relay = run_relay(
        Watched {
            inner: store.clone(),
            claims: Arc::clone(&claims),
            strict: true,
            runs,
        },
        RunBroker::new("relay", &wire, script),
        "relay",
        20,
        false,
        false,
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut operator_retried = false;
    loop {
        let report = relay.run_once().await.expect("cycle");
        let (failed, sent_after) = {
            let w = wire.lock().expect("wire");
            let failed = w.attempts.get(&four).copied().unwrap_or(0) >= 1;
            let after = w.sends.iter().any(|s| s.1 == "x" && s.2 > 4);
            (failed, after)
        };
        if failed && failure == MidRunFailure::Permanent && !operator_retried {
            assert!(!sent_after, "{mode:?}: x 5.. sent while x 4 was parked");
            // A few idle cycles: nothing of x may go out while 4 is parked.
            if report.claimed == 0 {
                let parked = store.list_parked(10).await.expect("list");
                assert!(
                    parked.iter().any(|p| p.envelope.event_id == four),
                    "{mode:?}: x 4 not parked after a permanent failure"
                );
                assert_eq!(
                    status_of(backend, all[4].event_id).await,
                    Some(DeliveryStatus::Pending),
                    "{mode:?}: x 5 after a parked 4"
                );
                store.retry_parked(four, "operator").await.expect("retry 4");
                operator_retried = true;
            }
        }
        let done = acked_ids(&wire);
        if all.iter().all(|e| done.contains(&e.event_id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{mode:?} {failure:?}: not drained in 60 s"
        );
        if let Some(pause) = report.pause {
            tokio::time::sleep(pause).await;
        } else if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        }
    }
    relay.release_prefetched().await.expect("release");
    assert_prefix(backend, &all, "at the end").await;
    let w = wire.lock().expect("wire");
    check_wire(&w, &all, false);
    let c = claims.lock().expect("claims");
    assert!(c.violations.is_empty(), "{:#?}", c.violations);
    for (agg, v, attempts, _, _) in &c.records {
        if agg == "x" && *v > 4 {
            assert_eq!(
                *attempts, 0,
                "{mode:?} {failure:?}: x v{v} was never sent before it was published but has \
                 {attempts} attempts counted"
            );
        }
    }
    let fours: Vec<u32> = c
        .records
        .iter()
        .filter(|r| r.0 == "x" && r.1 == 4)
        .map(|r| r.2)
        .collect();
    let want_after = match failure {
        MidRunFailure::Retry => Some(1),
        MidRunFailure::Transport => Some(0),
        MidRunFailure::Permanent => None,
    };
    if let Some(want) = want_after {
        assert_eq!(
            fours.last().copied(),
            Some(want),
            "{mode:?} {failure:?}: x 4's attempts when claimed again ({fours:?})"
        );
    }
}

/// Emits this module's scenarios as named tests for a [`RandomizedBackend`] type with an
/// `async fn new(connections: u32) -> Option<Self>`, in a module per claim mode (`lease::…`,
/// `locked::…`); `runs` says whether the store hands out runs (`false`: heads only, as
/// MariaDB, which the contract allows). With `lease_only` the locked module is left out (the
/// in-memory store cannot end a crashed relay's locked claim).
///
/// ```text
/// outbox_testkit::run_adversary_tests!(common::backend::PgBackend, runs = true);
/// ```
#[macro_export]
macro_rules! run_adversary_tests {
    ($backend:ty, runs = $runs:expr) => {
        $crate::run_adversary_tests!($backend, runs = $runs, lease_only);
        mod locked {
            $crate::run_adversary_tests!(@all super::RunAdversaryBackend, $runs,
                ::outbox_core::ClaimMode::LockedTransaction,
                ::outbox_core::ClaimMode::LockedTransaction);
        }
    };
    ($backend:ty, runs = $runs:expr, lease_only) => {
        type RunAdversaryBackend = $backend;
        mod lease {
            $crate::run_adversary_tests!(@all super::RunAdversaryBackend, $runs,
                $crate::scenarios::run_adversary::lease(2.0),
                $crate::scenarios::run_adversary::lease(30.0));
        }
    };
    (@all $backend:ty, $runs:expr, $short:expr, $long:expr) => {
        $crate::run_adversary_tests!(@case $backend, expired_run_is_fenced_and_resumed, |b|
            $crate::scenarios::run_adversary::expired_run_is_fenced_and_resumed(&b, $short, $runs));
        $crate::run_adversary_tests!(@case $backend, version_committed_during_a_run_is_claimed_after_it, |b|
            $crate::scenarios::run_adversary::version_committed_during_a_run_is_claimed_after_it(&b, $long, $runs));
        $crate::run_adversary_tests!(@case $backend, lower_version_committed_after_the_run_is_parked, |b|
            $crate::scenarios::run_adversary::lower_version_committed_after_the_run_is_parked(&b, $long, $runs));
        $crate::run_adversary_tests!(@case $backend, operator_retries_a_parked_row_while_a_run_is_out, |b|
            $crate::scenarios::run_adversary::operator_acts_on_a_parked_row_while_a_run_is_out(&b, $long, $runs,
                $crate::scenarios::run_adversary::OperatorAction::Retry));
        $crate::run_adversary_tests!(@case $backend, operator_discards_a_parked_row_while_a_run_is_out, |b|
            $crate::scenarios::run_adversary::operator_acts_on_a_parked_row_while_a_run_is_out(&b, $long, $runs,
                $crate::scenarios::run_adversary::OperatorAction::Discard));
        $crate::run_adversary_tests!(@case $backend, completion_with_a_hole_is_refused, |b|
            $crate::scenarios::run_adversary::completion_with_a_hole_is_refused(&b, $long, $runs));
        $crate::run_adversary_tests!(@case $backend, completion_without_the_head_is_refused, |b|
            $crate::scenarios::run_adversary::completion_without_the_head_is_refused(&b, $long, $runs));
        $crate::run_adversary_tests!(@case $backend, two_relays_hammer_one_hot_aggregate, |b|
            $crate::scenarios::run_adversary::two_relays_hammer_one_hot_aggregate(&b, $long, $runs, false, false));
        $crate::run_adversary_tests!(@case $backend, two_relays_hammer_with_prefetch_and_early_claim, |b|
            $crate::scenarios::run_adversary::two_relays_hammer_one_hot_aggregate(&b, $long, $runs, true, true));
        $crate::run_adversary_tests!(@case $backend, slow_broker_runs_stop_inside_their_claim, |b|
            $crate::scenarios::run_adversary::slow_broker_runs_stop_inside_their_claim(&b, $long, $runs));
        $crate::run_adversary_tests!(@case $backend, crash_mid_run_resends_in_order, |b|
            $crate::scenarios::run_adversary::crash_mid_run_resends_in_order(&b, $short, $runs));
        $crate::run_adversary_tests!(@case $backend, record_retry_mid_run_stops_the_run, |b|
            $crate::scenarios::run_adversary::publisher_failure_mid_run_stops_the_run(&b, $long, $runs,
                $crate::scenarios::run_adversary::MidRunFailure::Retry));
        $crate::run_adversary_tests!(@case $backend, transport_failure_mid_run_stops_the_run, |b|
            $crate::scenarios::run_adversary::publisher_failure_mid_run_stops_the_run(&b, $long, $runs,
                $crate::scenarios::run_adversary::MidRunFailure::Transport));
        $crate::run_adversary_tests!(@case $backend, permanent_failure_mid_run_stops_the_run, |b|
            $crate::scenarios::run_adversary::publisher_failure_mid_run_stops_the_run(&b, $long, $runs,
                $crate::scenarios::run_adversary::MidRunFailure::Permanent));
    };
    (@case $backend:ty, $name:ident, |$b:ident| $body:expr) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some($b) = <$backend>::new(8).await else {
                return;
            };
            $body.await;
            $crate::randomized::RandomizedBackend::finish(&$b).await;
        }
    };
}
