//! Aggregate state under its lock: the state rows (`<table>_aggregate`), their row locks, the
//! aggregate's head, and the unblocking of the rows that became candidates again.
//!
//! An aggregate's state row is its lock: every writer of its delivery state locks the row
//! (`FOR UPDATE`, or `FOR UPDATE SKIP LOCKED` in claims) and reads what it decides on in a
//! later statement (READ COMMITTED: a new snapshot per statement, taken after the lock).

use std::collections::HashMap;

use sqlx::{MySqlConnection, Row};

use outbox_core::StoreError;

use super::MySqlOutboxStore;
use crate::error::{db, is_duplicate};

/// An aggregate key (SHA-256 of type, U+001F, id; computed by the server).
pub(crate) type Key = Vec<u8>;

/// Lower-case hex of `bytes` (an aggregate key in a JSON document; `UNHEX` reads it back).
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A row's `claim_token` when no lease claim holds it (16 zero bytes), as SQL.
pub(crate) const NO_TOKEN: &str = "X'00000000000000000000000000000000'";

/// `?, ?, ...` for `n` values.
pub(crate) fn marks(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// Values per `IN` list of [`in_list`]: below MariaDB's `in_predicate_conversion_threshold`
/// (1,000 by default).
const IN_CHUNK: usize = 500;

/// `column IN (?, ...)` for `n` values, as a disjunction of lists of at most [`IN_CHUNK`]
/// values (placeholders in the same order). MariaDB turns an `IN` list of 1,000 values or more
/// into a join with a materialized table of the values: a semi-join in a multi-table `UPDATE`,
/// and in a `SELECT` of a claim batch's candidates a temporary table and a sort of the
/// selected rows, envelopes included, that cost that statement about a fifth of its time
/// (`BENCHMARKS.md`, sixth pass). Shorter lists stay ranges of the index, read in its order.
pub(crate) fn in_list(column: &str, n: usize) -> String {
    if n <= IN_CHUNK {
        return format!("{column} IN ({})", marks(n));
    }
    let lists: Vec<String> = (0..n)
        .step_by(IN_CHUNK)
        .map(|i| format!("{column} IN ({})", marks(IN_CHUNK.min(n - i))))
        .collect();
    format!("({})", lists.join(" OR "))
}

/// Fewest consecutive values [`id_set`] writes as a range.
const RUN_MIN: usize = 3;

/// `column` restricted to the values of `ids` (any order, duplicates allowed), and the values
/// to bind in order: runs of at least [`RUN_MIN`] consecutive values as `BETWEEN` ranges, the
/// other values as [`in_list`]. The same set of rows as `column IN (ids)`; a claim's rows are
/// mostly runs of consecutive ids, and a range reads them in one descent of the primary key
/// instead of one per value (the candidates' read and the lease `UPDATE` of a batch of
/// 1,000 took about half the server time, `BENCHMARKS.md`, seventh pass).
pub(crate) fn id_set(column: &str, ids: &[i64]) -> (String, Vec<i64>) {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut ranges: Vec<(i64, i64)> = Vec::new();
    let mut singles: Vec<i64> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        if j + 1 - i >= RUN_MIN {
            ranges.push((sorted[i], sorted[j]));
        } else {
            singles.extend_from_slice(&sorted[i..=j]);
        }
        i = j + 1;
    }
    let mut parts: Vec<String> = ranges
        .iter()
        .map(|_| format!("{column} BETWEEN ? AND ?"))
        .collect();
    let mut values: Vec<i64> = ranges.iter().flat_map(|(a, b)| [*a, *b]).collect();
    if !singles.is_empty() {
        parts.push(in_list(column, singles.len()));
        values.extend(singles);
    }
    let sql = match parts.len() {
        0 => "FALSE".to_string(),
        1 => parts.pop().unwrap_or_default(),
        _ => format!("({})", parts.join(" OR ")),
    };
    (sql, values)
}

/// The first unfinished row of an aggregate above its last version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Head {
    pub(crate) id: i64,
    pub(crate) version: i64,
    pub(crate) parked: bool,
    pub(crate) blocked: bool,
    /// Pending, and a pending row of its aggregate at or below its version (normally the
    /// head itself) is under a live lease claim: it carries a claim token and is not due
    /// before the lease ends (`next_attempt_at`, on the database clock).
    pub(crate) leased: bool,
}

