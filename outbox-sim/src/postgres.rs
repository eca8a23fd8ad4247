//! The simulation's backend on a real PostgreSQL server: `outbox-postgres`'s outbox store and
//! inbox in a schema of the case's own.
//!
//! The store reads the database's clock, so time cannot be faked in the server; virtual time is
//! made the other way round: [`Step::Advance`](crate::Step::Advance) by `d` moves every stored
//! deadline of the outbox back by `d` (pending rows' `next_attempt_at` and `held_since`, the
//! aggregates' `lease_until`) and moves the clock the relays and the simulation read
//! ([`PostgresBackend::clock`], the system clock plus every advance so far) forward by `d`. So
//! leases expire, retries come due and version gaps reach their timeout in a step, as on the
//! in-memory store, and both sides agree on what is live. Rows under a locked claim's
//! transaction are skipped (`SKIP LOCKED`): their deadlines are written when the claim ends.
//! Real time still passes too (configure short leases and delivery timeouts,
//! [`crate::SimConfig::timing`]). A
//! relay's crash is a killed task plus, for a locked claim, its dropped connection (the store's
//! `abandon_locked_claim`, which rolls the claim's transaction back as a closed connection
//! would); the consumer's crash drops the engine and with it any open inbox transaction.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, Clock, DeliveryStatus, Envelope, EventId,
    ParkKind, StoreError, SystemClock,
};
use outbox_postgres::{map_sqlx_error, PostgresInboxStore, PostgresOutboxStore};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::backend::{
    assemble_snapshot, json_columns, Backend, DeliverySnapshot, EffectsView, Hold, RowView,
};

/// Advisory lock class of the simulation's business transactions (apart from the store's).
const BUSINESS_LOCK_CLASS: i32 = 0x51_4d;

/// The store's gap timeout in the simulation (virtual time reaches it in a few advances).
pub(crate) const PG_GAP_TIMEOUT: Duration = Duration::from_secs(20);

/// How long an idle relay's arm of the wake-up gate waits for the appends in flight (the
/// simulation keeps business transactions open across steps: a short wait keeps claims quick).
const WAKE_GATE_WAIT: Duration = Duration::from_millis(20);

/// The system clock plus the virtual time the simulation let pass.
#[derive(Debug, Default)]
struct ShiftedClock(Mutex<Duration>);

impl Clock for ShiftedClock {
    fn now(&self) -> chrono::DateTime<chrono::Utc> {
        let by = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        SystemClock.now() + chrono::Duration::from_std(by).unwrap_or(chrono::Duration::zero())
    }
}

/// `outbox-postgres` on a real server, in schema `schema`.
#[derive(Clone, Debug)]
pub struct PostgresBackend {
    pool: PgPool,
    schema: String,
    store: PostgresOutboxStore,
    inbox: PostgresInboxStore,
    clock: Arc<ShiftedClock>,
    /// Woken by the store's listener on every `NOTIFY` of the outbox's channel.
    wake: Arc<tokio::sync::Notify>,
}

