//! Adversarial tests of paused partitions and of the start of assigned partitions (issue 20,
//! items 9 and 13) on a real Kafka-protocol broker (tansu) and the real PostgreSQL inbox:
//! rebalances (a member joining and leaving) while a partition is paused, a member whose
//! committed-offsets reads on assignment all fail across several rebalances, and an engine
//! dropped while its partition is paused.
//!
//! Invariants attacked: every event applied once, in order per aggregate; nothing skipped or
//! read past by a pause, a resume, a revoke or a re-assignment; a paused partition that changes
//! hands is read to its end by its owner; the group's committed offsets end at the ends of the
//! partitions.
//!
//! Needs `DATABASE_URL` and `KAFKA_BROKERS` (`scripts/test` provides both).

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::{Envelope, Publisher};
use outbox_inbox::{EngineConfig, VersionPolicy};

/// The broker's partitions of the events published so far, and the end of each partition.
#[derive(Default)]
struct Published {
    parts: HashMap<String, i32>,
    ends: HashMap<i32, i64>,
    count: usize,
}

impl Published {
    /// Publishes one record per produce request (tansu cannot serve a fetch starting inside a
    /// batch).
    async fn publish(&mut self, publisher: &outbox_kafka::KafkaPublisher, events: &[Envelope]) {
        for e in events {
            let ack = publisher.publish(&[e]).await.remove(0).expect("published");
            let (_, partition, offset) = ack.as_kafka().expect("a Kafka acknowledgement");
            self.parts.insert(e.aggregate_id.clone(), partition);
            let end = self.ends.entry(partition).or_insert(0);
            *end = (*end).max(offset + 1);
            self.count += 1;
        }
    }

    async fn wait_committed_at_ends(&self, brokers: &str, group: &str, topic: &str) {
        eventually("the group's offsets at the ends", || async {
            let mut done = true;
            for (p, end) in &self.ends {
                done &= group_committed(brokers, group, topic, *p).await == Some(*end);
            }
            done
        })
        .await;
    }
}

/// Logs to the test's output (`RUST_LOG`, default `warn`): the rebalances and pauses of a
/// failing run.
fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

async fn publisher(brokers: &str, topic: &str) -> outbox_kafka::KafkaPublisher {
    outbox_kafka::KafkaPublisher::builder(brokers, topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("publisher")
}

/// Stops an engine started with `spawn_engine` and drops it off the runtime's threads (closing
/// a Kafka consumer blocks).
async fn stop<S: outbox_core::MessageSource + Send + 'static>(
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<(Engine<S>, outbox_inbox::EngineReport)>,
) -> outbox_inbox::EngineReport {
    stop.send(()).unwrap();
    let (eng, r) = task.await.unwrap();
    tokio::task::spawn_blocking(move || drop(eng))
        .await
        .unwrap();
    r
}

async fn wait_applied(ctx: &Ctx, agg: &str, want: Vec<i64>) {
    eventually(&format!("{agg} applied {want:?}"), || {
        let want = want.clone();
        async move { ctx.applied(agg).await == want }
    })
    .await;
}

fn slow_cfg() -> EngineConfig {
    fast()
        .with_max_batch(2)
        .with_concurrency(2)
        .with_max_in_flight(8)
        .with_max_in_flight_per_partition(4)
        .with_commit(5, Duration::from_millis(200))
        // A member leaving with a batch blocked behind the other's open transaction abandons
        // it (rolled back) instead of waiting the default 10 s.
        .with_shutdown_grace(Duration::from_millis(500))
}

