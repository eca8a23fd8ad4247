//! Adversarial tests of `ParkedMessages::discard` against a real PostgreSQL inbox, aimed at
//! the hold-back of the skip when another open message of the aggregate has a version at or
//! below the discarded one (two events of one aggregate may share a version).
//!
//! Invariants attacked: an event nobody discarded is never lost, none is applied twice, and
//! parking holds only its aggregate (once everything parked is resolved, the next version
//! applies: no gap, no stale).

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::time::Duration;

use outbox_core::{Envelope, InboxParking, ParkKind, ParkedId, ParkedStatus, Publisher};
use outbox_inbox::{OperatorError, VersionPolicy};
use outbox_testkit::MemoryLog;

/// Publishes `events` to a one-partition log and runs an engine over them until quiet.
async fn parked_log(
    inbox: &outbox_postgres::PostgresInboxStore,
    h: &Effects,
    events: &[Envelope],
) -> (
    MemoryLog,
    Engine<outbox_testkit::MemoryConsumer>,
    outbox_inbox::EngineReport,
) {
    let log = MemoryLog::new("t", 1);
    log.publish(&events.iter().collect::<Vec<_>>()).await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        inbox,
        h,
        VersionPolicy::Reject,
        fast(),
    );
    let r = quiet(&mut eng).await;
    (log, eng, r)
}

/// Publishes version `v` of `agg`, runs the engine until quiet, and checks that `agg`'s
/// applied versions are then `applied` and that no effect ran twice.
async fn next_version_applies(
    ctx: &Ctx,
    log: &MemoryLog,
    eng: &mut Engine<outbox_testkit::MemoryConsumer>,
    agg: &str,
    v: i64,
    applied: &[i64],
) -> outbox_inbox::EngineReport {
    log.publish(&[&ev(agg, v)]).await;
    let r = quiet(eng).await;
    assert_eq!(ctx.applied(agg).await, applied, "{r:?}");
    ctx.effects_once().await;
    r
}

/// Parks `poison-a` v`v` twice (two distinct events, one version): the first is the parked
/// head, the second waits. Returns the engine's log, the engine and (head, copy).
async fn two_copies(
    ctx: &Ctx,
    inbox: &outbox_postgres::PostgresInboxStore,
    h: &Effects,
    v: i64,
) -> (
    MemoryLog,
    Engine<outbox_testkit::MemoryConsumer>,
    ParkedId,
    ParkedId,
) {
    let log = MemoryLog::new("t", 1);
    let mut evs = Vec::new();
    for i in 1..v {
        evs.push(ev("poison-a", i));
    }
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        inbox,
        h,
        VersionPolicy::Reject,
        fast(),
    );
    if !evs.is_empty() {
        ctx.fix("poison-a").await;
        log.publish(&evs.iter().collect::<Vec<_>>()).await;
        quiet(&mut eng).await;
        sqlx::query(&format!("DELETE FROM \"{}\".fixes", ctx.schema))
            .execute(&ctx.pool)
            .await
            .unwrap();
    }
    let (a, b) = (ev("poison-a", v), ev("poison-a", v));
    assert_ne!(a.dedup_id(), b.dedup_id(), "two distinct events");
    log.publish(&[&a, &b, &ev("c", 1)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!((r.parked, r.waiting), (1, 1), "{r:?}");
    let open = open_parked(inbox).await;
    assert_eq!(open.len(), 2);
    let head = open
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let copy = open
        .iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .unwrap()
        .id;
    assert_eq!(ctx.applied("c").await, vec![1], "other aggregates flow");
    (log, eng, head, copy)
}

/// Attack 1: two operators discard both open same-version copies; their transactions are
/// queued behind a test lock and start together. Neither is applied, both are discarded, the
/// aggregate is released and counts the version: the next version applies.
#[tokio::test]
async fn concurrent_discards_of_both_same_version_copies() {
    let ctx = ctx!("concurrent_discards_of_both_same_version_copies");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), true));
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let (o1, o2) = (ops.clone(), ops.clone());
    let d1 = tokio::spawn(async move { o1.discard(head, "alice", "dup head").await });
    let d2 = tokio::spawn(async move { o2.discard(copy, "bob", "dup copy").await });
    wait_blocked(&ctx, 2).await;
    lock.commit().await.unwrap();
    let (r1, r2) = (d1.await.unwrap(), d2.await.unwrap());
    for r in [&r1, &r2] {
        match r {
            Ok(rep) => assert_eq!(rep.discarded, 1, "{rep:?}"),
            Err(e) => panic!("a discard of an open message failed: {e} ({r1:?} {r2:?})"),
        }
    }
    assert_eq!(
        r1.as_ref().unwrap().applied + r2.as_ref().unwrap().applied,
        0
    );
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Discarded);
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(
        agg_state(&ctx, "poison-a").await,
        (Some(2), false),
        "{r1:?} {r2:?}"
    );
    for (id, reason) in [(head, "dup head"), (copy, "dup copy")] {
        let trail = inbox.audit_trail(GROUP, Some(id)).await.unwrap();
        assert_eq!(trail.len(), 1, "{trail:?}");
        assert_eq!(trail[0].reason, reason);
    }
    // v3 follows: no gap, not stale.
    ctx.fix("poison-a").await;
    let r = next_version_applies(&ctx, &log, &mut eng, "poison-a", 3, &[1, 3]).await;
    assert_eq!(r.parked, 1, "no new parking: {r:?}");
    assert_eq!(ctx.effects_once().await, 3);
    ctx.drop().await;
}

