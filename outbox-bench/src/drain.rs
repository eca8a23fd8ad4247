//! Drain: a preloaded backlog drained by each contender, rounds alternating the contenders.
//!
//! Without the broker (the store's share, [`Store`] contenders): a naive `SKIP LOCKED` claim and
//! one `UPDATE` on the outbox table (no order), the store's own claim and completion statements
//! in both claim modes with fake acknowledgements (the raw SQL ceiling), and
//! `outbox_core::Relay` over the store with a publisher that acknowledges at once.
//!
//! Into the broker: the same records produced straight to the broker with the relay's safe
//! producer settings (the raw producer ceiling), the lean unordered relay (claim 1,000 with
//! `SKIP LOCKED`, produce all, await all, one `UPDATE`, commit; the reference, see
//! [`crate::lean`], with its one-factor variants), the old minimal unordered relay (the same
//! loop with librdkafka's default `linger.ms` and headers decoded from arrays), the relay over
//! the store into the broker for each claim mode with 1 and 2 relays, and a relay that awaits
//! each record before sending the next (on a fraction of the backlog: it is slow).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, Envelope, Outcome, PublishResult, Publisher, Relay,
    RelayConfig, SystemClock,
};
use outbox_kafka::KafkaPublisher;
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;
use sqlx::{PgPool, Row};

use crate::env::{self, Env};
use crate::lean::Lean;
use crate::report::{Report, Samples};
use crate::transports::{self, Transport};

