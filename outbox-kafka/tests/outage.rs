//! Broker outages against a tansu broker of each test's own:
//!
//! * the shared publisher outage suite ([`outbox_testkit::conformance::outage`]) against the
//!   [`KafkaPublisher`]: the broker is frozen (SIGSTOP) while batches are in flight and thawed
//!   (SIGCONT). Every error must be transient and the transport's, every `publish` must return
//!   within the delivery timeout (plus [`REPORT_GRACE`]), and every record reported
//!   acknowledged must be in the topic afterwards (found by its `event_id` header). Freezing
//!   rather than killing: tansu's memory storage loses everything on a kill, so nothing could
//!   be read back (its PostgreSQL storage keeps data, but needs a schema the crate does not
//!   ship);
//! * a broker outage must never park events: the real relay over an in-memory store publishes
//!   through the real [`KafkaPublisher`] to a broker that is killed for longer than the attempt
//!   limit allows, then started again without the topic (memory storage), and only later given
//!   its topic back.
//!
//! Needs the tansu binary (`TANSU_BIN`, or `~/.cargo/bin/tansu`); fails without it unless
//! `OUTBOX_SKIP_SERVICE_TESTS=1`.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{create_topic, read_all, read_event_ids, tansu_bin, unique, Tansu};
use outbox_core::prelude::*;
use outbox_core::{
    async_trait, DeliveryStatus, Envelope, EventId, FailureScope, PublishError, PublishErrorKind,
    PublishResult, Publisher, RelayConfig,
};
use outbox_kafka::{KafkaPublisher, REPORT_GRACE};
use outbox_testkit::conformance::outage::{publisher_outage, OutageHarness};
use outbox_testkit::scenarios::{memory_backlog, retry_policy, seeded_relay};

const AGGREGATES: usize = 40;
const VERSIONS: i64 = 8;
const PARTITIONS: i32 = 4;
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_ATTEMPTS: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Broker up, topic present.
    Up,
    /// Broker process killed.
    Down,
    /// Broker running again, topic not created yet.
    TopicMissing,
    /// Topic created again: the backlog must drain.
    Recovered,
}

/// One `publish` call as the relay made it.
struct Call {
    phase: Phase,
    errors: Vec<PublishError>,
}

/// Passes batches to the real publisher and records what came back, with the test's phase.
struct Recording {
    inner: KafkaPublisher,
    phase: Arc<Mutex<Phase>>,
    calls: Arc<Mutex<Vec<Call>>>,
}

#[async_trait]
impl Publisher for Recording {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let phase = *self.phase.lock().unwrap();
        let results = self.inner.publish(batch).await;
        let errors = results
            .iter()
            .filter_map(|r| r.as_ref().err().cloned())
            .collect();
        self.calls.lock().unwrap().push(Call { phase, errors });
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.inner.delivery_timeout()
    }
}

/// A tansu broker of the test's own with a topic of the test's own.
struct KafkaOutage {
    broker: Tansu,
    topic: String,
}

#[async_trait]
impl OutageHarness for KafkaOutage {
    type Publisher = KafkaPublisher;

    async fn publisher(&self) -> KafkaPublisher {
        KafkaPublisher::builder(self.broker.brokers(), &self.topic)
            .delivery_timeout(DELIVERY_TIMEOUT)
            .set("reconnect.backoff.max.ms", "500")
            .start()
            .await
            .expect("start")
    }

    async fn stop(&mut self) {
        self.broker.pause();
    }

    async fn restart(&mut self) {
        self.broker.resume();
    }

    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId> {
        let wanted: HashSet<String> = ids.iter().map(ToString::to_string).collect();
        let (brokers, topic) = (self.broker.brokers(), self.topic.clone());
        tokio::task::spawn_blocking(move || {
            read_event_ids(
                &brokers,
                &topic,
                PARTITIONS,
                &wanted,
                Duration::from_secs(30),
            )
        })
        .await
        .expect("reader")
        .into_iter()
        .map(|id| id.parse().expect("an event id"))
        .collect()
    }

