//! End-to-end relay throughput: PostgreSQL outbox → Kafka, side by side with a naive baseline.
//!
//! ```sh
//! cargo run --release -p outbox-examples --bin relay_bench -- \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres --brokers 127.0.0.1:9092
//! ```
//!
//! For each contender the same backlog (`--events` across `--aggregates`) is preloaded, then
//! drained into a fresh topic, and the drain rate is printed:
//!
//! * `naive`: claim 1,000 rows with `FOR UPDATE SKIP LOCKED`, produce all, await all, one
//!   `UPDATE`, commit. No per-aggregate order, no fencing, no ack metadata: the ceiling.
//! * `outbox locked`: `outbox_core::Relay` over `PostgresOutboxStore` in
//!   `ClaimMode::LockedTransaction` and `KafkaPublisher` — head-of-line per aggregate, ack metadata
//!   stored per row.
//! * `outbox lease`: the same with `ClaimMode::Lease` (fencing tokens).
//!
//! Each outbox contender runs as one relay without and with prefetch (claiming the next batch
//! while the current one is published and completed, the default), then as `--relays`
//! concurrent relays with prefetch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{ClaimMode, Envelope, OutboxStore, Relay, RelayConfig, SystemClock};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};

/// Relay throughput benchmark (PostgreSQL → Kafka).
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: String,
    /// Events to preload per contender.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Aggregates the events are spread over (round robin).
    #[arg(long, default_value_t = 20_000)]
    aggregates: usize,
    /// Claim batch size.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Concurrent relays for the multi-relay runs.
    #[arg(long, default_value_t = 2)]
    relays: usize,
    /// Partitions of each topic.
    #[arg(long, default_value_t = 6)]
    partitions: i32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .connect(&args.database_url)
        .await?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    println!(
        "relay_bench: {} events over {} aggregates, batch {}, {} partitions",
        args.events, args.aggregates, args.batch, args.partitions
    );
    println!(
        "{:<42} {:>10} {:>12} {:>8}",
        "contender", "seconds", "events/s", "ratio"
    );

    let naive = naive(&args, &pool, &run).await?;
    print_row("naive (no guarantees)", args.events, naive, naive);

    for (label, mode) in [
        ("outbox locked", ClaimMode::LockedTransaction),
        ("outbox lease", ClaimMode::lease(Duration::from_secs(60))?),
    ] {
        for (relays, prefetch) in [(1, false), (1, true), (args.relays, true)] {
            let took = outbox(&args, &pool, &run, mode, relays, prefetch).await?;
            let how = if prefetch { "prefetch" } else { "no prefetch" };
            print_row(
                &format!("{label}, {relays} relay(s), {how}"),
                args.events,
                took,
                naive,
            );
        }
    }
    Ok(())
}

fn print_row(label: &str, events: usize, took: Duration, baseline: Duration) {
    let rate = events as f64 / took.as_secs_f64();
    let base_rate = events as f64 / baseline.as_secs_f64();
    println!(
        "{label:<42} {:>10.2} {:>12.0} {:>8.2}",
        took.as_secs_f64(),
        rate,
        rate / base_rate
    );
}

async fn create_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for r in admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?
    {
        r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
    }
    Ok(())
}

fn payload(i: usize) -> serde_json::Value {
    serde_json::json!({ "order": i, "total_cents": 1999, "currency": "EUR", "items": 3 })
}

