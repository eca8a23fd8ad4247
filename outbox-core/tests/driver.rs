//! The tokio driver over the in-memory backends: wake-ups cut idle sleeps short, shutdown stops
//! the loop and leaves nothing claimed.

#![cfg(feature = "tokio")]

use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, Relay, RelayConfig, SystemClock};
use outbox_testkit::{MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

async fn append(db: &MemoryDb, store: &MemoryOutboxStore, agg: &str, v: i64) {
    let mut tx = db.begin();
    let e = Envelope::builder("t", agg, v, "t.happened")
        .build()
        .unwrap();
    store.append(&mut tx, &[e]).await.unwrap();
    tx.commit().unwrap();
}

/// A relay over `store` and `log` whose idle sleeps all last `idle`.
fn relay<S: outbox_core::RelayStore + Clone>(
    store: &S,
    log: &MemoryLog,
    idle: Duration,
) -> Relay<S, MemoryLog> {
    let cfg = RelayConfig::builder()
        .owner("driver-test")
        .idle(idle, idle)
        .build()
        .unwrap();
    Relay::new(
        store.clone(),
        log.clone(),
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(1)),
    )
    .unwrap()
}

#[tokio::test]
async fn wakeup_cuts_a_long_idle_sleep_short_and_shutdown_stops() {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let log = MemoryLog::new("t", 2);
    append(&db, &store, "a", 1).await;

    // Idle sleeps of 120 s: without the wake-up, the second event would wait that long.
    let r = relay(&store, &log, Duration::from_secs(120));
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_core::driver::run(
        r,
        Some(wake.clone()),
        async move {
            let _ = stop_rx.await;
        },
    ));

    wait_for(|| log.all_records().len() == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await; // the driver is now in its long sleep
    append(&db, &store, "b", 1).await;
    wake.notify_one();
    wait_for(|| log.all_records().len() == 2).await;

    stop_tx.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("driver stops on shutdown")
        .unwrap();
    assert_eq!(report.published, 2);
    assert_eq!(report.errors, 0);
    assert_eq!(store.open_claims(), 0, "nothing left claimed");
}

#[tokio::test]
async fn shutdown_during_idle_sleep_returns_promptly() {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::new("t", 1);
    let r = relay(&store, &log, Duration::from_secs(300));
    let report = tokio::time::timeout(
        Duration::from_secs(10),
        outbox_core::driver::run(r, None, tokio::time::sleep(Duration::from_millis(50))),
    )
    .await
    .expect("a 300 s idle sleep must not delay shutdown");
    assert!(report.cycles >= 1);
    assert_eq!(report.published, 0);
}

/// Polls `cond` for up to 10 s (a generous bound: the point is the 120 s alternative).
async fn wait_for(cond: impl Fn() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached within 10 s");
}

#[tokio::test]
async fn a_failed_completion_is_counted_backed_off_and_the_event_republished() {
    use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyStore};
    let db = MemoryDb::new(SystemClock);
    let inner = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    append(&db, &inner, "a", 1).await;
    // The first completion fails (connection lost): the claim's transaction rolls back.
    let faults =
        FaultInjector::new(FaultSource::script([Some(Fault::Transient)])).only(&["complete"]);
    let store = FaultyStore::memory(inner.clone(), faults);
    let log = MemoryLog::new("t", 1);
    let cfg = RelayConfig::builder()
        .owner("driver-test")
        .idle(Duration::from_millis(5), Duration::from_millis(5))
        .build()
        .unwrap();
    let relay = Relay::new(
        store,
        log.clone(),
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(2)),
    )
    .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_core::driver::run(relay, None, async move {
        let _ = stop_rx.await;
    }));
    wait_for(|| {
        inner
            .snapshot()
            .iter()
            .all(|r| r.status == outbox_core::DeliveryStatus::Published)
    })
    .await;
    stop_tx.send(()).unwrap();
    let report = task.await.unwrap();
    assert_eq!(report.errors, 1, "the failed cycle is counted");
    assert_eq!(report.published, 1);
    // Published by the broker in both cycles: a duplicate, never a loss.
    assert_eq!(log.all_records().len(), 2);
}

/// A broker that is down: every record of every batch fails in the transport after a delay.
struct DownBroker;

#[outbox_core::async_trait]
impl outbox_core::Publisher for DownBroker {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<outbox_core::PublishResult> {
        tokio::time::sleep(Duration::from_millis(200)).await;
        batch
            .iter()
            .map(|_| {
                Err(outbox_core::PublishError::new(
                    outbox_core::PublishErrorKind::Timeout,
                    "broker down",
                )
                .with_scope(outbox_core::FailureScope::Transport))
            })
            .collect()
    }
    fn delivery_timeout(&self) -> Duration {
        Duration::from_secs(1)
    }
}

