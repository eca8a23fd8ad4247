//! Positions of consumed messages: the coordinates the engine orders and commits by
//! ([`TopicPartition`], [`LogPosition`], [`CommitOffset`]) and the transport's own identity of
//! the message ([`NativePosition`]), which parked messages keep and operators see.

use std::fmt;

use crate::delivery::TransportKind;

/// A partition of a topic.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TopicPartition {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
}

impl TopicPartition {
    /// A partition.
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        Self {
            topic: topic.into(),
            partition,
        }
    }

    /// The commit "resume reading this partition at `next_offset`".
    pub fn at_next(&self, next_offset: i64) -> CommitOffset {
        CommitOffset {
            topic: self.topic.clone(),
            partition: self.partition,
            next_offset,
        }
    }
}

impl fmt::Display for TopicPartition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.topic, self.partition)
    }
}

/// The transport's own identity of a delivered message, beside the coordinates the engine
/// orders and commits by ([`LogPosition::topic`], [`LogPosition::partition`],
/// [`LogPosition::offset`]).
///
/// | transport | `topic` | `partition` | `offset` | here |
/// |---|---|---|---|---|
/// | Kafka (any partitioned log) | topic | partition | offset | [`Log`](Self::Log): the coordinates are the identity |
/// | JetStream | stream | 0 | the consumer's delivery sequence | [`JetStream`](Self::JetStream): stream sequence, durable consumer |
/// | RabbitMQ | queue | 0 | the channel's delivery tag | [`RabbitMq`](Self::RabbitMq): exchange, routing key, redelivered flag |
///
/// The coordinates of JetStream and RabbitMQ name a *delivery*, not a message: the same
/// message delivered again gets a new delivery sequence or tag. The stable identity an operator
/// looks a message up by is the stream sequence (JetStream) or the exchange and routing key with
/// the event id (RabbitMQ, which gives a queued message no position of its own).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum NativePosition {
    /// A partitioned log (Kafka): topic, partition and offset say it all.
    #[default]
    Log,
    /// A JetStream delivery through a durable pull consumer.
    JetStream {
        /// The message's stream sequence: its stable identity in the stream.
        stream_sequence: u64,
        /// The durable consumer that delivered it.
        consumer: String,
    },
    /// A RabbitMQ delivery (`basic.deliver`) from a queue.
    RabbitMq {
        /// The exchange the message was published to (empty: the default exchange).
        exchange: String,
        /// The routing key it was published with.
        routing_key: String,
        /// The broker delivered it before (to this or another consumer) without an ack.
        redelivered: bool,
    },
}

impl NativePosition {
    /// The transport that gives positions of this form (a plain log counts as Kafka).
    pub const fn transport(&self) -> TransportKind {
        match self {
            Self::Log => TransportKind::Kafka,
            Self::JetStream { .. } => TransportKind::Nats,
            Self::RabbitMq { .. } => TransportKind::RabbitMq,
        }
    }
}

/// Position of a delivered message: the coordinates the engine orders, tracks and commits by
/// (`topic`, `partition`, `offset`: see [`crate::watermark`]) and the transport's own identity
/// ([`native`](Self::native)). [`LogPosition::new`] is the Kafka (plain log) form; the other
/// transports' sources use [`jetstream`](Self::jetstream) and [`rabbitmq`](Self::rabbitmq).
///
/// ```
/// use outbox_core::LogPosition;
/// assert_eq!(LogPosition::new("orders", 2, 41).to_string(), "orders/2@41");
/// let js = LogPosition::jetstream("ORDERS", 42, 3, "billing");
/// assert_eq!((js.topic.as_str(), js.partition, js.offset), ("ORDERS", 0, 3));
/// assert_eq!(js.to_string(), "stream ORDERS seq 42 (delivery 3, consumer billing)");
/// let amqp = LogPosition::rabbitmq("orders-q", 7, "outbox", "order.created", true);
/// assert_eq!(
///     amqp.to_string(),
///     "queue orders-q tag 7 (exchange outbox, routing key order.created, redelivered)"
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogPosition {
    /// Topic (JetStream: the stream; RabbitMQ: the queue).
    pub topic: String,
    /// Partition (0 for a transport without partitions).
    pub partition: i32,
    /// Offset of the message (JetStream: the consumer's delivery sequence; RabbitMQ: the
    /// channel's delivery tag): what the watermark orders and commits by.
    pub offset: i64,
    /// The transport's own identity of the message.
    pub native: NativePosition,
}

