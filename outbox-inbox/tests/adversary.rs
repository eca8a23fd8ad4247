//! Adversarial tests of the consumer side against a real PostgreSQL inbox (and, where the
//! broker is the point, the Kafka source against a real Kafka-protocol broker): interleavings
//! and crash points chosen to break its guarantees.
//!
//! * each effect is applied once;
//! * the committed offset never passes a message whose outcome is not final (applied,
//!   duplicate, or durably parked);
//! * a parked message holds its own aggregate only, and later messages of that aggregate are
//!   never applied before it is retried or discarded;
//! * an operator retry applies in order and then releases the waiting messages exactly once; a
//!   discard records its reason;
//! * nothing is lost across crashes, rebalances and rewinds.
//!
//! Interleavings are forced deterministically: one side is held inside its transaction (a
//! handler waiting on a gate) and the test waits, through `pg_blocking_pids`, until the other
//! side is blocked behind it.
//!
//! Tests marked `// FOUND` reproduced a defect; each was fixed and its test stays as the
//! regression test. The others are attacks that the implementation withstood.
//!
//! Each test uses its own schema (and topic and group). Needs PostgreSQL at `DATABASE_URL` and,
//! for the broker tests, a broker at `KAFKA_BROKERS` (`scripts/test` provides both).

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{wire, InboxParking, ParkKind, ParkedFilter, ParkedStatus, Publisher};
use outbox_inbox::{ConsumerEngine, InboxProcessor, VersionPolicy};
use outbox_testkit::MemoryLog;

// ---------------------------------------------------------------------------------------------
// Operator actions racing the running engine on the same aggregate
// ---------------------------------------------------------------------------------------------

/// The operator's retry holds the aggregate (its first release step is inside the handler)
/// while the engine receives the aggregate's next version and tries to park it behind the
/// head. The engine must wait for the release, and the release must then apply everything in
/// order, each version once, leaving nothing open and the offsets committed.
#[tokio::test]
async fn operator_retry_racing_the_engine_on_the_same_aggregate() {
    let ctx = ctx!("operator_retry_racing_the_engine_on_the_same_aggregate");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1), &ev("poison-a", 2), &ev("b", 1)])
        .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!((r.parked, r.waiting, r.applied), (1, 1, 1), "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(3));
    let head = open_parked(&inbox).await[0].id;

    // The operator fixes the data and retries; its first step stops inside the handler, with
    // the aggregate locked.
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let retry = tokio::spawn(async move { ops.retry(head, "alice", "customer created").await });
    h.wait_entered(1).await;

    // Meanwhile version 3 arrives; the engine parks it behind the head and must wait.
    let (stop, task) = spawn_engine(eng);
    log.publish(&[&ev("poison-a", 3)]).await;
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let report = retry.await.unwrap().unwrap();
    assert!(report.released, "{report:?}");
    assert!(report.still_parked.is_none(), "{report:?}");

    eventually("version 3 applied", || async {
        ctx.applied("poison-a").await.len() == 3
    })
    .await;
    eventually("offsets committed", || async {
        log.committed(GROUP, "t", 0) == Some(4)
    })
    .await;
    stop.send(()).unwrap();
    let (_eng, _) = task.await.unwrap();
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3]);
    assert_eq!(ctx.effects_once().await, 4);
    assert!(open_parked(&inbox).await.is_empty());
    let trail = inbox.audit_trail(GROUP, Some(head)).await.unwrap();
    assert_eq!(trail.len(), 1, "one audited action: {trail:?}");
    ctx.drop().await;
}

