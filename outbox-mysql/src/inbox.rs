//! [`MySqlInboxStore`]: the consumer side on MySQL 8 / MariaDB: deduplication, per-aggregate
//! versions and parked messages, in the effect's transaction.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sqlx::{MySql, MySqlPool, Row, Transaction};
use uuid::Uuid;

use outbox_core::{
    async_trait, AggregateKey, AggregateRegistration, AggregateState, EventId, InboxStore,
    NewParkedMessage, ParkAs, Parking, Registration, StoreError, StoreErrorKind, VersionAdvance,
};

use crate::config::DEFAULT_INBOX_TABLE;
use crate::error::{db, error_number, is_duplicate};
use crate::inbox_parking::encode_headers;
use crate::outbox::marks;
use crate::schema::{self, qualified, validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};

/// The aggregate key of type `?` and id `?` as the server computes it (SHA-256 of type,
/// U+001F, id), the same expression as the outbox's generated column.
pub(crate) const KEY_EXPR: &str = "UNHEX(SHA2(CONCAT(?, CHAR(31 USING utf8mb4), ?), 256))";

/// Longest consumer name (the registrations' key column is `VARCHAR(255)`).
pub const MAX_CONSUMER_LEN: usize = 255;

/// The consumer's store on MySQL 8.0.13+ or MariaDB 10.6+ (InnoDB).
///
/// * **Deduplication:** registrations `(consumer, event_id)` inserted in the effect's
///   transaction. MySQL has no `INSERT .. RETURNING` (MariaDB has, MySQL 8 does not), so a
///   batch first reads the ids already registered with a locking read (which waits for a
///   concurrent registration of the same pair to end, then sees it), then inserts the rest in
///   one statement; a duplicate key from a registration that committed in between makes the
///   batch read again. Two transactions never both register a pair as fresh.
/// * **Versions and blocking:** `<table>_aggregates`, keyed by (consumer, aggregate key);
///   advanced with conditional updates that match the expected version, so a concurrent
///   advance is a `Conflict`, never a lost update.
/// * **Parking:** `<table>_parked` keeps the raw record (key, headers with null values,
///   value), position, reason and attempts; `<table>_audit` keeps every operator action.
///   Parking locks the aggregate's row, as the operator's release does. A message is parked
///   once per dedup id *and aggregate* (unique key `dedup_scope_key`, inbox migration 3): a
///   record naming another aggregate's parked event as its original (or that event, after
///   such a record) is parked, not taken for parked already. The aggregate is part of the key
///   itself, not of a derived id, so no record can be crafted to take another's place.
/// * **Transactions:** READ COMMITTED, whatever the server default (no gap locks between
///   consumers; each statement sees the latest committed state). Durability is the server's
///   (`innodb_flush_log_at_trx_commit = 1`, checked by [`crate::check_durability`]).
#[derive(Clone, Debug)]
pub struct MySqlInboxStore {
    pool: MySqlPool,
    database: Option<String>,
    table: String,
    pub(crate) tables: InboxTables,
}

/// Qualified names of the inbox's tables.
#[derive(Clone, Debug)]
pub(crate) struct InboxTables {
    pub(crate) registrations: String,
    pub(crate) aggregates: String,
    pub(crate) parked: String,
    pub(crate) audit: String,
}

/// Builder of a [`MySqlInboxStore`].
#[derive(Clone, Debug)]
#[must_use]
pub struct MySqlInboxStoreBuilder {
    pool: MySqlPool,
    database: Option<String>,
    table: String,
}

