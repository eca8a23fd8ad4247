//! The outbox-testkit conformance suites (outbox, inbox with its parking and operator
//! clauses) against MySQL/MariaDB: each test gets its own database.
//!
//! Needs a server at `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`). Unreachable:
//! the tests fail with a clear message, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::time::Duration;

use outbox_core::{
    async_trait, ClaimHandle, ClaimMode, InboxStore, LogPosition, NativeColumns, NewParkedMessage,
    ParkAs, ParkKind, ParkedRecord, Parking, StoreError,
};
use outbox_mysql::{MySqlInboxStore, MySqlOutboxStore};
use outbox_testkit::conformance::{Capabilities, InboxHarness, OutboxHarness};
use sqlx::mysql::{MySqlRow, MySqlTransactionManager};
use sqlx::{Connection, MySqlConnection, MySqlPool, Row, TransactionManager};

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
    pool: MySqlPool,
    database: String,
}

impl MyInboxHarness {
    async fn new() -> Self {
        let h = MyHarness::new().await;
        let store = MySqlInboxStore::builder(h.pool.clone())
            .database(&h.database)
            .build()
            .expect("inbox");
        store.migrate().await.expect("migrate");
        Self {
            store,
            pool: h.pool,
            database: h.database,
        }
    }

    /// `` `database`.`name` ``.
    fn table(&self, name: &str) -> String {
        format!("`{}`.`{name}`", self.database)
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

    async fn native_columns(&self, consumer: &str) -> Option<Vec<NativeColumns>> {
        let rows = sqlx::query(&format!(
            "SELECT native_transport, native_sequence, native_consumer, native_exchange, \
                    native_routing_key, native_redelivered \
             FROM {} WHERE consumer = ? ORDER BY id",
            self.table("processed_events_parked")
        ))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .unwrap();
        let text = |r: &MySqlRow, i: usize| {
            r.get::<Option<Vec<u8>>, _>(i)
                .map(|b| String::from_utf8(b).unwrap())
        };
        Some(
            rows.iter()
                .map(|r| {
                    NativeColumns::new(
                        text(r, 0),
                        r.get(1),
                        text(r, 2),
                        text(r, 3),
                        text(r, 4),
                        r.get(5),
                    )
                })
                .collect(),
        )
    }

    async fn write_native_columns(&self, consumer: &str, c: &NativeColumns) -> bool {
        sqlx::query(&format!(
            "UPDATE {} SET native_transport = ?, native_sequence = ?, native_consumer = ?, \
               native_exchange = ?, native_routing_key = ?, native_redelivered = ? \
             WHERE consumer = ?",
            self.table("processed_events_parked")
        ))
        .bind(&c.transport)
        .bind(c.sequence)
        .bind(&c.consumer)
        .bind(&c.exchange)
        .bind(&c.routing_key)
        .bind(c.redelivered)
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
        true
    }

    /// The message parked by this version, then the parked table turned back into its
    /// migration-3 shape (the native columns gone, the migration log at version 3): the row
    /// is what a consumer of version 3 wrote.
    async fn before_native_columns(
        &self,
        consumer: &str,
        position: &LogPosition,
        reason: &str,
    ) -> bool {
        let mut tx = self.store.begin().await.unwrap();
        let parked = self
            .store
            .park(
                &mut tx,
                consumer,
                &[NewParkedMessage::new(
                    ParkedRecord::new(position.clone(), None, vec![], Some(vec![0xff])),
                    ParkAs::Head(ParkKind::Unprocessable),
                    reason,
                    1,
                )],
            )
            .await
            .unwrap();
        self.store.commit(tx).await.unwrap();
        assert!(matches!(parked[..], [Parking::Head(_)]), "{parked:?}");
        sqlx::query(&format!(
            "ALTER TABLE {} DROP COLUMN native_transport, DROP COLUMN native_sequence, \
               DROP COLUMN native_consumer, DROP COLUMN native_exchange, \
               DROP COLUMN native_routing_key, DROP COLUMN native_redelivered",
            self.table("processed_events_parked")
        ))
        .execute(&self.pool)
        .await
        .unwrap();
        sqlx::query(&format!(
            "DELETE FROM {} WHERE object = 'inbox:processed_events' AND version >= 4",
            self.table("outbox_schema_migrations")
        ))
        .execute(&self.pool)
        .await
        .unwrap();
        true
    }

    async fn migrate(&self) -> Option<usize> {
        Some(self.store.migrate().await.expect("migrate"))
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
