//! Shared setup of the integration tests: one schema per test on the server at `DATABASE_URL`.
#![allow(dead_code, unreachable_pub)]

pub mod backend;
pub mod explain;
pub mod stand_in;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, ClaimedBatch, Envelope, ErrorClass, LastError, Outcome,
    ParkKind, ParkReason,
};
use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

pub const DEFAULT_URL: &str = outbox_test_support::DEFAULT_DATABASE_URL;

/// `None` when the tests must be skipped (`OUTBOX_SKIP_SERVICE_TESTS=1`); panics with a clear
/// message when the server is unreachable otherwise.
pub async fn pool(max: u32) -> Option<PgPool> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    // The skip switch and its notice are the workspace's one policy (outbox-test-support).
    let skip = outbox_test_support::skip_allowed();
    match PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) if skip => {
            outbox_test_support::report_skip(
                "outbox-postgres tests",
                &format!("PostgreSQL at {url} is unreachable ({e})"),
            );
            None
        }
        Err(e) => panic!(
            "PostgreSQL is required for these tests but {url} is unreachable: {e}. \
             Start it (scripts/test does) or set DATABASE_URL; set OUTBOX_SKIP_SERVICE_TESTS=1 \
             to skip explicitly."
        ),
    }
}

/// A fresh schema name: `opg_<unix seconds>_<random>`, so stale schemas of interrupted runs
/// can be recognised by age.
pub fn schema_name() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!(
        "opg_{secs}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Drops test schemas older than an hour (left by failed or interrupted runs; the conformance
/// harness cannot drop its schema at the end of a test).
pub async fn drop_stale_schemas(pool: &PgPool) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let names: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'opg\\_%'")
            .fetch_all(pool)
            .await
            .unwrap_or_default();
    for name in names {
        let age = name
            .split('_')
            .nth(1)
            .and_then(|s| s.parse::<u64>().ok())
            .map(|t| now.saturating_sub(t));
        if age.is_some_and(|a| a > 3600) {
            let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
                .execute(pool)
                .await;
        }
    }
}

pub struct Ctx {
    pub pool: PgPool,
    pub schema: String,
}

impl Ctx {
    pub async fn new(max: u32) -> Option<Self> {
        let pool = pool(max).await?;
        Some(Self {
            pool,
            schema: schema_name(),
        })
    }

    pub async fn store(&self, mode: ClaimMode) -> PostgresOutboxStore {
        let store = self.store_unmigrated(mode);
        store.migrate().await.expect("migrate");
        store
    }

    pub fn store_unmigrated(&self, mode: ClaimMode) -> PostgresOutboxStore {
        PostgresOutboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .claim_mode(mode)
            .build()
            .expect("build")
    }

    pub async fn inbox(&self) -> PostgresInboxStore {
        let inbox = PostgresInboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .build()
            .expect("build");
        inbox.migrate().await.expect("migrate");
        inbox
    }

    /// Drops the schema (call at the end of a passing test).
    pub async fn drop(self) {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&self.pool)
            .await;
        self.pool.close().await;
    }
}

pub fn lease(secs: f64) -> ClaimMode {
    ClaimMode::lease(Duration::from_secs_f64(secs)).unwrap()
}

pub fn event(agg: &str, version: i64) -> Envelope {
    Envelope::builder("order", agg, version, "order.changed")
        .json(&serde_json::json!({ "v": version }))
        .unwrap()
        .header("x-test", "1")
        .build()
        .unwrap()
}

/// A fresh [`Ctx`] with `max` pooled connections, or `return` when skipping explicitly.
#[macro_export]
macro_rules! ctx {
    ($max:expr) => {
        match common::Ctx::new($max).await {
            Some(c) => c,
            None => return,
        }
    };
}

/// A publication outcome for `e` (topic `orders`, partition 3).
pub fn published(e: &Envelope, offset: i64) -> Outcome {
    Outcome::Published {
        event_id: e.event_id,
        ack: AckMetadata::kafka("orders", 3, offset),
    }
}

