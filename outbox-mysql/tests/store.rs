//! MySQL/MariaDB-specific behaviour of the outbox store, beyond the conformance suite: the
//! fixes of the concurrent correctness pass carried into this store (`accept_first_version`
//! kept across claims that do not publish, serialized migrations; the stats are in `stats.rs`,
//! aggregate names at their bound in `aggregate_names.rs`), the
//! locked claim's server-side hold, the in-process wake-up, validation of names and values.
//! Each test has its own database on the server at `MYSQL_URL`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::prelude::*;
use outbox_core::{
    ClaimMode, ClaimRequest, Envelope, ErrorClass, LastError, Outcome, RelayConfig, StoreErrorKind,
};
use outbox_mysql::MySqlOutboxStore;

use common::{append, claim, event, lease, publish_all, published, versions};

fn defer(e: &Envelope, delay: Duration) -> Outcome {
    Outcome::Defer {
        event_id: e.event_id,
        delay,
        error: LastError {
            class: ErrorClass::Transient,
            kind: "broker_unavailable".into(),
            message: "down".into(),
        },
    }
}

/// Issue 20 (a), carried: with `accept_first_version`, an aggregate's first stored version
/// is its baseline until a version is published or discarded. Claims that end without a
/// publication (a deferral, a retry, a release, a lease that expires under a crashed relay)
/// must not turn that baseline into "last version 0", which would hold the aggregate as a
/// version gap and park it.
#[tokio::test]
async fn accept_first_version_survives_claims_that_do_not_publish() {
    let ctx = ctx!(4);
    let store = ctx
        .builder(lease(0.6))
        .accept_first_version(true)
        .gap_timeout(Duration::from_millis(400))
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let (v5, v6) = (event("legacy", 5), event("legacy", 6));
    append(&ctx, &store, &[v5.clone(), v6.clone()]).await;

    // Deferred.
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("legacy".into(), 5)]);
    store
        .complete(&b.handle, &[defer(&v5, Duration::from_millis(10))])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Retried.
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("legacy".into(), 5)], "after a deferral");
    assert_eq!(b.gaps_held, 0);
    store
        .complete(&b.handle, &[common::retry(&v5, Duration::from_millis(10))])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    // Released.
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("legacy".into(), 5)], "after a retry");
    store.release(&b.handle).await.unwrap();
    // Crashed: the lease expires.
    let b = claim(&store, "r", 10).await;
    assert_eq!(versions(&b), vec![("legacy".into(), 5)], "after a release");
    tokio::time::sleep(Duration::from_millis(700)).await;
    let b = claim(&store, "r2", 10).await;
    assert_eq!(
        versions(&b),
        vec![("legacy".into(), 5)],
        "after an expired lease (and past the gap timeout: nothing was held)"
    );
    assert_eq!(b.gaps_held, 0);
    assert!(b.parked.is_empty(), "{:?}", b.parked);
    assert!(
        b.records[0].maybe_sent_before,
        "an expired claim may have sent it"
    );
    publish_all(&store, &b).await;
    let b = claim(&store, "r2", 10).await;
    assert_eq!(versions(&b), vec![("legacy".into(), 6)]);
    publish_all(&store, &b).await;
    assert_eq!(store.stats().await.unwrap().parked, 0);
    ctx.drop().await;
}

/// Issue 20 (d), carried for a new crate: two `migrate` runs at once are serialized by the
/// named lock, apply each migration once, and leave the lock free.
#[tokio::test]
async fn concurrent_migrations_apply_once_and_release_the_lock() {
    let ctx = ctx!(12);
    let store = ctx.builder(lease(30.0)).build().unwrap();
    let inbox = outbox_mysql::MySqlInboxStore::builder(ctx.pool.clone())
        .database(&ctx.database)
        .build()
        .unwrap();
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let (s, i) = (store.clone(), inbox.clone());
            tokio::spawn(async move { (s.migrate().await, i.migrate().await) })
        })
        .collect();
    let (mut outbox_applied, mut inbox_applied) = (0, 0);
    for r in runs {
        let (o, i) = r.await.unwrap();
        outbox_applied += o.expect("outbox migrate");
        inbox_applied += i.expect("inbox migrate");
    }
    assert_eq!(
        (outbox_applied, inbox_applied),
        (
            outbox_mysql::outbox_migrations().len(),
            outbox_mysql::inbox_migrations().len()
        ),
        "each migration once"
    );
    // The lock's name is one per server, and other tests migrate their own databases at the
    // same time: it must not be held by a session of this test's pool (every connection of
    // the pool, taken at once), whoever else holds it meanwhile.
    let mut conns = Vec::new();
    let mut ours = Vec::new();
    for _ in 0..12 {
        let mut c = ctx.pool.acquire().await.unwrap();
        let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
            .fetch_one(&mut *c)
            .await
            .unwrap();
        ours.push(id);
        conns.push(c);
    }
    let holder: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?)")
        .bind(outbox_mysql::MIGRATION_LOCK)
        .fetch_one(&mut *conns[0])
        .await
        .unwrap();
    assert!(
        holder.is_none_or(|h| !ours.contains(&h)),
        "the migration lock is free again (held by {holder:?}; this test's sessions: {ours:?})"
    );
    drop(conns);
    assert_eq!(store.migrate().await.unwrap(), 0);
    ctx.drop().await;
}

