//! The consumer's hot-path store: [`InboxStore`] (deduplication, per-aggregate versions and
//! parking inside the effect's transaction), its conveniences, and the values it exchanges.

use std::time::Duration;

use async_trait::async_trait;

use super::{AggregateKey, NewParkedMessage, Parking};
use crate::envelope::{Envelope, EventId};
use crate::error::StoreError;

/// Result of registering an event for a consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Registration {
    /// First time this consumer sees the event: apply the effect in the same transaction.
    Fresh,
    /// Already applied (or discarded) and committed: do not repeat the effect.
    Duplicate,
}

/// Result of registering an event **for its aggregate** ([`InboxStore::register_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AggregateRegistration {
    /// Not registered before: registered now, for this aggregate.
    Fresh,
    /// Registered before for the same aggregate (or without an aggregate, by
    /// [`InboxStore::register`]): a duplicate.
    Duplicate,
    /// Registered before for **another** aggregate: not this event (a record whose original-id
    /// header names another aggregate's event, which only a foreign or buggy producer sends).
    /// Nothing was recorded for it.
    OtherAggregate,
}

impl From<Registration> for AggregateRegistration {
    fn from(r: Registration) -> Self {
        match r {
            Registration::Fresh => Self::Fresh,
            Registration::Duplicate => Self::Duplicate,
        }
    }
}

/// Namespace of [`scoped_dedup_id`] (a fixed, random UUID).
const SCOPED_NAMESPACE: uuid::Uuid =
    uuid::Uuid::from_u128(0x6f0b_2c4e_91d3_4a57_b8e6_0d2f_7a13_c945);

/// The id under which an event of `aggregate` is registered when its dedup id was registered
/// before by another aggregate's event ([`AggregateRegistration::OtherAggregate`]): a UUID v5
/// of the aggregate and the id, the same for every store and every redelivery, so the event
/// is still deduplicated against itself (and against other copies naming the same original in
/// the same aggregate) and never against the other aggregate's event.
pub fn scoped_dedup_id(aggregate: &AggregateKey, id: EventId) -> EventId {
    let mut name =
        Vec::with_capacity(aggregate.aggregate_type.len() + aggregate.aggregate_id.len() + 32);
    for part in [
        aggregate.aggregate_type.as_bytes(),
        aggregate.aggregate_id.as_bytes(),
    ] {
        name.extend_from_slice(&(part.len() as u64).to_be_bytes());
        name.extend_from_slice(part);
    }
    name.extend_from_slice(id.as_uuid().as_bytes());
    EventId::from_uuid(uuid::Uuid::new_v5(&SCOPED_NAMESPACE, &name))
}

/// What an inbox knows about one aggregate of a consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AggregateState {
    /// Highest version applied (or discarded) by this consumer; `None` when the consumer has
    /// not tracked the aggregate yet.
    pub applied_version: Option<i64>,
    /// A parked message blocks the aggregate: later messages wait behind it.
    pub blocked: bool,
}

impl AggregateState {
    /// A state.
    pub fn new(applied_version: Option<i64>, blocked: bool) -> Self {
        Self {
            applied_version,
            blocked,
        }
    }
}

/// Moves an aggregate's applied version from `expected` to `version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionAdvance {
    /// The aggregate.
    pub aggregate: AggregateKey,
    /// The version read in this transaction ([`AggregateState::applied_version`]).
    pub expected: Option<i64>,
    /// The new applied version.
    pub version: i64,
}

