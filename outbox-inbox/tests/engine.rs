//! Engine tests over the in-memory backends (and a scripted source where the order of calls
//! matters): parking, versions, concurrency and the watermark, rewinds, rebalances, retention,
//! cleanup and metrics.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{applied, effects_once, ev, fast, publish, Script};
use outbox_core::retention::{Strictness, TopicRetention};
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, wire, AckModel, CommitOffset, Envelope, ErrorClass, InboxParking, LogPosition,
    MessageSource, ParkKind, ParkedFilter, ParkedStatus, PartitionLag, ReceivedMessage,
    RetryPolicy, SourceError, TopicPartition,
};
use outbox_inbox::*;
use outbox_testkit::{ManualClock, MemoryDb, MemoryInboxStore, MemoryLog};

type MemEngine = ConsumerEngine<outbox_testkit::MemoryConsumer, MemoryInboxStore, Script>;

fn engine_on(
    log: &MemoryLog,
    db: &MemoryDb,
    script: &Script,
    policy: VersionPolicy,
    cfg: EngineConfig,
) -> MemEngine {
    let processor = InboxProcessor::new("proj", MemoryInboxStore::new(db), script.clone())
        .with_version_policy(policy);
    ConsumerEngine::new(log.consumer("proj", &["t"]), processor, cfg, 7).unwrap()
}

async fn parked(db: &MemoryDb) -> Vec<outbox_core::ParkedMessage> {
    MemoryInboxStore::new(db)
        .list_parked("proj", &ParkedFilter::open())
        .await
        .unwrap()
}

fn end(log: &MemoryLog, p: i32) -> i64 {
    log.end_offset("t", p)
}

// ---------------------------------------------------------------------------------------------
// Deduplication and batching

#[tokio::test]
async fn duplicates_are_absorbed_and_effects_applied_once() {
    for policy in [VersionPolicy::Reject, VersionPolicy::Unchecked] {
        let log = MemoryLog::new("t", 2);
        let db = MemoryDb::default();
        let script = Script::new();
        let (a, b) = (ev("a", 1), ev("b", 1));
        publish(&log, &[a.clone(), b.clone(), a.clone(), b.clone()]).await;
        let mut eng = engine_on(&log, &db, &script, policy, fast());
        let rep = eng
            .run_until_quiet(Duration::from_millis(30))
            .await
            .unwrap();
        assert_eq!(rep.applied, 2, "{policy:?}");
        // With versions tracked, a redelivered version is stale before it is a duplicate.
        assert_eq!(rep.duplicates + rep.stale, 2, "{policy:?}");
        assert_eq!(effects_once(&db), 2);
        assert!((rep.duplicate_share() - 0.5).abs() < 1e-9);
        for p in 0..2 {
            assert_eq!(log.committed("proj", "t", p), Some(end(&log, p)));
        }
    }
}

#[tokio::test]
async fn a_reissued_copy_of_an_applied_event_is_not_applied_again() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let original = ev("a", 1);
    let copy = Envelope::builder("order", "a", 1, "order.changed")
        .header(wire::ORIGINAL_EVENT_ID, original.event_id.to_string())
        .build()
        .unwrap();
    publish(&log, &[original.clone(), copy]).await;
    // Unchecked: only the inbox's dedup id can tell the copy from a new event.
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Unchecked, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.duplicates), (1, 1));
    assert_eq!(effects_once(&db), 1);
}

#[tokio::test]
async fn buffered_messages_are_applied_in_one_transaction() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let events: Vec<Envelope> = (0..10).map(|i| ev(&format!("a{i}"), 1)).collect();
    publish(&log, &events).await;
    let cfg = fast().with_concurrency(1);
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.received, rep.applied), (10, 10));
    assert_eq!(db.counters().committed, 1, "one transaction for the batch");
    assert_eq!(log.committed("proj", "t", 0), Some(10));
}

#[tokio::test]
async fn max_batch_one_uses_one_transaction_per_message() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let events: Vec<Envelope> = (0..4).map(|i| ev(&format!("a{i}"), 1)).collect();
    publish(&log, &events).await;
    let cfg = fast().with_concurrency(1).with_max_batch(1);
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Reject, cfg);
    eng.run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(db.counters().committed, 4);
}

#[test]
fn bad_config_is_rejected() {
    let bad = [
        EngineConfig::default().with_commit(0, Duration::from_secs(1)),
        EngineConfig::default().with_poll_timeout(Duration::ZERO),
        EngineConfig::default().with_max_batch(0),
        EngineConfig::default().with_concurrency(0),
        EngineConfig::default()
            .with_max_batch(100)
            .with_max_in_flight(10),
        EngineConfig::default().with_metrics_interval(Duration::ZERO),
        EngineConfig::default().with_cleanup(CleanupSchedule::new(Duration::ZERO)),
        EngineConfig::default()
            .with_cleanup(CleanupSchedule::new(Duration::from_secs(1)).batch_size(0)),
    ];
    for cfg in bad {
        assert!(cfg.validate().is_err(), "{cfg:?}");
    }
    assert!(EngineConfig::default().validate().is_ok());
    // The bound is inclusive: room for exactly one full batch is enough.
    assert!(EngineConfig::default()
        .with_max_batch(100)
        .with_max_in_flight(100)
        .validate()
        .is_ok());
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let p = InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new())
        .with_version_policy(VersionPolicy::hold(0, Duration::from_secs(1)));
    assert!(ConsumerEngine::new(log.consumer("g", &["t"]), p, EngineConfig::default(), 1).is_err());
}

// ---------------------------------------------------------------------------------------------
// Failures and parking

#[tokio::test]
async fn transient_handler_failures_are_retried_without_registering() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    *script.flaky_left.lock().unwrap() = 2;
    publish(&log, &[ev("flaky", 1)]).await;
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.retries, rep.parked), (1, 2, 0));
    assert_eq!(effects_once(&db), 1);
}

/// The poison message parks, its aggregate's later messages wait behind it, every other
/// aggregate flows, and the partition's committed offset reaches the end.
#[tokio::test]
async fn a_permanent_failure_parks_and_the_partition_continues() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(
        &log,
        &[
            ev("a", 1),
            ev("poison", 1),
            ev("b", 1),
            ev("poison", 2),
            ev("a", 2),
        ],
    )
    .await;
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.parked, rep.waiting), (3, 1, 1));
    assert_eq!(applied(&db, "a"), vec![1, 2]);
    assert_eq!(applied(&db, "b"), vec![1]);
    assert!(applied(&db, "poison").is_empty());
    assert_eq!(log.committed("proj", "t", 0), Some(5));
    let p = parked(&db).await;
    assert_eq!(p.len(), 2);
    assert_eq!(p[0].status, ParkedStatus::Parked);
    assert_eq!(p[0].kind, Some(ParkKind::Unprocessable));
    assert!(
        p[0].reason.contains("violates the schema"),
        "{}",
        p[0].reason
    );
    assert_eq!(p[0].attempts, 1, "a permanent failure is not retried");
    assert_eq!(p[0].record.position, LogPosition::new("t", 0, 1));
    assert_eq!(p[1].status, ParkedStatus::Waiting);
    assert_eq!(p[1].record.aggregate_version, Some(2));
    // Nothing of the poison is registered: an operator retry can still apply it.
    let inbox = MemoryInboxStore::new(&db);
    assert!(!inbox.is_registered("proj", p[0].record.dedup_id.unwrap()));
}

#[tokio::test]
async fn transient_failures_past_the_limit_park_with_their_attempts() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    *script.flaky_left.lock().unwrap() = 100;
    publish(&log, &[ev("flaky", 1), ev("ok", 1)]).await;
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.parked, rep.applied, rep.retries), (1, 1, 3));
    let p = parked(&db).await;
    assert_eq!(p[0].attempts, 4);
    assert!(p[0].reason.contains("4 time(s)"), "{}", p[0].reason);
    assert_eq!(log.committed("proj", "t", 0), Some(2));
}

/// A failing message in the middle of a batch: the part before it commits, it parks, the rest
/// is applied; nothing is applied twice.
#[tokio::test]
async fn a_failing_message_splits_its_batch() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("poison", 1), ev("b", 1)]).await;
    let cfg = fast().with_concurrency(1);
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.parked), (2, 1));
    assert_eq!(effects_once(&db), 2);
    assert_eq!(log.committed("proj", "t", 0), Some(3));
}

