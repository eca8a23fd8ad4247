//! The real relay drains an outbox into RabbitMQ through a broker outage: the relay over the
//! in-memory store publishes through [`RabbitPublisher`] to a RabbitMQ node of this test's
//! own, which is stopped for longer than the attempt limit allows and started again (SIGTERM:
//! see `outage.rs` for why not SIGKILL). The backlog must drain with nothing parked and no
//! attempt spent, every event must be in the durable quorum queue, and per aggregate the first
//! copies must be queued in version order. The relay run and the check of what was stored are
//! `outbox_test_support::relay_outage`'s, shared with outbox-nats's relay test; this file
//! builds the publisher and reads the queue.
//!
//! Needs `rabbitmq-server`; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{wire, Envelope};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher};
use outbox_test_support::relay_outage::{
    assert_first_copies_in_order, drain_through_outage, DELIVERY_TIMEOUT,
};
use outbox_test_support::RabbitNode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_through_a_broker_outage_in_order_with_nothing_parked() {
    common::init_tracing();
    let mut node = require!(RabbitNode::start("rabbit_relay_outage", &[]));
    let url = node.url();
    let mut t = Topology::exchange(&url, "relay", LapinKind::Topic, true).await;
    let q = t.queue("#", quorum_arguments(false)).await;

    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .delivery_timeout(DELIVERY_TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .start()
        .await
        .expect("start");
    let drained = drain_through_outage(
        publisher,
        "rabbit-relay",
        &mut node,
        Duration::from_secs(120),
    )
    .await;

    // The queue: every event, and per aggregate the first copies in version order.
    let reader = Topology::exchange(&url, "reader", LapinKind::Topic, true).await;
    let stored = reader.drain(&q).await;
    let events = stored.iter().map(|(id, headers, body)| {
        let e = wire::decode(headers, body).expect("decodes");
        assert_eq!(id, &e.event_id.to_string(), "message_id is the event id");
        (id.clone(), e.aggregate_id, e.aggregate_version)
    });
    assert_first_copies_in_order(events, drained.total);
    eprintln!(
        "rabbitmq relay outage: {} events, {} messages queued (copies: {}), {} deferrals",
        drained.total,
        stored.len(),
        stored.len() - drained.total,
        drained.deferred
    );
    drop(t);
}

/// The documented way to spread one aggregate type over several queues: an
/// `x-consistent-hash` exchange (plugin enabled on a node of this test's own) with the
/// aggregate id as routing key. Every aggregate lands in exactly one queue, its versions in
/// order; both queues get some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consistent_hash_exchange_keeps_each_aggregate_in_one_queue_in_order() {
    common::init_tracing();
    let node = require!(RabbitNode::start(
        "rabbit_consistent_hash",
        &["rabbitmq_consistent_hash_exchange"]
    ));
    let url = node.url();
    let mut t = Topology::exchange(
        &url,
        "hash",
        LapinKind::Custom("x-consistent-hash".into()),
        true,
    )
    .await;
    // The binding key of a consistent-hash exchange is the queue's weight.
    let queues = [
        t.queue("1", quorum_arguments(false)).await,
        t.queue("1", quorum_arguments(false)).await,
    ];
    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .exchange_kind(outbox_rabbitmq::ExchangeKind::ConsistentHash)
        .routing_key(outbox_rabbitmq::RoutingKey::AggregateId)
        .start()
        .await
        .expect("start");
    for version in 1..=4 {
        let round: Vec<Envelope> = (0..20)
            .map(|a| {
                Envelope::builder("order", format!("order-{a:02}"), version, "order.changed")
                    .build()
                    .unwrap()
            })
            .collect();
        for r in
            outbox_core::Publisher::publish(&publisher, &round.iter().collect::<Vec<_>>()).await
        {
            r.expect("confirmed");
        }
    }
    let mut home: BTreeMap<String, usize> = BTreeMap::new();
    for (i, q) in queues.iter().enumerate() {
        let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (_, headers, body) in t.drain(q).await {
            let e = wire::decode(&headers, &body).unwrap();
            order
                .entry(e.aggregate_id)
                .or_default()
                .push(e.aggregate_version);
        }
        assert!(!order.is_empty(), "queue {i} got nothing");
        for (agg, versions) in order {
            assert_eq!(versions, vec![1, 2, 3, 4], "{agg} in queue {i}");
            assert!(home.insert(agg.clone(), i).is_none(), "{agg} in two queues");
        }
    }
    assert_eq!(home.len(), 20);
}
