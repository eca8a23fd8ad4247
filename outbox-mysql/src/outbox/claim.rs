//! Claims (the relay's role). One transaction decides, under the aggregates' state-row locks:
//!
//! 1. **Candidates**: pending, unblocked, due rows in id order, `FOR UPDATE SKIP LOCKED`, so
//!    concurrent claims take disjoint candidates and skip rows another claim holds.
//!    Candidates whose aggregate type or id is past [`outbox_core::MAX_AGGREGATE_NAME_BYTES`]
//!    (stored by other means) are parked here, before any state of their aggregate is written.
//! 2. **State rows**: the candidates' aggregates are locked with `FOR UPDATE SKIP LOCKED` (a
//!    busy aggregate is skipped, never waited for); the missing ones are then created (short
//!    inserts) and locked the same way.
//! 3. **Decision**, in statements that start after the locks (READ COMMITTED): each candidate
//!    is claimed, blocked, held, parked or left ([`super::decide`]).
//!
//! Lease mode writes one lease row for the batch (owner, expiry on the database clock) and
//! writes the claim's token into the claimed rows, which it makes due again only when the
//! lease ends (`next_attempt_at`), so other claims' candidate scans pass over them; then
//! commits. No state row is written at claim. Locked mode commits what it
//! decided (parks, holds, blocks) and then, in a second transaction on a connection of its own
//! (the claim's), locks the claimed rows and their aggregates again with SKIP LOCKED, checks
//! each decision again, and keeps that transaction open until the completion. What a locked
//! claim reports as parked is therefore committed, whatever becomes of the claim.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::NaiveDateTime;
use sqlx::{MySqlConnection, Row};
use tracing::warn;
use uuid::Uuid;

use outbox_core::{
    ClaimHandle, ClaimMode, ClaimRequest, ClaimedBatch, ClaimedRecord, Envelope, EventId, ParkKind,
    ParkedAtClaim, StoreError,
};

use super::decide::{decide, Action, Candidate};
use super::head::{id_set, in_list, marks, AggView, Head, Key, StateRow, NO_TOKEN};
use super::rows::{envelope_from_row, ENVELOPE_COLS};
use super::tx::{self, begin, finish, micros, HeldConnection};
use super::MySqlOutboxStore;
use crate::error::db;

/// Rows that `block_followers` locks and blocks per statement: far below the protocol's 65,535
/// placeholders, whatever an aggregate's backlog.
const BLOCK_CHUNK: usize = 5_000;

/// Longest time a version-gap head waits before it is checked again.
const GAP_RECHECK: Duration = Duration::from_secs(1);

/// Most id ranges of its own claims in flight a scan passes over.
const SKIP_RUNS: usize = 8;

/// Fewest consecutive ids in flight worth a range of their own in the scan.
const SKIP_RUN_MIN: usize = 16;

/// Longest a claim of this instance is passed over by its own scans, whatever its lease or
/// hold: the passing over only spares the scan a batch in flight (published and completed in
/// well under a second at 1,000 events), while a claim that ended elsewhere (an operator's
/// release, a locked claim's connection cut) must come back to this instance soon, not after
/// half of a 300 s hold.
const SKIP_MAX_AGE: Duration = Duration::from_secs(5);

/// One claimed row, carried from the claim to its completion.
#[derive(Clone, Debug)]
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) event: Uuid,
    pub(crate) key: Key,
    pub(crate) version: i64,
}

/// A claim of [`ClaimMode::LockedTransaction`]: its connection's transaction holds the locks.
pub(crate) struct LockedClaim {
    pub(crate) held: HeldConnection,
    pub(crate) rows: Vec<ClaimedRow>,
    /// The claimed aggregates' `last_version`, read under the locks this claim still holds
    /// (so still current at its completion).
    pub(crate) lasts: HashMap<Key, Option<i64>>,
    pub(crate) since: Instant,
}

/// A candidate row as scanned.
struct Scanned {
    id: i64,
    key: Key,
    /// Its aggregate type or id is longer than [`outbox_core::MAX_AGGREGATE_NAME_BYTES`].
    unkeyable: bool,
}

/// What one decision round produced.
#[derive(Default)]
struct Decided {
    /// Claimed heads, oldest first, with the record handed out.
    claimed: Vec<(ClaimedRow, ClaimedRecord)>,
    parked: Vec<ParkedAtClaim>,
    gaps_held: usize,
    /// Lease mode: the end of the lease written (the claimed rows' `next_attempt_at`).
    until: Option<NaiveDateTime>,
}

