//! Transitions and their generation.
//!
//! Steps address things by index (relay `i`, aggregate `k`, the `n`-th parked event) and are
//! no-ops when they do not apply, so every sequence is valid and proptest shrinks failures to
//! short, readable sequences.

use std::time::Duration;

use proptest::prelude::*;

use crate::config::SimConfig;
use crate::transport::Transport;

/// How the broker answers one record of a batch held by the publisher double.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordAnswer {
    /// Stored and acknowledged with its metadata.
    Ack,
    /// The record's own transient failure (not stored; an attempt is spent).
    Transient,
    /// A transport failure (broker down; not stored; no attempt spent).
    Transport,
    /// A permanent failure (not stored; the event parks).
    Permanent,
    /// Stored, but the acknowledgement is lost (the relay sees a timeout).
    AckLost,
}

/// A fault of the relays' database calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreFault {
    /// The next claim fails (nothing claimed).
    ClaimFails,
    /// The next completion fails (nothing recorded).
    CompleteFails,
    /// The next completion is recorded but its reply is lost.
    CompleteReplyLost,
}

/// An operator action on the `n`-th parked event of the outbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperatorStep {
    /// Retry it.
    Retry,
    /// Discard it.
    Discard,
    /// Re-issue it.
    Reissue,
}

/// A fault of the consumer's handler, for the next event it applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandlerFault {
    /// Fails transiently (the engine retries with backoff).
    Transient,
    /// Fails permanently (the engine parks the message on the consumer side; its aggregate
    /// waits, the others flow).
    Permanent,
    /// Fails transiently, and keeps failing for that event until an operator retries it: the
    /// engine must park it after `max_attempts` attempts.
    Stuck,
}

/// A producer that does not keep its aggregate's versions in order: what a business
/// transaction appends instead of the next version (see [`Step::Skew`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skew {
    /// Appends the version `n` (1 or 2) past the next one: the versions between are missing
    /// until a [`Skew::Fill`] appends them (or never). The outbox must hold the head, park it
    /// as a version gap after the gap timeout, and publish nothing past the gap.
    Gap(i64),
    /// Appends the lowest version still missing (a late fill, committed after a higher
    /// version): the outbox publishes it in order when the gap was not yet parked, and parks it
    /// as out of order when a higher version went out first.
    Fill,
    /// Appends a version the aggregate already has (a re-append, the `n`-th from its last):
    /// the outbox publishes at most one event of a version, and parks a version at or below
    /// the last one published as out of order.
    Lower(i64),
}

/// The version policy of the consumer (`outbox_inbox::VersionPolicy`) a case runs with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// `VersionPolicy::Reject` (the default): a gap parks at once.
    #[default]
    Reject,
    /// `VersionPolicy::Hold`: a gap is held in memory, bounded, then parked.
    Hold,
    /// `VersionPolicy::Unchecked`: no versions kept; a parked message still blocks its
    /// aggregate.
    Unchecked,
}

/// One operation of a [`Step::Race`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RaceOp {
    /// Relay `n` starts a cycle: its claim (a relay that holds a batch or runs a cycle
    /// already is left alone).
    Claim(usize),
    /// The broker answers relay `relay`'s held batch; its completion (and, with prefetch, its
    /// next claim) runs.
    Answer {
        /// Relay index.
        relay: usize,
        /// Per-record answers, cycled.
        answers: Vec<RecordAnswer>,
    },
    /// An operator action on the `n`-th parked event of the outbox.
    Operator(OperatorStep, usize),
}

