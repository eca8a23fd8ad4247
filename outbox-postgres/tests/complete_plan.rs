//! The plan of the lease completion with few aggregates (issue 25, BENCHMARKS.md "Few
//! aggregates: the lease completion's release plan"): the release step (`rel`, the update of
//! the aggregate state from the fenced outcomes `f`) must reach the state table through its
//! primary key. Compared with the claim's token as a constant (`a.lease_token = $19`), the
//! planner estimated the state table at about one row (tokens are nearly all NULL) and ran
//! the release as a Seq Scan of the state table with `f` rescanned for every row it found
//! (batch x batch).
//!
//! The plan is the one the server chose for the store's own statement: the store runs over a
//! pool whose sessions load `auto_explain` (every plan sent to the client as a NOTICE), and
//! the test reads the notices sqlx reports (tracing target `sqlx::postgres::notice`). Needs a
//! superuser (`LOAD`) at `DATABASE_URL`, like the other tests; see `common::explain`.
//!
//! With many aggregates (issue 25, commit 7873128): the completion of a batch of about 1,000
//! events over about 1,000 aggregates, heads alone and with runs, all published and a mix of
//! outcomes, must do work linear in the batch. Before that commit the release joined `f` and
//! `pv`, and the promote probed `upd` through correlated `NOT EXISTS`; all three CTEs are
//! estimated at about one row, so each ran as a nested loop over a CTE scan: 1,000 x 1,000
//! rows compared per completion. The check is on the work the executed plan did (auto_explain
//! with `ANALYZE`: rows and loops of every node), not on node names: a hash, merge or keyed
//! join all pass, a rescan per row of the batch does not.

mod common;

use outbox_core::prelude::*;
use outbox_core::{ClaimedBatch, Outcome};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::claim_run;

use common::explain::{busiest_node, explained_pool, plans, Explain, COMPLETION};
use common::{claim, event, lease, park, publish_all, published, retry, Ctx};

/// The indentation of a plan line's node (`->` or the line's first character).
fn depth(line: &str) -> usize {
    line.find("->")
        .unwrap_or_else(|| line.len() - line.trim_start().len())
}

