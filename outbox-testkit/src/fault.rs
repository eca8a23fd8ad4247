//! Fault-injecting wrappers around any [`OutboxStore`], [`Publisher`], [`InboxStore`] or
//! [`MessageSource`].
//!
//! A [`FaultInjector`] decides, call by call, whether to inject a [`Fault`]. It is driven by a
//! [`FaultSource`]:
//!
//! * a **script** (one entry per call, then no more faults),
//! * a **countdown** (pass `n` calls, then fault once or forever),
//! * a **seed** (each call faults with given probabilities; the seed is printed on creation,
//!   so a failing test shows it, and [`FaultSource::seeded_from_env`] takes it from the
//!   `OUTBOX_SIM_SEED` environment variable to replay).
//!
//! Faults: [`Fault::Transient`], [`Fault::Permanent`], [`Fault::Latency`], and
//! [`Fault::AckLost`]: the operation *took effect* but its caller gets a transient error (the
//! broker stored the record but the delivery report was lost; the database committed but the
//! connection dropped before the reply).
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use outbox_core::{Envelope, Publisher};
//! use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyPublisher};
//! use outbox_testkit::MemoryLog;
//!
//! let log = MemoryLog::new("orders", 1);
//! let faults = FaultInjector::new(FaultSource::script([None, Some(Fault::AckLost)]));
//! let publisher = FaultyPublisher::new(log.clone(), faults);
//! let a = Envelope::builder("order", "a", 1, "e").build().unwrap();
//! let b = Envelope::builder("order", "b", 1, "e").build().unwrap();
//! let results = publisher.publish(&[&a, &b]).await;
//! assert!(results[0].is_ok());
//! assert!(results[1].is_err());            // the caller sees a timeout...
//! assert_eq!(log.all_records().len(), 2);  // ...but the broker has the record
//! # });
//! ```

use std::collections::{BTreeSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, AggregateKey, AggregateState, AuditEntry, ClaimHandle, ClaimMode, ClaimRequest,
    ClaimedBatch, CleanupReport, CommitOffset, CompletionReport, Envelope, ErrorClass, EventId,
    InboxAuditEntry, InboxParking, InboxStore, MessageSource, NewParkedMessage, OutboxStats,
    Outcome, ParkedChange, ParkedEvent, ParkedFilter, ParkedId, ParkedMessage, ParkedStats,
    Parking, PartitionLag, PublishError, PublishErrorKind, PublishResult, Publisher,
    ReceivedMessage, Registration, SourceError, StoreError, StoreErrorKind, VersionAdvance,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Name of the environment variable holding a seed to replay.
pub const SEED_ENV: &str = "OUTBOX_SIM_SEED";

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The operation does not happen; the caller gets a transient error.
    Transient,
    /// The operation does not happen; the caller gets a permanent error.
    Permanent,
    /// The operation happens after this delay (on tokio's clock).
    Latency(Duration),
    /// The operation happens, but the caller gets a transient error.
    AckLost,
}

/// Probabilities of each fault per call for [`FaultSource::Seeded`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct FaultRates {
    /// Probability of [`Fault::Transient`].
    pub transient: f64,
    /// Probability of [`Fault::Permanent`].
    pub permanent: f64,
    /// Probability of [`Fault::AckLost`].
    pub ack_lost: f64,
    /// Probability of [`Fault::Latency`] (uniform up to `max_latency`).
    pub latency: f64,
    /// Largest injected latency.
    pub max_latency: Duration,
}

impl Default for FaultRates {
    /// 10 % transient, 1 % permanent, 5 % ack lost, no latency.
    fn default() -> Self {
        Self {
            transient: 0.10,
            permanent: 0.01,
            ack_lost: 0.05,
            latency: 0.0,
            max_latency: Duration::ZERO,
        }
    }
}

impl FaultRates {
    /// Sets the transient probability.
    pub fn transient(mut self, p: f64) -> Self {
        self.transient = p;
        self
    }
    /// Sets the permanent probability.
    pub fn permanent(mut self, p: f64) -> Self {
        self.permanent = p;
        self
    }
    /// Sets the ack-lost probability.
    pub fn ack_lost(mut self, p: f64) -> Self {
        self.ack_lost = p;
        self
    }
    /// Sets the latency probability and bound.
    pub fn latency(mut self, p: f64, max: Duration) -> Self {
        self.latency = p;
        self.max_latency = max;
        self
    }
}

