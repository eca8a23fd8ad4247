//! Setup shared by the adversarial tests of the consumer side (`adversary.rs`,
//! `adversary_retry.rs`): one schema per test, the effect handler with its gates and faults,
//! and the message sources the tests drive.
#![allow(dead_code, unused_imports, unused_macros)]

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::watermark::SharedOffsetTracker;
use outbox_core::{
    async_trait, wire, CommitOffset, Envelope, InboxParking, LogPosition, MessageSource, ParkKind,
    ParkedFilter, ParkedStatus, PartitionLag, Publisher, ReceivedMessage, RetryPolicy, SourceError,
};
use outbox_inbox::{
    ConsumerEngine, EngineConfig, EngineReport, Handler, HandlerError, InboxProcessor,
    ParkedMessages, VersionPolicy,
};
use outbox_postgres::{map_sqlx_error, PostgresInboxStore};
use outbox_testkit::MemoryLog;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres, Transaction};
use tokio::sync::Semaphore;

pub(crate) type PgTx = Transaction<'static, Postgres>;

// ---------------------------------------------------------------------------------------------
// Setup
// ---------------------------------------------------------------------------------------------

/// One test's schema, with its pool (connections named after the schema, so the test can see
/// its own sessions waiting on locks).
pub(crate) struct Ctx {
    pub(crate) pool: PgPool,
    pub(crate) schema: String,
}

