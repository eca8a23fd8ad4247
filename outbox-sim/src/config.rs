//! Simulation parameters and the seeded bugs that prove the invariants catch something.

use std::time::Duration;

/// Environment variable: number of cases (overrides [`SimConfig::cases`]).
pub const CASES_ENV: &str = "OUTBOX_SIM_CASES";
/// Environment variable: seed of the case generator (decimal).
pub const SEED_ENV: &str = outbox_testkit::fault::SEED_ENV;

/// A deliberate bug, to prove that the invariants catch it. Each is a wrapper or a double
/// around the production code (nothing in the relay or the engine is changed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SeededBug {
    /// The store records the batch as published before the publisher is even called (a
    /// relay that marks before the acknowledgement).
    MarkBeforeAck,
    /// The publisher double sends the next version of an aggregate instead of the claimed
    /// head when one exists (a relay that skips the head).
    SkipHead,
    /// The source commits each message's offset as soon as the engine receives it, before
    /// its transaction.
    CommitOffsetBeforeTx,
    /// The outcomes of a batch reach the store shifted by one record: record `i` gets the
    /// outcome decided for record `i + 1` (a `decide`/`complete` result-mapping bug).
    ShiftedOutcomes,
    /// Acknowledgement metadata of another record of the batch is stored for each published
    /// record (metadata rotated by one among the batch's acknowledged records).
    SwappedAckMetadata,
    /// The source commits one past the offset the engine asked for (a watermark that passes
    /// an unfinished offset).
    WatermarkPastUnfinished,
    /// The one-by-one handler fallback skips the second event of a batch: it is registered
    /// but its effect never runs.
    FallbackSkipsRecord,
    /// A prefetched claim is released right after it is taken but still handed to the relay,
    /// which publishes it under a stale claim.
    StalePrefetch,
    /// JetStream: the source orders deliveries by their stream sequence instead of the
    /// delivery sequence, so a redelivery after later messages goes backwards (the engine's
    /// watermark takes it for a rewind and forgets the later messages in flight, which a
    /// later acknowledgement then covers).
    JetStreamStreamSequenceOffsets,
    /// JetStream: the source acknowledges each delivery as it hands it to the engine, before
    /// its effect committed (an `AckNone` / auto-ack consumer).
    JetStreamAckOnDelivery,
    /// RabbitMQ: the source takes a delivery's redelivered flag for proof that it was
    /// handled before: acknowledges it alone and does not hand it to the engine.
    RabbitSkipsRedelivered,
    /// Runs: the relay sends a run's events at once, each version without waiting for the
    /// acknowledgement of the one before, so also after its failure (the claim's run
    /// positions are hidden from the real relay).
    RunSentAtOnce,
    /// Runs: a completion drops the outcome of the event before a published event of a run
    /// (a hole), and the store applies the rest anyway instead of refusing it (the in-memory
    /// store's `seeded_bug_accept_run_holes`).
    StoreAcceptsRunHoles,
    /// Runs: the store's claim continues a run past a missing version (the in-memory store's
    /// `seeded_bug_run_skips_gaps`).
    RunSkipsGap,
}

impl SeededBug {
    /// Every seeded bug.
    pub const ALL: [SeededBug; 14] = [
        Self::MarkBeforeAck,
        Self::SkipHead,
        Self::CommitOffsetBeforeTx,
        Self::ShiftedOutcomes,
        Self::SwappedAckMetadata,
        Self::WatermarkPastUnfinished,
        Self::FallbackSkipsRecord,
        Self::StalePrefetch,
        Self::JetStreamStreamSequenceOffsets,
        Self::JetStreamAckOnDelivery,
        Self::RabbitSkipsRedelivered,
        Self::RunSentAtOnce,
        Self::StoreAcceptsRunHoles,
        Self::RunSkipsGap,
    ];
}

