//! The consumer side against a real Kafka-protocol broker (`KAFKA_BROKERS`; tansu in
//! `scripts/test`), beyond the shared message source suite (`tests/conformance.rs`: no
//! auto-commit, exact commits, resuming, revoke commits, start positions): a live rebalance
//! between two members, a lost assignment's commit refused as a rebalance, malformed records
//! from a plain producer parked by the engine while the partition continues, partitions in
//! parallel under the watermark, lag and the topic's retention. Every test uses its own topic
//! and consumer group.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{brokers, create_topic, unique};
use outbox_core::retention::{Strictness, TopicRetention};
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, wire, CommitOffset, DecodeError, Envelope, MessageSource, Publisher,
    ReceivedMessage, SourceErrorKind, TopicPartition,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::{KafkaPublisher, KafkaSource, KafkaSourceBuilder};
use outbox_testkit::{MemoryDb, MemoryInboxStore, MemoryTx};
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

fn event(aggregate: &str, version: i64) -> Envelope {
    Envelope::builder("order", aggregate, version, "order.changed")
        .json(&serde_json::json!({ "aggregate": aggregate, "version": version }))
        .unwrap()
        .build()
        .unwrap()
}

fn source(brokers: &str, group: &str, topic: &str) -> KafkaSourceBuilder {
    KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_secs(6))
}

/// Where a record was stored: the partition and offset of its Kafka acknowledgement.
#[derive(Clone, Debug)]
struct Stored {
    partition: i32,
    offset: i64,
}

/// Publishes one record per produce request (tansu 0.6 cannot serve a fetch that starts
/// inside a multi-record batch, see the crate docs, and these tests resume mid-stream).
async fn publish_each(brokers: &str, topic: &str, events: &[Envelope]) -> Vec<Stored> {
    let publisher = KafkaPublisher::builder(brokers, topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("start");
    let mut acks = Vec::new();
    for e in events {
        let mut r = publisher.publish(&[e]).await;
        let ack = r.remove(0).expect("published");
        let (_, partition, offset) = ack.as_kafka().expect("a Kafka acknowledgement");
        acks.push(Stored { partition, offset });
    }
    acks
}

async fn poll_n(source: &KafkaSource, n: usize, timeout: Duration) -> Vec<ReceivedMessage> {
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} messages within {timeout:?}",
            out.len()
        );
        if let Some(m) = source.poll(Duration::from_millis(500)).await.expect("poll") {
            out.push(m);
        }
    }
    out
}

async fn committed(source: &KafkaSource, topic: &str, partition: i32) -> Option<i64> {
    source
        .committed(
            &[TopicPartition::new(topic, partition)],
            Duration::from_secs(5),
        )
        .await
        .expect("committed")[0]
        .1
}

// ---------------------------------------------------------------------------------------------
// Commits and rebalances

