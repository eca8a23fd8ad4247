//! Relay scenarios on a real server, one body for every backend: several relays on one backlog
//! while producers commit out of id order, a relay that dies between claim and complete, a
//! broker outage longer than the attempt limit, and a lower version whose transaction commits
//! after a higher one. A backend runs them through the same [`RandomizedBackend`] it gives the
//! randomized run (stores over its own schema or database, business transactions), so the
//! PostgreSQL and MySQL tests hold the stores to the same bodies.
//!
//! Each scenario drives `outbox_core::Relay::run_once` in a loop (honouring the report's pause
//! and the idle backoff) and records what a broker would have seen; the checks are on that
//! record and on the store's own stats, never on timing (the only time bounds are generous
//! deadlines).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimMode, ClaimRequest, Envelope, EventId, FailureScope,
    PublishError, PublishErrorKind, PublishResult, Publisher, Relay, RelayConfig, RetryPolicy,
    SystemClock,
};
use rand::SeedableRng;

use crate::randomized::{RandomizedBackend, StoreParams};

pub mod early_claim;
pub mod hot_adversary;
pub mod hot_aggregate;
pub mod run_adversary;

/// Every record of `batch` published, with offsets 0, 1, .. in batch order (topic `orders`,
/// partition 0).
pub(crate) fn published_in_order(batch: &outbox_core::ClaimedBatch) -> Vec<outbox_core::Outcome> {
    batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| outbox_core::Outcome::Published {
            event_id: r.envelope.event_id,
            ack: AckMetadata::kafka("orders", 0, i as i64),
        })
        .collect()
}

/// Store parameters of the scenarios: `mode`, `locked_max_hold` `hold`, a gap timeout of five
/// minutes (no scenario leaves a gap), the publishers' delivery timeout.
fn params(mode: ClaimMode, hold: Duration, delivery_timeout: Duration) -> StoreParams {
    StoreParams {
        mode,
        locked_hold: hold,
        gap_timeout: Duration::from_secs(300),
        delivery_timeout,
    }
}

fn event(aggregate: &str, version: i64) -> Envelope {
    Envelope::builder("order", aggregate, version, "order.changed")
        .json(&serde_json::json!({ "aggregate": aggregate, "version": version }))
        .and_then(|b| b.build())
        .expect("valid envelope")
}

/// What the broker saw.
#[derive(Default)]
struct Log {
    /// Acknowledged publications in acknowledgement order: (event, aggregate, version, relay).
    acked: Vec<(EventId, String, i64, String)>,
    /// Aggregates being published right now, by relay.
    in_flight: HashMap<String, String>,
    /// Two relays publishing one aggregate at once.
    overlaps: Vec<String>,
    /// Hand-overs per event.
    attempts: HashMap<EventId, u32>,
    /// Relays that have started a hand-over.
    publishers: HashSet<String>,
}

/// A broker double: notes what is in flight, takes 3 ms, fails the first hand-over of every
/// version `v % 7 == 3` with a record-scoped timeout, acknowledges the rest.
#[derive(Clone)]
struct RecordingPublisher {
    name: String,
    log: Arc<Mutex<Log>>,
    offset: Arc<AtomicUsize>,
    /// Until a second relay has started a hand-over, each hand-over waits for one (at most
    /// [`RENDEZVOUS`]), so that the relays' sharing of the work does not depend on timing.
    rendezvous: bool,
}

/// The longest a hand-over waits for a second relay's (`RecordingPublisher::rendezvous`).
const RENDEZVOUS: Duration = Duration::from_secs(5);

impl RecordingPublisher {
    fn new(name: &str, log: &Arc<Mutex<Log>>) -> Self {
        Self {
            name: name.to_owned(),
            log: Arc::clone(log),
            offset: Arc::default(),
            rendezvous: false,
        }
    }

    /// See [`RecordingPublisher::rendezvous`].
    fn with_rendezvous(mut self) -> Self {
        self.rendezvous = true;
        self
    }

    /// Notes this relay as a publisher; with a rendezvous, waits until another one is.
    async fn meet(&self) {
        let deadline = Instant::now() + RENDEZVOUS;
        loop {
            let publishers = {
                let mut log = self.log.lock().expect("log");
                log.publishers.insert(self.name.clone());
                log.publishers.len()
            };
            if !self.rendezvous || publishers >= 2 || Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[async_trait]
impl Publisher for RecordingPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        self.meet().await;
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
        // Broker latency: lets the other relays run in between.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut log = self.log.lock().expect("log");
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            log.in_flight.remove(&e.aggregate_id);
            let n = log.attempts.entry(e.event_id).or_default();
            *n += 1;
            if e.aggregate_version % 7 == 3 && *n == 1 {
                out.push(Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "injected timeout",
                )
                .with_scope(FailureScope::Record)));
                continue;
            }
            log.acked.push((
                e.event_id,
                e.aggregate_id.clone(),
                e.aggregate_version,
                self.name.clone(),
            ));
            out.push(Ok(AckMetadata::kafka(
                "orders",
                0,
                self.offset.fetch_add(1, Ordering::Relaxed) as i64,
            )));
        }
        out
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_millis(500)
    }
}