/// A retry outcome for `e`, due at once (a transient `timeout`).
pub fn retry(e: &Envelope) -> Outcome {
    Outcome::Retry {
        event_id: e.event_id,
        delay: Duration::ZERO,
        error: LastError {
            class: ErrorClass::Transient,
            kind: "timeout".into(),
            message: "no ack".into(),
        },
    }
}

/// A park outcome for `e` (a permanent `record_too_large`).
pub fn park(e: &Envelope) -> Outcome {
    Outcome::Park {
        event_id: e.event_id,
        reason: ParkReason {
            kind: ParkKind::PermanentError,
            error: LastError {
                class: ErrorClass::Permanent,
                kind: "record_too_large".into(),
                message: "too big".into(),
            },
        },
    }
}

/// Claims at most `limit` events for `owner`.
pub async fn claim(store: &PostgresOutboxStore, owner: &str, limit: usize) -> ClaimedBatch {
    store
        .claim(&ClaimRequest::new(owner, limit))
        .await
        .expect("claim")
}

/// (type, id, version) of each claimed record, sorted.
pub fn claimed(batch: &ClaimedBatch) -> Vec<(String, String, i64)> {
    let mut v: Vec<_> = batch
        .records
        .iter()
        .map(|r| {
            let e = &r.envelope;
            (
                e.aggregate_type.clone(),
                e.aggregate_id.clone(),
                e.aggregate_version,
            )
        })
        .collect();
    v.sort();
    v
}

/// The (aggregate, version) pairs of a batch, sorted.
pub fn versions(batch: &ClaimedBatch) -> Vec<(String, i64)> {
    let mut v: Vec<_> = batch
        .records
        .iter()
        .map(|r| {
            (
                r.envelope.aggregate_id.clone(),
                r.envelope.aggregate_version,
            )
        })
        .collect();
    v.sort();
    v
}

/// The seed of a randomized test given in the environment variable `var`, if any (and a number).
pub fn env_seed(var: &str) -> Option<u64> {
    std::env::var(var).ok().and_then(|s| s.parse().ok())
}

/// A seed drawn from the clock: the nanoseconds since the Unix epoch (the low 64 bits).
pub fn clock_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Completes every record of `batch` as published; every outcome must apply.
pub async fn publish_all(store: &PostgresOutboxStore, batch: &ClaimedBatch) {
    let outs: Vec<_> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&batch.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, outs.len(), "every publication applies");
}

/// The schema as migrations 1 and 2 left it (the version before the per-aggregate state).
pub async fn version_2_schema(ctx: &Ctx) {
    schema_at_version(ctx, 2).await;
}

/// The outbox migrations in order (the files, as embedded by the crate).
pub const OUTBOX_MIGRATIONS: [&str; 7] = [
    include_str!("../../src/migrations/0001_outbox.sql"),
    include_str!("../../src/migrations/0002_outbox.sql"),
    include_str!("../../src/migrations/0003_outbox.sql"),
    // Migration 4 as one text (its index step is a file of its own).
    concat!(
        include_str!("../../src/migrations/0004_outbox.sql"),
        include_str!("../../src/migrations/0004_outbox_index.sql")
    ),
    include_str!("../../src/migrations/0005_outbox.sql"),
    include_str!("../../src/migrations/0006_outbox.sql"),
    include_str!("../../src/migrations/0007_outbox.sql"),
];

