//! Tests against a real Kafka-protocol broker (`KAFKA_BROKERS`; tansu in `scripts/test`),
//! beyond the shared publisher suite (`tests/conformance.rs`). Every test uses its own topic
//! and consumer group; the fault tests run a broker of their own.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{brokers, create_topic, read_all, tansu_bin, unique, Tansu};
use outbox_core::{Envelope, ErrorClass, PublishErrorKind, PublishResult, Publisher};
use outbox_kafka::{CleanupPolicy, KafkaPublisher, StartError, TopicCheckError};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn event(aggregate: &str, version: i64) -> Envelope {
    Envelope::builder("order", aggregate, version, "order.changed")
        .json(&serde_json::json!({ "aggregate": aggregate, "version": version }))
        .unwrap()
        .header("traceparent", TRACEPARENT)
        .header("tenant", "acme")
        .build()
        .unwrap()
}

fn oks(results: &[PublishResult]) -> usize {
    results.iter().filter(|r| r.is_ok()).count()
}

// ---------------------------------------------------------------------------------------------
// Publisher

/// What `start` learns about the topic. Records, keys, headers, order and acknowledgements are
/// the publisher suite's (`tests/conformance.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_reports_the_topic() {
    let brokers = require!(brokers("start_report"));
    let topic = unique("report");
    create_topic(&brokers, &topic, 3, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("start");
    let report = publisher.topic_report().unwrap();
    assert_eq!(report.topic(&topic).unwrap().partitions, 3);
    assert!(report.compacted().next().is_none());
    assert_eq!(publisher.partition_counts().get(&topic), Some(&3));
}

/// Routes are by aggregate type: an order's events go to the order topic whatever their event
/// type (here `payment.captured` among them, which routing by event type sent to another
/// topic, so a consumer of both saw v2 before v1), on one partition, in version order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_keep_each_aggregate_on_one_topic_and_partition_in_order() {
    let brokers = require!(brokers("routing"));
    let orders = unique("route-orders");
    let payments = unique("route-payments");
    create_topic(&brokers, &orders, 4, &[]).await;
    create_topic(&brokers, &payments, 2, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &orders)
        .route_aggregate("payment", &payments)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("start");
    let event_types = ["order.placed", "payment.captured", "order.shipped"];
    let mut expected: Vec<(String, String, i64)> = Vec::new(); // (topic, aggregate, version)
                                                               // One batch per version, as the relay publishes aggregate heads.
    for version in 1..=6i64 {
        let mut batch = Vec::new();
        for i in 0..6 {
            let t = event_types[(version as usize + i) % event_types.len()];
            batch.push(
                Envelope::builder("order", format!("o-{i}"), version, t)
                    .build()
                    .unwrap(),
            );
            expected.push((orders.clone(), format!("o-{i}"), version));
        }
        for i in 0..3 {
            batch.push(
                Envelope::builder("payment", format!("p-{i}"), version, "payment.captured")
                    .build()
                    .unwrap(),
            );
            expected.push((payments.clone(), format!("p-{i}"), version));
        }
        let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
        for (e, r) in batch.iter().zip(&results) {
            let ack = r.as_ref().expect("published");
            let topic = if e.aggregate_type == "payment" {
                &payments
            } else {
                &orders
            };
            assert_eq!(
                ack.destination(),
                topic.as_str(),
                "{} {}",
                e.aggregate_id,
                e.event_type
            );
        }
    }
    // What a consumer of both topics reads: every aggregate on one topic and one partition,
    // its versions in offset order.
    let mut seen: HashMap<String, Vec<(String, i32, i64, i64)>> = HashMap::new();
    for (topic, partitions, n) in [(&orders, 4, 36), (&payments, 2, 18)] {
        let read = read_all(&brokers, topic, partitions, n, Duration::from_secs(20));
        assert_eq!(read.len(), n, "records in {topic}");
        for r in read {
            let aggregate = r.header("aggregate_id").unwrap().to_owned();
            let version: i64 = r.header("aggregate_version").unwrap().parse().unwrap();
            seen.entry(aggregate).or_default().push((
                topic.clone(),
                r.partition,
                r.offset,
                version,
            ));
        }
    }
    assert_eq!(seen.len(), 9);
    for (aggregate, mut records) in seen {
        records.sort_by_key(|(_, _, offset, _)| *offset);
        let places: std::collections::BTreeSet<(&String, i32)> =
            records.iter().map(|(t, p, _, _)| (t, *p)).collect();
        assert_eq!(places.len(), 1, "{aggregate} spans {places:?}");
        let versions: Vec<i64> = records.iter().map(|r| r.3).collect();
        assert_eq!(versions, (1..=6).collect::<Vec<_>>(), "{aggregate}");
        let topic = &records[0].0;
        assert!(expected
            .iter()
            .any(|(t, a, _)| t == topic && a == &aggregate));
    }

    // A route table that splits an aggregate type is refused before anything is sent.
    let err = KafkaPublisher::builder(&brokers, &orders)
        .route_aggregate("order", &orders)
        .route_aggregate("order", &payments)
        .build()
        .expect_err("an aggregate type on two topics");
    assert!(err.to_string().contains("exactly one topic"), "{err}");
}

