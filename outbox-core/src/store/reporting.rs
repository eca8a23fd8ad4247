//! The read-only reporting view: what the `outbox` command (`status`, `replay`, `reconcile`,
//! `cleanup --dry-run`) reads, in types that name no backend.
//!
//! Nothing here writes or runs on the hot path. Times are UTC on the store's clock (the
//! database's for SQL stores); durations are windows ending at the store's "now".

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::delivery::{AckMetadata, OutboxStats};
use crate::envelope::{Envelope, EventId};
use crate::error::StoreError;

/// A point in time as the reports carry it.
pub type UtcTime = DateTime<Utc>;

/// The reporting role: read-only views of the outbox for operators and their tools.
///
/// Every method MUST be read-only and SHOULD be served by the store's indexes (they run on
/// live systems). The [reporting conformance checks] in `outbox-testkit` pin each clause
/// with values.
///
/// [reporting conformance checks]: https://docs.rs/outbox-testkit/latest/outbox_testkit/conformance/reporting/
#[async_trait]
pub trait ReportingStore: Send + Sync {
    /// The backlog and its ages: the same snapshot as
    /// [`MaintenanceStore::stats`](crate::MaintenanceStore::stats), offered here so that a
    /// reader needs no write role.
    async fn backlog(&self) -> Result<OutboxStats, StoreError>;

    /// Created-to-acknowledged latency of the events published within `window` (publication
    /// time in `[now - window, now]`), with continuous percentiles (linear interpolation
    /// between closest ranks, as SQL's `percentile_cont`), and the number of events created
    /// within `window` (any status). An empty window MUST give `count == 0` and no
    /// percentiles. A store MAY estimate the figures of a busy window over a sample, and
    /// MUST then say so in [`LatencySummary::sample`] (`None` only for exact figures).
    async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError>;

    /// How many events entered and left the backlog within `window`: the counts of
    /// [`publish_latency`](Self::publish_latency) without its percentiles, for a reader that
    /// needs only those (`outbox status` reconstructs the backlog's trend from one per trend
    /// point). `created` MUST be what `publish_latency` counts; `finished` MUST count the
    /// events published within `window` and MAY count the discarded ones too (they left the
    /// backlog as well). The default reads `publish_latency`; a store whose percentiles cost
    /// more than its counts SHOULD override it.
    async fn flow(&self, window: Duration) -> Result<WindowFlow, StoreError> {
        let l = self.publish_latency(window).await?;
        Ok(WindowFlow {
            created: l.created,
            finished: l.count,
        })
    }

    /// The flows of several windows ending now, in the order of `windows`: each MUST be
    /// what [`flow`](Self::flow) gives for that window. What `outbox status` reads for its
    /// trend points (up to 60 of them). The default calls `flow` once per window; a store
    /// SHOULD override it with one read of the widest window (the narrower ones are inside
    /// it), all windows then ending at the same "now".
    async fn flows(&self, windows: &[Duration]) -> Result<Vec<WindowFlow>, StoreError> {
        let mut out = Vec::with_capacity(windows.len());
        for w in windows {
            out.push(self.flow(*w).await?);
        }
        Ok(out)
    }

    /// Published and discarded rows that a
    /// [`MaintenanceStore::cleanup`](crate::MaintenanceStore::cleanup) with `retention` would
    /// remove now (finished more than `retention` ago).
    async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError>;

    /// How many retained published events match `filter`.
    async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError>;

    /// Up to `limit` retained published events matching `filter`, after `after` (from the
    /// first when `None`), in publication order: an aggregate's versions MUST come in the
    /// order the broker got them, also where a lower version was appended after a higher one.
    /// Paging by the last row's [`PublishedRow::position`] MUST return each event once.
    /// Pending, parked and discarded events MUST NOT be returned.
    async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError>;

