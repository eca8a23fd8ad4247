//! Adversary scenarios of the relay's early claim ([`RelayConfig::early_claim`]) on a real
//! server, one body for every backend (run by `outbox-postgres/tests/adversary_early_claim.rs`
//! and `outbox-mysql/tests/adversary_early_claim.rs`, in both claim modes).
//!
//! With the early claim on, a batch that was not full has the next batch claimed while its
//! completion is written: the claim's statements run beside the completion's transaction, on
//! another connection of the same relay, under the same owner. Every scenario places a store
//! wrapper ([`Watched`]) between the relay and the store. It sees each claim and completion,
//! reports what a claim returned while a batch of the relay was still held (claimed, its
//! completion not yet returned), and can act at the one moment that matters: when a
//! completion runs beside an early claim, after that claim returned (fail the completion, hang
//! as a crash would, stop the relay, or take longer than the early claim's lease).
//!
//! What each scenario holds the store and the relay to:
//!
//! * [`early_claim_races_completions_and_keeps_order`]: two relays while producers commit;
//!   claims overlap completions (counted); no claim returns an event of a batch still held,
//!   every event is acknowledged once, versions in order, no cycle fails (no deadlock, no
//!   claim that blocks behind the relay's own completion).
//! * [`failed_completion_keeps_the_early_claim_and_order`]: the completion fails after the
//!   early claim was taken (before reaching the store, or after committing); the early claim
//!   holds no aggregate of the failed batch and is kept for the next cycle; nothing is parked,
//!   nothing lost, first deliveries in order.
//! * [`crash_between_the_early_claim_and_the_completion`]: the relay is dropped there; another
//!   relay publishes everything, the dead relay's early claim included, once its claims end.
//! * [`parked_head_beside_the_early_claim_blocks_its_aggregate`]: the completion beside the
//!   early claim parks a head (refused for good); its next version stays unpublished until an
//!   operator retries the head, then goes out after it.
//! * [`shutdown_releases_the_early_claim`]: stopping the driver while the completion is
//!   written releases the early claim at once (not at lease expiry).
//! * [`early_claim_whose_lease_ran_out_is_released_not_published`] (lease mode): a completion
//!   slower than the lease; another relay takes the expired aggregates; the early claim is
//!   released (fenced: the other relay's claim stays valid) and never published.
//!
//! With runs ([`RelayConfig::run`] above 1; [`early_claim_run_tests!`](crate::early_claim_run_tests)):
//!
//! * [`runs_beside_the_early_claim_keep_order`]: two relays with runs of 3 or 100
//!   (`run_yields` off or on) while one hot aggregate and 25 others commit; runs fail mid-way
//!   and are cut by the waves' budget; most completions wait until the claim started beside
//!   them returned. No claim hands out anything of an aggregate of a batch whose completion
//!   was not yet sent to the store (the run's unsent rest and later versions included); every
//!   event once, in order; no failed cycle; nothing left.
//! * [`run_beside_the_early_claim`]: a batch holding a run whose rest is released unsent (the
//!   budget ends, or a wave fails) or whose completion fails or loses its answer, beside the
//!   early claim: the early claim holds only the aggregates committed meanwhile, is kept after
//!   a failed completion, and everything goes out in order afterwards.
//!
//! Seen failing under (reverted) breaks: PostgreSQL's lease claim taking over a live lease
//! (every new lease-mode test on PostgreSQL), its locked claim ignoring the advisory locks of
//! other claims (every new locked-mode test on PostgreSQL), MySQL's claim ignoring live leases
//! (not-due rows, `leased` state; every new lease-mode test on MariaDB), its claim reading
//! without `FOR UPDATE SKIP LOCKED` (every new locked-mode test on MariaDB), and the relay
//! dropping the early claim when the completion fails (the failed and lost completions, both
//! stores).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport,
    Envelope, EventId, Outcome, PublishError, PublishErrorKind, PublishResult, Publisher, Relay,
    RelayConfig, RelayConfigBuilder, StoreError, StoreErrorKind,
};
use rand::{Rng, SeedableRng};

use super::{check_log, drive, event, params, prepared, retry_policy, seeded_relay, Log};
use crate::randomized::RandomizedBackend;

/// What a completion does when it runs beside an early claim (once; later completions and
/// completions with no claim beside them go straight to the store, after `jitter`).
#[derive(Clone, Debug)]
enum Plan {
    /// Nothing: the completion runs at once (after the jitter).
    Plain,
    /// Fails with a transient store error without reaching the store.
    Fail,
    /// Reaches the store (commits), then reports a transient store error (the answer lost).
    FailAfterCommit,
    /// Never returns (the relay is dropped there).
    Hang,
    /// Sleeps this long, then reaches the store.
    Slow(Duration),
}

/// What the wrapper saw.
#[derive(Default)]
struct Seen {
    /// Claims returned and not yet ended by their completion or release, by token.
    held: HashMap<uuid::Uuid, Vec<(EventId, String, i64)>>,
    /// Completions in progress, by relay (owner).
    completing: HashMap<String, usize>,
    /// Completions started so far, by relay.
    completions: HashMap<String, u64>,
    claims_started: u64,
    claims_done: u64,
    /// The number each returned claim got when it started (`claims_started` then), by token.
    claim_number: HashMap<uuid::Uuid, u64>,
    /// Claims that ran while a completion of their relay was in progress, and how many
    /// returned events.
    overlapped: usize,
    overlapped_with_events: usize,
    /// The plan was carried out (by the completion it names).
    acted: bool,
    /// The early claim the plan acted beside: its events.
    early: Vec<(EventId, String, i64)>,
    violations: Vec<String>,
    /// Claims released (by the relay: a lease too short to publish, a shutdown).
    releases: usize,
    /// Claims whose completion or release was sent to the store (it may have ended them), by
    /// token.
    ending: HashSet<uuid::Uuid>,
    /// Each held claim's owner and its records' run positions, by token.
    shapes: HashMap<uuid::Uuid, (String, Vec<u32>)>,
    /// Claims that handed out a run (a record with run position above 0).
    runs_seen: usize,
    /// Claims that returned events while a batch of their relay holding a run was still live
    /// (its completion not yet sent to the store).
    beside_run_with_events: usize,
    /// Completions that released records unsent (the rest of a run), and completions that
    /// retried an event of a run after its head (a wave that failed).
    released_rest: usize,
    failed_waves: usize,
    /// Completions that waited for a claim started beside them to return (`wait_beside`).
    waited: usize,
}

/// Shared between the wrappers of the relays of one scenario.
#[derive(Clone)]
struct Watch {
    seen: Arc<Mutex<Seen>>,
    rng: Arc<Mutex<rand::rngs::StdRng>>,
    plan: Plan,
    /// Also a violation: a claim returning an aggregate of a held batch (only where no held
    /// batch's completion can commit while a claim runs: the plan fails, hangs or delays it).
    strict: bool,
    jitter: Duration,
    /// Told once the plan acted (before a `Hang` hangs, before a `Slow` sleeps).
    acted_tx: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
    /// The first claim answers this much later (a loaded server's round trip).
    slow_first_claim: Option<Duration>,
    /// A claim returning what a held claim holds is a violation only if that claim's
    /// completion or release was not yet sent to the store (which may have ended it: a run's
    /// unsent rest, released by its completion, can be claimed again at once). Strict then
    /// holds even where completions commit while claims run.
    ending_aware: bool,
    /// Three completions in four (seeded coin) with a claim started beside it wait for that claim
    /// to return before reaching the store, so the claim runs while the batch is surely live.
    wait_beside: bool,
}

impl Watch {
    fn new(plan: Plan, strict: bool, jitter: Duration, seed: u64) -> Self {
        Self {
            seen: Arc::default(),
            rng: Arc::new(Mutex::new(rand::rngs::StdRng::seed_from_u64(seed))),
            plan,
            strict,
            jitter,
            acted_tx: Arc::default(),
            slow_first_claim: None,
            ending_aware: false,
            wait_beside: false,
        }
    }

