//! Indexes: which of the outbox table's indexes each statement of the store reads, and what
//! an operation costs when one index is gone (issue 25: an append should write the fewest
//! index entries; keep only those a claim or an operator query cannot do without).
//!
//! For each variant (all indexes, then each secondary index dropped in turn) a table is filled
//! as `outbox-bench status` fills it (mostly published rows over the last 24 hours, pending
//! rows, parked heads with their later versions behind them, the state rows), then every
//! operation of the store runs once, in an order that leaves each the rows it needs: append,
//! claim and its completions (published, retry, park, release), the metrics snapshot, the
//! reads of `outbox status`, reconciliation and replay, the operator actions on parked events,
//! cleanup. Around each operation the server's own counters (`pg_stat_user_indexes.idx_scan`
//! and `pg_stat_user_tables.seq_scan` of the outbox table) are read: which index a plan used
//! is read from the server, not guessed from the SQL. The store runs on a pool of one
//! connection, whose backend is told to report its counters at its next idle moment
//! (`pg_stat_force_next_flush()`, PostgreSQL 15) before each reading; otherwise a backend
//! that reported less than a second ago holds them for ten seconds. A dropped index shows as
//! the operations that fell back to another index or to a sequential scan, and their time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clap::Args;
use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, ParkKind, ParkReason,
    PublishedFilter,
};
use outbox_postgres::PostgresOutboxStore;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

use crate::env::Env;
use crate::report::{Report, Samples};
use crate::scale::published;

/// Options of `outbox-bench indexes`.
#[derive(Debug, Clone, Args)]
pub(crate) struct IndexesArgs {
    /// Rows in the table (mostly published).
    #[arg(long, default_value_t = 200_000)]
    rows: usize,
    /// Pending rows (the claims consume some).
    #[arg(long, default_value_t = 5_000)]
    pending: usize,
    /// Parked heads (each with later versions behind it).
    #[arg(long, default_value_t = 50)]
    parked: usize,
    /// Variants (comma-separated): `all` (every index) and the names of indexes to drop one
    /// at a time; default `all` and each secondary index.
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// Wait for the store's backend to report its counters before each reading, ms.
    #[arg(long, default_value_t = 300)]
    settle_ms: u64,
}

/// The outbox table's secondary indexes after every migration (the primary key stays).
pub(crate) const SECONDARY: [&str; 8] = [
    "outbox_events_event_id_key",
    "outbox_events_claim_idx",
    "outbox_events_unfinished_idx",
    "outbox_events_blocked_idx",
    "outbox_events_parked_idx",
    "outbox_events_finished_idx",
    "outbox_events_created_at_idx",
    "outbox_events_held_idx",
];

/// What the server counted for one operation.
#[derive(Default)]
struct Counted {
    ms: f64,
    seq_scans: i64,
    index_scans: BTreeMap<String, i64>,
}