impl Ctx {
    pub(crate) async fn new(test: &str) -> Option<Self> {
        let url = outbox_test_support::database_url(test)?;
        let schema = outbox_test_support::unique("cadv");
        let opts: PgConnectOptions = url.parse().expect("DATABASE_URL");
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts.application_name(&schema))
            .await
            .expect("connect to PostgreSQL");
        let ctx = Self { pool, schema };
        let s = &ctx.schema;
        sqlx::raw_sql(&format!(
            "CREATE SCHEMA \"{s}\";
             CREATE TABLE \"{s}\".effects (seq bigserial PRIMARY KEY, dedup_id uuid NOT NULL,
                 aggregate_id text NOT NULL, version bigint NOT NULL);
             CREATE TABLE \"{s}\".fixes (id text PRIMARY KEY);
             CREATE TABLE \"{s}\".uniq (id int PRIMARY KEY);
             INSERT INTO \"{s}\".uniq VALUES (1);"
        ))
        .execute(&ctx.pool)
        .await
        .expect("test tables");
        Some(ctx)
    }

    pub(crate) async fn inbox(&self) -> PostgresInboxStore {
        let inbox = PostgresInboxStore::builder(self.pool.clone())
            .schema(&self.schema)
            .build()
            .expect("build");
        inbox.migrate().await.expect("migrate");
        inbox
    }

    /// Versions applied for `agg`, in the order they were applied.
    pub(crate) async fn applied(&self, agg: &str) -> Vec<i64> {
        sqlx::query_scalar(&format!(
            "SELECT version FROM \"{}\".effects WHERE aggregate_id = $1 ORDER BY seq",
            self.schema
        ))
        .bind(agg)
        .fetch_all(&self.pool)
        .await
        .unwrap()
    }

    /// Asserts that no effect was applied twice; returns the number of effects.
    pub(crate) async fn effects_once(&self) -> i64 {
        let twice: Vec<(uuid::Uuid, i64)> = sqlx::query_as(&format!(
            "SELECT dedup_id, count(*) FROM \"{}\".effects GROUP BY dedup_id HAVING count(*) > 1",
            self.schema
        ))
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert!(
            twice.is_empty(),
            "effects applied more than once: {twice:?}"
        );
        sqlx::query_scalar(&format!("SELECT count(*) FROM \"{}\".effects", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub(crate) async fn fix(&self, agg: &str) {
        sqlx::query(&format!(
            "INSERT INTO \"{}\".fixes VALUES ($1) ON CONFLICT DO NOTHING",
            self.schema
        ))
        .bind(agg)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    /// Waits until one of this test's sessions waits on a lock held by another session.
    pub(crate) async fn wait_until_blocked(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND cardinality(pg_blocking_pids(pid)) > 0",
            )
            .bind(&self.schema)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            if n > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no session of this test became blocked"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(crate) async fn drop(self) {
        let _ = sqlx::query(&format!("DROP SCHEMA \"{}\" CASCADE", self.schema))
            .execute(&self.pool)
            .await;
        self.pool.close().await;
    }
}

macro_rules! ctx {
    ($test:expr) => {
        match Ctx::new($test).await {
            Some(c) => c,
            None => return,
        }
    };
}

/// The aggregate row of `agg` for this test's consumer: (applied version, blocked).
pub(crate) async fn agg_state(ctx: &Ctx, agg: &str) -> (Option<i64>, bool) {
    sqlx::query_as(&format!(
        "SELECT applied_version, blocked FROM \"{}\".processed_events_aggregates \
         WHERE consumer = $1 AND aggregate_type = 'order' AND aggregate_id = $2",
        ctx.schema
    ))
    .bind(GROUP)
    .bind(agg)
    .fetch_optional(&ctx.pool)
    .await
    .unwrap()
    .unwrap_or((None, false))
}

pub(crate) async fn status(
    inbox: &outbox_postgres::PostgresInboxStore,
    id: outbox_core::ParkedId,
) -> ParkedStatus {
    inbox
        .parked_message(GROUP, id)
        .await
        .unwrap()
        .expect("parked message")
        .status
}

pub(crate) async fn all_parked(
    inbox: &outbox_postgres::PostgresInboxStore,
) -> Vec<outbox_core::ParkedMessage> {
    inbox
        .list_parked(GROUP, &ParkedFilter::open().all())
        .await
        .unwrap()
}

/// Holds the aggregate row of `agg` locked (FOR UPDATE) in a test transaction, so operator
/// transactions queue behind it and start together when it ends.
pub(crate) async fn lock_aggregate(ctx: &Ctx, agg: &str) -> PgTx {
    let mut tx = ctx.pool.begin().await.unwrap();
    let n: Option<i32> = sqlx::query_scalar(&format!(
        "SELECT 1 FROM \"{}\".processed_events_aggregates \
         WHERE consumer = $1 AND aggregate_type = 'order' AND aggregate_id = $2 FOR UPDATE",
        ctx.schema
    ))
    .bind(GROUP)
    .bind(agg)
    .fetch_optional(&mut *tx)
    .await
    .unwrap();
    assert!(n.is_some(), "the aggregate row exists");
    tx
}

/// Waits until `n` sessions of this test wait on a lock.
pub(crate) async fn wait_blocked(ctx: &Ctx, n: usize) -> Vec<i32> {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let found: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
             AND cardinality(pg_blocking_pids(pid)) > 0",
        )
        .bind(&ctx.schema)
        .fetch_all(&ctx.pool)
        .await
        .unwrap();
        if found.len() >= n {
            return found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} sessions did not become blocked"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The handler: one effect row per event, in the effect's transaction.
///
/// * `poison*` aggregates fail permanently until a row in `fixes` names them;
/// * an aggregate with a gate waits on it (counting in `entered`) before writing;
/// * `swallow*` aggregates, while `swallow` is set, run a statement that fails and ignore the
///   error (the "insert, and treat a unique violation as already done" idiom), which leaves
///   PostgreSQL's transaction aborted.
#[derive(Clone)]
pub(crate) struct Effects {
    pub(crate) schema: String,
    pub(crate) gates: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
    pub(crate) entered: Arc<AtomicUsize>,
    pub(crate) swallow: Arc<AtomicBool>,
    /// Every handler call takes this long (milliseconds), so batches are in flight.
    pub(crate) delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Wait on the gate before deciding to fail (so a retry that fails again can be held open);
    /// by default the gate is after the check.
    pub(crate) gate_first: bool,
}

impl Effects {
    pub(crate) fn new(ctx: &Ctx) -> Self {
        Self {
            schema: ctx.schema.clone(),
            gates: Arc::default(),
            entered: Arc::default(),
            swallow: Arc::new(AtomicBool::new(true)),
            delay_ms: Arc::default(),
            gate_first: false,
        }
    }

    /// As [`Effects::new`], with the gate before the check.
    pub(crate) fn gated_first(ctx: &Ctx) -> Self {
        Self {
            gate_first: true,
            ..Self::new(ctx)
        }
    }

    async fn delay_and_gate(&self, e: &Envelope) {
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let gate = self.gates.lock().unwrap().get(&e.aggregate_id).cloned();
        if let Some(g) = gate {
            self.entered.fetch_add(1, Ordering::SeqCst);
            g.acquire().await.expect("gate").forget();
        }
    }

    /// Closes a gate on `agg`; returns it (add permits to open it).
    pub(crate) fn gate(&self, agg: &str) -> Arc<Semaphore> {
        let g = Arc::new(Semaphore::new(0));
        self.gates.lock().unwrap().insert(agg.to_owned(), g.clone());
        g
    }

    pub(crate) async fn wait_entered(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.entered.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "the handler was not entered");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

#[async_trait]
impl Handler<PgTx> for Effects {
    async fn handle(&self, tx: &mut PgTx, e: &Envelope) -> Result<(), HandlerError> {
        let s = &self.schema;
        let err = |e: sqlx::Error| HandlerError::from(map_sqlx_error(e));
        if self.gate_first {
            self.delay_and_gate(e).await;
        }
        if e.aggregate_id.starts_with("poison") {
            let fixed: Option<i32> =
                sqlx::query_scalar(&format!("SELECT 1 FROM \"{s}\".fixes WHERE id = $1"))
                    .bind(&e.aggregate_id)
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(err)?;
            if fixed.is_none() {
                return Err(HandlerError::permanent("unknown customer"));
            }
        }
        if !self.gate_first {
            self.delay_and_gate(e).await;
        }
        sqlx::query(&format!(
            "INSERT INTO \"{s}\".effects (dedup_id, aggregate_id, version) VALUES ($1, $2, $3)"
        ))
        .bind(e.dedup_id().as_uuid())
        .bind(&e.aggregate_id)
        .bind(e.aggregate_version)
        .execute(&mut **tx)
        .await
        .map_err(err)?;
        if e.aggregate_id.starts_with("swallow") && self.swallow.load(Ordering::SeqCst) {
            // "Already there? Fine." The error is ignored; PostgreSQL aborted the transaction.
            let _ = sqlx::query(&format!("INSERT INTO \"{s}\".uniq VALUES (1)"))
                .execute(&mut **tx)
                .await;
        }
        Ok(())
    }
}

pub(crate) fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .json(&serde_json::json!({ "v": v }))
        .unwrap()
        .build()
        .unwrap()
}

pub(crate) fn retry_fast(max_attempts: u32) -> RetryPolicy {
    RetryPolicy::builder()
        .base(Duration::from_millis(1))
        .max_delay(Duration::from_millis(2))
        .min_delay(Duration::from_millis(1))
        .max_attempts(max_attempts)
        .build()
        .unwrap()
}

/// Commits after every final message; fast retries.
pub(crate) fn fast() -> EngineConfig {
    EngineConfig::default()
        .with_commit(1, Duration::from_secs(60))
        .with_poll_timeout(Duration::from_millis(5))
        .with_retry(retry_fast(3))
}

pub(crate) const GROUP: &str = "proj";

pub(crate) fn processor(
    inbox: &PostgresInboxStore,
    h: &Effects,
    policy: VersionPolicy,
) -> InboxProcessor<PostgresInboxStore, Effects> {
    InboxProcessor::new(GROUP, inbox.clone(), h.clone()).with_version_policy(policy)
}

pub(crate) type Engine<S> = ConsumerEngine<S, PostgresInboxStore, Effects>;

pub(crate) fn engine<S: MessageSource>(
    source: S,
    inbox: &PostgresInboxStore,
    h: &Effects,
    policy: VersionPolicy,
    cfg: EngineConfig,
) -> Engine<S> {
    ConsumerEngine::new(source, processor(inbox, h, policy), cfg, 7).unwrap()
}

pub(crate) async fn quiet<S: MessageSource>(eng: &mut Engine<S>) -> EngineReport {
    eng.run_until_quiet(Duration::from_millis(60))
        .await
        .unwrap()
}

pub(crate) fn operator(
    inbox: &PostgresInboxStore,
    h: &Effects,
    policy: VersionPolicy,
) -> ParkedMessages<PostgresInboxStore, Effects> {
    ParkedMessages::new(processor(inbox, h, policy))
}

pub(crate) async fn open_parked(inbox: &PostgresInboxStore) -> Vec<outbox_core::ParkedMessage> {
    inbox
        .list_parked(GROUP, &ParkedFilter::open())
        .await
        .unwrap()
}

/// Runs `eng` in a task until the returned sender fires; the task hands the engine back.
pub(crate) fn spawn_engine<S>(
    mut eng: Engine<S>,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<(Engine<S>, EngineReport)>,
)
where
    S: MessageSource + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let report = eng
            .run(async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        (eng, report)
    });
    (tx, task)
}

