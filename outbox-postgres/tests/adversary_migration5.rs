//! Adversarial tests of migration 5 and the completion's one time per outcome (`o.ts`, one
//! `clock_timestamp()` per outcome row of the materialized outcomes CTE): retry and defer
//! delays counted from the completion, `published_at = finished_at`, parks never published
//! later, the upgrade of a version 4 schema in use (also concurrent), cleanup by `finished_at`,
//! and the plain SQL schema against `migrate()`. Both claim modes where it applies.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{ClaimMode, Envelope, ErrorClass, LastError, Outcome};
use outbox_postgres::PostgresOutboxStore;

use common::{claim, event, lease, park, published};

const MODES: [&str; 2] = ["lease", "locked"];

fn mode(name: &str) -> ClaimMode {
    match name {
        "lease" => lease(30.0),
        _ => ClaimMode::LockedTransaction,
    }
}

fn err(kind: &str) -> LastError {
    LastError {
        class: ErrorClass::Transient,
        kind: kind.into(),
        message: "broker busy".into(),
    }
}

fn retry(e: &Envelope, delay: Duration) -> Outcome {
    Outcome::Retry {
        event_id: e.event_id,
        delay,
        error: err("timeout"),
    }
}

fn defer(e: &Envelope, delay: Duration) -> Outcome {
    Outcome::Defer {
        event_id: e.event_id,
        delay,
        error: err("broker_unavailable"),
    }
}

async fn db_now(ctx: &common::Ctx) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&ctx.pool)
        .await
        .unwrap()
}

type Times = (
    String,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    DateTime<Utc>,
);

/// (status, published_at, finished_at, parked_at, next_attempt_at, created_at) of `e`'s row.
async fn times(ctx: &common::Ctx, e: &Envelope) -> Times {
    sqlx::query_as(&format!(
        "SELECT status, published_at, finished_at, parked_at, \
                CASE WHEN isfinite(next_attempt_at) THEN next_attempt_at END, created_at \
         FROM \"{}\".outbox_events WHERE event_id = $1",
        ctx.schema
    ))
    .bind(e.event_id.as_uuid())
    .fetch_one(&ctx.pool)
    .await
    .unwrap()
}

fn us(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap()
}

/// The aggregate ids a claim hands out (the claim completed as published when not empty, so
/// that a locked claim's transaction ends).
async fn claim_ids(store: &PostgresOutboxStore, owner: &str) -> BTreeSet<String> {
    let b = claim(store, owner, 100).await;
    let ids = b
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.clone())
        .collect();
    if !b.is_empty() {
        common::publish_all(store, &b).await;
    }
    ids
}

