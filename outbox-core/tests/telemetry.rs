//! Metrics and logs of a relay cycle: the documented series are emitted, and logs carry ids and
//! stages but never the payload.

mod common;

use common::{cycle, setup};
use outbox_core::prelude::*;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;

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
            .any(|(l, v)| l.contains(&"kind=other".to_string())
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
        find("outbox_oldest_claimable_age_seconds", MetricKind::Gauge).len(),
        1
    );
}
