//! The claim's plans on shapes that drive the decision's less common paths (written as the
//! adversary pass of generic plans for the claim, stop 42). Claims run custom plans
//! (`outbox/claim.rs`, `BEGIN_CLAIM`): generic ones, planned once per session while the tables
//! were small and kept as they grew, were not kept. Run alone under them,
//! `locked_runs_over_deep_and_hot_aggregates` saw the locked completion compare every outcome
//! with every pending row (18,600,000 rows for one completion of 1,000) and
//! `locked_first_versions_of_aggregates_without_state` 320,000; the pass that wrote these
//! tests also saw the decision's `promote` hash-join a scan of the whole table. Run beside
//! each other, the tests' schema changes make the server discard every session's cached
//! plans, so these tests check the plans' shapes, not the plan mode.
//!
//! The relay's only session plans its statements (claim candidates, the decision, and in
//! locked mode the completion, which runs in the claim's transaction) on a nearly empty
//! table, and the tables then grow, without `ANALYZE` (the server's autovacuum is off), into:
//!
//! * followers met in the claim's window (each version appended in a transaction of its own,
//!   so nothing is blocked at insert): `fol` and `blk`, over the rows of the window and behind
//!   it, beside a hot aggregate whose whole backlog `blk` blocks at once;
//! * runs (`run0`, `run`) of up to 50 versions, over deep aggregates and a hot one of
//!   thousands of versions beside a few hundred shallow ones;
//! * version gaps (`gap_hold`, then `gap_park` once the gap timeout passed: `hold`, `prk`)
//!   and stale versions (at or below the last published: `prk` and `promote`);
//! * an aggregate without state under `accept_first_version` (the `unknown_last` read);
//! * the reverse direction: plans made while the event table was large (and the state table
//!   empty), the table drained and cleaned, then filled again.
//!
//! Every executed node of those plans (not of lease completions: see `complete_plan.rs`) must
//! handle a number of rows bounded by the claim's size, well below the grown table's
//! (`common::explain::busiest_node`: rows returned plus rows removed, times loops).
//!
//! Found by these tests and fixed (issue 25): with runs in lease mode, the decision's last
//! step joined the run rows with the leases it took (`run r JOIN ins i ON i.id = r.head`) as
//! a nested loop over two CTE scans, custom plans included: heads x run rows (172,159 rows
//! compared for a claim of 1,000 with runs of 50). The run rows now go out unjoined and the
//! store keeps those whose head it leased.

mod common;

use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimedBatch, ParkKind};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::claim_run;
use sqlx::PgPool;

use common::explain::{busiest_node, explained_pool, plans, Explain, COMPLETION};
use common::{claim, event, lease, publish_all, Ctx};

/// Marker of the claim's candidate scan (step 1).
const CANDIDATES: &str = "pg_try_advisory_xact_lock";
/// Marker of the claim's decision (step 2), lease or locked.
const DECISION: &str = "AS claimed";

