//! A seeded, randomized, time-bounded concurrency run of an outbox store on a real server, in
//! both claim modes, judged by the shared history checker ([`history`]). A backend
//! (`outbox-postgres`, `outbox-mysql`) implements [`RandomizedBackend`] (stores over its own
//! schema or database, business transactions, and a few reads of the raw table) and calls
//! [`run`] from a test; [`MemoryBackend`] is the in-memory store's, for runs without a server.
//!
//! Four `outbox_core::Relay`s, each over its own store instance (some with prefetch, batch
//! sizes drawn from the seed, and run lengths from [`Spec::with_runs`]), drive `run_once` in a loop honouring `CycleReport::pause`,
//! against two producers that append many aggregates (some 20 to 40 versions deep) in
//! overlapping transactions, now and then rolled back, with duplicate and out-of-order versions
//! and version gaps (some filled late) appended on purpose. A fake broker decides per hand-over
//! of each record: acknowledge, acknowledge but lose the report, a record-scoped transient
//! failure (`Other`), a permanent one (`InvalidRecord`), a transport failure
//! (`BrokerUnavailable`, also for whole calls) or a timeout; now and then it stalls after its
//! delivery reports for longer than the claim lives (lease 2.5 s, delivery timeout 0.3 s; locked
//! mode: `locked_max_hold` 3 s), so claims expire mid-publish, another relay takes the aggregate
//! over and the stalled relay's completion is refused. An operator lists parked events and
//! retries, discards or re-issues them (answering `Conflict` with a discard, tolerating
//! `NotFound`), and kills a relay every few seconds (its task dropped mid-cycle; lease mode:
//! usually followed by `release_claims_of`) and starts a new one under a new owner. Once the
//! producers stop, the relays drain the backlog while the operator retries what it can and
//! discards the rest. Then the checks of [`history`] run. Relay cycles may fail only with a
//! lost claim or connection; any other store error fails the run. The run also fails when it
//! exercised too little (fewer than `MIN_ACKS` deliveries, or nothing parked).
//!
//! The seed is printed at the start of each run (past the output capture) and in every
//! failure; `<PREFIX>_RANDOM_SEED` replays it and `<PREFIX>_RANDOM_SECS` sets the production
//! time of the lease run (default 15 s; the locked run gets 60 % of it), where the prefix is
//! the backend's ([`RandomizedBackend::env_prefix`], e.g. `OUTBOX_PG`). The seed fixes every
//! random decision: the producer's script, the broker's verdict on each hand-over of each
//! event, the operator's choice for each parked event, the relays' settings and the crash
//! schedule. Which decision meets which interleaving is the scheduler's, so a replay repeats
//! the decisions (and usually the failure), not the exact interleaving.
//!
//! # How the checks stay exact under a slow machine
//!
//! Every claim goes through a recording wrapper of the store (module `recorded`), which notes, per
//! claim, a window that is certainly inside the claim's real life: from the moment `claim`
//! returned (the lease is committed, the locks are held) to the earliest moment it could have
//! ended: the lease deadline measured from *before* the claim request (`before +
//! lease_remaining`; locked mode: `before + locked_max_hold`, after which the server may end
//! the claim), the call of `complete` or `release`, and for a killed relay the operator's
//! `release_claims_of` call (lease) or the abort (locked). The fake broker stores a record only
//! while the handing relay's claim is live by that window (a real producer would have timed
//! out otherwise), so every delivery is one the store's guarantees cover, and a relay that
//! stalls past its claim leads to a timeout, never to a false alarm. No check depends on
//! timing; the only time bound is a generous drain limit.

mod actors;
mod broker;
pub mod history;
mod memory;
mod recorded;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, DeliveryStatus, Envelope, EventId, StoreError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use actors::{kill_and_replace, operate, produce, Env, Injected, OperatorState, Phase, RelaySlot};
pub use history::FinalRow;
use history::{check, digest, Checked, World};
pub use memory::MemoryBackend;

/// How a backend builds the stores of a run.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct StoreParams {
    /// The claim mode of the run.
    pub mode: ClaimMode,
    /// `locked_max_hold` for the locked run (the server ends a claim held longer).
    pub locked_hold: Duration,
    /// The store's gap timeout.
    pub gap_timeout: Duration,
    /// The publisher's delivery timeout (for `publisher_delivery_timeout`).
    pub delivery_timeout: Duration,
}

