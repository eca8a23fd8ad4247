//! A store operation cancelled while its transaction begins (a relay task aborted, a consumer
//! shut down, a timeout around a call) must not hand its connection back to the pool with the
//! transaction open: the next user of that pooled connection would fail to begin
//! ("Transaction characteristics can't be changed while a transaction is in progress", 1568)
//! or, with a plain statement, write inside a transaction that never commits. Each test has
//! its own database on the server at `MYSQL_URL`, and a pool of one connection, so the next
//! operation gets the connection the cancelled one used.

mod common;

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use outbox_core::InboxStore;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::MySqlPool;

/// A pool of one connection, handed out without a ping (so a begin's first wait is its own
/// statement's answer).
async fn one_connection() -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&outbox_test_support::mysql_url("outbox-mysql tests").unwrap())
        .await
        .unwrap()
}

/// Waits until the pool's connection is back and idle (a connection goes back to the pool in
/// a task of its own), so that the next operation's first poll gets it at once.
async fn idle(pool: &MySqlPool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while pool.num_idle() < 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the connection never came back"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Polls `f` once (with the connection idle, it sends its first statement, its transaction's
/// begin, and waits for the answer), then drops it.
fn cancel_after_first_poll<F: Future>(f: F) {
    assert!(
        f.now_or_never().is_none(),
        "the operation finished in one poll: nothing was cancelled"
    );
}

/// Whether the pool's connection is in a transaction (MariaDB's `@@in_transaction`).
async fn in_transaction(pool: &MySqlPool) -> i64 {
    sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The inbox's `begin`, cancelled after its statement was sent: the next `begin` on the pooled
/// connection works, and no transaction is left open on it.
#[tokio::test]
async fn an_inbox_begin_cancelled_leaves_no_open_transaction_on_the_pool() {
    let ctx = ctx!(2);
    ctx.inbox().await;
    let pool = one_connection().await;
    let inbox = outbox_mysql::MySqlInboxStore::builder(pool.clone())
        .database(&ctx.database)
        .build()
        .unwrap();
    for round in 0..3 {
        idle(&pool).await;
        cancel_after_first_poll(inbox.begin());
        // What the pool hands out next: the connection of the cancelled begin.
        let tx = inbox
            .begin()
            .await
            .unwrap_or_else(|e| panic!("round {round}: the next begin on the pool: {e}"));
        inbox.rollback(tx).await.unwrap();
        assert_eq!(in_transaction(&pool).await, 0, "round {round}");
    }
    pool.close().await;
    ctx.drop().await;
}

/// The outbox's operations begin their transactions the same way: a claim cancelled while its
/// first transaction begins (in both modes the claim's decision is a short transaction) leaves
/// the pooled connection usable, with no transaction open and the server's `wait_timeout`.
#[tokio::test]
async fn an_outbox_claim_cancelled_while_it_begins_leaves_the_pool_clean() {
    use outbox_core::{ClaimMode, ClaimRequest, RelayStore};
    let ctx = ctx!(2);
    let pool = one_connection().await;
    let default_wait: u64 = sqlx::query_scalar("SELECT @@GLOBAL.wait_timeout")
        .fetch_one(&pool)
        .await
        .unwrap();
    for mode in [common::lease(30.0), ClaimMode::LockedTransaction] {
        let store = outbox_mysql::MySqlOutboxStore::builder(pool.clone())
            .database(&ctx.database)
            .claim_mode(mode)
            .build()
            .unwrap();
        store.migrate().await.unwrap();
        for round in 0..3 {
            let request = ClaimRequest::new("relay", 10);
            idle(&pool).await;
            cancel_after_first_poll(store.claim(&request));
            let claim = store
                .claim(&request)
                .await
                .unwrap_or_else(|e| panic!("{mode:?} round {round}: the next claim: {e}"));
            store.complete(&claim.handle, &[]).await.unwrap();
            assert_eq!(in_transaction(&pool).await, 0, "{mode:?} round {round}");
            let wait: u64 = sqlx::query_scalar("SELECT @@SESSION.wait_timeout")
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(wait, default_wait, "{mode:?} round {round}");
        }
    }
    pool.close().await;
    ctx.drop().await;
}
