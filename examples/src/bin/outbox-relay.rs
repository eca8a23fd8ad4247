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
    /// Schema of the outbox table.
    #[arg(long, default_value = "public")]
    schema: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: String,
    /// Default topic.
    #[arg(long)]
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
    /// Extra librdkafka producer properties, `key=value` (repeatable).
    #[arg(long = "producer-property", value_parser = parse_kv)]
    producer_properties: Vec<(String, String)>,
    /// Create the outbox schema if missing.
    #[arg(long)]
    migrate: bool,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
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
    let publisher = builder.start().await.map_err(|e| anyhow::anyhow!("{e}"))?;
    let config = RelayConfig::builder()
        .owner(format!("relay-{}", std::process::id()))
        .batch_size(args.batch)
        .idle(Duration::from_millis(5), Duration::from_millis(500))
        .build()?;
    let relay = Relay::new(
        store.clone(),
        publisher,
        config,
        Arc::new(SystemClock),
        Box::new(StdRng::from_os_rng()),
    )?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = store.spawn_listener(wake.clone())?;
    let report = outbox_core::driver::run(relay, Some(wake), shutdown_signal()).await;
    listener.abort();
    eprintln!("relay stopped: {report:?}");
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