/// Records another producer wrote: no headers, garbage headers, a non-numeric version, an
/// empty value. Each parks with its raw record; one whose aggregate headers are readable blocks
/// that aggregate; the partition continues.
#[tokio::test]
async fn malformed_records_park_raw_and_the_partition_continues() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let good = ev("m", 1);
    let with = |name: &str, value: &[u8]| -> Vec<(String, Vec<u8>)> {
        wire::encode_headers(&ev("m", 2))
            .into_iter()
            .map(|(k, v)| {
                if k == name {
                    (k, value.to_vec())
                } else {
                    (k, v)
                }
            })
            .collect()
    };
    publish(&log, std::slice::from_ref(&good)).await;
    log.append_raw("t", 0, None, vec![], b"no headers".to_vec())
        .unwrap();
    log.append_raw(
        "t",
        0,
        Some(b"x".to_vec()),
        vec![("garbage".into(), vec![0xff, 0xfe])],
        b"{}".to_vec(),
    )
    .unwrap();
    let bad_version = with(wire::AGGREGATE_VERSION, b"two");
    log.append_raw(
        "t",
        0,
        Some(b"m".to_vec()),
        bad_version.clone(),
        b"{}".to_vec(),
    )
    .unwrap();
    publish(&log, &[ev("m", 3), ev("other", 1)]).await;
    log.append_raw("t", 0, None, vec![], Vec::new()).unwrap();
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(rep.applied, 2, "m v1 and other");
    assert_eq!(
        rep.parked, 4,
        "no headers, garbage, bad version, empty value"
    );
    assert_eq!(rep.waiting, 1, "m v3 waits behind the undecodable m v2");
    assert_eq!(log.committed("proj", "t", 0), Some(end(&log, 0)));
    let p = parked(&db).await;
    let bad = p
        .iter()
        .find(|m| m.record.position.offset == 3)
        .expect("bad version parked");
    assert!(bad.reason.contains("aggregate_version"), "{}", bad.reason);
    assert_eq!(
        bad.record.headers.len(),
        bad_version.len(),
        "raw headers kept"
    );
    assert_eq!(bad.record.value.as_deref(), Some(b"{}".as_slice()));
    assert_eq!(
        bad.record.aggregate,
        Some(outbox_core::AggregateKey::new("order", "m"))
    );
    let none = p
        .iter()
        .find(|m| m.record.position.offset == 1)
        .expect("no headers parked");
    assert_eq!(none.record.aggregate, None);
    assert_eq!(none.record.value.as_deref(), Some(b"no headers".as_slice()));
}

// ---------------------------------------------------------------------------------------------
// Versions

#[tokio::test]
async fn reject_parks_a_gap_and_skips_stale_versions() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let v1 = ev("a", 1);
    publish(
        &log,
        &[
            v1,
            ev("a", 2),
            ev("a", 2),
            ev("a", 1),
            ev("a", 4),
            ev("a", 5),
            ev("b", 1),
        ],
    )
    .await;
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(applied(&db, "a"), vec![1, 2]);
    assert_eq!(
        rep.stale, 2,
        "a v2 and a v1 again (new event ids, old versions)"
    );
    assert_eq!((rep.parked, rep.waiting), (1, 1));
    let p = parked(&db).await;
    assert_eq!(p[0].kind, Some(ParkKind::VersionGap));
    assert!(
        p[0].reason.contains("expected version 3, got 4"),
        "{}",
        p[0].reason
    );
    assert_eq!(log.committed("proj", "t", 0), Some(7));
}

#[tokio::test]
async fn hold_waits_for_the_missing_version_and_applies_in_order() {
    // v3 arrives on another topic partition before v2 (a producer that does not keep order).
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("a", 3), ev("b", 1), ev("a", 4)]).await;
    let policy = VersionPolicy::hold(100, Duration::from_secs(30));
    let mut eng = engine_on(&log, &db, &script, policy, fast());
    for _ in 0..50 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().held, 2, "v3 and v4 held");
    assert_eq!(applied(&db, "b"), vec![1], "other aggregates flow");
    assert_eq!(
        log.committed("proj", "t", 0),
        Some(1),
        "the committed offset waits at the first held message"
    );
    publish(&log, &[ev("a", 2)]).await;
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(applied(&db, "a"), vec![1, 2, 3, 4]);
    assert_eq!((rep.held, rep.parked), (0, 0));
    assert_eq!(log.committed("proj", "t", 0), Some(5));
}

#[tokio::test]
async fn hold_is_bounded_in_time_then_parks_the_gap() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("a", 3), ev("a", 4), ev("b", 1)]).await;
    let policy = VersionPolicy::hold(100, Duration::from_millis(50));
    let mut eng = engine_on(&log, &db, &script, policy, fast());
    let started = std::time::Instant::now();
    let rep = eng
        .run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(applied(&db, "a"), vec![1]);
    assert_eq!((rep.parked, rep.waiting, rep.held), (1, 1, 0));
    let p = parked(&db).await;
    assert_eq!(p[0].kind, Some(ParkKind::VersionGap));
    assert_eq!(p[0].record.aggregate_version, Some(3));
    assert!(p[0].reason.contains("did not close"), "{}", p[0].reason);
    assert_eq!(log.committed("proj", "t", 0), Some(4));
}

/// Held versions that arrived out of order are released lowest first: when the gap expires,
/// the lowest held version is the parked head and the higher one waits behind it (killed
/// surviving mutant: `Work::version` returning a constant, which left them in arrival order).
#[tokio::test]
async fn an_expired_gap_parks_the_lowest_held_version_first() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    publish(&log, &[ev("a", 1), ev("a", 4), ev("a", 3)]).await;
    let policy = VersionPolicy::hold(100, Duration::from_millis(40));
    let mut eng = engine_on(&log, &db, &Script::new(), policy, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(80))
        .await
        .unwrap();
    assert_eq!((rep.parked, rep.waiting, rep.held), (1, 1, 0));
    let p = parked(&db).await;
    let head = p.iter().find(|m| m.status == ParkedStatus::Parked).unwrap();
    let waiting = p
        .iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .unwrap();
    assert_eq!(
        (
            head.record.aggregate_version,
            waiting.record.aggregate_version
        ),
        (Some(3), Some(4))
    );
    assert_eq!(head.kind, Some(ParkKind::VersionGap));
}

#[tokio::test]
async fn hold_is_bounded_in_count() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let mut events = vec![ev("a", 1), ev("b", 1)];
    events.extend([ev("a", 3), ev("b", 3), ev("b", 4)]);
    publish(&log, &events).await;
    let policy = VersionPolicy::hold(2, Duration::from_secs(60));
    let mut eng = engine_on(&log, &db, &script, policy, fast().with_concurrency(1));
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    // Three held > 2: the aggregate held longest (a, held first) is parked; b stays held.
    assert_eq!(rep.held, 2);
    assert_eq!((rep.parked, rep.waiting), (1, 0));
    assert_eq!(parked(&db).await[0].record.aggregate_id(), "a");
}

trait AggId {
    fn aggregate_id(&self) -> String;
}
impl AggId for outbox_core::ParkedRecord {
    fn aggregate_id(&self) -> String {
        self.aggregate
            .as_ref()
            .map(|a| a.aggregate_id.clone())
            .unwrap_or_default()
    }
}

#[tokio::test]
async fn unchecked_applies_gaps_and_keeps_no_versions() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    publish(&log, &[ev("a", 1), ev("a", 5), ev("a", 3)]).await;
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Unchecked, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(rep.applied, 3);
    assert_eq!(applied(&db, "a"), vec![1, 5, 3]);
    let inbox = MemoryInboxStore::new(&db);
    assert_eq!(
        inbox.applied_version("proj", &outbox_core::AggregateKey::new("order", "a")),
        None
    );
}

#[tokio::test]
async fn require_first_version_parks_an_aggregate_that_starts_late() {
    for (require, parked_n) in [(true, 1), (false, 0)] {
        let log = MemoryLog::new("t", 1);
        let db = MemoryDb::default();
        publish(&log, &[ev("a", 3), ev("b", 1)]).await;
        let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new())
            .require_first_version(require);
        let mut eng =
            ConsumerEngine::new(log.consumer("proj", &["t"]), processor, fast(), 1).unwrap();
        let rep = eng
            .run_until_quiet(Duration::from_millis(30))
            .await
            .unwrap();
        assert_eq!(rep.parked, parked_n, "require = {require}");
        // The late starter is the one held; an aggregate that starts at version 1 applies.
        let late: Vec<i64> = if require { vec![] } else { vec![3] };
        assert_eq!(applied(&db, "a"), late, "require = {require}");
        assert_eq!(applied(&db, "b"), vec![1], "require = {require}");
    }
}