/// The consumer's store, used inside the transaction that applies an effect: deduplication,
/// per-aggregate versions, and parking.
///
/// # Contract
///
/// * [`register`](Self::register) MUST record `(consumer, id)` for each id inside `tx`, so the
///   record commits or rolls back with the effect; a rolled-back registration MUST leave the
///   id fresh. It returns one [`Registration`] per id, in order; an id repeated in the slice is
///   `Fresh` the first time and `Duplicate` after. It MUST return `Duplicate` only for ids
///   registered by a committed transaction or earlier in `tx`. Two concurrent transactions
///   registering the same pair MUST NOT both commit as fresh: the second either blocks and
///   then sees a duplicate, or fails with a transient `Conflict`. Callers register by
///   [`Envelope::dedup_id`] ([`InboxStoreExt::register_event`]), so a re-issued copy and its
///   original are one event.
/// * [`register_for`](Self::register_for) is `register` with each id's aggregate recorded:
///   an id registered before for the same aggregate, or without one (by `register`), is
///   [`AggregateRegistration::Duplicate`]; one registered before for another aggregate is
///   [`AggregateRegistration::OtherAggregate`] and nothing is written for it (the caller
///   registers it under [`scoped_dedup_id`] instead). A re-issued copy names its original by
///   id, and only an event of its own aggregate can be its original: a record naming another
///   aggregate's event MUST NOT be deduplicated against it (its effect would be applied zero
///   times). Repeats inside one call answer as if registered one after the other.
/// * [`aggregates`](Self::aggregates) MUST return one state per key, in order, as seen by
///   `tx`; an aggregate never written is `AggregateState::default()`.
/// * [`advance_versions`](Self::advance_versions) MUST set each aggregate's applied version in
///   `tx`, and MUST fail with a transient `Conflict` (changing nothing) when an aggregate's
///   current version is not the `expected` one (another transaction moved it).
/// * [`park`](Self::park) MUST store each message durably in `tx` with its raw record, reason
///   and attempts. A [`ParkAs::Head`](super::ParkAs::Head) with a known aggregate MUST mark
///   the aggregate blocked (stored as waiting when it is blocked already). A
///   [`ParkAs::Waiting`](super::ParkAs::Waiting) MUST fail with a
///   transient `Conflict` when the aggregate is not blocked as `tx` commits (an operator
///   released it meanwhile). A message parked already (same consumer, aggregate and dedup
///   id; for an undecodable one, same position) is reported as [`Parking::AlreadyParked`].
///   A message whose dedup id a parked message of **another** aggregate holds (a record whose
///   original-id header names another aggregate's event, or the event such a record named)
///   is not that message: it MUST be parked, under [`scoped_dedup_id`] (as
///   [`register_for`](Self::register_for) registers it), whichever of the two came first;
///   taking it for parked already would lose it (its offset final, nothing of it kept).
/// * [`cleanup`](Self::cleanup) removes at most one batch of `consumer`'s registrations older
///   than the retention, in its own short transaction, and returns how many. It MUST NOT
///   remove another consumer's registrations: consumers sharing a table may keep different
///   dedup windows, and a registration removed before its consumer's window ends lets a
///   redelivered event be applied twice.
#[async_trait]
pub trait InboxStore: Send + Sync {
    /// The transaction in which registration and effect happen.
    type Tx: Send;

    /// Begins a transaction. Its commit MUST be durable when it returns (a store on PostgreSQL
    /// sets `synchronous_commit = on` for it, whatever the server's default).
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Registers `ids` for `consumer` in `tx`.
    async fn register(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        ids: &[EventId],
    ) -> Result<Vec<Registration>, StoreError>;

    /// Registers each id **for its aggregate** in `tx` (see the contract). The default keeps
    /// no aggregate: it answers through [`register`](Self::register), so an id registered by
    /// any aggregate is a duplicate; stores SHOULD override it (the conformance suite holds
    /// them to the scoped answer).
    async fn register_for(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        events: &[(EventId, AggregateKey)],
    ) -> Result<Vec<AggregateRegistration>, StoreError> {
        let ids: Vec<EventId> = events.iter().map(|(id, _)| *id).collect();
        Ok(self
            .register(tx, consumer, &ids)
            .await?
            .into_iter()
            .map(AggregateRegistration::from)
            .collect())
    }

    /// The states of `aggregates` for `consumer`, as seen by `tx`.
    async fn aggregates(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        aggregates: &[AggregateKey],
    ) -> Result<Vec<AggregateState>, StoreError>;

    /// Advances applied versions in `tx`.
    async fn advance_versions(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        updates: &[VersionAdvance],
    ) -> Result<(), StoreError>;

    /// Parks `messages` in `tx`.
    async fn park(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        messages: &[NewParkedMessage],
    ) -> Result<Vec<Parking>, StoreError>;

