//! Adversarial tests of the wake-up gate against the real PostgreSQL: open appends while the
//! relay arms, two relays arming at once, the gate's connection killed while armed, rolled-back
//! appends, and appends under READ COMMITTED / REPEATABLE READ.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::{Duration, Instant};

use common::{
    claim, event, lease, listening_store, publish_all, raw_listener, received_until_marker,
};

/// Advisory locks in this database: (pid, mode, granted).
async fn advisory(ctx: &common::Ctx) -> Vec<(i32, String, bool)> {
    sqlx::query_as(
        "SELECT pid, mode, granted FROM pg_locks WHERE locktype = 'advisory' \
         AND objsubid = 2 \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(&ctx.pool)
    .await
    .unwrap()
}

async fn wait_for_waiter(ctx: &common::Ctx) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if advisory(ctx).await.iter().any(|(_, _, g)| !g) {
            return;
        }
        assert!(Instant::now() < deadline, "nobody queued on the gate");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An append transaction holds the shared try-lock and stays open past the wait: the relay's
/// claim returns after about the wait (unarmed), appends made while it is queued complete at
/// once, and once the long append commits the next claim finds its row.
#[tokio::test]
async fn an_open_append_never_blocks_and_the_relay_times_out() {
    let ctx = ctx!(8);
    let wait = Duration::from_secs(2);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), wait).await;
    let mut long = ctx.pool.begin().await.unwrap();
    store.append(&mut *long, &event("long", 1)).await.unwrap();
    assert!(
        advisory(&ctx)
            .await
            .iter()
            .any(|(_, m, g)| m == "ShareLock" && *g),
        "the open append holds the shared gate lock"
    );
    let relay = {
        let store = store.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let b = claim(&store, "r", 10).await;
            (b, t.elapsed())
        })
    };
    wait_for_waiter(&ctx).await;
    // Appends while the relay is queued: each finishes fast, in and out of a transaction.
    for i in 0..5 {
        let t = Instant::now();
        let mut tx = ctx.pool.begin().await.unwrap();
        store
            .append(&mut *tx, &event("during", i + 1))
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "append {i} blocked on the gate: {:?}",
            t.elapsed()
        );
    }
    let (b, took) = tokio::time::timeout(Duration::from_secs(5), relay)
        .await
        .expect("the relay returns after the wait")
        .unwrap();
    assert!(
        took >= wait - Duration::from_millis(50),
        "returned before the wait: {took:?}"
    );
    assert!(
        took < wait + Duration::from_secs(3),
        "blocked beyond the wait: {took:?}"
    );
    // It may have found the `during` rows on its first claim (before arming); never `long`.
    assert!(!b.records.iter().any(|r| r.envelope.aggregate_id == "long"));
    if !b.is_empty() {
        publish_all(&store, &b).await;
    }
    assert!(!store.wake_gate_armed() || b.is_empty());
    long.commit().await.unwrap();
    // The fallback poll picks everything up.
    let mut seen = Vec::new();
    for _ in 0..10 {
        let b = claim(&store, "r", 100).await;
        if b.is_empty() {
            break;
        }
        seen.extend(b.records.iter().map(|r| r.envelope.aggregate_id.clone()));
        publish_all(&store, &b).await;
    }
    assert!(seen.contains(&"long".to_owned()), "{seen:?}");
    handle.abort();
    ctx.drop().await;
}