#[tokio::test]
async fn process_reports_without_parking() {
    let db = MemoryDb::default();
    let inbox = MemoryInboxStore::new(&db);
    let p = InboxProcessor::new("proj", inbox, Script::new());
    assert_eq!(
        p.process(&ev("a", 1)).await.unwrap(),
        MessageOutcome::Applied
    );
    assert_eq!(
        p.process(&ev("a", 3)).await.unwrap(),
        MessageOutcome::VersionGap { expected: 2 }
    );
    assert_eq!(
        p.process(&ev("a", 1)).await.unwrap(),
        MessageOutcome::Stale { applied: 1 }
    );
    assert!(matches!(
        p.process(&ev("poison", 1)).await.unwrap(),
        MessageOutcome::Failed(e) if e.class == ErrorClass::Permanent
    ));
    assert!(parked(&db).await.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Lanes and the watermark

/// One aggregate's message hangs; messages of other aggregates in the same partition complete
/// around it in other transactions; the committed offset stays at the hanging message until it
/// finishes.
#[tokio::test]
async fn aggregates_run_in_parallel_and_the_commit_waits_for_the_unfinished_offset() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let mut events = vec![ev("a0", 1), ev("gate", 1)];
    events.extend((1..40).map(|i| ev(&format!("a{i}"), 1)));
    publish(&log, &events).await;
    let mut eng = engine_on(
        &log,
        &db,
        &script,
        VersionPolicy::Reject,
        // One message per transaction: only the hanging message itself is stuck (with larger
        // batches, the messages sharing its transaction wait with it).
        fast().with_concurrency(4).with_max_batch(1),
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while eng.report().applied < 40 {
        assert!(std::time::Instant::now() < deadline, "{:?}", eng.report());
        eng.step().await.unwrap();
    }
    eng.commit_final().await.unwrap();
    assert_eq!(
        log.committed("proj", "t", 0),
        Some(1),
        "committed past the unfinished offset 1"
    );
    assert!(
        script.max_running.load(Ordering::SeqCst) >= 2,
        "no parallelism"
    );
    script.open_gate();
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(rep.applied, 41);
    assert_eq!(log.committed("proj", "t", 0), Some(41));
}

/// `concurrency` bounds the batch transactions running at once: with handlers that wait, the
/// most running at any time is exactly the configured number.
#[tokio::test]
async fn concurrency_bounds_the_transactions_running_at_once() {
    for concurrency in [1, 2] {
        let log = MemoryLog::new("t", 1);
        let db = MemoryDb::default();
        let script = Script::new();
        let events: Vec<Envelope> = (0..6).map(|i| ev(&format!("d{i}"), 1)).collect();
        for e in &events {
            script
                .delay
                .lock()
                .unwrap()
                .insert(e.aggregate_id.clone(), Duration::from_millis(15));
        }
        publish(&log, &events).await;
        let cfg = fast().with_concurrency(concurrency).with_max_batch(1);
        let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
        let rep = eng
            .run_until_quiet(Duration::from_millis(30))
            .await
            .unwrap();
        assert_eq!(rep.applied, 6);
        assert_eq!(
            script.max_running.load(Ordering::SeqCst),
            concurrency,
            "concurrency {concurrency}"
        );
    }
}

/// `max_in_flight` bounds what is received and not final: with every transaction stuck, the
/// engine stops polling at the bound (a source that cannot pause; one that can has the
/// partitions holding messages paused: `adversary_pause.rs`); `in_flight` counts those
/// messages and drops to zero once they are final.
#[tokio::test]
async fn max_in_flight_stops_polling_until_messages_are_final() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let events: Vec<Envelope> = (0..5).map(|i| ev(&format!("gate{i}"), 1)).collect();
    publish(&log, &events).await;
    let cfg = fast()
        .with_concurrency(4)
        .with_max_batch(2)
        .with_max_in_flight(2);
    let mut eng = common::engine_over(
        common::NoPause(log.consumer("proj", &["t"])),
        &db,
        &script,
        cfg,
    );
    for _ in 0..20 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().received, 2, "polled past max_in_flight");
    assert_eq!(eng.in_flight(), 2);
    script.open_gate();
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!((rep.received, rep.applied), (5, 5));
    assert_eq!(eng.in_flight(), 0);
    assert_eq!(log.committed("proj", "t", 0), Some(5));
}

/// At shutdown, `run` waits for a hanging transaction only for `shutdown_grace`, then
/// abandons it: its offset is not committed (it is redelivered), the report is returned.
#[tokio::test]
async fn run_abandons_a_hanging_transaction_after_the_shutdown_grace() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("gate", 1)]).await;
    let cfg = fast()
        .with_max_batch(1)
        .with_shutdown_grace(Duration::from_millis(100));
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let started = std::time::Instant::now();
    let rep = eng
        .run(tokio::time::sleep(Duration::from_millis(100)))
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!((rep.received, rep.applied), (2, 1));
    assert_eq!(
        log.committed("proj", "t", 0),
        Some(1),
        "a applied, gate not"
    );
}

/// Several partitions, many aggregates, random handler delays, duplicates: every effect once,
/// every aggregate in version order, everything committed, for several seeds.
#[tokio::test]
async fn partitions_and_aggregates_in_parallel_keep_order_and_apply_once() {
    use rand::{Rng, SeedableRng};
    for seed in 0..4u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let log = MemoryLog::new("t", 3);
        let db = MemoryDb::default();
        let script = Script::new();
        let mut events = Vec::new();
        let mut versions = std::collections::HashMap::new();
        for _ in 0..300 {
            let agg = format!("g{}", rng.random_range(0..25));
            let v = versions.entry(agg.clone()).or_insert(0i64);
            *v += 1;
            events.push(ev(&agg, *v));
            if rng.random_bool(0.1) {
                events.push(events[rng.random_range(0..events.len())].clone());
            }
        }
        for agg in versions.keys() {
            if rng.random_bool(0.3) {
                script
                    .delay
                    .lock()
                    .unwrap()
                    .insert(agg.clone(), Duration::from_millis(rng.random_range(0..3)));
            }
        }
        for chunk in events.chunks(7) {
            publish(&log, chunk).await;
        }
        let cfg = fast()
            .with_concurrency(rng.random_range(1..6))
            .with_max_batch(rng.random_range(1..20))
            .with_commit(rng.random_range(1..50), Duration::from_millis(5));
        let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
        let rep = eng
            .run_until_quiet(Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(rep.parked + rep.waiting, 0, "seed {seed}");
        assert_eq!(effects_once(&db), 300, "seed {seed}");
        for (agg, n) in &versions {
            assert_eq!(
                applied(&db, agg),
                (1..=*n).collect::<Vec<_>>(),
                "seed {seed}"
            );
        }
        for p in 0..3 {
            assert_eq!(
                log.committed("proj", "t", p),
                Some(end(&log, p)),
                "seed {seed}"
            );
        }
    }
}

/// The defect: 10 records committed; the topic is recreated under the running consumer and 10
/// new records arrive at offsets 0..9; only the first 2 are applied when the third hangs. The
/// group's committed offset must move back to 2, not stay at 10 (a restart would skip 8).
#[tokio::test]
async fn a_rewound_log_is_committed_from_its_new_records_only() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let old: Vec<Envelope> = (0..10).map(|i| ev(&format!("old{i}"), 1)).collect();
    publish(&log, &old).await;
    let cfg = fast().with_concurrency(16).with_max_batch(1);
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    eng.run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(log.committed("proj", "t", 0), Some(10));
    log.recreate_topic("t", 1);
    let mut new = vec![ev("n0", 1), ev("n1", 1), ev("gate", 1)];
    new.extend((3..10).map(|i| ev(&format!("n{i}"), 1)));
    publish(&log, &new).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while applied(&db, "n0").is_empty() || applied(&db, "n1").is_empty() {
        assert!(std::time::Instant::now() < deadline, "{:?}", eng.report());
        eng.step().await.unwrap();
    }
    for _ in 0..20 {
        eng.step().await.unwrap();
    }
    eng.commit_final().await.unwrap();
    assert_eq!(eng.report().rewinds, 1);
    assert_eq!(
        log.committed("proj", "t", 0),
        Some(2),
        "after the rewind only offsets 0 and 1 are final"
    );
    script.open_gate();
    eng.run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(log.committed("proj", "t", 0), Some(10));
    assert_eq!(effects_once(&db), 20);
}