impl MySqlInboxStoreBuilder {
    /// Database (default: the connection's current database).
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.database = Some(database.into());
        self
    }
    /// Table (default `processed_events`); the versions, parked and audit tables are named
    /// after it (`<table>_aggregates`, `<table>_parked`, `<table>_audit`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }
    /// Validates the names (`Configuration` error for anything but plain identifiers).
    pub fn build(self) -> Result<MySqlInboxStore, StoreError> {
        if let Some(d) = &self.database {
            validate_identifier("database", d, MAX_IDENTIFIER_LEN)?;
        }
        validate_identifier("table", &self.table, MAX_TABLE_NAME_LEN)?;
        let d = self.database.as_deref();
        let tables = InboxTables {
            registrations: qualified(d, &self.table),
            aggregates: qualified(d, &format!("{}_aggregates", self.table)),
            parked: qualified(d, &format!("{}_parked", self.table)),
            audit: qualified(d, &format!("{}_audit", self.table)),
        };
        Ok(MySqlInboxStore {
            pool: self.pool,
            database: self.database,
            table: self.table,
            tables,
        })
    }
}

/// Checks a consumer name for this store: not blank, at most [`MAX_CONSUMER_LEN`]
/// characters, and not ending with a space. MySQL's and MariaDB's `utf8mb4_bin` is a PAD
/// SPACE collation: `'billing '` equals `'billing'`, so a consumer named with a trailing
/// space would share the registrations, versions and parked messages of the name without it
/// (on PostgreSQL they are two consumers). `Validation` error otherwise.
pub fn check_consumer_name(consumer: &str) -> Result<(), StoreError> {
    check_consumer(consumer)
}

pub(crate) fn check_consumer(consumer: &str) -> Result<(), StoreError> {
    if consumer.trim().is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            "consumer name must not be empty",
        ));
    }
    if consumer.ends_with(' ') {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            format!(
                "consumer name {consumer:?} ends with a trailing space: MySQL and MariaDB \
                 compare names ignoring trailing spaces, so it would act on the consumer \
                 named without them"
            ),
        ));
    }
    if consumer.chars().count() > MAX_CONSUMER_LEN {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            format!("consumer name is longer than {MAX_CONSUMER_LEN} characters"),
        ));
    }
    Ok(())
}

