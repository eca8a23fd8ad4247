//! The outbox checks, one per contract clause of [`OutboxStore`]. Each takes a fresh
//! [`OutboxHarness`].

use std::collections::BTreeSet;

use outbox_core::prelude::*;
use outbox_core::{
    AckMetadata, ClaimMode, ClaimRequest, ClaimedBatch, Classify, Envelope, ErrorClass, EventId,
    LastError, OperatorAction, Outcome, ParkKind, ParkReason, StoreErrorKind,
};

use super::{event, not_applicable, unique, OutboxHarness};
use crate::{batch_layout as layout, claim_run, run_layout as run_of};

fn agg(name: &str) -> String {
    format!("{name}-{}", unique())
}

async fn append_committed<H: OutboxHarness>(h: &H, store: &H::Store, events: &[Envelope]) {
    let mut tx = h.begin().await;
    store.append(&mut tx, events).await.expect("append");
    h.commit(tx).await.expect("commit");
}

async fn claim<S: OutboxStore>(store: &S, owner: &str, limit: usize) -> ClaimedBatch {
    store
        .claim(&ClaimRequest::new(owner, limit))
        .await
        .expect("claim")
}

fn ids(batch: &ClaimedBatch) -> BTreeSet<EventId> {
    batch.records.iter().map(|r| r.envelope.event_id).collect()
}

fn set(events: &[&Envelope]) -> BTreeSet<EventId> {
    events.iter().map(|e| e.event_id).collect()
}

fn published(event_id: EventId, offset: i64) -> Outcome {
    Outcome::Published {
        event_id,
        ack: AckMetadata::kafka("conformance", 0, offset),
    }
}

fn publish_all(batch: &ClaimedBatch) -> Vec<Outcome> {
    batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| published(r.envelope.event_id, i as i64))
        .collect()
}

fn last_error(class: ErrorClass) -> LastError {
    LastError {
        class,
        kind: "invalid_record".into(),
        message: "injected by the conformance suite".into(),
    }
}

fn park(event_id: EventId) -> Outcome {
    Outcome::Park {
        event_id,
        reason: ParkReason {
            kind: ParkKind::PermanentError,
            error: last_error(ErrorClass::Permanent),
        },
    }
}

/// The claim modes the backend supports: lease (with the harness's duration), then locked
/// transaction.
fn claim_modes(caps: &super::Capabilities) -> Vec<ClaimMode> {
    [
        caps.lease.then(|| caps.lease_mode()),
        caps.locked_transaction
            .then_some(ClaimMode::LockedTransaction),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// A store in the mode the checks prefer: lease if supported, else locked transaction.
async fn default_store<H: OutboxHarness>(h: &H) -> H::Store {
    let caps = h.capabilities();
    if caps.lease {
        h.store(caps.lease_mode()).await
    } else {
        h.store(ClaimMode::LockedTransaction).await
    }
}

/// Appends `missing`, the version a held head waits for, and publishes it, then the held
/// head, one claim each after the gap's re-check delay, so that the next mode of a check starts
/// from an empty backlog.
async fn fill_the_gap<H: OutboxHarness>(
    h: &H,
    store: &H::Store,
    mode: ClaimMode,
    missing: &Envelope,
    held: &Envelope,
) {
    let caps = h.capabilities();
    append_committed(h, store, std::slice::from_ref(missing)).await;
    for expected in [missing, held] {
        h.advance(caps.gap_timeout.min(std::time::Duration::from_secs(1)) + caps.time_step)
            .await;
        let b = claim(store, "r", 10).await;
        assert_eq!(ids(&b), set(&[expected]), "{mode:?}");
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
    }
}

/// Parks `e` (which must be its aggregate's head and due) through a claim.
async fn park_head<H: OutboxHarness>(store: &H::Store, e: &Envelope) {
    let batch = claim(store, "parker", 100).await;
    assert!(
        ids(&batch).contains(&e.event_id),
        "setup: {} should be claimable",
        e.event_id
    );
    let rep = store
        .complete(&batch.handle, &[park(e.event_id)])
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1, "setup: park outcome applied");
}

/// Atomic append: rolled-back events are never claimable; committed ones are.
pub async fn append_commits_with_the_transaction<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let rolled = event(&agg("rolled"), 1);
    let mut tx = h.begin().await;
    store
        .append(&mut tx, std::slice::from_ref(&rolled))
        .await
        .expect("append");
    h.rollback(tx).await;
    assert!(
        claim(&store, "r", 100).await.is_empty(),
        "an event of a rolled-back transaction was claimable"
    );
    let kept = event(&agg("kept"), 1);
    let mut tx = h.begin().await;
    store
        .append(&mut tx, std::slice::from_ref(&kept))
        .await
        .expect("append");
    assert!(
        claim(&store, "r", 100).await.is_empty(),
        "an uncommitted event was claimable"
    );
    h.commit(tx).await.expect("commit");
    assert_eq!(ids(&claim(&store, "r", 100).await), set(&[&kept]));
}

/// Append validates every envelope and writes nothing of a call that fails validation.
pub async fn append_validates_and_writes_nothing_on_error<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let good = event(&agg("good"), 1);
    let mut bad = event(&agg("bad"), 1);
    bad.event_type = "  ".into();
    let mut tx = h.begin().await;
    let err = store
        .append(&mut tx, &[good.clone(), bad])
        .await
        .expect_err("an invalid envelope was accepted");
    assert_eq!(err.kind, StoreErrorKind::Validation, "{err}");
    assert_eq!(err.class(), ErrorClass::Permanent);
    // The transaction is still usable: validation happens before anything is written.
    h.commit(tx).await.expect("commit after a validation error");
    assert!(
        claim(&store, "r", 100).await.is_empty(),
        "the valid half of a rejected append was written"
    );
}

/// A duplicate event id is a `Constraint` error (at append or at commit).
pub async fn duplicate_event_id_is_a_constraint_error<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let first = event(&agg("dup"), 1);
    append_committed(h, &store, std::slice::from_ref(&first)).await;
    let mut copy = event(&agg("other"), 1);
    copy.event_id = first.event_id;
    let mut tx = h.begin().await;
    let err = match store.append(&mut tx, &[copy]).await {
        Err(e) => {
            h.rollback(tx).await;
            e
        }
        Ok(()) => h
            .commit(tx)
            .await
            .expect_err("a duplicate event id was committed"),
    };
    assert_eq!(err.kind, StoreErrorKind::Constraint, "{err}");
    assert_eq!(ids(&claim(&store, "r", 100).await), set(&[&first]));
}

/// Two relays never hold the same event.
pub async fn claim_is_exclusive_between_relays<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let modes = claim_modes(&caps);
    assert!(!modes.is_empty(), "the backend supports no claim mode");
    for mode in modes {
        let r1 = h.store(mode).await;
        let r2 = h.store(mode).await;
        let events: Vec<Envelope> = (0..6).map(|_| event(&agg("excl"), 1)).collect();
        append_committed(h, &r1, &events).await;
        let a = claim(&r1, "relay-1", 3).await;
        let b = claim(&r2, "relay-2", 100).await;
        assert_eq!(a.records.len(), 3, "{mode:?}: limit honoured");
        assert_eq!(
            b.records.len(),
            3,
            "{mode:?}: the rest goes to the second relay"
        );
        assert!(
            ids(&a).is_disjoint(&ids(&b)),
            "{mode:?}: two relays hold the same event"
        );
        assert!(claim(&r2, "relay-3", 100).await.is_empty(), "{mode:?}");
        assert_ne!(
            a.handle.token, b.handle.token,
            "claim tokens must be unique"
        );
        r1.complete(&a.handle, &publish_all(&a))
            .await
            .expect("complete");
        r2.complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
    }
}

