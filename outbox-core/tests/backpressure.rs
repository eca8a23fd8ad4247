//! `BackpressureStore` over a real store (the in-memory one): the gate refreshed from the
//! store's stats refuses non-critical appends above the threshold and lets critical ones in;
//! below it, everything goes in; refused appends write nothing.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::backpressure::{
    Backpressure, BackpressurePolicy, BackpressureStore, CRITICAL_HEADER,
};
use outbox_core::{ClaimMode, Envelope, OutboxStore, StoreErrorKind};
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