impl MySqlInboxStore {
    /// A builder with the default names.
    pub fn builder(pool: MySqlPool) -> MySqlInboxStoreBuilder {
        MySqlInboxStoreBuilder {
            pool,
            database: None,
            table: DEFAULT_INBOX_TABLE.to_owned(),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Applies the embedded inbox migrations that are missing. Returns how many were applied.
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        schema::migrate(
            &self.pool,
            schema::Component::Inbox,
            self.database.as_deref(),
            &self.table,
        )
        .await
    }

    /// The inbox schema as plain SQL.
    pub fn schema_sql(&self) -> String {
        schema::inbox_schema_sql(self.database.as_deref(), &self.table)
            .expect("names validated by build()")
    }

    /// How many of `consumer`'s registrations are older than `retention` (a dry run of
    /// [`InboxStore::cleanup`]).
    pub async fn cleanup_candidates(
        &self,
        consumer: &str,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        check_consumer(consumer)?;
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE consumer = ? \
               AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
            self.tables.registrations
        ))
        .bind(consumer)
        .bind(micros(retention))
        .fetch_one(&self.pool)
        .await
        .map_err(db)?;
        Ok(n.max(0) as u64)
    }

    /// Creates the consumer's row of `aggregate` if missing and locks it; returns whether the
    /// aggregate is blocked.
    pub(crate) async fn lock_aggregate(
        &self,
        tx: &mut sqlx::MySqlConnection,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<bool, StoreError> {
        // Creates the row or locks the existing one (an upsert takes the row's lock).
        sqlx::query(&format!(
            "INSERT INTO {} (consumer, aggregate_key, aggregate_type, aggregate_id, updated_at) \
             VALUES (?, {KEY_EXPR}, ?, ?, UTC_TIMESTAMP(6)) \
             ON DUPLICATE KEY UPDATE consumer = consumer",
            self.tables.aggregates
        ))
        .bind(consumer)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        let blocked: bool = sqlx::query_scalar(&format!(
            "SELECT blocked FROM {} WHERE consumer = ? AND aggregate_key = {KEY_EXPR} FOR UPDATE",
            self.tables.aggregates
        ))
        .bind(consumer)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db)?;
        Ok(blocked)
    }

    /// Registers `(id, aggregate hash)` pairs in `tx` ([`InboxStore::register`] without a
    /// hash, [`InboxStore::register_for`] with one). The registrations already there are read
    /// with a locking read (which waits for a concurrent registration of the same pair to end,
    /// then sees it), the missing ids are inserted in one statement with the hash of their
    /// first occurrence; a duplicate key from a registration that committed in between makes
    /// the batch read again. Answers in order: the first occurrence of an inserted id is
    /// fresh; any other is a duplicate, unless the id's holder has a hash and the event's hash
    /// differs ([`AggregateRegistration::OtherAggregate`]; only `register_for` passes hashes).
    async fn register_rows(
        &self,
        tx: &mut sqlx::MySqlConnection,
        consumer: &str,
        events: &[(Uuid, Option<Uuid>)],
    ) -> Result<Vec<AggregateRegistration>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // First occurrences, in order, with the hash they are registered under.
        let mut unique: Vec<(Uuid, Option<Uuid>)> = Vec::with_capacity(events.len());
        let mut seen = HashSet::with_capacity(events.len());
        for (id, hash) in events {
            if seen.insert(*id) {
                unique.push((*id, *hash));
            }
        }
        let t = &self.tables.registrations;
        // Who holds each id: those registered already, then those inserted here.
        let mut holders: HashMap<Uuid, Option<Uuid>> = HashMap::with_capacity(unique.len());
        let mut fresh: HashSet<Uuid> = HashSet::new();
        for attempt in 0.. {
            holders.clear();
            let sql = format!(
                "SELECT event_id, aggregate FROM {t} WHERE consumer = ? AND event_id IN ({}) \
                 FOR UPDATE",
                marks(unique.len())
            );
            let mut q = sqlx::query_as::<_, (Uuid, Option<Uuid>)>(&sql).bind(consumer);
            for (u, _) in &unique {
                q = q.bind(u);
            }
            holders.extend(q.fetch_all(&mut *tx).await.map_err(db)?);
            let missing: Vec<(Uuid, Option<Uuid>)> = unique
                .iter()
                .filter(|(u, _)| !holders.contains_key(u))
                .copied()
                .collect();
            if missing.is_empty() {
                break;
            }
            let sql = format!(
                "INSERT INTO {t} (consumer, event_id, aggregate, processed_at) VALUES {}",
                vec!["(?, ?, ?, UTC_TIMESTAMP(6))"; missing.len()].join(", ")
            );
            let mut q = sqlx::query(&sql);
            for (u, hash) in &missing {
                q = q.bind(consumer).bind(u).bind(hash);
            }
            match q.execute(&mut *tx).await {
                Ok(_) => {
                    fresh.extend(missing.iter().map(|(u, _)| *u));
                    holders.extend(missing);
                    break;
                }
                // A concurrent registration committed between the read and the insert: the
                // statement alone was rolled back; read again.
                Err(e) if is_duplicate(&e) && attempt < 5 => continue,
                Err(e) => return Err(db(e)),
            }
        }
        Ok(events
            .iter()
            .map(|(u, hash)| {
                if fresh.remove(u) {
                    return AggregateRegistration::Fresh;
                }
                match (holders.get(u).copied().flatten(), hash) {
                    (Some(holder), Some(mine)) if holder != *mine => {
                        AggregateRegistration::OtherAggregate
                    }
                    _ => AggregateRegistration::Duplicate,
                }
            })
            .collect())
    }

    async fn park_one(
        &self,
        tx: &mut sqlx::MySqlConnection,
        consumer: &str,
        m: &NewParkedMessage,
    ) -> Result<Parking, StoreError> {
        let r = &m.record;
        let blocked = match &r.aggregate {
            // The row lock serializes this with an operator releasing the aggregate.
            Some(a) => self.lock_aggregate(tx, consumer, a).await?,
            None => false,
        };
        let (status, kind) = match (m.park_as, blocked) {
            (ParkAs::Waiting, false) => {
                return Err(StoreError::new(
                    StoreErrorKind::Conflict,
                    format!(
                        "aggregate {:?} is not blocked: the message at {} cannot wait (it was \
                         released meanwhile; apply it instead)",
                        r.aggregate, r.position
                    ),
                ))
            }
            (ParkAs::Waiting, true) | (ParkAs::Head(_), true) => ("waiting", None),
            (ParkAs::Head(kind), false) => ("parked", Some(kind.as_str())),
        };
        let headers = encode_headers(&r.headers);
        // A record is parked once per dedup id and aggregate (the unique key includes the
        // aggregate key, migration 3), so a duplicate key on the dedup id is this message
        // parked before. A record without a dedup id (undecodable) is parked once per
        // position. Another record at a position parked before (the log was rewound) is a
        // different record: it is parked under an id derived from its position and content.
        let mut dedup = r.dedup_id.map(|e| e.as_uuid());
        let native = r.position.native_columns();
        let (key_sql, agg) = match &r.aggregate {
            Some(a) => (KEY_EXPR, Some(a)),
            None => ("NULL", None),
        };
        let insert = format!(
            "INSERT INTO {} (consumer, topic, `partition`, `offset`, record_key, headers, value, \
               aggregate_type, aggregate_id, aggregate_key, event_id, dedup_id, \
               aggregate_version, status, kind, reason, attempts, parked_at, native_transport, \
               native_sequence, native_consumer, native_exchange, native_routing_key, \
               native_redelivered) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, {key_sql}, ?, ?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6), \
               ?, ?, ?, ?, ?, ?)",
            self.tables.parked
        );
        let id = loop {
            let mut q = sqlx::query(&insert)
                .bind(consumer)
                .bind(&r.position.topic)
                .bind(r.position.partition)
                .bind(r.position.offset)
                .bind(r.key.as_deref())
                .bind(&headers)
                .bind(r.value.as_deref())
                .bind(agg.map(|a| a.aggregate_type.as_str()))
                .bind(agg.map(|a| a.aggregate_id.as_str()));
            if let Some(a) = agg {
                q = q.bind(&a.aggregate_type).bind(&a.aggregate_id);
            }
            let inserted = q
                .bind(r.event_id.map(|e| e.as_uuid()))
                .bind(dedup)
                .bind(r.aggregate_version)
                .bind(status)
                .bind(kind)
                .bind(&m.reason)
                .bind(i32::try_from(m.attempts).unwrap_or(i32::MAX))
                .bind(native.transport.as_deref())
                .bind(native.sequence)
                .bind(native.consumer.as_deref())
                .bind(native.exchange.as_deref())
                .bind(native.routing_key.as_deref())
                .bind(native.redelivered)
                .execute(&mut *tx)
                .await;
            match inserted {
                Ok(done) => break Some(done.last_insert_id() as i64),
                Err(e) if is_duplicate(&e) => {
                    if dedup.is_some() {
                        break None;
                    }
                    // Same position: the same record, or another one after a rewind.
                    let same: Option<RawRecord> = sqlx::query_as(&format!(
                        "SELECT record_key, headers, value FROM {} WHERE consumer = ? \
                               AND topic = ? AND `partition` = ? AND `offset` = ? \
                               AND dedup_id IS NULL",
                        self.tables.parked
                    ))
                    .bind(consumer)
                    .bind(&r.position.topic)
                    .bind(r.position.partition)
                    .bind(r.position.offset)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(db)?;
                    match same {
                        Some((k, h, v)) if k != r.key || h != headers || v != r.value => {
                            dedup = Some(content_id(r));
                        }
                        _ => break None,
                    }
                }
                Err(e) => return Err(db(e)),
            }
        };
        let Some(id) = id else {
            return Ok(Parking::AlreadyParked);
        };
        let id = outbox_core::ParkedId(id);
        if status == "parked" {
            if let Some(a) = &r.aggregate {
                sqlx::query(&format!(
                    "UPDATE {} SET blocked = 1, updated_at = UTC_TIMESTAMP(6) \
                     WHERE consumer = ? AND aggregate_key = {KEY_EXPR}",
                    self.tables.aggregates
                ))
                .bind(consumer)
                .bind(&a.aggregate_type)
                .bind(&a.aggregate_id)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            }
            Ok(Parking::Head(id))
        } else {
            Ok(Parking::Waiting(id))
        }
    }
}

