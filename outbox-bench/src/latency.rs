//! End-to-end latency at a fixed offered load: single-event business transactions at `--rate`
//! per second (open loop, spread over `--clients` connections), one relay (the real driver,
//! default configuration) into the broker, and a consumer applying each event through the
//! inbox. Per event: commit → acknowledgement (the relay's publish call returned it) and
//! commit → applied (the consumer's inbox transaction committed), and where the time goes
//! (commit → publish call started: wake-up and claim; publish call: producer linger and the
//! broker round trip).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::{
    ClaimMode, Envelope, EventId, PublishResult, Publisher, Relay, RelayConfig, SystemClock,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::PostgresInboxStore;
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
    /// notify-before, notify-linger5, notify-early-claim, notify-fetch10.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

#[derive(Clone, Copy, Debug)]
struct Contender {
    id: &'static str,
    label: &'static str,
    notify: bool,
    /// `RelayConfig::early_claim` (the default: off).
    early_claim: bool,
    /// `linger.ms` set on the publisher (None: the publisher's default, 0).
    linger_ms: Option<u32>,
    /// `fetch.wait.max.ms` set on the consumer (None: librdkafka's default, 500 ms).
    fetch_wait_ms: Option<u32>,
}

const CONTENDERS: [Contender; 6] = [
    Contender {
        id: "notify",
        label: "NOTIFY wake-up (default)",
        notify: true,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: None,
    },
    Contender {
        id: "polling",
        label: "polling only",
        notify: false,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: None,
    },
    Contender {
        id: "notify-before",
        label: "NOTIFY, no early claim, linger.ms=5 (before)",
        notify: true,
        early_claim: false,
        linger_ms: Some(5),
        fetch_wait_ms: None,
    },
    Contender {
        id: "notify-linger5",
        label: "NOTIFY, linger.ms=5",
        notify: true,
        early_claim: false,
        linger_ms: Some(5),
        fetch_wait_ms: None,
    },
    Contender {
        id: "notify-early-claim",
        label: "NOTIFY, early claim, linger.ms=0",
        notify: true,
        early_claim: true,
        linger_ms: None,
        fetch_wait_ms: None,
    },
    Contender {
        id: "notify-fetch10",
        label: "NOTIFY, consumer fetch.wait.max.ms=10",
        notify: true,
        early_claim: false,
        linger_ms: None,
        fetch_wait_ms: Some(10),
    },
];

/// Times per event, shared by the load, the relay's publisher and the consumer.
#[derive(Default)]
struct Clocks {
    committed: HashMap<EventId, Instant>,
    publish: HashMap<EventId, (Instant, Instant)>,
    applied: HashMap<EventId, Instant>,
}

type SharedClocks = Arc<Mutex<Clocks>>;

/// The relay's publisher, timing each publish call.
struct Timed {
    inner: KafkaPublisher,
    clocks: SharedClocks,
}

