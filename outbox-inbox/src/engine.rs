//! [`ConsumerEngine`]: polls a source, applies messages in concurrent batches (an aggregate in
//! at most one batch at a time, so in order), parks what cannot be applied, and commits offsets
//! along the contiguous watermark.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use outbox_core::retention::{RetentionCheck, TopicRetention};
use outbox_core::watermark::{BeginKind, SharedOffsetTracker, Ticket};
use outbox_core::{
    AckModel, AggregateKey, Classify, CommitOffset, ConfigError, ErrorClass, InboxParking,
    LogPosition, MessageSource, ParkKind, ReceivedMessage, RetryPolicy, SourceError,
    SourceErrorKind, StoreError, TopicPartition,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tracing::{debug, error, info, warn};

use crate::handler::Handler;
use crate::metrics;
use crate::operator::ParkedMessages;
use crate::processor::{BatchResult, Force, InboxProcessor, Item, MessageOutcome, VersionPolicy};

/// Scheduled inbox cleanup, run by the engine between batches.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanupSchedule {
    /// The dedup window: registrations older than this are removed. It must cover the longest
    /// possible redelivery ([`ConsumerEngine::retention_check`]).
    pub retention: Duration,
    /// Registrations removed per transaction. Default 1,000.
    pub batch_size: usize,
    /// How often a cleanup run starts. Default 10 minutes. A run removes batch after batch
    /// (one per engine step, so applying never waits long) until a batch comes back short.
    pub every: Duration,
}

impl CleanupSchedule {
    /// Cleanup of registrations older than `retention`, 1,000 per transaction, every 10 minutes.
    pub fn new(retention: Duration) -> Self {
        Self {
            retention,
            batch_size: 1_000,
            every: Duration::from_secs(600),
        }
    }

    /// Sets the batch size.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Sets how often a run starts.
    pub fn every(mut self, d: Duration) -> Self {
        self.every = d;
        self
    }
}

/// Engine configuration.
///
/// | field | default | meaning |
/// |---|---|---|
/// | `poll_timeout` | 100 ms | longest wait of one poll |
/// | `retry` | [`RetryPolicy::default`] | backoff of transient failures; a handler failing `max_attempts` times (or permanently) parks its message; store failures are retried without limit |
/// | `commit_interval` | 1 s | commit offsets at least this often while messages flow |
/// | `commit_every` | 500 | commit after this many final messages |
/// | `max_batch` | 100 | most messages applied in one database transaction |
/// | `concurrency` | 4 | batch transactions in flight at once (an aggregate is in at most one) |
/// | `max_in_flight` | 5,000 | most messages received and not final (queued or running; held messages are bounded apart, by [`VersionPolicy::Hold`]'s `max_held`) before the engine pauses the partitions that hold them (a source that cannot pause: before polling stops) |
/// | `max_in_flight_per_partition` | 1,000 | most messages of one partition received and not final (held ones apart; at most half of `max_in_flight`, so that one full partition never holds up the others) before that partition alone is paused (resumed at half); the others, and polling, go on |
/// | `cleanup` | none | scheduled inbox cleanup ([`CleanupSchedule`]) |
/// | `metrics_interval` | 15 s | how often lag and parked counts are read for the gauges |
/// | `shutdown_grace` | 10 s | how long [`ConsumerEngine::run`] waits for running transactions after the shutdown signal |
/// | `retry_requests_interval` | 5 s | how often the engine looks for retries requested by an operator ([`ParkedMessages::request_retry`], `outbox parked retry --consumer`) and performs them with its handler (also right at start) |
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// Longest wait of one poll.
    pub poll_timeout: Duration,
    /// Backoff and attempt limit.
    pub retry: RetryPolicy,
    /// Commit at least this often.
    pub commit_interval: Duration,
    /// Commit after this many final messages.
    pub commit_every: usize,
    /// Most messages per transaction.
    pub max_batch: usize,
    /// Batch transactions in flight at once.
    pub concurrency: usize,
    /// Most messages not final (held ones apart).
    pub max_in_flight: usize,
    /// Most messages of one partition not final (held ones apart) before it is paused.
    pub max_in_flight_per_partition: usize,
    /// Scheduled cleanup.
    pub cleanup: Option<CleanupSchedule>,
    /// Gauge refresh interval.
    pub metrics_interval: Duration,
    /// Wait for running transactions at shutdown.
    pub shutdown_grace: Duration,
    /// How often requested retries are looked for and performed.
    pub retry_requests_interval: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            poll_timeout: Duration::from_millis(100),
            retry: RetryPolicy::default(),
            commit_interval: Duration::from_secs(1),
            commit_every: 500,
            max_batch: 100,
            concurrency: 4,
            max_in_flight: 5_000,
            max_in_flight_per_partition: 1_000,
            cleanup: None,
            metrics_interval: Duration::from_secs(15),
            shutdown_grace: Duration::from_secs(10),
            retry_requests_interval: Duration::from_secs(5),
        }
    }
}