fn clamp(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl LogPosition {
    /// A position in a partitioned log (Kafka, or any source whose coordinates are the
    /// message's identity).
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            offset,
            native: NativePosition::Log,
        }
    }

    /// A JetStream delivery: ordered and committed by the consumer's `delivery_sequence`
    /// (which grows with every delivery, redeliveries included) in "partition" 0 of `stream`;
    /// identified by `stream_sequence`. A sequence above `i64::MAX` is given as `i64::MAX`.
    pub fn jetstream(
        stream: impl Into<String>,
        stream_sequence: u64,
        delivery_sequence: u64,
        consumer: impl Into<String>,
    ) -> Self {
        Self {
            topic: stream.into(),
            partition: 0,
            offset: clamp(delivery_sequence),
            native: NativePosition::JetStream {
                stream_sequence,
                consumer: consumer.into(),
            },
        }
    }

    /// A RabbitMQ delivery: ordered and committed by the channel's `delivery_tag` in
    /// "partition" 0 of `queue`; published to `exchange` with `routing_key`.
    pub fn rabbitmq(
        queue: impl Into<String>,
        delivery_tag: u64,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
        redelivered: bool,
    ) -> Self {
        Self {
            topic: queue.into(),
            partition: 0,
            offset: clamp(delivery_tag),
            native: NativePosition::RabbitMq {
                exchange: exchange.into(),
                routing_key: routing_key.into(),
                redelivered,
            },
        }
    }

    /// The transport's identity of the *message*, one that a redelivery keeps (the
    /// coordinates of JetStream and RabbitMQ name a delivery, which a redelivery changes):
    /// JetStream's stream and stream sequence. `None` where the coordinates are the identity
    /// (Kafka: topic, partition, offset) and where the position holds none (RabbitMQ, whose
    /// `message_id` a source gives with
    /// [`ReceivedMessage::with_message_id`](super::ReceivedMessage::with_message_id)). An
    /// undecodable message is parked once per its identity
    /// ([`ParkedRecord::dedup_id`](super::ParkedRecord::dedup_id)), else once per position.
    pub fn message_identity(&self) -> Option<Vec<u8>> {
        match &self.native {
            NativePosition::JetStream {
                stream_sequence, ..
            } => {
                let mut id = Vec::with_capacity(self.topic.len() + 24);
                id.extend_from_slice(b"nats");
                id.extend_from_slice(&(self.topic.len() as u64).to_be_bytes());
                id.extend_from_slice(self.topic.as_bytes());
                id.extend_from_slice(&stream_sequence.to_be_bytes());
                Some(id)
            }
            NativePosition::Log | NativePosition::RabbitMq { .. } => None,
        }
    }

    /// The partition.
    pub fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.clone(), self.partition)
    }

    /// The commit that marks this message and everything before it as final (offset + 1).
    pub fn next(&self) -> CommitOffset {
        CommitOffset::new(self.topic.clone(), self.partition, self.offset + 1)
    }

    /// The transport's columns of this position, as the parked tables store them.
    pub fn native_columns(&self) -> NativeColumns {
        match &self.native {
            NativePosition::Log => NativeColumns {
                transport: Some(TransportKind::Kafka.as_str().to_owned()),
                ..NativeColumns::default()
            },
            NativePosition::JetStream {
                stream_sequence,
                consumer,
            } => NativeColumns {
                transport: Some(TransportKind::Nats.as_str().to_owned()),
                sequence: Some(clamp(*stream_sequence)),
                consumer: Some(consumer.clone()),
                ..NativeColumns::default()
            },
            NativePosition::RabbitMq {
                exchange,
                routing_key,
                redelivered,
            } => NativeColumns {
                transport: Some(TransportKind::RabbitMq.as_str().to_owned()),
                exchange: Some(exchange.clone()),
                routing_key: Some(routing_key.clone()),
                redelivered: Some(*redelivered),
                ..NativeColumns::default()
            },
        }
    }

    /// Maps stored columns back. No transport (a row written before the stores kept it, or by
    /// a consumer of that version) is a Kafka position, as it was read then. Refuses (instead
    /// of guessing) an unknown transport and a column its transport needs that is missing or
    /// out of range.
    pub fn from_columns(
        topic: impl Into<String>,
        partition: i32,
        offset: i64,
        columns: NativeColumns,
    ) -> Result<Self, NativeColumnsError> {
        let mut p = Self::new(topic, partition, offset);
        let Some(transport) = columns.transport.as_deref() else {
            return Ok(p);
        };
        let kind = TransportKind::parse(transport).ok_or_else(|| {
            NativeColumnsError(format!(
                "unknown transport {transport:?} (this version knows kafka, nats, rabbitmq)"
            ))
        })?;
        let missing = |what: &str| NativeColumnsError(format!("a {kind} position without {what}"));
        p.native = match kind {
            TransportKind::Kafka => NativePosition::Log,
            TransportKind::Nats => NativePosition::JetStream {
                stream_sequence: columns
                    .sequence
                    .ok_or_else(|| missing("a stream sequence"))
                    .and_then(|s| {
                        u64::try_from(s).map_err(|_| {
                            NativeColumnsError(format!("a negative stream sequence {s}"))
                        })
                    })?,
                consumer: columns.consumer.ok_or_else(|| missing("a consumer"))?,
            },
            TransportKind::RabbitMq => NativePosition::RabbitMq {
                exchange: columns.exchange.ok_or_else(|| missing("an exchange"))?,
                routing_key: columns
                    .routing_key
                    .ok_or_else(|| missing("a routing key"))?,
                redelivered: columns
                    .redelivered
                    .ok_or_else(|| missing("its redelivered flag"))?,
            },
        };
        Ok(p)
    }
}

