//! The outbox demo: order service → outbox → relay → broker → inbox → projection.
//!
//! ```sh
//! cargo run -p outbox-examples --bin demo                       # in-memory, no services
//! cargo run -p outbox-examples --bin demo -- --database-url postgres://postgres@127.0.0.1/postgres
//! cargo run -p outbox-examples --bin demo -- --brokers 127.0.0.1:9092
//! ```

use clap::Parser;

/// Transactional outbox demo: order service → outbox → relay → broker → inbox → projection.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Number of orders to place and confirm.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    orders: u16,
    /// PostgreSQL for orders, outbox and inbox (each run gets its own schema). In-memory when
    /// absent.
    #[arg(long)]
    database_url: Option<String>,
    /// Kafka bootstrap servers to publish through (a fresh topic per run). In-memory log when
    /// absent.
    #[arg(long)]
    brokers: Option<String>,
    /// Keep the PostgreSQL schema and the Kafka topic of the run for inspection (the demo
    /// prints both and removes them otherwise).
    #[arg(long = "keep", alias = "keep-schema")]
    keep_schema: bool,
    /// PostgreSQL schema of the run (a plain lowercase identifier that must not exist yet: the
    /// demo creates it, and drops it at the end unless --keep). Default: a fresh
    /// `outbox_demo_<random>`.
    #[arg(long, requires = "database_url", value_parser = outbox_examples::cli::parse_schema)]
    schema: Option<String>,
    /// Log filter (e.g. `info`, `outbox_core=debug`). Warnings show retries and parking.
    #[arg(long, default_value = "warn")]
    log: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&args.log)?)
        .with_target(false)
        .without_time()
        .compact()
        .with_writer(std::io::stderr)
        .init();
    let config = outbox_examples::DemoConfig {
        orders: usize::from(args.orders),
        database_url: args.database_url,
        brokers: args.brokers,
        keep_schema: args.keep_schema,
        schema: args.schema,
    };
    let summary = outbox_examples::run_demo(&config).await?;
    println!("{summary}");
    Ok(())
}