/// Java's `Utils.murmur2`, written out for this test: the Java client's default partitioner
/// puts a keyed record on `(murmur2(key) & 0x7fffffff) % partitions`.
fn java_murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, b) in tail.iter().enumerate().rev() {
            h ^= u32::from(*b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

fn java_partition(key: &str, partitions: u32) -> i32 {
    ((java_murmur2(key.as_bytes()) & 0x7fff_ffff) % partitions) as i32
}

#[test]
fn java_murmur2_matches_known_values() {
    // Values of org.apache.kafka.common.utils.Utils.murmur2 (as used by Kafka's own tests).
    assert_eq!(java_murmur2(b"21") as i32, -973_932_308);
    assert_eq!(java_murmur2(b"foobar") as i32, -790_332_482);
    assert_eq!(
        java_murmur2(b"a-little-bit-long-string") as i32,
        -985_981_536
    );
    assert_eq!(
        java_murmur2(b"a-little-bit-longer-string") as i32,
        -1_486_304_829
    );
    assert_eq!(
        java_murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") as i32,
        -58_897_971
    );
    assert_eq!(java_murmur2(b"abc") as i32, 479_470_107);
}

/// The pinned default partitioner places every key where the Java client's default
/// partitioner would (librdkafka's own default, CRC32, does not), and 16 versions of one
/// aggregate share one partition, in order (with `partitioner=random` they spread over all 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_partitioner_places_keys_like_the_java_client() {
    let brokers = require!(brokers("partitioner"));
    let topic = unique("murmur2");
    create_topic(&brokers, &topic, 4, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("start");
    assert_eq!(
        publisher.partitioner(),
        outbox_kafka::Partitioner::Murmur2Random
    );
    let mut hot = Vec::new();
    for version in 1..=16 {
        let results = publisher.publish(&[&event("hot-aggregate", version)]).await;
        hot.push(results[0].as_ref().expect("published").clone());
    }
    assert!(
        hot.iter().all(|a| kafka_at(a).0 == kafka_at(&hot[0]).0),
        "one aggregate on several partitions: {hot:?}"
    );
    assert!(hot
        .windows(2)
        .all(|w| kafka_at(&w[0]).1 < kafka_at(&w[1]).1));
    assert_eq!(kafka_at(&hot[0]).0, java_partition("hot-aggregate", 4));

    let batch: Vec<Envelope> = (0..64).map(|i| event(&format!("agg-{i}"), 1)).collect();
    let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
    let mut used = std::collections::BTreeSet::new();
    for (e, r) in batch.iter().zip(&results) {
        let ack = r.as_ref().expect("published");
        let partition = ack.as_kafka().expect("a Kafka acknowledgement").1;
        assert_eq!(
            partition,
            java_partition(&e.aggregate_id, 4),
            "{} is not where a Java producer puts it",
            e.aggregate_id
        );
        used.insert(partition);
    }
    assert_eq!(used.len(), 4, "64 keys over 4 partitions use them all");
}

/// A change of partitioner between runs moves keys like a change of partition count, and is
/// reported the same way: from what the previous run recorded, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioner_change_between_runs_is_reported() {
    use outbox_kafka::Partitioner;
    let brokers = require!(brokers("partitioner_change"));
    let topic = unique("partitioner-change");
    create_topic(&brokers, &topic, 3, &[]).await;

    // The previous run used librdkafka's default (CRC32): every key moves.
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .expect_partitioner(Partitioner::ConsistentRandom)
        .build()
        .unwrap();
    let report = publisher.check_topics().await.expect("check");
    assert_eq!(report.partitioner, Partitioner::Murmur2Random);
    let change = report.partitioner_change.expect("change reported");
    assert_eq!(change.before, Partitioner::ConsistentRandom);
    assert_eq!(change.after, Partitioner::Murmur2Random);
    assert_eq!(change.topics, vec![topic.clone()]);
    assert!(
        publisher
            .check_topics()
            .await
            .unwrap()
            .partitioner_change
            .is_none(),
        "reported once"
    );

    // Keeping the previous mapping, or a twin that maps keys alike, is no change.
    for (expected, now) in [
        (Partitioner::ConsistentRandom, Partitioner::ConsistentRandom),
        (Partitioner::Murmur2, Partitioner::Murmur2Random),
    ] {
        let p = KafkaPublisher::builder(&brokers, &topic)
            .partitioner(now)
            .expect_partitioner(expected)
            .build()
            .unwrap();
        let report = p.check_topics().await.unwrap();
        assert_eq!(report.partitioner, now);
        assert!(report.partitioner_change.is_none(), "{expected} -> {now}");
    }
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_local_queue_is_waited_out_not_reported() {
    let brokers = require!(brokers("queue_full"));
    let topic = unique("queue-full");
    create_topic(&brokers, &topic, 1, &[]).await;
    // librdkafka's queue holds 5 records; the batch has 300.
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .set("queue.buffering.max.messages", "5")
        .delivery_timeout(Duration::from_secs(20))
        .start()
        .await
        .unwrap();
    let batch: Vec<Envelope> = (0..300)
        .map(|i| event(&format!("q-{}", i % 7), i + 1))
        .collect();
    let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
    assert_eq!(
        oks(&results),
        300,
        "{:?}",
        results.iter().find(|r| r.is_err())
    );
    let offsets: Vec<i64> = results
        .iter()
        .map(|r| kafka_at(r.as_ref().unwrap()).1)
        .collect();
    assert!(
        offsets.windows(2).all(|w| w[0] < w[1]),
        "input order kept in one partition"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topic_is_a_clear_error_at_start() {
    let brokers = require!(brokers("missing_topic"));
    let present = unique("present");
    create_topic(&brokers, &present, 1, &[]).await;
    let missing = unique("missing");
    let started = Instant::now();
    let err = KafkaPublisher::builder(&brokers, &present)
        .route_aggregate("shipment", &missing)
        .start()
        .await
        .expect_err("a missing topic must fail the start");
    match &err {
        StartError::Topics(TopicCheckError::Missing { topics }) => {
            assert_eq!(topics, &vec![missing.clone()]);
        }
        other => panic!("expected a missing-topic error, got {other}"),
    }
    assert!(err.to_string().contains(&missing), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "the check must not wait for a delivery timeout ({:?})",
        started.elapsed()
    );
    // Checking did not create it (no auto-creation through metadata requests).
    let again = KafkaPublisher::builder(&brokers, &missing).start().await;
    assert!(matches!(
        again,
        Err(StartError::Topics(TopicCheckError::Missing { .. }))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_producer_config_is_rejected_at_build() {
    let brokers = require!(brokers("unsafe_config"));
    let topic = unique("unsafe");
    // (key, value, words of the fix the message must give)
    let rules = [
        ("enable.idempotence", "false", "forced to true"),
        ("acks", "1", "forced to all"),
        ("acks", "0", "forced to all"),
        ("request.required.acks", "1", "forced to all"),
        (
            "max.in.flight.requests.per.connection",
            "6",
            "Use a value in 1..=5",
        ),
        ("max.in.flight", "100", "Use a value in 1..=5"),
        ("retries", "0", "Remove the property"),
        ("transactional.id", "relay", "remove the property"),
        ("delivery.report.only.error", "true", "forced to false"),
        (
            "partitioner",
            "random",
            "Remove the property to use the default murmur2_random",
        ),
        ("queuing.strategy", "lifo", "allow-list"),
        ("a.property.from.librdkafka.3", "on", "allow-list"),
    ];
    for (k, v, fix) in rules {
        let err = KafkaPublisher::builder(&brokers, &topic)
            .set(k, v)
            .build()
            .expect_err(k)
            .to_string();
        assert!(err.contains(k), "{k}={v}: {err}");
        assert!(err.contains(fix), "{k}={v}: no fix in {err}");
    }
    // The safe values (and stricter in-flight limits) are accepted.
    let ok = KafkaPublisher::builder(&brokers, &topic)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "2")
        .set("delivery.report.only.error", "false")
        .set("partitioner", "murmur2")
        .set("linger.ms", "5")
        .delivery_timeout(Duration::from_secs(3))
        .build()
        .expect("safe overrides");
    assert_eq!(ok.delivery_timeout(), Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_record_is_permanent_and_does_not_block_other_aggregates() {
    let brokers = require!(brokers("oversize"));
    let topic = unique("oversize");
    create_topic(&brokers, &topic, 1, &[]).await;
    // tansu does not enforce the topic's max.message.bytes, so the limit is the producer's own
    // message.max.bytes, checked by librdkafka before sending (same error code as the broker's).
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .set("message.max.bytes", "10000")
        .delivery_timeout(Duration::from_secs(5))
        .start()
        .await
        .expect("start");
    let big = Envelope::builder("order", "big", 1, "order.changed")
        .payload(outbox_core::Payload::new(
            "application/octet-stream",
            vec![7u8; 50_000],
        ))
        .build()
        .unwrap();
    let next_of_big = event("big", 2);
    let results = publisher
        .publish(&[&event("small", 1), &big, &next_of_big, &event("small", 2)])
        .await;
    let err = results[1].as_ref().expect_err("oversize");
    assert_eq!(err.kind, PublishErrorKind::RecordTooLarge, "{err}");
    assert_eq!(err.class, ErrorClass::Permanent);
    // The aggregate's next version is held back (never overtakes), transiently.
    let held = results[2].as_ref().expect_err("held back");
    assert_eq!(held.class, ErrorClass::Transient);
    // Other aggregates flow.
    assert!(results[0].is_ok() && results[3].is_ok(), "{results:?}");
    let read = read_all(&brokers, &topic, 1, 2, Duration::from_secs(10));
    assert_eq!(read.len(), 2, "only the two small records are in the log");
}

/// A topic that accepts smaller record batches than the producer builds: the broker would
/// refuse a whole batch of small records (and librdkafka fail every record of it), so the
/// publisher refuses to start, naming both sizes and the fix. With `batch.size` within the
/// limit it starts, keeps the limit (to class "too large" refusals by the record's own size)
/// and publishes. (tansu reports the `max.message.bytes` a topic was created with, though it
/// does not enforce it, so the refusal itself is table-tested in `size`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_batch_larger_than_the_topics_max_message_bytes_is_refused_at_start() {
    let brokers = require!(brokers("batch_vs_topic_limit"));
    let topic = unique("small_batches");
    create_topic(&brokers, &topic, 1, &[("max.message.bytes", "50000")]).await;
    let err = KafkaPublisher::builder(&brokers, &topic)
        .start()
        .await
        .expect_err("the default batch.size (1000000) exceeds the topic's limit");
    match &err {
        StartError::Topics(TopicCheckError::BatchTooLarge {
            topic: t,
            max_message_bytes: 50_000,
            batch_bytes: 1_000_000,
        }) if *t == topic => {}
        other => panic!("{other}"),
    }
    assert!(
        err.to_string().contains("batch.size to at most 50000"),
        "{err}"
    );
    // message.max.bytes bounds batches too.
    let err = KafkaPublisher::builder(&brokers, &topic)
        .set("batch.size", "2000000")
        .set("message.max.bytes", "60000")
        .start()
        .await
        .expect_err("60000 > 50000");
    assert!(
        matches!(
            err,
            StartError::Topics(TopicCheckError::BatchTooLarge {
                batch_bytes: 60_000,
                ..
            })
        ),
        "{err}"
    );
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .set("batch.size", "50000")
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("batches within the topic's limit");
    let report = publisher.topic_report().unwrap();
    assert_eq!(
        report.topic(&topic).unwrap().max_message_bytes,
        Some(50_000)
    );
    let results = publisher.publish(&[&event("a", 1), &event("b", 1)]).await;
    assert_eq!(oks(&results), 2, "{results:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_checks_report_compaction_and_partition_changes() {
    let brokers = require!(brokers("topic_checks"));
    let compacted = unique("compacted");
    let plain = unique("plain");
    create_topic(&brokers, &compacted, 1, &[("cleanup.policy", "compact")]).await;
    create_topic(&brokers, &plain, 3, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &plain)
        .route_aggregate("order_snapshot", &compacted)
        // As recorded at a previous start: the topic has grown since.
        .expect_partitions(&plain, 2)
        .build()
        .unwrap();
    let report = publisher.check_topics().await.expect("check");
    let c = report.topic(&compacted).unwrap();
    match &c.cleanup_policy {
        CleanupPolicy::Unavailable(reason) => {
            // Documents the degraded mode: a broker without DescribeConfigs is reported, not
            // fatal. (tansu 0.6 does answer DescribeConfigs, so this arm is not expected there.)
            panic!("DescribeConfigs unavailable on this broker: {reason}");
        }
        policy => assert!(policy.is_compacted(), "{policy:?}"),
    }
    assert_eq!(
        report
            .compacted()
            .map(|t| t.name.clone())
            .collect::<Vec<_>>(),
        vec![compacted.clone()]
    );
    let p = report.topic(&plain).unwrap();
    assert!(!p.cleanup_policy.is_compacted(), "{:?}", p.cleanup_policy);
    assert_eq!(p.partitions, 3);
    assert_eq!(report.partition_changes.len(), 1, "{report:?}");
    let change = &report.partition_changes[0];
    assert_eq!(
        (change.topic.as_str(), change.before, change.after),
        (plain.as_str(), 2, 3)
    );
    // A second check sees no change.
    assert!(publisher
        .check_topics()
        .await
        .unwrap()
        .partition_changes
        .is_empty());
}

/// Broker frozen (SIGSTOP) while batches are in flight: the failures are transient, and every
/// record reported published is in the log at the reported position. After the broker resumes,
/// publishing succeeds again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stopped_mid_batch_gives_transient_errors_and_no_false_acks() {
    let bin = require!(tansu_bin("broker_stopped"));
    let broker = Tansu::start(&bin);
    let brokers = broker.brokers();
    let topic = unique("paused");
    create_topic(&brokers, &topic, 2, &[]).await;
    let publisher = Arc::new(
        KafkaPublisher::builder(&brokers, &topic)
            .delivery_timeout(Duration::from_millis(2500))
            .set("socket.timeout.ms", "2000")
            .start()
            .await
            .expect("start"),
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let worker = {
        let publisher = Arc::clone(&publisher);
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut all: Vec<(Envelope, PublishResult)> = Vec::new();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let batch: Vec<Envelope> = (0..50)
                    .map(|i| {
                        n += 1;
                        event(&format!("agg-{}", (n + i) % 17), n)
                    })
                    .collect();
                let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
                all.extend(batch.into_iter().zip(results));
            }
            all
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    broker.pause();
    tokio::time::sleep(Duration::from_millis(3500)).await;
    broker.resume();
    // Publishing resumes; keep going until batches succeed again.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut resumed = false;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let r = publisher.publish(&[&event("probe", 1)]).await;
        if r[0].is_ok() {
            resumed = true;
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let all = worker.await.unwrap();
    assert!(
        resumed,
        "publishing did not resume after the broker came back"
    );

    let failed: Vec<_> = all.iter().filter_map(|(_, r)| r.as_ref().err()).collect();
    let acked: Vec<_> = all
        .iter()
        .filter_map(|(e, r)| r.as_ref().ok().map(|a| (e, a)))
        .collect();
    eprintln!("{} acknowledged, {} failed", acked.len(), failed.len());
    assert!(!failed.is_empty(), "the pause produced no failure");
    assert!(!acked.is_empty());
    for e in &failed {
        assert_eq!(e.class, ErrorClass::Transient, "{e}");
    }
    // Every acknowledged record is stored where its report said. Failed ones may be stored too
    // (a duplicate later, which at-least-once allows), so the log holds at least the acked.
    let read = read_all(
        &brokers,
        &topic,
        2,
        acked.len() + 1,
        Duration::from_secs(30),
    );
    let by_position: HashMap<(i32, i64), &common::Read> =
        read.iter().map(|r| ((r.partition, r.offset), r)).collect();
    for (e, ack) in &acked {
        let r = by_position
            .get(&ack.as_kafka().map(|(_, p, o)| (p, o)).unwrap())
            .unwrap_or_else(|| panic!("acknowledged record missing from the log: {ack:?}"));
        assert_eq!(r.header("event_id"), Some(e.event_id.to_string().as_str()));
    }
}

/// Broker killed (memory storage: everything gone) and restarted: while it is down, nothing is
/// reported published; after the restart (topic recreated) publishing resumes, rebuilding the
/// idempotent producer if the new broker rejects its old sequence state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_killed_and_restarted_publishing_resumes() {
    let bin = require!(tansu_bin("broker_restarted"));
    let mut broker = Tansu::start(&bin);
    let brokers = broker.brokers();
    let topic = unique("restart");
    create_topic(&brokers, &topic, 1, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_millis(2000))
        .start()
        .await
        .expect("start");
    let before = publisher.publish(&[&event("a", 1), &event("b", 1)]).await;
    assert_eq!(oks(&before), 2, "{before:?}");

    broker.kill();
    let started = Instant::now();
    let down = publisher
        .publish(&[&event("a", 2), &event("b", 2), &event("c", 1)])
        .await;
    assert!(
        started.elapsed()
            < Duration::from_secs(2) + outbox_kafka::REPORT_GRACE + Duration::from_secs(1),
        "publish must return within the delivery timeout ({:?})",
        started.elapsed()
    );
    for r in &down {
        let e = r
            .as_ref()
            .expect_err("nothing can be acknowledged by a dead broker");
        assert_eq!(e.class, ErrorClass::Transient, "{e}");
        assert!(
            matches!(
                e.kind,
                PublishErrorKind::Timeout | PublishErrorKind::BrokerUnavailable
            ),
            "{e}"
        );
    }

    broker.restart();
    create_topic(&brokers, &topic, 1, &[]).await;
    // The relay would retry with backoff; do the same until the batch goes through.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut results;
    loop {
        results = publisher
            .publish(&[&event("a", 2), &event("b", 2), &event("c", 1)])
            .await;
        if oks(&results) == 3 || Instant::now() > deadline {
            break;
        }
        for r in &results {
            if let Err(e) = r {
                eprintln!("after restart: {e}");
                assert_eq!(e.class, ErrorClass::Transient, "{e}");
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(oks(&results), 3, "publishing did not resume: {results:?}");
    eprintln!(
        "producer generation after restart: {}",
        publisher.producer_generation()
    );
    let read = read_all(&brokers, &topic, 1, 3, Duration::from_secs(15));
    for r in &results {
        let ack = r.as_ref().unwrap();
        assert!(
            read.iter()
                .any(|x| Some(x.offset) == ack.as_kafka().map(|k| k.2)),
            "{ack:?} not in the log"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_deleted_mid_run_is_reported_as_unknown_topic_naming_it() {
    use outbox_core::FailureScope;
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    let brokers = require!(brokers("topic_deleted"));
    let topic = unique("deleted");
    create_topic(&brokers, &topic, 2, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(2))
        .set("topic.metadata.refresh.interval.ms", "500")
        .start()
        .await
        .expect("start");
    let before = publisher
        .publish(&[&event("d-1", 1), &event("d-2", 1)])
        .await;
    assert_eq!(oks(&before), 2, "{before:?}");

    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    let deleted = admin
        .delete_topics(&[&topic], &AdminOptions::new())
        .await
        .expect("delete_topics request");
    for r in deleted {
        r.unwrap_or_else(|(t, code)| panic!("deleting {t}: {code}"));
    }

    // tansu 0.6 still accepts records for a deleted topic from a client that has its leader
    // cached (Kafka answers UNKNOWN_TOPIC_OR_PARTITION), until the producer's metadata refresh
    // (every 500 ms here) learns that the topic is gone; on a loaded machine that can take a few
    // refreshes, so publish until the producer knows (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    let results = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let started = Instant::now();
        let results = publisher
            .publish(&[&event("d-1", 2), &event("d-3", 1)])
            .await;
        assert!(
            started.elapsed()
                < Duration::from_secs(2) + outbox_kafka::REPORT_GRACE + Duration::from_secs(3),
            "publish must stay within the delivery timeout ({:?})",
            started.elapsed()
        );
        if results.iter().all(|r| r.is_err()) {
            break results;
        }
        assert!(
            Instant::now() < deadline,
            "the producer never learned that {topic} was deleted"
        );
    };
    for r in &results {
        let e = r.as_ref().expect_err("the topic is gone");
        assert_eq!(e.kind, PublishErrorKind::UnknownTopic, "{e}");
        assert_eq!(e.scope, FailureScope::Transport, "{e}");
        assert!(e.message.contains(&topic), "the topic is not named: {e}");
    }
}

/// The partition and offset of a Kafka acknowledgement.
fn kafka_at(ack: &outbox_core::AckMetadata) -> (i32, i64) {
    let (_, partition, offset) = ack.as_kafka().expect("a Kafka acknowledgement");
    (partition, offset)
}
