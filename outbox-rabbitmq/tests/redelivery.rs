//! An undecodable message that RabbitMQ gives back to the queue (its channel closed before the
//! ack) comes again at a delivery tag of the new channel: it is parked once, by its
//! `message_id`; without one, once per tag (documented). Against a real RabbitMQ and the real
//! PostgreSQL inbox.

mod common;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::inbox::Effects;
use common::{event, require, Topology};
use lapin::options::BasicPublishOptions;
use lapin::BasicProperties;
use lapin::ExchangeKind as LapinKind;
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, AckModel, CommitOffset, InboxParking, LogPosition, MessageSource, ParkedFilter,
    ParkedMessage, PartitionLag, Publisher, ReceivedMessage, SourceError, TopicPartition,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, EngineReport, InboxProcessor};
use outbox_rabbitmq::{quorum_arguments, RabbitSource};

/// A source whose commits never pass `max_next`: the member acknowledges what comes before
/// and crashes holding the rest.
struct AckBelow {
    inner: RabbitSource,
    max_next: i64,
}

#[async_trait]
impl MessageSource for AckBelow {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        self.inner.poll(timeout).await
    }
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        let clamped: Vec<CommitOffset> = offsets
            .iter()
            .map(|c| {
                CommitOffset::new(
                    c.topic.clone(),
                    c.partition,
                    c.next_offset.min(self.max_next),
                )
            })
            .collect();
        self.inner.commit(&clamped).await
    }
    fn ack_model(&self) -> AckModel {
        self.inner.ack_model()
    }
    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        self.inner.attach_offsets(offsets);
    }
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        self.inner.lag().await
    }
    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        self.inner.ack_ahead(positions).await
    }
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        self.inner.pause(partitions).await
    }
    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        self.inner.resume(partitions).await
    }
}

/// An event (tag 1) and then an undecodable message (tag 2, with `message_id` when given). The
/// first member applies the event, parks the undecodable message, acknowledges tag 1 only and
/// crashes: the message goes back to the queue and comes to the next member at tag 1 of its
/// channel, marked redelivered. Returns the parked copies and the second member's report.
async fn requeued_undecodable(
    test: &str,
    message_id: Option<&str>,
) -> Option<(Vec<ParkedMessage>, EngineReport)> {
    let url = common::amqp_url(test)?;
    let db = common::inbox_db(test).await?;
    let mut topology = Topology::exchange(&url, "undec", LapinKind::Topic, true).await;
    let queue = topology.queue("#", quorum_arguments(true)).await;
    let publisher = outbox_rabbitmq::RabbitPublisher::builder(&url, &topology.exchange)
        .start()
        .await
        .expect("publisher");
    let good = event("order", "u-1", 1);
    publisher.publish(&[&good]).await.remove(0).unwrap();
    let mut props = BasicProperties::default();
    if let Some(id) = message_id {
        props = props.with_message_id(id.into());
    }
    topology
        .channel
        .basic_publish(
            &topology.exchange,
            "junk",
            BasicPublishOptions::default(),
            b"not an envelope",
            props,
        )
        .await
        .expect("publish")
        .await
        .expect("published");
    let consumer = "rabbit-undecodable";
    let inbox = db.inbox().await;
    let processor = || {
        InboxProcessor::new(
            consumer,
            inbox.clone(),
            Effects {
                schema: db.schema.clone(),
                applied: Arc::new(AtomicUsize::new(0)),
            },
        )
    };
    let member = || async {
        RabbitSource::builder(&url, &queue)
            .prefetch(100)
            .start()
            .await
            .expect("source")
            .0
    };
    let config = || EngineConfig::default().with_commit(1, Duration::from_millis(100));
    {
        let source = AckBelow {
            inner: member().await,
            max_next: 2,
        };
        let mut engine = ConsumerEngine::new(source, processor(), config(), 1).expect("engine");
        let deadline = Instant::now() + Duration::from_secs(20);
        while engine.report().parked < 1 || engine.report().applied < 1 {
            assert!(Instant::now() < deadline, "not applied and parked");
            engine.step().await.unwrap();
        }
        let report = engine
            .run_until_quiet(Duration::from_millis(300))
            .await
            .unwrap();
        assert!(report.commits >= 1, "tag 1 acknowledged: {report:?}");
        // Dropped: its channel closes and tag 2 goes back to the queue.
    }
    let mut engine = ConsumerEngine::new(member().await, processor(), config(), 2).expect("engine");
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.report().received < 1 {
        assert!(Instant::now() < deadline, "the message did not come again");
        engine.step().await.unwrap();
    }
    let report = engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(report.received, 1, "only the requeued message: {report:?}");
    assert_eq!(topology.depth(&queue).await, 0, "acknowledged at last");
    let parked = inbox
        .list_parked(consumer, &ParkedFilter::open().all())
        .await
        .unwrap();
    Some((parked, report))
}

fn positions(parked: &[ParkedMessage]) -> Vec<String> {
    parked
        .iter()
        .map(|m| m.record.position.to_string())
        .collect()
}

/// With a `message_id` (the outbox publisher always sets one), the requeued message is found
/// parked already: one parked copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_requeued_at_another_tag_is_parked_once() {
    let (parked, report) =
        require!(requeued_undecodable("rabbit_undecodable_once", Some("junk-1")).await);
    assert_eq!(
        parked.len(),
        1,
        "one parked copy: {:#?}",
        positions(&parked)
    );
    assert_eq!((report.parked, report.already_parked), (0, 1), "{report:?}");
}

/// Without a `message_id` nothing identifies the message across deliveries: it is parked
/// once per (queue, tag), so its redelivery at another tag is parked a second time (the
/// documented limit: two copies, never a loss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_message_id_a_requeued_undecodable_message_is_parked_per_tag() {
    let (parked, report) = require!(requeued_undecodable("rabbit_undecodable_no_id", None).await);
    assert_eq!(parked.len(), 2, "{:#?}", positions(&parked));
    assert_eq!((report.parked, report.already_parked), (1, 0), "{report:?}");
}