/// The naive relay on its own table: the ceiling without any guarantee.
async fn naive(args: &Args, pool: &PgPool, run: &str) -> anyhow::Result<Duration> {
    let table = format!("relay_bench_naive_{run}");
    sqlx::raw_sql(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea NOT NULL, published_at timestamptz);
         CREATE INDEX ON {table} (id) WHERE published_at IS NULL;"
    ))
    .execute(pool)
    .await?;
    let keys: Vec<String> = (0..args.events)
        .map(|i| format!("agg-{}", i % args.aggregates))
        .collect();
    let payloads: Vec<Vec<u8>> = (0..args.events)
        .map(|i| serde_json::to_vec(&payload(i)).expect("json"))
        .collect();
    for (k, p) in keys.chunks(10_000).zip(payloads.chunks(10_000)) {
        sqlx::query(&format!(
            "INSERT INTO {table} (key, payload) SELECT * FROM UNNEST($1::text[], $2::bytea[])"
        ))
        .bind(k)
        .bind(p)
        .execute(pool)
        .await?;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
        .execute(pool)
        .await?;
    let topic = format!("relay-bench-naive-{run}");
    create_topic(&args.brokers, &topic, args.partitions).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()?;
    let claim = format!(
        "SELECT id, key, payload FROM {table} WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let mark = format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)");
    let started = Instant::now();
    let mut total = 0;
    loop {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&claim)
            .bind(args.batch as i64)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get("id");
            let key: String = row.get("key");
            let payload: Vec<u8> = row.get("payload");
            ids.push(id);
            let record = FutureRecord::to(&topic).key(&key).payload(&payload);
            pending.push(producer.send_result(record).map_err(|(e, _)| e)?);
        }
        for p in pending {
            p.await?.map_err(|(e, _)| e)?;
        }
        sqlx::query(&mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += rows.len();
    }
    let took = started.elapsed();
    anyhow::ensure!(
        total == args.events,
        "naive drained {total} of {}",
        args.events
    );
    producer.flush(Duration::from_secs(10))?;
    sqlx::raw_sql(&format!("DROP TABLE {table}"))
        .execute(pool)
        .await?;
    Ok(took)
}

/// `relays` concurrent `outbox_core::Relay`s over the PostgreSQL store and the Kafka publisher.
async fn outbox(
    args: &Args,
    pool: &PgPool,
    run: &str,
    mode: ClaimMode,
    relays: usize,
    prefetch: bool,
) -> anyhow::Result<Duration> {
    let tag = match mode {
        ClaimMode::LockedTransaction => "locked",
        _ => "lease",
    };
    let schema = format!(
        "relay_bench_{tag}{relays}{}_{run}",
        if prefetch { "p" } else { "" }
    );
    sqlx::raw_sql(&format!("CREATE SCHEMA {schema}"))
        .execute(pool)
        .await?;
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(schema.clone())
        .claim_mode(mode)
        .build()?;
    store.migrate().await?;
    // Preload: versions 1..n per aggregate, in append batches of 10,000.
    let created = chrono::Utc::now();
    let events: Vec<Envelope> = (0..args.events)
        .map(|i| {
            let agg = i % args.aggregates;
            let version = (i / args.aggregates) as i64 + 1;
            Envelope::builder("order", format!("agg-{agg}"), version, "order.placed")
                .json(&payload(i))
                .and_then(|b| b.created_at(created).build())
                .expect("valid envelope")
        })
        .collect();
    for chunk in events.chunks(10_000) {
        store.append_many(pool, chunk).await?;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {schema}.outbox_events"))
        .execute(pool)
        .await
        .ok();
    let topic = format!(
        "relay-bench-{tag}{relays}{}-{run}",
        if prefetch { "p" } else { "" }
    );
    create_topic(&args.brokers, &topic, args.partitions).await?;
    let publisher = Arc::new(
        KafkaPublisher::builder(&args.brokers, &topic)
            .delivery_timeout(Duration::from_secs(30))
            .set("linger.ms", "5")
            .start()
            .await
            .map_err(|e| anyhow::anyhow!("publisher: {e}"))?,
    );
    let started = Instant::now();
    let mut tasks = Vec::new();
    for r in 0..relays {
        let config = RelayConfig::builder()
            .owner(format!("bench-{r}"))
            .batch_size(args.batch)
            .prefetch(prefetch)
            .build()?;
        let mut relay = Relay::new(
            store.clone(),
            publisher.clone(),
            config,
            Arc::new(SystemClock),
            Box::new(StdRng::seed_from_u64(r as u64)),
        )?;
        tasks.push(tokio::spawn(async move {
            let mut published = 0usize;
            let mut idle = 0;
            // The relay's own cycle (with prefetch when enabled). Stop after a few consecutive
            // empty cycles (another relay may hold the rest).
            while idle < 3 {
                let report = relay.run_once().await?;
                if report.claimed == 0 {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                idle = 0;
                anyhow::ensure!(
                    report.retried == 0
                        && report.parked == 0
                        && report.superseded == 0
                        && !report.released,
                    "publish failures, released or superseded claims: {report:?}"
                );
                published += report.published;
            }
            relay.release_prefetched().await?;
            Ok(published)
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    let took = started.elapsed();
    let stats = store.stats().await?;
    anyhow::ensure!(
        total == args.events && stats.unpublished == 0,
        "{tag}: published {total} of {}, {} left",
        args.events,
        stats.unpublished
    );
    sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(pool)
        .await?;
    Ok(took)
}
