//! The real relay drains an outbox into JetStream through a server outage: the relay over the
//! in-memory store publishes through [`NatsPublisher`] to a nats-server of this test's own,
//! which is killed (SIGKILL) for longer than the attempt limit allows and started again. The
//! backlog must drain with nothing parked and no attempt spent, every event must be in the
//! stream, and per aggregate the first copies must be stored in version order. The relay run
//! and the check of what was stored are `outbox_test_support::relay_outage`'s, shared with
//! outbox-rabbitmq's relay test; this file builds the publisher and reads the stream.
//!
//! Needs the nats-server binary; fails without it unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::time::Duration;

use common::{require, unique, TestStream};
use outbox_nats::NatsPublisher;
use outbox_test_support::relay_outage::{
    assert_first_copies_in_order, drain_through_outage, DELIVERY_TIMEOUT,
};
use outbox_test_support::{nats_server_bin, NatsServer};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_through_a_server_outage_in_order_with_nothing_parked() {
    common::init_tracing();
    let bin = require!(nats_server_bin("nats_relay_outage"));
    let mut server = NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("relay");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;

    let publisher = NatsPublisher::builder(&url, &prefix)
        .delivery_timeout(DELIVERY_TIMEOUT)
        .connect_timeout(Duration::from_millis(500))
        .relay_lease(Duration::from_secs(30))
        .start()
        .await
        .expect("start");
    let drained = drain_through_outage(
        publisher,
        "nats-relay",
        &mut server,
        Duration::from_secs(90),
    )
    .await;

    // The stream: every event, and per aggregate the first copies in version order.
    let last = stream.count().await;
    let js_stream = stream.js.get_stream(&stream.name).await.unwrap();
    let info_last = {
        let mut s = js_stream.clone();
        s.info().await.unwrap().state.last_sequence
    };
    let mut stored = Vec::new();
    for seq in 1..=info_last {
        let Ok(m) = js_stream.get_raw_message(seq).await else {
            continue;
        };
        let get = |k: &str| m.headers.get(k).map(|v| v.as_str().to_owned()).unwrap();
        stored.push((
            get("event_id"),
            get("aggregate_id"),
            get("aggregate_version").parse().unwrap(),
        ));
    }
    assert_first_copies_in_order(stored, drained.total);
    eprintln!(
        "nats relay outage: {} events, {last} messages stored (copies: {}), {} deferrals",
        drained.total,
        last as usize - drained.total,
        drained.deferred
    );
}

/// Acknowledges every record at once: the relay's cycle without a transport.
struct InstantAcks(std::sync::atomic::AtomicU64);

#[outbox_core::async_trait]
impl outbox_core::Publisher for InstantAcks {
    async fn publish(&self, batch: &[&outbox_core::Envelope]) -> Vec<outbox_core::PublishResult> {
        batch
            .iter()
            .map(|_| {
                let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(outbox_core::AckMetadata::kafka("instant", 0, n as i64))
            })
            .collect()
    }
    fn delivery_timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
}

/// Where one relay's cycle goes: claim, publish, decide + complete, each timed per cycle.
#[derive(Debug, Default)]
struct CycleSplit {
    cycles: u32,
    events: usize,
    claim: Duration,
    publish: Duration,
    complete: Duration,
    wall: Duration,
}

impl CycleSplit {
    fn line(&self, what: &str) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / f64::from(self.cycles.max(1));
        format!(
            "{what}: {} events in {} cycles, {:.2} s, {:.0} events/s; per cycle: claim {:.1} ms, \
             publish {:.1} ms, complete {:.1} ms (shares {:.0} / {:.0} / {:.0} %)",
            self.events,
            self.cycles,
            self.wall.as_secs_f64(),
            self.events as f64 / self.wall.as_secs_f64(),
            ms(self.claim),
            ms(self.publish),
            ms(self.complete),
            100.0 * self.claim.as_secs_f64() / self.wall.as_secs_f64(),
            100.0 * self.publish.as_secs_f64() / self.wall.as_secs_f64(),
            100.0 * self.complete.as_secs_f64() / self.wall.as_secs_f64(),
        )
    }
}

/// The schemas [`backlog`] created, dropped at the end of the harness.
static SCHEMAS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A lease-mode PostgreSQL outbox in a schema of its own, `events` events over `aggregates`.
async fn backlog(
    pool: &sqlx::PgPool,
    events: usize,
    aggregates: usize,
) -> outbox_postgres::PostgresOutboxStore {
    let schema = unique("natsprof");
    SCHEMAS.lock().unwrap().push(schema.clone());
    sqlx::query(&format!("CREATE SCHEMA \"{schema}\""))
        .execute(pool)
        .await
        .unwrap();
    let store = outbox_postgres::PostgresOutboxStore::builder(pool.clone())
        .schema(schema)
        .claim_mode(outbox_core::ClaimMode::lease(Duration::from_secs(60)).unwrap())
        .notify_channel(None)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let all: Vec<outbox_core::Envelope> = (0..events)
        .map(|i| {
            common::event(
                "order",
                &format!("agg-{}", i % aggregates),
                (i / aggregates) as i64 + 1,
            )
        })
        .collect();
    for chunk in all.chunks(1000) {
        store.append_many(pool, chunk).await.unwrap();
    }
    store
}

