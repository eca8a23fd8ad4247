//! Operator reads (the read-only reporting role): what `outbox status`, `replay`, `cleanup`
//! and `reconcile` need beyond the [`outbox_core::OutboxStore`] trait, with the signatures and
//! value types of outbox-postgres's (`PostgresOutboxStore::publish_latency` and the rest), so
//! a reporting view over either store reads the same. Kept apart from the hot path: nothing
//! here runs in a claim or a completion, and nothing here writes.
//!
//! Times are UTC on the database clock (`UTC_TIMESTAMP(6)`), as the store writes them; the
//! windows are read through the table's indexes on `finished_at` (publication or discard
//! time) and `created_at`.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, SubsecRound, Utc};
use sqlx::mysql::MySqlRow;
use sqlx::Row;
use uuid::Uuid;

pub use outbox_core::{
    IntervalCount, LatencySummary, PublishedFilter, PublishedPosition, PublishedRow,
};
use outbox_core::{StoreError, StoreErrorKind, WindowFlow};

use super::head::marks;
use super::rows::{ack_from_row, envelope_from_row, utc, ACK_COLS, ENVELOPE_COLS};
use super::tx::micros;
use super::MySqlOutboxStore;
use crate::error::db;
use crate::inbox::KEY_EXPR;

/// The percentiles of [`LatencySummary`], in thousandths.
const PERCENTILES: [i64; 3] = [500, 900, 990];

/// The latest finished events of a window [`MySqlOutboxStore::publish_latency`] reads for the
/// percentiles (outbox-postgres's default `latency_sample`): above, they are an estimate.
pub(crate) const LATENCY_SAMPLE: i64 = 5_000;

/// Events created in a window counted exactly (as outbox-postgres); above, estimated.
const CREATED_EXACT_UP_TO: u64 = 10_000;

/// The first events of a busy window whose ids place its start (as outbox-postgres).
const CREATED_FIRST_IDS: i64 = 101;

/// A value bound to a filter's placeholder.
enum Bind {
    Text(String),
    Time(NaiveDateTime),
}

