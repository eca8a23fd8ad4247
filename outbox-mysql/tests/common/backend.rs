//! The MySQL side of `outbox_testkit::randomized::RandomizedBackend`: a database of its own,
//! stores over it, business transactions, reads of the raw table. Used by the randomized run
//! and by the shared relay scenarios (`outbox_testkit::scenarios`).

use std::collections::HashMap;

use outbox_core::{async_trait, DeliveryStatus, Envelope, EventId, StoreError};
use outbox_mysql::{map_sqlx_error, MySqlOutboxStore};
use outbox_testkit::randomized::{FinalRow, RandomizedBackend, StoreParams, LABEL};
use sqlx::{MySql, MySqlPool, Transaction};
use uuid::Uuid;

/// Prefix of the randomized run's replay variables.
pub const PREFIX: &str = "OUTBOX_MYSQL";

/// The run's MySQL: a database of its own; the relays' pool, and a pool of its own for the
/// reads of the raw table.
pub struct MyBackend {
    pool: MySqlPool,
    checker: MySqlPool,
    database: String,
}

impl MyBackend {
    /// A backend whose pool holds `connections` (`None`: skipped, see [`super::pool`]).
    pub async fn new(connections: u32) -> Option<Self> {
        let ctx = super::Ctx::new(connections).await?;
        super::drop_stale_databases(&ctx.pool).await;
        let checker = super::pool(6)
            .await
            .expect("the server answered a moment ago");
        Some(Self {
            pool: ctx.pool,
            checker,
            database: ctx.database,
        })
    }

    fn table(&self) -> String {
        outbox_mysql::qualified(Some(&self.database), "outbox_events")
    }
}

#[async_trait]
impl RandomizedBackend for MyBackend {
    type Store = MySqlOutboxStore;
    type Tx = Transaction<'static, MySql>;

    fn store(&self, p: &StoreParams) -> MySqlOutboxStore {
        MySqlOutboxStore::builder(self.pool.clone())
            .database(&self.database)
            .claim_mode(p.mode)
            .locked_max_hold(p.locked_hold)
            .gap_timeout(p.gap_timeout)
            .publisher_delivery_timeout(p.delivery_timeout)
            .build()
            .expect("store settings")
    }

    async fn prepare(&self, store: &MySqlOutboxStore) -> Result<(), StoreError> {
        store.migrate().await.map(|_| ())
    }

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool.begin().await.map_err(map_sqlx_error)
    }

    async fn append(
        &self,
        store: &MySqlOutboxStore,
        tx: &mut Self::Tx,
        events: &[Envelope],
    ) -> Result<(), StoreError> {
        store.append_many(&mut **tx, events).await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(map_sqlx_error)
    }

    async fn rollback(&self, tx: Self::Tx) {
        let _ = tx.rollback().await;
    }

    async fn statuses(&self, ids: &[EventId]) -> Option<HashMap<EventId, DeliveryStatus>> {
        if ids.is_empty() {
            return Some(HashMap::new());
        }
        let sql = format!(
            "SELECT event_id, CAST(status AS CHAR) FROM {} WHERE event_id IN ({})",
            self.table(),
            vec!["?"; ids.len()].join(", ")
        );
        let mut q = sqlx::query_as::<_, (Uuid, String)>(&sql);
        for id in ids {
            q = q.bind(id.as_uuid());
        }
        let rows = q.fetch_all(&self.checker).await.ok()?;
        rows.into_iter()
            .map(|(id, s)| Some((EventId::from_uuid(id), DeliveryStatus::parse(&s)?)))
            .collect()
    }

    async fn counts(&self) -> Result<(u64, u64), StoreError> {
        let (pending, parked): (i64, i64) = sqlx::query_as(&format!(
            "SELECT CAST(COALESCE(SUM(status = 'pending'), 0) AS SIGNED), \
                    CAST(COALESCE(SUM(status = 'parked'), 0) AS SIGNED) FROM {}",
            self.table()
        ))
        .fetch_one(&self.checker)
        .await
        .map_err(map_sqlx_error)?;
        Ok((pending as u64, parked as u64))
    }

    async fn stalled(&self) -> Result<Vec<(String, i64, String)>, StoreError> {
        sqlx::query_as(&format!(
            "SELECT CAST(MIN(aggregate_id) AS CHAR), \
                    CAST(SUM(status = 'pending') AS SIGNED), \
                    CAST(GROUP_CONCAT(CONCAT('v', aggregate_version, ' ', status, \
                                             IF(blocked, ' blocked', '')) \
                                      ORDER BY aggregate_version, id SEPARATOR ', ') AS CHAR) \
             FROM {} WHERE status IN ('pending', 'parked') \
             GROUP BY aggregate_key \
             HAVING SUM(status = 'parked') = 0 AND SUM(NOT blocked) = 0",
            self.table()
        ))
        .fetch_all(&self.checker)
        .await
        .map_err(map_sqlx_error)
    }

    async fn stuck(&self) -> Vec<String> {
        let rows: Vec<(Option<String>, String, bool, String)> = sqlx::query_as(&format!(
            "SELECT CAST(JSON_UNQUOTE(JSON_EXTRACT(headers, '$.\"{LABEL}\"')) AS CHAR), \
                    CAST(status AS CHAR), blocked = 1, \
                    CAST(CONCAT(COALESCE(last_error_kind, ''), ' ', \
                                COALESCE(last_error_message, '')) AS CHAR) \
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
            "SELECT event_id, CAST(status AS CHAR), \
                    CAST(JSON_UNQUOTE(JSON_EXTRACT(headers, '$.\"{LABEL}\"')) AS CHAR), \
                    CAST(ack_destination AS CHAR), ack_partition, ack_position \
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
        format!("database {}", self.database)
    }

    fn env_prefix(&self) -> &'static str {
        PREFIX
    }

    fn replay_command(&self, test: &str, seed: u64) -> String {
        format!("{PREFIX}_RANDOM_SEED={seed} cargo test -p outbox-mysql --test randomized {test}")
    }

    async fn finish(&self) {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS `{}`", self.database))
            .execute(&self.pool)
            .await;
        self.checker.close().await;
        self.pool.close().await;
    }
}
