//! [`InboxProcessor`]: deduplication, version checks, the handler and parking in one
//! transaction.

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::inbox::scoped_dedup_id;
use outbox_core::{
    AggregateKey, AggregateRegistration, AggregateState, Envelope, InboxStore, NewParkedMessage,
    ParkAs, ParkKind, ParkedId, Parking, ReceivedMessage, Registration, StoreError, VersionAdvance,
};

use crate::handler::{BatchHandlerError, Handler, HandlerError};
use crate::metrics;

/// Reads, in a batch's transaction, the versions of an aggregate's messages that an operator
/// discarded (the engine's store; [`InboxProcessor::process`] has none). A discard counts its
/// version as applied only when that skips no unseen version; one made while a lower version
/// was still unseen counts once that version is applied, which the batch that finds the next
/// version a "gap" checks here.
#[async_trait::async_trait]
pub(crate) trait DiscardedVersions<Tx: Send>: Send + Sync {
    /// The discarded versions of `aggregate` (decodable messages only, as the operator counts).
    async fn discarded_versions(
        &self,
        tx: &mut Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<i64>, StoreError>;
}

#[async_trait::async_trait]
impl<I: outbox_core::InboxParking> DiscardedVersions<I::Tx> for I {
    async fn discarded_versions(
        &self,
        tx: &mut I::Tx,
        consumer: &str,
        aggregate: &AggregateKey,
    ) -> Result<Vec<i64>, StoreError> {
        Ok(self
            .discarded_of(tx, consumer, aggregate)
            .await?
            .into_iter()
            .filter_map(|m| m.record.decode().ok().map(|e| e.aggregate_version))
            .collect())
    }
}

/// What to do with a message whose `aggregate_version` skips ahead of the last version this
/// consumer applied for its aggregate. Versions at or below the applied one are never applied
/// again, whatever the policy (they are duplicates or stale; counted as `stale`), except under
/// [`VersionPolicy::Unchecked`], which keeps no versions at all.
///
/// | policy | a gap | pick it when |
/// |---|---|---|
/// | [`Reject`](Self::Reject) (default) | parked at once as [`ParkKind::VersionGap`]; the aggregate's later messages wait behind it | the producer is this library's outbox: it publishes an aggregate's versions in order, so a gap is a real anomaly (a lost or discarded event, a wrong route, a compacted topic) that an operator should look at |
/// | [`Hold`](Self::Hold) | held in memory until the missing version arrives, at most `max_wait` and `max_held` messages; then parked as a gap | one aggregate's events can arrive out of order by design (several topics, producers that do not keep order) and usually fill their gaps quickly. Held offsets are not final, so the committed offset of their partition waits too |
/// | [`Unchecked`](Self::Unchecked) | applied | the effect is a monotonic projection guarded by its own version condition (`UPDATE .. WHERE version < $v`), which makes order irrelevant; no version is stored, which saves a write per batch |
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum VersionPolicy {
    /// Park a gap at once.
    #[default]
    Reject,
    /// Hold a gap until it closes, bounded; then park it.
    Hold {
        /// Most messages held at once (all aggregates together); past it, the aggregate held
        /// longest is parked.
        max_held: usize,
        /// Longest a message is held.
        max_wait: Duration,
    },
    /// No version tracking.
    ///
    /// A message parked by this instance blocks its aggregate here as under every policy. One
    /// limit is specific to this policy: with no version written, a batch takes no lock on the
    /// aggregate's row, so while two instances overlap (a rebalance), one may apply a message of
    /// an aggregate whose earlier message the other parks at the same moment. Nothing is applied
    /// twice; the parked message stays parked, and an operator's retry applies it (or answers a
    /// duplicate).
    Unchecked,
}

impl VersionPolicy {
    /// [`VersionPolicy::Hold`] with its bounds.
    pub fn hold(max_held: usize, max_wait: Duration) -> Self {
        Self::Hold { max_held, max_wait }
    }

    pub(crate) fn tracks(self) -> bool {
        !matches!(self, Self::Unchecked)
    }
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum MessageOutcome {
    /// Fresh: the effect and the registration committed together.
    Applied,
    /// Registered before (or discarded by an operator): nothing done.
    Duplicate,
    /// Its version is at or below the one applied: nothing done.
    Stale {
        /// The applied version.
        applied: i64,
    },
    /// Parked as its aggregate's head (or standalone when its aggregate is unknown).
    Parked {
        /// The parked message.
        id: ParkedId,
        /// Why.
        kind: ParkKind,
    },
    /// Parked as waiting behind its aggregate's head.
    Waiting(ParkedId),
    /// Parked before (a redelivery): nothing stored.
    AlreadyParked,
    /// Held back until its aggregate's missing version arrives ([`VersionPolicy::Hold`]).
    Held,
    /// [`InboxProcessor::process`] only: its aggregate is blocked by a parked message.
    Blocked,
    /// [`InboxProcessor::process`] only: its version skips ahead.
    VersionGap {
        /// The version that was expected.
        expected: i64,
    },
    /// [`InboxProcessor::process`] only: the handler failed; everything was rolled back.
    Failed(HandlerError),
}

impl MessageOutcome {
    /// Whether the message's offset is final (everything but `Held`, `Blocked`, `VersionGap`
    /// and `Failed`).
    pub fn is_final(&self) -> bool {
        !matches!(
            self,
            Self::Held | Self::Blocked | Self::VersionGap { .. } | Self::Failed(_)
        )
    }