    /// See [`Watch::ending_aware`] and [`Watch::wait_beside`].
    fn runs_aware(mut self) -> Self {
        self.ending_aware = true;
        self.wait_beside = true;
        self
    }

    /// See [`Watch::ending_aware`] alone: for a scenario whose later cycles complete while the
    /// next claim runs (and may return the next version once the completion committed).
    fn ending_aware(mut self) -> Self {
        self.ending_aware = true;
        self
    }

    /// The first claim answers `d` after the store did, as a loaded machine's round trip.
    fn slow_first_claim(mut self, d: Duration) -> Self {
        self.slow_first_claim = Some(d);
        self
    }

    /// A receiver told when the plan acts.
    fn on_act(&self) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        *self.acted_tx.lock().expect("watch") = Some(tx);
        rx
    }

    fn wrap<S>(&self, inner: S) -> Watched<S> {
        Watched {
            inner,
            watch: self.clone(),
        }
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().expect("watch")
    }

    fn assert_clean(&self) {
        let seen = self.seen();
        assert!(seen.violations.is_empty(), "{:#?}", seen.violations);
    }
}

/// A store between the relay and the real one; see the module docs.
#[derive(Clone)]
pub struct Watched<S> {
    inner: S,
    watch: Watch,
}

fn triple(batch: &ClaimedBatch) -> Vec<(EventId, String, i64)> {
    batch
        .records
        .iter()
        .map(|r| {
            (
                r.envelope.event_id,
                r.envelope.aggregate_id.clone(),
                r.envelope.aggregate_version,
            )
        })
        .collect()
}

#[async_trait]
impl<S: RelayStore> RelayStore for Watched<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let owner = request.owner.as_str();
        let (number, completions_before, completing_before) = {
            let mut seen = self.watch.seen();
            seen.claims_started += 1;
            (
                seen.claims_started,
                seen.completions.get(owner).copied().unwrap_or(0),
                seen.completing.get(owner).copied().unwrap_or(0),
            )
        };
        let result = self.inner.claim(request).await;
        if let (1, Some(d)) = (number, self.watch.slow_first_claim) {
            tokio::time::sleep(d).await;
        }
        let mut seen = self.watch.seen();
        seen.claims_done += 1;
        let batch = match result {
            Ok(b) => b,
            Err(e) => return Err(e),
        };
        seen.claim_number.insert(batch.handle.token, number);
        let got = triple(&batch);
        if completing_before > 0
            || seen.completing.get(owner).copied().unwrap_or(0) > 0
            || seen.completions.get(owner).copied().unwrap_or(0) > completions_before
        {
            seen.overlapped += 1;
            if !got.is_empty() {
                seen.overlapped_with_events += 1;
            }
        }
        let mut found = Vec::new();
        if batch.records.iter().any(|r| r.run_position > 0) {
            seen.runs_seen += 1;
        }
        let beside_run = seen.held.keys().any(|t| {
            !seen.ending.contains(t)
                && seen
                    .shapes
                    .get(t)
                    .is_some_and(|(o, pos)| o == owner && pos.iter().any(|p| *p > 0))
        });
        if beside_run && !got.is_empty() {
            seen.beside_run_with_events += 1;
        }
        for (id, agg, v) in &got {
            for (token, rows) in &seen.held {
                if self.watch.ending_aware && seen.ending.contains(token) {
                    continue;
                }
                for (hid, hagg, hv) in rows {
                    if hid == id {
                        found.push(format!(
                            "{agg} v{v} claimed again while claim {token} (its completion not \
                             returned) held it"
                        ));
                    } else if self.watch.strict && hagg == agg {
                        found.push(format!(
                            "{agg} v{v} claimed while claim {token} held v{hv} of it, unrecorded"
                        ));
                    }
                }
            }
        }
        seen.violations.extend(found);
        if !got.is_empty() {
            seen.held.insert(batch.handle.token, got);
            seen.shapes.insert(
                batch.handle.token,
                (
                    owner.to_owned(),
                    batch.records.iter().map(|r| r.run_position).collect(),
                ),
            );
        }
        Ok(batch)
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        // The early claim: a claim started after this batch's own. The relay polls it first,
        // so it is normally still under way here; but it can also have returned already (its
        // statements done before the completion's first poll, as seen on PostgreSQL in locked
        // mode), which is the same case for every plan: the plan acts once it has returned.
        let (beside, jitter, wait_for) = {
            let mut seen = self.watch.seen();
            if let Some((_, positions)) = seen.shapes.get(&claim.token) {
                let rows = seen.held.get(&claim.token).cloned().unwrap_or_default();
                let of_runs: HashSet<EventId> = rows
                    .iter()
                    .zip(positions)
                    .filter(|(_, p)| **p > 0)
                    .map(|(r, _)| r.0)
                    .collect();
                if outcomes.len() < rows.len() {
                    seen.released_rest += 1;
                }
                if outcomes
                    .iter()
                    .any(|o| matches!(o, Outcome::Retry { .. }) && of_runs.contains(&o.event_id()))
                {
                    seen.failed_waves += 1;
                }
            }
            *seen.completions.entry(claim.owner.clone()).or_default() += 1;
            *seen.completing.entry(claim.owner.clone()).or_default() += 1;
            let own = seen
                .claim_number
                .get(&claim.token)
                .copied()
                .unwrap_or(u64::MAX);
            let wait_for = (self.watch.wait_beside
                && seen.claims_started > own
                && self.watch.rng.lock().expect("rng").random_bool(0.75))
            .then_some(seen.claims_started);
            let beside = (seen.claims_started > own && !seen.acted).then_some(seen.claims_started);
            if beside.is_some() {
                seen.acted = true;
            }
            let max = self.watch.jitter.as_micros() as u64;
            let jitter = if max == 0 {
                Duration::ZERO
            } else {
                Duration::from_micros(self.watch.rng.lock().expect("rng").random_range(0..=max))
            };
            (beside, jitter, wait_for)
        };
        if let Some(started) = wait_for {
            // Bounded: a claim that never returns is not this wrapper's to wait for.
            let until = Instant::now() + Duration::from_secs(20);
            while self.watch.seen().claims_done < started && Instant::now() < until {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            self.watch.seen().waited += 1;
        }
        let plan = match beside {
            Some(started) if !matches!(self.watch.plan, Plan::Plain) => {
                // Act once the early claim has returned.
                while self.watch.seen().claims_done < started {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                {
                    let mut seen = self.watch.seen();
                    let early = seen
                        .held
                        .iter()
                        .filter(|(t, _)| **t != claim.token)
                        .flat_map(|(_, rows)| rows.clone())
                        .collect();
                    seen.early = early;
                }
                if let Some(tx) = self.watch.acted_tx.lock().expect("watch").take() {
                    let _ = tx.send(());
                }
                self.watch.plan.clone()
            }
            _ => Plan::Plain,
        };
        if !jitter.is_zero() {
            tokio::time::sleep(jitter).await;
        }
        let reach = || {
            self.watch.seen().ending.insert(claim.token);
        };
        let result = match plan {
            Plan::Plain => {
                reach();
                self.inner.complete(claim, outcomes).await
            }
            Plan::Fail => Err(StoreError::new(
                StoreErrorKind::Connection,
                "injected: the completion never reached the store",
            )),
            Plan::FailAfterCommit => {
                reach();
                let _ = self.inner.complete(claim, outcomes).await;
                Err(StoreError::new(
                    StoreErrorKind::Connection,
                    "injected: the completion's answer was lost",
                ))
            }
            Plan::Hang => std::future::pending().await,
            Plan::Slow(d) => {
                tokio::time::sleep(d).await;
                reach();
                self.inner.complete(claim, outcomes).await
            }
        };
        let mut seen = self.watch.seen();
        *seen.completing.entry(claim.owner.clone()).or_default() -= 1;
        seen.held.remove(&claim.token);
        seen.shapes.remove(&claim.token);
        seen.ending.remove(&claim.token);
        result
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.watch.seen().ending.insert(claim.token);
        let result = self.inner.release(claim).await;
        let mut seen = self.watch.seen();
        seen.held.remove(&claim.token);
        seen.shapes.remove(&claim.token);
        seen.ending.remove(&claim.token);
        seen.releases += 1;
        result
    }

    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }

    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

