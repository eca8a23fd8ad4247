//! The [`Publisher`] trait: the transport side of the relay.

use std::time::Duration;

use async_trait::async_trait;

use crate::delivery::AckMetadata;
use crate::envelope::Envelope;
use crate::error::PublishError;

/// The result of publishing one event.
pub type PublishResult = Result<AckMetadata, PublishError>;

/// Publishes batches of events to a broker.
///
/// Implementations: `outbox_kafka::KafkaPublisher`, `outbox_testkit::MemoryLog`.
///
/// # Contract
///
/// * [`publish`](Self::publish) MUST return exactly one result per input event, in input order.
/// * A result MUST be `Ok` only after the broker acknowledged that record (delivery report), not
///   when a client library buffered it.
/// * The batch SHOULD be sent concurrently: all records enqueued, then all acknowledgements
///   awaited; never one round trip per record.
/// * The key of each record MUST be the event's `aggregate_id`, so one aggregate stays in one
///   partition, and records of one key MUST stay in order under the transport's own retries.
/// * Every error MUST carry its class ([`crate::ErrorClass`]).
/// * `publish` SHOULD return within [`delivery_timeout`](Self::delivery_timeout) plus a small
///   margin; the relay relies on this to keep publications inside their lease.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// Publishes `batch` and returns one result per event, in order.
    ///
    /// The events are borrowed where they lie (the relay lends the records of its claimed
    /// batch, so nothing is copied between the claim and the transport); a caller holding a
    /// `Vec<Envelope>` passes `&events.iter().collect::<Vec<_>>()`.
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult>;

    /// Upper bound on the time from send to a final delivery report.
    fn delivery_timeout(&self) -> Duration;
}

#[async_trait]
impl<P: Publisher + ?Sized> Publisher for std::sync::Arc<P> {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        (**self).publish(batch).await
    }
    fn delivery_timeout(&self) -> Duration {
        (**self).delivery_timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::PublishErrorKind;

    /// Acknowledges even aggregate versions at offset = version, fails odd ones.
    struct Parity;

    #[async_trait]
    impl Publisher for Parity {
        async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
            batch
                .iter()
                .map(|e| {
                    if e.aggregate_version % 2 == 0 {
                        Ok(AckMetadata::kafka("t", 0, e.aggregate_version))
                    } else {
                        Err(PublishError::new(PublishErrorKind::Timeout, "odd"))
                    }
                })
                .collect()
        }
        fn delivery_timeout(&self) -> Duration {
            Duration::from_secs(7)
        }
    }

    #[test]
    fn a_shared_publisher_is_the_publisher_it_shares() {
        let shared = std::sync::Arc::new(Parity);
        let batch: Vec<Envelope> = (1..=3)
            .map(|v| Envelope::builder("o", "o-1", v, "t").build().unwrap())
            .collect();
        let results =
            futures::executor::block_on(shared.publish(&batch.iter().collect::<Vec<_>>()));
        assert_eq!(results.len(), 3);
        assert!(results[0].is_err() && results[2].is_err());
        assert_eq!(results[1].as_ref().unwrap().position().unwrap().offset, 2);
        assert_eq!(shared.delivery_timeout(), Duration::from_secs(7));
    }
}