    /// Stable name, used as the `result` label of `outbox_inbox_processed_total`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Duplicate => "duplicate",
            Self::Stale { .. } => "stale",
            Self::Parked { .. } => "parked",
            Self::Waiting(_) => "waiting",
            Self::AlreadyParked => "already_parked",
            Self::Held => "held",
            Self::Blocked => "blocked",
            Self::VersionGap { .. } => "version_gap",
            Self::Failed(_) => "failed",
        }
    }
}

/// What the caller already decided about a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Force {
    /// Nothing: decide by state and policy.
    None,
    /// Park it as the head (attempts exhausted, permanent failure, hold expired).
    Park(ParkKind, String),
    /// An operator accepts its version gap.
    AllowGap,
}

/// One message in a batch.
#[derive(Clone, Debug)]
pub(crate) struct Item<'a> {
    pub(crate) msg: &'a ReceivedMessage,
    pub(crate) attempts: u32,
    pub(crate) force: &'a Force,
}

/// The outcome of a batch.
#[derive(Debug)]
pub(crate) enum BatchResult {
    /// Committed; one outcome per item.
    Committed(Vec<MessageOutcome>),
    /// The handler failed on item `index`; everything was rolled back.
    HandlerFailed { index: usize, error: HandlerError },
    /// Items `deferred` were decided on a premise that did not hold (a message before them of
    /// their aggregate was not applied after all); everything was rolled back. Run the batch
    /// again without them, and them after it.
    Split { deferred: Vec<usize> },
    /// Item `index`, to be applied, can be registered neither under its dedup id nor under its
    /// aggregate-scoped id ([`register_scoped`]); everything was rolled back. It can never be
    /// deduplicated, so it is never applied: park it (`reason`) and run the batch again.
    Unregistrable { index: usize, reason: String },
}

/// Registers `events` by their dedup ids, each for its aggregate, as
/// [`outbox_core::InboxStoreExt::register_events`] does (an event whose dedup id another
/// aggregate's event holds is registered under [`scoped_dedup_id`]), answering `None` for an
/// event whose scoped id another aggregate's event holds too. Only a record whose event id was
/// computed on purpose to be that scoped id can hold it, so such an event cannot be told apart
/// from its own redeliveries by any id the inbox keeps: the caller parks it rather than fail
/// the whole batch on it (which would stop the consumer on that record for good).
pub(crate) async fn register_scoped<I: InboxStore>(
    store: &I,
    tx: &mut I::Tx,
    consumer: &str,
    events: &[&Envelope],
) -> Result<Vec<Option<Registration>>, StoreError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let first: Vec<(outbox_core::EventId, AggregateKey)> = events
        .iter()
        .map(|e| (e.dedup_id(), AggregateKey::of(e)))
        .collect();
    let answers = store.register_for(tx, consumer, &first).await?;
    let wrong = |n: usize, of: usize| {
        StoreError::new(
            outbox_core::StoreErrorKind::Other,
            format!("the inbox answered {n} registrations for {of} ids"),
        )
    };
    if answers.len() != events.len() {
        return Err(wrong(answers.len(), events.len()));
    }
    let as_registration = |a: AggregateRegistration| match a {
        AggregateRegistration::Fresh => Some(Registration::Fresh),
        AggregateRegistration::Duplicate => Some(Registration::Duplicate),
        _ => None,
    };
    let others: Vec<usize> = (0..events.len())
        .filter(|i| answers[*i] == AggregateRegistration::OtherAggregate)
        .collect();
    let mut out: Vec<Option<Registration>> = answers.into_iter().map(as_registration).collect();
    if !others.is_empty() {
        let scoped: Vec<(outbox_core::EventId, AggregateKey)> = others
            .iter()
            .map(|i| {
                let (id, key) = &first[*i];
                (scoped_dedup_id(key, *id), key.clone())
            })
            .collect();
        let again = store.register_for(tx, consumer, &scoped).await?;
        if again.len() != others.len() {
            return Err(wrong(again.len(), others.len()));
        }
        for (i, a) in others.into_iter().zip(again) {
            out[i] = as_registration(a);
        }
    }
    Ok(out)
}

