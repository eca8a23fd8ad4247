//! Claims run generic plans (`plan_cache_mode = force_generic_plan`, `outbox/claim.rs`; a
//! locked claim's completion too, in its transaction): each session plans each statement once
//! and keeps that plan until the server invalidates it (DDL, `ANALYZE`, `VACUUM`). A plan made while the tables
//! were nearly empty, on a server whose autovacuum is off (as here) or has not analyzed them
//! yet, is still the plan when they hold many rows: it must read by key, never scan a table.
//!
//! The plans are the ones the server ran for the store's own statements (`auto_explain` with
//! `ANALYZE` on the relay's one session, see `common::explain`); the check is on the rows each
//! executed node handled, not on node names.

mod common;

use outbox_core::prelude::*;
use outbox_core::ClaimMode;
use outbox_postgres::PostgresOutboxStore;

use common::explain::{busiest_node, explained_pool, plans, Explain, COMPLETION};
use common::{claim, event, lease, publish_all};

/// Aggregates of the grown table, and their versions (20,000 event rows, 2,000 state rows;
/// few aggregates so that the claim of every head stays within the server's lock table beside
/// the other tests).
const AGGREGATES: usize = 2_000;
const VERSIONS: i64 = 10;

/// Most rows any node of a claim, completion or release of 100 events may handle on the grown
/// tables: a scan of either table handles at least 2,000.
const BOUND: f64 = 1_000.0;

/// A relay store whose only session plans its statements while the outbox holds one row,
/// then claims, completes and releases batches of 100 once it holds 20,000: no node of the
/// claims' plans (of a locked completion's) handles more than [`BOUND`] rows.
async fn plans_cached_on_a_nearly_empty_table_still_read_by_key(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = ctx.store(mode).await;
    let explained = explained_pool(1, Explain::AnalyzeJson).await;
    let relay = PostgresOutboxStore::builder(explained.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .build()
        .unwrap();

    // Plans made now, on one row: a claim released, a claim completed, an empty claim.
    store
        .append_many(&ctx.pool, &[event("seed", 1)])
        .await
        .unwrap();
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1);
    relay.release(&b.handle).await.unwrap();
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1);
    publish_all(&relay, &b).await;
    assert!(claim(&relay, "relay", 100).await.records.is_empty());

    // The tables grow: 2,000 aggregates of ten versions (all but the first blocked behind
    // it), each with its state row (a claim of every head, released).
    let evs: Vec<_> = (1..=VERSIONS)
        .flat_map(|v| (0..AGGREGATES).map(move |i| event(&format!("agg-{i}"), v)))
        .collect();
    for chunk in evs.chunks(2_000) {
        store.append_many(&ctx.pool, chunk).await.unwrap();
    }
    let warm = claim(&store, "warm", AGGREGATES).await;
    assert_eq!(warm.records.len(), AGGREGATES, "the heads");
    if mode == ClaimMode::LockedTransaction {
        // A locked claim writes no state row: publish the heads to create them.
        publish_all(&store, &warm).await;
    } else {
        store.release(&warm.handle).await.unwrap();
    }

    // The relay's session, with the plans it made on one row: a claim completed, one released.
    let before = plans(&ctx.schema, "").len();
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 100);
    publish_all(&relay, &b).await;
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 100);
    relay.release(&b.handle).await.unwrap();

    // The claim's statements (candidates, decision) and, in locked mode, the completion, which
    // runs in the claim's transaction; a lease completion or release has a transaction of
    // its own, with custom plans (see `complete_plan.rs`).
    let ran = plans(&ctx.schema, "");
    let ran: Vec<&String> = ran[before..]
        .iter()
        .filter(|p| {
            p.contains("pg_try_advisory_xact_lock")
                || p.contains("AS claimed")
                || mode == ClaimMode::LockedTransaction && p.contains(COMPLETION)
        })
        .collect();
    let expected = if mode == ClaimMode::LockedTransaction {
        5
    } else {
        4
    };
    assert_eq!(
        ran.len(),
        expected,
        "two claims' candidates and decisions (and a locked completion): {ran:#?}"
    );
    for plan in ran {
        let (rows, node) = busiest_node(plan);
        assert!(
            rows < BOUND,
            "a node handled {rows} rows (bound {BOUND}) on tables of {} events and {AGGREGATES} \
             aggregates, with a plan cached on one row: {node}\n{plan}",
            AGGREGATES * VERSIONS as usize + 1
        );
    }
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_plans_cached_on_a_nearly_empty_table_still_read_by_key() {
    plans_cached_on_a_nearly_empty_table_still_read_by_key(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_plans_cached_on_a_nearly_empty_table_still_read_by_key() {
    plans_cached_on_a_nearly_empty_table_still_read_by_key(ClaimMode::LockedTransaction).await;
}
