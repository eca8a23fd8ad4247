//! End-to-end latency at a fixed offered load: single-event business transactions at `--rate`
//! per second (open loop, spread over `--clients` connections), one relay (the real driver,
//! default configuration) into the broker, and a consumer applying each event through the
//! inbox. Per event: commit → acknowledgement (the relay's publish call returned it) and
//! commit → applied (the consumer's inbox transaction committed), and where the time goes
//! (commit → publish call started: wake-up and claim; publish call: producer linger and the
//! broker round trip).
//!
//! Per-stage timestamps (issue 25, latency pass): the store is wrapped (`TimedStore`) so that
//! every claim, completion and `stats()` call of the relay is timed, and each event's wait
//! splits into commit → start of the claim that took it, that claim, claim → publish call, and
//! the publish call; per cycle: claim, publish and completion times and events per cycle.
//! `--transport nats` runs the same scenario into NATS JetStream (acknowledgement only: no
//! consumer). `--probe` times the publisher alone (batches of 1, 10 and 50 records over the
//! topic's partitions, one call at a time, no database load), with each Kafka setting under test.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::{
    ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport, CompletionReport, Envelope,
    EventId, MaintenanceStore, OutboxStats, Outcome, PublishResult, Publisher, Relay, RelayConfig,
    RelayStore, StoreError, SystemClock,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
use rand::rngs::StdRng;
use rand::SeedableRng;
use sqlx::{Postgres, Transaction};

use crate::env::{self, Env};
use crate::report::{quantile_ms, Report, Samples};

/// Options of `outbox-bench latency`.
#[derive(Debug, Clone, Args)]
pub(crate) struct LatencyArgs {
    /// Offered load: single-event transactions per second.
    #[arg(long, default_value_t = 1000)]
    rate: u32,
    /// Measured seconds per contender and round.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Connections the load is spread over.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Partitions of each topic.
    #[arg(long, default_value_t = 6)]
    partitions: i32,
    /// Only these contenders (ids, comma-separated; default all): notify, polling,
    /// notify-before, notify-linger5, notify-nagle, notify-no-early-claim, notify-fetch10.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Transports (comma-separated): kafka (default), nats. Into NATS only the contenders
    /// without Kafka settings run, and only the acknowledgement is measured (no consumer).
    #[arg(long, value_delimiter = ',', default_value = "kafka")]
    transport: Vec<String>,
    /// NATS server with JetStream (for `--transport nats` and `--probe`).
    #[arg(long, env = "NATS_URL")]
    nats_url: Option<String>,
    /// Time the publishers alone instead: `--probe-calls` calls per batch size, one at a time.
    #[arg(long)]
    probe: bool,
    /// Publish calls per batch size and variant with `--probe`.
    #[arg(long, default_value_t = 300)]
    probe_calls: usize,
    /// Extra producer property `KEY=VALUE` for every Kafka publisher of the run (repeatable;
    /// e.g. `debug=protocol` with `RUST_LOG=librdkafka=debug` for librdkafka's own per-request
    /// timings).
    #[arg(long = "kafka-set", value_name = "KEY=VALUE")]
    kafka_set: Vec<String>,
}

impl LatencyArgs {
    /// The `--kafka-set` properties.
    fn kafka_props(&self) -> anyhow::Result<Vec<(String, String)>> {
        self.kafka_set
            .iter()
            .map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                    .with_context(|| format!("--kafka-set {kv:?}: expected KEY=VALUE"))
            })
            .collect()
    }
}

#[derive(Clone, Copy, Debug)]
struct Contender {
    id: &'static str,
    label: &'static str,
    notify: bool,
    /// `RelayConfig::early_claim` (the default: on).
    early_claim: bool,
    /// `linger.ms` set on the publisher (None: the publisher's default, 0).
    linger_ms: Option<u32>,
    /// `fetch.wait.max.ms` set on the consumer (None: librdkafka's default, 500 ms).
    fetch_wait_ms: Option<u32>,
    /// Other producer properties set on the publisher.
    kafka: &'static [(&'static str, &'static str)],
}

impl Contender {
    /// Whether the contender changes only what every transport has (the relay, the wake-up).
    fn transport_neutral(&self) -> bool {
        self.linger_ms.is_none() && self.fetch_wait_ms.is_none() && self.kafka.is_empty()
    }
}