#[derive(Clone, Debug)]
enum Decision {
    Apply,
    Stale(i64),
    Park(ParkAs, String),
    Hold,
    Gap(i64),
    Blocked,
}

#[derive(Clone, Debug, Default)]
struct Local {
    read: AggregateState,
    applied: Option<i64>,
    blocked: bool,
    /// Versions of the aggregate an operator discarded (read only for an aggregate found with
    /// a gap): the next ones count as applied when a gap is found.
    discarded: Option<std::collections::BTreeSet<i64>>,
    /// The highest discarded version counted as applied by this batch.
    counted: Option<i64>,
}

/// Register-and-apply in one transaction, with version checks and parking. The building block
/// of [`crate::ConsumerEngine`] and [`crate::ParkedMessages`]; usable on its own when messages
/// come from elsewhere (an HTTP webhook, a test) through [`process`](Self::process).
///
/// ```
/// # use outbox_inbox::*;
/// # fn _doc<I: outbox_core::InboxStore, H: Handler<I::Tx>>(store: I, handler: H) {
/// let processor = InboxProcessor::new("projection", store, handler)
///     .with_version_policy(VersionPolicy::Reject);
/// # }
/// ```
#[derive(Debug)]
pub struct InboxProcessor<I, H> {
    consumer: String,
    store: I,
    handler: H,
    policy: VersionPolicy,
    require_first_version: bool,
}

impl<I, H> InboxProcessor<I, H> {
    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The store.
    pub fn store(&self) -> &I {
        &self.store
    }

    /// The version policy.
    pub fn version_policy(&self) -> VersionPolicy {
        self.policy
    }
}

impl<I: InboxStore, H: Handler<I::Tx>> InboxProcessor<I, H> {
    /// A processor for the consumer named `consumer` (the key of its registrations, versions
    /// and parked messages), with [`VersionPolicy::Reject`].
    pub fn new(consumer: impl Into<String>, store: I, handler: H) -> Self {
        Self {
            consumer: consumer.into(),
            store,
            handler,
            policy: VersionPolicy::default(),
            require_first_version: false,
        }
    }