/// Only an aggregate's head (lowest version neither published nor discarded) is claimed, and the
/// next version only after the head is published.
pub async fn claim_returns_only_aggregate_heads<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("heads-a");
    let b = agg("heads-b");
    // Appended out of version order on purpose.
    let (a2, a1, a3, b1) = (event(&a, 2), event(&a, 1), event(&a, 3), event(&b, 1));
    append_committed(h, &store, &[a2.clone(), a1.clone(), a3.clone(), b1.clone()]).await;
    let batch = claim(&store, "r", 100).await;
    assert_eq!(ids(&batch), set(&[&a1, &b1]), "only heads are claimed");
    // Version 2 is not handed out while version 1 is in flight.
    assert!(claim(&store, "r2", 100).await.is_empty());
    store
        .complete(&batch.handle, &[published(a1.event_id, 0)])
        .await
        .expect("complete");
    let next = claim(&store, "r", 100).await;
    assert_eq!(ids(&next), set(&[&a2, &b1]));
    store
        .complete(&next.handle, &publish_all(&next))
        .await
        .expect("complete");
    assert_eq!(ids(&claim(&store, "r", 100).await), set(&[&a3]));
}

/// Claims return at most `limit` events, oldest first.
pub async fn claim_is_oldest_first_within_the_limit<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let events: Vec<Envelope> = (0..5).map(|_| event(&agg("old"), 1)).collect();
    for e in &events {
        append_committed(h, &store, std::slice::from_ref(e)).await;
    }
    let first = claim(&store, "r", 2).await;
    assert_eq!(ids(&first), set(&[&events[0], &events[1]]));
    let rest = claim(&store, "r", 100).await;
    assert_eq!(ids(&rest), set(&[&events[2], &events[3], &events[4]]));
    assert!(
        claim(&store, "r", 0).await.is_empty(),
        "limit 0 claims nothing"
    );
}

/// A row that commits after rows appended later (higher id/sequence) is still claimed: no
/// high-water mark.
pub async fn late_commit_with_lower_sequence_is_not_skipped<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let early = event(&agg("early"), 1);
    let late = event(&agg("late"), 1);
    let mut slow = h.begin().await;
    store
        .append(&mut slow, std::slice::from_ref(&early))
        .await
        .expect("append");
    append_committed(h, &store, std::slice::from_ref(&late)).await;
    let batch = claim(&store, "r", 100).await;
    assert_eq!(ids(&batch), set(&[&late]));
    store
        .complete(&batch.handle, &publish_all(&batch))
        .await
        .expect("complete");
    h.commit(slow).await.expect("commit");
    assert_eq!(
        ids(&claim(&store, "r", 100).await),
        set(&[&early]),
        "the late-committing row was skipped"
    );
}

/// An expired lease returns its rows to the pool; a live one excludes other relays. The claim
/// that takes them over reports them as possibly sent before.
pub async fn lease_expiry_returns_rows_to_the_pool<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.lease {
        return not_applicable("lease_expiry_returns_rows_to_the_pool", "no lease mode");
    }
    let r1 = h.store(caps.lease_mode()).await;
    let r2 = h.store(caps.lease_mode()).await;
    let e = event(&agg("lease"), 1);
    append_committed(h, &r1, std::slice::from_ref(&e)).await;
    let first = claim(&r1, "relay-1", 10).await;
    assert_eq!(ids(&first), set(&[&e]));
    assert!(
        !first.records[0].maybe_sent_before,
        "a first claim is no re-send"
    );
    let remaining = first
        .lease_remaining
        .expect("a lease claim reports its remaining time");
    assert!(remaining <= caps.lease_duration && !remaining.is_zero());
    assert!(
        claim(&r2, "relay-2", 10).await.is_empty(),
        "live lease ignored"
    );
    h.advance(caps.lease_duration + caps.time_step).await;
    let second = claim(&r2, "relay-2", 10).await;
    assert_eq!(
        ids(&second),
        set(&[&e]),
        "expired lease not returned to the pool"
    );
    assert_eq!(
        second.records[0].attempts, 0,
        "expiry is not a failed attempt"
    );
    assert!(
        second.records[0].maybe_sent_before && second.records[0].is_resend(),
        "the expired claim may have sent it: publishing it again is a possible re-send"
    );
}

/// A stale lease holder's outcomes are refused and counted as superseded.
pub async fn stale_lease_holder_is_fenced<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.lease {
        return not_applicable("stale_lease_holder_is_fenced", "no lease mode");
    }
    let r1 = h.store(caps.lease_mode()).await;
    let r2 = h.store(caps.lease_mode()).await;
    let a = agg("fence");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &r1, &[v1.clone(), v2.clone()]).await;
    let stale = claim(&r1, "relay-1", 10).await;
    h.advance(caps.lease_duration + caps.time_step).await;
    let fresh = claim(&r2, "relay-2", 10).await;
    assert_eq!(ids(&fresh), set(&[&v1]));
    let rep = r1
        .complete(&stale.handle, &[published(v1.event_id, 1)])
        .await
        .expect("complete");
    assert_eq!(
        (rep.applied, rep.superseded),
        (0, 1),
        "a superseded completion must be counted, not applied"
    );
    // The new holder still owns the row: v2 is not claimable yet, and its ack applies.
    assert!(claim(&r1, "relay-1", 10).await.is_empty());
    let rep = r2
        .complete(&fresh.handle, &[published(v1.event_id, 2)])
        .await
        .expect("complete");
    assert_eq!((rep.applied, rep.superseded), (1, 0));
    assert_eq!(ids(&claim(&r1, "relay-1", 10).await), set(&[&v2]));
}

/// Completing a published event again changes nothing and never makes it claimable.
pub async fn mark_published_is_idempotent<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("idem");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &store, &[v1.clone(), v2.clone()]).await;
    let batch = claim(&store, "r", 10).await;
    let outcome = [published(v1.event_id, 7)];
    let rep = store
        .complete(&batch.handle, &outcome)
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1);
    let again = store
        .complete(&batch.handle, &outcome)
        .await
        .expect("complete twice");
    assert_eq!(again.applied, 0, "a published row was marked again");
    let next = claim(&store, "r", 10).await;
    assert_eq!(ids(&next), set(&[&v2]), "the published head came back");
    // An outcome for the already-published v1 under another claim is refused too.
    let rep = store
        .complete(
            &next.handle,
            &[published(v1.event_id, 8), published(v2.event_id, 9)],
        )
        .await
        .expect("complete");
    assert_eq!((rep.applied, rep.superseded), (1, 1));
    assert!(claim(&store, "r", 10).await.is_empty());
}

/// Rows of a claim without an outcome are released unchanged by `complete`.
pub async fn complete_releases_rows_without_outcome<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let (x, y) = (event(&agg("x"), 1), event(&agg("y"), 1));
    append_committed(h, &store, &[x.clone(), y.clone()]).await;
    let batch = claim(&store, "r", 10).await;
    assert_eq!(batch.records.len(), 2);
    store
        .complete(&batch.handle, &[published(x.event_id, 0)])
        .await
        .expect("complete");
    let next = claim(&store, "r2", 10).await;
    assert_eq!(
        ids(&next),
        set(&[&y]),
        "a row without outcome stayed claimed"
    );
    assert_eq!(
        next.records[0].attempts, 0,
        "no attempt counted without an outcome"
    );
}

/// `release` gives rows back without counting an attempt, and is a no-op for a finished claim.
pub async fn release_returns_rows_without_counting_an_attempt<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let e = event(&agg("rel"), 1);
    append_committed(h, &store, std::slice::from_ref(&e)).await;
    let batch = claim(&store, "r", 10).await;
    store.release(&batch.handle).await.expect("release");
    let again = claim(&store, "r2", 10).await;
    assert_eq!(ids(&again), set(&[&e]));
    assert_eq!(again.records[0].attempts, 0);
    // Releasing the old claim again must not free the new holder's row.
    store
        .release(&batch.handle)
        .await
        .expect("release is idempotent");
    assert!(claim(&store, "r3", 10).await.is_empty());
}

