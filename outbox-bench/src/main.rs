//! `outbox-bench`: one benchmark program for the outbox's scenarios, each beside reference
//! implementations measured in the same run.
//!
//! ```sh
//! cargo build --release -p outbox-bench
//! source scripts/services.sh && ensure_postgres && ensure_kafka   # sets DATABASE_URL, KAFKA_BROKERS
//! target/release/outbox-bench drain --json drain.json
//! target/release/outbox-bench append
//! target/release/outbox-bench latency
//! NATS_URL=nats://127.0.0.1:4222 target/release/outbox-bench latency --transport kafka,nats
//! target/release/outbox-bench latency --probe      # the publishers alone, no database load
//! target/release/outbox-bench consumer
//! target/release/outbox-bench scale
//! target/release/outbox-bench status --sizes 10000,10000000
//! target/release/outbox-bench profile --explain
//! target/release/outbox-bench --rounds 1 indexes
//! target/release/outbox-bench hot --publishers instant,kafka
//! # MySQL 8 / MariaDB (outbox-mysql): drain and append, beside hand-written references
//! target/release/outbox-bench --database-url mysql://root@127.0.0.1:3306/test drain
//! target/release/outbox-bench --database-url mysql://root@127.0.0.1:3306/test append
//! target/release/outbox-bench --database-url mysql://root@127.0.0.1:3306/test status
//! # Into NATS JetStream and RabbitMQ, each beside a minimal relay written for it
//! NATS_URL=nats://127.0.0.1:4222 AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f \
//!     target/release/outbox-bench drain --transport nats,rabbitmq
//! ```
//!
//! Every scenario repeats `--rounds` rounds with the contenders in a rotating order (a slow
//! phase of a shared machine hits all of them), prints each sample as it comes and then a
//! table of medians with their spread (min–max) and the ratio of each contender to its
//! reference, checks the targets of the performance issue, and writes the same figures to
//! `--json FILE`. Each contender runs in its own schema and topic, named after the run and
//! removed when it ends. Absolute numbers depend on the machine; compare ratios. See
//! `BENCHMARKS.md` for the conditions and the latest figures.

mod append;
mod autovac;
mod consumer;
mod drain;
mod env;
mod hot;
mod indexes;
mod latency;
mod lean;
mod mysql;
mod mystatus;
mod profile;
mod report;
mod scale;
mod status;
mod transports;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// Benchmarks of the outbox against the local PostgreSQL and Kafka-protocol broker.
#[derive(Debug, Parser)]
#[command(name = "outbox-bench", version)]
struct Cli {
    /// PostgreSQL URL; a `mysql://` (or `mariadb://`) URL runs `drain`, `append` and `status` on
    /// MySQL 8 / MariaDB (outbox-mysql) instead.
    #[arg(long, env = "DATABASE_URL", global = true)]
    database_url: Option<String>,
    /// Kafka bootstrap servers (the scenarios that use the broker require it).
    #[arg(long, env = "KAFKA_BROKERS", global = true)]
    brokers: Option<String>,
    /// Rounds; the contenders alternate within each.
    #[arg(long, default_value_t = 3, global = true)]
    rounds: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long, global = true)]
    json: Option<PathBuf>,
    #[command(subcommand)]
    scenario: Scenario,
}