/// Attack A1 + A2 + A3 (one statement): publish, retry, defer and park outcomes completed
/// together. Each time lies within the completion's call; a retried or deferred row's
/// `next_attempt_at` is its completion time + delay (never earlier than the call's start +
/// delay); it is not claimable before that and is claimable after; the published row has
/// `published_at = finished_at`; the parked one has `parked_at` and no finish.
#[tokio::test]
async fn delays_count_from_the_completion_and_one_time_per_outcome() {
    let ctx = ctx!(6);
    let delay = Duration::from_millis(1500);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let evs: Vec<Envelope> = ["pub", "ret", "def", "park"]
            .iter()
            .map(|a| event(&format!("{m}-{a}"), 1))
            .collect();
        store.append_many(&ctx.pool, &evs).await.unwrap();
        // Some time between append and claim, so that a `ts` taken from the row's creation or
        // the transaction start would show.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let b = claim(&store, m, 100).await;
        assert_eq!(b.records.len(), 4, "{m}");
        let before = db_now(&ctx).await;
        let outs = vec![
            published(&evs[0], 1),
            retry(&evs[1], delay),
            defer(&evs[2], delay),
            park(&evs[3]),
        ];
        let rep = store.complete(&b.handle, &outs).await.unwrap();
        assert_eq!(rep.applied, 4, "{m}");
        let after = db_now(&ctx).await;

        let (st, pa, fa, pk, _, created) = times(&ctx, &evs[0]).await;
        assert_eq!(st, "published", "{m}");
        let pa = pa.expect("published_at");
        assert_eq!(Some(pa), fa, "{m}: published_at = finished_at");
        assert!(
            pa >= before && pa <= after,
            "{m}: {pa} not in [{before}, {after}]"
        );
        assert!(pa > created, "{m}");
        assert_eq!(pk, None, "{m}");

        let mut due = Vec::new();
        for e in &evs[1..3] {
            let (st, pa, fa, pk, next, _) = times(&ctx, e).await;
            assert_eq!(
                (st.as_str(), pa, fa, pk),
                ("pending", None, None, None),
                "{m}"
            );
            let next = next.expect("a finite next_attempt_at");
            assert!(
                next >= before + us(delay),
                "{m}: next_attempt_at {next} earlier than the completion's start {before} + {delay:?}"
            );
            assert!(
                next <= after + us(delay),
                "{m}: next_attempt_at {next} later than the completion's end {after} + {delay:?}"
            );
            due.push(next);
        }

        let (st, pa, fa, pk, _, _) = times(&ctx, &evs[3]).await;
        assert_eq!((st.as_str(), pa, fa), ("parked", None, None), "{m}");
        let pk = pk.expect("parked_at");
        assert!(pk >= before && pk <= after, "{m}: parked_at {pk}");

        // Not claimable at once, nor shortly before the delay ends.
        assert_eq!(claim_ids(&store, m).await, BTreeSet::new(), "{m}: at once");
        let first_due = *due.iter().min().unwrap();
        let until = (first_due - db_now(&ctx).await)
            .to_std()
            .unwrap_or_default();
        tokio::time::sleep(until.saturating_sub(Duration::from_millis(300))).await;
        assert!(
            db_now(&ctx).await < first_due,
            "{m}: slept too long to check"
        );
        assert_eq!(
            claim_ids(&store, m).await,
            BTreeSet::new(),
            "{m}: before the delay ended"
        );
        // Claimable once due.
        let last_due = *due.iter().max().unwrap();
        while db_now(&ctx).await <= last_due {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let got = claim_ids(&store, m).await;
        assert_eq!(
            got,
            [format!("{m}-def"), format!("{m}-ret")]
                .into_iter()
                .collect(),
            "{m}: due rows are claimable"
        );
        // The parked row is never handed out.
        assert_eq!(claim_ids(&store, m).await, BTreeSet::new(), "{m}: parked");
    }
    ctx.drop().await;
}

/// What a completion that waited for another transaction's lock on the row recorded.
struct LockWait {
    /// Database clock before the completion and after it returned.
    start: DateTime<Utc>,
    done: DateTime<Utc>,
    /// The retried row's `next_attempt_at`.
    next: DateTime<Utc>,
    /// What another relay could claim right after the completion.
    claimable_now: BTreeSet<String>,
}

const LOCK_WAIT_DELAY: Duration = Duration::from_millis(1000);

/// Attack A1 under a lock wait: another transaction holds the outbox row of a retried event
/// (`blocker`: its SQL on the row, `{t}` the table) for `hold` while the completion retries it
/// with [`LOCK_WAIT_DELAY`], so the completion's UPDATE waits for it. Lease mode only: in
/// locked mode the claim's own transaction holds the row, so another transaction's lock
/// would wait on the claim, never the reverse.
async fn retry_after_lock_wait(ctx: &common::Ctx, blocker: &str, hold: Duration) -> LockWait {
    let store = ctx.store(lease(30.0)).await;
    let e = event("lockwait", 1);
    store.append(&ctx.pool, &e).await.unwrap();
    let b = claim(&store, "r", 100).await;
    assert_eq!(b.records.len(), 1);
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query(&blocker.replace("{t}", &format!("\"{}\".outbox_events", ctx.schema)))
        .bind(e.event_id.as_uuid())
        .execute(&mut *tx)
        .await
        .unwrap();
    let release = tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        tx.commit().await.unwrap();
    });
    let start = db_now(ctx).await;
    let rep = store
        .complete(&b.handle, &[retry(&e, LOCK_WAIT_DELAY)])
        .await
        .unwrap();
    assert_eq!(rep.applied, 1);
    release.await.unwrap();
    let done = db_now(ctx).await;
    assert!(done - start >= us(hold) - chrono::Duration::milliseconds(100));
    let next = times(ctx, &e).await.4.expect("a finite next_attempt_at");
    let claimable_now = claim_ids(&store, "other").await;
    LockWait {
        start,
        done,
        next,
        claimable_now,
    }
}

