//! Adversarial checks of the third drain pass of the MySQL/MariaDB store (state rows written
//! by multi-row `INSERT .. ON DUPLICATE KEY UPDATE` checked to update every row, the claim's
//! `next_attempt_at` as a separate `UPDATE`, the head probes skipped when no row is parked or
//! blocked), against the real server: concurrent relays, appenders and operator actions, and
//! interleavings forced with held transactions on other connections.
//!
//! Each test uses its own database. Needs MySQL/MariaDB at `MYSQL_URL`; see `common`.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{ClaimMode, ClaimRequest, Envelope, Outcome, StoreError, StoreErrorKind};
use sqlx::Executor;

use common::{claim, event, lease, published};

const AGGS: usize = 24;
const VERSIONS: i64 = 4;

/// Three relays claim and complete overlapping batches while an appender keeps adding the
/// next versions of the aggregates (new aggregates' state rows inserted by the claims while
/// other claims and completions upsert theirs), some outcomes retried at once. Nothing fails
/// (no deadlock or lock wait timeout surfaces), every event is published exactly once, each
/// aggregate in version order (acknowledgement offsets taken before each completion grow
/// with the version), its last version ends at the top and each row's attempts count its
/// retries. A follower left blocked would stall the drain and fail the deadline.
#[tokio::test]
async fn overlapping_relays_and_an_appender_deliver_in_order_without_errors() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(24);
        let store = ctx.store(mode).await;
        let offsets = Arc::new(AtomicI64::new(1));
        let appended = Arc::new(AtomicBool::new(false));
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let retries: Arc<Mutex<HashMap<uuid::Uuid, i64>>> = Arc::default();
        let published_n = Arc::new(AtomicUsize::new(0));
        let total = AGGS * VERSIONS as usize;
        // The appender: version by version, a few aggregates per transaction.
        let appender = {
            let (ctx_pool, store, appended) = (ctx.pool.clone(), store.clone(), appended.clone());
            tokio::spawn(async move {
                for v in 1..=VERSIONS {
                    for chunk in (0..AGGS).collect::<Vec<_>>().chunks(5) {
                        let evs: Vec<Envelope> = chunk
                            .iter()
                            .map(|i| event(&format!("s{i:02}"), v))
                            .collect();
                        let mut tx = ctx_pool.begin().await.unwrap();
                        store.append_many_in(&mut tx, &evs).await.unwrap();
                        tx.commit().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(3)).await;
                    }
                }
                appended.store(true, Ordering::SeqCst);
            })
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut relays = Vec::new();
        for r in 0..3 {
            let (store, offsets, errors, retries, published_n) = (
                store.clone(),
                offsets.clone(),
                errors.clone(),
                retries.clone(),
                published_n.clone(),
            );
            relays.push(tokio::spawn(async move {
                let mut turn = 0usize;
                while published_n.load(Ordering::SeqCst) < total && Instant::now() < deadline {
                    let batch = match store
                        .claim(&ClaimRequest::new(format!("relay-{r}"), 7))
                        .await
                    {
                        Ok(b) => b,
                        Err(e) => {
                            errors.lock().unwrap().push(format!("claim: {e}"));
                            continue;
                        }
                    };
                    if batch.records.is_empty() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    let mut outs = Vec::new();
                    let mut pubs = 0;
                    for rec in &batch.records {
                        turn += 1;
                        if turn % 5 == r + 1 {
                            outs.push(common::retry(&rec.envelope, Duration::ZERO));
                        } else {
                            let off = offsets.fetch_add(1, Ordering::SeqCst);
                            outs.push(published(&rec.envelope, off));
                            pubs += 1;
                        }
                    }
                    match store.complete(&batch.handle, &outs).await {
                        Ok(rep) if rep.applied == outs.len() => {
                            let mut map = retries.lock().unwrap();
                            for o in &outs {
                                if let Outcome::Retry { event_id, .. } = o {
                                    *map.entry(event_id.as_uuid()).or_default() += 1;
                                }
                            }
                            published_n.fetch_add(pubs, Ordering::SeqCst);
                        }
                        Ok(rep) => errors.lock().unwrap().push(format!(
                            "{} of {} outcomes applied on a live claim",
                            rep.applied,
                            outs.len()
                        )),
                        Err(e) => errors.lock().unwrap().push(format!("complete: {e}")),
                    }
                }
            }));
        }
        appender.await.unwrap();
        for r in relays {
            r.await.unwrap();
        }
        let errors = errors.lock().unwrap().clone();
        assert!(errors.is_empty(), "{mode:?}: {errors:?}");
        assert!(appended.load(Ordering::SeqCst));
        assert_eq!(
            published_n.load(Ordering::SeqCst),
            total,
            "{mode:?}: drained before the deadline"
        );
        let rows: Vec<(String, i64, String, Option<i64>, i64, uuid::Uuid)> =
            sqlx::query_as(&format!(
                "SELECT CONVERT(aggregate_id USING utf8mb4), aggregate_version, CONVERT(status USING utf8mb4), ack_position, attempts, event_id \
                 FROM {} ORDER BY aggregate_id, aggregate_version",
                ctx.table("outbox_events")
            ))
            .fetch_all(&ctx.pool)
            .await
            .unwrap();
        assert_eq!(rows.len(), total);
        let retries = retries.lock().unwrap().clone();
        let mut extra = None;
        for w in rows.windows(2) {
            if w[0].0 == w[1].0 {
                assert!(
                    w[0].3 < w[1].3,
                    "{mode:?}: {} v{} published after v{}",
                    w[0].0,
                    w[0].1,
                    w[1].1
                );
            }
        }
        for (agg, v, status, _, attempts, id) in &rows {
            assert_eq!(status, "published", "{mode:?}: {agg} v{v}");
            // Attempts minus this row's retries: the same for every row.
            let base = attempts - retries.get(id).copied().unwrap_or(0);
            assert_eq!(*extra.get_or_insert(base), base, "{mode:?}: {agg} v{v}");
        }
        assert!(!retries.is_empty(), "some outcomes were retries");
        let lasts: Vec<Option<i64>> = sqlx::query_scalar(&format!(
            "SELECT last_version FROM {}",
            ctx.table("outbox_events_aggregate")
        ))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(lasts.len(), AGGS);
        assert!(lasts.iter().all(|l| *l == Some(VERSIONS)), "{lasts:?}");
        ctx.drop().await;
    }
}

