//! The demo on PostgreSQL: orders, outbox and inbox in one database, each run in its own schema.

use std::time::Duration;

use outbox_core::{async_trait, ClaimMode, Envelope, StoreError};
use outbox_inbox::{BatchHandlerError, Handler, HandlerError};
use outbox_postgres::{
    map_sqlx_error, qualified, quote_identifier, validate_identifier, PostgresInboxStore,
    PostgresOutboxStore, MAX_IDENTIFIER_LEN,
};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::{Order, OrderService, Transition};

/// PostgreSQL backends of one demo run.
#[derive(Debug, Clone)]
pub struct PostgresBackend {
    /// The pool.
    pub pool: PgPool,
    /// The schema of this run (`outbox_demo_<random>`).
    pub schema: String,
    /// The outbox.
    pub store: PostgresOutboxStore,
    /// The inbox.
    pub inbox: PostgresInboxStore,
    /// The order service.
    pub service: PostgresOrderService,
}

impl PostgresBackend {
    /// Connects, creates a fresh schema with the order, projection, outbox and inbox tables:
    /// `schema` (validated like the stores' names before anything connects; it must not exist
    /// yet) or `outbox_demo_<random>`.
    pub async fn connect(url: &str, schema: Option<&str>) -> anyhow::Result<Self> {
        let schema = match schema {
            Some(s) => s.to_owned(),
            None => format!(
                "outbox_demo_{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
        };
        validate_identifier("schema", &schema, MAX_IDENTIFIER_LEN)
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await
            .map_err(|e| {
                anyhow::anyhow!("cannot connect to PostgreSQL at the given --database-url: {e}")
            })?;
        // No IF NOT EXISTS: the schema is the run's own, and only then is it dropped later.
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA {};
             CREATE TABLE {} (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL, note text NOT NULL);
             CREATE TABLE {} (id text PRIMARY KEY, status text NOT NULL, version bigint NOT NULL);",
            quote_identifier(&schema),
            qualified(&schema, "orders"),
            qualified(&schema, "projection"),
        ))
        .execute(&pool)
        .await?;
        let store = PostgresOutboxStore::builder(pool.clone())
            .schema(schema.clone())
            .claim_mode(ClaimMode::lease(Duration::from_secs(60))?)
            .build()?;
        store.migrate().await?;
        let inbox = PostgresInboxStore::builder(pool.clone())
            .schema(schema.clone())
            .build()?;
        inbox.migrate().await?;
        let service = PostgresOrderService {
            pool: pool.clone(),
            outbox: store.clone(),
            schema: schema.clone(),
        };
        Ok(Self {
            pool,
            schema,
            store,
            inbox,
            service,
        })
    }

    /// Drops this run's schema.
    pub async fn drop_schema(&self) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(&format!(
            "DROP SCHEMA {} CASCADE",
            quote_identifier(&self.schema)
        ))
        .execute(&self.pool)
        .await
        .map(|_| ())
    }
}

/// The order service on PostgreSQL.
#[derive(Debug, Clone)]
pub struct PostgresOrderService {
    pool: PgPool,
    outbox: PostgresOutboxStore,
    schema: String,
}

impl PostgresOrderService {
    async fn append_and_commit(
        &self,
        mut tx: Transaction<'static, Postgres>,
        order: Order,
        event_type: &str,
    ) -> Result<Transition, StoreError> {
        let event = Envelope::builder("order", &order.id, order.version, event_type)
            .json(&order)?
            .created_at(crate::now())
            .build()?;
        let id = event.event_id;
        // Same transaction as the state change; no broker call in here.
        self.outbox.append(&mut *tx, &event).await?;
        tx.commit().await.map_err(map_sqlx_error)?;
        Ok(Transition::Applied(id))
    }
}

#[async_trait]
impl OrderService for PostgresOrderService {
    async fn place(&self, id: &str, note: &str) -> Result<Transition, StoreError> {
        let mut tx = self.pool.begin().await.map_err(map_sqlx_error)?;
        let inserted = sqlx::query(&format!(
            "INSERT INTO {} (id, status, version, note) VALUES ($1, 'pending', 1, $2) ON CONFLICT (id) DO NOTHING",
            qualified(&self.schema, "orders")
        ))
        .bind(id)
        .bind(note)
        .execute(&mut *tx)
        .await
        .map_err(map_sqlx_error)?
        .rows_affected();
        if inserted != 1 {
            return Ok(Transition::Rejected(format!("order {id} exists")));
        }
        let order = Order {
            id: id.into(),
            status: "pending".into(),
            version: 1,
            note: note.into(),
        };
        self.append_and_commit(tx, order, "order.placed").await
    }

    async fn transition(
        &self,
        id: &str,
        from: &str,
        to: &str,
        event_type: &str,
    ) -> Result<Transition, StoreError> {
        let mut tx = self.pool.begin().await.map_err(map_sqlx_error)?;
        // Conditional transition: only from `from`; the row lock serializes concurrent commands.
        let row = sqlx::query(&format!(
            "UPDATE {} SET status = $3, version = version + 1 WHERE id = $1 AND status = $2 RETURNING version, note",
            qualified(&self.schema, "orders")
        ))
        .bind(id)
        .bind(from)
        .bind(to)
        .fetch_optional(&mut *tx)
        .await
        .map_err(map_sqlx_error)?;
        let Some(row) = row else {
            // Rolled back on drop: no state change, no event.
            return Ok(Transition::Rejected(format!("order {id} is not {from}")));
        };
        let order = Order {
            id: id.into(),
            status: to.into(),
            version: row.get("version"),
            note: row.get("note"),
        };
        self.append_and_commit(tx, order, event_type).await
    }

