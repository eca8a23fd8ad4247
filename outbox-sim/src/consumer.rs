//! The consumer side: the real [`outbox_inbox::ConsumerEngine`] over the in-memory log, with
//! the simulation's effect recorded in the same transaction as the user's handler
//! ([`SimHandler`]), and the source wrapped for the consumer-side seeded bugs ([`SimSource`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, CommitOffset, Envelope, InboxStore, MessageSource, PartitionLag, ReceivedMessage,
    SourceError,
};
use outbox_inbox::{BatchHandlerError, Handler, HandlerError};

use crate::backend::Backend;
use crate::config::SeededBug;
use crate::steps::HandlerFault;

/// The transaction type of backend `B`'s inbox.
pub type InboxTx<B> = <<B as Backend>::Inbox as InboxStore>::Tx;

/// Runs a user's [`Handler`] (the one written for the real inbox transaction) in the
/// simulation: in the engine's transaction, the simulation first records its own effect
/// (counted per event, order-checked per aggregate, so "each effect once" and "in version
/// order" are checked against committed state), then the user's handler runs. A scripted
/// [`HandlerFault`] fails the next event instead.
pub struct SimHandler<B, H> {
    backend: Arc<B>,
    user: Arc<H>,
    fault: Arc<Mutex<Option<HandlerFault>>>,
    skip_second: bool,
}

impl<B, H> Clone for SimHandler<B, H> {
    fn clone(&self) -> Self {
        Self {
            backend: self.backend.clone(),
            user: self.user.clone(),
            fault: self.fault.clone(),
            skip_second: self.skip_second,
        }
    }
}

impl<B, H> std::fmt::Debug for SimHandler<B, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimHandler").finish_non_exhaustive()
    }
}

impl<B, H> SimHandler<B, H> {
    pub(crate) fn new(
        backend: Arc<B>,
        user: Arc<H>,
        fault: Arc<Mutex<Option<HandlerFault>>>,
        bug: Option<SeededBug>,
    ) -> Self {
        Self {
            backend,
            user,
            fault,
            skip_second: bug == Some(SeededBug::FallbackSkipsRecord),
        }
    }
}

#[async_trait]
impl<B, H> Handler<InboxTx<B>> for SimHandler<B, H>
where
    B: Backend,
    H: Handler<InboxTx<B>> + 'static,
{
    async fn handle(&self, tx: &mut InboxTx<B>, event: &Envelope) -> Result<(), HandlerError> {
        let fault = self
            .fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match fault {
            Some(HandlerFault::Transient) => {
                return Err(HandlerError::transient("scripted transient handler fault"))
            }
            Some(HandlerFault::Permanent) => {
                return Err(HandlerError::permanent("scripted permanent handler fault"))
            }
            None => {}
        }
        self.backend.record_effect(tx, event).await?;
        self.user.handle(tx, event).await
    }

    async fn handle_batch(
        &self,
        tx: &mut InboxTx<B>,
        events: &[&Envelope],
    ) -> Result<(), BatchHandlerError> {
        for (index, event) in events.iter().enumerate() {
            if self.skip_second && index == 1 {
                continue; // the seeded bug: the fallback loses a record
            }
            self.handle(tx, event)
                .await
                .map_err(|error| BatchHandlerError { index, error })?;
        }
        Ok(())
    }
}

/// The source under the engine, with the consumer-side seeded bugs.
#[derive(Debug)]
pub struct SimSource<S> {
    inner: S,
    bug: Option<SeededBug>,
}

impl<S> SimSource<S> {
    pub(crate) fn new(inner: S, bug: Option<SeededBug>) -> Self {
        Self { inner, bug }
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for SimSource<S> {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let msg = self.inner.poll(timeout).await?;
        if let (Some(m), Some(SeededBug::CommitOffsetBeforeTx)) = (&msg, self.bug) {
            self.inner.commit(&[m.position.next()]).await?;
        }
        Ok(msg)
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        if self.bug == Some(SeededBug::WatermarkPastUnfinished) {
            let past: Vec<CommitOffset> = offsets
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    c.next_offset += 1;
                    c
                })
                .collect();
            return self.inner.commit(&past).await;
        }
        self.inner.commit(offsets).await
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        self.inner.attach_offsets(offsets);
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        self.inner.lag().await
    }
}

/// A handler with no effect of its own (the simulation records its effect anyway).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEffect;

#[async_trait]
impl<Tx: Send + 'static> Handler<Tx> for NoEffect {
    async fn handle(&self, _tx: &mut Tx, _event: &Envelope) -> Result<(), HandlerError> {
        Ok(())
    }
}
