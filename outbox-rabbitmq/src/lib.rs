//! # outbox-rabbitmq
//!
//! RabbitMQ adapters for the outbox, on [lapin](https://docs.rs/lapin) (AMQP 0-9-1).
//!
//! (crate docs: see below)

mod ack;
mod config;
mod connection;
pub mod error;
mod publisher;
mod source;
mod topology;

pub use config::{
    ExchangeKind, RabbitPublisherBuilder, RabbitPublisherConfig, RoutingKey,
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_TIMEOUT, DEFAULT_MAX_MESSAGE_BYTES,
};
pub use publisher::{RabbitPublisher, StartError, REPORT_GRACE};
pub use source::{RabbitSource, RabbitSourceBuilder, RabbitSourceConfig, DEFAULT_PREFETCH};
pub use topology::{
    check_exchange, check_queue, quorum_arguments, ExchangeReport, QueueReport, TopologyError,
};