/// A second member joins while the first is active: the first member's rebalance callback
/// commits what its tracker holds final before the partitions move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_to_a_new_member_commits_final_offsets_on_revoke() {
    let brokers = require!(brokers("source_rebalance"));
    let topic = unique("rebalance");
    let group = unique("group");
    create_topic(&brokers, &topic, 2, &[]).await;
    let events: Vec<Envelope> = (0..12).map(|i| event(&format!("agg-{i}"), 1)).collect();
    let acks = publish_each(&brokers, &topic, &events).await;
    let mut last: HashMap<i32, i64> = HashMap::new();
    for a in &acks {
        let e = last.entry(a.partition).or_insert(a.offset);
        *e = (*e).max(a.offset);
    }
    assert_eq!(last.len(), 2, "keys spread over both partitions: {last:?}");

    let tracker = SharedOffsetTracker::new();
    let first = Arc::new(source(&brokers, &group, &topic).build().unwrap());
    first.attach_offsets(tracker.clone());
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let engine = {
        let (first, tracker, received) = (first.clone(), tracker.clone(), received.clone());
        tokio::spawn(async move {
            loop {
                if let Some(m) = first.poll(Duration::from_millis(200)).await.unwrap() {
                    let mut t = tracker.lock();
                    let ticket = t.begin(&m.position);
                    t.finish(&ticket);
                    received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while received.load(std::sync::atomic::Ordering::Relaxed) < 12 {
        assert!(
            Instant::now() < deadline,
            "first member did not receive all"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(first.revoke_commits().is_empty());
    let second = source(&brokers, &group, &topic).build().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while first.revoke_commits().len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no commit on revoke: {:?}",
            first.revoke_commits()
        );
        let _ = second.poll(Duration::from_millis(200)).await.unwrap();
    }
    engine.abort();
    let mut expect: Vec<CommitOffset> = last
        .iter()
        .map(|(p, o)| CommitOffset::new(topic.clone(), *p, o + 1))
        .collect();
    expect.sort();
    let mut got = first.revoke_commits();
    got.sort();
    assert_eq!(got, expect);
    for c in &expect {
        assert_eq!(
            committed(&second, &topic, c.partition).await,
            Some(c.next_offset)
        );
    }
}

/// The defect: a member that stalled past `max.poll.interval.ms` still listed its partitions
/// (the revoke runs on the next poll) and committed an offset for a partition another member
/// already owned. Now the commit is refused as a rebalance and moves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_a_lost_assignment_is_refused_and_moves_nothing() {
    let brokers = require!(brokers("source_lost"));
    let topic = unique("lost");
    let group = unique("group");
    create_topic(&brokers, &topic, 1, &[]).await;
    let events: Vec<Envelope> = (1..=6).map(|v| event("o-1", v)).collect();
    publish_each(&brokers, &topic, &events).await;

    let stalled = source(&brokers, &group, &topic)
        .set("max.poll.interval.ms", "7000")
        .build()
        .unwrap();
    let tracker = SharedOffsetTracker::new();
    stalled.attach_offsets(tracker.clone());
    let got = poll_n(&stalled, 6, Duration::from_secs(30)).await;
    // The member stalls (no poll) past max.poll.interval.ms; librdkafka leaves the group.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !stalled.assignment_lost() {
        assert!(Instant::now() < deadline, "assignment never lost");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Another member takes the partition over.
    let owner = source(&brokers, &group, &topic).build().unwrap();
    let first = poll_n(&owner, 1, Duration::from_secs(30)).await;
    assert_eq!(first[0].position.offset, got[0].position.offset);
    assert_eq!(
        stalled.assignment().unwrap(),
        vec![TopicPartition::new(topic.clone(), 0)],
        "the stalled member still lists the partition"
    );
    let err = stalled
        .commit(&[got[4].position.next()])
        .await
        .expect_err("a commit after a lost assignment");
    assert_eq!(err.kind, SourceErrorKind::Rebalanced, "{err}");
    assert_eq!(
        committed(&owner, &topic, 0).await,
        None,
        "the owner's position moved"
    );
}

// ---------------------------------------------------------------------------------------------
// Malformed records

type RawHeaders = Vec<(String, Option<Vec<u8>>)>;

async fn produce_raw(
    brokers: &str,
    topic: &str,
    records: &[(Option<RawHeaders>, Option<Vec<u8>>)],
) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    for (headers, payload) in records {
        let mut r: FutureRecord<'_, str, [u8]> = FutureRecord::to(topic).key("m");
        if let Some(p) = payload {
            r = r.payload(p);
        }
        if let Some(hs) = headers {
            let mut oh = OwnedHeaders::new();
            for (k, v) in hs {
                oh = oh.insert(Header {
                    key: k,
                    value: v.as_deref(),
                });
            }
            r = r.headers(oh);
        }
        producer
            .send(r, Duration::from_secs(5))
            .await
            .expect("produce");
    }
}

fn headers_of(e: &Envelope) -> RawHeaders {
    wire::encode_headers(e)
        .into_iter()
        .map(|(k, v)| (k, Some(v)))
        .collect()
}

fn replace(h: &RawHeaders, name: &str, value: Option<&[u8]>) -> RawHeaders {
    h.iter()
        .map(|(k, v)| {
            if k == name {
                (k.clone(), value.map(<[u8]>::to_vec))
            } else {
                (k.clone(), v.clone())
            }
        })
        .collect()
}

/// Records of a plain producer decode into typed errors with their raw record; a repeated
/// identical header and a null user header decode; a null value is an empty payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_a_plain_producer_decode_into_typed_errors_with_their_raw_record() {
    let brokers = require!(brokers("source_malformed"));
    let topic = unique("malformed");
    create_topic(&brokers, &topic, 1, &[]).await;
    let good = event("m", 1);
    let h = headers_of(&good);
    let mut binary = h.clone();
    binary.push(("x-binary".into(), Some(vec![0xff, 0xfe])));
    let mut repeated = h.clone();
    repeated.push(("traceparent-copy".into(), Some(b"1".to_vec())));
    repeated.push(("traceparent-copy".into(), Some(b"1".to_vec())));
    repeated.push((
        wire::EVENT_TYPE.into(),
        Some(good.event_type.clone().into_bytes()),
    ));
    let mut null_user = h.clone();
    null_user.push(("x-null".into(), None));
    let payload = Some(good.payload.bytes.clone());
    let records = vec![
        (None, Some(b"no headers at all".to_vec())),
        (
            Some(replace(&h, wire::AGGREGATE_VERSION, Some(b"two"))),
            payload.clone(),
        ),
        (Some(binary), payload.clone()),
        (
            Some(replace(&h, wire::EVENT_ID, Some(b"not-a-uuid"))),
            payload.clone(),
        ),
        (Some(replace(&h, wire::EVENT_TYPE, None)), payload.clone()),
        (Some(repeated), payload.clone()),
        (Some(null_user), payload.clone()),
        (Some(h.clone()), None),
    ];
    produce_raw(&brokers, &topic, &records).await;

    let src = source(&brokers, &unique("group"), &topic).build().unwrap();
    let got = poll_n(&src, records.len(), Duration::from_secs(30)).await;
    assert_eq!(
        got[0].envelope.as_ref().unwrap_err(),
        &DecodeError::MissingHeader(wire::EVENT_ID)
    );
    assert_eq!(got[0].value(), Some(b"no headers at all".as_slice()));
    assert!(got[0].headers.is_empty());
    for (i, header) in [
        (1, wire::AGGREGATE_VERSION),
        (2, "x-binary"),
        (3, wire::EVENT_ID),
        (4, wire::EVENT_TYPE),
    ] {
        assert!(
            matches!(got[i].envelope.as_ref().unwrap_err(), DecodeError::MalformedHeader { name, .. } if name == header),
            "#{i}: {:?}",
            got[i].envelope
        );
    }
    // The null event_type header arrived as null, not as an empty string.
    assert!(got[4]
        .headers
        .iter()
        .any(|x| x.name == wire::EVENT_TYPE && x.value.is_none()));
    // The aggregate of a record with a bad version is still known (it blocks its aggregate).
    assert_eq!(
        got[1].aggregate(),
        Some(outbox_core::AggregateKey::new("order", "m"))
    );
    assert_eq!(got[5].envelope.as_ref().unwrap().event_id, good.event_id);
    let with_null = got[6].envelope.as_ref().unwrap();
    assert!(!with_null.headers.contains_key("x-null"));
    assert!(got[6]
        .headers
        .iter()
        .any(|x| x.name == "x-null" && x.value.is_none()));
    let empty = got[7].envelope.as_ref().unwrap();
    assert!(empty.payload.bytes.is_empty());
}

/// Tolerates anything as JSON except an empty payload.
struct JsonProjection;

#[async_trait]
impl Handler<MemoryTx> for JsonProjection {
    async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
        let v: serde_json::Value = e
            .payload
            .to_json()
            .map_err(|err| HandlerError::permanent(format!("payload is not JSON: {err}")))?;
        tx.put(
            "projection",
            &format!("{}@{}", e.aggregate_id, e.aggregate_version),
            v,
        );
        Ok(())
    }
}

