//! # outbox-inbox: the idempotent consumer engine
//!
//! Applies each event's effect **once per consumer** although the relay delivers at least once,
//! keeps an aggregate's events in order, parks what cannot be applied without stopping anything
//! else, and commits offsets only past messages whose outcome is final.
//!
//! For a batch of messages, in one transaction of the consumer's own database:
//!
//! 1. Read the aggregates' state: the last version applied and whether a parked message blocks
//!    them ([`outbox_core::InboxStore::aggregates`]).
//! 2. Decide per message, in order: apply; skip a version at or below the applied one
//!    (*stale*); park it as waiting behind its aggregate's parked message; park it as a
//!    version gap or hold it ([`VersionPolicy`]); park it when it cannot be decoded.
//! 3. Register the messages to apply by [`outbox_core::Envelope::dedup_id`] (a re-issued copy
//!    and its original are one event). A duplicate is not applied again.
//! 4. Run the [`Handler`] on the fresh ones, in order. If it fails, everything rolls back,
//!    registrations included: an unapplied event is never marked processed. The engine retries
//!    transient failures with backoff and parks a message that fails permanently or too often.
//! 5. Record the new versions and the parked messages, commit. Only then are the messages'
//!    offsets *final*; the committed offset follows the contiguous watermark
//!    ([`outbox_core::watermark`]), so it never passes an unfinished effect.
//!
//! The [`ConsumerEngine`] runs this in concurrent batches (an aggregate in at most one at a time),
//! hands its offset tracker to the source for rebalances, drops commits a rebalance refused,
//! stops on a retention gap, cleans the inbox up on a schedule ([`CleanupSchedule`]) and emits
//! the [`metrics`] of the consumer. [`ParkedMessages`] is the operator's API: list, show,
//! retry, discard, audit trail.
//!
//! Effects on external systems use [`idempotency_key`], a stable key derived from
//! `(consumer, event_id)`, so the external API can deduplicate too.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::time::Duration;
//! use outbox_core::{async_trait, Envelope, Publisher};
//! use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
//! use outbox_testkit::{ManualClock, MemoryDb, MemoryInboxStore, MemoryLog, MemoryTx};
//!
//! /// Counts confirmed orders; the count lives in the same transaction as the inbox record.
//! struct Counter;
//! #[async_trait]
//! impl Handler<MemoryTx> for Counter {
//!     async fn handle(&self, tx: &mut MemoryTx, _event: &Envelope) -> Result<(), HandlerError> {
//!         let n = tx.get("stats", "confirmed").and_then(|v| v.as_i64()).unwrap_or(0);
//!         tx.put("stats", "confirmed", serde_json::json!(n + 1));
//!         Ok(())
//!     }
//! }
//!
//! let db = MemoryDb::new(ManualClock::default());
//! let log = MemoryLog::new("orders", 2);
//! let event = Envelope::builder("order", "o-1", 1, "order.confirmed").build().unwrap();
//! // The same event delivered twice (e.g. the relay lost the acknowledgement).
//! log.publish(&[&event]).await;
//! log.publish(&[&event]).await;
//! // A record some other producer wrote without headers: parked, not a stop.
//! log.append_raw("orders", 0, None, vec![], b"??".to_vec()).unwrap();
//!
//! let processor = InboxProcessor::new("stats", MemoryInboxStore::new(&db), Counter);
//! let source = log.consumer("stats", &["orders"]);
//! let mut engine = ConsumerEngine::new(source, processor, EngineConfig::default(), 1).unwrap();
//! let report = engine.run_until_quiet(Duration::from_millis(50)).await.unwrap();
//!
//! // Applied once; the copy is a duplicate; the malformed record is parked and its offset
//! // committed.
//! assert_eq!((report.applied, report.duplicates, report.parked), (1, 1, 1));
//! assert_eq!(db.read("stats", "confirmed"), Some(serde_json::json!(1)));
//! # });
//! ```
//!
//! Generic over [`outbox_core::InboxParking`] (an [`outbox_core::InboxStore`] with the
//! operator's side) and [`outbox_core::MessageSource`]: the in-memory backends of
//! `outbox-testkit`, `outbox-postgres`'s inbox and `outbox-kafka`'s source all fit.
//!
//! ## Capabilities
//!
//! | capability | how |
//! |---|---|
//! | dedupe + effect in one transaction | `InboxStore::register` in the handler's transaction |
//! | re-issued copies | registered by `dedup_id`: copy and original are one event |
//! | order per aggregate | an aggregate in at most one batch at a time; versions tracked per aggregate ([`VersionPolicy`]) |
//! | poison messages | parked durably with the raw record, reason and attempts; the aggregate's later messages wait; other aggregates flow |
//! | operator actions | [`ParkedMessages`]: list, show, retry, discard (with reason), audited; a retry *request* from a process without the handler (`request_retry`), performed by the engine every `retry_requests_interval` (5 s) |
//! | parallelism | `concurrency` transactions at once, `max_batch` messages each, bounded by `max_in_flight` (and `max_in_flight_per_partition`, at most half of it: a partition whose messages fill it is paused alone, and polling, which serves rebalances, goes on; held messages are bounded apart by `max_held`); a parked aggregate holds up nothing else, and a retrying one holds up at most the rest of its own partition once that partition's bound is full (a log is read in order); a slow one (a handler that takes long) also holds up the aggregates that share its batch's transaction (at most `max_batch - 1`, of any partition) and one of the `concurrency` transaction slots |
//! | offsets | contiguous watermark per partition; rewinds detected; tracker shared with the source |
//! | rebalances | revoke commits what is final; commits refused by a rebalance are dropped |
//! | retention | a gap below the earliest offset stops the engine ([`EngineError::RetentionGap`]); [`ConsumerEngine::retention_check`] |
//! | cleanup | [`CleanupSchedule`], bounded batches between transactions |
//! | metrics | [`metrics`]; with feature `prometheus`, [`prometheus::serve`] exports them on `/metrics` in one call |

mod engine;
mod handler;
pub mod metrics;
mod operator;
mod processor;
#[cfg(feature = "prometheus")]
pub mod prometheus;

pub use engine::{CleanupSchedule, ConsumerEngine, EngineConfig, EngineError, EngineReport};
pub use handler::{idempotency_key, BatchHandlerError, Handler, HandlerError};
pub use operator::{OperatorError, ParkedMessages, ReleaseReport};
pub use processor::{InboxProcessor, MessageOutcome, VersionPolicy};
