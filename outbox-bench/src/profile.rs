//! Profile: where a drain's time goes, per statement, from PostgreSQL's own accounting.
//!
//! The run gets a database of its own (`outbox_bench_<run>`, dropped at the end) with
//! `pg_stat_statements` tracking switched on for that database only (`ALTER DATABASE .. SET
//! pg_stat_statements.track = 'top'`, planning and utility statements included: BEGIN, the
//! `SET LOCAL`s and COMMIT are statements of their own, and COMMIT's time is the WAL flush).
//! For each claim mode it preloads a backlog, resets the statistics of that database, drains it
//! with `Relay::run_once` and a publisher that acknowledges at once (the drain scenario's
//! "instant" contender), then prints every statement by total time (execution + planning) with
//! calls, mean, rows, shared blocks hit/read/dirtied, WAL bytes and the time per drained event,
//! and the split of the drain's wall time: time inside statements vs the rest (the relay's
//! client work, the round trips, the waits), with the CPU time of the relay process and of the
//! run's PostgreSQL backends (from `/proc`, when the server is local).
//!
//! `--explain`: one claim and its completion in each mode after `--explain-warmup` cycles (the
//! aggregates then have their state rows, as in a steady drain), on connections that load
//! `auto_explain` with `log_analyze`, `log_buffers` and `log_level = notice`: the plans of
//! the real statements, with their real parameters, arrive as notices, which the program logs
//! under the target `sqlx::postgres::notice`. Run with
//! `RUST_LOG=warn,sqlx::postgres::notice=info` and keep stderr.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, Relay, RelayConfig, SystemClock};
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor as _, PgPool, Row};

use crate::drain::InstantAcks;
use crate::env::{self, Env};
use crate::report::{Report, Samples};

/// Options of `outbox-bench profile`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ProfileArgs {
    /// Events in the backlog of each drain.
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// Aggregates the backlog is spread over (round robin).
    #[arg(long, default_value_t = 20_000)]
    aggregates: usize,
    /// Claim batch size.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Claim modes to profile (lease, locked), and `naive`: the drain scenario's reference
    /// (`SKIP LOCKED` select + one `UPDATE` per batch on the same table, no order). A mode
    /// with the suffix `+published-at-idx` (e.g. `lease+published-at-idx`) puts back the
    /// index that migration 5 dropped, to price it in the same run.
    #[arg(long, value_delimiter = ',', default_value = "lease,locked")]
    modes: Vec<String>,
    /// Statements printed per mode (by total time).
    #[arg(long, default_value_t = 15)]
    top: usize,
    /// Skip the drains (pg_stat_statements); with `--explain`, only the plans.
    #[arg(long)]
    no_statements: bool,
    /// Also log `EXPLAIN (ANALYZE, BUFFERS)` of one claim + completion per mode (auto_explain;
    /// see the module docs for RUST_LOG).
    #[arg(long)]
    explain: bool,
    /// Claim + completion cycles before the explained one.
    #[arg(long, default_value_t = 20)]
    explain_warmup: usize,
    /// A `perf record --control fifo:FILE -D -1` control FIFO: the program writes `enable`
    /// before each drain and `disable` after it, so that perf samples the drains only.
    #[arg(long)]
    perf_ctl: Option<std::path::PathBuf>,
}

/// One relay (`Relay::run_once`, default prefetch, instant publisher) drains `events` events,
/// as the drain scenario's instant contender does, with nothing else inside the clock (nor
/// inside perf's window): the events are counted, not read from the store's statistics.
async fn drain_profiled(
    store: &PostgresOutboxStore,
    batch: usize,
    events: usize,
    ctl: Option<&std::path::Path>,
) -> anyhow::Result<(u64, Duration)> {
    let config = RelayConfig::builder()
        .owner("profile")
        .batch_size(batch)
        .build()?;
    let mut relay = Relay::new(
        store.clone(),
        Arc::new(InstantAcks::default()),
        config,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(0)),
    )?;
    perf_ctl(ctl, "enable")?;
    let started = Instant::now();
    let mut done = 0u64;
    let result = async {
        while done < events as u64 {
            let report = relay.run_once().await?;
            crate::drain::ensure_clean_cycle(&report)?;
            if report.claimed == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            done += report.published as u64;
        }
        anyhow::Ok(())
    }
    .await;
    let took = started.elapsed();
    perf_ctl(ctl, "disable")?;
    result?;
    relay.release_prefetched().await?;
    Ok((done, took))
}

