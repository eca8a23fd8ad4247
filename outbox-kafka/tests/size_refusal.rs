//! Adversary pass on issue 20, item 12: a "message too large" refusal is classed by the
//! record's own size against its topic's `max.message.bytes`, because librdkafka fails every
//! record of a refused batch alike. tansu reports a topic's `max.message.bytes` but does not
//! enforce it, so the broker is scripted here: it packs each `publish` call's records into
//! record batches of at most the producer's `batch.size` (a record larger than that goes alone,
//! as librdkafka sends it) and refuses every record of a batch larger than the topic's limit with
//! `MSG_SIZE_TOO_LARGE`; each refusal is classed by the publisher's own rule
//! (`outbox_kafka::size::size_refusal_error`, with the record's exact batch size from
//! `envelope_batch_bytes`). The real relay runs over the in-memory store. Those tests need no
//! service.
//!
//! Whether `envelope_batch_bytes` is the size the broker compares is measured on the wire:
//! the real publisher sends through a proxy of the test to a tansu broker of its own, and the
//! proxy reads the record batches of the produce requests (needs the tansu binary, as
//! `outage.rs`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{create_topic, free_port, tansu_bin, unique, Tansu};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimMode, DeliveryStatus, Envelope, ParkKind, Payload,
    PublishResult, Publisher, Relay, RelayConfig, RetryPolicy, SystemClock,
};
use outbox_kafka::size::{envelope_batch_bytes, size_refusal_error};
use outbox_kafka::KafkaPublisher;
use outbox_testkit::{MemoryDb, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

const TOPIC: &str = "orders";

/// The scripted broker and librdkafka's batching in front of it.
struct ScriptedBroker {
    /// The topic's `max.message.bytes`.
    topic_limit: u64,
    /// The producer's `batch.size`.
    batch_size: u64,
    /// Record batches the broker refused (their record counts).
    refused: Mutex<Vec<usize>>,
    offset: Mutex<i64>,
}

impl ScriptedBroker {
    fn new(topic_limit: u64, batch_size: u64) -> Arc<Self> {
        Arc::new(Self {
            topic_limit,
            batch_size,
            refused: Mutex::new(Vec::new()),
            offset: Mutex::new(0),
        })
    }
}

struct Scripted(Arc<ScriptedBroker>);

#[async_trait]
impl Publisher for Scripted {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let broker = &self.0;
        // Batches in order: a record joins the open batch while the batch stays within
        // batch.size; a record larger than batch.size is sent alone.
        let mut batches: Vec<(Vec<usize>, u64)> = Vec::new();
        for (i, e) in batch.iter().enumerate() {
            let bytes = envelope_batch_bytes(e);
            match batches.last_mut() {
                Some((members, size)) if *size + bytes <= broker.batch_size => {
                    members.push(i);
                    *size += bytes;
                }
                _ => batches.push((vec![i], bytes)),
            }
        }
        let mut results: Vec<Option<PublishResult>> = vec![None; batch.len()];
        for (members, size) in batches {
            if size > broker.topic_limit {
                broker.refused.lock().unwrap().push(members.len());
                let err = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
                for i in members {
                    let own = envelope_batch_bytes(batch[i]);
                    results[i] = Some(Err(size_refusal_error(
                        TOPIC,
                        &err,
                        own,
                        Some(broker.topic_limit),
                        false,
                    )));
                }
            } else {
                let mut offset = broker.offset.lock().unwrap();
                for i in members {
                    results[i] = Some(Ok(AckMetadata::kafka(TOPIC, 0, *offset)));
                    *offset += 1;
                }
            }
        }
        results.into_iter().map(Option::unwrap).collect()
    }

    fn delivery_timeout(&self) -> Duration {
        Duration::from_secs(1)
    }
}

fn record(id: &str, payload_bytes: usize) -> Envelope {
    Envelope::builder("order", id, 1, "order.changed")
        .payload(Payload::new(
            "application/octet-stream",
            vec![b'x'; payload_bytes],
        ))
        .build()
        .unwrap()
}