impl MySqlOutboxStore {
    /// Publish latency percentiles (continuous, as PostgreSQL's `percentile_cont`) of the
    /// events published within `window`, and how many events were created in it.
    ///
    /// One statement, bounded as outbox-postgres's: the window's finished (published or
    /// discarded) events are counted through `finished_idx` alone, and only the latest
    /// [`LATENCY_SAMPLE`] of them are read (backwards along that index) for the latencies,
    /// ranked on the server (a window function; MySQL has no `percentile_cont`); only the
    /// ranks each percentile falls between come back, interpolated here in integer rank
    /// arithmetic both sides agree on. When the window holds no more than the sample, the
    /// figures are exact and [`LatencySummary::sample`] is `None`; otherwise they are those of
    /// the sample's published events (`sample` says how many) and `count` is the window's
    /// finished count times the sample's share of published ones (exact when it holds no
    /// discard).
    ///
    /// The events created in the window are counted through `created_idx` up to 10,000
    /// ([`LatencySummary::created_estimated`] `false`); above, estimated (`true`) from the ids
    /// issued since the window's start ([`created_estimate`]), as outbox-postgres does.
    pub async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError> {
        let t = &self.inner.tables.events;
        let ranks: Vec<String> = PERCENTILES
            .iter()
            .flat_map(|p| {
                [
                    format!("1 + ({p} * (r.n - 1)) DIV 1000"),
                    format!("2 + ({p} * (r.n - 1)) DIV 1000"),
                ]
            })
            .collect();
        let sql = format!(
            "WITH p AS ( \
               SELECT status = 'published' AS pub, \
                      TIMESTAMPDIFF(MICROSECOND, created_at, published_at) AS us FROM {t} \
               WHERE finished_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
               ORDER BY finished_at DESC LIMIT ?), \
             r AS (SELECT us, ROW_NUMBER() OVER (ORDER BY us) AS rn, COUNT(*) OVER () AS n \
                   FROM p WHERE pub) \
             SELECT c.created, c.finished, x.rn, x.n, x.us \
             FROM (SELECT (SELECT COUNT(*) FROM (SELECT 1 FROM {t} \
                             WHERE created_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                             LIMIT {cap}) y) AS created, \
                          (SELECT COUNT(*) FROM {t} \
                             WHERE finished_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                            AS finished) c \
             LEFT JOIN (SELECT r.rn, r.n, r.us FROM r \
                        WHERE r.rn = r.n OR r.rn IN ({})) x ON 1 = 1",
            ranks.join(", "),
            cap = CREATED_EXACT_UP_TO + 1,
        );
        let rows = sqlx::query(&sql)
            .bind(micros(window))
            .bind(LATENCY_SAMPLE)
            .bind(micros(window))
            .bind(micros(window))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        let mut s = LatencySummary::default();
        let mut at: HashMap<i64, f64> = HashMap::new();
        let (mut n, mut finished) = (0i64, 0i64);
        for r in &rows {
            s.created = r.try_get::<i64, _>("created").map_err(db)?.max(0) as u64;
            finished = r.try_get::<i64, _>("finished").map_err(db)?.max(0);
            if let (Some(rn), Some(count), Some(us)) = (
                r.try_get::<Option<i64>, _>("rn").map_err(db)?,
                r.try_get::<Option<i64>, _>("n").map_err(db)?,
                r.try_get::<Option<i64>, _>("us").map_err(db)?,
            ) {
                n = count;
                at.insert(rn, us as f64 / 1e6);
            }
        }
        if n > 0 {
            let [p50, p90, p99] = PERCENTILES.map(|p| percentile(&at, n, p));
            (s.p50, s.p90, s.p99) = (p50, p90, p99);
            s.max = at.get(&n).copied();
        }
        // The sample is the latest LATENCY_SAMPLE finished events of the window: all of them
        // when there are no more.
        let read = finished.min(LATENCY_SAMPLE);
        if finished <= LATENCY_SAMPLE {
            s.count = n as u64;
        } else {
            s.count = if n == read {
                finished as u64
            } else {
                (finished as f64 * n as f64 / read as f64).round() as u64
            };
            s.sample = Some(n as u64);
        }
        if s.created > CREATED_EXACT_UP_TO {
            // At least the entries counted, whatever the ids say.
            s.created = self.created_estimate(window).await?.max(s.created);
            s.created_estimated = true;
        }
        Ok(s)
    }

