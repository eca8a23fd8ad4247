//! [`NatsSource`] against a real NATS server with JetStream: the clauses of the shared message
//! source suite that fit JetStream, the server behaviour the source relies on, and the inbox
//! engine end to end on the real PostgreSQL inbox.
//!
//! # Which source suite checks run, and why the others cannot (today's trait)
//!
//! The suite identifies a message by the `(partition, offset)` that `SourceHarness::produce`
//! returns and expects a redelivered message at the same position. A JetStream position here
//! is the consumer's *delivery* sequence (see `outbox_nats`'s source docs for why the stream
//! sequence cannot serve the contiguous watermark): assigned at delivery, not at publish, and
//! new on every redelivery. For the first delivery of a fresh stream to a fresh consumer the
//! two coincide, so checks that only read first deliveries run as written. Not run:
//!
//! * `records_round_trip_key_headers_and_value`: NATS messages have no key, header values are
//!   text (binary values cannot be written), and there is no partition 1.
//! * `commit_moves_exactly_the_given_offsets`, `a_new_member_resumes_from_the_last_commit`:
//!   they use partition 1 and Kafka's offsets; a stream is one log.
//! * `nothing_is_committed_without_a_commit_call`, `leaving_commits_the_trackers_final_offsets`:
//!   the second member sees the same messages at new delivery sequences (the properties
//!   themselves are checked by `nothing_is_acknowledged_without_a_commit` and
//!   `leaving_acks_what_the_tracker_holds_final` below, by event id).
//! * `a_member_that_lost_its_partitions_commits_nothing`: JetStream has no assignment to lose;
//!   a stalled member's late ack of a message whose effect is final is correct and accepted.
//! * `a_commit_below_the_earliest_offset_is_a_retention_gap`: JetStream skips messages removed
//!   by retention without telling the consumer (the harness cannot delete records either).
//! * `start_from_latest_skips_earlier_records_and_keeps_later_ones`: its committed offset is
//!   Kafka's end offset; `a_consumer_created_at_the_latest_message_skips_earlier_ones` below
//!   checks the behaviour.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::HeaderMap;
use common::{poll_n, require, unique, TestStream};
use futures::StreamExt;
use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{async_trait, Envelope, MessageSource, Publisher};
use outbox_inbox::{ConsumerEngine, EngineConfig, InboxProcessor, VersionPolicy};
use outbox_nats::{NatsPublisher, NatsSource, StartFrom};
use outbox_testkit::conformance::{RawRecord, SourceCapabilities, SourceHarness};

const ACK_WAIT: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------------
// The shared suite

struct SourceSuite {
    url: String,
    stream: TestStream,
    prefix: String,
    durable: String,
}

impl SourceSuite {
    async fn new(test: &str) -> Option<Self> {
        let url = common::nats_url(test)?;
        let prefix = unique("srcsuite");
        let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
        Some(Self {
            url,
            stream,
            durable: unique("durable"),
            prefix,
        })
    }

    async fn member(&self, start: StartFrom) -> NatsSource {
        NatsSource::builder(&self.url, &self.stream.name, &self.durable)
            .ack_wait(ACK_WAIT)
            .start_from(start)
            .start()
            .await
            .expect("source")
    }
}

#[async_trait]
impl SourceHarness for SourceSuite {
    type Source = NatsSource;

    fn capabilities(&self) -> SourceCapabilities {
        SourceCapabilities::broker()
            .with_null_values(false)
            .with_patience(Duration::from_secs(20))
    }

    fn topic(&self) -> String {
        self.stream.name.clone()
    }

    async fn produce(&self, partition: i32, record: RawRecord) -> i64 {
        let mut headers = HeaderMap::new();
        for h in &record.headers {
            let v = std::str::from_utf8(h.value.as_deref().unwrap_or_default())
                .expect("NATS header values are text");
            headers.append(h.name.as_str(), v);
        }
        let ack = self
            .stream
            .js
            .publish_with_headers(
                format!("{}.p{partition}", self.prefix),
                headers,
                record.value.unwrap_or_default().into(),
            )
            .await
            .expect("publish")
            .await
            .expect("PubAck");
        ack.sequence as i64
    }

    async fn join(&self) -> NatsSource {
        self.member(StartFrom::Earliest).await
    }