outbox_core::forward_store_roles!(Watched<S>.inner => maintenance);

/// A broker double (for the scenarios' signatures only) that acknowledges everything after `latency` and records it (overlaps of
/// one aggregate in flight at two relays included). While `gate` is set, its first call waits
/// for the gate to open (the scenario commits events then), and tells `entered` first.
#[derive(Clone)]
pub struct Broker {
    name: String,
    log: Arc<Mutex<Log>>,
    latency: Duration,
    gate: Arc<Mutex<Option<Gate>>>,
    /// Events refused once with a permanent error (the relay parks them), then acknowledged.
    refuse_once: Arc<Mutex<HashSet<EventId>>>,
    /// Events failed once with a record-scoped transient error (the relay retries them; a
    /// run stops there, its rest released unsent), then acknowledged.
    fail_once: Arc<Mutex<HashSet<EventId>>>,
}

struct Gate {
    entered: tokio::sync::oneshot::Sender<()>,
    open: tokio::sync::oneshot::Receiver<()>,
}

impl Broker {
    fn new(name: &str, log: &Arc<Mutex<Log>>, latency: Duration) -> Self {
        Self {
            name: name.to_owned(),
            log: Arc::clone(log),
            latency,
            gate: Arc::default(),
            refuse_once: Arc::default(),
            fail_once: Arc::default(),
        }
    }

    /// Gates the first call: returns (told when it is entered, opens it).
    fn gated(
        self,
    ) -> (
        Self,
        tokio::sync::oneshot::Receiver<()>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (entered, entered_rx) = tokio::sync::oneshot::channel();
        let (open_tx, open) = tokio::sync::oneshot::channel();
        *self.gate.lock().expect("gate") = Some(Gate { entered, open });
        (self, entered_rx, open_tx)
    }
}

#[async_trait]
impl Publisher for Broker {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let gate = self.gate.lock().expect("gate").take();
        if let Some(gate) = gate {
            let _ = gate.entered.send(());
            let _ = gate.open.await;
        }
        {
            let mut log = self.log.lock().expect("log");
            for e in batch {
                if let Some(other) = log
                    .in_flight
                    .insert(e.aggregate_id.clone(), self.name.clone())
                {
                    log.overlaps.push(format!(
                        "{} published by {} while {other} had it in flight",
                        e.aggregate_id, self.name
                    ));
                }
            }
        }
        tokio::time::sleep(self.latency).await;
        let mut refuse = self.refuse_once.lock().expect("refuse");
        let mut fail = self.fail_once.lock().expect("fail");
        let mut log = self.log.lock().expect("log");
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            log.in_flight.remove(&e.aggregate_id);
            *log.attempts.entry(e.event_id).or_default() += 1;
            if refuse.remove(&e.event_id) {
                out.push(Err(PublishError::new(
                    PublishErrorKind::RecordTooLarge,
                    "injected: refused once",
                )));
                continue;
            }
            if fail.remove(&e.event_id) {
                out.push(Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "injected: failed once, record-scoped",
                )
                .with_scope(outbox_core::FailureScope::Record)));
                continue;
            }
            log.acked.push((
                e.event_id,
                e.aggregate_id.clone(),
                e.aggregate_version,
                self.name.clone(),
            ));
            out.push(Ok(AckMetadata::kafka("orders", 0, log.acked.len() as i64)));
        }
        out
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// The configuration of an early-claim relay, to build (or to set more on first): the early
/// claim on (prefetch on, the default), batches of `batch_size`, idle pauses of 2 to 20 ms, the
/// smallest lease margin, retries after 5 to 20 ms (50 at the most).
pub fn early_claim_config(owner: impl Into<String>, batch_size: usize) -> RelayConfigBuilder {
    RelayConfig::builder()
        .owner(owner)
        .batch_size(batch_size)
        .early_claim(true)
        .idle(Duration::from_millis(2), Duration::from_millis(20))
        .lease_margin(outbox_core::MIN_LEASE_MARGIN)
        .retry(retry_policy(
            Duration::from_millis(5),
            Duration::from_millis(20),
            50,
        ))
}

/// A relay with the early claim on (prefetch on, the default), batches of 50.
fn early_relay<S: RelayStore, P: Publisher>(
    store: S,
    publisher: P,
    owner: &str,
    seed: u64,
) -> Relay<S, P> {
    let config = early_claim_config(owner, 50).build().expect("relay config");
    seeded_relay(store, publisher, config, seed)
}

/// Store parameters of the scenarios of one relay: `mode`, `locked_max_hold` 3 s (just above
/// what a prefetching relay needs with a 200 ms delivery timeout), the broker's timeout.
fn one_relay_params(mode: ClaimMode) -> crate::randomized::StoreParams {
    params(mode, Duration::from_secs(3), Duration::from_millis(200))
}

/// Nothing unpublished, in flight or parked in `store` (`what` leads the message).
async fn assert_nothing_left<S: OutboxStore>(store: &S, what: &str) {
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats.unpublished, stats.in_flight, stats.parked),
        (0, 0, 0),
        "{what}: {stats:?}"
    );
}

async fn append<B: RandomizedBackend>(backend: &B, store: &B::Store, events: &[Envelope]) {
    let mut tx = backend.begin().await.expect("begin");
    backend
        .append(store, &mut tx, events)
        .await
        .expect("append");
    backend.commit(tx).await.expect("commit");
}

/// Per aggregate, the versions in order of first acknowledgement; each event's acknowledgements.
fn first_deliveries(log: &Log) -> (HashMap<String, Vec<i64>>, HashMap<EventId, usize>) {
    let mut firsts: HashMap<String, Vec<i64>> = HashMap::new();
    let mut count: HashMap<EventId, usize> = HashMap::new();
    for (id, agg, v, _) in &log.acked {
        let n = count.entry(*id).or_default();
        *n += 1;
        if *n == 1 {
            firsts.entry(agg.clone()).or_default().push(*v);
        }
    }
    (firsts, count)
}

/// Every event of `expected` acknowledged, first deliveries of each aggregate in version order
/// without a gap; returns the events acknowledged more than once.
fn check_first_deliveries(log: &Log, expected: &[Envelope]) -> HashSet<EventId> {
    assert!(log.overlaps.is_empty(), "overlaps: {:?}", log.overlaps);
    let (firsts, count) = first_deliveries(log);
    for e in expected {
        assert!(
            count.contains_key(&e.event_id),
            "{} v{} never acknowledged",
            e.aggregate_id,
            e.aggregate_version
        );
    }
    for (agg, versions) in &firsts {
        let want: Vec<i64> = (1..=versions.len() as i64).collect();
        assert_eq!(versions, &want, "first deliveries of {agg}");
    }
    count
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(id, _)| id)
        .collect()
}