/// A state row as the claim's locking read returned it (under the row's lock, so current until
/// the transaction ends).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct StateRow {
    /// `last_version`.
    pub(crate) last: Option<i64>,
    /// The row a relay of the previous version leased there (live or expired).
    pub(crate) legacy_lease_row: Option<i64>,
    /// That lease is live on the database clock, as read by the locking read (a lease that
    /// ends later in the claim counts as live: the claim waits for it).
    pub(crate) legacy_leased: bool,
}

/// An aggregate's delivery state as read after its lock.
#[derive(Clone, Debug)]
pub(crate) struct AggView {
    /// The last version the version rule counts from: `last`, or for an aggregate without one
    /// 0 (its first event must be version 1) or, with `accept_first_version`, one below its
    /// first version: its lowest unfinished version that may have been sent already, or else
    /// its lowest unfinished version.
    pub(crate) last_eff: i64,
    /// The state row's `last_version` as read (the completion moves it from there).
    pub(crate) last: Option<i64>,
    /// A live lease on the aggregate (the database clock says it has not expired): a pending
    /// row at or below its head's version carries a live claim token, or its state row a live lease of a relay of the previous
    /// version (which kept the lease there; a rolling upgrade).
    pub(crate) leased: bool,
    /// The row a relay of the previous version leased in the state row (live or expired):
    /// a claim of this version that takes the row over clears that lease, which fences the
    /// old relay's completion.
    pub(crate) legacy_lease_row: Option<i64>,
    /// The head: first unfinished (pending or parked) row above `last_eff` in (version, id).
    pub(crate) head: Option<Head>,
}

