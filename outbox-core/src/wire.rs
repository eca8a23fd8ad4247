//! The wire mapping of an [`Envelope`] onto a log record: key, headers and value.
//!
//! Every transport (Kafka, the in-memory log) uses this one mapping, so a consumer written in any
//! language reads the same headers:
//!
//! | header | content |
//! |---|---|
//! | `event_id` | UUID text |
//! | `event_type` | text |
//! | `aggregate_type` | text |
//! | `aggregate_id` | text (also the record key) |
//! | `aggregate_version` | decimal integer |
//! | `schema_version` | decimal integer |
//! | `content_type` | MIME type of the value |
//! | `created_at` | RFC 3339 timestamp |
//! | `outbox_original_event_id` | on a re-issued copy only: the id of the parked event it replaces ([`ORIGINAL_EVENT_ID`]) |
//! | `outbox_replay` | on an operator replay only (`outbox replay`): the id of the replay run ([`REPLAY_HEADER`]) |
//! | any user header | as given (e.g. `traceparent`) |
//!
//! The record value is the payload bytes, unchanged.
//!
//! ```
//! use outbox_core::{wire, Envelope};
//! let e = Envelope::builder("order", "o-1", 2, "order.paid").build().unwrap();
//! let headers = wire::encode_headers(&e);
//! let back = wire::decode(&headers, &e.payload.bytes).unwrap();
//! assert_eq!(back, e);
//! ```

use std::collections::BTreeMap;

/// Header carried by every record an operator replay re-publishes (`outbox replay`): the id of
/// the replay run. A transport that drops re-sends by event id (JetStream's duplicate window)
/// must not drop a replay: it is a deliberate second delivery, and the inbox on the consuming
/// side still deduplicates its effect by event id.
pub const REPLAY_HEADER: &str = "outbox_replay";

use chrono::{DateTime, Utc};

use crate::envelope::{Envelope, EventId, Payload};

/// Header carrying the event id.
pub const EVENT_ID: &str = "event_id";
/// Header carrying the event type.
pub const EVENT_TYPE: &str = "event_type";
/// Header carrying the aggregate type.
pub const AGGREGATE_TYPE: &str = "aggregate_type";
/// Header carrying the aggregate id.
pub const AGGREGATE_ID: &str = "aggregate_id";
/// Header carrying the aggregate version.
pub const AGGREGATE_VERSION: &str = "aggregate_version";
/// Header carrying the payload schema version.
pub const SCHEMA_VERSION: &str = "schema_version";
/// Header carrying the payload content type.
pub const CONTENT_TYPE: &str = "content_type";
/// Header carrying the creation time.
pub const CREATED_AT: &str = "created_at";

/// Header set by the store on a re-issued copy of a parked event: the original's event id.
/// Inboxes deduplicate by it ([`crate::Envelope::dedup_id`]), so the copy and the original are
/// applied at most once together. It travels as a user header (stores write it; applications
/// should not).
pub const ORIGINAL_EVENT_ID: &str = "outbox_original_event_id";

const RESERVED: [&str; 8] = [
    EVENT_ID,
    EVENT_TYPE,
    AGGREGATE_TYPE,
    AGGREGATE_ID,
    AGGREGATE_VERSION,
    SCHEMA_VERSION,
    CONTENT_TYPE,
    CREATED_AT,
];

/// `true` for header names that carry envelope fields (user headers may not use them).
pub fn is_reserved_header(name: &str) -> bool {
    RESERVED.iter().any(|r| r.eq_ignore_ascii_case(name))
}

/// The record headers for `e`, envelope fields first, then user headers, as owned pairs.
///
/// Transports that copy headers into their own buffers (librdkafka does) should use
/// [`for_each_header`] instead, which hands out borrowed names and values without copying.
pub fn encode_headers(e: &Envelope) -> Vec<(String, Vec<u8>)> {
    let mut h = Vec::with_capacity(RESERVED.len() + e.headers.len());
    for_each_header(e, |k, v| h.push((k.to_owned(), v.to_vec())));
    h
}