#[outbox_core::async_trait]
impl Publisher for Timed {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let started = Instant::now();
        let results = self.inner.publish(batch).await;
        let ended = Instant::now();
        let mut c = self.clocks.lock().expect("clocks");
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

/// Runs the latency scenario.
pub(crate) async fn run(env: &Env, args: &LatencyArgs, rounds: usize) -> anyhow::Result<Report> {
    env.brokers()?;
    let contenders: Vec<Contender> = CONTENDERS
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| o == c.id))
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut report = Report::new("latency", rounds);
    report.param("rate_per_s", args.rate);
    report.param("seconds", args.seconds);
    report.param("clients", args.clients);
    report.param("partitions", args.partitions);
    report.param(
        "relay",
        "outbox_core::driver::run with RelayConfig defaults (batch 500, idle 10 ms..1 s, prefetch, early claim only where a contender turns it on), lease 60 s, KafkaPublisher defaults (linger.ms 0 unless a contender sets it)",
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        let n = contenders.len();
        for k in 0..n {
            let c = contenders[(k + round) % n];
            let figures = run_one(env, args, c)
                .await
                .with_context(|| format!("round {}: {}", round + 1, c.label))?;
            env.cleanup().await?;
            print!("round {}/{rounds}  {:<32}", round + 1, c.label);
            for (metric, value) in &figures {
                print!(" {metric} {value:.2}");
                samples.add(c.label, metric, *value);
            }
            println!();
        }
    }
    for c in &contenders {
        if c.id != "notify" {
            for m in ["ack p50 ms", "ack p99 ms", "ack p99.9 ms"] {
                samples.compare(c.label, m, CONTENDERS[0].label);
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

async fn run_one(
    env: &Env,
    args: &LatencyArgs,
    c: Contender,
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
    let inbox = PostgresInboxStore::builder(env.pool.clone())
        .schema(&schema)
        .build()?;
    inbox.migrate().await?;
    let effects = format!("\"{schema}\".effects");
    sqlx::raw_sql(&format!(
        "CREATE TABLE {effects} (event_id uuid PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp())"
    ))
    .execute(&env.pool)
    .await?;
    let topic = env.topic("latency", args.partitions).await?;
    let brokers = env.brokers()?.to_owned();
    let clocks: SharedClocks = Arc::default();

    // The relay.
    let mut pb = KafkaPublisher::builder(&brokers, &topic);
    if let Some(l) = c.linger_ms {
        pb = pb.set("linger.ms", l.to_string());
    }
    let publisher = Timed {
        inner: pb
            .start()
            .await
            .map_err(|e| anyhow::anyhow!("publisher: {e}"))?,
        clocks: clocks.clone(),
    };
    let relay = Relay::new(
        store.clone(),
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

    // The consumer.
    let handled = Arc::new(Mutex::new(Vec::new()));
    let processor = InboxProcessor::new(
        "bench-latency",
        inbox,
        Effect {
            table: effects.clone(),
            handled: handled.clone(),
        },
    );
    let mut source = outbox_kafka::KafkaSource::builder(&brokers, format!("bench-{topic}"))
        .topic(&topic)
        .session_timeout(Duration::from_secs(6));
    if let Some(ms) = c.fetch_wait_ms {
        source = source.set("fetch.wait.max.ms", ms.to_string());
    }
    let source = source.build()?;
    let config = EngineConfig::default()
        .with_concurrency(1)
        .with_poll_timeout(Duration::from_millis(20));
    let mut engine = ConsumerEngine::new(source, processor, config, 1)?;
    let consuming = Arc::new(AtomicBool::new(true));
    let consumer_task = {
        let (clocks, handled, consuming) = (clocks.clone(), handled.clone(), consuming.clone());
        tokio::spawn(async move {
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
        })
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
    while !clocks
        .lock()
        .expect("clocks")
        .applied
        .contains_key(&probe_id)
    {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the probe event was not applied within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

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
        let n = clocks.lock().expect("clocks").applied.len();
        if n > total {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {} of {total} events applied 60 s after the load ended",
            n.saturating_sub(1)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consuming.store(false, Ordering::Relaxed);
    consumer_task.await??;
    stop_relay.notify_one();
    relay_task.await?;
    if let Some(l) = listener {
        l.abort();
    }
    let notifies = store.notifications_raised();

    let c = clocks.lock().expect("clocks");
    let (mut ack, mut applied, mut wait, mut publish) = (vec![], vec![], vec![], vec![]);
    for (id, committed) in &c.committed {
        if *id == probe_id {
            continue;
        }
        let (start, end) = *c
            .publish
            .get(id)
            .context("an event without acknowledgement")?;
        let done = *c.applied.get(id).context("an event never applied")?;
        ack.push(end.saturating_duration_since(*committed));
        applied.push(done.saturating_duration_since(*committed));
        wait.push(start.saturating_duration_since(*committed));
        publish.push(end - start);
    }
    for v in [&mut ack, &mut applied, &mut wait, &mut publish] {
        v.sort_unstable();
    }
    Ok(vec![
        ("ack p50 ms".into(), quantile_ms(&ack, 0.5)),
        ("ack p99 ms".into(), quantile_ms(&ack, 0.99)),
        ("ack p99.9 ms".into(), quantile_ms(&ack, 0.999)),
        ("applied p50 ms".into(), quantile_ms(&applied, 0.5)),
        ("applied p99 ms".into(), quantile_ms(&applied, 0.99)),
        ("applied p99.9 ms".into(), quantile_ms(&applied, 0.999)),
        ("to publish p50 ms".into(), quantile_ms(&wait, 0.5)),
        ("publish p50 ms".into(), quantile_ms(&publish, 0.5)),
        ("offered/s".into(), total as f64 / offered_for),
        ("late starts".into(), late as f64),
        ("notifies/event".into(), notifies as f64 / total as f64),
    ])
}
