//! The consumer engine (outbox-inbox) over the MariaDB/MySQL inbox, on the attacks of issue 20
//! against the aggregate-scoped dedupe: a record naming another aggregate's event as its
//! original, and a record whose event id is crafted to be the scoped id such a record would be
//! registered under. Each test has its own database on the server at `MYSQL_URL`.

mod common;

use std::time::Duration;

use outbox_core::{
    wire, Envelope, InboxParking, InboxStore, ParkedFilter, ParkedStatus, Publisher,
};
use outbox_inbox::{ConsumerEngine, EngineConfig, Handler, HandlerError, InboxProcessor};
use outbox_mysql::MySqlInboxStore;
use outbox_testkit::{MemoryConsumer, MemoryLog};
use sqlx::{MySql, MySqlPool, Transaction};

const GROUP: &str = "proj";

/// An aggregate, a version, and the semaphore its events wait on.
type Gate = (String, i64, std::sync::Arc<tokio::sync::Semaphore>);

/// Writes each effect to `effects` (aggregate id, version) in the inbox transaction; the
/// events of `poison*` aggregates fail permanently until the aggregate is in `fixed`.
#[derive(Clone)]
struct Effects {
    table: String,
    fixed: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Events of this aggregate and version wait on the semaphore in the handler (counted in
    /// `entered`) before writing their effect.
    gate: std::sync::Arc<std::sync::Mutex<Option<Gate>>>,
    entered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[outbox_core::async_trait]
impl Handler<Transaction<'static, MySql>> for Effects {
    async fn handle(
        &self,
        tx: &mut Transaction<'static, MySql>,
        e: &Envelope,
    ) -> Result<(), HandlerError> {
        if e.aggregate_id.starts_with("poison")
            && !self.fixed.lock().unwrap().contains(&e.aggregate_id)
        {
            return Err(HandlerError::permanent("poison"));
        }
        let gate = self.gate.lock().unwrap().clone();
        if let Some((agg, v, g)) = gate {
            if agg == e.aggregate_id && v == e.aggregate_version {
                self.entered
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                g.acquire().await.expect("gate").forget();
            }
        }
        sqlx::query(&format!(
            "INSERT INTO {} (aggregate_id, version) VALUES (?, ?)",
            self.table
        ))
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(|e| HandlerError::transient(e.to_string()))?;
        Ok(())
    }
}

async fn setup(ctx: &common::Ctx) -> (MySqlInboxStore, Effects) {
    let inbox = ctx.inbox().await;
    let table = ctx.table("effects");
    sqlx::query(&format!(
        "CREATE TABLE {table} (seq BIGINT AUTO_INCREMENT PRIMARY KEY, \
         aggregate_id VARCHAR(64) NOT NULL, version BIGINT NOT NULL)"
    ))
    .execute(&ctx.pool)
    .await
    .unwrap();
    (
        inbox,
        Effects {
            table,
            fixed: Default::default(),
            gate: Default::default(),
            entered: Default::default(),
        },
    )
}

async fn applied(pool: &MySqlPool, h: &Effects, agg: &str) -> Vec<i64> {
    sqlx::query_scalar(&format!(
        "SELECT version FROM {} WHERE aggregate_id = ? ORDER BY seq",
        h.table
    ))
    .bind(agg)
    .fetch_all(pool)
    .await
    .unwrap()
}

fn engine(
    log: &MemoryLog,
    inbox: &MySqlInboxStore,
    h: &Effects,
    max_batch: usize,
    concurrency: usize,
) -> ConsumerEngine<MemoryConsumer, MySqlInboxStore, Effects> {
    let retry = outbox_core::RetryPolicy::builder()
        .base(Duration::from_millis(1))
        .max_delay(Duration::from_millis(2))
        .min_delay(Duration::from_millis(1))
        .max_attempts(3)
        .build()
        .unwrap();
    ConsumerEngine::new(
        log.consumer(GROUP, &["t"]),
        InboxProcessor::new(GROUP, inbox.clone(), h.clone()),
        EngineConfig::default()
            .with_commit(1, Duration::from_secs(60))
            .with_poll_timeout(Duration::from_millis(5))
            .with_retry(retry)
            .with_max_batch(max_batch)
            .with_concurrency(concurrency),
        7,
    )
    .unwrap()
}

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .json(&serde_json::json!({ "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

/// A record of `agg` at version `v` whose original-id header names `original`.
fn naming(agg: &str, v: i64, original: &Envelope) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .header(wire::ORIGINAL_EVENT_ID, original.event_id.to_string())
        .build()
        .unwrap()
}

async fn open_of(inbox: &MySqlInboxStore, agg: &str) -> Vec<outbox_core::ParkedMessage> {
    inbox
        .list_parked(GROUP, &ParkedFilter::open())
        .await
        .unwrap()
        .into_iter()
        .filter(|m| m.record.aggregate.as_ref().map(|a| a.aggregate_id.as_str()) == Some(agg))
        .collect()
}

/// A foreign record (of `poison-b`, naming `poison-a` v2 as its original) is parked first;
/// then the real `poison-a` v2 must wait behind `poison-a`'s parked head, not be taken for a
/// redelivery of the foreign record (its offset final and nothing of it kept: lost; the
/// operator's retry of v1 then released nothing behind it).
#[tokio::test]
async fn a_foreign_record_parked_first_does_not_swallow_a_waiting_event() {
    let ctx = ctx!(4);
    let (inbox, h) = setup(&ctx).await;
    let (a1, a2) = (ev("poison-a", 1), ev("poison-a", 2));
    let foreign = naming("poison-b", 1, &a2);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&a1, &foreign]).await;
    let mut eng = engine(&log, &inbox, &h, 100, 4);
    let r = eng
        .run_until_quiet(Duration::from_millis(60))
        .await
        .unwrap();
    assert_eq!(r.parked, 2, "{r:?}");
    log.publish(&[&a2]).await;
    let r = eng
        .run_until_quiet(Duration::from_millis(60))
        .await
        .unwrap();
    assert_eq!((r.waiting, r.already_parked), (1, 0), "{r:?}");
    let open = open_of(&inbox, "poison-a").await;
    assert_eq!(open.len(), 2, "{open:?}");
    h.fixed.lock().unwrap().push("poison-a".into());
    let head = open
        .iter()
        .find(|m| m.status == ParkedStatus::Parked)
        .unwrap();
    let d = eng.parked().retry(head.id, "alice", "fixed").await.unwrap();
    assert_eq!((d.applied, d.released), (2, true), "{d:?}");
    assert_eq!(applied(&ctx.pool, &h, "poison-a").await, vec![1, 2]);
    ctx.drop().await;
}

/// A crafted record whose event id is the scoped id of `b`'s foreign record, then that
/// foreign record: the consumer does not stop, the foreign record is parked as unprocessable
/// (b's next version waits behind it), other aggregates keep flowing, and its redelivery is
/// parked already; a discard releases `b`.
#[tokio::test]
async fn a_crafted_scoped_id_collision_does_not_stop_the_consumer() {
    let ctx = ctx!(4);
    let (inbox, h) = setup(&ctx).await;
    for max_batch in [100, 1] {
        let [a, b, c, d] = ["a", "b", "c", "d"].map(|x| format!("{x}{max_batch}"));
        let real = ev(&a, 1);
        let foreign = naming(&b, 1, &real);
        let scoped = outbox_core::inbox::scoped_dedup_id(
            &outbox_core::AggregateKey::new("order", b.as_str()),
            real.event_id,
        );
        let crafted = Envelope::builder("order", c.as_str(), 1, "order.changed")
            .event_id(scoped)
            .build()
            .unwrap();
        let log = MemoryLog::new("t", 1);
        log.publish(&[&real, &crafted, &foreign, &ev(&b, 2), &ev(&d, 1)])
            .await;
        // One batch in flight: the crafted record registers before the foreign one (with
        // several, the foreign one may register first and is then applied: see the race).
        let mut eng = engine(&log, &inbox, &h, max_batch, 1);
        let r = eng.run_until_quiet(Duration::from_millis(60)).await;
        let r = r.unwrap_or_else(|e| panic!("max_batch {max_batch}: the consumer stopped: {e:?}"));
        assert_eq!(log.committed(GROUP, "t", 0), Some(5));
        assert_eq!((r.applied, r.parked, r.waiting), (3, 1, 1), "{r:?}");
        let open = open_of(&inbox, &b).await;
        let head = open
            .iter()
            .find(|m| m.status == ParkedStatus::Parked)
            .expect("b's head");
        assert!(
            head.reason.contains("cannot be deduplicated"),
            "{}",
            head.reason
        );
        let before = eng.report().clone();
        log.publish(&[&foreign]).await;
        let r = eng
            .run_until_quiet(Duration::from_millis(60))
            .await
            .unwrap();
        assert_eq!(r.already_parked - before.already_parked, 1, "{r:?}");
        eng.parked()
            .discard(head.id, "alice", "crafted")
            .await
            .unwrap();
        assert_eq!(applied(&ctx.pool, &h, &b).await, vec![2]);
        for agg in [&a, &c, &d] {
            assert_eq!(applied(&ctx.pool, &h, agg).await, vec![1], "{agg}");
        }
    }
    ctx.drop().await;
}

async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !cond().await {
        assert!(std::time::Instant::now() < deadline, "not reached: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Adversary pass on the MariaDB side: two instances of the consumer (one inbox consumer name)
/// race the same records, a crafted collision among them, in batches of one and of all with
/// several aggregates at once; then a redelivery races the discard of the parked foreign
/// record (when parked). Neither instance stops; the foreign record is applied once or parked
/// once with `b`'s next version behind it (which one depends on whether its scoped id was free
/// when it registered), never both, never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_race_a_crafted_collision_and_a_discard() {
    let ctx = ctx!(12);
    let (inbox, h) = setup(&ctx).await;
    let real = ev("a", 1);
    let foreign = naming("b", 1, &real);
    let scoped = outbox_core::inbox::scoped_dedup_id(
        &outbox_core::AggregateKey::new("order", "b"),
        real.event_id,
    );
    let crafted = Envelope::builder("order", "c", 1, "order.changed")
        .event_id(scoped)
        .build()
        .unwrap();
    let b2 = ev("b", 2);
    let log = MemoryLog::new("t", 1);
    log.publish(&[&real, &crafted, &foreign, &b2, &ev("d", 1)])
        .await;
    let instances: Vec<_> = [("i1", 1usize), ("i2", 100)]
        .into_iter()
        .map(|(group, max_batch)| {
            let retry = outbox_core::RetryPolicy::builder()
                .base(Duration::from_millis(1))
                .max_delay(Duration::from_millis(2))
                .min_delay(Duration::from_millis(1))
                .max_attempts(3)
                .build()
                .unwrap();
            let mut eng = ConsumerEngine::new(
                log.consumer(group, &["t"]),
                InboxProcessor::new(GROUP, inbox.clone(), h.clone()),
                EngineConfig::default()
                    .with_commit(1, Duration::from_secs(60))
                    .with_poll_timeout(Duration::from_millis(5))
                    .with_retry(retry)
                    .with_max_batch(max_batch)
                    .with_concurrency(4),
                7,
            )
            .unwrap();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                let r = eng
                    .run(async {
                        let _ = stopped.await;
                    })
                    .await;
                (group, r)
            });
            (stop, task)
        })
        .collect();
    let l = &log;
    eventually("both instances through the log", || async move {
        l.committed("i1", "t", 0) == Some(5) && l.committed("i2", "t", 0) == Some(5)
    })
    .await;
    for agg in ["a", "c", "d"] {
        assert_eq!(applied(&ctx.pool, &h, agg).await, vec![1], "{agg}");
    }
    let open = open_of(&inbox, "b").await;
    let parked = match (applied(&ctx.pool, &h, "b").await.as_slice(), open.len()) {
        ([1, 2], 0) => false,
        ([], 2) => true,
        (got, _) => panic!("b applied {got:?} with open {open:?}"),
    };
    eprintln!(
        "the foreign record was {}",
        if parked { "parked" } else { "applied" }
    );
    let redelivered = [&foreign, &b2];
    if parked {
        let head = open
            .iter()
            .find(|m| m.status == ParkedStatus::Parked)
            .expect("b's head");
        let ops =
            outbox_inbox::ParkedMessages::new(InboxProcessor::new(GROUP, inbox.clone(), h.clone()));
        let (discard, _) = tokio::join!(
            ops.discard(head.id, "alice", "crafted"),
            log.publish(&redelivered)
        );
        discard.unwrap();
    } else {
        log.publish(&redelivered).await;
    }
    eventually("redeliveries committed", || async {
        l.committed("i1", "t", 0) == Some(7) && l.committed("i2", "t", 0) == Some(7)
    })
    .await;
    let expected = if parked { vec![2] } else { vec![1, 2] };
    let (pool, hh, e) = (&ctx.pool, &h, &expected);
    eventually("b's versions applied once", || async move {
        &applied(pool, hh, "b").await == e
    })
    .await;
    for (stop, task) in instances {
        stop.send(()).unwrap();
        let (group, r) = task.await.unwrap();
        let r = r.unwrap_or_else(|e| panic!("{group} stopped: {e:?}"));
        assert_eq!(r.received, 7, "{group}: {r:?}");
    }
    for agg in ["a", "c", "d"] {
        assert_eq!(applied(&ctx.pool, &h, agg).await, vec![1], "{agg}");
    }
    assert_eq!(applied(&ctx.pool, &h, "b").await, expected);
    assert!(inbox
        .list_parked(GROUP, &ParkedFilter::open())
        .await
        .unwrap()
        .is_empty());
    ctx.drop().await;
}

