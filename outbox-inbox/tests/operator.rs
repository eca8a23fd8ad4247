//! The operator's API over parked messages: list, show, retry, discard, audit; in order,
//! refused where it must be, over the in-memory inbox.

mod common;

use std::time::Duration;

use common::{applied, effects_once, ev, fast, Script};
use outbox_core::{
    Envelope, InboxAction, InboxParking, ParkKind, ParkedFilter, ParkedId, ParkedStatus, Publisher,
};
use outbox_inbox::*;
use outbox_testkit::{MemoryDb, MemoryInboxStore, MemoryLog};

struct Setup {
    log: MemoryLog,
    db: MemoryDb,
    script: Script,
    engine: ConsumerEngine<outbox_testkit::MemoryConsumer, MemoryInboxStore, Script>,
}

async fn run(events: &[Envelope], policy: VersionPolicy, broken: &[&str]) -> Setup {
    let log = MemoryLog::new("t", 2);
    let db = MemoryDb::default();
    let script = Script::new();
    for b in broken {
        script.broken.lock().unwrap().insert((*b).to_owned());
    }
    for r in log.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), script.clone())
        .with_version_policy(policy);
    let config = fast().with_retry_requests_interval(Duration::from_millis(20));
    let mut engine =
        ConsumerEngine::new(log.consumer("proj", &["t"]), processor, config, 3).unwrap();
    engine
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    Setup {
        log,
        db,
        script,
        engine,
    }
}

async fn open(s: &Setup) -> Vec<outbox_core::ParkedMessage> {
    s.engine.parked().list(&ParkedFilter::open()).await.unwrap()
}

/// Aggregate `x` with these versions, its handler failing: the first is parked, the rest wait.
async fn broken_x(versions: &[i64]) -> Setup {
    let events: Vec<Envelope> = versions.iter().map(|v| ev("x", *v)).collect();
    run(&events, VersionPolicy::Reject, &["x"]).await
}

/// The open parked message of aggregate `agg` at version `v`.
async fn parked_version(s: &Setup, agg: &str, v: i64) -> ParkedId {
    open(s)
        .await
        .into_iter()
        .find(|m| {
            m.record.aggregate_version == Some(v)
                && m.record
                    .aggregate
                    .as_ref()
                    .is_some_and(|k| k.aggregate_id == agg)
        })
        .expect("an open parked message at that version")
        .id
}

async fn head(s: &Setup) -> ParkedId {
    open(s)
        .await
        .into_iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .expect("a parked head")
        .id
}

#[tokio::test]
async fn retry_applies_the_head_then_releases_the_waiting_messages_in_order() {
    let s = run(
        &[ev("x", 1), ev("x", 2), ev("x", 3), ev("y", 1)],
        VersionPolicy::Reject,
        &["x"],
    )
    .await;
    assert_eq!(s.engine.report().parked, 1);
    assert_eq!(s.engine.report().waiting, 2);
    assert_eq!(applied(&s.db, "y"), vec![1]);
    let ops = s.engine.parked();
    let id = head(&s).await;
    // Still broken: the retry fails, the head stays parked with one more attempt, audited.
    let r = ops.retry(id, "alice", "try again").await.unwrap();
    assert_eq!(r.applied, 0);
    assert!(!r.released);
    assert_eq!(r.still_parked.as_ref().map(|(i, _)| *i), Some(id));
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!((m.status, m.attempts), (ParkedStatus::Parked, 2));
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(trail.len(), 1);
    assert!(trail[0].outcome.contains("failed again"), "{:?}", trail[0]);
    // Fixed: the retry applies x v1, v2, v3 in order and releases the aggregate.
    s.script.broken.lock().unwrap().clear();
    let r = ops.retry(id, "alice", "schema fixed").await.unwrap();
    assert_eq!((r.applied, r.skipped, r.released), (3, 0, true));
    assert_eq!(applied(&s.db, "x"), vec![1, 2, 3]);
    assert!(open(&s).await.is_empty());
    let all = ops.list(&ParkedFilter::open().all()).await.unwrap();
    assert!(all
        .iter()
        .all(|m| m.status == ParkedStatus::Applied && m.resolved_at.is_some()));
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(trail.len(), 2);
    assert_eq!(
        (
            trail[1].action,
            trail[1].actor.as_str(),
            trail[1].reason.as_str()
        ),
        (InboxAction::Retry, "alice", "schema fixed")
    );
    // A resolved message cannot be retried again; an unknown id is reported.
    assert!(matches!(
        ops.retry(id, "alice", "again").await,
        Err(OperatorError::NotOpen { .. })
    ));
    assert!(matches!(
        ops.retry(ParkedId(999_999), "alice", "x").await,
        Err(OperatorError::NotFound(_))
    ));
    effects_once(&s.db);
}

