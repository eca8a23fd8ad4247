//! Adversary tests of the membership lease of [`NatsSource`] (one active member per durable
//! consumer, `src/lease.rs`), against the real NATS server (and the real PostgreSQL inbox where
//! an engine runs): a member cut from the server while it holds messages, a close that gives
//! messages and the lease back, a close by a member that lost the lease without knowing it.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::inbox::{Effects, PgTx};
use common::proxy::Proxy;
use common::{pending, require, unique, upstream, TestStream};
use outbox_core::{async_trait, Envelope, MessageSource, Publisher, ReceivedMessage};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor, VersionPolicy,
};
use outbox_nats::{NatsPublisher, NatsSource};

/// The shortest lease TTL accepted.
const TTL: Duration = Duration::from_secs(3);

fn payload(m: &ReceivedMessage) -> String {
    String::from_utf8(m.value().unwrap_or_default().to_vec()).unwrap()
}

async fn publish_n(stream: &TestStream, subject: &str, from: usize, to: usize) {
    for i in from..to {
        stream
            .js
            .publish(subject.to_owned(), format!("m{i}").into())
            .await
            .expect("publish")
            .await
            .expect("PubAck");
    }
}

async fn wait_active(source: &NatsSource, within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while !source.is_active() {
        assert!(
            Instant::now() < deadline,
            "{what}: no lease within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A member of `durable` on `stream` at `url` with lease TTL `ttl` (and `ack_wait` if given).
async fn member(
    url: &str,
    stream: &str,
    durable: &str,
    ttl: Duration,
    ack_wait: Option<Duration>,
) -> NatsSource {
    let mut builder = NatsSource::builder(url, stream, durable).lease_ttl(ttl);
    if let Some(wait) = ack_wait {
        builder = builder.ack_wait(wait);
    }
    builder.start().await.unwrap()
}

/// Two members as [`member`] makes them: the first active (within `within`), the second
/// started after it.
async fn active_and_second(
    url: &str,
    stream: &TestStream,
    durable: &str,
    ttl: Duration,
    ack_wait: Option<Duration>,
    within: Duration,
) -> (NatsSource, NatsSource) {
    let a = member(url, &stream.name, durable, ttl, ack_wait).await;
    wait_active(&a, within, "the first member").await;
    let b = member(url, &stream.name, durable, ttl, ack_wait).await;
    (a, b)
}

/// Publishes versions `from..=to` of aggregate `x`.
async fn publish_versions(publisher: &NatsPublisher, from: i64, to: i64) {
    let events: Vec<Envelope> = (from..=to)
        .map(|v| common::event("order", "x", v))
        .collect();
    for r in publisher.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
}

/// Polls `source` until `until`, collecting the payloads.
async fn drain(source: &NatsSource, until: Instant) -> Vec<String> {
    let mut got = Vec::new();
    while Instant::now() < until {
        if let Some(m) = source.poll(Duration::from_millis(100)).await.unwrap() {
            got.push(payload(&m));
        }
    }
    got.sort();
    got
}

/// Issue: `close` gave its messages back (`-NAK`) before it dropped its pull, so a message
/// given back went to the closing member's pull request, still open at the server, and waited
/// out the whole ack wait there. An active member holds three of five messages (the other two
/// brought by its pull, not handed out), its pull request still open; it closes. Promise: the
/// standby receives all five within 8 s, far below the ack wait of 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_gives_back_what_it_held_to_the_next_member_at_once() {
    let url = require!(common::nats_url("nats_lease_close_gives_back"));
    let prefix = unique("leaseclose");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let (a, b) = active_and_second(
        &url,
        &stream,
        &durable,
        TTL,
        Some(Duration::from_secs(30)),
        TTL * 2,
    )
    .await;
    publish_n(&stream, &format!("{prefix}.m"), 0, 5).await;
    let held = common::poll_n(&a, 3).await;
    assert_eq!(
        held.iter().map(payload).collect::<Vec<_>>(),
        vec!["m0", "m1", "m2"]
    );
    assert!(!b.is_active(), "the second member is a standby");
    a.close().await;
    let got = drain(&b, Instant::now() + Duration::from_secs(8)).await;
    assert_eq!(
        got,
        vec!["m0", "m1", "m2", "m3", "m4"],
        "what the closed member held (and what its pull had brought) comes to the next \
         member at once, not after the ack wait"
    );
}

/// A clean close gives the lease back: the standby takes over well before the TTL (60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_at_once_after_a_clean_close() {
    let url = require!(common::nats_url("nats_lease_close_prompt"));
    let prefix = unique("leaseprompt");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let ttl = Duration::from_secs(60);
    let (a, b) =
        active_and_second(&url, &stream, &durable, ttl, None, Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!b.is_active(), "the second member is a standby");
    a.close().await;
    wait_active(
        &b,
        Duration::from_secs(8),
        "the standby after a clean close",
    )
    .await;
    publish_n(&stream, &format!("{prefix}.m"), 0, 1).await;
    assert_eq!(payload(&common::poll_n(&b, 1).await[0]), "m0");
}

/// A member whose lease was taken (its key deleted by hand, re-created by a second member)
/// closes before its own renewal found out (a TTL of 60 s: renewed every 20 s). Promise: its
/// close does not delete the new holder's key: the second member stays active, and a third
/// member stays a standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_by_a_member_that_lost_the_lease_keeps_the_new_holders_key() {
    let url = require!(common::nats_url("nats_lease_close_lost"));
    let prefix = unique("leaselost");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let ttl = Duration::from_secs(60);
    let (a, b) =
        active_and_second(&url, &stream, &durable, ttl, None, Duration::from_secs(5)).await;
    let kv = common::js(&url)
        .await
        .get_key_value(format!("outbox_leases_{}ms", ttl.as_millis()))
        .await
        .expect("the lease bucket");
    let key = format!("{}.{}", stream.name, durable);
    kv.delete(&key).await.unwrap();
    wait_active(&b, Duration::from_secs(5), "the second member").await;
    let taken = kv.entry(&key).await.unwrap().expect("the new holder's key");
    assert!(a.is_active(), "the first member does not know yet");
    a.close().await;
    let c = member(&url, &stream.name, &durable, ttl, None).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = kv.entry(&key).await.unwrap();
    assert!(
        now.as_ref()
            .is_some_and(|e| e.value == taken.value
                && e.operation == async_nats::jetstream::kv::Operation::Put),
        "the new holder's key was deleted by a member that no longer held it: {now:?}"
    );
    assert!(b.is_active(), "the new holder lost its lease");
    assert!(
        !c.is_active(),
        "a third member became active beside the holder"
    );
}