impl MySqlOutboxStore {
    /// Creates the missing state rows of `keys` (`ids`: event rows of those aggregates, where
    /// the type and id come from). New rows are locked by this transaction; an existing row is
    /// neither read with a lock nor waited for. A row inserted concurrently by another
    /// transaction is waited for (inserts happen in short transactions only) and then taken
    /// as existing.
    pub(crate) async fn ensure_state_rows(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
    ) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let t = &self.inner.tables;
        let sql = format!(
            "INSERT INTO {state} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
             SELECT e.aggregate_key, MIN(e.aggregate_type), MIN(e.aggregate_id), \
                    UTC_TIMESTAMP(6) \
             FROM {events} e \
             WHERE {} \
               AND NOT EXISTS (SELECT 1 FROM {state} a WHERE a.aggregate_key = e.aggregate_key) \
             GROUP BY e.aggregate_key",
            in_list("e.id", ids.len()),
            state = t.state,
            events = t.events,
        );
        // Each duplicate is a row another transaction committed meanwhile, which the next
        // attempt sees as existing: one attempt per aggregate (at most one per row) and one
        // more end it, however many other claims create these rows at the same time.
        let attempts = ids.len() + 1;
        for attempt in 1..=attempts {
            let mut q = sqlx::query(&sql);
            for id in ids {
                q = q.bind(id);
            }
            match q.execute(&mut *conn).await {
                Ok(_) => return Ok(()),
                // Another transaction inserted one of them meanwhile: the statement was rolled
                // back alone; the next attempt sees that row as existing.
                Err(e) if is_duplicate(&e) && attempt < attempts => continue,
                Err(e) => return Err(db(e)),
            }
        }
        Ok(())
    }

    /// Locks the state rows of `keys` that no other transaction holds; returns those locked,
    /// each with what the claim decides on from it ([`StateRow`]). The locking read returns
    /// the latest committed version of each row it locks, and every writer of a state row
    /// locks it first, so what it returns stays current while this transaction holds the
    /// lock: the claim's later statements need not read the state rows again (a join of
    /// 1,000 state rows by their 32-byte key cost the candidates' read about a third of its
    /// server time, `BENCHMARKS.md`, seventh pass).
    pub(crate) async fn try_lock(
        &self,
        conn: &mut MySqlConnection,
        keys: &[Key],
    ) -> Result<Vec<(Key, StateRow)>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT aggregate_key, last_version, lease_row, \
                    COALESCE(lease_until > UTC_TIMESTAMP(6), 0) AS leased \
             FROM {} WHERE {} \
             ORDER BY aggregate_key FOR UPDATE SKIP LOCKED",
            self.inner.tables.state,
            in_list("aggregate_key", keys.len())
        );
        let mut q = sqlx::query(&sql);
        for k in keys {
            q = q.bind(k);
        }
        let rows = q.fetch_all(conn).await.map_err(db)?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get::<Vec<u8>, _>("aggregate_key").map_err(db)?,
                    StateRow {
                        last: r.try_get("last_version").map_err(db)?,
                        legacy_lease_row: r.try_get("lease_row").map_err(db)?,
                        legacy_leased: r.try_get::<i64, _>("leased").map_err(db)? != 0,
                    },
                ))
            })
            .collect()
    }

    /// Locks the state rows of `keys` (creating missing ones from `(key, type, id)`), waiting
    /// for other holders, in key order (so two lockers of the same keys never deadlock).
    pub(crate) async fn lock_keys(
        &self,
        conn: &mut MySqlConnection,
        aggregates: &[(Key, String, String)],
    ) -> Result<(), StoreError> {
        let mut sorted: Vec<&(Key, String, String)> = aggregates.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        sorted.dedup_by(|a, b| a.0 == b.0);
        for (key, agg_type, agg_id) in sorted {
            // Creates the row or locks the existing one (an upsert takes the row's lock).
            sqlx::query(&format!(
                "INSERT INTO {} (aggregate_key, aggregate_type, aggregate_id, updated_at) \
                 VALUES (?, ?, ?, UTC_TIMESTAMP(6)) \
                 ON DUPLICATE KEY UPDATE aggregate_key = aggregate_key",
                self.inner.tables.state
            ))
            .bind(key)
            .bind(agg_type)
            .bind(agg_id)
            .execute(&mut *conn)
            .await
            .map_err(db)?;
        }
        Ok(())
    }

    /// The state of `keys` (locked by this transaction), read in a statement after the locks.
    ///
    /// One statement: the state rows and, for each, its first pending and first parked row
    /// above the last version (two correlated probes of `aggregate_idx`, each row packed as a
    /// `JSON_ARRAY` of id, version, blocked; the parked one only when the table holds a
    /// parked row, see [`parked_row`]). With `accept_first_version` the last version the
    /// rule counts from depends on the unfinished rows, so the heads are probed in a second
    /// statement ([`Self::heads`]).
    pub(crate) async fn views(
        &self,
        conn: &mut MySqlConnection,
        keys: &[Key],
    ) -> Result<HashMap<Key, AggView>, StoreError> {
        if keys.is_empty() {
            return Ok(HashMap::new());
        }
        let t = &self.inner.tables;
        let accept_first = self.inner.settings.accept_first_version;
        // The lowest unfinished version, for aggregates without a last version (one probe of
        // the aggregate index per status).
        // A version that may have been sent already (`maybe_delivered`, or the row of a lease
        // that ended without an outcome or a release) is the first for good: a lower version
        // committed later would reach consumers after it, so it is out of order.
        let extra = if accept_first {
            format!(
                "(SELECT MIN(u.aggregate_version) FROM {e} u \
                  WHERE u.aggregate_key = a.aggregate_key AND u.status = 'pending') AS min_pending, \
                 (SELECT MIN(u.aggregate_version) FROM {e} u \
                  WHERE u.aggregate_key = a.aggregate_key AND u.status = 'parked') AS min_parked, \
                 (SELECT MIN(u.aggregate_version) FROM {e} u \
                  WHERE u.aggregate_key = a.aggregate_key AND u.status IN ('pending', 'parked') \
                    AND (u.maybe_delivered = 1 OR u.id = a.lease_row \
                         OR (u.status = 'pending' AND u.claim_token <> {NO_TOKEN}))) AS min_sent, \
                 NULL AS pending_head, NULL AS parked_head",
                e = t.events
            )
        } else {
            format!(
                "NULL AS min_pending, NULL AS min_parked, NULL AS min_sent, \
                 {} AS pending_head, {} AS parked_head",
                first_row(
                    &t.events,
                    "pending",
                    "a.aggregate_key",
                    "COALESCE(a.last_version, 0)"
                ),
                parked_row(&t.events, "a.aggregate_key", "COALESCE(a.last_version, 0)"),
            )
        };
        let sql = format!(
            "SELECT a.aggregate_key, a.last_version, a.lease_row, \
                    COALESCE(a.lease_until > UTC_TIMESTAMP(6), 0) AS leased, \
                    {extra} \
             FROM {} a WHERE {}",
            t.state,
            in_list("a.aggregate_key", keys.len())
        );
        let mut q = sqlx::query(&sql);
        for k in keys {
            q = q.bind(k);
        }
        let rows = q.fetch_all(&mut *conn).await.map_err(db)?;
        let mut views: HashMap<Key, AggView> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let key: Vec<u8> = r.try_get("aggregate_key").map_err(db)?;
            let last: Option<i64> = r.try_get("last_version").map_err(db)?;
            let min_pending: Option<i64> = r.try_get("min_pending").map_err(db)?;
            let min_parked: Option<i64> = r.try_get("min_parked").map_err(db)?;
            let min_sent: Option<i64> = r.try_get("min_sent").map_err(db)?;
            let last_eff = match last {
                Some(l) => l,
                None if accept_first => match (min_sent, min_pending, min_parked) {
                    (Some(sent), _, _) => sent - 1,
                    (None, None, None) => 0,
                    (None, a, b) => a.into_iter().chain(b).min().unwrap_or(1) - 1,
                },
                None => 0,
            };
            views.insert(
                key,
                AggView {
                    last_eff,
                    last,
                    leased: r.try_get::<i64, _>("leased").map_err(db)? != 0,
                    legacy_lease_row: r.try_get("lease_row").map_err(db)?,
                    head: head_of(r)?,
                },
            );
        }
        if accept_first {
            let lasts: Vec<(Key, i64)> =
                views.iter().map(|(k, v)| (k.clone(), v.last_eff)).collect();
            for (key, head) in self.heads(conn, &lasts).await? {
                if let Some(v) = views.get_mut(&key) {
                    v.head = Some(head);
                }
            }
        }
        // The lease of lease mode is on the claimed row, which a claim took as the head; the
        // head probe reports it (see `first_row`) even when a late lower-id duplicate or a
        // raised last version has made another row the head since.
        for v in views.values_mut() {
            v.leased |= v.head.as_ref().is_some_and(|h| h.leased);
        }
        Ok(views)
    }

    /// The head of each aggregate above the given last version: its first pending or parked
    /// row in (version, id). Two index probes per aggregate, in one statement.
    pub(crate) async fn heads(
        &self,
        conn: &mut MySqlConnection,
        lasts: &[(Key, i64)],
    ) -> Result<HashMap<Key, Head>, StoreError> {
        Ok(self.probe(conn, lasts, false).await?.0)
    }

    /// The heads, and (with `stale`) the blocked pending rows at or below each last version,
    /// in one statement.
    async fn probe(
        &self,
        conn: &mut MySqlConnection,
        lasts: &[(Key, i64)],
        stale: bool,
    ) -> Result<(HashMap<Key, Head>, Vec<i64>), StoreError> {
        if lasts.is_empty() {
            return Ok((HashMap::new(), Vec::new()));
        }
        let e = &self.inner.tables.events;
        // The aggregates and their last versions as a table (keys in hex). Each aggregate's
        // first pending and first parked row above its last version: two correlated index
        // probes per aggregate (`aggregate_idx`: key, status, then version order, `LIMIT 1`),
        // prepared once, each returning the row's id, version and blocked flag as a
        // `JSON_ARRAY`, where a UNION ALL of one subquery per aggregate and status made the
        // server parse and plan thousands of them per call, and a second statement read the
        // rows by id.
        let json = serde_json::Value::Array(
            lasts
                .iter()
                .map(|(k, last)| serde_json::json!([hex(k), last]))
                .collect(),
        )
        .to_string();
        let table = "JSON_TABLE(?, '$[*]' COLUMNS (k VARCHAR(64) PATH '$[0]', \
                     lv BIGINT PATH '$[1]')) j";
        let mut sql = format!(
            "SELECT 'h' AS part, UNHEX(j.k) AS aggregate_key, {} AS pending_head, \
                    {} AS parked_head, NULL AS stale_id \
             FROM {table}",
            first_row(e, "pending", "UNHEX(j.k)", "j.lv"),
            parked_row(e, "UNHEX(j.k)", "j.lv"),
        );
        // Promotion changes only blocked pending rows: when the table holds none (one probe
        // of `claim_idx`, evaluated once per statement), the statement returns no row and
        // probes nothing. Exact: the check reads the statement's own snapshot, so any blocked
        // row the probes below would return, it sees.
        if stale {
            sql.push_str(&format!(" WHERE {}", any_blocked(e)));
        }
        // With `stale`, the pending rows at or below each last version: an index range that
        // is empty unless a duplicate or late version waits there.
        if stale {
            sql.push_str(&format!(
                " UNION ALL \
                 SELECT 's', u.aggregate_key, NULL, NULL, u.id \
                 FROM {table} JOIN {e} u ON u.aggregate_key = UNHEX(j.k) \
                   AND u.status = 'pending' AND u.aggregate_version <= j.lv \
                   AND u.blocked = 1 \
                 WHERE {}",
                any_blocked(e)
            ));
        }
        let mut q = sqlx::query(&sql).bind(&json);
        if stale {
            q = q.bind(&json);
        }
        let rows = q.fetch_all(conn).await.map_err(db)?;
        let mut heads: HashMap<Key, Head> = HashMap::new();
        let mut below_ids = Vec::new();
        for r in &rows {
            let part: String = crate::error::text(r, "part")?;
            if part == "s" {
                below_ids.push(r.try_get::<i64, _>("stale_id").map_err(db)?);
                continue;
            }
            let key: Vec<u8> = r.try_get("aggregate_key").map_err(db)?;
            if let Some(h) = head_of(r)? {
                heads.insert(key, h);
            }
        }
        Ok((heads, below_ids))
    }

    /// After the last version of these aggregates moved to the given values (under their
    /// locks): unblocks each one's new head, and every pending row at or below its last
    /// version (a duplicate or late version, which the next claim parks as out of order).
    /// Rows are blocked only while an earlier unfinished row exists; every change that can
    /// end that state calls this in the same transaction, so no aggregate is left with only
    /// blocked rows.
    pub(crate) async fn promote(
        &self,
        conn: &mut MySqlConnection,
        lasts: &[(Key, i64)],
    ) -> Result<(), StoreError> {
        if lasts.is_empty() {
            return Ok(());
        }
        let (heads, mut ids) = self.probe(conn, lasts, true).await?;
        ids.extend(
            heads
                .values()
                .filter(|h| !h.parked && h.blocked)
                .map(|h| h.id),
        );
        if ids.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "UPDATE {} SET blocked = 0 WHERE id IN ({}) AND status = 'pending' AND blocked = 1",
            self.inner.tables.events,
            marks(ids.len())
        );
        let mut q = sqlx::query(&sql);
        for id in &ids {
            q = q.bind(id);
        }
        q.execute(conn).await.map_err(db)?;
        Ok(())
    }
}

