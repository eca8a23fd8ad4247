//! Adversarial tests of issue 20's third pass on the operator side, against a real PostgreSQL
//! inbox: a discard counts its version only when that skips nothing, `discard_skipping_to` is
//! the explicit skip (item 10), and under `VersionPolicy::Unchecked` a later message is never
//! applied while an earlier one of its aggregate is parked (item 11).
//!
//! Interleavings are forced with a test transaction holding the aggregate's row lock: the
//! actions queue behind it in the order they were started (`wait_blocked` counts them) and run
//! in that order when it ends. Invariants attacked: an event nobody discarded or skipped is
//! never lost, none is applied twice, a skip swallows only what the operator declared, an
//! action's failure writes nothing, and an aggregate's effects apply in version order.

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{async_trait, Envelope, InboxParking, ParkedId, ParkedStatus, Publisher};
use outbox_inbox::{Handler, HandlerError, OperatorError, VersionPolicy};
use outbox_testkit::MemoryLog;

type MemEngine = Engine<outbox_testkit::MemoryConsumer>;

/// A log and an engine (policy `policy`) that applied `agg` v1 and parked `agg` v`gap` as a
/// version gap. Returns the log, the engine and the parked message.
async fn gap_parked(
    inbox: &outbox_postgres::PostgresInboxStore,
    h: &Effects,
    agg: &str,
    gap: i64,
    policy: VersionPolicy,
) -> (MemoryLog, MemEngine, ParkedId) {
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev(agg, 1), &ev(agg, gap)]).await;
    let mut eng = engine(log.consumer(GROUP, &["t"]), inbox, h, policy, fast());
    let r = quiet(&mut eng).await;
    assert_eq!(r.parked, 1, "{r:?}");
    let id = open_parked(inbox)
        .await
        .into_iter()
        .find(|m| m.record.aggregate_version == Some(gap))
        .expect("the gap is parked")
        .id;
    (log, eng, id)
}

/// Publishes `events` and runs the engine until quiet.
async fn feed(
    log: &MemoryLog,
    eng: &mut MemEngine,
    events: &[Envelope],
) -> outbox_inbox::EngineReport {
    log.publish(&events.iter().collect::<Vec<_>>()).await;
    quiet(eng).await
}

// ---------------------------------------------------------------------------------------------
// Operators racing each other
// ---------------------------------------------------------------------------------------------

