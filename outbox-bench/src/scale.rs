//! Scale: the claim's cost as the backlog grows, and a soak at a steady load with cleanup.
//!
//! Claim cost: for each size, a table is filled with that many queued rows (in SQL, one
//! statement per million rows: the same columns and indexes as appends write, faster), then
//! each round alternates `--claims` claim+complete cycles of the store (default mode, batch
//! 1,000) with as many naive `SELECT .. LIMIT 1000 FOR UPDATE SKIP LOCKED` (rolled back) on the
//! same table, the reference. `EXPLAIN (ANALYZE, BUFFERS)` of the claim at each size goes to
//! the JSON details.
//!
//! Soak: single-event transactions at `--soak-rate` per second for `--soak-seconds`, a relay
//! (the real driver, NOTIFY wake-up, a publisher that acknowledges at once: the table's
//! behaviour is the subject) and cleanup every 5 s (retention 5 s); every `--sample-every`
//! seconds the table and index size, live and dead tuples, backlog and the latency of a probe
//! claim. The figure is the growth of size and dead tuples between the first quarter of the
//! soak and its end.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, Envelope, Outcome, Relay, RelayConfig, SystemClock,
};
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;
use sqlx::Row;

use crate::drain::InstantAcks;
use crate::env::{self, Env};
use crate::report::{median, Report, Samples};

/// Options of `outbox-bench scale`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ScaleArgs {
    /// Queued rows for the claim-cost part (comma-separated; the issue asks for
    /// 10000,1000000,10000000; 10M takes minutes to fill here).
    #[arg(long, value_delimiter = ',', default_value = "10000,1000000")]
    sizes: Vec<usize>,
    /// Aggregates the queued rows are spread over.
    #[arg(long, default_value_t = 10_000)]
    aggregates: usize,
    /// Claim cycles per round and size (fewer when the size cannot feed them: each claim
    /// publishes 1,000 rows).
    #[arg(long, default_value_t = 5)]
    claims: usize,
    /// Seconds of the soak (0: no soak; the issue asks for 1800).
    #[arg(long, default_value_t = 60)]
    soak_seconds: u64,
    /// Offered load of the soak (single-event transactions per second).
    #[arg(long, default_value_t = 500)]
    soak_rate: u32,
    /// Run `VACUUM` on the outbox table after each cleanup (for servers without autovacuum:
    /// shows whether the table stays bounded when it is vacuumed).
    #[arg(long)]
    soak_vacuum: bool,
    /// Emulate autovacuum with the server's own thresholds and naptime on the outbox and its
    /// aggregate-state table (for servers running with `autovacuum = off`): what a server with
    /// the default autovacuum settings would do.
    #[arg(long, conflicts_with = "soak_vacuum")]
    soak_autovacuum: bool,
    /// Seconds between soak samples.
    #[arg(long, default_value_t = 10)]
    sample_every: u64,
}

