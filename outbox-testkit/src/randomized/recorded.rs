//! The recording wrapper of a run's stores: every claim, completion and release goes through
//! it, and what it saw goes into the history the checker judges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{
    async_trait, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CleanupReport,
    CompletionReport, Envelope, EventId, OutboxStats, OutboxStore, Outcome, ParkedEvent,
    StoreError,
};

use super::history::{Window, World};

// The store wrapper: records claims, completions and releases

#[derive(Clone)]
pub(crate) struct Recorded<S> {
    pub(crate) inner: S,
    pub(crate) world: Arc<World>,
}

#[async_trait]
impl<S: OutboxStore> OutboxStore for Recorded<S> {
    type Tx = S::Tx;

    async fn append(&self, tx: &mut S::Tx, events: &[Envelope]) -> Result<(), StoreError> {
        OutboxStore::append(&self.inner, tx, events).await
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let before = Instant::now();
        let batch = self.inner.claim(request).await?;
        let start = Instant::now();
        self.world
            .record_claim(&request.owner, before, start, &batch);
        Ok(batch)
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let call = Instant::now();
        self.world.end_claim(claim.token, call);
        let res = self.inner.complete(claim, outcomes).await;
        if let Ok(rep) = &res {
            let w = Window {
                call,
                ret: Instant::now(),
            };
            self.world.record_completion(claim.token, outcomes, rep, w);
        } else {
            // Nothing applied; a locked claim's transaction is gone with its parks.
            self.world.drop_provisional_parks(claim.token);
        }
        res
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        self.world.end_claim(claim.token, Instant::now());
        self.world.drop_provisional_parks(claim.token);
        self.world.claims.lock().unwrap().releases += 1;
        self.inner.release(claim).await
    }

    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        self.inner.list_parked(limit).await
    }

    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        self.inner.parked_event(event_id).await
    }

    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        self.inner.retry_parked(event_id, actor).await
    }

    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.inner.discard_parked(event_id, actor, reason).await
    }

    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        self.inner.reissue_parked(event_id, actor, reason).await
    }

    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        self.inner.audit_trail(event_id).await
    }

    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        self.inner.cleanup(retention, batch_size).await
    }

    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        self.inner.stats().await
    }

    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        self.inner.release_claims_of(owner, actor).await
    }

    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }

    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}
