//! `status` on MariaDB (outbox-mysql): what `outbox status` and the relay's metrics cost on a
//! large table, the same shape and the same reads as the PostgreSQL scenario (`status.rs`).
//!
//! For each size a table is filled in SQL: its secondary indexes are dropped, the rows are
//! inserted by `INSERT .. SELECT` from MariaDB's `SEQUENCE` engine (`seq_<a>_to_<b>`, one
//! statement per million rows, the columns the store writes), the indexes are added back as
//! they were (built by sorting, not row by row), then `ANALYZE TABLE`. Shape: mostly
//! published rows (their publications spread over the last 24 hours), `--pending-percent`
//! pending (at least 2,000, appended one per millisecond up to now), `--parked` parked heads
//! (their aggregates' later versions wait behind them), one aggregate per 100 rows, each with
//! its state row (last version = its highest published one). Then each round alternates,
//! `--reads` times: `stats()`; the reads of one `outbox status` with the default
//! configuration (the backlog, the latency over the 15-minute window, six trend points over
//! the last minute, the relay registry); one claim of 100 + completion (lease mode).

use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest};
use outbox_mysql::MySqlOutboxStore;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::Row;

use crate::mysql::MyEnv;
use crate::report::{median, Report, Samples};
use crate::scale::published;
use crate::status::StatusArgs;

/// Runs the status scenario on MariaDB.
pub(crate) async fn run(env: &MyEnv, args: &StatusArgs, rounds: usize) -> anyhow::Result<Report> {
    anyhow::ensure!(
        args.sizes.iter().all(|&s| s >= 10_000),
        "--sizes: each size needs at least 10,000 rows"
    );
    let mut report = Report::new("status (mysql)", rounds);
    report.param("sizes", &args.sizes);
    report.param("pending_percent", args.pending_percent);
    report.param("parked", args.parked);
    report.param("reads_per_round", args.reads);
    report.param("window_seconds", args.window);
    report.param("claim_batch", 100);
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(30))
        .connect(env.url())
        .await?;
    let mut samples = Samples::default();
    for &size in &args.sizes {
        let store = env
            .store_on(
                &pool,
                "status",
                ClaimMode::Lease {
                    duration: Duration::from_secs(60),
                },
            )
            .await?;
        let pending = ((size as f64 * args.pending_percent / 100.0) as usize)
            .max(2000)
            .min(size);
        let aggregates = (size / 100).max(args.parked + 1);
        let filled = Instant::now();
        fill(&store, size, pending, args.parked, aggregates).await?;
        println!(
            "size {size}: {pending} pending, {} parked, {aggregates} aggregates; filled in {:.1} s \
             (database {})",
            args.parked,
            filled.elapsed().as_secs_f64(),
            store.settings().database.as_deref().unwrap_or("?")
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
        if args.keep {
            println!(
                "kept: database {} (drop it yourself)",
                env.forget_last_database()
            );
        } else {
            env.cleanup().await?;
        }
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
        report.target(
            &format!("status reads at {last} rows, ms (<= 100)"),
            samples.median(&format!("status reads [{last} rows]"), "ms"),
            100.0,
            false,
        );
    }
    report.figures = samples.figures();
    Ok(report)
}

