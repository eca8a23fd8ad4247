//! The relay side: the real [`Relay::run_once`] over the store under test, wrapped in
//! [`SimStore`] (claim bookkeeping for the invariants, injected store faults, and the relay's
//! seeded bugs), publishing through the [`ScriptedPublisher`] double.
//!
//! A relay's cycle runs as a tokio task. [`Step::Relay`](crate::Step::Relay) starts it and runs
//! it until the double holds its batch (or the cycle ends without publishing);
//! [`Step::Answer`](crate::Step::Answer) answers the batch record by record and runs the cycle
//! to its end (completion, and with prefetch the next claim); a crash aborts the task, so the
//! relay loses its batch in flight and its prefetched claim like a killed process.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_core::prelude::*;
use outbox_core::{
    async_trait, ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, Clock, CompletionReport,
    EventId, Outcome, StoreError,
};
use outbox_testkit::fault::{Fault, FaultyStore};
use uuid::Uuid;

use crate::backend::ShortClaimCheck;
use crate::config::SeededBug;
use crate::invariants::Violations;

/// A claim some relay holds, as the simulation tracks it.
#[derive(Clone, Debug)]
pub(crate) struct HeldClaim {
    pub(crate) relay: usize,
    pub(crate) handle: ClaimHandle,
    pub(crate) granted_at: DateTime<Utc>,
    pub(crate) events: Vec<(EventId, String)>,
    /// Its completion is running (in a race, another relay's claim may see the aggregate free
    /// before this completion returns).
    pub(crate) ending: bool,
}

/// State shared by the relays' stores.
pub(crate) struct RelayShared {
    claims: Mutex<BTreeMap<Uuid, HeldClaim>>,
    /// The latest claim (token) that handed out each event: a completion under an older one
    /// is superseded and must apply nothing to that event (fencing).
    latest_claim: Mutex<BTreeMap<EventId, Uuid>>,
    pub(crate) violations: Violations,
    clock: Arc<dyn Clock>,
    lease: Option<Duration>,
    bug: Option<SeededBug>,
    short_claim_check: Option<ShortClaimCheck>,
    /// Store calls of the relays under way (a prefetch claim runs beside its batch's publish,
    /// so it may still be running when the batch is held).
    in_flight: Arc<AtomicUsize>,
    /// For each event its latest claim handed out inside a run (after the head): that claim
    /// and the event before it in the run (the prefix invariant).
    run_predecessor: Mutex<BTreeMap<EventId, (Uuid, EventId)>>,
    /// Per claim: the (aggregate, version)s whose acknowledgement the simulation returned to
    /// the claim's relay (the send-order invariant).
    acked_in_claim: Mutex<BTreeMap<Uuid, std::collections::BTreeSet<(String, i64)>>>,
}

/// Counts a relay's store call as under way until dropped (also when its task is aborted).
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    fn start(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for RelayShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayShared")
            .field("lease", &self.lease)
            .field("bug", &self.bug)
            .finish_non_exhaustive()
    }
}

impl RelayShared {
    pub(crate) fn new(
        violations: Violations,
        clock: Arc<dyn Clock>,
        mode: ClaimMode,
        bug: Option<SeededBug>,
        short_claim_check: Option<ShortClaimCheck>,
    ) -> Self {
        Self {
            claims: Mutex::new(BTreeMap::new()),
            latest_claim: Mutex::new(BTreeMap::new()),
            violations,
            clock,
            lease: match mode {
                ClaimMode::Lease { duration } => Some(duration),
                _ => None,
            },
            bug,
            short_claim_check,
            in_flight: Arc::default(),
            run_predecessor: Mutex::new(BTreeMap::new()),
            acked_in_claim: Mutex::new(BTreeMap::new()),
        }
    }