    /// Reconciliation counts per interval and event type for events created from `since` to
    /// now. Intervals are whole multiples of `interval` counted from `since` (SQL's
    /// `date_bin`), listed in (start, event type) order, only where events exist. `overdue`
    /// counts pending events created more than `grace` ago. MUST fail with `Configuration`
    /// for a zero `interval`.
    async fn interval_counts(
        &self,
        since: UtcTime,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError>;

    /// The events of `event_type` created in `[start, end)` and published to one of `topics`
    /// (any topic when empty) more than `grace` ago: what every consumer of those topics
    /// should have applied. A re-issued copy names its original
    /// ([`crate::wire::ORIGINAL_EVENT_ID`]). Order unspecified.
    async fn published_ids(
        &self,
        event_type: &str,
        start: UtcTime,
        end: UtcTime,
        topics: &[String],
        grace: Duration,
    ) -> Result<Vec<PublishedId>, StoreError>;
}

/// Created-to-acknowledged latency of the events published in a window.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct LatencySummary {
    /// Events published in the window.
    pub count: u64,
    /// Median, seconds.
    pub p50: Option<f64>,
    /// 90th percentile, seconds.
    pub p90: Option<f64>,
    /// 99th percentile, seconds.
    pub p99: Option<f64>,
    /// Largest, seconds.
    pub max: Option<f64>,
    /// Events created in the window (any status): with `count`, the backlog's flow.
    pub created: u64,
    /// `None` when the figures above are exact. `Some(n)` when the store bounded the read on
    /// a busy window: `p50`..`max` are then an **estimate** over a sample of `n` published
    /// events of the window (which ones is the store's choice; PostgreSQL takes the latest
    /// publications), and `count` may be estimated too (PostgreSQL scales its exact count of
    /// the window's finished events by the sample's share of published ones). `created` is
    /// not part of the sample (see `created_estimated`). A reader shows such figures as
    /// estimates with the sample size, as `outbox status` does.
    pub sample: Option<u64>,
    /// `false` when `created` is an exact count. `true` when the store estimated it on a busy
    /// window (PostgreSQL above 10,000 events: from the range of ids issued since the
    /// window's first events); a reader shows it as an estimate, as `outbox status` does.
    pub created_estimated: bool,
}

/// Events that entered and left the backlog within a window ([`ReportingStore::flow`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WindowFlow {
    /// Events created within the window (any status).
    pub created: u64,
    /// Events published within the window (with a store's discarded ones, if it counts them).
    pub finished: u64,
}

impl WindowFlow {
    /// A flow of `created` and `finished` events.
    pub fn new(created: u64, finished: u64) -> Self {
        Self { created, finished }
    }
}

impl LatencySummary {
    /// The summary of `latencies` (seconds, any order) with continuous percentiles, for
    /// stores that compute them in process.
    pub fn from_latencies(mut latencies: Vec<f64>, created: u64) -> Self {
        latencies.sort_by(f64::total_cmp);
        let cont = |p: f64| -> Option<f64> {
            let n = latencies.len();
            if n == 0 {
                return None;
            }
            let pos = p * (n - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            let frac = pos - lo as f64;
            Some(latencies[lo] + (latencies[hi] - latencies[lo]) * frac)
        };
        Self {
            count: latencies.len() as u64,
            p50: cont(0.5),
            p90: cont(0.9),
            p99: cont(0.99),
            max: latencies.last().copied(),
            created,
            sample: None,
            created_estimated: false,
        }
    }
}

/// Which published events to select (every set field must match).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PublishedFilter {
    /// Aggregate type.
    pub aggregate_type: Option<String>,
    /// Aggregate id.
    pub aggregate_id: Option<String>,
    /// Event type.
    pub event_type: Option<String>,
    /// Created at or after.
    pub since: Option<UtcTime>,
    /// Created before.
    pub until: Option<UtcTime>,
}

