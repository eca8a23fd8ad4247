//! The consumer engine over a `FaultySource` (outbox-testkit): polls and offset commits that
//! fail transiently (or lose their acknowledgement) cost retries, never a message or a second
//! application; a permanent source error stops the engine without committing past an
//! unfinished message, and a restart finishes the work exactly once.

mod common;

use std::time::Duration;

use common::{applied, effects_once, engine_over, ev, fast, publish, Script};
use outbox_core::{Envelope, ErrorClass};
use outbox_inbox::*;
use outbox_testkit::fault::{Fault, FaultInjector, FaultRates, FaultSource, FaultySource};
use outbox_testkit::{MemoryConsumer, MemoryDb, MemoryLog};

/// Faults on commits around faults on polls, each with its own injector (so the scripts do not
/// depend on how the engine interleaves the two).
type Faulty = FaultySource<FaultySource<MemoryConsumer>>;

fn faulty(log: &MemoryLog, polls: FaultSource, commits: FaultSource) -> Faulty {
    FaultySource::new(
        FaultySource::new(
            log.consumer("proj", &["t"]),
            FaultInjector::new(polls).only(&["poll"]),
        ),
        FaultInjector::new(commits).only(&["commit"]),
    )
}

/// `err` is the permanent source error injected into `operation`.
fn assert_injected_permanent(err: &EngineError, operation: &str) {
    match err {
        EngineError::Source(e) => {
            assert_eq!(e.class, ErrorClass::Permanent, "{e}");
            let expected = format!("injected permanent fault in {operation}");
            assert!(e.message.contains(&expected), "{e}");
        }
        other => panic!("expected a source error, got {other:?}"),
    }
}

fn poll_faults(source: &Faulty) -> Vec<(&'static str, Fault)> {
    source.inner().faults().injected()
}

fn commit_faults(source: &Faulty) -> Vec<(&'static str, Fault)> {
    source.faults().injected()
}

/// `aggregates` × `versions` events, interleaved by version.
fn events(aggregates: usize, versions: i64) -> Vec<Envelope> {
    (1..=versions)
        .flat_map(|v| (0..aggregates).map(move |a| ev(&format!("agg{a}"), v)))
        .collect()
}

fn assert_committed_at_end(log: &MemoryLog, partitions: i32) {
    for p in 0..partitions {
        let end = log.end_offset("t", p);
        assert!(end > 0, "partition {p} got no records");
        assert_eq!(
            log.committed("proj", "t", p),
            Some(end),
            "partition {p}: committed offset is not the end of the log"
        );
    }
}

#[tokio::test]
async fn transient_poll_and_commit_faults_lose_nothing_and_apply_once() {
    let log = MemoryLog::new("t", 2);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &events(5, 4)).await;
    let polls = [
        Some(Fault::Transient),
        None,
        Some(Fault::Transient),
        Some(Fault::AckLost),
        None,
        None,
        Some(Fault::Latency(Duration::from_millis(3))),
        Some(Fault::Transient),
    ];
    // Never three failures in a row, so the final commits of the drain get through.
    let commits = [
        Some(Fault::Transient),
        None,
        Some(Fault::AckLost),
        Some(Fault::Transient),
        None,
        Some(Fault::Transient),
        Some(Fault::AckLost),
        None,
        Some(Fault::Latency(Duration::from_millis(3))),
    ];
    let source = faulty(
        &log,
        FaultSource::script(polls),
        FaultSource::script(commits),
    );
    // One message per poll and per transaction: many polls and commits, so both scripts run
    // to their end during the run.
    let mut eng = engine_over(source, &db, &script, fast().with_max_batch(1));
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    let injected_polls: Vec<Fault> = poll_faults(eng.source())
        .into_iter()
        .map(|(_, f)| f)
        .collect();
    assert_eq!(
        injected_polls,
        polls.iter().flatten().copied().collect::<Vec<_>>()
    );
    let injected_commits: Vec<Fault> = commit_faults(eng.source())
        .into_iter()
        .map(|(_, f)| f)
        .collect();
    assert_eq!(
        injected_commits,
        commits.iter().flatten().copied().collect::<Vec<_>>()
    );
    assert_eq!(rep.received, 20, "a failed poll lost or repeated a message");
    assert_eq!(rep.applied, 20);
    assert_eq!((rep.duplicates, rep.stale, rep.parked), (0, 0, 0));
    assert_eq!(effects_once(&db), 20);
    for a in 0..5 {
        assert_eq!(applied(&db, &format!("agg{a}")), vec![1, 2, 3, 4], "agg{a}");
    }
    assert_committed_at_end(&log, 2);
}

#[tokio::test]
async fn seeded_transient_source_faults_lose_nothing_and_apply_once() {
    let seed = outbox_testkit::fault::seed_from_env(2026);
    let log = MemoryLog::new("t", 3);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &events(6, 5)).await;
    let rates = FaultRates::default()
        .transient(0.3)
        .ack_lost(0.15)
        .permanent(0.0)
        .latency(0.1, Duration::from_millis(3));
    let source = faulty(
        &log,
        FaultSource::seeded(seed, rates),
        FaultSource::seeded(seed.wrapping_add(1), rates),
    );
    let mut eng = engine_over(source, &db, &script, fast().with_max_batch(2));
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert!(
        !poll_faults(eng.source()).is_empty() && !commit_faults(eng.source()).is_empty(),
        "seed {seed} injected no poll or no commit fault"
    );
    assert_eq!(rep.received, 30, "seed {seed}");
    assert_eq!(rep.applied, 30, "seed {seed}");
    assert_eq!(effects_once(&db), 30);
    for a in 0..6 {
        assert_eq!(
            applied(&db, &format!("agg{a}")),
            vec![1, 2, 3, 4, 5],
            "agg{a}"
        );
    }
    // The last commits may still fail under faults (the drain tries three times); a commit that
    // failed transiently is kept, so once the faults stop the next run commits it.
    eng.source().faults().set_source(FaultSource::None);
    eng.source().inner().faults().set_source(FaultSource::None);
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!((rep.received, rep.applied), (30, 30), "nothing came twice");
    assert_committed_at_end(&log, 3);
}

