//! The conformance suite: one plain generic `async fn` per contract clause of
//! [`OutboxStore`], [`InboxStore`](outbox_core::InboxStore), [`Publisher`] and
//! [`MessageSource`], and macros that turn the suite into one named test per check.
//!
//! A backend implements a small harness trait ([`OutboxHarness`], [`InboxHarness`]) that gives
//! the suite what it needs: a store over a fresh, empty database, transactions, and a way to let
//! time pass. Real differences between backends are [`Capabilities`], never commented-out
//! assertions: a check that needs a capability the harness does not declare prints
//! `conformance: <check> not applicable: ...` and returns.
//!
//! # Running the suite for a backend
//!
//! ```
//! // In the backend crate's tests/conformance.rs (here with the in-memory harnesses; a
//! // backend passes its own, e.g. `async { my_crate::testing::harness().await }`):
//! mod outbox {
//!     outbox_testkit::outbox_conformance_tests!(async {
//!         outbox_testkit::conformance::MemoryOutboxHarness::new()
//!     });
//! }
//! mod inbox {
//!     outbox_testkit::inbox_conformance_tests!(async {
//!         outbox_testkit::conformance::MemoryInboxHarness::new()
//!     });
//! }
//! # fn main() {}
//! ```
//!
//! The argument is an expression evaluating to a future that yields the harness; it is
//! evaluated once per test, so every test gets its own database. Each emitted test is a plain
//! `#[test]` that runs the check on a current-thread tokio runtime with time and I/O enabled
//! (what `#[tokio::test]` does), so the calling crate needs no tokio dependency of its own.
//! The names of the emitted tests are those of the functions in [`outbox`], [`inbox`],
//! [`publisher`] and [`source`]; the lists are [`OUTBOX_CHECKS`], [`INBOX_CHECKS`],
//! [`PUBLISHER_CHECKS`] and [`SOURCE_CHECKS`].
//!
//! The in-memory backends run the suite in this crate (`tests/conformance.rs`) through
//! [`MemoryOutboxHarness`], [`MemoryInboxHarness`], [`MemoryPublisherHarness`] and
//! [`MemorySourceHarness`], and so do the fault wrappers of [`crate::fault`] with no fault
//! scheduled; a [`Publisher`] runs
//! [`publisher_conformance_tests!`](crate::publisher_conformance_tests) through a
//! [`PublisherHarness`], a [`MessageSource`] runs
//! [`source_conformance_tests!`](crate::source_conformance_tests) through a [`SourceHarness`]
//! (outbox-kafka runs both against a real broker).
//!
//! A [`Publisher`] over a server the test can stop and restart also runs the outage suite,
//! [`outage::publisher_outage`], through an [`outage::OutageHarness`]: what a broker outage
//! must look like from any publisher (outbox-kafka, outbox-nats and outbox-rabbitmq run it
//! against server instances of their own).
//!
//! A store that implements [`outbox_core::ReportingStore`] also runs
//! [`reporting_conformance_tests!`](crate::reporting_conformance_tests) with its
//! [`OutboxHarness`] ([`REPORTING_CHECKS`]; the in-memory store, outbox-postgres and
//! outbox-mysql do), so the `outbox` command reads the same answers from every store.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use outbox_core::prelude::*;
use outbox_core::{
    async_trait, AckMetadata, ClaimHandle, ClaimMode, ClaimedBatch, Envelope, EventId,
    InboxParking, LogPosition, MessageSource, NativeColumns, Outcome, Publisher, RecordHeader,
    StoreError,
};

use crate::{
    ManualClock, MemoryConsumer, MemoryDb, MemoryInboxStore, MemoryLog, MemoryOutboxStore,
};

pub mod inbox;
pub mod outage;
pub mod outbox;
pub mod publisher;
pub mod registry;
pub mod reporting;
pub mod source;

/// What a backend can do, for the checks that depend on it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The backend supports [`ClaimMode::Lease`].
    pub lease: bool,
    /// The backend supports [`ClaimMode::LockedTransaction`].
    pub locked_transaction: bool,
    /// [`OutboxHarness::advance`] moves the store's clock at once (virtual time). When `false`
    /// it sleeps in real time, so `lease_duration` and `time_step` must be short.
    pub virtual_time: bool,
    /// Lease duration the checks use in lease mode.
    pub lease_duration: Duration,
    /// Smallest duration the checks use for retry delays, retention and ages; it must be long
    /// enough for a few store round trips.
    pub time_step: Duration,
    /// The gap timeout of the harness's stores: how long a head that skips a version is held
    /// before it is parked. Harnesses MUST build their stores with it.
    pub gap_timeout: Duration,
    /// The backend can accept an aggregate's lowest unfinished version as its first when the
    /// aggregate has no state ([`OutboxHarness::store_accepting_first_version`] works).
    pub accept_first_version: bool,
    /// The backend hands out runs ([`ClaimRequest::run`](outbox_core::ClaimRequest::run) above
    /// 1; `outbox_core::store`, *Runs*). Without it the run checks verify only that a claim
    /// asking for runs still hands out heads alone (which the contract allows).
    pub runs: bool,
}

