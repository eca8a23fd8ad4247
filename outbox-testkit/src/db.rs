//! [`MemoryDb`]: an in-memory database with explicit transactions.
//!
//! Committed state lives in the database; everything a transaction does (outbox appends, inbox
//! registrations, business writes) is staged in its [`MemoryTx`] and applied atomically by
//! [`MemoryTx::commit`]. Dropping a transaction rolls it back, which is how a crash of the
//! process holding it is modelled: durable state is exactly what was committed.
//!
//! Business reads are validated optimistically: if a key the transaction read was changed by
//! another commit in the meantime, the commit fails with a transient
//! [`StoreErrorKind::Conflict`] (what PostgreSQL reports as a serialization failure), so the
//! caller retries the whole transaction.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use outbox_core::{Clock, EventId, StoreError, StoreErrorKind};
use serde_json::Value;

use crate::clock::ManualClock;
use crate::outbox::{OutboxState, StagedRow};

#[derive(Debug, Clone)]
struct KvEntry {
    value: Option<Value>,
    version: u64,
}

#[derive(Debug, Default)]
pub(crate) struct DbState {
    kv: HashMap<(String, String), KvEntry>,
    commit_counter: u64,
    next_seq: u64,
    pub(crate) outbox: OutboxState,
    /// Committed inbox registrations: (consumer, event id) -> registration time.
    pub(crate) inbox: BTreeMap<(String, EventId), DateTime<Utc>>,
    /// The aggregate each registration was made for (absent: registered without one).
    pub(crate) inbox_aggregates: BTreeMap<(String, EventId), outbox_core::AggregateKey>,
    /// Consumer versions, parked messages and their audit.
    pub(crate) consumer: crate::inbox::ConsumerState,
    counters: TxCounters,
}

/// Transaction counters of a [`MemoryDb`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TxCounters {
    /// Transactions committed.
    pub committed: u64,
    /// Transactions rolled back (explicitly or by drop).
    pub rolled_back: u64,
    /// Commits refused with a conflict or constraint error.
    pub failed: u64,
}

pub(crate) struct DbShared {
    pub(crate) state: Mutex<DbState>,
    pub(crate) clock: Arc<dyn Clock>,
}

/// An in-memory database shared by [`crate::MemoryOutboxStore`], [`crate::MemoryInboxStore`] and
/// business code. Cloning gives another handle to the same database.
///
/// ```
/// use outbox_testkit::{ManualClock, MemoryDb};
/// use serde_json::json;
///
/// let db = MemoryDb::new(ManualClock::default());
/// let mut tx = db.begin();
/// tx.put("orders", "o-1", json!({"status": "pending", "version": 1}));
/// assert_eq!(db.read("orders", "o-1"), None); // not committed yet
/// tx.commit().unwrap();
/// assert_eq!(db.read("orders", "o-1").unwrap()["status"], "pending");
///
/// // Optimistic validation: a key read by a transaction changed before it committed.
/// let mut a = db.begin();
/// let mut b = db.begin();
/// let _ = a.get("orders", "o-1");
/// let _ = b.get("orders", "o-1");
/// a.put("orders", "o-1", json!({"status": "confirmed", "version": 2}));
/// b.put("orders", "o-1", json!({"status": "cancelled", "version": 2}));
/// a.commit().unwrap();
/// let err = b.commit().unwrap_err();
/// assert_eq!(err.kind, outbox_core::StoreErrorKind::Conflict);
/// ```
#[derive(Clone)]
pub struct MemoryDb {
    pub(crate) shared: Arc<DbShared>,
}

impl fmt::Debug for MemoryDb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryDb")
            .field("clock", &self.shared.clock)
            .finish_non_exhaustive()
    }
}

impl Default for MemoryDb {
    /// A database on a fresh [`ManualClock`].
    fn default() -> Self {
        Self::new(ManualClock::default())
    }
}

impl MemoryDb {
    /// A database whose timestamps (append time, leases, retention) come from `clock`.
    pub fn new(clock: impl Clock + 'static) -> Self {
        Self::with_shared_clock(Arc::new(clock))
    }

