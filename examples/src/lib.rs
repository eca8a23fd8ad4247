//! The demo pipeline: an order service appends events in its transactions, the relay publishes
//! them (through scripted broker failures and one poison event), and a projection consumer
//! applies them once through the inbox.
//!
//! By default everything runs in one process on the in-memory backends of `outbox-testkit`.
//! [`run_memory_demo`] is what `cargo run -p outbox-examples --bin demo` calls; the test in
//! `tests/demo.rs` runs the same function and checks its invariants.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{
    async_trait, ClaimMode, Clock, DeliveryStatus, Envelope, EventId, OutboxStore, ParkedEvent,
    PublishErrorKind, Relay, RelayConfig, RetryPolicy, StoreError, SystemClock,
};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, EngineReport, Handler, HandlerError, InboxProcessor,
};
use outbox_testkit::{MemoryDb, MemoryInboxStore, MemoryLog, MemoryOutboxStore, MemoryTx};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

/// Topic the demo publishes to.
pub const TOPIC: &str = "orders";
/// Name of the projection consumer.
pub const CONSUMER: &str = "order-projection";

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

/// The order service on the in-memory database.
#[derive(Clone, Debug)]
pub struct MemoryOrderService {
    db: MemoryDb,
    outbox: MemoryOutboxStore,
    clock: Arc<dyn Clock>,
}

impl MemoryOrderService {
    /// A service over `db`, appending to `outbox`.
    pub fn new(db: MemoryDb, outbox: MemoryOutboxStore) -> Self {
        let clock = db.clock();
        Self { db, outbox, clock }
    }

    /// Places an order: inserts it (version 1) and appends `order.placed` in one transaction.
    pub async fn place(&self, id: &str, note: &str) -> Result<Transition, StoreError> {
        let mut tx = self.db.begin();
        if tx.get("orders", id).is_some() {
            return Ok(Transition::Rejected(format!("order {id} exists")));
        }
        let order = Order {
            id: id.into(),
            status: "pending".into(),
            version: 1,
            note: note.into(),
        };
        self.write(tx, order, "order.placed").await
    }

    /// Moves an order `from` → `to` (a conditional transition: only from `from`), version + 1,
    /// and appends `event_type` in the same transaction. An invalid transition appends nothing.
    pub async fn transition(
        &self,
        id: &str,
        from: &str,
        to: &str,
        event_type: &str,
    ) -> Result<Transition, StoreError> {
        let mut tx = self.db.begin();
        let Some(current) = tx.get("orders", id) else {
            return Ok(Transition::Rejected(format!("order {id} does not exist")));
        };
        let mut order: Order = serde_json::from_value(current)
            .map_err(|e| StoreError::new(outbox_core::StoreErrorKind::Other, e.to_string()))?;
        if order.status != from {
            // Dropping `tx` rolls it back: no state change, no event.
            return Ok(Transition::Rejected(format!(
                "order {id} is {}, not {from}",
                order.status
            )));
        }
        order.status = to.into();
        order.version += 1;
        self.write(tx, order, event_type).await
    }

    async fn write(
        &self,
        mut tx: MemoryTx,
        order: Order,
        event_type: &str,
    ) -> Result<Transition, StoreError> {
        let event = Envelope::builder("order", &order.id, order.version, event_type)
            .json(&order)?
            .created_at(self.clock.now())
            .build()?;
        let id = event.event_id;
        tx.put(
            "orders",
            &order.id,
            serde_json::to_value(&order).expect("order serializes"),
        );
        // A validation error here fails the business change too.
        self.outbox.append(&mut tx, &[event]).await?;
        tx.commit()?;
        Ok(Transition::Applied(id))
    }

    /// The committed order.
    pub fn order(&self, id: &str) -> Option<Order> {
        self.db
            .read("orders", id)
            .and_then(|v| serde_json::from_value(v).ok())
    }
}

/// The projection: the consumer's view of each order, written in the inbox transaction.
#[derive(Debug, Default, Clone, Copy)]
pub struct Projection;

