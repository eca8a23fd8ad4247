//! The seeded, randomized, time-bounded concurrency run (issue 9, item 1) against a real
//! PostgreSQL, in both claim modes: four relays with prefetch and kills, two producers with
//! rollbacks, duplicates, gaps and late fills, a fake broker with every failure and stalls past
//! the claim's life, an operator retrying, discarding and re-issuing. The run and its checks
//! are `outbox_testkit::randomized` (shared with `outbox-mysql`'s run, one history checker);
//! this file gives it PostgreSQL stores and reads of the raw table. See that module for the
//! checks and for how they stay exact under a slow machine. Each relay asks for runs of 1, 3
//! or 100 (drawn from the seed; issue 25), so check 6 judges the run claims and their
//! completions beside the relays that claim heads only.
//!
//! The seed is printed at the start of each test (past the output capture) and in every
//! failure:
//!
//! ```text
//! OUTBOX_PG_RANDOM_SEED=<seed> cargo test -p outbox-postgres --test randomized <test name>
//! ```
//!
//! `OUTBOX_PG_RANDOM_SECS` sets the production time of the lease run (default 15 s; the locked
//! run gets 60 % of it). The `regression_*` tests at the end reproduce, deterministically, the
//! store defects this test found.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{AckMetadata, ClaimMode, ClaimRequest, EventId, Outcome, StoreErrorKind};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::randomized::{run, Spec};

use common::backend::{PgBackend, PREFIX};

/// The run lengths the relays ask for (`RelayConfig::run`), one drawn per relay from the seed:
/// heads only, short runs, and runs longer than any batch.
const RUNS: &[usize] = &[1, 3, 100];

