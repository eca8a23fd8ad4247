//! The operator's side of [`MySqlInboxStore`]: parked messages and their audit.

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::mysql::MySqlRow;
use sqlx::{MySql, Row, Transaction};

use outbox_core::{
    async_trait, AggregateKey, InboxAction, InboxAuditEntry, InboxParking, LogPosition,
    NativeColumns, ParkKind, ParkedChange, ParkedFilter, ParkedId, ParkedMessage, ParkedRecord,
    ParkedStats, ParkedStatus, RecordHeader, RetryRequest, StoreError, StoreErrorKind,
};

use crate::error::db;
use crate::inbox::{check_consumer, MySqlInboxStore, KEY_EXPR};

const COLUMNS: &str = "id, consumer, topic, `partition`, `offset`, record_key, headers, value, \
                       status, kind, reason, attempts, parked_at, resolved_at, \
                       retry_requested_at, retry_requested_by, retry_requested_reason, \
                       native_transport, native_sequence, native_consumer, native_exchange, \
                       native_routing_key, native_redelivered";
const OPEN: &str = "status IN ('parked', 'waiting')";

/// Headers as stored: per header a 4-byte big-endian name length, the name, a flag byte (0:
/// null value, 1: a value), and for a value its 4-byte length and bytes. Raw, so names and
/// values are kept exactly, null values included.
pub(crate) fn encode_headers(headers: &[RecordHeader]) -> Vec<u8> {
    let mut out = Vec::new();
    for h in headers {
        out.extend_from_slice(&(h.name.len() as u32).to_be_bytes());
        out.extend_from_slice(h.name.as_bytes());
        match &h.value {
            Some(v) => {
                out.push(1);
                out.extend_from_slice(&(v.len() as u32).to_be_bytes());
                out.extend_from_slice(v);
            }
            None => out.push(0),
        }
    }
    out
}

/// The inverse of [`encode_headers`]; `None` for bytes it did not write.
pub(crate) fn decode_headers(mut b: &[u8]) -> Option<Vec<RecordHeader>> {
    fn take<'a>(b: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if b.len() < n {
            return None;
        }
        let (head, tail) = b.split_at(n);
        *b = tail;
        Some(head)
    }
    fn len(b: &mut &[u8]) -> Option<usize> {
        let raw: [u8; 4] = take(b, 4)?.try_into().ok()?;
        Some(u32::from_be_bytes(raw) as usize)
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let n = len(&mut b)?;
        let name = String::from_utf8(take(&mut b, n)?.to_vec()).ok()?;
        let value = match take(&mut b, 1)?[0] {
            0 => None,
            1 => {
                let n = len(&mut b)?;
                Some(take(&mut b, n)?.to_vec())
            }
            _ => return None,
        };
        out.push(RecordHeader { name, value });
    }
    Some(out)
}

fn corrupt(what: &str, value: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Schema,
        format!("unexpected {what} {value:?} in the parked table"),
    )
}

