//! What JetStream's redeliveries (a new delivery sequence for the same stream sequence) do to
//! the inbox engine, against a real NATS server and the real PostgreSQL inbox:
//!
//! * an undecodable message redelivered after a crash is parked once, not once per delivery
//!   (it is parked by its stream sequence, not by its delivery sequence);
//! * final messages behind an aggregate held for a missing version are acknowledged ahead of
//!   the watermark, so the server does not redeliver them at every ack wait while the
//!   aggregate waits; the held message itself stays unacknowledged.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::Info as ConsumerInfo;
use common::inbox::Effects;
use common::{require, unique, TestStream};
use outbox_core::{Envelope, InboxParking, ParkedFilter, ParkedStatus, Publisher};
use outbox_inbox::{ConsumerEngine, EngineConfig, InboxProcessor, VersionPolicy};
use outbox_nats::{NatsPublisher, NatsSource};

/// The shortest ack wait the source accepts.
const ACK_WAIT: Duration = Duration::from_secs(1);

async fn consumer_info(url: &str, stream: &str, durable: &str) -> ConsumerInfo {
    common::js(url)
        .await
        .get_stream(stream)
        .await
        .expect("stream")
        .consumer_info(durable)
        .await
        .expect("consumer info")
}

/// An undecodable message (no envelope headers, no aggregate) is parked by a member that then
/// crashes before acknowledging it (no commit: the commit cadence is an hour). JetStream
/// redelivers it after the ack wait at a new delivery sequence; the next member finds it
/// parked already. Exactly one parked copy, and it is acknowledged at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_redelivered_after_a_crash_is_parked_once() {
    let url = require!(common::nats_url("nats_undecodable_once"));
    let db = require!(common::inbox_db("nats_undecodable_once").await);
    let prefix = unique("undec");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let durable = unique("inbox");
    stream
        .js
        .publish(format!("{prefix}.junk"), "not an envelope".into())
        .await
        .expect("publish")
        .await
        .expect("PubAck");
    let consumer = "nats-undecodable";
    let inbox = db.inbox().await;
    let processor = || {
        InboxProcessor::new(
            consumer,
            inbox.clone(),
            Effects {
                schema: db.schema.clone(),
                applied: Arc::new(AtomicUsize::new(0)),
            },
        )
    };
    let member = || {
        NatsSource::builder(&url, &stream.name, &durable)
            .ack_wait(ACK_WAIT)
            .start()
    };
    let no_commit = EngineConfig::default().with_commit(10_000, Duration::from_secs(3600));
    {
        let mut engine = ConsumerEngine::new(member().await.unwrap(), processor(), no_commit, 1)
            .expect("engine");
        let deadline = Instant::now() + Duration::from_secs(20);
        while engine.report().parked < 1 {
            assert!(Instant::now() < deadline, "nothing parked");
            engine.step().await.unwrap();
        }
        assert_eq!(engine.report().commits, 0, "crashes before any ack");
        // Dropped: a crash after the parking transaction committed, before the ack.
    }
    tokio::time::sleep(ACK_WAIT + Duration::from_millis(500)).await;
    let mut engine = ConsumerEngine::new(
        member().await.unwrap(),
        processor(),
        EngineConfig::default().with_commit(1, Duration::from_millis(100)),
        2,
    )
    .expect("engine");
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.report().received < 1 {
        assert!(Instant::now() < deadline, "the message was not redelivered");
        engine.step().await.unwrap();
    }
    let report = engine
        .run_until_quiet(Duration::from_millis(300))
        .await
        .unwrap();
    let parked = inbox
        .list_parked(consumer, &ParkedFilter::open().all())
        .await
        .unwrap();
    assert_eq!(
        parked.len(),
        1,
        "one parked copy of the message: {:#?}",
        parked
            .iter()
            .map(|m| m.record.position.to_string())
            .collect::<Vec<_>>()
    );
    assert_eq!(parked[0].status, ParkedStatus::Parked);
    assert_eq!(
        parked[0].record.value.as_deref(),
        Some(&b"not an envelope"[..])
    );
    assert_eq!((report.parked, report.already_parked), (0, 1), "{report:?}");
    let info = consumer_info(&url, &stream.name, &durable).await;
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (0, 0),
        "acknowledged once parked: {info:?}"
    );
}

/// Version 2 of aggregate `h` arrives without version 1 and is held (`Hold`, first version
/// required, for a minute); five events of other aggregates arrive behind it and are applied.
/// The watermark stays at version 2's delivery, but the applied ones are acknowledged ahead
/// of it: after several ack waits the server holds only version 2 unacknowledged and has
/// redelivered nothing else. Version 2 is neither applied nor acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn final_messages_behind_a_held_aggregate_are_not_redelivered() {
    let url = require!(common::nats_url("nats_ack_ahead"));
    let db = require!(common::inbox_db("nats_ack_ahead").await);
    let prefix = unique("ahead");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    let durable = unique("inbox");
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let mut events: Vec<Envelope> = vec![common::event("order", "h", 2)];
    events.extend((0..5).map(|i| common::event("order", &format!("f-{i}"), 1)));
    for r in publisher.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let applied = Arc::new(AtomicUsize::new(0));
    let processor = InboxProcessor::new(
        "nats-ack-ahead",
        db.inbox().await,
        Effects {
            schema: db.schema.clone(),
            applied: applied.clone(),
        },
    )
    .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(60)))
    .require_first_version(true);
    let source = NatsSource::builder(&url, &stream.name, &durable)
        .ack_wait(ACK_WAIT)
        .start()
        .await
        .unwrap();
    let config = EngineConfig::default().with_commit(1, Duration::from_millis(100));
    let mut engine = ConsumerEngine::new(source, processor, config, 5).expect("engine");
    let deadline = Instant::now() + Duration::from_secs(20);
    while applied.load(Ordering::Relaxed) < 5 {
        assert!(
            Instant::now() < deadline,
            "the later events were not applied"
        );
        engine.step().await.unwrap();
    }
    // Three ack waits with the engine running: what is unacknowledged comes again.
    let until = Instant::now() + ACK_WAIT * 3;
    while Instant::now() < until {
        engine.step().await.unwrap();
    }
    assert_eq!(engine.report().held, 1, "{:?}", engine.report());
    assert!(db.applied("h").await.is_empty(), "version 2 waits");
    let info = consumer_info(&url, &stream.name, &durable).await;
    assert_eq!(
        info.num_ack_pending, 1,
        "only the held version 2 is unacknowledged: {info:?}"
    );
    assert!(
        info.num_redelivered <= 1,
        "nothing but the held version 2 redelivered: {info:?}"
    );
    assert_eq!(engine.offset_tracker().lock().in_flight(), 1);
}
