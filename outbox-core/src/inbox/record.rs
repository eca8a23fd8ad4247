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
    /// The transport's id of the message outside its position, which a redelivery keeps
    /// (RabbitMQ's `message_id` property); see [`with_message_id`](Self::with_message_id).
    message_id: Option<String>,
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
            message_id: None,
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
            message_id: None,
        }
    }

    /// With the transport's id of the message, given apart from its position and kept by a
    /// redelivery: RabbitMQ's `message_id` property (the outbox publisher sets the event id).
    /// An undecodable message that has one is parked once per queue and id (see
    /// [`ParkedRecord::dedup_id`]); it is not stored with a parked message (stores keep the
    /// position). A source whose position names the message already (Kafka, JetStream)
    /// needs none.
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// The transport's id of the message given with [`with_message_id`](Self::with_message_id).
    pub fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }

    /// The transport's identity of the message, which a redelivery keeps: its position's
    /// ([`LogPosition::message_identity`]), else the message id within the topic (queue).
    fn message_identity(&self) -> Option<Vec<u8>> {
        if let Some(id) = self.position.message_identity() {
            return Some(id);
        }
        let id = self.message_id.as_deref()?;
        let topic = &self.position.topic;
        let mut out = Vec::with_capacity(topic.len() + id.len() + 24);
        out.extend_from_slice(b"message-id");
        out.extend_from_slice(&(topic.len() as u64).to_be_bytes());
        out.extend_from_slice(topic.as_bytes());
        out.extend_from_slice(id.as_bytes());
        Some(out)
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
            dedup_id: match envelope {
                Some(e) => Some(e.dedup_id()),
                None => {
                    undecodable_dedup_id(self.message_identity(), self.key.as_deref(), self.value())
                }
            },
            aggregate_version: envelope.map(|e| e.aggregate_version),
        }
    }
}

/// Namespace of [`undecodable_dedup_id`] (a fixed, random UUID).
const UNDECODABLE_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x2d7e_5a10_c3b4_4f86_9e21_58ad_0c6f_b743);

/// The dedup id of an undecodable record: a UUID v5 of the transport's identity of the message
/// (which a redelivery keeps), its key and its value. The key and value are part of it so that
/// another message under the same identity (a stream deleted and created again, its sequences
/// starting over) is not taken for this one. A UUID v5 is never an outbox event id (v7), so
/// only a record whose event id was made to be this id can hold it; the stores park the
/// undecodable record apart then (see the PostgreSQL store's parking).
fn undecodable_dedup_id(
    identity: Option<Vec<u8>>,
    key: Option<&[u8]>,
    value: Option<&[u8]>,
) -> Option<EventId> {
    let identity = identity?;
    let mut name = Vec::with_capacity(identity.len() + 32);
    for part in [Some(identity.as_slice()), key, value] {
        match part {
            Some(b) => {
                name.push(1);
                name.extend_from_slice(&(b.len() as u64).to_be_bytes());
                name.extend_from_slice(b);
            }
            None => name.push(0),
        }
    }
    Some(EventId::from_uuid(uuid::Uuid::new_v5(
        &UNDECODABLE_NAMESPACE,
        &name,
    )))
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
    /// The id the inbox parks it once by: [`Envelope::dedup_id`] when decodable; for an
    /// undecodable record, an id derived from the transport's identity of the message (a
    /// JetStream stream sequence, [`LogPosition::message_identity`]; a RabbitMQ `message_id`
    /// within its queue, [`ReceivedMessage::with_message_id`]), its key and its value, so that
    /// a redelivery (a new delivery sequence or tag) is recognised as parked already; `None`
    /// when the transport gives no such identity (Kafka: the position is the identity; a
    /// RabbitMQ message without `message_id`): stores park such a record once per position.
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
