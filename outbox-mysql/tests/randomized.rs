//! The seeded, randomized, time-bounded concurrency run against a real MySQL/MariaDB, in both
//! claim modes: four relays with prefetch and kills, two producers with rollbacks, duplicates,
//! gaps and late fills, a fake broker with every failure and stalls past the claim's life, an
//! operator retrying, discarding and re-issuing. The run and its checks are
//! `outbox_testkit::randomized`, the same as PostgreSQL's (one history checker); this file
//! gives it MySQL stores and reads of the raw table. The relays ask for runs of 1, 3 or 100
//! (seeded), which this store ignores (allowed): check 6 then holds it to heads only.
//!
//! ```text
//! OUTBOX_MYSQL_RANDOM_SEED=<seed> cargo test -p outbox-mysql --test randomized <test name>
//! ```
//!
//! `OUTBOX_MYSQL_RANDOM_SECS` sets the production time of the lease run (default 15 s; the
//! locked run gets 60 % of it).

mod common;

use common::backend::{MyBackend, PREFIX};
use outbox_testkit::randomized::{run, Spec};

/// The run lengths the relays ask for (`RelayConfig::run`), one drawn per relay from the seed:
/// heads only, short runs, and runs longer than any batch.
const RUNS: &[usize] = &[1, 3, 100];

/// Four relays (a locked claim holds a connection of its own), two producers, the operator,
/// the stores' transactions.
const CONNECTIONS: u32 = 4 + 3 * 4 + 2 + 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_lease_relays_operator_and_crashes_keep_the_contract() {
    const TEST: &str = "randomized_lease_relays_operator_and_crashes_keep_the_contract";
    let Some(backend) = MyBackend::new(CONNECTIONS).await else {
        return;
    };
    run(backend, Spec::lease(TEST, PREFIX).with_runs(RUNS, false)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_locked_relays_operator_and_crashes_keep_the_contract() {
    const TEST: &str = "randomized_locked_relays_operator_and_crashes_keep_the_contract";
    let Some(backend) = MyBackend::new(CONNECTIONS).await else {
        return;
    };
    run(backend, Spec::locked(TEST, PREFIX).with_runs(RUNS, false)).await;
}