/// What a run needs from a backend: stores over the run's own schema or database, business
/// transactions, and reads of the raw outbox table on a connection apart from the relays'.
#[async_trait]
pub trait RandomizedBackend: Send + Sync + 'static {
    /// The store under test.
    type Store: OutboxStore + Clone + 'static;
    /// A business transaction.
    type Tx: Send + 'static;

    /// A new store instance over the run's data (each relay gets its own, as separate
    /// processes would). MUST use `params`.
    fn store(&self, params: &StoreParams) -> Self::Store;
    /// Creates the tables (migrations).
    async fn prepare(&self, store: &Self::Store) -> Result<(), StoreError>;
    /// Begins a business transaction (`Err`: none could be had now; the producer waits).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;
    /// Appends in `tx` through `store`.
    async fn append(
        &self,
        store: &Self::Store,
        tx: &mut Self::Tx,
        events: &[Envelope],
    ) -> Result<(), StoreError>;
    /// Commits.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;
    /// Rolls back.
    async fn rollback(&self, tx: Self::Tx);
    /// The stored status of each of `ids` (`None`: the read failed).
    async fn statuses(&self, ids: &[EventId]) -> Option<HashMap<EventId, DeliveryStatus>>;
    /// How many rows are pending and parked.
    async fn counts(&self) -> Result<(u64, u64), StoreError>;
    /// Aggregates that can never move again: pending rows, all of them blocked, none parked.
    /// Per aggregate: its id, its pending rows, and a description of its unfinished rows.
    async fn stalled(&self) -> Result<Vec<(String, i64, String)>, StoreError>;
    /// A description of the first rows still pending or parked (for a drain that timed out).
    async fn stuck(&self) -> Vec<String>;
    /// Every row of the outbox table, in insertion order.
    async fn final_rows(&self) -> Result<Vec<FinalRow>, StoreError>;
    /// Where the run's data is kept (a schema, a database), named in a failure.
    fn location(&self) -> String;
    /// The prefix of the replay variables (`<prefix>_RANDOM_SEED`, `<prefix>_RANDOM_SECS`).
    fn env_prefix(&self) -> &'static str;
    /// The command that replays `test` with `seed`.
    fn replay_command(&self, test: &str, seed: u64) -> String;
    /// Called after a passing run (drop the schema or database).
    async fn finish(&self);
}

/// The publisher's declared delivery timeout.
pub(crate) const DELIVERY_TIMEOUT: Duration = Duration::from_millis(300);
/// Lease of the lease run: just above delivery timeout + `MIN_LEASE_MARGIN`, so stalls of the
/// fake broker make leases expire mid-publish.
pub(crate) const LEASE: Duration = Duration::from_millis(2500);
/// `locked_max_hold` of the locked run: just above 2 x (delivery timeout + margin), what a
/// prefetching relay needs; a stall past it makes the server end the claim mid-publish.
pub(crate) const LOCKED_HOLD: Duration = Duration::from_secs(3);
/// How long a head that skips a version is held before it is parked as a version gap.
pub(crate) const GAP_TIMEOUT: Duration = Duration::from_millis(1500);
pub(crate) const RELAYS: usize = 4;
pub(crate) const PRODUCERS: usize = 2;
/// Aggregates each producer keeps open at a time.
pub(crate) const OPEN_AGGREGATES: usize = 8;
pub(crate) const PARTITIONS: usize = 3;
pub(crate) const TOPIC: &str = "orders";
/// Header carrying the producer's label of an event (kept by re-issued copies), the key of
/// every seeded decision about the event.
pub const LABEL: &str = "x-label";
/// Liveness bound of the drain (generous: a loaded 2-core machine).
pub(crate) const DRAIN_LIMIT: Duration = Duration::from_secs(120);
/// Re-tries per parked event during the drain before the operator discards it.
pub(crate) const DRAIN_RETRIES: u32 = 3;
/// Fewer deliveries than this and the run proved nothing; it fails instead of passing vacuously.
pub(crate) const MIN_ACKS: usize = 100;

// Salts of the seeded decision streams.
pub(crate) const SALT_PRODUCER: u64 = 0x5052_4f44;
pub(crate) const SALT_VERDICT: u64 = 0x5645_5244;
pub(crate) const SALT_OPERATOR: u64 = 0x4f50_4552;
pub(crate) const SALT_OP_SKIP: u64 = 0x534b_4950;
pub(crate) const SALT_RELAY: u64 = 0x524c_4159;
pub(crate) const SALT_CHAOS: u64 = 0x4348_414f;

