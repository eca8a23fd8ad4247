//! Adversarial tests of the consumer engine's poll error handling (`on_poll` /
//! `on_poll_error`): errors met while taking further buffered messages after a successful poll
//! (the "extra take", polls with a zero timeout). A transient one must cost no message and no
//! hot loop; a permanent one or a retention gap must stop the engine without committing past
//! an unfinished message.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use common::{applied, effects_once, engine_over, ev, fast, publish, Script};
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, CommitOffset, Envelope, ErrorClass, MessageSource, PartitionLag, ReceivedMessage,
    SourceError, SourceErrorKind,
};
use outbox_inbox::*;
use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultySource};
use outbox_testkit::{MemoryConsumer, MemoryDb, MemoryLog};

/// Runs before a poll is forwarded, with its number (1-based) and timeout; an error it returns
/// is the poll's result (the inner source is not polled).
type Hook = Box<dyn Fn(usize, Duration) -> Option<SourceError> + Send + Sync>;

/// One poll: its timeout, and the error's kind and class when it failed.
type PollRecord = (Duration, Option<SourceErrorKind>, Option<ErrorClass>);

/// Counts polls (and records each poll's timeout and whether it failed); runs `hook` before
/// forwarding each.
struct Counting<S> {
    inner: S,
    polls: AtomicUsize,
    log: Mutex<Vec<PollRecord>>,
    hook: Option<Hook>,
}

impl<S> Counting<S> {
    fn new(inner: S, hook: Option<Hook>) -> Self {
        Self {
            inner,
            polls: AtomicUsize::new(0),
            log: Mutex::new(Vec::new()),
            hook,
        }
    }
    fn polls(&self) -> usize {
        self.polls.load(Ordering::SeqCst)
    }
    /// (poll number, timeout, kind, class) of each failed poll.
    fn failures(&self) -> Vec<(usize, Duration, SourceErrorKind, ErrorClass)> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .enumerate()
            .filter_map(|(i, (t, k, c))| Some((i + 1, *t, (*k)?, (*c)?)))
            .collect()
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for Counting<S> {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
        let injected = self.hook.as_ref().and_then(|h| h(n, timeout));
        let r = match injected {
            Some(e) => Err(e),
            None => self.inner.poll(timeout).await,
        };
        let (k, c) = match &r {
            Ok(_) => (None, None),
            Err(e) => (Some(e.kind), Some(e.class)),
        };
        self.log.lock().unwrap().push((timeout, k, c));
        r
    }
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        self.inner.commit(offsets).await
    }
    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        self.inner.attach_offsets(offsets);
    }
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        self.inner.lag().await
    }
}

/// Polls faulted by `polls` (only polls), counted outside the faults.
fn faulty(log: &MemoryLog, polls: FaultSource) -> Counting<FaultySource<MemoryConsumer>> {
    Counting::new(
        FaultySource::new(
            log.consumer("proj", &["t"]),
            FaultInjector::new(polls).only(&["poll"]),
        ),
        None,
    )
}

/// Every record of the log below the group's committed offset was applied (its effect is in
/// the database): a commit never passes an unfinished message. Returns the committed offsets.
fn assert_commits_cover_only_applied(log: &MemoryLog, db: &MemoryDb, partitions: i32) -> Vec<i64> {
    let mut out = Vec::new();
    for p in 0..partitions {
        let c = log.committed("proj", "t", p).unwrap_or(0);
        for r in log.records("t", p) {
            if r.offset >= c {
                continue;
            }
            let e = r.decode().unwrap();
            let key = e.dedup_id().to_string();
            assert_eq!(
                db.read("effects", &key).and_then(|v| v.as_u64()),
                Some(1),
                "partition {p}: committed offset {c} passes offset {} ({} v{}), not applied",
                r.offset,
                e.aggregate_id,
                e.aggregate_version
            );
        }
        out.push(c);
    }
    out
}

