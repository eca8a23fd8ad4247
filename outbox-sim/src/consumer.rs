//! The consumer side: the real [`outbox_inbox::ConsumerEngine`] over the in-memory log, with
//! the simulation's effect recorded in the same transaction as the user's handler
//! ([`SimHandler`]), and the source wrapped for the consumer-side seeded bugs ([`SimSource`]).

use std::collections::{HashMap, HashSet};
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
///
/// A failure is what the engine sees: a scripted [`HandlerFault`], or an error of the
/// handler itself (the user's handler refusing an event, or the simulation's effect failing),
/// with its class ([`Ledger::handler_failed`]).
///
/// A RabbitMQ channel lost under the running engine starts a generation
/// ([`Ledger::channel_lost`]) while a batch of the engine may still hold an old delivery of
/// an event the channel held: that batch can hand it to the handler once more, and the
/// ledger cannot tell that call from one for the redelivery. The engine keeps an aggregate's
/// calls in order (the redelivery waits behind the running batch), and an old delivery that
/// fails transiently is handed back and dropped (its ticket is stale), so at most one
/// transient failure in the new generation is the old delivery's: such an event may be
/// handed to the handler after `max_attempts` transient failures in that generation, not
/// after more. Whether the engine may park it is judged as for any event (`max_attempts`
/// in the generation), since the old delivery may not have been called at all.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    generation: u64,
    operator: bool,
    /// (generation, event) → (transient failures, permanent failure).
    failures: HashMap<(u64, EventId), (u32, bool)>,
    /// Events that reached the parking threshold in some generation.
    may_park: HashSet<EventId>,
    /// The event a [`HandlerFault::Stuck`] fails on every call, until an operator retries it.
    stuck: Option<EventId>,
    /// (generation, event) → when its last transient failure happened: the engine waits at
    /// least the retry policy's `min_delay` before handing it to the handler again.
    failed_at: HashMap<(u64, EventId), std::time::Instant>,
    /// Events whose old delivery, of a RabbitMQ channel lost in this generation, a running
    /// batch may still hand to the handler: one transient failure more is allowed.
    carried: HashSet<EventId>,
}

impl Ledger {
    /// A new generation: the engine was rebuilt (nothing of the old one runs on).
    pub(crate) fn new_generation(&mut self) {
        self.generation += 1;
        self.carried.clear();
    }

    /// A new generation: (RabbitMQ) the engine's channel was lost under it, a new assignment
    /// whose redeliveries the engine takes as new deliveries, attempts counted from zero (as
    /// a Kafka partition assigned again). `held`: the events the lost channel had delivered
    /// and not acknowledged; each may fail once more in the new generation, for its old
    /// delivery. So may an event whose allowance of the generation ending was not used (no
    /// failure yet): the batch holding its old delivery may still be running.
    pub(crate) fn channel_lost(&mut self, held: impl IntoIterator<Item = EventId>) {
        let ending = self.generation;
        let unused: Vec<EventId> = self
            .carried
            .iter()
            .filter(|e| {
                self.failures
                    .get(&(ending, **e))
                    .is_none_or(|(transient, permanent)| *transient == 0 && !permanent)
            })
            .copied()
            .collect();
        self.generation += 1;
        self.carried = held.into_iter().chain(unused).collect();
    }

    /// Handler calls made by an operator's retry (between `true` and `false`) are not checked.
    pub(crate) fn set_operator(&mut self, on: bool) {
        self.operator = on;
    }

    /// Whether the handler's failures of `event` allowed the engine to park it.
    pub(crate) fn may_park(&self, event: &EventId) -> bool {
        self.may_park.contains(event)
    }