/// The applications seen: member, version, when its handler started.
type Log = Arc<Mutex<Vec<(&'static str, i64, Instant)>>>;

/// When the pause started, and when it ended.
type Paused = Arc<Mutex<Option<(Instant, Option<Instant>)>>>;

/// Records each application (member, version, when its handler started) and applies it after
/// `delay`.
#[derive(Debug)]
struct Recorded {
    inner: Effects,
    member: &'static str,
    delay: Duration,
    log: Log,
}

#[async_trait]
impl Handler<PgTx> for Recorded {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        self.log
            .lock()
            .unwrap()
            .push((self.member, e.aggregate_version, Instant::now()));
        tokio::time::sleep(self.delay).await;
        self.inner.handle(tx, e).await
    }
}

/// An engine over `source` and `inbox` running `handler` (versions held in order, one message
/// a batch, commits of one).
fn engine_with<H: Handler<PgTx> + 'static>(
    source: NatsSource,
    inbox: outbox_postgres::PostgresInboxStore,
    handler: H,
    seed: u64,
) -> ConsumerEngine<NatsSource, outbox_postgres::PostgresInboxStore, H> {
    let processor = InboxProcessor::new("nats-lease", inbox, handler)
        .with_version_policy(VersionPolicy::hold(100, Duration::from_secs(120)))
        .require_first_version(true);
    let config = EngineConfig::default()
        .with_commit(1, Duration::from_millis(100))
        .with_max_batch(1)
        .with_poll_timeout(Duration::from_millis(50));
    ConsumerEngine::new(source, processor, config, seed).unwrap()
}