// ---------------------------------------------------------------------------------------------
// Source: commits, rebalances, retention

#[derive(Default)]
struct ScriptedSource {
    queue: Mutex<VecDeque<ReceivedMessage>>,
    log: Arc<Mutex<Vec<String>>>,
    commit_errors: Mutex<VecDeque<SourceError>>,
    commits: Arc<Mutex<Vec<Vec<CommitOffset>>>>,
    attached: Mutex<Option<SharedOffsetTracker>>,
    /// Returned once by a poll that finds the queue empty after a transaction has committed.
    error_after_tx: Mutex<Option<SourceError>>,
    /// Acknowledges per message (logs "ack-ahead N" for every delivery acknowledged ahead).
    per_message: bool,
}

#[async_trait]
impl MessageSource for ScriptedSource {
    async fn poll(&self, _: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        if let Some(m) = self.queue.lock().unwrap().pop_front() {
            return Ok(Some(m));
        }
        if self.log.lock().unwrap().iter().any(|l| l == "tx-commit") {
            if let Some(e) = self.error_after_tx.lock().unwrap().take() {
                return Err(e);
            }
        }
        Ok(None)
    }
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        self.commits.lock().unwrap().push(offsets.to_vec());
        if let Some(e) = self.commit_errors.lock().unwrap().pop_front() {
            return Err(e);
        }
        for o in offsets {
            self.log
                .lock()
                .unwrap()
                .push(format!("offset-commit {}", o.next_offset));
        }
        Ok(())
    }
    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        *self.attached.lock().unwrap() = Some(offsets);
    }
    fn ack_model(&self) -> AckModel {
        if self.per_message {
            AckModel::PerMessage
        } else {
            AckModel::ContiguousWatermark
        }
    }
    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        for p in positions {
            self.log
                .lock()
                .unwrap()
                .push(format!("ack-ahead {}", p.offset));
        }
        Ok(())
    }
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        Ok(vec![PartitionLag::new(
            TopicPartition::new("t", 0),
            Some(3),
            0,
            10,
        )])
    }
}

fn msg(offset: i64, e: &Envelope) -> ReceivedMessage {
    ReceivedMessage::new(LogPosition::new("t", 0, offset), None, Ok(e.clone()))
}

/// Logs "tx-commit" for every committed transaction of the inbox, in the same log as the
/// source's offset commits; counts the engine's housekeeping calls (`cleanup`,
/// `requested_retries`), and fails every cleanup when `failing_cleanup` is set.
#[derive(Clone)]
struct LoggingInbox {
    inner: MemoryInboxStore,
    log: Arc<Mutex<Vec<String>>>,
    cleanups: Arc<AtomicUsize>,
    retry_reads: Arc<AtomicUsize>,
    failing_cleanup: bool,
}

#[async_trait]
impl outbox_core::InboxStore for LoggingInbox {
    type Tx = outbox_testkit::MemoryTx;
    async fn begin(&self) -> Result<Self::Tx, outbox_core::StoreError> {
        self.inner.begin().await
    }
    async fn register(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        ids: &[outbox_core::EventId],
    ) -> Result<Vec<outbox_core::Registration>, outbox_core::StoreError> {
        self.inner.register(tx, c, ids).await
    }
    async fn aggregates(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        a: &[outbox_core::AggregateKey],
    ) -> Result<Vec<outbox_core::AggregateState>, outbox_core::StoreError> {
        self.inner.aggregates(tx, c, a).await
    }
    async fn advance_versions(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        u: &[outbox_core::VersionAdvance],
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.advance_versions(tx, c, u).await
    }
    async fn park(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        m: &[outbox_core::NewParkedMessage],
    ) -> Result<Vec<outbox_core::Parking>, outbox_core::StoreError> {
        self.inner.park(tx, c, m).await
    }
    async fn commit(&self, tx: Self::Tx) -> Result<(), outbox_core::StoreError> {
        self.inner.commit(tx).await?;
        self.log.lock().unwrap().push("tx-commit".into());
        Ok(())
    }
    async fn rollback(&self, tx: Self::Tx) -> Result<(), outbox_core::StoreError> {
        self.inner.rollback(tx).await
    }
    async fn cleanup(
        &self,
        c: &str,
        r: Duration,
        b: usize,
    ) -> Result<u64, outbox_core::StoreError> {
        self.cleanups.fetch_add(1, Ordering::SeqCst);
        if self.failing_cleanup {
            return Err(outbox_core::StoreError::new(
                outbox_core::StoreErrorKind::Connection,
                "connection reset",
            ));
        }
        self.inner.cleanup(c, r, b).await
    }
}

#[async_trait]
impl InboxParking for LoggingInbox {
    async fn list_parked(
        &self,
        c: &str,
        f: &ParkedFilter,
    ) -> Result<Vec<outbox_core::ParkedMessage>, outbox_core::StoreError> {
        self.inner.list_parked(c, f).await
    }
    async fn parked_message(
        &self,
        c: &str,
        id: outbox_core::ParkedId,
    ) -> Result<Option<outbox_core::ParkedMessage>, outbox_core::StoreError> {
        self.inner.parked_message(c, id).await
    }
    async fn open_parked_of(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        a: &outbox_core::AggregateKey,
    ) -> Result<Vec<outbox_core::ParkedMessage>, outbox_core::StoreError> {
        self.inner.open_parked_of(tx, c, a).await
    }
    async fn parked_in(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        id: outbox_core::ParkedId,
    ) -> Result<Option<outbox_core::ParkedMessage>, outbox_core::StoreError> {
        self.inner.parked_in(tx, c, id).await
    }
    async fn change_parked(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        id: outbox_core::ParkedId,
        ch: &outbox_core::ParkedChange,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.change_parked(tx, c, id, ch).await
    }
    async fn unblock(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        a: &outbox_core::AggregateKey,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.unblock(tx, c, a).await
    }
    async fn audit(
        &self,
        tx: &mut Self::Tx,
        e: &outbox_core::InboxAuditEntry,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.audit(tx, e).await
    }
    async fn audit_trail(
        &self,
        c: &str,
        id: Option<outbox_core::ParkedId>,
    ) -> Result<Vec<outbox_core::InboxAuditEntry>, outbox_core::StoreError> {
        self.inner.audit_trail(c, id).await
    }
    async fn parked_stats(
        &self,
        c: &str,
    ) -> Result<outbox_core::ParkedStats, outbox_core::StoreError> {
        self.inner.parked_stats(c).await
    }
    async fn request_retry(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        id: outbox_core::ParkedId,
        request: &outbox_core::RetryRequest,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.request_retry(tx, c, id, request).await
    }
    async fn requested_retries(
        &self,
        c: &str,
    ) -> Result<Vec<outbox_core::ParkedMessage>, outbox_core::StoreError> {
        self.retry_reads.fetch_add(1, Ordering::SeqCst);
        self.inner.requested_retries(c).await
    }
    async fn clear_retry_request(
        &self,
        tx: &mut Self::Tx,
        c: &str,
        id: outbox_core::ParkedId,
        at: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), outbox_core::StoreError> {
        self.inner.clear_retry_request(tx, c, id, at).await
    }
}

type ScriptedEngine = ConsumerEngine<ScriptedSource, LoggingInbox, Script>;
type CallLog = Arc<Mutex<Vec<String>>>;
type Commits = Arc<Mutex<Vec<Vec<CommitOffset>>>>;

fn scripted_engine(
    msgs: Vec<ReceivedMessage>,
    errors: Vec<SourceError>,
) -> (ScriptedEngine, CallLog, Commits) {
    scripted_engine_with(
        ScriptedSource {
            queue: Mutex::new(msgs.into()),
            commit_errors: Mutex::new(errors.into()),
            ..ScriptedSource::default()
        },
        fast(),
        false,
    )
}

/// An engine over `source` (its log is replaced by the shared one) with `cfg`.
fn scripted_engine_with(
    mut source: ScriptedSource,
    cfg: EngineConfig,
    failing_cleanup: bool,
) -> (ScriptedEngine, CallLog, Commits) {
    let log = Arc::new(Mutex::new(Vec::new()));
    source.log = log.clone();
    let commits = source.commits.clone();
    let inbox = LoggingInbox {
        inner: MemoryInboxStore::new(&MemoryDb::default()),
        log: log.clone(),
        cleanups: Arc::default(),
        retry_reads: Arc::default(),
        failing_cleanup,
    };
    let engine = ConsumerEngine::new(
        source,
        InboxProcessor::new("proj", inbox, Script::new()),
        cfg,
        1,
    )
    .unwrap();
    (engine, log, commits)
}

