//! [`PostgresInboxStore`]: the consumer side on PostgreSQL: deduplication, per-aggregate
//! versions and parked messages, in the effect's transaction.

use std::borrow::Cow;
use std::collections::HashSet;
use std::time::Duration;

use sqlx::{PgPool, Postgres, Row, Transaction};
use uuid::Uuid;

use outbox_core::inbox::scoped_dedup_id;
use outbox_core::{
    async_trait, AggregateKey, AggregateRegistration, AggregateState, EventId, InboxStore,
    NewParkedMessage, ParkAs, Parking, Registration, StoreError, StoreErrorKind, VersionAdvance,
};

use crate::config::{DEFAULT_INBOX_TABLE, DEFAULT_SCHEMA};
use crate::error::db;
use crate::schema::{self, qualified, validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};

/// The statement that begins every inbox transaction. `synchronous_commit = on` for the
/// transaction: the engine commits the Kafka offset right after this transaction's commit
/// returns, so the commit must be flushed, whatever the role's or database's default.
pub(crate) const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; \
                                SET LOCAL synchronous_commit TO on";

/// The consumer's store on PostgreSQL.
///
/// * **Deduplication:** `INSERT .. SELECT unnest($ids) ON CONFLICT DO NOTHING RETURNING` in the
///   effect's transaction, one statement per batch. A returned id means "apply"; a missing one
///   means the pair was registered by a committed transaction (or earlier in this one). A
///   concurrent registration of the same pair blocks on the unique index until the first
///   transaction ends. [`InboxStore::register_for`] also writes a hash of the aggregate
///   (column `aggregate`, migration 4) and, for ids it did not insert, reads who holds them: a
///   holder of another aggregate is [`AggregateRegistration::OtherAggregate`].
/// * **Versions and blocking:** table `<table>_aggregates`, read for a batch in one statement;
///   advanced in one statement that matches the expected version, so a concurrent advance (a
///   second consumer instance during a rebalance) is a `Conflict`, never a lost update.
/// * **Parking:** table `<table>_parked` keeps the raw record (key, headers with null values,
///   value), position, reason and attempts; `<table>_audit` keeps every operator action.
///   Parking locks the aggregate's row, as the operator's release does, so a message never
///   waits behind an aggregate that is being released. A message is parked once per dedup
///   id and aggregate: one whose dedup id a parked message of another aggregate holds is
///   parked under [`outbox_core::inbox::scoped_dedup_id`] (and, when a parked message of
///   another aggregate holds that too, a record made to collide, under an id of its position
///   and content: kept, never taken for parked already).
/// * **Durability:** every transaction begins with `SET LOCAL synchronous_commit TO on`.
#[derive(Clone, Debug)]
pub struct PostgresInboxStore {
    pool: PgPool,
    schema: String,
    table: String,
    pub(crate) sql: Sql,
}