impl Capabilities {
    /// Both claim modes, virtual time, a 30 s lease and a 1 s step: the in-memory backend.
    pub fn virtual_time() -> Self {
        Self {
            lease: true,
            locked_transaction: true,
            virtual_time: true,
            lease_duration: Duration::from_secs(30),
            time_step: Duration::from_secs(1),
            gap_timeout: Duration::from_secs(60),
            accept_first_version: false,
            runs: false,
        }
    }

    /// Real time: both claim modes, a 1.5 s lease and a 300 ms step (for backends whose clock
    /// is the database's `now()`).
    pub fn real_time() -> Self {
        Self {
            lease: true,
            locked_transaction: true,
            virtual_time: false,
            lease_duration: Duration::from_millis(1500),
            time_step: Duration::from_millis(300),
            gap_timeout: Duration::from_millis(600),
            accept_first_version: false,
            runs: false,
        }
    }

    /// Sets `lease`.
    pub fn with_lease(mut self, yes: bool) -> Self {
        self.lease = yes;
        self
    }

    /// Sets `locked_transaction`.
    pub fn with_locked_transaction(mut self, yes: bool) -> Self {
        self.locked_transaction = yes;
        self
    }

    /// Sets `lease_duration`.
    pub fn with_lease_duration(mut self, d: Duration) -> Self {
        self.lease_duration = d;
        self
    }

    /// Sets `gap_timeout`.
    pub fn with_gap_timeout(mut self, d: Duration) -> Self {
        self.gap_timeout = d;
        self
    }

    /// Sets `time_step`.
    pub fn with_time_step(mut self, d: Duration) -> Self {
        self.time_step = d;
        self
    }

    /// Sets `accept_first_version`.
    pub fn with_accept_first_version(mut self, yes: bool) -> Self {
        self.accept_first_version = yes;
        self
    }

    /// Sets `runs`.
    pub fn with_runs(mut self, yes: bool) -> Self {
        self.runs = yes;
        self
    }

    /// The lease claim mode of these capabilities.
    pub fn lease_mode(&self) -> ClaimMode {
        ClaimMode::Lease {
            duration: self.lease_duration,
        }
    }
}

/// What the outbox checks need from a backend.
///
/// Contract for implementors: every harness value (one per test) MUST start from an empty
/// outbox; every [`store`](Self::store) call on one harness MUST return a store over the same
/// data (so two stores act as two relays).
#[async_trait]
pub trait OutboxHarness: Send + Sync {
    /// The store under test.
    type Store: OutboxStore + 'static;

    /// What the backend can do.
    fn capabilities(&self) -> Capabilities;

    /// A store over this harness's database, handing out work in `mode`.
    async fn store(&self, mode: ClaimMode) -> Self::Store;

    /// A store like [`store`](Self::store) that accepts the lowest unfinished version of an
    /// aggregate without state as its first (instead of requiring version 1). Called only when
    /// [`Capabilities::accept_first_version`] is declared; a harness that declares it MUST
    /// implement this (the default panics).
    async fn store_accepting_first_version(&self, mode: ClaimMode) -> Self::Store {
        let _ = mode;
        panic!(
            "Capabilities::accept_first_version is declared but \
             OutboxHarness::store_accepting_first_version is not implemented"
        );
    }

    /// Begins a business transaction for [`AppendStore::append`].
    async fn begin(&self) -> <Self::Store as AppendStore>::Tx;

    /// Commits a transaction.
    async fn commit(&self, tx: <Self::Store as AppendStore>::Tx) -> Result<(), StoreError>;

    /// Rolls a transaction back.
    async fn rollback(&self, tx: <Self::Store as AppendStore>::Tx);

    /// Lets `by` pass on the store's clock (virtual time: at once; real time: sleeps).
    async fn advance(&self, by: Duration);

    /// The store's clock now, to place events in time (default: the system clock, which a
    /// database on the same machine shares).
    async fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now()
    }

    /// Models the crash of the relay holding `claim` in `LockedTransaction` mode: its
    /// connection drops and its locks go. Returns `false` if the harness cannot do that (the
    /// check that needs it then reports itself not applicable).
    async fn abandon(&self, store: &Self::Store, claim: &ClaimHandle) -> bool {
        let _ = (store, claim);
        false
    }
}

/// What the inbox checks need from a backend.
///
/// Every harness value (one per test) MUST start from an empty inbox.
#[async_trait]
pub trait InboxHarness: Send + Sync {
    /// The store under test.
    type Store: InboxParking + 'static;

    /// What the backend can do (only `virtual_time` and `time_step` matter here).
    fn capabilities(&self) -> Capabilities;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// Lets `by` pass on the store's clock.
    async fn advance(&self, by: Duration);

    /// The columns in which the store keeps the native positions of `consumer`'s parked
    /// messages, one entry a message in the order they were parked. `None` (the default): the
    /// store keeps no such columns, and the checks of them report themselves not applicable.
    async fn native_columns(&self, consumer: &str) -> Option<Vec<NativeColumns>> {
        let _ = consumer;
        None
    }

