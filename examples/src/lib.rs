//! The demo pipeline: an order service appends events in its transactions, the relay publishes
//! them (through broker failures and one poison event), and a projection consumer applies them
//! once through the inbox.
//!
//! By default everything runs in one process on the in-memory backends of `outbox-testkit`
//! (`cargo run -p outbox-examples --bin demo`). `--database-url` puts the orders, the outbox and
//! the inbox in PostgreSQL; `--brokers` publishes through Kafka. [`run_demo`] is what the binary
//! calls; `tests/demo.rs` runs it and checks its invariants.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    Clock, EventId, InboxParking, MessageSource, ParkedEvent, Publisher, Relay, RelayConfig,
    RetryPolicy, StoreError, SystemClock,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, EngineReport, Handler, InboxProcessor};
use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyPublisher};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

pub mod cli;
pub mod kafka;
pub mod memory;
pub mod postgres;

/// Name of the projection consumer.
pub const CONSUMER: &str = "order-projection";
/// Largest record the demo's broker accepts, so the poison order is refused permanently.
pub const MAX_RECORD_BYTES: usize = 2048;

/// An order as the order service stores it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    /// Identity.
    pub id: String,
    /// `pending`, `confirmed` or `shipped`.
    pub status: String,
    /// Version: 1 when placed, +1 per transition; equals the aggregate version of its last event.
    pub version: i64,
    /// Free-text note from the customer.
    pub note: String,
}

/// Result of a business command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    /// State changed and one event appended in the same transaction.
    Applied(EventId),
    /// The transition is not allowed from the current state: nothing changed, nothing appended.
    Rejected(String),
}

/// The order service, whatever database it runs on.
#[outbox_core::async_trait]
pub trait OrderService: Send + Sync {
    /// Places an order: inserts it (version 1) and appends `order.placed` in one transaction.
    async fn place(&self, id: &str, note: &str) -> Result<Transition, StoreError>;
    /// Moves an order `from` → `to` only if it is in `from` (conditional update), version + 1,
    /// appending `event_type` in the same transaction. An invalid transition appends nothing.
    async fn transition(
        &self,
        id: &str,
        from: &str,
        to: &str,
        event_type: &str,
    ) -> Result<Transition, StoreError>;
    /// Number of orders whose projection row has the order's current version.
    async fn projection_matches(&self) -> Result<usize, StoreError>;
}

/// Which backends the demo uses.
#[derive(Clone, Debug, Default)]
pub struct DemoConfig {
    /// Orders to place and confirm.
    pub orders: usize,
    /// PostgreSQL for orders, outbox and inbox (in-memory when `None`).
    pub database_url: Option<String>,
    /// Kafka bootstrap servers (in-memory log when `None`).
    pub brokers: Option<String>,
    /// Keep the PostgreSQL schema and the Kafka topic of the run for inspection (both removed
    /// by default).
    pub keep_schema: bool,
    /// PostgreSQL schema of the run, created by the demo (so it must not exist yet); a fresh
    /// `outbox_demo_<random>` when `None`.
    pub schema: Option<String>,
}

/// What the demo did, for printing and for the test.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DemoSummary {
    /// Backends used, for the header line.
    pub backends: String,
    /// Events appended (committed).
    pub appended: usize,
    /// Business commands rejected (nothing appended).
    pub rejected: Vec<String>,
    /// Events marked published by the relay.
    pub marked_published: u64,
    /// Publication attempts that failed transiently on their own and were retried with backoff
    /// (an attempt spent).
    pub retried: u64,
    /// Publications that failed in the transport (broker unavailable, a lost acknowledgement)
    /// and were put back without spending an attempt, the relay pausing as a whole.
    pub deferred: u64,
    /// Cycles after which the relay's circuit breaker paused it.
    pub paused: u64,
    /// Relay cycles run.
    pub relay_cycles: u64,
    /// Parked events with reasons.
    pub parked: Vec<ParkedEvent>,
    /// Events not published (waiting, in flight, or behind a parked event of their aggregate).
    pub unpublished: u64,
    /// Of those, waiting behind a parked event of their aggregate.
    pub blocked: u64,
    /// Age of the oldest claimable event (neither blocked nor held behind a version gap).
    pub oldest_claimable_age: Option<Duration>,
    /// Age of the oldest parked event.
    pub oldest_parked_age: Option<Duration>,
    /// Consumer totals.
    pub consumer: EngineReport,
    /// Orders whose projection matches the order's current version.
    pub projection_rows: usize,
}