/// Waits (`within` at most) until `log` holds `n` acknowledgements, then stops the relays
/// driven by `tasks` and checks that none had a failed cycle; `what` leads the messages.
async fn published_then_stopped(
    log: &Arc<Mutex<Log>>,
    n: usize,
    within: Duration,
    stop: &AtomicBool,
    tasks: Vec<tokio::task::JoinHandle<(usize, usize)>>,
    what: &str,
) {
    let deadline = Instant::now() + within;
    while log.lock().expect("log").acked.len() < n {
        assert!(
            Instant::now() < deadline,
            "{what}: only {} of {n} published in time",
            log.lock().expect("log").acked.len(),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Release);
    for t in tasks {
        let (errors, _) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("relay stops")
            .expect("relay task");
        assert_eq!(errors, 0, "{what}: a cycle failed");
    }
}

/// Drives `relay` until `log` holds `n` acknowledgements (30 s at most).
async fn drain<S: RelayStore, P: Publisher>(
    relay: &mut Relay<S, P>,
    log: &Arc<Mutex<Log>>,
    n: usize,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().expect("log").acked.len() < n {
        assert!(Instant::now() < deadline, "not drained in time");
        match relay.run_once().await {
            Ok(r) if r.is_idle() => tokio::time::sleep(Duration::from_millis(20)).await,
            Ok(_) => {}
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Two relays with the early claim on, each over its own store instance, while two producers
/// commit 24 aggregates x 6 versions one event per transaction (so batches are rarely full and
/// the early claim finds what committed during a publication). Completions start after a
/// seeded jitter of up to 3 ms, so the early claim's statements fall before, inside and after
/// the completion's transaction. Checks: some claims overlapped a completion and returned
/// events; no claim returned an event of a batch still held; every event acknowledged once, in
/// version order per aggregate, no aggregate at two relays at once; no failed cycle.
pub async fn early_claim_races_completions_and_keeps_order<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(200));
    let store = prepared(backend, &p).await;
    let watch = Watch::new(Plan::Plain, false, Duration::from_millis(3), 25);
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for r in 0..2 {
        let name = format!("early-{r}");
        let relay = early_relay(
            watch.wrap(backend.store(&p)),
            Broker::new(&name, &log, Duration::from_millis(2)),
            &name,
            r,
        );
        tasks.push(tokio::spawn(drive(relay, Arc::clone(&stop))));
    }
    let (aggs, versions) = (24, 6);
    let mut all = Vec::new();
    for v in 1..=versions {
        for a in 0..aggs {
            let e = event(&format!("race-{a}"), v);
            append(backend, &store, std::slice::from_ref(&e)).await;
            all.push(e);
            if a % 4 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    published_then_stopped(
        &log,
        all.len(),
        Duration::from_secs(60),
        &stop,
        tasks,
        &format!("{mode:?}"),
    )
    .await;
    watch.assert_clean();
    {
        let seen = watch.seen();
        eprintln!(
            "{mode:?}: {} claims, {} beside a completion of their relay, {} of them with events",
            seen.claims_done, seen.overlapped, seen.overlapped_with_events
        );
        assert!(
            seen.overlapped_with_events > 0,
            "{mode:?}: no claim ran beside a completion and returned events (overlapped: {})",
            seen.overlapped
        );
    }
    check_log(&log.lock().expect("log"), &all);
    assert_nothing_left(&store, &format!("{mode:?}")).await;
}

/// Six aggregates' version 1 claimed by one relay; while the broker holds them, version 2 of
/// each and version 1 of three new aggregates commit; returns (relay's first batch, the new
/// versions 2, the new aggregates' events).
fn gated_backlog() -> (Vec<Envelope>, Vec<Envelope>, Vec<Envelope>) {
    let first: Vec<Envelope> = (0..6).map(|a| event(&format!("f{a}"), 1)).collect();
    let seconds: Vec<Envelope> = (0..6).map(|a| event(&format!("f{a}"), 2)).collect();
    let fresh: Vec<Envelope> = (0..3).map(|a| event(&format!("g{a}"), 1)).collect();
    (first, seconds, fresh)
}

/// How long the gated scenarios retry their first cycle until one reaches the broker.
const FIRST_CYCLE_DEADLINE: Duration = Duration::from_secs(60);

/// The first cycle of the gated scenarios: the relay claims `first`, its broker call waits
/// while `later` commits, then the cycle goes on (with the watch's plan beside its completion).
///
/// A cycle can end before it reaches the broker, and waiting for the broker then would wait
/// forever (the gate's sender lives in the relay): a claim that failed, or a claim slower
/// than its lease leaves room for (a 1.5 s lease less the delivery timeout and the 1 s
/// margin leaves 300 ms, which a loaded machine's claim round trip exceeds), which the relay
/// releases unpublished, as it must. Such a cycle is run again, the released events being
/// claimable at once, until one reaches the broker ([`FIRST_CYCLE_DEADLINE`], then a failure
/// that names every early end); any other early end (nothing claimed) fails at once.
async fn gated_cycle<B, S, P>(
    backend: &B,
    store: &B::Store,
    relay: &mut Relay<S, P>,
    entered: tokio::sync::oneshot::Receiver<()>,
    open: tokio::sync::oneshot::Sender<()>,
    later: &[Envelope],
) -> Result<outbox_core::CycleReport, StoreError>
where
    B: RandomizedBackend,
    S: RelayStore,
    P: Publisher,
{
    let started = Instant::now();
    let mut entered = entered;
    let mut early_ends: Vec<String> = Vec::new();
    loop {
        let cycle = relay.run_once();
        tokio::pin!(cycle);
        tokio::select! {
            gate = &mut entered => {
                gate.expect("the broker was called");
                append(backend, store, later).await;
                let _ = open.send(());
                return cycle.await;
            }
            ended = &mut cycle => {
                let retry = match &ended {
                    Ok(r) => r.released && r.claimed > 0,
                    Err(_) => true,
                };
                early_ends.push(format!("{:?}: {ended:?}", started.elapsed()));
                assert!(
                    retry,
                    "the first cycle ended before reaching the broker: {early_ends:#?}"
                );
                assert!(
                    started.elapsed() < FIRST_CYCLE_DEADLINE,
                    "no first cycle reached the broker within {FIRST_CYCLE_DEADLINE:?} (each \
                     claim too slow for its lease, or failing): {early_ends:#?}"
                );
                eprintln!(
                    "the first cycle ended before reaching the broker ({ended:?}); running it \
                     again"
                );
            }
        }
    }
}

/// The names of the aggregates of a set of (event, aggregate, version) rows.
fn aggregates(rows: &[(EventId, String, i64)]) -> Vec<String> {
    let mut a: Vec<String> = rows.iter().map(|r| r.1.clone()).collect();
    a.sort();
    a
}

/// The completion of the batch in flight fails after the early claim was taken:
/// `committed == false`, before reaching the store (its rows stay claimed until the lease
/// expires or the server ends the locked claim); `true`, after committing (the answer lost).
/// Checks: the cycle reports the store error; the early claim holds the three new aggregates
/// and none of the batch's (whose versions 2 committed meanwhile), and the relay keeps it for
/// its next cycle; then everything is published, first deliveries in version order, only the
/// failed batch's events twice (and none when the completion committed), nothing parked.
/// `mode`'s lease should be short (1.5 s). In lease mode the relay's first claim answers too
/// late to be published (as a loaded machine's claim round trip can): the relay releases it
/// and the first cycle runs again ([`gated_cycle`]).
pub async fn failed_completion_keeps_the_early_claim_and_order<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    committed: bool,
) {
    let p = one_relay_params(mode);
    let store = prepared(backend, &p).await;
    let (first, seconds, fresh) = gated_backlog();
    append(backend, &store, &first).await;
    let plan = if committed {
        Plan::FailAfterCommit
    } else {
        Plan::Fail
    };
    let watch = Watch::new(plan, true, Duration::ZERO, 1);
    let lease_mode = matches!(mode, ClaimMode::Lease { .. });
    let watch = match mode {
        // Later than the lease's room for a publication (delivery timeout and margin).
        ClaimMode::Lease { duration } => watch.slow_first_claim(
            duration.saturating_sub(Duration::from_millis(200) + outbox_core::MIN_LEASE_MARGIN)
                + Duration::from_millis(200),
        ),
        _ => watch,
    };
    let log = Arc::new(Mutex::new(Log::default()));
    let (broker, entered, open) = Broker::new("r", &log, Duration::from_millis(1)).gated();
    let mut relay = early_relay(watch.wrap(backend.store(&p)), broker, "failing", 3);
    let later: Vec<Envelope> = seconds.iter().chain(&fresh).cloned().collect();
    let first_cycle = gated_cycle(backend, &store, &mut relay, entered, open, &later).await;
    if lease_mode {
        assert!(
            watch.seen().releases >= 1,
            "{mode:?}: the slow first claim was published, not released"
        );
    }
    assert!(
        first_cycle.is_err(),
        "{mode:?}: the failed completion is reported: {first_cycle:?}"
    );
    assert!(
        watch.seen().acted,
        "{mode:?}: no early claim beside the completion"
    );
    watch.assert_clean();
    let early = aggregates(&watch.seen().early);
    assert_eq!(early, vec!["g0", "g1", "g2"], "{mode:?}: the early claim");
    let kept = relay
        .prefetched()
        .map(|b| {
            let mut a: Vec<String> = b
                .records
                .iter()
                .map(|r| r.envelope.aggregate_id.clone())
                .collect();
            a.sort();
            a
        })
        .unwrap_or_default();
    assert_eq!(
        kept, early,
        "{mode:?}: the relay keeps the early claim after the failed completion"
    );
    let all: Vec<Envelope> = first.iter().chain(&later).cloned().collect();
    drain(&mut relay, &log, all.len() + if committed { 0 } else { 6 }).await;
    watch.assert_clean();
    let twice = check_first_deliveries(&log.lock().expect("log"), &all);
    let failed: HashSet<EventId> = first.iter().map(|e| e.event_id).collect();
    assert!(
        twice.is_subset(&failed),
        "{mode:?}: only the failed batch goes out twice"
    );
    if committed {
        assert!(twice.is_empty(), "{mode:?}: the completion had committed");
    }
    let _ = relay.release_prefetched().await;
    assert_nothing_left(&store, &format!("{mode:?}")).await;
}

/// The relay is dropped after its early claim returned and before its completion reached the
/// store (a crash there). Another relay, over another store instance, publishes everything:
/// the dead relay's batch again once its claim ends (lease expiry, or the server ending the
/// locked transaction), its early claim's events, and the versions 2 after the versions 1.
/// Checks: the early claim held none of the batch's aggregates; every event published, first
/// deliveries in version order, only the dead relay's batch twice; nothing parked or left.
/// `mode`'s lease should be short (1.5 s).
pub async fn crash_between_the_early_claim_and_the_completion<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let p = one_relay_params(mode);
    let store = prepared(backend, &p).await;
    let (first, seconds, fresh) = gated_backlog();
    append(backend, &store, &first).await;
    let watch = Watch::new(Plan::Hang, true, Duration::ZERO, 2);
    let mut acted = watch.on_act();
    let log = Arc::new(Mutex::new(Log::default()));
    let (broker, entered, open) = Broker::new("doomed", &log, Duration::from_millis(1)).gated();
    let mut doomed = early_relay(watch.wrap(backend.store(&p)), broker, "doomed", 4);
    let later: Vec<Envelope> = seconds.iter().chain(&fresh).cloned().collect();
    {
        let cycle = gated_cycle(backend, &store, &mut doomed, entered, open, &later);
        tokio::select! {
            r = cycle => panic!("{mode:?}: the cycle returned: {r:?}"),
            _ = &mut acted => {}
        }
    }
    // The crash: the cycle was dropped mid-completion; now the relay and its store go.
    drop(doomed);
    watch.assert_clean();
    let early = aggregates(&watch.seen().early);
    assert_eq!(early, vec!["g0", "g1", "g2"], "{mode:?}: the early claim");

    let survivor_watch = Watch::new(Plan::Plain, false, Duration::ZERO, 5);
    let mut survivor = early_relay(
        survivor_watch.wrap(backend.store(&p)),
        Broker::new("survivor", &log, Duration::from_millis(1)),
        "survivor",
        6,
    );
    let all: Vec<Envelope> = first.iter().chain(&later).cloned().collect();
    drain(&mut survivor, &log, all.len() + first.len()).await;
    survivor_watch.assert_clean();
    let twice = check_first_deliveries(&log.lock().expect("log"), &all);
    let dead: HashSet<EventId> = first.iter().map(|e| e.event_id).collect();
    assert_eq!(
        twice, dead,
        "{mode:?}: the dead relay's batch went out twice"
    );
    let by_survivor: HashSet<EventId> = log
        .lock()
        .expect("log")
        .acked
        .iter()
        .filter(|a| a.3 == "survivor")
        .map(|a| a.0)
        .collect();
    for e in &fresh {
        assert!(
            by_survivor.contains(&e.event_id),
            "{mode:?}: the dead relay's early claim was published by the survivor"
        );
    }
    let _ = survivor.release_prefetched().await;
    assert_nothing_left(&store, &format!("{mode:?}")).await;
}

/// The driver future of [`shutdown_releases_the_early_claim`]: runs a relay until the stop
/// future completes, then returns (e.g. `outbox_core::driver::run(relay, None, stop)`).
pub type StopFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Stopping the relay while the completion is written, with an early claim outstanding: the
/// driver (`drive`, given a relay and the stop future) finishes the cycle and releases the
/// early claim at once. `mode`'s lease should be long (30 s), so only a release explains
/// claimable events. Checks: the batch in flight is published and recorded; right after the
/// driver returns, another owner's claim gets the early claim's three aggregates.
pub async fn shutdown_releases_the_early_claim<B, D, F>(backend: &B, mode: ClaimMode, run: D)
where
    B: RandomizedBackend,
    D: FnOnce(Relay<Watched<B::Store>, Broker>, StopFuture) -> F,
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let p = one_relay_params(mode);
    let store = prepared(backend, &p).await;
    let (first, _, fresh) = gated_backlog();
    append(backend, &store, &first).await;
    let watch = Watch::new(
        Plan::Slow(Duration::from_millis(50)),
        true,
        Duration::ZERO,
        7,
    );
    let acted = watch.on_act();
    let log = Arc::new(Mutex::new(Log::default()));
    let (broker, entered, open) = Broker::new("stopping", &log, Duration::from_millis(1)).gated();
    // The relay's store instance outlives the driver, as in a service that goes on running
    // (a locked claim would otherwise end with the instance's connections).
    let relay_store = backend.store(&p);
    let kept = relay_store.clone();
    let relay = early_relay(watch.wrap(relay_store), broker, "stopping", 8);
    let stop: StopFuture = Box::pin(async move {
        let _ = acted.await;
    });
    let task = tokio::spawn(run(relay, stop));
    entered.await.expect("the broker was called");
    append(backend, &store, &fresh).await;
    let _ = open.send(());
    tokio::time::timeout(Duration::from_secs(20), task)
        .await
        .expect("the driver stops")
        .expect("driver task");
    watch.assert_clean();
    assert_eq!(
        aggregates(&watch.seen().early),
        vec!["g0", "g1", "g2"],
        "{mode:?}: the early claim"
    );
    assert_eq!(
        log.lock().expect("log").acked.len(),
        first.len(),
        "{mode:?}: the batch in flight was published, the early claim not"
    );
    let other = store
        .claim(&ClaimRequest::new("after-shutdown", 50))
        .await
        .expect("claim");
    let mut got: Vec<String> = other
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.clone())
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec!["g0", "g1", "g2"],
        "{mode:?}: the early claim was released when the driver stopped"
    );
    store.release(&other.handle).await.expect("release");
    drop(kept);
}