impl MySqlOutboxStore {
    pub(super) async fn claim_inner(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimedBatch, StoreError> {
        let token = Uuid::now_v7();
        let handle = ClaimHandle {
            token,
            owner: request.owner.clone(),
        };
        if request.limit == 0 {
            return Ok(ClaimedBatch::new(handle, Vec::new(), None));
        }
        self.sweep_locked_claims();
        let mode = self.inner.settings.claim_mode;
        let decided = tx::retry_lock_conflicts!(self.claim_round(request, token, mode).await)?;
        let Decided {
            claimed,
            parked,
            gaps_held,
            until,
        } = decided;
        match mode {
            ClaimMode::LockedTransaction => {
                let (held, claimed, lasts) = self.lock_claimed(claimed).await?;
                let (rows, records): (Vec<ClaimedRow>, Vec<ClaimedRecord>) =
                    claimed.into_iter().unzip();
                if let Some(held) = held {
                    self.inner.locked.lock().expect("poisoned").insert(
                        token,
                        LockedClaim {
                            held,
                            rows,
                            lasts,
                            since: Instant::now(),
                        },
                    );
                }
                Ok(
                    ClaimedBatch::new(handle, records, None)
                        .with_version_notices(parked, gaps_held),
                )
            }
            _ => {
                let duration = match mode {
                    ClaimMode::Lease { duration } => Some(duration),
                    _ => None,
                };
                let (rows, records): (Vec<ClaimedRow>, Vec<ClaimedRecord>) =
                    claimed.into_iter().unzip();
                if let (Some(duration), Some(until), false) = (duration, until, rows.is_empty()) {
                    let mut leased = self.inner.leased.lock().expect("poisoned");
                    // Forget claims that were never completed (crashed relay tasks).
                    let horizon = duration * 2 + Duration::from_secs(60);
                    leased.retain(|_, (_, _, at)| at.elapsed() < horizon);
                    leased.insert(token, (rows, until, Instant::now()));
                }
                let remaining = duration.filter(|_| !records.is_empty());
                Ok(ClaimedBatch::new(handle, records, remaining)
                    .with_version_notices(parked, gaps_held))
            }
        }
    }

    /// One claim transaction: scan, lock, decide, write, commit.
    async fn claim_round(
        &self,
        request: &ClaimRequest,
        token: Uuid,
        mode: ClaimMode,
    ) -> Result<Decided, StoreError> {
        let limit = request.limit.min(10_000) as i64;
        let mut tx = begin(&self.inner.pool).await?;
        let result = async {
            let scanned = self.scan(&mut tx, limit).await?;
            if scanned.is_empty() {
                return Ok(Decided::default());
            }
            // Rows past the name bound are parked before any state of their aggregate is
            // written; every row of such an aggregate is one (its names are the same).
            let (unkeyable, scanned): (Vec<Scanned>, Vec<Scanned>) =
                scanned.into_iter().partition(|s| s.unkeyable);
            let parked = self.park_unkeyable(&mut tx, &unkeyable).await?;
            if scanned.is_empty() {
                return Ok(Decided {
                    parked,
                    ..Decided::default()
                });
            }
            let mut keys: Vec<Key> = scanned.iter().map(|s| s.key.clone()).collect();
            keys.sort();
            keys.dedup();
            // The state rows that exist and no other transaction holds are locked at once;
            // the others are missing (created now, locked by their insert) or held elsewhere
            // (skipped by the second lock). A batch of aggregates met before takes one
            // statement here.
            let mut locked: HashMap<Key, StateRow> =
                self.try_lock(&mut tx, &keys).await?.into_iter().collect();
            let missing: Vec<Key> = keys
                .into_iter()
                .filter(|k| !locked.contains_key(k))
                .collect();
            if !missing.is_empty() {
                let ids: Vec<i64> = scanned
                    .iter()
                    .filter(|s| missing.binary_search(&s.key).is_ok())
                    .map(|s| s.id)
                    .collect();
                self.ensure_state_rows(&mut tx, &ids).await?;
                locked.extend(self.try_lock(&mut tx, &missing).await?);
            }
            let ids: Vec<i64> = scanned
                .iter()
                .filter(|s| locked.contains_key(&s.key))
                .map(|s| s.id)
                .collect();
            let mut decided = self
                .decide_and_write(&mut tx, &ids, &locked, request, token, mode)
                .await?;
            decided.parked.splice(0..0, parked);
            Ok(decided)
        }
        .await;
        finish(tx, result).await
    }

    /// Step 1: candidate rows in id order, locked (rows another claim holds are skipped).
    ///
    /// In two statements: the candidates are found by a plain read (no lock), then locked by
    /// primary key, each checked again there (`FOR UPDATE SKIP LOCKED`: the latest committed
    /// version of the row, a row another transaction holds skipped). A single locking scan
    /// (`.. ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`) also locks every row it passes over
    /// and keeps those locks until the claim commits, though the rows are not candidates
    /// (MariaDB 10.11, READ COMMITTED, measured: a row in flight the scan passed over could
    /// not be updated by another transaction until the scan's transaction ended); with the
    /// relay's prefetch the next claim's scan passes over the batch in flight, whose
    /// completion then waited for that claim to commit before it could mark its rows: the
    /// claim and the completion ran one after the other instead of side by side.
    ///
    /// When rows found by the plain read were taken by another claim meanwhile (or changed),
    /// and there may be more candidates than those (a full batch was found), the single
    /// locking scan runs as well, so that concurrent claims still fill their batches with the
    /// rows the others left.
    ///
    /// Both pass over the id ranges of this instance's own claims in flight
    /// ([`Self::own_in_flight`]): their rows are not due (lease mode: not before their lease
    /// ends) or locked by the claim's transaction (locked mode), so the scan would read and
    /// skip each of them; with the relay's prefetch that is a whole batch per claim (1,865
    /// rows examined per 1,000 taken in the sixth pass's profile).
    ///
    /// Both read through `claim_idx` (`status, blocked, id`: the pending unblocked rows in id
    /// order), forced: MariaDB 10.11 planned the plain read as a walk of the primary key in id
    /// order on the status bench's tables (issue 25, 1% pending after the published rows:
    /// 9.9M rows read for 100 candidates, 13 s per claim at 10M rows, 1.2 s at 1M). Through
    /// the index both pass over pending unblocked rows only (not yet due, or taken by another
    /// claim), never over finished or blocked ones, so the locking scan also locks only those
    /// few rows besides its candidates, not whatever precedes them in id order.
    async fn scan(
        &self,
        conn: &mut MySqlConnection,
        limit: i64,
    ) -> Result<Vec<Scanned>, StoreError> {
        let skip = self.own_in_flight();
        let t = &self.inner.tables;
        let max = outbox_core::MAX_AGGREGATE_NAME_BYTES;
        let skip_sql = " AND id NOT BETWEEN ? AND ?".repeat(skip.len());
        let due = "status = 'pending' AND blocked = 0 AND next_attempt_at <= UTC_TIMESTAMP(6)";
        let cols = format!(
            "id, aggregate_key, \
             (LENGTH(aggregate_type) > {max} OR LENGTH(aggregate_id) > {max}) AS unkeyable"
        );
        let locking_scan = format!(
            "SELECT {cols} FROM {} FORCE INDEX (claim_idx) WHERE {due}{skip_sql} \
             ORDER BY id LIMIT ? FOR UPDATE SKIP LOCKED",
            t.events
        );
        let sql = format!(
            "SELECT id FROM {} FORCE INDEX (claim_idx) WHERE {due}{skip_sql} ORDER BY id LIMIT ?",
            t.events
        );
        let mut q = sqlx::query_scalar::<_, i64>(&sql);
        for (first, last) in &skip {
            q = q.bind(first).bind(last);
        }
        let found = q.bind(limit).fetch_all(&mut *conn).await.map_err(db)?;
        if found.is_empty() {
            return Ok(Vec::new());
        }
        // Values, not ranges (`id_set`): a locking range read that skips a row another
        // transaction holds locks the row after the range's end instead.
        let sql = format!(
            "SELECT {cols} FROM {} WHERE {} AND {due} ORDER BY id FOR UPDATE SKIP LOCKED",
            t.events,
            in_list("id", found.len())
        );
        let mut q = sqlx::query(&sql);
        for id in &found {
            q = q.bind(id);
        }
        let rows = q.fetch_all(&mut *conn).await.map_err(db)?;
        let mut locked = scanned(&rows)?;
        if locked.len() < found.len() && found.len() as i64 >= limit {
            // Another claim took some of them: the rows after them, as one locking scan
            // finds them (it returns the rows this transaction already holds too).
            let mut q = sqlx::query(&locking_scan);
            for (first, last) in &skip {
                q = q.bind(first).bind(last);
            }
            let rows = q.bind(limit).fetch_all(&mut *conn).await.map_err(db)?;
            let held: HashSet<i64> = locked.iter().map(|s| s.id).collect();
            locked.extend(
                scanned(&rows)?
                    .into_iter()
                    .filter(|s| !held.contains(&s.id)),
            );
            locked.sort_by_key(|s| s.id);
            locked.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        }
        Ok(locked)
    }

    /// Runs of consecutive ids held by this instance's own claims in flight, for the scan to
    /// pass over: the rows of lease claims taken less than half their lease ago (their
    /// `next_attempt_at` is the lease's end, on the database clock, read before the claim
    /// returned), and of locked claims held less than half of `locked_max_hold` (locked by
    /// their open transaction), in both modes for at most [`SKIP_MAX_AGE`]. Skipping them changes no claim's result, since the scan would
    /// skip them too; a row whose claim ended elsewhere meanwhile (an operator's release) is
    /// left to other relays, or to this one once its claim completes or is released (which
    /// forgets it here) or has aged past the bound. At most [`SKIP_RUNS`] runs, the longest,
    /// each of at least [`SKIP_RUN_MIN`] ids.
    fn own_in_flight(&self) -> Vec<(i64, i64)> {
        let mut ids: Vec<i64> = Vec::new();
        match self.inner.settings.claim_mode {
            ClaimMode::Lease { duration } => {
                let leased = self.inner.leased.lock().expect("poisoned");
                for (rows, _, at) in leased.values() {
                    if at.elapsed() < (duration / 2).min(SKIP_MAX_AGE) {
                        ids.extend(rows.iter().map(|r| r.id));
                    }
                }
            }
            ClaimMode::LockedTransaction => {
                let hold = Duration::from_secs(tx::hold_secs(self.inner.settings.locked_max_hold));
                let locked = self.inner.locked.lock().expect("poisoned");
                for c in locked.values() {
                    if c.since.elapsed() < (hold / 2).min(SKIP_MAX_AGE) {
                        ids.extend(c.rows.iter().map(|r| r.id));
                    }
                }
            }
            _ => {}
        }
        id_runs(ids)
    }

    /// Parks the scanned rows whose aggregate type or id is longer than
    /// [`outbox_core::MAX_AGGREGATE_NAME_BYTES`] (written by other means, or by an earlier
    /// version of this crate, which took up to 65,535 bytes): no store publishes them, so an
    /// event of such an aggregate would be published by this store and refused by another.
    /// They are parked as permanent errors under their own row locks (the scan's), without
    /// any state of their aggregate: every row of the aggregate is parked the same way
    /// whichever claim meets it, and only a discard acts on them. Rows of theirs a previous
    /// version blocked are unblocked, so the next claims park them too.
    async fn park_unkeyable(
        &self,
        conn: &mut MySqlConnection,
        rows: &[Scanned],
    ) -> Result<Vec<ParkedAtClaim>, StoreError> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let t = &self.inner.tables;
        let max = outbox_core::MAX_AGGREGATE_NAME_BYTES;
        let ids: Vec<i64> = rows.iter().map(|s| s.id).collect();
        let sql = format!(
            "UPDATE {} SET status = 'parked', park_kind = 'permanent_error', \
               parked_at = UTC_TIMESTAMP(6), last_error_class = 'permanent', \
               last_error_kind = 'invalid_record', \
               last_error_message = CONCAT('aggregate_type (', LENGTH(aggregate_type), \
                 ' bytes) or aggregate_id (', LENGTH(aggregate_id), ' bytes) is longer than \
{max} bytes, the most a store can key an aggregate by: discard it and append the event again \
under shorter names') \
             WHERE id IN ({}) AND status = 'pending'",
            t.events,
            marks(ids.len())
        );
        let mut q = sqlx::query(&sql);
        for id in &ids {
            q = q.bind(id);
        }
        q.execute(&mut *conn).await.map_err(db)?;
        let mut keys: Vec<&Key> = rows.iter().map(|s| &s.key).collect();
        keys.sort();
        keys.dedup();
        let sql = format!(
            "UPDATE {} SET blocked = 0 \
             WHERE aggregate_key IN ({}) AND status = 'pending' AND blocked = 1",
            t.events,
            marks(keys.len())
        );
        let mut q = sqlx::query(&sql);
        for k in &keys {
            q = q.bind(k);
        }
        q.execute(&mut *conn).await.map_err(db)?;
        let sql = format!(
            "SELECT event_id, aggregate_type, aggregate_id, aggregate_version FROM {} \
             WHERE id IN ({}) AND status = 'parked' ORDER BY id",
            t.events,
            marks(ids.len())
        );
        let mut q = sqlx::query(&sql);
        for id in &ids {
            q = q.bind(id);
        }
        let parked = q.fetch_all(&mut *conn).await.map_err(db)?;
        parked
            .iter()
            .map(|r| {
                let meta = (
                    r.try_get::<Uuid, _>("event_id").map_err(db)?,
                    crate::error::text(r, "aggregate_type")?,
                    crate::error::text(r, "aggregate_id")?,
                    r.try_get::<i64, _>("aggregate_version").map_err(db)?,
                );
                Ok(notice(&meta, ParkKind::PermanentError))
            })
            .collect()
    }

