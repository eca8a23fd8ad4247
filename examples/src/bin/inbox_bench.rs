//! Consumer throughput through the PostgreSQL inbox: the consumer engine applies a filled topic
//! (the demo's projection with its version check, registration by dedup id, per-aggregate
//! versions), with and without redelivered duplicates, for several batch sizes, concurrencies
//! and version policies, side by side in one run.
//!
//! ```sh
//! # in-memory log as the topic (the figure is the engine's, the inbox's and the handler's):
//! cargo run --release -p outbox-examples --bin inbox_bench -- \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres
//! # a real Kafka-protocol broker as the topic (filled first, then read from the beginning):
//! cargo run --release -p outbox-examples --bin inbox_bench -- \
//!     --database-url postgres://postgres@127.0.0.1:5432/postgres --brokers 127.0.0.1:9092
//! ```
//!
//! Duplicates are copies of earlier records (same event, as a relay that lost an
//! acknowledgement publishes them) placed up to 1,000 records after the original. The clock
//! starts at the first message received (a consumer group's join is not counted) and stops
//! when every record's outcome is final and its offset committed.

use std::time::{Duration, Instant};

use clap::Parser;
use outbox_core::{Envelope, Publisher};
use outbox_examples::postgres::{PostgresBackend, Projection};
use outbox_examples::Order;
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor, VersionPolicy,
};
use outbox_testkit::MemoryLog;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{Postgres, Transaction};

/// Inbox throughput benchmark.
#[derive(Debug, Parser)]
struct Args {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Read from a topic on this Kafka-protocol broker instead of the in-memory log.
    #[arg(long)]
    brokers: Option<String>,
    /// Distinct events per contender.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the events are spread over (each gets events / aggregates versions).
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 4)]
    partitions: usize,
    /// Share of duplicates for the duplicate runs.
    #[arg(long, default_value_t = 0.10)]
    duplicates: f64,
    /// Only the headline contenders (max_batch 500, concurrency 4, version check; set-based and
    /// per-event handler), with and without duplicates.
    #[arg(long)]
    quick: bool,
}

#[derive(Clone, Copy, Debug)]
struct Contender {
    max_batch: usize,
    concurrency: usize,
    policy: VersionPolicy,
    /// The handler applies the batch set-based (`handle_batch`), else one statement per event.
    set_based: bool,
}

impl Contender {
    fn name(&self) -> String {
        let policy = match self.policy {
            VersionPolicy::Unchecked => "unchecked",
            _ => "versions",
        };
        let handler = if self.set_based { "set" } else { "each" };
        format!(
            "batch {:>4}, conc {}, {policy}, {handler}",
            self.max_batch, self.concurrency
        )
    }
}

/// The projection applied one statement per event (the default `handle_batch`).
struct PerEvent(Projection);

#[outbox_core::async_trait]
impl Handler<Transaction<'static, Postgres>> for PerEvent {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        self.0.handle(tx, event).await
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let source = args
        .brokers
        .as_deref()
        .map_or("in-memory log".to_owned(), |b| format!("Kafka at {b}"));
    println!(
        "inbox_bench: {} events over {} aggregates, {} partitions, from the {source}; \
         PostgreSQL inbox + projection",
        args.events, args.aggregates, args.partitions
    );
    println!(
        "{:<38} {:>5} {:>8} {:>9} {:>11} {:>10}",
        "contender", "dups", "seconds", "received", "received/s", "applied/s"
    );
    let contenders: Vec<Contender> = if args.quick {
        [true, false]
            .into_iter()
            .map(|set_based| Contender {
                max_batch: 500,
                concurrency: 4,
                policy: VersionPolicy::Reject,
                set_based,
            })
            .collect()
    } else {
        let mut c = Vec::new();
        let sweep: Vec<(usize, usize, bool)> = match std::env::var("BENCH_SWEEP") {
            // e.g. BENCH_SWEEP=500x4s,100x2e (batch x concurrency, s = set-based, e = each)
            Ok(v) => v
                .split(',')
                .map(|p| {
                    let set = p.ends_with('s');
                    let p = p.trim_end_matches(['s', 'e']);
                    let (b, c) = p.split_once('x').expect("BATCHxCONCURRENCY");
                    (
                        b.parse().expect("batch"),
                        c.parse().expect("concurrency"),
                        set,
                    )
                })
                .collect(),
            Err(_) => vec![
                (1, 1, false),
                (100, 1, false),
                (500, 4, false),
                (100, 1, true),
                (500, 2, true),
                (500, 4, true),
            ],
        };
        for (max_batch, concurrency, set_based) in sweep {
            c.push(Contender {
                max_batch,
                concurrency,
                policy: VersionPolicy::Reject,
                set_based,
            });
        }
        c.push(Contender {
            max_batch: 500,
            concurrency: 4,
            policy: VersionPolicy::Unchecked,
            set_based: true,
        });
        c
    };
    for dup in [0.0, args.duplicates] {
        for c in &contenders {
            // One message per transaction is slow: measure it on a tenth of the events.
            let events = if c.max_batch == 1 {
                args.events / 10
            } else {
                args.events
            };
            let r = run(&args, *c, events, dup).await?;
            println!(
                "{:<38} {:>4.0}% {:>8.2} {:>9} {:>11.0} {:>10.0}",
                c.name(),
                dup * 100.0,
                r.seconds,
                r.received,
                r.received as f64 / r.seconds,
                events as f64 / r.seconds
            );
        }
    }
    Ok(())
}

struct RunResult {
    seconds: f64,
    received: u64,
}