/// Runs the scale scenario.
pub(crate) async fn run(env: &Env, args: &ScaleArgs, rounds: usize) -> anyhow::Result<Report> {
    if let Some(small) = args.sizes.iter().find(|&&s| s < 2000) {
        anyhow::bail!(
            "--sizes: {small} is too small; each size needs at least 2,000 rows (claims of \
             1,000 and a naive select after them)"
        );
    }
    let mut report = Report::new("scale", rounds);
    report.param("sizes", &args.sizes);
    report.param("aggregates", args.aggregates);
    report.param("claims_per_round", args.claims);
    report.param("batch", 1000);
    report.param("soak_seconds", args.soak_seconds);
    report.param("soak_rate", args.soak_rate);
    report.param("soak_vacuum", args.soak_vacuum);
    report.param("soak_autovacuum_emulated", args.soak_autovacuum);
    let autovacuum: String = sqlx::query_scalar("SELECT current_setting('autovacuum')")
        .fetch_one(&env.pool)
        .await?;
    report.param("server_autovacuum", autovacuum);
    let mut samples = Samples::default();
    let mut plans = serde_json::Map::new();
    for &size in &args.sizes {
        let store = env
            .store(
                "scale",
                ClaimMode::Lease {
                    duration: Duration::from_secs(60),
                },
                false,
            )
            .await?;
        let filled = Instant::now();
        fill(&store, size, args.aggregates).await?;
        println!(
            "size {size}: filled in {:.1} s",
            filled.elapsed().as_secs_f64()
        );
        let plan = store.explain_claim(1000).await?;
        plans.insert(size.to_string(), serde_json::json!(plan));
        let claim_name = format!("store claim (lease) [{size} queued]");
        let complete_name = format!("store complete (lease) [{size} queued]");
        let naive_name = format!("naive SKIP LOCKED select [{size} queued]");
        // Each measured claim publishes 1,000 rows: never more than the table holds, and 1,000
        // rows stay queued for the naive select that may follow the last claim.
        let claims = args
            .claims
            .min((size / 1000).saturating_sub(1) / rounds)
            .max(1);
        for round in 0..rounds {
            let (mut claim_ms, mut complete_ms, mut naive_ms) = (vec![], vec![], vec![]);
            for k in 0..claims {
                // Alternate which goes first.
                if (k + round) % 2 == 0 {
                    naive_ms.push(naive_select(&store).await?);
                }
                let (c, d) = claim_complete(&store).await?;
                claim_ms.push(c);
                complete_ms.push(d);
                if (k + round) % 2 == 1 {
                    naive_ms.push(naive_select(&store).await?);
                }
            }
            println!(
                "round {}/{rounds}  size {size:>9}: claim p50 {:.2} ms, complete p50 {:.2} ms, naive select p50 {:.2} ms",
                round + 1,
                median(&claim_ms),
                median(&complete_ms),
                median(&naive_ms)
            );
            samples.add(&claim_name, "ms", median(&claim_ms));
            samples.add(&complete_name, "ms", median(&complete_ms));
            samples.add(&naive_name, "ms", median(&naive_ms));
        }
        samples.compare(&claim_name, "ms", &naive_name);
        env.cleanup().await?;
    }
    if let (Some(&first), Some(&last)) = (args.sizes.first(), args.sizes.last()) {
        if last > first {
            let at = |s: usize| samples.median(&format!("store claim (lease) [{s} queued]"), "ms");
            report.target(
                &format!("claim cost at {last} / at {first} queued rows (flat: <= 2)"),
                at(last).zip(at(first)).map(|(a, b)| a / b),
                2.0,
                false,
            );
        }
    }
    report
        .details
        .insert("claim_plans".into(), serde_json::Value::Object(plans));
    if args.soak_seconds > 0 {
        let series = soak(env, args).await?;
        let quarter = series.len() / 4;
        if series.len() >= 4 {
            let get = |i: usize, k: &str| series[i][k].as_f64().unwrap_or(0.0);
            let last = series.len() - 1;
            let growth = |k: &str| {
                let base = get(quarter, k).max(1.0);
                get(last, k) / base
            };
            samples.add(
                "soak: total size end / at 1st quarter",
                "ratio",
                growth("total_bytes"),
            );
            samples.add(
                "soak: dead tuples end / at 1st quarter",
                "ratio",
                growth("dead_tuples"),
            );
            let claims: Vec<f64> = series
                .iter()
                .map(|s| s["probe_claim_ms"].as_f64().unwrap_or(0.0))
                .collect();
            samples.add(
                "soak: probe claim ms, first quarter",
                "ms",
                median(&claims[..quarter.max(1)]),
            );
            samples.add(
                "soak: probe claim ms, last quarter",
                "ms",
                median(&claims[last + 1 - quarter.max(1)..]),
            );
            report.target(
                "soak: table+index size stays bounded (end / first quarter <= 1.5)",
                Some(growth("total_bytes")),
                1.5,
                false,
            );
        }
        report
            .details
            .insert("soak_samples".into(), serde_json::Value::Array(series));
    }
    report.figures = samples.figures();
    Ok(report)
}