/// Calls `f` with each record header of `e` (name, value), in the order of
/// [`encode_headers`]: envelope fields first, then user headers. Names and text fields are
/// borrowed from the envelope and numbers are formatted on the stack, so nothing is allocated
/// except the `created_at` text.
///
/// ```
/// use outbox_core::{wire, Envelope};
/// let e = Envelope::builder("order", "o-1", 2, "order.paid").build().unwrap();
/// let mut names = Vec::new();
/// wire::for_each_header(&e, |name, _value| names.push(name.to_owned()));
/// assert_eq!(names[..2], ["event_id", "event_type"]);
/// ```
pub fn for_each_header(e: &Envelope, mut f: impl FnMut(&str, &[u8])) {
    let mut id = uuid::Uuid::encode_buffer();
    let id = e.event_id.as_uuid().hyphenated().encode_lower(&mut id);
    f(EVENT_ID, id.as_bytes());
    f(EVENT_TYPE, e.event_type.as_bytes());
    f(AGGREGATE_TYPE, e.aggregate_type.as_bytes());
    f(AGGREGATE_ID, e.aggregate_id.as_bytes());
    let mut buf = [0u8; 20];
    f(AGGREGATE_VERSION, decimal(e.aggregate_version, &mut buf));
    f(
        SCHEMA_VERSION,
        decimal(i64::from(e.schema_version), &mut buf),
    );
    f(CONTENT_TYPE, e.payload.content_type.as_bytes());
    let created = e
        .created_at
        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    f(CREATED_AT, created.as_bytes());
    for (k, v) in &e.headers {
        f(k, v.as_bytes());
    }
}

/// `v` in decimal, written into `buf` (20 bytes hold any `i64`).
fn decimal(v: i64, buf: &mut [u8; 20]) -> &[u8] {
    use std::io::Write;
    let mut rest = &mut buf[..];
    // Cannot fail: the longest i64 ("-9223372036854775808") is 20 bytes.
    let _ = write!(rest, "{v}");
    let len = 20 - rest.len();
    &buf[..len]
}