/// A correlated subquery: the first row of `status` of the aggregate `key` above version
/// `last`, in (version, id), as `JSON_ARRAY(id, version, blocked, leased)` (NULL when none).
///
/// `leased` (pending rows only): a pending row of the aggregate at or below the head's
/// version carries a claim token and is not due yet, the live lease of a lease claim. Not
/// only the head itself: a duplicate of the leased version with a lower id that commits
/// after the claim becomes the head, and an operator's discard of a parked duplicate can
/// raise the last version to the leased one, making the next version the head; in both
/// cases the aggregate is still in flight. One more probe of `aggregate_idx` (the key, the
/// pending rows up to the head's version other than the head: normally none).
fn first_row(events: &str, status: &str, key: &str, last: &str) -> String {
    let leased = if status == "pending" {
        // The head's own lease from the row already read; the other rows up to its version
        // through the index alone (`w.id <> u.id` is in `aggregate_idx`), a row read only for
        // a duplicate or stale row there. The index is forced: on a table without statistics
        // the server chose `claim_idx`, every pending row of the table per aggregate.
        format!(
            "(u.claim_token <> {NO_TOKEN} AND u.next_attempt_at > UTC_TIMESTAMP(6)) \
             OR EXISTS (SELECT 1 FROM {events} w FORCE INDEX (aggregate_idx) \
                      WHERE w.aggregate_key = u.aggregate_key AND w.status = 'pending' \
                        AND w.aggregate_version <= u.aggregate_version AND w.id <> u.id \
                        AND w.claim_token <> {NO_TOKEN} \
                        AND w.next_attempt_at > UTC_TIMESTAMP(6))"
        )
    } else {
        "0".to_string()
    };
    format!(
        "(SELECT JSON_ARRAY(u.id, u.aggregate_version, u.blocked + 0, ({leased}) + 0) \
           FROM {events} u \
           WHERE u.aggregate_key = {key} AND u.status = '{status}' \
             AND u.aggregate_version > {last} \
           ORDER BY u.aggregate_version, u.id LIMIT 1)"
    )
}