/// Attack 1b: the same, the two discards started together without a lock (plain spawn),
/// repeated on fresh aggregates: whatever the order, both are discarded and the version
/// counts.
#[tokio::test]
async fn racing_discards_of_same_version_copies_unforced() {
    let ctx = ctx!("racing_discards_of_same_version_copies_unforced");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 1).await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(2));
    let (o1, o2, b1, b2) = (ops.clone(), ops.clone(), barrier.clone(), barrier.clone());
    let d1 = tokio::spawn(async move {
        b1.wait().await;
        o1.discard(copy, "bob", "dup copy").await
    });
    let d2 = tokio::spawn(async move {
        b2.wait().await;
        o2.discard(head, "alice", "dup head").await
    });
    let (r1, r2) = (d1.await.unwrap(), d2.await.unwrap());
    // The head's discard commits, then its release fails on the (unfixed) copy; when the
    // copy's discard slips in between, the release goes on (it reported a store NotFound
    // before the fix: see `release_failure_after_a_concurrent_discard_of_the_copy`).
    assert!(r1.is_ok() && r2.is_ok(), "{r1:?} {r2:?}");
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Discarded);
    assert!(ctx.applied("poison-a").await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), false));
    ctx.fix("poison-a").await;
    let r = next_version_applies(&ctx, &log, &mut eng, "poison-a", 2, &[2]).await;
    assert_eq!(r.parked, 1, "no new parking: {r:?}");
    ctx.drop().await;
}

/// Attack 2: the discard of the waiting copy races an operator retry of the head whose
/// handler is held on a gate (the retry's transaction holds the aggregate). The head is
/// applied once; the copy is never applied (discarded, or resolved by the retry's release
/// as stale and then the discard is refused cleanly).
#[tokio::test]
async fn discard_of_the_copy_racing_a_retry_of_the_head() {
    let ctx = ctx!("discard_of_the_copy_racing_a_retry_of_the_head");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(copy, "bob", "dup copy").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = retry.await.unwrap().unwrap();
    let d = discard.await.unwrap();
    assert_eq!(r.applied, 1, "the head applies once: {r:?}");
    assert!(r.released, "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2], "{r:?} {d:?}");
    assert_eq!(status(&inbox, head).await, ParkedStatus::Applied);
    match &d {
        Ok(rep) => {
            assert_eq!(rep.discarded, 1);
            assert_eq!(status(&inbox, copy).await, ParkedStatus::Discarded);
        }
        Err(OperatorError::NotOpen { .. }) => {
            assert_eq!(status(&inbox, copy).await, ParkedStatus::Skipped)
        }
        Err(e) => panic!("discard failed: {e}"),
    }
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    let rep = next_version_applies(&ctx, &log, &mut eng, "poison-a", 3, &[1, 2, 3]).await;
    assert_eq!(rep.parked, 1, "{rep:?}");
    ctx.drop().await;
}

/// Attack 2b: the reverse: the discard of the waiting copy holds the aggregate first (a
/// test lock queued in front of both), the retry of the head queues behind it. The head must
/// still apply (it was not discarded), exactly once.
#[tokio::test]
async fn discard_of_the_copy_then_retry_of_the_head_queued_together() {
    let ctx = ctx!("discard_of_the_copy_then_retry_of_the_head_queued_together");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (_log, _eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    ctx.fix("poison-a").await;
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(copy, "bob", "dup copy").await });
    wait_blocked(&ctx, 1).await;
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    wait_blocked(&ctx, 2).await;
    lock.commit().await.unwrap();
    let d = discard.await.unwrap().unwrap();
    let r = retry.await.unwrap().unwrap();
    assert_eq!((d.discarded, d.released), (1, false), "{d:?}");
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(status(&inbox, head).await, ParkedStatus::Applied);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Discarded);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    let trail = inbox.audit_trail(GROUP, Some(copy)).await.unwrap();
    assert_eq!(
        trail[0].outcome,
        "discarded; 1 other message(s) of its aggregate stay open"
    );
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 3: the running engine; the head is discarded while the waiting copy is released
/// (its handler held on a gate), and meanwhile the log redelivers the copy and delivers the
/// next version. The copy applies exactly once, then the next version, in order.
#[tokio::test]
async fn discard_of_the_head_while_the_copy_is_released_and_redelivered() {
    let ctx = ctx!("discard_of_the_head_while_the_copy_is_released_and_redelivered");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let src = Scripted::default();
    let (a, b) = (ev("poison-a", 1), ev("poison-a", 1));
    src.push(0, &a);
    src.push(1, &b);
    src.push(2, &ev("c", 1));
    let eng = engine(src.clone(), &inbox, &h, VersionPolicy::Reject, fast());
    let (stop, task) = spawn_engine(eng);
    eventually("head parked, copy waiting, c applied", || async {
        open_parked(&inbox).await.len() == 2 && ctx.applied("c").await == vec![1]
    })
    .await;
    let open = open_parked(&inbox).await;
    let head = open
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let copy = open
        .iter()
        .find(|m| m.status == ParkedStatus::Waiting)
        .unwrap()
        .id;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let discard = tokio::spawn(async move { o.discard(head, "alice", "dup head").await });
    h.wait_entered(1).await;
    // The release holds the aggregate applying the copy; the copy comes again, and v2.
    src.push(1, &b);
    src.push(3, &ev("poison-a", 2));
    src.push(4, &ev("c", 2));
    // (The engine may wait on the aggregate lock of the release meanwhile: documented.)
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate.add_permits(1_000);
    let d = discard.await.unwrap().unwrap();
    assert_eq!(d.discarded, 1, "{d:?}");
    eventually("the copy then v2 applied", || async {
        ctx.applied("poison-a").await.len() >= 2 && open_parked(&inbox).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    task.await.unwrap();
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2], "{d:?}");
    assert_eq!(ctx.applied("c").await, vec![1, 2]);
    let dedups: Vec<uuid::Uuid> = sqlx::query_scalar(&format!(
        "SELECT dedup_id FROM \"{}\".effects WHERE aggregate_id = 'poison-a' AND version = 1",
        ctx.schema
    ))
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(
        dedups,
        vec![b.dedup_id().as_uuid()],
        "the copy, not the head"
    );
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Applied);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 4: the discard's connection is killed while its transaction waits on the
/// aggregate lock held by a test transaction. Nothing of it is written; a second discard
/// succeeds and releases the copy.
#[tokio::test]
async fn discard_killed_mid_transaction_rolls_back() {
    let ctx = ctx!("discard_killed_mid_transaction_rolls_back");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (_log, _eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    let before = agg_state(&ctx, "poison-a").await;
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let discard = tokio::spawn(async move { o.discard(copy, "bob", "dup copy").await });
    let pids = wait_blocked(&ctx, 1).await;
    assert_eq!(pids.len(), 1);
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pids[0])
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert!(killed);
    let d = discard.await.unwrap();
    assert!(matches!(d, Err(OperatorError::Store(_))), "{d:?}");
    lock.commit().await.unwrap();
    assert_eq!(status(&inbox, head).await, ParkedStatus::Parked);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Waiting);
    assert!(inbox.audit_trail(GROUP, None).await.unwrap().is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, before);
    // Again, this time the head, with the fix: the copy is applied.
    ctx.fix("poison-a").await;
    let d = ops.discard(head, "bob", "dup head").await.unwrap();
    assert_eq!((d.discarded, d.applied, d.released), (1, 1, true), "{d:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Applied);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 4b: killed while the discard of the head is in its release step (the copy's
/// handler held on a gate): the discard committed, the release's step rolls back; a retry of
/// the copy (now the only open message) applies it once.
#[tokio::test]
async fn discard_killed_in_its_release_step() {
    let ctx = ctx!("discard_killed_in_its_release_step");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let discard = tokio::spawn(async move { o.discard(head, "alice", "dup head").await });
    h.wait_entered(1).await;
    // The session in the handler (the one that inserted nothing yet but holds the lock).
    let pid: i32 = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
         AND state = 'idle in transaction' ORDER BY xact_start LIMIT 1",
    )
    .bind(&ctx.schema)
    .fetch_one(&ctx.pool)
    .await
    .unwrap();
    let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    gate.add_permits(1_000);
    let d = discard.await.unwrap();
    // The handler saw the lost connection: a transient failure, the copy now the head.
    match &d {
        Ok(rep) => assert!(
            rep.transient && rep.still_parked.as_ref().is_some_and(|(id, _)| *id == copy),
            "{rep:?}"
        ),
        Err(OperatorError::Store(_)) => {}
        Err(e) => panic!("{e}"),
    }
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert!(ctx.applied("poison-a").await == vec![1], "nothing applied");
    assert_eq!(open_parked(&inbox).await.len(), 1);
    // The aggregate still counts the version as not applied, so the copy is not stale.
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), true));
    let r = ops.retry(copy, "carol", "finish").await.unwrap();
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    next_version_applies(&ctx, &log, &mut eng, "poison-a", 3, &[1, 2, 3]).await;
    ctx.drop().await;
}

