//! The Kafka source against a real Kafka-protocol broker (`KAFKA_BROKERS`): where an assigned
//! partition starts when its committed offset cannot be read on assignment (issue 20, item
//! 13), and pausing a partition keeps its position exactly (item 9). Every test uses its own
//! topic and consumer group.

mod common;

use std::time::{Duration, Instant};

use common::{brokers, create_topic, unique};
use outbox_core::{CommitOffset, Envelope, MessageSource, Publisher, TopicPartition};
use outbox_kafka::{KafkaPublisher, KafkaSource, StartFrom};

fn event(v: i64) -> Envelope {
    Envelope::builder("order", "o-1", v, "order.changed")
        .build()
        .unwrap()
}

async fn publish(brokers: &str, topic: &str, n: i64) {
    let p = KafkaPublisher::builder(brokers, topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("publisher");
    // One record per produce request (tansu cannot serve a fetch starting inside a batch).
    for v in 1..=n {
        p.publish(&[&event(v)]).await.remove(0).expect("published");
    }
}

fn source(brokers: &str, group: &str, topic: &str, failing_reads: u32) -> KafkaSource {
    KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_secs(6))
        .start_from(StartFrom::Earliest)
        .fail_committed_reads_on_assignment(failing_reads)
        .build()
        .expect("source")
}

/// Polls until `n` messages arrived or `within` passed; returns their offsets.
async fn offsets(s: &KafkaSource, n: usize, within: Duration) -> Vec<i64> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    while got.len() < n && Instant::now() < deadline {
        match s.poll(Duration::from_millis(200)).await {
            Ok(Some(m)) => got.push(m.position.offset),
            Ok(None) => {}
            Err(e) => eprintln!("poll: {e}"),
        }
    }
    got
}

/// Every committed-offsets read made on assignment fails (the retries too): the partition,
/// which has no committed offset, must still be read from the configured start. (Before: it
/// kept no start offset, stopped at `auto.offset.reset=error`, and was never fetched until the
/// next rebalance, while the poll said an offset "has been reset".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_committed_read_on_assignment_still_starts_the_partition() {
    common::init_tracing();
    let Some(brokers) = brokers("a_failed_committed_read_on_assignment") else {
        return;
    };
    let topic = unique("start_t");
    create_topic(&brokers, &topic, 1, &[]).await;
    publish(&brokers, &topic, 3).await;
    let s = source(&brokers, &unique("start_g"), &topic, 100);
    assert_eq!(offsets(&s, 3, Duration::from_secs(25)).await, vec![0, 1, 2]);
    s.close().await;
}

/// The same with a committed offset: reading resumes there, not at the beginning (nothing
/// read twice) and not past it (nothing skipped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_committed_read_on_assignment_resumes_at_the_committed_offset() {
    let Some(brokers) = brokers("a_failed_committed_read_resumes") else {
        return;
    };
    let topic = unique("start_t");
    let group = unique("start_g");
    create_topic(&brokers, &topic, 1, &[]).await;
    publish(&brokers, &topic, 4).await;
    let first = source(&brokers, &group, &topic, 0);
    assert_eq!(
        offsets(&first, 2, Duration::from_secs(25)).await,
        vec![0, 1]
    );
    first
        .commit(&[CommitOffset::new(topic.clone(), 0, 2)])
        .await
        .expect("commit");
    first.close().await;
    let second = source(&brokers, &group, &topic, 100);
    assert_eq!(
        offsets(&second, 2, Duration::from_secs(25)).await,
        vec![2, 3]
    );
    second.close().await;
}

/// A paused partition delivers nothing and keeps its position: after `resume`, delivery
/// continues with the first message not yet delivered (nothing skipped, nothing twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_keeps_the_position_exactly() {
    let Some(brokers) = brokers("pause_keeps_the_position_exactly") else {
        return;
    };
    let topic = unique("pause_t");
    create_topic(&brokers, &topic, 1, &[]).await;
    publish(&brokers, &topic, 12).await;
    let s = source(&brokers, &unique("pause_g"), &topic, 0);
    let tp = TopicPartition::new(topic.clone(), 0);
    assert_eq!(offsets(&s, 3, Duration::from_secs(25)).await, vec![0, 1, 2]);
    assert!(s.pause(std::slice::from_ref(&tp)).await.expect("pause"));
    assert!(
        offsets(&s, 1, Duration::from_secs(2)).await.is_empty(),
        "a paused partition delivered"
    );
    s.resume(std::slice::from_ref(&tp)).await.expect("resume");
    assert_eq!(
        offsets(&s, 9, Duration::from_secs(25)).await,
        (3..12).collect::<Vec<i64>>()
    );
    s.close().await;
}