/// A retry outcome counts an attempt and hides the row until its delay has passed.
pub async fn retry_outcome_counts_and_delays<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let e = event(&agg("retry"), 1);
    append_committed(h, &store, std::slice::from_ref(&e)).await;
    let batch = claim(&store, "r", 10).await;
    let delay = caps.time_step * 2;
    let retry = Outcome::Retry {
        event_id: e.event_id,
        delay,
        error: last_error(ErrorClass::Transient),
    };
    let rep = store
        .complete(&batch.handle, &[retry])
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1);
    assert!(
        claim(&store, "r", 10).await.is_empty(),
        "a retried row was claimable before its delay"
    );
    h.advance(delay + caps.time_step).await;
    let again = claim(&store, "r", 10).await;
    assert_eq!(ids(&again), set(&[&e]), "a retried row never came back");
    assert_eq!(again.records[0].attempts, 1, "the attempt was not counted");
}

/// A parked event blocks its aggregate's later events and nothing else.
pub async fn parking_blocks_only_its_aggregate<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let (a, b) = (agg("park-a"), agg("park-b"));
    let (a1, a2, b1) = (event(&a, 1), event(&a, 2), event(&b, 1));
    append_committed(h, &store, &[a1.clone(), a2.clone(), b1.clone()]).await;
    let batch = claim(&store, "r", 10).await;
    store
        .complete(&batch.handle, &[park(a1.event_id)])
        .await
        .expect("complete");
    let next = claim(&store, "r", 10).await;
    assert_eq!(
        ids(&next),
        set(&[&b1]),
        "parking blocked another aggregate or leaked a2"
    );
    let parked = store.list_parked(10).await.expect("list_parked");
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].envelope.event_id, a1.event_id);
    assert_eq!(parked[0].reason.kind, ParkKind::PermanentError);
    assert!(parked[0].attempts >= 1);
}

/// Operator retry makes a parked event claimable with its id, resets attempts, is audited, and
/// fails with `NotFound` for an event that is not parked.
pub async fn operator_retry_is_audited<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let e = event(&agg("op-retry"), 1);
    append_committed(h, &store, std::slice::from_ref(&e)).await;
    park_head::<H>(&store, &e).await;
    store
        .retry_parked(e.event_id, "alice")
        .await
        .expect("retry_parked");
    let batch = claim(&store, "r", 10).await;
    assert_eq!(ids(&batch), set(&[&e]));
    assert_eq!(batch.records[0].attempts, 0, "attempts reset by retry");
    let trail = store.audit_trail(Some(e.event_id)).await.expect("audit");
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].action, OperatorAction::Retry);
    assert_eq!(trail[0].actor, "alice");
    let err = store
        .retry_parked(e.event_id, "alice")
        .await
        .expect_err("retry of an event that is not parked");
    assert_eq!(err.kind, StoreErrorKind::NotFound, "{err}");
}

/// Discard requires a reason, frees the aggregate, and is audited.
pub async fn operator_discard_needs_a_reason_and_is_audited<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("op-discard");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &store, &[v1.clone(), v2.clone()]).await;
    park_head::<H>(&store, &v1).await;
    assert!(
        store.discard_parked(v1.event_id, "bob", "").await.is_err(),
        "discard without a reason was accepted"
    );
    assert!(store
        .discard_parked(v1.event_id, "bob", "   ")
        .await
        .is_err());
    store
        .discard_parked(v1.event_id, "bob", "customer deleted")
        .await
        .expect("discard");
    assert_eq!(ids(&claim(&store, "r", 10).await), set(&[&v2]));
    assert!(store.list_parked(10).await.expect("list").is_empty());
    let trail = store.audit_trail(Some(v1.event_id)).await.expect("audit");
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].action, OperatorAction::Discard);
    assert_eq!(
        (trail[0].actor.as_str(), trail[0].reason.as_str()),
        ("bob", "customer deleted")
    );
    let err = store
        .discard_parked(v1.event_id, "bob", "again")
        .await
        .expect_err("discard of a discarded event");
    assert_eq!(err.kind, StoreErrorKind::NotFound, "{err}");
}

/// Re-issue replaces a parked event by a copy with a new id at the same version, is audited
/// with the new id, and the copy is delivered.
pub async fn operator_reissue_replaces_the_event_and_is_audited<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("op-reissue");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &store, &[v1.clone(), v2.clone()]).await;
    park_head::<H>(&store, &v1).await;
    let new_id = store
        .reissue_parked(v1.event_id, "carol", "payload fixed")
        .await
        .expect("reissue");
    assert_ne!(new_id, v1.event_id);
    let batch = claim(&store, "r", 10).await;
    assert_eq!(
        batch.records.len(),
        1,
        "only the copy (the new head) is claimable"
    );
    let copy = &batch.records[0].envelope;
    assert_eq!(copy.event_id, new_id);
    assert_eq!(copy.aggregate_id, a);
    assert_eq!(copy.aggregate_version, 1);
    assert_eq!(copy.payload, v1.payload);
    store
        .complete(&batch.handle, &publish_all(&batch))
        .await
        .expect("complete");
    assert_eq!(ids(&claim(&store, "r", 10).await), set(&[&v2]));
    let trail = store.audit_trail(Some(v1.event_id)).await.expect("audit");
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].action, OperatorAction::Reissue);
    assert_eq!(trail[0].new_event_id, Some(new_id));
    assert!(store
        .reissue_parked(v1.event_id, "carol", "again")
        .await
        .is_err());
    let all = store.audit_trail(None).await.expect("audit");
    assert!(all.iter().any(|e| e.event_id == v1.event_id));
}

/// Cleanup removes published rows past retention, in batches, and never pending or parked rows.
pub async fn cleanup_removes_only_published_rows_past_retention<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let done: Vec<Envelope> = (0..3).map(|_| event(&agg("done"), 1)).collect();
    let pending = event(&agg("pending"), 1);
    let parked = event(&agg("parked"), 1);
    append_committed(h, &store, &done).await;
    append_committed(h, &store, std::slice::from_ref(&parked)).await;
    park_head::<H>(&store, &parked).await;
    let batch = claim(&store, "r", 10).await;
    assert_eq!(ids(&batch), set(&[&done[0], &done[1], &done[2]]));
    store
        .complete(&batch.handle, &publish_all(&batch))
        .await
        .expect("complete");
    append_committed(h, &store, std::slice::from_ref(&pending)).await;
    let retention = caps.time_step * 3;
    let early = store.cleanup(retention, 2).await.expect("cleanup");
    assert_eq!(
        early.removed, 0,
        "rows removed before their retention passed"
    );
    h.advance(retention + caps.time_step).await;
    let rep = store.cleanup(retention, 2).await.expect("cleanup");
    assert_eq!(rep.removed, 3);
    assert!(
        rep.batches >= 2,
        "3 rows with batch size 2 need 2 batches, got {}",
        rep.batches
    );
    let stats = store.stats().await.expect("stats");
    assert_eq!(stats.published_retained, 0);
    assert_eq!(stats.parked, 1, "a parked row was cleaned up");
    assert_eq!(stats.unpublished, 1, "a pending row was cleaned up");
    assert_eq!(ids(&claim(&store, "r", 10).await), set(&[&pending]));
    assert_eq!(store.list_parked(10).await.expect("list").len(), 1);
}

/// Stats count the backlog, in-flight, parked and retained rows and measure ages.
pub async fn stats_report_backlog_and_ages<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let empty = store.stats().await.expect("stats");
    assert_eq!(
        (empty.unpublished, empty.parked, empty.in_flight),
        (0, 0, 0)
    );
    assert_eq!(empty.oldest_claimable_age, None);
    let events: Vec<Envelope> = (0..4).map(|_| event(&agg("stats"), 1)).collect();
    append_committed(h, &store, &events).await;
    h.advance(caps.time_step).await;
    let s = store.stats().await.expect("stats");
    assert_eq!(s.unpublished, 4);
    let age = s.oldest_claimable_age.expect("a claimable age");
    assert!(
        age >= caps.time_step,
        "oldest age {age:?} below the time that passed"
    );
    let batch = claim(&store, "r", 3).await;
    let mut outcomes = publish_all(&batch);
    let parked_id = outcomes.pop().expect("three claimed").event_id();
    outcomes.push(park(parked_id));
    let held = claim(&store, "r2", 10).await;
    assert_eq!(held.records.len(), 1);
    let s = store.stats().await.expect("stats");
    assert_eq!(s.in_flight, 4, "claimed rows count as in flight");
    store
        .complete(&batch.handle, &outcomes)
        .await
        .expect("complete");
    let s = store.stats().await.expect("stats");
    assert_eq!(s.unpublished, 1);
    assert_eq!(s.in_flight, 1);
    assert_eq!(s.parked, 1);
    assert_eq!(s.published_retained, 2);
    assert!(s.oldest_parked_age.is_some());
}