impl PostgresBackend {
    /// Creates the schema (outbox, inbox and the simulation's own tables) and the stores.
    pub async fn new(pool: PgPool, schema: &str, mode: ClaimMode) -> Result<Self, StoreError> {
        let store = PostgresOutboxStore::builder(pool.clone())
            .schema(schema)
            .claim_mode(mode)
            .gap_timeout(PG_GAP_TIMEOUT)
            .wake_gate_wait(WAKE_GATE_WAIT)
            .build()?;
        store.migrate().await?;
        // The gate arms only for a store that listens (an idle relay waiting for a wake-up).
        let wake = Arc::new(tokio::sync::Notify::new());
        store.spawn_listener(wake.clone())?;
        let inbox = PostgresInboxStore::builder(pool.clone())
            .schema(schema)
            .build()?;
        inbox.migrate().await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS \"{s}\".sim_aggregates (id text PRIMARY KEY, version bigint NOT NULL, state jsonb NOT NULL)",
            "CREATE TABLE IF NOT EXISTS \"{s}\".sim_effects (event_id uuid PRIMARY KEY, n bigint NOT NULL)",
            "CREATE TABLE IF NOT EXISTS \"{s}\".sim_effect_order (aggregate_id text PRIMARY KEY, version bigint NOT NULL)",
            "CREATE TABLE IF NOT EXISTS \"{s}\".sim_effect_disorder (message text NOT NULL)",
        ] {
            sqlx::query(&ddl.replace("{s}", schema))
                .execute(&pool)
                .await
                .map_err(map_sqlx_error)?;
        }
        Ok(Self {
            pool,
            schema: schema.to_owned(),
            store,
            inbox,
            clock: Arc::default(),
            wake,
        })
    }

    /// Drops the schema.
    pub async fn drop_schema(&self) {
        let _ = sqlx::query(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        ))
        .execute(&self.pool)
        .await;
    }

    fn table(&self, name: &str) -> String {
        format!("\"{}\".{name}", self.schema)
    }
}

fn status(s: &str) -> Result<DeliveryStatus, String> {
    Ok(match s {
        "pending" => DeliveryStatus::Pending,
        "published" => DeliveryStatus::Published,
        "parked" => DeliveryStatus::Parked,
        "discarded" => DeliveryStatus::Discarded,
        other => return Err(format!("unknown status {other}")),
    })
}

#[async_trait]
impl Backend for PostgresBackend {
    type Store = PostgresOutboxStore;
    type BizTx = Transaction<'static, Postgres>;
    type Inbox = PostgresInboxStore;

    fn store(&self) -> PostgresOutboxStore {
        self.store.clone()
    }
    fn inbox(&self) -> PostgresInboxStore {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        self.clock.clone()
    }
    async fn advance(&self, by: Duration) -> Result<(), String> {
        let t = self.table(outbox_postgres::DEFAULT_OUTBOX_TABLE);
        let a = self.table(&format!(
            "{}_aggregate",
            outbox_postgres::DEFAULT_OUTBOX_TABLE
        ));
        let us = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        let mut tx = self.pool.begin().await.map_err(|e| e.to_string())?;
        sqlx::query(&format!(
            "UPDATE {t} SET next_attempt_at = next_attempt_at - $1 * interval '1 microsecond', \
                    held_since = held_since - $1 * interval '1 microsecond' \
             WHERE id IN (SELECT id FROM {t} WHERE status = 'pending' FOR UPDATE SKIP LOCKED)"
        ))
        .bind(us)
        .execute(&mut *tx)
        .await
        .map_err(|e| format!("advancing the outbox's time: {e}"))?;
        sqlx::query(&format!(
            "UPDATE {a} SET lease_until = lease_until - $1 * interval '1 microsecond' \
             WHERE ctid IN (SELECT ctid FROM {a} WHERE lease_until IS NOT NULL \
                            FOR UPDATE SKIP LOCKED)"
        ))
        .bind(us)
        .execute(&mut *tx)
        .await
        .map_err(|e| format!("advancing the leases' time: {e}"))?;
        tx.commit().await.map_err(|e| e.to_string())?;
        // The simulation drives its steps one by one: nothing reads a deadline between the
        // commit and this.
        *self.clock.0.lock().unwrap_or_else(PoisonError::into_inner) += by;
        Ok(())
    }
    fn gap_timeout(&self) -> Duration {
        PG_GAP_TIMEOUT
    }
    async fn expire_leases(&self, lease: Duration) {
        let _ = self.advance(lease + Duration::from_secs(60)).await;
    }