/// Options of `outbox-bench drain`.
#[derive(Debug, Clone, Args)]
pub(crate) struct DrainArgs {
    /// Events in the backlog of each contender.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) events: usize,
    /// Aggregates the backlog is spread over (round robin); a list runs each.
    #[arg(long, value_delimiter = ',', default_value = "1000,20000")]
    pub(crate) aggregates: Vec<usize>,
    /// Claim batch size (relays and references).
    #[arg(long, default_value_t = 1000)]
    pub(crate) batch: usize,
    /// Partitions of each topic.
    #[arg(long, default_value_t = 6)]
    pub(crate) partitions: i32,
    /// The relay awaiting each record drains events / this (it is slow).
    #[arg(long, default_value_t = 50)]
    await_each_fraction: usize,
    /// Only these contenders (comma-separated ids; default all): naive-sql, sql-lease,
    /// sql-locked, instant-lease, instant-locked, producer, lean, lean-linger5, lean-arrays,
    /// lean-pk-only, lean-no-headers, lean-cold, minimal, lease-1, lease-2, locked-1, locked-2,
    /// lease-1-linger5, await-each. On a mysql:// URL: naive-instant,
    /// lease-instant, locked-instant, naive-kafka, lease-kafka, locked-kafka, sql-lease,
    /// sql-locked.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// The relays' run length (`RelayConfig::run`; default: the relay's default).
    #[arg(long)]
    pub(crate) run: Option<usize>,
    /// Skip the contenders that need the broker (store-only figures).
    #[arg(long)]
    pub(crate) no_broker: bool,
    /// Brokers of the broker contenders (comma-separated): kafka, nats, rabbitmq, or all.
    /// Kafka runs every broker contender above; NATS and RabbitMQ run minimal, lease-1,
    /// lease-2, locked-1, locked-2 (ids prefixed `nats-` / `rabbitmq-`), each beside a minimal
    /// relay written for that transport.
    #[arg(long = "transport", value_delimiter = ',', default_value = "kafka")]
    pub(crate) transports: Vec<String>,
    /// NATS server with JetStream (for `--transport nats`); the bench creates and deletes its
    /// own streams.
    #[arg(long, env = "NATS_URL")]
    pub(crate) nats_url: Option<String>,
    /// RabbitMQ broker (for `--transport rabbitmq`); the bench declares and deletes its own
    /// durable exchange and quorum queue.
    #[arg(long, env = "AMQP_URL")]
    pub(crate) amqp_url: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Contender {
    NaiveSql,
    Sql(Mode),
    Instant(Mode),
    Producer,
    /// The lean unordered relay (the broker group's reference) or one of its variants.
    Lean(Lean),
    /// The old minimal unordered relay (the reference before issue 25).
    Minimal,
    Relay(Mode, usize),
    /// One lease relay with the producer's `linger.ms` at 5 (librdkafka's default, the
    /// publisher's before it set 0: what the lower latency costs in throughput).
    RelayLinger5,
    AwaitEach,
    /// The minimal relay written for NATS or RabbitMQ.
    OtherMinimal(Transport),
    /// The relay over the store into NATS or RabbitMQ: mode, relays.
    OtherRelay(Transport, Mode, usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Lease,
    Locked,
}

impl Mode {
    pub(crate) fn claim_mode(self) -> ClaimMode {
        match self {
            Mode::Lease => ClaimMode::Lease {
                duration: Duration::from_secs(60),
            },
            Mode::Locked => ClaimMode::LockedTransaction,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Mode::Lease => "lease",
            Mode::Locked => "locked",
        }
    }
}

impl Contender {
    const KAFKA_AND_STORE: [Contender; 19] = [
        Contender::NaiveSql,
        Contender::Sql(Mode::Lease),
        Contender::Sql(Mode::Locked),
        Contender::Instant(Mode::Lease),
        Contender::Instant(Mode::Locked),
        Contender::Producer,
        Contender::Lean(Lean::Reference),
        Contender::Lean(Lean::Linger5),
        Contender::Lean(Lean::HeaderArrays),
        Contender::Lean(Lean::PkOnly),
        Contender::Lean(Lean::NoHeaders),
        Contender::Lean(Lean::Cold),
        Contender::Minimal,
        Contender::Relay(Mode::Lease, 1),
        Contender::Relay(Mode::Lease, 2),
        Contender::Relay(Mode::Locked, 1),
        Contender::Relay(Mode::Locked, 2),
        Contender::RelayLinger5,
        Contender::AwaitEach,
    ];

    /// Every contender of the selected transports (the store's own always).
    fn all(transports: &[Transport]) -> Vec<Contender> {
        let mut all: Vec<Contender> = Contender::KAFKA_AND_STORE
            .into_iter()
            .filter(|c| !c.needs_broker() || transports.contains(&Transport::Kafka))
            .collect();
        for &t in transports.iter().filter(|t| **t != Transport::Kafka) {
            all.push(Contender::OtherMinimal(t));
            for (m, n) in [
                (Mode::Lease, 1),
                (Mode::Lease, 2),
                (Mode::Locked, 1),
                (Mode::Locked, 2),
            ] {
                all.push(Contender::OtherRelay(t, m, n));
            }
        }
        all
    }

    fn transport(self) -> Option<Transport> {
        match self {
            Contender::OtherMinimal(t) | Contender::OtherRelay(t, ..) => Some(t),
            c if c.needs_broker() => Some(Transport::Kafka),
            _ => None,
        }
    }

    fn id(self) -> String {
        match self {
            Contender::NaiveSql => "naive-sql".into(),
            Contender::Sql(m) => format!("sql-{}", m.name()),
            Contender::Instant(m) => format!("instant-{}", m.name()),
            Contender::Producer => "producer".into(),
            Contender::Lean(l) => l.id().into(),
            Contender::Minimal => "minimal".into(),
            Contender::Relay(m, n) => format!("{}-{n}", m.name()),
            Contender::RelayLinger5 => "lease-1-linger5".into(),
            Contender::AwaitEach => "await-each".into(),
            Contender::OtherMinimal(t) => format!("{}-minimal", t.name()),
            Contender::OtherRelay(t, m, n) => format!("{}-{}-{n}", t.name(), m.name()),
        }
    }

    fn label(self) -> String {
        match self {
            Contender::NaiveSql => "store: naive SKIP LOCKED + UPDATE".into(),
            Contender::Sql(m) => format!("store: claim+complete {} (SQL ceiling)", m.name()),
            Contender::Instant(m) => format!("store: relay {}, instant publisher", m.name()),
            Contender::Producer => "broker: raw producer ceiling".into(),
            Contender::Lean(l) => l.label().into(),
            Contender::Minimal => "broker: minimal unordered relay (old reference)".into(),
            Contender::Relay(m, n) => format!("broker: relay {} x{n}", m.name()),
            Contender::RelayLinger5 => "broker: relay lease x1, linger.ms=5".into(),
            Contender::AwaitEach => "broker: relay awaiting each record".into(),
            Contender::OtherMinimal(t) => format!("{}: minimal unordered relay", t.name()),
            Contender::OtherRelay(t, m, n) => format!("{}: relay {} x{n}", t.name(), m.name()),
        }
    }

    fn needs_broker(self) -> bool {
        matches!(
            self,
            Contender::Producer
                | Contender::Lean(_)
                | Contender::Minimal
                | Contender::Relay(..)
                | Contender::RelayLinger5
                | Contender::AwaitEach
                | Contender::OtherMinimal(_)
                | Contender::OtherRelay(..)
        )
    }
}

/// The contenders `args` select and the transports they use, each transport's server checked
/// (`brokers`: the Kafka bootstrap servers): called before connecting to anything.
pub(crate) fn select(
    args: &DrainArgs,
    brokers: Option<&str>,
) -> anyhow::Result<(Vec<Contender>, Vec<Transport>)> {
    let transports = transports::selected(&args.transports)?;
    let contenders: Vec<Contender> = Contender::all(&transports)
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| *o == c.id()))
        .filter(|c| !(args.no_broker && c.needs_broker()))
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut used: Vec<Transport> = contenders.iter().filter_map(|c| c.transport()).collect();
    used.sort();
    used.dedup();
    transports::check_servers(
        &used,
        brokers,
        args.nats_url.as_deref(),
        args.amqp_url.as_deref(),
    )?;
    Ok((contenders, used))
}