/// Attack B1: a transient error on every other poll over a long run (many aggregates, 4
/// partitions, max_batch 8, concurrency 4): every message applied exactly once, in version
/// order per aggregate; committed offsets at the log's end; polls bounded by the messages (no
/// hot loop).
#[tokio::test]
async fn transient_errors_on_every_other_poll_lose_nothing_and_do_not_spin() {
    let log = MemoryLog::new("t", 4);
    let db = MemoryDb::default();
    let script = Script::new();
    let (aggs, versions) = (40, 10);
    let evs: Vec<Envelope> = (1..=versions)
        .flat_map(|v| (0..aggs).map(move |a| ev(&format!("agg{a}"), v)))
        .collect();
    publish(&log, &evs).await;
    let total = evs.len();
    // Every other poll fails, for far longer than the run needs.
    let steps = (0..20 * total).map(|i| (i % 2 == 1).then_some(Fault::Transient));
    let source = faulty(&log, FaultSource::script(steps));
    let cfg = fast()
        .with_max_batch(8)
        .with_concurrency(4)
        .with_commit(5, Duration::from_millis(20));
    let mut eng = engine_over(source, &db, &script, cfg);
    let started = std::time::Instant::now();
    let rep = tokio::time::timeout(
        Duration::from_secs(60),
        eng.run_until_quiet(Duration::from_millis(100)),
    )
    .await
    .expect("the engine finishes")
    .unwrap();
    let elapsed = started.elapsed();
    assert_eq!(
        rep.received as usize, total,
        "a failed poll lost or repeated a message"
    );
    assert_eq!(rep.applied as usize, total);
    assert_eq!((rep.duplicates, rep.stale, rep.parked), (0, 0, 0));
    assert_eq!(effects_once(&db), total);
    for a in 0..aggs {
        assert_eq!(
            applied(&db, &format!("agg{a}")),
            (1..=versions).collect::<Vec<_>>(),
            "agg{a}"
        );
    }
    for p in 0..4 {
        assert_eq!(
            log.committed("proj", "t", p),
            Some(log.end_offset("t", p)),
            "partition {p}"
        );
    }
    let polls = eng.source().polls();
    let failures = eng.source().failures();
    assert!(
        failures.len() >= total / 2,
        "the faults were exercised: {}",
        failures.len()
    );
    assert!(
        failures.iter().any(|(_, t, _, _)| *t == Duration::ZERO),
        "some transient errors were met while taking buffered messages"
    );
    // Each message needs at most one successful poll and one failed one; the quiet period
    // (100 ms) at most a few dozen more (2 ms poll timeout, backoff >= 1 ms on failures).
    eprintln!(
        "{polls} polls, {} failed ({} extra takes), {total} messages, {elapsed:?}",
        failures.len(),
        failures.iter().filter(|f| f.1 == Duration::ZERO).count()
    );
    let bound = 2 * total + 2 * (elapsed.as_millis() as usize) + 50;
    assert!(
        polls <= 4 * total + 400 && polls <= bound,
        "{polls} polls for {total} messages in {elapsed:?}: a hot loop"
    );
}