/// In `LockedTransaction` mode a claim holds its rows however long publishing takes.
pub async fn locked_claim_is_held_until_completed<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.locked_transaction {
        return not_applicable("locked_claim_is_held_until_completed", "no locked mode");
    }
    let r1 = h.store(ClaimMode::LockedTransaction).await;
    let r2 = h.store(ClaimMode::LockedTransaction).await;
    let a = agg("locked");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &r1, &[v1.clone(), v2.clone()]).await;
    let batch = claim(&r1, "relay-1", 10).await;
    assert_eq!(ids(&batch), set(&[&v1]));
    assert_eq!(batch.lease_remaining, None);
    h.advance(caps.lease_duration + caps.time_step).await;
    assert!(
        claim(&r2, "relay-2", 10).await.is_empty(),
        "a locked row was handed out twice"
    );
    let rep = r1
        .complete(&batch.handle, &publish_all(&batch))
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1);
    assert_eq!(ids(&claim(&r2, "relay-2", 10).await), set(&[&v2]));
}

/// In `LockedTransaction` mode a relay that crashes loses its locks; its late outcomes are
/// refused.
pub async fn locked_claim_is_freed_when_the_relay_crashes<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.locked_transaction {
        return not_applicable(
            "locked_claim_is_freed_when_the_relay_crashes",
            "no locked mode",
        );
    }
    let r1 = h.store(ClaimMode::LockedTransaction).await;
    let r2 = h.store(ClaimMode::LockedTransaction).await;
    let e = event(&agg("crash"), 1);
    append_committed(h, &r1, std::slice::from_ref(&e)).await;
    let batch = claim(&r1, "relay-1", 10).await;
    if !h.abandon(&r1, &batch.handle).await {
        return not_applicable(
            "locked_claim_is_freed_when_the_relay_crashes",
            "the harness cannot drop a relay's connection (OutboxHarness::abandon)",
        );
    }
    let again = claim(&r2, "relay-2", 10).await;
    assert_eq!(
        ids(&again),
        set(&[&e]),
        "a crashed relay's rows stayed locked"
    );
    assert_eq!(again.records[0].attempts, 0);
    let late = r1.complete(&batch.handle, &publish_all(&batch)).await;
    if let Ok(rep) = late {
        assert_eq!(rep.applied, 0, "a crashed relay's outcome was applied");
    }
}

/// The store reports the claim mode it was built with.
pub async fn claim_mode_is_reported<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if caps.lease {
        assert_eq!(
            h.store(caps.lease_mode()).await.claim_mode(),
            caps.lease_mode()
        );
    }
    if caps.locked_transaction {
        assert_eq!(
            h.store(ClaimMode::LockedTransaction).await.claim_mode(),
            ClaimMode::LockedTransaction
        );
    }
}

/// A claim with a limit of 0 claims nothing, and leaves every row claimable.
pub async fn claim_limit_zero_claims_nothing<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let events: Vec<Envelope> = (0..3).map(|_| event(&agg("zero"), 1)).collect();
    append_committed(h, &store, &events).await;
    let none = claim(&store, "r", 0).await;
    assert!(
        none.is_empty(),
        "a claim of 0 returned {} events",
        none.records.len()
    );
    assert_eq!(
        ids(&claim(&store, "r", 10).await),
        set(&events.iter().collect::<Vec<_>>()),
        "a claim of 0 took rows"
    );
}

/// Version N+1 is held while version N is missing (its transaction has not committed yet),
/// and goes out after N: a lower version that commits late is never published after a higher
/// one.
pub async fn late_lower_version_goes_out_before_the_higher_one<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("late-lower");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    let mut slow = h.begin().await;
    store
        .append(&mut slow, std::slice::from_ref(&v1))
        .await
        .expect("append");
    append_committed(h, &store, std::slice::from_ref(&v2)).await;
    let held = claim(&store, "r", 10).await;
    assert!(
        held.is_empty(),
        "version 2 was handed out before version 1 committed"
    );
    assert_eq!(held.gaps_held, 1, "the held head must be counted");
    assert_eq!(
        store.stats().await.expect("stats").version_gaps_held,
        1,
        "stats must report the held gap"
    );
    h.commit(slow).await.expect("commit");
    let first = claim(&store, "r", 10).await;
    assert_eq!(ids(&first), set(&[&v1]));
    store
        .complete(&first.handle, &publish_all(&first))
        .await
        .expect("complete");
    // The held head is re-checked after a short delay (at most the gap timeout).
    let caps = h.capabilities();
    h.advance(caps.gap_timeout.min(std::time::Duration::from_secs(1)) + caps.time_step)
        .await;
    assert_eq!(ids(&claim(&store, "r", 10).await), set(&[&v2]));
}

/// The head is the first unfinished event in (version, append order) above `last`: of two
/// events with the same version, the first appended goes out and the later is parked out of
/// order, in every claim mode. The case that broke it on PostgreSQL (a randomized upgrade test,
/// seed 1796639460882049773): a stale copy of version 2 stands before the first copy of
/// version 3, which a claim blocked behind it; a second copy of version 3, appended alone, is
/// met by the claim that parks the stale copy and unblocks the first.
pub async fn of_two_events_of_one_version_the_first_appended_goes_out<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let modes = claim_modes(&caps);
    for mode in modes {
        let store = h.store(mode).await;
        let a = agg("first-copy");
        let v1 = event(&a, 1);
        append_committed(h, &store, std::slice::from_ref(&v1)).await;
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[&v1]), "{mode:?}: setup");
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
        // Each appended alone, in this order: version 2, a second copy of it, version 3.
        let (v2, v2_again, v3) = (event(&a, 2), event(&a, 2), event(&a, 3));
        for e in [&v2, &v2_again, &v3] {
            append_committed(h, &store, std::slice::from_ref(e)).await;
        }
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[&v2]), "{mode:?}: version 2, first copy");
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
        let v3_again = event(&a, 3);
        append_committed(h, &store, std::slice::from_ref(&v3_again)).await;
        let (mut sent, mut parked) = (Vec::new(), BTreeSet::new());
        for _ in 0..6 {
            let b = claim(&store, "r", 10).await;
            sent.extend(b.records.iter().map(|r| r.envelope.event_id));
            for n in &b.parked {
                assert_eq!(n.kind, ParkKind::OutOfOrder, "{mode:?}");
                parked.insert(n.event_id);
            }
            store
                .complete(&b.handle, &publish_all(&b))
                .await
                .expect("complete");
            h.advance(caps.time_step).await;
        }
        assert_eq!(
            sent,
            vec![v3.event_id],
            "{mode:?}: version 3 must go out once, from its first copy ({}), not the later \
             one ({})",
            v3.event_id,
            v3_again.event_id
        );
        assert_eq!(
            parked,
            set(&[&v2_again, &v3_again]),
            "{mode:?}: both later copies parked out of order"
        );
    }
}

