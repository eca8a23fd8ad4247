//! The outbox-testkit conformance suites (outbox, inbox with its parking and operator
//! clauses) against MySQL/MariaDB: each test gets its own database.
//!
//! Needs a server at `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). Unreachable:
//! the tests fail with a clear message, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::time::Duration;

use outbox_core::{async_trait, ClaimHandle, ClaimMode, StoreError};
use outbox_mysql::{MySqlInboxStore, MySqlOutboxStore};
use outbox_testkit::conformance::{Capabilities, InboxHarness, OutboxHarness};
use sqlx::mysql::MySqlTransactionManager;
use sqlx::{Connection, MySqlConnection, MySqlPool, TransactionManager};

mod common;

struct MyHarness {
    pool: MySqlPool,
    database: String,
}

impl MyHarness {
    async fn new() -> Self {
        let Some(pool) = common::pool(8).await else {
            // Explicit skip requested and no server: nothing of this binary can run.
            std::process::exit(0);
        };
        common::drop_stale_databases(&pool).await;
        Self {
            pool,
            database: common::database_name(),
        }
    }
}

fn capabilities() -> Capabilities {
    Capabilities::real_time()
        .with_lease_duration(Duration::from_millis(1500))
        .with_time_step(Duration::from_millis(300))
        .with_accept_first_version(true)
}

impl MyHarness {
    async fn build(&self, mode: ClaimMode, accept_first_version: bool) -> MySqlOutboxStore {
        let store = MySqlOutboxStore::builder(self.pool.clone())
            .database(&self.database)
            .claim_mode(mode)
            .gap_timeout(capabilities().gap_timeout)
            .accept_first_version(accept_first_version)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        store
    }
}

#[async_trait]
impl OutboxHarness for MyHarness {
    type Store = MySqlOutboxStore;

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    async fn store(&self, mode: ClaimMode) -> MySqlOutboxStore {
        self.build(mode, false).await
    }

    async fn store_accepting_first_version(&self, mode: ClaimMode) -> MySqlOutboxStore {
        self.build(mode, true).await
    }

    async fn begin(&self) -> MySqlConnection {
        let mut conn = self.pool.acquire().await.expect("connection").detach();
        // Through sqlx's transaction manager, so the store's own savepoints nest in it.
        MySqlTransactionManager::begin(&mut conn, None)
            .await
            .expect("begin");
        conn
    }

    async fn commit(&self, mut tx: MySqlConnection) -> Result<(), StoreError> {
        let r = MySqlTransactionManager::commit(&mut tx)
            .await
            .map_err(outbox_mysql::map_sqlx_error);
        let _ = tx.close().await;
        r
    }

    async fn rollback(&self, mut tx: MySqlConnection) {
        let _ = MySqlTransactionManager::rollback(&mut tx).await;
        let _ = tx.close().await;
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    async fn abandon(&self, store: &MySqlOutboxStore, claim: &ClaimHandle) -> bool {
        store.abandon_locked_claim(claim).await
    }
}

struct MyInboxHarness {
    store: MySqlInboxStore,
}

impl MyInboxHarness {
    async fn new() -> Self {
        let h = MyHarness::new().await;
        let store = MySqlInboxStore::builder(h.pool.clone())
            .database(&h.database)
            .build()
            .expect("inbox");
        store.migrate().await.expect("migrate");
        Self { store }
    }
}

#[async_trait]
impl InboxHarness for MyInboxHarness {
    type Store = MySqlInboxStore;

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    fn store(&self) -> &MySqlInboxStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
}

mod outbox {
    outbox_testkit::outbox_conformance_tests!(async { super::MyHarness::new().await });
}

mod inbox {
    outbox_testkit::inbox_conformance_tests!(async { super::MyInboxHarness::new().await });
}

/// The reporting view (`outbox status`, `replay`, `reconcile`) against the same server.
mod reporting {
    outbox_testkit::reporting_conformance_tests!(async { super::MyHarness::new().await });
}

/// The relay registry (`outbox status`, `outbox parked release-claims`) against the same server.
mod registry {
    outbox_testkit::registry_conformance_tests!(async { super::MyHarness::new().await });
}