/// A parked record's key, headers and value as stored.
type RawRecord = (Option<Vec<u8>>, Vec<u8>, Option<Vec<u8>>);

fn micros(d: Duration) -> i64 {
    d.as_micros().min(i64::MAX as u128) as i64
}

/// Namespace of the aggregate hashes kept beside registrations (a fixed, random UUID; the same
/// as outbox-postgres's, so both stores keep the same value for an aggregate).
const AGGREGATE_NAMESPACE: Uuid = Uuid::from_u128(0x9a41_6e0c_2f7b_4d18_8c53_e1b0_47d9_62af);

/// The hash of an aggregate kept beside a registration: a UUID v5 of the length-prefixed type
/// and id (so no two aggregates share an encoding, whatever characters their names hold).
fn aggregate_hash(a: &AggregateKey) -> Uuid {
    let mut buf = Vec::with_capacity(a.aggregate_type.len() + a.aggregate_id.len() + 16);
    for part in [a.aggregate_type.as_bytes(), a.aggregate_id.as_bytes()] {
        buf.extend_from_slice(&(part.len() as u64).to_be_bytes());
        buf.extend_from_slice(part);
    }
    Uuid::new_v5(&AGGREGATE_NAMESPACE, &buf)
}

/// Namespace of the ids of undecodable records parked after a rewind (a fixed, random UUID).
const CONTENT_NAMESPACE: Uuid = Uuid::from_u128(0x3c5e_8d21_7a4f_4b96_a0e2_5f19_c6d8_0b73);

