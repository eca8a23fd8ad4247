//! An append of several versions of one aggregate writes every row above that aggregate's
//! lowest version in the statement `blocked` (`blocked_at_insert`, `src/outbox/append.rs`):
//! the flags at insert, a drain of such a batch by the real relay in both claim modes (with and
//! without runs), the first claim writing none of a burst's rows, and batches whose lowest
//! version is stale or is an aggregate's first under `accept_first_version`.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, Relay, RelayConfig, SystemClock};
use outbox_postgres::PostgresOutboxStore;
use outbox_testkit::MemoryLog;
use rand::SeedableRng;
use sqlx::Row;

use common::{claim, event, lease, publish_all, versions, Ctx};

/// (aggregate id, version) -> blocked, of every row of the table.
async fn flags(ctx: &Ctx) -> BTreeMap<(String, i64), bool> {
    sqlx::query(&format!(
        "SELECT aggregate_id, aggregate_version, blocked FROM \"{}\".outbox_events",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| ((r.get(0), r.get(1)), r.get(2)))
    .collect()
}

/// Rows not published, or still blocked: (aggregate id, version, status, blocked).
async fn left_over(ctx: &Ctx) -> Vec<(String, i64, String, bool)> {
    sqlx::query(&format!(
        "SELECT aggregate_id, aggregate_version, status, blocked FROM \"{}\".outbox_events \
         WHERE status <> 'published' OR blocked ORDER BY aggregate_id, aggregate_version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// version -> `xmin` of aggregate `agg`'s rows above version 1.
async fn xmins(ctx: &Ctx, agg: &str) -> HashMap<i64, String> {
    sqlx::query(&format!(
        "SELECT aggregate_version, xmin::text FROM \"{}\".outbox_events \
         WHERE aggregate_id = $1 AND aggregate_version > 1",
        ctx.schema
    ))
    .bind(agg)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Runs a relay (batches of 4, runs of `run`) over `store` until the log holds `want` records
/// or 30 s passed; returns each aggregate's published versions in the log's order.
async fn drain(store: PostgresOutboxStore, run: usize, want: usize) -> BTreeMap<String, Vec<i64>> {
    let log = MemoryLog::new("orders", 1);
    let config = RelayConfig::builder()
        .owner("relay")
        .batch_size(4)
        .run(run)
        .idle(Duration::from_millis(5), Duration::from_millis(20))
        .build()
        .expect("relay config");
    let mut relay = Relay::new(
        store,
        log.clone(),
        config,
        Arc::new(SystemClock),
        Box::new(rand::rngs::StdRng::seed_from_u64(7)),
    )
    .expect("relay");
    let deadline = Instant::now() + Duration::from_secs(30);
    while log.records("orders", 0).len() < want && Instant::now() < deadline {
        let report = relay.run_once().await.expect("relay cycle");
        if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        } else {
            relay.reset_idle();
        }
    }
    let _ = relay.release_prefetched().await;
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in log.records("orders", 0) {
        let key = String::from_utf8(r.key.expect("keyed by aggregate")).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        out.entry(key)
            .or_default()
            .push(body["v"].as_i64().unwrap());
    }
    out
}

/// One statement carries several aggregates' versions, out of version order and interleaved:
/// each aggregate's lowest version in it is written unblocked and the rest blocked (an
/// aggregate with one event here, and one whose version 1 an earlier transaction appended,
/// included). The real relay then publishes everything, each aggregate in version order, and
/// leaves nothing blocked: in both claim modes, with runs of 1 (each completion promotes the
/// next blocked version) and of 3 (runs read the blocked versions after a head).
#[tokio::test]
async fn a_batch_is_blocked_above_each_aggregates_lowest_version_and_drains_in_order() {
    let ctx = ctx!(6);
    for (mode, run) in [
        (lease(30.0), 1),
        (lease(30.0), 3),
        (ClaimMode::LockedTransaction, 1),
        (ClaimMode::LockedTransaction, 3),
    ] {
        let store = ctx.store(mode).await;
        let tag = format!("{}-{run}", matches!(mode, ClaimMode::Lease { .. }));
        let (a, b, c, e) = (
            format!("a-{tag}"),
            format!("b-{tag}"),
            format!("c-{tag}"),
            format!("e-{tag}"),
        );
        // e's version 1 was appended (and is pending) before the batch.
        store.append(&ctx.pool, &event(&e, 1)).await.unwrap();
        let batch: Vec<Envelope> = [
            (&a, 3),
            (&b, 2),
            (&a, 1),
            (&e, 3),
            (&c, 1),
            (&a, 2),
            (&b, 1),
            (&a, 5),
            (&e, 2),
            (&a, 4),
        ]
        .into_iter()
        .map(|(agg, v)| event(agg, v))
        .collect();
        store.append_many(&ctx.pool, &batch).await.unwrap();

        let got = flags(&ctx).await;
        let want: BTreeMap<(String, i64), bool> = [
            (&a, 1, false),
            (&a, 2, true),
            (&a, 3, true),
            (&a, 4, true),
            (&a, 5, true),
            (&b, 1, false),
            (&b, 2, true),
            (&c, 1, false),
            (&e, 1, false),
            (&e, 2, false),
            (&e, 3, true),
        ]
        .into_iter()
        .map(|(agg, v, blocked)| ((agg.clone(), v), blocked))
        .collect();
        let got_here: BTreeMap<_, _> = got
            .into_iter()
            .filter(|((agg, _), _)| agg.ends_with(&tag))
            .collect();
        assert_eq!(
            got_here, want,
            "{mode:?} run {run}: blocked flags at insert"
        );

        let published = drain(ctx.store(mode).await, run, 11).await;
        let want: BTreeMap<String, Vec<i64>> = [
            (a.clone(), vec![1, 2, 3, 4, 5]),
            (b.clone(), vec![1, 2]),
            (c.clone(), vec![1]),
            (e.clone(), vec![1, 2, 3]),
        ]
        .into_iter()
        .collect();
        assert_eq!(
            published, want,
            "{mode:?} run {run}: every event published once, in version order per aggregate"
        );
        assert_eq!(
            left_over(&ctx).await,
            vec![],
            "{mode:?} run {run}: nothing left unpublished or blocked"
        );
        // The next round's rows are told apart by their aggregate names; clear these.
        sqlx::query(&format!("DELETE FROM \"{}\".outbox_events", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
    }
    ctx.drop().await;
}

/// The first claim after a burst of one aggregate's versions writes none of the burst's rows
/// (the 512 ms `blk` statement of the `hot` benchmark: it blocked every follower in one
/// statement): each row keeps the `xmin` of its append. The claim hands out the head and the
/// other aggregate's event appended after the burst; both modes.
#[tokio::test]
async fn the_first_claim_after_a_burst_writes_none_of_its_rows() {
    let ctx = ctx!(4);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let store = ctx.store(mode).await;
        let hot = format!("hot-{}", matches!(mode, ClaimMode::Lease { .. }));
        let other = format!("other-{}", matches!(mode, ClaimMode::Lease { .. }));
        let burst: Vec<_> = (1..=500).map(|v| event(&hot, v)).collect();
        store.append_many(&ctx.pool, &burst).await.unwrap();
        store.append(&ctx.pool, &event(&other, 1)).await.unwrap();
        let before = xmins(&ctx, &hot).await;
        let b = claim(&store, "r", 100).await;
        // (The previous mode's burst goes on: its next version is claimable too.)
        let mine: Vec<_> = versions(&b)
            .into_iter()
            .filter(|(agg, _)| *agg == hot || *agg == other)
            .collect();
        assert_eq!(mine, vec![(hot.clone(), 1), (other.clone(), 1)], "{mode:?}");
        let after = xmins(&ctx, &hot).await;
        let rewritten = before.iter().filter(|(v, x)| after[*v] != **x).count();
        assert_eq!(rewritten, 0, "{mode:?}: the claim rewrote burst rows");
        publish_all(&store, &b).await;
    }
    ctx.drop().await;
}

/// A batch whose lowest version is at or below the last published one: that row is parked as
/// out of order, the claim that parks it promotes the next, and the versions after it go out in
/// order (both modes, runs of 1).
#[tokio::test]
async fn a_batch_whose_lowest_version_is_stale_parks_it_and_the_rest_flows() {
    let ctx = ctx!(6);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let store = ctx.store(mode).await;
        let agg = format!("stale-{}", matches!(mode, ClaimMode::Lease { .. }));
        for v in 1..=2 {
            store.append(&ctx.pool, &event(&agg, v)).await.unwrap();
            publish_all(&store, &claim(&store, "r", 10).await).await;
        }
        let dup = event(&agg, 2);
        store
            .append_many(&ctx.pool, &[event(&agg, 4), dup.clone(), event(&agg, 3)])
            .await
            .unwrap();
        let published = drain(ctx.store(mode).await, 1, 2).await;
        assert_eq!(published.get(&agg), Some(&vec![3, 4]), "{mode:?}");
        let left: Vec<_> = left_over(&ctx)
            .await
            .into_iter()
            .filter(|r| r.0 == agg)
            .collect();
        assert_eq!(
            left,
            vec![(agg.clone(), 2, "parked".to_owned(), false)],
            "{mode:?}: only the stale duplicate is left, parked"
        );
        store
            .discard_parked(dup.event_id, "ops", "duplicate")
            .await
            .unwrap();
    }
    ctx.drop().await;
}

/// `accept_first_version`: a new aggregate's batch `[7, 5, 6]` starts at its lowest version,
/// which is written unblocked: 5, 6 and 7 go out in that order (both modes).
#[tokio::test]
async fn accept_first_version_starts_a_batch_at_its_lowest_version() {
    let ctx = ctx!(6);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let build = || {
            PostgresOutboxStore::builder(ctx.pool.clone())
                .schema(&ctx.schema)
                .claim_mode(mode)
                .accept_first_version(true)
                .build()
                .expect("build")
        };
        let store = build();
        store.migrate().await.unwrap();
        let agg = format!("first-{}", matches!(mode, ClaimMode::Lease { .. }));
        store
            .append_many(&ctx.pool, &[event(&agg, 7), event(&agg, 5), event(&agg, 6)])
            .await
            .unwrap();
        let published = drain(build(), 1, 3).await;
        assert_eq!(published.get(&agg), Some(&vec![5, 6, 7]), "{mode:?}");
        assert_eq!(left_over(&ctx).await, vec![], "{mode:?}");
    }
    ctx.drop().await;
}
