//! [`MySqlOutboxStoreBuilder`]: names, claim mode and limits, validated by `build()`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{ClaimMode, EnvelopeLimits, StoreError, MAX_LEASE};
use sqlx::MySqlPool;

use super::{Inner, MySqlOutboxStore, Tables};
use crate::config::{AppendGuard, OutboxSettings};
use crate::error::config;
use crate::schema::{validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};

/// Builder of a [`MySqlOutboxStore`]; [`build`](Self::build) validates.
#[derive(Debug, Clone)]
#[must_use]
pub struct MySqlOutboxStoreBuilder {
    pub(super) pool: MySqlPool,
    pub(super) settings: OutboxSettings,
    pub(super) delivery_timeout: Option<Duration>,
}

impl MySqlOutboxStoreBuilder {
    /// Database of the tables (default: the connection's current database). `migrate`
    /// creates it when missing.
    pub fn database(mut self, database: impl Into<String>) -> Self {
        self.settings.database = Some(database.into());
        self
    }
    /// Outbox table name (default `outbox_events`, at most 40 characters).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.settings.table = table.into();
        self
    }
    /// Claim mode (default: 30 s lease).
    pub fn claim_mode(mut self, mode: ClaimMode) -> Self {
        self.settings.claim_mode = mode;
        self
    }
    /// Archive rows into `<table>_archive` on cleanup (default off).
    pub fn archive(mut self, archive: bool) -> Self {
        self.settings.archive = archive;
        self
    }
    /// Envelope limits checked on append. `build()` refuses limits whose
    /// `max_aggregate_name_bytes` is above [`outbox_core::MAX_AGGREGATE_NAME_BYTES`] (1,024
    /// bytes, the bound of every store: an event this store takes is one any other store
    /// takes); raising `max_name_len` leaves the aggregate names at that bound.
    pub fn limits(mut self, limits: EnvelopeLimits) -> Self {
        self.settings.limits = limits;
        self
    }
    /// Longest idle time of a locked claim's connection (default 5 min; whole seconds,
    /// rounded up, at least 1 s).
    pub fn locked_max_hold(mut self, d: Duration) -> Self {
        self.settings.locked_max_hold = d;
        self
    }
    /// How long a head that skips a version is held before it is parked as a version gap
    /// (default [`crate::DEFAULT_GAP_TIMEOUT`], 5 minutes).
    pub fn gap_timeout(mut self, d: Duration) -> Self {
        self.settings.gap_timeout = d;
        self
    }
    /// Accept the lowest pending version of an aggregate the store has no published or
    /// discarded version for as its first (default `false`: such an aggregate's first event
    /// must be version 1, and a later one is held as a version gap). For aggregates that
    /// already have a history when they adopt the outbox. The price: for such an aggregate, a
    /// lower version that commits after a higher one is parked as out of order instead of
    /// going out first. The acceptance holds until a version is published or discarded:
    /// a claim that does not publish (a retry, a deferral, a release, a crash) forgets nothing.
    /// Once a version may have reached the broker (a failure that left its delivery uncertain,
    /// or a lease that ended without an outcome or a release), it stays the first: a lower
    /// version that commits later is parked as out of order.
    pub fn accept_first_version(mut self, on: bool) -> Self {
        self.settings.accept_first_version = on;
        self
    }
    /// The publisher's delivery timeout: `build()` then rejects a lease (or, in locked mode, a
    /// `locked_max_hold`) that does not outlive it. (`outbox_core::Relay::new` checks both
    /// against the publisher too, and always.)
    pub fn publisher_delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = Some(d);
        self
    }
    /// The backpressure hook, see [`AppendGuard`].
    pub fn append_guard(mut self, guard: Arc<dyn AppendGuard>) -> Self {
        self.settings.append_guard = Some(guard);
        self
    }

    /// Validates names and durations. A hostile or malformed identifier is a `Configuration`
    /// error; it never reaches SQL.
    pub fn build(self) -> Result<MySqlOutboxStore, StoreError> {
        let s = &self.settings;
        if let Some(d) = &s.database {
            validate_identifier("database", d, MAX_IDENTIFIER_LEN)?;
        }
        validate_identifier("table", &s.table, MAX_TABLE_NAME_LEN)?;
        s.limits.check_storable().map_err(|e| config(e.0))?;
        match s.claim_mode {
            ClaimMode::Lease { duration } if duration < Duration::from_millis(1) => {
                return Err(config("lease duration must be at least 1 ms"));
            }
            ClaimMode::Lease { duration } if duration > MAX_LEASE => {
                return Err(config(format!(
                    "a lease of {duration:?} is longer than {MAX_LEASE:?}: a relay that dies \
                     holding it would keep its events unpublished that long"
                )));
            }
            ClaimMode::LockedTransaction
                if s.locked_max_hold < Duration::from_secs(1)
                    || s.locked_max_hold > Duration::from_secs(31_536_000) =>
            {
                return Err(config(format!(
                    "locked_max_hold of {:?} is outside 1 s..=365 days (the server's \
                     wait_timeout counts whole seconds)",
                    s.locked_max_hold
                )));
            }
            ClaimMode::Lease { .. } | ClaimMode::LockedTransaction => {}
            other => return Err(config(format!("unsupported claim mode {other:?}"))),
        }
        if s.gap_timeout < Duration::from_millis(1) || s.gap_timeout > Duration::from_secs(86_400) {
            return Err(config(format!(
                "gap_timeout of {:?} is outside 1 ms..=24 h",
                s.gap_timeout
            )));
        }
        if let Some(timeout) = self.delivery_timeout {
            let (what, claim) = match s.claim_mode {
                ClaimMode::Lease { duration } => ("lease", duration),
                _ => ("locked_max_hold", s.locked_max_hold),
            };
            if claim <= timeout {
                return Err(config(format!(
                    "the {what} ({claim:?}) must outlive the publisher's delivery timeout \
                     ({timeout:?})"
                )));
            }
        }
        let tables = Tables::new(s.database.as_deref(), &s.table);
        Ok(MySqlOutboxStore {
            inner: Arc::new(Inner {
                pool: self.pool,
                settings: self.settings,
                tables,
                locked: Mutex::new(HashMap::new()),
                leased: Mutex::new(HashMap::new()),
                wakers: super::wake::Wakers::default(),
            }),
        })
    }
}