/// Lease mode (`lease` short, 1.5 s): the completion of the batch in flight waits longer than
/// the lease after the early claim was taken (so both claims' leases run out); meanwhile
/// another relay claims the expired aggregates, the batch's and the early claim's. Checks: the
/// late completion is refused (superseded, nothing recorded); the first relay's next cycle
/// releases its early claim without publishing it; that release does not end the other
/// relay's claim (its completion applies in full); the early claim's events are never
/// published by the first relay.
pub async fn early_claim_whose_lease_ran_out_is_released_not_published<B: RandomizedBackend>(
    backend: &B,
    lease: ClaimMode,
) {
    let ClaimMode::Lease { duration } = lease else {
        panic!("lease mode only");
    };
    let p = one_relay_params(lease);
    let store = prepared(backend, &p).await;
    let (first, _, fresh) = gated_backlog();
    append(backend, &store, &first).await;
    let watch = Watch::new(
        Plan::Slow(duration + Duration::from_millis(400)),
        true,
        Duration::ZERO,
        9,
    );
    let acted = watch.on_act();
    let log = Arc::new(Mutex::new(Log::default()));
    let (broker, entered, open) = Broker::new("slow", &log, Duration::from_millis(1)).gated();
    let mut slow = early_relay(watch.wrap(backend.store(&p)), broker, "slow", 10);
    let other_store = backend.store(&p);
    let other_claim = async {
        let _ = acted.await;
        // Past the early claim's lease, before the slow completion reaches the store.
        tokio::time::sleep(duration + Duration::from_millis(150)).await;
        other_store
            .claim(&ClaimRequest::new("other", 50))
            .await
            .expect("claim")
    };
    let (first_cycle, taken) = tokio::join!(
        gated_cycle(backend, &store, &mut slow, entered, open, &fresh),
        other_claim
    );
    let first_cycle = first_cycle.expect("first cycle");
    watch.assert_clean();
    assert_eq!(aggregates(&watch.seen().early), vec!["g0", "g1", "g2"]);
    assert_eq!(
        (first_cycle.published, first_cycle.superseded),
        (0, first.len()),
        "the late completion is refused: {first_cycle:?}"
    );
    let mut got: Vec<String> = taken
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.clone())
        .collect();
    got.sort();
    let mut want: Vec<String> = first
        .iter()
        .chain(&fresh)
        .map(|e| e.aggregate_id.clone())
        .collect();
    want.sort();
    assert_eq!(got, want, "the expired aggregates go to the other relay");
    assert!(slow.prefetched().is_some(), "the early claim is still held");
    let next = slow.run_once().await.expect("next cycle");
    assert!(
        next.released && next.published == 0,
        "an early claim whose lease ran out is released, not published: {next:?}"
    );
    let outcomes: Vec<Outcome> = taken
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| Outcome::Published {
            event_id: r.envelope.event_id,
            ack: AckMetadata::kafka("orders", 0, 100 + i as i64),
        })
        .collect();
    let done = other_store
        .complete(&taken.handle, &outcomes)
        .await
        .expect("complete");
    assert_eq!(
        (done.applied, done.superseded),
        (outcomes.len(), 0),
        "the stale release ended the other relay's claim"
    );
    let acked: Vec<EventId> = log.lock().expect("log").acked.iter().map(|a| a.0).collect();
    for e in &fresh {
        assert!(
            !acked.contains(&e.event_id),
            "the expired early claim was published"
        );
    }
    assert_nothing_left(&store, "").await;
}