const CONTENDERS: [Contender; 7] = [
    Contender {
        id: "notify",
        label: "NOTIFY wake-up (default)",
        notify: true,
        early_claim: true,
        linger_ms: None,
        fetch_wait_ms: None,
        kafka: &[],
    },
    Contender {
        id: "polling",
        label: "polling only",
        notify: false,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: None,
        kafka: &[],
    },
    Contender {
        id: "notify-before",
        label: "NOTIFY, no early claim, linger.ms=5 (before)",
        notify: true,
        early_claim: false,
        linger_ms: Some(5),
        fetch_wait_ms: None,
        kafka: &[],
    },
    Contender {
        id: "notify-linger5",
        label: "NOTIFY, linger.ms=5",
        notify: true,
        early_claim: false,
        linger_ms: Some(5),
        fetch_wait_ms: None,
        kafka: &[],
    },
    Contender {
        id: "notify-nagle",
        label: "NOTIFY, socket.nagle.disable=true",
        notify: true,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: None,
        kafka: &[("socket.nagle.disable", "true")],
    },
    Contender {
        id: "notify-no-early-claim",
        label: "NOTIFY, no early claim (the default before stop 41)",
        notify: true,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: None,
        kafka: &[],
    },
    Contender {
        id: "notify-fetch10",
        label: "NOTIFY, consumer fetch.wait.max.ms=10",
        notify: true,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: Some(10),
        kafka: &[],
    },
];

/// Times per event, shared by the load, the relay's store and publisher and the consumer.
#[derive(Default)]
struct Clocks {
    committed: HashMap<EventId, Instant>,
    /// The claim that took the event: its start and end, and whether the claim before it came
    /// back empty (the relay had been idle, waiting for a wake-up or its poll).
    claimed: HashMap<EventId, (Instant, Instant, bool)>,
    publish: HashMap<EventId, (Instant, Instant)>,
    applied: HashMap<EventId, Instant>,
    /// Every claim of the relay: start, end, events.
    claims: Vec<(Instant, Instant, usize)>,
    /// Every completion: start, end.
    completions: Vec<(Instant, Instant)>,
    /// Every publish call: start, end, records.
    publishes: Vec<(Instant, Instant, usize)>,
    /// Every `stats()` call of the driver: start and end.
    stats: Vec<(Instant, Instant)>,
    last_claim_empty: bool,
}

type SharedClocks = Arc<Mutex<Clocks>>;

/// The relay's publisher, timing each publish call.
struct Timed<P> {
    inner: P,
    clocks: SharedClocks,
}

#[outbox_core::async_trait]
impl<P: Publisher> Publisher for Timed<P> {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let started = Instant::now();
        let results = self.inner.publish(batch).await;
        let ended = Instant::now();
        let mut c = self.clocks.lock().expect("clocks");
        c.publishes.push((started, ended, batch.len()));
        for (e, r) in batch.iter().zip(&results) {
            if r.is_ok() {
                c.publish.entry(e.event_id).or_insert((started, ended));
            }
        }
        results
    }
    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

/// The relay's store, timing each claim, completion and `stats()` call (the per-stage
/// timestamps of the latency breakdown).
#[derive(Clone)]
struct TimedStore {
    inner: PostgresOutboxStore,
    clocks: SharedClocks,
}

#[outbox_core::async_trait]
impl RelayStore for TimedStore {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let started = Instant::now();
        let batch = self.inner.claim(request).await?;
        let ended = Instant::now();
        let mut c = self.clocks.lock().expect("clocks");
        let after_idle = c.last_claim_empty;
        c.last_claim_empty = batch.is_empty();
        c.claims.push((started, ended, batch.records.len()));
        for r in &batch.records {
            c.claimed
                .entry(r.envelope.event_id)
                .or_insert((started, ended, after_idle));
        }
        Ok(batch)
    }
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let started = Instant::now();
        let r = self.inner.complete(claim, outcomes).await;
        let ended = Instant::now();
        self.clocks
            .lock()
            .expect("clocks")
            .completions
            .push((started, ended));
        r
    }
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.inner.release(claim).await
    }
    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

