//! The testkit's shared suites against a real Kafka-protocol broker (`KAFKA_BROKERS`; tansu in
//! `scripts/test`): the publisher suite for [`KafkaPublisher`], records read back through a
//! plain consumer, and the message source suite for [`KafkaSource`]. Every test gets its own
//! topic and consumer group.

mod common;

use std::time::{Duration, Instant};

use outbox_core::{async_trait, AckMetadata, Envelope};
use outbox_kafka::{KafkaPublisher, KafkaSource, StartFrom};
use outbox_testkit::conformance::{
    PublisherHarness, RawRecord, ReadBack, SourceCapabilities, SourceHarness,
};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The producer's record size limit in the publisher harness (tansu does not enforce the
/// topic's `max.message.bytes`; librdkafka checks `message.max.bytes` before sending).
const MAX_RECORD_BYTES: usize = 10_000;

/// Group joins: tansu completes a join after about half the session timeout.
const SESSION_TIMEOUT: Duration = Duration::from_secs(2);

/// A member that does not poll for this long loses its assignment (the take-over check).
const MAX_POLL_INTERVAL: Duration = Duration::from_secs(3);

// ---------------------------------------------------------------------------------------------
// Publisher

struct PublisherSuite {
    brokers: String,
    publisher: KafkaPublisher,
}

impl PublisherSuite {
    async fn new(test: &str) -> Option<Self> {
        let brokers = common::brokers(test)?;
        let topic = common::unique("pub-suite");
        common::create_topic(&brokers, &topic, 3, &[]).await;
        let publisher = KafkaPublisher::builder(&brokers, &topic)
            .set("message.max.bytes", MAX_RECORD_BYTES.to_string())
            .delivery_timeout(Duration::from_secs(10))
            .start()
            .await
            .expect("start the publisher");
        Some(Self { brokers, publisher })
    }
}

/// Reads the record at `ack` with a plain consumer (no group), from the beginning of its
/// partition (tansu 0.6 cannot serve a fetch that starts inside a multi-record batch).
fn read_at(brokers: &str, ack: &AckMetadata) -> Option<ReadBack> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", common::unique("read-back"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()
        .expect("reader");
    let (topic, partition, offset) = ack.as_kafka()?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Beginning)
        .expect("partition");
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) if m.offset() == offset => {
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                return Some((
                    m.key().map(<[u8]>::to_vec),
                    headers,
                    m.payload().unwrap_or_default().to_vec(),
                ));
            }
            Some(Ok(m)) if m.offset() > offset => return None,
            Some(Ok(_)) | None => {}
            Some(Err(e)) => eprintln!("read-back: {e}"),
        }
    }
    None
}

#[async_trait]
impl PublisherHarness for PublisherSuite {
    type Publisher = KafkaPublisher;

    fn publisher(&self) -> &KafkaPublisher {
        &self.publisher
    }

    fn event(&self, aggregate_id: &str, version: i64) -> Envelope {
        Envelope::builder("conformance", aggregate_id, version, "conformance.happened")
            .json(&serde_json::json!({ "v": version }))
            .expect("json")
            .header("traceparent", TRACEPARENT)
            .header("tenant", "acme")
            .build()
            .expect("valid envelope")
    }

    fn max_record_bytes(&self) -> Option<usize> {
        Some(MAX_RECORD_BYTES)
    }

    async fn read_back(&self, ack: &AckMetadata) -> Option<ReadBack> {
        let (brokers, ack) = (self.brokers.clone(), ack.clone());
        let found = tokio::task::spawn_blocking(move || read_at(&brokers, &ack))
            .await
            .expect("read-back task");
        // The harness can read back; a record missing at its acknowledged place is a failure.
        Some(found.expect("no record at the acknowledged position"))
    }
}

mod publisher {
    outbox_testkit::publisher_conformance_tests!(optional async {
        super::PublisherSuite::new("publisher_conformance").await
    });
}

// ---------------------------------------------------------------------------------------------
// Message source

struct SourceSuite {
    brokers: String,
    topic: String,
    group: String,
    producer: FutureProducer,
    /// Reads the group's committed offsets without joining it.
    offsets: BaseConsumer,
}

impl SourceSuite {
    async fn new(test: &str) -> Option<Self> {
        let brokers = common::brokers(test)?;
        let topic = common::unique("src-suite");
        let group = common::unique("src-suite-group");
        common::create_topic(&brokers, &topic, 2, &[]).await;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("linger.ms", "0")
            .create()
            .expect("producer");
        let offsets: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("offset reader");
        Some(Self {
            brokers,
            topic,
            group,
            producer,
            offsets,
        })
    }

    fn member(&self, start: StartFrom) -> KafkaSource {
        KafkaSource::builder(&self.brokers, &self.group)
            .topic(&self.topic)
            .session_timeout(SESSION_TIMEOUT)
            .set(
                "max.poll.interval.ms",
                MAX_POLL_INTERVAL.as_millis().to_string(),
            )
            .start_from(start)
            .build()
            .expect("source")
    }
}

#[async_trait]
impl SourceHarness for SourceSuite {
    type Source = KafkaSource;

    fn capabilities(&self) -> SourceCapabilities {
        SourceCapabilities::broker()
    }

    fn topic(&self) -> String {
        self.topic.clone()
    }

    async fn produce(&self, partition: i32, record: RawRecord) -> i64 {
        // One record per produce request, awaited before the next (tansu 0.6 cannot serve a
        // fetch that starts inside a multi-record batch).
        let mut r: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).partition(partition);
        if let Some(k) = &record.key {
            r = r.key(k.as_slice());
        }
        if let Some(v) = &record.value {
            r = r.payload(v.as_slice());
        }
        let mut headers = OwnedHeaders::new();
        for h in &record.headers {
            headers = headers.insert(Header {
                key: &h.name,
                value: h.value.as_deref(),
            });
        }
        r = r.headers(headers);
        let delivery = self
            .producer
            .send(r, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .expect("produce");
        assert_eq!(delivery.partition, partition);
        delivery.offset
    }

    async fn join(&self) -> KafkaSource {
        self.member(StartFrom::Earliest)
    }

    async fn join_from_latest(&self) -> Option<KafkaSource> {
        Some(self.member(StartFrom::Latest))
    }

    async fn leave(&self, member: KafkaSource) {
        member.close().await;
    }

    async fn take_over(&self, member: &KafkaSource) -> KafkaSource {
        // The member stalls (no poll) past max.poll.interval.ms: librdkafka leaves the group
        // and the assignment is lost. The new member then owns every partition.
        let deadline = Instant::now() + MAX_POLL_INTERVAL * 10;
        while !member.assignment_lost() {
            assert!(Instant::now() < deadline, "the assignment was never lost");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.member(StartFrom::Earliest)
    }

    async fn committed(&self, partition: i32) -> Option<i64> {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&self.topic, partition);
        let got = self
            .offsets
            .committed_offsets(tpl, Duration::from_secs(10))
            .expect("committed offsets");
        match got.elements()[0].offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        }
    }
}

mod source {
    outbox_testkit::source_conformance_tests!(optional async {
        super::SourceSuite::new("source_conformance").await
    });
}