/// The handler of `member` on `schema`: records, waits `delay`, applies.
fn recorded(schema: String, member: &'static str, delay: Duration, log: Log) -> Recorded {
    Recorded {
        inner: Effects {
            schema,
            applied: Arc::new(AtomicUsize::new(0)),
        },
        member,
        delay,
        log,
    }
}

async fn engine(
    db: &common::inbox::Db,
    source: NatsSource,
    member: &'static str,
    delay: Duration,
    log: Log,
) -> ConsumerEngine<NatsSource, outbox_postgres::PostgresInboxStore, Recorded> {
    let handler = recorded(db.schema.clone(), member, delay, log);
    engine_with(source, db.inbox().await, handler, 7)
}

/// The active member reads through a proxy, with a slow handler and the versions of one
/// aggregate queued in its engine; a standby reads directly. The link of the active member is
/// cut (black-holed: its connection looks alive, nothing gets through) while it holds them;
/// more versions are published. Both engines keep running; the link heals after the standby
/// took over. Promises: the cut member starts no application once its lease ran out (it is
/// inactive from then: no renewal confirmed within 0.75 TTL), the standby takes over, the old
/// member never becomes active again after the heal, and every version is applied once, in
/// order, nothing parked, nothing left unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_cut_from_the_server_stops_when_its_lease_runs_out_and_stays_out() {
    let test = "nats_lease_cut";
    let url = require!(common::nats_url(test));
    let db = require!(common::inbox_db(test).await);
    let prefix = unique("leasecut");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    const N: i64 = 24;
    const MORE: i64 = 4;
    let ack_wait = Duration::from_secs(5);
    let log: Log = Arc::default();
    let proxy = Proxy::start(&upstream(&url));
    let a = NatsSource::builder(proxy.url(), &stream.name, &durable)
        .ack_wait(ack_wait)
        .lease_ttl(TTL)
        .connect_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    wait_active(&a, TTL * 2, "the first member").await;
    let b = member(&url, &stream.name, &durable, TTL, Some(ack_wait)).await;
    let mut a = engine(&db, a, "a", Duration::from_millis(300), log.clone()).await;
    let mut b = engine(&db, b, "b", Duration::ZERO, log.clone()).await;
    publish_versions(&publisher, 1, N).await;
    let by = |m: &str| log.lock().unwrap().iter().filter(|e| e.0 == m).count();
    let deadline = Instant::now() + Duration::from_secs(20);
    while by("a") < 3 {
        assert!(
            Instant::now() < deadline,
            "the active member applied nothing"
        );
        a.step().await.unwrap();
        assert!(!b.source().is_active());
        let _ = tokio::time::timeout(Duration::from_millis(50), b.step()).await;
    }

    proxy.partition();
    let cut = Instant::now();
    publish_versions(&publisher, N + 1, N + MORE).await;
    let a_out: Mutex<Option<Instant>> = Mutex::new(None);
    let taken: Mutex<Option<Instant>> = Mutex::new(None);
    let healed: Mutex<Option<Instant>> = Mutex::new(None);
    let done = || {
        taken
            .lock()
            .unwrap()
            .is_some_and(|t| t.elapsed() > Duration::from_secs(2))
            || cut.elapsed() > Duration::from_secs(20)
    };
    tokio::join!(
        async {
            while !done() {
                let _ = a.step().await;
                if a_out.lock().unwrap().is_none() && !a.source().is_active() {
                    *a_out.lock().unwrap() = Some(Instant::now());
                    // Time for the source's lease watch to run (it acts when the lease runs
                    // out, which `is_active` reads from the clock).
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        },
        async {
            while !done() {
                let _ = b.step().await;
                if taken.lock().unwrap().is_none() && b.source().is_active() {
                    *taken.lock().unwrap() = Some(Instant::now());
                }
                let t = *taken.lock().unwrap();
                if t.is_some_and(|t| t.elapsed() > Duration::from_secs(1))
                    && healed.lock().unwrap().is_none()
                {
                    proxy.heal();
                    *healed.lock().unwrap() = Some(Instant::now());
                }
            }
        },
    );
    let a_out = a_out
        .into_inner()
        .unwrap()
        .expect("the cut member stayed active");
    let taken = taken
        .into_inner()
        .unwrap()
        .expect("the standby did not take over");
    let healed = healed.into_inner().unwrap().expect("healed");
    tracing::info!(out = ?a_out - cut, taken = ?taken - cut, "cut");
    assert!(
        taken > cut + TTL / 2,
        "taken over before the lease could run out"
    );
    let late: Vec<(i64, Duration)> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == "a" && e.2 > a_out)
        .map(|e| (e.1, e.2 - a_out))
        .collect();
    assert_eq!(
        late,
        vec![],
        "versions the cut member started after its lease ran out"
    );

    // The healed member reconnects; it must stay a standby while the other one holds the lease.
    let deadline = healed + Duration::from_secs(60);
    while db.effects_once().await < N + MORE
        || pending(&url, &stream.name, &durable).await != (0, 0)
    {
        assert!(
            Instant::now() < deadline,
            "not everything applied and acknowledged: {:?}, pending {:?}",
            db.applied("x").await,
            pending(&url, &stream.name, &durable).await
        );
        let _ = tokio::time::timeout(Duration::from_millis(200), a.step()).await;
        b.run_until_quiet(Duration::from_millis(200)).await.unwrap();
        assert!(
            !a.source().is_active(),
            "the old member became active again beside the holder"
        );
        assert!(b.source().is_active(), "the holder lost its lease");
    }
    assert_eq!(db.applied("x").await, (1..=N + MORE).collect::<Vec<i64>>());
    assert_eq!(b.report().parked, 0, "{:?}", b.report());
    assert_eq!(a.report().parked, 0, "{:?}", a.report());
    let after_heal = log
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == "a" && e.2 > healed)
        .count();
    assert_eq!(after_heal, 0, "the old member applied after the heal");
}

