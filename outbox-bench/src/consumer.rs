//! Consumer throughput through the PostgreSQL inbox: the consumer engine applies a filled topic
//! (the example projection with its version check, registration by event id, per-aggregate
//! versions), with and without redelivered duplicates, for the set-based and the per-event
//! handler, side by side.
//!
//! Duplicates are copies of earlier records (same event, as a relay that lost an
//! acknowledgement publishes them) placed up to 1,000 records after the original. The clock
//! starts at the first message received (the group's join is not counted) and stops when every
//! record's outcome is final and its offset committed.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::{Envelope, Publisher};
use outbox_examples::postgres::Projection;
use outbox_examples::Order;
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor, VersionPolicy,
};
use outbox_postgres::PostgresInboxStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::{Postgres, Transaction};

use crate::env::Env;
use crate::report::{Report, Samples};

/// Options of `outbox-bench consumer`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ConsumerArgs {
    /// Distinct events in the topic.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Aggregates the events are spread over (each gets events / aggregates versions).
    #[arg(long, default_value_t = 5_000)]
    aggregates: usize,
    /// Partitions of the topic.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Share of duplicates in the duplicate runs.
    #[arg(long, default_value_t = 0.10)]
    duplicates: f64,
    /// Engine batch size.
    #[arg(long, default_value_t = 500)]
    max_batch: usize,
    /// Engine concurrency (batches in flight).
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
}

#[derive(Clone, Copy, Debug)]
struct Contender {
    /// The handler applies a batch set-based (`handle_batch`), else one statement per event.
    set_based: bool,
    dup: bool,
}

impl Contender {
    fn label(self, args: &ConsumerArgs) -> String {
        format!(
            "{} handler, {:.0}% duplicates",
            if self.set_based {
                "set-based"
            } else {
                "per-event"
            },
            if self.dup {
                args.duplicates * 100.0
            } else {
                0.0
            }
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

/// Runs the consumer scenario.
pub(crate) async fn run(env: &Env, args: &ConsumerArgs, rounds: usize) -> anyhow::Result<Report> {
    let brokers = env.brokers()?.to_owned();
    let mut report = Report::new("consumer", rounds);
    report.param("events", args.events);
    report.param("aggregates", args.aggregates);
    report.param("partitions", args.partitions);
    report.param("duplicates", args.duplicates);
    report.param("max_batch", args.max_batch);
    report.param("concurrency", args.concurrency);
    report.param("version_policy", "reject");
    let contenders = [
        Contender {
            set_based: true,
            dup: false,
        },
        Contender {
            set_based: false,
            dup: false,
        },
        Contender {
            set_based: true,
            dup: true,
        },
        Contender {
            set_based: false,
            dup: true,
        },
    ];
    let mut samples = Samples::default();
    for round in 0..rounds {
        // One topic per duplicate setting and round; each contender reads it with its own
        // group into its own schema.
        let mut topics = Vec::new();
        for dup in [false, true] {
            let share = if dup { args.duplicates } else { 0.0 };
            let (records, dups) = workload(args, share, 7 + round as u64);
            let topic = env.topic("consumer", args.partitions).await?;
            let publisher = outbox_kafka::KafkaPublisher::builder(&brokers, &topic)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
            for chunk in records.chunks(1000) {
                let r = publisher.publish(&chunk.iter().collect::<Vec<_>>()).await;
                anyhow::ensure!(r.iter().all(Result::is_ok), "filling the topic failed");
            }
            topics.push((topic, records.len(), dups));
        }
        let n = contenders.len();
        for k in 0..n {
            let c = contenders[(k + round) % n];
            let (topic, total, dups) = &topics[usize::from(c.dup)];
            let name = c.label(args);
            let seconds = consume(env, args, &brokers, topic, c, *total as u64, *dups as u64)
                .await
                .with_context(|| format!("round {}: {name}", round + 1))?;
            let rate = args.events as f64 / seconds;
            println!(
                "round {}/{rounds}  {name:<40} {total:>8} records in {seconds:>6.2} s = {rate:>8.0} events applied/s",
                round + 1
            );
            samples.add(&name, "events/s", rate);
            samples.add(&name, "records/s", *total as f64 / seconds);
        }
        env.cleanup().await?;
    }
    let reference = contenders[0].label(args);
    for c in &contenders[1..] {
        samples.compare(&c.label(args), "events/s", &reference);
    }
    for c in &contenders {
        report.target(
            &format!("{}: events/s >= 20,000", c.label(args)),
            samples.median(&c.label(args), "events/s"),
            20_000.0,
            true,
        );
    }
    report.figures = samples.figures();
    Ok(report)
}

/// `events` distinct events, round-robin over the aggregates (version = the round), with `dup`
/// of them copied up to 1,000 records later.
fn workload(args: &ConsumerArgs, dup: f64, seed: u64) -> (Vec<Envelope>, usize) {
    let events = args.events;
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

async fn consume(
    env: &Env,
    args: &ConsumerArgs,
    brokers: &str,
    topic: &str,
    c: Contender,
    total: u64,
    dups: u64,
) -> anyhow::Result<f64> {
    let schema = env.schema("consumer").await?;
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{schema}\".projection (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL)"
    ))
    .execute(&env.pool)
    .await?;
    let inbox = PostgresInboxStore::builder(env.pool.clone())
        .schema(&schema)
        .build()?;
    inbox.migrate().await?;
    let source = outbox_kafka::KafkaSource::builder(brokers, format!("bench-{schema}"))
        .topic(topic)
        .session_timeout(Duration::from_secs(6))
        .build()?;
    let config = EngineConfig::default()
        .with_max_batch(args.max_batch)
        .with_concurrency(args.concurrency)
        .with_max_in_flight(20_000)
        .with_commit(5_000, Duration::from_millis(500))
        .with_poll_timeout(Duration::from_millis(50));
    let events = total - dups;
    if c.set_based {
        let p = InboxProcessor::new("bench", inbox, Projection::new(&schema))
            .with_version_policy(VersionPolicy::Reject);
        drive(
            ConsumerEngine::new(source, p, config, 1)?,
            total,
            events,
            dups,
        )
        .await
    } else {
        let p = InboxProcessor::new("bench", inbox, PerEvent(Projection::new(&schema)))
            .with_version_policy(VersionPolicy::Reject);
        drive(
            ConsumerEngine::new(source, p, config, 1)?,
            total,
            events,
            dups,
        )
        .await
    }
}

async fn drive<S, H>(
    mut engine: ConsumerEngine<S, PostgresInboxStore, H>,
    total: u64,
    events: u64,
    dups: u64,
) -> anyhow::Result<f64>
where
    S: outbox_core::MessageSource,
    H: Handler<Transaction<'static, Postgres>> + 'static,
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
    Ok(seconds)
}