    /// A database on an already shared clock.
    pub fn with_shared_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            shared: Arc::new(DbShared {
                state: Mutex::new(DbState::default()),
                clock,
            }),
        }
    }

    /// The database's clock.
    pub fn clock(&self) -> Arc<dyn Clock> {
        self.shared.clock.clone()
    }

    pub(crate) fn now(&self) -> DateTime<Utc> {
        self.shared.clock.now()
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, DbState> {
        // A panic while holding the lock (a failed assertion in a test) must not hide the
        // state from the report that follows.
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Begins a transaction.
    pub fn begin(&self) -> MemoryTx {
        MemoryTx {
            db: self.clone(),
            reads: HashMap::new(),
            writes: BTreeMap::new(),
            outbox: Vec::new(),
            inbox: Vec::new(),
            inbox_aggregates: Vec::new(),
            consumer_ops: Vec::new(),
            consumer_locks: Vec::new(),
            finished: false,
        }
    }

    /// The committed value of `table`/`key`.
    pub fn read(&self, table: &str, key: &str) -> Option<Value> {
        self.lock()
            .kv
            .get(&(table.to_owned(), key.to_owned()))
            .and_then(|e| e.value.clone())
    }

    /// All committed keys and values of `table`, ordered by key.
    pub fn scan(&self, table: &str) -> BTreeMap<String, Value> {
        self.lock()
            .kv
            .iter()
            .filter(|((t, _), _)| t == table)
            .filter_map(|((_, k), e)| e.value.clone().map(|v| (k.clone(), v)))
            .collect()
    }

    /// Transaction counters.
    pub fn counters(&self) -> TxCounters {
        self.lock().counters
    }

    pub(crate) fn next_seq(&self) -> u64 {
        let mut st = self.lock();
        st.next_seq += 1;
        st.next_seq
    }
}

/// A transaction on a [`MemoryDb`]: staged outbox appends, staged inbox registrations and
/// business reads/writes, applied atomically by [`commit`](Self::commit). Dropping it rolls it
/// back.
pub struct MemoryTx {
    db: MemoryDb,
    /// Version of each key when this transaction first read it (0: absent).
    reads: HashMap<(String, String), u64>,
    writes: BTreeMap<(String, String), Option<Value>>,
    pub(crate) outbox: Vec<StagedRow>,
    pub(crate) inbox: Vec<(String, EventId)>,
    /// The aggregate of each staged registration made for one.
    pub(crate) inbox_aggregates: Vec<((String, EventId), outbox_core::AggregateKey)>,
    pub(crate) consumer_ops: Vec<crate::inbox::ConsumerOp>,
    pub(crate) consumer_locks: Vec<(String, outbox_core::AggregateKey, u64)>,
    finished: bool,
}

impl fmt::Debug for MemoryTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryTx")
            .field("reads", &self.reads.len())
            .field("writes", &self.writes.len())
            .field("outbox", &self.outbox.len())
            .field("inbox", &self.inbox.len())
            .field("consumer_ops", &self.consumer_ops.len())
            .finish()
    }
}

impl MemoryTx {
    /// The database this transaction belongs to.
    pub fn db(&self) -> &MemoryDb {
        &self.db
    }

    /// Reads `table`/`key`: this transaction's own write if any, else the committed value. The
    /// key's version is remembered and validated at commit.
    pub fn get(&mut self, table: &str, key: &str) -> Option<Value> {
        let k = (table.to_owned(), key.to_owned());
        if let Some(v) = self.writes.get(&k) {
            return v.clone();
        }
        let st = self.db.lock();
        let entry = st.kv.get(&k).cloned();
        drop(st);
        let version = entry.as_ref().map_or(0, |e| e.version);
        self.reads.entry(k).or_insert(version);
        entry.and_then(|e| e.value)
    }

    /// Writes `table`/`key` (visible to others after commit).
    pub fn put(&mut self, table: &str, key: &str, value: Value) {
        self.writes
            .insert((table.to_owned(), key.to_owned()), Some(value));
    }

    /// Deletes `table`/`key`.
    pub fn delete(&mut self, table: &str, key: &str) {
        self.writes.insert((table.to_owned(), key.to_owned()), None);
    }

    /// Number of outbox events staged in this transaction.
    pub fn staged_events(&self) -> usize {
        self.outbox.len()
    }

