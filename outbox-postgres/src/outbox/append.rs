//! Append: validation, the backpressure hook, one `INSERT .. SELECT FROM UNNEST`.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{Executor, Postgres, Row};
use uuid::Uuid;

use outbox_core::{Envelope, StoreError, StoreErrorKind};

use super::PostgresOutboxStore;
use crate::error::db;

/// Columns of one append, as arrays for `UNNEST`.
#[derive(Default)]
struct AppendArrays {
    ids: Vec<Uuid>,
    agg_types: Vec<String>,
    agg_ids: Vec<String>,
    versions: Vec<i64>,
    event_types: Vec<String>,
    schema_versions: Vec<i32>,
    content_types: Vec<String>,
    payloads: Vec<Vec<u8>>,
    headers: Vec<String>,
    created: Vec<DateTime<Utc>>,
}

impl PostgresOutboxStore {
    /// Appends one event through any executor (`&mut *tx`, `&mut PgConnection`, `&PgPool`).
    pub async fn append<'e, E>(&self, executor: E, event: &Envelope) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        self.append_many(executor, std::slice::from_ref(event))
            .await
    }

    /// Appends many events in one statement (one round trip, `INSERT .. SELECT FROM UNNEST`).
    ///
    /// Validates every envelope first (a `Validation` error writes nothing), then asks the
    /// [`crate::AppendGuard`] (a `Backpressure` error writes nothing). A duplicate event id is a
    /// `Constraint` error; inside a transaction, that transaction is then aborted.
    ///
    /// Append takes no lock and never waits for a relay. Append an aggregate's events in
    /// version order, each version once, under the aggregate's own row lock (or a conditional
    /// update of its version) in the business transaction: then version N+1 never commits
    /// before N. If it does anyway, the relay holds N+1 until N arrives (and parks it as a
    /// version gap after the store's gap timeout), and parks a version that arrives after a
    /// higher one was published as out of order; it never publishes out of order.
    pub async fn append_many<'e, E>(
        &self,
        executor: E,
        events: &[Envelope],
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        if events.is_empty() {
            return Ok(());
        }
        let s = &self.inner.settings;
        for e in events {
            e.validate(&s.limits)?;
        }
        if let Some(guard) = &s.append_guard {
            guard.check(events)?;
        }
        let (k1, k2) = super::wake_gate::gate_keys(self.inner.seed);
        let gate = s.wake_gate.then_some((k1, k2));
        if let [e] = events {
            return self.append_one(executor, e, gate).await;
        }
        let mut a = AppendArrays::default();
        for e in events {
            a.ids.push(e.event_id.as_uuid());
            a.agg_types.push(e.aggregate_type.clone());
            a.agg_ids.push(e.aggregate_id.clone());
            a.versions.push(e.aggregate_version);
            a.event_types.push(e.event_type.clone());
            a.schema_versions.push(e.schema_version);
            a.content_types.push(e.payload.content_type.clone());
            a.payloads.push(e.payload.bytes.clone());
            a.headers.push(
                serde_json::to_string(&e.headers)
                    .map_err(|err| StoreError::new(StoreErrorKind::Validation, err.to_string()))?,
            );
            a.created.push(e.created_at);
        }
        let blocked = blocked_at_insert(events);
        let row = sqlx::query(&self.inner.sql.append)
            .bind(a.ids)
            .bind(a.agg_types)
            .bind(a.agg_ids)
            .bind(a.versions)
            .bind(a.event_types)
            .bind(a.schema_versions)
            .bind(a.content_types)
            .bind(a.payloads)
            .bind(a.headers)
            .bind(a.created)
            .bind(s.notify_channel.as_deref())
            .bind(gate.map(|g| g.0))
            .bind(gate.map(|g| g.1))
            .bind(blocked)
            .fetch_one(executor)
            .await
            .map_err(db)?;
        self.appended(&row, events.len())
    }

    /// One event: the same row, notification and gate as a batch, from scalars
    /// (`OutboxSql::append_one`; the append alone measured against a bare insert, issue 25).
    async fn append_one<'e, E>(
        &self,
        executor: E,
        e: &Envelope,
        gate: Option<(i32, i32)>,
    ) -> Result<(), StoreError>
    where
        E: Executor<'e, Database = Postgres>,
    {
        let headers = serde_json::to_string(&e.headers)
            .map_err(|err| StoreError::new(StoreErrorKind::Validation, err.to_string()))?;
        let row = sqlx::query(&self.inner.sql.append_one)
            .bind(e.event_id.as_uuid())
            .bind(&e.aggregate_type)
            .bind(&e.aggregate_id)
            .bind(e.aggregate_version)
            .bind(&e.event_type)
            .bind(e.schema_version)
            .bind(&e.payload.content_type)
            .bind(&e.payload.bytes)
            .bind(headers)
            .bind(e.created_at)
            .bind(self.inner.settings.notify_channel.as_deref())
            .bind(gate.map(|g| g.0))
            .bind(gate.map(|g| g.1))
            .fetch_one(executor)
            .await
            .map_err(db)?;
        self.appended(&row, 1)
    }

    /// Reads an append's result row: counts its notification, checks every event was written.
    fn appended(&self, row: &sqlx::postgres::PgRow, events: usize) -> Result<(), StoreError> {
        let n: i64 = row.try_get("n").map_err(db)?;
        let notified: i64 = row.try_get("notified").map_err(db)?;
        self.inner
            .notifies
            .fetch_add(notified as u64, std::sync::atomic::Ordering::Relaxed);
        if n as usize != events {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("appended {n} of {events} events"),
            ));
        }
        Ok(())
    }
}