#[async_trait]
impl Handler<MemoryTx> for Projection {
    async fn handle(&self, tx: &mut MemoryTx, event: &Envelope) -> Result<(), HandlerError> {
        let order: Order = event
            .payload
            .to_json()
            .map_err(|e| HandlerError::permanent(e.to_string()))?;
        let seen = tx
            .get("projection", &order.id)
            .and_then(|v| v.get("version").and_then(serde_json::Value::as_i64))
            .unwrap_or(0);
        // Version check: exactly the next version, else the transaction rolls back.
        if event.aggregate_version != seen + 1 {
            return Err(HandlerError::transient(format!(
                "order {} at version {seen}, event has {}",
                order.id, event.aggregate_version
            )));
        }
        tx.put(
            "projection",
            &order.id,
            serde_json::json!({ "status": order.status, "version": event.aggregate_version }),
        );
        Ok(())
    }
}

/// Pending events whose aggregate has no parked event: work the relay still has to do.
fn pending_not_behind_parked(outbox: &MemoryOutboxStore) -> usize {
    let rows = outbox.snapshot();
    let parked: std::collections::HashSet<&str> = rows
        .iter()
        .filter(|r| r.status == DeliveryStatus::Parked)
        .map(|r| r.envelope.aggregate_id.as_str())
        .collect();
    rows.iter()
        .filter(|r| {
            r.status == DeliveryStatus::Pending
                && !parked.contains(r.envelope.aggregate_id.as_str())
        })
        .count()
}

/// What the demo did, for printing and for the test.
#[derive(Debug, Clone)]
pub struct DemoSummary {
    /// Events appended (committed).
    pub appended: usize,
    /// Business commands rejected (nothing appended).
    pub rejected: Vec<String>,
    /// Records the broker holds (duplicates included).
    pub records_in_log: usize,
    /// Distinct events in the log.
    pub distinct_published: usize,
    /// Events marked published in the outbox.
    pub marked_published: usize,
    /// Parked events with reasons.
    pub parked: Vec<ParkedEvent>,
    /// Events waiting behind a parked event of their aggregate.
    pub blocked_behind_parked: u64,
    /// Age of the oldest unpublished event (claimable or waiting), if any.
    pub oldest_unpublished_age: Option<Duration>,
    /// Consumer totals.
    pub consumer: EngineReport,
    /// Orders whose projection matches the order service's published state.
    pub projection_rows: usize,
    /// Relay cycles run.
    pub relay_cycles: u64,
    /// Publication attempts that failed transiently and were scheduled for retry.
    pub retried: u64,
    /// Age of the oldest parked event.
    pub oldest_parked_age: Option<Duration>,
}

