//! [`ParkedMessages`]: the operator's API over a consumer's parked messages.

use std::sync::Arc;

use outbox_core::{
    AggregateKey, InboxAction, InboxAuditEntry, InboxParking, ParkedChange, ParkedFilter, ParkedId,
    ParkedMessage, ParkedStatus, ReceivedMessage, RetryRequest, StoreError, StoreErrorKind,
    VersionAdvance,
};
use tracing::{info, warn};

use crate::handler::Handler;
use crate::processor::{InboxProcessor, MessageOutcome};

/// Pauses before the second and third attempt of a requested retry that failed transiently.
const REQUESTED_RETRY_BACKOFF_MS: [u64; 2] = [200, 800];

/// Why an operator action was refused or failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// No parked message with this id for this consumer.
    #[error("no parked message {0} for this consumer")]
    NotFound(ParkedId),
    /// The message is resolved already (applied, skipped or discarded).
    #[error("parked message {id} is {} already", status.as_str())]
    NotOpen {
        /// The message.
        id: ParkedId,
        /// Its state.
        status: ParkedStatus,
    },
    /// A discard needs a reason (and every action an actor).
    #[error("{0}")]
    Invalid(String),
    /// The store failed; nothing of the failing step was written.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What an operator action did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseReport {
    /// Messages applied (the target and released waiting ones).
    pub applied: usize,
    /// Messages found to be duplicates or stale: resolved without effect.
    pub skipped: usize,
    /// Messages discarded (the target of a discard).
    pub discarded: usize,
    /// The message that failed again and now blocks its aggregate, with why.
    pub still_parked: Option<(ParkedId, String)>,
    /// Whether that failure was transient (a lost connection, a lock timeout): trying again
    /// may succeed.
    pub transient: bool,
    /// Whether the aggregate was released (nothing of it is parked any more).
    pub released: bool,
    /// Versions never seen that the operator declared never to come
    /// ([`ParkedMessages::discard_skipping_to`]); 0 for every other action.
    pub skipped_versions: i64,
}

impl ReleaseReport {
    fn summary(&self) -> String {
        let mut s = format!(
            "applied {}, skipped {}, discarded {}",
            self.applied, self.skipped, self.discarded
        );
        if let Some((id, why)) = &self.still_parked {
            s.push_str(&format!("; {id} still parked: {why}"));
        }
        if self.skipped_versions > 0 {
            s.push_str(&format!(
                "; {} unseen version(s) skipped by the operator",
                self.skipped_versions
            ));
        }
        if self.released {
            s.push_str("; aggregate released");
        }
        s
    }
}