/// A pending event at or below the aggregate's last published version is never handed out:
/// the claim parks it as out of order; an operator may discard it but not retry it.
pub async fn version_at_or_below_the_last_published_is_parked_out_of_order<H: OutboxHarness>(
    h: &H,
) {
    let store = default_store(h).await;
    let a = agg("ooo");
    let (v1, v2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &store, &[v1.clone(), v2.clone()]).await;
    for expected in [&v1, &v2] {
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[expected]));
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
    }
    let stale = event(&a, 2);
    let v3 = event(&a, 3);
    append_committed(h, &store, &[stale.clone(), v3.clone()]).await;
    let b = claim(&store, "r", 10).await;
    assert!(
        !ids(&b).contains(&stale.event_id),
        "a version at or below the last published one was handed out"
    );
    let parked = store.parked_event(stale.event_id).await.expect("parked");
    assert_eq!(parked.reason.kind, ParkKind::OutOfOrder);
    let mut seen = b.parked.iter().map(|p| (p.event_id, p.kind));
    assert!(
        seen.any(|p| p == (stale.event_id, ParkKind::OutOfOrder)),
        "the claim must report what it parked: {:?}",
        b.parked
    );
    // v3 is next and unaffected (same claim or the next one).
    let mut got = ids(&b);
    if !got.contains(&v3.event_id) {
        got = ids(&claim(&store, "r", 10).await);
    }
    assert!(got.contains(&v3.event_id), "v3 must flow");
    let err = store
        .retry_parked(stale.event_id, "ops")
        .await
        .expect_err("retrying an out-of-order event must be refused");
    assert_eq!(err.kind, StoreErrorKind::Conflict, "{err}");
    store
        .discard_parked(stale.event_id, "ops", "duplicate version")
        .await
        .expect("discard");
}

/// A head that skips a version is held, then parked as a version gap once the gap timeout
/// passed; an operator retry accepts its version and it goes out.
pub async fn version_gap_is_parked_after_the_timeout_and_retry_accepts_it<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let a = agg("gap");
    let (v2, v3) = (event(&a, 2), event(&a, 3));
    append_committed(h, &store, &[v2.clone(), v3.clone()]).await;
    let b = claim(&store, "r", 10).await;
    assert!(b.is_empty(), "version 2 went out without version 1");
    assert_eq!(b.gaps_held, 1);
    h.advance(caps.gap_timeout + caps.time_step).await;
    let b = claim(&store, "r", 10).await;
    assert!(b.is_empty());
    assert!(
        b.parked
            .iter()
            .any(|p| p.event_id == v2.event_id && p.kind == ParkKind::VersionGap),
        "the gap head must be parked once the timeout passed: {:?}",
        b.parked
    );
    assert_eq!(
        store
            .parked_event(v2.event_id)
            .await
            .expect("parked")
            .reason
            .kind,
        ParkKind::VersionGap
    );
    assert!(
        claim(&store, "r", 10).await.is_empty(),
        "v3 is behind the parked head"
    );
    store.retry_parked(v2.event_id, "ops").await.expect("retry");
    for expected in [&v2, &v3] {
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[expected]));
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
    }
}

/// A deferred outcome (a transport failure) delays the event without counting an attempt.
pub async fn defer_outcome_delays_without_counting_an_attempt<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let e = event(&agg("defer"), 1);
    append_committed(h, &store, std::slice::from_ref(&e)).await;
    let b = claim(&store, "r", 10).await;
    let delay = caps.time_step * 3;
    let rep = store
        .complete(
            &b.handle,
            &[Outcome::Defer {
                event_id: e.event_id,
                delay,
                error: LastError {
                    class: ErrorClass::Transient,
                    kind: "broker_unavailable".into(),
                    message: "down".into(),
                },
            }],
        )
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1);
    assert!(
        claim(&store, "r", 10).await.is_empty(),
        "claimable before its delay"
    );
    h.advance(delay + caps.time_step).await;
    let again = claim(&store, "r", 10).await;
    assert_eq!(ids(&again), set(&[&e]));
    assert_eq!(again.records[0].attempts, 0, "a deferral spent an attempt");
}

/// A re-issued copy carries the original's id, so consumers deduplicate the two as one event;
/// a copy of a copy keeps the first original. A parked event reports whether an earlier attempt
/// may have reached the broker.
pub async fn reissued_copy_carries_the_original_id<H: OutboxHarness>(h: &H) {
    let store = default_store(h).await;
    let a = agg("reissue-id");
    let v1 = event(&a, 1);
    append_committed(h, &store, std::slice::from_ref(&v1)).await;
    // A timeout first (the broker may have stored it), then a permanent failure.
    let b = claim(&store, "r", 10).await;
    let timeout = LastError {
        class: ErrorClass::Transient,
        kind: "timeout".into(),
        message: "no ack".into(),
    };
    store
        .complete(
            &b.handle,
            &[Outcome::Retry {
                event_id: v1.event_id,
                delay: std::time::Duration::from_millis(1),
                error: timeout,
            }],
        )
        .await
        .expect("complete");
    h.advance(h.capabilities().time_step).await;
    park_head::<H>(&store, &v1).await;
    let shown = store.parked_event(v1.event_id).await.expect("parked");
    assert!(
        shown.delivery_uncertain,
        "an event that timed out may be in the log: the operator must be told"
    );
    let copy_id = store
        .reissue_parked(v1.event_id, "ops", "re-send")
        .await
        .expect("reissue");
    let b = claim(&store, "r", 10).await;
    let copy = &b.records[0].envelope;
    assert_eq!(copy.event_id, copy_id);
    assert_eq!(copy.original_event_id(), Some(v1.event_id));
    assert_eq!(copy.dedup_id(), v1.event_id);
    store
        .complete(&b.handle, &[park(copy_id)])
        .await
        .expect("complete");
    let plain = store.parked_event(copy_id).await.expect("parked");
    assert!(
        !plain.delivery_uncertain,
        "a copy that only failed permanently cannot be in the log"
    );
    let second = store
        .reissue_parked(copy_id, "ops", "again")
        .await
        .expect("reissue");
    let b = claim(&store, "r", 10).await;
    assert_eq!(b.records[0].envelope.event_id, second);
    assert_eq!(
        b.records[0].envelope.original_event_id(),
        Some(v1.event_id),
        "a copy of a copy must keep the first original"
    );
}

/// An operator ends the leases of a relay that is gone: its aggregates are claimable at once,
/// its late completion is refused, and the action is audited.
pub async fn release_claims_of_a_gone_relay<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.lease {
        return not_applicable("release_claims_of_a_gone_relay", "no lease mode");
    }
    let gone = h.store(caps.lease_mode()).await;
    let other = h.store(caps.lease_mode()).await;
    let e = event(&agg("gone"), 1);
    let kept = event(&agg("kept"), 1);
    append_committed(h, &gone, std::slice::from_ref(&e)).await;
    let lost = claim(&gone, "relay-gone", 10).await;
    append_committed(h, &gone, std::slice::from_ref(&kept)).await;
    let live = claim(&other, "relay-live", 10).await;
    assert_eq!(ids(&live), set(&[&kept]));
    assert_eq!(
        other
            .release_claims_of("relay-gone", "ops")
            .await
            .expect("release"),
        1
    );
    let again = claim(&other, "relay-2", 10).await;
    assert_eq!(
        ids(&again),
        set(&[&e]),
        "the released aggregate must be claimable at once"
    );
    // The gone relay may have sent it: its next publication is a re-publication
    // (`outbox_republished_total` counts the duplicates a release causes).
    assert!(
        again.records[0].maybe_sent_before && again.records[0].is_resend(),
        "an event released from a gone relay must be claimed as possibly sent before"
    );
    let rep = gone
        .complete(&lost.handle, &publish_all(&lost))
        .await
        .expect("complete");
    assert_eq!((rep.applied, rep.superseded), (0, 1));
    assert_eq!(rep.superseded_events, vec![e.event_id]);
    let trail = other.audit_trail(Some(e.event_id)).await.expect("audit");
    assert!(
        trail
            .iter()
            .any(|t| t.action == OperatorAction::ReleaseClaim && t.actor == "ops"),
        "{trail:?}"
    );
    // The live relay's lease was not touched.
    let rep = other
        .complete(&live.handle, &publish_all(&live))
        .await
        .expect("complete");
    assert_eq!(rep.applied, 1);
}