/// A store of `backend` with `p`, its tables created.
async fn prepared<B: RandomizedBackend>(backend: &B, p: &StoreParams) -> B::Store {
    let store = backend.store(p);
    backend.prepare(&store).await.expect("migrate");
    store
}

/// An in-memory outbox in lease mode (30 s) holding `aggregates` x `versions` committed events
/// (aggregates `order-00`, `order-01`, ..., appended version by version), and their count.
pub async fn memory_backlog(aggregates: usize, versions: i64) -> (crate::MemoryOutboxStore, usize) {
    let db = crate::MemoryDb::new(SystemClock);
    let store = crate::MemoryOutboxStore::new(
        &db,
        ClaimMode::Lease {
            duration: Duration::from_secs(30),
        },
    );
    let mut events = Vec::new();
    for version in 1..=versions {
        for a in 0..aggregates {
            events.push(
                Envelope::builder("order", format!("order-{a:02}"), version, "order.changed")
                    .build()
                    .expect("valid event"),
            );
        }
    }
    let mut tx = db.begin();
    store.append(&mut tx, &events).await.expect("append");
    tx.commit().expect("commit");
    (store, events.len())
}

/// A retry policy from `base` up to `max` between attempts, `attempts` at the most.
pub fn retry_policy(base: Duration, max: Duration, attempts: u32) -> RetryPolicy {
    RetryPolicy::builder()
        .base(base)
        .max_delay(max)
        .max_attempts(attempts)
        .build()
        .expect("retry policy")
}

/// A relay of `config` over `store` and `publisher`, on the system clock, its jitter seeded
/// with `seed`.
pub fn seeded_relay<S: RelayStore, P: Publisher>(
    store: S,
    publisher: P,
    config: RelayConfig,
    seed: u64,
) -> Relay<S, P> {
    Relay::new(
        store,
        publisher,
        config,
        Arc::new(SystemClock),
        Box::new(rand::rngs::StdRng::seed_from_u64(seed)),
    )
    .expect("relay config")
}

fn relay<S: RelayStore, P: Publisher>(
    store: S,
    publisher: P,
    owner: &str,
    seed: u64,
) -> Relay<S, P> {
    seeded_relay(store, publisher, relay_config(owner, 50), seed)
}

/// The scenarios' relay configuration: batches of `batch_size`, short idle delays and
/// retries, the smallest lease margin.
fn relay_config(owner: &str, batch_size: usize) -> RelayConfig {
    RelayConfig::builder()
        .owner(owner)
        .batch_size(batch_size)
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .lease_margin(outbox_core::MIN_LEASE_MARGIN)
        .retry(retry_policy(
            Duration::from_millis(5),
            Duration::from_millis(20),
            50,
        ))
        .circuit_breaker(Duration::from_millis(20), Duration::from_millis(200))
        .build()
        .expect("relay config")
}

/// Every expected event acknowledged exactly once, each aggregate's versions acknowledged in
/// order without a gap, no aggregate published by two relays at once.
fn check_log(log: &Log, expected: &[Envelope]) {
    assert!(log.overlaps.is_empty(), "overlaps: {:?}", log.overlaps);
    let mut seen = HashSet::new();
    for (id, ..) in &log.acked {
        assert!(seen.insert(*id), "event {id} acknowledged twice");
    }
    let want: HashSet<EventId> = expected.iter().map(|e| e.event_id).collect();
    assert_eq!(seen, want, "every event published");
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (_, agg, version, _) in &log.acked {
        let prev = last.insert(agg.as_str(), *version).unwrap_or(0);
        assert_eq!(
            *version,
            prev + 1,
            "aggregate {agg}: {version} after {prev}"
        );
    }
}

