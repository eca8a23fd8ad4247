//! `BackpressureStore` over a real store (the in-memory one): the gate refreshed from the
//! store's stats refuses non-critical appends above the threshold and lets critical ones in;
//! below it, everything goes in; refused appends write nothing.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::backpressure::{
    Backpressure, BackpressurePolicy, BackpressureStore, CRITICAL_HEADER,
};
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, StoreErrorKind};
use outbox_testkit::{ManualClock, MemoryDb, MemoryOutboxStore};

fn event(agg: &str, v: i64, t: &str) -> Envelope {
    Envelope::builder("order", agg, v, t).build().unwrap()
}

#[tokio::test]
async fn non_critical_appends_fail_fast_above_the_threshold_and_critical_ones_go_in() {
    let db = MemoryDb::new(ManualClock::default());
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let gate = Arc::new(Backpressure::new(
        BackpressurePolicy::default()
            .max_backlog(3)
            .critical_event_types(["payment.*"]),
    ));
    let store = BackpressureStore::new(inner, gate.clone());
    let append = |events: Vec<Envelope>| {
        let store = &store;
        let db = &db;
        async move {
            let mut tx = db.begin();
            store.append(&mut tx, &events).await?;
            tx.commit()
        }
    };
    // Below the threshold: everything goes in.
    append(vec![
        event("a", 1, "order.viewed"),
        event("b", 1, "order.viewed"),
        event("c", 1, "order.viewed"),
    ])
    .await
    .unwrap();
    let state = gate.refresh(&store, chrono::Utc::now()).await.unwrap();
    assert!(state.active, "{state:?}");
    // Non-critical: refused, typed, nothing written.
    let err = append(vec![event("d", 1, "order.viewed")])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Backpressure);
    // A batch with one non-critical event is refused whole.
    let err = append(vec![
        event("e", 1, "payment.captured"),
        event("f", 1, "order.viewed"),
    ])
    .await
    .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Backpressure);
    assert_eq!(store.stats().await.unwrap().unpublished, 3);
    // Critical by type or by header: in.
    let marked = Envelope::builder("order", "g", 1, "order.viewed")
        .header(CRITICAL_HEADER, "true")
        .build()
        .unwrap();
    append(vec![event("e", 1, "payment.captured"), marked])
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().unpublished, 5);
}

/// FOUND (issue 20, item 4, reproduced on the in-memory store and PostgreSQL): one parked event
/// with one more event of its aggregate behind it turned backpressure by age on for every
/// aggregate once the waiting event was older than `max_age` (the age counted events blocked
/// behind a parked one, which grow old without bound). The gate now reads the oldest claimable
/// age: it stays off, other aggregates' non-critical appends go in; it turns on when a
/// claimable event is that old (the relay does not keep up), whatever its `created_at`.
#[tokio::test]
async fn a_parked_event_with_one_behind_it_does_not_turn_backpressure_by_age_on() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let gate = Arc::new(Backpressure::new(
        BackpressurePolicy::default().max_age(Duration::from_secs(60)),
    ));
    let store = BackpressureStore::new(inner, gate.clone());
    let append = |events: Vec<Envelope>| {
        let store = &store;
        let db = &db;
        async move {
            let mut tx = db.begin();
            store.append(&mut tx, &events).await?;
            tx.commit()
        }
    };
    let (p1, p2) = (
        event("poison", 1, "order.viewed"),
        event("poison", 2, "order.viewed"),
    );
    append(vec![p1.clone(), p2]).await.unwrap();
    let batch = store
        .claim(&outbox_core::ClaimRequest::new("r", 10))
        .await
        .unwrap();
    assert_eq!(batch.records.len(), 1);
    let park = outbox_core::Outcome::Park {
        event_id: p1.event_id,
        reason: outbox_core::ParkReason {
            kind: outbox_core::ParkKind::PermanentError,
            error: outbox_core::LastError {
                class: outbox_core::ErrorClass::Permanent,
                kind: "record_too_large".into(),
                message: "too big".into(),
            },
        },
    };
    store.complete(&batch.handle, &[park]).await.unwrap();
    // An hour later the event behind the parked one is an hour old; nothing else waits.
    clock.advance(Duration::from_secs(3600));
    let state = gate.refresh(&store, chrono::Utc::now()).await.unwrap();
    assert!(!state.active, "{state:?}");
    append(vec![event("other", 1, "order.viewed")])
        .await
        .expect("another aggregate's non-critical append goes in");
    // A claimable event older than max_age (the relay is behind): on.
    clock.advance(Duration::from_secs(61));
    let state = gate.refresh(&store, chrono::Utc::now()).await.unwrap();
    assert!(state.active, "{state:?}");
    let err = append(vec![event("third", 1, "order.viewed")])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Backpressure);
}

