//! `FaultySource` with faults: a failed poll takes nothing from the inner source, a failed
//! commit moves no offset, a lost commit acknowledgement moves it, and a seed replays the same
//! faults. (With no faults it runs the whole source conformance suite: `tests/conformance.rs`.)

use std::time::Duration;

use outbox_core::watermark::{BeginKind, SharedOffsetTracker};
use outbox_core::{
    CommitOffset, ErrorClass, LogPosition, MessageSource, SourceError, SourceErrorKind,
};
use outbox_testkit::fault::{Fault, FaultInjector, FaultRates, FaultSource, FaultySource};
use outbox_testkit::{MemoryConsumer, MemoryLog};

/// A log with topic `t` of `partitions` partitions and `n` records in partition 0.
fn log_with(partitions: usize, n: usize) -> MemoryLog {
    let log = MemoryLog::new("t", partitions);
    for i in 0..n {
        let offset = log
            .append_raw("t", 0, None, vec![], format!("r{i}").into_bytes())
            .unwrap();
        assert_eq!(offset, i as i64);
    }
    log
}

fn faulty(log: &MemoryLog, steps: Vec<Option<Fault>>) -> FaultySource<MemoryConsumer> {
    FaultySource::new(
        log.consumer("g", &["t"]),
        FaultInjector::new(FaultSource::script(steps)),
    )
}

/// What one poll gave: the offset read, nothing, or the class of the error.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Polled {
    Message(i64),
    Nothing,
    Failed(ErrorClass),
}

async fn poll_once<S: MessageSource>(source: &S) -> Polled {
    match source.poll(Duration::ZERO).await {
        Ok(Some(m)) => Polled::Message(m.position.offset),
        Ok(None) => Polled::Nothing,
        Err(e) => {
            assert_eq!(e.kind, SourceErrorKind::Other, "{e}");
            Polled::Failed(e.class)
        }
    }
}

fn next(offset: i64) -> CommitOffset {
    CommitOffset::new("t", 0, offset)
}

fn class(r: Result<(), SourceError>) -> Option<ErrorClass> {
    r.err().map(|e| e.class)
}

#[tokio::test]
async fn a_failed_poll_takes_no_message_and_keeps_the_order() {
    let log = log_with(1, 3);
    let source = faulty(
        &log,
        vec![
            Some(Fault::Transient),
            None,
            Some(Fault::Permanent),
            Some(Fault::AckLost),
            Some(Fault::Transient),
            None,
            Some(Fault::Latency(Duration::from_millis(1))),
            None,
        ],
    );
    let mut got = Vec::new();
    for _ in 0..8 {
        got.push(poll_once(&source).await);
    }
    use Polled::*;
    assert_eq!(
        got,
        vec![
            Failed(ErrorClass::Transient),
            Message(0),
            Failed(ErrorClass::Permanent),
            // A lost fetch reply is a transient error and takes nothing either.
            Failed(ErrorClass::Transient),
            Failed(ErrorClass::Transient),
            Message(1),
            Message(2),
            Nothing,
        ]
    );
    assert_eq!(
        source.faults().injected(),
        vec![
            ("poll", Fault::Transient),
            ("poll", Fault::Permanent),
            ("poll", Fault::AckLost),
            ("poll", Fault::Transient),
            ("poll", Fault::Latency(Duration::from_millis(1))),
        ]
    );
    // Polls commit nothing, failed or not.
    assert_eq!(log.committed("g", "t", 0), None);
}

#[tokio::test]
async fn a_poll_dropped_during_injected_latency_loses_no_message() {
    let log = log_with(1, 2);
    let source = faulty(&log, vec![Some(Fault::Latency(Duration::from_secs(30)))]);
    let dropped = tokio::time::timeout(Duration::from_millis(5), source.poll(Duration::ZERO)).await;
    assert!(dropped.is_err(), "the delayed poll finished: {dropped:?}");
    assert_eq!(poll_once(&source).await, Polled::Message(0));
    assert_eq!(poll_once(&source).await, Polled::Message(1));
    assert_eq!(poll_once(&source).await, Polled::Nothing);
}

#[tokio::test]
async fn a_failed_commit_leaves_the_committed_offset_unchanged() {
    let log = log_with(1, 3);
    let source = faulty(&log, vec![]);
    for o in 0..3 {
        assert_eq!(poll_once(&source).await, Polled::Message(o));
    }
    source.commit(&[next(1)]).await.unwrap();
    assert_eq!(log.committed("g", "t", 0), Some(1));
    source.faults().set_source(FaultSource::script([
        Some(Fault::Transient),
        Some(Fault::Permanent),
        Some(Fault::Latency(Duration::from_millis(1))),
    ]));
    assert_eq!(
        class(source.commit(&[next(2)]).await),
        Some(ErrorClass::Transient)
    );
    assert_eq!(
        log.committed("g", "t", 0),
        Some(1),
        "a transient fault committed"
    );
    assert_eq!(
        class(source.commit(&[next(3)]).await),
        Some(ErrorClass::Permanent)
    );
    assert_eq!(
        log.committed("g", "t", 0),
        Some(1),
        "a permanent fault committed"
    );
    // The inner source agrees: its lag still counts from offset 1.
    let lag = source.inner().lag().await.unwrap();
    assert_eq!(lag[0].committed, Some(1));
    // A delayed commit commits; the script ended, so the next one too.
    source.commit(&[next(2)]).await.unwrap();
    assert_eq!(log.committed("g", "t", 0), Some(2));
    source.commit(&[next(3)]).await.unwrap();
    assert_eq!(log.committed("g", "t", 0), Some(3));
}

