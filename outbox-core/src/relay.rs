//! The relay: claim a bounded batch, publish it concurrently, record one outcome per event.
//!
//! The relay is a state machine whose steps are public ([`Relay::claim`], [`Relay::publish`],
//! [`Relay::decide`], [`Relay::complete`]) for callers that drive a cycle themselves.
//! [`Relay::run_once`] chains them for one cycle (the simulation in `outbox-sim` drives it
//! through a scripted publisher and crashes it between any two effects); the tokio driver (feature `tokio`) loops over
//! cycles with jittered idle backoff, a wake-up hook and graceful shutdown.
//!
//! # Prefetch
//!
//! When a batch comes back full (more work is likely waiting), [`Relay::run_once`] claims the
//! next batch while it publishes and completes the current one, so the store's claim cost
//! overlaps the broker round trip and the completion ([`RelayConfigBuilder::prefetch`], on by
//! default). Order is unaffected: the aggregates of a batch in flight are still claimed (under a
//! live lease or a held lock), so the next batch cannot hold any of them. The prefetched batch
//! is published by the next cycle, or released on shutdown ([`Relay::release_prefetched`]);
//! a crash leaves it to lease expiry or to the rollback of its transaction, like any claim.
//!
//! A batch that was not full (a relay keeping up with its appends) gets the same overlap one
//! step later ([`RelayConfigBuilder::early_claim`], on by default since it took a fifth off the
//! latency's p99 to p99.9 at no cost to p50 or throughput; BENCHMARKS.md, stop 41): the next
//! claim starts as soon as the batch's publish call returns, while its completion is written,
//! so events committed during that cycle are claimed then and published by the next cycle
//! without waiting for the completion and a fresh claim. Claiming at the start of the cycle
//! instead would only catch what committed before it. The claim may come back empty (nothing
//! new); the next cycle then claims as before. A claim started this way lives no longer than
//! a full batch's prefetch (the rest of this completion, then its own publication).
//!
//! ## What the early claim guarantees, and what it was tested against
//!
//! The early claim is an ordinary claim of the same owner, made while the batch in flight is
//! still claimed (its lease live, or its transaction holding the aggregates' locks) and being
//! completed, on another connection. So:
//!
//! * it never holds an event of the batch in flight, nor a later version of one of its
//!   aggregates unless that batch's completion committed first (the store hands out only an
//!   aggregate's next version, `last + 1`, and never an aggregate under a live claim);
//! * when the completion fails (a store error, before reaching the store or with its answer
//!   lost), [`Relay::run_once`] returns the error and keeps the early claim for the next cycle
//!   ([`Relay::prefetched`]); the failed batch comes back when its lease expires or its
//!   transaction ends, and is published again: a duplicate, never a reordering or a park;
//! * a relay that dies between the early claim and the completion leaves both claims to lease
//!   expiry or to the end of their transactions, like any claim; the driver (`driver::run`,
//!   feature `tokio`) releases an outstanding early claim when it stops, at once; a
//!   relay that is dropped without it leaves the claim to expire;
//! * an early claim whose lease no longer covers a publication when its cycle comes (a
//!   completion slower than expected) is released, not published, and that release cannot end
//!   the claim of a relay that took the aggregates over;
//! * like any claim, it is ended by `outbox release` (`release_claims_of`), which is only for a
//!   relay that is gone.
//!
//! In locked-transaction mode a relay holds up to two claims, so two connections, as with
//! prefetch. Tested on PostgreSQL and MariaDB, in both claim modes, by the scenarios of
//! `outbox_testkit::scenarios::early_claim` (`tests/adversary_early_claim.rs` of
//! outbox-postgres and outbox-mysql): two relays racing early claims against completions while
//! producers commit (no deadlock, no claim blocked behind its relay's own completion, every
//! event once and in order), a failed and a lost completion, a crash between the two, a
//! shutdown, and a lease that runs out while the completion is written.
//!
//! # Runs: one hot aggregate without a claim per version
//!
//! A relay asks its claims for runs of up to [`RelayConfig::run`] consecutive versions per
//! aggregate ([`ClaimRequest::run`]; the store's contract: `outbox_core::store`, *Runs*). A
//! store that supports them hands out after an aggregate's head the next versions under the
//! same claim, adjacent in the batch ([`crate::ClaimedRecord::run_position`]); one that does
//! not hands out heads only, and nothing below changes. [`Relay::publish`] sends the batch in
//! *waves*:
//!
//! * wave 0: every head (every record with `run_position` 0), in one publish call, as a batch
//!   without runs is sent;
//! * wave `j`: the `j`-th event of each run whose event `j - 1` came back `Ok`, in one call
//!   for all runs. A run stops at its first failure (retry, park, defer, a transport failure):
//!   the rest of it is not sent and gets no outcome, so the completion releases it unchanged
//!   (no attempt counted) and its first unsent event is its aggregate's head again;
//! * before each wave after the first, the claim must still cover one more publication
//!   (delivery timeout plus [`RelayConfig::lease_margin`]: the lease's remaining time, or in
//!   locked-transaction mode the store's hold limit counted from before the claim), as before
//!   a batch; otherwise, or when shutdown was requested, or once the waves' time budget is
//!   spent (*The waves' bound* below), every run stops there. So a run never outlives its
//!   claim, whatever its length.
//!
//! Version N+1 of an aggregate is thus sent only after N's acknowledgement came back to the
//! relay that holds both, and the store's prefix rule (a `Published` outcome whose predecessor
//! is not published is refused) keeps `last` from passing an unpublished version whatever a
//! relay records. The relay checks the layout it is given (a record whose `run_position` does
//! not follow the record before it, of the same aggregate, is never sent) but trusts the
//! store for the versions, as it does for heads. A crash mid-run leaves the acknowledged but
//! uncompleted prefix to be sent again by the next claim: duplicates, as for any batch.
//!
//! ## The waves' bound
//!
//! A cycle's completion and the next claim wait for its last wave, and events of other
//! aggregates committed meanwhile wait for that claim. Unbounded, a run of 100 kept them
//! waiting up to 99 publish round trips (into Kafka on tansu the trickle's p50 went from 5 to
//! 26 ms). So the waves after the first start only within [`RelayConfig::run_budget`] of the
//! first wave's start (default 5 ms): the cycle lasts at most that much longer than one
//! without runs, and a run that reaches the budget stops like one that meets a failure, its
//! rest released unsent (no attempt counted, its first unsent version the aggregate's head
//! again), to be claimed by the next cycle as a new run. The hot aggregate then gets
//! `run_budget / rtt` versions per cycle instead of one (on a loaded machine 173 events/s into
//! Kafka and 685 into NATS against 28 and 38 with runs off, 716 and 1,590 unbounded;
//! BENCHMARKS.md, *Run claims with the waves' bound*).
//!
//! Rejected as the default: [`RelayConfig::run_yields`] (off by default), which claims the next
//! batch while the waves of a batch holding a run go out, as prefetch does, and stops the waves
//! once that claim brought events. The claim cannot hold the aggregate of a run in flight, so
//! the hot aggregate is served every other cycle only, for about one claim's duration: the
//! others' latency was the best measured (trickle p50 0.56 x of runs off into Kafka, 0.9 x
//! into NATS) but the hot aggregate the slowest (132 and 612 events/s). Prefetch and the early claim are otherwise
//! unchanged: a next claim made while the waves go out cannot hold any aggregate of the batch
//! in flight, runs included.
//!
//! # Why a crash never loses an event
//!
//! A row becomes published only through [`crate::Outcome::Published`], which is built from the
//! broker's delivery report. A crash anywhere between claim and complete leaves the row pending
//! (its lease expires or its locking transaction rolls back), so another cycle publishes it
//! again: a duplicate, never a loss.
//!
//! # Why order holds per aggregate
//!
//! The store hands out only aggregate heads, at most one per aggregate across all relays, and the
//! next version becomes claimable only after the head is published, or is handed out with it in
//! its run to the same relay, which sends it only after the head's acknowledgement (*Runs*).
//! A parked head keeps its aggregate blocked, and only that aggregate.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;
use tracing::{debug, error, info, info_span, warn, Instrument};

