use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use outbox_core::watermark::OffsetTracker;
use outbox_core::{
    Classify, ConfigError, Envelope, ErrorClass, InboxStore, LogPosition, MessageSource,
    Registration, RetryPolicy, SourceError, StoreError,
};
use rand::rngs::StdRng;
use rand::SeedableRng;
use tracing::{debug, error, info_span, warn, Instrument};

use crate::handler::{Handler, HandlerError};

/// The outcome of processing one event.
#[derive(Debug, Clone)]
pub enum ProcessOutcome {
    /// Fresh: the effect and the registration committed together.
    Applied,
    /// Already applied before: nothing was done.
    Duplicate,
    /// The handler failed; the transaction (registration included) was rolled back.
    Failed(HandlerError),
}

/// Register-and-apply in one transaction. The building block of [`ConsumerEngine`]; usable on
/// its own when messages come from elsewhere (an HTTP webhook, a test).
///
/// ```
/// # use outbox_inbox::*;
/// # fn _doc<I: outbox_core::InboxStore, H: Handler<I::Tx>>(store: I, handler: H) {
/// let processor = InboxProcessor::new("projection", store, handler);
/// # }
/// ```
#[derive(Debug)]
pub struct InboxProcessor<I, H> {
    consumer: String,
    store: I,
    handler: H,
}

impl<I: InboxStore, H: Handler<I::Tx>> InboxProcessor<I, H> {
    /// A processor for the consumer named `consumer` (the inbox key prefix).
    pub fn new(consumer: impl Into<String>, store: I, handler: H) -> Self {
        Self {
            consumer: consumer.into(),
            store,
            handler,
        }
    }

    /// The consumer name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The store.
    pub fn store(&self) -> &I {
        &self.store
    }

    /// Registers and applies `event` in one transaction.
    ///
    /// `Err` means the store failed (nothing committed unless the error came from the commit
    /// itself, in which case the outcome is unknown and a retry is answered by deduplication).
    pub async fn process(&self, event: &Envelope) -> Result<ProcessOutcome, StoreError> {
        match self.process_batch(std::slice::from_ref(event)).await? {
            BatchOutcome::Committed(mut outcomes) => {
                Ok(outcomes.pop().unwrap_or(ProcessOutcome::Duplicate))
            }
            BatchOutcome::RolledBack { error, .. } => {
                outbox_core::telemetry::record_inbox(&self.consumer, "failed");
                Ok(ProcessOutcome::Failed(error))
            }
        }
    }
}

/// The outcome of processing several events in one transaction.
#[derive(Debug, Clone)]
pub enum BatchOutcome {
    /// All registrations and effects committed together; one outcome per event, in order
    /// (`Applied` or `Duplicate`).
    Committed(Vec<ProcessOutcome>),
    /// The handler failed on the event at `index`; the whole transaction was rolled back and
    /// nothing of the batch is registered.
    RolledBack {
        /// Position of the failing event in the batch.
        index: usize,
        /// The failure.
        error: HandlerError,
    },
}

impl<I: InboxStore, H: Handler<I::Tx>> InboxProcessor<I, H> {
    /// Registers and applies `events` in **one** transaction: one commit for the whole batch
    /// instead of one per event. An event that appears twice in the batch is applied once (the
    /// second registration sees the first, uncommitted one). If the handler fails on any event,
    /// everything rolls back and [`BatchOutcome::RolledBack`] says where; the caller then
    /// processes the events one by one.
    pub async fn process_batch(&self, events: &[Envelope]) -> Result<BatchOutcome, StoreError> {
        let mut tx = self.store.begin().await?;
        let mut outcomes = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            let registration = match self
                .store
                .register(&mut tx, &self.consumer, event.event_id)
                .await
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = self.store.rollback(tx).await;
                    return Err(e);
                }
            };
            if registration == Registration::Duplicate {
                outcomes.push(ProcessOutcome::Duplicate);
                continue;
            }
            if let Err(error) = self.handler.handle(&mut tx, event).await {
                self.store.rollback(tx).await?;
                return Ok(BatchOutcome::RolledBack { index, error });
            }
            outcomes.push(ProcessOutcome::Applied);
        }
        self.store.commit(tx).await?;
        for o in &outcomes {
            let result = match o {
                ProcessOutcome::Applied => "applied",
                _ => "duplicate",
            };
            outbox_core::telemetry::record_inbox(&self.consumer, result);
        }
        Ok(BatchOutcome::Committed(outcomes))
    }
}

