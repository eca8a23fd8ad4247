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

use common::inbox::Effects;
use common::{consumer_info, require, unique, TestStream};
use outbox_core::{
    Classify, Envelope, InboxParking, MessageSource, ParkedFilter, ParkedStatus, Publisher,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, InboxProcessor, VersionPolicy};
use outbox_nats::{NatsPublisher, NatsSource};

/// The shortest ack wait the source accepts.
const ACK_WAIT: Duration = Duration::from_secs(1);

/// An undecodable message (no envelope headers, no aggregate) is parked by a member that then
/// crashes before acknowledging it (no commit: the commit cadence is an hour). JetStream
/// redelivers it after the ack wait at a new delivery sequence; the next member finds it
/// parked already. Exactly one parked copy, and it is acknowledged at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_redelivered_after_a_crash_is_parked_once() {
    let url = require!(common::nats_url("nats_undecodable_once"));
    let db = require!(common::inbox_db("nats_undecodable_once").await);
    let prefix = unique("undec");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
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
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
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

/// Seven messages read by a source through a proxy of the test's own, with acks ahead lost in
/// a network partition: the first (`held`) stands for the head of a held aggregate (never
/// final, never acknowledged), the next five were handed to `ack_ahead` while the partition
/// black-holed the acks, the last (`later`) is not final yet. The partition is healed on
/// return; the server holds all seven unacknowledged.
struct LostAcksAhead {
    stream: TestStream,
    durable: String,
    // The proxy outlives the source (declared after it: dropped after it).
    source: NatsSource,
    _proxy: common::proxy::Proxy,
    later: outbox_core::LogPosition,
}

async fn acks_ahead_lost_in_a_partition(test: &str, ack_wait: Duration) -> Option<LostAcksAhead> {
    let url = common::nats_url(test)?;
    let prefix = unique("lostahead");
    let stream = TestStream::create(&url, &prefix, &[format!("{prefix}.>")], None, None).await;
    for i in 0..7 {
        stream
            .js
            .publish(format!("{prefix}.m"), format!("m{i}").into())
            .await
            .expect("publish")
            .await
            .expect("PubAck");
    }
    let proxy = common::proxy::Proxy::start(&common::upstream(&url));
    let durable = unique("inbox");
    let source = NatsSource::builder(proxy.url(), &stream.name, &durable)
        .ack_wait(ack_wait)
        .connect_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let got = common::poll_n(&source, 7).await;
    let finals: Vec<_> = got[1..6].iter().map(|m| m.position.clone()).collect();
    proxy.partition();
    let lost = source.ack_ahead(&finals).await;
    proxy.heal();
    assert!(
        lost.is_err(),
        "the acks ahead went into the partition and were not confirmed"
    );
    let info = consumer_info(&url, &stream.name, &durable).await;
    assert_eq!(
        info.num_ack_pending, 7,
        "nothing acknowledged yet: {info:?}"
    );
    Some(LostAcksAhead {
        stream,
        durable,
        source,
        _proxy: proxy,
        later: got[6].position.clone(),
    })
}

/// Acks ahead lost in a network partition: once the link is back, the server redelivers the
/// five final messages after the ack wait. The source holds them as final, so it acknowledges
/// each redelivery at once instead of dropping it as "in flight here" (which left them
/// unacknowledged, redelivered at every ack wait until a watermark passed them). Nothing is
/// handed out again; at the end the server holds only the two messages that are not final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_of_a_final_message_whose_ack_was_lost_is_acknowledged() {
    let Some(lost) = acks_ahead_lost_in_a_partition("nats_lost_ack_redelivered", ACK_WAIT).await
    else {
        return;
    };
    let url = common::nats_url("nats_lost_ack_redelivered").expect("checked above");
    let until = Instant::now() + ACK_WAIT * 5;
    while Instant::now() < until {
        match lost.source.poll(Duration::from_millis(200)).await {
            Ok(None) => {}
            Ok(Some(m)) => panic!("handed out again: {}", m.position),
            // The pull request lost with the cut connection.
            Err(e) => assert!(e.is_transient(), "{e}"),
        }
    }
    let info = consumer_info(&url, &lost.stream.name, &lost.durable).await;
    assert_eq!(
        info.num_ack_pending, 2,
        "the five final messages are acknowledged once redelivered; the held and the later \
         one are not: {info:?}"
    );
    assert!(
        info.delivered.consumer_sequence >= 7 + 5,
        "the final messages came back (their acks were lost): {info:?}"
    );
    assert_eq!(lost.source.unacknowledged(), 2);
}

