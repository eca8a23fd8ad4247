//! # outbox-inbox: the idempotent consumer engine
//!
//! Applies each event's effect **once per consumer** although the relay delivers at least once:
//!
//! 1. Begin a transaction in the consumer's own database.
//! 2. Register `(consumer, event_id)` there ([`outbox_core::InboxStore::register`]). A
//!    [`Registration::Duplicate`](outbox_core::Registration::Duplicate) means the effect was
//!    committed before: roll back, do nothing.
//! 3. Otherwise run the [`Handler`] in the same transaction and commit. If the handler fails (for
//!    example a version check finds fewer rows than expected), the whole transaction rolls back,
//!    registration included: an unapplied event is never marked processed.
//! 4. Only after the commit is the message's offset *final*; the committed offset follows the
//!    contiguous watermark ([`outbox_core::watermark`]) so it never passes an unfinished effect.
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
//! log.publish(&[event.clone()]).await;
//! log.publish(&[event]).await;
//!
//! let processor = InboxProcessor::new("stats", MemoryInboxStore::new(&db), Counter);
//! let source = log.consumer("stats", &["orders"]);
//! let mut engine = ConsumerEngine::new(source, processor, EngineConfig::default(), 1).unwrap();
//! let report = engine.run_until_quiet(Duration::from_millis(50)).await.unwrap();
//!
//! assert_eq!((report.applied, report.duplicates), (1, 1));
//! assert_eq!(db.read("stats", "confirmed"), Some(serde_json::json!(1))); // effect applied once
//! # });
//! ```
//!
//! Generic over [`outbox_core::InboxStore`] and [`outbox_core::MessageSource`]: the in-memory
//! backends of `outbox-testkit`, `outbox-postgres`'s inbox and `outbox-kafka`'s source all fit.
//!
//! Not yet here (tracked separately): parallel handling inside a partition, durable
//! consumer-side parking, per-aggregate version policies. Until then, a message that can never
//! be applied stops the engine with [`EngineError::Unprocessable`] and its offset is never
//! committed, so nothing is skipped silently.

mod engine;
mod handler;

pub use engine::{
    BatchOutcome, ConsumerEngine, EngineConfig, EngineError, EngineReport, InboxProcessor,
    ProcessOutcome,
};
pub use handler::{idempotency_key, Handler, HandlerError};