#[outbox_core::async_trait]
impl MaintenanceStore for TimedStore {
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        self.inner.cleanup(retention, batch_size).await
    }
    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        let started = Instant::now();
        let r = self.inner.stats().await;
        let ended = Instant::now();
        self.clocks
            .lock()
            .expect("clocks")
            .stats
            .push((started, ended));
        r
    }
}

/// The consumer's effect: one row per event; the ids wait for their transaction's commit.
struct Effect {
    table: String,
    handled: Arc<Mutex<Vec<EventId>>>,
}

#[outbox_core::async_trait]
impl Handler<Transaction<'static, Postgres>> for Effect {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        sqlx::query(&format!(
            "INSERT INTO {} (event_id) VALUES ($1)",
            self.table
        ))
        .bind(event.event_id.as_uuid())
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::transient(e.to_string()))?;
        self.handled.lock().expect("handled").push(event.event_id);
        Ok(())
    }
}

/// A transport of the scenario.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Transport {
    Kafka,
    Nats,
}

impl Transport {
    fn parse(names: &[String]) -> anyhow::Result<Vec<Transport>> {
        let mut out = Vec::new();
        for n in names {
            let t = match n.trim() {
                "kafka" => Transport::Kafka,
                "nats" => Transport::Nats,
                other => anyhow::bail!("unknown transport {other:?}: expected kafka or nats"),
            };
            if !out.contains(&t) {
                out.push(t);
            }
        }
        anyhow::ensure!(!out.is_empty(), "no transport selected");
        Ok(out)
    }

    fn label(self, c: &Contender) -> String {
        match self {
            Transport::Kafka => c.label.to_owned(),
            Transport::Nats => format!("NATS: {}", c.label),
        }
    }
}

/// The relay's publisher on either transport.
enum AnyPublisher {
    Kafka(KafkaPublisher),
    Nats(outbox_nats::NatsPublisher),
}

#[outbox_core::async_trait]
impl Publisher for AnyPublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        match self {
            AnyPublisher::Kafka(p) => p.publish(batch).await,
            AnyPublisher::Nats(p) => p.publish(batch).await,
        }
    }
    fn delivery_timeout(&self) -> Duration {
        match self {
            AnyPublisher::Kafka(p) => p.delivery_timeout(),
            AnyPublisher::Nats(p) => p.delivery_timeout(),
        }
    }
}

/// A JetStream stream (file storage) capturing `<name>.>`, for one contender.
async fn nats_stream(url: &str, name: &str) -> anyhow::Result<async_nats::jetstream::Context> {
    use async_nats::jetstream::{self, stream};
    let client = async_nats::connect(url)
        .await
        .with_context(|| format!("cannot connect to NATS at {url}"))?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: name.to_owned(),
        subjects: vec![format!("{name}.>")],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .context("create the latency bench's JetStream stream")?;
    Ok(js)
}

/// Runs the latency scenario.
pub(crate) async fn run(env: &Env, args: &LatencyArgs, rounds: usize) -> anyhow::Result<Report> {
    let transports = Transport::parse(&args.transport)?;
    if transports.contains(&Transport::Kafka) {
        env.brokers()?;
    }
    if transports.contains(&Transport::Nats) {
        args.nats_url
            .as_deref()
            .context("--transport nats needs NATS_URL or --nats-url")?;
    }
    if args.probe {
        return probe(env, args, rounds, &transports).await;
    }
    let contenders: Vec<(Transport, Contender)> = transports
        .iter()
        .flat_map(|t| CONTENDERS.into_iter().map(move |c| (*t, c)))
        .filter(|(_, c)| args.only.is_empty() || args.only.iter().any(|o| o == c.id))
        .filter(|(t, c)| *t == Transport::Kafka || c.transport_neutral())
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut report = Report::new("latency", rounds);
    report.param("rate_per_s", args.rate);
    report.param("seconds", args.seconds);
    report.param("clients", args.clients);
    report.param("partitions", args.partitions);
    report.param(
        "relay",
        "outbox_core::driver::run with RelayConfig defaults (batch 500, idle 10 ms..1 s, prefetch, early claim unless a contender turns it off), lease 60 s, KafkaPublisher / NatsPublisher defaults (linger.ms 0 unless a contender sets it)",
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        let n = contenders.len();
        for k in 0..n {
            let (t, c) = contenders[(k + round) % n];
            let label = t.label(&c);
            let load = load_average();
            let figures = run_one(env, args, c, t)
                .await
                .with_context(|| format!("round {}: {label}", round + 1))?;
            env.cleanup().await?;
            print!("round {}/{rounds}  {label:<40} load {load:.2}", round + 1);
            samples.add(&label, "load 1 min", load);
            for (metric, value) in &figures {
                print!(" {metric} {value:.2}");
                samples.add(&label, metric, *value);
            }
            println!();
        }
    }
    let reference = contenders[0].0.label(&contenders[0].1);
    for (t, c) in &contenders {
        let label = t.label(c);
        if label != reference {
            for m in ["ack p50 ms", "ack p99 ms", "ack p99.9 ms", "publish p50 ms"] {
                samples.compare(&label, m, &reference);
            }
        }
    }
    report.target(
        "NOTIFY: commit -> acknowledgement p50 <= 5 ms",
        samples.median(CONTENDERS[0].label, "ack p50 ms"),
        5.0,
        false,
    );
    report.target(
        "NOTIFY: commit -> acknowledgement p99 <= 20 ms",
        samples.median(CONTENDERS[0].label, "ack p99 ms"),
        20.0,
        false,
    );
    report.figures = samples.figures();
    Ok(report)
}

