//! The services a benchmark runs against, and what every scenario needs from them: fresh
//! schemas and topics named after the run (removed at the end), the workload's envelopes.

use std::time::Duration;

use anyhow::Context as _;
use outbox_core::{ClaimMode, Envelope};
use outbox_postgres::PostgresOutboxStore;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

/// The connections of one benchmark run.
pub(crate) struct Env {
    pub(crate) pool: PgPool,
    pub(crate) database_url: String,
    brokers: Option<String>,
    /// Short random id: every schema and topic of this run carries it.
    pub(crate) run: String,
    schemas: std::sync::Mutex<Vec<String>>,
    topics: std::sync::Mutex<Vec<String>>,
}

impl Env {
    /// Connects to `DATABASE_URL` (required) and remembers `KAFKA_BROKERS` (required by the
    /// scenarios that use the broker).
    pub(crate) async fn connect(
        database_url: Option<String>,
        brokers: Option<String>,
        max_connections: u32,
    ) -> anyhow::Result<Self> {
        let database_url = database_url.context(
            "no PostgreSQL: set DATABASE_URL or pass --database-url \
             (scripts/services.sh: ensure_postgres)",
        )?;
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&database_url)
            .await
            .context("cannot connect to PostgreSQL at DATABASE_URL")?;
        Ok(Self {
            pool,
            database_url,
            brokers,
            run: uuid::Uuid::new_v4().simple().to_string()[..8].to_owned(),
            schemas: Default::default(),
            topics: Default::default(),
        })
    }

    /// The broker, or a clear error.
    pub(crate) fn brokers(&self) -> anyhow::Result<&str> {
        self.brokers.as_deref().context(
            "no broker: set KAFKA_BROKERS or pass --brokers (scripts/services.sh: ensure_kafka)",
        )
    }

    /// A new, empty schema named `bench_<run>_<tag>`, dropped by [`Env::cleanup`].
    pub(crate) async fn schema(&self, tag: &str) -> anyhow::Result<String> {
        let n = {
            let mut s = self.schemas.lock().expect("lock");
            let name = format!("bench_{}_{}_{}", self.run, tag, s.len());
            s.push(name.clone());
            name
        };
        sqlx::raw_sql(&format!("CREATE SCHEMA \"{n}\""))
            .execute(&self.pool)
            .await?;
        Ok(n)
    }

    /// Drops a schema now (and forgets it).
    pub(crate) async fn drop_schema(&self, schema: &str) -> anyhow::Result<()> {
        sqlx::raw_sql(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .execute(&self.pool)
            .await?;
        self.schemas.lock().expect("lock").retain(|s| s != schema);
        Ok(())
    }

    /// A migrated outbox store in a new schema.
    pub(crate) async fn store(
        &self,
        tag: &str,
        mode: ClaimMode,
        notify: bool,
    ) -> anyhow::Result<PostgresOutboxStore> {
        let schema = self.schema(tag).await?;
        let mut b = PostgresOutboxStore::builder(self.pool.clone())
            .schema(schema)
            .claim_mode(mode);
        if !notify {
            b = b.notify_channel(None);
        }
        let store = b.build()?;
        store.migrate().await?;
        Ok(store)
    }

    /// A new topic `bench-<run>-<tag>-<n>` with `partitions` partitions, deleted by cleanup.
    pub(crate) async fn topic(&self, tag: &str, partitions: i32) -> anyhow::Result<String> {
        let brokers = self.brokers()?.to_owned();
        let name = {
            let mut t = self.topics.lock().expect("lock");
            let name = format!("bench-{}-{}-{}", self.run, tag, t.len());
            t.push(name.clone());
            name
        };
        let admin = admin(&brokers)?;
        for r in admin
            .create_topics(
                [&NewTopic::new(
                    &name,
                    partitions,
                    TopicReplication::Fixed(1),
                )],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?
        {
            r.map_err(|(t, e)| anyhow::anyhow!("create topic {t}: {e}"))?;
        }
        Ok(name)
    }

    /// Drops every schema and deletes every topic this run created.
    pub(crate) async fn cleanup(&self) -> anyhow::Result<()> {
        let schemas: Vec<String> = self.schemas.lock().expect("lock").clone();
        for s in schemas {
            self.drop_schema(&s).await?;
        }
        let topics: Vec<String> = std::mem::take(&mut *self.topics.lock().expect("lock"));
        if !topics.is_empty() {
            let admin = admin(self.brokers()?)?;
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            for r in admin
                .delete_topics(
                    &names,
                    &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
                )
                .await?
            {
                if let Err((t, e)) = r {
                    eprintln!("warning: could not delete topic {t}: {e}");
                }
            }
        }
        Ok(())
    }
}

pub(crate) fn admin(brokers: &str) -> anyhow::Result<AdminClient<DefaultClientContext>> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?)
}

/// The workload's payload: about 200 bytes of JSON.
pub(crate) fn payload(i: usize) -> serde_json::Value {
    serde_json::json!({
        "order": format!("order-{i:08}"),
        "customer": format!("customer-{:06}", i % 100_000),
        "total_cents": 1999 + (i % 1000),
        "currency": "EUR",
        "items": [{"sku": "SKU-0001", "qty": 2}, {"sku": "SKU-0042", "qty": 1}],
        "note": "benchmark payload, about two hundred bytes"
    })
}

/// Event `i` of a backlog spread round-robin over `aggregates` (version = the round).
pub(crate) fn event(i: usize, aggregates: usize) -> Envelope {
    let aggregates = aggregates.max(1);
    Envelope::builder(
        "order",
        format!("order-{}", i % aggregates),
        (i / aggregates) as i64 + 1,
        "order.changed",
    )
    .json(&payload(i))
    .and_then(|b| b.build())
    .expect("valid envelope")
}

/// Appends `events` events over `aggregates` in batches of 5,000, then analyzes the table.
pub(crate) async fn preload(
    store: &PostgresOutboxStore,
    events: usize,
    aggregates: usize,
) -> anyhow::Result<()> {
    let mut i = 0;
    while i < events {
        let n = 5_000.min(events - i);
        let batch: Vec<Envelope> = (i..i + n).map(|k| event(k, aggregates)).collect();
        store.append_many(store.pool(), &batch).await?;
        i += n;
    }
    let s = store.settings();
    sqlx::raw_sql(&format!("VACUUM ANALYZE \"{}\".\"{}\"", s.schema, s.table))
        .execute(store.pool())
        .await?;
    Ok(())
}

/// Unpublished rows left in a store.
pub(crate) async fn unpublished(store: &PostgresOutboxStore) -> anyhow::Result<i64> {
    let s = store.settings();
    Ok(sqlx::query_scalar(&format!(
        "SELECT count(*) FROM \"{}\".\"{}\" WHERE status <> 'published'",
        s.schema, s.table
    ))
    .fetch_one(store.pool())
    .await?)
}