/// Attack 5: every open message of the aggregate is discarded, the waiting ones (two copies
/// of v2) first, the head (v1) last. Each waiting discard held its skip back (the head was
/// below); the last discard must then count the highest discarded version: v3 follows
/// without a gap.
//
// FOUND here, fixed: the discard of the last open message (open_rest == 0) only skipped its
// own version and unblocked; it never applied the skips the earlier discards held back
// (`skip_discarded(None)` ran only in `release`). The aggregate stayed at v1, v3 was parked
// as a version gap.
#[tokio::test]
async fn discarding_everything_waiting_first_counts_the_highest_version() {
    let ctx = ctx!("discarding_everything_waiting_first_counts_the_highest_version");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, r) = parked_log(
        &inbox,
        &h,
        &[ev("poison-a", 1), ev("poison-a", 2), ev("poison-a", 2)],
    )
    .await;
    assert_eq!((r.parked, r.waiting), (1, 2), "{r:?}");
    let open = open_parked(&inbox).await;
    let ops = eng.parked();
    for m in open.iter().filter(|m| m.status == ParkedStatus::Waiting) {
        let d = ops.discard(m.id, "bob", "sent by mistake").await.unwrap();
        assert_eq!((d.discarded, d.released), (1, false), "{d:?}");
    }
    let head = open
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let d = ops.discard(head, "bob", "sent by mistake").await.unwrap();
    assert!(d.released, "{d:?}");
    assert!(open_parked(&inbox).await.is_empty());
    let state = agg_state(&ctx, "poison-a").await;
    ctx.fix("poison-a").await;
    log.publish(&[&ev("poison-a", 3)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(
        (r.parked, ctx.applied("poison-a").await),
        (1, vec![3]),
        "v2 was discarded (twice), so v3 is no gap; aggregate after the discards: {state:?}; \
         open now: {:?}",
        open_parked(&inbox)
            .await
            .iter()
            .map(|m| (m.record.aggregate_version, m.status, m.reason.clone()))
            .collect::<Vec<_>>()
    );
    ctx.drop().await;
}

/// Attack 5b: the same with a retry instead of the last discard: the head (v1) is retried
/// after both v2 copies were discarded: v1 applies, and v3 follows (control for 5).
#[tokio::test]
async fn discarding_both_waiting_copies_then_retrying_the_head() {
    let ctx = ctx!("discarding_both_waiting_copies_then_retrying_the_head");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, _) = parked_log(
        &inbox,
        &h,
        &[ev("poison-a", 1), ev("poison-a", 2), ev("poison-a", 2)],
    )
    .await;
    let open = open_parked(&inbox).await;
    let ops = eng.parked();
    for m in open.iter().filter(|m| m.status == ParkedStatus::Waiting) {
        ops.discard(m.id, "bob", "sent by mistake").await.unwrap();
    }
    ctx.fix("poison-a").await;
    let r = ops.retry(open[0].id, "alice", "fixed").await.unwrap();
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    let r = next_version_applies(&ctx, &log, &mut eng, "poison-a", 3, &[1, 3]).await;
    assert_eq!(r.parked, 1, "{r:?}");
    ctx.drop().await;
}