/// What drives a [`FaultInjector`].
#[derive(Debug)]
#[non_exhaustive]
pub enum FaultSource {
    /// Never faults.
    None,
    /// One entry per call; after the script ends, no faults.
    Script(VecDeque<Option<Fault>>),
    /// Passes `pass` calls, then injects `fault` once (or on every later call if `repeat`).
    Countdown {
        /// Calls still passing.
        pass: u64,
        /// The fault.
        fault: Fault,
        /// Whether the fault repeats after the countdown.
        repeat: bool,
    },
    /// Random faults from a seeded RNG.
    Seeded {
        /// The seed (printed on creation).
        seed: u64,
        /// The RNG (boxed: it is large).
        rng: Box<StdRng>,
        /// Probabilities.
        rates: FaultRates,
    },
}

impl FaultSource {
    /// A script, one entry per call.
    pub fn script(steps: impl IntoIterator<Item = Option<Fault>>) -> Self {
        Self::Script(steps.into_iter().collect())
    }

    /// Pass `pass` calls, then inject `fault` once.
    pub fn countdown(pass: u64, fault: Fault) -> Self {
        Self::Countdown {
            pass,
            fault,
            repeat: false,
        }
    }

    /// Pass `pass` calls, then inject `fault` on every call.
    pub fn from_call(pass: u64, fault: Fault) -> Self {
        Self::Countdown {
            pass,
            fault,
            repeat: true,
        }
    }

    /// Seeded random faults. Prints the seed to stderr (shown by the test harness when the test
    /// fails).
    pub fn seeded(seed: u64, rates: FaultRates) -> Self {
        eprintln!("fault injection seed = {seed} (replay with {SEED_ENV}={seed})");
        Self::Seeded {
            seed,
            rng: Box::new(StdRng::seed_from_u64(seed)),
            rates,
        }
    }

    /// Seeded random faults with the seed from `OUTBOX_SIM_SEED`, else `default_seed`.
    pub fn seeded_from_env(default_seed: u64, rates: FaultRates) -> Self {
        Self::seeded(seed_from_env(default_seed), rates)
    }

    fn next(&mut self) -> Option<Fault> {
        match self {
            Self::None => None,
            Self::Script(steps) => steps.pop_front().flatten(),
            Self::Countdown {
                pass,
                fault,
                repeat,
            } => {
                if *pass > 0 {
                    *pass -= 1;
                    return None;
                }
                let f = *fault;
                if !*repeat {
                    *self = Self::None;
                }
                Some(f)
            }
            Self::Seeded { rng, rates, .. } => {
                let x: f64 = rng.random();
                let mut edge = rates.transient;
                if x < edge {
                    return Some(Fault::Transient);
                }
                edge += rates.permanent;
                if x < edge {
                    return Some(Fault::Permanent);
                }
                edge += rates.ack_lost;
                if x < edge {
                    return Some(Fault::AckLost);
                }
                edge += rates.latency;
                if x < edge {
                    let max = rates.max_latency.as_micros() as u64;
                    return Some(Fault::Latency(Duration::from_micros(
                        rng.random_range(0..=max),
                    )));
                }
                None
            }
        }
    }
}

/// The seed in `OUTBOX_SIM_SEED` (decimal), else `default`.
pub fn seed_from_env(default: u64) -> u64 {
    std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}

#[derive(Debug)]
struct InjectorState {
    source: FaultSource,
    only: Option<BTreeSet<&'static str>>,
    injected: Vec<(&'static str, Fault)>,
    calls: u64,
}

/// Decides which calls fail. Cloning shares the decisions (one script across wrappers).
#[derive(Clone)]
pub struct FaultInjector {
    state: Arc<Mutex<InjectorState>>,
}

impl fmt::Debug for FaultInjector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.lock();
        f.debug_struct("FaultInjector")
            .field("source", &st.source)
            .field("calls", &st.calls)
            .finish()
    }
}