/// Writes a command (`enable`, `disable`) to perf's control FIFO.
fn perf_ctl(fifo: Option<&std::path::Path>, command: &str) -> anyhow::Result<()> {
    if let Some(f) = fifo {
        use std::io::Write as _;
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(f)
            .with_context(|| format!("perf control FIFO {}", f.display()))?;
        writeln!(w, "{command}")?;
    }
    Ok(())
}

fn mode_of(name: &str) -> anyhow::Result<ClaimMode> {
    match name.strip_suffix(PUBLISHED_AT_IDX).unwrap_or(name) {
        "lease" => Ok(ClaimMode::Lease {
            duration: Duration::from_secs(60),
        }),
        // The naive reference (the drain scenario's `naive-sql`) on a store's table.
        "locked" | "naive" => Ok(ClaimMode::LockedTransaction),
        other => anyhow::bail!("--modes: unknown claim mode {other:?} (lease, locked, naive)"),
    }
}

/// Mode suffix: the store's table gets migration 4's `published_at_idx` back.
const PUBLISHED_AT_IDX: &str = "+published-at-idx";

/// Runs the profile scenario.
pub(crate) async fn run(env: &Env, args: &ProfileArgs, rounds: usize) -> anyhow::Result<Report> {
    let modes: Vec<(String, ClaimMode)> = args
        .modes
        .iter()
        .map(|m| Ok((m.clone(), mode_of(m)?)))
        .collect::<anyhow::Result<_>>()?;
    let db = format!("outbox_bench_{}", env.run);
    sqlx::raw_sql(&format!("CREATE DATABASE \"{db}\""))
        .execute(&env.pool)
        .await
        .context("CREATE DATABASE (the profile needs a database of its own)")?;
    let result = profile_in(env, &db, args, &modes, rounds).await;
    let dropped = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)"))
        .execute(&env.pool)
        .await;
    let report = result?;
    dropped?;
    Ok(report)
}

async fn profile_in(
    admin: &Env,
    db: &str,
    args: &ProfileArgs,
    modes: &[(String, ClaimMode)],
    rounds: usize,
) -> anyhow::Result<Report> {
    // Tracking for this database only; the settings apply to sessions started after them.
    for set in [
        "pg_stat_statements.track = 'top'",
        "pg_stat_statements.track_planning = on",
        "pg_stat_statements.track_utility = on",
        "track_io_timing = on",
    ] {
        sqlx::raw_sql(&format!("ALTER DATABASE \"{db}\" SET {set}"))
            .execute(&admin.pool)
            .await
            .with_context(|| format!("ALTER DATABASE .. SET {set} (needs a superuser)"))?;
    }
    let mut url = url::Url::parse(&admin.database_url).context("DATABASE_URL is not a URL")?;
    url.set_path(db);
    let env = Env::connect(Some(url.to_string()), None, 16).await?;
    let result = profile_with(&env, &url, args, modes, rounds).await;
    let cleaned = env.cleanup().await;
    env.pool.close().await;
    let report = result?;
    cleaned?;
    Ok(report)
}

