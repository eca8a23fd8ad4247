//! Reporting (the read-only reporting role): the monitoring snapshot.

use std::time::Duration;

use sqlx::Row;

use outbox_core::{ClaimMode, OutboxStats, StoreError};

use super::tx::{begin, begin_snapshot};
use super::MySqlOutboxStore;
use crate::error::db;

/// How many of the oldest due candidates the locked-mode in-flight probe looks at.
const IN_FLIGHT_PROBE: i64 = 10_000;

/// Published rows the stats count exactly; above this many, an estimate (as outbox-postgres).
const PUBLISHED_EXACT_UP_TO: u64 = 10_000;

/// How many of the oldest unblocked pending rows (by id) the stats look at for leases and
/// held version gaps: all of them up to this many (the figures are then exact), else these
/// only (`candidates_probe_limited` 1). Claims take the oldest candidates first, so their
/// leases and the heads they held are among them.
const CANDIDATE_PROBE: i64 = 10_000;

impl MySqlOutboxStore {
    /// The monitoring snapshot, in two statements on one consistent snapshot (a read-only
    /// `REPEATABLE READ` transaction), with the classes of [`OutboxStats`] as outbox-postgres
    /// counts them ([`stats_sql`]). No read grows with the published history:
    ///
    /// * the backlog (`unpublished`, `queued_rows`) is counted through `claim_idx` alone
    ///   (exact; it grows with the backlog only), `parked` through `parked_idx`;
    /// * the published rows are counted up to 10,000 (exact), estimated above (see below);
    /// * the leases and the held version gaps are looked for among the oldest
    ///   [`CANDIDATE_PROBE`] unblocked pending rows by id (the rows claims take first; the
    ///   first statement, [`probe_sql`]): exact while there are no more of them, else counted
    ///   among those only and flagged (`candidates_probe_limited` 1 in `extra`);
    /// * the blocked and gap-held rows are read through their aggregates only (the parked
    ///   heads' and the held heads'), and the oldest claimable age walks `age_idx` from the
    ///   oldest pending row, skipping those;
    /// * the leases of a relay of the version before migration 3 through the state table's
    ///   `lease_token_idx` (rows this version never writes), not the whole state table.
    ///
    /// Ages are measured on the database clock from each row's insertion time (`inserted_at`,
    /// written by the server at append), never from the producer's `created_at`; the parked
    /// age too. `extra` holds `queued_rows` (pending rows a claim took out of the candidates
    /// because an earlier unfinished event of their aggregate comes first) and the table's
    /// size from `information_schema` (`table_bytes`, `index_bytes`, `free_bytes`,
    /// `estimated_rows`), `published_retained_estimated` (1 when the published rows are
    /// more than 10,000 and `published_retained` is estimated from `estimated_rows`), and
    /// `candidates_probe_limited`.
    pub(super) async fn stats_inner(&self) -> Result<OutboxStats, StoreError> {
        let t = &self.inner.tables;
        let mut tx = begin_snapshot(&self.inner.pool).await?;
        let read = async {
            let probed = sqlx::query(&probe_sql(&t.events))
                .bind(CANDIDATE_PROBE)
                .fetch_all(&mut *tx)
                .await
                .map_err(db)?;
            let mut held = Vec::new();
            let mut leased = 0u64;
            for r in &probed {
                if r.try_get::<i64, _>("held").map_err(db)? != 0 {
                    held.push(r.try_get::<i64, _>("id").map_err(db)?);
                }
                if r.try_get::<i64, _>("leased").map_err(db)? != 0 {
                    leased += 1;
                }
            }
            let held = serde_json::to_string(&held)
                .map_err(|e| StoreError::new(outbox_core::StoreErrorKind::Other, e.to_string()))?;
            let sql = stats_sql(
                &t.events,
                &t.state,
                self.inner.settings.accept_first_version,
            );
            let row = sqlx::query(&sql)
                .bind(held)
                .fetch_one(&mut *tx)
                .await
                .map_err(db)?;
            Ok::<_, StoreError>((row, leased))
        }
        .await;
        let _ = tx.rollback().await;
        let (row, probe_leased) = read?;
        let get = |name: &str| -> Result<u64, StoreError> {
            Ok(row.try_get::<i64, _>(name).map_err(db)?.max(0) as u64)
        };
        let age = |name: &str| -> Result<Option<Duration>, StoreError> {
            Ok(row
                .try_get::<Option<i64>, _>(name)
                .map_err(db)?
                .map(|us| Duration::from_micros(us.max(0) as u64)))
        };
        let mut stats = OutboxStats::default();
        stats.unpublished = get("unpublished")?;
        let queued = get("queued")?;
        let leased = probe_leased + get("old_leased")?;
        // Lease mode: live leases on pending rows. Locked mode: those (a relay of the other
        // mode) and the due candidates other transactions hold locked (the claims).
        stats.in_flight = match self.inner.settings.claim_mode {
            ClaimMode::LockedTransaction => leased + self.locked_in_flight().await?,
            _ => leased,
        };
        stats.parked = get("parked")?;
        let published = get("published")?;
        stats.blocked = get("blocked")?;
        stats.gap_held = get("gap_held")?;
        stats.version_gaps_held = get("gaps_held")?;
        stats.oldest_claimable_age = age("oldest_claimable_us")?;
        stats.oldest_blocked_age = age("oldest_blocked_us")?;
        stats.oldest_parked_age = age("oldest_parked_us")?;
        let mut extra = vec![("queued_rows".to_owned(), queued as f64)];
        extra.extend(self.table_extra().await?);
        // Exact up to PUBLISHED_EXACT_UP_TO (the published rows are counted no further:
        // counting them all read the whole status index range, the table's size); above it,
        // the table's rows as InnoDB estimates them (`information_schema`'s `TABLE_ROWS`,
        // from sampled index pages: it can be off by tens of percent) less the unfinished
        // ones, at least the rows counted, flagged in `extra` ("published_retained_estimated"
        // 1), as outbox-postgres does.
        let estimated = published > PUBLISHED_EXACT_UP_TO;
        stats.published_retained = if estimated {
            let rows = extra
                .iter()
                .find(|(k, _)| k == "estimated_rows")
                .map_or(0.0, |(_, v)| v.max(0.0)) as u64;
            rows.saturating_sub(stats.unpublished + stats.parked)
                .max(published)
        } else {
            published
        };
        extra.push((
            "published_retained_estimated".to_owned(),
            if estimated { 1.0 } else { 0.0 },
        ));
        // The unblocked pending rows (the claim candidates) beyond the probe were not looked
        // at for leases and held gaps.
        let limited = stats.unpublished.saturating_sub(queued) > CANDIDATE_PROBE as u64;
        extra.push((
            "candidates_probe_limited".to_owned(),
            if limited { 1.0 } else { 0.0 },
        ));
        stats.extra = extra;
        Ok(stats)
    }

