//! End-to-end under SIGKILL on MariaDB: the scenario of `kill_support` (the one `kill.rs` runs
//! on PostgreSQL) with the outbox, the orders, the projector's inbox (`outbox-mysql`'s
//! `MySqlInboxStore` through `outbox-inbox`), its effects and its projection all in one MariaDB
//! database. Two `outbox relay` processes on a `mysql://` URL (the URL is the only change from
//! the PostgreSQL run) and the projector are killed with SIGKILL at seeded random moments under
//! load; then no loss, nothing rolled back published, order per aggregate, each effect once.
//! Needs `MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`) and `KAFKA_BROKERS`
//! (`scripts/test`); skips only with `OUTBOX_SKIP_SERVICE_TESTS=1`. Seed and duration as in
//! `kill_support`.

mod kill_support;

use std::collections::HashSet;
use std::time::Duration;

use kill_support::{Proc, System};
use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, Envelope};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaSource;
use outbox_mysql::sqlx::mysql::MySqlPoolOptions;
use outbox_mysql::sqlx::{self, MySql, MySqlPool, Transaction};
use outbox_mysql::{map_sqlx_error, MySqlInboxStore, MySqlOutboxStore};
use outbox_test_support::required_var;

/// The outbox, orders, inbox, effects and projection in one MariaDB database.
struct Maria {
    pool: MySqlPool,
    store: MySqlOutboxStore,
}

async fn scalar(pool: &MySqlPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect(sql)
}

#[async_trait]
impl System for Maria {
    async fn business(&self, e: &Envelope, rollback: bool) {
        let mut tx = self.pool.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO orders (id, version) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE version = VALUES(version)",
        )
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
        // The projector creates the table when it first starts.
        sqlx::query_scalar::<_, i64>("SELECT COUNT(DISTINCT event_id) FROM effects")
            .fetch_one(&self.pool)
            .await
            .unwrap_or(0) as usize
    }
    async fn published_ids(&self) -> HashSet<uuid::Uuid> {
        sqlx::query_scalar::<_, Vec<u8>>(
            "SELECT event_id FROM outbox_events WHERE status = 'published'",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .iter()
        .map(|b| uuid::Uuid::from_slice(b).expect("16 bytes"))
        .collect()
    }
    async fn duplicate_effects(&self) -> i64 {
        scalar(
            &self.pool,
            "SELECT COUNT(*) FROM (SELECT event_id FROM effects GROUP BY event_id \
             HAVING COUNT(*) > 1) d",
        )
        .await
    }
    async fn total_effects(&self) -> i64 {
        scalar(&self.pool, "SELECT COUNT(*) FROM effects").await
    }
    async fn projection_mismatches(&self) -> i64 {
        scalar(
            &self.pool,
            "SELECT COUNT(*) FROM orders o LEFT JOIN projection p ON p.id = o.id \
             WHERE NOT (p.version <=> o.version)",
        )
        .await
    }
}