/// Checks a completion plan: no Seq Scan of the state table directly under a Nested Loop
/// (scanned in full, the other side read again for each of its rows), and the release (`CTE
/// rel`) reads the state table by its primary key.
fn check(plan: &str, state: &str) -> Result<(), String> {
    let lines: Vec<&str> = plan.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if !line.contains(&format!("Seq Scan on {state}")) {
            continue;
        }
        let d = depth(line);
        let parent = lines[..i]
            .iter()
            .rev()
            .find(|l| l.contains("->") && depth(l) < d)
            .copied()
            .unwrap_or("");
        if parent.contains("Nested Loop") {
            return Err(format!("Seq Scan of {state} under a Nested Loop"));
        }
    }
    let rel = lines
        .iter()
        .position(|l| l.trim_start().starts_with("CTE rel"))
        .ok_or("no CTE rel in the plan")?;
    let d = depth(lines[rel]);
    let end = lines[rel + 1..]
        .iter()
        .position(|l| !l.trim().is_empty() && depth(l) <= d && !l.contains("->"))
        .map_or(lines.len(), |p| rel + 1 + p);
    let keyed = lines[rel..end].iter().any(|l| {
        (l.contains("Index Scan using") || l.contains("Index Only Scan using"))
            && l.contains(&format!("{state}_pkey on {state}"))
    });
    if !keyed {
        return Err(format!("CTE rel does not read {state} by its primary key"));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_release_keys_the_state_table_with_few_aggregates() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    const AGGREGATES: usize = 200;

    // Cycle 1: 200 aggregates get their state rows (lease released: tokens NULL); the
    // statistics then see what autovacuum sees in the field.
    let v1: Vec<_> = (0..AGGREGATES)
        .map(|i| event(&format!("agg-{i}"), 1))
        .collect();
    store.append_many(&ctx.pool, &v1).await.unwrap();
    let b = claim(&store, "relay", AGGREGATES).await;
    assert_eq!(b.records.len(), AGGREGATES);
    publish_all(&store, &b).await;
    sqlx::raw_sql(&format!(
        "ANALYZE \"{}\".outbox_events_aggregate",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();

    // Cycle 2, completed through a store whose sessions explain every statement.
    let v2: Vec<_> = (0..AGGREGATES)
        .map(|i| event(&format!("agg-{i}"), 2))
        .collect();
    store.append_many(&ctx.pool, &v2).await.unwrap();
    let explained = explained_pool(2, Explain::Text).await;
    let relay = PostgresOutboxStore::builder(explained.clone())
        .schema(&ctx.schema)
        .claim_mode(lease(30.0))
        .build()
        .unwrap();
    let b = claim(&relay, "relay", AGGREGATES).await;
    assert_eq!(b.records.len(), AGGREGATES);
    publish_all(&relay, &b).await;

    let state = "outbox_events_aggregate";
    let plans = plans(&ctx.schema, COMPLETION);
    assert_eq!(plans.len(), 1, "one completion plan: {plans:#?}");
    if let Err(e) = check(&plans[0], state) {
        panic!("{e}:\n{}", plans[0]);
    }
    explained.close().await;
    ctx.drop().await;
}

/// The checker itself, on the two plan shapes of the probe
/// (`benchmarks/probes/complete-lease-plan/plans.txt`), abridged.
#[test]
fn the_checker_tells_the_shapes_apart() {
    let quadratic = "Query Text: WITH ...\n\
        CTE Scan on x  (cost=1..2 rows=1 width=32)\n\
          CTE rel\n\
            ->  Update on outbox_events_aggregate a  (cost=0.00..9.1 rows=1 width=70)\n\
                  ->  Nested Loop  (cost=0.00..9.1 rows=1 width=70)\n\
                        Join Filter: ((a.aggregate_key = f.k))\n\
                        ->  Seq Scan on outbox_events_aggregate a  (cost=0.00..8.5 rows=1 width=6)\n\
                              Filter: (lease_token = $19)\n\
                        ->  CTE Scan on f  (cost=0.00..0.02 rows=1 width=80)\n\
          CTE promote\n\
            ->  Update on outbox_events s\n";
    let keyed = "Query Text: WITH ...\n\
        CTE Scan on x  (cost=1..2 rows=1 width=32)\n\
          CTE rel\n\
            ->  Update on outbox_events_aggregate a  (cost=0.28..8.3 rows=1 width=70)\n\
                  ->  Nested Loop  (cost=0.28..8.3 rows=1 width=70)\n\
                        ->  CTE Scan on f  (cost=0.00..0.02 rows=1 width=80)\n\
                        ->  Index Scan using outbox_events_aggregate_pkey on outbox_events_aggregate a  (cost=0.28..8.29 rows=1 width=6)\n\
                              Index Cond: (aggregate_key = f.k)\n\
          CTE promote\n\
            ->  Update on outbox_events s\n";
    let hashed = keyed.replace(
        "->  Index Scan using outbox_events_aggregate_pkey on outbox_events_aggregate a",
        "->  Hash\n                              ->  Seq Scan on outbox_events_aggregate a",
    );
    let state = "outbox_events_aggregate";
    assert!(check(quadratic, state).is_err());
    assert!(check(keyed, state).is_ok());
    // A hashed state table is no loop over it, but the release does not key it either.
    assert!(check(&hashed, state).is_err());
}

/// A completion plan's busiest node handled fewer than `batch * aggregates / 20` rows: a
/// node that compares each row of the batch with each of its aggregates handles about
/// `batch * aggregates` (half of it on average when a probe stops at its match), a keyed or
/// hashed plan a few rows per row of the batch (and at most the event table once, here
/// under 5 rows per aggregate).
fn assert_no_batch_by_batch_node(plan: &str, batch: usize, aggregates: usize) {
    let (rows, node) = busiest_node(plan);
    let bound = (batch * aggregates / 20) as f64;
    eprintln!("busiest node: {rows} rows (bound {bound}): {node}");
    assert!(
        rows < bound,
        "a node of the completion of {batch} events over {aggregates} aggregates handled \
         {rows} rows (bound {bound}): {node}\n{plan}"
    );
}

/// `aggregates` aggregates of `versions` events each; a first claim that meets every row
/// (so the followers are blocked, and the completions' promote has work), released; fresh
/// statistics; and a relay over a pool whose sessions report their executed plans.
async fn prepare(
    ctx: &Ctx,
    store: &PostgresOutboxStore,
    aggregates: usize,
    versions: i64,
) -> (PostgresOutboxStore, sqlx::PgPool) {
    let evs: Vec<_> = (1..=versions)
        .flat_map(|v| (0..aggregates).map(move |i| event(&format!("agg-{i}"), v)))
        .collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let warm = claim(store, "warm", evs.len()).await;
    assert_eq!(warm.records.len(), aggregates, "the heads");
    store.release(&warm.handle).await.unwrap();
    let blocked: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_events WHERE blocked",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        blocked as usize,
        evs.len() - aggregates,
        "every follower blocked"
    );
    sqlx::raw_sql(&format!(
        "ANALYZE \"{0}\".outbox_events; ANALYZE \"{0}\".outbox_events_aggregate",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let explained = explained_pool(2, Explain::AnalyzeJson).await;
    let relay = PostgresOutboxStore::builder(explained.clone())
        .schema(&ctx.schema)
        .claim_mode(lease(30.0))
        .build()
        .unwrap();
    (relay, explained)
}

/// The aggregate number `i` of `agg-{i}`.
fn index(id: &str) -> usize {
    id.trim_start_matches("agg-").parse().unwrap()
}

fn aggregates_of(batch: &ClaimedBatch) -> usize {
    let ids: std::collections::HashSet<&str> = batch
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.as_str())
        .collect();
    ids.len()
}

/// The latest completion plan of the test's schema, the `n`-th.
fn nth_completion_plan(ctx: &Ctx, n: usize) -> String {
    let all = plans(&ctx.schema, COMPLETION);
    assert_eq!(all.len(), n, "one plan per completion");
    all[n - 1].clone()
}

/// 1,000 heads of 1,000 aggregates: all published (every aggregate's next row promoted), then
/// a third each published, retried and parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_of_a_thousand_heads_do_no_batch_by_batch_work() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    const AGGREGATES: usize = 1_000;
    let (relay, explained) = prepare(&ctx, &store, AGGREGATES, 3).await;

    let b = claim_run(&relay, "relay", AGGREGATES, 1).await;
    assert_eq!(b.records.len(), AGGREGATES);
    publish_all(&relay, &b).await;
    let plan = nth_completion_plan(&ctx, 1);
    assert_no_batch_by_batch_node(&plan, AGGREGATES, AGGREGATES);

    let b = claim_run(&relay, "relay", AGGREGATES, 1).await;
    assert_eq!(b.records.len(), AGGREGATES, "every version 2, promoted");
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| match index(&r.envelope.aggregate_id) % 3 {
            0 => published(&r.envelope, i as i64),
            1 => retry(&r.envelope),
            _ => park(&r.envelope),
        })
        .collect();
    let rep = relay.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, AGGREGATES);
    let plan = nth_completion_plan(&ctx, 2);
    assert_no_batch_by_batch_node(&plan, AGGREGATES, AGGREGATES);
    explained.close().await;
    ctx.drop().await;
}

