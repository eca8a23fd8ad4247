//! The operator's side of [`PostgresInboxStore`]: parked messages and their audit.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use outbox_core::{
    async_trait, AggregateKey, InboxAction, InboxAuditEntry, InboxParking, LogPosition,
    NativeColumns, ParkKind, ParkedChange, ParkedFilter, ParkedId, ParkedMessage, ParkedRecord,
    ParkedStats, ParkedStatus, RecordHeader, RetryRequest, StoreError, StoreErrorKind,
};

use crate::error::db;
use crate::inbox::{pg_text, PostgresInboxStore};

const COLUMNS: &str = "id, consumer, topic, \"partition\", \"offset\", record_key, header_names, \
                       header_values, value, status, kind, reason, attempts, parked_at, resolved_at, \
                       retry_requested_at, retry_requested_by, retry_requested_reason, \
                       native_transport, native_sequence, native_consumer, native_exchange, \
                       native_routing_key, native_redelivered";
const OPEN: &str = "status IN ('parked', 'waiting')";

fn corrupt(what: &str, value: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Schema,
        format!("unexpected {what} {value:?} in the parked table"),
    )
}

fn to_parked(row: &PgRow) -> Result<ParkedMessage, StoreError> {
    let names: Vec<String> = row.try_get("header_names").map_err(db)?;
    let values: Vec<Option<Vec<u8>>> = row.try_get("header_values").map_err(db)?;
    let headers = names
        .into_iter()
        .zip(values)
        .map(|(name, value)| RecordHeader { name, value })
        .collect();
    let position = LogPosition::from_columns(
        row.try_get::<String, _>("topic").map_err(db)?,
        row.try_get("partition").map_err(db)?,
        row.try_get("offset").map_err(db)?,
        NativeColumns::new(
            row.try_get("native_transport").map_err(db)?,
            row.try_get("native_sequence").map_err(db)?,
            row.try_get("native_consumer").map_err(db)?,
            row.try_get("native_exchange").map_err(db)?,
            row.try_get("native_routing_key").map_err(db)?,
            row.try_get("native_redelivered").map_err(db)?,
        ),
    )
    .map_err(|e| StoreError::new(StoreErrorKind::Schema, e.to_string()))?;
    let record = ParkedRecord::new(
        position,
        row.try_get("record_key").map_err(db)?,
        headers,
        row.try_get("value").map_err(db)?,
    );
    let status: String = row.try_get("status").map_err(db)?;
    let kind: Option<String> = row.try_get("kind").map_err(db)?;
    let attempts: i32 = row.try_get("attempts").map_err(db)?;
    let requested_at: Option<DateTime<Utc>> = row.try_get("retry_requested_at").map_err(db)?;
    let retry_request = match requested_at {
        Some(at) => Some(RetryRequest::new(
            row.try_get::<Option<String>, _>("retry_requested_by")
                .map_err(db)?
                .unwrap_or_default(),
            row.try_get::<Option<String>, _>("retry_requested_reason")
                .map_err(db)?
                .unwrap_or_default(),
            at,
        )),
        None => None,
    };
    Ok(ParkedMessage::new(
        ParkedId(row.try_get("id").map_err(db)?),
        row.try_get::<String, _>("consumer").map_err(db)?,
        record,
        ParkedStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
        match kind {
            Some(k) => Some(ParkKind::parse(&k).ok_or_else(|| corrupt("kind", &k))?),
            None => None,
        },
        row.try_get::<String, _>("reason").map_err(db)?,
        u32::try_from(attempts).unwrap_or(0),
        row.try_get::<DateTime<Utc>, _>("parked_at").map_err(db)?,
        row.try_get::<Option<DateTime<Utc>>, _>("resolved_at")
            .map_err(db)?,
    )
    .with_retry_request(retry_request))
}

fn to_audit(row: &PgRow) -> Result<InboxAuditEntry, StoreError> {
    let action: String = row.try_get("action").map_err(db)?;
    Ok(InboxAuditEntry::new(
        row.try_get::<String, _>("consumer").map_err(db)?,
        ParkedId(row.try_get("parked_id").map_err(db)?),
        InboxAction::parse(&action).ok_or_else(|| corrupt("action", &action))?,
        row.try_get::<String, _>("actor").map_err(db)?,
        row.try_get::<String, _>("reason").map_err(db)?,
        row.try_get::<String, _>("outcome").map_err(db)?,
        row.try_get::<DateTime<Utc>, _>("at").map_err(db)?,
    ))
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

impl PostgresInboxStore {
    /// `aggregate`'s parked messages of `consumer` matching `condition` (an SQL predicate
    /// followed by its `ORDER BY`), read in `tx`.
    async fn parked_of_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        aggregate: &AggregateKey,
        condition: &str,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = $1 AND aggregate_type = $2 \
             AND aggregate_id = $3 AND {condition}",
            self.sql.parked
        );
        let rows = sqlx::query(&sql)
            .bind(consumer)
            .bind(pg_text(&aggregate.aggregate_type))
            .bind(pg_text(&aggregate.aggregate_id))
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        rows.iter().map(to_parked).collect()
    }
}

