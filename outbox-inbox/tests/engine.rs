//! Engine tests against small fakes that log every step, so the order of "transaction
//! committed" and "offset committed" can be asserted.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    DecodeError, Envelope, EventId, InboxStore, LogPosition, MessageSource, ReceivedMessage,
    Registration, RetryPolicy, SourceError, StoreError,
};
use outbox_inbox::*;

type Log = Arc<Mutex<Vec<String>>>;
type Commits = Arc<Mutex<Vec<(String, i32, i64)>>>;
type TestEngine = ConsumerEngine<FakeSource, FakeInbox, ScriptedHandler>;

#[derive(Default, Clone)]
struct FakeInbox {
    commits: Arc<Mutex<u32>>,
    committed: Arc<Mutex<HashSet<(String, EventId)>>>,
    effects: Arc<Mutex<Vec<EventId>>>,
    log: Log,
}

struct Tx {
    regs: Vec<(String, EventId)>,
    effects: Vec<EventId>,
}

#[async_trait]
impl InboxStore for FakeInbox {
    type Tx = Tx;
    async fn begin(&self) -> Result<Tx, StoreError> {
        Ok(Tx {
            regs: vec![],
            effects: vec![],
        })
    }
    async fn register(
        &self,
        tx: &mut Tx,
        c: &str,
        id: EventId,
    ) -> Result<Registration, StoreError> {
        let key = (c.to_owned(), id);
        if self.committed.lock().unwrap().contains(&key) || tx.regs.contains(&key) {
            return Ok(Registration::Duplicate);
        }
        tx.regs.push((c.to_owned(), id));
        Ok(Registration::Fresh)
    }
    async fn commit(&self, tx: Tx) -> Result<(), StoreError> {
        *self.commits.lock().unwrap() += 1;
        for r in &tx.regs {
            self.log.lock().unwrap().push(format!("tx-commit {}", r.1));
        }
        self.committed.lock().unwrap().extend(tx.regs);
        self.effects.lock().unwrap().extend(tx.effects);
        Ok(())
    }
    async fn rollback(&self, _tx: Tx) -> Result<(), StoreError> {
        Ok(())
    }
    async fn cleanup(&self, _: Duration, _: usize) -> Result<u64, StoreError> {
        Ok(0)
    }
}

struct FakeSource {
    queue: Mutex<VecDeque<ReceivedMessage>>,
    commits: Commits,
    log: Log,
}

#[async_trait]
impl MessageSource for FakeSource {
    async fn poll(&self, _: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        Ok(self.queue.lock().unwrap().pop_front())
    }
    async fn commit(&self, offsets: &[(String, i32, i64)]) -> Result<(), SourceError> {
        for o in offsets {
            self.log
                .lock()
                .unwrap()
                .push(format!("offset-commit {}", o.2));
        }
        self.commits.lock().unwrap().extend_from_slice(offsets);
        Ok(())
    }
}

/// Applies an effect; fails as scripted by aggregate id.
struct ScriptedHandler {
    transient_failures_left: Mutex<u32>,
}

#[async_trait]
impl Handler<Tx> for ScriptedHandler {
    async fn handle(&self, tx: &mut Tx, event: &Envelope) -> Result<(), HandlerError> {
        if event.aggregate_id == "poison" {
            return Err(HandlerError::permanent("schema violation"));
        }
        if event.aggregate_id == "flaky" {
            let mut left = self.transient_failures_left.lock().unwrap();
            if *left > 0 {
                *left -= 1;
                return Err(HandlerError::transient("lock timeout"));
            }
        }
        tx.effects.push(event.event_id);
        Ok(())
    }
}

fn msg(offset: i64, e: &Envelope) -> ReceivedMessage {
    ReceivedMessage::new(
        LogPosition {
            topic: "t".into(),
            partition: 0,
            offset,
        },
        Some(e.aggregate_id.clone().into_bytes()),
        Ok(e.clone()),
    )
}

fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("x", agg, v, "x.happened")
        .build()
        .unwrap()
}

/// The engine over the fakes with fast retries and a commit after every final message.
fn engine(msgs: Vec<ReceivedMessage>, inbox: FakeInbox, flaky: u32) -> (TestEngine, Commits) {
    let cfg = EngineConfig::default()
        .with_commit(1, Duration::from_secs(60))
        .with_retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(1))
                .max_delay(Duration::from_millis(2))
                .min_delay(Duration::from_millis(1))
                .max_attempts(4)
                .build()
                .unwrap(),
        );
    engine_with(msgs, inbox, flaky, cfg)
}