/// Engine configuration.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct EngineConfig {
    /// How long one poll waits for a message. Default 100 ms.
    pub poll_timeout: Duration,
    /// Backoff and attempt limit for transient handler failures. Store errors are retried with
    /// the same backoff but without a limit (the database coming back is only a matter of time).
    pub retry: RetryPolicy,
    /// Commit offsets at least this often while messages flow. Default 1 s.
    pub commit_interval: Duration,
    /// Commit offsets after this many final messages. Default 500.
    pub commit_every: usize,
    /// Most messages applied in one database transaction: after a poll returns a message, the
    /// engine takes what else is already buffered, up to this many. Default 100; 1 means one
    /// transaction per message.
    pub max_batch: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            poll_timeout: Duration::from_millis(100),
            retry: RetryPolicy::default(),
            commit_interval: Duration::from_secs(1),
            commit_every: 500,
            max_batch: 100,
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
    /// Validates.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.commit_every == 0 {
            return Err(ConfigError::new("commit_every must be at least 1"));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::new("max_batch must be at least 1"));
        }
        if self.poll_timeout.is_zero() {
            return Err(ConfigError::new("poll_timeout must be greater than zero"));
        }
        Ok(())
    }
}

/// Why the engine stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A message can never be applied (undecodable, or a permanent handler failure, or
    /// transient failures past the attempt limit). Its offset was not committed.
    #[error("message at {position:?} cannot be applied: {reason}")]
    Unprocessable {
        /// Where it is.
        position: LogPosition,
        /// Why.
        reason: String,
    },
    /// The source failed permanently.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// The store failed permanently.
    #[error(transparent)]
    Store(#[from] StoreError),
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
    /// Transient failures retried.
    pub retries: u64,
    /// Offset commits made.
    pub commits: u64,
}

/// Polls a [`MessageSource`], processes each message through an [`InboxProcessor`], and commits
/// offsets along the contiguous watermark.
pub struct ConsumerEngine<S, I, H> {
    source: S,
    processor: InboxProcessor<I, H>,
    config: EngineConfig,
    tracker: Arc<Mutex<OffsetTracker>>,
    rng: StdRng,
    report: EngineReport,
    since_commit: usize,
    last_commit: Instant,
    poll_failures: u32,
}

impl<S, I, H> std::fmt::Debug for ConsumerEngine<S, I, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerEngine")
            .field("consumer", &self.processor.consumer)
            .field("report", &self.report)
            .finish_non_exhaustive()
    }
}

