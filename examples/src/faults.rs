//! A publisher wrapper that injects the demo's broker trouble on any transport.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use outbox_core::{
    async_trait, Envelope, PublishError, PublishErrorKind, PublishResult, Publisher,
};

/// Fails the first `fail` records transiently without sending them, then sends the next
/// `lose_ack` records but reports a timeout although the broker stored them (a lost
/// acknowledgement: the relay publishes those events again).
#[derive(Debug)]
pub struct Flaky<P> {
    inner: P,
    fail: AtomicUsize,
    lose_ack: AtomicUsize,
}

impl<P> Flaky<P> {
    /// Wraps `inner`.
    pub fn new(inner: P, fail: usize, lose_ack: usize) -> Self {
        Self {
            inner,
            fail: AtomicUsize::new(fail),
            lose_ack: AtomicUsize::new(lose_ack),
        }
    }
}

fn take(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[async_trait]
impl<P: Publisher> Publisher for Flaky<P> {
    async fn publish(&self, batch: &[Envelope]) -> Vec<PublishResult> {
        let mut results: Vec<Option<PublishResult>> = vec![None; batch.len()];
        let mut send = Vec::new();
        let mut lost = Vec::new();
        for (i, e) in batch.iter().enumerate() {
            if take(&self.fail) {
                results[i] = Some(Err(PublishError::new(
                    PublishErrorKind::BrokerUnavailable,
                    "injected: broker unavailable",
                )));
            } else {
                if take(&self.lose_ack) {
                    lost.push(i);
                }
                send.push((i, e.clone()));
            }
        }
        let envelopes: Vec<Envelope> = send.iter().map(|(_, e)| e.clone()).collect();
        let sent = self.inner.publish(&envelopes).await;
        for ((i, _), r) in send.into_iter().zip(sent) {
            results[i] = Some(if lost.contains(&i) && r.is_ok() {
                Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "injected: acknowledgement lost after the broker stored the record",
                ))
            } else {
                r
            });
        }
        results
            .into_iter()
            .map(|r| r.expect("every record has a result"))
            .collect()
    }

    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}