/// Version 2 of `a` is held (version 1 missing); `b` and `c` behind it are applied. A
/// per-message source is asked to acknowledge `b` and `c` on their own, after their
/// transaction committed, while the watermark stays below the held message (never acknowledged
/// ahead); a contiguous-watermark source is never asked.
#[tokio::test]
async fn final_deliveries_are_acknowledged_ahead_only_by_a_per_message_source() {
    for per_message in [true, false] {
        let log = Arc::new(Mutex::new(Vec::new()));
        let source = ScriptedSource {
            queue: Mutex::new(
                vec![
                    msg(1, &ev("a", 2)),
                    msg(2, &ev("b", 1)),
                    msg(3, &ev("c", 1)),
                ]
                .into(),
            ),
            log: log.clone(),
            per_message,
            ..ScriptedSource::default()
        };
        let inbox = LoggingInbox {
            inner: MemoryInboxStore::new(&MemoryDb::default()),
            log: log.clone(),
            cleanups: Arc::default(),
            retry_reads: Arc::default(),
            failing_cleanup: false,
        };
        let processor = InboxProcessor::new("proj", inbox, Script::new())
            .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(60)))
            .require_first_version(true);
        let mut eng = ConsumerEngine::new(source, processor, fast(), 1).unwrap();
        let rep = eng
            .run_until_quiet(Duration::from_millis(20))
            .await
            .unwrap();
        assert_eq!((rep.applied, rep.held), (2, 1), "{rep:?}");
        let log = log.lock().unwrap().clone();
        let acked: Vec<&String> = log.iter().filter(|l| l.starts_with("ack-ahead")).collect();
        assert!(
            log.iter()
                .all(|l| !l.starts_with("offset-commit") || l == "offset-commit 1"),
            "the watermark never passes the held message: {log:?}"
        );
        if per_message {
            assert_eq!(acked, ["ack-ahead 2", "ack-ahead 3"], "{log:?}");
            let first_ack = log.iter().position(|l| l.starts_with("ack-ahead")).unwrap();
            let first_tx = log.iter().position(|l| l == "tx-commit").unwrap();
            assert!(
                first_tx < first_ack,
                "acknowledged after the commit: {log:?}"
            );
            assert_eq!(rep.acked_ahead, 2);
        } else {
            assert!(acked.is_empty(), "{log:?}");
            assert_eq!(rep.acked_ahead, 0);
        }
    }
}

#[tokio::test]
async fn the_offset_is_committed_only_after_the_transaction() {
    let (mut eng, log, _) = scripted_engine(vec![msg(7, &ev("a", 1))], vec![]);
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        vec!["tx-commit".to_string(), "offset-commit 8".to_string()]
    );
}

#[tokio::test]
async fn the_engine_hands_its_tracker_to_the_source() {
    let (eng, _, _) = scripted_engine(vec![], vec![]);
    let attached = eng
        .source()
        .attached
        .lock()
        .unwrap()
        .clone()
        .expect("attached");
    assert!(attached.same_as(&eng.offset_tracker()));
}

/// A commit refused by a rebalance is dropped, not retried: the engine goes back to polling.
#[tokio::test]
async fn a_commit_refused_by_a_rebalance_is_dropped_not_retried() {
    let (mut eng, _, commits) = scripted_engine(
        vec![msg(0, &ev("a", 1)), msg(1, &ev("b", 1))],
        vec![SourceError::rebalanced("ILLEGAL_GENERATION")],
    );
    for _ in 0..4 {
        eng.step().await.unwrap();
    }
    let first = commits.lock().unwrap().len();
    assert!(first >= 1);
    assert!(eng.report().dropped_commits >= 1);
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    // The dropped offsets are not sent again by themselves; later progress commits as usual.
    let all = commits.lock().unwrap().clone();
    let refused = &all[0];
    assert!(
        all[1..].iter().all(|c| c != refused),
        "the refused commit was retried: {all:?}"
    );
    assert_eq!(rep.applied, 2);
}

/// A transient commit failure keeps the offsets for the next commit.
#[tokio::test]
async fn a_transiently_failed_commit_is_sent_again_with_the_next_one() {
    let (mut eng, _, commits) = scripted_engine(
        vec![msg(0, &ev("a", 1))],
        vec![SourceError::new(ErrorClass::Transient, "coordinator moved")],
    );
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    let all = commits.lock().unwrap().clone();
    assert!(all.len() >= 2, "{all:?}");
    assert_eq!(all.last().unwrap(), &vec![CommitOffset::new("t", 0, 1)]);
    assert_eq!(eng.report().commits, 1);
}

#[tokio::test]
async fn a_retention_gap_stops_the_engine_with_a_clear_error() {
    let log = MemoryLog::new("t", 2);
    let db = MemoryDb::default();
    let events: Vec<Envelope> = (0..20).map(|i| ev(&format!("r{i}"), 1)).collect();
    publish(&log, &events).await;
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Reject, fast());
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    drop(eng);
    publish(
        &log,
        &events
            .iter()
            .map(|e| ev(&e.aggregate_id, 2))
            .collect::<Vec<_>>(),
    )
    .await;
    let committed = log.committed("proj", "t", 0).unwrap();
    log.truncate_before("t", 0, committed + 3);
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Reject, fast());
    let err = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::RetentionGap(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("t/0") && text.contains("3 records lost"),
        "{text}"
    );
    assert_eq!(
        log.committed("proj", "t", 0),
        Some(committed),
        "never jumps over the gap"
    );
}

#[tokio::test]
async fn transient_poll_failures_back_off_instead_of_spinning() {
    struct Failing {
        failures: Mutex<u32>,
        msg: Mutex<Option<ReceivedMessage>>,
    }
    #[async_trait]
    impl MessageSource for Failing {
        async fn poll(&self, _: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
            let mut f = self.failures.lock().unwrap();
            if *f > 0 {
                *f -= 1;
                return Err(SourceError::new(ErrorClass::Transient, "broker down"));
            }
            Ok(self.msg.lock().unwrap().take())
        }
        async fn commit(&self, _: &[CommitOffset]) -> Result<(), SourceError> {
            Ok(())
        }
        fn attach_offsets(&self, _: SharedOffsetTracker) {}
    }
    let source = Failing {
        failures: Mutex::new(3),
        msg: Mutex::new(Some(msg(0, &ev("a", 1)))),
    };
    let cfg = EngineConfig::default().with_retry(
        RetryPolicy::builder()
            .base(Duration::from_millis(20))
            .min_delay(Duration::from_millis(20))
            .build()
            .unwrap(),
    );
    let db = MemoryDb::default();
    let mut eng = ConsumerEngine::new(
        source,
        InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new()),
        cfg,
        3,
    )
    .unwrap();
    let started = std::time::Instant::now();
    for _ in 0..3 {
        assert!(!eng.step().await.unwrap());
    }
    assert!(started.elapsed() >= Duration::from_millis(60));
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!(rep.applied, 1);
}

/// A permanent source error (other than a retention gap) stops the engine.
#[tokio::test]
async fn a_permanent_poll_error_stops_the_engine() {
    struct Broken;
    #[async_trait]
    impl MessageSource for Broken {
        async fn poll(&self, _: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
            Err(SourceError::new(ErrorClass::Permanent, "not authorized"))
        }
        async fn commit(&self, _: &[CommitOffset]) -> Result<(), SourceError> {
            Ok(())
        }
        fn attach_offsets(&self, _: SharedOffsetTracker) {}
    }
    let db = MemoryDb::default();
    let mut eng = ConsumerEngine::new(
        Broken,
        InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new()),
        fast(),
        3,
    )
    .unwrap();
    let err = eng.step().await.unwrap_err();
    assert!(matches!(err, EngineError::Source(_)), "{err:?}");
}

// ---------------------------------------------------------------------------------------------
// Cleanup, retention check, metrics