    async fn join_from_latest(&self) -> Option<NatsSource> {
        Some(self.member(StartFrom::Latest).await)
    }

    async fn leave(&self, member: NatsSource) {
        member.close().await;
    }

    async fn take_over(&self, member: &NatsSource) -> NatsSource {
        let _ = member;
        tokio::time::sleep(ACK_WAIT).await;
        self.join().await
    }

    async fn committed(&self, partition: i32) -> Option<i64> {
        assert_eq!(partition, 0, "a stream is one log");
        let stream = self.stream.js.get_stream(&self.stream.name).await.ok()?;
        let info = stream.consumer_info(&self.durable).await.ok()?;
        let floor = info.ack_floor.consumer_sequence;
        (floor > 0).then(|| floor as i64 + 1)
    }
}

macro_rules! suite_checks {
    ($($check:ident),* $(,)?) => {
        mod suite {
            $(
                #[test]
                fn $check() {
                    outbox_testkit::conformance::run(async {
                        if let Some(h) = super::SourceSuite::new(stringify!($check)).await {
                            outbox_testkit::conformance::source::$check(&h).await;
                        }
                    });
                }
            )*
        }
    };
}

suite_checks!(
    assignment_resets_the_attached_tracker,
    a_dropped_poll_loses_no_message,
);

// ---------------------------------------------------------------------------------------------
// What the source relies on, and its own contract in JetStream's terms

async fn fill(s: &SourceSuite, n: usize) -> Vec<Envelope> {
    let events: Vec<Envelope> = (1..=n as i64)
        .map(|v| common::event("order", "o-1", v))
        .collect();
    let publisher = NatsPublisher::builder(&s.url, &s.prefix)
        .start()
        .await
        .expect("publisher");
    for r in publisher.publish(&events.iter().collect::<Vec<_>>()).await {
        r.expect("published");
    }
    events
}