/// Four relays (a locked claim holds a connection of its own), two producers, the operator,
/// the stores' transactions.
const CONNECTIONS: u32 = 4 + 3 * 4 + 2 + 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_lease_relays_operator_and_crashes_keep_the_contract() {
    const TEST: &str = "randomized_lease_relays_operator_and_crashes_keep_the_contract";
    let Some(backend) = PgBackend::new(CONNECTIONS).await else {
        return;
    };
    run(backend, Spec::lease(TEST, PREFIX).with_runs(RUNS, true)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_locked_relays_operator_and_crashes_keep_the_contract() {
    const TEST: &str = "randomized_locked_relays_operator_and_crashes_keep_the_contract";
    let Some(backend) = PgBackend::new(CONNECTIONS).await else {
        return;
    };
    run(backend, Spec::locked(TEST, PREFIX).with_runs(RUNS, true)).await;
}

// ---------------------------------------------------------------------------------------------
// Regression found by the randomized run

/// REGRESSION, found by the locked-mode run above (seed 407991146): when the server ends a
/// locked claim's transaction (`idle_in_transaction_session_timeout`, what
/// `locked_max_hold` sets; a relay stalled past it), the completion must report the claim as
/// lost (`LeaseLost`, transient), as `complete` intends for a lost claim transaction. The
/// server's answer is SQLSTATE 25P03, which was mapped to `Other` (permanent): a relay, a
/// dashboard or an alert then sees a permanent store failure where only a claim ended.
#[tokio::test]
async fn regression_completion_of_a_locked_claim_ended_by_the_server_is_lease_lost() {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .locked_max_hold(Duration::from_millis(300))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let e = common::event("stalled", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let batch = store
        .claim(&ClaimRequest::new("stalled-relay", 10))
        .await
        .unwrap();
    assert_eq!(batch.records.len(), 1);
    // The relay stalls past locked_max_hold: the server ends the claim's transaction.
    tokio::time::sleep(Duration::from_millis(900)).await;
    let ack = Outcome::Published {
        event_id: e.event_id,
        ack: AckMetadata::kafka("orders", 0, 0),
    };
    let err = store
        .complete(&batch.handle, &[ack])
        .await
        .expect_err("the server ended the claim's transaction; nothing can be recorded");
    assert_eq!(
        (err.kind, err.class),
        (
            StoreErrorKind::LeaseLost,
            outbox_core::ErrorClass::Transient
        ),
        "a completion whose claim the server ended must report the claim lost, got: {err}"
    );
    // The event was not recorded and is claimable again.
    let again = store
        .claim(&ClaimRequest::new("next-relay", 10))
        .await
        .unwrap();
    assert_eq!(again.records.len(), 1);
    store.release(&again.handle).await.unwrap();
    ctx.drop().await;
}

/// REGRESSION, found by the lease-mode run above (seed 754663211, aggregate `p0-a91`): a
/// re-issue must leave the aggregate able to move. Version 1 is parked; a duplicate of version
/// 1 (and version 2) arrive meanwhile and are blocked behind it, as followers of the parked
/// head. The re-issue discards the original and appends the copy at version 1 with a new,
/// higher id, so the blocked duplicate (lower id) becomes the aggregate's head; a discard
/// unblocks the next blocked row at that point, a re-issue did not: the head stayed blocked
/// (outside the claim index), the first claim blocked the copy as its follower, and the
/// aggregate never moved again, with nothing parked for an operator to act on.
#[tokio::test]
async fn regression_reissue_with_a_blocked_duplicate_of_the_version_keeps_the_aggregate_moving() {
    for mode in [
        ClaimMode::lease(Duration::from_secs(30)).unwrap(),
        ClaimMode::LockedTransaction,
    ] {
        let ctx = ctx!(4);
        let store = PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .claim_mode(mode)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let agg = format!("reissued-{}", matches!(mode, ClaimMode::Lease { .. }));
        let v1 = common::event(&agg, 1);
        store.append(&ctx.pool, &v1).await.unwrap();
        let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
        assert_eq!(b.records.len(), 1, "{mode:?}");
        let park = Outcome::Park {
            event_id: v1.event_id,
            reason: outbox_core::ParkReason {
                kind: outbox_core::ParkKind::PermanentError,
                error: outbox_core::LastError {
                    class: outbox_core::ErrorClass::Permanent,
                    kind: "invalid_record".into(),
                    message: "rejected".into(),
                },
            },
        };
        store.complete(&b.handle, &[park]).await.unwrap();
        // A duplicate of version 1 and version 2 arrive while version 1 is parked.
        let (dup, v2) = (common::event(&agg, 1), common::event(&agg, 2));
        store
            .append_many(&ctx.pool, &[dup.clone(), v2.clone()])
            .await
            .unwrap();
        let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
        assert!(
            b.is_empty(),
            "{mode:?}: the parked head blocks its aggregate"
        );
        let copy = store
            .reissue_parked(v1.event_id, "ops", "fixed the payload")
            .await
            .unwrap();
        // The aggregate moves on: the duplicate (first in version, then append order) goes
        // out, the copy is then out of order.
        let mut claimed = Vec::new();
        for _ in 0..3 {
            let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
            claimed.extend(b.records.iter().map(|r| r.envelope.event_id));
            if !b.is_empty() {
                store.release(&b.handle).await.unwrap();
                break;
            }
        }
        let stuck: Vec<(i64, bool, String)> = sqlx::query_as(&format!(
            "SELECT aggregate_version, blocked, status FROM {} WHERE aggregate_id = $1 \
             AND status IN ('pending', 'parked') ORDER BY aggregate_version, id",
            outbox_postgres::qualified(&ctx.schema, "outbox_events")
        ))
        .bind(&agg)
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            claimed,
            vec![dup.event_id],
            "{mode:?}: after re-issuing version 1 (copy {copy}) nothing of the aggregate could \
             be claimed; its unfinished rows (version, blocked, status): {stuck:?}"
        );
        ctx.drop().await;
    }
}

/// REGRESSION (found by the locked-mode run above, seed 946945909, aggregate `p1-a22`; fixed):
/// in locked-transaction mode a claim that hands out events keeps its transaction open until
/// the completion, and the version parks it made (`ClaimedBatch::parked`: a gap past the gap
/// timeout, a stale version) were writes of that transaction. When the claim ended without a
/// completion (released at shutdown, the relay killed, or ended by the server past
/// `locked_max_hold`) the parks rolled back with it, although the claim had reported them and
/// the relay had logged and counted them as parked. Parks now commit on their own before the
/// claim's aggregates are locked again.
#[tokio::test]
async fn regression_locked_claim_reports_parks_that_roll_back_with_the_claim() {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(ClaimMode::LockedTransaction)
        .gap_timeout(Duration::from_millis(50))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    // Version 1 of `gapped` is missing; `other` gives the claim something to hand out.
    let (gapped, other) = (common::event("gapped", 2), common::event("other", 1));
    store.append(&ctx.pool, &gapped).await.unwrap();
    // The first claim holds the gap (its timeout counts from here).
    let held = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    assert!(held.is_empty() && held.gaps_held == 1);
    store.append(&ctx.pool, &other).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // past the gap timeout
    let b = store.claim(&ClaimRequest::new("r", 10)).await.unwrap();
    let handed: Vec<EventId> = b.records.iter().map(|r| r.envelope.event_id).collect();
    let parked: Vec<EventId> = b.parked.iter().map(|p| p.event_id).collect();
    assert_eq!(
        (handed, parked),
        (vec![other.event_id], vec![gapped.event_id])
    );
    // The relay gives the batch back (shutdown; a crash or the server's timeout is the same).
    store.release(&b.handle).await.unwrap();
    let status: String = sqlx::query_scalar(&format!(
        "SELECT status FROM {} WHERE event_id = $1",
        outbox_postgres::qualified(&ctx.schema, "outbox_events")
    ))
    .bind(gapped.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        status, "parked",
        "the claim reported {} parked as a version gap, but the park rolled back with the \
         released claim",
        gapped.event_id
    );
    ctx.drop().await;
}