/// A locked claim whose relay hangs is ended by the server after `locked_max_hold` (the
/// session's `wait_timeout`): another relay then claims the aggregate, and the hung relay's
/// completion is reported as a lost claim.
#[tokio::test]
async fn a_locked_claim_held_past_its_hold_is_ended_by_the_server() {
    let ctx = ctx!(6);
    let build = || {
        ctx.builder(ClaimMode::LockedTransaction)
            .locked_max_hold(Duration::from_secs(1))
            .build()
            .unwrap()
    };
    let (r1, r2) = (build(), build());
    r1.migrate().await.unwrap();
    let e = event("hung", 1);
    append(&ctx, &r1, std::slice::from_ref(&e)).await;
    let b1 = claim(&r1, "r1", 10).await;
    assert_eq!(b1.records.len(), 1);
    assert!(claim(&r2, "r2", 10).await.is_empty(), "held while alive");
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let b2 = claim(&r2, "r2", 10).await;
    assert_eq!(
        versions(&b2),
        vec![("hung".into(), 1)],
        "the server ended the claim"
    );
    let late = r1.complete(&b1.handle, &[published(&e, 1)]).await;
    assert!(
        matches!(&late, Err(err) if err.kind == StoreErrorKind::LeaseLost),
        "{late:?}"
    );
    publish_all(&r2, &b2).await;
    ctx.drop().await;
}

/// Names are validated before they reach SQL; a `created_at` MySQL's DATETIME cannot hold is
/// a validation error, and nothing is written.
#[tokio::test]
async fn hostile_names_and_unstorable_times_are_refused() {
    let ctx = ctx!(2);
    for (db, table) in [
        ("x`; DROP DATABASE test; --", "outbox_events"),
        ("ok", "t`x"),
        ("Upper", "outbox_events"),
        ("mysql", "outbox_events"),
        ("ok", &"t".repeat(41)),
    ] {
        let err = MySqlOutboxStore::builder(ctx.pool.clone())
            .database(db)
            .table(table)
            .build()
            .expect_err(db);
        assert_eq!(err.kind, StoreErrorKind::Configuration, "{db} {table}");
    }
    let store = ctx.store(lease(30.0)).await;
    let ancient = Envelope::builder("order", "o", 1, "t")
        .created_at("0999-12-31T23:59:59Z".parse().unwrap())
        .build()
        .unwrap();
    let mut tx = ctx.pool.begin().await.unwrap();
    let err = store
        .append_many(&mut *tx, &[event("o", 1), ancient])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Validation, "{err}");
    tx.commit().await.unwrap();
    assert_eq!(
        store.stats().await.unwrap().unpublished,
        0,
        "nothing written"
    );
    ctx.drop().await;
}

/// A batch larger than one statement (500 events) is refused by `append_many` and written all
/// or nothing by `append_many_in`: a duplicate event id in its last part leaves none of it.
#[tokio::test]
async fn a_batch_split_into_statements_is_all_or_nothing() {
    let ctx = ctx!(2);
    let store = ctx.store(lease(30.0)).await;
    let mut events: Vec<Envelope> = (0..1200).map(|i| event(&format!("a{i}"), 1)).collect();
    append(&ctx, &store, &events[..1]).await;
    events.push(events[0].clone());
    let mut tx = ctx.pool.begin().await.unwrap();
    let err = store.append_many(&mut *tx, &events[1..]).await.unwrap_err();
    assert_eq!(
        err.kind,
        StoreErrorKind::Validation,
        "one statement at most: {err}"
    );
    let err = store
        .append_many_in(&mut tx, &events[1..])
        .await
        .unwrap_err();
    assert_eq!(err.kind, StoreErrorKind::Constraint, "{err}");
    tx.commit().await.unwrap();
    assert_eq!(
        store.stats().await.unwrap().unpublished,
        1,
        "none of the batch"
    );
    let mut tx = ctx.pool.begin().await.unwrap();
    store
        .append_many_in(&mut tx, &events[1..1200])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.stats().await.unwrap().unpublished, 1200);
    ctx.drop().await;
}

