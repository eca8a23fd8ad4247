//! Claim/complete throughput of the PostgreSQL outbox store, against a naive baseline.
//!
//! ```text
//! cargo run --release -p outbox-postgres --example claim_bench -- [--events N] [--aggregates A]
//!     [--batch B] [--relays R] [--rounds K] [--explain-sizes 10000,1000000]
//! ```
//!
//! Environment: `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! `BENCH_MODES` (comma-separated subset of `naive,lease,locked,relay-lease,relay-locked`), and `BENCH_EVENTS`,
//! `BENCH_AGGREGATES`, `BENCH_BATCH`, `BENCH_RELAYS`, `BENCH_ROUNDS` (default 3),
//! `BENCH_EXPLAIN_SIZES` as alternatives to the flags. Every run uses fresh schemas and drops them afterwards.
//!
//! For each mode it preloads N events round-robin across A aggregates (so each aggregate has
//! N/A versions queued), then drains with claim(B) + complete(B published outcomes with fake
//! ack metadata) until the backlog is empty, and prints events/s. The baseline drains the same
//! table with a plain `SELECT .. FOR UPDATE SKIP LOCKED LIMIT B` + one `UPDATE` per batch: no
//! ordering, no fencing. The `relay-*` modes drain through `outbox_core::Relay::run_once` (prefetch
//! on) with a publisher that acknowledges at once: the relay's cycle minus the broker. Finally
//! it prints `EXPLAIN (ANALYZE, BUFFERS)` of the claim at each
//! size in `--explain-sizes`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, Envelope, OutboxStore, Outcome, PublishResult, Publisher,
    Relay, RelayConfig, SystemClock,
};
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::SeedableRng;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Row};

struct Args {
    events: usize,
    aggregates: usize,
    batch: usize,
    relays: usize,
    rounds: usize,
    explain_sizes: Vec<usize>,
}

fn args() -> Args {
    let mut a = Args {
        events: env("BENCH_EVENTS", 100_000),
        aggregates: env("BENCH_AGGREGATES", 10_000),
        batch: env("BENCH_BATCH", 1_000),
        relays: env("BENCH_RELAYS", 1),
        rounds: env("BENCH_ROUNDS", 3).max(1),
        explain_sizes: std::env::var("BENCH_EXPLAIN_SIZES")
            .map(|s| parse_list(&s))
            .unwrap_or_else(|_| vec![10_000, 100_000]),
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--events" => a.events = value.parse().expect("--events N"),
            "--aggregates" => a.aggregates = value.parse().expect("--aggregates A"),
            "--batch" => a.batch = value.parse().expect("--batch B"),
            "--relays" => a.relays = value.parse().expect("--relays R"),
            "--rounds" => a.rounds = value.parse::<usize>().expect("--rounds K").max(1),
            "--explain-sizes" => a.explain_sizes = parse_list(&value),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn parse_list(s: &str) -> Vec<usize> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse().expect("comma-separated sizes"))
        .collect()
}

async fn fresh_store(pool: &PgPool, mode: ClaimMode) -> PostgresOutboxStore {
    let schema = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(schema)
        .claim_mode(mode)
        .notify_channel(None)
        .build()
        .expect("store");
    store.migrate().await.expect("migrate");
    store
}

async fn drop_store(pool: &PgPool, store: &PostgresOutboxStore) {
    sqlx::query(&format!(
        "DROP SCHEMA \"{}\" CASCADE",
        store.settings().schema
    ))
    .execute(pool)
    .await
    .expect("drop schema");
}

async fn preload(store: &PostgresOutboxStore, events: usize, aggregates: usize) -> Duration {
    let started = Instant::now();
    let payload = serde_json::json!({"order": "o", "items": [1, 2, 3], "total_cents": 1999});
    let chunk = 5_000;
    let mut i = 0;
    while i < events {
        let n = chunk.min(events - i);
        let batch: Vec<Envelope> = (i..i + n)
            .map(|k| {
                Envelope::builder(
                    "order",
                    format!("o-{}", k % aggregates),
                    (k / aggregates) as i64 + 1,
                    "order.changed",
                )
                .json(&payload)
                .unwrap()
                .build()
                .unwrap()
            })
            .collect();
        store
            .append_many(store.pool(), &batch)
            .await
            .expect("append");
        i += n;
    }
    sqlx::query(&format!(
        "ANALYZE \"{}\".\"{}\"",
        store.settings().schema,
        store.settings().table
    ))
    .execute(store.pool())
    .await
    .expect("analyze");
    started.elapsed()
}