    /// The events created within `window` on a busy window (more than 10,000): the ids issued
    /// since its start, the newest id less the id the window starts at (the median of
    /// `id - rank` over its first [`CREATED_FIRST_IDS`] events by creation time, so that a few
    /// events whose ids are out of creation order do not move it), as outbox-postgres. The
    /// append takes the id in its statement (`AUTO_INCREMENT`), so ids follow insertion order;
    /// the estimate counts too many by the ids that never became rows (appends rolled back,
    /// InnoDB's `AUTO_INCREMENT` gaps) and by rows deleted since, and is off by the events
    /// whose `created_at` (the producer's clock) is on the other side of the window's start
    /// than their insertion.
    async fn created_estimate(&self, window: Duration) -> Result<u64, StoreError> {
        let t = &self.inner.tables.events;
        let rows = sqlx::query(&format!(
            "SELECT f.id, (SELECT MAX(id) FROM {t}) AS newest FROM ( \
               SELECT id FROM {t} \
               WHERE created_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
               ORDER BY created_at, id LIMIT ?) f"
        ))
        .bind(micros(window))
        .bind(CREATED_FIRST_IDS)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        let mut offsets = Vec::with_capacity(rows.len());
        let mut newest = 0i64;
        for (rank, r) in rows.iter().enumerate() {
            newest = r
                .try_get::<Option<i64>, _>("newest")
                .map_err(db)?
                .unwrap_or(0);
            offsets.push(r.try_get::<i64, _>("id").map_err(db)? - (rank as i64 + 1));
        }
        if offsets.is_empty() {
            return Ok(0);
        }
        offsets.sort_unstable();
        // The lower median (PostgreSQL's `percentile_disc(0.5)`).
        let start = offsets[(offsets.len() - 1) / 2];
        Ok((newest - start).max(0) as u64)
    }

    /// Events created and events finished (published or discarded: both left the backlog)
    /// within `window`: two counts over `created_idx` and `finished_idx` alone (`finished_at`
    /// is set by a publication or a discard only, so the index needs no status). What `outbox
    /// status` reads per trend point; the trait's default read the whole latency window
    /// (every publication's row, ranked) per point.
    pub async fn flow(&self, window: Duration) -> Result<WindowFlow, StoreError> {
        let t = &self.inner.tables.events;
        let row = sqlx::query(&format!(
            "SELECT (SELECT COUNT(*) FROM {t} \
                       WHERE created_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                      AS created, \
                    (SELECT COUNT(*) FROM {t} \
                       WHERE finished_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) \
                      AS finished"
        ))
        .bind(micros(window))
        .bind(micros(window))
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        let count = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        Ok(WindowFlow::new(count("created")?, count("finished")?))
    }

    /// [`flow`](Self::flow) for several windows ending at one "now", in one statement: both
    /// indexes are read once over the widest window, and each window's count is a sum over
    /// those entries (one `SUM` per window). `outbox status` reads one window per trend point
    /// (up to 60); one `flow` each read the newest part of both indexes that many times over.
    pub async fn flows(&self, windows: &[Duration]) -> Result<Vec<WindowFlow>, StoreError> {
        let Some(widest) = windows.iter().max() else {
            return Ok(Vec::new());
        };
        let t = &self.inner.tables.events;
        let sums = |col: &str, tag: &str| -> String {
            (0..windows.len())
                .map(|i| {
                    format!(
                        "CAST(COALESCE(SUM({col} >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND), 0) \
                         AS SIGNED) AS {tag}{i}"
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let sql = format!(
            "SELECT c.*, f.* FROM \
               (SELECT {} FROM {t} \
                  WHERE created_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) c, \
               (SELECT {} FROM {t} \
                  WHERE finished_at >= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) f",
            sums("created_at", "c"),
            sums("finished_at", "f"),
        );
        let mut q = sqlx::query(&sql);
        for _ in 0..2 {
            for w in windows {
                q = q.bind(micros(*w));
            }
            q = q.bind(micros(*widest));
        }
        let row = q.fetch_one(&self.inner.pool).await.map_err(db)?;
        let count = |name: String| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name.as_str()).map_err(db)?.max(0) as u64)
        };
        (0..windows.len())
            .map(|i| {
                Ok(WindowFlow::new(
                    count(format!("c{i}"))?,
                    count(format!("f{i}"))?,
                ))
            })
            .collect()
    }

    /// Published and discarded rows that a cleanup with `retention` would remove now.
    pub async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError> {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT COUNT(*) FROM {} \
             WHERE finished_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
               AND status IN ('published', 'discarded')",
            self.inner.tables.events
        ))
        .bind(micros(retention))
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(n.max(0) as u64)
    }

    /// How many retained published events match `filter`.
    pub async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError> {
        let (clauses, binds) = published_where(filter);
        let sql = format!(
            "SELECT COUNT(*) FROM {} WHERE {clauses}",
            self.inner.tables.events
        );
        let mut q = sqlx::query_scalar::<_, i64>(&sql);
        for b in binds {
            q = match b {
                Bind::Text(v) => q.bind(v),
                Bind::Time(v) => q.bind(v),
            };
        }
        let n = q.fetch_one(&self.inner.pool).await.map_err(db)?;
        Ok(n.max(0) as u64)
    }

    /// Up to `limit` (1..=100,000) retained published events matching `filter` after position
    /// `after` (from the first when `None`), in the order they were published: an aggregate's
    /// versions come in the order the broker got them, also where a lower version committed
    /// after a higher one and was published first (insertion order would send them the other
    /// way round). The order is by publication time (`finished_at`, which a completion sets to
    /// the publication time; an aggregate's next version is only claimed after its previous
    /// one's completion committed, so its time is later), then row id.
    pub async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError> {
        let (mut clauses, mut binds) = published_where(filter);
        if let Some(p) = after {
            let at = p.published_at.naive_utc();
            clauses.push_str(" AND (finished_at > ? OR (finished_at = ? AND id > ?))");
            binds.push(Bind::Time(at));
            binds.push(Bind::Time(at));
        }
        let sql = format!(
            "SELECT id, finished_at, {ENVELOPE_COLS}, {ACK_COLS} \
             FROM {} WHERE {clauses} ORDER BY finished_at, id LIMIT ?",
            self.inner.tables.events
        );
        let mut q = sqlx::query(&sql);
        for b in binds {
            q = match b {
                Bind::Text(v) => q.bind(v),
                Bind::Time(v) => q.bind(v),
            };
        }
        if let Some(p) = after {
            q = q.bind(p.seq);
        }
        let rows = q
            .bind(limit.clamp(1, 100_000) as i64)
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        rows.iter().map(published_row).collect()
    }

    /// Counts per interval of `interval` from `since` to now and per event type: events
    /// created, published (with the broker's offset recorded), pending past `grace`, parked,
    /// discarded. Intervals start at `since` (to the microsecond) plus whole intervals, as
    /// PostgreSQL's `date_bin`; only intervals with events are returned, in time then event
    /// type order.
    pub async fn interval_counts(
        &self,
        since: DateTime<Utc>,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError> {
        if interval < Duration::from_micros(1) {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "interval must be at least one microsecond",
            ));
        }
        let since = since.trunc_subsecs(6);
        let step = micros(interval);
        let rows = sqlx::query(&format!(
            "SELECT TIMESTAMPDIFF(MICROSECOND, ?, created_at) DIV ? AS bucket, event_type, \
                    COUNT(*) AS events, \
                    COUNT(CASE WHEN status = 'published' AND ack_destination IS NOT NULL \
                               THEN 1 END) AS published, \
                    COUNT(CASE WHEN status = 'pending' AND created_at < \
                                    UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND \
                               THEN 1 END) AS overdue, \
                    COUNT(CASE WHEN status = 'parked' THEN 1 END) AS parked, \
                    COUNT(CASE WHEN status = 'discarded' THEN 1 END) AS discarded \
             FROM {} WHERE created_at >= ? \
             GROUP BY bucket, event_type ORDER BY bucket, event_type",
            self.inner.tables.events
        ))
        .bind(since.naive_utc())
        .bind(step)
        .bind(micros(grace))
        .bind(since.naive_utc())
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        let n = |r: &MySqlRow, c: &str| -> Result<u64, StoreError> {
            Ok(r.try_get::<i64, _>(c).map_err(db)?.max(0) as u64)
        };
        rows.iter()
            .map(|r| {
                let bucket: i64 = r.try_get("bucket").map_err(db)?;
                let offset = bucket
                    .checked_mul(step)
                    .map(chrono::Duration::microseconds)
                    .and_then(|d| since.checked_add_signed(d))
                    .ok_or_else(|| {
                        StoreError::new(StoreErrorKind::Other, "interval start out of range")
                    })?;
                let mut c = IntervalCount::zero(offset, crate::error::text(r, "event_type")?);
                c.events = n(r, "events")?;
                c.published = n(r, "published")?;
                c.overdue = n(r, "overdue")?;
                c.parked = n(r, "parked")?;
                c.discarded = n(r, "discarded")?;
                Ok(c)
            })
            .collect()
    }

    /// Ids of the events of `event_type` created in `[start, end)`, published to one of
    /// `topics` (any topic when empty) at least `grace` ago: what every consumer of those
    /// topics should have applied. Each entry is (event id, original id for a re-issued copy).
    pub async fn published_ids(
        &self,
        event_type: &str,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        topics: &[String],
        grace: Duration,
    ) -> Result<Vec<(Uuid, Option<Uuid>)>, StoreError> {
        let topic_clause = if topics.is_empty() {
            String::new()
        } else {
            format!(" AND ack_destination IN ({})", marks(topics.len()))
        };
        let sql = format!(
            "SELECT event_id, JSON_UNQUOTE(JSON_EXTRACT(headers, ?)) AS original FROM {} \
             WHERE status = 'published' AND event_type = ? AND created_at >= ? \
               AND created_at < ?{topic_clause} \
               AND published_at < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND",
            self.inner.tables.events
        );
        let mut q = sqlx::query(&sql)
            .bind(format!("$.\"{}\"", outbox_core::wire::ORIGINAL_EVENT_ID))
            .bind(event_type)
            .bind(start.naive_utc())
            .bind(end.naive_utc());
        for topic in topics {
            q = q.bind(topic);
        }
        let rows = q
            .bind(micros(grace))
            .fetch_all(&self.inner.pool)
            .await
            .map_err(db)?;
        rows.iter()
            .map(|r| {
                let id: Uuid = r.try_get("event_id").map_err(db)?;
                let original = crate::error::opt_text(r, "original")?;
                Ok((id, original.and_then(|o| o.parse().ok())))
            })
            .collect()
    }
}

