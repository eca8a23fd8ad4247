//! Adversary pass on the relay's early claim (`RelayConfig::early_claim`) against PostgreSQL,
//! in both claim modes: the early claim racing the completion of the batch in flight, the
//! completion failing after it (before reaching the server, or after committing), the relay
//! dropped between the two, the driver stopped with an early claim outstanding, and (lease
//! mode) an early claim whose lease runs out while the completion is written. The bodies are
//! `outbox_testkit::scenarios::early_claim`, the same as MySQL's
//! (`outbox-mysql/tests/adversary_early_claim.rs`); this file gives each a schema of its own.

mod common;

use std::time::Duration;

use common::backend::PgBackend;
use outbox_core::ClaimMode;
use outbox_testkit::randomized::RandomizedBackend;
use outbox_testkit::scenarios::early_claim as scenario;

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
async fn early_claims_race_completions_lease() {
    let b = backend!(12);
    scenario::early_claim_races_completions_and_keeps_order(&b, lease(30.0)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_claims_race_completions_locked() {
    let b = backend!(12);
    scenario::early_claim_races_completions_and_keeps_order(&b, ClaimMode::LockedTransaction).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_completion_after_the_early_claim_lease() {
    let b = backend!(8);
    scenario::failed_completion_keeps_the_early_claim_and_order(&b, lease(1.5), false).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_completion_after_the_early_claim_locked() {
    let b = backend!(8);
    scenario::failed_completion_keeps_the_early_claim_and_order(
        &b,
        ClaimMode::LockedTransaction,
        false,
    )
    .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_completion_answer_after_the_early_claim_lease() {
    let b = backend!(8);
    scenario::failed_completion_keeps_the_early_claim_and_order(&b, lease(1.5), true).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_completion_answer_after_the_early_claim_locked() {
    let b = backend!(8);
    scenario::failed_completion_keeps_the_early_claim_and_order(
        &b,
        ClaimMode::LockedTransaction,
        true,
    )
    .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_the_early_claim_and_the_completion_lease() {
    let b = backend!(8);
    scenario::crash_between_the_early_claim_and_the_completion(&b, lease(1.5)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_the_early_claim_and_the_completion_locked() {
    let b = backend!(8);
    scenario::crash_between_the_early_claim_and_the_completion(&b, ClaimMode::LockedTransaction)
        .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_the_early_claim_lease() {
    let b = backend!(8);
    scenario::shutdown_releases_the_early_claim(&b, lease(30.0), |relay, stop| {
        outbox_core::driver::run(relay, None, stop)
    })
    .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_the_early_claim_locked() {
    let b = backend!(8);
    scenario::shutdown_releases_the_early_claim(&b, ClaimMode::LockedTransaction, |relay, stop| {
        outbox_core::driver::run(relay, None, stop)
    })
    .await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_claim_whose_lease_ran_out_is_released_not_published() {
    let b = backend!(8);
    scenario::early_claim_whose_lease_ran_out_is_released_not_published(&b, lease(1.5)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_head_beside_the_early_claim_blocks_its_aggregate_lease() {
    let b = backend!(8);
    scenario::parked_head_beside_the_early_claim_blocks_its_aggregate(&b, lease(30.0)).await;
    b.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_head_beside_the_early_claim_blocks_its_aggregate_locked() {
    let b = backend!(8);
    scenario::parked_head_beside_the_early_claim_blocks_its_aggregate(
        &b,
        ClaimMode::LockedTransaction,
    )
    .await;
    b.finish().await;
}