    /// For each event handed out inside a run by its latest claim: the event before it.
    pub(crate) fn run_predecessors(&self) -> BTreeMap<EventId, EventId> {
        self.run_predecessor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(e, (_, pred))| (*e, *pred))
            .collect()
    }

    /// The simulation returned an acknowledgement of (`aggregate`, `version`) to the relay
    /// holding `claim`.
    pub(crate) fn note_acked(&self, claim: Uuid, aggregate: &str, version: i64) {
        self.acked_in_claim
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(claim)
            .or_default()
            .insert((aggregate.to_owned(), version));
    }

    /// Whether `claim` handed out a run and an acknowledgement of one of its events went
    /// back to its relay (a crash now falls between two events of the run, or after them).
    pub(crate) fn mid_run(&self, claim: Uuid) -> bool {
        let has_run = self
            .run_predecessor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .any(|(t, _)| *t == claim);
        has_run
            && self
                .acked_in_claim
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(&claim)
                .is_some_and(|s| !s.is_empty())
    }

    /// Whether an acknowledgement of (`aggregate`, `version`) went back to `claim`'s relay.
    pub(crate) fn acked_in(&self, claim: Uuid, aggregate: &str, version: i64) -> bool {
        self.acked_in_claim
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&claim)
            .is_some_and(|s| s.contains(&(aggregate.to_owned(), version)))
    }

    /// How many store calls of the relays are under way.
    pub(crate) fn calls_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    pub(crate) fn claims(&self) -> MutexGuard<'_, BTreeMap<Uuid, HeldClaim>> {
        self.claims.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `claim` still keeps others away: a locked claim until it ends, a lease until
    /// it expires.
    pub(crate) fn live(&self, claim: &HeldClaim) -> bool {
        match self.lease {
            None => true,
            Some(d) => claim.granted_at + d > self.clock.now(),
        }
    }

    pub(crate) fn is_lease(&self) -> bool {
        self.lease.is_some()
    }

    /// The claims of `relay`.
    pub(crate) fn claims_of(&self, relay: usize) -> Vec<HeldClaim> {
        self.claims()
            .values()
            .filter(|c| c.relay == relay)
            .cloned()
            .collect()
    }

    fn set_ending(&self, token: Uuid, on: bool) {
        if let Some(c) = self.claims().get_mut(&token) {
            c.ending = on;
        }
    }

    pub(crate) fn forget(&self, token: Uuid) {
        self.claims().remove(&token);
    }

    /// An operator released every claim of `owner`.
    pub(crate) fn forget_owner(&self, owner: &str) {
        self.claims().retain(|_, c| c.handle.owner != owner);
    }
}

/// The store as relay `relay` sees it: the store under test behind two fault injectors (claim,
/// completion), with the claims it holds tracked, and the relay-side seeded bugs.
pub struct SimStore<S> {
    inner: FaultyStore<FaultyStore<S>>,
    relay: usize,
    shared: Arc<RelayShared>,
}

impl<S> std::fmt::Debug for SimStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimStore")
            .field("relay", &self.relay)
            .finish_non_exhaustive()
    }
}

impl<S: RelayStore> SimStore<S> {
    pub(crate) fn new(
        inner: FaultyStore<FaultyStore<S>>,
        relay: usize,
        shared: Arc<RelayShared>,
    ) -> Self {
        Self {
            inner,
            relay,
            shared,
        }
    }

    fn bug(&self, bug: SeededBug) -> bool {
        self.shared.bug == Some(bug)
    }

    /// Records a new claim requested at `requested_at` (a lease counts from before the
    /// request, so the simulation never thinks a lease lives longer than the store does),
    /// checking that no other relay holds one of its aggregates.
    fn track(&self, batch: &ClaimedBatch, requested_at: DateTime<Utc>) {
        {
            let mut latest = self
                .shared
                .latest_claim
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for rec in &batch.records {
                latest.insert(rec.envelope.event_id, batch.handle.token);
            }
            let mut runs = self
                .shared
                .run_predecessor
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for (k, rec) in batch.records.iter().enumerate() {
                let id = rec.envelope.event_id;
                match k.checked_sub(1).map(|p| &batch.records[p]) {
                    Some(prev) if rec.run_position > 0 => {
                        runs.insert(id, (batch.handle.token, prev.envelope.event_id));
                    }
                    _ => {
                        runs.remove(&id);
                    }
                }
            }
        }
        let mut claims = self.shared.claims();
        for rec in &batch.records {
            let agg = &rec.envelope.aggregate_id;
            for other in claims.values() {
                if other.relay != self.relay
                    && !other.ending
                    && self.shared.live(other)
                    && other.events.iter().any(|(_, a)| a == agg)
                {
                    self.shared.violations.push(format!(
                        "relays {} and {} hold aggregate {agg} at once",
                        other.relay, self.relay
                    ));
                }
            }
        }
        claims.insert(
            batch.handle.token,
            HeldClaim {
                relay: self.relay,
                handle: batch.handle.clone(),
                granted_at: requested_at,
                events: batch
                    .records
                    .iter()
                    .map(|r| (r.envelope.event_id, r.envelope.aggregate_id.clone()))
                    .collect(),
                ending: false,
            },
        );
    }
}

