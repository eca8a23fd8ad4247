//! The event envelope: the contract with consumers.
//!
//! An [`Envelope`] is everything a consumer sees. Delivery mechanics (attempts, leases, broker
//! acknowledgements) live in [`crate::delivery`] and are never published.
//!
//! Envelopes are built with [`Envelope::builder`], which validates at append time, inside the
//! business transaction: a bad event fails the business change instead of poisoning the relay.
//!
//! ```
//! use outbox_core::{Envelope, EnvelopeLimits};
//!
//! let event = Envelope::builder("order", "order-42", 3, "order.confirmed")
//!     .json(&serde_json::json!({ "total_cents": 1999 }))
//!     .unwrap()
//!     .header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
//!     .build()
//!     .unwrap();
//! assert_eq!(event.aggregate_version, 3);
//! assert_eq!(event.payload.content_type, "application/json");
//!
//! // Validation happens before anything is written.
//! let err = Envelope::builder("order", "", 1, "order.confirmed").build().unwrap_err();
//! assert!(err.to_string().contains("aggregate_id"));
//! # let _ = EnvelopeLimits::default();
//! ```

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Datelike, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Identifier of one event: a time-ordered UUID (version 7).
///
/// The identifier is what consumers deduplicate on; it is assigned once, when the envelope is
/// built, and never changes across re-publication.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EventId(Uuid);

impl EventId {
    /// A new v7 identifier from the system clock and the thread-local RNG.
    pub fn now_v7() -> Self {
        Self(Uuid::now_v7())
    }

    /// A v7 identifier from an explicit timestamp and random bits, for deterministic tests and
    /// simulations (time and randomness injected).
    pub fn from_parts(at: DateTime<Utc>, random: u128) -> Self {
        let millis = at.timestamp_millis().max(0) as u64;
        let bytes = random.to_le_bytes();
        let mut rand10 = [0u8; 10];
        rand10.copy_from_slice(&bytes[..10]);
        Self(uuid::Builder::from_unix_timestamp_millis(millis, &rand10).into_uuid())
    }

    /// Wraps an existing UUID (as read back from storage or a message header).
    pub const fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The underlying UUID.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Debug for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EventId({})", self.0)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::str::FromStr for EventId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(Self)
    }
}

/// The body of an event: opaque bytes plus their content type.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Payload {
    /// MIME type of `bytes`, e.g. `application/json`.
    pub content_type: String,
    /// The encoded body.
    pub bytes: Vec<u8>,
}

impl Payload {
    /// A payload from raw bytes and a content type.
    pub fn new(content_type: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Self {
            content_type: content_type.into(),
            bytes: bytes.into(),
        }
    }

    /// Serializes `value` as JSON.
    pub fn json<T: Serialize + ?Sized>(value: &T) -> Result<Self, serde_json::Error> {
        Ok(Self::new(CONTENT_TYPE_JSON, serde_json::to_vec(value)?))
    }

    /// Deserializes a JSON payload. Fails if the content type is not JSON or the bytes do not
    /// match `T`.
    pub fn to_json<T: serde::de::DeserializeOwned>(&self) -> Result<T, PayloadError> {
        if !is_json_content_type(&self.content_type) {
            return Err(PayloadError::NotJson(self.content_type.clone()));
        }
        serde_json::from_slice(&self.bytes).map_err(PayloadError::Json)
    }
}

// Payloads can hold personal data: never print their bytes.
impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Payload")
            .field("content_type", &self.content_type)
            .field("len", &self.bytes.len())
            .finish()
    }
}

/// The content type used by the JSON helpers.
pub const CONTENT_TYPE_JSON: &str = "application/json";

fn is_json_content_type(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim();
    base.eq_ignore_ascii_case(CONTENT_TYPE_JSON) || base.ends_with("+json")
}

/// Errors decoding a payload.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadError {
    /// The content type is not JSON.
    #[error("payload content type {0:?} is not JSON")]
    NotJson(String),
    /// The bytes are not valid JSON for the requested type.
    #[error("payload is not valid JSON for the requested type: {0}")]
    Json(#[source] serde_json::Error),
}

/// An event as consumers see it.
///
/// Fields are public for reading; construct through [`Envelope::builder`] so that every
/// envelope that reaches a store has passed validation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Envelope {
    /// Unique, time-ordered identifier; the consumer-side deduplication key.
    pub event_id: EventId,
    /// Kind of entity the event belongs to, e.g. `order`.
    pub aggregate_type: String,
    /// Identity of the entity; also the partition key, so one aggregate stays in one partition.
    pub aggregate_id: String,
    /// Position of this event in the entity's change sequence (1, 2, 3, ...).
    pub aggregate_version: i64,
    /// What happened, e.g. `order.confirmed`.
    pub event_type: String,
    /// Format version of the payload. Unrelated to `aggregate_version`.
    pub schema_version: i32,
    /// The body.
    pub payload: Payload,
    /// Extra headers (e.g. W3C `traceparent`), published as message headers.
    pub headers: BTreeMap<String, String>,
    /// When the event was created (append time).
    pub created_at: DateTime<Utc>,
}