use crate::circuit::{CircuitBreaker, CircuitChange};
use crate::clock::Clock;
use crate::delivery::{
    ClaimMode, ClaimRequest, ClaimedBatch, CompletionReport, LastError, Outcome, MAX_LEASE, MAX_RUN,
};
use crate::envelope::Envelope;
use crate::error::{ConfigError, StoreError};
use crate::publisher::{PublishResult, Publisher};
use crate::retry::{IdleBackoff, RetryPolicy};
use crate::store::RelayStore;
use crate::telemetry::{self, FailureAction};

/// Relay configuration. Build with [`RelayConfig::builder`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RelayConfig {
    /// Identity in leases and logs. Default: `relay-<random>`.
    pub owner: String,
    /// Most events per claim. Default 500.
    pub batch_size: usize,
    /// Longest run per aggregate the relay claims ([`ClaimRequest::run`]): up to this many
    /// consecutive versions of one aggregate are published in one cycle, each sent once the
    /// one before it is acknowledged (module docs, *Runs*). Default 1 (runs off: heads only,
    /// as before runs existed); a store without runs (MariaDB today) ignores it.
    /// Runs count against `batch_size`, so a run longer than it is claimed as `batch_size`
    /// events at most. Accepted: `1..=MAX_RUN`.
    ///
    /// Why off by default: with runs of 100 a hot aggregate costs one claim and one
    /// completion per run instead of per version. The cycle that carries a run completes and
    /// claims again only after its last wave, so events of other aggregates committed
    /// meanwhile wait for it; [`RelayConfig::run_budget`] bounds that wait (default 5 ms),
    /// which also bounds the versions per cycle to about `run_budget / rtt`. Measured on a
    /// loaded machine (BENCHMARKS.md, *Run claims with the waves' bound*), the budget kept the
    /// trickle's p50 within 1.1 x of runs off into Kafka but 1.4 x into NATS, and the hot
    /// aggregate below 1,000 events/s, so runs stay opt-in until a quiet-machine run says
    /// otherwise. Turn runs on (e.g. 100) where one aggregate's backlog must drain fast; on a
    /// slow transport, or where other aggregates' latency matters more, keep them short or off.
    pub run: usize,
    /// Longest time a cycle spends on the waves of its runs after the first wave (module docs,
    /// *Runs*, *The waves' bound*): a wave after the first starts only while less than this
    /// has passed since the first wave started; the rest of each run is released unsent (no
    /// attempt counted) and its first unsent version is its aggregate's head for the next
    /// claim. Default 5 ms. Accepted: 1 ms..=60 s. Irrelevant with `run` 1.
    pub run_budget: Duration,
    /// With `prefetch` and runs: a batch that holds a run has the next batch claimed while its
    /// waves go out (as a full batch does), and its waves stop once that claim came back with
    /// events, so those wait no longer than a claim for the run (module docs, *The waves'
    /// bound*). Default `false`.
    pub run_yields: bool,
    /// Retry and poison policy.
    pub retry: RetryPolicy,
    /// Shortest idle sleep. Default 10 ms.
    pub idle_min: Duration,
    /// Longest idle sleep (the fallback polling period when wake-ups are lost). Default 1 s.
    pub idle_max: Duration,
    /// Time the lease must still have left, beyond the delivery timeout, before a batch may be
    /// published. Default 2 s.
    pub lease_margin: Duration,
    /// Claim the next batch while a full batch is published. Default `true`.
    pub prefetch: bool,
    /// With `prefetch`: once a batch that was not full is published, claim the next batch while
    /// its completion is written. Default `true`: at 1,000 events/s on PostgreSQL into Kafka
    /// it took the commit → acknowledgement p99 to 0.84 x and p99.9 to 0.80 x on a quiet
    /// machine (p50 0.99 x), p99 to 0.72 x at load 11, p50 and p99 to about half on a
    /// saturated one (BENCHMARKS.md, stop 41 and the latency pass; an earlier run at load 4-6,
    /// section 3, measured it slower and was not reproduced).
    /// Order, fencing and crash recovery are those of any claim (what holds when the
    /// completion fails, the relay dies or stops, and what it was tested against: the module
    /// docs, "What the early claim guarantees").
    pub early_claim: bool,
    /// First pause of the circuit breaker after a cycle that failed as a whole (see
    /// [`crate::circuit`]). Default 500 ms.
    pub circuit_base: Duration,
    /// Longest pause of the circuit breaker. Default 30 s.
    pub circuit_max: Duration,
}

