//! The in-memory log's consumer side: typed commits, the attached offset tracker, simulated
//! retention (a retention gap is an error, never a silent jump), a recreated topic (a rewind)
//! and lag.

use std::time::Duration;

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    Classify, CommitOffset, Envelope, MessageSource, Publisher, SourceErrorKind, TopicPartition,
};
use outbox_testkit::MemoryLog;

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .build()
        .unwrap()
}

async fn fill(log: &MemoryLog, n: i64) {
    let events: Vec<Envelope> = (1..=n).map(|v| ev("a", v)).collect();
    assert!(log
        .publish(&events.iter().collect::<Vec<_>>())
        .await
        .iter()
        .all(Result::is_ok));
}

#[tokio::test]
async fn a_committed_offset_below_the_earliest_is_a_retention_gap_naming_the_partition() {
    let log = MemoryLog::new("orders", 1);
    fill(&log, 10).await;
    let c = log.consumer("g", &["orders"]);
    for _ in 0..3 {
        c.poll(Duration::ZERO).await.unwrap().unwrap();
    }
    c.commit(&[CommitOffset::new("orders", 0, 3)])
        .await
        .unwrap();
    drop(c);
    // Retention deletes offsets 0..6 while the group is away.
    log.truncate_before("orders", 0, 6);
    assert_eq!(log.earliest_offset("orders", 0), 6);
    let c = log.consumer("g", &["orders"]);
    let err = c.poll(Duration::ZERO).await.unwrap_err();
    assert_eq!(err.kind, SourceErrorKind::RetentionGap);
    assert!(!err.is_transient());
    let text = err.to_string();
    assert!(
        text.contains("orders/0") && text.contains("3 records lost"),
        "{text}"
    );
    let lag = c.lag().await.unwrap();
    assert_eq!(lag[0].lost_to_retention(), Some(3));
    // A group that never committed starts at the earliest available offset: no gap.
    let fresh = log.consumer("fresh", &["orders"]);
    let m = fresh.poll(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(m.position.offset, 6);
}

#[tokio::test]
async fn a_recreated_topic_rewinds_the_reader_and_the_attached_tracker_sees_it() {
    let log = MemoryLog::new("orders", 1);
    fill(&log, 5).await;
    let c = log.consumer("g", &["orders"]);
    let tracker = SharedOffsetTracker::new();
    c.attach_offsets(tracker.clone());
    for _ in 0..5 {
        let m = c.poll(Duration::ZERO).await.unwrap().unwrap();
        let t = tracker.lock().begin(&m.position);
        tracker.lock().finish(&t);
    }
    log.recreate_topic("orders", 1);
    fill(&log, 2).await;
    let m = c.poll(Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(m.position.offset, 0, "read again from the start");
    let (_, kind) = tracker.lock().begin_checked(&m.position);
    assert!(matches!(
        kind,
        outbox_core::watermark::BeginKind::Rewind { highest_seen: 4 }
    ));
}

#[tokio::test]
async fn a_fenced_member_loses_its_partitions_and_its_commits_are_rebalance_errors() {
    let log = MemoryLog::new("orders", 2);
    fill(&log, 4).await;
    let c1 = log.consumer("g", &["orders"]);
    let tracker = SharedOffsetTracker::new();
    c1.attach_offsets(tracker.clone());
    let m = c1.poll(Duration::ZERO).await.unwrap().unwrap();
    let t = tracker.lock().begin(&m.position);
    tracker.lock().finish(&t);
    let _c2 = log.consumer("g", &["orders"]);
    assert!(c1.poll(Duration::ZERO).await.is_err());
    assert!(
        tracker.lock().take_commits().is_empty(),
        "a lost partition must not be committed"
    );
    let err = c1.commit(&[m.position.next()]).await.unwrap_err();
    assert_eq!(err.kind, SourceErrorKind::Rebalanced);
    assert_eq!(
        log.committed("g", &m.position.topic, m.position.partition),
        None
    );
}

#[tokio::test]
async fn lag_is_the_distance_from_the_committed_offset_to_the_end() {
    let log = MemoryLog::new("orders", 1);
    fill(&log, 7).await;
    let c = log.consumer("g", &["orders"]);
    let lag = c.lag().await.unwrap();
    assert_eq!(lag.len(), 1);
    assert_eq!(lag[0].partition, TopicPartition::new("orders", 0));
    assert_eq!((lag[0].committed, lag[0].end, lag[0].lag()), (None, 7, 7));
    c.commit(&[CommitOffset::new("orders", 0, 5)])
        .await
        .unwrap();
    assert_eq!(c.lag().await.unwrap()[0].lag(), 2);
}

#[tokio::test]
async fn a_commit_for_a_partition_the_consumer_does_not_read_is_refused_whole() {
    let log = MemoryLog::builder()
        .topic("orders", 2)
        .topic("audit", 1)
        .default_topic("orders")
        .build();
    fill(&log, 3).await;
    let c = log.consumer("g", &["orders"]);
    for bad in [
        CommitOffset::new("audit", 0, 1), // a topic it does not subscribe to
        CommitOffset::new("orders", 2, 1), // a partition the topic does not have
        CommitOffset::new("orders", -1, 1),
        CommitOffset::new("nowhere", 0, 1),
    ] {
        let label = format!("{}/{}", bad.topic, bad.partition);
        let err = c
            .commit(&[CommitOffset::new("orders", 0, 2), bad])
            .await
            .unwrap_err();
        assert!(
            !err.is_transient(),
            "{label}: a caller bug, not a retryable failure"
        );
        assert!(err.to_string().contains(&label), "{label}: {err}");
        assert_eq!(
            log.committed("g", "orders", 0),
            None,
            "{label}: nothing committed"
        );
    }
    assert_eq!(log.committed("g", "audit", 0), None);
    c.commit(&[CommitOffset::new("orders", 1, 1)])
        .await
        .unwrap();
    assert_eq!(log.committed("g", "orders", 1), Some(1));
}