    /// The candidates `ids` (their aggregates' state rows `states` locked by this transaction,
    /// as its locking read returned them), read again in a statement after the locks, with
    /// what tells their aggregates' heads; with `envelopes`, in the same statement, their
    /// envelopes (decoded, or why not, with the event's id, type, id and version).
    ///
    /// For each candidate the statement tells whether it is, alone, its aggregate's head under
    /// no lease (`sole`): pending, unblocked, not under a live token of its own, above the
    /// last version (the state row's, compared here), and no other pending row of its
    /// aggregate at or below its version (a left join on `aggregate_idx`, index only, that
    /// matches nothing in the steady state; a join costs the server much less than a
    /// correlated subquery per row) nor a parked row between the last version and its
    /// version (the highest parked version at or below its own, probed only when the table
    /// holds a parked row, compared with the last version here). Then its aggregate's head is
    /// that candidate (the first unfinished row above the last version in (version, id): any
    /// row before it is pending or parked at or below its version) and no pending row up to
    /// the head's version carries a live token, which is what [`Self::views`] reads with its
    /// probes. Only the aggregates whose first candidate is not `sole` (a duplicate, a stale
    /// or parked row, another live lease; and every aggregate with `accept_first_version`,
    /// whose last version depends on its unfinished rows) are read by [`Self::views`], in one
    /// more statement.
    ///
    /// With `lease`, the same statement also reads the database clock once for a lease of
    /// that duration: its end ([`Read::lease_end`]; `None` only when no candidate was read).
    async fn candidates(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
        states: &HashMap<Key, StateRow>,
        envelopes: bool,
        lease: Option<Duration>,
    ) -> Result<Read, StoreError> {
        if ids.is_empty() {
            return Ok(Read::default());
        }
        let envelope_cols = if envelopes {
            let cols: Vec<String> = ENVELOPE_COLS
                .split(',')
                .map(|c| format!("e.{}", c.trim()))
                .collect();
            format!(", {}", cols.join(", "))
        } else {
            String::new()
        };
        let gap_us = micros(self.inner.settings.gap_timeout);
        let e = &self.inner.tables.events;
        let (id_sql, id_values) = id_set("e.id", ids);
        let sql = format!(
            "SELECT e.id, e.aggregate_key, e.aggregate_version, e.attempts, \
                    UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND AS lease_end, \
                    (e.maybe_delivered = 1 OR e.claim_token <> {NO_TOKEN}) AS sent_before, \
                    (e.status = 'pending' AND e.blocked = 0) AS open, \
                    (e.next_attempt_at <= UTC_TIMESTAMP(6)) AS due, \
                    (e.held_since IS NOT NULL \
                     AND e.held_since <= UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND) AS gap_expired, \
                    (e.status = 'pending' AND e.blocked = 0 \
                     AND (e.claim_token = {NO_TOKEN} OR e.next_attempt_at <= UTC_TIMESTAMP(6)) \
                     AND w.id IS NULL) AS alone, \
                    CASE WHEN EXISTS (SELECT 1 FROM {e} p WHERE p.status = 'parked') \
                    THEN (SELECT MAX(q.aggregate_version) FROM {e} q FORCE INDEX (aggregate_idx) \
                          WHERE q.aggregate_key = e.aggregate_key AND q.status = 'parked' \
                            AND q.aggregate_version <= e.aggregate_version) END AS parked_below \
                    {envelope_cols} \
             FROM {e} e \
             LEFT JOIN {e} w FORCE INDEX (aggregate_idx) ON w.aggregate_key = e.aggregate_key \
               AND w.status = 'pending' AND w.aggregate_version <= e.aggregate_version \
               AND w.id <> e.id \
             WHERE {id_sql} ORDER BY e.id"
        );
        let mut q = sqlx::query(&sql).bind(lease.map_or(0, micros)).bind(gap_us);
        for id in id_values {
            q = q.bind(id);
        }
        let mut rows = q.fetch_all(&mut *conn).await.map_err(db)?;
        let lease_end: Option<NaiveDateTime> = match (lease, rows.first()) {
            (Some(_), Some(r)) => Some(r.try_get("lease_end").map_err(db)?),
            _ => None,
        };
        // A candidate with other pending rows of its aggregate at or below its version comes
        // once per such row (not `sole` in each): once is enough.
        let mut last_id = None;
        rows.retain(|r| {
            let id = r.try_get::<i64, _>("id").ok();
            let first = id != last_id;
            last_id = id;
            first
        });
        let mut decoded = HashMap::new();
        if envelopes {
            for r in &rows {
                let id: i64 = r.try_get("id").map_err(db)?;
                let meta = (
                    r.try_get::<Uuid, _>("event_id").map_err(db)?,
                    crate::error::text(r, "aggregate_type")?,
                    crate::error::text(r, "aggregate_id")?,
                    r.try_get::<i64, _>("aggregate_version").map_err(db)?,
                );
                decoded.insert(id, (envelope_from_row(r).map_err(|e| e.message), meta));
            }
        }
        // Per aggregate, its first candidate in (version, id) and what the statement read.
        let mut firsts: HashMap<Key, ((i64, i64), bool, AggView)> = HashMap::new();
        let mut candidates = Vec::with_capacity(rows.len());
        for r in &rows {
            let flag = |name: &str| -> Result<bool, StoreError> {
                Ok(r.try_get::<Option<i64>, _>(name).map_err(db)?.unwrap_or(0) != 0)
            };
            let c = Candidate {
                id: r.try_get("id").map_err(db)?,
                version: r.try_get("aggregate_version").map_err(db)?,
                open: flag("open")?,
                due: flag("due")?,
                gap_expired: flag("gap_expired")?,
            };
            let key: Key = r.try_get("aggregate_key").map_err(db)?;
            let Some(state) = states.get(&key) else {
                continue;
            };
            let order = (c.version, c.id);
            if firsts.get(&key).is_none_or(|(o, ..)| order < *o) {
                let last_eff = state.last.unwrap_or(0);
                // Above the last version, and no parked row between the last version and it.
                let parked_below: Option<i64> = r.try_get("parked_below").map_err(db)?;
                let sole = flag("alone")?
                    && c.version > last_eff
                    && parked_below.is_none_or(|v| v <= last_eff);
                let view = AggView {
                    last_eff,
                    last: state.last,
                    leased: state.legacy_leased,
                    legacy_lease_row: state.legacy_lease_row,
                    head: Some(Head {
                        id: c.id,
                        version: c.version,
                        parked: false,
                        blocked: false,
                        leased: false,
                    }),
                };
                firsts.insert(key.clone(), (order, sole, view));
            }
            candidates.push((
                c,
                key,
                i64::from(r.try_get::<i32, _>("attempts").map_err(db)?),
                // Sent before: `maybe_delivered`, or the row still carries the token of a
                // lease claim that ended without an outcome or a release.
                flag("sent_before")?,
            ));
        }
        let accept_first = self.inner.settings.accept_first_version;
        let mut views: HashMap<Key, AggView> = HashMap::with_capacity(states.len());
        let mut slow: Vec<Key> = Vec::new();
        for key in states.keys() {
            match firsts.remove(key) {
                Some((_, true, view)) if !accept_first => {
                    views.insert(key.clone(), view);
                }
                _ => slow.push(key.clone()),
            }
        }
        views.extend(self.views(conn, &slow).await?);
        Ok(Read {
            candidates,
            envelopes: decoded,
            views,
            lease_end,
        })
    }