/// The source's positions are delivery sequences because the server gives every delivery,
/// redeliveries included, a higher one: if it did not, the watermark would see a rewind.
#[tokio::test]
async fn redelivery_gets_a_new_delivery_sequence() {
    let Some(s) = SourceSuite::new("redelivery_sequence").await else {
        return;
    };
    fill(&s, 2).await;
    let stream = s.stream.js.get_stream(&s.stream.name).await.unwrap();
    let consumer = stream
        .create_consumer(PullConfig {
            durable_name: Some(s.durable.clone()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut batch = consumer.fetch().max_messages(2).messages().await.unwrap();
    let mut first = Vec::new();
    while let Some(m) = batch.next().await {
        let m = m.unwrap();
        let i = m.info().unwrap();
        first.push((i.stream_sequence, i.consumer_sequence));
    }
    assert_eq!(first.len(), 2);
    // Neither is acked: both come again after the ack wait.
    tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
    let mut again = Vec::new();
    let mut batch = consumer
        .batch()
        .max_messages(2)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .unwrap();
    while let Some(m) = batch.next().await {
        let m = m.unwrap();
        let i = m.info().unwrap();
        assert_eq!(i.delivered, 2, "a redelivery");
        again.push((i.stream_sequence, i.consumer_sequence));
        m.ack().await.unwrap();
    }
    assert_eq!(
        again.iter().map(|x| x.0).collect::<Vec<_>>(),
        first.iter().map(|x| x.0).collect::<Vec<_>>()
    );
    let highest_first = first.iter().map(|x| x.1).max().unwrap();
    for (_, delivery) in &again {
        assert!(*delivery > highest_first, "{first:?} then {again:?}");
    }
}

/// Nothing is acknowledged by polling or by leaving without a tracker; a commit acknowledges
/// exactly the deliveries below its offset, confirmed by the server.
#[tokio::test]
async fn nothing_is_acknowledged_without_a_commit() {
    let Some(s) = SourceSuite::new("no_ack_without_commit").await else {
        return;
    };
    fill(&s, 3).await;
    let member = s.member(StartFrom::Earliest).await;
    let got = poll_n(&member, 3).await;
    assert_eq!(s.committed(0).await, None, "polling acknowledged");
    member
        .commit(&[got[1].position.clone().next()])
        .await
        .unwrap();
    assert_eq!(
        s.committed(0).await,
        Some(got[1].position.offset + 1),
        "exactly the first two"
    );
    assert_eq!(member.unacknowledged(), 1);
    member.close().await;
    // The third comes again (at a new delivery sequence) to the next member, at once (nak).
    let next = s.member(StartFrom::Earliest).await;
    let again = poll_n(&next, 1).await;
    assert_eq!(
        again[0].envelope.as_ref().unwrap(),
        got[2].envelope.as_ref().unwrap()
    );
    assert!(again[0].position.offset > got[2].position.offset);
}

/// On leaving, the attached tracker's final offset is acked (never past an unfinished
/// message), and every later message goes back at once (`-NAK`) to the next member. JetStream
/// does not redeliver them in stream order (seen here: the 4th and 5th before the 3rd): the
/// engine's version policy (`Hold` with `require_first_version`) keeps an aggregate in order
/// across that (`redelivered_head_is_applied_before_its_successors`).
#[tokio::test]
async fn leaving_acks_what_the_tracker_holds_final() {
    let Some(s) = SourceSuite::new("leave_with_tracker").await else {
        return;
    };
    let events = fill(&s, 5).await;
    let tracker = SharedOffsetTracker::new();
    let first = s.member(StartFrom::Earliest).await;
    first.attach_offsets(tracker.clone());
    let got = poll_n(&first, 5).await;
    {
        let mut t = tracker.lock();
        let tickets: Vec<_> = got.iter().map(|m| t.begin(&m.position)).collect();
        // Final: 0, 1 and 3; 2 still running; 4 not final.
        for i in [0, 1, 3] {
            t.finish(&tickets[i]);
        }
    }
    first.close().await;
    assert_eq!(s.committed(0).await, Some(got[2].position.offset));
    let second = s.member(StartFrom::Earliest).await;
    let started = Instant::now();
    let again = poll_n(&second, 3).await;
    assert!(
        started.elapsed() < ACK_WAIT,
        "given back at once, not after the ack wait"
    );
    let mut ids: Vec<_> = again
        .iter()
        .map(|m| m.envelope.as_ref().unwrap().event_id)
        .collect();
    ids.sort();
    let mut expected: Vec<_> = events[2..].iter().map(|e| e.event_id).collect();
    expected.sort();
    assert_eq!(ids, expected);
}

/// A redelivery of a message still being applied by this member is not handed out twice: the
/// engine never sees a copy of work it has in flight.
#[tokio::test]
async fn a_redelivery_of_a_message_in_flight_is_not_handed_out_again() {
    let Some(s) = SourceSuite::new("inflight_redelivery").await else {
        return;
    };
    fill(&s, 1).await;
    let member = s.member(StartFrom::Earliest).await;
    let got = poll_n(&member, 1).await;
    // Its ack wait runs out while "applying".
    let deadline = Instant::now() + ACK_WAIT * 3;
    while Instant::now() < deadline {
        if let Some(m) = member.poll(Duration::from_millis(200)).await.unwrap() {
            panic!("handed out again at {}", m.position);
        }
    }
    // The ack of the one message (through its newest delivery) settles it.
    member
        .commit(&[got[0].position.clone().next()])
        .await
        .unwrap();
    let stream = s.stream.js.get_stream(&s.stream.name).await.unwrap();
    let info = stream.consumer_info(&s.durable).await.unwrap();
    assert_eq!((info.num_ack_pending, info.num_pending), (0, 0), "{info:?}");
}

#[tokio::test]
async fn a_consumer_created_at_the_latest_message_skips_earlier_ones() {
    let Some(s) = SourceSuite::new("start_latest").await else {
        return;
    };
    fill(&s, 2).await;
    let member = s.member(StartFrom::Latest).await;
    let nothing = member.poll(Duration::from_millis(500)).await.unwrap();
    assert!(nothing.is_none(), "{nothing:?}");
    let later = fill(&s, 1).await;
    let got = poll_n(&member, 1).await;
    assert_eq!(got[0].envelope.as_ref().unwrap(), &later[0]);
}

// ---------------------------------------------------------------------------------------------
// The inbox engine end to end on PostgreSQL

use common::inbox::{Db, Effects};

fn engine_config() -> EngineConfig {
    EngineConfig::default()
        .with_commit(50, Duration::from_millis(200))
        .with_max_batch(20)
}

/// Events of 10 aggregates, each version published once and some twice more (copies outside
/// the duplicate window, as after long outages): the engine applies each effect once, in
/// version order per aggregate, across a consumer that is dropped mid-way without committing
/// (a crash) and a second one that takes over; at the end nothing is left unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_applies_each_event_once_in_order_across_a_crash() {
    let url = require!(common::nats_url("nats_engine_crash"));
    let db = require!(common::inbox_db("nats_engine_crash").await);
    let prefix = unique("engine");
    let stream = TestStream::create(
        &url,
        &prefix,
        &[format!("{prefix}.>")],
        Some(Duration::from_millis(100)),
        None,
    )
    .await;
    let durable = unique("inbox");
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let aggregates: Vec<String> = (0..10).map(|i| format!("agg-{i}")).collect();
    let mut total = 0;
    for v in 1..=6 {
        let round: Vec<Envelope> = aggregates
            .iter()
            .map(|a| common::event("order", a, v))
            .collect();
        for r in publisher.publish(&round.iter().collect::<Vec<_>>()).await {
            r.unwrap();
        }
        total += round.len();
        if v % 2 == 0 {
            // Copies, stored again (the window is 100 ms): duplicates for the inbox.
            tokio::time::sleep(Duration::from_millis(150)).await;
            for r in publisher.publish(&round.iter().collect::<Vec<_>>()).await {
                r.unwrap();
            }
        }
    }
    let applied = Arc::new(AtomicUsize::new(0));
    let processor = |db: &Db, inbox| {
        InboxProcessor::new(
            "nats-engine",
            inbox,
            Effects {
                schema: db.schema.clone(),
                applied: applied.clone(),
            },
        )
        .with_version_policy(VersionPolicy::hold(100, Duration::from_secs(30)))
        .require_first_version(true)
    };
    // First member: stops (dropped, no final commit) after a part of the work.
    {
        let source = NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ACK_WAIT)
            .start()
            .await
            .unwrap();
        let mut engine =
            ConsumerEngine::new(source, processor(&db, db.inbox().await), engine_config(), 7)
                .unwrap();
        while applied.load(Ordering::Relaxed) < total / 3 {
            engine.step().await.unwrap();
        }
    }
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .ack_wait(ACK_WAIT)
        .start()
        .await
        .unwrap();
    let mut engine =
        ConsumerEngine::new(source, processor(&db, db.inbox().await), engine_config(), 8).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (db.effects_once().await as usize) < total {
        assert!(Instant::now() < deadline, "not all effects applied");
        engine
            .run_until_quiet(Duration::from_millis(300))
            .await
            .unwrap();
    }
    // Redeliveries of what the crashed member held arrive after the ack wait: let them come.
    tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
    engine
        .run_until_quiet(Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(db.effects_once().await as usize, total);
    for a in &aggregates {
        assert_eq!(db.applied(a).await, (1..=6).collect::<Vec<i64>>(), "{a}");
    }
    let js = common::js(&url).await;
    let info = js
        .get_stream(&stream.name)
        .await
        .unwrap()
        .consumer_info(&durable)
        .await
        .unwrap();
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (0, 0),
        "everything acknowledged: {info:?}"
    );
}

/// JetStream redelivers an unacknowledged message after later ones were delivered: member X
/// took version 1 of an aggregate and died without acking; the engine's member gets versions
/// 2 and 3 first, holds them (version policy `Hold`, first version required), and applies
/// 1, 2, 3 in order once version 1 is redelivered after its ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivered_head_is_applied_before_its_successors() {
    let url = require!(common::nats_url("nats_redelivered_head"));
    let db = require!(common::inbox_db("nats_redelivered_head").await);
    let prefix = unique("head");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let v1 = common::event("order", "a-1", 1);
    publisher.publish(&[&v1]).await.remove(0).unwrap();
    // Member X: a plain consumer on the same durable takes version 1 and never acks it.
    let taken = {
        let source = NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ACK_WAIT)
            .pull_batch(1)
            .max_ack_pending(100)
            .start()
            .await
            .unwrap();
        let got = poll_n(&source, 1).await;
        got[0].envelope.clone().unwrap()
        // Dropped without ack or nak: a crash.
    };
    assert_eq!(taken, v1);
    let later: Vec<Envelope> = (2..=3).map(|v| common::event("order", "a-1", v)).collect();
    for r in publisher.publish(&later.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let applied = Arc::new(AtomicUsize::new(0));
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .ack_wait(ACK_WAIT)
        .start()
        .await
        .unwrap();
    let processor = InboxProcessor::new(
        "nats-head",
        db.inbox().await,
        Effects {
            schema: db.schema.clone(),
            applied: applied.clone(),
        },
    )
    .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(30)))
    .require_first_version(true);
    let mut engine = ConsumerEngine::new(source, processor, engine_config(), 3).unwrap();
    let tracker: SharedOffsetTracker = engine.offset_tracker();
    let deadline = Instant::now() + ACK_WAIT * 10;
    while applied.load(Ordering::Relaxed) < 3 {
        assert!(Instant::now() < deadline, "version 1 never came back");
        engine.step().await.unwrap();
    }
    engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(db.applied("a-1").await, vec![1, 2, 3]);
    assert_eq!(engine.report().applied, 3);
    assert_eq!(tracker.lock().in_flight(), 0);
}

