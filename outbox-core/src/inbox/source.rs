//! Where messages come from: [`MessageSource`], how it acknowledges ([`AckModel`]) and lag.
//! The positions it hands out and the commits it takes back are in `position`.

use std::time::Duration;

use async_trait::async_trait;

use super::{CommitOffset, LogPosition, ReceivedMessage, TopicPartition};
use crate::error::SourceError;
use crate::watermark::SharedOffsetTracker;

/// Lag of one partition: how far the consumer group's committed offset is behind the end of
/// the partition.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionLag {
    /// The partition.
    pub partition: TopicPartition,
    /// The group's committed next offset (`None`: nothing committed yet).
    pub committed: Option<i64>,
    /// The earliest offset still available (log start).
    pub earliest: i64,
    /// The end of the partition (high watermark: next offset to be written).
    pub end: i64,
}

impl PartitionLag {
    /// A lag record.
    pub fn new(partition: TopicPartition, committed: Option<i64>, earliest: i64, end: i64) -> Self {
        Self {
            partition,
            committed,
            earliest,
            end,
        }
    }

    /// Messages between the committed offset (or the log start) and the end.
    pub fn lag(&self) -> i64 {
        (self.end - self.committed.unwrap_or(self.earliest).max(self.earliest)).max(0)
    }

    /// Records the consumer lost to retention: committed offset below the log start.
    pub fn lost_to_retention(&self) -> Option<i64> {
        self.committed
            .filter(|c| *c < self.earliest)
            .map(|c| self.earliest - c)
    }
}

/// How a transport acknowledges consumed messages, which decides how a [`MessageSource`]
/// turns the engine's commits ([`CommitOffset`]: "everything below this offset of the
/// partition is final") into acknowledgements.
///
/// The engine is the same for both models: it tracks a contiguous watermark per partition
/// ([`crate::watermark`]) and commits only offsets below which every message's outcome is
/// final (applied, a duplicate, or parked durably). What differs is what the source does with
/// such a commit, and what it must give as offsets so the watermark stays correct:
///
/// | model | transports | offsets handed out | a commit "next `n`" becomes | a final message behind an unfinished one |
/// |---|---|---|---|---|
/// | [`ContiguousWatermark`](Self::ContiguousWatermark) | Kafka (offsets), RabbitMQ (`basic.ack` with `multiple` on one channel) | the transport's own cumulative coordinate: Kafka offset; RabbitMQ delivery tag, a new channel being a new assignment | one cumulative acknowledgement (offset commit; `ack multiple` up to tag `n - 1`) | acknowledged when the watermark passes it ([`MessageSource::ack_ahead`] is not called) |
/// | [`PerMessage`](Self::PerMessage) | NATS JetStream (`+ACK` per message) | a sequence the source assigns each *delivery*, growing with every delivery, redeliveries included (JetStream's consumer delivery sequence) | one acknowledgement for every delivery below `n` the source handed out and has not acknowledged | acknowledged on its own, ahead of the watermark ([`MessageSource::ack_ahead`], at the engine's next commit) |
///
/// Why one watermark is right for per-message acknowledgement too: the watermark orders
/// *deliveries*, not messages. A message JetStream redelivers after later ones were delivered
/// (its ack wait ran out at a member that crashed) comes at a new, higher delivery sequence, so
/// it is simply the newest delivery: nothing is rewound, nothing already final is forgotten,
/// and no acknowledgement covers it before its own outcome is final. The order of an
/// aggregate across such a redelivery is kept by the inbox (versions, `VersionPolicy::Hold`
/// with `require_first_version`), which never depended on acknowledgement order. The price of
/// the one watermark alone would be that a final message behind an unfinished one (an
/// aggregate held for a missing version, a handler retrying) is acknowledged only when the
/// watermark passes it, and JetStream redelivers it at every ack wait meanwhile; so for
/// per-message sources the engine also hands every final delivery to
/// [`MessageSource::ack_ahead`], which acknowledges it on its own. The watermark still says
/// what is final below it, and its commit acknowledges what the source has not acknowledged
/// ahead (an ack ahead that failed). Sequences that are not per delivery (JetStream's stream sequence) MUST NOT be
/// handed out as offsets: a redelivery would go backwards, which the watermark takes for a
/// rewind of the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AckModel {
    /// One acknowledgement covers a position and everything before it in its partition.
    ContiguousWatermark,
    /// Each delivery is acknowledged on its own.
    PerMessage,
}

impl AckModel {
    /// Stable lowercase name (`contiguous_watermark`, `per_message`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ContiguousWatermark => "contiguous_watermark",
            Self::PerMessage => "per_message",
        }
    }
}