/// Attack B2: a permanent poll error in the extra-take loop while gated batches are in
/// flight: the engine returns that error; no committed offset passes an unapplied message;
/// a restart (gate open) applies everything exactly once and commits to the end.
#[tokio::test]
async fn a_permanent_error_in_the_extra_take_with_batches_in_flight_stops_without_overcommit() {
    let log = MemoryLog::new("t", 2);
    let db = MemoryDb::default();
    let script = Script::new();
    // Interleaved: free aggregates complete at once, gated ones stay in flight.
    let evs: Vec<Envelope> = (0..30)
        .map(|i| {
            if i >= 10 && i % 3 == 1 {
                ev(&format!("gate{i}"), 1)
            } else {
                ev(&format!("free{i}"), 1)
            }
        })
        .collect();
    publish(&log, &evs).await;
    // A second wave of free messages once something was committed: the extra takes then
    // find buffered messages while the gated ones are still in flight.
    let wave: Vec<Envelope> = (0..30).map(|i| ev(&format!("late{i}"), 1)).collect();
    let total = evs.len() + wave.len();
    let wave_log = log.clone();
    let second = tokio::spawn(async move {
        while (0..2).all(|p| wave_log.committed("proj", "t", p).unwrap_or(0) == 0) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        publish(&wave_log, &wave).await;
    });
    // The first extra take (zero timeout) after some offset was committed (free messages
    // finished) fails permanently, once; gated messages are in flight then.
    let fired = std::sync::atomic::AtomicBool::new(false);
    let hook_log = log.clone();
    let hook: Hook = Box::new(move |_, timeout| {
        let committed = (0..2).any(|p| hook_log.committed("proj", "t", p).unwrap_or(0) > 0);
        (timeout == Duration::ZERO && committed && !fired.swap(true, Ordering::SeqCst))
            .then(|| SourceError::new(ErrorClass::Permanent, "not authorized"))
    });
    let source = Counting::new(log.consumer("proj", &["t"]), Some(hook));
    let cfg = fast()
        .with_max_batch(4)
        .with_concurrency(4)
        .with_commit(1, Duration::from_millis(5));
    let mut eng = engine_over(source, &db, &script, cfg);
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        eng.run_until_quiet(Duration::from_millis(100)),
    )
    .await
    .expect("the engine stops")
    .unwrap_err();
    second.await.unwrap();
    match &err {
        EngineError::Source(e) => assert_eq!(e.class, ErrorClass::Permanent, "{e}"),
        other => panic!("expected a permanent source error, got {other:?}"),
    }
    let failures = eng.source().failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert_eq!(
        failures[0].1,
        Duration::ZERO,
        "the permanent error met an extra take: {failures:?}"
    );
    let gated_applied = (0..30)
        .filter(|i| *i >= 10 && i % 3 == 1)
        .filter(|i| !applied(&db, &format!("gate{i}")).is_empty())
        .count();
    assert_eq!(gated_applied, 0, "the gate was closed");
    let committed = assert_commits_cover_only_applied(&log, &db, 2);
    eprintln!(
        "committed at the error: {committed:?}, polls {}, failures {failures:?}",
        eng.source().polls()
    );
    assert!(
        committed.iter().any(|c| *c > 0),
        "something was committed first"
    );
    assert!(
        (0..2).any(|p| committed[p] < log.end_offset("t", p as i32)),
        "gated messages stay uncommitted"
    );
    drop(eng);

    // Restart with the gate open: everything once, committed at the end.
    script.open_gate();
    let source = faulty(&log, FaultSource::None);
    let mut eng = engine_over(source, &db, &script, fast().with_max_batch(4));
    eng.run_until_quiet(Duration::from_millis(100))
        .await
        .unwrap();
    assert_eq!(effects_once(&db), total);
    for p in 0..2 {
        let end = log.end_offset("t", p);
        assert_eq!(log.committed("proj", "t", p), Some(end), "partition {p}");
        assert!(committed[p as usize] <= end);
    }
}

/// Attack B3: a retention gap found by the extra take (the records after the first message
/// were deleted between the two polls) stops the engine with `RetentionGap`; the committed
/// offset never jumps over the gap, and a restart meets the gap again.
#[tokio::test]
async fn a_retention_gap_in_the_extra_take_stops_the_engine() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let script = Script::new();
    script.open_gate();
    let evs: Vec<Envelope> = (0..8).map(|i| ev(&format!("r{i}"), 1)).collect();
    publish(&log, &evs).await;
    let hook_log = log.clone();
    let hook: Hook = Box::new(move |n, timeout| {
        // Before poll 2 (the first extra take after poll 1 returned offset 0): offsets 0..5
        // are deleted by retention.
        if n == 2 {
            assert_eq!(timeout, Duration::ZERO, "poll 2 is an extra take");
            hook_log.truncate_before("t", 0, 5);
        }
        None
    });
    let source = Counting::new(log.consumer("proj", &["t"]), Some(hook));
    let cfg = fast().with_max_batch(4);
    let mut eng = engine_over(source, &db, &script, cfg);
    let err = tokio::time::timeout(
        Duration::from_secs(10),
        eng.run_until_quiet(Duration::from_millis(100)),
    )
    .await
    .expect("the engine stops")
    .unwrap_err();
    assert!(matches!(err, EngineError::RetentionGap(_)), "{err:?}");
    assert!(err.to_string().contains("4 records lost"), "{err}");
    let failures = eng.source().failures();
    assert_eq!(
        failures
            .iter()
            .map(|(n, t, k, _)| (*n, *t, *k))
            .collect::<Vec<_>>(),
        vec![(2, Duration::ZERO, SourceErrorKind::RetentionGap)]
    );
    let committed = assert_commits_cover_only_applied(&log, &db, 1);
    eprintln!("retention gap: committed {committed:?}");
    assert!(committed[0] <= 1, "never jumps over the gap: {committed:?}");
    drop(eng);

    // A restart meets the gap again (nothing was skipped silently).
    let mut eng = engine_over(
        log.consumer("proj", &["t"]),
        &db,
        &script,
        fast().with_max_batch(4),
    );
    let err = eng
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap_err();
    assert!(matches!(err, EngineError::RetentionGap(_)), "{err:?}");
    assert_eq!(log.committed("proj", "t", 0).unwrap_or(0), committed[0]);
}