/// Runs the relay over `events` against `broker` until nothing is left to do; returns the
/// store.
async fn relay_through(broker: &Arc<ScriptedBroker>, events: &[Envelope]) -> MemoryOutboxStore {
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(
        &db,
        ClaimMode::Lease {
            duration: Duration::from_secs(30),
        },
    );
    let mut tx = db.begin();
    store.append(&mut tx, events).await.unwrap();
    tx.commit().unwrap();
    let config = RelayConfig::builder()
        .owner("size")
        .batch_size(100)
        .retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(1))
                .max_delay(Duration::from_millis(5))
                .max_attempts(2)
                .build()
                .unwrap(),
        )
        .circuit_breaker(Duration::from_millis(5), Duration::from_millis(20))
        .idle(Duration::from_millis(1), Duration::from_millis(5))
        .build()
        .unwrap();
    let mut relay = Relay::new(
        store.clone(),
        Scripted(Arc::clone(broker)),
        config,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(12)),
    )
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        relay.run_once().await.unwrap();
        let stats = store.stats().await.unwrap();
        if stats.unpublished == 0 {
            return store;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relay does not finish: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn status_of(store: &MemoryOutboxStore, e: &Envelope) -> (DeliveryStatus, u32, Option<ParkKind>) {
    let row = store.row(e.event_id).unwrap();
    (row.status, row.attempts, row.park_reason.map(|r| r.kind))
}

/// One record too large for the topic among small ones, with the producer's batch within the
/// topic's limit (what start-up enforces): the large record goes in a batch of its own, is
/// refused and parked as a permanent error; the small ones are published at once, no attempt
/// spent.
#[tokio::test]
async fn one_oversize_record_among_small_ones_parks_only_itself() {
    let broker = ScriptedBroker::new(10_000, 10_000);
    let small: Vec<_> = (0..6).map(|i| record(&format!("s{i}"), 1_000)).collect();
    let big = record("big", 12_000);
    let mut events = small[..3].to_vec();
    events.push(big.clone());
    events.extend_from_slice(&small[3..]);
    let store = relay_through(&broker, &events).await;
    assert_eq!(
        status_of(&store, &big),
        (DeliveryStatus::Parked, 1, Some(ParkKind::PermanentError))
    );
    for e in &small {
        assert_eq!(status_of(&store, e), (DeliveryStatus::Published, 0, None));
    }
    assert_eq!(
        *broker.refused.lock().unwrap(),
        vec![1],
        "the large one alone"
    );
}

/// The topic's limit was lowered below the producer's batch size after start (start-up refuses
/// this, a later topic change does not stop a running relay): the broker refuses the batch that
/// holds the large record and small ones, and librdkafka fails every record of it. The large
/// record is parked; the small ones were only in its batch: they are put back without spending
/// an attempt and published by the next cycle (their own batch fits). None of them is parked.
#[tokio::test]
async fn a_batch_refused_for_its_oversize_record_parks_only_that_record() {
    let broker = ScriptedBroker::new(10_000, 100_000);
    let small: Vec<_> = (0..5).map(|i| record(&format!("s{i}"), 1_000)).collect();
    let big = record("big", 10_000);
    assert!(envelope_batch_bytes(&big) > 10_000);
    let mut events = small[..2].to_vec();
    events.push(big.clone());
    events.extend_from_slice(&small[2..]);
    let store = relay_through(&broker, &events).await;
    assert_eq!(
        status_of(&store, &big),
        (DeliveryStatus::Parked, 1, Some(ParkKind::PermanentError))
    );
    for e in &small {
        assert_eq!(status_of(&store, e), (DeliveryStatus::Published, 0, None));
    }
    assert_eq!(
        *broker.refused.lock().unwrap(),
        vec![6],
        "one batch of all six"
    );
}

/// A record whose batch is exactly the topic's limit is accepted (the broker refuses only
/// larger batches), and one byte more is refused as the record's own: the record's size is
/// counted exactly, so a record just too large is never taken for a batch problem (retried
/// without end, holding up its batch) nor one that fits parked.
#[tokio::test]
async fn the_records_own_size_at_and_one_byte_past_the_limit() {
    let base = record("edge", 0);
    let overhead = envelope_batch_bytes(&base);
    // Find the payload that makes the record's batch exactly 10,000 bytes.
    let mut payload = (10_000 - overhead) as usize;
    while envelope_batch_bytes(&record("edge", payload)) > 10_000 {
        payload -= 1;
    }
    let at = record("edge", payload);
    assert_eq!(
        envelope_batch_bytes(&at),
        10_000,
        "a record exactly at the limit"
    );
    let past = record("edgf", payload + 1);
    assert_eq!(envelope_batch_bytes(&past), 10_001);
    let broker = ScriptedBroker::new(10_000, 10_000);
    let store = relay_through(&broker, &[at.clone(), past.clone()]).await;
    assert_eq!(status_of(&store, &at), (DeliveryStatus::Published, 0, None));
    assert_eq!(
        status_of(&store, &past),
        (DeliveryStatus::Parked, 1, Some(ParkKind::PermanentError))
    );
    let err = size_refusal_error(
        TOPIC,
        &KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge),
        envelope_batch_bytes(&at),
        Some(10_000),
        false,
    );
    assert_eq!(err.class, outbox_core::ErrorClass::Transient, "{err}");
}