impl FaultInjector {
    /// An injector over `source`, applying to every operation.
    pub fn new(source: FaultSource) -> Self {
        Self {
            state: Arc::new(Mutex::new(InjectorState {
                source,
                only: None,
                injected: Vec::new(),
                calls: 0,
            })),
        }
    }

    /// Restricts faults to the named operations (method names such as `"claim"`,
    /// `"complete"`, `"publish"`, `"register"`, `"commit"`, `"poll"`); other calls pass and do
    /// not consume the source.
    pub fn only(self, operations: &[&'static str]) -> Self {
        self.lock().only = Some(operations.iter().copied().collect());
        self
    }

    /// Replaces the source (e.g. to stop faults so the system can drain).
    pub fn set_source(&self, source: FaultSource) {
        self.lock().source = source;
    }

    /// Faults injected so far, with the operation.
    pub fn injected(&self) -> Vec<(&'static str, Fault)> {
        self.lock().injected.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InjectorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The decision for one call of `operation`.
    pub fn next(&self, operation: &'static str) -> Option<Fault> {
        let mut st = self.lock();
        if st.only.as_ref().is_some_and(|o| !o.contains(operation)) {
            return None;
        }
        st.calls += 1;
        let f = st.source.next();
        if let Some(f) = f {
            st.injected.push((operation, f));
        }
        f
    }
}

fn store_error(fault: Fault, op: &str) -> StoreError {
    match fault {
        Fault::Permanent => StoreError::new(
            StoreErrorKind::Other,
            format!("injected permanent fault in {op}"),
        ),
        Fault::AckLost => StoreError::new(
            StoreErrorKind::Connection,
            format!("injected: {op} took effect but the connection dropped before the reply"),
        ),
        _ => StoreError::new(
            StoreErrorKind::Connection,
            format!("injected transient fault in {op}"),
        ),
    }
}

/// Runs `op` under the injector's decision for `name`.
macro_rules! faulty {
    ($inj:expr, $name:literal, $call:expr) => {{
        match $inj.next($name) {
            None => $call,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                $call
            }
            Some(f @ (Fault::Transient | Fault::Permanent)) => Err(store_error(f, $name)),
            Some(f) => {
                let _ = $call;
                Err(store_error(f, $name))
            }
        }
    }};
}

/// Called with a claim whose connection an injected fault broke.
pub type ConnectionLost = Arc<dyn Fn(&ClaimHandle) + Send + Sync>;

/// An [`OutboxStore`] whose calls fail as the [`FaultInjector`] decides. `claim_mode` never
/// fails.
///
/// An injected fault on `claim` (lost reply) or `complete` (any fault but latency) stands for
/// a broken connection. With [`on_connection_lost`](Self::on_connection_lost) the wrapper
/// reports the claim concerned, so a `LockedTransaction` backend can roll its transaction back
/// (for [`crate::MemoryOutboxStore`]: `abandon`), as a real database does when the
/// connection drops. Without it, a locked claim hit by a fault stays locked.
#[derive(Clone)]
pub struct FaultyStore<S> {
    inner: S,
    faults: FaultInjector,
    on_lost: Option<ConnectionLost>,
}

impl<S: fmt::Debug> fmt::Debug for FaultyStore<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultyStore")
            .field("inner", &self.inner)
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

impl FaultyStore<crate::MemoryOutboxStore> {
    /// Wraps an in-memory store; a broken connection abandons the claim (see
    /// [`crate::MemoryOutboxStore::abandon`]).
    pub fn memory(inner: crate::MemoryOutboxStore, faults: FaultInjector) -> Self {
        let store = inner.clone();
        Self::new(inner, faults).on_connection_lost(Arc::new(move |h| store.abandon(h)))
    }
}

impl<S> FaultyStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, faults: FaultInjector) -> Self {
        Self {
            inner,
            faults,
            on_lost: None,
        }
    }

    /// Sets the callback for claims whose connection an injected fault broke.
    pub fn on_connection_lost(mut self, f: ConnectionLost) -> Self {
        self.on_lost = Some(f);
        self
    }

    fn connection_lost(&self, claim: &ClaimHandle) {
        if let Some(f) = &self.on_lost {
            f(claim);
        }
    }
    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
    /// The injector.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }
}