/// The batch in flight has one event refused for good (`f0` version 1, parked by its
/// completion) while the early claim runs beside that completion; versions 2 of the batch's
/// aggregates and three new aggregates committed during the publication. Then an operator
/// retries the parked event. Checks: the early claim holds only the new aggregates; `f0`
/// version 2 stays unpublished while version 1 is parked (the other aggregates drain); after
/// the retry, `f0` goes out 1 then 2; nothing else parked, nothing left.
pub async fn parked_head_beside_the_early_claim_blocks_its_aggregate<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let p = one_relay_params(mode);
    let store = prepared(backend, &p).await;
    let (first, seconds, fresh) = gated_backlog();
    append(backend, &store, &first).await;
    // The completion reaches the store only after the early claim returned.
    let watch = Watch::new(
        Plan::Slow(Duration::from_millis(30)),
        true,
        Duration::ZERO,
        11,
    );
    let log = Arc::new(Mutex::new(Log::default()));
    let broker = Broker::new("parking", &log, Duration::from_millis(1));
    broker
        .refuse_once
        .lock()
        .expect("refuse")
        .insert(first[0].event_id);
    let (broker, entered, open) = broker.gated();
    let mut relay = early_relay(watch.wrap(backend.store(&p)), broker, "parking", 12);
    let later: Vec<Envelope> = seconds.iter().chain(&fresh).cloned().collect();
    let first_cycle = gated_cycle(backend, &store, &mut relay, entered, open, &later)
        .await
        .expect("first cycle");
    assert_eq!(
        (first_cycle.published, first_cycle.parked),
        (5, 1),
        "{mode:?}: {first_cycle:?}"
    );
    watch.assert_clean();
    assert_eq!(
        aggregates(&watch.seen().early),
        vec!["g0", "g1", "g2"],
        "{mode:?}: the early claim"
    );
    let all: Vec<Envelope> = first.iter().chain(&later).cloned().collect();
    // Everything but f0's two versions.
    drain(&mut relay, &log, all.len() - 2).await;
    for _ in 0..5 {
        let r = relay.run_once().await.expect("cycle");
        assert_eq!(
            r.published, 0,
            "{mode:?}: f0 v2 went out behind its parked v1"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        (stats.parked, stats.unpublished),
        (1, 1),
        "{mode:?}: {stats:?}"
    );
    store
        .retry_parked(first[0].event_id, "early-claim-test")
        .await
        .expect("operator retry");
    drain(&mut relay, &log, all.len()).await;
    watch.assert_clean();
    let twice = check_first_deliveries(&log.lock().expect("log"), &all);
    assert!(twice.is_empty(), "{mode:?}: nothing twice");
    let _ = relay.release_prefetched().await;
    assert_nothing_left(&store, &format!("{mode:?}")).await;
}

/// How long one scenario of [`early_claim_tests!`](crate::early_claim_tests) may run: several
/// times what the slowest takes on a loaded machine, so that a hang fails the test with the
/// state of its store instead of holding CI until its own limit.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(240);

/// A lease claim mode of `secs` seconds (the scenarios' lease lengths).
pub fn lease(secs: f64) -> ClaimMode {
    ClaimMode::lease(Duration::from_secs_f64(secs)).expect("a positive lease")
}

/// Emits this module's scenarios as named tests, each in both claim modes where it applies,
/// for a [`RandomizedBackend`] type with an `async fn new(connections: u32) -> Option<Self>`
/// (`None` skips explicitly, as the backend's constructor says). Every test gets a backend of
/// its own (its own schema or database) and finishes it.
///
/// ```text
/// outbox_testkit::early_claim_tests!(common::backend::PgBackend);
/// ```
#[macro_export]
macro_rules! early_claim_tests {
    ($backend:ty) => {
        $crate::early_claim_tests!(@case $backend, early_claims_race_completions_lease, 12, |b|
            $crate::scenarios::early_claim::early_claim_races_completions_and_keeps_order(
                &b, $crate::scenarios::early_claim::lease(30.0)));
        $crate::early_claim_tests!(@case $backend, early_claims_race_completions_locked, 12, |b|
            $crate::scenarios::early_claim::early_claim_races_completions_and_keeps_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction));
        $crate::early_claim_tests!(@case $backend, failed_completion_after_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::failed_completion_keeps_the_early_claim_and_order(
                &b, $crate::scenarios::early_claim::lease(1.5), false));
        $crate::early_claim_tests!(@case $backend, failed_completion_after_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::failed_completion_keeps_the_early_claim_and_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction, false));
        $crate::early_claim_tests!(@case $backend, lost_completion_answer_after_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::failed_completion_keeps_the_early_claim_and_order(
                &b, $crate::scenarios::early_claim::lease(1.5), true));
        $crate::early_claim_tests!(@case $backend, lost_completion_answer_after_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::failed_completion_keeps_the_early_claim_and_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction, true));
        $crate::early_claim_tests!(@case $backend, crash_between_the_early_claim_and_the_completion_lease, 8, |b|
            $crate::scenarios::early_claim::crash_between_the_early_claim_and_the_completion(
                &b, $crate::scenarios::early_claim::lease(1.5)));
        $crate::early_claim_tests!(@case $backend, crash_between_the_early_claim_and_the_completion_locked, 8, |b|
            $crate::scenarios::early_claim::crash_between_the_early_claim_and_the_completion(
                &b, ::outbox_core::ClaimMode::LockedTransaction));
        $crate::early_claim_tests!(@case $backend, shutdown_releases_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::shutdown_releases_the_early_claim(
                &b, $crate::scenarios::early_claim::lease(30.0),
                |relay, stop| ::outbox_core::driver::run(relay, None, stop)));
        $crate::early_claim_tests!(@case $backend, shutdown_releases_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::shutdown_releases_the_early_claim(
                &b, ::outbox_core::ClaimMode::LockedTransaction,
                |relay, stop| ::outbox_core::driver::run(relay, None, stop)));
        $crate::early_claim_tests!(@case $backend, early_claim_whose_lease_ran_out_is_released_not_published, 8, |b|
            $crate::scenarios::early_claim::early_claim_whose_lease_ran_out_is_released_not_published(
                &b, $crate::scenarios::early_claim::lease(1.5)));
        $crate::early_claim_tests!(@case $backend, parked_head_beside_the_early_claim_blocks_its_aggregate_lease, 8, |b|
            $crate::scenarios::early_claim::parked_head_beside_the_early_claim_blocks_its_aggregate(
                &b, $crate::scenarios::early_claim::lease(30.0)));
        $crate::early_claim_tests!(@case $backend, parked_head_beside_the_early_claim_blocks_its_aggregate_locked, 8, |b|
            $crate::scenarios::early_claim::parked_head_beside_the_early_claim_blocks_its_aggregate(
                &b, ::outbox_core::ClaimMode::LockedTransaction));
    };
    (@case $backend:ty, $name:ident, $connections:expr, |$b:ident| $body:expr) => {
        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some($b) = <$backend>::new($connections).await else {
                return;
            };
            let limit = $crate::scenarios::early_claim::SCENARIO_LIMIT;
            if ::tokio::time::timeout(limit, $body).await.is_err() {
                panic!(
                    "{} did not finish within {limit:?} (a hang, which none of its checks \
                     explains); {} kept, its first rows still pending or parked: {:#?}",
                    stringify!($name),
                    $crate::randomized::RandomizedBackend::location(&$b),
                    $crate::randomized::RandomizedBackend::stuck(&$b).await
                );
            }
            $crate::randomized::RandomizedBackend::finish(&$b).await;
        }
    };
}