/// Runs the demo on the backends `config` names.
pub async fn run_demo(config: &DemoConfig) -> anyhow::Result<DemoSummary> {
    anyhow::ensure!(config.orders >= 1, "at least one order");
    anyhow::ensure!(
        config.schema.is_none() || config.database_url.is_some(),
        "a schema is for PostgreSQL: give a database_url too"
    );
    match (&config.database_url, &config.brokers) {
        (None, None) => {
            let m = memory::MemoryBackend::new()?;
            let (log, source) = memory::log_and_source();
            drive(
                "in-memory store, in-memory log",
                config,
                &m.service,
                m.store.clone(),
                log,
                m.inbox.clone(),
                source,
                memory::Projection,
            )
            .await
        }
        (None, Some(brokers)) => {
            let m = memory::MemoryBackend::new()?;
            let k = kafka::KafkaBackend::start(brokers).await?;
            let topic = k.topic.clone();
            let summary = drive(
                "in-memory store, Kafka",
                config,
                &m.service,
                m.store.clone(),
                k.publisher,
                m.inbox.clone(),
                k.source,
                memory::Projection,
            )
            .await;
            kafka::finish(brokers, &topic, config.keep_schema).await;
            summary
        }
        (Some(url), None) => {
            let p = postgres::PostgresBackend::connect(url, config.schema.as_deref()).await?;
            let (log, source) = memory::log_and_source();
            let summary = drive(
                "PostgreSQL, in-memory log",
                config,
                &p.service,
                p.store.clone(),
                log,
                p.inbox.clone(),
                source,
                postgres::Projection::new(&p.schema),
            )
            .await;
            finish_postgres(&p, config, summary).await
        }
        (Some(url), Some(brokers)) => {
            let p = postgres::PostgresBackend::connect(url, config.schema.as_deref()).await?;
            let k = kafka::KafkaBackend::start(brokers).await?;
            let topic = k.topic.clone();
            let summary = drive(
                "PostgreSQL, Kafka",
                config,
                &p.service,
                p.store.clone(),
                k.publisher,
                p.inbox.clone(),
                k.source,
                postgres::Projection::new(&p.schema),
            )
            .await;
            kafka::finish(brokers, &topic, config.keep_schema).await;
            finish_postgres(&p, config, summary).await
        }
    }
}

/// Drops the run's schema unless asked to keep it.
async fn finish_postgres(
    p: &postgres::PostgresBackend,
    config: &DemoConfig,
    summary: anyhow::Result<DemoSummary>,
) -> anyhow::Result<DemoSummary> {
    if config.keep_schema {
        eprintln!("kept PostgreSQL schema {}", p.schema);
    } else {
        p.drop_schema().await?;
        eprintln!(
            "used PostgreSQL schema {} (dropped; --keep keeps it)",
            p.schema
        );
    }
    summary
}