#[tokio::test]
async fn scheduled_cleanup_removes_registrations_past_the_dedup_window_in_batches() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let log = MemoryLog::new("t", 1);
    let events: Vec<Envelope> = (0..25).map(|i| ev(&format!("c{i}"), 1)).collect();
    publish(&log, &events).await;
    let cfg = fast().with_cleanup(
        CleanupSchedule::new(Duration::from_secs(3600))
            .batch_size(10)
            .every(Duration::from_millis(1)),
    );
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Unchecked, cfg);
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    let inbox = MemoryInboxStore::new(&db);
    assert_eq!(inbox.registrations("proj").len(), 25);
    assert_eq!(eng.report().cleaned, 0);
    clock.advance(Duration::from_secs(7200));
    for _ in 0..10 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().cleaned, 25, "three batches of at most 10");
    assert!(inbox.registrations("proj").is_empty());
}

/// A cleanup run removes batch after batch, one per step, until a batch comes back short,
/// without waiting for the next interval in between.
#[tokio::test]
async fn a_cleanup_run_continues_while_batches_come_back_full() {
    let clock = ManualClock::default();
    let db = MemoryDb::new(clock.clone());
    let log = MemoryLog::new("t", 1);
    let events: Vec<Envelope> = (0..25).map(|i| ev(&format!("c{i}"), 1)).collect();
    publish(&log, &events).await;
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Unchecked, fast());
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    clock.advance(Duration::from_secs(7200));
    // A fresh engine whose next run is an hour away once this one finishes.
    let cfg = fast().with_cleanup(
        CleanupSchedule::new(Duration::from_secs(3600))
            .batch_size(10)
            .every(Duration::from_secs(3600)),
    );
    let mut eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Unchecked, cfg);
    for _ in 0..5 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().cleaned, 25, "10 + 10 + 5 in consecutive steps");
    assert!(MemoryInboxStore::new(&db).registrations("proj").is_empty());
}

/// The engine refreshes the lag and parked gauges by itself every `metrics_interval`.
#[test]
fn gauges_are_refreshed_on_the_metrics_interval() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    ::metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let (mut eng, _, _) = scripted_engine(vec![msg(0, &ev("poison", 1))], vec![]);
                eng.run_until_quiet(Duration::from_millis(20))
                    .await
                    .unwrap();
            });
    });
    let snap = snapshotter.snapshot().into_vec();
    let gauge = |name: &str| {
        snap.iter()
            .find(|(k, _, _, _)| k.key().name() == name)
            .and_then(|(_, _, _, v)| match v {
                DebugValue::Gauge(g) => Some(g.into_inner()),
                _ => None,
            })
    };
    // Read by the first step (the message received, not applied yet, nothing parked) and not
    // again within the 15 s interval: the gauges show the state after the first poll.
    assert_eq!(gauge("outbox_inbox_lag"), Some(7.0));
    assert_eq!(gauge("outbox_inbox_parked"), Some(0.0));
    assert_eq!(gauge("outbox_inbox_in_flight"), Some(1.0));
}

#[tokio::test]
async fn the_retention_check_uses_the_engines_dedup_window() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let day = Duration::from_secs(86_400);
    let cfg = fast().with_cleanup(CleanupSchedule::new(3 * day));
    let eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Reject, cfg);
    let err = eng
        .retention_check(TopicRetention::Limited(7 * day))
        .max_lag(day)
        .evaluate(Strictness::Refuse)
        .unwrap_err();
    assert!(err.to_string().contains("dedup retention 3d"), "{err}");
    assert!(eng
        .retention_check(TopicRetention::Limited(2 * day))
        .evaluate(Strictness::Refuse)
        .is_ok());
    // Without a cleanup schedule the inbox keeps everything: always covered.
    let eng = engine_on(&log, &db, &Script::new(), VersionPolicy::Reject, fast());
    assert!(eng
        .retention_check(TopicRetention::Unlimited)
        .evaluate(Strictness::Refuse)
        .is_ok());
}

#[test]
fn metrics_report_outcomes_errors_lag_and_parked() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    ::metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async {
                let (mut eng, _, _) = scripted_engine(
                    vec![
                        msg(0, &ev("a", 1)),
                        msg(1, &ev("poison", 1)),
                        msg(2, &ev("a", 1)),
                    ],
                    vec![],
                );
                eng.run_until_quiet(Duration::from_millis(20))
                    .await
                    .unwrap();
                eng.refresh_gauges().await;
            });
    });
    let snap = snapshotter.snapshot().into_vec();
    let find = |name: &str, label: Option<(&str, &str)>| {
        snap.iter()
            .find(|(k, _, _, _)| {
                k.key().name() == name
                    && label.is_none_or(|(l, v)| {
                        k.key().labels().any(|x| x.key() == l && x.value() == v)
                    })
            })
            .map(|(_, _, _, v)| v)
    };
    assert_eq!(
        find("outbox_inbox_processed_total", Some(("result", "applied"))),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        find("outbox_inbox_processed_total", Some(("result", "parked"))),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        find("outbox_inbox_processed_total", Some(("result", "stale"))),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        find(
            "outbox_inbox_apply_errors_total",
            Some(("kind", "handler_permanent"))
        ),
        Some(&DebugValue::Counter(1))
    );
    assert!(matches!(
        find("outbox_inbox_lag", Some(("partition", "0"))),
        Some(DebugValue::Gauge(v)) if v.into_inner() == 7.0
    ));
    assert!(matches!(
        find("outbox_inbox_parked", None),
        Some(DebugValue::Gauge(v)) if v.into_inner() == 1.0
    ));
    assert!(find("outbox_inbox_oldest_parked_age_seconds", None).is_some());
    assert!(find("outbox_inbox_apply_latency_seconds", None).is_some());
}

// ---------------------------------------------------------------------------------------------
// Store failures

/// Transient inbox failures at every step (a lost commit reply included: the transaction
/// committed but the engine was told it failed) are retried; every effect is applied exactly
/// once, in order, and everything is committed. Seeded; replay with OUTBOX_SIM_SEED.
#[tokio::test]
async fn transient_store_failures_and_lost_commit_replies_are_retried_without_double_effects() {
    use outbox_testkit::fault::{FaultInjector, FaultRates, FaultSource, FaultyInbox};
    let log = MemoryLog::new("t", 2);
    let db = MemoryDb::default();
    let script = Script::new();
    let mut events = Vec::new();
    for v in 1..=10 {
        for a in 0..8 {
            events.push(ev(&format!("f{a}"), v));
        }
    }
    publish(&log, &events).await;
    let faults = FaultInjector::new(FaultSource::seeded_from_env(
        11,
        FaultRates::default()
            .transient(0.15)
            .permanent(0.0)
            .ack_lost(0.1),
    ));
    let inbox = FaultyInbox::new(MemoryInboxStore::new(&db), faults.clone());
    let processor = InboxProcessor::new("proj", inbox, script.clone());
    let mut eng = ConsumerEngine::new(
        log.consumer("proj", &["t"]),
        processor,
        fast().with_max_batch(7),
        5,
    )
    .unwrap();
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert!(!faults.injected().is_empty(), "no fault was injected");
    assert!(rep.retries > 0);
    assert_eq!(
        rep.parked + rep.waiting,
        0,
        "a store fault parked a message"
    );
    assert_eq!(effects_once(&db), 80);
    for a in 0..8 {
        assert_eq!(applied(&db, &format!("f{a}")), (1..=10).collect::<Vec<_>>());
    }
    for p in 0..2 {
        assert_eq!(log.committed("proj", "t", p), Some(end(&log, p)));
    }
}

#[tokio::test]
async fn a_permanent_store_failure_stops_the_engine_before_the_offset() {
    use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyInbox};
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    publish(&log, &[ev("a", 1)]).await;
    let faults = FaultInjector::new(FaultSource::script([Some(Fault::Permanent)]));
    let inbox = FaultyInbox::new(MemoryInboxStore::new(&db), faults);
    let processor = InboxProcessor::new("proj", inbox, Script::new());
    let mut eng = ConsumerEngine::new(log.consumer("proj", &["t"]), processor, fast(), 5).unwrap();
    let err = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::Store(_)), "{err:?}");
    assert_eq!(log.committed("proj", "t", 0), None);
}

