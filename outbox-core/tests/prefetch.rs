//! The relay's prefetch (claiming batch N+1 while batch N is published and completed) over the
//! in-memory backends: the prefetched batch never holds an aggregate of the batch in flight, so
//! first deliveries stay in version order even when the batch in flight fails; a failed
//! prefetch claim costs nothing; prefetch off claims once per cycle; the driver releases a
//! prefetched batch when it stops.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, DeliveryStatus, Envelope, PublishErrorKind, Relay, RelayConfig, RetryPolicy,
    SystemClock,
};
use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyPublisher, FaultyStore};
use outbox_testkit::{MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn event(agg: &str, v: i64) -> Envelope {
    Envelope::builder("t", agg, v, "t.happened")
        .json(&serde_json::json!({ "agg": agg, "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

/// Appends versions `1..=versions` of each aggregate, interleaved (a1, b1, .., a2, b2, ..).
async fn append_all(db: &MemoryDb, store: &MemoryOutboxStore, aggs: &[&str], versions: i64) {
    let mut tx = db.begin();
    let evs: Vec<_> = (1..=versions)
        .flat_map(|v| aggs.iter().map(move |a| event(a, v)))
        .collect();
    store.append(&mut tx, &evs).await.unwrap();
    tx.commit().unwrap();
}

fn relay<S: OutboxStore, P: outbox_core::Publisher + Clone>(
    store: S,
    log: &P,
    batch: usize,
    prefetch: bool,
) -> Relay<S, P> {
    let retry = RetryPolicy::builder()
        .base(Duration::from_millis(1))
        .min_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(2))
        .max_attempts(50)
        .build()
        .unwrap();
    let cfg = RelayConfig::builder()
        .owner("prefetch-test")
        .batch_size(batch)
        .retry(retry)
        .prefetch(prefetch)
        .build()
        .unwrap();
    Relay::new(
        store,
        log.clone(),
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(7)),
    )
    .unwrap()
}

/// First deliveries per aggregate, in log order.
fn first_deliveries(log: &MemoryLog) -> BTreeMap<String, Vec<i64>> {
    let mut seen = std::collections::HashSet::new();
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let mut records = log.all_records();
    records.sort_by_key(|r| (r.timestamp, r.partition, r.offset));
    for r in records {
        let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        let agg = v["agg"].as_str().unwrap().to_owned();
        let ver = v["v"].as_i64().unwrap();
        if seen.insert((agg.clone(), ver)) {
            out.entry(agg).or_default().push(ver);
        }
    }
    out
}

fn all_published(store: &MemoryOutboxStore) -> bool {
    store
        .snapshot()
        .iter()
        .all(|r| r.status == DeliveryStatus::Published)
}

/// Runs the driver over `store` with 20 ms publishes and batches of 10, and stops it once 20
/// records are in the log: mid-drain, with a prefetched batch in hand.
#[cfg(feature = "tokio")]
async fn drive_and_stop_mid_drain<S: OutboxStore + Clone + 'static>(
    store: S,
    log: &MemoryLog,
) -> outbox_core::driver::DriverReport {
    let slow = FaultyPublisher::new(
        log.clone(),
        FaultInjector::new(FaultSource::from_call(
            0,
            Fault::Latency(Duration::from_millis(20)),
        )),
    );
    let r = relay(store, &slow, 10, true);
    let stop = async {
        while log.all_records().len() < 20 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(
        Duration::from_secs(10),
        outbox_core::driver::run(r, None, stop),
    )
    .await
    .expect("the driver stops")
}

#[tokio::test]
async fn prefetched_batch_is_disjoint_from_the_batch_in_flight_and_order_holds() {
    for mode in [
        ClaimMode::LockedTransaction,
        ClaimMode::lease(Duration::from_secs(30)).unwrap(),
    ] {
        let db = MemoryDb::new(SystemClock);
        let store = MemoryOutboxStore::new(&db, mode);
        // One partition: log order is publication order.
        let log = MemoryLog::new("t", 1);
        append_all(&db, &store, &["a", "b", "c", "d"], 3).await;
        // a1 fails while the prefetch claims the next batch: that batch must not hold a2.
        let a1 = store
            .snapshot()
            .into_iter()
            .find(|r| r.envelope.aggregate_id == "a" && r.envelope.aggregate_version == 1)
            .unwrap()
            .envelope
            .event_id;
        log.fail_event(a1, PublishErrorKind::Other);
        let mut r = relay(store.clone(), &log, 2, true);

        let first = r.run_once().await.unwrap();
        assert_eq!((first.claimed, first.published, first.retried), (2, 1, 1));
        let ahead: Vec<(String, i64)> = r
            .prefetched()
            .expect("a full batch prefetches the next")
            .records
            .iter()
            .map(|rec| {
                (
                    rec.envelope.aggregate_id.clone(),
                    rec.envelope.aggregate_version,
                )
            })
            .collect();
        // a1 and b1 were in flight: neither they nor their successors may be claimed ahead.
        assert_eq!(ahead, vec![("c".into(), 1), ("d".into(), 1)], "{mode:?}");
        assert_eq!(
            store.open_claims(),
            1,
            "{mode:?}: only the prefetched claim is open"
        );
        log.clear_faults();

        for _ in 0..500 {
            if all_published(&store) {
                break;
            }
            if r.run_once().await.unwrap().is_idle() {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        assert!(all_published(&store), "{mode:?}: backlog drained");
        let firsts = first_deliveries(&log);
        for agg in ["a", "b", "c", "d"] {
            assert_eq!(firsts[agg], vec![1, 2, 3], "{mode:?}: order of {agg}");
        }
        assert!(r.prefetched().is_none());
        assert_eq!(store.open_claims(), 0);
    }
}

#[tokio::test]
async fn prefetch_off_claims_once_per_cycle() {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::new("t", 1);
    append_all(&db, &store, &["a", "b", "c", "d"], 1).await;
    let mut r = relay(store.clone(), &log, 2, false);
    let rep = r.run_once().await.unwrap();
    assert_eq!(rep.published, 2);
    assert!(r.prefetched().is_none());
    assert_eq!(store.open_claims(), 0);
    // The same relay with prefetch on holds the other two after one cycle.
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    append_all(&db, &store, &["a", "b", "c", "d"], 1).await;
    let mut r = relay(store.clone(), &log, 2, true);
    r.run_once().await.unwrap();
    assert!(r.prefetched().is_some());
    assert_eq!(store.open_claims(), 1);
    // A partial batch does not prefetch (the backlog is drained).
    let rep = r.run_once().await.unwrap();
    assert_eq!(rep.published, 2);
    assert!(r.prefetched().is_none());
    assert_eq!(store.open_claims(), 0);
}

#[tokio::test]
async fn failed_prefetch_claim_keeps_the_cycle_and_the_next_cycle_claims_again() {
    let db = MemoryDb::new(SystemClock);
    let inner = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    append_all(&db, &inner, &["a", "b", "c", "d"], 1).await;
    // Claim 1 passes, claim 2 (the prefetch) fails.
    let faults =
        FaultInjector::new(FaultSource::script([None, Some(Fault::Transient)])).only(&["claim"]);
    let store = FaultyStore::memory(inner.clone(), faults);
    let log = MemoryLog::new("t", 1);
    let mut r = relay(store, &log, 2, true);
    let rep = r.run_once().await.unwrap();
    assert_eq!(rep.published, 2, "the batch in flight is recorded");
    assert!(r.prefetched().is_none());
    assert_eq!(inner.open_claims(), 0);
    let rep = r.run_once().await.unwrap();
    assert_eq!(rep.published, 2, "the next cycle claims on its own");
    assert!(all_published(&inner));
}

#[cfg(feature = "tokio")]
#[tokio::test]
async fn driver_releases_the_prefetched_batch_when_it_stops() {
    let db = MemoryDb::new(SystemClock);
    // A 30 s lease: a prefetched batch that was not released would hold its aggregates.
    let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let aggs: Vec<String> = (0..200).map(|i| format!("x{i}")).collect();
    let agg_refs: Vec<&str> = aggs.iter().map(String::as_str).collect();
    append_all(&db, &store, &agg_refs, 1).await;
    let log = MemoryLog::new("t", 1);
    let report = drive_and_stop_mid_drain(store.clone(), &log).await;
    assert!(report.published >= 20);
    assert_eq!(store.open_claims(), 0, "the prefetched batch was released");
    // Every remaining event is claimable at once (no lease left behind).
    let left = store
        .snapshot()
        .iter()
        .filter(|r| r.status == DeliveryStatus::Pending)
        .count();
    assert!(left > 0);
    let batch = store
        .claim(&outbox_core::ClaimRequest::new("other", 1000))
        .await
        .unwrap();
    assert_eq!(batch.records.len(), left);
}

/// A release that fails when the driver stops is logged, not fatal: the driver still returns
/// its report, and the claim is left to expire (here: still open in the store).
#[cfg(feature = "tokio")]
#[tokio::test]
async fn driver_stops_even_when_releasing_the_prefetched_batch_fails() {
    let db = MemoryDb::new(SystemClock);
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let aggs: Vec<String> = (0..200).map(|i| format!("y{i}")).collect();
    let agg_refs: Vec<&str> = aggs.iter().map(String::as_str).collect();
    append_all(&db, &inner, &agg_refs, 1).await;
    let store = FaultyStore::memory(
        inner.clone(),
        FaultInjector::new(FaultSource::from_call(0, Fault::Transient)).only(&["release"]),
    );
    let log = MemoryLog::new("t", 1);
    let report = drive_and_stop_mid_drain(store, &log).await;
    assert!(report.published >= 20);
    assert_eq!(
        inner.open_claims(),
        1,
        "the unreleased prefetch stays claimed"
    );
}

/// A publisher over `log` that commits `b` v1 while its first batch is being published (an
/// append that lands during a relay cycle).
#[derive(Clone)]
struct AppendsWhilePublishing {
    log: MemoryLog,
    db: MemoryDb,
    store: MemoryOutboxStore,
    appended: Arc<std::sync::atomic::AtomicBool>,
}

#[outbox_core::async_trait]
impl outbox_core::Publisher for AppendsWhilePublishing {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<outbox_core::PublishResult> {
        let results = self.log.publish(batch).await;
        if !self
            .appended
            .swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            append_all(&self.db, &self.store, &["b"], 1).await;
        }
        results
    }
    fn delivery_timeout(&self) -> Duration {
        self.log.delivery_timeout()
    }
}

/// An event committed while a partial batch is published is claimed during that batch's
/// completion (the early claim), and the next cycle publishes it without a claim of its own;
/// with the early claim off, a partial batch claims nothing ahead (the next cycle must claim).
#[tokio::test]
async fn an_event_committed_during_a_partial_batch_is_claimed_while_it_completes() {
    for mode in [
        ClaimMode::LockedTransaction,
        ClaimMode::lease(Duration::from_secs(30)).unwrap(),
    ] {
        for early in [true, false] {
            let db = MemoryDb::new(SystemClock);
            let store = MemoryOutboxStore::new(&db, mode);
            let log = MemoryLog::new("t", 1);
            append_all(&db, &store, &["a"], 1).await;
            let publisher = AppendsWhilePublishing {
                log: log.clone(),
                db: db.clone(),
                store: store.clone(),
                appended: Arc::default(),
            };
            let cfg = RelayConfig::builder()
                .owner("early-claim-test")
                .batch_size(10)
                .early_claim(early)
                .build()
                .unwrap();
            let mut r = Relay::new(
                store.clone(),
                publisher,
                cfg,
                Arc::new(SystemClock),
                Box::new(StdRng::seed_from_u64(7)),
            )
            .unwrap();
            let rep = r.run_once().await.unwrap();
            assert_eq!((rep.claimed, rep.published), (1, 1), "{mode:?}");
            let ahead: Vec<String> = r
                .prefetched()
                .map(|b| {
                    b.records
                        .iter()
                        .map(|rec| rec.envelope.aggregate_id.clone())
                        .collect()
                })
                .unwrap_or_default();
            if early {
                assert_eq!(
                    ahead,
                    vec!["b".to_owned()],
                    "{mode:?}: b1, committed while a1 was published, is claimed in a1's cycle"
                );
                assert_eq!(store.open_claims(), 1, "{mode:?}");
            } else {
                assert!(ahead.is_empty(), "{mode:?}: early claim off");
                assert_eq!(store.open_claims(), 0, "{mode:?}");
            }
            // The next cycle publishes b1 either way (from the early claim, or its own).
            let rep = r.run_once().await.unwrap();
            assert_eq!(rep.published, 1, "{mode:?} early={early}");
            assert!(all_published(&store), "{mode:?} early={early}");
            assert!(r.prefetched().is_none(), "{mode:?} early={early}");
            assert_eq!(store.open_claims(), 0, "{mode:?} early={early}");
            assert_eq!(log.all_records().len(), 2, "{mode:?} early={early}");
        }
    }
}
