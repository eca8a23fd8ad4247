//! Configuration of the stores: names, claim mode, wake-up channel, backpressure hook.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{ClaimMode, Envelope, EnvelopeLimits, StoreError};

/// Default schema of the outbox and inbox tables.
pub const DEFAULT_SCHEMA: &str = "outbox";
/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox_events";
/// Default inbox table name.
pub const DEFAULT_INBOX_TABLE: &str = "processed_events";

/// The one place where an append can be refused before anything is written (backpressure).
///
/// Called by [`crate::PostgresOutboxStore::append_many`] with the events about to be written,
/// after validation and before the INSERT. Return a `Backpressure` error
/// (`StoreError::new(StoreErrorKind::Backpressure, ..)`, transient) to refuse. The check is
/// synchronous on purpose: it runs inside the caller's business transaction and must not add a
/// round trip; feed it from a periodic [`outbox_core::MaintenanceStore::stats`] reading (an atomic
/// backlog gauge) and decide there, e.g. "refuse non-critical events above N".
pub trait AppendGuard: Send + Sync + std::fmt::Debug {
    /// `Ok(())` lets the append go ahead.
    fn check(&self, events: &[Envelope]) -> Result<(), StoreError>;
}

/// The shared backpressure gate of `outbox-core` is an append guard: the store's own
/// [`crate::PostgresOutboxStore::append_many`] then refuses non-critical events above the
/// thresholds like `outbox_core::backpressure::BackpressureStore` does.
impl AppendGuard for outbox_core::backpressure::Backpressure {
    fn check(&self, events: &[Envelope]) -> Result<(), StoreError> {
        outbox_core::backpressure::Backpressure::check(self, events)
    }
}

/// Settings of a [`crate::PostgresOutboxStore`], built by
/// [`crate::PostgresOutboxStoreBuilder`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutboxSettings {
    /// Schema. Default [`DEFAULT_SCHEMA`].
    pub schema: String,
    /// Outbox table; the audit and archive tables are `<table>_audit` and `<table>_archive`.
    /// Default [`DEFAULT_OUTBOX_TABLE`].
    pub table: String,
    /// Claim mode. Default: a 30 s lease.
    pub claim_mode: ClaimMode,
    /// `NOTIFY` channel raised by appends (delivered at commit). Default
    /// `<schema>_<table>`; `None` turns notifications off.
    pub notify_channel: Option<String>,
    /// The wake-up gate: `true` (default) raises the `NOTIFY` only while a relay of this table
    /// is idle and waiting for one (it holds the table's gate lock, see
    /// [`crate::PostgresOutboxStore::wake_gate_armed`]); a busy relay claims again on its own.
    /// `false`: every append notifies. PostgreSQL serializes the commits of notifying
    /// transactions, so under load the gate keeps group commit for the business transactions.
    /// Appenders and relays must agree: a relay of a version without the gate is never woken by
    /// gated appends and falls back to polling.
    pub wake_gate: bool,
    /// How long an idle relay waits, when it arms the gate, for the appends in flight to end
    /// (default 200 ms). When the wait runs out the relay stays unarmed and polls.
    pub wake_gate_wait: Duration,
    /// Cleanup copies rows into `<table>_archive` before deleting them. Default `false`.
    pub archive: bool,
    /// Envelope limits checked on append. Default [`EnvelopeLimits::default`].
    pub limits: EnvelopeLimits,
    /// For [`ClaimMode::LockedTransaction`]: the server ends a claim transaction that stays
    /// idle longer than this (`idle_in_transaction_session_timeout`), releasing its locks if a
    /// relay hangs or leaks its claim. Default 5 minutes; must exceed the publisher's delivery
    /// timeout.
    pub locked_max_hold: Duration,
    /// `true`: completions (`complete`, and the end of a locked claim) wait for the WAL flush
    /// at commit. Default `false`: they commit with `synchronous_commit = off`, which saves a
    /// disk flush per batch and is safe under at-least-once delivery: a completion lost in a
    /// server crash only makes its events be published again (a duplicate), and any later
    /// claim of the same aggregate commits synchronously, which flushes the earlier completion
    /// first, so order holds. Claims in lease mode and operator actions always commit
    /// synchronously.
    pub synchronous_completion: bool,
    /// Backpressure hook, see [`AppendGuard`]. Default none.
    pub append_guard: Option<Arc<dyn AppendGuard>>,
    /// How long an aggregate's head that skips a version (its predecessor never committed, or
    /// not yet) is held before it is parked as a version gap for an operator to decide,
    /// measured from the head's insertion. Default [`DEFAULT_GAP_TIMEOUT`] (5 minutes). A held
    /// head is re-checked at most every second, so it goes out within about a second of its
    /// missing predecessor's publication.
    pub gap_timeout: Duration,
    /// Accept the lowest pending version of an aggregate without state as its first. Default
    /// `false` (the first must be version 1). See
    /// [`crate::PostgresOutboxStoreBuilder::accept_first_version`].
    pub accept_first_version: bool,
    /// The most published events [`crate::PostgresOutboxStore::publish_latency`] reads for
    /// its percentiles. A window with more finished events is estimated over its latest
    /// `latency_sample` publications and says so ([`outbox_core::LatencySummary::sample`]);
    /// up to this many, the figures are exact. Default [`DEFAULT_LATENCY_SAMPLE`].
    pub latency_sample: usize,
}

/// Default of [`OutboxSettings::latency_sample`]: 5,000 publications. Reading them costs a
/// few milliseconds; a 15-minute window at 115 events/s (10M rows a day) holds about 104,000,
/// which took 300-400 ms to read in full (issue 25).
pub const DEFAULT_LATENCY_SAMPLE: usize = 5_000;

/// Default of [`OutboxSettings::gap_timeout`].
pub const DEFAULT_GAP_TIMEOUT: Duration = Duration::from_secs(300);

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_OUTBOX_TABLE.to_owned(),
            claim_mode: ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
            notify_channel: Some(format!("{DEFAULT_SCHEMA}_{DEFAULT_OUTBOX_TABLE}")),
            wake_gate: true,
            wake_gate_wait: Duration::from_millis(200),
            archive: false,
            limits: EnvelopeLimits::default(),
            locked_max_hold: Duration::from_secs(300),
            synchronous_completion: false,
            append_guard: None,
            gap_timeout: DEFAULT_GAP_TIMEOUT,
            accept_first_version: false,
            latency_sample: DEFAULT_LATENCY_SAMPLE,
        }
    }
}
