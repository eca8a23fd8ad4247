//! MySQL 8 / MariaDB (`outbox-mysql`): `drain` and `append` on a `mysql://` URL, each beside a
//! hand-written reference on the same server in the same run.
//!
//! * **Drain.** The reference is a naive drain of the same outbox table: claim `batch` rows with
//!   `SELECT .. FOR UPDATE SKIP LOCKED` in id order, hand every record to the same publisher
//!   the relay uses (an instantly acknowledging one, and the Kafka publisher when a broker is
//!   given), wait for the acknowledgements, mark the rows published with their ack metadata in
//!   one `UPDATE` (joined with the acknowledgements as `JSON_TABLE`), commit. Same records, no
//!   per-aggregate order, no fencing. Beside it: the relay (`outbox_core::Relay`, one relay,
//!   default prefetch) over the store in each claim mode with that same publisher, and the
//!   store's own claim and completion statements with fake acknowledgements (the SQL ceiling).
//! * **Append.** The business transaction (update one random order row, read its version,
//!   insert one order line, commit) with no outbox row (context), with a bare `INSERT` of the
//!   same outbox row into the same table (the reference), and with the store's `append_many`;
//!   1 and 10 events.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::NaiveDateTime;
use outbox_core::{ClaimMode, Envelope, EnvelopeLimits, EventId, Payload, Publisher};
use outbox_kafka::KafkaPublisher;
use outbox_mysql::MySqlOutboxStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::Row;

use crate::append::AppendArgs;
use crate::drain::{self, DrainArgs, InstantAcks};
use crate::env;
use crate::report::{quantile_ms, Report, Samples};

