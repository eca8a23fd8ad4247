//! The outbox-testkit conformance suite against PostgreSQL: each test gets its own schema.
//!
//! Needs a server at `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`).
//! Unreachable: the tests fail with a clear message, unless `OUTBOX_SKIP_SERVICE_TESTS=1`.

use std::time::Duration;

use outbox_core::{async_trait, ClaimHandle, ClaimMode, LogPosition, NativeColumns, StoreError};
use outbox_postgres::{PostgresInboxStore, PostgresOutboxStore};
use outbox_testkit::conformance::{Capabilities, InboxHarness, OutboxHarness};
use sqlx::{Connection, PgConnection, PgPool, Row};

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
        .with_runs(true)
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
    pool: PgPool,
    schema: String,
}

/// The inbox migrations before the native-position columns (migration 5).
const INBOX_V1_TO_V4: [&str; 4] = [
    include_str!("../src/migrations/0001_inbox.sql"),
    include_str!("../src/migrations/0002_inbox.sql"),
    concat!(
        include_str!("../src/migrations/0003_inbox.sql"),
        include_str!("../src/migrations/0003_inbox_index.sql")
    ),
    include_str!("../src/migrations/0004_inbox.sql"),
];

impl PgInboxHarness {
    async fn new() -> Self {
        let h = PgHarness::new().await;
        let store = PostgresInboxStore::builder(h.pool.clone())
            .schema(&h.schema)
            .build()
            .expect("inbox");
        store.migrate().await.expect("migrate");
        Self {
            store,
            pool: h.pool,
            schema: h.schema,
        }
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

    async fn native_columns(&self, consumer: &str) -> Option<Vec<NativeColumns>> {
        let rows = sqlx::query(&format!(
            "SELECT native_transport, native_sequence, native_consumer, native_exchange, \
                    native_routing_key, native_redelivered \
             FROM \"{}\".processed_events_parked WHERE consumer = $1 ORDER BY id",
            self.schema
        ))
        .bind(consumer)
        .fetch_all(&self.pool)
        .await
        .unwrap();
        Some(
            rows.iter()
                .map(|r| {
                    NativeColumns::new(r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))
                })
                .collect(),
        )
    }

    async fn write_native_columns(&self, consumer: &str, c: &NativeColumns) -> bool {
        sqlx::query(&format!(
            "UPDATE \"{}\".processed_events_parked SET native_transport = $2, \
               native_sequence = $3, native_consumer = $4, native_exchange = $5, \
               native_routing_key = $6, native_redelivered = $7 WHERE consumer = $1",
            self.schema
        ))
        .bind(consumer)
        .bind(&c.transport)
        .bind(c.sequence)
        .bind(&c.consumer)
        .bind(&c.exchange)
        .bind(&c.routing_key)
        .bind(c.redelivered)
        .execute(&self.pool)
        .await
        .unwrap();
        true
    }

    /// The inbox's tables dropped and made again by migrations 1 to 4, the migration log
    /// saying so, and the message inserted as a consumer of version 4 parked it.
    async fn before_native_columns(
        &self,
        consumer: &str,
        position: &LogPosition,
        reason: &str,
    ) -> bool {
        let schema = &self.schema;
        let v4: String = INBOX_V1_TO_V4
            .iter()
            .map(|m| {
                m.replace("__SCHEMA__", schema)
                    .replace("__TABLE__", "processed_events")
            })
            .collect();
        sqlx::raw_sql(&format!(
            "DROP TABLE \"{schema}\".processed_events, \"{schema}\".processed_events_aggregates, \
               \"{schema}\".processed_events_parked, \"{schema}\".processed_events_audit CASCADE; \
             DELETE FROM \"{schema}\".outbox_schema_migrations \
               WHERE object = 'inbox:processed_events'; \
             {v4}; \
             INSERT INTO \"{schema}\".outbox_schema_migrations (object, version, description) \
               VALUES ('inbox:processed_events', 1, 'v1'), ('inbox:processed_events', 2, 'v2'), \
               ('inbox:processed_events', 3, 'v3'), ('inbox:processed_events', 4, 'v4');"
        ))
        .execute(&self.pool)
        .await
        .unwrap();
        sqlx::query(&format!(
            "INSERT INTO \"{schema}\".processed_events_parked (consumer, topic, \"partition\", \
               \"offset\", header_names, header_values, value, status, kind, reason, attempts) \
             VALUES ($1, $2, $3, $4, '{{}}', '{{}}', '\\x0102', 'parked', 'unprocessable', $5, 1)"
        ))
        .bind(consumer)
        .bind(&position.topic)
        .bind(position.partition)
        .bind(position.offset)
        .bind(reason)
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
