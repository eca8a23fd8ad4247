//! A message as read ([`ReceivedMessage`]) and as kept when parked ([`ParkedRecord`]), with
//! its raw headers and aggregate.

use std::fmt;

use chrono::{DateTime, Utc};

use super::LogPosition;
use crate::envelope::{Envelope, EventId};
use crate::wire::{self, DecodeError};

/// One record header as it came from the log. `value: None` is a null header value, which is
/// not the same as an empty one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RecordHeader {
    /// Name.
    pub name: String,
    /// Value; `None` when the producer sent a null value.
    pub value: Option<Vec<u8>>,
}

impl RecordHeader {
    /// A header with a value.
    pub fn new(name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self {
            name: name.into(),
            value: Some(value.into()),
        }
    }

    /// A header with a null value.
    pub fn null(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            value: None,
        }
    }
}

/// The identity of an aggregate: type and id.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AggregateKey {
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: String,
}

impl AggregateKey {
    /// A key.
    pub fn new(aggregate_type: impl Into<String>, aggregate_id: impl Into<String>) -> Self {
        Self {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
        }
    }

    /// The aggregate of `e`.
    pub fn of(e: &Envelope) -> Self {
        Self::new(e.aggregate_type.clone(), e.aggregate_id.clone())
    }
}

impl fmt::Display for AggregateKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.aggregate_type, self.aggregate_id)
    }
}

/// A message read from a source: its position, the raw record and the decoded envelope.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// Where it was read.
    pub position: LogPosition,
    /// The record key, if any.
    pub key: Option<Vec<u8>>,
    /// The record headers exactly as received (parked messages keep them).
    pub headers: Vec<RecordHeader>,
    /// The broker's timestamp of the record, when known.
    pub timestamp: Option<DateTime<Utc>>,
    /// The decoded envelope, or why it could not be decoded (the engine parks such messages;
    /// a malformed message never panics).
    pub envelope: Result<Envelope, DecodeError>,
    /// The raw value, kept only when decoding failed (else it is the envelope's payload).
    undecoded_value: Option<Vec<u8>>,
}

impl ReceivedMessage {
    /// A message with an already decoded (or failed) envelope; the headers are the wire
    /// mapping of the envelope (none when decoding failed). For tests and in-process sources.
    pub fn new(
        position: LogPosition,
        key: Option<Vec<u8>>,
        envelope: Result<Envelope, DecodeError>,
    ) -> Self {
        let headers = match &envelope {
            Ok(e) => wire::encode_headers(e)
                .into_iter()
                .map(|(k, v)| RecordHeader::new(k, v))
                .collect(),
            Err(_) => Vec::new(),
        };
        Self {
            position,
            key,
            headers,
            timestamp: None,
            envelope,
            undecoded_value: None,
        }
    }

    /// Decodes a raw record ([`wire::decode_record`]); never panics on hostile input.
    pub fn from_record(
        position: LogPosition,
        key: Option<Vec<u8>>,
        headers: Vec<RecordHeader>,
        value: Option<Vec<u8>>,
        timestamp: Option<DateTime<Utc>>,
    ) -> Self {
        let envelope = wire::decode_record(&headers, value.as_deref());
        let undecoded_value = if envelope.is_err() { value } else { None };
        Self {
            position,
            key,
            headers,
            timestamp,
            envelope,
            undecoded_value,
        }
    }

    /// The record value (`None`: a null value).
    pub fn value(&self) -> Option<&[u8]> {
        match &self.envelope {
            Ok(e) => Some(&e.payload.bytes),
            Err(_) => self.undecoded_value.as_deref(),
        }
    }

    /// The aggregate this message belongs to: from the envelope, or, for a message that cannot
    /// be decoded, from its `aggregate_type` and `aggregate_id` headers when those are readable
    /// ([`wire::aggregate_of`]).
    pub fn aggregate(&self) -> Option<AggregateKey> {
        match &self.envelope {
            Ok(e) => Some(AggregateKey::of(e)),
            Err(_) => wire::aggregate_of(&self.headers),
        }
    }

    /// The raw record, for parking.
    pub fn to_record(&self) -> ParkedRecord {
        let envelope = self.envelope.as_ref().ok();
        ParkedRecord {
            position: self.position.clone(),
            key: self.key.clone(),
            headers: self.headers.clone(),
            value: self.value().map(<[u8]>::to_vec),
            aggregate: self.aggregate(),
            event_id: envelope.map(|e| e.event_id),
            dedup_id: envelope.map(Envelope::dedup_id),
            aggregate_version: envelope.map(|e| e.aggregate_version),
        }
    }
}

/// A message as it came from the log, with what could be decoded of it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ParkedRecord {
    /// Where it was read.
    pub position: LogPosition,
    /// Record key.
    pub key: Option<Vec<u8>>,
    /// Record headers, raw.
    pub headers: Vec<RecordHeader>,
    /// Record value, raw (`None`: null).
    pub value: Option<Vec<u8>>,
    /// Its aggregate, when known.
    pub aggregate: Option<AggregateKey>,
    /// Its event id, when decodable.
    pub event_id: Option<EventId>,
    /// The id the inbox deduplicates it by ([`Envelope::dedup_id`]), when decodable.
    pub dedup_id: Option<EventId>,
    /// Its aggregate version, when decodable.
    pub aggregate_version: Option<i64>,
}

impl ParkedRecord {
    /// A record from its raw parts, with what can be decoded of it (for stores reading rows
    /// back, and for tests).
    pub fn new(
        position: LogPosition,
        key: Option<Vec<u8>>,
        headers: Vec<RecordHeader>,
        value: Option<Vec<u8>>,
    ) -> Self {
        ReceivedMessage::from_record(position, key, headers, value, None).to_record()
    }

    /// Decodes the record again.
    pub fn decode(&self) -> Result<Envelope, DecodeError> {
        wire::decode_record(&self.headers, self.value.as_deref())
    }
}
