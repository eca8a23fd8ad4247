//! The demo on the in-memory backends of `outbox-testkit`.

use std::time::Duration;

use outbox_core::{async_trait, ClaimMode, Envelope, StoreError, StoreErrorKind, SystemClock};
use outbox_inbox::{Handler, HandlerError};
use outbox_testkit::{
    MemoryConsumer, MemoryDb, MemoryInboxStore, MemoryLog, MemoryOutboxStore, MemoryTx,
};

use crate::{Order, OrderService, Transition, CONSUMER, MAX_RECORD_BYTES};

/// Topic of the in-memory log.
pub const TOPIC: &str = "orders";

/// The in-memory database, outbox and inbox.
#[derive(Debug, Clone)]
pub struct MemoryBackend {
    /// The database.
    pub db: MemoryDb,
    /// The outbox.
    pub store: MemoryOutboxStore,
    /// The inbox (same database as the projection).
    pub inbox: MemoryInboxStore,
    /// The order service.
    pub service: MemoryOrderService,
}

impl MemoryBackend {
    /// A fresh in-memory backend on the system clock.
    pub fn new() -> Result<Self, outbox_core::ConfigError> {
        let db = MemoryDb::new(SystemClock);
        let store = MemoryOutboxStore::new(&db, ClaimMode::lease(Duration::from_secs(30))?);
        let inbox = MemoryInboxStore::new(&db);
        let service = MemoryOrderService {
            db: db.clone(),
            outbox: store.clone(),
        };
        Ok(Self {
            db,
            store,
            inbox,
            service,
        })
    }
}

/// An in-memory log (3 partitions, small record limit) and a consumer of it.
pub fn log_and_source() -> (MemoryLog, MemoryConsumer) {
    let log = MemoryLog::builder()
        .topic(TOPIC, 3)
        .default_topic(TOPIC)
        .max_record_bytes(MAX_RECORD_BYTES)
        .delivery_timeout(Duration::from_secs(5))
        .build();
    let source = log.consumer(CONSUMER, &[TOPIC]);
    (log, source)
}

/// The order service on the in-memory database.
#[derive(Clone, Debug)]
pub struct MemoryOrderService {
    db: MemoryDb,
    outbox: MemoryOutboxStore,
}

impl MemoryOrderService {
    async fn write(
        &self,
        mut tx: MemoryTx,
        order: Order,
        event_type: &str,
    ) -> Result<Transition, StoreError> {
        let event = Envelope::builder("order", &order.id, order.version, event_type)
            .json(&order)?
            .created_at(crate::now())
            .build()?;
        let id = event.event_id;
        tx.put("orders", &order.id, to_value(&order));
        // A validation or backpressure error here fails the business change too.
        outbox_core::AppendStore::append(&self.outbox, &mut tx, &[event]).await?;
        tx.commit()?;
        Ok(Transition::Applied(id))
    }
}

fn to_value(order: &Order) -> serde_json::Value {
    serde_json::to_value(order).expect("an order serializes")
}

#[async_trait]
impl OrderService for MemoryOrderService {
    async fn place(&self, id: &str, note: &str) -> Result<Transition, StoreError> {
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

    async fn transition(
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
            .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
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

    async fn projection_matches(&self) -> Result<usize, StoreError> {
        let projection = self.db.scan("projection");
        Ok(self
            .db
            .scan("orders")
            .iter()
            .filter(|(id, order)| {
                projection.get(*id).and_then(|p| p.get("version")) == order.get("version")
            })
            .count())
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
        // Version check: exactly the next version, else the whole transaction rolls back.
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