impl EngineConfig {
    /// Sets the retry policy.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }
    /// Sets the commit cadence.
    pub fn with_commit(mut self, every: usize, interval: Duration) -> Self {
        self.commit_every = every;
        self.commit_interval = interval;
        self
    }
    /// Sets the largest batch applied in one transaction (1 = one transaction per message).
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }
    /// Sets the poll timeout.
    pub fn with_poll_timeout(mut self, t: Duration) -> Self {
        self.poll_timeout = t;
        self
    }
    /// Sets how many batch transactions may be in flight at once.
    pub fn with_concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// Sets the most messages received and not final.
    pub fn with_max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }
    /// Sets the most messages of one partition received and not final before that partition
    /// is paused.
    pub fn with_max_in_flight_per_partition(mut self, n: usize) -> Self {
        self.max_in_flight_per_partition = n;
        self
    }
    /// Schedules inbox cleanup.
    pub fn with_cleanup(mut self, schedule: CleanupSchedule) -> Self {
        self.cleanup = Some(schedule);
        self
    }
    /// Sets the gauge refresh interval.
    pub fn with_metrics_interval(mut self, d: Duration) -> Self {
        self.metrics_interval = d;
        self
    }
    /// Sets the shutdown grace.
    pub fn with_shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }
    /// Sets how often requested retries are looked for (and performed).
    pub fn with_retry_requests_interval(mut self, d: Duration) -> Self {
        self.retry_requests_interval = d;
        self
    }
    /// Validates.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.commit_every == 0 {
            return Err(ConfigError::new("commit_every must be at least 1"));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::new("max_batch must be at least 1"));
        }
        if self.concurrency == 0 {
            return Err(ConfigError::new("concurrency must be at least 1"));
        }
        if self.max_in_flight < self.max_batch {
            return Err(ConfigError::new(format!(
                "max_in_flight ({}) must be at least max_batch ({})",
                self.max_in_flight, self.max_batch
            )));
        }
        if self.max_in_flight_per_partition == 0 {
            return Err(ConfigError::new(
                "max_in_flight_per_partition must be at least 1",
            ));
        }
        if self.poll_timeout.is_zero() {
            return Err(ConfigError::new("poll_timeout must be greater than zero"));
        }
        if self.metrics_interval.is_zero() {
            return Err(ConfigError::new(
                "metrics_interval must be greater than zero",
            ));
        }
        if self.retry_requests_interval.is_zero() {
            return Err(ConfigError::new(
                "retry_requests_interval must be greater than zero",
            ));
        }
        if let Some(c) = &self.cleanup {
            if c.batch_size == 0 || c.every.is_zero() || c.retention.is_zero() {
                return Err(ConfigError::new(
                    "cleanup needs a retention, a batch size and an interval above zero",
                ));
            }
        }
        Ok(())
    }
}

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The group's committed offset fell below the earliest available offset: records were
    /// deleted by retention before this consumer read them. The message names the partitions
    /// and the gap. Nothing was skipped; decide how to recover (replay from the outbox, reset
    /// the group knowingly) before starting again.
    #[error("consumer lost records to retention: {0}")]
    RetentionGap(SourceError),
    /// The source failed permanently.
    #[error(transparent)]
    Source(SourceError),
    /// The store failed permanently.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<SourceError> for EngineError {
    fn from(e: SourceError) -> Self {
        if e.kind == SourceErrorKind::RetentionGap {
            Self::RetentionGap(e)
        } else {
            Self::Source(e)
        }
    }
}

/// Totals of a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineReport {
    /// Messages received.
    pub received: u64,
    /// Effects applied.
    pub applied: u64,
    /// Duplicates absorbed (effect not repeated).
    pub duplicates: u64,
    /// Versions at or below the applied one, not applied again.
    pub stale: u64,
    /// Messages parked as an aggregate's head (or standalone).
    pub parked: u64,
    /// Messages parked waiting behind a head.
    pub waiting: u64,
    /// Redeliveries of messages parked before.
    pub already_parked: u64,
    /// Messages held for a version gap right now.
    pub held: u64,
    /// Transient failures retried.
    pub retries: u64,
    /// Offset commits made.
    pub commits: u64,
    /// Final deliveries handed to a per-message source to acknowledge ahead of the watermark
    /// ([`MessageSource::ack_ahead`]).
    pub acked_ahead: u64,
    /// Offset commits dropped because the group rebalanced.
    pub dropped_commits: u64,
    /// Log rewinds seen.
    pub rewinds: u64,
    /// Registrations removed by the scheduled cleanup.
    pub cleaned: u64,
    /// Retries requested by an operator and performed (applied, or failed again and audited).
    pub requested_retries: u64,
}

impl EngineReport {
    /// Duplicates among the messages whose outcome is final and that were not parked.
    pub fn duplicate_share(&self) -> f64 {
        let total = self.applied + self.duplicates + self.stale;
        if total == 0 {
            0.0
        } else {
            (self.duplicates + self.stale) as f64 / total as f64
        }
    }
}

/// The partition a message was read from.
fn msg_partition(m: &ReceivedMessage) -> TopicPartition {
    m.position.topic_partition()
}

/// What orders messages: an aggregate (its messages apply one batch at a time, in order), or a
/// message whose aggregate is unknown (undecodable, no readable aggregate headers), alone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Key {
    Aggregate(AggregateKey),
    Alone(u64),
}

/// One received message on its way through a batch.
struct Work {
    ticket: Ticket,
    msg: ReceivedMessage,
    key: Key,
    attempts: u32,
    force: Force,
    held_since: Option<Instant>,
}

impl Work {
    fn version(&self) -> i64 {
        self.msg
            .envelope
            .as_ref()
            .map_or(i64::MIN, |e| e.aggregate_version)
    }
}

/// The messages of one key that are not in flight.
#[derive(Default)]
struct KeyQueue {
    items: VecDeque<Work>,
    /// A batch holding messages of this key is running.
    busy: bool,
    /// A transient failure: not before this instant.
    retry_at: Option<Instant>,
}

/// What a batch task hands back.
struct BatchDone {
    /// Messages whose outcome is known.
    results: Vec<(Work, MessageOutcome)>,
    /// Messages handed back unprocessed: a transient handler failure of the first of them,
    /// and the later messages of its key, to try again after `retry_after`.
    returned: Vec<Work>,
    retry_after: Duration,
    retries: u64,
    error: Option<EngineError>,
}

type BatchFuture = Pin<Box<dyn Future<Output = BatchDone> + Send>>;

struct Shared<I, H> {
    processor: Arc<InboxProcessor<I, H>>,
    retry: RetryPolicy,
    rng: Mutex<StdRng>,
}

impl<I, H> Shared<I, H> {
    fn backoff(&self, failures: u32) -> Duration {
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        self.retry.backoff(failures, &mut *rng)
    }
}

