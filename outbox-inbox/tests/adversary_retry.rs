//! Adversarial tests of operator retry requests (`ParkedMessages::request_retry`, performed by
//! the engine's retry-request check) against a real PostgreSQL inbox: a request performed while
//! the engine handles the aggregate, two engines performing one request, a request made while
//! another is performed, a discard racing a performed request, the engine dropped mid-retry, and
//! a request for a message resolved meanwhile.
//!
//! Setup shared with `adversary.rs` (`adversary_common`); here the handler waits on its gate
//! *before* deciding to fail, so a retry that fails again can be held open.
#![allow(dead_code)]

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use outbox_core::{InboxParking, Publisher};
use outbox_inbox::{EngineConfig, VersionPolicy};
use outbox_postgres::PostgresInboxStore;
use outbox_testkit::MemoryLog;

// ---------------------------------------------------------------------------------------------
// Retry requests
// ---------------------------------------------------------------------------------------------

fn cfg() -> EngineConfig {
    fast().with_retry_requests_interval(Duration::from_millis(20))
}

/// `poison-a` v1 parked, v2 waiting behind it, `b` v1 applied; offsets committed to 3.
async fn setup(
    ctx: &Ctx,
    h: &Effects,
) -> (
    PostgresInboxStore,
    MemoryLog,
    Engine<outbox_testkit::MemoryConsumer>,
    outbox_core::ParkedId,
) {
    let inbox = ctx.inbox().await;
    let log = MemoryLog::new("t", 1);
    log.publish(&[&ev("poison-a", 1), &ev("poison-a", 2), &ev("b", 1)])
        .await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        h,
        VersionPolicy::Reject,
        cfg(),
    );
    let r = quiet(&mut eng).await;
    assert_eq!((r.parked, r.waiting, r.applied), (1, 1, 1), "{r:?}");
    assert_eq!(log.committed(GROUP, "t", 0), Some(3));
    let head = open_parked(&inbox).await[0].id;
    (inbox, log, eng, head)
}

async fn retries_audited(inbox: &PostgresInboxStore, id: outbox_core::ParkedId) -> usize {
    inbox
        .audit_trail(GROUP, Some(id))
        .await
        .unwrap()
        .iter()
        .filter(|a| a.action == outbox_core::InboxAction::Retry)
        .count()
}

/// Waits up to `d` for `h`; `None` when still running.
async fn within<T>(h: &mut tokio::task::JoinHandle<T>, d: Duration) -> Option<T> {
    match tokio::time::timeout(d, h).await {
        Ok(r) => Some(r.unwrap()),
        Err(_) => None,
    }
}

/// The engine's retry task holds the aggregate inside the handler; v3 of the aggregate arrives
/// and the engine must wait behind it (seen through `pg_blocking_pids`), then apply v3 after
/// the released v2; the offset is not committed past v3 before it is final.
#[tokio::test]
async fn a_request_performed_while_the_engine_receives_the_aggregate() {
    let ctx = ctx!("a_request_performed_while_the_engine_receives_the_aggregate");
    let h = Effects::gated_first(&ctx);
    let (inbox, log, eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let (stop, task) = spawn_engine(eng);
    h.wait_entered(1).await;
    log.publish(&[&ev("poison-a", 3)]).await;
    ctx.wait_until_blocked().await;
    assert_eq!(log.committed(GROUP, "t", 0), Some(3), "v3 not final yet");
    gate.add_permits(1_000);
    eventually("v3 applied", || async {
        ctx.applied("poison-a").await.len() == 3
    })
    .await;
    eventually("offsets committed", || async {
        log.committed(GROUP, "t", 0) == Some(4)
    })
    .await;
    stop.send(()).unwrap();
    let (_eng, report) = task.await.unwrap();
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3]);
    assert_eq!(ctx.effects_once().await, 4);
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(report.requested_retries, 1, "{report:?}");
    assert_eq!(retries_audited(&inbox, head).await, 1);
    assert!(ops.requested_retries().await.unwrap().is_empty());
    ctx.drop().await;
}

