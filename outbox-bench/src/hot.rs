//! One hot aggregate (issue 25): `--versions` versions of one aggregate committed at once,
//! while a steady trickle of single-event transactions of other aggregates (`--rate` per
//! second over `--aggregates` aggregates) runs for `--seconds`; one relay (the real driver,
//! default configuration, NOTIFY wake-up, lease mode) into the publisher. Figures: the hot
//! aggregate's events/s over the trickle's window (its versions acknowledged in that window,
//! per second; the relay sends a version only after its predecessor was acknowledged: with
//! `--run 1` only after it was completed too, one version per claim cycle; with a longer run,
//! up to that many versions per claim) and the trickle's commit ->
//! acknowledgement latency p50/p99, beside the same trickle without the hot aggregate.
//! Publishers: the instant one (acknowledges at once, or after `--ack-delay-us`: the store's
//! and the relay's own cost, with a modelled broker round trip) and, with a broker, Kafka.
//!
//! Runs (issue 25, `RelayConfig::run`, `--run`, default the relay's 100): a store that
//! supports them hands out up to that many consecutive versions of the hot aggregate in one
//! claim, sent one after the other's acknowledgement, so the hot aggregate costs one claim
//! and one completion per run instead of per version. `--store memory` runs the scenario on
//! the in-memory store of `outbox-testkit` (which supports runs; no NOTIFY, the driver
//! polls), `--store postgres` (the default) on PostgreSQL, which hands out heads only until
//! it supports runs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::{
    ClaimMode, Envelope, EventId, PublishResult, Publisher, Relay, RelayConfig, SystemClock,
};
use outbox_kafka::KafkaPublisher;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::drain::InstantAcks;
use crate::env::{self, Env};
use crate::report::{quantile_ms, Report, Samples};

/// Options of `outbox-bench hot`.
#[derive(Debug, Clone, Args)]
pub(crate) struct HotArgs {
    /// Versions of the hot aggregate, committed in one transaction before the trickle starts.
    #[arg(long, default_value_t = 10_000)]
    versions: usize,
    /// The trickle: single-event transactions of other aggregates per second.
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// Aggregates the trickle is spread over.
    #[arg(long, default_value_t = 50)]
    aggregates: usize,
    /// Seconds the trickle runs (and the hot aggregate's rate is measured over).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Publishers (comma-separated): instant, kafka, nats (default: instant, and kafka when a
    /// broker is given; nats needs `--nats-url`, a JetStream stream with file storage that the
    /// bench creates and deletes).
    #[arg(long, value_delimiter = ',')]
    publishers: Vec<String>,
    /// The relay's run lengths to compare (comma-separated; `RelayConfig::run`, 1: heads
    /// only, one version of an aggregate per claim cycle): each is a contender of its own.
    /// An entry may name the waves' bound too: `100:2` (`run_budget` 2 ms instead of the
    /// default), `100:5:y` (and `run_yields`: the next batch claimed during the waves, which
    /// stop once it brought events).
    #[arg(long, value_delimiter = ',', default_values = ["1", "100"])]
    run: Vec<RunSpec>,
    /// Also measure each transport's single-message round trip: this many publish calls of
    /// one event through the crate's publisher, each awaited before the next (Kafka with a
    /// broker, NATS with `--nats-url`, RabbitMQ with `--amqp-url`; 0: not measured).
    #[arg(long, default_value_t = 0)]
    rtt: usize,
    /// The store: postgres, or memory (the in-memory store of outbox-testkit).
    #[arg(long, default_value = "postgres")]
    store: String,
    /// The instant publisher answers each publish call after this many microseconds (a
    /// modelled broker round trip; 0: at once).
    #[arg(long, default_value_t = 0)]
    ack_delay_us: u64,
    /// NATS server with JetStream (for `--rtt`); the bench creates and deletes its stream.
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
    /// RabbitMQ broker (for `--rtt`); the bench declares and deletes its exchange and queue.
    #[arg(long, env = "AMQP_URL")]
    amqp_url: Option<String>,
}

/// A contender's run settings: `run[:budget_ms[:y]]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RunSpec {
    run: usize,
    budget: Option<Duration>,
    yields: bool,
}

