//! # outbox-nats
//!
//! NATS JetStream adapters for the outbox, on [async-nats](https://docs.rs/async-nats).
//!
//! (crate docs: see docs.md)

mod ack;
mod config;
pub mod error;
mod publisher;
mod source;
mod streams;
pub mod subject;

pub use config::{
    NatsPublisherBuilder, NatsPublisherConfig, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_TIMEOUT,
    DEFAULT_MAX_IN_FLIGHT,
};
pub use publisher::{NatsPublisher, StartError, REPORT_GRACE};
pub use source::{
    NatsSource, NatsSourceBuilder, NatsSourceConfig, StartFrom, DEFAULT_ACK_WAIT,
    DEFAULT_MAX_ACK_PENDING, DEFAULT_PULL_BATCH,
};
pub use streams::{
    check_streams, Retention, Storage, StreamCheckError, StreamInfo, StreamReport, StreamWarning,
};
pub use subject::SubjectMapping;