/// Runs the indexes scenario.
pub(crate) async fn run(env: &Env, args: &IndexesArgs, rounds: usize) -> anyhow::Result<Report> {
    let variants: Vec<String> = if args.variants.is_empty() {
        std::iter::once("all".to_owned())
            .chain(SECONDARY.iter().map(|s| (*s).to_owned()))
            .collect()
    } else {
        args.variants.clone()
    };
    let mut report = Report::new("indexes", rounds);
    report.param("rows", args.rows);
    report.param("pending", args.pending);
    report.param("parked", args.parked);
    report.param("variants", &variants);
    let mut samples = Samples::default();
    let mut used: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    for round in 0..rounds {
        for variant in &variants {
            // One connection: the backend whose counters are flushed before each reading.
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(Duration::from_secs(60))
                .connect(&env.database_url)
                .await?;
            let store = PostgresOutboxStore::builder(pool.clone())
                .schema(env.schema("indexes").await?)
                .claim_mode(ClaimMode::Lease {
                    duration: Duration::from_secs(60),
                })
                .notify_channel(None)
                .build()?;
            store.migrate().await?;
            let aggregates = (args.rows / 100).max(args.parked + 1);
            crate::status::fill(&store, args.rows, args.pending, args.parked, aggregates).await?;
            if variant != "all" {
                let s = store.settings();
                crate::append::drop_index(store.pool(), &s.schema, variant).await?;
            }
            let counted =
                operations(&store, &env.pool, Duration::from_millis(args.settle_ms)).await?;
            println!("round {}/{rounds}  variant {variant}", round + 1);
            for (op, c) in &counted {
                let scans: Vec<String> = c
                    .index_scans
                    .iter()
                    .map(|(i, n)| format!("{}×{n}", short(i)))
                    .collect();
                println!(
                    "  {op:<34} {:>8.2} ms  seq scans {:>2}  index scans: {}",
                    c.ms,
                    c.seq_scans,
                    if scans.is_empty() {
                        "-".to_owned()
                    } else {
                        scans.join(", ")
                    }
                );
                let name = format!("{op} [{variant}]");
                samples.add(&name, "ms", c.ms);
                samples.add(&name, "seq scans", c.seq_scans as f64);
                if variant != "all" {
                    samples.compare(&name, "ms", &format!("{op} [all]"));
                }
                if variant == "all" && round == 0 {
                    used.insert(op.clone(), c.index_scans.clone());
                }
            }
            pool.close().await;
            env.cleanup().await?;
        }
    }
    // Which operation read which index (with every index there, first round).
    let mut by_index: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (op, scans) in &used {
        for index in scans.keys() {
            by_index.entry(index.clone()).or_default().push(op.clone());
        }
    }
    println!("\nread by (all indexes present):");
    for index in std::iter::once("outbox_events_pkey").chain(SECONDARY) {
        let ops = by_index.get(index).map(|v| v.join(", "));
        println!(
            "  {:<30} {}",
            short(index),
            ops.as_deref().unwrap_or("(no operation)")
        );
    }
    report.details.insert(
        "index_scans_by_operation".to_owned(),
        serde_json::to_value(&used)?,
    );
    report.details.insert(
        "operations_by_index".to_owned(),
        serde_json::to_value(&by_index)?,
    );
    report.figures = samples.figures();
    Ok(report)
}

fn short(index: &str) -> &str {
    index.strip_prefix("outbox_events_").unwrap_or(index)
}

/// The index and sequential scans of the outbox table so far, as the server counts them:
/// the store's backend reports them first (read on another connection after `settle`).
async fn counters(
    store: &PostgresOutboxStore,
    reader: &PgPool,
    settle: Duration,
) -> anyhow::Result<(i64, BTreeMap<String, i64>)> {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(store.pool())
        .await?;
    tokio::time::sleep(settle).await;
    let s = store.settings();
    let seq: i64 = sqlx::query_scalar(
        "SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2",
    )
    .bind(&s.schema)
    .bind(&s.table)
    .fetch_one(reader)
    .await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT indexrelname::text, idx_scan FROM pg_stat_user_indexes \
         WHERE schemaname = $1 AND relname = $2",
    )
    .bind(&s.schema)
    .bind(&s.table)
    .fetch_all(reader)
    .await?;
    Ok((seq, rows.into_iter().collect()))
}