/// An operator acting on a version-gap head while the missing versions have arrived since is
/// refused: they go out first, in order, and the head after them.
pub async fn operator_action_on_a_filling_gap_is_refused<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let a = agg("filling");
    let v2 = event(&a, 2);
    append_committed(h, &store, std::slice::from_ref(&v2)).await;
    assert!(claim(&store, "r", 10).await.is_empty());
    h.advance(caps.gap_timeout + caps.time_step).await;
    let b = claim(&store, "r", 10).await;
    assert!(b.parked.iter().any(|p| p.event_id == v2.event_id));
    let v1 = event(&a, 1);
    append_committed(h, &store, std::slice::from_ref(&v1)).await;
    for refused in [
        store.retry_parked(v2.event_id, "ops").await,
        store.discard_parked(v2.event_id, "ops", "give up").await,
        store
            .reissue_parked(v2.event_id, "ops", "again")
            .await
            .map(|_| ()),
    ] {
        let err = refused.expect_err("acting above waiting versions must be refused");
        assert_eq!(err.kind, StoreErrorKind::Conflict, "{err}");
    }
    let b = claim(&store, "r", 10).await;
    assert_eq!(
        ids(&b),
        set(&[&v1]),
        "the version that filled the gap goes out first"
    );
    store
        .complete(&b.handle, &publish_all(&b))
        .await
        .expect("complete");
    store.retry_parked(v2.event_id, "ops").await.expect("retry");
    assert_eq!(ids(&claim(&store, "r", 10).await), set(&[&v2]));
}

/// With `accept_first_version`, an aggregate without state accepts its lowest unfinished
/// version as its first, and keeps accepting it after a claim that ends without a
/// publication: a release, a deferral (a broker outage), a retry, or the relay's crash (an
/// expired lease, a dropped locked claim). Its head is never held as a version gap for that,
/// so nothing is parked. Once a version is published the aggregate has state: a later gap is
/// held as usual.
pub async fn first_version_is_accepted_again_after_a_claim_that_did_not_publish<
    H: OutboxHarness,
>(
    h: &H,
) {
    let caps = h.capabilities();
    if !caps.accept_first_version {
        return not_applicable(
            "first_version_is_accepted_again_after_a_claim_that_did_not_publish",
            "the backend cannot accept a first version above 1",
        );
    }
    let modes = claim_modes(&caps);
    let transient = |kind: &str| LastError {
        class: ErrorClass::Transient,
        kind: kind.into(),
        message: "injected by the conformance suite".into(),
    };
    for mode in modes {
        let store = h.store_accepting_first_version(mode).await;
        for end in ["release", "defer", "retry", "crash"] {
            // An aggregate with a history from before the outbox: its first event here is 3.
            let a = agg(&format!("first-{end}"));
            let (v3, v4) = (event(&a, 3), event(&a, 4));
            append_committed(h, &store, &[v3.clone(), v4.clone()]).await;
            let first = claim(&store, "r", 10).await;
            assert_eq!(ids(&first), set(&[&v3]), "{mode:?} {end}: the first claim");
            let attempts = match end {
                "release" => {
                    store.release(&first.handle).await.expect("release");
                    0
                }
                "defer" | "retry" => {
                    let outcome = if end == "defer" {
                        Outcome::Defer {
                            event_id: v3.event_id,
                            delay: std::time::Duration::ZERO,
                            error: transient("broker_unavailable"),
                        }
                    } else {
                        Outcome::Retry {
                            event_id: v3.event_id,
                            delay: std::time::Duration::ZERO,
                            error: transient("timeout"),
                        }
                    };
                    let rep = store
                        .complete(&first.handle, &[outcome])
                        .await
                        .expect("complete");
                    assert_eq!(rep.applied, 1, "{mode:?} {end}");
                    u32::from(end == "retry")
                }
                _ => {
                    if mode == ClaimMode::LockedTransaction {
                        if !h.abandon(&store, &first.handle).await {
                            eprintln!(
                                "conformance: {mode:?} crash skipped: the harness cannot drop \
                                 a relay's connection (OutboxHarness::abandon)"
                            );
                            store.release(&first.handle).await.expect("release");
                        }
                    } else {
                        h.advance(caps.lease_duration + caps.time_step).await;
                    }
                    0
                }
            };
            let again = claim(&store, "r", 10).await;
            assert_eq!(
                ids(&again),
                set(&[&v3]),
                "{mode:?} {end}: the first version must be accepted again (held: {}, \
                 parked: {:?})",
                again.gaps_held,
                again.parked
            );
            assert_eq!(again.gaps_held, 0, "{mode:?} {end}");
            assert_eq!(again.records[0].attempts, attempts, "{mode:?} {end}");
            assert_eq!(
                store.stats().await.expect("stats").version_gaps_held,
                0,
                "{mode:?} {end}: no gap is held"
            );
            store
                .complete(&again.handle, &publish_all(&again))
                .await
                .expect("complete");
            let next = claim(&store, "r", 10).await;
            assert_eq!(ids(&next), set(&[&v4]), "{mode:?} {end}: then version 4");
            store
                .complete(&next.handle, &publish_all(&next))
                .await
                .expect("complete");
            if end != "crash" {
                continue;
            }
            // The aggregate has state now: version 6 skips 5 and is held.
            let v6 = event(&a, 6);
            append_committed(h, &store, std::slice::from_ref(&v6)).await;
            let held = claim(&store, "r", 10).await;
            assert!(held.is_empty(), "{mode:?}: version 6 went out after 4");
            assert_eq!(held.gaps_held, 1, "{mode:?}");
            fill_the_gap(h, &store, mode, &event(&a, 5), &v6).await;
        }
    }
}

/// With `accept_first_version`, the first version of an aggregate without state is accepted
/// again after a claim that did not publish, but once that version may have reached the broker
/// (its lease ran out under a relay that may have sent it, or a failure left its delivery
/// uncertain) it stays the first: a lower version that commits afterwards is parked as out of
/// order, never sent after it, and an operator cannot send it either; discarding it keeps the
/// first version next. When the claim certainly sent nothing (a release), the lower versions
/// come first and go out before it.
pub async fn a_late_lower_version_never_follows_a_first_version_that_may_have_been_sent<
    H: OutboxHarness,
>(
    h: &H,
) {
    let caps = h.capabilities();
    if !caps.accept_first_version {
        return not_applicable(
            "a_late_lower_version_never_follows_a_first_version_that_may_have_been_sent",
            "the backend cannot accept a first version above 1",
        );
    }
    let mut cases: Vec<(ClaimMode, &str)> = Vec::new();
    if caps.lease {
        for end in ["expiry", "uncertain", "release"] {
            cases.push((caps.lease_mode(), end));
        }
    }
    if caps.locked_transaction {
        for end in ["uncertain", "release"] {
            cases.push((ClaimMode::LockedTransaction, end));
        }
    }
    for (mode, end) in cases {
        let store = h.store_accepting_first_version(mode).await;
        let a = agg(&format!("maybe-sent-{end}"));
        let v5 = event(&a, 5);
        append_committed(h, &store, std::slice::from_ref(&v5)).await;
        let first = claim(&store, "r", 10).await;
        assert_eq!(ids(&first), set(&[&v5]), "{mode:?} {end}");
        match end {
            "expiry" => h.advance(caps.lease_duration + caps.time_step).await,
            "uncertain" => {
                let outcome = Outcome::Defer {
                    event_id: v5.event_id,
                    delay: std::time::Duration::ZERO,
                    error: LastError {
                        class: ErrorClass::Transient,
                        kind: "timeout".into(),
                        message: "injected by the conformance suite".into(),
                    },
                };
                let rep = store
                    .complete(&first.handle, &[outcome])
                    .await
                    .expect("complete");
                assert_eq!(rep.applied, 1, "{mode:?} {end}");
            }
            _ => store.release(&first.handle).await.expect("release"),
        }
        let (v3, v4) = (event(&a, 3), event(&a, 4));
        if end == "release" {
            // Nothing was sent: version 3 is the first, and 3, 4, 5 go out in order.
            append_committed(h, &store, &[v3.clone(), v4.clone()]).await;
            for expected in [&v3, &v4, &v5] {
                let b = claim(&store, "r", 10).await;
                assert_eq!(ids(&b), set(&[expected]), "{mode:?} {end}");
                assert!(b.parked.is_empty(), "{mode:?} {end}: {:?}", b.parked);
                store
                    .complete(&b.handle, &publish_all(&b))
                    .await
                    .expect("complete");
            }
            continue;
        }
        append_committed(h, &store, std::slice::from_ref(&v3)).await;
        let again = claim(&store, "r", 10).await;
        assert_eq!(
            ids(&again),
            set(&[&v5]),
            "{mode:?} {end}: version 5 may be at the broker; 3 must not go out after it"
        );
        assert!(again.records[0].is_resend(), "{mode:?} {end}");
        assert_eq!(
            again
                .parked
                .iter()
                .map(|p| (p.event_id, p.kind))
                .collect::<Vec<_>>(),
            vec![(v3.event_id, ParkKind::OutOfOrder)],
            "{mode:?} {end}"
        );
        store.release(&again.handle).await.expect("release");
        let retry = store
            .retry_parked(v3.event_id, "ops")
            .await
            .expect_err("retry of a version below the first must be refused");
        assert_eq!(retry.kind, StoreErrorKind::Conflict, "{mode:?} {end}");
        store
            .discard_parked(v3.event_id, "ops", "arrived after version 5")
            .await
            .expect("discard");
        let next = claim(&store, "r", 10).await;
        assert_eq!(
            ids(&next),
            set(&[&v5]),
            "{mode:?} {end}: after the discard, 5 is still next (held {}, parked {:?})",
            next.gaps_held,
            next.parked
        );
        store
            .complete(&next.handle, &publish_all(&next))
            .await
            .expect("complete");
    }
}