/// Statements, rendered once for the configured names.
#[derive(Clone, Debug)]
pub(crate) struct Sql {
    register: String,
    register_for: String,
    registered_aggregates: String,
    cleanup: String,
    cleanup_candidates: String,
    aggregates: String,
    advance: String,
    ensure_aggregate: String,
    lock_aggregate: String,
    block: String,
    insert_parked: String,
    /// Whether the parked message holding a dedup id is of the given aggregate.
    parked_same_aggregate: String,
    same_at_position: String,
    pub(crate) parked: String,
    pub(crate) aggs: String,
    pub(crate) audit: String,
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
    /// Table (default `processed_events`); the versions, parked and audit tables are named
    /// after it (`<table>_aggregates`, `<table>_parked`, `<table>_audit`).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }
    /// Validates the names (`Configuration` error for anything but plain identifiers).
    pub fn build(self) -> Result<PostgresInboxStore, StoreError> {
        validate_identifier("schema", &self.schema, MAX_IDENTIFIER_LEN)?;
        validate_identifier("table", &self.table, MAX_TABLE_NAME_LEN)?;
        let t = qualified(&self.schema, &self.table);
        let aggs = qualified(&self.schema, &format!("{}_aggregates", self.table));
        let parked = qualified(&self.schema, &format!("{}_parked", self.table));
        let audit = qualified(&self.schema, &format!("{}_audit", self.table));
        let sql = Sql {
            register: format!(
                "INSERT INTO {t} (consumer, event_id) SELECT $1, u FROM unnest($2::uuid[]) AS u \
                 ON CONFLICT DO NOTHING RETURNING event_id"
            ),
            register_for: format!(
                "INSERT INTO {t} (consumer, event_id, aggregate) \
                 SELECT $1, u, a FROM unnest($2::uuid[], $3::uuid[]) AS x(u, a) \
                 ON CONFLICT DO NOTHING RETURNING event_id"
            ),
            registered_aggregates: format!(
                "SELECT event_id, aggregate FROM {t} WHERE consumer = $1 AND event_id = ANY($2)"
            ),
            cleanup: format!(
                "DELETE FROM {t} WHERE ctid IN ( \
                   SELECT ctid FROM {t} \
                   WHERE consumer = $1 \
                     AND processed_at < clock_timestamp() - $2::int8 * interval '1 microsecond' \
                   LIMIT $3)"
            ),
            cleanup_candidates: format!(
                "SELECT count(*) FROM {t} \
                 WHERE consumer = $1 \
                   AND processed_at < clock_timestamp() - $2::int8 * interval '1 microsecond'"
            ),
            aggregates: format!(
                "SELECT a.applied_version, coalesce(a.blocked, false) AS blocked \
                 FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS k(t, i, ord) \
                 LEFT JOIN {aggs} a ON a.consumer = $1 AND a.aggregate_type = k.t \
                   AND a.aggregate_id = k.i \
                 ORDER BY k.ord"
            ),
            advance: format!(
                "WITH x AS (SELECT * FROM unnest($2::text[], $3::text[], $4::int8[], $5::int8[]) \
                            AS x(t, i, expected, version)), \
                 ins AS (INSERT INTO {aggs} AS a (consumer, aggregate_type, aggregate_id, applied_version) \
                         SELECT $1, t, i, version FROM x WHERE expected IS NULL \
                         ON CONFLICT (consumer, aggregate_type, aggregate_id) DO UPDATE \
                           SET applied_version = EXCLUDED.applied_version, updated_at = now() \
                           WHERE a.applied_version IS NULL \
                         RETURNING 1), \
                 upd AS (UPDATE {aggs} a SET applied_version = x.version, updated_at = now() \
                         FROM x WHERE x.expected IS NOT NULL AND a.consumer = $1 \
                           AND a.aggregate_type = x.t AND a.aggregate_id = x.i \
                           AND a.applied_version = x.expected \
                         RETURNING 1) \
                 SELECT (SELECT count(*) FROM ins) + (SELECT count(*) FROM upd)"
            ),
            ensure_aggregate: format!(
                "INSERT INTO {aggs} (consumer, aggregate_type, aggregate_id) VALUES ($1, $2, $3) \
                 ON CONFLICT DO NOTHING"
            ),
            lock_aggregate: format!(
                "SELECT blocked FROM {aggs} WHERE consumer = $1 AND aggregate_type = $2 \
                 AND aggregate_id = $3 FOR UPDATE"
            ),
            block: format!(
                "UPDATE {aggs} SET blocked = true, updated_at = now() WHERE consumer = $1 \
                 AND aggregate_type = $2 AND aggregate_id = $3"
            ),
            insert_parked: format!(
                "INSERT INTO {parked} (consumer, topic, \"partition\", \"offset\", record_key, \
                   header_names, header_values, value, aggregate_type, aggregate_id, event_id, \
                   dedup_id, aggregate_version, status, kind, reason, attempts, native_transport, \
                   native_sequence, native_consumer, native_exchange, native_routing_key, \
                   native_redelivered) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
                   $18, $19, $20, $21, $22, $23) \
                 ON CONFLICT DO NOTHING RETURNING id"
            ),
            parked_same_aggregate: format!(
                "SELECT aggregate_type IS NOT DISTINCT FROM $3 \
                   AND aggregate_id IS NOT DISTINCT FROM $4 \
                 FROM {parked} WHERE consumer = $1 AND dedup_id = $2"
            ),
            same_at_position: format!(
                "SELECT record_key IS NOT DISTINCT FROM $5 \
                   AND header_names IS NOT DISTINCT FROM $6::text[] \
                   AND header_values IS NOT DISTINCT FROM $7::bytea[] \
                   AND value IS NOT DISTINCT FROM $8 \
                 FROM {parked} WHERE consumer = $1 AND topic = $2 AND \"partition\" = $3 \
                   AND \"offset\" = $4 AND dedup_id IS NULL"
            ),
            parked,
            aggs,
            audit,
        };
        Ok(PostgresInboxStore {
            pool: self.pool,
            schema: self.schema,
            table: self.table,
            sql,
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
    /// On an existing table, migration 3's index of the registrations is built after the
    /// migrations' transaction with `CREATE INDEX CONCURRENTLY`, as the outbox's
    /// ([`PostgresOutboxStore::migrate`](crate::PostgresOutboxStore::migrate)).
    pub async fn migrate(&self) -> Result<usize, StoreError> {
        schema::migrate(
            &self.pool,
            schema::Component::Inbox,
            &self.schema,
            &self.table,
        )
        .await
    }

    /// How many of `consumer`'s registrations are older than `retention`: what
    /// [`InboxStore::cleanup`] for that consumer and retention would remove (a dry run).
    pub async fn cleanup_candidates(
        &self,
        consumer: &str,
        retention: Duration,
    ) -> Result<u64, StoreError> {
        check_consumer(consumer)?;
        let retention_us = retention.as_micros().min(i64::MAX as u128) as i64;
        let n: i64 = sqlx::query_scalar(&self.sql.cleanup_candidates)
            .bind(consumer)
            .bind(retention_us)
            .fetch_one(&self.pool)
            .await
            .map_err(db)?;
        Ok(n.max(0) as u64)
    }

    /// The inbox schema as plain SQL.
    pub fn schema_sql(&self) -> String {
        schema::inbox_schema_sql(&self.schema, &self.table).expect("names validated by build()")
    }

    async fn park_one(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        m: &NewParkedMessage,
    ) -> Result<Parking, StoreError> {
        let r = &m.record;
        let blocked = match &r.aggregate {
            Some(a) => {
                sqlx::query(&self.sql.ensure_aggregate)
                    .bind(consumer)
                    .bind(pg_text(&a.aggregate_type))
                    .bind(pg_text(&a.aggregate_id))
                    .execute(&mut **tx)
                    .await
                    .map_err(db)?;
                // The row lock serializes this with an operator releasing the aggregate.
                let blocked: bool = sqlx::query_scalar(&self.sql.lock_aggregate)
                    .bind(consumer)
                    .bind(pg_text(&a.aggregate_type))
                    .bind(pg_text(&a.aggregate_id))
                    .fetch_one(&mut **tx)
                    .await
                    .map_err(db)?;
                blocked
            }
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
        let (names, values): (Vec<Cow<'_, str>>, Vec<Option<&[u8]>>) = r
            .headers
            .iter()
            .map(|h| (pg_text(&h.name), h.value.as_deref()))
            .unzip();
        let native = r.position.native_columns();
        // An undecodable record is parked once per its transport's message identity (its
        // derived dedup id, `ParkedRecord::dedup_id`: a JetStream redelivery comes at a new
        // delivery sequence), or, without one (Kafka), once per position.
        // A record without a dedup id is parked once per position. Another
        // record at a position parked before (the log was rewound: a topic recreated, data
        // lost on the broker) is a different record: it is parked under an id derived from
        // its position and content, so it is kept, and its own redeliveries are recognised.
        // A record whose dedup id a parked message of another aggregate holds (a record
        // naming another aggregate's event as its original, or the event such a record
        // named) is not that message either: it is parked under its aggregate-scoped id.
        // A record whose scoped id is held by a parked message of another aggregate too (only
        // a record whose event id was made to be that id can hold it) is parked under an id
        // derived from its position and content: kept, and its redeliveries at that position
        // recognised (one at another position is parked again: kept twice, never lost).
        let mut dedup = r.dedup_id.map(|e| e.as_uuid());
        let mut scoped = false;
        let mut by_content = false;
        let id = loop {
            let id: Option<i64> = sqlx::query_scalar(&self.sql.insert_parked)
                .bind(consumer)
                .bind(pg_text(&r.position.topic))
                .bind(r.position.partition)
                .bind(r.position.offset)
                .bind(r.key.as_deref())
                .bind(&names)
                .bind(&values)
                .bind(r.value.as_deref())
                .bind(r.aggregate.as_ref().map(|a| pg_text(&a.aggregate_type)))
                .bind(r.aggregate.as_ref().map(|a| pg_text(&a.aggregate_id)))
                .bind(r.event_id.map(|e| e.as_uuid()))
                .bind(dedup)
                .bind(r.aggregate_version)
                .bind(status)
                .bind(kind)
                .bind(pg_text(&m.reason))
                .bind(i32::try_from(m.attempts).unwrap_or(i32::MAX))
                .bind(native.transport.as_deref())
                .bind(native.sequence)
                .bind(native.consumer.as_deref().map(pg_text))
                .bind(native.exchange.as_deref().map(pg_text))
                .bind(native.routing_key.as_deref().map(pg_text))
                .bind(native.redelivered)
                .fetch_optional(&mut **tx)
                .await
                .map_err(db)?;
            if id.is_some() {
                break id;
            }
            if let Some(held) = dedup {
                if r.aggregate.is_none() && r.event_id.is_none() && !by_content {
                    // An undecodable record parked by its transport's message identity: held
                    // by a record without an aggregate, that is the same message parked
                    // before (a redelivery); held by a record of an aggregate (only one whose
                    // event id was made to be this id), it is another message: parked under
                    // an id derived from its position and content.
                    let same: Option<bool> = sqlx::query_scalar(&self.sql.parked_same_aggregate)
                        .bind(consumer)
                        .bind(held)
                        .bind(None::<&str>)
                        .bind(None::<&str>)
                        .fetch_optional(&mut **tx)
                        .await
                        .map_err(db)?;
                    if same != Some(false) {
                        break None;
                    }
                    dedup = Some(content_id(r, &names));
                    by_content = true;
                    continue;
                }
                let (Some(a), Some(original), false) = (&r.aggregate, r.dedup_id, by_content)
                else {
                    break None;
                };
                // A statement of its own: it sees the holder that a concurrent transaction
                // committed while the insert waited on it.
                let same: Option<bool> = sqlx::query_scalar(&self.sql.parked_same_aggregate)
                    .bind(consumer)
                    .bind(held)
                    .bind(pg_text(&a.aggregate_type))
                    .bind(pg_text(&a.aggregate_id))
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(db)?;
                if same != Some(false) {
                    break None;
                }
                if scoped {
                    dedup = Some(content_id(r, &names));
                    by_content = true;
                    continue;
                }
                dedup = Some(scoped_dedup_id(a, original).as_uuid());
                scoped = true;
                continue;
            }
            let same: Option<Option<bool>> = sqlx::query_scalar(&self.sql.same_at_position)
                .bind(consumer)
                .bind(pg_text(&r.position.topic))
                .bind(r.position.partition)
                .bind(r.position.offset)
                .bind(r.key.as_deref())
                .bind(&names)
                .bind(&values)
                .bind(r.value.as_deref())
                .fetch_optional(&mut **tx)
                .await
                .map_err(db)?;
            if same.flatten() != Some(false) {
                break None;
            }
            dedup = Some(content_id(r, &names));
        };
        let Some(id) = id else {
            return Ok(Parking::AlreadyParked);
        };
        let id = outbox_core::ParkedId(id);
        if status == "parked" {
            if let Some(a) = &r.aggregate {
                sqlx::query(&self.sql.block)
                    .bind(consumer)
                    .bind(pg_text(&a.aggregate_type))
                    .bind(pg_text(&a.aggregate_id))
                    .execute(&mut **tx)
                    .await
                    .map_err(db)?;
            }
            Ok(Parking::Head(id))
        } else {
            Ok(Parking::Waiting(id))
        }
    }
}

/// `s` as PostgreSQL text: a NUL character (which `text` cannot hold, and which a plain
/// producer's header names and values may carry) becomes U+FFFD. Every string the inbox binds
/// goes through it, so a record with such headers is parked (raw values are kept in `bytea`)
/// instead of failing the statement on every redelivery, and an aggregate key is mapped the
/// same way wherever it is written or read.
pub(crate) fn pg_text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// Namespace of the aggregate hashes kept beside registrations (a fixed, random UUID).
const AGGREGATE_NAMESPACE: Uuid = Uuid::from_u128(0x9a41_6e0c_2f7b_4d18_8c53_e1b0_47d9_62af);

/// The hash of an aggregate kept beside a registration (length-prefixed type and id).
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
fn content_id(r: &outbox_core::ParkedRecord, names: &[Cow<'_, str>]) -> Uuid {
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
    for (name, h) in names.iter().zip(&r.headers) {
        field(&mut buf, Some(name.as_bytes()));
        field(&mut buf, h.value.as_deref());
    }
    field(&mut buf, r.value.as_deref());
    Uuid::new_v5(&CONTENT_NAMESPACE, &buf)
}

fn check_consumer(consumer: &str) -> Result<(), StoreError> {
    if consumer.trim().is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            "consumer name must not be empty",
        ));
    }
    Ok(())
}

#[async_trait]
impl InboxStore for PostgresInboxStore {
    type Tx = Transaction<'static, Postgres>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.pool.begin_with(BEGIN).await.map_err(db)
    }

    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError> {
        check_consumer(consumer)?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let uuids: Vec<Uuid> = ids.iter().map(|i| i.as_uuid()).collect();
        let inserted: Vec<Uuid> = sqlx::query_scalar(&self.sql.register)
            .bind(consumer)
            .bind(&uuids)
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        let mut fresh: HashSet<Uuid> = inserted.into_iter().collect();
        // The first occurrence of an inserted id is fresh; repeats and the rest are duplicates.
        Ok(uuids
            .iter()
            .map(|u| {
                if fresh.remove(u) {
                    Registration::Fresh
                } else {
                    Registration::Duplicate
                }
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
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let uuids: Vec<Uuid> = events.iter().map(|(i, _)| i.as_uuid()).collect();
        let hashes: Vec<Uuid> = events.iter().map(|(_, a)| aggregate_hash(a)).collect();
        let inserted: Vec<Uuid> = sqlx::query_scalar(&self.sql.register_for)
            .bind(consumer)
            .bind(&uuids)
            .bind(&hashes)
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        let mut fresh: HashSet<Uuid> = inserted.into_iter().collect();
        let firsts: Vec<bool> = uuids.iter().map(|u| fresh.remove(u)).collect();
        if firsts.iter().all(|f| *f) {
            return Ok(vec![AggregateRegistration::Fresh; events.len()]);
        }
        // Who holds the others: a statement of its own, so it sees a registration that a
        // concurrent transaction committed while the insert waited on it.
        let held: Vec<Uuid> = uuids
            .iter()
            .zip(&firsts)
            .filter(|(_, f)| !**f)
            .map(|(u, _)| *u)
            .collect();
        let rows = sqlx::query(&self.sql.registered_aggregates)
            .bind(consumer)
            .bind(&held)
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        let mut holders: std::collections::HashMap<Uuid, Option<Uuid>> =
            std::collections::HashMap::with_capacity(rows.len());
        for r in &rows {
            holders.insert(
                r.try_get("event_id").map_err(db)?,
                r.try_get("aggregate").map_err(db)?,
            );
        }
        Ok(uuids
            .iter()
            .zip(&hashes)
            .zip(firsts)
            .map(|((u, h), first)| {
                if first {
                    return AggregateRegistration::Fresh;
                }
                match holders.get(u) {
                    Some(Some(holder)) if holder != h => AggregateRegistration::OtherAggregate,
                    _ => AggregateRegistration::Duplicate,
                }
            })
            .collect())
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
        let (types, ids): (Vec<Cow<'_, str>>, Vec<Cow<'_, str>>) = aggregates
            .iter()
            .map(|a| (pg_text(&a.aggregate_type), pg_text(&a.aggregate_id)))
            .unzip();
        let rows = sqlx::query(&self.sql.aggregates)
            .bind(consumer)
            .bind(&types)
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok(AggregateState::new(
                    r.try_get("applied_version").map_err(db)?,
                    r.try_get("blocked").map_err(db)?,
                ))
            })
            .collect()
    }

    async fn advance_versions(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        if updates.is_empty() {
            return Ok(());
        }
        let types: Vec<Cow<'_, str>> = updates
            .iter()
            .map(|u| pg_text(&u.aggregate.aggregate_type))
            .collect();
        let ids: Vec<Cow<'_, str>> = updates
            .iter()
            .map(|u| pg_text(&u.aggregate.aggregate_id))
            .collect();
        let expected: Vec<Option<i64>> = updates.iter().map(|u| u.expected).collect();
        let versions: Vec<i64> = updates.iter().map(|u| u.version).collect();
        let moved: i64 = sqlx::query_scalar(&self.sql.advance)
            .bind(consumer)
            .bind(&types)
            .bind(&ids)
            .bind(&expected)
            .bind(&versions)
            .fetch_one(&mut **tx)
            .await
            .map_err(db)?;
        if moved != updates.len() as i64 {
            return Err(StoreError::new(
                StoreErrorKind::Conflict,
                format!(
                    "{} of {} aggregate versions were moved by another transaction",
                    updates.len() as i64 - moved,
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
        // `COMMIT` of a transaction that a failed statement aborted rolls back *without an
        // error*. A handler that ignored a database error (the "insert, and treat a unique
        // violation as done" idiom) would then have its effect and registration rolled back
        // while the engine counts the message applied and commits its offset: the message
        // would be lost. Any statement fails in an aborted transaction, so probe first.
        if let Err(e) = sqlx::query("SELECT 1").execute(&mut *tx).await {
            let e = db(e);
            let _ = tx.rollback().await;
            return Err(StoreError::new(
                e.kind,
                format!(
                    "nothing was committed: the transaction was aborted by a failed statement \
                     (did the handler ignore a database error?): {e}"
                ),
            ));
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
        let retention_us = retention.as_micros().min(i64::MAX as u128) as i64;
        let n = sqlx::query(&self.sql.cleanup)
            .bind(consumer)
            .bind(retention_us)
            .bind(batch)
            .execute(&self.pool)
            .await
            .map_err(db)?
            .rows_affected();
        Ok(n)
    }
}
