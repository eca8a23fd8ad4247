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

/// Seeded runs the bug test may take to meet its bug (see the test).
const BUG_ATTEMPTS: u32 = 4;

/// The store's seeded bug: a run goes on past a missing version. Check 6 finds the run that is
/// not consecutive.
///
/// The bug shows only when a claim finds a missing version behind a head it hands out with a
/// run, which one seed's traffic does not always bring (CI, seed 873403852: 19 gaps, none met
/// by a run; the test then passed the store and failed). So the store counts the runs the bug
/// sent past a gap, and each run is judged against that witness: a run that met the bug must
/// fail on check 6 (the checker is blind otherwise), one that did not must pass (else the
/// checker fails a conformant history); a run that did not meet it is followed by another
/// seed, up to [`BUG_ATTEMPTS`]. With `OUTBOX_MEMORY_RANDOM_SEED` set, that seed alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_bug_run_skips_gaps_is_found() {
    const TEST: &str = "seeded_bug_run_skips_gaps_is_found";
    let replay = std::env::var(format!("{PREFIX}_RANDOM_SEED")).is_ok();
    let attempts = if replay { 1 } else { BUG_ATTEMPTS };
    for attempt in 1..=attempts {
        let backend = backend(true);
        let witness = backend.seeded_bug_witness();
        let outcome = tokio::spawn(run(backend, spec(TEST))).await;
        let met = witness();
        match outcome {
            Ok(()) => {
                assert_eq!(
                    met, 0,
                    "attempt {attempt}: the store handed out {met} runs past a missing version \
                     and the checker passed them"
                );
                eprintln!(
                    "{TEST}: attempt {attempt} of {attempts}: no claim met a missing version \
                     behind a run (nothing to find); another seed"
                );
            }
            Err(e) => {
                assert!(e.is_panic(), "attempt {attempt}: {e}");
                let payload = e.into_panic();
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                assert!(
                    message.contains("check 6 (run not consecutive)"),
                    "attempt {attempt}: the run failed, but not on the run check:\n{message}"
                );
                assert!(
                    met > 0,
                    "attempt {attempt}: check 6 failed a history in which the bug never \
                     fired:\n{message}"
                );
                eprintln!("{TEST}: attempt {attempt}: {met} runs past a gap, found by check 6");
                return;
            }
        }
    }
    panic!(
        "{attempts} seeded runs never met a missing version behind a run: the traffic does not \
         exercise the seeded bug"
    );
}