/// Two instances of the consumer perform the same request at once (their retry tasks are
/// `perform_requested_retries` of two operators over the same consumer).
#[tokio::test]
async fn two_instances_perform_the_same_request() {
    let ctx = ctx!("two_instances_perform_the_same_request");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, _eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let a = operator(&inbox, &h, VersionPolicy::Reject);
    let b = operator(&inbox, &h, VersionPolicy::Reject);
    a.request_retry(head, "alice", "fixed").await.unwrap();
    let mut ta = tokio::spawn(async move { a.perform_requested_retries().await });
    h.wait_entered(1).await;
    let mut tb = tokio::spawn(async move { b.perform_requested_retries().await });
    // The second either waits on the first's locks or is held in the handler as well.
    let early = within(&mut tb, Duration::from_millis(300)).await;
    let early_done = early.is_some();
    if early.is_none() && h.entered.load(Ordering::SeqCst) < 2 {
        ctx.wait_until_blocked().await;
    }
    gate.add_permits(1_000);
    let ra = within(&mut ta, Duration::from_secs(10))
        .await
        .expect("a")
        .unwrap();
    let rb = match early {
        Some(r) => r,
        None => within(&mut tb, Duration::from_secs(10)).await.expect("b"),
    }
    .unwrap();
    eprintln!(
        "two instances: second early={} a={ra:?} b={rb:?}",
        early_done
    );
    let ok = ra
        .iter()
        .chain(rb.iter())
        .filter(|(_, r)| r.is_ok())
        .count();
    assert_eq!(ok, 1, "performed once: a={ra:?} b={rb:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    assert_eq!(retries_audited(&inbox, head).await, 1);
    assert!(open_parked(&inbox).await.is_empty());
    ctx.drop().await;
}

/// A second request is made while the first is being performed, and that retry fails again:
/// the message stays parked and the newer request must survive the clearing of the first.
#[tokio::test]
async fn a_request_made_while_the_previous_one_is_performed_survives() {
    let ctx = ctx!("a_request_made_while_the_previous_one_is_performed_survives");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, _eng, head) = setup(&ctx, &h).await;
    let gate = h.gate("poison-a"); // not fixed: the retry fails again
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    let first = ops.request_retry(head, "alice", "first").await.unwrap();
    let performer = operator(&inbox, &h, VersionPolicy::Reject);
    let mut perf = tokio::spawn(async move { performer.perform_requested_retries().await });
    h.wait_entered(1).await;
    let second_ops = operator(&inbox, &h, VersionPolicy::Reject);
    let mut second =
        tokio::spawn(async move { second_ops.request_retry(head, "bob", "second").await });
    let early = within(&mut second, Duration::from_millis(300)).await;
    if early.is_none() {
        ctx.wait_until_blocked().await;
    }
    gate.add_permits(1_000);
    let done = within(&mut perf, Duration::from_secs(10))
        .await
        .expect("perform")
        .unwrap();
    assert_eq!(done.len(), 1);
    let second = match early {
        Some(r) => r,
        None => within(&mut second, Duration::from_secs(10))
            .await
            .expect("second"),
    }
    .expect("the message is still open: the second request is accepted");
    eprintln!("second request: perform={done:?}");
    assert!(second.requested_at > first.requested_at);
    let pending = ops.requested_retries().await.unwrap();
    assert_eq!(pending.len(), 1, "the newer request survives: {pending:?}");
    assert_eq!(
        pending[0].retry_request.as_ref().unwrap().actor,
        "bob",
        "{pending:?}"
    );
    assert!(ctx.applied("poison-a").await.is_empty());
    // Performed once more after the fix: applies in order, then nothing is pending.
    ctx.fix("poison-a").await;
    let done = ops.perform_requested_retries().await.unwrap();
    assert!(done[0].1.is_ok(), "{done:?}");
    assert!(ops.perform_requested_retries().await.unwrap().is_empty());
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    ctx.drop().await;
}

/// An operator discard of the head races the performed request (held inside the handler):
/// exactly one of them resolves the message; the discarded version is never applied too.
#[tokio::test]
async fn a_discard_racing_a_performed_request() {
    let ctx = ctx!("a_discard_racing_a_performed_request");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, _eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let performer = operator(&inbox, &h, VersionPolicy::Reject);
    let mut perf = tokio::spawn(async move { performer.perform_requested_retries().await });
    h.wait_entered(1).await;
    let d_ops = operator(&inbox, &h, VersionPolicy::Reject);
    let mut disc = tokio::spawn(async move { d_ops.discard(head, "carol", "obsolete").await });
    let early = within(&mut disc, Duration::from_millis(300)).await;
    if early.is_none() {
        ctx.wait_until_blocked().await;
    }
    gate.add_permits(1_000);
    let done = within(&mut perf, Duration::from_secs(10))
        .await
        .expect("perform")
        .unwrap();
    let d = match early {
        Some(r) => r,
        None => within(&mut disc, Duration::from_secs(10))
            .await
            .expect("discard"),
    };
    let retried = done.iter().any(|(_, r)| r.is_ok());
    eprintln!("discard race: retry={done:?} discard={d:?}");
    assert!(
        retried != d.is_ok(),
        "exactly one resolves the head: retry={done:?} discard={d:?}"
    );
    let applied = ctx.applied("poison-a").await;
    if retried {
        assert_eq!(applied, vec![1, 2]);
    } else {
        assert_eq!(applied, vec![2], "discarded v1 never applied");
    }
    ctx.effects_once().await;
    assert!(open_parked(&inbox).await.is_empty());
    assert!(ops.requested_retries().await.unwrap().is_empty());
    ctx.drop().await;
}