    /// Commits `tx`. After `Ok`, everything done in it is durable.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls `tx` back; nothing done in it remains.
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Removes at most `batch_size` of `consumer`'s registrations older than `retention` (its
    /// dedup window); other consumers' registrations stay. Returns the number removed.
    async fn cleanup(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
    ) -> Result<u64, StoreError>;
}

/// Conveniences over any [`InboxStore`].
#[async_trait]
pub trait InboxStoreExt: InboxStore {
    /// Registers one id.
    async fn register_one(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        id: EventId,
    ) -> Result<Registration, StoreError> {
        let mut r = self.register(tx, consumer, &[id]).await?;
        r.pop().ok_or_else(|| {
            StoreError::new(
                crate::StoreErrorKind::Other,
                "register returned no registration",
            )
        })
    }

    /// Registers an event by its [`Envelope::dedup_id`], for its aggregate: a re-issued copy
    /// and its original are one event; a record naming another aggregate's event as its
    /// original is not a copy of it ([`register_events`](Self::register_events)).
    async fn register_event(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        event: &Envelope,
    ) -> Result<Registration, StoreError> {
        let mut r = self.register_events(tx, consumer, &[event]).await?;
        r.pop().ok_or_else(|| {
            StoreError::new(
                crate::StoreErrorKind::Other,
                "register returned no registration",
            )
        })
    }

    /// Registers events by their [`Envelope::dedup_id`], each for its aggregate
    /// ([`InboxStore::register_for`]), answering one [`Registration`] per event in order. An
    /// event whose dedup id another aggregate's event holds is registered under
    /// [`scoped_dedup_id`] (a second round trip, only then): it is deduplicated against its own
    /// redeliveries, never against the other aggregate's event.
    async fn register_events(
        &self,
        tx: &mut Self::Tx,
        consumer: &str,
        events: &[&Envelope],
    ) -> Result<Vec<Registration>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let first: Vec<(EventId, AggregateKey)> = events
            .iter()
            .map(|e| (e.dedup_id(), AggregateKey::of(e)))
            .collect();
        let answers = self.register_for(tx, consumer, &first).await?;
        if answers.len() != events.len() {
            return Err(StoreError::new(
                crate::StoreErrorKind::Other,
                format!(
                    "the inbox answered {} registrations for {} ids",
                    answers.len(),
                    events.len()
                ),
            ));
        }
        let others: Vec<usize> = (0..events.len())
            .filter(|i| answers[*i] == AggregateRegistration::OtherAggregate)
            .collect();
        let mut out: Vec<Registration> = answers
            .iter()
            .map(|a| match a {
                AggregateRegistration::Fresh => Registration::Fresh,
                _ => Registration::Duplicate,
            })
            .collect();
        if !others.is_empty() {
            let scoped: Vec<(EventId, AggregateKey)> = others
                .iter()
                .map(|i| {
                    let (id, key) = &first[*i];
                    (scoped_dedup_id(key, *id), key.clone())
                })
                .collect();
            let again = self.register_for(tx, consumer, &scoped).await?;
            if again.len() != others.len() {
                return Err(StoreError::new(
                    crate::StoreErrorKind::Other,
                    "the inbox answered the wrong number of scoped registrations",
                ));
            }
            for (i, a) in others.into_iter().zip(again) {
                out[i] = match a {
                    AggregateRegistration::Fresh => Registration::Fresh,
                    AggregateRegistration::Duplicate => Registration::Duplicate,
                    AggregateRegistration::OtherAggregate => {
                        return Err(StoreError::new(
                            crate::StoreErrorKind::Other,
                            format!("scoped id of {} is held by another aggregate", first[i].1),
                        ))
                    }
                };
            }
        }
        Ok(out)
    }

    /// Runs [`InboxStore::cleanup`] for `consumer` batch after batch until a batch comes back
    /// short or `max_batches` ran. Returns the number removed.
    async fn cleanup_batches(
        &self,
        consumer: &str,
        retention: Duration,
        batch_size: usize,
        max_batches: usize,
    ) -> Result<u64, StoreError> {
        let mut removed = 0;
        for _ in 0..max_batches {
            let n = self.cleanup(consumer, retention, batch_size).await?;
            removed += n;
            if n < batch_size as u64 {
                break;
            }
        }
        Ok(removed)
    }
}

impl<T: InboxStore + ?Sized> InboxStoreExt for T {}