/// The transport's own form: `orders/2@41` (topic/partition@offset), `stream ORDERS seq 42
/// (delivery 3, consumer billing)`, `queue orders-q tag 7 (exchange outbox, routing key
/// order.created[, redelivered])`.
impl fmt::Display for LogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.native {
            NativePosition::Log => write!(f, "{}/{}@{}", self.topic, self.partition, self.offset),
            NativePosition::JetStream {
                stream_sequence,
                consumer,
            } => write!(
                f,
                "stream {} seq {stream_sequence} (delivery {}, consumer {consumer})",
                self.topic, self.offset
            ),
            NativePosition::RabbitMq {
                exchange,
                routing_key,
                redelivered,
            } => {
                let exchange = if exchange.is_empty() {
                    "(default)"
                } else {
                    exchange
                };
                write!(
                    f,
                    "queue {} tag {} (exchange {exchange}, routing key {routing_key}",
                    self.topic, self.offset
                )?;
                if *redelivered {
                    f.write_str(", redelivered")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// The parked tables' columns of a [`NativePosition`] (beside `topic`, `partition`,
/// `offset`): `native_transport` (`kafka`, `nats`, `rabbitmq`; none for rows written before
/// they existed: Kafka), `native_sequence` (JetStream stream sequence), `native_consumer`
/// (JetStream durable), `native_exchange`, `native_routing_key`, `native_redelivered`
/// (RabbitMQ). A transport fills only its own.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct NativeColumns {
    /// `native_transport`.
    pub transport: Option<String>,
    /// `native_sequence`.
    pub sequence: Option<i64>,
    /// `native_consumer`.
    pub consumer: Option<String>,
    /// `native_exchange`.
    pub exchange: Option<String>,
    /// `native_routing_key`.
    pub routing_key: Option<String>,
    /// `native_redelivered`.
    pub redelivered: Option<bool>,
}

impl NativeColumns {
    /// Columns as read from a row.
    pub fn new(
        transport: Option<String>,
        sequence: Option<i64>,
        consumer: Option<String>,
        exchange: Option<String>,
        routing_key: Option<String>,
        redelivered: Option<bool>,
    ) -> Self {
        Self {
            transport,
            sequence,
            consumer,
            exchange,
            routing_key,
            redelivered,
        }
    }
}

/// Stored position columns that do not describe a position this version can read
/// ([`LogPosition::from_columns`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeColumnsError(String);

impl fmt::Display for NativeColumnsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stored position: {}", self.0)
    }
}