/// Blocks its thread (its whole runtime: the lease renewal, the connection) once, inside the
/// transaction of version `at`, for `pause`: a stop-the-world pause of the member.
#[derive(Debug)]
struct Pausing {
    inner: Recorded,
    at: i64,
    pause: Duration,
    paused: Paused,
}

#[async_trait]
impl Handler<PgTx> for Pausing {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        let r = &self.inner;
        r.log
            .lock()
            .unwrap()
            .push((r.member, e.aggregate_version, Instant::now()));
        if e.aggregate_version == self.at && self.paused.lock().unwrap().is_none() {
            *self.paused.lock().unwrap() = Some((Instant::now(), None));
            std::thread::sleep(self.pause);
            self.paused.lock().unwrap().as_mut().unwrap().1 = Some(Instant::now());
        }
        tokio::time::sleep(r.delay).await;
        r.inner.handle(tx, e).await
    }
}

/// The active member runs on a runtime of its own, whose one thread is blocked for twice the
/// TTL inside the transaction of version 3 of an aggregate (a stop-the-world pause, a stopped
/// process: nothing of the member runs, its lease renewal included), while it holds the
/// aggregate's later versions; more versions are published during the pause. A standby takes
/// over. The paused member then resumes: its effect of version 3 commits. Promises: the member
/// starts nothing after it resumed, acknowledges nothing it did not apply (every version is
/// applied, once, in order; nothing parked; nothing left unacknowledged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_paused_past_its_lease_applies_and_acknowledges_nothing_more() {
    let test = "nats_lease_paused";
    let url = require!(common::nats_url(test));
    let db = require!(common::inbox_db(test).await);
    let db_url = outbox_test_support::database_url(test).expect("the database");
    let prefix = unique("leasepause");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let publisher = NatsPublisher::builder(&url, &prefix).start().await.unwrap();
    const N: i64 = 10;
    const MORE: i64 = 2;
    // Longer than the pause: what the paused member held comes to the standby only after it
    // resumed, so that an ack of it by the paused member would lose it.
    let ack_wait = Duration::from_secs(15);
    let log: Log = Arc::default();
    let paused: Paused = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let _migrated = db.inbox().await;
    publish_versions(&publisher, 1, N).await;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
    let member_a = {
        let (url, stream, durable, schema) = (
            url.clone(),
            stream.name.clone(),
            durable.clone(),
            db.schema.clone(),
        );
        let (log, paused, stop) = (log.clone(), paused.clone(), stop.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(2)
                    .connect(&db_url)
                    .await
                    .expect("PostgreSQL");
                let inbox = outbox_postgres::PostgresInboxStore::builder(pool)
                    .schema(&schema)
                    .build()
                    .expect("inbox");
                let source = member(&url, &stream, &durable, TTL, Some(ack_wait)).await;
                wait_active(&source, TTL * 2, "the first member").await;
                ready_tx.send(()).unwrap();
                let handler = Pausing {
                    inner: recorded(schema, "a", Duration::from_millis(100), log),
                    at: 3,
                    pause: TTL * 2,
                    paused,
                };
                let mut engine = engine_with(source, inbox, handler, 3);
                while !stop.load(Ordering::SeqCst) {
                    let _ = engine.step().await;
                }
                engine.report().parked
            })
        })
    };
    ready_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the first member started");
    let b = member(&url, &stream.name, &durable, TTL, Some(ack_wait)).await;
    let mut b = engine(&db, b, "b", Duration::ZERO, log.clone()).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while paused.lock().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the first member never paused");
        let _ = tokio::time::timeout(Duration::from_millis(100), b.step()).await;
        assert!(!b.source().is_active(), "taken over before the pause");
    }
    publish_versions(&publisher, N + 1, N + MORE).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.effects_once().await < N + MORE
        || pending(&url, &stream.name, &durable).await != (0, 0)
    {
        assert!(
            Instant::now() < deadline,
            "not everything applied and acknowledged: {:?}, pending {:?}",
            db.applied("x").await,
            pending(&url, &stream.name, &durable).await
        );
        b.run_until_quiet(Duration::from_millis(200)).await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let parked_a = member_a.join().expect("the first member's thread");
    let (_, resumed) = paused.lock().unwrap().expect("paused");
    let resumed = resumed.expect("resumed");
    assert!(b.source().is_active(), "the standby took over");
    assert_eq!(db.applied("x").await, (1..=N + MORE).collect::<Vec<i64>>());
    assert_eq!(b.report().parked + parked_a, 0, "{:?}", b.report());
    let after: Vec<i64> = log
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.0 == "a" && e.2 > resumed)
        .map(|e| e.1)
        .collect();
    assert_eq!(
        after,
        Vec::<i64>::new(),
        "versions the paused member started after it resumed"
    );
}