/// A message whose handler fails transiently waits for its retry without holding a transaction
/// or any other aggregate: everything else is applied meanwhile, and the committed offset stays
/// below the retrying message until it is applied.
#[tokio::test]
async fn a_retrying_aggregate_holds_up_nothing_else() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    *script.flaky_left.lock().unwrap() = 2;
    let mut events = vec![ev("flaky", 1), ev("flaky", 2)];
    events.extend((0..20).map(|i| ev(&format!("o{i}"), 1)));
    publish(&log, &events).await;
    let cfg = fast().with_concurrency(1).with_retry(
        RetryPolicy::builder()
            .base(Duration::from_millis(300))
            .min_delay(Duration::from_millis(300))
            .max_delay(Duration::from_millis(300))
            .max_attempts(5)
            .build()
            .unwrap(),
    );
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let started = std::time::Instant::now();
    while eng.report().applied < 20 {
        eng.step().await.unwrap();
    }
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "the others waited for the retry: {:?}",
        started.elapsed()
    );
    assert!(applied(&db, "flaky").is_empty());
    eng.commit_final().await.unwrap();
    assert_eq!(log.committed("proj", "t", 0), Some(0));
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(applied(&db, "flaky"), vec![1, 2]);
    assert_eq!((rep.applied, rep.retries), (22, 2));
    assert_eq!(log.committed("proj", "t", 0), Some(22));
}

/// A handler that applies a batch in one go (`handle_batch`) and names the failing event: the
/// engine parks that one and applies the rest; an index out of range blames the first.
#[tokio::test]
async fn a_set_based_handler_names_the_failing_event() {
    use std::sync::atomic::AtomicUsize;
    struct SetBased {
        calls: Arc<AtomicUsize>,
        bogus_index: bool,
    }
    #[async_trait]
    impl Handler<outbox_testkit::MemoryTx> for SetBased {
        async fn handle(
            &self,
            _: &mut outbox_testkit::MemoryTx,
            _: &Envelope,
        ) -> Result<(), HandlerError> {
            unreachable!("the engine calls handle_batch")
        }
        async fn handle_batch(
            &self,
            tx: &mut outbox_testkit::MemoryTx,
            events: &[&Envelope],
        ) -> Result<(), BatchHandlerError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if let Some(i) = events.iter().position(|e| e.aggregate_id == "poison") {
                let index = if self.bogus_index { 99 } else { i };
                return Err(BatchHandlerError::new(
                    index,
                    HandlerError::permanent("poison"),
                ));
            }
            for e in events {
                tx.put("effects", &e.event_id.to_string(), serde_json::json!(1));
            }
            Ok(())
        }
    }
    for bogus_index in [false, true] {
        let log = MemoryLog::new("t", 1);
        let db = MemoryDb::default();
        publish(&log, &[ev("a", 1), ev("poison", 1), ev("b", 1), ev("c", 1)]).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let handler = SetBased {
            calls: calls.clone(),
            bogus_index,
        };
        let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), handler);
        let mut eng = ConsumerEngine::new(
            log.consumer("proj", &["t"]),
            processor,
            fast().with_concurrency(1),
            1,
        )
        .unwrap();
        let rep = eng
            .run_until_quiet(Duration::from_millis(30))
            .await
            .unwrap();
        if bogus_index {
            // "a" was blamed: parked in place of the poison, which then fails again.
            assert_eq!(rep.parked, 2, "{rep:?}");
            assert_eq!(rep.applied, 2);
        } else {
            assert_eq!((rep.parked, rep.applied), (1, 3), "{rep:?}");
            assert_eq!(
                calls.load(Ordering::SeqCst),
                2,
                "one failed batch, one applied"
            );
        }
        assert_eq!(log.committed("proj", "t", 0), Some(4));
    }
}

/// The share of duplicates among final, not parked outcomes: (duplicates + stale) / (applied
/// + duplicates + stale), 0 when nothing finished.
#[test]
fn duplicate_share_counts_duplicates_and_stale_among_finished_messages() {
    let mut r = EngineReport::default();
    assert_eq!(r.duplicate_share(), 0.0);
    r.applied = 6;
    r.duplicates = 3;
    r.stale = 1;
    assert!(
        (r.duplicate_share() - 0.4).abs() < 1e-12,
        "{}",
        r.duplicate_share()
    );
    r.applied = 0;
    assert!((r.duplicate_share() - 1.0).abs() < 1e-12);
}

/// A transient handler failure waits out the retry policy's backoff (at least `min_delay`)
/// before the next attempt: the engine never retries at once.
#[tokio::test]
async fn a_transient_failure_waits_for_its_backoff_before_the_retry() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    *script.flaky_left.lock().unwrap() = 1;
    publish(&log, &[ev("flaky", 1)]).await;
    let min = Duration::from_millis(300);
    let cfg = fast().with_retry(
        RetryPolicy::builder()
            .min_delay(min)
            .base(min)
            .max_delay(min)
            .max_attempts(4)
            .build()
            .unwrap(),
    );
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let started = std::time::Instant::now();
    // A quiet period shorter than the backoff: the run cannot last `min` without it.
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.retries), (1, 1));
    assert!(
        started.elapsed() >= min,
        "applied {:?} after the start, before the {min:?} backoff",
        started.elapsed()
    );
}

/// Records the size of every batch handed to the handler, then applies it through `inner`.
#[derive(Clone)]
struct BatchSizes {
    inner: Script,
    sizes: Arc<Mutex<Vec<usize>>>,
}

#[async_trait::async_trait]
impl Handler<outbox_testkit::MemoryTx> for BatchSizes {
    async fn handle(
        &self,
        tx: &mut outbox_testkit::MemoryTx,
        e: &Envelope,
    ) -> Result<(), HandlerError> {
        self.inner.handle(tx, e).await
    }
    async fn handle_batch(
        &self,
        tx: &mut outbox_testkit::MemoryTx,
        events: &[&Envelope],
    ) -> Result<(), BatchHandlerError> {
        self.sizes.lock().unwrap().push(events.len());
        for (index, e) in events.iter().enumerate() {
            self.inner
                .handle(tx, e)
                .await
                .map_err(|error| BatchHandlerError { index, error })?;
        }
        Ok(())
    }
}

/// A batch filled from several aggregates' queues never exceeds `max_batch`: while a gated
/// batch runs, two messages of `a` and three of `b` queue up; the next batches take at most 3.
#[tokio::test]
async fn a_batch_filled_from_several_queues_never_exceeds_max_batch() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let handler = BatchSizes {
        inner: script.clone(),
        sizes: Arc::default(),
    };
    publish(&log, &[ev("gate", 1)]).await;
    let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), handler.clone());
    let cfg = fast().with_max_batch(3).with_concurrency(1);
    let mut eng = ConsumerEngine::new(log.consumer("proj", &["t"]), processor, cfg, 7).unwrap();
    // The gate's batch runs alone (it waits in the handler); the engine keeps polling.
    while eng.report().received < 1 {
        eng.step().await.unwrap();
    }
    let more = [ev("a", 1), ev("a", 2), ev("b", 1), ev("b", 2), ev("b", 3)];
    publish(&log, &more).await;
    while eng.report().received < 6 {
        eng.step().await.unwrap();
    }
    script.open_gate();
    eng.run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    let sizes = handler.sizes.lock().unwrap().clone();
    assert_eq!(sizes.iter().sum::<usize>(), 6, "{sizes:?}");
    assert!(sizes.iter().all(|n| *n <= 3), "{sizes:?}");
    assert_eq!(effects_once(&db), 6);
    assert_eq!(applied(&db, "b"), vec![1, 2, 3]);
}

/// Messages whose partition was lost while they waited are dropped at dispatch (the new owner
/// delivers them) and no longer count as in flight: the engine's bound on messages in flight
/// does not shrink with every lost assignment.
#[tokio::test]
async fn messages_of_a_lost_partition_leave_the_in_flight_count() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("gate", 1)]).await;
    let cfg = fast().with_max_batch(3).with_concurrency(1);
    // Unchecked: the aggregates start again above the versions that were dropped.
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Unchecked, cfg);
    while eng.report().received < 1 {
        eng.step().await.unwrap();
    }
    publish(&log, &[ev("a", 1), ev("a", 2), ev("b", 1)]).await;
    while eng.report().received < 4 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.in_flight(), 4);
    eng.offset_tracker()
        .lose(&[outbox_core::TopicPartition::new("t", 0)]);
    script.open_gate();
    // The gate's batch finishes (its ticket is stale too: it is not final); the three queued
    // messages are dropped at dispatch.
    for _ in 0..20 {
        eng.step().await.unwrap();
        if eng.in_flight() == 0 {
            break;
        }
    }
    assert_eq!(eng.in_flight(), 0);
    assert!(applied(&db, "a").is_empty() && applied(&db, "b").is_empty());
    // The aggregates whose messages were dropped are not left marked busy: once the partition
    // is assigned again, their next messages apply.
    eng.offset_tracker()
        .assign(&[outbox_core::TopicPartition::new("t", 0)]);
    publish(&log, &[ev("a", 3)]).await;
    eng.run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(applied(&db, "a"), vec![3]);
}

