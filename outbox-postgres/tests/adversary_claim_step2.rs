//! Adversarial tests of claim step 2's own filter (`status = 'pending' AND NOT blocked` in
//! `claim_decide_lease` / `claim_decide_locked`).
//!
//! Step 1 picks candidates in its statement's snapshot and try-locks their aggregates while it
//! scans, so that snapshot predates the locks: a completion that commits after step 1's
//! snapshot was taken, but before step 1 reaches the row's aggregate lock, leaves a row among
//! the candidates that is no longer pending (published), or that the completing claim blocked
//! meanwhile. Step 2, in a snapshot taken after the locks, must not decide about such a row:
//! without its filter it would park a published event as out of order, or hand out a row that
//! is blocked behind the aggregate's order.
//!
//! The window is forced deterministically: the claim under test runs on a pool whose sessions
//! search the test's schema before `pg_catalog`, where a function of the same name stands in
//! for `pg_try_advisory_xact_lock(bigint)`. It first waits for a shared advisory "gate" that the
//! test holds (the claim's step 1 has then taken its snapshot and met the row), logs the key,
//! then takes the real lock. The test waits (through `pg_blocking_pids`) until the claim is
//! blocked on the gate, lets another relay claim and complete, then opens the gate.
//!
//! These tests kill the SQL mutants that drop either predicate (docs/mutants-sql.md). Each test
//! uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::{ClaimMode, ClaimedBatch, Envelope, ParkKind};
use outbox_postgres::PostgresOutboxStore;
use sqlx::PgPool;

use common::stand_in::search_path_pool;
use common::{claim, event, lease, publish_all, versions};

/// First key of the gate (two-key advisory locks never collide with the store's bigint keys).
const GATE_CLASS: i32 = 0x5e_ed02;