/// Attack 5c: three copies of one version (head parked, two waiting); the head is discarded:
/// the first waiting copy applies, the second one is a stale same-version copy (as the engine
/// treats one arriving after its version applied) and is skipped, never applied twice.
#[tokio::test]
async fn discarding_the_head_of_three_same_version_copies() {
    let ctx = ctx!("discarding_the_head_of_three_same_version_copies");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (_log, eng, _) = parked_log(
        &inbox,
        &h,
        &[ev("poison-a", 1), ev("poison-a", 1), ev("poison-a", 1)],
    )
    .await;
    let open = open_parked(&inbox).await;
    assert_eq!(open.len(), 3);
    ctx.fix("poison-a").await;
    let d = eng
        .parked()
        .discard(open[0].id, "bob", "dup")
        .await
        .unwrap();
    assert_eq!(
        (d.discarded, d.applied, d.skipped, d.released),
        (1, 1, 1, true),
        "{d:?}"
    );
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    assert_eq!(status(&inbox, open[1].id).await, ParkedStatus::Applied);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), false));
    assert_eq!(all_parked(&inbox).await.len(), 3);
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 6: the head is a version gap (v3 after v1) and a copy of v3 waits. Discarding the
/// head must not skip v3 (the copy was not discarded): the copy is released, is a gap itself,
/// and stays parked as the new head (not stale, not lost) until the operator retries it.
#[tokio::test]
async fn discarding_a_gap_head_with_a_same_version_copy_keeps_the_copy() {
    let ctx = ctx!("discarding_a_gap_head_with_a_same_version_copy_keeps_the_copy");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, r) = parked_log(&inbox, &h, &[ev("a", 1), ev("a", 3), ev("a", 3)]).await;
    assert_eq!((r.applied, r.parked, r.waiting), (1, 1, 1), "{r:?}");
    let open = open_parked(&inbox).await;
    let (head, copy) = (open[0].id, open[1].id);
    assert_eq!(open[0].status, ParkedStatus::Parked);
    let ops = eng.parked();
    let d = ops.discard(head, "bob", "dup v3").await.unwrap();
    assert_eq!(d.applied + d.skipped, 0, "{d:?}");
    assert_eq!(
        d.still_parked.as_ref().map(|(id, _)| *id),
        Some(copy),
        "{d:?}"
    );
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Parked);
    assert_eq!(agg_state(&ctx, "a").await, (Some(1), true));
    let r = ops.retry(copy, "alice", "v2 will not come").await.unwrap();
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    let r = next_version_applies(&ctx, &log, &mut eng, "a", 4, &[1, 3, 4]).await;
    assert_eq!(r.parked, 1, "{r:?}");
    ctx.drop().await;
}