/// When the first of several messages of one aggregate in a batch fails transiently, all of
/// them wait for its retry and then apply in their order.
#[tokio::test]
async fn messages_handed_back_for_a_retry_keep_their_order() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    *script.flaky_left.lock().unwrap() = 1;
    publish(
        &log,
        &[
            ev("flaky", 1),
            ev("flaky", 2),
            ev("flaky", 3),
            ev("other", 1),
        ],
    )
    .await;
    let cfg = fast().with_max_batch(4).with_concurrency(1);
    let mut eng = engine_on(&log, &db, &script, VersionPolicy::Reject, cfg);
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.retries, rep.parked), (4, 1, 0));
    assert_eq!(applied(&db, "flaky"), vec![1, 2, 3]);
    assert_eq!(applied(&db, "other"), vec![1]);
}

// ---------------------------------------------------------------------------------------------
// Poll rounds and housekeeping timing

/// One poll round takes what the source has buffered, up to `max_batch` messages, and stops
/// taking at `max_in_flight`: never one message past either bound (a source that cannot
/// pause; with one that can, a round also stops at a partition's bound).
#[tokio::test]
async fn a_poll_round_takes_at_most_max_batch_and_never_passes_max_in_flight() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    let events: Vec<Envelope> = (0..10).map(|i| ev(&format!("gate{i}"), 1)).collect();
    publish(&log, &events).await;
    let cfg = fast()
        .with_concurrency(1)
        .with_max_batch(3)
        .with_max_in_flight(5);
    let mut eng = common::engine_over(
        common::NoPause(log.consumer("proj", &["t"])),
        &db,
        &script,
        cfg,
    );
    for _ in 0..20 {
        eng.step().await.unwrap();
        if eng.report().received > 0 {
            break;
        }
    }
    assert_eq!(eng.report().received, 3, "the first round takes max_batch");
    // The first three are stuck in their transaction: the next round may take two more.
    for _ in 0..20 {
        eng.step().await.unwrap();
        if eng.report().received > 3 {
            break;
        }
    }
    assert_eq!(eng.report().received, 5, "a round stops at max_in_flight");
    for _ in 0..5 {
        eng.step().await.unwrap();
    }
    assert_eq!((eng.report().received, eng.in_flight()), (5, 5));
    script.open_gate();
    let rep = eng
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(rep.applied, 10);
}

/// A retention gap found by a poll stops the engine, but what was applied before it is
/// committed first: a restart must not redo it.
#[tokio::test]
async fn a_retention_gap_commits_what_was_finished_before_stopping() {
    let source = ScriptedSource {
        queue: Mutex::new(vec![msg(4, &ev("a", 1))].into()),
        error_after_tx: Mutex::new(Some(SourceError::retention_gap("t/0: 3 records lost"))),
        ..ScriptedSource::default()
    };
    // Neither the count nor the interval commits here: only the final commit can.
    let cfg = fast().with_commit(1000, Duration::from_secs(3600));
    let (mut eng, log, _) = scripted_engine_with(source, cfg, false);
    let mut err = None;
    for _ in 0..50 {
        if let Err(e) = eng.step().await {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("the engine stopped");
    assert!(matches!(err, EngineError::RetentionGap(_)), "{err:?}");
    assert_eq!(
        *log.lock().unwrap(),
        vec!["tx-commit".to_string(), "offset-commit 5".to_string()]
    );
}

/// While messages keep coming, offsets are committed after every `commit_every` final
/// messages; the rest when the engine falls quiet, not before.
#[tokio::test]
async fn a_busy_engine_commits_after_every_commit_every_messages() {
    let msgs: Vec<ReceivedMessage> = (0..7).map(|i| msg(i, &ev(&format!("a{i}"), 1))).collect();
    let source = ScriptedSource {
        queue: Mutex::new(msgs.into()),
        ..ScriptedSource::default()
    };
    let cfg = fast()
        .with_commit(2, Duration::from_secs(3600))
        .with_max_batch(1)
        .with_concurrency(1);
    let (mut eng, _, commits) = scripted_engine_with(source, cfg, false);
    // Steps only (no `run_until_quiet`, which commits at its end): the last offset must be
    // committed by the first step that finds the engine quiet.
    for _ in 0..40 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().applied, 7);
    let next: Vec<i64> = commits
        .lock()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c.len(), 1, "{c:?}");
            c[0].next_offset
        })
        .collect();
    assert_eq!(next, vec![2, 4, 6, 7]);
}

/// A commit that failed transiently is kept, but a quiet engine does not send it again at
/// every idle poll: it goes with the next commit (by count, by interval, or the first quiet
/// step after new progress), not in a loop against a failing coordinator.
#[tokio::test]
async fn a_failed_commit_is_not_retried_at_every_idle_step() {
    let source = ScriptedSource {
        queue: Mutex::new(vec![msg(0, &ev("a", 1))].into()),
        commit_errors: Mutex::new(
            vec![SourceError::new(ErrorClass::Transient, "coordinator moved")].into(),
        ),
        ..ScriptedSource::default()
    };
    let cfg = fast().with_commit(1000, Duration::from_secs(3600));
    let (mut eng, _, commits) = scripted_engine_with(source, cfg, false);
    for _ in 0..30 {
        eng.step().await.unwrap();
    }
    assert_eq!(eng.report().applied, 1);
    assert_eq!(
        *commits.lock().unwrap(),
        vec![vec![CommitOffset::new("t", 0, 1)]],
        "one attempt, failed, not repeated while idle"
    );
    assert_eq!(eng.report().commits, 0);
    // The next commit carries it.
    eng.commit_final().await.unwrap();
    assert_eq!(commits.lock().unwrap().len(), 2);
    assert_eq!(eng.report().commits, 1);
}

/// A transaction that takes long does not hold back the commit of the messages finished
/// before it: once `commit_interval` has passed, their offsets are committed while it runs.
#[tokio::test]
async fn finished_offsets_are_committed_on_the_interval_while_a_batch_still_runs() {
    let source = ScriptedSource {
        queue: Mutex::new(vec![msg(0, &ev("a", 1)), msg(1, &ev("gate1", 1))].into()),
        ..ScriptedSource::default()
    };
    let cfg = fast()
        .with_commit(1000, Duration::from_millis(5))
        .with_max_batch(1)
        .with_concurrency(2);
    let (mut eng, _, commits) = scripted_engine_with(source, cfg, false);
    // No poll comes back empty while the gated message is still to be received, and none
    // finds the engine idle after: only the interval can commit.
    for _ in 0..400 {
        eng.step().await.unwrap();
        if !commits.lock().unwrap().is_empty() && eng.report().received == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(
        *commits.lock().unwrap(),
        vec![vec![CommitOffset::new("t", 0, 1)]]
    );
    assert_eq!(
        (eng.report().applied, eng.in_flight()),
        (1, 1),
        "the gated message still runs"
    );
}

/// After a cleanup run ends (a short batch) or fails, the next one waits for `every`.
#[tokio::test]
async fn a_cleanup_run_is_not_repeated_before_its_interval() {
    for failing in [false, true] {
        let cfg = fast().with_cleanup(
            CleanupSchedule::new(Duration::from_secs(3600))
                .batch_size(10)
                .every(Duration::from_secs(3600)),
        );
        let (mut eng, _, _) = scripted_engine_with(ScriptedSource::default(), cfg, failing);
        for _ in 0..20 {
            eng.step().await.unwrap();
        }
        assert_eq!(
            eng.processor().store().cleanups.load(Ordering::SeqCst),
            1,
            "failing cleanup: {failing}"
        );
        assert_eq!(eng.report().cleaned, 0);
    }
}

/// Requested retries are read at the first step, then once per `retry_requests_interval`.
#[tokio::test]
async fn requested_retries_are_read_once_per_interval() {
    let cfg = fast().with_retry_requests_interval(Duration::from_secs(3600));
    let (mut eng, _, _) = scripted_engine_with(ScriptedSource::default(), cfg, false);
    for _ in 0..20 {
        eng.step().await.unwrap();
        tokio::task::yield_now().await;
    }
    assert_eq!(
        eng.processor().store().retry_reads.load(Ordering::SeqCst),
        1
    );
}