#[tokio::test]
async fn a_lost_commit_acknowledgement_commits_but_reports_a_transient_error() {
    let log = log_with(1, 2);
    let source = faulty(&log, vec![None, None, Some(Fault::AckLost)]);
    assert_eq!(poll_once(&source).await, Polled::Message(0));
    assert_eq!(poll_once(&source).await, Polled::Message(1));
    let err = source.commit(&[next(2)]).await.unwrap_err();
    assert_eq!(
        (err.class, err.kind),
        (ErrorClass::Transient, SourceErrorKind::Other)
    );
    assert!(err.message.contains("acknowledgement was lost"), "{err}");
    assert_eq!(
        log.committed("g", "t", 0),
        Some(2),
        "the commit reached the log despite the error"
    );
    assert_eq!(source.faults().injected(), vec![("commit", Fault::AckLost)]);
}

#[tokio::test]
async fn errors_of_the_inner_source_pass_through_unchanged() {
    let log = log_with(1, 1);
    let source = faulty(&log, vec![]);
    assert_eq!(poll_once(&source).await, Polled::Message(0));
    let _newer = log.consumer("g", &["t"]);
    // A fenced member's commit is refused as a rebalance, also under a lost-ack fault (the
    // inner error wins: nothing took effect).
    source
        .faults()
        .set_source(FaultSource::script([None, Some(Fault::AckLost)]));
    for _ in 0..2 {
        let err = source.commit(&[next(1)]).await.unwrap_err();
        assert_eq!(err.kind, SourceErrorKind::Rebalanced, "{err}");
    }
    assert_eq!(log.committed("g", "t", 0), None);
}

#[tokio::test]
async fn lag_is_forwarded_and_can_fail() {
    let log = log_with(2, 3);
    let source = faulty(
        &log,
        vec![None, Some(Fault::Transient), Some(Fault::AckLost)],
    );
    let lag = source.lag().await.unwrap();
    assert_eq!(lag, source.inner().lag().await.unwrap());
    assert_eq!(lag.len(), 2);
    assert_eq!(lag[0].end, 3);
    assert_eq!(source.lag().await.unwrap_err().class, ErrorClass::Transient);
    assert_eq!(source.lag().await.unwrap_err().class, ErrorClass::Transient);
    assert_eq!(source.lag().await.unwrap().len(), 2);
}

#[tokio::test]
async fn the_tracker_is_attached_to_the_inner_source() {
    let log = log_with(1, 1);
    let source = faulty(&log, vec![]);
    let tracker = SharedOffsetTracker::new();
    let stale = tracker.lock().begin(&LogPosition::new("t", 0, 40));
    source.attach_offsets(tracker.clone());
    let m = source
        .poll(Duration::ZERO)
        .await
        .unwrap()
        .expect("a message");
    let mut t = tracker.lock();
    let (_, kind) = t.begin_checked(&m.position);
    assert!(matches!(kind, BeginKind::Forward), "{kind:?}");
    assert!(
        !t.is_current(&stale),
        "the assignment did not reach the tracker"
    );
}

#[tokio::test]
async fn only_restricts_faults_to_the_named_operations() {
    let log = log_with(1, 1);
    let source = FaultySource::new(
        log.consumer("g", &["t"]),
        FaultInjector::new(FaultSource::from_call(0, Fault::Transient)).only(&["commit"]),
    );
    assert_eq!(poll_once(&source).await, Polled::Message(0));
    assert_eq!(
        class(source.commit(&[next(1)]).await),
        Some(ErrorClass::Transient)
    );
    assert!(source.lag().await.is_ok());
    assert_eq!(log.committed("g", "t", 0), None);
}

/// Polls and commits under seeded faults until every record is read and committed; returns
/// what each call gave and the faults injected.
async fn seeded_run(seed: u64) -> (Vec<String>, Vec<(&'static str, Fault)>) {
    let log = log_with(1, 12);
    let rates = FaultRates::default()
        .transient(0.25)
        .permanent(0.1)
        .ack_lost(0.15)
        .latency(0.1, Duration::from_millis(2));
    let source = FaultySource::new(
        log.consumer("g", &["t"]),
        FaultInjector::new(FaultSource::seeded(seed, rates)),
    );
    let mut calls = Vec::new();
    let mut read = Vec::new();
    for _ in 0..200 {
        if log.committed("g", "t", 0) == Some(12) {
            break;
        }
        match poll_once(&source).await {
            Polled::Message(o) => {
                read.push(o);
                calls.push(format!("poll {o}"));
            }
            other => calls.push(format!("poll {other:?}")),
        }
        if let Some(last) = read.last() {
            let r = source.commit(&[next(last + 1)]).await;
            calls.push(format!(
                "commit {} -> {:?}, committed {:?}",
                last + 1,
                class(r),
                log.committed("g", "t", 0)
            ));
        }
    }
    assert_eq!(
        read,
        (0..12).collect::<Vec<_>>(),
        "every record once, in order"
    );
    assert_eq!(log.committed("g", "t", 0), Some(12));
    (calls, source.faults().injected())
}

#[tokio::test]
async fn a_seed_replays_the_same_faults() {
    let (calls, faults) = seeded_run(41).await;
    assert!(
        faults.iter().any(|(op, _)| *op == "poll") && faults.iter().any(|(op, _)| *op == "commit"),
        "the seed faulted polls and commits: {faults:?}"
    );
    assert_eq!(seeded_run(41).await, (calls.clone(), faults.clone()));
    let (other_calls, other_faults) = seeded_run(42).await;
    assert_ne!((other_calls, other_faults), (calls, faults));
}
