//! Several `outbox_core::Relay`s on one PostgreSQL backlog, and a relay that crashes between
//! claim and complete. Each test uses its own schema; needs PostgreSQL (see `common`).

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimMode, ClaimedBatch, Envelope, EventId, PublishError,
    PublishErrorKind, PublishResult, Publisher, Relay, RelayConfig, RetryPolicy, SystemClock,
};
use outbox_postgres::PostgresOutboxStore;
use rand::SeedableRng;

use common::event;

/// What the broker saw.
#[derive(Default)]
struct Log {
    /// Successful publications, in acknowledgement order: (event, aggregate, version, relay).
    acked: Vec<(EventId, String, i64, String)>,
    /// Aggregates being published right now, by relay.
    in_flight: HashMap<String, String>,
    /// Violations seen: two relays publishing one aggregate at once.
    overlaps: Vec<String>,
    /// Attempts per event (to fail the first attempt of some events).
    attempts: HashMap<EventId, u32>,
}

#[derive(Clone)]
struct RecordingPublisher {
    name: String,
    log: Arc<Mutex<Log>>,
    offset: Arc<AtomicUsize>,
}

#[async_trait]
impl Publisher for RecordingPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        {
            let mut log = self.log.lock().unwrap();
            for e in batch {
                if let Some(other) = log
                    .in_flight
                    .insert(e.aggregate_id.clone(), self.name.clone())
                {
                    log.overlaps.push(format!(
                        "{} published by {} while {} had it in flight",
                        e.aggregate_id, self.name, other
                    ));
                }
            }
        }
        // Broker latency: lets other relays run in between.
        tokio::time::sleep(Duration::from_millis(3)).await;
        let mut log = self.log.lock().unwrap();
        let mut out = Vec::with_capacity(batch.len());
        for e in batch {
            log.in_flight.remove(&e.aggregate_id);
            let n = log.attempts.entry(e.event_id).or_default();
            *n += 1;
            // Every 7th version fails transiently on its first attempt.
            if e.aggregate_version % 7 == 3 && *n == 1 {
                out.push(Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "injected timeout",
                )));
                continue;
            }
            log.acked.push((
                e.event_id,
                e.aggregate_id.clone(),
                e.aggregate_version,
                self.name.clone(),
            ));
            out.push(Ok(AckMetadata {
                topic: "orders".into(),
                partition: 0,
                offset: self.offset.fetch_add(1, Ordering::Relaxed) as i64,
            }));
        }
        out
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_millis(500)
    }
}

fn relay<P: Publisher>(
    store: PostgresOutboxStore,
    publisher: P,
    owner: &str,
    seed: u64,
) -> Relay<PostgresOutboxStore, P> {
    let config = RelayConfig::builder()
        .owner(owner)
        .batch_size(50)
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .lease_margin(outbox_core::MIN_LEASE_MARGIN)
        .retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(5))
                .max_delay(Duration::from_millis(20))
                .max_attempts(50)
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    Relay::new(
        store,
        publisher,
        config,
        Arc::new(SystemClock),
        Box::new(rand::rngs::StdRng::seed_from_u64(seed)),
    )
    .expect("relay config")
}

/// Checks the broker log: every expected event acknowledged exactly once, per-aggregate
/// order, no overlapping publications of one aggregate.
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