/// Every operation once, each between two readings of the counters.
async fn operations(
    store: &PostgresOutboxStore,
    reader: &PgPool,
    settle: Duration,
) -> anyhow::Result<Vec<(String, Counted)>> {
    let mut out: Vec<(String, Counted)> = Vec::new();
    let owner = "indexes-bench";
    let retention = Duration::from_secs(12 * 3600);
    let grace = Duration::from_secs(60);
    let now = chrono::Utc::now();
    let mut f = PublishedFilter::default();
    f.event_type = Some("order.changed".to_owned());
    f.since = Some(now - chrono::Duration::minutes(30));
    f.until = Some(now);
    // One operation between two readings of the counters (what set it up is not counted).
    macro_rules! op {
        ($name:expr, $body:expr) => {{
            let before = counters(store, reader, settle).await?;
            let t = Instant::now();
            let value = $body;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let after = counters(store, reader, settle).await?;
            let index_scans = after
                .1
                .iter()
                .filter_map(|(i, n)| {
                    let d = n - before.1.get(i).copied().unwrap_or(0);
                    (d > 0).then(|| (i.clone(), d))
                })
                .collect();
            out.push((
                $name.to_owned(),
                Counted {
                    ms,
                    seq_scans: after.0 - before.0,
                    index_scans,
                },
            ));
            value
        }};
    }
    let event = Envelope::builder("order", "order-new", 1, "order.changed")
        .json(&crate::env::payload(0))
        .and_then(|b| b.build())?;
    op!(
        "append 1 event",
        store
            .append_many(store.pool(), std::slice::from_ref(&event))
            .await?
    );
    let req = ClaimRequest::new(owner, 100);
    let b = op!("claim 100 (lease)", store.claim(&req).await?);
    anyhow::ensure!(!b.is_empty(), "nothing claimed");
    op!(
        "complete 100: published",
        store.complete(&b.handle, &published(&b)).await?
    );
    let error = |class| LastError {
        class,
        kind: "other".to_owned(),
        message: "bench".to_owned(),
    };
    let b = store.claim(&req).await?;
    let retry: Vec<Outcome> = b
        .records
        .iter()
        .map(|r| Outcome::Retry {
            event_id: r.envelope.event_id,
            delay: Duration::from_secs(3600),
            error: error(ErrorClass::Transient),
        })
        .collect();
    op!(
        "complete 100: retry",
        store.complete(&b.handle, &retry).await?
    );
    let b = store.claim(&ClaimRequest::new(owner, 10)).await?;
    let park: Vec<Outcome> = b
        .records
        .iter()
        .map(|r| Outcome::Park {
            event_id: r.envelope.event_id,
            reason: ParkReason {
                kind: ParkKind::PermanentError,
                error: error(ErrorClass::Permanent),
            },
        })
        .collect();
    op!("complete 10: park", store.complete(&b.handle, &park).await?);
    let b = store.claim(&req).await?;
    op!("release 100", store.release(&b.handle).await?);
    let b = store.claim(&req).await?;
    op!(
        "release_claims_of (operator)",
        store.release_claims_of(owner, "bench").await?
    );
    drop(b);
    op!("stats()", store.stats().await?);
    op!(
        "publish_latency(15 min)",
        ReportingStore::publish_latency(store, Duration::from_secs(900)).await?
    );
    op!(
        "cleanup_candidates",
        store.cleanup_candidates(retention).await?
    );
    op!(
        "count_published (time filter)",
        store.count_published(&f).await?
    );
    op!(
        "published_events (replay)",
        store.published_events(&f, None, 100).await?
    );
    op!(
        "interval_counts (reconcile)",
        store
            .interval_counts(
                now - chrono::Duration::minutes(30),
                Duration::from_secs(60),
                grace
            )
            .await?
    );
    op!(
        "published_ids (reconcile)",
        store
            .published_ids(
                "order.changed",
                now - chrono::Duration::minutes(30),
                now,
                &[],
                grace
            )
            .await?
    );
    let parked = op!("list_parked 100", store.list_parked(100).await?);
    anyhow::ensure!(parked.len() >= 3, "too few parked events");
    let id = |k: usize| parked[k].envelope.event_id;
    op!("parked_event", store.parked_event(id(0)).await?);
    op!("retry_parked", store.retry_parked(id(0), "bench").await?);
    op!(
        "discard_parked",
        store.discard_parked(id(1), "bench", "bench").await?
    );
    op!(
        "reissue_parked",
        store.reissue_parked(id(2), "bench", "bench").await?
    );
    op!("audit_trail", store.audit_trail(None).await?);
    op!(
        "cleanup (12 h retention)",
        store.cleanup(retention, 1000).await?
    );
    Ok(out)
}