/// Two relays with the early claim and runs of `run` (`run_yields` as given), while producers
/// commit one hot aggregate (150 versions, three per transaction, so claims find runs) and
/// 25 others (eight versions each, one per transaction, four between two of its commits). The broker
/// fails the first hand-over of every hot version `v % 5 == 2` (record-scoped, transient: a
/// run stops there, its rest released unsent by the completion) and the waves' budget ends
/// other runs early. Three completions in four with a claim started beside them wait for that
/// claim to return before reaching the store, so early claims run while a run is surely in
/// flight (its claim live). Checks: no claim returns an event, or any version of an aggregate,
/// of a batch whose completion was not yet sent to the store (the run's unsent versions and
/// the versions committed meanwhile included); every event acknowledged once, in version
/// order per aggregate, no aggregate at two relays at once; no failed cycle; nothing parked
/// or left. With `runs` (the store hands out runs): runs were handed out, claims returned
/// events beside a live run of their relay, and runs were cut (rest released unsent) and
/// failed mid-run.
pub async fn runs_beside_the_early_claim_keep_order<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    run: usize,
    yields: bool,
    runs: bool,
) {
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(200));
    let store = prepared(backend, &p).await;
    let watch =
        Watch::new(Plan::Plain, true, Duration::from_millis(2), 31 + run as u64).runs_aware();
    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let hot: Vec<Envelope> = (1..=150).map(|v| event("hot", v)).collect();
    let fail: HashSet<EventId> = hot
        .iter()
        .filter(|e| e.aggregate_version % 5 == 2)
        .map(|e| e.event_id)
        .collect();
    let mut tasks = Vec::new();
    for r in 0..2u64 {
        let name = format!("runner-{r}");
        let broker = Broker::new(&name, &log, Duration::from_millis(1));
        // Shared: whichever relay sends such a version first has it fail.
        let broker = Broker {
            fail_once: Arc::new(Mutex::new(fail.clone())),
            ..broker
        };
        let config = early_claim_config(&name, 50)
            .run(run)
            .run_yields(yields)
            .build()
            .expect("relay config");
        let relay = seeded_relay(watch.wrap(backend.store(&p)), broker, config, 40 + r);
        tasks.push(tokio::spawn(drive(relay, Arc::clone(&stop))));
    }
    let cold: Vec<Envelope> = (1..=8)
        .flat_map(|v| (0..25).map(move |a| event(&format!("cold-{a}"), v)))
        .collect();
    let mut all = Vec::new();
    let mut cold_left = cold.chunks(4);
    for chunk in hot.chunks(3) {
        append(backend, &store, chunk).await;
        all.extend_from_slice(chunk);
        for e in cold_left.next().unwrap_or_default() {
            append(backend, &store, std::slice::from_ref(e)).await;
            all.push(e.clone());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    published_then_stopped(
        &log,
        all.len(),
        Duration::from_secs(120),
        &stop,
        tasks,
        &format!("{mode:?} run {run} yields {yields}"),
    )
    .await;
    watch.assert_clean();
    {
        let seen = watch.seen();
        eprintln!(
            "{mode:?} run {run} yields {yields}: {} claims, {} with runs, {} with events beside a \
             live run of their relay, {} completions releasing a run's rest, {} retrying a run's \
             later event, {} waited for the claim beside them",
            seen.claims_done,
            seen.runs_seen,
            seen.beside_run_with_events,
            seen.released_rest,
            seen.failed_waves,
            seen.waited
        );
        assert!(
            seen.waited > 0,
            "{mode:?}: no claim ran beside a completion"
        );
        if runs {
            assert!(seen.runs_seen > 0, "{mode:?}: no run handed out");
            assert!(
                seen.beside_run_with_events > 0,
                "{mode:?} run {run} yields {yields}: no claim returned events beside a live run"
            );
            assert!(
                seen.released_rest > 0 && seen.failed_waves > 0,
                "{mode:?} run {run} yields {yields}: no run cut ({}) or failed mid-run ({})",
                seen.released_rest,
                seen.failed_waves
            );
        }
    }
    check_log(&log.lock().expect("log"), &all);
    assert_nothing_left(&store, &format!("{mode:?}")).await;
}

/// What happens to the run of the first batch of [`run_beside_the_early_claim`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunCut {
    /// The waves' budget (1 ms) ends before the run's second event: its rest is released
    /// unsent by the completion, written after the early claim returned.
    Budget,
    /// The run's second event fails (record-scoped, transient): it is retried, the third
    /// released unsent, by the completion written after the early claim returned.
    FailedWave,
    /// The whole run is acknowledged, then the completion fails without reaching the store
    /// after the early claim returned (`mode`'s lease should be short, 1.5 s).
    CompletionFails,
    /// The whole run is acknowledged, the completion commits after the early claim returned,
    /// and its answer is lost.
    AnswerLost,
}

