//! Consumer throughput through the PostgreSQL inbox, one transaction per message versus
//! batched transactions, side by side in one run.
//!
//! ```sh
//! cargo run --release -p outbox-examples --bin inbox_bench -- --database-url postgres://postgres@127.0.0.1:5432/postgres
//! ```
//!
//! Messages come from the in-memory log (so the figure is the inbox's and the handler's cost,
//! not the broker's); the handler is the demo's projection with its version check.

use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{Envelope, Publisher};
use outbox_examples::postgres::{PostgresBackend, Projection};
use outbox_examples::Order;
use outbox_inbox::{ConsumerEngine, EngineConfig, InboxProcessor};
use outbox_testkit::MemoryLog;

/// Inbox throughput benchmark.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Events per contender.
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Aggregates the events are spread over.
    #[arg(long, default_value_t = 2_000)]
    aggregates: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    println!(
        "inbox_bench: {} events over {} aggregates, PostgreSQL inbox + projection",
        args.events, args.aggregates
    );
    println!(
        "{:<26} {:>9} {:>11} {:>7}",
        "contender", "seconds", "events/s", "ratio"
    );
    let mut baseline = None;
    for max_batch in [1usize, 20, 100, 500] {
        let took = run(&args, max_batch).await?;
        let rate = args.events as f64 / took.as_secs_f64();
        let base = *baseline.get_or_insert(rate);
        println!(
            "{:<26} {:>9.2} {:>11.0} {:>7.2}",
            format!("max_batch = {max_batch}"),
            took.as_secs_f64(),
            rate,
            rate / base
        );
    }
    Ok(())
}

async fn run(args: &Args, max_batch: usize) -> anyhow::Result<Duration> {
    let pg = PostgresBackend::connect(&args.database_url, None).await?;
    let log = MemoryLog::new("orders", 4);
    let envelopes: Vec<Envelope> = (0..args.events)
        .map(|i| {
            let id = format!("order-{}", i % args.aggregates);
            let version = (i / args.aggregates) as i64 + 1;
            let order = Order {
                id: id.clone(),
                status: "confirmed".into(),
                version,
                note: String::new(),
            };
            Envelope::builder("order", id, version, "order.changed")
                .json(&order)
                .and_then(|b| b.build())
                .expect("valid")
        })
        .collect();
    for chunk in envelopes.chunks(1000) {
        anyhow::ensure!(log.publish(chunk).await.iter().all(Result::is_ok));
    }
    let mut engine = ConsumerEngine::new(
        log.consumer("bench", &["orders"]),
        InboxProcessor::new("bench", pg.inbox.clone(), Projection::new(&pg.schema)),
        EngineConfig::default()
            .with_max_batch(max_batch)
            .with_poll_timeout(Duration::from_millis(5)),
        1,
    )?;
    let started = Instant::now();
    while engine.report().applied < args.events as u64 {
        engine.step().await?;
    }
    let took = started.elapsed();
    engine.commit_final().await?;
    anyhow::ensure!(engine.report().duplicates == 0);
    pg.drop_schema().await?;
    Ok(took)
}
