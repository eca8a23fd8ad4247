//! Adversarial tests of `MemoryConsumer::commit`'s refusal (permanent, whole) of a commit naming
//! a topic the consumer does not read or a partition the topic does not have: the consumer
//! engine's own commits, in legitimate situations, must never be refused so.

use std::time::Duration;

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{Classify, Envelope, MessageSource, Publisher, SourceErrorKind};
use outbox_testkit::MemoryLog;

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .build()
        .unwrap()
}

/// Reads everything available, finishing each message in the tracker (what the engine does).
async fn read_all(c: &outbox_testkit::MemoryConsumer, tracker: &SharedOffsetTracker) -> usize {
    let mut n = 0;
    while let Some(m) = c.poll(Duration::ZERO).await.unwrap() {
        let t = tracker.lock().begin(&m.position);
        tracker.lock().finish(&t);
        n += 1;
    }
    n
}

// FOUND: a topic recreated with fewer partitions under a running consumer: the offsets it made
// final on the vanished partitions were refused as a permanent error (the engine stopped).
/// The engine commits what its tracker made final; the topic was recreated meanwhile with fewer
/// partitions. The commit must not be a permanent error (the engine would stop); what it names
/// on the remaining partitions is recorded.
#[tokio::test]
async fn a_topic_recreated_with_fewer_partitions_does_not_stop_the_consumer() {
    let log = MemoryLog::new("orders", 3);
    let events: Vec<Envelope> = (0..30).map(|i| ev(&format!("a{i}"), 1)).collect();
    let refs: Vec<&Envelope> = events.iter().collect();
    assert!(log.publish(&refs).await.iter().all(Result::is_ok));
    assert!(log.end_offset("orders", 2) > 0, "partition 2 has records");
    let c = log.consumer("g", &["orders"]);
    let tracker = SharedOffsetTracker::new();
    c.attach_offsets(tracker.clone());
    assert_eq!(read_all(&c, &tracker).await, 30);
    // Recreated before the engine's periodic commit; the consumer notices on its next poll.
    log.recreate_topic("orders", 1);
    let _ = read_all(&c, &tracker).await;
    let commits = tracker.lock().take_commits();
    assert!(
        commits.iter().any(|c| c.partition == 2),
        "the tracker still holds the vanished partition's offsets: {commits:?}"
    );
    if let Err(e) = c.commit(&commits).await {
        assert!(
            e.is_transient() || e.kind == SourceErrorKind::Rebalanced,
            "the engine would stop on a legitimate commit: {e}"
        );
    }
    // The consumer goes on: a new record is read and committed.
    assert!(log.publish(&[&ev("after", 1)]).await[0].is_ok());
    assert_eq!(read_all(&c, &tracker).await, 1);
    let commits = tracker.lock().take_commits();
    c.commit(&commits).await.unwrap();
    assert_eq!(log.committed("g", "orders", 0), Some(1));
}

/// Retention below the consumer's position, a consumer on several topics: its commits are
/// accepted. A fenced member's commit is a rebalance error (dropped by the engine), not a
/// permanent one, even when it names a partition the topic no longer has.
#[tokio::test]
async fn truncation_several_topics_and_a_rebalance_are_never_permanent_refusals() {
    let log = MemoryLog::builder()
        .topic("orders", 2)
        .topic("audit", 3)
        .default_topic("orders")
        .route("audit.changed", "audit")
        .build();
    let mut events: Vec<Envelope> = (0..10).map(|i| ev(&format!("o{i}"), 1)).collect();
    events.extend((0..10).map(|i| {
        Envelope::builder("audit", format!("x{i}"), 1, "audit.changed")
            .build()
            .unwrap()
    }));
    let refs: Vec<&Envelope> = events.iter().collect();
    assert!(log.publish(&refs).await.iter().all(Result::is_ok));
    let c = log.consumer("g", &["orders", "audit"]);
    let tracker = SharedOffsetTracker::new();
    c.attach_offsets(tracker.clone());
    assert_eq!(read_all(&c, &tracker).await, 20);
    for p in 0..2 {
        let end = log.end_offset("orders", p);
        log.truncate_before("orders", p, end);
    }
    let commits = tracker.lock().take_commits();
    assert!(commits.iter().any(|c| c.topic == "audit"));
    c.commit(&commits).await.unwrap();
    // A rebalance (a new member) and a shrink: the old member's commit is fenced.
    let _c2 = log.consumer("g", &["orders", "audit"]);
    log.recreate_topic("audit", 1);
    let err = c
        .commit(&[outbox_core::CommitOffset::new("audit", 2, 1)])
        .await
        .unwrap_err();
    assert_eq!(err.kind, SourceErrorKind::Rebalanced, "{err}");
}