/// Why a record could not be decoded into an envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// A required header is absent.
    #[error("missing header {0:?}")]
    MissingHeader(&'static str),
    /// A header is not valid UTF-8 or not parseable.
    #[error("malformed header {name:?}: {reason}")]
    MalformedHeader {
        /// Header name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A header appears twice with different values.
    #[error("header {0:?} appears more than once")]
    DuplicateHeader(String),
    /// The decoded envelope fails validation.
    #[error("decoded envelope is invalid: {0}")]
    Invalid(String),
}

/// Decodes headers and value into an envelope. Never panics on hostile input.
///
/// A header repeated with the same value counts once (third-party producers and tracing
/// instrumentation add such repeats); repeated with different values it is
/// [`DecodeError::DuplicateHeader`].
pub fn decode<K: AsRef<str>, V: AsRef<[u8]>>(
    headers: &[(K, V)],
    value: &[u8],
) -> Result<Envelope, DecodeError> {
    decode_parts(
        headers.iter().map(|(k, v)| (k.as_ref(), Some(v.as_ref()))),
        Some(value),
    )
}

/// Decodes a record as it came from a log: headers whose value may be null, and a value that
/// may be null (read as an empty payload). A null value of an envelope header is
/// [`DecodeError::MalformedHeader`]; a user header with a null value is left out of
/// [`Envelope::headers`] (it cannot be told apart from an empty one there) but stays in the
/// raw record.
pub fn decode_record(
    headers: &[crate::inbox::RecordHeader],
    value: Option<&[u8]>,
) -> Result<Envelope, DecodeError> {
    decode_parts(
        headers
            .iter()
            .map(|h| (h.name.as_str(), h.value.as_deref())),
        value,
    )
}

/// The aggregate named by a record's `aggregate_type` and `aggregate_id` headers, when both are
/// present once (or repeated identically), UTF-8 and non-empty. Lets a consumer hold back the
/// later messages of an aggregate whose message could not be decoded.
pub fn aggregate_of(headers: &[crate::inbox::RecordHeader]) -> Option<crate::inbox::AggregateKey> {
    let one = |name: &str| -> Option<String> {
        let mut found: Option<&[u8]> = None;
        for h in headers.iter().filter(|h| h.name == name) {
            let v = h.value.as_deref()?;
            if found.is_some_and(|f| f != v) {
                return None;
            }
            found = Some(v);
        }
        let text = std::str::from_utf8(found?).ok()?;
        (!text.is_empty()).then(|| text.to_owned())
    };
    Some(crate::inbox::AggregateKey::new(
        one(AGGREGATE_TYPE)?,
        one(AGGREGATE_ID)?,
    ))
}

fn decode_parts<'a>(
    headers: impl Iterator<Item = (&'a str, Option<&'a [u8]>)>,
    value: Option<&[u8]>,
) -> Result<Envelope, DecodeError> {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    let mut nulls: Vec<&str> = Vec::new();
    for (name, v) in headers {
        let Some(v) = v else {
            if is_reserved_header(name) {
                return Err(DecodeError::MalformedHeader {
                    name: name.to_owned(),
                    reason: "null value".into(),
                });
            }
            if map.contains_key(name) {
                return Err(DecodeError::DuplicateHeader(name.to_owned()));
            }
            nulls.push(name);
            continue;
        };
        let text = std::str::from_utf8(v).map_err(|_| DecodeError::MalformedHeader {
            name: name.to_owned(),
            reason: "not UTF-8".into(),
        })?;
        if nulls.contains(&name) {
            return Err(DecodeError::DuplicateHeader(name.to_owned()));
        }
        match map.get(name) {
            Some(prev) if prev == text => {}
            Some(_) => return Err(DecodeError::DuplicateHeader(name.to_owned())),
            None => {
                map.insert(name.to_owned(), text.to_owned());
            }
        }
    }
    let value = value.unwrap_or(&[]);
    let mut take = |name: &'static str| map.remove(name).ok_or(DecodeError::MissingHeader(name));
    let malformed = |name: &str, reason: String| DecodeError::MalformedHeader {
        name: name.to_owned(),
        reason,
    };
    let event_id: EventId = take(EVENT_ID)?
        .parse()
        .map_err(|e: uuid::Error| malformed(EVENT_ID, e.to_string()))?;
    let event_type = take(EVENT_TYPE)?;
    let aggregate_type = take(AGGREGATE_TYPE)?;
    let aggregate_id = take(AGGREGATE_ID)?;
    let aggregate_version: i64 = take(AGGREGATE_VERSION)?
        .parse()
        .map_err(|e: std::num::ParseIntError| malformed(AGGREGATE_VERSION, e.to_string()))?;
    let schema_version: i32 = take(SCHEMA_VERSION)?
        .parse()
        .map_err(|e: std::num::ParseIntError| malformed(SCHEMA_VERSION, e.to_string()))?;
    let content_type = take(CONTENT_TYPE)?;
    let created_at: DateTime<Utc> = DateTime::parse_from_rfc3339(&take(CREATED_AT)?)
        .map_err(|e| malformed(CREATED_AT, e.to_string()))?
        .with_timezone(&Utc);
    let envelope = Envelope {
        event_id,
        aggregate_type,
        aggregate_id,
        aggregate_version,
        event_type,
        schema_version,
        payload: Payload::new(content_type, value.to_vec()),
        headers: map,
        created_at,
    };
    // Consumers accept what producers could have sent; the payload limit is the transport's.
    let limits = crate::EnvelopeLimits::default().with_max_payload_bytes(usize::MAX);
    envelope
        .validate(&limits)
        .map_err(|e| DecodeError::Invalid(e.to_string()))?;
    Ok(envelope)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::RecordHeader;

    fn sample() -> Envelope {
        Envelope::builder("order", "o-9", 4, "order.shipped")
            .schema_version(2)
            .json(&serde_json::json!({"x": 1}))
            .unwrap()
            .header(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap()
    }

    #[test]
    fn round_trip_preserves_every_field() {
        let e = sample();
        let h = encode_headers(&e);
        assert_eq!(decode(&h, &e.payload.bytes).unwrap(), e);
    }

    #[test]
    fn headers_are_the_fields_as_text_in_a_fixed_order() {
        let e = sample();
        let mut seen: Vec<(String, String)> = Vec::new();
        for_each_header(&e, |k, v| {
            seen.push((k.to_owned(), String::from_utf8(v.to_vec()).unwrap()))
        });
        let expected: Vec<(String, String)> = [
            (EVENT_ID, e.event_id.to_string()),
            (EVENT_TYPE, e.event_type.clone()),
            (AGGREGATE_TYPE, e.aggregate_type.clone()),
            (AGGREGATE_ID, e.aggregate_id.clone()),
            (AGGREGATE_VERSION, "4".to_owned()),
            (SCHEMA_VERSION, "2".to_owned()),
            (CONTENT_TYPE, e.payload.content_type.clone()),
            (
                CREATED_AT,
                e.created_at
                    .to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            ),
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(seen, expected);
        let owned: Vec<(String, String)> = encode_headers(&e)
            .into_iter()
            .map(|(k, v)| (k, String::from_utf8(v).unwrap()))
            .collect();
        assert_eq!(owned, expected, "encode_headers is the same list, owned");
    }

    #[test]
    fn decimals_cover_the_whole_i64_range() {
        let mut buf = [0u8; 20];
        for v in [0, 1, -1, 9, 10, 4_294_967_296, i64::MAX, i64::MIN] {
            assert_eq!(decimal(v, &mut buf), v.to_string().as_bytes());
        }
    }

    #[test]
    fn malformed_records_are_typed_errors() {
        let e = sample();
        let good = encode_headers(&e);
        let without = |name: &str| -> Vec<(String, Vec<u8>)> {
            good.iter().filter(|(k, _)| k != name).cloned().collect()
        };
        let replace = |name: &str, v: &[u8]| -> Vec<(String, Vec<u8>)> {
            good.iter()
                .map(|(k, old)| (k.clone(), if k == name { v.to_vec() } else { old.clone() }))
                .collect()
        };
        type Headers = Vec<(String, Vec<u8>)>;
        let cases: Vec<(&str, Headers)> = vec![
            ("no event id", without(EVENT_ID)),
            ("no version", without(AGGREGATE_VERSION)),
            ("bad uuid", replace(EVENT_ID, b"nope")),
            ("bad version", replace(AGGREGATE_VERSION, b"1.5")),
            ("non utf8", replace(EVENT_TYPE, &[0xff, 0xfe])),
            ("bad time", replace(CREATED_AT, b"yesterday")),
            ("empty type", replace(EVENT_TYPE, b"")),
            ("zero version", replace(AGGREGATE_VERSION, b"0")),
        ];
        for (name, headers) in cases {
            assert!(decode(&headers, b"{}").is_err(), "{name} decoded");
        }
        let mut dup = good.clone();
        dup.push((EVENT_TYPE.to_owned(), b"other".to_vec()));
        assert!(matches!(
            decode(&dup, b"{}"),
            Err(DecodeError::DuplicateHeader(_))
        ));
        let none: Vec<(String, Vec<u8>)> = vec![];
        assert_eq!(
            decode(&none, b""),
            Err(DecodeError::MissingHeader(EVENT_ID))
        );
    }

    fn raw(e: &Envelope) -> Vec<RecordHeader> {
        encode_headers(e)
            .into_iter()
            .map(|(k, v)| RecordHeader::new(k, v))
            .collect()
    }

    /// Third-party producers and tracing instrumentation repeat headers with the same value.
    #[test]
    fn a_header_repeated_with_the_same_value_decodes() {
        let e = sample();
        let mut h = encode_headers(&e);
        h.push((EVENT_TYPE.to_owned(), e.event_type.clone().into_bytes()));
        h.push((
            "traceparent".to_owned(),
            e.headers["traceparent"].clone().into_bytes(),
        ));
        assert_eq!(decode(&h, &e.payload.bytes).unwrap(), e);
        // Different values stay an error, for envelope and user headers alike.
        for name in [EVENT_TYPE, "traceparent"] {
            let mut h = encode_headers(&e);
            h.push((name.to_owned(), b"other".to_vec()));
            assert_eq!(
                decode(&h, &e.payload.bytes),
                Err(DecodeError::DuplicateHeader(name.to_owned())),
                "{name}"
            );
        }
    }

    /// A null header value is not an empty string.
    #[test]
    fn null_header_values_are_not_empty_strings() {
        let e = sample();
        // A null user header is left out of the envelope, not read as "".
        let mut h = raw(&e);
        h.push(RecordHeader::null("x-null"));
        let back = decode_record(&h, Some(&e.payload.bytes)).unwrap();
        assert!(!back.headers.contains_key("x-null"), "{:?}", back.headers);
        assert_eq!(back, e);
        // An empty user header is an empty string.
        let mut h = raw(&e);
        h.push(RecordHeader::new("x-empty", Vec::new()));
        let back = decode_record(&h, Some(&e.payload.bytes)).unwrap();
        assert_eq!(back.headers.get("x-empty").map(String::as_str), Some(""));
        // A null envelope header is malformed (it was accepted as "" before).
        for name in [EVENT_TYPE, CONTENT_TYPE] {
            let h: Vec<RecordHeader> = raw(&e)
                .into_iter()
                .map(|x| {
                    if x.name == name {
                        RecordHeader::null(name)
                    } else {
                        x
                    }
                })
                .collect();
            assert!(
                matches!(decode_record(&h, Some(&e.payload.bytes)), Err(DecodeError::MalformedHeader { name: n, .. }) if n == name),
                "{name}"
            );
        }
        // Null next to a value of the same header is ambiguous.
        let mut h = raw(&e);
        h.push(RecordHeader::null("traceparent"));
        assert!(matches!(
            decode_record(&h, Some(&e.payload.bytes)),
            Err(DecodeError::DuplicateHeader(_))
        ));
        // A null value is an empty payload.
        let empty = Envelope::builder("order", "o-9", 4, "order.shipped")
            .payload(crate::Payload::new("application/octet-stream", Vec::new()))
            .build()
            .unwrap();
        assert_eq!(decode_record(&raw(&empty), None).unwrap(), empty);
    }

    #[test]
    fn aggregate_of_reads_what_it_can() {
        let e = sample();
        let mut h = raw(&e);
        h.retain(|x| x.name != EVENT_ID);
        assert!(decode_record(&h, None).is_err());
        assert_eq!(
            aggregate_of(&h),
            Some(crate::inbox::AggregateKey::new("order", "o-9"))
        );
        h.push(RecordHeader::new(AGGREGATE_ID, "o-9"));
        assert!(aggregate_of(&h).is_some(), "identical repeat");
        h.push(RecordHeader::new(AGGREGATE_ID, "o-10"));
        assert_eq!(aggregate_of(&h), None, "ambiguous");
        assert_eq!(
            aggregate_of(&[RecordHeader::new(AGGREGATE_TYPE, "order")]),
            None
        );
        assert_eq!(
            aggregate_of(&[
                RecordHeader::new(AGGREGATE_TYPE, "order"),
                RecordHeader::null(AGGREGATE_ID)
            ]),
            None
        );
    }
}
