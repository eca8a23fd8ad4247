//! The wake-up gate and LISTEN behind a connection pooler: PgBouncer, started by each test on a
//! port of its own in front of `DATABASE_URL` (`scripts/services.sh` installs it).
//!
//! In transaction mode a client connection's consecutive transactions may run on different
//! server sessions, and the gate's session advisory lock could be taken on one and left there
//! (see the crate docs): the gate must find this out before it takes the lock, turn itself off
//! and leave the relay polling. In session mode every client connection keeps its server
//! session and the gate works as on a direct connection. The checks after the lock was taken
//! (an arm, an unlock or an idle check run on another session) are tested in the crate
//! (`src/outbox/wake_gate_tests.rs`).
//!
//! Each test uses its own schema and PgBouncer. Needs PostgreSQL at `DATABASE_URL` and
//! PgBouncer; see `common` and `outbox_test_support::pgbouncer_bin`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use outbox_postgres::PostgresOutboxStore;
use outbox_test_support::PgBouncer;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Notify;

use common::{claim, event, gate_locks, lease, publish_all};

/// PgBouncer in `mode` in front of this test's server, and a listening store on this test's
/// schema whose pool goes through it (the schema is migrated over a direct connection first).
async fn store_behind(
    ctx: &common::Ctx,
    test: &str,
    mode: &str,
    server_sessions: u32,
) -> Option<(
    PgBouncer,
    PostgresOutboxStore,
    Arc<Notify>,
    tokio::task::JoinHandle<()>,
)> {
    let bin = outbox_test_support::pgbouncer_bin(test)?;
    let direct = outbox_test_support::database_url(test)?;
    let bouncer = PgBouncer::start(&bin, &direct, mode, server_sessions);
    ctx.store(lease(30.0)).await;
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&bouncer.url())
        .await
        .unwrap_or_else(|e| panic!("PgBouncer at {}: {e}\n{}", bouncer.url(), bouncer.log()));
    let store = PostgresOutboxStore::builder(pool)
        .schema(&ctx.schema)
        .claim_mode(lease(30.0))
        .wake_gate_wait(Duration::from_secs(1))
        .build()
        .unwrap();
    let notify = Arc::new(Notify::new());
    let handle = store.spawn_listener(notify.clone()).unwrap();
    // The listener wakes once it has connected and LISTENs: from then on nothing else runs
    // through the pooler while the gate opens its connection.
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("the listener connected through the pooler");
    Some((bouncer, store, notify, handle))
}

/// The idle claim through PgBouncer in transaction mode would arm the gate: it finds out that
/// two connections of its pool share a server session, takes no lock, turns the gate off with
/// the reason, and the relay is left polling.
///
/// Behind a pooler that carries prepared statements (PgBouncer 1.21 and later), the gate
/// armed before the fix: its session advisory lock stayed on a server session PgBouncer hands
/// to every other client (whose appends then take the shared lock beside it and never
/// notify), and its release ran wherever the next transaction landed. Behind PgBouncer 1.18
/// (Debian 12's, used here) the old gate failed earlier, on its own named prepared statement
/// (`42P05`, "already exists"), so this test does not fail without the fix; the hang it caused
/// is reproduced in the crate (`an_arm_never_waits_past_wake_gate_wait_whatever_session_serves_it`).
///
/// The test stops there: behind PgBouncer 1.18 in transaction mode sqlx's named prepared
/// statements collide (two client connections both prepare `sqlx_s_1` on one server session),
/// so further claims through it fail whatever the gate does; the crate docs say so.
#[tokio::test]
async fn behind_a_transaction_pooler_the_gate_turns_itself_off_and_the_relay_polls() {
    let ctx = ctx!(4);
    let test = "gate_behind_transaction_pooler";
    let Some((bouncer, store, _notify, handle)) = store_behind(&ctx, test, "transaction", 2).await
    else {
        return;
    };
    assert!(claim(&store, "r", 10).await.is_empty());
    assert_eq!(
        gate_locks(&ctx, true).await,
        0,
        "the gate's lock is held by a pooled server session"
    );
    assert!(!store.wake_gate_armed());
    let why = store
        .wake_gate_disabled()
        .unwrap_or_else(|| panic!("the gate is still on\n{}", bouncer.log()));
    assert!(why.contains("ran on one server session"), "{why}");
    handle.abort();
    ctx.drop().await;
}

/// PgBouncer in session mode keeps each client connection on its own server session: the gate
/// arms, an append through the pooler notifies and wakes the relay, and the next claim
/// disarms (no false alarm).
#[tokio::test]
async fn behind_a_session_pooler_the_gate_works_as_on_a_direct_connection() {
    let ctx = ctx!(4);
    let test = "gate_behind_session_pooler";
    let Some((_bouncer, store, notify, handle)) = store_behind(&ctx, test, "session", 8).await
    else {
        return;
    };
    assert!(claim(&store, "r", 10).await.is_empty());
    assert_eq!(store.wake_gate_disabled(), None);
    assert!(store.wake_gate_armed());
    assert_eq!(gate_locks(&ctx, true).await, 1);
    let before = store.notifications_raised();
    store
        .append(store.pool(), &event("through-the-pooler", 1))
        .await
        .unwrap();
    assert_eq!(store.notifications_raised(), before + 1);
    tokio::time::timeout(Duration::from_secs(5), notify.notified())
        .await
        .expect("the append's NOTIFY reached the listener through the pooler");
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records.len(), 1);
    assert!(!store.wake_gate_armed());
    assert_eq!(gate_locks(&ctx, true).await, 0);
    publish_all(&store, &b).await;
    handle.abort();
    ctx.drop().await;
}
