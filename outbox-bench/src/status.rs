//! Status: what `outbox status` and the relay's metrics cost on a large table, and the claim's
//! cost beside them (issue 25: `stats()` took 1.2 s at 100k rows; the target is `status`
//! within 100 ms at 10M rows, and a claim at 10M rows within 1.3 x its cost at 10k).
//!
//! For each size a table is filled in SQL (one statement per million rows, the columns the
//! store writes): mostly published rows (their publications spread over the last 24 hours,
//! so a status window reads a realistic slice), `--pending-percent` pending (at least 2,000:
//! the claims below consume them), `--parked` parked heads (their aggregates' later versions
//! wait behind them: the blocked figures), over one aggregate per 100 rows, each with its
//! state row (last version = its highest published one). Then each round alternates, `--reads`
//! times: the store's `stats()` (the metrics' snapshot); the reads `outbox status` makes
//! through the reporting role with the default configuration (the backlog, the latency over
//! the 15-minute window, six trend points over the last minute, the relay registry); one
//! claim of 100 + completion (lease mode).
//!
//! The rounds, the reads and the report are [`measure`]'s for every backend; a backend
//! ([`StatusBackend`]: this module's PostgreSQL one, `mystatus`'s MariaDB one) gives the
//! store, the fill and what becomes of the store after its size.

use std::time::{Duration, Instant};

use clap::Args;
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest};
use outbox_postgres::PostgresOutboxStore;

use crate::env::Env;
use crate::report::{median, Report, Samples};
use crate::scale::published;

/// Options of `outbox-bench status`.
#[derive(Debug, Clone, Args)]
pub(crate) struct StatusArgs {
    /// Table sizes in rows (comma-separated; the issue asks for 10000,10000000, which takes a
    /// few minutes to fill here).
    #[arg(long, value_delimiter = ',', default_value = "10000,1000000")]
    pub(crate) sizes: Vec<usize>,
    /// Pending rows, percent of the size (at least 2,000 pending rows either way).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) pending_percent: f64,
    /// Parked rows (each its aggregate's head, with pending versions behind it).
    #[arg(long, default_value_t = 50)]
    pub(crate) parked: usize,
    /// Reads of each kind per round.
    #[arg(long, default_value_t = 5)]
    pub(crate) reads: usize,
    /// The status window (`status.window`, default 15 min), seconds.
    #[arg(long, default_value_t = 900)]
    pub(crate) window: u64,
    /// MariaDB only: keep each size's database (its name is printed) for `EXPLAIN`s.
    #[arg(long)]
    pub(crate) keep: bool,
}

/// The backend-specific steps of the status scenario: a store per size, its fill, and what
/// becomes of it afterwards. The rounds, their reads and the report's figures are
/// [`measure`]'s, the same on every backend.
pub(crate) trait StatusBackend {
    /// The backend's store.
    type Store: OutboxStore + ReportingStore + RelayRegistry;
    /// A new, migrated store (its own schema or database) in lease mode ([`lease`]).
    async fn store(&self) -> anyhow::Result<Self::Store>;
    /// Fills `store` with the rows of `shape` (see the module's doc).
    async fn fill(&self, store: &Self::Store, shape: &Shape) -> anyhow::Result<()>;
    /// Appended to the line that says how long the fill took (empty, or where the rows are).
    fn filled_note(&self, store: &Self::Store) -> String;
    /// Done with a size's store: drops it (or keeps it, where the backend can).
    async fn finish(&self) -> anyhow::Result<()>;
}

/// The rows of one size: `rows` in all, the last `pending` of them pending, `parked` parked
/// heads before those, over `aggregates` aggregates.
pub(crate) struct Shape {
    pub(crate) rows: usize,
    pub(crate) pending: usize,
    pub(crate) parked: usize,
    pub(crate) aggregates: usize,
}