/// One relay (runs of 3) claims `h` 1..=3 (a run, with runs) and `f1`..`f3` version 1; while
/// its broker holds them, `h` 4 and 5, `f1`..`f3` version 2 and three new aggregates commit;
/// then the run is cut or its completion fails as `cut` says, the completion reaching the
/// store (if at all) only after the early claim returned. Checks: the early claim holds the
/// three new aggregates only (nothing of `h`: not its unsent or failed versions, not 4 or 5;
/// nothing of `f1`..`f3`); the first cycle reports what `cut` says; after it the relay keeps
/// the early claim (failed completion), then publishes everything: first deliveries in
/// version order, only a batch whose completion never reached the store twice; nothing parked,
/// nothing left.
pub async fn run_beside_the_early_claim<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    cut: RunCut,
    runs: bool,
) {
    let p = one_relay_params(mode);
    let store = prepared(backend, &p).await;
    let first: Vec<Envelope> = (1..=3)
        .map(|v| event("h", v))
        .chain((1..=3).map(|a| event(&format!("f{a}"), 1)))
        .collect();
    let later: Vec<Envelope> = (4..=5)
        .map(|v| event("h", v))
        .chain((1..=3).map(|a| event(&format!("f{a}"), 2)))
        .chain((0..3).map(|a| event(&format!("g{a}"), 1)))
        .collect();
    append(backend, &store, &first).await;
    let plan = match cut {
        RunCut::Budget | RunCut::FailedWave => Plan::Slow(Duration::from_millis(30)),
        RunCut::CompletionFails => Plan::Fail,
        RunCut::AnswerLost => Plan::FailAfterCommit,
    };
    // Ending-aware: after the gated first cycle the relay drains `h` 4 and 5 and the `f`
    // versions 2 with early claims beside completions; on MariaDB in locked mode such a claim
    // waits for the completion's locks and returns `h` 5 once `h` 4's completion committed,
    // before this wrapper hears that it returned (seen once in 9 runs of the binary). The
    // first cycle's early claim returns before its completion is sent, so it is judged
    // strictly whatever this says.
    let watch = Watch::new(plan, true, Duration::ZERO, 13).ending_aware();
    let log = Arc::new(Mutex::new(Log::default()));
    let broker = Broker::new("runner", &log, Duration::from_millis(1));
    if cut == RunCut::FailedWave {
        broker
            .fail_once
            .lock()
            .expect("fail")
            .insert(first[1].event_id);
    }
    let (broker, entered, open) = broker.gated();
    let budget = if cut == RunCut::Budget {
        Duration::from_millis(1)
    } else {
        Duration::from_secs(10)
    };
    let config = early_claim_config("runner", 50)
        .run(3)
        .run_budget(budget)
        .build()
        .expect("relay config");
    let mut relay = seeded_relay(watch.wrap(backend.store(&p)), broker, config, 14);
    let first_cycle = gated_cycle(backend, &store, &mut relay, entered, open, &later).await;
    assert!(
        watch.seen().acted,
        "{mode:?} {cut:?}: no early claim beside the completion"
    );
    watch.assert_clean();
    assert_eq!(
        aggregates(&watch.seen().early),
        vec!["g0", "g1", "g2"],
        "{mode:?} {cut:?}: the early claim"
    );
    if runs {
        assert!(
            watch.seen().runs_seen > 0,
            "{mode:?} {cut:?}: no run handed out"
        );
    }
    match cut {
        RunCut::Budget | RunCut::FailedWave => {
            let r = first_cycle.expect("first cycle");
            // Without runs the claim held `h` 1 only.
            let (published, retried, unsent) = match (runs, cut) {
                (false, _) => (4, 0, 0),
                (true, RunCut::Budget) => (4, 0, 2),
                (true, _) => (4, 1, 1),
            };
            assert_eq!(
                (r.claimed, r.published, r.retried, r.unsent, r.parked),
                (if runs { 6 } else { 4 }, published, retried, unsent, 0),
                "{mode:?} {cut:?}: {r:?}"
            );
        }
        RunCut::CompletionFails | RunCut::AnswerLost => {
            assert!(
                first_cycle.is_err(),
                "{mode:?} {cut:?}: the failed completion is reported: {first_cycle:?}"
            );
            let mut kept: Vec<String> = relay
                .prefetched()
                .map(|b| {
                    b.records
                        .iter()
                        .map(|r| r.envelope.aggregate_id.clone())
                        .collect()
                })
                .unwrap_or_default();
            kept.sort();
            assert_eq!(
                kept,
                vec!["g0", "g1", "g2"],
                "{mode:?} {cut:?}: the relay keeps the early claim"
            );
        }
    }
    let all: Vec<Envelope> = first.iter().chain(&later).cloned().collect();
    // What the first cycle acknowledged and no completion recorded goes out again.
    let again = if cut == RunCut::CompletionFails {
        log.lock().expect("log").acked.len()
    } else {
        0
    };
    drain(&mut relay, &log, all.len() + again).await;
    // Nothing more comes (the count reached, a duplicate would show up now).
    for _ in 0..3 {
        let _ = relay.run_once().await;
    }
    watch.assert_clean();
    let twice = check_first_deliveries(&log.lock().expect("log"), &all);
    let failed: HashSet<EventId> = first.iter().map(|e| e.event_id).collect();
    if cut == RunCut::CompletionFails {
        assert!(
            twice.is_subset(&failed),
            "{mode:?} {cut:?}: only the failed batch goes out twice"
        );
    } else {
        assert!(twice.is_empty(), "{mode:?} {cut:?}: nothing goes out twice");
    }
    let _ = relay.release_prefetched().await;
    assert_nothing_left(&store, &format!("{mode:?} {cut:?}")).await;
}

/// Emits the scenarios of runs beside the early claim ([`runs_beside_the_early_claim_keep_order`],
/// [`run_beside_the_early_claim`]) as named tests, in both claim modes, for a
/// [`RandomizedBackend`] type as [`early_claim_tests!`](crate::early_claim_tests) takes;
/// `runs` says whether its store hands out runs (MariaDB's hands out heads only).
///
/// ```text
/// outbox_testkit::early_claim_run_tests!(common::backend::PgBackend, runs = true);
/// ```
#[macro_export]
macro_rules! early_claim_run_tests {
    ($backend:ty, runs = $runs:expr) => {
        $crate::early_claim_tests!(@case $backend, runs_of_3_beside_early_claims_lease, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, $crate::scenarios::early_claim::lease(30.0), 3, false, $runs));
        $crate::early_claim_tests!(@case $backend, runs_of_3_beside_early_claims_locked, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction, 3, false, $runs));
        $crate::early_claim_tests!(@case $backend, runs_of_100_beside_early_claims_lease, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, $crate::scenarios::early_claim::lease(30.0), 100, false, $runs));
        $crate::early_claim_tests!(@case $backend, runs_of_100_beside_early_claims_locked, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction, 100, false, $runs));
        $crate::early_claim_tests!(@case $backend, yielding_runs_of_3_beside_early_claims_lease, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, $crate::scenarios::early_claim::lease(30.0), 3, true, $runs));
        $crate::early_claim_tests!(@case $backend, yielding_runs_of_100_beside_early_claims_locked, 12, |b|
            $crate::scenarios::early_claim::runs_beside_the_early_claim_keep_order(
                &b, ::outbox_core::ClaimMode::LockedTransaction, 100, true, $runs));
        $crate::early_claim_tests!(@case $backend, run_cut_by_the_budget_beside_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, $crate::scenarios::early_claim::lease(30.0), $crate::scenarios::early_claim::RunCut::Budget, $runs));
        $crate::early_claim_tests!(@case $backend, run_cut_by_the_budget_beside_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, ::outbox_core::ClaimMode::LockedTransaction, $crate::scenarios::early_claim::RunCut::Budget, $runs));
        $crate::early_claim_tests!(@case $backend, run_failed_mid_wave_beside_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, $crate::scenarios::early_claim::lease(30.0), $crate::scenarios::early_claim::RunCut::FailedWave, $runs));
        $crate::early_claim_tests!(@case $backend, run_failed_mid_wave_beside_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, ::outbox_core::ClaimMode::LockedTransaction, $crate::scenarios::early_claim::RunCut::FailedWave, $runs));
        $crate::early_claim_tests!(@case $backend, run_completion_fails_after_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, $crate::scenarios::early_claim::lease(1.5), $crate::scenarios::early_claim::RunCut::CompletionFails, $runs));
        $crate::early_claim_tests!(@case $backend, run_completion_fails_after_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, ::outbox_core::ClaimMode::LockedTransaction, $crate::scenarios::early_claim::RunCut::CompletionFails, $runs));
        $crate::early_claim_tests!(@case $backend, run_completion_answer_lost_after_the_early_claim_lease, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, $crate::scenarios::early_claim::lease(30.0), $crate::scenarios::early_claim::RunCut::AnswerLost, $runs));
        $crate::early_claim_tests!(@case $backend, run_completion_answer_lost_after_the_early_claim_locked, 8, |b|
            $crate::scenarios::early_claim::run_beside_the_early_claim(
                &b, ::outbox_core::ClaimMode::LockedTransaction, $crate::scenarios::early_claim::RunCut::AnswerLost, $runs));
    };
}