async fn many_relays_on_one_backlog(mode: ClaimMode, relays: usize) {
    let ctx = ctx!(4 + 3 * relays as u32);
    let store = ctx.store(mode).await;
    let (aggs, versions) = (40, 20);
    // Preload versions 1..=15 interleaved across aggregates.
    let mut all = Vec::new();
    for v in 1..=15 {
        for a in 0..aggs {
            all.push(event(&format!("agg-{a}"), v));
        }
    }
    store.append_many(&ctx.pool, &all).await.unwrap();

    let log = Arc::new(Mutex::new(Log::default()));
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = store.spawn_listener(wake.clone()).unwrap();
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut tasks = Vec::new();
    for r in 0..relays {
        let publisher = RecordingPublisher {
            name: format!("relay-{r}"),
            log: log.clone(),
            offset: Arc::new(AtomicUsize::new(0)),
        };
        // Each relay has its own store instance (as separate processes would).
        let relay = relay(
            ctx.store(mode).await,
            publisher,
            &format!("relay-{r}"),
            r as u64,
        );
        let mut stop = stop_tx.subscribe();
        tasks.push(tokio::spawn(outbox_core::driver::run(
            relay,
            Some(wake.clone()),
            async move {
                let _ = stop.recv().await;
            },
        )));
    }
    // Meanwhile producers append versions 16..=20: one transaction per aggregate and version,
    // transactions of different aggregates overlap and commit out of id order.
    let mut late = Vec::new();
    for v in 16..=versions {
        for group in (0..aggs).collect::<Vec<_>>().chunks(5) {
            let mut open = Vec::new();
            for a in group {
                let e = event(&format!("agg-{a}"), v);
                let mut tx = ctx.pool.begin().await.unwrap();
                store.append(&mut *tx, &e).await.unwrap();
                open.push(tx);
                late.push(e);
            }
            // Commit in reverse order: higher ids first.
            while let Some(tx) = open.pop() {
                tx.commit().await.unwrap();
            }
        }
    }
    all.extend(late);

    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let done = log.lock().unwrap().acked.len();
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
    let _ = stop_tx.send(());
    let mut published_by = 0;
    for t in tasks {
        let report = tokio::time::timeout(Duration::from_secs(10), t)
            .await
            .expect("driver stops")
            .unwrap();
        assert_eq!(report.errors, 0, "no failed cycles");
        if report.published > 0 {
            published_by += 1;
        }
    }
    listener.abort();
    check_log(&log.lock().unwrap(), &all);
    assert!(published_by >= 2, "the work was shared between relays");
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.unpublished, 0);
    assert_eq!(stats.in_flight, 0);
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_lease_relays_keep_order_and_publish_everything_once() {
    many_relays_on_one_backlog(ClaimMode::lease(Duration::from_secs(30)).unwrap(), 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_locked_relays_keep_order_and_publish_everything_once() {
    many_relays_on_one_backlog(ClaimMode::LockedTransaction, 3).await;
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

async fn crashed_relay_work_is_finished_by_another(mode: ClaimMode) {
    let ctx = ctx!(8);
    let build = |hold: Duration| {
        PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .claim_mode(mode)
            .locked_max_hold(hold)
            .build()
            .unwrap()
    };
    let store = build(Duration::from_secs(60));
    store.migrate().await.unwrap();
    let evs: Vec<_> = (0..30)
        .map(|i| event(&format!("c{}", i % 10), i / 10 + 1))
        .collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();

    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // The crashing relay has its own store instance (its own process, in real life).
    let mut doomed = relay(
        build(Duration::from_secs(3)),
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
        .unwrap();
    assert_eq!(claimed.len(), 10, "one head per aggregate");
    task.abort();
    let _ = task.await;

    let log = Arc::new(Mutex::new(Log::default()));
    let publisher = RecordingPublisher {
        name: "survivor".into(),
        log: log.clone(),
        offset: Arc::new(AtomicUsize::new(0)),
    };
    let mut survivor = relay(store.clone(), publisher, "survivor", 2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while log.lock().unwrap().acked.len() < evs.len() {
        assert!(Instant::now() < deadline, "the survivor did not finish");
        let report = survivor.run_once().await.expect("cycle");
        if report.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    {
        let log = log.lock().unwrap();
        check_log(&log, &evs);
        let first_acked: HashSet<EventId> = log.acked.iter().take(10).map(|a| a.0).collect();
        assert_eq!(
            first_acked,
            claimed.into_iter().collect(),
            "the crashed relay's heads are published first, by the survivor"
        );
    }
    let _: ClaimedBatch = store
        .claim(&outbox_core::ClaimRequest::new("check", 10))
        .await
        .unwrap();
    assert_eq!(store.stats().await.unwrap().unpublished, 0);
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_claim_and_complete_lease() {
    crashed_relay_work_is_finished_by_another(
        ClaimMode::lease(Duration::from_millis(1800)).unwrap(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_claim_and_complete_locked() {
    crashed_relay_work_is_finished_by_another(ClaimMode::LockedTransaction).await;
}