/// One transition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Begin a business transaction running `events` commands on aggregate `aggregate`
    /// (command `command` of the producer's commands, modulo their number).
    Begin {
        /// Aggregate index.
        aggregate: usize,
        /// Number of commands (events).
        events: usize,
        /// Which command.
        command: usize,
    },
    /// Begin a business transaction on aggregate `aggregate` that appends one event out of
    /// the aggregate's order ([`Skew`]), under the aggregate's lock as [`Step::Begin`].
    Skew {
        /// Aggregate index.
        aggregate: usize,
        /// What it appends.
        skew: Skew,
    },
    /// Commit the `n`-th open business transaction.
    Commit(usize),
    /// Roll back the `n`-th open business transaction.
    Rollback(usize),
    /// Relay `n` runs `Relay::run_once` until the publisher double holds its batch, or the
    /// cycle ends.
    Relay(usize),
    /// The broker answers the batch held for relay `relay`, record `k` with
    /// `answers[k % len]`; the relay's cycle then runs to its end.
    Answer {
        /// Relay index.
        relay: usize,
        /// Per-record answers, cycled.
        answers: Vec<RecordAnswer>,
    },
    /// What production runs concurrently runs concurrently: claims of several relays,
    /// completions and operator actions start together (in this order, `stagger` apart) and
    /// their statements interleave on the server.
    Race {
        /// The operations, in their order of start.
        ops: Vec<RaceOp>,
        /// How far apart they start (see `Simulation`'s race: 0 to 3).
        stagger: u8,
    },
    /// A lease expires between relay `relay`'s send and its answer while relay `by` claims:
    /// virtual time passes beyond the lease, relay `by` claims (its batches answered, up to a
    /// few claims) until it takes an aggregate of `relay`'s batch, then that batch is answered
    /// with `answers` and its late completion runs: it must apply nothing to what `by` took
    /// (fencing). With `hold`, on a backend that can stop a claim mid-transaction
    /// ([`crate::Backend::hold_head`]), the late completion starts while `by`'s claim stands
    /// after its decision's snapshot, holding the aggregate's lock: the completion must wait
    /// for that claim to commit (the store's completion locks), or `by` re-sends a version
    /// the completion marked done. Only in lease mode; otherwise a no-op.
    Overtake {
        /// The relay whose lease expires (it must hold a batch).
        relay: usize,
        /// The relay that claims meanwhile.
        by: usize,
        /// Per-record answers to `relay`'s batch, cycled.
        answers: Vec<RecordAnswer>,
        /// Whether `by`'s claim is held mid-transaction while the completion starts.
        hold: bool,
    },
    /// Relay `n`'s process dies: its task is aborted (a locked claim's connection drops), and
    /// a fresh relay takes its place.
    RelayCrash(usize),
    /// Virtual time passes.
    Advance(Duration),
    /// The relays' next database call of a kind fails.
    StoreFault(StoreFault),
    /// An operator acts on the `n`-th parked event of the outbox.
    Operator(OperatorStep, usize),
    /// Relay `n`'s process dies (as [`Step::RelayCrash`]) and an operator releases its claims
    /// (`release_claims_of` its owner): in lease mode its leases end at once instead of at
    /// their expiry.
    ReleaseClaims(usize),
    /// The consumer engine makes `n` steps (`ConsumerEngine::step`).
    Consumer(usize),
    /// The consumer stalls with work in flight: the engine makes `before` steps, then
    /// virtual time passes beyond the JetStream ack wait ([`crate::transport::ACK_WAIT`] + 1 s)
    /// while it holds what it received, then it makes `after` steps. On JetStream every
    /// delivery not acknowledged in time is due again: what this member holds is not handed
    /// out again, but a crashed member's message comes back *after* the later messages this
    /// member received, while they are still in flight (the interleaving a source that
    /// orders by stream sequence gets wrong). On the other transports, time passes mid-work.
    ConsumerStalls {
        /// Engine steps before the stall.
        before: usize,
        /// Engine steps after it.
        after: usize,
    },
    /// JetStream: another member of the durable consumer (a second process) pulls the next
    /// `n` new messages, as they come, before the live engine sees them, and dies without
    /// acknowledging them: they come back after their ack wait ([`Step::Advance`],
    /// [`Step::ConsumerStalls`]), behind the later messages the live engine read meanwhile
    /// (possibly still in flight). A no-op on the other transports.
    OtherMemberDies(usize),
    /// The consumer's process dies: the engine (with its running transactions) is dropped and
    /// a fresh one resumes from the committed offsets.
    ConsumerCrash,
    /// The partitions move to a new member: the engine commits what is final and hands over.
    Rebalance,
    /// The next event the handler applies fails.
    HandlerFault(HandlerFault),
    /// The consumer's next inbox commit fails (`lost_reply: false`) or commits but reports a
    /// failure (`lost_reply: true`).
    InboxCommitFault {
        /// Whether the commit happened.
        lost_reply: bool,
    },
    /// The consumer's inbox commits fail (transiently) from now on, until [`Step::InboxUp`]:
    /// a batch of the engine stays in its store-failure backoff however many times its
    /// backoff runs out meanwhile (an [`Step::InboxCommitFault`] fails one commit, which a
    /// backoff that ran out within the same engine step retries). Not generated.
    InboxDown,
    /// The consumer's inbox commits succeed again. Not generated.
    InboxUp,
    /// The consumer engine's thread is held for this long within its next step, after the
    /// step started its batches and before it polls the source, as a loaded machine holds a
    /// process: the engine's real-time timers that run out meanwhile (a backoff) fire at once
    /// when it runs again. Not generated.
    EngineThreadStalls(Duration),
    /// An operator retries the `n`-th open parked message of the consumer.
    ConsumerOperator(usize),
    /// Cleanup deletes published and discarded outbox rows (retention zero, batches of 2).
    Cleanup,
}

