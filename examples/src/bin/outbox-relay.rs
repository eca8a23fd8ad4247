//! A relay process: drains a PostgreSQL outbox into Kafka until SIGINT/SIGTERM.
//!
//! ```sh
//! cargo run -p outbox-examples --bin outbox-relay -- \
//!     --database-url postgres://postgres@127.0.0.1/postgres --schema shop \
//!     --brokers 127.0.0.1:9092 --topic orders
//! ```
//!
//! Safe to run several at once and to kill at any moment: a killed relay's leases expire and
//! another relay publishes those events again (duplicates, never losses, order kept per
//! aggregate).

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use outbox_core::{ClaimMode, Relay, RelayConfig, SystemClock};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Relay: PostgreSQL outbox → Kafka.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Schema of the outbox table (a plain lowercase identifier, checked like the store's names
    /// before anything connects).
    #[arg(long, default_value = "public", value_parser = outbox_examples::cli::parse_schema)]
    schema: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: String,
    /// Default topic.
    #[arg(long, value_parser = outbox_examples::cli::parse_topic)]
    topic: String,
    /// Lease duration in seconds (must exceed the delivery timeout plus 2 s).
    #[arg(long, default_value_t = 15)]
    lease_secs: u64,
    /// Delivery timeout in seconds.
    #[arg(long, default_value_t = 10)]
    delivery_timeout_secs: u64,
    /// Claim batch size.
    #[arg(long, default_value_t = 500)]
    batch: usize,
    /// Relay loops in this process. Each claims its own batches (disjoint aggregates), so one
    /// publishes while another claims or marks: about twice the drain rate of one loop.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=64))]
    workers: u16,
    /// Do not claim the next batch while a full batch is published (prefetch is on by default).
    #[arg(long)]
    no_prefetch: bool,
    /// Extra librdkafka producer properties, `key=value` (repeatable).
    #[arg(long = "producer-property", value_parser = outbox_examples::cli::parse_kv)]
    producer_properties: Vec<(String, String)>,
    /// Create the outbox schema if missing.
    #[arg(long)]
    migrate: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    outbox_examples::cli::init_tracing();
    let args = Args::parse();
    // Per worker: a claim (its prefetch included) and a completion at once; plus the listener's
    // reconnects and stats.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2 * u32::from(args.workers) + 2)
        .connect(&args.database_url)
        .await?;
    let store = PostgresOutboxStore::builder(pool)
        .schema(args.schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(args.lease_secs))?)
        .build()?;
    if args.migrate {
        store.migrate().await?;
    }
    let mut builder = KafkaPublisher::builder(&args.brokers, &args.topic)
        .delivery_timeout(Duration::from_secs(args.delivery_timeout_secs));
    for (k, v) in &args.producer_properties {
        builder = builder.set(k, v);
    }
    let publisher = Arc::new(builder.start().await.map_err(|e| anyhow::anyhow!("{e}"))?);
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = store.spawn_listener(wake.clone())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for w in 0..args.workers {
        let config = RelayConfig::builder()
            .owner(format!("relay-{}-{w}", std::process::id()))
            .batch_size(args.batch)
            .idle(Duration::from_millis(5), Duration::from_millis(500))
            .prefetch(!args.no_prefetch)
            .build()?;
        let relay = Relay::new(
            store.clone(),
            publisher.clone(),
            config,
            Arc::new(SystemClock),
            Box::new(StdRng::from_os_rng()),
        )?;
        let mut stop = stop_rx.clone();
        let shutdown = async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        workers.push(tokio::spawn(outbox_core::driver::run(
            relay,
            Some(wake.clone()),
            shutdown,
        )));
    }
    outbox_examples::cli::shutdown_signal().await;
    let _ = stop_tx.send(true);
    for w in workers {
        eprintln!("relay worker stopped: {:?}", w.await?);
    }
    listener.abort();
    Ok(())
}
