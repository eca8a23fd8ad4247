//! A projection consumer process: Kafka → inbox + projection in PostgreSQL, until SIGINT/SIGTERM.
//!
//! Each event's effect (a row in `<schema>.effects` and the projection update with a version
//! check) commits in one transaction with the inbox registration; offsets are committed only
//! after that transaction. Safe to kill at any moment.

use std::time::Duration;

use clap::Parser;
use outbox_core::{async_trait, Envelope};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_kafka::KafkaSource;
use outbox_postgres::{map_sqlx_error, qualified, PostgresInboxStore};
use sqlx::{Postgres, Transaction};

/// Projector: Kafka → PostgreSQL projection through the inbox.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Schema of the inbox, `projection` and `effects` tables (a plain lowercase identifier,
    /// checked like the stores' names before anything connects).
    #[arg(long, value_parser = outbox_examples::cli::parse_schema)]
    schema: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS")]
    brokers: String,
    /// Topic to read.
    #[arg(long, value_parser = outbox_examples::cli::parse_topic)]
    topic: String,
    /// Kafka consumer group.
    #[arg(long)]
    group: String,
    /// Inbox consumer name: the deduplication key prefix (default: the group). Keep it stable
    /// when the group changes, or every re-read event counts as new.
    #[arg(long)]
    consumer: Option<String>,
    /// Session timeout in milliseconds.
    #[arg(long, default_value_t = 6000)]
    session_timeout_ms: u64,
    /// Extra librdkafka consumer properties, `key=value` (repeatable).
    #[arg(long = "consumer-property", value_parser = outbox_examples::cli::parse_kv)]
    consumer_properties: Vec<(String, String)>,
}

/// Appends an effect row and moves the projection to the event's version.
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    outbox_examples::cli::init_tracing();
    let args = Args::parse();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&args.database_url)
        .await?;
    // Validated while parsing the arguments; written into SQL only quoted.
    let s = &args.schema;
    let (effects, projection) = (qualified(s, "effects"), qualified(s, "projection"));
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS {effects} (event_id uuid NOT NULL, aggregate_id text NOT NULL, version bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now());
         CREATE TABLE IF NOT EXISTS {projection} (id text PRIMARY KEY, version bigint NOT NULL);"
    ))
    .execute(&pool)
    .await?;
    let inbox = PostgresInboxStore::builder(pool)
        .schema(s.clone())
        .build()?;
    inbox.migrate().await?;
    let handler = Projector {
        effect: format!(
            "INSERT INTO {effects} (event_id, aggregate_id, version) VALUES ($1, $2, $3)"
        ),
        insert: format!(
            "INSERT INTO {projection} (id, version) VALUES ($1, 1) ON CONFLICT (id) DO NOTHING"
        ),
        update: format!("UPDATE {projection} SET version = $2 WHERE id = $1 AND version = $2 - 1"),
    };
    let mut builder = KafkaSource::builder(&args.brokers, &args.group)
        .topic(&args.topic)
        .session_timeout(Duration::from_millis(args.session_timeout_ms));
    for (k, v) in &args.consumer_properties {
        builder = builder.set(k, v);
    }
    let source = builder.build()?;
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(
            args.consumer.clone().unwrap_or_else(|| args.group.clone()),
            inbox,
            handler,
        ),
        EngineConfig::default().with_commit(100, Duration::from_millis(200)),
        rand::random(),
    )?;
    let report = engine.run(outbox_examples::cli::shutdown_signal()).await?;
    eprintln!("projector stopped: {report:?}");
    Ok(())
}