/// The in-process wake-up: a relay driver that sleeps long between idle polls publishes an
/// event appended through `commit_and_wake` at once; the same append committed without it
/// waits for the next poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_and_wake_wakes_a_relay_of_the_process_at_once() {
    let ctx = ctx!(6);
    let store = ctx.store(lease(30.0)).await;
    let log = outbox_testkit::MemoryLog::builder()
        .topic("orders", 1)
        .default_topic("orders")
        .build();
    let config = RelayConfig::builder()
        .owner("waker")
        .idle(Duration::from_secs(4), Duration::from_secs(4))
        .build()
        .unwrap();
    let relay = outbox_core::Relay::new(
        store.clone(),
        log.clone(),
        config,
        Arc::new(outbox_core::SystemClock),
        Box::new(<rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(7)),
    )
    .unwrap();
    let wake = Arc::new(tokio::sync::Notify::new());
    let _subscription = store.subscribe_wakeups(wake.clone());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let driver = tokio::spawn(outbox_core::driver::run(relay, Some(wake), async move {
        let _ = stopped.await;
    }));
    // Let the driver find nothing and go to sleep.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let published_count = || log.records("orders", 0).len();
    let wait_for = |n: usize, limit: Duration| {
        let log = log.clone();
        async move {
            let start = Instant::now();
            while start.elapsed() < limit {
                if log.records("orders", 0).len() >= n {
                    return Some(start.elapsed());
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            None
        }
    };
    let mut latencies = Vec::new();
    for i in 0..5 {
        let mut tx = ctx.pool.begin().await.unwrap();
        store
            .append_many(&mut *tx, &[event(&format!("w{i}"), 1)])
            .await
            .unwrap();
        store.commit_and_wake(tx).await.unwrap();
        let took = wait_for(i + 1, Duration::from_secs(2))
            .await
            .expect("published within 2 s of the wake-up");
        latencies.push(took);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Control: without the wake-up the relay sleeps out its idle delay. First let it finish
    // the empty cycle that follows a publication (under load it can start well after the
    // 100 ms above, and would then find the control event without any wake-up).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    store
        .append_many(&mut *tx, &[event("unwoken", 1)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let unwoken = wait_for(6, Duration::from_millis(1000)).await;
    assert_eq!(unwoken, None, "published without a wake-up within 1 s");
    assert_eq!(published_count(), 5);
    eprintln!("commit_and_wake: commit-to-published latencies {latencies:?}");
    let _ = stop.send(());
    let _ = driver.await;
    ctx.drop().await;
}

/// Claims of concurrent relays never hand out one aggregate twice, and every event goes out
/// once, with SKIP LOCKED under contention (8 relays on 200 aggregates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_share_the_backlog_without_overlap() {
    let ctx = ctx!(16);
    let store = ctx.store(lease(30.0)).await;
    let events: Vec<Envelope> = (0..200)
        .flat_map(|a| (1..=3).map(move |v| event(&format!("c{a}"), v)))
        .collect();
    append(&ctx, &store, &events).await;
    let tasks: Vec<_> = (0..8)
        .map(|r| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut empty = 0;
                while empty < 5 {
                    let b = store
                        .claim(&ClaimRequest::new(format!("r{r}"), 20))
                        .await
                        .expect("claim");
                    if b.is_empty() {
                        empty += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    empty = 0;
                    got.extend(versions(&b));
                    let outs: Vec<Outcome> = b
                        .records
                        .iter()
                        .map(|rec| published(&rec.envelope, 0))
                        .collect();
                    let rep = store.complete(&b.handle, &outs).await.expect("complete");
                    assert_eq!(rep.superseded, 0);
                }
                got
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all.sort();
    let want: Vec<(String, i64)> = {
        let mut w: Vec<(String, i64)> = events
            .iter()
            .map(|e| (e.aggregate_id.clone(), e.aggregate_version))
            .collect();
        w.sort();
        w
    };
    assert_eq!(all, want, "each event claimed and published exactly once");
    ctx.drop().await;
}