pub(crate) fn production_secs(prefix: &str) -> f64 {
    let var = format!("{prefix}_RANDOM_SECS");
    match std::env::var(&var) {
        Ok(s) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|v| v.is_finite() && *v > 0.0 && *v <= 3600.0)
            .unwrap_or_else(|| panic!("{var}={s:?} is not a number of seconds in (0, 3600]")),
        Err(_) => 15.0,
    }
}

/// The seed: `OUTBOX_PG_RANDOM_SEED` (decimal or 0x-hex), else derived from the time (so every
/// run explores a new one).
pub(crate) fn seed_for(spec: &Spec, prefix: &str) -> u64 {
    let var = format!("{prefix}_RANDOM_SEED");
    match std::env::var(&var) {
        Ok(s) => {
            let t = s.trim();
            let parsed = match t.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => t.parse::<u64>().ok(),
            };
            parsed.unwrap_or_else(|| panic!("{var}={s:?} is not a u64 (decimal, or hex with 0x)"))
        }
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            // Short enough to type; the two tests of one run get different seeds.
            mix(nanos ^ spec.salt ^ u64::from(std::process::id()) << 20) % 1_000_000_000
        }
    }
}

/// SplitMix64's finalizer.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded draw in [0, 1) for decision `n` about `key`: independent of the interleaving.
pub(crate) fn roll(seed: u64, salt: u64, key: &str, n: u32) -> f64 {
    let mut h = mix(seed ^ salt);
    for b in key.bytes() {
        h = mix(h ^ u64::from(b));
    }
    h = mix(h ^ u64::from(n));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

pub(crate) fn label_of(e: &Envelope) -> String {
    e.headers
        .get(LABEL)
        .cloned()
        .unwrap_or_else(|| format!("<unlabelled {}>", e.event_id))
}

/// An injected duplicate or out-of-order version (labels are `<agg>/v<version>/<kind><n>`).
pub(crate) fn is_injected_duplicate(label: &str) -> bool {
    label
        .rsplit('/')
        .next()
        .is_some_and(|k| k.starts_with("dup"))
}

pub(crate) fn stderr_line(line: &str) {
    // Past the harness's output capture, so the seed is in the log even if the run hangs.
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// One run.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Spec {
    /// The test's name (in messages and the replay command).
    pub test: &'static str,
    /// The claim mode.
    pub mode: ClaimMode,
    /// How long the producers append.
    pub produce: Duration,
    /// Salt of the seed derived from the time.
    pub salt: u64,
    /// The run lengths the relays ask for (`RelayConfig::run`), one drawn per relay from the
    /// seed. Default `[1]`: heads only.
    pub runs: &'static [usize],
    /// Whether the store hands out runs. `false` (a store that ignores `run`): every claim
    /// must hold heads only, whatever the relays ask for.
    pub runs_supported: bool,
}

impl Spec {
    /// The lease run (`<prefix>_RANDOM_SECS` of production, default 15 s).
    pub fn lease(test: &'static str, prefix: &str) -> Self {
        Self {
            test,
            mode: ClaimMode::lease(LEASE).expect("a valid lease"),
            produce: Duration::from_secs_f64(production_secs(prefix)),
            salt: 0x4c45_4153,
            runs: &[1],
            runs_supported: true,
        }
    }

    /// Relays ask for runs: each draws its length from `lengths` (seeded; empty is `[1]`).
    /// `supported`: whether the store hands out runs (checked: a store that does not must
    /// hand out heads only; one that does must hand out at least one run).
    pub fn with_runs(mut self, lengths: &'static [usize], supported: bool) -> Self {
        self.runs = if lengths.is_empty() { &[1] } else { lengths };
        self.runs_supported = supported;
        self
    }

    /// Another production time (the lease run's default is `<PREFIX>_RANDOM_SECS`).
    pub fn producing_for(mut self, produce: Duration) -> Self {
        self.produce = produce;
        self
    }

    /// The locked-transaction run (60 % of the lease run's production time).
    pub fn locked(test: &'static str, prefix: &str) -> Self {
        Self {
            test,
            mode: ClaimMode::LockedTransaction,
            produce: Duration::from_secs_f64(production_secs(prefix) * 0.6),
            salt: 0x4c4f_434b,
            runs: &[1],
            runs_supported: true,
        }
    }
}

/// Runs `spec` against `backend` and panics with the findings (and the seed) when a check
/// fails. Call it from a `#[tokio::test(flavor = "multi_thread")]`.
pub async fn run<B: RandomizedBackend>(backend: B, spec: Spec) {
    let backend = Arc::new(backend);
    let seed = seed_for(&spec, backend.env_prefix());
    stderr_line(&format!(
        "{}: seed {seed} (replay: {})",
        spec.test,
        backend.replay_command(spec.test, seed)
    ));
    let locked = spec.mode == ClaimMode::LockedTransaction;
    let world = Arc::new(World {
        test: spec.test,
        seed,
        location: backend.location(),
        t0: Instant::now(),
        locked_hold: locked.then_some(LOCKED_HOLD),
        heads_only: !spec.runs_supported,
        claim_life: if locked { LOCKED_HOLD } else { LEASE },
        claims: Mutex::default(),
        broker: Mutex::default(),
        ops: Mutex::default(),
        violations: Mutex::default(),
        tally: Mutex::default(),
        committed: Mutex::default(),
        rolled_back: Mutex::default(),
        op_counts: Mutex::default(),
    });
    let env = Env {
        world: world.clone(),
        backend: backend.clone(),
        spec,
    };
    let op_store = env.store();
    backend.prepare(&op_store).await.expect("prepare the store");

    let mut chaos = StdRng::seed_from_u64(mix(seed ^ SALT_CHAOS));
    let batches = [3usize, 8, 20, 50];
    let mut slots: Vec<RelaySlot> = (0..RELAYS)
        .map(|i| {
            let batch = batches[chaos.random_range(0..batches.len())];
            env.spawn_relay(i, 0, batch, i % 2 == 0)
        })
        .collect();

    let until = Instant::now() + spec.produce;
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|i| {
            tokio::spawn(produce(
                world.clone(),
                backend.clone(),
                env.store(),
                i,
                until,
            ))
        })
        .collect();

    // The operator, while the producers run: parked events, and now and then a relay killed.
    let mut st = OperatorState::default();
    let mut failures: Vec<String> = Vec::new();
    let mut stalls = StallWatch::default();
    let mut next_kill = Instant::now() + Duration::from_millis(chaos.random_range(1500..4000));
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(chaos.random_range(80..300))).await;
        operate(&world, &op_store, Phase::Running, &mut st).await;
        stalls.watch(backend.as_ref(), &mut failures).await;
        if Instant::now() >= next_kill {
            let i = chaos.random_range(0..slots.len());
            let release = chaos.random_bool(0.6);
            kill_and_replace(&env, &mut slots[i], release, &mut st).await;
            next_kill = Instant::now() + Duration::from_millis(chaos.random_range(1500..4000));
        }
    }
    let mut injected = Injected::default();
    for p in producers {
        let i = p.await.expect("producer task");
        injected.dup += i.dup;
        injected.gap += i.gap;
        injected.fill += i.fill;
        injected.transactions += i.transactions;
        injected.held_open += i.held_open;
    }
    let produced_at = Instant::now();

    // Drain: the operator retries what can be retried and discards the rest.
    loop {
        operate(&world, &op_store, Phase::Draining, &mut st).await;
        let (pending, parked) = backend.counts().await.expect("count rows");
        if pending == 0 && parked == 0 {
            break;
        }
        if stalls.watch(backend.as_ref(), &mut failures).await {
            break; // it will never drain
        }
        if produced_at.elapsed() > DRAIN_LIMIT {
            let stuck = backend.stuck().await;
            failures.push(format!(
                "check 2 (drain): the backlog did not drain within {DRAIN_LIMIT:?} after the \
                 producers stopped: {pending} pending, {parked} parked; first rows: {stuck:?}"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_in = produced_at.elapsed();
    for s in &slots {
        s.shutdown.trigger();
    }
    for s in slots {
        let owner = s.owner.clone();
        let mut handle = s.handle;
        if tokio::time::timeout(Duration::from_secs(30), &mut handle)
            .await
            .is_err()
        {
            handle.abort();
            failures.push(format!("{owner} did not stop within 30 s of its shutdown"));
        }
    }

    let rows = backend.final_rows().await.expect("final rows");
    let audit = op_store.audit_trail(None).await.expect("audit trail");
    let checked = check(
        &world,
        &rows,
        &audit,
        (st.released_claims, st.uncertain_releases),
        &mut failures,
    );
    let summary = summary(&world, &st, &injected, &checked, spec, drained_in);
    println!("{summary}");
    if !failures.is_empty() {
        panic!(
            "{} failed with seed {seed} ({} findings; {} kept for inspection)\n\
             replay: {}\n\n{}\n\n{summary}",
            spec.test,
            failures.len(),
            world.location,
            backend.replay_command(spec.test, seed),
            digest(&failures)
        );
    }
    backend.finish().await;
}

/// Aggregates that can never move again: pending rows, all of them blocked (outside the
/// candidates, waiting for a predecessor to finish), and no parked row for an operator to act
/// on. Every change that blocks or unblocks a row of an aggregate commits together with the
/// change of its predecessor, so no snapshot shows this state on the way to a healthy one; an
/// aggregate is reported once it shows in a few snapshots in a row (belt and braces), long
/// before the drain limit.
#[derive(Default)]
struct StallWatch {
    seen: HashMap<String, u32>,
    reported: HashSet<String>,
}

impl StallWatch {
    const SNAPSHOTS: u32 = 3;

    /// Whether a stalled aggregate was found (reported in `failures`, once each).
    async fn watch<B: RandomizedBackend>(
        &mut self,
        backend: &B,
        failures: &mut Vec<String>,
    ) -> bool {
        let Ok(rows) = backend.stalled().await else {
            return false;
        };
        let now: HashSet<&str> = rows.iter().map(|(a, ..)| a.as_str()).collect();
        self.seen.retain(|a, _| now.contains(a.as_str()));
        let mut found = false;
        for (agg, pending, rows) in &rows {
            let n = self.seen.entry(agg.clone()).or_default();
            *n += 1;
            if *n >= Self::SNAPSHOTS {
                found = true;
                if self.reported.insert(agg.clone()) {
                    failures.push(format!(
                        "check 2 (stalled aggregate): aggregate {agg} can never drain: its \
                         {pending} pending rows are all blocked and none is parked (seen in {} \
                         snapshots); rows: {rows}",
                        Self::SNAPSHOTS
                    ));
                }
            }
        }
        found
    }
}

fn summary(
    world: &World,
    st: &OperatorState,
    inj: &Injected,
    checked: &Checked,
    spec: Spec,
    drained: Duration,
) -> String {
    let claims = world.claims.lock().unwrap();
    let broker = world.broker.lock().unwrap();
    let ops = world.ops.lock().unwrap();
    let tally = world.tally.lock().unwrap();
    let mut op_counts: BTreeMap<String, usize> = BTreeMap::new();
    for o in ops.iter() {
        *op_counts
            .entry(format!("{}:{}", o.action, o.result))
            .or_default() += 1;
    }
    let labels: HashSet<&str> = ops.iter().map(|o| o.label.as_str()).collect();
    format!(
        "{} (seed {}, {:?}, produced for {:?}, drained in {:?}, total {:?}):\n\
         producer: {} committed, {} rolled back, {} transactions ({} held open), injected {} \
         duplicate/out-of-order, {} gaps, {} late fills\n\
         relays: {} cycles, {} claimed, {} published, {} retried, {} deferred, {} parked, \
         {} superseded, {} released, {} paused; errors {:?}\n\
         store: {} claims, {} completions ({} superseded outcomes), {} releases, parks: {} by \
         completions, {} by claims ({} of them reported by locked claims that then ended \
         without completing, so rolled back); {} gap holds; runs asked {:?}: {} runs handed out \
         ({} events)\n\
         broker: {} calls ({} stalled past the claim), {} deliveries ({} first deliveries), {} \
         hand-overs checked, {} stalled, {} status checks failed ({} records); verdicts {:?}; \
         {} takeovers of an aggregate after a lease expired\n\
         operator: {:?} on {} events, {} parked_event looks, {} relays killed, {} claims \
         released, {} lost connections",
        world.test,
        world.seed,
        spec.mode,
        spec.produce,
        drained,
        world.t0.elapsed(),
        world.committed.lock().unwrap().len(),
        world.rolled_back.lock().unwrap().len(),
        inj.transactions,
        inj.held_open,
        inj.dup,
        inj.gap,
        inj.fill,
        tally.cycles,
        tally.claimed,
        tally.published,
        tally.retried,
        tally.deferred,
        tally.parked,
        tally.superseded,
        tally.released,
        tally.paused,
        tally.errors,
        claims.claims.len(),
        claims.completions,
        claims.superseded,
        claims.releases,
        claims.parks_by_completion,
        claims.parks_by_claim,
        claims.claim_parks_rolled_back,
        claims.gaps_held,
        spec.runs,
        claims.runs_claimed,
        claims.run_events,
        broker.calls,
        broker.long_stalls,
        broker.acks.len(),
        checked.first_deliveries,
        broker.checked,
        broker.stalled,
        broker.status_query_failures,
        broker.unchecked,
        broker.verdicts,
        checked.takeovers,
        op_counts,
        labels.len(),
        st.parked_event_checks,
        st.kills,
        st.released_claims,
        st.connection_errors + st.uncertain_releases,
    )
}