pub(crate) async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A source that delegates to `inner` but whose offset commits never return (the process dies
/// in the middle of them), or fail transiently while `fail` is set.
pub(crate) struct CommitControl<S> {
    pub(crate) inner: S,
    pub(crate) hang: bool,
    pub(crate) fail: Arc<AtomicBool>,
    pub(crate) commits: Arc<Mutex<Vec<CommitOffset>>>,
}

impl<S> CommitControl<S> {
    pub(crate) fn hanging(inner: S) -> Self {
        Self {
            inner,
            hang: true,
            fail: Arc::default(),
            commits: Arc::default(),
        }
    }
}

#[async_trait]
impl<S: MessageSource> MessageSource for CommitControl<S> {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        self.inner.poll(timeout).await
    }
    async fn commit(&self, offsets: &[CommitOffset]) -> Result<(), SourceError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        if self.fail.load(Ordering::SeqCst) {
            return Err(SourceError::new(
                outbox_core::ErrorClass::Transient,
                "coordinator not available",
            ));
        }
        self.commits.lock().unwrap().extend(offsets.iter().cloned());
        self.inner.commit(offsets).await
    }
    fn attach_offsets(&self, offsets: SharedOffsetTracker) {
        self.inner.attach_offsets(offsets);
    }
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        self.inner.lag().await
    }
}

