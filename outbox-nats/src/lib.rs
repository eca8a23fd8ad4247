//! # outbox-nats
//!
//! NATS JetStream adapters for the outbox, on [async-nats](https://docs.rs/async-nats):
//!
//! * [`NatsPublisher`]: the relay's [`outbox_core::Publisher`]. A record counts as published
//!   only from its JetStream `PubAck`; the event id travels as `Nats-Msg-Id`, so the stream's
//!   duplicate window drops the relay's re-sends.
//! * [`NatsSource`]: the inbox engine's [`outbox_core::MessageSource`], a durable pull
//!   consumer with explicit acks sent only after the effects' transaction committed.
//! * [`check_streams`]: the start-up check (a stream captures every outbox subject; its
//!   duplicate window, storage, replicas and retention, with [`StreamWarning`]s).
//!
//! Usable alone: nothing here depends on a store or on another transport.
//!
//! ## Why async-nats
//!
//! * **async-nats** (nats.rs, the NATS maintainers' client): tokio-native, JetStream publish
//!   with `PubAck` futures that can be awaited together, pull consumers, double acks. Chosen.
//! * **nats** (the older synchronous crate in the same repository): deprecated by its
//!   maintainers in favour of async-nats; blocking I/O would need a thread per batch.
//!
//! Version 0.46 is the newest whose minimum Rust version (1.79) fits the workspace's 1.85;
//! the server-2.10+ features are off, so nothing here needs more than nats-server 2.9.
//!
//! ## Capabilities
//!
//! | capability | status | how |
//! |---|---|---|
//! | batch sent whole, all acks awaited | yes | every message handed to the connection (each its own request), then every `PubAck` future together |
//! | `Ok` only from an acknowledgement | yes | a `PubAck` without error; a duplicate `PubAck` (re-send inside the window) is an acknowledgement of the stored copy |
//! | acknowledgement metadata | exact | [`AckMetadata::JetStream`](outbox_core::AckMetadata::JetStream): stream, stream sequence, subject and the `PubAck`'s duplicate flag ([`ack`]) |
//! | duplicate suppression | `Nats-Msg-Id` = event id | the stream's duplicate window; [`StreamWarning::DuplicateWindowShorterThanLease`] when shorter than [`NatsPublisherBuilder::relay_lease`] |
//! | subjects | per aggregate type or route | see [Subjects](#subjects); [`SubjectMapping::AggregateTypeAndId`] adds the id |
//! | ordering | per aggregate | one connection keeps publish order; one stream is one ordered log; a failed send holds back the aggregate's later events in the batch |
//! | headers | [`outbox_core::wire`] | the envelope's headers as NATS headers (text); `Nats-Msg-Id` added |
//! | oversize | refused before sending | over the server's `max_payload` (the server would close the connection): `record_too_large`; over the stream's `max_msg_size`: the server's `10054`, same kind |
//! | error classes | typed | [`error`]: async-nats error kinds and JetStream API codes, table-tested |
//! | missing stream | error at start, confirmed at run time | [`NatsPublisherBuilder::start`]; "no responders" is `unknown_topic` only when the JetStream API confirms no stream captures the subject, else `broker_unavailable` |
//! | server outage | transient, transport-scoped | the client reconnects in the background; records of a batch fail as `timeout`/`broker_unavailable` within [`delivery_timeout`](outbox_core::Publisher::delivery_timeout) + [`REPORT_GRACE`] (`tests/outage.rs`: server killed and restarted mid-batch) |
//! | consumer acks | explicit, after commit, per message ([`AckModel::PerMessage`](outbox_core::AckModel::PerMessage)) | [`outbox_core::MessageSource::commit`] acks (confirmed `+ACK`) every delivery below the committed offset |
//! | consumer positions | native | ordered by `(stream, 0, delivery sequence)` (see [`NatsSource`] for why not the stream sequence); identified by [`LogPosition::jetstream`](outbox_core::LogPosition::jetstream): stream sequence and durable consumer, kept with a parked message |
//! | redelivery | handled | a message still in flight here is not handed out twice; an older one redelivered after later ones is held behind by the engine's version policy (`Hold` with `require_first_version`) |
//! | retention gap | not detected | JetStream skips deleted messages silently |
//!
//! ## Subjects
//!
//! An event of aggregate type `T` goes to `<prefix>.T` (or to the subject
//! [`NatsPublisherBuilder::route_aggregate`] names for `T`), with its aggregate id appended
//! as `.<id>` under [`SubjectMapping::AggregateTypeAndId`]. Routes are by aggregate type,
//! never by event type, so one aggregate's events stay in one subject space and one stream.
//! The start-up check requires one stream to capture `<prefix>.>` and each route. See
//! [`subject`] for the token rules.
//!
//! ## Example
//!
//! ```no_run
//! use std::time::Duration;
//! use outbox_core::{Envelope, Publisher};
//! use outbox_nats::NatsPublisher;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Fails here if no stream captures `outbox.>` (permanent) or the server is away
//! // (transient), instead of at the first publish.
//! let publisher = NatsPublisher::builder("nats://127.0.0.1:4222", "outbox")
//!     .relay_lease(Duration::from_secs(30))
//!     .start()
//!     .await?;
//! for w in &publisher.stream_report().expect("checked at start").warnings {
//!     eprintln!("warning: {w}");
//! }
//! let event = Envelope::builder("order", "o-1", 1, "order.created").build()?;
//! let ack = publisher.publish(&[&event]).await.remove(0)?;
//! println!("stored at {ack}"); // e.g. ORDERS#41
//! # Ok(()) }
//! ```

pub mod ack;
mod config;
pub mod error;
mod lease;
mod publisher;
pub mod source;
mod streams;
pub mod subject;

pub use config::{
    NatsPublisherBuilder, NatsPublisherConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_TIMEOUT,
    DEFAULT_MAX_IN_FLIGHT,
};
pub use publisher::{NatsPublisher, StartError, REPORT_GRACE};
pub use source::{
    NatsSource, NatsSourceBuilder, NatsSourceConfig, StartFrom, DEFAULT_ACK_WAIT,
    DEFAULT_LEASE_TTL, DEFAULT_MAX_ACK_PENDING, DEFAULT_PULL_BATCH, MIN_LEASE_TTL,
};
pub use streams::{
    check_streams, Retention, Storage, StreamCheckError, StreamInfo, StreamReport, StreamWarning,
};
pub use subject::SubjectMapping;
