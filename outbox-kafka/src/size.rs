//! Record and batch sizes against a topic's `max.message.bytes`.
//!
//! The broker compares `max.message.bytes` with a whole record batch, and when it refuses one
//! as too large librdkafka fails **every** record of that batch with `MSG_SIZE_TOO_LARGE` (it
//! does not split the batch and retry, as the Java client does). A delivery report saying "too
//! large" therefore does not say whose size it was. Classing it as the record's permanent
//! failure parks every small record that happened to share a batch with others, though each
//! would be accepted alone. So:
//!
//! * **At start** (and at every [`crate::KafkaPublisher::check_topics`]), the largest batch the
//!   producer builds, [`producer_batch_bytes`] (the smaller of `batch.size` and
//!   `message.max.bytes`, librdkafka's defaults 1,000,000 bytes each), must not exceed any
//!   topic's `max.message.bytes` as the broker reports it (DescribeConfigs):
//!   [`crate::TopicCheckError::BatchTooLarge`] otherwise, with the fix. `outbox check` makes the
//!   same comparison.
//! * **Per record**, a delivery report refusing a record as too large is classed by the
//!   record's own size, [`single_record_batch_bytes`] (the exact size of a batch holding it
//!   alone, uncompressed), against the topic's limit ([`size_verdict`]):
//!
//! | record alone vs. the topic's `max.message.bytes` | verdict | class, scope |
//! |---|---|---|
//! | over it, no compression | [`SizeVerdict::RecordTooLarge`] | permanent, the record's (parked) |
//! | within it | [`SizeVerdict::BatchTooLarge`] | transient, the transport's: no attempt spent, the relay pauses and retries; the log names the producer's batch size as the cause |
//! | over it uncompressed, with compression on | [`SizeVerdict::Unknown`] | transient, the record's (retried; parked only past the attempt limit) |
//! | limit unknown (not described) | [`SizeVerdict::Unknown`] | transient, the record's |
//!
//! A record larger than the producer's own `message.max.bytes` is refused by librdkafka before
//! it is sent (at enqueue); that is the record's own size and stays permanent.
//!
//! The broker checks the batch after the producer's compression; the sizes here are before it,
//! so a compressed batch is never larger than counted.

use outbox_core::{wire, Envelope, ErrorClass, FailureScope, PublishError, PublishErrorKind};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use crate::Properties;

/// librdkafka's default `batch.size` (bytes).
pub const LIBRDKAFKA_DEFAULT_BATCH_SIZE: u64 = 1_000_000;
/// librdkafka's default `message.max.bytes` (bytes).
pub const LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES: u64 = 1_000_000;
/// The header of a Kafka record batch (message format v2), in bytes.
pub const RECORD_BATCH_HEADER_BYTES: u64 = 61;

/// Bytes of `n` as a zig-zag varint (Kafka's record fields).
fn varint_len(n: u64) -> u64 {
    // Zig-zag of a non-negative number doubles it; 7 bits per byte.
    let mut v = n.saturating_mul(2);
    let mut len = 1;
    while v >= 0x80 {
        v >>= 7;
        len += 1;
    }
    len
}

/// The size of a record batch (format v2, uncompressed) holding one record with a key of
/// `key` bytes, a value of `value` bytes and headers of (name, value) lengths: what the broker
/// would compare with `max.message.bytes` if the record were sent alone.
pub fn single_record_batch_bytes(
    key: usize,
    value: usize,
    headers: impl IntoIterator<Item = (usize, usize)>,
) -> u64 {
    let (key, value) = (key as u64, value as u64);
    let mut count = 0u64;
    let mut header_bytes = 0u64;
    for (name, val) in headers {
        let (name, val) = (name as u64, val as u64);
        count += 1;
        header_bytes += varint_len(name) + name + varint_len(val) + val;
    }
    // attributes (1), timestamp delta (0: 1 byte), offset delta (0: 1 byte), key, value,
    // header count, headers.
    let body =
        3 + varint_len(key) + key + varint_len(value) + value + varint_len(count) + header_bytes;
    RECORD_BATCH_HEADER_BYTES + varint_len(body) + body
}

