//! [`MemoryInboxStore`]: the in-memory [`InboxStore`], sharing transactions with the business
//! data of a [`MemoryDb`].

use std::fmt;
use std::time::Duration;

use outbox_core::{async_trait, EventId, InboxStore, Registration, StoreError, StoreErrorKind};

use crate::db::{MemoryDb, MemoryTx};

/// The in-memory [`InboxStore`]. Registrations are staged in the [`MemoryTx`] and commit with the
/// effect's writes ([`MemoryTx::put`]).
///
/// * A pair committed before is [`Registration::Duplicate`]; so is a pair this same transaction
///   registered already (as PostgreSQL's `ON CONFLICT DO NOTHING` reports for its own row).
/// * Two open transactions may both see a pair as fresh; the second to commit fails with a
///   transient `Conflict`, so only one effect is ever committed.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use outbox_core::{EventId, InboxStore, Registration};
/// use outbox_testkit::{MemoryDb, MemoryInboxStore};
///
/// let db = MemoryDb::default();
/// let inbox = MemoryInboxStore::new(&db);
/// let id = EventId::from_parts(chrono::Utc::now(), 1);
/// let mut tx = inbox.begin().await.unwrap();
/// assert_eq!(inbox.register(&mut tx, "projection", id).await.unwrap(), Registration::Fresh);
/// tx.put("projection", "o-1", serde_json::json!({"seen": 1}));
/// inbox.commit(tx).await.unwrap();
/// let mut tx = inbox.begin().await.unwrap();
/// assert_eq!(inbox.register(&mut tx, "projection", id).await.unwrap(), Registration::Duplicate);
/// # });
/// ```
#[derive(Clone)]
pub struct MemoryInboxStore {
    db: MemoryDb,
}

impl fmt::Debug for MemoryInboxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryInboxStore").finish_non_exhaustive()
    }
}

impl MemoryInboxStore {
    /// An inbox over `db`.
    pub fn new(db: &MemoryDb) -> Self {
        Self { db: db.clone() }
    }

    /// The database.
    pub fn db(&self) -> &MemoryDb {
        &self.db
    }

    /// Whether `(consumer, event_id)` is committed.
    pub fn is_registered(&self, consumer: &str, event_id: EventId) -> bool {
        self.db
            .lock()
            .inbox
            .contains_key(&(consumer.to_owned(), event_id))
    }

    /// Committed registrations of `consumer`.
    pub fn registrations(&self, consumer: &str) -> Vec<EventId> {
        self.db
            .lock()
            .inbox
            .keys()
            .filter(|(c, _)| c == consumer)
            .map(|(_, id)| *id)
            .collect()
    }
}

#[async_trait]
impl InboxStore for MemoryInboxStore {
    type Tx = MemoryTx;

    async fn begin(&self) -> Result<MemoryTx, StoreError> {
        Ok(self.db.begin())
    }

    async fn register(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        event_id: EventId,
    ) -> Result<Registration, StoreError> {
        if consumer.trim().is_empty() {
            return Err(StoreError::new(
                StoreErrorKind::Validation,
                "consumer name must not be empty",
            ));
        }
        if !std::sync::Arc::ptr_eq(&tx.db().shared, &self.db.shared) {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "the transaction belongs to another MemoryDb",
            ));
        }
        let key = (consumer.to_owned(), event_id);
        if self.db.lock().inbox.contains_key(&key) || tx.inbox.contains(&key) {
            return Ok(Registration::Duplicate);
        }
        tx.inbox.push(key);
        Ok(Registration::Fresh)
    }

    async fn commit(&self, tx: MemoryTx) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn rollback(&self, tx: MemoryTx) -> Result<(), StoreError> {
        tx.rollback();
        Ok(())
    }

    async fn cleanup(&self, retention: Duration, batch_size: usize) -> Result<u64, StoreError> {
        if batch_size == 0 {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "cleanup batch size must be at least 1",
            ));
        }
        let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
        let mut removed = 0u64;
        loop {
            let now = self.db.now();
            let mut st = self.db.lock();
            let victims: Vec<(String, EventId)> = st
                .inbox
                .iter()
                .filter(|(_, at)| at.checked_add_signed(retention).is_some_and(|d| d <= now))
                .map(|(k, _)| k.clone())
                .take(batch_size)
                .collect();
            for k in &victims {
                st.inbox.remove(k);
            }
            removed += victims.len() as u64;
            if victims.len() < batch_size {
                return Ok(removed);
            }
        }
    }
}