impl Envelope {
    /// Starts building an envelope for `aggregate_type`/`aggregate_id` at `aggregate_version`.
    pub fn builder(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        aggregate_version: i64,
        event_type: impl Into<String>,
    ) -> EnvelopeBuilder {
        EnvelopeBuilder {
            event_id: None,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            aggregate_version,
            event_type: event_type.into(),
            schema_version: 1,
            payload: Payload::new(CONTENT_TYPE_JSON, b"null".to_vec()),
            headers: BTreeMap::new(),
            created_at: None,
            limits: EnvelopeLimits::default(),
        }
    }

    /// The W3C trace context header, if present.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers.get(TRACEPARENT).map(String::as_str)
    }

    /// For a re-issued copy of a parked event: the id of the event it replaces (header
    /// [`crate::wire::ORIGINAL_EVENT_ID`]). `None` for an original event or an unparsable value.
    pub fn original_event_id(&self) -> Option<EventId> {
        self.headers
            .get(crate::wire::ORIGINAL_EVENT_ID)
            .and_then(|v| v.parse().ok())
    }

    /// The identity under which consumers deduplicate this event: the original event's id for
    /// a re-issued copy, else its own. A copy and its original are one event to an inbox, so
    /// re-issuing an event that did reach the broker never applies its effect twice.
    pub fn dedup_id(&self) -> EventId {
        self.original_event_id().unwrap_or(self.event_id)
    }

    /// Checks the envelope against `limits`. Stores call this on append, so an envelope that was
    /// altered after building is still rejected before it is written.
    pub fn validate(&self, limits: &EnvelopeLimits) -> Result<(), ValidationError> {
        let aggregate_limit = limits.max_name_len.min(limits.max_aggregate_name_bytes);
        validate_name("aggregate_type", &self.aggregate_type, aggregate_limit)?;
        validate_name("aggregate_id", &self.aggregate_id, aggregate_limit)?;
        validate_name("event_type", &self.event_type, limits.max_name_len)?;
        if self.aggregate_version < 1 {
            return Err(ValidationError::InvalidVersion {
                field: "aggregate_version",
                value: self.aggregate_version,
            });
        }
        if self.schema_version < 1 {
            return Err(ValidationError::InvalidVersion {
                field: "schema_version",
                value: i64::from(self.schema_version),
            });
        }
        if self.payload.content_type.trim().is_empty()
            || self.payload.content_type.len() > limits.max_name_len
            || !is_header_value(&self.payload.content_type)
        {
            return Err(ValidationError::InvalidContentType(
                self.payload.content_type.clone(),
            ));
        }
        if !CREATED_AT_YEARS.contains(&self.created_at.year()) {
            return Err(ValidationError::CreatedAtOutOfRange {
                year: self.created_at.year(),
            });
        }
        if self.payload.bytes.len() > limits.max_payload_bytes {
            return Err(ValidationError::PayloadTooLarge {
                size: self.payload.bytes.len(),
                limit: limits.max_payload_bytes,
            });
        }
        if self.headers.len() > limits.max_headers {
            return Err(ValidationError::TooManyHeaders {
                count: self.headers.len(),
                limit: limits.max_headers,
            });
        }
        let mut header_bytes = 0usize;
        for (name, value) in &self.headers {
            if name.is_empty() || name.len() > limits.max_name_len || !is_header_name(name) {
                return Err(ValidationError::InvalidHeader {
                    name: name.clone(),
                    reason: "header names are 1..=max_name_len visible ASCII characters",
                });
            }
            if crate::wire::is_reserved_header(name) {
                return Err(ValidationError::InvalidHeader {
                    name: name.clone(),
                    reason: "the name is reserved for envelope fields",
                });
            }
            if !is_header_value(value) {
                return Err(ValidationError::InvalidHeader {
                    name: name.clone(),
                    reason: "header values must not contain control characters",
                });
            }
            if name.eq_ignore_ascii_case(TRACEPARENT) && !is_traceparent(value) {
                return Err(ValidationError::InvalidHeader {
                    name: name.clone(),
                    reason: "not a W3C traceparent (version-traceid-parentid-flags)",
                });
            }
            header_bytes += name.len() + value.len();
        }
        if header_bytes > limits.max_header_bytes {
            return Err(ValidationError::HeadersTooLarge {
                size: header_bytes,
                limit: limits.max_header_bytes,
            });
        }
        Ok(())
    }
}