/// Drains `store` with the relay's steps one after the other (no prefetch), timing each.
async fn drain_split<P: outbox_core::Publisher + 'static>(
    store: outbox_postgres::PostgresOutboxStore,
    publisher: P,
) -> CycleSplit {
    use rand::SeedableRng;
    let config = outbox_core::RelayConfig::builder()
        .owner("prof")
        .batch_size(1000)
        .build()
        .unwrap();
    let mut relay = outbox_core::Relay::new(
        store,
        publisher,
        config,
        std::sync::Arc::new(outbox_core::SystemClock),
        Box::new(rand::rngs::StdRng::seed_from_u64(1)),
    )
    .unwrap();
    let mut split = CycleSplit::default();
    let started = std::time::Instant::now();
    loop {
        let t = std::time::Instant::now();
        let batch = relay.claim().await.unwrap();
        split.claim += t.elapsed();
        if batch.is_empty() {
            break;
        }
        let t = std::time::Instant::now();
        let results = relay.publish(&batch, chrono::Utc::now()).await;
        split.publish += t.elapsed();
        assert!(
            results.iter().all(|r| matches!(r, Some(Ok(_)))),
            "every record acknowledged"
        );
        let t = std::time::Instant::now();
        let outcomes = relay.decide(&batch, &results);
        relay.complete(&batch, &outcomes).await.unwrap();
        split.complete += t.elapsed();
        split.cycles += 1;
        split.events += batch.records.len();
    }
    split.wall = started.elapsed();
    split
}

/// Drains `store` with `Relay::run_once` (the default prefetch): events per second.
async fn drain_run_once<P: outbox_core::Publisher + 'static>(
    store: outbox_postgres::PostgresOutboxStore,
    publisher: P,
    events: usize,
) -> f64 {
    use rand::SeedableRng;
    let config = outbox_core::RelayConfig::builder()
        .owner("prof")
        .batch_size(1000)
        .build()
        .unwrap();
    let mut relay = outbox_core::Relay::new(
        store,
        publisher,
        config,
        std::sync::Arc::new(outbox_core::SystemClock),
        Box::new(rand::rngs::StdRng::seed_from_u64(1)),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let mut published = 0;
    while published < events {
        published += relay.run_once().await.unwrap().published;
    }
    events as f64 / started.elapsed().as_secs_f64()
}

/// A timing harness, not a check (run it on purpose: `--ignored --nocapture`): where the relay
/// into NATS spends its cycle beside the same relay with a publisher that acknowledges at once,
/// on the shared NATS server and PostgreSQL. Prints the split of each; asserts only that every
/// event was published. `OUTBOX_PROFILE_EVENTS` (default 20,000) over a quarter as many
/// aggregates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "timing harness: run with --ignored --nocapture"]
async fn relay_cycle_split_into_nats() {
    let url = require!(common::nats_url("nats_relay_profile"));
    let db = outbox_test_support::required_var("nats_relay_profile", "DATABASE_URL");
    let db = require!(db);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&db)
        .await
        .unwrap();
    let events: usize = std::env::var("OUTBOX_PROFILE_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let aggregates = events / 4;
    let prefix = unique("relayprof");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let nats = || async {
        NatsPublisher::builder(&url, &prefix)
            .relay_lease(Duration::from_secs(60))
            .start()
            .await
            .unwrap()
    };
    let instant = || InstantAcks(std::sync::atomic::AtomicU64::new(0));
    let s_nats = drain_split(backlog(&pool, events, aggregates).await, nats().await).await;
    let s_inst = drain_split(backlog(&pool, events, aggregates).await, instant()).await;
    let r_nats = drain_run_once(
        backlog(&pool, events, aggregates).await,
        nats().await,
        events,
    )
    .await;
    let r_inst = drain_run_once(backlog(&pool, events, aggregates).await, instant(), events).await;
    eprintln!("{}", s_nats.line("steps, nats"));
    eprintln!("{}", s_inst.line("steps, instant"));
    eprintln!(
        "run_once (prefetch): nats {r_nats:.0} events/s, instant {r_inst:.0} events/s, ratio {:.2}",
        r_nats / r_inst
    );
    let schemas = std::mem::take(&mut *SCHEMAS.lock().unwrap());
    for schema in schemas {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
            .execute(&pool)
            .await;
    }
    assert_eq!(s_nats.events, events);
    assert_eq!(stream.count().await as usize, 2 * events);
}
