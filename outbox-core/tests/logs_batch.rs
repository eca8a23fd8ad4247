//! The relay's batch-level warnings: "failed on their own" when some events are retried (each
//! failure kind named once), "part of the batch failed in the transport" only when a batch is
//! partly deferred and partly acknowledged. Operators alert on these lines.
//!
//! Alone in its test binary (one test): tracing caches callsite interest process-wide.

mod common;

use std::sync::Arc;

use common::capture_logs;
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, PublishErrorKind, Relay, RelayConfig, SystemClock};
use outbox_testkit::{MemoryDb, MemoryLog, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

const RETRIED: &str = "events of the batch failed on their own and will be retried";
const PARTLY: &str = "part of the batch failed in the transport";

/// One relay cycle over three events of three aggregates; `fail[i]` makes event `i` fail
/// with that kind. Returns the cycle's WARN lines.
fn warnings(fail: [Option<PublishErrorKind>; 3]) -> Vec<String> {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(&db, ClaimMode::LockedTransaction);
    let log = MemoryLog::builder()
        .topic("t", 1)
        .default_topic("t")
        .build();
    let events: Vec<Envelope> = (0..3)
        .map(|i| {
            Envelope::builder("card", format!("c-{i}"), 1, "card.added")
                .build()
                .unwrap()
        })
        .collect();
    for (e, f) in events.iter().zip(fail) {
        if let Some(kind) = f {
            log.fail_event(e.event_id, kind);
        }
    }
    let mut tx = db.begin();
    futures::executor::block_on(store.append(&mut tx, &events)).unwrap();
    tx.commit().unwrap();
    let cfg = RelayConfig::builder().owner("logs").build().unwrap();
    let mut relay = Relay::new(
        store,
        log,
        cfg,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(3)),
    )
    .unwrap();
    let out = capture_logs(tracing::Level::WARN, || {
        futures::executor::block_on(relay.run_once()).unwrap();
    });
    out.lines().map(str::to_owned).collect()
}

fn count(lines: &[String], what: &str) -> usize {
    lines.iter().filter(|l| l.contains(what)).count()
}

#[test]
fn batch_warnings_name_what_happened_to_the_batch() {
    use PublishErrorKind::{BrokerUnavailable, Other, RecordTooLarge};

    // Two events failed on their own with the same kind: one warning, the kind named once.
    let w = warnings([Some(Other), Some(Other), None]);
    assert_eq!(count(&w, RETRIED), 1, "{w:#?}");
    assert!(
        w.iter()
            .any(|l| l.contains(RETRIED) && l.contains(r#"kinds=["other"]"#)),
        "{w:#?}"
    );
    assert_eq!(count(&w, PARTLY), 0, "{w:#?}");

    // Everything acknowledged: no batch warning.
    let w = warnings([None, None, None]);
    assert_eq!((count(&w, RETRIED), count(&w, PARTLY)), (0, 0), "{w:#?}");

    // A permanent failure parks (no retry warning; the park has its own ERROR line).
    let w = warnings([Some(RecordTooLarge), None, None]);
    assert_eq!((count(&w, RETRIED), count(&w, PARTLY)), (0, 0), "{w:#?}");

    // One event deferred by the transport, the others acknowledged: the "partly" warning.
    let w = warnings([Some(BrokerUnavailable), None, None]);
    assert_eq!((count(&w, RETRIED), count(&w, PARTLY)), (0, 1), "{w:#?}");

    // The whole batch deferred: the circuit breaker's warning, not the "partly" one.
    let w = warnings([
        Some(BrokerUnavailable),
        Some(BrokerUnavailable),
        Some(BrokerUnavailable),
    ]);
    assert_eq!((count(&w, RETRIED), count(&w, PARTLY)), (0, 0), "{w:#?}");
    assert!(
        w.iter().any(|l| l.contains("pausing publication")),
        "{w:#?}"
    );
}