#[tokio::test]
async fn the_aggregate_flows_again_after_a_release() {
    let mut s = broken_x(&[1, 2]).await;
    s.script.broken.lock().unwrap().clear();
    let id = head(&s).await;
    s.engine.parked().retry(id, "ops", "fixed").await.unwrap();
    for r in s.log.publish(&[&ev("x", 3)]).await {
        r.unwrap();
    }
    let rep = s
        .engine
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(rep.waiting, 1, "only the one parked before");
    assert_eq!(applied(&s.db, "x"), vec![1, 2, 3]);
}

#[tokio::test]
async fn discard_needs_a_reason_counts_the_version_and_releases_the_rest() {
    let s = broken_x(&[1, 2, 3]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    assert!(matches!(
        ops.discard(id, "bob", " ").await,
        Err(OperatorError::Invalid(_))
    ));
    assert!(matches!(
        ops.discard(id, "", "why").await,
        Err(OperatorError::Invalid(_))
    ));
    s.script.broken.lock().unwrap().clear();
    let r = ops.discard(id, "bob", "duplicate order").await.unwrap();
    assert_eq!((r.discarded, r.applied, r.released), (1, 2, true));
    // v1 discarded (no effect), v2 and v3 applied: no version gap after a discard.
    assert_eq!(applied(&s.db, "x"), vec![2, 3]);
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!(m.status, ParkedStatus::Discarded);
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(trail.len(), 1);
    assert_eq!(
        (
            trail[0].action,
            trail[0].reason.as_str(),
            trail[0].outcome.as_str()
        ),
        (
            InboxAction::Discard,
            "duplicate order",
            "discarded; releasing 2 waiting message(s)"
        )
    );
    // The discarded event is registered: a redelivery is not applied.
    let inbox = MemoryInboxStore::new(&s.db);
    assert!(inbox.is_registered("proj", m.record.dedup_id.unwrap()));
}

/// Discarding a parked head counts its version as done: the aggregate's applied version moves
/// up to it (from an applied predecessor, and from nothing), so the next version is no gap.
#[tokio::test]
async fn discard_moves_the_applied_version_up_to_the_discarded_one() {
    let key = outbox_core::AggregateKey::new("order", "x");
    let inbox = |s: &Setup| MemoryInboxStore::new(&s.db);
    // From an applied predecessor: x1 applied, x2 parked and discarded.
    let mut s = run(&[ev("x", 1)], VersionPolicy::Reject, &[]).await;
    assert_eq!(inbox(&s).applied_version("proj", &key), Some(1));
    s.script.broken.lock().unwrap().insert("x".to_owned());
    for r in s.log.publish(&[&ev("x", 2)]).await {
        r.unwrap();
    }
    s.engine
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    let id = head(&s).await;
    s.engine
        .parked()
        .discard(id, "bob", "bad data")
        .await
        .unwrap();
    assert_eq!(inbox(&s).applied_version("proj", &key), Some(2));
    // From nothing: the aggregate's first message parked and discarded.
    let s = broken_x(&[1]).await;
    assert_eq!(inbox(&s).applied_version("proj", &key), None);
    let id = head(&s).await;
    s.engine
        .parked()
        .discard(id, "bob", "bad data")
        .await
        .unwrap();
    assert_eq!(inbox(&s).applied_version("proj", &key), Some(1));
}

#[tokio::test]
async fn discarding_a_waiting_message_keeps_the_head() {
    let s = broken_x(&[1, 2]).await;
    let ops = s.engine.parked();
    let waiting = open(&s)
        .await
        .into_iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .unwrap()
        .id;
    let r = ops.discard(waiting, "bob", "superseded").await.unwrap();
    assert_eq!((r.discarded, r.released), (1, false));
    assert_eq!(open(&s).await.len(), 1);
    assert!(applied(&s.db, "x").is_empty());
}

/// Discarding a later version while a lower one of its aggregate is still open must not move
/// the applied version past the lower one: that one would turn stale and be lost. After the
/// fix, the head and the versions nobody discarded apply, in order.
#[tokio::test]
async fn discarding_a_later_version_leaves_the_lower_open_ones_applicable() {
    // x: v3 is discarded between open versions; y: the last version is discarded.
    let s = run(
        &[
            ev("x", 1),
            ev("x", 2),
            ev("x", 3),
            ev("x", 4),
            ev("y", 1),
            ev("y", 2),
            ev("y", 3),
        ],
        VersionPolicy::Reject,
        &["x", "y"],
    )
    .await;
    let ops = s.engine.parked();
    let heads = (
        parked_version(&s, "x", 1).await,
        parked_version(&s, "y", 1).await,
    );
    for id in [
        parked_version(&s, "x", 3).await,
        parked_version(&s, "y", 3).await,
    ] {
        let r = ops.discard(id, "bob", "superseded").await.unwrap();
        assert_eq!((r.discarded, r.released), (1, false));
    }
    s.script.broken.lock().unwrap().clear();
    let r = ops.retry(heads.0, "carol", "fixed").await.unwrap();
    assert_eq!((r.applied, r.released), (3, true), "{r:?}");
    let r = ops.retry(heads.1, "carol", "fixed").await.unwrap();
    assert_eq!((r.applied, r.released), (2, true), "{r:?}");
    assert_eq!(applied(&s.db, "x"), vec![1, 2, 4]);
    assert_eq!(applied(&s.db, "y"), vec![1, 2]);
    assert!(open(&s).await.is_empty());
    effects_once(&s.db);
}

/// Two events of one aggregate with the same version (the outbox does not forbid it): the
/// head is parked and the other waits. Discarding the waiting one must not make the head
/// stale: the head was not discarded, and applies after the fix.
#[tokio::test]
async fn discarding_a_waiting_copy_of_the_heads_version_keeps_the_head_applicable() {
    let s = broken_x(&[2, 2]).await;
    let ops = s.engine.parked();
    let head_id = head(&s).await;
    let waiting = open(&s)
        .await
        .into_iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .expect("the second v2 waits")
        .id;
    ops.discard(waiting, "bob", "duplicate version")
        .await
        .unwrap();
    s.script.broken.lock().unwrap().clear();
    let r = ops.retry(head_id, "carol", "fixed").await.unwrap();
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    assert_eq!(applied(&s.db, "x"), vec![2]);
    // The mirror case: discarding the head releases the waiting copy, which applies.
    let s = broken_x(&[2, 2]).await;
    let ops = s.engine.parked();
    s.script.broken.lock().unwrap().clear();
    let r = ops
        .discard(head(&s).await, "bob", "duplicate version")
        .await
        .unwrap();
    assert_eq!((r.discarded, r.applied, r.released), (1, 1, true), "{r:?}");
    assert_eq!(applied(&s.db, "x"), vec![2]);
    assert!(open(&s).await.is_empty());
}

/// Discards that held their skip back (a lower version was open) count once the last open
/// message is discarded: the next version applies, no gap.
#[tokio::test]
async fn discarding_the_waiting_messages_then_the_head_counts_the_highest_version() {
    let mut s = broken_x(&[1, 2, 3]).await;
    let ops = s.engine.parked();
    for v in [3, 2, 1] {
        let id = parked_version(&s, "x", v).await;
        ops.discard(id, "bob", "voided").await.unwrap();
    }
    assert!(open(&s).await.is_empty());
    let key = outbox_core::AggregateKey::new("order", "x");
    assert_eq!(
        MemoryInboxStore::new(&s.db).applied_version("proj", &key),
        Some(3)
    );
    s.script.broken.lock().unwrap().clear();
    for r in s.log.publish(&[&ev("x", 4)]).await {
        r.unwrap();
    }
    s.engine
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    assert_eq!(applied(&s.db, "x"), vec![4]);
    assert!(open(&s).await.is_empty());
}

/// A discard of the only open message of its aggregate releases it at once, and says so in
/// the audit trail.
#[tokio::test]
async fn discarding_a_lone_message_releases_its_aggregate() {
    let s = broken_x(&[1]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    let r = ops.discard(id, "bob", "voided").await.unwrap();
    assert_eq!((r.discarded, r.applied, r.released), (1, 0, true));
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(trail.len(), 1);
    assert_eq!(trail[0].outcome, "discarded; nothing waits behind it");
    assert!(open(&s).await.is_empty());
}

/// Discarding a waiting message leaves the head alone: the head is not retried, even when
/// its handler would now succeed (only an operator's retry or discard of the head does that).
#[tokio::test]
async fn discarding_a_waiting_message_does_not_retry_the_head() {
    let s = broken_x(&[1, 2, 3]).await;
    let ops = s.engine.parked();
    let head_id = head(&s).await;
    let attempts = ops.show(head_id).await.unwrap().unwrap().attempts;
    let v3 = parked_version(&s, "x", 3).await;
    s.script.broken.lock().unwrap().clear();
    let r = ops.discard(v3, "bob", "superseded").await.unwrap();
    assert_eq!((r.discarded, r.applied, r.released), (1, 0, false));
    let head = ops.show(head_id).await.unwrap().unwrap();
    assert_eq!(
        (head.status, head.attempts),
        (ParkedStatus::Parked, attempts)
    );
    assert!(applied(&s.db, "x").is_empty());
    assert_eq!(
        ops.audit_trail(Some(v3)).await.unwrap()[0].outcome,
        "discarded; 2 other message(s) of its aggregate stay open"
    );
}

/// A release applies what is due and skips what turned stale (a second event with a version
/// already applied), and counts each.
#[tokio::test]
async fn a_release_counts_the_stale_messages_it_skips() {
    let s = broken_x(&[1, 2, 2]).await;
    let ops = s.engine.parked();
    s.script.broken.lock().unwrap().clear();
    let r = ops.retry(head(&s).await, "carol", "fixed").await.unwrap();
    assert_eq!((r.applied, r.skipped, r.released), (2, 1, true), "{r:?}");
    assert_eq!(applied(&s.db, "x"), vec![1, 2]);
}

#[tokio::test]
async fn retry_of_a_version_gap_accepts_the_gap_but_never_a_stale_version() {
    let s = run(
        &[ev("x", 1), ev("x", 3), ev("x", 4), ev("x", 2)],
        VersionPolicy::Reject,
        &[],
    )
    .await;
    // x v3 parked as a gap; v4 and the late v2 wait behind it.
    assert_eq!(
        (s.engine.report().parked, s.engine.report().waiting),
        (1, 2)
    );
    let ops = s.engine.parked();
    let id = head(&s).await;
    assert_eq!(
        ops.show(id).await.unwrap().unwrap().kind,
        Some(ParkKind::VersionGap)
    );
    // Released in version order: v2 (which closes the gap), v3, v4.
    let r = ops.retry(id, "carol", "v2 arrived").await.unwrap();
    assert_eq!((r.applied, r.released), (3, true));
    assert_eq!(applied(&s.db, "x"), vec![1, 2, 3, 4]);
}

#[tokio::test]
async fn retry_of_a_gap_whose_version_never_comes_applies_it_by_operator_decision() {
    let s = run(
        &[ev("x", 1), ev("x", 3), ev("x", 4)],
        VersionPolicy::Reject,
        &[],
    )
    .await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    let r = ops
        .retry(id, "carol", "v2 was discarded upstream")
        .await
        .unwrap();
    assert_eq!((r.applied, r.released), (2, true));
    assert_eq!(applied(&s.db, "x"), vec![1, 3, 4]);
}

#[tokio::test]
async fn an_undecodable_message_can_only_be_discarded() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    log.append_raw("t", 0, None, vec![], b"junk".to_vec())
        .unwrap();
    let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new());
    let mut engine =
        ConsumerEngine::new(log.consumer("proj", &["t"]), processor, fast(), 3).unwrap();
    engine
        .run_until_quiet(Duration::from_millis(30))
        .await
        .unwrap();
    let ops = engine.parked();
    let id = ops.list(&ParkedFilter::open()).await.unwrap()[0].id;
    let r = ops.retry(id, "dan", "try").await.unwrap();
    assert!(r.still_parked.is_some());
    assert_eq!(ops.show(id).await.unwrap().unwrap().attempts, 2);
    let r = ops.discard(id, "dan", "not ours").await.unwrap();
    assert_eq!((r.discarded, r.released), (1, true));
    assert!(ops.list(&ParkedFilter::open()).await.unwrap().is_empty());
    assert_eq!(ops.audit_trail(None).await.unwrap().len(), 2);
    let stats = MemoryInboxStore::new(&db)
        .parked_stats("proj")
        .await
        .unwrap();
    assert_eq!((stats.parked, stats.waiting), (0, 0));
}

