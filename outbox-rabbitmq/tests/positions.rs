//! What a [`RabbitSource`] delivery is called, against a real RabbitMQ: the engine orders and
//! commits by the channel's delivery tag (`ack multiple` is its watermark), and the message
//! keeps the exchange and routing key it was published with and the broker's redelivered
//! flag as its native identity, in the parked table too (on the real PostgreSQL inbox).

mod common;

use common::inbox::park_version_2;
use common::{event, poll_n, require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{AckMetadata, AckModel, Envelope, MessageSource, NativePosition, Publisher};
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

/// A message the handler refuses is parked with the exchange and routing key it was
/// published with (the delivery tag alone means nothing once its channel is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_keeps_its_exchange_and_routing_key() {
    let s = require!(Setup::new("rabbit_position_parked").await);
    let db = require!(common::inbox_db("rabbit_position_parked").await);
    let keys = s.fill("p-1", 1..=3).await;
    let (head, waiting) =
        park_version_2(&db, s.member().await, "rabbit-parked-position", "p-1").await;
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
    assert!(
        matches!(&waiting.record.position.native, NativePosition::RabbitMq { routing_key, .. } if *routing_key == keys[2]),
        "{}",
        waiting.record.position
    );
}