/// The keys of aggregates `aggs` (each with a row in the table).
async fn keys(ctx: &common::Ctx, aggs: &[String]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for a in aggs {
        let k: Vec<u8> = sqlx::query_scalar(&format!(
            "SELECT aggregate_key FROM {} WHERE aggregate_id = ? LIMIT 1",
            ctx.table("outbox_events")
        ))
        .bind(a)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        out.push((a.clone(), k));
    }
    out
}

/// A READ COMMITTED transaction on a connection of its own.
async fn held(ctx: &common::Ctx) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut conn = ctx.pool.acquire().await.unwrap();
    conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION")
        .await
        .unwrap();
    conn
}

/// Next-key and gap locks of the state-row upserts. (1) Another claim has inserted the state
/// row of a new aggregate whose key lies between the keys a lease completion's upsert writes,
/// and not committed: the completion must not wait on it. (2) The other way round: a
/// transaction holds the very upsert a completion runs, on the state rows around a new
/// aggregate's key: a claim inserting that aggregate's state row must not wait either.
#[tokio::test]
async fn state_row_upserts_and_new_state_row_inserts_do_not_wait_on_each_other() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let store = ctx.store(mode).await;
        let old: Vec<String> = (0..12).map(|i| format!("old{i}")).collect();
        let evs: Vec<Envelope> = old.iter().map(|a| event(a, 1)).collect();
        common::append(&ctx, &store, &evs).await;
        let mut old_keys = keys(&ctx, &old).await;
        old_keys.sort_by(|a, b| a.1.cmp(&b.1));
        let (lo, hi) = (old_keys[0].1.clone(), old_keys[11].1.clone());
        // New aggregates with keys inside the range of the old ones.
        let mut inside = Vec::new();
        for i in 0..40 {
            let a = format!("new{i}");
            common::append(&ctx, &store, &[event(&a, 1)]).await;
            let (_, k) = keys(&ctx, std::slice::from_ref(&a)).await.remove(0);
            if k > lo && k < hi {
                inside.push(a);
            }
            if inside.len() == 2 {
                break;
            }
        }
        assert_eq!(inside.len(), 2, "two new keys inside the old range");
        // The old aggregates claimed (their state rows created) by a claim that cannot see
        // the new rows: they are held back by a far `next_attempt_at`.
        sqlx::query(&format!(
            "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR \
             WHERE aggregate_id LIKE 'new%'",
            ctx.table("outbox_events")
        ))
        .execute(&ctx.pool)
        .await
        .unwrap();
        let batch = claim(&store, "relay", 100).await;
        assert_eq!(batch.records.len(), 12, "{mode:?}");
        // (1) The first new aggregate's state row inserted, uncommitted.
        let mut other = held(&ctx).await;
        sqlx::query(&format!(
            "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
             SELECT aggregate_key, aggregate_type, aggregate_id, UTC_TIMESTAMP(6) \
             FROM {} WHERE aggregate_id = ?",
            ctx.table("outbox_events_aggregate"),
            ctx.table("outbox_events")
        ))
        .bind(&inside[0])
        .execute(&mut *other)
        .await
        .unwrap();
        let outs: Vec<Outcome> = batch
            .records
            .iter()
            .enumerate()
            .map(|(i, r)| published(&r.envelope, i as i64))
            .collect();
        let rep = tokio::time::timeout(
            Duration::from_secs(10),
            store.complete(&batch.handle, &outs),
        )
        .await
        .unwrap_or_else(|_| panic!("{mode:?}: the completion waited on another claim's insert"))
        .unwrap();
        assert_eq!(rep.applied, 12, "{mode:?}");
        other.execute("ROLLBACK").await.unwrap();
        drop(other);
        // (2) The completion's upsert held on all the old state rows, uncommitted.
        let mut other = held(&ctx).await;
        let sql = format!(
            "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, last_version, \
               updated_at) VALUES {} \
             ON DUPLICATE KEY UPDATE lease_owner = NULL, lease_token = NULL, \
               lease_until = NULL, lease_row = NULL, \
               last_version = COALESCE(VALUES(last_version), last_version), \
               updated_at = VALUES(updated_at)",
            ctx.table("outbox_events_aggregate"),
            vec!["(?, '', '', NULL, UTC_TIMESTAMP(6))"; old_keys.len()].join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (_, k) in &old_keys {
            q = q.bind(k);
        }
        let n = q.execute(&mut *other).await.unwrap().rows_affected();
        assert_eq!(n, 24, "each old state row updated (2 each)");
        sqlx::query(&format!(
            "UPDATE {} SET next_attempt_at = UTC_TIMESTAMP(6) WHERE aggregate_id IN (?, ?)",
            ctx.table("outbox_events")
        ))
        .bind(&inside[0])
        .bind(&inside[1])
        .execute(&ctx.pool)
        .await
        .unwrap();
        let batch = tokio::time::timeout(Duration::from_secs(10), async {
            claim(&store, "relay", 100).await
        })
        .await
        .unwrap_or_else(|_| panic!("{mode:?}: the claim's insert waited on a held upsert"));
        let mut want = vec![(inside[0].clone(), 1), (inside[1].clone(), 1)];
        want.sort();
        assert_eq!(common::versions(&batch), want, "{mode:?}");
        common::publish_all(&store, &batch).await;
        other.execute("COMMIT").await.unwrap();
        drop(other);
        ctx.drop().await;
    }
}