/// The blocker updated the row (a no-op write): the completion's UPDATE re-evaluates its SET
/// on the new row version after the wait (EvalPlanQual), and the retry's `next_attempt_at`
/// comes from the row's own `clock_timestamp()`, so the delay counts from after the wait and
/// the row is not claimable right after the completion (a regression of ec96db8, which took
/// the time of the outcomes CTE, read before the wait).
#[tokio::test]
async fn a_retry_delay_is_not_eaten_by_waiting_on_a_concurrent_update() {
    let ctx = ctx!(6);
    let w = retry_after_lock_wait(
        &ctx,
        "UPDATE {t} SET attempts = attempts WHERE event_id = $1",
        Duration::from_millis(2000),
    )
    .await;
    assert!(
        w.next >= w.done - chrono::Duration::milliseconds(200) + us(LOCK_WAIT_DELAY)
            && w.claimable_now.is_empty(),
        "retried with a {LOCK_WAIT_DELAY:?} delay, but next_attempt_at = {} is {:?} after the \
         completion's start ({}) and {:?} before its end ({}); claimable right after: {:?}",
        w.next,
        (w.next - w.start).to_std().unwrap_or_default(),
        w.start,
        (w.done - w.next).to_std().unwrap_or_default(),
        w.done,
        w.claimable_now,
    );
    ctx.drop().await;
}

/// The blocker only locked the row (`FOR UPDATE`, no change): PostgreSQL computes the new row
/// before waiting and does not compute it again, so the wait counts toward the delay (as it
/// did before migration 5). Documented limit (`Outcome::Retry`): the delay counts from the
/// completion statement's start at the earliest; the row is never due before that.
#[tokio::test]
async fn a_row_lock_held_by_another_transaction_counts_toward_the_delay() {
    let ctx = ctx!(6);
    let w = retry_after_lock_wait(
        &ctx,
        "SELECT 1 FROM {t} WHERE event_id = $1 FOR UPDATE",
        Duration::from_millis(1500),
    )
    .await;
    assert!(
        w.next >= w.start + us(LOCK_WAIT_DELAY) && w.next < w.done + us(LOCK_WAIT_DELAY),
        "next_attempt_at {}: not within [start + delay, end + delay) ({}, {})",
        w.next,
        w.start,
        w.done
    );
    ctx.drop().await;
}

/// Attack A2: many rounds of mixed outcomes in one statement each (publish, retry 0, defer 0,
/// park), both modes: every published row has `published_at = finished_at`, after its
/// creation; every parked row has `parked_at` and neither publication time.
#[tokio::test]
async fn published_at_equals_finished_at_in_mixed_rounds() {
    let ctx = ctx!(6);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let evs: Vec<Envelope> = (0..30)
            .flat_map(|a| (1..=3).map(move |v| (a, v)))
            .map(|(a, v)| event(&format!("{m}-mix{a}"), v))
            .collect();
        store.append_many(&ctx.pool, &evs).await.unwrap();
        for round in 0..40 {
            let b = claim(&store, m, 50).await;
            if b.is_empty() {
                break;
            }
            let outs: Vec<Outcome> = b
                .records
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let e = &r.envelope;
                    let agg: usize = e
                        .aggregate_id
                        .rsplit("mix")
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    match (agg + round + i) % 5 {
                        0 if agg.is_multiple_of(7) => park(e),
                        1 => retry(e, Duration::ZERO),
                        2 => defer(e, Duration::ZERO),
                        _ => published(e, i as i64),
                    }
                })
                .collect();
            let rep = store.complete(&b.handle, &outs).await.unwrap();
            assert_eq!(rep.applied, outs.len(), "{m} round {round}");
        }
        let (bad_pub, bad_park, published_n, parked_n): (i64, i64, i64, i64) =
            sqlx::query_as(&format!(
                "SELECT count(*) FILTER (WHERE status = 'published' AND \
                          (published_at IS NULL OR published_at IS DISTINCT FROM finished_at \
                           OR published_at < created_at OR parked_at IS NOT NULL)), \
                        count(*) FILTER (WHERE status = 'parked' AND \
                          (parked_at IS NULL OR published_at IS NOT NULL \
                           OR finished_at IS NOT NULL)), \
                        count(*) FILTER (WHERE status = 'published'), \
                        count(*) FILTER (WHERE status = 'parked') \
                 FROM \"{}\".outbox_events WHERE aggregate_id LIKE $1",
                ctx.schema
            ))
            .bind(format!("{m}-mix%"))
            .fetch_one(&ctx.pool)
            .await
            .unwrap();
        assert_eq!((bad_pub, bad_park), (0, 0), "{m}");
        assert!(published_n > 30, "{m}: {published_n} published");
        assert!(parked_n > 0, "{m}: no park exercised");
    }
    ctx.drop().await;
}