    /// Blocks, per aggregate of `firsts` (its state row locked by this transaction), its first
    /// follower (version, id) and every pending row after it, in the window or not: each has
    /// the same unfinished row before it, so each is a follower too. Blocking only the
    /// window's followers let one aggregate's backlog fill every claim's window one batch at a
    /// time, and an event of another aggregate appended after it waited (issue 25: 10,000
    /// versions of one aggregate kept it out of about 100 claims).
    ///
    /// Never waits: the rows are found by a plain (consistent, non-locking) read through
    /// `aggregate_idx`, then locked by primary key with `SKIP LOCKED` and blocked. An `UPDATE`
    /// driven by the secondary index is a locking read of it, which under READ COMMITTED still
    /// waits on the entry of a business transaction's uncommitted append of the aggregate
    /// (InnoDB's semi-consistent read covers clustered-index scans only), and would hold the
    /// whole claim, every other aggregate of the batch with it, until that transaction ends.
    /// A row this step leaves unblocked (appended since the read, or locked by another
    /// transaction) stays a candidate, and the claim that next sees it decides it a follower.
    async fn block_followers(
        &self,
        conn: &mut MySqlConnection,
        firsts: &HashMap<Key, (i64, i64)>,
    ) -> Result<(), StoreError> {
        let events = &self.inner.tables.events;
        let rows = vec!["SELECT ? AS k, ? AS v, ? AS i"; firsts.len()].join(" UNION ALL ");
        let read = format!(
            "SELECT e.id FROM {events} e JOIN ({rows}) f ON e.aggregate_key = f.k \
             WHERE e.status = 'pending' AND e.blocked = 0 \
               AND (e.aggregate_version > f.v OR (e.aggregate_version = f.v AND e.id >= f.i))"
        );
        let mut q = sqlx::query_scalar::<_, i64>(&read);
        for (key, (version, id)) in firsts {
            q = q.bind(key).bind(version).bind(id);
        }
        let ids = q.fetch_all(&mut *conn).await.map_err(db)?;
        for chunk in ids.chunks(BLOCK_CHUNK) {
            let lock = format!(
                "SELECT id FROM {events} WHERE {} AND status = 'pending' AND blocked = 0 \
                 FOR UPDATE SKIP LOCKED",
                in_list("id", chunk.len())
            );
            let mut q = sqlx::query_scalar::<_, i64>(&lock);
            for id in chunk {
                q = q.bind(id);
            }
            let locked = q.fetch_all(&mut *conn).await.map_err(db)?;
            if locked.is_empty() {
                continue;
            }
            let block = format!(
                "UPDATE {events} SET blocked = 1 WHERE {}",
                in_list("id", locked.len())
            );
            let mut q = sqlx::query(&block);
            for id in &locked {
                q = q.bind(id);
            }
            q.execute(&mut *conn).await.map_err(db)?;
        }
        Ok(())
    }

