//! Shared setup of the integration tests: one database per test on the server at `MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`).
#![allow(dead_code, unreachable_pub)]

pub mod backend;
pub mod lease;
pub mod proxy;
pub mod race;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, ClaimedBatch, Envelope, ErrorClass, LastError,
    OutboxStats, Outcome, ParkKind, ParkReason,
};
use outbox_mysql::{MySqlInboxStore, MySqlOutboxStore};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::MySqlPool;

/// `None` when the tests must be skipped (`OUTBOX_SKIP_SERVICE_TESTS=1` and no server);
/// panics with a clear message when the server is unreachable otherwise.
pub async fn pool(max: u32) -> Option<MySqlPool> {
    let url = outbox_test_support::mysql_url("outbox-mysql tests")?;
    match MySqlPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&url)
        .await
    {
        Ok(p) => Some(p),
        Err(e) => panic!(
            "MySQL/MariaDB is required for these tests but {url} refused the connection: {e}. \
             Set MYSQL_URL to a server where the user may create databases."
        ),
    }
}

/// A fresh database name: `omy_<unix seconds>_<random>`, so stale databases of interrupted
/// runs can be recognised by age.
pub fn database_name() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    format!(
        "omy_{secs}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Drops test databases older than an hour (left by failed or interrupted runs; the
/// conformance harness cannot drop its database at the end of a test).
pub async fn drop_stale_databases(pool: &MySqlPool) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(SCHEMA_NAME AS CHAR) FROM information_schema.SCHEMATA \
         WHERE SCHEMA_NAME LIKE 'omy\\_%'",
    )
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
            let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS `{name}`"))
                .execute(pool)
                .await;
        }
    }
}

pub struct Ctx {
    pub pool: MySqlPool,
    pub database: String,
}

impl Ctx {
    pub async fn new(max: u32) -> Option<Self> {
        let pool = pool(max).await?;
        Some(Self {
            pool,
            database: database_name(),
        })
    }

    pub async fn store(&self, mode: ClaimMode) -> MySqlOutboxStore {
        let store = self.builder(mode).build().expect("build");
        store.migrate().await.expect("migrate");
        store
    }

    pub fn builder(&self, mode: ClaimMode) -> outbox_mysql::MySqlOutboxStoreBuilder {
        MySqlOutboxStore::builder(self.pool.clone())
            .database(&self.database)
            .claim_mode(mode)
    }

    pub async fn inbox(&self) -> MySqlInboxStore {
        let inbox = MySqlInboxStore::builder(self.pool.clone())
            .database(&self.database)
            .build()
            .expect("build");
        inbox.migrate().await.expect("migrate");
        inbox
    }

    /// A lease-mode store (30 s) whose held version gaps wait 60 s before they are parked
    /// (none is parked within a test), migrated: the reporting tests' store.
    pub async fn stats_store(&self) -> MySqlOutboxStore {
        let store = self
            .builder(lease(30.0))
            .gap_timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        store
    }

    /// `` `database`.`name` ``.
    pub fn table(&self, name: &str) -> String {
        format!("`{}`.`{name}`", self.database)
    }

    /// Runs `sql` (a statement without parameters) on the test's pool; panics on an error.
    pub async fn execute(&self, sql: &str) {
        sqlx::raw_sql(sql)
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Drops the database (call at the end of a passing test).
    pub async fn drop(self) {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS `{}`", self.database))
            .execute(&self.pool)
            .await;
        self.pool.close().await;
    }
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

/// Version 1 of each of `n` aggregates `<prefix>0`, `<prefix>1`, ..., in that order.
pub fn heads(prefix: &str, n: usize) -> Vec<Envelope> {
    (0..n).map(|i| event(&format!("{prefix}{i}"), 1)).collect()
}

/// The figure `name` of the stats' backend-specific extras.
pub fn extra(s: &OutboxStats, name: &str) -> Option<f64> {
    s.extra.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
}

/// A publication outcome for `e` (topic `orders`, partition 3).
pub fn published(e: &Envelope, offset: i64) -> Outcome {
    Outcome::Published {
        event_id: e.event_id,
        ack: AckMetadata::kafka("orders", 3, offset),
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

/// A transient retry outcome for `e`.
pub fn retry(e: &Envelope, delay: Duration) -> Outcome {
    Outcome::Retry {
        event_id: e.event_id,
        delay,
        error: LastError {
            class: ErrorClass::Transient,
            kind: "other".into(),
            message: "flaky".into(),
        },
    }
}

/// Claims at most `limit` events for `owner`.
pub async fn claim(store: &MySqlOutboxStore, owner: &str, limit: usize) -> ClaimedBatch {
    store
        .claim(&ClaimRequest::new(owner, limit))
        .await
        .expect("claim")
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

/// Completes every record of `batch` as published; every outcome must apply.
pub async fn publish_all(store: &MySqlOutboxStore, batch: &ClaimedBatch) {
    let outs: Vec<_> = batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&batch.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, outs.len(), "every publication applies");
}

/// Appends `events` in a transaction of their own and commits.
pub async fn append(ctx: &Ctx, store: &MySqlOutboxStore, events: &[Envelope]) {
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append_many_in(&mut tx, events).await.unwrap();
    tx.commit().await.unwrap();
}