/// The crafted collision at parking: the crafted record (its event id the foreign record's
/// scoped id) and the real event are parked, then the foreign record naming the real event:
/// it is parked (the unique key holds the aggregate itself, so no id of another aggregate's
/// message stands in its way), and its redelivery is parked already.
#[tokio::test]
async fn a_crafted_collision_at_parking_does_not_lose_the_foreign_record() {
    use outbox_core::{LogPosition, NewParkedMessage, ParkAs, ParkKind, Parking, ReceivedMessage};
    let ctx = ctx!(4);
    let (inbox, _h) = setup(&ctx).await;
    let real = ev("a", 1);
    let foreign = naming("b", 1, &real);
    let scoped = outbox_core::inbox::scoped_dedup_id(
        &outbox_core::AggregateKey::new("order", "b"),
        real.event_id,
    );
    let crafted = Envelope::builder("order", "c", 1, "order.changed")
        .event_id(scoped)
        .build()
        .unwrap();
    let park = |e: &Envelope, offset: i64| {
        let record =
            ReceivedMessage::new(LogPosition::new("t", 0, offset), None, Ok(e.clone())).to_record();
        let m = NewParkedMessage::new(record, ParkAs::Head(ParkKind::Unprocessable), "fails", 1);
        let inbox = inbox.clone();
        async move {
            let mut tx = inbox.begin().await.unwrap();
            let p = inbox.park(&mut tx, GROUP, &[m]).await.unwrap();
            inbox.commit(tx).await.unwrap();
            p[0]
        }
    };
    assert!(matches!(park(&crafted, 1).await, Parking::Head(_)));
    assert!(matches!(park(&real, 2).await, Parking::Head(_)));
    let p = park(&foreign, 3).await;
    assert!(matches!(p, Parking::Head(_)), "the foreign record: {p:?}");
    assert_eq!(park(&foreign, 4).await, Parking::AlreadyParked);
    assert_eq!(open_of(&inbox, "b").await.len(), 1);
    ctx.drop().await;
}

