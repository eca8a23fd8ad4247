//! The publisher outage suite: what a broker outage must look like from any [`Publisher`].
//!
//! [`publisher_outage`] publishes batches back to back through the harness's publisher, stops
//! the harness's own server while a batch is in flight, keeps publishing through the outage,
//! restarts the server and publishes until the publisher has recovered. Then it checks:
//!
//! * every `publish` returned one result per record;
//! * every error is [`ErrorClass::Transient`] and [`FailureScope::Transport`]-scoped (the relay
//!   backs off as a whole and spends no record's attempts), and the outage produced at least
//!   one (else the server was not stopped mid-publishing and nothing was tested);
//! * every `publish` returned within the publisher's delivery timeout plus the adapter's report
//!   grace (plus [`SLACK`] for scheduling), so a relay's lease is never outlived;
//! * no record was reported acknowledged that the server did not store: every acknowledged
//!   event id is read back from the server after the restart.
//!
//! Records are identified by event id only; the acknowledgement metadata is not inspected.
//!
//! An adapter runs the suite from its own test (on a multi-thread runtime, so that the server
//! can be stopped while a batch is in flight), with a harness over a server instance of its
//! own, never over a shared one:
//!
//! ```
//! use outbox_testkit::conformance::outage::{publisher_outage, MemoryOutageHarness};
//!
//! # fn main() {
//! tokio::runtime::Builder::new_multi_thread()
//!     .enable_all()
//!     .build()
//!     .unwrap()
//!     .block_on(async {
//!         let report = publisher_outage(MemoryOutageHarness::new()).await;
//!         assert!(report.errors > 0 && report.acknowledged > 0);
//!     });
//! # }
//! ```
//!
//! The suite is tested against deliberately broken publishers in this crate's
//! `tests/outage.rs` (a false acknowledgement, a permanent error, a record-scoped error, a
//! `publish` that outlives its timeout): each must make it fail.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{
    async_trait, Envelope, ErrorClass, EventId, FailureScope, PublishError, PublishErrorKind,
    PublishResult, Publisher,
};

use super::event;
use crate::MemoryLog;

/// Records per batch.
pub const BATCH: usize = 50;

/// Scheduling slack allowed on top of the delivery timeout and the report grace.
pub const SLACK: Duration = Duration::from_millis(500);

/// How long publishing may take to progress (before the outage, and to recover after it).
pub const PROGRESS_TIMEOUT: Duration = Duration::from_secs(60);

/// How long the driver pauses after a batch with errors, as a relay backs off.
pub const ERROR_BACKOFF: Duration = Duration::from_millis(200);

/// What the outage suite needs from an adapter: a server instance of its own (started when the
/// harness is made, stopped and restarted by the suite), a publisher to it, and a way to read
/// back what the server stored.
///
/// The suite publishes events of aggregate type `conformance`, event type
/// `conformance.happened` (one aggregate per event, version 1): the publisher MUST route them
/// to a destination that exists on the server and that [`stored`](Self::stored) reads.
#[async_trait]
pub trait OutageHarness: Send + Sync {
    /// The publisher under test.
    type Publisher: Publisher + 'static;

    /// A publisher to the harness's server (called once, while the server is up). Its
    /// [`Publisher::delivery_timeout`] bounds every `publish` call.
    async fn publisher(&self) -> Self::Publisher;

    /// Stops the server (the suite calls it while a batch is in flight). MUST stop only the
    /// harness's own server instance.
    async fn stop(&mut self);

    /// Starts the stopped server again, with the data it had stored.
    async fn restart(&mut self);

    /// Of `ids`, those the server has stored (read after the restart, from a fresh
    /// connection).
    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId>;

    /// How long past its delivery timeout the adapter's `publish` may return (the time it
    /// allows the transport to report after the timeout; zero when it has none).
    fn report_grace(&self) -> Duration;

    /// How long the server stays down. Default: twice the delivery timeout of `publisher`, so
    /// batches time out during the outage.
    fn outage(&self, publisher: &Self::Publisher) -> Duration {
        publisher.delivery_timeout() * 2
    }
}