/// Where unpublished events stand is reported apart (issue 20, items 4 and 5): an event
/// waiting behind a parked event of its aggregate is blocked, an aggregate whose head a claim
/// holds as a version gap is gap-held, and neither counts for the oldest claimable age, the
/// main signal (one parked event with one more of its aggregate behind it must not make it
/// grow without bound). Ages count from the insertion into the store on its clock, not from
/// the producer's `created_at` (here a year 2000 time, as a history import keeps it).
pub async fn stats_keep_blocked_and_gap_held_events_out_of_the_claimable_age<H: OutboxHarness>(
    h: &H,
) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let (a, g, c) = (agg("st-parked"), agg("st-gap"), agg("st-fresh"));
    let (a1, a2) = (event(&a, 1), event(&a, 2));
    append_committed(h, &store, &[a1.clone(), a2.clone()]).await;
    park_head::<H>(&store, &a1).await;
    h.advance(caps.time_step * 3).await;
    let mut c1 = event(&c, 1);
    c1.created_at = "2000-01-01T00:00:00Z".parse().expect("a time");
    append_committed(h, &store, std::slice::from_ref(&c1)).await;
    let s = store.stats().await.expect("stats");
    assert_eq!((s.unpublished, s.parked), (2, 1), "{s:?}");
    assert_eq!(
        (s.blocked, s.gap_held, s.version_gaps_held),
        (1, 0, 0),
        "{s:?}"
    );
    assert!(
        s.oldest_blocked_age
            .is_some_and(|a| a >= caps.time_step * 3),
        "{s:?}"
    );
    let fresh = s.oldest_claimable_age.expect("c1 is claimable");
    assert!(
        fresh < caps.time_step * 3,
        "the claimable age {fresh:?} must be c1's, counted from its insertion (not from its \
         created_at in 2000, nor from the blocked event): {s:?}"
    );
    // c1 in flight still counts; once published, nothing claimable is left: no claimable
    // age, however long a2 waits behind the parked a1.
    let b = claim(&store, "r", 10).await;
    assert_eq!(ids(&b), set(&[&c1]));
    h.advance(caps.time_step).await;
    let s = store.stats().await.expect("stats");
    assert_eq!(s.in_flight, 1);
    assert!(
        s.oldest_claimable_age.is_some_and(|a| a >= caps.time_step),
        "{s:?}"
    );
    store
        .complete(&b.handle, &publish_all(&b))
        .await
        .expect("complete");
    // A head that skips a version, held by the claim that meets it (checked well within the
    // gap timeout): gap-held, not claimable either.
    let g2 = event(&g, 2);
    append_committed(h, &store, std::slice::from_ref(&g2)).await;
    let b = claim(&store, "r", 10).await;
    assert_eq!((b.records.len(), b.gaps_held), (0, 1));
    let s = store.stats().await.expect("stats");
    assert_eq!(
        s.oldest_claimable_age, None,
        "only a blocked and a gap-held event are left: {s:?}"
    );
    assert_eq!(
        (s.unpublished, s.blocked, s.gap_held, s.version_gaps_held),
        (2, 1, 1, 1),
        "{s:?}"
    );
    assert!(
        s.oldest_blocked_age
            .is_some_and(|a| a >= caps.time_step * 4),
        "{s:?}"
    );
    // Once the parked event is discarded, a2 is claimable, with its age since insertion.
    store
        .discard_parked(a1.event_id, "ops", "test")
        .await
        .expect("discard");
    let s = store.stats().await.expect("stats");
    assert_eq!((s.blocked, s.oldest_blocked_age), (0, None), "{s:?}");
    assert!(
        s.oldest_claimable_age
            .is_some_and(|a| a >= caps.time_step * 4),
        "{s:?}"
    );
}

/// A claim reports everything its decision did beside what it hands out, in every claim
/// mode: the stale version it parked (a parked notice) and the head it holds as a version gap
/// (`gaps_held`), in the same batch as the head it claims. A store that decides again after
/// committing its parks (the locked mode of a SQL store) must add up what each decision held,
/// not report the last one's alone.
pub async fn a_claim_reports_what_it_parked_and_held_beside_what_it_claimed<H: OutboxHarness>(
    h: &H,
) {
    let caps = h.capabilities();
    let modes = claim_modes(&caps);
    for mode in modes {
        let store = h.store(mode).await;
        let (p, g, c) = (agg("rep-stale"), agg("rep-gap"), agg("rep-head"));
        let p1 = event(&p, 1);
        append_committed(h, &store, std::slice::from_ref(&p1)).await;
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[&p1]), "{mode:?}: setup");
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
        // Version 1 of `p` again (published already: stale), version 2 of `g` (1 missing:
        // held), version 1 of `c` (claimable).
        let (stale, g2, c1) = (event(&p, 1), event(&g, 2), event(&c, 1));
        append_committed(h, &store, &[stale.clone(), g2.clone(), c1.clone()]).await;
        let b = claim(&store, "r", 10).await;
        assert_eq!(ids(&b), set(&[&c1]), "{mode:?}");
        let parked: Vec<(EventId, ParkKind)> =
            b.parked.iter().map(|n| (n.event_id, n.kind)).collect();
        assert_eq!(
            parked,
            vec![(stale.event_id, ParkKind::OutOfOrder)],
            "{mode:?}: the stale version parked and reported"
        );
        assert_eq!(
            b.gaps_held, 1,
            "{mode:?}: version 2 of {g} held and reported"
        );
        store
            .complete(&b.handle, &publish_all(&b))
            .await
            .expect("complete");
        assert_eq!(
            store.stats().await.expect("stats").version_gaps_held,
            1,
            "{mode:?}"
        );
        fill_the_gap(h, &store, mode, &event(&g, 1), &g2).await;
    }
}

// ---- Runs (`outbox_core::store`, *Runs*; capability `runs`) ----

