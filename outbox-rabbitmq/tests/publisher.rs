//! [`RabbitPublisher`] against a real RabbitMQ (`AMQP_URL`, else the local broker): the
//! testkit's publisher suite, what RabbitMQ stores for each acknowledgement, unroutable
//! messages, and the start-up exchange check.
//!
//! The suite's read-back is not applicable here: a publisher confirm names no stored position,
//! so an acknowledgement ([`AckMetadata::RabbitMq`]: exchange and routing key) cannot be
//! looked up. `acknowledgements_follow_the_publish_order_of_their_messages` checks the same
//! clause with what the test knows about its own batch.

mod common;

use std::time::{Duration, Instant};

use common::{event, require, unique, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{
    async_trait, wire, AckMetadata, Envelope, ErrorClass, FailureScope, Payload, PublishErrorKind,
    Publisher,
};
use outbox_rabbitmq::{quorum_arguments, ExchangeKind, RabbitPublisher, RoutingKey, TopologyError};
use outbox_testkit::conformance::PublisherHarness;

const MAX_RECORD_BYTES: usize = 10_000;

struct PublisherSuite {
    _topology: Topology,
    publisher: RabbitPublisher,
}

impl PublisherSuite {
    async fn new(test: &str) -> Option<Self> {
        let url = common::amqp_url(test)?;
        let mut topology = Topology::exchange(&url, "pubsuite", LapinKind::Topic, true).await;
        topology.queue("conformance", quorum_arguments(true)).await;
        let publisher = RabbitPublisher::builder(&url, &topology.exchange)
            .max_message_bytes(MAX_RECORD_BYTES)
            .start()
            .await
            .expect("start");
        Some(Self {
            _topology: topology,
            publisher,
        })
    }
}

#[async_trait]
impl PublisherHarness for PublisherSuite {
    type Publisher = RabbitPublisher;

    fn publisher(&self) -> &RabbitPublisher {
        &self.publisher
    }

    fn event(&self, aggregate_id: &str, version: i64) -> Envelope {
        event("conformance", aggregate_id, version)
    }

    fn max_record_bytes(&self) -> Option<usize> {
        Some(MAX_RECORD_BYTES)
    }

    /// No queue is bound for the routing key `unroutable`.
    fn unroutable_event(&self) -> Option<Envelope> {
        Some(event("unroutable", &unique("u"), 1))
    }
}

mod suite {
    outbox_testkit::publisher_conformance_tests!(optional async {
        super::PublisherSuite::new("rabbitmq_publisher_conformance").await
    });
}

/// Each message is stored once, persistent, with the event id as `message_id` and the wire
/// headers; each acknowledgement names the exchange and the routing key the message was
/// stored under (no position: a confirm names none), and the queue bound to that key holds
/// the routable messages in publish order.
#[tokio::test]
async fn acknowledgements_follow_the_publish_order_of_their_messages() {
    let url = require!(common::amqp_url("rabbit_ack_order"));
    let mut t = Topology::exchange(&url, "ackorder", LapinKind::Topic, true).await;
    let q = t.queue("order", quorum_arguments(false)).await;
    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .start()
        .await
        .unwrap();
    let batch: Vec<Envelope> = (0..6)
        .map(|i| {
            if i == 2 {
                event("nobody", "n-1", 1)
            } else {
                event("order", &format!("o-{i}"), 1)
            }
        })
        .collect();
    let results = publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
    let mut acked: Vec<(usize, &Envelope)> = Vec::new();
    for (i, (e, r)) in batch.iter().zip(&results).enumerate() {
        match r {
            Ok(ack) => {
                assert_eq!(
                    ack,
                    &AckMetadata::RabbitMq {
                        exchange: t.exchange.clone(),
                        routing_key: "order".into(),
                    }
                );
                assert_eq!(ack.to_string(), format!("{} -> order", t.exchange));
                acked.push((i, e));
            }
            Err(err) => assert_eq!(i, 2, "{err}"),
        }
    }
    assert_eq!(
        acked.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![0, 1, 3, 4, 5],
        "2 was the returned one"
    );
    // The queue bound to the acknowledged routing key holds them, in publish order.
    let stored = t.drain(&q).await;
    assert_eq!(stored.len(), 5);
    for ((_, e), (id, headers, body)) in acked.iter().zip(&stored) {
        assert_eq!(id, &e.event_id.to_string());
        assert_eq!(&wire::decode(headers, body).expect("decodes"), *e);
    }
}

/// Mandatory routing: a message no queue is bound for is returned and reported as a clear
/// permanent error naming the exchange and routing key, never dropped silently; the rest of
/// the batch is stored.
#[tokio::test]
async fn an_unroutable_message_is_a_clear_permanent_error() {
    let url = require!(common::amqp_url("rabbit_unroutable"));
    let mut t = Topology::exchange(&url, "unroutable", LapinKind::Direct, true).await;
    let q = t.queue("order", quorum_arguments(false)).await;
    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .exchange_kind(ExchangeKind::Direct)
        .start()
        .await
        .unwrap();
    let lost = event("invoice", "i-1", 1);
    let fine = event("order", "o-1", 1);
    let results = publisher.publish(&[&lost, &fine]).await;
    let err = results[0].as_ref().expect_err("unroutable");
    assert_eq!(
        (err.kind, err.class, err.scope),
        (
            PublishErrorKind::UnknownTopic,
            ErrorClass::Permanent,
            FailureScope::Transport
        ),
        "{err}"
    );
    assert!(err.message.contains("\"invoice\""), "{}", err.message);
    assert!(err.message.contains(&t.exchange), "{}", err.message);
    assert!(err.message.contains("312"), "{}", err.message);
    assert!(results[1].is_ok());
    assert_eq!(t.depth(&q).await, 1);
}

/// A message over `max_message_bytes` fails alone, before it is sent (the broker would close
/// the channel and fail the whole batch), and the channel keeps working.
#[tokio::test]
async fn an_oversize_message_fails_alone_before_it_is_sent() {
    let url = require!(common::amqp_url("rabbit_oversize"));
    let mut t = Topology::exchange(&url, "oversize", LapinKind::Topic, true).await;
    let q = t.queue("#", quorum_arguments(false)).await;
    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .max_message_bytes(1000)
        .start()
        .await
        .unwrap();
    let mut big = event("order", "o-big", 1);
    big.payload = Payload::new("application/octet-stream", vec![0u8; 1001]);
    let small = event("order", "o-small", 1);
    let results = publisher.publish(&[&big, &small]).await;
    let err = results[0].as_ref().expect_err("oversize");
    assert_eq!(
        (err.kind, err.class, err.scope),
        (
            PublishErrorKind::RecordTooLarge,
            ErrorClass::Permanent,
            FailureScope::Record
        )
    );
    assert!(results[1].is_ok());
    assert!(publisher.publish(&[&event("order", "o-3", 1)]).await[0].is_ok());
    assert_eq!(t.depth(&q).await, 2);
}

/// Routing by aggregate id onto a consistent-hash exchange needs the plugin; here the routing
/// key itself is checked on a direct exchange bound by id.
#[tokio::test]
async fn routing_by_aggregate_id_uses_the_id_as_routing_key() {
    let url = require!(common::amqp_url("rabbit_route_by_id"));
    let mut t = Topology::exchange(&url, "byid", LapinKind::Direct, true).await;
    let q = t.queue("o-7", quorum_arguments(false)).await;
    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .exchange_kind(ExchangeKind::Direct)
        .routing_key(RoutingKey::AggregateId)
        .start()
        .await
        .unwrap();
    let results = publisher
        .publish(&[&event("order", "o-7", 1), &event("order", "o-8", 1)])
        .await;
    // The acknowledgement names the key the message was routed by: the aggregate id, the key
    // the only queue is bound with.
    assert_eq!(
        results[0].as_ref().expect("routed"),
        &AckMetadata::RabbitMq {
            exchange: t.exchange.clone(),
            routing_key: "o-7".into(),
        }
    );
    assert_eq!(
        results[1].as_ref().unwrap_err().kind,
        PublishErrorKind::UnknownTopic
    );
    assert_eq!(t.depth(&q).await, 1);
}

#[tokio::test]
async fn start_checks_the_exchange() {
    let url = require!(common::amqp_url("rabbit_exchange_check"));
    // Missing.
    let err = RabbitPublisher::builder(&url, unique("missing"))
        .start()
        .await
        .expect_err("missing exchange");
    assert!(!err.is_transient(), "{err}");
    assert!(err.to_string().contains("does not exist"), "{err}");
    // Not durable.
    let transient = Topology::exchange(&url, "transient", LapinKind::Topic, false).await;
    let err = RabbitPublisher::builder(&url, &transient.exchange)
        .start()
        .await
        .expect_err("not durable");
    match err {
        outbox_rabbitmq::StartError::Topology(TopologyError::Inequivalent { detail, .. }) => {
            assert!(detail.contains("durable"), "{detail}")
        }
        other => panic!("{other}"),
    }
    // Another type.
    let direct = Topology::exchange(&url, "direct", LapinKind::Direct, true).await;
    let err = RabbitPublisher::builder(&url, &direct.exchange)
        .exchange_kind(ExchangeKind::Topic)
        .start()
        .await
        .expect_err("other type");
    assert!(err.to_string().contains("durable topic exchange"), "{err}");
    // Right.
    let p = RabbitPublisher::builder(&url, &direct.exchange)
        .exchange_kind(ExchangeKind::Direct)
        .start()
        .await
        .expect("start");
    let report = p.exchange_report().unwrap();
    assert!(report.durable && report.confirms && report.mandatory);
    assert_eq!(report.kind, ExchangeKind::Direct);
}

#[tokio::test]
async fn an_unreachable_broker_is_a_transient_start_error_within_the_timeout() {
    common::init_tracing();
    let port = outbox_test_support::free_port();
    let started = Instant::now();
    let err = RabbitPublisher::builder(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"), "x")
        .connect_timeout(Duration::from_millis(500))
        .start()
        .await
        .expect_err("nothing listens there");
    assert!(err.is_transient(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3));
    // Publishing fails the same way, transiently and as the transport's failure.
    let p = RabbitPublisher::builder(format!("amqp://guest:guest@127.0.0.1:{port}/%2f"), "x")
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .unwrap();
    let e = event("order", "o-1", 1);
    let r = p.publish(&[&e]).await.remove(0).unwrap_err();
    assert_eq!(
        (r.class, r.scope),
        (ErrorClass::Transient, FailureScope::Transport),
        "{r}"
    );
}