/// The engine is aborted while its retry task is inside the handler, then a new instance
/// starts and performs the (still pending) request. The request must be performed once.
#[tokio::test]
async fn the_engine_aborted_mid_retry_then_restarted() {
    let ctx = ctx!("the_engine_aborted_mid_retry_then_restarted");
    let h = Effects::gated_first(&ctx);
    let (inbox, log, eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let (_stop, task) = spawn_engine(eng);
    h.wait_entered(1).await;
    task.abort();
    let _ = task.await;
    let eng2 = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    let (stop2, task2) = spawn_engine(eng2);
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.add_permits(1_000);
    eventually("resolved", || async {
        open_parked(&inbox).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop2.send(()).unwrap();
    let (_e, rep2) = task2.await.unwrap();
    eprintln!("restarted engine: {rep2:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    assert_eq!(retries_audited(&inbox, head).await, 1);
    assert!(ops.requested_retries().await.unwrap().is_empty());
    ctx.drop().await;
}

/// A request for a message discarded meanwhile: performing does nothing, no request stays,
/// and a new request is refused.
#[tokio::test]
async fn a_request_for_a_message_resolved_meanwhile() {
    let ctx = ctx!("a_request_for_a_message_resolved_meanwhile");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, _eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    ops.discard(head, "carol", "obsolete").await.unwrap();
    let done = ops.perform_requested_retries().await.unwrap();
    assert!(done.iter().all(|(_, r)| r.is_err()), "{done:?}");
    assert!(ops.requested_retries().await.unwrap().is_empty());
    assert!(ops.request_retry(head, "alice", "again").await.is_err());
    assert_eq!(ctx.applied("poison-a").await, vec![2]);
    assert_eq!(retries_audited(&inbox, head).await, 0);
    ctx.effects_once().await;
    ctx.drop().await;
}

/// The retry's connection is lost while its retry task is inside the handler (terminated with
/// `pg_terminate_backend`; the transaction rolls back). FOUND by the adversary pass: the handler
/// surfaces the lost connection as a transient error, the retry counted as "failed again" and
/// the request was cleared, so the message stayed parked with nothing to retry it. Now a
/// transient failure is tried again at once (bounded): the second attempt applies it. Both
/// attempts are audited; nothing is applied twice.
#[tokio::test]
async fn the_retry_connection_killed_mid_retry() {
    let ctx = ctx!("the_retry_connection_killed_mid_retry");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let (stop, task) = spawn_engine(eng);
    h.wait_entered(1).await;
    let pids: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
         AND state LIKE 'idle in transaction%'",
    )
    .bind(&ctx.schema)
    .fetch_all(&ctx.pool)
    .await
    .unwrap();
    assert_eq!(pids.len(), 1, "the retry's transaction: {pids:?}");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pids[0])
        .execute(&ctx.pool)
        .await
        .unwrap();
    gate.add_permits(1_000);
    let deadline = Instant::now() + Duration::from_secs(3);
    while !open_parked(&inbox).await.is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "killed mid-retry: open {:?}; pending {:?}; trail {:?}",
        open_parked(&inbox)
            .await
            .iter()
            .map(|m| (m.id, m.status, m.attempts, m.reason.clone()))
            .collect::<Vec<_>>(),
        ops.requested_retries().await.map(|v| v.len()),
        inbox.audit_trail(GROUP, Some(head)).await
    );
    eventually("resolved", || async {
        open_parked(&inbox).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).unwrap();
    let (_e, rep) = task.await.unwrap();
    eprintln!("killed mid-retry: {rep:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    assert_eq!(
        retries_audited(&inbox, head).await,
        2,
        "the failed attempt and the one that applied it"
    );
    assert!(ops.requested_retries().await.unwrap().is_empty());
    ctx.drop().await;
}

/// While a request is performed (held inside the handler), the engine receives the parked head
/// and its waiting v2 again (a rewind or a producer retry: same event ids). Each is applied once,
/// in order, and the offset reaches the end only when all is final.
#[tokio::test]
async fn redelivery_of_the_parked_messages_while_the_request_is_performed() {
    let ctx = ctx!("redelivery_of_the_parked_messages_while_the_request_is_performed");
    let h = Effects::gated_first(&ctx);
    let inbox = ctx.inbox().await;
    let log = MemoryLog::new("t", 1);
    let (e1, e2) = (ev("poison-a", 1), ev("poison-a", 2));
    log.publish(&[&e1, &e2, &ev("b", 1)]).await;
    let mut eng = engine(
        log.consumer(GROUP, &["t"]),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    quiet(&mut eng).await;
    let head = open_parked(&inbox).await[0].id;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let (stop, task) = spawn_engine(eng);
    h.wait_entered(1).await;
    log.publish(&[&e1, &e2]).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        log.committed(GROUP, "t", 0).unwrap_or(0) <= 5,
        "committed past the end?"
    );
    gate.add_permits(1_000);
    eventually("offsets committed", || async {
        log.committed(GROUP, "t", 0) == Some(5)
    })
    .await;
    eventually("resolved", || async {
        open_parked(&inbox).await.is_empty()
    })
    .await;
    stop.send(()).unwrap();
    let (_e, rep) = task.await.unwrap();
    eprintln!("redelivery: {rep:?}");
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    assert_eq!(retries_audited(&inbox, head).await, 1);
    ctx.drop().await;
}

/// A request for the *waiting* v2 (not the head) while the head v1 still fails: performing it
/// must never apply v2 before v1; once v1 is fixed, a request for v2 applies 1 then 2.
#[tokio::test]
async fn a_request_for_a_waiting_message_never_applies_it_before_the_head() {
    let ctx = ctx!("a_request_for_a_waiting_message_never_applies_it_before_the_head");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, _eng, head) = setup(&ctx, &h).await;
    let waiting = open_parked(&inbox)
        .await
        .into_iter()
        .find(|m| m.id != head)
        .unwrap()
        .id;
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(waiting, "alice", "v2 please")
        .await
        .unwrap();
    let done = ops.perform_requested_retries().await.unwrap();
    eprintln!("waiting request, head unfixed: {done:?}");
    assert!(
        ctx.applied("poison-a").await.is_empty(),
        "v2 applied before v1"
    );
    assert_eq!(open_parked(&inbox).await.len(), 2);
    ctx.fix("poison-a").await;
    ops.request_retry(waiting, "alice", "v2 please")
        .await
        .unwrap();
    let done = ops.perform_requested_retries().await.unwrap();
    eprintln!("waiting request, head fixed: {done:?}");
    let applied = ctx.applied("poison-a").await;
    assert_eq!(applied, vec![1, 2]);
    ctx.effects_once().await;
    ctx.drop().await;
}

/// Two running engines of the same consumer (the second with an idle source) both check for
/// requests every 20 ms while the first retry is held inside the handler.
#[tokio::test]
async fn two_running_engines_check_the_same_request() {
    let ctx = ctx!("two_running_engines_check_the_same_request");
    let h = Effects::gated_first(&ctx);
    let (inbox, _log, eng, head) = setup(&ctx, &h).await;
    ctx.fix("poison-a").await;
    let gate = h.gate("poison-a");
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.request_retry(head, "alice", "fixed").await.unwrap();
    let (stop_a, task_a) = spawn_engine(eng);
    let eng_b = engine(
        Scripted::default(),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    let (stop_b, task_b) = spawn_engine(eng_b);
    h.wait_entered(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let entered = h.entered.load(Ordering::SeqCst);
    gate.add_permits(1_000);
    eventually("resolved", || async {
        open_parked(&inbox).await.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop_a.send(()).unwrap();
    stop_b.send(()).unwrap();
    let (_a, ra) = task_a.await.unwrap();
    let (_b, rb) = task_b.await.unwrap();
    eprintln!(
        "two engines: entered while held={entered} a={} b={}",
        ra.requested_retries, rb.requested_retries
    );
    assert_eq!(ra.requested_retries + rb.requested_retries, 1);
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2]);
    assert_eq!(ctx.effects_once().await, 3);
    assert_eq!(retries_audited(&inbox, head).await, 1);
    assert!(ops.requested_retries().await.unwrap().is_empty());
    ctx.drop().await;
}
