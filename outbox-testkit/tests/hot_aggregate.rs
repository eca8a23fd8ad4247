//! One hot aggregate beside the others (issue 25) on the in-memory store, in both claim modes:
//! the bodies of `outbox_testkit::scenarios::hot_aggregate`, which the PostgreSQL and MySQL
//! tests run too.

use std::time::Duration;

use outbox_core::ClaimMode;
use outbox_testkit::scenarios::hot_aggregate::{
    event_after_a_hot_backlog_is_claimed_at_once,
    event_appended_while_a_hot_aggregate_drains_is_claimed_next, HOT_VERSIONS,
};
use outbox_testkit::{MemoryDb, MemoryOutboxStore};

fn modes() -> [ClaimMode; 2] {
    [
        ClaimMode::lease(Duration::from_secs(30)).expect("lease"),
        ClaimMode::LockedTransaction,
    ]
}

#[tokio::test]
async fn event_after_a_hot_backlog_is_claimed_at_once_in_memory() {
    for mode in modes() {
        let store = MemoryOutboxStore::new(&MemoryDb::default(), mode);
        event_after_a_hot_backlog_is_claimed_at_once(&store, &store, HOT_VERSIONS).await;
    }
}

#[tokio::test]
async fn event_appended_while_a_hot_aggregate_drains_is_claimed_next_in_memory() {
    for mode in modes() {
        let store = MemoryOutboxStore::new(&MemoryDb::default(), mode);
        event_appended_while_a_hot_aggregate_drains_is_claimed_next(&store, &store, HOT_VERSIONS)
            .await;
    }
}