/// One relay's loop until `stop`: `run_once`, then the report's pause or the idle backoff.
/// Returns (cycles that failed, events published).
async fn drive<S, P>(mut relay: Relay<S, P>, stop: Arc<AtomicBool>) -> (usize, usize)
where
    S: RelayStore,
    P: Publisher,
{
    let (mut errors, mut published) = (0, 0);
    while !stop.load(Ordering::Acquire) {
        match relay.run_once().await {
            Ok(report) => {
                published += report.published;
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
    (errors, published)
}

/// `relays` relays, each over its own store instance (as separate processes would have), on a
/// backlog of 40 aggregates x 15 versions, while producers append versions 16..=20: one
/// transaction per aggregate and version, five open at once, committed in reverse order (rows
/// commit out of id order). Every version of 20 transiently fails its first hand-over.
/// Batches of 16, and every hand-over waits (at most 5 s) until two relays have started one:
/// a relay holds at most two batches, so another always finds heads to claim, and the work is
/// shared whatever the scheduling (with the early claim a lone relay could otherwise take the
/// next batch the moment it completes, for ever).
/// Checks: every event acknowledged once, per-aggregate order, no two relays with one aggregate
/// in flight, the work shared, nothing left unpublished or in flight.
pub async fn many_relays_keep_order_and_publish_everything_once<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
    relays: usize,
) {
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(500));
    let store = backend.store(&p);
    backend.prepare(&store).await.expect("migrate");
    let (aggs, versions) = (40, 20);
    let mut all = Vec::new();
    for v in 1..=15 {
        for a in 0..aggs {
            all.push(event(&format!("agg-{a}"), v));
        }
    }
    for chunk in all.chunks(200) {
        let mut tx = backend.begin().await.expect("begin");
        backend
            .append(&store, &mut tx, chunk)
            .await
            .expect("append");
        backend.commit(tx).await.expect("commit");
    }

    let log = Arc::new(Mutex::new(Log::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for r in 0..relays {
        let name = format!("relay-{r}");
        // Batches of 16 of 40 aggregates: one relay holds at most two (one claimed ahead),
        // so a second relay always finds heads to claim while the first waits at the
        // rendezvous.
        let relay = seeded_relay(
            backend.store(&p),
            RecordingPublisher::new(&name, &log).with_rendezvous(),
            relay_config(&name, 16),
            r as u64,
        );
        tasks.push(tokio::spawn(drive(relay, Arc::clone(&stop))));
    }
    let mut late = Vec::new();
    for v in 16..=versions {
        for group in (0..aggs).collect::<Vec<_>>().chunks(5) {
            let mut open = Vec::new();
            for a in group {
                let e = event(&format!("agg-{a}"), v);
                let mut tx = backend.begin().await.expect("begin");
                backend
                    .append(&store, &mut tx, std::slice::from_ref(&e))
                    .await
                    .expect("append");
                open.push(tx);
                late.push(e);
            }
            // Higher ids first.
            while let Some(tx) = open.pop() {
                backend.commit(tx).await.expect("commit");
            }
        }
    }
    all.extend(late);

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = log.lock().expect("log").acked.len();
        if done >= all.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "only {done} of {} published in time",
            all.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, Ordering::Release);
    let mut published_by = 0;
    for t in tasks {
        let (errors, published) = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("relay stops")
            .expect("relay task");
        assert_eq!(errors, 0, "no failed cycles");
        if published > 0 {
            published_by += 1;
        }
    }
    check_log(&log.lock().expect("log"), &all);
    assert!(published_by >= 2, "the work was shared between relays");
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.unpublished, 0, "{stats:?}");
    assert_eq!(stats.in_flight, 0, "{stats:?}");
}

/// Signals the claimed batch, then never returns: the relay is "between claim and complete".
struct HangingPublisher {
    claimed: tokio::sync::mpsc::UnboundedSender<Vec<EventId>>,
}

#[async_trait]
impl Publisher for HangingPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let _ = self
            .claimed
            .send(batch.iter().map(|e| e.event_id).collect());
        std::future::pending().await
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_millis(100)
    }
}

