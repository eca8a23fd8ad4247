//! [`Simulation`]: one system (backend, relays, log, consumer engine) plus the reference
//! model; applies [`Step`]s, checks the invariants after each, drains and checks the quiescent
//! invariants. [`run_property`] runs it as a seeded property test.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, Classify, CycleReport, DeliveryStatus, Envelope, EventId, ParkedFilter,
    ParkedStatus, PublishError, PublishErrorKind, PublishResult, Relay, RelayConfig, RetryPolicy,
    StoreError, StoreErrorKind,
};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, InboxProcessor, ParkedMessages, VersionPolicy,
};
use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyInbox, FaultyStore};
use outbox_testkit::MemoryLog;
use proptest::test_runner::{
    Config, FileFailurePersistence, RngSeed, TestCaseError, TestError, TestRunner,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::backend::{Backend, DeliverySnapshot, Hold, MemoryBackend};
use crate::config::{cases_from_env, SeededBug, SimConfig, SEED_ENV};
use crate::consumer::{InboxTx, Ledger, NoEffect, SimHandler, SimSource};
use crate::invariants::{self, ensure, Check, Model, Observed, Violations};
use crate::operator_scope;
use crate::producer::{Command, Touch};
use crate::publisher::{self, HeldBatch, PublisherHandle, ScriptedPublisher};
use crate::relay::{RelayShared, SimStore};
use crate::steps::{
    self, Case, HandlerFault, Modes, OperatorStep, Policy, RaceOp, RecordAnswer, Skew, Step,
    StoreFault,
};
use crate::transport::{Broker, Transport, TransportSource};

/// The topic (JetStream: the stream; RabbitMQ: the queue) of the simulation.
pub(crate) const TOPIC: &str = "events";
/// The consumer group (and inbox consumer name) of the simulation.
pub const GROUP: &str = "projection";
/// The wake-up bound: how soon after its commit an event appended while a relay was idle
/// (the wake-up gate armed) must wake that relay's listener.
const WAKE_BOUND: Duration = Duration::from_secs(2);
/// Longest a single step may take in real time before the simulation calls it hung.
const STEP_LIMIT: Duration = Duration::from_secs(20);

/// An invariant violation, with the step at which it was detected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Index of the step after which the invariant failed (`None`: at quiescence).
    pub step: Option<usize>,
    /// What failed.
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.step {
            Some(i) => write!(f, "after step {i}: {}", self.message),
            None => write!(f, "at quiescence: {}", self.message),
        }
    }
}

impl std::error::Error for Violation {}

/// What a run reached (coverage counters, so tests can prove the generator gets somewhere).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimReport {
    /// Steps applied.
    pub steps: usize,
    /// Events committed by business transactions.
    pub committed_events: usize,
    /// Records in the log (including duplicates).
    pub log_records: usize,
    /// Records in the log that repeat an earlier record's event.
    pub duplicates_in_log: usize,
    /// Events whose effect committed.
    pub applied: usize,
    /// Outcomes refused by fencing.
    pub superseded: usize,
    /// Late completions that ran after another relay claimed an aggregate of theirs
    /// ([`Step::Overtake`]).
    pub overtaken: usize,
    /// Of those, the ones that started while that claim stood mid-transaction on the server.
    pub overtaken_mid_claim: usize,
    /// Commits made while the store's wake-up gate was armed, whose wake-up was checked.
    pub wake_ups: usize,
    /// Events seen parked in the outbox.
    pub parked: usize,
    /// Batches answered with both acknowledgements and failures.
    pub mixed_batches: usize,
    /// Records sent inside a run: past their aggregate's next version, after the
    /// acknowledgement of the versions before them under the same claim.
    pub run_sends: usize,
    /// Cycles that ended with a prefetched batch waiting.
    pub prefetches: usize,
    /// Of those, cycles whose own batch was not full: the early claim took the next batch.
    pub early_claims: usize,
    /// Operator actions on the outbox (during the steps).
    pub operator_actions: usize,
    /// Relay crashes while holding a claim.
    pub relay_crashes_holding_work: usize,
    /// Of those, crashes between two events of a run: an event of the claim's run was
    /// acknowledged, its completion not written.
    pub relay_crashes_mid_run: usize,
    /// Consumer crashes with messages in flight.
    pub consumer_crashes_with_work: usize,
    /// Duplicates the engine absorbed.
    pub engine_duplicates: u64,
    /// Messages parked on the consumer side.
    pub consumer_parked: u64,
    /// Business commits refused with a conflict.
    pub conflicts: usize,
    /// Rows removed by cleanup.
    pub cleaned: u64,
    /// Faults injected into the relays' store, the inbox and the handler.
    pub faults: usize,
    /// Events appended out of their aggregate's order (gaps, late fills, re-appends).
    pub skewed: usize,
    /// Steps that ran two or more claims, completions or operator actions at once.
    pub races: usize,
    /// Events the outbox parked as version gaps.
    pub gap_parked: usize,
    /// Events the outbox parked as out of order.
    pub out_of_order_parked: usize,
    /// Operator actions the store refused (a version at or below the last, lower versions
    /// still waiting).
    pub operator_refused: usize,
    /// Operator actions (on parked events, or releases of an owner's claims, during the steps
    /// and the drain) whose scope was checked: the store's whole delivery state read before
    /// and after, only the target changed, and only as promised.
    pub operator_scope_checked: usize,
    /// Of those, releases of a crashed relay's claims ([`Step::ReleaseClaims`]).
    pub claim_releases: usize,
    /// Leases those releases ended.
    pub claims_released: u64,
    /// RabbitMQ channels lost under the running engine.
    pub channels_lost: usize,
    /// Messages the broker delivered again after later ones (JetStream) or after a channel
    /// closed (RabbitMQ).
    pub redelivered: usize,
    /// Re-sends JetStream's duplicate window kept out of the stream.
    pub deduplicated_sends: usize,
    /// [`Step::ConsumerStalls`] applied.
    pub consumer_stalls: usize,
    /// JetStream messages pulled by another member that died ([`Step::OtherMemberDies`]).
    pub taken_by_dead_members: usize,
    /// JetStream redeliveries handed to a member that held later messages unacknowledged
    /// (a crashed member's message coming back while the later ones are in flight).
    pub redelivered_behind_later: usize,
}

type OpTask = JoinHandle<Result<Option<EventId>, StoreError>>;
type SimRelay<B> = Relay<SimStore<<B as Backend>::Store>, ScriptedPublisher>;
type CycleResult<B> = (SimRelay<B>, Result<CycleReport, StoreError>);
type Engine<B, H> = ConsumerEngine<
    SimSource<TransportSource>,
    FaultyInbox<<B as Backend>::Inbox>,
    SimHandler<B, H>,
>;

struct RelaySlot<B: Backend> {
    relay: Option<SimRelay<B>>,
    task: Option<JoinHandle<CycleResult<B>>>,
    handle: PublisherHandle,
    held: Option<HeldBatch>,
    generation: u64,
    last_cycle: Option<CycleReport>,
}

enum Waited<B: Backend> {
    Held(Option<HeldBatch>),
    Done(Box<Result<CycleResult<B>, tokio::task::JoinError>>),
    /// The relay's cycle waits on a [`Hold`].
    Blocked,
}

/// How often a wait on the server's locks looks again.
const LOCK_POLL: Duration = Duration::from_millis(5);
/// Longest the simulation waits for a statement to queue behind a hold before it lets the
/// hold go anyway.
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// One simulated system: the system under test plus the reference model.
pub struct Simulation<B: Backend, H> {
    config: SimConfig,
    modes: Modes,
    backend: Arc<B>,
    log: MemoryLog,
    broker: Broker,
    shared: Arc<RelayShared>,
    violations: Violations,
    claim_faults: FaultInjector,
    complete_faults: FaultInjector,
    inbox_faults: FaultInjector,
    handler_fault: Arc<Mutex<Option<HandlerFault>>>,
    /// A stall of the engine's thread in its next poll ([`Step::EngineThreadStalls`]).
    engine_stall: Arc<Mutex<Option<Duration>>>,
    ledger: Arc<Mutex<Ledger>>,
    relays: Vec<RelaySlot<B>>,
    handler: SimHandler<B, H>,
    engine: Option<Engine<B, H>>,
    engine_generation: u64,
    parked_api: ParkedMessages<B::Inbox, SimHandler<B, H>>,
    commands: Arc<Vec<Box<dyn Command>>>,
    open: Vec<(B::BizTx, Vec<Envelope>)>,
    /// Events appended while the store's wake-up gate was armed throughout the append (an
    /// idle relay waited for a wake-up): their commit must wake it.
    gated: BTreeSet<EventId>,
    model: Model,
    report: SimReport,
    next_id: u64,
    // Dropped last: the tasks above run on it.
    rt: Runtime,
}

