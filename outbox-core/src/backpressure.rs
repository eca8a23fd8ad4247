//! Backpressure: above configured backlog thresholds, appends of non-critical events fail fast
//! with a typed error ([`StoreErrorKind::Backpressure`], transient) while critical events still
//! go in.
//!
//! Works with every store: [`BackpressureStore`] wraps any [`OutboxStore`] and checks its
//! appends against a shared [`Backpressure`] gate. The gate decides from a backlog snapshot fed
//! periodically ([`Backpressure::refresh`] reads [`MaintenanceStore::stats`];
//! [`Backpressure::observe`] takes a snapshot from elsewhere), never from a query inside the
//! business transaction, so an append costs no extra round trip. Stores with their own append
//! path (e.g. `PostgresOutboxStore::append_many`) can ask the same gate
//! ([`Backpressure::check`]; `outbox-postgres` accepts it as its `AppendGuard`).
//!
//! **Which events are critical.** An event is critical when its event type is listed in
//! [`BackpressurePolicy::critical_event_types`] (an entry ending in `*` matches a prefix:
//! `payment.*`), or when it carries the header [`CRITICAL_HEADER`] with the value `true`
//! (set per event by the application: `.header("outbox_critical", "true")`; it is published
//! like any user header). Everything else is non-critical. An append is all or nothing: a batch
//! with one non-critical event is refused whole while backpressure is on.
//!
//! **When it is on.** When any configured threshold is reached: the backlog (unpublished
//! events) at or above `max_backlog`, the oldest claimable event at least `max_age` old
//! ([`OutboxStats::oldest_claimable_age`]: events blocked behind a parked event, or held behind
//! a version gap, do not count, so one parked event does not refuse the appends of every
//! aggregate; ages are counted from the insertion into the store, not from the producer's
//! `created_at`), or the backlog reaching `capacity` within `min_forecast` at its current rate
//! of growth. A
//! snapshot older than `stale_after` turns it off (fail open: backpressure protects the
//! outbox, it is not a correctness rule, and a relay that stopped refreshing must not stop the
//! business).
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use outbox_core::backpressure::{Backpressure, BackpressurePolicy, BacklogSnapshot};
//! use outbox_core::{Envelope, StoreErrorKind};
//!
//! let policy = BackpressurePolicy::default()
//!     .max_backlog(10_000)
//!     .critical_event_types(["payment.*"]);
//! let gate = Arc::new(Backpressure::new(policy));
//! gate.observe(BacklogSnapshot::new(25_000, Some(Duration::from_secs(40)), None), chrono::Utc::now());
//!
//! let ad = Envelope::builder("order", "o-1", 2, "order.viewed").build()?;
//! let pay = Envelope::builder("order", "o-1", 3, "payment.captured").build()?;
//! assert_eq!(gate.check(&[ad]).unwrap_err().kind, StoreErrorKind::Backpressure);
//! assert!(gate.check(&[pay]).is_ok()); // critical events still go in
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`OutboxStore`]: crate::OutboxStore

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::delivery::OutboxStats;
use crate::envelope::Envelope;
use crate::error::{StoreError, StoreErrorKind};
use crate::store::{AppendStore, MaintenanceStore};

/// Header that marks one event critical (value `true`).
pub const CRITICAL_HEADER: &str = "outbox_critical";

/// Thresholds and the definition of critical events. All thresholds are off by default.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BackpressurePolicy {
    /// On at or above this many unpublished events.
    pub max_backlog: Option<u64>,
    /// On while the oldest claimable event ([`OutboxStats::oldest_claimable_age`]) is at least
    /// this old.
    pub max_age: Option<Duration>,
    /// On while the backlog reaches `capacity` within this at its current growth.
    pub min_forecast: Option<Duration>,
    /// The backlog considered full (for the forecast). Default 1,000,000.
    pub capacity: u64,
    /// Event types that always go in (`*` suffix: prefix match).
    pub critical_event_types: Vec<String>,
    /// A snapshot older than this is ignored (backpressure off). Default 2 minutes.
    pub stale_after: Duration,
}

