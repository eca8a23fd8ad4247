//! The consumer side: the real [`outbox_inbox::ConsumerEngine`] over the in-memory log, with
//! the simulation's effect recorded in the same transaction as the user's handler
//! ([`SimHandler`]), and the source wrapped for the consumer-side seeded bugs ([`SimSource`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, CommitOffset, Envelope, EventId, InboxStore, MessageSource, PartitionLag,
    ReceivedMessage, SourceError,
};
use outbox_inbox::{BatchHandlerError, Handler, HandlerError};

use crate::backend::Backend;
use crate::config::SeededBug;
use crate::invariants::Violations;
use crate::steps::HandlerFault;

/// What the handler was asked to do, per event and generation (a restarted engine
/// starts over: its attempt counts are in memory). Checks the engine's handling of handler
/// failures, which the effects alone do not show:
/// * after a permanent failure, or after `max_attempts` transient ones, the engine parks the
///   event: it never hands it to the handler again in that generation (an operator's retry
///   may, and is not counted);
/// * a message parked because its handler failed had a permanent failure or `max_attempts`
///   transient ones in one generation ([`Ledger::may_park`], checked against the inbox's
///   parked messages).
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    generation: u64,
    operator: bool,
    /// (generation, event) → (transient failures, permanent failure).
    failures: HashMap<(u64, EventId), (u32, bool)>,
    /// Events that reached the parking threshold in some generation.
    may_park: std::collections::HashSet<EventId>,
    /// The event a [`HandlerFault::Stuck`] fails on every call, until an operator retries it.
    stuck: Option<EventId>,
    /// (generation, event) → when its last transient failure happened: the engine waits at
    /// least the retry policy's `min_delay` before handing it to the handler again.
    failed_at: HashMap<(u64, EventId), std::time::Instant>,
}

impl Ledger {
    /// A new generation: the engine was rebuilt, or (RabbitMQ) its channel was lost under it,
    /// a new assignment whose redeliveries the engine takes as new deliveries, attempts
    /// counted from zero (as a Kafka partition assigned again).
    pub(crate) fn new_generation(&mut self) {
        self.generation += 1;
    }

    /// Handler calls made by an operator's retry (between `true` and `false`) are not checked.
    pub(crate) fn set_operator(&mut self, on: bool) {
        self.operator = on;
    }

    /// Whether the handler's failures of `event` allowed the engine to park it.
    pub(crate) fn may_park(&self, event: &EventId) -> bool {
        self.may_park.contains(event)
    }

    /// A handler call for `event`, with the fault about to be injected (if any). Returns a
    /// violation when the engine should not have made the call.
    fn call(
        &mut self,
        event: EventId,
        fault: Option<HandlerFault>,
        max: u32,
        min_delay: Duration,
    ) -> (Option<HandlerFault>, Option<String>) {
        if self.operator {
            // An operator's retry: a stuck event is released, the call is not checked.
            if self.stuck == Some(event) {
                self.stuck = None;
            }
            return (fault.filter(|f| *f != HandlerFault::Stuck), None);
        }
        let fault = match fault {
            Some(HandlerFault::Stuck) => {
                self.stuck = Some(event);
                Some(HandlerFault::Transient)
            }
            None if self.stuck == Some(event) => Some(HandlerFault::Transient),
            other => other,
        };
        let gen = self.generation;
        let now = std::time::Instant::now();
        let early = self
            .failed_at
            .get(&(gen, event))
            .map(|at| now.duration_since(*at))
            .filter(|since| *since < min_delay);
        let entry = self.failures.entry((gen, event)).or_insert((0, false));
        let violation = if let Some(since) = early {
            Some(format!(
                "the engine handed event {event} to the handler again {since:?} after its \
                 transient failure, before the retry policy's min_delay ({min_delay:?}) \
                 (generation {gen})"
            ))
        } else if entry.1 {
            Some(format!(
                "the engine handed event {event} to the handler again after its permanent \
                 failure (generation {gen}); it must park it"
            ))
        } else if entry.0 >= max {
            Some(format!(
                "the engine handed event {event} to the handler after {} transient failures \
                 (max_attempts {max}, generation {gen}); it must park it",
                entry.0
            ))
        } else {
            None
        };
        match fault {
            Some(HandlerFault::Transient) => {
                entry.0 += 1;
                self.failed_at.insert((gen, event), now);
            }
            Some(HandlerFault::Permanent) => entry.1 = true,
            Some(HandlerFault::Stuck) | None => {}
        }
        if entry.1 || entry.0 >= max {
            self.may_park.insert(event);
        }
        (fault, violation)
    }
}

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
    ledger: Arc<Mutex<Ledger>>,
    violations: Violations,
    max_attempts: u32,
    min_delay: Duration,
}

impl<B, H> Clone for SimHandler<B, H> {
    fn clone(&self) -> Self {
        Self {
            backend: self.backend.clone(),
            user: self.user.clone(),
            fault: self.fault.clone(),
            skip_second: self.skip_second,
            ledger: self.ledger.clone(),
            violations: self.violations.clone(),
            max_attempts: self.max_attempts,
            min_delay: self.min_delay,
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
        ledger: Arc<Mutex<Ledger>>,
        violations: Violations,
        retry: &outbox_core::RetryPolicy,
    ) -> Self {
        Self {
            backend,
            user,
            fault,
            skip_second: bug == Some(SeededBug::FallbackSkipsRecord),
            ledger,
            violations,
            max_attempts: retry.max_attempts,
            min_delay: retry.min_delay,
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
        let (fault, violation) = self
            .ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .call(event.event_id, fault, self.max_attempts, self.min_delay);
        if let Some(v) = violation {
            self.violations.push(v);
        }
        match fault {
            Some(HandlerFault::Transient | HandlerFault::Stuck) => {
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

    /// The source it wraps.
    pub fn inner(&self) -> &S {
        &self.inner
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

    async fn ack_ahead(&self, positions: &[outbox_core::LogPosition]) -> Result<(), SourceError> {
        self.inner.ack_ahead(positions).await
    }

    fn ack_model(&self) -> outbox_core::AckModel {
        self.inner.ack_model()
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