/// The events of a run: `events` distinct ones, round-robin over the aggregates (version = the
/// round), with `dup` of them copied up to 1,000 records later.
fn workload(args: &Args, events: usize, dup: f64, seed: u64) -> (Vec<Envelope>, usize) {
    let aggregates = args.aggregates.min(events).max(1);
    let distinct: Vec<Envelope> = (0..events)
        .map(|i| {
            let id = format!("order-{}", i % aggregates);
            let version = (i / aggregates) as i64 + 1;
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
    let mut rng = StdRng::seed_from_u64(seed);
    let mut copies: Vec<(usize, Envelope)> = Vec::new();
    for (i, e) in distinct.iter().enumerate() {
        if rng.random_bool(dup) {
            copies.push((i + rng.random_range(1..=1_000), e.clone()));
        }
    }
    copies.sort_by_key(|(at, _)| *at);
    let dups = copies.len();
    let mut out = Vec::with_capacity(events + dups);
    let mut copies = copies.into_iter().peekable();
    for (i, e) in distinct.into_iter().enumerate() {
        out.push(e);
        while copies.peek().is_some_and(|(at, _)| *at <= i) {
            out.push(copies.next().expect("peeked").1);
        }
    }
    out.extend(copies.map(|(_, e)| e));
    (out, dups)
}

async fn run(args: &Args, c: Contender, events: usize, dup: f64) -> anyhow::Result<RunResult> {
    let pg = PostgresBackend::connect(&args.database_url, None).await?;
    let (records, dups) = workload(args, events, dup, 7);
    let result = run_on(args, &pg, c, records, events, dups).await;
    pg.drop_schema().await?;
    result
}

async fn run_on(
    args: &Args,
    pg: &PostgresBackend,
    c: Contender,
    records: Vec<Envelope>,
    events: usize,
    dups: usize,
) -> anyhow::Result<RunResult> {
    if c.set_based {
        let handler = Projection::new(&pg.schema);
        consume(args, pg, c, handler, records, events, dups).await
    } else {
        let handler = PerEvent(Projection::new(&pg.schema));
        consume(args, pg, c, handler, records, events, dups).await
    }
}

async fn consume<H>(
    args: &Args,
    pg: &PostgresBackend,
    c: Contender,
    handler: H,
    records: Vec<Envelope>,
    events: usize,
    dups: usize,
) -> anyhow::Result<RunResult>
where
    H: Handler<Transaction<'static, Postgres>> + 'static,
{
    let total = records.len() as u64;
    let processor =
        InboxProcessor::new("bench", pg.inbox.clone(), handler).with_version_policy(c.policy);
    let config = EngineConfig::default()
        .with_max_batch(c.max_batch)
        .with_concurrency(c.concurrency)
        .with_max_in_flight(20_000)
        .with_commit(5_000, Duration::from_millis(500))
        .with_poll_timeout(Duration::from_millis(50));
    let result = match &args.brokers {
        None => {
            let log = MemoryLog::new("orders", args.partitions);
            for chunk in records.chunks(1000) {
                anyhow::ensure!(log.publish(chunk).await.iter().all(Result::is_ok));
            }
            let engine =
                ConsumerEngine::new(log.consumer("bench", &["orders"]), processor, config, 1)?;
            drive(engine, total, events as u64, dups as u64).await?
        }
        Some(brokers) => {
            let topic = kafka_topic(brokers, args.partitions).await?;
            let publisher = outbox_kafka::KafkaPublisher::builder(brokers, &topic)
                .delivery_timeout(Duration::from_secs(30))
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
            for chunk in records.chunks(1000) {
                let r = publisher.publish(chunk).await;
                anyhow::ensure!(r.iter().all(Result::is_ok), "filling the topic failed");
            }
            let source = outbox_kafka::KafkaSource::builder(brokers, format!("bench-{topic}"))
                .topic(&topic)
                .session_timeout(Duration::from_secs(6))
                .build()?;
            let engine = ConsumerEngine::new(source, processor, config, 1)?;
            drive(engine, total, events as u64, dups as u64).await?
        }
    };
    Ok(result)
}

async fn drive<S, H>(
    mut engine: ConsumerEngine<S, outbox_postgres::PostgresInboxStore, H>,
    total: u64,
    events: u64,
    dups: u64,
) -> anyhow::Result<RunResult>
where
    S: outbox_core::MessageSource,
    H: outbox_inbox::Handler<sqlx::Transaction<'static, sqlx::Postgres>> + 'static,
{
    let join_deadline = Instant::now() + Duration::from_secs(60);
    while engine.report().received == 0 {
        anyhow::ensure!(Instant::now() < join_deadline, "no message within 60 s");
        engine.step().await?;
    }
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    loop {
        let r = engine.report();
        if r.received >= total
            && r.applied + r.duplicates + r.stale >= total
            && engine.in_flight() == 0
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "did not finish: {:?}",
            engine.report()
        );
        engine.step().await?;
    }
    engine.commit_final().await?;
    let seconds = started.elapsed().as_secs_f64();
    let r = engine.report();
    anyhow::ensure!(
        r.applied == events && r.duplicates + r.stale == dups && r.parked == 0,
        "unexpected outcome: {r:?} (expected {events} applied, {dups} duplicates)"
    );
    Ok(RunResult {
        seconds,
        received: r.received,
    })
}

async fn kafka_topic(brokers: &str, partitions: usize) -> anyhow::Result<String> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let topic = format!(
        "inbox-bench-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for r in admin
        .create_topics(
            [&NewTopic::new(
                &topic,
                partitions as i32,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?
    {
        r.map_err(|(t, code)| anyhow::anyhow!("cannot create topic {t}: {code}"))?;
    }
    Ok(topic)
}