impl<B: Backend, H> fmt::Debug for Simulation<B, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Simulation")
            .field("config", &self.config)
            .field("modes", &self.modes)
            .field("committed", &self.model.committed.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend, H> Drop for Simulation<B, H> {
    /// Ends what may still hold a database connection (relay tasks, the engine's
    /// transactions, open business transactions, locked claims) inside the simulation's
    /// runtime, where a connection can be handed back.
    fn drop(&mut self) {
        let _context = self.rt.enter();
        for slot in &mut self.relays {
            if let Some(task) = slot.task.take() {
                task.abort();
            }
            slot.held = None;
            slot.relay = None;
        }
        self.engine = None;
        self.open.clear();
        let claims: Vec<_> = self
            .shared
            .claims()
            .values()
            .map(|c| c.handle.clone())
            .collect();
        let backend = self.backend.clone();
        self.rt.block_on(async move {
            for handle in claims {
                backend.abandon(&handle).await;
            }
            tokio::task::yield_now().await;
        });
    }
}

/// The owner name of relay `i`'s `generation`-th process.
fn relay_owner(i: usize, generation: u64) -> String {
    format!("relay-{i}-{generation}")
}

fn retry_policy(config: &SimConfig, base: Duration, max: Duration) -> RetryPolicy {
    RetryPolicy::builder()
        .base(base)
        .max_delay(max)
        .max_attempts(config.max_attempts.max(1))
        .build()
        .expect("valid retry policy")
}

/// The consumer engine's retry policy (the handler double checks the engine against it).
fn engine_retry(config: &SimConfig) -> RetryPolicy {
    retry_policy(config, Duration::from_millis(1), Duration::from_millis(4))
}

/// The consumer's version policy of a case. `Hold` waits a few real milliseconds (the engine
/// reads the real clock) and holds few messages, so both of its bounds are reached.
/// Whether the consumer requires an aggregate it has not seen to start at version 1: on
/// JetStream, where a redelivery comes after later messages, so that a later version first
/// does not become the baseline (the earlier one then skipped as stale). Every transport reads
/// its stream or queue from the beginning here.
fn first_version_required(transport: Transport) -> bool {
    transport == Transport::JetStream
}

fn version_policy(policy: Policy) -> VersionPolicy {
    match policy {
        Policy::Reject => VersionPolicy::Reject,
        Policy::Hold => VersionPolicy::hold(3, Duration::from_millis(20)),
        Policy::Unchecked => VersionPolicy::Unchecked,
    }
}

/// A current-thread runtime with time (the simulation's own).
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

impl Simulation<MemoryBackend, NoEffect> {
    /// A simulation on the in-memory backends with the default command ([`Touch`]) and no
    /// user effect.
    pub fn memory(config: SimConfig, modes: Modes) -> Self {
        let (gap_timeout, bug) = (config.gap_timeout, config.bug);
        Self::new(
            config,
            modes,
            move |_, mode| {
                MemoryBackend::with_gap_timeout(mode, gap_timeout).map_store(|s| {
                    s.seeded_bug_accept_run_holes(bug == Some(SeededBug::StoreAcceptsRunHoles))
                        .seeded_bug_run_skips_gaps(bug == Some(SeededBug::RunSkipsGap))
                })
            },
            NoEffect,
            vec![Box::new(Touch)],
        )
    }
}

impl<B, H> Simulation<B, H>
where
    B: Backend,
    H: Handler<InboxTx<B>> + 'static,
{
    /// A fresh system. `make_backend` builds the backend for the case's claim mode on the
    /// simulation's runtime; `user` is the consumer's handler (run by the real engine through
    /// [`SimHandler`]); `commands` are the producer's commands.
    pub fn new(
        config: SimConfig,
        modes: Modes,
        make_backend: impl FnOnce(&Runtime, ClaimMode) -> B,
        user: H,
        commands: Vec<Box<dyn Command>>,
    ) -> Self {
        let rt = runtime();
        let mode = if modes.lease {
            ClaimMode::Lease {
                duration: config.lease,
            }
        } else {
            ClaimMode::LockedTransaction
        };
        let backend = Arc::new(make_backend(&rt, mode));
        let clock = backend.clock();
        // A JetStream stream and a RabbitMQ queue are one ordered sequence.
        let partitions = match modes.transport {
            Transport::Kafka => config.partitions.max(1),
            Transport::JetStream | Transport::RabbitMq => 1,
        };
        let log = MemoryLog::builder()
            .topic(TOPIC, partitions)
            .default_topic(TOPIC)
            .clock(clock.clone())
            .build();
        let violations = Violations::default();
        let shared = Arc::new(RelayShared::new(
            violations.clone(),
            clock,
            mode,
            config.bug,
            backend.short_claim_check(),
        ));
        let handler_fault = Arc::new(Mutex::new(None));
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let handler = SimHandler::new(
            backend.clone(),
            Arc::new(user),
            handler_fault.clone(),
            config.bug,
            ledger.clone(),
            violations.clone(),
            &engine_retry(&config),
        );
        let parked_api = ParkedMessages::new(
            InboxProcessor::new(GROUP, backend.inbox(), handler.clone())
                .with_version_policy(version_policy(modes.policy))
                .require_first_version(first_version_required(modes.transport)),
        );
        let mut sim = Self {
            modes,
            backend,
            broker: Broker::new(modes.transport, log.clone()),
            log,
            shared,
            violations,
            claim_faults: FaultInjector::new(FaultSource::None).only(&["claim"]),
            complete_faults: FaultInjector::new(FaultSource::None).only(&["complete"]),
            inbox_faults: FaultInjector::new(FaultSource::None).only(&["commit"]),
            handler_fault,
            engine_stall: Arc::default(),
            ledger,
            relays: Vec::new(),
            handler,
            engine: None,
            engine_generation: 0,
            parked_api,
            commands: Arc::new(if commands.is_empty() {
                vec![Box::new(Touch) as Box<dyn Command>]
            } else {
                commands
            }),
            open: Vec::new(),
            gated: BTreeSet::new(),
            model: Model::default(),
            report: SimReport::default(),
            next_id: 0,
            rt,
            config,
        };
        for i in 0..sim.config.relays.max(1) {
            let slot = sim.relay_slot(i, 0);
            sim.relays.push(slot);
        }
        sim.engine = Some(sim.make_engine());
        sim
    }

    /// The backend (for inspection).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The log (for inspection).
    pub fn log(&self) -> &MemoryLog {
        &self.log
    }

    fn relay_slot(&self, i: usize, generation: u64) -> RelaySlot<B> {
        let store = SimStore::new(
            FaultyStore::new(
                FaultyStore::new(self.backend.store(), self.claim_faults.clone()),
                self.complete_faults.clone(),
            ),
            i,
            self.shared.clone(),
        );
        let (publisher, handle) = publisher::pair(self.config.delivery_timeout);
        let cfg = RelayConfig::builder()
            .owner(relay_owner(i, generation))
            .batch_size(self.batch_size())
            .run(self.modes.run.max(1))
            .retry(retry_policy(
                &self.config,
                self.config.relay_retry.0,
                self.config.relay_retry.1,
            ))
            .prefetch(self.modes.prefetch)
            .early_claim(self.modes.early_claim)
            .build()
            .expect("valid relay config");
        let relay = Relay::new(
            store,
            publisher,
            cfg,
            self.backend.clock(),
            Box::new(StdRng::seed_from_u64((i as u64) << 32 | generation)),
        )
        .expect("the lease outlives the delivery timeout");
        RelaySlot {
            relay: Some(relay),
            task: None,
            handle,
            held: None,
            generation,
            last_cycle: None,
        }
    }

    fn make_engine(&mut self) -> Engine<B, H> {
        self.engine_generation += 1;
        self.ledger
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .new_generation();
        let source = SimSource::new(
            TransportSource::new(&self.broker, &self.log, self.config.bug),
            self.config.bug,
        )
        .with_stall(self.engine_stall.clone());
        let inbox = FaultyInbox::new(self.backend.inbox(), self.inbox_faults.clone());
        let processor = InboxProcessor::new(GROUP, inbox, self.handler.clone())
            .with_version_policy(version_policy(self.modes.policy))
            .require_first_version(first_version_required(self.modes.transport));
        let config = EngineConfig::default()
            .with_retry(engine_retry(&self.config))
            .with_commit(2, Duration::from_secs(3600))
            .with_max_batch(3)
            .with_concurrency(2)
            .with_max_in_flight(64)
            .with_poll_timeout(Duration::from_millis(1));
        ConsumerEngine::new(source, processor, config, self.engine_generation)
            .expect("valid engine config")
    }

    fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> Result<T, String> {
        self.rt
            .block_on(async { tokio::time::timeout(STEP_LIMIT, f).await })
            .map_err(|_| format!("a step did not finish within {STEP_LIMIT:?}"))
    }

    /// Applies every step, checking invariants after each, then drains and checks the
    /// quiescent invariants.
    pub fn run(&mut self, steps: &[Step]) -> Result<SimReport, Violation> {
        for (i, s) in steps.iter().enumerate() {
            self.apply(s)
                .and_then(|()| self.check_invariants())
                .map_err(|message| Violation {
                    step: Some(i),
                    message: format!("{message} (step {s:?})"),
                })?;
        }
        self.quiesce().map_err(|message| Violation {
            step: None,
            message,
        })?;
        let records = self.log.all_records();
        let distinct: BTreeSet<EventId> = records
            .iter()
            .filter_map(|r| r.decode().ok())
            .map(|e| e.event_id)
            .collect();
        let effects = self
            .block_on(self.backend.effects())
            .and_then(|r| r)
            .map_err(|message| Violation {
                step: None,
                message,
            })?;
        let mut report = self.report.clone();
        report.steps = steps.len();
        report.committed_events = self.model.committed.len();
        report.log_records = records.len();
        report.duplicates_in_log = records.len() - distinct.len();
        report.applied = effects.counts.len();
        report.parked = self.model.parked_seen.len();
        report.gap_parked = self.model.gap_parked;
        report.out_of_order_parked = self.model.out_of_order_parked;
        report.redelivered = self.broker.redelivered_events().len();
        report.deduplicated_sends = self.broker.deduplicated_sends();
        report.redelivered_behind_later = self.broker.redelivered_behind_later();
        report.taken_by_dead_members = self.broker.taken_by_dead_members();
        if let Some(e) = &self.engine {
            report.engine_duplicates += e.report().duplicates;
            report.consumer_parked += e.report().parked;
        }
        Ok(report)
    }

    /// Applies one step (no invariant check).
    pub fn apply(&mut self, step: &Step) -> Check {
        match step {
            Step::Begin {
                aggregate,
                events,
                command,
            } => self.begin(*aggregate, *events, *command),
            Step::Skew { aggregate, skew } => self.skew(*aggregate, *skew),
            Step::Race { ops, stagger } => self.race(ops, *stagger),
            Step::Overtake {
                relay,
                by,
                answers,
                hold,
            } => self.overtake(
                relay % self.relays.len(),
                by % self.relays.len(),
                answers,
                *hold,
            ),
            Step::Commit(n) => self.commit_open(*n),
            Step::Rollback(n) => {
                if !self.open.is_empty() {
                    let (tx, events) = self.open.remove(n % self.open.len());
                    self.block_on(self.backend.rollback(tx))?;
                    self.model
                        .rolled_back
                        .extend(events.iter().map(|e| e.event_id));
                }
                Ok(())
            }
            Step::Relay(i) => self.relay_step(i % self.relays.len()),
            Step::Answer { relay, answers } => self.answer(relay % self.relays.len(), answers),
            Step::RelayCrash(i) => self.relay_crash(i % self.relays.len()),
            Step::Advance(d) => {
                self.broker.advance(*d);
                self.block_on(self.backend.advance(*d))?
            }
            Step::StoreFault(f) => {
                self.report.faults += 1;
                let (injector, fault) = match f {
                    StoreFault::ClaimFails => (&self.claim_faults, Fault::Transient),
                    StoreFault::CompleteFails => (&self.complete_faults, Fault::Transient),
                    StoreFault::CompleteReplyLost => (&self.complete_faults, Fault::AckLost),
                };
                injector.set_source(FaultSource::script([Some(fault)]));
                Ok(())
            }
            Step::Operator(op, n) => self.operator(*op, *n),
            Step::ReleaseClaims(i) => self.release_claims(i % self.relays.len()),
            Step::Consumer(n) => self.consumer_steps(*n).map(|_| ()),
            Step::ConsumerStalls { before, after } => {
                self.consumer_steps(*before)?;
                self.ack_wait_runs_out()?;
                self.report.consumer_stalls += 1;
                self.consumer_steps(*after).map(|_| ())
            }
            Step::OtherMemberDies(n) => {
                self.broker.member_dies(*n);
                Ok(())
            }
            Step::ConsumerCrash => {
                self.drop_engine();
                self.engine = Some(self.make_engine());
                Ok(())
            }
            Step::Rebalance => {
                // RabbitMQ: the channel is lost under the running engine (its unacked
                // deliveries go back to the queue; the next poll opens a new channel).
                if let Some(engine) = self.engine.as_ref() {
                    let held = self.broker.rabbit_unacked();
                    if engine.source().inner().lose_channel() {
                        self.report.channels_lost += 1;
                        // What the engine held is redelivered on the next channel, and taken
                        // as new deliveries: the handler's failures count again (a running
                        // batch may still fail an old delivery once: see `Ledger`).
                        self.ledger
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .channel_lost(held);
                        return Ok(());
                    }
                }
                // On revoke, a well-behaved member commits what is final, then hands over
                // (JetStream: and gives back what it still holds).
                if let Some(engine) = self.engine.as_mut() {
                    let r = self.rt.block_on(async {
                        tokio::time::timeout(STEP_LIMIT, engine.commit_final()).await
                    });
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(format!("commit on revoke failed: {e}")),
                        Err(_) => return Err("commit on revoke hung".into()),
                    }
                    engine.source().inner().leave();
                }
                self.drop_engine();
                self.engine = Some(self.make_engine());
                Ok(())
            }
            Step::HandlerFault(f) => {
                self.report.faults += 1;
                *self
                    .handler_fault
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(*f);
                Ok(())
            }
            Step::InboxCommitFault { lost_reply } => {
                self.report.faults += 1;
                let f = if *lost_reply {
                    Fault::AckLost
                } else {
                    Fault::Transient
                };
                self.inbox_faults.set_source(FaultSource::script([Some(f)]));
                Ok(())
            }
            Step::InboxDown => {
                self.report.faults += 1;
                self.inbox_faults.set_source(FaultSource::Countdown {
                    pass: 0,
                    fault: Fault::Transient,
                    repeat: true,
                });
                Ok(())
            }
            Step::InboxUp => {
                self.inbox_faults.set_source(FaultSource::None);
                Ok(())
            }
            Step::EngineThreadStalls(d) => {
                *self
                    .engine_stall
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(*d);
                Ok(())
            }
            Step::ConsumerOperator(n) => self.consumer_operator(*n).map(|_| ()),
            Step::Cleanup => {
                let store = self.backend.store();
                let rep = self
                    .block_on(store.cleanup(Duration::ZERO, 2))?
                    .map_err(|e| format!("cleanup failed: {e}"))?;
                self.report.cleaned += rep.removed;
                Ok(())
            }
        }
    }

    /// Virtual time passes beyond the JetStream ack wait (by `ACK_WAIT` + 1 s).
    fn ack_wait_runs_out(&mut self) -> Check {
        let d = crate::transport::ACK_WAIT + Duration::from_secs(1);
        self.broker.advance(d);
        self.block_on(self.backend.advance(d))?
    }

    // ---- producer ----

    fn begin(&mut self, aggregate: usize, events: usize, command: usize) -> Check {
        let agg = format!("agg-{}", aggregate % self.config.aggregates.max(1));
        let backend = self.backend.clone();
        let mut tx = self.block_on(backend.begin())??;
        let Some((mut version, mut state)) = self.block_on(backend.aggregate(&mut tx, &agg))??
        else {
            self.report.conflicts += 1;
            self.block_on(backend.rollback(tx))?;
            return Ok(());
        };
        let now = backend.clock().now();
        let mut batch = Vec::new();
        for k in 0..events {
            let cmd = &self.commands[(command + k) % self.commands.len()];
            if !cmd.guard(&state) {
                continue;
            }
            let t = cmd.apply(&state);
            version += 1;
            self.next_id += 1;
            let e = Envelope::builder("sim", &agg, version, &t.event_type)
                .event_id(outbox_testkit::deterministic_event_id(now, self.next_id))
                .created_at(now)
                .json(&t.payload)
                .map_err(|e| format!("command {}: {e}", cmd.name()))?
                .build()
                .map_err(|e| format!("command {}: {e}", cmd.name()))?;
            batch.push(e);
            state = t.state;
        }
        if batch.is_empty() {
            self.block_on(backend.rollback(tx))?;
            return Ok(());
        }
        self.block_on(backend.set_aggregate(&mut tx, &agg, version, state))??;
        let armed = backend.wake_gate_armed();
        self.block_on(backend.append(&mut tx, &batch))?
            .map_err(|e| format!("append failed: {e}"))?;
        self.note_gate(armed, &batch);
        self.open.push((tx, batch));
        Ok(())
    }

    /// A business transaction that appends one event out of its aggregate's order.
    fn skew(&mut self, aggregate: usize, skew: Skew) -> Check {
        let agg = format!("agg-{}", aggregate % self.config.aggregates.max(1));
        let backend = self.backend.clone();
        let mut tx = self.block_on(backend.begin())??;
        let Some((version, state)) = self.block_on(backend.aggregate(&mut tx, &agg))?? else {
            self.report.conflicts += 1;
            self.block_on(backend.rollback(tx))?;
            return Ok(());
        };
        let v = match skew {
            Skew::Gap(n) => version + 1 + n.max(1),
            Skew::Fill => match self.model.lowest_hole(&agg) {
                Some(h) => h,
                None => version + 1,
            },
            Skew::Lower(n) => version - n,
        };
        if v < 1 {
            self.block_on(backend.rollback(tx))?;
            return Ok(());
        }
        if v > version {
            self.block_on(backend.set_aggregate(&mut tx, &agg, v, state))??;
        }
        let now = backend.clock().now();
        self.next_id += 1;
        let e = Envelope::builder("sim", &agg, v, "sim.skewed")
            .event_id(outbox_testkit::deterministic_event_id(now, self.next_id))
            .created_at(now)
            .json(&serde_json::json!({ "skew": format!("{skew:?}") }))
            .map_err(|e| e.to_string())?
            .build()
            .map_err(|e| e.to_string())?;
        self.report.skewed += 1;
        let armed = backend.wake_gate_armed();
        self.block_on(backend.append(&mut tx, std::slice::from_ref(&e)))?
            .map_err(|e| format!("append failed: {e}"))?;
        self.note_gate(armed, std::slice::from_ref(&e));
        self.open.push((tx, vec![e]));
        Ok(())
    }

    /// Remembers `events` when the wake-up gate was armed before their append (`armed`) and
    /// still is: an idle relay waited for them all along.
    fn note_gate(&mut self, armed: Option<bool>, events: &[Envelope]) {
        if armed == Some(true) && self.backend.wake_gate_armed() == Some(true) {
            self.gated.extend(events.iter().map(|e| e.event_id));
        }
    }

    fn commit_open(&mut self, n: usize) -> Check {
        if self.open.is_empty() {
            return Ok(());
        }
        let (tx, events) = self.open.remove(n % self.open.len());
        let gated: Vec<EventId> = events
            .iter()
            .map(|e| e.event_id)
            .filter(|id| self.gated.remove(id))
            .collect();
        if !gated.is_empty() {
            self.block_on(self.backend.clear_wake_ups())?;
        }
        if self.block_on(self.backend.commit(tx))?? {
            // The gate's promise: an event appended while a relay was idle and waiting wakes
            // it (else it sleeps until its idle poll: a lost wake-up).
            if !gated.is_empty() {
                self.report.wake_ups += 1;
                ensure(self.block_on(self.backend.wake_up(WAKE_BOUND))?, || {
                    format!(
                        "lost wake-up: {gated:?} committed while the wake-up gate was armed \
                         (a relay idle and waiting), and no wake-up reached the listener \
                         within {WAKE_BOUND:?}"
                    )
                })?;
            }
            let now = self.backend.clock().now();
            for e in events {
                self.model.committed_at.insert(e.event_id, now);
                self.model.committed.insert(e.event_id, e);
            }
        } else {
            self.report.conflicts += 1;
            self.model
                .rolled_back
                .extend(events.iter().map(|e| e.event_id));
        }
        Ok(())
    }

    fn operator(&mut self, op: OperatorStep, n: usize) -> Check {
        let store = self.backend.store();
        let parked = self
            .block_on(store.list_parked(100))?
            .map_err(|e| format!("list_parked failed: {e}"))?;
        if parked.is_empty() {
            return Ok(());
        }
        let id = parked[n % parked.len()].envelope.event_id;
        self.report.operator_actions += 1;
        let before = self.scope_snapshot()?;
        // The store refuses (a conflict) to accept or drop a version while lower ones of its
        // aggregate still wait, and to retry or re-issue one at or below the last published:
        // a refusal changes nothing.
        let task = self.spawn_operator(op, id);
        let (result, relays_moved) = self.await_operator(task)?;
        let action = match result {
            Ok(new_id) => {
                self.operator_done(op, id, new_id);
                operator_scope::Action::Parked {
                    op,
                    event: id,
                    copy: new_id,
                }
            }
            Err(e) if e.kind == StoreErrorKind::Conflict => {
                self.report.operator_refused += 1;
                operator_scope::Action::Refused(format!("{op:?} of {id}"))
            }
            Err(e) => return Err(format!("{op:?} of {id} failed: {e}")),
        };
        // The relays had to finish what they held for the action to get its lock: they
        // changed other aggregates meanwhile, and the comparison would blame the operator.
        if !relays_moved {
            self.check_scope(before, &action)?;
        }
        if matches!(action, operator_scope::Action::Refused(_)) {
            return Ok(());
        }
        let trail = self
            .block_on(store.audit_trail(Some(id)))?
            .map_err(|e| e.to_string())?;
        ensure(!trail.is_empty(), || {
            format!("operator action on {id} not audited")
        })
    }

    /// [`Step::ReleaseClaims`]: relay `i` dies, and the operator releases its owner's claims.
    fn release_claims(&mut self, i: usize) -> Check {
        let owner = relay_owner(i, self.relays[i].generation);
        self.relay_crash(i)?;
        let before = self.scope_snapshot()?;
        let store = self.backend.store();
        let released = self
            .block_on(store.release_claims_of(&owner, "sim-operator"))?
            .map_err(|e| format!("releasing the claims of {owner} failed: {e}"))?;
        // The leases are over: no longer the relay's (which is gone), nor anybody's.
        self.shared.forget_owner(&owner);
        self.report.claim_releases += 1;
        self.report.claims_released += released;
        self.check_scope(before, &operator_scope::Action::ReleaseClaims { owner })
    }

    /// The store's whole delivery state, read once the relays' store calls under way (a
    /// prefetch claim beside a held batch) have ended, so that nothing but the operator
    /// writes until the next read. `None`: the backend cannot read it, or a call did not end.
    fn scope_snapshot(&mut self) -> Result<Option<DeliverySnapshot>, String> {
        if !self.calls_settled()? {
            return Ok(None);
        }
        self.block_on(self.backend.delivery_snapshot())?
    }

    /// Waits (up to 2 s) until no store call of a relay is under way: a prefetch claim that a
    /// cycle started beside the batch the double now holds runs on in the background. `false`:
    /// a call did not end in time (one waiting on a lock, say).
    fn calls_settled(&self) -> Result<bool, String> {
        let shared = self.shared.clone();
        self.block_on(async move {
            for _ in 0..400 {
                if shared.calls_in_flight() == 0 {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            false
        })
    }

    /// Checks the operator-action invariant for `action`, taken since `before` was read.
    fn check_scope(
        &mut self,
        before: Option<DeliverySnapshot>,
        action: &operator_scope::Action,
    ) -> Check {
        let Some(before) = before else {
            return Ok(());
        };
        let Some(after) = self.block_on(self.backend.delivery_snapshot())?? else {
            return Ok(());
        };
        self.report.operator_scope_checked += 1;
        operator_scope::check(action, &before, &after)
    }

    /// Starts an operator action on the outbox as a task of its own.
    fn spawn_operator(&self, op: OperatorStep, id: EventId) -> OpTask {
        let store = self.backend.store();
        self.rt.spawn(async move {
            match op {
                OperatorStep::Retry => store.retry_parked(id, "sim-operator").await.map(|()| None),
                OperatorStep::Discard => store
                    .discard_parked(id, "sim-operator", "simulated")
                    .await
                    .map(|()| None),
                OperatorStep::Reissue => store
                    .reissue_parked(id, "sim-operator", "simulated")
                    .await
                    .map(Some),
            }
        })
    }

    /// Waits for an operator action. One that waits for its aggregate's lock (a locked claim
    /// of a relay holds it, as a re-appended version parked out of order can share its
    /// aggregate with a claimed head) waits as it does in production: until the relays finish
    /// what they hold (their batches acknowledged, what they claimed ahead published).
    /// Returns the action's result, and whether the relays were moved meanwhile.
    fn await_operator(
        &mut self,
        mut task: OpTask,
    ) -> Result<(Result<Option<EventId>, StoreError>, bool), String> {
        let mut relays_moved = false;
        for round in 0..40 {
            let waited = self.rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(300), &mut task).await
            });
            if let Ok(joined) = waited {
                return joined
                    .map(|r| (r, relays_moved))
                    .map_err(|e| format!("operator task panicked: {e}"));
            }
            let mut moved = false;
            for i in 0..self.relays.len() {
                if self.relays[i].held.is_some() {
                    self.answer(i, &[RecordAnswer::Ack])?;
                    moved = true;
                } else if self.relays[i].task.is_some() || self.has_prefetched(i) {
                    self.relay_step(i)?;
                    moved = true;
                }
            }
            relays_moved |= moved;
            if !moved && round >= 5 {
                break;
            }
        }
        task.abort();
        Err("an operator action hung with no relay holding work".into())
    }

    fn operator_done(&mut self, op: OperatorStep, id: EventId, new_id: Option<EventId>) {
        match op {
            OperatorStep::Retry => self.model.retry(id),
            OperatorStep::Discard => {
                self.model.discarded.insert(id);
            }
            OperatorStep::Reissue => {
                self.model.discarded.insert(id);
                if let Some(n) = new_id {
                    self.model.reissued.insert(n, id);
                }
            }
        }
    }

    // ---- relays ----

    fn relay_step(&mut self, i: usize) -> Check {
        if self.relays[i].held.is_some() {
            return Ok(()); // the batch waits for the broker's answer
        }
        if self.relays[i].task.is_none() {
            let mut relay = self.relays[i].relay.take().ok_or("relay missing")?;
            let task = self.rt.spawn(async move {
                let r = relay.run_once().await;
                (relay, r)
            });
            self.relays[i].task = Some(task);
        }
        self.wait_relay(i)
    }

    /// Runs relay `i`'s cycle until the double holds its batch or the cycle ends.
    fn wait_relay(&mut self, i: usize) -> Check {
        self.wait_relay_or_blocked(i, None).map(|_| ())
    }

    /// As [`Self::wait_relay`], and with `hold`, also returns (`true`) as soon as a session
    /// waits on the hold (the cycle's claim, stopped mid-transaction).
    fn wait_relay_or_blocked(
        &mut self,
        i: usize,
        hold: Option<&mut dyn Hold>,
    ) -> Result<bool, String> {
        let rt = &self.rt;
        let slot = &mut self.relays[i];
        let Some(task) = slot.task.as_mut() else {
            return Ok(false);
        };
        let handle = &mut slot.handle;
        let waited: Waited<B> = rt
            .block_on(async {
                tokio::time::timeout(STEP_LIMIT, async {
                    let blocked = async {
                        let Some(hold) = hold else {
                            return std::future::pending().await;
                        };
                        loop {
                            match hold.waiting().await {
                                Ok(n) if n > 0 => return Ok(()),
                                Ok(_) => tokio::time::sleep(LOCK_POLL).await,
                                Err(e) => return Err(e),
                            }
                        }
                    };
                    tokio::select! {
                        b = handle.next_batch() => Ok(Waited::Held(b)),
                        r = task => Ok(Waited::Done(Box::new(r))),
                        w = blocked => w.map(|()| Waited::Blocked),
                    }
                })
                .await
            })
            .map_err(|_| format!("relay {i} hung"))??;
        match waited {
            Waited::Blocked => Ok(true),
            Waited::Done(done) => match *done {
                Err(e) => Err(format!("relay {i}'s cycle panicked: {e}")),
                Ok((relay, result)) => {
                    let slot = &mut self.relays[i];
                    slot.task = None;
                    slot.relay = Some(relay);
                    self.settle(i, result).map(|()| false)
                }
            },
            Waited::Held(None) => Err(format!("relay {i}'s publisher went away")),
            Waited::Held(Some(mut batch)) => {
                if self.config.has(SeededBug::SkipHead) {
                    self.skip_heads(&mut batch.records)?;
                }
                self.report.run_sends += self.check_send(i, &batch.records)?;
                self.relays[i].held = Some(batch);
                Ok(false)
            }
        }
    }

    /// [`Step::Overtake`]: relay `a`'s lease expires while the double holds its batch; relay
    /// `b` claims until it takes one of `a`'s aggregates (with `hold`, its claim is stopped
    /// mid-transaction on the server); then `a`'s batch is answered and its completion runs.
    fn overtake(&mut self, a: usize, b: usize, answers: &[RecordAnswer], hold: bool) -> Check {
        if a == b || !self.shared.is_lease() {
            return Ok(());
        }
        let Some(held) = self.relays[a].held.as_ref() else {
            return Ok(());
        };
        let head = held.records[0].event_id;
        let aggregates: BTreeSet<String> = held
            .records
            .iter()
            .map(|e| e.aggregate_id.clone())
            .collect();
        // A prefetch claim `a` started beside the held batch ends first: run after the expiry,
        // it would take `a`'s expired aggregates back for `a` itself, and `b` would find none.
        self.calls_settled()?;
        self.block_on(
            self.backend
                .advance(self.config.lease + Duration::from_secs(1)),
        )??;
        for _ in 0..4 {
            // Relay `b` ends what it holds, then starts a cycle: its claim.
            if self.relays[b].held.is_some() {
                self.answer(b, &[RecordAnswer::Ack])?;
            }
            if self.relays[b].held.is_some() || self.relays[b].task.is_some() {
                break;
            }
            let mut holder = if hold {
                self.block_on(self.backend.hold_head(head))??
            } else {
                None
            };
            let mut relay = self.relays[b].relay.take().ok_or("relay missing")?;
            self.relays[b].task = Some(self.rt.spawn(async move {
                let r = relay.run_once().await;
                (relay, r)
            }));
            let blocked = match holder.as_mut() {
                Some(h) => self.wait_relay_or_blocked(b, Some(h.as_mut())),
                None => self.wait_relay(b).map(|()| false),
            };
            if let Ok(true) = blocked {
                let h = holder.take().ok_or("hold missing")?;
                self.report.overtaken += 1;
                self.report.overtaken_mid_claim += 1;
                return self.late_answer_mid_claim(a, b, answers, h);
            }
            if let Some(h) = holder.take() {
                self.block_on(h.release())??;
            }
            blocked?;
            let took = self.relays[b].held.as_ref().is_some_and(|h| {
                h.records
                    .iter()
                    .any(|e| aggregates.contains(&e.aggregate_id))
            });
            if took {
                self.report.overtaken += 1;
                break;
            }
            if self.relays[b].held.is_none() {
                break; // nothing (more) to claim
            }
        }
        self.answer(a, answers)
    }

    /// Answers relay `a`'s batch while another relay's claim waits on `hold`; lets the hold go
    /// once `a`'s completion waits too (or ended), then runs both cycles on.
    fn late_answer_mid_claim(
        &mut self,
        a: usize,
        b: usize,
        answers: &[RecordAnswer],
        mut hold: Box<dyn Hold>,
    ) -> Check {
        let answered = self.relays[a].held.take().map(|batch| {
            self.broker_answers(a, &batch, answers)
                .map(|results| batch.answer(results))
        });
        if let Some(Err(e)) = answered {
            self.block_on(hold.release())??;
            return Err(e);
        }
        let task = self.relays[a].task.as_ref();
        let waited = self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + LOCK_WAIT;
            while tokio::time::Instant::now() < deadline
                && !task.is_some_and(JoinHandle::is_finished)
            {
                match hold.waiting().await {
                    Ok(n) if n >= 2 => break,
                    Ok(_) => tokio::time::sleep(LOCK_POLL).await,
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        });
        self.block_on(hold.release())??;
        waited?;
        // The completion first, so that the claim's send is judged with it known.
        self.wait_relay(a)?;
        self.wait_relay(b)
    }

    /// The seeded bug: the next version of an aggregate goes out instead of the claimed head.
    fn skip_heads(&self, records: &mut [Envelope]) -> Check {
        let rows = self.block_on(self.backend.rows())??;
        for e in records.iter_mut() {
            let next = rows.iter().find(|r| {
                r.status == DeliveryStatus::Pending
                    && r.aggregate_id == e.aggregate_id
                    && r.version == e.aggregate_version + 1
            });
            if let Some(env) = next.and_then(|r| self.model.committed.get(&r.event_id)) {
                *e = env.clone();
            }
        }
        Ok(())
    }

    /// At send time: every record is held by a live claim of its sender, and is its
    /// aggregate's head, or follows it in a run after the acknowledgements of the versions
    /// before it (send order). Returns how many records went out inside a run.
    fn check_send(&self, i: usize, records: &[Envelope]) -> Result<usize, String> {
        let mine = self.shared.claims_of(i);
        for e in records {
            ensure(
                mine.iter().any(|c| {
                    self.shared.live(c) && c.events.iter().any(|(id, _)| *id == e.event_id)
                }),
                || format!("relay {i} sent {} without a live claim on it", e.event_id),
            )?;
        }
        let rows = self.block_on(self.backend.rows())??;
        // A version past the next one goes out only inside a run: after the acknowledgement
        // of every version before it came back to this relay under the claim that holds it.
        let acked_before = |e: &Envelope, version: i64| {
            mine.iter()
                .filter(|c| self.shared.live(c))
                .filter(|c| c.events.iter().any(|(id, _)| *id == e.event_id))
                .any(|c| {
                    self.shared
                        .acked_in(c.handle.token, &e.aggregate_id, version)
                })
        };
        invariants::check_send_order(&self.model, &rows, records, acked_before)
    }

    fn answer(&mut self, i: usize, answers: &[RecordAnswer]) -> Check {
        let Some(batch) = self.relays[i].held.take() else {
            return Ok(());
        };
        let results = self.broker_answers(i, &batch, answers)?;
        batch.answer(results);
        self.wait_relay(i)
    }

    /// The broker's answers to `batch`, record `k` answered with `answers[k % len]` (the
    /// records stored in the log as they are answered).
    fn broker_answers(
        &mut self,
        relay: usize,
        batch: &HeldBatch,
        answers: &[RecordAnswer],
    ) -> Result<Vec<PublishResult>, String> {
        let mine = self.shared.claims_of(relay);
        let mut results: Vec<PublishResult> = Vec::with_capacity(batch.records.len());
        let (mut acked, mut failed) = (0, 0);
        for (k, e) in batch.records.iter().enumerate() {
            let a = answers
                .get(k % answers.len().max(1))
                .copied()
                .unwrap_or(RecordAnswer::Ack);
            let stored = matches!(a, RecordAnswer::Ack | RecordAnswer::AckLost);
            let ack: Option<PublishResult> = if stored {
                Some(self.block_on(self.broker.publish(e))??)
            } else {
                None
            };
            if matches!(a, RecordAnswer::Transient | RecordAnswer::Permanent) {
                // A record-scoped failure: the only kind that may spend an attempt.
                *self.model.record_failures.entry(e.event_id).or_default() += 1;
            }
            let result = match a {
                RecordAnswer::Ack => ack.ok_or("no ack")?,
                RecordAnswer::AckLost => Err(PublishError::new(
                    PublishErrorKind::Timeout,
                    "scripted: stored, acknowledgement lost",
                )),
                RecordAnswer::Transient => Err(PublishError::new(
                    PublishErrorKind::Other,
                    "scripted: transient failure of the record",
                )),
                RecordAnswer::Transport => Err(PublishError::new(
                    PublishErrorKind::BrokerUnavailable,
                    "scripted: broker unavailable",
                )),
                RecordAnswer::Permanent => Err(PublishError::new(
                    PublishErrorKind::RecordTooLarge,
                    "scripted: permanent failure",
                )),
            };
            if result.is_ok() {
                acked += 1;
                // The acknowledgement goes back to the relay, under the claim it sent it in:
                // the one record after it in a run may go out now (send order).
                if let Some(c) = mine
                    .iter()
                    .find(|c| c.events.iter().any(|(id, _)| *id == e.event_id))
                {
                    self.shared
                        .note_acked(c.handle.token, &e.aggregate_id, e.aggregate_version);
                }
            } else {
                failed += 1;
            }
            results.push(result);
        }
        if acked > 0 && failed > 0 {
            self.report.mixed_batches += 1;
        }
        Ok(results)
    }

    /// Runs `ops` at once: relays' claims and completions are their cycles' tasks, operator
    /// actions tasks of their own, all on the simulation's runtime, so their statements
    /// interleave on the server. They start in the order given, `stagger` apart (0: all
    /// before any runs, 1: one scheduler turn, 2: a millisecond, 3: five). The operator
    /// actions are awaited first, so that the sends checked afterwards are judged with their
    /// outcome known.
    fn race(&mut self, ops: &[RaceOp], stagger: u8) -> Check {
        let store = self.backend.store();
        let parked = self
            .block_on(store.list_parked(100))?
            .map_err(|e| format!("list_parked failed: {e}"))?;
        let mut relays: Vec<usize> = Vec::new();
        let mut operators: Vec<(OperatorStep, EventId, OpTask)> = Vec::new();
        for (k, op) in ops.iter().enumerate() {
            if k > 0 {
                match stagger % 4 {
                    0 => {}
                    1 => self.block_on(tokio::task::yield_now())?,
                    2 => {
                        self.block_on(async { tokio::time::sleep(Duration::from_millis(1)).await })?
                    }
                    _ => {
                        self.block_on(async { tokio::time::sleep(Duration::from_millis(5)).await })?
                    }
                }
            }
            match op {
                RaceOp::Claim(i) => {
                    let i = i % self.relays.len();
                    let slot = &mut self.relays[i];
                    if slot.held.is_some() || slot.task.is_some() {
                        continue;
                    }
                    let Some(mut relay) = slot.relay.take() else {
                        continue;
                    };
                    slot.task = Some(self.rt.spawn(async move {
                        let r = relay.run_once().await;
                        (relay, r)
                    }));
                    relays.push(i);
                }
                RaceOp::Answer { relay, answers } => {
                    let i = relay % self.relays.len();
                    let Some(batch) = self.relays[i].held.take() else {
                        continue;
                    };
                    let results = self.broker_answers(i, &batch, answers)?;
                    batch.answer(results);
                    relays.push(i);
                }
                RaceOp::Operator(op, n) => {
                    if parked.is_empty() {
                        continue;
                    }
                    let id = parked[n % parked.len()].envelope.event_id;
                    if operators.iter().any(|(_, other, _)| *other == id) {
                        continue;
                    }
                    let op = *op;
                    let task = self.spawn_operator(op, id);
                    operators.push((op, id, task));
                }
            }
        }
        if relays.len() + operators.len() > 1 {
            self.report.races += 1;
        }
        for (op, id, task) in operators {
            self.report.operator_actions += 1;
            match self.await_operator(task)?.0 {
                Ok(new_id) => self.operator_done(op, id, new_id),
                // Refused (lower versions wait, out of order), or the event is no longer
                // parked (another action of the race took it).
                Err(e) if matches!(e.kind, StoreErrorKind::Conflict | StoreErrorKind::NotFound) => {
                    self.report.operator_refused += 1;
                }
                Err(e) => return Err(format!("{op:?} of {id} failed: {e}")),
            }
        }
        relays.sort_unstable();
        relays.dedup();
        for i in relays {
            self.wait_relay(i)?;
        }
        Ok(())
    }

    /// The relays' batch size: a case with runs claims room for one (the heads come first).
    fn batch_size(&self) -> usize {
        self.config.batch_size.max(1) + self.modes.run.max(1) - 1
    }

    fn settle(&mut self, i: usize, result: Result<CycleReport, StoreError>) -> Check {
        let prefetched = self.relays[i]
            .relay
            .as_ref()
            .and_then(|r| r.prefetched())
            .map(|b| b.handle.token);
        match result {
            Ok(report) => {
                self.report.superseded += report.superseded;
                if prefetched.is_some() {
                    self.report.prefetches += 1;
                    if report.claimed < self.batch_size() {
                        self.report.early_claims += 1;
                    }
                }
                self.relays[i].last_cycle = Some(report);
                Ok(())
            }
            Err(e) => {
                ensure(e.kind == StoreErrorKind::Connection, || {
                    format!("relay {i}'s cycle failed: {e}")
                })?;
                self.relays[i].last_cycle = None;
                // The connection failed: a locked claim's transaction rolled back; a lease
                // stays until it expires.
                for c in self.shared.claims_of(i) {
                    if Some(c.handle.token) != prefetched {
                        self.orphan(c.handle.clone())?;
                    }
                }
                Ok(())
            }
        }
    }

    fn orphan(&self, handle: outbox_core::ClaimHandle) -> Check {
        self.block_on(self.backend.abandon(&handle))?;
        let mut claims = self.shared.claims();
        if self.shared.is_lease() {
            if let Some(c) = claims.get_mut(&handle.token) {
                c.relay = usize::MAX; // nobody's, until it expires
            }
        } else {
            claims.remove(&handle.token);
        }
        Ok(())
    }

    fn relay_crash(&mut self, i: usize) -> Check {
        if let Some(task) = self.relays[i].task.take() {
            task.abort();
            let _ = self.rt.block_on(task);
        }
        self.relays[i].held = None;
        let claims = self.shared.claims_of(i);
        if !claims.is_empty() {
            self.report.relay_crashes_holding_work += 1;
        }
        if claims.iter().any(|c| self.shared.mid_run(c.handle.token)) {
            self.report.relay_crashes_mid_run += 1;
        }
        for c in claims {
            self.orphan(c.handle)?;
        }
        let generation = self.relays[i].generation + 1;
        self.relays[i] = self.relay_slot(i, generation);
        Ok(())
    }

    // ---- consumer ----

    fn drop_engine(&mut self) {
        // Its running transactions hand their connections back as they are dropped.
        let _context = self.rt.enter();
        if let Some(e) = self.engine.take() {
            if e.in_flight() > 0 {
                self.report.consumer_crashes_with_work += 1;
            }
            self.report.engine_duplicates += e.report().duplicates;
            self.report.consumer_parked += e.report().parked;
        }
    }

    /// Runs `n` engine steps; returns how many made progress.
    fn consumer_steps(&mut self, n: usize) -> Result<usize, String> {
        let rt = &self.rt;
        let Some(engine) = self.engine.as_mut() else {
            return Ok(0);
        };
        let mut progressed = 0;
        for _ in 0..n {
            let r = rt
                .block_on(async { tokio::time::timeout(STEP_LIMIT, engine.step()).await })
                .map_err(|_| "the consumer engine hung".to_owned())?;
            match r {
                Ok(true) => progressed += 1,
                Ok(false) => {}
                Err(e) => return Err(format!("the consumer engine failed: {e}")),
            }
        }
        Ok(progressed)
    }

    /// Retries the `n`-th open parked head of the consumer; whether there was one.
    fn consumer_operator(&mut self, n: usize) -> Result<bool, String> {
        let open = self
            .block_on(self.parked_api.list(&ParkedFilter::default()))?
            .map_err(|e| format!("listing parked messages failed: {e}"))?;
        let coming = self.still_coming(&open)?;
        let heads: Vec<_> = open
            .into_iter()
            .filter(|m| m.status == ParkedStatus::Parked)
            .filter(|m| {
                let head = (m.record.aggregate.as_ref(), m.record.aggregate_version);
                !matches!(head, (Some(a), Some(v)) if coming.iter().any(|(b, u)| *b == a.aggregate_id && *u < v))
            })
            .collect();
        // An aggregate can have two parked heads: a retry of its head releases its open
        // messages in version order, and a lower version that came later (a JetStream
        // redelivery, parked waiting behind the head) fails there on its own gap and becomes
        // a head too. The operator retries the lowest one (whose gap the retry accepts);
        // retrying the higher one again would fail on the lower one every time.
        let lowest = |m: &outbox_core::ParkedMessage| {
            let (Some(a), Some(v)) = (m.record.aggregate.as_ref(), m.record.aggregate_version)
            else {
                return true;
            };
            !heads.iter().any(|o| {
                o.record.aggregate.as_ref() == Some(a)
                    && o.record.aggregate_version.is_some_and(|u| u < v)
            })
        };
        let heads: Vec<_> = heads.iter().filter(|m| lowest(m)).collect();
        if heads.is_empty() {
            return Ok(false);
        }
        let id = heads[n % heads.len()].id;
        let lock = |on: bool| {
            self.ledger
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .set_operator(on);
        };
        lock(true);
        let r = self.block_on(self.parked_api.retry(id, "sim-operator", "simulated"));
        lock(false);
        match r? {
            Ok(_) => Ok(true),
            Err(outbox_inbox::OperatorError::Store(e)) if e.is_transient() => Ok(true),
            Err(e) => Err(format!("retrying parked message {id} failed: {e}")),
        }
    }

    /// JetStream: the versions, per aggregate, that were committed (and not discarded) but
    /// are neither applied nor parked on the consumer side: a redelivery still brings them.
    /// The simulation's operator does not accept a version gap below such a version (a
    /// careful operator waits for it; accepting the gap would make it stale). Empty on the
    /// other transports, which deliver an aggregate's versions in order.
    fn still_coming(
        &self,
        open: &[outbox_core::ParkedMessage],
    ) -> Result<Vec<(String, i64)>, String> {
        if self.broker.transport() != Transport::JetStream {
            return Ok(Vec::new());
        }
        let effects = self.block_on(self.backend.effects())??;
        let parked: BTreeSet<EventId> = open.iter().filter_map(|m| m.record.event_id).collect();
        Ok(self
            .model
            .expected()
            .into_iter()
            .filter(|id| {
                let d = self.model.dedup(*id);
                !effects.counts.contains_key(&d) && !parked.contains(id) && !parked.contains(&d)
            })
            .filter_map(|id| self.model.committed.get(&self.model.dedup(id)))
            .map(|e| (e.aggregate_id.clone(), e.aggregate_version))
            .collect())
    }

    // ---- invariants ----

    fn observe(&self) -> Result<Observed, String> {
        let rows = self.block_on(self.backend.rows())??;
        let effects = self.block_on(self.backend.effects())??;
        let registered = self.block_on(self.backend.registered(GROUP))??;
        let mut filter = ParkedFilter::default();
        filter.open_only = false;
        filter.limit = 100_000;
        let parked = self
            .block_on(self.parked_api.list(&filter))?
            .map_err(|e| format!("listing parked messages failed: {e}"))?;
        // A message the engine parked because its handler failed must have failed enough.
        {
            let ledger = self.ledger.lock().unwrap_or_else(PoisonError::into_inner);
            for m in &parked {
                let by_handler = m.kind == Some(outbox_core::ParkKind::Unprocessable)
                    && m.reason.starts_with("handler failed");
                if let (true, Some(id)) = (by_handler, m.record.event_id) {
                    if !ledger.may_park(&id) {
                        return Err(format!(
                            "event {id} was parked on the consumer side ({}) without a \
                             permanent handler failure or max_attempts ({}) transient ones \
                             in one engine generation",
                            m.reason, self.config.max_attempts
                        ));
                    }
                }
            }
        }
        // A version gap parked on the consumer side is real: a lower version of its aggregate
        // was never committed, or was discarded (the outbox publishes the rest in order), or
        // (JetStream) was delivered before it, to a member that did not acknowledge it, and
        // comes again after it.
        let first_delivered = self.broker.first_deliveries();
        for m in &parked {
            if m.kind != Some(outbox_core::ParkKind::VersionGap) {
                continue;
            }
            let (Some(agg), Some(v)) = (&m.record.aggregate, m.record.aggregate_version) else {
                continue;
            };
            let present: BTreeSet<i64> = self
                .model
                .expected()
                .iter()
                .filter_map(|id| self.model.committed.get(&self.model.dedup(*id)))
                .filter(|e| e.aggregate_id == agg.aggregate_id)
                .map(|e| e.aggregate_version)
                .collect();
            let overtaken = first_delivered.iter().any(|(id, first)| {
                *first < m.record.position.offset
                    && self
                        .model
                        .committed
                        .get(&self.model.dedup(*id))
                        .is_some_and(|e| {
                            e.aggregate_id == agg.aggregate_id && e.aggregate_version < v
                        })
            });
            ensure(overtaken || (1..v).any(|u| !present.contains(&u)), || {
                format!(
                    "{} v{v} was parked on the consumer side as a version gap although \
                     versions 1..{v} of its aggregate were all committed and not discarded",
                    agg.aggregate_id
                )
            })?;
        }
        // Open consumer-side parking (head or waiting behind it), per aggregate.
        let consumer_open = parked
            .iter()
            .filter(|m| matches!(m.status, ParkedStatus::Parked | ParkedStatus::Waiting))
            .filter_map(|m| {
                let agg = m.record.aggregate.as_ref()?;
                Some((
                    agg.aggregate_id.clone(),
                    m.record.aggregate_version?,
                    m.record.event_id,
                ))
            })
            .collect();
        let parked_events = parked.iter().filter_map(|m| m.record.event_id).collect();
        let consumer_parked = parked.into_iter().map(|m| m.record.position).collect();
        let transport = self.broker.transport();
        let offsets = match transport {
            Transport::Kafka => (0..self.config.partitions.max(1) as i32)
                .map(|p| (p, self.log.committed(GROUP, TOPIC, p).unwrap_or(0)))
                .collect(),
            _ => Vec::new(),
        };
        let acked = match transport {
            Transport::Kafka => Vec::new(),
            _ => self.broker.acked_records(),
        };
        Ok(Observed {
            rows,
            records: self.log.all_records(),
            effects,
            registered,
            consumer_parked,
            consumer_open,
            offsets,
            acked,
            parked_events,
            // Across a JetStream redelivery, only a policy that keeps versions keeps an
            // aggregate's order (`Unchecked` applies what comes, as it comes).
            order_promised: !(transport == Transport::JetStream
                && self.modes.policy == Policy::Unchecked),
            now: self.backend.clock().now(),
            gap_timeout: self.backend.gap_timeout(),
        })
    }

    /// Checks the invariants that hold after every step.
    pub fn check_invariants(&mut self) -> Check {
        if let Some(v) = self.violations.first() {
            return Err(v);
        }
        let seen = self.observe()?;
        invariants::check(&mut self.model, &self.log, &seen)?;
        invariants::check_run_prefix(&seen.rows, &self.shared.run_predecessors())?;
        self.positions_grow()
    }

    /// The positions a source hands the engine grow with every delivery within an
    /// assignment (the `MessageSource` contract; JetStream's delivery sequence, RabbitMQ's
    /// tag on one channel). Nothing here rewinds a log (no topic is recreated, nothing is
    /// lost to retention) and a new member starts a new watermark, so a rewind the engine
    /// saw is a source whose positions went backwards: the watermark forgot the messages in
    /// flight (their outcomes count for nothing), and a commit past them may acknowledge one
    /// that was never applied.
    fn positions_grow(&self) -> Check {
        let rewinds = self.engine.as_ref().map_or(0, |e| e.report().rewinds);
        ensure(rewinds == 0, || {
            format!(
                "the consumer engine saw {rewinds} rewind(s) on {:?}: its source handed out a \
                 position at or below one it had handed out in the same assignment (positions \
                 must grow with every delivery), and the watermark forgot the messages in flight",
                self.broker.transport()
            )
        })
    }

    // ---- quiescence ----

    fn has_prefetched(&self, i: usize) -> bool {
        self.relays[i]
            .relay
            .as_ref()
            .is_some_and(|r| r.prefetched().is_some())
    }

    /// Acknowledges every wave relay `i`'s cycle sends until the cycle ends: a run's next
    /// version goes out only after the one before it was answered, so one answer leaves it
    /// held (and its lease would then expire under it while the drain waits).
    fn answer_cycle(&mut self, i: usize) -> Check {
        for _ in 0..1_000 {
            if self.relays[i].held.is_none() {
                return Ok(());
            }
            self.answer(i, &[RecordAnswer::Ack])?;
        }
        Err(format!("relay {i}'s cycle kept sending"))
    }

    fn drain_relays(&mut self) -> Check {
        // Every relay finishes its batch in flight and publishes what it claimed ahead (a
        // locked claim would hold its aggregates until then).
        for i in 0..self.relays.len() {
            self.answer_cycle(i)?;
            for _ in 0..100 {
                if !self.has_prefetched(i) {
                    break;
                }
                self.relay_step(i)?;
                self.answer_cycle(i)?;
            }
        }
        for _ in 0..500 {
            self.relay_step(0)?;
            self.answer_cycle(0)?;
            self.check_invariants()?;
            let idle = self.relays[0]
                .last_cycle
                .as_ref()
                .is_some_and(CycleReport::is_idle);
            if idle && !self.has_prefetched(0) {
                return Ok(());
            }
        }
        Err("relay 0 never went idle".into())
    }

    fn drain_consumer(&mut self) -> Check {
        let mut quiet = 0;
        let mut expiries = 0;
        for _ in 0..5_000 {
            let progressed = self.consumer_steps(1)?;
            // A violation recorded by a double (e.g. a handler call the engine should not
            // have made) ends the drain: an engine that retries forever never goes quiet.
            if let Some(v) = self.violations.first() {
                return Err(v);
            }
            let in_flight = self.engine.as_ref().map_or(0, |e| e.in_flight());
            if progressed == 0 && in_flight == 0 {
                quiet += 1;
                if quiet >= 3 {
                    // JetStream: what a crashed member held comes back after the ack wait.
                    if expiries < 20 && self.broker.expire_all() > 0 {
                        expiries += 1;
                        quiet = 0;
                        continue;
                    }
                    return self.check_invariants();
                }
            } else {
                quiet = 0;
            }
        }
        Err("the consumer never went quiet".into())
    }

    fn offsets_at_end(&self) -> Check {
        if self.broker.transport() != Transport::Kafka {
            return self.broker.all_acked();
        }
        for p in 0..self.config.partitions.max(1) as i32 {
            let end = self.log.end_offset(TOPIC, p);
            let committed = self.log.committed(GROUP, TOPIC, p).unwrap_or(0);
            ensure(committed == end, || {
                format!("partition {p}: committed offset {committed}, end {end}")
            })?;
        }
        Ok(())
    }

    /// The first committed event that is neither published nor parked, if any.
    fn unsettled(&self) -> Result<Option<String>, String> {
        let rows = self.block_on(self.backend.rows())??;
        for id in self.model.expected() {
            let row = rows.iter().find(|r| r.event_id == id);
            let status = row.map(|r| r.status);
            // Parking blocks the aggregate's later versions (and another event of the same
            // version, appended again): they wait, pending.
            let behind_a_park = row.is_some_and(|me| {
                rows.iter().any(|r| {
                    r.aggregate_id == me.aggregate_id
                        && r.event_id != me.event_id
                        && r.version <= me.version
                        && r.status == DeliveryStatus::Parked
                })
            });
            let settled = matches!(
                status,
                Some(DeliveryStatus::Published | DeliveryStatus::Parked)
            ) || (status == Some(DeliveryStatus::Pending) && behind_a_park)
                || (status.is_none() && self.model.published_ever.contains(&id));
            if !settled {
                return Ok(Some(format!(
                    "committed event {id} is {status:?} after draining: neither published, nor parked, nor behind a parked version"
                )));
            }
        }
        Ok(None)
    }

    /// Stops faults, lets everything drain, and checks the quiescent invariants.
    pub fn quiesce(&mut self) -> Check {
        self.log.clear_faults();
        for f in [
            &self.claim_faults,
            &self.complete_faults,
            &self.inbox_faults,
        ] {
            f.set_source(FaultSource::None);
        }
        *self
            .handler_fault
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        while !self.open.is_empty() {
            self.commit_open(0)?;
        }
        let store = self.backend.store();
        // 1. Without an operator, every committed event ends published or parked.
        for _ in 0..10 {
            self.drain_relays()?;
            if self.unsettled()?.is_none() {
                break;
            }
            self.block_on(self.backend.expire_leases(self.config.lease))?;
        }
        if let Some(message) = self.unsettled()? {
            return Err(message);
        }
        // 2. The operator retries what is parked; everything gets published.
        for round in 0..50 {
            let parked = self
                .block_on(store.list_parked(10_000))?
                .map_err(|e| e.to_string())?;
            for p in parked {
                let id = p.envelope.event_id;
                let before = self.scope_snapshot()?;
                match self.block_on(store.retry_parked(id, "drain"))? {
                    Ok(()) => {
                        self.model.retry(id);
                        let action = operator_scope::Action::Parked {
                            op: OperatorStep::Retry,
                            event: id,
                            copy: None,
                        };
                        self.check_scope(before, &action)?;
                    }
                    // Refused: at or below the last version published (out of order, for
                    // good: the operator discards it), or lower versions still wait (next
                    // round).
                    Err(e) if e.kind == StoreErrorKind::Conflict => {
                        self.report.operator_refused += 1;
                        let refused = operator_scope::Action::Refused(format!("retry of {id}"));
                        self.check_scope(before, &refused)?;
                        let rows = self.block_on(self.backend.rows())??;
                        if p.envelope.aggregate_version
                            <= self.model.floor(&rows, &p.envelope.aggregate_id)
                        {
                            let before = self.scope_snapshot()?;
                            self.block_on(store.discard_parked(id, "drain", "out of order"))?
                                .map_err(|e| format!("discarding {id} failed: {e}"))?;
                            self.model.discarded.insert(id);
                            let action = operator_scope::Action::Parked {
                                op: OperatorStep::Discard,
                                event: id,
                                copy: None,
                            };
                            self.check_scope(before, &action)?;
                        }
                    }
                    Err(e) => return Err(format!("retrying {id} failed: {e}")),
                }
            }
            self.drain_relays()?;
            let stats = self.block_on(store.stats())?.map_err(|e| e.to_string())?;
            let still_parked = !self
                .block_on(store.list_parked(1))?
                .map_err(|e| e.to_string())?
                .is_empty();
            if stats.unpublished == 0 && !still_parked {
                break;
            }
            ensure(round < 49, || {
                format!("the outbox did not drain: {stats:?}")
            })?;
            self.block_on(self.backend.expire_leases(self.config.lease))?;
        }
        // 3. The consumer drains. Consumer-side parking holds only its aggregate: every
        //    other aggregate's events are applied and the offsets reach the end.
        self.drain_consumer()?;
        self.offsets_at_end()?;
        let open_parked = self
            .block_on(self.parked_api.list(&ParkedFilter::default()))?
            .map_err(|e| e.to_string())?;
        let blocked: BTreeSet<String> = open_parked
            .iter()
            .filter_map(|m| m.record.aggregate.as_ref())
            .map(|a| a.aggregate_id.clone())
            .collect();
        let effects = self.block_on(self.backend.effects())??;
        for id in self.model.expected() {
            let e = self
                .model
                .committed
                .get(&id)
                .map(|e| e.aggregate_id.clone())
                .or_else(|| {
                    let original = self.model.dedup(id);
                    self.model
                        .committed
                        .get(&original)
                        .map(|e| e.aggregate_id.clone())
                });
            let Some(agg) = e else { continue };
            if blocked.contains(&agg) {
                continue;
            }
            let dedup = self.model.dedup(id);
            ensure(effects.counts.get(&dedup) == Some(&1), || {
                format!(
                    "event {id} of {agg} (not parked on the consumer side) was not applied once"
                )
            })?;
        }
        // 4. The operator retries the consumer's parked messages.
        for round in 0..50 {
            if !self.consumer_operator(0)? {
                break;
            }
            self.drain_consumer()?;
            ensure(round < 49, || {
                "consumer-side parking never cleared".to_owned()
            })?;
        }
        self.drain_consumer()?;
        // 5. Every committed, not discarded event is published and applied exactly once;
        //    the offsets are committed to the end.
        let effects = self.block_on(self.backend.effects())??;
        for id in self.model.expected() {
            ensure(self.model.published_ever.contains(&id), || {
                format!("event {id} is not published after draining")
            })?;
            let dedup = self.model.dedup(id);
            ensure(effects.counts.get(&dedup) == Some(&1), || {
                format!("committed event {id} was never applied by the consumer")
            })?;
        }
        self.offsets_at_end()?;
        self.check_invariants()
    }
}