fn modes() -> [(ClaimMode, &'static str); 2] {
    [
        (lease(30.0), "lease"),
        (ClaimMode::LockedTransaction, "locked"),
    ]
}

/// A claim paused inside step 1: the pool, its store and the gate's second key.
struct Gated {
    pool: PgPool,
    store: PostgresOutboxStore,
    gate: i32,
}

/// Installs the stand-in for `pg_try_advisory_xact_lock(bigint)` in the test's schema and
/// returns a store (of `mode`, on the migrated schema) whose sessions use it.
async fn gated(ctx: &common::Ctx, mode: ClaimMode) -> Gated {
    let s = &ctx.schema;
    let gate = (uuid::Uuid::new_v4().as_u128() as i32) & 0x7fff_ffff;
    sqlx::query(&format!(
        "CREATE TABLE \"{s}\".gate_log (k int8 NOT NULL, granted bool NOT NULL)"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "CREATE FUNCTION \"{s}\".pg_try_advisory_xact_lock(k int8) RETURNS bool \
         LANGUAGE plpgsql AS $$ \
         DECLARE ok bool; \
         BEGIN \
           PERFORM pg_catalog.pg_advisory_xact_lock_shared({GATE_CLASS}, {gate}); \
           ok := pg_catalog.pg_try_advisory_xact_lock(k); \
           INSERT INTO \"{s}\".gate_log VALUES (k, ok); \
           RETURN ok; \
         END $$"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let pool = search_path_pool(ctx, 2).await;
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(s)
        .claim_mode(mode)
        .build()
        .unwrap();
    Gated { pool, store, gate }
}

async fn pid(conn: &mut sqlx::PgConnection) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Waits until some backend is blocked by backend `holder`.
async fn wait_blocked_by(pool: &PgPool, holder: i32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: Option<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
        )
        .bind(holder)
        .fetch_optional(pool)
        .await
        .unwrap();
        if waiting.is_some() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the claim never reached the gate"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs a claim of `gated` (limit 100) that stops in step 1 at its first candidate, runs
/// `meanwhile` (which must commit), then lets the claim go on; returns the claim's batch.
async fn claim_around<F, Fut>(ctx: &common::Ctx, gated: &Gated, meanwhile: F) -> ClaimedBatch
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut holder = ctx.pool.begin().await.unwrap();
    let holder_pid = pid(&mut holder).await;
    sqlx::query("SELECT pg_advisory_xact_lock($1, $2)")
        .bind(GATE_CLASS)
        .bind(gated.gate)
        .execute(&mut *holder)
        .await
        .unwrap();
    let claiming = {
        let store = gated.store.clone();
        tokio::spawn(async move { claim(&store, "paused", 100).await })
    };
    wait_blocked_by(&ctx.pool, holder_pid).await;
    meanwhile().await;
    holder.commit().await.unwrap();
    claiming.await.unwrap()
}

/// The keys the paused claim's step 1 locked, one per candidate (all granted).
async fn step1_candidates(ctx: &common::Ctx) -> Vec<bool> {
    sqlx::query_scalar(&format!("SELECT granted FROM \"{}\".gate_log", ctx.schema))
        .fetch_all(&ctx.pool)
        .await
        .unwrap()
}

async fn row(ctx: &common::Ctx, e: &Envelope) -> (String, bool, Option<String>) {
    sqlx::query_as(&format!(
        "SELECT status, blocked, park_kind FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

/// A row that another relay published after step 1's snapshot is neither handed out again nor
/// parked (as "at or below the last version") by step 2.
#[tokio::test]
async fn a_row_published_during_step_1_is_neither_claimed_again_nor_parked() {
    for (mode, tag) in modes() {
        let ctx = ctx!(6);
        let other = ctx.store(mode).await;
        let paused = gated(&ctx, mode).await;
        let v1 = event("pub", 1);
        other.append(&ctx.pool, &v1).await.unwrap();
        let o = &other;
        let b = claim_around(&ctx, &paused, move || async move {
            // Step 1 of the paused claim has seen v1 pending; v1 is published meanwhile.
            let c = claim(o, "other", 100).await;
            assert_eq!(versions(&c), vec![("pub".into(), 1)], "{tag}: setup");
            publish_all(o, &c).await;
        })
        .await;
        assert_eq!(
            step1_candidates(&ctx).await,
            vec![true],
            "{tag}: setup: step 1 must pass v1 to step 2"
        );
        assert!(
            b.is_empty(),
            "{tag}: a published row was handed out again: {:?}",
            versions(&b)
        );
        assert!(
            b.parked.is_empty(),
            "{tag}: a published row was parked: {:?}",
            b.parked
        );
        assert_eq!(
            row(&ctx, &v1).await,
            ("published".into(), false, None),
            "{tag}"
        );
        paused.pool.close().await;
        ctx.drop().await;
    }
}

/// A row that the completing claim blocked after step 1's snapshot (it followed the head
/// then) is not handed out by step 2, even when it is blocked behind a stale twin only: the
/// twin is parked first, and the blocked row goes out in a later claim.
#[tokio::test]
async fn a_row_blocked_during_step_1_is_not_handed_out() {
    for (mode, tag) in modes() {
        let ctx = ctx!(6);
        let other = ctx.store(mode).await;
        let paused = gated(&ctx, mode).await;
        // v1, a twin of v1, v2: one aggregate, in this id order, each appended alone (one
        // batch would write v2 blocked: docs/design/hot-aggregate.md).
        let (v1, twin, v2) = (event("blk", 1), event("blk", 1), event("blk", 2));
        for e in [&v1, &twin, &v2] {
            other.append(&ctx.pool, e).await.unwrap();
        }
        let (o, cx, tw, second) = (&other, &ctx, &twin, &v2);
        let b = claim_around(&ctx, &paused, move || async move {
            // Step 1 of the paused claim has seen all three pending and unblocked. The other
            // relay claims v1 (blocking the twin and v2 behind it) and publishes it: the twin
            // is promoted (it is the first blocked row), v2 stays blocked.
            let c = claim(o, "other", 100).await;
            assert_eq!(versions(&c), vec![("blk".into(), 1)], "{tag}: setup");
            publish_all(o, &c).await;
            assert_eq!(
                row(cx, second).await,
                ("pending".into(), true, None),
                "{tag}: setup"
            );
            assert_eq!(
                row(cx, tw).await,
                ("pending".into(), false, None),
                "{tag}: setup"
            );
        })
        .await;
        assert_eq!(
            step1_candidates(&ctx).await,
            vec![true; 3],
            "{tag}: setup: step 1 must pass all three rows to step 2"
        );
        assert!(
            b.is_empty(),
            "{tag}: a row blocked in step 2's snapshot was handed out: {:?}",
            versions(&b)
        );
        assert_eq!(
            b.parked
                .iter()
                .map(|p| (p.event_id, p.kind))
                .collect::<Vec<_>>(),
            vec![(twin.event_id, ParkKind::OutOfOrder)],
            "{tag}: only the stale twin is parked"
        );
        // The twin's park promoted v2: the next claim hands it out.
        let next = claim(&other, "other", 100).await;
        assert_eq!(versions(&next), vec![("blk".into(), 2)], "{tag}");
        publish_all(&other, &next).await;
        assert_eq!(row(&ctx, &v2).await.0, "published", "{tag}");
        paused.pool.close().await;
        ctx.drop().await;
    }
}

/// A lease that a lease relay took on an aggregate after a locked claim's step 1 snapshot (which
/// then showed no lease) makes that locked claim's step 2 wait on the aggregate: the two relays
/// never hold one aggregate at once, even when the lease was taken inside the window. Kills
/// `claim_decide_locked`'s `WHEN c.leased THEN 'wait'` → `'claim'` (the locked relay claimed
/// the event the lease relay was sending).
#[tokio::test]
async fn a_lease_taken_during_step_1_makes_a_locked_claim_wait() {
    let ctx = ctx!(6);
    let leasing = ctx.store(lease(30.0)).await;
    let paused = gated(&ctx, ClaimMode::LockedTransaction).await;
    let v1 = event("lsd", 1);
    leasing.append(&ctx.pool, &v1).await.unwrap();
    let (l, cx, first) = (&leasing, &ctx, &v1);
    let b = claim_around(&ctx, &paused, move || async move {
        // Step 1 of the paused locked claim has seen v1 with no lease. The lease relay claims
        // it now (its claim commits, and with it its try-lock ends).
        let c = claim(l, "leasing", 100).await;
        assert_eq!(versions(&c), vec![("lsd".into(), 1)], "setup");
        assert_eq!(
            row(cx, first).await,
            ("pending".into(), false, None),
            "setup"
        );
    })
    .await;
    assert!(
        b.is_empty(),
        "a locked claim took an aggregate a lease relay holds: {:?}",
        versions(&b)
    );
    // (Checked after the batch: a locked claim that took the row keeps its log uncommitted.)
    assert_eq!(
        step1_candidates(&ctx).await,
        vec![true],
        "setup: step 1 must pass the row to step 2"
    );
    paused.pool.close().await;
    ctx.drop().await;
}
