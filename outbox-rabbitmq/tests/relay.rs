//! The real relay drains an outbox into RabbitMQ through a broker outage: the relay over the
//! in-memory store publishes through [`RabbitPublisher`] to a RabbitMQ node of this test's
//! own, which is stopped for longer than the attempt limit allows and started again (SIGTERM:
//! see `outage.rs` for why not SIGKILL). The backlog must drain with nothing parked and no
//! attempt spent, every event must be in the durable quorum queue, and per aggregate the first
//! copies must be queued in version order.
//!
//! Needs `rabbitmq-server`; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::{require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::prelude::*;
use outbox_core::{
    wire, ClaimMode, DeliveryStatus, Envelope, Relay, RelayConfig, RetryPolicy, SystemClock,
};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher};
use outbox_test_support::RabbitNode;
use outbox_testkit::{MemoryDb, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

const AGGREGATES: usize = 30;
const VERSIONS: i64 = 8;
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_ATTEMPTS: u32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_through_a_broker_outage_in_order_with_nothing_parked() {
    common::init_tracing();
    let mut node = require!(RabbitNode::start("rabbit_relay_outage", &[]));
    let url = node.url();
    let mut t = Topology::exchange(&url, "relay", LapinKind::Topic, true).await;
    let q = t.queue("#", quorum_arguments(false)).await;

    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(
        &db,
        ClaimMode::Lease {
            duration: Duration::from_secs(30),
        },
    );
    let mut events = Vec::new();
    for version in 1..=VERSIONS {
        for a in 0..AGGREGATES {
            events.push(
                Envelope::builder("order", format!("order-{a:02}"), version, "order.changed")
                    .build()
                    .unwrap(),
            );
        }
    }
    let mut tx = db.begin();
    store.append(&mut tx, &events).await.unwrap();
    tx.commit().unwrap();
    let total = events.len();

    let publisher = RabbitPublisher::builder(&url, &t.exchange)
        .delivery_timeout(DELIVERY_TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .start()
        .await
        .expect("start");
    let config = RelayConfig::builder()
        .owner("rabbit-relay")
        .batch_size(AGGREGATES)
        .retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(50))
                .max_delay(Duration::from_millis(500))
                .max_attempts(MAX_ATTEMPTS)
                .build()
                .unwrap(),
        )
        .circuit_breaker(Duration::from_millis(200), Duration::from_secs(1))
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .build()
        .unwrap();
    let mut relay = Relay::new(
        store.clone(),
        publisher,
        config,
        std::sync::Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(5)),
    )
    .unwrap();

    let outage = DELIVERY_TIMEOUT * (MAX_ATTEMPTS + 3);
    let (mut published, mut retried, mut deferred, mut parked) = (0, 0, 0, 0);
    let mut down_since: Option<Instant> = None;
    let mut restarted = false;
    let deadline = Instant::now() + Duration::from_secs(120);
    while published < total {
        let report = relay.run_once().await.expect("no store errors");
        published += report.published;
        retried += report.retried;
        deferred += report.deferred;
        parked += report.parked + report.parked_at_claim;
        assert_eq!((parked, retried), (0, 0), "parked or spent an attempt");
        if !restarted && down_since.is_none() && published >= total / 3 {
            node.stop_gracefully();
            down_since = Some(Instant::now());
        }
        if let Some(since) = down_since {
            if !restarted && since.elapsed() >= outage {
                node.restart();
                restarted = true;
            }
        }
        assert!(
            Instant::now() < deadline,
            "not drained: {published} of {total} published"
        );
        if let Some(pause) = report.pause {
            tokio::time::sleep(pause).await;
        } else if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        } else {
            relay.reset_idle();
        }
    }
    assert!(restarted && deferred > 0, "the outage deferred nothing");
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.unpublished, stats.parked), (0, 0), "{stats:?}");
    for r in store.snapshot() {
        assert_eq!(r.status, DeliveryStatus::Published);
        assert_eq!(r.attempts, 0, "attempts spent on {:?}", r.envelope);
    }

    // The queue: every event, and per aggregate the first copies in version order.
    let reader = Topology::exchange(&url, "reader", LapinKind::Topic, true).await;
    let stored = reader.drain(&q).await;
    let mut seen: HashSet<String> = HashSet::new();
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (id, headers, body) in &stored {
        let e = wire::decode(headers, body).expect("decodes");
        assert_eq!(id, &e.event_id.to_string(), "message_id is the event id");
        if seen.insert(id.clone()) {
            order
                .entry(e.aggregate_id.clone())
                .or_default()
                .push(e.aggregate_version);
        }
    }
    assert_eq!(seen.len(), total, "every event queued");
    for (agg, versions) in &order {
        assert_eq!(versions, &(1..=VERSIONS).collect::<Vec<_>>(), "{agg}");
    }
    eprintln!(
        "rabbitmq relay outage: {total} events, {} messages queued (copies: {}), {deferred} \
         deferrals",
        stored.len(),
        stored.len() - total
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
