//! Shared by the telemetry and logs tests: one relay cycle with a published, a retried and a
//! parked event, and a log capture.
#![allow(dead_code)]

use std::sync::Arc;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, PublishErrorKind, Relay, RelayConfig, SystemClock};
use outbox_testkit::{MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

pub(crate) const SECRET: &str = "4111-1111-1111-1111";

pub(crate) fn setup() -> (MemoryOutboxStore, MemoryLog, MemoryDb) {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::builder()
        .topic("t", 1)
        .default_topic("t")
        .max_record_bytes(4096)
        .build();
    (store, log, db)
}

pub(crate) async fn cycle(store: &MemoryOutboxStore, log: &MemoryLog, db: &MemoryDb) {
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
    log.fail_event(flaky.event_id, PublishErrorKind::Other);
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

/// Runs `f` with a `fmt` subscriber at `level` writing into a buffer; returns what it wrote.
pub(crate) fn capture_logs(level: tracing::Level, f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(level)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let out = buf.0.lock().unwrap().clone();
    String::from_utf8(out).unwrap()
}