impl std::str::FromStr for RunSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut parts = s.split(':');
        let run = parts
            .next()
            .and_then(|r| r.trim().parse().ok())
            .ok_or_else(|| format!("{s:?}: expected run[:budget_ms[:y]]"))?;
        let budget = match parts.next() {
            Some(ms) => Some(Duration::from_secs_f64(
                ms.trim()
                    .parse::<f64>()
                    .map_err(|_| format!("{s:?}: the budget is milliseconds"))?
                    / 1000.0,
            )),
            None => None,
        };
        let yields = match parts.next() {
            Some("y") => true,
            None => false,
            Some(other) => return Err(format!("{s:?}: unknown flag {other:?} (y)")),
        };
        Ok(Self {
            run,
            budget,
            yields,
        })
    }
}

impl std::fmt::Display for RunSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.run)?;
        if let Some(b) = self.budget {
            write!(f, ":{}", b.as_secs_f64() * 1000.0)?;
        } else if self.yields {
            write!(
                f,
                ":{}",
                outbox_core::DEFAULT_RUN_BUDGET.as_secs_f64() * 1000.0
            )?;
        }
        if self.yields {
            write!(f, ":y")?;
        }
        Ok(())
    }
}

impl RunSpec {
    /// The relay's configuration for this contender.
    fn config(&self) -> anyhow::Result<RelayConfig> {
        let mut b = RelayConfig::builder()
            .owner("bench-hot")
            .run(self.run)
            .run_yields(self.yields);
        if let Some(budget) = self.budget {
            b = b.run_budget(budget);
        }
        Ok(b.build()?)
    }
}

/// When each event committed and when its acknowledgement came back.
#[derive(Default)]
struct Clocks {
    committed: HashMap<EventId, Instant>,
    acked: HashMap<EventId, Instant>,
}

type SharedClocks = Arc<Mutex<Clocks>>;

/// The relay's publisher, noting when each acknowledgement returned.
struct Timed<P> {
    inner: P,
    clocks: SharedClocks,
}

#[outbox_core::async_trait]
impl<P: Publisher> Publisher for Timed<P> {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let results = self.inner.publish(batch).await;
        let now = Instant::now();
        let mut c = self.clocks.lock().expect("clocks");
        for (e, r) in batch.iter().zip(&results) {
            if r.is_ok() {
                c.acked.entry(e.event_id).or_insert(now);
            }
        }
        results
    }
    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

/// The instant publisher, answering each call after a fixed delay (a modelled round trip).
struct Delayed {
    inner: InstantAcks,
    delay: Duration,
}

impl Delayed {
    fn new(us: u64) -> Self {
        Self {
            inner: InstantAcks::default(),
            delay: Duration::from_micros(us),
        }
    }
}

#[outbox_core::async_trait]
impl Publisher for Delayed {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.publish(batch).await
    }
    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

