//! [`MemoryInboxStore`]: the in-memory [`InboxStore`] and [`InboxParking`], sharing
//! transactions with the business data of a [`MemoryDb`].

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::{
    async_trait, AggregateKey, AggregateRegistration, AggregateState, EventId, InboxAuditEntry,
    InboxParking, InboxStore, NewParkedMessage, ParkAs, ParkedChange, ParkedFilter, ParkedId,
    ParkedMessage, ParkedStats, ParkedStatus, Parking, Registration, RetryRequest, StoreError,
    StoreErrorKind, VersionAdvance,
};

use crate::db::{MemoryDb, MemoryTx};

/// Per-aggregate state of one consumer.
#[derive(Clone, Debug, Default)]
pub(crate) struct AggRow {
    applied: Option<i64>,
    blocked: bool,
    /// Bumped by every write that changes what is parked for the aggregate (the row lock of
    /// [`InboxParking::open_parked_of`], validated optimistically at commit).
    revision: u64,
}

/// Committed consumer-side state besides registrations.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConsumerState {
    aggregates: HashMap<(String, AggregateKey), AggRow>,
    parked: BTreeMap<i64, ParkedMessage>,
    next_parked: i64,
    audit: Vec<InboxAuditEntry>,
}

/// A write staged in a [`MemoryTx`], validated and applied at commit.
#[derive(Clone, Debug)]
pub(crate) enum ConsumerOp {
    Advance(String, VersionAdvance),
    Park {
        consumer: String,
        message: Box<NewParkedMessage>,
        id: i64,
        waiting: bool,
    },
    Change(String, i64, ParkedChange),
    Unblock(String, AggregateKey),
    Audit(InboxAuditEntry),
    RequestRetry(String, i64, RetryRequest),
    ClearRetryRequest(String, i64, DateTime<Utc>),
}

fn conflict(message: impl Into<String>) -> StoreError {
    StoreError::new(StoreErrorKind::Conflict, message)
}

impl ConsumerState {
    fn row(&self, consumer: &str, key: &AggregateKey) -> AggRow {
        self.aggregates
            .get(&(consumer.to_owned(), key.clone()))
            .cloned()
            .unwrap_or_default()
    }

    fn revision(&self, consumer: &str, key: &AggregateKey) -> u64 {
        self.row(consumer, key).revision
    }

    fn row_mut(&mut self, consumer: &str, key: &AggregateKey) -> &mut AggRow {
        self.aggregates
            .entry((consumer.to_owned(), key.clone()))
            .or_default()
    }

    /// `m` as it is parked: under its aggregate-scoped dedup id when a parked message of
    /// another aggregate holds its dedup id (a record naming another aggregate's event as its
    /// original, or the event such a record named), and under an id of its position and
    /// content when a parked message of another aggregate holds that too (a record whose event
    /// id was made to be that scoped id), as the PostgreSQL store does. An undecodable record
    /// whose derived dedup id (its transport's message identity) a parked message of an
    /// aggregate holds (only one whose event id was made to be that id can) is parked under
    /// an id of its position and content too: it is another message, never hidden by it.
    fn as_parked(&self, consumer: &str, m: &NewParkedMessage) -> NewParkedMessage {
        let mut m = m.clone();
        if let (Some(id), None, None) = (m.record.dedup_id, &m.record.aggregate, m.record.event_id)
        {
            let held_by_an_aggregate = self.parked.values().any(|p| {
                p.consumer == consumer
                    && p.record.dedup_id == Some(id)
                    && p.record.aggregate.is_some()
            });
            if held_by_an_aggregate {
                m.record.dedup_id = Some(content_id(&m.record));
            }
            return m;
        }
        if let (Some(id), Some(key)) = (m.record.dedup_id, m.record.aggregate.clone()) {
            let other = |id: EventId| {
                self.parked.values().any(|p| {
                    p.consumer == consumer
                        && p.record.dedup_id == Some(id)
                        && p.record.aggregate.as_ref() != Some(&key)
                })
            };
            if other(id) {
                let scoped = outbox_core::inbox::scoped_dedup_id(&key, id);
                m.record.dedup_id = Some(if other(scoped) {
                    content_id(&m.record)
                } else {
                    scoped
                });
            }
        }
        m
    }