/// `rows` queued rows over `aggregates`, written in SQL (same columns the append writes).
async fn fill(store: &PostgresOutboxStore, rows: usize, aggregates: usize) -> anyhow::Result<()> {
    let s = store.settings();
    let t = format!("\"{}\".\"{}\"", s.schema, s.table);
    let payload = serde_json::to_string(&env::payload(0))?;
    let mut from = 0usize;
    while from < rows {
        let to = (from + 1_000_000).min(rows);
        sqlx::query(&format!(
            "INSERT INTO {t} (event_id, aggregate_type, aggregate_id, aggregate_version, \
                              event_type, schema_version, content_type, payload, headers, created_at) \
             SELECT gen_random_uuid(), 'order', 'order-' || (g % $3), g / $3 + 1, 'order.changed', 1, \
                    'application/json', convert_to($4, 'UTF8'), '{{}}'::jsonb, now() \
             FROM generate_series($1::int8, $2::int8 - 1) g"
        ))
        .bind(from as i64)
        .bind(to as i64)
        .bind(aggregates.max(1) as i64)
        .bind(&payload)
        .execute(store.pool())
        .await?;
        from = to;
    }
    sqlx::raw_sql(&format!("VACUUM ANALYZE {t}"))
        .execute(store.pool())
        .await?;
    Ok(())
}

async fn claim_complete(store: &PostgresOutboxStore) -> anyhow::Result<(f64, f64)> {
    let started = Instant::now();
    let b = store.claim(&ClaimRequest::new("scale", 1000)).await?;
    let claim = started.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(!b.is_empty(), "nothing claimed");
    let outcomes = published(&b);
    let started = Instant::now();
    store.complete(&b.handle, &outcomes).await?;
    Ok((claim, started.elapsed().as_secs_f64() * 1e3))
}

/// Every record of `b` acknowledged (offsets by position), for the bare store loops.
pub(crate) fn published(b: &outbox_core::ClaimedBatch) -> Vec<Outcome> {
    b.records
        .iter()
        .enumerate()
        .map(|(i, r)| Outcome::Published {
            event_id: r.envelope.event_id,
            ack: AckMetadata::kafka("bench", 0, i as i64),
        })
        .collect()
}