/// As above, but the retried head is the only open message, so the operator's step that the
/// engine waits behind is the last one and unblocks the aggregate: the engine's attempt to
/// park behind it must fail and be retried as an apply (after the head), never leave a
/// message waiting behind an aggregate that nobody will release again.
#[tokio::test]
async fn the_engine_parking_behind_the_last_release_step_applies_instead() {
    let ctx = ctx!("the_engine_parking_behind_the_last_release_step_applies_instead");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1)]).await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 1, "{r:?}");
    let head = open_parked(&inbox).await[0].id;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let retry = tokio::spawn(async move { ops.retry(head, "alice", "fixed").await });
    h.wait_entered(1).await;
    let (stop, task) = spawn_engine(eng);
    log.publish(&[&ev("poison-a", 2)]).await;
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let rep = retry.await.unwrap().unwrap();
    assert!(rep.released && rep.applied == 1, "{rep:?}");
    eventually("v2 applied", || async {
        ctx.applied("poison-a").await.len() == 2
    })
    .await;
    eventually("offsets committed", || async {
        log.committed(GROUP, "t", 0) == Some(2)
    })
    .await;
    stop.send(()).unwrap();
    let (_eng, r) = task.await.unwrap();
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(r.waiting, 0, "{r:?}");
    assert!(
        r.retries >= 1,
        "the park behind the released head was refused: {r:?}"
    );
    assert!(open_parked(&inbox).await.is_empty());
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Two operators retry the same parked head at the same moment; the second waits for the
/// first. The effects are applied once, the release happens once, and both calls end
/// cleanly (the second finds nothing left to do).
#[tokio::test]
async fn two_operator_retries_of_the_same_head() {
    let ctx = ctx!("two_operator_retries_of_the_same_head");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1), &ev("poison-a", 2), &ev("poison-a", 3)])
        .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    quiet(&mut eng).await;
    let head = open_parked(&inbox).await[0].id;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let (o1, o2) = (ops.clone(), ops.clone());
    let first = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    h.wait_entered(1).await;
    let second = tokio::spawn(async move { o2.retry(head, "bob", "fixed too").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let a = first.await.unwrap();
    let b = second.await.unwrap();
    assert!(a.as_ref().is_ok_and(|r| r.released), "{a:?}");
    // The second either found the head resolved or had nothing left to release.
    assert!(
        matches!(b, Err(outbox_inbox::OperatorError::NotOpen { .. })) || b.is_ok(),
        "{b:?}"
    );
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3]);
    assert_eq!(ctx.effects_once().await, 3);
    assert!(open_parked(&inbox).await.is_empty());
    // The engine goes on with the aggregate.
    log.publish(&[&ev("poison-a", 4)]).await;
    quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3, 4]);
    ctx.drop().await;
}

