//! Metrics and logs of a relay cycle: the documented series are emitted, and logs carry ids and
//! stages but never the payload.

use std::io::Write;
use std::sync::{Arc, Mutex};

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use outbox_core::{
    ClaimMode, Envelope, OutboxStore, PublishErrorKind, Relay, RelayConfig, SystemClock,
};
use outbox_testkit::{MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

const SECRET: &str = "4111-1111-1111-1111";

fn setup() -> (MemoryOutboxStore, MemoryLog, MemoryDb) {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::builder()
        .topic("t", 1)
        .default_topic("t")
        .max_record_bytes(4096)
        .build();
    (store, log, db)
}

async fn cycle(store: &MemoryOutboxStore, log: &MemoryLog, db: &MemoryDb) {
    let mut tx = db.begin();
    let ok = Envelope::builder("card", "c-1", 1, "card.added")
        .json(&serde_json::json!({ "number": SECRET }))
        .unwrap()
        .build()
        .unwrap();
    let flaky = Envelope::builder("card", "c-2", 1, "card.added")
        .build()
        .unwrap();
    let big = Envelope::builder("card", "c-3", 1, "card.added")
        .json(&serde_json::json!({ "number": SECRET, "pad": "x".repeat(5000) }))
        .unwrap()
        .build()
        .unwrap();
    log.fail_event(flaky.event_id, PublishErrorKind::Timeout);
    store.append(&mut tx, &[ok, flaky, big]).await.unwrap();
    tx.commit().unwrap();
    let cfg = RelayConfig::builder().owner("telemetry").build().unwrap();
    let mut relay = Relay::new(
        store.clone(),
        log.clone(),
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(3)),
    )
    .unwrap();
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.published, report.retried, report.parked), (1, 1, 1));
}

#[test]
fn a_cycle_emits_the_documented_metrics() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (store, log, db) = setup();
    metrics::with_local_recorder(&recorder, || {
        futures::executor::block_on(cycle(&store, &log, &db));
        outbox_core::telemetry::record_stats(&futures::executor::block_on(store.stats()).unwrap());
    });
    let snap = snapshotter.snapshot().into_vec();
    let find = |name: &str, kind: MetricKind| {
        snap.iter()
            .filter(|(k, _, _, _)| k.key().name() == name && k.kind() == kind)
            .map(|(k, _, _, v)| {
                (
                    k.key()
                        .labels()
                        .map(|l| format!("{}={}", l.key(), l.value()))
                        .collect::<Vec<_>>(),
                    v,
                )
            })
            .collect::<Vec<_>>()
    };
    assert!(matches!(
        find("outbox_published_total", MetricKind::Counter)[..],
        [(_, DebugValue::Counter(1))]
    ));
    let failures = find("outbox_publish_failures_total", MetricKind::Counter);
    assert!(
        failures
            .iter()
            .any(|(l, v)| l.contains(&"kind=timeout".to_string())
                && l.contains(&"class=transient".to_string())
                && matches!(v, DebugValue::Counter(1))),
        "{failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|(l, _)| l.contains(&"kind=record_too_large".to_string())),
        "{failures:?}"
    );
    let parked = find("outbox_parked_total", MetricKind::Counter);
    assert!(
        parked
            .iter()
            .any(|(l, v)| l.contains(&"kind=permanent_error".to_string())
                && matches!(v, DebugValue::Counter(1))),
        "{parked:?}"
    );
    assert_eq!(
        find("outbox_publish_latency_seconds", MetricKind::Histogram).len(),
        1
    );
    assert_eq!(
        find("outbox_relay_batch_size", MetricKind::Histogram).len(),
        1
    );
    assert!(
        matches!(find("outbox_parked", MetricKind::Gauge)[..], [(_, DebugValue::Gauge(v))] if v.into_inner() == 1.0)
    );
    assert!(
        matches!(find("outbox_unpublished", MetricKind::Gauge)[..], [(_, DebugValue::Gauge(v))] if v.into_inner() == 1.0)
    );
    assert_eq!(
        find("outbox_oldest_unpublished_age_seconds", MetricKind::Gauge).len(),
        1
    );
}

#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);
impl Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn logs_carry_ids_and_stages_but_never_the_payload() {
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let (store, log, db) = setup();
    tracing::subscriber::with_default(subscriber, || {
        futures::executor::block_on(cycle(&store, &log, &db));
    });
    let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
    assert!(out.contains("stage=\"parked\""), "{out}");
    assert!(out.contains("stage=\"retry\""), "{out}");
    assert!(out.contains("stage=\"published\""), "{out}");
    assert!(out.contains("aggregate_id=c-3"), "{out}");
    assert!(out.contains("event_id="), "{out}");
    assert!(out.contains("attempt=1"), "{out}");
    assert!(!out.contains(SECRET), "payload leaked into logs:\n{out}");
}