/// Smallest accepted [`RelayConfig::lease_margin`]: it must cover what a relay does after the
/// last delivery report and before its completion commits (a publisher's grace for late reports,
/// 500 ms for the Kafka publisher, plus the completion's round trips).
pub const MIN_LEASE_MARGIN: Duration = Duration::from_secs(1);

/// The default [`RelayConfig::run_budget`].
pub const DEFAULT_RUN_BUDGET: Duration = Duration::from_millis(5);
/// The accepted [`RelayConfig::run_budget`]s.
pub const RUN_BUDGET_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(1)..=Duration::from_secs(60);

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            owner: format!("relay-{}", uuid::Uuid::new_v4().simple()),
            batch_size: 500,
            run: 1,
            run_budget: DEFAULT_RUN_BUDGET,
            run_yields: false,
            retry: RetryPolicy::default(),
            idle_min: Duration::from_millis(10),
            idle_max: Duration::from_secs(1),
            lease_margin: Duration::from_secs(2),
            prefetch: true,
            early_claim: true,
            circuit_base: Duration::from_millis(500),
            circuit_max: Duration::from_secs(30),
        }
    }
}

impl RelayConfig {
    /// A builder from the defaults.
    pub fn builder() -> RelayConfigBuilder {
        RelayConfigBuilder(Self::default())
    }
}

/// Builder for [`RelayConfig`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RelayConfigBuilder(RelayConfig);

impl RelayConfigBuilder {
    /// Relay identity.
    pub fn owner(mut self, owner: impl Into<String>) -> Self {
        self.0.owner = owner.into();
        self
    }
    /// Batch size.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.0.batch_size = n;
        self
    }
    /// Longest run per aggregate, in `1..=MAX_RUN` (see [`RelayConfig::run`]); 1 claims heads
    /// only, as before runs. A run longer than `batch_size` is capped at it when claiming.
    pub fn run(mut self, n: usize) -> Self {
        self.0.run = n;
        self
    }
    /// Longest time a cycle spends on its runs' waves after the first (see
    /// [`RelayConfig::run_budget`]), in [`RUN_BUDGET_RANGE`].
    pub fn run_budget(mut self, d: Duration) -> Self {
        self.0.run_budget = d;
        self
    }
    /// Whether a batch holding a run has the next batch claimed during its waves, which stop
    /// once that claim brought events (see [`RelayConfig::run_yields`]).
    pub fn run_yields(mut self, on: bool) -> Self {
        self.0.run_yields = on;
        self
    }
    /// Retry policy.
    pub fn retry(mut self, p: RetryPolicy) -> Self {
        self.0.retry = p;
        self
    }
    /// Idle backoff bounds.
    pub fn idle(mut self, min: Duration, max: Duration) -> Self {
        self.0.idle_min = min;
        self.0.idle_max = max;
        self
    }
    /// Lease safety margin.
    pub fn lease_margin(mut self, d: Duration) -> Self {
        self.0.lease_margin = d;
        self
    }
    /// Whether to claim the next batch while publishing a full one (see the module docs).
    pub fn prefetch(mut self, on: bool) -> Self {
        self.0.prefetch = on;
        self
    }
    /// Whether, with prefetch on, a batch that was not full has the next batch claimed while
    /// its completion is written (see the module docs). Default `true`; `false` claims the
    /// next batch only once the completion committed (one claim fewer per cycle that finds
    /// nothing new, the commit → acknowledgement tail about a fifth longer).
    pub fn early_claim(mut self, on: bool) -> Self {
        self.0.early_claim = on;
        self
    }
    /// Pauses of the circuit breaker: the first one, and the longest.
    pub fn circuit_breaker(mut self, base: Duration, max: Duration) -> Self {
        self.0.circuit_base = base;
        self.0.circuit_max = max;
        self
    }
    /// Validates the configuration on its own; [`Relay::new`] also checks it against the store
    /// and the publisher.
    pub fn build(self) -> Result<RelayConfig, ConfigError> {
        let c = self.0;
        if c.owner.trim().is_empty() {
            return Err(ConfigError::new("relay owner must not be empty"));
        }
        if c.batch_size == 0 || c.batch_size > 100_000 {
            return Err(ConfigError::new("batch_size must be in 1..=100000"));
        }
        if c.run == 0 || c.run > MAX_RUN {
            return Err(ConfigError::new(format!(
                "run must be in 1..={MAX_RUN} (1: heads only, no runs); got {}",
                c.run
            )));
        }
        if !RUN_BUDGET_RANGE.contains(&c.run_budget) {
            return Err(ConfigError::new(format!(
                "run_budget must be in {:?}..={:?}; got {:?}",
                RUN_BUDGET_RANGE.start(),
                RUN_BUDGET_RANGE.end(),
                c.run_budget
            )));
        }
        if c.idle_min.is_zero() || c.idle_min > c.idle_max {
            return Err(ConfigError::new(
                "idle_min must be greater than zero and not above idle_max",
            ));
        }
        if c.lease_margin < MIN_LEASE_MARGIN {
            return Err(ConfigError::new(format!(
                "lease_margin of {:?} is shorter than the {MIN_LEASE_MARGIN:?} a relay needs \
                 between the last delivery report and its completion",
                c.lease_margin
            )));
        }
        if c.circuit_base.is_zero() || c.circuit_base > c.circuit_max {
            return Err(ConfigError::new(
                "circuit breaker: base must be greater than zero and not above max",
            ));
        }
        Ok(c)
    }
}

