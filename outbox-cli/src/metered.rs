//! [`MeteredStore`]: any [`OutboxStore`] with its claim and completion durations recorded
//! (`outbox_claim_seconds`, `outbox_complete_seconds`).

use std::time::{Duration, Instant};

use outbox_core::{
    async_trait, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, Envelope, EventId, OutboxStats, OutboxStore, Outcome, ParkedEvent,
    StoreError,
};

/// Times claims and completions of the wrapped store.
#[derive(Clone, Debug)]
pub struct MeteredStore<S>(pub S);

#[async_trait]
impl<S: OutboxStore> OutboxStore for MeteredStore<S> {
    type Tx = S::Tx;

    async fn append(&self, tx: &mut Self::Tx, events: &[Envelope]) -> Result<(), StoreError> {
        self.0.append(tx, events).await
    }
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
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        self.0.list_parked(limit).await
    }
    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        self.0.parked_event(event_id).await
    }
    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        self.0.retry_parked(event_id, actor).await
    }
    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.0.discard_parked(event_id, actor, reason).await
    }
    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        self.0.reissue_parked(event_id, actor, reason).await
    }
    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        self.0.audit_trail(event_id).await
    }
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        self.0.cleanup(retention, batch_size).await
    }
    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        self.0.stats().await
    }
    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        self.0.release_claims_of(owner, actor).await
    }
    fn claim_mode(&self) -> ClaimMode {
        self.0.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.0.locked_claim_timeout()
    }
}
