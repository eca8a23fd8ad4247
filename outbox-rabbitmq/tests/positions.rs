//! What a [`RabbitSource`] delivery is called, against a real RabbitMQ: the engine orders and
//! commits by the channel's delivery tag (`ack multiple` is its watermark), and the message
//! keeps the exchange and routing key it was published with and the broker's redelivered
//! flag as its native identity, in the parked table too (on the real PostgreSQL inbox).

mod common;

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::inbox::{Db, Effects, PgTx};
use common::{event, require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{
    async_trait, AckMetadata, AckModel, Envelope, InboxParking, MessageSource, NativePosition,
    ParkedFilter, ParkedStatus, Publisher, ReceivedMessage,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher, RabbitSource};

struct Setup {
    url: String,
    topology: Topology,
    queue: String,
    publisher: RabbitPublisher,
}

impl Setup {
    async fn new(test: &str) -> Option<Self> {
        let url = common::amqp_url(test)?;
        let mut topology = Topology::exchange(&url, "pos", LapinKind::Topic, true).await;
        let queue = topology.queue("#", quorum_arguments(true)).await;
        let publisher = RabbitPublisher::builder(&url, &topology.exchange)
            .start()
            .await
            .expect("publisher");
        Some(Self {
            url,
            topology,
            queue,
            publisher,
        })
    }

    /// Publishes versions of `agg`; returns each one's routing key (from its confirm).
    async fn fill(&self, agg: &str, versions: std::ops::RangeInclusive<i64>) -> Vec<String> {
        let events: Vec<Envelope> = versions.map(|v| event("order", agg, v)).collect();
        self.publisher
            .publish(&events.iter().collect::<Vec<_>>())
            .await
            .into_iter()
            .map(|r| match r.expect("published") {
                AckMetadata::RabbitMq {
                    exchange,
                    routing_key,
                } => {
                    assert_eq!(exchange, self.topology.exchange);
                    routing_key
                }
                other => panic!("not a confirm: {other:?}"),
            })
            .collect()
    }

    async fn member(&self) -> RabbitSource {
        RabbitSource::builder(&self.url, &self.queue)
            .prefetch(100)
            .start()
            .await
            .expect("source")
            .0
    }
}

async fn poll_n(source: &RabbitSource, n: usize) -> Vec<ReceivedMessage> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n}", out.len());
        if let Some(m) = source.poll(Duration::from_millis(200)).await.expect("poll") {
            out.push(m);
        }
    }
    out
}

/// A delivery is ordered by its channel's delivery tag and named by the exchange and routing
/// key it was published with; given back by a member that died (its channel closed), it comes
/// again marked redelivered, at a tag of the new channel.
#[tokio::test]
async fn a_delivery_names_its_exchange_routing_key_and_redelivery() {
    let s = require!(Setup::new("rabbit_position_native").await);
    let keys = s.fill("n-1", 1..=2).await;
    let first = s.member().await;
    assert_eq!(first.ack_model(), AckModel::ContiguousWatermark);
    let got = poll_n(&first, 2).await;
    for (i, m) in got.iter().enumerate() {
        let p = &m.position;
        assert_eq!(
            (p.topic.as_str(), p.partition, p.offset),
            (s.queue.as_str(), 0, i as i64 + 1)
        );
        assert_eq!(
            p.native,
            NativePosition::RabbitMq {
                exchange: s.topology.exchange.clone(),
                routing_key: keys[i].clone(),
                redelivered: false,
            }
        );
        assert_eq!(
            p.to_string(),
            format!(
                "queue {} tag {} (exchange {}, routing key {})",
                s.queue,
                i + 1,
                s.topology.exchange,
                keys[i]
            )
        );
    }
    drop(first); // a crash: its channel closes, both deliveries go back to the queue
    let second = s.member().await;
    let again = poll_n(&second, 2).await;
    for (i, m) in again.iter().enumerate() {
        assert_eq!(m.position.offset, i as i64 + 1, "the new channel's tags");
        assert_eq!(
            m.position.native,
            NativePosition::RabbitMq {
                exchange: s.topology.exchange.clone(),
                routing_key: keys[i].clone(),
                redelivered: true,
            }
        );
        assert!(m.position.to_string().ends_with(", redelivered)"));
    }
    second.close().await;
}

/// Applies every event but version `fail`, which fails permanently.
struct FailVersion {
    fail: i64,
    inner: Effects,
}

#[async_trait]
impl Handler<PgTx> for FailVersion {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        if e.aggregate_version == self.fail {
            return Err(HandlerError::permanent("version refused by the test"));
        }
        self.inner.handle(tx, e).await
    }
}

/// A message the handler refuses is parked with the exchange and routing key it was
/// published with (the delivery tag alone means nothing once its channel is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_keeps_its_exchange_and_routing_key() {
    let s = require!(Setup::new("rabbit_position_parked").await);
    let db = require!(Db::new("rabbit_position_parked").await);
    let keys = s.fill("p-1", 1..=3).await;
    let inbox = db.inbox().await;
    let processor = InboxProcessor::new(
        "rabbit-parked-position",
        inbox.clone(),
        FailVersion {
            fail: 2,
            inner: Effects {
                schema: db.schema.clone(),
                applied: Arc::new(AtomicUsize::new(0)),
            },
        },
    );
    let config = EngineConfig::default().with_commit(10, Duration::from_millis(100));
    let mut engine = ConsumerEngine::new(s.member().await, processor, config, 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.report().parked < 1 {
        assert!(Instant::now() < deadline, "nothing parked");
        engine.step().await.unwrap();
    }
    engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    let parked = inbox
        .list_parked("rabbit-parked-position", &ParkedFilter::open())
        .await
        .unwrap();
    let head = parked
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .expect("the refused version is parked");
    assert_eq!(head.record.aggregate_version, Some(2));
    let p = &head.record.position;
    assert_eq!((p.topic.as_str(), p.offset), (s.queue.as_str(), 2));
    assert_eq!(
        p.native,
        NativePosition::RabbitMq {
            exchange: s.topology.exchange.clone(),
            routing_key: keys[1].clone(),
            redelivered: false,
        },
        "{p}"
    );
    let waiting = parked
        .iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .expect("version 3 waits");
    assert!(
        matches!(&waiting.record.position.native, NativePosition::RabbitMq { routing_key, .. } if *routing_key == keys[2]),
        "{}",
        waiting.record.position
    );
    assert_eq!(db.applied("p-1").await, vec![1]);
}