    async fn begin(&self) -> Result<Self::BizTx, String> {
        self.pool.begin().await.map_err(|e| e.to_string())
    }
    async fn aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
    ) -> Result<Option<(i64, Value)>, String> {
        // Another open transaction of the simulation holds the aggregate: a conflict, never a
        // wait (the simulation drives every transaction from one thread).
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, hashtext($2))")
            .bind(BUSINESS_LOCK_CLASS)
            // Advisory locks are database-wide: the schema keeps cases apart.
            .bind(format!("{}/{aggregate}", self.schema))
            .fetch_one(&mut **tx)
            .await
            .map_err(|e| e.to_string())?;
        if !locked {
            return Ok(None);
        }
        let row = sqlx::query(&format!(
            "SELECT version, state FROM {} WHERE id = $1",
            self.table("sim_aggregates")
        ))
        .bind(aggregate)
        .fetch_optional(&mut **tx)
        .await
        .map_err(|e| e.to_string())?;
        Ok(Some(match row {
            Some(r) => (r.get::<i64, _>(0), r.get::<Value, _>(1)),
            None => (0, Value::Null),
        }))
    }
    async fn set_aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
        version: i64,
        state: Value,
    ) -> Result<(), String> {
        sqlx::query(&format!(
            "INSERT INTO {} (id, version, state) VALUES ($1, $2, $3) \
             ON CONFLICT (id) DO UPDATE SET version = EXCLUDED.version, state = EXCLUDED.state",
            self.table("sim_aggregates")
        ))
        .bind(aggregate)
        .bind(version)
        .bind(state)
        .execute(&mut **tx)
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    }
    async fn append(&self, tx: &mut Self::BizTx, events: &[Envelope]) -> Result<(), StoreError> {
        AppendStore::append(&self.store, &mut **tx, events).await
    }
    async fn commit(&self, tx: Self::BizTx) -> Result<bool, String> {
        tx.commit().await.map(|()| true).map_err(|e| e.to_string())
    }
    async fn rollback(&self, tx: Self::BizTx) {
        let _ = tx.rollback().await;
    }

    async fn rows(&self) -> Result<Vec<RowView>, String> {
        let rows = sqlx::query(&format!(
            "SELECT event_id, aggregate_id, aggregate_version, status, ack_transport, \
             ack_destination, ack_partition, ack_position, ack_route, ack_duplicate, attempts, \
             park_kind FROM {} ORDER BY id",
            self.table(outbox_postgres::DEFAULT_OUTBOX_TABLE)
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        rows.into_iter()
            .map(|r| {
                let transport: Option<String> = r.get(4);
                let ack = AckMetadata::from_columns(
                    transport.as_deref(),
                    r.get(5),
                    r.get(6),
                    r.get(7),
                    r.get(8),
                    r.get(9),
                )
                .map_err(|e| e.to_string())?;
                Ok(RowView {
                    event_id: EventId::from_uuid(r.get(0)),
                    aggregate_id: r.get(1),
                    version: r.get(2),
                    status: status(r.get::<&str, _>(3))?,
                    ack,
                    attempts: r.get::<i32, _>(10).max(0) as u32,
                    park_kind: r
                        .get::<Option<String>, _>(11)
                        .as_deref()
                        .and_then(ParkKind::parse),
                })
            })
            .collect()
    }
    async fn delivery_snapshot(&self) -> Result<Option<DeliverySnapshot>, String> {
        // Nothing else writes while the simulation reads it (operator steps run alone); one
        // snapshot of both tables all the same.
        let views = self.rows().await?;
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .map_err(|e| e.to_string())?;
        let t = self.table(outbox_postgres::DEFAULT_OUTBOX_TABLE);
        let a = self.table(&format!(
            "{}_aggregate",
            outbox_postgres::DEFAULT_OUTBOX_TABLE
        ));
        let rows: Vec<(uuid::Uuid, Value)> =
            sqlx::query_as(&format!("SELECT event_id, to_jsonb(t) FROM {t} t"))
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
        let states: Vec<(String, Value)> =
            sqlx::query_as(&format!("SELECT aggregate_id, to_jsonb(a) FROM {a} a"))
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| e.to_string())?;
        tx.rollback().await.map_err(|e| e.to_string())?;
        let raws = rows
            .into_iter()
            .map(|(id, v)| Ok((EventId::from_uuid(id), json_columns(v)?)))
            .collect::<Result<_, String>>()?;
        let states = states
            .into_iter()
            .map(|(agg, v)| Ok((agg, json_columns(v)?)))
            .collect::<Result<_, String>>()?;
        assemble_snapshot(views, raws, states).map(Some)
    }
    async fn abandon(&self, claim: &ClaimHandle) {
        self.store.abandon_locked_claim(claim).await;
    }
    fn wake_gate_armed(&self) -> Option<bool> {
        Some(self.store.wake_gate_armed())
    }
    async fn clear_wake_ups(&self) {
        // A stored permit is taken by the first poll.
        let _ = tokio::time::timeout(Duration::ZERO, self.wake.notified()).await;
    }
    async fn wake_up(&self, within: Duration) -> bool {
        tokio::time::timeout(within, self.wake.notified())
            .await
            .is_ok()
    }
    async fn hold_head(&self, event: EventId) -> Result<Option<Box<dyn Hold>>, String> {
        crate::pg_hold::hold_head(&self.pool, &self.schema, event).await
    }

    async fn record_effect(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), StoreError> {
        let id = event.dedup_id().as_uuid();
        sqlx::query(&format!(
            "INSERT INTO {t} (event_id, n) VALUES ($1, 1) \
             ON CONFLICT (event_id) DO UPDATE SET n = {t}.n + 1",
            t = self.table("sim_effects")
        ))
        .bind(id)
        .execute(&mut **tx)
        .await
        .map_err(map_sqlx_error)?;
        let last: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT version FROM {} WHERE aggregate_id = $1",
            self.table("sim_effect_order")
        ))
        .bind(&event.aggregate_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(map_sqlx_error)?;
        let last = last.unwrap_or(0);
        if event.aggregate_version <= last {
            sqlx::query(&format!(
                "INSERT INTO {} (message) VALUES ($1)",
                self.table("sim_effect_disorder")
            ))
            .bind(format!(
                "{} v{} applied after v{last}",
                event.aggregate_id, event.aggregate_version
            ))
            .execute(&mut **tx)
            .await
            .map_err(map_sqlx_error)?;
        }
        sqlx::query(&format!(
            "INSERT INTO {t} (aggregate_id, version) VALUES ($1, $2) \
             ON CONFLICT (aggregate_id) DO UPDATE SET version = GREATEST({t}.version, EXCLUDED.version)",
            t = self.table("sim_effect_order")
        ))
        .bind(&event.aggregate_id)
        .bind(event.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(map_sqlx_error)?;
        Ok(())
    }
    async fn effects(&self) -> Result<EffectsView, String> {
        let mut view = EffectsView::default();
        let rows = sqlx::query(&format!(
            "SELECT event_id, n FROM {}",
            self.table("sim_effects")
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        for r in rows {
            view.counts
                .insert(EventId::from_uuid(r.get(0)), r.get::<i64, _>(1) as u64);
        }
        view.out_of_order = sqlx::query_scalar(&format!(
            "SELECT message FROM {}",
            self.table("sim_effect_disorder")
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        let last: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT aggregate_id, version FROM {}",
            self.table("sim_effect_order")
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        view.last_applied = last.into_iter().collect();
        Ok(view)
    }
    async fn registered(&self, consumer: &str) -> Result<BTreeSet<EventId>, String> {
        let ids: Vec<uuid::Uuid> = sqlx::query_scalar(&format!(
            "SELECT event_id FROM {} WHERE consumer = $1",
            self.table(outbox_postgres::DEFAULT_INBOX_TABLE)
        ))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        Ok(ids.into_iter().map(EventId::from_uuid).collect())
    }
}