    /// Step 3: decides on `ids` and writes the decisions (parks, holds, blocks; in lease mode
    /// the leases).
    async fn decide_and_write(
        &self,
        conn: &mut MySqlConnection,
        ids: &[i64],
        states: &HashMap<Key, StateRow>,
        request: &ClaimRequest,
        token: Uuid,
        mode: ClaimMode,
    ) -> Result<Decided, StoreError> {
        let mut out = Decided::default();
        // Per aggregate with a follower, its first follower in (version, id).
        let mut blocks: HashMap<Key, (i64, i64)> = HashMap::new();
        let mut to_claim: Vec<(i64, Key, i64, bool)> = Vec::new();
        let mut notices: Vec<(i64, Action, i64, i64)> = Vec::new();
        // Claimed aggregates whose state row carries a lease of a relay of the previous version.
        let mut legacy: Vec<Key> = Vec::new();
        // The envelopes come with the candidates: the events handed out, and the notices,
        // need them (one read of the rows, after the locks; the decisions below change no
        // envelope column).
        let lease = match mode {
            ClaimMode::Lease { duration } => Some(duration),
            _ => None,
        };
        let Read {
            candidates,
            envelopes: mut rows,
            views,
            lease_end,
        } = self.candidates(conn, ids, states, true, lease).await?;
        for (c, key, attempts, maybe) in candidates {
            let Some(view) = views.get(&key) else {
                continue;
            };
            match decide(&c, view) {
                Action::Claim => {
                    let resend = view.legacy_lease_row == Some(c.id) || maybe;
                    if view.legacy_lease_row.is_some() {
                        legacy.push(key.clone());
                    }
                    to_claim.push((c.id, key, attempts, resend));
                }
                Action::Follower => {
                    let first = blocks.entry(key).or_insert((c.version, c.id));
                    *first = (*first).min((c.version, c.id));
                }
                Action::Stale => {
                    self.park_at_claim(conn, c.id, ParkKind::OutOfOrder, view.last_eff, c.version)
                        .await?;
                    notices.push((c.id, Action::Stale, c.version, view.last_eff));
                }
                Action::GapPark => {
                    self.park_at_claim(conn, c.id, ParkKind::VersionGap, view.last_eff, c.version)
                        .await?;
                    notices.push((c.id, Action::GapPark, c.version, view.last_eff));
                }
                Action::GapHold => {
                    self.hold_gap(conn, c.id, view.last_eff).await?;
                    out.gaps_held += 1;
                }
                Action::Wait => {}
            }
        }
        if !blocks.is_empty() {
            self.block_followers(conn, &blocks).await?;
        }
        for (id, action, ..) in &notices {
            let kind = if *action == Action::Stale {
                ParkKind::OutOfOrder
            } else {
                ParkKind::VersionGap
            };
            if let Some((_, meta)) = rows.get(id) {
                out.parked.push(notice(meta, kind));
            }
        }
        let mut claimed: Vec<(ClaimedRow, ClaimedRecord)> = Vec::new();
        let mut undecodable: Vec<(i64, String, ParkedAtClaim)> = Vec::new();
        for (id, key, attempts, resend) in to_claim {
            let Some((decoded, meta)) = rows.remove(&id) else {
                continue;
            };
            match decoded {
                Ok(envelope) => {
                    let row = ClaimedRow {
                        id,
                        event: envelope.event_id.as_uuid(),
                        key,
                        version: envelope.aggregate_version,
                    };
                    let record = ClaimedRecord::new(envelope, attempts.max(0) as u32)
                        .with_maybe_sent_before(resend);
                    claimed.push((row, record));
                }
                // A stored row that no longer decodes is parked alone: it must not stop the
                // claims of other aggregates.
                Err(why) => undecodable.push((id, why, notice(&meta, ParkKind::PermanentError))),
            }
        }
        for (id, why, n) in undecodable {
            sqlx::query(&format!(
                "UPDATE {} SET status = 'parked', park_kind = 'permanent_error', \
                   parked_at = UTC_TIMESTAMP(6), last_error_class = 'permanent', \
                   last_error_kind = 'invalid_record', last_error_message = ?, \
                   attempts = attempts WHERE id = ? AND status = 'pending'",
                self.inner.tables.events
            ))
            .bind(format!("stored event does not decode: {why}"))
            .bind(id)
            .execute(&mut *conn)
            .await
            .map_err(db)?;
            out.parked.push(n);
        }
        if let Some(until) = lease_end {
            out.until = self
                .write_leases(conn, &claimed, &legacy, request, token, until)
                .await?;
        }
        claimed.sort_by_key(|(r, _)| r.id);
        out.claimed = claimed;
        Ok(out)
    }

