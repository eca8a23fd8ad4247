//! What a [`NatsSource`] delivery is called, against a real NATS server: the engine orders and
//! commits by the consumer's delivery sequence, the message keeps its stream sequence and the
//! durable consumer as its native identity (in the parked table too, on the real PostgreSQL
//! inbox), and JetStream's per-message acks under the engine's one watermark hold an
//! aggregate behind a redelivered message without acknowledging what waits behind it.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::inbox::{park_version_2, Effects};
use common::{poll_n, require, unique};
use outbox_core::{
    AckMetadata, AckModel, Envelope, LogPosition, MessageSource, NativePosition, Publisher,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, InboxProcessor, VersionPolicy};
use outbox_nats::{NatsPublisher, NatsSource};

const ACK_WAIT: Duration = Duration::from_secs(2);

/// Publishes `events` and returns the stream sequence of each (from its `PubAck`).
async fn publish(publisher: &NatsPublisher, events: &[Envelope]) -> Vec<u64> {
    publisher
        .publish(&events.iter().collect::<Vec<_>>())
        .await
        .into_iter()
        .map(|r| match r.expect("published") {
            AckMetadata::JetStream { sequence, .. } => sequence,
            other => panic!("not a PubAck: {other:?}"),
        })
        .collect()
}

fn stream_sequence(p: &LogPosition) -> u64 {
    match &p.native {
        NativePosition::JetStream {
            stream_sequence, ..
        } => *stream_sequence,
        other => panic!("not a JetStream position: {other:?} at {p}"),
    }
}

/// A delivery is ordered by its delivery sequence and named by its stream sequence and the
/// durable consumer; a redelivery (the first member died holding it) keeps the stream
/// sequence at a new, higher delivery sequence.
#[tokio::test]
async fn a_delivery_names_its_stream_sequence_and_consumer() {
    let url = require!(common::nats_url("nats_position_native"));
    let prefix = unique("pos");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "durable").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    // Stream sequences start past messages of other aggregates, so they differ from the
    // delivery sequences of a fresh consumer.
    publish(&publisher, &[common::event("other", "x", 1)]).await;
    let events: Vec<Envelope> = (1..=3).map(|v| common::event("order", "o-1", v)).collect();
    let seqs = publish(&publisher, &events).await;
    let member = |filter: String| {
        NatsSource::builder(&url, &stream.name, &durable)
            .filter_subject(filter)
            .ack_wait(ACK_WAIT)
            .start()
    };
    let filter = format!("{prefix}.order");
    let first = member(filter.clone()).await.unwrap();
    assert_eq!(first.ack_model(), AckModel::PerMessage);
    let got = poll_n(&first, 3).await;
    for (i, m) in got.iter().enumerate() {
        let p = &m.position;
        assert_eq!(m.envelope.as_ref().unwrap(), &events[i]);
        assert_eq!((p.topic.as_str(), p.partition), (stream.name.as_str(), 0));
        assert_eq!(p.offset, i as i64 + 1, "ordered by delivery sequence");
        assert_eq!(
            p.native,
            NativePosition::JetStream {
                stream_sequence: seqs[i],
                consumer: durable.clone(),
            }
        );
        assert_eq!(
            p.to_string(),
            format!(
                "stream {} seq {} (delivery {}, consumer {durable})",
                stream.name,
                seqs[i],
                i + 1
            )
        );
    }
    assert_ne!(seqs[0], 1, "stream and delivery sequences differ here");
    drop(first); // a crash: nothing acknowledged
    tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
    let second = member(filter).await.unwrap();
    let again = poll_n(&second, 3).await;
    let mut by_stream: Vec<(u64, i64)> = again
        .iter()
        .map(|m| (stream_sequence(&m.position), m.position.offset))
        .collect();
    by_stream.sort_unstable();
    assert_eq!(
        by_stream.iter().map(|x| x.0).collect::<Vec<_>>(),
        seqs,
        "same messages"
    );
    assert!(
        by_stream.iter().all(|x| x.1 > 3),
        "new delivery sequences: {by_stream:?}"
    );
    second.close().await;
}