    /// Overwrites the native-position columns of `consumer`'s parked messages with `columns`
    /// (every column, a `None` as NULL), as a writer other than this store could. `false`
    /// (the default): not applicable.
    async fn write_native_columns(&self, consumer: &str, columns: &NativeColumns) -> bool {
        let _ = (consumer, columns);
        false
    }

    /// Puts the inbox back at the version before its native-position columns (its tables and
    /// migration log as that version left them), holding one message that version parked for
    /// `consumer` at the Kafka position `position` with `reason`. `false` (the default): not
    /// applicable.
    async fn before_native_columns(
        &self,
        consumer: &str,
        position: &LogPosition,
        reason: &str,
    ) -> bool {
        let _ = (consumer, position, reason);
        false
    }

    /// Runs the store's inbox migrations and says how many it applied. `None` (the default):
    /// not applicable.
    async fn migrate(&self) -> Option<usize> {
        None
    }
}

/// A stored record as read back by [`PublisherHarness::read_back`]: key, headers, value.
pub type ReadBack = (Option<Vec<u8>>, Vec<(String, Vec<u8>)>, Vec<u8>);

/// What the publisher checks need from a backend.
#[async_trait]
pub trait PublisherHarness: Send + Sync {
    /// The publisher under test.
    type Publisher: Publisher + 'static;

    /// The publisher.
    fn publisher(&self) -> &Self::Publisher;

    /// A valid event for `aggregate_id` at `version` that the publisher routes to an existing
    /// topic. Default: event type `conformance.happened`.
    fn event(&self, aggregate_id: &str, version: i64) -> Envelope {
        event(aggregate_id, version)
    }

    /// The broker's record size limit, for the oversize check (`None`: not applicable).
    fn max_record_bytes(&self) -> Option<usize> {
        None
    }

    /// An event routed to a topic that does not exist (`None`: not applicable).
    fn unroutable_event(&self) -> Option<Envelope> {
        None
    }

    /// Reads back the record acknowledged as `ack` (`None`: not applicable).
    async fn read_back(&self, ack: &AckMetadata) -> Option<ReadBack> {
        let _ = ack;
        None
    }
}

/// A raw record for [`SourceHarness::produce`]: key, headers (in order; `None` values are
/// null) and value (`None`: null).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RawRecord {
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Headers.
    pub headers: Vec<RecordHeader>,
    /// Value.
    pub value: Option<Vec<u8>>,
}

impl RawRecord {
    /// A record.
    pub fn new(key: Option<Vec<u8>>, headers: Vec<RecordHeader>, value: Option<Vec<u8>>) -> Self {
        Self {
            key,
            headers,
            value,
        }
    }
}

/// What a [`MessageSource`] backend can do, for the source checks that depend on it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SourceCapabilities {
    /// A member that leaves commits the attached tracker's final offsets (rebalance callbacks
    /// with a revoke). `false`: leaving is a lost assignment and commits nothing.
    pub commits_on_leave: bool,
    /// The log stores null header values and null record values.
    pub null_values: bool,
    /// [`SourceHarness::delete_records_before`] works.
    pub deletes_records: bool,
    /// How long a check waits for a message (a broker's first group join included).
    pub patience: Duration,
    /// How long a check watches that nothing more arrives.
    pub quiet: Duration,
}

impl SourceCapabilities {
    /// An in-process log: no revoke commits, no null values, records can be deleted, 2 s
    /// patience, 50 ms quiet.
    pub fn in_process() -> Self {
        Self {
            commits_on_leave: false,
            null_values: false,
            deletes_records: true,
            patience: Duration::from_secs(2),
            quiet: Duration::from_millis(50),
        }
    }

    /// A broker: revoke commits and null values, no record deletion, 60 s patience, 1 s quiet.
    pub fn broker() -> Self {
        Self {
            commits_on_leave: true,
            null_values: true,
            deletes_records: false,
            patience: Duration::from_secs(60),
            quiet: Duration::from_secs(1),
        }
    }

    /// Sets `commits_on_leave`.
    pub fn with_commits_on_leave(mut self, yes: bool) -> Self {
        self.commits_on_leave = yes;
        self
    }

    /// Sets `null_values`.
    pub fn with_null_values(mut self, yes: bool) -> Self {
        self.null_values = yes;
        self
    }

    /// Sets `deletes_records`.
    pub fn with_deletes_records(mut self, yes: bool) -> Self {
        self.deletes_records = yes;
        self
    }

    /// Sets `patience`.
    pub fn with_patience(mut self, d: Duration) -> Self {
        self.patience = d;
        self
    }

    /// Sets `quiet`.
    pub fn with_quiet(mut self, d: Duration) -> Self {
        self.quiet = d;
        self
    }
}