    /// Sets the version policy. Default [`VersionPolicy::Reject`].
    pub fn with_version_policy(mut self, policy: VersionPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Whether an aggregate this consumer has not seen yet must start at version 1. Default
    /// `false`: the first version seen is the baseline, so a consumer that starts on a topic
    /// whose older records were deleted (or that starts at the latest offset) does not park
    /// every aggregate. Set it for consumers that read their topics from the very beginning.
    pub fn require_first_version(mut self, yes: bool) -> Self {
        self.require_first_version = yes;
        self
    }

    /// Registers and applies `event` in one transaction, with the version check; parks
    /// nothing. A blocked aggregate, a version gap and a handler failure come back as
    /// outcomes ([`MessageOutcome::Blocked`], [`MessageOutcome::VersionGap`],
    /// [`MessageOutcome::Failed`]) with nothing committed.
    ///
    /// `Err` means the store failed (nothing committed unless the error came from the commit
    /// itself, in which case the outcome is unknown and a retry is answered by deduplication).
    pub async fn process(&self, event: &Envelope) -> Result<MessageOutcome, StoreError> {
        let msg = ReceivedMessage::new(
            outbox_core::LogPosition::new("", 0, 0),
            None,
            Ok(event.clone()),
        );
        let force = Force::None;
        let items = [Item {
            msg: &msg,
            attempts: 0,
            force: &force,
        }];
        let mut result = self.run_batch(&items, false, None).await?;
        // Run again when the aggregate was blocked by another instance while this ran: the
        // run again reads it blocked and applies nothing.
        for _ in 0..3 {
            if !matches!(&result, BatchResult::Split { deferred } if deferred.is_empty()) {
                break;
            }
            result = self.run_batch(&items, false, None).await?;
        }
        match result {
            BatchResult::Committed(mut o) => Ok(o.pop().unwrap_or(MessageOutcome::Duplicate)),
            BatchResult::HandlerFailed { error, .. } => {
                metrics::record_outcome(&self.consumer, &MessageOutcome::Failed(error.clone()));
                Ok(MessageOutcome::Failed(error))
            }
            BatchResult::Unregistrable { reason, .. } => {
                let error = HandlerError::permanent(reason);
                metrics::record_outcome(&self.consumer, &MessageOutcome::Failed(error.clone()));
                Ok(MessageOutcome::Failed(error))
            }
            BatchResult::Split { .. } => Err(StoreError::new(
                outbox_core::StoreErrorKind::Other,
                "a batch of one message cannot be split",
            )),
        }
    }

    fn gap(&self, applied: Option<i64>, version: i64) -> Option<i64> {
        match applied {
            Some(a) if version > a + 1 => Some(a + 1),
            None if self.require_first_version && version != 1 => Some(1),
            _ => None,
        }
    }

    fn decide(&self, item: &Item<'_>, local: Option<&mut Local>, park: bool) -> Decision {
        let agg = item.msg.aggregate();
        let blocked = local.as_ref().is_some_and(|l| l.blocked);
        if blocked {
            // A version at or below the applied one (a redelivery of an applied event) is
            // stale whatever blocks the aggregate: never parked as waiting behind it.
            if self.policy.tracks() {
                if let (Ok(e), Some(a)) =
                    (&item.msg.envelope, local.as_ref().and_then(|l| l.applied))
                {
                    if e.aggregate_version <= a {
                        return Decision::Stale(a);
                    }
                }
            }
            return if park {
                Decision::Park(
                    ParkAs::Waiting,
                    format!(
                        "waiting behind a parked message of {}",
                        agg.map_or_else(String::new, |a| a.to_string())
                    ),
                )
            } else {
                Decision::Blocked
            };
        }
        let park_head = |local: Option<&mut Local>, kind: ParkKind, reason: String| {
            if let Some(l) = local {
                l.blocked = true;
            }
            Decision::Park(ParkAs::Head(kind), reason)
        };
        let event = match &item.msg.envelope {
            Err(e) => {
                return park_head(
                    local,
                    ParkKind::Unprocessable,
                    format!("cannot be decoded: {e}"),
                )
            }
            Ok(e) => e,
        };
        // A version at or below the applied one is stale even when parking was decided
        // before (hold expired, attempts exhausted): another instance of the consumer may
        // have applied it meanwhile, and parking it would block the aggregate for nothing.
        if self.policy.tracks() {
            if let Some(a) = local
                .as_ref()
                .and_then(|l| l.applied)
                .filter(|a| event.aggregate_version <= *a)
            {
                return Decision::Stale(a);
            }
        }
        if let Force::Park(kind, reason) = item.force {
            return park_head(local, *kind, reason.clone());
        }
        if !self.policy.tracks() {
            return Decision::Apply;
        }
        let Some(local) = local else {
            return Decision::Apply;
        };
        let v = event.aggregate_version;
        if let Some(a) = local.applied.filter(|a| v <= *a) {
            return Decision::Stale(a);
        }
        // Versions below this one that an operator discarded while a lower version was
        // unseen (applied since) count as applied now: they skip nothing any more. Never this
        // version itself: another event of it may have been sent, and nobody discarded that.
        if let (Some(set), Some(mut a)) = (&local.discarded, local.applied) {
            while a < v - 1 && set.contains(&(a + 1)) {
                a += 1;
            }
            if Some(a) != local.applied {
                local.applied = Some(a);
                local.counted = Some(a);
            }
        }
        if let Some(expected) = self.gap(local.applied, v) {
            if *item.force == Force::AllowGap {
                local.applied = Some(v);
                return Decision::Apply;
            }
            if !park {
                return Decision::Gap(expected);
            }
            // A held message does not hold back later ones of its aggregate: only the next
            // version can apply, and applying it is what closes the gap.
            return match self.policy {
                VersionPolicy::Hold { .. } => Decision::Hold,
                _ => {
                    local.blocked = true;
                    Decision::Park(
                        ParkAs::Head(ParkKind::VersionGap),
                        format!(
                            "version gap: {} expected version {expected}, got {v}",
                            AggregateKey::of(event)
                        ),
                    )
                }
            };
        }
        local.applied = Some(v);
        Decision::Apply
    }

    /// Runs `items` in one transaction. With `park`, messages that cannot be applied are
    /// parked (and held under [`VersionPolicy::Hold`]); without it, they come back as
    /// `Blocked`/`VersionGap` and nothing is written for them.
    ///
    /// `discarded` reads the versions an operator discarded: a gap they fill is no gap.
    pub(crate) async fn run_batch(
        &self,
        items: &[Item<'_>],
        park: bool,
        discarded: Option<&dyn DiscardedVersions<I::Tx>>,
    ) -> Result<BatchResult, StoreError> {
        let mut tx = self.store.begin().await?;
        match self.batch_in(&mut tx, items, park, discarded).await {
            Ok((BatchResult::Committed(outcomes), baselines)) => {
                self.store.commit(tx).await?;
                for o in &outcomes {
                    metrics::record_outcome(&self.consumer, o);
                }
                self.record_baselines(&baselines);
                Ok(BatchResult::Committed(outcomes))
            }
            Ok((failed, _)) => {
                self.store.rollback(tx).await?;
                Ok(failed)
            }
            Err(e) => {
                let _ = self.store.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Logs and counts the baselines taken: an aggregate's first applied version above 1 (the
    /// versions below it are never applied by this consumer; see
    /// [`require_first_version`](Self::require_first_version)).
    fn record_baselines(&self, baselines: &[(AggregateKey, i64)]) {
        for (aggregate, version) in baselines {
            tracing::warn!(consumer = %self.consumer, aggregate = %aggregate, version, "first version of an aggregate above 1 taken as its baseline: earlier versions will be treated as stale");
        }
        if !baselines.is_empty() {
            metrics::record_counter(
                "outbox_inbox_baselines_total",
                &self.consumer,
                baselines.len() as u64,
            );
        }
    }

    async fn batch_in(
        &self,
        tx: &mut I::Tx,
        items: &[Item<'_>],
        park: bool,
        discarded: Option<&dyn DiscardedVersions<I::Tx>>,
    ) -> Result<(BatchResult, Vec<(AggregateKey, i64)>), StoreError> {
        // 1. What the inbox knows about the batch's aggregates (one round trip).
        let mut keys: Vec<AggregateKey> = Vec::new();
        let mut index: HashMap<AggregateKey, usize> = HashMap::new();
        let aggs: Vec<Option<AggregateKey>> = items.iter().map(|i| i.msg.aggregate()).collect();
        for k in aggs.iter().flatten() {
            if !index.contains_key(k) {
                index.insert(k.clone(), keys.len());
                keys.push(k.clone());
            }
        }
        let states = if keys.is_empty() {
            Vec::new()
        } else {
            self.store.aggregates(tx, &self.consumer, &keys).await?
        };
        let mut locals: Vec<Local> = states
            .iter()
            .map(|s| Local {
                read: *s,
                applied: s.applied_version,
                blocked: s.blocked,
                ..Local::default()
            })
            .collect();
        // 2. Decide each message in order, as if the ones before it were applied.
        let decide_all = |locals: &mut [Local]| -> Vec<Decision> {
            items
                .iter()
                .zip(&aggs)
                .map(|(item, agg)| {
                    let local = agg.as_ref().map(|k| &mut locals[index[k]]);
                    self.decide(item, local, park)
                })
                .collect()
        };
        let initial: Vec<Local> = locals.clone();
        let mut decisions = decide_all(&mut locals);
        // 2b. An aggregate found with a version gap: read the versions an operator discarded
        //     (one round trip each; rare) and decide again. A discard made while a lower
        //     version was unseen counts once that version is applied, as the operator's own
        //     release counts it: the next version is then no gap.
        if let (Some(reader), true) = (discarded, self.policy.tracks()) {
            let mut gapped: Vec<usize> = Vec::new();
            for (d, agg) in decisions.iter().zip(&aggs) {
                let gap = matches!(
                    d,
                    Decision::Gap(_)
                        | Decision::Hold
                        | Decision::Park(ParkAs::Head(ParkKind::VersionGap), _)
                );
                if let (true, Some(k)) = (gap, agg) {
                    if !gapped.contains(&index[k]) {
                        gapped.push(index[k]);
                    }
                }
            }
            if !gapped.is_empty() {
                locals = initial;
                for ki in gapped {
                    let versions = reader
                        .discarded_versions(tx, &self.consumer, &keys[ki])
                        .await?;
                    if !versions.is_empty() {
                        locals[ki].discarded = Some(versions.into_iter().collect());
                    }
                }
                decisions = decide_all(&mut locals);
            }
        }
        // 3. Register what is to be applied, and the stale versions (one round trip; a second
        //    only for an id that another aggregate's event holds): a stale message registered
        //    before is a duplicate of an applied event; one that was not is another event at an
        //    old version, registered now so it is never applied. Each event is registered for
        //    its aggregate: a record naming another aggregate's event as its original is not
        //    deduplicated against it.
        let apply: Vec<usize> = (0..items.len())
            .filter(|i| matches!(decisions[*i], Decision::Apply | Decision::Stale(_)))
            .filter(|i| items[*i].msg.envelope.is_ok())
            .collect();
        let events: Vec<&Envelope> = apply
            .iter()
            .map(|i| items[*i].msg.envelope.as_ref().expect("filtered above"))
            .collect();
        let registrations = if events.is_empty() {
            Vec::new()
        } else {
            register_scoped(&self.store, tx, &self.consumer, &events).await?
        };
        if registrations.len() != events.len() {
            return Err(StoreError::new(
                outbox_core::StoreErrorKind::Other,
                format!(
                    "the inbox answered {} registrations for {} ids",
                    registrations.len(),
                    events.len()
                ),
            ));
        }
        let mut fresh: HashMap<usize, Registration> = HashMap::new();
        for (i, r) in apply.iter().zip(registrations) {
            match r {
                Some(r) => {
                    fresh.insert(*i, r);
                }
                // A stale one is not applied anyway: nothing registered, stale again when it
                // comes back. One to apply is handed back to be parked.
                None if matches!(decisions[*i], Decision::Apply) => {
                    let e = items[*i].msg.envelope.as_ref().expect("filtered above");
                    return Ok((
                        BatchResult::Unregistrable {
                            index: *i,
                            reason: format!(
                                "cannot be deduplicated: its dedup id {} and its id scoped to \
                                 {} are both held by other aggregates' events (an event id \
                                 made to collide)",
                                e.dedup_id(),
                                AggregateKey::of(e)
                            ),
                        },
                        Vec::new(),
                    ));
                }
                None => {}
            }
        }
        // A duplicate decided as the next version is not applied, so its version does not
        // count: the later messages of its aggregate in this batch were decided as if it did.
        // They are handed back and decided again on what is committed.
        if self.policy.tracks() {
            let deferred = self.after_unapplied(items, &aggs, |i| {
                matches!(decisions[i], Decision::Apply)
                    && fresh.get(&i) == Some(&Registration::Duplicate)
            });
            if !deferred.is_empty() {
                return Ok((BatchResult::Split { deferred }, Vec::new()));
            }
        }
        let to_apply: Vec<usize> = apply
            .iter()
            .copied()
            .filter(|i| {
                fresh.get(i) == Some(&Registration::Fresh)
                    && matches!(decisions[*i], Decision::Apply)
            })
            .collect();
        if !to_apply.is_empty() {
            let events: Vec<&Envelope> = to_apply
                .iter()
                .map(|i| items[*i].msg.envelope.as_ref().expect("decided Apply"))
                .collect();
            if let Err(BatchHandlerError { index, error }) =
                self.handler.handle_batch(tx, &events).await
            {
                let index = to_apply.get(index).copied().unwrap_or_else(|| {
                    tracing::warn!(
                        index,
                        len = to_apply.len(),
                        "handle_batch named an event out of range; blaming the first"
                    );
                    to_apply[0]
                });
                return Ok((BatchResult::HandlerFailed { index, error }, Vec::new()));
            }
        }
        // 4. Versions that moved (one round trip): only an applied message moves its
        //    aggregate's version (a duplicate or a stale one never does), to the version of the
        //    last one applied.
        let mut baselines = Vec::new();
        // Each aggregate's applied version as this transaction leaves it.
        let mut written: Vec<Option<i64>> = locals.iter().map(|l| l.read.applied_version).collect();
        if self.policy.tracks() {
            let mut applied: Vec<Option<i64>> =
                locals.iter().map(|l| l.read.applied_version).collect();
            for i in &to_apply {
                let Some(k) = &aggs[*i] else { continue };
                let e = items[*i].msg.envelope.as_ref().expect("decided Apply");
                let slot = &mut applied[index[k]];
                if slot.is_none() && e.aggregate_version > 1 {
                    baselines.push((k.clone(), e.aggregate_version));
                }
                *slot = Some(e.aggregate_version);
            }
            // Discarded versions counted in step 2b move the version even when nothing after
            // them is applied (versions only grow, so the highest wins).
            for (slot, l) in applied.iter_mut().zip(&locals) {
                if l.counted > *slot {
                    *slot = l.counted;
                }
            }
            let advances: Vec<VersionAdvance> = keys
                .iter()
                .zip(&locals)
                .zip(&applied)
                .filter(|((_, l), a)| **a != l.read.applied_version)
                .filter_map(|((k, l), a)| {
                    a.map(|v| VersionAdvance {
                        aggregate: k.clone(),
                        expected: l.read.applied_version,
                        version: v,
                    })
                })
                .collect();
            if !advances.is_empty() {
                self.store
                    .advance_versions(tx, &self.consumer, &advances)
                    .await?;
                // The batch decided on the aggregates as read at its start. Writing a version
                // took the aggregate's row lock, which parking takes too: a message of it that
                // another instance of the consumer parked meanwhile (during a rebalance) has
                // committed by now and a read now sees the aggregate blocked. Applying behind
                // that head would break its order (and apply the head itself when this batch
                // holds it): everything is run again on what is committed. A park that comes
                // after this point waits on the row lock and sees the version moved.
                let moved: Vec<AggregateKey> =
                    advances.iter().map(|a| a.aggregate.clone()).collect();
                let now = self.store.aggregates(tx, &self.consumer, &moved).await?;
                let blocked_meanwhile = moved
                    .iter()
                    .zip(&now)
                    .any(|(k, state)| state.blocked && !locals[index[k]].read.blocked);
                if blocked_meanwhile {
                    return Ok((
                        BatchResult::Split {
                            deferred: Vec::new(),
                        },
                        Vec::new(),
                    ));
                }
            }
            written = applied;
        }
        // 5. Parking: the heads first, then the messages waiting behind them (one round trip
        //    each). A head parked before and resolved since (an operator discarded it; a
        //    redelivery) comes back `AlreadyParked` and blocks nothing: the messages decided
        //    to wait behind it are handed back and decided again.
        let park_of = |i: usize, park_as: ParkAs, reason: &str| {
            NewParkedMessage::new(
                items[i].msg.to_record(),
                park_as,
                reason.to_owned(),
                // A head was tried (decoded, checked or handled) at least once; a waiting
                // message was not.
                match park_as {
                    ParkAs::Head(_) => items[i].attempts.max(1),
                    ParkAs::Waiting => items[i].attempts,
                },
            )
        };
        let mut parked: HashMap<usize, Parking> = HashMap::new();
        for heads in [true, false] {
            let parks: Vec<(usize, NewParkedMessage)> = decisions
                .iter()
                .enumerate()
                .filter_map(|(i, d)| match d {
                    Decision::Park(park_as, reason)
                        if matches!(park_as, ParkAs::Head(_)) == heads =>
                    {
                        Some((i, park_of(i, *park_as, reason)))
                    }
                    _ => None,
                })
                .collect();
            if parks.is_empty() {
                continue;
            }
            if !heads {
                let deferred = self.after_unapplied(items, &aggs, |i| {
                    matches!(decisions[i], Decision::Park(ParkAs::Head(_), _))
                        && parked.get(&i) == Some(&Parking::AlreadyParked)
                });
                if !deferred.is_empty() {
                    return Ok((BatchResult::Split { deferred }, Vec::new()));
                }
            }
            let messages: Vec<NewParkedMessage> = parks.iter().map(|(_, m)| m.clone()).collect();
            let results = self.store.park(tx, &self.consumer, &messages).await?;
            for ((i, _), r) in parks.iter().zip(results) {
                parked.insert(*i, r);
            }
            // A head was parked on the aggregate's state as read at the start of the batch.
            // Parking took the aggregate's row lock, so a transaction that applied a version of
            // it meanwhile (another instance of the consumer on the same records, during a
            // rebalance) has committed by now, and a read now sees it: the message may have
            // been applied there (or is stale now), and parking it would block the aggregate
            // behind an applied event. Then everything is run again on what is committed.
            if heads && self.policy.tracks() {
                let mut moved: Vec<AggregateKey> = Vec::new();
                for (i, _) in &parks {
                    if let (Some(Parking::Head(_)), Some(k)) = (parked.get(i), &aggs[*i]) {
                        if !moved.contains(k) {
                            moved.push(k.clone());
                        }
                    }
                }
                if !moved.is_empty() {
                    let now = self.store.aggregates(tx, &self.consumer, &moved).await?;
                    let changed = moved
                        .iter()
                        .zip(&now)
                        .any(|(k, state)| state.applied_version != written[index[k]]);
                    if changed {
                        return Ok((
                            BatchResult::Split {
                                deferred: Vec::new(),
                            },
                            Vec::new(),
                        ));
                    }
                }
            }
        }
        let outcomes = decisions
            .into_iter()
            .enumerate()
            .map(|(i, d)| match d {
                Decision::Apply => match fresh[&i] {
                    Registration::Fresh => MessageOutcome::Applied,
                    Registration::Duplicate => MessageOutcome::Duplicate,
                },
                Decision::Stale(applied) => match fresh.get(&i) {
                    Some(Registration::Duplicate) => MessageOutcome::Duplicate,
                    _ => MessageOutcome::Stale { applied },
                },
                Decision::Hold => MessageOutcome::Held,
                Decision::Gap(expected) => MessageOutcome::VersionGap { expected },
                Decision::Blocked => MessageOutcome::Blocked,
                Decision::Park(park_as, _) => match parked.get(&i) {
                    Some(Parking::Head(id)) => MessageOutcome::Parked {
                        id: *id,
                        kind: match park_as {
                            ParkAs::Head(kind) => kind,
                            ParkAs::Waiting => ParkKind::Unprocessable,
                        },
                    },
                    Some(Parking::Waiting(id)) => MessageOutcome::Waiting(*id),
                    _ => MessageOutcome::AlreadyParked,
                },
            })
            .collect();
        Ok((BatchResult::Committed(outcomes), baselines))
    }

    /// The items after the first one (in batch order) of each aggregate for which `unapplied`
    /// holds: decided on a premise that did not hold, they are handed back.
    fn after_unapplied(
        &self,
        items: &[Item<'_>],
        aggs: &[Option<AggregateKey>],
        unapplied: impl Fn(usize) -> bool,
    ) -> Vec<usize> {
        let mut stopped: Vec<&AggregateKey> = Vec::new();
        let mut deferred = Vec::new();
        for (i, agg) in aggs.iter().enumerate().take(items.len()) {
            let Some(k) = agg else { continue };
            if stopped.contains(&k) {
                deferred.push(i);
            } else if unapplied(i) {
                stopped.push(k);
            }
        }
        deferred
    }

    /// Registers `event` without effect (an operator discard), in `tx`. One that cannot be
    /// registered ([`register_scoped`]) is left unregistered: its parked message, discarded,
    /// keeps answering its redeliveries as parked already.
    pub(crate) async fn register_without_effect(
        &self,
        tx: &mut I::Tx,
        event: &Envelope,
    ) -> Result<(), StoreError> {
        register_scoped(&self.store, tx, &self.consumer, &[event]).await?;
        Ok(())
    }

    /// Applies one parked message in `tx` for an operator: the same checks as the engine, a gap
    /// accepted when `allow_gap`. `Ok(Err(..))` is a failure to record on the message (its
    /// kind, why, and whether it was transient).
    pub(crate) async fn apply_parked(
        &self,
        tx: &mut I::Tx,
        msg: &ReceivedMessage,
        allow_gap: bool,
    ) -> Result<Result<MessageOutcome, (ParkKind, String, bool)>, StoreError> {
        let event = match &msg.envelope {
            Ok(e) => e,
            Err(e) => {
                return Ok(Err((
                    ParkKind::Unprocessable,
                    format!("cannot be decoded: {e}"),
                    false,
                )))
            }
        };
        let key = AggregateKey::of(event);
        let state = self
            .store
            .aggregates(tx, &self.consumer, std::slice::from_ref(&key))
            .await?
            .pop()
            .unwrap_or_default();
        let v = event.aggregate_version;
        if self.policy.tracks() {
            if let Some(a) = state.applied_version.filter(|a| v <= *a) {
                return Ok(Ok(MessageOutcome::Stale { applied: a }));
            }
            if let Some(expected) = self.gap(state.applied_version, v) {
                if !allow_gap {
                    return Ok(Err((
                        ParkKind::VersionGap,
                        format!("version gap: {key} expected version {expected}, got {v}"),
                        false,
                    )));
                }
            }
        }
        match register_scoped(&self.store, tx, &self.consumer, &[event])
            .await?
            .pop()
            .flatten()
        {
            Some(Registration::Fresh) => {}
            Some(Registration::Duplicate) => return Ok(Ok(MessageOutcome::Duplicate)),
            None => {
                return Ok(Err((
                    ParkKind::Unprocessable,
                    format!(
                        "cannot be deduplicated: its dedup id {} and its id scoped to {key} are \
                         both held by other aggregates' events (an event id made to collide)",
                        event.dedup_id()
                    ),
                    false,
                )))
            }
        }
        if let Err(e) = self.handler.handle(tx, event).await {
            let transient = e.class == outbox_core::ErrorClass::Transient;
            return Ok(Err((ParkKind::Unprocessable, e.to_string(), transient)));
        }
        if self.policy.tracks() {
            let baseline = state.applied_version.is_none() && v > 1;
            self.store
                .advance_versions(
                    tx,
                    &self.consumer,
                    &[VersionAdvance {
                        aggregate: key.clone(),
                        expected: state.applied_version,
                        version: v,
                    }],
                )
                .await?;
            if baseline {
                self.record_baselines(&[(key, v)]);
            }
        }
        Ok(Ok(MessageOutcome::Applied))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Which outcomes let the offset move, and the metric label of each (killed surviving
    /// mutants of `is_final`).
    #[test]
    fn outcomes_are_final_or_not_and_named() {
        let table = [
            (MessageOutcome::Applied, true, "applied"),
            (MessageOutcome::Duplicate, true, "duplicate"),
            (MessageOutcome::Stale { applied: 3 }, true, "stale"),
            (
                MessageOutcome::Parked {
                    id: ParkedId(1),
                    kind: ParkKind::Unprocessable,
                },
                true,
                "parked",
            ),
            (MessageOutcome::Waiting(ParkedId(2)), true, "waiting"),
            (MessageOutcome::AlreadyParked, true, "already_parked"),
            (MessageOutcome::Held, false, "held"),
            (MessageOutcome::Blocked, false, "blocked"),
            (
                MessageOutcome::VersionGap { expected: 4 },
                false,
                "version_gap",
            ),
            (
                MessageOutcome::Failed(HandlerError::transient("x")),
                false,
                "failed",
            ),
        ];
        for (outcome, is_final, name) in table {
            assert_eq!(outcome.is_final(), is_final, "{outcome:?}");
            assert_eq!(outcome.as_str(), name);
        }
    }
}
