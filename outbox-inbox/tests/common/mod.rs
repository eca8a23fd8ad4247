//! A scriptable handler over the in-memory database, and small helpers shared by the engine and
//! operator tests.
#![allow(dead_code, unreachable_pub)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{async_trait, Envelope, RetryPolicy};
use outbox_inbox::{EngineConfig, Handler, HandlerError};
use outbox_testkit::MemoryTx;
use serde_json::json;

/// Applies an effect per event (a counter under `effects/<dedup id>`) and appends the version to
/// `applied/<aggregate id>`; both commit with the inbox registration.
///
/// Scripted by aggregate id: `poison*` fails permanently; `flaky*` fails transiently while
/// `flaky_left` > 0; `gate*` waits until [`Script::open_gate`]. Aggregates in `broken` fail
/// permanently until removed.
#[derive(Clone)]
pub struct Script {
    pub flaky_left: Arc<Mutex<u32>>,
    pub broken: Arc<Mutex<HashSet<String>>>,
    gate: Arc<tokio::sync::Semaphore>,
    pub calls: Arc<AtomicUsize>,
    running: Arc<AtomicUsize>,
    pub max_running: Arc<AtomicUsize>,
    pub delay: Arc<Mutex<HashMap<String, Duration>>>,
}

impl Script {
    pub fn new() -> Self {
        Self {
            flaky_left: Arc::default(),
            broken: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
            calls: Arc::default(),
            running: Arc::default(),
            max_running: Arc::default(),
            delay: Arc::default(),
        }
    }

    pub fn open_gate(&self) {
        self.gate.add_permits(1_000_000);
    }
}

struct Running<'a>(&'a AtomicUsize);
impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl Handler<MemoryTx> for Script {
    async fn handle(&self, tx: &mut MemoryTx, e: &Envelope) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        let _guard = Running(&self.running);
        self.max_running.fetch_max(now, Ordering::SeqCst);
        let agg = e.aggregate_id.as_str();
        if agg.starts_with("poison") || self.broken.lock().unwrap().contains(agg) {
            return Err(HandlerError::permanent(format!(
                "{agg} violates the schema"
            )));
        }
        if agg.starts_with("flaky") {
            let mut left = self.flaky_left.lock().unwrap();
            if *left > 0 {
                *left -= 1;
                return Err(HandlerError::transient("lock timeout"));
            }
        }
        if agg.starts_with("gate") {
            let _ = self.gate.acquire().await.expect("gate").forget();
        }
        let d = self.delay.lock().unwrap().get(agg).copied();
        if let Some(d) = d {
            tokio::time::sleep(d).await;
        }
        let key = e.dedup_id().to_string();
        let n = tx
            .get("effects", &key)
            .and_then(|v| v.as_u64())
            .unwrap_or(0);
        tx.put("effects", &key, json!(n + 1));
        let mut seq = tx
            .get("applied", agg)
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default();
        seq.push(json!(e.aggregate_version));
        tx.put("applied", agg, json!(seq));
        Ok(())
    }
}

pub fn ev(agg: &str, v: i64) -> Envelope {
    Envelope::builder("order", agg, v, "order.changed")
        .build()
        .unwrap()
}

/// Fast retries, 4 attempts, commits after every final message.
pub fn fast() -> EngineConfig {
    EngineConfig::default()
        .with_commit(1, Duration::from_secs(60))
        .with_poll_timeout(Duration::from_millis(2))
        .with_retry(
            RetryPolicy::builder()
                .base(Duration::from_millis(1))
                .max_delay(Duration::from_millis(2))
                .min_delay(Duration::from_millis(1))
                .max_attempts(4)
                .build()
                .unwrap(),
        )
}

/// The versions applied for `agg`, in order.
pub fn applied(db: &outbox_testkit::MemoryDb, agg: &str) -> Vec<i64> {
    db.read("applied", agg)
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.as_i64())
        .collect()
}

/// Every effect counter is 1.
pub fn effects_once(db: &outbox_testkit::MemoryDb) -> usize {
    let effects = db.scan("effects");
    for (k, v) in &effects {
        assert_eq!(v.as_u64(), Some(1), "effect of {k} applied {v} times");
    }
    effects.len()
}

/// Publishes `events` to the in-memory log (each must be accepted).
pub async fn publish(log: &outbox_testkit::MemoryLog, events: &[Envelope]) {
    use outbox_core::Publisher as _;
    for r in log.publish(&events.iter().collect::<Vec<_>>()).await {
        r.unwrap();
    }
}

/// An engine of consumer `proj` over `source`, applying through [`Script`] into `db`.
pub fn engine_over<S: outbox_core::MessageSource>(
    source: S,
    db: &outbox_testkit::MemoryDb,
    script: &Script,
    cfg: EngineConfig,
) -> outbox_inbox::ConsumerEngine<S, outbox_testkit::MemoryInboxStore, Script> {
    let processor = outbox_inbox::InboxProcessor::new(
        "proj",
        outbox_testkit::MemoryInboxStore::new(db),
        script.clone(),
    );
    outbox_inbox::ConsumerEngine::new(source, processor, cfg, 7).unwrap()
}

/// A source that cannot pause partitions (the trait's default), over `S`: the engine then
/// stops polling at `max_in_flight` instead of pausing the partitions that hold messages.
pub struct NoPause<S>(pub S);

#[async_trait]
impl<S: outbox_core::MessageSource> outbox_core::MessageSource for NoPause<S> {
    async fn poll(
        &self,
        timeout: Duration,
    ) -> Result<Option<outbox_core::ReceivedMessage>, outbox_core::SourceError> {
        self.0.poll(timeout).await
    }
    async fn commit(
        &self,
        offsets: &[outbox_core::CommitOffset],
    ) -> Result<(), outbox_core::SourceError> {
        self.0.commit(offsets).await
    }
    fn attach_offsets(&self, offsets: outbox_core::watermark::SharedOffsetTracker) {
        self.0.attach_offsets(offsets);
    }
    async fn lag(&self) -> Result<Vec<outbox_core::PartitionLag>, outbox_core::SourceError> {
        self.0.lag().await
    }
}
