//! Adversarial tests of the wake-up gate's disarm (unlock only when this store holds the gate)
//! with concurrent claims through ONE store instance, and with a claim dropped (cancelled) while
//! it arms: the store's `wake_gate_armed()` must always match what the gate's session holds in
//! `pg_locks`, and the lock must never be held twice (an unlock would then leave it held, and
//! appends would notify for ever while nobody waits).
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::{Duration, Instant};

use common::{claim, event, gate_locks, lease, listening_store, publish_all};

/// The tests of this file count gate locks database-wide: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn exclusive_held(ctx: &common::Ctx) -> usize {
    gate_locks(ctx, true).await
}

async fn waiter_queued(ctx: &common::Ctx) -> bool {
    gate_locks(ctx, false).await > 0
}

/// Waits (at most 5 s) until the gate's lock state in `pg_locks` is `want` held.
async fn settle(ctx: &common::Ctx, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = exclusive_held(ctx).await;
        if n == want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Many claims at once through one store (a relay's prefetch beside its claim, two relays
/// sharing the store), while appends commit in other transactions, for several rounds. After
/// each round, an idle claim arms (the lock held once, flag set), and the next claim that finds
/// work disarms: the lock is then gone from `pg_locks` (never held twice), and no row appended
/// during the round is left unclaimed.
#[tokio::test]
async fn concurrent_claims_through_one_store_keep_the_gate_consistent() {
    let _serial = SERIAL.lock().await;
    let ctx = ctx!(16);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(2)).await;
    let mut published = 0usize;
    for round in 0..15 {
        let appends = {
            let (store, pool) = (store.clone(), ctx.pool.clone());
            tokio::spawn(async move {
                for i in 0..6 {
                    let mut tx = pool.begin().await.unwrap();
                    store
                        .append(&mut *tx, &event(&format!("r{round}-{i}"), 1))
                        .await
                        .unwrap();
                    tx.commit().await.unwrap();
                    tokio::task::yield_now().await;
                }
            })
        };
        let claims: Vec<_> = (0..4)
            .map(|c| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut n = 0;
                    for _ in 0..4 {
                        let b = claim(&store, &format!("c{c}"), 2).await;
                        n += b.records.len();
                        if !b.is_empty() {
                            publish_all(&store, &b).await;
                        }
                    }
                    n
                })
            })
            .collect();
        appends.await.unwrap();
        for c in claims {
            published += c.await.unwrap();
        }
        // Quiesce: drain what is left; the last claim is empty and leaves the gate armed.
        loop {
            let b = claim(&store, "drain", 100).await;
            if b.is_empty() {
                break;
            }
            published += b.records.len();
            publish_all(&store, &b).await;
        }
        assert!(store.wake_gate_armed(), "round {round}: idle, armed");
        assert_eq!(settle(&ctx, 1).await, 1, "round {round}: armed, held");
        // Work appears, a claim finds it and disarms: nothing may stay held.
        store
            .append(&ctx.pool, &event(&format!("w{round}"), 1))
            .await
            .unwrap();
        let b = claim(&store, "w", 10).await;
        assert_eq!(b.records.len(), 1, "round {round}");
        published += 1;
        publish_all(&store, &b).await;
        assert!(!store.wake_gate_armed(), "round {round}: disarmed");
        assert_eq!(
            settle(&ctx, 0).await,
            0,
            "round {round}: disarmed but the gate's session still holds the lock \
             (locked twice, unlocked once)"
        );
    }
    assert_eq!(published, 15 * 7, "every row claimed once");
    handle.abort();
    ctx.drop().await;
}

/// A claim dropped (a caller's timeout, a `select!`) while its arm waits behind an open append:
/// once the append ends the server grants the lock to the gate's session anyway. The store must
/// not keep a session that holds the lock while it believes the gate unarmed: the next arm would
/// take it a second time, the disarm would release it once, and appends would notify for ever
/// (and another relay process could never arm).
#[tokio::test]
async fn a_claim_cancelled_while_arming_leaves_no_lock_behind() {
    let _serial = SERIAL.lock().await;
    let ctx = ctx!(10);
    let (store, _n, handle) = listening_store(&ctx, lease(30.0), Duration::from_secs(5)).await;
    let mut long = ctx.pool.begin().await.unwrap();
    store.append(&mut *long, &event("long", 1)).await.unwrap();
    let cancelled = {
        let store = store.clone();
        tokio::spawn(async move {
            tokio::time::timeout(Duration::from_millis(500), claim(&store, "r", 10)).await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !waiter_queued(&ctx).await {
        assert!(Instant::now() < deadline, "the arm never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        cancelled.await.unwrap().is_err(),
        "the claim was dropped while arming"
    );
    long.commit().await.unwrap();
    assert!(!store.wake_gate_armed());
    // The relay's next cycles: work found (no disarm: not armed), then idle (armed), then work
    // again (disarmed). Afterwards nothing may be held.
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    publish_all(&store, &b).await;
    assert!(claim(&store, "r", 10).await.is_empty());
    assert!(store.wake_gate_armed());
    store.append(&ctx.pool, &event("next", 1)).await.unwrap();
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    publish_all(&store, &b).await;
    assert!(!store.wake_gate_armed());
    // FOUND: a claim cancelled inside arm() left the lock granted to the gate session with the
    // flag unset; the next arm stacked it, the disarm unlocked once, the lock stayed held.
    assert_eq!(
        settle(&ctx, 0).await,
        0,
        "unarmed, yet the gate's session holds the lock"
    );
    let before = store.notifications_raised();
    store.append(&ctx.pool, &event("quiet", 1)).await.unwrap();
    assert_eq!(
        store.notifications_raised(),
        before,
        "a busy relay (unarmed gate): appends do not notify"
    );
    handle.abort();
    ctx.drop().await;
}
