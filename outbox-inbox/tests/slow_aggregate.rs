//! One slow aggregate among many, on a real Kafka-protocol broker (tansu) and the real
//! PostgreSQL inbox (issue 20, item 9): the engine pauses the partition whose messages fill
//! its bound and keeps polling, so the other partitions flow, a missing version held behind
//! a gap is still read, and a member joining the group is served; when the slow aggregate is
//! released, its partition resumes exactly where it stopped (every message once, in order,
//! the committed offsets at the ends).
//!
//! Needs `DATABASE_URL` and `KAFKA_BROKERS` (`scripts/test` provides both).

#[macro_use]
mod adversary_common;
use adversary_common::*;

use std::collections::HashMap;
use std::time::Duration;

use outbox_core::Publisher;
use outbox_inbox::VersionPolicy;

/// Publishes one record per produce request (tansu cannot serve a fetch starting inside a
/// batch); returns the partition of each aggregate and the end of each partition.
async fn publish_each(
    publisher: &outbox_kafka::KafkaPublisher,
    events: &[outbox_core::Envelope],
    parts: &mut HashMap<String, i32>,
    ends: &mut HashMap<i32, i64>,
) {
    for e in events {
        let ack = publisher.publish(&[e]).await.remove(0).expect("published");
        let (_, partition, offset) = ack.as_kafka().expect("a Kafka acknowledgement");
        parts.insert(e.aggregate_id.clone(), partition);
        let end = ends.entry(partition).or_insert(0);
        *end = (*end).max(offset + 1);
    }
}

async fn wait_applied_gap_baseline(ctx: &Ctx) {
    eventually("gap v1 applied", || async {
        ctx.applied("gap").await == vec![1]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slow_aggregate_holds_up_only_its_own_partition() {
    let Some(brokers) = outbox_test_support::brokers("one_slow_aggregate") else {
        return;
    };
    let ctx = ctx!("one_slow_aggregate_holds_up_only_its_own_partition");
    let inbox = ctx.inbox().await;
    let h = Effects::new(&ctx);
    let gate = h.gate("slow");
    let topic = outbox_test_support::unique("slow_t");
    let group = outbox_test_support::unique("slow_g");
    create_topic(&brokers, &topic, 2).await;
    let publisher = outbox_kafka::KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(Duration::from_secs(10))
        .start()
        .await
        .expect("publisher");
    let (mut parts, mut ends) = (HashMap::new(), HashMap::new());
    // The first version of the aggregate that will have a gap (its baseline), applied before
    // the slow aggregate arrives: a batch takes messages of several aggregates, and one that
    // shared the slow aggregate's transaction would wait with it (whatever its partition).
    publish_each(&publisher, &[ev("gap", 1)], &mut parts, &mut ends).await;
    let cfg = || {
        fast()
            .with_max_batch(2)
            .with_concurrency(2)
            .with_max_in_flight(8)
            .with_max_in_flight_per_partition(4)
            .with_commit(5, Duration::from_millis(200))
    };
    let policy = VersionPolicy::hold(100, Duration::from_secs(60));
    let first = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        policy,
        cfg(),
    );
    let (stop_first, first_task) = spawn_engine(first);
    wait_applied_gap_baseline(&ctx).await;
    let slow: Vec<_> = (1..=16).map(|v| ev("slow", v)).collect();
    publish_each(&publisher, &slow, &mut parts, &mut ends).await;
    let slow_part = parts["slow"];
    // The slow aggregate's first batch is in its handler; the engine reads on until the slow
    // partition's bound is full.
    h.wait_entered(1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Many other aggregates, published now; some land beside the slow one, some on the other
    // partition. One of them arrives with a version gap: v3..=11 first, the missing v2 last.
    let mut others: Vec<_> = (0..8)
        .flat_map(|i| (1..=3).map(move |v| ev(&format!("k{i}"), v)))
        .collect();
    others.extend((3..=11).map(|v| ev("gap", v)));
    others.push(ev("gap", 2));
    publish_each(&publisher, &others, &mut parts, &mut ends).await;
    let other_part = 1 - slow_part;
    let flowing: Vec<String> = parts
        .iter()
        .filter(|(a, p)| **p == other_part && a.as_str() != "slow")
        .map(|(a, _)| a.clone())
        .collect();
    assert!(
        !flowing.is_empty(),
        "no aggregate on the other partition: {parts:?}"
    );
    for a in &flowing {
        let want: Vec<i64> = if a == "gap" {
            (1..=11).collect()
        } else {
            vec![1, 2, 3]
        };
        let ctx = &ctx;
        eventually(
            &format!("{a} applied while the slow aggregate waits"),
            || {
                let want = want.clone();
                async move { ctx.applied(a).await == want }
            },
        )
        .await;
    }
    assert!(
        ctx.applied("slow").await.is_empty(),
        "the slow aggregate is held"
    );
    // A second member joins while the slow aggregate is held: the first keeps polling, so the
    // rebalance is served; new records on the other partition are applied by whichever member
    // owns it now.
    let second = engine(
        kafka_source(&brokers, &group, &topic),
        &inbox,
        &h,
        policy,
        cfg(),
    );
    let (stop_second, second_task) = spawn_engine(second);
    let late: Vec<_> = flowing
        .iter()
        .filter(|a| a.starts_with('k'))
        .map(|a| ev(a, 4))
        .collect();
    publish_each(&publisher, &late, &mut parts, &mut ends).await;
    for e in &late {
        let a = e.aggregate_id.as_str();
        let ctx = &ctx;
        eventually(
            &format!("{a} v4 applied across the rebalance"),
            || async move { ctx.applied(a).await.last() == Some(&4) },
        )
        .await;
    }
    // Release the slow aggregate: its partition resumes exactly where it stopped.
    gate.add_permits(1_000);
    let total = slow.len() + 1 + others.len() + late.len();
    eventually("every event applied", || async {
        ctx.effects_once().await == total as i64
    })
    .await;
    assert_eq!(ctx.applied("slow").await, (1..=16).collect::<Vec<i64>>());
    eventually("the group's offsets at the ends", || async {
        let mut done = true;
        for (p, end) in &ends {
            done &= group_committed(&brokers, &group, &topic, *p).await == Some(*end);
        }
        done
    })
    .await;
    stop_first.send(()).unwrap();
    stop_second.send(()).unwrap();
    let (first, r1) = first_task.await.unwrap();
    let (second, r2) = second_task.await.unwrap();
    tokio::task::spawn_blocking(move || {
        drop(first);
        drop(second);
    })
    .await
    .unwrap();
    assert_eq!(r1.parked + r2.parked, 0, "{r1:?} {r2:?}");
    assert!(open_parked(&inbox).await.is_empty());
    assert_eq!(ctx.effects_once().await, total as i64);
    ctx.drop().await;
}