impl<S, I, H> ConsumerEngine<S, I, H>
where
    S: MessageSource,
    I: InboxStore,
    H: Handler<I::Tx>,
{
    /// An engine. `seed` seeds the retry jitter (pass a random value in production, a fixed one
    /// in tests).
    pub fn new(
        source: S,
        processor: InboxProcessor<I, H>,
        config: EngineConfig,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            source,
            processor,
            config,
            tracker: Arc::default(),
            rng: StdRng::seed_from_u64(seed),
            report: EngineReport::default(),
            since_commit: 0,
            last_commit: Instant::now(),
            poll_failures: 0,
        })
    }

    /// Shares `tracker` with the source, so a rebalance callback can commit exactly the
    /// offsets whose outcome is final (e.g. `outbox_kafka::KafkaSourceBuilder::offset_tracker`).
    pub fn with_offset_tracker(mut self, tracker: Arc<Mutex<OffsetTracker>>) -> Self {
        self.tracker = tracker;
        self
    }

    /// The engine's offset watermarks (shared, see [`Self::with_offset_tracker`]).
    pub fn offset_tracker(&self) -> Arc<Mutex<OffsetTracker>> {
        self.tracker.clone()
    }

    fn tracker(&self) -> std::sync::MutexGuard<'_, OffsetTracker> {
        // The tracker holds plain data; a panic elsewhere cannot leave it half-updated.
        self.tracker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Totals so far.
    pub fn report(&self) -> &EngineReport {
        &self.report
    }

    /// The processor.
    pub fn processor(&self) -> &InboxProcessor<I, H> {
        &self.processor
    }

    /// Polls once and processes what arrived. Returns `Ok(false)` when the poll was empty.
    pub async fn step(&mut self) -> Result<bool, EngineError> {
        let msg = match self.source.poll(self.config.poll_timeout).await {
            Ok(Some(m)) => {
                self.poll_failures = 0;
                m
            }
            Ok(None) => {
                self.commit_final().await?;
                return Ok(false);
            }
            Err(e) if e.is_transient() => {
                self.poll_failures = self.poll_failures.saturating_add(1);
                let d = self.config.retry.backoff(self.poll_failures, &mut self.rng);
                warn!(error = %e, delay_ms = d.as_millis() as u64, "poll failed; retrying");
                // Never a hot loop on a failing source.
                tokio::time::sleep(d).await;
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        };
        // Take what else is already buffered, up to max_batch, without waiting.
        let mut received = vec![msg];
        while received.len() < self.config.max_batch {
            match self.source.poll(Duration::ZERO).await {
                Ok(Some(m)) => received.push(m),
                // A poll error here shows up again on the next step.
                Ok(None) | Err(_) => break,
            }
        }
        self.report.received += received.len() as u64;
        let mut batch: Vec<(LogPosition, Envelope)> = Vec::with_capacity(received.len());
        let mut undecodable = None;
        for m in received {
            let pos = m.position;
            self.tracker().begin(&pos.topic, pos.partition, pos.offset);
            match m.envelope {
                Ok(e) if undecodable.is_none() => batch.push((pos, e)),
                Ok(_) => {} // behind an undecodable message: redelivered after the fix
                Err(decode) => {
                    if undecodable.is_none() {
                        undecodable = Some((pos, decode));
                    }
                }
            }
        }
        if batch.len() > 1 {
            self.apply_batch(&batch).await?;
        } else if let Some((pos, envelope)) = batch.first() {
            self.apply_one(envelope, pos).await?;
        }
        if let Some((pos, decode)) = undecodable {
            error!(topic = %pos.topic, partition = pos.partition, offset = pos.offset, stage = "decode", error = %decode, "undecodable message; stopping before its offset");
            self.commit_final().await?;
            return Err(EngineError::Unprocessable {
                position: pos,
                reason: decode.to_string(),
            });
        }
        if self.since_commit >= self.config.commit_every
            || self.last_commit.elapsed() >= self.config.commit_interval
        {
            self.commit_final().await?;
        }
        Ok(true)
    }

    /// Applies one message with retries and marks its offset final.
    async fn apply_one(
        &mut self,
        envelope: &Envelope,
        pos: &LogPosition,
    ) -> Result<(), EngineError> {
        let span = info_span!("outbox.consume", consumer = %self.processor.consumer, event_id = %envelope.event_id, aggregate_id = %envelope.aggregate_id, event_type = %envelope.event_type, stage = "apply");
        self.apply_with_retries(envelope, pos)
            .instrument(span)
            .await?;
        self.tracker().finish(&pos.topic, pos.partition, pos.offset);
        self.since_commit += 1;
        Ok(())
    }

    /// Applies a batch in one transaction; on any failure, falls back to one by one (which
    /// retries, or stops before an event that cannot be applied).
    async fn apply_batch(&mut self, batch: &[(LogPosition, Envelope)]) -> Result<(), EngineError> {
        let events: Vec<Envelope> = batch.iter().map(|(_, e)| e.clone()).collect();
        let span = info_span!("outbox.consume.batch", consumer = %self.processor.consumer, size = events.len(), stage = "apply");
        match self.processor.process_batch(&events).instrument(span).await {
            Ok(BatchOutcome::Committed(outcomes)) => {
                for ((pos, _), o) in batch.iter().zip(outcomes) {
                    match o {
                        ProcessOutcome::Applied => self.report.applied += 1,
                        _ => self.report.duplicates += 1,
                    }
                    self.tracker().finish(&pos.topic, pos.partition, pos.offset);
                    self.since_commit += 1;
                }
                Ok(())
            }
            Ok(BatchOutcome::RolledBack { index, error }) => {
                debug!(index, error = %error, "batch rolled back; applying one by one");
                self.apply_each(batch).await
            }
            Err(e) => {
                warn!(error = %e, "batch transaction failed; applying one by one");
                self.apply_each(batch).await
            }
        }
    }

    async fn apply_each(&mut self, batch: &[(LogPosition, Envelope)]) -> Result<(), EngineError> {
        for (pos, envelope) in batch {
            self.apply_one(envelope, pos).await?;
        }
        Ok(())
    }

    async fn apply_with_retries(
        &mut self,
        envelope: &Envelope,
        pos: &LogPosition,
    ) -> Result<(), EngineError> {
        let mut handler_failures = 0u32;
        let mut store_failures = 0u32;
        loop {
            match self.processor.process(envelope).await {
                Ok(ProcessOutcome::Applied) => {
                    self.report.applied += 1;
                    debug!(attempt = handler_failures + store_failures + 1, "applied");
                    return Ok(());
                }
                Ok(ProcessOutcome::Duplicate) => {
                    self.report.duplicates += 1;
                    debug!("duplicate absorbed");
                    return Ok(());
                }
                Ok(ProcessOutcome::Failed(e)) => {
                    handler_failures += 1;
                    if e.class == ErrorClass::Permanent
                        || handler_failures >= self.config.retry.max_attempts
                    {
                        error!(attempt = handler_failures, error = %e, "event cannot be applied; stopping before its offset");
                        self.commit_final().await?;
                        return Err(EngineError::Unprocessable {
                            position: pos.clone(),
                            reason: e.to_string(),
                        });
                    }
                    self.report.retries += 1;
                    let d = self.config.retry.backoff(handler_failures, &mut self.rng);
                    warn!(attempt = handler_failures, error = %e, delay_ms = d.as_millis() as u64, "handler failed; retrying");
                    tokio::time::sleep(d).await;
                }
                Err(e) if e.is_transient() => {
                    store_failures += 1;
                    self.report.retries += 1;
                    let d = self.config.retry.backoff(store_failures, &mut self.rng);
                    warn!(attempt = store_failures, error = %e, delay_ms = d.as_millis() as u64, "inbox store failed; retrying");
                    tokio::time::sleep(d).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Commits every offset that is final and not yet committed.
    pub async fn commit_final(&mut self) -> Result<(), EngineError> {
        let commits = self.tracker().take_commits();
        self.since_commit = 0;
        self.last_commit = Instant::now();
        if commits.is_empty() {
            return Ok(());
        }
        let mut failures = 0;
        loop {
            match self.source.commit(&commits).await {
                Ok(()) => {
                    self.report.commits += 1;
                    return Ok(());
                }
                Err(e) if e.is_transient() && failures < 5 => {
                    failures += 1;
                    warn!(error = %e, "offset commit failed; retrying");
                    tokio::time::sleep(Duration::from_millis(50 * failures)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Runs until `shutdown` completes, then commits what is final.
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
        self.commit_final().await?;
        Ok(self.report.clone())
    }

    /// Runs until no message arrived for `quiet`, then commits what is final. Handy for demos
    /// and tests.
    pub async fn run_until_quiet(&mut self, quiet: Duration) -> Result<EngineReport, EngineError> {
        let mut last = Instant::now();
        loop {
            if self.step().await? {
                last = Instant::now();
            } else if last.elapsed() >= quiet {
                break;
            }
        }
        self.commit_final().await?;
        Ok(self.report.clone())
    }
}