#[async_trait]
impl<S: AppendStore> AppendStore for FaultyStore<S> {
    type Tx = S::Tx;

    async fn append(&self, tx: &mut S::Tx, events: &[Envelope]) -> Result<(), StoreError> {
        faulty!(self.faults, "append", self.inner.append(tx, events).await)
    }
}

#[async_trait]
impl<S: RelayStore> RelayStore for FaultyStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        match self.faults.next("claim") {
            None => self.inner.claim(request).await,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                self.inner.claim(request).await
            }
            Some(f @ (Fault::Transient | Fault::Permanent)) => Err(store_error(f, "claim")),
            Some(f) => {
                if let Ok(batch) = self.inner.claim(request).await {
                    self.connection_lost(&batch.handle);
                }
                Err(store_error(f, "claim"))
            }
        }
    }
    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let result = faulty!(
            self.faults,
            "complete",
            self.inner.complete(claim, outcomes).await
        );
        if result.is_err() {
            self.connection_lost(claim);
        }
        result
    }
    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        faulty!(self.faults, "release", self.inner.release(claim).await)
    }
    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

#[async_trait]
impl<S: OperatorStore> OperatorStore for FaultyStore<S> {
    async fn list_parked(&self, limit: usize) -> Result<Vec<ParkedEvent>, StoreError> {
        faulty!(
            self.faults,
            "list_parked",
            self.inner.list_parked(limit).await
        )
    }
    async fn parked_event(&self, event_id: EventId) -> Result<ParkedEvent, StoreError> {
        faulty!(
            self.faults,
            "parked_event",
            self.inner.parked_event(event_id).await
        )
    }
    async fn release_claims_of(&self, owner: &str, actor: &str) -> Result<u64, StoreError> {
        faulty!(
            self.faults,
            "release_claims_of",
            self.inner.release_claims_of(owner, actor).await
        )
    }
    async fn retry_parked(&self, event_id: EventId, actor: &str) -> Result<(), StoreError> {
        faulty!(
            self.faults,
            "retry_parked",
            self.inner.retry_parked(event_id, actor).await
        )
    }
    async fn retry_parked_with_reason(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        faulty!(
            self.faults,
            "retry_parked",
            self.inner
                .retry_parked_with_reason(event_id, actor, reason)
                .await
        )
    }
    async fn discard_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<(), StoreError> {
        faulty!(
            self.faults,
            "discard_parked",
            self.inner.discard_parked(event_id, actor, reason).await
        )
    }
    async fn reissue_parked(
        &self,
        event_id: EventId,
        actor: &str,
        reason: &str,
    ) -> Result<EventId, StoreError> {
        faulty!(
            self.faults,
            "reissue_parked",
            self.inner.reissue_parked(event_id, actor, reason).await
        )
    }
    async fn audit_trail(&self, event_id: Option<EventId>) -> Result<Vec<AuditEntry>, StoreError> {
        faulty!(
            self.faults,
            "audit_trail",
            self.inner.audit_trail(event_id).await
        )
    }
}

#[async_trait]
impl<S: MaintenanceStore> MaintenanceStore for FaultyStore<S> {
    async fn cleanup(
        &self,
        retention: Duration,
        batch_size: usize,
    ) -> Result<CleanupReport, StoreError> {
        faulty!(
            self.faults,
            "cleanup",
            self.inner.cleanup(retention, batch_size).await
        )
    }
    async fn stats(&self) -> Result<OutboxStats, StoreError> {
        faulty!(self.faults, "stats", self.inner.stats().await)
    }
}

// Reads are not fault-injected.
outbox_core::forward_store_roles!(FaultyStore<S>.inner => reporting);

/// An [`InboxStore`] whose calls fail as the [`FaultInjector`] decides. An `AckLost` on
/// `commit` commits and then reports a transient error: the classic "did my transaction
/// commit?" case a consumer must survive.
#[derive(Clone, Debug)]
pub struct FaultyInbox<I> {
    inner: I,
    faults: FaultInjector,
}

impl<I> FaultyInbox<I> {
    /// Wraps `inner`.
    pub fn new(inner: I, faults: FaultInjector) -> Self {
        Self { inner, faults }
    }
    /// The wrapped store.
    pub fn inner(&self) -> &I {
        &self.inner
    }
    /// The injector.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }
}