/// A relay claims the heads of 10 aggregates (3 versions each) and dies before completing
/// (its task dropped; in locked mode its store's claims end after `locked_max_hold` 3 s, or
/// when the connection goes). A second relay over another store instance finishes the
/// backlog: the dead relay's heads first, every event once, in order. `mode`'s lease should
/// be short (about 2 s).
pub async fn crashed_relay_work_is_finished_by_another<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let survivor_params = params(mode, Duration::from_secs(60), Duration::from_millis(500));
    let store = backend.store(&survivor_params);
    backend.prepare(&store).await.expect("migrate");
    let evs: Vec<Envelope> = (0..30)
        .map(|i| event(&format!("c{}", i % 10), i / 10 + 1))
        .collect();
    let mut tx = backend.begin().await.expect("begin");
    backend.append(&store, &mut tx, &evs).await.expect("append");
    backend.commit(tx).await.expect("commit");

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut doomed = relay(
        backend.store(&params(
            mode,
            Duration::from_secs(3),
            Duration::from_millis(100),
        )),
        HangingPublisher { claimed: tx },
        "doomed",
        1,
    );
    let task = tokio::spawn(async move {
        let _ = doomed.run_once().await;
    });
    let claimed = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the doomed relay claimed")
        .expect("a batch");
    assert_eq!(claimed.len(), 10, "one head per aggregate");
    task.abort();
    let _ = task.await;

    let log = Arc::new(Mutex::new(Log::default()));
    let mut survivor = relay(
        store.clone(),
        RecordingPublisher::new("survivor", &log),
        "survivor",
        2,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.lock().expect("log").acked.len() < evs.len() {
        assert!(Instant::now() < deadline, "the survivor did not finish");
        let report = survivor.run_once().await.expect("cycle");
        if report.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    {
        let log = log.lock().expect("log");
        check_log(&log, &evs);
        let first_acked: HashSet<EventId> = log.acked.iter().take(10).map(|a| a.0).collect();
        assert_eq!(
            first_acked,
            claimed.into_iter().collect(),
            "the crashed relay's heads are published first, by the survivor"
        );
    }
    survivor.release_prefetched().await.expect("release");
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.in_flight), (0, 0), "{stats:?}");
}

/// Whether the broker double answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Broker {
    Up,
    Down,
}

/// A broker double that can be taken down: while down every call fails as a whole, alternately
/// with `BrokerUnavailable` and a `Timeout` of transport scope (what the Kafka publisher
/// reports with no broker); while up it acknowledges in order and records the acknowledgements.
#[derive(Clone)]
struct OutageBroker {
    state: Arc<Mutex<Broker>>,
    acked: Arc<Mutex<Vec<(EventId, String, i64)>>>,
    failed_calls: Arc<AtomicUsize>,
}

#[async_trait]
impl Publisher for OutageBroker {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        tokio::time::sleep(Duration::from_millis(2)).await;
        if *self.state.lock().expect("state") == Broker::Down {
            let n = self.failed_calls.fetch_add(1, Ordering::Relaxed);
            let error = if n.is_multiple_of(2) {
                PublishError::new(PublishErrorKind::BrokerUnavailable, "injected: no broker")
            } else {
                PublishError::new(PublishErrorKind::Timeout, "injected: message timed out")
                    .with_scope(FailureScope::Transport)
            };
            return batch.iter().map(|_| Err(error.clone())).collect();
        }
        let mut acked = self.acked.lock().expect("acked");
        batch
            .iter()
            .map(|e| {
                acked.push((e.event_id, e.aggregate_id.clone(), e.aggregate_version));
                Ok(AckMetadata::kafka("orders", 0, acked.len() as i64))
            })
            .collect()
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_millis(200)
    }
}