/// The `blocked` flag each event of one append statement is written with: `true` for an event
/// whose version is above the lowest version of its aggregate in the statement. `None` when no
/// event is (a single event, a batch of distinct aggregates): the statement then binds NULL and
/// writes `false` everywhere, so such an append costs nothing more.
///
/// Why: a batch of one aggregate's versions (issue 25's hot aggregate: 20,000 versions in one
/// `append_many`) used to go in as 20,000 claim candidates, and the first claim to meet a
/// follower moved 19,999 rows into the blocked index in its `blk` step (one non-HOT update per
/// row, 512 ms in one statement), while every other aggregate's events waited for that claim.
/// Written blocked at insert, they are in the blocked index from birth, and the claim's
/// follower, promote and run logic takes them from there as it takes rows a claim blocked.
///
/// Why the claims stay correct (`crate::sql`, the claim's step 2, the completion and the
/// operator actions; the SQL append function inserts one event per call, never blocked):
///
/// * Order never rests on the flag. A claim hands out a head only at `last + 1` and parks a
///   row at or below `last` as out of order; a run is the consecutive versions after a claimed
///   head, read whether blocked or not. The flag only decides which rows a claim's step 1
///   looks at, so a wrong flag could stall an aggregate, never reorder it.
/// * Liveness rests on this invariant, which the claims' `blk` keeps for the rows it blocks:
///   *every blocked pending row has an unfinished (pending or parked) row of its aggregate
///   with a lower (version, id) that is not blocked, or one such chain down to an unblocked
///   one, and the aggregate's lowest blocked row is promoted when that row finishes*. Every
///   way an unblocked unfinished row ends promotes the aggregate's lowest blocked row or
///   leaves another unblocked one: a publication (the completion's `promote`, except when the
///   row after its published prefix got an outcome: the completion unblocks that row, the new
///   head), a discard or a re-issue (`promote_after`; the copy is inserted unblocked), a park
///   as stale or `bad_key` (the claim's `promote`). Parked as a version gap or by the relay, it
///   stays unfinished and the rows after it wait for an operator, as behind any parked head
///   (parking blocks the aggregate): a discard or re-issue promotes, a retry makes it pending
///   again. `blk` blocks only from an aggregate's first follower on, and a follower has an
///   unblocked unfinished row below it above `last`, so the lowest of those stays unblocked.
///   A promoted row is classified again by the next claim (follower, head, stale or gap).
/// * A batch keeps the invariant. Its rows commit together (one statement), and each blocked
///   row's version is strictly above the lowest version of its aggregate in the statement,
///   whose rows are written unblocked: so each blocked row has that unblocked pending row
///   below it in (version, id) whatever ids the statement assigns. For the same reason every
///   row *at* the lowest version stays unblocked (duplicates, e.g. a producer's retry): the
///   claim's follower rule orders them by id, as it does for separate appends. Put another
///   way, the batch's flags are those a claim's `blk` leaves when, right after the commit, it
///   meets the batch's first row above its lowest version as a follower of it (rows of other
///   transactions committing after that claim): a state the claims already produce and
///   handle. The one difference: a lowest version at or below `last` would not have made it
///   a follower; that row is parked as stale and the claim promotes the next.
/// * The lowest version, not the first event, is the one left unblocked: a claim's follower
///   check counts only unblocked rows as predecessors, so in a batch `[v6, v5]` an unblocked
///   v6 would be held as a gap above a blocked v5, then parked.
/// * Other transactions. An earlier version of the aggregate that is pending makes the batch's
///   lowest row a follower: the first claim that meets it blocks it (the rows above it are
///   already blocked and are not written again, unless `blk` marks them `maybe_delivered`). One
///   in flight (a live lease: `wait`; the locked mode's aggregate lock: not a candidate) leaves
///   it a candidate until the completion, whose promote may then unblock a blocked row above
///   it: the next claim blocks that row again or hands it out in order. One parked above
///   `last` makes it a follower, blocked behind the parked row. A batch whose lowest version is
///   stale is parked row by row (each park promotes the next); one whose lowest version skips
///   a version is held, then parked as a gap, with the rest behind it.
/// * `accept_first_version`: an aggregate without state counts from its lowest unfinished
///   version, blocked rows included, so a new batch's lowest row is `last + 1`.
/// * Runs read the rows after the head whether blocked or not. The early claim is a claim like
///   the others (an aggregate whose batch is in flight is leased, `wait`, or locked). The
///   lease's `maybe_delivered` marks (`blk` marks the rows a follower precedes, blocked or
///   not; `mark_run` the rows of a re-claimed head's run) and the stats' `blocked` (events
///   behind a parked event, found from the parked rows) never read the flag. `queued_rows` counts a
///   batch's rows above their head from the append on (before: from the first claim), and
///   they are no longer counted as candidates: both true, they are not claimable.
///
/// One cost moves: a batch whose versions are at or below `last` (a producer replaying
/// published versions) was parked a claim's window at a time; now one row per claim, each
/// promoting the next.
fn blocked_at_insert(events: &[Envelope]) -> Option<Vec<bool>> {
    if events.len() < 2 {
        return None;
    }
    let mut lowest: HashMap<(&str, &str), i64> = HashMap::with_capacity(events.len());
    for e in events {
        lowest
            .entry((e.aggregate_type.as_str(), e.aggregate_id.as_str()))
            .and_modify(|v| *v = (*v).min(e.aggregate_version))
            .or_insert(e.aggregate_version);
    }
    if lowest.len() == events.len() {
        return None;
    }
    let flags: Vec<bool> = events
        .iter()
        .map(|e| {
            e.aggregate_version > lowest[&(e.aggregate_type.as_str(), e.aggregate_id.as_str())]
        })
        .collect();
    flags.iter().any(|&b| b).then_some(flags)
}