/// [`single_record_batch_bytes`] of `e` as [`crate::KafkaPublisher`] sends it (key: the
/// aggregate id; value: the payload; headers: [`outbox_core::wire`]).
pub fn envelope_batch_bytes(e: &Envelope) -> u64 {
    let mut headers = Vec::with_capacity(8 + e.headers.len());
    wire::for_each_header(e, |name, value| headers.push((name.len(), value.len())));
    single_record_batch_bytes(e.aggregate_id.len(), e.payload.bytes.len(), headers)
}

fn property_bytes(properties: &Properties, key: &str, default: u64) -> u64 {
    properties
        .get(key)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// The largest record batch the producer builds with `properties`: the smaller of
/// `batch.size` and `message.max.bytes` (librdkafka's defaults when unset).
pub fn producer_batch_bytes(properties: &Properties) -> u64 {
    property_bytes(properties, "batch.size", LIBRDKAFKA_DEFAULT_BATCH_SIZE).min(property_bytes(
        properties,
        "message.max.bytes",
        LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES,
    ))
}

/// Whether the producer compresses batches (`compression.type` or `compression.codec` set to
/// anything but `none`).
pub fn producer_compresses(properties: &Properties) -> bool {
    ["compression.type", "compression.codec"].iter().any(|k| {
        properties
            .get(k)
            .is_some_and(|v| !v.trim().eq_ignore_ascii_case("none"))
    })
}

/// Whose size a "too large" refusal was, see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SizeVerdict {
    /// The record alone exceeds the topic's limit: no retry can help.
    RecordTooLarge,
    /// The record alone fits: its batch was too large (the producer's batch size exceeds the
    /// topic's limit).
    BatchTooLarge,
    /// Not known (the topic's limit is unknown, or compression may make the record fit).
    Unknown,
}

/// The verdict on a record of `record_bytes` (alone in a batch, uncompressed) refused as too
/// large by a topic whose `max.message.bytes` is `topic_limit`.
pub fn size_verdict(record_bytes: u64, topic_limit: Option<u64>, compressed: bool) -> SizeVerdict {
    match topic_limit {
        None => SizeVerdict::Unknown,
        Some(limit) if record_bytes <= limit => SizeVerdict::BatchTooLarge,
        Some(_) if compressed => SizeVerdict::Unknown,
        Some(_) => SizeVerdict::RecordTooLarge,
    }
}

/// `true` for the codes of a broker refusing a record (or its batch) as too large.
pub fn is_size_refusal(err: &KafkaError) -> bool {
    matches!(
        err.rdkafka_error_code(),
        Some(RDKafkaErrorCode::MessageSizeTooLarge | RDKafkaErrorCode::MessageBatchTooLarge)
    )
}