/// A message the handler refuses is parked with its native identity: an operator reading the
/// parked table (or `outbox parked show --consumer`) sees the stream sequence, not only the
/// delivery sequence that means nothing outside the member that received it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_keeps_its_stream_sequence() {
    let url = require!(common::nats_url("nats_position_parked"));
    let db = require!(common::inbox_db("nats_position_parked").await);
    let prefix = unique("parkpos");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    publish(&publisher, &[common::event("other", "x", 1)]).await;
    let events: Vec<Envelope> = (1..=3).map(|v| common::event("order", "p-1", v)).collect();
    let seqs = publish(&publisher, &events).await;
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .filter_subject(format!("{prefix}.order"))
        .ack_wait(ACK_WAIT)
        .start()
        .await
        .unwrap();
    let (head, waiting) = park_version_2(&db, source, "nats-parked-position", "p-1").await;
    let p = &head.record.position;
    assert_eq!(p.topic, stream.name);
    assert_eq!(p.offset, 2, "delivery sequence of version 2");
    assert_eq!(
        p.native,
        NativePosition::JetStream {
            stream_sequence: seqs[1],
            consumer: durable.clone(),
        },
        "{p}"
    );
    assert!(
        p.to_string()
            .starts_with(&format!("stream {} seq {} ", stream.name, seqs[1])),
        "{p}"
    );
    // Version 3 waits behind it, with its own identity.
    assert_eq!(stream_sequence(&waiting.record.position), seqs[2]);
}

/// JetStream redelivers an unacknowledged message after later ones were delivered. Member X
/// takes version 1 of an aggregate and dies without acking; the engine's member gets versions
/// 2 and 3 first and holds them (`Hold`, first version required). Under the one watermark
/// (per-message acks of every delivery below it) neither is acknowledged while held, nothing
/// is applied out of order, and once version 1 comes again (a newer delivery, not a rewind)
/// 1, 2, 3 are applied in order and every delivery is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_head_holds_its_aggregate_unacknowledged() {
    let url = require!(common::nats_url("nats_position_hold"));
    let db = require!(common::inbox_db("nats_position_hold").await);
    let prefix = unique("hold");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    // The next member takes over once X's lease expired (3 s, X crashed holding it): the ack
    // wait leaves it time to get versions 2 and 3 before version 1 comes again.
    let ack_wait = Duration::from_secs(10);
    let lease_ttl = Duration::from_secs(3);
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let v1 = common::event("order", "h-1", 1);
    let seq1 = publish(&publisher, std::slice::from_ref(&v1)).await[0];
    let taken_at = Instant::now();
    {
        let x = NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ack_wait)
            .pull_batch(1)
            .max_ack_pending(100)
            .lease_ttl(lease_ttl)
            .start()
            .await
            .unwrap();
        let got = poll_n(&x, 1).await;
        assert_eq!(got[0].envelope.as_ref().unwrap(), &v1);
        // Dropped without ack or nak: a crash.
    }
    let later: Vec<Envelope> = (2..=3).map(|v| common::event("order", "h-1", v)).collect();
    publish(&publisher, &later).await;
    let applied = Arc::new(AtomicUsize::new(0));
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .ack_wait(ack_wait)
        .lease_ttl(lease_ttl)
        .start()
        .await
        .unwrap();
    let processor = InboxProcessor::new(
        "nats-hold",
        db.inbox().await,
        Effects {
            schema: db.schema.clone(),
            applied: applied.clone(),
        },
    )
    .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(30)))
    .require_first_version(true);
    let config = EngineConfig::default().with_commit(1, Duration::from_millis(50));
    let mut engine = ConsumerEngine::new(source, processor, config, 3).unwrap();
    let tracker = engine.offset_tracker();
    // Versions 2 and 3 arrive and are held; commits run meanwhile.
    while tracker.lock().in_flight() < 2 {
        assert!(
            taken_at.elapsed() < ack_wait / 2,
            "versions 2 and 3 not delivered in time"
        );
        engine.step().await.unwrap();
    }
    for _ in 0..5 {
        engine.step().await.unwrap();
    }
    assert!(taken_at.elapsed() < ack_wait, "the test was too slow");
    let js = common::js(&url).await;
    let consumer = || async {
        js.get_stream(&stream.name)
            .await
            .unwrap()
            .consumer_info(&durable)
            .await
            .unwrap()
    };
    let held = consumer().await;
    assert_eq!(
        applied.load(Ordering::Relaxed),
        0,
        "nothing applied out of order"
    );
    assert_eq!(
        (held.num_ack_pending, held.ack_floor.stream_sequence),
        (3, 0),
        "versions 2 and 3 held unacknowledged behind version 1: {held:?}"
    );
    let deadline = Instant::now() + ack_wait * 5;
    while applied.load(Ordering::Relaxed) < 3 {
        assert!(Instant::now() < deadline, "version 1 never came back");
        engine.step().await.unwrap();
    }
    engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(db.applied("h-1").await, vec![1, 2, 3]);
    assert_eq!(tracker.lock().rewinds(), 0, "a redelivery is no rewind");
    let done = consumer().await;
    assert_eq!(
        (done.num_ack_pending, done.num_pending),
        (0, 0),
        "everything acknowledged: {done:?}"
    );
    assert!(done.ack_floor.stream_sequence >= seq1 + 2, "{done:?}");
}