/// What the message source checks need from a backend.
///
/// Contract for implementors: every harness value (one per test) MUST own a fresh, empty topic
/// of at least two partitions and a consumer group nobody else uses; every member it hands out
/// subscribes to that topic in that group.
#[async_trait]
pub trait SourceHarness: Send + Sync {
    /// The source under test.
    type Source: MessageSource + 'static;

    /// What the backend can do.
    fn capabilities(&self) -> SourceCapabilities;

    /// The harness's topic.
    fn topic(&self) -> String;

    /// Writes `record` to `partition` of the topic (one record per write) and returns its
    /// offset once it is readable.
    async fn produce(&self, partition: i32, record: RawRecord) -> i64;

    /// A new member of the group, starting where the group committed (or at the earliest
    /// offset). Checks let the previous member [`leave`](Self::leave) first, except
    /// [`take_over`](Self::take_over).
    async fn join(&self) -> Self::Source;

    /// A new member that starts partitions without a committed offset at their end (`None`:
    /// the source cannot; the check reports itself not applicable).
    async fn join_from_latest(&self) -> Option<Self::Source> {
        None
    }

    /// The member leaves the group cleanly (closes; its partitions are revoked).
    async fn leave(&self, member: Self::Source);

    /// Another member takes every partition of `member` away without a clean revoke (a lost
    /// assignment: `member` stalled, or was fenced); returns the new member, which owns them.
    async fn take_over(&self, member: &Self::Source) -> Self::Source;

    /// The group's committed next offset of `partition` (`None`: nothing committed).
    async fn committed(&self, partition: i32) -> Option<i64>;

    /// Deletes the records of `partition` below `offset` (retention). Called only when
    /// [`SourceCapabilities::deletes_records`] is set.
    async fn delete_records_before(&self, partition: i32, offset: i64) {
        let _ = (partition, offset);
        panic!("delete_records_before called on a harness that does not declare it");
    }
}

/// The in-memory source harness: a [`MemoryLog`] with topic `source` (2 partitions) and group
/// `conformance`.
#[derive(Clone, Debug)]
pub struct MemorySourceHarness {
    /// The log.
    pub log: MemoryLog,
}

impl MemorySourceHarness {
    /// A harness over a fresh log.
    pub fn new() -> Self {
        Self {
            log: MemoryLog::new("source", 2),
        }
    }
}

impl Default for MemorySourceHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl SourceHarness for MemorySourceHarness {
    type Source = MemoryConsumer;

    fn capabilities(&self) -> SourceCapabilities {
        SourceCapabilities::in_process()
    }

    fn topic(&self) -> String {
        "source".into()
    }

    async fn produce(&self, partition: i32, record: RawRecord) -> i64 {
        let headers = record
            .headers
            .into_iter()
            .map(|h| {
                let value = h
                    .value
                    .expect("the in-memory log has no null header values");
                (h.name, value)
            })
            .collect();
        let value = record
            .value
            .expect("the in-memory log has no null record values");
        self.log
            .append_raw("source", partition, record.key, headers, value)
            .expect("append to the in-memory log")
    }

    async fn join(&self) -> MemoryConsumer {
        self.log.consumer("conformance", &["source"])
    }

    async fn leave(&self, member: MemoryConsumer) {
        drop(member);
    }

    async fn take_over(&self, member: &MemoryConsumer) -> MemoryConsumer {
        let owner = self.log.consumer("conformance", &["source"]);
        assert!(member.is_fenced(), "a new member fences the previous one");
        owner
    }

    async fn committed(&self, partition: i32) -> Option<i64> {
        self.log.committed("conformance", "source", partition)
    }

    async fn delete_records_before(&self, partition: i32, offset: i64) {
        self.log.truncate_before("source", partition, offset);
    }
}

/// The in-memory publisher harness: a [`MemoryLog`] with topic `conformance` (3 partitions),
/// a 64 KiB record limit, and no route to topic `missing`.
#[derive(Clone, Debug)]
pub struct MemoryPublisherHarness {
    /// The log.
    pub log: MemoryLog,
}

impl MemoryPublisherHarness {
    /// A harness over a fresh log.
    pub fn new() -> Self {
        Self {
            log: MemoryLog::builder()
                .topic("conformance", 3)
                .default_topic("conformance")
                .route("conformance.unroutable", "missing")
                .max_record_bytes(64 * 1024)
                .build(),
        }
    }
}

impl Default for MemoryPublisherHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl PublisherHarness for MemoryPublisherHarness {
    type Publisher = MemoryLog;

    fn publisher(&self) -> &MemoryLog {
        &self.log
    }

    fn max_record_bytes(&self) -> Option<usize> {
        Some(64 * 1024)
    }

    fn unroutable_event(&self) -> Option<Envelope> {
        Envelope::builder("conformance", "u-1", 1, "conformance.unroutable")
            .event_id(fresh_event_id())
            .build()
            .ok()
    }

    async fn read_back(&self, ack: &AckMetadata) -> Option<ReadBack> {
        let (topic, partition, offset) = ack.as_kafka()?;
        self.log
            .records(topic, partition)
            .into_iter()
            .find(|r| r.offset == offset)
            .map(|r| (r.key, r.headers, r.value))
    }
}