/// The operator's API over the parked messages of one consumer: list, show, retry, discard,
/// audit trail. Every action is written to the audit trail in the same transaction as its first
/// effect.
///
/// * **retry** applies the message now, through the same handler and checks as the engine (a
///   version gap of the retried message is accepted: the operator decided the missing versions
///   will not come), then releases the aggregate's waiting messages in order (aggregate
///   version, then arrival). A message that fails again stops the release and becomes the
///   aggregate's parked head, with its attempts counted.
/// * **discard** resolves the message without effect (registered, so a redelivery is a
///   duplicate), with a recorded reason; then releases the waiting messages as retry does. Its
///   version counts as applied only as far as that skips nothing: when every version below it
///   was applied or discarded and no lower one is still open (so once a missing lower version
///   is applied, the engine counts it). A discard never moves the
///   applied version over a version that was not seen; an operator who knows missing versions
///   will never come says so explicitly, and how far, with
///   [`discard_skipping_to`](ParkedMessages::discard_skipping_to) (audited).
///
/// Each released message commits in its own transaction, which locks the aggregate against
/// the engine parking more messages behind it at that moment; the engine's messages of that
/// aggregate wait (parked as waiting) until the release is done and are picked up by it.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use std::time::Duration;
/// use outbox_core::{async_trait, Envelope, InboxParking, ParkedFilter, Publisher};
/// use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
/// use outbox_testkit::{MemoryDb, MemoryInboxStore, MemoryLog, MemoryTx};
///
/// /// Refuses events flagged as broken until the operator fixes the data.
/// struct Strict;
/// #[async_trait]
/// impl Handler<MemoryTx> for Strict {
///     async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
///         if tx.get("fixes", &e.aggregate_id).is_none() && e.event_type == "order.broken" {
///             return Err(HandlerError::permanent("unknown customer"));
///         }
///         tx.put("orders", &e.aggregate_id, serde_json::json!(e.aggregate_version));
///         Ok(())
///     }
/// }
///
/// let db = MemoryDb::default();
/// let log = MemoryLog::new("orders", 1);
/// let broken = Envelope::builder("order", "o-1", 1, "order.broken").build().unwrap();
/// let next = Envelope::builder("order", "o-1", 2, "order.paid").build().unwrap();
/// let other = Envelope::builder("order", "o-2", 1, "order.paid").build().unwrap();
/// log.publish(&[&broken, &next, &other]).await;
///
/// let processor = InboxProcessor::new("billing", MemoryInboxStore::new(&db), Strict);
/// let mut engine = ConsumerEngine::new(
///     log.consumer("billing", &["orders"]), processor, EngineConfig::default(), 1,
/// ).unwrap();
/// let report = engine.run_until_quiet(Duration::from_millis(50)).await.unwrap();
/// // o-1 v1 parked, o-1 v2 waits behind it, o-2 flowed; every offset is committed.
/// assert_eq!((report.parked, report.waiting, report.applied), (1, 1, 1));
/// assert_eq!(log.committed("billing", "orders", 0), Some(3));
///
/// // The operator fixes the data and retries: v1 then v2 are applied, in order.
/// let mut tx = db.begin();
/// tx.put("fixes", "o-1", serde_json::json!(true));
/// tx.commit().unwrap();
/// let ops = engine.parked();
/// let head = ops.list(&ParkedFilter::open()).await.unwrap()[0].id;
/// let done = ops.retry(head, "alice", "customer created").await.unwrap();
/// assert_eq!((done.applied, done.released), (2, true));
/// assert_eq!(db.read("orders", "o-1"), Some(serde_json::json!(2)));
/// assert_eq!(ops.audit_trail(Some(head)).await.unwrap()[0].actor, "alice");
/// # });
/// ```
#[derive(Debug)]
pub struct ParkedMessages<I, H> {
    processor: Arc<InboxProcessor<I, H>>,
}

impl<I, H> Clone for ParkedMessages<I, H> {
    fn clone(&self) -> Self {
        Self {
            processor: self.processor.clone(),
        }
    }
}