impl<S> SimStore<S> {
    /// The seeded bug's completion: the outcome of the event before each published event of
    /// a run of `claim` is dropped (a completion with a hole, which the store must refuse).
    fn without_run_heads(&self, claim: &ClaimHandle, outcomes: &[Outcome]) -> Vec<Outcome> {
        let runs = self
            .shared
            .run_predecessor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let holes: std::collections::BTreeSet<EventId> = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Published { .. }))
            .filter_map(|o| runs.get(&o.event_id()))
            .filter(|(token, _)| *token == claim.token)
            .map(|(_, pred)| *pred)
            .collect();
        outcomes
            .iter()
            .filter(|o| !holes.contains(&o.event_id()))
            .cloned()
            .collect()
    }
}

/// Outcome `from`, about the event of `to`.
fn retarget(from: &Outcome, to: EventId) -> Outcome {
    match from.clone() {
        Outcome::Published { ack, .. } => Outcome::Published { event_id: to, ack },
        Outcome::Retry { delay, error, .. } => Outcome::Retry {
            event_id: to,
            delay,
            error,
        },
        Outcome::Defer { delay, error, .. } => Outcome::Defer {
            event_id: to,
            delay,
            error,
        },
        Outcome::Park { reason, .. } => Outcome::Park {
            event_id: to,
            reason,
        },
    }
}

fn shifted(outcomes: &[Outcome]) -> Vec<Outcome> {
    let n = outcomes.len();
    (0..n)
        .map(|i| retarget(&outcomes[(i + 1) % n], outcomes[i].event_id()))
        .collect()
}

fn swapped_acks(outcomes: &[Outcome]) -> Vec<Outcome> {
    let acked: Vec<usize> = (0..outcomes.len())
        .filter(|i| matches!(outcomes[*i], Outcome::Published { .. }))
        .collect();
    let mut out = outcomes.to_vec();
    for (k, i) in acked.iter().enumerate() {
        let from = acked[(k + 1) % acked.len()];
        if let (Outcome::Published { ack, .. }, Outcome::Published { ack: mine, .. }) =
            (&outcomes[from], &mut out[*i])
        {
            *mine = ack.clone();
        }
    }
    out
}