/// Attack 1: two operators act on one bogus far-future version (v50 after v1): one discards it
/// plainly, the other discards it with `--skip-to 60`. Both queue behind the aggregate's lock;
/// whichever runs first decides, the second is refused as not open (nothing written twice, no
/// second audit entry). A plain discard first counts nothing (the real v2 then applies); a skip
/// first swallows exactly the declared versions.
#[tokio::test]
async fn a_plain_discard_and_a_skip_to_race_on_one_message() {
    let ctx = ctx!("a_plain_discard_and_a_skip_to_race_on_one_message");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    for skip_first in [true, false] {
        let agg = format!("a-{skip_first}");
        let (log, mut eng, bogus) = gap_parked(&inbox, &h, &agg, 50, VersionPolicy::Reject).await;
        let lock = lock_aggregate(&ctx, &agg).await;
        let ops = eng.parked();
        let (o1, o2) = (ops.clone(), ops.clone());
        let skip = move || async move { o1.discard_skipping_to(bogus, "alice", "lost", 60).await };
        let plain = move || async move { o2.discard(bogus, "bob", "bogus").await };
        let (first, second) = if skip_first {
            let a = tokio::spawn(skip());
            wait_blocked(&ctx, 1).await;
            let b = tokio::spawn(plain());
            wait_blocked(&ctx, 2).await;
            (a, b)
        } else {
            let a = tokio::spawn(plain());
            wait_blocked(&ctx, 1).await;
            let b = tokio::spawn(skip());
            wait_blocked(&ctx, 2).await;
            (b, a)
        };
        lock.commit().await.unwrap();
        let (s, p) = (first.await.unwrap(), second.await.unwrap());
        let (winner, loser) = if skip_first { (&s, &p) } else { (&p, &s) };
        let won = winner.as_ref().expect("the first action succeeds");
        assert_eq!(won.discarded, 1, "{won:?}");
        assert!(
            matches!(
                loser,
                Err(OperatorError::NotOpen {
                    status: ParkedStatus::Discarded,
                    ..
                })
            ),
            "{loser:?}"
        );
        assert_eq!(
            inbox.audit_trail(GROUP, Some(bogus)).await.unwrap().len(),
            1
        );
        if skip_first {
            // 2..=49 and 51..=60 were never seen: 58 versions swallowed, as declared.
            assert_eq!(s.as_ref().unwrap().skipped_versions, 58, "{s:?}");
            assert_eq!(agg_state(&ctx, &agg).await, (Some(60), false));
            let r = feed(&log, &mut eng, &[ev(&agg, 2), ev(&agg, 61)]).await;
            assert_eq!(ctx.applied(&agg).await, vec![1, 61], "{r:?}");
        } else {
            assert_eq!(agg_state(&ctx, &agg).await, (Some(1), false));
            let r = feed(&log, &mut eng, &[ev(&agg, 2), ev(&agg, 3)]).await;
            assert_eq!(ctx.applied(&agg).await, vec![1, 2, 3], "{r:?}");
        }
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 2: a retry and a discard of one parked head, queued behind the aggregate's lock, the
/// retry first: the retry applies it, and the discard must be refused with the message's real
/// status (applied), not a made-up one.
//
// FOUND here, fixed: the discard answered `NotOpen { status: Discarded }` for a message that a
// concurrent retry had applied (the status was hard-coded), so `outbox parked discard` told
// the operator it was discarded already.
#[tokio::test]
async fn a_discard_refused_after_a_concurrent_retry_reports_the_real_status() {
    let ctx = ctx!("a_discard_refused_after_a_concurrent_retry_reports_the_real_status");
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
    quiet(&mut eng).await;
    let head = open_parked(&inbox).await[0].id;
    ctx.fix("poison-a").await;
    let lock = lock_aggregate(&ctx, "poison-a").await;
    let ops = eng.parked();
    let (o1, o2) = (ops.clone(), ops.clone());
    let retry = tokio::spawn(async move { o1.retry(head, "alice", "fixed").await });
    wait_blocked(&ctx, 1).await;
    let discard = tokio::spawn(async move { o2.discard(head, "bob", "void").await });
    wait_blocked(&ctx, 2).await;
    lock.commit().await.unwrap();
    let r = retry.await.unwrap().unwrap();
    assert_eq!((r.applied, r.released), (1, true), "{r:?}");
    let d = discard.await.unwrap();
    assert!(
        matches!(
            d,
            Err(OperatorError::NotOpen {
                status: ParkedStatus::Applied,
                ..
            })
        ),
        "{d:?}"
    );
    assert_eq!(status(&inbox, head).await, ParkedStatus::Applied);
    assert_eq!(ctx.applied("poison-a").await, vec![1]);
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// A skip racing the engine
// ---------------------------------------------------------------------------------------------

/// Attack 3: `--skip-to 7` of a parked gap head (v5 after v1) races the engine parking the real
/// v2 behind it. The engine first: v2 waits, and the skip is refused (it would make v2 stale);
/// a plain discard then releases v2. The skip first: it declared v2..v7 never to come, so the
/// real v2, arriving after it, is stale (registered, never applied) and nothing waits.
#[tokio::test]
async fn a_skip_to_racing_the_engine_parking_the_next_version() {
    let ctx = ctx!("a_skip_to_racing_the_engine_parking_the_next_version");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    for engine_first in [true, false] {
        let agg = format!("s-{engine_first}");
        let (log, eng, gap) = gap_parked(&inbox, &h, &agg, 5, VersionPolicy::Reject).await;
        let ops = eng.parked();
        let lock = lock_aggregate(&ctx, &agg).await;
        let (stop, task, skip);
        if engine_first {
            log.publish(&[&ev(&agg, 2)]).await;
            (stop, task) = spawn_engine(eng);
            wait_blocked(&ctx, 1).await;
            let o = ops.clone();
            skip =
                tokio::spawn(async move { o.discard_skipping_to(gap, "alice", "gone", 7).await });
            wait_blocked(&ctx, 2).await;
        } else {
            let o = ops.clone();
            skip =
                tokio::spawn(async move { o.discard_skipping_to(gap, "alice", "gone", 7).await });
            wait_blocked(&ctx, 1).await;
            log.publish(&[&ev(&agg, 2)]).await;
            (stop, task) = spawn_engine(eng);
            wait_blocked(&ctx, 2).await;
        }
        lock.commit().await.unwrap();
        let s = skip.await.unwrap();
        eventually("v2 final", || async {
            log.committed(GROUP, "t", 0) == Some(3)
        })
        .await;
        stop.send(()).unwrap();
        let (mut eng, r) = task.await.unwrap();
        if engine_first {
            assert!(matches!(s, Err(OperatorError::Invalid(_))), "{s:?}");
            assert_eq!(status(&inbox, gap).await, ParkedStatus::Parked);
            assert_eq!(r.waiting, 1, "{r:?}");
            let d = ops.discard(gap, "alice", "bogus").await.unwrap();
            assert_eq!((d.applied, d.released), (1, true), "{d:?}");
            assert_eq!(ctx.applied(&agg).await, vec![1, 2]);
            let r = feed(&log, &mut eng, &[ev(&agg, 3)]).await;
            assert_eq!(ctx.applied(&agg).await, vec![1, 2, 3], "{r:?}");
        } else {
            let s = s.expect("the skip ran first");
            assert_eq!(s.skipped_versions, 5, "2, 3, 4, 6, 7: {s:?}");
            assert_eq!((r.stale, r.waiting), (1, 0), "{r:?}");
            assert_eq!(agg_state(&ctx, &agg).await, (Some(7), false));
            let r = feed(&log, &mut eng, &[ev(&agg, 8)]).await;
            assert_eq!(ctx.applied(&agg).await, vec![1, 8], "{r:?}");
        }
        assert!(open_parked(&inbox).await.iter().all(|m| m
            .record
            .aggregate
            .as_ref()
            .map(|a| a.aggregate_id.as_str())
            != Some(&agg)));
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 4: the skip's connection is killed while it waits on the aggregate's lock: nothing of
/// it is written (applied version, parked status, audit); the same skip then succeeds.
#[tokio::test]
async fn a_skip_to_killed_mid_transaction_writes_nothing() {
    let ctx = ctx!("a_skip_to_killed_mid_transaction_writes_nothing");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, gap) = gap_parked(&inbox, &h, "k", 5, VersionPolicy::Reject).await;
    let ops = eng.parked();
    let lock = lock_aggregate(&ctx, "k").await;
    let o = ops.clone();
    let skip = tokio::spawn(async move { o.discard_skipping_to(gap, "alice", "gone", 9).await });
    let pids = wait_blocked(&ctx, 1).await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pids[0])
        .fetch_one(&ctx.pool)
        .await
        .unwrap();
    assert!(killed);
    let s = skip.await.unwrap();
    assert!(matches!(s, Err(OperatorError::Store(_))), "{s:?}");
    lock.commit().await.unwrap();
    assert_eq!(agg_state(&ctx, "k").await, (Some(1), true));
    assert_eq!(status(&inbox, gap).await, ParkedStatus::Parked);
    assert!(inbox.audit_trail(GROUP, None).await.unwrap().is_empty());
    let s = ops
        .discard_skipping_to(gap, "alice", "gone", 9)
        .await
        .unwrap();
    assert_eq!(s.skipped_versions, 7, "{s:?}");
    let r = feed(&log, &mut eng, &[ev("k", 4), ev("k", 10)]).await;
    assert_eq!(ctx.applied("k").await, vec![1, 10], "{r:?}");
    ctx.drop().await;
}

/// Attack 5: the bounds of `--skip-to`: below the message's version, or at or above another
/// open message of the aggregate, it is refused and writes nothing; at the message's own
/// version it swallows exactly the unseen versions below it.
#[tokio::test]
async fn skip_to_below_at_and_over_other_open_messages() {
    let ctx = ctx!("skip_to_below_at_and_over_other_open_messages");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let (log, mut eng, gap) = gap_parked(&inbox, &h, "b", 5, VersionPolicy::Reject).await;
    // v8 waits behind the parked v5.
    feed(&log, &mut eng, &[ev("b", 8)]).await;
    let ops = eng.parked();
    for (to, why) in [
        (4, "below its version"),
        (8, "at the waiting v8"),
        (9, "over v8"),
    ] {
        let r = ops.discard_skipping_to(gap, "alice", "x", to).await;
        assert!(matches!(r, Err(OperatorError::Invalid(_))), "{why}: {r:?}");
    }
    assert!(ops.audit_trail(Some(gap)).await.unwrap().is_empty());
    assert_eq!(agg_state(&ctx, "b").await, (Some(1), true));
    // At its own version: 2, 3 and 4 swallowed; the release then finds v8 a gap (6, 7 unseen).
    let d = ops
        .discard_skipping_to(gap, "alice", "2..4 lost", 5)
        .await
        .unwrap();
    assert_eq!(d.skipped_versions, 3, "{d:?}");
    assert!(d.still_parked.is_some(), "v8 is a gap: {d:?}");
    assert_eq!(agg_state(&ctx, "b").await, (Some(5), true));
    let r = feed(&log, &mut eng, &[ev("b", 6), ev("b", 7)]).await;
    assert_eq!(r.waiting, 3, "v6, v7 wait behind v8: {r:?}");
    let head = open_parked(&inbox).await;
    let v8 = head
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap()
        .id;
    let d = ops.retry(v8, "alice", "6 and 7 came").await.unwrap();
    assert_eq!((d.applied, d.released), (3, true), "{d:?}");
    assert_eq!(ctx.applied("b").await, vec![1, 6, 7, 8]);
    ctx.effects_once().await;
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// A discarded version comes again
// ---------------------------------------------------------------------------------------------

/// Attack 6: a bogus far-future version (v1000) is discarded, the real v2 and v3 waiting
/// behind it are released; then the bogus record is delivered again (a relay re-publishes it)
/// in one batch with the real v4. The bogus one must resolve as parked already (it is
/// discarded: it blocks nothing) and v4 must apply: no loop, no gap, nothing twice, under
/// `Reject` and `Hold`.
#[tokio::test]
async fn a_discarded_bogus_version_delivered_again_beside_the_next_version() {
    let ctx = ctx!("a_discarded_bogus_version_delivered_again_beside_the_next_version");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    for (i, policy) in [
        VersionPolicy::Reject,
        VersionPolicy::hold(10, Duration::from_millis(20)),
    ]
    .into_iter()
    .enumerate()
    {
        let agg = format!("x{i}");
        let bogus = ev(&agg, 1000);
        let log = MemoryLog::new("t", 1);
        let mut eng = engine(log.consumer(GROUP, &["t"]), &inbox, &h, policy, fast());
        let r = feed(
            &log,
            &mut eng,
            &[ev(&agg, 1), bogus.clone(), ev(&agg, 2), ev(&agg, 3)],
        )
        .await;
        assert_eq!(r.parked, 1, "{policy:?}: {r:?}");
        let id = open_parked(&inbox)
            .await
            .into_iter()
            .find(|m| m.record.aggregate_version == Some(1000))
            .unwrap()
            .id;
        let ops = eng.parked();
        ops.discard(id, "alice", "bogus").await.unwrap();
        assert_eq!(ctx.applied(&agg).await, vec![1, 2, 3], "{policy:?}");
        let before = eng.report().clone();
        let r = feed(&log, &mut eng, &[bogus.clone(), ev(&agg, 4)]).await;
        assert_eq!(
            ctx.applied(&agg).await,
            vec![1, 2, 3, 4],
            "{policy:?}: {r:?}"
        );
        assert_eq!(
            (
                r.already_parked - before.already_parked,
                r.parked - before.parked,
                r.waiting - before.waiting
            ),
            (1, 0, 0),
            "{policy:?}: {r:?}"
        );
        assert_eq!(log.committed(GROUP, "t", 0), Some(6), "{policy:?}");
        assert_eq!(agg_state(&ctx, &agg).await, (Some(4), false), "{policy:?}");
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Attack 7: the operator discards a version-gap head (v3 after v1) without a skip (v2 may
/// still come); then v2 comes and is applied. The discarded v3 now skips nothing (every version
/// below it was applied), so it counts as applied, as documented: v4 must apply, not be parked
/// as a new gap (under `Hold`: held, then parked). The same when v3's record is delivered
/// again after v2, and when v2 and v4 arrive in one batch or apart.
//
// FOUND here, fixed: nothing counted the discarded v3 once v2 was applied (only an operator
// action did), so v4 was parked as a version gap ("expected version 3") although v3 had been
// discarded and every version below it applied; a redelivered v3 was a duplicate that did
// not count either. The engine now reads the aggregate's discarded versions when it finds a
// gap, and counts those that follow the applied version.
#[tokio::test]
async fn a_discarded_gap_head_counts_once_the_missing_version_is_applied() {
    let ctx = ctx!("a_discarded_gap_head_counts_once_the_missing_version_is_applied");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let cases = [
        (VersionPolicy::Reject, false, 100),
        (VersionPolicy::Reject, true, 100),
        (VersionPolicy::Reject, false, 1),
        (
            VersionPolicy::hold(10, Duration::from_millis(20)),
            false,
            100,
        ),
        (VersionPolicy::hold(10, Duration::from_millis(20)), true, 1),
    ];
    for (i, (policy, again, max_batch)) in cases.into_iter().enumerate() {
        let agg = format!("g{i}");
        let v3 = ev(&agg, 3);
        let log = MemoryLog::new("t", 1);
        let mut eng = engine(
            log.consumer(GROUP, &["t"]),
            &inbox,
            &h,
            policy,
            fast().with_max_batch(max_batch),
        );
        feed(&log, &mut eng, &[ev(&agg, 1), v3.clone()]).await;
        let id = open_parked(&inbox)
            .await
            .into_iter()
            .find(|m| m.record.aggregate_version == Some(3))
            .unwrap()
            .id;
        eng.parked().discard(id, "alice", "bad v3").await.unwrap();
        assert_eq!(
            agg_state(&ctx, &agg).await,
            (Some(1), false),
            "v2 unseen yet"
        );
        let mut next = vec![ev(&agg, 2)];
        if again {
            next.push(v3.clone());
        }
        next.push(ev(&agg, 4));
        let r = feed(&log, &mut eng, &next).await;
        let what = format!("{policy:?} again={again} max_batch={max_batch}");
        assert_eq!(ctx.applied(&agg).await, vec![1, 2, 4], "{what}: {r:?}");
        assert!(open_parked(&inbox).await.is_empty(), "{what}: {r:?}");
        assert_eq!(agg_state(&ctx, &agg).await, (Some(4), false), "{what}");
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

// ---------------------------------------------------------------------------------------------
// Unchecked
// ---------------------------------------------------------------------------------------------

/// Effects, failing permanently for the listed (aggregate, version) pairs.
#[derive(Clone)]
struct FailVersions {
    inner: Effects,
    failing: Arc<Mutex<HashSet<(String, i64)>>>,
}

#[async_trait]
impl Handler<PgTx> for FailVersions {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        if self
            .failing
            .lock()
            .unwrap()
            .contains(&(e.aggregate_id.clone(), e.aggregate_version))
        {
            return Err(HandlerError::permanent("bad version"));
        }
        self.inner.handle(tx, e).await
    }
}

/// Attack 8: under `Unchecked`, x v2 fails permanently in the middle of a batch (x v1 before
/// it, x v3 and y after it), in one batch and one message per batch: v1 and y apply, v2 is
/// parked, v3 waits, also when it is delivered again; the release applies v2 then v3.
#[tokio::test]
async fn unchecked_a_mid_batch_failure_parks_and_holds_the_rest_of_its_aggregate() {
    let ctx = ctx!("unchecked_a_mid_batch_failure_parks_and_holds_the_rest_of_its_aggregate");
    let inbox = ctx.inbox().await;
    let h = FailVersions {
        inner: Effects::new(&ctx),
        failing: Arc::default(),
    };
    for max_batch in [100, 1] {
        let (x, y) = (format!("x{max_batch}"), format!("y{max_batch}"));
        h.failing.lock().unwrap().insert((x.clone(), 2));
        let group = format!("g{max_batch}");
        let log = MemoryLog::new("t", 1);
        let x3 = ev(&x, 3);
        log.publish(&[&ev(&x, 1), &ev(&x, 2), &x3, &ev(&y, 1), &x3])
            .await;
        let processor = outbox_inbox::InboxProcessor::new(group.clone(), inbox.clone(), h.clone())
            .with_version_policy(VersionPolicy::Unchecked);
        let mut eng = outbox_inbox::ConsumerEngine::new(
            log.consumer(&group, &["t"]),
            processor,
            fast().with_max_batch(max_batch),
            7,
        )
        .unwrap();
        let r = eng
            .run_until_quiet(Duration::from_millis(60))
            .await
            .unwrap();
        assert_eq!(
            ctx.applied(&x).await,
            vec![1],
            "max_batch {max_batch}: {r:?}"
        );
        assert_eq!(
            ctx.applied(&y).await,
            vec![1],
            "max_batch {max_batch}: {r:?}"
        );
        assert_eq!(
            (r.parked, r.waiting + r.already_parked),
            (1, 2),
            "max_batch {max_batch}: {r:?}"
        );
        h.failing.lock().unwrap().clear();
        let ops = eng.parked();
        let head = ops
            .list(&outbox_core::ParkedFilter::open())
            .await
            .unwrap()
            .into_iter()
            .find(|m| m.status == ParkedStatus::Parked)
            .unwrap();
        let d = ops.retry(head.id, "alice", "fixed").await.unwrap();
        assert_eq!((d.applied, d.released), (2, true), "{d:?}");
        assert_eq!(
            ctx.applied(&x).await,
            vec![1, 2, 3],
            "max_batch {max_batch}"
        );
    }
    ctx.effects_once().await;
    ctx.drop().await;
}

type FvEngine = outbox_inbox::ConsumerEngine<
    outbox_testkit::MemoryConsumer,
    outbox_postgres::PostgresInboxStore,
    FailVersions,
>;

/// Runs `eng` in a task until the returned sender fires (as `spawn_engine`, for this handler).
fn spawn_fv(
    mut eng: FvEngine,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<(FvEngine, outbox_inbox::EngineReport)>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let r = eng
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        (eng, r)
    });
    (tx, task)
}

/// Attack 9: under `Unchecked`, the operator discards the parked head (v1) of an aggregate with
/// v2 waiting, while the engine parks the new v3 behind it; both queue behind the aggregate's
/// lock, in either order. v2 and v3 must be applied, in that order, each once.
#[tokio::test]
async fn unchecked_discard_of_the_head_racing_the_engine_parking_a_later_message() {
    let ctx = ctx!("unchecked_discard_of_the_head_racing_the_engine_parking_a_later_message");
    let inbox = ctx.inbox().await;
    let h = FailVersions {
        inner: Effects::new(&ctx),
        failing: Arc::default(),
    };
    for engine_first in [true, false] {
        let agg = format!("u-{engine_first}");
        h.failing.lock().unwrap().insert((agg.clone(), 1));
        let log = MemoryLog::new("t", 1);
        log.publish(&[&ev(&agg, 1), &ev(&agg, 2)]).await;
        let processor = outbox_inbox::InboxProcessor::new(GROUP, inbox.clone(), h.clone())
            .with_version_policy(VersionPolicy::Unchecked);
        let mut eng =
            outbox_inbox::ConsumerEngine::new(log.consumer(GROUP, &["t"]), processor, fast(), 7)
                .unwrap();
        let r = eng
            .run_until_quiet(Duration::from_millis(60))
            .await
            .unwrap();
        assert_eq!((r.parked, r.waiting), (1, 1), "{r:?}");
        let ops = eng.parked();
        let head = open_parked(&inbox)
            .await
            .into_iter()
            .find(|m| m.status == ParkedStatus::Parked)
            .unwrap()
            .id;
        let lock = lock_aggregate(&ctx, &agg).await;
        let (stop, task, discard);
        let o = ops.clone();
        if engine_first {
            log.publish(&[&ev(&agg, 3)]).await;
            (stop, task) = spawn_fv(eng);
            wait_blocked(&ctx, 1).await;
            discard = tokio::spawn(async move { o.discard(head, "alice", "void").await });
            wait_blocked(&ctx, 2).await;
        } else {
            discard = tokio::spawn(async move { o.discard(head, "alice", "void").await });
            wait_blocked(&ctx, 1).await;
            log.publish(&[&ev(&agg, 3)]).await;
            (stop, task) = spawn_fv(eng);
            wait_blocked(&ctx, 2).await;
        }
        lock.commit().await.unwrap();
        let d = discard.await.unwrap().unwrap();
        assert_eq!(d.discarded, 1, "{d:?}");
        let c = &ctx;
        let a = agg.clone();
        eventually("v2 and v3 applied", || {
            let a = a.clone();
            async move { c.applied(&a).await.len() >= 2 }
        })
        .await;
        eventually("v3 final", || async {
            log.committed(GROUP, "t", 0) == Some(3)
        })
        .await;
        stop.send(()).unwrap();
        let (_eng, r) = task.await.unwrap();
        assert_eq!(
            ctx.applied(&agg).await,
            vec![2, 3],
            "engine_first={engine_first}: {d:?} {r:?}"
        );
        assert!(open_parked(&inbox).await.is_empty(), "{d:?} {r:?}");
    }
    ctx.effects_once().await;
    ctx.drop().await;
}