#[tokio::test]
async fn a_permanent_poll_error_stops_the_engine_without_committing_past_unfinished_work() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    // Offset 1 waits at the gate: it is unfinished when the source fails.
    publish(
        &log,
        &[
            ev("a", 1),
            ev("gate", 1),
            ev("b", 1),
            ev("c", 1),
            ev("d", 1),
        ],
    )
    .await;
    // The first three polls pass, every later one fails permanently (as a real source's
    // permanent error repeats).
    let source = faulty(
        &log,
        FaultSource::from_call(3, Fault::Permanent),
        FaultSource::None,
    );
    let mut eng = engine_over(source, &db, &script, fast());
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        eng.run_until_quiet(Duration::from_millis(50)),
    )
    .await
    .expect("the engine stops on a permanent source error")
    .unwrap_err();
    assert_injected_permanent(&err, "poll");
    assert!(
        poll_faults(eng.source())
            .iter()
            .all(|f| f == &("poll", Fault::Permanent)),
        "{:?}",
        poll_faults(eng.source())
    );
    assert!(applied(&db, "gate").is_empty(), "the gate was never opened");
    let committed = log.committed("proj", "t", 0);
    assert!(
        matches!(committed, None | Some(1)),
        "committed {committed:?} past the unfinished message at offset 1"
    );
    if committed == Some(1) {
        assert_eq!(
            applied(&db, "a"),
            vec![1],
            "committed past an unapplied message"
        );
    }
    drop(eng);

    // A restart without faults finishes everything, each effect once.
    script.open_gate();
    let mut eng = engine_over(log.consumer("proj", &["t"]), &db, &script, fast());
    eng.run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(effects_once(&db), 5);
    for agg in ["a", "gate", "b", "c", "d"] {
        assert_eq!(applied(&db, agg), vec![1], "{agg}");
    }
    assert_committed_at_end(&log, 1);
}

#[tokio::test]
async fn a_permanent_commit_error_stops_the_engine_and_moves_no_offset() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("b", 1), ev("c", 1)]).await;
    let source = faulty(
        &log,
        FaultSource::None,
        FaultSource::countdown(0, Fault::Permanent),
    );
    let mut eng = engine_over(source, &db, &script, fast());
    let err = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap_err();
    assert_injected_permanent(&err, "commit");
    assert_eq!(
        commit_faults(eng.source()),
        vec![("commit", Fault::Permanent)]
    );
    assert_eq!(
        log.committed("proj", "t", 0),
        None,
        "the failed commit moved"
    );
    let before = db.scan("effects").len();
    assert!(before >= 1, "the engine committed after applying something");
    drop(eng);

    // The restart gets every message again; what was applied is absorbed as a duplicate.
    let mut eng = engine_over(log.consumer("proj", &["t"]), &db, &script, fast());
    let rep = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(rep.received, 3);
    assert_eq!(rep.applied as usize, 3 - before);
    // With versions tracked, a redelivered version is stale before it is a duplicate.
    assert_eq!((rep.duplicates + rep.stale) as usize, before);
    assert_eq!(effects_once(&db), 3);
    assert_committed_at_end(&log, 1);
}

/// A permanent error reported once, by the poll that takes further buffered messages after a
/// successful one, stops the engine: it is not dropped because later polls succeed.
#[tokio::test]
async fn a_one_off_permanent_error_while_taking_buffered_messages_stops_the_engine() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    publish(&log, &[ev("a", 1), ev("b", 1), ev("c", 1)]).await;
    // Poll 1 returns a message; poll 2 (the engine taking what else is buffered, without
    // waiting) fails permanently, once; every later poll would succeed.
    let source = faulty(
        &log,
        FaultSource::script([None, Some(Fault::Permanent)]),
        FaultSource::None,
    );
    let mut eng = engine_over(source, &db, &script, fast());
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        eng.run_until_quiet(Duration::from_millis(50)),
    )
    .await
    .expect("the engine stops")
    .unwrap_err();
    match &err {
        EngineError::Source(e) => assert_eq!(e.class, ErrorClass::Permanent, "{e}"),
        other => panic!("expected a source error, got {other:?}"),
    }
    assert_eq!(poll_faults(eng.source()), vec![("poll", Fault::Permanent)]);
}

/// A transient error while taking buffered messages costs nothing: the messages taken before
/// it are applied, the rest arrive with the next polls, each effect once.
#[tokio::test]
async fn a_transient_error_while_taking_buffered_messages_loses_nothing() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    script.open_gate();
    publish(&log, &[ev("a", 1), ev("b", 1), ev("c", 1), ev("d", 1)]).await;
    let source = faulty(
        &log,
        FaultSource::script([None, Some(Fault::Transient)]),
        FaultSource::None,
    );
    let mut eng = engine_over(source, &db, &script, fast());
    tokio::time::timeout(
        Duration::from_secs(10),
        eng.run_until_quiet(Duration::from_millis(50)),
    )
    .await
    .expect("the engine finishes")
    .unwrap();
    assert_eq!(poll_faults(eng.source()), vec![("poll", Fault::Transient)]);
    assert_eq!(effects_once(&db), 4);
    assert_committed_at_end(&log, 1);
}