/// Attack A3: two stores on one schema claim concurrently; one event per some aggregates is
/// parked by whichever relay holds it. No parked event (nor anything after it) is ever
/// published, by either relay, in later rounds.
#[tokio::test]
async fn a_parked_row_is_never_published_by_another_relay() {
    let ctx = ctx!(10);
    for m in MODES {
        let a = ctx.store(mode(m)).await;
        let b = ctx.store(mode(m)).await;
        let evs: Vec<Envelope> = (0..12)
            .flat_map(|g| (1..=3).map(move |v| (g, v)))
            .map(|(g, v)| event(&format!("{m}-pk{g}"), v))
            .collect();
        a.append_many(&ctx.pool, &evs).await.unwrap();
        let poisoned = |e: &Envelope| {
            let g: usize = e.aggregate_id.rsplit("pk").next().unwrap().parse().unwrap();
            g.is_multiple_of(3) && e.aggregate_version == 2
        };
        let mut published_ids = Vec::new();
        let mut parked_ids = Vec::new();
        for _ in 0..20 {
            let run = |s: &PostgresOutboxStore, owner: &'static str| {
                let s = s.clone();
                async move {
                    let batch = claim(&s, owner, 5).await;
                    let outs: Vec<Outcome> = batch
                        .records
                        .iter()
                        .map(|r| {
                            if poisoned(&r.envelope) {
                                park(&r.envelope)
                            } else {
                                published(&r.envelope, 0)
                            }
                        })
                        .collect();
                    if !batch.is_empty() {
                        let rep = s.complete(&batch.handle, &outs).await.unwrap();
                        assert_eq!(rep.applied, outs.len());
                    }
                    outs
                }
            };
            let (x, y) = tokio::join!(run(&a, "relay-a"), run(&b, "relay-b"));
            if x.is_empty() && y.is_empty() {
                break;
            }
            for o in x.into_iter().chain(y) {
                match o {
                    Outcome::Published { event_id, .. } => published_ids.push(event_id),
                    Outcome::Park { event_id, .. } => parked_ids.push(event_id),
                    _ => unreachable!(),
                }
            }
        }
        let expected_parked: BTreeSet<_> = evs
            .iter()
            .filter(|e| poisoned(e))
            .map(|e| e.event_id)
            .collect();
        assert_eq!(
            parked_ids.iter().copied().collect::<BTreeSet<_>>(),
            expected_parked,
            "{m}"
        );
        assert_eq!(parked_ids.len(), 4, "{m}: each poisoned event parked once");
        let pubs: BTreeSet<_> = published_ids.iter().copied().collect();
        assert_eq!(pubs.len(), published_ids.len(), "{m}: published twice");
        // Everything but the poisoned events and the versions after them.
        assert_eq!(pubs.len(), 36 - 4 - 4, "{m}");
        assert!(pubs.is_disjoint(&expected_parked), "{m}");
        // Later rounds by both relays publish nothing more.
        assert_eq!(claim_ids(&a, "relay-a").await, BTreeSet::new(), "{m}");
        assert_eq!(claim_ids(&b, "relay-b").await, BTreeSet::new(), "{m}");
        let bad: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events WHERE event_id = ANY($1) \
             AND (status <> 'parked' OR parked_at IS NULL OR published_at IS NOT NULL \
                  OR finished_at IS NOT NULL)",
            ctx.schema
        ))
        .bind(
            expected_parked
                .iter()
                .map(|e| e.as_uuid())
                .collect::<Vec<_>>(),
        )
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(bad, 0, "{m}");
    }
    ctx.drop().await;
}

async fn index_defs(ctx: &common::Ctx, schema: &str) -> Vec<String> {
    sqlx::query_scalar::<_, String>(
        "SELECT indexdef::text FROM pg_indexes WHERE schemaname = $1 ORDER BY indexname",
    )
    .bind(schema)
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
    .into_iter()
    .map(|d| d.replace(schema, "S"))
    .collect()
}