/// Attack 7: the operator process dies (its task is aborted) after the discard of the head
/// committed, while its release holds the waiting copy in the handler. The copy is left
/// waiting with no parked head; it stays listed, and a retry of it applies it once; the
/// next version follows.
#[tokio::test]
async fn operator_dies_between_the_discard_and_its_release() {
    let ctx = ctx!("operator_dies_between_the_discard_and_its_release");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let discard = tokio::spawn(async move { o.discard(head, "alice", "dup head").await });
    h.wait_entered(1).await;
    discard.abort();
    assert!(discard.await.unwrap_err().is_cancelled());
    h.gates.lock().unwrap().clear();
    gate.add_permits(1_000);
    // The aborted release's transaction is rolled back when its connection is reused/closed.
    eventually("the aborted transaction ended", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
             AND state LIKE 'idle in transaction%'",
        )
        .bind(&ctx.schema)
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        n == 0
    })
    .await;
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Waiting);
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), true));
    // v3 arrives meanwhile: it waits (the aggregate is still blocked), not applied before v2.
    log.publish(&[&ev("poison-a", 3)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(r.waiting, 2, "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    let r = ops
        .retry(copy, "carol", "finish the release")
        .await
        .unwrap();
    assert_eq!((r.applied, r.released), (2, true), "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3]);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(3), false));
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 8: two operators clean up an aggregate concurrently: one discards the waiting v2,
/// the other the parked head v1; the waiting discard's transaction is queued first (behind a
/// test lock). Both succeed, and the next version (v3) must follow without a gap.
//
// FOUND here, fixed (same defect as attack 5, reached by a race): the waiting discard holds
// its skip back (v1 is open below it); the head's discard then found itself alone, skipped
// only v1 and unblocked. The aggregate stayed at v1: v3 was parked as a gap although v1 and
// v2 were both discarded.
#[tokio::test]
async fn concurrent_discards_of_head_and_waiting_count_both_versions() {
    let ctx = ctx!("concurrent_discards_of_head_and_waiting_count_both_versions");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, _) = parked_log(&inbox, &h, &[ev("poison-a", 1), ev("poison-a", 2)]).await;
    let open = open_parked(&inbox).await;
    let (head, v2) = (open[0].id, open[1].id);
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let (o1, o2) = (ops.clone(), ops.clone());
    let d2 = tokio::spawn(async move { o2.discard(v2, "bob", "void v2").await });
    wait_blocked(&ctx, 1).await;
    let d1 = tokio::spawn(async move { o1.discard(head, "alice", "void v1").await });
    wait_blocked(&ctx, 2).await;
    lock.commit().await.unwrap();
    let (r2, r1) = (d2.await.unwrap().unwrap(), d1.await.unwrap().unwrap());
    assert_eq!((r1.discarded, r2.discarded), (1, 1));
    assert!(open_parked(&inbox).await.is_empty());
    assert!(ctx.applied("poison-a").await.is_empty());
    let state = agg_state(&ctx, "poison-a").await;
    ctx.fix("poison-a").await;
    log.publish(&[&ev("poison-a", 3)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(
        (r.parked, ctx.applied("poison-a").await),
        (1, vec![3]),
        "v1 and v2 discarded: v3 is no gap (aggregate after the discards: {state:?}; {r1:?} {r2:?})"
    );
    ctx.drop().await;
}

/// Attack 9: the head's discard commits and its release takes the waiting copy, whose handler
/// (held on a gate, before it fails: the aggregate is not fixed) fails again; meanwhile a
/// second operator's discard of the copy queues on the aggregate. The release rolls back and
/// records the failure in a new transaction, but the copy's discard got the aggregate in
/// between. Expected: the head's discard reports success (its discard committed; the copy is
/// resolved by someone else), like a release that finds nothing open.
//
// FOUND here, fixed: the release's "failed again" transaction called `open_parked_of` and
// ignored the result, then `change_parked(Failed)` on the copy, which was no longer open: the
// discard of the head returned `Err(Store(NotFound "no open parked message N"))` although it
// committed (audited, head Discarded). The same path was taken by `retry` (a retry that fails
// again while another operator discards).
#[tokio::test]
async fn release_failure_after_a_concurrent_discard_of_the_copy() {
    let ctx = ctx!("release_failure_after_a_concurrent_discard_of_the_copy");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (log, mut eng, head, copy) = two_copies(&ctx, &inbox, &h, 2).await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let d1 = tokio::spawn(async move { o1.discard(head, "alice", "dup head").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let d2 = tokio::spawn(async move { o2.discard(copy, "bob", "dup copy").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let (r1, r2) = (d1.await.unwrap(), d2.await.unwrap());
    // The state is right.
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, copy).await, ParkedStatus::Discarded);
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    ctx.fix("poison-a").await;
    log.publish(&[&ev("poison-a", 3)]).await;
    quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![1, 3]);
    // The report is not.
    let r2 = r2.expect("the copy's discard");
    assert_eq!((r2.discarded, r2.released), (1, true), "{r2:?}");
    let r1 = r1.expect("the head's discard committed: it must not report a store error");
    assert_eq!(r1.discarded, 1, "{r1:?}");
    ctx.drop().await;
}

/// Attack 10: the discard of a lone parked head (v2) races the running engine receiving a
/// same-version copy and v3 (both queued behind a test lock on the aggregate). Whoever wins,
/// the head is never applied, the copy at most once (applied if it was parked behind the head
/// before the discard; a stale copy of a counted version otherwise), v3 exactly once, last,
/// and nothing stays parked or blocked.
#[tokio::test]
async fn discard_of_a_lone_head_racing_the_engine_parking_a_copy() {
    let ctx = ctx!("discard_of_a_lone_head_racing_the_engine_parking_a_copy");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let src = Scripted::default();
    ctx.fix("poison-a").await;
    src.push(0, &ev("poison-a", 1));
    let eng = engine(src.clone(), &inbox, &h, VersionPolicy::Reject, fast());
    let (stop, task) = spawn_engine(eng);
    eventually("v1 applied", || async {
        ctx.applied("poison-a").await == vec![1]
    })
    .await;
    sqlx::query(&format!("DELETE FROM \"{}\".fixes", ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let a = ev("poison-a", 2);
    src.push(1, &a);
    eventually("v2 parked", || async {
        open_parked(&inbox).await.len() == 1
    })
    .await;
    let head = open_parked(&inbox).await[0].id;
    ctx.fix("poison-a").await;
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let d = tokio::spawn(async move { o.discard(head, "alice", "void v2").await });
    let b = ev("poison-a", 2);
    src.push(2, &b);
    src.push(3, &ev("poison-a", 3));
    wait_blocked(&ctx, 2).await;
    lock.commit().await.unwrap();
    let d = d.await.unwrap().unwrap();
    assert_eq!(d.discarded, 1, "{d:?}");
    eventually("v3 applied", || async {
        ctx.applied("poison-a").await.last() == Some(&3)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.send(()).unwrap();
    task.await.unwrap();
    let applied = ctx.applied("poison-a").await;
    assert!(
        applied == vec![1, 3] || applied == vec![1, 2, 3],
        "{applied:?} {d:?}"
    );
    if applied.len() == 3 {
        let v2: uuid::Uuid = sqlx::query_scalar(&format!(
            "SELECT dedup_id FROM \"{}\".effects WHERE version = 2",
            ctx.schema
        ))
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
        assert_eq!(v2, b.dedup_id().as_uuid(), "the copy, never the head");
    }
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(3), false));
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Parks `poison-a` v1..=n (nothing fixed): v1 is the parked head, the rest wait.
async fn park_versions(
    inbox: &outbox_postgres::PostgresInboxStore,
    h: &Effects,
    n: i64,
) -> (
    MemoryLog,
    Engine<outbox_testkit::MemoryConsumer>,
    Vec<ParkedId>,
) {
    let evs: Vec<_> = (1..=n).map(|v| ev("poison-a", v)).collect();
    let (log, eng, _) = parked_log(inbox, h, &evs).await;
    let open = open_parked(inbox).await;
    assert_eq!(open.len() as i64, n);
    let ids = open.iter().map(|m| m.id).collect();
    (log, eng, ids)
}

const BOUND: Duration = Duration::from_secs(40);

/// Attack 11 (fix 2): a retry of a lone head whose handler fails again (held on a gate before
/// the check) while a second operator's discard of that head queues on the aggregate. The
/// retry must not loop, nothing is applied, the head is Discarded, the aggregate counts v1 and
/// is released; if the retry reports NotOpen, the status it reports is the real one.
#[tokio::test]
async fn retry_failing_again_while_another_operator_discards_the_lone_head() {
    let ctx = ctx!("retry_failing_again_while_another_operator_discards_the_lone_head");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (log, mut eng, ids) = park_versions(&inbox, &h, 1).await;
    let head = ids[0];
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "try again").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(head, "bob", "void v1").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = tokio::time::timeout(BOUND, retry)
        .await
        .expect("the retry hangs")
        .unwrap();
    let d = tokio::time::timeout(BOUND, discard)
        .await
        .expect("the discard hangs")
        .unwrap();
    let d = d.expect("the discard of an open head");
    assert_eq!((d.discarded, d.released), (1, true), "{d:?}");
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert!(open_parked(&inbox).await.is_empty());
    assert!(ctx.applied("poison-a").await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), false), "{r:?}");
    match &r {
        Ok(rep) => assert_eq!(rep.applied, 0, "{rep:?}"),
        // The reported status is checked by
        // `retry_reports_the_real_status_of_a_head_discarded_meanwhile`.
        Err(OperatorError::NotOpen { .. }) => {}
        Err(e) => panic!("retry failed: {e}"),
    }
    ctx.fix("poison-a").await;
    log.publish(&[&ev("poison-a", 2)]).await;
    let rep = quiet(&mut eng).await;
    assert_eq!(
        rep.parked, 1,
        "no new parking (the count is cumulative): {rep:?}"
    );
    assert_eq!(ctx.applied("poison-a").await, vec![2]);
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 12 (fix 2): as attack 11, with v2 waiting behind the head: the discard's release
/// takes v2, which fails again (nothing fixed) and becomes the head. Nothing applied twice,
/// v2 stays parked and blocks; fixed and retried it applies, then v3, no gap.
#[tokio::test]
async fn retry_failing_again_while_another_operator_discards_the_head_with_one_waiting() {
    let ctx = ctx!("retry_failing_again_while_another_operator_discards_the_head_with_one_waiting");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (log, mut eng, ids) = park_versions(&inbox, &h, 2).await;
    let (head, v2) = (ids[0], ids[1]);
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "try again").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(head, "bob", "void v1").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = tokio::time::timeout(BOUND, retry)
        .await
        .expect("the retry hangs")
        .unwrap();
    let d = tokio::time::timeout(BOUND, discard)
        .await
        .expect("the discard hangs")
        .unwrap()
        .expect("the discard of an open head");
    assert_eq!(d.discarded, 1, "{d:?}");
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    assert_eq!(
        status(&inbox, v2).await,
        ParkedStatus::Parked,
        "{d:?} {r:?}"
    );
    assert!(ctx.applied("poison-a").await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(1), true), "{r:?}");
    match &r {
        Ok(rep) => assert_eq!(rep.applied, 0, "{rep:?}"),
        // The reported status is checked by
        // `retry_reports_the_real_status_of_a_head_discarded_meanwhile`.
        Err(OperatorError::NotOpen { .. }) => {}
        Err(e) => panic!("retry failed: {e}"),
    }
    gate.add_permits(1_000);
    ctx.fix("poison-a").await;
    let r2 = tokio::time::timeout(BOUND, ops.retry(v2, "alice", "fixed"))
        .await
        .expect("hang")
        .unwrap();
    assert_eq!((r2.applied, r2.released), (1, true), "{r2:?}");
    log.publish(&[&ev("poison-a", 3)]).await;
    quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![2, 3]);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(3), false));
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 13 (fix 1 and 2 together): v1 head, v2 and v3 waiting, nothing fixed; three
/// operators discard v1, v3 and v2, queued in that order behind a test lock. v1's discard
/// releases v2, which fails again while v2's own discard is queued (the `continue` path).
/// All three end Discarded, none applied, the aggregate counts v3 and is released, v4 applies.
#[tokio::test]
async fn three_queued_discards_with_a_release_failing_in_between() {
    let ctx = ctx!("three_queued_discards_with_a_release_failing_in_between");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, ids) = park_versions(&inbox, &h, 3).await;
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let mut tasks = Vec::new();
    for (n, i) in [0usize, 2, 1].into_iter().enumerate() {
        let o = ops.clone();
        let id = ids[i];
        tasks.push(tokio::spawn(async move {
            o.discard(id, "op", &format!("void v{}", i + 1)).await
        }));
        wait_blocked(&ctx, n + 1).await;
    }
    lock.commit().await.unwrap();
    let mut reps = Vec::new();
    for t in tasks {
        let r = tokio::time::timeout(BOUND, t)
            .await
            .expect("a discard hangs")
            .unwrap();
        reps.push(r.expect("the discard of an open message"));
    }
    for id in &ids {
        assert_eq!(
            status(&inbox, *id).await,
            ParkedStatus::Discarded,
            "{reps:?}"
        );
    }
    assert!(ctx.applied("poison-a").await.is_empty());
    assert_eq!(
        agg_state(&ctx, "poison-a").await,
        (Some(3), false),
        "{reps:?}"
    );
    ctx.fix("poison-a").await;
    log.publish(&[&ev("poison-a", 4)]).await;
    let r = quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![4], "{r:?}");
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 14 (fix 1's second connection): the operator's store runs on a pool of one
/// connection. The discard of the last open message holds that connection in its transaction
/// and `skip_discarded` reads the parked history through the store (not the transaction): it
/// waits for a second connection that never comes.
//
// FOUND here, fixed (`InboxParking::discarded_of` reads in the transaction): it failed with
// `Err(Store(PoolTimedOut))` after the pool's acquire timeout; the discard rolled back (v1
// stayed parked, the aggregate blocked), and every retry of it failed the same way; the same
// starvation hit `N` concurrent operator actions on a pool of `N`.
#[tokio::test]
async fn discard_of_the_last_open_message_on_a_one_connection_pool() {
    let ctx = ctx!("discard_of_the_last_open_message_on_a_one_connection_pool");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (_log, _eng, ids) = park_versions(&inbox, &h, 2).await;
    let small = one_connection_store(&ctx).await;
    let ops = operator(&small, &h, VersionPolicy::Reject);
    // v2 (waiting) first: not the last open message, one connection is enough.
    let d2 = tokio::time::timeout(BOUND, ops.discard(ids[1], "op", "void v2"))
        .await
        .expect("hang")
        .expect("the discard of the waiting v2");
    assert_eq!(d2.discarded, 1);
    // v1, now the last open message.
    let d1 = tokio::time::timeout(BOUND, ops.discard(ids[0], "op", "void v1"))
        .await
        .expect("hang");
    if let Err(e) = &d1 {
        // What a failure leaves: the discard rolled back.
        assert_eq!(status(&inbox, ids[0]).await, ParkedStatus::Parked);
        assert_eq!(agg_state(&ctx, "poison-a").await, (None, true), "{e}");
    }
    let d1 = d1.expect("the discard of the last open message on a one-connection pool");
    assert!(d1.released, "{d1:?}");
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    ctx.drop().await;
}

/// Attack 11b: the report of attack 11. The retry's head was discarded by another operator
/// while the retry's handler failed; the retry reports NotOpen with the head's real status.
//
// FOUND here, fixed (failed ~5 runs in 6; passes when the retry's "failed again"
// transaction wins the aggregate lock before the discard): the retry returned `NotOpen {
// status: Applied }` for a head that is Discarded: the `retried.filter(|_| audit_pending)`
// check in `release` hard-coded `ParkedStatus::Applied`; it now reads the real status.
#[tokio::test]
async fn retry_reports_the_real_status_of_a_head_discarded_meanwhile() {
    let ctx = ctx!("retry_reports_the_real_status_of_a_head_discarded_meanwhile");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (_log, _eng, ids) = park_versions(&inbox, &h, 1).await;
    let head = ids[0];
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "try again").await });
    h.wait_entered(1).await;
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(head, "bob", "void v1").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = tokio::time::timeout(BOUND, retry).await.unwrap().unwrap();
    tokio::time::timeout(BOUND, discard)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(status(&inbox, head).await, ParkedStatus::Discarded);
    match &r {
        Ok(rep) => assert_eq!(rep.applied, 0, "{rep:?}"),
        Err(OperatorError::NotOpen { status: s, .. }) => {
            assert_eq!(*s, ParkedStatus::Discarded, "the retry misreports: {r:?}")
        }
        Err(e) => panic!("retry failed: {e}"),
    }
    ctx.drop().await;
}