/// Attack 1: a member pauses the partition of a slow aggregate (its handler held on a gate);
/// a second member joins (the group revokes every partition and splits them, so the paused
/// partition is either given back to the first member, which must start it unpaused, or to
/// the new one, whose registration of the slow message waits on the first member's open
/// transaction), then leaves again (the first member gets every partition back). Released,
/// everything applies once and in order, and the committed offsets reach the ends: the paused
/// partition was never left paused by a rebalance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_across_a_join_and_a_leave() {
    let Some(brokers) = outbox_test_support::brokers("a_paused_partition_across_a_join") else {
        return;
    };
    init_tracing();
    let ctx = ctx!("a_paused_partition_across_a_join_and_a_leave");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let gate = h.gate("slow");
    let topic = outbox_test_support::unique("pauseb_t");
    let group = outbox_test_support::unique("pauseb_g");
    create_topic(&brokers, &topic, 2).await;
    let p = publisher(&brokers, &topic).await;
    let mut published = Published::default();
    published
        .publish(&p, &(1..=12).map(|v| ev("slow", v)).collect::<Vec<_>>())
        .await;
    let first = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        slow_cfg(),
    );
    let (stop_first, first_task) = spawn_engine(first);
    h.wait_entered(1).await;
    // Long enough for the first member to fill the slow partition's bound and pause it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let others: Vec<Envelope> = (1..=3)
        .flat_map(|v| (0..8).map(move |i| ev(&format!("k{i}"), v)))
        .collect();
    published.publish(&p, &others).await;
    let slow_part = published.parts["slow"];
    let flowing: Vec<String> = published
        .parts
        .iter()
        .filter(|(a, part)| **part != slow_part && a.as_str() != "slow")
        .map(|(a, _)| a.clone())
        .collect();
    assert!(!flowing.is_empty(), "{:?}", published.parts);
    for a in &flowing {
        wait_applied(&ctx, a, vec![1, 2, 3]).await;
    }
    // A second member joins and takes one of the two partitions.
    let second = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        slow_cfg(),
    );
    let (stop_second, second_task) = spawn_engine(second);
    let v4: Vec<Envelope> = flowing.iter().map(|a| ev(a, 4)).collect();
    published.publish(&p, &v4).await;
    for a in &flowing {
        wait_applied(&ctx, a, vec![1, 2, 3, 4]).await;
    }
    // It leaves: the first member owns both partitions again.
    let r2 = stop(stop_second, second_task).await;
    let v5: Vec<Envelope> = flowing.iter().map(|a| ev(a, 5)).collect();
    published.publish(&p, &v5).await;
    for a in &flowing {
        wait_applied(&ctx, a, vec![1, 2, 3, 4, 5]).await;
    }
    assert!(
        ctx.applied("slow").await.is_empty(),
        "the slow aggregate is held"
    );
    gate.add_permits(1_000);
    eventually("every event applied", || async {
        ctx.effects_once().await == published.count as i64
    })
    .await;
    published
        .wait_committed_at_ends(&brokers, &group, &topic)
        .await;
    let r1 = stop(stop_first, first_task).await;
    assert_eq!(ctx.applied("slow").await, (1..=12).collect::<Vec<i64>>());
    for (a, part) in &published.parts {
        let n = if *part == slow_part { 3 } else { 5 };
        if a != "slow" {
            assert_eq!(
                ctx.applied(a).await,
                (1..=n).collect::<Vec<i64>>(),
                "{a}: {r1:?} {r2:?}"
            );
        }
    }
    assert_eq!(r1.parked + r2.parked, 0, "{r1:?} {r2:?}");
    assert_eq!(ctx.effects_once().await, published.count as i64);
    ctx.drop().await;
}

/// Attack 2: every committed-offsets read a member makes on assignment fails (item 13's test
/// seam), across rebalances: the member starts alone (no committed offset anywhere: the
/// partitions start at the configured start), a second member joins (partitions revoked and
/// assigned again, now with committed offsets the failing member cannot read), then leaves
/// (the failing member gets the other's partition back). Events published in each phase are
/// applied once and in order, nothing read twice or skipped; offsets at the ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_committed_reads_on_assignment_across_rebalances() {
    let Some(brokers) = outbox_test_support::brokers("failing_committed_reads_across") else {
        return;
    };
    init_tracing();
    let ctx = ctx!("failing_committed_reads_on_assignment_across_rebalances");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let topic = outbox_test_support::unique("startb_t");
    let group = outbox_test_support::unique("startb_g");
    create_topic(&brokers, &topic, 2).await;
    let p = publisher(&brokers, &topic).await;
    let aggs: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let mut published = Published::default();
    let phase = |v: i64| aggs.iter().map(|a| ev(a, v)).collect::<Vec<_>>();
    published.publish(&p, &phase(1)).await;
    assert_eq!(published.ends.len(), 2, "{:?}", published.parts);
    let failing = outbox_kafka::KafkaSource::builder(&brokers, &group)
        .topic(&topic)
        .session_timeout(Duration::from_secs(6))
        .fail_committed_reads_on_assignment(1_000)
        .build()
        .expect("source");
    let (stop_failing, failing_task) = spawn_engine(engine(
        failing,
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_commit(5, Duration::from_millis(200)),
    ));
    for a in &aggs {
        wait_applied(&ctx, a, vec![1]).await;
    }
    published.publish(&p, &phase(2)).await;
    for a in &aggs {
        wait_applied(&ctx, a, vec![1, 2]).await;
    }
    published
        .wait_committed_at_ends(&brokers, &group, &topic)
        .await;
    // A second member joins: every partition is revoked and assigned again.
    let (stop_other, other_task) = spawn_engine(engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        fast().with_commit(5, Duration::from_millis(200)),
    ));
    // Published while the group settles, and after it settled (a first assignment takes
    // about half the session timeout).
    published.publish(&p, &phase(3)).await;
    for a in &aggs {
        wait_applied(&ctx, a, vec![1, 2, 3]).await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    published.publish(&p, &phase(4)).await;
    for a in &aggs {
        wait_applied(&ctx, a, vec![1, 2, 3, 4]).await;
    }
    published
        .wait_committed_at_ends(&brokers, &group, &topic)
        .await;
    let r_other = stop(stop_other, other_task).await;
    // The failing member owns both partitions again, its reads failing.
    published.publish(&p, &phase(5)).await;
    for a in &aggs {
        wait_applied(&ctx, a, vec![1, 2, 3, 4, 5]).await;
    }
    published
        .wait_committed_at_ends(&brokers, &group, &topic)
        .await;
    let r_failing = stop(stop_failing, failing_task).await;
    assert_eq!(
        ctx.effects_once().await,
        published.count as i64,
        "{r_failing:?} {r_other:?}"
    );
    assert!(
        r_other.applied > 0,
        "the second member owned a partition: {r_other:?}"
    );
    // A partition started anywhere but at its committed offset (the beginning: a whole
    // partition read again) would show as a phase's worth of duplicates or more.
    let again = r_failing.duplicates + r_failing.stale + r_other.duplicates + r_other.stale;
    assert!(again < 8, "read again: {r_failing:?} {r_other:?}");
    ctx.drop().await;
}

