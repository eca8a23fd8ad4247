//! The outbox demo. Runs the whole pipeline in one process on in-memory backends:
//!
//! ```sh
//! cargo run -p outbox-examples --bin demo
//! ```

use clap::Parser;

/// Transactional outbox demo: order service → outbox → relay → broker → inbox → projection.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Number of orders to place and confirm.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=10_000))]
    orders: u16,
    /// Log level filter (e.g. `info`, `outbox_core=debug`). Relay warnings show retries.
    #[arg(long, env = "RUST_LOG", default_value = "warn")]
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
        .init();
    let summary = outbox_examples::run_memory_demo(args.orders as usize).await?;
    println!("{summary}");
    Ok(())
}