async fn one_connection_store(ctx: &Ctx) -> outbox_postgres::PostgresInboxStore {
    let url = outbox_test_support::database_url("one_conn").unwrap();
    let opts: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(3))
        .connect_with(opts.application_name(&ctx.schema))
        .await
        .unwrap();
    outbox_postgres::PostgresInboxStore::builder(pool)
        .schema(&ctx.schema)
        .build()
        .unwrap()
}

/// Attack 14b: scope of attack 14: a retry of a fixed lone head on a one-connection pool
/// (the release's `skip_discarded` reads through the store while its transaction holds the
/// only connection; this path predated the fix). FOUND here, fixed with attack 14.
#[tokio::test]
async fn retry_of_a_lone_head_on_a_one_connection_pool() {
    let ctx = ctx!("retry_of_a_lone_head_on_a_one_connection_pool");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (_log, _eng, ids) = park_versions(&inbox, &h, 1).await;
    ctx.fix("poison-a").await;
    let small = one_connection_store(&ctx).await;
    let ops = operator(&small, &h, VersionPolicy::Reject);
    let r = tokio::time::timeout(BOUND, ops.retry(ids[0], "op", "fixed"))
        .await
        .expect("hang")
        .expect("a retry on a one-connection pool");
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    ctx.drop().await;
}