fn engine_with(
    msgs: Vec<ReceivedMessage>,
    inbox: FakeInbox,
    flaky: u32,
    cfg: EngineConfig,
) -> (TestEngine, Commits) {
    let commits = Arc::new(Mutex::new(vec![]));
    let source = FakeSource {
        queue: Mutex::new(msgs.into()),
        commits: commits.clone(),
        log: inbox.log.clone(),
    };
    let handler = ScriptedHandler {
        transient_failures_left: Mutex::new(flaky),
    };
    let cfg = cfg.with_poll_timeout(Duration::from_millis(1));
    let e =
        ConsumerEngine::new(source, InboxProcessor::new("proj", inbox, handler), cfg, 1).unwrap();
    (e, commits)
}

#[tokio::test]
async fn duplicates_are_absorbed_and_effects_applied_once() {
    let a = ev("a", 1);
    let b = ev("b", 1);
    let inbox = FakeInbox::default();
    let (mut eng, commits) = engine(
        vec![msg(0, &a), msg(1, &b), msg(2, &a), msg(3, &b)],
        inbox.clone(),
        0,
    );
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.duplicates), (2, 2));
    assert_eq!(*inbox.effects.lock().unwrap(), vec![a.event_id, b.event_id]);
    assert_eq!(commits.lock().unwrap().last().unwrap().2, 4);
}

#[tokio::test]
async fn offset_is_committed_only_after_the_transaction() {
    let a = ev("a", 1);
    let inbox = FakeInbox::default();
    let (mut eng, _) = engine(vec![msg(7, &a)], inbox.clone(), 0);
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    let log = inbox.log.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![
            format!("tx-commit {}", a.event_id),
            "offset-commit 8".to_string()
        ]
    );
}

#[tokio::test]
async fn transient_handler_failures_are_retried_without_registering() {
    let f = ev("flaky", 1);
    let inbox = FakeInbox::default();
    let (mut eng, _) = engine(vec![msg(0, &f)], inbox.clone(), 2);
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!((rep.applied, rep.retries), (1, 2));
    assert_eq!(inbox.effects.lock().unwrap().len(), 1);
}

#[tokio::test]
async fn permanent_failure_stops_before_its_offset_and_registers_nothing() {
    let a = ev("a", 1);
    let p = ev("poison", 1);
    let b = ev("b", 1);
    let inbox = FakeInbox::default();
    let (mut eng, commits) = engine(vec![msg(0, &a), msg(1, &p), msg(2, &b)], inbox.clone(), 0);
    let err = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap_err();
    match err {
        EngineError::Unprocessable { position, reason } => {
            assert_eq!(position.offset, 1);
            assert!(reason.contains("schema violation"));
        }
        e => panic!("{e:?}"),
    }
    assert!(!inbox
        .committed
        .lock()
        .unwrap()
        .iter()
        .any(|(_, id)| *id == p.event_id));
    let max = commits.lock().unwrap().iter().map(|c| c.2).max().unwrap();
    assert_eq!(max, 1, "offset 1 (the poison) must remain uncommitted");
}

#[tokio::test]
async fn transient_failures_past_the_limit_stop_the_engine() {
    let f = ev("flaky", 1);
    let (mut eng, commits) = engine(vec![msg(0, &f)], FakeInbox::default(), 100);
    assert!(matches!(
        eng.run_until_quiet(Duration::from_millis(20)).await,
        Err(EngineError::Unprocessable { .. })
    ));
    assert!(commits.lock().unwrap().iter().all(|c| c.2 == 0));
}

#[tokio::test]
async fn undecodable_message_is_a_typed_stop_not_a_panic() {
    let a = ev("a", 1);
    let bad = ReceivedMessage::new(
        LogPosition {
            topic: "t".into(),
            partition: 0,
            offset: 1,
        },
        None,
        Err(DecodeError::MissingHeader("event_id")),
    );
    let (mut eng, commits) = engine(vec![msg(0, &a), bad], FakeInbox::default(), 0);
    let err = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("event_id"), "{err}");
    assert_eq!(commits.lock().unwrap().last().unwrap().2, 1);
}

#[test]
fn bad_config_is_rejected() {
    let cfg = EngineConfig::default().with_commit(0, Duration::from_secs(1));
    assert!(cfg.validate().is_err());
    let cfg = EngineConfig::default().with_poll_timeout(Duration::ZERO);
    assert!(cfg.validate().is_err());
}

