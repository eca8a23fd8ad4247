//! The inbox engine's PostgreSQL side for the rabbitmq source tests: a schema of the test's own
//! with an effects table (dropped with the [`Db`]) and a handler that records each effect.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use outbox_core::{async_trait, Envelope};
use outbox_inbox::{Handler, HandlerError};
use outbox_postgres::{map_sqlx_error, PostgresInboxStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};

use super::unique;

pub type PgTx = Transaction<'static, Postgres>;

pub struct Db {
    pub pool: PgPool,
    pub schema: String,
}

impl Db {
    pub async fn new(test: &str) -> Option<Self> {
        let url = outbox_test_support::database_url(test)?;
        let schema = unique("rmqinbox");
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await
            .expect("PostgreSQL");
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".effects (seq bigserial PRIMARY KEY, dedup_id uuid NOT NULL,
                 aggregate_id text NOT NULL, version bigint NOT NULL);"
        ))
        .execute(&pool)
        .await
        .expect("effects table");
        Some(Self { pool, schema })
    }

    pub async fn inbox(&self) -> PostgresInboxStore {
        let inbox = PostgresInboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .build()
            .expect("inbox");
        inbox.migrate().await.expect("migrate");
        inbox
    }

    pub async fn applied(&self, agg: &str) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT version FROM \"{}\".effects WHERE aggregate_id = $1 ORDER BY seq",
            self.schema
        ))
        .bind(agg)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    pub async fn effects_once(&self) -> i64 {
        let twice: Vec<(uuid::Uuid, i64)> = sqlx::query_as(&format!(
            "SELECT dedup_id, count(*) FROM \"{}\".effects GROUP BY dedup_id HAVING count(*) > 1",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert!(twice.is_empty(), "effects applied twice: {twice:?}");
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".effects", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let (pool, schema) = (self.pool.clone(), self.schema.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let _ = sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                        .execute(&pool)
                        .await;
                })
        })
        .join();
    }
}

pub struct Effects {
    pub schema: String,
    pub applied: Arc<AtomicUsize>,
}

#[async_trait]
impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".effects (dedup_id, aggregate_id, version) VALUES ($1, $2, $3)",
            self.schema
        ))
        .bind(e.dedup_id().as_uuid())
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::from(map_sqlx_error(e)))?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