/// Shutdown that completes while a cycle publishes, and a cycle that opens the circuit breaker:
/// the driver stops without waiting the pause and without polling the finished shutdown future
/// again (an `async` block panics when resumed after completion).
#[tokio::test]
async fn shutdown_during_a_cycle_that_opens_the_circuit_stops_the_driver() {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    append(&db, &store, "a", 1).await;
    let cfg = RelayConfig::builder()
        .owner("driver-test")
        .circuit_breaker(Duration::from_secs(60), Duration::from_secs(60))
        .build()
        .unwrap();
    let relay = Relay::new(
        store.clone(),
        DownBroker,
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(3)),
    )
    .unwrap();
    let report = tokio::time::timeout(
        Duration::from_secs(10),
        outbox_core::driver::run(relay, None, async {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }),
    )
    .await
    .expect("the driver stops instead of waiting the 60 s pause");
    assert_eq!(report.cycles, 1);
    assert_eq!(report.published, 0);
    assert_eq!(store.open_claims(), 0, "nothing left claimed");
}

/// The report counts every event parked: by a failed publication and by a claim (a version at
/// or below the last published one is parked out of order when claimed).
#[tokio::test]
async fn the_report_counts_events_parked_by_publication_and_by_claim() {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let log = MemoryLog::new("t", 1);
    append(&db, &store, "a", 1).await;
    let bad = Envelope::builder("t", "bad", 1, "t.happened")
        .build()
        .unwrap();
    log.fail_event(bad.event_id, outbox_core::PublishErrorKind::RecordTooLarge);
    let mut tx = db.begin();
    store.append(&mut tx, &[bad]).await.unwrap();
    tx.commit().unwrap();
    let r = relay(&store, &log, Duration::from_millis(5));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_core::driver::run(r, None, async move {
        let _ = stop_rx.await;
    }));
    let parked = || {
        store
            .snapshot()
            .iter()
            .filter(|r| r.status == outbox_core::DeliveryStatus::Parked)
            .count()
    };
    wait_for(|| parked() == 1 && log.all_records().len() == 1).await;
    // A second version 1 of "a" arrives after version 1 was published: out of order.
    append(&db, &store, "a", 1).await;
    wait_for(|| parked() == 2).await;
    stop_tx.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("driver stops on shutdown")
        .unwrap();
    assert_eq!((report.published, report.parked, report.errors), (1, 2, 0));
    assert!(report.cycles >= 2);
}

/// The driver reads the store's statistics into the gauges when it starts (and every 5 s
/// after): a relay's dashboards have figures from its first cycle.
#[tokio::test(flavor = "current_thread")]
async fn the_driver_records_the_outbox_gauges_at_start() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Thread-local: the current-thread runtime runs the driver on this thread.
    let _guard = metrics::set_default_local_recorder(&recorder);
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::new("t", 1);
    for v in 1..=3 {
        append(&db, &store, &format!("g{v}"), 1).await;
    }
    let r = relay(&store, &log, Duration::from_millis(10));
    let report =
        outbox_core::driver::run(r, None, tokio::time::sleep(Duration::from_millis(100))).await;
    assert_eq!(report.published, 3);
    let unpublished: Vec<DebugValue> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, _, _, _)| k.key().name() == "outbox_unpublished")
        .map(|(_, _, _, v)| v)
        .collect();
    // Read before the first cycle: the three events were still unpublished.
    assert_eq!(unpublished.len(), 1, "{unpublished:?}");
    assert!(
        matches!(unpublished[0], DebugValue::Gauge(g) if g.into_inner() == 3.0),
        "{unpublished:?}"
    );
}

/// The in-memory store, whose claims can be held after they ran (a claim whose round trip and
/// commit are still under way while events commit), and whose statistics read can hang (one
/// stuck behind a lock, or slow on a large table).
#[derive(Clone)]
struct HeldClaims {
    inner: MemoryOutboxStore,
    /// Hold the next claim after it ran, until `release` is notified.
    hold: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
    claims: Arc<std::sync::atomic::AtomicUsize>,
    /// `stats` never returns.
    hang_stats: bool,
    /// `stats` reads started.
    stats_reads: Arc<std::sync::atomic::AtomicUsize>,
}