#[tokio::test]
async fn a_release_that_fails_half_way_leaves_the_failing_message_as_the_head() {
    let s = broken_x(&[1, 2, 3]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    // Make only v2 fail: a handler that fails on version 2.
    s.script.broken.lock().unwrap().clear();
    let two = parked_version(&s, "x", 2).await;
    // Fails again on v2 because "x" is broken for v2 only: emulate by re-breaking after v1.
    let processor = InboxProcessor::new(
        "proj",
        MemoryInboxStore::new(&s.db),
        FailOnVersion(2, s.script.clone()),
    );
    let r = ParkedMessages::new(processor)
        .retry(id, "erin", "partial fix")
        .await
        .unwrap();
    assert_eq!(r.applied, 1);
    assert_eq!(r.still_parked.as_ref().map(|(i, _)| *i), Some(two));
    let m = ops.show(two).await.unwrap().unwrap();
    assert_eq!(
        m.status,
        ParkedStatus::Parked,
        "the failing one is the new head"
    );
    assert_eq!(m.kind, Some(ParkKind::Unprocessable));
    assert_eq!(applied(&s.db, "x"), vec![1]);
    assert_eq!(open(&s).await.len(), 2);
}

struct FailOnVersion(i64, Script);

#[outbox_core::async_trait]
impl Handler<outbox_testkit::MemoryTx> for FailOnVersion {
    async fn handle(
        &self,
        tx: &mut outbox_testkit::MemoryTx,
        e: &Envelope,
    ) -> Result<(), HandlerError> {
        if e.aggregate_version == self.0 {
            return Err(HandlerError::permanent("still broken"));
        }
        self.1.handle(tx, e).await
    }
}

#[tokio::test]
async fn a_requested_retry_is_performed_by_the_engine_and_cleared_also_when_it_fails_again() {
    let mut s = run(
        &[ev("x", 1), ev("x", 2), ev("x", 3), ev("y", 1)],
        VersionPolicy::Reject,
        &["x"],
    )
    .await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    // Still broken: the engine performs the request, the head stays parked, audited.
    let req = ops.request_retry(id, "alice", "try").await.unwrap();
    assert_eq!(req.actor, "alice");
    assert_eq!(
        ops.show(id).await.unwrap().unwrap().retry_request,
        Some(req.clone())
    );
    let listed = ops.requested_retries().await.unwrap();
    assert_eq!(listed.iter().map(|m| m.id).collect::<Vec<_>>(), vec![id]);
    assert_eq!(
        applied(&s.db, "x"),
        Vec::<i64>::new(),
        "a request applies nothing"
    );
    let rep = s
        .engine
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(rep.requested_retries, 1);
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!((m.status, m.attempts), (ParkedStatus::Parked, 2));
    assert_eq!(m.retry_request, None, "cleared after the failed retry");
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(
        trail.iter().map(|a| a.action).collect::<Vec<_>>(),
        vec![InboxAction::RequestRetry, InboxAction::Retry]
    );
    assert!(trail[1].outcome.contains("failed again"), "{:?}", trail[1]);
    assert_eq!(
        (trail[1].actor.as_str(), trail[1].reason.as_str()),
        ("alice", "requested retry: try")
    );
    // Fixed: the next request applies x v1, v2, v3 in order and releases the aggregate.
    s.script.broken.lock().unwrap().clear();
    ops.request_retry(id, "bob", "fixed").await.unwrap();
    let rep = s
        .engine
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(rep.requested_retries, 2);
    assert_eq!(applied(&s.db, "x"), vec![1, 2, 3]);
    assert!(open(&s).await.is_empty());
    assert!(ops.requested_retries().await.unwrap().is_empty());
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!((m.status, m.retry_request), (ParkedStatus::Applied, None));
    let last = ops.audit_trail(Some(id)).await.unwrap().pop().unwrap();
    assert_eq!(
        (last.action, last.actor.as_str()),
        (InboxAction::Retry, "bob")
    );
    effects_once(&s.db);
    // Refused: resolved, unknown, no actor; nothing recorded.
    assert!(matches!(
        ops.request_retry(id, "alice", "again").await,
        Err(OperatorError::NotOpen { .. })
    ));
    assert!(matches!(
        ops.request_retry(ParkedId(999_999), "alice", "x").await,
        Err(OperatorError::NotFound(_))
    ));
    assert!(matches!(
        ops.request_retry(id, "", "x").await,
        Err(OperatorError::Invalid(_))
    ));
    assert_eq!(ops.audit_trail(Some(id)).await.unwrap().len(), 4);
}

#[tokio::test]
async fn a_request_for_a_message_resolved_meanwhile_is_cleared_without_effect() {
    let mut s = broken_x(&[1, 2]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    ops.request_retry(id, "alice", "try").await.unwrap();
    // Another operator discards it before the engine's next check.
    ops.discard(id, "bob", "voided").await.unwrap();
    s.engine
        .run_until_quiet(Duration::from_millis(50))
        .await
        .unwrap();
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!((m.status, m.retry_request), (ParkedStatus::Discarded, None));
    assert!(ops.requested_retries().await.unwrap().is_empty());
    assert_eq!(applied(&s.db, "x"), Vec::<i64>::new());
}

/// A requested retry that fails in the store (here every transaction fails to begin, as on a
/// lost connection) was not performed: its request stays for the next check.
#[tokio::test]
async fn a_requested_retry_that_fails_in_the_store_keeps_its_request() {
    use outbox_core::Classify;
    use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyInbox};
    let s = broken_x(&[1]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    ops.request_retry(id, "alice", "try").await.unwrap();
    let faults = FaultInjector::new(FaultSource::from_call(0, Fault::Transient)).only(&["begin"]);
    let faulty = ParkedMessages::new(InboxProcessor::new(
        "proj",
        FaultyInbox::new(MemoryInboxStore::new(&s.db), faults.clone()),
        s.script.clone(),
    ));
    let done = faulty.perform_requested_retries().await.unwrap();
    assert_eq!(done.len(), 1);
    assert!(
        matches!(&done[0].1, Err(OperatorError::Store(e)) if e.is_transient()),
        "{:?}",
        done[0].1
    );
    assert!(!faults.injected().is_empty());
    let kept = ops.requested_retries().await.unwrap();
    assert_eq!(kept.iter().map(|m| m.id).collect::<Vec<_>>(), vec![id]);
    let m = ops.show(id).await.unwrap().unwrap();
    assert_eq!((m.status, m.attempts), (ParkedStatus::Parked, 1));
}

/// A message resolved between a retry request's first look and its transaction is refused
/// inside the transaction: no request is recorded on a resolved message. (The request's
/// transaction is held back by an injected latency while another operator discards.)
#[tokio::test]
async fn a_retry_request_for_a_message_resolved_meanwhile_is_refused() {
    use outbox_testkit::fault::{Fault, FaultInjector, FaultSource, FaultyInbox};
    let s = broken_x(&[1]).await;
    let ops = s.engine.parked();
    let id = head(&s).await;
    let faults = FaultInjector::new(FaultSource::script([Some(Fault::Latency(
        Duration::from_millis(200),
    ))]))
    .only(&["begin"]);
    let slow = ParkedMessages::new(InboxProcessor::new(
        "proj",
        FaultyInbox::new(MemoryInboxStore::new(&s.db), faults.clone()),
        s.script.clone(),
    ));
    let request = tokio::spawn(async move { slow.request_retry(id, "alice", "try").await });
    // The request has looked at the message and waits to begin its transaction.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(faults.injected().len(), 1, "the request is held at begin");
    ops.discard(id, "bob", "voided").await.unwrap();
    let r = request.await.unwrap();
    assert!(
        matches!(
            r,
            Err(OperatorError::NotOpen {
                status: ParkedStatus::Discarded,
                ..
            })
        ),
        "{r:?}"
    );
    assert!(ops.requested_retries().await.unwrap().is_empty());
    let trail = ops.audit_trail(Some(id)).await.unwrap();
    assert_eq!(
        trail.iter().map(|a| a.action).collect::<Vec<_>>(),
        vec![InboxAction::Discard]
    );
}

#[tokio::test]
async fn the_retry_requests_interval_must_be_above_zero() {
    let log = MemoryLog::new("t", 1);
    let db = MemoryDb::default();
    let processor = InboxProcessor::new("proj", MemoryInboxStore::new(&db), Script::new());
    let err = ConsumerEngine::new(
        log.consumer("proj", &["t"]),
        processor,
        fast().with_retry_requests_interval(Duration::ZERO),
        1,
    )
    .unwrap_err();
    assert!(err.to_string().contains("retry_requests_interval"), "{err}");
    assert_eq!(
        EngineConfig::default().retry_requests_interval,
        Duration::from_secs(5)
    );
}