/// The 1-minute load average (`/proc/loadavg`), NaN where there is none.
fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

async fn run_one(
    env: &Env,
    args: &LatencyArgs,
    c: Contender,
    transport: Transport,
) -> anyhow::Result<Vec<(String, f64)>> {
    let store = env
        .store(
            "latency",
            ClaimMode::Lease {
                duration: Duration::from_secs(60),
            },
            c.notify,
        )
        .await?;
    let schema = store.settings().schema.clone();
    let clocks: SharedClocks = Arc::default();

    // The relay's publisher.
    let mut nats = None;
    let (publisher, topic) = match transport {
        Transport::Kafka => {
            let topic = env.topic("latency", args.partitions).await?;
            let mut pb = KafkaPublisher::builder(env.brokers()?, &topic);
            if let Some(l) = c.linger_ms {
                pb = pb.set("linger.ms", l.to_string());
            }
            for (k, v) in c.kafka {
                pb = pb.set(*k, *v);
            }
            for (k, v) in args.kafka_props()? {
                pb = pb.set(k, v);
            }
            let p = pb
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
            (AnyPublisher::Kafka(p), Some(topic))
        }
        Transport::Nats => {
            let url = args.nats_url.as_deref().context("no NATS_URL")?;
            let name = format!("bench_{}_latency", env.run);
            let js = nats_stream(url, &name).await?;
            nats = Some((js, name.clone()));
            let p = outbox_nats::NatsPublisher::builder(url, &name)
                .start()
                .await
                .map_err(|e| anyhow::anyhow!("NATS publisher: {e}"))?;
            (AnyPublisher::Nats(p), None)
        }
    };
    let r = run_relay(env, args, c, &store, &schema, publisher, topic, clocks).await;
    if let Some((js, name)) = nats {
        let _ = js.delete_stream(&name).await;
    }
    r
}

