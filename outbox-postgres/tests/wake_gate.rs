//! The wake-up gate: appends raise a `NOTIFY` only while a relay is idle and waiting for one,
//! and no wake-up is lost when an append and a relay going idle overlap.
//!
//! Each test uses its own schema. Needs PostgreSQL at `DATABASE_URL`; see `common`.

mod common;

use std::time::Duration;

use outbox_core::ClaimMode;
use outbox_postgres::PostgresOutboxStore;

use common::{
    claim, event, lease, listening_store, publish_all, raw_listener, received_until_marker,
};

#[tokio::test]
async fn an_idle_relay_is_woken_and_a_busy_one_is_not_notified() {
    let ctx = ctx!(6);
    for mode in [lease(30.0), ClaimMode::LockedTransaction] {
        let (store, notify, handle) = listening_store(&ctx, mode, Duration::from_secs(5)).await;
        let mut raw = raw_listener(&ctx, &store).await;

        // Idle: the empty claim arms the gate; the append's commit notifies and wakes the relay.
        assert!(claim(&store, "r", 10).await.is_empty());
        assert!(store.wake_gate_armed(), "an empty claim arms the gate");
        let before = store.notifications_raised();
        store.append(&ctx.pool, &event("idle", 1)).await.unwrap();
        tokio::time::timeout(Duration::from_secs(2), notify.notified())
            .await
            .expect("the idle relay is woken by the append's commit");
        assert_eq!(store.notifications_raised(), before + 1);
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["", "marker"]
        );

        // Busy: a claim that finds work disarms; appends from now on do not notify.
        let b = claim(&store, "r", 10).await;
        assert_eq!(b.records.len(), 1);
        assert!(!store.wake_gate_armed(), "a claim that finds work disarms");
        store.append(&ctx.pool, &event("busy", 1)).await.unwrap();
        store.append(&ctx.pool, &event("busy", 2)).await.unwrap();
        assert_eq!(store.notifications_raised(), before + 1);
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["marker"]
        );
        publish_all(&store, &b).await;

        // Drain, go idle again: armed again, and the next append notifies again.
        let b = claim(&store, "r", 10).await;
        assert_eq!(b.records.len(), 1, "busy v1");
        publish_all(&store, &b).await;
        let b = claim(&store, "r", 10).await;
        assert_eq!(b.records.len(), 1, "busy v2");
        publish_all(&store, &b).await;
        assert!(claim(&store, "r", 10).await.is_empty());
        assert!(store.wake_gate_armed());
        store.append(&ctx.pool, &event("again", 1)).await.unwrap();
        assert_eq!(
            received_until_marker(&ctx, &store, &mut raw).await,
            ["", "marker"]
        );
        let b = claim(&store, "r", 10).await;
        publish_all(&store, &b).await;
        handle.abort();
        sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
    }
    ctx.drop().await;
}

/// The race the gate must win: an append that saw no idle relay (so it will not notify) is
/// still open when the relay's claim comes back empty. Arming waits for that transaction, and
/// the claim after arming returns its row: nothing waits for a wake-up that never comes.
#[tokio::test]
async fn an_append_that_did_not_notify_is_claimed_by_the_relay_going_idle() {
    let ctx = ctx!(6);
    let (store, _notify, handle) =
        listening_store(&ctx, lease(30.0), Duration::from_secs(30)).await;
    let mut raw = raw_listener(&ctx, &store).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("race", 1)).await.unwrap();
    assert_eq!(store.notifications_raised(), 0, "no relay waits yet");
    let relay = {
        let store = store.clone();
        tokio::spawn(async move { claim(&store, "r", 10).await })
    };
    // Wait until the relay's arm is queued behind the open append (the lock is not granted).
    // Only this test's gate counts: tests running beside it wait on gates of their own.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if common::gate_locks(&ctx, false).await > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the arm never queued"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !relay.is_finished(),
        "the claim waits for the append in flight"
    );
    // An append while the relay is queued notifies (it cannot take the shared lock).
    store.append(&ctx.pool, &event("queued", 1)).await.unwrap();
    assert_eq!(store.notifications_raised(), 1);
    tx.commit().await.unwrap();
    let b = tokio::time::timeout(Duration::from_secs(10), relay)
        .await
        .expect("the claim ends once the append committed")
        .unwrap();
    let mut got: Vec<_> = b
        .records
        .iter()
        .map(|r| r.envelope.aggregate_id.clone())
        .collect();
    got.sort();
    assert!(
        got.contains(&"race".to_owned()),
        "the open append's row is claimed: {got:?}"
    );
    assert!(!store.wake_gate_armed(), "it found work, so it disarmed");
    publish_all(&store, &b).await;
    assert_eq!(
        received_until_marker(&ctx, &store, &mut raw).await,
        ["", "marker"],
        "exactly the append made while the relay was queued notified"
    );
    handle.abort();
    ctx.drop().await;
}

/// When the appends in flight outlast the wait, the relay does not stay blocked: its claim
/// returns (empty, unarmed) after the wait, and appends meanwhile notify.
#[tokio::test]
async fn a_long_append_does_not_block_the_relay_beyond_the_wait() {
    let ctx = ctx!(6);
    let (store, _notify, handle) =
        listening_store(&ctx, lease(30.0), Duration::from_millis(100)).await;
    let mut tx = ctx.pool.begin().await.unwrap();
    store.append(&mut *tx, &event("long", 1)).await.unwrap();
    let started = std::time::Instant::now();
    assert!(claim(&store, "r", 10).await.is_empty());
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(!store.wake_gate_armed(), "the arm gave up");
    tx.commit().await.unwrap();
    // The next idle claim finds the row (the relay polls).
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    publish_all(&store, &b).await;
    assert!(claim(&store, "r", 10).await.is_empty());
    assert!(store.wake_gate_armed(), "nothing in flight: armed");
    handle.abort();
    ctx.drop().await;
}

/// With the gate off every append notifies; a store without a listener never arms.
#[tokio::test]
async fn gate_off_notifies_every_append_and_no_listener_never_arms() {
    let ctx = ctx!(6);
    let ungated = PostgresOutboxStore::builder(ctx.pool.clone())
        .schema(&ctx.schema)
        .wake_gate(false)
        .build()
        .unwrap();
    ungated.migrate().await.unwrap();
    let mut raw = raw_listener(&ctx, &ungated).await;
    ungated.append(&ctx.pool, &event("a", 1)).await.unwrap();
    ungated.append(&ctx.pool, &event("a", 2)).await.unwrap();
    assert_eq!(ungated.notifications_raised(), 2);
    assert_eq!(
        received_until_marker(&ctx, &ungated, &mut raw).await,
        ["", "", "marker"]
    );
    let quiet = ctx.store(lease(30.0)).await;
    // Drain both versions; the claim that comes back empty would arm a listening store.
    for _ in 0..2 {
        let b = claim(&quiet, "r", 10).await;
        assert_eq!(b.records.len(), 1);
        publish_all(&quiet, &b).await;
    }
    assert!(claim(&quiet, "r", 10).await.is_empty());
    assert!(
        !quiet.wake_gate_armed(),
        "no listener: nothing waits for a NOTIFY"
    );
    quiet.append(&ctx.pool, &event("b", 1)).await.unwrap();
    assert_eq!(quiet.notifications_raised(), 0);
    assert_eq!(
        received_until_marker(&ctx, &quiet, &mut raw).await,
        ["marker"]
    );
    assert!(PostgresOutboxStore::builder(ctx.pool.clone())
        .wake_gate_wait(Duration::ZERO)
        .build()
        .is_err());
    ctx.drop().await;
}