/// The next occasion an ack ahead lost in a partition is tried again at.
#[derive(Clone, Copy, Debug)]
enum Occasion {
    /// The next ack ahead (of the later message, final now).
    AckAhead,
    /// The next commit (one that passes no delivery: the watermark stays at the held head).
    Commit,
}

/// Acks ahead lost in a network partition are tried again at the next ack ahead or commit,
/// after the link is back, long before the ack wait would redeliver them: the five are
/// acknowledged then, and nothing was delivered again.
async fn lost_acks_ahead_are_retried_at(test: &str, occasion: Occasion) {
    let wait = Duration::from_secs(60);
    let Some(lost) = acks_ahead_lost_in_a_partition(test, wait).await else {
        return;
    };
    let url = common::nats_url(test).expect("checked above");
    let held_by_source = match occasion {
        Occasion::AckAhead => 1,
        Occasion::Commit => 2,
    };
    // Until the client has reconnected through the healed link.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = match occasion {
            Occasion::AckAhead => {
                lost.source
                    .ack_ahead(std::slice::from_ref(&lost.later))
                    .await
            }
            Occasion::Commit => {
                let below_all = outbox_core::CommitOffset::new(lost.stream.name.clone(), 0, 1);
                lost.source.commit(&[below_all]).await
            }
        };
        match r {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "acks never confirmed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = consumer_info(&url, &lost.stream.name, &lost.durable).await;
    assert_eq!(
        info.num_ack_pending, held_by_source,
        "{occasion:?}: only what is not final is unacknowledged: {info:?}"
    );
    assert_eq!(
        info.delivered.consumer_sequence, 7,
        "nothing delivered again: {info:?}"
    );
    assert_eq!(lost.source.unacknowledged(), held_by_source);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_ahead_lost_in_a_partition_are_retried_at_the_next_ack_ahead() {
    lost_acks_ahead_are_retried_at("nats_lost_ack_retried_ahead", Occasion::AckAhead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_ahead_lost_in_a_partition_are_retried_at_the_next_commit() {
    lost_acks_ahead_are_retried_at("nats_lost_ack_retried_commit", Occasion::Commit).await;
}

/// Applies events as [`Effects`] once the gate is open (waits for it, inside the transaction).
struct Gated {
    open: tokio::sync::watch::Receiver<bool>,
    inner: Effects,
}

#[outbox_core::async_trait]
impl outbox_inbox::Handler<common::inbox::PgTx> for Gated {
    async fn handle(
        &self,
        tx: &mut common::inbox::PgTx,
        e: &Envelope,
    ) -> Result<(), outbox_inbox::HandlerError> {
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
        self.inner.handle(tx, e).await
    }
}

/// How often the engine commits in [`lost_acks_do_not_starve_a_small_max_ack_pending`].
#[derive(Clone, Copy, Debug)]
enum Cadence {
    /// After every final message and every 100 ms: a lost ack ahead is tried again at the next
    /// commit once the link is back.
    Periodic,
    /// Only when something became final since the last commit and the engine is quiet: once
    /// the lost acks' commit is over, nothing here tries them again, and nothing new is
    /// delivered while `max_ack_pending` is full. Only the server's redelivery of the final
    /// messages (acknowledged at once) frees the slots.
    OnNewFinals,
}

/// `max_ack_pending` 4. Version 2 of `h` (version 1 not published yet: held) and three events
/// of other aggregates are delivered; the three are applied while a network partition
/// black-holes their acks ahead, so the server holds all four unacknowledged and delivers
/// nothing more. The rest of the stream (version 1 of `h` and four more events) is published
/// meanwhile. After two ack waits the link is back: the three are acknowledged, version 1 of
/// `h` comes, `h` is applied in order, every event once, and the consumer's acks pending drain
/// to 0 (read from the server). Were the lost acks left to the watermark (which version 2 of
/// `h` holds at its delivery), the four slots would stay taken for good.
async fn lost_acks_do_not_starve_a_small_max_ack_pending(test: &str, cadence: Cadence) {
    let url = require!(common::nats_url(test));
    let db = require!(common::inbox_db(test).await);
    let prefix = unique("starve");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    // Publishes straight to the server (not through the proxy).
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    let mut first: Vec<Envelope> = vec![common::event("order", "h", 2)];
    first.extend((0..3).map(|i| common::event("order", &format!("f-{i}"), 1)));
    for r in publisher.publish(&first.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let proxy = common::proxy::Proxy::start(&common::upstream(&url));
    let source = NatsSource::builder(proxy.url(), &stream.name, &durable)
        .ack_wait(ACK_WAIT)
        .max_ack_pending(4)
        .pull_batch(4)
        .connect_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    let (gate, open) = tokio::sync::watch::channel(false);
    let applied = Arc::new(AtomicUsize::new(0));
    let processor = InboxProcessor::new(
        "nats-starve",
        db.inbox().await,
        Gated {
            open,
            inner: Effects {
                schema: db.schema.clone(),
                applied: applied.clone(),
            },
        },
    )
    .with_version_policy(VersionPolicy::hold(10, Duration::from_secs(600)))
    .require_first_version(true);
    let config = match cadence {
        Cadence::Periodic => EngineConfig::default().with_commit(1, Duration::from_millis(100)),
        Cadence::OnNewFinals => {
            EngineConfig::default().with_commit(10_000, Duration::from_secs(3600))
        }
    };
    let mut engine = ConsumerEngine::new(source, processor, config, 4).expect("engine");
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.report().received < 4 {
        assert!(Instant::now() < deadline, "the four were not delivered");
        engine.step().await.unwrap();
    }
    // Nothing is final before the gate opens: every ack ahead goes into the partition.
    proxy.partition();
    gate.send_replace(true);
    while engine.report().acked_ahead < 3 || engine.report().held != 1 {
        assert!(
            Instant::now() < deadline,
            "the three were not applied: {:?}",
            engine.report()
        );
        engine.step().await.unwrap();
    }
    assert_eq!(applied.load(Ordering::Relaxed), 3);
    let mut later: Vec<Envelope> = vec![common::event("order", "h", 1)];
    later.extend((3..7).map(|i| common::event("order", &format!("f-{i}"), 1)));
    for r in publisher.publish(&later.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
    let info = consumer_info(&url, &stream.name, &durable).await;
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (4, 5),
        "max_ack_pending is reached: the rest waits at the server: {info:?}"
    );
    // Two ack waits in the partition: the server's redeliveries go into it too.
    let until = Instant::now() + ACK_WAIT * 2;
    while Instant::now() < until {
        engine.step().await.unwrap();
    }
    proxy.heal();
    let total = first.len() + later.len();
    let deadline = Instant::now() + Duration::from_secs(30);
    let info = loop {
        let until = Instant::now() + Duration::from_millis(500);
        while Instant::now() < until {
            engine.step().await.unwrap();
        }
        let info = consumer_info(&url, &stream.name, &durable).await;
        let done = db.effects_once().await as usize == total
            && (info.num_ack_pending, info.num_pending) == (0, 0);
        if done || Instant::now() > deadline {
            break info;
        }
    };
    assert_eq!(
        db.applied("h").await,
        vec![1, 2],
        "{cadence:?}: version 1 of h was delivered after the partition and h applied in order \
         (server: {info:?}; engine: {:?})",
        engine.report()
    );
    for i in 0..7 {
        assert_eq!(db.applied(&format!("f-{i}")).await, vec![1], "f-{i}");
    }
    assert_eq!(db.effects_once().await as usize, total);
    assert_eq!(
        (info.num_ack_pending, info.num_pending),
        (0, 0),
        "{cadence:?}: the consumer's acks pending drained: {info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_acks_do_not_starve_a_small_max_ack_pending_with_periodic_commits() {
    lost_acks_do_not_starve_a_small_max_ack_pending("nats_starve_periodic", Cadence::Periodic)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_acks_do_not_starve_a_small_max_ack_pending_with_commits_on_new_finals_only() {
    lost_acks_do_not_starve_a_small_max_ack_pending("nats_starve_new_finals", Cadence::OnNewFinals)
        .await;
}