async fn naive_select(store: &PostgresOutboxStore) -> anyhow::Result<f64> {
    let s = store.settings();
    let sql = format!(
        "SELECT id, payload, headers FROM \"{}\".\"{}\" WHERE status = 'pending' AND NOT blocked \
         ORDER BY id LIMIT 1000 FOR UPDATE SKIP LOCKED",
        s.schema, s.table
    );
    let started = Instant::now();
    let mut tx = store.pool().begin().await?;
    let rows = sqlx::query(&sql).fetch_all(&mut *tx).await?;
    tx.rollback().await?;
    anyhow::ensure!(!rows.is_empty(), "nothing selected");
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

async fn soak(env: &Env, args: &ScaleArgs) -> anyhow::Result<Vec<serde_json::Value>> {
    let store = env
        .store(
            "soak",
            ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
            true,
        )
        .await?;
    let s = store.settings().clone();
    let wake = Arc::new(tokio::sync::Notify::new());
    let listener = store.spawn_listener(wake.clone())?;
    let relay = Relay::new(
        store.clone(),
        Arc::new(InstantAcks::default()),
        RelayConfig::builder().owner("soak-relay").build()?,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(3)),
    )?;
    let stop = Arc::new(tokio::sync::Notify::new());
    let relay_task = {
        let stop = stop.clone();
        tokio::spawn(outbox_core::driver::run(relay, Some(wake), async move {
            stop.notified().await;
        }))
    };
    let running = Arc::new(AtomicBool::new(true));
    // The load: 4 clients, open loop.
    let clients = 4usize;
    let interval = Duration::from_secs_f64(clients as f64 / f64::from(args.soak_rate.max(1)));
    let mut load = Vec::new();
    for client in 0..clients {
        let (store, running) = (store.clone(), running.clone());
        load.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut k = 0usize;
            while running.load(Ordering::Relaxed) {
                tick.tick().await;
                let e = Envelope::builder(
                    "order",
                    format!("c{client}-{}", k % 1000),
                    (k / 1000) as i64 + 1,
                    "order.changed",
                )
                .json(&env::payload(k))?
                .build()?;
                store.append(store.pool(), &e).await?;
                k += 1;
            }
            Ok::<_, anyhow::Error>(k)
        }));
    }
    // Cleanup every 5 s.
    let cleanup = {
        let (store, running) = (store.clone(), running.clone());
        let vacuum = args
            .soak_vacuum
            .then(|| format!("VACUUM \"{}\".\"{}\"", s.schema, s.table));
        tokio::spawn(async move {
            let mut removed = 0u64;
            while running.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_secs(5)).await;
                // Deletes in transactions of at most 1,000 rows until none is due.
                removed += store.cleanup(Duration::from_secs(5), 1000).await?.removed;
                if let Some(v) = &vacuum {
                    sqlx::raw_sql(v).execute(store.pool()).await?;
                }
            }
            Ok::<_, anyhow::Error>(removed)
        })
    };
    let autovac = args.soak_autovacuum.then(|| {
        tokio::spawn(crate::autovac::run(
            store.pool().clone(),
            vec![
                (s.schema.clone(), s.table.clone()),
                (s.schema.clone(), format!("{}_aggregate", s.table)),
            ],
            running.clone(),
        ))
    });
    let started = Instant::now();
    let mut series = Vec::new();
    let stats_sql = format!(
        "SELECT pg_total_relation_size(c.oid)::int8 AS total, pg_relation_size(c.oid)::int8 AS heap, \
                pg_indexes_size(c.oid)::int8 AS idx, st.n_live_tup, st.n_dead_tup, \
                st.autovacuum_count, st.vacuum_count, \
                pg_total_relation_size(format('%I.%I', n.nspname, c.relname || '_aggregate'))::int8 \
                  AS state_total \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         JOIN pg_stat_user_tables st ON st.relid = c.oid \
         WHERE n.nspname = '{}' AND c.relname = '{}'",
        s.schema, s.table
    );
    while started.elapsed() < Duration::from_secs(args.soak_seconds) {
        tokio::time::sleep(Duration::from_secs(args.sample_every.max(1))).await;
        let t0 = Instant::now();
        let b = store.claim(&ClaimRequest::new("soak-probe", 100)).await?;
        let probe_ms = t0.elapsed().as_secs_f64() * 1e3;
        store.complete(&b.handle, &published(&b)).await?;
        let row = sqlx::query(&stats_sql).fetch_one(store.pool()).await?;
        let backlog = store.stats().await?.unpublished;
        let sample = serde_json::json!({
            "t_s": started.elapsed().as_secs(),
            "total_bytes": row.get::<i64, _>("total"),
            "heap_bytes": row.get::<i64, _>("heap"),
            "index_bytes": row.get::<i64, _>("idx"),
            "live_tuples": row.get::<i64, _>("n_live_tup"),
            "dead_tuples": row.get::<i64, _>("n_dead_tup"),
            "autovacuums": row.get::<i64, _>("autovacuum_count"),
            "vacuums": row.get::<i64, _>("vacuum_count"),
            "state_total_bytes": row.get::<i64, _>("state_total"),
            "backlog": backlog,
            "probe_claim_ms": probe_ms,
        });
        println!("soak {sample}");
        series.push(sample);
    }
    running.store(false, Ordering::Relaxed);
    let mut appended = 0;
    for t in load {
        appended += t.await??;
    }
    let removed = cleanup.await??;
    if let Some(a) = autovac {
        let c = a.await??;
        println!(
            "soak: autovacuum stand-in ran {} VACUUM and {} ANALYZE",
            c.vacuums, c.analyzes
        );
    }
    stop.notify_one();
    relay_task.await?;
    listener.abort();
    println!("soak: {appended} appended, {removed} removed by cleanup");
    Ok(series)
}