/// The in-memory outbox harness: a fresh [`MemoryDb`] on a [`ManualClock`].
#[derive(Clone, Debug, Default)]
pub struct MemoryOutboxHarness {
    /// The clock.
    pub clock: ManualClock,
    /// The database.
    pub db: MemoryDb,
    /// Its stores hand out heads only, as a store without runs ([`MemoryOutboxStore::runs`]).
    pub heads_only: bool,
}

impl MemoryOutboxHarness {
    /// A harness over a fresh database.
    pub fn new() -> Self {
        let clock = ManualClock::default();
        Self {
            db: MemoryDb::new(clock.clone()),
            clock,
            heads_only: false,
        }
    }

    /// A harness whose stores ignore runs (a store without them must pass the suite too).
    pub fn heads_only() -> Self {
        Self {
            heads_only: true,
            ..Self::new()
        }
    }
}

#[async_trait]
impl OutboxHarness for MemoryOutboxHarness {
    type Store = MemoryOutboxStore;

    fn capabilities(&self) -> Capabilities {
        Capabilities::virtual_time()
            .with_accept_first_version(true)
            .with_runs(!self.heads_only)
    }

    async fn store(&self, mode: ClaimMode) -> MemoryOutboxStore {
        MemoryOutboxStore::new(&self.db, mode)
            .gap_timeout(self.capabilities().gap_timeout)
            .runs(!self.heads_only)
    }

    async fn store_accepting_first_version(&self, mode: ClaimMode) -> MemoryOutboxStore {
        self.store(mode).await.accept_first_version(true)
    }

    async fn begin(&self) -> crate::MemoryTx {
        self.db.begin()
    }

    async fn commit(&self, tx: crate::MemoryTx) -> Result<(), StoreError> {
        tx.commit()
    }

    async fn rollback(&self, tx: crate::MemoryTx) {
        tx.rollback();
    }

    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    async fn now(&self) -> chrono::DateTime<chrono::Utc> {
        outbox_core::Clock::now(&self.clock)
    }

    async fn abandon(&self, store: &MemoryOutboxStore, claim: &ClaimHandle) -> bool {
        store.abandon(claim);
        true
    }
}

/// The in-memory inbox harness.
#[derive(Clone, Debug)]
pub struct MemoryInboxHarness {
    /// The clock.
    pub clock: ManualClock,
    /// The inbox.
    pub inbox: MemoryInboxStore,
}

impl MemoryInboxHarness {
    /// A harness over a fresh database.
    pub fn new() -> Self {
        let clock = ManualClock::default();
        Self {
            inbox: MemoryInboxStore::new(&MemoryDb::new(clock.clone())),
            clock,
        }
    }
}

impl Default for MemoryInboxHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl InboxHarness for MemoryInboxHarness {
    type Store = MemoryInboxStore;

    fn capabilities(&self) -> Capabilities {
        Capabilities::virtual_time()
    }

    fn store(&self) -> &MemoryInboxStore {
        &self.inbox
    }

    async fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }
}

/// Runs one check on a current-thread tokio runtime with time and I/O enabled (used by the
/// macros).
pub fn run<F: Future<Output = ()>>(check: F) {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance check")
        .block_on(check);
}

pub(crate) fn not_applicable(check: &str, why: &str) {
    eprintln!("conformance: {check} not applicable: {why}");
}

static COUNTER: AtomicU64 = AtomicU64::new(1);

