//! The real relay drains an outbox into JetStream through a server outage: the relay over the
//! in-memory store publishes through [`NatsPublisher`] to a nats-server of this test's own,
//! which is killed (SIGKILL) for longer than the attempt limit allows and started again. The
//! backlog must drain with nothing parked and no attempt spent, every event must be in the
//! stream, and per aggregate the first copies must be stored in version order.
//!
//! Needs the nats-server binary; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use common::{require, unique, TestStream};
use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, DeliveryStatus, Envelope, Relay, RelayConfig, RetryPolicy, SystemClock,
};
use outbox_nats::NatsPublisher;
use outbox_test_support::{nats_server_bin, NatsServer};
use outbox_testkit::{MemoryDb, MemoryOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;

const AGGREGATES: usize = 30;
const VERSIONS: i64 = 8;
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_ATTEMPTS: u32 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_through_a_server_outage_in_order_with_nothing_parked() {
    common::init_tracing();
    let bin = require!(nats_server_bin("nats_relay_outage"));
    let mut server = NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("relay");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;

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

    let publisher = NatsPublisher::builder(&url, &prefix)
        .delivery_timeout(DELIVERY_TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .relay_lease(Duration::from_secs(30))
        .start()
        .await
        .expect("start");
    let config = RelayConfig::builder()
        .owner("nats-relay")
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
    let deadline = Instant::now() + Duration::from_secs(90);
    while published < total {
        let report = relay.run_once().await.expect("no store errors");
        published += report.published;
        retried += report.retried;
        deferred += report.deferred;
        parked += report.parked + report.parked_at_claim;
        assert_eq!((parked, retried), (0, 0), "parked or spent an attempt");
        if !restarted && down_since.is_none() && published >= total / 3 {
            server.stop();
            down_since = Some(Instant::now());
        }
        if let Some(t) = down_since {
            if !restarted && t.elapsed() >= outage {
                server.restart();
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

    // The stream: every event, and per aggregate the first copies in version order.
    let last = stream.count().await;
    let mut seen: HashSet<String> = HashSet::new();
    let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
    let info_last = {
        let mut s = js_stream.clone();
        s.info().await.unwrap().state.last_sequence
    };
    for seq in 1..=info_last {
        let Ok(m) = js_stream.get_raw_message(seq).await else {
            continue;
        };
        let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned()).unwrap();
        if seen.insert(get("event_id")) {
            order
                .entry(get("aggregate_id"))
                .or_default()
                .push(get("aggregate_version").parse().unwrap());
        }
    }
    assert_eq!(seen.len(), total, "every event stored ({last} messages)");
    for (agg, versions) in &order {
        assert_eq!(versions, &(1..=VERSIONS).collect::<Vec<_>>(), "{agg}");
    }
    eprintln!(
        "nats relay outage: {total} events, {last} messages stored (copies: {}), {deferred} \
         deferrals",
        last as usize - total
    );
}