    fn already_parked(&self, consumer: &str, m: &NewParkedMessage) -> bool {
        self.parked.values().any(|p| {
            p.consumer == consumer
                && match m.record.dedup_id {
                    Some(id) => p.record.dedup_id == Some(id),
                    None => p.record.dedup_id.is_none() && p.record.position == m.record.position,
                }
        })
    }

    fn open_of(&self, consumer: &str, key: &AggregateKey) -> Vec<&ParkedMessage> {
        let mut open: Vec<&ParkedMessage> = self
            .parked
            .values()
            .filter(|p| {
                p.consumer == consumer
                    && p.status.is_open()
                    && p.record.aggregate.as_ref() == Some(key)
            })
            .collect();
        open.sort_by_key(|p| (p.record.aggregate_version.unwrap_or(i64::MIN), p.id));
        open
    }

    /// Validates and applies one op.
    fn apply(&mut self, op: &ConsumerOp, now: DateTime<Utc>) -> Result<(), StoreError> {
        match op {
            ConsumerOp::Advance(consumer, adv) => {
                let row = self.row_mut(consumer, &adv.aggregate);
                if row.applied != adv.expected {
                    return Err(conflict(format!(
                        "applied version of {} moved from {:?} to {:?} concurrently",
                        adv.aggregate, adv.expected, row.applied
                    )));
                }
                row.applied = Some(adv.version);
            }
            ConsumerOp::Park {
                consumer,
                message,
                id,
                waiting,
            } => {
                if self.already_parked(consumer, message) {
                    return Err(conflict(format!(
                        "message at {} was parked concurrently",
                        message.record.position
                    )));
                }
                let kind = match message.park_as {
                    ParkAs::Head(kind) if !waiting => Some(kind),
                    _ => None,
                };
                if let Some(key) = &message.record.aggregate {
                    let row = self.row_mut(consumer, key);
                    match (waiting, row.blocked) {
                        (true, false) => {
                            return Err(conflict(format!(
                                "aggregate {key} was released before the message at {} could \
                                 wait behind it; apply it instead",
                                message.record.position
                            )))
                        }
                        (false, true) => {
                            return Err(conflict(format!(
                                "aggregate {key} was blocked concurrently"
                            )))
                        }
                        _ => {}
                    }
                    row.blocked = true;
                    row.revision += 1;
                }
                let status = if *waiting {
                    ParkedStatus::Waiting
                } else {
                    ParkedStatus::Parked
                };
                self.parked.insert(
                    *id,
                    ParkedMessage::new(
                        ParkedId(*id),
                        consumer.clone(),
                        message.record.clone(),
                        status,
                        kind,
                        message.reason.clone(),
                        message.attempts,
                        now,
                        None,
                    ),
                );
            }
            ConsumerOp::Change(consumer, id, change) => {
                let p = self
                    .parked
                    .get_mut(id)
                    .filter(|p| p.consumer == *consumer && p.status.is_open())
                    .ok_or_else(|| conflict(format!("parked message {id} is no longer open")))?;
                match change {
                    ParkedChange::Resolved(status) => {
                        p.status = *status;
                        p.resolved_at = Some(now);
                        p.retry_request = None;
                    }
                    ParkedChange::Failed {
                        kind,
                        reason,
                        attempts,
                    } => {
                        p.status = ParkedStatus::Parked;
                        p.kind = Some(*kind);
                        p.reason = reason.clone();
                        p.attempts = *attempts;
                    }
                }
                if let Some(key) = p.record.aggregate.clone() {
                    self.row_mut(consumer, &key).revision += 1;
                }
            }
            ConsumerOp::Unblock(consumer, key) => {
                if !self.open_of(consumer, key).is_empty() {
                    return Err(conflict(format!(
                        "aggregate {key} still has open parked messages"
                    )));
                }
                let row = self.row_mut(consumer, key);
                row.blocked = false;
                row.revision += 1;
            }
            ConsumerOp::Audit(entry) => {
                let mut e = entry.clone();
                e.at = now;
                self.audit.push(e);
            }
            ConsumerOp::RequestRetry(consumer, id, request) => {
                let p = self
                    .parked
                    .get_mut(id)
                    .filter(|p| p.consumer == *consumer && p.status.is_open())
                    .ok_or_else(|| conflict(format!("parked message {id} is no longer open")))?;
                p.retry_request = Some(request.clone());
            }
            ConsumerOp::ClearRetryRequest(consumer, id, at) => {
                if let Some(p) = self.parked.get_mut(id).filter(|p| p.consumer == *consumer) {
                    if p.retry_request
                        .as_ref()
                        .is_some_and(|r| r.requested_at <= *at)
                    {
                        p.retry_request = None;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Validates and applies the consumer ops of a committing transaction to `state`. On error,
/// `state` is unchanged.
pub(crate) fn commit_ops(
    state: &mut ConsumerState,
    locks: &[(String, AggregateKey, u64)],
    ops: &[ConsumerOp],
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    for (consumer, key, revision) in locks {
        if state.revision(consumer, key) != *revision {
            return Err(conflict(format!(
                "parked messages of {key} changed since this transaction read them"
            )));
        }
    }
    if ops.is_empty() {
        return Ok(());
    }
    let mut scratch = state.clone();
    for op in ops {
        scratch.apply(op, now)?;
    }
    *state = scratch;
    Ok(())
}

/// The in-memory [`InboxStore`] and [`InboxParking`]. Everything is staged in the
/// [`MemoryTx`] and commits with the effect's writes ([`MemoryTx::put`]).
///
/// * A pair committed before is [`Registration::Duplicate`]; so is a pair this same transaction
///   registered already (as PostgreSQL's `ON CONFLICT DO NOTHING` reports for its own row).
/// * [`InboxStore::register_for`] keeps each registration's aggregate beside it: an id held by
///   another aggregate is [`AggregateRegistration::OtherAggregate`].
/// * Two open transactions may both see a pair as fresh; the second to commit fails with a
///   transient `Conflict`, so only one effect is ever committed. Version advances, parking and
///   operator writes are validated the same way (optimistically, at commit).
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// use outbox_core::{EventId, InboxStore, InboxStoreExt, Registration};
/// use outbox_testkit::{MemoryDb, MemoryInboxStore};
///
/// let db = MemoryDb::default();
/// let inbox = MemoryInboxStore::new(&db);
/// let id = EventId::from_parts(chrono::Utc::now(), 1);
/// let mut tx = inbox.begin().await.unwrap();
/// assert_eq!(inbox.register_one(&mut tx, "projection", id).await.unwrap(), Registration::Fresh);
/// tx.put("projection", "o-1", serde_json::json!({"seen": 1}));
/// inbox.commit(tx).await.unwrap();
/// let mut tx = inbox.begin().await.unwrap();
/// assert_eq!(inbox.register_one(&mut tx, "projection", id).await.unwrap(), Registration::Duplicate);
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

fn check_consumer(consumer: &str) -> Result<(), StoreError> {
    if consumer.trim().is_empty() {
        return Err(StoreError::new(
            StoreErrorKind::Validation,
            "consumer name must not be empty",
        ));
    }
    Ok(())
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

    /// The committed applied version of an aggregate for `consumer`.
    pub fn applied_version(&self, consumer: &str, aggregate: &AggregateKey) -> Option<i64> {
        self.db.lock().consumer.row(consumer, aggregate).applied
    }

    fn check_tx(&self, tx: &MemoryTx) -> Result<(), StoreError> {
        if !std::sync::Arc::ptr_eq(&tx.db().shared, &self.db.shared) {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "the transaction belongs to another MemoryDb",
            ));
        }
        Ok(())
    }

    /// The consumer state as `tx` sees it (committed state plus its staged writes).
    fn view(&self, tx: &MemoryTx) -> ConsumerState {
        let mut state = self.db.lock().consumer.clone();
        let now = self.db.now();
        for op in &tx.consumer_ops {
            // A staged op that would fail at commit is ignored here; the commit reports it.
            let _ = state.apply(op, now);
        }
        state
    }

    fn with_view<T>(&self, tx: &MemoryTx, f: impl FnOnce(&ConsumerState) -> T) -> T {
        if tx.consumer_ops.is_empty() {
            f(&self.db.lock().consumer)
        } else {
            f(&self.view(tx))
        }
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
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let st = self.db.lock();
        Ok(ids
            .iter()
            .map(|id| {
                let key = (consumer.to_owned(), *id);
                if st.inbox.contains_key(&key) || tx.inbox.contains(&key) {
                    Registration::Duplicate
                } else {
                    tx.inbox.push(key);
                    Registration::Fresh
                }
            })
            .collect())
    }

    async fn register_for(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        events: &[(EventId, AggregateKey)],
    ) -> Result<Vec<AggregateRegistration>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let st = self.db.lock();
        Ok(events
            .iter()
            .map(|(id, aggregate)| {
                let key = (consumer.to_owned(), *id);
                let registered = st.inbox.contains_key(&key) || tx.inbox.contains(&key);
                if !registered {
                    tx.inbox.push(key.clone());
                    tx.inbox_aggregates.push((key, aggregate.clone()));
                    return AggregateRegistration::Fresh;
                }
                let holder = tx
                    .inbox_aggregates
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, a)| a)
                    .or_else(|| st.inbox_aggregates.get(&key));
                match holder {
                    Some(a) if a != aggregate => AggregateRegistration::OtherAggregate,
                    _ => AggregateRegistration::Duplicate,
                }
            })
            .collect())
    }

    async fn aggregates(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        aggregates: &[AggregateKey],
    ) -> Result<Vec<AggregateState>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        Ok(self.with_view(tx, |state| {
            aggregates
                .iter()
                .map(|k| {
                    let row = state.row(consumer, k);
                    AggregateState::new(row.applied, row.blocked)
                })
                .collect()
        }))
    }

