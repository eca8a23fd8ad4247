//! [`MeteredStore`]: any [`OutboxStore`] with its claim and completion durations recorded
//! (`outbox_claim_seconds`, `outbox_complete_seconds`).

use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport, Outcome,
    StoreError,
};

/// Times claims and completions of the wrapped store.
#[derive(Clone, Debug)]
pub struct MeteredStore<S>(pub S);

#[async_trait]
impl<S: RelayStore> RelayStore for MeteredStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let started = Instant::now();
        let r = self.0.claim(request).await;
        metrics::histogram!("outbox_claim_seconds").record(started.elapsed().as_secs_f64());
        r
    }
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let started = Instant::now();
        let r = self.0.complete(claim, outcomes).await;
        metrics::histogram!("outbox_complete_seconds").record(started.elapsed().as_secs_f64());
        r
    }
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.0.release(claim).await
    }
    fn claim_mode(&self) -> ClaimMode {
        self.0.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.0.locked_claim_timeout()
    }
}

outbox_core::forward_store_roles!(MeteredStore<S>.0 => append, operator, maintenance, reporting);