async fn profile_with(
    env: &Env,
    url: &url::Url,
    args: &ProfileArgs,
    modes: &[(String, ClaimMode)],
    rounds: usize,
) -> anyhow::Result<Report> {
    sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(&env.pool)
        .await
        .context("CREATE EXTENSION pg_stat_statements (the module must be preloaded)")?;
    let track: String = sqlx::query_scalar("SELECT current_setting('pg_stat_statements.track')")
        .fetch_one(&env.pool)
        .await?;
    anyhow::ensure!(
        track == "top",
        "pg_stat_statements.track is {track:?} in the profile's database"
    );
    let mut report = Report::new("profile", rounds);
    report.param("events", args.events);
    report.param("aggregates", args.aggregates);
    report.param("batch", args.batch);
    report.param("payload_bytes", serde_json::to_vec(&env::payload(0))?.len());
    report.param("publisher", "instant acknowledgements (no broker)");
    report.param("pg_stat_statements.track", "top (this database only)");
    let mut samples = Samples::default();
    if !args.no_statements {
        for (name, mode) in modes {
            let mut wall = Duration::ZERO;
            let mut events = 0u64;
            let mut cpu = CpuSplit::default();
            let mut stmts: Vec<Stmt> = Vec::new();
            for round in 0..rounds {
                let tag = format!("prof_{}", name.replace(PUBLISHED_AT_IDX, "_pidx"));
                let store = env.store(&tag, *mode, false).await?;
                if name.ends_with(PUBLISHED_AT_IDX) {
                    let s = store.settings();
                    sqlx::raw_sql(&format!(
                        "CREATE INDEX \"{t}_published_at_idx\" ON \"{sc}\".\"{t}\" \
                         (published_at) WHERE status = 'published'",
                        sc = s.schema,
                        t = s.table
                    ))
                    .execute(&env.pool)
                    .await?;
                }
                env::preload(&store, args.events, args.aggregates).await?;
                if name == "naive" {
                    crate::drain::unblock_for_naive(&store).await?;
                }
                // Only the drain's statements: reset after the preload, read after the drain.
                reset_stats(&env.pool).await?;
                let before = cpu_snapshot(&env.pool).await?;
                let (n, took) = if name == "naive" {
                    perf_ctl(args.perf_ctl.as_deref(), "enable")?;
                    let r = crate::drain::drain_naive_sql(&store, args.batch).await;
                    perf_ctl(args.perf_ctl.as_deref(), "disable")?;
                    r?
                } else {
                    drain_profiled(&store, args.batch, args.events, args.perf_ctl.as_deref())
                        .await?
                };
                let after = cpu_snapshot(&env.pool).await?;
                merge(&mut stmts, statements(&env.pool).await?);
                cpu.add(&before, &after);
                let mut pids: Vec<i32> = after.backends.keys().copied().collect();
                pids.sort_unstable();
                println!(
                    "relay process pid {}; backends of the run's database: {pids:?}",
                    std::process::id()
                );
                anyhow::ensure!(n == args.events as u64, "drained {n} of {}", args.events);
                println!(
                    "round {}/{rounds}  {name} drain, instant publisher: {n} events in {:.2} s = {:.0} events/s",
                    round + 1,
                    took.as_secs_f64(),
                    n as f64 / took.as_secs_f64()
                );
                samples.add(
                    &format!("{name} drain, instant publisher"),
                    "events/s",
                    n as f64 / took.as_secs_f64(),
                );
                wall += took;
                events += n;
                env.cleanup().await?;
            }
            stmts.sort_by(|a, b| (b.exec_ms + b.plan_ms).total_cmp(&(a.exec_ms + a.plan_ms)));
            let detail = print_statements(name, &stmts, args.top, events, wall, &cpu);
            report.details.insert(format!("statements_{name}"), detail);
        }
    }
    if args.explain {
        for (name, mode) in modes.iter().filter(|(n, _)| n != "naive") {
            explain_cycle(env, url, name, *mode, args).await?;
        }
    }
    report.figures = samples.figures();
    Ok(report)
}