impl<I, H> ParkedMessages<I, H>
where
    I: InboxParking,
    H: Handler<I::Tx>,
{
    /// The API over `processor`'s consumer (use the same handler and version policy as the
    /// engine).
    pub fn new(processor: InboxProcessor<I, H>) -> Self {
        Self::from_shared(Arc::new(processor))
    }

    pub(crate) fn from_shared(processor: Arc<InboxProcessor<I, H>>) -> Self {
        Self { processor }
    }

    fn store(&self) -> &I {
        self.processor.store()
    }

    fn consumer(&self) -> &str {
        self.processor.consumer()
    }

    /// Parked messages, oldest first.
    pub async fn list(&self, filter: &ParkedFilter) -> Result<Vec<ParkedMessage>, StoreError> {
        self.store().list_parked(self.consumer(), filter).await
    }

    /// One parked message (resolved ones too).
    pub async fn show(&self, id: ParkedId) -> Result<Option<ParkedMessage>, StoreError> {
        self.store().parked_message(self.consumer(), id).await
    }

    /// The audit trail (of one message, or all), oldest first.
    pub async fn audit_trail(
        &self,
        id: Option<ParkedId>,
    ) -> Result<Vec<InboxAuditEntry>, StoreError> {
        self.store().audit_trail(self.consumer(), id).await
    }

    async fn target(&self, id: ParkedId) -> Result<ParkedMessage, OperatorError> {
        let m = self.show(id).await?.ok_or(OperatorError::NotFound(id))?;
        if !m.status.is_open() {
            return Err(OperatorError::NotOpen {
                id,
                status: m.status,
            });
        }
        Ok(m)
    }

    fn check_actor(actor: &str) -> Result<(), OperatorError> {
        if actor.trim().is_empty() {
            return Err(OperatorError::Invalid(
                "an operator action needs an actor".into(),
            ));
        }
        Ok(())
    }

    /// Applies parked message `id` now, then releases its aggregate's waiting messages.
    pub async fn retry(
        &self,
        id: ParkedId,
        actor: &str,
        reason: &str,
    ) -> Result<ReleaseReport, OperatorError> {
        Self::check_actor(actor)?;
        let target = self.target(id).await?;
        let mut report = ReleaseReport::default();
        match target.record.aggregate.clone() {
            Some(key) => {
                self.release(
                    &key,
                    Some(id),
                    InboxAction::Retry,
                    actor,
                    reason,
                    &mut report,
                )
                .await?
            }
            None => {
                self.retry_standalone(&target, actor, reason, &mut report)
                    .await?
            }
        }
        info!(consumer = %self.consumer(), parked_id = %id, actor, outcome = %report.summary(), "operator retry");
        Ok(report)
    }

    /// Records, audited, that parked message `id` is to be retried by the consumer service: a
    /// process that does not have the consumer's handler (the `outbox` command) asks, and the
    /// [`ConsumerEngine`](crate::ConsumerEngine) of the consumer performs the retry at its next
    /// check ([`EngineConfig::retry_requests_interval`](crate::EngineConfig)) through
    /// [`retry`](Self::retry), then clears the request. A second request replaces a pending one.
    /// Refused for an unknown or resolved message.
    pub async fn request_retry(
        &self,
        id: ParkedId,
        actor: &str,
        reason: &str,
    ) -> Result<RetryRequest, OperatorError> {
        Self::check_actor(actor)?;
        self.target(id).await?;
        let store = self.store();
        let consumer = self.consumer().to_owned();
        let request = RetryRequest::new(actor, reason, chrono::Utc::now());
        let mut tx = store.begin().await?;
        let step = async {
            let current = store.parked_in(&mut tx, &consumer, id).await?;
            match current {
                None => return Err(OperatorError::NotFound(id)),
                Some(m) if !m.status.is_open() => {
                    return Err(OperatorError::NotOpen {
                        id,
                        status: m.status,
                    })
                }
                Some(_) => {}
            }
            store
                .request_retry(&mut tx, &consumer, id, &request)
                .await?;
            store
                .audit(
                    &mut tx,
                    &InboxAuditEntry::new(
                        &consumer,
                        id,
                        InboxAction::RequestRetry,
                        actor,
                        reason,
                        "retry requested; the consumer service performs it at its next check",
                        request.requested_at,
                    ),
                )
                .await?;
            Ok::<(), OperatorError>(())
        }
        .await;
        match step {
            Ok(()) => store.commit(tx).await?,
            Err(e) => {
                let _ = store.rollback(tx).await;
                return Err(e);
            }
        }
        info!(consumer = %consumer, parked_id = %id, actor, reason, "operator retry requested");
        Ok(request)
    }

    /// Open messages with a pending retry request, oldest request first.
    pub async fn requested_retries(&self) -> Result<Vec<ParkedMessage>, StoreError> {
        self.store().requested_retries(self.consumer()).await
    }

    /// Performs the pending retry requests, oldest first, each through [`retry`](Self::retry)
    /// with the requester as the actor (the retry and its outcome are audited), and clears each
    /// request that was acted on: after a retry, also one that failed again (the message stays
    /// parked with its attempts counted), and for a message resolved meanwhile. A retry that
    /// fails transiently (the handler's error is transient: a lost connection, a lock timeout)
    /// is tried again at once, up to three attempts in all with a short backoff, before it
    /// counts as failed again. A request whose retry failed in the store stays, for the next
    /// check. Returns what each retry did.
    pub async fn perform_requested_retries(
        &self,
    ) -> Result<Vec<(ParkedId, Result<ReleaseReport, OperatorError>)>, StoreError> {
        let requested = self.requested_retries().await?;
        let mut done = Vec::with_capacity(requested.len());
        for m in requested {
            let Some(request) = m.retry_request.clone() else {
                continue;
            };
            let reason = if request.reason.trim().is_empty() {
                "requested retry".to_owned()
            } else {
                format!("requested retry: {}", request.reason)
            };
            // A transient failure (a lost connection, a lock timeout) is tried again a few
            // times with a short backoff before the request counts as performed; each attempt
            // is audited and counted on the message.
            let mut r = self.retry(m.id, &request.actor, &reason).await;
            for pause_ms in REQUESTED_RETRY_BACKOFF_MS {
                if !matches!(&r, Ok(report) if report.still_parked.is_some() && report.transient) {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
                r = self.retry(m.id, &request.actor, &reason).await;
            }
            let acted = match &r {
                Ok(_) | Err(OperatorError::NotFound(_) | OperatorError::NotOpen { .. }) => true,
                Err(OperatorError::Store(e)) => e.kind == StoreErrorKind::NotFound,
                Err(_) => true,
            };
            match &r {
                Ok(report) => {
                    info!(consumer = %self.consumer(), parked_id = %m.id, actor = %request.actor, outcome = %report.summary(), "requested retry performed")
                }
                Err(e) => {
                    warn!(consumer = %self.consumer(), parked_id = %m.id, error = %e, "requested retry failed")
                }
            }
            if acted {
                self.clear_request(m.id, request.requested_at).await?;
            }
            done.push((m.id, r));
        }
        Ok(done)
    }

    async fn clear_request(
        &self,
        id: ParkedId,
        requested_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), StoreError> {
        let store = self.store();
        let mut tx = store.begin().await?;
        match store
            .clear_retry_request(&mut tx, self.consumer(), id, requested_at)
            .await
        {
            Ok(()) => store.commit(tx).await,
            Err(e) => {
                let _ = store.rollback(tx).await;
                Err(e)
            }
        }
    }

    /// Resolves parked message `id` without effect, with a reason, then releases its
    /// aggregate's waiting messages (only when `id` was the head: discarding a waiting message
    /// leaves the head parked).
    ///
    /// A discard never moves the aggregate's applied version over a version that was not seen:
    /// the discarded version counts as applied only when every version between the applied one
    /// and it was applied or discarded too (counted from version 1 when nothing was applied
    /// yet), and no other open message of the aggregate waits at or below it. A discarded
    /// version above a missing one (a bogus record with a far-future version, or one after a
    /// version that never came) counts as nothing: the missing versions still apply when they
    /// come, and once they are applied it counts (the engine reads the discarded versions of
    /// an aggregate in which it finds a gap), so the version after it is no gap. To declare
    /// that versions which were never seen will never come, use
    /// [`discard_skipping_to`](Self::discard_skipping_to).
    pub async fn discard(
        &self,
        id: ParkedId,
        actor: &str,
        reason: &str,
    ) -> Result<ReleaseReport, OperatorError> {
        self.discard_inner(id, actor, reason, None).await
    }

    /// [`discard`](Self::discard), and the operator's explicit declaration that the versions of
    /// the aggregate up to and including `skip_to` that were not seen will never come: the
    /// applied version moves up to `skip_to` in the discard's transaction, so a later message
    /// at or below it is stale (never applied). The audit entry and
    /// [`ReleaseReport::skipped_versions`] say how many versions were swallowed.
    ///
    /// Refused ([`OperatorError::Invalid`], nothing written) when the message has no readable
    /// version, when `skip_to` is below its version, or when another open message of the
    /// aggregate (or one whose version is unknown) waits at or below `skip_to` (it would turn
    /// stale: discard or retry it first).
    pub async fn discard_skipping_to(
        &self,
        id: ParkedId,
        actor: &str,
        reason: &str,
        skip_to: i64,
    ) -> Result<ReleaseReport, OperatorError> {
        self.discard_inner(id, actor, reason, Some(skip_to)).await
    }

    async fn discard_inner(
        &self,
        id: ParkedId,
        actor: &str,
        reason: &str,
        skip_to: Option<i64>,
    ) -> Result<ReleaseReport, OperatorError> {
        Self::check_actor(actor)?;
        if reason.trim().is_empty() {
            return Err(OperatorError::Invalid(
                "a discard needs a reason: it is recorded in the audit trail".into(),
            ));
        }
        let target = self.target(id).await?;
        if skip_to.is_some() && !self.processor.version_policy().tracks() {
            return Err(OperatorError::Invalid(
                "this consumer keeps no versions (VersionPolicy::Unchecked): there is nothing to \
                 skip"
                    .into(),
            ));
        }
        let store = self.store();
        let consumer = self.consumer().to_owned();
        let mut report = ReleaseReport {
            discarded: 1,
            ..ReleaseReport::default()
        };
        let mut tx = store.begin().await?;
        let step = async {
            let (open_rest, was_head, lowest_other) = match &target.record.aggregate {
                Some(key) => {
                    let open = store.open_parked_of(&mut tx, &consumer, key).await?;
                    let Some(me) = open.iter().find(|m| m.id == id) else {
                        // Resolved meanwhile (another operator retried or discarded it): say
                        // how, as read under the aggregate's lock.
                        let status = store
                            .parked_in(&mut tx, &consumer, id)
                            .await?
                            .map_or(ParkedStatus::Discarded, |m| m.status);
                        return Err(OperatorError::NotOpen { id, status });
                    };
                    // The lowest version still open besides this one (unknown versions sort
                    // first): no version at or above it may count as applied yet, or that
                    // message, which nobody discarded, would turn stale and be lost. At the
                    // same version too: the outbox does not forbid two events of one aggregate
                    // with one version.
                    let lowest_other = open
                        .iter()
                        .filter(|m| m.id != id)
                        .map(|m| m.record.aggregate_version.unwrap_or(i64::MIN))
                        .min();
                    (
                        open.len() - 1,
                        me.status == ParkedStatus::Parked,
                        lowest_other,
                    )
                }
                None => (0, true, None),
            };
            if let Some(to) = skip_to {
                let v = target.record.aggregate_version.ok_or_else(|| {
                    OperatorError::Invalid(format!(
                        "parked message {id} has no readable version: there is nothing to skip to"
                    ))
                })?;
                if to < v {
                    return Err(OperatorError::Invalid(format!(
                        "--skip-to {to} is below the discarded message's version {v}"
                    )));
                }
                if let Some(w) = lowest_other.filter(|w| *w <= to) {
                    return Err(OperatorError::Invalid(format!(
                        "another open message of the aggregate waits at version {} (at or below \
                         {to}): skipping would make it stale; retry or discard it first",
                        if w == i64::MIN {
                            "unknown".to_owned()
                        } else {
                            w.to_string()
                        }
                    )));
                }
            }
            if let Ok(event) = target.record.decode() {
                self.processor
                    .register_without_effect(&mut tx, &event)
                    .await?;
            }
            store
                .change_parked(
                    &mut tx,
                    &consumer,
                    id,
                    &ParkedChange::Resolved(ParkedStatus::Discarded),
                )
                .await?;
            let mut skipped = None;
            if let Some(key) = &target.record.aggregate {
                if let Some(to) = skip_to {
                    skipped = self
                        .skip_to(&mut tx, key, to, target.record.aggregate_version)
                        .await?;
                }
                self.count_discarded(&mut tx, key, lowest_other, target.record.aggregate_version)
                    .await?;
                if open_rest == 0 {
                    store.unblock(&mut tx, &consumer, key).await?;
                }
            }
            if open_rest == 0 {
                report.released = true;
            }
            let mut outcome = if open_rest == 0 {
                "discarded; nothing waits behind it".to_owned()
            } else if was_head {
                format!("discarded; releasing {open_rest} waiting message(s)")
            } else {
                // Not the head: nothing is released, the head stays where it is.
                format!("discarded; {open_rest} other message(s) of its aggregate stay open")
            };
            if let (Some(to), Some((from, unseen))) = (skip_to, skipped) {
                outcome.push_str(&format!(
                    "; versions skipped by the operator: applied version moved from {} to {to}, \
                     {unseen} version(s) never seen declared never to come",
                    from.map_or_else(|| "none".to_owned(), |f| f.to_string())
                ));
            } else if let Some(to) = skip_to {
                outcome.push_str(&format!(
                    "; --skip-to {to}: the applied version was there already, nothing skipped"
                ));
            }
            store
                .audit(
                    &mut tx,
                    &InboxAuditEntry::new(
                        &consumer,
                        id,
                        InboxAction::Discard,
                        actor,
                        reason,
                        outcome,
                        chrono::Utc::now(),
                    ),
                )
                .await?;
            Ok::<(usize, bool, Option<(Option<i64>, i64)>), OperatorError>((
                open_rest, was_head, skipped,
            ))
        }
        .await;
        let (open_rest, was_head) = match step {
            Ok((n, head, skipped)) => {
                store.commit(tx).await?;
                report.skipped_versions = skipped.map_or(0, |(_, n)| n);
                (n, head)
            }
            Err(e) => {
                let _ = store.rollback(tx).await;
                return Err(e);
            }
        };
        if let (Some(key), true) = (&target.record.aggregate, open_rest > 0 && was_head) {
            // Only a discarded head unblocks the rest; a discarded waiting message leaves the
            // head in place, and the release stops at it.
            self.release(key, None, InboxAction::Discard, actor, reason, &mut report)
                .await?;
        }
        info!(consumer = %consumer, parked_id = %id, actor, reason, skip_to, outcome = %report.summary(), "operator discard");
        Ok(report)
    }

    async fn retry_standalone(
        &self,
        target: &ParkedMessage,
        actor: &str,
        reason: &str,
        report: &mut ReleaseReport,
    ) -> Result<(), OperatorError> {
        let store = self.store();
        let consumer = self.consumer().to_owned();
        let msg = to_message(target);
        let mut tx = store.begin().await?;
        let current = store.parked_in(&mut tx, &consumer, target.id).await?;
        if !current.as_ref().is_some_and(|m| m.status.is_open()) {
            let _ = store.rollback(tx).await;
            return Err(OperatorError::NotOpen {
                id: target.id,
                status: current.map_or(ParkedStatus::Discarded, |m| m.status),
            });
        }
        let applied = self.processor.apply_parked(&mut tx, &msg, true).await;
        let (change, outcome) = match applied {
            Ok(Ok(o)) => (resolution(&o, report), o.as_str().to_owned()),
            Ok(Err((kind, why, transient))) => {
                let _ = store.rollback(tx).await;
                tx = store.begin().await?;
                report.still_parked = Some((target.id, why.clone()));
                report.transient = transient;
                (
                    ParkedChange::Failed {
                        kind,
                        reason: why.clone(),
                        attempts: target.attempts + 1,
                    },
                    format!("failed again: {why}"),
                )
            }
            Err(e) => {
                let _ = store.rollback(tx).await;
                return Err(e.into());
            }
        };
        let r = async {
            store
                .change_parked(&mut tx, &consumer, target.id, &change)
                .await?;
            store
                .audit(
                    &mut tx,
                    &InboxAuditEntry::new(
                        &consumer,
                        target.id,
                        InboxAction::Retry,
                        actor,
                        reason,
                        outcome,
                        chrono::Utc::now(),
                    ),
                )
                .await
        }
        .await;
        match r {
            Ok(()) => store.commit(tx).await?,
            Err(e) => {
                let _ = store.rollback(tx).await;
                return Err(e.into());
            }
        }
        report.released = report.still_parked.is_none();
        Ok(())
    }

    /// Counts discarded versions of `key` (and `also`, discarded in `tx`) as applied, in `tx`,
    /// as far as that skips nothing:
    /// from the applied version (0 when none yet) up through each next version that was
    /// discarded, and never to `below` or beyond (the lowest version still open, `None` when
    /// nothing of the aggregate is open any more). A discarded version above a version that
    /// was never seen stays uncounted, so the missing version still applies when it comes.
    async fn count_discarded(
        &self,
        tx: &mut I::Tx,
        key: &AggregateKey,
        below: Option<i64>,
        also: Option<i64>,
    ) -> Result<(), StoreError> {
        if !self.processor.version_policy().tracks() {
            return Ok(());
        }
        let mut discarded: std::collections::BTreeSet<i64> = self
            .store()
            .discarded_of(tx, self.consumer(), key)
            .await?
            .into_iter()
            .filter_map(|m| m.record.decode().ok())
            .map(|e| e.aggregate_version)
            .collect();
        // The version discarded in `tx` itself (a store may read committed state only).
        discarded.extend(also);
        if discarded.is_empty() {
            return Ok(());
        }
        let state = self.state_of(tx, key).await?;
        let mut next = state.applied_version.unwrap_or(0);
        while next < i64::MAX
            && discarded.contains(&(next + 1))
            && below.is_none_or(|b| next + 1 < b)
        {
            next += 1;
        }
        if state.applied_version.unwrap_or(0) < next {
            self.store()
                .advance_versions(
                    tx,
                    self.consumer(),
                    &[VersionAdvance {
                        aggregate: key.clone(),
                        expected: state.applied_version,
                        version: next,
                    }],
                )
                .await?;
        }
        Ok(())
    }

    /// An operator's skip: moves `key`'s applied version up to `to` in `tx`. Returns the
    /// version it moved from and how many versions it swallowed without anyone seeing them
    /// (the versions between, less the discarded ones); `None` when it was there already.
    async fn skip_to(
        &self,
        tx: &mut I::Tx,
        key: &AggregateKey,
        to: i64,
        discarded_now: Option<i64>,
    ) -> Result<Option<(Option<i64>, i64)>, StoreError> {
        let state = self.state_of(tx, key).await?;
        if state.applied_version.is_some_and(|a| a >= to) {
            return Ok(None);
        }
        let from = state.applied_version;
        let mut seen: std::collections::BTreeSet<i64> = self
            .store()
            .discarded_of(tx, self.consumer(), key)
            .await?
            .into_iter()
            .filter_map(|m| m.record.aggregate_version)
            .collect();
        seen.extend(discarded_now);
        let lo = from.unwrap_or(0) + 1;
        let unseen = (to - lo + 1) - seen.range(lo..=to).count() as i64;
        self.store()
            .advance_versions(
                tx,
                self.consumer(),
                &[VersionAdvance {
                    aggregate: key.clone(),
                    expected: from,
                    version: to,
                }],
            )
            .await?;
        warn!(consumer = %self.consumer(), aggregate = %key, from = ?from, to, unseen, "operator skip: versions never seen declared never to come");
        Ok(Some((from, unseen)))
    }

    async fn state_of(
        &self,
        tx: &mut I::Tx,
        key: &AggregateKey,
    ) -> Result<outbox_core::AggregateState, StoreError> {
        Ok(self
            .store()
            .aggregates(tx, self.consumer(), std::slice::from_ref(key))
            .await?
            .pop()
            .unwrap_or_default())
    }

    /// Releases `key`'s open messages in order, one transaction each, until none is left or
    /// one fails again. `retried` is the message whose version gap the operator accepts. The
    /// audit entry of the action is written with the first step.
    async fn release(
        &self,
        key: &AggregateKey,
        retried: Option<ParkedId>,
        action: InboxAction,
        actor: &str,
        reason: &str,
        report: &mut ReleaseReport,
    ) -> Result<(), OperatorError> {
        let store = self.store();
        let consumer = self.consumer().to_owned();
        // The discard wrote its own audit entry; a retry audits with its first step.
        let mut audit_pending = action == InboxAction::Retry;
        let audit_id = retried;
        loop {
            let mut tx = store.begin().await?;
            let open = match store.open_parked_of(&mut tx, &consumer, key).await {
                Ok(o) => o,
                Err(e) => {
                    let _ = store.rollback(tx).await;
                    return Err(e.into());
                }
            };
            if let Some(id) = retried.filter(|_| audit_pending) {
                if !open.iter().any(|m| m.id == id) {
                    // Resolved by someone else meanwhile (applied, or discarded by another
                    // operator): say which.
                    let status = match store.parked_in(&mut tx, &consumer, id).await {
                        Ok(Some(m)) => m.status,
                        Ok(None) => {
                            let _ = store.rollback(tx).await;
                            return Err(OperatorError::NotFound(id));
                        }
                        Err(e) => {
                            let _ = store.rollback(tx).await;
                            return Err(e.into());
                        }
                    };
                    let _ = store.rollback(tx).await;
                    return Err(OperatorError::NotOpen { id, status });
                }
            }
            let Some(first) = open.first().cloned() else {
                // Nothing open (someone else released it): make sure the mark is gone.
                let r = async {
                    self.count_discarded(&mut tx, key, None, None).await?;
                    store.unblock(&mut tx, &consumer, key).await
                }
                .await;
                match r {
                    Ok(()) => store.commit(tx).await?,
                    Err(e) => {
                        let _ = store.rollback(tx).await;
                        return Err(e.into());
                    }
                }
                report.released = true;
                return Ok(());
            };
            let allow_gap = retried == Some(first.id);
            let msg = to_message(&first);
            // Versions discarded below this one count as applied now (not earlier: a lower
            // version waiting before them would have been skipped as stale), as far as that
            // skips no version that was never seen.
            let below = first.record.aggregate_version.unwrap_or(i64::MIN);
            if let Err(e) = self.count_discarded(&mut tx, key, Some(below), None).await {
                let _ = store.rollback(tx).await;
                return Err(e.into());
            }
            let applied = match self.processor.apply_parked(&mut tx, &msg, allow_gap).await {
                Ok(a) => a,
                Err(e) => {
                    let _ = store.rollback(tx).await;
                    return Err(e.into());
                }
            };
            let last = open.len() == 1;
            let audit = |outcome: String| {
                InboxAuditEntry::new(
                    &consumer,
                    audit_id.unwrap_or(first.id),
                    action,
                    actor,
                    reason,
                    outcome,
                    chrono::Utc::now(),
                )
            };
            match applied {
                Ok(outcome) => {
                    let change = resolution(&outcome, report);
                    let r = async {
                        store
                            .change_parked(&mut tx, &consumer, first.id, &change)
                            .await?;
                        if last {
                            self.count_discarded(&mut tx, key, None, None).await?;
                            store.unblock(&mut tx, &consumer, key).await?;
                        }
                        if audit_pending {
                            store
                                .audit(
                                    &mut tx,
                                    &audit(format!(
                                        "{} {} (v{})",
                                        outcome.as_str(),
                                        first.id,
                                        first.record.aggregate_version.unwrap_or(0)
                                    )),
                                )
                                .await?;
                        }
                        Ok::<(), StoreError>(())
                    }
                    .await;
                    match r {
                        Ok(()) => store.commit(tx).await?,
                        Err(e) => {
                            let _ = store.rollback(tx).await;
                            return Err(e.into());
                        }
                    }
                    audit_pending = false;
                    if last {
                        report.released = true;
                        return Ok(());
                    }
                }
                Err((kind, why, transient)) => {
                    let _ = store.rollback(tx).await;
                    let mut tx = store.begin().await?;
                    // The message may have been resolved meanwhile (another operator discarded
                    // it while its handler ran): then it is not failed again; the release goes
                    // on with what is open now.
                    let still_open = match store.open_parked_of(&mut tx, &consumer, key).await {
                        Ok(open) => open.iter().any(|m| m.id == first.id),
                        Err(e) => {
                            let _ = store.rollback(tx).await;
                            return Err(e.into());
                        }
                    };
                    if !still_open {
                        let _ = store.rollback(tx).await;
                        continue;
                    }
                    report.transient = transient;
                    warn!(consumer = %consumer, parked_id = %first.id, error = %why, "released message failed again; it now blocks its aggregate");
                    let r = async {
                        store
                            .change_parked(
                                &mut tx,
                                &consumer,
                                first.id,
                                &ParkedChange::Failed {
                                    kind,
                                    reason: why.clone(),
                                    attempts: first.attempts + 1,
                                },
                            )
                            .await?;
                        if audit_pending {
                            store
                                .audit(&mut tx, &audit(format!("failed again: {why}")))
                                .await?;
                        }
                        Ok::<(), StoreError>(())
                    }
                    .await;
                    match r {
                        Ok(()) => store.commit(tx).await?,
                        Err(e) => {
                            let _ = store.rollback(tx).await;
                            return Err(e.into());
                        }
                    }
                    report.still_parked = Some((first.id, why));
                    return Ok(());
                }
            }
        }
    }
}

fn resolution(outcome: &MessageOutcome, report: &mut ReleaseReport) -> ParkedChange {
    match outcome {
        MessageOutcome::Applied => {
            report.applied += 1;
            ParkedChange::Resolved(ParkedStatus::Applied)
        }
        _ => {
            report.skipped += 1;
            ParkedChange::Resolved(ParkedStatus::Skipped)
        }
    }
}

fn to_message(m: &ParkedMessage) -> ReceivedMessage {
    ReceivedMessage::from_record(
        m.record.position.clone(),
        m.record.key.clone(),
        m.record.headers.clone(),
        m.record.value.clone(),
        None,
    )
}