/// What one relay cycle did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CycleReport {
    /// Events claimed.
    pub claimed: usize,
    /// Events acknowledged and marked published.
    pub published: usize,
    /// Events scheduled for retry after their own failure (an attempt spent).
    pub retried: usize,
    /// Events put back after a transport failure (no attempt spent).
    pub deferred: usize,
    /// Events parked after publishing failed.
    pub parked: usize,
    /// Events the claim parked for their aggregate version (out of order, or a version gap
    /// held past the store's bound).
    pub parked_at_claim: usize,
    /// Aggregates held by the claim because their head skips a version.
    pub gaps_held: usize,
    /// The circuit breaker is open: wait this long before the next cycle.
    pub pause: Option<Duration>,
    /// Outcomes refused by fencing (the claim was superseded).
    pub superseded: usize,
    /// The batch was released without publishing (shutdown, or too little lease left).
    pub released: bool,
    /// Events of runs not sent: their run stopped at an earlier event's failure, at the lease
    /// check before their wave, or at shutdown. The completion released them unchanged.
    pub unsent: usize,
}

impl CycleReport {
    /// `true` when the cycle found nothing to do.
    pub fn is_idle(&self) -> bool {
        self.claimed == 0
    }
}

/// A request to stop, shared with whoever triggers shutdown.
#[derive(Clone, Debug, Default)]
pub struct ShutdownSignal(Arc<AtomicBool>);

