//! [`PostgresInboxStore`]: consumer-side deduplication on PostgreSQL.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};

use outbox_core::{async_trait, EventId, InboxStore, Registration, StoreError};

use crate::config::{DEFAULT_INBOX_TABLE, DEFAULT_SCHEMA};
use crate::error::db;
use crate::schema::{self, qualified, validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};

/// The inbox: `INSERT .. ON CONFLICT DO NOTHING RETURNING` in the effect's transaction.
///
/// A returned row means "apply the effect"; no row means the pair was registered by a committed
/// transaction. A concurrent registration of the same pair blocks on the unique index until the
/// first transaction ends, then sees a duplicate (first committed) or registers fresh (first
/// rolled back).
#[derive(Clone, Debug)]
pub struct PostgresInboxStore {
    pool: PgPool,
    schema: String,
    table: String,
    register_sql: String,
    cleanup_sql: String,
}

/// Builder of a [`PostgresInboxStore`].
#[derive(Clone, Debug)]
#[must_use]
pub struct PostgresInboxStoreBuilder {
    pool: PgPool,
    schema: String,
    table: String,
}

impl PostgresInboxStoreBuilder {
    /// Schema (default `outbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }
    /// Table (default `processed_events`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }
    /// Validates the names (`Configuration` error for anything but plain identifiers).
    pub fn build(self) -> Result<PostgresInboxStore, StoreError> {
        validate_identifier("schema", &self.schema, MAX_IDENTIFIER_LEN)?;
        validate_identifier("table", &self.table, MAX_TABLE_NAME_LEN)?;
        let t = qualified(&self.schema, &self.table);
        Ok(PostgresInboxStore {
            register_sql: format!(
                "INSERT INTO {t} (consumer, event_id) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING RETURNING 1"
            ),
            cleanup_sql: format!(
                "DELETE FROM {t} WHERE ctid IN ( \
                   SELECT ctid FROM {t} \
                   WHERE processed_at < clock_timestamp() - $1::int8 * interval '1 microsecond' \
                   LIMIT $2)"
            ),
            pool: self.pool,
            schema: self.schema,
            table: self.table,
        })
    }
}

impl PostgresInboxStore {
    /// A builder with the default names.
    pub fn builder(pool: PgPool) -> PostgresInboxStoreBuilder {
        PostgresInboxStoreBuilder {
            pool,
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_INBOX_TABLE.to_owned(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies the embedded inbox migrations that are missing. Returns how many were applied.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        schema::migrate(
            &self.pool,
            schema::Component::Inbox,
            &self.schema,
            &self.table,
        )
        .await
    }

    /// The inbox schema as plain SQL.
    pub fn schema_sql(&self) -> String {
        schema::inbox_schema_sql(&self.schema, &self.table).expect("names validated by build()")
    }
}

#[async_trait]
impl InboxStore for PostgresInboxStore {
    type Tx = Transaction<'static, Postgres>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool.begin().await.map_err(db)
    }

    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event_id: EventId,
    ) -> Result<Registration, StoreError> {
        let row: Option<i32> = sqlx::query_scalar(&self.register_sql)
            .bind(consumer)
            .bind(event_id.as_uuid())
            .fetch_optional(&mut **tx)
            .await
            .map_err(db)?;
        Ok(if row.is_some() {
            Registration::Fresh
        } else {
            Registration::Duplicate
        })
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(db)
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(db)
    }

    async fn cleanup(&self, retention: Duration, batch_size: usize) -> Result<u64, StoreError> {
        let batch = batch_size.clamp(1, 1_000_000) as i64;
        let retention_us = retention.as_micros().min(i64::MAX as u128) as i64;
        let mut removed = 0u64;
        loop {
            let n = sqlx::query(&self.cleanup_sql)
                .bind(retention_us)
                .bind(batch)
                .execute(&self.pool)
                .await
                .map_err(db)?
                .rows_affected();
            removed += n;
            if (n as i64) < batch {
                break;
            }
        }
        Ok(removed)
    }
}