/// Forwards connections from `listen` to `to` (threads: the proxy lives as long as the test
/// process), keeping every byte a client sent.
fn proxy(listen: u16, to: u16) -> Arc<Mutex<Vec<Vec<u8>>>> {
    use std::io::{Read, Write};
    let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let keep = Arc::clone(&sent);
    let listener = std::net::TcpListener::bind(("127.0.0.1", listen)).unwrap();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { continue };
            let Ok(mut server) = std::net::TcpStream::connect(("127.0.0.1", to)) else {
                continue;
            };
            let (mut back_from, mut back_to) =
                (server.try_clone().unwrap(), client.try_clone().unwrap());
            let slot = {
                let mut all = keep.lock().unwrap();
                all.push(Vec::new());
                all.len() - 1
            };
            let keep = Arc::clone(&keep);
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = client.read(&mut buf) {
                    if n == 0 || server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    keep.lock().unwrap()[slot].extend_from_slice(&buf[..n]);
                }
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut back_from, &mut back_to);
            });
        }
    });
    sent
}

/// Sizes of the one-record batches (message format v2) in `bytes`, as the broker measures
/// them: the 12 bytes of base offset and length, and the length.
fn one_record_batches(bytes: &[u8]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 61 <= bytes.len() {
        let w = &bytes[i..];
        let len = u32::from_be_bytes([w[8], w[9], w[10], w[11]]) as usize;
        let records = u32::from_be_bytes([w[57], w[58], w[59], w[60]]);
        if w[..8].iter().all(|b| *b == 0)
            && w[16] == 2
            && records == 1
            && len >= 49
            && i + 12 + len <= bytes.len()
        {
            out.push(12 + len as u64);
            i += 12 + len;
        } else {
            i += 1;
        }
    }
    out
}

/// The size the publisher classes a refusal by is the size of the record batch librdkafka
/// really sends for the record alone, byte for byte, measured on the wire for records whose
/// fields cross varint boundaries (empty and large payloads, many and long headers, multibyte
/// ids): a record counted smaller than it is would be taken for a batch problem when it is too
/// large itself (retried without end, holding up its batch), one counted larger parked when it
/// fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counted_size_is_the_batch_librdkafka_sends() {
    let bin = require!(tansu_bin("size_on_the_wire"));
    let (port, front) = (free_port(), free_port());
    let sent = proxy(front, port);
    let _broker = Tansu::start_advertising(&bin, port, front);
    let brokers = format!("127.0.0.1:{front}");
    let topic = unique("wire_sizes");
    create_topic(&brokers, &topic, 1, &[]).await;
    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("start");
    let mut records = Vec::new();
    for (id, payload, headers) in [
        ("a", 0usize, 0usize),
        ("order-1", 63, 1),
        ("ü".repeat(40).as_str(), 64, 3),
        ("x".repeat(200).as_str(), 8191, 0),
        ("y", 8192, 20),
        ("z", 200_000, 2),
    ] {
        let mut b = Envelope::builder("order", id, 1, "order.changed")
            .payload(Payload::new("application/octet-stream", vec![7u8; payload]));
        for h in 0..headers {
            b = b.header(format!("h{h}"), "v".repeat(h * 10));
        }
        records.push(b.build().unwrap());
    }
    for e in &records {
        // One record per call: its own batch.
        let results = publisher.publish(&[e]).await;
        assert!(results[0].is_ok(), "{:?}", results[0]);
    }
    let sent = sent.lock().unwrap().concat();
    let measured = one_record_batches(&sent);
    let counted: Vec<u64> = records.iter().map(envelope_batch_bytes).collect();
    assert_eq!(
        measured, counted,
        "the broker's measure vs the publisher's count"
    );
}