/// A unique number within this process, for aggregate names and event ids.
pub(crate) fn unique() -> u64 {
    COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// A fresh event id, increasing with each call in this process.
pub(crate) fn fresh_event_id() -> EventId {
    let n = unique();
    let at = ManualClock::epoch() + chrono::Duration::milliseconds(n as i64);
    EventId::from_parts(at, u128::from(n) << 16)
}

/// A valid test envelope.
pub(crate) fn event(aggregate: &str, version: i64) -> Envelope {
    Envelope::builder("conformance", aggregate, version, "conformance.happened")
        .event_id(fresh_event_id())
        .json(&serde_json::json!({ "v": version }))
        .expect("json payload")
        .build()
        .expect("valid envelope")
}

/// A publication of each record of `batch`, acknowledged by the entry of `acks` at the index
/// of its event in `events` (every claimed event is one of `events`).
pub(crate) fn published_with_acks(
    batch: &ClaimedBatch,
    events: &[Envelope],
    acks: &[AckMetadata],
) -> Vec<Outcome> {
    batch
        .records
        .iter()
        .map(|r| {
            let k = events
                .iter()
                .position(|e| e.event_id == r.envelope.event_id)
                .expect("a claimed event was appended");
            Outcome::Published {
                event_id: r.envelope.event_id,
                ack: acks[k].clone(),
            }
        })
        .collect()
}

/// Names of the outbox checks, in the order the macro emits them.
pub const OUTBOX_CHECKS: &[&str] = &[
    "append_commits_with_the_transaction",
    "append_validates_and_writes_nothing_on_error",
    "duplicate_event_id_is_a_constraint_error",
    "claim_is_exclusive_between_relays",
    "claim_returns_only_aggregate_heads",
    "claim_is_oldest_first_within_the_limit",
    "late_commit_with_lower_sequence_is_not_skipped",
    "lease_expiry_returns_rows_to_the_pool",
    "stale_lease_holder_is_fenced",
    "mark_published_is_idempotent",
    "complete_releases_rows_without_outcome",
    "release_returns_rows_without_counting_an_attempt",
    "retry_outcome_counts_and_delays",
    "parking_blocks_only_its_aggregate",
    "operator_retry_is_audited",
    "operator_discard_needs_a_reason_and_is_audited",
    "operator_reissue_replaces_the_event_and_is_audited",
    "cleanup_removes_only_published_rows_past_retention",
    "stats_report_backlog_and_ages",
    "locked_claim_is_held_until_completed",
    "locked_claim_is_freed_when_the_relay_crashes",
    "claim_mode_is_reported",
    "claim_limit_zero_claims_nothing",
    "late_lower_version_goes_out_before_the_higher_one",
    "of_two_events_of_one_version_the_first_appended_goes_out",
    "version_at_or_below_the_last_published_is_parked_out_of_order",
    "version_gap_is_parked_after_the_timeout_and_retry_accepts_it",
    "defer_outcome_delays_without_counting_an_attempt",
    "reissued_copy_carries_the_original_id",
    "release_claims_of_a_gone_relay",
    "operator_action_on_a_filling_gap_is_refused",
    "first_version_is_accepted_again_after_a_claim_that_did_not_publish",
    "a_late_lower_version_never_follows_a_first_version_that_may_have_been_sent",
    "stats_keep_blocked_and_gap_held_events_out_of_the_claimable_age",
    "a_claim_reports_what_it_parked_and_held_beside_what_it_claimed",
    "runs_are_consecutive_from_the_next_version",
    "a_run_ends_at_a_gap_a_duplicate_version_or_a_parked_row",
    "a_run_completion_with_a_hole_is_refused_after_it",
    "the_rest_of_a_run_is_released_and_claimable_at_once",
];

/// Names of the publisher checks, in the order the macro emits them.
pub const PUBLISHER_CHECKS: &[&str] = &[
    "publish_returns_one_result_per_event_in_order",
    "mixed_outcomes_in_one_batch_map_to_their_records",
    "empty_batch_returns_no_results",
    "records_follow_the_wire_mapping",
    "oversize_record_is_a_permanent_error",
    "unknown_topic_is_a_permanent_error",
    "delivery_timeout_is_positive",
];

/// Names of the message source checks, in the order the macro emits them.
pub const SOURCE_CHECKS: &[&str] = &[
    "records_round_trip_key_headers_and_value",
    "nothing_is_committed_without_a_commit_call",
    "commit_moves_exactly_the_given_offsets",
    "a_new_member_resumes_from_the_last_commit",
    "leaving_commits_the_trackers_final_offsets",
    "assignment_resets_the_attached_tracker",
    "a_member_that_lost_its_partitions_commits_nothing",
    "a_dropped_poll_loses_no_message",
    "a_commit_below_the_earliest_offset_is_a_retention_gap",
    "start_from_latest_skips_earlier_records_and_keeps_later_ones",
];

/// Names of the inbox checks, in the order the macro emits them.
pub const INBOX_CHECKS: &[&str] = &[
    "first_registration_is_fresh_then_duplicate",
    "batch_registration_answers_each_id_in_order",
    "reissued_copy_and_original_are_one_event",
    "original_id_dedupe_is_scoped_to_the_aggregate",
    "park_dedupe_is_scoped_to_the_aggregate",
    "park_keeps_a_crafted_scoped_id_collision",
    "rolled_back_registration_is_fresh_again",
    "consumers_deduplicate_independently",
    "concurrent_registrations_cannot_both_commit",
    "cleanup_forgets_registrations_past_retention",
    "versions_advance_and_conflict_when_moved",
    "park_head_blocks_its_aggregate_only",
    "waiting_messages_queue_behind_the_head",
    "undecodable_messages_park_raw",
    "parked_messages_resolve_in_release_order_and_are_audited",
    "release_and_waiting_park_serialize",
    "parked_messages_keep_their_native_position",
    "a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position",
    "native_columns_that_describe_no_position_are_refused",
    "an_undecodable_jetstream_message_is_parked_once_per_stream_sequence",
    "a_crafted_event_id_does_not_hide_an_undecodable_message",
];

/// The names of the reporting checks (module [`reporting`]).
pub const REPORTING_CHECKS: &[&str] = &[
    "backlog_is_the_monitoring_snapshot",
    "publish_latency_percentiles_over_a_window",
    "published_events_come_in_publication_order_and_page_by_position",
    "cleanup_candidates_count_what_a_cleanup_removes",
    "interval_counts_per_interval_and_event_type",
    "published_ids_name_the_original_of_a_copy",
    "published_events_keep_each_transport_acknowledgement",
];

/// The names of the relay registry checks ([`registry`]), in the order
/// [`registry_conformance_tests!`](crate::registry_conformance_tests) emits them.
pub const REGISTRY_CHECKS: &[&str] = &[
    "registered_relays_are_listed_until_they_deregister",
    "a_relay_without_heartbeat_turns_stale",
    "live_claims_of_counts_what_a_release_would_end",
];

/// Emits one named test per relay registry check (see [`REGISTRY_CHECKS`]) from a setup
/// expression: an expression evaluating to a future that yields an [`OutboxHarness`] whose
/// store implements [`outbox_core::RelayRegistry`], evaluated once per test.
///
/// ```
/// mod suite {
///     outbox_testkit::registry_conformance_tests!(async {
///         outbox_testkit::conformance::MemoryOutboxHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! registry_conformance_tests {
    ($setup:expr) => {
        $crate::registry_conformance_tests!(@emit ($setup)
            registered_relays_are_listed_until_they_deregister,
            a_relay_without_heartbeat_turns_stale,
            live_claims_of_counts_what_a_release_would_end,
        );
    };
    (@emit ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::registry::$check(&harness).await;
                });
            }
        )*
    };
}