/// Runs the simulation as a property test and returns the shrunk failure, if any.
///
/// Each case picks the claim mode (lease or locked transaction), prefetch and the early claim
/// on or off, and a step sequence; `make` builds the system for a case. The case count comes from
/// `OUTBOX_SIM_CASES` (else `config.cases`), the generator seed from `OUTBOX_SIM_SEED` (else
/// `config.seed`); the seed is printed. `source_file` (usually `Some(file!())`) enables
/// proptest's failure persistence in `proptest-regressions/simulation.txt` (relative to the
/// package root), so a failure found once is replayed first on every later run.
pub fn run_property<B, H, F>(
    config: &SimConfig,
    source_file: Option<&'static str>,
    make: F,
) -> Result<(), TestError<Case>>
where
    B: Backend,
    H: Handler<InboxTx<B>> + 'static,
    F: Fn(Modes) -> Simulation<B, H>,
{
    let seed = outbox_testkit::fault::seed_from_env(config.seed);
    let cases = if config.cases_from_env {
        cases_from_env(config.cases)
    } else {
        config.cases
    };
    eprintln!("simulation: {cases} cases, seed {seed} ({SEED_ENV}={seed} replays it)");
    let mut pt = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        max_shrink_iters: config.max_shrink_iters,
        source_file,
        ..Config::default()
    };
    pt.failure_persistence = match source_file {
        Some(_) => Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/simulation.txt",
        ))),
        None => None,
    };
    let mut runner = TestRunner::new(pt);
    // How many cases ran until the first failure (the shrinking runs more after it).
    let ran = std::cell::Cell::new(0u32);
    let first_failure = std::cell::Cell::new(None::<u32>);
    // Operator actions checked for their scope, and leases an operator released.
    let scoped = std::cell::Cell::new((0usize, 0u64));
    let result = runner.run(&steps::cases(config), |(modes, steps)| {
        if first_failure.get().is_none() {
            ran.set(ran.get() + 1);
        }
        let mut sim = make(modes);
        let r = sim
            .run(&steps)
            .map(|report| {
                if first_failure.get().is_none() {
                    let (s, c) = scoped.get();
                    scoped.set((
                        s + report.operator_scope_checked,
                        c + report.claims_released,
                    ));
                }
            })
            .map_err(|v| TestCaseError::fail(v.to_string()));
        if r.is_err() && first_failure.get().is_none() {
            first_failure.set(Some(ran.get()));
        }
        r
    });
    let (checked, released) = scoped.get();
    eprintln!(
        "simulation: {checked} operator actions checked for their scope ({released} leases \
         released by an operator) in the cases that passed"
    );
    if result.is_err() {
        if let Some(n) = first_failure.get() {
            eprintln!("simulation: first failing case: {n} of {cases}");
        }
        eprintln!("simulation failed with seed {seed} (replay with {SEED_ENV}={seed})");
    }
    result
}

/// Runs the property over the in-memory backends and panics with the shrunk failing case
/// and the seed if an invariant fails.
pub fn check_memory(config: &SimConfig) {
    let c = config.clone();
    if let Err(e) = run_property(config, None, |modes| Simulation::memory(c.clone(), modes)) {
        panic!("{e}");
    }
}

/// Generates `n` cases from `seed`, as [`run_property`] would; for coverage checks and for
/// driving a [`Simulation`] by hand.
pub fn sample_cases(config: &SimConfig, n: usize, seed: u64) -> Vec<Case> {
    use proptest::strategy::{Strategy, ValueTree};
    let mut runner = TestRunner::new(Config {
        rng_seed: RngSeed::Fixed(seed),
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = steps::cases(config);
    (0..n)
        .map(|_| {
            strategy
                .new_tree(&mut runner)
                .expect("the step strategy never rejects")
                .current()
        })
        .collect()
}
