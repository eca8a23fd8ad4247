//! End-to-end under SIGKILL on NATS JetStream and on RabbitMQ: the load of `kill_support`
//! (business transactions over 30 aggregates on PostgreSQL, a tenth rolled back) while two
//! `outbox relay` processes, configured with `[transport] kind = "nats"` / `"rabbitmq"`, are
//! killed with SIGKILL at seeded random moments and restarted. After the load stops and the
//! outbox drains, what the stream (or the quorum queue) holds must show: no committed event
//! lost, nothing from a rolled-back transaction, per aggregate the first deliveries in version
//! order, and every other record a re-send of a committed event. (The consumer side under
//! SIGKILL is `kill.rs`; the adapters' consumers have their own end-to-end tests.)
//!
//! Seed: `OUTBOX_KILL_SEED` (printed); chaos duration: `OUTBOX_KILL_SECS` (default 15). Needs
//! `DATABASE_URL`, NATS and RabbitMQ (`NATS_URL`, `AMQP_URL`, else the local servers); skips
//! only with `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod kill_support;
mod transport_support;

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use kill_support::{Business, Load, Proc};
use outbox_core::prelude::*;
use outbox_core::{async_trait, ClaimMode, Envelope};
use outbox_postgres::PostgresOutboxStore;
use sqlx::{PgPool, Row};
use transport_support::{check_invariants, NatsStream, RabbitTopology, Record};

/// The outbox and the orders in one PostgreSQL schema of the test's own.
struct PgOutbox {
    url: String,
    pool: PgPool,
    schema: String,
    store: PostgresOutboxStore,
}

#[async_trait]
impl Business for PgOutbox {
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
}

impl PgOutbox {
    async fn create(url: &str) -> Self {
        let schema = outbox_test_support::unique("killt");
        let pool = PgPool::connect(url).await.unwrap();
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
        Self {
            url: url.to_owned(),
            pool,
            schema,
            store,
        }
    }

    /// `outbox relay` arguments with the transport from `config` (a file), a 6 s lease.
    fn relay_args(&self, config: &Path) -> Vec<String> {
        [
            "--database-url",
            &self.url,
            "--schema",
            &self.schema,
            "--config",
            config.to_str().unwrap(),
            "--lease",
            "6s",
            "--batch-size",
            "50",
            "--no-http",
            "--no-cleanup",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// Waits until nothing is unpublished; nothing may be parked.
    async fn drain(&self, seed: u64) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let stats = self.store.stats().await.unwrap();
            if stats.unpublished == 0 {
                assert_eq!(stats.parked, 0, "nothing parked (seed {seed})");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not drained (seed {seed}): {} unpublished",
                stats.unpublished
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
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

    async fn drop_schema(&self) {
        sqlx::raw_sql(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

/// Load with kills, drain, and the invariants over what `read` returns from the broker.
async fn scenario<F, Fut>(pg: &PgOutbox, config: &str, transport: &str, read: F)
where
    F: FnOnce(usize) -> Fut,
    Fut: std::future::Future<Output = Vec<Record>>,
{
    let (seed, chaos) = kill_support::seed_and_duration();
    let path = std::env::temp_dir().join(format!("{}.toml", pg.schema));
    std::fs::write(&path, config).unwrap();
    let args = pg.relay_args(&path);
    let mut procs = vec![
        Proc::spawn("relay", args.clone()),
        Proc::spawn("relay", args),
    ];
    let Load {
        committed,
        rolled_back,
    } = kill_support::load_with_kills(pg, &mut procs, seed, chaos).await;
    pg.drain(seed).await;
    drop(procs);
    let _ = std::fs::remove_file(&path);
    let published = pg.published_ids().await;
    for (id, agg, v) in &committed {
        assert!(
            published.contains(&id.as_uuid()),
            "event {id} ({agg} v{v}) not marked published (seed {seed})"
        );
    }
    let committed: Vec<(uuid::Uuid, String, i64)> = committed
        .into_iter()
        .map(|(id, agg, v)| (id.as_uuid(), agg, v))
        .collect();
    let rolled_back: HashSet<uuid::Uuid> = rolled_back.iter().map(|id| id.as_uuid()).collect();
    let records = read(committed.len()).await;
    let duplicates = check_invariants(
        &records,
        &committed,
        &rolled_back,
        &format!("{transport}, seed {seed}"),
    );
    println!(
        "ok ({transport}): {} records for {} events ({duplicates} re-sends), {} rolled back",
        records.len(),
        committed.len(),
        rolled_back.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_relays_lose_nothing_on_nats() {
    let test = "sigkilled_relays_lose_nothing_on_nats";
    let (Some(url), Some(nats)) = (
        outbox_test_support::database_url(test),
        outbox_test_support::nats_url(test),
    ) else {
        return;
    };
    let pg = PgOutbox::create(&url).await;
    let stream = NatsStream::create(&nats, Duration::from_secs(120)).await;
    let config = format!(
        "[transport]\nkind = \"nats\"\n[nats]\nservers = \"{nats}\"\nsubject_prefix = \"{}\"\ndelivery_timeout = \"3s\"\n",
        stream.prefix
    );
    scenario(&pg, &config, "nats", |n| async move {
        stream.read_settled(n).await
    })
    .await;
    pg.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_relays_lose_nothing_on_rabbitmq() {
    let test = "sigkilled_relays_lose_nothing_on_rabbitmq";
    let (Some(url), Some(amqp)) = (
        outbox_test_support::database_url(test),
        outbox_test_support::amqp_url(test),
    ) else {
        return;
    };
    let pg = PgOutbox::create(&url).await;
    let topology = RabbitTopology::create(&amqp).await;
    let config = format!(
        "[transport]\nkind = \"rabbitmq\"\n[rabbitmq]\nuri = \"{amqp}\"\nexchange = \"{}\"\ndelivery_timeout = \"3s\"\n",
        topology.exchange
    );
    scenario(&pg, &config, "rabbitmq", |n| async move {
        topology.drain_settled(n).await
    })
    .await;
    pg.drop_schema().await;
}