/// A broker outage that outlasts the attempt limit many times over parks nothing and spends no
/// attempt: one relay (attempt limit 3) drains 12 aggregates x 8 versions; after a third is
/// published the broker goes down for 40 failed calls, then comes back. Checks: no cycle
/// retried (spent an attempt) or parked anything, the circuit opened, every event published
/// once in per-aggregate order, nothing parked or unpublished in the store.
pub async fn broker_outage_parks_nothing_and_drains<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    const AGGREGATES: usize = 12;
    const VERSIONS: i64 = 8;
    const MAX_ATTEMPTS: u32 = 3;
    const OUTAGE_CALLS: usize = 40;
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(200));
    let store = backend.store(&p);
    backend.prepare(&store).await.expect("migrate");
    let mut events = Vec::new();
    for v in 1..=VERSIONS {
        for a in 0..AGGREGATES {
            events.push(event(&format!("order-{a:02}"), v));
        }
    }
    let mut tx = backend.begin().await.expect("begin");
    backend
        .append(&store, &mut tx, &events)
        .await
        .expect("append");
    backend.commit(tx).await.expect("commit");
    let total = events.len();

    let broker = OutageBroker {
        state: Arc::new(Mutex::new(Broker::Up)),
        acked: Arc::default(),
        failed_calls: Arc::default(),
    };
    let config = RelayConfig::builder()
        .owner("outage-relay")
        .batch_size(AGGREGATES)
        .retry(retry_policy(
            Duration::from_millis(5),
            Duration::from_millis(20),
            MAX_ATTEMPTS,
        ))
        .circuit_breaker(Duration::from_millis(5), Duration::from_millis(40))
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .build()
        .expect("relay config");
    let mut relay = seeded_relay(store.clone(), broker.clone(), config, 9);
    let (mut published, mut deferred, mut opened) = (0, 0, false);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let report = relay.run_once().await.expect("no store error");
        published += report.published;
        deferred += report.deferred;
        let state = *broker.state.lock().expect("state");
        assert_eq!(
            report.parked + report.parked_at_claim,
            0,
            "an event was parked, broker {state:?}: {report:?}"
        );
        assert_eq!(
            report.retried, 0,
            "an attempt was spent, broker {state:?}: {report:?}"
        );
        opened |= relay.circuit().is_open();
        match state {
            Broker::Up
                if published >= total / 3 && broker.failed_calls.load(Ordering::Relaxed) == 0 =>
            {
                *broker.state.lock().expect("state") = Broker::Down;
            }
            Broker::Down if broker.failed_calls.load(Ordering::Relaxed) >= OUTAGE_CALLS => {
                *broker.state.lock().expect("state") = Broker::Up;
            }
            Broker::Up if published == total => break,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "not drained: {published} of {total} published, broker {state:?}"
        );
        if let Some(pause) = report.pause {
            tokio::time::sleep(pause).await;
        } else if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        } else {
            relay.reset_idle();
        }
    }
    assert!(deferred > 0, "the outage deferred nothing");
    assert!(opened, "the circuit never opened");
    assert!(
        broker.failed_calls.load(Ordering::Relaxed) as u32 > MAX_ATTEMPTS * 5,
        "the outage did not outlast the attempt limit"
    );
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.parked), (0, 0), "{stats:?}");
    assert!(store.list_parked(10).await.expect("parked").is_empty());
    let acked = broker.acked.lock().expect("acked");
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for (id, agg, v) in acked.iter() {
        assert!(seen.insert(*id), "{agg} v{v} acknowledged twice");
        let prev = last.insert(agg.as_str(), *v).unwrap_or(0);
        assert_eq!(*v, prev + 1, "{agg}: v{v} after v{prev}");
    }
    assert_eq!(seen.len(), total, "every event acknowledged");
}

/// A version that commits after a higher one of its aggregate goes out first: version 1's
/// transaction is open while version 2 commits; the claim holds version 2 (a gap held), and
/// after version 1 commits it publishes 1, then 2. `mode`: either claim mode.
pub async fn late_lower_version_is_published_first<B: RandomizedBackend>(
    backend: &B,
    mode: ClaimMode,
) {
    let p = params(mode, Duration::from_secs(60), Duration::from_millis(500));
    let store = backend.store(&p);
    backend.prepare(&store).await.expect("migrate");
    let agg = format!("late-{}", matches!(mode, ClaimMode::Lease { .. }));
    let (v1, v2) = (event(&agg, 1), event(&agg, 2));
    let mut open = backend.begin().await.expect("begin");
    backend
        .append(&store, &mut open, std::slice::from_ref(&v1))
        .await
        .expect("append v1");
    let mut tx = backend.begin().await.expect("begin");
    backend
        .append(&store, &mut tx, std::slice::from_ref(&v2))
        .await
        .expect("append v2");
    backend.commit(tx).await.expect("commit v2");
    let claim = |store: B::Store| async move {
        let b = store
            .claim(&ClaimRequest::new("r1", 100))
            .await
            .expect("claim");
        let versions: Vec<i64> = b
            .records
            .iter()
            .map(|r| r.envelope.aggregate_version)
            .collect();
        (b, versions)
    };
    let (held, versions) = claim(store.clone()).await;
    assert!(
        versions.is_empty(),
        "{mode:?}: v2 went out while v1 was open"
    );
    assert_eq!(held.gaps_held, 1, "{mode:?}");
    backend.commit(open).await.expect("commit v1");
    let publish = |store: B::Store, b: outbox_core::ClaimedBatch| async move {
        let outcomes = published_in_order(&b);
        let rep = store
            .complete(&b.handle, &outcomes)
            .await
            .expect("complete");
        assert_eq!(rep.applied, outcomes.len());
    };
    let (b, versions) = claim(store.clone()).await;
    assert_eq!(versions, vec![1], "{mode:?}");
    publish(store.clone(), b).await;
    // The held head is checked again within a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (b, versions) = claim(store.clone()).await;
        if !b.is_empty() {
            assert_eq!(versions, vec![2], "{mode:?}");
            publish(store.clone(), b).await;
            break;
        }
        assert!(Instant::now() < deadline, "{mode:?}: v2 never came out");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.unpublished, 0, "{stats:?}");
}
