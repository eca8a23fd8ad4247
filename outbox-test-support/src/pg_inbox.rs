//! The inbox engine's PostgreSQL side for the transports' source tests (feature
//! `postgres-inbox`): a schema of the test's own with an effects table (dropped with the
//! [`Db`]), a handler that records each effect ([`Effects`]) or refuses one version
//! ([`FailVersion`]), and the parking checks every transport shares ([`park_version_2`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{
    async_trait, Envelope, InboxParking, MessageSource, ParkedFilter, ParkedMessage, ParkedStatus,
    ReceivedMessage,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_postgres::{map_sqlx_error, PostgresInboxStore};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};

use crate::unique;

/// The transaction the PostgreSQL inbox hands a handler.
pub type PgTx = Transaction<'static, Postgres>;

/// A schema of the test's own on `DATABASE_URL`, with an effects table; dropped with the value.
#[derive(Debug)]
pub struct Db {
    /// A pool on the server.
    pub pool: PgPool,
    /// The schema's name.
    pub schema: String,
}

impl Db {
    /// A schema named `<schema_prefix>_…` (`None` after a printed skip, as
    /// [`database_url`](crate::database_url)).
    pub async fn new(test: &str, schema_prefix: &str) -> Option<Self> {
        let url = crate::database_url(test)?;
        let schema = unique(schema_prefix);
        let pool = PgPoolOptions::new()
            .max_connections(6)
            .connect(&url)
            .await
            .expect("PostgreSQL");
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{schema}\";
             CREATE TABLE \"{schema}\".effects (seq bigserial PRIMARY KEY, dedup_id uuid NOT NULL,
                 aggregate_id text NOT NULL, version bigint NOT NULL);"
        ))
        .execute(&pool)
        .await
        .expect("effects table");
        Some(Self { pool, schema })
    }

    /// The schema's inbox, migrated.
    pub async fn inbox(&self) -> PostgresInboxStore {
        let inbox = PostgresInboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .build()
            .expect("inbox");
        inbox.migrate().await.expect("migrate");
        inbox
    }

    /// The versions of `agg` applied, in the order they were.
    pub async fn applied(&self, agg: &str) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT version FROM \"{}\".effects WHERE aggregate_id = $1 ORDER BY seq",
            self.schema
        ))
        .bind(agg)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    /// Effects applied; panics if any event's was applied twice.
    pub async fn effects_once(&self) -> i64 {
        let twice: Vec<(uuid::Uuid, i64)> = sqlx::query_as(&format!(
            "SELECT dedup_id, count(*) FROM \"{}\".effects GROUP BY dedup_id HAVING count(*) > 1",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert!(twice.is_empty(), "effects applied twice: {twice:?}");
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".effects", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        let (pool, schema) = (self.pool.clone(), self.schema.clone());
        let _ = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async move {
                    let _ = sqlx::raw_sql(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
                        .execute(&pool)
                        .await;
                })
        })
        .join();
    }
}

/// A handler that records each event in the effects table of `schema` and counts it.
#[derive(Debug)]
pub struct Effects {
    /// The [`Db`]'s schema.
    pub schema: String,
    /// Events applied.
    pub applied: Arc<AtomicUsize>,
}

#[async_trait]
impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".effects (dedup_id, aggregate_id, version) VALUES ($1, $2, $3)",
            self.schema
        ))
        .bind(e.dedup_id().as_uuid())
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::from(map_sqlx_error(e)))?;
        self.applied.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Applies every event but version `fail` of any aggregate, which fails permanently.
#[derive(Debug)]
pub struct FailVersion {
    /// The version refused.
    pub fail: i64,
    /// What applies the others.
    pub inner: Effects,
}

#[async_trait]
impl Handler<PgTx> for FailVersion {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        if e.aggregate_version == self.fail {
            return Err(HandlerError::permanent("version refused by the test"));
        }
        self.inner.handle(tx, e).await
    }
}

/// Polls `source` until it handed out `n` messages (at most 20 s).
pub async fn poll_n<S: MessageSource>(source: &S, n: usize) -> Vec<ReceivedMessage> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(Instant::now() < deadline, "only {} of {n}", out.len());
        if let Some(m) = source.poll(Duration::from_millis(200)).await.expect("poll") {
            out.push(m);
        }
    }
    out
}

/// The parking every transport shares: `source` holds versions 1 to 3 of aggregate `agg`;
/// the inbox engine runs it as `consumer` on `db`'s inbox with a handler that refuses version
/// 2, until something is parked and the engine is quiet. Checks that version 2 is parked as
/// the head, version 3 waits behind it and only version 1 was applied; returns the parked
/// head and the waiting message for the transport's own checks of their positions.
pub async fn park_version_2<S: MessageSource>(
    db: &Db,
    source: S,
    consumer: &str,
    agg: &str,
) -> (ParkedMessage, ParkedMessage) {
    let inbox = db.inbox().await;
    let processor = InboxProcessor::new(
        consumer,
        inbox.clone(),
        FailVersion {
            fail: 2,
            inner: Effects {
                schema: db.schema.clone(),
                applied: Arc::new(AtomicUsize::new(0)),
            },
        },
    );
    let config = EngineConfig::default().with_commit(10, Duration::from_millis(100));
    let mut engine = ConsumerEngine::new(source, processor, config, 10).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.report().parked < 1 {
        assert!(Instant::now() < deadline, "nothing parked");
        engine.step().await.unwrap();
    }
    engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    let parked = inbox
        .list_parked(consumer, &ParkedFilter::open())
        .await
        .unwrap();
    let head = parked
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .expect("the refused version is parked")
        .clone();
    assert_eq!(head.record.aggregate_version, Some(2));
    let waiting = parked
        .iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .expect("version 3 waits")
        .clone();
    assert_eq!(db.applied(agg).await, vec![1]);
    (head, waiting)
}