/// Runs of two versions on 1,000 aggregates (2,000 events): per aggregate both published,
/// the head published and the next retried, the head parked, or the head alone published;
/// then the next claim all published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_of_runs_over_a_thousand_aggregates_do_no_batch_by_batch_work() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    const AGGREGATES: usize = 1_000;
    let (relay, explained) = prepare(&ctx, &store, AGGREGATES, 4).await;

    let b = claim_run(&relay, "relay", 2 * AGGREGATES, 2).await;
    assert_eq!(b.records.len(), 2 * AGGREGATES, "every head and its next");
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .enumerate()
        .filter_map(|(i, r)| {
            let e = &r.envelope;
            let head = r.run_position == 0;
            match (index(&e.aggregate_id) % 4, head) {
                (0, _) | (1 | 3, true) => Some(published(e, i as i64)),
                (1, false) => Some(retry(e)),
                (2, true) => Some(park(e)),
                _ => None,
            }
        })
        .collect();
    let rep = relay.complete(&b.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, AGGREGATES / 4 * (2 + 2 + 1 + 1));
    let plan = nth_completion_plan(&ctx, 1);
    assert_no_batch_by_batch_node(&plan, b.records.len(), AGGREGATES);

    // Parked aggregates wait; the others hand out their next two versions.
    let b = claim_run(&relay, "relay", 2 * AGGREGATES, 2).await;
    assert_eq!(b.records.len(), AGGREGATES / 4 * 3 * 2);
    publish_all(&relay, &b).await;
    let plan = nth_completion_plan(&ctx, 2);
    assert_no_batch_by_batch_node(&plan, b.records.len(), aggregates_of(&b));
    explained.close().await;
    ctx.drop().await;
}