/// Simulation parameters.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SimConfig {
    /// Number of relays. Default 2.
    pub relays: usize,
    /// Number of aggregates events are spread over. Default 4.
    pub aggregates: usize,
    /// Partitions of the topic. Default 2.
    pub partitions: usize,
    /// Lease duration in lease mode. Default 30 s.
    pub lease: Duration,
    /// The publisher double's delivery timeout. Default 5 s.
    pub delivery_timeout: Duration,
    /// The relays' retry backoff: first delay and longest delay. Default 500 ms and 5 s.
    pub relay_retry: (Duration, Duration),
    /// Events per claim. Default 2 (so full batches, and so prefetch, happen often).
    pub batch_size: usize,
    /// Transient failures before parking. Default 3.
    pub max_attempts: u32,
    /// How long the in-memory store holds a version gap before it parks it. Default 20 s (of
    /// virtual time: a few [`crate::Step::Advance`]s), as the PostgreSQL backend's.
    pub gap_timeout: Duration,
    /// Largest number of steps per case. Default 80.
    pub max_steps: usize,
    /// Cases run by [`crate::check_memory`] and [`crate::run_property`] unless `OUTBOX_SIM_CASES` is set. Default 150.
    pub cases: u32,
    /// Seed of the case generator unless `OUTBOX_SIM_SEED` is set.
    pub seed: u64,
    /// A deliberate bug (for tests of the simulation itself).
    pub bug: Option<SeededBug>,
    /// Whether the producer also appends versions out of order ([`crate::Skew`]). Default
    /// `true`; off for a user's handler that cannot take an event outside its commands.
    pub skew: bool,
    /// Whether `OUTBOX_SIM_CASES` overrides `cases`. Default `true`.
    pub cases_from_env: bool,
    /// Most shrinking iterations after a failure. Default 1000.
    pub max_shrink_iters: u32,
    /// The transport of every case; `None` (the default): each case's own, chosen by the
    /// generator (Kafka in half the cases, JetStream and RabbitMQ in a quarter each).
    pub transport: Option<crate::Transport>,
    /// The relays' run length ([`outbox_core::RelayConfig::run`]) in every case; `None` (the
    /// default): each case's own, chosen by the generator (1, heads only, in half the cases,
    /// 3 in the other half, with the batch 2 larger so a run fits beside the heads).
    pub run: Option<usize>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            relays: 2,
            aggregates: 4,
            partitions: 2,
            lease: Duration::from_secs(30),
            delivery_timeout: Duration::from_secs(5),
            relay_retry: (Duration::from_millis(500), Duration::from_secs(5)),
            batch_size: 2,
            max_attempts: 3,
            gap_timeout: Duration::from_secs(20),
            max_steps: 80,
            cases: 150,
            seed: 388_816,
            bug: None,
            skew: true,
            cases_from_env: true,
            max_shrink_iters: 1000,
            transport: None,
            run: None,
        }
    }
}

impl SimConfig {
    /// Sets the number of cases.
    pub fn cases(mut self, n: u32) -> Self {
        self.cases = n;
        self
    }
    /// Sets the number of cases and ignores `OUTBOX_SIM_CASES`.
    pub fn fixed_cases(mut self, n: u32) -> Self {
        self.cases = n;
        self.cases_from_env = false;
        self
    }
    /// Sets the largest number of steps per case.
    pub fn max_steps(mut self, n: usize) -> Self {
        self.max_steps = n;
        self
    }
    /// Sets the events per claim.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }
    /// Sets the number of relays.
    pub fn relays(mut self, n: usize) -> Self {
        self.relays = n.max(1);
        self
    }
    /// Sets the lease duration, the publisher double's delivery timeout and the relays'
    /// retry backoff (a backend on real time needs them short).
    pub fn timing(
        mut self,
        lease: Duration,
        delivery_timeout: Duration,
        relay_retry: (Duration, Duration),
    ) -> Self {
        self.lease = lease;
        self.delivery_timeout = delivery_timeout;
        self.relay_retry = relay_retry;
        self
    }
    /// Sets the default seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    /// Sets the most shrinking iterations after a failure.
    pub fn max_shrink_iters(mut self, n: u32) -> Self {
        self.max_shrink_iters = n;
        self
    }
    /// No versions out of order from the producer (only the user's commands append).
    pub fn without_skew(mut self) -> Self {
        self.skew = false;
        self
    }
    /// Runs every case with relays claiming runs of up to `run` events (1: heads only).
    pub fn run(mut self, run: usize) -> Self {
        self.run = Some(run.max(1));
        self
    }
    /// Runs every case over `transport`.
    pub fn transport(mut self, transport: crate::Transport) -> Self {
        self.transport = Some(transport);
        self
    }
    /// Injects a deliberate bug.
    pub fn bug(mut self, bug: SeededBug) -> Self {
        self.bug = Some(bug);
        self
    }
    pub(crate) fn has(&self, bug: SeededBug) -> bool {
        self.bug == Some(bug)
    }
}

/// The number of cases: `OUTBOX_SIM_CASES` if set, else `default`.
pub fn cases_from_env(default: u32) -> u32 {
    std::env::var(CASES_ENV)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(default)
}
