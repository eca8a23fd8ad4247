//! Relay state-machine tests with a small fake store and a mockall publisher.

use std::collections::HashSet;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use mockall::predicate::*;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::*;
use crate::delivery::*;
use crate::envelope::{Envelope, EventId};
use crate::error::{PublishError, PublishErrorKind, StoreErrorKind};
use crate::store::prelude::*;

// The mock's methods are synchronous (mockall cannot mock `&[&Envelope]` through
// async-trait's lifetimes); the trait impl forwards to them.
mockall::mock! {
    pub Pub {
        fn publish<'a>(&self, batch: &[&'a Envelope]) -> Vec<PublishResult>;
        fn delivery_timeout(&self) -> Duration;
    }
}

#[async_trait::async_trait]
impl Publisher for MockPub {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        MockPub::publish(self, batch)
    }
    fn delivery_timeout(&self) -> Duration {
        MockPub::delivery_timeout(self)
    }
}

#[derive(Debug)]
struct FixedClock(Mutex<DateTime<Utc>>);
impl Clock for FixedClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap()
    }
}
fn clock() -> Arc<FixedClock> {
    Arc::new(FixedClock(Mutex::new(
        DateTime::from_timestamp(1_700_000_000, 0).unwrap(),
    )))
}

#[derive(Clone, Debug, PartialEq)]
enum St {
    Pending,
    Claimed,
    Published,
    Parked,
}

/// Head-of-line fake: one row per (aggregate, version), claim returns aggregate heads.
#[derive(Default)]
struct FakeStore {
    rows: Mutex<Vec<(Envelope, St, u32)>>,
    completions: Mutex<Vec<Vec<Outcome>>>,
    releases: Mutex<usize>,
    mode: Option<ClaimMode>,
    lease_remaining: Option<Duration>,
    /// Outcomes of these events are refused (superseded).
    refuse: Mutex<HashSet<EventId>>,
    /// The clock moves this much while a claim runs (a slow claim or commit).
    claim_takes: Option<(Arc<FixedClock>, Duration)>,
    locked_timeout: Option<Duration>,
    /// Parking notices handed out by the claims, one list per claim call (then none).
    parks_at_claim: Mutex<std::collections::VecDeque<Vec<ParkedAtClaim>>>,
    /// Hands out runs: after a head, its aggregate's next pending versions up to `run`.
    runs: bool,
    /// Events committed while a claim starts, one list per claim call (then none).
    appear_at_claim: Mutex<std::collections::VecDeque<Vec<Envelope>>>,
    /// The rows each claim handed out, by its token: a completion releases those it got no
    /// outcome for, as a real store does (no attempt counted).
    claimed: Mutex<std::collections::HashMap<uuid::Uuid, Vec<usize>>>,
}

impl FakeStore {
    fn with(events: &[(&str, i64)]) -> Self {
        let s = Self::default();
        for (agg, v) in events {
            s.rows.lock().unwrap().push((ev(agg, *v), St::Pending, 0));
        }
        s
    }
    fn status(&self, agg: &str, v: i64) -> St {
        self.rows
            .lock()
            .unwrap()
            .iter()
            .find(|(e, _, _)| e.aggregate_id == agg && e.aggregate_version == v)
            .unwrap()
            .1
            .clone()
    }
}

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("t", agg, v, "e").build().unwrap()
}

#[async_trait::async_trait]
impl AppendStore for FakeStore {
    type Tx = ();
    async fn append(&self, _: &mut (), _: &[Envelope]) -> Result<(), StoreError> {
        Ok(())
    }
}

#[async_trait::async_trait]
impl RelayStore for FakeStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        if let Some((clock, d)) = &self.claim_takes {
            let mut now = clock.0.lock().unwrap();
            *now += chrono::Duration::from_std(*d).unwrap();
        }
        let mut rows = self.rows.lock().unwrap();
        for e in self
            .appear_at_claim
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_default()
        {
            rows.push((e, St::Pending, 0));
        }
        let mut seen = HashSet::new();
        let mut out = vec![];
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|i| rows[*i].0.aggregate_version);
        for i in order {
            let (e, st, att) = &rows[i];
            if *st == St::Published {
                continue;
            }
            if !seen.insert(e.aggregate_id.clone()) {
                continue; // not the head
            }
            if *st == St::Pending && out.len() < req.limit {
                out.push((i, ClaimedRecord::new(e.clone(), *att)));
                // The rest of its run: the next versions, consecutive and pending.
                let mut position = 1;
                while self.runs && (position as usize) < req.run_len() && out.len() < req.limit {
                    let next = rows.iter().position(|(n, st, _)| {
                        n.aggregate_id == e.aggregate_id
                            && n.aggregate_version == e.aggregate_version + i64::from(position)
                            && *st == St::Pending
                    });
                    let Some(j) = next else { break };
                    let rec = ClaimedRecord::new(rows[j].0.clone(), rows[j].2)
                        .with_run_position(position);
                    out.push((j, rec));
                    position += 1;
                }
            }
        }
        for (i, _) in &out {
            rows[*i].1 = St::Claimed;
        }
        let token = uuid::Uuid::new_v4();
        self.claimed
            .lock()
            .unwrap()
            .insert(token, out.iter().map(|(i, _)| *i).collect());
        let mut batch = ClaimedBatch::new(
            ClaimHandle {
                token,
                owner: req.owner.clone(),
            },
            out.into_iter().map(|(_, r)| r).collect(),
            self.lease_remaining,
        );
        batch.parked = self
            .parks_at_claim
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_default();
        Ok(batch)
    }
    async fn complete(
        &self,
        handle: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let mut rows = self.rows.lock().unwrap();
        // Rows of this claim without an outcome (a run's unsent rest) are released unchanged.
        for i in self
            .claimed
            .lock()
            .unwrap()
            .remove(&handle.token)
            .unwrap_or_default()
        {
            let id = rows[i].0.event_id;
            if rows[i].1 == St::Claimed && !outcomes.iter().any(|o| o.event_id() == id) {
                rows[i].1 = St::Pending;
            }
        }
        let refuse = self.refuse.lock().unwrap().clone();
        let mut refused = vec![];
        for o in outcomes {
            if refuse.contains(&o.event_id()) {
                refused.push(o.event_id());
                continue;
            }
            let row = rows
                .iter_mut()
                .find(|r| r.0.event_id == o.event_id())
                .unwrap();
            match o {
                Outcome::Published { .. } => row.1 = St::Published,
                Outcome::Retry { .. } => {
                    row.1 = St::Pending;
                    row.2 += 1;
                }
                Outcome::Defer { .. } => row.1 = St::Pending,
                Outcome::Park { .. } => row.1 = St::Parked,
            }
        }
        self.completions.lock().unwrap().push(outcomes.to_vec());
        Ok(CompletionReport::new(
            outcomes.len() - refused.len(),
            refused,
        ))
    }
    async fn release(&self, _: &ClaimHandle) -> Result<(), StoreError> {
        *self.releases.lock().unwrap() += 1;
        for r in self.rows.lock().unwrap().iter_mut() {
            if r.1 == St::Claimed {
                r.1 = St::Pending;
            }
        }
        Ok(())
    }
    fn claim_mode(&self) -> ClaimMode {
        self.mode.unwrap_or(ClaimMode::LockedTransaction)
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.locked_timeout
    }
}