/// The WHERE clause of published events matching `filter`, with its values in order. With
/// both the aggregate's type and id, the rows are found through the aggregate index (its key
/// is a hash of the two; the names are compared too).
fn published_where(filter: &PublishedFilter) -> (String, Vec<Bind>) {
    let mut clauses = vec!["status = 'published'".to_owned()];
    let mut binds = Vec::new();
    if let (Some(t), Some(i)) = (&filter.aggregate_type, &filter.aggregate_id) {
        clauses.push(format!("aggregate_key = {KEY_EXPR}"));
        binds.push(Bind::Text(t.clone()));
        binds.push(Bind::Text(i.clone()));
    }
    for (column, value) in [
        ("aggregate_type", &filter.aggregate_type),
        ("aggregate_id", &filter.aggregate_id),
        ("event_type", &filter.event_type),
    ] {
        if let Some(v) = value {
            clauses.push(format!("{column} = ?"));
            binds.push(Bind::Text(v.clone()));
        }
    }
    if let Some(since) = filter.since {
        clauses.push("created_at >= ?".to_owned());
        binds.push(Bind::Time(since.naive_utc()));
    }
    if let Some(until) = filter.until {
        clauses.push("created_at < ?".to_owned());
        binds.push(Bind::Time(until.naive_utc()));
    }
    (clauses.join(" AND "), binds)
}