#[async_trait]
impl InboxParking for PostgresInboxStore {
    async fn list_parked(
        &self,
        consumer: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = $1 AND (NOT $2 OR {OPEN}) \
             AND ($3::text IS NULL OR (aggregate_type = $3 AND aggregate_id = $4)) \
             ORDER BY id LIMIT $5",
            self.sql.parked
        );
        let rows = sqlx::query(&sql)
            .bind(consumer)
            .bind(filter.open_only)
            .bind(
                filter
                    .aggregate
                    .as_ref()
                    .map(|a| pg_text(&a.aggregate_type)),
            )
            .bind(filter.aggregate.as_ref().map(|a| pg_text(&a.aggregate_id)))
            .bind(i64::try_from(filter.limit).unwrap_or(i64::MAX))
            .fetch_all(self.pool())
            .await
            .map_err(db)?;
        rows.iter().map(to_parked).collect()
    }

    async fn parked_message(
        &self,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = $1 AND id = $2",
            self.sql.parked
        );
        let row = sqlx::query(&sql)
            .bind(consumer)
            .bind(id.0)
            .fetch_optional(self.pool())
            .await
            .map_err(db)?;
        row.as_ref().map(to_parked).transpose()
    }

    async fn open_parked_of(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        // The aggregate's row lock: parking behind it waits until this transaction ends.
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3 \
             FOR UPDATE",
            self.sql.aggs
        ))
        .bind(consumer)
        .bind(pg_text(&aggregate.aggregate_type))
        .bind(pg_text(&aggregate.aggregate_id))
        .fetch_optional(&mut **tx)
        .await
        .map_err(db)?;
        self.parked_of_in(
            tx,
            consumer,
            aggregate,
            &format!("{OPEN} ORDER BY aggregate_version NULLS FIRST, id"),
        )
        .await
    }

    async fn discarded_of(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        self.parked_of_in(tx, consumer, aggregate, "status = 'discarded' ORDER BY id")
            .await
    }

    async fn parked_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = $1 AND id = $2 FOR UPDATE",
            self.sql.parked
        );
        let row = sqlx::query(&sql)
            .bind(consumer)
            .bind(id.0)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db)?;
        row.as_ref().map(to_parked).transpose()
    }

    async fn change_parked(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        id: ParkedId,
        change: &ParkedChange,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let changed = match change {
            ParkedChange::Resolved(status) => {
                if status.is_open() {
                    return Err(StoreError::new(
                        StoreErrorKind::Validation,
                        format!("{} is not a resolution", status.as_str()),
                    ));
                }
                sqlx::query(&format!(
                    "UPDATE {} SET status = $3, resolved_at = now(), retry_requested_at = NULL, \
                       retry_requested_by = NULL, retry_requested_reason = NULL \
                     WHERE consumer = $1 AND id = $2 AND {OPEN}",
                    self.sql.parked
                ))
                .bind(consumer)
                .bind(id.0)
                .bind(status.as_str())
                .execute(&mut **tx)
                .await
                .map_err(db)?
                .rows_affected()
            }
            ParkedChange::Failed {
                kind,
                reason,
                attempts,
            } => sqlx::query(&format!(
                "UPDATE {} SET status = 'parked', kind = $3, reason = $4, attempts = $5 \
                     WHERE consumer = $1 AND id = $2 AND {OPEN}",
                self.sql.parked
            ))
            .bind(consumer)
            .bind(id.0)
            .bind(kind.as_str())
            .bind(pg_text(reason))
            .bind(i32::try_from(*attempts).unwrap_or(i32::MAX))
            .execute(&mut **tx)
            .await
            .map_err(db)?
            .rows_affected(),
        };
        if changed == 0 {
            return Err(StoreError::new(
                StoreErrorKind::NotFound,
                format!("no open parked message {id} for consumer {consumer}"),
            ));
        }
        Ok(())
    }

    async fn unblock(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let open: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {} WHERE consumer = $1 AND aggregate_type = $2 \
             AND aggregate_id = $3 AND {OPEN}",
            self.sql.parked
        ))
        .bind(consumer)
        .bind(pg_text(&aggregate.aggregate_type))
        .bind(pg_text(&aggregate.aggregate_id))
        .fetch_one(&mut **tx)
        .await
        .map_err(db)?;
        if open > 0 {
            return Err(StoreError::new(
                StoreErrorKind::Conflict,
                format!("aggregate {aggregate} still has {open} open parked messages"),
            ));
        }
        sqlx::query(&format!(
            "UPDATE {} SET blocked = false, updated_at = now() WHERE consumer = $1 \
             AND aggregate_type = $2 AND aggregate_id = $3",
            self.sql.aggs
        ))
        .bind(consumer)
        .bind(pg_text(&aggregate.aggregate_type))
        .bind(pg_text(&aggregate.aggregate_id))
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn audit(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        entry: &InboxAuditEntry,
    ) -> Result<(), StoreError> {
        check_consumer(&entry.consumer)?;
        sqlx::query(&format!(
            "INSERT INTO {} (consumer, parked_id, action, actor, reason, outcome) \
             VALUES ($1, $2, $3, $4, $5, $6)",
            self.sql.audit
        ))
        .bind(&entry.consumer)
        .bind(entry.parked_id.0)
        .bind(entry.action.as_str())
        .bind(pg_text(&entry.actor))
        .bind(pg_text(&entry.reason))
        .bind(pg_text(&entry.outcome))
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn audit_trail(
        &self,
        consumer: &str,
        id: Option<ParkedId>,
    ) -> Result<Vec<InboxAuditEntry>, StoreError> {
        check_consumer(consumer)?;
        let rows = sqlx::query(&format!(
            "SELECT consumer, parked_id, action, actor, reason, outcome, at FROM {} \
             WHERE consumer = $1 AND ($2::int8 IS NULL OR parked_id = $2) ORDER BY id",
            self.sql.audit
        ))
        .bind(consumer)
        .bind(id.map(|i| i.0))
        .fetch_all(self.pool())
        .await
        .map_err(db)?;
        rows.iter().map(to_audit).collect()
    }

    async fn parked_stats(&self, consumer: &str) -> Result<ParkedStats, StoreError> {
        check_consumer(consumer)?;
        let row = sqlx::query(&format!(
            "SELECT count(*) FILTER (WHERE status = 'parked') AS parked, \
                    count(*) FILTER (WHERE status = 'waiting') AS waiting, \
                    min(parked_at) AS oldest \
             FROM {} WHERE consumer = $1 AND {OPEN}",
            self.sql.parked
        ))
        .bind(consumer)
        .fetch_one(self.pool())
        .await
        .map_err(db)?;
        let parked: i64 = row.try_get("parked").map_err(db)?;
        let waiting: i64 = row.try_get("waiting").map_err(db)?;
        Ok(ParkedStats::new(
            parked as u64,
            waiting as u64,
            row.try_get("oldest").map_err(db)?,
        ))
    }

    async fn request_retry(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        id: ParkedId,
        request: &RetryRequest,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let changed = sqlx::query(&format!(
            "UPDATE {} SET retry_requested_at = $3, retry_requested_by = $4, \
               retry_requested_reason = $5 \
             WHERE consumer = $1 AND id = $2 AND {OPEN}",
            self.sql.parked
        ))
        .bind(consumer)
        .bind(id.0)
        .bind(request.requested_at)
        .bind(&request.actor)
        .bind(&request.reason)
        .execute(&mut **tx)
        .await
        .map_err(db)?
        .rows_affected();
        if changed == 0 {
            return Err(StoreError::new(
                StoreErrorKind::NotFound,
                format!("no open parked message {id} for consumer {consumer}"),
            ));
        }
        Ok(())
    }

    async fn requested_retries(&self, consumer: &str) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = $1 AND retry_requested_at IS NOT NULL \
             AND {OPEN} ORDER BY retry_requested_at, id",
            self.sql.parked
        );
        let rows = sqlx::query(&sql)
            .bind(consumer)
            .fetch_all(self.pool())
            .await
            .map_err(db)?;
        rows.iter().map(to_parked).collect()
    }

    async fn clear_retry_request(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        consumer: &str,
        id: ParkedId,
        requested_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        sqlx::query(&format!(
            "UPDATE {} SET retry_requested_at = NULL, retry_requested_by = NULL, \
               retry_requested_reason = NULL \
             WHERE consumer = $1 AND id = $2 AND retry_requested_at <= $3",
            self.sql.parked
        ))
        .bind(consumer)
        .bind(id.0)
        .bind(requested_at)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }
}