/// A source whose polls fail transiently `failures` times, then yields one message.
struct FailingSource {
    failures: Mutex<u32>,
    polls: Mutex<u32>,
    msg: Mutex<Option<ReceivedMessage>>,
}

#[async_trait]
impl MessageSource for FailingSource {
    async fn poll(&self, _: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        *self.polls.lock().unwrap() += 1;
        let mut f = self.failures.lock().unwrap();
        if *f > 0 {
            *f -= 1;
            return Err(SourceError::new(
                outbox_core::ErrorClass::Transient,
                "broker down",
            ));
        }
        Ok(self.msg.lock().unwrap().take())
    }
    async fn commit(&self, _: &[(String, i32, i64)]) -> Result<(), SourceError> {
        Ok(())
    }
}

#[tokio::test]
async fn transient_poll_failures_back_off_instead_of_spinning() {
    let a = ev("a", 1);
    let source = FailingSource {
        failures: Mutex::new(3),
        polls: Mutex::new(0),
        msg: Mutex::new(Some(msg(0, &a))),
    };
    let handler = ScriptedHandler {
        transient_failures_left: Mutex::new(0),
    };
    let cfg = EngineConfig::default().with_retry(
        RetryPolicy::builder()
            .base(Duration::from_millis(20))
            .min_delay(Duration::from_millis(20))
            .build()
            .unwrap(),
    );
    let mut eng = ConsumerEngine::new(
        source,
        InboxProcessor::new("proj", FakeInbox::default(), handler),
        cfg,
        3,
    )
    .unwrap();
    let started = std::time::Instant::now();
    for _ in 0..3 {
        assert!(!eng.step().await.unwrap());
    }
    // Three failed polls slept at least min_delay each.
    assert!(started.elapsed() >= Duration::from_millis(60));
    assert!(eng.step().await.unwrap());
    assert_eq!(eng.report().applied, 1);
}

#[tokio::test]
async fn buffered_messages_are_applied_in_one_transaction() {
    let events: Vec<Envelope> = (0..10).map(|i| ev(&format!("a{i}"), 1)).collect();
    let mut msgs: Vec<ReceivedMessage> = events
        .iter()
        .enumerate()
        .map(|(i, e)| msg(i as i64, e))
        .collect();
    msgs.push(msg(10, &events[3])); // a redelivery inside the same batch
    let inbox = FakeInbox::default();
    let (mut eng, commits) = engine(msgs, inbox.clone(), 0);
    let rep = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!((rep.received, rep.applied, rep.duplicates), (11, 10, 1));
    assert_eq!(
        *inbox.commits.lock().unwrap(),
        1,
        "one transaction for the batch"
    );
    assert_eq!(inbox.effects.lock().unwrap().len(), 10);
    assert_eq!(commits.lock().unwrap().last().unwrap().2, 11);
}

#[tokio::test]
async fn a_failing_event_rolls_the_batch_back_and_the_rest_is_applied_one_by_one() {
    let a = ev("a", 1);
    let p = ev("poison", 1);
    let b = ev("b", 1);
    let inbox = FakeInbox::default();
    let (mut eng, commits) = engine(vec![msg(0, &a), msg(1, &p), msg(2, &b)], inbox.clone(), 0);
    let err = eng
        .run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(
        matches!(err, EngineError::Unprocessable { ref position, .. } if position.offset == 1),
        "{err}"
    );
    // a was applied alone after the batch rolled back; the poison and b were not.
    assert_eq!(*inbox.effects.lock().unwrap(), vec![a.event_id]);
    assert!(!inbox
        .committed
        .lock()
        .unwrap()
        .iter()
        .any(|(_, id)| *id == b.event_id));
    assert_eq!(commits.lock().unwrap().iter().map(|c| c.2).max(), Some(1));
}

#[tokio::test]
async fn max_batch_one_uses_one_transaction_per_message() {
    let events: Vec<Envelope> = (0..4).map(|i| ev(&format!("a{i}"), 1)).collect();
    let msgs = events
        .iter()
        .enumerate()
        .map(|(i, e)| msg(i as i64, e))
        .collect::<Vec<_>>();
    let inbox = FakeInbox::default();
    let cfg = EngineConfig::default().with_max_batch(1);
    let (mut eng, _) = engine_with(msgs, inbox.clone(), 0, cfg);
    eng.run_until_quiet(Duration::from_millis(20))
        .await
        .unwrap();
    assert_eq!(*inbox.commits.lock().unwrap(), 4);
    assert!(EngineConfig::default()
        .with_max_batch(0)
        .validate()
        .is_err());
}