/// Runs the in-memory demo.
pub async fn run_memory_demo(orders: usize) -> anyhow::Result<DemoSummary> {
    let db = MemoryDb::new(SystemClock);
    let outbox = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30))?);
    // A broker that takes records up to 2 KiB, like a topic with a small max.message.bytes.
    let log = MemoryLog::builder()
        .topic(TOPIC, 3)
        .default_topic(TOPIC)
        .max_record_bytes(2048)
        .delivery_timeout(Duration::from_secs(5))
        .build();
    let service = MemoryOrderService::new(db.clone(), outbox.clone());

    // 1. Business transactions.
    let mut appended = 0;
    let mut rejected = vec![];
    let mut count = |t: Transition| match t {
        Transition::Applied(_) => appended += 1,
        Transition::Rejected(why) => rejected.push(why),
    };
    for i in 0..orders {
        count(
            service
                .place(&format!("order-{i:03}"), "leave at the door")
                .await?,
        );
    }
    // The poison: a note so large the broker will refuse the record (permanent error).
    count(service.place("order-big", &"x".repeat(4096)).await?);
    for i in 0..orders {
        count(
            service
                .transition(
                    &format!("order-{i:03}"),
                    "pending",
                    "confirmed",
                    "order.confirmed",
                )
                .await?,
        );
    }
    // Invalid: confirming twice appends nothing.
    count(
        service
            .transition("order-000", "pending", "confirmed", "order.confirmed")
            .await?,
    );
    // order-big/2 is appended but must wait behind its parked head.
    count(
        service
            .transition("order-big", "pending", "confirmed", "order.confirmed")
            .await?,
    );

    // 2. Broker trouble: three transient failures, and two acks lost after the broker stored
    //    the records (they will be published twice).
    log.fail_next(3, PublishErrorKind::BrokerUnavailable);
    log.lose_ack_next(2);

    // 3. The relay drains the outbox.
    let config = RelayConfig::builder()
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
        .build()?;
    let mut relay = Relay::new(
        outbox.clone(),
        log.clone(),
        config,
        Arc::new(SystemClock),
        Box::new(StdRng::seed_from_u64(42)),
    )?;
    let mut relay_cycles = 0u64;
    let mut retried = 0u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let cycle = relay.run_once().await?;
        relay_cycles += 1;
        retried += cycle.retried as u64;
        if cycle.is_idle() && pending_not_behind_parked(&outbox) == 0 {
            // Only what waits behind a parked head is left.
            break;
        }
        if cycle.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "relay did not drain in 20 s"
        );
    }

    // 4. The projection consumer applies everything once.
    let inbox = MemoryInboxStore::new(&db);
    let source = log.consumer(CONSUMER, &[TOPIC]);
    let mut engine = ConsumerEngine::new(
        source,
        InboxProcessor::new(CONSUMER, inbox, Projection),
        EngineConfig::default().with_poll_timeout(Duration::from_millis(5)),
        7,
    )?;
    let consumer = engine.run_until_quiet(Duration::from_millis(100)).await?;

    // 5. Summary.
    let records = log.all_records();
    let distinct: std::collections::HashSet<_> = records
        .iter()
        .filter_map(|r| r.decode().ok().map(|e| e.event_id))
        .collect();
    let stats = outbox.stats().await?;
    let snapshot = outbox.snapshot();
    let marked_published = snapshot
        .iter()
        .filter(|r| r.status == DeliveryStatus::Published)
        .count();
    let parked = outbox.list_parked(100).await?;
    let blocked = stats.unpublished;
    let projection = db.scan("projection");
    let projection_rows = projection
        .iter()
        .filter(|(id, row)| {
            let published_version = snapshot
                .iter()
                .filter(|r| {
                    r.status == DeliveryStatus::Published && r.envelope.aggregate_id == **id
                })
                .map(|r| r.envelope.aggregate_version)
                .max();
            row.get("version").and_then(serde_json::Value::as_i64) == published_version
        })
        .count();
    Ok(DemoSummary {
        appended,
        rejected,
        records_in_log: records.len(),
        distinct_published: distinct.len(),
        marked_published,
        parked,
        blocked_behind_parked: blocked,
        oldest_unpublished_age: stats.oldest_unpublished_age,
        consumer,
        projection_rows,
        relay_cycles,
        retried,
        oldest_parked_age: stats.oldest_parked_age,
    })
}

impl std::fmt::Display for DemoSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "outbox demo (in-memory backends)")?;
        writeln!(
            f,
            "  events appended (committed with their state change): {}",
            self.appended
        )?;
        for r in &self.rejected {
            writeln!(f, "  rejected transition, nothing appended: {r}")?;
        }
        writeln!(
            f,
            "  published: {} events marked published, {} records in the log ({} distinct; {} duplicates from lost acks)",
            self.marked_published,
            self.records_in_log,
            self.distinct_published,
            self.records_in_log - self.distinct_published
        )?;
        writeln!(
            f,
            "  relay: {} cycles, {} transient failures retried with backoff",
            self.relay_cycles, self.retried
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
            "  waiting behind a parked event of their aggregate: {}",
            self.blocked_behind_parked
        )?;
        let age = |a: Option<Duration>| {
            a.map_or("none".to_string(), |d| format!("{:.3} s", d.as_secs_f64()))
        };
        writeln!(
            f,
            "  oldest unpublished age: {} (oldest parked: {})",
            age(self.oldest_unpublished_age),
            age(self.oldest_parked_age)
        )?;
        writeln!(
            f,
            "  consumer '{CONSUMER}': {} received, {} applied, {} duplicates absorbed, {} offset commits",
            self.consumer.received,
            self.consumer.applied,
            self.consumer.duplicates,
            self.consumer.commits
        )?;
        write!(
            f,
            "  projection rows matching the published state: {}",
            self.projection_rows
        )
    }
}