#[async_trait]
impl<S: RelayStore> RelayStore for SimStore<S> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimedBatch, StoreError> {
        let _call = InFlight::start(&self.shared.in_flight);
        let prefetch = !self.shared.claims_of(self.relay).is_empty();
        let requested_at = self.shared.clock.now();
        let batch = self.inner.claim(request).await?;
        if let Some(check) = &self.shared.short_claim_check {
            if let Some(v) = check(batch.records.len(), request.limit) {
                self.shared.violations.push(v);
            }
        }
        if batch.is_empty() {
            return Ok(batch);
        }
        self.track(&batch, requested_at);
        let mut batch = batch;
        if self.bug(SeededBug::RunSentAtOnce) {
            // The relay takes every event for a head: a run goes out at once, each version
            // without waiting for the acknowledgement of the one before (so also after its
            // failure).
            for rec in &mut batch.records {
                rec.run_position = 0;
            }
        }
        if self.bug(SeededBug::MarkBeforeAck) {
            let outcomes: Vec<Outcome> = batch
                .records
                .iter()
                .map(|r| Outcome::Published {
                    event_id: r.envelope.event_id,
                    ack: outbox_core::AckMetadata::kafka(crate::runner::TOPIC, 0, -1),
                })
                .collect();
            let _ = self.inner.complete(&batch.handle, &outcomes).await;
        }
        if prefetch && self.bug(SeededBug::StalePrefetch) {
            // The claim is given up at once, yet handed to the relay as if it held it.
            self.inner.release(&batch.handle).await?;
            self.shared.forget(batch.handle.token);
        }
        Ok(batch)
    }

    async fn complete(
        &self,
        claim: &ClaimHandle,
        outcomes: &[Outcome],
    ) -> Result<CompletionReport, StoreError> {
        let _call = InFlight::start(&self.shared.in_flight);
        let outcomes = if self.bug(SeededBug::ShiftedOutcomes) && outcomes.len() > 1 {
            shifted(outcomes)
        } else if self.bug(SeededBug::SwappedAckMetadata) {
            swapped_acks(outcomes)
        } else if self.bug(SeededBug::StoreAcceptsRunHoles) {
            self.without_run_heads(claim, outcomes)
        } else {
            outcomes.to_vec()
        };
        let injected_before = self.inner.faults().injected().len();
        // Events another claim took before this completion started: it must apply nothing to
        // them (fencing).
        let superseded: Vec<EventId> = {
            let latest = self
                .shared
                .latest_claim
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            outcomes
                .iter()
                .map(Outcome::event_id)
                .filter(|id| latest.get(id).is_some_and(|t| *t != claim.token))
                .collect()
        };
        self.shared.set_ending(claim.token, true);
        let result = self.inner.complete(claim, &outcomes).await;
        if let Ok(report) = &result {
            for id in superseded {
                if !report.superseded_events.contains(&id) {
                    self.shared.violations.push(format!(
                        "relay {}'s completion of {id} under a claim that another claim \
                         superseded was applied (fencing)",
                        self.relay
                    ));
                }
            }
        }
        // A completion whose reply was lost took effect: the claim is over all the same.
        let took_effect = result.is_ok()
            || self
                .inner
                .faults()
                .injected()
                .get(injected_before..)
                .is_some_and(|new| new.iter().any(|(_, f)| *f == Fault::AckLost));
        if took_effect {
            self.shared.forget(claim.token);
        } else {
            self.shared.set_ending(claim.token, false);
        }
        result
    }

    async fn release(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        let _call = InFlight::start(&self.shared.in_flight);
        let result = self.inner.release(claim).await;
        if result.is_ok() {
            self.shared.forget(claim.token);
        }
        result
    }
    fn claim_mode(&self) -> ClaimMode {
        self.inner.claim_mode()
    }
    fn locked_claim_timeout(&self) -> Option<Duration> {
        self.inner.locked_claim_timeout()
    }
}

outbox_core::forward_store_roles!(SimStore<S>.inner => append, operator, maintenance, reporting);

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::AckMetadata;
    use outbox_testkit::ManualClock;

    fn published(n: u8) -> Outcome {
        Outcome::Published {
            event_id: EventId::from_parts(ManualClock::epoch(), u128::from(n) << 16),
            ack: AckMetadata::kafka("t", 0, i64::from(n)),
        }
    }

    #[test]
    fn shifting_moves_each_outcome_to_the_previous_record() {
        let o = vec![published(1), published(2)];
        let s = shifted(&o);
        assert_eq!(s[0].event_id(), o[0].event_id());
        assert!(matches!(&s[0], Outcome::Published { ack, .. } if ack.as_kafka().unwrap().2 == 2));
        assert!(matches!(&s[1], Outcome::Published { ack, .. } if ack.as_kafka().unwrap().2 == 1));
    }

    #[test]
    fn swapping_rotates_acks_among_acknowledged_records() {
        let o = vec![published(1), published(2), published(3)];
        let s = swapped_acks(&o);
        let offsets: Vec<i64> = s
            .iter()
            .map(|x| match x {
                Outcome::Published { ack, .. } => ack.as_kafka().unwrap().2,
                _ => -1,
            })
            .collect();
        assert_eq!(offsets, vec![2, 3, 1]);
        assert_eq!(swapped_acks(&o[..1]), o[..1].to_vec(), "one ack stays put");
    }
}
