//! Relays on one PostgreSQL backlog: several relays while producers commit out of id
//! order, a relay that dies between claim and complete, a broker outage longer than the
//! attempt limit, and a lower version whose transaction commits after a higher one. The bodies
//! are `outbox_testkit::scenarios`, the same as MySQL's (`outbox-mysql/tests/relays.rs`); this
//! file gives them a schema of their own per test. (The relays poll here; the NOTIFY wake-up
//! has its own tests, `wake_gate.rs`.)

mod common;

use std::time::Duration;

use common::backend::PgBackend;
use outbox_core::ClaimMode;
use outbox_testkit::randomized::RandomizedBackend;
use outbox_testkit::scenarios;

/// A backend of its own, or `return` when skipping explicitly.
macro_rules! backend {
    ($connections:expr) => {
        match PgBackend::new($connections).await {
            Some(b) => b,
            None => return,
        }
    };
}

fn lease(secs: f64) -> ClaimMode {
    ClaimMode::lease(Duration::from_secs_f64(secs)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_lease_relays_keep_order_and_publish_everything_once() {
    let b = backend!(4 + 3 * 4);
    scenarios::many_relays_keep_order_and_publish_everything_once(&b, lease(30.0), 4).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_locked_relays_keep_order_and_publish_everything_once() {
    let b = backend!(4 + 3 * 3);
    scenarios::many_relays_keep_order_and_publish_everything_once(
        &b,
        ClaimMode::LockedTransaction,
        3,
    )
    .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_claim_and_complete_lease() {
    let b = backend!(8);
    scenarios::crashed_relay_work_is_finished_by_another(&b, lease(1.8)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_claim_and_complete_locked() {
    let b = backend!(8);
    scenarios::crashed_relay_work_is_finished_by_another(&b, ClaimMode::LockedTransaction).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_parks_nothing_and_drains_lease() {
    let b = backend!(6);
    scenarios::broker_outage_parks_nothing_and_drains(&b, lease(30.0)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_parks_nothing_and_drains_locked() {
    let b = backend!(6);
    scenarios::broker_outage_parks_nothing_and_drains(&b, ClaimMode::LockedTransaction).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_lower_version_is_published_first_in_both_modes() {
    let b = backend!(6);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        scenarios::late_lower_version_is_published_first(&b, mode).await;
    }
    b.finish().await;
}