/// The schema as migrations 1 to `version` left it (table `outbox_events`), recorded as applied,
/// so that `migrate()` applies the rest: a table of a previous version.
pub async fn schema_at_version(ctx: &Ctx, version: usize) {
    let render = |sql: &str| {
        sql.replace("__SCHEMA__", &ctx.schema)
            .replace("__TABLE__", "outbox_events")
            .replace("__SEED__", "0")
            // Migration 7's append function (not used by the tests of older schemas).
            .replace("__CHANNEL__", "NULL")
            .replace("__GATE_K1__", "0")
            .replace("__GATE_K2__", "0")
    };
    let sql: String = OUTBOX_MIGRATIONS[..version]
        .iter()
        .map(|m| render(m))
        .collect();
    sqlx::raw_sql(&sql).execute(&ctx.pool).await.unwrap();
    let records: Vec<String> = (1..=version)
        .map(|v| format!("('outbox:outbox_events', {v}, 'v{v}')"))
        .collect();
    sqlx::raw_sql(&format!(
        "CREATE TABLE \"{0}\".outbox_schema_migrations (object text NOT NULL, \
           version integer NOT NULL, description text NOT NULL, \
           applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (object, version)); \
         INSERT INTO \"{0}\".outbox_schema_migrations (object, version, description) \
           VALUES {1};",
        ctx.schema,
        records.join(", ")
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// Panics when a pending row of `outbox_events` is blocked with no row of its aggregate before
/// it in (version, id) that is claimable (pending, not blocked) or parked above the last
/// version: nothing would ever promote it (the append-time blocking invariant,
/// `blocked_at_insert` in `src/outbox/append.rs`).
pub async fn no_orphans(ctx: &Ctx) {
    let orphans: Vec<String> = sqlx::query_scalar(&format!(
        "SELECT format('%s v%s (row %s)', r.aggregate_id, r.aggregate_version, r.id) \
         FROM {t} r WHERE r.status = 'pending' AND r.blocked AND NOT EXISTS ( \
           SELECT 1 FROM {t} u \
           LEFT JOIN \"{s}\".outbox_events_aggregate a \
             ON a.aggregate_type = u.aggregate_type AND a.aggregate_id = u.aggregate_id \
           WHERE u.aggregate_type = r.aggregate_type AND u.aggregate_id = r.aggregate_id \
             AND (u.aggregate_version, u.id) < (r.aggregate_version, r.id) \
             AND (u.status = 'pending' AND NOT u.blocked \
                  OR u.status = 'parked' \
                     AND u.aggregate_version > COALESCE(a.last_version, 0))) \
         ORDER BY r.id",
        t = format!("\"{}\".outbox_events", ctx.schema),
        s = ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert!(
        orphans.is_empty(),
        "blocked rows with no unfinished predecessor (never promoted): {orphans:?}"
    );
}

/// Whether the row of `agg` (any type) at `version` in `outbox_events` is blocked.
pub async fn blocked(ctx: &Ctx, agg: &str, version: i64) -> bool {
    sqlx::query_scalar(&format!(
        "SELECT blocked FROM \"{}\".outbox_events \
          WHERE aggregate_id = $1 AND aggregate_version = $2",
        ctx.schema
    ))
    .bind(agg)
    .bind(version)
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// The promotion every released version's completion runs after a publication, in the same
/// statement (`promote_after` in `src/sql.rs` since the first release, e.g. at `96643ee^`, the
/// version before migration 6): the aggregate's first blocked row by (version, id), other
/// than the published one, is unblocked. Tests that write an older relay's completion by hand
/// append it, so that a follower the append wrote blocked (docs/design/hot-aggregate.md) is
/// promoted as that relay would. `published`: the SQL condition selecting the published row of
/// `outbox_events` (e.g. `aggregate_id = 'x' AND aggregate_version = 3`).
pub fn old_relay_promotion(ctx: &Ctx, published: &str) -> String {
    format!(
        "UPDATE \"{0}\".outbox_events s SET blocked = false \
         FROM (SELECT (SELECT b.id FROM \"{0}\".outbox_events b \
                       WHERE hashtextextended(b.aggregate_type || chr(31) || b.aggregate_id, 0) \
                             = hashtextextended(p.aggregate_type || chr(31) || p.aggregate_id, 0) \
                         AND b.status IN ('pending', 'parked') AND b.blocked \
                         AND b.aggregate_type = p.aggregate_type \
                         AND b.aggregate_id = p.aggregate_id AND b.id <> p.id \
                       ORDER BY b.aggregate_version, b.id LIMIT 1) AS id \
               FROM \"{0}\".outbox_events p WHERE p.status = 'published' AND {1}) nx \
         WHERE s.id = nx.id AND s.blocked;",
        ctx.schema, published
    )
}

/// The id of the transaction open on `tx`, for [`wait_for_waiter_on`].
pub async fn xact_id(tx: &mut sqlx::PgConnection) -> String {
    sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(tx)
        .await
        .unwrap()
}

/// Waits (up to 10 s) until a session waits for transaction `xid` (a row it wrote and holds):
/// the point where a claim stands behind a transaction of the test.
pub async fn wait_for_waiter_on(ctx: &Ctx, xid: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks \
             WHERE NOT granted AND locktype = 'transactionid' AND transactionid::text = $1",
        )
        .bind(xid)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no session waited for transaction {xid}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 10 s) until a session waits for a lock on a table of the test's schema: the
/// point where a migration stands behind a transaction of the test.
pub async fn wait_for_lock_wait(ctx: &Ctx) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE NOT l.granted AND n.nspname = $1",
        )
        .bind(&ctx.schema)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no session waits for a lock on schema {}",
            ctx.schema
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// The wake-up gate's tests (`wake_gate.rs`, `adversary_gate.rs`).

/// A store over the test's schema with the gate on, its listener running (its first wake-up,
/// after connecting, consumed).
pub async fn listening_store(
    ctx: &Ctx,
    mode: ClaimMode,
    wait: Duration,
) -> (
    PostgresOutboxStore,
    std::sync::Arc<tokio::sync::Notify>,
    tokio::task::JoinHandle<()>,
) {
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .wake_gate_wait(wait)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let notify = std::sync::Arc::new(tokio::sync::Notify::new());
    let handle = store.spawn_listener(notify.clone()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("initial wake-up after connect");
    let _ = tokio::time::timeout(Duration::from_millis(100), notify.notified()).await;
    (store, notify, handle)
}

/// A raw listener on the store's channel, to see exactly which notifications were sent.
pub async fn raw_listener(ctx: &Ctx, store: &PostgresOutboxStore) -> sqlx::postgres::PgListener {
    let mut l = sqlx::postgres::PgListener::connect_with(&ctx.pool)
        .await
        .unwrap();
    l.listen(store.settings().notify_channel.as_deref().unwrap())
        .await
        .unwrap();
    l
}

/// Sends a marker notification on the channel and returns the payloads received up to and
/// including it. Notifications arrive in commit order, so everything a commit before the marker
/// sent is in the list: no timing involved.
pub async fn received_until_marker(
    ctx: &Ctx,
    store: &PostgresOutboxStore,
    l: &mut sqlx::postgres::PgListener,
) -> Vec<String> {
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(store.settings().notify_channel.as_deref().unwrap())
        .execute(&ctx.pool)
        .await
        .unwrap();
    let mut got = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), l.recv())
            .await
            .expect("marker within 5 s")
            .unwrap();
        got.push(n.payload().to_owned());
        if n.payload() == "marker" {
            return got;
        }
    }
}

/// The gate's two advisory keys for this test's table, as `pg_locks` shows them (`classid`,
/// `objid`: the keys' bits as unsigned 32-bit numbers). The store derives them from an FNV-1a
/// hash of `schema.table` (`sql::seed`, `wake_gate::gate_keys`); computed the same way here so
/// that gate locks of other tests, in this or in another process, are never counted.
pub fn gate_lock_keys(ctx: &Ctx) -> (i64, i64) {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let table = outbox_postgres::DEFAULT_OUTBOX_TABLE;
    for b in ctx.schema.bytes().chain([b'.']).chain(table.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let seed = h as i64;
    let (k1, k2) = ((seed >> 32) as i32, seed as i32);
    (i64::from(k1 as u32), i64::from(k2 as u32))
}

/// Locks on this test's gate (two-key advisory) in this database: granted exclusive ones, or
/// requests still waiting.
pub async fn gate_locks(ctx: &Ctx, granted: bool) -> usize {
    let (k1, k2) = gate_lock_keys(ctx);
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 \
         AND classid::int8 = $1 AND objid::int8 = $2 AND granted = $3 \
         AND (NOT granted OR mode = 'ExclusiveLock') \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .bind(k1)
    .bind(k2)
    .bind(granted)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    n as usize
}