    async fn projection_matches(&self) -> Result<usize, StoreError> {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} o JOIN {} p ON p.id = o.id AND p.version = o.version",
            qualified(&self.schema, "orders"),
            qualified(&self.schema, "projection")
        ))
        .fetch_one(&self.pool)
        .await
        .map_err(map_sqlx_error)?;
        Ok(n as usize)
    }
}

/// The projection on PostgreSQL: written in the inbox transaction, with a version check.
///
/// A batch of events is applied set-based ([`Handler::handle_batch`]): one `INSERT` and one
/// `UPDATE .. FROM unnest(..)` per wave, where a wave holds at most one event per order (the
/// first not yet applied), so several versions of one order in a batch apply in order.
#[derive(Debug, Clone)]
pub struct Projection {
    insert: String,
    update: String,
    insert_many: String,
    update_many: String,
}

impl Projection {
    /// The projection in `schema` (a validated name; see [`outbox_postgres::qualified`]).
    pub fn new(schema: &str) -> Self {
        let projection = qualified(schema, "projection");
        Self {
            insert: format!(
                "INSERT INTO {projection} (id, status, version) VALUES ($1, $2, 1) ON CONFLICT (id) DO NOTHING"
            ),
            update: format!(
                "UPDATE {projection} SET status = $2, version = $3 WHERE id = $1 AND version = $3 - 1"
            ),
            insert_many: format!(
                "INSERT INTO {schema}.projection (id, status, version) \
                 SELECT id, status, 1 FROM unnest($1::text[], $2::text[]) AS x(id, status) \
                 ON CONFLICT (id) DO NOTHING RETURNING id"
            ),
            update_many: format!(
                "UPDATE {schema}.projection p SET status = x.status, version = x.version \
                 FROM unnest($1::text[], $2::text[], $3::int8[]) AS x(id, status, version) \
                 WHERE p.id = x.id AND p.version = x.version - 1 RETURNING p.id"
            ),
        }
    }
}

fn not_at(order: &Order) -> HandlerError {
    HandlerError::transient(format!(
        "projection of {} is not at version {}",
        order.id,
        order.version - 1
    ))
}

#[async_trait]
impl Handler<Transaction<'static, Postgres>> for Projection {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        let order: Order = event
            .payload
            .to_json()
            .map_err(|e| HandlerError::permanent(e.to_string()))?;
        let q = if event.aggregate_version == 1 {
            sqlx::query(&self.insert)
                .bind(&order.id)
                .bind(&order.status)
        } else {
            sqlx::query(&self.update)
                .bind(&order.id)
                .bind(&order.status)
                .bind(event.aggregate_version)
        };
        let changed = q
            .execute(&mut **tx)
            .await
            .map_err(|e| HandlerError::from(map_sqlx_error(e)))?
            .rows_affected();
        // The row count we expected: exactly one, else roll the whole transaction back.
        if changed != 1 {
            return Err(HandlerError::transient(format!(
                "projection of {} is not at version {}",
                order.id,
                event.aggregate_version - 1
            )));
        }
        Ok(())
    }

    async fn handle_batch(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        events: &[&Envelope],
    ) -> Result<(), BatchHandlerError> {
        let mut orders = Vec::with_capacity(events.len());
        for (i, e) in events.iter().enumerate() {
            let mut order: Order = e.payload.to_json().map_err(|err| {
                BatchHandlerError::new(i, HandlerError::permanent(err.to_string()))
            })?;
            order.version = e.aggregate_version;
            orders.push(order);
        }
        let db =
            |i: usize| move |e: sqlx::Error| BatchHandlerError::new(i, map_sqlx_error(e).into());
        let mut remaining: Vec<usize> = (0..orders.len()).collect();
        while !remaining.is_empty() {
            // A wave: the first remaining event of each order, in batch order.
            let mut seen = std::collections::HashSet::new();
            let (wave, rest): (Vec<usize>, Vec<usize>) = remaining
                .iter()
                .partition(|i| seen.insert(orders[**i].id.as_str()));
            let (first, later): (Vec<usize>, Vec<usize>) =
                wave.iter().partition(|i| orders[**i].version == 1);
            for (indices, sql) in [(&first, &self.insert_many), (&later, &self.update_many)] {
                if indices.is_empty() {
                    continue;
                }
                let ids: Vec<&str> = indices.iter().map(|i| orders[*i].id.as_str()).collect();
                let statuses: Vec<&str> =
                    indices.iter().map(|i| orders[*i].status.as_str()).collect();
                let versions: Vec<i64> = indices.iter().map(|i| orders[*i].version).collect();
                let mut q = sqlx::query_scalar::<_, String>(sql)
                    .bind(&ids)
                    .bind(&statuses);
                if std::ptr::eq(sql, &self.update_many) {
                    q = q.bind(&versions);
                }
                let changed: std::collections::HashSet<String> = q
                    .fetch_all(&mut **tx)
                    .await
                    .map_err(db(indices[0]))?
                    .into_iter()
                    .collect();
                // Every row we expected to change, else roll the whole transaction back and
                // name the first event that did not apply.
                if let Some(i) = indices.iter().find(|i| !changed.contains(&orders[**i].id)) {
                    return Err(BatchHandlerError::new(*i, not_at(&orders[*i])));
                }
            }
            remaining = rest;
        }
        Ok(())
    }
}
