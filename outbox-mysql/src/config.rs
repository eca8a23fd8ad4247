//! Configuration of the stores: names, claim mode, gap timeout, backpressure hook.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{ClaimMode, Envelope, EnvelopeLimits, StoreError};

/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "outbox_events";
/// Default inbox table name.
pub const DEFAULT_INBOX_TABLE: &str = "processed_events";
/// Default of [`OutboxSettings::gap_timeout`].
pub const DEFAULT_GAP_TIMEOUT: Duration = Duration::from_secs(300);

/// The one place where an append can be refused before anything is written (backpressure).
///
/// Called by [`crate::MySqlOutboxStore::append_many`] with the events about to be written,
/// after validation and before the INSERT. Return a `Backpressure` error to refuse. It is
/// synchronous on purpose: it runs inside the caller's business transaction and must not add
/// a round trip; feed it from a periodic `stats()` reading.
pub trait AppendGuard: Send + Sync + std::fmt::Debug {
    /// `Ok(())` lets the append go ahead.
    fn check(&self, events: &[Envelope]) -> Result<(), StoreError>;
}

/// The shared backpressure gate of `outbox-core` is an append guard.
impl AppendGuard for outbox_core::backpressure::Backpressure {
    fn check(&self, events: &[Envelope]) -> Result<(), StoreError> {
        outbox_core::backpressure::Backpressure::check(self, events)
    }
}

/// Settings of a [`crate::MySqlOutboxStore`], built by [`crate::MySqlOutboxStoreBuilder`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutboxSettings {
    /// Database of the tables; `None` (default): the connection's current database.
    pub database: Option<String>,
    /// Outbox table; the state, audit, archive and lease tables are `<table>_aggregate`,
    /// `<table>_audit`, `<table>_archive` and `<table>_lease`. Default
    /// [`DEFAULT_OUTBOX_TABLE`].
    pub table: String,
    /// Claim mode. Default: a 30 s lease.
    pub claim_mode: ClaimMode,
    /// Cleanup copies rows into `<table>_archive` before deleting them. Default `false`.
    pub archive: bool,
    /// Envelope limits checked on append. Default [`EnvelopeLimits::default`].
    pub limits: EnvelopeLimits,
    /// For [`ClaimMode::LockedTransaction`]: the server closes a claim's connection that stays
    /// idle longer than this (the session's `wait_timeout`, whole seconds, rounded up), which
    /// rolls the claim back and frees its aggregates if a relay hangs or leaks its claim.
    /// Default 5 minutes; must exceed the publisher's delivery timeout.
    pub locked_max_hold: Duration,
    /// Backpressure hook, see [`AppendGuard`]. Default none.
    pub append_guard: Option<Arc<dyn AppendGuard>>,
    /// How long an aggregate's head that skips a version is held before it is parked as a
    /// version gap, counted from the first claim that held it. Default
    /// [`DEFAULT_GAP_TIMEOUT`] (5 minutes). A held head is re-checked at most every second.
    pub gap_timeout: Duration,
    /// Accept the lowest pending version of an aggregate without a published or discarded
    /// version as its first. Default `false` (the first must be version 1).
    pub accept_first_version: bool,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            database: None,
            table: DEFAULT_OUTBOX_TABLE.to_owned(),
            claim_mode: ClaimMode::Lease {
                duration: Duration::from_secs(30),
            },
            archive: false,
            limits: EnvelopeLimits::default(),
            locked_max_hold: Duration::from_secs(300),
            append_guard: None,
            gap_timeout: DEFAULT_GAP_TIMEOUT,
            accept_first_version: false,
        }
    }
}
