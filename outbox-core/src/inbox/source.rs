//! Where messages come from: [`MessageSource`], positions in a partitioned log, the offsets
//! committed back, and lag.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;

use super::ReceivedMessage;
use crate::error::SourceError;
use crate::watermark::SharedOffsetTracker;

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

/// Position of a message in a partitioned log.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogPosition {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset of the message.
    pub offset: i64,
}

impl LogPosition {
    /// A position.
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            offset,
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
}

impl fmt::Display for LogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.topic, self.partition, self.offset)
    }
}

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

/// A partitioned log consumer with manual offset commits.
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

    /// Commits next offsets synchronously.
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError>;

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
