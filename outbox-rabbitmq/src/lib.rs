//! # outbox-rabbitmq
//!
//! RabbitMQ adapters for the outbox, on [lapin](https://docs.rs/lapin) (AMQP 0-9-1):
//!
//! * [`RabbitPublisher`]: the relay's [`outbox_core::Publisher`]. Publisher confirms on a
//!   durable exchange, persistent messages, the event id as `message_id`, mandatory routing.
//! * [`RabbitSource`]: the inbox engine's [`outbox_core::MessageSource`], a consumer on a
//!   durable quorum queue with manual acks after the effects' transaction committed and a
//!   bounded prefetch.
//! * [`check_exchange`], [`check_queue`]: the start-up checks (exchange durable and of the
//!   expected type; queue a durable quorum queue that drops no message on its own, with or
//!   without single active consumer). [`describe_queue`] reads a queue's properties over
//!   AMQP and [`judge_queue`] says what is wrong with them and what to run
//!   (`outbox check` reports it for each `[[consumers]]` section).
//!
//! Usable alone: nothing here depends on a store or on another transport.
//!
//! ## Why lapin
//!
//! * **lapin**: the most used AMQP 0-9-1 client in Rust; publisher confirms as one future per
//!   message (awaited together), returned messages, consumer streams, an executor abstraction
//!   that runs on tokio. Chosen.
//! * **amqprs**: tokio-native and lean, but confirms and returns arrive as channel callbacks
//!   the caller must correlate to messages by hand, which is what a per-record result needs
//!   directly.
//!
//! Version 3.7 is the newest whose minimum Rust version fits the workspace's 1.85 (4.x needs
//! 1.88). A lapin behaviour this crate works around: a returned message is attached to
//! whichever confirm completes next, not to its own; [`RabbitPublisher`] matches returns to
//! messages by `message_id`.
//!
//! ## Capabilities
//!
//! | capability | status | how |
//! |---|---|---|
//! | batch sent whole, all confirms awaited | yes | every `basic.publish` written, then every confirm future together |
//! | concurrent batches | one at a time per publisher | returns are matched to messages within a batch (see [`RabbitPublisher`]); relay workers that publish in parallel each need their own publisher (its own connection and channel) |
//! | `Ok` only from a confirm | yes | `basic.ack` for the message and no `basic.return` for it |
//! | acknowledgement metadata | exact | [`AckMetadata::RabbitMq`](outbox_core::AckMetadata::RabbitMq): exchange and routing key; no position (a confirm names none) ([`ack`]) |
//! | unroutable message | clear permanent error | `mandatory`: `basic.return` 312 → `unknown_topic` naming exchange and routing key |
//! | durability | enforced | persistent messages (`delivery_mode = 2`), the exchange checked durable at start, the source's queue checked a durable quorum queue |
//! | headers | [`outbox_core::wire`] | the envelope's headers as AMQP long strings, as on Kafka; `message_id` = event id, `content_type`, `timestamp` |
//! | routing key | aggregate type (or route), or aggregate id | [`RoutingKey`]; see [Ordering](#ordering) |
//! | oversize | refused before sending | over [`RabbitPublisherBuilder::max_message_bytes`] (the broker would close the channel): `record_too_large` |
//! | error classes | typed | [`error`]: lapin error kinds and AMQP reply codes, table-tested |
//! | broker outage | transient, transport-scoped | a lost connection fails the batch's unconfirmed records (`broker_unavailable`, `timeout`) within the delivery timeout + [`REPORT_GRACE`]; the next batch reconnects (`tests/outage.rs`: node stopped and restarted mid-batch) |
//! | consumer acks | manual, after commit, a contiguous watermark ([`AckModel::ContiguousWatermark`](outbox_core::AckModel::ContiguousWatermark)) | [`outbox_core::MessageSource::commit`] = `basic.ack(multiple)` up to the committed offset |
//! | consumer positions | native | ordered by `(queue, 0, delivery tag)`: a channel's tags are a contiguous watermark, a new channel is a new assignment; identified by [`LogPosition::rabbitmq`](outbox_core::LogPosition::rabbitmq): exchange, routing key, redelivered flag, kept with a parked message |
//! | prefetch | bounded | `basic.qos` ([`RabbitSourceBuilder::prefetch`], default 500) |
//! | redelivery after a crash | duplicate, absorbed | the closed channel's unacked deliveries go back to the queue; the inbox deduplicates them |
//!
//! ## Ordering
//!
//! Order is promised per aggregate. What RabbitMQ gives: messages published on one channel
//! reach a queue in publish order, and one queue delivers in order to one consumer (a closed
//! channel's unacked deliveries come back to the next consumer, in their order here: see
//! `a_commit_acks_exactly_up_to_its_offset`; the engine's version policy holds an aggregate
//! whose later version would arrive first). So:
//!
//! * The publisher uses one channel and publishes a batch in order; it never sends an
//!   aggregate's later event after a failed earlier one in the same batch.
//! * One aggregate must reach one queue and one consumer at a time. With
//!   [`RoutingKey::AggregateType`], bind one queue per aggregate type (or per set of types);
//!   to spread one type over several queues, use an `x-consistent-hash` exchange with
//!   [`RoutingKey::AggregateId`] (the id is hashed, so an aggregate always lands in the same
//!   queue). Either way each queue is a **quorum queue with single active consumer**
//!   (`x-single-active-consumer = true`): several consumer processes may attach for
//!   availability, and only one receives at a time. [`RabbitSource`] refuses a queue without
//!   single active consumer unless told it runs as a single process.
//!
//! ## Example
//!
//! ```no_run
//! use outbox_core::{Envelope, Publisher};
//! use outbox_rabbitmq::RabbitPublisher;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // Fails here if the exchange is missing, not durable or of another type.
//! let publisher = RabbitPublisher::builder("amqp://guest:guest@127.0.0.1:5672/%2f", "outbox")
//!     .start()
//!     .await?;
//! let event = Envelope::builder("order", "o-1", 1, "order.created").build()?;
//! let result = publisher.publish(&[&event]).await.remove(0);
//! println!("{result:?}");
//! # Ok(()) }
//! ```

pub mod ack;
mod config;
mod connection;
pub mod error;
mod publisher;
pub mod source;
mod topology;

pub use config::{
    ExchangeKind, RabbitPublisherBuilder, RabbitPublisherConfig, RoutingKey,
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_TIMEOUT, DEFAULT_MAX_MESSAGE_BYTES,
};
pub use publisher::{RabbitPublisher, StartError, REPORT_GRACE};
pub use source::{RabbitSource, RabbitSourceBuilder, RabbitSourceConfig, DEFAULT_PREFETCH};
pub use topology::{
    check_exchange, check_queue, describe_queue, judge_queue, quorum_arguments, ArgValue,
    ExchangeReport, QueueFacts, QueueProblem, QueueReport, QueueSeverity, TopologyError,
};