/// Years a `created_at` may fall in: what the wire format's RFC 3339 timestamp (four-digit
/// year) can carry, so every envelope that is appended can be decoded by its consumers.
pub const CREATED_AT_YEARS: std::ops::RangeInclusive<i32> = 0..=9999;

/// Name of the W3C trace context header.
pub const TRACEPARENT: &str = "traceparent";

fn validate_name(field: &'static str, value: &str, max: usize) -> Result<(), ValidationError> {
    if value.trim().is_empty() {
        return Err(ValidationError::Empty(field));
    }
    if value.len() > max {
        return Err(ValidationError::TooLong {
            field,
            len: value.len(),
            limit: max,
        });
    }
    if value.chars().any(char::is_control) {
        return Err(ValidationError::ControlCharacter(field));
    }
    Ok(())
}

fn is_header_name(name: &str) -> bool {
    name.bytes().all(|b| b.is_ascii_graphic())
}

fn is_header_value(value: &str) -> bool {
    !value.chars().any(char::is_control)
}

/// `version-traceid-parentid-flags`, lowercase hex, ids not all zero.
fn is_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    if parts.len() < 4 {
        return false;
    }
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let not_zero = |s: &str| s.bytes().any(|b| b != b'0');
    hex(parts[0], 2)
        && parts[0] != "ff"
        && hex(parts[1], 32)
        && not_zero(parts[1])
        && hex(parts[2], 16)
        && not_zero(parts[2])
        && hex(parts[3], 2)
        && (parts[0] != "00" || parts.len() == 4)
}

/// Longest `aggregate_type`, and longest `aggregate_id`, in UTF-8 bytes, that every store can
/// key an aggregate by: the ceiling of [`EnvelopeLimits::max_aggregate_name_bytes`], whatever
/// [`EnvelopeLimits::max_name_len`] allows for other names.
///
/// Stores keep per-aggregate state (the last version published, a lease; at the consumer, the
/// last version applied) under a unique index of the aggregate's type and id, next to a 64-bit
/// hash of them or the consumer's name. An index entry has a hard size limit: PostgreSQL's
/// B-tree takes at most about 2,700 bytes (a third of an 8 KiB page; one entry above it makes
/// the statement that writes it fail, and with it every claim that meets the event), InnoDB
/// 3,072 bytes per key. Two names of at most 1,024 bytes each, with the hash or a consumer name
/// of up to 255 bytes, stay below both, uncompressed, with room for the entry's overhead.
/// Bounding the names (rather than keying the state by a hash of them) keeps the state
/// readable and its uniqueness exact, and costs nothing at claim time; an aggregate id needs
/// far less in practice (a UUID is 36 bytes).
pub const MAX_AGGREGATE_NAME_BYTES: usize = 1024;

/// Limits enforced on every envelope at append time.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EnvelopeLimits {
    /// Largest payload in bytes. Default: 900 KiB, under Kafka's default 1 MiB message limit
    /// with room for headers.
    pub max_payload_bytes: usize,
    /// Longest type, id, content type or header name, in bytes. Default: 255. The aggregate
    /// type and id are also bounded by `max_aggregate_name_bytes`.
    pub max_name_len: usize,
    /// Longest aggregate type and longest aggregate id, in bytes (the smaller of this and
    /// `max_name_len` applies to them). Default [`MAX_AGGREGATE_NAME_BYTES`], also the
    /// largest value a store accepts ([`Self::check_storable`]): raising `max_name_len` does
    /// not raise it.
    pub max_aggregate_name_bytes: usize,
    /// Most headers per event. Default: 32.
    pub max_headers: usize,
    /// Largest total size of header names and values. Default: 16 KiB.
    pub max_header_bytes: usize,
}

impl Default for EnvelopeLimits {
    fn default() -> Self {
        Self {
            max_payload_bytes: 900 * 1024,
            max_name_len: 255,
            max_aggregate_name_bytes: MAX_AGGREGATE_NAME_BYTES,
            max_headers: 32,
            max_header_bytes: 16 * 1024,
        }
    }
}

impl EnvelopeLimits {
    /// No size limits (names, headers and the reserved header names are still checked): for
    /// reading back events that were validated when they were stored, so that a change of
    /// limits, or the header a re-issue adds, never makes a stored event unreadable.
    pub fn unlimited() -> Self {
        Self {
            max_payload_bytes: usize::MAX,
            max_name_len: usize::MAX,
            max_aggregate_name_bytes: usize::MAX,
            max_headers: usize::MAX,
            max_header_bytes: usize::MAX,
        }
    }