/// Attack A4: a version 4 schema in use (published rows, some two hours old, a parked and a
/// pending one, `published_at_idx` present) is upgraded by two stores migrating at once: both
/// succeed, one applies migrations 5 and 6, the other nothing; the index is gone and the latency
/// window still counts the recent old rows (not the old ones), over `finished_at`.
#[tokio::test]
async fn upgrade_from_version_4_concurrently() {
    let ctx = ctx!(8);
    let store = ctx.store(lease(30.0)).await;
    let evs: Vec<Envelope> = (0..20).map(|i| event(&format!("up{i}"), 1)).collect();
    store.append_many(&ctx.pool, &evs).await.unwrap();
    let b = claim(&store, "r", 100).await;
    let outs: Vec<Outcome> = b
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| match i {
            0 => park(&r.envelope),
            1 => retry(&r.envelope, Duration::from_secs(3600)),
            _ => published(&r.envelope, i as i64),
        })
        .collect();
    store.complete(&b.handle, &outs).await.unwrap();
    // Back to version 4: its index, its migration record; times as version 4 wrote them (two
    // clock readings: finished_at a little after published_at); 8 rows published 2 hours ago.
    let v4 = include_str!("../src/migrations/0004_outbox.sql");
    let idx_start = v4.find("CREATE INDEX IF NOT EXISTS \"__TABLE___published_at_idx\"");
    let idx = &v4[idx_start.expect("migration 4 creates published_at_idx")..];
    let idx = &idx[..idx.find(';').unwrap() + 1];
    let deleted = sqlx::query(&format!(
        "DELETE FROM \"{}\".outbox_schema_migrations WHERE version >= 5",
        ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(deleted, 7, "the records of migrations 5 to 11");
    sqlx::raw_sql(&format!(
        "{}; \
         UPDATE \"{s}\".outbox_events SET finished_at = published_at + interval '7 microseconds' \
         WHERE status = 'published'; \
         UPDATE \"{s}\".outbox_events SET published_at = published_at - interval '2 hours', \
                finished_at = finished_at - interval '2 hours' \
         WHERE id IN (SELECT id FROM \"{s}\".outbox_events WHERE status = 'published' \
                      ORDER BY id LIMIT 8);",
        idx.replace("__SCHEMA__", &ctx.schema)
            .replace("__TABLE__", "outbox_events"),
        s = ctx.schema
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    let has_idx = |ctx: &common::Ctx| {
        let pool = ctx.pool.clone();
        let schema = ctx.schema.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_indexes WHERE schemaname = $1 \
                 AND indexname = 'outbox_events_published_at_idx'",
            )
            .bind(schema)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(has_idx(&ctx).await, 1, "version 4 has the index");
    let before = store
        .publish_latency(Duration::from_secs(3600))
        .await
        .unwrap();
    assert_eq!(before.count, 10);

    let s1 = ctx.store_unmigrated(lease(30.0));
    let s2 = ctx.store_unmigrated(ClaimMode::LockedTransaction);
    let (r1, r2) = tokio::join!(s1.migrate(), s2.migrate());
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    assert_eq!(
        r1 + r2,
        7,
        "one store applies migrations 5 to 11 ({r1}, {r2})"
    );
    assert_eq!(has_idx(&ctx).await, 0, "migration 5 drops published_at_idx");
    let versions: Vec<i32> = sqlx::query_scalar(&format!(
        "SELECT version FROM \"{}\".outbox_schema_migrations \
         WHERE object = 'outbox:outbox_events' ORDER BY version",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(versions, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(s1.migrate().await.unwrap(), 0);
    let after = s1.publish_latency(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(after.count, 10, "the recent old rows are in the window");
    assert_eq!(after.created, 20);
    assert_eq!((after.p50, after.max), (before.p50, before.max));
    let all = s1
        .publish_latency(Duration::from_secs(3 * 3600))
        .await
        .unwrap();
    assert_eq!(all.count, 18);
    // And the upgraded schema works: new publications after the upgrade count too.
    let e = event("after-upgrade", 1);
    s2.append(&ctx.pool, &e).await.unwrap();
    let b = claim(&s2, "r2", 10).await;
    assert_eq!(b.records.len(), 1);
    common::publish_all(&s2, &b).await;
    let after = s1.publish_latency(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(after.count, 11);
    ctx.drop().await;
}

/// Attack A4 on a fresh schema: three stores migrate it at once; all succeed, 10 migrations in
/// total, one record per version.
#[tokio::test]
async fn concurrent_migrations_of_a_fresh_schema() {
    let ctx = ctx!(8);
    let s: Vec<_> = (0..3).map(|_| ctx.store_unmigrated(lease(30.0))).collect();
    let (a, b, c) = tokio::join!(s[0].migrate(), s[1].migrate(), s[2].migrate());
    let total = a.unwrap() + b.unwrap() + c.unwrap();
    assert_eq!(total, 11);
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".outbox_schema_migrations",
        ctx.schema
    ))
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(n, 11);
    ctx.drop().await;
}

/// Attack A5: cleanup removes published rows by `finished_at` in both modes, in batches; rows
/// not finished (parked, pending after a retry) stay; a recent publication stays until its
/// retention has passed.
#[tokio::test]
async fn cleanup_by_finished_at_in_both_modes() {
    let ctx = ctx!(6);
    for m in MODES {
        let store = ctx.store(mode(m)).await;
        let evs: Vec<Envelope> = (0..12).map(|i| event(&format!("{m}-cl{i}"), 1)).collect();
        store.append_many(&ctx.pool, &evs).await.unwrap();
        let b = claim(&store, m, 100).await;
        assert_eq!(b.records.len(), 12);
        let outs: Vec<Outcome> = b
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| match i {
                0 => park(&r.envelope),
                1 => retry(&r.envelope, Duration::from_secs(3600)),
                _ => published(&r.envelope, i as i64),
            })
            .collect();
        store.complete(&b.handle, &outs).await.unwrap();
        // 6 of the 10 published rows finished 2 hours ago; their published_at stays recent
        // (cleanup must read finished_at, not published_at).
        sqlx::query(&format!(
            "UPDATE \"{s}\".outbox_events SET finished_at = finished_at - interval '2 hours' \
             WHERE id IN (SELECT id FROM \"{s}\".outbox_events WHERE status = 'published' \
                          AND aggregate_id LIKE $1 ORDER BY id LIMIT 6)",
            s = ctx.schema
        ))
        .bind(format!("{m}-cl%"))
        .execute(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            store
                .cleanup_candidates(Duration::from_secs(3600))
                .await
                .unwrap(),
            6,
            "{m}"
        );
        let rep = store.cleanup(Duration::from_secs(3600), 4).await.unwrap();
        assert_eq!(rep.removed, 6, "{m}");
        assert!(
            rep.batches >= 2,
            "{m}: batch size 4 for 6 rows: {}",
            rep.batches
        );
        let left: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT status, count(*) FROM \"{}\".outbox_events WHERE aggregate_id LIKE $1 \
             GROUP BY status ORDER BY status",
            ctx.schema
        ))
        .bind(format!("{m}-cl%"))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            left,
            [
                ("parked".to_owned(), 1),
                ("pending".to_owned(), 1),
                ("published".to_owned(), 4)
            ],
            "{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        let rep = store.cleanup(Duration::from_millis(10), 100).await.unwrap();
        assert_eq!(rep.removed, 4, "{m}");
        let left: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM \"{}\".outbox_events WHERE aggregate_id LIKE $1",
            ctx.schema
        ))
        .bind(format!("{m}-cl%"))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(left, 2, "{m}: the parked and the pending row stay");
    }
    ctx.drop().await;
}

/// Attack A6: the plain SQL (`outbox_schema_sql`) applied to a fresh schema gives the same
/// indexes (definitions, not just names) as `migrate()`, and neither has `published_at_idx`.
#[tokio::test]
async fn plain_sql_has_the_same_indexes_as_migrate() {
    let ctx = ctx!(4);
    let store = ctx.store(lease(30.0)).await;
    let plain = format!("{}_plain", &ctx.schema);
    let sql = outbox_postgres::outbox_schema_sql(&plain, "outbox_events").unwrap();
    sqlx::raw_sql(&sql).execute(&ctx.pool).await.unwrap();
    let migrated = index_defs(&ctx, &ctx.schema).await;
    let from_plain = index_defs(&ctx, &plain).await;
    // The migration record table exists only with migrate().
    let migrated: Vec<_> = migrated
        .into_iter()
        .filter(|d| !d.contains("outbox_schema_migrations"))
        .collect();
    let _ = sqlx::query(&format!("DROP SCHEMA \"{plain}\" CASCADE"))
        .execute(&ctx.pool)
        .await;
    assert_eq!(from_plain, migrated);
    assert!(!migrated.iter().any(|d| d.contains("published_at_idx")));
    assert!(migrated
        .iter()
        .any(|d| d.contains("outbox_events_finished_idx")));
    drop(store);
    ctx.drop().await;
}