    /// A handler call for `event`, with the fault about to be injected (if any). Returns the
    /// fault to inject, and a violation when the engine should not have made the call. A
    /// scripted fault is counted here; a failure of the handler itself, once it returns
    /// ([`Ledger::handler_failed`]).
    fn call(
        &mut self,
        event: EventId,
        fault: Option<HandlerFault>,
        max: u32,
        min_delay: Duration,
    ) -> (Option<HandlerFault>, Option<String>) {
        if self.operator {
            // An operator's retry: a stuck event is released, the call is not checked. A
            // failure leaves the message parked with the handler's reason: the outcome of the
            // operator's one attempt (`ReleaseReport::still_parked`), not the engine's.
            if self.stuck == Some(event) {
                self.stuck = None;
            }
            let fault = fault.filter(|f| *f != HandlerFault::Stuck);
            if fault.is_some() {
                self.may_park.insert(event);
            }
            return (fault, None);
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
        // One transient failure more for an old delivery of a lost channel (see the type).
        let carried = self.carried.contains(&event);
        let budget = max + u32::from(carried);
        let (transient, permanent) = self
            .failures
            .get(&(gen, event))
            .copied()
            .unwrap_or_default();
        let violation = if let Some(since) = early {
            Some(format!(
                "the engine handed event {event} to the handler again {since:?} after its \
                 transient failure, before the retry policy's min_delay ({min_delay:?}) \
                 (generation {gen})"
            ))
        } else if permanent {
            Some(format!(
                "the engine handed event {event} to the handler again after its permanent \
                 failure (generation {gen}); it must park it"
            ))
        } else if transient >= budget {
            let old = if carried {
                ", one of them possibly its old delivery's, of the channel lost"
            } else {
                ""
            };
            Some(format!(
                "the engine handed event {event} to the handler after {transient} transient \
                 failures (max_attempts {max}{old}, generation {gen}); it must park it"
            ))
        } else {
            None
        };
        if let Some(f @ (HandlerFault::Transient | HandlerFault::Permanent)) = fault {
            self.failed(event, f == HandlerFault::Permanent, max);
        }
        (fault, violation)
    }

    /// The handler itself (not a scripted fault) failed on `event`: the user's handler
    /// refused it, or the simulation's effect failed. The engine counts it as any handler
    /// failure; an operator's retry is not counted, and may leave the message parked.
    fn handler_failed(&mut self, event: EventId, permanent: bool, max: u32) {
        if self.operator {
            // Parked again by the operator's retry (see `call`).
            self.may_park.insert(event);
        } else {
            self.failed(event, permanent, max);
        }
    }

    /// Counts a failure of the engine's call for `event` in the current generation.
    fn failed(&mut self, event: EventId, permanent: bool, max: u32) {
        let gen = self.generation;
        let entry = self.failures.entry((gen, event)).or_insert((0, false));
        if permanent {
            entry.1 = true;
        } else {
            entry.0 += 1;
            self.failed_at
                .insert((gen, event), std::time::Instant::now());
        }
        if entry.1 || entry.0 >= max {
            self.may_park.insert(event);
        }
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
        let result = match self.backend.record_effect(tx, event).await {
            Ok(()) => self.user.handle(tx, event).await,
            Err(e) => Err(e.into()),
        };
        if let Err(e) = &result {
            self.ledger
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .handler_failed(
                    event.event_id,
                    e.class == outbox_core::ErrorClass::Permanent,
                    self.max_attempts,
                );
        }
        result
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

/// The source under the engine, with the consumer-side seeded bugs, and the stalls of the
/// engine's thread ([`crate::Step::EngineThreadStalls`]).
#[derive(Debug)]
pub struct SimSource<S> {
    inner: S,
    bug: Option<SeededBug>,
    stall: Arc<Mutex<Option<Duration>>>,
}

impl<S> SimSource<S> {
    pub(crate) fn new(inner: S, bug: Option<SeededBug>) -> Self {
        Self {
            inner,
            bug,
            stall: Arc::default(),
        }
    }

    /// Its next poll first blocks the thread for the duration set here (once).
    pub(crate) fn with_stall(mut self, stall: Arc<Mutex<Option<Duration>>>) -> Self {
        self.stall = stall;
        self
    }

    /// The source it wraps.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for SimSource<S> {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let stall = self
            .stall
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(d) = stall {
            // The thread itself is held, as a loaded machine holds a process: the timers that
            // run out meanwhile fire together once it runs again.
            std::thread::sleep(d);
        }
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