/// Two relays (two store instances on the same table) go idle at the same time: one arms, the
/// other gives up after the wait; an append then notifies; neither blocks appends.
#[tokio::test]
async fn two_relays_arming_at_once() {
    let ctx = ctx!(10);
    let wait = Duration::from_secs(1);
    let (a, _na, ha) = listening_store(&ctx, lease(30.0), wait).await;
    let (b, _nb, hb) = listening_store(&ctx, lease(30.0), wait).await;
    let mut raw = raw_listener(&ctx, &a).await;
    let (ra, rb) = tokio::join!(claim(&a, "a", 10), claim(&b, "b", 10));
    assert!(ra.is_empty() && rb.is_empty());
    let armed = [a.wake_gate_armed(), b.wake_gate_armed()];
    assert_eq!(
        armed.iter().filter(|x| **x).count(),
        1,
        "exactly one arms: {armed:?}"
    );
    let t = Instant::now();
    a.append(&ctx.pool, &event("x", 1)).await.unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "the append blocked"
    );
    assert_eq!(
        received_until_marker(&ctx, &a, &mut raw).await,
        ["", "marker"]
    );
    // The unarmed relay claims the row; the armed one stays armed, so appends keep notifying.
    let (armed_store, other) = if armed[0] { (&a, &b) } else { (&b, &a) };
    let got = claim(other, "o", 10).await;
    assert_eq!(got.records.len(), 1);
    publish_all(other, &got).await;
    assert!(armed_store.wake_gate_armed());
    a.append(&ctx.pool, &event("x", 2)).await.unwrap();
    assert_eq!(
        received_until_marker(&ctx, &a, &mut raw).await,
        ["", "marker"]
    );
    ha.abort();
    hb.abort();
    ctx.drop().await;
}

/// The gate's connection is killed (`pg_terminate_backend`) while armed: the lock goes with the
/// session. FOUND by the adversary pass: the store kept `gate_armed` set and its empty claims
/// neither checked nor re-armed, so appends stopped notifying (a lost wake-up until the relay's
/// next poll). Now the next empty claim (the relay is idle) finds the session gone and arms anew.
#[tokio::test]
async fn a_gate_connection_killed_while_armed_is_armed_anew_by_the_next_idle_claim() {
    let ctx = ctx!(8);
    let (store, notify, handle) =
        listening_store(&ctx, lease(30.0), Duration::from_millis(200)).await;
    assert!(claim(&store, "r", 10).await.is_empty());
    assert!(store.wake_gate_armed());
    let locks = advisory(&ctx).await;
    let gate_pid = locks
        .iter()
        .find(|(_, m, g)| m == "ExclusiveLock" && *g)
        .expect("the gate's lock")
        .0;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(gate_pid)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert!(killed);
    while advisory(&ctx).await.iter().any(|(p, _, _)| *p == gate_pid) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The relay goes on being idle: its empty claim is where it would notice.
    assert!(claim(&store, "r", 10).await.is_empty());
    let before = store.notifications_raised();
    store.append(&ctx.pool, &event("lost", 1)).await.unwrap();
    let woke = tokio::time::timeout(Duration::from_secs(2), notify.notified()).await;
    assert!(
        woke.is_ok(),
        "the idle relay is not woken: armed flag = {}, notifies {} -> {}",
        store.wake_gate_armed(),
        before,
        store.notifications_raised()
    );
    handle.abort();
    ctx.drop().await;
}

/// An append that took the shared lock rolls back while the relay is queued: the relay arms,
/// its claim is empty, and the next committed append notifies. An append that notified and
/// rolled back sends nothing.
#[tokio::test]
async fn rolled_back_appends() {
    let ctx = ctx!(8);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(10)).await;
    let mut raw = raw_listener(&ctx, &store).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("rb", 1)).await.unwrap();
    let relay = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "r", 10).await })
    };
    wait_for_waiter(&ctx).await;
    tx.rollback().await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(5), relay)
        .await
        .unwrap()
        .unwrap();
    assert!(b.is_empty());
    assert!(store.wake_gate_armed());
    // Armed: an append that notifies then rolls back delivers nothing.
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("rb2", 1)).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        received_until_marker(&ctx, &store, &mut raw).await,
        ["marker"]
    );
    store.append(&ctx.pool, &event("ok", 1)).await.unwrap();
    assert_eq!(
        received_until_marker(&ctx, &store, &mut raw).await,
        ["", "marker"]
    );
    let b = claim(&store, "r", 10).await;
    assert_eq!(common::versions(&b), [("ok".to_owned(), 1)]);
    publish_all(&store, &b).await;
    handle.abort();
    ctx.drop().await;
}