    /// Parks a candidate for its version (out of order, or a gap past its timeout).
    async fn park_at_claim(
        &self,
        conn: &mut MySqlConnection,
        id: i64,
        kind: ParkKind,
        last: i64,
        version: i64,
    ) -> Result<(), StoreError> {
        let message = match kind {
            ParkKind::OutOfOrder => format!(
                "version {version} is at or below {last}, the last version published or \
                 discarded for its aggregate"
            ),
            _ => format!(
                "version {version} follows {last}: the versions between did not arrive within \
                 {:?}",
                self.inner.settings.gap_timeout
            ),
        };
        sqlx::query(&format!(
            "UPDATE {} SET status = 'parked', parked_at = UTC_TIMESTAMP(6), park_kind = ?, \
               last_error_class = 'permanent', last_error_kind = ?, last_error_message = ? \
             WHERE id = ? AND status = 'pending'",
            self.inner.tables.events
        ))
        .bind(kind.as_str())
        .bind(kind.as_str())
        .bind(message)
        .bind(id)
        .execute(conn)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// Holds a head that skips a version: checked again within a second, parked once it has
    /// waited the gap timeout (counted from the first hold).
    async fn hold_gap(
        &self,
        conn: &mut MySqlConnection,
        id: i64,
        last: i64,
    ) -> Result<(), StoreError> {
        let gap = self.inner.settings.gap_timeout;
        sqlx::query(&format!(
            "UPDATE {} SET held_since = COALESCE(held_since, UTC_TIMESTAMP(6)), \
               next_attempt_at = LEAST( \
                 COALESCE(held_since, UTC_TIMESTAMP(6)) + INTERVAL ? MICROSECOND, \
                 UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND), \
               last_error_class = 'transient', last_error_kind = 'version_gap', \
               last_error_message = ? \
             WHERE id = ? AND status = 'pending'",
            self.inner.tables.events
        ))
        .bind(micros(gap))
        .bind(micros(gap.min(GAP_RECHECK)))
        .bind(format!(
            "waiting for version {} of the aggregate (the last published or discarded is {last})",
            last + 1
        ))
        .bind(id)
        .execute(conn)
        .await
        .map_err(db)?;
        Ok(())
    }

    /// Lease mode: the batch's lease row (owner, expiry), and the claimed rows made due again
    /// only when their lease ends, carrying the claim's token. No state row is written (a
    /// previous version's lease on one is cleared, see below).
    ///
    /// `until` is the lease's end: one reading of the database clock, taken by the candidates'
    /// read after the locks (in the statement that decided these rows were due), plus the
    /// lease's duration.
    async fn write_leases(
        &self,
        conn: &mut MySqlConnection,
        claimed: &[(ClaimedRow, ClaimedRecord)],
        legacy: &[Key],
        request: &ClaimRequest,
        token: Uuid,
        until: NaiveDateTime,
    ) -> Result<Option<NaiveDateTime>, StoreError> {
        if claimed.is_empty() {
            return Ok(None);
        }
        let t = &self.inner.tables;
        // One reading of the database clock is the lease's end, in the lease row and in the
        // rows' `next_attempt_at`: the rows are due exactly when the lease row has ended, and
        // the completion requires that value on each row (`complete::Fence`). Every other
        // writer of a pending row's `next_attempt_at` (a relay of the previous version taking
        // the row over, then retrying or releasing it; a release by owner) writes a later
        // reading plus a delay, so a row that carries it is still this claim's. The reading is
        // the candidates' (no statement of its own).
        // Statements whatever the batch size, each row found by primary key (the event rows
        // and their aggregates' state rows are all locked by this transaction: nothing else is
        // read or waited for):
        // 1. The batch's lease row: who holds the claim and until when (one short insert).
        // 2. The rows made due again only when their lease ends, with the claim's token: one
        //    constant value each, written in place (`claim_token` is fixed width), so the
        //    update costs what `next_attempt_at` alone did. The token and the lease's end
        //    fence the completion (its marking matches only rows that still carry both): the
        //    next claim of a row whose lease ended overwrites them.
        // 3. Only when a head's earlier lease ended without outcome or release (it may have
        //    been sent): `maybe_delivered` on those rows.
        // 4. Only during a rolling upgrade: the expired leases a relay of the previous version
        //    wrote into the claimed aggregates' state rows are cleared, so that relay's
        //    completion, which checks its token there, applies nothing to the row taken over.
        sqlx::query(&format!(
            "INSERT INTO {} (token, owner, until) VALUES (?, ?, ?)",
            t.lease
        ))
        .bind(token)
        .bind(&request.owner)
        .bind(until)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
        let ids: Vec<i64> = claimed.iter().map(|(r, _)| r.id).collect();
        let (id_sql, id_values) = id_set("id", &ids);
        let sql = format!(
            "UPDATE {} SET next_attempt_at = ?, claim_token = ? WHERE {id_sql}",
            t.events,
        );
        let mut q = sqlx::query(&sql).bind(until).bind(token);
        for id in id_values {
            q = q.bind(id);
        }
        q.execute(&mut *conn).await.map_err(db)?;
        if !legacy.is_empty() {
            let sql = format!(
                "UPDATE {} SET lease_owner = NULL, lease_token = NULL, lease_until = NULL, \
                   lease_row = NULL, updated_at = UTC_TIMESTAMP(6) \
                 WHERE aggregate_key IN ({})",
                t.state,
                marks(legacy.len())
            );
            let mut q = sqlx::query(&sql);
            for k in legacy {
                q = q.bind(k);
            }
            q.execute(&mut *conn).await.map_err(db)?;
        }
        let resent: Vec<i64> = claimed
            .iter()
            .filter(|(_, rec)| rec.maybe_sent_before)
            .map(|(r, _)| r.id)
            .collect();
        if resent.is_empty() {
            return Ok(Some(until));
        }
        let sql = format!(
            "UPDATE {} SET maybe_delivered = 1 WHERE id IN ({})",
            t.events,
            marks(resent.len())
        );
        let mut q = sqlx::query(&sql);
        for id in &resent {
            q = q.bind(id);
        }
        q.execute(conn).await.map_err(db)?;
        Ok(Some(until))
    }

    /// Locked mode, after the decision committed: a transaction of the claim's own that locks
    /// the claimed rows and their aggregates again (skipping any another claim took meanwhile)
    /// and checks each decision again; it stays open until the completion.
    #[allow(clippy::type_complexity)]
    async fn lock_claimed(
        &self,
        claimed: Vec<(ClaimedRow, ClaimedRecord)>,
    ) -> Result<
        (
            Option<HeldConnection>,
            Vec<(ClaimedRow, ClaimedRecord)>,
            HashMap<Key, Option<i64>>,
        ),
        StoreError,
    > {
        if claimed.is_empty() {
            return Ok((None, claimed, HashMap::new()));
        }
        let mut held =
            HeldConnection::begin(&self.inner.pool, self.inner.settings.locked_max_hold).await?;
        match self.relock(held.conn(), claimed).await {
            Ok((kept, _)) if kept.is_empty() => {
                held.end(false).await?;
                Ok((None, kept, HashMap::new()))
            }
            Ok((kept, lasts)) => {
                // A row handed out as possibly sent before (an earlier lease claim of it ended
                // without outcome or release: its token is still on the row) keeps that as
                // `maybe_delivered`, written in this claim's transaction: a park or a retry by
                // this claim commits it (the park made the row non-pending, and an operator's
                // retry then clears the token, so the next claim handed it out as never sent,
                // and under `accept_first_version` a lower version committed later went out
                // after it; adversary_mixed46), a release rolls it back with the rest.
                let resent: Vec<i64> = kept
                    .iter()
                    .filter(|(_, rec)| rec.maybe_sent_before)
                    .map(|(r, _)| r.id)
                    .collect();
                if !resent.is_empty() {
                    let sql = format!(
                        "UPDATE {} SET maybe_delivered = 1 WHERE id IN ({})",
                        self.inner.tables.events,
                        marks(resent.len())
                    );
                    let mut q = sqlx::query(&sql);
                    for id in &resent {
                        q = q.bind(id);
                    }
                    // On error the held connection is dropped (closed): nothing stays locked.
                    q.execute(held.conn()).await.map_err(db)?;
                }
                Ok((Some(held), kept, lasts))
            }
            // Dropping the held connection closes it: nothing stays locked.
            Err(e) => Err(e),
        }
    }

    async fn relock(
        &self,
        conn: &mut MySqlConnection,
        claimed: Vec<(ClaimedRow, ClaimedRecord)>,
    ) -> Result<(Vec<(ClaimedRow, ClaimedRecord)>, HashMap<Key, Option<i64>>), StoreError> {
        let ids: Vec<i64> = claimed.iter().map(|(r, _)| r.id).collect();
        // Values, not ranges (`id_set`): a locking range read that skips a row another
        // transaction holds locks the row after the range's end instead, and this
        // transaction keeps its locks until the claim ends.
        let sql = format!(
            "SELECT id FROM {} WHERE {} ORDER BY id FOR UPDATE SKIP LOCKED",
            self.inner.tables.events,
            in_list("id", ids.len())
        );
        let mut q = sqlx::query_scalar::<_, i64>(&sql);
        for id in &ids {
            q = q.bind(id);
        }
        let rows: HashSet<i64> = q
            .fetch_all(&mut *conn)
            .await
            .map_err(db)?
            .into_iter()
            .collect();
        let mut keys: Vec<Key> = claimed
            .iter()
            .filter(|(r, _)| rows.contains(&r.id))
            .map(|(r, _)| r.key.clone())
            .collect();
        keys.sort();
        keys.dedup();
        let locked: HashMap<Key, StateRow> =
            self.try_lock(conn, &keys).await?.into_iter().collect();
        let ids: Vec<i64> = claimed
            .iter()
            .filter(|(r, _)| rows.contains(&r.id) && locked.contains_key(&r.key))
            .map(|(r, _)| r.id)
            .collect();
        let Read {
            candidates, views, ..
        } = self.candidates(conn, &ids, &locked, false, None).await?;
        let still: HashSet<i64> = candidates
            .into_iter()
            .filter(|(c, key, ..)| {
                views
                    .get(key)
                    .is_some_and(|v| decide(c, v) == Action::Claim)
            })
            .map(|(c, ..)| c.id)
            .collect();
        let lasts = views.iter().map(|(k, v)| (k.clone(), v.last)).collect();
        Ok((
            claimed
                .into_iter()
                .filter(|(r, _)| still.contains(&r.id))
                .collect(),
            lasts,
        ))
    }

    /// Drops locked claims held longer than the server allows (`locked_max_hold`: the server
    /// has closed their sessions), so a relay that never completes nor releases a claim does
    /// not leak its connection here.
    fn sweep_locked_claims(&self) {
        if self.inner.settings.claim_mode != ClaimMode::LockedTransaction {
            return;
        }
        let hold = Duration::from_secs(tx::hold_secs(self.inner.settings.locked_max_hold));
        let expired: Vec<LockedClaim> = {
            let mut locked = self.inner.locked.lock().expect("poisoned");
            let tokens: Vec<Uuid> = locked
                .iter()
                .filter(|(_, c)| c.since.elapsed() > hold)
                .map(|(t, _)| *t)
                .collect();
            tokens.iter().filter_map(|t| locked.remove(t)).collect()
        };
        if !expired.is_empty() {
            warn!(
                claims = expired.len(),
                "dropping locked claims that were neither completed nor released within locked_max_hold"
            );
        }
        // Dropping a held connection closes it; the server rolls back.
        drop(expired);
    }

    /// Number of locked claims held by this store instance (not completed or released).
    #[doc(hidden)]
    pub fn open_locked_claims(&self) -> usize {
        self.inner.locked.lock().expect("poisoned").len()
    }

    /// Test support: ends a locked claim as a crash would (its connection is closed, so the
    /// server rolls it back and its locks go), without the relay calling `complete` or
    /// `release`. Returns `false` when the store holds no such claim.
    #[doc(hidden)]
    pub async fn abandon_locked_claim(&self, claim: &ClaimHandle) -> bool {
        let taken = self
            .inner
            .locked
            .lock()
            .expect("poisoned")
            .remove(&claim.token);
        match taken {
            Some(mut claim) => {
                let id: Option<u64> = sqlx::query_scalar("SELECT CONNECTION_ID()")
                    .fetch_one(claim.held.conn())
                    .await
                    .ok();
                drop(claim);
                // The server ends the session when it sees the socket close; wait until it is
                // gone (and its locks with it), as after a crash.
                if let Some(id) = id {
                    for _ in 0..200 {
                        let alive: Option<i64> = sqlx::query_scalar(
                            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ?",
                        )
                        .bind(id)
                        .fetch_one(&self.inner.pool)
                        .await
                        .ok();
                        if alive == Some(0) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                true
            }
            None => false,
        }
    }
}

/// What [`MySqlOutboxStore::candidates`] read.
#[derive(Default)]
struct Read {
    /// Each candidate, its aggregate, its attempts, and whether it may have been sent before.
    candidates: Vec<(Candidate, Key, i64, bool)>,
    envelopes: Envelopes,
    views: HashMap<Key, AggView>,
    /// Lease mode: the end of a lease taken now (the statement's reading of the database
    /// clock plus the lease's duration).
    lease_end: Option<NaiveDateTime>,
}

/// The event's id, type, id and version, as read with its envelope.
type Meta = (Uuid, String, String, i64);

/// Envelopes by row id, decoded (or why not), with their [`Meta`].
type Envelopes = HashMap<i64, (Result<Envelope, String>, Meta)>;

/// The runs of consecutive values in `ids` (first, last) of at least [`SKIP_RUN_MIN`] values,
/// the [`SKIP_RUNS`] longest, in ascending order.
fn id_runs(mut ids: Vec<i64>) -> Vec<(i64, i64)> {
    ids.sort_unstable();
    ids.dedup();
    let mut runs: Vec<(i64, i64)> = Vec::new();
    for id in ids {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == id => *last = id,
            _ => runs.push((id, id)),
        }
    }
    runs.retain(|(first, last)| last - first + 1 >= SKIP_RUN_MIN as i64);
    runs.sort_by_key(|(first, last)| std::cmp::Reverse(last - first));
    runs.truncate(SKIP_RUNS);
    runs.sort_unstable();
    runs
}

/// The rows of a scan.
fn scanned(rows: &[sqlx::mysql::MySqlRow]) -> Result<Vec<Scanned>, StoreError> {
    rows.iter()
        .map(|r| {
            Ok(Scanned {
                id: r.try_get("id").map_err(db)?,
                key: r.try_get("aggregate_key").map_err(db)?,
                unkeyable: r.try_get::<i64, _>("unkeyable").map_err(db)? != 0,
            })
        })
        .collect()
}

fn notice(meta: &Meta, kind: ParkKind) -> ParkedAtClaim {
    ParkedAtClaim::new(
        EventId::from_uuid(meta.0),
        meta.1.clone(),
        meta.2.clone(),
        meta.3,
        kind,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs of consecutive ids, the short ones left out, at most the longest `SKIP_RUNS`, in
    /// ascending order; nothing else is passed over.
    #[test]
    fn in_flight_ids_become_runs_of_consecutive_ids() {
        assert!(id_runs(Vec::new()).is_empty());
        assert_eq!(id_runs((1..=1000).rev().collect()), vec![(1, 1000)]);
        // Gaps split runs; a run shorter than the minimum is not worth a range.
        let mut ids: Vec<i64> = (100..200).chain(201..230).collect();
        ids.extend([300, 302, 304]);
        ids.extend(400..400 + SKIP_RUN_MIN as i64 - 1);
        ids.extend(500..500 + SKIP_RUN_MIN as i64);
        ids.extend(150..160); // duplicates of a run
        assert_eq!(
            id_runs(ids),
            vec![(100, 199), (201, 229), (500, 500 + SKIP_RUN_MIN as i64 - 1)]
        );
        // Only the longest runs are kept, in id order.
        let mut ids = Vec::new();
        for k in 0..(SKIP_RUNS as i64 + 4) {
            let len = SKIP_RUN_MIN as i64 + k;
            ids.extend(k * 1000..k * 1000 + len);
        }
        let runs = id_runs(ids);
        assert_eq!(runs.len(), SKIP_RUNS);
        assert_eq!(runs[0].0, 4000);
        assert!(runs.windows(2).all(|w| w[0].1 < w[1].0));
        assert!(runs
            .iter()
            .all(|(a, b)| b - a + 1 >= SKIP_RUN_MIN as i64 + 4));
    }
}
