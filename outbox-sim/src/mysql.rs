//! The simulation's backend on a real MySQL 8 / MariaDB server: `outbox-mysql`'s outbox store
//! and inbox in a database of the case's own.
//!
//! As on PostgreSQL the store reads the database's clock, so this backend runs on real time:
//! the relays get the system clock, [`Step::Advance`](crate::Step::Advance) does nothing, and
//! leases expire by waiting. A relay's crash is a killed task plus, for a locked claim, its
//! closed connection (the store's `abandon_locked_claim`); the consumer's crash drops the
//! engine and with it any open inbox transaction.
//!
//! The simulation drives every transaction from one thread, so a business transaction must
//! never wait for another: it takes its aggregate's row with `FOR UPDATE NOWAIT` (a held row is
//! a conflict: the command is refused), the row having been created beforehand in a statement
//! of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, Clock, DeliveryStatus, Envelope, EventId,
    ParkKind, StoreError, SystemClock,
};
use outbox_mysql::{map_sqlx_error, MySqlInboxStore, MySqlOutboxStore};
use serde_json::Value;
use sqlx::{MySql, MySqlConnection, MySqlPool, Row, Transaction};

use crate::backend::{assemble_snapshot, Backend, DeliverySnapshot, EffectsView, RowView};

/// The MySQL store's gap timeout in the simulation: it runs on real time, so a gap the
/// producer leaves must park within a run.
const MYSQL_GAP_TIMEOUT: Duration = Duration::from_secs(2);

/// `outbox-mysql` on a real server, in database `database`.
#[derive(Clone, Debug)]
pub struct MySqlBackend {
    pool: MySqlPool,
    database: String,
    store: MySqlOutboxStore,
    inbox: MySqlInboxStore,
}

