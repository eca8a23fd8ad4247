//! Operator reads and the application's conflict counter: what `outbox status`, `replay`,
//! `reconcile` and the relay daemon's metrics need beyond the [`outbox_core::OutboxStore`]
//! trait. Kept apart from the hot path: nothing here runs in a claim or a completion.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{Executor, Postgres, Row};
use uuid::Uuid;

pub use outbox_core::{
    IntervalCount, LatencySummary, PublishedFilter, PublishedPosition, PublishedRow,
};
use outbox_core::{StoreError, StoreErrorKind, WindowFlow};

use super::claim::micros;
use super::rows::{ack_from_row, envelope_from_row, ACK_COLS};
use super::PostgresOutboxStore;
use crate::error::db;
use crate::schema::qualified;
use crate::sql::ENVELOPE_COLS;

/// A topic's facts as a relay recorded them.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordedTopic {
    /// Topic.
    pub topic: String,
    /// Partition count.
    pub partitions: u32,
    /// Partitioner name.
    pub partitioner: String,
    /// When.
    pub recorded_at: DateTime<Utc>,
}

impl RecordedTopic {
    /// A record.
    pub fn new(topic: impl Into<String>, partitions: u32, partitioner: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            partitions,
            partitioner: partitioner.into(),
            recorded_at: Utc::now(),
        }
    }
}

/// Events created in a `publish_latency` window counted exactly; above this many, estimated
/// from the ids (see [`PostgresOutboxStore::publish_latency`]).
pub(crate) const CREATED_EXACT_UP_TO: u64 = 10_000;

/// The window's first events (by creation time) whose ids place the window's start in the id
/// sequence when the created count is estimated.
const CREATED_FIRST_IDS: u64 = 101;

impl PostgresOutboxStore {
    fn admin_table(&self, suffix: &str) -> String {
        let s = &self.inner.settings;
        qualified(&s.schema, &format!("{}{suffix}", s.table))
    }