#[async_trait::async_trait]
impl OperatorStore for FakeStore {
    async fn list_parked(&self, _: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        Ok(vec![])
    }
    async fn parked_event(&self, id: EventId) -> Result<ParkedEvent, StoreError> {
        Err(StoreError::new(StoreErrorKind::NotFound, id.to_string()))
    }
    async fn release_claims_of(&self, _: &str, _: &str) -> Result<u64, StoreError> {
        Ok(0)
    }
    async fn retry_parked(&self, _: EventId, _: &str) -> Result<(), StoreError> {
        Ok(())
    }
    async fn discard_parked(&self, _: EventId, _: &str, _: &str) -> Result<(), StoreError> {
        Ok(())
    }
    async fn reissue_parked(&self, id: EventId, _: &str, _: &str) -> Result<EventId, StoreError> {
        Ok(id)
    }
    async fn audit_trail(&self, _: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        Ok(vec![])
    }
}

#[async_trait::async_trait]
impl MaintenanceStore for FakeStore {
    async fn cleanup(&self, _: Duration, _: usize) -> Result<CleanupReport, StoreError> {
        Ok(CleanupReport::default())
    }
    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        Ok(OutboxStats::default())
    }
}

fn ack(i: i64) -> PublishResult {
    Ok(AckMetadata::kafka("t", 0, i))
}

fn relay(store: FakeStore, publisher: MockPub) -> Relay<FakeStore, MockPub> {
    let cfg = RelayConfig::builder()
        .owner("r1")
        .retry(RetryPolicy::builder().max_attempts(3).build().unwrap())
        .build()
        .unwrap();
    Relay::new(
        store,
        publisher,
        cfg,
        clock(),
        Box::new(StdRng::seed_from_u64(5)),
    )
    .unwrap()
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}

