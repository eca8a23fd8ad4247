//! [`PostgresOutboxStoreBuilder`]: names, claim mode and limits, validated by `build()`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{ClaimMode, EnvelopeLimits, StoreError, MAX_LEASE};
use sqlx::PgPool;

use super::{Inner, PostgresOutboxStore};
use crate::config::{AppendGuard, OutboxSettings};
use crate::error::config;
use crate::schema::{validate_identifier, MAX_IDENTIFIER_LEN, MAX_TABLE_NAME_LEN};
use crate::sql::{seed, OutboxSql};

/// Builder of a [`PostgresOutboxStore`]; [`build`](Self::build) validates.
#[derive(Debug, Clone)]
#[must_use]
pub struct PostgresOutboxStoreBuilder {
    pub(super) pool: PgPool,
    pub(super) settings: OutboxSettings,
    pub(super) channel_set: bool,
    pub(super) delivery_timeout: Option<Duration>,
}

impl PostgresOutboxStoreBuilder {
    /// Schema of the tables (default `outbox`).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.settings.schema = schema.into();
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
    /// The `NOTIFY` channel raised by appends (default `<schema>_<table>`); `None` disables.
    pub fn notify_channel(mut self, channel: Option<&str>) -> Self {
        self.settings.notify_channel = channel.map(str::to_owned);
        self.channel_set = true;
        self
    }
    /// The wake-up gate (default on): appends `NOTIFY` only while a relay of this table is
    /// idle and waiting for one, instead of in every transaction. See
    /// [`OutboxSettings::wake_gate`].
    pub fn wake_gate(mut self, on: bool) -> Self {
        self.settings.wake_gate = on;
        self
    }
    /// How long an idle relay waits for the appends in flight when it arms the wake-up gate
    /// (default 200 ms; 1 ms..=60 s).
    pub fn wake_gate_wait(mut self, d: Duration) -> Self {
        self.settings.wake_gate_wait = d;
        self
    }
    /// Archive rows into `<table>_archive` on cleanup (default off).
    pub fn archive(mut self, archive: bool) -> Self {
        self.settings.archive = archive;
        self
    }
    /// Envelope limits checked on append. `build()` refuses limits whose
    /// `max_aggregate_name_bytes` is above [`outbox_core::MAX_AGGREGATE_NAME_BYTES`] (the
    /// aggregate's state row is keyed by its type and id, and a B-tree entry is limited to
    /// about 2,700 bytes); raising `max_name_len` leaves the aggregate names at that bound.
    pub fn limits(mut self, limits: EnvelopeLimits) -> Self {
        self.settings.limits = limits;
        self
    }
    /// Longest idle time of a locked claim transaction (default 5 min).
    pub fn locked_max_hold(mut self, d: Duration) -> Self {
        self.settings.locked_max_hold = d;
        self
    }
    /// Completions wait for the WAL flush at commit (default `false`: they commit
    /// asynchronously, which is safe under at-least-once delivery; see the crate docs).
    pub fn synchronous_completion(mut self, on: bool) -> Self {
        self.settings.synchronous_completion = on;
        self
    }
    /// How long a head that skips a version is held before it is parked as a version gap
    /// (default [`crate::DEFAULT_GAP_TIMEOUT`], 5 minutes).
    pub fn gap_timeout(mut self, d: Duration) -> Self {
        self.settings.gap_timeout = d;
        self
    }
    /// Accept the lowest pending version of an aggregate the store has no state for as its
    /// first (default `false`: such an aggregate's first event must be version 1, and a later
    /// one is held as a version gap). Turn it on when adopting the outbox for aggregates that
    /// already have a history, or after upgrading from a version before migration 3 whose
    /// cleanup removed (without archiving) every row of quiet aggregates. The price: for an
    /// aggregate without state, a lower version that commits after a higher one is parked as
    /// out of order instead of going out first. An aggregate has state once one of its events
    /// was published or discarded; a claim that ends without a publication (a release, a
    /// deferral during a broker outage, a retry, a relay's crash) leaves it without state, so
    /// its first version is accepted again by the next claim (migration 6). Once that version
    /// may have reached the broker (a failure that left its delivery uncertain, or a lease
    /// that ended without an outcome or a release), it stays the first: a lower version that
    /// commits later is parked as out of order. A locked claim whose relay crashed after the
    /// broker stored the record leaves no trace of it (see `docs/claims.md`).
    pub fn accept_first_version(mut self, on: bool) -> Self {
        self.settings.accept_first_version = on;
        self
    }
    /// The publisher's delivery timeout: `build()` then rejects a lease (or, in locked mode, a
    /// `locked_max_hold`) that does not outlive it, since such a claim could end while the
    /// broker still holds a record and let another relay send the aggregate's next version.
    /// (`outbox_core::Relay::new` checks both against the publisher too, and always.)
    pub fn publisher_delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = Some(d);
        self
    }
    /// The most published events `publish_latency` reads for its percentiles (default
    /// [`crate::DEFAULT_LATENCY_SAMPLE`]; at least 1). See [`OutboxSettings::latency_sample`].
    ///
    /// [`OutboxSettings::latency_sample`]: crate::OutboxSettings::latency_sample
    pub fn latency_sample(mut self, n: usize) -> Self {
        self.settings.latency_sample = n;
        self
    }
    /// The backpressure hook, see [`AppendGuard`].
    pub fn append_guard(mut self, guard: Arc<dyn AppendGuard>) -> Self {
        self.settings.append_guard = Some(guard);
        self
    }

    /// Validates names and durations. A hostile or malformed identifier is a `Configuration`
    /// error; it never reaches SQL.
    pub fn build(mut self) -> Result<PostgresOutboxStore, StoreError> {
        let s = &mut self.settings;
        validate_identifier("schema", &s.schema, MAX_IDENTIFIER_LEN)?;
        validate_identifier("table", &s.table, MAX_TABLE_NAME_LEN)?;
        if !self.channel_set {
            let ch = format!("{}_{}", s.schema, s.table);
            s.notify_channel = (ch.len() <= MAX_IDENTIFIER_LEN).then_some(ch);
        }
        if let Some(ch) = &s.notify_channel {
            validate_identifier("notify channel", ch, MAX_IDENTIFIER_LEN)?;
        }
        // The aggregate's state is keyed by its type and id: longer names could not be indexed.
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
            ClaimMode::LockedTransaction if s.locked_max_hold < Duration::from_millis(10) => {
                return Err(config("locked_max_hold must be at least 10 ms"));
            }
            ClaimMode::Lease { .. } | ClaimMode::LockedTransaction => {}
            other => return Err(config(format!("unsupported claim mode {other:?}"))),
        }
        if s.wake_gate_wait < Duration::from_millis(1) || s.wake_gate_wait > Duration::from_secs(60)
        {
            return Err(config(format!(
                "wake_gate_wait of {:?} is outside 1 ms..=60 s",
                s.wake_gate_wait
            )));
        }
        if s.gap_timeout < Duration::from_millis(1) || s.gap_timeout > Duration::from_secs(86_400) {
            return Err(config(format!(
                "gap_timeout of {:?} is outside 1 ms..=24 h",
                s.gap_timeout
            )));
        }
        if s.latency_sample == 0 {
            return Err(config("latency_sample must be at least 1"));
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
        let sql = OutboxSql::new(&s.schema, &s.table, s.accept_first_version);
        #[cfg(feature = "sql-mutation")]
        let sql = crate::sql_mutation::from_env(sql, &s.schema, &s.table, s.accept_first_version)?;
        let seed = seed(&s.schema, &s.table);
        Ok(PostgresOutboxStore {
            inner: Arc::new(Inner {
                pool: self.pool,
                settings: self.settings,
                sql,
                seed,
                locked: Mutex::new(HashMap::new()),
                leased: Mutex::new(HashMap::new()),
                gate: super::wake_gate::WakeGate::default(),
                gate_armed: std::sync::atomic::AtomicBool::new(false),
                listening: std::sync::atomic::AtomicBool::new(false),
                notifies: std::sync::atomic::AtomicU64::new(0),
            }),
        })
    }
}