/// Attack 15 (fix 2, the resolved message the last open one, with the retry's audit already
/// written): a retry of the fixed head v1 applies it, then takes v2, whose handler (held on a
/// gate) fails again (the fix removed meanwhile) while a second operator's discard of v2
/// queues on the aggregate. The release must end (not spin, not NotFound), v1 applied once, v2
/// Discarded, the aggregate at v2 and unblocked; v3 applies.
///
/// The retry records v2's failure in a new transaction (the failed one is rolled back with the
/// handler's effect), so the queued discard and that transaction race for the aggregate's row
/// lock: PostgreSQL does not hand a released row lock to the session that waited for it
/// first (the waiter wakes and locks the row again, and a new transaction that finds the row
/// unlocked can take it before). Both serializations are correct, and each is checked exactly:
/// the discard first (the retry finds v2 resolved and ends released), or the retry first (it
/// reports v2 failed again, the failure is on v2's record, then the discard resolves v2 and
/// releases the aggregate). The test used to expect the first only and failed 2 runs in 8
/// under load.
#[tokio::test]
async fn retry_whose_last_waiting_message_fails_again_while_discarded() {
    let ctx = ctx!("retry_whose_last_waiting_message_fails_again_while_discarded");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (log, mut eng, ids) = park_versions(&inbox, &h, 2).await;
    let (head, v2) = (ids[0], ids[1]);
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o1 = ops.clone();
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    h.wait_entered(1).await;
    gate.add_permits(1);
    h.wait_entered(2).await;
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    sqlx::query(&format!("DELETE FROM \"{}\".fixes", ctx.schema))
        .execute(&ctx.pool)
        .await
        .unwrap();
    let o2 = ops.clone();
    let discard = tokio::spawn(async move { o2.discard(v2, "bob", "void v2").await });
    ctx.wait_until_blocked().await;
    gate.add_permits(1_000);
    let r = tokio::time::timeout(BOUND, retry)
        .await
        .expect("the retry hangs")
        .unwrap()
        .expect("the retry applied v1: it must not fail");
    let d = tokio::time::timeout(BOUND, discard)
        .await
        .expect("the discard hangs")
        .unwrap()
        .expect("the discard of an open v2");
    let v2_record = inbox.parked_message(GROUP, v2).await.unwrap().unwrap();
    match &r.still_parked {
        // The discard took the lock first: the retry found v2 resolved and went on.
        None => {
            eprintln!("serialization: the discard first");
            assert_eq!((r.applied, r.released), (1, true), "{r:?}");
            assert_eq!(
                v2_record.kind, None,
                "discarded while waiting: {v2_record:?}"
            );
            assert_eq!(v2_record.attempts, 0, "{v2_record:?}");
        }
        // The retry took it first: v2 failed again, recorded, then discarded.
        Some((id, why)) => {
            eprintln!("serialization: the retry first");
            assert_eq!(*id, v2, "{r:?}");
            assert!(why.contains("unknown customer"), "{r:?}");
            assert_eq!((r.applied, r.released), (1, false), "{r:?}");
            assert_eq!(
                v2_record.kind,
                Some(ParkKind::Unprocessable),
                "{v2_record:?}"
            );
            assert_eq!(v2_record.attempts, 1, "{v2_record:?}");
        }
    }
    assert_eq!((d.discarded, d.released), (1, true), "{d:?}");
    assert_eq!(status(&inbox, head).await, ParkedStatus::Applied);
    assert_eq!(status(&inbox, v2).await, ParkedStatus::Discarded);
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), false));
    let trail = inbox.audit_trail(GROUP, Some(head)).await.unwrap();
    assert_eq!(trail.len(), 1, "{trail:?}");
    ctx.fix("poison-a").await;
    next_version_applies(&ctx, &log, &mut eng, "poison-a", 3, &[1, 3]).await;
    ctx.drop().await;
}