/// An operator discards a waiting message while another operator retries the head: the
/// discarded one is never applied, the rest applies in order once, and the discard's reason
/// is in the audit trail.
#[tokio::test]
async fn discard_of_a_waiting_message_racing_a_retry_of_its_head() {
    let ctx = ctx!("discard_of_a_waiting_message_racing_a_retry_of_its_head");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1), &ev("poison-a", 2), &ev("poison-a", 3)])
        .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    quiet(&mut eng).await;
    let open = open_parked(&inbox).await;
    let (head, v2) = (open[0].id, open[1].id);
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let discard =
        tokio::spawn(async move { o2.discard(v2, "bob", "v2 was sent by mistake").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = retry.await.unwrap().unwrap();
    let d = discard.await.unwrap();
    // The retry's first step (v1) committed before the discard got the aggregate; the retry's
    // next step then either saw v2 discarded, or applied it before the discard ran (then the
    // discard finds it resolved).
    let applied = ctx.applied("poison-a").await;
    match &d {
        Ok(_) => {
            assert_eq!(applied, vec![1, 3], "retry {r:?}");
            let trail = inbox.audit_trail(GROUP, Some(v2)).await.unwrap();
            assert_eq!(trail.len(), 1);
            assert_eq!(trail[0].reason, "v2 was sent by mistake");
            assert_eq!(
                ops.show(v2).await.unwrap().unwrap().status,
                ParkedStatus::Discarded
            );
        }
        Err(outbox_inbox::OperatorError::NotOpen { .. }) => assert_eq!(applied, vec![1, 2, 3]),
        Err(e) => panic!("discard failed: {e}"),
    }
    ctx.effects_once().await;
    assert!(
        open_parked(&inbox).await.is_empty(),
        "retry {r:?} discard {d:?}"
    );
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Crashes
// ---------------------------------------------------------------------------------------------

/// The engine dies after effects and parkings committed but before any offset commit
/// returned, and a third message's transaction is still open (its handler waits). An operator
/// releases the parked aggregate before the restart. The restarted engine gets everything
/// again: nothing is applied twice, nothing parked twice, nothing lost.
#[tokio::test]
async fn crash_between_effect_or_park_and_offset_commit() {
    let ctx = ctx!("crash_between_effect_or_park_and_offset_commit");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[
        &ev("a", 1),
        &ev("poison-p", 1),
        &ev("poison-p", 2),
        &ev("a", 2),
        &ev("g", 1),
    ])
    .await;
    let gate = h.gate("g");
    let eng = engine(
        CommitControl::hanging(log.consumer(GROUP, &["t"])),
        &inbox,
        &h,
        VersionPolicy::Reject,
        // No commit before the end: g's transaction is open until the crash.
        fast()
            .with_max_batch(1)
            .with_commit(1_000, Duration::from_secs(3600)),
    );
    let task = tokio::spawn(async move {
        let mut eng = eng;
        eng.run_until_quiet(Duration::from_secs(3600)).await
    });
    h.wait_entered(1).await;
    eventually("a applied and p parked", || async {
        ctx.applied("a").await.len() == 2 && open_parked(&inbox).await.len() == 2
    })
    .await;
    // The process dies: the offset commit never returned, g's transaction is abandoned.
    task.abort();
    let _ = task.await;
    assert_eq!(log.committed(GROUP, "t", 0), None);
    assert!(ctx.applied("g").await.is_empty());
    h.gates.lock().unwrap().clear();
    drop(gate);

    // The operator releases the parked aggregate before the consumer comes back.
    ctx.fix("poison-p").await;
    let head = open_parked(&inbox).await[0].id;
    let rel = operator(&inbox, &h, VersionPolicy::Reject)
        .retry(head, "alice", "fixed")
        .await
        .unwrap();
    assert_eq!((rel.applied, rel.released), (2, true));

    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!(r.received, 5, "{r:?}");
    assert_eq!(r.applied, 1, "only g is new: {r:?}");
    assert_eq!(r.parked + r.waiting + r.already_parked, 0, "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(5));
    assert_eq!(ctx.applied("a").await, vec![1, 2]);
    assert_eq!(ctx.applied("poison-p").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 5);
    assert!(open_parked(&inbox).await.is_empty());
    ctx.drop().await;
}

/// The engine dies after parking, before the offset commit, and comes back while the
/// aggregate is still parked: the redelivered messages are recognised as parked already
/// (nothing parked twice, nothing applied), and the offsets move on.
#[tokio::test]
async fn crash_after_parking_then_redelivery_while_still_parked() {
    let ctx = ctx!("crash_after_parking_then_redelivery_while_still_parked");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-p", 1), &ev("poison-p", 2)]).await;
    log.append_raw("t", 0, None, vec![], b"not an event".to_vec())
        .unwrap();
    let eng = engine(
        CommitControl::hanging(log.consumer(GROUP, &["t"])),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let task = tokio::spawn(async move {
        let mut eng = eng;
        eng.run_until_quiet(Duration::from_secs(3600)).await
    });
    eventually("three parked", || async {
        open_parked(&inbox).await.len() == 3
    })
    .await;
    task.abort();
    let _ = task.await;
    assert_eq!(log.committed(GROUP, "t", 0), None);

    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!(r.already_parked, 3, "{r:?}");
    assert_eq!(r.applied, 0, "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(3));
    assert_eq!(open_parked(&inbox).await.len(), 3);
    assert!(ctx.applied("poison-p").await.is_empty());
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Handlers, batches and duplicates
// ---------------------------------------------------------------------------------------------

// FOUND: a handler that swallows a failed statement leaves PostgreSQL's transaction aborted;
// `COMMIT` of an aborted transaction rolls back without an error, so the store reported a
// commit, the engine counted the message applied and committed its offset: the effect and the
// registration were gone and the message was never delivered again. Now the commit fails
// (nothing was committed), the offset stays, and the message is applied once the handler
// stops failing.
#[tokio::test]
async fn a_transaction_aborted_behind_the_handlers_back_is_not_reported_committed() {
    let ctx = ctx!("a_transaction_aborted_behind_the_handlers_back_is_not_reported_committed");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("b", 1), &ev("swallow-a", 1)]).await;
    for policy in [VersionPolicy::Unchecked, VersionPolicy::Reject] {
        h.swallow.store(true, Ordering::SeqCst);
        let group = format!("g-{policy:?}");
        let eng = ConsumerEngine::new(
            log.consumer(&group, &["t"]),
            InboxProcessor::new(group.clone(), inbox.clone(), h.clone())
                .with_version_policy(policy),
            fast().with_max_batch(1),
            7,
        )
        .unwrap();
        let task = tokio::spawn(async move {
            let mut eng = eng;
            let r = eng.run_until_quiet(Duration::from_millis(300)).await;
            (eng, r)
        });
        // b is applied and committed; swallow-a never is while the handler swallows errors.
        eventually("b committed", || async {
            log.committed(&group, "t", 0).is_some()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            log.committed(&group, "t", 0),
            Some(1),
            "{policy:?}: the offset passed a message whose transaction rolled back"
        );
        h.swallow.store(false, Ordering::SeqCst);
        let (eng, r) = task.await.unwrap();
        let r = r.unwrap();
        assert_eq!(log.committed(&group, "t", 0), Some(2), "{policy:?} {r:?}");
        assert_eq!(eng.report().applied, 2, "{policy:?} {r:?}");
        let mut tx = inbox.pool().begin().await.unwrap();
        sqlx::query(&format!("DELETE FROM \"{}\".effects", ctx.schema))
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    ctx.drop().await;
}

/// Copies of one event inside one batch (the relay re-published it; a re-issued copy), under
/// every version policy: applied once, the rest counted as duplicates, all offsets final.
#[tokio::test]
async fn duplicates_inside_one_batch_are_applied_once() {
    let ctx = ctx!("duplicates_inside_one_batch_are_applied_once");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    for (i, policy) in [
        VersionPolicy::Reject,
        VersionPolicy::Unchecked,
        VersionPolicy::hold(10, Duration::from_secs(5)),
    ]
    .into_iter()
    .enumerate()
    {
        let log = MemoryLog::new("t", 1);
        let agg = format!("a{i}");
        let (e1, e2) = (ev(&agg, 1), ev(&agg, 2));
        log.publish(&[&e1, &e1, &e2, &e1, &e2]).await;
        let group = format!("g{i}");
        let mut eng = ConsumerEngine::new(
            log.consumer(&group, &["t"]),
            InboxProcessor::new(group.clone(), inbox.clone(), h.clone())
                .with_version_policy(policy),
            fast().with_commit(100, Duration::from_secs(60)),
            7,
        )
        .unwrap();
        let r = quiet(&mut eng).await;
        assert_eq!(r.applied, 2, "{policy:?} {r:?}");
        assert_eq!(r.duplicates + r.stale, 3, "{policy:?} {r:?}");
        assert_eq!(log.committed(&group, "t", 0), Some(5), "{policy:?}");
        assert_eq!(ctx.applied(&agg).await, vec![1, 2], "{policy:?}");
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

/// A batch of several aggregates in which one event fails partway (a permanent failure of
/// the third event of five): the transaction rolls back, the others are applied again once,
/// the failing one is parked, and its aggregate's later event waits.
#[tokio::test]
async fn a_batch_failing_partway_applies_the_others_once() {
    let ctx = ctx!("a_batch_failing_partway_applies_the_others_once");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[
        &ev("a", 1),
        &ev("b", 1),
        &ev("poison-c", 1),
        &ev("a", 2),
        &ev("poison-c", 2),
        &ev("d", 1),
    ])
    .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_commit(100, Duration::from_secs(60)),
    );
    let r = quiet(&mut eng).await;
    assert_eq!((r.applied, r.parked, r.waiting), (4, 1, 1), "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(6));
    assert_eq!(ctx.applied("a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 4);
    let open = open_parked(&inbox).await;
    assert_eq!(open.len(), 2);
    assert_eq!(open[0].status, ParkedStatus::Parked);
    assert_eq!(open[0].kind, Some(ParkKind::Unprocessable));
    assert_eq!(open[1].status, ParkedStatus::Waiting);
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Version policies and parking
// ---------------------------------------------------------------------------------------------

// FOUND: version 3 arrives before version 2 and is parked as a gap; version 2 then arrives and
// waits behind it. Discarding version 3 moved the aggregate's applied version to 3 at once, so
// the release found version 2 "stale" and resolved it without effect: an event nobody
// discarded was lost. Now the discarded version counts as applied only once the lower ones
// waiting before it are released.
#[tokio::test]
async fn discarding_a_gap_head_does_not_swallow_the_lower_version_waiting_behind_it() {
    let ctx = ctx!("discarding_a_gap_head_does_not_swallow_the_lower_version_waiting_behind_it");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("a", 1), &ev("a", 3), &ev("a", 2)]).await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!((r.applied, r.parked, r.waiting), (1, 1, 1), "{r:?}");
    let open = open_parked(&inbox).await;
    let head = open
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let rep = eng
        .parked()
        .discard(head, "alice", "v3 was published twice by a bug")
        .await
        .unwrap();
    assert!(rep.released, "{rep:?}");
    assert_eq!(
        ctx.applied("a").await,
        vec![1, 2],
        "version 2 was never discarded: it must be applied ({rep:?})"
    );
    // Version 3 counts as done: version 4 follows without a gap.
    log.publish(&[&ev("a", 4)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 1, "no new parking: {r:?}");
    assert_eq!(ctx.applied("a").await, vec![1, 2, 4]);
    let trail = inbox.audit_trail(GROUP, Some(head)).await.unwrap();
    assert_eq!(trail[0].reason, "v3 was published twice by a bug");
    assert!(open_parked(&inbox).await.is_empty());
    ctx.drop().await;
}

/// Hold policy: a gap is held (its offset not final, so the commit waits), the hold expires
/// and the gap is parked; the missing version arrives later and waits behind it; the
/// operator's retry applies the missing version first, then the held one, each once.
#[tokio::test]
async fn hold_then_park_then_the_missing_version_arrives() {
    let ctx = ctx!("hold_then_park_then_the_missing_version_arrives");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    let policy = VersionPolicy::hold(10, Duration::from_millis(300));
    log.publish(&[&ev("a", 1), &ev("a", 3), &ev("b", 1)]).await;
    let mut eng = engine(log.consumer(GROUP, &["t"]), &inbox, &h, policy, fast());
    // While v3 is held, the committed offset stays at it.
    let deadline = Instant::now() + Duration::from_secs(5);
    while ctx.applied("b").await.is_empty() || eng.report().held == 0 {
        assert!(Instant::now() < deadline);
        eng.step().await.unwrap();
    }
    for _ in 0..5 {
        eng.step().await.unwrap();
    }
    eng.commit_final().await.unwrap();
    assert_eq!(eng.report().held, 1);
    assert_eq!(
        log.committed(GROUP, "t", 0),
        Some(1),
        "held v3 is not final"
    );
    quiet(&mut eng).await;
    tokio::time::sleep(Duration::from_millis(350)).await;
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 1, "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(3));
    log.publish(&[&ev("a", 2)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(r.waiting, 1, "{r:?}");
    assert_eq!(ctx.applied("a").await, vec![1]);
    let head = open_parked(&inbox)
        .await
        .into_iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let rep = eng.parked().retry(head, "alice", "v2 came").await.unwrap();
    assert_eq!((rep.applied, rep.released), (2, true), "{rep:?}");
    assert_eq!(ctx.applied("a").await, vec![1, 2, 3]);
    assert_eq!(ctx.effects_once().await, 4);
    ctx.drop().await;
}

/// Records from a plain producer: no headers, garbage headers, a non-numeric version (its
/// aggregate is readable, so the aggregate waits behind it), an empty value. Each is parked
/// raw, the partition moves on, other aggregates flow, and a discard releases the aggregate.
///
/// FOUND: a header name (or an aggregate header value) with a NUL character, which Kafka
/// allows, made every inbox statement fail (`text` cannot hold NUL): a permanent store error
/// that stopped the engine at the same offset on every restart. Text is now mapped (NUL to
/// U+FFFD) wherever the inbox binds it; raw header values stay bytes.
#[tokio::test]
async fn malformed_records_from_a_plain_producer() {
    let ctx = ctx!("malformed_records_from_a_plain_producer");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("a", 1)]).await;
    // No headers at all.
    log.append_raw("t", 0, Some(b"k".to_vec()), vec![], b"{}".to_vec())
        .unwrap();
    // Garbage headers (not UTF-8, unknown names).
    log.append_raw(
        "t",
        0,
        None,
        vec![
            ("event_id".into(), vec![0xff, 0xfe]),
            ("\u{0}".into(), b"x".to_vec()),
        ],
        b"x".to_vec(),
    )
    .unwrap();
    // A well-formed event of aggregate a whose version is not a number.
    let bad = ev("a", 2);
    let headers: Vec<(String, Vec<u8>)> = wire::encode_headers(&bad)
        .into_iter()
        .map(|(k, v)| {
            if k == wire::AGGREGATE_VERSION {
                (k, b"two".to_vec())
            } else {
                (k, v)
            }
        })
        .collect();
    log.append_raw("t", 0, None, headers, bad.payload.bytes.to_vec())
        .unwrap();
    // An empty value with valid headers of another aggregate.
    let empty = ev("e", 1);
    log.append_raw("t", 0, None, wire::encode_headers(&empty), Vec::new())
        .unwrap();
    log.publish(&[&ev("a", 3), &ev("b", 1)]).await;
    // An aggregate id with a NUL character, and no other envelope field.
    log.append_raw(
        "t",
        0,
        None,
        vec![
            (wire::AGGREGATE_TYPE.into(), b"order".to_vec()),
            (wire::AGGREGATE_ID.into(), b"x\0y".to_vec()),
        ],
        b"x".to_vec(),
    )
    .unwrap();
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!(log.committed(GROUP, "t", 0), Some(8), "{r:?}");
    // Parked: no headers, garbage headers, the bad version of a, the NUL aggregate. The empty
    // value with valid headers is an event with an empty payload: applied.
    assert_eq!((r.parked, r.waiting, r.applied), (4, 1, 3), "{r:?}");
    assert_eq!(ctx.applied("b").await, vec![1]);
    assert_eq!(ctx.applied("e").await, vec![1]);
    assert_eq!(
        ctx.applied("a").await,
        vec![1],
        "a v3 waits behind the bad v2"
    );
    let open = open_parked(&inbox).await;
    let bad_v2 = open
        .iter()
        .find(|m| m.record.position.offset == 3)
        .expect("the non-numeric version is parked");
    assert_eq!(bad_v2.status, ParkedStatus::Parked);
    assert!(open.iter().any(|m| m.record.position.offset == 1
        && m.record.headers.is_empty()
        && m.record.value.as_deref() == Some(&b"{}"[..])));
    assert!(open.iter().any(|m| m.record.position.offset == 2));
    // A second engine run (a redelivery of everything) parks nothing twice.
    //
    // FOUND (minor): the redelivered a v1, applied long ago, was parked as "waiting" behind
    // the blocked aggregate (noise for the operator, skipped on release). A version at or
    // below the applied one is now stale even while its aggregate is blocked.
    let mut eng2 = engine(
        log.consumer("again", &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r2 = quiet(&mut eng2).await;
    assert_eq!(r2.parked + r2.waiting, 0, "{r2:?}");
    let rep = eng
        .parked()
        .discard(bad_v2.id, "alice", "producer bug: version as a word")
        .await
        .unwrap();
    // Its version is unknown, so nothing counts as applied: v3 is a gap now, parked for the
    // operator to accept.
    let (gap_id, why) = rep.still_parked.clone().expect("v3 parked as a gap");
    assert!(why.contains("version gap"), "{rep:?}");
    assert_eq!(ctx.applied("a").await, vec![1]);
    let rep = eng
        .parked()
        .retry(gap_id, "alice", "v2 is gone for good")
        .await
        .unwrap();
    assert!(rep.released, "{rep:?}");
    assert_eq!(ctx.applied("a").await, vec![1, 3]);
    ctx.effects_once().await;
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Offsets: rewinds and commits
// ---------------------------------------------------------------------------------------------

/// Offsets 0..3 are final but their commit fails transiently and is kept for the next one;
/// then the log is rewound (the same offsets now hold new records) while the new record at
/// offset 0 is still running. The kept offset 3 must not be sent after the rewind (it held:
/// the new epoch's first watermark replaces the kept commit of its partition).
#[tokio::test]
async fn a_commit_kept_from_before_a_rewind_is_not_sent_after_it() {
    let ctx = ctx!("a_commit_kept_from_before_a_rewind_is_not_sent_after_it");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let scripted = Scripted::default();
    let fail = Arc::new(AtomicBool::new(true));
    let source = CommitControl {
        inner: scripted.clone(),
        hang: false,
        fail: fail.clone(),
        commits: Arc::default(),
    };
    let commits = source.commits.clone();
    let mut eng = engine(
        source,
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_max_batch(1),
    );
    for (o, agg) in ["o0", "o1", "o2"].iter().enumerate() {
        scripted.push(o as i64, &ev(agg, 1));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while ctx.applied("o2").await.is_empty() {
        assert!(Instant::now() < deadline);
        eng.step().await.unwrap();
    }
    eng.commit_final().await.unwrap();
    assert!(commits.lock().unwrap().is_empty(), "commits fail so far");
    // The log is rewound: offset 0 holds a new record, whose handler is still running.
    let _gate = h.gate("n0");
    scripted.push(0, &ev("n0", 1));
    scripted.push(1, &ev("n1", 1));
    let deadline = Instant::now() + Duration::from_secs(10);
    while ctx.applied("n1").await.is_empty() {
        assert!(Instant::now() < deadline);
        eng.step().await.unwrap();
    }
    fail.store(false, Ordering::SeqCst);
    for _ in 0..5 {
        eng.step().await.unwrap();
    }
    eng.commit_final().await.unwrap();
    let sent = commits.lock().unwrap().clone();
    assert!(
        sent.iter().all(|c| c.next_offset == 0),
        "the new record at offset 0 is not final, yet {sent:?} was committed"
    );
    assert_eq!(eng.report().rewinds, 1);
    drop(eng);
    ctx.drop().await;
}

// FOUND: head v1 parked, v2 and v3 waiting. Discarding the waiting v2 moved the applied
// version to 2 at once; the later retry of v1 then found it "stale" and resolved it without
// effect. The discarded version now counts as applied only when the release passes it.
#[tokio::test]
async fn discarding_a_waiting_message_does_not_make_its_head_stale() {
    let ctx = ctx!("discarding_a_waiting_message_does_not_make_its_head_stale");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1), &ev("poison-a", 2), &ev("poison-a", 3)])
        .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    quiet(&mut eng).await;
    let open = open_parked(&inbox).await;
    let (head, v2) = (open[0].id, open[1].id);
    let ops = eng.parked();
    let d = ops
        .discard(v2, "bob", "v2 was sent by mistake")
        .await
        .unwrap();
    assert!(!d.released, "the head still blocks: {d:?}");
    ctx.fix("poison-a").await;
    let r = ops.retry(head, "alice", "fixed").await.unwrap();
    assert!(r.released, "{r:?}");
    assert_eq!(
        ctx.applied("poison-a").await,
        vec![1, 3],
        "v1 was retried, not discarded: {r:?}"
    );
    log.publish(&[&ev("poison-a", 4)]).await;
    let rep = quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![1, 3, 4], "{rep:?}");
    assert!(open_parked(&inbox).await.is_empty());
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// The broker: rebalances with batches in flight
// ---------------------------------------------------------------------------------------------

/// Two engines in one consumer group over the PostgreSQL inbox. The first runs alone with
/// slow batches in flight; the second joins (partitions move while batches run), later the
/// first leaves (they move again). Every event is applied once, each aggregate's versions in
/// order, nothing is parked, and the group's committed offsets end at the partitions' ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_in_one_group_with_batches_in_flight_across_rebalances() {
    let Some(brokers) = outbox_test_support::brokers("two_engines_in_one_group") else {
        return;
    };
    let ctx = ctx!("two_engines_in_one_group_with_batches_in_flight_across_rebalances");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    h.delay_ms.store(15, Ordering::SeqCst);
    let topic = outbox_test_support::unique("cadv_t");
    let group = outbox_test_support::unique("cadv_g");
    create_topic(&brokers, &topic, 2).await;
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("publisher");
    let aggs: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    // One record per produce request (tansu cannot serve a fetch starting inside a batch).
    for v in 1..=5 {
        for a in &aggs {
            let ack = publisher
                .publish(&[&ev(a, v)])
                .await
                .remove(0)
                .expect("published");
            let (_, partition, offset) = ack.as_kafka().expect("a Kafka acknowledgement");
            let e = ends.entry(partition).or_insert(0);
            *e = (*e).max(offset + 1);
        }
    }
    assert_eq!(ends.len(), 2, "keys spread over both partitions: {ends:?}");
    let cfg = || {
        fast()
            .with_max_batch(3)
            .with_commit(5, Duration::from_millis(200))
    };
    let first = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    let (stop_first, first_task) = spawn_engine(first);
    eventually("the first engine applied something", || async {
        ctx.effects_once().await >= 5
    })
    .await;
    // The second member joins while the first has batches in flight.
    let second = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    let (stop_second, second_task) = spawn_engine(second);
    eventually("more applied after the join", || async {
        ctx.effects_once().await >= 20
    })
    .await;
    // The first leaves: its partitions move to the second, again with batches in flight.
    stop_first.send(()).unwrap();
    let (first, r1) = first_task.await.unwrap();
    tokio::task::spawn_blocking(move || drop(first))
        .await
        .unwrap();
    eventually("every event applied", || async {
        ctx.effects_once().await == 40
    })
    .await;
    eventually("the group's offsets at the ends", || async {
        let mut done = true;
        for (p, end) in &ends {
            let c = group_committed(&brokers, &group, &topic, *p).await;
            done &= c == Some(*end);
        }
        done
    })
    .await;
    stop_second.send(()).unwrap();
    let (second, r2) = second_task.await.unwrap();
    tokio::task::spawn_blocking(move || drop(second))
        .await
        .unwrap();
    for a in &aggs {
        assert_eq!(
            ctx.applied(a).await,
            vec![1, 2, 3, 4, 5],
            "{a}: {r1:?} {r2:?}"
        );
    }
    assert_eq!(ctx.effects_once().await, 40);
    assert!(open_parked(&inbox).await.is_empty(), "{r1:?} {r2:?}");
    assert_eq!(r1.parked + r2.parked + r1.waiting + r2.waiting, 0);
    assert!(
        r1.applied > 0 && r2.applied > 0,
        "both members worked: {r1:?} {r2:?}"
    );
    ctx.drop().await;
}

/// A member's batch is in flight (its transaction registered the event and waits in the
/// handler) when the group gives the partition to a new member, which receives the same
/// message and tries to register it: it must wait for the first transaction and then see a
/// duplicate. The old member's later commit is refused (it was fenced); the new member commits
/// past everything. One effect per event.
#[tokio::test]
async fn a_partition_moves_while_its_batch_is_in_flight() {
    let ctx = ctx!("a_partition_moves_while_its_batch_is_in_flight");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("g", 1), &ev("b", 1)]).await;
    let gate = h.gate("g");
    let old = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_max_batch(1),
    );
    let (stop_old, old_task) = spawn_engine(old);
    h.wait_entered(1).await;
    // The group rebalances: a new member owns the partition now, and gets g again.
    h.gates.lock().unwrap().clear();
    let new = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_max_batch(1),
    );
    let (stop_new, new_task) = spawn_engine(new);
    // The new member's registration of g waits behind the old member's transaction.
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    eventually("the new member committed past everything", || async {
        log.committed(GROUP, "t", 0) == Some(2)
    })
    .await;
    stop_old.send(()).unwrap();
    stop_new.send(()).unwrap();
    let (_, r_old) = old_task.await.unwrap();
    let (_, r_new) = new_task.await.unwrap();
    assert_eq!(ctx.applied("g").await, vec![1], "{r_old:?} {r_new:?}");
    assert_eq!(ctx.applied("b").await, vec![1], "{r_old:?} {r_new:?}");
    assert_eq!(ctx.effects_once().await, 2);
    assert!(r_new.duplicates >= 1, "{r_new:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(2));
    ctx.drop().await;
}

// FOUND: an undecodable record is parked by its position (it has no dedup id). When the log
// was rewound and the same offset held a *different* undecodable record (a topic recreated
// under the consumer), the new record was taken for a redelivery of the parked one ("already
// parked"): neither applied nor parked, its offset committed, lost without a trace. Now a
// different record at a parked position is parked under an id derived from its position and
// content (and its own redeliveries are recognised).
#[tokio::test]
async fn a_new_undecodable_record_at_a_rewound_offset_is_parked_too() {
    let ctx = ctx!("a_new_undecodable_record_at_a_rewound_offset_is_parked_too");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    log.append_raw("t", 0, None, vec![], b"old garbage".to_vec())
        .unwrap();
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 1, "{r:?}");
    log.recreate_topic("t", 1);
    log.append_raw("t", 0, None, vec![], b"new garbage".to_vec())
        .unwrap();
    let r = quiet(&mut eng).await;
    assert_eq!(r.rewinds, 1, "{r:?}");
    let values: Vec<Option<Vec<u8>>> = inbox
        .list_parked(GROUP, &ParkedFilter::open().all())
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.record.value)
        .collect();
    assert!(
        values.contains(&Some(b"new garbage".to_vec())),
        "the new record is neither applied nor parked: {values:?} {r:?}"
    );
    // Both redelivered once more (a restart from the beginning): nothing parked twice.
    let mut again = engine(
        log.consumer("again", &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast(),
    );
    let r2 = quiet(&mut again).await;
    assert_eq!((r2.parked, r2.already_parked), (0, 1), "{r2:?}");
    assert_eq!(values.len(), 2);
    ctx.drop().await;
}

// FOUND: a message the engine decided to park (hold expired, attempts exhausted) was parked
// as its aggregate's head even when its version had meanwhile been applied by another
// instance of the consumer (a second engine during a rebalance, a webhook through
// `InboxProcessor::process`): the aggregate was blocked by an event already applied, and its
// later messages waited for an operator. A version at or below the applied one is now stale
// whatever was decided before.
#[tokio::test]
async fn a_message_due_for_parking_whose_version_was_applied_meanwhile_is_stale() {
    let ctx = ctx!("a_message_due_for_parking_whose_version_was_applied_meanwhile_is_stale");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let log = MemoryLog::new("t", 1);
    let policy = VersionPolicy::hold(10, Duration::from_millis(200));
    let v3 = ev("a", 3);
    log.publish(&[&ev("a", 1), &v3]).await;
    let mut eng = engine(log.consumer(GROUP, &["t"]), &inbox, &h, policy, fast());
    let deadline = Instant::now() + Duration::from_secs(5);
    while eng.report().held == 0 {
        assert!(Instant::now() < deadline);
        eng.step().await.unwrap();
    }
    // Another instance of the consumer applies v2 and the same v3.
    let other = processor(&inbox, &h, policy);
    for e in [ev("a", 2), v3] {
        let o = other.process(&e).await.unwrap();
        assert_eq!(o, outbox_inbox::MessageOutcome::Applied);
    }
    // The hold expires while v3 is still held in the engine.
    tokio::time::sleep(Duration::from_millis(250)).await;
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 0, "{r:?}");
    assert!(open_parked(&inbox).await.is_empty(), "{r:?}");
    log.publish(&[&ev("a", 4)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(ctx.applied("a").await, vec![1, 2, 3, 4], "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(3));
    ctx.effects_once().await;
    ctx.drop().await;
}