/// Adversary pass on the stale-read apply (MariaDB): `g` v1 is applied; instance A reads `g`
/// (not blocked) for its batch [v2, v3] and waits in v2's handler; instance B, on the same
/// partition from v3 only, parks v3 as a version gap and commits. A must not then apply v2 and
/// v3 behind the parked head (v3 applied and parked): writing the version takes the row lock,
/// A reads `g` blocked, runs again, and v2 waits. The operator's retry then applies v2 and v3
/// once each and unblocks `g`.
//
// FOUND here (as on PostgreSQL), fixed in the processor: A applied v2 and v3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_read_does_not_apply_behind_a_head_parked_meanwhile() {
    let ctx = ctx!(12);
    let (inbox, h) = setup(&ctx).await;
    let (g1, g2, g3) = (ev("g", 1), ev("g", 2), ev("g", 3));
    assert!(matches!(
        InboxProcessor::new(GROUP, inbox.clone(), h.clone())
            .process(&g1)
            .await
            .unwrap(),
        outbox_inbox::MessageOutcome::Applied
    ));
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    *h.gate.lock().unwrap() = Some(("g".into(), 2, gate.clone()));
    let log_a = MemoryLog::new("t", 1);
    log_a.publish(&[&g2, &g3]).await;
    let log_b = MemoryLog::new("t", 1);
    log_b.publish(&[&g3]).await;
    let mut eng_a = engine(&log_a, &inbox, &h, 100, 1);
    let (stop_a, stopped) = tokio::sync::oneshot::channel::<()>();
    let task_a = tokio::spawn(async move {
        eng_a
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    eventually("A in v2's handler", || async {
        h.entered.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    let mut eng_b = engine(&log_b, &inbox, &h, 100, 1);
    tokio::time::timeout(
        Duration::from_secs(20),
        eng_b.run_until_quiet(Duration::from_millis(60)),
    )
    .await
    .expect("B quiet")
    .unwrap();
    let open = open_of(&inbox, "g").await;
    assert_eq!(open.len(), 1, "B parked v3: {open:?}");
    let head = open[0].id;
    gate.add_permits(1_000);
    let l = &log_a;
    eventually("A through its log", || async move {
        l.committed(GROUP, "t", 0) == Some(2)
    })
    .await;
    stop_a.send(()).unwrap();
    let r = tokio::time::timeout(Duration::from_secs(20), task_a)
        .await
        .expect("A stops")
        .unwrap()
        .unwrap();
    assert_eq!(
        applied(&ctx.pool, &h, "g").await,
        vec![1],
        "applied behind a parked head ({r:?}); open: {:?}",
        open_of(&inbox, "g").await
    );
    assert_eq!(open_of(&inbox, "g").await.len(), 2);
    let ops =
        outbox_inbox::ParkedMessages::new(InboxProcessor::new(GROUP, inbox.clone(), h.clone()));
    ops.retry(head, "alice", "v2 came").await.unwrap();
    assert_eq!(applied(&ctx.pool, &h, "g").await, vec![1, 2, 3]);
    assert!(open_of(&inbox, "g").await.is_empty());
    ctx.drop().await;
}