/// [`first_row`] for `parked`, probed only when the table holds a parked row at all (an
/// uncorrelated `EXISTS` on `parked_idx`, evaluated once per statement): a table without
/// parked rows, the healthy state, skips one correlated probe per aggregate. Exact: the check
/// reads the statement's own snapshot, so any row the probe would return, it sees.
fn parked_row(events: &str, key: &str, last: &str) -> String {
    format!(
        "CASE WHEN EXISTS (SELECT 1 FROM {events} p WHERE p.status = 'parked') THEN {} END",
        first_row(events, "parked", key, last)
    )
}

/// `EXISTS` a blocked pending row anywhere in the table (one probe of `claim_idx`).
fn any_blocked(events: &str) -> String {
    format!("EXISTS (SELECT 1 FROM {events} b WHERE b.status = 'pending' AND b.blocked = 1)")
}

/// The head of a row carrying `pending_head` and `parked_head` ([`first_row`]): the first of
/// the two in (version, id).
fn head_of(r: &sqlx::mysql::MySqlRow) -> Result<Option<Head>, StoreError> {
    let mut best: Option<Head> = None;
    for (column, parked) in [("pending_head", false), ("parked_head", true)] {
        let Some(text) = crate::error::opt_text(r, column)? else {
            continue;
        };
        let (id, version, blocked, leased): (i64, i64, i64, i64) = serde_json::from_str(&text)
            .map_err(|e| {
                outbox_core::StoreError::new(
                    outbox_core::StoreErrorKind::Other,
                    format!("unexpected head probe result {text:?}: {e}"),
                )
            })?;
        let h = Head {
            id,
            version,
            parked,
            blocked: blocked != 0,
            leased: !parked && leased != 0,
        };
        match &best {
            Some(old) if (old.version, old.id) <= (h.version, h.id) => {}
            _ => best = Some(h),
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same set as `IN (ids)`: every run of three or more consecutive values a range,
    /// the rest one list, one value bound per placeholder.
    #[test]
    fn id_sets_are_ranges_of_runs_and_a_list_of_the_rest() {
        let (sql, v) = id_set("id", &[]);
        assert_eq!((sql.as_str(), v.len()), ("FALSE", 0));
        let (sql, v) = id_set("e.id", &(1..=1000).rev().collect::<Vec<_>>());
        assert_eq!(sql, "e.id BETWEEN ? AND ?");
        assert_eq!(v, vec![1, 1000]);
        let (sql, v) = id_set("id", &[7, 3, 4, 10, 5, 11, 20, 21, 22, 4]);
        assert_eq!(
            sql,
            "(id BETWEEN ? AND ? OR id BETWEEN ? AND ? OR id IN (?, ?, ?))"
        );
        assert_eq!(v, vec![3, 5, 20, 22, 7, 10, 11]);
        // Which values the SQL admits, evaluated here: exactly the input set.
        let ids: Vec<i64> = (0..3000).filter(|i| i % 7 != 0 && i % 11 != 3).collect();
        let (sql, v) = id_set("id", &ids);
        let mut k = 0;
        let mut admitted = std::collections::HashSet::new();
        for part in sql.trim_matches(|c| c == '(' || c == ')').split(" OR ") {
            if part.contains("BETWEEN") {
                admitted.extend(v[k]..=v[k + 1]);
                k += 2;
            } else {
                let n = part.matches('?').count();
                admitted.extend(&v[k..k + n]);
                k += n;
            }
        }
        assert_eq!(k, v.len(), "one value per placeholder");
        assert_eq!(admitted, ids.iter().copied().collect());
    }

    /// One placeholder per value, in order, in lists of at most 500 (MariaDB materializes a
    /// list of 1,000 or more); a short list stays one plain `IN`.
    #[test]
    fn in_lists_are_split_below_the_conversion_threshold() {
        assert_eq!(in_list("id", 1), "id IN (?)");
        assert_eq!(in_list("id", 500), format!("id IN ({})", marks(500)));
        for n in [501, 999, 1000, 1001, 1500, 10_000] {
            let sql = in_list("e.id", n);
            assert!(
                sql.starts_with("(e.id IN (") && sql.ends_with("))"),
                "{n}: {sql}"
            );
            let lists: Vec<&str> = sql[1..sql.len() - 1].split(" OR ").collect();
            assert_eq!(lists.len(), n.div_ceil(500), "{n}");
            let mut total = 0;
            for l in &lists {
                let k = l.matches('?').count();
                assert!(
                    l.starts_with("e.id IN (") && (1..=500).contains(&k),
                    "{n}: {l}"
                );
                total += k;
            }
            assert_eq!(total, n, "{n}: one placeholder per value");
        }
    }
}
