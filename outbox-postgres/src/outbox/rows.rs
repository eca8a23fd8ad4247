//! Row mapping: envelopes and parked events out of result rows.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::Row;
use uuid::Uuid;

use outbox_core::{
    AckMetadata, Envelope, EnvelopeLimits, ErrorClass, EventId, LastError, ParkKind, ParkReason,
    ParkedEvent, Payload, StoreError, StoreErrorKind,
};

use crate::error::db;

/// The acknowledgement columns, in the order [`ack_from_row`] reads them.
pub(crate) const ACK_COLS: &str =
    "ack_transport, ack_destination, ack_partition, ack_position, ack_route, ack_duplicate";

/// Reads the acknowledgement columns (`ACK_COLS`) of a row: `None` when it has none; an
/// unknown transport or an incomplete acknowledgement is a `Schema` error (written by a newer
/// version, or by hand), never guessed.
pub(crate) fn ack_from_row(row: &PgRow) -> Result<Option<AckMetadata>, StoreError> {
    let transport: Option<String> = row.try_get("ack_transport").map_err(db)?;
    AckMetadata::from_columns(
        transport.as_deref(),
        row.try_get("ack_destination").map_err(db)?,
        row.try_get("ack_partition").map_err(db)?,
        row.try_get("ack_position").map_err(db)?,
        row.try_get("ack_route").map_err(db)?,
        row.try_get("ack_duplicate").map_err(db)?,
    )
    .map_err(|e| StoreError::new(StoreErrorKind::Schema, e.to_string()))
}

/// Reads the envelope columns (see `sql::ENVELOPE_COLS`) of a row. Size limits are not
/// checked again ([`EnvelopeLimits::unlimited`]): the event was validated when it was
/// appended, and a later change of limits (or the header a re-issue adds) must not make it
/// unreadable.
pub(crate) fn envelope_from_row(row: &PgRow) -> Result<Envelope, StoreError> {
    let event_id: Uuid = row.try_get("event_id").map_err(db)?;
    let headers: serde_json::Value = row.try_get("headers").map_err(db)?;
    let mut b = Envelope::builder(
        row.try_get::<String, _>("aggregate_type").map_err(db)?,
        row.try_get::<String, _>("aggregate_id").map_err(db)?,
        row.try_get::<i64, _>("aggregate_version").map_err(db)?,
        row.try_get::<String, _>("event_type").map_err(db)?,
    )
    .event_id(EventId::from_uuid(event_id))
    .schema_version(row.try_get("schema_version").map_err(db)?)
    .payload(Payload::new(
        row.try_get::<String, _>("content_type").map_err(db)?,
        row.try_get::<Vec<u8>, _>("payload").map_err(db)?,
    ))
    .created_at(row.try_get("created_at").map_err(db)?)
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

/// Reads a parked row (envelope and `sql::PARKED_COLS`).
pub(crate) fn parked_from_row(row: &PgRow) -> Result<ParkedEvent, StoreError> {
    let envelope = envelope_from_row(row)?;
    let attempts: i32 = row.try_get("attempts").map_err(db)?;
    let kind: Option<String> = row.try_get("park_kind").map_err(db)?;
    let class: Option<String> = row.try_get("last_error_class").map_err(db)?;
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
            kind: row
                .try_get::<Option<String>, _>("last_error_kind")
                .map_err(db)?
                .unwrap_or_default(),
            message: row
                .try_get::<Option<String>, _>("last_error_message")
                .map_err(db)?
                .unwrap_or_default(),
        },
    };
    let parked_at: Option<DateTime<Utc>> = row.try_get("parked_at").map_err(db)?;
    let uncertain: bool = row.try_get("maybe_delivered").map_err(db)?;
    Ok(ParkedEvent::new(
        envelope,
        attempts.max(0) as u32,
        reason,
        parked_at.unwrap_or_default(),
    )
    .with_delivery_uncertain(uncertain))
}