/// An id for an undecodable record from its position and content (length-prefixed fields).
fn content_id(r: &outbox_core::ParkedRecord) -> Uuid {
    fn field(buf: &mut Vec<u8>, b: Option<&[u8]>) {
        match b {
            Some(b) => {
                buf.push(1);
                buf.extend_from_slice(&(b.len() as u64).to_be_bytes());
                buf.extend_from_slice(b);
            }
            None => buf.push(0),
        }
    }
    let mut buf = Vec::new();
    field(&mut buf, Some(r.position.topic.as_bytes()));
    buf.extend_from_slice(&r.position.partition.to_be_bytes());
    buf.extend_from_slice(&r.position.offset.to_be_bytes());
    field(&mut buf, r.key.as_deref());
    for h in &r.headers {
        field(&mut buf, Some(h.name.as_bytes()));
        field(&mut buf, h.value.as_deref());
    }
    field(&mut buf, r.value.as_deref());
    Uuid::new_v5(&CONTENT_NAMESPACE, &buf)
}

#[async_trait]
impl InboxStore for MySqlInboxStore {
    type Tx = Transaction<'static, MySql>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        // Cancel-safe: see `outbox::tx::begin`.
        crate::outbox::begin(&self.pool).await
    }

    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError> {
        check_consumer(consumer)?;
        let events: Vec<(Uuid, Option<Uuid>)> = ids.iter().map(|i| (i.as_uuid(), None)).collect();
        Ok(self
            .register_rows(tx, consumer, &events)
            .await?
            .into_iter()
            .map(|r| match r {
                AggregateRegistration::Fresh => Registration::Fresh,
                _ => Registration::Duplicate,
            })
            .collect())
    }

    async fn register_for(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        events: &[(EventId, AggregateKey)],
    ) -> Result<Vec<AggregateRegistration>, StoreError> {
        check_consumer(consumer)?;
        let events: Vec<(Uuid, Option<Uuid>)> = events
            .iter()
            .map(|(i, a)| (i.as_uuid(), Some(aggregate_hash(a))))
            .collect();
        self.register_rows(tx, consumer, &events).await
    }

    async fn aggregates(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        aggregates: &[AggregateKey],
    ) -> Result<Vec<AggregateState>, StoreError> {
        check_consumer(consumer)?;
        if aggregates.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT aggregate_type, aggregate_id, applied_version, blocked FROM {} \
             WHERE consumer = ? AND aggregate_key IN ({})",
            self.tables.aggregates,
            vec![KEY_EXPR; aggregates.len()].join(", ")
        );
        let mut q = sqlx::query(&sql).bind(consumer);
        for a in aggregates {
            q = q.bind(&a.aggregate_type).bind(&a.aggregate_id);
        }
        let rows = q.fetch_all(&mut **tx).await.map_err(db)?;
        let mut found: HashMap<(String, String), AggregateState> = HashMap::new();
        for r in &rows {
            found.insert(
                (
                    crate::error::text(r, "aggregate_type")?,
                    crate::error::text(r, "aggregate_id")?,
                ),
                AggregateState::new(
                    r.try_get("applied_version").map_err(db)?,
                    r.try_get("blocked").map_err(db)?,
                ),
            );
        }
        Ok(aggregates
            .iter()
            .map(|a| {
                found
                    .get(&(a.aggregate_type.clone(), a.aggregate_id.clone()))
                    .copied()
                    .unwrap_or_default()
            })
            .collect())
    }

    async fn advance_versions(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let t = &self.tables.aggregates;
        let mut moved = 0usize;
        for u in updates {
            let a = &u.aggregate;
            let matched = match u.expected {
                Some(expected) => sqlx::query(&format!(
                    "UPDATE {t} SET applied_version = ?, updated_at = UTC_TIMESTAMP(6) \
                     WHERE consumer = ? AND aggregate_key = {KEY_EXPR} AND applied_version = ?"
                ))
                .bind(u.version)
                .bind(consumer)
                .bind(&a.aggregate_type)
                .bind(&a.aggregate_id)
                .bind(expected)
                .execute(&mut **tx)
                .await
                .map_err(db)?
                .rows_affected(),
                None => {
                    // Not tracked yet: the row may exist without a version (created by
                    // parking) or not at all.
                    let n = sqlx::query(&format!(
                        "UPDATE {t} SET applied_version = ?, updated_at = UTC_TIMESTAMP(6) \
                         WHERE consumer = ? AND aggregate_key = {KEY_EXPR} \
                           AND applied_version IS NULL"
                    ))
                    .bind(u.version)
                    .bind(consumer)
                    .bind(&a.aggregate_type)
                    .bind(&a.aggregate_id)
                    .execute(&mut **tx)
                    .await
                    .map_err(db)?
                    .rows_affected();
                    if n == 0 {
                        let inserted = sqlx::query(&format!(
                            "INSERT INTO {t} (consumer, aggregate_key, aggregate_type, \
                               aggregate_id, applied_version, updated_at) \
                             VALUES (?, {KEY_EXPR}, ?, ?, ?, UTC_TIMESTAMP(6))"
                        ))
                        .bind(consumer)
                        .bind(&a.aggregate_type)
                        .bind(&a.aggregate_id)
                        .bind(&a.aggregate_type)
                        .bind(&a.aggregate_id)
                        .bind(u.version)
                        .execute(&mut **tx)
                        .await;
                        match inserted {
                            Ok(_) => 1,
                            // Another transaction tracked it meanwhile.
                            Err(e) if is_duplicate(&e) => 0,
                            Err(e) => return Err(db(e)),
                        }
                    } else {
                        n
                    }
                }
            };
            moved += matched as usize;
        }
        if moved != updates.len() {
            return Err(StoreError::new(
                StoreErrorKind::Conflict,
                format!(
                    "{} of {} aggregate versions were moved by another transaction",
                    updates.len() - moved,
                    updates.len()
                ),
            ));
        }
        Ok(())
    }

    async fn park(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        messages: &[NewParkedMessage],
    ) -> Result<Vec<Parking>, StoreError> {
        check_consumer(consumer)?;
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            out.push(self.park_one(tx, consumer, m).await?);
        }
        Ok(out)
    }

    async fn commit(&self, mut tx: Self::Tx) -> Result<(), StoreError> {
        // A failed statement does not abort a MySQL transaction (only that statement is
        // rolled back), but a deadlock or a lock wait timeout (with
        // `innodb_rollback_on_timeout`) rolls the whole transaction back, registration
        // included, and the session goes on in autocommit mode: a handler that ignored that
        // error would have its later statements committed one by one while COMMIT commits
        // nothing, and the engine would count the message applied and commit its offset.
        // MariaDB tells whether the transaction is still open; MySQL has no such variable
        // (1193), and there a handler must not ignore database errors.
        match sqlx::query_scalar::<_, i64>("SELECT CAST(@@in_transaction AS SIGNED)")
            .fetch_one(&mut *tx)
            .await
        {
            Ok(0) => {
                let _ = tx.rollback().await;
                return Err(StoreError::new(
                    StoreErrorKind::Conflict,
                    "nothing was committed: the server rolled the transaction back (a deadlock \
                     or lock wait timeout; did the handler ignore a database error?)",
                ));
            }
            Ok(_) => {}
            Err(e) if error_number(&e) == Some(crate::error::codes::UNKNOWN_SYSTEM_VARIABLE) => {}
            Err(e) => {
                let _ = tx.rollback().await;
                return Err(db(e));
            }
        }
        tx.commit().await.map_err(db)
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        tx.rollback().await.map_err(db)
    }

    async fn cleanup(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError> {
        check_consumer(consumer)?;
        if batch_size == 0 {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "cleanup batch size must be at least 1",
            ));
        }
        let batch = batch_size.min(1_000_000) as i64;
        let n = sqlx::query(&format!(
            "DELETE FROM {} WHERE consumer = ? \
               AND processed_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
             ORDER BY processed_at LIMIT ?",
            self.tables.registrations
        ))
        .bind(consumer)
        .bind(micros(retention))
        .bind(batch)
        .execute(&self.pool)
        .await
        .map_err(db)?
        .rows_affected();
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hash kept beside a registration tells aggregates apart whatever their names hold
    /// (the type and id are length-prefixed, so no split of one string into two collides), and
    /// is stable: a registration written by one version is compared by the next.
    #[test]
    fn aggregate_hashes_are_stable_and_unambiguous() {
        let h = |t: &str, i: &str| aggregate_hash(&AggregateKey::new(t, i));
        assert_ne!(h("ab", "c"), h("a", "bc"));
        assert_ne!(h("a\u{1f}b", "c"), h("a", "b\u{1f}c"));
        assert_ne!(h("order", "1"), h("order", "2"));
        assert_eq!(h("order", "1"), h("order", "1"));
        assert_eq!(
            h("order", "o-1").to_string(),
            "5e4dcc4c-34d0-5ed2-97ac-354d55075b5b",
            "the stored value must not change between versions (computed independently: SHA-1 of \
             the namespace, then each name prefixed by its length as a big-endian u64)"
        );
    }
}