async fn reset_stats(pool: &PgPool) -> anyhow::Result<()> {
    // This database's entries only (other databases on the server are not touched).
    sqlx::raw_sql(
        "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database \
                                             WHERE datname = current_database()), 0)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Adds the statements of one drain to those of the previous rounds (same label and text).
fn merge(into: &mut Vec<Stmt>, from: Vec<Stmt>) {
    for s in from {
        match into
            .iter_mut()
            .find(|t| t.label == s.label && t.query == s.query)
        {
            Some(t) => {
                t.calls += s.calls;
                t.exec_ms += s.exec_ms;
                t.plan_ms += s.plan_ms;
                t.rows += s.rows;
                t.blks_hit += s.blks_hit;
                t.blks_read += s.blks_read;
                t.blks_dirtied += s.blks_dirtied;
                t.wal_bytes += s.wal_bytes;
                t.wal_fpi += s.wal_fpi;
            }
            None => into.push(s),
        }
    }
}

/// One statement's totals over the profiled drains.
#[derive(Debug, Clone, serde::Serialize)]
struct Stmt {
    label: String,
    query: String,
    calls: i64,
    exec_ms: f64,
    plan_ms: f64,
    rows: i64,
    blks_hit: i64,
    blks_read: i64,
    blks_dirtied: i64,
    wal_bytes: f64,
    wal_fpi: i64,
}

async fn statements(pool: &PgPool) -> anyhow::Result<Vec<Stmt>> {
    let rows = sqlx::query(
        "SELECT regexp_replace(query, '\\s+', ' ', 'g') AS query, calls, \
                total_exec_time, total_plan_time, rows, shared_blks_hit, shared_blks_read, \
                shared_blks_dirtied, wal_bytes::float8 AS wal_bytes, wal_fpi \
         FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '%pg_stat_statements%' \
         ORDER BY total_exec_time + total_plan_time DESC",
    )
    .fetch_all(pool)
    .await?;
    let mut out = Vec::new();
    for r in rows {
        let query: String = r.get("query");
        // Whatever of the run's own handling slipped in is not part of a drain.
        let label = label(&query);
        if label == "(preload)" {
            continue;
        }
        out.push(Stmt {
            label: label.to_owned(),
            query: query.chars().take(200).collect(),
            calls: r.get("calls"),
            exec_ms: r.get("total_exec_time"),
            plan_ms: r.get("total_plan_time"),
            rows: r.get("rows"),
            blks_hit: r.get("shared_blks_hit"),
            blks_read: r.get("shared_blks_read"),
            blks_dirtied: r.get("shared_blks_dirtied"),
            wal_bytes: r.get("wal_bytes"),
            wal_fpi: r.get("wal_fpi"),
        });
    }
    Ok(out)
}

/// A short name for a statement of the store (matched on its text).
fn label(q: &str) -> &'static str {
    let has = |s: &str| q.contains(s);
    if has("INSERT INTO") && has("UNNEST($1::uuid[]")
        || has("VACUUM")
        || has("CREATE SCHEMA")
        || has("DROP SCHEMA")
    {
        "(preload)"
    } else if has("ORDER BY c.id LIMIT") {
        "claim 1: candidates + try-locks"
    } else if has("c AS MATERIALIZED") && has("lease_owner, lease_token, lease_until, lease_row)") {
        "claim 2: decide (lease)"
    } else if has("c AS MATERIALIZED") {
        "claim 2: decide (locked)"
    } else if has("f AS MATERIALIZED") {
        "complete (lease)"
    } else if has("o AS MATERIALIZED") {
        "complete (locked)"
    } else if has("pg_advisory_xact_lock(s.k)") {
        "complete: lock keys"
    } else if q.starts_with("BEGIN") {
        "BEGIN"
    } else if q.starts_with("COMMIT") {
        "COMMIT"
    } else if q.starts_with("ROLLBACK") {
        "ROLLBACK"
    } else if q.starts_with("SET LOCAL synchronous_commit") {
        "SET LOCAL synchronous_commit"
    } else if q.starts_with("SET LOCAL") {
        "SET LOCAL (plan, jit, scan)"
    } else if has("FOR UPDATE SKIP LOCKED") {
        "naive: SKIP LOCKED select"
    } else if has("AS u(id, p, o)") {
        "naive: one UPDATE"
    } else if has("AS unpublished") {
        "stats"
    } else {
        "other"
    }
}

fn print_statements(
    mode: &str,
    stmts: &[Stmt],
    top: usize,
    events: u64,
    wall: Duration,
    cpu: &CpuSplit,
) -> serde_json::Value {
    let total_ms: f64 = stmts.iter().map(|s| s.exec_ms + s.plan_ms).sum();
    let plan_ms: f64 = stmts.iter().map(|s| s.plan_ms).sum();
    let wal: f64 = stmts.iter().map(|s| s.wal_bytes).sum();
    let calls: i64 = stmts.iter().map(|s| s.calls).sum();
    let wall_ms = wall.as_secs_f64() * 1e3;
    let per_event = |ms: f64| ms * 1e3 / events.max(1) as f64;
    println!(
        "\n== pg_stat_statements, drain in {mode} mode: {events} events, wall {wall_ms:.0} ms \
         ({:.1} µs/event) ==",
        per_event(wall_ms)
    );
    println!(
        "{:<32} {:>7} {:>9} {:>9} {:>8} {:>9} {:>10} {:>8} {:>8} {:>10} {:>8}",
        "statement",
        "calls",
        "exec ms",
        "plan ms",
        "mean ms",
        "rows",
        "blks hit",
        "read",
        "dirtied",
        "WAL bytes",
        "µs/event"
    );
    for s in stmts.iter().take(top) {
        println!(
            "{:<32} {:>7} {:>9.1} {:>9.1} {:>8.3} {:>9} {:>10} {:>8} {:>8} {:>10.0} {:>8.2}",
            s.label,
            s.calls,
            s.exec_ms,
            s.plan_ms,
            (s.exec_ms + s.plan_ms) / s.calls.max(1) as f64,
            s.rows,
            s.blks_hit,
            s.blks_read,
            s.blks_dirtied,
            s.wal_bytes,
            per_event(s.exec_ms + s.plan_ms)
        );
    }
    println!(
        "all {} statements: {calls} calls, {total_ms:.0} ms ({:.1} µs/event; planning {plan_ms:.0} ms), \
         WAL {:.0} bytes/event",
        stmts.len(),
        per_event(total_ms),
        wal / events.max(1) as f64
    );
    println!(
        "wall {wall_ms:.0} ms = in statements {total_ms:.0} ms ({:.0}%) + outside {:.0} ms \
         (client work, round trips, waits; negative when the prefetch overlaps statements)",
        100.0 * total_ms / wall_ms.max(1e-9),
        wall_ms - total_ms
    );
    println!(
        "CPU during the drains: relay process {:.0} ms ({:.0}% of wall), its PostgreSQL backends \
         {:.0} ms ({:.0}%), server background processes (shared) {:.0} ms",
        cpu.relay_ms,
        100.0 * cpu.relay_ms / wall_ms.max(1e-9),
        cpu.backends_ms,
        100.0 * cpu.backends_ms / wall_ms.max(1e-9),
        cpu.background_ms
    );
    serde_json::json!({
        "events": events,
        "wall_ms": wall_ms,
        "statements_ms": total_ms,
        "planning_ms": plan_ms,
        "calls": calls,
        "wal_bytes_per_event": wal / events.max(1) as f64,
        "cpu_relay_ms": cpu.relay_ms,
        "cpu_backends_ms": cpu.backends_ms,
        "cpu_server_background_ms": cpu.background_ms,
        "statements": stmts,
    })
}

/// CPU time (ms) consumed over the profiled drains.
#[derive(Default, Debug)]
struct CpuSplit {
    relay_ms: f64,
    backends_ms: f64,
    background_ms: f64,
}

/// CPU ticks of this process, of each backend of this database and of the server's background
/// processes (`/proc/<pid>/stat`; empty when the server is not on this machine).
struct CpuSnapshot {
    relay: f64,
    backends: HashMap<i32, f64>,
    background: HashMap<i32, f64>,
}

impl CpuSplit {
    fn add(&mut self, before: &CpuSnapshot, after: &CpuSnapshot) {
        let delta = |b: &HashMap<i32, f64>, a: &HashMap<i32, f64>| -> f64 {
            a.iter()
                .map(|(pid, t)| t - b.get(pid).copied().unwrap_or(0.0))
                .sum()
        };
        self.relay_ms += after.relay - before.relay;
        self.backends_ms += delta(&before.backends, &after.backends);
        self.background_ms += delta(&before.background, &after.background);
    }
}

/// utime + stime of a process, ms (clock ticks of 10 ms, the Linux default).
fn cpu_ms(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces): state is field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = f.get(11)?.parse().ok()?;
    let stime: f64 = f.get(12)?.parse().ok()?;
    Some((utime + stime) * 10.0)
}