/// The server goes away under a running engine (a nats-server of this test's own, killed and
/// started again with its file storage): polls fail transiently, the pull stream is opened
/// again, unacknowledged messages come again after their ack wait, and every effect is applied
/// once, in order, with nothing left unacknowledged at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_survives_a_server_restart_with_each_effect_once() {
    let bin = require!(outbox_test_support::nats_server_bin("nats_source_restart"));
    let db = require!(common::inbox_db("nats_source_restart").await);
    let mut server = outbox_test_support::NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("srcrestart");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let aggregates: Vec<String> = (0..10).map(|i| format!("agg-{i}")).collect();
    for v in 1..=6 {
        let round: Vec<Envelope> = aggregates
            .iter()
            .map(|a| common::event("order", a, v))
            .collect();
        for r in publisher.publish(&round.iter().collect::<Vec<_>>()).await {
            r.unwrap();
        }
    }
    let total = aggregates.len() * 6;
    let applied = Arc::new(AtomicUsize::new(0));
    let processor = InboxProcessor::new(
        "nats-restart",
        db.inbox().await,
        Effects {
            schema: db.schema.clone(),
            applied: applied.clone(),
        },
    )
    .with_version_policy(VersionPolicy::hold(100, Duration::from_secs(30)))
    .require_first_version(true);
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .ack_wait(ACK_WAIT)
        .pull_batch(10)
        .connect_timeout(Duration::from_millis(500))
        .start()
        .await
        .unwrap();
    let config = EngineConfig::default()
        .with_commit(10, Duration::from_millis(100))
        .with_max_batch(5);
    let mut engine = ConsumerEngine::new(source, processor, config, 12).unwrap();
    while applied.load(Ordering::Relaxed) < total / 3 {
        engine.step().await.unwrap();
    }
    server.stop();
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(3) {
        engine.step().await.unwrap();
    }
    server.restart();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (db.effects_once().await as usize) < total {
        assert!(
            Instant::now() < deadline,
            "not all effects applied after the restart"
        );
        engine
            .run_until_quiet(Duration::from_millis(300))
            .await
            .unwrap();
    }
    // Acks sent while the server was down (or forgotten when the log rewound) are settled by
    // the redelivery of those messages after the ack wait: the engine takes them as duplicates
    // and acknowledges them. How soon the restarted server redelivers varies with the load, so
    // keep the engine running until the consumer has nothing pending (bounded).
    let js = common::js(&url).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let info = loop {
        tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
        engine
            .run_until_quiet(Duration::from_secs(1))
            .await
            .unwrap();
        let info = js
            .get_stream(&stream.name)
            .await
            .unwrap()
            .consumer_info(&durable)
            .await
            .unwrap();
        if (info.num_ack_pending, info.num_pending) == (0, 0) || Instant::now() > deadline {
            break info;
        }
    };
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (0, 0),
        "everything acknowledged: {info:?}"
    );
    assert_eq!(db.effects_once().await as usize, total);
    for a in &aggregates {
        assert_eq!(db.applied(a).await, (1..=6).collect::<Vec<i64>>(), "{a}");
    }
    assert_eq!(engine.report().parked, 0);
}