    /// Commits atomically.
    ///
    /// Fails with a transient `Conflict` when a key this transaction read was changed by another
    /// commit since, or when another transaction committed the same inbox registration first;
    /// fails with a permanent `Constraint` when another transaction committed an event with the
    /// same id. On failure nothing is applied.
    pub fn commit(mut self) -> Result<(), StoreError> {
        self.finished = true;
        let now = self.db.now();
        let mut st = self.db.lock();
        let check = (|| {
            for (k, read_version) in &self.reads {
                let current = st.kv.get(k).map_or(0, |e| e.version);
                if current != *read_version {
                    return Err(StoreError::new(
                        StoreErrorKind::Conflict,
                        format!(
                            "serialization conflict: {}/{} changed since it was read",
                            k.0, k.1
                        ),
                    ));
                }
            }
            for (consumer, id) in &self.inbox {
                if st.inbox.contains_key(&(consumer.clone(), *id)) {
                    return Err(StoreError::new(
                        StoreErrorKind::Conflict,
                        format!(
                            "event {id} was registered for consumer {consumer} by a concurrent transaction"
                        ),
                    ));
                }
            }
            for row in &self.outbox {
                if st.outbox.contains_event(row.envelope.event_id) {
                    return Err(StoreError::new(
                        StoreErrorKind::Constraint,
                        format!("duplicate event id {}", row.envelope.event_id),
                    ));
                }
            }
            let ops = std::mem::take(&mut self.consumer_ops);
            crate::inbox::commit_ops(&mut st.consumer, &self.consumer_locks, &ops, now)
        })();
        if let Err(e) = check {
            st.counters.failed += 1;
            st.counters.rolled_back += 1;
            return Err(e);
        }
        st.commit_counter += 1;
        let version = st.commit_counter;
        for (k, v) in std::mem::take(&mut self.writes) {
            st.kv.insert(k, KvEntry { value: v, version });
        }
        for key in std::mem::take(&mut self.inbox) {
            st.inbox.insert(key, now);
        }
        for (key, aggregate) in std::mem::take(&mut self.inbox_aggregates) {
            st.inbox_aggregates.insert(key, aggregate);
        }
        for row in std::mem::take(&mut self.outbox) {
            st.outbox.insert_committed(row, now);
        }
        st.counters.committed += 1;
        Ok(())
    }

    /// Rolls back: nothing staged remains.
    pub fn rollback(mut self) {
        self.finish_rollback();
    }

    fn finish_rollback(&mut self) {
        if !self.finished {
            self.finished = true;
            self.db.lock().counters.rolled_back += 1;
        }
    }
}

impl Drop for MemoryTx {
    fn drop(&mut self) {
        self.finish_rollback();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn own_writes_visible_and_rollback_discards() {
        let db = MemoryDb::default();
        let mut tx = db.begin();
        assert_eq!(tx.get("t", "k"), None);
        tx.put("t", "k", json!(1));
        assert_eq!(tx.get("t", "k"), Some(json!(1)));
        tx.rollback();
        assert_eq!(db.read("t", "k"), None);
        {
            let mut tx = db.begin();
            tx.put("t", "k", json!(2));
        } // dropped: rolled back
        assert_eq!(db.read("t", "k"), None);
        assert_eq!(db.counters().rolled_back, 2);
        let mut tx = db.begin();
        tx.put("t", "k", json!(3));
        tx.commit().unwrap();
        assert_eq!(db.read("t", "k"), Some(json!(3)));
        assert_eq!(db.scan("t").len(), 1);
        let mut tx = db.begin();
        tx.delete("t", "k");
        tx.commit().unwrap();
        assert_eq!(db.read("t", "k"), None);
    }

    #[test]
    fn read_of_absent_key_conflicts_with_concurrent_insert() {
        let db = MemoryDb::default();
        let mut a = db.begin();
        let mut b = db.begin();
        assert_eq!(a.get("t", "k"), None);
        b.put("t", "k", json!("b"));
        b.commit().unwrap();
        a.put("t", "k", json!("a"));
        let err = a.commit().unwrap_err();
        assert_eq!(err.kind, StoreErrorKind::Conflict);
        assert_eq!(db.read("t", "k"), Some(json!("b")));
        assert_eq!(db.counters().failed, 1);
    }

    #[test]
    fn blind_writes_do_not_conflict() {
        let db = MemoryDb::default();
        let mut a = db.begin();
        let mut b = db.begin();
        a.put("t", "k", json!("a"));
        b.put("t", "k", json!("b"));
        a.commit().unwrap();
        b.commit().unwrap();
        assert_eq!(db.read("t", "k"), Some(json!("b")));
    }
}
