//! Adversary tests of [`RabbitSource`] under the inbox engine, against the real RabbitMQ and
//! the real PostgreSQL inbox: the consuming link is cut (through a TCP proxy of the test's own)
//! while a message is in its handler's backoff and later versions of its aggregate wait behind
//! it, so the broker requeues everything unacknowledged onto a new channel whose delivery
//! tags start again at 1, while work of the old channel is still in the engine.

mod common;

// The NATS tests' TCP proxy relays any TCP protocol; used as it is.
#[path = "../../outbox-nats/tests/common/proxy.rs"]
#[allow(unreachable_pub, dead_code)]
mod proxy;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::inbox::{Effects, PgTx};
use common::{event, require, Topology};
use lapin::ExchangeKind as LapinKind;
use outbox_core::{async_trait, Envelope, Publisher, RetryPolicy};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor, VersionPolicy,
};
use outbox_rabbitmq::{quorum_arguments, RabbitPublisher, RabbitSource};
use proxy::Proxy;

/// Records effects, but fails aggregate `slow` transiently while `fail_slow` is set (its
/// transaction rolls back; the engine retries it with backoff).
#[derive(Debug)]
struct FailSlow {
    inner: Effects,
    fail_slow: Arc<AtomicBool>,
}

#[async_trait]
impl Handler<PgTx> for FailSlow {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        if e.aggregate_id == "slow" && self.fail_slow.load(Ordering::SeqCst) {
            return Err(HandlerError::transient("slow is failing (test)"));
        }
        self.inner.handle(tx, e).await
    }
}

/// `url` with its `host:port` replaced by the proxy's, and the `host:port` it had.
fn through(url: &str, proxy_port: &str) -> (String, String) {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (auth, hostpart) = match rest.rsplit_once('@') {
        Some((a, h)) => (format!("{a}@"), h),
        None => (String::new(), rest),
    };
    let (host, path) = match hostpart.split_once('/') {
        Some((h, p)) => (h, format!("/{p}")),
        None => (hostpart, String::new()),
    };
    let host = if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5672")
    };
    (
        format!("{scheme}://{auth}127.0.0.1:{proxy_port}{path}"),
        host,
    )
}

/// Queue depth plus the deliveries the broker still holds unacknowledged for a connection
/// that is cut: the link is cut (the broker requeues what was not acked) and the ready
/// messages are counted.
async fn left_after_cut(topology: &Topology, queue: &str, proxy: &Proxy) -> u32 {
    proxy.partition();
    proxy.heal();
    // The broker sees the connection closed and returns its unacked deliveries.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut depth = topology.depth(queue).await;
    while depth == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        depth = topology.depth(queue).await;
    }
    depth
}

/// Four aggregates with versions 1 to 3 and aggregate `slow` whose version 1 fails (versions 2
/// and 3 wait behind it in the engine), published so that the first channel acks tags 1-8 and
/// holds 9-15 unacked. While `slow` is in backoff the link is cut: the channel's unacked
/// deliveries go back to the queue; the source opens a new channel (tags from 1 again, below
/// what the first channel acked) and the engine gets them again while the old channel's work
/// is still in it. Then `slow` succeeds.
///
/// Promises: each effect once, first applications in version order, and every delivery of the
/// new channel acknowledged (cutting the link at the end returns nothing to the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_lost_while_a_message_is_in_backoff_applies_each_effect_once_in_order() {
    let url = require!(common::amqp_url("rabbit_adv_lost_channel_backoff"));
    let db = require!(common::inbox_db("rabbit_adv_lost_channel_backoff").await);
    let mut topology = Topology::exchange(&url, "adv", LapinKind::Topic, true).await;
    let queue = topology.queue("#", quorum_arguments(true)).await;
    let publisher = RabbitPublisher::builder(&url, &topology.exchange)
        .start()
        .await
        .expect("publisher");
    let aggs: Vec<String> = (0..4).map(|i| format!("a{i}")).collect();
    let mut events: Vec<Envelope> = Vec::new();
    // Tags on the first channel: 1-8 the four aggregates' versions 1 and 2 (applied, acked),
    // 9-11 `slow` (9 fails), 12-15 their versions 3 (applied, not acked: behind tag 9).
    for v in 1..=2 {
        events.extend(aggs.iter().map(|a| event("order", a, v)));
    }
    events.extend((1..=3).map(|v| event("order", "slow", v)));
    events.extend(aggs.iter().map(|a| event("order", a, 3)));
    for r in publisher.publish(&events.iter().collect::<Vec<_>>()).await {
        r.expect("published");
    }
    let total = events.len();

    let upstream = through(&url, "0").1;
    let proxy = Proxy::start(&upstream);
    let port = proxy.url().rsplit(':').next().expect("port").to_owned();
    let member_url = through(&url, &port).0;

    let applied = Arc::new(AtomicUsize::new(0));
    let fail_slow = Arc::new(AtomicBool::new(true));
    let processor = InboxProcessor::new(
        "rabbit-adv-lost-channel",
        db.inbox().await,
        FailSlow {
            inner: Effects {
                schema: db.schema.clone(),
                applied: applied.clone(),
            },
            fail_slow: fail_slow.clone(),
        },
    )
    .with_version_policy(VersionPolicy::Reject)
    .require_first_version(true);
    let retry = RetryPolicy::builder()
        .base(Duration::from_millis(300))
        .max_delay(Duration::from_millis(600))
        .max_attempts(10_000)
        .build()
        .unwrap();
    let config = EngineConfig::default()
        .with_commit(1, Duration::from_millis(100))
        .with_retry(retry);
    let (source, _) = RabbitSource::builder(&member_url, &queue)
        .prefetch(100)
        .connect_timeout(Duration::from_secs(2))
        .start()
        .await
        .expect("source");
    let mut engine = ConsumerEngine::new(source, processor, config, 31).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while applied.load(Ordering::SeqCst) < 12 {
        assert!(
            Instant::now() < deadline,
            "the four aggregates were not applied"
        );
        engine.step().await.unwrap();
    }
    // A few retries of `slow`, then the link goes while it is in backoff.
    let until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < until {
        engine.step().await.unwrap();
    }
    assert_eq!(engine.source().channel_generation(), 1);
    proxy.partition();
    proxy.heal();
    let deadline = Instant::now() + Duration::from_secs(20);
    while engine.source().channel_generation() < 2 {
        assert!(Instant::now() < deadline, "no new channel");
        let _ = engine.step().await;
    }
    // The requeued deliveries arrive on the new channel; let a few come before `slow` heals.
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        engine.step().await.unwrap();
    }
    fail_slow.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    while (db.effects_once().await as usize) < total {
        assert!(
            Instant::now() < deadline,
            "not all effects applied: slow {:?}",
            db.applied("slow").await
        );
        engine
            .run_until_quiet(Duration::from_millis(300))
            .await
            .unwrap();
    }
    engine
        .run_until_quiet(Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(db.effects_once().await as usize, total);
    for a in &aggs {
        assert_eq!(db.applied(a).await, vec![1, 2, 3], "{a}");
    }
    assert_eq!(db.applied("slow").await, vec![1, 2, 3]);
    assert!(
        engine.report().duplicates >= 4,
        "the versions 3 applied behind `slow` came again on the new channel: {:?}",
        engine.report()
    );
    assert_eq!(engine.report().parked, 0, "{:?}", engine.report());
    assert_eq!(
        left_after_cut(&topology, &queue, &proxy).await,
        0,
        "every delivery of the new channel acknowledged"
    );
}