/// `refresh` measures the backlog's growth between two refreshes and forecasts from it.
#[tokio::test]
async fn refresh_measures_growth_between_snapshots() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let gate = Arc::new(Backpressure::new(
        BackpressurePolicy::default().min_forecast(Duration::from_secs(5), 16),
    ));
    let store = BackpressureStore::new(inner, gate.clone());
    assert!(Arc::ptr_eq(store.gate(), &gate));
    let append = |aggs: std::ops::Range<usize>| {
        let store = &store;
        let db = &db;
        async move {
            let mut tx = db.begin();
            let events: Vec<_> = aggs
                .map(|i| event(&format!("g{i}"), 1, "order.viewed"))
                .collect();
            store.append(&mut tx, &events).await.unwrap();
            tx.commit().unwrap();
        }
    };
    let t0 = chrono::Utc::now();
    append(0..2).await;
    let first = gate.refresh(&store, t0).await.unwrap();
    let snapshot = first.snapshot.expect("a snapshot");
    assert_eq!(
        (snapshot.backlog, snapshot.rate_per_sec),
        (2, None),
        "no rate yet"
    );
    assert!(!first.active);
    // 4 more in 2 s: 2 events/s; 16 - 6 = 10 to go, 5 s: at the min_forecast bound.
    append(2..6).await;
    let second = gate
        .refresh(&store, t0 + chrono::Duration::seconds(2))
        .await
        .unwrap();
    assert_eq!(second.snapshot.as_ref().unwrap().rate_per_sec, Some(2.0));
    assert_eq!(second.forecast, Some(Duration::from_secs(5)));
    assert!(second.active, "{second:?}");
    // No time passed: no rate can be measured.
    let again = gate
        .refresh(&store, t0 + chrono::Duration::seconds(2))
        .await
        .unwrap();
    assert_eq!(again.snapshot.unwrap().rate_per_sec, None);
    assert!(!again.active);
    // Draining: a negative rate, no forecast.
    let batch = store
        .claim(&outbox_core::ClaimRequest::new("r", 100))
        .await
        .unwrap();
    let outcomes: Vec<_> = batch
        .records
        .iter()
        .map(|r| outbox_core::Outcome::Published {
            event_id: r.envelope.event_id,
            ack: outbox_core::AckMetadata::kafka("t", 0, 0),
        })
        .collect();
    store.complete(&batch.handle, &outcomes).await.unwrap();
    let drained = gate
        .refresh(&store, t0 + chrono::Duration::seconds(4))
        .await
        .unwrap();
    assert_eq!(drained.snapshot.unwrap().rate_per_sec, Some(-3.0));
    assert_eq!(drained.forecast, None);
}

/// With backpressure off, a `BackpressureStore` is the store it wraps: the whole outbox
/// conformance suite runs through the wrapper (every operation must reach the inner store
/// unchanged, not just appends).
mod conformance_through_the_wrapper {
    use std::sync::Arc;
    use std::time::Duration;

    use outbox_core::backpressure::{Backpressure, BackpressurePolicy, BackpressureStore};
    use outbox_core::{async_trait, ClaimHandle, ClaimMode, StoreError};
    use outbox_testkit::conformance::{Capabilities, MemoryOutboxHarness, OutboxHarness};
    use outbox_testkit::{MemoryOutboxStore, MemoryTx};

    pub(crate) struct Wrapped(MemoryOutboxHarness);

    #[async_trait]
    impl OutboxHarness for Wrapped {
        type Store = BackpressureStore<MemoryOutboxStore>;

        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }

        async fn store(&self, mode: ClaimMode) -> Self::Store {
            let gate = Arc::new(Backpressure::new(BackpressurePolicy::default()));
            BackpressureStore::new(self.0.store(mode).await, gate)
        }

        async fn store_accepting_first_version(&self, mode: ClaimMode) -> Self::Store {
            let gate = Arc::new(Backpressure::new(BackpressurePolicy::default()));
            BackpressureStore::new(self.0.store_accepting_first_version(mode).await, gate)
        }