impl Shape {
    /// The shape of `size` rows under `args`: `--pending-percent` pending (at least 2,000),
    /// `--parked` parked, one aggregate per 100 rows (more than the parked heads).
    fn of(args: &StatusArgs, size: usize) -> Self {
        Self {
            rows: size,
            pending: ((size as f64 * args.pending_percent / 100.0) as usize)
                .max(2000)
                .min(size),
            parked: args.parked,
            aggregates: (size / 100).max(args.parked + 1),
        }
    }
}

/// The claim mode of the scenario's stores: leases of 60 s.
pub(crate) fn lease() -> ClaimMode {
    ClaimMode::Lease {
        duration: Duration::from_secs(60),
    }
}

/// The scenario's report named `name`, with its parameters; refuses sizes below 10,000 rows.
pub(crate) fn report(name: &str, args: &StatusArgs, rounds: usize) -> anyhow::Result<Report> {
    anyhow::ensure!(
        args.sizes.iter().all(|&s| s >= 10_000),
        "--sizes: each size needs at least 10,000 rows"
    );
    let mut report = Report::new(name, rounds);
    report.param("sizes", &args.sizes);
    report.param("pending_percent", args.pending_percent);
    report.param("parked", args.parked);
    report.param("reads_per_round", args.reads);
    report.param("window_seconds", args.window);
    report.param("claim_batch", 100);
    Ok(report)
}

/// The target on the status reads at the largest size, `last` rows: within 100 ms.
pub(crate) fn status_reads_target(report: &mut Report, samples: &Samples, last: usize) {
    report.target(
        &format!("status reads at {last} rows, ms (<= 100)"),
        samples.median(&format!("status reads [{last} rows]"), "ms"),
        100.0,
        false,
    );
}

