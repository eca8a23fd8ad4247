//! # outbox-core
//!
//! The domain types, traits and state machines of a transactional outbox and inbox, free of I/O
//! crates: no tokio, sqlx or rdkafka in the normal dependency tree (a `tokio` feature adds the
//! relay's driver loop). Time ([`Clock`]) and randomness (any [`rand::RngCore`]) are injected.
//!
//! The contract is **at-least-once delivery plus idempotent effect**, with order per
//! aggregate. Nothing here claims exactly-once.
//!
//! * [`Envelope`]: the event as consumers see it, validated at append time.
//! * [`OutboxStore`] (the umbrella of the store roles [`AppendStore`], [`RelayStore`],
//!   [`OperatorStore`], [`MaintenanceStore`]; and the read-only [`ReportingStore`]),
//!   [`Publisher`], [`InboxStore`], [`MessageSource`]: the traits adapters
//!   implement, each with its contract in MUST/SHOULD terms.
//! * [`RetryPolicy`]: transient/permanent classification, exponential backoff with full jitter,
//!   parking after the attempt limit.
//! * [`Relay`]: claim, publish concurrently, record outcomes; steps exposed for simulation.
//! * [`watermark`]: contiguous offset commits for consumers, with rewind detection.
//! * [`retention`]: the check that the inbox's dedup window covers what the broker can
//!   redeliver.
//! * [`wire`]: the one mapping of an envelope onto record headers.
//! * [`backpressure`]: refuse non-critical appends above backlog thresholds, for any store.
//!
//! ```
//! use outbox_core::{Envelope, ErrorClass, PublishError, PublishErrorKind, Classify};
//!
//! let event = Envelope::builder("order", "o-7", 1, "order.created")
//!     .json(&serde_json::json!({"items": 3}))?
//!     .build()?;
//! assert_eq!(event.aggregate_id, "o-7");
//!
//! let err = PublishError::new(PublishErrorKind::RecordTooLarge, "1.2 MB > 1 MB");
//! assert_eq!(err.class(), ErrorClass::Permanent); // parked, never retried in a loop
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The in-memory backends that run this without any service live in `outbox-testkit`.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backpressure;
pub mod circuit;
pub mod clock;
pub mod delivery;
pub mod envelope;
pub mod error;
pub mod inbox;
pub mod publisher;
pub mod relay;
pub mod retention;
pub mod retry;
pub mod store;
pub mod telemetry;
pub mod watermark;
pub mod wire;

#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub mod driver;

pub use async_trait::async_trait;
pub use clock::{Clock, SystemClock};
pub use delivery::{
    AckColumnsError, AckMetadata, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch,
    ClaimedRecord, CleanupReport, CompletionReport, DeliveryStatus, LastError, OperatorAction,
    OutboxStats, Outcome, ParkKind, ParkReason, ParkedAtClaim, ParkedEvent, StoredPosition,
    TransportKind, MAX_LEASE, MAX_RUN,
};
pub use envelope::{
    Envelope, EnvelopeBuilder, EnvelopeLimits, EventId, Payload, PayloadError, ValidationError,
    CONTENT_TYPE_JSON, CREATED_AT_YEARS, MAX_AGGREGATE_NAME_BYTES,
};
pub use error::{
    Classify, ConfigError, ErrorClass, FailureScope, PublishError, PublishErrorKind, SourceError,
    SourceErrorKind, StoreError, StoreErrorKind,
};
pub use inbox::{
    AckModel, AggregateKey, AggregateRegistration, AggregateState, CommitOffset, InboxAction,
    InboxAuditEntry, InboxParking, InboxStore, InboxStoreExt, LogPosition, MessageSource,
    NativeColumns, NativeColumnsError, NativePosition, NewParkedMessage, ParkAs, ParkedChange,
    ParkedFilter, ParkedId, ParkedMessage, ParkedRecord, ParkedStats, ParkedStatus, Parking,
    PartitionLag, ReceivedMessage, RecordHeader, Registration, RetryRequest, TopicPartition,
    VersionAdvance,
};
pub use publisher::{PublishResult, Publisher};
pub use relay::{
    CycleReport, Relay, RelayConfig, RelayConfigBuilder, ShutdownSignal, DEFAULT_RUN_BUDGET,
    MIN_LEASE_MARGIN, RUN_BUDGET_RANGE,
};
pub use retry::{IdleBackoff, RetryPolicy, RetryPolicyBuilder};
pub use store::{
    AppendStore, IntervalCount, LatencySummary, MaintenanceStore, OperatorStore, OutboxStore,
    PublishedFilter, PublishedId, PublishedPosition, PublishedRow, RelayEntry, RelayRegistration,
    RelayRegistry, RelayState, RelayStore, ReportingStore, WindowFlow,
};

/// The store role traits, to bring their methods into scope: `use outbox_core::prelude::*;`.
pub mod prelude {
    pub use crate::store::prelude::*;
}
pub use wire::DecodeError;