impl HeldClaims {
    /// Over `inner`, holding nothing, hanging nothing.
    fn over(inner: &MemoryOutboxStore) -> Self {
        Self {
            inner: inner.clone(),
            hold: Arc::default(),
            held: Arc::default(),
            release: Arc::default(),
            claims: Arc::default(),
            hang_stats: false,
            stats_reads: Arc::default(),
        }
    }
}

#[outbox_core::async_trait]
impl outbox_core::RelayStore for HeldClaims {
    async fn claim(
        &self,
        request: &outbox_core::ClaimRequest,
    ) -> Result<outbox_core::ClaimedBatch, outbox_core::StoreError> {
        let batch = self.inner.claim(request).await;
        self.claims
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.hold.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.held.notify_one();
            self.release.notified().await;
        }
        batch
    }
    async fn complete(
        &self,
        claim: &outbox_core::ClaimHandle,
        outcomes: &[outbox_core::Outcome],
    ) -> Result<outbox_core::CompletionReport, outbox_core::StoreError> {
        self.inner.complete(claim, outcomes).await
    }
    async fn release(
        &self,
        claim: &outbox_core::ClaimHandle,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.release(claim).await
    }
    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }
}

#[outbox_core::async_trait]
impl outbox_core::MaintenanceStore for HeldClaims {
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<outbox_core::CleanupReport, outbox_core::StoreError> {
        self.inner.cleanup(retention, batch_size).await
    }
    async fn stats(&self) -> Result<outbox_core::OutboxStats, outbox_core::StoreError> {
        self.stats_reads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.hang_stats {
            std::future::pending::<()>().await;
        }
        self.inner.stats().await
    }
}

/// A wake-up that arrives while a cycle runs (here: its claim already ran and came back empty,
/// and the event commits before the cycle ends) is not lost: the claim after that cycle comes
/// at once, not after the idle sleep (an hour here, the fallback polling period).
#[tokio::test]
async fn a_wakeup_during_a_cycle_starts_the_next_claim_when_the_cycle_ends() {
    let db = MemoryDb::new(SystemClock);
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let store = HeldClaims {
        hold: Arc::new(true.into()),
        ..HeldClaims::over(&inner)
    };
    let log = MemoryLog::new("t", 1);
    let r = relay(&store, &log, Duration::from_secs(3600));
    let wake = Arc::new(tokio::sync::Notify::new());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_core::driver::run(
        r,
        Some(wake.clone()),
        async move {
            let _ = stop_rx.await;
        },
    ));

    // The first cycle's claim found nothing and is held: the cycle is still running.
    tokio::time::timeout(Duration::from_secs(10), store.held.notified())
        .await
        .expect("the first claim ran");
    append(&db, &inner, "a", 1).await;
    wake.notify_one(); // as the LISTEN task does after the commit's NOTIFY
    store.release.notify_one();

    // Within seconds (wait_for's bound), not the hour of the idle sleep.
    wait_for(|| log.all_records().len() == 1).await;
    assert!(store.claims.load(std::sync::atomic::Ordering::SeqCst) >= 2);
    stop_tx.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("driver stops on shutdown")
        .unwrap();
    assert_eq!(report.published, 1);
    assert_eq!(inner.open_claims(), 0, "nothing left claimed");
}

/// The driver's statistics read (for the gauges) runs beside the cycles: one that never
/// returns holds no claim back, neither at start nor later, and is not doubled when the next
/// read is due (5 s) while it still runs.
#[tokio::test]
async fn a_statistics_read_that_hangs_holds_no_claim_back() {
    let db = MemoryDb::new(SystemClock);
    let inner = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30)).unwrap());
    let store = HeldClaims {
        hang_stats: true,
        ..HeldClaims::over(&inner)
    };
    let log = MemoryLog::new("t", 1);
    append(&db, &inner, "a", 1).await;
    let r = relay(&store, &log, Duration::from_millis(10));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(outbox_core::driver::run(r, None, async move {
        let _ = stop_rx.await;
    }));
    wait_for(|| log.all_records().len() == 1).await;
    // Past the next read's due time (5 s after the first): events keep flowing meanwhile.
    for v in 2..=7 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        append(&db, &inner, "a", v).await;
        wait_for(|| log.all_records().len() == v as usize).await;
    }
    assert_eq!(
        store.stats_reads.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one read at start, still running: not started again"
    );
    stop_tx.send(()).unwrap();
    let report = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("driver stops on shutdown")
        .unwrap();
    assert_eq!(report.published, 7);
    assert_eq!(inner.open_claims(), 0, "nothing left claimed");
}