/// A completion racing the claim of the aggregate's next version, many times over: relay A
/// publishes v(n) while relay B claims at the same moment. B either finds v(n+1) blocked
/// behind v(n) (then A's completion must unblock it: its unblocking probe may not be skipped
/// because B's blocking committed after the probe's snapshot) or claims it after A
/// committed. Every version is delivered, in order, and never two of one aggregate at once.
#[tokio::test]
async fn a_completion_racing_the_claim_of_the_next_version_never_strands_it() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(8);
        let store = ctx.store(mode).await;
        let n = 30;
        let evs: Vec<Envelope> = (1..=n).map(|v| event("race", v)).collect();
        common::append(&ctx, &store, &evs).await;
        let mut next = 1;
        let mut current = claim(&store, "relay-a", 10).await;
        assert_eq!(common::versions(&current), vec![("race".to_owned(), 1)]);
        let mut stalls = 0;
        while next <= n {
            let rec = current.records[0].envelope.clone();
            assert_eq!(rec.aggregate_version, next, "{mode:?}: in order");
            let s = store.clone();
            let h = current.handle.clone();
            let done = tokio::spawn(async move {
                s.complete(&h, &[published(&rec, rec.aggregate_version)])
                    .await
            });
            let b = store
                .claim(&ClaimRequest::new("relay-b", 10))
                .await
                .unwrap();
            let rep = done.await.unwrap().unwrap();
            assert_eq!(rep.applied, 1, "{mode:?}");
            next += 1;
            if next > n {
                assert!(b.records.is_empty(), "{mode:?}");
                break;
            }
            current = if b.records.is_empty() {
                // B met the row blocked or ran before the commit: a claim now must find it.
                stalls += 1;
                let c = claim(&store, "relay-a", 10).await;
                assert!(
                    !c.records.is_empty(),
                    "{mode:?}: v{next} stranded after its predecessor was published"
                );
                c
            } else {
                b
            };
            assert_eq!(current.records.len(), 1, "{mode:?}: one head at a time");
        }
        let _ = stalls;
        ctx.drop().await;
    }
}