    async fn advance_versions(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let mismatch = self.with_view(tx, |state| {
            updates.iter().find_map(|u| {
                let now = state.row(consumer, &u.aggregate).applied;
                (now != u.expected).then(|| (u.clone(), now))
            })
        });
        if let Some((u, now)) = mismatch {
            return Err(conflict(format!(
                "applied version of {} is {now:?}, not the expected {:?}",
                u.aggregate, u.expected
            )));
        }
        tx.consumer_ops.extend(
            updates
                .iter()
                .map(|u| ConsumerOp::Advance(consumer.to_owned(), u.clone())),
        );
        Ok(())
    }

    async fn park(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        messages: &[NewParkedMessage],
    ) -> Result<Vec<Parking>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            let view = self.view(tx);
            let m = &view.as_parked(consumer, m);
            if view.already_parked(consumer, m) {
                out.push(Parking::AlreadyParked);
                continue;
            }
            let blocked = m
                .record
                .aggregate
                .as_ref()
                .is_some_and(|k| view.row(consumer, k).blocked);
            let waiting = match m.park_as {
                ParkAs::Waiting => {
                    if !blocked {
                        return Err(conflict(format!(
                            "aggregate {:?} is not blocked: the message at {} cannot wait",
                            m.record.aggregate, m.record.position
                        )));
                    }
                    true
                }
                ParkAs::Head(_) => blocked,
            };
            let id = {
                let mut st = self.db.lock();
                st.consumer.next_parked += 1;
                st.consumer.next_parked
            };
            tx.consumer_ops.push(ConsumerOp::Park {
                consumer: consumer.to_owned(),
                message: Box::new(m.clone()),
                id,
                waiting,
            });
            out.push(if waiting {
                Parking::Waiting(ParkedId(id))
            } else {
                Parking::Head(ParkedId(id))
            });
        }
        Ok(out)
    }

    async fn commit(&self, tx: MemoryTx) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn rollback(&self, tx: MemoryTx) -> Result<(), StoreError> {
        tx.rollback();
        Ok(())
    }

    async fn cleanup(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError> {
        if batch_size == 0 {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "cleanup batch size must be at least 1",
            ));
        }
        let retention = chrono::Duration::from_std(retention).unwrap_or(chrono::Duration::MAX);
        let now = self.db.now();
        let mut st = self.db.lock();
        let victims: Vec<(String, EventId)> = st
            .inbox
            .iter()
            .filter(|((c, _), at)| {
                c == consumer && at.checked_add_signed(retention).is_some_and(|d| d <= now)
            })
            .map(|(k, _)| k.clone())
            .take(batch_size)
            .collect();
        for k in &victims {
            st.inbox.remove(k);
            st.inbox_aggregates.remove(k);
        }
        Ok(victims.len() as u64)
    }
}

