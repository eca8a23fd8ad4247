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
    ConsumerEngine, EngineConfig, EngineError, EngineReport, InboxProcessor, ProcessOutcome,
};
pub use handler::{idempotency_key, Handler, HandlerError};