    /// Sets the payload limit.
    pub fn with_max_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_payload_bytes = bytes;
        self
    }

    /// Sets the name limit (type, id, content type, header names; the aggregate type and id
    /// stay within `max_aggregate_name_bytes`).
    pub fn with_max_name_len(mut self, bytes: usize) -> Self {
        self.max_name_len = bytes;
        self
    }

    /// Whether a store may validate appends with these limits: `max_aggregate_name_bytes` at
    /// most [`MAX_AGGREGATE_NAME_BYTES`] (a store could not key a longer aggregate). Stores
    /// call it when they are configured ([`Self::unlimited`], for reading stored events back,
    /// is not for appends and fails it).
    pub fn check_storable(&self) -> Result<(), crate::error::ConfigError> {
        if self.max_aggregate_name_bytes > MAX_AGGREGATE_NAME_BYTES {
            return Err(crate::error::ConfigError::new(format!(
                "max_aggregate_name_bytes {} is above {MAX_AGGREGATE_NAME_BYTES}, the longest \
                 aggregate type or id a store can key its state by",
                self.max_aggregate_name_bytes
            )));
        }
        Ok(())
    }
}

/// Why an envelope was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A required text field is empty or blank.
    #[error("{0} must not be empty")]
    Empty(&'static str),
    /// A text field exceeds the limit.
    #[error("{field} is {len} bytes long; the limit is {limit}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A text field contains a control character.
    #[error("{0} must not contain control characters")]
    ControlCharacter(&'static str),
    /// A version is below 1.
    #[error("{field} must be at least 1, got {value}")]
    InvalidVersion {
        /// The field.
        field: &'static str,
        /// The value given.
        value: i64,
    },
    /// The payload's content type is empty or malformed.
    #[error("invalid payload content type {0:?}")]
    InvalidContentType(String),
    /// `created_at` lies outside [`CREATED_AT_YEARS`]: the wire format could not carry it.
    #[error("created_at in year {year} is outside 0..=9999, which the wire format (RFC 3339) cannot carry")]
    CreatedAtOutOfRange {
        /// The year given.
        year: i32,
    },
    /// The payload exceeds the limit.
    #[error("payload is {size} bytes; the limit is {limit}")]
    PayloadTooLarge {
        /// Payload size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Too many headers.
    #[error("{count} headers; the limit is {limit}")]
    TooManyHeaders {
        /// Number given.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// Headers exceed the byte limit.
    #[error("headers take {size} bytes; the limit is {limit}")]
    HeadersTooLarge {
        /// Their size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A header is malformed or reserved.
    #[error("invalid header {name:?}: {reason}")]
    InvalidHeader {
        /// Header name.
        name: String,
        /// What is wrong.
        reason: &'static str,
    },
    /// The payload could not be serialized.
    #[error("payload could not be serialized: {0}")]
    Serialization(String),
}

/// Builder for [`Envelope`]; [`EnvelopeBuilder::build`] validates.
#[derive(Debug, Clone)]
#[must_use]
pub struct EnvelopeBuilder {
    event_id: Option<EventId>,
    aggregate_type: String,
    aggregate_id: String,
    aggregate_version: i64,
    event_type: String,
    schema_version: i32,
    payload: Payload,
    headers: BTreeMap<String, String>,
    created_at: Option<DateTime<Utc>>,
    limits: EnvelopeLimits,
}

impl EnvelopeBuilder {
    /// Sets an explicit event id (default: a fresh v7 id).
    pub fn event_id(mut self, id: EventId) -> Self {
        self.event_id = Some(id);
        self
    }

    /// Sets the payload schema version (default 1).
    pub fn schema_version(mut self, v: i32) -> Self {
        self.schema_version = v;
        self
    }

    /// Sets the payload (default: JSON `null`).
    pub fn payload(mut self, payload: Payload) -> Self {
        self.payload = payload;
        self
    }

    /// Serializes `value` as the JSON payload.
    pub fn json<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, ValidationError> {
        self.payload =
            Payload::json(value).map_err(|e| ValidationError::Serialization(e.to_string()))?;
        Ok(self)
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.insert(name.into(), value.into());
        self
    }

    /// Sets the creation time (default: now from the system clock).
    pub fn created_at(mut self, at: DateTime<Utc>) -> Self {
        self.created_at = Some(at);
        self
    }

    /// Overrides the validation limits.
    pub fn limits(mut self, limits: EnvelopeLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Validates and returns the envelope.
    pub fn build(self) -> Result<Envelope, ValidationError> {
        // Microsecond precision: what PostgreSQL stores and the wire format carries, so an
        // envelope read back compares equal to the one appended.
        let created_at = self.created_at.unwrap_or_else(Utc::now).trunc_subsecs(6);
        let envelope = Envelope {
            event_id: self.event_id.unwrap_or_else(EventId::now_v7),
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            aggregate_version: self.aggregate_version,
            event_type: self.event_type,
            schema_version: self.schema_version,
            payload: self.payload,
            headers: self.headers,
            created_at,
        };
        envelope.validate(&self.limits)?;
        Ok(envelope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> EnvelopeBuilder {
        Envelope::builder("order", "o-1", 1, "order.created")
    }

    /// Found by the `envelope_build` fuzz target: an envelope created in year 10000 (or before
    /// year 0) was built and appended, but its RFC 3339 `created_at` header could not be
    /// decoded, so every consumer would have parked it as malformed.
    #[test]
    fn created_at_outside_the_wire_formats_years_is_rejected() {
        use chrono::TimeZone;
        for (at, year) in [
            (Utc.with_ymd_and_hms(10000, 1, 1, 0, 0, 0).unwrap(), 10000),
            (Utc.with_ymd_and_hms(-1, 12, 31, 23, 59, 59).unwrap(), -1),
        ] {
            assert_eq!(
                base().created_at(at).build(),
                Err(ValidationError::CreatedAtOutOfRange { year })
            );
        }
        for at in [
            Utc.with_ymd_and_hms(9999, 12, 31, 23, 59, 59).unwrap(),
            Utc.with_ymd_and_hms(0, 1, 1, 0, 0, 0).unwrap(),
        ] {
            let e = base()
                .created_at(at)
                .build()
                .expect("a year the wire format carries");
            let decoded = crate::wire::decode(&crate::wire::encode_headers(&e), &e.payload.bytes);
            assert_eq!(decoded, Ok(e), "the edge years round-trip");
        }
    }

    #[test]
    fn valid_envelope_builds() {
        let e = base()
            .json(&serde_json::json!({"a": 1}))
            .unwrap()
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        assert_eq!(e.event_id.as_uuid().get_version_num(), 7);
        assert_eq!(
            e.traceparent(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let v: serde_json::Value = e.payload.to_json().unwrap();
        assert_eq!(v["a"], 1);
    }

    type Case = (&'static str, EnvelopeBuilder, fn(&ValidationError) -> bool);

    #[test]
    fn validation_table() {
        let limits = EnvelopeLimits::default();
        let cases: Vec<Case> = vec![
            (
                "empty aggregate_type",
                Envelope::builder("", "a", 1, "t"),
                |e| matches!(e, ValidationError::Empty("aggregate_type")),
            ),
            (
                "blank aggregate_id",
                Envelope::builder("x", "  ", 1, "t"),
                |e| matches!(e, ValidationError::Empty("aggregate_id")),
            ),
            (
                "empty event_type",
                Envelope::builder("x", "a", 1, ""),
                |e| matches!(e, ValidationError::Empty("event_type")),
            ),
            ("version zero", Envelope::builder("x", "a", 0, "t"), |e| {
                matches!(
                    e,
                    ValidationError::InvalidVersion {
                        field: "aggregate_version",
                        ..
                    }
                )
            }),
            ("schema zero", base().schema_version(0), |e| {
                matches!(
                    e,
                    ValidationError::InvalidVersion {
                        field: "schema_version",
                        ..
                    }
                )
            }),
            (
                "oversize payload",
                base().payload(Payload::new(
                    "application/octet-stream",
                    vec![0u8; limits.max_payload_bytes + 1],
                )),
                |e| matches!(e, ValidationError::PayloadTooLarge { .. }),
            ),
            (
                "empty content type",
                base().payload(Payload::new("", vec![])),
                |e| matches!(e, ValidationError::InvalidContentType(_)),
            ),
            (
                "header name with space",
                base().header("bad name", "v"),
                |e| matches!(e, ValidationError::InvalidHeader { .. }),
            ),
            (
                "header value with newline",
                base().header("x-a", "v\r\nInjected: 1"),
                |e| matches!(e, ValidationError::InvalidHeader { .. }),
            ),
            ("reserved header", base().header("event_id", "x"), |e| {
                matches!(e, ValidationError::InvalidHeader { .. })
            }),
            (
                "bad traceparent",
                base().header("traceparent", "00-zz-11-01"),
                |e| matches!(e, ValidationError::InvalidHeader { .. }),
            ),
            (
                "all-zero trace id",
                base().header(
                    "traceparent",
                    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                ),
                |e| matches!(e, ValidationError::InvalidHeader { .. }),
            ),
            (
                "control char in id",
                Envelope::builder("x", "a\u{0}", 1, "t"),
                |e| matches!(e, ValidationError::ControlCharacter("aggregate_id")),
            ),
            (
                "too long type",
                Envelope::builder("x".repeat(256), "a", 1, "t"),
                |e| {
                    matches!(
                        e,
                        ValidationError::TooLong {
                            field: "aggregate_type",
                            ..
                        }
                    )
                },
            ),
        ];
        for (name, builder, check) in cases {
            let err = builder.build().expect_err(name);
            assert!(check(&err), "{name}: unexpected error {err:?}");
        }
    }

    #[test]
    fn too_many_headers_and_header_bytes() {
        let mut b = base();
        for i in 0..33 {
            b = b.header(format!("h{i}"), "v");
        }
        assert!(matches!(
            b.build(),
            Err(ValidationError::TooManyHeaders { count: 33, .. })
        ));
        let b = base().header("big", "x".repeat(17 * 1024));
        assert!(matches!(
            b.build(),
            Err(ValidationError::HeadersTooLarge { .. })
        ));
    }

    #[test]
    fn payload_debug_hides_bytes() {
        let p = Payload::new("text/plain", b"secret card number".to_vec());
        let s = format!("{p:?}");
        assert!(!s.contains("secret"));
        assert!(s.contains("len: 18"));
    }

    #[test]
    fn to_json_rejects_non_json() {
        let p = Payload::new("text/plain", b"{}".to_vec());
        assert!(matches!(
            p.to_json::<serde_json::Value>(),
            Err(PayloadError::NotJson(_))
        ));
        let p = Payload::new("application/vnd.x+json; charset=utf-8", b"{}".to_vec());
        assert!(p.to_json::<serde_json::Value>().is_ok());
    }

    /// Issue 20, item 6: raising the name limit does not raise the aggregate type's and id's,
    /// which stay within what every store can key (exactly the ceiling passes, one more byte
    /// is refused, in bytes not characters); reading back (`unlimited`) lifts it; a store
    /// refuses limits above the ceiling.
    #[test]
    fn aggregate_names_stay_within_what_stores_can_key() {
        let raised = EnvelopeLimits::default().with_max_name_len(8192);
        assert_eq!(raised.check_storable(), Ok(()));
        let build = |t: &str, id: &str, et: &str| {
            let mut b = Envelope::builder(t, id, 1, et);
            b = b.limits(raised.clone());
            b.build()
        };
        let at = "a".repeat(MAX_AGGREGATE_NAME_BYTES);
        let past = "a".repeat(MAX_AGGREGATE_NAME_BYTES + 1);
        assert!(build(&at, &at, "t").is_ok(), "both names at the ceiling");
        for (t, id, field) in [(&past, &at, "aggregate_type"), (&at, &past, "aggregate_id")] {
            assert_eq!(
                build(t, id, "t"),
                Err(ValidationError::TooLong {
                    field,
                    len: MAX_AGGREGATE_NAME_BYTES + 1,
                    limit: MAX_AGGREGATE_NAME_BYTES
                })
            );
        }
        // Counted in bytes: 512 two-byte characters are at the ceiling, one more is past it.
        let wide = "é".repeat(MAX_AGGREGATE_NAME_BYTES / 2);
        assert!(build("t", &wide, "t").is_ok());
        assert!(build("t", &format!("{wide}a"), "t").is_err());
        // Other names follow max_name_len.
        assert!(build("t", "a", &"e".repeat(8192)).is_ok());
        // Reading back stored events: no limit.
        let mut b = Envelope::builder("t", "x".repeat(2700), 1, "t");
        b = b.limits(EnvelopeLimits::unlimited());
        assert!(b.build().is_ok());
        assert!(EnvelopeLimits::unlimited().check_storable().is_err());
        let above = EnvelopeLimits {
            max_aggregate_name_bytes: MAX_AGGREGATE_NAME_BYTES + 1,
            ..EnvelopeLimits::default()
        };
        assert!(above.check_storable().is_err());
    }

    /// Every limit is inclusive: a value exactly at it is accepted, one past it is refused.
    #[test]
    fn limits_accept_exactly_the_limit_and_refuse_one_more() {
        let limits = EnvelopeLimits::default();
        let name = |n: usize| "n".repeat(n);
        // Payload.
        let at = base().payload(Payload::new(
            "text/plain",
            vec![0u8; limits.max_payload_bytes],
        ));
        assert!(at.build().is_ok(), "a payload of exactly the limit");
        // Names: aggregate type and id, event type.
        let max = name(limits.max_name_len);
        assert!(Envelope::builder(max.clone(), "a", 1, "t").build().is_ok());
        assert!(Envelope::builder("x", max.clone(), 1, "t").build().is_ok());
        assert!(Envelope::builder("x", "a", 1, max).build().is_ok());
        assert_eq!(
            Envelope::builder("x", "a", 1, name(256)).build(),
            Err(ValidationError::TooLong {
                field: "event_type",
                len: 256,
                limit: 255
            })
        );
        // Content type.
        let ct = |n: usize| base().payload(Payload::new(name(n), b"x".to_vec())).build();
        assert!(ct(limits.max_name_len).is_ok());
        assert!(matches!(
            ct(limits.max_name_len + 1),
            Err(ValidationError::InvalidContentType(_))
        ));
        // Header count.
        let mut b = base();
        for i in 0..limits.max_headers {
            b = b.header(format!("h{i}"), "v");
        }
        assert!(b.build().is_ok(), "exactly max_headers headers");
        // Header name length.
        assert!(base().header(name(255), "v").build().is_ok());
        assert!(matches!(
            base().header(name(256), "v").build(),
            Err(ValidationError::InvalidHeader { .. })
        ));
        // Header bytes: names and values together (2 + 16382 = 16384).
        let value = |n: usize| "v".repeat(n);
        let max = limits.max_header_bytes;
        assert!(base().header("hh", value(max - 2)).build().is_ok());
        assert_eq!(
            base().header("hh", value(max - 1)).build(),
            Err(ValidationError::HeadersTooLarge {
                size: max + 1,
                limit: max
            })
        );
        // Two headers add up.
        assert_eq!(
            base()
                .header("a", value(max / 2))
                .header("b", value(max / 2))
                .build(),
            Err(ValidationError::HeadersTooLarge {
                size: max + 2,
                limit: max
            })
        );
    }

    #[test]
    fn control_characters_and_blank_names_are_refused_everywhere() {
        assert_eq!(
            Envelope::builder("x", "a", 1, "t\n").build(),
            Err(ValidationError::ControlCharacter("event_type"))
        );
        assert!(matches!(
            base()
                .payload(Payload::new("text/plain\r\n", vec![]))
                .build(),
            Err(ValidationError::InvalidContentType(_))
        ));
        assert!(matches!(
            base().payload(Payload::new("  ", vec![])).build(),
            Err(ValidationError::InvalidContentType(_))
        ));
        assert!(matches!(
            base().header("", "v").build(),
            Err(ValidationError::InvalidHeader { .. })
        ));
        // Visible ASCII names and values with spaces or non-ASCII text are fine.
        let e = base()
            .header("x-Tenant_1!", "caf\u{e9} au lait")
            .build()
            .unwrap();
        assert_eq!(e.headers["x-Tenant_1!"], "caf\u{e9} au lait");
        assert!(matches!(
            base().header("caf\u{e9}", "v").build(),
            Err(ValidationError::InvalidHeader { .. })
        ));
        // Reserved names are refused in any case.
        assert!(matches!(
            base().header("Event_ID", "x").build(),
            Err(ValidationError::InvalidHeader { .. })
        ));
    }

    #[test]
    fn traceparent_table() {
        let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
        let parent = "00f067aa0ba902b7";
        let zeros32 = "0".repeat(32);
        let zeros16 = "0".repeat(16);
        let cases: Vec<(String, bool)> = vec![
            (format!("00-{trace}-{parent}-01"), true),
            (format!("00-{trace}-{parent}-00"), true),
            // Only digits in the ids (no letters) is still hex.
            (format!("00-{}-{}-01", "1".repeat(32), "2".repeat(16)), true),
            // A later version may append fields; version 00 may not.
            (format!("01-{trace}-{parent}-01-extra"), true),
            (format!("00-{trace}-{parent}-01-extra"), false),
            (format!("01-{trace}-{parent}-01"), true),
            // Version ff is invalid.
            (format!("ff-{trace}-{parent}-01"), false),
            // Uppercase hex, wrong lengths, non-hex.
            (format!("00-{}-{parent}-01", trace.to_uppercase()), false),
            (format!("0-{trace}-{parent}-01"), false),
            (format!("000-{trace}-{parent}-01"), false),
            (format!("00-{trace}0-{parent}-01"), false),
            (format!("00-{}-{parent}-01", &trace[1..]), false),
            (format!("00-{trace}-{parent}0-01"), false),
            (format!("00-{trace}-{}-01", &parent[1..]), false),
            (format!("00-{trace}-{parent}-1"), false),
            (format!("00-{trace}-{parent}-001"), false),
            (format!("00-{trace}-{parent}-0g"), false),
            (format!("0g-{trace}-{parent}-01"), false),
            (format!("00-{}g-{parent}-01", &trace[1..]), false),
            (format!("00-{trace}-{}g-01", &parent[1..]), false),
            // All-zero ids.
            (format!("00-{zeros32}-{parent}-01"), false),
            (format!("00-{trace}-{zeros16}-01"), false),
            // Too few fields.
            (format!("00-{trace}-{parent}"), false),
            (String::new(), false),
        ];
        for (value, valid) in cases {
            assert_eq!(is_traceparent(&value), valid, "{value:?}");
            // The header is checked under any capitalisation of its name.
            let built = base().header("TraceParent", value.clone()).build();
            assert_eq!(built.is_ok(), valid, "{value:?}: {built:?}");
        }
        // Other headers may hold anything printable.
        assert!(base().header("x-trace", "00-zz").build().is_ok());
    }

    #[test]
    fn a_reissued_copy_deduplicates_as_its_original() {
        let original = EventId::from_parts(Utc::now(), 7);
        let copy = base()
            .header(crate::wire::ORIGINAL_EVENT_ID, original.to_string())
            .build()
            .unwrap();
        assert_eq!(copy.original_event_id(), Some(original));
        assert_eq!(copy.dedup_id(), original);
        assert_ne!(copy.event_id, original);

        let plain = base().build().unwrap();
        assert_eq!(plain.original_event_id(), None);
        assert_eq!(plain.dedup_id(), plain.event_id);

        let garbled = base()
            .header(crate::wire::ORIGINAL_EVENT_ID, "not-a-uuid")
            .build()
            .unwrap();
        assert_eq!(garbled.original_event_id(), None);
        assert_eq!(garbled.dedup_id(), garbled.event_id);
    }

    #[test]
    fn unlimited_limits_lift_the_sizes_but_not_the_rules() {
        let huge = EnvelopeLimits::default().max_payload_bytes + 1;
        let mut e = base().build().unwrap();
        e.payload = Payload::new("application/octet-stream", vec![0u8; huge]);
        for i in 0..40 {
            e.headers.insert(format!("h{i}"), "v".repeat(1024));
        }
        e.aggregate_id = "a".repeat(1000);
        assert!(e.validate(&EnvelopeLimits::default()).is_err());
        assert_eq!(e.validate(&EnvelopeLimits::unlimited()), Ok(()));
        e.headers.insert("event_type".into(), "x".into());
        assert!(matches!(
            e.validate(&EnvelopeLimits::unlimited()),
            Err(ValidationError::InvalidHeader { .. })
        ));
        assert_eq!(
            EnvelopeLimits::default()
                .with_max_payload_bytes(10)
                .max_payload_bytes,
            10
        );
    }

    #[test]
    fn builder_fields_reach_the_envelope() {
        use chrono::TimeZone;
        let at = Utc.with_ymd_and_hms(2024, 5, 1, 12, 0, 0).unwrap()
            + chrono::Duration::nanoseconds(123_456_789);
        let id = EventId::from_parts(at, 1);
        let e = base()
            .event_id(id)
            .schema_version(4)
            .created_at(at)
            .build()
            .unwrap();
        assert_eq!(e.event_id, id);
        assert_eq!(e.schema_version, 4);
        // Truncated to microseconds, what PostgreSQL and the wire format keep.
        assert_eq!(e.created_at, at.trunc_subsecs(6));
        assert_eq!(e.created_at.timestamp_subsec_nanos(), 123_456_000);
        // A payload limit set on the builder applies.
        let small = EnvelopeLimits::default().with_max_payload_bytes(3);
        assert_eq!(
            base().limits(small).build(),
            Err(ValidationError::PayloadTooLarge { size: 4, limit: 3 })
        );
        // The default payload is JSON null.
        let v: serde_json::Value = base().build().unwrap().payload.to_json().unwrap();
        assert_eq!(v, serde_json::Value::Null);
    }

    #[test]
    fn event_id_from_parts_is_deterministic_and_ordered() {
        let t0 = DateTime::from_timestamp_millis(1_700_000_000_000).unwrap();
        let t1 = DateTime::from_timestamp_millis(1_700_000_000_001).unwrap();
        let a = EventId::from_parts(t0, 42);
        assert_eq!(a, EventId::from_parts(t0, 42));
        assert!(a < EventId::from_parts(t1, 0));
        assert_eq!(a.as_uuid().get_version_num(), 7);
        assert_eq!(a.to_string().parse::<EventId>().unwrap(), a);
    }
}