#[derive(Debug, Subcommand)]
enum Scenario {
    /// Drain a backlog: claim modes, 1 and 2 relays, beside the SQL ceiling, the producer
    /// ceiling, the lean unordered relay (the reference) with its one-factor variants, the old
    /// minimal unordered relay and a relay awaiting each record.
    Drain(drain::DrainArgs),
    /// Append overhead in a business transaction: 0, 1 and 10 appends, 1 and 8 clients, the
    /// wake-up variants.
    Append(append::AppendArgs),
    /// End-to-end latency at a fixed offered load: commit to acknowledgement and to the
    /// consumer's applied effect, NOTIFY wake-up vs polling, split per stage (claim, publish,
    /// completion); into Kafka and NATS; `--probe` for the publishers alone.
    Latency(latency::LatencyArgs),
    /// Consumer: events/s applied through the inbox from a filled topic, 0% and 10% duplicates.
    Consumer(consumer::ConsumerArgs),
    /// Scale: the claim's cost at growing backlogs, and a soak with cleanup (size, dead
    /// tuples, claim latency over time).
    Scale(scale::ScaleArgs),
    /// Profile a drain per claim mode: pg_stat_statements over the run (a database of its
    /// own), the wall time inside vs outside statements, the CPU split; `--explain` for the
    /// plans of one claim + completion (auto_explain).
    Profile(profile::ProfileArgs),
    /// Status: `stats()`, the reads of `outbox status` and one claim + completion on tables
    /// of growing size (mostly published rows), side by side.
    Status(status::StatusArgs),
    /// Indexes: which index each store operation reads (the server's counters), and each
    /// operation's time with one index of the outbox table dropped at a time.
    Indexes(indexes::IndexesArgs),
    /// One hot aggregate (issue 25): its versions/s while a trickle of other aggregates runs,
    /// and the trickle's commit -> acknowledgement latency beside the trickle alone.
    Hot(hot::HotArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Library logs (warnings by default; RUST_LOG=outbox_postgres=debug for the wake-up gate).
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    anyhow::ensure!(cli.rounds >= 1, "--rounds must be at least 1");
    if let Some(url) = cli
        .database_url
        .as_deref()
        .filter(|u| mysql::is_mysql_url(u))
    {
        return run_mysql(&cli, url).await;
    }
    if let Scenario::Drain(a) = &cli.scenario {
        // A bad transport or a missing server is refused before any work.
        drain::select(a, cli.brokers.as_deref())?;
    }
    let env = env::Env::connect(cli.database_url.clone(), cli.brokers.clone(), 16).await?;
    println!("outbox-bench run {}", env.run);
    let result = match &cli.scenario {
        Scenario::Drain(a) => drain::run(&env, a, cli.rounds).await,
        Scenario::Append(a) => append::run(&env, a, cli.rounds).await,
        Scenario::Latency(a) => latency::run(&env, a, cli.rounds).await,
        Scenario::Consumer(a) => consumer::run(&env, a, cli.rounds).await,
        Scenario::Scale(a) => scale::run(&env, a, cli.rounds).await,
        Scenario::Profile(a) => profile::run(&env, a, cli.rounds).await,
        Scenario::Status(a) => status::run(&env, a, cli.rounds).await,
        Scenario::Indexes(a) => indexes::run(&env, a, cli.rounds).await,
        Scenario::Hot(a) => hot::run(&env, a, cli.rounds).await,
    };
    // Remove what the run created, also after a failure.
    let cleaned = env.cleanup().await;
    let report = result?;
    cleaned?;
    report.print();
    if let Some(path) = &cli.json {
        report::write_json(path, std::slice::from_ref(&report))?;
        println!("figures written to {}", path.display());
    }
    Ok(())
}

/// `drain`, `append` and `status` on MySQL / MariaDB; the other scenarios are PostgreSQL's.
async fn run_mysql(cli: &Cli, url: &str) -> anyhow::Result<()> {
    let env = mysql::MyEnv::connect(url, cli.brokers.clone()).await?;
    println!("outbox-bench run {} (mysql)", env.run);
    let result = match &cli.scenario {
        Scenario::Drain(a) => mysql::drain(&env, a, cli.rounds).await,
        Scenario::Append(a) => mysql::append(&env, a, cli.rounds).await,
        Scenario::Status(a) => mystatus::run(&env, a, cli.rounds).await,
        _ => Err(anyhow::anyhow!(
            "only `drain`, `append` and `status` run on a mysql:// URL; the other scenarios \
             measure PostgreSQL"
        )),
    };
    let cleaned = env.cleanup().await;
    let report = result?;
    cleaned?;
    report.print();
    if let Some(path) = &cli.json {
        report::write_json(path, std::slice::from_ref(&report))?;
        println!("figures written to {}", path.display());
    }
    Ok(())
}
