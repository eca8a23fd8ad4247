//! Adversary pass on append-time blocking (`blocked_at_insert`, outbox/append.rs) during a
//! rolling upgrade: the new `append_many` writes every version of a batch above each
//! aggregate's lowest one `blocked = true`, and relays or operators of OLDER versions, which
//! never saw such rows written by an append, run beside it. Those versions only unblock a row
//! through their own `promote` (stale park) and `promote_after` (publication, discard): if
//! any of their paths that finish a batch's unblocked row did not promote, the batch would
//! stay blocked for good.
//!
//! The older relays are not invented: `old_relay/` runs the verbatim SQL of `src/sql.rs` at
//! `1522a56^` (version 10, the last before runs) and at `96643ee^` (version 5, before
//! migration 6), driven as their Rust code drove it (see `old_relay/mod.rs`). Version 10 runs
//! on the current schema; version 5 writes `ack_topic` (renamed by migration 8) and runs on a
//! schema of migration 5.
//!
//! Checked in every test: every event is published exactly once (by the completions that
//! applied), in version order per aggregate, or parked where the contract puts it; nothing is
//! left pending (blocked or not); after every round no pending blocked row lacks an unfinished
//! row before it that is claimable or parked above the last version (an orphan nothing would
//! ever promote). Every wait is bounded.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;
mod old_relay;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, Envelope};
use outbox_postgres::PostgresOutboxStore;
use uuid::Uuid;

use common::{event, lease, published, Ctx};
use old_relay::{Kind, OldRelay, Version};

fn table(ctx: &Ctx) -> String {
    format!("\"{}\".outbox_events", ctx.schema)
}

/// A store over the test's schema, migrated or not.
async fn store(ctx: &Ctx, mode: ClaimMode, migrate: bool) -> PostgresOutboxStore {
    let store = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .claim_mode(mode)
        .build()
        .expect("build");
    if migrate {
        store.migrate().await.expect("migrate");
    }
    store
}

/// Appends `events` in one `append_many` statement.
async fn append(ctx: &Ctx, store: &PostgresOutboxStore, events: &[Envelope]) {
    store.append_many(&ctx.pool, events).await.expect("append");
}

/// `n` consecutive versions of `agg` from `from`.
fn batch(agg: &str, from: i64, n: i64) -> Vec<Envelope> {
    (from..from + n).map(|v| event(agg, v)).collect()
}

/// The publications applied so far, in completion order: (aggregate, version, event id).
#[derive(Default)]
struct Log {
    published: Vec<(String, i64, Uuid)>,
}

impl Log {
    /// Per aggregate, the versions in the order they were published.
    fn per_aggregate(&self) -> BTreeMap<String, Vec<i64>> {
        let mut m: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (a, v, _) in &self.published {
            m.entry(a.clone()).or_default().push(*v);
        }
        m
    }

    /// No event published twice; per aggregate strictly increasing versions, equal to `want`.
    fn check(&self, want: &[(&str, Vec<i64>)]) {
        let mut seen = HashSet::new();
        for (a, v, id) in &self.published {
            assert!(seen.insert(*id), "{a} v{v} ({id}) published twice");
        }
        let got = self.per_aggregate();
        for (a, vs) in &got {
            assert!(
                vs.windows(2).all(|w| w[0] < w[1]),
                "{a} published out of version order: {vs:?}"
            );
        }
        let want: BTreeMap<String, Vec<i64>> = want
            .iter()
            .map(|(a, v)| ((*a).to_owned(), v.clone()))
            .collect();
        assert_eq!(got, want, "publications per aggregate");
    }
}

/// A publication: aggregate, version, event id.
type Pub = (String, i64, Uuid);

/// One claim of the old relay, every claimed row published; every outcome must apply.
/// Returns the publications.
async fn old_step(relay: &OldRelay) -> Vec<Pub> {
    let c = relay.claim("old-relay", 10).await;
    let n = c.rows.len();
    let rows = c.rows.clone();
    let outs: Vec<(usize, Kind)> = (0..n).map(|i| (i, Kind::Published)).collect();
    let applied = relay.complete(c, &outs).await;
    assert_eq!(
        applied.len(),
        n,
        "every outcome of a live old claim applies"
    );
    rows.into_iter()
        .map(|r| (r.agg_id, r.version, r.event))
        .collect()
}