async fn drain(store: PostgresOutboxStore, batch: usize, relays: usize) -> (u64, Duration) {
    let total = Arc::new(AtomicU64::new(0));
    let claim_us = Arc::new(AtomicU64::new(0));
    let complete_us = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for r in 0..relays {
        let store = store.clone();
        let total = total.clone();
        let (claim_us, complete_us) = (claim_us.clone(), complete_us.clone());
        tasks.push(tokio::spawn(async move {
            let req = ClaimRequest::new(format!("bench-{r}"), batch);
            let mut offset = 0i64;
            let mut idle = 0;
            loop {
                let t0 = Instant::now();
                let claimed = store.claim(&req).await.expect("claim");
                claim_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                if claimed.is_empty() {
                    // Another relay may hold the last heads; stop after a few empty claims.
                    idle += 1;
                    if idle > 20 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                let outcomes: Vec<Outcome> = claimed
                    .records
                    .iter()
                    .map(|rec| {
                        offset += 1;
                        Outcome::Published {
                            event_id: rec.envelope.event_id,
                            ack: AckMetadata {
                                topic: "bench".into(),
                                partition: (offset % 12) as i32,
                                offset,
                            },
                        }
                    })
                    .collect();
                let t0 = Instant::now();
                let report = store
                    .complete(&claimed.handle, &outcomes)
                    .await
                    .expect("complete");
                complete_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                assert_eq!(report.superseded, 0);
                total.fetch_add(report.applied as u64, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("relay task");
    }
    let elapsed = started.elapsed() - Duration::from_millis(5 * 21);
    println!(
        "    time in claim {:.2} s, in complete {:.2} s (summed over relays)",
        claim_us.load(Ordering::Relaxed) as f64 / 1e6,
        complete_us.load(Ordering::Relaxed) as f64 / 1e6
    );
    (total.load(Ordering::Relaxed), elapsed)
}

/// A publisher that acknowledges every record at once (offsets count up): what remains of a
/// relay cycle is the store's work.
struct InstantAcks(AtomicU64);

#[async_trait::async_trait]
impl Publisher for InstantAcks {
    async fn publish(&self, batch: &[Envelope]) -> Vec<PublishResult> {
        batch
            .iter()
            .map(|_| {
                let offset = self.0.fetch_add(1, Ordering::Relaxed) as i64;
                Ok(AckMetadata {
                    topic: "bench".into(),
                    partition: (offset % 12) as i32,
                    offset,
                })
            })
            .collect()
    }
    fn delivery_timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
}

/// `outbox_core::Relay::run_once` (prefetch on: the next claim overlaps the completion) over
/// the store, with instant acknowledgements.
async fn drain_relay(store: PostgresOutboxStore, batch: usize, relays: usize) -> (u64, Duration) {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for r in 0..relays {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let config = RelayConfig::builder()
                .owner(format!("bench-relay-{r}"))
                .batch_size(batch)
                .prefetch(true)
                .build()
                .expect("relay config");
            let mut relay = Relay::new(
                store,
                InstantAcks(AtomicU64::new(0)),
                config,
                Arc::new(SystemClock),
                Box::new(StdRng::seed_from_u64(r as u64)),
            )
            .expect("relay");
            let (mut published, mut idle) = (0u64, 0);
            while idle <= 20 {
                let report = relay.run_once().await.expect("relay cycle");
                if report.claimed == 0 {
                    idle += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                idle = 0;
                assert_eq!(report.superseded, 0);
                published += report.published as u64;
            }
            relay.release_prefetched().await.expect("release");
            published
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("relay task");
    }
    (total, started.elapsed() - Duration::from_millis(5 * 21))
}

/// The naive baseline: SKIP LOCKED claim + one UPDATE with ack metadata, no ordering.
async fn drain_naive(store: PostgresOutboxStore, batch: usize, relays: usize) -> (u64, Duration) {
    let t = format!(
        "\"{}\".\"{}\"",
        store.settings().schema,
        store.settings().table
    );
    let select = format!(
        "SELECT id, event_id, aggregate_type, aggregate_id, aggregate_version, event_type, \
                schema_version, content_type, payload, headers, created_at \
         FROM {t} WHERE status = 'pending' AND NOT blocked \
         ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let update = format!(
        "UPDATE {t} x SET status = 'published', published_at = clock_timestamp(), \
                finished_at = clock_timestamp(), ack_topic = 'bench', ack_partition = u.p, \
                ack_offset = u.o \
         FROM UNNEST($1::int8[], $2::int4[], $3::int8[]) AS u(id, p, o) WHERE x.id = u.id"
    );
    let total = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..relays {
        let pool = store.pool().clone();
        let (select, update, total) = (select.clone(), update.clone(), total.clone());
        tasks.push(tokio::spawn(async move {
            let mut offset = 0i64;
            loop {
                let mut tx = pool.begin().await.unwrap();
                let rows = sqlx::query(&select)
                    .bind(batch as i64)
                    .fetch_all(&mut *tx)
                    .await
                    .unwrap();
                if rows.is_empty() {
                    break;
                }
                let mut ids = Vec::with_capacity(rows.len());
                let mut parts = Vec::with_capacity(rows.len());
                let mut offs = Vec::with_capacity(rows.len());
                for row in &rows {
                    // Decode what a relay would publish.
                    let _payload: Vec<u8> = row.get("payload");
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
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                total.fetch_add(ids.len() as u64, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await.expect("naive task");
    }
    (total.load(Ordering::Relaxed), started.elapsed())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let pool = PgPoolOptions::new()
        .max_connections(4 + a.relays as u32 * 2)
        .connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"));
    println!(
        "claim_bench: {} events over {} aggregates ({} per aggregate), batch {}, {} relay(s)",
        a.events,
        a.aggregates,
        a.events.div_ceil(a.aggregates.max(1)),
        a.batch,
        a.relays
    );
    let lease = ClaimMode::Lease {
        duration: Duration::from_secs(30),
    };
    // (name, store mode (None: naive), through the relay with prefetch)
    let modes: [(&str, Option<ClaimMode>, bool); 5] = [
        ("naive SKIP LOCKED + UPDATE (no ordering)", None, false),
        (
            "lease (head-of-line, fencing, ack metadata)",
            Some(lease),
            false,
        ),
        (
            "locked transaction (head-of-line, ack metadata)",
            Some(ClaimMode::LockedTransaction),
            false,
        ),
        ("relay-lease (Relay::run_once, prefetch)", Some(lease), true),
        (
            "relay-locked (Relay::run_once, prefetch)",
            Some(ClaimMode::LockedTransaction),
            true,
        ),
    ];
    // BENCH_MODES=naive,lease,locked,relay-lease,relay-locked (default: all).
    let only = std::env::var("BENCH_MODES").ok();
    let wanted = |name: &str| {
        let short = name.split_whitespace().next().unwrap_or_default();
        only.as_deref()
            .is_none_or(|m| m.split(',').any(|w| w.trim() == short))
    };
    let modes: Vec<_> = modes
        .into_iter()
        .filter(|(name, ..)| wanted(name))
        .collect();
    // Rounds alternate the modes, so a slow phase of the machine (a checkpoint, autovacuum, a
    // neighbour) hits all of them; the summary gives each mode's median and its ratio to the
    // naive median.
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 1..=a.rounds {
        if a.rounds > 1 {
            println!("-- round {round}/{}", a.rounds);
        }
        for (i, (name, mode, via_relay)) in modes.iter().enumerate() {
            let store = fresh_store(&pool, mode.unwrap_or(ClaimMode::LockedTransaction)).await;
            let load = preload(&store, a.events, a.aggregates).await;
            let (n, elapsed) = match mode {
                None => drain_naive(store.clone(), a.batch, a.relays).await,
                Some(_) if *via_relay => drain_relay(store.clone(), a.batch, a.relays).await,
                Some(_) => drain(store.clone(), a.batch, a.relays).await,
            };
            let rate = n as f64 / elapsed.as_secs_f64();
            let left: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM \"{}\".\"{}\" WHERE status <> 'published'",
                store.settings().schema,
                store.settings().table
            ))
            .fetch_one(&pool)
            .await
            .unwrap();
            assert_eq!(left, 0, "{name}: events left unpublished");
            println!(
                "{name:<50} drained {n:>8} in {:>7.2} s = {:>8.0} events/s \
                 (preload {:.1} s = {:.0} appends/s)",
                elapsed.as_secs_f64(),
                rate,
                load.as_secs_f64(),
                a.events as f64 / load.as_secs_f64()
            );
            rates[i].push(rate);
            drop_store(&pool, &store).await;
        }
    }
    let medians: Vec<f64> = rates.iter_mut().map(|r| median(r)).collect();
    let naive = modes
        .iter()
        .position(|(_, m, _)| m.is_none())
        .map(|i| medians[i]);
    println!("\nmedian of {} round(s):", a.rounds);
    for ((name, ..), m) in modes.iter().zip(&medians) {
        let ratio = naive.map_or(String::new(), |b| format!("  {:.2} x naive", m / b));
        println!("  {name:<50} {m:>8.0} events/s{ratio}");
    }
    for size in a.explain_sizes {
        for mode in [
            ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
            ClaimMode::LockedTransaction,
        ] {
            let store = fresh_store(&pool, mode).await;
            preload(&store, size, a.aggregates.min(size)).await;
            let plans = store.explain_claim(a.batch).await.expect("explain");
            println!(
                "\n=== EXPLAIN claim, {size} rows, {mode:?}, limit {} ===",
                a.batch
            );
            println!(
                "--- statement 1: candidates, locks, head check, claim ---\n{}",
                plans[0]
            );
            println!(
                "--- statement 2: the re-check, as if every candidate needed it ---\n{}",
                plans[1]
            );
            drop_store(&pool, &store).await;
        }
    }
}