/// A relay store over the test's schema whose only session reports the executed plan of every
/// statement it runs.
async fn relay(
    ctx: &Ctx,
    mode: ClaimMode,
    gap_timeout: Option<Duration>,
    accept_first_version: bool,
) -> (PostgresOutboxStore, PgPool) {
    let explained = explained_pool(1, Explain::AnalyzeJson).await;
    let mut b = PostgresOutboxStore::builder(explained.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(accept_first_version);
    if let Some(gap) = gap_timeout {
        b = b.gap_timeout(gap);
    }
    (b.build().unwrap(), explained)
}

/// The relay's session plans its statements while the outbox holds one row (as in
/// `generic_plans.rs`): a claim released, a claim completed, an empty claim.
async fn cache_plans_on_one_row(
    ctx: &Ctx,
    store: &PostgresOutboxStore,
    relay: &PostgresOutboxStore,
) {
    store
        .append_many(&ctx.pool, &[event("seed", 1)])
        .await
        .unwrap();
    let b = claim(relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1);
    relay.release(&b.handle).await.unwrap();
    let b = claim(relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1);
    publish_all(relay, &b).await;
    assert!(claim(relay, "relay", 100).await.records.is_empty());
}

/// `n` aggregates `h-{i}` with version 1 published through `store` (not the relay): the state
/// table holds their rows (last version 1), the event table their published rows.
async fn history(ctx: &Ctx, store: &PostgresOutboxStore, n: usize) {
    let evs: Vec<_> = (0..n).map(|i| event(&format!("h-{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim(store, "history", n).await;
    assert_eq!(b.records.len(), n);
    publish_all(store, &b).await;
}

/// `versions` of aggregates `{prefix}0` to `{prefix}{n - 1}`, each version
/// appended across a group of `group` aggregates in a transaction of its own (one version per
/// aggregate per append: nothing is blocked at insert), group after group: the claim index
/// holds each group's versions next to each other, so a claim's window meets followers.
async fn per_version_appends(
    ctx: &Ctx,
    store: &PostgresOutboxStore,
    prefix: &str,
    n: usize,
    group: usize,
    versions: std::ops::RangeInclusive<i64>,
) -> usize {
    let mut rows = 0;
    for g in (0..n).step_by(group) {
        for v in versions.clone() {
            let evs: Vec<_> = (g..(g + group).min(n))
                .map(|i| event(&format!("{prefix}{i}"), v))
                .collect();
            rows += evs.len();
            store.append_many(&ctx.pool, &evs).await.unwrap();
        }
    }
    rows
}

/// Versions `1..=n` of aggregate `agg`, each in a transaction of its own.
async fn single_appends(ctx: &Ctx, store: &PostgresOutboxStore, agg: &str, n: i64) -> usize {
    for v in 1..=n {
        store
            .append_many(&ctx.pool, &[event(agg, v)])
            .await
            .unwrap();
    }
    n as usize
}

async fn count(ctx: &Ctx, filter: &str) -> usize {
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE {filter}",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    n as usize
}

/// Checks every plan the relay ran since `before` (`plans(..).len()` then) for the claims'
/// candidates and decisions and for completions: at least `claims` candidate scans and
/// decisions, and no node handling `bound` rows or more. Returns the busiest node's rows.
fn check(
    ctx: &Ctx,
    mode: ClaimMode,
    shape: &str,
    before: usize,
    claims: usize,
    bound: f64,
    table: usize,
) -> f64 {
    let all = plans(&ctx.schema, "");
    let locked = mode == ClaimMode::LockedTransaction;
    let ran: Vec<&String> = all[before..]
        .iter()
        .filter(|p| {
            p.contains(CANDIDATES) || p.contains(DECISION) || locked && p.contains(COMPLETION)
        })
        .collect();
    let n = |m: &str| ran.iter().filter(|p| p.contains(m)).count();
    assert!(
        n(CANDIDATES) >= claims && n(DECISION) >= claims,
        "{shape}: {} candidate scans and {} decisions explained, expected at least {claims} each",
        n(CANDIDATES),
        n(DECISION)
    );
    let mut busiest = (0.0, String::new());
    for plan in ran {
        let (rows, node) = busiest_node(plan);
        assert!(
            rows < bound,
            "{shape}: a node handled {rows} rows (bound {bound}) on a table of {table} events, \
             with plans cached before it grew: {node}\n{plan}"
        );
        if rows > busiest.0 {
            busiest = (rows, node);
        }
    }
    eprintln!(
        "{shape}: busiest node {} rows (bound {bound}, table {table}): {}",
        busiest.0, busiest.1
    );
    busiest.0
}

/// Ends a claim: completes every record as published, or releases it.
async fn end(relay: &PostgresOutboxStore, b: &ClaimedBatch, publish: bool) {
    if publish {
        publish_all(relay, b).await;
    } else {
        relay.release(&b.handle).await.unwrap();
    }
}

/// Shape 1: followers met in the window, not blocked at insert. A hot aggregate of 1,200
/// versions appended one per transaction (the first claim meets 99 of its followers and `blk`
/// blocks its whole backlog once), then 2,000 aggregates of 8 versions appended a version at a
/// time across groups of 20 (each window: 20 heads and their followers; `blk` also blocks the
/// versions behind the window).
async fn followers_met_in_the_window(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = ctx.store(mode).await;
    let (relay, explained) = relay(&ctx, mode, None, false).await;
    cache_plans_on_one_row(&ctx, &store, &relay).await;

    history(&ctx, &store, 2_000).await;
    const HOT: i64 = 1_200;
    let mut table = 1 + 2_000 + single_appends(&ctx, &store, "hot", HOT).await;
    table += per_version_appends(&ctx, &store, "f-", 2_000, 20, 1..=8).await;
    assert_eq!(count(&ctx, "blocked").await, 0, "nothing blocked at insert");

    let before = plans(&ctx.schema, "").len();
    // The window: the hot aggregate's first 100 versions; its head is claimed, every later
    // version blocked.
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1, "the hot head alone");
    end(&relay, &b, true).await;
    // Every version after the head blocked by the claim, the next promoted by the completion.
    assert_eq!(
        count(&ctx, "blocked").await,
        HOT as usize - 2,
        "the hot backlog blocked"
    );
    // The hot aggregate's next version (promoted) and the first group's heads and followers.
    let b = claim(&relay, "relay", 100).await;
    assert!(
        b.records.len() > 20,
        "heads of the first group: {}",
        b.records.len()
    );
    end(&relay, &b, false).await;
    let b = claim(&relay, "relay", 100).await;
    assert!(b.records.len() > 20);
    end(&relay, &b, true).await;
    let b = claim_run(&relay, "relay", 200, 10).await;
    assert!(!b.records.is_empty());
    end(&relay, &b, true).await;
    assert!(
        count(&ctx, "blocked").await > HOT as usize,
        "the groups' followers blocked too"
    );

    check(
        &ctx,
        mode,
        "followers in the window",
        before,
        4,
        2_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_followers_met_in_the_window() {
    followers_met_in_the_window(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_followers_met_in_the_window() {
    followers_met_in_the_window(ClaimMode::LockedTransaction).await;
}

/// Shape 2: runs of up to 50. A hot aggregate of 8,000 versions, 20 deep aggregates of 500
/// and 200 shallow ones of 3 (each aggregate appended in one batch: its versions but the first
/// blocked at insert), claims of 1,000 with runs of 50.
async fn runs_over_deep_and_hot_aggregates(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = ctx.store(mode).await;
    let (relay, explained) = relay(&ctx, mode, None, false).await;
    cache_plans_on_one_row(&ctx, &store, &relay).await;

    history(&ctx, &store, 2_000).await;
    let mut table = 1 + 2_000;
    let hot: Vec<_> = (1..=8_000).map(|v| event("hot", v)).collect();
    store.append_many(&ctx.pool, &hot).await.unwrap();
    table += hot.len();
    for i in 0..20 {
        let deep: Vec<_> = (1..=500).map(|v| event(&format!("deep-{i}"), v)).collect();
        store.append_many(&ctx.pool, &deep).await.unwrap();
        table += deep.len();
    }
    let shallow: Vec<_> = (0..200)
        .flat_map(|i| (1..=3).map(move |v| event(&format!("s-{i}"), v)))
        .collect();
    store.append_many(&ctx.pool, &shallow).await.unwrap();
    table += shallow.len();

    let before = plans(&ctx.schema, "").len();
    // 221 heads; the rest of the limit goes to runs, in head order: the hot one's 49, then
    // the deep ones'.
    let b = claim_run(&relay, "relay", 1_000, 50).await;
    assert_eq!(b.records.len(), 1_000);
    assert!(
        b.records.iter().any(|r| r.run_position == 49),
        "a run of 50"
    );
    end(&relay, &b, true).await;
    let b = claim_run(&relay, "relay", 1_000, 50).await;
    assert_eq!(b.records.len(), 1_000);
    end(&relay, &b, false).await;
    let b = claim_run(&relay, "relay", 1_000, 50).await;
    assert_eq!(b.records.len(), 1_000);
    end(&relay, &b, true).await;
    // Fewer than the heads: no budget for runs.
    let b = claim_run(&relay, "relay", 100, 50).await;
    assert_eq!(b.records.len(), 100);
    end(&relay, &b, true).await;

    check(&ctx, mode, "runs of 50", before, 4, 3_000.0, table);
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_runs_over_deep_and_hot_aggregates() {
    runs_over_deep_and_hot_aggregates(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_runs_over_deep_and_hot_aggregates() {
    runs_over_deep_and_hot_aggregates(ClaimMode::LockedTransaction).await;
}

/// Shape 3: version gaps and stale versions, mixed in every window with ordinary heads: per
/// batch of 10 aggregates of each kind, stale (`h-*`, last version 1, versions 1 again to 6:
/// the head is parked out of order and the next promoted), gaps after a known version (`h-*`
/// with versions 3 to 8), gaps of aggregates without state (`g-*`, versions 2 to 7) and
/// ordinary ones (`n-*`, versions 1 to 3). The gaps are held, then parked once the gap timeout
/// has passed.
async fn gaps_and_stale_versions(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = ctx.store(mode).await;
    let gap = Duration::from_millis(300);
    let (relay, explained) = relay(&ctx, mode, Some(gap), false).await;
    cache_plans_on_one_row(&ctx, &store, &relay).await;

    history(&ctx, &store, 2_000).await;
    let mut table = 1 + 2_000;
    for g in (0..1_000).step_by(10) {
        let mut evs = Vec::new();
        for i in g..g + 10 {
            evs.extend((1..=6).map(|v| event(&format!("h-{i}"), v)));
            evs.extend((3..=8).map(|v| event(&format!("h-{}", 1_000 + i), v)));
            evs.extend((2..=7).map(|v| event(&format!("g-{i}"), v)));
            evs.extend((1..=3).map(|v| event(&format!("n-{i}"), v)));
        }
        table += evs.len();
        store.append_many(&ctx.pool, &evs).await.unwrap();
    }

    let before = plans(&ctx.schema, "").len();
    let kinds = |b: &ClaimedBatch, k: ParkKind| b.parked.iter().filter(|p| p.kind == k).count();
    let b = claim(&relay, "relay", 100).await;
    assert!(kinds(&b, ParkKind::OutOfOrder) > 0, "stale versions parked");
    // Held in the table (the batch's count, `gaps_held`, is printed: in locked mode a claim
    // that also parked decides again, and reports that second decision's count).
    eprintln!("gaps held by the first claim ({mode:?}): {}", b.gaps_held);
    let held = "status = 'pending' AND held_since IS NOT NULL";
    assert!(!b.records.is_empty(), "ordinary heads");
    end(&relay, &b, true).await;
    assert!(count(&ctx, held).await > 0, "gaps held");
    let b = claim(&relay, "relay", 100).await;
    assert!(!b.records.is_empty());
    end(&relay, &b, false).await;
    tokio::time::sleep(gap + Duration::from_millis(200)).await;
    let b = claim(&relay, "relay", 100).await;
    assert!(
        kinds(&b, ParkKind::VersionGap) > 0,
        "gaps parked after the timeout"
    );
    end(&relay, &b, true).await;
    let b = claim(&relay, "relay", 100).await;
    end(&relay, &b, true).await;
    assert!(count(&ctx, "status = 'parked'").await > 0);

    check(
        &ctx,
        mode,
        "gaps and stale versions",
        before,
        4,
        2_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_gaps_and_stale_versions() {
    gaps_and_stale_versions(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_gaps_and_stale_versions() {
    gaps_and_stale_versions(ClaimMode::LockedTransaction).await;
}

/// Shape 3b: `accept_first_version`: 2,000 aggregates without state whose first versions are
/// 5 to 12 (appended in groups of 20 aggregates, a version at a time: followers in the
/// window), so every candidate's last version is read from its unfinished rows.
async fn first_versions_of_aggregates_without_state(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(true)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let (relay, explained) = relay(&ctx, mode, None, true).await;
    cache_plans_on_one_row(&ctx, &store, &relay).await;

    history(&ctx, &store, 2_000).await;
    let table = 1 + 2_000 + per_version_appends(&ctx, &store, "u-", 2_000, 20, 5..=12).await;

    let before = plans(&ctx.schema, "").len();
    let b = claim(&relay, "relay", 100).await;
    assert!(b.records.len() >= 20, "heads accepted as first versions");
    assert!(b.records.iter().all(|r| r.envelope.aggregate_version == 5));
    end(&relay, &b, true).await;
    let b = claim(&relay, "relay", 100).await;
    end(&relay, &b, false).await;
    let b = claim_run(&relay, "relay", 300, 10).await;
    assert!(!b.records.is_empty());
    end(&relay, &b, true).await;

    check(
        &ctx,
        mode,
        "first versions without state",
        before,
        3,
        // A claim of 300 with runs of 10 reads up to 8 unfinished versions per head for its
        // first version (2,240 rows in locked mode): linear in the claim, far below the table.
        4_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_first_versions_of_aggregates_without_state() {
    first_versions_of_aggregates_without_state(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_first_versions_of_aggregates_without_state() {
    first_versions_of_aggregates_without_state(ClaimMode::LockedTransaction).await;
}

/// Shape 3c: `accept_first_version` and one hot aggregate without state: 1,500 versions, each
/// appended in a transaction of its own (nothing blocked at insert), so that a claim's window
/// of 33 holds 33 of its versions. Its last version is read from its unfinished rows once per
/// aggregate of the window (`uk`): read once per candidate, the claim read 33 x 1,500 =
/// 49,500 index rows (stop 46). The first claim meets no state row, the second (after a
/// release) a state row without a last version (lease mode).
async fn hot_aggregate_without_state(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .accept_first_version(true)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let (relay, explained) = relay(&ctx, mode, None, true).await;
    let table = single_appends(&ctx, &store, "hot", 1_500).await;
    assert_eq!(count(&ctx, "blocked").await, 0, "nothing blocked at insert");

    let before = plans(&ctx.schema, "").len();
    let b = claim(&relay, "relay", 33).await;
    assert_eq!(b.records.len(), 1, "the hot head alone");
    assert_eq!(b.records[0].envelope.aggregate_version, 1);
    assert!(!b.records[0].maybe_sent_before);
    if mode != ClaimMode::LockedTransaction {
        // A locked claim's writes commit with its completion (or roll back at its release).
        assert_eq!(count(&ctx, "blocked").await, 1_499, "its followers blocked");
    }
    end(&relay, &b, false).await;
    let b = claim(&relay, "relay", 33).await;
    assert_eq!(b.records.len(), 1);
    assert_eq!(b.records[0].envelope.aggregate_version, 1);
    end(&relay, &b, true).await;
    check(
        &ctx,
        mode,
        "hot aggregate without state",
        before,
        2,
        // One read of the aggregate's 1,500 unfinished rows and `blk`'s 1,499: not one read
        // per candidate.
        4_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_hot_aggregate_without_state() {
    hot_aggregate_without_state(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_hot_aggregate_without_state() {
    hot_aggregate_without_state(ClaimMode::LockedTransaction).await;
}

/// Shape 4, the reverse direction: the relay's session plans while the event table holds
/// 20,000 rows (2,000 aggregates of 10 versions, blocked at insert behind their heads) and
/// the state table none; the table is drained (everything published) and cleaned (every row
/// deleted, no VACUUM: the plans stay), so that the state table now holds 2,000 rows and the
/// event table none; then it is filled again with followers met in the window (a hot
/// aggregate appended a version at a time, and versions 11 to 18 of the 2,000 aggregates, a
/// version at a time across groups of 20).
async fn plans_cached_on_a_large_table_drained_and_refilled(mode: ClaimMode) {
    let ctx = ctx!(4);
    let store = ctx.store(mode).await;
    let (relay, explained) = relay(&ctx, mode, None, false).await;
    for g in (0..2_000).step_by(200) {
        let evs: Vec<_> = (g..g + 200)
            .flat_map(|i| (1..=10).map(move |v| event(&format!("a-{i}"), v)))
            .collect();
        store.append_many(&ctx.pool, &evs).await.unwrap();
    }
    // The relay's first statements, on the large table.
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 100);
    end(&relay, &b, true).await;
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 100);
    end(&relay, &b, false).await;
    let b = claim_run(&relay, "relay", 300, 10).await;
    assert_eq!(b.records.len(), 300);
    end(&relay, &b, true).await;

    // Drained and cleaned through another session.
    loop {
        let b = claim_run(&store, "drain", 10_000, 10).await;
        if b.records.is_empty() {
            break;
        }
        publish_all(&store, &b).await;
    }
    let cleaned = store.cleanup(Duration::ZERO, 10_000).await.unwrap();
    assert_eq!(cleaned.removed, 20_000);
    assert_eq!(count(&ctx, "true").await, 0, "an empty event table");

    let mut table = single_appends(&ctx, &store, "hot", 1_200).await;
    table += per_version_appends(&ctx, &store, "a-", 2_000, 20, 11..=18).await;

    let before = plans(&ctx.schema, "").len();
    let b = claim(&relay, "relay", 100).await;
    assert_eq!(b.records.len(), 1, "the hot head alone");
    end(&relay, &b, true).await;
    let b = claim(&relay, "relay", 100).await;
    assert!(b.records.len() > 20);
    end(&relay, &b, false).await;
    let b = claim(&relay, "relay", 100).await;
    assert!(b.records.len() > 20);
    end(&relay, &b, true).await;
    let b = claim_run(&relay, "relay", 200, 10).await;
    assert!(!b.records.is_empty());
    end(&relay, &b, true).await;

    check(
        &ctx,
        mode,
        "cached large, drained, refilled",
        before,
        4,
        2_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_plans_cached_on_a_large_table_drained_and_refilled() {
    plans_cached_on_a_large_table_drained_and_refilled(lease(30.0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_plans_cached_on_a_large_table_drained_and_refilled() {
    plans_cached_on_a_large_table_drained_and_refilled(ClaimMode::LockedTransaction).await;
}

/// Shape 5 (lease mode): claims after leases that ended without outcome or release (expired):
/// their heads are handed out again as possibly sent (`mark`), and the rest of their runs
/// marked as possibly delivered (`mark_run`). 200 aggregates of 80 versions (blocked at insert
/// behind their heads); the relay's leases last 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_claims_after_expired_leases_of_runs() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let short = Duration::from_secs(2);
    let mode = ClaimMode::lease(short).unwrap();
    let (relay, explained) = relay(&ctx, mode, None, false).await;
    cache_plans_on_one_row(&ctx, &store, &relay).await;

    history(&ctx, &store, 2_000).await;
    let mut table = 1 + 2_000;
    for g in (0..200).step_by(50) {
        let evs: Vec<_> = (g..g + 50)
            .flat_map(|i| (1..=80).map(move |v| event(&format!("x-{i}"), v)))
            .collect();
        table += evs.len();
        store.append_many(&ctx.pool, &evs).await.unwrap();
    }

    let before = plans(&ctx.schema, "").len();
    // 200 heads, the first 60 with runs of 5; never completed nor released.
    let b = claim_run(&relay, "relay", 500, 5).await;
    assert_eq!(b.records.len(), 500);
    tokio::time::sleep(short + Duration::from_millis(500)).await;
    // Every head again, possibly sent; the expired runs' rows marked.
    let b = claim_run(&relay, "relay", 400, 2).await;
    assert_eq!(b.records.len(), 400);
    let resent = b.records.iter().filter(|r| r.maybe_sent_before).count();
    assert!(
        resent >= 200 + 60,
        "heads and run rows possibly sent: {resent}"
    );
    end(&relay, &b, true).await;
    assert!(count(&ctx, "maybe_delivered AND status = 'pending'").await >= 60 * 3);
    let b = claim_run(&relay, "relay", 400, 2).await;
    assert_eq!(b.records.len(), 400);
    end(&relay, &b, true).await;

    check(
        &ctx,
        mode,
        "expired leases of runs",
        before,
        3,
        2_000.0,
        table,
    );
    explained.close().await;
    ctx.drop().await;
}