/// Replays and stolen leases with state-row values that do not change: a completion replayed
/// after its lease ended, a release of a released claim, and a completion of a lease that
/// expired and was taken over by the same owner name (same `lease_owner`, a new token) are
/// refused without error, and the aggregate goes on.
#[tokio::test]
async fn replays_and_same_owner_takeovers_are_refused_without_error() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(0.3)).await;
    let evs: Vec<Envelope> = (1..=3).map(|v| event("same", v)).collect();
    common::append(&ctx, &store, &evs).await;
    let first = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&first), vec![("same".to_owned(), 1)]);
    tokio::time::sleep(Duration::from_millis(450)).await;
    let second = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&second), vec![("same".to_owned(), 1)]);
    let outs = vec![published(&first.records[0].envelope, 1)];
    let rep = store.complete(&first.handle, &outs).await.unwrap();
    assert_eq!(rep.applied, 0, "the stolen lease is fenced");
    let outs = vec![published(&second.records[0].envelope, 2)];
    assert_eq!(
        store.complete(&second.handle, &outs).await.unwrap().applied,
        1
    );
    assert_eq!(
        store.complete(&second.handle, &outs).await.unwrap().applied,
        0
    );
    store.release(&second.handle).await.unwrap();
    store.release(&first.handle).await.unwrap();
    let third = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&third), vec![("same".to_owned(), 2)]);
    store.release(&third.handle).await.unwrap();
    store.release(&third.handle).await.unwrap();
    let fourth = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&fourth), vec![("same".to_owned(), 2)]);
    common::publish_all(&store, &fourth).await;
    let fifth = claim(&store, "relay", 10).await;
    assert_eq!(common::versions(&fifth), vec![("same".to_owned(), 3)]);
    common::publish_all(&store, &fifth).await;
    ctx.drop().await;
}

