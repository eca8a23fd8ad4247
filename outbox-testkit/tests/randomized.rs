//! The seeded, randomized concurrency run (`outbox_testkit::randomized`, the same run and
//! history checker as PostgreSQL's and MariaDB's) on the in-memory store, lease mode (its
//! locked mode has no hold limit: a killed relay's locks would stay), with run claims on: each
//! relay asks for runs of 1, 3 or 100 (seeded). No server needed, so it runs everywhere.
//!
//! ```text
//! OUTBOX_MEMORY_RANDOM_SEED=<seed> cargo test -p outbox-testkit --test randomized <test name>
//! ```
//!
//! `OUTBOX_MEMORY_RANDOM_SECS` sets the production time (default 15 s; the tests here use less,
//! see each). The `seeded_bug_*` tests run the store with a deliberate run bug and expect the
//! checker's run check (check 6) to find it.

use std::time::Duration;

use outbox_testkit::randomized::{run, MemoryBackend, Spec};

const PREFIX: &str = MemoryBackend::ENV_PREFIX;
/// Run lengths the relays draw from.
const RUNS: &[usize] = &[1, 3, 100];

/// The in-memory backend of these runs (replayed by this test binary). With `run_skips_gaps`,
/// the store's deliberate run bug: a run goes on past a missing version. (Its other run bug,
/// completions out of prefix order, needs a relay that completes out of order, which
/// `outbox_core::Relay` never does: the checker's prefix check is pinned by its unit tests.)
fn backend(run_skips_gaps: bool) -> MemoryBackend {
    MemoryBackend::replayed_by("randomized").seeded_bug_run_skips_gaps(run_skips_gaps)
}

/// Production time of these runs: the in-memory store is fast, 8 s give thousands of
/// deliveries (unless `OUTBOX_MEMORY_RANDOM_SECS` says otherwise).
fn spec(test: &'static str) -> Spec {
    let spec = Spec::lease(test, PREFIX).with_runs(RUNS, true);
    if std::env::var(format!("{PREFIX}_RANDOM_SECS")).is_ok() {
        spec
    } else {
        spec.producing_for(Duration::from_secs(8))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_lease_relays_with_runs_keep_the_contract() {
    const TEST: &str = "randomized_lease_relays_with_runs_keep_the_contract";
    run(backend(false), spec(TEST)).await;
}

/// The store's seeded bug: a run goes on past a missing version. Check 6 finds the run that is
/// not consecutive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "check 6 (run not consecutive)")]
async fn seeded_bug_run_skips_gaps_is_found() {
    const TEST: &str = "seeded_bug_run_skips_gaps_is_found";
    run(backend(true), spec(TEST)).await;
}