impl MySqlBackend {
    /// Creates the database (outbox, inbox and the simulation's own tables) and the stores.
    pub async fn new(pool: MySqlPool, database: &str, mode: ClaimMode) -> Result<Self, StoreError> {
        let store = MySqlOutboxStore::builder(pool.clone())
            .database(database)
            .claim_mode(mode)
            .gap_timeout(MYSQL_GAP_TIMEOUT)
            .build()?;
        store.migrate().await?;
        let inbox = MySqlInboxStore::builder(pool.clone())
            .database(database)
            .build()?;
        inbox.migrate().await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS `{s}`.sim_aggregates (id VARCHAR(255) PRIMARY KEY, version BIGINT NOT NULL, state LONGTEXT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS `{s}`.sim_effects (event_id BINARY(16) PRIMARY KEY, n BIGINT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS `{s}`.sim_effect_order (aggregate_id VARCHAR(255) PRIMARY KEY, version BIGINT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS `{s}`.sim_effect_disorder (id BIGINT AUTO_INCREMENT PRIMARY KEY, message TEXT NOT NULL) ENGINE = InnoDB",
        ] {
            sqlx::query(&ddl.replace("{s}", database))
                .execute(&pool)
                .await
                .map_err(map_sqlx_error)?;
        }
        Ok(Self {
            pool,
            database: database.to_owned(),
            store,
            inbox,
        })
    }

    /// Drops the database.
    pub async fn drop_database(&self) {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS `{}`", self.database))
            .execute(&self.pool)
            .await;
    }

    fn table(&self, name: &str) -> String {
        format!("`{}`.`{name}`", self.database)
    }

    /// Every row of `table` with every column as text (binary columns in hex), and the
    /// values of `key_col` (as text) apart.
    async fn columns_of(
        &self,
        conn: &mut MySqlConnection,
        table: &str,
        key_col: &str,
    ) -> Result<Vec<(String, BTreeMap<String, String>)>, String> {
        let cols: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(COLUMN_NAME AS CHAR), CAST(DATA_TYPE AS CHAR) \
             FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? \
             ORDER BY ORDINAL_POSITION",
        )
        .bind(&self.database)
        .bind(table)
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
        if cols.is_empty() {
            return Err(format!("table {table} has no columns"));
        }
        let text = |(name, ty): &(String, String)| {
            if ty.contains("binary") || ty.contains("blob") {
                format!("HEX(`{name}`)")
            } else {
                format!("CAST(`{name}` AS CHAR)")
            }
        };
        let key_type = cols
            .iter()
            .find(|(n, _)| n == key_col)
            .ok_or_else(|| format!("table {table} has no column {key_col}"))?;
        let select: Vec<String> = std::iter::once(text(key_type))
            .chain(cols.iter().map(text))
            .collect();
        let rows = sqlx::query(&format!(
            "SELECT {} FROM {}",
            select.join(", "),
            self.table(table)
        ))
        .fetch_all(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
        rows.into_iter()
            .map(|r| {
                let key: Option<String> = r.try_get(0).map_err(|e| e.to_string())?;
                let mut raw = BTreeMap::new();
                for (i, (name, _)) in cols.iter().enumerate() {
                    let v: Option<String> = r.try_get(i + 1).map_err(|e| e.to_string())?;
                    raw.insert(name.clone(), v.unwrap_or_else(|| "null".to_owned()));
                }
                Ok((key.unwrap_or_default(), raw))
            })
            .collect()
    }
}

fn status(s: &str) -> Result<DeliveryStatus, String> {
    DeliveryStatus::parse(s).ok_or_else(|| format!("unknown status {s}"))
}

#[async_trait]
impl Backend for MySqlBackend {
    type Store = MySqlOutboxStore;
    type BizTx = Transaction<'static, MySql>;
    type Inbox = MySqlInboxStore;

    fn store(&self) -> MySqlOutboxStore {
        self.store.clone()
    }
    fn inbox(&self) -> MySqlInboxStore {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(SystemClock)
    }
    async fn advance(&self, _by: Duration) -> Result<(), String> {
        Ok(())
    }
    fn gap_timeout(&self) -> Duration {
        MYSQL_GAP_TIMEOUT
    }
    async fn expire_leases(&self, lease: Duration) {
        tokio::time::sleep(lease + Duration::from_millis(200)).await;
    }

    async fn begin(&self) -> Result<Self::BizTx, String> {
        self.pool.begin().await.map_err(|e| e.to_string())
    }
    async fn aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
    ) -> Result<Option<(i64, Value)>, String> {
        let t = self.table("sim_aggregates");
        // The row exists before any transaction locks it (created on its own, so creating it
        // never waits for a transaction that holds it).
        let exists: Option<i64> = sqlx::query_scalar(&format!("SELECT 1 FROM {t} WHERE id = ?"))
            .bind(aggregate)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        if exists.is_none() {
            let created = sqlx::query(&format!(
                "INSERT INTO {t} (id, version, state) VALUES (?, 0, 'null')"
            ))
            .bind(aggregate)
            .execute(&self.pool)
            .await;
            if let Err(e) = created {
                if map_sqlx_error(e).kind != outbox_core::StoreErrorKind::Constraint {
                    return Err("creating the aggregate's row failed".into());
                }
            }
        }
        // Another open transaction holds the aggregate: a conflict, never a wait.
        let row = sqlx::query(&format!(
            "SELECT version, CAST(state AS CHAR) FROM {t} WHERE id = ? FOR UPDATE NOWAIT"
        ))
        .bind(aggregate)
        .fetch_one(&mut **tx)
        .await;
        match row {
            Ok(r) => {
                let state: String = r.get(1);
                let state = serde_json::from_str(&state).map_err(|e| e.to_string())?;
                Ok(Some((r.get::<i64, _>(0), state)))
            }
            Err(e) => {
                let e = map_sqlx_error(e);
                if e.kind == outbox_core::StoreErrorKind::Conflict {
                    Ok(None)
                } else {
                    Err(e.to_string())
                }
            }
        }
    }
    async fn set_aggregate(
        &self,
        tx: &mut Self::BizTx,
        aggregate: &str,
        version: i64,
        state: Value,
    ) -> Result<(), String> {
        sqlx::query(&format!(
            "UPDATE {} SET version = ?, state = ? WHERE id = ?",
            self.table("sim_aggregates")
        ))
        .bind(version)
        .bind(state.to_string())
        .bind(aggregate)
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
            "SELECT event_id, CAST(aggregate_id AS CHAR), aggregate_version, \
                    CAST(status AS CHAR), CAST(ack_transport AS CHAR), \
                    CAST(ack_destination AS CHAR), ack_partition, ack_position, \
                    CAST(ack_route AS CHAR), ack_duplicate, attempts, CAST(park_kind AS CHAR) \
             FROM {} ORDER BY id",
            self.table(outbox_mysql::DEFAULT_OUTBOX_TABLE)
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
            .begin_with("START TRANSACTION WITH CONSISTENT SNAPSHOT")
            .await
            .map_err(|e| e.to_string())?;
        let events = outbox_mysql::DEFAULT_OUTBOX_TABLE;
        let rows = self.columns_of(&mut tx, events, "event_id").await?;
        let states = self
            .columns_of(&mut tx, &format!("{events}_aggregate"), "aggregate_id")
            .await?;
        // Lease mode: a claimed row carries its claim's token, the batch's lease row names the
        // relay; shown as the row's `claim` and `claim_owner`, as on PostgreSQL.
        let owners: BTreeMap<String, String> = sqlx::query_as(&format!(
            "SELECT HEX(token), CAST(owner AS CHAR) FROM {}",
            self.table(&format!("{events}_lease"))
        ))
        .fetch_all(&mut *tx)
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .collect();
        tx.rollback().await.map_err(|e| e.to_string())?;
        let raws = rows
            .into_iter()
            .map(|(hex, mut raw)| {
                if let Some(token) = raw.remove("claim_token") {
                    if token.bytes().any(|b| b != b'0') {
                        if let Some(owner) = owners.get(&token) {
                            raw.insert("claim_owner".to_owned(), owner.clone());
                        }
                        raw.insert("claim".to_owned(), token);
                    }
                }
                let id = uuid::Uuid::parse_str(&hex).map_err(|e| format!("event id {hex}: {e}"))?;
                Ok((EventId::from_uuid(id), raw))
            })
            .collect::<Result<_, String>>()?;
        assemble_snapshot(views, raws, states).map(Some)
    }
    async fn abandon(&self, claim: &ClaimHandle) {
        self.store.abandon_locked_claim(claim).await;
    }

    async fn record_effect(
        &self,
        tx: &mut Transaction<'static, MySql>,
        event: &Envelope,
    ) -> Result<(), StoreError> {
        let id = event.dedup_id().as_uuid();
        sqlx::query(&format!(
            "INSERT INTO {} (event_id, n) VALUES (?, 1) ON DUPLICATE KEY UPDATE n = n + 1",
            self.table("sim_effects")
        ))
        .bind(id)
        .execute(&mut **tx)
        .await
        .map_err(map_sqlx_error)?;
        let last: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT version FROM {} WHERE aggregate_id = ? FOR UPDATE",
            self.table("sim_effect_order")
        ))
        .bind(&event.aggregate_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(map_sqlx_error)?;
        let last = last.unwrap_or(0);
        if event.aggregate_version <= last {
            sqlx::query(&format!(
                "INSERT INTO {} (message) VALUES (?)",
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
            "INSERT INTO {} (aggregate_id, version) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE version = GREATEST(version, VALUES(version))",
            self.table("sim_effect_order")
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
            "SELECT CAST(message AS CHAR) FROM {} ORDER BY id",
            self.table("sim_effect_disorder")
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        let last: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT CAST(aggregate_id AS CHAR), version FROM {}",
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
            "SELECT event_id FROM {} WHERE consumer = ?",
            self.table(outbox_mysql::DEFAULT_INBOX_TABLE)
        ))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| e.to_string())?;
        Ok(ids.into_iter().map(EventId::from_uuid).collect())
    }
}