#[allow(clippy::too_many_arguments)]
async fn run_relay(
    env: &Env,
    args: &LatencyArgs,
    c: Contender,
    store: &PostgresOutboxStore,
    schema: &str,
    publisher: AnyPublisher,
    topic: Option<String>,
    clocks: SharedClocks,
) -> anyhow::Result<Vec<(String, f64)>> {
    let publisher = Timed {
        inner: publisher,
        clocks: clocks.clone(),
    };
    let relay = Relay::new(
        TimedStore {
            inner: store.clone(),
            clocks: clocks.clone(),
        },
        publisher,
        RelayConfig::builder()
            .owner("bench-latency")
            .early_claim(c.early_claim)
            .build()?,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(7)),
    )?;
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = if c.notify {
        Some(store.spawn_listener(wake.clone())?)
    } else {
        None
    };
    let stop_relay = Arc::new(tokio::sync::Notify::new());
    let relay_task = {
        let stop = stop_relay.clone();
        let wake = c.notify.then_some(wake);
        tokio::spawn(outbox_core::driver::run(relay, wake, async move {
            stop.notified().await;
        }))
    };

    // The consumer (Kafka only).
    let consuming = Arc::new(AtomicBool::new(true));
    let consumer_task = match &topic {
        Some(topic) => {
            let inbox = PostgresInboxStore::builder(env.pool.clone())
                .schema(schema)
                .build()?;
            inbox.migrate().await?;
            let effects = format!("\"{schema}\".effects");
            sqlx::raw_sql(&format!(
                "CREATE TABLE {effects} (event_id uuid PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ))
            .execute(&env.pool)
            .await?;
            let handled = Arc::new(Mutex::new(Vec::new()));
            let processor = InboxProcessor::new(
                "bench-latency",
                inbox,
                Effect {
                    table: effects.clone(),
                    handled: handled.clone(),
                },
            );
            let mut source =
                outbox_kafka::KafkaSource::builder(env.brokers()?, format!("bench-{topic}"))
                    .topic(topic)
                    .session_timeout(Duration::from_secs(6));
            if let Some(ms) = c.fetch_wait_ms {
                source = source.set("fetch.wait.max.ms", ms.to_string());
            }
            let source = source.build()?;
            let config = EngineConfig::default()
                .with_concurrency(1)
                .with_poll_timeout(Duration::from_millis(20));
            let mut engine = ConsumerEngine::new(source, processor, config, 1)?;
            let (clocks, handled, consuming) = (clocks.clone(), handled.clone(), consuming.clone());
            Some(tokio::spawn(async move {
                let mut applied = 0;
                while consuming.load(Ordering::Relaxed) {
                    engine.step().await?;
                    let now_applied = engine.report().applied;
                    if now_applied > applied {
                        applied = now_applied;
                        let now = Instant::now();
                        let ids = std::mem::take(&mut *handled.lock().expect("handled"));
                        let mut c = clocks.lock().expect("clocks");
                        for id in ids {
                            c.applied.entry(id).or_insert(now);
                        }
                    }
                }
                engine.commit_final().await?;
                Ok::<_, anyhow::Error>(())
            }))
        }
        None => None,
    };
    let consumed = consumer_task.is_some();
    // What "done" means for an event: applied by the consumer, or acknowledged without one.
    let done = |c: &Clocks| {
        if consumed {
            c.applied.len()
        } else {
            c.publish.len()
        }
    };
    let is_done = |c: &Clocks, id: &EventId| {
        if consumed {
            c.applied.contains_key(id)
        } else {
            c.publish.contains_key(id)
        }
    };

    // Wait until one probe event went all the way (the consumer group has joined).
    let probe = Envelope::builder("probe", "probe", 1, "probe")
        .json(&serde_json::json!({}))?
        .build()?;
    let probe_id = probe.event_id;
    store.append(&env.pool, &probe).await?;
    clocks
        .lock()
        .expect("clocks")
        .committed
        .insert(probe_id, Instant::now());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !is_done(&clocks.lock().expect("clocks"), &probe_id) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the probe event was not applied within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let measured_from = Instant::now();

    // The load: open loop, each client at rate / clients.
    let total = (f64::from(args.rate) * args.seconds) as usize;
    let clients = args.clients.max(1);
    let interval = Duration::from_secs_f64(clients as f64 / f64::from(args.rate.max(1)));
    let started = tokio::time::Instant::now();
    let mut load = Vec::new();
    for client in 0..clients {
        let (pool, store, clocks) = (env.pool.clone(), store.clone(), clocks.clone());
        let count = total / clients + usize::from(client < total % clients);
        load.push(tokio::spawn(async move {
            let mut late = 0u64;
            for k in 0..count {
                let due = started
                    + interval.mul_f64(k as f64)
                    + interval.mul_f64(client as f64 / clients as f64);
                if tokio::time::Instant::now() > due + Duration::from_millis(5) {
                    late += 1;
                }
                tokio::time::sleep_until(due).await;
                let e = Envelope::builder(
                    "order",
                    format!("c{client}-{}", k % 100),
                    (k / 100) as i64 + 1,
                    "order.changed",
                )
                .json(&env::payload(k))?
                .build()?;
                let id = e.event_id;
                let mut tx = pool.begin().await?;
                store.append(&mut *tx, &e).await?;
                tx.commit().await?;
                clocks
                    .lock()
                    .expect("clocks")
                    .committed
                    .insert(id, Instant::now());
            }
            Ok::<_, anyhow::Error>(late)
        }));
    }
    let mut late = 0;
    for t in load {
        late += t.await??;
    }
    let offered_for = started.elapsed().as_secs_f64();
    // Everything applied (or a clear failure).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n = done(&clocks.lock().expect("clocks"));
        if n > total {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} of {total} events done 60 s after the load ended",
            n.saturating_sub(1)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let measured_to = Instant::now();
    consuming.store(false, Ordering::Relaxed);
    if let Some(t) = consumer_task {
        t.await??;
    }
    stop_relay.notify_one();
    relay_task.await?;
    if let Some(l) = listener {
        l.abort();
    }
    let notifies = store.notifications_raised();

    let c = clocks.lock().expect("clocks");
    let (mut ack, mut applied, mut wait, mut publish) = (vec![], vec![], vec![], vec![]);
    let (mut to_claim, mut claim, mut to_publish_call) = (vec![], vec![], vec![]);
    // Per event: (ack, commit -> claim start, claim, publish call), for the tail's breakdown.
    let mut parts: Vec<(Duration, Duration, Duration, Duration)> = vec![];
    let (mut after_idle, mut after_idle_to_claim) = (0usize, vec![]);
    // Events that waited through a `stats()` call of the driver (it started between their
    // commit and the start of their claim), and the acknowledgement of all the others.
    let (mut behind_stats, mut ack_not_behind_stats) = (0usize, vec![]);
    for (id, committed) in &c.committed {
        if *id == probe_id {
            continue;
        }
        let (start, end) = *c
            .publish
            .get(id)
            .context("an event without acknowledgement")?;
        if consumed {
            let done = *c.applied.get(id).context("an event never applied")?;
            applied.push(done.saturating_duration_since(*committed));
        }
        ack.push(end.saturating_duration_since(*committed));
        wait.push(start.saturating_duration_since(*committed));
        publish.push(end - start);
        if let Some((claim_start, claim_end, idle)) = c.claimed.get(id) {
            let d = claim_start.saturating_duration_since(*committed);
            parts.push((
                end.saturating_duration_since(*committed),
                d,
                claim_end.saturating_duration_since(*claim_start),
                end - start,
            ));
            to_claim.push(d);
            claim.push(claim_end.saturating_duration_since(*claim_start));
            to_publish_call.push(start.saturating_duration_since(*claim_end));
            if *idle {
                after_idle += 1;
                after_idle_to_claim.push(d);
            }
            if c.stats
                .iter()
                .any(|(s, _)| s >= committed && s <= claim_start)
            {
                behind_stats += 1;
            } else {
                ack_not_behind_stats.push(end.saturating_duration_since(*committed));
            }
        }
    }
    // Per cycle, over the measured window (probe and drain-out excluded).
    let within = |t: &Instant| *t >= measured_from && *t <= measured_to;
    let mut cycle_claim: Vec<Duration> = c
        .claims
        .iter()
        .filter(|(s, _, n)| within(s) && *n > 0)
        .map(|(s, e, _)| *e - *s)
        .collect();
    let mut empty_claim: Vec<Duration> = c
        .claims
        .iter()
        .filter(|(s, _, n)| within(s) && *n == 0)
        .map(|(s, e, _)| *e - *s)
        .collect();
    let mut cycle_complete: Vec<Duration> = c
        .completions
        .iter()
        .filter(|(s, _)| within(s))
        .map(|(s, e)| *e - *s)
        .collect();
    let mut cycle_publish: Vec<Duration> = c
        .publishes
        .iter()
        .filter(|(s, _, _)| within(s))
        .map(|(s, e, _)| *e - *s)
        .collect();
    let published_calls: Vec<usize> = c
        .publishes
        .iter()
        .filter(|(s, _, _)| within(s))
        .map(|(_, _, n)| *n)
        .collect();
    let per_call =
        published_calls.iter().sum::<usize>() as f64 / published_calls.len().max(1) as f64;
    let stats_max = c
        .stats
        .iter()
        .map(|(s, e)| *e - *s)
        .max()
        .unwrap_or_default();
    for v in [
        &mut ack,
        &mut applied,
        &mut wait,
        &mut publish,
        &mut to_claim,
        &mut claim,
        &mut to_publish_call,
        &mut after_idle_to_claim,
        &mut ack_not_behind_stats,
        &mut cycle_claim,
        &mut empty_claim,
        &mut cycle_complete,
        &mut cycle_publish,
    ] {
        v.sort_unstable();
    }
    // The slowest 1% of events (ack at or above p99): the median of each part.
    parts.sort_unstable_by_key(|p| p.0);
    let tail = &parts[parts.len() - parts.len().div_ceil(100).min(parts.len())..];
    let tail_median = |f: fn(&(Duration, Duration, Duration, Duration)) -> Duration| {
        let mut v: Vec<Duration> = tail.iter().map(f).collect();
        v.sort_unstable();
        quantile_ms(&v, 0.5)
    };
    let mut out: Vec<(String, f64)> = vec![
        ("ack p50 ms".into(), quantile_ms(&ack, 0.5)),
        ("ack p99 ms".into(), quantile_ms(&ack, 0.99)),
        ("ack p99.9 ms".into(), quantile_ms(&ack, 0.999)),
    ];
    if consumed {
        out.extend([
            ("applied p50 ms".into(), quantile_ms(&applied, 0.5)),
            ("applied p99 ms".into(), quantile_ms(&applied, 0.99)),
            ("applied p99.9 ms".into(), quantile_ms(&applied, 0.999)),
        ]);
    }
    out.extend([
        ("to publish p50 ms".into(), quantile_ms(&wait, 0.5)),
        ("publish p50 ms".into(), quantile_ms(&publish, 0.5)),
        ("publish p99 ms".into(), quantile_ms(&publish, 0.99)),
        // The wait before the publish call, split per event.
        (
            "commit->claim start p50 ms".into(),
            quantile_ms(&to_claim, 0.5),
        ),
        ("claim p50 ms".into(), quantile_ms(&claim, 0.5)),
        (
            "claim end->publish p50 ms".into(),
            quantile_ms(&to_publish_call, 0.5),
        ),
        (
            "events claimed after an empty claim %".into(),
            100.0 * after_idle as f64 / ack.len().max(1) as f64,
        ),
        (
            "after empty: commit->claim p50 ms".into(),
            quantile_ms(&after_idle_to_claim, 0.5),
        ),
        // Per cycle.
        ("cycle: claim p50 ms".into(), quantile_ms(&cycle_claim, 0.5)),
        (
            "cycle: publish p50 ms".into(),
            quantile_ms(&cycle_publish, 0.5),
        ),
        (
            "cycle: completion p50 ms".into(),
            quantile_ms(&cycle_complete, 0.5),
        ),
        (
            "cycle: empty claim p50 ms".into(),
            quantile_ms(&empty_claim, 0.5),
        ),
        ("empty claims".into(), empty_claim.len() as f64),
        ("cycle: events per publish call".into(), per_call),
        (
            "tail 1%: commit->claim start p50 ms".into(),
            tail_median(|p| p.1),
        ),
        ("tail 1%: claim p50 ms".into(), tail_median(|p| p.2)),
        ("tail 1%: publish p50 ms".into(), tail_median(|p| p.3)),
        ("stats() max ms".into(), stats_max.as_secs_f64() * 1e3),
        ("events behind a stats() call".into(), behind_stats as f64),
        (
            "ack p99 without those ms".into(),
            quantile_ms(&ack_not_behind_stats, 0.99),
        ),
        (
            "ack p99.9 without those ms".into(),
            quantile_ms(&ack_not_behind_stats, 0.999),
        ),
        ("offered/s".into(), total as f64 / offered_for),
        ("late starts".into(), late as f64),
        ("notifies/event".into(), notifies as f64 / total as f64),
    ]);
    Ok(out)
}

/// `--probe`: the publishers alone, one call at a time, batches of 1, 10 and 50 records (each
/// of its own aggregate, so spread over the topic's partitions), with the Kafka settings under
/// test; no database and no other load.
async fn probe(
    env: &Env,
    args: &LatencyArgs,
    rounds: usize,
    transports: &[Transport],
) -> anyhow::Result<Report> {
    type Props = &'static [(&'static str, &'static str)];
    let mut variants: Vec<(String, Option<(i32, Props)>)> = Vec::new();
    if transports.contains(&Transport::Kafka) {
        let p = args.partitions;
        variants.push((format!("kafka {p} partitions, defaults"), Some((p, &[]))));
        variants.push((
            format!("kafka {p} partitions, socket.nagle.disable=true"),
            Some((p, &[("socket.nagle.disable", "true")])),
        ));
        variants.push((
            format!("kafka {p} partitions, socket.nagle.disable=false"),
            Some((p, &[("socket.nagle.disable", "false")])),
        ));
        variants.push(("kafka 1 partition, defaults".into(), Some((1, &[]))));
    }
    if transports.contains(&Transport::Nats) {
        variants.push(("nats, defaults".into(), None));
    }
    let mut report = Report::new("latency-probe", rounds);
    report.param("calls", args.probe_calls);
    let mut samples = Samples::default();
    for round in 0..rounds {
        for k in 0..variants.len() {
            let (label, v) = &variants[(k + round) % variants.len()];
            let load = load_average();
            let (publisher, nats) = match v {
                Some((partitions, props)) => {
                    let topic = env.topic("probe", *partitions).await?;
                    let mut pb = KafkaPublisher::builder(env.brokers()?, &topic);
                    for (k, v) in props.iter() {
                        pb = pb.set(*k, *v);
                    }
                    for (k, v) in args.kafka_props()? {
                        pb = pb.set(k, v);
                    }
                    let p = pb
                        .start()
                        .await
                        .map_err(|e| anyhow::anyhow!("publisher: {e}"))?;
                    (AnyPublisher::Kafka(p), None)
                }
                None => {
                    let url = args.nats_url.as_deref().context("no NATS_URL")?;
                    let name = format!("bench_{}_probe", env.run);
                    let js = nats_stream(url, &name).await?;
                    let p = outbox_nats::NatsPublisher::builder(url, &name)
                        .start()
                        .await
                        .map_err(|e| anyhow::anyhow!("NATS publisher: {e}"))?;
                    (AnyPublisher::Nats(p), Some((js, name)))
                }
            };
            let r = probe_calls(&publisher, args.probe_calls).await;
            if let Some((js, name)) = nats {
                let _ = js.delete_stream(&name).await;
            }
            env.cleanup().await?;
            print!(
                "round {}/{rounds}  probe {label:<44} load {load:.2}",
                round + 1
            );
            for (metric, value) in r? {
                print!(" {metric} {value:.3}");
                samples.add(label, &metric, value);
            }
            println!();
        }
    }
    for (label, _) in variants.iter().skip(1) {
        for b in PROBE_BATCHES {
            samples.compare(label, &format!("b{b} p50 ms"), &variants[0].0);
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

const PROBE_BATCHES: [usize; 3] = [1, 10, 50];

async fn probe_calls(p: &AnyPublisher, calls: usize) -> anyhow::Result<Vec<(String, f64)>> {
    let mut out = Vec::new();
    let mut version = 0i64;
    for b in PROBE_BATCHES {
        let mut took = Vec::with_capacity(calls);
        // One warm-up call first (connection, metadata, producer id).
        for call in 0..=calls {
            version += 1;
            let batch: Vec<Envelope> = (0..b)
                .map(|i| {
                    Envelope::builder("order", format!("probe-{i}"), version, "order.changed")
                        .json(&env::payload(i))
                        .and_then(|e| e.build())
                        .expect("valid envelope")
                })
                .collect();
            let refs: Vec<&Envelope> = batch.iter().collect();
            let started = Instant::now();
            let results = p.publish(&refs).await;
            if call > 0 {
                took.push(started.elapsed());
            }
            if let Some(Err(e)) = results.into_iter().find(|r| r.is_err()) {
                anyhow::bail!("probe publish: {e}");
            }
        }
        took.sort_unstable();
        out.push((format!("b{b} p50 ms"), quantile_ms(&took, 0.5)));
        out.push((format!("b{b} p99 ms"), quantile_ms(&took, 0.99)));
    }
    Ok(out)
}