/// One claim of the new store (limit 10, runs of `run`), every record published.
async fn new_step(store: &PostgresOutboxStore, run: usize) -> Vec<Pub> {
    let b = store
        .claim(&ClaimRequest::new("new-relay", 10).with_run(run))
        .await
        .expect("claim");
    let outs: Vec<_> = b
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(&r.envelope, i as i64))
        .collect();
    let rep = store.complete(&b.handle, &outs).await.expect("complete");
    assert_eq!(
        rep.applied,
        outs.len(),
        "every outcome of a live claim applies"
    );
    b.records
        .iter()
        .map(|r| {
            let e = &r.envelope;
            (
                e.aggregate_id.clone(),
                e.aggregate_version,
                e.event_id.as_uuid(),
            )
        })
        .collect()
}

/// Pending rows (aggregate, version, blocked), in (aggregate, version) order.
async fn pending(ctx: &Ctx) -> Vec<(String, i64, bool)> {
    sqlx::query_as(&format!(
        "SELECT aggregate_id, aggregate_version, blocked FROM {} WHERE status = 'pending' \
         ORDER BY aggregate_id, aggregate_version, id",
        table(ctx)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// (aggregate, version, status[:park kind]) of every row, in (aggregate, version, id) order.
async fn rows(ctx: &Ctx) -> Vec<(String, i64, String)> {
    sqlx::query_as(&format!(
        "SELECT aggregate_id, aggregate_version, \
                status || CASE WHEN status = 'parked' THEN ':' || park_kind ELSE '' END \
         FROM {} ORDER BY aggregate_id, aggregate_version, id",
        table(ctx)
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Runs `step` until a round claims nothing and nothing is pending, checking for orphans after
/// every round; panics after `rounds` rounds or 20 s (a stall).
async fn drain_with<F, Fut>(ctx: &Ctx, log: &mut Log, rounds: usize, mut step: F)
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Vec<Pub>>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    for round in 0..rounds {
        let pubs = step(round).await;
        let got = pubs.len();
        log.published.extend(pubs);
        common::no_orphans(ctx).await;
        if got == 0 {
            let left = pending(ctx).await;
            if left.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "stalled: pending rows nothing claims: {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    panic!(
        "not drained after {rounds} rounds; pending: {:?}",
        pending(ctx).await
    );
}

/// The schema and the appending store for an old relay of `version`: the current schema
/// (version 10 runs on it), or one of migration 5 (version 5), appended to by the new store
/// without migrating (its append writes only columns of migration 1).
async fn setup(ctx: &Ctx, version: Version) -> PostgresOutboxStore {
    match version {
        Version::V10 => store(ctx, lease(30.0), true).await,
        Version::V5 => {
            common::schema_at_version(ctx, 5).await;
            store(ctx, lease(30.0), false).await
        }
    }
}

/// An old relay alone drains what the new append wrote: a 50-version batch of one aggregate
/// (49 rows written blocked), a batch of three aggregates interleaved and one with its
/// versions reversed, in both claim modes. Each claim of an old relay hands out one version
/// per aggregate (no runs), and only its completion's promotion moves the batch on: 50 claims.
#[tokio::test]
async fn old_relays_alone_drain_batches_the_new_append_wrote_blocked() {
    for version in [Version::V10, Version::V5] {
        for locked in [false, true] {
            let ctx = ctx!(4);
            let new = setup(&ctx, version).await;
            append(&ctx, &new, &batch("hot", 1, 50)).await;
            let mut mixed = Vec::new();
            for v in 1..=4 {
                mixed.push(event("a", v));
                mixed.push(event("b", v));
            }
            mixed.extend((1..=4).rev().map(|v| event("rev", v)));
            append(&ctx, &new, &mixed).await;
            let blocked: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM {} WHERE blocked",
                table(&ctx)
            ))
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
            assert_eq!(
                blocked,
                49 + 3 * 3,
                "the append wrote the followers blocked"
            );

            let relay = OldRelay::new(version, ctx.pool.clone(), &ctx.schema, locked);
            let mut log = Log::default();
            let relay_ref = &relay;
            drain_with(&ctx, &mut log, 200, |_| old_step(relay_ref)).await;
            log.check(&[
                ("a", (1..=4).collect()),
                ("b", (1..=4).collect()),
                ("hot", (1..=50).collect()),
                ("rev", (1..=4).collect()),
            ]);
            ctx.drop().await;
        }
    }
}

/// A relay of version 10 and a new relay (runs of 4) alternate claims on the same aggregates,
/// with more batches appended between rounds (some starting where the last one ended, one
/// with a duplicate of its lowest version, one reversed), and every few rounds the new relay's
/// claim ends without a completion (released) after the old one took a head of the same
/// aggregate. Every version is published once, in order; the duplicate is parked as out of
/// order.
#[tokio::test]
async fn old_and_new_relays_alternate_on_the_same_batches() {
    let ctx = ctx!(6);
    let new = store(&ctx, lease(30.0), true).await;
    let old = OldRelay::new(Version::V10, ctx.pool.clone(), &ctx.schema, false);
    let aggs = ["x", "y", "z"];
    let mut next: BTreeMap<&str, i64> = aggs.iter().map(|a| (*a, 1)).collect();
    let mut dup = None;
    let mut log = Log::default();
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0..80 {
        if round % 3 == 0 && round < 30 {
            // One append_many: 6 versions of each aggregate, interleaved; x reversed; y's
            // lowest version twice in round 9.
            let mut evs = Vec::new();
            for a in aggs {
                let from = next[a];
                let mut vs: Vec<Envelope> = batch(a, from, 6);
                if a == "x" {
                    vs.reverse();
                }
                if a == "y" && round == 9 {
                    let d = event(a, from);
                    dup = Some(d.event_id.as_uuid());
                    vs.insert(3, d);
                }
                evs.extend(vs);
                *next.get_mut(a).unwrap() += 6;
            }
            append(&ctx, &new, &evs).await;
        }
        if round % 5 == 4 {
            // The new relay's claim ends without an outcome.
            let b = new
                .claim(&ClaimRequest::new("new-relay", 10).with_run(4))
                .await
                .unwrap();
            new.release(&b.handle).await.unwrap();
        }
        let pubs = if round % 2 == 0 {
            old_step(&old).await
        } else {
            new_step(&new, 4).await
        };
        let got = pubs.len();
        log.published.extend(pubs);
        common::no_orphans(&ctx).await;
        if round >= 30 && got == 0 && pending(&ctx).await.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stalled: {:?}",
            pending(&ctx).await
        );
    }
    // Whatever is left (none expected), by both in turn.
    let (new_ref, old_ref) = (&new, &old);
    drain_with(&ctx, &mut log, 100, |round| async move {
        if round % 2 == 0 {
            old_step(old_ref).await
        } else {
            new_step(new_ref, 4).await
        }
    })
    .await;
    log.check(&[
        ("x", (1..=60).collect()),
        ("y", (1..=60).collect()),
        ("z", (1..=60).collect()),
    ]);
    let dup = dup.expect("a duplicate was appended");
    let status: String = sqlx::query_scalar(&format!(
        "SELECT status || ':' || COALESCE(park_kind, '') FROM {} WHERE event_id = $1",
        table(&ctx)
    ))
    .bind(dup)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    let dup_published = log.published.iter().any(|p| p.2 == dup);
    assert!(
        status == "parked:out_of_order" || dup_published && status == "published:",
        "the duplicate of y's lowest version: {status}"
    );
    ctx.drop().await;
}

/// A producer replays published versions in one batch (lowest version stale, the rest written
/// blocked behind it), and a duplicate of the stale version rides along: the old relay parks
/// each stale row as out of order, and its claim promotes the next (`promote` on `stale`), so
/// the batch's new versions flow. Old versions 10 and 5.
#[tokio::test]
async fn an_old_relay_parks_a_stale_lowest_version_and_promotes_the_next() {
    for version in [Version::V10, Version::V5] {
        let ctx = ctx!(4);
        let new = setup(&ctx, version).await;
        let relay = OldRelay::new(version, ctx.pool.clone(), &ctx.schema, false);
        let mut log = Log::default();
        append(&ctx, &new, &batch("s", 1, 3)).await;
        let relay_ref = &relay;
        drain_with(&ctx, &mut log, 20, |_| old_step(relay_ref)).await;
        // Replayed: v2, v3 (published), a second v2, then the new v4..v6.
        let mut replay = vec![event("s", 2), event("s", 3), event("s", 2)];
        replay.extend(batch("s", 4, 3));
        append(&ctx, &new, &replay).await;
        assert!(common::blocked(&ctx, "s", 4).await, "v4 written blocked");
        drain_with(&ctx, &mut log, 30, |_| old_step(relay_ref)).await;
        log.check(&[("s", (1..=6).collect())]);
        let got = rows(&ctx).await;
        let parked: Vec<i64> = got
            .iter()
            .filter(|r| r.2 == "parked:out_of_order")
            .map(|r| r.1)
            .collect();
        assert_eq!(parked, vec![2, 2, 3], "{version:?}: {got:?}");
        ctx.drop().await;
    }
}

/// The relay of an old version parks a batch's head (a permanent broker error); the batch's
/// followers, written blocked by the append, wait behind it. The old version's operator
/// retries one parked head and discards another (and one parked in the middle of a batch):
/// its retry makes the head pending again, its discard promotes the next version, and the old
/// relay drains the rest. Old versions 10 and 5.
#[tokio::test]
async fn an_old_operator_retries_or_discards_a_parked_head_with_blocked_followers() {
    for version in [Version::V10, Version::V5] {
        let ctx = ctx!(4);
        let new = setup(&ctx, version).await;
        let relay = OldRelay::new(version, ctx.pool.clone(), &ctx.schema, false);
        let mut evs = batch("retried", 1, 6);
        evs.extend(batch("discarded", 1, 6));
        evs.extend(batch("middle", 1, 6));
        append(&ctx, &new, &evs).await;
        let id = |agg: &str, v: i64| {
            evs.iter()
                .find(|e| e.aggregate_id == agg && e.aggregate_version == v)
                .unwrap()
                .event_id
                .as_uuid()
        };
        let mut log = Log::default();
        // Claim 1: the three heads; "retried" and "discarded" are parked by the relay, "middle"
        // v1 published. Claim 2: "middle" v2 published. Claim 3: "middle" v3 parked.
        for (n, park) in [
            (3, vec!["retried", "discarded"]),
            (1, vec![]),
            (1, vec!["middle"]),
        ] {
            let c = relay.claim("old-relay", 10).await;
            assert_eq!(c.rows.len(), n, "{version:?}: {:?}", c.actions);
            let outs: Vec<(usize, Kind)> = c
                .rows
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let k = if park.contains(&r.agg_id.as_str()) {
                        Kind::Park
                    } else {
                        Kind::Published
                    };
                    (i, k)
                })
                .collect();
            let rows = c.rows.clone();
            let applied = relay.complete(c, &outs).await;
            assert_eq!(applied.len(), rows.len());
            for (r, (_, k)) in rows.into_iter().zip(&outs) {
                if matches!(k, Kind::Published) {
                    log.published.push((r.agg_id, r.version, r.event));
                }
            }
        }
        common::no_orphans(&ctx).await;
        assert_eq!(
            old_step(&relay).await,
            vec![],
            "everything waits behind a park"
        );
        assert!(common::blocked(&ctx, "retried", 2).await);

        relay.retry(id("retried", 1)).await.expect("old retry");
        relay
            .discard(id("discarded", 1))
            .await
            .expect("old discard");
        relay.discard(id("middle", 3)).await.expect("old discard");
        let relay_ref = &relay;
        drain_with(&ctx, &mut log, 40, |_| old_step(relay_ref)).await;
        log.check(&[
            ("discarded", (2..=6).collect()),
            ("middle", vec![1, 2, 4, 5, 6]),
            ("retried", (1..=6).collect()),
        ]);
        ctx.drop().await;
    }
}

/// The migrations of versions 8 to 10 on top of `common::schema_at_version(ctx, 7)`, recorded
/// as applied: the schema a relay of version 10 ran on (then `migrate()` applies 11 alone).
async fn schema_at_version_10(ctx: &Ctx) {
    common::schema_at_version(ctx, 7).await;
    let render = |sql: &str| {
        sql.replace("__SCHEMA__", &ctx.schema)
            .replace("__TABLE__", "outbox_events")
    };
    for m in [
        include_str!("../src/migrations/0008_outbox.sql"),
        include_str!("../src/migrations/0008_outbox_validate.sql"),
        include_str!("../src/migrations/0009_outbox.sql"),
        include_str!("../src/migrations/0010_outbox.sql"),
    ] {
        sqlx::raw_sql(&render(m)).execute(&ctx.pool).await.unwrap();
    }
    sqlx::raw_sql(&format!(
        "INSERT INTO \"{}\".outbox_schema_migrations (object, version, description) \
         VALUES ('outbox:outbox_events', 8, 'v8'), ('outbox:outbox_events', 9, 'v9'), \
                ('outbox:outbox_events', 10, 'v10')",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
}

/// A schema of migration 10 with version 10 relays on it, the new store appending batches
/// before it migrates (an application upgraded before its relays): a lease claim of the old
/// relay is live and a locked claim of the old relay is open when `migrate()` starts. The
/// migration waits for the locked claim, which completes (publication and promotion) and
/// commits; an old claim started meanwhile waits for the migration; the old lease completes
/// after the migration. The new relay (runs of 3) then drains everything in order, nothing
/// left blocked.
#[tokio::test]
async fn migration_11_beside_old_claims_on_batches_the_new_append_wrote_blocked() {
    let ctx = ctx!(8);
    schema_at_version_10(&ctx).await;
    let new = store(&ctx, lease(30.0), false).await;
    let mut evs = batch("leased", 1, 5);
    evs.extend(batch("locked", 1, 5));
    append(&ctx, &new, &evs).await;
    append(&ctx, &new, &batch("late", 1, 5)).await;
    assert!(common::blocked(&ctx, "locked", 2).await && common::blocked(&ctx, "late", 5).await);
    let old_lease = OldRelay::new(Version::V10, ctx.pool.clone(), &ctx.schema, false);
    let old_locked = OldRelay::new(Version::V10, ctx.pool.clone(), &ctx.schema, true);
    let mut log = Log::default();

    // The old lease relay claims the three heads and completes: "late" v1 published (its
    // promotion unblocks v2), "locked" v1 a retry due at once, "leased" v1 without outcome
    // (released). Then it claims "leased" v1 again and keeps that lease live, and the old
    // locked relay claims "late" v2 and "locked" v1 and keeps its transaction open.
    let c = old_lease.claim("old-lease", 10).await;
    assert_eq!(c.rows.len(), 3, "{:?}", c.actions);
    let late = c.rows.iter().position(|r| r.agg_id == "late").unwrap();
    let locked_v1 = c.rows.iter().position(|r| r.agg_id == "locked").unwrap();
    let late_row = c.rows[late].clone();
    let applied = old_lease
        .complete(c, &[(late, Kind::Published), (locked_v1, Kind::Retry)])
        .await;
    assert_eq!(applied.len(), 2);
    log.published
        .push((late_row.agg_id, late_row.version, late_row.event));

    let held_lease = old_lease.claim("old-lease", 1).await;
    assert_eq!(
        held_lease
            .rows
            .iter()
            .map(|r| (r.agg_id.as_str(), r.version))
            .collect::<Vec<_>>(),
        vec![("leased", 1)],
        "{:?}",
        held_lease.actions
    );
    let held_locked = old_locked.claim("old-locked", 10).await;
    let locked_rows: Vec<(String, i64)> = held_locked
        .rows
        .iter()
        .map(|r| (r.agg_id.clone(), r.version))
        .collect();
    let mut locked_sorted = locked_rows.clone();
    locked_sorted.sort();
    assert_eq!(
        locked_sorted,
        vec![("late".to_owned(), 2), ("locked".to_owned(), 1)],
        "{:?}",
        held_locked.actions
    );

    let migrating = {
        let store = new.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !migrating.is_finished(),
        "migration 11 went ahead of an open locked claim of version 10"
    );
    // A claim of the old version, started while the migration waits.
    let waiting_claim = {
        let pool = ctx.pool.clone();
        let schema = ctx.schema.clone();
        tokio::spawn(async move {
            let relay = OldRelay::new(Version::V10, pool, &schema, false);
            let c = relay.claim("old-late", 10).await;
            (relay, c)
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The locked claim completes: both published, each promotion in the same statement.
    let rows_locked = held_locked.rows.clone();
    let applied = old_locked
        .complete(held_locked, &[(0, Kind::Published), (1, Kind::Published)])
        .await;
    assert_eq!(applied.len(), 2);
    for r in rows_locked {
        log.published.push((r.agg_id, r.version, r.event));
    }
    let applied_migrations = tokio::time::timeout(Duration::from_secs(20), migrating)
        .await
        .expect("migration within 20 s")
        .unwrap()
        .expect("migrate");
    assert_eq!(applied_migrations, 1, "migration 11 alone");
    let (late_relay, c) = tokio::time::timeout(Duration::from_secs(20), waiting_claim)
        .await
        .expect("old claim within 20 s")
        .unwrap();
    // It claimed after the migration: "late" v3 and "locked" v2, promoted by the completion.
    let mut got: Vec<(String, i64)> = c
        .rows
        .iter()
        .map(|r| (r.agg_id.clone(), r.version))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("late".to_owned(), 3), ("locked".to_owned(), 2)],
        "{:?}",
        c.actions
    );
    let rows_late = c.rows.clone();
    let applied = late_relay
        .complete(c, &[(0, Kind::Published), (1, Kind::Published)])
        .await;
    assert_eq!(applied.len(), 2);
    for r in rows_late {
        log.published.push((r.agg_id, r.version, r.event));
    }
    // The lease taken before the migration completes after it.
    let rows_held = held_lease.rows.clone();
    let applied = old_lease
        .complete(held_lease, &[(0, Kind::Published)])
        .await;
    assert_eq!(
        applied.len(),
        1,
        "the old lease's completion applies on migration 11"
    );
    for r in rows_held {
        log.published.push((r.agg_id, r.version, r.event));
    }

    let new_ref = &new;
    drain_with(&ctx, &mut log, 40, |_| new_step(new_ref, 3)).await;
    log.check(&[
        ("late", (1..=5).collect()),
        ("leased", (1..=5).collect()),
        ("locked", (1..=5).collect()),
    ]);
    ctx.drop().await;
}

/// The seed of the randomized test: `OUTBOX_PG_UPGRADE_BLOCK_SEED`, else drawn and printed.
fn seed() -> u64 {
    let seed = std::env::var("OUTBOX_PG_UPGRADE_BLOCK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("OUTBOX_PG_UPGRADE_BLOCK_SEED={seed}");
    seed
}

/// Seeded random interleaving of the new append and a relay of version 10 beside a new relay
/// (both lease mode): batches of one to four aggregates with their next versions shuffled, a
/// version twice in the same batch now and then, a replay of versions already appended (a
/// stale or duplicate lowest version), appended while claims of either relay are open; the
/// old relay's completions publish, retry or release each row, the new relay's publish a
/// prefix of each run and release the rest. After every step no blocked row is orphaned; at
/// the end every (aggregate, version) is published once, from its first appended row, in
/// version order, every other row parked out of order, nothing pending. The old relay in
/// lease mode, or in locked mode (its claim's transaction open across the other steps).
async fn random_batches_beside_a_relay_of_version_10(locked: bool) {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    let seed = seed();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let ctx = ctx!(6);
    let new = store(&ctx, lease(30.0), true).await;
    let old = OldRelay::new(Version::V10, ctx.pool.clone(), &ctx.schema, locked);
    let aggs = ["r0", "r1", "r2", "r3", "r4"];
    let mut next: BTreeMap<&str, i64> = aggs.iter().map(|a| (*a, 1)).collect();
    let mut appended: Vec<Envelope> = Vec::new();
    let mut log = Log::default();
    let mut held_old: Option<old_relay::OldClaim> = None;
    let mut held_new: Option<outbox_core::ClaimedBatch> = None;
    for _ in 0..150 {
        match rng.random_range(0..6) {
            0 | 1 if appended.len() < 150 => {
                let mut evs = Vec::new();
                let mut picked = aggs.to_vec();
                picked.shuffle(&mut rng);
                for a in &picked[..rng.random_range(1..=4)] {
                    let from = next[a];
                    let k = rng.random_range(1..=6);
                    for v in from..from + k {
                        evs.push(event(a, v));
                        if rng.random_bool(0.1) {
                            evs.push(event(a, v));
                        }
                    }
                    if from > 1 && rng.random_bool(0.2) {
                        let back = rng.random_range(1..from);
                        evs.push(event(a, back));
                    }
                    *next.get_mut(a).unwrap() += k;
                }
                evs.shuffle(&mut rng);
                append(&ctx, &new, &evs).await;
                appended.extend(evs);
            }
            2 if held_old.is_none() => held_old = Some(old.claim("old-relay", 6).await),
            3 if held_new.is_none() => {
                let run = rng.random_range(1..=4);
                held_new = Some(
                    new.claim(&ClaimRequest::new("new-relay", 6).with_run(run))
                        .await
                        .unwrap(),
                );
            }
            4 => {
                if let Some(c) = held_old.take() {
                    let rows = c.rows.clone();
                    let mut outs = Vec::new();
                    for i in 0..rows.len() {
                        match rng.random_range(0..10) {
                            0..=6 => outs.push((i, Kind::Published)),
                            7 => outs.push((i, Kind::Retry)),
                            _ => {}
                        }
                    }
                    let applied = old.complete(c, &outs).await;
                    assert_eq!(applied.len(), outs.len(), "seed {seed}");
                    for (i, k) in outs {
                        if matches!(k, Kind::Published) {
                            let r = &rows[i];
                            log.published.push((r.agg_id.clone(), r.version, r.event));
                        }
                    }
                }
            }
            _ => {
                if let Some(b) = held_new.take() {
                    // Per aggregate, a prefix of its rows (head first) published; the rest
                    // released.
                    let mut cut: BTreeMap<String, usize> = BTreeMap::new();
                    let mut outs = Vec::new();
                    let mut pubs = Vec::new();
                    let mut recs: Vec<&Envelope> = b.records.iter().map(|r| &r.envelope).collect();
                    recs.sort_by_key(|e| (e.aggregate_id.clone(), e.aggregate_version));
                    for e in recs {
                        let n = cut.entry(e.aggregate_id.clone()).or_insert_with(|| {
                            if rng.random_bool(0.7) {
                                usize::MAX
                            } else {
                                rng.random_range(0..3)
                            }
                        });
                        if *n > 0 {
                            *n -= 1;
                            outs.push(published(e, 0));
                            pubs.push((
                                e.aggregate_id.clone(),
                                e.aggregate_version,
                                e.event_id.as_uuid(),
                            ));
                        }
                    }
                    let rep = new.complete(&b.handle, &outs).await.unwrap();
                    assert_eq!(rep.applied, outs.len(), "seed {seed}");
                    log.published.extend(pubs);
                }
            }
        }
        common::no_orphans(&ctx).await;
    }
    if let Some(c) = held_old.take() {
        let n = c.rows.len();
        let rows = c.rows.clone();
        let outs: Vec<_> = (0..n).map(|i| (i, Kind::Published)).collect();
        assert_eq!(old.complete(c, &outs).await.len(), n);
        for r in rows {
            log.published.push((r.agg_id, r.version, r.event));
        }
    }
    if let Some(b) = held_new.take() {
        new.release(&b.handle).await.unwrap();
    }
    let (new_ref, old_ref) = (&new, &old);
    drain_with(&ctx, &mut log, 400, |round| async move {
        if round % 2 == 0 {
            old_step(old_ref).await
        } else {
            new_step(new_ref, 3).await
        }
    })
    .await;
    // The row of each (aggregate, version) that must go out: the first appended.
    let mut winner: BTreeMap<(String, i64), Uuid> = BTreeMap::new();
    for e in &appended {
        winner
            .entry((e.aggregate_id.clone(), e.aggregate_version))
            .or_insert(e.event_id.as_uuid());
    }
    let want: Vec<(String, Vec<i64>)> = aggs
        .iter()
        .filter(|a| next[*a] > 1)
        .map(|a| ((*a).to_owned(), (1..next[a]).collect()))
        .collect();
    let want_ref: Vec<(&str, Vec<i64>)> =
        want.iter().map(|(a, v)| (a.as_str(), v.clone())).collect();
    log.check(&want_ref);
    for (a, v, id) in &log.published {
        assert_eq!(
            winner[&(a.clone(), *v)],
            *id,
            "seed {seed}: {a} v{v} published from a row other than its first"
        );
    }
    let left: Vec<(String, i64, String)> = rows(&ctx)
        .await
        .into_iter()
        .filter(|r| r.2 != "published" && r.2 != "parked:out_of_order")
        .collect();
    assert!(left.is_empty(), "seed {seed}: {left:?}");
    let parked = rows(&ctx).await.len() - log.published.len();
    eprintln!(
        "seed {seed}: {} appended, {} published, {parked} parked out of order",
        appended.len(),
        log.published.len()
    );
    ctx.drop().await;
}

#[tokio::test]
async fn random_batches_beside_a_lease_relay_of_version_10() {
    random_batches_beside_a_relay_of_version_10(false).await;
}

#[tokio::test]
async fn random_batches_beside_a_locked_relay_of_version_10() {
    random_batches_beside_a_relay_of_version_10(true).await;
}

/// Relays of version 5 on a schema of migration 5 hold claims on batches the new store
/// appended (followers written blocked) when `migrate()` upgrades it to 11: a locked claim
/// (the migration waits for it; its completion, with version 5's own statement and
/// promotion, commits first) and a lease claim whose completion fails after migration 8
/// renamed `ack_topic` (a relay of version 5 cannot complete on the new schema). Once that
/// lease has run out, the new relay sends its head again and drains both batches in order:
/// a duplicate of the head at most, never a loss, nothing left blocked.
#[tokio::test]
async fn migration_11_beside_relays_of_version_5_holding_batch_heads() {
    let ctx = ctx!(8);
    common::schema_at_version(&ctx, 5).await;
    let new = store(&ctx, lease(30.0), false).await;
    let mut evs = batch("a", 1, 5);
    evs.extend(batch("b", 1, 5));
    append(&ctx, &new, &evs).await;
    assert!(common::blocked(&ctx, "a", 2).await && common::blocked(&ctx, "b", 5).await);
    let mut old_lease = OldRelay::new(Version::V5, ctx.pool.clone(), &ctx.schema, false);
    old_lease.lease = Duration::from_secs(1);
    let old_locked = OldRelay::new(Version::V5, ctx.pool.clone(), &ctx.schema, true);
    let held_lease = old_lease.claim("old-lease", 1).await;
    let held_locked = old_locked.claim("old-locked", 10).await;
    let claimed = |c: &old_relay::OldClaim| {
        c.rows
            .iter()
            .map(|r| (r.agg_id.clone(), r.version))
            .collect::<Vec<_>>()
    };
    assert_eq!(claimed(&held_lease), vec![("a".to_owned(), 1)]);
    assert_eq!(claimed(&held_locked), vec![("b".to_owned(), 1)]);

    let migrating = {
        let store = new.clone();
        tokio::spawn(async move { store.migrate().await })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !migrating.is_finished(),
        "the migration went ahead of an open locked claim of version 5"
    );
    let mut log = Log::default();
    let b1 = held_locked.rows[0].clone();
    let applied = old_locked
        .complete(held_locked, &[(0, Kind::Published)])
        .await;
    assert_eq!(applied.len(), 1);
    log.published.push((b1.agg_id, b1.version, b1.event));
    let applied_migrations = tokio::time::timeout(Duration::from_secs(20), migrating)
        .await
        .expect("migration within 20 s")
        .unwrap()
        .expect("migrate");
    assert_eq!(applied_migrations, 6, "migrations 6 to 11");
    let failed = old_lease
        .try_complete(held_lease, &[(0, Kind::Published)])
        .await
        .expect_err("a version 5 completion writes ack_topic, gone since migration 8");
    assert!(failed.to_string().contains("ack_topic"), "{failed}");

    let new_ref = &new;
    drain_with(&ctx, &mut log, 400, |_| new_step(new_ref, 3)).await;
    log.check(&[("a", (1..=5).collect()), ("b", (1..=5).collect())]);
    ctx.drop().await;
}

/// `accept_first_version` on both sides: aggregates without state whose first batch starts
/// above version 1 (one reversed, one with its lowest version twice), drained by a lenient
/// relay of version 10 or 5 alone, and (version 10) alternating with a lenient new relay, a
/// late lower version appended while the batch's head is claimed. Each aggregate counts from
/// its batch's lowest version (the old `unknown_last` reads the blocked rows too); the late
/// lower version and the duplicate are parked out of order, the rest published in order.
#[tokio::test]
async fn lenient_old_relays_start_a_batch_at_its_lowest_version() {
    for (version, alternate) in [
        (Version::V10, false),
        (Version::V10, true),
        (Version::V5, false),
    ] {
        let ctx = ctx!(4);
        let migrate = version == Version::V10;
        if !migrate {
            common::schema_at_version(&ctx, 5).await;
        }
        let new = PostgresOutboxStore::builder(ctx.pool.clone())
            .schema(&ctx.schema)
            .claim_mode(lease(30.0))
            .accept_first_version(true)
            .build()
            .unwrap();
        if migrate {
            new.migrate().await.unwrap();
        }
        let old = OldRelay::with_first_version(version, ctx.pool.clone(), &ctx.schema, false, true);
        let mut evs = batch("up", 5, 4);
        evs.extend((10..=14).rev().map(|v| event("down", v)));
        let dup = event("dup", 7);
        evs.extend([
            event("dup", 7),
            event("dup", 8),
            dup.clone(),
            event("dup", 9),
        ]);
        append(&ctx, &new, &evs).await;
        assert!(common::blocked(&ctx, "up", 6).await && common::blocked(&ctx, "down", 14).await);
        // The first claim takes the three heads; a late lower version of "up" arrives while
        // its head is claimed.
        let c = old.claim("old-relay", 10).await;
        let mut heads: Vec<(String, i64)> = c
            .rows
            .iter()
            .map(|r| (r.agg_id.clone(), r.version))
            .collect();
        heads.sort();
        assert_eq!(
            heads,
            vec![
                ("down".to_owned(), 10),
                ("dup".to_owned(), 7),
                ("up".to_owned(), 5)
            ],
            "{version:?}: {:?}",
            c.actions
        );
        append(&ctx, &new, &[event("up", 3)]).await;
        let mut log = Log::default();
        let rows_c = c.rows.clone();
        let outs: Vec<_> = (0..rows_c.len()).map(|i| (i, Kind::Published)).collect();
        assert_eq!(old.complete(c, &outs).await.len(), rows_c.len());
        for r in rows_c {
            log.published.push((r.agg_id, r.version, r.event));
        }
        let (new_ref, old_ref) = (&new, &old);
        drain_with(&ctx, &mut log, 60, |round| async move {
            if alternate && round % 2 == 1 {
                new_step(new_ref, 3).await
            } else {
                old_step(old_ref).await
            }
        })
        .await;
        log.check(&[
            ("down", (10..=14).collect()),
            ("dup", (7..=9).collect()),
            ("up", (5..=8).collect()),
        ]);
        let parked: Vec<(String, i64, String)> = rows(&ctx)
            .await
            .into_iter()
            .filter(|r| r.2 != "published")
            .collect();
        assert_eq!(
            parked,
            vec![
                ("dup".to_owned(), 7, "parked:out_of_order".to_owned()),
                ("up".to_owned(), 3, "parked:out_of_order".to_owned())
            ],
            "{version:?} alternate {alternate}"
        );
        let dup_status: String = sqlx::query_scalar(&format!(
            "SELECT status FROM {} WHERE event_id = $1",
            table(&ctx)
        ))
        .bind(dup.event_id.as_uuid())
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            dup_status, "parked",
            "the later row of version 7 is the duplicate"
        );
        ctx.drop().await;
    }
}
