//! Shared setup of the integration tests: one schema per test on the server at `DATABASE_URL`.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use outbox_core::{ClaimMode, Envelope};
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