fn to_parked(row: &MySqlRow) -> Result<ParkedMessage, StoreError> {
    let raw: Vec<u8> = row.try_get("headers").map_err(db)?;
    let headers = decode_headers(&raw).ok_or_else(|| corrupt("headers", "<bytes>"))?;
    let position = LogPosition::from_columns(
        crate::error::text(row, "topic")?,
        row.try_get("partition").map_err(db)?,
        row.try_get("offset").map_err(db)?,
        NativeColumns::new(
            crate::error::opt_text(row, "native_transport")?,
            row.try_get("native_sequence").map_err(db)?,
            crate::error::opt_text(row, "native_consumer")?,
            crate::error::opt_text(row, "native_exchange")?,
            crate::error::opt_text(row, "native_routing_key")?,
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
    let status: String = crate::error::text(row, "status")?;
    let kind: Option<String> = crate::error::opt_text(row, "kind")?;
    let attempts: i32 = row.try_get("attempts").map_err(db)?;
    let requested_at: Option<NaiveDateTime> = row.try_get("retry_requested_at").map_err(db)?;
    let retry_request = match requested_at {
        Some(at) => Some(RetryRequest::new(
            crate::error::opt_text(row, "retry_requested_by")?.unwrap_or_default(),
            crate::error::opt_text(row, "retry_requested_reason")?.unwrap_or_default(),
            at.and_utc(),
        )),
        None => None,
    };
    Ok(ParkedMessage::new(
        ParkedId(row.try_get("id").map_err(db)?),
        crate::error::text(row, "consumer")?,
        record,
        ParkedStatus::parse(&status).ok_or_else(|| corrupt("status", &status))?,
        match kind {
            Some(k) => Some(ParkKind::parse(&k).ok_or_else(|| corrupt("kind", &k))?),
            None => None,
        },
        crate::error::text(row, "reason")?,
        u32::try_from(attempts).unwrap_or(0),
        row.try_get::<NaiveDateTime, _>("parked_at")
            .map_err(db)?
            .and_utc(),
        row.try_get::<Option<NaiveDateTime>, _>("resolved_at")
            .map_err(db)?
            .map(|t| t.and_utc()),
    )
    .with_retry_request(retry_request))
}

fn to_audit(row: &MySqlRow) -> Result<InboxAuditEntry, StoreError> {
    let action: String = crate::error::text(row, "action")?;
    Ok(InboxAuditEntry::new(
        crate::error::text(row, "consumer")?,
        ParkedId(row.try_get("parked_id").map_err(db)?),
        InboxAction::parse(&action).ok_or_else(|| corrupt("action", &action))?,
        crate::error::text(row, "actor")?,
        crate::error::text(row, "reason")?,
        crate::error::text(row, "outcome")?,
        row.try_get::<NaiveDateTime, _>("at").map_err(db)?.and_utc(),
    ))
}

impl MySqlInboxStore {
    /// `aggregate`'s parked messages of `consumer` matching `condition` (an SQL predicate
    /// followed by its `ORDER BY`), read in `tx`.
    async fn parked_of_in(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        aggregate: &AggregateKey,
        condition: &str,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = ? AND aggregate_key = {KEY_EXPR} \
             AND {condition}",
            self.tables.parked
        );
        let rows = sqlx::query(&sql)
            .bind(consumer)
            .bind(&aggregate.aggregate_type)
            .bind(&aggregate.aggregate_id)
            .fetch_all(&mut **tx)
            .await
            .map_err(db)?;
        rows.iter().map(to_parked).collect()
    }
}

#[async_trait]
impl InboxParking for MySqlInboxStore {
    async fn list_parked(
        &self,
        consumer: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let open = if filter.open_only { OPEN } else { "TRUE" };
        let (agg, limit) = (
            filter.aggregate.as_ref(),
            i64::try_from(filter.limit).unwrap_or(i64::MAX),
        );
        let by_agg = if agg.is_some() {
            format!("aggregate_key = {KEY_EXPR}")
        } else {
            "TRUE".to_owned()
        };
        let sql = format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = ? AND {open} AND {by_agg} \
             ORDER BY id LIMIT ?",
            self.tables.parked
        );
        let mut q = sqlx::query(&sql).bind(consumer);
        if let Some(a) = agg {
            q = q.bind(&a.aggregate_type).bind(&a.aggregate_id);
        }
        let rows = q.bind(limit).fetch_all(self.pool()).await.map_err(db)?;
        rows.iter().map(to_parked).collect()
    }

    async fn parked_message(
        &self,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = ? AND id = ?",
            self.tables.parked
        ))
        .bind(consumer)
        .bind(id.0)
        .fetch_optional(self.pool())
        .await
        .map_err(db)?;
        row.as_ref().map(to_parked).transpose()
    }

    async fn open_parked_of(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        // The aggregate's row lock: parking behind it waits until this transaction ends.
        sqlx::query(&format!(
            "SELECT 1 FROM {} WHERE consumer = ? AND aggregate_key = {KEY_EXPR} FOR UPDATE",
            self.tables.aggregates
        ))
        .bind(consumer)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
        .fetch_optional(&mut **tx)
        .await
        .map_err(db)?;
        // MySQL sorts NULLs first: undecodable messages (no version) come first.
        self.parked_of_in(
            tx,
            consumer,
            aggregate,
            &format!("{OPEN} ORDER BY aggregate_version, id"),
        )
        .await
    }

    async fn discarded_of(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        self.parked_of_in(tx, consumer, aggregate, "status = 'discarded' ORDER BY id")
            .await
    }

    async fn parked_in(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = ? AND id = ? FOR UPDATE",
            self.tables.parked
        ))
        .bind(consumer)
        .bind(id.0)
        .fetch_optional(&mut **tx)
        .await
        .map_err(db)?;
        row.as_ref().map(to_parked).transpose()
    }

    async fn change_parked(
        &self,
        tx: &mut Transaction<'static, MySql>,
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
                    "UPDATE {} SET status = ?, resolved_at = UTC_TIMESTAMP(6), \
                       retry_requested_at = NULL, retry_requested_by = NULL, \
                       retry_requested_reason = NULL \
                     WHERE consumer = ? AND id = ? AND {OPEN}",
                    self.tables.parked
                ))
                .bind(status.as_str())
                .bind(consumer)
                .bind(id.0)
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
                "UPDATE {} SET status = 'parked', kind = ?, reason = ?, attempts = ? \
                 WHERE consumer = ? AND id = ? AND {OPEN}",
                self.tables.parked
            ))
            .bind(kind.as_str())
            .bind(reason)
            .bind(i32::try_from(*attempts).unwrap_or(i32::MAX))
            .bind(consumer)
            .bind(id.0)
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
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let open: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} WHERE consumer = ? AND aggregate_key = {KEY_EXPR} AND {OPEN}",
            self.tables.parked
        ))
        .bind(consumer)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
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
            "UPDATE {} SET blocked = 0, updated_at = UTC_TIMESTAMP(6) \
             WHERE consumer = ? AND aggregate_key = {KEY_EXPR}",
            self.tables.aggregates
        ))
        .bind(consumer)
        .bind(&aggregate.aggregate_type)
        .bind(&aggregate.aggregate_id)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn audit(
        &self,
        tx: &mut Transaction<'static, MySql>,
        entry: &InboxAuditEntry,
    ) -> Result<(), StoreError> {
        check_consumer(&entry.consumer)?;
        sqlx::query(&format!(
            "INSERT INTO {} (consumer, parked_id, action, actor, reason, outcome, at) \
             VALUES (?, ?, ?, ?, ?, ?, UTC_TIMESTAMP(6))",
            self.tables.audit
        ))
        .bind(&entry.consumer)
        .bind(entry.parked_id.0)
        .bind(entry.action.as_str())
        .bind(&entry.actor)
        .bind(&entry.reason)
        .bind(&entry.outcome)
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
             WHERE consumer = ? AND (? IS NULL OR parked_id = ?) ORDER BY id",
            self.tables.audit
        ))
        .bind(consumer)
        .bind(id.map(|i| i.0))
        .bind(id.map(|i| i.0))
        .fetch_all(self.pool())
        .await
        .map_err(db)?;
        rows.iter().map(to_audit).collect()
    }

    async fn parked_stats(&self, consumer: &str) -> Result<ParkedStats, StoreError> {
        check_consumer(consumer)?;
        let row = sqlx::query(&format!(
            "SELECT CAST(COALESCE(SUM(status = 'parked'), 0) AS SIGNED) AS parked, \
                    CAST(COALESCE(SUM(status = 'waiting'), 0) AS SIGNED) AS waiting, \
                    MIN(parked_at) AS oldest \
             FROM {} WHERE consumer = ? AND {OPEN}",
            self.tables.parked
        ))
        .bind(consumer)
        .fetch_one(self.pool())
        .await
        .map_err(db)?;
        let parked: i64 = row.try_get("parked").map_err(db)?;
        let waiting: i64 = row.try_get("waiting").map_err(db)?;
        let oldest: Option<NaiveDateTime> = row.try_get("oldest").map_err(db)?;
        Ok(ParkedStats::new(
            parked.max(0) as u64,
            waiting.max(0) as u64,
            oldest.map(|t| t.and_utc()),
        ))
    }

    async fn request_retry(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        id: ParkedId,
        request: &RetryRequest,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        let changed = sqlx::query(&format!(
            "UPDATE {} SET retry_requested_at = ?, retry_requested_by = ?, \
               retry_requested_reason = ? \
             WHERE consumer = ? AND id = ? AND {OPEN}",
            self.tables.parked
        ))
        .bind(request.requested_at.naive_utc())
        .bind(&request.actor)
        .bind(&request.reason)
        .bind(consumer)
        .bind(id.0)
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
        let rows = sqlx::query(&format!(
            "SELECT {COLUMNS} FROM {} WHERE consumer = ? AND retry_requested_at IS NOT NULL \
             AND {OPEN} ORDER BY retry_requested_at, id",
            self.tables.parked
        ))
        .bind(consumer)
        .fetch_all(self.pool())
        .await
        .map_err(db)?;
        rows.iter().map(to_parked).collect()
    }

    async fn clear_retry_request(
        &self,
        tx: &mut Transaction<'static, MySql>,
        consumer: &str,
        id: ParkedId,
        requested_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        sqlx::query(&format!(
            "UPDATE {} SET retry_requested_at = NULL, retry_requested_by = NULL, \
               retry_requested_reason = NULL \
             WHERE consumer = ? AND id = ? AND retry_requested_at <= ?",
            self.tables.parked
        ))
        .bind(consumer)
        .bind(id.0)
        .bind(requested_at.naive_utc())
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_with_null_and_binary_values() {
        let cases = vec![
            vec![],
            vec![
                RecordHeader::new("a", b"1".to_vec()),
                RecordHeader::null("n"),
            ],
            vec![
                RecordHeader::new("", Vec::new()),
                RecordHeader::new("bin", vec![0, 255, 10, 0]),
                RecordHeader::new("ünï", "x".repeat(70_000).into_bytes()),
            ],
        ];
        for headers in cases {
            assert_eq!(decode_headers(&encode_headers(&headers)), Some(headers));
        }
        for bad in [&[0u8, 0, 0][..], &[0, 0, 0, 1, b'a'], &[0, 0, 0, 0, 7]] {
            assert_eq!(decode_headers(bad), None, "{bad:?}");
        }
    }
}