impl std::error::Error for NativeColumnsError {}

/// An offset to commit: the **next** offset to read in a partition (Kafka's convention: last
/// final offset + 1). A distinct type from [`LogPosition`] so the two are never confused.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommitOffset {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Next offset to read.
    pub next_offset: i64,
}

impl CommitOffset {
    /// A commit.
    pub fn new(topic: impl Into<String>, partition: i32, next_offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            next_offset,
        }
    }

    /// The partition.
    pub fn topic_partition(&self) -> TopicPartition {
        TopicPartition::new(self.topic.clone(), self.partition)
    }
}

impl fmt::Display for CommitOffset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} next {}",
            self.topic, self.partition, self.next_offset
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::watermark::{BeginKind, OffsetTracker};

    fn cols(
        transport: Option<&str>,
        sequence: Option<i64>,
        consumer: Option<&str>,
        exchange: Option<&str>,
        routing_key: Option<&str>,
        redelivered: Option<bool>,
    ) -> NativeColumns {
        NativeColumns::new(
            transport.map(str::to_owned),
            sequence,
            consumer.map(str::to_owned),
            exchange.map(str::to_owned),
            routing_key.map(str::to_owned),
            redelivered,
        )
    }

    /// Each transport's position keeps its own identity through the stored columns, and the
    /// coordinates the engine orders by are the delivery's.
    #[test]
    fn native_positions_round_trip_through_their_columns() {
        let cases = [
            LogPosition::new("orders", 3, 41),
            LogPosition::jetstream("ORDERS", 42, 3, "billing"),
            LogPosition::rabbitmq("orders-q", 7, "outbox", "order.created", true),
            LogPosition::rabbitmq("q", 1, "", "q", false),
        ];
        for p in cases {
            let c = p.native_columns();
            assert_eq!(
                c.transport.as_deref(),
                Some(p.native.transport().as_str()),
                "{p}"
            );
            let back = LogPosition::from_columns(p.topic.clone(), p.partition, p.offset, c)
                .expect("readable");
            assert_eq!(back, p);
        }
        let js = LogPosition::jetstream("S", 42, 3, "d");
        assert_eq!((js.partition, js.offset), (0, 3), "ordered by delivery");
        assert_eq!(
            js.native_columns(),
            cols(Some("nats"), Some(42), Some("d"), None, None, None)
        );
        let big = LogPosition::jetstream("S", u64::MAX, u64::MAX, "d");
        assert_eq!(big.offset, i64::MAX);
        assert_eq!(big.native_columns().sequence, Some(i64::MAX));
    }

    /// A row written before the native columns existed (no transport) reads back as the
    /// Kafka position it was read as then; columns that do not describe a position are refused.
    #[test]
    fn stored_columns_are_read_or_refused() {
        let old = LogPosition::from_columns("t", 1, 5, NativeColumns::default()).unwrap();
        assert_eq!(old, LogPosition::new("t", 1, 5));
        assert_eq!(old.native, NativePosition::Log);
        let bad = [
            (
                cols(Some("mqtt"), None, None, None, None, None),
                "unknown transport",
            ),
            (
                cols(Some("nats"), None, Some("d"), None, None, None),
                "stream sequence",
            ),
            (
                cols(Some("nats"), Some(-1), Some("d"), None, None, None),
                "negative",
            ),
            (
                cols(Some("nats"), Some(1), None, None, None, None),
                "consumer",
            ),
            (
                cols(Some("rabbitmq"), None, None, None, Some("k"), Some(false)),
                "exchange",
            ),
            (
                cols(Some("rabbitmq"), None, None, Some("x"), None, Some(false)),
                "routing key",
            ),
            (
                cols(Some("rabbitmq"), None, None, Some("x"), Some("k"), None),
                "redelivered",
            ),
        ];
        for (c, expected) in bad {
            let err = LogPosition::from_columns("t", 0, 1, c.clone())
                .expect_err(expected)
                .to_string();
            assert!(err.contains(expected), "{c:?}: {err}");
            assert!(err.starts_with("stored position"), "{err}");
        }
    }

    #[test]
    fn positions_display_in_the_transports_own_terms() {
        assert_eq!(LogPosition::new("orders", 2, 41).to_string(), "orders/2@41");
        assert_eq!(
            LogPosition::jetstream("ORDERS", 42, 3, "billing").to_string(),
            "stream ORDERS seq 42 (delivery 3, consumer billing)"
        );
        assert_eq!(
            LogPosition::rabbitmq("q", 9, "", "q", false).to_string(),
            "queue q tag 9 (exchange (default), routing key q)"
        );
        assert_eq!(
            LogPosition::rabbitmq("q", 9, "x", "a.b", true).to_string(),
            "queue q tag 9 (exchange x, routing key a.b, redelivered)"
        );
    }

    /// Why JetStream positions are ordered by delivery sequence: a redelivery after later
    /// messages were delivered is the newest delivery, so the watermark goes on (no rewind,
    /// the later messages' tickets stay current) and holds everything behind the redelivered
    /// message until it is final. Ordered by stream sequence, the same redelivery would be a
    /// rewind that forgets the later messages still in flight.
    #[test]
    fn a_jetstream_redelivery_is_the_newest_delivery_not_a_rewind() {
        let mut t = OffsetTracker::default();
        // Stream sequences 2 and 3 delivered (deliveries 2, 3); stream sequence 1 (delivery 1
        // at a member that crashed) comes again as delivery 4.
        let later: Vec<_> = [(2, 2), (3, 3)]
            .iter()
            .map(|(s, d)| t.begin(&LogPosition::jetstream("S", *s, *d, "c")))
            .collect();
        let (head, kind) = t.begin_checked(&LogPosition::jetstream("S", 1, 4, "c"));
        assert_eq!(kind, BeginKind::Forward);
        assert!(later.iter().all(|tk| t.is_current(tk)));
        for tk in &later {
            t.finish(tk);
        }
        let tp = TopicPartition::new("S", 0);
        assert_eq!(
            t.take_commits(),
            vec![tp.at_next(4)],
            "held at the redelivered message"
        );
        t.finish(&head);
        assert_eq!(t.take_commits(), vec![tp.at_next(5)]);
        assert_eq!(t.rewinds(), 0);

        // The same deliveries ordered by stream sequence: the redelivery is a rewind.
        let mut by_stream = OffsetTracker::default();
        let a = by_stream.begin(&LogPosition::new("S", 0, 2));
        by_stream.begin(&LogPosition::new("S", 0, 3));
        let kind = by_stream.begin_checked(&LogPosition::new("S", 0, 1)).1;
        assert!(matches!(kind, BeginKind::Rewind { .. }));
        assert!(!by_stream.is_current(&a));
    }
}