/// `url` with `database` as its path.
fn with_database(url: &str, database: &str) -> String {
    let (head, tail) = url.split_once("://").expect("MYSQL_URL has a scheme");
    let host = tail.split(['/', '?']).next().unwrap_or(tail);
    format!("{head}://{host}/{database}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_relays_and_consumer_on_mariadb_lose_nothing_and_apply_once() {
    let test = "sigkilled_relays_and_consumer_on_mariadb_lose_nothing_and_apply_once";
    let (Some(base), Some(brokers)) = (
        outbox_test_support::mysql_url(test),
        required_var(test, "KAFKA_BROKERS"),
    ) else {
        return;
    };
    let (seed, chaos) = kill_support::seed_and_duration();

    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let database = format!("kill_{run}");
    let topic = format!("kill-my-{run}");
    let admin = MySqlPool::connect(&base).await.expect("MariaDB");
    sqlx::query(&format!("CREATE DATABASE `{database}`"))
        .execute(&admin)
        .await
        .unwrap();
    let url = with_database(&base, &database);
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE orders (id VARCHAR(64) PRIMARY KEY, version BIGINT NOT NULL) \
         ENGINE = InnoDB",
    )
    .execute(&pool)
    .await
    .unwrap();
    let store = MySqlOutboxStore::builder(pool.clone())
        .claim_mode(ClaimMode::lease(Duration::from_secs(6)).unwrap())
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    kill_support::create_topic(&brokers, &topic).await;

    let relay_args = kill_support::relay_args(&["--database-url", &url], &brokers, &topic);
    let projector_args = vec![
        url.clone(),
        brokers.clone(),
        topic.clone(),
        "--group".into(),
        format!("kill-my-projector-{run}"),
        "projection".into(),
    ];
    let procs = vec![
        Proc::spawn("relay", relay_args.clone()),
        Proc::spawn("relay", relay_args),
        Proc::spawn("projector", projector_args),
    ];
    let system = Maria {
        pool: pool.clone(),
        store,
    };
    kill_support::run(&system, procs, &brokers, &topic, seed, chaos).await;
    sqlx::query(&format!("DROP DATABASE `{database}`"))
        .execute(&admin)
        .await
        .unwrap();
}

/// Appends an effect row and moves the projection to the event's version, in the inbox
/// transaction.
struct Projector;

#[async_trait]
impl Handler<Transaction<'static, MySql>> for Projector {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, MySql>,
        event: &Envelope,
    ) -> Result<(), HandlerError> {
        let err = |e: sqlx::Error| HandlerError::from(map_sqlx_error(e));
        sqlx::query("INSERT INTO effects (event_id, aggregate_id, version) VALUES (?, ?, ?)")
            .bind(event.event_id.as_uuid().as_bytes().to_vec())
            .bind(&event.aggregate_id)
            .bind(event.aggregate_version)
            .execute(&mut **tx)
            .await
            .map_err(err)?;
        let q = if event.aggregate_version == 1 {
            sqlx::query("INSERT IGNORE INTO projection (id, version) VALUES (?, 1)")
                .bind(&event.aggregate_id)
        } else {
            sqlx::query("UPDATE projection SET version = ? WHERE id = ? AND version = ?")
                .bind(event.aggregate_version)
                .bind(&event.aggregate_id)
                .bind(event.aggregate_version - 1)
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
/// only when started by `sigkilled_relays_and_consumer_on_mariadb_lose_nothing_and_apply_once`,
/// which passes its arguments in the environment), so it is ignored in normal runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process of the SIGKILL test, started (and killed) by it"]
async fn projector_process() {
    let a = kill_support::projector_args();
    let (url, brokers, topic, group, consumer) = (&a[0], &a[1], &a[2], &a[4], &a[5]);
    let pool = MySqlPoolOptions::new()
        .max_connections(4)
        .connect(url)
        .await
        .expect("connect");
    for ddl in [
        "CREATE TABLE IF NOT EXISTS effects (event_id BINARY(16) NOT NULL, \
         aggregate_id VARCHAR(64) NOT NULL, version BIGINT NOT NULL, \
         applied_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE = InnoDB",
        "CREATE TABLE IF NOT EXISTS projection (id VARCHAR(64) PRIMARY KEY, \
         version BIGINT NOT NULL) ENGINE = InnoDB",
    ] {
        sqlx::query(ddl).execute(&pool).await.expect("tables");
    }
    let inbox = MySqlInboxStore::builder(pool).build().expect("inbox");
    inbox.migrate().await.expect("inbox migrate");
    let source = KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_millis(6000))
        .build()
        .expect("source");
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(consumer, inbox, Projector),
        EngineConfig::default().with_commit(100, Duration::from_millis(200)),
        rand::random(),
    )
    .expect("engine");
    // Runs until the test kills it.
    let report = engine.run(std::future::pending::<()>()).await;
    eprintln!("projector stopped: {report:?}");
}