/// Runs the scenario.
pub(crate) async fn run(env: &Env, args: &HotArgs, rounds: usize) -> anyhow::Result<Report> {
    let publishers: Vec<String> = if args.publishers.is_empty() {
        let mut p = vec!["instant".to_owned()];
        if env.brokers().is_ok() && args.store != "memory" {
            p.push("kafka".to_owned());
        }
        p
    } else {
        args.publishers.clone()
    };
    for p in &publishers {
        anyhow::ensure!(
            p == "instant" || p == "kafka" || p == "nats",
            "--publishers: unknown publisher {p} (instant, kafka, nats)"
        );
        if p == "kafka" {
            env.brokers()?;
        }
        anyhow::ensure!(
            p != "nats" || args.nats_url.is_some(),
            "--publishers nats needs --nats-url (or NATS_URL)"
        );
    }
    anyhow::ensure!(args.rate >= 1, "--rate must be at least 1");
    anyhow::ensure!(
        args.store == "postgres" || args.store == "memory",
        "--store: unknown store {} (postgres, memory)",
        args.store
    );
    let mut report = Report::new("hot", rounds);
    report.param("store", &args.store);
    report.param("ack_delay_us", args.ack_delay_us);
    report.param("versions", args.versions);
    report.param("rate_per_s", args.rate);
    report.param("aggregates", args.aggregates);
    report.param("seconds", args.seconds);
    anyhow::ensure!(
        !args.run.is_empty()
            && args
                .run
                .iter()
                .all(|r| (1..=outbox_core::MAX_RUN).contains(&r.run) && r.config().is_ok()),
        "--run: each in 1..={}, budgets within the relay's bounds",
        outbox_core::MAX_RUN
    );
    report.param(
        "relay",
        "outbox_core::driver::run with RelayConfig defaults (batch 500, prefetch) but `run` \
         (run[:run_budget ms[:y = run_yields]]), NOTIFY wake-up, lease 60 s",
    );
    report.param(
        "run",
        args.run
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        let mut order = Vec::new();
        for p in &publishers {
            for &run in &args.run {
                for hot in [false, true] {
                    order.push((p.as_str(), run, hot));
                }
            }
        }
        let n = order.len();
        for k in 0..n {
            let (publisher, run, hot) = order[(k + round) % n];
            let label = format!(
                "{publisher} run {run}: {}",
                if hot {
                    "hot aggregate + trickle"
                } else {
                    "trickle only"
                }
            );
            let figures = if args.store == "memory" {
                run_one_memory(args, publisher, run, hot).await
            } else {
                run_one(env, args, publisher, run, hot).await
            }
            .with_context(|| format!("round {}: {label}", round + 1))?;
            env.cleanup().await?;
            print!("round {}/{rounds}  {label:<36}", round + 1);
            for (metric, value) in &figures {
                print!(" {metric} {value:.2}");
                samples.add(&label, metric, *value);
            }
            println!();
        }
    }
    for p in &publishers {
        for run in &args.run {
            let (with, without) = (
                format!("{p} run {run}: hot aggregate + trickle"),
                format!("{p} run {run}: trickle only"),
            );
            for m in ["trickle p50 ms", "trickle p99 ms"] {
                samples.compare(&with, m, &without);
            }
            report.target(
                &format!("{p} run {run}: hot aggregate >= 1,000 events/s"),
                samples.median(&with, "hot events/s"),
                1_000.0,
                true,
            );
        }
    }
    if args.rtt > 0 {
        report.param("rtt_calls", args.rtt);
        for round in 0..rounds {
            for (transport, rtt) in round_trips(env, args).await? {
                print!("round {}/{rounds}  rtt {transport:<30}", round + 1);
                for (metric, value) in rtt {
                    print!(" {metric} {value:.2}");
                    samples.add(&format!("rtt {transport}"), &metric, value);
                }
                println!();
            }
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

/// One event for a round-trip call.
fn rtt_event(i: usize) -> Envelope {
    Envelope::builder("order", "rtt", i as i64 + 1, "order.changed")
        .json(&env::payload(i))
        .and_then(|b| b.build())
        .expect("valid envelope")
}

/// `calls` publish calls of one event each through `publisher`, each awaited: p50 and p99 ms.
async fn time_calls<P: Publisher>(
    publisher: &P,
    calls: usize,
) -> anyhow::Result<Vec<(String, f64)>> {
    // One call first: connections and metadata are not part of the round trip.
    let warm = rtt_event(0);
    if let Some(Err(e)) = publisher.publish(&[&warm]).await.into_iter().next() {
        anyhow::bail!("warm-up publish: {e}");
    }
    let mut took = Vec::with_capacity(calls);
    for i in 0..calls {
        let e = rtt_event(i + 1);
        let started = Instant::now();
        let r = publisher.publish(&[&e]).await;
        took.push(started.elapsed());
        if let Some(Err(e)) = r.into_iter().next() {
            anyhow::bail!("publish {i}: {e}");
        }
    }
    took.sort_unstable();
    Ok(vec![
        ("p50 ms".into(), quantile_ms(&took, 0.5)),
        ("p99 ms".into(), quantile_ms(&took, 0.99)),
    ])
}

/// The single-message round trip of every transport that is configured.
async fn round_trips(
    env: &Env,
    args: &HotArgs,
) -> anyhow::Result<Vec<(&'static str, Vec<(String, f64)>)>> {
    let mut out = Vec::new();
    if let Ok(brokers) = env.brokers() {
        let topic = env.topic("rtt", 1).await?;
        let p = KafkaPublisher::builder(brokers, &topic)
            .start()
            .await
            .map_err(|e| anyhow::anyhow!("Kafka publisher: {e}"))?;
        out.push(("kafka", time_calls(&p, args.rtt).await?));
    }
    if let Some(url) = args.nats_url.as_deref() {
        use async_nats::jetstream::{self, stream};
        let client = async_nats::connect(url)
            .await
            .with_context(|| format!("cannot connect to NATS at {url}"))?;
        let js = jetstream::new(client);
        let prefix = format!("bench_{}_rtt", env.run);
        js.create_stream(stream::Config {
            name: prefix.clone(),
            subjects: vec![format!("{prefix}.>")],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .context("create the round trip's JetStream stream")?;
        let r = async {
            let p = outbox_nats::NatsPublisher::builder(url, &prefix)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("NATS publisher: {e}"))?;
            time_calls(&p, args.rtt).await
        }
        .await;
        let _ = js.delete_stream(&prefix).await;
        out.push(("nats", r?));
    }
    if let Some(url) = args.amqp_url.as_deref() {
        use lapin::options::{
            ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
            QueueDeleteOptions,
        };
        use lapin::types::FieldTable;
        let props = lapin::ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio);
        let conn = lapin::Connection::connect(url, props)
            .await
            .with_context(|| format!("cannot connect to RabbitMQ at {url}"))?;
        let ch = conn.create_channel().await?;
        let name = format!("bench_{}_rtt", env.run);
        ch.exchange_declare(
            &name,
            lapin::ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_declare(
            &name,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            outbox_rabbitmq::quorum_arguments(false),
        )
        .await?;
        ch.queue_bind(
            &name,
            &name,
            "#",
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        let r = async {
            let p = outbox_rabbitmq::RabbitPublisher::builder(url, &name)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("RabbitMQ publisher: {e}"))?;
            time_calls(&p, args.rtt).await
        }
        .await;
        let _ = ch.queue_delete(&name, QueueDeleteOptions::default()).await;
        let _ = ch
            .exchange_delete(&name, ExchangeDeleteOptions::default())
            .await;
        let _ = conn.close(200, "bench done").await;
        out.push(("rabbitmq", r?));
    }
    Ok(out)
}

/// One contender: the hot backlog (or not), the trickle, one relay.
async fn run_one(
    env: &Env,
    args: &HotArgs,
    publisher: &str,
    run: RunSpec,
    hot: bool,
) -> anyhow::Result<Vec<(String, f64)>> {
    let store = env
        .store(
            "hot",
            ClaimMode::Lease {
                duration: Duration::from_secs(60),
            },
            true,
        )
        .await?;
    let clocks: SharedClocks = Arc::default();
    let config = run.config()?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = store.spawn_listener(wake.clone())?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut nats_stream = None;
    let relay_task = {
        let stop = stop.clone();
        let store = store.clone();
        let clocks = clocks.clone();
        let until = async move { stop.notified().await };
        if publisher == "nats" {
            use async_nats::jetstream::{self, stream};
            let url = args.nats_url.as_deref().context("--nats-url")?;
            let client = async_nats::connect(url)
                .await
                .with_context(|| format!("cannot connect to NATS at {url}"))?;
            let js = jetstream::new(client);
            let prefix = format!(
                "bench_{}_hot_{}_{}",
                env.run,
                run.to_string().replace([':', '.'], "_"),
                u8::from(hot)
            );
            js.create_stream(stream::Config {
                name: prefix.clone(),
                subjects: vec![format!("{prefix}.>")],
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .context("create the hot scenario's JetStream stream")?;
            nats_stream = Some((js, prefix.clone()));
            let inner = outbox_nats::NatsPublisher::builder(url, &prefix)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("NATS publisher: {e}"))?;
            let relay = Relay::new(
                store,
                Timed { inner, clocks },
                config,
                Arc::new(SystemClock),
                Box::new(StdRng::seed_from_u64(7)),
            )?;
            tokio::spawn(outbox_core::driver::run(relay, Some(wake), until))
        } else if publisher == "kafka" {
            let topic = env.topic("hot", 6).await?;
            let inner = KafkaPublisher::builder(env.brokers()?, &topic)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
            // Warm the topic before the clock starts: the first send waits for the topic's
            // metadata (~1 s on a new topic), which is no steady-state latency.
            let warm = Envelope::builder("warm-up", "warm-up", 1, "warm-up")
                .build()
                .map_err(|e| anyhow::anyhow!("warm-up record: {e}"))?;
            for r in inner.publish(&[&warm]).await {
                r.map_err(|e| anyhow::anyhow!("warm-up send: {e}"))?;
            }
            let relay = Relay::new(
                store,
                Timed { inner, clocks },
                config,
                Arc::new(SystemClock),
                Box::new(StdRng::seed_from_u64(7)),
            )?;
            tokio::spawn(outbox_core::driver::run(relay, Some(wake), until))
        } else {
            let relay = Relay::new(
                store,
                Timed {
                    inner: Delayed::new(args.ack_delay_us),
                    clocks,
                },
                config,
                Arc::new(SystemClock),
                Box::new(StdRng::seed_from_u64(7)),
            )?;
            tokio::spawn(outbox_core::driver::run(relay, Some(wake), until))
        }
    };

    // The hot backlog, in one transaction.
    let mut hot_ids = Vec::new();
    if hot {
        let backlog: Vec<Envelope> = (0..args.versions)
            .map(|i| {
                Envelope::builder("order", "hot", i as i64 + 1, "order.changed")
                    .json(&env::payload(i))
                    .and_then(|b| b.build())
                    .expect("valid envelope")
            })
            .collect();
        hot_ids = backlog.iter().map(|e| e.event_id).collect();
        let mut tx = env.pool.begin().await?;
        store.append_many(&mut *tx, &backlog).await?;
        tx.commit().await?;
    }

    // The trickle: open loop at `rate`, one client.
    let total = (f64::from(args.rate) * args.seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate));
    let aggregates = args.aggregates.max(1);
    let started = tokio::time::Instant::now();
    let mut trickle_ids = Vec::with_capacity(total);
    for k in 0..total {
        tokio::time::sleep_until(started + interval.mul_f64(k as f64)).await;
        let e = Envelope::builder(
            "order",
            format!("cold-{}", k % aggregates),
            (k / aggregates) as i64 + 1,
            "order.changed",
        )
        .json(&env::payload(k))?
        .build()?;
        let id = e.event_id;
        let mut tx = env.pool.begin().await?;
        store.append(&mut *tx, &e).await?;
        tx.commit().await?;
        clocks
            .lock()
            .expect("clocks")
            .committed
            .insert(id, Instant::now());
        trickle_ids.push(id);
    }
    let window = started.elapsed();
    let hot_in_window = acknowledged(&clocks, &hot_ids);
    trickle_acknowledged(&clocks, &trickle_ids).await?;
    stop.notify_one();
    relay_task.await?;
    listener.abort();
    if let Some((js, name)) = nats_stream {
        let _ = js.delete_stream(&name).await;
    }

    Ok(figures(
        &clocks,
        &trickle_ids,
        window,
        hot.then_some(hot_in_window),
    ))
}

/// How many of `ids` were acknowledged so far.
fn acknowledged(clocks: &SharedClocks, ids: &[EventId]) -> usize {
    let c = clocks.lock().expect("clocks");
    ids.iter().filter(|id| c.acked.contains_key(id)).count()
}

/// Waits until every trickle event is acknowledged (60 s at most after the trickle ended: an
/// error then); the hot rest is left.
async fn trickle_acknowledged(
    clocks: &SharedClocks,
    trickle_ids: &[EventId],
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let missing = trickle_ids.len() - acknowledged(clocks, trickle_ids);
        if missing == 0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{missing} of {} trickle events not acknowledged 60 s after the trickle ended",
            trickle_ids.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One contender's figures: the trickle's commit -> acknowledgement p50/p99 and rate over
/// `window`, and with the hot aggregate (`hot_in_window`: its versions acknowledged within
/// the window) its rate.
fn figures(
    clocks: &SharedClocks,
    trickle_ids: &[EventId],
    window: Duration,
    hot_in_window: Option<usize>,
) -> Vec<(String, f64)> {
    let c = clocks.lock().expect("clocks");
    let mut latency: Vec<Duration> = trickle_ids
        .iter()
        .map(|id| c.acked[id].saturating_duration_since(c.committed[id]))
        .collect();
    latency.sort_unstable();
    let mut figures = vec![
        ("trickle p50 ms".into(), quantile_ms(&latency, 0.5)),
        ("trickle p99 ms".into(), quantile_ms(&latency, 0.99)),
        (
            "trickle/s".into(),
            trickle_ids.len() as f64 / window.as_secs_f64(),
        ),
    ];
    if let Some(n) = hot_in_window {
        figures.push(("hot events/s".into(), n as f64 / window.as_secs_f64()));
        figures.push(("hot acked".into(), n as f64));
    }
    figures
}

/// [`run_one`] on the in-memory store (real clock, lease mode, no wake-up: the driver polls
/// from 10 ms), instant publisher only.
async fn run_one_memory(
    args: &HotArgs,
    publisher: &str,
    run: RunSpec,
    hot: bool,
) -> anyhow::Result<Vec<(String, f64)>> {
    use outbox_core::AppendStore as _;
    use outbox_testkit::{MemoryDb, MemoryOutboxStore};
    anyhow::ensure!(
        publisher == "instant",
        "--store memory runs the instant publisher only"
    );
    let db = MemoryDb::new(SystemClock);
    let store = MemoryOutboxStore::new(
        &db,
        ClaimMode::Lease {
            duration: Duration::from_secs(60),
        },
    );
    let clocks: SharedClocks = Arc::default();
    let config = run.config()?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let relay = Relay::new(
        store.clone(),
        Timed {
            inner: Delayed::new(args.ack_delay_us),
            clocks: clocks.clone(),
        },
        config,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(7)),
    )?;
    let until = {
        let stop = stop.clone();
        async move { stop.notified().await }
    };
    let relay_task = tokio::spawn(outbox_core::driver::run(relay, None, until));
    let mut hot_ids = Vec::new();
    if hot {
        let backlog: Vec<Envelope> = (0..args.versions)
            .map(|i| {
                Envelope::builder("order", "hot", i as i64 + 1, "order.changed")
                    .json(&env::payload(i))
                    .and_then(|b| b.build())
                    .expect("valid envelope")
            })
            .collect();
        hot_ids = backlog.iter().map(|e| e.event_id).collect();
        let mut tx = db.begin();
        store.append(&mut tx, &backlog).await?;
        tx.commit()?;
    }
    let total = (f64::from(args.rate) * args.seconds) as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate));
    let aggregates = args.aggregates.max(1);
    let started = tokio::time::Instant::now();
    let mut trickle_ids = Vec::with_capacity(total);
    for k in 0..total {
        tokio::time::sleep_until(started + interval.mul_f64(k as f64)).await;
        let e = Envelope::builder(
            "order",
            format!("cold-{}", k % aggregates),
            (k / aggregates) as i64 + 1,
            "order.changed",
        )
        .json(&env::payload(k))?
        .build()?;
        let id = e.event_id;
        let mut tx = db.begin();
        store.append(&mut tx, std::slice::from_ref(&e)).await?;
        tx.commit()?;
        clocks
            .lock()
            .expect("clocks")
            .committed
            .insert(id, Instant::now());
        trickle_ids.push(id);
    }
    let window = started.elapsed();
    let hot_in_window = acknowledged(&clocks, &hot_ids);
    trickle_acknowledged(&clocks, &trickle_ids).await?;
    stop.notify_one();
    relay_task.await?;
    Ok(figures(
        &clocks,
        &trickle_ids,
        window,
        hot.then_some(hot_in_window),
    ))
}
