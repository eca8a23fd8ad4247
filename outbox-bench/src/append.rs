//! Append overhead: a business transaction (update the order row, insert one order line) with no
//! outbox append (the reference), with one, and with ten, at 1 and 8 clients; the wake-up
//! variants side by side (the gate, a `NOTIFY` in every append, no channel), with and without a
//! relay running against the same table.
//!
//! Beside them, the append alone against a bare insert (issue 25: one append within 1.1 x the
//! cost of a bare insert of the same row into a table with only a primary key): a transaction
//! that does nothing but the store's append of one event, and one that does nothing but a plain
//! `INSERT .. VALUES` of the same row (the same columns, the same values, `inserted_at` from the
//! same clock) into a table whose only index is its primary key; the same two writes inside the
//! business transaction; and experiments that drop the outbox table's indexes one at a time
//! (what each index costs the append).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use outbox_core::{ClaimMode, Envelope, Relay, RelayConfig, SystemClock};
use outbox_postgres::PostgresOutboxStore;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::postgres::PgPoolOptions;

use crate::drain::InstantAcks;
use crate::env::{self, Env};
use crate::indexes::SECONDARY;
use crate::report::{quantile_ms, Report, Samples};

/// Options of `outbox-bench append`.
#[derive(Debug, Clone, Args)]
pub(crate) struct AppendArgs {
    /// Client counts (concurrent connections running the business transaction).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub(crate) clients: Vec<usize>,
    /// Measured seconds per contender and round (after the warm-up).
    #[arg(long, default_value_t = 5.0)]
    pub(crate) seconds: f64,
    /// Warm-up seconds per contender and round (not counted).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) warmup: f64,
    /// Order rows the transactions pick from at random.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) orders: usize,
    /// Only these contenders (ids, comma-separated; default all): none, gate, notify,
    /// no-channel, gate-10, gate-relay, notify-relay, gate-no-created-idx, gate-bare, bare,
    /// bare-outbox, only, only-no-created-idx, only-no-event-id-key, only-no-claim-idx,
    /// only-no-unfinished-idx, only-no-entry-free-idx, only-pk. On a mysql:// URL: none, bare,
    /// append, bare-10, append-10.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Contender {
    id: &'static str,
    label: &'static str,
    /// The business statements (update one order, insert one order line) run before the
    /// outbox row; without them the transaction writes the outbox row only.
    business: bool,
    /// Outbox events appended per transaction.
    appends: usize,
    /// Where the outbox rows go.
    write: Write,
    wake: Wake,
    /// A relay (instant acknowledgements, the driver with the listener) runs meanwhile.
    relay: bool,
    /// Experiment: these indexes of the outbox table are dropped before the run (what each
    /// costs the append).
    drop_indexes: &'static [&'static str],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Write {
    /// The store's `append_many`.
    Store,
    /// A plain `INSERT .. VALUES` of the same row into a table with only a primary key.
    Bare,
    /// The same plain `INSERT .. VALUES` into the outbox table itself (its indexes, checks and
    /// defaults): what the store's statement adds beyond the table.
    BareOutbox,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    Gate,
    NotifyEach,
    NoChannel,
}

