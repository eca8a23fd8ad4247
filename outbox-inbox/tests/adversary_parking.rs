//! Adversarial tests of parking against concurrent instances of one consumer (PostgreSQL):
//! a parked message blocks its aggregate even for an instance that read the aggregate before
//! the message was parked.
//!
//! Each test runs in its own schema; skipped (returns) when `DATABASE_URL` is unset.

#[macro_use]
mod adversary_common;
use adversary_common::*;

use outbox_core::{ParkedStatus, Publisher};
use outbox_inbox::VersionPolicy;
use outbox_testkit::MemoryLog;
use std::time::Duration;

/// Attack: `poison-a` v1 is applied. Instance A reads the aggregate (v1 applied, not blocked)
/// for its batch [v2, v3], and its handler waits on a gate in v2. Meanwhile instance B, on the
/// same partition (a rebalance) but only from v3, finds v3 a version gap, parks it as the
/// aggregate's head and commits (its parking takes no lock A holds). A must not then commit v2
/// and v3 over the parked head (v3 applied *and* parked, the aggregate blocked behind an
/// applied event): writing the version takes the aggregate's row lock, A reads the aggregate
/// blocked, runs again and v2 waits behind the head. An operator's retry then applies v2 and
/// v3 once each, releases both and unblocks the aggregate.
//
// FOUND here, fixed: A applied v2 and v3 after B parked v3 (the open risk the i20 follow-up
// reported: a stale read applied behind a head parked meanwhile).
async fn stale_read_apply_after_park(policy: VersionPolicy, name: &str) {
    let ctx = ctx!(name);
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    ctx.fix("poison-a").await;
    let (a1, a2, a3) = (ev("poison-a", 1), ev("poison-a", 2), ev("poison-a", 3));
    assert!(matches!(
        processor(&inbox, &h, policy).process(&a1).await.unwrap(),
        outbox_inbox::MessageOutcome::Applied
    ));
    let gate = h.gate("poison-a");
    let log_a = MemoryLog::new("t", 1);
    log_a.publish(&[&a2, &a3]).await;
    let log_b = MemoryLog::new("t", 1);
    log_b.publish(&[&a3]).await;
    let eng_a = engine(log_a.consumer(GROUP, &["t"]), &inbox, &h, policy, fast());
    let (stop_a, task_a) = spawn_engine(eng_a);
    // A is in the handler of v2: it read the aggregate unblocked.
    h.wait_entered(1).await;
    let mut eng_b = engine(log_b.consumer(GROUP, &["t"]), &inbox, &h, policy, fast());
    tokio::time::timeout(Duration::from_secs(20), quiet(&mut eng_b))
        .await
        .expect("B quiet");
    let parked = open_parked(&inbox).await;
    assert_eq!(parked.len(), 1, "B parked v3: {parked:?}");
    assert_eq!(parked[0].status, ParkedStatus::Parked);
    let head = parked[0].id;
    // A goes on.
    gate.add_permits(1_000);
    let l = &log_a;
    eventually("A through its log", || async move {
        l.committed(GROUP, "t", 0) == Some(2)
    })
    .await;
    stop_a.send(()).unwrap();
    let (_eng, r) = tokio::time::timeout(Duration::from_secs(20), task_a)
        .await
        .expect("A stops")
        .unwrap();
    assert_eq!(
        ctx.applied("poison-a").await,
        vec![1],
        "applied behind a parked head ({r:?}); parked: {:?}",
        all_parked(&inbox).await
    );
    let parked = all_parked(&inbox).await;
    assert_eq!(parked.len(), 2, "{parked:?}");
    assert!(agg_state(&ctx, "poison-a").await.1, "blocked");
    // The operator retries the head: both applied once, the aggregate unblocked.
    let ops = operator(&inbox, &h, policy);
    tokio::time::timeout(Duration::from_secs(20), ops.retry(head, "alice", "v2 came"))
        .await
        .expect("retry returns")
        .unwrap();
    assert_eq!(ctx.applied("poison-a").await, vec![1, 2, 3]);
    assert!(
        open_parked(&inbox).await.is_empty(),
        "{:?}",
        all_parked(&inbox).await
    );
    assert!(!agg_state(&ctx, "poison-a").await.1, "unblocked");
    ctx.effects_once().await;
    ctx.drop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_read_does_not_apply_behind_a_head_parked_meanwhile_reject() {
    stale_read_apply_after_park(
        VersionPolicy::Reject,
        "a_stale_read_does_not_apply_behind_a_head_parked_meanwhile_reject",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_read_does_not_apply_behind_a_head_parked_meanwhile_hold() {
    stale_read_apply_after_park(
        VersionPolicy::hold(16, Duration::from_millis(1)),
        "a_stale_read_does_not_apply_behind_a_head_parked_meanwhile_hold",
    )
    .await;
}

fn head_at(e: &outbox_core::Envelope, offset: i64) -> outbox_core::NewParkedMessage {
    let record = outbox_core::ReceivedMessage::new(
        outbox_core::LogPosition::new("t", 0, offset),
        None,
        Ok(e.clone()),
    )
    .to_record();
    outbox_core::NewParkedMessage::new(
        record,
        outbox_core::ParkAs::Head(outbox_core::ParkKind::Unprocessable),
        "fails",
        1,
    )
}

/// Attack: the record parked under an id of its position and content (its dedup id and scoped
/// id both held by parked messages of other aggregates) is delivered again at the same offset
/// (parked already) and at another offset after a rewind (parked again, waiting behind the
/// first: kept twice). The operator retries the real event, then the foreign record's head:
/// the foreign record is applied once, and its copy from the other offset is released as a
/// duplicate, never applied a second time; the aggregate is unblocked.
//
// Held.
#[tokio::test]
async fn a_record_parked_by_content_twice_after_a_rewind_is_applied_once() {
    use outbox_core::{InboxStore, Parking};
    let ctx = ctx!("a_record_parked_by_content_twice_after_a_rewind_is_applied_once");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let real = ev("a", 1);
    let foreign = outbox_core::Envelope::builder("order", "b", 1, "order.changed")
        .header(
            outbox_core::wire::ORIGINAL_EVENT_ID,
            real.event_id.to_string(),
        )
        .json(&serde_json::json!({ "v": 1 }))
        .unwrap()
        .build()
        .unwrap();
    let crafted = outbox_core::Envelope::builder("order", "c", 1, "order.changed")
        .event_id(outbox_core::inbox::scoped_dedup_id(
            &outbox_core::AggregateKey::new("order", "b"),
            real.event_id,
        ))
        .build()
        .unwrap();
    let park = |e: &outbox_core::Envelope, offset: i64| {
        let (inbox, m) = (inbox.clone(), head_at(e, offset));
        async move {
            let mut tx = inbox.begin().await.unwrap();
            let p = inbox.park(&mut tx, GROUP, &[m]).await.unwrap();
            inbox.commit(tx).await.unwrap();
            p[0]
        }
    };
    assert!(matches!(park(&crafted, 1).await, Parking::Head(_)));
    let Parking::Head(real_head) = park(&real, 2).await else {
        panic!("real not parked")
    };
    let Parking::Head(foreign_head) = park(&foreign, 3).await else {
        panic!("foreign not parked")
    };
    assert_eq!(park(&foreign, 3).await, Parking::AlreadyParked);
    assert!(matches!(park(&foreign, 7).await, Parking::Waiting(_)));
    let ops = operator(&inbox, &h, VersionPolicy::Reject);
    ops.retry(real_head, "alice", "fixed").await.unwrap();
    ops.retry(foreign_head, "alice", "fixed").await.unwrap();
    assert_eq!(ctx.applied("a").await, vec![1]);
    assert_eq!(ctx.applied("b").await, vec![1], "the foreign record once");
    let open: Vec<_> = open_parked(&inbox)
        .await
        .into_iter()
        .filter(|m| m.record.aggregate.as_ref().map(|a| a.aggregate_id.as_str()) != Some("c"))
        .collect();
    assert!(open.is_empty(), "{open:?}");
    assert!(!agg_state(&ctx, "b").await.1, "b unblocked");
    ctx.drop().await;
}