    /// Locked mode: the claims of every relay are row locks, which no view of the server
    /// lists on both MySQL and MariaDB. The probe locks the oldest due candidates with
    /// `SKIP LOCKED` in a transaction it rolls back at once and counts those it could not
    /// lock: rows other transactions hold (the claims; a claim deciding at that instant
    /// counts too). Bounded to the oldest [`IN_FLIGHT_PROBE`] candidates, read through
    /// `claim_idx` as the claim reads them (forced: MariaDB may walk the primary key instead).
    async fn locked_in_flight(&self) -> Result<u64, StoreError> {
        let t = &self.inner.tables;
        let mut tx = begin(&self.inner.pool).await?;
        let counted = async {
            let all: i64 = sqlx::query_scalar(&format!(
                "SELECT COUNT(*) FROM (SELECT id FROM {} FORCE INDEX (claim_idx) \
                   WHERE status = 'pending' AND blocked = 0 \
                     AND next_attempt_at <= UTC_TIMESTAMP(6) ORDER BY id LIMIT ?) x",
                t.events
            ))
            .bind(IN_FLIGHT_PROBE)
            .fetch_one(&mut *tx)
            .await
            .map_err(db)?;
            let free: Vec<i64> = sqlx::query_scalar(&format!(
                "SELECT id FROM {} FORCE INDEX (claim_idx) \
                 WHERE status = 'pending' AND blocked = 0 AND next_attempt_at <= UTC_TIMESTAMP(6) \
                 ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
                t.events
            ))
            .bind(IN_FLIGHT_PROBE)
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
            Ok::<u64, StoreError>((all - free.len() as i64).max(0) as u64)
        }
        .await;
        let _ = tx.rollback().await;
        counted
    }

    async fn table_extra(&self) -> Result<Vec<(String, f64)>, StoreError> {
        let s = &self.inner.settings;
        let row = sqlx::query(
            "SELECT CAST(DATA_LENGTH AS DOUBLE) AS table_bytes, \
                    CAST(INDEX_LENGTH AS DOUBLE) AS index_bytes, \
                    CAST(DATA_FREE AS DOUBLE) AS free_bytes, \
                    CAST(TABLE_ROWS AS DOUBLE) AS estimated_rows \
             FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = ?",
        )
        .bind(s.database.as_deref())
        .bind(&s.table)
        .fetch_optional(&self.inner.pool)
        .await
        .map_err(db)?;
        let mut extra = Vec::new();
        if let Some(row) = row {
            for name in ["table_bytes", "index_bytes", "free_bytes", "estimated_rows"] {
                if let Some(v) = row.try_get::<Option<f64>, _>(name).map_err(db)? {
                    extra.push((name.to_owned(), v));
                }
            }
        }
        Ok(extra)
    }
}