/// Runs the drain scenario.
pub(crate) async fn run(env: &Env, args: &DrainArgs, rounds: usize) -> anyhow::Result<Report> {
    let (contenders, used) = select(args, env.brokers().ok())?;
    let mut report = Report::new("drain", rounds);
    report.param("events", args.events);
    report.param("aggregates", &args.aggregates);
    report.param("batch", args.batch);
    report.param("partitions", args.partitions);
    report.param(
        "run",
        args.run
            .map_or_else(|| "relay default".to_owned(), |r| r.to_string()),
    );
    report.param(
        "transports",
        used.iter().map(|t| t.name()).collect::<Vec<_>>(),
    );
    report.param("payload_bytes", serde_json::to_vec(&env::payload(0))?.len());
    report.param(
        "contenders",
        contenders.iter().map(|c| c.id()).collect::<Vec<_>>(),
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        for &aggregates in &args.aggregates {
            // Rotate the order each round, so a slow phase of the machine is shared.
            let n = contenders.len();
            for k in 0..n {
                let c = contenders[(k + round) % n];
                let name = format!("{} [{aggregates} aggs]", c.label());
                let (events, took) = run_one(env, args, c, aggregates)
                    .await
                    .with_context(|| format!("round {}: {name}", round + 1))?;
                env.cleanup().await?;
                let rate = events as f64 / took.as_secs_f64();
                println!(
                    "round {}/{rounds}  {name:<60} {events:>8} events in {:>7.2} s = {rate:>8.0} events/s",
                    round + 1,
                    took.as_secs_f64()
                );
                samples.add(&name, "events/s", rate);
            }
        }
    }
    // The broker group's reference: the lean relay, or the old minimal one when the lean
    // relay was not selected.
    let kafka_reference = [Contender::Lean(Lean::Reference), Contender::Minimal]
        .into_iter()
        .find(|r| contenders.contains(r));
    for &aggregates in &args.aggregates {
        let name = |c: Contender| format!("{} [{aggregates} aggs]", c.label());
        for c in &contenders {
            let reference = match c {
                Contender::Sql(_) | Contender::Instant(_) => Some(Contender::NaiveSql),
                Contender::Producer
                | Contender::Lean(_)
                | Contender::Minimal
                | Contender::Relay(..)
                | Contender::RelayLinger5
                | Contender::AwaitEach => kafka_reference.filter(|r| r != c),
                Contender::OtherRelay(t, ..) => Some(Contender::OtherMinimal(*t)),
                Contender::NaiveSql | Contender::OtherMinimal(_) => None,
            };
            if let Some(r) = reference.filter(|r| contenders.contains(r)) {
                samples.compare(&name(*c), "events/s", &name(r));
            }
        }
        let m = |c: Contender| samples.median(&name(c), "events/s");
        let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
        let default = Mode::Lease;
        report.target(
            &format!(
                "[{aggregates} aggs] relay over the store, instant publisher, default mode (lease): events/s >= 50,000"
            ),
            m(Contender::Instant(default)),
            50_000.0,
            true,
        );
        // Held against the lean reference, and against the old minimal relay so the change
        // of reference stays visible.
        for (r, what) in [
            (Contender::Lean(Lean::Reference), "lean relay"),
            (Contender::Minimal, "old minimal relay"),
        ] {
            report.target(
                &format!("[{aggregates} aggs] 1 relay (lease) / {what} >= 0.85"),
                ratio(m(Contender::Relay(default, 1)), m(r)),
                0.85,
                true,
            );
            report.target(
                &format!("[{aggregates} aggs] 2 relays (lease) / {what} >= 1.3"),
                ratio(m(Contender::Relay(default, 2)), m(r)),
                1.3,
                true,
            );
        }
        report.target(
            &format!("[{aggregates} aggs] 1 relay (lease) / relay awaiting each record >= 100"),
            ratio(m(Contender::Relay(default, 1)), m(Contender::AwaitEach)),
            100.0,
            true,
        );
        for &t in used.iter().filter(|t| **t != Transport::Kafka) {
            report.target(
                &format!(
                    "[{aggregates} aggs] {}: 1 relay (lease) / minimal {} relay >= 0.85",
                    t.name(),
                    t.name()
                ),
                ratio(
                    m(Contender::OtherRelay(t, default, 1)),
                    m(Contender::OtherMinimal(t)),
                ),
                0.85,
                true,
            );
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

async fn run_one(
    env: &Env,
    args: &DrainArgs,
    c: Contender,
    aggregates: usize,
) -> anyhow::Result<(u64, Duration)> {
    match c {
        Contender::OtherMinimal(t) => transports::run_one(env, args, t, None, aggregates).await,
        Contender::OtherRelay(t, mode, relays) => {
            transports::run_one(env, args, t, Some((mode, relays)), aggregates).await
        }
        Contender::NaiveSql => {
            let store = env
                .store("naive", ClaimMode::LockedTransaction, false)
                .await?;
            env::preload(&store, args.events, aggregates).await?;
            unblock_for_naive(&store).await?;
            let r = drain_naive_sql(&store, args.batch).await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        Contender::Sql(mode) => {
            let store = env.store("sql", mode.claim_mode(), false).await?;
            env::preload(&store, args.events, aggregates).await?;
            let r = drain_store(&store, args.batch).await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        Contender::Instant(mode) => {
            let store = env.store("instant", mode.claim_mode(), false).await?;
            env::preload(&store, args.events, aggregates).await?;
            let r = drain_relay_run(
                &store,
                Arc::new(InstantAcks::default()),
                args.batch,
                1,
                args.run,
            )
            .await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        Contender::Relay(..) | Contender::RelayLinger5 => {
            let (mode, relays) = match c {
                Contender::Relay(mode, relays) => (mode, relays),
                _ => (Mode::Lease, 1),
            };
            let store = env.store("relay", mode.claim_mode(), false).await?;
            env::preload(&store, args.events, aggregates).await?;
            let topic = env.topic("relay", args.partitions).await?;
            let mut builder = KafkaPublisher::builder(env.brokers()?, &topic);
            if c == Contender::RelayLinger5 {
                builder = builder.set("linger.ms", "5");
            }
            let publisher = Arc::new(
                builder
                    .start()
                    .await
                    .map_err(|e| anyhow::anyhow!("publisher: {e}"))?,
            );
            // Warmed up before the clock starts, as the lean reference's producer is: a
            // producer's first send otherwise waits for its connection and producer id, once
            // per drain. One record of an aggregate of its own, never read.
            let warm = Envelope::builder("warm-up", "warm-up", 1, "warm-up")
                .json(&env::payload(0))
                .and_then(|b| b.build())
                .map_err(|e| anyhow::anyhow!("warm-up record: {e}"))?;
            for r in publisher.publish(&[&warm]).await {
                r.map_err(|e| anyhow::anyhow!("warm-up send: {e}"))?;
            }
            let r = drain_relay_run(&store, publisher, args.batch, relays, args.run).await?;
            check_drained(&store, args.events, r.0).await?;
            Ok(r)
        }
        Contender::Producer => {
            let records = references(args.events, aggregates);
            let topic = env.topic("producer", args.partitions).await?;
            produce_all(env.brokers()?, &topic, &records, args.batch).await
        }
        Contender::Lean(lean) => {
            let records = references(args.events, aggregates);
            crate::lean::run_one(env, lean, &records, args.batch, args.partitions).await
        }
        Contender::Minimal | Contender::AwaitEach => {
            let events = if c == Contender::AwaitEach {
                (args.events / args.await_each_fraction.max(1)).max(1)
            } else {
                args.events
            };
            let schema = env.schema("minimal").await?;
            let table = format!("\"{schema}\".minimal");
            fill_minimal(&env.pool, &table, &references(events, aggregates)).await?;
            let topic = env.topic("minimal", args.partitions).await?;
            let producer = reference_producer(env.brokers()?)?;
            let r = drain_minimal(
                &env.pool,
                &table,
                &producer,
                &topic,
                args.batch,
                c == Contender::AwaitEach,
            )
            .await?;
            anyhow::ensure!(r.0 == events as u64, "drained {} of {events}", r.0);
            Ok(r)
        }
    }
}

pub(crate) async fn check_drained(
    store: &PostgresOutboxStore,
    events: usize,
    drained: u64,
) -> anyhow::Result<()> {
    let left = env::unpublished(store).await?;
    anyhow::ensure!(
        drained == events as u64 && left == 0,
        "drained {drained} of {events}, {left} left unpublished"
    );
    Ok(())
}

/// A record as the references send it: the envelope's key, payload and headers.
pub(crate) struct RefRecord {
    pub(crate) key: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
}

pub(crate) fn references(events: usize, aggregates: usize) -> Vec<RefRecord> {
    (0..events)
        .map(|i| {
            let e = env::event(i, aggregates);
            RefRecord {
                headers: outbox_core::wire::encode_headers(&e),
                key: e.aggregate_id,
                payload: e.payload.bytes,
            }
        })
        .collect()
}

fn owned_headers(h: &[(String, Vec<u8>)]) -> OwnedHeaders {
    let mut out = OwnedHeaders::new_with_capacity(h.len());
    for (k, v) in h {
        out = out.insert(Header {
            key: k.as_str(),
            value: Some(v.as_slice()),
        });
    }
    out
}

/// A producer with the relay's forced safe settings and librdkafka's defaults otherwise
/// (`linger.ms` 5, where the relay's publisher sets 0): the raw producer ceiling's and the old
/// minimal relay's.
pub(crate) fn reference_producer(brokers: &str) -> anyhow::Result<FutureProducer> {
    Ok(reference_config(brokers).create()?)
}

/// The relay's forced safe producer settings (the lean relay adds the publisher's
/// `linger.ms`).
pub(crate) fn reference_config(brokers: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set("partitioner", outbox_kafka::DEFAULT_PARTITIONER.as_str());
    cc
}

/// The raw producer ceiling: every record sent, `window` at a time awaited.
async fn produce_all(
    brokers: &str,
    topic: &str,
    records: &[RefRecord],
    window: usize,
) -> anyhow::Result<(u64, Duration)> {
    let producer = reference_producer(brokers)?;
    let started = Instant::now();
    for chunk in records.chunks(window.max(1)) {
        let mut pending = Vec::with_capacity(chunk.len());
        for r in chunk {
            let rec = FutureRecord::to(topic)
                .key(&r.key)
                .payload(&r.payload)
                .headers(owned_headers(&r.headers));
            pending.push(producer.send_result(rec).map_err(|(e, _)| e)?);
        }
        for p in pending {
            p.await?.map_err(|(e, _)| e)?;
        }
    }
    let took = started.elapsed();
    producer.flush(Duration::from_secs(10))?;
    Ok((records.len() as u64, took))
}

pub(crate) async fn fill_minimal(
    pool: &PgPool,
    table: &str,
    records: &[RefRecord],
) -> anyhow::Result<()> {
    sqlx::raw_sql(&format!(
        "CREATE TABLE {table} (id bigserial PRIMARY KEY, key text NOT NULL, payload bytea NOT NULL, \
         header_keys text[] NOT NULL, header_values bytea[] NOT NULL, published_at timestamptz); \
         CREATE INDEX ON {table} (id) WHERE published_at IS NULL;"
    ))
    .execute(pool)
    .await?;
    for chunk in records.chunks(5_000) {
        // Header arrays of equal length per row: encode as one text/bytea array per row via
        // JSON would cost more; insert row by row in one statement instead.
        let keys: Vec<&str> = chunk.iter().map(|r| r.key.as_str()).collect();
        let payloads: Vec<&[u8]> = chunk.iter().map(|r| r.payload.as_slice()).collect();
        let hk: Vec<String> = chunk
            .iter()
            .map(|r| serde_json::to_string(&r.headers.iter().map(|h| &h.0).collect::<Vec<_>>()))
            .collect::<Result<_, _>>()?;
        let hv: Vec<String> = chunk
            .iter()
            .map(|r| {
                serde_json::to_string(
                    &r.headers
                        .iter()
                        .map(|h| String::from_utf8_lossy(&h.1).into_owned())
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Result<_, _>>()?;
        sqlx::query(&format!(
            "INSERT INTO {table} (key, payload, header_keys, header_values) \
             SELECT k, p, ARRAY(SELECT jsonb_array_elements_text(hk::jsonb)), \
                    ARRAY(SELECT convert_to(jsonb_array_elements_text(hv::jsonb), 'UTF8')) \
             FROM UNNEST($1::text[], $2::bytea[], $3::text[], $4::text[]) AS u(k, p, hk, hv)"
        ))
        .bind(&keys)
        .bind(&payloads)
        .bind(&hk)
        .bind(&hv)
        .execute(pool)
        .await?;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
        .execute(pool)
        .await?;
    Ok(())
}

/// The minimal relay: claim `batch` with `SKIP LOCKED`, produce all (or each awaited before the
/// next), one `UPDATE`, commit.
async fn drain_minimal(
    pool: &PgPool,
    table: &str,
    producer: &FutureProducer,
    topic: &str,
    batch: usize,
    await_each: bool,
) -> anyhow::Result<(u64, Duration)> {
    let claim = format!(
        "SELECT id, key, payload, header_keys, header_values FROM {table} \
         WHERE published_at IS NULL ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let mark = format!("UPDATE {table} SET published_at = now() WHERE id = ANY($1)");
    let started = Instant::now();
    let mut total = 0u64;
    loop {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&claim)
            .bind(batch as i64)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut pending = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.get::<i64, _>("id"));
            let rec = crate::lean::record(row, topic, crate::lean::Headers::Arrays)?;
            let delivery = producer.send_result(rec).map_err(|(e, _)| e)?;
            if await_each {
                delivery.await?.map_err(|(e, _)| e)?;
            } else {
                pending.push(delivery);
            }
        }
        for p in pending {
            p.await?.map_err(|(e, _)| e)?;
        }
        sqlx::query(&mark).bind(&ids).execute(&mut *tx).await?;
        tx.commit().await?;
        total += rows.len() as u64;
    }
    Ok((total, started.elapsed()))
}

/// A publisher that acknowledges every record at once (offsets count up): what remains of a
/// relay cycle is the store's work and the relay's own.
#[derive(Default)]
pub(crate) struct InstantAcks(AtomicU64);

#[outbox_core::async_trait]
impl Publisher for InstantAcks {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        batch
            .iter()
            .map(|_| {
                let offset = self.0.fetch_add(1, Ordering::Relaxed) as i64;
                Ok(AckMetadata::kafka("bench", (offset % 12) as i32, offset))
            })
            .collect()
    }
    fn delivery_timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
}

/// `relays` relays (`Relay::run_once` with the default prefetch) over one store until the
/// backlog is empty. The clock stops when the last event is completed.
pub(crate) async fn drain_relay<S, P>(
    store: &S,
    publisher: Arc<P>,
    batch: usize,
    relays: usize,
) -> anyhow::Result<(u64, Duration)>
where
    S: RelayStore + MaintenanceStore + Clone + 'static,
    P: Publisher + 'static,
{
    drain_relay_run(store, publisher, batch, relays, None).await
}

/// [`drain_relay`] with runs of `run` (`None`: the relay's default).
pub(crate) async fn drain_relay_run<S, P>(
    store: &S,
    publisher: Arc<P>,
    batch: usize,
    relays: usize,
    run: Option<usize>,
) -> anyhow::Result<(u64, Duration)>
where
    S: RelayStore + MaintenanceStore + Clone + 'static,
    P: Publisher + 'static,
{
    let target = store.stats().await?.unpublished;
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for r in 0..relays {
        let mut config = RelayConfig::builder()
            .owner(format!("bench-{r}"))
            .batch_size(batch);
        if let Some(run) = run {
            config = config.run(run);
        }
        let config = config.build()?;
        let mut relay = Relay::new(
            store.clone(),
            publisher.clone(),
            config,
            Arc::new(SystemClock),
            Box::new(StdRng::seed_from_u64(r as u64)),
        )?;
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let mut finished_at = None;
            // Until every event is done (another relay may hold the last heads).
            while done.load(Ordering::Acquire) < target {
                let report = relay.run_once().await?;
                ensure_clean_cycle(&report)?;
                if report.claimed == 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                if done.fetch_add(report.published as u64, Ordering::AcqRel)
                    + report.published as u64
                    >= target
                {
                    finished_at = Some(Instant::now());
                }
            }
            relay.release_prefetched().await?;
            Ok::<_, anyhow::Error>(finished_at)
        }));
    }
    let mut end = None;
    for t in tasks {
        if let Some(at) = t.await?? {
            end = Some(at);
        }
    }
    let end = end.unwrap_or_else(Instant::now);
    Ok((done.load(Ordering::Acquire), end - started))
}

/// The store's own claim and completion statements with fake acknowledgements: the SQL
/// ceiling of a relay over this store.
pub(crate) async fn drain_store<S: RelayStore>(
    store: &S,
    batch: usize,
) -> anyhow::Result<(u64, Duration)> {
    let req = ClaimRequest::new("bench-sql", batch);
    let started = Instant::now();
    let mut total = 0u64;
    let mut offset = 0i64;
    loop {
        let claimed = store.claim(&req).await?;
        if claimed.is_empty() {
            break;
        }
        let outcomes: Vec<Outcome> = claimed
            .records
            .iter()
            .map(|rec| {
                offset += 1;
                Outcome::Published {
                    event_id: rec.envelope.event_id,
                    ack: AckMetadata::kafka("bench", (offset % 12) as i32, offset),
                }
            })
            .collect();
        let r = store.complete(&claimed.handle, &outcomes).await?;
        anyhow::ensure!(r.superseded == 0, "superseded completion");
        total += r.applied as u64;
    }
    Ok((total, started.elapsed()))
}

/// The naive drain keeps no order, so every pending row is its candidate: rows the append
/// wrote blocked (a preload batch holding several versions of one aggregate, i.e. fewer than
/// 5,000 aggregates; docs/design/hot-aggregate.md) are unblocked before the clock starts, and
/// the table vacuumed again so that the drain reads no dead row versions. With the figures'
/// 20,000 aggregates no row is blocked and this changes nothing.
pub(crate) async fn unblock_for_naive(store: &PostgresOutboxStore) -> anyhow::Result<()> {
    let s = store.settings();
    let t = format!("\"{}\".\"{}\"", s.schema, s.table);
    let n = sqlx::query(&format!("UPDATE {t} SET blocked = false WHERE blocked"))
        .execute(store.pool())
        .await?
        .rows_affected();
    if n > 0 {
        sqlx::raw_sql(&format!("VACUUM ANALYZE {t}"))
            .execute(store.pool())
            .await?;
    }
    Ok(())
}

/// The naive baseline on the outbox table: `SKIP LOCKED` claim and one `UPDATE` with ack
/// metadata, no ordering.
pub(crate) async fn drain_naive_sql(
    store: &PostgresOutboxStore,
    batch: usize,
) -> anyhow::Result<(u64, Duration)> {
    let s = store.settings();
    let t = format!("\"{}\".\"{}\"", s.schema, s.table);
    let select = format!(
        "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                schema_version, content_type, payload, headers, created_at \
         FROM {t} WHERE status = 'pending' AND NOT blocked \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let update = format!(
        "UPDATE {t} x SET status = 'published', published_at = clock_timestamp(), \
                finished_at = clock_timestamp(), ack_transport = 'kafka', ack_destination = 'bench', ack_partition = u.p, \
                ack_position = u.o \
         FROM UNNEST($1::int8[], $2::int4[], $3::int8[]) AS u(id, p, o) WHERE x.id = u.id"
    );
    let pool = store.pool();
    let started = Instant::now();
    let (mut total, mut offset) = (0u64, 0i64);
    loop {
        let mut tx = pool.begin().await?;
        let rows = sqlx::query(&select)
            .bind(batch as i64)
            .fetch_all(&mut *tx)
            .await?;
        if rows.is_empty() {
            break;
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut parts = Vec::with_capacity(rows.len());
        let mut offs = Vec::with_capacity(rows.len());
        for row in &rows {
            // Decode what a relay would publish.
            let _payload: &[u8] = row.get("payload");
            let _headers: serde_json::Value = row.get("headers");
            offset += 1;
            ids.push(row.get::<i64, _>("id"));
            parts.push((offset % 12) as i32);
            offs.push(offset);
        }
        sqlx::query(&update)
            .bind(&ids)
            .bind(&parts)
            .bind(&offs)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        total += ids.len() as u64;
    }
    Ok((total, started.elapsed()))
}

/// A drain cycle must publish what it claimed: no retries, parks, superseded or released claims
/// (the benchmark's events are all publishable, so any of these is a failed run).
pub(crate) fn ensure_clean_cycle(report: &outbox_core::CycleReport) -> anyhow::Result<()> {
    anyhow::ensure!(
        report.retried == 0 && report.parked == 0 && report.superseded == 0 && !report.released,
        "publish failures, released or superseded claims: {report:?}"
    );
    Ok(())
}
