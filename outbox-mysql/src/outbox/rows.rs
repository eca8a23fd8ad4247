//! Row mapping: envelopes and parked events out of result rows; the columns they read.

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::mysql::MySqlRow;
use sqlx::Row;
use uuid::Uuid;

use outbox_core::{
    AckMetadata, Envelope, EnvelopeLimits, ErrorClass, EventId, LastError, ParkKind, ParkReason,
    ParkedEvent, Payload, StoreError, StoreErrorKind,
};

use crate::error::db;

/// Envelope columns, as [`envelope_from_row`] reads them (without a table alias).
pub(crate) const ENVELOPE_COLS: &str = "event_id, aggregate_type, aggregate_id, \
    aggregate_version, event_type, schema_version, content_type, payload, headers, created_at";

/// Columns of a parked row as [`parked_from_row`] reads them.
pub(crate) const PARKED_COLS: &str = "attempts, park_kind, last_error_class, last_error_kind, \
    last_error_message, parked_at, maybe_delivered";

/// The acknowledgement columns, in the order [`ack_from_row`] reads them.
pub(crate) const ACK_COLS: &str =
    "ack_transport, ack_destination, ack_partition, ack_position, ack_route, ack_duplicate";

/// Reads the acknowledgement columns (`ACK_COLS`) of a row: `None` when it has none; an
/// unknown transport or an incomplete acknowledgement is a `Schema` error (written by a newer
/// version, or by hand), never guessed.
pub(crate) fn ack_from_row(row: &MySqlRow) -> Result<Option<AckMetadata>, StoreError> {
    use crate::error::opt_text;
    let transport = opt_text(row, "ack_transport")?;
    let duplicate: Option<bool> = row.try_get("ack_duplicate").map_err(db)?;
    AckMetadata::from_columns(
        transport.as_deref(),
        opt_text(row, "ack_destination")?,
        row.try_get("ack_partition").map_err(db)?,
        row.try_get("ack_position").map_err(db)?,
        opt_text(row, "ack_route")?,
        duplicate,
    )
    .map_err(|e| StoreError::new(StoreErrorKind::Schema, e.to_string()))
}

/// A `DATETIME(6)` read as UTC (the store writes UTC_TIMESTAMP(6) and UTC values only).
pub(crate) fn utc(t: NaiveDateTime) -> DateTime<Utc> {
    t.and_utc()
}

/// Reads the envelope columns of a row. Size limits are not checked again
/// ([`EnvelopeLimits::unlimited`]): the event was validated when it was appended, and a later
/// change of limits (or the header a re-issue adds) must not make it unreadable.
pub(crate) fn envelope_from_row(row: &MySqlRow) -> Result<Envelope, StoreError> {
    let event_id: Uuid = row.try_get("event_id").map_err(db)?;
    let headers: String = crate::error::text(row, "headers")?;
    let headers: serde_json::Value = serde_json::from_str(&headers).map_err(|e| {
        StoreError::new(
            StoreErrorKind::Schema,
            format!("stored event {event_id} has headers that are not JSON: {e}"),
        )
    })?;
    let created: NaiveDateTime = row.try_get("created_at").map_err(db)?;
    let mut b = Envelope::builder(
        crate::error::text(row, "aggregate_type")?,
        crate::error::text(row, "aggregate_id")?,
        row.try_get::<i64, _>("aggregate_version").map_err(db)?,
        crate::error::text(row, "event_type")?,
    )
    .event_id(EventId::from_uuid(event_id))
    .schema_version(row.try_get("schema_version").map_err(db)?)
    .payload(Payload::new(
        crate::error::text(row, "content_type")?,
        row.try_get::<Vec<u8>, _>("payload").map_err(db)?,
    ))
    .created_at(utc(created))
    .limits(EnvelopeLimits::unlimited());
    if let serde_json::Value::Object(map) = headers {
        for (k, v) in map {
            if let serde_json::Value::String(v) = v {
                b = b.header(k, v);
            }
        }
    }
    b.build().map_err(|e| {
        StoreError::new(
            StoreErrorKind::Schema,
            format!("stored event {event_id} no longer passes validation: {e}"),
        )
        .with_source(e)
    })
}

/// Reads a parked row (envelope and [`PARKED_COLS`]).
pub(crate) fn parked_from_row(row: &MySqlRow) -> Result<ParkedEvent, StoreError> {
    let envelope = envelope_from_row(row)?;
    let attempts: i32 = row.try_get("attempts").map_err(db)?;
    let kind: Option<String> = crate::error::opt_text(row, "park_kind")?;
    let class: Option<String> = crate::error::opt_text(row, "last_error_class")?;
    let reason = ParkReason {
        kind: kind
            .as_deref()
            .and_then(ParkKind::parse)
            .unwrap_or(ParkKind::PermanentError),
        error: LastError {
            class: if class.as_deref() == Some("transient") {
                ErrorClass::Transient
            } else {
                ErrorClass::Permanent
            },
            kind: crate::error::opt_text(row, "last_error_kind")?.unwrap_or_default(),
            message: crate::error::opt_text(row, "last_error_message")?.unwrap_or_default(),
        },
    };
    let parked_at: Option<NaiveDateTime> = row.try_get("parked_at").map_err(db)?;
    let uncertain: bool = row.try_get("maybe_delivered").map_err(db)?;
    Ok(ParkedEvent::new(
        envelope,
        attempts.max(0) as u32,
        reason,
        parked_at.map(utc).unwrap_or_default(),
    )
    .with_delivery_uncertain(uncertain))
}

/// The headers of `e` as stored (a JSON object).
pub(crate) fn headers_json(e: &Envelope) -> Result<String, StoreError> {
    serde_json::to_string(&e.headers)
        .map_err(|err| StoreError::new(StoreErrorKind::Validation, err.to_string()))
}