impl PublishedFilter {
    /// Whether `e` passes the filter's envelope fields.
    pub fn matches(&self, e: &Envelope) -> bool {
        self.aggregate_type
            .as_ref()
            .is_none_or(|t| *t == e.aggregate_type)
            && self
                .aggregate_id
                .as_ref()
                .is_none_or(|a| *a == e.aggregate_id)
            && self.event_type.as_ref().is_none_or(|t| *t == e.event_type)
            && self.since.is_none_or(|s| e.created_at >= s)
            && self.until.is_none_or(|u| e.created_at < u)
    }
}

/// Where a published event stands in publication order: the keyset for paging through
/// [`ReportingStore::published_events`]. Ordered by publication time, then by `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub struct PublishedPosition {
    /// When the event was marked published.
    pub published_at: UtcTime,
    /// The store's own sequence of the row (a row id), breaking ties of equal times.
    pub seq: i64,
}

impl PublishedPosition {
    /// A position.
    pub fn new(published_at: UtcTime, seq: i64) -> Self {
        Self { published_at, seq }
    }
}

/// A published event and where the transport stored it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct PublishedRow {
    /// Its place in publication order.
    pub position: PublishedPosition,
    /// The event.
    pub envelope: Envelope,
    /// The acknowledgement recorded on publish.
    pub ack: AckMetadata,
}

impl PublishedRow {
    /// A row.
    pub fn new(position: PublishedPosition, envelope: Envelope, ack: AckMetadata) -> Self {
        Self {
            position,
            envelope,
            ack,
        }
    }
}

/// Counts of one interval and event type.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct IntervalCount {
    /// Start of the interval.
    pub start: UtcTime,
    /// Event type.
    pub event_type: String,
    /// Events created in the interval (still retained).
    pub events: u64,
    /// Of those, published with the transport's acknowledgement recorded.
    pub published: u64,
    /// Of those, not yet published (pending) and older than the grace.
    pub overdue: u64,
    /// Of those, parked.
    pub parked: u64,
    /// Of those, discarded by an operator.
    pub discarded: u64,
}

impl IntervalCount {
    /// An interval with no events (for an event type expected there).
    pub fn zero(start: UtcTime, event_type: impl Into<String>) -> Self {
        Self {
            start,
            event_type: event_type.into(),
            events: 0,
            published: 0,
            overdue: 0,
            parked: 0,
            discarded: 0,
        }
    }
}

/// A published event's id, and its original's for a re-issued copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub struct PublishedId {
    /// The event id.
    pub event_id: EventId,
    /// The original's id when the event is a re-issued copy.
    pub original: Option<EventId>,
}

impl PublishedId {
    /// An entry.
    pub fn new(event_id: EventId, original: Option<EventId>) -> Self {
        Self { event_id, original }
    }

    /// The id consumers deduplicate by: the original's, else the event's own.
    pub fn dedup_id(&self) -> EventId {
        self.original.unwrap_or(self.event_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Continuous percentiles as SQL's `percentile_cont`: 10, 20, .., 100 give a median of
    /// 55, a 90th percentile of 91 and a 99th of 99.1.
    #[test]
    fn continuous_percentiles() {
        let s =
            LatencySummary::from_latencies((1..=10).rev().map(|k| 10.0 * k as f64).collect(), 3);
        assert_eq!(s.count, 10);
        assert_eq!(s.created, 3);
        let close = |g: Option<f64>, w: f64| (g.unwrap() - w).abs() < 1e-9;
        assert!(close(s.p50, 55.0), "{s:?}");
        assert!(close(s.p90, 91.0), "{s:?}");
        assert!(close(s.p99, 99.1), "{s:?}");
        assert_eq!(s.max, Some(100.0));
        let one = LatencySummary::from_latencies(vec![2.5], 0);
        assert_eq!(
            (one.p50, one.p99, one.max),
            (Some(2.5), Some(2.5), Some(2.5))
        );
        let none = LatencySummary::from_latencies(Vec::new(), 4);
        assert_eq!(
            none,
            LatencySummary {
                created: 4,
                ..Default::default()
            }
        );
    }
}