    /// Counts one conflict refused by the application's conditional update of an aggregate of
    /// `aggregate_type` (e.g. `UPDATE orders SET version = version + 1 WHERE id = $1 AND
    /// version = $2` changed no row). Run it on the pool or in a transaction that commits, not
    /// in the business transaction that is rolled back. The relay daemon exports the totals as
    /// `outbox_conditional_update_conflicts_total`.
    pub async fn record_conflict<'e, E>(
        &self,
        executor: E,
        aggregate_type: &str,
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        let t = self.admin_table("_conflicts");
        sqlx::query(&format!(
            "INSERT INTO {t} (aggregate_type, refused) VALUES ($1, 1) \
             ON CONFLICT (aggregate_type) DO UPDATE \
             SET refused = {t}.refused + 1, updated_at = now()"
        ))
        .bind(aggregate_type)
        .execute(executor)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// Conflicts counted by [`record_conflict`](Self::record_conflict), per aggregate type.
    pub async fn conflict_counts(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let t = self.admin_table("_conflicts");
        let rows = sqlx::query(&format!(
            "SELECT aggregate_type, refused FROM {t} ORDER BY aggregate_type"
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("aggregate_type").map_err(db)?,
                    r.try_get::<i64, _>("refused").map_err(db)?.max(0) as u64,
                ))
            })
            .collect()
    }

    /// Publish latency percentiles of the events published within `window`, and how many
    /// events were created in it.
    ///
    /// The window's start is a scalar subquery, evaluated once: a bare `clock_timestamp()`
    /// (volatile) in the condition kept the planner from using it as an index bound, so each
    /// call read the whole table (5.5 s at 10M rows, issue 25), and `outbox status` makes
    /// one call per trend point. With the bound, the finished and creation-time indexes read
    /// only the window. No JIT, as in the stats: its compile time is what a large table's
    /// cost estimate bought.
    ///
    /// The read is bounded by [`OutboxSettings::latency_sample`](crate::OutboxSettings):
    /// the window's finished (published or discarded) events are counted through
    /// `finished_idx` alone, and only the latest `latency_sample` of them are read (backwards
    /// along the same index) for the latencies. When the window holds no more than that, the
    /// figures are exact and [`LatencySummary::sample`] is `None`. Otherwise the percentiles
    /// and the largest are those of the sample's published events (`sample` says how many),
    /// and `count` is the exact count of finished events times the sample's share of
    /// published ones (discards are rare; it is exact when the sample holds none). A busy
    /// window thus costs one index range plus `latency_sample` rows, whatever its traffic
    /// (issue 25: 104,000 publications in a 15-minute window at 10M rows a day took
    /// 300-400 ms to read in full).
    ///
    /// The events created in the window are counted through the creation-time index up to
    /// 10,000 ([`LatencySummary::created_estimated`] `false`). Above that the count is
    /// estimated (`created_estimated` `true`) from the ids: the newest id, less the id the
    /// window starts at (the median of `id - rank` over its first 101 events by creation
    /// time, so that a few events whose ids are out of creation order do not move it). The
    /// append takes the id in its statement, so ids follow insertion order; the estimate is
    /// the number of ids issued since the window's start, which counts too many by the ids
    /// that never became rows (appends rolled back, or refused by a unique violation, and
    /// the sequence's jump after a server crash) and by rows deleted since, and is off by
    /// the events whose `created_at` (the producer's clock) is on the other side of the
    /// window's start than their insertion. At 10M rows with 186,000 events created in the
    /// 15-minute window (issue 25, third pass), the exact count walked 186,000 index
    /// entries, 72 ms of the call's 118 ms.
    pub async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError> {
        let t = self.admin_table("");
        let limit = self
            .inner
            .settings
            .latency_sample
            .clamp(1, i64::MAX as usize) as i64;
        let mut tx = self
            .inner
            .pool
            .begin_with(super::maintenance::REPORT_BEGIN)
            .await
            .map_err(db)?;
        let row = sqlx::query(&format!(
            "WITH b AS MATERIALIZED ( \
               SELECT clock_timestamp() - $1::int8 * interval '1 microsecond' AS lo), \
             w AS ( \
               SELECT status = 'published' AS pub, \
                      extract(epoch FROM published_at - created_at)::float8 AS s \
               FROM {t} \
               WHERE status IN ('published', 'discarded') \
                 AND finished_at >= (SELECT lo FROM b) \
               ORDER BY finished_at DESC LIMIT $2), \
             c AS MATERIALIZED ( \
               SELECT count(*) AS n FROM (SELECT FROM {t} \
                 WHERE created_at >= (SELECT lo FROM b) LIMIT {cap}) x) \
             SELECT (SELECT count(*) FROM {t} \
                       WHERE status IN ('published', 'discarded') \
                         AND finished_at >= (SELECT lo FROM b)) AS finished, \
                    count(*) AS read, \
                    count(*) FILTER (WHERE pub) AS n, \
                    percentile_cont(ARRAY[0.5, 0.9, 0.99]::float8[]) \
                      WITHIN GROUP (ORDER BY s) FILTER (WHERE pub) AS pct, \
                    max(s) FILTER (WHERE pub) AS mx, \
                    (SELECT n FROM c) AS created, \
                    (SELECT CASE WHEN c.n >= {cap} THEN \
                       (SELECT max(id) FROM {t}) \
                       - (SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY f.id - f.r) \
                          FROM (SELECT id, row_number() OVER (ORDER BY created_at, id) AS r \
                                FROM (SELECT id, created_at FROM {t} \
                                      WHERE created_at >= (SELECT lo FROM b) \
                                      ORDER BY created_at, id LIMIT {first}) f0) f) END \
                     FROM c) AS created_ids \
             FROM w",
            cap = CREATED_EXACT_UP_TO + 1,
            first = CREATED_FIRST_IDS,
        ))
        .bind(micros(window))
        .bind(limit)
        .fetch_one(&mut *tx)
        .await
        .map_err(db);
        let row = super::claim::finish(tx, row).await?;
        let count = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        let (finished, read, published) = (count("finished")?, count("read")?, count("n")?);
        let pct: Option<Vec<Option<f64>>> = row.try_get("pct").map_err(db)?;
        let at = |i: usize| pct.as_ref().and_then(|p| p.get(i).copied().flatten());
        let mut s = LatencySummary::default();
        s.p50 = at(0);
        s.p90 = at(1);
        s.p99 = at(2);
        s.max = row.try_get("mx").map_err(db)?;
        s.created = count("created")?;
        if s.created > CREATED_EXACT_UP_TO {
            // At least the entries counted, whatever the ids say.
            let ids = row.try_get::<Option<i64>, _>("created_ids").map_err(db)?;
            s.created = ids.map_or(0, |n| n.max(0) as u64).max(s.created);
            s.created_estimated = true;
        }
        if finished <= read {
            // The whole window was read.
            s.count = published;
        } else {
            s.count = if read == published {
                finished
            } else {
                (finished as f64 * published as f64 / read as f64).round() as u64
            };
            s.sample = Some(published);
        }
        Ok(s)
    }

    /// Events created and events finished (published or discarded: both left the backlog)
    /// within `window`, counted through the creation-time and finished indexes alone (an
    /// index-only scan where the pages are all-visible): no row is read for a latency. What
    /// `outbox status` reads per trend point.
    pub async fn flow(&self, window: Duration) -> Result<WindowFlow, StoreError> {
        let t = self.admin_table("");
        let mut tx = self
            .inner
            .pool
            .begin_with(super::maintenance::REPORT_BEGIN)
            .await
            .map_err(db)?;
        let row = sqlx::query(&format!(
            "WITH b AS MATERIALIZED ( \
               SELECT clock_timestamp() - $1::int8 * interval '1 microsecond' AS lo) \
             SELECT (SELECT count(*) FROM {t} WHERE created_at >= (SELECT lo FROM b)) \
                      AS created, \
                    (SELECT count(*) FROM {t} \
                       WHERE status IN ('published', 'discarded') \
                         AND finished_at >= (SELECT lo FROM b)) AS finished"
        ))
        .bind(micros(window))
        .fetch_one(&mut *tx)
        .await
        .map_err(db);
        let row = super::claim::finish(tx, row).await?;
        let count = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        Ok(WindowFlow::new(count("created")?, count("finished")?))
    }

    /// [`flow`](Self::flow) for several windows ending at one "now", in one statement: the
    /// creation-time and finished indexes are read once over the widest window, each entry
    /// put in the bucket of the narrowest window that holds it (`width_bucket` over the
    /// windows' starts), and the windows' counts are the sums of their buckets. `outbox
    /// status` reads one window per trend point (up to 60): one flow each read the newest
    /// part of both indexes that many times over.
    pub async fn flows(&self, windows: &[Duration]) -> Result<Vec<WindowFlow>, StoreError> {
        if windows.is_empty() {
            return Ok(Vec::new());
        }
        let t = self.admin_table("");
        let micros: Vec<i64> = windows
            .iter()
            .map(|w| w.as_micros().min(i64::MAX as u128) as i64)
            .collect();
        // Grouped by sorting the entries read, not hashing them: the planner sizes the hash
        // table by the index range's generic estimate (a third of the table), 3 MB per
        // index to set up even when the windows are empty (8-18 ms at 10M rows, issue 25
        // third pass, against about 1 ms sorted).
        let mut tx = self
            .inner
            .pool
            .begin_with(concat!(
                "BEGIN READ ONLY; SET LOCAL jit = off; ",
                "SET LOCAL max_parallel_workers_per_gather = 0; SET LOCAL enable_hashagg = off"
            ))
            .await
            .map_err(db)?;
        // `los`: the windows' starts, earliest first (the widest window's is `los[1]`); an
        // entry at or after `los[k]` and before `los[k + 1]` is in bucket k: in the k widest
        // windows. An entry before `los[1]` is read by neither range.
        let rows = sqlx::query(&format!(
            "WITH b AS MATERIALIZED ( \
               SELECT array_agg(n.now - u.us * interval '1 microsecond' ORDER BY u.us DESC) \
                        AS los \
               FROM (SELECT clock_timestamp() AS now) n, unnest($1::int8[]) u(us)) \
             SELECT false AS fin, width_bucket(created_at, (SELECT los FROM b)) AS k, \
                    count(*) AS n \
             FROM {t} WHERE created_at >= (SELECT los[1] FROM b) GROUP BY 2 \
             UNION ALL \
             SELECT true, width_bucket(finished_at, (SELECT los FROM b)), count(*) \
             FROM {t} \
             WHERE status IN ('published', 'discarded') \
               AND finished_at >= (SELECT los[1] FROM b) GROUP BY 2"
        ))
        .bind(&micros)
        .fetch_all(&mut *tx)
        .await
        .map_err(db);
        let rows = super::claim::finish(tx, rows).await?;
        // Per bucket (1..=windows), then the k-th widest window's count: buckets k and above.
        let n = windows.len();
        let (mut created, mut finished) = (vec![0u64; n + 1], vec![0u64; n + 1]);
        for r in &rows {
            let k = r.try_get::<i32, _>("k").map_err(db)?.clamp(0, n as i32) as usize;
            let c = r.try_get::<i64, _>("n").map_err(db)?.max(0) as u64;
            if r.try_get::<bool, _>("fin").map_err(db)? {
                finished[k] += c;
            } else {
                created[k] += c;
            }
        }
        for k in (1..n).rev() {
            created[k] += created[k + 1];
            finished[k] += finished[k + 1];
        }
        // The windows by size, widest first (the order of `los`), back to the caller's order.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| micros[b].cmp(&micros[a]));
        let mut out = vec![WindowFlow::default(); n];
        for (rank, &i) in order.iter().enumerate() {
            out[i] = WindowFlow::new(created[rank + 1], finished[rank + 1]);
        }
        Ok(out)
    }

    /// Published and discarded rows that a cleanup with `retention` would remove now.
    pub async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError> {
        let t = self.admin_table("");
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {t} WHERE status IN ('published', 'discarded') \
               AND finished_at < (SELECT clock_timestamp() - $1::int8 * interval '1 microsecond')"
        ))
        .bind(micros(retention))
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(n.max(0) as u64)
    }

    const PUBLISHED_WHERE: &'static str = "status = 'published' \
         AND ($1::text IS NULL OR aggregate_type = $1) \
         AND ($2::text IS NULL OR aggregate_id = $2) \
         AND ($3::text IS NULL OR event_type = $3) \
         AND ($4::timestamptz IS NULL OR created_at >= $4) \
         AND ($5::timestamptz IS NULL OR created_at < $5)";

    /// How many retained published events match `filter`.
    pub async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError> {
        let t = self.admin_table("");
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT count(*) FROM {t} WHERE {}",
            Self::PUBLISHED_WHERE
        ))
        .bind(filter.aggregate_type.as_deref())
        .bind(filter.aggregate_id.as_deref())
        .bind(filter.event_type.as_deref())
        .bind(filter.since)
        .bind(filter.until)
        .fetch_one(&self.inner.pool)
        .await
        .map_err(db)?;
        Ok(n.max(0) as u64)
    }

    /// Up to `limit` retained published events matching `filter` after position `after` (from
    /// the first when `None`), in the order they were published: an aggregate's versions come
    /// in the order the broker got them, also where a lower version committed after a higher
    /// one and was published first (insertion order would send them the other way round).
    /// The order is by publication time (`finished_at`, which a completion sets to the
    /// publication time; an aggregate's next version is only claimed after its previous one's
    /// completion committed, so its time is later), through the index of finished rows.
    pub async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError> {
        let t = self.admin_table("");
        let rows = sqlx::query(&format!(
            "SELECT id, finished_at, {ENVELOPE_COLS}, {ACK_COLS} \
             FROM {t} \
             WHERE {} AND status IN ('published', 'discarded') \
               AND ($6::timestamptz IS NULL OR (finished_at, id) > ($6, $7)) \
             ORDER BY finished_at, id LIMIT $8",
            Self::PUBLISHED_WHERE
        ))
        .bind(filter.aggregate_type.as_deref())
        .bind(filter.aggregate_id.as_deref())
        .bind(filter.event_type.as_deref())
        .bind(filter.since)
        .bind(filter.until)
        .bind(after.map(|p| p.published_at))
        .bind(after.map_or(0, |p| p.seq))
        .bind(limit.clamp(1, 100_000) as i64)
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok(PublishedRow::new(
                    PublishedPosition::new(
                        r.try_get("finished_at").map_err(db)?,
                        r.try_get("id").map_err(db)?,
                    ),
                    envelope_from_row(r)?,
                    ack_from_row(r)?.ok_or_else(|| {
                        StoreError::new(
                            StoreErrorKind::Schema,
                            "a published row without an acknowledgement",
                        )
                    })?,
                ))
            })
            .collect()
    }

    /// Counts per interval of `interval` from `since` to now and per event type: events
    /// created, published (with the broker's offset recorded), pending past `grace`, parked,
    /// discarded.
    pub async fn interval_counts(
        &self,
        since: DateTime<Utc>,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError> {
        if interval.is_zero() {
            return Err(StoreError::new(
                StoreErrorKind::Configuration,
                "interval must be greater than zero",
            ));
        }
        let t = self.admin_table("");
        let rows = sqlx::query(&format!(
            "SELECT date_bin($2::int8 * interval '1 microsecond', created_at, $1) AS start, \
                    event_type, count(*) AS events, \
                    count(*) FILTER (WHERE status = 'published' AND ack_destination IS NOT NULL) \
                      AS published, \
                    count(*) FILTER (WHERE status = 'pending' AND created_at < \
                      clock_timestamp() - $3::int8 * interval '1 microsecond') AS overdue, \
                    count(*) FILTER (WHERE status = 'parked') AS parked, \
                    count(*) FILTER (WHERE status = 'discarded') AS discarded \
             FROM {t} WHERE created_at >= $1 GROUP BY 1, 2 ORDER BY 1, 2"
        ))
        .bind(since)
        .bind(micros(interval))
        .bind(micros(grace))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        let n = |r: &sqlx::postgres::PgRow, c: &str| -> Result<u64, StoreError> {
            Ok(r.try_get::<i64, _>(c).map_err(db)?.max(0) as u64)
        };
        rows.iter()
            .map(|r| {
                let mut c = IntervalCount::zero(
                    r.try_get("start").map_err(db)?,
                    r.try_get::<String, _>("event_type").map_err(db)?,
                );
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
    /// `topics` (topics, streams or exchanges: the acknowledgement's destination; any when
    /// empty) at least `grace` ago: what every consumer of those
    /// topics should have applied. Each entry is (event id, original id for a re-issued copy).
    pub async fn published_ids(
        &self,
        event_type: &str,
        start: DateTime<Utc>,
        end: DateTime<Utc>,
        topics: &[String],
        grace: Duration,
    ) -> Result<Vec<(Uuid, Option<Uuid>)>, StoreError> {
        let t = self.admin_table("");
        let rows = sqlx::query(&format!(
            "SELECT event_id, headers->>'{orig}' AS original FROM {t} \
             WHERE status = 'published' AND event_type = $1 AND created_at >= $2 \
               AND created_at < $3 AND (cardinality($4::text[]) = 0 OR ack_destination = ANY($4)) \
               AND published_at < clock_timestamp() - $5::int8 * interval '1 microsecond'",
            orig = outbox_core::wire::ORIGINAL_EVENT_ID
        ))
        .bind(event_type)
        .bind(start)
        .bind(end)
        .bind(topics)
        .bind(micros(grace))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|r| {
                let id: Uuid = r.try_get("event_id").map_err(db)?;
                let original: Option<String> = r.try_get("original").map_err(db)?;
                Ok((id, original.and_then(|o| o.parse().ok())))
            })
            .collect()
    }

    /// Topic facts recorded by [`record_topics`](Self::record_topics).
    pub async fn recorded_topics(&self) -> Result<Vec<RecordedTopic>, StoreError> {
        let t = self.admin_table("_topics");
        let rows = sqlx::query(&format!(
            "SELECT topic, partitions, partitioner, recorded_at FROM {t} ORDER BY topic"
        ))
        .fetch_all(&self.inner.pool)
        .await
        .map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok(RecordedTopic {
                    topic: r.try_get("topic").map_err(db)?,
                    partitions: r.try_get::<i32, _>("partitions").map_err(db)?.max(1) as u32,
                    partitioner: r.try_get("partitioner").map_err(db)?,
                    recorded_at: r.try_get("recorded_at").map_err(db)?,
                })
            })
            .collect()
    }

    /// Records topic facts (replacing earlier ones of the same topics).
    pub async fn record_topics(&self, topics: &[RecordedTopic]) -> Result<(), StoreError> {
        let t = self.admin_table("_topics");
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        for topic in topics {
            sqlx::query(&format!(
                "INSERT INTO {t} (topic, partitions, partitioner, recorded_at) \
                 VALUES ($1, $2, $3, now()) ON CONFLICT (topic) DO UPDATE \
                 SET partitions = EXCLUDED.partitions, partitioner = EXCLUDED.partitioner, \
                     recorded_at = EXCLUDED.recorded_at"
            ))
            .bind(&topic.topic)
            .bind(topic.partitions.min(i32::MAX as u32) as i32)
            .bind(&topic.partitioner)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        tx.commit().await.map_err(db)?;
        Ok(())
    }

    /// Figures for [`outbox_core::OutboxStats::extra`] that come from this module.
    pub(super) async fn admin_extra(&self) -> Result<Vec<(String, f64)>, StoreError> {
        let mut extra = Vec::new();
        match self.conflict_counts().await {
            Ok(counts) => {
                let total: u64 = counts.iter().map(|(_, n)| n).sum();
                extra.push(("conditional_update_conflicts".to_owned(), total as f64));
            }
            // A schema before migration 4 has no counter table: nothing to report.
            Err(e) if e.kind == StoreErrorKind::Schema => {}
            Err(e) => return Err(e),
        }
        Ok(extra)
    }
}

/// The reporting role over the reads above (the inherent methods stay for callers that name
/// this store).
#[outbox_core::async_trait]
impl outbox_core::ReportingStore for PostgresOutboxStore {
    async fn backlog(&self) -> Result<outbox_core::OutboxStats, StoreError> {
        outbox_core::MaintenanceStore::stats(self).await
    }
    async fn publish_latency(&self, window: Duration) -> Result<LatencySummary, StoreError> {
        PostgresOutboxStore::publish_latency(self, window).await
    }
    async fn flow(&self, window: Duration) -> Result<WindowFlow, StoreError> {
        PostgresOutboxStore::flow(self, window).await
    }
    async fn flows(&self, windows: &[Duration]) -> Result<Vec<WindowFlow>, StoreError> {
        PostgresOutboxStore::flows(self, windows).await
    }
    async fn cleanup_candidates(&self, retention: Duration) -> Result<u64, StoreError> {
        PostgresOutboxStore::cleanup_candidates(self, retention).await
    }
    async fn count_published(&self, filter: &PublishedFilter) -> Result<u64, StoreError> {
        PostgresOutboxStore::count_published(self, filter).await
    }
    async fn published_events(
        &self,
        filter: &PublishedFilter,
        after: Option<PublishedPosition>,
        limit: usize,
    ) -> Result<Vec<PublishedRow>, StoreError> {
        PostgresOutboxStore::published_events(self, filter, after, limit).await
    }
    async fn interval_counts(
        &self,
        since: DateTime<Utc>,
        interval: Duration,
        grace: Duration,
    ) -> Result<Vec<IntervalCount>, StoreError> {
        PostgresOutboxStore::interval_counts(self, since, interval, grace).await
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
            PostgresOutboxStore::published_ids(self, event_type, start, end, topics, grace).await?;
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