#[async_trait]
impl InboxParking for MemoryInboxStore {
    async fn list_parked(
        &self,
        consumer: &str,
        filter: &ParkedFilter,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let st = self.db.lock();
        Ok(st
            .consumer
            .parked
            .values()
            .filter(|p| p.consumer == consumer)
            .filter(|p| !filter.open_only || p.status.is_open())
            .filter(|p| {
                filter
                    .aggregate
                    .as_ref()
                    .is_none_or(|a| p.record.aggregate.as_ref() == Some(a))
            })
            .take(filter.limit)
            .cloned()
            .collect())
    }

    async fn parked_message(
        &self,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        Ok(self
            .db
            .lock()
            .consumer
            .parked
            .get(&id.0)
            .filter(|p| p.consumer == consumer)
            .cloned())
    }

    async fn open_parked_of(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let revision = self.db.lock().consumer.revision(consumer, aggregate);
        tx.consumer_locks
            .push((consumer.to_owned(), aggregate.clone(), revision));
        Ok(self.with_view(tx, |s| {
            s.open_of(consumer, aggregate)
                .into_iter()
                .cloned()
                .collect()
        }))
    }

    async fn parked_in(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        id: ParkedId,
    ) -> Result<Option<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        Ok(self.with_view(tx, |s| {
            s.parked
                .get(&id.0)
                .filter(|p| p.consumer == consumer)
                .cloned()
        }))
    }

    async fn change_parked(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        id: ParkedId,
        change: &ParkedChange,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        if let ParkedChange::Resolved(s) = change {
            if s.is_open() {
                return Err(StoreError::new(
                    StoreErrorKind::Validation,
                    format!("{} is not a resolution", s.as_str()),
                ));
            }
        }
        let open = self.with_view(tx, |s| {
            s.parked
                .get(&id.0)
                .is_some_and(|p| p.consumer == consumer && p.status.is_open())
        });
        if !open {
            return Err(StoreError::new(
                StoreErrorKind::NotFound,
                format!("no open parked message {id} for consumer {consumer}"),
            ));
        }
        tx.consumer_ops.push(ConsumerOp::Change(
            consumer.to_owned(),
            id.0,
            change.clone(),
        ));
        Ok(())
    }

    async fn unblock(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let open = self.with_view(tx, |s| s.open_of(consumer, aggregate).len());
        if open > 0 {
            return Err(conflict(format!(
                "aggregate {aggregate} still has {open} open parked messages"
            )));
        }
        tx.consumer_ops
            .push(ConsumerOp::Unblock(consumer.to_owned(), aggregate.clone()));
        Ok(())
    }

    async fn audit(&self, tx: &mut MemoryTx, entry: &InboxAuditEntry) -> Result<(), StoreError> {
        check_consumer(&entry.consumer)?;
        self.check_tx(tx)?;
        tx.consumer_ops.push(ConsumerOp::Audit(entry.clone()));
        Ok(())
    }

    async fn audit_trail(
        &self,
        consumer: &str,
        id: Option<ParkedId>,
    ) -> Result<Vec<InboxAuditEntry>, StoreError> {
        check_consumer(consumer)?;
        Ok(self
            .db
            .lock()
            .consumer
            .audit
            .iter()
            .filter(|e| e.consumer == consumer && id.is_none_or(|id| e.parked_id == id))
            .cloned()
            .collect())
    }

    async fn parked_stats(&self, consumer: &str) -> Result<ParkedStats, StoreError> {
        check_consumer(consumer)?;
        let st = self.db.lock();
        let open: Vec<&ParkedMessage> = st
            .consumer
            .parked
            .values()
            .filter(|p| p.consumer == consumer && p.status.is_open())
            .collect();
        Ok(ParkedStats::new(
            open.iter()
                .filter(|p| p.status == ParkedStatus::Parked)
                .count() as u64,
            open.iter()
                .filter(|p| p.status == ParkedStatus::Waiting)
                .count() as u64,
            open.iter().map(|p| p.parked_at).min(),
        ))
    }

    async fn request_retry(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        id: ParkedId,
        request: &RetryRequest,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        let open = self.with_view(tx, |s| {
            s.parked
                .get(&id.0)
                .is_some_and(|p| p.consumer == consumer && p.status.is_open())
        });
        if !open {
            return Err(StoreError::new(
                StoreErrorKind::NotFound,
                format!("no open parked message {id} for consumer {consumer}"),
            ));
        }
        tx.consumer_ops.push(ConsumerOp::RequestRetry(
            consumer.to_owned(),
            id.0,
            request.clone(),
        ));
        Ok(())
    }

    async fn requested_retries(&self, consumer: &str) -> Result<Vec<ParkedMessage>, StoreError> {
        check_consumer(consumer)?;
        let st = self.db.lock();
        let mut out: Vec<ParkedMessage> = st
            .consumer
            .parked
            .values()
            .filter(|p| p.consumer == consumer && p.status.is_open() && p.retry_request.is_some())
            .cloned()
            .collect();
        out.sort_by_key(|p| (p.retry_request.as_ref().map(|r| r.requested_at), p.id));
        Ok(out)
    }

    async fn clear_retry_request(
        &self,
        tx: &mut MemoryTx,
        consumer: &str,
        id: ParkedId,
        requested_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        check_consumer(consumer)?;
        self.check_tx(tx)?;
        tx.consumer_ops.push(ConsumerOp::ClearRetryRequest(
            consumer.to_owned(),
            id.0,
            requested_at,
        ));
        Ok(())
    }
}

/// An id for a parked record from its position and content (length-prefixed fields).
fn content_id(r: &outbox_core::ParkedRecord) -> EventId {
    fn field(buf: &mut Vec<u8>, b: Option<&[u8]>) {
        match b {
            Some(b) => {
                buf.push(1);
                buf.extend_from_slice(&(b.len() as u64).to_be_bytes());
                buf.extend_from_slice(b);
            }
            None => buf.push(0),
        }
    }
    let mut buf = Vec::new();
    field(&mut buf, Some(r.position.topic.as_bytes()));
    buf.extend_from_slice(&r.position.partition.to_be_bytes());
    buf.extend_from_slice(&r.position.offset.to_be_bytes());
    field(&mut buf, r.key.as_deref());
    for h in &r.headers {
        field(&mut buf, Some(h.name.as_bytes()));
        field(&mut buf, h.value.as_deref());
    }
    field(&mut buf, r.value.as_deref());
    const CONTENT_NAMESPACE: uuid::Uuid =
        uuid::Uuid::from_u128(0x3c5e_8d21_7a4f_4b96_a0e2_5f19_c6d8_0b73);
    EventId::from_uuid(uuid::Uuid::new_v5(&CONTENT_NAMESPACE, &buf))
}