/// Runs the status scenario.
pub(crate) async fn run(env: &Env, args: &StatusArgs, rounds: usize) -> anyhow::Result<Report> {
    let mut report = report("status", args, rounds)?;
    let samples = measure(&Postgres { env }, args, rounds).await?;
    if let (Some(&first), Some(&last)) = (args.sizes.first(), args.sizes.last()) {
        if last > first {
            status_reads_target(&mut report, &samples, last);
            let at = |s: usize| samples.median(&format!("claim 100 (lease) [{s} rows]"), "ms");
            report.target(
                &format!("claim cost at {last} / at {first} rows (<= 1.3)"),
                at(last).zip(at(first)).map(|(a, b)| a / b),
                1.3,
                false,
            );
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

/// Each size of `args` on a new store of `backend`: filled, then `rounds` rounds of
/// `args.reads` reads of each kind (their medians are the samples), then the latency and the
/// stats the store reports at that size. With more than one size, the largest is compared
/// with the smallest.
pub(crate) async fn measure<B: StatusBackend>(
    backend: &B,
    args: &StatusArgs,
    rounds: usize,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    for &size in &args.sizes {
        let store = backend.store().await?;
        let shape = Shape::of(args, size);
        let filled = Instant::now();
        backend.fill(&store, &shape).await?;
        println!(
            "size {size}: {} pending, {} parked, {} aggregates; filled in {:.1} s{}",
            shape.pending,
            shape.parked,
            shape.aggregates,
            filled.elapsed().as_secs_f64(),
            backend.filled_note(&store)
        );
        let stats_name = format!("stats() [{size} rows]");
        let status_name = format!("status reads [{size} rows]");
        let claim_name = format!("claim 100 (lease) [{size} rows]");
        let complete_name = format!("complete 100 [{size} rows]");
        let window = Duration::from_secs(args.window);
        for round in 0..rounds {
            let (mut st, mut su, mut cl, mut co) = (vec![], vec![], vec![], vec![]);
            for _ in 0..args.reads {
                let t = Instant::now();
                let s = store.stats().await?;
                st.push(t.elapsed().as_secs_f64() * 1e3);
                anyhow::ensure!(s.unpublished > 0, "nothing pending");
                su.push(status_reads(&store, window).await?);
                let t = Instant::now();
                let b = store.claim(&ClaimRequest::new("status-bench", 100)).await?;
                cl.push(t.elapsed().as_secs_f64() * 1e3);
                anyhow::ensure!(!b.is_empty(), "nothing claimed");
                let t = Instant::now();
                store.complete(&b.handle, &published(&b)).await?;
                co.push(t.elapsed().as_secs_f64() * 1e3);
            }
            println!(
                "round {}/{rounds}  size {size:>9}: stats p50 {:.1} ms, status reads p50 {:.1} ms, \
                 claim p50 {:.2} ms, complete p50 {:.2} ms",
                round + 1,
                median(&st),
                median(&su),
                median(&cl),
                median(&co)
            );
            samples.add(&stats_name, "ms", median(&st));
            samples.add(&status_name, "ms", median(&su));
            samples.add(&claim_name, "ms", median(&cl));
            samples.add(&complete_name, "ms", median(&co));
        }
        let l = ReportingStore::publish_latency(&store, window).await?;
        println!(
            "size {size}: latency over {} s: published {}, p50 {:?} s, p99 {:?} s, sample {:?} \
             (None: exact); created {} (estimated: {})",
            window.as_secs(),
            l.count,
            l.p50,
            l.p99,
            l.sample,
            l.created,
            l.created_estimated
        );
        let s = store.stats().await?;
        println!(
            "size {size}: stats say unpublished {}, parked {}, blocked {}, published_retained {} \
             (estimated: {})",
            s.unpublished,
            s.parked,
            s.blocked,
            s.published_retained,
            s.extra
                .iter()
                .any(|(k, v)| k == "published_retained_estimated" && *v > 0.0)
        );
        backend.finish().await?;
    }
    if let (Some(&first), Some(&last)) = (args.sizes.first(), args.sizes.last()) {
        if last > first {
            for what in [
                "stats()",
                "status reads",
                "claim 100 (lease)",
                "complete 100",
            ] {
                samples.compare(
                    &format!("{what} [{last} rows]"),
                    "ms",
                    &format!("{what} [{first} rows]"),
                );
            }
        }
    }
    Ok(samples)
}

/// The store reads of one `outbox status` with the default configuration (`status.window`
/// 15 min, `status.trend_window` 1 min, `relay.stats_interval` 10 s): the backlog, the
/// latency over the window, the flow counts of the trend points (one call, as `status` makes
/// it), the relay registry. Milliseconds.
async fn status_reads<S>(store: &S, window: Duration) -> anyhow::Result<f64>
where
    S: ReportingStore + RelayRegistry,
{
    let t = Instant::now();
    let stats = ReportingStore::backlog(store).await?;
    let latency = ReportingStore::publish_latency(store, window).await?;
    let points: Vec<Duration> = (1..=6u64)
        .rev()
        .map(|back| Duration::from_secs(10 * back))
        .collect();
    ReportingStore::flows(store, &points).await?;
    RelayRegistry::relays(store).await?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(stats.unpublished > 0 && latency.count > 0, "empty status");
    Ok(ms)
}

/// The scenario on PostgreSQL: a store per size in its own schema, dropped after its size.
struct Postgres<'a> {
    env: &'a Env,
}

impl StatusBackend for Postgres<'_> {
    type Store = PostgresOutboxStore;

    async fn store(&self) -> anyhow::Result<PostgresOutboxStore> {
        self.env.store("status", lease(), false).await
    }

    async fn fill(&self, store: &PostgresOutboxStore, s: &Shape) -> anyhow::Result<()> {
        fill(store, s.rows, s.pending, s.parked, s.aggregates).await
    }

    fn filled_note(&self, _: &PostgresOutboxStore) -> String {
        String::new()
    }

    async fn finish(&self) -> anyhow::Result<()> {
        self.env.cleanup().await
    }
}

/// The columns a fill writes in the outbox table: the ones the store writes.
pub(crate) const FILL_COLUMNS: &str = "event_id, aggregate_type, aggregate_id, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at, \
    status, published_at, finished_at, ack_transport, ack_destination, ack_partition, \
    ack_position, parked_at, park_kind, attempts, inserted_at";

/// The ranges `[from, to)` of the fill's statements: a million rows each, over `rows` rows.
pub(crate) fn million_row_ranges(rows: usize) -> impl Iterator<Item = (i64, i64)> {
    (0..rows)
        .step_by(1_000_000)
        .map(move |from| (from as i64, (from + 1_000_000).min(rows) as i64))
}

/// `rows` rows: published (the oldest, their publications over the last 24 hours), then
/// `parked` parked heads, then pending (the last `pending` rows, appended one per millisecond
/// up to now), over `aggregates` aggregates, version = the row's round over them; the state
/// rows; `VACUUM ANALYZE`.
pub(crate) async fn fill(
    store: &PostgresOutboxStore,
    rows: usize,
    pending: usize,
    parked: usize,
    aggregates: usize,
) -> anyhow::Result<()> {
    let s = store.settings();
    let t = format!("\"{}\".\"{}\"", s.schema, s.table);
    let state = format!("\"{}\".\"{}_aggregate\"", s.schema, s.table);
    // Rows below `done` are published; [done, done + parked) parked; the rest pending.
    let done = (rows - pending) as i64;
    for (from, to) in million_row_ranges(rows) {
        sqlx::query(&format!(
            "INSERT INTO {t} ({FILL_COLUMNS}) \
             SELECT gen_random_uuid(), 'order', 'order-' || (g % $3), g / $3 + 1, \
               'order.changed', 1, 'application/json', convert_to(repeat('x', 200), 'UTF8'), \
               '{{}}'::jsonb, c, \
               CASE WHEN g < $4 THEN 'published' WHEN g < $4 + $5 THEN 'parked' \
                    ELSE 'pending' END, \
               CASE WHEN g < $4 THEN c + interval '40 ms' END, \
               CASE WHEN g < $4 THEN c + interval '40 ms' END, \
               CASE WHEN g < $4 THEN 'kafka' END, CASE WHEN g < $4 THEN 'orders' END, \
               CASE WHEN g < $4 THEN (g % 12)::int4 END, CASE WHEN g < $4 THEN g END, \
               CASE WHEN g >= $4 AND g < $4 + $5 THEN c + interval '1 s' END, \
               CASE WHEN g >= $4 AND g < $4 + $5 THEN 'poison' END, \
               CASE WHEN g >= $4 AND g < $4 + $5 THEN 1 ELSE 0 END, c \
             FROM (SELECT g, CASE WHEN g < $4 \
                               THEN now() - ($4 - g) * (86400.0 / $4) * interval '1 s' \
                               ELSE now() - ($6 - g) * interval '1 ms' END AS c \
                   FROM generate_series($1::int8, $2::int8 - 1) g) r"
        ))
        .bind(from)
        .bind(to)
        .bind(aggregates as i64)
        .bind(done)
        .bind(parked as i64)
        .bind(rows as i64)
        .execute(store.pool())
        .await?;
    }
    sqlx::query(&format!(
        "INSERT INTO {state} (aggregate_key, aggregate_type, aggregate_id, last_version) \
         SELECT hashtextextended('order' || chr(31) || 'order-' || a, 0), 'order', \
                'order-' || a, CASE WHEN a < $2 THEN ($2 - 1 - a) / $1 + 1 END \
         FROM generate_series(0, $1 - 1) a"
    ))
    .bind(aggregates as i64)
    .bind(done)
    .execute(store.pool())
    .await?;
    for table in [&t, &state] {
        sqlx::raw_sql(&format!("VACUUM ANALYZE {table}"))
            .execute(store.pool())
            .await?;
    }
    Ok(())
}