/// Applies a batch in one transaction. A handler failure rolls it back; the failing message is
/// then parked (permanent, or attempts exhausted) or handed back with the later messages of its
/// key for a delayed retry (transient), and the rest runs again at once. Transient store
/// failures are retried with backoff (the database coming back is only a matter of time).
async fn run_batch<I, H>(shared: Arc<Shared<I, H>>, mut items: Vec<Work>) -> BatchDone
where
    I: InboxParking,
    H: Handler<I::Tx>,
{
    let processor = &shared.processor;
    let consumer = processor.consumer().to_owned();
    let mut done = BatchDone {
        results: Vec::new(),
        returned: Vec::new(),
        retry_after: Duration::ZERO,
        retries: 0,
        error: None,
    };
    let mut store_failures = 0u32;
    while !items.is_empty() {
        let result = {
            let batch: Vec<Item<'_>> = items
                .iter()
                .map(|w| Item {
                    msg: &w.msg,
                    attempts: w.attempts,
                    force: &w.force,
                })
                .collect();
            processor
                .run_batch(&batch, true, Some(processor.store()))
                .await
        };
        match result {
            Ok(BatchResult::Committed(outcomes)) => {
                done.results.extend(items.drain(..).zip(outcomes));
            }
            Ok(BatchResult::Split { deferred }) => {
                // Decided on a premise that did not hold: handed back (in order, they are the
                // tail of their keys in this batch) and decided again on what is committed.
                store_failures = 0;
                let mut keep = Vec::with_capacity(items.len());
                for (i, w) in items.drain(..).enumerate() {
                    if deferred.contains(&i) {
                        done.returned.push(w);
                    } else {
                        keep.push(w);
                    }
                }
                items = keep;
            }
            Ok(BatchResult::Unregistrable { index, reason }) => {
                store_failures = 0;
                let w = &mut items[index];
                let pos = &w.msg.position;
                metrics::record_error(&consumer, "unregistrable");
                error!(consumer = %consumer, topic = %pos.topic, partition = pos.partition, offset = pos.offset, reason = %reason, stage = "register", "message cannot be deduplicated; parking it");
                w.force = Force::Park(ParkKind::Unprocessable, reason);
            }
            Ok(BatchResult::HandlerFailed { index, error: e }) => {
                store_failures = 0;
                let w = &mut items[index];
                w.attempts += 1;
                let permanent = e.class == ErrorClass::Permanent;
                metrics::record_error(
                    &consumer,
                    if permanent {
                        "handler_permanent"
                    } else {
                        "handler_transient"
                    },
                );
                let pos = w.msg.position.clone();
                if permanent || w.attempts >= shared.retry.max_attempts {
                    error!(consumer = %consumer, topic = %pos.topic, partition = pos.partition, offset = pos.offset, attempt = w.attempts, error = %e, stage = "apply", "message cannot be applied; parking it");
                    w.force = Force::Park(
                        ParkKind::Unprocessable,
                        format!("handler failed {} time(s): {e}", w.attempts),
                    );
                } else {
                    done.retries += 1;
                    let d = shared.backoff(w.attempts);
                    done.retry_after = done.retry_after.max(d);
                    warn!(consumer = %consumer, topic = %pos.topic, partition = pos.partition, offset = pos.offset, attempt = w.attempts, error = %e, delay_ms = d.as_millis() as u64, "handler failed; retrying later, its aggregate waits");
                    // The failing message and what follows it of its key wait; the others
                    // of the batch run again now.
                    let key = w.key.clone();
                    let mut keep = Vec::with_capacity(items.len());
                    for (i, w) in items.drain(..).enumerate() {
                        if i >= index && w.key == key {
                            done.returned.push(w);
                        } else {
                            keep.push(w);
                        }
                    }
                    items = keep;
                }
            }
            Err(e) if e.is_transient() => {
                store_failures = store_failures.saturating_add(1);
                done.retries += 1;
                metrics::record_error(&consumer, "store");
                let d = shared.backoff(store_failures);
                warn!(consumer = %consumer, attempt = store_failures, error = %e, delay_ms = d.as_millis() as u64, "inbox store failed; retrying the batch");
                tokio::time::sleep(d).await;
            }
            Err(e) => {
                metrics::record_error(&consumer, "store");
                done.error = Some(EngineError::Store(e));
                done.returned.append(&mut items);
                break;
            }
        }
    }
    done
}

enum Event {
    Done(BatchDone),
    Timer,
    Polled(Box<Result<Option<ReceivedMessage>, SourceError>>),
    Idle,
}

/// Polls a [`MessageSource`], applies messages through an [`InboxProcessor`] and commits
/// offsets along the contiguous watermark.
///
/// * **Concurrency.** Every aggregate has its own queue; a batch takes the queued messages of
///   several aggregates (up to `max_batch`) and applies them in one transaction; up to
///   `concurrency` batches run at once, and an aggregate is in at most one of them, so its
///   messages apply in order while different aggregates (of one partition or of several)
///   apply in parallel. A message whose handler fails transiently waits for its retry without
///   holding a transaction or anything but its own aggregate. The engine owns a
///   [`SharedOffsetTracker`]: an offset is final only when its message's transaction committed
///   (applied, duplicate, stale, or parked), and the committed offset of a partition never
///   passes a message that is not final.
/// * **Parking.** A message that cannot be decoded, whose handler fails permanently, or fails
///   transiently `retry.max_attempts` times, is parked in the inbox's database with its raw
///   record; its offset becomes final, the partition moves on. Later messages of its aggregate
///   are parked as waiting behind it; other aggregates flow. An operator releases them with
///   [`ParkedMessages`] ([`ConsumerEngine::parked`]).
/// * **Versions.** See [`VersionPolicy`] (on the processor).
/// * **Rebalances and rewinds.** The source hears of the tracker
///   ([`MessageSource::attach_offsets`]) and commits its final offsets on revoke; a commit
///   refused by a rebalance is dropped, not retried; an offset at or below the highest seen
///   starts a new epoch of its partition (see [`outbox_core::watermark`]).
pub struct ConsumerEngine<S, I, H> {
    source: S,
    shared: Arc<Shared<I, H>>,
    config: EngineConfig,
    tracker: SharedOffsetTracker,
    queues: HashMap<Key, KeyQueue>,
    /// Keys with queued messages that may run now, oldest first (may hold stale entries).
    ready: VecDeque<Key>,
    running: FuturesUnordered<BatchFuture>,
    held: HashMap<AggregateKey, Vec<Work>>,
    held_count: usize,
    in_flight: usize,
    /// Per partition: messages received and not final, held ones apart.
    pending: HashMap<TopicPartition, usize>,
    /// Partitions this engine paused and has not resumed.
    paused: BTreeSet<TopicPartition>,
    /// Whether the source can pause (`None`: not asked yet).
    can_pause: Option<bool>,
    /// The tracker's [`changes`](outbox_core::watermark::OffsetTracker::changes) when stale
    /// messages were last dropped.
    seen_changes: u64,
    next_alone: u64,
    pending_commits: BTreeMap<TopicPartition, CommitOffset>,
    /// The source acknowledges per message ([`AckModel::PerMessage`]): final deliveries are
    /// acknowledged ahead of the watermark.
    per_message: bool,
    /// Final deliveries to acknowledge ahead of the watermark at the next commit.
    ack_ahead: Vec<LogPosition>,
    rng: StdRng,
    report: EngineReport,
    since_commit: usize,
    last_commit: Instant,
    next_cleanup: Option<Instant>,
    cleanup_running: bool,
    next_metrics: Instant,
    next_retry_check: Instant,
    retry_task: Option<RetryTask>,
    poll_failures: u32,
}

