//! The real relay loop (`Relay::run_once`) over fault-injecting wrappers with seeded faults:
//! nothing is lost, order per aggregate holds, duplicates are allowed.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, DeliveryStatus, Envelope, Relay, RelayConfig, RetryPolicy};
use outbox_testkit::fault::{
    seed_from_env, FaultInjector, FaultRates, FaultSource, FaultyPublisher, FaultyStore,
};
use outbox_testkit::{ManualClock, MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

async fn relay_survives_seeded_faults(mode: ClaimMode, seed: u64) {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let store = MemoryOutboxStore::new(&db, mode);
    let log = MemoryLog::builder()
        .topic("events", 3)
        .default_topic("events")
        .clock(clock.shared())
        .build();
    let broker_faults = FaultInjector::new(FaultSource::seeded(
        seed,
        FaultRates::default()
            .transient(0.2)
            .ack_lost(0.1)
            .permanent(0.02),
    ));
    let store_faults = FaultInjector::new(FaultSource::seeded(
        seed.wrapping_add(1),
        FaultRates::default()
            .transient(0.1)
            .ack_lost(0.05)
            .permanent(0.0),
    ))
    .only(&["claim", "complete"]);
    let config = RelayConfig::builder()
        .owner("relay")
        .batch_size(4)
        .retry(
            RetryPolicy::builder()
                .max_attempts(4)
                .base(Duration::from_millis(100))
                .max_delay(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    let mut relay = Relay::new(
        FaultyStore::memory(store.clone(), store_faults.clone()),
        FaultyPublisher::new(log.clone(), broker_faults.clone()),
        config,
        clock.shared(),
        Box::new(StdRng::seed_from_u64(seed)),
    )
    .unwrap();

    let mut events = Vec::new();
    for agg in 0..5 {
        for v in 1..=6 {
            let n = (agg * 100 + v) as u64;
            events.push(
                Envelope::builder("order", format!("o-{agg}"), v, "order.changed")
                    .event_id(outbox_testkit::deterministic_event_id(clock.now_utc(), n))
                    .created_at(clock.now_utc())
                    .build()
                    .unwrap(),
            );
        }
    }
    let mut tx = db.begin();
    store.append(&mut tx, &events).await.unwrap();
    tx.commit().unwrap();

    for round in 0..400 {
        if round == 300 {
            // Faults stop; the system must drain.
            broker_faults.set_source(FaultSource::None);
            store_faults.set_source(FaultSource::None);
        }
        let _ = relay.run_once().await; // store errors are retried by the next cycle
        for p in store.list_parked(100).await.unwrap() {
            store
                .retry_parked(p.envelope.event_id, "test")
                .await
                .unwrap();
        }
        clock.advance(Duration::from_secs(5));
    }
    assert!(!broker_faults.injected().is_empty() && !store_faults.injected().is_empty());
    let snap = store.snapshot();
    assert!(
        snap.iter().all(|r| r.status == DeliveryStatus::Published),
        "seed {seed}: not drained: {:?}",
        snap.iter()
            .filter(|r| r.status != DeliveryStatus::Published)
            .count()
    );
    let records = log.all_records();
    let mut first: BTreeSet<_> = BTreeSet::new();
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for r in &records {
        let e = r.decode().unwrap();
        if first.insert(e.event_id) {
            let l = last.entry(e.aggregate_id.clone()).or_insert(0);
            assert_eq!(
                e.aggregate_version,
                *l + 1,
                "seed {seed}: first deliveries out of order"
            );
            *l = e.aggregate_version;
        }
    }
    assert_eq!(
        first.len(),
        events.len(),
        "seed {seed}: every event delivered"
    );
}

trait NowUtc {
    fn now_utc(&self) -> chrono::DateTime<chrono::Utc>;
}

impl NowUtc for ManualClock {
    fn now_utc(&self) -> chrono::DateTime<chrono::Utc> {
        outbox_core::Clock::now(self)
    }
}

#[tokio::test]
async fn lease_relay_survives_seeded_faults() {
    let seed = seed_from_env(42);
    relay_survives_seeded_faults(ClaimMode::lease(Duration::from_secs(30)).unwrap(), seed).await;
}

#[tokio::test]
async fn locked_relay_survives_seeded_faults() {
    let seed = seed_from_env(43);
    relay_survives_seeded_faults(ClaimMode::LockedTransaction, seed).await;
}