/// The first statement of the stats: among the oldest `?` unblocked pending rows by id (the
/// claim candidates, in the order claims take them; `claim_idx` then each row), those held
/// as a version gap (`held_since`) or under a live lease (this version's: the claim token
/// and `next_attempt_at`, the lease's end), with which of the two. Normally few rows.
fn probe_sql(ev: &str) -> String {
    format!(
        "SELECT x.id, x.held, x.leased FROM ( \
           SELECT p.id, (p.held_since IS NOT NULL) AS held, \
                  (p.claim_token <> {no_token} AND p.next_attempt_at > UTC_TIMESTAMP(6)) \
                    AS leased \
           FROM (SELECT id, held_since, claim_token, next_attempt_at \
                 FROM {ev} FORCE INDEX (claim_idx) \
                 WHERE status = 'pending' AND blocked = 0 ORDER BY id LIMIT ?) p) x \
         WHERE x.held OR x.leased",
        no_token = super::head::NO_TOKEN,
    )
}

/// The second statement of the stats: PostgreSQL's classes (outbox-postgres, `stats_sql`)
/// in MySQL 8 / MariaDB SQL (CTEs and window functions; no `LATERAL`, no `DISTINCT ON`).
/// Its one parameter is the JSON array of the held rows [`probe_sql`] found. Per aggregate,
/// with `last` its last version published or discarded (for an aggregate without one: 0,
/// or with `accept_first_version` one below its lowest unfinished version, as the claim
/// counts):
///
/// * `lp`: its first parked event above `last` (in version, insertion order), from the
///   parked rows (`parked_idx`);
/// * `gh`: its head held as a version gap: a held row of the probe, still pending, above
///   `last + 1`, with no unfinished event above `last` before it (so before `lp`);
///   `version_gaps_held` counts these, one per aggregate;
/// * then each pending event is, by where it stands in its aggregate: **blocked** after `lp`
///   (the parked event itself is not one), **gap-held** from `gh` on (before `lp`), else
///   **claimable**.
///
/// `lp` and `gh` are small (one row per parked or held aggregate) and grouped into one row per
/// aggregate (`b`); only those aggregates' pending rows are read (`c`, through
/// `aggregate_idx`, driven by `b`), which gives the blocked and gap-held counts and the
/// oldest blocked age. The oldest claimable age is the first pending row by insertion time
/// (`age_idx`, once per `blocked` value) that is in neither class: the walk reads at most
/// the blocked and gap-held rows before it. The backlog is counted through `claim_idx` (an
/// index-only range), the published rows up to 10,001, the old version's leases through
/// `lease_token_idx`. (Written as anti-joins on the blocked and gap-held sets over every
/// pending event, MariaDB evaluated them once per pending event: 2.3-2.9 s at 100,000.)
fn stats_sql(ev: &str, st: &str, accept_first_version: bool) -> String {
    let last_of = |x: &str| {
        if accept_first_version {
            format!(
                "COALESCE(a.last_version, (SELECT MIN(m.aggregate_version) - 1 FROM {ev} m \
                   WHERE m.aggregate_key = {x}.aggregate_key \
                     AND m.status IN ('pending', 'parked')))"
            )
        } else {
            "COALESCE(a.last_version, 0)".to_owned()
        }
    };
    // Pending row `e` is blocked or gap-held by its aggregate's row `b`.
    let held_back = "((b.pv IS NOT NULL \
                       AND (e.aggregate_version > b.pv \
                            OR (e.aggregate_version = b.pv AND e.id > b.pid))) \
                      OR (b.gv IS NOT NULL \
                          AND (e.aggregate_version > b.gv \
                               OR (e.aggregate_version = b.gv AND e.id >= b.gid))))";
    let first_claimable = |blocked: u8| {
        format!(
            "(SELECT e.inserted_at AS ia FROM {ev} e FORCE INDEX (age_idx) \
              WHERE e.status = 'pending' AND e.blocked = {blocked} \
                AND NOT EXISTS (SELECT 1 FROM b WHERE b.k = e.aggregate_key AND {held_back}) \
              ORDER BY e.inserted_at LIMIT 1)"
        )
    };
    let age = |expr: &str| format!("TIMESTAMPDIFF(MICROSECOND, MIN({expr}), UTC_TIMESTAMP(6))");
    format!(
        "WITH lp AS ( \
           SELECT x.k, x.v, x.id FROM ( \
             SELECT p.aggregate_key AS k, p.aggregate_version AS v, p.id, \
                    ROW_NUMBER() OVER (PARTITION BY p.aggregate_key \
                                       ORDER BY p.aggregate_version, p.id) AS rn \
             FROM {ev} p LEFT JOIN {st} a ON a.aggregate_key = p.aggregate_key \
             WHERE p.status = 'parked' AND p.aggregate_version > {last_p}) x \
           WHERE x.rn = 1), \
         gh AS ( \
           SELECT g.id, g.k, g.v FROM ( \
             SELECT g.id, g.aggregate_key AS k, g.aggregate_version AS v, {last_g} AS l \
             FROM JSON_TABLE(?, '$[*]' COLUMNS (hid BIGINT PATH '$')) j \
             STRAIGHT_JOIN {ev} g ON g.id = j.hid \
             LEFT JOIN {st} a ON a.aggregate_key = g.aggregate_key \
             WHERE g.status = 'pending' AND g.held_since IS NOT NULL) g \
           WHERE g.v > g.l + 1 \
             AND NOT EXISTS (SELECT 1 FROM {ev} u \
                             WHERE u.aggregate_key = g.k \
                               AND u.status IN ('pending', 'parked') \
                               AND u.aggregate_version > g.l \
                               AND (u.aggregate_version < g.v \
                                    OR (u.aggregate_version = g.v AND u.id < g.id)))), \
         b AS ( \
           SELECT u.k, MAX(u.gv) AS gv, MAX(u.gid) AS gid, MAX(u.pv) AS pv, MAX(u.pid) AS pid \
           FROM (SELECT gh.k, gh.v AS gv, gh.id AS gid, \
                        CAST(NULL AS SIGNED) AS pv, CAST(NULL AS SIGNED) AS pid FROM gh \
                 UNION ALL SELECT lp.k, NULL, NULL, lp.v, lp.id FROM lp) u \
           GROUP BY u.k), \
         c AS ( \
           SELECT e.id, e.inserted_at, b.gid, \
                  CASE WHEN b.pv IS NOT NULL \
                            AND (e.aggregate_version > b.pv \
                                 OR (e.aggregate_version = b.pv AND e.id > b.pid)) THEN 'b' \
                       WHEN b.gv IS NOT NULL \
                            AND (e.aggregate_version > b.gv \
                                 OR (e.aggregate_version = b.gv AND e.id >= b.gid)) THEN 'g' \
                       ELSE 'c' END AS cls \
           FROM b STRAIGHT_JOIN {ev} e ON e.aggregate_key = b.k AND e.status = 'pending') \
         SELECT \
           (SELECT COUNT(*) FROM {ev} WHERE status = 'pending') AS unpublished, \
           (SELECT COUNT(*) FROM {ev} WHERE status = 'pending' AND blocked = 1) AS queued, \
           COUNT(CASE WHEN c.cls = 'b' THEN 1 END) AS blocked, \
           COUNT(CASE WHEN c.cls = 'g' THEN 1 END) AS gap_held, \
           COUNT(CASE WHEN c.id = c.gid THEN 1 END) AS gaps_held, \
           {oldest_blocked} AS oldest_blocked_us, \
           (SELECT TIMESTAMPDIFF(MICROSECOND, MIN(o.ia), UTC_TIMESTAMP(6)) \
              FROM ({first_unblocked} UNION ALL {first_queued}) o) AS oldest_claimable_us, \
           (SELECT COUNT(*) FROM {ev} WHERE status = 'parked') AS parked, \
           (SELECT COUNT(*) FROM (SELECT 1 FROM {ev} WHERE status = 'published' \
              LIMIT {cap}) p) AS published, \
           (SELECT COUNT(*) FROM {st} a JOIN {ev} e ON e.id = a.lease_row \
              WHERE a.lease_token IS NOT NULL AND a.lease_until > UTC_TIMESTAMP(6) \
                AND e.status = 'pending' AND e.blocked = 0 \
                AND e.claim_token = {no_token}) AS old_leased, \
           (SELECT {oldest_parked} FROM {ev} WHERE status = 'parked') AS oldest_parked_us \
         FROM c",
        last_p = last_of("p"),
        last_g = last_of("g"),
        oldest_blocked = age("CASE WHEN c.cls = 'b' THEN c.inserted_at END"),
        first_unblocked = first_claimable(0),
        first_queued = first_claimable(1),
        oldest_parked = age("inserted_at"),
        no_token = super::head::NO_TOKEN,
        cap = PUBLISHED_EXACT_UP_TO + 1,
    )
}