impl Default for BackpressurePolicy {
    fn default() -> Self {
        Self {
            max_backlog: None,
            max_age: None,
            min_forecast: None,
            capacity: 1_000_000,
            critical_event_types: Vec::new(),
            stale_after: Duration::from_secs(120),
        }
    }
}

impl BackpressurePolicy {
    /// Sets `max_backlog`.
    pub fn max_backlog(mut self, n: u64) -> Self {
        self.max_backlog = Some(n);
        self
    }
    /// Sets `max_age`.
    pub fn max_age(mut self, d: Duration) -> Self {
        self.max_age = Some(d);
        self
    }
    /// Sets `min_forecast` and the `capacity` it refers to.
    pub fn min_forecast(mut self, d: Duration, capacity: u64) -> Self {
        self.min_forecast = Some(d);
        self.capacity = capacity;
        self
    }
    /// Sets the capacity used by forecasts.
    pub fn capacity(mut self, capacity: u64) -> Self {
        self.capacity = capacity;
        self
    }
    /// Sets the critical event types.
    pub fn critical_event_types<I, T>(mut self, types: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        self.critical_event_types = types.into_iter().map(Into::into).collect();
        self
    }
    /// Sets `stale_after`.
    pub fn stale_after(mut self, d: Duration) -> Self {
        self.stale_after = d;
        self
    }

    /// Whether any threshold is configured.
    pub fn is_enabled(&self) -> bool {
        self.max_backlog.is_some() || self.max_age.is_some() || self.min_forecast.is_some()
    }

    /// Whether `e` is critical (see the module docs).
    pub fn is_critical(&self, e: &Envelope) -> bool {
        if e.headers
            .get(CRITICAL_HEADER)
            .is_some_and(|v| v.eq_ignore_ascii_case("true"))
        {
            return true;
        }
        self.critical_event_types
            .iter()
            .any(|t| match t.strip_suffix('*') {
                Some(prefix) => e.event_type.starts_with(prefix),
                None => e.event_type == *t,
            })
    }

    /// The threshold `snapshot` reaches, if any, as a sentence.
    pub fn evaluate(&self, snapshot: &BacklogSnapshot) -> Option<String> {
        if let Some(max) = self.max_backlog {
            if snapshot.backlog >= max {
                return Some(format!(
                    "backlog of {} unpublished events is at or above max_backlog {max}",
                    snapshot.backlog
                ));
            }
        }
        if let (Some(max), Some(age)) = (self.max_age, snapshot.oldest_age) {
            if age >= max {
                return Some(format!(
                    "oldest claimable event is {}s old, at or above max_age {}s",
                    age.as_secs(),
                    max.as_secs()
                ));
            }
        }
        if let (Some(min), Some(f)) = (
            self.min_forecast,
            forecast(self.capacity, snapshot.backlog, snapshot.rate_per_sec),
        ) {
            if f <= min {
                return Some(format!(
                    "backlog reaches its capacity of {} events in {}s at the current rate, \
                     within min_forecast {}s",
                    self.capacity,
                    f.as_secs(),
                    min.as_secs()
                ));
            }
        }
        None
    }
}

/// Time until `backlog` reaches `capacity` growing at `rate_per_sec` events per second: zero
/// when it is already there, `None` when it does not grow (or the rate is unknown).
pub fn forecast(capacity: u64, backlog: u64, rate_per_sec: Option<f64>) -> Option<Duration> {
    if backlog >= capacity {
        return Some(Duration::ZERO);
    }
    let rate = rate_per_sec?;
    if !rate.is_finite() || rate <= 0.0 {
        return None;
    }
    let secs = (capacity - backlog) as f64 / rate;
    Some(Duration::from_secs_f64(secs.min(1e12)))
}

/// What the gate decides from.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BacklogSnapshot {
    /// Unpublished events.
    pub backlog: u64,
    /// Age of the oldest claimable event ([`OutboxStats::oldest_claimable_age`]).
    pub oldest_age: Option<Duration>,
    /// Growth of the backlog, events per second (negative: draining); `None`: unknown.
    pub rate_per_sec: Option<f64>,
}

impl BacklogSnapshot {
    /// A snapshot.
    pub fn new(backlog: u64, oldest_age: Option<Duration>, rate_per_sec: Option<f64>) -> Self {
        Self {
            backlog,
            oldest_age,
            rate_per_sec,
        }
    }