        async fn begin(&self) -> MemoryTx {
            self.0.begin().await
        }

        async fn commit(&self, tx: MemoryTx) -> Result<(), StoreError> {
            self.0.commit(tx).await
        }

        async fn rollback(&self, tx: MemoryTx) {
            self.0.rollback(tx).await;
        }

        async fn advance(&self, by: Duration) {
            self.0.advance(by).await;
        }

        async fn abandon(&self, store: &Self::Store, claim: &ClaimHandle) -> bool {
            self.0.abandon(store.inner(), claim).await
        }
    }

    outbox_testkit::outbox_conformance_tests!(async { Wrapped(MemoryOutboxHarness::new()) });
}

mockall::mock! {
    HoldLimited {}
    #[outbox_core::async_trait]
    impl AppendStore for HoldLimited {
        type Tx = ();
        async fn append(&self, tx: &mut (), events: &[Envelope]) -> Result<(), outbox_core::StoreError>;
    }
    #[outbox_core::async_trait]
    impl RelayStore for HoldLimited {
        async fn claim(&self, request: &outbox_core::ClaimRequest) -> Result<outbox_core::ClaimedBatch, outbox_core::StoreError>;
        async fn complete(&self, claim: &outbox_core::ClaimHandle, outcomes: &[outbox_core::Outcome]) -> Result<outbox_core::CompletionReport, outbox_core::StoreError>;
        async fn release(&self, claim: &outbox_core::ClaimHandle) -> Result<(), outbox_core::StoreError>;
        fn claim_mode(&self) -> ClaimMode;
        fn locked_claim_timeout(&self) -> Option<Duration>;
    }
    #[outbox_core::async_trait]
    impl OperatorStore for HoldLimited {
        async fn list_parked(&self, limit: usize) -> Result<Vec<outbox_core::ParkedEvent>, outbox_core::StoreError>;
        async fn parked_event(&self, event_id: outbox_core::EventId) -> Result<outbox_core::ParkedEvent, outbox_core::StoreError>;
        async fn retry_parked(&self, event_id: outbox_core::EventId, actor: &str) -> Result<(), outbox_core::StoreError>;
        async fn discard_parked(&self, event_id: outbox_core::EventId, actor: &str, reason: &str) -> Result<(), outbox_core::StoreError>;
        async fn reissue_parked(&self, event_id: outbox_core::EventId, actor: &str, reason: &str) -> Result<outbox_core::EventId, outbox_core::StoreError>;
        async fn audit_trail(&self, event_id: Option<outbox_core::EventId>) -> Result<Vec<outbox_core::AuditEntry>, outbox_core::StoreError>;
        async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, outbox_core::StoreError>;
    }
    #[outbox_core::async_trait]
    impl MaintenanceStore for HoldLimited {
        async fn cleanup(&self, retention: Duration, batch_size: usize) -> Result<outbox_core::CleanupReport, outbox_core::StoreError>;
        async fn stats(&self) -> Result<outbox_core::OutboxStats, outbox_core::StoreError>;
    }
}

/// The wrapper reports the inner store's hold limit for locked claims (PostgreSQL's
/// `idle_in_transaction_session_timeout`), so `Relay::new` still refuses a publication that
/// could outlive it when the store is wrapped.
#[test]
fn the_wrapper_reports_the_inner_stores_hold_limit() {
    let mut inner = MockHoldLimited::new();
    inner
        .expect_claim_mode()
        .return_const(ClaimMode::LockedTransaction);
    inner
        .expect_locked_claim_timeout()
        .return_const(Some(Duration::from_secs(10)));
    let store = BackpressureStore::new(
        inner,
        Arc::new(Backpressure::new(BackpressurePolicy::default())),
    );
    assert_eq!(store.locked_claim_timeout(), Some(Duration::from_secs(10)));
    // A 30 s delivery timeout does not fit in a 10 s hold.
    let log = outbox_testkit::MemoryLog::builder()
        .topic("t", 1)
        .default_topic("t")
        .delivery_timeout(Duration::from_secs(30))
        .build();
    let relay = outbox_core::Relay::new(
        store,
        log,
        outbox_core::RelayConfig::builder().build().unwrap(),
        Arc::new(outbox_core::SystemClock),
        Box::new(<rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(1)),
    );
    let err = relay.expect_err("the hold limit is checked");
    assert!(err.to_string().contains("locked claim after 10s"), "{err}");
}