impl ShutdownSignal {
    /// Requests shutdown: a claimed batch not yet sent is released, one being published is
    /// finished and recorded.
    pub fn trigger(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    /// Whether shutdown was requested.
    pub fn is_triggered(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// The relay over a store `S` and a publisher `P`.
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    clock: Arc<dyn Clock>,
    rng: Box<dyn RngCore + Send + Sync>,
    idle: IdleBackoff,
    shutdown: ShutdownSignal,
    /// A batch claimed ahead by the previous cycle, with the relay clock before its claim.
    prefetched: Option<(ClaimedBatch, chrono::DateTime<chrono::Utc>)>,
    breaker: CircuitBreaker,
    gauge: CircuitMember,
}

/// A relay's share of the `outbox_relay_circuit_open` gauge: counted in its tally while the
/// relay's breaker is open, and no longer once the relay is dropped.
#[derive(Debug)]
struct CircuitMember {
    tally: telemetry::CircuitTally,
    counted: bool,
    /// The tally's acknowledgements when this relay's last cycle failed as a whole.
    acks_at_failure: u64,
}

impl CircuitMember {
    fn new(tally: telemetry::CircuitTally) -> Self {
        Self {
            tally,
            counted: false,
            acks_at_failure: 0,
        }
    }

    fn set_open(&mut self, open: bool) {
        if open != self.counted {
            self.counted = open;
            if open {
                self.tally.opened();
            } else {
                self.tally.closed();
            }
        }
    }
}

impl Drop for CircuitMember {
    fn drop(&mut self) {
        self.set_open(false);
    }
}

impl<S, P> std::fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S: RelayStore, P: Publisher> Relay<S, P> {
    /// A relay. Rejects a claim that could end while the broker still holds a record, which
    /// would let a second relay send version N+1 before N is acknowledged:
    ///
    /// * a lease that does not outlive the publisher's delivery timeout plus the lease margin;
    /// * in locked-transaction mode, a store-side hold limit
    ///   ([`RelayStore::locked_claim_timeout`]) shorter than what a claim really lives: one
    ///   publication (delivery timeout plus margin), or two with prefetch, since a prefetched
    ///   claim waits for the batch before it and is then published itself.
    pub fn new(
        store: S,
        publisher: P,
        config: RelayConfig,
        clock: Arc<dyn Clock>,
        rng: Box<dyn RngCore + Send + Sync>,
    ) -> Result<Self, ConfigError> {
        let publication = publisher.delivery_timeout() + config.lease_margin;
        match store.claim_mode() {
            ClaimMode::Lease { duration } if duration <= publication => {
                return Err(ConfigError::new(format!(
                    "lease of {duration:?} does not outlive the publisher's delivery timeout \
                     ({:?}) plus the lease margin ({:?}); use a lease longer than {publication:?}",
                    publisher.delivery_timeout(),
                    config.lease_margin
                )));
            }
            ClaimMode::Lease { duration } if duration > MAX_LEASE => {
                return Err(ConfigError::new(format!(
                    "lease of {duration:?} is longer than {MAX_LEASE:?}: a relay that dies \
                     holding it would keep its events unpublished that long"
                )));
            }
            _ => {}
        }
        if let Some(hold) = store.locked_claim_timeout() {
            let claims_alive = if config.prefetch { 2 } else { 1 };
            let need = publication * claims_alive;
            if hold <= need {
                return Err(ConfigError::new(format!(
                    "the store ends a locked claim after {hold:?}, but a claim lives up to \
                     {need:?} ({claims_alive} x (delivery timeout {:?} + lease margin {:?}){}); \
                     raise locked_max_hold above {need:?}{}",
                    publisher.delivery_timeout(),
                    config.lease_margin,
                    if config.prefetch {
                        ", since a prefetched claim waits for the batch before it"
                    } else {
                        ""
                    },
                    if config.prefetch {
                        " or turn prefetch off"
                    } else {
                        ""
                    },
                )));
            }
        }
        let idle = IdleBackoff::new(config.idle_min, config.idle_max);
        let breaker = CircuitBreaker::new(config.circuit_base, config.circuit_max);
        Ok(Self {
            store,
            publisher,
            config,
            clock,
            rng,
            idle,
            shutdown: ShutdownSignal::default(),
            prefetched: None,
            breaker,
            gauge: CircuitMember::new(telemetry::CircuitTally::process()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The publisher.
    pub fn publisher(&self) -> &P {
        &self.publisher
    }

    /// A handle to request shutdown.
    pub fn shutdown_signal(&self) -> ShutdownSignal {
        self.shutdown.clone()
    }

    /// Shares the circuit gauge with the relays holding `tally` instead of the process.
    #[cfg(test)]
    pub(crate) fn with_circuit_tally(mut self, tally: telemetry::CircuitTally) -> Self {
        self.gauge.set_open(false);
        self.gauge = CircuitMember::new(tally);
        self.gauge.set_open(self.breaker.is_open());
        self
    }

    /// The circuit breaker (open while the transport fails as a whole).
    pub fn circuit(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// Step 1: claim a batch.
    pub async fn claim(&self) -> Result<ClaimedBatch, StoreError> {
        self.store.claim(&self.claim_request()).await
    }

    /// The request of this relay's claims: its owner, `batch_size` and `run` (at most
    /// `batch_size`).
    pub fn claim_request(&self) -> ClaimRequest {
        ClaimRequest::new(self.config.owner.clone(), self.config.batch_size)
            .with_run(self.config.run.min(self.config.batch_size))
    }

    /// Whether the batch's claim leaves enough time to publish (delivery timeout + margin):
    /// the lease's remaining time in lease mode, in locked-transaction mode the store's hold
    /// limit ([`RelayStore::locked_claim_timeout`]; none: always). `claimed_at` is this
    /// relay's clock reading taken *before* the claim was requested: the store measures the
    /// lease's remaining time when it grants it, so adding it to a reading from before the
    /// request errs early, whatever the claim's round trip and commit took. The same check
    /// runs before each wave of runs (module docs, *Runs*).
    pub fn lease_allows_publish(
        &self,
        batch: &ClaimedBatch,
        claimed_at: chrono::DateTime<chrono::Utc>,
    ) -> bool {
        claim_covers(
            self.clock.now(),
            claimed_at,
            self.claim_limit(batch),
            self.publication(),
        )
    }

    /// How long a claim lives from before its request: the lease's remaining time, or the
    /// locked-mode hold limit; `None`: no limit.
    fn claim_limit(&self, batch: &ClaimedBatch) -> Option<Duration> {
        batch
            .lease_remaining
            .or_else(|| match self.store.claim_mode() {
                ClaimMode::LockedTransaction => self.store.locked_claim_timeout(),
                _ => None,
            })
    }

    /// What one more publication needs of a claim: the delivery timeout plus the margin.
    fn publication(&self) -> Duration {
        self.publisher.delivery_timeout() + self.config.lease_margin
    }

    /// Step 2: publish the batch in waves (module docs, *Runs*): every head at once, then
    /// each run's next event once the one before it was acknowledged, while the claim (taken
    /// at `claimed_at`, as for [`lease_allows_publish`](Self::lease_allows_publish)) covers
    /// one more publication. One entry per record: `None` for an event of a run that was not
    /// sent (its run stopped before it).
    pub async fn publish(
        &self,
        batch: &ClaimedBatch,
        claimed_at: chrono::DateTime<chrono::Utc>,
    ) -> Vec<Option<PublishResult>> {
        let bounds = WaveBounds {
            shutdown: &self.shutdown,
            clock: &self.clock,
            claimed_at,
            limit: self.claim_limit(batch),
            need: self.publication(),
            started: self.clock.now(),
            budget: self.config.run_budget,
            yielded: None,
        };
        publish_waves(&self.publisher, batch, || bounds.may_continue()).await
    }

    /// Step 3 (pure): turn results into outcomes with the retry policy; a record that was not
    /// sent (`None`) gets none, so the completion releases it unchanged.
    pub fn decide(
        &mut self,
        batch: &ClaimedBatch,
        results: &[Option<PublishResult>],
    ) -> Vec<Outcome> {
        decide_batch(&self.config.retry, &mut self.rng, batch, results)
            .into_iter()
            .flatten()
            .collect()
    }

    /// Step 4: record the outcomes.
    pub async fn complete(
        &self,
        batch: &ClaimedBatch,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        self.store.complete(&batch.handle, outcomes).await
    }

    /// One full cycle: claim (or take the prefetched batch), publish, decide, complete; with
    /// prefetch on and a full batch, the next batch is claimed meanwhile.
    pub async fn run_once(&mut self) -> Result<CycleReport, StoreError> {
        let started = std::time::Instant::now();
        let (batch, claimed_at) = match self.prefetched.take() {
            Some(prefetched) => prefetched,
            None => {
                let before = self.clock.now();
                let batch = self.claim().await?;
                (batch, before)
            }
        };
        let mut report = CycleReport {
            claimed: batch.records.len(),
            ..CycleReport::default()
        };
        self.note_claim(&batch, &mut report);
        if batch.is_empty() {
            self.note_idle_circuit();
            report.pause = self.breaker.pause(&mut self.rng);
            return Ok(report);
        }
        if self.shutdown.is_triggered() {
            self.store.release(&batch.handle).await?;
            report.released = true;
            return Ok(report);
        }
        if !self.lease_allows_publish(&batch, claimed_at) {
            warn!(
                owner = %self.config.owner,
                "lease too close to expiry to publish safely; releasing the batch"
            );
            self.store.release(&batch.handle).await?;
            report.released = true;
            return Ok(report);
        }
        let span = info_span!("outbox.relay.batch", owner = %self.config.owner, size = batch.records.len(), stage = "publish");
        let full = batch.records.len() >= self.config.batch_size;
        let has_run = batch.records.iter().any(|r| r.run_position > 0);
        let yields = self.config.run_yields && has_run && !full;
        let prefetch = self.config.prefetch && (full || yields) && !self.shutdown.is_triggered();
        let early = self.config.prefetch && self.config.early_claim && !full && !yields;
        let request = self.claim_request();
        let request = &request;
        // Set once a claim made during the waves came back with events (`run_yields`).
        let next_claimed = AtomicBool::new(false);
        let next_claimed = &next_claimed;
        let bounds = WaveBounds {
            shutdown: &self.shutdown,
            clock: &self.clock,
            claimed_at,
            limit: self.claim_limit(&batch),
            need: self.publication(),
            started: self.clock.now(),
            budget: self.config.run_budget,
            yielded: (prefetch && yields).then_some(next_claimed),
        };
        // Disjoint borrows: this batch's publish, decide and complete, and the next claim.
        let (store, publisher, clock) = (&self.store, &self.publisher, &self.clock);
        let (retry, rng, shutdown) = (&self.config.retry, &mut self.rng, &self.shutdown);
        let may_continue = || bounds.may_continue();
        let claim_next = move || async move {
            let before = clock.now();
            let claimed = store.claim(request).await;
            if claimed.as_ref().is_ok_and(|b| !b.is_empty()) {
                next_claimed.store(true, Ordering::SeqCst);
            }
            Some((claimed, before))
        };
        let (next, (results, outcomes, completion)) = if prefetch {
            let current = async {
                let results = publish_waves(publisher, &batch, may_continue)
                    .instrument(span)
                    .await;
                let outcomes = decide_batch(retry, rng, &batch, &results);
                let recorded: Vec<Outcome> = outcomes.iter().flatten().cloned().collect();
                let completion = store.complete(&batch.handle, &recorded).await;
                (results, outcomes, completion)
            };
            // The claim is polled first, so it is under way before the publish starts.
            futures::future::join(claim_next(), current).await
        } else {
            let results = publish_waves(publisher, &batch, may_continue)
                .instrument(span)
                .await;
            let outcomes = decide_batch(retry, rng, &batch, &results);
            let recorded: Vec<Outcome> = outcomes.iter().flatten().cloned().collect();
            let completion = store.complete(&batch.handle, &recorded);
            if early && !shutdown.is_triggered() {
                // Published: what committed meanwhile is claimed while the completion is
                // written (the claim polled first, so it is under way with it).
                let (next, completion) = futures::future::join(claim_next(), completion).await;
                (next, (results, outcomes, completion))
            } else {
                let completion = completion.await;
                (None, (results, outcomes, completion))
            }
        };
        match next {
            Some((Ok(next), at)) if !next.is_empty() => self.prefetched = Some((next, at)),
            Some((Ok(next), _)) => {
                let mut ignored = CycleReport::default();
                self.note_claim(&next, &mut ignored);
                report.parked_at_claim += ignored.parked_at_claim;
            }
            Some((Err(e), _)) => {
                warn!(owner = %self.config.owner, error = %e, "prefetch claim failed; the next cycle claims again");
            }
            None => {}
        }
        let completion = completion?;
        report.superseded = completion.superseded;
        let refused: std::collections::HashSet<_> =
            completion.superseded_events.iter().copied().collect();
        let now = self.clock.now();
        let mut acknowledged = 0usize;
        let mut transport_failures = 0usize;
        let mut failure_kinds: Vec<&str> = Vec::new();
        for ((rec, outcome), res) in batch.records.iter().zip(&outcomes).zip(&results) {
            let (Some(outcome), Some(res)) = (outcome, res) else {
                // An event of a run that was not sent: released by the completion.
                report.unsent += 1;
                continue;
            };
            let e = &rec.envelope;
            let attempt = rec.attempts + 1;
            if res.is_ok() {
                acknowledged += 1;
            }
            if let Err(err) = res {
                if !failure_kinds.contains(&err.kind.as_str()) {
                    failure_kinds.push(err.kind.as_str());
                }
                // Labelled with what the relay did with it (below), not the record's own class.
                let action = if refused.contains(&e.event_id) {
                    FailureAction::Superseded
                } else {
                    match outcome {
                        Outcome::Defer { .. } => FailureAction::Deferred,
                        Outcome::Park { .. } => FailureAction::Parked,
                        _ => FailureAction::Retried,
                    }
                };
                telemetry::record_failure(&LastError::from(err), action);
            }
            if refused.contains(&e.event_id) {
                // Not recorded: the claim was superseded (the lease expired and another
                // relay took the aggregate). Counted in `superseded` only.
                continue;
            }
            match outcome {
                Outcome::Published { ack, .. } => {
                    report.published += 1;
                    telemetry::record_published(e, rec.is_resend(), now);
                    debug!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, attempt, stage = "published", transport = %ack.transport(), ack = %ack, "event published");
                }
                Outcome::Retry { delay, error, .. } => {
                    report.retried += 1;
                    debug!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, attempt, stage = "retry", error_kind = %error.kind, error = %error.message, delay_ms = delay.as_millis() as u64, "publish failed; will retry");
                }
                Outcome::Defer { error, .. } => {
                    report.deferred += 1;
                    transport_failures += 1;
                    debug!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, stage = "deferred", error_kind = %error.kind, error = %error.message, "transport failed; event put back without spending an attempt");
                }
                Outcome::Park { reason, .. } => {
                    report.parked += 1;
                    telemetry::record_parked(reason);
                    error!(event_id = %e.event_id, aggregate_id = %e.aggregate_id, event_type = %e.event_type, attempt, stage = "parked", park_kind = reason.kind.as_str(), error_kind = %reason.error.kind, error = %reason.error.message, "event parked; its aggregate is blocked until an operator acts");
                }
            }
        }
        if report.retried > 0 {
            warn!(owner = %self.config.owner, retried = report.retried, kinds = ?failure_kinds, "events of the batch failed on their own and will be retried");
        }
        if report.deferred > 0 && acknowledged > 0 {
            warn!(owner = %self.config.owner, deferred = report.deferred, published = report.published, kinds = ?failure_kinds, "part of the batch failed in the transport; those events were put back without spending attempts");
        }
        self.note_circuit(acknowledged, transport_failures, &failure_kinds, now);
        report.pause = self.breaker.pause(&mut self.rng);
        if completion.superseded > 0 {
            telemetry::record_superseded(completion.superseded);
            warn!(owner = %self.config.owner, superseded = completion.superseded, "claim was superseded (lease expired); those events may be published twice");
        }
        telemetry::record_cycle(batch.records.len(), started.elapsed());
        Ok(report)
    }

    /// Signals and logs for what a claim parked or held because of aggregate versions.
    fn note_claim(&self, batch: &ClaimedBatch, report: &mut CycleReport) {
        report.gaps_held = batch.gaps_held;
        report.parked_at_claim += batch.parked.len();
        for p in &batch.parked {
            telemetry::record_parked_kind(p.kind);
            error!(event_id = %p.event_id, aggregate_type = %p.aggregate_type, aggregate_id = %p.aggregate_id, aggregate_version = p.aggregate_version, stage = "claim", park_kind = p.kind.as_str(), "event parked by the claim for its aggregate version; an operator decides");
        }
    }

    /// Feeds the circuit breaker and logs its changes, once each.
    fn note_circuit(
        &mut self,
        acknowledged: usize,
        transport_failures: usize,
        kinds: &[&str],
        now: chrono::DateTime<chrono::Utc>,
    ) {
        if acknowledged > 0 {
            self.gauge.tally.note_acknowledged();
        } else if transport_failures > 0 {
            self.gauge.acks_at_failure = self.gauge.tally.acknowledgements();
        }
        match self.breaker.on_cycle(acknowledged, transport_failures, now) {
            Some(CircuitChange::Opened) => {
                self.gauge.set_open(true);
                warn!(owner = %self.config.owner, failed = transport_failures, kinds = ?kinds, "the transport failed for the whole batch (broker down, topic or leader missing?); pausing publication with growing backoff, no attempts spent");
            }
            Some(CircuitChange::Closed { open_for }) => {
                self.gauge.set_open(false);
                info!(owner = %self.config.owner, open_for_ms = open_for.as_millis() as u64, "the broker acknowledges again; publication resumed");
            }
            None => {}
        }
    }

    /// A cycle with nothing to send never tries the broker, so an open breaker would stay open
    /// (and counted in `outbox_relay_circuit_open`) until work arrives. It closes instead when
    /// another relay sharing the gauge had a record acknowledged since this relay last failed:
    /// the transport answers again.
    fn note_idle_circuit(&mut self) {
        if !self.breaker.is_open()
            || self.gauge.tally.acknowledgements() == self.gauge.acks_at_failure
        {
            return;
        }
        if let Some(CircuitChange::Closed { open_for }) = self.breaker.close(self.clock.now()) {
            self.gauge.set_open(false);
            info!(owner = %self.config.owner, open_for_ms = open_for.as_millis() as u64, "another relay's records are acknowledged again and this one has nothing to send; circuit closed");
        }
    }

    /// Releases the batch claimed ahead by the last cycle, if any (the driver calls this when it
    /// stops; a relay that is simply dropped leaves it to lease expiry or to the rollback of
    /// its transaction).
    pub async fn release_prefetched(&mut self) -> Result<bool, StoreError> {
        match self.prefetched.take() {
            Some((batch, _)) => {
                self.store.release(&batch.handle).await?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The batch claimed ahead that waits for the next cycle, if any.
    pub fn prefetched(&self) -> Option<&ClaimedBatch> {
        self.prefetched.as_ref().map(|(batch, _)| batch)
    }

    /// How long to sleep after an idle cycle (jittered, growing while idle).
    pub fn idle_delay(&mut self) -> Duration {
        self.idle.next_delay(&mut self.rng)
    }

    /// Resets the idle backoff after a cycle that found work.
    pub fn reset_idle(&mut self) {
        self.idle.reset();
    }

    /// A jittered delay after a failed cycle (`failures` consecutive failures).
    pub fn error_delay(&mut self, failures: u32) -> Duration {
        self.config.retry.backoff(failures, &mut self.rng)
    }
}

/// What bounds the waves of one batch (module docs, *Runs*): a wave after the first starts
/// only while no shutdown was requested, the claim (living `limit` from `claimed_at`) still
/// covers one more publication (`need`), less than `budget` has passed since the first wave
/// started (`started`), and the next batch, claimed meanwhile with `yielded` set, has not
/// come back with events.
struct WaveBounds<'a> {
    shutdown: &'a ShutdownSignal,
    clock: &'a Arc<dyn Clock>,
    claimed_at: chrono::DateTime<chrono::Utc>,
    limit: Option<Duration>,
    need: Duration,
    started: chrono::DateTime<chrono::Utc>,
    budget: Duration,
    yielded: Option<&'a AtomicBool>,
}

impl WaveBounds<'_> {
    /// Whether the runs may go on to their next wave.
    fn may_continue(&self) -> bool {
        if self.shutdown.is_triggered() {
            debug!("shutdown requested; the runs of the batch stop here");
            return false;
        }
        let now = self.clock.now();
        if !claim_covers(now, self.claimed_at, self.limit, self.need) {
            warn!("the claim no longer covers one more publication; the runs of the batch stop here and their rest is released");
            return false;
        }
        if (now - self.started).to_std().unwrap_or(Duration::ZERO) >= self.budget {
            debug!(budget_ms = self.budget.as_millis() as u64, "the waves' time budget is spent; the runs of the batch stop here and their rest is released");
            return false;
        }
        if self.yielded.is_some_and(|y| y.load(Ordering::SeqCst)) {
            debug!("the next batch was claimed; the runs of the batch stop here and their rest is released");
            return false;
        }
        true
    }
}

/// Whether a claim living `limit` from `claimed_at` has more than `need` left at `now`.
fn claim_covers(
    now: chrono::DateTime<chrono::Utc>,
    claimed_at: chrono::DateTime<chrono::Utc>,
    limit: Option<Duration>,
    need: Duration,
) -> bool {
    let Some(limit) = limit else {
        return true;
    };
    let left = (claimed_at + limit - now)
        .to_std()
        .unwrap_or(Duration::ZERO);
    left > need
}

/// Whether record `i` of `batch` continues the run of record `i - 1`: same aggregate, next
/// run position. A record that claims a run position without that predecessor is never sent
/// (a store breaking the batch layout must not make the relay send out of order).
fn continues_run(batch: &ClaimedBatch, i: usize) -> bool {
    let rec = &batch.records[i];
    if rec.run_position == 0 {
        return false;
    }
    let Some(prev) = i.checked_sub(1).map(|p| &batch.records[p]) else {
        return false;
    };
    prev.run_position.checked_add(1) == Some(rec.run_position)
        && prev.envelope.aggregate_type == rec.envelope.aggregate_type
        && prev.envelope.aggregate_id == rec.envelope.aggregate_id
}

/// Publishes `batch` in waves: wave 0 is every head (`run_position` 0), sent in one call;
/// wave `j` is the `j`-th event of each run whose event `j - 1` came back `Ok`, sent once
/// `may_continue` allows it. A run stops at its first failure. One entry per record, `None`
/// for a record not sent. A publisher that returns the wrong number of results gets every
/// record of that wave treated as a transient failure.
async fn publish_waves<P: Publisher>(
    publisher: &P,
    batch: &ClaimedBatch,
    may_continue: impl Fn() -> bool,
) -> Vec<Option<PublishResult>> {
    let n = batch.records.len();
    let mut results: Vec<Option<PublishResult>> = (0..n).map(|_| None).collect();
    for (i, rec) in batch.records.iter().enumerate() {
        if rec.run_position > 0 && !continues_run(batch, i) {
            error!(event_id = %rec.envelope.event_id, run_position = rec.run_position, "the claim put an event of a run where its predecessor is not; not sending it (the completion releases it)");
        }
    }
    let mut wave: Vec<usize> = (0..n)
        .filter(|&i| batch.records[i].run_position == 0)
        .collect();
    let mut first = true;
    while !wave.is_empty() {
        if !first && !may_continue() {
            break;
        }
        first = false;
        // Lent, not copied: the publisher reads the envelopes where the claim put them.
        let envelopes: Vec<&Envelope> = wave.iter().map(|&i| &batch.records[i].envelope).collect();
        let mut sent = publisher.publish(&envelopes).await;
        if sent.len() != envelopes.len() {
            // A publisher that breaks its contract must not make us mark anything: treat
            // every record of the wave as a transient failure.
            error!(
                expected = envelopes.len(),
                got = sent.len(),
                "publisher returned the wrong number of results; treating the batch as failed"
            );
            sent = envelopes
                .iter()
                .map(|_| {
                    Err(crate::PublishError::new(
                        crate::PublishErrorKind::Other,
                        "publisher returned the wrong number of results",
                    ))
                })
                .collect();
        }
        let mut next = Vec::new();
        for (&i, res) in wave.iter().zip(sent) {
            if res.is_ok() && i + 1 < n && continues_run(batch, i + 1) {
                next.push(i + 1);
            }
            results[i] = Some(res);
        }
        wave = next;
    }
    results
}

/// One outcome per record that was sent, `None` for one that was not.
fn decide_batch(
    retry: &RetryPolicy,
    rng: &mut Box<dyn RngCore + Send + Sync>,
    batch: &ClaimedBatch,
    results: &[Option<PublishResult>],
) -> Vec<Option<Outcome>> {
    batch
        .records
        .iter()
        .zip(results)
        .map(|(rec, res)| res.as_ref().map(|res| retry.decide(rec, res, &mut **rng)))
        .collect()
}

#[cfg(test)]
mod tests;
