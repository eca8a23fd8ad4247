//! The testkit's shared publisher suite against a real NATS server with JetStream (`NATS_URL`,
//! else the local server): every test gets its own stream. Records are read back from the
//! stream by the sequence of their `PubAck`.
//!
//! The message source suite is in `tests/source.rs` (the checks that fit JetStream, and why the
//! others do not).

mod common;

use std::time::Duration;

use common::{unique, TestStream};
use outbox_core::{async_trait, AckMetadata, Envelope};
use outbox_nats::{NatsPublisher, SubjectMapping};
use outbox_testkit::conformance::{PublisherHarness, ReadBack};

/// The stream's `max_msg_size` in the harness.
const MAX_RECORD_BYTES: usize = 10_000;

struct PublisherSuite {
    stream: TestStream,
    publisher: NatsPublisher,
}

impl PublisherSuite {
    async fn new(test: &str) -> Option<Self> {
        let url = common::nats_url(test)?;
        let prefix = unique("pubsuite");
        let stream = TestStream::create(
            &url,
            &prefix,
            &[format!("{prefix}.>")],
            None,
            Some(MAX_RECORD_BYTES as i32),
        )
        .await;
        let missing_route = unique("nostream");
        // The aggregate id goes into the subject, so a record's key can be read back from it.
        let publisher = NatsPublisher::builder(&url, &prefix)
            .subject_mapping(SubjectMapping::AggregateTypeAndId)
            .route_aggregate("unroutable", &missing_route)
            .delivery_timeout(Duration::from_secs(10))
            .connect()
            .await
            .expect("connect");
        // Not `start`: the unroutable route has no stream on purpose. The other subjects do.
        let report = publisher.check_streams().await;
        assert!(
            matches!(&report, Err(e) if e.to_string().contains(&missing_route)),
            "{report:?}"
        );
        Some(Self { stream, publisher })
    }
}

#[async_trait]
impl PublisherHarness for PublisherSuite {
    type Publisher = NatsPublisher;

    fn publisher(&self) -> &NatsPublisher {
        &self.publisher
    }

    fn event(&self, aggregate_id: &str, version: i64) -> Envelope {
        common::event("conformance", aggregate_id, version)
    }

    fn max_record_bytes(&self) -> Option<usize> {
        Some(MAX_RECORD_BYTES)
    }

    /// Aggregate type `unroutable` is routed to a subject no stream captures.
    fn unroutable_event(&self) -> Option<Envelope> {
        Some(common::event("unroutable", &unique("u"), 1))
    }

    async fn read_back(&self, ack: &AckMetadata) -> Option<ReadBack> {
        let AckMetadata::JetStream {
            stream,
            sequence,
            subject: acked,
            ..
        } = ack
        else {
            panic!("not a JetStream acknowledgement: {ack:?}");
        };
        assert_eq!(stream, &self.stream.name, "acknowledged by another stream");
        let (subject, mut headers, value) = self.stream.read(*sequence).await;
        assert_eq!(&subject, acked, "stored under another subject");
        // NATS has no record key: the aggregate id is the subject's last token.
        let key = subject.rsplit('.').next().map(|k| k.as_bytes().to_vec());
        // The message id is the transport's copy of the event id; the record is the rest.
        let id = headers
            .iter()
            .position(|(k, _)| k == "Nats-Msg-Id")
            .map(|i| headers.remove(i).1)
            .expect("every message carries Nats-Msg-Id");
        let event_id = headers
            .iter()
            .find(|(k, _)| k == "event_id")
            .map(|(_, v)| v.clone());
        assert_eq!(Some(id), event_id, "Nats-Msg-Id is the event id");
        Some((key, headers, value))
    }
}

mod publisher {
    outbox_testkit::publisher_conformance_tests!(optional async {
        super::PublisherSuite::new("publisher_conformance").await
    });
}