/// Emits one named test per reporting check (see [`REPORTING_CHECKS`]) from a setup
/// expression: an expression evaluating to a future that yields an [`OutboxHarness`] whose
/// store implements [`outbox_core::ReportingStore`], evaluated once per test.
///
/// ```
/// mod suite {
///     outbox_testkit::reporting_conformance_tests!(async {
///         outbox_testkit::conformance::MemoryOutboxHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! reporting_conformance_tests {
    ($setup:expr) => {
        $crate::reporting_conformance_tests!(@emit ($setup)
            backlog_is_the_monitoring_snapshot,
            publish_latency_percentiles_over_a_window,
            published_events_come_in_publication_order_and_page_by_position,
            cleanup_candidates_count_what_a_cleanup_removes,
            interval_counts_per_interval_and_event_type,
            published_ids_name_the_original_of_a_copy,
            published_events_keep_each_transport_acknowledgement,
        );
    };
    (@emit ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::reporting::$check(&harness).await;
                });
            }
        )*
    };
}

/// Emits one named test per outbox check (see [`OUTBOX_CHECKS`]) from a setup expression: an
/// expression evaluating to a future that yields an [`OutboxHarness`], evaluated once per test.
///
/// ```
/// mod suite {
///     outbox_testkit::outbox_conformance_tests!(async {
///         outbox_testkit::conformance::MemoryOutboxHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! outbox_conformance_tests {
    ($setup:expr) => {
        $crate::outbox_conformance_tests!(@emit ($setup)
            append_commits_with_the_transaction,
            append_validates_and_writes_nothing_on_error,
            duplicate_event_id_is_a_constraint_error,
            claim_is_exclusive_between_relays,
            claim_returns_only_aggregate_heads,
            claim_is_oldest_first_within_the_limit,
            late_commit_with_lower_sequence_is_not_skipped,
            lease_expiry_returns_rows_to_the_pool,
            stale_lease_holder_is_fenced,
            mark_published_is_idempotent,
            complete_releases_rows_without_outcome,
            release_returns_rows_without_counting_an_attempt,
            retry_outcome_counts_and_delays,
            parking_blocks_only_its_aggregate,
            operator_retry_is_audited,
            operator_discard_needs_a_reason_and_is_audited,
            operator_reissue_replaces_the_event_and_is_audited,
            cleanup_removes_only_published_rows_past_retention,
            stats_report_backlog_and_ages,
            locked_claim_is_held_until_completed,
            locked_claim_is_freed_when_the_relay_crashes,
            claim_mode_is_reported,
            claim_limit_zero_claims_nothing,
            late_lower_version_goes_out_before_the_higher_one,
            of_two_events_of_one_version_the_first_appended_goes_out,
            version_at_or_below_the_last_published_is_parked_out_of_order,
            version_gap_is_parked_after_the_timeout_and_retry_accepts_it,
            defer_outcome_delays_without_counting_an_attempt,
            reissued_copy_carries_the_original_id,
            release_claims_of_a_gone_relay,
            operator_action_on_a_filling_gap_is_refused,
            first_version_is_accepted_again_after_a_claim_that_did_not_publish,
            a_late_lower_version_never_follows_a_first_version_that_may_have_been_sent,
            stats_keep_blocked_and_gap_held_events_out_of_the_claimable_age,
            a_claim_reports_what_it_parked_and_held_beside_what_it_claimed,
            runs_are_consecutive_from_the_next_version,
            a_run_ends_at_a_gap_a_duplicate_version_or_a_parked_row,
            a_run_completion_with_a_hole_is_refused_after_it,
            the_rest_of_a_run_is_released_and_claimable_at_once,
        );
    };
    (@emit ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::outbox::$check(&harness).await;
                });
            }
        )*
    };
}

