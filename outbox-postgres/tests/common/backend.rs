//! The PostgreSQL side of `outbox_testkit::randomized::RandomizedBackend`: a schema of its
//! own, stores over it, business transactions, reads of the raw table. Used by the randomized
//! run and by the shared relay scenarios (`outbox_testkit::scenarios`).

use std::collections::HashMap;

use outbox_core::{async_trait, DeliveryStatus, Envelope, EventId, StoreError};
use outbox_postgres::{map_sqlx_error, PostgresOutboxStore};
use outbox_testkit::randomized::{FinalRow, RandomizedBackend, StoreParams, LABEL};
use sqlx::{PgPool, Postgres, Transaction};
use uuid::Uuid;

/// Prefix of the randomized run's replay variables.
pub const PREFIX: &str = "OUTBOX_PG";

/// The run's PostgreSQL: a schema of its own; the relays' pool, and a pool of its own for the
/// reads of the raw table, so they never wait behind the relays' connections.
pub struct PgBackend {
    pool: PgPool,
    checker: PgPool,
    schema: String,
}

impl PgBackend {
    /// A backend whose pool holds `connections` (`None`: skipped, see [`super::pool`]).
    pub async fn new(connections: u32) -> Option<Self> {
        let ctx = super::Ctx::new(connections).await?;
        super::drop_stale_schemas(&ctx.pool).await;
        let checker = super::pool(6)
            .await
            .expect("the server answered a moment ago");
        Some(Self {
            pool: ctx.pool,
            checker,
            schema: ctx.schema,
        })
    }

    fn table(&self) -> String {
        outbox_postgres::qualified(&self.schema, "outbox_events")
    }
}

#[async_trait]
impl RandomizedBackend for PgBackend {
    type Store = PostgresOutboxStore;
    type Tx = Transaction<'static, Postgres>;

    fn store(&self, p: &StoreParams) -> PostgresOutboxStore {
        PostgresOutboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .claim_mode(p.mode)
            .locked_max_hold(p.locked_hold)
            .gap_timeout(p.gap_timeout)
            .publisher_delivery_timeout(p.delivery_timeout)
            .build()
            .expect("store settings")
    }

    async fn prepare(&self, store: &PostgresOutboxStore) -> Result<(), StoreError> {
        store.migrate().await.map(|_| ())
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool.begin().await.map_err(map_sqlx_error)
    }

    async fn append(
        &self,
        store: &PostgresOutboxStore,
        tx: &mut Self::Tx,
        events: &[Envelope],
    ) -> Result<(), StoreError> {
        store.append_many(&mut **tx, events).await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(map_sqlx_error)
    }

    async fn rollback(&self, tx: Self::Tx) {
        // A failed rollback leaves nothing committed either.
        let _ = tx.rollback().await;
    }

    async fn statuses(&self, ids: &[EventId]) -> Option<HashMap<EventId, DeliveryStatus>> {
        let ids: Vec<Uuid> = ids.iter().map(|e| e.as_uuid()).collect();
        let rows: Vec<(Uuid, String)> = sqlx::query_as(&format!(
            "SELECT event_id, status FROM {} WHERE event_id = ANY($1)",
            self.table()
        ))
        .bind(&ids)
        .fetch_all(&self.checker)
        .await
        .ok()?;
        rows.into_iter()
            .map(|(id, s)| Some((EventId::from_uuid(id), DeliveryStatus::parse(&s)?)))
            .collect()
    }

    async fn counts(&self) -> Result<(u64, u64), StoreError> {
        let (pending, parked): (i64, i64) = sqlx::query_as(&format!(
            "SELECT count(*) FILTER (WHERE status = 'pending'), \
                    count(*) FILTER (WHERE status = 'parked') FROM {}",
            self.table()
        ))
        .fetch_one(&self.checker)
        .await
        .map_err(map_sqlx_error)?;
        Ok((pending as u64, parked as u64))
    }

    async fn stalled(&self) -> Result<Vec<(String, i64, String)>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT aggregate_id, count(*) FILTER (WHERE status = 'pending'), \
                    string_agg(format('v%s %s%s', aggregate_version, status, \
                                      CASE WHEN blocked THEN ' blocked' ELSE '' END), \
                               ', ' ORDER BY aggregate_version, id) \
             FROM {} WHERE status IN ('pending', 'parked') \
             GROUP BY aggregate_type, aggregate_id \
             HAVING count(*) FILTER (WHERE status = 'parked') = 0 \
                AND count(*) FILTER (WHERE NOT blocked) = 0",
            self.table()
        ))
        .fetch_all(&self.checker)
        .await
        .map_err(map_sqlx_error)
    }

    async fn stuck(&self) -> Vec<String> {
        let rows: Vec<(Option<String>, String, bool, String)> = sqlx::query_as(&format!(
            "SELECT headers->>'{LABEL}', status, blocked, \
                    coalesce(last_error_kind, '') || ' ' || coalesce(last_error_message, '') \
             FROM {} WHERE status IN ('pending', 'parked') ORDER BY id LIMIT 10",
            self.table()
        ))
        .fetch_all(&self.checker)
        .await
        .unwrap_or_default();
        rows.into_iter()
            .map(|(label, status, blocked, error)| {
                format!("{label:?} {status} blocked={blocked} {error}")
            })
            .collect()
    }

    async fn final_rows(&self) -> Result<Vec<FinalRow>, StoreError> {
        type Row = (
            Uuid,
            String,
            Option<String>,
            Option<String>,
            Option<i32>,
            Option<i64>,
        );
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT event_id, status, headers->>'{LABEL}', ack_destination, ack_partition, ack_position \
             FROM {} ORDER BY id",
            self.table()
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(map_sqlx_error)?;
        Ok(rows
            .into_iter()
            .map(|(id, status, label, topic, part, off)| {
                let ack = match (topic, part, off) {
                    (Some(t), Some(p), Some(o)) => Some((t, p, o)),
                    _ => None,
                };
                FinalRow::new(EventId::from_uuid(id), status, label, ack)
            })
            .collect())
    }

    fn location(&self) -> String {
        format!("schema {}", self.schema)
    }

    fn env_prefix(&self) -> &'static str {
        PREFIX
    }

    fn replay_command(&self, test: &str, seed: u64) -> String {
        format!(
            "{PREFIX}_RANDOM_SEED={seed} cargo test -p outbox-postgres --test randomized {test}"
        )
    }

    async fn finish(&self) {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&self.pool)
            .await;
        self.checker.close().await;
        self.pool.close().await;
    }
}