fn fast() -> EngineConfig {
    EngineConfig::default()
        .with_poll_timeout(Duration::from_millis(200))
        .with_commit(1, Duration::from_millis(100))
}

/// Tried as an operator would: a topic with records another producer wrote (no headers,
/// garbage headers, a non-numeric version, an empty value) between good ones. The engine parks
/// each with its raw record and the partition continues to its end; a restart of the consumer
/// does not stop at any of them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_parks_malformed_records_and_the_partition_continues() {
    let brokers = require!(brokers("source_engine_park"));
    let topic = unique("poison");
    let group = unique("group");
    create_topic(&brokers, &topic, 1, &[]).await;
    let a1 = event("a", 1);
    let empty = event("e", 1);
    let mut garbage = vec![("x".to_owned(), Some(vec![0xc3, 0x28]))];
    garbage.push((wire::EVENT_ID.into(), Some(b"\x00\x01".to_vec())));
    let bad_version = replace(
        &headers_of(&event("m", 2)),
        wire::AGGREGATE_VERSION,
        Some(b"two"),
    );
    produce_raw(
        &brokers,
        &topic,
        &[
            (Some(headers_of(&a1)), Some(a1.payload.bytes.clone())),
            (None, Some(b"{\"no\": \"headers\"}".to_vec())),
            (Some(garbage), Some(b"{}".to_vec())),
            (Some(bad_version), Some(b"{}".to_vec())),
            (Some(headers_of(&empty)), Some(Vec::new())),
        ],
    )
    .await;
    let later = [event("b", 1), event("m", 3)];
    publish_each(&brokers, &topic, &later).await;
    let total = 7;

    let db = MemoryDb::default();
    let processor = InboxProcessor::new("projection", MemoryInboxStore::new(&db), JsonProjection);
    let mut engine = ConsumerEngine::new(
        source(&brokers, &group, &topic).build().unwrap(),
        processor,
        fast(),
        1,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.report().received < total {
        assert!(Instant::now() < deadline, "{:?}", engine.report());
        engine.step().await.unwrap();
    }
    let report = engine
        .run_until_quiet(Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(report.applied, 2, "a v1 and b v1: {report:?}");
    assert_eq!(
        report.parked, 4,
        "no headers, garbage, bad version, empty value"
    );
    assert_eq!(report.waiting, 1, "m v3 waits behind m's undecodable v2");
    let parked = engine
        .parked()
        .list(&outbox_core::ParkedFilter::open())
        .await
        .unwrap();
    let empty_value = parked
        .iter()
        .find(|p| p.record.position.offset == 4)
        .expect("the empty value parked");
    assert!(
        empty_value.reason.contains("not JSON"),
        "{}",
        empty_value.reason
    );
    assert_eq!(empty_value.record.value.as_deref(), Some([].as_slice()));
    let src = engine.source();
    assert_eq!(committed(src, &topic, 0).await, Some(total as i64));
    drop(engine);

    // A restart does not stop at the malformed records again: nothing is redelivered.
    let processor = InboxProcessor::new("projection", MemoryInboxStore::new(&db), JsonProjection);
    let mut engine = ConsumerEngine::new(
        source(&brokers, &group, &topic).build().unwrap(),
        processor,
        fast(),
        2,
    )
    .unwrap();
    let report = engine
        .run_until_quiet(Duration::from_secs(8))
        .await
        .unwrap();
    assert_eq!(report.received, 0, "{report:?}");
}

// ---------------------------------------------------------------------------------------------
// Parallelism under the watermark

/// Applies everything except aggregate `slow`, which waits for a gate.
#[derive(Clone)]
struct Gated {
    gate: Arc<tokio::sync::Semaphore>,
    running: Arc<std::sync::atomic::AtomicUsize>,
    max_running: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait]
impl Handler<MemoryTx> for Gated {
    async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.running.fetch_add(1, SeqCst) + 1;
        self.max_running.fetch_max(now, SeqCst);
        if e.aggregate_id == "slow" {
            self.gate.acquire().await.expect("gate").forget();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        tx.put("applied", &e.event_id.to_string(), serde_json::json!(1));
        self.running.fetch_sub(1, SeqCst);
        Ok(())
    }
}

/// Three partitions, one aggregate hanging: the other partitions and the other aggregates of
/// the hanging one's partition are applied and committed around it; its partition's committed
/// offset stays at the hanging message until it finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_and_aggregates_apply_in_parallel_without_committing_past_an_unfinished_offset()
{
    let brokers = require!(brokers("source_parallel"));
    let topic = unique("parallel");
    let group = unique("group");
    create_topic(&brokers, &topic, 3, &[]).await;
    let mut events = vec![event("slow", 1)];
    events.extend((0..30).map(|i| event(&format!("p{i}"), 1)));
    let acks = publish_each(&brokers, &topic, &events).await;
    let slow = acks[0].clone();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for a in &acks {
        let e = ends.entry(a.partition).or_insert(0);
        *e = (*e).max(a.offset + 1);
    }
    assert_eq!(ends.len(), 3, "keys spread over all partitions");

    let handler = Gated {
        gate: Arc::new(tokio::sync::Semaphore::new(0)),
        running: Arc::default(),
        max_running: Arc::default(),
    };
    let db = MemoryDb::default();
    let processor = InboxProcessor::new("parallel", MemoryInboxStore::new(&db), handler.clone());
    let mut engine = ConsumerEngine::new(
        source(&brokers, &group, &topic).build().unwrap(),
        processor,
        // One message per transaction: only the hanging message itself waits (with larger
        // batches, the messages sharing its transaction wait with it).
        fast().with_concurrency(4).with_max_batch(1),
        3,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.report().applied < 30 {
        assert!(Instant::now() < deadline, "{:?}", engine.report());
        engine.step().await.unwrap();
    }
    for _ in 0..20 {
        engine.step().await.unwrap();
    }
    engine.commit_final().await.unwrap();
    let src = engine.source();
    assert_eq!(
        committed(src, &topic, slow.partition).await.unwrap_or(0),
        slow.offset,
        "the hanging message's partition committed past it"
    );
    for (p, end) in &ends {
        if *p != slow.partition {
            assert_eq!(
                committed(src, &topic, *p).await,
                Some(*end),
                "partition {p}"
            );
        }
    }
    assert!(
        handler
            .max_running
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 2,
        "nothing ran in parallel"
    );
    handler.gate.add_permits(1);
    let report = engine
        .run_until_quiet(Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(report.applied, 31);
    for (p, end) in &ends {
        assert_eq!(committed(engine.source(), &topic, *p).await, Some(*end));
    }
}

// ---------------------------------------------------------------------------------------------
// Lag and retention

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_and_the_topics_retention_come_from_the_broker() {
    let brokers = require!(brokers("source_lag"));
    let topic = unique("lag");
    let plain = unique("plain");
    create_topic(&brokers, &topic, 1, &[("retention.ms", "3600000")]).await;
    create_topic(&brokers, &plain, 1, &[]).await;
    let events: Vec<Envelope> = (1..=5).map(|v| event("l", v)).collect();
    publish_each(&brokers, &topic, &events).await;
    let src = source(&brokers, &unique("group"), &topic).build().unwrap();
    let got = poll_n(&src, 5, Duration::from_secs(30)).await;
    src.commit(&[got[2].position.next()]).await.unwrap();
    let lag = src.lag().await.unwrap();
    assert_eq!(lag.len(), 1);
    assert_eq!((lag[0].committed, lag[0].end), (Some(3), 5));
    assert_eq!(lag[0].lag(), 2);
    assert_eq!(lag[0].lost_to_retention(), None);

    let info = outbox_kafka::topic_retention(&brokers, &[&topic, &plain], Duration::from_secs(5))
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    assert_eq!(info[0].retention, TopicRetention::Limited(hour));
    assert!(!info[0].compacted);
    // tansu does not report a retention.ms that was not set at creation; Kafka reports its
    // default. Either way the check has a figure to work with.
    assert!(matches!(
        info[1].retention,
        TopicRetention::Unknown | TopicRetention::Limited(_)
    ));
    // The inbox keeps 30 minutes; the topic keeps an hour: refused.
    let err = info[0]
        .check(Some(hour / 2))
        .evaluate(Strictness::Refuse)
        .unwrap_err();
    assert!(err.to_string().contains("dedup retention"), "{err}");
    // Two hours cover the hour plus 30 minutes of lag and 15 of replay.
    info[0]
        .check(Some(2 * hour))
        .max_lag(hour / 2)
        .replay_window(hour / 4)
        .evaluate(Strictness::Refuse)
        .unwrap();
    let missing =
        outbox_kafka::topic_retention(&brokers, &[&unique("nope")], Duration::from_secs(5)).await;
    assert!(missing.is_err(), "{missing:?}");
}