/// Attack 3: `max_in_flight_per_partition = 1`; a member's engine is dropped (its task
/// aborted, the slow aggregate's transaction open, its partition paused). A new member of the
/// group starts where the group's committed offsets are (the old member's last commit, below
/// the unfinished message): every event once, in order; offsets at the ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_dropped_while_its_partition_is_paused() {
    let Some(brokers) = outbox_test_support::brokers("an_engine_dropped_while_paused") else {
        return;
    };
    init_tracing();
    let ctx = ctx!("an_engine_dropped_while_its_partition_is_paused");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let gate = h.gate("slow");
    let topic = outbox_test_support::unique("dropb_t");
    let group = outbox_test_support::unique("dropb_g");
    create_topic(&brokers, &topic, 2).await;
    let p = publisher(&brokers, &topic).await;
    let mut published = Published::default();
    let mut events: Vec<Envelope> = (1..=6).map(|v| ev("slow", v)).collect();
    events.extend((1..=3).flat_map(|v| (0..6).map(move |i| ev(&format!("k{i}"), v))));
    published.publish(&p, &events).await;
    let cfg = || {
        fast()
            .with_max_batch(1)
            .with_concurrency(2)
            .with_max_in_flight(4)
            .with_max_in_flight_per_partition(1)
            .with_commit(1, Duration::from_millis(100))
    };
    let mut first = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    );
    let first_task = tokio::spawn(async move {
        let _ = first.run(std::future::pending::<()>()).await;
    });
    h.wait_entered(1).await;
    let slow_part = published.parts["slow"];
    // The other partition is read to its end by the first member while it is held.
    let flowing: Vec<String> = published
        .parts
        .iter()
        .filter(|(a, part)| **part != slow_part && a.as_str() != "slow")
        .map(|(a, _)| a.clone())
        .collect();
    for a in &flowing {
        wait_applied(&ctx, a, vec![1, 2, 3]).await;
    }
    // The slow partition's committed offset never passes the unfinished slow v1 (offset 0).
    let held_at = group_committed(&brokers, &group, &topic, slow_part).await;
    assert!(
        held_at.unwrap_or(0) == 0,
        "committed {held_at:?} past slow v1"
    );
    first_task.abort();
    let _ = first_task.await;
    gate.add_permits(1_000);
    let (stop_second, second_task) = spawn_engine(engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        VersionPolicy::Reject,
        cfg(),
    ));
    eventually("every event applied", || async {
        ctx.effects_once().await == published.count as i64
    })
    .await;
    published
        .wait_committed_at_ends(&brokers, &group, &topic)
        .await;
    let r = stop(stop_second, second_task).await;
    assert_eq!(
        ctx.applied("slow").await,
        (1..=6).collect::<Vec<i64>>(),
        "{r:?}"
    );
    for (a, _) in published.parts.iter().filter(|(a, _)| a.as_str() != "slow") {
        assert_eq!(ctx.applied(a).await, vec![1, 2, 3], "{a}: {r:?}");
    }
    assert_eq!(r.parked, 0, "{r:?}");
    ctx.drop().await;
}