/// The error of a record to `topic` whose delivery report refused it as too large (`err`),
/// classed by [`size_verdict`].
pub fn size_refusal_error(
    topic: &str,
    err: &KafkaError,
    record_bytes: u64,
    topic_limit: Option<u64>,
    compressed: bool,
) -> PublishError {
    let limit = topic_limit.map_or_else(|| "unknown".to_owned(), |l| l.to_string());
    let (class, scope, what) = match size_verdict(record_bytes, topic_limit, compressed) {
        SizeVerdict::RecordTooLarge => (
            ErrorClass::Permanent,
            FailureScope::Record,
            format!(
                "the record alone is {record_bytes} bytes, over the topic's max.message.bytes \
                 ({limit})"
            ),
        ),
        SizeVerdict::BatchTooLarge => (
            ErrorClass::Transient,
            FailureScope::Transport,
            format!(
                "the broker refused the batch this record was sent in; the record alone is \
                 {record_bytes} bytes, within the topic's max.message.bytes ({limit}): lower the \
                 producer's batch.size to at most {limit}"
            ),
        ),
        SizeVerdict::Unknown => (
            ErrorClass::Transient,
            FailureScope::Record,
            format!(
                "the record alone is {record_bytes} bytes (before compression) and the topic's \
                 max.message.bytes is {limit}: the record or its batch was too large"
            ),
        ),
    };
    PublishError::new(
        PublishErrorKind::RecordTooLarge,
        format!("topic {topic:?}: {err}: {what}"),
    )
    .with_class(class)
    .with_scope(scope)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_table() {
        use SizeVerdict::{BatchTooLarge, RecordTooLarge, Unknown};
        let table = [
            // (record bytes, topic limit, compressed, verdict)
            (500, Some(1_000), false, BatchTooLarge),
            (1_000, Some(1_000), false, BatchTooLarge),
            (1_001, Some(1_000), false, RecordTooLarge),
            (1_001, Some(1_000), true, Unknown),
            (500, Some(1_000), true, BatchTooLarge),
            (500, None, false, Unknown),
            (5_000_000, None, false, Unknown),
        ];
        for (bytes, limit, compressed, want) in table {
            assert_eq!(
                size_verdict(bytes, limit, compressed),
                want,
                "{bytes} vs {limit:?} (compressed: {compressed})"
            );
        }
    }

    #[test]
    fn refusals_are_classed_by_the_records_own_size() {
        let err = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        let table = [
            (
                900,
                Some(1_000),
                ErrorClass::Transient,
                FailureScope::Transport,
                "lower the producer's batch.size to at most 1000",
            ),
            (
                1_200,
                Some(1_000),
                ErrorClass::Permanent,
                FailureScope::Record,
                "over the topic's max.message.bytes (1000)",
            ),
            (
                900,
                None,
                ErrorClass::Transient,
                FailureScope::Record,
                "max.message.bytes is unknown",
            ),
        ];
        for (bytes, limit, class, scope, says) in table {
            let e = size_refusal_error("orders", &err, bytes, limit, false);
            assert_eq!(e.kind, PublishErrorKind::RecordTooLarge);
            assert_eq!((e.class, e.scope), (class, scope), "{bytes} vs {limit:?}");
            assert!(e.message.contains(says), "{}", e.message);
            assert!(e.message.starts_with("topic \"orders\": "), "{}", e.message);
            // The broker refused it: never "maybe delivered".
            assert!(!e.kind.delivery_uncertain());
        }
        assert!(is_size_refusal(&err));
        assert!(is_size_refusal(&KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageBatchTooLarge
        )));
        assert!(!is_size_refusal(&KafkaError::MessageProduction(
            RDKafkaErrorCode::MessageTimedOut
        )));
    }

    #[test]
    fn varints_and_single_record_batches() {
        assert_eq!(varint_len(0), 1);
        assert_eq!(varint_len(63), 1);
        assert_eq!(varint_len(64), 2);
        assert_eq!(varint_len(8191), 2);
        assert_eq!(varint_len(8192), 3);
        // Empty record: header + length(1) + attributes, deltas (3) + key/value lengths (2) +
        // header count (1).
        assert_eq!(single_record_batch_bytes(0, 0, []), 61 + 1 + 6);
        // Key "o-1", 100-byte value, one header ("a", "bc").
        let body = 3 + 1 + 3 + 2 + 100 + 1 + (1 + 1 + 1 + 2);
        assert_eq!(
            single_record_batch_bytes(3, 100, [(1, 2)]),
            61 + 2 + body as u64
        );
        let e = Envelope::builder("order", "o-1", 1, "order.placed")
            .json(&serde_json::json!({"note": "x".repeat(1000)}))
            .unwrap()
            .build()
            .unwrap();
        let bytes = envelope_batch_bytes(&e);
        assert!(bytes > e.payload.bytes.len() as u64 + 61, "{bytes}");
        assert!(bytes < e.payload.bytes.len() as u64 + 1_000, "{bytes}");
    }

    #[test]
    fn the_producer_batch_bound_is_the_smaller_of_its_two_limits() {
        let mut p = Properties::default();
        assert_eq!(producer_batch_bytes(&p), 1_000_000);
        assert!(!producer_compresses(&p));
        p.set("batch.size", "40000");
        assert_eq!(producer_batch_bytes(&p), 40_000);
        p.set("message.max.bytes", "20000");
        assert_eq!(producer_batch_bytes(&p), 20_000);
        p.set("compression.type", "zstd");
        assert!(producer_compresses(&p));
        p.set("compression.type", "none");
        assert!(!producer_compresses(&p));
    }
}