/// The store reads of one `outbox status` with the default configuration, as in `status.rs`
/// (the backlog, the latency over the window, the flows of six trend points in one call, the
/// relay registry). Milliseconds.
async fn status_reads(store: &MySqlOutboxStore, window: Duration) -> anyhow::Result<f64> {
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

/// `rows` rows (see the module's doc): published (the oldest, their publications over the
/// last 24 hours), then `parked` parked heads, then `pending` pending (one per millisecond up
/// to now), over `aggregates` aggregates (version = the row's round over them); the state
/// rows; the secondary indexes dropped during the fill and built again after it.
async fn fill(
    store: &MySqlOutboxStore,
    rows: usize,
    pending: usize,
    parked: usize,
    aggregates: usize,
) -> anyhow::Result<()> {
    let pool = store.pool();
    let db = store
        .settings()
        .database
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the bench's store names its database"))?;
    let table = store.settings().table.clone();
    let t = format!("`{db}`.`{table}`");
    let state = format!("`{db}`.`{table}_aggregate`");
    let seq: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM information_schema.ENGINES \
         WHERE ENGINE = 'SEQUENCE' AND SUPPORT IN ('YES', 'DEFAULT')",
    )
    .fetch_one(pool)
    .await?;
    anyhow::ensure!(seq > 0, "the fill needs MariaDB's SEQUENCE engine");
    // The secondary indexes as the migrations made them, in column order.
    let defs = sqlx::query(
        "SELECT INDEX_NAME AS name, MAX(NON_UNIQUE) AS non_unique, \
                GROUP_CONCAT(CONCAT('`', COLUMN_NAME, '`', \
                                    IF(SUB_PART IS NULL, '', CONCAT('(', SUB_PART, ')'))) \
                             ORDER BY SEQ_IN_INDEX SEPARATOR ', ') AS cols \
         FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND INDEX_NAME <> 'PRIMARY' \
         GROUP BY INDEX_NAME",
    )
    .bind(&db)
    .bind(&table)
    .fetch_all(pool)
    .await?;
    let mut drops = Vec::new();
    let mut adds = Vec::new();
    for d in &defs {
        let name: String = d.try_get("name")?;
        let non_unique: i64 = d.try_get("non_unique")?;
        let cols: String = d.try_get("cols")?;
        drops.push(format!("DROP INDEX `{name}`"));
        adds.push(format!(
            "ADD {}KEY `{name}` ({cols})",
            if non_unique == 0 { "UNIQUE " } else { "" }
        ));
    }
    if !drops.is_empty() {
        sqlx::raw_sql(&format!("ALTER TABLE {t} {}", drops.join(", ")))
            .execute(pool)
            .await?;
    }
    // Rows below `done` are published; [done, done + parked) parked; the rest pending.
    let done = (rows - pending) as i64;
    let pk = done + parked as i64;
    let (all, a) = (rows as i64, aggregates as i64);
    let mut from = 0i64;
    while from < all {
        let to = (from + 1_000_000).min(all);
        sqlx::raw_sql(&format!(
            "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, aggregate_version, \
               event_type, schema_version, content_type, payload, headers, created_at, status, \
               published_at, finished_at, ack_transport, ack_destination, ack_partition, \
               ack_position, parked_at, park_kind, attempts, inserted_at) \
             SELECT UNHEX(LPAD(HEX(g), 32, '0')), 'order', CONCAT('order-', g % {a}), \
               g DIV {a} + 1, 'order.changed', 1, 'application/json', REPEAT('x', 200), '{{}}', \
               c, \
               CASE WHEN g < {done} THEN 'published' WHEN g < {pk} THEN 'parked' \
                    ELSE 'pending' END, \
               IF(g < {done}, c + INTERVAL 40000 MICROSECOND, NULL), \
               IF(g < {done}, c + INTERVAL 40000 MICROSECOND, NULL), \
               IF(g < {done}, 'kafka', NULL), IF(g < {done}, 'orders', NULL), \
               IF(g < {done}, g % 12, NULL), IF(g < {done}, g, NULL), \
               IF(g >= {done} AND g < {pk}, c + INTERVAL 1 SECOND, NULL), \
               IF(g >= {done} AND g < {pk}, 'poison', NULL), \
               IF(g >= {done} AND g < {pk}, 1, 0), c \
             FROM (SELECT seq AS g, \
                     IF(seq < {done}, \
                        UTC_TIMESTAMP(6) - INTERVAL (({done} - seq) * 86400000000 DIV {done}) \
                          MICROSECOND, \
                        UTC_TIMESTAMP(6) - INTERVAL (({all} - seq) * 1000) MICROSECOND) AS c \
                   FROM seq_{from}_to_{last}) r",
            last = to - 1,
        ))
        .execute(pool)
        .await?;
        from = to;
    }
    sqlx::raw_sql(&format!(
        "INSERT INTO {state} (aggregate_key, aggregate_type, aggregate_id, last_version, \
           updated_at) \
         SELECT UNHEX(SHA2(CONCAT('order', CHAR(31 USING utf8mb4), CONCAT('order-', s.seq)), \
                           256)), \
                'order', CONCAT('order-', s.seq), \
                IF(s.seq < {done}, ({done} - 1 - s.seq) DIV {a} + 1, NULL), UTC_TIMESTAMP(6) \
         FROM seq_0_to_{last} s",
        last = a - 1,
    ))
    .execute(pool)
    .await?;
    if !adds.is_empty() {
        sqlx::raw_sql(&format!("ALTER TABLE {t} {}", adds.join(", ")))
            .execute(pool)
            .await?;
    }
    for table in [&t, &state] {
        sqlx::raw_sql(&format!("ANALYZE TABLE {table}"))
            .execute(pool)
            .await?;
    }
    Ok(())
}
