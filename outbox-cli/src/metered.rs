//! [`MeteredStore`]: any [`OutboxStore`] with its claim and completion durations recorded
//! (`outbox_claim_seconds`, `outbox_complete_seconds`), and the events its claims hold counted
//! for the relay registry's heartbeat.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport, Outcome,
    StoreError,
};
use uuid::Uuid;

/// Events held per open claim (claimed, not yet completed or released), by claim token.
#[derive(Clone, Debug, Default)]
pub struct Held(Arc<Mutex<HashMap<Uuid, u64>>>);

impl Held {
    /// Events held by the open claims.
    pub fn count(&self) -> u64 {
        self.lock().values().sum()
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, u64>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Times claims and completions of the wrapped store, and counts what its claims hold.
#[derive(Clone, Debug)]
pub struct MeteredStore<S> {
    /// The store.
    pub inner: S,
    /// What the claims made through this wrapper hold now.
    pub held: Held,
}

impl<S> MeteredStore<S> {
    /// `inner`, holding nothing yet.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            held: Held::default(),
        }
    }
}

#[async_trait]
impl<S: RelayStore> RelayStore for MeteredStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let started = Instant::now();
        let r = self.inner.claim(request).await;
        metrics::histogram!("outbox_claim_seconds").record(started.elapsed().as_secs_f64());
        if let Ok(batch) = &r {
            if !batch.records.is_empty() {
                self.held
                    .lock()
                    .insert(batch.handle.token, batch.records.len() as u64);
            }
        }
        r
    }
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let started = Instant::now();
        let r = self.inner.complete(claim, outcomes).await;
        metrics::histogram!("outbox_complete_seconds").record(started.elapsed().as_secs_f64());
        // Done with, whatever the answer: a failed completion leaves the rows to the lease's
        // expiry, and the relay does not come back to this claim.
        self.held.lock().remove(&claim.token);
        r
    }
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        let r = self.inner.release(claim).await;
        self.held.lock().remove(&claim.token);
        r
    }
    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

outbox_core::forward_store_roles!(MeteredStore<S>.inner => append, operator, maintenance, reporting);