#[test]
fn whole_batch_goes_to_the_publisher_in_one_call() {
    let store = FakeStore::with(&[("a", 1), ("b", 1), ("c", 1), ("d", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish()
        .times(1)
        .withf(|batch| batch.len() == 4)
        .returning(|b| (0..b.len() as i64).map(ack).collect());
    let mut r = relay(store, p);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.claimed, rep.published), (4, 4));
    assert_eq!(r.store().status("c", 1), St::Published);
}

#[test]
fn claims_only_aggregate_heads_so_versions_never_overtake() {
    let store = FakeStore::with(&[("a", 1), ("a", 2), ("a", 3), ("b", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish()
        .times(3)
        .returning(|b| (0..b.len() as i64).map(ack).collect());
    let mut r = relay(store, p);
    let first = block_on(r.run_once()).unwrap();
    assert_eq!(first.published, 2, "a1 and b1 only");
    assert_eq!(r.store().status("a", 2), St::Pending);
    block_on(r.run_once()).unwrap();
    assert_eq!(r.store().status("a", 2), St::Published);
    assert_eq!(r.store().status("a", 3), St::Pending);
    block_on(r.run_once()).unwrap();
    assert_eq!(r.store().status("a", 3), St::Published);
    assert!(block_on(r.run_once()).unwrap().is_idle());
}

#[test]
fn transient_failures_retry_then_park_after_the_limit() {
    let store = FakeStore::with(&[("a", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().times(3).returning(|b| {
        b.iter()
            .map(|_| Err(PublishError::new(PublishErrorKind::Other, "flaky")))
            .collect()
    });
    let mut r = relay(store, p);
    for expected_retry in [1, 1, 0] {
        let rep = block_on(r.run_once()).unwrap();
        assert_eq!(rep.retried, expected_retry);
    }
    assert_eq!(r.store().status("a", 1), St::Parked);
    let last = r
        .store()
        .completions
        .lock()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    match &last[0] {
        Outcome::Park { reason, .. } => {
            assert_eq!(reason.kind, ParkKind::AttemptsExhausted);
            assert_eq!(reason.error.kind, "other");
        }
        o => panic!("{o:?}"),
    }
}

#[test]
fn retry_delays_are_jittered_and_never_zero() {
    let store = FakeStore::with(&[("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().returning(|b| {
        b.iter()
            .map(|_| Err(PublishError::new(PublishErrorKind::Other, "t")))
            .collect()
    });
    let mut r = relay(store, p);
    block_on(r.run_once()).unwrap();
    let outcomes = r.store().completions.lock().unwrap()[0].clone();
    let delays: HashSet<Duration> = outcomes
        .iter()
        .map(|o| match o {
            Outcome::Retry { delay, .. } => *delay,
            o => panic!("{o:?}"),
        })
        .collect();
    assert!(delays.len() > 1, "all retries share one delay: {delays:?}");
    assert!(delays.iter().all(|d| *d >= Duration::from_millis(10)));
}

#[test]
fn permanent_failure_parks_and_blocks_only_its_aggregate() {
    let store = FakeStore::with(&[("poison", 1), ("poison", 2), ("ok", 1), ("ok", 2)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().returning(|b| {
        b.iter()
            .map(|e| {
                if e.aggregate_id == "poison" {
                    Err(PublishError::new(PublishErrorKind::RecordTooLarge, "big"))
                } else {
                    ack(0)
                }
            })
            .collect()
    });
    let mut r = relay(store, p);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.parked), (1, 1));
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!(
        (rep.claimed, rep.published),
        (1, 1),
        "only ok/2 is claimable"
    );
    assert_eq!(r.store().status("poison", 1), St::Parked);
    assert_eq!(r.store().status("poison", 2), St::Pending);
    assert!(
        block_on(r.run_once()).unwrap().is_idle(),
        "poison/2 waits behind its parked head"
    );
}

#[test]
fn shutdown_releases_a_claimed_batch_without_publishing() {
    let store = FakeStore::with(&[("a", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().times(0);
    let mut r = relay(store, p);
    r.shutdown_signal().trigger();
    let rep = block_on(r.run_once()).unwrap();
    assert!(rep.released);
    assert_eq!(*r.store().releases.lock().unwrap(), 1);
    assert_eq!(r.store().status("a", 1), St::Pending);
}

#[test]
fn lease_shorter_than_delivery_timeout_is_rejected() {
    let store = FakeStore {
        mode: Some(ClaimMode::lease(Duration::from_secs(10)).unwrap()),
        ..FakeStore::default()
    };
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(30));
    let err = Relay::new(
        store,
        p,
        RelayConfig::default(),
        clock(),
        Box::new(StdRng::seed_from_u64(1)),
    )
    .unwrap_err();
    assert!(err.to_string().contains("does not outlive"), "{err}");
}

#[test]
fn batch_with_too_little_lease_left_is_released() {
    let mut store = FakeStore::with(&[("a", 1)]);
    store.mode = Some(ClaimMode::lease(Duration::from_secs(60)).unwrap());
    store.lease_remaining = Some(Duration::from_secs(3)); // claim took most of the lease
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().times(0);
    let mut r = relay(store, p);
    let rep = block_on(r.run_once()).unwrap();
    assert!(rep.released);
    assert_eq!(r.store().status("a", 1), St::Pending);
}

#[test]
fn wrong_result_count_marks_nothing_published() {
    let store = FakeStore::with(&[("a", 1), ("b", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().returning(|_| vec![ack(0)]);
    let mut r = relay(store, p);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.retried), (0, 2));
}

#[test]
fn config_builder_rejects_bad_values() {
    assert!(RelayConfig::builder().batch_size(0).build().is_err());
    assert!(RelayConfig::builder().owner(" ").build().is_err());
    assert!(RelayConfig::builder()
        .idle(Duration::from_secs(2), Duration::from_secs(1))
        .build()
        .is_err());
    assert!(RelayConfig::builder()
        .idle(Duration::ZERO, Duration::from_secs(1))
        .build()
        .is_err());
}

/// Each bound of `RelayConfigBuilder::build`, on both sides of its edge.
#[test]
fn config_builder_bounds_are_inclusive_where_documented() {
    let b = RelayConfig::builder;
    let (s1, s2) = (Duration::from_secs(1), Duration::from_secs(2));
    // batch_size: 1..=100000.
    assert_eq!(b().batch_size(1).build().unwrap().batch_size, 1);
    assert_eq!(b().batch_size(100_000).build().unwrap().batch_size, 100_000);
    assert!(b().batch_size(100_001).build().is_err());
    // idle: min > 0 and min <= max (equal is a constant idle sleep).
    let c = b().idle(s1, s1).build().unwrap();
    assert_eq!((c.idle_min, c.idle_max), (s1, s1));
    // lease margin: at least MIN_LEASE_MARGIN.
    let m = b().lease_margin(MIN_LEASE_MARGIN).build().unwrap();
    assert_eq!(m.lease_margin, MIN_LEASE_MARGIN);
    let short = b()
        .lease_margin(MIN_LEASE_MARGIN - Duration::from_millis(1))
        .build()
        .unwrap_err();
    assert!(short.to_string().contains("lease_margin"), "{short}");
    // circuit breaker: base > 0 and base <= max.
    let c = b().circuit_breaker(s1, s1).build().unwrap();
    assert_eq!((c.circuit_base, c.circuit_max), (s1, s1));
    assert!(b().circuit_breaker(s2, s1).build().is_err());
    assert!(b().circuit_breaker(Duration::ZERO, s1).build().is_err());
    // Every default is valid.
    assert!(b().build().is_ok());
}

#[test]
fn step_api_matches_run_once() {
    let store = FakeStore::with(&[("a", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish()
        .with(always())
        .returning(|b| (0..b.len() as i64).map(ack).collect());
    let mut r = relay(store, p);
    let batch = block_on(r.claim()).unwrap();
    let results = block_on(r.publish(&batch, r.clock.now()));
    let outcomes = r.decide(&batch, &results);
    assert!(matches!(outcomes[0], Outcome::Published { .. }));
    let rep = block_on(r.complete(&batch, &outcomes)).unwrap();
    assert_eq!(rep.applied, 1);
}

fn failing(kind: PublishErrorKind) -> impl Fn(&[&Envelope]) -> Vec<PublishResult> {
    move |b: &[&Envelope]| {
        b.iter()
            .map(|_| Err(PublishError::new(kind, "injected")))
            .collect()
    }
}

#[test]
fn transport_failures_never_spend_attempts_and_open_then_close_the_circuit() {
    let store = FakeStore::with(&[("a", 1), ("b", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let mut seq = mockall::Sequence::new();
    // Far more failing cycles than the attempt limit of 3.
    p.expect_publish()
        .times(6)
        .in_sequence(&mut seq)
        .returning(failing(PublishErrorKind::BrokerUnavailable));
    p.expect_publish()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|b| (0..b.len() as i64).map(ack).collect());
    let mut r = relay(store, p);
    let mut pauses = vec![];
    for _ in 0..6 {
        let rep = block_on(r.run_once()).unwrap();
        assert_eq!((rep.deferred, rep.retried, rep.parked), (2, 0, 0));
        pauses.push(rep.pause.expect("the circuit is open: the relay pauses"));
        assert!(r.circuit().is_open());
    }
    assert!(pauses[5] > pauses[0], "pauses grow: {pauses:?}");
    for (e, _, attempts) in r.store().rows.lock().unwrap().iter() {
        assert_eq!(
            *attempts, 0,
            "{}: a transport failure spent an attempt",
            e.aggregate_id
        );
    }
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!(rep.published, 2);
    assert_eq!(rep.pause, None);
    assert!(
        !r.circuit().is_open(),
        "an acknowledgement closes the circuit"
    );
    assert_eq!(r.store().status("a", 1), St::Published);
}

#[test]
fn a_partial_transport_failure_defers_its_records_without_opening_the_circuit() {
    let store = FakeStore::with(&[("a", 1), ("b", 1)]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().returning(|b| {
        b.iter()
            .map(|e| {
                if e.aggregate_id == "a" {
                    Err(PublishError::new(
                        PublishErrorKind::LeaderMoved,
                        "no leader",
                    ))
                } else {
                    ack(0)
                }
            })
            .collect()
    });
    let mut r = relay(store, p);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.deferred), (1, 1));
    assert_eq!(rep.pause, None);
    assert!(!r.circuit().is_open());
}

#[test]
fn lease_time_is_counted_from_before_the_claim() {
    // The lease has 10 s left when granted; the claim itself took 4 s (a slow commit), so only
    // 6 s are left, less than the 5 s delivery timeout plus the 2 s margin.
    let clk = clock();
    let mut store = FakeStore::with(&[("a", 1)]);
    store.mode = Some(ClaimMode::lease(Duration::from_secs(60)).unwrap());
    store.lease_remaining = Some(Duration::from_secs(10));
    store.claim_takes = Some((clk.clone(), Duration::from_secs(4)));
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().times(0);
    let cfg = RelayConfig::builder().owner("r1").build().unwrap();
    let mut r = Relay::new(store, p, cfg, clk, Box::new(StdRng::seed_from_u64(5))).unwrap();
    let rep = block_on(r.run_once()).unwrap();
    assert!(
        rep.released,
        "a lease that is too short must not be published"
    );
}

#[test]
fn claims_that_cannot_outlive_a_publication_are_rejected() {
    let pub_with = |t: u64| {
        let mut p = MockPub::new();
        p.expect_delivery_timeout()
            .return_const(Duration::from_secs(t));
        p
    };
    let make = |store: FakeStore, p: MockPub, prefetch: bool| {
        let cfg = RelayConfig::builder()
            .owner("r")
            .prefetch(prefetch)
            .build()
            .unwrap();
        Relay::new(store, p, cfg, clock(), Box::new(StdRng::seed_from_u64(1)))
    };
    // A lease longer than the bound.
    let store = FakeStore {
        mode: Some(ClaimMode::Lease {
            duration: MAX_LEASE + Duration::from_secs(1),
        }),
        ..FakeStore::default()
    };
    let err = make(store, pub_with(5), true).unwrap_err();
    assert!(err.to_string().contains("longer than"), "{err}");
    assert!(ClaimMode::lease(MAX_LEASE + Duration::from_secs(1)).is_err());
    // Locked mode: the store ends a claim after 10 s; one publication needs 5 + 2 s, two with
    // prefetch need 14 s.
    let locked = || FakeStore {
        locked_timeout: Some(Duration::from_secs(10)),
        ..FakeStore::default()
    };
    let err = make(locked(), pub_with(5), true).unwrap_err();
    assert!(err.to_string().contains("prefetch"), "{err}");
    assert!(make(locked(), pub_with(5), false).is_ok());
    let err = make(locked(), pub_with(9), false).unwrap_err();
    assert!(err.to_string().contains("locked_max_hold"), "{err}");
    // The margin must cover the publisher's grace and the completion.
    assert!(RelayConfig::builder()
        .lease_margin(MIN_LEASE_MARGIN - Duration::from_millis(1))
        .build()
        .is_err());
    assert!(RelayConfig::builder()
        .circuit_breaker(Duration::ZERO, Duration::from_secs(1))
        .build()
        .is_err());
}

#[test]
fn a_cycle_is_idle_only_when_it_claimed_nothing() {
    assert!(CycleReport::default().is_idle());
    let busy = CycleReport {
        claimed: 1,
        ..CycleReport::default()
    };
    assert!(!busy.is_idle());
}

#[test]
fn the_relay_hands_out_its_own_configuration() {
    let store = FakeStore::with(&[]);
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let cfg = RelayConfig::builder()
        .owner("relay-7")
        .batch_size(17)
        .build()
        .unwrap();
    let r = Relay::new(store, p, cfg, clock(), Box::new(StdRng::seed_from_u64(1))).unwrap();
    assert_eq!(
        (r.config().owner.as_str(), r.config().batch_size),
        ("relay-7", 17)
    );
}

/// The lease must leave strictly more than delivery timeout + margin: exactly that much is
/// too little (the last delivery report could land when the lease ends).
#[test]
fn a_lease_leaving_exactly_the_time_needed_is_released() {
    let clk = clock();
    let mut store = FakeStore::with(&[("a", 1)]);
    store.mode = Some(ClaimMode::lease(Duration::from_secs(60)).unwrap());
    // 5 s delivery timeout + 2 s default margin.
    store.lease_remaining = Some(Duration::from_secs(7));
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish().times(0);
    let cfg = RelayConfig::builder().owner("r1").build().unwrap();
    assert_eq!(cfg.lease_margin, Duration::from_secs(2));
    let mut r = Relay::new(store, p, cfg, clk, Box::new(StdRng::seed_from_u64(5))).unwrap();
    let rep = block_on(r.run_once()).unwrap();
    assert!(rep.released);
    assert_eq!(*r.store().releases.lock().unwrap(), 1);
}

/// A prefetch claim that hands out nothing but parks events (version checks) still counts
/// them in the cycle's report.
#[test]
fn events_parked_by_an_empty_prefetch_claim_are_counted() {
    let store = FakeStore::with(&[("a", 1)]);
    let parked = ParkedAtClaim::new(ev("z", 3).event_id, "t", "z", 3, ParkKind::OutOfOrder);
    {
        let mut q = store.parks_at_claim.lock().unwrap();
        q.push_back(vec![]);
        q.push_back(vec![parked]);
    }
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    p.expect_publish()
        .returning(|b| (0..b.len() as i64).map(ack).collect());
    // Batch size 1: the first batch is full, so the next claim runs as a prefetch.
    let cfg = RelayConfig::builder()
        .owner("r1")
        .batch_size(1)
        .build()
        .unwrap();
    let mut r = Relay::new(store, p, cfg, clock(), Box::new(StdRng::seed_from_u64(3))).unwrap();
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.parked_at_claim), (1, 1));
    assert!(r.prefetched().is_none());
}

/// Idle sleeps start at `idle_min`, grow while idle, and start over after work; failed cycles
/// wait the retry policy's backoff.
#[test]
fn idle_and_error_delays_follow_the_configuration() {
    let ms = Duration::from_millis;
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let cfg = RelayConfig::builder()
        .owner("r1")
        .idle(ms(10), ms(1000))
        .retry(
            RetryPolicy::builder()
                .min_delay(ms(5))
                .base(ms(10))
                .max_delay(ms(20))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    let mut r = Relay::new(
        FakeStore::with(&[]),
        p,
        cfg,
        clock(),
        Box::new(StdRng::seed_from_u64(9)),
    )
    .unwrap();
    assert_eq!(r.idle_delay(), ms(10), "the first idle sleep is idle_min");
    let later: Vec<Duration> = (0..12).map(|_| r.idle_delay()).collect();
    assert!(
        later.iter().all(|d| (ms(10)..=ms(1000)).contains(d)),
        "{later:?}"
    );
    assert!(
        later.iter().any(|d| *d > ms(20)),
        "idle sleeps grow: {later:?}"
    );
    r.reset_idle();
    assert_eq!(r.idle_delay(), ms(10), "work resets the idle backoff");
    for failures in 1..6 {
        let d = r.error_delay(failures);
        assert!((ms(5)..=ms(20)).contains(&d), "{failures}: {d:?}");
    }
}

/// Outcomes a superseded claim could not record are not counted as published;
/// `outbox_superseded_total` counts them, and a cycle without any does not touch it.
#[test]
fn superseded_outcomes_are_not_published_and_are_counted_in_their_metric() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let run = |refuse: bool| {
        let store = FakeStore::with(&[("a", 1), ("b", 1), ("c", 1)]);
        if refuse {
            let b_id = store.rows.lock().unwrap()[1].0.event_id;
            store.refuse.lock().unwrap().insert(b_id);
        }
        let mut p = MockPub::new();
        p.expect_delivery_timeout()
            .return_const(Duration::from_secs(5));
        p.expect_publish()
            .returning(|b| (0..b.len() as i64).map(ack).collect());
        let mut r = relay(store, p);
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let rep = metrics::with_local_recorder(&recorder, || block_on(r.run_once()).unwrap());
        let values = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(k, _, _, _)| k.key().name() == "outbox_superseded_total")
            .map(|(_, _, _, v)| v)
            .collect::<Vec<_>>();
        ((rep.published, rep.superseded), values)
    };
    // A superseded outcome is neither published nor silent.
    assert_eq!(run(true), ((2, 1), vec![DebugValue::Counter(1)]));
    assert_eq!(run(false), ((3, 0), Vec::<DebugValue>::new()));
}

/// A recorder that keeps the last value of each gauge and the total of each counter (the
/// debugging recorder's snapshots reset them), by name.
#[derive(Clone, Default)]
struct Latest(Arc<Mutex<std::collections::HashMap<String, f64>>>);

struct LatestCell(Latest, String);

impl metrics::GaugeFn for LatestCell {
    fn increment(&self, v: f64) {
        *(self.0)
            .0
            .lock()
            .unwrap()
            .entry(self.1.clone())
            .or_default() += v;
    }
    fn decrement(&self, v: f64) {
        self.increment(-v);
    }
    fn set(&self, v: f64) {
        (self.0).0.lock().unwrap().insert(self.1.clone(), v);
    }
}

impl metrics::CounterFn for LatestCell {
    fn increment(&self, v: u64) {
        metrics::GaugeFn::increment(self, v as f64);
    }
    fn absolute(&self, v: u64) {
        metrics::GaugeFn::set(self, v as f64);
    }
}

impl metrics::Recorder for Latest {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(Arc::new(LatestCell(self.clone(), key.name().to_owned())))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(Arc::new(LatestCell(self.clone(), key.name().to_owned())))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

impl Latest {
    fn get(&self, name: &str) -> Option<f64> {
        self.0.lock().unwrap().get(name).copied()
    }
}

/// The last value of `outbox_relay_circuit_open`.
fn circuit_gauge(s: &Latest) -> f64 {
    s.get("outbox_relay_circuit_open")
        .expect("the gauge was written")
}

fn add_pending(r: &Relay<FakeStore, MockPub>, agg: &str, v: i64) {
    r.store()
        .rows
        .lock()
        .unwrap()
        .push((ev(agg, v), St::Pending, 0));
}

/// Another worker published the relay's records: it has nothing left to send.
fn drain(r: &Relay<FakeStore, MockPub>) {
    for row in r.store().rows.lock().unwrap().iter_mut() {
        row.1 = St::Published;
    }
}

#[test]
fn the_circuit_gauge_says_whether_any_relay_sharing_it_is_open() {
    let tally = telemetry::CircuitTally::default();
    let ack_all = |b: &[&Envelope]| (0..b.len() as i64).map(ack).collect();
    let fail = || failing(PublishErrorKind::BrokerUnavailable);
    let mut pa = MockPub::new();
    pa.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let mut seq = mockall::Sequence::new();
    for ok in [false, false, false, true] {
        let call = pa.expect_publish().times(1).in_sequence(&mut seq);
        if ok {
            call.returning(ack_all);
        } else {
            call.returning(fail());
        }
    }
    let mut pb = MockPub::new();
    pb.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let mut seq = mockall::Sequence::new();
    for ok in [true, false, true] {
        let call = pb.expect_publish().times(1).in_sequence(&mut seq);
        if ok {
            call.returning(ack_all);
        } else {
            call.returning(fail());
        }
    }
    let mut a = relay(FakeStore::with(&[("a", 1)]), pa).with_circuit_tally(tally.clone());
    let mut b = relay(FakeStore::with(&[("b", 1)]), pb).with_circuit_tally(tally.clone());
    let s = Latest::default();
    metrics::with_local_recorder(&s, || {
        // The broker fails while `a` has work and `b` has none yet: `a` opens.
        assert!(block_on(a.run_once()).unwrap().pause.is_some());
        assert_eq!(circuit_gauge(&s), 1.0);
        // It comes back; `b` publishes everything (its own record and, say, `a`'s), and `a`
        // is left idle with its breaker open. An idle relay never tries the broker, so it
        // learns from `b`'s acknowledgement that the transport answers again.
        drain(&a);
        assert_eq!(block_on(b.run_once()).unwrap().published, 1);
        let idle = block_on(a.run_once()).unwrap();
        assert!(idle.is_idle());
        assert_eq!(idle.pause, None, "the idle relay closes and polls normally");
        assert!(!a.circuit().is_open());
        assert_eq!(
            circuit_gauge(&s),
            0.0,
            "stuck at 1 after the broker came back"
        );

        // Both open; `b` recovers first while `a` has not learned it yet: still open.
        add_pending(&a, "a", 2);
        add_pending(&b, "b", 2);
        assert!(block_on(a.run_once()).unwrap().pause.is_some());
        assert!(block_on(b.run_once()).unwrap().pause.is_some());
        add_pending(&b, "b", 3);
        assert_eq!(block_on(b.run_once()).unwrap().published, 1);
        assert!(!b.circuit().is_open());
        assert!(a.circuit().is_open());
        assert_eq!(circuit_gauge(&s), 1.0, "one circuit is still open");
        // `a` fails again after `b`'s acknowledgement: idle, it stays open (nothing since its
        // own failure says the transport answers).
        assert!(block_on(a.run_once()).unwrap().pause.is_some());
        drain(&a);
        assert!(block_on(a.run_once()).unwrap().pause.is_some());
        assert!(a.circuit().is_open());
        assert_eq!(circuit_gauge(&s), 1.0);
        add_pending(&a, "a", 3);
        assert_eq!(block_on(a.run_once()).unwrap().published, 1);
        assert_eq!(circuit_gauge(&s), 0.0);

        // A relay dropped with its circuit open no longer counts.
        let mut pc = MockPub::new();
        pc.expect_delivery_timeout()
            .return_const(Duration::from_secs(5));
        pc.expect_publish().times(1).returning(fail());
        let mut c = relay(FakeStore::with(&[("c", 1)]), pc).with_circuit_tally(tally.clone());
        assert!(block_on(c.run_once()).unwrap().pause.is_some());
        assert_eq!(circuit_gauge(&s), 1.0);
        drop(c);
        assert_eq!(circuit_gauge(&s), 0.0);
    });
    let opened = s.get("outbox_relay_circuit_opened_total");
    assert_eq!(opened, Some(4.0), "each opening once: a, a and b, c");
}

// ---- Runs (module docs, "Runs") ----

/// The publish calls of a run test: each call's (aggregate, version)s.
type Calls = Arc<Mutex<Vec<Vec<(String, i64)>>>>;

/// A relay over `store` (handing out runs) with runs of up to `run`, the mock publisher
/// logging each call's (aggregate, version)s and answering through `answer`, the clock moved
/// by `per_call` at each call.
fn run_relay(
    store: FakeStore,
    run: usize,
    per_call: Duration,
    answer: impl Fn(&Envelope) -> PublishResult + Send + 'static,
) -> (Relay<FakeStore, MockPub>, Calls) {
    run_relay_with(store, run, per_call, answer, |b| b)
}

/// [`run_relay`] with the configuration tuned by `tune`.
fn run_relay_with(
    mut store: FakeStore,
    run: usize,
    per_call: Duration,
    answer: impl Fn(&Envelope) -> PublishResult + Send + 'static,
    tune: impl FnOnce(RelayConfigBuilder) -> RelayConfigBuilder,
) -> (Relay<FakeStore, MockPub>, Calls) {
    store.runs = true;
    let clk = clock();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let (log, moved) = (calls.clone(), clk.clone());
    p.expect_publish().returning(move |b| {
        log.lock().unwrap().push(
            b.iter()
                .map(|e| (e.aggregate_id.clone(), e.aggregate_version))
                .collect(),
        );
        *moved.0.lock().unwrap() += chrono::Duration::from_std(per_call).unwrap();
        b.iter().map(|e| answer(e)).collect()
    });
    let cfg = tune(
        RelayConfig::builder()
            .owner("r1")
            .run(run)
            .retry(RetryPolicy::builder().max_attempts(3).build().unwrap()),
    )
    .build()
    .unwrap();
    let r = Relay::new(store, p, cfg, clk, Box::new(StdRng::seed_from_u64(5))).unwrap();
    (r, calls)
}

/// [`run_relay_with`] with runs of up to 10 and a broker that acknowledges every event.
fn acking_run_relay(
    store: FakeStore,
    per_call: Duration,
    tune: impl FnOnce(RelayConfigBuilder) -> RelayConfigBuilder,
) -> (Relay<FakeStore, MockPub>, Calls) {
    run_relay_with(store, 10, per_call, |e| ack(e.aggregate_version), tune)
}

/// One cycle of `r`, whose (claimed, published, unsent) must be `want`.
fn cycle(r: &mut Relay<FakeStore, MockPub>, want: (usize, usize, usize)) {
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.claimed, rep.published, rep.unsent), want, "{rep:?}");
}

/// Five versions of one aggregate, the claim's life set on the store by `life`, published at
/// 5 s per call with the budget far above the claim's life, so that the claim's end is what
/// stops the run: with 20 s, waves start at 0, 5 and 10 s, and at 15 s the claim no longer
/// covers one more publication (delivery timeout 5 s plus the 2 s margin): 3 published, 2
/// released.
fn run_until_the_claim_ends(life: impl FnOnce(&mut FakeStore)) -> Relay<FakeStore, MockPub> {
    let mut store = hot(5);
    life(&mut store);
    let (mut r, calls) = acking_run_relay(store, Duration::from_secs(5), |b| {
        b.run_budget(Duration::from_secs(60))
    });
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.unsent), (3, 2), "{rep:?}");
    assert_eq!(calls.lock().unwrap().len(), 3);
    r
}

fn ids(v: &[(&str, i64)]) -> Vec<(String, i64)> {
    v.iter().map(|(a, n)| (a.to_string(), *n)).collect()
}

/// Wave 0 carries every head at once; a run's next version goes out in the next call, after
/// the call that acknowledged the one before it. The whole run is recorded in one cycle.
#[test]
fn a_run_is_sent_in_waves_each_version_after_the_acknowledgement_of_the_one_before() {
    let store = FakeStore::with(&[("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)]);
    let (mut r, calls) = acking_run_relay(store, Duration::ZERO, |b| b);
    cycle(&mut r, (5, 5, 0));
    assert_eq!(
        *calls.lock().unwrap(),
        vec![
            ids(&[("a", 1), ("b", 1)]),
            ids(&[("a", 2), ("b", 2)]),
            ids(&[("a", 3)])
        ]
    );
    assert_eq!(r.store().status("a", 3), St::Published);
    assert_eq!(r.store().completions.lock().unwrap().len(), 1);
}

/// A run stops at its first failure: the versions after it are never sent and get no outcome
/// (the completion releases them, no attempt counted); other runs go on.
#[test]
fn a_run_stops_at_its_first_failure_and_its_rest_gets_no_outcome() {
    let store = FakeStore::with(&[
        ("a", 1),
        ("a", 2),
        ("a", 3),
        ("a", 4),
        ("b", 1),
        ("b", 2),
        ("b", 3),
    ]);
    let (mut r, calls) = run_relay(store, 10, Duration::ZERO, |e| {
        if (e.aggregate_id.as_str(), e.aggregate_version) == ("a", 2) {
            Err(PublishError::new(PublishErrorKind::Other, "injected"))
        } else {
            ack(e.aggregate_version)
        }
    });
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!(
        (rep.published, rep.retried, rep.unsent),
        (4, 1, 2),
        "{rep:?}"
    );
    assert_eq!(
        *calls.lock().unwrap(),
        vec![
            ids(&[("a", 1), ("b", 1)]),
            ids(&[("a", 2), ("b", 2)]),
            ids(&[("b", 3)])
        ],
        "a3 must not be sent after a2 failed"
    );
    let completions = r.store().completions.lock().unwrap();
    let recorded: Vec<(String, i64)> = completions[0]
        .iter()
        .map(|o| {
            let rows = r.store().rows.lock().unwrap();
            let e = &rows
                .iter()
                .find(|x| x.0.event_id == o.event_id())
                .unwrap()
                .0;
            (e.aggregate_id.clone(), e.aggregate_version)
        })
        .collect();
    assert!(
        !recorded.contains(&("a".into(), 3)) && !recorded.contains(&("a".into(), 4)),
        "the rest of a's run gets no outcome: {recorded:?}"
    );
    assert!(completions[0]
        .iter()
        .any(|o| matches!(o, Outcome::Retry { .. })));
}

/// Before each wave the lease must still cover one more publication (delivery timeout 5 s
/// plus the 2 s margin): with 20 s granted and 5 s per call, waves start at 0, 5 and 10 s,
/// and at 15 s only 5 s are left, so the run stops there and its rest is released.
#[test]
fn a_run_stops_where_the_lease_no_longer_covers_one_more_publication() {
    let r = run_until_the_claim_ends(|store| {
        store.mode = Some(ClaimMode::lease(Duration::from_secs(60)).unwrap());
        store.lease_remaining = Some(Duration::from_secs(20));
    });
    assert_eq!(r.store().status("a", 3), St::Published);
}

/// Locked-transaction mode: the same check against the store's hold limit, counted from
/// before the claim.
#[test]
fn a_locked_run_stops_where_the_hold_limit_no_longer_covers_one_more_publication() {
    run_until_the_claim_ends(|store| store.locked_timeout = Some(Duration::from_secs(20)));
}

/// A relay asking for runs of 1 (or a store handing out heads only) publishes one version
/// per cycle, as before runs.
#[test]
fn a_run_of_one_claims_heads_only() {
    let store = FakeStore::with(&[("a", 1), ("a", 2)]);
    let (mut r, calls) = run_relay(store, 1, Duration::ZERO, |e| ack(e.aggregate_version));
    assert_eq!(r.claim_request().run, 1);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.claimed, rep.published), (1, 1));
    assert_eq!(calls.lock().unwrap().len(), 1);
}

/// A record whose run position does not follow the record before it (another aggregate, or a
/// position skipped) is never sent, whatever the store handed out.
#[test]
fn a_record_out_of_its_run_is_never_sent() {
    let (r, calls) = acking_run_relay(FakeStore::default(), Duration::ZERO, |b| b);
    let handle = ClaimHandle {
        token: uuid::Uuid::nil(),
        owner: "r1".into(),
    };
    let batch = ClaimedBatch::new(
        handle,
        vec![
            ClaimedRecord::new(ev("a", 1), 0),
            ClaimedRecord::new(ev("b", 2), 0).with_run_position(1),
            ClaimedRecord::new(ev("c", 1), 0),
            ClaimedRecord::new(ev("c", 3), 0).with_run_position(2),
        ],
        None,
    );
    let results = block_on(r.publish(&batch, r.clock.now()));
    let sent: Vec<bool> = results.iter().map(Option::is_some).collect();
    assert_eq!(sent, vec![true, false, true, false]);
    assert_eq!(calls.lock().unwrap().len(), 1);
}

#[test]
fn config_run_is_validated_and_capped_at_the_batch() {
    let b = RelayConfig::builder;
    assert_eq!(
        b().build().unwrap().run,
        1,
        "the documented default: runs off"
    );
    let zero = b().run(0).build().unwrap_err();
    assert!(zero.to_string().contains("run must be in 1..="), "{zero}");
    assert!(b().run(MAX_RUN + 1).build().is_err());
    assert_eq!(b().run(MAX_RUN).build().unwrap().run, MAX_RUN);
    assert_eq!(b().run(1).build().unwrap().run, 1);
    let store = FakeStore::default();
    let mut p = MockPub::new();
    p.expect_delivery_timeout()
        .return_const(Duration::from_secs(5));
    let cfg = b().owner("r1").batch_size(7).run(50).build().unwrap();
    let r = Relay::new(store, p, cfg, clock(), Box::new(StdRng::seed_from_u64(5))).unwrap();
    assert_eq!(r.claim_request().run, 7, "a run never exceeds the batch");
}

fn hot(n: i64) -> FakeStore {
    let v: Vec<(&str, i64)> = (1..=n).map(|i| ("a", i)).collect();
    FakeStore::with(&v)
}

fn attempts(r: &Relay<FakeStore, MockPub>, agg: &str, v: i64) -> u32 {
    let rows = r.store().rows.lock().unwrap();
    rows.iter()
        .find(|(e, _, _)| e.aggregate_id == agg && e.aggregate_version == v)
        .unwrap()
        .2
}

/// The waves' time budget (`run_budget`, 5 ms): with 2 ms per publish call, waves start at
/// 0, 2 and 4 ms; at 6 ms the budget is spent and the run stops, its rest released with no
/// attempt counted. The next cycle starts from the first unsent version, in order.
#[test]
fn the_waves_stop_at_the_time_budget_and_the_rest_is_released_in_order() {
    let (mut r, calls) = acking_run_relay(hot(10), Duration::from_millis(2), |b| {
        b.run_budget(Duration::from_millis(5))
    });
    cycle(&mut r, (10, 3, 7));
    assert_eq!(
        *calls.lock().unwrap(),
        vec![ids(&[("a", 1)]), ids(&[("a", 2)]), ids(&[("a", 3)])]
    );
    for v in 4..=10 {
        assert_eq!(r.store().status("a", v), St::Pending, "a{v} released");
        assert_eq!(attempts(&r, "a", v), 0, "a{v}: no attempt counted");
    }
    cycle(&mut r, (7, 3, 4));
    assert_eq!(
        calls.lock().unwrap()[3..],
        [ids(&[("a", 4)]), ids(&[("a", 5)]), ids(&[("a", 6)])],
        "the next cycle goes on from the first unsent version"
    );
}

/// `run_yields`: a batch holding a run has the next batch claimed during its waves; once that
/// claim brought events (b1, committed meanwhile), the run stops after the wave under way and
/// its rest is released; b1 is published by the next cycle, and the run goes on after it.
#[test]
fn a_run_stops_once_the_next_claim_brought_events() {
    let store = hot(5);
    store
        .appear_at_claim
        .lock()
        .unwrap()
        .extend([vec![], vec![ev("b", 1)]]);
    let (mut r, calls) = acking_run_relay(store, Duration::ZERO, |b| b.run_yields(true));
    cycle(&mut r, (5, 1, 4));
    assert_eq!(r.prefetched().map(|b| b.records.len()), Some(1));
    assert_eq!(attempts(&r, "a", 2), 0);
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.claimed, rep.published), (1, 1), "{rep:?}");
    cycle(&mut r, (4, 4, 0));
    assert_eq!(
        *calls.lock().unwrap(),
        vec![
            ids(&[("a", 1)]),
            ids(&[("b", 1)]),
            ids(&[("a", 2)]),
            ids(&[("a", 3)]),
            ids(&[("a", 4)]),
            ids(&[("a", 5)]),
        ]
    );
}

/// `run_yields` with nothing new: the claim made during the waves comes back empty and the
/// run goes on to its end (within the budget).
#[test]
fn a_run_goes_on_when_the_next_claim_comes_back_empty() {
    let (mut r, calls) = acking_run_relay(hot(4), Duration::ZERO, |b| b.run_yields(true));
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.unsent), (4, 0), "{rep:?}");
    assert_eq!(calls.lock().unwrap().len(), 4);
    assert!(r.prefetched().is_none());
}

/// A shutdown requested while a run is out stops it before its next wave (the budget is far
/// from spent); the sent prefix is recorded, the rest released.
#[test]
fn a_shutdown_stops_the_runs_before_their_next_wave() {
    let signal: Arc<std::sync::OnceLock<ShutdownSignal>> = Arc::default();
    let on_answer = signal.clone();
    let (mut r, calls) = run_relay_with(
        hot(6),
        10,
        Duration::ZERO,
        move |e| {
            if e.aggregate_version == 2 {
                on_answer.get().unwrap().trigger();
            }
            ack(e.aggregate_version)
        },
        |b| b.run_budget(Duration::from_secs(60)),
    );
    signal.set(r.shutdown_signal()).unwrap();
    let rep = block_on(r.run_once()).unwrap();
    assert_eq!((rep.published, rep.unsent), (2, 4), "{rep:?}");
    assert_eq!(calls.lock().unwrap().len(), 2);
    assert_eq!(r.store().status("a", 3), St::Pending);
}

#[test]
fn config_run_budget_is_validated() {
    let b = RelayConfig::builder;
    assert_eq!(b().build().unwrap().run_budget, DEFAULT_RUN_BUDGET);
    for bad in [
        Duration::ZERO,
        Duration::from_micros(999),
        Duration::from_millis(60_001),
    ] {
        let e = b().run_budget(bad).build().unwrap_err();
        assert!(
            e.to_string().contains("run_budget must be in 1ms..=60s"),
            "{e}"
        );
    }
    for ok in [Duration::from_millis(1), Duration::from_secs(60)] {
        assert_eq!(b().run_budget(ok).build().unwrap().run_budget, ok);
    }
}