/// The background run of requested retries: how many were performed.
type RetryTask = tokio::task::JoinHandle<Result<u64, StoreError>>;

impl<S, I, H> std::fmt::Debug for ConsumerEngine<S, I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerEngine")
            .field("consumer", &self.shared.processor.consumer())
            .field("report", &self.report)
            .field("in_flight", &self.in_flight)
            .finish_non_exhaustive()
    }
}

impl<S, I, H> ConsumerEngine<S, I, H>
where
    S: MessageSource,
    I: InboxParking + 'static,
    H: Handler<I::Tx> + 'static,
{
    /// An engine. Hands its offset tracker to `source`. `seed` seeds the retry jitter (pass a
    /// random value in production, a fixed one in tests).
    pub fn new(
        source: S,
        processor: InboxProcessor<I, H>,
        config: EngineConfig,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        if let VersionPolicy::Hold { max_held, max_wait } = processor.version_policy() {
            if max_held == 0 || max_wait.is_zero() {
                return Err(ConfigError::new(
                    "VersionPolicy::Hold needs max_held and max_wait above zero",
                ));
            }
        }
        let tracker = SharedOffsetTracker::new();
        source.attach_offsets(tracker.clone());
        let per_message = source.ack_model() == AckModel::PerMessage;
        let next_cleanup = config.cleanup.as_ref().map(|_| Instant::now());
        Ok(Self {
            source,
            shared: Arc::new(Shared {
                processor: Arc::new(processor),
                retry: config.retry.clone(),
                rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15)),
            }),
            tracker,
            queues: HashMap::new(),
            ready: VecDeque::new(),
            running: FuturesUnordered::new(),
            held: HashMap::new(),
            held_count: 0,
            in_flight: 0,
            pending: HashMap::new(),
            paused: BTreeSet::new(),
            can_pause: None,
            seen_changes: 0,
            next_alone: 0,
            pending_commits: BTreeMap::new(),
            per_message,
            ack_ahead: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            report: EngineReport::default(),
            since_commit: 0,
            last_commit: Instant::now(),
            next_cleanup,
            cleanup_running: false,
            next_metrics: Instant::now(),
            next_retry_check: Instant::now(),
            retry_task: None,
            poll_failures: 0,
            config,
        })
    }

    /// The engine's offset tracker (also held by the source).
    pub fn offset_tracker(&self) -> SharedOffsetTracker {
        self.tracker.clone()
    }

    /// Totals so far.
    pub fn report(&self) -> &EngineReport {
        &self.report
    }

    /// The processor.
    pub fn processor(&self) -> &InboxProcessor<I, H> {
        &self.shared.processor
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The operator API over this engine's processor (same consumer, store, handler and
    /// version policy).
    pub fn parked(&self) -> ParkedMessages<I, H> {
        ParkedMessages::from_shared(self.shared.processor.clone())
    }

    /// Messages received whose outcome is not final.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// A retention check prefilled with this engine's dedup window (the cleanup schedule's
    /// retention; forever when no cleanup is scheduled) and `topic_retention`; add the
    /// tolerated lag and the replay window, then evaluate it at start-up.
    pub fn retention_check(&self, topic_retention: TopicRetention) -> RetentionCheck {
        RetentionCheck::new(
            self.config.cleanup.as_ref().map(|c| c.retention),
            topic_retention,
        )
    }

    /// Queues `items` in front of their key's queue (in order), and marks the key ready unless
    /// it is busy or waiting for a retry.
    fn requeue_front(&mut self, key: &Key, items: Vec<Work>) {
        let q = self.queues.entry(key.clone()).or_default();
        for w in items.into_iter().rev() {
            q.items.push_front(w);
        }
        if !q.busy && q.retry_at.is_none() && !q.items.is_empty() {
            self.ready.push_back(key.clone());
        }
    }

    fn receive(&mut self, msg: ReceivedMessage) {
        let tp = msg_partition(&msg);
        let (ticket, kind) = self.tracker.lock().begin_checked(&msg.position);
        if let BeginKind::Rewind { highest_seen } = kind {
            self.report.rewinds += 1;
            metrics::record_counter(
                "outbox_inbox_rewinds_total",
                self.shared.processor.consumer(),
                1,
            );
            warn!(consumer = %self.shared.processor.consumer(), position = %msg.position, highest_seen, "log rewound: messages at these offsets are applied again (duplicates are absorbed)");
        }
        let key = match msg.aggregate() {
            Some(a) => Key::Aggregate(a),
            None => {
                self.next_alone += 1;
                Key::Alone(self.next_alone)
            }
        };
        let q = self.queues.entry(key.clone()).or_default();
        q.items.push_back(Work {
            ticket,
            msg,
            key: key.clone(),
            attempts: 0,
            force: Force::None,
            held_since: None,
        });
        if !q.busy && q.retry_at.is_none() && q.items.len() == 1 {
            self.ready.push_back(key);
        }
        self.in_flight += 1;
        self.report.received += 1;

        // A message of a partition paused by this engine: the source resumed it (a new
        // assignment starts unpaused) or handed out what it held before the pause. Paused
        // again below if it is still full.
        self.paused.remove(&tp);
        *self.pending.entry(tp).or_default() += 1;
    }

    /// [`receive`](Self::receive); returns whether the message's partition reached its bound
    /// (a source that can pause then pauses it before anything else of it is taken).
    fn receive_bounded(&mut self, msg: ReceivedMessage) -> bool {
        let tp = msg_partition(&msg);
        self.receive(msg);
        self.can_pause == Some(true)
            && self.pending.get(&tp).copied().unwrap_or(0) >= self.partition_bound()
    }

    fn unpend(&mut self, tp: &TopicPartition, n: usize) {
        if let Some(c) = self.pending.get_mut(tp) {
            *c = c.saturating_sub(n);
            if *c == 0 {
                self.pending.remove(tp);
            }
        }
    }

    /// The bound of one partition: `max_in_flight_per_partition`, at most half of
    /// `max_in_flight`. A partition that could take the whole total bound would pause every
    /// other partition whenever it is full (the total bound pauses all that hold messages,
    /// and resumes them only under three quarters of it): one slow aggregate would stop the
    /// consumer.
    fn partition_bound(&self) -> usize {
        self.config
            .max_in_flight_per_partition
            .min(self.config.max_in_flight / 2)
            .max(1)
    }

    /// Messages received and not final, held ones apart.
    fn unsettled(&self) -> usize {
        self.in_flight - self.held_count
    }

    /// Pauses the partitions that are full (their own bound, or all that hold messages while
    /// the total bound is reached) and resumes those that drained (to half their bound, and
    /// the total under three quarters of its own), so one slow aggregate holds up its own
    /// partition at most, and polling (which serves rebalances) never stops.
    async fn adjust_pauses(&mut self) {
        if self.can_pause.is_none() {
            // Whether the source can pause, asked once before the first poll (pausing no
            // partition changes nothing), so the first poll round already stops at a
            // partition's bound.
            match self.source.pause(&[]).await {
                Ok(can) => {
                    self.can_pause = Some(can);
                    if !can {
                        info!(consumer = %self.shared.processor.consumer(), "the source cannot pause partitions; polling stops while the engine is full");
                    }
                }
                Err(e) => debug!(error = %e, "the source did not say whether it can pause"),
            }
        }
        if self.can_pause == Some(false) {
            return;
        }
        let per = self.partition_bound();
        let total = self.unsettled();
        let over_total = total >= self.config.max_in_flight;
        let to_pause: Vec<TopicPartition> = self
            .pending
            .iter()
            .filter(|(tp, n)| !self.paused.contains(*tp) && (**n >= per || (over_total && **n > 0)))
            .map(|(tp, _)| tp.clone())
            .collect();
        let low_total = total <= self.config.max_in_flight - self.config.max_in_flight / 4;
        let to_resume: Vec<TopicPartition> = self
            .paused
            .iter()
            .filter(|tp| low_total && self.pending.get(*tp).copied().unwrap_or(0) <= per / 2)
            .cloned()
            .collect();
        let consumer = self.shared.processor.consumer().to_owned();
        if !to_pause.is_empty() {
            match self.source.pause(&to_pause).await {
                Ok(true) => {
                    self.can_pause = Some(true);
                    info!(consumer = %consumer, partitions = ?to_pause, unsettled = total, "partitions full; paused (polling goes on)");
                    metrics::record_counter(
                        "outbox_inbox_partition_pauses_total",
                        &consumer,
                        to_pause.len() as u64,
                    );
                    self.paused.extend(to_pause);
                }
                Ok(false) => {
                    self.can_pause = Some(false);
                    info!(consumer = %consumer, "the source cannot pause partitions; polling stops while the engine is full");
                }
                Err(e) => {
                    warn!(consumer = %consumer, error = %e, "pausing partitions failed; trying again")
                }
            }
        }
        if !to_resume.is_empty() {
            match self.source.resume(&to_resume).await {
                Ok(()) => {
                    info!(consumer = %consumer, partitions = ?to_resume, "partitions drained; resumed");
                    for tp in &to_resume {
                        self.paused.remove(tp);
                    }
                }
                Err(e) => {
                    warn!(consumer = %consumer, error = %e, "resuming partitions failed; trying again")
                }
            }
        }
        metrics::record_paused(&consumer, self.paused.len());
    }

    /// Drops the messages, queued or held, whose partition was revoked, lost, assigned again
    /// or rewound since they were received (their tickets are no longer current: the
    /// partition's owner, or the rewound log, delivers them again), as soon as the tracker
    /// says tickets changed. Dispatch drops them too, but the queue of a busy or retrying
    /// aggregate is not dispatched: left there, they would keep counting toward the bounds
    /// (and pile up with each rebalance) until a slow aggregate finishes, pausing every
    /// partition. Messages in running batches come back with their batch.
    fn drop_stale(&mut self) {
        let tracker = self.tracker.lock();
        let changes = tracker.changes();
        if changes == self.seen_changes {
            return;
        }
        self.seen_changes = changes;
        let mut dropped: Vec<TopicPartition> = Vec::new();
        for q in self.queues.values_mut() {
            q.items.retain(|w| {
                let current = tracker.is_current(&w.ticket);
                if !current {
                    dropped.push(msg_partition(&w.msg));
                }
                current
            });
        }
        let mut held_dropped = 0;
        for items in self.held.values_mut() {
            items.retain(|w| {
                let current = tracker.is_current(&w.ticket);
                held_dropped += usize::from(!current);
                current
            });
        }
        drop(tracker);
        self.held.retain(|_, items| !items.is_empty());
        self.queues
            .retain(|_, q| q.busy || q.retry_at.is_some() || !q.items.is_empty());
        self.held_count -= held_dropped;
        self.in_flight -= dropped.len() + held_dropped;
        if !dropped.is_empty() || held_dropped > 0 {
            debug!(consumer = %self.shared.processor.consumer(), queued = dropped.len(), held = held_dropped, "messages of revoked or rewound partitions dropped");
        }
        for tp in dropped {
            self.unpend(&tp, 1);
        }
    }

    /// Starts batches while transaction slots are free and keys are ready.
    fn dispatch(&mut self) {
        let mut dropped: Vec<TopicPartition> = Vec::new();
        self.dispatch_batches(&mut dropped);
        for tp in dropped {
            self.unpend(&tp, 1);
        }
    }

    fn dispatch_batches(&mut self, dropped: &mut Vec<TopicPartition>) {
        while self.running.len() < self.config.concurrency && !self.ready.is_empty() {
            let mut batch: Vec<Work> = Vec::new();
            let mut keys: Vec<Key> = Vec::new();
            while batch.len() < self.config.max_batch {
                let Some(key) = self.ready.pop_front() else {
                    break;
                };
                let Some(q) = self.queues.get_mut(&key) else {
                    continue;
                };
                if q.busy || q.retry_at.is_some() || q.items.is_empty() {
                    continue; // a stale entry
                }
                let room = self.config.max_batch - batch.len();
                let mut took = 0;
                while took < room {
                    let Some(w) = q.items.pop_front() else {
                        break;
                    };
                    if self.tracker.lock().is_current(&w.ticket) {
                        batch.push(w);
                        took += 1;
                    } else {
                        // Revoked, lost or rewound since it was received: the partition's
                        // owner (or the rewound log) delivers it again.
                        self.in_flight -= 1;
                        dropped.push(msg_partition(&w.msg));
                    }
                }
                if took > 0 {
                    q.busy = true;
                    keys.push(key.clone());
                    if !q.items.is_empty() {
                        // The rest waits until this batch is done.
                        continue;
                    }
                } else if q.items.is_empty() {
                    self.queues.remove(&key);
                }
            }
            if batch.is_empty() {
                continue;
            }
            self.running
                .push(Box::pin(run_batch(self.shared.clone(), batch)));
        }
    }

    /// The next instant a held gap expires or a retry is due.
    fn next_timer(&self) -> Option<Instant> {
        let retry = self.queues.values().filter_map(|q| q.retry_at).min();
        let hold = match self.shared.processor.version_policy() {
            VersionPolicy::Hold { max_wait, .. } => self
                .held
                .values()
                .filter_map(|items| items.iter().filter_map(|w| w.held_since).min())
                .min()
                .map(|since| since + max_wait),
            _ => None,
        };
        match (retry, hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn on_timer(&mut self) {
        let now = Instant::now();
        let due: Vec<Key> = self
            .queues
            .iter()
            .filter(|(_, q)| q.retry_at.is_some_and(|t| t <= now))
            .map(|(k, _)| k.clone())
            .collect();
        for k in due {
            let q = self.queues.get_mut(&k).expect("listed above");
            q.retry_at = None;
            if !q.busy && !q.items.is_empty() {
                self.ready.push_back(k);
            }
        }
        self.expire_holds();
    }

    /// Sends the held messages of `key` back to its queue, lowest version first; with
    /// `park_reason`, the first is parked as a version gap (the rest then wait behind it).
    fn release_held(&mut self, key: &AggregateKey, park_reason: Option<String>) {
        let Some(mut items) = self.held.remove(key) else {
            return;
        };
        self.held_count -= items.len();
        for w in &items {
            *self.pending.entry(msg_partition(&w.msg)).or_default() += 1;
        }
        items.sort_by_key(Work::version);
        if let (Some(reason), Some(first)) = (park_reason, items.first_mut()) {
            first.force = Force::Park(ParkKind::VersionGap, reason);
        }
        self.requeue_front(&Key::Aggregate(key.clone()), items);
    }

    fn expire_holds(&mut self) {
        let VersionPolicy::Hold { max_held, max_wait } = self.shared.processor.version_policy()
        else {
            return;
        };
        let now = Instant::now();
        let busy = |engine: &Self, k: &AggregateKey| {
            engine
                .queues
                .get(&Key::Aggregate(k.clone()))
                .is_some_and(|q| q.busy)
        };
        let expired: Vec<(AggregateKey, Duration)> = self
            .held
            .iter()
            .filter_map(|(k, items)| {
                let since = items.iter().filter_map(|w| w.held_since).min()?;
                (now >= since + max_wait).then(|| (k.clone(), now - since))
            })
            .collect();
        for (key, held_for) in expired {
            // A batch of the aggregate is running (it may close the gap): decide after it.
            if busy(self, &key) {
                continue;
            }
            warn!(consumer = %self.shared.processor.consumer(), aggregate = %key, held_ms = held_for.as_millis() as u64, "version gap did not close in time; parking");
            self.release_held(
                &key,
                Some(format!(
                    "version gap of {key} did not close within {max_wait:?} (held {held_for:?})"
                )),
            );
        }
        while self.held_count > max_held {
            let Some(oldest) = self
                .held
                .iter()
                .filter(|(k, _)| !busy(self, k))
                .filter_map(|(k, items)| {
                    Some((items.iter().filter_map(|w| w.held_since).min()?, k))
                })
                .min()
                .map(|(_, k)| k.clone())
            else {
                break;
            };
            warn!(consumer = %self.shared.processor.consumer(), aggregate = %oldest, max_held, "too many messages held for version gaps; parking the oldest gap");
            self.release_held(
                &oldest,
                Some(format!(
                    "version gap of {oldest} parked: more than {max_held} messages were held"
                )),
            );
        }
        self.report.held = self.held_count as u64;
    }

    fn on_batch_done(&mut self, done: BatchDone) -> Result<(), EngineError> {
        self.report.retries += done.retries;
        let consumer = self.shared.processor.consumer().to_owned();
        let mut touched: Vec<Key> = Vec::new();
        let mut release = Vec::new();
        let now = chrono::Utc::now();
        for (mut w, outcome) in done.results {
            if !touched.contains(&w.key) {
                touched.push(w.key.clone());
            }
            if outcome == MessageOutcome::Held {
                let Key::Aggregate(key) = w.key.clone() else {
                    unreachable!("only decodable messages are held");
                };
                w.held_since.get_or_insert_with(Instant::now);
                self.unpend(&msg_partition(&w.msg), 1);
                self.held.entry(key).or_default().push(w);
                self.held_count += 1;
                continue;
            }
            self.tracker.lock().finish(&w.ticket);
            if self.per_message {
                // Final: its transaction committed (applied, duplicate, stale or parked).
                self.ack_ahead.push(w.msg.position.clone());
            }
            self.in_flight -= 1;
            self.unpend(&msg_partition(&w.msg), 1);
            self.since_commit += 1;
            match &outcome {
                MessageOutcome::Applied => {
                    self.report.applied += 1;
                    if let Ok(e) = &w.msg.envelope {
                        metrics::record_latency(&consumer, e, now);
                    }
                }
                MessageOutcome::Duplicate => self.report.duplicates += 1,
                MessageOutcome::Stale { applied } => {
                    self.report.stale += 1;
                    debug!(consumer = %consumer, position = %w.msg.position, applied, "stale version skipped");
                }
                MessageOutcome::Parked { id, kind } => {
                    self.report.parked += 1;
                    if w.msg.envelope.is_err() {
                        metrics::record_error(&consumer, "decode");
                    }
                    error!(consumer = %consumer, position = %w.msg.position, parked_id = %id, kind = kind.as_str(), key = ?w.key, stage = "park", "message parked; its aggregate waits for an operator");
                }
                MessageOutcome::Waiting(id) => {
                    self.report.waiting += 1;
                    info!(consumer = %consumer, position = %w.msg.position, parked_id = %id, key = ?w.key, stage = "park", "message waits behind a parked one");
                }
                MessageOutcome::AlreadyParked => self.report.already_parked += 1,
                _ => {}
            }
            if matches!(
                outcome,
                MessageOutcome::Applied
                    | MessageOutcome::Parked { .. }
                    | MessageOutcome::Waiting(_)
            ) {
                if let Key::Aggregate(k) = &w.key {
                    if self.held.contains_key(k) && !release.contains(k) {
                        release.push(k.clone());
                    }
                }
            }
        }
        // Messages handed back for a delayed retry, per key, in order.
        let mut returned: Vec<(Key, Vec<Work>)> = Vec::new();
        for w in done.returned {
            match returned.iter_mut().find(|(k, _)| *k == w.key) {
                Some((_, v)) => v.push(w),
                None => returned.push((w.key.clone(), vec![w])),
            }
        }
        let retry_at = Instant::now() + done.retry_after;
        for (key, items) in returned {
            if !touched.contains(&key) {
                touched.push(key.clone());
            }
            let q = self.queues.entry(key).or_default();
            for w in items.into_iter().rev() {
                q.items.push_front(w);
            }
            q.retry_at = Some(retry_at);
        }
        for key in touched {
            let Some(q) = self.queues.get_mut(&key) else {
                continue;
            };
            q.busy = false;
            if q.items.is_empty() {
                if q.retry_at.is_none() {
                    self.queues.remove(&key);
                }
            } else if q.retry_at.is_none() {
                self.ready.push_back(key);
            }
        }
        for k in release {
            self.release_held(&k, None);
        }
        self.expire_holds();
        match done.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    async fn on_poll(
        &mut self,
        polled: Result<Option<ReceivedMessage>, SourceError>,
    ) -> Result<bool, EngineError> {
        match polled {
            Ok(Some(m)) => {
                self.poll_failures = 0;
                let mut full = self.receive_bounded(m);
                // Take what else is already buffered, without waiting, until a partition
                // reaches its bound (paused at the next step) or the total bound is reached.
                let mut taken = 1;
                while !full
                    && taken < self.config.max_batch
                    && self.unsettled() < self.config.max_in_flight
                {
                    match self.source.poll(Duration::ZERO).await {
                        Ok(Some(m)) => {
                            full = self.receive_bounded(m);
                            taken += 1;
                        }
                        Ok(None) => break,
                        // Handled as any poll error, after the messages already taken: a
                        // source may report an error once (a retention gap found at
                        // assignment), so it is never dropped here.
                        Err(e) => return self.on_poll_error(e, true).await,
                    }
                }
                Ok(true)
            }
            Ok(None) => {
                self.poll_failures = 0;
                Ok(false)
            }
            Err(e) => self.on_poll_error(e, false).await,
        }
    }

    /// A failed poll. `progressed`: messages were taken in the same round (a transient error
    /// then needs no pause: the engine has work).
    async fn on_poll_error(
        &mut self,
        e: SourceError,
        progressed: bool,
    ) -> Result<bool, EngineError> {
        match e {
            e if e.kind == SourceErrorKind::RetentionGap => {
                error!(consumer = %self.shared.processor.consumer(), error = %e, "records were lost to retention; stopping");
                let _ = self.commit_final().await;
                Err(e.into())
            }
            e if e.is_transient() => {
                self.poll_failures = self.poll_failures.saturating_add(1);
                if progressed {
                    warn!(error = %e, "poll failed after taking messages; polling again later");
                    return Ok(true);
                }
                let d = self.config.retry.backoff(self.poll_failures, &mut self.rng);
                warn!(error = %e, delay_ms = d.as_millis() as u64, "poll failed; retrying");
                // Never a hot loop on a failing source.
                tokio::time::sleep(d).await;
                Ok(false)
            }
            e => Err(e.into()),
        }
    }

    /// One round of the engine: starts batches, then waits for a batch to finish, a message, a
    /// retry or held gap to come due, or the poll timeout; commits, cleans up and refreshes
    /// gauges when due. Returns whether anything happened (a message arrived, a batch finished
    /// or a timer fired).
    pub async fn step(&mut self) -> Result<bool, EngineError> {
        self.drop_stale();
        self.dispatch();
        self.adjust_pauses().await;
        // With partitions paused, polling goes on whatever the engine holds (it serves
        // rebalances and reads the partitions that are not full); a source that cannot pause
        // stops being polled at the bound.
        let capacity = self.can_pause == Some(true) || self.unsettled() < self.config.max_in_flight;
        let timer = self.next_timer();
        let event = {
            let running = &mut self.running;
            let source = &self.source;
            let timeout = self.config.poll_timeout;
            tokio::select! {
                biased;
                Some(done) = running.next(), if !running.is_empty() => Event::Done(done),
                () = tokio::time::sleep_until(timer.map_or_else(tokio::time::Instant::now, Into::into)), if timer.is_some() => Event::Timer,
                polled = source.poll(timeout), if capacity => Event::Polled(Box::new(polled)),
                () = tokio::time::sleep(timeout), if !capacity => Event::Idle,
            }
        };
        let progressed = match event {
            Event::Done(done) => {
                self.on_batch_done(done)?;
                true
            }
            Event::Timer => {
                self.on_timer();
                true
            }
            Event::Polled(polled) => self.on_poll(*polled).await?,
            Event::Idle => false,
        };
        self.housekeeping(progressed).await?;
        Ok(progressed)
    }

    async fn housekeeping(&mut self, progressed: bool) -> Result<(), EngineError> {
        let quiet = !progressed && self.running.is_empty();
        if self.since_commit >= self.config.commit_every
            || (self.since_commit > 0 && quiet)
            || self.last_commit.elapsed() >= self.config.commit_interval
        {
            self.commit_final().await?;
        }
        if let (Some(schedule), Some(at)) = (self.config.cleanup.clone(), self.next_cleanup) {
            if self.cleanup_running || Instant::now() >= at {
                self.cleanup_batch(&schedule).await;
            }
        }
        if Instant::now() >= self.next_metrics {
            self.next_metrics = Instant::now() + self.config.metrics_interval;
            self.refresh_gauges().await;
        }
        self.retry_requests().await;
        Ok(())
    }

    /// Collects a finished run of requested retries, and starts the next one when it is due.
    /// A run is a task of its own, beside the engine (as an operator's retry would be): it
    /// takes the aggregates' row locks, which the engine's own transactions may hold.
    async fn retry_requests(&mut self) {
        let consumer = self.shared.processor.consumer();
        if self.retry_task.as_ref().is_some_and(|t| t.is_finished()) {
            let finished = self.retry_task.take().and_then(|t| t.now_or_never());
            match finished {
                Some(Ok(Ok(n))) => self.report.requested_retries += n,
                Some(Ok(Err(e))) => {
                    warn!(consumer = %consumer, error = %e, "requested retries not read; trying again at the next check")
                }
                Some(Err(e)) => {
                    error!(consumer = %consumer, error = %e, "requested retries run failed")
                }
                None => {}
            }
        }
        if self.retry_task.is_some() {
            // Let the run make progress on a single-threaded runtime, even when the source
            // and the store never wait.
            tokio::task::yield_now().await;
            return;
        }
        if Instant::now() < self.next_retry_check {
            return;
        }
        self.next_retry_check = Instant::now() + self.config.retry_requests_interval;
        let ops = self.parked();
        self.retry_task = Some(tokio::spawn(async move {
            let done = ops.perform_requested_retries().await?;
            Ok(done.iter().filter(|(_, r)| r.is_ok()).count() as u64)
        }));
    }

    async fn cleanup_batch(&mut self, schedule: &CleanupSchedule) {
        let consumer = self.shared.processor.consumer().to_owned();
        match self
            .shared
            .processor
            .store()
            .cleanup(&consumer, schedule.retention, schedule.batch_size)
            .await
        {
            Ok(n) => {
                self.report.cleaned += n;
                metrics::record_counter("outbox_inbox_cleaned_total", &consumer, n);
                self.cleanup_running = n >= schedule.batch_size as u64;
                if !self.cleanup_running {
                    self.next_cleanup = Some(Instant::now() + schedule.every);
                    debug!(consumer = %consumer, removed = n, "inbox cleanup run finished");
                }
            }
            Err(e) => {
                warn!(consumer = %consumer, error = %e, "inbox cleanup failed; trying again at the next interval");
                self.cleanup_running = false;
                self.next_cleanup = Some(Instant::now() + schedule.every);
            }
        }
    }

    /// Reads lag and parked counts into the gauges now.
    pub async fn refresh_gauges(&mut self) {
        let consumer = self.shared.processor.consumer().to_owned();
        metrics::record_gauges(&consumer, self.held_count, self.in_flight);
        match self.source.lag().await {
            Ok(lags) => metrics::record_lag(&consumer, &lags),
            Err(e) => debug!(error = %e, "lag not available"),
        }
        match self.shared.processor.store().parked_stats(&consumer).await {
            Ok(stats) => metrics::record_parked(&consumer, &stats, chrono::Utc::now()),
            Err(e) => debug!(error = %e, "parked counts not available"),
        }
    }

    /// Commits every offset that is final and not committed yet. A commit refused by a
    /// rebalance is dropped (what it covered is redelivered to the owner); one that fails
    /// transiently is kept and tried again at the next commit. A per-message source first
    /// acknowledges the deliveries that became final since the last commit, each on its own
    /// ([`MessageSource::ack_ahead`]), so a final message behind an unfinished one is not
    /// redelivered while it waits for the watermark.
    pub async fn commit_final(&mut self) -> Result<(), EngineError> {
        if !self.ack_ahead.is_empty() {
            let positions = std::mem::take(&mut self.ack_ahead);
            self.report.acked_ahead += positions.len() as u64;
            if let Err(e) = self.source.ack_ahead(&positions).await {
                // Still covered by the watermark's commits (or redelivered: a duplicate).
                warn!(error = %e, deliveries = positions.len(), "acknowledging final deliveries ahead of the watermark failed; the commits cover them");
            }
        }
        for c in self.tracker.lock().take_commits() {
            self.pending_commits.insert(c.topic_partition(), c);
        }
        self.since_commit = 0;
        self.last_commit = Instant::now();
        if self.pending_commits.is_empty() {
            return Ok(());
        }
        let commits: Vec<CommitOffset> = self.pending_commits.values().cloned().collect();
        match self.source.commit(&commits).await {
            Ok(()) => {
                self.pending_commits.clear();
                self.report.commits += 1;
                Ok(())
            }
            Err(e) if e.kind == SourceErrorKind::Rebalanced => {
                warn!(error = %e, offsets = ?commits, "offset commit refused by a rebalance; dropped (the partitions' owner redelivers)");
                self.pending_commits.clear();
                self.report.dropped_commits += commits.len() as u64;
                metrics::record_counter(
                    "outbox_inbox_dropped_commits_total",
                    self.shared.processor.consumer(),
                    commits.len() as u64,
                );
                Ok(())
            }
            Err(e) if e.is_transient() => {
                warn!(error = %e, "offset commit failed; trying again at the next commit");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn drain(&mut self, grace: Duration) -> Result<(), EngineError> {
        let deadline = tokio::time::Instant::now() + grace;
        while !self.running.is_empty() {
            match tokio::time::timeout_at(deadline, self.running.next()).await {
                Ok(Some(done)) => self.on_batch_done(done)?,
                Ok(None) => break,
                Err(_) => {
                    warn!(
                        running = self.running.len(),
                        "transactions still running at shutdown; abandoning them (rolled back, redelivered)"
                    );
                    self.running = FuturesUnordered::new();
                    break;
                }
            }
        }
        if let Some(task) = self.retry_task.take() {
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(Ok(n))) => self.report.requested_retries += n,
                Ok(Ok(Err(e))) => warn!(error = %e, "requested retries not read at shutdown"),
                Ok(Err(e)) => error!(error = %e, "requested retries run failed"),
                Err(_) => warn!(
                    "requested retries still running at shutdown; abandoning them (each step \
                     commits on its own; a request not cleared is performed at the next start)"
                ),
            }
        }
        for _ in 0..3 {
            self.commit_final().await?;
            if self.pending_commits.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Runs until `shutdown` completes, then lets running transactions finish (up to
    /// `shutdown_grace`) and commits what is final.
    pub async fn run<F: Future<Output = ()>>(
        &mut self,
        shutdown: F,
    ) -> Result<EngineReport, EngineError> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                r = self.step() => { r?; }
            }
        }
        self.drain(self.config.shutdown_grace).await?;
        Ok(self.report.clone())
    }

    /// Runs until nothing arrived and nothing finished for `quiet` (messages held for a version
    /// gap stay held; retries that come due are waited for), then commits what is final. Handy
    /// for demos and tests.
    pub async fn run_until_quiet(&mut self, quiet: Duration) -> Result<EngineReport, EngineError> {
        let mut last = Instant::now();
        loop {
            if self.step().await? {
                last = Instant::now();
            } else if last.elapsed() >= quiet
                && self.running.is_empty()
                && self.ready.is_empty()
                && self.queues.values().all(|q| q.retry_at.is_none())
                && self.retry_task.is_none()
            {
                break;
            }
        }
        self.drain(self.config.shutdown_grace).await?;
        Ok(self.report.clone())
    }
}