fn answer() -> impl Strategy<Value = RecordAnswer> {
    prop_oneof![
        10 => Just(RecordAnswer::Ack),
        1 => Just(RecordAnswer::Transient),
        1 => Just(RecordAnswer::Transport),
        3 => Just(RecordAnswer::Permanent),
        2 => Just(RecordAnswer::AckLost),
    ]
}

fn race_op(relays: usize) -> impl Strategy<Value = RaceOp> {
    prop_oneof![
        3 => (0..relays).prop_map(RaceOp::Claim),
        3 => (0..relays, proptest::collection::vec(answer(), 1..=3))
            .prop_map(|(relay, answers)| RaceOp::Answer { relay, answers }),
        2 => (
            prop_oneof![
                Just(OperatorStep::Retry),
                Just(OperatorStep::Discard),
                Just(OperatorStep::Reissue)
            ],
            0..2usize
        )
            .prop_map(|(o, n)| RaceOp::Operator(o, n)),
    ]
}

/// The strategy of step sequences for `config`.
pub fn steps(config: &SimConfig) -> impl Strategy<Value = Vec<Step>> {
    let relays = config.relays.max(1);
    let aggs = config.aggregates.max(1);
    let skew = config.skew;
    let step = prop_oneof![
        5 => (0..aggs, 1..=3usize, 0..4usize)
            .prop_map(|(aggregate, events, command)| Step::Begin { aggregate, events, command }),
        2 => (
            0..aggs,
            prop_oneof![
                2 => (1..=2i64).prop_map(Skew::Gap),
                2 => Just(Skew::Fill),
                2 => (0..=1i64).prop_map(Skew::Lower),
            ]
        )
            // Without skew, an ordinary transaction in its place.
            .prop_map(move |(aggregate, s)| if skew {
                Step::Skew { aggregate, skew: s }
            } else {
                Step::Begin { aggregate, events: 1, command: 0 }
            }),
        5 => (0..3usize).prop_map(Step::Commit),
        1 => (0..3usize).prop_map(Step::Rollback),
        12 => (0..relays).prop_map(Step::Relay),
        12 => (0..relays, proptest::collection::vec(answer(), 1..=3))
            .prop_map(|(relay, answers)| Step::Answer { relay, answers }),
        4 => (proptest::collection::vec(race_op(relays), 2..=3), 0..4u8)
            .prop_map(|(ops, stagger)| Step::Race { ops, stagger }),
        4 => (
            0..relays,
            1..relays.max(2),
            proptest::collection::vec(answer(), 1..=3),
            prop_oneof![2 => Just(true), 1 => Just(false)]
        )
            .prop_map(move |(relay, d, answers, hold)| Step::Overtake {
                relay,
                by: (relay + d) % relays,
                answers,
                hold
            }),
        2 => (0..relays).prop_map(Step::RelayCrash),
        2 => (0..relays).prop_map(Step::ReleaseClaims),
        4 => prop_oneof![Just(1u64), Just(10), Just(31), Just(31), Just(120)]
            .prop_map(|s| Step::Advance(Duration::from_secs(s))),
        1 => prop_oneof![
            Just(StoreFault::ClaimFails),
            Just(StoreFault::CompleteFails),
            Just(StoreFault::CompleteReplyLost)
        ]
        .prop_map(Step::StoreFault),
        6 => (
            prop_oneof![
                Just(OperatorStep::Retry),
                Just(OperatorStep::Discard),
                Just(OperatorStep::Reissue)
            ],
            0..2usize
        )
            .prop_map(|(o, n)| Step::Operator(o, n)),
        12 => (1..=4usize).prop_map(Step::Consumer),
        2 => (1..=3usize, 1..=4usize)
            .prop_map(|(before, after)| Step::ConsumerStalls { before, after }),
        2 => Just(Step::ConsumerCrash),
        2 => (1..=3usize).prop_map(Step::OtherMemberDies),
        1 => Just(Step::Rebalance),
        4 => prop_oneof![
            1 => Just(HandlerFault::Transient),
            2 => Just(HandlerFault::Permanent),
            1 => Just(HandlerFault::Stuck)
        ]
        .prop_map(Step::HandlerFault),
        1 => any::<bool>().prop_map(|lost_reply| Step::InboxCommitFault { lost_reply }),
        2 => (0..2usize).prop_map(Step::ConsumerOperator),
        1 => Just(Step::Cleanup),
    ];
    proptest::collection::vec(step, 1..=config.max_steps.max(1))
}