/// A source fed by the test (messages pushed at any time), recording successful commits.
#[derive(Clone, Default)]
pub(crate) struct Scripted {
    pub(crate) queue: Arc<Mutex<VecDeque<ReceivedMessage>>>,
}

impl Scripted {
    pub(crate) fn push(&self, offset: i64, e: &Envelope) {
        self.queue.lock().unwrap().push_back(ReceivedMessage::new(
            LogPosition::new("t", 0, offset),
            None,
            Ok(e.clone()),
        ));
    }
}

#[async_trait]
impl MessageSource for Scripted {
    async fn poll(&self, timeout: Duration) -> Result<Option<ReceivedMessage>, SourceError> {
        let m = self.queue.lock().unwrap().pop_front();
        if m.is_none() {
            tokio::time::sleep(timeout.min(Duration::from_millis(2))).await;
        }
        Ok(m)
    }
    async fn commit(&self, _: &[CommitOffset]) -> Result<(), SourceError> {
        Ok(())
    }
    fn attach_offsets(&self, _: SharedOffsetTracker) {}
    async fn lag(&self) -> Result<Vec<PartitionLag>, SourceError> {
        Ok(Vec::new())
    }
}

// ---------------------------------------------------------------------------------------------
// The broker (tests that need `KAFKA_BROKERS`)
// ---------------------------------------------------------------------------------------------

/// Creates `topic` with `partitions` and waits until its metadata shows them.
pub(crate) async fn create_topic(brokers: &str, topic: &str, partitions: i32) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("admin client");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &opts,
        )
        .await
        .expect("create_topics")
    {
        r.unwrap_or_else(|(t, code)| panic!("creating topic {t}: {code}"));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let md = admin
            .inner()
            .fetch_metadata(Some(topic), Duration::from_secs(5))
            .expect("metadata");
        if md.topics().iter().any(|t| {
            t.name() == topic && t.error().is_none() && t.partitions().len() == partitions as usize
        }) {
            return;
        }
        assert!(Instant::now() < deadline, "topic {topic} did not appear");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) fn kafka_source(brokers: &str, group: &str, topic: &str) -> outbox_kafka::KafkaSource {
    outbox_kafka::KafkaSource::builder(brokers, group)
        .topic(topic)
        .session_timeout(Duration::from_secs(6))
        .build()
        .expect("source")
}

/// The group's committed next offset of one partition (`None`: nothing committed), read with a
/// plain client of that group id that never joins it.
pub(crate) async fn group_committed(
    brokers: &str,
    group: &str,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let (brokers, group, topic) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("consumer");
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition(&topic, partition);
        let got = c.committed_offsets(tpl, Duration::from_secs(5)).ok()?;
        match got.elements()[0].offset() {
            rdkafka::Offset::Offset(o) => Some(o),
            _ => None,
        }
    })
    .await
    .unwrap()
}