/// The pipeline, generic over every backend.
#[allow(clippy::too_many_arguments)]
async fn drive<Svc, S, P, I, Src, H>(
    backends: &str,
    config: &DemoConfig,
    service: &Svc,
    store: S,
    publisher: P,
    inbox: I,
    source: Src,
    handler: H,
) -> anyhow::Result<DemoSummary>
where
    Svc: OrderService,
    S: OutboxStore + Clone + 'static,
    P: Publisher + 'static,
    I: InboxParking + 'static,
    Src: MessageSource,
    H: Handler<I::Tx> + 'static,
{
    // 1. Business transactions.
    let mut appended = 0;
    let mut rejected = vec![];
    let mut count = |t: Transition| match t {
        Transition::Applied(_) => appended += 1,
        Transition::Rejected(why) => rejected.push(why),
    };
    let orders = config.orders;
    for i in 0..orders {
        count(
            service
                .place(&format!("order-{i:03}"), "leave at the door")
                .await?,
        );
    }
    // The poison: a note so large the broker refuses the record (a permanent error).
    count(
        service
            .place("order-big", &"x".repeat(MAX_RECORD_BYTES * 2))
            .await?,
    );
    for i in 0..orders {
        let id = format!("order-{i:03}");
        count(
            service
                .transition(&id, "pending", "confirmed", "order.confirmed")
                .await?,
        );
    }
    // Invalid: confirming twice appends nothing.
    count(
        service
            .transition("order-000", "pending", "confirmed", "order.confirmed")
            .await?,
    );
    // order-big's confirmation is appended but waits behind its parked head.
    count(
        service
            .transition("order-big", "pending", "confirmed", "order.confirmed")
            .await?,
    );

    // 2. The relay, through a broker that fails three times and loses two acknowledgements
    //    after storing the records (those events are published twice).
    let trouble = [Some(Fault::Transient); 3]
        .into_iter()
        .chain([Some(Fault::AckLost); 2]);
    let publisher =
        FaultyPublisher::new(publisher, FaultInjector::new(FaultSource::script(trouble)));
    let relay_config = RelayConfig::builder()
        .owner("demo-relay")
        .batch_size(16)
        .retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(5))
                .max_delay(Duration::from_millis(50))
                .min_delay(Duration::from_millis(1))
                .max_attempts(8)
                .build()?,
        )
        .idle(Duration::from_millis(2), Duration::from_millis(20))
        .circuit_breaker(Duration::from_millis(20), Duration::from_millis(200))
        .build()?;
    let mut relay = Relay::new(
        store.clone(),
        publisher,
        relay_config,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(42)),
    )?;
    let (mut relay_cycles, mut retried, mut marked_published) = (0u64, 0u64, 0u64);
    let (mut deferred, mut paused) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    // Expected: everything except order-big's two events.
    let expected = (2 * orders) as u64;
    while marked_published < expected {
        let cycle = relay.run_once().await?;
        relay_cycles += 1;
        retried += cycle.retried as u64;
        deferred += cycle.deferred as u64;
        marked_published += cycle.published as u64;
        if let Some(pause) = cycle.pause {
            // The transport failed as a whole: the circuit breaker paces the relay.
            paused += 1;
            tokio::time::sleep(pause).await;
        } else if cycle.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "relay did not drain within 60 s ({marked_published} of {expected} published)"
        );
    }

    // 3. The projection consumer applies everything once.
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(CONSUMER, inbox, handler),
        EngineConfig::default().with_poll_timeout(Duration::from_millis(20)),
        7,
    )?;
    let consumer = engine.run_until_quiet(Duration::from_secs(2)).await?;

    // 4. Summary.
    let stats = store.stats().await?;
    let parked = store.list_parked(100).await?;
    let projection_rows = service.projection_matches().await?;
    Ok(DemoSummary {
        backends: backends.to_owned(),
        appended,
        rejected,
        marked_published,
        retried,
        deferred,
        paused,
        relay_cycles,
        parked,
        unpublished: stats.unpublished,
        blocked: stats.blocked,
        oldest_claimable_age: stats.oldest_claimable_age,
        oldest_parked_age: stats.oldest_parked_age,
        consumer,
        projection_rows,
    })
}

/// Creation time for events: the system clock.
pub(crate) fn now() -> chrono::DateTime<chrono::Utc> {
    SystemClock.now()
}

impl std::fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let age = |a: Option<Duration>| {
            a.map_or("none".to_string(), |d| format!("{:.3} s", d.as_secs_f64()))
        };
        writeln!(f, "outbox demo ({})", self.backends)?;
        writeln!(
            f,
            "  appended: {} events, each committed with its state change",
            self.appended
        )?;
        for r in &self.rejected {
            writeln!(f, "  rejected, nothing appended: {r}")?;
        }
        writeln!(
            f,
            "  relay: {} events published in {} cycles; {} transient failures retried with backoff",
            self.marked_published, self.relay_cycles, self.retried
        )?;
        writeln!(
            f,
            "  broker trouble: {} publications put back without spending an attempt; {} pauses of the circuit breaker",
            self.deferred, self.paused
        )?;
        for p in &self.parked {
            writeln!(
                f,
                "  parked: {} {} v{} after {} attempt(s): {} ({}: {})",
                p.envelope.aggregate_id,
                p.envelope.event_type,
                p.envelope.aggregate_version,
                p.attempts,
                p.reason.kind.as_str(),
                p.reason.error.kind,
                p.reason.error.message
            )?;
        }
        writeln!(
            f,
            "  unpublished: {} ({} waiting behind the parked event of their aggregate)",
            self.unpublished, self.blocked
        )?;
        writeln!(
            f,
            "  oldest claimable age: {}; oldest parked age: {}",
            age(self.oldest_claimable_age),
            age(self.oldest_parked_age)
        )?;
        writeln!(
            f,
            "  consumer '{CONSUMER}': {} received, {} applied, {} duplicates absorbed, {} offset commits",
            self.consumer.received, self.consumer.applied, self.consumer.duplicates, self.consumer.commits
        )?;
        write!(
            f,
            "  projection rows equal to the order's current version: {}",
            self.projection_rows
        )
    }
}