    fn report_grace(&self) -> Duration {
        REPORT_GRACE
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_frozen_and_thawed_mid_batch_gives_transient_transport_errors_and_no_false_ack() {
    let bin = require!(tansu_bin("kafka_outage_suite"));
    let broker = Tansu::start(&bin);
    let topic = unique("outage-suite");
    create_topic(&broker.brokers(), &topic, PARTITIONS, &[]).await;
    let report = publisher_outage(KafkaOutage { broker, topic }).await;
    eprintln!("kafka outage: {report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_longer_than_the_attempt_limit_parks_nothing_and_drains_in_order() {
    let bin = require!(tansu_bin("broker_outage"));
    let mut broker = Tansu::start(&bin);
    let brokers = broker.brokers();
    let topic = unique("outage");
    create_topic(&brokers, &topic, PARTITIONS, &[]).await;

    // The outbox: AGGREGATES x VERSIONS events, committed.
    let (store, total) = memory_backlog(AGGREGATES, VERSIONS).await;

    let publisher = KafkaPublisher::builder(&brokers, &topic)
        .delivery_timeout(DELIVERY_TIMEOUT)
        // Reconnect quickly once the broker is back (librdkafka's default backs off to 10 s).
        .set("reconnect.backoff.max.ms", "500")
        .start()
        .await
        .expect("start");
    let phase = Arc::new(Mutex::new(Phase::Up));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let recording = Recording {
        inner: publisher,
        phase: Arc::clone(&phase),
        calls: Arc::clone(&calls),
    };
    // The attempt limit: the old publisher (timeouts spending attempts) parked every event in
    // flight after MAX_ATTEMPTS timed-out batches, about 5 s into the outage.
    let config = RelayConfig::builder()
        .owner("outage-relay")
        .batch_size(AGGREGATES)
        .retry(retry_policy(
            Duration::from_millis(50),
            Duration::from_millis(500),
            MAX_ATTEMPTS,
        ))
        .circuit_breaker(Duration::from_millis(200), Duration::from_secs(1))
        .idle(Duration::from_millis(5), Duration::from_millis(50))
        .build()
        .unwrap();
    let mut relay = seeded_relay(store.clone(), recording, config, 9);

    let outage = DELIVERY_TIMEOUT * (MAX_ATTEMPTS + 2);
    let topic_missing_for = Duration::from_secs(6);
    let mut published_before_kill: HashSet<EventId> = HashSet::new();
    let (mut published, mut retried, mut deferred, mut parked) = (0, 0, 0, 0);
    let mut circuit_changes: Vec<(Phase, bool)> = Vec::new();
    let mut changed_at = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let report = relay
            .run_once()
            .await
            .expect("store errors are not expected");
        published += report.published;
        retried += report.retried;
        deferred += report.deferred;
        parked += report.parked + report.parked_at_claim;
        let now_phase = *phase.lock().unwrap();
        let open = relay.circuit().is_open();
        if circuit_changes.last().map(|c| c.1).unwrap_or(false) != open {
            circuit_changes.push((now_phase, open));
        }
        assert_eq!(parked, 0, "an event was parked in phase {now_phase:?}");
        assert_eq!(retried, 0, "an attempt was spent in phase {now_phase:?}");

        let next = match now_phase {
            // Kill the broker with about a third of the events published.
            Phase::Up if published >= total / 3 => {
                published_before_kill = store
                    .snapshot()
                    .into_iter()
                    .filter(|r| r.status == DeliveryStatus::Published)
                    .map(|r| r.envelope.event_id)
                    .collect();
                assert!(published_before_kill.len() < total);
                broker.kill();
                Some(Phase::Down)
            }
            Phase::Down if changed_at.elapsed() >= outage => {
                // Memory storage: the broker comes back empty, the topic is missing.
                broker.restart();
                Some(Phase::TopicMissing)
            }
            Phase::TopicMissing if changed_at.elapsed() >= topic_missing_for => {
                create_topic(&brokers, &topic, PARTITIONS, &[]).await;
                Some(Phase::Recovered)
            }
            Phase::Recovered if published == total => break,
            _ => None,
        };
        if let Some(p) = next {
            *phase.lock().unwrap() = p;
            changed_at = Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "not drained within 120 s: {published} of {total} published, phase {now_phase:?}, \
             circuit {circuit_changes:?}"
        );
        if let Some(pause) = report.pause {
            tokio::time::sleep(pause).await;
        } else if report.is_idle() {
            tokio::time::sleep(relay.idle_delay()).await;
        } else {
            relay.reset_idle();
        }
    }

    // Everything drained, nothing parked, no attempt spent.
    let stats = store.stats().await.unwrap();
    assert_eq!((stats.unpublished, stats.parked), (0, 0), "{stats:?}");
    assert!(store.list_parked(10).await.unwrap().is_empty());
    let rows = store.snapshot();
    assert_eq!(rows.len(), total);
    for r in &rows {
        assert_eq!(r.status, DeliveryStatus::Published, "{:?}", r.envelope);
        assert_eq!(r.attempts, 0, "attempts spent on {:?}", r.envelope);
    }
    assert!(deferred > 0, "the outage deferred nothing");

    // The circuit breaker opened during the outage and closed when the topic came back.
    eprintln!("circuit changes: {circuit_changes:?}");
    assert!(
        circuit_changes.iter().any(|c| c.1),
        "the circuit never opened"
    );
    assert!(!relay.circuit().is_open(), "the circuit is still open");
    assert_eq!(circuit_changes.last().map(|c| c.0), Some(Phase::Recovered));

    // What the publisher reported: transport failures only; once the broker answered again,
    // the missing topic was reported as such, naming it, not as a timeout.
    let calls = calls.lock().unwrap();
    let mut kinds: BTreeMap<(String, &str), usize> = BTreeMap::new();
    for c in calls.iter() {
        for e in &c.errors {
            *kinds
                .entry((format!("{:?}", c.phase), e.kind.as_str()))
                .or_default() += 1;
            assert_eq!(e.scope, FailureScope::Transport, "{e}");
        }
    }
    eprintln!("errors by phase and kind: {kinds:?}");
    let missing_phase: Vec<&Call> = calls
        .iter()
        .filter(|c| c.phase == Phase::TopicMissing && !c.errors.is_empty())
        .collect();
    // The last batch before the topic came back: the broker had been answering for seconds.
    let last = missing_phase
        .last()
        .expect("no batch while the topic was missing");
    for e in &last.errors {
        assert_eq!(
            e.kind,
            PublishErrorKind::UnknownTopic,
            "a missing topic reported as {e}"
        );
        assert!(e.message.contains(&topic), "the topic is not named: {e}");
    }
    drop(calls);

    // The topic, read back: every event published after the restart is there, each aggregate
    // on one partition, its first deliveries in version order.
    let after: Vec<&outbox_testkit::OutboxRow> = rows
        .iter()
        .filter(|r| !published_before_kill.contains(&r.envelope.event_id))
        .collect();
    let read = read_all(
        &brokers,
        &topic,
        PARTITIONS,
        after.len(),
        Duration::from_secs(30),
    );
    let mut first_seen: HashSet<String> = HashSet::new();
    let mut by_aggregate: BTreeMap<String, Vec<(i32, i64, i64)>> = BTreeMap::new();
    for r in &read {
        let id = r.header("event_id").unwrap().to_owned();
        if !first_seen.insert(id) {
            continue; // a duplicate, which at-least-once allows
        }
        let aggregate = r.header("aggregate_id").unwrap().to_owned();
        let version: i64 = r.header("aggregate_version").unwrap().parse().unwrap();
        by_aggregate
            .entry(aggregate)
            .or_default()
            .push((r.partition, r.offset, version));
    }
    for row in &after {
        assert!(
            first_seen.contains(&row.envelope.event_id.to_string()),
            "{} v{} acknowledged but not in the topic",
            row.envelope.aggregate_id,
            row.envelope.aggregate_version
        );
    }
    assert_eq!(by_aggregate.len(), AGGREGATES, "aggregates in the topic");
    for (aggregate, mut records) in by_aggregate {
        records.sort_by_key(|(_, offset, _)| *offset);
        assert!(
            records.iter().all(|r| r.0 == records[0].0),
            "{aggregate} on several partitions: {records:?}"
        );
        let versions: Vec<i64> = records.iter().map(|r| r.2).collect();
        assert!(
            versions.windows(2).all(|w| w[0] + 1 == w[1]),
            "{aggregate}: versions out of order or with a gap in the topic: {versions:?}"
        );
        assert_eq!(versions.last(), Some(&VERSIONS), "{aggregate}");
    }
}
