//! Consumer-side traits: [`InboxStore`] (deduplication in the effect's transaction) and
//! [`MessageSource`] (where messages come from and where offsets are committed).

use async_trait::async_trait;

use crate::envelope::{Envelope, EventId};
use crate::error::{SourceError, StoreError};
use crate::wire::DecodeError;

/// Result of registering an event for a consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Registration {
    /// First time this consumer sees the event: apply the effect in the same transaction.
    Fresh,
    /// Already applied and committed: do not repeat the effect.
    Duplicate,
}

/// Deduplication store of a consumer, used inside the transaction that applies the effect.
///
/// # Contract
///
/// * [`register`](Self::register) MUST record `(consumer, event_id)` inside `tx`, so the record
///   commits or rolls back with the effect. A rolled-back registration MUST leave the event
///   fresh.
/// * It MUST return [`Registration::Duplicate`] only for a registration that was committed.
/// * Two concurrent transactions registering the same pair MUST NOT both commit as fresh: the
///   second either blocks and then sees a duplicate, or fails with a transient `Conflict`.
#[async_trait]
pub trait InboxStore: Send + Sync {
    /// The transaction in which registration and effect happen.
    type Tx: Send;

    /// Begins a transaction.
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Registers `event_id` for `consumer` in `tx`.
    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event_id: EventId,
    ) -> Result<Registration, StoreError>;

    /// Commits `tx`. After `Ok`, the effect and the registration are durable.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls `tx` back; neither the effect nor the registration remains.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Removes registrations older than `retention` (dedup window), in batches of at most
    /// `batch_size`. Returns the number removed.
    async fn cleanup(
        &self,
        retention: std::time::Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError>;
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

/// A message read from a source.
#[derive(Debug)]
#[non_exhaustive]
pub struct ReceivedMessage {
    /// Where it was read.
    pub position: LogPosition,
    /// The record key, if any.
    pub key: Option<Vec<u8>>,
    /// The decoded envelope, or why it could not be decoded (the engine parks such messages;
    /// a malformed message never panics).
    pub envelope: Result<Envelope, DecodeError>,
}

impl ReceivedMessage {
    /// A received message.
    pub fn new(
        position: LogPosition,
        key: Option<Vec<u8>>,
        envelope: Result<Envelope, DecodeError>,
    ) -> Self {
        Self {
            position,
            key,
            envelope,
        }
    }
}

/// A partitioned log consumer with manual offset commits.
///
/// # Contract
///
/// * Automatic offset commits MUST be off: offsets move only through [`commit`](Self::commit).
/// * [`commit`](Self::commit) takes *next offsets to read* (Kafka convention: last processed
///   offset + 1) per partition.
/// * After a rebalance or restart, reading MUST resume from the last committed offset, so any
///   message whose outcome was not final is delivered again.
#[async_trait]
pub trait MessageSource: Send + Sync {
    /// Waits up to `timeout` for the next message. `Ok(None)` when none arrived.
    async fn poll(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<ReceivedMessage>, SourceError>;

    /// Commits `(topic, partition, next_offset)` triples synchronously.
    async fn commit(&self, offsets: &[(String, i32, i64)]) -> Result<(), SourceError>;
}