/// A consumer of a transport with manual acknowledgements, seen by the engine as partitions
/// of offsets (see [`AckModel`] for how a transport without partitions or offsets fits).
///
/// # What a transport must provide
///
/// * **Positions** ([`LogPosition`](super::LogPosition)): `topic`/`partition`/`offset` the engine
///   orders and commits by, growing within a partition for every delivery; and the
///   transport's own identity ([`NativePosition`](super::NativePosition)), which parked
///   messages keep so an operator can find the message on the broker. Kafka:
///   [`LogPosition::new`](super::LogPosition::new); JetStream:
///   [`LogPosition::jetstream`](super::LogPosition::jetstream) (stream, stream sequence,
///   delivery sequence, consumer); RabbitMQ: [`LogPosition::rabbitmq`](super::LogPosition::rabbitmq)
///   (queue, delivery tag, exchange, routing key, redelivered).
/// * **Acknowledgement** by [`commit`](Self::commit) only, after the effects' transactions
///   committed, as its [`ack_model`](Self::ack_model) says.
/// * **Redelivery** of everything not acknowledged, after a crash, a rebalance or a lost
///   channel; the inbox absorbs the duplicates.
///
/// # Contract
///
/// * Automatic offset commits MUST be off: offsets move only through [`commit`](Self::commit)
///   and the revoke commits of the attached tracker.
/// * [`commit`](Self::commit) takes *next offsets to read* ([`CommitOffset`]). Offsets of
///   partitions this member no longer owns (or whose assignment was lost) MUST NOT be
///   committed; a commit refused because the group rebalanced MUST be reported as
///   [`SourceErrorKind::Rebalanced`](crate::SourceErrorKind::Rebalanced), which the engine
///   answers by dropping those commits and polling again.
/// * After a rebalance or restart, reading MUST resume from the last committed offset, so any
///   message whose outcome was not final is delivered again.
/// * [`poll`](Self::poll) MUST be cancellation safe: a poll dropped before it completed loses
///   no message.
/// * A source whose committed offset fell below the earliest available offset (records lost
///   to retention) MUST fail the poll with
///   [`SourceErrorKind::RetentionGap`](crate::SourceErrorKind::RetentionGap) naming the
///   partitions and the gap, and MUST NOT skip ahead silently.
/// * [`attach_offsets`](Self::attach_offsets) is called by the engine once, before the first
///   poll. A source with rebalance callbacks MUST, on revoke, commit the tracker's final
///   offsets ([`SharedOffsetTracker::revoke`]); on assignment call
///   [`SharedOffsetTracker::assign`]; on a lost assignment call [`SharedOffsetTracker::lose`]
///   and commit nothing.
/// * [`pause`](Self::pause) and [`resume`](Self::resume) hold back and restart delivery of
///   some partitions (the engine pauses a partition whose messages fill its buffer, so one
///   slow aggregate does not stop the others, and keeps polling, which serves rebalances). A
///   source that returns `Ok(true)` from `pause` MUST, for a paused partition: deliver no
///   message of it from a later poll until it is resumed (at most the messages already handed
///   out before the call); keep its position exactly: after `resume`, delivery continues with
///   the first message not yet delivered (nothing skipped, nothing delivered twice, so order
///   is kept); keep serving the other partitions and the group (rebalances, commits) while
///   it is paused. Pausing a partition the member does not own (any more) is not an error.
///   After a rebalance, a newly assigned partition starts unpaused. A transport without
///   partitions (per-message acknowledgements) maps "partition" to its unit of ordered
///   delivery and MUST keep the same promises, or keep the default, which pauses nothing
///   (the engine then stops polling altogether while it is full).
#[async_trait]
pub trait MessageSource: Send + Sync {
    /// Waits up to `timeout` for the next message. `Ok(None)` when none arrived.
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError>;

    /// Commits next offsets synchronously: acknowledges, as [`ack_model`](Self::ack_model)
    /// says, every message this member handed out below them.
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError>;

    /// How this source acknowledges (see [`AckModel`]). The default is
    /// [`AckModel::ContiguousWatermark`] (Kafka offsets).
    fn ack_model(&self) -> AckModel {
        AckModel::ContiguousWatermark
    }

    /// Acknowledges final deliveries one by one, ahead of the watermark. The engine calls it
    /// only for a source whose [`ack_model`](Self::ack_model) is [`AckModel::PerMessage`],
    /// with the positions of messages whose outcome is final (the effect's transaction
    /// committed, a duplicate or stale version found in a committed transaction, or parked
    /// durably), never before that; a held message is not final.
    ///
    /// A source MAY acknowledge each of these deliveries at once, and MUST NOT acknowledge
    /// through this call any delivery that was never named final to it (by this call or by a
    /// [`commit`](Self::commit) that passed it): it MAY retry here the acknowledgement of a
    /// delivery an earlier call named, whose acknowledgement failed. A position it does not
    /// hold (acknowledged already, or handed out by another connection) is skipped. A failed
    /// acknowledgement needs nothing from the engine, which only logs it: the delivery stays
    /// covered by the next [`commit`](Self::commit) that passes it (or is redelivered, a
    /// duplicate the inbox absorbs; a source that remembers the delivery as final SHOULD
    /// acknowledge that redelivery at once). The default does nothing: the commits acknowledge
    /// everything.
    async fn ack_ahead(&self, positions: &[LogPosition]) -> Result<(), SourceError> {
        let _ = positions;
        Ok(())
    }

    /// Takes the engine's offset tracker, so rebalance callbacks commit exactly what is final.
    fn attach_offsets(&self, offsets: SharedOffsetTracker);

    /// Lag of the assigned partitions. The default reports nothing (a source that cannot tell);
    /// sources over a broker SHOULD implement it.
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        Ok(Vec::new())
    }

    /// Holds back delivery of `partitions` (see the contract). Returns whether the source can
    /// pause; the default cannot (`Ok(false)`, nothing paused).
    async fn pause(&self, partitions: &[TopicPartition]) -> Result<bool, SourceError> {
        let _ = partitions;
        Ok(false)
    }

    /// Restarts delivery of paused `partitions` where each stopped. The default does nothing.
    async fn resume(&self, partitions: &[TopicPartition]) -> Result<(), SourceError> {
        let _ = partitions;
        Ok(())
    }
}
