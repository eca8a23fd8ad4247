//! The recording wrapper of a run's stores: every claim, completion and release goes through
//! it, and what it saw goes into the history the checker judges.

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport, Outcome,
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
impl<S: RelayStore> RelayStore for Recorded<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let before = Instant::now();
        let batch = self.inner.claim(request).await?;
        let start = Instant::now();
        self.world
            .record_claim(&request.owner, request.run_len(), before, start, &batch);
        Ok(batch)
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let call = Instant::now();
        self.world.end_claim(claim.token, call);
        self.world.note_completion_call(claim.token, outcomes, call);
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

    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }

    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

outbox_core::forward_store_roles!(Recorded<S>.inner => append, operator, maintenance, reporting);