/// `true` when `url` names a MySQL or MariaDB server.
pub(crate) fn is_mysql_url(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// The connections of one benchmark run on MySQL / MariaDB.
pub(crate) struct MyEnv {
    pool: MySqlPool,
    url: String,
    brokers: Option<String>,
    /// Short random id: every database and topic of this run carries it.
    pub(crate) run: String,
    databases: Mutex<Vec<String>>,
    topics: Mutex<Vec<String>>,
}

impl MyEnv {
    pub(crate) async fn connect(url: &str, brokers: Option<String>) -> anyhow::Result<Self> {
        // sqlx knows the scheme mysql:// only.
        let url = url.replacen("mariadb://", "mysql://", 1);
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&url)
            .await
            .context("cannot connect to MySQL/MariaDB at the database URL")?;
        let version: String = sqlx::query_scalar("SELECT VERSION()")
            .fetch_one(&pool)
            .await?;
        println!("server: {version}");
        Ok(Self {
            pool,
            url,
            brokers,
            run: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
            databases: Mutex::default(),
            topics: Mutex::default(),
        })
    }

    fn brokers(&self) -> anyhow::Result<&str> {
        self.brokers.as_deref().context(
            "no broker: set KAFKA_BROKERS or pass --brokers (scripts/services.sh: ensure_kafka)",
        )
    }

    /// A new, empty database `bench_<run>_<tag>_<n>`, dropped by [`MyEnv::cleanup`].
    async fn database(&self, tag: &str) -> anyhow::Result<String> {
        let name = {
            let mut d = self.databases.lock().expect("lock");
            let name = format!("bench_{}_{}_{}", self.run, tag, d.len());
            d.push(name.clone());
            name
        };
        sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
            .execute(&self.pool)
            .await?;
        Ok(name)
    }

    /// A migrated store in a new database, on `pool`.
    async fn store(
        &self,
        pool: &MySqlPool,
        tag: &str,
        mode: ClaimMode,
    ) -> anyhow::Result<MySqlOutboxStore> {
        let db = self.database(tag).await?;
        let store = MySqlOutboxStore::builder(pool.clone())
            .database(db)
            .claim_mode(mode)
            .build()?;
        store.migrate().await?;
        Ok(store)
    }

    async fn topic(&self, partitions: i32) -> anyhow::Result<String> {
        let name = {
            let mut t = self.topics.lock().expect("lock");
            let name = format!("bench-{}-mysql-{}", self.run, t.len());
            t.push(name.clone());
            name
        };
        let admin = env::admin(self.brokers()?)?;
        for r in admin
            .create_topics(
                [&NewTopic::new(
                    &name,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?
        {
            r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
        }
        Ok(name)
    }

    /// The server's URL (`mysql://`).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// A migrated store in a new database, on `pool` (for the other scenarios' modules).
    pub(crate) async fn store_on(
        &self,
        pool: &MySqlPool,
        tag: &str,
        mode: ClaimMode,
    ) -> anyhow::Result<MySqlOutboxStore> {
        self.store(pool, tag, mode).await
    }

    /// Forgets the newest database (cleanup will not drop it) and returns its name.
    pub(crate) fn forget_last_database(&self) -> String {
        self.databases
            .lock()
            .expect("lock")
            .pop()
            .unwrap_or_default()
    }

    /// Drops every database and deletes every topic this run created.
    pub(crate) async fn cleanup(&self) -> anyhow::Result<()> {
        let dbs: Vec<String> = std::mem::take(&mut *self.databases.lock().expect("lock"));
        for d in dbs {
            sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS `{d}`"))
                .execute(&self.pool)
                .await?;
        }
        let topics: Vec<String> = std::mem::take(&mut *self.topics.lock().expect("lock"));
        if !topics.is_empty() {
            let admin = env::admin(self.brokers()?)?;
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            for r in admin
                .delete_topics(
                    &names,
                    &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
                )
                .await?
            {
                if let Err((t, e)) = r {
                    eprintln!("warning: could not delete topic {t}: {e}");
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Drain

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pub {
    Instant,
    Kafka,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DrainContender {
    /// The hand-written `SKIP LOCKED` drain through the publisher (the reference).
    Naive(Pub),
    /// `Relay` over the store, one relay.
    Relay(ClaimKind, Pub),
    /// The store's claim + complete with fake acknowledgements.
    Sql(ClaimKind),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClaimKind {
    Lease,
    Locked,
}

impl ClaimKind {
    fn mode(self) -> ClaimMode {
        match self {
            ClaimKind::Lease => ClaimMode::Lease {
                duration: Duration::from_secs(60),
            },
            ClaimKind::Locked => ClaimMode::LockedTransaction,
        }
    }
    fn name(self) -> &'static str {
        match self {
            ClaimKind::Lease => "lease",
            ClaimKind::Locked => "locked",
        }
    }
}

impl Pub {
    fn name(self) -> &'static str {
        match self {
            Pub::Instant => "instant",
            Pub::Kafka => "kafka",
        }
    }
}

impl DrainContender {
    fn id(self) -> String {
        match self {
            DrainContender::Naive(p) => format!("naive-{}", p.name()),
            DrainContender::Relay(m, p) => format!("{}-{}", m.name(), p.name()),
            DrainContender::Sql(m) => format!("sql-{}", m.name()),
        }
    }
    fn label(self) -> String {
        match self {
            DrainContender::Naive(p) => {
                format!("mysql: naive SKIP LOCKED drain, {} publisher", p.name())
            }
            DrainContender::Relay(m, p) => {
                format!("mysql: relay {}, {} publisher", m.name(), p.name())
            }
            DrainContender::Sql(m) => format!("mysql: claim+complete {} (SQL ceiling)", m.name()),
        }
    }
    fn publisher(self) -> Option<Pub> {
        match self {
            DrainContender::Naive(p) | DrainContender::Relay(_, p) => Some(p),
            DrainContender::Sql(_) => None,
        }
    }
}

/// `outbox-bench drain` on MySQL / MariaDB.
pub(crate) async fn drain(env: &MyEnv, args: &DrainArgs, rounds: usize) -> anyhow::Result<Report> {
    let mut pubs = vec![Pub::Instant];
    if !args.no_broker && env.brokers.is_some() {
        pubs.push(Pub::Kafka);
    }
    let mut all = Vec::new();
    for &p in &pubs {
        all.push(DrainContender::Naive(p));
        all.push(DrainContender::Relay(ClaimKind::Lease, p));
        all.push(DrainContender::Relay(ClaimKind::Locked, p));
    }
    all.push(DrainContender::Sql(ClaimKind::Lease));
    all.push(DrainContender::Sql(ClaimKind::Locked));
    let contenders: Vec<DrainContender> = all
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| *o == c.id()))
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut report = Report::new("drain (mysql)", rounds);
    report.param("store", "outbox-mysql");
    report.param("events", args.events);
    report.param("aggregates", &args.aggregates);
    report.param("batch", args.batch);
    report.param("partitions", args.partitions);
    report.param("payload_bytes", serde_json::to_vec(&env::payload(0))?.len());
    report.param(
        "contenders",
        contenders.iter().map(|c| c.id()).collect::<Vec<_>>(),
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        for &aggregates in &args.aggregates {
            let n = contenders.len();
            for k in 0..n {
                let c = contenders[(k + round) % n];
                let name = format!("{} [{aggregates} aggs]", c.label());
                let (events, took) = drain_one(env, args, c, aggregates)
                    .await
                    .with_context(|| format!("round {}: {name}", round + 1))?;
                env.cleanup().await?;
                let rate = events as f64 / took.as_secs_f64();
                println!(
                    "round {}/{rounds}  {name:<62} {events:>8} events in {:>7.2} s = {rate:>8.0} events/s",
                    round + 1,
                    took.as_secs_f64()
                );
                samples.add(&name, "events/s", rate);
            }
        }
    }
    for &aggregates in &args.aggregates {
        let name = |c: DrainContender| format!("{} [{aggregates} aggs]", c.label());
        for c in &contenders {
            let reference = match c {
                DrainContender::Relay(_, p) => DrainContender::Naive(*p),
                DrainContender::Sql(_) => DrainContender::Naive(Pub::Instant),
                DrainContender::Naive(_) => continue,
            };
            if contenders.contains(&reference) {
                samples.compare(&name(*c), "events/s", &name(reference));
            }
        }
        for &p in &pubs {
            for m in [ClaimKind::Lease, ClaimKind::Locked] {
                let a = samples.median(&name(DrainContender::Relay(m, p)), "events/s");
                let b = samples.median(&name(DrainContender::Naive(p)), "events/s");
                report.target(
                    &format!(
                        "[{aggregates} aggs] relay ({}) / naive SKIP LOCKED drain, {} publisher >= 0.6",
                        m.name(),
                        p.name()
                    ),
                    a.zip(b).map(|(a, b)| a / b),
                    0.6,
                    true,
                );
            }
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

async fn drain_one(
    env: &MyEnv,
    args: &DrainArgs,
    c: DrainContender,
    aggregates: usize,
) -> anyhow::Result<(u64, Duration)> {
    let pool = MySqlPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&env.url)
        .await?;
    let mode = match c {
        DrainContender::Relay(m, _) | DrainContender::Sql(m) => m.mode(),
        DrainContender::Naive(_) => ClaimMode::LockedTransaction,
    };
    let store = env.store(&pool, "drain", mode).await?;
    preload(&store, args.events, aggregates).await?;
    let kafka = match c.publisher() {
        Some(Pub::Kafka) => {
            let topic = env.topic(args.partitions).await?;
            Some(Arc::new(
                KafkaPublisher::builder(env.brokers()?, &topic)
                    .start()
                    .await
                    .map_err(|e| anyhow::anyhow!("publisher: {e}"))?,
            ))
        }
        _ => None,
    };
    let r = match (c, kafka) {
        (DrainContender::Naive(_), Some(k)) => drain_naive(&store, &*k, args.batch).await?,
        (DrainContender::Naive(_), None) => {
            drain_naive(&store, &InstantAcks::default(), args.batch).await?
        }
        (DrainContender::Relay(..), Some(k)) => {
            drain::drain_relay(&store, k, args.batch, 1).await?
        }
        (DrainContender::Relay(..), None) => {
            drain::drain_relay(&store, Arc::new(InstantAcks::default()), args.batch, 1).await?
        }
        (DrainContender::Sql(_), _) => drain::drain_store(&store, args.batch).await?,
    };
    let left: i64 = sqlx::query_scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE status <> 'published'",
        store.table_name()
    ))
    .fetch_one(&pool)
    .await?;
    anyhow::ensure!(
        r.0 == args.events as u64 && left == 0,
        "drained {} of {}, {left} left unpublished",
        r.0,
        args.events
    );
    pool.close().await;
    Ok(r)
}

/// Appends `events` events over `aggregates` (batches of 500, one statement each), then
/// analyzes the table.
async fn preload(store: &MySqlOutboxStore, events: usize, aggregates: usize) -> anyhow::Result<()> {
    let mut i = 0;
    while i < events {
        let n = 500.min(events - i);
        let batch: Vec<Envelope> = (i..i + n).map(|k| env::event(k, aggregates)).collect();
        store.append_many(store.pool(), &batch).await?;
        i += n;
    }
    sqlx::raw_sql(&format!("ANALYZE TABLE {}", store.table_name()))
        .execute(store.pool())
        .await?;
    Ok(())
}

const NAIVE_COLS: &str = "id, event_id, aggregate_type, aggregate_id, aggregate_version, \
    event_type, schema_version, content_type, payload, headers, created_at";

/// A text column (utf8mb4_bin text reads back as bytes).
fn text(row: &MySqlRow, column: &str) -> anyhow::Result<String> {
    Ok(String::from_utf8(row.try_get::<Vec<u8>, _>(column)?)?)
}

/// What a relay publishes, read back from a row (the store's own decoding is private; this is
/// the same work).
fn envelope(row: &MySqlRow) -> anyhow::Result<Envelope> {
    let headers = text(row, "headers")?;
    let headers: std::collections::BTreeMap<String, String> = serde_json::from_str(&headers)?;
    let created: NaiveDateTime = row.try_get("created_at")?;
    let mut b = Envelope::builder(
        text(row, "aggregate_type")?,
        text(row, "aggregate_id")?,
        row.try_get::<i64, _>("aggregate_version")?,
        text(row, "event_type")?,
    )
    .event_id(EventId::from_uuid(row.try_get("event_id")?))
    .schema_version(row.try_get("schema_version")?)
    .payload(Payload::new(
        text(row, "content_type")?,
        row.try_get::<Vec<u8>, _>("payload")?,
    ))
    .created_at(created.and_utc())
    .limits(EnvelopeLimits::unlimited());
    for (k, v) in headers {
        b = b.header(k, v);
    }
    Ok(b.build()?)
}

/// The naive drain: claim `batch` with `SKIP LOCKED`, publish all through `publisher`, await
/// the acknowledgements, mark the batch published (ack metadata per row, one `UPDATE`),
/// commit. No order per aggregate, no fencing.
async fn drain_naive<P: Publisher + ?Sized>(
    store: &MySqlOutboxStore,
    publisher: &P,
    batch: usize,
) -> anyhow::Result<(u64, Duration)> {
    let t = store.table_name();
    let select = format!(
        "SELECT {NAIVE_COLS} FROM {t} WHERE status = 'pending' AND blocked = 0 \
         ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED"
    );
    let update = format!(
        "UPDATE {t} e JOIN JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$[0]', \
           topic TEXT PATH '$[1]', part INT PATH '$[2]', off BIGINT PATH '$[3]')) v \
           ON e.id = v.id \
         SET e.status = 'published', e.published_at = UTC_TIMESTAMP(6), \
             e.finished_at = UTC_TIMESTAMP(6), e.ack_transport = 'kafka', \
             e.ack_destination = v.topic, e.ack_partition = v.part, e.ack_position = v.off"
    );
    let pool = store.pool();
    let started = Instant::now();
    let mut total = 0u64;
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
        let mut events = Vec::with_capacity(rows.len());
        for row in &rows {
            ids.push(row.try_get::<i64, _>("id")?);
            events.push(envelope(row)?);
        }
        let refs: Vec<&Envelope> = events.iter().collect();
        let mut acks = Vec::with_capacity(rows.len());
        for r in publisher.publish(&refs).await {
            acks.push(r.map_err(|e| anyhow::anyhow!("publish: {e:?}"))?);
        }
        // One statement marks the batch: the acknowledgements as a JSON array joined as a
        // table (JSON_TABLE drives, the primary key finds each row; measured faster than a
        // CASE per column or a UNION ALL of rows).
        let marks: Vec<serde_json::Value> = ids
            .iter()
            .zip(&acks)
            .map(|(id, a)| {
                let (topic, partition, offset) = a
                    .as_kafka()
                    .expect("the bench publisher acknowledges as Kafka");
                serde_json::json!([id, topic, partition, offset])
            })
            .collect();
        let q = sqlx::query(&update).bind(serde_json::to_string(&marks)?);
        let n = q.execute(&mut *tx).await?.rows_affected();
        anyhow::ensure!(n == ids.len() as u64, "marked {n} of {}", ids.len());
        tx.commit().await?;
        total += ids.len() as u64;
    }
    Ok((total, started.elapsed()))
}

// ---------------------------------------------------------------------------------------------
// Append

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AppendContender {
    id: &'static str,
    label: &'static str,
    events: usize,
    how: How,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Nothing,
    BareInsert,
    Store,
}

const APPEND_CONTENDERS: [AppendContender; 5] = [
    AppendContender {
        id: "none",
        label: "mysql: no outbox row (context)",
        events: 0,
        how: How::Nothing,
    },
    AppendContender {
        id: "bare",
        label: "mysql: bare INSERT of the row (reference)",
        events: 1,
        how: How::BareInsert,
    },
    AppendContender {
        id: "append",
        label: "mysql: store append_many, 1 event",
        events: 1,
        how: How::Store,
    },
    AppendContender {
        id: "bare-10",
        label: "mysql: bare INSERT of 10 rows (reference)",
        events: 10,
        how: How::BareInsert,
    },
    AppendContender {
        id: "append-10",
        label: "mysql: store append_many, 10 events",
        events: 10,
        how: How::Store,
    },
];

struct AppendOutcome {
    txns: u64,
    seconds: f64,
    latencies: Vec<Duration>,
}

/// `outbox-bench append` on MySQL / MariaDB.
pub(crate) async fn append(
    env: &MyEnv,
    args: &AppendArgs,
    rounds: usize,
) -> anyhow::Result<Report> {
    let contenders: Vec<AppendContender> = APPEND_CONTENDERS
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| o == c.id))
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut report = Report::new("append (mysql)", rounds);
    report.param("store", "outbox-mysql");
    report.param("clients", &args.clients);
    report.param("seconds", args.seconds);
    report.param("warmup", args.warmup);
    report.param("orders", args.orders);
    report.param("payload_bytes", serde_json::to_vec(&env::payload(0))?.len());
    report.param(
        "transaction",
        "BEGIN; UPDATE orders (one row, random); SELECT its version; INSERT order_lines (one \
         row); [bare INSERT of the outbox row(s) | append_many]; COMMIT",
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        for &clients in &args.clients {
            let n = contenders.len();
            for k in 0..n {
                let c = contenders[(k + round) % n];
                let name = format!("{} [{clients} clients]", c.label);
                let o = append_one(env, args, c, clients)
                    .await
                    .with_context(|| format!("round {}: {name}", round + 1))?;
                env.cleanup().await?;
                let mut lat = o.latencies;
                lat.sort_unstable();
                let tps = o.txns as f64 / o.seconds;
                let (p50, p99) = (quantile_ms(&lat, 0.5), quantile_ms(&lat, 0.99));
                println!(
                    "round {}/{rounds}  {name:<54} {tps:>8.0} txn/s  p50 {p50:>6.2} ms  p99 {p99:>6.2} ms",
                    round + 1,
                );
                samples.add(&name, "txn/s", tps);
                samples.add(&name, "p50 ms", p50);
                samples.add(&name, "p99 ms", p99);
            }
        }
    }
    for &clients in &args.clients {
        let name = |id: &str| {
            APPEND_CONTENDERS
                .iter()
                .find(|c| c.id == id)
                .map(|c| format!("{} [{clients} clients]", c.label))
                .expect("known contender")
        };
        for (c, r) in [
            ("bare", "none"),
            ("append", "bare"),
            ("bare-10", "none"),
            ("append-10", "bare-10"),
        ] {
            if contenders.iter().any(|x| x.id == c) && contenders.iter().any(|x| x.id == r) {
                for metric in ["txn/s", "p50 ms", "p99 ms"] {
                    samples.compare(&name(c), metric, &name(r));
                }
            }
        }
        for (c, r) in [("append", "bare"), ("append-10", "bare-10")] {
            let m = |id: &str, metric: &str| samples.median(&name(id), metric);
            // Time per transaction: the inverse of transactions/s.
            report.target(
                &format!("[{clients} clients] {c}: time per txn / {r}'s <= 1.15"),
                m(r, "txn/s")
                    .zip(m(c, "txn/s"))
                    .map(|(ref_tps, tps)| ref_tps / tps),
                1.15,
                false,
            );
            report.target(
                &format!("[{clients} clients] {c}: p50 / {r}'s p50 <= 1.15"),
                m(c, "p50 ms").zip(m(r, "p50 ms")).map(|(a, b)| a / b),
                1.15,
                false,
            );
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

async fn append_one(
    env: &MyEnv,
    args: &AppendArgs,
    c: AppendContender,
    clients: usize,
) -> anyhow::Result<AppendOutcome> {
    let pool = MySqlPoolOptions::new()
        .max_connections(clients as u32 + 2)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&env.url)
        .await?;
    let store = env
        .store(
            &pool,
            "append",
            ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
        )
        .await?;
    let db = store
        .settings()
        .database
        .clone()
        .context("the bench store names its database")?;
    sqlx::raw_sql(&format!(
        "CREATE TABLE `{db}`.orders (id BIGINT PRIMARY KEY, total_cents BIGINT NOT NULL, \
             version BIGINT NOT NULL, updated_at DATETIME(6) NOT NULL) ENGINE = InnoDB; \
         CREATE TABLE `{db}`.order_lines (id BIGINT AUTO_INCREMENT PRIMARY KEY, \
             order_id BIGINT NOT NULL, sku VARCHAR(64) NOT NULL, qty INT NOT NULL, \
             price_cents BIGINT NOT NULL, created_at DATETIME(6) NOT NULL DEFAULT \
             CURRENT_TIMESTAMP(6), KEY (order_id)) ENGINE = InnoDB;"
    ))
    .execute(&pool)
    .await?;
    for from in (1..=args.orders).step_by(1_000) {
        let to = (from + 999).min(args.orders);
        let rows: Vec<String> = (from..=to)
            .map(|id| format!("({id}, 0, 0, UTC_TIMESTAMP(6))"))
            .collect();
        sqlx::raw_sql(&format!(
            "INSERT INTO `{db}`.orders VALUES {}",
            rows.join(", ")
        ))
        .execute(&pool)
        .await?;
    }
    sqlx::raw_sql(&format!("ANALYZE TABLE `{db}`.orders"))
        .execute(&pool)
        .await?;

    let update = format!(
        "UPDATE `{db}`.orders SET total_cents = total_cents + ?, version = version + 1, \
         updated_at = UTC_TIMESTAMP(6) WHERE id = ?"
    );
    let version = format!("SELECT version FROM `{db}`.orders WHERE id = ?");
    let line = format!(
        "INSERT INTO `{db}`.order_lines (order_id, sku, qty, price_cents) VALUES (?, ?, ?, ?)"
    );
    // The same row the store writes, the same columns, one statement.
    let bare = |n: usize| {
        format!(
            "INSERT INTO {} (event_id, aggregate_type, aggregate_id, aggregate_version, \
             event_type, schema_version, content_type, payload, headers, created_at, \
             inserted_at) VALUES {}",
            store.table_name(),
            vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))"; n].join(", ")
        )
    };
    let bare = bare(c.events.max(1));
    let measuring = Arc::new(AtomicBool::new(false));
    let running = Arc::new(AtomicBool::new(true));
    let txns = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (pool, store) = (pool.clone(), store.clone());
        let (update, version, line, bare) =
            (update.clone(), version.clone(), line.clone(), bare.clone());
        let (measuring, running, txns) = (measuring.clone(), running.clone(), txns.clone());
        let orders = args.orders;
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(client as u64);
            let mut latencies = Vec::new();
            let mut i = client;
            while running.load(Ordering::Relaxed) {
                let order = rng.random_range(1..=orders as i64);
                let started = Instant::now();
                let mut tx = pool.begin().await?;
                sqlx::query(&update)
                    .bind(199i64)
                    .bind(order)
                    .execute(&mut *tx)
                    .await?;
                let v: i64 = sqlx::query_scalar(&version)
                    .bind(order)
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query(&line)
                    .bind(order)
                    .bind("SKU-0042")
                    .bind(1i32)
                    .bind(199i64)
                    .execute(&mut *tx)
                    .await?;
                let events: Vec<Envelope> = (0..c.events)
                    .map(|k| {
                        Envelope::builder(
                            "order",
                            format!("order-{order}"),
                            (v - 1) * c.events as i64 + k as i64 + 1,
                            "order.line_added",
                        )
                        .json(&env::payload(i))
                        .and_then(|b| b.build())
                        .expect("valid envelope")
                    })
                    .collect();
                match c.how {
                    How::Nothing => {}
                    How::Store => store.append_many(&mut *tx, &events).await?,
                    How::BareInsert => {
                        let mut q = sqlx::query(&bare);
                        for e in &events {
                            q = q
                                .bind(e.event_id.as_uuid())
                                .bind(&e.aggregate_type)
                                .bind(&e.aggregate_id)
                                .bind(e.aggregate_version)
                                .bind(&e.event_type)
                                .bind(e.schema_version)
                                .bind(&e.payload.content_type)
                                .bind(&e.payload.bytes)
                                .bind(serde_json::to_string(&e.headers)?)
                                .bind(e.created_at.naive_utc());
                        }
                        q.execute(&mut *tx).await?;
                    }
                }
                tx.commit().await?;
                i += clients;
                if measuring.load(Ordering::Relaxed) {
                    latencies.push(started.elapsed());
                    txns.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok::<_, anyhow::Error>(latencies)
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(args.warmup)).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    let measured = txns.load(Ordering::Relaxed);
    running.store(false, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    pool.close().await;
    Ok(AppendOutcome {
        txns: measured,
        seconds,
        latencies,
    })
}