/// Business transactions at READ COMMITTED and REPEATABLE READ (snapshot taken before the relay
/// arms): an append racing the arm is claimed after it; an append after arming notifies.
#[tokio::test]
async fn appends_under_read_committed_and_repeatable_read() {
    let ctx = ctx!(8);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(10)).await;
    let mut raw = raw_listener(&ctx, &store).await;
    for (i, iso) in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"]
        .iter()
        .enumerate()
    {
        let v = i as i64 + 1;
        // Race: the append is open when the relay arms (drain first).
        let b = claim(&store, "r", 10).await;
        if !b.is_empty() {
            publish_all(&store, &b).await;
        }
        let mut tx = ctx.pool.begin().await.unwrap();
        sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {iso}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        // Disarm first so that the append takes the shared lock.
        store.append(&ctx.pool, &event("disarm", v)).await.unwrap();
        let d = claim(&store, "r", 10).await;
        assert!(!store.wake_gate_armed());
        publish_all(&store, &d).await;
        store.append(&mut *tx, &event("race", v)).await.unwrap();
        let relay = {
            let store = store.clone();
            tokio::spawn(async move { claim(&store, "r", 10).await })
        };
        wait_for_waiter(&ctx).await;
        tx.commit().await.unwrap();
        let b = tokio::time::timeout(Duration::from_secs(5), relay)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(common::versions(&b), [("race".to_owned(), v)], "{iso}");
        publish_all(&store, &b).await;
        // Armed now: an append in a transaction whose snapshot predates the arm notifies.
        let mut tx = ctx.pool.begin().await.unwrap();
        sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {iso}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        let _: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert!(claim(&store, "r", 10).await.is_empty());
        assert!(store.wake_gate_armed(), "{iso}");
        let _ = received_until_marker(&ctx, &store, &mut raw).await;
        store.append(&mut *tx, &event("after", v)).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["", "marker"],
            "{iso}"
        );
        let b = claim(&store, "r", 10).await;
        assert_eq!(common::versions(&b), [("after".to_owned(), v)], "{iso}");
        publish_all(&store, &b).await;
    }
    handle.abort();
    ctx.drop().await;
}

/// Appends inside savepoints: one rolled back to its savepoint while the relay is queued, one
/// released into its transaction. Whatever the lock manager does with the subtransaction's
/// shared lock, the released append's row is claimed by the relay going idle, and an append
/// made after the relay armed notifies.
#[tokio::test]
async fn appends_inside_savepoints() {
    let ctx = ctx!(8);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(10)).await;
    let mut raw = raw_listener(&ctx, &store).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    sqlx::query("SAVEPOINT a").execute(&mut *tx).await.unwrap();
    store.append(&mut *tx, &event("gone", 1)).await.unwrap();
    let relay = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "r", 10).await })
    };
    wait_for_waiter(&ctx).await;
    sqlx::query("ROLLBACK TO SAVEPOINT a")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("SAVEPOINT b").execute(&mut *tx).await.unwrap();
    store.append(&mut *tx, &event("kept", 1)).await.unwrap();
    sqlx::query("RELEASE SAVEPOINT b")
        .execute(&mut *tx)
        .await
        .unwrap();
    let notified_in_tx = store.notifications_raised();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let relay_done_before_commit = relay.is_finished();
    tx.commit().await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(5), relay)
        .await
        .unwrap()
        .unwrap();
    eprintln!(
        "savepoints: relay done before commit={relay_done_before_commit}, \
         notified in tx={notified_in_tx}, claimed={:?}",
        common::versions(&b)
    );
    let mut got = common::versions(&b);
    if got.is_empty() {
        // The relay armed before `kept` was appended, so `kept` notified: it is claimed now.
        assert_eq!(notified_in_tx, 1, "kept neither claimed nor notified");
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["", "marker"]
        );
        let b2 = claim(&store, "r", 10).await;
        got = common::versions(&b2);
        publish_all(&store, &b2).await;
    } else {
        publish_all(&store, &b).await;
    }
    assert_eq!(got, [("kept".to_owned(), 1)]);
    handle.abort();
    ctx.drop().await;
}