    /// The snapshot of a store's stats: the unpublished events and the oldest claimable age.
    pub fn from_stats(stats: &OutboxStats, rate_per_sec: Option<f64>) -> Self {
        Self::new(stats.unpublished, stats.oldest_claimable_age, rate_per_sec)
    }
}

/// The gate's current state, for status output and metrics.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct BackpressureState {
    /// Non-critical appends are refused.
    pub active: bool,
    /// Which threshold, when active.
    pub reason: Option<String>,
    /// The snapshot decided from.
    pub snapshot: Option<BacklogSnapshot>,
    /// When it was observed.
    pub observed_at: Option<DateTime<Utc>>,
    /// Time until the capacity is reached at the current rate.
    pub forecast: Option<Duration>,
}

#[derive(Debug, Default)]
struct Observed {
    snapshot: Option<BacklogSnapshot>,
    at: Option<DateTime<Utc>>,
    reason: Option<String>,
}

/// The shared gate. Cheap to share behind an `Arc`; see the module docs.
#[derive(Debug)]
pub struct Backpressure {
    policy: BackpressurePolicy,
    observed: RwLock<Observed>,
}

impl Backpressure {
    /// A gate with `policy`, off until the first snapshot.
    pub fn new(policy: BackpressurePolicy) -> Self {
        Self {
            policy,
            observed: RwLock::new(Observed::default()),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &BackpressurePolicy {
        &self.policy
    }

    /// Feeds a snapshot taken at `at`. Records the gauges `outbox_backpressure_active` and
    /// `outbox_backlog_forecast_seconds`.
    pub fn observe(&self, snapshot: BacklogSnapshot, at: DateTime<Utc>) {
        let reason = self.policy.evaluate(&snapshot);
        let f = forecast(
            self.policy.capacity,
            snapshot.backlog,
            snapshot.rate_per_sec,
        );
        metrics::gauge!("outbox_backpressure_active").set(if reason.is_some() { 1.0 } else { 0.0 });
        metrics::gauge!("outbox_backlog_forecast_seconds").set(f.map_or(-1.0, |d| d.as_secs_f64()));
        let mut o = self
            .observed
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if reason.is_some() != o.reason.is_some() {
            match &reason {
                Some(r) => {
                    tracing::warn!(reason = %r, "backpressure on: appends of non-critical events are refused")
                }
                None => tracing::info!("backpressure off: every append is accepted again"),
            }
        }
        *o = Observed {
            snapshot: Some(snapshot),
            at: Some(at),
            reason,
        };
    }

    /// Reads `store`'s stats and feeds them, with the growth rate measured against the previous
    /// snapshot.
    pub async fn refresh<S: MaintenanceStore + ?Sized>(
        &self,
        store: &S,
        now: DateTime<Utc>,
    ) -> Result<BackpressureState, StoreError> {
        let stats = store.stats().await?;
        let rate = {
            let o = self.observed.read().unwrap_or_else(PoisonError::into_inner);
            match (&o.snapshot, o.at) {
                (Some(prev), Some(at)) => {
                    let dt = (now - at).to_std().unwrap_or_default().as_secs_f64();
                    (dt > 0.0).then(|| (stats.unpublished as f64 - prev.backlog as f64) / dt)
                }
                _ => None,
            }
        };
        self.observe(BacklogSnapshot::from_stats(&stats, rate), now);
        Ok(self.state(now))
    }

    /// The state at `now` (a stale snapshot reads as off).
    pub fn state(&self, now: DateTime<Utc>) -> BackpressureState {
        let o = self.observed.read().unwrap_or_else(PoisonError::into_inner);
        let fresh = o
            .at
            .is_some_and(|at| (now - at).to_std().unwrap_or_default() <= self.policy.stale_after);
        BackpressureState {
            active: fresh && o.reason.is_some(),
            reason: if fresh { o.reason.clone() } else { None },
            forecast: o
                .snapshot
                .as_ref()
                .and_then(|s| forecast(self.policy.capacity, s.backlog, s.rate_per_sec)),
            snapshot: o.snapshot.clone(),
            observed_at: o.at,
        }
    }

    /// `Ok` when `events` may be appended now; a `Backpressure` error (transient) naming the
    /// threshold when one of them is non-critical and backpressure is on.
    pub fn check(&self, events: &[Envelope]) -> Result<(), StoreError> {
        let state = self.state(Utc::now());
        let Some(reason) = state.reason.filter(|_| state.active) else {
            return Ok(());
        };
        let non_critical = events
            .iter()
            .filter(|e| !self.policy.is_critical(e))
            .count();
        if non_critical == 0 {
            return Ok(());
        }
        metrics::counter!("outbox_backpressure_refused_total").increment(non_critical as u64);
        Err(StoreError::new(
            StoreErrorKind::Backpressure,
            format!(
                "append refused by backpressure ({non_critical} of {} events non-critical): \
                 {reason}. Retry later, or mark events critical (event type in \
                 critical_event_types, or header {CRITICAL_HEADER}=true)",
                events.len()
            ),
        ))
    }
}

/// Any [`OutboxStore`] whose appends go through a [`Backpressure`] gate; everything else is
/// passed through unchanged.
///
/// [`OutboxStore`]: crate::OutboxStore
#[derive(Clone, Debug)]
pub struct BackpressureStore<S> {
    inner: S,
    gate: Arc<Backpressure>,
}

impl<S> BackpressureStore<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, gate: Arc<Backpressure>) -> Self {
        Self { inner, gate }
    }
    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
    /// The gate.
    pub fn gate(&self) -> &Arc<Backpressure> {
        &self.gate
    }
}