const CONTENDERS: [Contender; 20] = [
    Contender {
        id: "none",
        label: "no append (reference)",
        business: true,
        appends: 0,
        write: Write::Store,
        wake: Wake::NoChannel,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "gate",
        label: "1 append, wake-up gate (default)",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::Gate,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "notify",
        label: "1 append, NOTIFY in every append",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::NotifyEach,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "no-channel",
        label: "1 append, no NOTIFY channel",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::NoChannel,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "gate-10",
        label: "10 appends, wake-up gate",
        business: true,
        appends: 10,
        write: Write::Store,
        wake: Wake::Gate,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "gate-relay",
        label: "1 append, gate, relay running",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::Gate,
        relay: true,
        drop_indexes: &[],
    },
    Contender {
        id: "notify-relay",
        label: "1 append, NOTIFY each, relay running",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::NotifyEach,
        relay: true,
        drop_indexes: &[],
    },
    Contender {
        id: "gate-no-created-idx",
        label: "1 append, gate, without created_at index",
        business: true,
        appends: 1,
        write: Write::Store,
        wake: Wake::Gate,
        relay: false,
        drop_indexes: &["outbox_events_created_at_idx"],
    },
    Contender {
        id: "gate-bare",
        label: "bare INSERT of the row, PK-only table",
        business: true,
        appends: 1,
        write: Write::Bare,
        wake: Wake::NoChannel,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "bare",
        label: "alone: bare INSERT of the row, PK-only table (reference)",
        business: false,
        appends: 1,
        write: Write::Bare,
        wake: Wake::NoChannel,
        relay: false,
        drop_indexes: &[],
    },
    Contender {
        id: "bare-outbox",
        label: "alone: bare INSERT of the row into the outbox table",
        business: false,
        appends: 1,
        write: Write::BareOutbox,
        wake: Wake::NoChannel,
        relay: false,
        drop_indexes: &[],
    },
    only("only", "alone: 1 append, gate (default store)", &[]),
    only(
        "only-no-created-idx",
        "alone: 1 append, without created_at_idx",
        &["outbox_events_created_at_idx"],
    ),
    only(
        "only-no-event-id-key",
        "alone: 1 append, without the event_id unique key",
        &["outbox_events_event_id_key"],
    ),
    only(
        "only-no-claim-idx",
        "alone: 1 append, without claim_idx",
        &["outbox_events_claim_idx"],
    ),
    only(
        "only-no-unfinished-idx",
        "alone: 1 append, without unfinished_idx",
        &["outbox_events_unfinished_idx"],
    ),
    only(
        "only-no-entry-free-idx",
        "alone: 1 append, without blocked/parked/finished/held",
        &ENTRY_FREE_INDEXES,
    ),
    only(
        "only-no-checks",
        "alone: 1 append, without the CHECK constraints",
        &CHECKS,
    ),
    only(
        "only-pk-no-checks",
        "alone: 1 append, primary key only, no CHECK constraints",
        &SECONDARY_AND_CHECKS,
    ),
    only("only-pk", "alone: 1 append, primary key only", &SECONDARY),
];

/// Every index of the outbox table but its primary key, and its CHECK constraints.
const SECONDARY_AND_CHECKS: [&str; 12] = concat(SECONDARY, CHECKS);