fn published_row(r: &MySqlRow) -> Result<PublishedRow, StoreError> {
    let at: NaiveDateTime = r.try_get("finished_at").map_err(db)?;
    Ok(PublishedRow::new(
        PublishedPosition::new(utc(at), r.try_get("id").map_err(db)?),
        envelope_from_row(r)?,
        ack_from_row(r)?.ok_or_else(|| {
            StoreError::new(
                StoreErrorKind::Schema,
                "a published row without an acknowledgement",
            )
        })?,
    ))
}

/// The continuous percentile `p` (thousandths) of `n` ranked values, from the values at the
/// ranks it falls between (`at`, 1-based): rank `1 + p (n - 1) / 1000`, interpolated.
fn percentile(at: &HashMap<i64, f64>, n: i64, p: i64) -> Option<f64> {
    let scaled = p * (n - 1);
    let lo = 1 + scaled / 1000;
    let frac = (scaled % 1000) as f64 / 1000.0;
    let low = *at.get(&lo)?;
    if frac == 0.0 {
        return Some(low);
    }
    let high = *at.get(&(lo + 1))?;
    Some(low + frac * (high - low))
}

/// The reporting role over the reads above (the inherent methods stay for callers that name
/// this store).
#[outbox_core::async_trait]
impl outbox_core::ReportingStore for MySqlOutboxStore {
    async fn backlog(&self) -> Result<outbox_core::OutboxStats, StoreError> {
        outbox_core::MaintenanceStore::stats(self).await
    }
    async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError> {
        MySqlOutboxStore::publish_latency(self, window).await
    }
    async fn flow(&self, window: Duration) -> Result<WindowFlow, StoreError> {
        MySqlOutboxStore::flow(self, window).await
    }
    async fn flows(&self, windows: &[Duration]) -> Result<Vec<WindowFlow>, StoreError> {
        MySqlOutboxStore::flows(self, windows).await
    }
    async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError> {
        MySqlOutboxStore::cleanup_candidates(self, retention).await
    }
    async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError> {
        MySqlOutboxStore::count_published(self, filter).await
    }
    async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError> {
        MySqlOutboxStore::published_events(self, filter, after, limit).await
    }
    async fn interval_counts(
        &self,
        since: DateTime<Utc>,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError> {
        MySqlOutboxStore::interval_counts(self, since, interval, grace).await
    }
    async fn published_ids(
        &self,
        event_type: &str,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        topics: &[String],
        grace: Duration,
    ) -> Result<Vec<outbox_core::PublishedId>, StoreError> {
        let ids =
            MySqlOutboxStore::published_ids(self, event_type, start, end, topics, grace).await?;
        Ok(ids
            .into_iter()
            .map(|(id, original)| {
                outbox_core::PublishedId::new(
                    outbox_core::EventId::from_uuid(id),
                    original.map(outbox_core::EventId::from_uuid),
                )
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The interpolation matches PostgreSQL's `percentile_cont` on known sets.
    #[test]
    fn percentiles_interpolate_between_ranks() {
        let ranked = |vals: &[f64]| -> HashMap<i64, f64> {
            vals.iter()
                .enumerate()
                .map(|(i, v)| (i as i64 + 1, *v))
                .collect()
        };
        let one = ranked(&[4.0]);
        assert_eq!(percentile(&one, 1, 500), Some(4.0));
        assert_eq!(percentile(&one, 1, 990), Some(4.0));
        let ten = ranked(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]);
        // percentile_cont(0.5) of 1..=10 = 5.5, (0.9) = 9.1, (0.99) = 9.91.
        assert_eq!(percentile(&ten, 10, 500), Some(5.5));
        assert!((percentile(&ten, 10, 900).unwrap() - 9.1).abs() < 1e-9);
        assert!((percentile(&ten, 10, 990).unwrap() - 9.91).abs() < 1e-9);
        let two = ranked(&[0.0, 1.0]);
        assert_eq!(percentile(&two, 2, 500), Some(0.5));
        // A rank the statement did not return is not guessed.
        assert_eq!(percentile(&HashMap::new(), 10, 500), None);
    }

    #[test]
    fn the_filter_binds_what_it_names_in_order() {
        let mut f = PublishedFilter::default();
        let (w, b) = published_where(&f);
        assert_eq!((w.as_str(), b.len()), ("status = 'published'", 0));
        f.aggregate_type = Some("order".into());
        f.aggregate_id = Some("o-1".into());
        f.until = Some(Utc::now());
        let (w, b) = published_where(&f);
        assert_eq!(
            w,
            format!(
                "status = 'published' AND aggregate_key = {KEY_EXPR} AND aggregate_type = ? \
                 AND aggregate_id = ? AND created_at < ?"
            )
        );
        assert_eq!(b.len(), 5);
        assert!(matches!(&b[0], Bind::Text(t) if t == "order"));
        assert!(matches!(&b[4], Bind::Time(_)));
    }
}