/// Emits one named test per inbox check (see [`INBOX_CHECKS`]) from a setup expression: an
/// expression evaluating to a future that yields an [`InboxHarness`], evaluated once per test.
///
/// ```
/// mod suite {
///     outbox_testkit::inbox_conformance_tests!(async {
///         outbox_testkit::conformance::MemoryInboxHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! inbox_conformance_tests {
    ($setup:expr) => {
        $crate::inbox_conformance_tests!(@emit ($setup)
            first_registration_is_fresh_then_duplicate,
            batch_registration_answers_each_id_in_order,
            reissued_copy_and_original_are_one_event,
            original_id_dedupe_is_scoped_to_the_aggregate,
            park_dedupe_is_scoped_to_the_aggregate,
            park_keeps_a_crafted_scoped_id_collision,
            rolled_back_registration_is_fresh_again,
            consumers_deduplicate_independently,
            concurrent_registrations_cannot_both_commit,
            cleanup_forgets_registrations_past_retention,
            versions_advance_and_conflict_when_moved,
            park_head_blocks_its_aggregate_only,
            waiting_messages_queue_behind_the_head,
            undecodable_messages_park_raw,
            parked_messages_resolve_in_release_order_and_are_audited,
            release_and_waiting_park_serialize,
            parked_messages_keep_their_native_position,
            a_message_parked_before_the_native_columns_reads_back_as_its_kafka_position,
            native_columns_that_describe_no_position_are_refused,
            an_undecodable_jetstream_message_is_parked_once_per_stream_sequence,
            a_crafted_event_id_does_not_hide_an_undecodable_message,
        );
    };
    (@emit ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::inbox::$check(&harness).await;
                });
            }
        )*
    };
}

/// Emits one named test per publisher check (see [`PUBLISHER_CHECKS`]) from a setup
/// expression: an expression evaluating to a future that yields a [`PublisherHarness`],
/// evaluated once per test.
///
/// With `optional` before it, the future yields an `Option` of the harness and a `None` ends
/// the test at once: for backends whose service may be skipped on purpose (the setup reports
/// the skip; it must fail when the service is required and missing).
///
/// ```
/// mod suite {
///     outbox_testkit::publisher_conformance_tests!(async {
///         outbox_testkit::conformance::MemoryPublisherHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! publisher_conformance_tests {
    (optional $setup:expr) => {
        $crate::publisher_conformance_tests!(@list (optional) ($setup));
    };
    ($setup:expr) => {
        $crate::publisher_conformance_tests!(@list (required) ($setup));
    };
    (@list $mode:tt ($setup:expr)) => {
        $crate::publisher_conformance_tests!(@emit $mode ($setup)
            publish_returns_one_result_per_event_in_order,
            mixed_outcomes_in_one_batch_map_to_their_records,
            empty_batch_returns_no_results,
            records_follow_the_wire_mapping,
            oversize_record_is_a_permanent_error,
            unknown_topic_is_a_permanent_error,
            delivery_timeout_is_positive,
        );
    };
    (@emit (required) ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::publisher::$check(&harness).await;
                });
            }
        )*
    };
    (@emit (optional) ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    if let Some(harness) = $setup.await {
                        $crate::conformance::publisher::$check(&harness).await;
                    }
                });
            }
        )*
    };
}

/// Emits one named test per message source check (see [`SOURCE_CHECKS`]) from a setup
/// expression: an expression evaluating to a future that yields a [`SourceHarness`], evaluated
/// once per test.
///
/// `optional` works as for [`publisher_conformance_tests!`](crate::publisher_conformance_tests).
///
/// ```
/// mod suite {
///     outbox_testkit::source_conformance_tests!(async {
///         outbox_testkit::conformance::MemorySourceHarness::new()
///     });
/// }
/// # fn main() {}
/// ```
#[macro_export]
macro_rules! source_conformance_tests {
    (optional $setup:expr) => {
        $crate::source_conformance_tests!(@list (optional) ($setup));
    };
    ($setup:expr) => {
        $crate::source_conformance_tests!(@list (required) ($setup));
    };
    (@list $mode:tt ($setup:expr)) => {
        $crate::source_conformance_tests!(@emit $mode ($setup)
            records_round_trip_key_headers_and_value,
            nothing_is_committed_without_a_commit_call,
            commit_moves_exactly_the_given_offsets,
            a_new_member_resumes_from_the_last_commit,
            leaving_commits_the_trackers_final_offsets,
            assignment_resets_the_attached_tracker,
            a_member_that_lost_its_partitions_commits_nothing,
            a_dropped_poll_loses_no_message,
            a_commit_below_the_earliest_offset_is_a_retention_gap,
            start_from_latest_skips_earlier_records_and_keeps_later_ones,
        );
    };
    (@emit (required) ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    let harness = $setup.await;
                    $crate::conformance::source::$check(&harness).await;
                });
            }
        )*
    };
    (@emit (optional) ($setup:expr) $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::conformance::run(async {
                    if let Some(harness) = $setup.await {
                        $crate::conformance::source::$check(&harness).await;
                    }
                });
            }
        )*
    };
}