/// Two members of one durable consumer configured with different lease TTLs (so two lease
/// buckets): the second one starts while the first is active. Promises: the second never
/// becomes active and hands out nothing, its poll fails with a permanent error naming the
/// lease TTL; the first one keeps reading.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_with_another_lease_ttl_refuses_to_read() {
    let url = require!(common::nats_url("nats_lease_other_ttl"));
    let prefix = unique("leasettl");
    let (stream, durable) = common::stream_and_durable(&url, &prefix, "inbox").await;
    let with_ttl = |ttl: Duration| {
        member(
            &url,
            &stream.name,
            &durable,
            ttl,
            Some(Duration::from_secs(30)),
        )
    };
    let a = with_ttl(TTL).await;
    wait_active(&a, TTL * 2, "the first member").await;
    let b = with_ttl(TTL + Duration::from_secs(1)).await;
    publish_n(&stream, &format!("{prefix}.m"), 0, 3).await;
    let until = Instant::now() + Duration::from_secs(5);
    let mut refused = None;
    while Instant::now() < until && refused.is_none() {
        match b.poll(Duration::from_millis(100)).await {
            Ok(None) => {}
            Ok(Some(m)) => panic!("a member with another TTL handed out {}", payload(&m)),
            Err(e) => refused = Some(e),
        }
        assert!(!b.is_active(), "two active members (two TTLs, two buckets)");
    }
    let refused = refused.expect("the member with another TTL did not refuse");
    assert_eq!(
        refused.class,
        outbox_core::ErrorClass::Permanent,
        "{refused}"
    );
    assert!(refused.to_string().contains("lease_ttl"), "{refused}");
    assert!(a.is_active());
    let got = common::poll_n(&a, 3).await;
    assert_eq!(
        got.iter().map(payload).collect::<Vec<_>>(),
        vec!["m0", "m1", "m2"]
    );
}