/// Whether an error is a lock conflict surfacing (deadlock 1213, lock wait timeout 1205) or a
/// failed state-row count check, which no caller may see under concurrency.
fn lock_failure(e: &StoreError) -> bool {
    let m = e.to_string().to_lowercase();
    m.contains("1213")
        || m.contains("1205")
        || m.contains("deadlock")
        || m.contains("lock wait")
        || m.contains("row counts")
}

/// The rows of the table: (aggregate, version, status, ack offset), in version order.
async fn rows(ctx: &common::Ctx) -> Vec<(String, i64, String, Option<i64>)> {
    sqlx::query_as(&format!(
        "SELECT CONVERT(aggregate_id USING utf8mb4), aggregate_version, \
           CONVERT(status USING utf8mb4), ack_position \
         FROM {} ORDER BY aggregate_id, aggregate_version",
        ctx.table("outbox_events")
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

/// Four relays with leases shorter than some of their sends (leases expire and are taken
/// over, late completions fenced), some outcomes parked, an operator retrying every parked
/// event and releasing one relay's claims while an appender adds versions. Claims,
/// completions and releases never fail; the operator's actions fail only as refused
/// (`NotFound`, `Conflict` without a lock conflict); every event ends published, each
/// aggregate's acknowledgements in version order, its last version at the top.
#[tokio::test]
async fn expiring_leases_parks_and_operator_actions_race_without_losses() {
    for mode in [lease(0.2), ClaimMode::LockedTransaction] {
        let ctx = ctx!(24);
        let store = ctx.store(mode).await;
        let offsets = Arc::new(AtomicI64::new(1));
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let total = AGGS * VERSIONS as usize;
        let appender = {
            let (pool, store) = (ctx.pool.clone(), store.clone());
            tokio::spawn(async move {
                for v in 1..=VERSIONS {
                    for chunk in (0..AGGS).collect::<Vec<_>>().chunks(7) {
                        let evs: Vec<Envelope> = chunk
                            .iter()
                            .map(|i| event(&format!("p{i:02}"), v))
                            .collect();
                        let mut tx = pool.begin().await.unwrap();
                        store.append_many_in(&mut tx, &evs).await.unwrap();
                        tx.commit().await.unwrap();
                        tokio::time::sleep(Duration::from_millis(7)).await;
                    }
                }
            })
        };
        let mut tasks = Vec::new();
        for r in 0..4usize {
            let (store, offsets, errors, stop) =
                (store.clone(), offsets.clone(), errors.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut turn = 0usize;
                while !stop.load(Ordering::SeqCst) {
                    let batch = match store
                        .claim(&ClaimRequest::new(format!("relay-{r}"), 5))
                        .await
                    {
                        Ok(b) => b,
                        Err(e) => {
                            errors.lock().unwrap().push(format!("claim: {e}"));
                            continue;
                        }
                    };
                    if batch.records.is_empty() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    turn += 1;
                    let outs: Vec<Outcome> = batch
                        .records
                        .iter()
                        .enumerate()
                        .map(|(i, rec)| {
                            if (turn + i + r) % 9 == 4 {
                                common::park(&rec.envelope)
                            } else {
                                published(&rec.envelope, offsets.fetch_add(1, Ordering::SeqCst))
                            }
                        })
                        .collect();
                    if turn.is_multiple_of(4) {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    let done = if turn % 11 == 5 {
                        store.release(&batch.handle).await.map(|_| ())
                    } else {
                        store.complete(&batch.handle, &outs).await.map(|_| ())
                    };
                    if let Err(e) = done {
                        errors
                            .lock()
                            .unwrap()
                            .push(format!("complete/release: {e}"));
                    }
                }
            }));
        }
        {
            let (store, errors, stop) = (store.clone(), errors.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut turn = 0;
                while !stop.load(Ordering::SeqCst) {
                    turn += 1;
                    match store.list_parked(50).await {
                        Ok(parked) => {
                            for p in parked {
                                if let Err(e) = store.retry_parked(p.envelope.event_id, "op").await
                                {
                                    if lock_failure(&e)
                                        || !matches!(
                                            e.kind,
                                            StoreErrorKind::NotFound | StoreErrorKind::Conflict
                                        )
                                    {
                                        errors.lock().unwrap().push(format!("retry: {e}"));
                                    }
                                }
                            }
                        }
                        Err(e) => errors.lock().unwrap().push(format!("list: {e}")),
                    }
                    if turn % 10 == 0 {
                        if let Err(e) = store.release_claims_of("relay-1", "op").await {
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("release_claims_of: {e}"));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }));
        }
        appender.await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let rs = rows(&ctx).await;
            let done = rs.iter().filter(|r| r.2 == "published").count();
            if done == total || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        stop.store(true, Ordering::SeqCst);
        for t in tasks {
            t.await.unwrap();
        }
        let errors = errors.lock().unwrap().clone();
        assert!(errors.is_empty(), "{mode:?}: {errors:?}");
        let rs = rows(&ctx).await;
        assert_eq!(rs.len(), total);
        for r in &rs {
            assert_eq!(r.2, "published", "{mode:?}: {r:?} never published");
        }
        for w in rs.windows(2) {
            if w[0].0 == w[1].0 {
                assert!(
                    w[0].3 < w[1].3,
                    "{mode:?}: out of order {:?} {:?}",
                    w[0],
                    w[1]
                );
            }
        }
        let lasts: Vec<Option<i64>> = sqlx::query_scalar(&format!(
            "SELECT last_version FROM {}",
            ctx.table("outbox_events_aggregate")
        ))
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(lasts.len(), AGGS);
        assert!(
            lasts.iter().all(|l| *l == Some(VERSIONS)),
            "{mode:?}: {lasts:?}"
        );
        ctx.drop().await;
    }
}

/// The parked probe skipped only while no row is parked: once the first row of the table is
/// parked (the head of its aggregate), the next version appended after it is its follower,
/// blocked, and never
/// taken for a version gap (which would park it as a gap past the gap timeout). Other
/// aggregates flow meanwhile. After the operator's retry both go out in order.
#[tokio::test]
async fn the_first_parked_row_blocks_its_follower_not_as_a_gap() {
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let ctx = ctx!(6);
        let store = ctx
            .builder(mode)
            .gap_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        let v1 = event("pk", 1);
        let v2 = event("pk", 2);
        common::append(&ctx, &store, std::slice::from_ref(&v1)).await;
        let b = claim(&store, "relay", 10).await;
        assert_eq!(common::versions(&b), vec![("pk".to_owned(), 1)], "{mode:?}");
        let rep = store
            .complete(&b.handle, &[common::park(&v1)])
            .await
            .unwrap();
        assert_eq!(rep.applied, 1);
        // Appended after the park: no claim has blocked it, so it is a candidate.
        common::append(&ctx, &store, std::slice::from_ref(&v2)).await;
        for i in 0..3 {
            let other = event(&format!("flow{i}"), 1);
            common::append(&ctx, &store, std::slice::from_ref(&other)).await;
            let b = claim(&store, "relay", 10).await;
            assert_eq!(
                common::versions(&b),
                vec![(format!("flow{i}"), 1)],
                "{mode:?}"
            );
            assert!(b.parked.is_empty(), "{mode:?}: {:?}", b.parked);
            common::publish_all(&store, &b).await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let status: String = sqlx::query_scalar(&format!(
            "SELECT CONVERT(status USING utf8mb4) FROM {} WHERE event_id = ?",
            ctx.table("outbox_events")
        ))
        .bind(v2.event_id.as_uuid())
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(
            status, "pending",
            "{mode:?}: the follower was parked as a gap"
        );
        store.retry_parked(v1.event_id, "op").await.unwrap();
        for want in 1..=2 {
            let b = claim(&store, "relay", 10).await;
            assert_eq!(
                common::versions(&b),
                vec![("pk".to_owned(), want)],
                "{mode:?}"
            );
            common::publish_all(&store, &b).await;
        }
        ctx.drop().await;
    }
}