/// `a` then `b` (`C` must be their total length).
const fn concat<const A: usize, const B: usize, const C: usize>(
    a: [&'static str; A],
    b: [&'static str; B],
) -> [&'static str; C] {
    assert!(A + B == C);
    let mut out = [""; C];
    let mut i = 0;
    while i < C {
        out[i] = if i < A { a[i] } else { b[i - A] };
        i += 1;
    }
    out
}

/// The outbox table's CHECK constraints (an experiment: what they cost a one-row statement,
/// which parses, simplifies and compiles each of them again at every execution).
const CHECKS: [&str; 4] = [
    "outbox_events_aggregate_version_check",
    "outbox_events_schema_version_check",
    "outbox_events_status_check",
    "outbox_events_published_has_ack",
];

/// The partial indexes whose predicate a new row never matches: an append writes no entry to
/// them, only evaluates their predicates.
const ENTRY_FREE_INDEXES: [&str; 4] = [
    "outbox_events_blocked_idx",
    "outbox_events_parked_idx",
    "outbox_events_finished_idx",
    "outbox_events_held_idx",
];

/// The reference and the append it is held against: nothing but the outbox row.
const BARE: &str = "bare";
const ONLY: &str = "only";

/// An append-alone contender (the default store), without `drop_indexes` (an experiment).
const fn only(
    id: &'static str,
    label: &'static str,
    drop_indexes: &'static [&'static str],
) -> Contender {
    Contender {
        id,
        label,
        business: false,
        appends: 1,
        write: Write::Store,
        wake: Wake::Gate,
        relay: false,
        drop_indexes,
    }
}

struct Outcome {
    txns: u64,
    seconds: f64,
    latencies: Vec<Duration>,
    notifies: u64,
}

/// Runs the append scenario.
pub(crate) async fn run(env: &Env, args: &AppendArgs, rounds: usize) -> anyhow::Result<Report> {
    let contenders: Vec<Contender> = CONTENDERS
        .into_iter()
        .filter(|c| args.only.is_empty() || args.only.iter().any(|o| o == c.id))
        .collect();
    anyhow::ensure!(!contenders.is_empty(), "no contender selected");
    let mut report = Report::new("append", rounds);
    report.param("clients", &args.clients);
    report.param("seconds", args.seconds);
    report.param("warmup", args.warmup);
    report.param("orders", args.orders);
    report.param("payload_bytes", serde_json::to_vec(&env::payload(0))?.len());
    report.param(
        "transaction",
        "BEGIN; UPDATE orders (one row, random); INSERT order_lines (one row); \
         [append_many(N events) | bare INSERT of the row]; COMMIT",
    );
    report.param(
        "transaction_alone",
        "BEGIN; [append_many(1 event) | bare INSERT of the row into a table with only a \
         primary key]; COMMIT",
    );
    let mut samples = Samples::default();
    for round in 0..rounds {
        for &clients in &args.clients {
            let n = contenders.len();
            for k in 0..n {
                let c = contenders[(k + round) % n];
                let name = format!("{} [{clients} clients]", c.label);
                let o = run_one(env, args, c, clients)
                    .await
                    .with_context(|| format!("round {}: {name}", round + 1))?;
                env.cleanup().await?;
                let mut lat = o.latencies;
                lat.sort_unstable();
                let tps = o.txns as f64 / o.seconds;
                let (p50, p99) = (quantile_ms(&lat, 0.5), quantile_ms(&lat, 0.99));
                println!(
                    "round {}/{rounds}  {name:<52} {tps:>8.0} txn/s  p50 {p50:>6.2} ms  p99 {p99:>6.2} ms  notifies/txn {:.2}",
                    round + 1,
                    o.notifies as f64 / o.txns.max(1) as f64
                );
                samples.add(&name, "txn/s", tps);
                samples.add(&name, "p50 ms", p50);
                samples.add(&name, "p99 ms", p99);
                samples.add(
                    &name,
                    "notifies/txn",
                    o.notifies as f64 / o.txns.max(1) as f64,
                );
            }
        }
    }
    for &clients in &args.clients {
        let named = |id: &str| {
            let c = CONTENDERS.iter().find(|c| c.id == id).expect("a contender");
            format!("{} [{clients} clients]", c.label)
        };
        let reference = named("none");
        for c in &contenders {
            // Business transactions against the one without an outbox row; the outbox row
            // alone against its bare insert.
            let against = match (c.business, c.id) {
                (true, "none") | (false, BARE) => continue,
                (true, _) => named("none"),
                (false, _) => named(BARE),
            };
            let name = format!("{} [{clients} clients]", c.label);
            for metric in ["txn/s", "p50 ms", "p99 ms"] {
                samples.compare(&name, metric, &against);
            }
        }
        let ratio = |id: &str, metric: &str| {
            let a = samples.median(&named(id), metric)?;
            let b = samples.median(&reference, metric)?;
            Some(a / b)
        };
        // Cost = time per transaction = 1 / (txn/s): the append's cost over the bare
        // insert's is the bare insert's txn/s over the append's.
        let cost = |id: &str, against: &str| {
            let a = samples.median(&named(id), "txn/s")?;
            let b = samples.median(&named(against), "txn/s")?;
            Some(b / a)
        };
        report.target(
            &format!(
                "[{clients} clients] 1 append alone: cost (1 / txn/s) / bare INSERT's <= 1.10"
            ),
            cost(ONLY, BARE),
            1.10,
            false,
        );
        report.target(
            &format!(
                "[{clients} clients] business + 1 append: cost / business + bare INSERT's <= 1.10"
            ),
            cost("gate", "gate-bare"),
            1.10,
            false,
        );
        report.target(
            &format!("[{clients} clients] 1 append (default store): p50 / reference <= 1.10"),
            ratio("gate", "p50 ms"),
            1.10,
            false,
        );
        report.target(
            &format!("[{clients} clients] 1 append (default store): txn/s / reference >= 0.90"),
            ratio("gate", "txn/s"),
            0.90,
            true,
        );
    }
    report.figures = samples.figures();
    Ok(report)
}

async fn run_one(
    env: &Env,
    args: &AppendArgs,
    c: Contender,
    clients: usize,
) -> anyhow::Result<Outcome> {
    let schema = env.schema("append").await?;
    let pool = PgPoolOptions::new()
        .max_connections(clients as u32 + 4)
        .connect(&env.database_url)
        .await?;
    let mut b = PostgresOutboxStore::builder(pool.clone())
        .schema(&schema)
        .claim_mode(ClaimMode::Lease {
            duration: Duration::from_secs(30),
        });
    b = match c.wake {
        Wake::Gate => b.wake_gate(true),
        Wake::NotifyEach => b.wake_gate(false),
        Wake::NoChannel => b.notify_channel(None),
    };
    let store = b.build()?;
    store.migrate().await?;
    for index in c.drop_indexes {
        drop_index(&pool, &schema, index).await?;
    }
    // The bare insert's table: the columns the append writes, no default, no check, no index
    // but its primary key (an identity, as the outbox table's).
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{schema}\".bare_outbox (\
           id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL, \
           aggregate_type text NOT NULL, aggregate_id text NOT NULL, \
           aggregate_version bigint NOT NULL, event_type text NOT NULL, \
           schema_version integer NOT NULL, content_type text NOT NULL, payload bytea NOT NULL, \
           headers jsonb NOT NULL, created_at timestamptz NOT NULL, \
           inserted_at timestamptz NOT NULL)"
    ))
    .execute(&pool)
    .await?;
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{schema}\".orders (id bigint PRIMARY KEY, total_cents bigint NOT NULL, \
             version bigint NOT NULL, updated_at timestamptz NOT NULL); \
         INSERT INTO \"{schema}\".orders SELECT g, 0, 0, now() FROM generate_series(1, {}) g; \
         CREATE TABLE \"{schema}\".order_lines (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
             order_id bigint NOT NULL, sku text NOT NULL, qty integer NOT NULL, \
             price_cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now()); \
         CREATE INDEX ON \"{schema}\".order_lines (order_id);",
        args.orders
    ))
    .execute(&pool)
    .await?;
    sqlx::raw_sql(&format!("VACUUM ANALYZE \"{schema}\".orders"))
        .execute(&pool)
        .await?;

    // The relay, when the contender has one: the real driver with the listener.
    let stop = Arc::new(tokio::sync::Notify::new());
    let relay_task = if c.relay {
        let wake = Arc::new(tokio::sync::Notify::new());
        let listener = store.spawn_listener(wake.clone())?;
        let relay = Relay::new(
            store.clone(),
            Arc::new(InstantAcks::default()),
            RelayConfig::builder().owner("bench-relay").build()?,
            Arc::new(SystemClock),
            Box::new(StdRng::seed_from_u64(1)),
        )?;
        let stop = stop.clone();
        Some((
            listener,
            tokio::spawn(outbox_core::driver::run(relay, Some(wake), async move {
                stop.notified().await;
            })),
        ))
    } else {
        None
    };

    let update = format!(
        "UPDATE \"{schema}\".orders SET total_cents = total_cents + $2, version = version + 1, \
         updated_at = now() WHERE id = $1 RETURNING version"
    );
    let insert = format!(
        "INSERT INTO \"{schema}\".order_lines (order_id, sku, qty, price_cents) VALUES ($1, $2, $3, $4)"
    );
    // The same row the store's append writes: its columns, its values (the headers as the
    // store serializes them), `inserted_at` from the statement's clock as the append takes it.
    let bare = format!(
        "INSERT INTO \"{schema}\".{} (event_id, aggregate_type, aggregate_id, \
           aggregate_version, event_type, schema_version, content_type, payload, headers, \
           created_at, inserted_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10, clock_timestamp())",
        if c.write == Write::BareOutbox {
            format!("\"{}\"", store.settings().table)
        } else {
            "bare_outbox".to_owned()
        }
    );
    let measuring = Arc::new(AtomicBool::new(false));
    let running = Arc::new(AtomicBool::new(true));
    let txns = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for client in 0..clients {
        let (pool, store) = (pool.clone(), store.clone());
        let (update, insert, bare) = (update.clone(), insert.clone(), bare.clone());
        let (measuring, running, txns) = (measuring.clone(), running.clone(), txns.clone());
        let (orders, appends) = (args.orders, c.appends);
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(client as u64);
            let mut latencies = Vec::new();
            let mut i = client;
            while running.load(Ordering::Relaxed) {
                let order = rng.random_range(1..=orders as i64);
                let started = Instant::now();
                let mut tx = pool.begin().await?;
                // Without the business statements there is no order version to follow: the
                // client's own count stands in (no constraint reads it).
                let version = if c.business {
                    let version: i64 = sqlx::query_scalar(&update)
                        .bind(order)
                        .bind(199i64)
                        .fetch_one(&mut *tx)
                        .await?;
                    sqlx::query(&insert)
                        .bind(order)
                        .bind("SKU-0042")
                        .bind(1i32)
                        .bind(199i64)
                        .execute(&mut *tx)
                        .await?;
                    version
                } else {
                    i as i64 + 1
                };
                if appends > 0 {
                    let events: Vec<Envelope> = (0..appends)
                        .map(|k| {
                            Envelope::builder(
                                "order",
                                format!("order-{order}"),
                                (version - 1) * appends as i64 + k as i64 + 1,
                                "order.line_added",
                            )
                            .json(&env::payload(i))
                            .and_then(|b| b.build())
                            .expect("valid envelope")
                        })
                        .collect();
                    match c.write {
                        Write::Store => store.append_many(&mut *tx, &events).await?,
                        Write::Bare | Write::BareOutbox => {
                            for e in &events {
                                sqlx::query(&bare)
                                    .bind(e.event_id.as_uuid())
                                    .bind(&e.aggregate_type)
                                    .bind(&e.aggregate_id)
                                    .bind(e.aggregate_version)
                                    .bind(&e.event_type)
                                    .bind(e.schema_version)
                                    .bind(&e.payload.content_type)
                                    .bind(&e.payload.bytes)
                                    .bind(serde_json::to_string(&e.headers)?)
                                    .bind(e.created_at)
                                    .execute(&mut *tx)
                                    .await?;
                            }
                        }
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
    let notifies_before = store.notifications_raised();
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    let measured = txns.load(Ordering::Relaxed);
    let notifies = store.notifications_raised() - notifies_before;
    running.store(false, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    if let Some((listener, task)) = relay_task {
        stop.notify_one();
        task.await?;
        listener.abort();
    }
    pool.close().await;
    Ok(Outcome {
        txns: measured,
        seconds,
        latencies,
        notifies,
    })
}

/// Drops one of the outbox table's indexes, or the constraint that owns it (the `event_id`
/// unique key).
pub(crate) async fn drop_index(
    pool: &sqlx::PgPool,
    schema: &str,
    index: &str,
) -> anyhow::Result<()> {
    let constraint: Option<String> = sqlx::query_scalar(
        "SELECT c.conrelid::regclass::text FROM pg_constraint c \
         JOIN pg_namespace n ON n.oid = c.connamespace \
         WHERE n.nspname = $1 AND c.conname = $2",
    )
    .bind(schema)
    .bind(index)
    .fetch_optional(pool)
    .await?;
    let ddl = match constraint {
        Some(table) => format!("ALTER TABLE {table} DROP CONSTRAINT \"{index}\""),
        None => format!("DROP INDEX \"{schema}\".\"{index}\""),
    };
    sqlx::raw_sql(&ddl)
        .execute(pool)
        .await
        .with_context(|| ddl.clone())?;
    Ok(())
}