async fn cpu_snapshot(pool: &PgPool) -> anyhow::Result<CpuSnapshot> {
    let rows = sqlx::query(
        "SELECT pid, backend_type, datname = current_database() AS ours FROM pg_stat_activity",
    )
    .fetch_all(pool)
    .await?;
    let mut s = CpuSnapshot {
        relay: cpu_ms("self").unwrap_or(0.0),
        backends: HashMap::new(),
        background: HashMap::new(),
    };
    for r in rows {
        let pid: i32 = r.get("pid");
        let kind: Option<String> = r.get("backend_type");
        let ours: Option<bool> = r.get("ours");
        let Some(ms) = cpu_ms(&pid.to_string()) else {
            continue;
        };
        if ours == Some(true) {
            s.backends.insert(pid, ms);
        } else if matches!(
            kind.as_deref(),
            Some("walwriter" | "checkpointer" | "background writer")
        ) {
            s.background.insert(pid, ms);
        }
    }
    Ok(s)
}

/// One claim and its completion under auto_explain, after `warmup` plain cycles.
async fn explain_cycle(
    env: &Env,
    url: &url::Url,
    name: &str,
    mode: ClaimMode,
    args: &ProfileArgs,
) -> anyhow::Result<()> {
    let store = env.store(&format!("explain_{name}"), mode, false).await?;
    env::preload(&store, args.events, args.aggregates).await?;
    let req = ClaimRequest::new("explain", args.batch);
    for _ in 0..args.explain_warmup {
        let b = store.claim(&req).await?;
        store
            .complete(&b.handle, &crate::scale::published(&b))
            .await?;
    }
    sqlx::raw_sql(&format!(
        "ANALYZE \"{}\".\"{}\"",
        store.settings().schema,
        store.settings().table
    ))
    .execute(store.pool())
    .await?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute(
                    "LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0; \
                     SET auto_explain.log_analyze = on; SET auto_explain.log_buffers = on; \
                     SET auto_explain.log_timing = on; SET auto_explain.log_verbose = off; \
                     SET auto_explain.log_nested_statements = off; \
                     SET auto_explain.log_level = notice",
                )
                .await?;
                Ok(())
            })
        })
        .connect(url.as_str())
        .await?;
    let s = store.settings();
    // The same table; the builder's defaults otherwise match the profiled store's.
    let b = PostgresOutboxStore::builder(pool.clone())
        .schema(s.schema.clone())
        .table(s.table.clone())
        .claim_mode(mode)
        .notify_channel(None)
        .build()?;
    eprintln!(
        "==== explain {name}: claim of {} after {} cycles (backlog {} events over {} aggregates) ====",
        args.batch, args.explain_warmup, args.events, args.aggregates
    );
    let t = Instant::now();
    let batch = b.claim(&req).await?;
    eprintln!(
        "==== explain {name}: claimed {} in {:.1} ms; completion follows ====",
        batch.records.len(),
        t.elapsed().as_secs_f64() * 1e3
    );
    let t = Instant::now();
    let r = b
        .complete(&batch.handle, &crate::scale::published(&batch))
        .await?;
    eprintln!(
        "==== explain {name}: completed {} in {:.1} ms ====",
        r.applied,
        t.elapsed().as_secs_f64() * 1e3
    );
    pool.close().await;
    env.cleanup().await?;
    Ok(())
}