#[async_trait]
impl<S: AppendStore> AppendStore for BackpressureStore<S> {
    type Tx = S::Tx;

    async fn append(&self, tx: &mut Self::Tx, events: &[Envelope]) -> Result<(), StoreError> {
        // The inner store validates (with its own limits) and writes; while backpressure is on,
        // a batch with a non-critical event is refused before it gets there.
        self.gate.check(events)?;
        self.inner.append(tx, events).await
    }
}

crate::forward_store_roles!(BackpressureStore<S>.inner => relay, operator, maintenance, reporting);

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t: &str) -> Envelope {
        Envelope::builder("order", "o", 1, t).build().unwrap()
    }

    #[test]
    fn criticality_table() {
        let p = BackpressurePolicy::default().critical_event_types(["payment.*", "order.paid"]);
        let table = [
            ("payment.captured", true),
            ("payment.", true),
            ("order.paid", true),
            ("order.paid.v2", false),
            ("order.viewed", false),
        ];
        for (t, want) in table {
            assert_eq!(p.is_critical(&ev(t)), want, "{t}");
        }
        let marked = Envelope::builder("order", "o", 1, "order.viewed")
            .header(CRITICAL_HEADER, "true")
            .build()
            .unwrap();
        assert!(p.is_critical(&marked));
    }

    #[test]
    fn thresholds_table() {
        let secs = Duration::from_secs;
        let p = BackpressurePolicy::default()
            .max_backlog(100)
            .max_age(secs(60))
            .min_forecast(secs(600), 1000);
        let table = [
            (BacklogSnapshot::new(10, Some(secs(5)), None), false),
            (BacklogSnapshot::new(100, None, None), true),
            (BacklogSnapshot::new(10, Some(secs(60)), None), true),
            // 990 to go at 2/s: 495 s, within 600 s.
            (BacklogSnapshot::new(10, None, Some(2.0)), true),
            (BacklogSnapshot::new(10, None, Some(1.0)), false),
            (BacklogSnapshot::new(10, None, Some(-5.0)), false),
        ];
        for (s, on) in table {
            assert_eq!(p.evaluate(&s).is_some(), on, "{s:?}");
        }
        assert_eq!(forecast(100, 150, None), Some(Duration::ZERO));
        assert_eq!(forecast(100, 50, Some(5.0)), Some(secs(10)));
    }

    #[test]
    fn stale_snapshots_fail_open_and_critical_events_pass() {
        let gate = Backpressure::new(BackpressurePolicy::default().max_backlog(1));
        assert!(gate.check(&[ev("x")]).is_ok(), "off before any snapshot");
        let long_ago = Utc::now() - chrono::Duration::minutes(10);
        gate.observe(BacklogSnapshot::new(5, None, None), long_ago);
        assert!(gate.check(&[ev("x")]).is_ok(), "stale snapshot");
        gate.observe(BacklogSnapshot::new(5, None, None), Utc::now());
        let err = gate.check(&[ev("x")]).unwrap_err();
        assert_eq!(err.kind, StoreErrorKind::Backpressure);
        assert!(err.is_transient_kind());
        assert!(err.message.contains("max_backlog"), "{}", err.message);
        let critical = Envelope::builder("o", "o", 1, "x")
            .header(CRITICAL_HEADER, "TRUE")
            .build()
            .unwrap();
        assert!(gate.check(&[critical]).is_ok());
    }

    #[test]
    fn enabled_only_with_a_threshold() {
        let secs = Duration::from_secs;
        assert!(!BackpressurePolicy::default().is_enabled());
        assert!(!BackpressurePolicy::default()
            .critical_event_types(["x"])
            .capacity(5)
            .stale_after(secs(1))
            .is_enabled());
        assert!(BackpressurePolicy::default().max_backlog(1).is_enabled());
        assert!(BackpressurePolicy::default().max_age(secs(1)).is_enabled());
        assert!(BackpressurePolicy::default()
            .min_forecast(secs(1), 10)
            .is_enabled());
    }

    #[test]
    fn builder_sets_each_field() {
        let secs = Duration::from_secs;
        let p = BackpressurePolicy::default()
            .max_backlog(7)
            .max_age(secs(8))
            .min_forecast(secs(9), 10)
            .stale_after(secs(11));
        assert_eq!(p.max_backlog, Some(7));
        assert_eq!(p.max_age, Some(secs(8)));
        assert_eq!((p.min_forecast, p.capacity), (Some(secs(9)), 10));
        assert_eq!(p.stale_after, secs(11));
        assert_eq!(p.clone().capacity(12).capacity, 12);
        let d = BackpressurePolicy::default();
        assert_eq!((d.capacity, d.stale_after), (1_000_000, secs(120)));
    }

    #[test]
    fn forecast_edges() {
        let secs = Duration::from_secs;
        // At capacity: zero, whatever the rate.
        assert_eq!(forecast(100, 100, None), Some(Duration::ZERO));
        assert_eq!(forecast(100, 100, Some(-1.0)), Some(Duration::ZERO));
        // Not growing, or a rate that is no number: no forecast.
        for rate in [0.0, -0.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(forecast(100, 99, Some(rate)), None, "{rate}");
        }
        assert_eq!(forecast(100, 99, None), None);
        assert_eq!(forecast(100, 40, Some(3.0)), Some(secs(20)));
        assert_eq!(forecast(100, 99, Some(0.5)), Some(secs(2)));
        // A crawl is capped instead of overflowing.
        assert_eq!(
            forecast(u64::MAX, 0, Some(1e-9)),
            Some(secs(1_000_000_000_000))
        );
    }

    #[test]
    fn thresholds_are_inclusive() {
        let secs = Duration::from_secs;
        let p = BackpressurePolicy::default().min_forecast(secs(600), 1000);
        // 600 events to go at 1/s: exactly 600 s.
        let at = p.evaluate(&BacklogSnapshot::new(400, None, Some(1.0)));
        assert!(
            at.as_deref()
                .is_some_and(|r| r.contains("min_forecast 600s")),
            "{at:?}"
        );
        assert_eq!(
            p.evaluate(&BacklogSnapshot::new(399, None, Some(1.0))),
            None
        );
        let p = BackpressurePolicy::default()
            .max_backlog(100)
            .max_age(secs(60));
        assert_eq!(
            p.evaluate(&BacklogSnapshot::new(99, Some(secs(59)), None)),
            None
        );
        let age = p.evaluate(&BacklogSnapshot::new(99, Some(secs(60)), None));
        assert!(
            age.as_deref().is_some_and(|r| r.contains("60s old")),
            "{age:?}"
        );
        let backlog = p.evaluate(&BacklogSnapshot::new(100, None, None));
        assert!(
            backlog
                .as_deref()
                .is_some_and(|r| r.contains("backlog of 100")),
            "{backlog:?}"
        );
    }

    #[test]
    fn state_is_fresh_up_to_stale_after_and_reports_the_snapshot() {
        let gate = Backpressure::new(
            BackpressurePolicy::default()
                .max_backlog(10)
                .capacity(100)
                .stale_after(Duration::from_secs(30)),
        );
        let at = Utc::now();
        assert_eq!(
            gate.state(at),
            BackpressureState {
                active: false,
                reason: None,
                snapshot: None,
                observed_at: None,
                forecast: None,
            }
        );
        let snapshot = BacklogSnapshot::new(20, None, Some(4.0));
        gate.observe(snapshot.clone(), at);
        let fresh = gate.state(at + chrono::Duration::seconds(30));
        assert!(fresh.active);
        assert!(fresh
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("max_backlog 10")));
        assert_eq!(fresh.snapshot, Some(snapshot.clone()));
        assert_eq!(fresh.observed_at, Some(at));
        // 80 to go at 4/s.
        assert_eq!(fresh.forecast, Some(Duration::from_secs(20)));
        let stale = gate.state(at + chrono::Duration::milliseconds(30_001));
        assert!(!stale.active);
        assert_eq!(stale.reason, None);
        assert_eq!(
            stale.snapshot,
            Some(snapshot),
            "a stale snapshot is still shown"
        );
        // Below the threshold again: off.
        gate.observe(BacklogSnapshot::new(9, None, None), at);
        assert!(!gate.state(at).active);
        assert_eq!(gate.policy().max_backlog, Some(10));
    }

    #[test]
    fn refusal_counts_the_non_critical_events_and_a_critical_batch_passes() {
        let gate = Backpressure::new(
            BackpressurePolicy::default()
                .max_backlog(1)
                .critical_event_types(["payment.*"]),
        );
        gate.observe(BacklogSnapshot::new(5, None, None), Utc::now());
        let err = gate
            .check(&[ev("payment.captured"), ev("order.viewed"), ev("order.paid")])
            .unwrap_err();
        assert!(
            err.message.contains("2 of 3 events non-critical"),
            "{}",
            err.message
        );
        assert!(gate
            .check(&[ev("payment.captured"), ev("payment.refunded")])
            .is_ok());
        assert!(gate.check(&[]).is_ok());
        // Only the value `true` marks an event critical.
        let not_marked = Envelope::builder("order", "o", 1, "order.viewed")
            .header(CRITICAL_HEADER, "false")
            .build()
            .unwrap();
        assert!(!gate.policy().is_critical(&not_marked));
        assert!(gate.check(&[not_marked]).is_err());
    }

    /// The gauges of the telemetry table: `outbox_backpressure_active` and
    /// `outbox_backlog_forecast_seconds` (-1 when the backlog does not grow).
    #[test]
    fn observe_sets_the_gauges() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};
        let gauges = |snapshot: BacklogSnapshot| {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            let gate =
                Backpressure::new(BackpressurePolicy::default().max_backlog(10).capacity(100));
            metrics::with_local_recorder(&recorder, || gate.observe(snapshot, Utc::now()));
            let mut out: Vec<(String, f64)> = snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .filter_map(|(k, _, _, v)| match v {
                    DebugValue::Gauge(g) => Some((k.key().name().to_owned(), g.into_inner())),
                    _ => None,
                })
                .collect();
            out.sort_by(|a, b| a.0.cmp(&b.0));
            out
        };
        let name = |n: &str| n.to_owned();
        assert_eq!(
            gauges(BacklogSnapshot::new(5, None, None)),
            [
                (name("outbox_backlog_forecast_seconds"), -1.0),
                (name("outbox_backpressure_active"), 0.0)
            ]
        );
        // 80 to go at 4/s: 20 s.
        assert_eq!(
            gauges(BacklogSnapshot::new(20, None, Some(4.0))),
            [
                (name("outbox_backlog_forecast_seconds"), 20.0),
                (name("outbox_backpressure_active"), 1.0)
            ]
        );
    }

    trait TransientKind {
        fn is_transient_kind(&self) -> bool;
    }
    impl TransientKind for StoreError {
        fn is_transient_kind(&self) -> bool {
            self.class == crate::ErrorClass::Transient
        }
    }
}