/// The consumer's state file under `dir` (a [`outbox_test_support::NatsServer`]'s storage):
/// `jetstream/$G/streams/<stream>/obs/<durable>/o.dat`.
fn consumer_state_file(dir: &std::path::Path, stream: &str, durable: &str) -> std::path::PathBuf {
    dir.join("jetstream")
        .join("$G")
        .join("streams")
        .join(stream)
        .join("obs")
        .join(durable)
        .join("o.dat")
}

/// The consumer's delivery sequence goes back under a running engine. A nats-server of this
/// test's own is killed while the engine has applied ten events and holds version 2 of `h`
/// (version 1 not published yet), and it comes back with the consumer state it had written
/// before anything was delivered (a crash loses what the server wrote of a consumer's state
/// since the disk last synced it: the test puts back that earlier state file). The server
/// then delivers the stream again from sequence 1 at delivery sequences 1, 2, ...: version 2
/// of `h` (still held here, at delivery 11) among them, at the same numbers. Version 1 of `h`
/// is published afterwards: both versions of `h` are applied once, in order, every other
/// event once, and nothing is left unacknowledged. (The source kept its deliveries keyed by
/// the old numbers: the engine took the first new delivery for a rewind and forgot the held
/// version 2, the source did not, and the commit after version 1 acknowledged version 2
/// without its effect.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_sequence_that_goes_back_after_a_restart_loses_nothing() {
    let bin = require!(outbox_test_support::nats_server_bin("nats_source_seq_back"));
    let db = require!(common::inbox_db("nats_source_seq_back").await);
    let mut server = outbox_test_support::NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("seqback");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let member = || {
        NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ACK_WAIT)
            .connect_timeout(Duration::from_millis(500))
            .start()
    };
    // The consumer, created before anything is published: its state as written then.
    drop(member().await.unwrap());
    let state_file = consumer_state_file(server.storage_dir(), &stream.name, &durable);
    server.stop();
    let early_state = std::fs::read(&state_file).ok();
    server.restart();

    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let mut first: Vec<Envelope> = (0..10)
        .map(|i| common::event("order", &format!("f-{i}"), 1))
        .collect();
    first.push(common::event("order", "h", 2));
    for r in publisher.publish(&first.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let applied = Arc::new(AtomicUsize::new(0));
    let processor = InboxProcessor::new(
        "nats-seq-back",
        db.inbox().await,
        Effects {
            schema: db.schema.clone(),
            applied: applied.clone(),
        },
    )
    .with_version_policy(VersionPolicy::hold(100, Duration::from_secs(120)))
    .require_first_version(true);
    let config = EngineConfig::default()
        .with_commit(10, Duration::from_millis(100))
        .with_max_batch(5);
    let mut engine = ConsumerEngine::new(member().await.unwrap(), processor, config, 21).unwrap();
    let consumer_info = |url: String| {
        let (stream, durable) = (stream.name.clone(), durable.clone());
        async move {
            common::js(&url)
                .await
                .get_stream(&stream)
                .await
                .expect("stream")
                .consumer_info(&durable)
                .await
                .expect("consumer info")
        }
    };
    // Ten applied and acknowledged, version 2 of `h` held (the server's only pending one).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        engine.step().await.unwrap();
        if applied.load(Ordering::Relaxed) == 10 && engine.report().held == 1 {
            let info = consumer_info(url.clone()).await;
            if info.num_ack_pending == 1 && info.ack_floor.stream_sequence == 10 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the ten were not acknowledged");
    }

    server.stop();
    match &early_state {
        Some(bytes) => std::fs::write(&state_file, bytes).expect("write the consumer state"),
        None => std::fs::remove_file(&state_file).expect("remove the consumer state"),
    }
    server.restart();
    // (The client may pull again as soon as it reconnects: only the acks are sure to be
    // gone before the engine steps again.)
    let info = consumer_info(url.clone()).await;
    assert_eq!(
        info.ack_floor.stream_sequence, 0,
        "the consumer's state went back to before the first delivery: {info:?}"
    );
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    publisher
        .publish(&[&common::event("order", "h", 1)])
        .await
        .remove(0)
        .unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    let info = loop {
        engine
            .run_until_quiet(Duration::from_millis(300))
            .await
            .unwrap();
        let info = consumer_info(url.clone()).await;
        let done =
            db.effects_once().await == 12 && (info.num_ack_pending, info.num_pending) == (0, 0);
        if done || Instant::now() > deadline {
            break info;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        db.applied("h").await,
        vec![1, 2],
        "both versions of h applied, in order (server: {info:?}; engine: {:?})",
        engine.report()
    );
    for i in 0..10 {
        assert_eq!(db.applied(&format!("f-{i}")).await, vec![1], "f-{i}");
    }
    assert_eq!(db.effects_once().await, 12);
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (0, 0),
        "everything acknowledged: {info:?}"
    );
    assert!(
        engine.report().rewinds >= 1,
        "the engine saw the delivery sequence go back: {:?}",
        engine.report()
    );
}

