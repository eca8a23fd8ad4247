//! The outbox-testkit conformance suite against PostgreSQL: each test gets its own schema.
//!
//! Needs a server at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
//! Unreachable: the tests fail with a clear message, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::time::Duration;

use outbox_core::{async_trait, ClaimHandle, ClaimMode, StoreError};
use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
use outbox_testkit::conformance::{Capabilities, InboxHarness, OutboxHarness};
use sqlx::{Connection, PgConnection, PgPool};

mod common;

struct PgHarness {
    pool: PgPool,
    schema: String,
}

impl PgHarness {
    async fn new() -> Self {
        let Some(pool) = common::pool(8).await else {
            // Explicit skip requested and no server: nothing of this binary can run.
            // `common::pool` printed the skip past the output capture.
            std::process::exit(0);
        };
        common::drop_stale_schemas(&pool).await;
        Self {
            pool,
            schema: common::schema_name(),
        }
    }
}

impl PgHarness {
    async fn build(&self, mode: ClaimMode, accept_first_version: bool) -> PostgresOutboxStore {
        let store = PostgresOutboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .claim_mode(mode)
            .gap_timeout(capabilities().gap_timeout)
            .accept_first_version(accept_first_version)
            .build()
            .expect("store");
        store.migrate().await.expect("migrate");
        store
    }
}

fn capabilities() -> Capabilities {
    Capabilities::real_time()
        .with_lease_duration(Duration::from_millis(1500))
        .with_time_step(Duration::from_millis(300))
        .with_accept_first_version(true)
}

#[async_trait]
impl OutboxHarness for PgHarness {
    type Store = PostgresOutboxStore;

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    async fn store(&self, mode: ClaimMode) -> PostgresOutboxStore {
        self.build(mode, false).await
    }

    async fn store_accepting_first_version(&self, mode: ClaimMode) -> PostgresOutboxStore {
        self.build(mode, true).await
    }

    async fn begin(&self) -> PgConnection {
        let mut conn = self.pool.acquire().await.expect("connection").detach();
        sqlx::query("BEGIN")
            .execute(&mut conn)
            .await
            .expect("begin");
        conn
    }

    async fn commit(&self, mut tx: PgConnection) -> Result<(), StoreError> {
        let r = sqlx::query("COMMIT")
            .execute(&mut tx)
            .await
            .map(|_| ())
            .map_err(outbox_postgres::map_sqlx_error);
        let _ = tx.close().await;
        r
    }

    async fn rollback(&self, mut tx: PgConnection) {
        let _ = sqlx::query("ROLLBACK").execute(&mut tx).await;
        let _ = tx.close().await;
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }

    async fn abandon(&self, store: &PostgresOutboxStore, claim: &ClaimHandle) -> bool {
        store.abandon_locked_claim(claim).await
    }
}

struct PgInboxHarness {
    store: PostgresInboxStore,
}

impl PgInboxHarness {
    async fn new() -> Self {
        let h = PgHarness::new().await;
        let store = PostgresInboxStore::builder(h.pool.clone())
            .schema(&h.schema)
            .build()
            .expect("inbox");
        store.migrate().await.expect("migrate");
        Self { store }
    }
}

#[async_trait]
impl InboxHarness for PgInboxHarness {
    type Store = PostgresInboxStore;

    fn capabilities(&self) -> Capabilities {
        capabilities()
    }

    fn store(&self) -> &PostgresInboxStore {
        &self.store
    }

    async fn advance(&self, by: Duration) {
        tokio::time::sleep(by).await;
    }
}

mod outbox {
    outbox_testkit::outbox_conformance_tests!(async { super::PgHarness::new().await });
}

mod inbox {
    outbox_testkit::inbox_conformance_tests!(async { super::PgInboxHarness::new().await });
}

/// The reporting view (`outbox status`, `replay`, `reconcile`) against the same server.
mod reporting {
    outbox_testkit::reporting_conformance_tests!(async { super::PgHarness::new().await });
}

/// The relay registry (`outbox status`, `outbox parked release-claims`) against the same server.
mod registry {
    outbox_testkit::registry_conformance_tests!(async { super::PgHarness::new().await });
}