/// Runs: a claim asking for runs gets, after each head, its aggregate's next versions, adjacent
/// and in version order with run positions 0, 1, 2, ..., each counted against the limit; a
/// whole run published advances `last` to its end. A store without runs hands out heads only.
pub async fn runs_are_consecutive_from_the_next_version<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    let store = default_store(h).await;
    let (a, b) = (agg("run-a"), agg("run-b"));
    let a_events: Vec<Envelope> = (1..=5).map(|v| event(&a, v)).collect();
    append_committed(h, &store, &a_events).await;
    append_committed(h, &store, &[event(&b, 1)]).await;
    let batch = claim_run(&store, "r", 100, 10).await;
    if !caps.runs {
        assert!(
            batch.records.iter().all(|r| r.run_position == 0),
            "a store without runs hands out heads only: {:?}",
            layout(&batch)
        );
        assert_eq!(batch.records.len(), 2, "{:?}", layout(&batch));
        return not_applicable(
            "runs_are_consecutive_from_the_next_version",
            "the store hands out heads only (capability runs)",
        );
    }
    let mut want = run_of(&a, 1..=5);
    want.push((b.clone(), 1, 0));
    let mut got = layout(&batch);
    // Aggregates may come in any order; each run stays together and in order.
    let pos_a = got.iter().position(|x| x.0 == a).expect("a is claimed");
    let end = (pos_a + 5).min(got.len());
    let a_part: Vec<_> = got.drain(pos_a..end).collect();
    assert_eq!(
        a_part,
        run_of(&a, 1..=5),
        "the run of a: {:?}",
        layout(&batch)
    );
    assert_eq!(
        got,
        vec![(b.clone(), 1, 0)],
        "{:?} / {want:?}",
        layout(&batch)
    );
    store
        .complete(&batch.handle, &publish_all(&batch))
        .await
        .expect("complete");
    // `last` is now 5: version 6 is the head, 7 its run.
    append_committed(h, &store, &[event(&a, 6), event(&a, 7)]).await;
    let next = claim_run(&store, "r", 100, 10).await;
    assert_eq!(layout(&next), run_of(&a, 6..=7));
    store.release(&next.handle).await.expect("release");
    // A run counts against the limit, one per event; shorter runs than asked are handed out.
    let limited = claim_run(&store, "r", 1, 10).await;
    assert_eq!(layout(&limited), run_of(&a, 6..=6));
    store.release(&limited.handle).await.expect("release");
    let short = claim_run(&store, "r", 100, 1).await;
    assert_eq!(layout(&short), run_of(&a, 6..=6), "run 1: heads only");
}

/// A run ends before a missing version, before a version held by two unfinished rows, and
/// before a parked row.
pub async fn a_run_ends_at_a_gap_a_duplicate_version_or_a_parked_row<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.runs {
        return not_applicable(
            "a_run_ends_at_a_gap_a_duplicate_version_or_a_parked_row",
            "the store hands out heads only (capability runs)",
        );
    }
    let store = default_store(h).await;
    // A parked follower: version 2 parked as a gap (1 missing), then 1 commits late.
    let p = agg("run-parked");
    append_committed(h, &store, &[event(&p, 2), event(&p, 3)]).await;
    assert!(claim_run(&store, "r", 100, 10).await.is_empty());
    h.advance(caps.gap_timeout + caps.time_step).await;
    let parked = claim_run(&store, "r", 100, 10).await;
    assert!(
        parked.is_empty() && parked.parked.len() == 1,
        "setup: {parked:?}"
    );
    append_committed(h, &store, &[event(&p, 1)]).await;
    let (g, d) = (agg("run-gap"), agg("run-dup"));
    append_committed(h, &store, &[event(&g, 1), event(&g, 2), event(&g, 4)]).await;
    append_committed(
        h,
        &store,
        &[event(&d, 1), event(&d, 2), event(&d, 2), event(&d, 3)],
    )
    .await;
    let batch = claim_run(&store, "r", 100, 10).await;
    let got = layout(&batch);
    let of = |name: &str| -> Vec<(String, i64, u32)> {
        got.iter().filter(|x| x.0 == name).cloned().collect()
    };
    assert_eq!(of(&p), run_of(&p, 1..=1), "a parked version 2 ends the run");
    assert_eq!(
        of(&g),
        run_of(&g, 1..=2),
        "the missing version 3 ends the run"
    );
    assert_eq!(
        of(&d),
        run_of(&d, 1..=1),
        "two rows of version 2 end the run"
    );
}

/// The prefix rule: a `Published` outcome whose predecessor in the run is not published (in
/// the same completion or before) is refused, and so is any outcome after the run's first
/// non-published one; what is accepted is applied, and the refused rows stay pending.
pub async fn a_run_completion_with_a_hole_is_refused_after_it<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.runs {
        return not_applicable(
            "a_run_completion_with_a_hole_is_refused_after_it",
            "the store hands out heads only (capability runs)",
        );
    }
    let store = default_store(h).await;
    let (a, b) = (agg("hole-a"), agg("hole-b"));
    let av: Vec<Envelope> = (1..=3).map(|v| event(&a, v)).collect();
    let bv: Vec<Envelope> = (1..=2).map(|v| event(&b, v)).collect();
    append_committed(h, &store, &av).await;
    append_committed(h, &store, &bv).await;
    let batch = claim_run(&store, "r", 100, 10).await;
    assert_eq!(batch.records.len(), 5, "setup: {:?}", layout(&batch));
    let retry = Outcome::Retry {
        event_id: av[1].event_id,
        delay: caps.time_step,
        error: last_error(ErrorClass::Transient),
    };
    // a: 1 published, 2 failed, 3 published (a hole); b: 2 published without 1.
    let outcomes = vec![
        published(av[0].event_id, 0),
        retry,
        published(av[2].event_id, 1),
        published(bv[1].event_id, 2),
    ];
    let rep = store
        .complete(&batch.handle, &outcomes)
        .await
        .expect("complete");
    let refused: BTreeSet<EventId> = rep.superseded_events.iter().copied().collect();
    assert_eq!(
        refused,
        set(&[&av[2], &bv[1]]),
        "a Published after an unpublished version must be refused"
    );
    assert_eq!((rep.applied, rep.superseded), (2, 2));
    // b: nothing published, its run released: version 1 at once, then 2 after it.
    let next = claim_run(&store, "r", 100, 10).await;
    assert_eq!(layout(&next), run_of(&b, 1..=2), "a waits for its retry");
    assert!(next.records.iter().all(|r| r.attempts == 0));
    store
        .complete(&next.handle, &publish_all(&next))
        .await
        .expect("complete");
    // a: version 2 is its head again after the retry delay, with the attempt counted, and 3
    // was never published.
    h.advance(caps.time_step * 2).await;
    let again = claim_run(&store, "r", 100, 10).await;
    assert_eq!(layout(&again), run_of(&a, 2..=3));
    assert_eq!(again.records[0].attempts, 1);
    assert_eq!(again.records[1].attempts, 0);
}

/// The rest of a run (rows without an outcome) is released unchanged: claimable at once, no
/// attempt counted, not flagged as possibly sent, the first of them the aggregate's head.
pub async fn the_rest_of_a_run_is_released_and_claimable_at_once<H: OutboxHarness>(h: &H) {
    let caps = h.capabilities();
    if !caps.runs {
        return not_applicable(
            "the_rest_of_a_run_is_released_and_claimable_at_once",
            "the store hands out heads only (capability runs)",
        );
    }
    let store = default_store(h).await;
    let a = agg("rest");
    let av: Vec<Envelope> = (1..=4).map(|v| event(&a, v)).collect();
    append_committed(h, &store, &av).await;
    let batch = claim_run(&store, "r", 100, 10).await;
    assert_eq!(layout(&batch), run_of(&a, 1..=4));
    let rep = store
        .complete(
            &batch.handle,
            &[published(av[0].event_id, 0), published(av[1].event_id, 1)],
        )
        .await
        .expect("complete");
    assert_eq!((rep.applied, rep.superseded), (2, 0));
    let next = claim_run(&store, "r2", 100, 10).await;
    assert_eq!(
        layout(&next),
        run_of(&a, 3..=4),
        "the rest comes back at once"
    );
    for r in &next.records {
        assert_eq!(r.attempts, 0, "no attempt counted for a released row");
        assert!(!r.maybe_sent_before, "a released row was not sent");
    }
}