/// An ack ahead of a position handed out before the numbering started over acknowledges
/// nothing that holds its number now. A nats-server of this test's own; `m0` is handed out at
/// delivery 1 and redelivered at delivery 2 (ack wait; still in flight here), `m1` is handed
/// out at delivery 3. The server comes back with the consumer state it had before anything was
/// delivered (see the test above): `m0` and `m1` come again at deliveries 1 and 2, and `m2`,
/// published then, at delivery 3. The engine's ack ahead of `m1`'s old position (delivery 3)
/// must not acknowledge `m2`, which is not final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_ahead_of_an_old_numbering_acknowledges_no_other_message() {
    use outbox_core::Classify as _;
    let bin = require!(outbox_test_support::nats_server_bin("nats_source_old_ack"));
    let mut server = outbox_test_support::NatsServer::start(bin);
    let url = server.url();
    let prefix = unique("oldack");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let member = || {
        NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ACK_WAIT)
            .pull_batch(1)
            .connect_timeout(Duration::from_millis(500))
            .start()
    };
    drop(member().await.unwrap());
    let state_file = consumer_state_file(server.storage_dir(), &stream.name, &durable);
    server.stop();
    let early_state = std::fs::read(&state_file).ok();
    server.restart();
    let publish = |i: usize| {
        let js = stream.js.clone();
        let subject = format!("{prefix}.m");
        async move {
            js.publish(subject, format!("m{i}").into())
                .await
                .expect("publish")
                .await
                .expect("PubAck");
        }
    };
    publish(0).await;
    let source = member().await.unwrap();
    let m0 = poll_n(&source, 1).await.remove(0);
    assert_eq!(m0.position.offset, 1);
    // m0's ack wait runs out: redelivered at delivery 2 (not handed out again).
    tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
    publish(1).await;
    let m1 = poll_n(&source, 1).await.remove(0);
    assert_eq!(
        (m1.position.offset, stream_seq(&m1.position)),
        (3, 2),
        "m0 came again at delivery 2: {}",
        m1.position
    );

    server.stop();
    match &early_state {
        Some(bytes) => std::fs::write(&state_file, bytes).expect("write the consumer state"),
        None => std::fs::remove_file(&state_file).expect("remove the consumer state"),
    }
    server.restart();
    publish(2).await;
    // (Polls fail transiently until the client has reconnected.)
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen: Vec<(i64, u64)> = Vec::new();
    while seen.len() < 3 {
        assert!(Instant::now() < deadline, "only {seen:?}");
        match source.poll(Duration::from_millis(200)).await {
            Ok(Some(m)) => seen.push((m.position.offset, stream_seq(&m.position))),
            Ok(None) => {}
            Err(e) => assert!(e.is_transient(), "{e}"),
        }
    }
    assert_eq!(
        seen,
        vec![(1, 1), (2, 2), (3, 3)],
        "the numbering started over: m0, m1, m2 at deliveries 1, 2, 3"
    );
    source
        .ack_ahead(std::slice::from_ref(&m1.position))
        .await
        .unwrap();
    let info = common::js(&url)
        .await
        .get_stream(&stream.name)
        .await
        .unwrap()
        .consumer_info(&durable)
        .await
        .unwrap();
    assert_eq!(
        (info.num_ack_pending, source.unacknowledged()),
        (3, 3),
        "nothing acknowledged by the old position: {info:?}"
    );
}

fn stream_seq(p: &outbox_core::LogPosition) -> u64 {
    match p.native {
        outbox_core::NativePosition::JetStream {
            stream_sequence, ..
        } => stream_sequence,
        _ => panic!("not a JetStream position: {p}"),
    }
}