/// Attack 16 (fix 2, three operators): v1 head, v2 and v3 waiting, nothing fixed. A retry of
/// v1 is held in its handler (it will fail again); a discard of v1 and then a discard of v2
/// queue on the aggregate. Then v1's discard releases the rest, which fails again. Whatever
/// the order: v1 and v2 Discarded, v3 the parked head, the aggregate at v2 and blocked, nothing
/// applied; fixed and retried, v3 applies, then v4.
#[tokio::test]
async fn retry_failing_again_while_the_head_and_the_next_are_discarded() {
    let ctx = ctx!("retry_failing_again_while_the_head_and_the_next_are_discarded");
    let inbox = ctx.inbox().await;
    let h = Effects::gated_first(&ctx);
    let (log, mut eng, ids) = park_versions(&inbox, &h, 3).await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let o = ops.clone();
    let head = ids[0];
    let retry = tokio::spawn(async move { o.retry(head, "alice", "try again").await });
    h.wait_entered(1).await;
    let o = ops.clone();
    let d1 = tokio::spawn(async move { o.discard(head, "bob", "void v1").await });
    wait_blocked(&ctx, 1).await;
    let o = ops.clone();
    let v2 = ids[1];
    let d2 = tokio::spawn(async move { o.discard(v2, "carol", "void v2").await });
    wait_blocked(&ctx, 2).await;
    gate.add_permits(10_000);
    let r = tokio::time::timeout(BOUND, retry)
        .await
        .expect("the retry hangs")
        .unwrap();
    let r1 = tokio::time::timeout(BOUND, d1)
        .await
        .expect("hang")
        .unwrap()
        .expect("the discard of v1");
    let r2 = tokio::time::timeout(BOUND, d2)
        .await
        .expect("hang")
        .unwrap()
        .expect("the discard of v2");
    match &r {
        Ok(rep) => assert_eq!(rep.applied, 0, "{rep:?}"),
        Err(OperatorError::NotOpen { .. }) => {}
        Err(e) => panic!("retry failed: {e}"),
    }
    assert_eq!((r1.discarded, r2.discarded), (1, 1));
    assert_eq!(status(&inbox, ids[0]).await, ParkedStatus::Discarded);
    assert_eq!(status(&inbox, ids[1]).await, ParkedStatus::Discarded);
    assert_eq!(
        status(&inbox, ids[2]).await,
        ParkedStatus::Parked,
        "{r:?} {r1:?} {r2:?}"
    );
    assert!(ctx.applied("poison-a").await.is_empty());
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(2), true));
    ctx.fix("poison-a").await;
    let r3 = tokio::time::timeout(BOUND, ops.retry(ids[2], "alice", "fixed"))
        .await
        .expect("hang")
        .unwrap();
    assert_eq!((r3.applied, r3.released), (1, true), "{r3:?}");
    log.publish(&[&ev("poison-a", 4)]).await;
    quiet(&mut eng).await;
    assert_eq!(ctx.applied("poison-a").await, vec![3, 4]);
    assert_eq!(agg_state(&ctx, "poison-a").await, (Some(4), false));
    ctx.effects_once().await;
    ctx.drop().await;
}