/// The modes of one case: lease (else locked transaction), prefetch and the early claim, the
/// consumer's version policy, the transport and the run length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Modes {
    /// `ClaimMode::Lease` (else `LockedTransaction`).
    pub lease: bool,
    /// `RelayConfig::prefetch`.
    pub prefetch: bool,
    /// The consumer's version policy.
    pub policy: Policy,
    /// The transport (see [`Transport`]).
    pub transport: Transport,
    /// `RelayConfig::run`: the longest run per aggregate the relays claim (1: heads only).
    pub run: usize,
    /// `RelayConfig::early_claim` (it acts only with `prefetch`): a batch that was not full
    /// has the next batch claimed while its completion is written.
    pub early_claim: bool,
}

/// One generated case.
pub type Case = (Modes, Vec<Step>);

/// The strategy of cases (modes and steps) for `config`.
pub fn cases(config: &SimConfig) -> impl Strategy<Value = Case> {
    let forced = config.transport;
    let forced_run = config.run;
    (
        (
            any::<bool>(),
            any::<bool>(),
            // `Unchecked` in half the cases: the one policy that keeps no versions, so only a
            // handler's failure parks a message there, and a case must also bring a later
            // version of that aggregate while it is parked.
            prop_oneof![
                1 => Just(Policy::Reject),
                1 => Just(Policy::Hold),
                2 => Just(Policy::Unchecked)
            ],
            // The cases are split among the transports (not multiplied by them): Kafka in
            // half, JetStream and RabbitMQ in a quarter each.
            prop_oneof![
                2 => Just(Transport::Kafka),
                1 => Just(Transport::JetStream),
                1 => Just(Transport::RabbitMq)
            ],
            // Runs in half the cases (1 is heads only).
            prop_oneof![Just(1usize), Just(3usize)],
        )
            .prop_map(move |(lease, prefetch, policy, transport, run)| Modes {
                lease,
                prefetch,
                policy,
                transport: forced.unwrap_or(transport),
                run: forced_run.unwrap_or(run),
                early_claim: false,
            }),
        steps(config),
        // Drawn last, so that a seed generates the same modes and steps as before this mode
        // existed: the early claim in half the cases (those with prefetch).
        any::<bool>(),
    )
        .prop_map(|(mut modes, steps, early_claim)| {
            modes.early_claim = early_claim;
            (modes, steps)
        })
}

/// A replayable description of a case.
pub fn describe(case: &Case) -> String {
    let steps: Vec<String> = case.1.iter().map(|s| format!("{s:?}")).collect();
    format!("modes: {:?}\nsteps:\n  {}", case.0, steps.join("\n  "))
}