/// What one run of [`publisher_outage`] saw (for the caller's log line).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutageReport {
    /// `publish` calls made.
    pub calls: usize,
    /// Records acknowledged (and found stored).
    pub acknowledged: usize,
    /// Records that failed (all transient and transport-scoped).
    pub errors: usize,
    /// The longest `publish` call.
    pub slowest: Duration,
    /// Errors by [`PublishErrorKind`] name.
    pub error_kinds: BTreeMap<&'static str, usize>,
}

/// One `publish` call as the driver made it.
struct Call {
    elapsed: Duration,
    records: usize,
    results: usize,
    acked: Vec<EventId>,
    errors: Vec<PublishError>,
}

/// Runs the outage suite (see the module docs) against `harness` and panics, naming the
/// broken promise, when the publisher breaks one. Needs a multi-thread tokio runtime.
pub async fn publisher_outage<H: OutageHarness>(mut harness: H) -> OutageReport {
    let publisher = Arc::new(harness.publisher().await);
    let timeout = publisher.delivery_timeout();
    let bound = timeout + harness.report_grace() + SLACK;
    let outage = harness.outage(&publisher);

    let stop = Arc::new(AtomicBool::new(false));
    let acked_total = Arc::new(AtomicUsize::new(0));
    let last_error = Arc::new(Mutex::new(String::new()));
    let driver = {
        let (publisher, stop, acked_total, last_error) = (
            publisher.clone(),
            stop.clone(),
            acked_total.clone(),
            last_error.clone(),
        );
        tokio::spawn(async move {
            let mut calls: Vec<Call> = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let batch: Vec<Envelope> = (0..BATCH)
                    .map(|_| {
                        n += 1;
                        event(&format!("outage-{n}"), 1)
                    })
                    .collect();
                let started = Instant::now();
                let results: Vec<PublishResult> =
                    publisher.publish(&batch.iter().collect::<Vec<_>>()).await;
                let mut call = Call {
                    elapsed: started.elapsed(),
                    records: batch.len(),
                    results: results.len(),
                    acked: Vec::new(),
                    errors: Vec::new(),
                };
                for (e, r) in batch.iter().zip(results) {
                    match r {
                        Ok(_) => call.acked.push(e.event_id),
                        Err(err) => call.errors.push(err),
                    }
                }
                acked_total.fetch_add(call.acked.len(), Ordering::SeqCst);
                let failed = !call.errors.is_empty();
                if let Some(e) = call.errors.last() {
                    *last_error.lock().unwrap_or_else(|p| p.into_inner()) = e.to_string();
                }
                calls.push(call);
                if failed {
                    // Backing off as the relay would; the server is away.
                    tokio::time::sleep(ERROR_BACKOFF).await;
                }
            }
            calls
        })
    };
    let wait_acked = |at_least: usize, what: &'static str| {
        let (acked_total, last_error) = (acked_total.clone(), last_error.clone());
        async move {
            let deadline = Instant::now() + PROGRESS_TIMEOUT;
            while acked_total.load(Ordering::SeqCst) < at_least {
                assert!(
                    Instant::now() < deadline,
                    "{what}: publishing did not progress within {PROGRESS_TIMEOUT:?}; last \
                     error: {}",
                    last_error.lock().unwrap_or_else(|p| p.into_inner())
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_acked(3 * BATCH, "before the outage").await;
    // The driver publishes back to back, so the stop lands while a batch is in flight.
    harness.stop().await;
    tokio::time::sleep(outage).await;
    harness.restart().await;
    let before = acked_total.load(Ordering::SeqCst);
    wait_acked(before + 3 * BATCH, "after the restart").await;
    stop.store(true, Ordering::SeqCst);
    let calls = driver.await.expect("the publishing task panicked");

    let mut report = OutageReport {
        calls: calls.len(),
        ..OutageReport::default()
    };
    let mut acked: Vec<EventId> = Vec::new();
    for (i, call) in calls.iter().enumerate() {
        assert_eq!(
            call.results, call.records,
            "publish call {i}: {} results for {} records",
            call.results, call.records
        );
        assert!(
            call.elapsed <= bound,
            "publish call {i} took {:?}: longer than the delivery timeout {timeout:?} + the \
             report grace + {SLACK:?} ({bound:?})",
            call.elapsed
        );
        for err in &call.errors {
            assert_eq!(
                (err.class, err.scope),
                (ErrorClass::Transient, FailureScope::Transport),
                "publish call {i}: an outage error that is not transient and the transport's: \
                 {err}"
            );
        }
        for err in &call.errors {
            *report.error_kinds.entry(err.kind.as_str()).or_default() += 1;
        }
        report.errors += call.errors.len();
        report.slowest = report.slowest.max(call.elapsed);
        acked.extend(call.acked.iter().copied());
    }
    assert!(
        report.errors > 0,
        "the outage produced no error: the server was not stopped while publishing"
    );
    let stored = harness.stored(&acked).await;
    let missing: Vec<&EventId> = acked.iter().filter(|id| !stored.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged records are not stored on the server after the restart (false \
         acknowledgements), e.g. {:?}",
        missing.len(),
        acked.len(),
        &missing[..missing.len().min(5)]
    );
    report.acknowledged = acked.len();
    report
}

/// The in-memory outage harness: a [`MemoryLog`] (topic `conformance`, 3 partitions) behind
/// an [`OutagePublisher`] whose "server" can be stopped and restarted. The log keeps its
/// records across the outage, as a server with durable storage does.
#[derive(Clone, Debug)]
pub struct MemoryOutageHarness {
    log: MemoryLog,
    down: Arc<AtomicBool>,
    delivery_timeout: Duration,
}

impl MemoryOutageHarness {
    /// A harness whose publisher has a delivery timeout of 300 ms.
    pub fn new() -> Self {
        let delivery_timeout = Duration::from_millis(300);
        Self {
            log: MemoryLog::builder()
                .topic("conformance", 3)
                .default_topic("conformance")
                .delivery_timeout(delivery_timeout)
                .build(),
            down: Arc::new(AtomicBool::new(false)),
            delivery_timeout,
        }
    }

    /// The log behind the publisher.
    pub fn log(&self) -> &MemoryLog {
        &self.log
    }
}

impl Default for MemoryOutageHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl OutageHarness for MemoryOutageHarness {
    type Publisher = OutagePublisher;

    async fn publisher(&self) -> OutagePublisher {
        OutagePublisher {
            log: self.log.clone(),
            down: self.down.clone(),
            delivery_timeout: self.delivery_timeout,
        }
    }

    async fn stop(&mut self) {
        self.down.store(true, Ordering::SeqCst);
    }

    async fn restart(&mut self) {
        self.down.store(false, Ordering::SeqCst);
    }

    async fn stored(&self, ids: &[EventId]) -> HashSet<EventId> {
        let wanted: HashSet<&EventId> = ids.iter().collect();
        self.log
            .all_records()
            .iter()
            .filter_map(|r| r.decode().ok())
            .map(|e| e.event_id)
            .filter(|id| wanted.contains(id))
            .collect()
    }

    fn report_grace(&self) -> Duration {
        Duration::ZERO
    }
}

/// A [`MemoryLog`] publisher behind a switch: while the "server" is down, each record waits
/// out a share of the delivery timeout and fails with a transient, transport-scoped
/// [`PublishErrorKind::BrokerUnavailable`]. Records go one at a time, so a stop can land in
/// the middle of a batch.
#[derive(Clone, Debug)]
pub struct OutagePublisher {
    log: MemoryLog,
    down: Arc<AtomicBool>,
    delivery_timeout: Duration,
}

#[async_trait]
impl Publisher for OutagePublisher {
    async fn publish(&self, batch: &[&Envelope]) -> Vec<PublishResult> {
        let mut results = Vec::with_capacity(batch.len());
        let mut waited = false;
        for e in batch {
            if self.down.load(Ordering::SeqCst) {
                if !waited {
                    // A down server answers nothing: the batch waits (within its timeout).
                    tokio::time::sleep(self.delivery_timeout / 2).await;
                    waited = true;
                }
                results.push(Err(PublishError::new(
                    PublishErrorKind::BrokerUnavailable,
                    "the server is down",
                )));
            } else {
                results.extend(self.log.publish(&[e]).await);
                tokio::task::yield_now().await;
            }
        }
        results
    }

    fn delivery_timeout(&self) -> Duration {
        self.delivery_timeout
    }
}
