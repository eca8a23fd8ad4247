//! End-to-end under SIGKILL on PostgreSQL: the scenario of `kill_support` (two `outbox relay`
//! processes and one projector process, a consumer through `outbox-inbox` with the PostgreSQL
//! inbox, killed with SIGKILL at seeded random moments under load; then no loss, nothing
//! rolled back published, order per aggregate, each effect once). `kill_mysql.rs` runs the
//! same scenario on MariaDB. Needs `DATABASE_URL` and `KAFKA_BROKERS` (`scripts/test` sets
//! both); skips only with `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod kill_support;

use std::collections::HashSet;
use std::time::Duration;

use kill_support::{Proc, System};
use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, Envelope};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaSource;
use outbox_postgres::{map_sqlx_error, qualified, PostgresInboxStore, PostgresOutboxStore};
use outbox_test_support::required_var;
use sqlx::{PgPool, Row};
use sqlx::{Postgres, Transaction};

/// The outbox, orders, effects and projection in one PostgreSQL schema.
struct Pg {
    pool: PgPool,
    schema: String,
    store: PostgresOutboxStore,
}

#[async_trait]
impl System for Pg {
    async fn business(&self, e: &Envelope, rollback: bool) {
        let schema = &self.schema;
        let mut tx = self.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "INSERT INTO {schema}.orders (id, version) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET version = $2"
        ))
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut *tx)
        .await
        .unwrap();
        self.store.append(&mut *tx, e).await.unwrap();
        if rollback {
            tx.rollback().await.unwrap();
        } else {
            tx.commit().await.unwrap();
        }
    }
    async fn backlog(&self) -> (u64, u64) {
        let stats = self.store.stats().await.unwrap();
        (stats.unpublished, stats.parked)
    }
    async fn applied_distinct(&self) -> usize {
        sqlx::query_scalar::<_, i64>(&format!(
            "SELECT count(DISTINCT event_id) FROM {}.effects",
            self.schema
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap_or(0) as usize
    }
    async fn published_ids(&self) -> HashSet<uuid::Uuid> {
        sqlx::query(&format!(
            "SELECT event_id FROM {}.outbox_events WHERE status = 'published'",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get("event_id"))
        .collect()
    }
    async fn duplicate_effects(&self) -> i64 {
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM (SELECT event_id FROM {}.effects GROUP BY event_id HAVING count(*) > 1) d",
            self.schema
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
    async fn total_effects(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.effects", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
    async fn projection_mismatches(&self) -> i64 {
        let schema = &self.schema;
        sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {schema}.orders o LEFT JOIN {schema}.projection p ON p.id = o.id WHERE p.version IS DISTINCT FROM o.version"
        ))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_relays_and_consumer_lose_nothing_and_apply_once() {
    let test = "sigkilled_relays_and_consumer_lose_nothing_and_apply_once";
    let (Some(url), Some(brokers)) = (
        required_var(test, "DATABASE_URL"),
        required_var(test, "KAFKA_BROKERS"),
    ) else {
        return;
    };
    let (seed, chaos) = kill_support::seed_and_duration();

    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let schema = format!("kill_{run}");
    let topic = format!("kill-{run}");
    let pool = PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(&format!(
        "CREATE SCHEMA {schema}; CREATE TABLE {schema}.orders (id text PRIMARY KEY, version bigint NOT NULL);"
    ))
    .execute(&pool)
    .await
    .unwrap();
    let store = PostgresOutboxStore::builder(pool.clone())
        .schema(schema.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(6)).unwrap())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    kill_support::create_topic(&brokers, &topic).await;

    let relay_args = kill_support::relay_args(
        &["--database-url", &url, "--schema", &schema],
        &brokers,
        &topic,
    );
    let projector_args = vec![
        url.clone(),
        schema.clone(),
        brokers.clone(),
        topic.clone(),
        "--group".into(),
        format!("kill-projector-{run}"),
        "projection".into(),
    ];
    let procs = vec![
        Proc::spawn("relay", relay_args.clone()),
        Proc::spawn("relay", relay_args),
        Proc::spawn("projector", projector_args),
    ];
    let system = Pg {
        pool: pool.clone(),
        schema: schema.clone(),
        store,
    };
    kill_support::run(&system, procs, &brokers, &topic, seed, chaos).await;
    sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
        .execute(&pool)
        .await
        .unwrap();
}

/// Appends an effect row and moves the projection to the event's version, in the inbox
/// transaction.
struct Projector {
    effect: String,
    insert: String,
    update: String,
}

#[async_trait]
impl Handler<Transaction<'static, Postgres>> for Projector {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        let err = |e: sqlx::Error| HandlerError::from(map_sqlx_error(e));
        sqlx::query(&self.effect)
            .bind(event.event_id.as_uuid())
            .bind(&event.aggregate_id)
            .bind(event.aggregate_version)
            .execute(&mut **tx)
            .await
            .map_err(err)?;
        let q = if event.aggregate_version == 1 {
            sqlx::query(&self.insert).bind(&event.aggregate_id)
        } else {
            sqlx::query(&self.update)
                .bind(&event.aggregate_id)
                .bind(event.aggregate_version)
        };
        if q.execute(&mut **tx).await.map_err(err)?.rows_affected() != 1 {
            return Err(HandlerError::transient(format!(
                "projection of {} is not at version {}",
                event.aggregate_id,
                event.aggregate_version - 1
            )));
        }
        Ok(())
    }
}

/// The projector process the SIGKILL test starts and kills: not a test of its own (it runs
/// only when started by `sigkilled_relays_and_consumer_lose_nothing_and_apply_once`, which
/// passes its arguments in the environment), so it is ignored in normal runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of the SIGKILL test, started (and killed) by it"]
async fn projector_process() {
    let a = kill_support::projector_args();
    let (url, schema, brokers, topic, group, consumer) = (&a[0], &a[1], &a[2], &a[3], &a[5], &a[6]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("connect");
    outbox_postgres::validate_identifier("schema", schema, outbox_postgres::MAX_IDENTIFIER_LEN)
        .expect("schema");
    let (effects, projection) = (
        qualified(schema, "effects"),
        qualified(schema, "projection"),
    );
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {effects} (event_id uuid NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS {projection} (id text PRIMARY KEY, version bigint NOT NULL);"
    ))
    .execute(&pool)
    .await
    .expect("tables");
    let inbox = PostgresInboxStore::builder(pool)
        .schema(schema.to_owned())
        .build()
        .expect("inbox");
    inbox.migrate().await.expect("inbox migrate");
    let handler = Projector {
        effect: format!(
            "INSERT INTO {effects} (event_id, aggregate_id, version) VALUES ($1, $2, $3)"
        ),
        insert: format!(
            "INSERT INTO {projection} (id, version) VALUES ($1, 1) ON CONFLICT (id) DO NOTHING"
        ),
        update: format!("UPDATE {projection} SET version = $2 WHERE id = $1 AND version = $2 - 1"),
    };
    let source = KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_millis(6000))
        .build()
        .expect("source");
    // The engine hands its offset tracker to the source.
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(consumer, inbox, handler),
        EngineConfig::default().with_commit(100, Duration::from_millis(200)),
        rand::random(),
    )
    .expect("engine");
    // Runs until the test kills it.
    let report = engine.run(std::future::pending::<()>()).await;
    eprintln!("projector stopped: {report:?}");
}