#[async_trait]
impl<I: InboxStore> InboxStore for FaultyInbox<I> {
    type Tx = I::Tx;

    async fn begin(&self) -> Result<I::Tx, StoreError> {
        faulty!(self.faults, "begin", self.inner.begin().await)
    }
    async fn register(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError> {
        faulty!(
            self.faults,
            "register",
            self.inner.register(tx, consumer, ids).await
        )
    }
    async fn register_for(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        events: &[(outbox_core::EventId, outbox_core::AggregateKey)],
    ) -> Result<Vec<outbox_core::AggregateRegistration>, StoreError> {
        faulty!(
            self.faults,
            "register",
            self.inner.register_for(tx, consumer, events).await
        )
    }
    async fn aggregates(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        aggregates: &[AggregateKey],
    ) -> Result<Vec<AggregateState>, StoreError> {
        faulty!(
            self.faults,
            "aggregates",
            self.inner.aggregates(tx, consumer, aggregates).await
        )
    }
    async fn advance_versions(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError> {
        faulty!(
            self.faults,
            "advance_versions",
            self.inner.advance_versions(tx, consumer, updates).await
        )
    }
    async fn park(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        messages: &[NewParkedMessage],
    ) -> Result<Vec<Parking>, StoreError> {
        faulty!(
            self.faults,
            "park",
            self.inner.park(tx, consumer, messages).await
        )
    }
    async fn commit(&self, tx: I::Tx) -> Result<(), StoreError> {
        match self.faults.next("commit") {
            None => self.inner.commit(tx).await,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                self.inner.commit(tx).await
            }
            Some(f @ (Fault::Transient | Fault::Permanent)) => {
                // The transaction is lost with the error: roll it back.
                let _ = self.inner.rollback(tx).await;
                Err(store_error(f, "commit"))
            }
            Some(f) => {
                self.inner.commit(tx).await?;
                Err(store_error(f, "commit"))
            }
        }
    }
    async fn rollback(&self, tx: I::Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }
    async fn cleanup(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError> {
        faulty!(
            self.faults,
            "cleanup",
            self.inner.cleanup(consumer, retention, batch_size).await
        )
    }
}

/// Operator reads and writes pass through unchanged: faults target the hot path.
#[async_trait]
impl<I: InboxParking> InboxParking for FaultyInbox<I> {
    async fn list_parked(
        &self,
        consumer: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        self.inner.list_parked(consumer, filter).await
    }
    async fn parked_message(
        &self,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        self.inner.parked_message(consumer, id).await
    }
    async fn open_parked_of(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        self.inner.open_parked_of(tx, consumer, aggregate).await
    }
    async fn discarded_of(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        self.inner.discarded_of(tx, consumer, aggregate).await
    }
    async fn parked_in(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        self.inner.parked_in(tx, consumer, id).await
    }
    async fn change_parked(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        id: ParkedId,
        change: &ParkedChange,
    ) -> Result<(), StoreError> {
        self.inner.change_parked(tx, consumer, id, change).await
    }
    async fn unblock(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<(), StoreError> {
        self.inner.unblock(tx, consumer, aggregate).await
    }
    async fn audit(&self, tx: &mut I::Tx, entry: &InboxAuditEntry) -> Result<(), StoreError> {
        self.inner.audit(tx, entry).await
    }
    async fn audit_trail(
        &self,
        consumer: &str,
        id: Option<ParkedId>,
    ) -> Result<Vec<InboxAuditEntry>, StoreError> {
        self.inner.audit_trail(consumer, id).await
    }
    async fn parked_stats(&self, consumer: &str) -> Result<ParkedStats, StoreError> {
        self.inner.parked_stats(consumer).await
    }
    async fn request_retry(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        id: ParkedId,
        request: &outbox_core::RetryRequest,
    ) -> Result<(), StoreError> {
        self.inner.request_retry(tx, consumer, id, request).await
    }
    async fn requested_retries(&self, consumer: &str) -> Result<Vec<ParkedMessage>, StoreError> {
        self.inner.requested_retries(consumer).await
    }
    async fn clear_retry_request(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        id: ParkedId,
        requested_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), StoreError> {
        self.inner
            .clear_retry_request(tx, consumer, id, requested_at)
            .await
    }
}

/// A [`Publisher`] whose records fail as the [`FaultInjector`] decides (one decision per
/// record, operation name `"publish"`). Records without a fault are sent to the inner publisher
/// in one batch, in order; latency delays the whole batch by the largest injected latency.
#[derive(Clone, Debug)]
pub struct FaultyPublisher<P> {
    inner: P,
    faults: FaultInjector,
}

impl<P> FaultyPublisher<P> {
    /// Wraps `inner`.
    pub fn new(inner: P, faults: FaultInjector) -> Self {
        Self { inner, faults }
    }
    /// The wrapped publisher.
    pub fn inner(&self) -> &P {
        &self.inner
    }
    /// The injector.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }
}

#[async_trait]
impl<P: Publisher> Publisher for FaultyPublisher<P> {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let decisions: Vec<Option<Fault>> =
            batch.iter().map(|_| self.faults.next("publish")).collect();
        let delay = decisions
            .iter()
            .filter_map(|d| match d {
                Some(Fault::Latency(l)) => Some(*l),
                _ => None,
            })
            .max();
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let sent: Vec<&Envelope> = batch
            .iter()
            .zip(&decisions)
            .filter(|(_, d)| !matches!(d, Some(Fault::Transient | Fault::Permanent)))
            .map(|(e, _)| *e)
            .collect();
        let mut results = if sent.is_empty() {
            Vec::new()
        } else {
            self.inner.publish(&sent).await
        }
        .into_iter();
        decisions
            .iter()
            .map(|d| match d {
                Some(Fault::Transient) => Err(PublishError::new(
                    PublishErrorKind::BrokerUnavailable,
                    "injected transient broker fault",
                )),
                Some(Fault::Permanent) => Err(PublishError::new(
                    PublishErrorKind::InvalidRecord,
                    "injected permanent broker fault",
                )),
                Some(Fault::AckLost) => {
                    let _ = results.next();
                    Err(PublishError::new(
                        PublishErrorKind::Timeout,
                        "injected: the delivery report was lost",
                    ))
                }
                _ => results.next().unwrap_or_else(|| {
                    Err(PublishError::new(
                        PublishErrorKind::Other,
                        "inner publisher returned too few results",
                    ))
                }),
            })
            .collect()
    }

    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

fn source_error(fault: Fault, op: &str) -> SourceError {
    match fault {
        Fault::Permanent => SourceError::new(
            ErrorClass::Permanent,
            format!("injected permanent fault in {op}"),
        ),
        Fault::AckLost => SourceError::new(
            ErrorClass::Transient,
            format!("injected: {op} took effect but its acknowledgement was lost"),
        ),
        _ => SourceError::new(
            ErrorClass::Transient,
            format!("injected transient fault in {op}"),
        ),
    }
}

/// A [`MessageSource`] whose broker calls fail as the [`FaultInjector`] decides (not to be
/// confused with [`FaultSource`], which drives the injector).
///
/// Operations, as named to the injector (and to [`FaultInjector::only`]):
///
/// * `"poll"`: the decision is taken *before* the inner source is asked, so a failed poll
///   consumes nothing: the message that was due comes with the next poll, nothing is lost or
///   reordered. [`Fault::Transient`] and [`Fault::Permanent`] fail the poll with a
///   [`SourceError`] of that class; [`Fault::AckLost`] acts as [`Fault::Transient`] (a fetch
///   whose response was lost is fetched again from the same position; a source never hands a
///   message out with an error); [`Fault::Latency`] waits, then polls (both cancellation safe,
///   so the poll stays cancellation safe).
/// * `"commit"`: [`Fault::Transient`] and [`Fault::Permanent`] fail without committing (the
///   group's offsets do not move); [`Fault::AckLost`] commits in the inner source, then reports
///   a transient error (the broker stored the offsets, the reply was lost); an error of the
///   inner commit is returned as it is. [`Fault::Latency`] waits, then commits.
/// * `"lag"`: as `"commit"` (a lost reply of a read is only an error).
///
/// [`attach_offsets`](MessageSource::attach_offsets) cannot fail and is always forwarded.
/// Injected errors are of kind [`SourceErrorKind::Other`](outbox_core::SourceErrorKind::Other);
/// errors of the inner source (rebalances, retention gaps) pass through unchanged.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use std::time::Duration;
/// use outbox_core::{ErrorClass, MessageSource};
/// use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultySource};
/// use outbox_testkit::MemoryLog;
///
/// let log = MemoryLog::new("orders", 1);
/// log.append_raw("orders", 0, None, vec![], b"a".to_vec()).unwrap();
/// let faults = FaultInjector::new(FaultSource::script([Some(Fault::Transient), None]));
/// let source = FaultySource::new(log.consumer("g", &["orders"]), faults);
/// let err = source.poll(Duration::ZERO).await.unwrap_err();
/// assert_eq!(err.class, ErrorClass::Transient);
/// // The failed poll consumed nothing: the message that was due comes next.
/// let m = source.poll(Duration::ZERO).await.unwrap().expect("the message");
/// assert_eq!(m.position.offset, 0);
/// # });
/// ```
#[derive(Clone, Debug)]
pub struct FaultySource<S> {
    inner: S,
    faults: FaultInjector,
}

impl<S> FaultySource<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, faults: FaultInjector) -> Self {
        Self { inner, faults }
    }
    /// The wrapped source.
    pub fn inner(&self) -> &S {
        &self.inner
    }
    /// The injector.
    pub fn faults(&self) -> &FaultInjector {
        &self.faults
    }
    /// Unwraps the inner source (e.g. to close it).
    pub fn into_inner(self) -> S {
        self.inner
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for FaultySource<S> {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        match self.faults.next("poll") {
            None => self.inner.poll(timeout).await,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                self.inner.poll(timeout).await
            }
            // Never forwarded, so no message is taken from the inner source.
            Some(f) => Err(source_error(f, "poll")),
        }
    }

    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        match self.faults.next("commit") {
            None => self.inner.commit(offsets).await,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                self.inner.commit(offsets).await
            }
            Some(f @ (Fault::Transient | Fault::Permanent)) => Err(source_error(f, "commit")),
            Some(f) => {
                self.inner.commit(offsets).await?;
                Err(source_error(f, "commit"))
            }
        }
    }

    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        self.inner.attach_offsets(offsets);
    }

    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        match self.faults.next("lag") {
            None => self.inner.lag().await,
            Some(Fault::Latency(d)) => {
                tokio::time::sleep(d).await;
                self.inner.lag().await
            }
            Some(f @ (Fault::Transient | Fault::Permanent)) => Err(source_error(f, "lag")),
            Some(f) => {
                self.inner.lag().await?;
                Err(source_error(f, "lag"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ManualClock, MemoryDb, MemoryInboxStore, MemoryLog, MemoryOutboxStore};
    use outbox_core::{ErrorClass, InboxStoreExt, MessageSource};

    fn ev(agg: &str) -> Envelope {
        Envelope::builder("t", agg, 1, "e")
            .event_id(crate::deterministic_event_id(
                ManualClock::epoch(),
                agg.len() as u64,
            ))
            .build()
            .unwrap()
    }

    #[test]
    fn sources_script_countdown_and_seed() {
        let mut s = FaultSource::script([None, Some(Fault::Transient)]);
        assert_eq!(
            (s.next(), s.next(), s.next()),
            (None, Some(Fault::Transient), None)
        );
        let mut c = FaultSource::countdown(2, Fault::Permanent);
        let got: Vec<_> = (0..4).map(|_| c.next()).collect();
        assert_eq!(got, vec![None, None, Some(Fault::Permanent), None]);
        let mut r = FaultSource::from_call(1, Fault::AckLost);
        let got: Vec<_> = (0..3).map(|_| r.next()).collect();
        assert_eq!(got, vec![None, Some(Fault::AckLost), Some(Fault::AckLost)]);
        let rates = FaultRates::default().latency(0.2, Duration::from_millis(5));
        let run = |seed| {
            let mut s = FaultSource::seeded(seed, rates);
            (0..200).map(|_| s.next()).collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5), "same seed, same faults");
        assert_ne!(run(5), run(6));
        let faults = run(5).into_iter().flatten().count();
        assert!(
            (40..=130).contains(&faults),
            "about 36% faulty, got {faults}/200"
        );
    }

    #[test]
    fn seed_env_parsing_falls_back() {
        // The variable is not set by the test suite; when it is, it wins.
        let expected = std::env::var(SEED_ENV)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(77);
        assert_eq!(seed_from_env(77), expected);
    }

    #[tokio::test]
    async fn faulty_store_transient_and_lost_reply() {
        let db = MemoryDb::default();
        let inner = MemoryOutboxStore::with_lease(&db);
        let faults = FaultInjector::new(FaultSource::script([
            Some(Fault::Transient),
            Some(Fault::AckLost),
        ]))
        .only(&["claim"]);
        let store = FaultyStore::new(inner.clone(), faults.clone());
        let mut tx = db.begin();
        store.append(&mut tx, &[ev("a")]).await.unwrap();
        tx.commit().unwrap();
        let err = store.claim(&ClaimRequest::new("r", 10)).await.unwrap_err();
        assert_eq!(err.class, ErrorClass::Transient);
        assert!(
            inner.snapshot()[0].claim.is_none(),
            "a failed call did nothing"
        );
        assert!(store.claim(&ClaimRequest::new("r", 10)).await.is_err());
        assert!(
            inner.snapshot()[0].claim.is_some(),
            "a lost reply still took effect"
        );
        assert_eq!(faults.injected().len(), 2);
        assert!(store.stats().await.is_ok());
    }

    #[tokio::test]
    async fn faulty_publisher_keeps_order_and_loses_acks() {
        let log = MemoryLog::new("t", 1);
        let faults = FaultInjector::new(FaultSource::script([
            Some(Fault::Transient),
            None,
            Some(Fault::AckLost),
            Some(Fault::Permanent),
            Some(Fault::Latency(Duration::from_millis(1))),
        ]));
        let p = FaultyPublisher::new(log.clone(), faults);
        let batch: Vec<Envelope> = ["a", "bb", "ccc", "dddd", "eeeee"]
            .iter()
            .map(|a| ev(a))
            .collect();
        let r = p.publish(&batch.iter().collect::<Vec<_>>()).await;
        assert_eq!(r.len(), 5);
        assert_eq!(r[0].as_ref().unwrap_err().class, ErrorClass::Transient);
        assert!(r[1].is_ok());
        assert_eq!(r[2].as_ref().unwrap_err().kind, PublishErrorKind::Timeout);
        assert_eq!(r[3].as_ref().unwrap_err().class, ErrorClass::Permanent);
        assert!(r[4].is_ok());
        let stored: Vec<String> = log
            .all_records()
            .iter()
            .map(|r| r.decode().unwrap().aggregate_id)
            .collect();
        assert_eq!(stored, vec!["bb", "ccc", "eeeee"]);
        assert_eq!(p.delivery_timeout(), log.delivery_timeout());
        let c = log.consumer("g", &["t"]);
        assert!(c.poll(Duration::ZERO).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn faulty_inbox_commit_lost_reply_commits() {
        let db = MemoryDb::default();
        let inner = MemoryInboxStore::new(&db);
        let faults = FaultInjector::new(FaultSource::script([
            Some(Fault::AckLost),
            Some(Fault::Transient),
        ]))
        .only(&["commit"]);
        let inbox = FaultyInbox::new(inner.clone(), faults);
        let id = ev("a").event_id;
        let mut tx = inbox.begin().await.unwrap();
        assert_eq!(
            inbox.register_one(&mut tx, "c", id).await.unwrap(),
            Registration::Fresh
        );
        assert!(inbox.commit(tx).await.is_err());
        assert!(inner.is_registered("c", id), "committed despite the error");
        let other = ev("bb").event_id;
        let mut tx = inbox.begin().await.unwrap();
        inbox.register_one(&mut tx, "c", other).await.unwrap();
        assert!(inbox.commit(tx).await.is_err());
        assert!(
            !inner.is_registered("c", other),
            "a failed commit rolled back"
        );
    }
}
